"""The round-size chooser: how much to verify this round, from measured cost and acceptance (seed §1.3, §9.3).

The unit to optimise is emitted tokens per second of batch time. For a group of ``B`` requests
on one drafter version and each size ``s`` the worker can run (``worker.verify_sizes``; 0 is a
plain step), the chooser predicts

    tokens/s(s) = B · (1 + E[accepted | s]) / (speed · (forward(B, 1 + s) + overhead(B, s)))

and runs the best ``s`` — a round only when it beats the plain step by ``MARGIN`` plus the
two estimates' noise (the standard error of each one's median, relative to it, combined).
Choosing the best of several noisy estimates favours the one that was measured luckiest, and
on a shared machine the speed moves by several percent within minutes: a size that runs only
now and then (an exploration) is measured at moments of different speed, and the spread of its
window says how far its median can be from what it costs now. With ``MARGIN`` alone a drafter
that lost 5–10 % a round speculated for stretches whenever the two estimates drew apart
(docs/benchmarks.md, Round cost):

- ``forward(B, rows)``: the cost table (``serving/cost_table.py``): the target's measured forward;
- ``overhead(B, s)``: everything else a round costs (drafting, acceptance, commits, the
  drafter's context), learned online from each round's measured wall time minus the table's
  forward: the median per batch size and round size of its last ``OVERHEAD_WINDOW`` rounds (a
  median, so a batch size's first slow forwards do not linger; when its last ``SHIFT_RUN`` rounds
  were each run after other decisions (explorations, not a stretch of that size) and all differ
  from what the rounds before them predict by more than ``SHIFT_FACTOR``× the same way — the
  machine's load changed while that size was not running — the older rounds are dropped, so an
  estimate made during a burst of load is replaced after two explorations, not after a window's
  worth; a blip inside a stretch of rounds only joins the median), shrunk toward the pooled mean of
  the same batch size's other round sizes (plain steps
  pool apart: they draft nothing), which is also what a size not yet run gets (with no round at
  that batch size: the nearest batch size's, scaled by the batch ratio; with none at all: 0).
  Pooling keeps one noisy round from deciding the next hundred;
- the machine's speed: both terms are kept in seconds at a reference speed, and a prediction is
  multiplied by the current ``speed`` factor; a round's measurement, divided by it, joins its
  size's window. Load elsewhere on a shared machine slows every size alike: without the factor
  the size that runs follows it and the one explored now and then keeps the speed of its last
  exploration, so a slow minute made rounds measured in a fast one look better by the slowdown
  (stretches of losing rounds, docs/benchmarks.md, Round cost). The plain step is the probe, per
  batch size (decisions compare sizes at one batch size): the factor is the median of its last
  ``SPEED_WINDOW`` plain steps' measured seconds over the table's forward for one row (1 before
  that many; anchored to the table, so noise cannot walk it away) — the target's forward and
  nothing of the drafter, whose own cost may change on its own (a speculative size's change
  joins its window, as before). A stretch of rounds therefore absorbs a change of load into its
  size's estimate, which the plain steps after it count again: the round then looks slower than
  it is until its explorations replace those rounds — the cautious side. The factor cancels
  between sizes in a decision: it only decides which measurements are comparable;
- ``E[accepted | s]``: from the version's rounds (``ChainAcceptance``: per-position conditional
  acceptance, each position shrunk toward the one before it while it has few rounds, so an
  untried longer chain is predicted from the positions before it; ``BudgetAcceptance`` for
  trees: the mean accepted length per node budget, falling back to a chain model over depths).

A plain step updates no acceptance, so when speculation stops paying the chooser still runs the
best speculative size now and then to keep its estimates current (a drafter whose acceptance
improves, a load that drops); and while it speculates it runs a plain step now and then, so a
plain-step estimate made from a few slow rounds (a batch size's first forwards build its
kernels) cannot keep it speculating at a loss. Explorations of a kind's stretch come
``explore_every`` decisions of that kind apart (its count carries over from its last stretch,
so the first may come sooner). An exploration pays for what it learns: with a weak
drafter a speculative round costs 1.4–1.8 plain steps on the embedded target (the owed drafter
rows included) and emits one token, so exploring every 32 decisions costs 1–2.5 % of
throughput for as long as the drafter loses. Each exploration that *confirms* the choice it
interrupted — its measured tokens/s below what that choice predicts — doubles the gap to the
next one, up to ``MAX_EXPLORE_GAP``× ``explore_every`` (under 0.2 % then); one that measures a
win, or any change of the choice itself, brings the gap back to ``explore_every``. A round
explored from a stretch of plain steps first runs the drafter work they owe (the group's
prompts and plain rows, ``serving/workers/deferred.py``): about 0.1 s for 16 requests on the
embedded target, 2–3 % of a batch of 48 tokens. The next exploration at that batch size also
waits until the plain steps since the last round took ``1 / EXPLORE_BUDGET`` times the owed work
the last one caught up (at another batch size: scaled by the batch ratio), so catching up costs
at most ``EXPLORE_BUDGET`` of the time.
``max_speculative_batch`` stays an upper bound: a larger group takes plain steps. A chain or
tree verify is padded (every request of the group runs ``1 + s`` rows), so one size per group
is the choice per request as well.

A *ragged* worker (``verify_layout = "ragged"``, DSpark, seed §5.5–§5.6) verifies a different number
of drafts per request: its size is the group's **draft budget** ``K`` (``0 … B·k``, ``k =
sizes[-1]`` the most drafts one request verifies), which the worker hands to the drafts of highest
predicted survival in the current round (``kernels/verify_schedule.py``). The chooser picks ``K``
from history only, as seed §5.6.3 does: each request's predicted survival ``[A_1 … A_k]`` is the one
the worker published from its latest round (``survival``: the cumulative product of its calibrated
confidences; all ones for a request that has not drafted yet), or, when the worker publishes none
for this group, the measured chain survival ``∏_{i<=j} alpha_i`` for every request; and

    tokens(K) = B + (the K largest of those B·k survivals),  seconds(K) = forward(B, 1 + K/B) + overhead(B, K)

over budgets in steps of half a request's draft (``candidates``); ``static`` gives ``B·k``
(every request verifies ``k``). A budget from the current round's drafts would make whether a
draft is verified depend on drafts after it and break the sampling guarantee
(``serving/workers/dspark.py``).

Each decision's prediction is kept next to what the round measured (``summary``): the model is
useful only if its predictions hold.
"""

