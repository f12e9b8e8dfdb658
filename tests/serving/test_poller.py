"""RegistryPoller: the version a replica should serve (pin, newest good, fallback), rejections kept in
the registry, retries with backoff of pulls and loads that failed for a while, crash-loop guard,
and the replica's reports; a load cancelled on timeout is never activated by the engine."""

import json
import threading
import time
from concurrent.futures import Future
from types import SimpleNamespace

import pytest

from specray.serving.engine import Engine
from specray.serving.poller import RegistryPoller, rejection_scope
from specray.serving.registry import MARKER, MAX_LOAD_CRASHES, OPERATOR, REGISTRY, DrafterRegistry


def _export(path, weights: bytes):
    """Publish copies files without validating them, so any export-shaped directory will do here."""
    path.mkdir(parents=True)
    (path / "config.json").write_text('{"format_version": 1}')
    (path / "model.safetensors").write_bytes(weights)
    (path / "export.json").write_text("{}")
    return path


class _FakeEngine:
    """Records load_drafter calls; rejects the versions in ``reject`` (a ValueError, as
    InvalidDrafterError is), fails those in ``fail`` (another error) and never finishes those in
    ``hang``; serves what it loaded."""

    def __init__(self, reject=(), fail=(), hang=(), fingerprint="sha256:debug"):
        self.loaded, self.reject, self.fail, self.hang = [], set(reject), set(fail), set(hang)
        self.active_version = None
        self.target = SimpleNamespace(target_fingerprint=fingerprint)
        self.futures = []

    def load_drafter(self, path, version):
        future = Future()
        self.loaded.append(version)
        self.futures.append(future)
        if version in self.reject:
            future.set_exception(ValueError(f"bad export {path}"))
        elif version in self.fail:
            future.set_exception(MemoryError("the machine is short of memory"))
        elif version not in self.hang:
            self.active_version = version
            future.set_result(version)
        return future

    def stats(self):
        return {"active_version": self.active_version, "algorithm": "dflash", "tau": 2.5,
                "versions": [{"version": self.active_version, "tau": 2.5, "rounds": 7}]}


def _poller(registry, engine, tmp_path, **kwargs):
    return RegistryPoller(registry, engine, cache_dir=tmp_path / "cache", interval_s=0.05, **kwargs)


@pytest.fixture(params=["file", pytest.param("s3", marks=pytest.mark.s3)])
def registry(request, tmp_path):
    if request.param == "file":
        return DrafterRegistry(str(tmp_path / "registry"))
    server = request.getfixturevalue("seaweedfs")
    return DrafterRegistry(server.uri(f"poller-{tmp_path.name}"), endpoint_url=server.endpoint)


def test_poller_loads_each_new_version_once(registry, tmp_path):
    engine = _FakeEngine(reject={2})
    poller = _poller(registry, engine, tmp_path)
    assert poller.poll() is None and engine.loaded == []
    registry.publish(_export(tmp_path / "a", b"A"))
    assert poller.poll() == 1 and poller.poll() is None
    registry.publish(_export(tmp_path / "b", b"B"))
    assert poller.poll() is None and "version 2 rejected: target-" in poller.last_error
    assert "bad export" in poller.last_error
    assert poller.poll() is None and engine.loaded == [1, 2]  # a rejected version is not retried
    registry.publish(_export(tmp_path / "c", b"C"))
    poller.start()
    try:
        for _ in range(200):
            if engine.loaded[-1] == 3:
                break
            time.sleep(0.05)
    finally:
        poller.stop()
    assert engine.loaded == [1, 2, 3] and poller.last_error is None
    with pytest.raises(ValueError, match="interval_s must be > 0"):
        RegistryPoller(registry, engine, cache_dir=tmp_path, interval_s=0)


def test_rejections_survive_a_restart_and_bind_only_the_same_target(registry, tmp_path):
    """A replica that rejected a version records it in the registry: a replica started afterwards
    (a crash, a scale-up) never hands that version to its engine; a replica of another target
    sharing the registry is not bound by it."""
    registry.publish(_export(tmp_path / "a", b"A"))
    registry.publish(_export(tmp_path / "b", b"B"))
    first = _FakeEngine(reject={2})
    assert _poller(registry, first, tmp_path).poll() == 1 and first.loaded == [2, 1]
    [record] = registry.rejections()[2]
    assert record.scope == rejection_scope("sha256:debug") and "bad export" in record.reason

    restarted = _FakeEngine()  # would load v2 if asked
    poller = _poller(registry, restarted, tmp_path)
    assert poller.poll() == 1 and restarted.loaded == [1]
    assert "version 2 rejected" in poller.last_error
    other_target = _FakeEngine(fingerprint="sha256:another")
    assert _poller(registry, other_target, tmp_path).poll() == 2


