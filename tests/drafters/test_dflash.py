import pytest
import torch
from torch import nn

from specray.drafters.common import SMALL_M, Linear
from specray.drafters.dflash import DFlashConfig, BlockLayout, DFlashDrafter

D, V, L = 32, 50, 3


def _drafter(**kw):
    torch.manual_seed(0)
    cfg = DFlashConfig(hidden_size=D, vocab_size=V, target_layer_ids=(1, 2, 3), mask_token_id=4, num_layers=2,
                       num_heads=4, num_kv_heads=2, head_dim=8, intermediate_size=64, block_size=4, **kw)
    embed, head = nn.Embedding(V, D), nn.Linear(D, V, bias=False)
    return DFlashDrafter(cfg, embed_tokens=embed, lm_head=head).eval()


def _inputs(S=12, anchors=((3, 7),)):
    g = torch.Generator().manual_seed(1)
    hidden = torch.randn(1, S, L * D, generator=g)
    anchors = torch.tensor(anchors)
    ids = torch.randint(0, V, (1, S), generator=g)
    return hidden, torch.ones(1, S, dtype=torch.bool), torch.gather(ids, 1, anchors.clamp(min=0)), anchors


def test_tiny_mask_equals_hand_written():
    # S = 4 context positions, blocks anchored at 2 and 0 plus an unused slot, B = 2, full attention
    mask = BlockLayout(torch.tensor([[2, 0, -1]]), torch.tensor([[True, True, True, False]]), 2).dense()
    expected = torch.tensor([
        # ctx 0 1 2 3 | block0 | block1 | unused
        [1, 1, 0, 0, 1, 1, 0, 0, 0, 0],  # anchor 2, offset 0: sees context < 2 only
        [1, 1, 0, 0, 1, 1, 0, 0, 0, 0],  # anchor 2, offset 1: same context, whole block
        [0, 0, 0, 0, 0, 0, 1, 1, 0, 0],  # anchor 0: no context at all
        [0, 0, 0, 0, 0, 0, 1, 1, 0, 0],
        [0, 0, 0, 0, 0, 0, 0, 0, 1, 0],  # unused slot: only itself (finite softmax, no loss)
        [0, 0, 0, 0, 0, 0, 0, 0, 0, 1],
    ], dtype=torch.bool)
    assert torch.equal(mask[0], expected)


def test_sliding_mask_is_causal_in_block_and_windowed():
    mask = BlockLayout(torch.tensor([[3]]), torch.ones(1, 4, dtype=torch.bool), 3, "sliding", sliding_window=2).dense()
    expected = torch.tensor([
        [0, 1, 1, 0, 1, 0, 0],
        [0, 1, 1, 0, 1, 1, 0],
        [0, 1, 1, 0, 1, 1, 1],
    ], dtype=torch.bool)
    assert torch.equal(mask[0], expected)


@pytest.mark.parametrize("attention", ["full", "sliding"])
def test_no_anchor_leak(attention):
    kw = {"attention": attention, "sliding_window": 16} if attention == "sliding" else {}
    model = _drafter(**kw)
    hidden, valid, anchor_ids, anchors = _inputs()
    with torch.no_grad():
        base = model(hidden, valid, anchor_ids, anchors)  # [1, 2, 3, V]
        at_anchor = hidden.clone()
        at_anchor[:, 3:] += 5.0  # the anchor of block 0 (3) and everything after it
        out = model(at_anchor, valid, anchor_ids, anchors)
        assert torch.equal(out[:, 0], base[:, 0])  # block 0 never sees positions >= 3
        assert not torch.allclose(out[:, 1], base[:, 1])  # block 1 (anchor 7) sees 3..6
        before = hidden.clone()
        before[:, 2] += 5.0  # strictly before both anchors
        out = model(before, valid, anchor_ids, anchors)
        assert not torch.allclose(out[:, 0], base[:, 0]) and not torch.allclose(out[:, 1], base[:, 1])
        after_both = hidden.clone()
        after_both[:, 7:] += 5.0
        assert torch.equal(model(after_both, valid, anchor_ids, anchors), base)


def test_positions_are_anchor_plus_offset():
    model = _drafter()
    seen = []
    model.layers[0].attn.register_forward_pre_hook(lambda m, args: seen.append(args[1].clone()))
    hidden, valid, anchor_ids, anchors = _inputs()
    with torch.no_grad():
        model(hidden, valid, anchor_ids, anchors)
    assert seen[0].tolist() == [[3, 4, 5, 6, 7, 8, 9, 10]]


def test_blocks_are_independent_and_shared_modules_stay_out_of_the_state():
    model = _drafter()
    hidden, valid, anchor_ids, anchors = _inputs()
    with torch.no_grad():
        both = model(hidden, valid, anchor_ids, anchors)
        alone = model(hidden, valid, anchor_ids[:, 1:], anchors[:, 1:])
    torch.testing.assert_close(both[:, 1:], alone)
    names = set(model.state_dict())
    assert not any("embed" in n or "lm_head" in n for n in names)
    assert sum(p.numel() for p in model.parameters()) == sum(t.numel() for t in model.state_dict().values())


