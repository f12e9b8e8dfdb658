"""DFlash speculative worker (seed §4.4, §8.1): propose a block, verify it in one target
forward, accept, commit — one round per call of ``step``.

State per request at the start of a round: ``n`` committed rows in both the target cache and
the drafter's context cache (the projected target hidden of those rows, as K/V per draft layer;
rows a prefill or a plain step committed are owed until the round's ``catch_up``), and the
anchor ``a`` (the last emitted token, which has no KV yet, at position ``n``).

    propose  block [a, MASK × m] at positions n … n+m over context rows < n  -> d1 … dk (q), k ≤ m
    verify   target forward on [a, d1 … dk]                                  -> k+1 rows of p
    accept   greedy / rejection sampling, the batch in one call (serving/verify.py) -> r, x*
    commit   target: rows [a, d1 … dr]; draft context: their target hidden   (r + 1 rows)

The emitted tokens are ``[d1 … dr, x*]``; ``x*`` (correction or bonus) is the next anchor.
Rejected rows stay as uncommitted scratch and are never read again.
"""

from __future__ import annotations

import time

import torch

from specray.drafters.dflash import BlockLayout, DFlashDrafter
from specray.serving.kv_cache import SlotKVCache
from specray.serving.runner import LlamaRunner
from specray.serving.sampling import process
from specray.serving.verify import accept_chains
from specray.serving.workers.ar import ar_step, prefill_target
from specray.serving.workers.base import StepOutput
from specray.serving.workers.deferred import DeferredRows, prompt_features