from __future__ import annotations

import statistics
from collections import deque
from dataclasses import dataclass, field, replace
from typing import Callable

import torch

from specray.serving.cost_table import CostTable

DECAY = 0.995  # per request-round recorded: acceptance estimates follow about the last 200 of them
OVERHEAD_WINDOW = 20  # rounds a (batch, size) overhead is the median of
SHIFT_RUN = 2  # separate rounds of a size that must agree on a changed cost before its older ones are dropped
SHIFT_FACTOR = 1.5  # ... each measured this much above or below what the older rounds predict
POOL_WEIGHT = 4.0  # pseudo-rounds pulling a (batch, size) overhead toward its batch size's pooled mean
MARGIN = 0.02  # a speculative size must predict this much more than a plain step (plus the estimates' noise)
MIN_NOISE_ROUNDS = 5  # rounds in a window before its spread is read as the noise of its median
SPEED_WINDOW = 8  # a batch size's last plain steps whose median measures the machine's speed
MAX_EXPLORE_GAP = 16  # explorations that confirm the choice space out to this many times explore_every
EXPLORE_BUDGET = 0.01  # the owed drafter work an exploration catches up, at most this share of the plain steps' time
PRIOR_ACCEPT = 0.5  # position 1's conditional acceptance before any round (optimistic enough to try)
SHRINK = 4.0  # pseudo-rounds pulling a position's estimate toward the position before it
LAYOUTS = ("chain", "tree", "ragged")