def test_block_key_bias_off_is_no_parameter_and_equals_a_zero_bias():
    """0 = off: no tensor in the state (hence none in an export), same logits as a bias of zeros."""
    off, on = _drafter(block_key_bias=0.0), _drafter(block_key_bias=4.0)
    assert all(layer.attn.block_key_bias is None for layer in off.layers)
    assert [n for n in on.state_dict() if n not in off.state_dict()] == [
        "layers.0.attn.block_key_bias", "layers.1.attn.block_key_bias"]
    inputs = _inputs()
    with torch.no_grad():
        assert not torch.allclose(off(*inputs), on(*inputs))
        for layer in on.layers:
            layer.attn.block_key_bias.zero_()
        torch.testing.assert_close(off(*inputs), on(*inputs))


def test_bad_configs():
    with pytest.raises(ValueError, match="block_size must be >= 2"):
        _drafter_cfg = DFlashConfig(hidden_size=D, vocab_size=V, target_layer_ids=(1,), mask_token_id=0, block_size=1)
    with pytest.raises(ValueError, match="mask_token_id 99 is outside"):
        DFlashConfig(hidden_size=D, vocab_size=V, target_layer_ids=(1,), mask_token_id=99)
    with pytest.raises(ValueError, match=r"block_key_bias must be >= 0 \(0 = off\)"):
        DFlashConfig(hidden_size=D, vocab_size=V, target_layer_ids=(1,), mask_token_id=0, block_key_bias=-1.0)
    with pytest.raises(ValueError, match="sliding_window"):
        DFlashConfig(hidden_size=D, vocab_size=V, target_layer_ids=(1,), mask_token_id=0, attention="sliding")
    with pytest.raises(ValueError, match="unknown DFlash config keys"):
        DFlashConfig.from_dict({"hidden_size": D, "vocab_size": V, "target_layer_ids": [1], "mask_token_id": 0, "x": 1})
    cfg = DFlashConfig(hidden_size=D, vocab_size=V, target_layer_ids=(1,), mask_token_id=0)
    with pytest.raises(ValueError, match="build the config from this target"):
        DFlashDrafter(cfg, embed_tokens=nn.Embedding(V + 1, D), lm_head=nn.Linear(D, V + 1))
    assert DFlashConfig.from_dict(cfg.to_dict()) == cfg


def test_drafter_finds_the_anchor_through_a_long_context():
    """The next token is a function of the anchor; 256 noise context positions must not hide it.

    Guards the block-key bias: without it this 1-layer drafter stays at chance here (the anchor
    gets a 1/S share of attention at init), with it position-1 accuracy passes 0.8.
    """
    from specray.trainer.loader import TrainBatch
    from specray.trainer.strategies.dflash import DFlashObjective, DFlashStrategy

    torch.manual_seed(0)
    V_, D_, S, Bt = 64, 64, 256, 4
    embed = nn.Embedding(V_, D_)
    nn.init.normal_(embed.weight, std=0.136)  # SmolLM2's embedding scale
    embed.requires_grad_(False)
    head = nn.Linear(D_, V_, bias=False)
    head.weight = embed.weight
    cfg = DFlashConfig(hidden_size=D_, vocab_size=V_, target_layer_ids=(1,), mask_token_id=0, num_layers=1,
                       num_heads=4, num_kv_heads=2, head_dim=16, intermediate_size=128, block_size=4,
                       block_key_bias=4.0)  # on: this is the bias's test (the default is off)
    strategy = DFlashStrategy(DFlashObjective(num_anchors=8))
    model = strategy.build_model(cfg, embed_tokens=embed, lm_head=head)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    g = torch.Generator().manual_seed(0)
    correct = count = 0
    for step in range(250):
        x = torch.zeros(Bt, S, dtype=torch.long)
        x[:, 0] = torch.randint(1, V_, (Bt,), generator=g)
        for t in range(1, S):
            x[:, t] = (x[:, t - 1] * 7 + 3) % V_
        ones = torch.ones(Bt, S, dtype=torch.bool)
        batch = TrainBatch(input_ids=x, loss_mask=ones, attention_mask=ones, hidden_states=torch.randn(Bt, S, D_, generator=g),
                           last_hidden_states=None, sample_ids=[""] * Bt, num_tokens=Bt * S)
        loss, metrics = strategy.forward_loss(model, cfg, batch, strategy.generator(step, 0))
        opt.zero_grad()
        loss.backward()
        opt.step()
        if step >= 230:
            correct += float(metrics["correct"][0])
            count += float(metrics["count"][0])
    assert correct / count > 0.8


def test_inference_logits_of_a_few_rows_equal_the_linear_heads():
    model = _drafter()
    hidden = torch.randn(2, 3, D)
    with torch.no_grad():
        fast = model.logits(hidden)  # <= 64 rows without grad: the (W @ xᵀ)ᵀ layout
    slow = model.lm_head(hidden)
    assert fast.shape == (2, 3, V)
    torch.testing.assert_close(fast, slow.detach(), rtol=1e-5, atol=1e-5)
    with torch.no_grad():  # a lone row runs as a 2-row product; only its own row comes back
        torch.testing.assert_close(model.logits(hidden[:1, :1]), slow.detach()[:1, :1], rtol=1e-5, atol=1e-5)
    with_grad = model.logits(hidden)  # training: nn.Linear itself, bit for bit, differentiable
    assert with_grad.requires_grad
    torch.testing.assert_close(with_grad, slow, rtol=0, atol=0)


