import pytest
import torch

from specray.capture.contract import build_contract
from specray.capture.data import ChatRenderer, Conversation, load_conversations
from specray.capture.server import CaptureServer, pack_batches, pad_batch
from specray.capture.store import FeatureStore

PROMPTS = [
    (("user", "Hi"), ("assistant", "Hello! How can I help?")),
    (("user", "Name three colours."), ("assistant", "Red, green and blue."), ("user", "More"), ("assistant", "Cyan.")),
    (("user", "Say nothing"), ("assistant", "")),
]


def _samples(target, convs, max_length=4096):
    renderer = ChatRenderer(target.tokenizer, max_length=max_length)
    return [renderer.render(c) for c in convs]


def _server(target, tmp_path, algorithm="dflash", dtype="float32", layer_ids=None):
    contract = build_contract(
        algorithm, target_fingerprint=target.target_fingerprint, template_fingerprint=target.template_fingerprint,
        num_target_layers=target.num_layers, hidden_size=target.hidden_size, layer_ids=layer_ids, dtype=dtype,
    )
    return CaptureServer(target, contract, FeatureStore(tmp_path.as_uri()))


def _alone(target, sample):
    """Reference: transformers' output_hidden_states for the sample run on its own."""
    with torch.inference_mode():
        out = target.model(input_ids=sample.input_ids[None], output_hidden_states=True)
    return out.hidden_states  # [embeddings, out_0, ..., norm(out_{L-1})]


def _check_padded_batch_equals_alone(target, server, samples, atol):
    lengths = {s.num_tokens for s in samples}
    assert len(lengths) == len(samples), "the batch must mix lengths to exercise padding"
    features = server.extract(samples)
    layer_ids = server.contract.layer_ids
    for sample, feats in zip(samples, features):
        hs = _alone(target, sample)
        expected = torch.cat([hs[i + 1][0] for i in layer_ids], dim=-1)  # decoder-layer outputs
        assert feats["hidden_states"].shape == (sample.num_tokens, len(layer_ids) * target.hidden_size)
        torch.testing.assert_close(feats["hidden_states"].float(), expected, atol=atol, rtol=1e-5)
        if server.contract.last_hidden:
            torch.testing.assert_close(feats["last_hidden_states"].float(), hs[-1][0], atol=atol, rtol=1e-5)
        assert torch.equal(feats["input_ids"], sample.input_ids.int())
        assert torch.equal(feats["loss_mask"], sample.loss_mask)


@pytest.mark.parametrize("algorithm", ["dflash", "eagle3"])
def test_padded_batch_equals_each_sample_alone(debug_target, tmp_path, algorithm):
    samples = _samples(debug_target, [Conversation(f"p{i}", p) for i, p in enumerate(PROMPTS)])
    server = _server(debug_target, tmp_path, algorithm)
    _check_padded_batch_equals_alone(debug_target, server, samples, atol=1e-5)


def test_layer_order_is_respected_and_last_layer_is_pre_norm(debug_target, tmp_path):
    samples = _samples(debug_target, [Conversation("a", PROMPTS[0])])
    server = _server(debug_target, tmp_path, layer_ids=[7, 2])
    hidden = server.extract(samples)[0]["hidden_states"]
    hs = _alone(debug_target, samples[0])
    D = debug_target.hidden_size
    torch.testing.assert_close(hidden[:, D:], hs[3][0], atol=1e-5, rtol=1e-5)  # layer 2
    # layer 7 is the last decoder layer: captured before the final norm, whose output is hs[-1]
    norm = debug_target.model.model.norm
    torch.testing.assert_close(norm(hidden[:, :D]), hs[-1][0], atol=1e-5, rtol=1e-5)
    assert not torch.allclose(hidden[:, :D], hs[-1][0])


def test_forward_stops_after_the_deepest_needed_layer(debug_target, tmp_path):
    calls = []
    model = debug_target.model
    handles = [model.lm_head.register_forward_hook(lambda *a: calls.append("lm_head"))]
    handles += [layer.register_forward_hook(lambda m, a, o, i=i: calls.append(i)) for i, layer in enumerate(model.model.layers)]
    try:
        _server(debug_target, tmp_path, layer_ids=[1, 3]).extract(_samples(debug_target, [Conversation("a", PROMPTS[0])]))
        assert calls == [0, 1, 2, 3]
        calls.clear()
        _server(debug_target, tmp_path, "eagle3").extract(_samples(debug_target, [Conversation("a", PROMPTS[0])]))
        assert calls == list(range(8))  # eagle3 needs the final norm: all layers, still no LM head
    finally:
        for h in handles:
            h.remove()


def test_capture_writes_blobs_that_read_back(debug_target, tmp_path):
    samples = _samples(debug_target, [Conversation(f"s/{i}", p) for i, p in enumerate(PROMPTS)])
    server = _server(debug_target, tmp_path, "dspark", dtype="bfloat16")
    refs = server.capture(samples)
    features = server.extract(samples)
    assert [r.sample_id for r in refs] == [s.sample_id for s in samples]
    assert refs[0].key == server.key_for("s/0") and "/" not in refs[0].key.rsplit("/", 1)[1].replace(".safetensors", "")
    for ref, sample, feats in zip(refs, samples, features):
        got = server.store.get(ref)
        assert set(got) == {"input_ids", "loss_mask", "hidden_states", "last_hidden_states"}
        assert got["hidden_states"].dtype == torch.bfloat16
        for name in got:
            assert torch.equal(got[name], feats[name])
        assert ref.num_tokens == sample.num_tokens and ref.contract == server.contract.contract_id
        assert ref.tensor("hidden_states").shape == (sample.num_tokens, 5 * 64)
    server.close()


def test_pack_batches_respects_the_token_budget(debug_target):
    convs = [Conversation(f"c{i}", (("user", "x" * (5 * i + 1)), ("assistant", "y" * i))) for i in range(40)]
    samples = _samples(debug_target, convs)
    batches = pack_batches(samples, max_batch_tokens=400, max_batch_size=6)
    assert sorted(s.sample_id for b in batches for s in b) == sorted(s.sample_id for s in samples)
    for batch in batches:
        longest = max(s.num_tokens for s in batch)
        assert len(batch) <= 6 and (len(batch) * longest <= 400 or len(batch) == 1)
    ids, mask = pad_batch(batches[0], pad_token_id=2)
    assert mask.sum().item() == sum(s.num_tokens for s in batches[0])


def test_contract_of_another_target_is_refused(debug_target, tmp_path):
    from specray.capture.target import load_target

    other = load_target("debug:1")
    server_contract = _server(other, tmp_path).contract
    with pytest.raises(ValueError, match="another target"):
        CaptureServer(debug_target, server_contract, FeatureStore(tmp_path.as_uri()))


@pytest.mark.slow
def test_padded_batch_equals_alone_on_smollm2(smollm2, tmp_path):
    convs = list(load_conversations("sharegpt", limit=12))
    samples = _samples(smollm2, convs, max_length=160)
    by_length = {}
    for s in filter(None, samples):
        by_length.setdefault(s.num_tokens, s)
    batch = sorted(by_length.values(), key=lambda s: s.num_tokens)[:3]
    batch = [batch[0], batch[-1], batch[1]] if len(batch) == 3 else batch
    for algorithm in ("dflash", "eagle3"):
        server = _server(smollm2, tmp_path, algorithm)
        _check_padded_batch_equals_alone(smollm2, server, batch, atol=2e-4)