class ChainAcceptance:
    """Conditional acceptance per draft position: ``alpha[i] = P(draft i accepted | i − 1 were)``."""

    def __init__(self, max_positions: int):
        self.tried = [0.0] * max_positions  # rounds (decayed) that verified position i with i − 1 accepted
        self.passed = [0.0] * max_positions  # of those, rounds that accepted position i

    def record(self, num_drafts: int, accepted: int) -> None:
        self.tried = [t * DECAY for t in self.tried]
        self.passed = [p * DECAY for p in self.passed]
        for i in range(min(num_drafts, accepted + 1, len(self.tried))):
            self.tried[i] += 1
            self.passed[i] += i < accepted

    def alphas(self) -> list[float]:
        out, prior = [], PRIOR_ACCEPT
        for tried, passed in zip(self.tried, self.passed):
            prior = (passed + SHRINK * prior) / (tried + SHRINK)
            out.append(prior)
        return out

    def expected(self, size: int) -> float:
        """Expected accepted drafts of a chain of ``size``: sum over i <= size of P(first i accepted)."""
        return self.cumulative()[min(size, len(self.tried))]

    def cumulative(self) -> list[float]:
        """``expected(size)`` for every size ``0 … max_positions``."""
        totals, survive = [0.0], 1.0
        for alpha in self.alphas():
            survive *= alpha
            totals.append(totals[-1] + survive)
        return totals


class BudgetAcceptance:
    """Mean accepted path length per node budget (a tree), from the rounds run at that budget;
    a budget with fewer than ``min_rounds`` rounds falls back to a chain model over depths."""

    min_rounds = 4

    def __init__(self, max_depth: int):
        self.depths = ChainAcceptance(max_depth)
        self.rounds: dict[int, list[float]] = {}  # size -> [decayed rounds, decayed accepted]

    def record(self, size: int, num_drafts: int, accepted: int) -> None:
        self.depths.record(num_drafts, accepted)
        for stats in self.rounds.values():
            stats[0] *= DECAY
            stats[1] *= DECAY
        stats = self.rounds.setdefault(size, [0.0, 0.0])
        stats[0] += 1
        stats[1] += accepted

    def expected(self, size: int, depth: int) -> float:
        rounds, accepted = self.rounds.get(size, (0.0, 0.0))
        if rounds >= self.min_rounds:
            return accepted / rounds
        return self.depths.expected(min(size, depth))


@dataclass
class _Outcome:
    """Predictions and measurements of the rounds run at one (batch, size)."""

    rounds: int = 0
    predicted_tokens: float = 0.0
    predicted_seconds: float = 0.0
    tokens: int = 0
    seconds: float = 0.0


