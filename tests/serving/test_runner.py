import pytest
import torch

from specray.kernels import decode_cpu
from specray.serving.kv_cache import SlotKVCache
from specray.serving.runner import LlamaRunner


def _prompt(target, text):
    ids = target.tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                               tokenize=True, return_dict=True)["input_ids"]
    return torch.tensor(ids)


def _reference(target, ids):
    with torch.inference_mode():
        out = target.model(input_ids=ids[None], output_hidden_states=True)
    return out.logits[0], out.hidden_states


def _native(flag):
    """A runner's ``native`` argument for a test over both paths (skipped where the kernels did not build)."""
    if flag and not decode_cpu.available():
        pytest.skip(f"fused CPU kernels unavailable: {decode_cpu.unavailable_reason()}")
    return flag


def _check_runner_matches_transformers(target, atol, native=None):
    runner = LlamaRunner(target.model, num_slots=3, max_len=512, capture_layer_ids=(1, 3), native=native)
    prompts = [_prompt(target, "Hi"), _prompt(target, "Tell me a long story about a dragon, please.")]
    slots = torch.tensor([runner.cache.allocate(), runner.cache.allocate()])
    T = max(len(p) for p in prompts)
    ids = torch.zeros(2, T, dtype=torch.long)
    for b, p in enumerate(prompts):
        ids[b, : len(p)] = p
    out = runner.forward(ids, slots, torch.tensor([len(p) for p in prompts]))
    for b, p in enumerate(prompts):
        logits, hs = _reference(target, p)
        torch.testing.assert_close(out.logits[b, : len(p)], logits, atol=atol, rtol=1e-4)
        torch.testing.assert_close(out.hidden[3][b, : len(p)], hs[4][0], atol=atol, rtol=1e-4)
        runner.cache.commit(int(slots[b]), len(p))
    # decode steps of one row per request: both requests at once (consecutive slots: cache views),
    # in reversed slot order (gathered cache copies), then each alone (a lone row runs as two)
    seqs = [p.clone() for p in prompts]
    for order in ([0, 1], [1, 0], [0], [1]):
        nxt = torch.stack([torch.tensor([int(seqs[b][-1]) * 7 % 200 + 20]) for b in order])  # any tokens
        out = runner.forward(nxt, slots[order], torch.ones(len(order), dtype=torch.long))
        assert out.logits.shape[:2] == (len(order), 1) and out.hidden[3].shape[:2] == (len(order), 1)
        for j, b in enumerate(order):
            seqs[b] = torch.cat([seqs[b], nxt[j]])
            logits, hs = _reference(target, seqs[b])
            torch.testing.assert_close(out.logits[j, 0], logits[-1], atol=atol, rtol=1e-4)
            torch.testing.assert_close(out.hidden[1][j, 0], hs[2][0, -1], atol=atol, rtol=1e-4)
            runner.cache.commit(int(slots[b]), 1)


@pytest.mark.parametrize("native", [True, False])
def test_runner_matches_transformers_debug(debug_target, native):
    _check_runner_matches_transformers(debug_target, atol=1e-4, native=_native(native))


@pytest.mark.parametrize("native", [True, False])
def test_captured_layers_are_written_side_by_side_into_one_features_tensor(debug_target, native):
    """``features`` holds the captured layers' outputs in ``capture_layer_ids`` order; ``hidden``
    views its columns; ``features_of`` is that tensor itself for the same order (no copy on a
    plain step's path) and the columns rearranged for another. A repeated layer is refused."""
    runner = LlamaRunner(debug_target.model, num_slots=2, max_len=64, capture_layer_ids=(0, 2), native=_native(native))
    ids = torch.tensor([[5, 9, 11], [7, 3, 2]])
    out = runner.forward(ids, torch.tensor([0, 1]), torch.tensor([3, 3]))
    _, hs = _reference(debug_target, ids[1])
    D = debug_target.model.config.hidden_size
    assert out.layers == (0, 2) and out.features.shape == (2, 3, 2 * D)
    torch.testing.assert_close(out.features[1, :, D:], hs[3][0], atol=1e-4, rtol=1e-4)
    assert out.hidden[2].data_ptr() == out.features[..., D:].data_ptr()
    assert out.features_of((0, 2)) is out.features
    assert torch.equal(out.features_of((2, 0)), torch.cat([out.hidden[2], out.hidden[0]], dim=-1))
    assert torch.equal(out.features_of((2,)), out.hidden[2])
    prefilled = runner.prefill([[5, 9, 11], [7, 3]], torch.tensor([0, 1]))
    assert prefilled.features.shape == (2, 3, 2 * D) and not prefilled.features[1, 2].any()  # zero padding
    torch.testing.assert_close(prefilled.features[0], out.features[0], atol=1e-5, rtol=1e-5)
    runner.capture_layer_ids = ()
    bare = runner.forward(ids, torch.tensor([0, 1]), torch.tensor([3, 3]))
    assert bare.features is None and bare.layers == () and bare.hidden == {}
    with pytest.raises(ValueError, match="repeat a layer"):
        LlamaRunner(debug_target.model, num_slots=1, max_len=8, capture_layer_ids=(1, 1))


