"""EAGLE-3 speculative worker (seed §3.4): draft a chain from the drafter's own state, verify it in
one target forward, accept, commit, then re-run the draft layer on the target-confirmed features
of the accepted rows ("draft extend").

Drafter rows (``drafters/eagle3.py``): row ``i`` pairs the target state ``g_i`` (the fused
features of target row ``i``) with the *next* token ``x_{i+1}`` at position ``i + 1``; its output
state predicts ``x_{i+2}``. Per request the drafter's KV cache holds the rows whose next token is
known, and ``state`` is the output of its last one. After ``prefill`` of ``n`` prompt tokens that
is rows ``0 … n−2``: row ``n−1`` waits for the first anchor, which the engine samples from the
prefill's logits, so its target state is kept as ``pending`` until the first ``step``.

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
"""

from __future__ import annotations

import time

import torch

from specray.drafters.eagle3 import Eagle3Drafter
from specray.serving.kv_cache import SlotKVCache
from specray.serving.runner import LlamaRunner, pad_rows
from specray.serving.sampling import process
from specray.serving.verify import accept_chains
from specray.serving.workers.ar import ar_step, prefill_target
from specray.serving.workers.base import StepOutput

DEFAULT_NUM_DRAFTS = 3  # k when the engine does not set num_speculative_tokens


