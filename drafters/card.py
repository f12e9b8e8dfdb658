"""The model card (``README.md``) of an export, rendered from its provenance alone.

Every export directory carries one: ours (``drafters/format.py``) and each peer format
(``drafters/peer.py``, ``drafters/sglang.py``). It states the target and verifier, the capture
contract, the training data and budget, the teacher-forced, held-out and live acceptance where
they are known, and the commands that reproduce and serve it. The Hub shows it as the repo's
page (``specray push``); its front matter names the library, the algorithm and, when the
verifier is a Hub id, the base model.

What it reads, all from the export directory:

- ``config.json`` / ``export.json`` (ours) or ``specray_export.json`` (a peer export's record of
  the export it was written from);
- ``evaluation.json``, written by ``specray evaluate`` (``record_evaluation``): the held-out
  teacher-forced metrics (``heldout``) and the live acceptance on the serving engine (``live``);
- ``calibration.json`` (DSpark): the calibration error before and after.

``record_evaluation`` rewrites the card after an evaluation; ``refresh_card`` before a push.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from pathlib import Path

import yaml

CARD_FILE = "README.md"
EVALUATION_FILE = "evaluation.json"
PEER_RECORD = "specray_export.json"  # a peer export's provenance (drafters/peer.py)
HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")  # owner/name

_TITLES = {"eagle3": "EAGLE-3", "dflash": "DFlash", "dspark": "DSpark", "dflash2": "DFlash 2"}


def _read(path: Path) -> dict | None:
    return json.loads(path.read_text()) if path.is_file() else None


def _contract_id(contract: dict) -> str:
    """The contract's id as capture/contract.py computes it (sha256 of its sorted JSON)."""
    return hashlib.sha256(json.dumps(contract, sort_keys=True, separators=(",", ":")).encode()).hexdigest()[:16]


def _fmt(value, digits: int = 3) -> str:
    return f"{value:.{digits}f}" if isinstance(value, float) else str(value)


def _provenance(export_dir: Path) -> tuple[dict, dict, dict | None]:
    """(config.json, export.json, the peer record or None) of the export the card describes."""
    peer = _read(export_dir / PEER_RECORD)
    if peer is not None:
        return peer["source_config"], peer["source_export"], peer
    return json.loads((export_dir / "config.json").read_text()), json.loads((export_dir / "export.json").read_text()), None


def _rows(config: dict, export: dict, peer: dict | None, evaluation: dict, calibration: dict | None) -> list[tuple]:
    arch, contract = config["architecture"], config["capture_contract"]
    rows = [("Algorithm", f"{_TITLES.get(config['algorithm'], config['algorithm'])} (`{config['algorithm']}`), "
                          f"{arch.get('num_layers')} draft layer(s)"
                          + (f", block size {arch['block_size']}" if "block_size" in arch else "")
                          + (f", draft vocabulary {arch['draft_vocab_size']}" if arch.get("draft_vocab_size") else ""))]
    target = export.get("target")
    verifier = (peer or {}).get("verifier")
    rows.append(("Target", f"`{target}`" + (f" (verifier named in the config: `{verifier}`)" if verifier else "")))
    rows.append(("Target fingerprint", f"`{config['target_fingerprint']}`"))
    rows.append(("Template fingerprint", f"`{config['template_fingerprint']}`"))
    rows.append(("Capture contract", f"`{_contract_id(contract)}`: layers {contract.get('layer_ids')} "
                                     f"({contract.get('capture_point')}, of {contract.get('num_target_layers')}), "
                                     f"{contract.get('dtype')} features"
                                     + (", last hidden states" if contract.get("last_hidden") else "")))
    train = export.get("config") or {}
    data = (train.get("data") or {}).get("manifest") or export.get("imported_from")
    if data:
        rows.append(("Data", f"`{data}`" + (f" ({export['samples']} samples)" if export.get("samples") else "")))
    if export.get("step") is not None:
        budget = f"{export['step']} optimizer steps"
        if export.get("tokens_seen"):
            budget += f", {export['tokens_seen']} tokens"
        if export.get("world_size"):
            budget += f", {export['world_size']} rank(s)"
        rows.append(("Training", budget))
    last = export.get("last_metrics") or {}
    if last.get("tau_tf") is not None:
        rows.append(("tau, teacher-forced (training)", f"{_fmt(last['tau_tf'])} at step {last.get('step')}"))
    heldout = evaluation.get("heldout")
    if heldout:
        rows.append(("tau, held-out (teacher-forced)", f"{_fmt(heldout['tau_tf'])} on `{heldout.get('manifest')}` "
                                                       f"({heldout.get('samples')} samples)"))
    live = evaluation.get("live") or (last if last.get("tau_live") is not None else None)
    if live:
        rows.append(("tau, live (serving engine, greedy)",
                     f"{_fmt(live['tau_live'])} on {live.get('live_dataset')} ({live.get('live_prompts')} prompts, "
                     f"{live.get('live_num_speculative_tokens')} drafts per round)"))
    if not heldout and not live:
        rows.append(("tau, held-out and live", "not measured yet (`specray evaluate EXPORT` and "
                                               "`specray evaluate EXPORT --live` record them here)"))
    if calibration:
        rows.append(("Confidence calibration", f"STS, ECE {_fmt(calibration.get('ece_before', float('nan')), 4)} -> "
                                               f"{_fmt(calibration.get('ece_after', float('nan')), 4)}"))
    rows.append(("Parameters", f"{export.get('num_parameters')} (the target's embedding and LM head are shared)"))
    rows.append(("Weights", f"`{export.get('weights_sha256')}`"))
    return rows