@pytest.mark.slow
@pytest.mark.parametrize("native", [True, False])
def test_runner_matches_transformers_smollm2(smollm2, native):
    _check_runner_matches_transformers(smollm2, atol=2e-3, native=_native(native))


def test_uncommitted_rows_are_never_context(debug_target):
    """After a rejection the cache equals one built from the accepted prefix alone."""
    target = debug_target
    prompt = _prompt(target, "Count: one two three")
    drafts = torch.tensor([40, 41, 42, 43])
    a = LlamaRunner(target.model, num_slots=1, max_len=256)
    slot = torch.tensor([a.cache.allocate()])
    a.forward(prompt[None], slot, torch.tensor([len(prompt)]))
    a.cache.commit(0, len(prompt))
    a.forward(drafts[None], slot, torch.tensor([4]))  # verify 4 rows...
    a.cache.commit(0, 2)  # ...accept 2: rows 3 and 4 are rejected scratch
    after_a = a.forward(torch.tensor([[99]]), slot, torch.tensor([1]))
    a.cache.commit(0, 1)

    b = LlamaRunner(target.model, num_slots=1, max_len=256)
    b.cache.allocate()
    prefix = torch.cat([prompt, drafts[:2]])
    b.forward(prefix[None], slot, torch.tensor([len(prefix)]))
    b.cache.commit(0, len(prefix))
    after_b = b.forward(torch.tensor([[99]]), slot, torch.tensor([1]))
    b.cache.commit(0, 1)
    torch.testing.assert_close(after_a.logits, after_b.logits, atol=1e-5, rtol=1e-5)
    n = len(prefix) + 1
    for layer in range(len(a.layers)):
        torch.testing.assert_close(a.cache.k[layer, 0, :, :n], b.cache.k[layer, 0, :, :n], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(a.cache.v[layer, 0, :, :n], b.cache.v[layer, 0, :, :n], atol=1e-5, rtol=1e-5)
    assert int(a.cache.committed[0]) == int(b.cache.committed[0]) == n


def test_cache_write_puts_each_request_at_its_own_start():
    cache = SlotKVCache(num_layers=2, num_slots=3, max_len=8, num_kv_heads=2, head_dim=4)
    k, v = torch.randn(2, 2, 3, 4), torch.randn(2, 2, 3, 4)  # [B, Hkv, T, hd]
    cache.write(1, torch.tensor([2, 0]), torch.tensor([4, 1]), k, v)
    assert torch.equal(cache.k[1, 2, :, 4:7], k[0]) and torch.equal(cache.k[1, 0, :, 1:4], k[1])
    assert torch.equal(cache.v[1, 2, :, 4:7], v[0]) and torch.equal(cache.v[1, 0, :, 1:4], v[1])
    assert cache.k[0].abs().sum() == 0 and cache.k[1, 1].abs().sum() == 0  # nothing else touched
    assert cache.k[1, 2, :, :4].abs().sum() == 0 and cache.k[1, 0, :, 4:].abs().sum() == 0
    with pytest.raises(ValueError, match="KV capacity of 8"):
        cache.write(0, torch.tensor([1]), torch.tensor([6]), k[:1], v[:1])


def test_lone_row_fits_the_last_cache_position(debug_target):
    runner = LlamaRunner(debug_target.model, num_slots=1, max_len=8)
    slot = torch.tensor([runner.cache.allocate()])
    runner.forward(torch.arange(3, 10)[None], slot, torch.tensor([7]))
    runner.cache.commit(0, 7)
    out = runner.forward(torch.tensor([[11]]), slot, torch.tensor([1]))  # position 7 of 0..7
    with torch.inference_mode():
        reference = debug_target.model(input_ids=torch.cat([torch.arange(3, 10), torch.tensor([11])])[None]).logits
    torch.testing.assert_close(out.logits[0, 0], reference[0, -1], atol=1e-4, rtol=1e-4)


def test_capacity_and_slot_errors(debug_target):
    runner = LlamaRunner(debug_target.model, num_slots=1, max_len=8)
    runner.cache.allocate()
    with pytest.raises(RuntimeError, match="no free KV slot"):
        runner.cache.allocate()
    with pytest.raises(ValueError, match="exceeds the engine's max_len 8"):
        runner.forward(torch.zeros(1, 9, dtype=torch.long), torch.tensor([0]), torch.tensor([9]))
    with pytest.raises(ValueError, match="cannot commit"):
        runner.cache.commit(0, 9)


@pytest.mark.parametrize("native", [True, False])
@pytest.mark.parametrize("order", [[0, 2, 3], [3, 0, 2], [0, 5]])
def test_decode_over_a_slot_window_with_holes_or_gathered_equals_each_request_alone(debug_target, order, native):
    """[0, 2, 3] / [3, 0, 2]: views of the window 0..3 (slot 1's rows computed and dropped);
    [0, 5]: sparser than half the window, gathered copies. Each request's logits and cache rows
    equal those of a forward of that request alone."""
    target = debug_target
    batched, alone = (LlamaRunner(target.model, num_slots=6, max_len=128, native=_native(native)) for _ in range(2))
    for runner in (batched, alone):
        for s in range(6):
            runner.cache.allocate()
            prompt = _prompt(target, "word " * (s + 1))
            runner.forward(prompt[None], torch.tensor([s]), torch.tensor([len(prompt)]))
            runner.cache.commit(s, len(prompt))
    assert (SlotKVCache.window(torch.tensor(order)) is None) == (order == [0, 5])
    ids = torch.tensor([[30 + s] for s in order])
    out = batched.forward(ids, torch.tensor(order), torch.ones(len(order), dtype=torch.long))
    for j, s in enumerate(order):
        ref = alone.forward(ids[j : j + 1], torch.tensor([s]), torch.ones(1, dtype=torch.long))
        torch.testing.assert_close(out.logits[j], ref.logits[0], atol=1e-5, rtol=1e-5)
        n = int(alone.cache.committed[s]) + 1
        torch.testing.assert_close(batched.cache.k[:, s, :, :n], alone.cache.k[:, s, :, :n], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("native", [True, False])
def test_packed_prefill_equals_the_padded_forward(debug_target, native):
    """``prefill`` (packed rows, logits of last rows only) gives what ``forward`` on the right-padded
    batch gives for the real rows: last-row logits, captured layers, and the K/V it writes — for
    prompts of different lengths, one slot already holding committed rows."""
    runners = [LlamaRunner(debug_target.model, num_slots=3, max_len=128, capture_layer_ids=(0, 2), native=_native(native))
               for _ in range(2)]
    prompts = [[5, 9, 31, 7], [40, 2, 2, 8, 19, 3, 77], [12]]
    for runner in runners:  # slot 1 holds 3 committed rows
        runner.forward(torch.tensor([[3, 4, 5]]), torch.tensor([1]), torch.tensor([3]))
        runner.cache.commit(1, 3)
    slots = torch.tensor([2, 1, 0])
    packed = runners[0].prefill(prompts, slots)
    ids = torch.zeros(3, 7, dtype=torch.long)
    for b, p in enumerate(prompts):
        ids[b, : len(p)] = torch.tensor(p)
    lengths = torch.tensor([len(p) for p in prompts])
    padded = runners[1].forward(ids, slots, lengths)
    assert packed.logits.shape == (3, 1, padded.logits.shape[-1])
    torch.testing.assert_close(packed.logits[:, 0], padded.logits[torch.arange(3), lengths - 1], atol=1e-5, rtol=1e-5)
    for b, (slot, n) in enumerate(zip(slots.tolist(), lengths.tolist())):
        for layer in (0, 2):
            torch.testing.assert_close(packed.hidden[layer][b, :n], padded.hidden[layer][b, :n], atol=1e-5, rtol=1e-5)
            assert not packed.hidden[layer][b, n:].any()  # zero padding
        start = 3 if slot == 1 else 0
        for cache in ("k", "v"):
            got, want = getattr(runners[0].cache, cache), getattr(runners[1].cache, cache)
            torch.testing.assert_close(got[:, slot, :, : start + n], want[:, slot, :, : start + n], atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="exceeds the engine's max_len 128"):
        runners[0].prefill([[1] * 126], torch.tensor([1]))


def test_runners_on_one_model_share_its_prepared_weights():
    from specray.capture.target import load_target

    target = load_target("debug:3")  # its own model object: this test changes a weight in place
    a = LlamaRunner(target.model, num_slots=1, max_len=32)
    b = LlamaRunner(target.model, num_slots=2, max_len=64, capture_layer_ids=(1,))
    assert a.layers is b.layers and a.lm_head is b.lm_head  # one fused, prepacked copy for both
    assert a.cache is not b.cache
    ids = torch.tensor([[5, 6, 7]])
    before = a.forward(ids, torch.tensor([0]), torch.tensor([3])).logits
    with torch.no_grad():
        target.model.model.layers[0].mlp.down_proj.weight.mul_(2.0)  # an in-place change: prepared again
    c = LlamaRunner(target.model, num_slots=1, max_len=32)
    assert c.layers is not a.layers
    after = c.forward(ids, torch.tensor([0]), torch.tensor([3])).logits
    with torch.inference_mode():
        reference = target.model(input_ids=ids).logits
    assert not torch.allclose(before, after)
    torch.testing.assert_close(after, reference, atol=1e-4, rtol=1e-4)
