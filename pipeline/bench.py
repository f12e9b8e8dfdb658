"""Benchmarks: measured side by side in one process, written as JSON, printed as a table.

``specray bench capture --json FILE`` times, on the same padded batches of the same
samples, alternating order each repeat:

- ``forward``: the plain target forward (``model(input_ids, attention_mask)``, logits and all);
- ``forward+hidden``: the same with ``output_hidden_states=True`` (a naive capture's cost
  before it has written anything);
- ``trunk``: all decoder layers + final norm, no LM head (``model.model``): what capture
  costs with no hooks, no early stop and no writes — ``capture / trunk`` isolates our overhead;
- ``capture``: ``CaptureServer.capture_all`` — hooked forward, cast, and the blobs written
  to the store (a fresh temporary ``file://`` store unless ``store.uri`` is set).

It reports median tokens/s of each (real tokens, padding excluded), the capture/forward
ratio of the medians, and stored bytes/token next to the contract's minimum.

``specray bench train --json FILE`` reports the median step time split and tokens/s.

``specray bench serve``: ``pipeline/serve_bench.py``.
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import tempfile
import time
from pathlib import Path
from typing import Callable

import torch

from specray.capture.server import CaptureServer, pack_batches, pad_batch
from specray.capture.store import FeatureStore
from specray.capture.target import load_target
from specray.pipeline.capture_job import contract_for, render_dataset
from specray.pipeline.config import CaptureJobConfig

BENCH_CAPTURE_DEFAULTS = ["name=bench-capture", "data.max_samples=32", "data.max_length=512"]


def _environment() -> dict:
    return {
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "cpus": os.cpu_count(),
        "machine": platform.machine(),
        "python": platform.python_version(),
        "load_average": list(os.getloadavg()),  # 1, 5, 15 min: other jobs sharing the CPUs
    }


def bench_capture(cfg: CaptureJobConfig, *, repeats: int = 3) -> dict:
    if repeats < 1:
        raise ValueError("--repeats must be >= 1")
    target = load_target(cfg.target.name, dtype=cfg.target.dtype, device=cfg.target.device)
    contract = contract_for(target, cfg)
    samples, _ = render_dataset(target, cfg)
    batches = pack_batches(samples, max_batch_tokens=cfg.capture.max_batch_tokens, max_batch_size=cfg.capture.max_batch_size)
    padded = [pad_batch(b, target.pad_token_id) for b in batches]
    tokens = sum(s.num_tokens for s in samples)
    model = target.model

    def forward(module: torch.nn.Module, **extra) -> Callable[[], None]:
        @torch.inference_mode()
        def run() -> None:
            for ids, mask in padded:
                module(input_ids=ids.to(model.device), attention_mask=mask.to(model.device), use_cache=False, **extra)
        return run

    with tempfile.TemporaryDirectory(prefix="specray-bench-") as tmp:
        store = FeatureStore(cfg.store.uri or Path(tmp).as_uri(), endpoint_url=cfg.store.endpoint_url)
        server = CaptureServer(target, contract, store, key_prefix="bench-capture")
        refs: list = []

        def capture() -> None:
            refs.clear()
            for batch_refs in server.capture_all(batches):
                refs.extend(batch_refs)

        systems = {
            "forward": forward(model),
            "forward+hidden": forward(model, output_hidden_states=True),
            "trunk": forward(model.model),
            "capture": capture,
        }
        times: dict[str, list[float]] = {name: [] for name in systems}
        server.capture(batches[0])  # warm-up: allocator, thread pools, first write
        systems["forward"]()
        for r in range(repeats):
            order = list(systems) if r % 2 == 0 else list(reversed(systems))
            for name in order:
                start = time.perf_counter()
                systems[name]()
                times[name].append(time.perf_counter() - start)
        stored = sum(ref.num_bytes for ref in refs)
        for ref in refs:
            store.delete(ref.key)
        server.close()

    tps = {name: tokens / statistics.median(t) for name, t in times.items()}
    return {
        "benchmark": "capture",
        "target": cfg.target.name,
        "algorithm": contract.algorithm,
        "layer_ids": list(contract.layer_ids),
        "dtype": contract.dtype,
        "samples": len(samples),
        "batches": len(batches),
        "tokens": tokens,
        "padded_tokens": sum(int(ids.numel()) for ids, _ in padded),
        "repeats": repeats,
        "seconds": times,
        "forward_tokens_per_s": tps["forward"],
        "forward_hidden_tokens_per_s": tps["forward+hidden"],
        "trunk_tokens_per_s": tps["trunk"],
        "capture_tokens_per_s": tps["capture"],
        "ratio": tps["capture"] / tps["forward"],
        "ratio_vs_trunk": tps["capture"] / tps["trunk"],
        "bytes_per_token": stored / tokens,
        "min_bytes_per_token": contract.min_bytes_per_token,
        "header_bytes_per_sample": (stored - contract.min_bytes_per_token * tokens) / len(samples),
        "store": cfg.store.uri or "file:// (temporary)",
        "environment": _environment(),
    }


def capture_table(result: dict) -> str:
    base = result["forward_tokens_per_s"]
    lines = [f"{'system':<16} {'tokens/s':>10} {'vs forward':>11}"]
    for label, key in (("forward", "forward_tokens_per_s"), ("forward+hidden", "forward_hidden_tokens_per_s"),
                       ("trunk", "trunk_tokens_per_s"), ("capture", "capture_tokens_per_s")):
        lines.append(f"{label:<16} {result[key]:>10.0f} {result[key] / base:>10.2f}x")
    lines.append(
        f"bytes/token {result['bytes_per_token']:.2f} (contract minimum {result['min_bytes_per_token']}, "
        f"header {result['header_bytes_per_sample']:.0f} B/sample); {result['tokens']} tokens in "
        f"{result['samples']} samples, {result['batches']} batches, median of {result['repeats']}"
    )
    return "\n".join(lines)


def write_json(result: dict, path: str | None) -> None:
    if path:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps(result, indent=2) + "\n")


BENCH_TRAIN_DEFAULTS = ["name=bench-train", "optim.total_steps=30", "optim.warmup_steps=5", "trainer.log_every=1",
                        "trainer.checkpoint_every=1000", "trainer.keep_last=1", "live_eval.enabled=false"]


def bench_train(cfg, *, warmup: int = 5) -> dict:
    """Median step time split (data wait / forward / backward / optimizer) and tokens/s.

    With no ``data.manifest`` given on the command line, 24 ShareGPT samples (≤ 512 tokens) of
    the target are captured first into a temporary store (not timed).
    """
    from specray.pipeline.config import TrainJobConfig
    from specray.pipeline.train_job import build_trainer

    with tempfile.TemporaryDirectory(prefix="specray-bench-train-") as tmp:
        if cfg.data.manifest == "auto":
            from specray.pipeline.capture_job import run_capture
            from specray.pipeline.config import load_config

            capture_cfg = load_config(CaptureJobConfig, None, [
                "name=bench-train-features", f"target.name={cfg.target.name}", "data.max_samples=24",
                "data.max_length=512", f"capture.algorithm={cfg.drafter.algorithm}", f"output.run_dir={tmp}/capture",
            ])
            run_capture(capture_cfg, progress=False)
            cfg = TrainJobConfig.model_validate(
                {**cfg.model_dump(), "data": {**cfg.data.model_dump(), "manifest": f"{tmp}/capture/manifest.parquet"}}
            )
        cfg = TrainJobConfig.model_validate(
            {**cfg.model_dump(), "output": {"run_dir": f"{tmp}/run", "resume": False}}
        )
        trainer = build_trainer(cfg)
        records = trainer.fit(progress=False)
        trainer.loader.close()
    if len(records) <= warmup:
        raise ValueError(f"optim.total_steps must exceed the {warmup} warm-up steps")
    timed = records[warmup:]
    split = {k: statistics.median(r["step_seconds"][k] for r in timed) for k in timed[0]["step_seconds"]}
    return {
        "benchmark": "train",
        "target": cfg.target.name,
        "algorithm": cfg.drafter.algorithm,
        "drafter": cfg.drafter.model_dump(),
        "micro_batch_size": cfg.optim.micro_batch_size,
        "accumulation_steps": cfg.optim.accumulation_steps,
        "objective": cfg.objective.model_dump(),
        "steps_timed": len(timed),
        "tokens_per_s": statistics.median(r["tokens_per_s"] for r in timed),
        "step_seconds": sum(split.values()),
        "split_seconds": split,
        "final_loss": records[-1]["loss"],
        "environment": _environment(),
    }


def train_table(result: dict) -> str:
    split = result["split_seconds"]
    total = sum(split.values())
    lines = [f"{'part':<10} {'s/step':>8} {'share':>7}"]
    lines += [f"{k:<10} {v:>8.3f} {v / total:>6.0%}" for k, v in split.items()]
    lines.append(f"{'step':<10} {total:>8.3f}")
    objective = " ".join(f"{k}={v}" for k, v in result["objective"].items())
    lines.append(f"tokens/s {result['tokens_per_s']:.0f} (median of {result['steps_timed']} steps; "
                 f"{result['algorithm']}, micro-batch {result['micro_batch_size']}, {objective})")
    return "\n".join(lines)
