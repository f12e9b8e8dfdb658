"""DSpark speculative worker (seed §5.5–§5.6): the DFlash round with the anchor-predict layout and
drafts drawn left to right through the sequence head.

State per request is DFlash's (``serving/workers/dflash.py``): ``n`` committed rows in the target
cache and in the drafter's context cache, and the anchor ``a`` at position ``n`` (no KV yet).
A round's ``size`` is the batch's **draft budget** ``K`` (``verify_layout = "ragged"``; 0 is a
plain step, ``B·k`` verifies every request's ``k`` drafts, ``k = verify_sizes[-1]``):

    propose   block [a, MASK × (B−1)] at positions n … n+B−1 over context rows < n; rows 0 … k−1
              give backbone logits U; d_j ~ q_j = softmax(U_{j−1} + bias(d_{j−1})), d_0 = a
              (argmax for a greedy request), and a confidence c_j per draft, calibrated with the
              table of the request's mode (greedy: argmax-match survival; sampling: 1 − TV)
    schedule  survival A_j = c_1 ⋯ c_j; the K draft slots of the batch with the highest survival
              (ties: position, then request) -> ℓ_r drafts per request, a prefix
              (``kernels/verify_schedule.py``)
    verify    target forward on [a, d1 … d_ℓ] per request, packed without padding -> ℓ + 1 rows of p
    accept    greedy / rejection sampling with the corrected q_j over each request's ℓ drafts
    commit    target: rows [a, d1 … dr]; draft context: their target hidden    (r + 1 rows)

The emitted tokens are ``[d1 … dr, x*]``; ``x*`` is the correction at the first rejected row or
the bonus from row ℓ (the last verified row). The commit keeps seed §5.6.6's one-row offset: the
r + 1 rows are the old anchor and the r accepted drafts; ``x*`` has no KV yet and is the next
anchor. Acceptance never runs past ℓ, so no accepted length is trimmed by the budget
(``cap_trim_lens`` is 0): an unverified draft is simply not emitted.

**Why the schedule keeps sampling exact** (seed §1.2, §5.5). Rejection sampling of request r's
drafts gives the target's distribution for any truncation rule under which whether ``d_j`` is
verified depends on ``d_1 … d_{j−1}`` and randomness independent of ``d_j``, never on ``d_j`` or
later drafts. Here: ``c_j`` reads the drafter's row and the token *before* ``d_j`` (``d_j`` is
drawn after it), so ``A_j`` is a function of ``d_{<j}``; slot ``(r, j)``'s rank counts the slots
ahead of it, which are r's own earlier positions (always ahead: A is non-increasing and ties go
to the earlier position) and other requests' slots (their drafts come from their own
generators); and ``K`` comes from the chooser's history, not from this round's drafts. The
tests run rounds through the schedule against the target's distribution (chi-square).

``stats()["confidence_by_pos"]``: the mean calibrated confidence of draft j given the ones before it.
"""

from __future__ import annotations

import time

import torch

from specray.drafters.dspark import DSparkDrafter
from specray.kernels.verify_schedule import schedule_verify_lens
from specray.serving.runner import LlamaRunner
from specray.serving.sampling import process
from specray.serving.verify import accept_chains
from specray.serving.workers.base import StepOutput
from specray.serving.workers.dflash import DFlashWorker


