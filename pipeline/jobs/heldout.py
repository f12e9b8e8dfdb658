"""The default held-out set: the target's own greedy answers to held-out chat prompts.

``specray evaluate EXPORT`` without ``--manifest`` reports teacher-forced metrics on it. A
drafter is served on the target's greedy outputs to users' chat prompts, so held-out answers
written by people (or by another model) measure another distribution than serving does; this set
is what serving sees, on prompts that are not the benchmark's (``bench serve`` and ``evaluate
--live`` use MT-Bench / HumanEval):

- prompts: the first user turn of ``HELDOUT_PROMPTS`` ShareGPT conversations from ``HELDOUT_SKIP``
  on (the tail of the 17,346 the loader yields; a training run that uses all of ShareGPT includes
  them — train on a head slice, ``data.max_samples``, as the recipes do);
- answers: the target's greedy answers (``specray regenerate``: our engine, lossless against
  transformers), ``HELDOUT_TOKENS`` tokens at most;
- features: captured under the export's capture contract (layer ids, capture point, dtype).

Built on first use and cached under ``$SPECRAY_CACHE/heldout/<target>/`` (answers once per
target, features once per contract). The answers file is renamed into place when complete, and a
capture's manifest is written last: an interrupted build is rebuilt, never read half-written.
"""

from __future__ import annotations

import os
from pathlib import Path

from specray.capture.target import cache_dir, load_target
from specray.drafters.format import read_drafter_config
from specray.pipeline.config import CaptureConfig, CaptureJobConfig, DataConfig, OutputConfig, StoreConfig, TargetConfig
from specray.pipeline.jobs.capture import run_capture
from specray.pipeline.jobs.regenerate import regenerate
from specray.serving.sampling import SamplingParams

HELDOUT_SKIP = 17_200  # ShareGPT conversations before the held-out tail
HELDOUT_PROMPTS = 64
HELDOUT_TOKENS = 128


def heldout_root(target_fingerprint: str) -> Path:
    return cache_dir() / "heldout" / target_fingerprint.removeprefix("sha256:")[:16]


def heldout_answers(target_name: str, root: Path, *, progress: bool = True) -> Path:
    """The target's greedy answers to the held-out prompts (a ``jsonl:`` dataset), built once."""
    path = root / f"answers-{HELDOUT_PROMPTS}x{HELDOUT_TOKENS}.jsonl"
    if not path.exists():
        root.mkdir(parents=True, exist_ok=True)
        partial = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        regenerate(target_name=target_name, dataset="sharegpt", num=HELDOUT_PROMPTS, skip=HELDOUT_SKIP, out=str(partial),
                   batch_size=8, params=SamplingParams(max_tokens=HELDOUT_TOKENS), progress=progress)
        os.replace(partial, path)
    return path


def heldout_manifest(target_name: str, export_dir: str | Path, *, progress: bool = True) -> str:
    """The held-out manifest under ``export_dir``'s capture contract (module doc), built on first use."""
    contract = read_drafter_config(export_dir)["capture_contract"]
    target = load_target(target_name)
    if contract["target_fingerprint"] != target.target_fingerprint:
        raise ValueError(f"{export_dir} was trained for another target than {target_name} (fingerprints differ); "
                         "pass --target with the export's target")
    root = heldout_root(target.target_fingerprint)
    run_dir = root / f"{contract['algorithm']}-{'-'.join(map(str, contract['layer_ids']))}-{contract['dtype']}"
    manifest = run_dir / "manifest.parquet"
    if manifest.exists():
        return str(manifest)
    answers = heldout_answers(target_name, root, progress=progress)
    cfg = CaptureJobConfig(
        name=f"heldout-{run_dir.name}", target=TargetConfig(name=target_name),
        data=DataConfig(dataset=f"jsonl:{answers}", max_length=2048),
        capture=CaptureConfig(algorithm=contract["algorithm"], layer_ids=contract["layer_ids"], dtype=contract["dtype"]),
        store=StoreConfig(uri=(run_dir / "features").resolve().as_uri()),
        output=OutputConfig(run_dir=str(run_dir), overwrite=True),  # replaces what an interrupted build left
    )
    run_capture(cfg, progress=progress)
    return str(manifest)
