"""``serving/workers/deferred.py``: the rows a plain step leaves a drafter owing."""

import pytest
import torch

from specray.serving.workers.deferred import DeferredRows


def test_rows_come_back_per_slot_in_order_padded_to_the_longest():
    rows = DeferredRows(num_slots=3, width=2, dtype=torch.float32, capacity=3)
    rows.push([0, 2], torch.tensor([[1.0, 1.0], [2.0, 2.0]]), torch.tensor([10, 20]))
    rows.push([2], torch.tensor([[3.0, 3.0]]), torch.tensor([30]))
    assert not rows.full([0, 2])
    (held, values, tokens, counts), = rows.take([1, 2, 0])
    assert held == [2, 0] and counts == [2, 1]  # slot 1 owes nothing
    assert values.shape == (2, 2, 2) and values[0].tolist() == [[2.0, 2.0], [3.0, 3.0]] and values[1, 0].tolist() == [1.0, 1.0]
    assert tokens[0].tolist() == [20, 30] and tokens[1, 0] == 10
    assert rows.take([0, 1, 2]) == []  # taken rows are gone


def test_a_full_slot_refuses_a_push_and_release_forgets_its_rows():
    rows = DeferredRows(num_slots=2, width=1, dtype=torch.float32, capacity=2)
    for value in (1.0, 2.0):
        rows.push([1], torch.tensor([[value]]))
    assert rows.full([0, 1]) and not rows.full([0])
    with pytest.raises(RuntimeError, match="catch up"):
        rows.push([1], torch.tensor([[3.0]]))
    rows.release(1)
    assert not rows.full([1]) and rows.take([1]) == []



def test_a_prompt_is_owed_before_the_rows_pushed_after_it():
    rows = DeferredRows(num_slots=3, width=1, dtype=torch.float32, capacity=2)
    rows.push([1], torch.tensor([[9.0]]), torch.tensor([90]))
    rows.owe_prompt(1, torch.tensor([[1.0], [2.0], [3.0]]), torch.tensor([11, 12, 13]))  # a fresh slot: 9.0 is gone
    rows.owe_prompt(2, torch.tensor([[4.0]]))  # no tokens: zeros
    rows.owe_prompt(0, torch.zeros(0, 1))  # an empty prompt owes nothing
    rows.push([1, 2], torch.tensor([[5.0], [6.0]]), torch.tensor([15, 16]))
    assert not rows.full([0, 1, 2])  # prompt rows do not count against the capacity
    prompts, pushed = rows.take([0, 2, 1])
    assert prompts.slots == [2, 1] and prompts.rows == [1, 3]
    assert prompts.values[:, :, 0].tolist() == [[4.0, 0.0, 0.0], [1.0, 2.0, 3.0]]
    assert prompts.tokens.tolist() == [[0, 0, 0], [11, 12, 13]]
    assert pushed.slots == [2, 1] and pushed.rows == [1, 1] and pushed.values[:, 0, 0].tolist() == [6.0, 5.0]
    assert pushed.tokens[:, 0].tolist() == [16, 15] and rows.take([0, 1, 2]) == []
    rows.owe_prompt(2, torch.tensor([[7.0]]))
    rows.release(2)
    assert rows.take([2]) == []


def test_rows_pushed_by_steps_of_different_groups_come_back_from_the_steps_own_tensors():
    rows = DeferredRows(num_slots=3, width=2, dtype=torch.float64, capacity=4)
    step1 = torch.tensor([[1.0, 1.0], [2.0, 2.0], [3.0, 3.0]])  # slots 0, 1, 2
    rows.push([0, 1, 2], step1, torch.tensor([10, 20, 30]))
    rows.release(1)  # slot 1 finished; a new request takes it
    step2 = torch.tensor([[4.0, 4.0], [5.0, 5.0]])  # slots 2, 1 (another order)
    rows.push([2, 1], step2, torch.tensor([40, 50]))
    rows.push([0], torch.tensor([[6.0, 6.0]]), torch.tensor([60]))
    assert [rows.owes(s) for s in range(3)] == [2, 1, 2]
    (held, values, tokens, counts), = rows.take([0, 1, 2])
    assert held == [0, 1, 2] and counts == [2, 1, 2] and values.dtype == torch.float64
    assert values[:, :, 0].tolist() == [[1.0, 6.0], [5.0, 5.0], [3.0, 4.0]]  # slot 1's padding repeats its row
    assert tokens.tolist() == [[10, 60], [50, 50], [30, 40]]
    assert [rows.owes(s) for s in range(3)] == [0, 0, 0]


def test_a_push_does_no_tensor_work():
    rows = DeferredRows(num_slots=2, width=2, dtype=torch.float32, capacity=2)
    step, step_tokens = torch.ones(2, 2), torch.tensor([5, 6])
    with torch.profiler.profile() as prof:
        rows.push([1, 0], step, step_tokens)
    assert [e.name for e in prof.events() if e.name.startswith("aten::")] == []
    (_, values, tokens, _), = rows.take([0, 1])
    assert tokens.tolist() == [[6], [5]] and values.tolist() == [[[1.0, 1.0]], [[1.0, 1.0]]]
