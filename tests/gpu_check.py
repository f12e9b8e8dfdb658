"""``make gpu-check``: the project's own device check, at most 8 minutes on one GPU.

    python tests/gpu_check.py [--out runs/gpu-check] [--gpu-memory 141GB]   (on a CUDA machine)
    python tests/gpu_check.py --dry-run                                     (anywhere: plans and checks)

Stages, each under its own timeout; a stage that fails or runs out of time is recorded and the
next one runs; a summary (and ``<out>/summary.json``) ends the check, exit status 1 when any
stage failed:

1. ``cuda tests``: ``pytest -m cuda`` with the Triton kernels compiled (``TRITON_INTERPRET=0``);
2. per algorithm (eagle3, dflash, dspark, dflash2): ``specray plan`` of its quickstart pipeline on
   CUDA, then the pipeline itself on the GPU — capture actors and the trainer gang granted a GPU
   each (``capture.num_gpus_per_actor=1``, ``train.gpus_per_worker=1``), a few steps, live
   evaluation at the checkpoint — in one process on one Ray cluster. One line per stage: seconds,
   throughput, the GPU memory in use at its peak (``nvidia-smi``, sampled every 0.2 s: the CUDA
   contexts and the caching allocators' reserve included) and the plan's estimate.

``--dry-run`` runs what needs no GPU: the configs of every stage validate, every algorithm is
planned on CUDA (``--gpu-memory``, default an H200's 141 GB), the CUDA tests collect; nothing
is trained. ``tests/pipeline/test_gpu_check.py`` runs it inside ``make test``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ALGORITHMS = ("eagle3", "dflash", "dspark", "dflash2")
TESTS_TIMEOUT_S = 140
PIPELINE_TIMEOUT_S = 75  # each algorithm's pipeline, inside the pipelines stage
PIPELINES_TIMEOUT_S = 4 * PIPELINE_TIMEOUT_S + 20  # the whole stage: one Ray start, four pipelines


def pipeline_overrides(algorithm: str, out: Path) -> tuple[str, list[str]]:
    """(manifest, overrides) of ``algorithm``'s quickstart pipeline, tiny, on the GPU."""
    manifest = "manifests/quickstart-eagle3.yaml" if algorithm == "eagle3" else "manifests/quickstart.yaml"
    drafter = [] if algorithm in ("eagle3", "dflash") else [
        f"train.drafter={{algorithm: {algorithm}, num_layers: 1, block_size: 8, draft_vocab_size: 8192}}"]
    return manifest, [
        f"name=gpu-check-{algorithm}", f"output.run_dir={out / algorithm}", f"capture.algorithm={algorithm}",
        *drafter, "data.max_samples=16", "data.max_length=256", "capture.num_gpus_per_actor=1",
        "capture.num_cpus_per_actor=2", "target.device=cuda", "train.device=cuda", "train.gpus_per_worker=1",
        "train.cpus_per_worker=2", "train.optim.total_steps=6", "train.optim.warmup_steps=2",
        "train.checkpoint_every=6", "train.log_every=1", "train.live_eval.num_prompts=2",
        "train.live_eval.max_tokens=8", "serve.enabled=false", "bench.enabled=false",
    ]


# -- GPU memory in use, sampled ---------------------------------------------------------------


class GpuMemory(threading.Thread):
    """``nvidia-smi``'s memory in use (MiB, all GPUs), sampled every 0.2 s with the time."""

    def __init__(self):
        super().__init__(daemon=True, name="gpu-check-memory")
        self.samples: list[tuple[float, float]] = []
        self.stop = threading.Event()
        self.available = shutil.which("nvidia-smi") is not None

    def run(self) -> None:
        while self.available and not self.stop.is_set():
            done = subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"],
                                  capture_output=True, text=True, timeout=10)
            if done.returncode == 0:
                self.samples.append((time.time(), sum(float(x) for x in done.stdout.split())))
            self.stop.wait(0.2)

    def peak(self, start: float, end: float) -> float | None:
        inside = [mib for t, mib in self.samples if start <= t <= end]
        return max(inside) * 2**20 if inside else None


# -- the pipelines stage (a subprocess: python tests/gpu_check.py --pipelines …) ----------------


