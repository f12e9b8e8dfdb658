"""A fresh run replaces only its own run dir (pipeline/jobs/rundir.py): never the runs root, one of its
parents or the home directory, never a directory holding other runs, even when it carries a marker."""

from pathlib import Path

import pytest

from specray.pipeline.jobs.rundir import MARKER, fresh_run_dir


def _run(path: Path, *files: str) -> Path:
    """A run dir a pipeline made, with some of its files."""
    path.mkdir(parents=True, exist_ok=True)
    (path / MARKER).write_text("")
    for name in files:
        (path / name).parent.mkdir(parents=True, exist_ok=True)
        (path / name).write_text(name)
    return path


@pytest.fixture
def in_tmp(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    return tmp_path


def test_a_rerun_replaces_its_own_run_dir(in_tmp):
    run = _run(Path("runs/a"), "report.json", "train/checkpoint-1/state")
    fresh_run_dir(run)
    assert sorted(p.name for p in run.iterdir()) == [MARKER]


@pytest.mark.parametrize("where", ["runs", "runs/other/..", ".", "runs/.."])
def test_the_runs_root_and_its_parents_are_never_deleted(in_tmp, where):
    """An earlier ``name: ""`` run (before names were checked) left a marker in runs/ itself."""
    _run(Path("runs"))
    _run(Path("."))
    other = _run(Path("runs/other"), "train/checkpoint-1/state")
    with pytest.raises(FileExistsError, match=r"is the runs root, one of its parents or the home directory.*name=NAME"):
        fresh_run_dir(Path(where))
    assert (other / "train/checkpoint-1/state").read_text() == "train/checkpoint-1/state"


def test_the_home_directory_is_never_deleted(in_tmp):
    home = _run(in_tmp / "home", "notes.txt")
    with pytest.raises(FileExistsError, match="home directory"):
        fresh_run_dir(home)
    assert (home / "notes.txt").exists()


def test_a_dir_holding_other_runs_is_never_deleted(in_tmp):
    """``output.run_dir`` set to the parent of other runs (outside runs/), even one that carries a marker."""
    shared = _run(in_tmp / "experiments", "report.json")
    first = _run(shared / "first", "report.json")
    _run(shared / "deep" / "er" / "second")
    with pytest.raises(FileExistsError, match=rf"holds other pipeline runs \({shared}/deep/er/second, {first}\)"):
        fresh_run_dir(shared)
    assert (first / "report.json").exists() and (shared / "report.json").exists()


def test_the_closed_loops_own_sub_runs_are_replaced_with_it(in_tmp):
    from specray.pipeline.jobs.closed_loop import SUB_RUNS

    loop = _run(Path("runs/loop"), "report.json")
    _run(loop / "initial", "exports/final/model.safetensors")
    _run(loop / "iterations" / "0001", "report.json")
    fresh_run_dir(loop, sub_runs=SUB_RUNS)
    assert sorted(p.name for p in loop.iterdir()) == [MARKER]
    _run(loop / "initial")
    stray = _run(loop / "exports" / "someone-else")
    with pytest.raises(FileExistsError, match=rf"holds other pipeline runs \({stray.resolve()}\)"):
        fresh_run_dir(loop, sub_runs=SUB_RUNS)
    assert (loop / "initial" / MARKER).exists()