def test_a_pull_refused_by_the_registry_is_rejected_for_every_target(registry, tmp_path):
    registry.publish(_export(tmp_path / "a", b"A"))
    target = f"{registry.root}/v000002"
    registry.fs.makedirs(target, exist_ok=True)
    registry.fs.pipe_file(f"{target}/config.json", b"{}")
    registry.fs.pipe_file(f"{target}/{MARKER}", json.dumps({"files": {"config.json": 2, "../escaped": 1}}).encode())
    engine = _FakeEngine()
    assert _poller(registry, engine, tmp_path).poll() == 1 and engine.loaded == [1]
    assert [r.scope for r in registry.rejections()[2]] == [REGISTRY]
    assert _poller(registry, _FakeEngine(fingerprint="sha256:another"), tmp_path).poll() == 1
    assert not (tmp_path / "escaped").exists()


def test_a_transient_pull_error_falls_back_and_is_retried_with_backoff(registry, tmp_path, monkeypatch):
    """An S3 503 while pulling the newest version: the replica serves the next older good version
    at once and retries the newest, with doubling delays, until it loads — without a new publish."""
    registry.publish(_export(tmp_path / "a", b"A"))
    registry.publish(_export(tmp_path / "b", b"B"))
    engine = _FakeEngine()
    poller = _poller(registry, engine, tmp_path, retry_s=0.2, max_retry_s=0.4)
    pull, outage = registry.pull, {"left": 3}

    def flaky_pull(version, cache_dir):
        if version == 2 and outage["left"]:
            outage["left"] -= 1
            raise OSError("503 Service Unavailable: SlowDown")
        return pull(version, cache_dir)

    monkeypatch.setattr(registry, "pull", flaky_pull)
    assert poller.poll() == 1 and engine.active_version == 1  # the fallback
    assert "version 2 failed 1x, retried in 0.2 s: OSError: 503" in poller.last_error
    assert poller.poll() is None and outage["left"] == 2  # inside the backoff: not tried again yet
    tries = []
    deadline = time.monotonic() + 10
    while engine.active_version != 2 and time.monotonic() < deadline:
        before = outage["left"]
        poller.poll()
        if outage["left"] != before or engine.active_version == 2:
            tries.append(time.monotonic())
        time.sleep(0.02)
    assert engine.active_version == 2 and outage["left"] == 0 and poller.last_error is None
    assert len(tries) == 3 and tries[2] - tries[1] >= 0.35  # the delay doubled (capped at max_retry_s)
    assert registry.attempts(2) == [] and 2 not in registry.rejections()


def test_a_marker_whose_size_disagrees_is_retried_not_rejected(registry, tmp_path):
    registry.publish(_export(tmp_path / "a", b"A"))
    registry.publish(_export(tmp_path / "b", b"B" * 10))
    weights = f"{registry.root}/v000002/model.safetensors"
    registry.fs.pipe_file(weights, b"B" * 4)  # a truncated copy, or a store that is not consistent yet
    engine = _FakeEngine()
    poller = _poller(registry, engine, tmp_path, retry_s=0.05)
    assert poller.poll() == 1 and "version 2 failed 1x" in poller.last_error
    assert "the registry recorded 10" in poller.last_error
    registry.fs.pipe_file(weights, b"B" * 10)
    time.sleep(0.06)
    assert poller.poll() == 2 and engine.loaded == [1, 2] and registry.rejections() == {}


def test_a_load_past_its_timeout_is_cancelled_and_retried(registry, tmp_path):
    registry.publish(_export(tmp_path / "a", b"A"))
    registry.publish(_export(tmp_path / "b", b"B"))
    engine = _FakeEngine(hang={2})
    poller = _poller(registry, engine, tmp_path, load_timeout_s=0.1, retry_s=0.05)
    assert poller.poll() == 1 and "load_timeout_s=0.1" in poller.last_error
    assert engine.futures[0].cancelled()  # its late result is never activated
    engine.hang.clear()
    time.sleep(0.06)
    assert poller.poll() == 2 and engine.loaded == [2, 1, 2]


