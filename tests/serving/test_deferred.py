"""``serving/workers/deferred.py``: the rows a plain step leaves a drafter owing."""

import pytest
import torch

from specray.serving.workers.deferred import DeferredRows


def test_rows_come_back_per_slot_in_order_padded_to_the_longest():
    rows = DeferredRows(num_slots=3, width=2, dtype=torch.float32, capacity=3)
    rows.push([0, 2], torch.tensor([[1.0, 1.0], [2.0, 2.0]]), torch.tensor([10, 20]))
    rows.push([2], torch.tensor([[3.0, 3.0]]), torch.tensor([30]))
    assert not rows.full([0, 2])
    held, values, tokens, counts = rows.take([1, 2, 0])
    assert held == [2, 0] and counts == [2, 1]  # slot 1 owes nothing
    assert values.shape == (2, 2, 2) and values[0].tolist() == [[2.0, 2.0], [3.0, 3.0]] and values[1, 0].tolist() == [1.0, 1.0]
    assert tokens[0].tolist() == [20, 30] and tokens[1, 0] == 10
    assert rows.take([0, 1, 2])[0] == []  # taken rows are gone


def test_a_full_slot_refuses_a_push_and_release_forgets_its_rows():
    rows = DeferredRows(num_slots=2, width=1, dtype=torch.float32, capacity=2)
    for value in (1.0, 2.0):
        rows.push([1], torch.tensor([[value]]))
    assert rows.full([0, 1]) and not rows.full([0])
    with pytest.raises(RuntimeError, match="catch up"):
        rows.push([1], torch.tensor([[3.0]]))
    rows.release(1)
    assert not rows.full([1]) and rows.take([1])[0] == []

