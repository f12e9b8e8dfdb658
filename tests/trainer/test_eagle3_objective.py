import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from specray.drafters.eagle3 import Eagle3Config, Eagle3Drafter
from specray.trainer import vocab_loss
from specray.trainer.core import OptimSettings, TrainerCore
from specray.trainer.loader import TrainBatch
from specray.trainer.strategies.eagle3 import (
    Eagle3Objective,
    Eagle3Strategy,
    Teacher,
    step_weights,
    supervised_rows,
)

from vocab_chunks import assert_chunks_change_nothing

D, V = 16, 12


def _drafter(draft_vocab=None, seed=0):
    torch.manual_seed(seed)
    cfg = Eagle3Config(hidden_size=D, vocab_size=V, target_layer_ids=(1, 2, 3), num_heads=2, num_kv_heads=1,
                       head_dim=8, intermediate_size=32, draft_vocab_size=None if draft_vocab is None else len(draft_vocab))
    model = Eagle3Drafter(cfg, embed_tokens=nn.Embedding(V, D), lm_head=nn.Linear(D, V, bias=False))
    if draft_vocab is not None:
        model.set_draft_vocab(torch.tensor(draft_vocab))
    return model, cfg


def _batch(ids, loss_mask, last_hidden=None, seed=1):
    g = torch.Generator().manual_seed(seed)
    B, T = ids.shape
    return TrainBatch(input_ids=ids, loss_mask=loss_mask, attention_mask=torch.ones(B, T, dtype=torch.bool),
                      hidden_states=torch.randn(B, T, 3 * D, generator=g),
                      last_hidden_states=torch.randn(B, T, D, generator=g) if last_hidden is None else last_hidden,
                      sample_ids=[str(i) for i in range(B)], num_tokens=B * T)


def test_step_weights_decay_as_configured():
    assert torch.allclose(step_weights(4, 0.8), torch.tensor([1.0, 0.8, 0.64, 0.512], dtype=torch.float64))
    assert torch.allclose(step_weights(3, 0.5), torch.tensor([1.0, 0.5, 0.25], dtype=torch.float64))
    assert Eagle3Objective() == Eagle3Objective(ttt_length=7, ploss_decay=0.8)
    with pytest.raises(ValueError):
        Eagle3Objective(ploss_decay=1.5)
    with pytest.raises(ValueError):
        Eagle3Objective(num_anchors=4)


def test_supervised_rows_need_an_answer_anchor_and_label():
    loss_mask = torch.tensor([[0, 1, 1, 1, 0, 1, 1]], dtype=torch.bool)
    rows = supervised_rows(loss_mask, 3)
    # step i, row t: loss_mask on t + 1 (the chain starts on an answer token) … t + 2 + i (its label)
    assert rows[0, 0].tolist() == [1, 1, 0, 0, 1, 0, 0]
    assert rows[1, 0].tolist() == [1, 0, 0, 0, 0, 0, 0]  # row 1 would predict x_4, outside the answer;
    # row 2 would predict x_5 (an answer token) but its chain crosses x_4
    assert rows[2, 0].tolist() == [0, 0, 0, 0, 0, 0, 0]  # row 0: x_4; row 4: past the end


@pytest.mark.parametrize("cached", [True, False])
def test_teacher_is_the_targets_head_on_the_final_norm_output_restricted_to_the_draft_vocab(monkeypatch, cached):
    """Kept for every position (one vocabulary chunk) or computed for the rows asked: the same."""
    if not cached:
        monkeypatch.setattr(vocab_loss, "VOCAB_CHUNK_ELEMENTS", 4)
    model, _ = _drafter(draft_vocab=[1, 4, 5, 9])
    y = torch.randn(2, 3, D)
    rows = torch.tensor([[True, True, False], [True, True, True]])
    target = Teacher(model, y, rows)
    assert (target.cached is not None) == cached
    b, t = rows.nonzero(as_tuple=True)
    logits = y @ model.lm_head.weight.T  # no norm: last_hidden_states already is the final norm's output
    assert torch.allclose(target.probs(b, t), logits[rows][:, [1, 4, 5, 9]].softmax(-1), atol=1e-6)
    assert torch.equal(target.argmax[rows], logits[rows].argmax(-1))  # over the whole vocabulary
    assert target.argmax[0, 2] == -1  # a row not asked for is not computed
    full, _ = _drafter()
    everything = torch.ones(2, 3, dtype=torch.bool)
    full_target = Teacher(full, y, everything)
    p_full = full_target.probs(*everything.nonzero(as_tuple=True)).view(2, 3, -1)
    assert torch.allclose(p_full, (y @ full.lm_head.weight.T).softmax(-1), atol=1e-6)
    assert torch.equal(full_target.argmax, p_full.argmax(-1))


