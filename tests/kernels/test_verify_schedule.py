"""kernels/verify_schedule.py: the seed's allocation example, the tie order (survival desc, position
asc, request asc), prefixes only, and the Triton kernel equal to the reference (conftest sets
TRITON_INTERPRET=1; ``TRITON_INTERPRET=0 pytest tests/kernels -k cuda`` runs it compiled on a GPU)."""

import pytest
import torch

from specray.kernels.verify_schedule import schedule_verify_lens, schedule_verify_lens_reference

PATHS = [pytest.param(False, id="reference"), pytest.param(True, id="triton")]


@pytest.mark.parametrize("use_triton", PATHS)
def test_the_seeds_example(use_triton):
    survival = torch.tensor([[0.95, 0.90, 0.85], [0.70, 0.30, 0.10]])
    lens = schedule_verify_lens(survival, 4, use_triton=use_triton)
    assert lens.tolist() == [4, 2]  # selected extras [3, 1] + the anchor row; M = 6
    assert schedule_verify_lens(survival, 0, use_triton=use_triton).tolist() == [1, 1]
    assert schedule_verify_lens(survival, 99, use_triton=use_triton).tolist() == [4, 4]


@pytest.mark.parametrize("use_triton", PATHS)
def test_ties_go_to_the_earlier_position_then_the_lower_request(use_triton):
    survival = torch.full((2, 2), 0.5)
    assert schedule_verify_lens(survival, 1, use_triton=use_triton).tolist() == [2, 1]  # request 0 first
    assert schedule_verify_lens(survival, 3, use_triton=use_triton).tolist() == [3, 2]  # both first positions first
    flat = torch.tensor([[0.8, 0.8, 0.8], [0.8, 0.2, 0.1]])  # a request's equal survivals: still its prefix
    assert schedule_verify_lens(flat, 2, use_triton=use_triton).tolist() == [2, 2]


@pytest.mark.parametrize("use_triton", PATHS)
def test_random_survivals_match_the_reference_and_select_prefixes(use_triton):
    g = torch.Generator().manual_seed(0)
    for R, m in [(1, 4), (3, 5), (7, 3), (40, 4)]:
        conf = torch.rand(R, m, generator=g)
        conf[conf > 0.7] = 1.0  # equal survivals along a request
        survival = (torch.round(conf * 4) / 4).cumprod(-1)  # coarse values: ties across requests
        for budget in range(0, R * m + 2, max(1, R * m // 7)):
            lens = schedule_verify_lens(survival, budget, use_triton=use_triton)
            assert torch.equal(lens, schedule_verify_lens_reference(survival, budget))
            assert int(lens.sum()) == R + min(budget, R * m)
            # every slot verified scores at least as high as every slot left out
            taken = torch.arange(m)[None, :] < (lens - 1)[:, None]
            if taken.any() and (~taken).any():
                assert survival[taken].min() >= survival[~taken].max()


def test_bad_inputs_are_refused():
    with pytest.raises(ValueError, match="float32"):
        schedule_verify_lens(torch.zeros(3), 1)
    with pytest.raises(ValueError, match=r"\[0, 1\]"):
        schedule_verify_lens(torch.tensor([[1.5]]), 1)
    with pytest.raises(ValueError, match="budget"):
        schedule_verify_lens(torch.ones(1, 2), -1)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_cuda_kernel_matches_the_reference():
    survival = torch.rand(64, 8).cumprod(-1)
    for budget in (0, 17, 100, 512):
        lens = schedule_verify_lens(survival.cuda(), budget)
        assert torch.equal(lens.cpu(), schedule_verify_lens_reference(survival, budget))