def run_pipelines(algorithms: list[str], out: Path, gpu_memory: str) -> None:
    """Plan and run each algorithm's pipeline in this process (one Ray cluster); one JSON line per result."""
    from specray.pipeline.config import PipelineConfig, load_config
    from specray.pipeline.jobs import run_manifest
    from specray.pipeline.jobs import pipeline as driver
    from specray.pipeline.jobs.plan import parse_bytes, plan

    windows: dict[str, tuple[float, float]] = {}
    original = driver._stage

    @contextlib.contextmanager
    def timed(report, name, progress):  # the driver's stages, with their wall-clock windows
        start = time.time()
        with original(report, name, progress):
            yield
        windows[name] = (start, time.time())

    driver._stage = timed
    memory = GpuMemory()
    memory.start()

    def expire(signum, frame):
        raise TimeoutError(f"the pipeline ran past {PIPELINE_TIMEOUT_S} s")

    signal.signal(signal.SIGALRM, expire)
    from specray.capture.target import DEFAULT_TARGET, resolve_target_dir

    resolve_target_dir(DEFAULT_TARGET)  # a fresh machine materialises the embedded target once, outside the timeouts
    for algorithm in algorithms:
        manifest, overrides = pipeline_overrides(algorithm, out)
        windows.clear()
        result = {"algorithm": algorithm}
        start = time.perf_counter()
        signal.alarm(PIPELINE_TIMEOUT_S)
        try:
            cfg = load_config(PipelineConfig, str(ROOT / manifest), overrides)
            estimates = {s.name: s.bytes for s in plan(cfg, device="cuda", gpu_memory=parse_bytes(gpu_memory))}
            result["plan"] = estimates
            report, _ = run_manifest(cfg, progress=False)
            result.update(ok=True, report=stage_lines(report, windows, memory, estimates))
        except Exception as e:  # noqa: BLE001 - a failed pipeline is a result; the next one runs
            result.update(ok=False, error=f"{type(e).__name__}: {e}"[:2000])
        finally:
            signal.alarm(0)
        result["seconds"] = round(time.perf_counter() - start, 1)
        print("GPU-CHECK " + json.dumps(result), flush=True)
    memory.stop.set()


def stage_lines(report, windows: dict, memory: GpuMemory, estimates: dict) -> list[dict]:
    """One record per pipeline stage: seconds, throughput, peak GPU memory in use, the plan's estimate."""
    train_dir = Path(report.run_dir) / "train"
    records = [json.loads(line) for line in (train_dir / "metrics.jsonl").read_text().splitlines()] \
        if (train_dir / "metrics.jsonl").exists() else []
    live = next((r for r in reversed(records) if r.get("tau_live") is not None), None)
    throughput = {
        "capture": f"{(report.capture or {}).get('tokens_per_s', 0):.0f} tokens/s",
        "train": f"{records[-1]['tokens_per_s']:.0f} tokens/s, loss {records[-1]['loss']:.3f}" if records else "n/a",
        "export": "",
    }
    if live is not None:
        throughput["train"] += (f"; live eval tau {live['tau_live']:.2f}, "
                                f"{live['live_tokens'] / max(live['live_seconds'], 1e-9):.0f} tokens/s")
    plan_of = {"capture": estimates.get("capture actor"), "train": estimates.get("trainer rank")}
    lines = []
    for name, seconds in report.stage_seconds.items():
        start, end = windows.get(name, (0.0, 0.0))
        lines.append({"stage": name, "seconds": seconds, "throughput": throughput.get(name, ""),
                      "gpu_peak_bytes": memory.peak(start, end), "plan_bytes": plan_of.get(name)})
    return lines


# -- the check ----------------------------------------------------------------------------------


def run(command: list[str], timeout: int, env: dict | None = None) -> tuple[bool, str, float]:
    """(ok, output tail, seconds) of ``command`` under ``timeout`` (its process group killed after)."""
    start = time.perf_counter()
    proc = subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        output, _ = proc.communicate(timeout=timeout)
        ok = proc.returncode == 0
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        output, _ = proc.communicate()
        ok, output = False, output + f"\n(timed out after {timeout} s)"
    return ok, output, time.perf_counter() - start


def human(num_bytes: float | None) -> str:
    return "n/a" if num_bytes is None else f"{num_bytes / 2**30:.2f} GiB"


