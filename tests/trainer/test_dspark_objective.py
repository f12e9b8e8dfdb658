"""DSpark objective (trainer/strategies/dspark.py): labels and supervision on hand-built masks, the
teacher at the label's predecessor, the detached confidence target, the weights, calibration metrics."""

from dataclasses import replace

import pytest
import torch

from specray.drafters import dspark
from specray.trainer.loader import TrainBatch
from specray.trainer.strategies import dspark as objective
from specray.trainer.strategies.dspark import DSparkObjective, DSparkStrategy, dspark_labels


def test_labels_previous_tokens_and_supervision_on_hand_built_masks():
    ids = torch.arange(100, 112)[None]  # token at position t is 100 + t
    mask = torch.tensor([[0, 1, 1, 1, 0, 1, 1, 1, 1, 1, 1, 1]], dtype=torch.bool)
    anchors = torch.tensor([[1, 5, 9, -1]])
    labels, prev, supervised = dspark_labels(ids, mask, anchors, 4)
    assert labels[0, 0].tolist() == [102, 103, 104, 105]  # offsets 1 … B from the anchor
    assert prev[0, 0].tolist() == [101, 102, 103, 104]  # row k's previous token sits at anchor + k
    assert supervised[0, 0].tolist() == [True, True, False, False]  # the gap at 4 stops the block, 5 stays off
    assert supervised[0, 1].tolist() == [True, True, True, True]
    assert supervised[0, 2].tolist() == [True, True, False, False]  # the tail: labels 12, 13 are past the end
    assert not supervised[0, 3].any()  # an unused anchor slot


def test_the_teacher_reads_the_labels_predecessor(debug_target):
    """A last hidden state equal to the LM head's row of token v makes the target predict v there:
    with last_hidden[t] built to predict x[t+1], the teacher's argmax at every supervised row is its label."""
    model = _model(debug_target)
    T = 16
    ids = torch.randint(0, debug_target.vocab_size, (1, T), generator=torch.Generator().manual_seed(0))
    head = debug_target.model.get_output_embeddings().weight.detach()
    last = torch.zeros(1, T, debug_target.hidden_size)
    last[0, :-1] = 50.0 * head[ids[0, 1:]]  # position t predicts the token at t + 1
    anchors = torch.tensor([[2, 7]])
    labels, _, supervised = dspark_labels(ids, torch.ones(1, T, dtype=torch.bool), anchors, 4)
    predecessors = anchors[..., None] + torch.arange(4)
    p, top = objective.teacher(model, last, predecessors, supervised)
    assert supervised.all() and torch.equal(p.argmax(-1), labels) and torch.equal(top, labels)
    assert p[supervised].max(-1).values.min() > 0.9


def _model(target, **overrides):
    cfg = replace(dspark.debug_config(target), **overrides)
    torch.manual_seed(0)
    model = DSparkStrategy().build_model(cfg, embed_tokens=target.model.get_input_embeddings(),
                                         lm_head=target.model.get_output_embeddings(),
                                         final_norm=target.model.model.norm)
    with torch.no_grad():
        model.markov_head.markov_w2.weight.normal_(0.0, 0.3)  # a head that moves q
    return model


def _batch(target, T=24):
    g = torch.Generator().manual_seed(4)
    ids = torch.randint(0, target.vocab_size, (2, T), generator=g)
    loss_mask = torch.ones(2, T, dtype=torch.bool)
    loss_mask[:, :4] = False
    return TrainBatch(input_ids=ids, attention_mask=torch.ones(2, T, dtype=torch.bool), loss_mask=loss_mask,
                      hidden_states=torch.randn(2, T, 3 * target.hidden_size, generator=g),
                      last_hidden_states=torch.randn(2, T, target.hidden_size, generator=g), sample_ids=["a", "b"],
                      num_tokens=2 * T)


def test_the_loss_reads_the_teacher_at_each_labels_predecessor(debug_target, monkeypatch):
    calls = []
    original = objective.teacher
    monkeypatch.setattr(objective, "teacher", lambda *args: calls.append(args) or original(*args))
    batch, model = _batch(debug_target), _model(debug_target)
    strategy = DSparkStrategy(DSparkObjective(num_anchors=4))
    loss, sums = strategy.forward_loss(model, model.config, batch, strategy.generator(0, 0))
    (_, last, positions, rows), = calls
    assert last is batch.last_hidden_states and rows.any()
    b = torch.arange(2)[:, None, None].expand_as(positions)
    labels, _, _ = dspark_labels(batch.input_ids, batch.loss_mask, positions[..., 0], 4)  # row 0 sits at the anchor
    assert torch.equal(batch.input_ids[b[rows], positions[rows] + 1], labels[rows])  # one before the label
    assert torch.isfinite(loss) and loss > 0 and sums["count"].shape == (4,)


