"""``make gpu-check``'s dry run (``tests/gpu_check.py --dry-run``): on a machine without a GPU it
validates every stage's config, plans every algorithm's quickstart on CUDA and collects the CUDA tests."""

import json
import subprocess
import sys
from pathlib import Path

GPU_CHECK = Path(__file__).resolve().parents[1] / "gpu_check.py"


def test_the_dry_run_plans_every_algorithm_and_collects_the_cuda_tests(tmp_path):
    done = subprocess.run([sys.executable, str(GPU_CHECK), "--dry-run", "--out", str(tmp_path)], capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    summary = json.loads((tmp_path / "summary.json").read_text())
    stages = {r["stage"]: r for r in summary["results"]}
    assert set(stages) == {"plan eagle3", "plan dflash", "plan dspark", "plan dflash2", "cuda tests (collect)"}
    assert all(r["ok"] for r in summary["results"])
    assert "tests collected" in stages["cuda tests (collect)"]["detail"]
    for algorithm in ("eagle3", "dflash", "dspark", "dflash2"):  # each plan printed, sized for the GPU
        assert f"-- {algorithm}: " in done.stdout
    assert done.stdout.count("bf16 autocast") == 4 and "DOES NOT FIT" not in done.stdout


def test_a_gpu_too_small_fails_the_dry_run(tmp_path):
    done = subprocess.run([sys.executable, str(GPU_CHECK), "--dry-run", "--out", str(tmp_path), "--gpu-memory", "200MB"],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 1 and "FAIL plan eagle3" in done.stdout