def test_a_loss_in_vocabulary_chunks_equals_the_loss_in_one(monkeypatch):
    """Loss, metric sums and gradients with the teacher and the LM head taken 3 rows at a time
    (checkpointed chunks) equal those of one chunk."""
    model, cfg = _drafter(draft_vocab=[0, 2, 3, 5, 7, 8, 9, 11])
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, V, (2, 12), generator=g)
    batch = _batch(ids, torch.ones(2, 12, dtype=torch.bool))
    strategy = Eagle3Strategy(Eagle3Objective(ttt_length=3))

    # 3 rows of the 8-token draft vocabulary
    assert_chunks_change_nothing(monkeypatch, strategy, model, cfg, batch, 3 * 8, rtol=1e-5, atol=1e-6)


def test_loss_equals_hand_computation_with_decayed_step_means():
    model, cfg = _drafter(draft_vocab=[0, 2, 3, 5, 7, 8, 9, 11])
    ids = torch.tensor([[3, 1, 4, 1, 5, 9, 2, 6]])
    loss_mask = torch.tensor([[0, 0, 1, 1, 1, 1, 1, 1]], dtype=torch.bool)
    batch = _batch(ids, loss_mask)
    for decay in (0.8, 0.5):
        strategy = Eagle3Strategy(Eagle3Objective(ttt_length=3, ploss_decay=decay))
        loss, sums = strategy.forward_loss(model, cfg, batch, strategy.generator(0, 0))
        with torch.no_grad():
            head = model.lm_head.weight[model.draft_vocab]
            logits = model(batch.hidden_states, ids, torch.ones(3, 1, 8, dtype=torch.bool))  # every row, every step
            expected = 0.0
            for i in range(3):
                terms = []
                for t in range(8):
                    if not (t + 2 + i < 8 and loss_mask[0, t + 1 : t + 3 + i].all()):
                        continue
                    teacher_logits = model.lm_head.weight @ batch.last_hidden_states[0, t + 1 + i]
                    if int(teacher_logits.argmax()) not in model.draft_vocab.tolist():
                        continue  # the drafter cannot propose the teacher's choice: no loss
                    p = (head @ batch.last_hidden_states[0, t + 1 + i]).softmax(-1)
                    terms.append(float(-(p * logits[i][t].log_softmax(-1)).sum()))
                if terms:
                    expected += decay**i * sum(terms) / len(terms)
        assert float(loss.detach()) == pytest.approx(expected, rel=1e-5)
        from_sums = sum(decay**i * float(sums["ce"][i] / sums["covered"][i]) for i in range(3))
        assert float(loss.detach()) == pytest.approx(from_sums, rel=1e-5)
    assert sums["count"].tolist() == [5, 4, 3] and (sums["covered"] > 0).all()


class _ForcedLogits(nn.Module):
    """Stands in for the drafter in forward_loss: returns fixed logits per step (``.module`` is the drafter)."""

    def __init__(self, drafter, logits):
        super().__init__()
        drafter.logits = lambda states: states  # the forced rows are the logits
        self.module = drafter
        self.logits = nn.ParameterList(logits)

    def forward(self, hidden_states, input_ids, logit_rows, head=True):
        assert [int(r.sum()) for r in logit_rows] == [len(x) for x in self.logits]
        return list(self.logits)  # as the "states" of an LM head that is the identity (head=False)


