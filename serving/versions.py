"""Drafter versions of one engine (DESIGN.md §7, hot-load): build, load in the background,
activate between steps, drop when idle, and the round statistics of each.

``load(dir, version)`` validates and builds a drafter and its worker in a background thread;
the engine's next step activates it (``activate_staged``). A request keeps the version that was
active when it was submitted: the engine groups running requests by version and runs each
group's round on its worker, over the one target runner and KV cache; a version without
requests that is no longer active is dropped. The runner captures the union of the target
layers the live drafters read. A load that fails (``InvalidDrafterError``: another target, a
checksum mismatch, weights that do not fit) is recorded in ``rejected`` and the active version
keeps serving.

Each speculative version has its own ``RoundChooser`` (``serving/chooser.py``), which sizes its
rounds from the engine's cost table (read from a file, or measured on a twin of the runner the
first time a speculative version is built) and the version's own acceptance.
"""

from __future__ import annotations

import logging
import threading
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from torch import nn

from specray.capture.target import Target
from specray.drafters.format import InvalidDrafterError, load_drafter, read_drafter_config
from specray.serving.chooser import RoundChooser
from specray.serving.cost_table import CostTable, describe_machine, engine_grid, profile_runner
from specray.serving.runner import LlamaRunner
from specray.serving.workers import TREE_WORKERS, WORKERS, ARWorker, Worker

SPECULATION_MODES = ("auto", "static")
_MEASURED: dict[tuple, CostTable] = {}  # tables engines of this process measured, by (machine, grid)

log = logging.getLogger(__name__)


@dataclass
class RoundStats:
    """Rounds of one drafter version (DESIGN.md §2: tau = E[r + 1]), counted up to each request's stop.

    ``accepted[j]``: rounds whose draft at position j + 1 was accepted (a tree: depth j + 1 reached)."""

    rounds: int = 0
    emitted: int = 0  # sum over rounds of r + 1
    plain_steps: int = 0  # request-steps that did not speculate (rounds the chooser sized 0)
    accepted: list[int] = field(default_factory=list)  # [max drafts verified]

    def add(self, num_drafts: int, accepted: int) -> None:
        self.rounds += 1
        self.emitted += accepted + 1
        self.accepted += [0] * (num_drafts - len(self.accepted))
        for j in range(accepted):
            self.accepted[j] += 1

    def summary(self) -> dict:
        rounds = max(1, self.rounds)
        return {"rounds": self.rounds, "tau": self.emitted / rounds if self.rounds else None,
                "acceptance_by_position": [a / rounds for a in self.accepted] if self.rounds else [],
                "plain_steps": self.plain_steps}


class _DrafterRunner:
    """The shared target runner as one drafter's worker sees it: the same forward and KV cache,
    but that drafter's own ``capture_layer_ids`` (the runner captures the union over live drafters)."""

    def __init__(self, runner: LlamaRunner, layer_ids: tuple[int, ...]):
        self._runner = runner
        self.capture_layer_ids = layer_ids

    def __getattr__(self, name: str):
        return getattr(self._runner, name)


@dataclass(eq=False)
class DrafterVersion:
    """A drafter version (None = plain autoregressive) and the worker that runs its requests."""

    version: int | None
    worker: Worker
    drafter: nn.Module | None = None
    layer_ids: tuple[int, ...] = ()  # target layers the drafter reads
    live: int = 0  # submitted requests bound to it that have not finished
    stats: RoundStats = field(default_factory=RoundStats)
    chooser: RoundChooser | None = None  # None: plain autoregressive

    @property
    def algorithm(self) -> str:
        return "ar" if self.drafter is None else self.drafter.algorithm


