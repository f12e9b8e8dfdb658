"""``specray calibrate EXPORT --manifest HELDOUT``: Sequential Temperature Scaling of a DSpark export's
confidence head on held-out features (seed §5.4; the fit in ``trainer/strategies/dspark.py``).

Runs the export teacher-forced over every sample of the manifest (the strategy's evaluation
anchors, seeded) and, for each serving mode, fits one temperature per draft position so that the
predicted survival ``∏ σ(z / T)`` matches the observed survival of that mode: ``greedy``, the
argmax match with the target; ``sampling``, the overlap ``c* = 1 − TV``. Both tables go into the
export's ``calibration.json`` (any previous one is replaced); serving reads the table of each
request's mode, and refuses a file fitted for another block size or another export
(``drafters/dspark.py::read_calibration``). Returns, per mode, the temperatures and the calibration
error before and after, per position and pooled.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from specray.capture.store import open_store, read_manifest
from specray.capture.target import load_target
from specray.drafters.dspark import CALIBRATION_FILE, CALIBRATION_MODES, write_calibration
from specray.drafters.format import load_drafter, read_drafter_config
from specray.pipeline.config import ConfigError
from specray.trainer.loader import FeatureLoader
from specray.trainer.strategies import get_strategy
from specray.trainer.strategies.dspark import fit_sts, survival_ece


def calibrate_export(export_dir: str, manifest_uri: str, *, target_name: str, endpoint_url: str | None = None,
                     bins: int = 10) -> dict:
    """Fit, write and report the calibration of ``export_dir`` on ``manifest_uri`` (module docstring)."""
    algorithm = read_drafter_config(export_dir)["algorithm"]
    strategy_cls = get_strategy(algorithm)
    if not hasattr(strategy_cls, "confidence_rows"):
        raise ConfigError(f"{export_dir}: algorithm {algorithm!r} has no confidence head to calibrate "
                          "(specray calibrate fits DSpark exports)")
    manifest = read_manifest(manifest_uri, endpoint_url=endpoint_url)
    target = load_target(target_name, chat_template=manifest.chat_template)  # as the manifest was rendered
    (Path(export_dir) / CALIBRATION_FILE).unlink(missing_ok=True)  # the fit below replaces it
    model = load_drafter(export_dir, embed_tokens=target.model.model.embed_tokens, lm_head=target.model.lm_head,
                         target_fingerprint=target.target_fingerprint,
                         template_fingerprint=target.template_fingerprint,
                         contract=json.loads(manifest.contract.to_json()))
    strategy = strategy_cls(strategy_cls.objective.model_validate(strategy_cls.evaluation))
    rows = []
    with FeatureLoader(manifest, open_store(manifest.store_uri, endpoint_url=endpoint_url), micro_batch_size=1,
                       seed=0) as loader:
        for i in range(len(manifest.refs)):
            rows.append(strategy.confidence_rows(model, model.config, loader.next_batch(), strategy.generator(0, i)))
    z = torch.cat([r[0] for r in rows])  # [n, B]
    supervised = torch.cat([r[2] for r in rows])  # [n, B]
    tables, modes = {}, {}
    for mode in CALIBRATION_MODES:
        target = torch.cat([r[1][mode] for r in rows])  # [n, B] the mode's survival target
        tables[mode] = fit_sts(z, target, supervised)
        before, after = survival_ece(z, target, supervised, None, bins), survival_ece(z, target, supervised,
                                                                                      tables[mode], bins)
        modes[mode] = {"survival": SURVIVAL_EVENTS[mode], "observed_by_pos": observed_survival(target, supervised),
                       "ece_before": before[1], "ece_after": after[1],
                       "ece_by_pos_before": before[0], "ece_by_pos_after": after[0]}
    report = {"manifest": manifest_uri, "blocks": int(z.shape[0]), "modes": modes}
    path = write_calibration(export_dir, tables, report)
    return {"path": str(path), **report, "modes": {m: {**modes[m], "temperatures": tables[m]} for m in modes}}


SURVIVAL_EVENTS = {"greedy": "argmax of q = argmax of the target", "sampling": "c* = 1 - TV(p, q)"}


def observed_survival(target: torch.Tensor, supervised: torch.Tensor) -> list[float]:
    """Mean observed survival ``∏_{i<=k} t_i`` per position k over the blocks supervised there (target,
    supervised [n, B])."""
    survival = torch.cumprod(target.double(), dim=-1)
    return [float(survival[supervised[:, k], k].mean()) if supervised[:, k].any() else float("nan")
            for k in range(target.shape[1])]


def calibration_table(result: dict) -> str:
    """``specray calibrate``'s printout: per mode, the temperatures and the ECE per position before and after."""
    def fmt(values: list[float]) -> str:
        return " ".join(f"{v:.3f}" for v in values)

    lines = [f"blocks        {result['blocks']}"]
    for mode, m in result["modes"].items():
        lines += [f"{mode} ({m['survival']})",
                  f"  observed    by pos {fmt(m['observed_by_pos'])}",
                  f"  temperature by pos {fmt(m['temperatures'])}",
                  f"  ECE before  {m['ece_before']:.4f}  by pos {fmt(m['ece_by_pos_before'])}",
                  f"  ECE after   {m['ece_after']:.4f}  by pos {fmt(m['ece_by_pos_after'])}"]
    return "\n".join([*lines, f"wrote         {result['path']}"])
