"""The trainer gang on Ray Train: the crash matrix of DESIGN.md §4, a world-size change, offline export,
and the errors that end it without a restart (a failed stream, a corrupt feature nobody re-captures).

Online runs use ``gang_support.Stream`` (18 samples, Q = 4, windows 4/4/4/4/2, a checkpoint
every 2 steps, at most 8 features stored). Each crash test kills a worker once (``FaultPlan``),
lets Ray Train restart the group, and then audits the ledger: every sample trained exactly
once in the final model's lineage, none missing, no feature left in the store.
"""

import json

import pytest
import torch

from specray.actors.broker import StreamFailedError, start_sample_broker
from specray.actors.trainer import FaultPlan, FeaturesLostError, GangFailedError, run_trainer_gang, split_window
from specray.capture.contract import ContractMismatchError, build_contract
from specray.capture.store import FeatureStore, read_manifest
from specray.drafters.format import load_drafter
from specray.trainer.checkpoint import load_checkpoint
from specray.trainer.export import export_checkpoint
from specray.trainer.ledger import Ledger

from gang_support import TIMEOUT_S, Stream, contract_of, offline_manifest, train_spec
from tracking_support import mlflow_metrics, tensorboard_scalars, wandb_history

pytestmark = pytest.mark.ray


@pytest.fixture(autouse=True)
def _prompt_ray_train(monkeypatch):
    # Ray Train polls its workers every 2 s by default; reports and failure detection wait for it.
    monkeypatch.setenv("RAY_TRAIN_HEALTH_CHECK_INTERVAL_S", "0.2")


@pytest.fixture
def stream(ray_cluster, debug_target, tmp_path):
    stream = Stream(tmp_path, debug_target)
    yield stream
    stream.close()


@pytest.mark.parametrize("fault", [
    pytest.param(dict(point="mid_window", step=3, rank=1, after=1), id="mid-window"),
    pytest.param(dict(point="after_step_before_checkpoint", step=4, rank=0), id="after-step-before-checkpoint"),
    pytest.param(dict(point="during_delete", step=2, rank=0, after=3), id="during-delete"),
])
def test_a_crash_is_recovered_with_every_sample_trained_exactly_once(stream, tmp_path, fault):
    plan = FaultPlan(marker=str(tmp_path / "crashed"), **fault)
    result = run_trainer_gang(train_spec(tmp_path, "crash"), num_workers=2, storage_path=str(tmp_path / "ray"),
                              broker=stream.broker, fault=plan, max_failures=1, timeout_s=TIMEOUT_S)
    assert (tmp_path / "crashed").exists()  # the fault fired once
    stream.finish(result)
    assert [a["parent"] for a in result.attempts] == [None, {"attempt": 0, "step": 2}]
    assert result.step == 5  # windows 4, 4, 4, 4 and the final 2
    assert [r["step"] for r in result.metrics] == [1, 2, 3, 4, 5]
    assert [r["attempt"] for r in result.metrics] == [0, 0, 1, 1, 1]
    assert load_checkpoint(result.checkpoint).step == 5


def test_resume_with_a_smaller_gang_resplits_the_windows(stream, tmp_path):
    cfg = train_spec(tmp_path, "shrink")
    plan = FaultPlan(point="after_step_before_checkpoint", step=3, rank=1, marker=str(tmp_path / "crashed"))
    with pytest.raises(GangFailedError, match="rerun with the same storage_path and name to resume"):
        run_trainer_gang(cfg, num_workers=2, storage_path=str(tmp_path / "ray"), broker=stream.broker, fault=plan,
                         max_failures=0, timeout_s=TIMEOUT_S)
    result = run_trainer_gang(cfg, num_workers=1, storage_path=str(tmp_path / "ray"), broker=stream.broker,
                              max_failures=0, timeout_s=TIMEOUT_S)
    stream.finish(result)
    assert [(a["world_size"], a["quantum"], a["parent"]) for a in result.attempts] == [
        (2, 4, None), (1, 2, {"attempt": 0, "step": 2})]
    assert result.step == 2 + 5  # 8 samples in 2 steps of Q = 4, then 10 in 5 steps of Q = 2


