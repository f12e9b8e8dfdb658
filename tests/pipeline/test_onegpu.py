"""pipeline/jobs/onegpu.py on the debug target (CPU; the cuda test runs where a GPU is present):
answers equal the engine's greedy answers, in-memory features equal CaptureServer's, variants
train side by side and export to drafters the engine serves, exports refuse another target."""

import json
import os

import pytest
import torch

from specray.capture.contract import build_contract
from specray.capture.data import ChatRenderer, Conversation
from specray.capture.server import CaptureServer
from specray.capture.store import FeatureStore
from specray.drafters.format import load_drafter
from specray.pipeline.jobs import onegpu
from specray.serving.engine import Engine
from specray.serving.sampling import SamplingParams

PROMPTS = ["hello", "write a poem about the sea", "2+2=?", "what is ray", "tell me a story", "x"]


def run_args(tmp_path, device="cpu", **overrides):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"id": f"p{i}", "prompt": p}) + "\n" for i, p in enumerate(PROMPTS)))
    argv = ["run", "--prompts", str(prompts), "--out", str(tmp_path / "out"), "--device", device, "--target", "debug",
            "--variants", json.dumps([{"name": "l1", "draft_vocab_size": 64, "objective": {"num_anchors": 8}},
                                      {"name": "l2", "num_layers": 2, "layer_ids": [2, 5], "draft_vocab_size": None}]),
            "--gen-batch-size", "4", "--max-new-tokens", "12", "--train-seconds", "3", "--warmup-steps", "3",
            "--batch-size", "2", "--heldout-percent", "50", "--log-every", "5", "--live-prompts", "2",
            "--live-max-tokens", "6"]
    for key, value in overrides.items():
        argv += [f"--{key.replace('_', '-')}", str(value)]
    return argv


