"""Speculative verification (accept / reject / correction / bonus) for a ragged batch of requests.

Notation (DESIGN.md §2). Request ``r`` fed the target ``[a, d_1 .. d_n]``: the anchor ``a`` and
``n = num_draft[r] <= m`` draft tokens (rows padded to ``m``). The target scored ``M = m + 1``
rows: row ``j`` (0-based) is ``p_j``, the target distribution at the position of draft
``d_{j+1}``, and row ``n`` is the bonus row. With ``k`` the accepted draft prefix length
(``0 <= k <= n``; DESIGN calls it ``r``, renamed here because ``r`` indexes requests) the round
emits ``[d_1 .. d_k, x*]``: ``x*`` is the *correction* drawn at the first rejected row ``k``,
or the *bonus* drawn from row ``n`` when every draft was accepted, so ``num_emitted = k + 1``.

- Greedy (``draft_probs=None``): accept ``d_{j+1}`` while ``d_{j+1} == argmax p_j``; ``x*``
  is the argmax of row ``k``. Ties go to the lowest token id, as in ``torch.argmax``. Only the
  argmax of each row is read, so the target's logits may be passed instead of ``p``: that skips
  a softmax over the vocabulary per row, and is exactly the argmax plain greedy decoding takes
  (a float32 softmax can round two nearly equal top logits to one probability, a tie).
- Sampling: accept ``d_{j+1}`` iff ``u_j * q_j(d_{j+1}) < p_j(d_{j+1})`` (``u < min(1, p/q)``,
  ``q_j`` being row ``j`` of ``draft_probs``, the distribution ``d_{j+1}`` was drawn from); the
  correction is drawn from ``norm([p_k - q_k]+)``, the bonus from ``p_n``. A draw is the
  exponential race ``argmax_v w_v / E_v`` with ``E_v`` i.i.d. Exp(1), which picks ``v`` with
  probability ``w_v / sum(w)``; given ``uniforms`` and ``exponentials`` the result is exact
  and deterministic. A residual that is all zero (only through rounding) falls back to ``p_k``.

Why this is lossless (seed §1.2, DESIGN.md §6): for ``d ~ q`` the accept branch contributes mass
``q(v) min(1, p(v)/q(v)) = min(p(v), q(v))`` to token ``v``; the reject branch has probability
``sum_u [p(u) - q(u)]+`` and spreads it as ``[p(v) - q(v)]+``; the two add up to ``p(v)``.
Nothing requires ``q == p`` (a poor ``q`` costs speed, not correctness), but it DOES require
that ``q`` is the distribution the draft tokens were actually sampled from: the corrected /
selector ``q``, never a raw backbone softmax when the proposal was modified. Passing another
``q`` silently changes the output distribution (``tests/kernels/test_rejection.py`` shows it).
Greedy verification reproduces plain greedy decoding token for token under the same numerics.

Triple (STYLE rule 7): ``rejection_sample_reference`` (plain torch, loops over draft positions),
``rejection_sample`` (checks, draws the random numbers, picks the path: the Triton kernel for
CUDA tensors, the reference otherwise) and ``_rejection_sample_kernel`` (one program per
request). Tests: ``pytest tests/kernels/test_rejection.py`` (the kernel runs under
``TRITON_INTERPRET=1`` on CPU).
"""

from __future__ import annotations

import os
import warnings

import torch
import triton
import triton.language as tl

PAD_ID = -1  # output slots past num_emitted


