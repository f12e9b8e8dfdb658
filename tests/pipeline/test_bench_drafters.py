"""``specray bench serve`` with several drafters and datasets: live acceptance, throughput against
our AR with the share of decisions that speculate, and vLLM (a stand-in here) beside them."""

import json

import pytest

from specray.drafters.format import InvalidDrafterError
from specray.pipeline.bench.drafters import bench_drafters, drafters_table, parse_drafters
from specray.serving.engine import Engine
from specray.serving.live_eval import measure
from specray.serving.sampling import SamplingParams

from test_bench_serve import _export, _StandInLLM, no_vllm, stand_in_vllm  # noqa: F401 (fixtures)


@pytest.fixture
def exports(debug_target, tmp_path):
    return {"d": _export(tmp_path, debug_target, "dflash"), "e": _export(tmp_path, debug_target, "eagle3")}


def test_drafters_are_labelled_by_name_or_algorithm(exports, tmp_path):
    assert parse_drafters([f"a={exports['d']}", exports["e"]]) == {"a": exports["d"], "eagle3": exports["e"]}
    with pytest.raises(ValueError, match="label 'eagle3' is given twice"):
        parse_drafters([exports["e"], f"eagle3={exports['d']}"])
    with pytest.raises(ValueError, match="a label is 1-40 letters"):
        parse_drafters([f"../x={exports['d']}"])
    with pytest.raises(InvalidDrafterError, match="is not a drafter export"):
        parse_drafters([str(tmp_path)])


def test_several_drafters_on_several_datasets(debug_target, exports, no_vllm):  # noqa: F811
    result = bench_drafters(target_name="debug", drafters={"d": exports["d"], "e": exports["e"]},
                            datasets=("mtbench", "humaneval"), num_prompts=2, max_tokens=5, batch_sizes=(1, 2),
                            num_speculative_tokens=2)
    assert result["benchmark"] == "serve-drafters" and set(result["datasets"]) == {"mtbench", "humaneval"}
    assert result["drafters"] == {"d": {"dir": exports["d"], "algorithm": "dflash"},
                                  "e": {"dir": exports["e"], "algorithm": "eagle3"}}
    for dataset, entry in result["datasets"].items():
        assert {(r["system"], r["batch_size"]) for r in entry["runs"]} == {
            (s, b) for s in ("specray-ar", "specray-d", "specray-e") for b in (1, 2)}
        for label, row in entry["drafters"].items():
            assert row["live_num_speculative_tokens"] == 2 and len(row["accept_rate_by_pos"]) == 2
            assert row["live_rounds"] > 0 and 1.0 <= row["tau_live"] <= 3.0
            for b, fig in row["by_batch"].items():
                assert fig["greedy_mismatches_vs_ar"] == 0  # lossless: each drafter's greedy output is our AR's
                assert fig["speedup_vs_ar"] == pytest.approx(fig["tokens_per_s"] / fig["ar_tokens_per_s"])
                decisions = sum(fig["rounds_by_size"].values())
                assert decisions > 0 and set(fig["rounds_by_size"]) <= {"0", "1", "2"}
                speculating = decisions - fig["rounds_by_size"].get("0", 0)
                assert fig["speculating_share"] == pytest.approx(speculating / decisions)
        assert "vllm" not in entry
    table = drafters_table(result)
    assert "humaneval (2 prompts x 5 tokens, greedy)" in table and "specray-e" in table
    assert "vLLM: not installed" in table


def test_live_acceptance_is_the_static_engines(debug_target, exports, no_vllm):  # noqa: F811
    """The side-by-side's live figures are what a static engine measures on the same prompts."""
    result = bench_drafters(target_name="debug", drafters={"e": exports["e"]}, datasets=("mtbench",), num_prompts=2,
                            max_tokens=6, batch_sizes=(1,), num_speculative_tokens=3)
    ar = Engine(debug_target, None, max_batch=1)
    from specray.capture.data import load_conversations
    prompts = [ar.encode(c.as_chat()) for c in load_conversations("mtbench", purpose="eval", limit=2)]
    engine = Engine(debug_target, exports["e"], max_batch=1, speculation="static", num_speculative_tokens=3)
    expected = measure(engine, prompts, max_tokens=6, batch_size=1)
    row = result["datasets"]["mtbench"]["drafters"]["e"]
    assert row["tau_live"] == pytest.approx(expected["tau_live"])
    assert row["accept_rate_by_pos"] == pytest.approx(expected["live_accept_by_pos"])


