"""``specray calibrate EXPORT --manifest HELDOUT``: Sequential Temperature Scaling of a DSpark export's
confidence head on held-out features (seed §5.4; the fit in ``trainer/strategies/dspark.py``).

Runs the export teacher-forced over every sample of the manifest (the strategy's evaluation
anchors, seeded), fits one temperature per draft position so that the predicted survival
``∏ σ(z / T)`` matches the observed ``∏ c*``, and writes ``calibration.json`` into the export (any
previous one is replaced). Serving reads it when it loads the export and refuses one fitted for
another block size or another export (``drafters/dspark.py::read_calibration``). Returns the
temperatures and the calibration error before and after, per position and pooled.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from specray.capture.store import open_store, read_manifest
from specray.capture.target import load_target
from specray.drafters.dspark import CALIBRATION_FILE, write_calibration
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
    z, c_star, supervised = (torch.cat(parts) for parts in zip(*rows))  # [n, B] each
    temperatures = fit_sts(z, c_star, supervised)
    before, after = survival_ece(z, c_star, supervised, None, bins), survival_ece(z, c_star, supervised,
                                                                                  temperatures, bins)
    report = {"manifest": manifest_uri, "blocks": int(z.shape[0]), "ece_before": before[1], "ece_after": after[1],
              "ece_by_pos_before": before[0], "ece_by_pos_after": after[0]}
    path = write_calibration(export_dir, temperatures, report)
    return {"path": str(path), "temperatures": temperatures, **report}
