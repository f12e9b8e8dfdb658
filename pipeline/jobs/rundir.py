"""A pipeline's run dir (``runs/<name>/`` by default): what both pipeline drivers own and replace.

A run dir a pipeline made carries ``MARKER``; only such a dir is ever deleted, by a fresh rerun
of the same name (``fresh_run_dir``). ``resumable_run_dir`` is the one ``--resume`` continues in.
A run's ``name`` is one path component (``pipeline/config.py`` ``RunName``), so ``runs/<name>``
is always one directory below ``RUNS_ROOT``. As a second line of defence a fresh run never
deletes the runs root, one of its ancestors or the home directory, nor a directory holding
another run's ``MARKER`` (a run dir is never the parent of other runs, except the sub-runs its
driver declares: the closed loop's ``initial/`` and ``iterations/``).
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

MARKER = ".specray-pipeline"
RUNS_ROOT = Path("runs")  # relative to the working directory: runs/<name> is a job's default run dir


def fresh_run_dir(run_dir: Path, refuse: list[str] = (), sub_runs: tuple[str, ...] = ()) -> Path:
    """A pipeline owns its run dir: a rerun replaces it. Only a dir a pipeline made is ever deleted.

    ``refuse`` lists an earlier run's state outside the run dir (``_earlier_run``): a rerun
    cannot replace it, so a fresh run with it is refused, before anything is deleted.
    ``sub_runs`` names the subdirectories where this driver's own runs live (their markers are
    this run's); a marker anywhere else below ``run_dir`` is another run's, and nothing is deleted.
    """
    if refuse:
        raise FileExistsError(
            f"a fresh run would continue an earlier one: {'; '.join(refuse)}. These lie outside the run dir "
            f"{run_dir}, so a rerun does not replace them. Continue that run with `specray pipeline run --resume "
            "MANIFEST`, or start a new one under a new name (name=...) or with new train.storage / online.ledger"
        )
    if run_dir.exists() and any(run_dir.iterdir()):
        if not (run_dir / MARKER).exists():
            raise FileExistsError(f"{run_dir} exists and was not made by specray pipeline; set output.run_dir "
                                  f"to a new or empty directory (a pipeline rerun replaces its own run dir)")
        _check_deletable(run_dir, sub_runs)
        shutil.rmtree(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / MARKER).write_text("this directory is replaced by the next `specray pipeline run` of the same name\n")
    return run_dir


def _check_deletable(run_dir: Path, sub_runs: tuple[str, ...]) -> None:
    """Refuse to delete a directory that holds more than this run (module docstring)."""
    resolved = run_dir.resolve()
    root = RUNS_ROOT.resolve()
    shared = {root, *root.parents, Path.home().resolve(), *Path.home().resolve().parents}
    if resolved in shared:
        raise FileExistsError(
            f"{run_dir} (= {resolved}) is the runs root, one of its parents or the home directory, and a fresh run "
            "deletes its run dir: give the run its own directory (name=NAME, or output.run_dir=runs/NAME)")
    own = [resolved / sub for sub in sub_runs]
    others = []
    for parent, dirs, files in os.walk(resolved):
        here = Path(parent)
        dirs[:] = [d for d in dirs if here / d not in own]  # the driver's own sub-runs
        if MARKER in files and here != resolved:
            others.append(str(here))
            dirs[:] = []
    if others:
        shown = ", ".join(sorted(others)[:3]) + (f" and {len(others) - 3} more" if len(others) > 3 else "")
        raise FileExistsError(
            f"{run_dir} holds other pipeline runs ({shown}) and a fresh run deletes its run dir with everything in "
            "it: give this run its own directory (name=NAME, or output.run_dir=runs/NAME), or move those runs out")


def resumable_run_dir(run_dir: Path) -> Path:
    """``run_dir`` when a pipeline made it (``--resume`` continues there); otherwise the fix."""
    if not (run_dir / MARKER).exists():
        raise FileNotFoundError(f"nothing to resume: {run_dir} is not a pipeline run dir (no {MARKER}); run "
                                "without --resume to start the run")
    return run_dir
