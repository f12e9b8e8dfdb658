"""kernels/selector_walk.py: the greedy walk equals the argmax path over hand-built edge scores (not
Viterbi), the sampled walk draws by inverse CDF from the rows it walks, and the Triton kernel equals
the reference (run: ``pytest -q tests/kernels/test_selector_walk.py``; conftest sets TRITON_INTERPRET=1).
On a CUDA machine, ``TRITON_INTERPRET=0 pytest -q tests/kernels -k cuda`` runs the compiled kernel.
"""

import os

import pytest
import torch

from specray.kernels.selector_walk import selector_walk, selector_walk_reference

PATHS = [pytest.param(False, id="reference"), pytest.param(True, id="triton")]


def _hand_built() -> torch.Tensor:
    """[1, 3, 3, 3]: the argmax path is [2, 0, 1]; Viterbi (best total score) would take [0, 1, 2]."""
    edges = torch.zeros(1, 3, 3, 3)
    edges[0, 0] = torch.tensor([1.0, 0.0, 2.0])  # anchor row, repeated for every predecessor
    edges[0, 1] = torch.tensor([[0.0, 9.0, 0.0],  # after candidate 0: 1 scores 9
                                [0.0, 0.0, 0.0],
                                [3.0, 1.0, 0.0]])  # after candidate 2: 0 wins
    edges[0, 2] = torch.tensor([[0.0, 5.0, 0.0],  # after candidate 0: 1 wins
                                [0.0, 0.0, 9.0],
                                [0.0, 0.0, 0.0]])
    return edges


@pytest.mark.parametrize("use_triton", PATHS)
def test_greedy_walk_is_the_argmax_path(use_triton):
    path, q = selector_walk(_hand_built(), torch.zeros(1), torch.zeros(1, 3), use_triton=use_triton)
    assert path.tolist() == [[2, 0, 1]]  # not Viterbi's [0, 1, 2] (total 19 against this path's 10)
    assert torch.equal(q, torch.nn.functional.one_hot(path, 3).float())


def test_the_walk_reads_the_chosen_predecessors_row():
    edges = _hand_built()
    edges[0, 2, 2] = torch.tensor([70.0, 0.0, 0.0])  # the row of a candidate the walk did not choose
    path, _ = selector_walk_reference(edges, torch.zeros(1), torch.zeros(1, 3))
    assert path.tolist() == [[2, 0, 1]]


def test_sampled_walk_draws_by_inverse_cdf():
    edges = torch.log(torch.tensor([0.2, 0.5, 0.3])).expand(1, 2, 3, 3).contiguous()
    u = torch.tensor([[0.1, 0.69]])  # cumulative [0.2, 0.7, 1.0]: 0.1 -> 0, 0.69 -> 1
    path, q = selector_walk_reference(edges, torch.ones(1), u)
    assert path.tolist() == [[0, 1]]
    torch.testing.assert_close(q[0], torch.tensor([[0.2, 0.5, 0.3]] * 2))


def _random_walk_inputs(R: int, m: int, K: int):
    g = torch.Generator().manual_seed(0)
    edges = torch.randn(R, m, K, K, generator=g) * 3
    edges[:, 0] = edges[:, 0, :1]  # position 0: the anchor's row repeated
    temperature = torch.tensor([0.0, 1.0, 0.5, 0.0, 2.0]).repeat(R // 5 + 1)[:R].contiguous()
    return edges, temperature, torch.rand(R, m, generator=g)


@pytest.mark.parametrize("K", [4, 16])
def test_triton_walk_equals_the_reference(K):
    R, m = 5, 6
    edges, temperature, u = _random_walk_inputs(R, m, K)
    ref_path, ref_q = selector_walk(edges, temperature, u, use_triton=False)
    tri_path, tri_q = selector_walk(edges, temperature, u, use_triton=True)
    assert torch.equal(tri_path, ref_path)
    torch.testing.assert_close(tri_q, ref_q, rtol=1e-5, atol=1e-6)
    assert torch.allclose(ref_q.sum(-1), torch.ones(R, m))


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1",
                    reason="needs a CUDA GPU and compiled Triton (TRITON_INTERPRET=0)")
def test_triton_cuda_walk_matches_reference():
    edges, temperature, u = _random_walk_inputs(64, 7, 16)
    ref_path, ref_q = selector_walk(edges, temperature, u)
    path, q = selector_walk(edges.cuda(), temperature.cuda(), u.cuda(), use_triton=True)
    assert path.is_cuda and (path != -999).all(), "the kernel left slots unwritten"
    assert torch.equal(path.cpu(), ref_path)
    torch.testing.assert_close(q.cpu(), ref_q, rtol=1e-5, atol=1e-6)


def test_input_checks():
    with pytest.raises(ValueError, match="edges must be"):
        selector_walk(torch.zeros(1, 2, 3, 4), torch.zeros(1), torch.zeros(1, 2))
    with pytest.raises(ValueError, match="uniforms must have shape"):
        selector_walk(torch.zeros(1, 2, 3, 3), torch.zeros(1), torch.zeros(1, 3))
    with pytest.raises(ValueError, match="temperature must be >= 0"):
        selector_walk(torch.zeros(1, 2, 3, 3), -torch.ones(1), torch.zeros(1, 2))