def rejection_sample_reference(
    target_probs: torch.Tensor,  # [R, M, V] float32
    draft_token_ids: torch.Tensor,  # [R, m] int64
    num_draft: torch.Tensor,  # [R] int32 / int64, each in [0, m]
    draft_probs: torch.Tensor | None,  # [R, m, V] float32, None = greedy
    uniforms: torch.Tensor | None,  # [R, m] float32 in [0, 1), unused when greedy
    exponentials: torch.Tensor | None,  # [R, V] float32 Exp(1), unused when greedy
) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain-torch verification; returns ``(output_token_ids [R, M] int64, num_emitted [R] int64)``.

    Inputs are assumed valid (``rejection_sample`` checks them). Example, m = 3, greedy:
    drafts ``[5, 7, 2]``, row argmaxes ``[5, 7, 9, 4]`` -> output ``[5, 7, 9, -1]``, emitted 3.
    """
    R, M, V = target_probs.shape
    m = M - 1
    rows = torch.arange(R, device=target_probs.device)
    num_draft = num_draft.long()
    output = torch.full((R, M), PAD_ID, dtype=torch.int64, device=target_probs.device)
    accepting = torch.ones(R, dtype=torch.bool, device=target_probs.device)
    num_accepted = torch.zeros(R, dtype=torch.int64, device=target_probs.device)
    for j in range(m):
        live = accepting & (j < num_draft)
        d = torch.where(live, draft_token_ids[:, j], 0)  # padding slots may hold anything
        if draft_probs is None:
            ok = d == target_probs[:, j].argmax(-1)
        else:
            ok = uniforms[:, j] * draft_probs[rows, j, d] < target_probs[rows, j, d]
        accepting = live & ok
        output[:, j] = torch.where(accepting, d, PAD_ID)
        num_accepted += accepting.long()

    p = target_probs[rows, num_accepted]  # [R, V]: the rejected row, or the bonus row n
    if draft_probs is None:
        token = p.argmax(-1)
    else:
        is_correction = (num_accepted < num_draft)[:, None]
        w = p
        if m > 0:
            q = draft_probs[rows, num_accepted.clamp(max=m - 1)]  # [R, V], only used on rejection
            w = torch.where(is_correction, (p - q).clamp_min(0.0), p)
        w = torch.where(w.amax(-1, keepdim=True) > 0, w, p)  # residual lost to rounding -> p
        token = (w / exponentials).argmax(-1)
    output[rows, num_accepted] = token
    return output, num_accepted + 1


def rejection_sample(
    target_probs: torch.Tensor,  # [R, M, V] float32
    draft_token_ids: torch.Tensor,  # [R, m] int64
    num_draft: torch.Tensor,  # [R] int32 / int64
    draft_probs: torch.Tensor | None = None,  # [R, m, V] float32; None = greedy
    uniforms: torch.Tensor | None = None,  # [R, m] float32; drawn from `generator` if None
    exponentials: torch.Tensor | None = None,  # [R, V] float32; drawn from `generator` if None
    *,
    generator: torch.Generator | None = None,
    use_triton: bool | None = None,
    block_v: int = 1024,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Verify ``num_draft[r]`` drafts per request; see the module docstring for the rule.

    Returns ``(output_token_ids [R, M] int64, num_emitted [R] int64)``: the accepted drafts, then
    the correction or bonus token, then ``-1``. Missing ``uniforms`` then ``exponentials`` are
    drawn (in that order) from ``generator``. ``use_triton=None`` runs the Triton kernel for CUDA
    tensors and the reference otherwise; ``block_v`` is the kernel's vocabulary chunk.
    """
    greedy = draft_probs is None
    if greedy and (uniforms is not None or exponentials is not None or generator is not None):
        warnings.warn("rejection_sample: greedy verification (draft_probs=None) ignores "
                      "uniforms, exponentials and generator", stacklevel=2)
    _check(isinstance(target_probs, torch.Tensor) and target_probs.dim() == 3
           and min(target_probs.shape[1:]) >= 1,
           f"target_probs must be a [R, M >= 1, V >= 1] tensor, got {getattr(target_probs, 'shape', None)}")
    R, M, V = target_probs.shape
    if not greedy:
        uniforms, exponentials = _draw_missing(target_probs, uniforms, exponentials, generator)
    _check_inputs(target_probs, draft_token_ids, num_draft, draft_probs, uniforms, exponentials)

    if use_triton is None:
        use_triton = target_probs.is_cuda
    if not use_triton:
        return rejection_sample_reference(
            target_probs, draft_token_ids, num_draft, draft_probs, uniforms, exponentials)
    if not target_probs.is_cuda and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError("use_triton=True needs CUDA tensors, or TRITON_INTERPRET=1 set before "
                         "triton is imported; use use_triton=None to run the reference on CPU")
    if block_v < 16 or block_v & (block_v - 1):
        raise ValueError(f"block_v must be a power of two >= 16, got {block_v}")

    sentinel = -999  # every slot is overwritten by the kernel; a leftover -999 is a kernel bug
    output = torch.full((R, M), sentinel, dtype=torch.int64, device=target_probs.device)
    num_emitted = torch.full((R,), sentinel, dtype=torch.int64, device=target_probs.device)
    if R == 0:
        return output, num_emitted
    dummy = target_probs  # never read when IS_GREEDY
    _rejection_sample_kernel[(R,)](
        output, num_emitted, target_probs, draft_token_ids, num_draft,
        dummy if greedy else draft_probs, dummy if greedy else uniforms,
        dummy if greedy else exponentials, M - 1, V,
        IS_GREEDY=greedy, BLOCK_V=min(block_v, max(16, triton.next_power_of_2(V))),
        BLOCK_M=max(16, triton.next_power_of_2(M)),
    )
    return output, num_emitted


