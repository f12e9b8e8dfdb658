"""``specray bench train --json FILE``: the median step time split (data wait / forward /
backward / optimizer) and tokens/s of a training run."""

from __future__ import annotations

import statistics
import tempfile

from specray.serving.sidebyside import environment
from specray.pipeline.config import CaptureJobConfig, TrainJobConfig, load_config

BENCH_TRAIN_DEFAULTS = ["name=bench-train", "optim.total_steps=30", "optim.warmup_steps=5", "trainer.log_every=1",
                        "trainer.checkpoint_every=1000", "trainer.keep_last=1", "live_eval.enabled=false"]


def bench_train(cfg, *, warmup: int = 5) -> dict:
    """Median step time split (data wait / forward / backward / optimizer) and tokens/s.

    With no ``data.manifest`` given on the command line, 24 ShareGPT samples (≤ 512 tokens) of
    the target are captured first into a temporary store (not timed).
    """
    from specray.pipeline.jobs.train import build_trainer

    with tempfile.TemporaryDirectory(prefix="specray-bench-train-") as tmp:
        if cfg.data.manifest == "auto":
            from specray.pipeline.jobs.capture import run_capture

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
        "environment": environment(),
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