def dry_run(args, results: list[dict]) -> None:
    """Validate every stage's config, plan every algorithm on CUDA, collect the CUDA tests."""
    from specray.pipeline.config import PipelineConfig, load_config
    from specray.pipeline.jobs.plan import parse_bytes, plan, plan_table

    for algorithm in ALGORITHMS:
        manifest, overrides = pipeline_overrides(algorithm, Path(args.out))
        try:
            cfg = load_config(PipelineConfig, str(ROOT / manifest), overrides)
            stages = plan(cfg, device="cuda", gpu_memory=parse_bytes(args.gpu_memory))
            print(f"-- {algorithm}: {manifest} {' '.join(overrides)}\n{plan_table(stages)}", flush=True)
            fits = all(s.fits is not False for s in stages)
            results.append({"stage": f"plan {algorithm}", "ok": fits,
                            "detail": "every device stage fits" if fits else "a device stage does not fit"})
        except Exception as e:  # noqa: BLE001 - recorded; the next algorithm is checked
            results.append({"stage": f"plan {algorithm}", "ok": False, "detail": f"{type(e).__name__}: {e}"})
    ok, output, seconds = run([sys.executable, "-m", "pytest", "-q", "-m", "cuda", "--collect-only",
                               "-p", "no:cacheprovider", "tests"], TESTS_TIMEOUT_S)
    results.append({"stage": "cuda tests (collect)", "ok": ok, "seconds": round(seconds, 1),
                    "detail": output.strip().splitlines()[-1] if output.strip() else ""})


def gpu_run(args, results: list[dict]) -> None:
    env = dict(os.environ, TRITON_INTERPRET="0", RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="0")
    ok, output, seconds = run([sys.executable, "-m", "pytest", "-q", "-m", "cuda", "-p", "no:cacheprovider", "tests"],
                              TESTS_TIMEOUT_S, env)
    tail = output.strip().splitlines()[-1] if output.strip() else ""
    results.append({"stage": "cuda tests", "ok": ok, "seconds": round(seconds, 1), "detail": tail})
    if not ok:
        print(output[-6000:], flush=True)
    out = Path(args.out)
    ok, output, seconds = run([sys.executable, str(Path(__file__).resolve()), "--pipelines", ",".join(ALGORITHMS),
                               "--out", str(out), "--gpu-memory", args.gpu_memory], PIPELINES_TIMEOUT_S, env)
    found = {json.loads(line[10:])["algorithm"]: json.loads(line[10:])
             for line in output.splitlines() if line.startswith("GPU-CHECK ")}
    for algorithm in ALGORITHMS:
        result = found.get(algorithm)
        if result is None:
            results.append({"stage": f"pipeline {algorithm}", "ok": False, "detail": "did not run (the stage ran out "
                            f"of time or crashed: {output.strip().splitlines()[-1] if output.strip() else ''})"})
            continue
        results.append({"stage": f"pipeline {algorithm}", "ok": result["ok"], "seconds": result["seconds"],
                        "detail": "" if result["ok"] else result["error"]})
        for line in result.get("report", []):
            results.append({"stage": f"  {algorithm} {line['stage']}", "ok": True, "seconds": line["seconds"],
                            "detail": f"{line['throughput']}; GPU in use {human(line['gpu_peak_bytes'])}"
                                      + (f" (plan {human(line['plan_bytes'])})" if line["plan_bytes"] else "")})
    if not ok and not found:
        print(output[-6000:], flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dry-run", action="store_true", help="plan and check configs only (no GPU needed)")
    parser.add_argument("--out", default=str(ROOT / "runs" / "gpu-check"))
    parser.add_argument("--gpu-memory", default="141GB", help="one GPU's memory, for the plans (default: an H200)")
    parser.add_argument("--pipelines", default=None, help=argparse.SUPPRESS)  # the pipelines stage's subprocess
    args = parser.parse_args(argv)
    if args.pipelines:
        run_pipelines(args.pipelines.split(","), Path(args.out), args.gpu_memory)
        return 0
    import torch

    if not args.dry_run and not torch.cuda.is_available():
        print("gpu-check: torch sees no CUDA device here; run it on a GPU machine, or with --dry-run", file=sys.stderr)
        return 2
    start = time.perf_counter()
    results: list[dict] = []
    device = "dry run (no GPU used)" if args.dry_run else torch.cuda.get_device_name(0)
    print(f"gpu-check on {device}, torch {torch.__version__}", flush=True)
    (dry_run if args.dry_run else gpu_run)(args, results)
    total = time.perf_counter() - start
    print("\n== gpu-check summary", flush=True)
    for r in results:
        seconds = f"{r['seconds']:7.1f} s" if "seconds" in r else " " * 9
        print(f"{'ok  ' if r['ok'] else 'FAIL'} {r['stage']:<26} {seconds}  {r['detail']}", flush=True)
    failed = [r["stage"] for r in results if not r["ok"]]
    print(f"{len(results) - len(failed)} ok, {len(failed)} failed, {total:.0f} s" + (f": {failed}" if failed else ""))
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "summary.json").write_text(json.dumps({"device": device, "seconds": round(total, 1),
                                                             "results": results}, indent=2) + "\n")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