def _draw_missing(target_probs, uniforms, exponentials, generator):
    R, M, V = target_probs.shape
    f32, device = torch.float32, target_probs.device
    if uniforms is None:
        uniforms = torch.rand((R, M - 1), generator=generator, device=device, dtype=f32)
    if exponentials is None:
        exponentials = torch.empty((R, V), device=device, dtype=f32).exponential_(generator=generator)
        exponentials.clamp_min_(torch.finfo(f32).tiny)  # an exact 0 would make w / E inf or nan
    return uniforms, exponentials


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(f"rejection_sample: {message}")


def _check_tensor(name: str, t: object, shape: tuple[int, ...], dtypes: tuple[torch.dtype, ...],
                  device: torch.device) -> None:
    _check(isinstance(t, torch.Tensor), f"{name} must be a torch.Tensor, got {type(t).__name__}")
    _check(tuple(t.shape) == shape, f"{name} must have shape {list(shape)}, got {list(t.shape)}")
    _check(t.dtype in dtypes, f"{name} must have dtype {' or '.join(map(str, dtypes))}, got {t.dtype}")
    _check(t.device == device, f"{name} is on {t.device} but target_probs is on {device}")
    _check(t.is_contiguous(), f"{name} must be contiguous; call .contiguous() first")


def _check_inputs(target_probs, draft_token_ids, num_draft, draft_probs, uniforms, exponentials) -> None:
    R, M, V = target_probs.shape  # the wrapper checked it is 3-D with M, V >= 1
    m, device = M - 1, target_probs.device
    _check_tensor("target_probs", target_probs, (R, M, V), (torch.float32,), device)
    _check_tensor("draft_token_ids", draft_token_ids, (R, m), (torch.int64,), device)
    _check_tensor("num_draft", num_draft, (R,), (torch.int32, torch.int64), device)
    if R == 0:
        return
    _check(bool((num_draft >= 0).all() and (num_draft <= m).all()),
           f"num_draft must lie in [0, m={m}], got min {int(num_draft.min())} max {int(num_draft.max())}")
    proposed = torch.arange(m, device=device) < num_draft[:, None]  # [R, m]: real drafts, not padding
    ids = draft_token_ids[proposed]
    _check(bool(((ids >= 0) & (ids < V)).all()), f"proposed draft_token_ids must lie in [0, V={V})")
    if draft_probs is None:
        return
    _check_tensor("draft_probs", draft_probs, (R, m, V), (torch.float32,), device)
    _check_tensor("uniforms", uniforms, (R, m), (torch.float32,), device)
    _check_tensor("exponentials", exponentials, (R, V), (torch.float32,), device)
    _check(bool(((uniforms >= 0) & (uniforms < 1)).all()), "uniforms must lie in [0, 1)")
    _check(bool((exponentials > 0).all()), "exponentials must be > 0 (i.i.d. Exp(1) samples)")
    q_d = draft_probs.gather(2, torch.where(proposed, draft_token_ids, 0)[..., None])[..., 0]
    bad = (proposed & ~(q_d > 0)).nonzero()  # [num_bad, 2]: (request, position)
    _check(len(bad) == 0, f"draft_probs gives q = 0 to a proposed draft token at (request, position) "
           f"{bad[:1].tolist()}: q must be the distribution the drafts were actually sampled from")


@triton.jit
def _row_argmax(row_ptr, V, BLOCK_V: tl.constexpr):
    """Lowest index of the maximum of ``row[0:V]``, scanned in BLOCK_V chunks."""
    best = tl.full([], -1.0, tl.float32)
    best_idx = tl.full([], 0, tl.int32)
    for v0 in range(0, V, BLOCK_V):
        offs = v0 + tl.arange(0, BLOCK_V)
        x = tl.load(row_ptr + offs, mask=offs < V, other=-1.0)
        blk_best = tl.max(x, axis=0)
        blk_idx = tl.argmax(x, axis=0, tie_break_left=True) + v0
        better = blk_best > best  # strict: an earlier chunk keeps ties
        best = tl.where(better, blk_best, best)
        best_idx = tl.where(better, blk_idx, best_idx)
    return best_idx