def test_accuracy_by_depth_and_teacher_forced_tau():
    model, cfg = _drafter()
    with torch.no_grad():
        model.lm_head.weight.copy_(torch.eye(V, D))  # teacher argmax at position s = the hot index of y_s
    k = [0, 1, 2, 3, 4]
    y = 5 * F.one_hot(torch.tensor([k]), D).float()
    batch = _batch(torch.tensor([[7, 7, 7, 7, 7]]), torch.tensor([[0, 1, 1, 1, 1]], dtype=torch.bool), y)
    # step 0 rows 0..2 predict positions 2..4 (teacher k[1..3] = 1, 2, 3); step 1 rows 0..1: k[2..3] = 2, 3
    step0 = 10 * F.one_hot(torch.tensor([1, 5, 3]), V).float()  # right, wrong, right
    step1 = 10 * F.one_hot(torch.tensor([2, 3]), V).float()  # right, right
    strategy = Eagle3Strategy(Eagle3Objective(ttt_length=2))
    loss, sums = strategy.forward_loss(_ForcedLogits(model, [step0, step1]), cfg, batch, strategy.generator(0, 0))
    loss.backward()
    summary = strategy.summarize(sums)
    assert summary["acc_by_pos"] == pytest.approx([2 / 3, 1.0])
    # chains: row 0 right at both depths (2), row 1 wrong first (0), row 2 right then unsupervised (1)
    assert summary["blocks"] == 3 and summary["tau_tf"] == pytest.approx(1 + 3 / 3)
    assert summary["coverage"] == 1.0 and len(summary["ce_by_pos"]) == 2


def test_teacher_outside_the_draft_vocabulary_is_a_miss_without_loss():
    model, cfg = _drafter(draft_vocab=[0, 1, 2, 3])
    with torch.no_grad():
        model.lm_head.weight.copy_(torch.eye(V, D))
    y = 5 * F.one_hot(torch.tensor([[0, 1, 9, 2]]), D).float()  # the teacher picks 9 at position 2
    batch = _batch(torch.tensor([[5, 5, 5, 5]]), torch.ones(1, 4, dtype=torch.bool), y)
    strategy = Eagle3Strategy(Eagle3Objective(ttt_length=1))
    _, sums = strategy.forward_loss(model, cfg, batch, strategy.generator(0, 0))
    assert sums["count"].tolist() == [2] and sums["covered"].tolist() == [1]  # rows 0, 1; row 0's teacher is 9
    assert float(sums["correct"][0]) <= 1


def test_features_without_last_hidden_states_are_refused():
    model, cfg = _drafter()
    batch = _batch(torch.tensor([[1, 2, 3]]), torch.ones(1, 3, dtype=torch.bool))
    batch.last_hidden_states = None
    strategy = Eagle3Strategy()
    with pytest.raises(ValueError, match="capture.algorithm=eagle3"):
        strategy.forward_loss(model, cfg, batch, strategy.generator(0, 0))


def test_loss_decreases_on_a_learnable_batch():
    """The teacher at every position predicts a fixed function of the token there (x -> x + 1 mod V),
    so each TTT depth is learnable from its input token: 30 steps must cut the loss well down."""
    model, cfg = _drafter()
    g = torch.Generator().manual_seed(2)
    ids = torch.randint(0, V, (2, 24), generator=g)
    rows = model.lm_head.weight.detach()[(ids + 1) % V]  # [2, 24, D]
    y = 12 * rows / rows.norm(dim=-1, keepdim=True)  # a peaked teacher: its entropy floor is low
    batch = _batch(ids, torch.ones(2, 24, dtype=torch.bool), y)
    strategy = Eagle3Strategy(Eagle3Objective(ttt_length=3))
    core = TrainerCore(model, strategy, cfg, OptimSettings(lr=3e-2, warmup_steps=2, total_steps=30))
    results = [core.train_step([batch], step) for step in range(30)]
    losses = [r.loss for r in results]
    assert all(math.isfinite(x) for x in losses)
    assert losses[-1] < 0.35 * losses[0]
    summary = strategy.summarize(results[-1].sums)
    assert min(summary["acc_by_pos"]) > 0.8 and summary["tau_tf"] > 2.5
