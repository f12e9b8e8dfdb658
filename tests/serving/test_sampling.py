import torch

from specray.serving.sampling import NonFiniteLogitsError, SamplingParams, sample_each, sample_next


def test_greedy_batch_takes_each_rows_argmax():
    logits = torch.randn(6, 50)
    logits[2, [7, 9]] = 100.0  # a tie: the first index, as a row's argmax
    params = [SamplingParams()] * 6
    tokens, errors = sample_each(logits, params, [None] * 6)
    assert tokens == [[sample_next(row, params[0], None)] for row in logits]
    assert tokens[2] == [7] and errors == [None] * 6


def test_a_non_finite_row_fails_alone_in_a_greedy_batch():
    logits = torch.randn(4, 50)
    logits[1, 3] = float("nan")
    logits[3] = float("-inf")
    tokens, errors = sample_each(logits, [SamplingParams()] * 4, [None] * 4)
    assert tokens[1] == [] and tokens[3] == [] and isinstance(errors[1], NonFiniteLogitsError)
    assert isinstance(errors[3], NonFiniteLogitsError)
    assert tokens[0] == [int(logits[0].argmax())] and tokens[2] == [int(logits[2].argmax())]
    assert errors[0] is None and errors[2] is None
