"""DrafterRegistry on file:// and s3:// (SeaweedFS): monotonic versions, a version is visible only
once complete, pulls are local copies; and the poller hands new versions to the engine."""

import json
import re
from concurrent.futures import Future
from pathlib import Path

import pytest

from specray.serving.registry import MARKER, DrafterRegistry, RegistryPoller, RejectedVersionError


def _export(path, weights: bytes):
    """Publish copies files without validating them, so any export-shaped directory will do here."""
    path.mkdir(parents=True)
    (path / "config.json").write_text('{"format_version": 1}')
    (path / "model.safetensors").write_bytes(weights)
    (path / "export.json").write_text("{}")
    return path


@pytest.fixture(params=["file", pytest.param("s3", marks=pytest.mark.s3)])
def registry(request, tmp_path):
    if request.param == "file":
        return DrafterRegistry((tmp_path / "registry").as_uri())
    server = request.getfixturevalue("seaweedfs")
    return DrafterRegistry(server.uri(f"registry-{tmp_path.name}"), endpoint_url=server.endpoint)


def test_publish_versions_pull(registry, tmp_path):
    assert registry.versions() == [] and registry.latest() is None
    assert registry.publish(_export(tmp_path / "a", b"A" * 1000)) == 1
    assert registry.publish(_export(tmp_path / "b", b"B" * 2000)) == 2
    assert registry.versions() == [1, 2] and registry.latest() == 2

    local = registry.pull(1, tmp_path / "cache")
    assert local.name == "v000001" and (local / "model.safetensors").read_bytes() == b"A" * 1000
    assert sorted(p.name for p in local.iterdir()) == [MARKER, "config.json", "export.json", "model.safetensors"]
    assert registry.pull(1, tmp_path / "cache") == local  # cached: not copied again
    with pytest.raises(FileNotFoundError, match=r"no complete version 7; it has \[1, 2\]"):
        registry.pull(7, tmp_path / "cache")
    with pytest.raises(FileNotFoundError, match="not a directory with files"):
        registry.publish(tmp_path / "missing")


def test_a_version_without_its_marker_is_invisible_and_not_reused(registry, tmp_path):
    registry.publish(_export(tmp_path / "a", b"A"))
    registry.fs.makedirs(f"{registry.root}/v000002", exist_ok=True)  # a publish that crashed half-way
    registry.fs.pipe_file(f"{registry.root}/v000002/model.safetensors", b"half")
    assert registry.versions() == [1]
    with pytest.raises(FileNotFoundError):
        registry.pull(2, tmp_path / "cache")
    assert registry.publish(_export(tmp_path / "b", b"B")) == 3
    assert registry.versions() == [1, 3]


class _FakeEngine:
    """Records load_drafter calls; rejects the directories named in ``reject``."""

    def __init__(self, reject=()):
        self.loaded, self.reject = [], set(reject)

    def load_drafter(self, path, version):
        future = Future()
        self.loaded.append(version)
        if version in self.reject:
            future.set_exception(ValueError(f"bad export {path}"))
        else:
            future.set_result(version)
        return future


def test_poller_loads_each_new_version_once(tmp_path):
    registry = DrafterRegistry(str(tmp_path / "registry"))
    engine = _FakeEngine(reject={2})
    poller = RegistryPoller(registry, engine, cache_dir=tmp_path / "cache", interval_s=0.05)
    assert poller.poll() is None and engine.loaded == []
    registry.publish(_export(tmp_path / "a", b"A"))
    assert poller.poll() == 1 and poller.poll() is None
    registry.publish(_export(tmp_path / "b", b"B"))
    assert poller.poll() is None and "version 2 rejected: bad export" in poller.last_error
    assert poller.poll() is None  # a rejected version is not retried
    registry.publish(_export(tmp_path / "c", b"C"))
    poller.start()
    try:
        for _ in range(200):
            if engine.loaded[-1] == 3:
                break
            poller._stop.wait(0.05)
    finally:
        poller.stop()
    assert engine.loaded == [1, 2, 3] and poller.last_error is None
    with pytest.raises(ValueError, match="interval_s must be > 0"):
        RegistryPoller(registry, engine, cache_dir=tmp_path, interval_s=0)


def _forge(registry, version: int, files: dict[str, bytes], listed: dict | None = None):
    """A version written straight into the registry with a hand-made marker (an attacker who can
    write the registry, or a buggy publisher): ``listed`` is what the marker names."""
    target = f"{registry.root}/v{version:06d}"
    registry.fs.makedirs(target, exist_ok=True)
    for name, data in files.items():
        registry.fs.pipe_file(f"{target}/{name}", data)
    listed = {name: len(data) for name, data in files.items()} if listed is None else listed
    registry.fs.pipe_file(f"{target}/{MARKER}", json.dumps({"version": version, "files": listed}).encode())