def test_the_confidence_loss_leaves_its_target_detached(debug_target):
    """With only the confidence term, nothing that shapes q (here the sequence head's W2, which enters
    only q and so c*) gets a gradient; the confidence head does."""
    batch, model = _batch(debug_target), _model(debug_target)
    strategy = DSparkStrategy(DSparkObjective(num_anchors=4, ce_weight=0.0, l1_weight=0.0))
    loss, _ = strategy.forward_loss(model, model.config, batch, strategy.generator(0, 0))
    loss.backward()
    w2 = model.markov_head.markov_w2.weight.grad
    assert w2 is None or torch.equal(w2, torch.zeros_like(w2))
    assert model.confidence_head.proj.weight.grad.abs().sum() > 0
    model.zero_grad()
    both = DSparkStrategy(DSparkObjective(num_anchors=4))
    both.forward_loss(model, model.config, batch, both.generator(0, 0))[0].backward()
    assert model.markov_head.markov_w2.weight.grad.abs().sum() > 0  # the L1 and CE terms do train q


def test_weights_are_normalised_by_their_sum(debug_target):
    batch, model = _batch(debug_target), _model(debug_target)
    one = DSparkStrategy(DSparkObjective(num_anchors=4))
    two = DSparkStrategy(DSparkObjective(num_anchors=4, ce_weight=0.2, l1_weight=1.8, confidence_weight=2.0))
    with torch.no_grad():
        a = one.forward_loss(model, model.config, batch, one.generator(0, 0))[0]
        b = two.forward_loss(model, model.config, batch, two.generator(0, 0))[0]
    torch.testing.assert_close(a, b)
    with pytest.raises(ValueError, match="must be > 0"):
        DSparkObjective(ce_weight=0.0, l1_weight=0.0, confidence_weight=0.0)


def test_overlap_counts_teacher_mass_outside_the_draft_vocabulary():
    p = torch.tensor([[0.5, 0.3]])  # 0.2 of the teacher's mass is outside V_d
    q = torch.tensor([[0.5, 0.5]])
    assert objective.overlap_l1(p, q).item() == pytest.approx(0.2 + 0.2)  # c* = 0.8 = Σ min(p, q)


def test_summary_reports_calibration_per_position():
    strategy = DSparkStrategy(DSparkObjective(calibration_bins=2))
    supervised = torch.ones(1, 2, 2, dtype=torch.bool)
    confidence = torch.tensor([[[0.9, 0.2], [0.8, 0.3]]])  # position 0 in the high bin, position 1 in the low
    c_star = torch.tensor([[[0.5, 0.2], [0.5, 0.3]]])  # position 0 over-confident by 0.35 on average
    correct = torch.tensor([[[True, False], [True, True]]])
    sums = strategy._sums(correct, supervised, supervised, torch.zeros(1, 2, 2), c_star, confidence)
    summary = DSparkStrategy.summarize(sums)
    assert summary["ece_by_pos"] == pytest.approx([0.35, 0.0])
    assert summary["overlap_by_pos"] == pytest.approx([0.5, 0.25])
    assert summary["acc_by_pos"] == pytest.approx([1.0, 0.5]) and summary["tau_tf"] == pytest.approx(2.5)


def test_a_ce_only_objective_computes_no_teacher_and_needs_no_last_hidden_states(debug_target, monkeypatch):
    """With l1_weight = confidence_weight = 0 nothing reads the teacher: it is not computed, features without
    last_hidden_states train, and the loss is the CE term of the full objective."""
    calls = []
    original = objective.teacher
    monkeypatch.setattr(objective, "teacher", lambda *args: calls.append(args) or original(*args))
    batch, model = _batch(debug_target), _model(debug_target)
    ce_only = DSparkStrategy(DSparkObjective(num_anchors=4, l1_weight=0.0, confidence_weight=0.0))
    loss, sums = ce_only.forward_loss(model, model.config, replace(batch, last_hidden_states=None),
                                      ce_only.generator(0, 0))
    assert not calls and torch.isfinite(loss) and "overlap" not in sums and "cal_target" not in sums
    summary = DSparkStrategy.summarize(sums)
    assert "ece" not in summary and summary["acc_by_pos"] and summary["tau_tf"] >= 1
    with_teacher = DSparkStrategy(DSparkObjective(num_anchors=4, l1_weight=0.0, confidence_weight=1e-9))
    full, _ = with_teacher.forward_loss(model, model.config, batch, with_teacher.generator(0, 0))
    assert len(calls) == 1
    torch.testing.assert_close(loss, full, rtol=1e-6, atol=1e-6)  # the same CE (its weight is nearly all)
    loss.backward()  # every parameter in the graph (DDP reduces them all), the confidence head's gradient zero
    assert torch.equal(model.confidence_head.proj.weight.grad, torch.zeros_like(model.confidence_head.proj.weight))
    with pytest.raises(ValueError, match="L1 and confidence terms read the target's last_hidden_states"):
        with_teacher.forward_loss(model, model.config, replace(batch, last_hidden_states=None),
                                  with_teacher.generator(0, 0))
