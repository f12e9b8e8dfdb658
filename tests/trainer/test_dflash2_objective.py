"""trainer/strategies/dflash2.py: the strict top-K selector CE is skipped exactly where the label is
outside the candidates; a fresh DFlash 2's loss is DFlash's plus the selector term, its walk's tau is
the unary teacher-forced tau; the selector term's stop-gradient and ramp."""

import math

import pytest
import torch
from torch import nn

from specray.drafters.dflash2 import DFlash2Config
from specray.trainer.loader import TrainBatch
from specray.trainer.strategies.dflash import DFlashStrategy
from specray.trainer.strategies.dflash2 import DFlash2Objective, DFlash2Strategy, selector_ce

D, V, L = 32, 50, 2


def test_selector_ce_skips_exactly_the_labels_outside_the_candidates():
    # one block, m = 3, K = 2; the label is candidate 1, absent, candidate 0
    scores = torch.tensor([[[[0.0, 1.0], [2.0, 0.0], [0.5, -0.5]]]])  # [1, 1, 3, 2]
    candidates = torch.tensor([[[[4, 7], [1, 2], [9, 3]]]])
    labels = torch.tensor([[[7, 5, 9]]])
    covered = torch.ones(1, 1, 3, dtype=torch.bool)
    w = torch.tensor([1.0, 0.5, 0.25])
    loss, in_top, target = selector_ce(scores, candidates, labels, covered, w)
    assert in_top.tolist() == [[[True, False, True]]] and target[in_top].tolist() == [1, 0]
    ce0 = math.log(1 + math.exp(1.0)) - 1.0
    ce2 = math.log(math.exp(0.5) + math.exp(-0.5)) - 0.5
    assert float(loss) == pytest.approx((1.0 * ce0 + 0.25 * ce2) / 1.25, rel=1e-6)
    scores.requires_grad_(True)
    selector_ce(scores, candidates, labels, covered, w)[0].backward()
    assert torch.equal(scores.grad[0, 0, 1], torch.zeros(2)) and scores.grad[0, 0, 0].abs().sum() > 0
    none, _, _ = selector_ce(scores, candidates, torch.tensor([[[0, 0, 0]]]), covered, w)
    assert float(none.detach()) == 0.0 and none.requires_grad  # no label is a candidate: nothing, still in the graph


class _Unary(nn.Module):
    """DFlash's view of a DFlash 2: the states of its unary logits (``.module`` is the drafter, as under DDP)."""

    def __init__(self, drafter):
        super().__init__()
        self.module = drafter

    def forward(self, *inputs, head=True):
        out = self.module(*inputs)
        return out.logits if head else out.hidden


def _batch(T=16):
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, V, (2, T), generator=g)
    mask = torch.ones(2, T, dtype=torch.bool)
    mask[:, :3] = False
    return TrainBatch(ids, mask, torch.ones(2, T, dtype=torch.bool), torch.randn(2, T, L * D, generator=g), None,
                      ["a", "b"], 2 * T)


def _strategy_and_model(**objective):
    torch.manual_seed(5)
    embed, head = nn.Embedding(V, D), nn.Linear(D, V, bias=False)
    cfg = DFlash2Config(hidden_size=D, vocab_size=V, target_layer_ids=(1, 2), mask_token_id=4, num_layers=1,
                        num_heads=4, num_kv_heads=2, head_dim=8, intermediate_size=64, block_size=5,
                        conv_group_size=8, selector_top_k=6, selector_rank=4)
    strategy = DFlash2Strategy(DFlash2Objective(num_anchors=4, **objective), seed=0)
    return strategy, strategy.build_model(cfg, embed_tokens=embed, lm_head=head), cfg


def test_fresh_dflash2_loss_is_dflash_plus_the_selector_term_and_its_walk_is_unary():
    strategy, model, cfg = _strategy_and_model()
    batch = _batch()
    loss, sums = strategy.forward_loss(model, cfg, batch, strategy.generator(0, 0))
    dflash = DFlashStrategy(DFlash2Objective(num_anchors=4), seed=0)
    base, base_sums = dflash.forward_loss(_Unary(model), cfg, batch, dflash.generator(0, 0))
    assert float(loss.detach()) > float(base.detach())
    summary = strategy.summarize(sums)
    assert summary["acc_by_pos"] == DFlashStrategy.summarize(base_sums)["acc_by_pos"]
    assert summary["tau_walk"] == summary["tau_tf"]  # a fresh selector walks the unary argmax
    assert len(summary["recallk_by_pos"]) == 4 and summary["recallk_by_pos"][0] >= summary["recall1_by_pos"][0]
    assert summary["topk_coverage"] > 0
    no_selector = DFlash2Strategy(DFlash2Objective(num_anchors=4, selector_weight=0.0), seed=0)
    zero, _ = no_selector.forward_loss(model, cfg, batch, no_selector.generator(0, 0))
    assert torch.equal(zero, base)


def test_stop_gradient_keeps_the_selector_term_off_the_backbone():
    strategy, model, cfg = _strategy_and_model(selector_stop_gradient=True, selector_weight=1.0)
    with torch.no_grad():
        model.candidate_selector.successor_codebook.normal_()
    batch = _batch()
    loss, _ = strategy.forward_loss(model, cfg, batch, strategy.generator(0, 0))
    loss.backward()
    with_sel = model.fc.weight.grad.clone()
    assert model.candidate_selector.successor_codebook.grad.abs().sum() > 0
    model.zero_grad()
    main = DFlash2Strategy(DFlash2Objective(num_anchors=4, selector_weight=0.0), seed=0)
    main.forward_loss(model, cfg, batch, main.generator(0, 0))[0].backward()
    torch.testing.assert_close(model.fc.weight.grad, with_sel)


def test_selector_weight_ramps_with_the_step():
    strategy, _, _ = _strategy_and_model(selector_weight=2.0, selector_ramp_steps=10)
    strategy.generator(5, 0)
    assert strategy.weight() == 1.0
    strategy.generator(30, 0)
    assert strategy.weight() == 2.0


def test_freeze_conv_trains_everything_but_the_convolutions():
    strategy, model, cfg = _strategy_and_model(freeze_conv=True)
    with torch.no_grad():
        model.candidate_selector.successor_codebook.normal_()
    loss, _ = strategy.forward_loss(model, cfg, _batch(), strategy.generator(0, 0))
    loss.backward()
    convs = [p for layer in model.layers for m in (layer.attention_conv, layer.mlp_conv) for p in m.parameters()]
    assert convs and all(not p.requires_grad and p.grad is None for p in convs)
    assert model.fc.weight.grad.abs().sum() > 0 and model.candidate_selector.successor_codebook.grad.abs().sum() > 0
    _, trained, _ = _strategy_and_model()
    assert all(p.requires_grad for layer in trained.layers for p in layer.attention_conv.parameters())
