"""The gang's resume point without Ray: ``check_position`` accepts a directory only if it holds the ledger
position its resume point claims; ``resume_from`` is this ledger's checkpoint (a parent), or another
ledger's starting a stream (an origin), refused once the ledger holds checkpoints of its own.
(tests/actors/test_gang_checkpoints.py and test_gang_resume.py run them in the gang.)"""

import pytest
import torch

from specray.actors.gang_recovery import (AttemptPlanner, CheckpointMismatchError, Resume, check_position,
                                          checkpoint_name, recorded_position)
from specray.trainer.checkpoint import capture_rng_state, save_checkpoint
from specray.trainer.ledger import Ledger

LEDGER = "s3://bucket/run/ledger"


def _checkpoint(directory, step: int, ledger: dict | None) -> str:
    """What the gang's rank 0 hands Ray Train: a directory holding one step dir and ``latest``."""
    extra = {} if ledger is None else {"ledger": ledger}
    save_checkpoint(directory, step, model={"w": torch.zeros(2)}, optimizer={}, scheduler={}, loader={},
                    rng=capture_rng_state(), extra=extra)
    return str(directory)


def test_the_recorded_position_of_the_resume_point_is_accepted(tmp_path):
    position = {"uri": LEDGER, "attempt": 1, "step": 4}
    directory = _checkpoint(tmp_path / "c", 4, position)
    check_position(directory, Resume((1, 4), "run/checkpoint-a001-s00000004", position))
    origin = {"ledger": LEDGER, "attempt": 1, "step": 4, "location": "run/checkpoint-a001-s00000004"}
    check_position(directory, Resume(None, "run/checkpoint-a001-s00000004", position, origin))  # starts a stream
    assert recorded_position(directory) == (4, position)


@pytest.mark.parametrize("resume", [
    pytest.param(Resume((1, 4), "loc", {"uri": "s3://bucket/other/ledger", "attempt": 1, "step": 4}), id="another-ledger"),
    pytest.param(Resume((0, 4), "loc", {"uri": LEDGER, "attempt": 0, "step": 4}), id="another-attempt"),
    pytest.param(Resume((1, 6), "loc", {"uri": LEDGER, "attempt": 1, "step": 6}), id="another-step"),
])
def test_another_position_is_refused(tmp_path, resume):
    directory = _checkpoint(tmp_path / "c", 4, {"uri": LEDGER, "attempt": 1, "step": 4})
    with pytest.raises(CheckpointMismatchError, match=r"^checkpoint loc is resumed as attempt \d step \d of the ledger "
                                                      r".*, but it holds step 4 saved at ledger position \{'uri': "):
        check_position(directory, resume)


def test_a_directory_without_its_position_or_a_checkpoint_is_refused(tmp_path):
    with pytest.raises(CheckpointMismatchError, match=r"holds step 4 saved at ledger position None"):
        check_position(_checkpoint(tmp_path / "c", 4, None), Resume((0, 4), "loc", {"uri": LEDGER, "attempt": 0, "step": 4}))
    (tmp_path / "empty").mkdir()
    with pytest.raises(CheckpointMismatchError, match="loc holds no training checkpoint"):
        check_position(str(tmp_path / "empty"), Resume((0, 4), "loc", {"uri": LEDGER, "attempt": 0, "step": 4}))
    with pytest.raises(CheckpointMismatchError, match="holds no training checkpoint"):
        recorded_position(str(tmp_path / "empty"))


# -- resume_from ------------------------------------------------------------------------------


def _gang_checkpoint(root, ledger_uri: str, attempt: int, step: int) -> str:
    """A gang checkpoint directory of ``ledger_uri``'s (attempt, step), as Ray Train stores it."""
    location = root / checkpoint_name(attempt, step)
    return _checkpoint(location, step, {"uri": ledger_uri, "attempt": attempt, "step": step})


def _trained(ledger: Ledger, steps: int) -> None:
    """Offline attempt 0 (no windows) checkpoints at ``steps``."""
    ledger.attempt(0, parent=None, world_size=1, quantum=2, checkpoint=None, run="run-a")
    ledger.checkpointed(0, steps, f"run-a/{checkpoint_name(0, steps)}")


