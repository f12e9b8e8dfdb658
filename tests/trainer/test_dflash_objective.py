import math

import torch

from specray.trainer.strategies.dflash import (
    block_labels,
    position_weights,
    sample_anchors,
    valid_anchor_mask,
    weighted_block_ce,
)


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
