import math

import pytest
import torch

from specray.trainer.strategies.dflash import (
    block_labels,
    position_weights,
    sample_anchors,
    valid_anchor_mask,
    weighted_block_ce,
)

from vocab_chunks import assert_chunks_change_nothing


def _ce(logits, label):
    return math.log(sum(math.exp(x) for x in logits)) - logits[label]


def test_weighted_loss_equals_hand_computation():
    # one sequence, two blocks, m = 3 draft positions, V = 3
    logits = torch.tensor([[
        [[2.0, 0.0, -1.0], [0.5, 0.5, 0.0], [0.0, 3.0, 0.0]],
        [[1.0, 1.0, 1.0], [0.0, -2.0, 4.0], [1.0, 0.0, 0.0]],
    ]])
    labels = torch.tensor([[[0, 1, 1], [2, 2, 0]]])
    supervised = torch.tensor([[[True, True, False], [True, True, True]]])  # last label of block 0 masked
    gamma = 2.0
    loss, ce = weighted_block_ce(logits, labels, supervised, position_weights(4, gamma))
    w = [1.0, math.exp(-1 / gamma), math.exp(-2 / gamma)]
    terms = [
        (w[0], _ce([2.0, 0.0, -1.0], 0)), (w[1], _ce([0.5, 0.5, 0.0], 1)),
        (w[0], _ce([1.0, 1.0, 1.0], 2)), (w[1], _ce([0.0, -2.0, 4.0], 2)), (w[2], _ce([1.0, 0.0, 0.0], 0)),
    ]
    expected = sum(wj * c for wj, c in terms) / sum(wj for wj, _ in terms)
    assert abs(float(loss) - expected) < 1e-6
    assert abs(float(ce[0, 0, 2]) - _ce([0.0, 3.0, 0.0], 1)) < 1e-6  # masked terms are computed, not counted


def test_position_weights():
    assert torch.allclose(position_weights(4, 4.0), torch.tensor([1.0, math.exp(-0.25), math.exp(-0.5)]))


def test_anchor_rule_and_labels():
    loss_mask = torch.tensor([[0, 0, 1, 1, 1, 0, 1, 1]], dtype=torch.bool)
    # anchor a needs loss_mask[a] and loss_mask[a+1]
    assert valid_anchor_mask(loss_mask).nonzero()[:, 1].tolist() == [2, 3, 6]
    anchors = sample_anchors(loss_mask, 5, torch.Generator().manual_seed(0))
    assert anchors.tolist() == [[2, 3, 6, -1, -1]]
    picked = sample_anchors(loss_mask, 2, torch.Generator().manual_seed(0))
    assert picked.shape == (1, 2) and set(picked[0].tolist()) <= {2, 3, 6} and picked[0, 0] < picked[0, 1]
    input_ids = torch.arange(10, 18)[None]
    labels, supervised = block_labels(input_ids, loss_mask, torch.tensor([[3, 6, -1]]), block_size=4)
    assert labels[0, 0].tolist() == [14, 15, 16]
    assert supervised[0, 0].tolist() == [True, False, True]  # position 5 is outside the answer
    assert supervised[0, 1].tolist() == [True, False, False]  # 7 is the last token; 8, 9 are past the end
    assert not supervised[0, 2].any()  # unused slot


