"""Job drivers, one per job: what ``specray capture | train | pipeline run | regenerate | calibrate |
serve | plan`` and ``ray job submit`` run.

    capture      capture.py      target features into a store and a Parquet manifest
    train        train.py        a drafter on a manifest (one process, or DDP ranks)
    pipeline     pipeline.py     capture → train → export → serve → bench on Ray (offline, online)
    closed loop  closed_loop.py  replicas that retrain the drafter they serve on their traffic
    regenerate   regenerate.py   the target's own answers to training prompts
    calibrate    calibrate.py    DSpark's confidence temperatures on held-out features
    serve        serve.py        the Ray Serve application (``serve run``, KubeRay RayService)
    plan         plan.py         each stage's memory and bytes, before anything runs

with what they share: run dirs (rundir.py), held-out answers (heldout.py), OpenAI streaming
clients (clients.py). Jobs never import pipeline/bench.
"""

from __future__ import annotations


def run_manifest(cfg, *, progress: bool = True, resume: bool = False):
    """``specray pipeline run``: the driver of ``cfg.mode``; returns (report, ServeHandle or None)."""
    if cfg.mode == "closed_loop":
        from specray.pipeline.jobs.closed_loop import run_closed_loop

        return run_closed_loop(cfg, progress=progress, resume=resume)
    from specray.pipeline.jobs.pipeline import run_pipeline

    return run_pipeline(cfg, progress=progress, resume=resume)