class DrafterVersions:
    """The versions an engine serves. Every method runs under the engine's ``lock``; ``notify``
    wakes the engine's loop when a version is staged."""

    def __init__(self, target: Target, runner: LlamaRunner, lock: threading.RLock, notify: Callable[[], None], *,
                 num_speculative_tokens: int | None = None, max_speculative_batch: int | None = None,
                 speculation: str = "auto", tree: bool = False, cost_table: CostTable | None = None):
        """``speculation``: "auto" (the chooser sizes every round) or "static" (every round of a
        group of at most ``max_speculative_batch`` requests verifies the largest size);
        ``tree``: build the algorithm's tree worker (``TREE_WORKERS``) instead of its chain;
        ``cost_table``: the forward costs (None: measured when the first speculative version is built)."""
        if speculation not in SPECULATION_MODES:
            raise ValueError(f"speculation must be one of {SPECULATION_MODES}, got {speculation!r}")
        self.target, self.runner = target, runner
        self._lock, self._notify = lock, notify
        self._num_speculative_tokens, self._max_speculative_batch = num_speculative_tokens, max_speculative_batch
        self._speculation, self._tree = speculation, tree
        self.cost_table = cost_table
        self._table_lock = threading.Lock()
        self.staged: list[DrafterVersion] = []
        self.rejected: dict[int, str] = {}
        self.history: dict[int | None, RoundStats] = {}  # round stats of every version that was active
        self.live: list[DrafterVersion] = []
        self.active: DrafterVersion | None = None

    def build_ar(self) -> DrafterVersion:
        return DrafterVersion(None, ARWorker(self.runner))

    def build(self, drafter_dir: str, version: int) -> DrafterVersion:
        """Load and validate the export in ``drafter_dir`` and build its worker (``InvalidDrafterError``)."""
        config = read_drafter_config(drafter_dir)
        drafter = load_drafter(
            drafter_dir, embed_tokens=self.target.model.model.embed_tokens, lm_head=self.target.model.lm_head,
            target_fingerprint=self.target.target_fingerprint, template_fingerprint=self.target.template_fingerprint,
        ).to(self.runner.device)  # the target's device: the drafter reads its features and shares its embedding
        layer_ids = tuple(config["architecture"]["target_layer_ids"])
        if any(not 0 <= i < self.target.num_layers for i in layer_ids):
            raise InvalidDrafterError(f"{drafter_dir}: target_layer_ids {layer_ids} outside the target's "
                                      f"0..{self.target.num_layers - 1}")
        workers = TREE_WORKERS if self._tree else WORKERS
        if drafter.algorithm not in workers:
            kind = "draft-tree worker" if self._tree else "serving worker"
            raise InvalidDrafterError(f"{drafter_dir}: no {kind} for algorithm {drafter.algorithm!r}; "
                                      f"registered: {sorted(workers)}")
        worker = workers[drafter.algorithm](_DrafterRunner(self.runner, layer_ids), drafter,
                                            num_speculative_tokens=self._num_speculative_tokens)
        return DrafterVersion(version, worker, drafter, layer_ids, chooser=self._chooser(worker))

    def _chooser(self, worker: Worker) -> RoundChooser:
        static = self._speculation == "static"
        table = None if static and self.cost_table is None else self._table(worker.max_verify_rows)
        return RoundChooser(table, worker.verify_sizes, worker.verify_layout,
                            depth=getattr(worker, "max_depth", None), max_speculative_batch=self._max_speculative_batch,
                            static=static, survival=getattr(worker, "published_survival", None))

    def _table(self, max_rows: int) -> CostTable:
        """The engine's cost table; when none was given, measured once per process and shape on a
        twin of the runner (its weights, its own small KV cache). Past its rows it extrapolates."""
        with self._table_lock:
            if self.cost_table is None:
                machine = describe_machine(self.target)
                batches, rows = engine_grid(self.runner.cache.num_slots, max_rows)
                key = (machine, batches, rows)
                if key not in _MEASURED:
                    log.info("measuring the round-cost table (batch sizes %s, rows %s)", batches, rows)
                    _MEASURED[key] = profile_runner(self.runner, machine, batch_sizes=batches, rows=rows, repeats=3)
                self.cost_table = _MEASURED[key]
            return self.cost_table

    def load(self, drafter_dir: str | Path, version: int) -> Future:
        """Validate and build ``version`` in a background thread; ``activate_staged`` activates it.
        The future resolves to ``version`` once it is ready, or raises why it was rejected.
        ``future.cancel()`` while it builds (a caller that stopped waiting) drops the result: a
        cancelled version is never staged."""
        future: Future = Future()
        threading.Thread(target=self._load, args=(str(drafter_dir), version, future), daemon=True,
                         name=f"specray-load-v{version}").start()
        return future

    def _load(self, drafter_dir: str, version: int, future: Future) -> None:
        try:
            staged = self.build(drafter_dir, version)
        except Exception as e:  # noqa: BLE001 - any failure rejects the version; the caller gets it via the future
            log.warning("drafter version %s rejected: %s", version, e)
            with self._lock:
                self.rejected[version] = f"{type(e).__name__}: {e}"
            if future.set_running_or_notify_cancel():
                future.set_exception(e)
            return
        with self._lock:
            if not future.set_running_or_notify_cancel():  # cancelled while it built: never activated
                log.warning("drafter version %s was built after its loader stopped waiting; dropped", version)
                return
            self.staged.append(staged)
            self._notify()
        future.set_result(version)

    def activate_staged(self) -> None:
        with self._lock:
            staged, self.staged = self.staged, []
        for version in staged:
            self.install(version)

    def install(self, version: DrafterVersion) -> None:
        """Make ``version`` the active one (new requests run on it); its stats join the history."""
        with self._lock:
            version.stats = self.history.setdefault(version.version, version.stats)
            self.live.append(version)
            self.active = version
            self.drop_idle()

    def drop_idle(self) -> None:
        """Forget versions that are not active and run no request; capture only the live drafters' layers."""
        with self._lock:
            self.live = [v for v in self.live if v is self.active or v.live > 0]
            layers = sorted({i for v in self.live for i in v.layer_ids})
            self.runner.capture_layer_ids = tuple(layers)  # read by every forward; changed only between steps

    def summary(self) -> dict:
        """The versions' part of ``Engine.stats()``."""
        with self._lock:
            active = self.active.stats.summary()
            return {
                "active_version": self.active.version,
                "algorithm": self.active.algorithm,
                "live_versions": [v.version for v in self.live],
                "rejected_versions": [{"version": v, "error": e} for v, e in sorted(self.rejected.items())],
                "tau": active["tau"],
                "acceptance_by_position": active["acceptance_by_position"],
                "worker": self.active.worker.stats(),
                "chooser": self.active.chooser.summary() if self.active.chooser else None,
                "versions": [{"version": v, **s.summary()} for v, s in self.history.items()],
            }
