"""DSpark speculative worker (seed §5.5–§5.6): the DFlash round with the anchor-predict layout and
drafts drawn left to right through the sequence head.

State per request is DFlash's (``serving/workers/dflash.py``): ``n`` committed rows in the target
cache and in the drafter's context cache, and the anchor ``a`` at position ``n`` (no KV yet).

    propose  block [a, MASK × (B−1)] at positions n … n+B−1 over context rows < n; rows 0 … k−1
             give backbone logits U; d_j ~ q_j = softmax(U_{j−1} + bias(d_{j−1})), d_0 = a
             (argmax for a greedy request), and a confidence c_j per draft, k ≤ m = B
    verify   target forward on [a, d1 … dk]                                   -> k+1 rows of p
    accept   greedy / rejection sampling with the corrected q_j (never the backbone's softmax)
    commit   target: rows [a, d1 … dr]; draft context: their target hidden    (r + 1 rows)

The emitted tokens are ``[d1 … dr, x*]``; ``x*`` (correction or bonus) is the next anchor. Every
round verifies the chooser's size for the whole batch; the confidences are reported per position
in ``stats()["confidence_by_pos"]`` (mean predicted survival of draft j given the ones before it).
"""

from __future__ import annotations

import torch

from specray.drafters.dflash import block_attention_mask
from specray.drafters.dspark import DSparkDrafter
from specray.serving.runner import LlamaRunner
from specray.serving.sampling import process
from specray.serving.workers.dflash import DFlashWorker


class DSparkWorker(DFlashWorker):
    """The worker protocol (``serving/workers/base.py``) for DSpark: DFlash's round, caches, plain
    step and commit; its own ``propose``. ``num_speculative_tokens`` is clamped to m = B (the
    anchor row drafts too; None = B)."""

    def __init__(self, runner: LlamaRunner, drafter: DSparkDrafter, *, num_speculative_tokens: int | None = None):
        super().__init__(runner, drafter, num_speculative_tokens=num_speculative_tokens)
        m = drafter.config.num_draft_tokens
        k = m if num_speculative_tokens is None else min(num_speculative_tokens, m)
        self.verify_sizes = tuple(range(1, k + 1))
        self.confidence_sum = torch.zeros(m, dtype=torch.float64)  # [m] over drafted positions
        self.confidence_count = torch.zeros(m, dtype=torch.float64)

    def stats(self) -> dict:
        mean = self.confidence_sum / self.confidence_count.clamp(min=1)
        return {**super().stats(), "confidence_by_pos": mean.tolist()}

    @staticmethod
    def _picker(params, generators):
        """Each request's draft from its corrected logits [B, V_d]: argmax (greedy), else a draw
        from ``process``-ed probabilities q, which verification receives (no q when all are greedy)."""

        def pick(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor | None]:
            if all(p.greedy for p in params):
                return logits.argmax(-1), None
            index, qs = [], []
            for b, p in enumerate(params):
                if p.greedy:
                    index.append(logits[b].argmax(-1))
                    qs.append(torch.zeros(logits.shape[-1]))  # unread: a greedy request has no q
                else:
                    q = process(logits[b], p)  # [V_d] the distribution the draft is drawn from
                    index.append(torch.multinomial(q, 1, generator=generators[b]).squeeze(-1))
                    qs.append(q)
            return torch.stack(index), torch.stack(qs)

        return pick

    @torch.inference_mode()
    def propose(self, slots: list[int], anchors: list[int], params, generators, k: int):
        """Draft k tokens per request; returns (drafts [B, k] target ids, q [k, V] or None per request)."""
        n = self.context.committed[torch.tensor(slots)]  # [B] anchor positions
        ctx_len = int(n.max())
        index = self.context.index(torch.tensor(slots))
        ctx_kv = [self.context.read(layer, index, ctx_len) for layer in range(self.cfg.num_layers)]
        anchor_ids = torch.tensor(anchors)
        block = self.drafter.block_inputs(anchor_ids[:, None]).view(len(slots), self.block_size)
        positions = n[:, None] + torch.arange(self.block_size)
        valid = torch.arange(ctx_len)[None, :] < n[:, None]
        mask = block_attention_mask(n[:, None], valid, self.block_size, self.cfg.attention, self.cfg.sliding_window)
        hidden = self.drafter.forward_block(block, positions, ctx_kv, mask, slice(0, k))  # [B, k, D]
        drafts, q, confidence = self.drafter.draft(hidden, anchor_ids, self._picker(params, generators))
        self.confidence_sum[:k] += confidence.sum(0).double()
        self.confidence_count[:k] += len(slots)
        qs = [None if p.greedy else self.drafter.to_target_distribution(q[b]) for b, p in enumerate(params)]
        return drafts, qs
