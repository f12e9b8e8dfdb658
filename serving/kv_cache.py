"""Slot KV cache with an explicit commit (DESIGN.md §2, §7; seed §8.1).

K/V live on the cache's device (the target's); the per-slot bookkeeping (``committed``,
``in_use``) and the ``slots`` / ``start`` tensors callers pass stay on the CPU, and indices into
K/V are moved to the cache's device where they are used.

Each request owns a slot: a preallocated ``[max_len]`` strip of K/V rows per layer. A forward
writes the rows it runs at positions ``committed[slot] …`` as *scratch*; only ``commit(slot, r)``
makes the first ``r`` of them part of the request's context. Rows past the committed length are
never read as context: a query at position ``p`` attends to committed rows and to rows of its
own forward at positions ``<= p`` (``attention_mask``), so a rejected draft row is invisible
from the next round on, and is overwritten by it.

After a DFlash round that verified ``[a, d1 … dm]`` and accepted ``r`` drafts, the worker calls
``commit(slot, r + 1)``: the KV of ``[a, d1 … dr]``. The correction/bonus token has no KV yet;
it is the next round's anchor.
"""

from __future__ import annotations

import torch


class SlotKVCache:
    def __init__(self, *, num_layers: int, num_slots: int, max_len: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu"):
        shape = (num_layers, num_slots, num_kv_heads, max_len, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)  # [L, slots, Hkv, max_len, hd]
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        # bookkeeping on the CPU, wherever K/V live: read by Python every step
        self.committed = torch.zeros(num_slots, dtype=torch.long, device="cpu")  # [slots] rows of trusted context
        self.in_use = torch.zeros(num_slots, dtype=torch.bool, device="cpu")
        self.max_len = max_len

    @property
    def num_slots(self) -> int:
        return self.committed.numel()

    def allocate(self) -> int:
        free = (~self.in_use).nonzero()
        if free.numel() == 0:
            raise RuntimeError("no free KV slot; the scheduler admits at most num_slots requests")
        slot = int(free[0])
        self.in_use[slot] = True
        self.committed[slot] = 0
        return slot

    def release(self, slot: int) -> None:
        self.in_use[slot] = False
        self.committed[slot] = 0

    def write(self, layer: int, slots: torch.Tensor, start: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Scratch-write ``k, v`` [B, Hkv, T, hd] at positions ``start[b] + t`` of each slot."""
        T, hd = k.shape[2], k.shape[3]
        if int((start + T).max()) > self.max_len:
            raise ValueError(f"request exceeds the KV capacity of {self.max_len} positions")
        index = self.flat_index(slots, start, T, heads_first=True)
        self.k[layer].view(-1, hd).index_copy_(0, index, k.reshape(-1, hd))
        self.v[layer].view(-1, hd).index_copy_(0, index, v.reshape(-1, hd))

    def flat_index(self, slots: torch.Tensor, start: torch.Tensor, T: int, *, heads_first: bool) -> torch.Tensor:
        """Where rows ``start[b] + t`` of every KV head of ``slots[b]`` are in one layer's K or V seen as
        ``[slots * Hkv * max_len, hd]``: [B * Hkv * T] ordered (b, h, t) when ``heads_first``, else (b, t, h).

        Writes go through ``index_copy_`` on that view: one contiguous-row copy per index, where an
        advanced-index ``index_put_`` over (slot, head, position) runs in parallel regions that cost
        about 0.6 ms per call on two threads at batch 16 (100× the copy)."""
        Hkv, device = self.k.shape[2], start.device
        base = (slots.to(device)[:, None] * Hkv + torch.arange(Hkv, device=device)[None, :]) * self.max_len  # [B, Hkv]
        rows = start[:, None] + torch.arange(T, device=device)  # [B, T]
        if heads_first:
            return (base[:, :, None] + rows[:, None, :]).reshape(-1).to(self.k.device)
        return (base[:, None, :] + rows[:, :, None]).reshape(-1).to(self.k.device)

    @staticmethod
    def index(slots: torch.Tensor) -> slice | torch.Tensor:
        """How ``read`` selects ``slots``: consecutive slots (always at batch 1) as a slice, so
        reads are views; others as an index tensor (reads gather a copy). Compute once per forward."""
        first = int(slots[0])
        if torch.equal(slots, torch.arange(first, first + len(slots), device=slots.device)):
            return slice(first, first + len(slots))
        return slots

    @staticmethod
    def window(slots: torch.Tensor) -> tuple[slice, torch.Tensor | None] | None:
        """The slots ``[min(slots), max(slots)]`` as a slice (reads are views) when ``slots`` fill at
        least half of it, with each request's place in it (None when ``slots`` are the window in
        order); None for sparser slots (read through ``index``: gathered copies). A reader of the
        window computes the other slots' rows too and drops them, which costs less than copying the
        batch's K/V: ``[0, 2, 3]`` -> ``(slice(0, 4), [0, 2, 3])``, ``[2, 3]`` -> ``(slice(2, 4), None)``."""
        lo, hi = int(slots.min()), int(slots.max())
        if hi - lo + 1 > 2 * len(slots):
            return None
        places = slots - lo  # [B]
        return slice(lo, hi + 1), None if torch.equal(places, torch.arange(len(slots), device=slots.device)) else places

    def read(self, layer: int, index: slice | torch.Tensor, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K/V rows ``[0, length)`` of the slots selected by ``index(slots)``: ([B, Hkv, length, hd], same)."""
        return self.k[layer, index, :, :length], self.v[layer, index, :, :length]

    def commit(self, slot: int, num_rows: int) -> None:
        """Make the next ``num_rows`` scratch rows of ``slot`` trusted context."""
        if num_rows < 0 or int(self.committed[slot]) + num_rows > self.max_len:
            raise ValueError(f"cannot commit {num_rows} rows to slot {slot} at length {int(self.committed[slot])}")
        self.committed[slot] += num_rows

    def compact(self, slot: int, rows: torch.Tensor) -> None:
        """Move scratch rows ``committed + rows[i]`` to ``committed + i`` (every layer), e.g. a tree
        verify's accepted path ``rows = [0, 2, 5]`` -> rows ``[0, 1, 2]``, ready for ``commit(slot, 3)``.
        ``rows`` [n] ascending: gathered (copied) before the write, so overlaps are safe."""
        start = int(self.committed[slot])
        n = len(rows)
        src = start + torch.as_tensor(rows, dtype=torch.long, device=self.k.device)
        self.k[:, slot, :, start : start + n] = self.k[:, slot].index_select(2, src)  # [L, Hkv, n, hd]
        self.v[:, slot, :, start : start + n] = self.v[:, slot].index_select(2, src)


def attention_mask(start: torch.Tensor, num_new: torch.Tensor, T: int, length: int) -> torch.Tensor:
    """[B, T, length] bool: query t of request b (position start[b] + t) sees keys at positions
    ``<= start[b] + t``; padded queries (t >= num_new[b]) see only position 0 (kept finite)."""
    device = start.device
    q_pos = start[:, None] + torch.arange(T, device=device)[None, :]  # [B, T]
    k_pos = torch.arange(length, device=device)
    mask = k_pos[None, None, :] <= q_pos[:, :, None]
    padded = torch.arange(T, device=device)[None, :] >= num_new.to(device)[:, None]
    mask[padded] = False
    mask[..., 0] |= padded
    return mask


def tree_attention_mask(start: torch.Tensor, ancestors: torch.Tensor, length: int) -> torch.Tensor:
    """[B, T, length] bool for tree rows (``serving/runner.py::TreeLayout``): query t of request b
    sees its committed keys (``< start[b]``) and the scratch key ``start[b] + j`` iff
    ``ancestors[b, t, j]`` (row j is t or an ancestor of t); keys past ``start[b] + S`` not at all.
    ``ancestors`` [B, T, S]: S = T in a verify; S scratch rows of earlier forwards for draft rows."""
    B, T, S = ancestors.shape
    start = start.to(ancestors.device)
    k_pos = torch.arange(length, device=ancestors.device)
    mask = (k_pos[None, None, :] < start[:, None, None]).expand(B, T, length).clone()
    if S == 0:
        return mask
    rows = k_pos[None, :] - start[:, None]  # [B, length]: the scratch row a key holds (if 0 <= . < S)
    inside = (rows >= 0) & (rows < S)
    own = torch.gather(ancestors, 2, rows.clamp(0, S - 1)[:, None, :].expand(B, T, length))  # [B, T, length]
    return mask | (own & inside[:, None, :])
