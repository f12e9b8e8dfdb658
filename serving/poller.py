"""The poller that keeps a replica on the version it should serve (serving/registry.py), and its reports.

    poller = RegistryPoller(DrafterRegistry(uri), engine, cache_dir="/tmp/drafters", replica_id="r1").start()
    poller.poll()     # one check by hand: the version it loaded, or None
    poller.stop()

**Which version.** With a pin (``specray registry pin N``), the pinned version, whatever is newer.
Without one, the newest *good* version: complete, and not rejected in the ``registry`` or
``operator`` scope or in this replica's own (``target-<hash>`` of its target). Each poll walks the
versions newest first down to the one the engine serves, and hands the first that loads to
``engine.load_drafter``, which validates it in the background and switches between steps. So a
replica falls back to older good versions while newer ones fail, and never goes below what it
serves unless what it serves was rejected (a rollback) — then it loads the next older good one.

**Failures.** A version the registry refuses to pull (``RejectedVersionError``) or the engine
refuses to load (a ``ValueError``: ``InvalidDrafterError``, a bad config) is rejected for good:
recorded in the registry, so no replica, restarted or new, tries it again. Anything else — a pull
that fails (an S3 503, a file whose size disagrees with its marker, a full disk), a load past
``load_timeout_s`` (cancelled: its late result is never activated) — is retried with backoff
(``retry_s`` doubling up to ``max_retry_s``) while the replica serves the next older good version.
A cached copy the engine refuses is deleted and pulled again before the version is rejected.

**Crash loops.** Before loading, the poller records an attempt in the registry; it ends it when
the load is done. An attempt whose owner stopped reporting (its replica died mid-load: an
out-of-memory kill) counts as a crash once that report is stale (``stale_after_s``: three of its
poll intervals and 10 s); once ``MAX_LOAD_CRASHES`` replicas died loading a version, the next
poller rejects it for every replica instead of trying it. Replicas that restart faster than a
report goes stale may try it a few more times; the count only grows, so the loop ends.

**Reports.** A thread of its own writes the replica's report every ``interval_s`` (also while a
load blocks the poll): the version it serves, its live tau and rounds per version, the pin it
follows, the version it is loading and ``last_error`` — what ``specray registry status`` shows.
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
import shutil
import socket
import threading
import time
import uuid
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass
from pathlib import Path

from specray.serving.registry import (MARKER, MAX_LOAD_CRASHES, REGISTRY, DrafterRegistry, RejectedVersionError,
                                      version_dir)

log = logging.getLogger(__name__)

_OK, _REJECTED, _TRANSIENT = "ok", "rejected", "transient"


def rejection_scope(target_fingerprint: str) -> str:
    """The scope of a replica's rejections: replicas of one target share it."""
    return "target-" + hashlib.sha256(target_fingerprint.encode()).hexdigest()[:16]


def _component(name: str) -> str:
    """``name`` as one registry path component (serving/registry.py ``check_name``)."""
    return re.sub(r"[^A-Za-z0-9_.-]", "-", name).lstrip("_.-")[:128] or "replica"


def stale_after_s(report: dict) -> float:
    """Seconds after which a replica's report means it is gone: three of its intervals, and 10 s."""
    interval = report.get("interval_s")
    return 3 * (interval if isinstance(interval, (int, float)) and interval > 0 else 10.0) + 10.0


def replica_report(stats: dict, *, owner: str, interval_s: float, pinned: int | None = None, loading: int | None = None,
                   last_error: str | None = None, rejected: list[int] = ()) -> dict:
    """A replica's report to the registry (what ``specray registry status`` shows) from its engine's stats."""
    return {"owner": owner, "host": socket.gethostname(), "pid": os.getpid(), "interval_s": interval_s,
            "version": stats.get("active_version"), "algorithm": stats.get("algorithm"), "tau": stats.get("tau"),
            "versions": [{k: v.get(k) for k in ("version", "tau", "rounds")} for v in stats.get("versions", [])],
            "pinned": pinned, "loading": loading, "last_error": last_error, "rejected": list(rejected)}


@dataclass
class _Backoff:
    failures: int
    next_at: float  # time.monotonic() of the next try
    error: str


