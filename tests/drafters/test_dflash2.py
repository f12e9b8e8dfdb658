"""drafters/dflash2.py: a fresh DFlash 2 computes DFlash's logits and greedy drafts (identity
convolution, no-op selector) and keeps them when warm-started from a DFlash state; convolution taps
never cross a block; the lattice's shape and rows; the serving block path equals training's."""

import pytest
import torch
from torch import nn

from specray.drafters.dflash import DFlashConfig, BlockLayout, DFlashDrafter
from specray.drafters.dflash2 import DFlash2Config, DFlash2Drafter, grouped_dynamic_conv
from specray.kernels.selector_walk import selector_walk

D, V, L = 32, 50, 3
BASE = dict(hidden_size=D, vocab_size=V, target_layer_ids=(1, 2, 3), mask_token_id=4, num_layers=2, num_heads=4,
            num_kv_heads=2, head_dim=8, intermediate_size=64, block_size=4)


def _shared():
    torch.manual_seed(7)
    return nn.Embedding(V, D), nn.Linear(D, V, bias=False)


def _pair():
    """A DFlash and a fresh DFlash 2 warm-started from its state (the backbone's weights)."""
    embed, head = _shared()
    torch.manual_seed(0)
    dflash = DFlashDrafter(DFlashConfig(**BASE), embed_tokens=embed, lm_head=head).eval()
    torch.manual_seed(1)
    dflash2 = DFlash2Drafter(DFlash2Config(**BASE, conv_group_size=8, selector_top_k=5, selector_rank=6),
                             embed_tokens=embed, lm_head=head).eval()
    missing, unexpected = dflash2.load_state_dict(dflash.state_dict(), strict=False)
    assert not unexpected and all("conv" in k or "candidate_selector" in k for k in missing)
    return dflash, dflash2


def _inputs(S=12, anchors=((3, 7),)):
    g = torch.Generator().manual_seed(1)
    hidden = torch.randn(1, S, L * D, generator=g)
    anchors = torch.tensor(anchors)
    ids = torch.randint(0, V, (1, S), generator=g)
    return hidden, torch.ones(1, S, dtype=torch.bool), torch.gather(ids, 1, anchors.clamp(min=0)), anchors


def test_fresh_dflash2_gives_dflash_logits_and_drafts():
    dflash, dflash2 = _pair()
    hidden, valid, anchor_ids, anchors = _inputs()
    with torch.no_grad():
        ours = dflash(hidden, valid, anchor_ids, anchors)  # [1, 2, 3, V]
        out = dflash2(hidden, valid, anchor_ids, anchors)
        index, _, lattice = dflash2.lattice(out.logits, out.hidden, anchor_ids)
    assert torch.equal(out.logits, ours)
    assert lattice.shape == (1, 2, 3, 5, 5)
    R = 2
    path, _ = selector_walk(lattice.view(R, 3, 5, 5).contiguous(), torch.zeros(R), torch.zeros(R, 3))
    drafts = index.view(R, 3, 5).gather(-1, path[..., None])[..., 0]
    assert torch.equal(drafts, ours.view(R, 3, V).argmax(-1))  # the walk starts as the unary choice


def test_trained_parts_change_the_logits_and_the_walk():
    _, dflash2 = _pair()
    hidden, valid, anchor_ids, anchors = _inputs()
    with torch.no_grad():
        base = dflash2(hidden, valid, anchor_ids, anchors).logits
        for layer in dflash2.layers:
            layer.mlp_conv.base_kernel[:, 1] = 0.5
        assert not torch.allclose(dflash2(hidden, valid, anchor_ids, anchors).logits, base)
        dflash2.candidate_selector.successor_codebook.normal_()
        out = dflash2(hidden, valid, anchor_ids, anchors)
        _, _, lattice = dflash2.lattice(out.logits, out.hidden, anchor_ids)
    assert not torch.equal(lattice[..., 1:, 0, :], lattice[..., 1:, 1, :])  # rows depend on the predecessor
    assert torch.equal(lattice[..., 0, 0, :], lattice[..., 0, 1, :])  # position 0: the anchor's row repeated


def test_conv_taps_never_cross_a_block():
    # two blocks of B = 3, one channel group; tap 1 weighs the previous row by 10
    x = torch.tensor([[1.0, 2.0, 3.0, 100.0, 200.0, 300.0]])[..., None].expand(1, 6, 4)
    base = torch.tensor([[1.0] * 4, [10.0] * 4])
    out = grouped_dynamic_conv(x, torch.zeros(1, 6, 2, 1), base, block_size=3)
    assert out[0, :, 0].tolist() == [1.0, 12.0, 23.0, 100.0, 1200.0, 2300.0]  # row 3 reads no row of block 0
    delta = torch.zeros(1, 6, 2, 2)
    delta[0, 4, 1, 1] = 1.0  # row 4, tap 1, group 1 (channels 2, 3)
    out = grouped_dynamic_conv(x, delta, base, block_size=3)
    assert out[0, 4].tolist() == [1200.0, 1200.0, 1300.0, 1300.0]


def test_serving_block_rows_equal_the_training_forward():
    _, dflash2 = _pair()
    with torch.no_grad():
        for layer in dflash2.layers:
            layer.attention_conv.base_kernel[:, 1] = 0.3
            layer.mlp_conv.kernel_projection.weight.normal_()
        hidden, valid, anchor_ids, anchors = _inputs(anchors=((7,),))
        train = dflash2(hidden, valid, anchor_ids, anchors).hidden[0, 0]  # [m, D]
        ctx = dflash2.project_context(hidden[:, :7])
        kv = dflash2.context_kv(ctx, torch.arange(7)[None])
        mask = BlockLayout(anchors, valid[:, :7], 4)
        block = dflash2.block_inputs(anchor_ids).view(1, 4)
        served = dflash2.forward_block(block, 7 + torch.arange(4)[None], kv, mask, slice(1, 3))[0]
    torch.testing.assert_close(served, train[:2], rtol=1e-5, atol=1e-5)


def test_config_checks():
    with pytest.raises(ValueError, match="conv_group_size"):
        DFlash2Config(**BASE, conv_group_size=5)
    with pytest.raises(ValueError, match="conv_kernel_size"):
        DFlash2Config(**BASE, conv_kernel_size=5)
    assert DFlash2Config(**dict(BASE, draft_vocab_size=3)).num_candidates == 3