def test_another_failure_of_the_engine_is_retried(registry, tmp_path):
    registry.publish(_export(tmp_path / "a", b"A"))
    engine = _FakeEngine(fail={1})
    poller = _poller(registry, engine, tmp_path, retry_s=0.05)
    assert poller.poll() is None and "MemoryError" in poller.last_error and registry.rejections() == {}
    engine.fail.clear()
    time.sleep(0.06)
    assert poller.poll() == 1


def test_a_version_that_killed_its_loaders_is_rejected_not_tried(registry, tmp_path):
    """Replicas that died while loading a version left their attempt records, and their reports
    went stale: after MAX_LOAD_CRASHES of them the next replica rejects it for everyone."""
    registry.publish(_export(tmp_path / "a", b"A"))
    registry.publish(_export(tmp_path / "b", b"B"))
    registry.begin_attempt(2, "dead-0", "replica-0")  # died before its first report
    engine = _FakeEngine()
    assert _poller(registry, engine, tmp_path).poll() == 2  # one death may be anything: tried
    engine.active_version = None

    for n in range(MAX_LOAD_CRASHES):
        registry.begin_attempt(2, f"dead-{n}", f"replica-{n}")
        registry.report(f"replica-{n}", {"owner": f"dead-{n}", "interval_s": 0.05})
    registry.begin_attempt(2, "alive", "replica-alive")  # a replica loading it right now: not a crash
    registry.report("replica-alive", {"owner": "alive", "interval_s": 60})
    for n in range(MAX_LOAD_CRASHES):  # their last reports are a minute old: those replicas are gone
        path = f"{registry.root}/replicas/replica-{n}.json"
        record = json.loads(registry.fs.cat_file(path))
        registry.fs.pipe_file(path, json.dumps(record | {"reported_at": time.time() - 60}).encode())
    fresh = _FakeEngine()
    poller = _poller(registry, fresh, tmp_path)
    assert poller.poll() == 1 and fresh.loaded == [1]
    assert "2 replicas died loading it (replica-0, replica-1)" in poller.last_error
    assert [r.scope for r in registry.rejections()[2]] == [REGISTRY]


def test_a_pin_holds_and_unpin_returns_to_the_newest(registry, tmp_path):
    for name in "abc":
        registry.publish(_export(tmp_path / name, name.encode()))
    engine = _FakeEngine()
    poller = _poller(registry, engine, tmp_path)
    assert poller.poll() == 3
    registry.pin(1)
    assert poller.poll() == 1 and poller.pinned == 1
    registry.publish(_export(tmp_path / "d", b"d"))
    assert poller.poll() is None and engine.active_version == 1  # newer versions exist: the pin holds
    registry.unpin()
    assert poller.poll() == 4 and poller.pinned is None


def test_a_rollback_falls_back_to_the_previous_good_version(registry, tmp_path):
    """``specray registry rollback`` rejects the newest good version in the operator's scope:
    replicas serving it load the previous good one; a later publish rolls out as usual."""
    for name in "abc":
        registry.publish(_export(tmp_path / name, name.encode()))
    engine = _FakeEngine(reject={2})
    poller = _poller(registry, engine, tmp_path)
    assert poller.poll() == 3
    registry.reject(3, OPERATOR, "tau dropped")
    assert poller.poll() == 1 and engine.loaded == [3, 2, 1]  # 3 rolled back, 2 refused by the engine
    assert "version 3 rejected: operator: tau dropped" in poller.last_error
    registry.publish(_export(tmp_path / "d", b"d"))
    assert poller.poll() == 4


def test_a_pinned_version_this_replica_rejects_keeps_what_it_serves(registry, tmp_path):
    registry.publish(_export(tmp_path / "a", b"a"))
    registry.publish(_export(tmp_path / "b", b"b"))
    engine = _FakeEngine(reject={1})
    poller = _poller(registry, engine, tmp_path)
    assert poller.poll() == 2
    registry.pin(1)
    assert poller.poll() is None and engine.active_version == 2 and "version 1 rejected" in poller.last_error
    registry.fs.pipe_file(f"{registry.root}/PIN", b"{}")
    assert poller.poll() is None and "PIN does not name a version" in poller.last_error