class DSparkWorker(DFlashWorker):
    """The worker protocol (``serving/workers/base.py``) for DSpark: DFlash's caches, plain step and
    commit; its own propose and a ragged round. ``num_speculative_tokens`` is clamped to m = B (the
    anchor row drafts too; None = B): ``k``, the most drafts one request verifies."""

    verify_layout = "ragged"

    def __init__(self, runner: LlamaRunner, drafter: DSparkDrafter, *, num_speculative_tokens: int | None = None):
        super().__init__(runner, drafter, num_speculative_tokens=num_speculative_tokens)
        m = drafter.config.num_draft_tokens
        k = m if num_speculative_tokens is None else min(num_speculative_tokens, m)
        self.verify_sizes = tuple(range(1, k + 1))
        # statistics and the chooser's survival history: CPU bookkeeping
        self.confidence_sum = torch.zeros(m, dtype=torch.float64, device="cpu")  # [m] over drafted positions
        self.confidence_count = torch.zeros(m, dtype=torch.float64, device="cpu")
        self.survival = torch.ones(runner.cache.num_slots, k, device="cpu")  # [slots, k] each slot's latest predicted survival
        self.live: set[int] = set()  # slots prefilled and not released

    def prefill(self, slots: list[int], prompts: list[list[int]]) -> torch.Tensor:
        logits = super().prefill(slots, prompts)
        self.survival[torch.tensor(slots, device="cpu")] = 1.0  # a new request: optimistic until it has drafted (seed §5.6.2)
        self.live.update(slots)
        return logits

    def release(self, slot: int) -> None:
        super().release(slot)
        self.live.discard(slot)

    def published_survival(self) -> torch.Tensor:
        """The predicted survival [R, k] of the live requests (slot order), from each one's latest round:
        history the chooser sizes the next round's budget from (serving/chooser.py)."""
        return self.survival[sorted(self.live)]

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
                    qs.append(logits.new_zeros(logits.shape[-1]))  # unread: a greedy request has no q
                else:
                    q = process(logits[b], p)  # [V_d] the distribution the draft is drawn from
                    index.append(torch.multinomial(q, 1, generator=generators[b]).squeeze(-1))
                    qs.append(q)
            return torch.stack(index), torch.stack(qs)

        return pick

    @torch.inference_mode()
    def propose(self, slots: list[int], anchors: list[int], params, generators, k: int):
        """Draft k tokens per request; returns (drafts [B, k] target ids, q [k, V] or None per request)."""
        drafts, qs, _ = self.draft_block(slots, anchors, params, generators, k)
        return drafts, qs

    @torch.inference_mode()
    def draft_block(self, slots: list[int], anchors: list[int], params, generators, k: int):
        """``propose`` plus the calibrated confidences [B, k] of the drafts."""
        anchor_ids = torch.tensor(anchors, device=self.device)
        hidden = self.block_hidden(slots, anchors, slice(0, k))  # [B, k, D]: anchor-predict, row j drafts d_{j+1}
        greedy = torch.tensor([p.greedy for p in params], device=self.device)  # [B] each request's calibration table (its mode)
        drafts, q, confidence = self.drafter.draft(hidden, anchor_ids, self._picker(params, generators), greedy)
        self.confidence_sum[:k] += confidence.sum(0).double().cpu()
        self.confidence_count[:k] += len(slots)
        qs = [None if p.greedy else self.drafter.to_target_distribution(q[b]) for b, p in enumerate(params)]
        return drafts, qs, confidence.float()

    def step(self, slots: list[int], anchors: list[int], params, generators, size: int) -> StepOutput:
        """One propose → schedule → verify → accept → commit round with a budget of ``size`` drafts
        over the batch (0: a plain step; module docstring)."""
        if size == 0:
            return self._plain_step(slots, anchors, params, generators)
        k = self.verify_sizes[-1]
        if not 1 <= size <= len(slots) * k:
            raise ValueError(f"a DSpark round's size is the batch's draft budget, 1 … {len(slots) * k} for "
                             f"{len(slots)} requests of at most {k} drafts; got {size}")
        owed = self.catch_up(slots)
        t0 = time.perf_counter()
        drafts, qs, confidence = self.draft_block(slots, anchors, params, generators, k)  # [B, k], [B, k]
        survival = confidence.cumprod(-1)  # [B, k]
        num_drafts = (schedule_verify_lens(survival, size) - 1).tolist()  # [B] ℓ_r, prefixes
        self.survival[torch.tensor(slots, device="cpu")] = survival.cpu()  # published for the next rounds' budgets, not this one's
        t1 = time.perf_counter()
        out = self._verify(slots, anchors, drafts, num_drafts)
        t2 = time.perf_counter()
        result = accept_chains(out.logits, drafts, params, qs, generators, num_drafts=num_drafts)
        t3 = time.perf_counter()
        self._commit_round(slots, out, result, (t0, t1, t2, t3), owed)
        return StepOutput(result.tokens, num_drafts, result.accepted, True, result.errors, deferred_seconds=owed,
                          target_logits=out.logits)

    def _verify(self, slots: list[int], anchors: list[int], drafts: torch.Tensor, num_drafts: list[int]):
        """The target on ``[a, d1 … d_ℓ]`` per request: logits [B, 1 + max ℓ, V] and hidden, rows past
        each request's ℓ + 1 padding. Equal lengths run the batched forward, others run packed."""
        ids = torch.cat([torch.tensor(anchors, device=drafts.device)[:, None], drafts[:, : max(num_drafts)]],
                        dim=1)  # [B, 1 + max ℓ]
        slot_t = torch.tensor(slots, device="cpu")
        if len(set(num_drafts)) == 1:
            return self.runner.forward(ids, slot_t, torch.full((len(slots),), ids.shape[1], device="cpu"))
        rows = [ids[b, : n + 1].tolist() for b, n in enumerate(num_drafts)]
        return self.runner.prefill(rows, slot_t, every_row=True)
