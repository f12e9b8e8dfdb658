"""The trainer gang's checkpoints: checked against the ledger on resume, not trusted by their name;
offline crash recovery around a checkpoint (Ray Train restarts the group).

Offline runs train 1 rank (micro_batch 1, 2 accumulation steps) on a manifest of 6 debug
samples for 6 steps, a checkpoint every 2 steps. The straight run of that configuration is made
once per module; a crash run must end with the same model, bit for bit (the loader order is a
pure function of the position, and the RNG and optimizer state ride in the checkpoint).
"""

import shutil
from types import SimpleNamespace

import pytest
import torch

from specray.actors.trainer import CheckpointMismatchError, FaultPlan, run_trainer_gang
from specray.trainer.checkpoint import load_checkpoint
from specray.trainer.ledger import Ledger

from gang_support import TIMEOUT_S, offline_manifest, train_spec

pytestmark = pytest.mark.ray

STEPS = 6


@pytest.fixture(autouse=True)
def _prompt_ray_train(monkeypatch):
    # Ray Train polls its workers every 2 s by default; reports and failure detection wait for it.
    monkeypatch.setenv("RAY_TRAIN_HEALTH_CHECK_INTERVAL_S", "0.2")


@pytest.fixture(scope="module")
def straight(ray_cluster, debug_target, tmp_path_factory):
    """The manifest and an uninterrupted run of STEPS steps (name ``straight`` under ``root/ray``)."""
    root = tmp_path_factory.mktemp("offline")
    manifest = offline_manifest(root, debug_target)
    spec = train_spec(root, "straight", f"data.manifest={manifest}", f"optim.total_steps={STEPS}")
    result = run_trainer_gang(spec, num_workers=1, storage_path=str(root / "ray"), timeout_s=TIMEOUT_S)
    assert result.step == STEPS and len(result.attempts) == 1
    return SimpleNamespace(root=root, manifest=manifest, result=result, model=load_checkpoint(result.checkpoint).model)


@pytest.mark.parametrize("point", ["after_report", "after_checkpointed"])
def test_an_offline_crash_at_a_checkpoint_resumes_to_the_same_model(straight, tmp_path, point):
    """Rank 0 dies at checkpoint 4 between Ray Train's report and the ``checkpointed`` txn, or right after it."""
    plan = FaultPlan(point=point, step=4, marker=str(tmp_path / "crashed"))
    spec = train_spec(tmp_path, "crash", f"data.manifest={straight.manifest}", f"optim.total_steps={STEPS}")
    result = run_trainer_gang(spec, num_workers=1, storage_path=str(tmp_path / "ray"), fault=plan, max_failures=1,
                              timeout_s=TIMEOUT_S)
    assert (tmp_path / "crashed").exists()  # the fault fired once
    assert result.step == STEPS and [r["step"] for r in result.metrics] == list(range(1, STEPS + 1))
    parents = [a["parent"] for a in result.attempts]
    # After the txn the ledger names checkpoint 4; after the report only Ray Train may know it (it
    # registers reports asynchronously), so the restart resumes from checkpoint 4 or from 2.
    resumable = [{"attempt": 0, "step": 4}] if point == "after_checkpointed" else [{"attempt": 0, "step": s} for s in (2, 4)]
    assert parents[0] is None and parents[1] in resumable and len(parents) == 2
    checkpoints = {(c["attempt"], c["step"]) for c in Ledger(result.ledger_uri).replay().checkpoints}
    assert (parents[1]["attempt"], parents[1]["step"]) in checkpoints and (1, STEPS) in checkpoints
    model = load_checkpoint(result.checkpoint).model
    assert model.keys() == straight.model.keys()
    assert all(torch.equal(model[name], value) for name, value in straight.model.items())


def test_a_checkpoint_is_checked_against_the_ledger_not_trusted_by_its_name(straight, tmp_path):
    """A rerun of the straight run whose newest checkpoint directory was replaced by an older one (restored after).

    (Other mismatches, e.g. a checkpoint of another ledger: tests/actors/test_gang_recovery.py.)
    """
    storage, ledger = straight.root / "ray", Ledger(straight.result.ledger_uri)
    spec = train_spec(straight.root, "straight", f"data.manifest={straight.manifest}", f"optim.total_steps={STEPS + 2}")
    newest, older = storage / "straight" / "checkpoint-a000-s00000006", storage / "straight" / "checkpoint-a000-s00000004"
    count = ledger.count()
    backup = tmp_path / "newest"
    shutil.move(newest, backup)
    shutil.copytree(older, newest)  # the name says step 6; the directory holds step 4
    try:
        with pytest.raises(CheckpointMismatchError, match=r"checkpoint-a000-s00000006 is resumed as attempt 0 step 6 of "
                                                          r"the ledger .*, but it holds step 4 saved at ledger position "
                                                          r".*'attempt': 0, 'step': 4\}: the directory was replaced"):
            run_trainer_gang(spec, num_workers=1, storage_path=str(storage), max_failures=1, timeout_s=TIMEOUT_S)
    finally:
        shutil.rmtree(newest)
        shutil.move(backup, newest)
    assert ledger.count() == count  # refused before anything was written, and without a restart
