"""The round-cost table: the target's measured forward time by batch size and rows per request.

A speculative round costs a drafter pass plus one target forward over ``rows = 1 + size`` rows
per request (the anchor and ``size`` drafts or tree nodes), and a plain step is the ``rows = 1``
forward. Whether a round pays depends on how that forward's time grows with its rows, which is a
property of the machine (on this CPU a verify of 8 rows costs about 2× one decode step in fp32),
so it is measured, not assumed:

    specray profile --out cost.json                      # the embedded target, this machine
    specray bench serve --drafter DIR --cost-table cost.json

``profile`` runs the engine's own ``LlamaRunner`` forward for every ``(batch, rows)`` of a grid
over ``context_tokens`` committed tokens per request and records the median of ``repeats``
timings. The table carries the machine's description (CPU, threads, torch, target and dtype):
the engine refuses a table whose description differs from its own, and ``save`` refuses to
overwrite a table from another machine without ``force``. ``seconds(batch, rows)`` interpolates
bilinearly inside the grid and extends linearly past its edges (``serving/chooser.py`` reads it);
the grid is made non-decreasing in rows and batch size first (a forward of more rows never
costs less; on a busy machine single timings can say otherwise).
"""

from __future__ import annotations

import copy
import datetime as _dt
import os
import platform
import statistics
import time
from pathlib import Path

import torch
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from specray.capture.target import Target
from specray.serving.cost_grid import DEFAULT_BATCH_SIZES, DEFAULT_CONTEXT_TOKENS, DEFAULT_ROWS  # noqa: F401
from specray.serving.kv_cache import SlotKVCache
from specray.serving.runner import LlamaRunner


class CostTableError(ValueError):
    """A cost table file that is missing, malformed, or from another machine."""


