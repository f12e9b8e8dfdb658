"""The drafters' attention without dense masks: DFlash's block attention (``BlockLayout``) and EAGLE-3's
training-time test (``ttt_attention``) equal attention under the dense reference mask, forward and
backward, whether they run as one chunk of queries or many (``chunked_rows``, checkpointed)."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from specray.drafters import dflash as dflash_module
from specray.drafters.common import chunked_rows
from specray.drafters.dflash import BlockLayout, DFlashConfig, DFlashDrafter
from specray.drafters.eagle3 import ttt_attention, ttt_attention_mask

D, V, L = 32, 50, 3


def _cfg(**kw) -> DFlashConfig:
    return DFlashConfig(hidden_size=D, vocab_size=V, target_layer_ids=(1, 2, 3), mask_token_id=4, num_layers=2,
                        num_heads=4, num_kv_heads=2, head_dim=8, intermediate_size=64, block_size=4, **kw)


def _reference_attention(attn, x, positions, ctx_k, ctx_v, layout: BlockLayout) -> torch.Tensor:
    """The attention as SDPA over the dense mask, with the block-key bias on every block key."""
    Bt, Q, _ = x.shape
    cfg = attn.cfg
    q = attn.q_norm(attn.q_proj(x).view(Bt, Q, cfg.num_heads, cfg.head_dim)).transpose(1, 2)
    q = attn.rope.rotate(q, positions)
    k_d, v_d = attn.project_kv(x, positions)
    k, v = torch.cat([ctx_k, k_d], dim=2), torch.cat([ctx_v, v_d], dim=2)
    S = ctx_k.shape[2]
    bias = torch.zeros(cfg.num_heads, 1, S + Q)
    if attn.block_key_bias is not None:
        bias[:, :, S:] = attn.block_key_bias[:, None, None]
    logit_bias = bias[None].masked_fill(~layout.dense()[:, None], float("-inf"))
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=logit_bias, enable_gqa=True)
    return attn.o_proj(out.transpose(1, 2).reshape(Bt, Q, -1))


LAYOUTS = {
    # name: (attention, sliding window, anchors per sequence, context validity per sequence)
    "full": ("full", None, [[5, 0, 9, -1, 2, 11], [3, 7, -1, -1, 12, 1]], [14, 10]),
    "sliding": ("sliding", 3, [[5, 0, 9, -1, 2, 11], [3, 7, -1, -1, 12, 1]], [14, 10]),
}


@pytest.mark.parametrize("name", sorted(LAYOUTS))
@pytest.mark.parametrize("bias", [0.0, 2.0])
@pytest.mark.parametrize("chunk", [4, 8, 1024])  # 4 queries: one block per chunk; 1024: a single chunk
def test_block_attention_equals_attention_under_the_dense_mask(monkeypatch, name, bias, chunk):
    monkeypatch.setattr(dflash_module, "ATTENTION_QUERY_CHUNK", chunk)
    attention, window, anchors, lengths = LAYOUTS[name]
    torch.manual_seed(0)
    cfg = _cfg(attention=attention, sliding_window=window, block_key_bias=bias)
    attn = dflash_module.DFlashAttention(cfg)
    anchors = torch.tensor(anchors)
    S, (Bt, N), B = 16, anchors.shape, cfg.block_size
    valid = torch.arange(S)[None, :] < torch.tensor(lengths)[:, None]  # right padding
    layout = BlockLayout(anchors, valid, B, attention, window)
    x = torch.randn(Bt, N * B, D, requires_grad=True)
    positions = (anchors.clamp(min=0)[..., None] + torch.arange(B)).reshape(Bt, N * B)
    ctx = torch.randn(Bt, S, D, requires_grad=True)
    ctx_k, ctx_v = attn.project_kv(ctx, torch.arange(S).expand(Bt, S))
    got = attn(x, positions, ctx_k, ctx_v, layout)
    want = _reference_attention(attn, x, positions, ctx_k, ctx_v, layout)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    weight = torch.randn_like(got)
    inputs = [x, ctx, *attn.parameters()]
    got_grads = torch.autograd.grad((got * weight).sum(), inputs, retain_graph=True)  # ctx's K/V feed both
    for a, b in zip(got_grads, torch.autograd.grad((want * weight).sum(), inputs)):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    rows = slice(1, 3)  # serving's rows of every block: the same rows of the whole computation
    with torch.no_grad():
        part = attn(x, positions, ctx_k, ctx_v, layout, rows)
    want_rows = got.detach().view(Bt, N, B, D)[:, :, rows].reshape(Bt, -1, D)
    torch.testing.assert_close(part, want_rows, rtol=1e-5, atol=1e-6)


def test_dense_layout_of_a_sliding_block_next_to_an_unused_slot():
    """Hand-built: S = 5, anchors (4, −1), B = 2, window 2: the block sees context 2 … 3 and its keys
    causally; the unused slot sees only its own rows."""
    mask = BlockLayout(torch.tensor([[4, -1]]), torch.ones(1, 5, dtype=torch.bool), 2, "sliding", 2).dense()[0]
    expected = torch.tensor([
        # ctx 0 1 2 3 4 | block | unused
        [0, 0, 1, 1, 0, 1, 0, 0, 0],
        [0, 0, 1, 1, 0, 1, 1, 0, 0],
        [0, 0, 0, 0, 0, 0, 0, 1, 0],
        [0, 0, 0, 0, 0, 0, 0, 0, 1],
    ], dtype=torch.bool)
    assert torch.equal(mask, expected)


def test_a_drafter_step_is_the_same_in_one_chunk_and_in_many(monkeypatch):
    """The training forward over 40 blocks per sequence, and its parameter gradients, with chunks
    of 2 blocks (checkpointed) as with a single chunk."""
    torch.manual_seed(0)
    model = DFlashDrafter(_cfg(), embed_tokens=nn.Embedding(V, D), lm_head=nn.Linear(D, V, bias=False))
    g = torch.Generator().manual_seed(1)
    S = 64
    hidden = torch.randn(2, S, L * D, generator=g)
    anchors = torch.stack([torch.randperm(S - 4, generator=g)[:40].sort().values for _ in range(2)])
    anchor_ids = torch.randint(0, V, anchors.shape, generator=g)
    valid = torch.ones(2, S, dtype=torch.bool)

    def step(chunk: int):
        monkeypatch.setattr(dflash_module, "ATTENTION_QUERY_CHUNK", chunk)
        model.zero_grad()
        logits = model(hidden, valid, anchor_ids, anchors)
        logits.float().logsumexp(-1).sum().backward()
        return logits.detach(), [p.grad.clone() for p in model.parameters()]

    one, one_grads = step(10_000)
    many, many_grads = step(8)
    torch.testing.assert_close(many, one, rtol=1e-5, atol=1e-5)
    for a, b in zip(many_grads, one_grads):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("chunk", [3, 7, 1024])
def test_ttt_attention_in_chunks_equals_the_explicit_mask_forward_and_backward(chunk):
    g = torch.Generator().manual_seed(0)
    B, H, Hkv, S, hd = 2, 4, 2, 17, 8
    q = torch.randn(B, H, S, hd, generator=g, requires_grad=True)
    keys = [torch.randn(B, Hkv, S, hd, generator=g, requires_grad=True) for _ in range(3)]
    values = [torch.randn(B, Hkv, S, hd, generator=g, requires_grad=True) for _ in range(3)]
    for step in range(3):
        got = ttt_attention(q, keys[: step + 1], values[: step + 1], chunk=chunk)
        k, v = torch.cat(keys[: step + 1], dim=2), torch.cat(values[: step + 1], dim=2)
        want = F.scaled_dot_product_attention(q, k, v, attn_mask=ttt_attention_mask(S, step), enable_gqa=True)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
        weight = torch.randn_like(got)
        inputs = [q, *keys[: step + 1], *values[: step + 1]]
        for a, b in zip(torch.autograd.grad((got * weight).sum(), inputs),
                        torch.autograd.grad((want * weight).sum(), inputs)):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_chunked_rows_checkpoints_only_under_autograd_with_several_chunks():
    """Several chunks under autograd: the backward runs each chunk's function again (recomputation);
    one chunk, or no autograd, runs each once."""
    calls = []
    x = torch.randn(10, 3, requires_grad=True)

    def rows(start, stop):
        calls.append((start, stop))
        return x[start:stop].exp()

    chunked_rows(rows, 10, 4).sum().backward()
    assert calls == [(0, 4), (4, 8), (8, 10), (8, 10), (4, 8), (0, 4)]
    torch.testing.assert_close(x.grad, x.detach().exp())
    calls.clear()
    chunked_rows(rows, 10, 16).sum().backward()
    assert calls == [(0, 10)]
    calls.clear()
    with torch.no_grad():
        chunked_rows(rows, 10, 4)
    assert calls == [(0, 4), (4, 8), (8, 10)]
