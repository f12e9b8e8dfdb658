"""Speculative verification (accept / reject / correction / bonus) of a mixed, ragged batch.

Notation (DESIGN.md §2). Request ``r`` fed the target ``[a, d_1 .. d_n]``: its anchor and
``n = n_r`` draft tokens, so the target scored ``n + 1`` rows: row ``j`` (0-based) is ``p_j``,
the target at the position of draft ``d_{j+1}``, and row ``n`` is the bonus row. With ``k``
the accepted draft prefix length (``0 <= k <= n``; DESIGN calls it ``r``, renamed here because
``r`` indexes requests) the round emits ``[d_1 .. d_k, x*]``: ``x*`` is the *correction* drawn
at the first rejected row ``k``, or the *bonus* drawn from row ``n`` when every draft was
accepted, so ``num_emitted = k + 1``.

Ragged layout (STYLE rule 6): requests are flattened one after another. ``cu_num_draft``
``[R + 1]`` holds cumulative draft counts: request ``r``'s drafts are
``draft_token_ids[cu[r] : cu[r + 1]]`` and its ``n_r + 1`` verify rows are
``target[cu[r] + r : cu[r + 1] + r + 1]``. Example, n = [3, 1]: ``cu_num_draft = [0, 3, 4]``,
drafts ``[d1 d2 d3 | e1]``, rows ``[a d1 d2 d3 | b e1]`` -> rows 0..3 and 4..5. The output
uses the rows' layout: each request's accepted drafts, then ``x*``, then ``-1``.

Each request verifies by its own rule (``greedy[r]``), all in one call:

- Greedy: accept ``d_{j+1}`` while ``d_{j+1} == argmax p_j``; ``x*`` is the argmax of row
  ``k``. Ties go to the lowest token id, as in ``torch.argmax``. Only the argmax of each row is
  read, so a greedy request passes the target's logits instead of ``p``: that skips a softmax
  over the vocabulary per row, and is exactly the argmax plain greedy decoding takes (a float32
  softmax can round two nearly equal top logits to one probability, a tie).
- Sampling: accept ``d_{j+1}`` iff ``u_j * q_j(d_{j+1}) < p_j(d_{j+1})`` (``u < min(1, p/q)``,
  ``q_j`` the row of ``draft_probs`` that ``d_{j+1}`` was drawn from); the correction is drawn
  from ``norm([p_k - q_k]+)``, the bonus from ``p_n``. A draw is the exponential race
  ``argmax_v w_v / E_v`` with ``E_v`` i.i.d. Exp(1), which picks ``v`` with probability
  ``w_v / sum(w)``; given ``uniforms`` and ``exponentials`` the result is exact and
  deterministic. A residual that is all zero (only through rounding) falls back to ``p_k``.

Rows must be free of NaN (the serving workers fail a request whose logits are not finite
before verifying it, ``serving/verify.py``).

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
from collections.abc import Sequence

import torch
import triton
import triton.language as tl

PAD_ID = -1  # output slots past num_emitted


def rejection_sample_reference(
    target: torch.Tensor,  # [num_rows, V] float32: logits (greedy request) or p (sampled)
    draft_token_ids: torch.Tensor,  # [num_drafts] int64, num_drafts = num_rows - R
    cu_num_draft: torch.Tensor,  # [R + 1] int32 / int64, cu[0] = 0
    greedy: torch.Tensor,  # [R] bool
    draft_probs: torch.Tensor | None,  # [num_drafts, V] float32; None when every request is greedy
    uniforms: torch.Tensor | None,  # [num_drafts] float32 in [0, 1); None when every request is greedy
    exponentials: torch.Tensor | None,  # [R, V] float32 Exp(1); None when every request is greedy
) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain-torch verification; returns ``(output_token_ids [num_rows] int64, num_emitted [R] int64)``.

    Inputs are assumed valid (``rejection_sample`` checks them). Example, one greedy request,
    drafts ``[5, 7, 2]``, row argmaxes ``[5, 7, 9, 4]`` -> output ``[5, 7, 9, -1]``, emitted 3.
    """
    num_rows, V = target.shape
    R, device = len(greedy), target.device
    cu = cu_num_draft.long()
    n, first_draft = cu[1:] - cu[:-1], cu[:-1]  # [R] drafts per request, index of its first draft
    first_row = first_draft + torch.arange(R, device=device)  # [R] its anchor's row
    output = torch.full((num_rows,), PAD_ID, dtype=torch.int64, device=device)
    accepting = torch.ones(R, dtype=torch.bool, device=device)
    k = torch.zeros(R, dtype=torch.int64, device=device)  # accepted drafts so far
    sampled = draft_probs is not None
    row_argmax = target.argmax(-1) if bool(greedy.any()) else None  # [num_rows]: all a greedy request reads
    for j in range(int(n.max()) if R else 0):
        live = accepting & (j < n)
        at = torch.where(live, first_draft + j, 0)  # [R] draft index (0 for requests past their drafts)
        row = torch.where(live, first_row + j, 0)  # [R] the row that verifies it
        d = torch.where(live, draft_token_ids[at], 0)
        ok = torch.zeros(R, dtype=torch.bool, device=device) if row_argmax is None else d == row_argmax[row]
        if sampled:
            ok = torch.where(greedy, ok, uniforms[at] * draft_probs[at, d] < target[row, d])
        accepting = live & ok
        output[(first_row + j)[accepting]] = d[accepting]
        k += accepting.long()

    last = first_row + k  # [R]: the rejected row, or the bonus row n
    token = torch.zeros(R, dtype=torch.int64, device=device) if row_argmax is None else row_argmax[last]
    if sampled:
        p = target[last]  # [R, V]
        w = p
        if len(draft_token_ids):
            q = draft_probs[(first_draft + k).clamp(max=len(draft_token_ids) - 1)]  # [R, V], read on rejection
            w = torch.where((k < n)[:, None], (p - q).clamp_min(0.0), p)
        w = torch.where(w.amax(-1, keepdim=True) > 0, w, p)  # residual lost to rounding -> p
        token = torch.where(greedy, token, (w / exponentials).argmax(-1))
    output[last] = token
    return output, k + 1