def _planner(ledger: Ledger, resume_from: str) -> AttemptPlanner:
    return AttemptPlanner(ledger, run_uri="run-b", resume_from=resume_from)


def test_another_ledgers_checkpoint_starts_a_fresh_stream_as_its_origin(tmp_path):
    other = str(tmp_path / "other-ledger")
    location = _gang_checkpoint(tmp_path / "other-run", other, 2, 6)
    ledger = Ledger(str(tmp_path / "ledger"))
    planner = _planner(ledger, location)
    resume = planner.choose(None)
    assert resume == Resume(None, location, {"uri": other, "attempt": 2, "step": 6},
                            {"ledger": other, "attempt": 2, "step": 6, "location": location})
    assert resume.step == 6
    assert planner.write(resume, world_size=1, quantum=2) == 0
    state = ledger.replay()
    assert state.attempts[0]["origin"] == resume.origin and state.attempts[0]["parent"] is None
    ledger.dispatched(0, 7, "w7", [])  # the stream counts on from the origin's step
    assert planner.total_steps(resume, stream_samples=5, quantum=2) == 6 + 3


def test_another_ledgers_checkpoint_is_refused_once_the_ledger_holds_checkpoints(tmp_path):
    location = _gang_checkpoint(tmp_path / "other-run", str(tmp_path / "other-ledger"), 0, 3)
    ledger = Ledger(str(tmp_path / "ledger"))
    _trained(ledger, 4)
    count = ledger.count()
    with pytest.raises(CheckpointMismatchError, match=r"resume_from=.*checkpoint-a000-s00000003 was saved under the "
                                                      r"ledger .*other-ledger \(attempt 0, step 3\), not this run's "
                                                      r"ledger .*, which holds checkpoints of its own stream \(the "
                                                      r"newest: attempt 0 step 4, .*a fresh ledger"):
        _planner(ledger, location).choose(None)
    assert ledger.count() == count  # nothing appended: the ledger still replays
    assert ledger.replay().last_checkpoint()["step"] == 4


def test_this_ledgers_checkpoint_is_resumed_as_a_parent_if_the_ledger_describes_it(tmp_path):
    uri = str(tmp_path / "ledger")
    ledger = Ledger(uri)
    _trained(ledger, 4)
    location = _gang_checkpoint(tmp_path / "run-a", uri, 0, 4)
    resume = _planner(ledger, location).choose(None)
    assert resume == Resume((0, 4), location, {"uri": uri, "attempt": 0, "step": 4})
    same = _gang_checkpoint(tmp_path / "copy", (tmp_path / "ledger").as_uri(), 0, 4)  # the ledger as a file:// URI
    assert _planner(ledger, same).choose(None).parent == (0, 4)
    unknown = _gang_checkpoint(tmp_path / "run-x", uri, 3, 8)  # a position this ledger never had
    with pytest.raises(CheckpointMismatchError, match=r"saved at attempt 3 step 8 of this run's ledger .*, but the "
                                                      r"ledger does not describe that model: attempt 3 has no attempt txn"):
        _planner(ledger, unknown).choose(None)


def test_a_checkpoint_without_a_ledger_position_or_with_a_replaced_directory_is_refused(tmp_path):
    ledger = Ledger(str(tmp_path / "ledger"))
    plain = _checkpoint(tmp_path / "plain", 5, None)  # e.g. specray train's
    with pytest.raises(CheckpointMismatchError, match=r"holds step 5 saved at ledger position None: it is not a "
                                                      r"checkpoint of the trainer gang"):
        _planner(ledger, plain).choose(None)
    replaced = tmp_path / "run" / checkpoint_name(0, 6)
    _checkpoint(replaced, 4, {"uri": "other", "attempt": 0, "step": 4})
    with pytest.raises(CheckpointMismatchError, match=r"is named after attempt 0 step 6 but holds attempt 0 step 4"):
        _planner(ledger, str(replaced)).choose(None)
