"""DrafterRegistry on file:// and s3:// (SeaweedFS): monotonic versions, a version is visible only
once complete, concurrent publishers never share a number, pulls are local copies; pins,
rejections, replica reports and load attempts (the poller's side is tests/serving/test_poller.py)."""

import json
import re
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from unittest.mock import ANY

import pytest

from specray.serving.registry import (MARKER, OPERATOR, ConditionalWriteError, DrafterRegistry, Rejection,
                                      RejectedVersionError)


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


def test_publish_refuses_files_that_are_not_export_files(tmp_path):
    registry = DrafterRegistry(str(tmp_path / "registry"))
    export = _export(tmp_path / "a", b"A")
    (export / "notes.txt").write_text("x")
    with pytest.raises(ValueError, match=r"notes.txt.*config.json, export.json, model.safetensors"):
        registry.publish(export)
    assert registry.versions() == []


def _own_fs(registry):
    """A registry with a filesystem instance of its own (its own S3 session): what another process has."""
    fresh = DrafterRegistry(registry.uri, endpoint_url=None)
    if registry.protocol == "s3":
        import s3fs

        fresh.fs = s3fs.S3FileSystem(client_kwargs=registry.fs.client_kwargs, skip_instance_cache=True)
    return fresh


def test_concurrent_publishers_never_share_a_version(registry, tmp_path):
    """Publishers that list the registry at the same instant all see the same next number; the
    exclusive CLAIM gives it to one, the others take the next ones. Every version holds exactly
    the export its publisher was told it got."""
    publishers, rounds = 6, 2
    exports = {(p, r): _export(tmp_path / f"p{p}-r{r}", f"publisher {p} round {r} ".encode() * 50)
               for p in range(publishers) for r in range(rounds)}
    registry.publish(_export(tmp_path / "first", b"first"))  # the root exists before the race
    barrier = threading.Barrier(publishers)

    def publish(p: int) -> list[tuple[int, tuple[int, int]]]:
        mine = _own_fs(registry)
        got = []
        for r in range(rounds):
            barrier.wait()
            got.append((mine.publish(exports[p, r]), (p, r)))
        return got

    with ThreadPoolExecutor(publishers) as pool:
        published = [item for got in pool.map(publish, range(publishers)) for item in got]
    numbers = [v for v, _ in published]
    assert sorted(numbers) == list(range(2, 2 + publishers * rounds))  # distinct, none skipped or lost
    assert registry.versions() == list(range(1, 2 + publishers * rounds))
    for version, key in published:
        local = registry.pull(version, tmp_path / "cache")
        assert (local / "model.safetensors").read_bytes() == (exports[key] / "model.safetensors").read_bytes()
        assert json.loads((local / MARKER).read_text())["source"] == str(exports[key].resolve())


@pytest.mark.s3
def test_publish_refuses_an_s3_server_that_ignores_if_none_match(seaweedfs, tmp_path, monkeypatch):
    registry = DrafterRegistry(seaweedfs.uri(f"ignoring-{tmp_path.name}"), endpoint_url=seaweedfs.endpoint)
    plain_pipe = registry.fs.pipe_file
    monkeypatch.setattr(registry.fs, "pipe_file", lambda path, data, mode="overwrite", **kw: plain_pipe(path, data))
    with pytest.raises(ConditionalWriteError, match="does not honour 'If-None-Match: \\*'"):
        registry.publish(_export(tmp_path / "a", b"A"))
    registry.fs.invalidate_cache()
    assert registry.versions() == []
    assert [p for p in registry.fs.find(registry.root) if p != registry.root] == []  # not even the probe is left


def test_pin_unpin_and_rejections(registry, tmp_path):
    for name in "abc":
        registry.publish(_export(tmp_path / name, name.encode()))
    assert registry.pinned() is None and registry.unpin() is None
    registry.pin(2, reason="canary")
    assert registry.pinned() == 2
    assert registry.unpin() == 2 and registry.pinned() is None
    with pytest.raises(ValueError, match=r"no complete version 9 to pin; it has \[1, 2, 3\]"):
        registry.pin(9)

    registry.reject(3, OPERATOR, "rolled back")
    registry.reject(2, "target-aaaa", "InvalidDrafterError: trained for another target")
    assert registry.rejected_for("target-aaaa") == {
        2: Rejection(2, "target-aaaa", "InvalidDrafterError: trained for another target", ANY, ANY),
        3: Rejection(3, OPERATOR, "rolled back", ANY, ANY)}
    assert set(registry.rejected_for("target-bbbb")) == {3}  # another target's replicas may still serve 2
    with pytest.raises(ValueError, match="version 2 was rejected \\(target-aaaa: InvalidDrafterError"):
        registry.pin(2)
    registry.pin(3)  # pinning a rolled-back version lifts the operator's rejection
    assert registry.pinned() == 3 and 3 not in registry.rejections()
    with pytest.raises(ValueError, match="one path component"):
        registry.reject(1, "../escape", "x")

    registry.fs.pipe_file(f"{registry.root}/PIN", b'{"version": "three"}')
    with pytest.raises(ValueError, match="PIN does not name a version"):
        registry.pinned()
    registry.fs.makedirs(f"{registry.root}/rejected/v000001", exist_ok=True)
    registry.fs.pipe_file(f"{registry.root}/rejected/v000001/operator.json", b"not json")
    assert set(registry.rejections()) == {2}  # a garbled record is ignored (logged), not fatal


def test_replica_reports_and_load_attempts(registry):
    registry.report("replica-b", {"version": 2, "tau": 2.5})
    registry.report("replica-a", {"version": 1, "tau": None})
    reports = registry.replicas()
    assert [(r["replica"], r["version"], r["tau"]) for r in reports] == [("replica-b", 2, 2.5), ("replica-a", 1, None)]
    assert all(time.time() - r["reported_at"] < 60 for r in reports)
    registry.forget("replica-b")
    assert [r["replica"] for r in registry.replicas()] == ["replica-a"]

    path = registry.begin_attempt(4, "owner-1", "replica-a")
    assert [(a["owner"], a["replica"]) for a in registry.attempts(4)] == [("owner-1", "replica-a")]
    registry.end_attempt(path)
    assert registry.attempts(4) == []