@pytest.mark.parametrize("rows", [1, 2, 7, SMALL_M + 1])
def test_drafter_linears_take_the_small_m_layout_at_inference_only(rows):
    """Every projection of the drafter (q/k/v/o, MLP, fc) is a ``Linear``: at inference with few
    rows it computes (W @ xᵀ)ᵀ, the same product up to rounding; with grad it is nn.Linear exactly."""
    model = _drafter()
    linears = [m for m in model.modules() if isinstance(m, nn.Linear) and m is not model.lm_head]
    assert linears and all(isinstance(m, Linear) for m in linears)
    layer = model.layers[0].down_proj
    x = torch.randn(rows, layer.in_features)
    reference = nn.functional.linear(x, layer.weight)
    with torch.no_grad():
        torch.testing.assert_close(layer(x), reference, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(layer(x[None]), reference[None], rtol=1e-5, atol=1e-5)  # any leading dims
    assert torch.equal(layer(x), reference) and layer(x).requires_grad


def test_draft_vocabulary_restricts_the_shared_head_to_its_rows():
    full = _drafter()
    small = _drafter(draft_vocab_size=6)
    small.load_state_dict({k: v for k, v in full.state_dict().items()}, strict=False)
    small.lm_head.load_state_dict(full.lm_head.state_dict())
    small.embed_tokens.load_state_dict(full.embed_tokens.state_dict())
    vocab = torch.tensor([2, 3, 11, 17, 40, 49])
    small.set_draft_vocab(vocab[torch.randperm(6)])  # stored ascending whatever the order given
    assert torch.equal(small.draft_vocab, vocab) and "draft_vocab" in small.state_dict()
    hidden = torch.randn(2, 3, D)
    with torch.no_grad():
        expected = full.logits(hidden)[..., vocab]
        torch.testing.assert_close(small.logits(hidden), expected)  # inference layout
    torch.testing.assert_close(small.logits(hidden), expected)  # training layout (grad enabled)
    ids = torch.tensor([[3, 40], [5, 49]])
    assert small.target_to_draft(ids).tolist() == [[1, 4], [-1, 5]]  # 5 is outside the draft vocabulary
    assert small.draft_to_target(torch.tensor([0, 5])).tolist() == [2, 49]
    q = torch.softmax(torch.randn(4, 6), -1)
    q_full = small.to_target_distribution(q)
    assert q_full.shape == (4, V) and torch.equal(q_full[:, vocab], q)
    assert q_full.sum(-1).allclose(torch.ones(4)) and (q_full[:, 5] == 0).all()
    assert full.target_to_draft(ids) is ids and full.to_target_distribution(q_full) is q_full  # no vocabulary: identity


def test_bad_draft_vocabularies_are_refused():
    with pytest.raises(ValueError, match=r"draft_vocab_size must be in \[1, 50\]"):
        _drafter(draft_vocab_size=51)
    small = _drafter(draft_vocab_size=3)
    with pytest.raises(ValueError, match="needs 3 token ids"):
        small.set_draft_vocab(torch.tensor([1, 2]))
    with pytest.raises(ValueError, match="distinct"):
        small.set_draft_vocab(torch.tensor([1, 2, 2]))
    with pytest.raises(ValueError, match=r"must be in \[0, 50\)"):
        small.set_draft_vocab(torch.tensor([1, 2, 50]))
    small.draft_vocab.copy_(torch.tensor([4, 4, 9]))  # e.g. a tampered export
    with pytest.raises(ValueError, match="distinct"):
        small.validate_state()


@pytest.mark.parametrize("num_layers", [1, 2])
def test_forward_block_of_some_rows_equals_those_rows_of_the_whole_block(num_layers):
    torch.manual_seed(0)
    cfg = DFlashConfig(hidden_size=D, vocab_size=V, target_layer_ids=(1, 2, 3), mask_token_id=4,
                       num_layers=num_layers, num_heads=4, num_kv_heads=2, head_dim=8, intermediate_size=64, block_size=4)
    model = DFlashDrafter(cfg, embed_tokens=nn.Embedding(V, D), lm_head=nn.Linear(D, V, bias=False)).eval()
    S = 9
    ctx = model.project_context(torch.randn(1, S, L * D))
    kv = model.context_kv(ctx, torch.arange(S)[None])
    block = model.block_inputs(torch.tensor([[7]]))[0]
    positions = S + torch.arange(4)[None]
    mask = BlockLayout(torch.tensor([[S]]), torch.ones(1, S, dtype=torch.bool), 4)
    with torch.no_grad():
        full = model.forward_block(block, positions, kv, mask)
        for rows in (slice(1, 2), slice(1, 3), slice(1, 4)):
            torch.testing.assert_close(model.forward_block(block, positions, kv, mask, rows), full[:, rows])