def test_vllm_serves_the_chosen_drafter_beside_our_ar(debug_target, exports, stand_in_vllm):  # noqa: F811
    _StandInLLM.reference, _StandInLLM.eos = {}, debug_target.tokenizer.eos_token_id
    result = bench_drafters(target_name="debug", drafters={"d": exports["d"], "e": exports["e"]},
                            datasets=("mtbench",), num_prompts=2, max_tokens=4, batch_sizes=(1, 2),
                            num_speculative_tokens=2, vllm_drafter="e")
    vllm = result["datasets"]["mtbench"]["vllm"]
    assert set(vllm["systems"]) == {"vllm-ar", "vllm-e"} and result["vllm"]["drafter"] == "e"
    spec = _StandInLLM.instances[1].kwargs["speculative_config"]
    assert (spec["method"], spec["num_speculative_tokens"]) == ("eagle3", 2)  # the live round size
    assert vllm["drafter"]["label"] == "e" and vllm["drafter"]["method"] == "eagle3"
    for system, by_batch in vllm["systems"].items():
        for fig in by_batch.values():  # each paired with our AR
            assert fig["speedup_vs_specray_ar"] == pytest.approx(fig["tokens_per_s"] / fig["paired_specray_ar_tokens_per_s"])
    assert vllm["systems"]["vllm-e"]["1"]["accept_rate_by_pos"] == [0.5, 0.25]  # the stand-in's counters
    assert vllm["systems"]["vllm-ar"]["1"]["tau"] is None
    assert {r["system"] for r in result["datasets"]["mtbench"]["runs"]} >= {"vllm-ar", "vllm-e"}
    assert "vllm-e" in drafters_table(result)
    with pytest.raises(ValueError, match="--vllm-drafter 'x' is not a --drafter label"):
        bench_drafters(target_name="debug", drafters={"d": exports["d"]}, datasets=("mtbench",), num_prompts=1,
                       max_tokens=2, vllm_drafter="x")


def test_the_cli_runs_drafters_side_by_side(debug_target, exports, no_vllm, tmp_path, capsys):  # noqa: F811
    from specray.pipeline.cli import main

    out = tmp_path / "d.json"
    assert main(["bench", "serve", "--target", "debug", "--drafter", f"d={exports['d']}", "--drafter", exports["e"],
                 "--dataset", "mtbench", "--num-prompts", "1", "--max-tokens", "3", "--batch-sizes", "1",
                 "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert set(result["datasets"]["mtbench"]["drafters"]) == {"d", "eagle3"}
    assert result["command"].startswith("specray bench serve")
    assert "specray-eagle3" in capsys.readouterr().out
    assert main(["bench", "serve", "--target", "debug", "--drafter", exports["d"], "--drafter", exports["e"],
                 "--png", str(tmp_path / "a.png")]) != 0
    assert "--png: options of a single drafter" in capsys.readouterr().err
    assert main(["bench", "serve", "--target", "debug", "--drafter", exports["d"], "--vllm-drafter", "d"]) != 0
    assert "--vllm-drafter picks one of several" in capsys.readouterr().err
    # one labelled drafter on one dataset is the single-drafter bench
    assert main(["bench", "serve", "--target", "debug", "--drafter", f"d={exports['d']}", "--num-prompts", "1",
                 "--max-tokens", "3", "--batch-sizes", "1", "--no-transformers", "--json", str(out)]) == 0
    assert json.loads(out.read_text())["drafter"] == exports["d"]
