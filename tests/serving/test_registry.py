"""DrafterRegistry on file:// and s3:// (SeaweedFS): monotonic versions, a version is visible only
once complete, pulls are local copies; and the poller hands new versions to the engine."""

from concurrent.futures import Future

import pytest

from specray.serving.registry import MARKER, DrafterRegistry, RegistryPoller


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