def test_a_failed_stream_ends_every_rank_at_once_without_a_restart(ray_cluster, debug_target, tmp_path):
    """The producer fails after 10 samples: windows 1-2 train, every rank gets the failure at step 3."""
    stream = Stream(tmp_path, debug_target, fail_after=10)
    try:
        with pytest.raises(StreamFailedError, match=r"^the feature stream failed: RuntimeError: injected: capture "
                                                    r"batch failed$"):
            run_trainer_gang(train_spec(tmp_path, "failed"), num_workers=2, storage_path=str(tmp_path / "ray"),
                             broker=stream.broker, max_failures=1, timeout_s=TIMEOUT_S)
        stream.producer.check()
    finally:
        stream.close()
    state = Ledger(str(tmp_path / "ray" / "failed" / "ledger")).replay()
    assert list(state.attempts) == [0]  # one worker-group start: Ray Train did not restart the gang
    assert [t["step"] for t in state.trained[0]] == [1, 2]
    assert [(c["attempt"], c["step"]) for c in state.checkpoints] == [(0, 2)]  # no checkpoint after the failure


@pytest.mark.parametrize("recapture", [True, False], ids=["captured-again", "no-recapture"])
def test_a_corrupt_feature_is_captured_again_or_ends_the_gang(ray_cluster, debug_target, tmp_path, recapture):
    """Sample s005 (window 2, rank 0) is corrupt in the store: never trained on, never a restart loop."""
    stream = Stream(tmp_path, debug_target, corrupt={"s005"}, recapture=recapture)
    spec = train_spec(tmp_path, "corrupt")
    try:
        if recapture:  # reported like a lost feature, captured again bit for bit, trained as dispatched
            result = run_trainer_gang(spec, num_workers=2, storage_path=str(tmp_path / "ray"), broker=stream.broker,
                                      max_failures=1, timeout_s=TIMEOUT_S)
            stream.finish(result)
            assert stream.producer.recaptured == ["s005"]
            assert len(result.attempts) == 1 and result.step == 5
            return
        with pytest.raises(FeaturesLostError, match=r"step 2: the feature blobs of 1 dispatched samples are corrupt: "
                                                    r"their bytes do not match .*s005.*no producer of this stream"):
            run_trainer_gang(spec, num_workers=2, storage_path=str(tmp_path / "ray"), broker=stream.broker,
                             max_failures=1, timeout_s=TIMEOUT_S)
    finally:
        stream.close()
    assert list(Ledger(str(tmp_path / "ray" / "corrupt" / "ledger")).replay().attempts) == [0]


def test_the_gang_refuses_a_stream_it_would_deadlock_on(ray_cluster, debug_target, tmp_path):
    import ray

    cfg = train_spec(tmp_path, "refused")
    uri = (tmp_path / "features").as_uri()
    small = start_sample_broker(4, max_inflight=6, contract=contract_of(debug_target), store_uri=uri)
    fix = r"needs Q × trainer.checkpoint_every = 4 × 2 = 8 in flight. Raise max_inflight to >= 8"
    with pytest.raises(ValueError, match=fix):
        run_trainer_gang(cfg, num_workers=2, storage_path=str(tmp_path / "ray"), broker=small)
    anonymous = start_sample_broker(4, max_inflight=8)
    with pytest.raises(ValueError, match="started without contract= and store_uri="):
        run_trainer_gang(cfg, num_workers=2, storage_path=str(tmp_path / "ray"), broker=anonymous)
    with pytest.raises(ValueError, match="give exactly one feature source"):
        run_trainer_gang(cfg, num_workers=2, storage_path=str(tmp_path / "ray"))
    eagle3 = build_contract("eagle3", target_fingerprint=debug_target.target_fingerprint,
                            template_fingerprint=debug_target.template_fingerprint,
                            num_target_layers=debug_target.num_layers, hidden_size=debug_target.hidden_size)
    other = start_sample_broker(4, max_inflight=8, contract=eagle3, store_uri=uri)
    with pytest.raises(ContractMismatchError, match=r"drafter\.algorithm=dflash needs features captured with "
                                                    r"capture\.algorithm=dflash \(got eagle3 in the SampleBroker's stream\)"):
        run_trainer_gang(cfg, num_workers=2, storage_path=str(tmp_path / "ray"), broker=other)
    for broker in (small, anonymous, other):
        ray.kill(broker)