def rejection_sample(
    target: torch.Tensor,  # [num_rows, V] float32, num_rows = num_drafts + R
    draft_token_ids: torch.Tensor,  # [num_drafts] int64
    cu_num_draft: torch.Tensor,  # [R + 1] int32 / int64
    greedy: torch.Tensor,  # [R] bool
    draft_probs: torch.Tensor | None = None,  # [num_drafts, V] float32; read for sampled requests only
    uniforms: torch.Tensor | None = None,  # [num_drafts] float32; drawn if None
    exponentials: torch.Tensor | None = None,  # [R, V] float32; drawn if None
    *,
    generators: Sequence[torch.Generator | None] | None = None,  # [R]; None for greedy requests
    use_triton: bool | None = None,
    block_v: int = 1024,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Verify every request's drafts, each by its own rule, in one call (module docstring).

    Returns ``(output_token_ids [num_rows] int64, num_emitted [R] int64)`` in the rows' layout:
    request r's accepted drafts, then its correction or bonus token, then ``-1``. For sampled
    requests (``greedy[r]`` False) ``draft_probs`` is required; their missing ``uniforms`` then
    ``exponentials`` are drawn request by request from ``generators[r]`` (its ``n_r``
    uniforms, then ``V`` exponentials; a generator None draws from torch's default one).
    Greedy requests read none of these (their rows of them may hold anything).
    ``use_triton=None`` runs the Triton kernel for CUDA tensors and the reference otherwise;
    ``block_v`` is the kernel's vocabulary chunk.
    """
    _check(isinstance(target, torch.Tensor) and target.dim() == 2 and target.shape[1] >= 1,
           f"target must be a [num_rows, V >= 1] tensor, got {getattr(target, 'shape', None)}")
    _check(isinstance(greedy, torch.Tensor) and greedy.dim() == 1 and greedy.dtype == torch.bool,
           f"greedy must be a [R] bool tensor, got {getattr(greedy, 'shape', None)} {getattr(greedy, 'dtype', None)}")
    R = len(greedy)
    generators = [None] * R if generators is None else list(generators)
    _check(len(generators) == R, f"generators must hold one entry per request ({R}), got {len(generators)}")
    _check_layout(target, draft_token_ids, cu_num_draft, greedy)
    is_greedy = greedy.tolist()
    if any(g is not None for g, gr in zip(generators, is_greedy) if gr) or (
            all(is_greedy) and (uniforms is not None or exponentials is not None)):
        warnings.warn("rejection_sample: greedy requests ignore uniforms, exponentials and generators", stacklevel=2)
    if all(is_greedy):
        draft_probs = uniforms = exponentials = None
    else:
        uniforms, exponentials = _draw_missing(target, cu_num_draft, is_greedy, uniforms, exponentials, generators)
        _check_sampling(target, draft_token_ids, cu_num_draft, greedy, draft_probs, uniforms, exponentials)

    if use_triton is None:
        use_triton = target.is_cuda
    if not use_triton:
        return rejection_sample_reference(target, draft_token_ids, cu_num_draft, greedy, draft_probs, uniforms,
                                          exponentials)
    if not target.is_cuda and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError("use_triton=True needs CUDA tensors, or TRITON_INTERPRET=1 set before "
                         "triton is imported; use use_triton=None to run the reference on CPU")
    if block_v < 16 or block_v & (block_v - 1):
        raise ValueError(f"block_v must be a power of two >= 16, got {block_v}")
    return _launch(target, draft_token_ids, cu_num_draft, greedy, draft_probs, uniforms, exponentials, block_v)


def _launch(target, draft_token_ids, cu_num_draft, greedy, draft_probs, uniforms, exponentials, block_v):
    (num_rows, V), R = target.shape, len(greedy)
    sentinel = -999  # every slot is overwritten by the kernel; a leftover -999 is a kernel bug
    output = torch.full((num_rows,), sentinel, dtype=torch.int64, device=target.device)
    num_emitted = torch.full((R,), sentinel, dtype=torch.int64, device=target.device)
    if R == 0:
        return output, num_emitted
    max_n = int((cu_num_draft[1:] - cu_num_draft[:-1]).max())
    _rejection_sample_kernel[(R,)](
        output, num_emitted, target, draft_token_ids if len(draft_token_ids) else output, cu_num_draft, greedy,
        target if draft_probs is None else draft_probs, target if uniforms is None else uniforms,
        target if exponentials is None else exponentials, V,  # dummies are never read: no request samples
        BLOCK_V=min(block_v, max(16, triton.next_power_of_2(V))), BLOCK_M=max(16, triton.next_power_of_2(max_n + 1)),
    )
    return output, num_emitted


def _draw_missing(target, cu_num_draft, is_greedy, uniforms, exponentials, generators):
    """Per sampled request r, from ``generators[r]`` on its device: n_r uniforms, then V exponentials."""
    (num_rows, V), R = target.shape, len(is_greedy)
    f32, device = torch.float32, target.device
    draw_u, draw_e = uniforms is None, exponentials is None
    if draw_u:
        uniforms = torch.zeros(num_rows - R, dtype=f32, device=device)
    if draw_e:
        exponentials = torch.ones((R, V), dtype=f32, device=device)
    cu = cu_num_draft.tolist()
    for r in (r for r in range(R) if not is_greedy[r]):
        g = generators[r]
        at = device if g is None else g.device
        if draw_u:
            uniforms[cu[r] : cu[r + 1]] = torch.rand(cu[r + 1] - cu[r], generator=g, device=at, dtype=f32)
        if draw_e:
            e = torch.empty(V, device=at, dtype=f32).exponential_(generator=g)
            exponentials[r] = e.clamp_min_(torch.finfo(f32).tiny)  # an exact 0 would make w / E inf or nan
    return uniforms, exponentials


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(f"rejection_sample: {message}")


def _check_tensor(name: str, t: object, shape: tuple[int, ...], dtypes: tuple[torch.dtype, ...],
                  device: torch.device) -> None:
    _check(isinstance(t, torch.Tensor), f"{name} must be a torch.Tensor, got {type(t).__name__}")
    _check(tuple(t.shape) == shape, f"{name} must have shape {list(shape)}, got {list(t.shape)}")
    _check(t.dtype in dtypes, f"{name} must have dtype {' or '.join(map(str, dtypes))}, got {t.dtype}")
    _check(t.device == device, f"{name} is on {t.device} but target is on {device}")
    _check(t.is_contiguous(), f"{name} must be contiguous; call .contiguous() first")


def _check_layout(target, draft_token_ids, cu_num_draft, greedy) -> None:
    (num_rows, V), R, device = target.shape, len(greedy), target.device
    _check(num_rows >= R, f"target has {num_rows} rows, fewer than one per request (R = {R})")
    num_drafts = num_rows - R
    _check_tensor("target", target, (num_rows, V), (torch.float32,), device)
    _check_tensor("greedy", greedy, (R,), (torch.bool,), device)
    _check_tensor("cu_num_draft", cu_num_draft, (R + 1,), (torch.int32, torch.int64), device)
    _check_tensor("draft_token_ids", draft_token_ids, (num_drafts,), (torch.int64,), device)
    n = cu_num_draft[1:] - cu_num_draft[:-1]
    _check(int(cu_num_draft[0]) == 0 and bool((n >= 0).all()) and int(cu_num_draft[-1]) == num_drafts,
           f"cu_num_draft must rise from 0 to num_drafts = num_rows - R = {num_drafts}, got {cu_num_draft.tolist()}")
    _check(bool(((draft_token_ids >= 0) & (draft_token_ids < V)).all()), f"draft_token_ids must lie in [0, V={V})")


def _check_sampling(target, draft_token_ids, cu_num_draft, greedy, draft_probs, uniforms, exponentials) -> None:
    (num_rows, V), R, device = target.shape, len(greedy), target.device
    num_drafts = num_rows - R
    _check(draft_probs is not None, "draft_probs is required when a request samples (greedy[r] False): "
           "the distribution its drafts were drawn from")
    _check_tensor("draft_probs", draft_probs, (num_drafts, V), (torch.float32,), device)
    _check_tensor("uniforms", uniforms, (num_drafts,), (torch.float32,), device)
    _check_tensor("exponentials", exponentials, (R, V), (torch.float32,), device)
    owner = torch.repeat_interleave(torch.arange(R, device=device), cu_num_draft[1:] - cu_num_draft[:-1])
    sampled = ~greedy[owner]  # [num_drafts]: drafts of sampled requests
    u = uniforms[sampled]
    _check(bool(((u >= 0) & (u < 1)).all()), "uniforms must lie in [0, 1)")
    _check(bool((exponentials[~greedy] > 0).all()), "exponentials must be > 0 (i.i.d. Exp(1) samples)")
    q_d = draft_probs.gather(1, draft_token_ids[:, None])[:, 0]
    bad = (sampled & ~(q_d > 0)).nonzero()[:, 0]  # [num_bad] draft indices
    _check(len(bad) == 0, f"draft_probs gives q = 0 to draft {bad[:1].tolist()} (of request "
           f"{owner[bad[:1]].tolist()}): q must be the distribution the drafts were actually sampled from")


@triton.jit
def _row_argmax(row_ptr, V, BLOCK_V: tl.constexpr):
    """Lowest index of the maximum of ``row[0:V]`` (as ``torch.argmax``), scanned in BLOCK_V chunks.
    Starts from and pads with -inf, so any finite maximum (also one <= -1) wins."""
    best = tl.full([], float("-inf"), tl.float32)
    best_idx = tl.full([], 0, tl.int32)
    for v0 in range(0, V, BLOCK_V):
        offs = v0 + tl.arange(0, BLOCK_V)
        x = tl.load(row_ptr + offs, mask=offs < V, other=float("-inf"))
        blk_best = tl.max(x, axis=0)
        blk_idx = tl.argmax(x, axis=0, tie_break_left=True) + v0
        better = blk_best > best  # strict: an earlier chunk keeps ties
        best = tl.where(better, blk_best, best)
        best_idx = tl.where(better, blk_idx, best_idx)
    return best_idx


@triton.jit
def _race_draw(p_ptr, q_ptr, e_ptr, is_correction, V, BLOCK_V: tl.constexpr):
    """``argmax_v w_v / E_v`` with w = [p - q]+ (correction) or p (bonus); w all zero -> p."""
    best_w = tl.full([], -1.0, tl.float32)  # ratios are >= 0; -1 marks padding
    idx_w = tl.full([], 0, tl.int32)
    max_w = tl.full([], 0.0, tl.float32)
    best_p = tl.full([], -1.0, tl.float32)
    idx_p = tl.full([], 0, tl.int32)
    q_len = tl.where(is_correction, V, 0)  # the bonus row n has no q row (it may lie out of bounds)
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
    output_ptr,  # [num_rows] int64, every slot written
    num_emitted_ptr,  # [R] int64
    target_ptr,  # [num_rows, V] float32
    draft_token_ids_ptr,  # [num_drafts] int64
    cu_num_draft_ptr,  # [R + 1] int32 / int64
    greedy_ptr,  # [R] bool
    draft_probs_ptr,  # [num_drafts, V] float32 (read for sampled requests only)
    uniforms_ptr,  # [num_drafts] float32 (sampled only)
    exponentials_ptr,  # [R, V] float32 (sampled only)
    V,
    BLOCK_V: tl.constexpr,
    BLOCK_M: tl.constexpr,  # >= max_r n_r + 1
):
    r = tl.program_id(0).to(tl.int64)  # one program per request; int64 offsets for big rows * V
    first_draft = tl.load(cu_num_draft_ptr + r).to(tl.int64)
    n = (tl.load(cu_num_draft_ptr + r + 1) - first_draft).to(tl.int32)
    first_row = first_draft + r  # the anchor's row: request r's rows are first_row .. first_row + n
    p_req = target_ptr + first_row * V
    is_greedy = tl.load(greedy_ptr + r)
    accepting = tl.full([], 1, tl.int32)
    num_accepted = tl.full([], 0, tl.int32)
    for j in range(0, n):  # no break in Triton: `accepting` drops to 0 at the first rejection
        d = tl.load(draft_token_ids_ptr + first_draft + j)
        if is_greedy:
            ok = d == _row_argmax(p_req + j * V, V, BLOCK_V).to(tl.int64)
        else:
            u = tl.load(uniforms_ptr + first_draft + j)
            ok = u * tl.load(draft_probs_ptr + (first_draft + j) * V + d) < tl.load(p_req + j * V + d)
        accepting = accepting & ok.to(tl.int32)
        num_accepted += accepting

    # Row num_accepted is the rejected row (correction) or row n (bonus).
    if is_greedy:
        token = _row_argmax(p_req + num_accepted * V, V, BLOCK_V)
    else:
        token = _race_draw(p_req + num_accepted * V, draft_probs_ptr + (first_draft + num_accepted) * V,
                           exponentials_ptr + r * V, num_accepted < n, V, BLOCK_V)

    # [d1 .. dk, x*, -1 ..] over the request's n + 1 rows: e.g. k = 2, n = 3 -> [d1, d2, x*, -1]
    offs = tl.arange(0, BLOCK_M)
    drafts = tl.load(draft_token_ids_ptr + first_draft + offs, mask=offs < num_accepted, other=-1)
    out = tl.where(offs == num_accepted, token.to(tl.int64), drafts)
    tl.store(output_ptr + first_row + offs, out, mask=offs <= n)
    tl.store(num_emitted_ptr + r, (num_accepted + 1).to(tl.int64))