def test_reports_show_the_served_version_and_tau(registry, tmp_path):
    registry.publish(_export(tmp_path / "a", b"a"))
    engine = _FakeEngine()
    poller = _poller(registry, engine, tmp_path, replica_id="replica/7").start()
    try:
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and not any(r.get("version") == 1 for r in registry.replicas()):
            time.sleep(0.05)
        [report] = registry.replicas()
        assert (report["replica"], report["version"], report["tau"], report["owner"]) == (
            "replica-7", 1, 2.5, poller.owner)
        assert report["versions"] == [{"version": 1, "tau": 2.5, "rounds": 7}] and report["last_error"] is None
    finally:
        poller.stop()
    assert registry.replicas() == []  # a stopped replica serves nothing


def test_a_cancelled_load_is_never_activated(debug_target, export_drafter):
    """The engine side of the load timeout: a future cancelled while its version builds drops the
    build; the engine keeps serving what it served."""
    engine = Engine(debug_target, max_batch=1, max_len=64, speculation="static")
    release = threading.Event()
    build = engine.versions.build

    def slow_build(drafter_dir, version):
        release.wait(10)
        return build(drafter_dir, version)

    engine.versions.build = slow_build
    future = engine.load_drafter(export_drafter(), 5)
    assert future.cancel()
    release.set()
    deadline = time.monotonic() + 30
    while threading.active_count() > 1 and any(t.name == "specray-load-v5" for t in threading.enumerate()):
        assert time.monotonic() < deadline
        time.sleep(0.05)
    engine.step()
    assert engine.versions.staged == [] and engine.active_version is None
    later = engine.load_drafter(export_drafter(), 6)
    assert later.result(timeout=30) == 6
    engine.step()
    assert engine.active_version == 6


def test_pinning_a_rolled_back_version_serves_it_again(registry, tmp_path):
    registry.publish(_export(tmp_path / "a", b"a"))
    registry.publish(_export(tmp_path / "b", b"b"))
    engine = _FakeEngine()
    poller = _poller(registry, engine, tmp_path)
    assert poller.poll() == 2
    registry.reject(2, OPERATOR, "rolled back")
    assert poller.poll() == 1
    registry.pin(2)
    assert poller.poll() == 2 and poller.last_error is None


_DYING_REPLICA = """
import os, sys
from concurrent.futures import Future
from types import SimpleNamespace
from specray.serving.poller import RegistryPoller
from specray.serving.registry import DrafterRegistry

class Engine:  # dies loading version 2, as a replica the kernel's OOM killer ends
    active_version = None
    target = SimpleNamespace(target_fingerprint="sha256:debug")
    def stats(self):
        return {"active_version": self.active_version, "versions": []}
    def load_drafter(self, path, version):
        if version == 2:
            os._exit(137)
        future = Future()
        self.active_version = version
        future.set_result(version)
        return future

RegistryPoller(DrafterRegistry(sys.argv[1]), Engine(), cache_dir=sys.argv[2], interval_s=0.2,
               replica_id=sys.argv[3]).poll()
"""


def test_a_version_that_kills_replicas_stops_being_tried(registry, tmp_path):
    """Two replica processes die loading version 2 (killed mid-load: no rejection could be
    written); the next replica, once their reports went stale, rejects it for every replica and
    serves version 1 — one crafted publish cannot crash-loop the replicas."""
    import subprocess
    import sys

    registry.publish(_export(tmp_path / "a", b"A"))
    registry.publish(_export(tmp_path / "b", b"B"))
    for n in range(MAX_LOAD_CRASHES):
        done = subprocess.run([sys.executable, "-c", _DYING_REPLICA, registry.uri, str(tmp_path / f"cache-{n}"),
                               f"replica-{n}"], capture_output=True, timeout=120)
        assert done.returncode == 137, done.stderr.decode()[-2000:]
    assert len(registry.attempts(2)) == MAX_LOAD_CRASHES and 2 not in registry.rejections()
    died = time.time()
    stale = max(r["reported_at"] for r in registry.replicas()) + 3 * 0.2 + 10.0  # stale_after_s of their reports
    time.sleep(max(0.0, stale - died) + 0.5)
    engine = _FakeEngine()
    poller = _poller(registry, engine, tmp_path)
    assert poller.poll() == 1 and engine.loaded == [1]
    assert "2 replicas died loading it (replica-0, replica-1)" in registry.rejections()[2][0].reason
