"""``check_position``: a gang checkpoint is resumed only if it holds the ledger position its name and
the ledger claim (without Ray; tests/actors/test_gang_checkpoints.py runs it in the gang)."""

import pytest
import torch

from specray.actors.gang_recovery import CheckpointMismatchError, Resume, check_position
from specray.trainer.checkpoint import capture_rng_state, save_checkpoint

LEDGER = "s3://bucket/run/ledger"


def _checkpoint(directory, step: int, ledger: dict | None) -> str:
    """What the gang's rank 0 hands Ray Train: a directory holding one step dir and ``latest``."""
    extra = {} if ledger is None else {"ledger": ledger}
    save_checkpoint(directory, step, model={"w": torch.zeros(2)}, optimizer={}, scheduler={}, loader={},
                    rng=capture_rng_state(), extra=extra)
    return str(directory)


def test_the_recorded_position_of_the_resume_point_is_accepted(tmp_path):
    directory = _checkpoint(tmp_path / "c", 4, {"uri": LEDGER, "attempt": 1, "step": 4})
    check_position(directory, Resume((1, 4), "run/checkpoint-a001-s00000004", LEDGER))
    check_position(directory, Resume((1, 4), "resume_from", None))  # resume_from: trained under any ledger


@pytest.mark.parametrize("resume", [
    pytest.param(Resume((1, 4), "loc", "s3://bucket/other/ledger"), id="another-ledger"),
    pytest.param(Resume((0, 4), "loc", LEDGER), id="another-attempt"),
    pytest.param(Resume((1, 6), "loc", LEDGER), id="another-step"),
])
def test_another_position_is_refused(tmp_path, resume):
    directory = _checkpoint(tmp_path / "c", 4, {"uri": LEDGER, "attempt": 1, "step": 4})
    with pytest.raises(CheckpointMismatchError, match=r"^checkpoint loc is resumed as attempt \d step \d of the ledger "
                                                      r".*, but it holds step 4 saved at ledger position \{'uri': "):
        check_position(directory, resume)


def test_a_directory_without_its_position_or_a_checkpoint_is_refused(tmp_path):
    with pytest.raises(CheckpointMismatchError, match=r"holds step 4 saved at ledger position None"):
        check_position(_checkpoint(tmp_path / "c", 4, None), Resume((0, 4), "loc", LEDGER))
    (tmp_path / "empty").mkdir()
    with pytest.raises(CheckpointMismatchError, match="loc holds no training checkpoint"):
        check_position(str(tmp_path / "empty"), Resume((0, 4), "loc", LEDGER))