@pytest.fixture(scope="module")
def finished(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("onegpu")
    onegpu.main(run_args(tmp))
    return tmp / "out"


def test_answers_are_the_engines_greedy_answers(finished, debug_target):
    rows = [json.loads(line) for line in (finished / "answers.jsonl").read_text().splitlines()]
    assert sorted(r["id"] for r in rows) == [f"p{i}" for i in range(len(PROMPTS))]
    engine = Engine(debug_target, None, max_batch=1, max_len=256)
    for row in rows:
        user, answer = row["messages"][0]["content"], row["messages"][1]["content"]
        assert user == PROMPTS[int(row["id"][1:])]
        assert answer == engine.generate([user], SamplingParams(max_tokens=12))[0].text, row["id"]


def test_features_equal_the_capture_servers(debug_target, tmp_path):
    renderer = ChatRenderer(debug_target.tokenizer, max_length=256)
    samples = [renderer.render(Conversation(f"c{i}", (("user", p), ("assistant", p[::-1] + " ok"))))
               for i, p in enumerate(PROMPTS)]
    contract = build_contract("dflash", target_fingerprint=debug_target.target_fingerprint,
                              template_fingerprint=debug_target.template_fingerprint,
                              num_target_layers=debug_target.num_layers, hidden_size=debug_target.hidden_size)
    server = CaptureServer(debug_target, contract, FeatureStore(f"file://{tmp_path}/store"))
    expected = server.extract(samples)
    server.close()
    feats = onegpu.extract_features(debug_target, samples, contract.layer_ids, max_batch_tokens=10**6)
    for i, item in enumerate(expected):
        start, n = feats.offsets[i], feats.lengths[i]
        assert torch.equal(feats.hidden[start:start + n], item["hidden_states"])
        assert torch.equal(feats.input_ids[start:start + n], item["input_ids"].long())
        assert torch.equal(feats.loss_mask[start:start + n], item["loss_mask"].bool())
    # a batch with a subset of the layers takes those columns
    batch = feats.select(feats.batch([1, 0]), contract.layer_ids[-1:])
    D, n0 = debug_target.hidden_size, feats.lengths[0]
    assert torch.equal(batch.hidden_states[1, :n0], expected[0]["hidden_states"][:, -D:].float())
    assert batch.attention_mask[1].sum() == n0 and not batch.hidden_states[1, n0:].any()


def test_variants_train_side_by_side_and_export(finished, debug_target, tmp_path):
    summary = json.loads((finished / "summary.json").read_text())
    assert summary["heldout_samples"] >= 1 and summary["train_samples"] + summary["heldout_samples"] == len(PROMPTS)
    assert summary["steps"] > 3 and set(summary["variants"]) == {"l1", "l2"}
    assert summary["variants"]["l2"]["config"]["target_layer_ids"] == [2, 5]
    for name, result in summary["variants"].items():
        acc = result["heldout"]["acc_by_pos"]
        assert len(acc) == 7 and all(0 <= a <= 1 for a in acc)
    assert 0 < summary["variants"]["l1"]["coverage"] <= 1 and summary["variants"]["l2"]["coverage"] is None
    for result in summary["variants"].values():  # live acceptance on the serving engine, as every training run reports
        live = result["live"]
        assert live["live_prompts"] == 2 and live["live_rounds"] >= 1 and len(live["live_accept_by_pos"]) == 7
        assert 1.0 <= live["tau_live"] <= 8.0
    first, last = summary["history"][0], summary["history"][-1]
    assert last["l1"] < first["l1"] + 0.5  # training ran (the loss is logged at every log_every steps)

    out = onegpu.export(finished / "l1.safetensors", tmp_path / "exp", target_name="debug")
    drafter = load_drafter(out, embed_tokens=debug_target.model.model.embed_tokens, lm_head=debug_target.model.lm_head,
                           target_fingerprint=debug_target.target_fingerprint,
                           template_fingerprint=debug_target.template_fingerprint)
    assert drafter.config.draft_vocab_size == 64 and drafter.config.num_layers == 1
    engine = Engine(debug_target, str(out), max_batch=1, max_len=256)  # lossless with the exported drafter
    ar = Engine(debug_target, None, max_batch=1, max_len=256)
    params = SamplingParams(max_tokens=20)
    assert engine.generate(["hello"], params)[0].token_ids == ar.generate(["hello"], params)[0].token_ids


def test_export_refuses_another_target(finished, tmp_path):
    with pytest.raises(ValueError, match="another model's hidden states"):
        onegpu.export(finished / "l1.safetensors", tmp_path / "exp", target_name="debug:1")
    assert not (tmp_path / "exp").exists()


def test_bad_variants_are_named():
    with pytest.raises(ValueError, match="variant .a.: layers: Extra inputs"):  # the field the drafter section does not know
        onegpu.Variant.parse({"name": "a", "layers": 2})
    with pytest.raises(ValueError, match="variant .a.: block_size: Value error, block_size must be >= 2"):
        onegpu.Variant.parse({"name": "a", "block_size": 1})
    with pytest.raises(ValueError, match="names a file"):
        onegpu.Variant.parse({"name": "a/b"})
    assert onegpu.Variant.parse({"name": "a"}).drafter.draft_vocab_size == 8192
    with pytest.raises(ValueError, match=r"variant .a.: num_anchors: Input should be greater than 0"):
        onegpu.Variant.parse({"name": "a", "objective": {"num_anchors": 0}})
    with pytest.raises(ValueError, match=r"variant .a.: unknown algorithm 'medusa'"):
        onegpu.Variant.parse({"name": "a", "algorithm": "medusa"})
    variant = onegpu.Variant.parse({"name": "a", "objective": {"gamma": 2}})
    assert variant.drafter.algorithm == "dflash" and variant.objective.gamma == 2 and variant.objective.num_anchors == 16


@pytest.mark.skipif(not torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1",
                    reason="needs a CUDA GPU")
def test_run_on_cuda(tmp_path):
    onegpu.main(run_args(tmp_path, device="cuda"))
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert summary["device"] == "cuda" and summary["steps"] > 3


def test_an_eos_the_template_does_not_close_turns_with_fails_before_generating(tmp_path, monkeypatch):
    """transformers 5.17 read SmolLM2's GGUF with eos = <|im_start|>: answers would run past the
    end of the turn. The run refuses before generating anything."""
    real = onegpu.load_target

    def wrong_eos(*args, **kwargs):
        target = real(*args, **kwargs)
        target.tokenizer.eos_token = "<|im_start|>"
        return target

    monkeypatch.setattr(onegpu, "load_target", wrong_eos)
    with pytest.raises(ValueError, match="does not close assistant turns"):
        onegpu.main(run_args(tmp_path))
    assert not (tmp_path / "out" / "answers.jsonl").exists()