class Eagle3Worker:
    """``num_speculative_tokens`` = the longest chain a round may draft (default ``DEFAULT_NUM_DRAFTS``);
    ``verify_sizes`` = ``1 … k``, the chain lengths the engine may pick per round.

    ``step(..., size=0)`` is a *plain* step (one target row per request, the next token sampled as
    the AR worker does), after which the drafter extends its cache by that row, so speculation
    resumes with the right state on the next round."""

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
        slots, dtype = runner.cache.num_slots, drafter.fc.weight.dtype
        self.cache = SlotKVCache(num_layers=cfg.num_layers, num_slots=slots,
                                 max_len=runner.cache.max_len + self._scratch_rows(), num_kv_heads=cfg.num_kv_heads,
                                 head_dim=cfg.head_dim, dtype=dtype)
        self.state = torch.zeros(slots, cfg.hidden_size, dtype=dtype)  # [slots, D] output of the last row
        self.pending = torch.zeros(slots, cfg.hidden_size, dtype=dtype)  # [slots, D] g of the row awaiting its token
        self.has_pending = torch.zeros(slots, dtype=torch.bool)
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
        self.has_pending[slot] = False

    # -- the drafter's rows ---------------------------------------------------------------

    def _target_state(self, hidden: dict[int, torch.Tensor]) -> torch.Tensor:
        """The runner's captured layers -> fused target states g [B, T, D]."""
        with torch.inference_mode():
            return self.drafter.fuse(torch.cat([hidden[i] for i in self.cfg.target_layer_ids], dim=-1))

    @torch.inference_mode()
    def _rows(self, slots: torch.Tensor, start: torch.Tensor, state: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        """Run drafter rows at cache indices ``start[b] + t`` (positions one more), as scratch.

        state [B, T, D], tokens [B, T] target ids; a row sees the slot's rows ``< start[b]`` and its
        own earlier rows (causal; padded rows past a request's real ones only see real rows before
        them and are never read as context). Returns output states [B, T, D]."""
        B, T = tokens.shape
        C = int(start.max())
        mask = torch.cat([(torch.arange(C)[None, :] < start[:, None])[:, None, :].expand(B, T, C),
                          torch.ones(T, T, dtype=torch.bool).tril().expand(B, T, T)], dim=-1)  # [B, T, C + T]
        return self._run_rows(slots, start, state, tokens, start[:, None] + torch.arange(T) + 1, mask)

    @torch.inference_mode()
    def _run_rows(self, slots: torch.Tensor, start: torch.Tensor, state: torch.Tensor, tokens: torch.Tensor,
                  positions: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """Drafter rows (state [B, T, D], tokens / positions [B, T]) over the slot's cache rows
        ``< C`` under ``mask`` [B, T, C + T]; their K/V written as scratch at rows ``start[b] + t``.
        Returns output states [B, T, D]."""
        C = mask.shape[-1] - tokens.shape[1]
        index = self.cache.index(slots)
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
        slot_t = torch.tensor(slots)
        out = self._rows(slot_t, self.cache.committed[slot_t], state, tokens)
        for b, (slot, n) in enumerate(zip(slots, rows)):
            if n:
                self.cache.commit(slot, n)
                self.state[slot] = out[b, n - 1]

    def _take_anchors(self, slots: list[int], anchors: list[int]) -> None:
        """Pair each pending target state (the last prompt row) with its next token, the anchor."""
        waiting = [b for b, slot in enumerate(slots) if self.has_pending[slot]]
        if waiting:
            chosen = [slots[b] for b in waiting]
            self._extend(chosen, self.pending[chosen][:, None], torch.tensor([[anchors[b]] for b in waiting]),
                         [1] * len(chosen))
            self.has_pending[chosen] = False

    # -- the protocol ---------------------------------------------------------------------

    def prefill(self, slots: list[int], prompts: list[list[int]]) -> torch.Tensor:
        """Run the prompts in the target, commit them; the drafter commits rows 0 … n−2 and keeps
        g_{n−1} pending. Returns the last rows' logits [B, V]."""
        logits, out = prefill_target(self.runner, slots, prompts)
        ids, lengths = pad_rows(prompts)
        g = self._target_state(out.hidden)  # [B, T, D]
        for slot in slots:
            self.release(slot)
        self._extend(slots, g[:, :-1], ids[:, 1:], (lengths - 1).tolist())
        slot_t = torch.tensor(slots)
        self.pending[slot_t] = g[torch.arange(len(slots)), lengths - 1]
        self.has_pending[slot_t] = True
        return logits

    @torch.inference_mode()
    def propose(self, slots: list[int], params, generators, k: int):
        """Draft a chain of k tokens per request from its state; returns (drafts [B, k] target ids,
        q [k, V] per request or None when greedy: the distribution each draft was drawn from,
        over the target's vocabulary, zero outside the draft vocabulary)."""
        slot_t = torch.tensor(slots)
        committed = self.cache.committed[slot_t]
        state = self.state[slot_t]  # [B, D]
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
        self._take_anchors(slots, anchors)
        if size == 0:
            return self._plain_step(slots, anchors, params, generators)
        if size not in self.verify_sizes:
            raise ValueError(f"size {size} is not a verify size of this worker {self.verify_sizes} (or 0: a plain step)")
        t0 = time.perf_counter()
        drafts, qs = self.propose(slots, params, generators, size)
        verify_ids = torch.cat([torch.tensor(anchors)[:, None], drafts], dim=1)  # [B, k + 1]
        B, M = verify_ids.shape
        t1 = time.perf_counter()
        out = self.runner.forward(verify_ids, torch.tensor(slots), torch.full((B,), M))
        t2 = time.perf_counter()
        result = accept_chains(out.logits, drafts, params, qs, generators)
        t3 = time.perf_counter()
        rows = [len(tokens) for tokens in result.tokens]  # [a, d1 … dr]: r + 1 rows (0 if it failed)
        for slot, n in zip(slots, rows):
            self.runner.cache.commit(slot, n)
        self._extend_emitted(slots, out.hidden, result.tokens)
        t4 = time.perf_counter()
        for phase, seconds in zip(self.phase_seconds, (t1 - t0, t2 - t1, t3 - t2, t4 - t3)):
            self.phase_seconds[phase] += seconds
        self.steps += 1
        return StepOutput(result.tokens, [M - 1] * B, result.accepted, True, result.errors)

    def _extend_emitted(self, slots: list[int], hidden: dict[int, torch.Tensor], emitted: list[list[int]]) -> None:
        """Draft extend: the target rows just committed, each paired with the token that follows
        it — the emitted tokens ``[d1 … dr, x*]`` follow verify rows ``[a, d1 … dr]``."""
        tokens, _ = pad_rows([t or [0] for t in emitted])
        rows = [len(t) for t in emitted]
        self._extend(slots, self._target_state(hidden)[:, : tokens.shape[1]], tokens, rows)

    def _plain_step(self, slots: list[int], anchors: list[int], params, generators) -> StepOutput:
        """One target row per request (the AR step), then the drafter row of that anchor's state."""
        tokens, errors, out = ar_step(self.runner, slots, anchors, params, generators)
        self._extend_emitted(slots, out.hidden, tokens)
        return StepOutput.plain(tokens, errors)