@triton.jit
def _race_draw(p_ptr, q_ptr, e_ptr, is_correction, V, BLOCK_V: tl.constexpr):
    """``argmax_v w_v / E_v`` with w = [p - q]+ (correction) or p (bonus); w all zero -> p."""
    best_w = tl.full([], -1.0, tl.float32)
    idx_w = tl.full([], 0, tl.int32)
    max_w = tl.full([], 0.0, tl.float32)
    best_p = tl.full([], -1.0, tl.float32)
    idx_p = tl.full([], 0, tl.int32)
    q_len = tl.where(is_correction, V, 0)  # the bonus row n has no q row (row m is out of bounds)
    for v0 in range(0, V, BLOCK_V):
        offs = v0 + tl.arange(0, BLOCK_V)
        mask = offs < V
        p = tl.load(p_ptr + offs, mask=mask, other=0.0)
        q = tl.load(q_ptr + offs, mask=offs < q_len, other=0.0)
        e = tl.load(e_ptr + offs, mask=mask, other=1.0)
        w = tl.where(is_correction, tl.maximum(p - q, 0.0), p)
        ratio_w = tl.where(mask, tl.div_rn(w, e), -1.0)  # div_rn: IEEE division, as torch
        ratio_p = tl.where(mask, tl.div_rn(p, e), -1.0)
        max_w = tl.maximum(max_w, tl.max(w, axis=0))
        blk = tl.max(ratio_w, axis=0)
        better = blk > best_w
        idx_w = tl.where(better, tl.argmax(ratio_w, axis=0, tie_break_left=True) + v0, idx_w)
        best_w = tl.where(better, blk, best_w)
        blk = tl.max(ratio_p, axis=0)
        better = blk > best_p
        idx_p = tl.where(better, tl.argmax(ratio_p, axis=0, tie_break_left=True) + v0, idx_p)
        best_p = tl.where(better, blk, best_p)
    return tl.where(max_w > 0, idx_w, idx_p)


@triton.jit
def _rejection_sample_kernel(
    output_ptr,  # [R, M] int64, every slot written
    num_emitted_ptr,  # [R] int64
    target_probs_ptr,  # [R, M, V] float32
    draft_token_ids_ptr,  # [R, m] int64
    num_draft_ptr,  # [R] int32 / int64
    draft_probs_ptr,  # [R, m, V] float32 (unused when IS_GREEDY)
    uniforms_ptr,  # [R, m] float32 (unused when IS_GREEDY)
    exponentials_ptr,  # [R, V] float32 (unused when IS_GREEDY)
    m,
    V,
    IS_GREEDY: tl.constexpr,
    BLOCK_V: tl.constexpr,
    BLOCK_M: tl.constexpr,  # >= M = m + 1
):
    r = tl.program_id(0).to(tl.int64)  # one program per request; int64 offsets for big R*M*V
    M = m + 1
    n = tl.load(num_draft_ptr + r).to(tl.int32)
    p_req = target_probs_ptr + r * M * V
    q_req = draft_probs_ptr + r * m * V
    accepting = tl.full([], 1, tl.int32)
    num_accepted = tl.full([], 0, tl.int32)
    for j in range(0, n):  # no break in Triton: `accepting` drops to 0 at the first rejection
        d = tl.load(draft_token_ids_ptr + r * m + j)
        if IS_GREEDY:
            ok = d == _row_argmax(p_req + j * V, V, BLOCK_V).to(tl.int64)
        else:
            u = tl.load(uniforms_ptr + r * m + j)
            ok = u * tl.load(q_req + j * V + d) < tl.load(p_req + j * V + d)
        accepting = accepting & ok.to(tl.int32)
        num_accepted += accepting

    # Row num_accepted is the rejected row (correction) or row n (bonus).
    if IS_GREEDY:
        token = _row_argmax(p_req + num_accepted * V, V, BLOCK_V)
    else:
        token = _race_draw(p_req + num_accepted * V, q_req + num_accepted * V,
                           exponentials_ptr + r * V, num_accepted < n, V, BLOCK_V)

    # [d1 .. dk, x*, -1 ..]: e.g. k = 2, M = 4 -> [d1, d2, x*, -1]
    offs = tl.arange(0, BLOCK_M)
    drafts = tl.load(draft_token_ids_ptr + r * m + offs, mask=offs < num_accepted, other=-1)
    out = tl.where(offs == num_accepted, token.to(tl.int64), drafts)
    tl.store(output_ptr + r * M + offs, out, mask=offs < M)
    tl.store(num_emitted_ptr + r, (num_accepted + 1).to(tl.int64))