class MachineDescription(BaseModel):
    """What a forward time depends on besides its shape. Two tables are comparable iff equal."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    cpu: str = Field(description="CPU model name (/proc/cpuinfo), or platform.processor()")
    logical_cpus: int = Field(description="os.cpu_count()")
    threads: int = Field(description="torch intra-op threads the forwards ran with")
    torch: str = Field(description="torch version")
    device: str = Field(description="the target's device")
    target: str = Field(description="the target's fingerprint")
    dtype: str = Field(description="the target's weight dtype")


class CostEntry(BaseModel):
    model_config = ConfigDict(extra="forbid")
    batch: int = Field(gt=0, description="requests in the forward")
    rows: int = Field(gt=0, description="rows per request (1 = a decode step, 1 + k = a verify of k drafts)")
    seconds: float = Field(gt=0, description="median wall time of the forward")


class CostTable(BaseModel):
    """Forward seconds on a full grid of batch sizes × rows per request (see the module doc)."""

    model_config = ConfigDict(extra="forbid")
    format: int = Field(1, description="the table format version")
    machine: MachineDescription
    context_tokens: int = Field(gt=0, description="committed tokens per request while timing")
    repeats: int = Field(gt=0, description="timings per entry (the median is kept)")
    created: str = Field(description="UTC time of the measurement")
    entries: list[CostEntry] = Field(min_length=1)

    def model_post_init(self, _context) -> None:
        grid = {(e.batch, e.rows): e.seconds for e in self.entries}
        batches, rows = sorted({b for b, _ in grid}), sorted({r for _, r in grid})
        missing = [(b, r) for b in batches for r in rows if (b, r) not in grid]
        if missing:
            raise ValueError(f"the entries must cover a full batch × rows grid; missing (batch, rows) {missing[:4]}")
        for i, b in enumerate(batches):  # never cheaper with more rows or requests (timing noise can say so)
            for j, r in enumerate(rows):
                grid[b, r] = max(grid[b, r], grid[b, rows[j - 1]] if j else 0.0, grid[batches[i - 1], r] if i else 0.0)
        self._grid, self._batches, self._rows = grid, batches, rows
        self._memo: dict[tuple[int, float], float] = {}  # seconds() per (batch, rows) asked: the chooser asks each round

    @property
    def max_rows(self) -> int:
        return self._rows[-1]

    def seconds(self, batch: int, rows: int) -> float:
        """Predicted forward seconds of ``batch`` requests × ``rows`` rows (interpolated, never < 0)."""
        if (batch, rows) in self._memo:
            return self._memo[batch, rows]
        (b0, b1, wb), (r0, r1, wr) = _bracket(self._batches, batch), _bracket(self._rows, rows)
        g = self._grid
        low = g[b0, r0] + wr * (g[b0, r1] - g[b0, r0])
        high = g[b1, r0] + wr * (g[b1, r1] - g[b1, r0])
        self._memo[batch, rows] = seconds = max(low + wb * (high - low), 1e-6)
        return seconds

    @classmethod
    def load(cls, path: str | Path) -> CostTable:
        path = Path(path)
        try:
            return cls.model_validate_json(path.read_text())
        except FileNotFoundError:
            raise CostTableError(f"cost table {path} does not exist; measure one with `specray profile --out {path}`") from None
        except (ValidationError, ValueError, UnicodeDecodeError) as e:
            raise CostTableError(f"cost table {path} is malformed ({_first_error(e)}); "
                                 f"measure it again with `specray profile --out {path} --force`") from None

    def save(self, path: str | Path, *, force: bool = False) -> None:
        """Write atomically; refuse to replace a table from another machine description unless ``force``."""
        path = Path(path)
        if path.exists() and not force:
            try:
                old = CostTable.load(path).machine
            except CostTableError:
                old = None
            if old != self.machine:
                raise CostTableError(f"{path} holds a cost table from another machine description"
                                     f"{_differences(old, self.machine)}; pass --force to replace it")
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        tmp.write_text(self.model_dump_json(indent=1))
        os.replace(tmp, path)

    def check_machine(self, machine: MachineDescription, source: str) -> None:
        if machine != self.machine:
            raise CostTableError(f"cost table {source} was measured on another machine description"
                                 f"{_differences(self.machine, machine)}; measure this one with "
                                 f"`specray profile --out {source} --force`")


def _bracket(grid: list[int], x: int) -> tuple[int, int, float]:
    """(lo, hi, weight of hi) for linear interpolation on ``grid``, extrapolating past its ends."""
    if len(grid) == 1:
        return grid[0], grid[0], 0.0
    hi_index = next((i for i, g in enumerate(grid) if g >= x), len(grid) - 1)
    hi_index = min(max(hi_index, 1), len(grid) - 1)
    lo, hi = grid[hi_index - 1], grid[hi_index]
    return lo, hi, (x - lo) / (hi - lo)


def _first_error(e: Exception) -> str:
    if isinstance(e, ValidationError):
        err = e.errors()[0]
        return f"{'.'.join(str(p) for p in err['loc']) or 'file'}: {err['msg']}"
    return str(e).splitlines()[0]


def _differences(old: MachineDescription | None, new: MachineDescription) -> str:
    if old is None:
        return " (unreadable)"
    changed = [f"{k}: {getattr(old, k)!r} vs {getattr(new, k)!r}" for k in new.model_fields if getattr(old, k) != getattr(new, k)]
    return " (" + "; ".join(changed) + ")"


def describe_machine(target: Target) -> MachineDescription:
    weights = target.model.lm_head.weight
    return MachineDescription(cpu=_cpu_name(), logical_cpus=os.cpu_count() or 1, threads=torch.get_num_threads(),
                              torch=torch.__version__, device=str(weights.device), target=target.target_fingerprint,
                              dtype=str(weights.dtype).removeprefix("torch."))


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def profile(target: Target, *, batch_sizes: tuple[int, ...] = DEFAULT_BATCH_SIZES, rows: tuple[int, ...] = DEFAULT_ROWS,
            context_tokens: int = DEFAULT_CONTEXT_TOKENS, repeats: int = 5, progress=None) -> CostTable:
    """Time ``target``'s serving forward (a ``LlamaRunner``) on every ``(batch, rows)`` of the grid."""
    runner = LlamaRunner(target.model, num_slots=1, max_len=context_tokens + max(rows))  # the twin has the slots
    return profile_runner(runner, describe_machine(target), batch_sizes=batch_sizes, rows=rows,
                          context_tokens=context_tokens, repeats=repeats, progress=progress)


