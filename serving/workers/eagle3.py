"""EAGLE-3 speculative worker (seed §3.4): draft a chain from the drafter's own state, verify it in
one target forward, accept, commit, then re-run the draft layer on the target-confirmed features
of the accepted rows ("draft extend").

Drafter rows (``drafters/eagle3.py``): row ``i`` pairs the target state ``g_i`` (the fused
features of target row ``i``) with the *next* token ``x_{i+1}`` at position ``i + 1``; its output
state predicts ``x_{i+2}``. Per request the drafter's rows are those whose next token is known —
in its KV cache, or owed until ``catch_up`` (below) — and ``state`` is the output of its last one.
After ``prefill`` of ``n`` prompt tokens that is rows ``0 … n−2`` (owed): row ``n−1`` waits for
the first anchor, which the engine samples from the prefill's logits, so its target state is
kept as ``pending`` until the first ``step``.

A round for a request whose target cache holds ``n`` rows, anchor ``a = x_n`` (no KV yet), drafter
rows ``0 … n−1`` (the last one paired ``g_{n−1}`` with ``a``):

    draft    d1 ~ head(state); row (state, d1) at n+1 -> d2; … -> dk     (k − 1 chain rows, scratch)
    verify   target forward on [a, d1 … dk]                              -> k+1 rows of p, g_n … g_{n+k}
    accept   greedy / rejection sampling, the batch in one call (serving/verify.py) -> r, x*
    commit   target rows [a, d1 … dr]                                    (r + 1 rows)
    extend   drafter rows (g_n … g_{n+r}) with (d1 … dr, x*)             (r + 1 rows, overwriting
             the chain's scratch) -> the new state, whose head drafts the next round's d1

After the round the drafter's cache and state are exactly those a fresh prefill of the accepted
text followed by its first anchor gives (tested): the chain's self-fed rows are scratch, never
committed, and every committed row was computed from target-confirmed features and tokens.

The drafter rows a prefill, a plain step or the first anchor makes known — a target row's
features and the token after it — are owed (``serving/workers/deferred.py``) until ``catch_up``
runs them in batched passes, which a round of size >= 1 does before it drafts.
"""

from __future__ import annotations

import time

import torch

from specray.drafters.eagle3 import Eagle3Drafter
from specray.serving.kv_cache import SlotKVCache
from specray.serving.runner import LlamaRunner, RunnerOutput, pad_rows
from specray.serving.sampling import process
from specray.serving.verify import accept_chains
from specray.serving.workers.ar import ar_step, prefill_target
from specray.serving.workers.base import StepOutput
from specray.serving.workers.deferred import DeferredRows, prompt_features

DEFAULT_NUM_DRAFTS = 3  # k when the engine does not set num_speculative_tokens