def test_draft_vocabulary_loss_skips_uncovered_labels_and_counts_them_as_misses():
    from torch import nn

    from specray.drafters.dflash import DFlashConfig, DFlashDrafter
    from specray.trainer.loader import TrainBatch
    from specray.trainer.strategies.dflash import DFlashObjective, DFlashStrategy

    D, V, T = 16, 12, 10
    cfg = DFlashConfig(hidden_size=D, vocab_size=V, target_layer_ids=(1, 2), mask_token_id=0, num_layers=1,
                       num_heads=2, num_kv_heads=1, head_dim=8, intermediate_size=32, block_size=4,
                       draft_vocab_size=6)
    torch.manual_seed(0)
    embed, head = nn.Embedding(V, D), nn.Linear(D, V, bias=False)
    model = DFlashDrafter(cfg, embed_tokens=embed, lm_head=head)
    vocab = torch.tensor([1, 2, 3, 5, 8, 9])
    model.set_draft_vocab(vocab)
    ids = torch.tensor([[1, 2, 3, 4, 5, 8, 9, 7, 2, 3]])  # 4 and 7 are outside the draft vocabulary
    batch = TrainBatch(input_ids=ids, loss_mask=torch.ones(1, T, dtype=torch.bool),
                       attention_mask=torch.ones(1, T, dtype=torch.bool), hidden_states=torch.randn(1, T, 2 * D),
                       last_hidden_states=None, sample_ids=["s"], num_tokens=T)
    strategy = DFlashStrategy(DFlashObjective(num_anchors=3, gamma=2.0))
    loss, metrics = strategy.forward_loss(model, cfg, batch, strategy.generator(0, 0))

    anchors = sample_anchors(batch.loss_mask, 3, strategy.generator(0, 0))
    with torch.no_grad():  # the same blocks; label mapping, loss and hits by hand below
        logits = model(batch.hidden_states, batch.attention_mask, torch.gather(ids, 1, anchors), anchors)
    labels, supervised = block_labels(ids, batch.loss_mask, anchors, 4)
    w = position_weights(4, 2.0)
    num = den = 0.0
    correct = torch.zeros(3)
    for n in range(anchors.shape[1]):
        for j in range(3):
            if not supervised[0, n, j]:
                continue
            label = int(labels[0, n, j])
            row = logits[0, n, j].tolist()
            correct[j] += int(vocab[int(logits[0, n, j].argmax())]) == label
            if label in vocab.tolist():
                num += float(w[j]) * _ce(row, vocab.tolist().index(label))
                den += float(w[j])
    assert abs(float(loss.detach()) - num / den) < 1e-5
    assert torch.equal(metrics["correct"].float(), correct)
    assert metrics["count"].sum() > metrics["covered"].sum() > 0  # some labels (4, 7) are not covered
    summary = DFlashStrategy.summarize(metrics)
    assert summary["coverage"] == pytest.approx(float(metrics["covered"].sum() / metrics["count"].sum()))


def test_a_loss_in_vocabulary_chunks_equals_the_loss_in_one(monkeypatch):
    """Loss, metric sums and gradients with the LM head and the CE taken 5 rows at a time (checkpointed
    chunks) equal those of one chunk."""
    from torch import nn

    from specray.drafters.dflash import DFlashConfig, DFlashDrafter
    from specray.trainer.loader import TrainBatch
    from specray.trainer.strategies.dflash import DFlashObjective, DFlashStrategy

    D, V, T = 16, 12, 24
    cfg = DFlashConfig(hidden_size=D, vocab_size=V, target_layer_ids=(1, 2), mask_token_id=0, num_layers=1,
                       num_heads=2, num_kv_heads=1, head_dim=8, intermediate_size=32, block_size=4)
    torch.manual_seed(0)
    model = DFlashDrafter(cfg, embed_tokens=nn.Embedding(V, D), lm_head=nn.Linear(D, V, bias=False))
    g = torch.Generator().manual_seed(1)
    batch = TrainBatch(input_ids=torch.randint(0, V, (2, T), generator=g), loss_mask=torch.ones(2, T, dtype=torch.bool),
                       attention_mask=torch.ones(2, T, dtype=torch.bool), hidden_states=torch.randn(2, T, 2 * D),
                       last_hidden_states=None, sample_ids=["a", "b"], num_tokens=2 * T)
    strategy = DFlashStrategy(DFlashObjective(num_anchors=6))

    assert_chunks_change_nothing(monkeypatch, strategy, model, cfg, batch, 5 * V)  # 36 drafted rows: 8 chunks