class DFlashWorker:
    """The worker protocol (``serving/workers/base.py``) for DFlash.

    ``num_speculative_tokens`` (clamped to m = B − 1; None = m) is the largest round: a round of
    size k verifies k drafts. The drafter still feeds its whole block of B rows to attention (its
    positions attend to each other), but only rows 1 … k go through its last layer's queries and
    MLP, the LM head and the target: when acceptance falls off after a few positions
    (docs/benchmarks.md), a smaller k makes a round cheaper and loses only what k could not accept.
    The engine's chooser picks k per round (``serving/chooser.py``).

    A round of size 0 is a *plain* step — no draft, one target row per request (the anchor), the
    next token sampled from it exactly as the AR worker does. The target cache commits that row;
    the drafter's context owes it (``serving/workers/deferred.py``), as it owes a prompt's rows
    after ``prefill``, until ``catch_up`` projects every owed row in batched passes, which the
    next round of size >= 1 does first: speculation resumes on the context eager commits would
    have built, and a request the chooser never speculates for costs no drafter work.
    """

    verify_layout = "chain"

    def __init__(self, runner: LlamaRunner, drafter: DFlashDrafter, *, num_speculative_tokens: int | None = None):
        cfg = drafter.config
        if tuple(runner.capture_layer_ids) != tuple(cfg.target_layer_ids):
            raise ValueError("the runner must capture the drafter's target layer ids")
        if num_speculative_tokens is not None and num_speculative_tokens < 1:
            raise ValueError(f"num_speculative_tokens must be >= 1 (or None for the drafter's block), "
                             f"got {num_speculative_tokens}")
        m = cfg.block_size - 1
        k = m if num_speculative_tokens is None else min(num_speculative_tokens, m)
        self.verify_sizes = tuple(range(1, k + 1))
        self.runner, self.drafter, self.cfg = runner, drafter, cfg
        cache, dtype = runner.cache, drafter.fc.weight.dtype
        self.device = runner.device
        self.deferred = DeferredRows(num_slots=cache.num_slots, width=drafter.fc.weight.shape[1], dtype=dtype)
        # a catch-up writes each slot's owed rows padded to the longest: room past max_len for the padding
        self.context = SlotKVCache(num_layers=cfg.num_layers, num_slots=cache.num_slots,
                                   max_len=cache.max_len + self.deferred.capacity, num_kv_heads=cfg.num_kv_heads,
                                   head_dim=cfg.head_dim, dtype=dtype, device=self.device)
        self.block_size = cfg.block_size
        self.phase_seconds = {"draft": 0.0, "verify": 0.0, "accept": 0.0, "commit": 0.0}
        self.steps = 0  # speculative rounds (plain steps are not timed)

    @property
    def max_verify_rows(self) -> int:
        return self.verify_sizes[-1] + 1

    def release(self, slot: int) -> None:
        self.context.release(slot)
        self.deferred.release(slot)

    def stats(self) -> dict:
        return {"steps": self.steps, "phase_seconds": dict(self.phase_seconds)}

    def _commit_context(self, slots: list[int], feats: torch.Tensor, rows: list[int]) -> None:
        """Project the features [B, T, L*D] of each request's first ``rows[b]`` rows into draft K/V."""
        slot_t = torch.tensor(slots, device="cpu")
        start = self.context.committed[slot_t]
        positions = (start[:, None] + torch.arange(feats.shape[1], device="cpu")).to(self.device)
        with torch.inference_mode():
            kv = self.drafter.context_kv(self.drafter.project_context(feats.to(self.device)), positions)
        for layer, (k, v) in enumerate(kv):
            self.context.write(layer, slot_t, start, k, v)
        for slot, r in zip(slots, rows):
            self.context.commit(slot, r)

    def prefill(self, slots: list[int], prompts: list[list[int]]) -> torch.Tensor:
        """Run the prompts and commit them in the target cache; the drafter's context owes their
        rows until ``catch_up``. Returns last-row logits [B, V]."""
        logits, out = prefill_target(self.runner, slots, prompts)
        features = prompt_features(out, self.cfg.target_layer_ids, [len(p) for p in prompts])
        for slot, rows in zip(slots, features):
            self.deferred.owe_prompt(slot, rows)
        return logits

    def catch_up(self, slots: list[int]) -> float:
        """Project every context row ``slots`` owe (their prompts', then plain steps'), a batch
        each; returns its seconds."""
        start = time.perf_counter()
        for owed in self.deferred.take(slots):
            self._commit_context(owed.slots, owed.values, owed.rows)
        return time.perf_counter() - start

    def block_hidden(self, slots: list[int], anchors: list[int], rows: slice) -> torch.Tensor:
        """The drafter's block [a, MASK × m] at positions n … n+m over each request's context rows
        < n; returns the final hidden states [B, len(rows), D] of block ``rows`` (DFlash drafts from
        rows 1 … k; a drafter on this backbone may read others), computed only for those rows."""
        slot_t = torch.tensor(slots, device="cpu")
        n = self.context.committed[slot_t]  # [B] anchor positions (CPU)
        ctx_len = int(n.max())
        index = self.context.index(slot_t)
        index = index if isinstance(index, slice) else index.to(self.device)
        ctx_kv = [self.context.read(layer, index, ctx_len) for layer in range(self.cfg.num_layers)]
        block = self.drafter.block_inputs(torch.tensor(anchors, device=self.device)[:, None]).view(len(slots),
                                                                                                  self.block_size)
        n = n.to(self.device)
        positions = n[:, None] + torch.arange(self.block_size, device=self.device)
        valid = torch.arange(ctx_len, device=self.device)[None, :] < n[:, None]
        layout = BlockLayout(n[:, None], valid, self.block_size, self.cfg.attention, self.cfg.sliding_window)
        return self.drafter.forward_block(block, positions, ctx_kv, layout, rows)

    @torch.inference_mode()
    def propose(self, slots: list[int], anchors: list[int], params, generators, k: int):
        """Draft k tokens per request; returns (drafts [B, k] target ids, q [k, V] or None per request).

        With a draft vocabulary the drafter's distribution covers V_d tokens; ``q`` is handed to
        verification over the target's V (zero outside), the distribution the drafts were drawn from."""
        logits = self.drafter.logits(self.block_hidden(slots, anchors, slice(1, k + 1)))  # [B, k, V|V_d]
        drafts, qs = [], []
        for b, p in enumerate(params):
            if p.greedy:
                drafts.append(logits[b].argmax(-1))
                qs.append(None)
            else:
                q = process(logits[b], p)  # the distribution the drafts are sampled from
                drafts.append(torch.multinomial(q, 1, generator=generators[b]).squeeze(-1))
                qs.append(self.drafter.to_target_distribution(q))
        return self.drafter.draft_to_target(torch.stack(drafts)), qs

    def step(self, slots: list[int], anchors: list[int], params, generators, size: int) -> StepOutput:
        """One propose → verify → accept → commit round of ``size`` drafts (0: a plain step).

        Wall-clock time per phase accumulates in ``phase_seconds`` (what ``bench serve`` reports);
        a plain step is not a round and is not timed there."""
        if size == 0:
            return self._plain_step(slots, anchors, params, generators)
        if size not in self.verify_sizes:
            raise ValueError(f"round size {size} is not one of this worker's verify_sizes {self.verify_sizes}")
        owed = self.catch_up(slots)
        t0 = time.perf_counter()
        drafts, qs = self.propose(slots, anchors, params, generators, size)  # [B, k], per request [k, V] or None
        verify_ids = torch.cat([torch.tensor(anchors, device=drafts.device)[:, None], drafts], dim=1)  # [B, k + 1]
        B, M = verify_ids.shape
        t1 = time.perf_counter()
        out = self.runner.forward(verify_ids, torch.tensor(slots, device="cpu"), torch.full((B,), M, device="cpu"))
        t2 = time.perf_counter()
        result = accept_chains(out.logits, drafts, params, qs, generators)
        t3 = time.perf_counter()
        self._commit_round(slots, out, result, (t0, t1, t2, t3), owed)
        return StepOutput(result.tokens, [M - 1] * B, result.accepted, True, result.errors, deferred_seconds=owed,
                          target_logits=out.logits)

    def _commit_round(self, slots: list[int], out, result, times: tuple[float, ...], owed: float) -> None:
        """Commit each request's ``[a, d1 … dr]`` (r + 1 rows, 0 if it failed) in the target cache and
        the drafter's context; add the round's phase times (``times`` = start of draft, verify,
        accept, commit; ``owed`` = the catch-up, counted in commit)."""
        rows = [len(tokens) for tokens in result.tokens]
        for slot, n in zip(slots, rows):
            self.runner.cache.commit(slot, n)
        self._commit_context(slots, out.features_of(self.cfg.target_layer_ids), rows)
        t0, t1, t2, t3 = times
        t4 = time.perf_counter()
        for phase, seconds in zip(self.phase_seconds, (t1 - t0, t2 - t1, t3 - t2, t4 - t3 + owed)):
            self.phase_seconds[phase] += seconds
        self.steps += 1

    def _plain_step(self, slots: list[int], anchors: list[int], params, generators) -> StepOutput:
        """One target row per request: the AR step; the drafter context owes that row."""
        owed = self.catch_up(slots) if self.deferred.full(slots) else 0.0
        tokens, errors, out = ar_step(self.runner, slots, anchors, params, generators)
        self.deferred.push(slots, out.features_of(self.cfg.target_layer_ids)[:, 0])
        return StepOutput.plain(tokens, errors, deferred_seconds=owed, target_logits=out.logits)