def _reproduce(export: dict, peer: dict | None) -> list[str]:
    train = export.get("config")
    lines = ["## Reproduce", ""]
    if export.get("imported_from"):
        lines += [f"Imported from a {export.get('imported_format')} directory:", "", "```bash",
                  f"specray import {export['imported_from']} --out EXPORT --target {export.get('target')}", "```"]
    elif train:
        run_dir = export.get("run_dir") or train.get("output", {}).get("run_dir", "RUN_DIR")
        lines += ["The training run's whole config (`train.yaml`), as export.json records it:", "", "```bash",
                  "specray train -c train.yaml", f"specray export {run_dir}"
                  + (f" --format {peer['format_name']}" if peer else ""), "```", "", "```yaml",
                  yaml.safe_dump(train, sort_keys=False).rstrip(), "```"]
    else:
        lines += ["export.json records no training config (the export was written outside `specray train`)."]
    return lines


def _usage(config: dict, export: dict, peer: dict | None) -> list[str]:
    target = export.get("target")
    if peer is None:
        return ["## Serve", "", "```bash",
                f"specray generate --target {target} --drafter . --prompt \"Hello\"",
                "specray serve -c serve.yaml    # registry: a version published from this directory", "```"]
    return ["## Serve", "", "```bash", *peer.get("serve_commands", []), "```"]


def render_card(export_dir: str | Path) -> str:
    """The card of the export (ours or a peer format) in ``export_dir`` (module doc)."""
    path = Path(export_dir)
    config, export, peer = _provenance(path)
    evaluation = _read(path / EVALUATION_FILE) or {}
    calibration = _read(path / "calibration.json")
    verifier = (peer or {}).get("verifier") or ""
    title = _TITLES.get(config["algorithm"], config["algorithm"])
    front = {"library_name": "specray", "tags": ["speculative-decoding", "specray", config["algorithm"]]}
    if HUB_ID.match(verifier):
        front["base_model"] = verifier
    fmt = peer["format"] if peer else f"specray export format {config.get('format_version')}"
    lines = ["---", yaml.safe_dump(front, sort_keys=False).rstrip(), "---", "",
             f"# {title} drafter for `{export.get('target')}`", "",
             f"A speculative-decoding drafter ({fmt}) trained with specray: the target's features at the "
             "capture contract's layers condition it, and the target verifies its drafts, so the output "
             "is the target's.", "", "| | |", "|---|---|"]
    lines += [f"| {k} | {v} |" for k, v in _rows(config, export, peer, evaluation, calibration)]
    lines += ["", "## Architecture", "", "```json", json.dumps(config["architecture"], indent=2), "```", ""]
    lines += _reproduce(export, peer) + [""] + _usage(config, export, peer) + [""]
    return "\n".join(lines)


def refresh_card(export_dir: str | Path) -> Path:
    """Rewrite ``README.md`` from the directory's current provenance and evaluations (readable by all)."""
    path = Path(export_dir) / CARD_FILE
    tmp = path.with_name(f".{CARD_FILE}.{os.getpid()}.tmp")
    tmp.write_text(render_card(export_dir))
    os.chmod(tmp, 0o644)
    os.replace(tmp, path)
    return path


def record_evaluation(export_dir: str | Path, result: dict) -> Path:
    """Keep ``specray evaluate``'s result in ``evaluation.json`` (held-out teacher-forced metrics
    under ``heldout``, live ones under ``live``, each replaced by a newer one) and refresh the card."""
    path = Path(export_dir) / EVALUATION_FILE
    body = _read(path) or {}
    if "tau_tf" in result:
        body["heldout"] = {k: result[k] for k in ("manifest", "samples", "loss", "acc_by_pos", "tau_tf", "coverage")
                           if k in result}
    if "tau_live" in result:
        body["live"] = {k: v for k, v in result.items() if k.startswith("live_") or k == "tau_live"}
    tmp = path.with_name(f".{EVALUATION_FILE}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(body, indent=2) + "\n")
    os.chmod(tmp, 0o644)
    os.replace(tmp, path)
    return refresh_card(export_dir)
