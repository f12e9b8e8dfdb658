"""DSpark's verify-length schedule (seed §5.6.4): a batch's draft budget ``K`` handed to the draft
slots of highest predicted survival.

``survival[r, j]`` is request r's predicted survival of draft ``j + 1``, ``A_{r,j+1} = ∏_{i<=j+1} c_{r,i}``
(the cumulative product of its calibrated confidences, non-increasing along j). Every slot
``(r, j)`` gets a rank in the order

    survival descending → position ascending → request ascending

and the ``K`` slots ranked first are verified: ``verify_lens[r] = 1 + #{selected slots of r}`` (the
1 is the anchor row). Because survival never increases along a request's positions and ties go
to the earlier position, the slots a request gets are always a prefix of its drafts. The order
reads no token id: whether draft ``j + 1`` is verified depends on its survival (a function of the
drafts before it) and the other requests' survivals, never on the draft itself, which is what
keeps rejection sampling exact (``serving/workers/dspark.py``).

Example (seed §5.6.4): A ``[0.95, 0.90, 0.85]``, B ``[0.70, 0.30, 0.10]``, ``K = 4`` -> the global top 4 are
A's three slots and B's first: ``verify_lens = [4, 2]``, ``M = 6`` target rows.

Triple (STYLE rule 7): ``schedule_verify_lens_reference`` (stable sorts), ``schedule_verify_lens``
(checks, picks the path: the Triton kernel for CUDA tensors, the reference otherwise) and
``_schedule_verify_lens_kernel`` (one program per request, counting each of its slots' rank
pairwise over every slot). Tests: ``pytest tests/kernels/test_verify_schedule.py``.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl


def schedule_verify_lens_reference(survival: torch.Tensor, budget: int) -> torch.Tensor:
    """survival [R, m] float, budget K >= 0 -> verify_lens [R] int64 in 1 … m + 1 (module docstring)."""
    R, m = survival.shape
    flat = survival.reshape(-1)  # [R*m], slot i = r * m + j
    order = torch.arange(R * m, device=survival.device)
    # stable sorts from the last key to the first: request asc, then position asc, then survival desc
    order = order[torch.sort(order % m, stable=True).indices]
    order = order[torch.sort(flat[order], descending=True, stable=True).indices]
    chosen = order[: min(budget, R * m)]
    return 1 + torch.bincount(chosen // m, minlength=R)


def schedule_verify_lens(survival: torch.Tensor, budget: int, *, use_triton: bool | None = None) -> torch.Tensor:
    """Verify lengths [R] int64 (anchor included) for ``survival`` [R, m] (float32, finite, in
    [0, 1]) and a budget of ``budget`` draft slots over the batch (K; more than R*m selects all).
    ``use_triton=None`` runs the Triton kernel for CUDA tensors and the reference otherwise."""
    if not (isinstance(survival, torch.Tensor) and survival.dim() == 2 and survival.dtype == torch.float32):
        raise ValueError(f"survival must be an [R, m] float32 tensor, got {getattr(survival, 'shape', None)} "
                         f"{getattr(survival, 'dtype', None)}")
    if budget < 0:
        raise ValueError(f"budget must be >= 0 draft slots, got {budget}")
    if not bool(((survival >= 0) & (survival <= 1)).all()):
        raise ValueError("survival must hold probabilities in [0, 1] (cumulative products of confidences)")
    if use_triton is None:
        use_triton = survival.is_cuda
    if not use_triton:
        return schedule_verify_lens_reference(survival, budget)
    if not survival.is_cuda and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError("use_triton=True needs CUDA tensors, or TRITON_INTERPRET=1 set before triton is imported")
    R, m = survival.shape
    lens = torch.full((R,), -999, dtype=torch.int64, device=survival.device)  # every entry is overwritten
    if R:
        _schedule_verify_lens_kernel[(R,)](lens, survival.contiguous(), R, m, budget,
                                           BLOCK_M=max(16, triton.next_power_of_2(m)), BLOCK_N=128)
    return lens


@triton.jit
def _schedule_verify_lens_kernel(lens_ptr, survival_ptr, R, m, budget, BLOCK_M: tl.constexpr,
                                 BLOCK_N: tl.constexpr):
    r = tl.program_id(0)
    j = tl.arange(0, BLOCK_M)
    mine = j < m
    a = tl.load(survival_ptr + r * m + j, mask=mine, other=0.0)  # [BLOCK_M] this request's survivals
    rank = tl.zeros([BLOCK_M], dtype=tl.int32)
    for start in range(0, R * m, BLOCK_N):
        i = start + tl.arange(0, BLOCK_N)
        real = i < R * m
        b = tl.load(survival_ptr + i, mask=real, other=0.0)  # [BLOCK_N] any slots'
        pos, req = i % m, i // m
        ahead = (b[None, :] > a[:, None]) | ((b[None, :] == a[:, None]) & (
            (pos[None, :] < j[:, None]) | ((pos[None, :] == j[:, None]) & (req[None, :] < r))))
        rank += tl.sum((ahead & real[None, :]).to(tl.int32), axis=1)
    chosen = mine & (rank < budget)
    tl.store(lens_ptr + r, 1 + tl.sum(chosen.to(tl.int64), axis=0))
