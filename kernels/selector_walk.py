"""The DFlash 2 selector walk (seed §6.2, §6.5): a causal left-to-right path through a candidate lattice.

Request ``r`` drafts ``m`` positions with ``K`` candidates each. The lattice ``edges[r, j, p, c]``
(``[R, m, K, K]``) scores candidate ``c`` of position ``j`` after predecessor ``p``, candidate
``p`` of position ``j − 1``; position 0's predecessor is the anchor, so its ``K`` rows are one
row repeated and the walk reads row 0. The walk reads one row per position, the row of the
predecessor it has just chosen (not Viterbi: no future score reaches an earlier choice):

- greedy request (``temperature[r] == 0``): ``path[j] = argmax_c edges[r, j, path[j−1], c]``
  (ties to the lowest index, as ``torch.argmax``); its ``q`` row is the one-hot of that choice;
- sampled request: ``q_j = softmax(edges[r, j, path[j−1]] / T)`` and ``path[j]`` is drawn by
  inverse CDF from ``uniforms[r, j]``: the number of cumulative probabilities ``<= u``, capped at
  ``K − 1`` (rounding can leave the last cumulative sum below ``u``).

Example (K = 2, greedy): rows ``edges[0] = [[1, 3], [1, 3]]`` (anchor), ``edges[1] = [[5, 0],
[0, 5]]``: position 0 picks 1 (3 > 1), position 1 reads row 1 and picks 1: path ``[1, 1]``, although
row 0 of position 1 holds the same best score at index 0.

``q`` is the distribution each drafted candidate was actually drawn from, what verification needs
(after scattering it to the vocabulary, ``serving/workers/dflash2.py``).

Triple (STYLE rule 7): ``selector_walk_reference`` (plain torch, loops over positions),
``selector_walk`` (checks; the Triton kernel for CUDA tensors, the reference otherwise) and
``_selector_walk_kernel`` (one program per request). Tests: ``pytest tests/kernels/test_selector_walk.py``
(the kernel runs under ``TRITON_INTERPRET=1`` on CPU).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl


def selector_walk_reference(
    edges: torch.Tensor,  # [R, m, K, K] float32
    temperature: torch.Tensor,  # [R] float32, 0 = greedy
    uniforms: torch.Tensor,  # [R, m] float32 in [0, 1), read for sampled requests only
) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain-torch walk; returns ``(path [R, m] int64 candidate indices, q [R, m, K] float32)``."""
    R, m, K, _ = edges.shape
    rows = torch.arange(R, device=edges.device)
    greedy = temperature == 0  # [R]
    scale = torch.where(greedy, torch.ones_like(temperature), temperature)[:, None]  # [R, 1]
    prev = torch.zeros(R, dtype=torch.int64, device=edges.device)  # position 0: the anchor's row
    path = torch.empty(R, m, dtype=torch.int64, device=edges.device)
    q = torch.empty(R, m, K, dtype=torch.float32, device=edges.device)
    for j in range(m):
        row = edges[rows, j, prev]  # [R, K]
        probs = (row / scale).softmax(-1)
        drawn = (uniforms[:, j, None] >= probs.cumsum(-1)).sum(-1).clamp_max(K - 1)
        choice = torch.where(greedy, row.argmax(-1), drawn)
        q[:, j] = torch.where(greedy[:, None], torch.nn.functional.one_hot(choice, K).float(), probs)
        path[:, j] = choice
        prev = choice
    return path, q


def selector_walk(
    edges: torch.Tensor,  # [R, m, K, K] float32
    temperature: torch.Tensor,  # [R] float32, 0 = greedy
    uniforms: torch.Tensor,  # [R, m] float32 in [0, 1)
    *,
    use_triton: bool | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The walk (module docstring): ``(path [R, m] int64, q [R, m, K] float32)``.

    ``use_triton=None`` runs the Triton kernel for CUDA tensors and the reference otherwise."""
    _check(edges.dim() == 4 and edges.shape[2] == edges.shape[3] and edges.shape[2] >= 1,
           f"edges must be [R, m, K, K], got {list(edges.shape)}")
    R, m, K, _ = edges.shape
    for name, t, shape in (("edges", edges, (R, m, K, K)), ("temperature", temperature, (R,)),
                           ("uniforms", uniforms, (R, m))):
        _check(tuple(t.shape) == shape, f"{name} must have shape {list(shape)}, got {list(t.shape)}")
        _check(t.dtype == torch.float32, f"{name} must be float32, got {t.dtype}")
        _check(t.device == edges.device, f"{name} is on {t.device}, edges on {edges.device}")
        _check(t.is_contiguous(), f"{name} must be contiguous; call .contiguous() first")
    _check(bool((temperature >= 0).all()), "temperature must be >= 0 (0 = greedy)")
    if use_triton is None:
        use_triton = edges.is_cuda
    if not use_triton:
        return selector_walk_reference(edges, temperature, uniforms)
    if not edges.is_cuda and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError("selector_walk: use_triton=True needs CUDA tensors, or TRITON_INTERPRET=1 set before "
                         "triton is imported; use use_triton=None to run the reference on CPU")
    sentinel = -999  # every slot is written by the kernel; a leftover -999 is a kernel bug
    path = torch.full((R, m), sentinel, dtype=torch.int64, device=edges.device)
    q = torch.full((R, m, K), float(sentinel), dtype=torch.float32, device=edges.device)
    if R and m:
        _selector_walk_kernel[(R,)](path, q, edges, temperature, uniforms, m, K,
                                    BLOCK_K=max(16, triton.next_power_of_2(K)))
    return path, q


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(f"selector_walk: {message}")


@triton.jit
def _selector_walk_kernel(
    path_ptr,  # [R, m] int64
    q_ptr,  # [R, m, K] float32
    edges_ptr,  # [R, m, K, K] float32
    temperature_ptr,  # [R] float32
    uniforms_ptr,  # [R, m] float32
    m,
    K,
    BLOCK_K: tl.constexpr,  # >= K, a power of two
):
    r = tl.program_id(0).to(tl.int64)
    t = tl.load(temperature_ptr + r)
    is_greedy = t == 0.0
    scale = tl.where(is_greedy, 1.0, t)
    offs = tl.arange(0, BLOCK_K)
    valid = offs < K
    prev = tl.full([], 0, tl.int64)  # position 0: the anchor's row
    for j in range(0, m):
        row = tl.load(edges_ptr + ((r * m + j) * K + prev) * K + offs, mask=valid, other=float("-inf"))
        best = tl.argmax(row, axis=0, tie_break_left=True).to(tl.int64)
        z = tl.where(valid, row / scale, float("-inf"))
        e = tl.where(valid, tl.exp(z - tl.max(z, axis=0)), 0.0)
        probs = e / tl.sum(e, axis=0)
        u = tl.load(uniforms_ptr + r * m + j)
        below = tl.where(valid & (tl.cumsum(probs, axis=0) <= u), 1, 0)
        drawn = tl.minimum(tl.sum(below, axis=0), K - 1).to(tl.int64)
        choice = tl.where(is_greedy, best, drawn)
        q_row = tl.where(is_greedy, tl.where(offs == choice, 1.0, 0.0), probs)
        tl.store(q_ptr + (r * m + j) * K + offs, q_row, mask=valid)
        tl.store(path_ptr + r * m + j, choice)
        prev = choice