class Eagle3Worker:
    """``num_speculative_tokens`` = the longest chain a round may draft (default ``DEFAULT_NUM_DRAFTS``);
    ``verify_sizes`` = ``1 … k``, the chain lengths the engine may pick per round.

    ``step(..., size=0)`` is a *plain* step (one target row per request, the next token sampled as
    the AR worker does); the drafter owes the row (features and the token after it) until the next
    round of size >= 1 catches up, so speculation resumes with the state step-by-step extends build."""

    verify_layout = "chain"

    def __init__(self, runner: LlamaRunner, drafter: Eagle3Drafter, *, num_speculative_tokens: int | None = None):
        cfg = drafter.config
        if tuple(runner.capture_layer_ids) != tuple(cfg.target_layer_ids):
            raise ValueError("the runner must capture the drafter's target layer ids")
        k = DEFAULT_NUM_DRAFTS if num_speculative_tokens is None else num_speculative_tokens
        if k < 1:
            raise ValueError(f"num_speculative_tokens must be >= 1, got {k}")
        self.verify_sizes = tuple(range(1, k + 1))  # chain lengths a round may verify
        self.runner, self.drafter, self.cfg = runner, drafter, cfg
        slots, dtype, self.device = runner.cache.num_slots, drafter.fc.weight.dtype, runner.device
        self.deferred = DeferredRows(num_slots=slots, width=drafter.fc.weight.shape[1], dtype=dtype)
        # scratch past max_len: the round's own rows, and a catch-up's padding to the longest owed run
        scratch = max(self._scratch_rows(), self.deferred.capacity)
        self.cache = SlotKVCache(num_layers=cfg.num_layers, num_slots=slots, max_len=runner.cache.max_len + scratch,
                                 num_kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim, dtype=dtype, device=self.device)
        self.state = torch.zeros(slots, cfg.hidden_size, dtype=dtype, device=self.device)  # [slots, D] output of the last row
        # [slots, L·D] features of the row awaiting its token
        self.pending = torch.zeros(slots, drafter.fc.weight.shape[1], dtype=dtype, device=self.device)
        self.has_pending = torch.zeros(slots, dtype=torch.bool, device="cpu")  # bookkeeping
        self.phase_seconds = {"draft": 0.0, "verify": 0.0, "accept": 0.0, "commit": 0.0}
        self.steps = 0

    @property
    def max_verify_rows(self) -> int:
        return self.verify_sizes[-1] + 1

    def _scratch_rows(self) -> int:
        """Drafter rows past the target's verify rows a round writes (a chain's k − 1 fit in them)."""
        return 0

    def stats(self) -> dict:
        return {"steps": self.steps, "phase_seconds": dict(self.phase_seconds)}

    def release(self, slot: int) -> None:
        self.cache.release(slot)
        self.deferred.release(slot)
        self.has_pending[slot] = False

    # -- the drafter's rows ---------------------------------------------------------------

    def _features(self, out: RunnerOutput) -> torch.Tensor:
        """A target forward's captured layers -> the drafter's features [B, T, L·D]."""
        return out.features_of(self.cfg.target_layer_ids)

    @torch.inference_mode()
    def _rows(self, slots: torch.Tensor, start: torch.Tensor, state: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        """Run drafter rows at cache indices ``start[b] + t`` (positions one more), as scratch.

        state [B, T, D], tokens [B, T] target ids; a row sees the slot's rows ``< start[b]`` and its
        own earlier rows (causal; padded rows past a request's real ones only see real rows before
        them and are never read as context). Returns output states [B, T, D]."""
        B, T = tokens.shape
        C, device = int(start.max()), self.device
        begin = start.to(device)
        mask = torch.cat([(torch.arange(C, device=device)[None, :] < begin[:, None])[:, None, :].expand(B, T, C),
                          torch.ones(T, T, dtype=torch.bool, device=device).tril().expand(B, T, T)], dim=-1)  # [B, T, C + T]
        return self._run_rows(slots, start, state, tokens, begin[:, None] + torch.arange(T, device=device) + 1, mask)

    @torch.inference_mode()
    def _run_rows(self, slots: torch.Tensor, start: torch.Tensor, state: torch.Tensor, tokens: torch.Tensor,
                  positions: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """Drafter rows (state [B, T, D], tokens / positions [B, T]) over the slot's cache rows
        ``< C`` under ``mask`` [B, T, C + T]; their K/V written as scratch at rows ``start[b] + t``.
        Returns output states [B, T, D]."""
        C = mask.shape[-1] - tokens.shape[1]
        index = self.cache.index(slots)
        index = index if isinstance(index, slice) else index.to(self.device)
        past = [self.cache.read(layer, index, C) for layer in range(self.cfg.num_layers)]  # [B, Hkv, C, hd]
        out, new_kv = self.drafter.forward_cached(state, tokens, positions, past, mask)
        for layer, (k, v) in enumerate(new_kv):
            self.cache.write(layer, slots, start, k, v)
        return out

    def _extend(self, slots: list[int], state: torch.Tensor, tokens: torch.Tensor, rows: list[int]) -> None:
        """Commit ``rows[b]`` drafter rows per request (target-confirmed states and their next
        tokens, [B, T, D] / [B, T]) after its committed ones; ``state`` becomes the last one's output."""
        if not any(rows):  # every request failed (no token): nothing is known to extend with
            return
        slot_t = torch.tensor(slots, device="cpu")
        out = self._rows(slot_t, self.cache.committed[slot_t], state, tokens.to(self.device))
        for b, (slot, n) in enumerate(zip(slots, rows)):
            if n:
                self.cache.commit(slot, n)
                self.state[slot] = out[b, n - 1]

    def _take_anchors(self, slots: list[int], anchors: list[int]) -> float:
        """Pair each pending target row (the last prompt row) with its next token, the anchor: a
        row the drafter owes. Returns the seconds spent catching up a slot that owed ``capacity``."""
        waiting = [b for b, slot in enumerate(slots) if self.has_pending[slot]]
        if not waiting:
            return 0.0
        chosen = [slots[b] for b in waiting]
        owed = self.catch_up(chosen) if self.deferred.full(chosen) else 0.0
        self.deferred.push(chosen, self.pending[chosen], torch.tensor([anchors[b] for b in waiting], device=self.device))
        self.has_pending[chosen] = False
        return owed

    def catch_up(self, slots: list[int]) -> float:
        """Run every drafter row ``slots`` owe (their prompts', then plain steps'), a batch each;
        returns its seconds."""
        start = time.perf_counter()
        for owed in self.deferred.take(slots):
            with torch.inference_mode():
                self._extend(owed.slots, self.drafter.fuse(owed.values), owed.tokens, owed.rows)
        return time.perf_counter() - start

    # -- the protocol ---------------------------------------------------------------------

    def prefill(self, slots: list[int], prompts: list[list[int]]) -> torch.Tensor:
        """Run the prompts in the target and commit them; the drafter owes rows 0 … n−2 (each
        prompt row's features with the next prompt token) until ``catch_up``, and keeps g_{n−1}
        pending. Returns the last rows' logits [B, V]."""
        logits, out = prefill_target(self.runner, slots, prompts)
        features = prompt_features(out, self.cfg.target_layer_ids, [len(p) for p in prompts])
        for slot, prompt, rows in zip(slots, prompts, features):
            self.release(slot)
            self.deferred.owe_prompt(slot, rows[:-1], torch.tensor(prompt[1:], dtype=torch.long, device=self.device))
            self.pending[slot] = rows[-1]
            self.has_pending[slot] = True
        return logits

    @torch.inference_mode()
    def propose(self, slots: list[int], params, generators, k: int):
        """Draft a chain of k tokens per request from its state; returns (drafts [B, k] target ids,
        q [k, V] per request or None when greedy: the distribution each draft was drawn from,
        over the target's vocabulary, zero outside the draft vocabulary)."""
        slot_t = torch.tensor(slots, device="cpu")
        committed = self.cache.committed[slot_t]
        state = self.state[slot_t.to(self.device)]  # [B, D]
        drafts, qs = [], [[] for _ in slots]
        for j in range(k):
            logits = self.drafter.compute_logits(state)  # [B, V_d]
            index = torch.stack([self._draw(logits[b], p, g, qs[b]) for b, (p, g) in enumerate(zip(params, generators))])
            drafts.append(self.drafter.draft_to_target(index))  # [B]
            if j + 1 < k:  # the chain row of this draft: scratch at committed + j
                state = self._rows(slot_t, committed + j, state[:, None], drafts[-1][:, None])[:, 0]
        q = [None if p.greedy else self.drafter.to_target_distribution(torch.stack(rows)) for p, rows in zip(params, qs)]
        return torch.stack(drafts, dim=1), q

    @staticmethod
    def _draw(logits: torch.Tensor, params, generator, qs: list) -> torch.Tensor:
        """One draft index from logits [V_d]: argmax when greedy, else a draw from q (appended to ``qs``)."""
        if params.greedy:
            return logits.argmax()
        q = process(logits, params)
        qs.append(q)
        return torch.multinomial(q, 1, generator=generator)[0]

    def step(self, slots: list[int], anchors: list[int], params, generators, size: int) -> StepOutput:
        """One draft → verify → accept → commit → extend round of ``size`` drafts per request
        (``size`` in ``verify_sizes``; 0: a plain step). Wall-clock time per phase accumulates
        in ``phase_seconds``."""
        owed = self._take_anchors(slots, anchors)
        if size == 0:
            return self._plain_step(slots, anchors, params, generators, owed)
        if size not in self.verify_sizes:
            raise ValueError(f"size {size} is not a verify size of this worker {self.verify_sizes} (or 0: a plain step)")
        owed += self.catch_up(slots)
        t0 = time.perf_counter()
        drafts, qs = self.propose(slots, params, generators, size)
        verify_ids = torch.cat([torch.tensor(anchors, device=drafts.device)[:, None], drafts], dim=1)  # [B, k + 1]
        B, M = verify_ids.shape
        t1 = time.perf_counter()
        out = self.runner.forward(verify_ids, torch.tensor(slots, device="cpu"), torch.full((B,), M, device="cpu"))
        t2 = time.perf_counter()
        result = accept_chains(out.logits, drafts, params, qs, generators)
        t3 = time.perf_counter()
        rows = [len(tokens) for tokens in result.tokens]  # [a, d1 … dr]: r + 1 rows (0 if it failed)
        for slot, n in zip(slots, rows):
            self.runner.cache.commit(slot, n)
        self._extend_emitted(slots, self._features(out), result.tokens)
        t4 = time.perf_counter()
        for phase, seconds in zip(self.phase_seconds, (t1 - t0, t2 - t1, t3 - t2, t4 - t3 + owed)):
            self.phase_seconds[phase] += seconds
        self.steps += 1
        return StepOutput(result.tokens, [M - 1] * B, result.accepted, True, result.errors, deferred_seconds=owed,
                          target_logits=out.logits)

    def _extend_emitted(self, slots: list[int], features: torch.Tensor, emitted: list[list[int]]) -> None:
        """Draft extend: the target rows just committed (``features`` [B, T, L·D] of verify rows
        ``[a, d1 … dr]`` first), each paired with the token that follows it — the emitted tokens
        ``[d1 … dr, x*]``."""
        tokens, _ = pad_rows([t or [0] for t in emitted])  # [B, T] (CPU)
        rows = [len(t) for t in emitted]
        with torch.inference_mode():
            state = self.drafter.fuse(features[:, : tokens.shape[1]])
        self._extend(slots, state, tokens, rows)

    def _plain_step(self, slots: list[int], anchors: list[int], params, generators, owed: float) -> StepOutput:
        """One target row per request (the AR step); the drafter owes the row of the anchor's
        features and the token sampled after it."""
        if self.deferred.full(slots):
            owed += self.catch_up(slots)
        tokens, errors, out = ar_step(self.runner, slots, anchors, params, generators)
        ok = [b for b, t in enumerate(tokens) if t]  # a failed request has no next token: nothing known
        if ok:
            self.deferred.push([slots[b] for b in ok], self._features(out)[ok, 0],
                               torch.tensor([tokens[b][0] for b in ok], device=self.device))
        return StepOutput.plain(tokens, errors, deferred_seconds=owed, target_logits=out.logits)
