"""Live acceptance (serving/live_eval.py) against ``specray bench serve`` and through ``specray evaluate --live``."""

import json

import pytest
import torch

from specray.capture.contract import build_contract
from specray.drafters.dflash import DFlashConfig, DFlashDrafter
from specray.drafters.format import save_drafter
from specray.pipeline.bench.serve import bench_serve
from specray.serving.live_eval import LiveEvalSettings, LiveEvaluator, prompt_turns

REPEATED = 226  # a token the debug target's greedy answers repeat (mtbench prompt 2: 226 226 226 …)


@pytest.fixture(scope="module")
def repeat_drafter(debug_target, tmp_path_factory):
    """A DFlash drafter whose layers add nothing: every draft is the LM head's argmax of the mask
    token's embedding (``REPEATED``), so rounds on repeated answers accept some drafts and others none."""
    t = debug_target
    contract = build_contract("dflash", target_fingerprint=t.target_fingerprint,
                              template_fingerprint=t.template_fingerprint, num_target_layers=t.num_layers,
                              hidden_size=t.hidden_size)
    cfg = DFlashConfig(hidden_size=t.hidden_size, vocab_size=t.vocab_size, target_layer_ids=contract.layer_ids,
                       mask_token_id=REPEATED, num_layers=1, num_heads=4, num_kv_heads=2, head_dim=16,
                       intermediate_size=128, block_size=4)
    torch.manual_seed(0)
    model = DFlashDrafter(cfg, embed_tokens=t.model.model.embed_tokens, lm_head=t.model.lm_head)
    with torch.no_grad():
        model.layers[0].attn.o_proj.weight.zero_()
        model.layers[0].down_proj.weight.zero_()
    return save_drafter(tmp_path_factory.mktemp("drafters") / "repeat", model,
                        contract=json.loads(contract.to_json()), provenance={"run": "repeat"})


def test_live_acceptance_equals_bench_serve(debug_target, repeat_drafter, monkeypatch):
    import importlib.util

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "vllm" else find_spec(name, *a))
    settings = LiveEvalSettings(dataset="mtbench", num_prompts=4, max_tokens=16, batch_size=2)
    evaluator = LiveEvaluator(debug_target, settings)
    live = evaluator.measure_export(repeat_drafter)
    assert 1.0 < live["tau_live"] < 4.0 and live["live_accept_by_pos"][2] > 0  # some rounds accept all 3 drafts
    assert live["live_num_speculative_tokens"] == 3 and live["live_prompts"] == 4 and live["live_tokens"] == 64
    again = evaluator.measure_export(repeat_drafter)  # a fresh version: its own round statistics
    assert again["tau_live"] == live["tau_live"] and again["live_accept_by_pos"] == live["live_accept_by_pos"]

    bench = bench_serve(target_name="debug", drafter_dir=str(repeat_drafter), dataset="mtbench", num_prompts=4,
                        max_tokens=16, batch_sizes=(2,), transformers=False, vllm=False, speculation="static")
    assert bench["tau"] == live["tau_live"]  # the same rounds, the same mean
    # bench's acceptance by position also counts its warm-up (the first prompt, 8 tokens): add it to ours
    warm = LiveEvaluator(debug_target, LiveEvalSettings(num_prompts=1, max_tokens=8, batch_size=2)).measure_export(
        repeat_drafter)
    rounds = live["live_rounds"] + warm["live_rounds"]
    combined = [(a * live["live_rounds"] + w * warm["live_rounds"]) / rounds
                for a, w in zip(live["live_accept_by_pos"], warm["live_accept_by_pos"], strict=True)]
    assert bench["accept_rate_by_pos"] == pytest.approx(combined, abs=1e-12)


def test_prompt_turns_stop_at_the_first_answer():
    chat = [{"role": "system", "content": "s"}, {"role": "user", "content": "q"},
            {"role": "assistant", "content": "a"}, {"role": "user", "content": "q2"}]
    assert prompt_turns(chat) == chat[:2] and prompt_turns(chat[:2]) == chat[:2]
    with pytest.raises(ValueError, match="live_eval.dataset 'sharegpt'"):
        LiveEvalSettings(dataset="sharegpt")


def test_evaluate_live_cli(repeat_drafter, tmp_path, capsys):
    from specray.pipeline.cli import main

    out = tmp_path / "live.json"
    assert main(["evaluate", str(repeat_drafter), "--live", "--target", "debug", "--num-prompts", "2",
                 "--max-tokens", "8", "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["export"] == str(repeat_drafter) and result["live_prompts"] == 2
    assert result["tau_live"] >= 1.0 and len(result["live_accept_by_pos"]) == 3
    assert "tau_live" in capsys.readouterr().out and "samples" not in result
    assert main(["evaluate", str(repeat_drafter), "--live", "--target", "debug:1"]) == 2  # another target: refused