@dataclass
class RoundChooser:
    """Picks each round's size for one drafter version (see the module doc).

    ``sizes``: the worker's ``verify_sizes``; ``layout``: its ``verify_layout`` ("chain", "tree"
    or "ragged": sizes are then draft budgets of the group, module doc); ``depth``: the most
    drafts one path can accept (a chain: ``sizes[-1]``); ``static``: every round of a group
    within ``max_speculative_batch`` runs the largest size (a fixed setting, what the chooser is
    compared with); ``survival``: a ragged worker's ``published_survival``. ``table`` may be None
    only when ``static`` (nothing is chosen): rounds are then counted and timed, not predicted."""

    table: CostTable | None
    sizes: tuple[int, ...]
    layout: str = "chain"
    depth: int | None = None
    max_speculative_batch: int | None = None
    static: bool = False  # always the largest size (a fixed setting, for comparison)
    explore_every: int = 32
    survival: Callable[[], torch.Tensor] | None = None  # a ragged worker's published survival [R, k] (module doc)
    overhead: dict[tuple[int, int], tuple[int, float]] = field(default_factory=dict)  # (rounds, median seconds at speed 1)
    outcomes: dict[tuple[int, int], _Outcome] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.layout not in LAYOUTS:
            raise ValueError(f"verify_layout must be one of {LAYOUTS}, got {self.layout!r}")
        if self.table is None and not self.static:
            raise ValueError("the chooser needs a cost table unless static (every round the largest size)")
        self.depth = self.depth or (self.sizes[-1] if self.sizes else 0)
        self.chain = ChainAcceptance(self.depth)
        self.budgets = BudgetAcceptance(self.depth) if self.layout == "tree" else None
        # per (batch, size): its last OVERHEAD_WINDOW (round number at that batch size, residual seconds)
        self._residuals: dict[tuple[int, int], deque] = {}
        self._recorded: dict[int, int] = {}  # rounds recorded per batch size, every round size
        self.speeds: dict[int, float] = {}  # per batch size, the machine's speed factor (module doc); 1 until measured
        self._plain: dict[int, deque] = {}  # per batch size, its last SPEED_WINDOW plain steps' measured seconds
        self._since = {False: 0, True: 0}  # decisions per kind (plain, speculative) since its last exploration
        self._gap = {False: self.explore_every, True: self.explore_every}  # decisions of a kind between explorations
        self._kind: bool | None = None  # the kind of the last choice that was not an exploration
        self._plain_seconds = 0.0  # measured seconds of the plain steps since the last round of size >= 1
        self._owed_seconds: dict[int, float] = {}  # per batch size, the owed work its last exploration caught up
        self._exploring: tuple[int, int, float] | None = None  # (batch, size, tokens/s of the choice it interrupts)
        self._predicted: tuple[int, dict[int, tuple[float, float]]] | None = None  # the last decision's (batch, predictions)
        # per batch size, the speculative sizes' predictions: only a speculative round's record changes them
        # (acceptance, their overheads), so a stretch of plain steps predicts only the plain step
        self._speculative: dict[int, dict[int, tuple[float, float]]] = {}

    def expected_accepted(self, size: int) -> float:
        if size == 0:
            return 0.0
        return self.chain.expected(size) if self.budgets is None else self.budgets.expected(size, self.depth)

    def predict(self, batch: int, size: int) -> tuple[float, float]:
        """(tokens, seconds) a round of ``size`` over ``batch`` requests is predicted to give now."""
        tokens, seconds = self._predictions(batch, (size,))[size]
        return tokens, self.speeds.get(batch, 1.0) * seconds

    def _predictions(self, batch: int, sizes: tuple[int, ...]) -> dict[int, tuple[float, float]]:
        """(tokens, seconds at speed 1) for each of ``sizes``, sharing the work they have in common
        (every decision runs this for every size; the speed factor cancels between sizes)."""
        overheads = self._overheads(batch, sizes)
        if self.layout == "ragged":
            curve = self._budget_curve(batch)
            accepted = {s: curve[min(s, len(curve) - 1)] for s in sizes}
        elif self.budgets is None:
            cumulative = self.chain.cumulative()  # [0 … depth]
            accepted = {s: batch * cumulative[min(s, self.depth)] for s in sizes}
        else:
            accepted = {s: batch * self.expected_accepted(s) for s in sizes}
        return {s: (batch + accepted[s], self.table.seconds(batch, self.rows(batch, s)) + overheads[s]) for s in sizes}

    def rows(self, batch: int, size: int) -> float:
        """Target rows per request of a round of ``size`` (the cost table's axis): ``1 + size``,
        or for a ragged worker's budget the mean ``1 + size / batch``."""
        return 1 + (size / batch if self.layout == "ragged" else size)

    def budget_accepted(self, batch: int, budget: int) -> float:
        """Expected accepted drafts of a ragged round: the ``budget`` largest predicted survivals of
        the group — the worker's published ones when it has them for ``batch`` requests, else
        ``batch`` copies of the measured ``[A_1 … A_k]`` (non-increasing, so position by position)."""
        curve = self._budget_curve(batch)
        return curve[min(budget, len(curve) - 1)]

    def _budget_curve(self, batch: int) -> list[float]:
        """``budget_accepted(batch, K)`` for every ``K`` in ``0 … batch·k`` (the running sum of
        the survivals, largest first)."""
        published = self.survival() if self.survival is not None else None
        if published is not None and len(published) == batch:
            survivals = published.reshape(-1).sort(descending=True).values.tolist()
        else:
            survivals, survive = [], 1.0
            for alpha in self.chain.alphas()[: self.sizes[-1]]:
                survive *= alpha
                survivals += [survive] * batch
        curve = [0.0]
        for x in survivals:
            curve.append(curve[-1] + x)
        return curve

    def candidates(self, batch: int) -> tuple[int, ...]:
        """The speculative sizes for a group of ``batch``: the worker's sizes, or for a ragged worker
        budgets ``1 … batch·k`` in steps of half a request's draft."""
        if self.layout != "ragged":
            return self.sizes
        return tuple(sorted({max(1, batch * h // 2) for h in range(1, 2 * self.sizes[-1] + 1)}))

    def choose(self, batch: int) -> int:
        """The size to run for a group of ``batch`` requests (0 = a plain step)."""
        if not self.sizes or (self.max_speculative_batch is not None and batch > self.max_speculative_batch):
            return 0
        sizes = self.candidates(batch)
        if self.static:
            return sizes[-1]
        speculative = self._speculative.get(batch)
        if speculative is None:
            speculative = self._predictions(batch, sizes)
            if self.survival is None:  # a published survival can change without a round recorded here
                self._speculative[batch] = speculative
        predicted = {**self._predictions(batch, (0,)), **speculative}  # at speed 1
        self._predicted = (batch, predicted)  # what ``record`` compares the round with
        rates = {s: tokens / seconds for s, (tokens, seconds) in predicted.items()}
        best = max(rates, key=lambda s: (rates[s], -s))  # ties: the smaller round
        if best and rates[best] < rates[0] * (1 + MARGIN + self._noise(batch, (0, best), predicted)):
            best = 0
        kind = best > 0  # now and then explore the other kind (module doc)
        if kind != self._kind:
            self._kind, self._gap = kind, {False: self.explore_every, True: self.explore_every}
        self._since[kind] += 1
        self._exploring = None
        if self._since[kind] >= self._gap[kind] and self._plain_seconds * EXPLORE_BUDGET >= self._owed(batch, best):
            self._since[kind] = 0
            explored = max(sizes, key=lambda s: (rates[s], -s)) if best == 0 else 0
            self._exploring, best = (batch, explored, rates[best]), explored
        return best

    def record(self, batch: int, size: int, seconds: float, num_drafts: list[int], accepted: list[int],
               tokens: int, *, deferred_seconds: float = 0.0) -> None:
        """One round's measurement: its wall ``seconds``, per request drafts verified and accepted
        (requests that failed excluded), and the tokens it emitted. ``deferred_seconds`` of the
        round did drafter work earlier plain steps owed: counted in the round's measured time,
        not in the overhead learned for its size."""
        outcome = self.outcomes.setdefault((batch, size), _Outcome())
        outcome.rounds += 1
        outcome.tokens += tokens
        outcome.seconds += seconds
        speed, measured = self.speeds.get(batch, 1.0), max(seconds - deferred_seconds, 0.0)
        if self.table is not None:
            chosen = self._predicted[1] if self._predicted is not None and self._predicted[0] == batch else {}
            tokens_predicted, seconds_predicted = chosen[size] if size in chosen else self._predictions(batch, (size,))[size]
            outcome.predicted_tokens += tokens_predicted
            outcome.predicted_seconds += speed * seconds_predicted
            forward = self.table.seconds(batch, self.rows(batch, size))
            window = self._residuals.setdefault((batch, size), deque(maxlen=OVERHEAD_WINDOW))
            if size == 0:
                self._track_speed(batch, measured, forward)
            window.append((self._recorded.get(batch, 0), measured / self.speeds.get(batch, 1.0) - forward))
            _drop_before_a_shift(window, forward)
            self.overhead[batch, size] = (len(window), statistics.median(r for _, r in window))
        self._recorded[batch] = self._recorded.get(batch, 0) + 1
        self._plain_seconds = self._plain_seconds + seconds if size == 0 else 0.0
        if self._exploring is not None and self._exploring[:2] == (batch, size):
            if size:  # a round explored from plain steps: the owed work it caught up (``_owed``)
                self._owed_seconds[batch] = deferred_seconds
            interrupted, rate = size == 0, self._exploring[2]  # rate: at speed 1
            confirmed = tokens < rate * measured / speed  # it measured a loss
            self._gap[interrupted] = (min(2 * self._gap[interrupted], MAX_EXPLORE_GAP * self.explore_every)
                                      if confirmed else self.explore_every)
        self._exploring = self._predicted = None
        if size:
            self._speculative.clear()
            for n, r in zip(num_drafts, accepted):
                if self.budgets is None:
                    self.chain.record(n, r)
                else:
                    self.budgets.record(size, n, r)

    def _owed(self, batch: int, best: int) -> float:
        """The owed drafter work the next exploration from plain steps (``best`` 0) is expected to
        catch up at ``batch``: its last one's, or the nearest batch size's scaled by the batch
        ratio; 0 when exploring a plain step or before any exploration."""
        if best or not self._owed_seconds:
            return 0.0
        if batch in self._owed_seconds:
            return self._owed_seconds[batch]
        nearest = min(self._owed_seconds, key=lambda b: abs(b - batch))
        return self._owed_seconds[nearest] * batch / nearest

    def _track_speed(self, batch: int, measured: float, forward: float) -> None:
        """A plain step at ``batch`` took ``measured`` seconds, ``forward`` in the table: the batch
        size's speed factor is the median of its last ``SPEED_WINDOW`` (once it has that many)
        over the table's — a lone slow step moves it by nothing, a change of load moves it within
        a few steps, before a size's window median would follow."""
        recent = self._plain.setdefault(batch, deque(maxlen=SPEED_WINDOW))
        recent.append(measured)
        if len(recent) == SPEED_WINDOW and forward > 0:
            self.speeds[batch] = statistics.median(recent) / forward

    def noise(self, batch: int, size: int) -> float:
        """The standard error of (batch, size)'s median overhead in seconds at speed 1, from the spread of its
        window (1.4826 MAD ~ sigma; a median's standard error ~ 1.2533 sigma / sqrt(n)); 0 with
        fewer than ``MIN_NOISE_ROUNDS`` rounds there: nothing to read it from. Computed only when
        a speculative size is the best (not on every plain step)."""
        window = [r for _, r in self._residuals.get((batch, size), ())]  # a copy: the engine thread may add rounds
        if len(window) < MIN_NOISE_ROUNDS:
            return 0.0
        median = statistics.median(window)
        return 1.2533 * 1.4826 * statistics.median(abs(r - median) for r in window) / len(window) ** 0.5

    def _noise(self, batch: int, sizes: tuple[int, ...], predicted: dict[int, tuple[float, float]]) -> float:
        """The combined relative standard error of ``sizes``' predicted seconds at ``batch``."""
        return sum((self.noise(batch, s) / predicted[s][1]) ** 2 for s in sizes) ** 0.5

    def _overheads(self, batch: int, sizes: tuple[int, ...]) -> dict[int, float]:
        """The overhead of (batch, s) for each of ``sizes``: its running median shrunk toward the
        pooled mean (module doc)."""
        cells = dict(self.overhead)  # a copy: the engine thread may add rounds
        pooled: dict[bool, float | None] = {}
        out = {}
        for size in sizes:
            kind = size > 0
            if kind not in pooled:
                same = [c for (b, s), c in cells.items() if b == batch and (s > 0) == kind]
                pooled[kind] = sum(n * mean for n, mean in same) / sum(n for n, _ in same) if same else None
            pool = pooled[kind]
            if pool is None:  # this batch size has no round of the kind: the nearest one's, scaled
                others = {(b, s): c for (b, s), c in cells.items() if (s > 0) == kind}
                if not others:
                    out[size] = 0.0
                    continue
                (b, _), (_, mean) = min(others.items(), key=lambda kv: (abs(kv[0][0] - batch), abs(kv[0][1] - size)))
                pool = mean * batch / b
            n, mean = cells.get((batch, size), (0, 0.0))
            out[size] = (n * mean + POOL_WEIGHT * pool) / (n + POOL_WEIGHT)
        return out

    def snapshot(self) -> dict[tuple[int, int], _Outcome]:
        """The outcomes so far (for ``report(since=...)``: what a later stretch of rounds did)."""
        return {key: replace(o) for key, o in dict(self.outcomes).items()}

    def report(self, since: dict[tuple[int, int], _Outcome] | None = None, batch: int | None = None) -> dict | None:
        """Rounds by size and predicted against measured tokens/s of the rounds since ``since``
        (over every group size, or only groups of ``batch``); None when no round ran."""
        since = since or {}
        rounds: dict[str, int] = {}
        predicted_tokens = predicted_seconds = tokens = seconds = 0.0
        for (b, size), o in sorted(dict(self.outcomes).items()):  # a copy: the engine thread may add rounds
            before = since.get((b, size), _Outcome())
            if (batch is not None and b != batch) or o.rounds == before.rounds:
                continue
            rounds[str(size)] = rounds.get(str(size), 0) + o.rounds - before.rounds
            predicted_tokens += o.predicted_tokens - before.predicted_tokens
            predicted_seconds += o.predicted_seconds - before.predicted_seconds
            tokens += o.tokens - before.tokens
            seconds += o.seconds - before.seconds
        if not rounds:
            return None
        measured = tokens / seconds
        predicted = predicted_tokens / predicted_seconds if self.table is not None else None
        return {"rounds_by_size": rounds, "predicted_tokens_per_s": predicted, "measured_tokens_per_s": measured,
                "prediction_error": predicted / measured - 1 if predicted is not None else None}

    def summary(self) -> dict:
        """``report`` per group size (the engine's ``stats()["chooser"]``)."""
        return {str(b): self.report(batch=b) for b in sorted({b for b, _ in dict(self.outcomes)})}


def _drop_before_a_shift(window: deque, forward: float) -> None:
    """Keep only the last ``SHIFT_RUN`` entries of ``window`` ((round number at its batch size,
    residual), oldest first) when each of those rounds ran apart from the one before it (rounds of
    other sizes at that batch size between them) and took more than ``SHIFT_FACTOR``× (or less than 1/``SHIFT_FACTOR``×) what the older
    ones predict (``forward`` + their median residual): the cost of this (batch, size) moved while
    other sizes ran, e.g. a burst of load began or ended."""
    if len(window) <= SHIFT_RUN or window[-1][0] - window[-2][0] < 2:
        return  # too few rounds, or a stretch of this size (checked in full below): its median follows on its own
    entries = list(window)
    recent = entries[-SHIFT_RUN:]
    if any(later - earlier < 2 for (earlier, _), (later, _) in zip(entries[-SHIFT_RUN - 1:], recent)):
        return  # a stretch of this size: its median follows on its own
    predicted = forward + statistics.median(r for _, r in entries[:-SHIFT_RUN])
    seconds = [forward + r for _, r in recent]
    if predicted > 0 and (min(seconds) > SHIFT_FACTOR * predicted or max(seconds) * SHIFT_FACTOR < predicted):
        for _ in range(len(entries) - SHIFT_RUN):
            window.popleft()
