"""DFlash 2 speculative worker (seed §6.5): DFlash's round with the selector's walked path as the drafts.

Prefill, verification, acceptance and the target-hidden commit of the draft context are
DFlash's (``serving/workers/dflash.py``); only ``propose`` differs:

    block forward      [a, MASK × m] -> hidden h_1 … h_k, unary logits U_1 … U_k      (as DFlash)
    candidates         top-K of each U_j                        -> ids [B, k, K]
    lattice            S_j(p, c) over adjacent candidates       -> [B, k, K, K]       (drafters/dflash2.py)
    walk               causal, from the anchor's row            -> path, q rows       (kernels/selector_walk.py)

A greedy request drafts the argmax path. A sampled request (temperature T) draws each position
from ``q_j = softmax(S_j(d_{j−1}, ·) / T)`` over the K candidates; that ``q_j``, scattered to the
target vocabulary (zero outside the candidates), is what verification receives: the distribution
the draft was actually drawn from, so rejection sampling stays lossless (seed §1.2) while the
target can still emit any token through the residual. The request's top-k / top-p shape the
target's ``p`` only; ``q`` needs nothing but to be the drawing distribution. Each round scatters
into a fresh zero tensor, so no candidate of an earlier round keeps mass in ``q``.
"""

from __future__ import annotations

import torch

from specray.kernels.selector_walk import selector_walk
from specray.serving.workers.dflash import DFlashWorker


class DFlash2Worker(DFlashWorker):
    """The worker protocol (``serving/workers/base.py``) for DFlash 2: ``DFlashWorker`` whose
    proposal walks the candidate selector (its drafter is a ``DFlash2Drafter``)."""

    @torch.inference_mode()
    def propose(self, slots: list[int], anchors: list[int], params, generators, k: int):
        """Draft k tokens per request along the selector's walk; returns (drafts [B, k] target ids,
        q [k, V] or None per request), q zero outside each position's K candidates."""
        hidden = self.block_hidden(slots, anchors, slice(1, k + 1))  # [B, k, D]
        unary = self.drafter.logits(hidden)  # [B, k, V | V_d]
        device = self.device
        _, ids, lattice = self.drafter.lattice(unary, hidden, torch.tensor(anchors, device=device))  # [B, k, K], [B, k, K, K]
        temperature = torch.tensor([p.temperature for p in params], dtype=torch.float32, device=device)
        uniforms = torch.stack([torch.zeros(k, device=device) if p.greedy else torch.rand(k, generator=g, device=device)
                                for p, g in zip(params, generators)])  # [B, k]
        path, q_rows = selector_walk(lattice.float().contiguous(), temperature, uniforms)  # [B, k], [B, k, K]
        drafts = ids.gather(-1, path[..., None])[..., 0]  # [B, k] target ids
        V = self.cfg.vocab_size
        qs = [None if p.greedy else torch.zeros(k, V, device=device).scatter_(-1, ids[b], q_rows[b])
              for b, p in enumerate(params)]
        return drafts, qs