class RegistryPoller:
    """Every ``interval_s``, move the engine to the version it should serve (module docstring).

    ``engine`` needs ``load_drafter(dir, version) -> Future``, ``active_version``, ``stats()`` and
    ``target.target_fingerprint`` (``serving/engine.py``'s ``Engine``)."""

    def __init__(self, registry: DrafterRegistry, engine, *, cache_dir: str | Path, interval_s: float = 10.0,
                 load_timeout_s: float = 600.0, replica_id: str | None = None, retry_s: float | None = None,
                 max_retry_s: float = 600.0):
        for name, value in (("interval_s", interval_s), ("load_timeout_s", load_timeout_s),
                            ("max_retry_s", max_retry_s), ("retry_s", interval_s if retry_s is None else retry_s)):
            if not value > 0:
                raise ValueError(f"{name} must be > 0, got {value}")
        self.registry, self.engine = registry, engine
        self.cache_dir = Path(cache_dir)
        self.interval_s, self.load_timeout_s = interval_s, load_timeout_s
        self.retry_s, self.max_retry_s = interval_s if retry_s is None else retry_s, max_retry_s
        self.owner = _component(f"{socket.gethostname()[:40]}-{os.getpid()}-{uuid.uuid4().hex[:8]}")
        self.replica_id = _component(replica_id) if replica_id else self.owner
        self.scope = rejection_scope(engine.target.target_fingerprint)
        self.rejected: dict[int, str] = {}  # versions this replica does not serve, and why
        self.pinned: int | None = None  # the pin the last poll read
        self.loading: int | None = None  # the version being loaded now
        self.last_error: str | None = None
        self._retry: dict[int, _Backoff] = {}
        self._unwritten: list[tuple[int, str, str]] = []  # rejections to record: (version, scope, reason)
        self._unended: list[str] = []  # attempt records to remove
        self._lock = threading.Lock()  # the registry writes of the two threads
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []

    # -- one poll ----------------------------------------------------------------------------

    def poll(self) -> int | None:
        """One check; blocks until a version is ready in the engine. Returns the version it loaded,
        or None (the engine already serves the version it should, or every candidate failed)."""
        self.report()
        self._flush()
        versions = self.registry.versions()
        # the registry's records (an operator may lift one: pin), and this replica's not written yet
        self.rejected = {v: f"{r.scope}: {r.reason}" for v, r in self.registry.rejected_for(self.scope).items()}
        self.rejected.update({v: f"{scope}: {reason}" for v, scope, reason in self._unwritten})
        try:
            self.pinned = self.registry.pinned()
        except ValueError as e:  # a garbled PIN: keep what is served until an operator fixes it
            self.last_error = str(e)
            return None
        active, errors = self.engine.active_version, []
        if self.pinned is not None and self.pinned not in versions:
            self.last_error = f"the pinned version {self.pinned} is not a complete version of {self.registry.uri}"
            return None
        for version in [self.pinned] if self.pinned is not None else reversed(versions):
            if version in self.rejected:  # also the one served: a rollback moves off it
                errors.append(f"version {version} rejected: {self.rejected[version]}")
                continue
            if version == active:
                break
            backoff = self._retry.get(version)
            if backoff is not None and time.monotonic() < backoff.next_at:
                errors.append(f"version {version} failed {backoff.failures}x, retried in "
                              f"{backoff.next_at - time.monotonic():.3g} s: {backoff.error}")
                continue
            if self._crashed(version):
                errors.append(f"version {version} rejected: {self.rejected[version]}")
                continue
            outcome, error = self._try(version)
            if outcome == _OK:
                self._retry.pop(version, None)
                self.last_error = "; ".join(errors) or None
                return version
            errors.append(self._failed(version, outcome, error))
        self.last_error = "; ".join(errors) or None
        return None

    def _failed(self, version: int, outcome: str, error: BaseException) -> str:
        """Record a failed try (a rejection, or a backoff) and describe it."""
        message = f"{type(error).__name__}: {error}"
        if outcome == _REJECTED:
            scope = REGISTRY if isinstance(error, RejectedVersionError) else self.scope
            self.rejected[version] = f"{scope}: {message}"
            self._unwritten.append((version, scope, message))
            self._flush()
            log.warning("version %s rejected: %s", version, message)
            return f"version {version} rejected: {self.rejected[version]}"
        failures = self._retry[version].failures + 1 if version in self._retry else 1
        delay = min(self.max_retry_s, self.retry_s * 2 ** (failures - 1))
        self._retry[version] = _Backoff(failures, time.monotonic() + delay, message)
        log.warning("version %s failed (%s), retried in %.3g s", version, message, delay)
        return f"version {version} failed {failures}x, retried in {delay:.3g} s: {message}"

    def _crashed(self, version: int) -> bool:
        """Whether ``MAX_LOAD_CRASHES`` replicas died loading ``version``; if so it is rejected."""
        attempts = [a for a in self.registry.attempts(version) if a.get("owner") != self.owner]
        if not attempts:
            return False
        reports = {r.get("owner"): r for r in self.registry.replicas()}
        now = time.time()
        dead = [a for a in attempts if a.get("owner") not in reports
                or now - reports[a["owner"]].get("reported_at", 0) > stale_after_s(reports[a["owner"]])]
        if len(dead) < MAX_LOAD_CRASHES:
            return False
        reason = (f"{len(dead)} replicas died loading it ({', '.join(str(a.get('replica')) for a in dead)}): "
                  "an export that kills its loader is not tried again")
        self.rejected[version] = f"{REGISTRY}: {reason}"
        self._unwritten.append((version, REGISTRY, reason))
        self._flush()
        log.warning("version %s rejected: %s", version, reason)
        return True

    def _try(self, version: int) -> tuple[str, BaseException | None]:
        """Pull ``version`` and load it into the engine: (outcome, the error that stopped it)."""
        with self._lock:
            attempt = self.registry.begin_attempt(version, self.owner, self.replica_id)
        self.loading = version
        try:
            cached = (self.cache_dir / version_dir(version) / MARKER).is_file()
            try:
                local = self.registry.pull(version, self.cache_dir)
            except RejectedVersionError as e:
                return _REJECTED, e
            except Exception as e:  # noqa: BLE001 - any other pull failure (S3 5xx, sizes, disk) is retried
                return _TRANSIENT, e
            future = self.engine.load_drafter(str(local), version)
            try:
                error = future.exception(timeout=self.load_timeout_s)
            except FutureTimeout:
                if future.cancel():  # a late success is dropped, not activated behind the poller's back
                    return _TRANSIENT, TimeoutError(f"loading took longer than load_timeout_s={self.load_timeout_s}")
                error = future.exception()  # it finished as the time ran out
            if error is None:
                return _OK, None
            if isinstance(error, ValueError) and cached:  # the local copy may be what is bad: pull afresh
                shutil.rmtree(local, ignore_errors=True)
                return _TRANSIENT, error
            return (_REJECTED if isinstance(error, ValueError) else _TRANSIENT), error
        finally:
            self.loading = None
            self._unended.append(attempt)
            self._flush()

    def _flush(self) -> None:
        """Write the rejections and end the attempts that are pending; what fails is retried next poll."""
        with self._lock:
            while self._unwritten:
                version, scope, reason = self._unwritten[0]
                try:
                    self.registry.reject(version, scope, reason, by=self.replica_id)
                except Exception as e:  # noqa: BLE001 - the rejection holds locally; written at a later poll
                    log.warning("recording the rejection of version %s failed: %s", version, e)
                    break
                self._unwritten.pop(0)
            while self._unended:
                try:
                    self.registry.end_attempt(self._unended[0])
                except Exception as e:  # noqa: BLE001 - removed at a later poll
                    log.warning("ending a load attempt record failed: %s", e)
                    break
                self._unended.pop(0)

    # -- reports -----------------------------------------------------------------------------

    def report(self) -> None:
        """Write this replica's report (module docstring) to the registry."""
        record = replica_report(self.engine.stats(), owner=self.owner, interval_s=self.interval_s, pinned=self.pinned,
                                loading=self.loading, last_error=self.last_error, rejected=sorted(self.rejected))
        with self._lock:
            self.registry.report(self.replica_id, record)

    # -- threads -----------------------------------------------------------------------------

    def start(self) -> RegistryPoller:
        self._threads = [threading.Thread(target=self._run, daemon=True, name="specray-registry-poller"),
                         threading.Thread(target=self._report_loop, daemon=True, name="specray-registry-report")]
        for thread in self._threads:
            thread.start()
        return self

    def stop(self, timeout: float = 30.0) -> None:
        """Stop both threads and remove this replica's report (a stopped replica serves nothing)."""
        self._stop.set()
        for thread in self._threads:
            thread.join(timeout)
        try:
            with self._lock:
                self.registry.forget(self.replica_id)
        except Exception as e:  # noqa: BLE001 - the report goes stale instead, and status says so
            log.warning("removing the report of %s failed: %s", self.replica_id, e)

    def _run(self) -> None:
        while True:  # the first poll at once: a new replica starts on the version it should serve
            try:
                self.poll()
            except Exception as e:  # noqa: BLE001 - a registry outage must not end hot-loading; retried next poll
                self.last_error = f"{type(e).__name__}: {e}"
                log.warning("polling %s failed: %s", self.registry.uri, self.last_error)
            if self._stop.wait(self.interval_s):
                return

    def _report_loop(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self.report()
            except Exception as e:  # noqa: BLE001 - retried next interval; status shows the report's age
                log.warning("reporting to %s failed: %s", self.registry.uri, e)
