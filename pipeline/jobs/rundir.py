"""A pipeline's run dir (``runs/<name>/`` by default): what both pipeline drivers own and replace.

A run dir a pipeline made carries ``MARKER``; only such a dir is ever deleted, by a fresh rerun
of the same name (``fresh_run_dir``). ``resumable_run_dir`` is the one ``--resume`` continues in.
"""

from __future__ import annotations

import shutil
from pathlib import Path

MARKER = ".specray-pipeline"


def fresh_run_dir(run_dir: Path, refuse: list[str] = ()) -> Path:
    """A pipeline owns its run dir: a rerun replaces it. Only a dir a pipeline made is ever deleted.

    ``refuse`` lists an earlier run's state outside the run dir (``_earlier_run``): a rerun
    cannot replace it, so a fresh run with it is refused, before anything is deleted.
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
        shutil.rmtree(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / MARKER).write_text("this directory is replaced by the next `specray pipeline run` of the same name\n")
    return run_dir


def resumable_run_dir(run_dir: Path) -> Path:
    """``run_dir`` when a pipeline made it (``--resume`` continues there); otherwise the fix."""
    if not (run_dir / MARKER).exists():
        raise FileNotFoundError(f"nothing to resume: {run_dir} is not a pipeline run dir (no {MARKER}); run "
                                "without --resume to start the run")
    return run_dir
