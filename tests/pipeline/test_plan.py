"""``specray plan``: its estimates agree with measured peaks of real CPU steps (a subprocess's resident
memory, ``plan_measure.py``) within 20 % for the debug and embedded targets, and it sizes an 8B
EAGLE-3 run on 80 GB GPUs from Llama-3.1-8B's config alone."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from specray.pipeline.cli import main
from specray.pipeline.config import PipelineConfig, load_config
from specray.pipeline.jobs.plan import parse_bytes, plan

HERE = Path(__file__).parent
LLAMA_8B = HERE / "fixtures" / "llama-3.1-8b"
EMBEDDED = "embedded:smollm2-135m-instruct"
TOLERANCE = 0.20

# (target, algorithm, micro-batch, sequence length, drafter fields, objective fields): steps whose
# activations outweigh the process's noise, each algorithm's memory mostly in its own terms
STEPS = [
    ("debug", "eagle3", 4, 256, {}, {}),
    ("debug", "dflash", 4, 512, {}, {"num_anchors": 64}),
    ("debug", "dspark", 4, 512, {}, {"num_anchors": 64}),
    ("debug", "dflash2", 4, 512, {}, {"num_anchors": 64}),
    # attention in several chunks of queries (drafters/common.py::chunked_rows)
    ("debug", "eagle3", 1, 1024, {}, {}),
    ("debug", "dflash", 1, 2048, {}, {"num_anchors": 256}),
    pytest.param(EMBEDDED, "eagle3", 2, 256, {"draft_vocab_size": 8192}, {}, marks=pytest.mark.slow),
    pytest.param(EMBEDDED, "dflash", 1, 1024, {}, {"num_anchors": 128}, marks=pytest.mark.slow),
    pytest.param(EMBEDDED, "dspark", 1, 512, {"draft_vocab_size": 8192}, {"num_anchors": 64}, marks=pytest.mark.slow),
    pytest.param(EMBEDDED, "dflash2", 1, 512, {"draft_vocab_size": 8192}, {"num_anchors": 64},
                 marks=pytest.mark.slow),
]


def measured(args: dict) -> float:
    """``plan_measure.py`` in a fresh process, glibc returning large blocks at once (resident = live)."""
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536", OMP_NUM_THREADS="1")
    done = subprocess.run([sys.executable, str(HERE / "plan_measure.py"), json.dumps(args)], capture_output=True,
                          text=True, env=env, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])["peak_bytes"]


def planned(target: str, algorithm: str, overrides: list[str]) -> dict[str, float]:
    cfg = load_config(PipelineConfig, "manifests/quickstart.yaml", [
        f"target.name={target}", f"capture.algorithm={algorithm}", f"train.drafter={{algorithm: {algorithm}}}",
        "train.live_eval.enabled=false", *overrides])
    return {s.name: s.bytes for s in plan(cfg, device="cpu")}


@pytest.mark.parametrize("target, algorithm, batch, seq_len, drafter, objective", STEPS)
def test_the_trainer_rank_estimate_agrees_with_a_measured_step(target, algorithm, batch, seq_len, drafter, objective):
    stages = planned(target, algorithm, [
        f"train.optim.micro_batch_size={batch}", f"data.max_length={seq_len}",
        *[f"train.drafter.{k}={v}" for k, v in drafter.items()], *[f"train.objective.{k}={v}" for k, v in objective.items()]])
    real = measured({"target": target, "algorithm": algorithm, "micro_batch": batch, "seq_len": seq_len,
                     "drafter": drafter, "objective": objective})
    assert abs(stages["trainer rank"] / real - 1) <= TOLERANCE, (stages["trainer rank"], real)


@pytest.mark.parametrize("algorithm, anchors_per_position", [("eagle3", None), ("dflash", 1 / 8)])
def test_a_step_s_memory_grows_linearly_in_the_sequence(algorithm, anchors_per_position):
    """Real steps at S = 512, 1024, 2048 (DFlash with a fixed share of positions anchored, so its
    queries grow with S too): peak = static + a·S at most doubles per doubling of S; an attention
    that materialised [S, S] or [Q, S + Q] scores would come close to quadrupling."""
    peaks = []
    for seq_len in (512, 1024, 2048):
        objective = {} if anchors_per_position is None else {"num_anchors": int(seq_len * anchors_per_position)}
        peaks.append(measured({"target": "debug", "algorithm": algorithm, "micro_batch": 1, "seq_len": seq_len,
                               "drafter": {}, "objective": objective}))
    assert peaks[1] / peaks[0] < 2.2 and peaks[2] / peaks[1] < 2.2, peaks


@pytest.mark.parametrize("target, algorithm, tokens, length", [
    ("debug", "eagle3", 8192, 1024), pytest.param(EMBEDDED, "dflash", 4096, 512, marks=pytest.mark.slow)])
def test_the_capture_actor_estimate_agrees_with_a_measured_batch(target, algorithm, tokens, length):
    stages = planned(target, algorithm, [f"capture.max_batch_tokens={tokens}", f"data.max_length={length}",
                                         "capture.dtype=bfloat16"])
    real = measured({"stage": "capture", "target": target, "algorithm": algorithm, "max_batch_tokens": tokens,
                     "max_length": length})
    assert abs(stages["capture actor"] / real - 1) <= TOLERANCE, (stages["capture actor"], real)


def test_plan_sizes_an_8b_eagle3_run_on_80gb_gpus_from_its_config_alone(tmp_path, capsys):
    assert sorted(p.name for p in LLAMA_8B.iterdir()) == ["config.json"]  # no weights, no tokenizer
    code = main(["plan", "manifests/quickstart-eagle3.yaml", "--device", "cuda", "--gpu-memory", "80GiB",
                 "--json", str(tmp_path / "plan.json"), f"target.name={LLAMA_8B}", "data.max_length=4096",
                 "data.max_samples=10000", "train.optim.micro_batch_size=1", "train.drafter.draft_vocab_size=32000",
                 "capture.num_gpus_per_actor=1", "train.gpus_per_worker=1"])
    out = capsys.readouterr().out
    assert code == 0, out
    stages = {s["name"]: s for s in json.loads((tmp_path / "plan.json").read_text())}
    assert set(stages) == {"target", "capture actor", "features", "trainer rank", "rank 0 live eval"}
    assert "8.03 B parameters in bfloat16 (32 layers, hidden 4096, vocab 128256)" in out
    assert abs(stages["target"]["bytes"] - 8.03e9 * 2) < 0.01e9 * 2
    # eagle3 features: 3 layers + the last hidden state in bf16, an int32 token and a bool mask
    assert "32773 B/token" in out and stages["features"]["bytes"] == pytest.approx(10000 * (32773 * 4096 + 4096))
    for name in ("capture actor", "trainer rank", "rank 0 live eval"):
        assert stages[name]["device"] and stages[name]["fits"], stages[name]
    assert 10e9 < stages["trainer rank"]["bytes"] < 80 * 2**30
    assert "bf16 autocast" in stages["trainer rank"]["detail"]
    # 4,096 rows: attention and the vocabulary in chunks, nothing [S, S] or [S, V] kept for the backward
    assert "attention 0 B" in stages["trainer rank"]["detail"], stages["trainer rank"]["detail"]


@pytest.mark.parametrize("algorithm", ["dflash", "dspark", "dflash2"])
def test_plan_sizes_a_dflash_family_run_on_a_target_without_a_tokenizer(algorithm):
    """No MASK token can be chosen without a tokenizer; the plan does not need one (it changes no shape)."""
    stages = {s.name: s for s in plan(load_config(PipelineConfig, "manifests/quickstart.yaml", [
        f"target.name={LLAMA_8B}", f"capture.algorithm={algorithm}", f"train.drafter={{algorithm: {algorithm}}}",
        "train.drafter.draft_vocab_size=32000"]), device="cuda")}
    assert f"{algorithm} " in stages["trainer rank"].detail and stages["trainer rank"].bytes > 0


def test_a_stage_larger_than_the_gpu_is_marked(capsys):
    assert main(["plan", "manifests/quickstart-eagle3.yaml", "--device", "cuda", "--gpu-memory", "16GB",
                 f"target.name={LLAMA_8B}", "data.max_length=4096", "train.optim.micro_batch_size=1",
                 "capture.num_gpus_per_actor=2", "train.gpus_per_worker=1", "mode=online",
                 "online.max_inflight_samples=200", "train.drafter.draft_vocab_size=null"]) == 0
    lines = {line.split("  ")[0].strip(): line for line in capsys.readouterr().out.splitlines()}
    assert lines["trainer rank"].endswith("DOES NOT FIT")
    assert "1/2 of the target per GPU" in lines["capture actor"] and lines["capture actor"].endswith("  fits")
    assert "200 samples in flight" in lines["online window"]


def test_gpu_memory_sizes_parse():
    assert parse_bytes("80GiB") == 80 * 2**30 and parse_bytes("141GB") == 141e9 and parse_bytes("8e10") == 8e10
    with pytest.raises(ValueError, match=r"--gpu-memory '80 gigs': give a size such as 80GiB"):
        parse_bytes("80 gigs")


def test_the_regenerate_stage_holds_the_target_and_a_kv_cache_per_conversation_slot():
    """SmolLM2-135M: 30 layers x 3 K/V heads x 64, fp32 on the CPU, 16 slots of 512 + 320 + 8 tokens."""
    cfg = load_config(PipelineConfig, "manifests/recipe.yaml")
    stages = {s.name: s for s in plan(cfg, device="cpu")}
    target, regenerate = stages["target"], stages["regenerate actor"]
    assert regenerate.bytes == target.bytes + 2 * 30 * 3 * 64 * 16 * (512 + 320 + 8) * 4
    assert "16 conversations of up to 512 + 320 tokens" in regenerate.detail
    off = load_config(PipelineConfig, "manifests/recipe.yaml", ["regenerate.enabled=false"])
    assert "regenerate actor" not in {s.name for s in plan(off, device="cpu")}
