"""``specray registry list | publish | pin | unpin | rollback | status`` on a file:// registry, with
replica reports written as a poller writes them (serving/poller.py)."""

import json
import time

import pytest

from specray.pipeline.cli import main
from specray.serving.registry import OPERATOR, DrafterRegistry


def _export(path, weights: bytes):
    path.mkdir(parents=True)
    (path / "config.json").write_text('{"format_version": 1}')
    (path / "model.safetensors").write_bytes(weights)
    (path / "export.json").write_text("{}")
    return path


def _run(capsys, *argv) -> tuple[int, str, str]:
    code = main(list(argv))
    out = capsys.readouterr()
    return code, out.out, out.err


def test_publish_pin_rollback_and_status(tmp_path, capsys):
    uri = (tmp_path / "registry").as_uri()
    registry = DrafterRegistry(uri)
    for name in "abc":
        export = _export(tmp_path / name, name.encode() * 10)
        code, out, _ = _run(capsys, "registry", "publish", str(export), "--uri", uri)
        assert code == 0 and f"as version {'abc'.index(name) + 1} of {uri}" in out
    assert registry.versions() == [1, 2, 3]

    assert _run(capsys, "registry", "pin", "2", "--uri", uri, "--reason", "canary")[0] == 0
    assert registry.pinned() == 2
    code, _, err = _run(capsys, "registry", "rollback", "--uri", uri)
    assert code == 2 and "version 2 is pinned" in err and "unpin first" in err
    code, out, _ = _run(capsys, "registry", "unpin", "--uri", uri)
    assert code == 0 and "unpinned   version 2" in out and registry.pinned() is None

    code, out, _ = _run(capsys, "registry", "rollback", "--uri", uri, "--reason", "tau dropped")
    assert code == 0 and "rolled back version 3" in out and "fall back to version 2" in out
    [rejection] = registry.rejections()[3]
    assert (rejection.scope, rejection.reason) == (OPERATOR, "tau dropped")

    registry.report("replica-a", {"version": 2, "tau": 2.75, "interval_s": 10, "loading": None, "last_error": None})
    registry.report("replica-b", {"version": None, "tau": None, "interval_s": 10, "loading": 2,
                                  "last_error": "version 3 rejected: operator: tau dropped"})
    path = f"{registry.root}/replicas/replica-old.json"
    registry.report("replica-old", {"version": 1, "tau": 1.5, "interval_s": 10})
    record = json.loads(registry.fs.cat_file(path))
    registry.fs.pipe_file(path, json.dumps(record | {"reported_at": time.time() - 3600}).encode())

    code, out, _ = _run(capsys, "registry", "status", "--uri", uri)
    assert code == 0 and "newest good version 2, not pinned" in out
    lines = {line.split()[0]: line for line in out.splitlines()[2:]}
    assert lines["replica-a"].split()[1:4] == ["2", "2.750", "serving"]
    assert lines["replica-b"].split()[1:5] == ["ar", "-", "loading", "v2"] and "tau dropped" in lines["replica-b"]
    assert "gone" in lines["replica-old"]
    code, out, _ = _run(capsys, "registry", "status", "--uri", uri, "--json")
    status = json.loads(out)
    assert {r["replica"]: r["state"] for r in status["replicas"]} == {
        "replica-old": "gone", "replica-a": "serving", "replica-b": "loading v2"}

    code, out, _ = _run(capsys, "registry", "list", "--uri", uri, "--json")
    listed = {v["version"]: v for v in json.loads(out)["versions"]}
    assert listed[1]["state"] == ["good"] and listed[2]["state"] == ["served by 1"]  # replica-old is gone
    assert listed[3]["state"] == ["rejected (operator: tau dropped)"] and listed[3]["bytes"] == 10 + 2 + 21
    code, out, _ = _run(capsys, "registry", "list", "--uri", uri)
    assert code == 0 and "rejected (operator: tau dropped)" in out and str(tmp_path / "c") in out

    assert _run(capsys, "registry", "pin", "3", "--uri", uri)[0] == 0  # pinning a rolled-back version serves it
    assert registry.pinned() == 3 and registry.rejections() == {}


def test_the_registry_is_named_by_uri_or_serve_manifest(tmp_path, capsys):
    code, _, err = _run(capsys, "registry", "list")
    assert code == 2 and "--uri" in err and "-c a serve manifest" in err
    manifest = tmp_path / "serve.yaml"
    manifest.write_text(f"registry:\n  uri: {tmp_path / 'from-manifest'}\n")
    code, out, _ = _run(capsys, "registry", "publish", str(_export(tmp_path / "a", b"a")), "-c", str(manifest))
    assert code == 0 and DrafterRegistry(str(tmp_path / "from-manifest")).versions() == [1]
    manifest.write_text("registry:\n  uri: null\n")
    code, _, err = _run(capsys, "registry", "list", "-c", str(manifest))
    assert code == 2 and "has no registry.uri" in err
    code, _, err = _run(capsys, "registry", "pin", "4", "--uri", str(tmp_path / "from-manifest"))
    assert code == 2 and "no complete version 4 to pin; it has [1]" in err


@pytest.mark.parametrize("argv", [["rollback"], ["unpin"]])
def test_an_empty_registry(tmp_path, capsys, argv):
    code, out, err = _run(capsys, "registry", *argv, "--uri", str(tmp_path / "empty"))
    if argv == ["rollback"]:
        assert code == 2 and "no version to roll back" in err
    else:
        assert code == 0 and "nothing was pinned" in out