def profile_runner(runner: LlamaRunner, machine: MachineDescription, *, batch_sizes: tuple[int, ...],
                   rows: tuple[int, ...], context_tokens: int = DEFAULT_CONTEXT_TOKENS, repeats: int = 3,
                   progress=None) -> CostTable:
    """Time ``runner``'s forward on a twin of it (the same weights, its own KV cache: the runner's
    requests are untouched, so this may run beside serving); ``progress(done, total)`` after each entry."""
    if repeats < 1 or context_tokens < 1 or not batch_sizes or not rows or min(*batch_sizes, *rows) < 1:
        raise ValueError("profile needs repeats >= 1, context_tokens >= 1 and positive batch sizes and rows")
    batch_sizes, rows = tuple(sorted(set(batch_sizes))), tuple(sorted(set(rows)))
    context_tokens = max(1, min(context_tokens, runner.cache.max_len - rows[-1]))
    twin = copy.copy(runner)
    cache = runner.cache
    twin.cache = SlotKVCache(num_layers=cache.k.shape[0], num_slots=batch_sizes[-1], max_len=context_tokens + rows[-1],
                             num_kv_heads=cache.k.shape[2], head_dim=cache.k.shape[4], dtype=cache.k.dtype,
                             device=cache.k.device)
    slots = torch.arange(batch_sizes[-1], device="cpu")
    twin.forward(torch.zeros(len(slots), context_tokens, dtype=torch.long, device=runner.device), slots,
                 torch.full((len(slots),), context_tokens, device="cpu"))
    twin.cache.committed[slots] = context_tokens  # every slot holds the context; the forwards below are scratch
    entries = []
    for i, (b, r) in enumerate((b, r) for b in batch_sizes for r in rows):
        ids, used, new = torch.zeros(b, r, dtype=torch.long, device=runner.device), slots[:b], torch.full((b,), r, device="cpu")
        twin.forward(ids, used, new)  # warm-up of this shape
        twin.synchronize()
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            twin.forward(ids, used, new)
            twin.synchronize()  # an accelerator's forward is timed to its end, not to its launch
            times.append(time.perf_counter() - start)
        entries.append(CostEntry(batch=b, rows=r, seconds=statistics.median(times)))
        if progress is not None:
            progress(i + 1, len(batch_sizes) * len(rows))
    created = _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")
    return CostTable(machine=machine, context_tokens=context_tokens, repeats=repeats, created=created, entries=entries)


def engine_grid(max_batch: int, max_rows: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The grid an engine measures for itself: batch sizes 1, 2, 4, … up to ``max_batch`` and
    rows of ``DEFAULT_ROWS`` up to ``max_rows`` (both ends included)."""
    batches = tuple(sorted({b for b in DEFAULT_BATCH_SIZES if b < max_batch} | {max_batch}))
    rows = tuple(sorted({r for r in DEFAULT_ROWS if r < max_rows} | {max_rows}))
    return batches, rows


def table_summary(table: CostTable) -> str:
    """A printable grid: ms per forward, batch down, rows across."""
    rows = table._rows
    lines = ["batch\\rows " + " ".join(f"{r:>7}" for r in rows)]
    for b in table._batches:
        lines.append(f"{b:>10} " + " ".join(f"{1000 * table._grid[b, r]:>7.1f}" for r in rows))
    return "\n".join(lines)