def test_split_window_deals_whole_and_partial_windows_over_the_slots():
    refs = [f"r{i}" for i in range(8)]
    assert split_window(refs, 4) == [["r0", "r1"], ["r2", "r3"], ["r4", "r5"], ["r6", "r7"]]  # Q = 4 slots × 2
    assert [len(s) for s in split_window(refs[:5], 4)] == [1, 1, 1, 2]
    assert split_window(refs[:3], 4) == [[], ["r0"], ["r1"], ["r2"]]  # the empty slot trains a masked filler
    assert sum(split_window(refs[:7], 6), []) == refs[:7]  # contiguous, in window order


def test_offline_manifest_run_exports_a_loadable_drafter(ray_cluster, debug_target, tmp_path):
    manifest = offline_manifest(tmp_path, debug_target)
    refs, store_uri, contract = read_manifest(manifest).refs, (tmp_path / "features").as_uri(), contract_of(debug_target)
    tracking = tmp_path / "tracking"
    cfg = train_spec(tmp_path, "offline", f"data.manifest={manifest}", "optim.total_steps=4", "optim.accumulation_steps=1",
                     "live_eval.enabled=true", "live_eval.num_prompts=2", "live_eval.max_tokens=6",
                     f"tracking.tensorboard={tracking / 'tb'}", "tracking.wandb.project=gang", "tracking.wandb.mode=offline",
                     f"tracking.wandb.dir={tracking / 'wandb'}", f"tracking.mlflow.uri=file:{tracking / 'mlruns'}")
    pushed = []
    result = run_trainer_gang(cfg, num_workers=2, storage_path=str(tmp_path / "ray"), timeout_s=TIMEOUT_S,
                              on_record=pushed.append)
    assert result.step == 4 and [r["step"] for r in result.metrics] == [1, 2, 3, 4]
    # rank 0 measured live acceptance at both checkpoints (steps 2, 4) and the driver received every record
    assert [r["step"] for r in result.metrics if "tau_live" in r] == [2, 4]
    assert all(r["tau_live"] >= 1.0 and len(r["live_accept_by_pos"]) == 7 and r["live_prompts"] == 2
               for r in result.metrics if "tau_live" in r)
    assert [r["step"] for r in pushed] == [1, 2, 2, 3, 4, 4]  # a checkpoint's record again, with its live fields
    assert pushed[2] == result.metrics[1] and pushed[-1] == result.metrics[-1]
    # rank 0 logged every record to each tracker, the checkpoints' live fields included
    for logged in (tensorboard_scalars(tracking / "tb"), wandb_history(tracking / "wandb"),
                   mlflow_metrics((tracking / "mlruns").as_uri(), "specray")):
        assert logged["loss"] == pytest.approx({r["step"]: r["loss"] for r in result.metrics})
        assert logged["acc_by_pos/1"] == pytest.approx({r["step"]: r["acc_by_pos"][0] for r in result.metrics})
        assert logged["tau_live"] == pytest.approx({r["step"]: r["tau_live"] for r in result.metrics if "tau_live" in r})
    assert len(result.attempts) == 1
    assert all(FeatureStore(store_uri).exists(r.key) for r in refs)  # manifests are immutable: nothing deleted

    out = export_checkpoint(result.checkpoint, tmp_path / "export")
    drafter = load_drafter(out, embed_tokens=debug_target.model.model.embed_tokens, lm_head=debug_target.model.lm_head,
                           target_fingerprint=debug_target.target_fingerprint,
                           template_fingerprint=debug_target.template_fingerprint,
                           contract=json.loads(contract.to_json()))
    trained = load_checkpoint(result.checkpoint).model
    loaded = drafter.state_dict()
    assert trained and all(torch.equal(loaded[name], value) for name, value in trained.items())
