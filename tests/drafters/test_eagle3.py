import pytest
import torch
import torch.nn.functional as F
from torch import nn

from specray.drafters.eagle3 import (
    Eagle3Config,
    Eagle3Drafter,
    Eagle3Section,
    debug_config,
    ttt_attention,
    ttt_attention_mask,
)

D, V = 32, 50


def _drafter(**kw):
    torch.manual_seed(0)
    cfg = Eagle3Config(hidden_size=D, vocab_size=V, target_layer_ids=(1, 2, 3), num_heads=4, num_kv_heads=2,
                       head_dim=8, intermediate_size=64, **kw)
    embed, head = nn.Embedding(V, D), nn.Linear(D, V, bias=False)
    return Eagle3Drafter(cfg, embed_tokens=embed, lm_head=head).eval()


def _inputs(S=7, B=1, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(B, S, 3 * D, generator=g), torch.randint(0, V, (B, S), generator=g)


def _causal_rows(model, state, tokens, positions):
    """Every row of ``state``/``tokens`` through the serving path: no cache, causal mask."""
    B, T = tokens.shape
    past = [(state.new_zeros(B, 2, 0, 8), state.new_zeros(B, 2, 0, 8)) for _ in model.layers]
    mask = torch.ones(T, T, dtype=torch.bool).tril().expand(B, T, T)
    return model.forward_cached(state, tokens, positions, past, mask)


def test_ttt_mask_two_step_unroll_over_four_rows():
    expected = torch.tensor([
        # step 0 keys (causal) | step 1 keys (diagonal)
        [1, 0, 0, 0, 1, 0, 0, 0],
        [1, 1, 0, 0, 0, 1, 0, 0],
        [1, 1, 1, 0, 0, 0, 1, 0],
        [1, 1, 1, 1, 0, 0, 0, 1],
    ], dtype=torch.bool)
    assert torch.equal(ttt_attention_mask(4, 1), expected)
    assert torch.equal(ttt_attention_mask(4, 0), expected[:, :4])
    three = ttt_attention_mask(4, 2)  # a third step adds one more diagonal block
    assert torch.equal(three[:, :8], expected) and torch.equal(three[:, 8:], torch.eye(4, dtype=torch.bool))


def test_ttt_attention_equals_attention_under_the_explicit_mask():
    g = torch.Generator().manual_seed(0)
    B, H, Hkv, S, hd = 2, 4, 2, 5, 8
    q = torch.randn(B, H, S, hd, generator=g)
    keys = [torch.randn(B, Hkv, S, hd, generator=g) for _ in range(3)]
    values = [torch.randn(B, Hkv, S, hd, generator=g) for _ in range(3)]
    for step in range(3):
        got = ttt_attention(q, keys[: step + 1], values[: step + 1])
        k, v = torch.cat(keys[: step + 1], dim=2), torch.cat(values[: step + 1], dim=2)
        want = F.scaled_dot_product_attention(q, k, v, attn_mask=ttt_attention_mask(S, step), enable_gqa=True)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_ttt_step0_equals_a_plain_causal_forward():
    model = _drafter()
    hidden, ids = _inputs(S=7, B=2)
    with torch.no_grad():
        rows = torch.ones(1, 2, 7, dtype=torch.bool)
        (logits,) = model(hidden, ids, rows)  # [2 * 7, V]
        tokens = F.pad(ids[:, 1:], (0, 1))  # row t reads x_{t+1}
        state, _ = _causal_rows(model, model.fuse(hidden), tokens, torch.arange(1, 8).expand(2, 7))
        torch.testing.assert_close(logits, model.compute_logits(state).flatten(0, 1), rtol=1e-5, atol=1e-5)


def test_ttt_later_steps_equal_the_serving_chain():
    """Step i of the unroll at row t = the serving chain: step-0 rows 0..t cached, then i rows fed
    the drafter's own states and the teacher-forced tokens x_{t+2}, …, at positions t+2, …"""
    model = _drafter(num_layers=2)
    hidden, ids = _inputs(S=8)
    steps, t = 3, 4
    with torch.no_grad():
        rows = torch.zeros(steps, 1, 8, dtype=torch.bool)
        rows[:, 0, t] = True
        unrolled = model(hidden, ids, rows)  # per step [1, V]
        tokens = F.pad(ids[:, 1:], (0, 1))
        ctx_state, ctx_kv = _causal_rows(model, model.fuse(hidden)[:, : t + 1], tokens[:, : t + 1],
                                         torch.arange(1, t + 2)[None])
        state = ctx_state[:, -1:]
        torch.testing.assert_close(unrolled[0], model.compute_logits(state[0]), rtol=1e-5, atol=1e-5)
        for i in range(1, steps):
            C = ctx_kv[0][0].shape[2]
            mask = torch.ones(1, 1, C + 1, dtype=torch.bool)
            state, new_kv = model.forward_cached(state, ids[:, t + 1 + i : t + 2 + i], torch.tensor([[t + 1 + i]]),
                                                 ctx_kv, mask)
            ctx_kv = [(torch.cat([k, nk], 2), torch.cat([v, nv], 2)) for (k, v), (nk, nv) in zip(ctx_kv, new_kv)]
            torch.testing.assert_close(unrolled[i], model.compute_logits(state[0]), rtol=1e-5, atol=1e-5)


def test_no_row_reads_a_later_row():
    model = _drafter()
    hidden, ids = _inputs(S=8)
    rows = torch.ones(3, 1, 8, dtype=torch.bool)
    with torch.no_grad():
        base = model(hidden, ids, rows)
        changed = hidden.clone()
        changed[:, 5:] += 3.0  # target features of rows 5.. change; tokens stay
        out = model(changed, ids, rows)
    for step in range(3):
        torch.testing.assert_close(base[step].view(8, V)[:5], out[step].view(8, V)[:5])
        assert not torch.allclose(base[step].view(8, V)[5:], out[step].view(8, V)[5:])


@pytest.mark.parametrize("norm_before_residual", [False, True])
def test_residual_is_the_state_or_its_norm(norm_before_residual):
    """With the attention and MLP outputs zeroed a layer returns its residual: the incoming state
    (EAGLE-3's reference) or hidden_norm(state) with norm_before_residual."""
    model = _drafter(norm_before_residual=norm_before_residual)
    layer = model.layers[0]
    with torch.no_grad():
        layer.self_attn.o_proj.weight.zero_()
        layer.mlp.down_proj.weight.zero_()
        layer.hidden_norm.weight.fill_(2.0)
        state = torch.randn(1, 3, D)
        out, _ = _causal_rows(model, state, torch.tensor([[1, 2, 3]]), torch.tensor([[1, 2, 3]]))
    assert torch.allclose(out, layer.hidden_norm(state) if norm_before_residual else state)


def test_attention_reads_the_embedding_then_the_state_2d_wide():
    model = _drafter(num_layers=2)
    first, second = model.layers
    assert first.self_attn.q_proj.weight.shape == (4 * 8, 2 * D)
    assert first.self_attn.k_proj.weight.shape == first.self_attn.v_proj.weight.shape == (2 * 8, 2 * D)
    assert second.self_attn.q_proj.weight.shape == (4 * 8, D) and not hasattr(second, "hidden_norm")
    with torch.no_grad():  # the first D input columns read the token embedding: zeroing them drops the token
        for proj in (first.self_attn.q_proj, first.self_attn.k_proj, first.self_attn.v_proj):
            proj.weight[:, :D] = 0
        state = torch.randn(1, 2, D)
        a, _ = _causal_rows(model, state, torch.tensor([[3, 4]]), torch.tensor([[1, 2]]))
        b, _ = _causal_rows(model, state, torch.tensor([[9, 11]]), torch.tensor([[1, 2]]))
    torch.testing.assert_close(a, b)


def test_state_dict_has_peer_names_and_no_target_weights():
    model = _drafter(num_layers=2, draft_vocab_size=10)
    names = set(model.state_dict())
    first = {f"layers.0.{n}.weight" for n in ("input_layernorm", "hidden_norm", "self_attn.q_proj", "self_attn.k_proj",
                                               "self_attn.v_proj", "self_attn.o_proj", "post_attention_layernorm",
                                               "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")}
    second = {n.replace("layers.0", "layers.1") for n in first} - {"layers.1.hidden_norm.weight"}
    assert names == first | second | {"fc.weight", "norm.weight", "draft_vocab"}
    assert model.fc.weight.shape == (D, 3 * D)


def test_draft_vocabulary_head_and_mappings():
    model = _drafter(draft_vocab_size=5)
    vocab = torch.tensor([2, 7, 11, 30, 49])
    model.set_draft_vocab(vocab)
    hidden, ids = _inputs(S=4)
    with torch.no_grad():
        (logits,) = model(hidden, ids, torch.ones(1, 1, 4, dtype=torch.bool))
        full = model.lm_head(model.norm(torch.randn(3, D)))
    assert logits.shape == (4, 5)
    assert torch.equal(model.draft_to_target(torch.tensor([0, 4])), torch.tensor([2, 49]))
    assert torch.equal(model.target_to_draft(torch.tensor([7, 8])), torch.tensor([1, -1]))
    assert full.shape == (3, V)


def test_config_round_trip_and_bad_values():
    cfg = Eagle3Config(hidden_size=D, vocab_size=V, target_layer_ids=[1, 2, 3], draft_vocab_size=8,
                       norm_before_residual=True)
    assert Eagle3Config.from_dict(cfg.to_dict()) == cfg and cfg.to_dict()["target_layer_ids"] == [1, 2, 3]
    with pytest.raises(ValueError, match="unknown EAGLE-3 config keys"):
        Eagle3Config.from_dict({**cfg.to_dict(), "block_size": 8})
    with pytest.raises(ValueError, match="multiple of num_kv_heads"):
        Eagle3Config(hidden_size=D, vocab_size=V, target_layer_ids=(1,), num_heads=3, num_kv_heads=2)
    with pytest.raises(ValueError, match="draft_vocab_size must be in"):
        Eagle3Config(hidden_size=D, vocab_size=V, target_layer_ids=(1,), draft_vocab_size=V + 1)


def test_section_and_debug_config_take_the_targets_sizes(debug_target):
    section = Eagle3Section(draft_vocab_size=64, num_heads=2)
    cfg = section.drafter_config(debug_target, (1, 3, 4))
    tcfg = debug_target.model.config
    assert (cfg.hidden_size, cfg.vocab_size, cfg.target_layer_ids) == (64, debug_target.vocab_size, (1, 3, 4))
    assert (cfg.num_heads, cfg.num_kv_heads, cfg.intermediate_size) == (2, tcfg.num_key_value_heads, tcfg.intermediate_size)
    assert cfg.draft_vocab_size == 64 and cfg.num_layers == 1 and not cfg.norm_before_residual
    with pytest.raises(ValueError):
        Eagle3Section(algorithm="dflash")
    with pytest.raises(ValueError, match="block_size"):
        Eagle3Section(block_size=8)
    debug = debug_config(debug_target)
    assert debug.target_layer_ids == (1, 3, 4)  # the eagle3 contract's default for 8 layers
    model = Eagle3Drafter(debug, embed_tokens=debug_target.model.model.embed_tokens, lm_head=debug_target.model.lm_head)
    assert "embed_tokens.weight" not in model.state_dict()