@pytest.mark.parametrize("name", ["../../escaped", "/tmp/specray-absolute-escape", "sub/config.json", "notes.txt",
                                  "..", "./config.json", "config.json/"])
def test_pull_refuses_names_outside_the_export_files(registry, tmp_path, name):
    """A marker naming anything but a plain export file (config.json, model.safetensors,
    export.json) is rejected whole: nothing is written, not even the files it names correctly."""
    _forge(registry, 1, {"config.json": b"{}", "model.safetensors": b"W"},
           {"config.json": 2, "model.safetensors": 1, name: 1})
    with pytest.raises(RejectedVersionError, match=r"version 1 .*" + re.escape(repr(name))):
        registry.pull(1, tmp_path / "cache" / "a" / "b")
    assert not (tmp_path / "cache").exists() and not Path("/tmp/specray-absolute-escape").exists()


def test_pull_refuses_a_marker_that_is_not_a_file_list(registry, tmp_path):
    _forge(registry, 1, {"config.json": b"{}"}, {"config.json": "2"})
    with pytest.raises(RejectedVersionError, match="sizes"):
        registry.pull(1, tmp_path / "cache")
    registry.fs.makedirs(f"{registry.root}/v000002", exist_ok=True)
    registry.fs.pipe_file(f"{registry.root}/v000002/{MARKER}", b"[]")
    with pytest.raises(RejectedVersionError, match="version 2"):
        registry.pull(2, tmp_path / "cache")


def test_pull_refuses_a_symlinked_file(tmp_path):
    """On a file:// registry a version's file that is a symlink would copy whatever it points at
    (another user's secrets) into the cache."""
    secret = tmp_path / "secret"
    secret.write_text("password")
    registry = DrafterRegistry(str(tmp_path / "registry"))
    _forge(registry, 1, {"config.json": b"{}"}, {"config.json": 2, "export.json": 8})
    (tmp_path / "registry" / "v000001" / "export.json").symlink_to(secret)
    with pytest.raises(RejectedVersionError, match="export.json.*not a regular file"):
        registry.pull(1, tmp_path / "cache")
    assert not list((tmp_path / "cache").rglob("export.json"))


def test_poller_reports_a_rejected_pull_and_keeps_the_old_version(tmp_path):
    registry = DrafterRegistry(str(tmp_path / "registry"))
    engine = _FakeEngine()
    poller = RegistryPoller(registry, engine, cache_dir=tmp_path / "cache", interval_s=0.05)
    registry.publish(_export(tmp_path / "a", b"A"))
    assert poller.poll() == 1
    _forge(registry, 2, {"config.json": b"{}"}, {"config.json": 2, "../../../escaped": 1})
    assert poller.poll() is None and engine.loaded == [1]  # never handed to the engine
    assert poller.last_error.startswith("version 2 rejected:") and "'../../../escaped'" in poller.last_error
    assert poller.poll() is None and poller.seen == 2  # not retried
    assert not (tmp_path / "escaped").exists()


def test_a_replica_started_after_a_bad_publish_serves_the_newest_good_version(tmp_path):
    registry = DrafterRegistry(str(tmp_path / "registry"))
    registry.publish(_export(tmp_path / "a", b"A"))
    registry.publish(_export(tmp_path / "b", b"B"))
    _forge(registry, 3, {"config.json": b"{}"}, {"config.json": 2, "../escaped": 1})
    engine = _FakeEngine(reject={2})  # v3 is refused by the registry, v2 by the engine
    poller = RegistryPoller(registry, engine, cache_dir=tmp_path / "cache", interval_s=0.05)
    assert poller.poll() == 1 and engine.loaded == [2, 1]  # newest first, down to the newest good one
    assert "version 3 rejected:" in poller.last_error and "version 2 rejected: bad export" in poller.last_error
    assert poller.poll() is None and engine.loaded == [2, 1]  # none of them is tried again
    registry.publish(_export(tmp_path / "d", b"D"))
    assert poller.poll() == 4 and poller.last_error is None


def test_publish_refuses_files_that_are_not_export_files(tmp_path):
    registry = DrafterRegistry(str(tmp_path / "registry"))
    export = _export(tmp_path / "a", b"A")
    (export / "notes.txt").write_text("x")
    with pytest.raises(ValueError, match=r"notes.txt.*config.json, export.json, model.safetensors"):
        registry.publish(export)
    assert registry.versions() == []
