"""The trainer gang on Ray Train: the crash matrix of DESIGN.md §4, a world-size change, offline export.

Online runs stream 18 debug-target samples (captured in this process by a producer thread
through the broker, with backpressure) into a 2-rank gang with micro_batch 1 and 2
accumulation steps: Q = 4, windows 4/4/4/4/2, a checkpoint every 2 steps, and at most
Q × checkpoint_every = 8 features stored at once. Each crash test kills a worker once
(``FaultPlan``), lets Ray Train restart the group, and then audits the ledger: every sample
trained exactly once in the final model's lineage, none missing, no feature left in the store.
"""

import json
import threading

import pytest
import torch

from specray.actors.broker import start_sample_broker
from specray.actors.trainer import FaultPlan, GangFailedError, run_trainer_gang, split_window
from specray.capture.contract import ContractMismatchError, build_contract
from specray.capture.data import RenderedSample
from specray.capture.server import CaptureServer
from specray.capture.store import FeatureStore, write_manifest
from specray.drafters.format import load_drafter
from specray.pipeline.config import TrainJobConfig, load_config
from specray.trainer.assembly import TrainSpec
from specray.trainer.checkpoint import load_checkpoint
from specray.trainer.export import export_checkpoint
from specray.trainer.ledger import Ledger, audit

pytestmark = pytest.mark.ray

NUM_SAMPLES = 18
MAX_INFLIGHT = 8  # Q × checkpoint_every for 2 ranks
TIMEOUT_S = 300


@pytest.fixture(autouse=True)
def _prompt_ray_train(monkeypatch):
    # Ray Train polls its workers every 2 s by default; reports and failure detection wait for it.
    monkeypatch.setenv("RAY_TRAIN_HEALTH_CHECK_INTERVAL_S", "0.2")


def _samples(prefix: str, n: int, vocab_size: int) -> list[RenderedSample]:
    generator = torch.Generator().manual_seed(0)
    samples = []
    for i in range(n):
        length = 24 + (7 * i) % 17
        loss_mask = torch.zeros(length, dtype=torch.bool)
        loss_mask[length // 3:] = True
        input_ids = torch.randint(3, vocab_size, (length,), generator=generator)
        samples.append(RenderedSample(f"{prefix}{i:03d}", input_ids, loss_mask, False))
    return samples


def _contract(target):
    return build_contract("dflash", target_fingerprint=target.target_fingerprint,
                          template_fingerprint=target.template_fingerprint, num_target_layers=target.num_layers,
                          hidden_size=target.hidden_size)


class _Producer(threading.Thread):
    """Captures samples in pairs: reserve room in the broker, write the blobs, offer the refs."""

    def __init__(self, broker, server: CaptureServer, samples: list[RenderedSample]):
        super().__init__(name="test-producer", daemon=True)
        self.broker, self.server, self.samples = broker, server, samples
        self.stop = threading.Event()
        self.error: BaseException | None = None

    def run(self) -> None:
        import ray

        try:
            for start in range(0, len(self.samples), 2):
                batch = self.samples[start:start + 2]
                estimate = sum(self.server.contract.min_bytes_per_token * s.num_tokens + 4096 for s in batch)
                while not ray.get(self.broker.reserve.remote(len(batch), num_bytes=estimate, timeout=2), timeout=60):
                    if self.stop.is_set():  # backpressure until the gang frees room, or the test gave up
                        return
                refs = self.server.capture(batch)
                ray.get(self.broker.offer.remote(refs, reserved_bytes=estimate), timeout=60)
            ray.get(self.broker.close.remote(), timeout=60)
        except BaseException as e:  # noqa: BLE001 - re-raised by the test through check()
            self.error = e

    def check(self) -> None:
        self.join(timeout=60)
        assert not self.is_alive(), "the producer is still blocked"
        if self.error is not None:
            raise self.error


def _cfg(tmp_path, name: str, *overrides: str) -> TrainSpec:
    return load_config(TrainJobConfig, None, [
        f"name={name}", "target.name=debug", "data.manifest=null", f"output.run_dir={tmp_path / 'run'}",
        "optim.total_steps=100", "optim.warmup_steps=2", "optim.micro_batch_size=1", "optim.accumulation_steps=2",
        "trainer.checkpoint_every=2", "trainer.log_every=1", "trainer.keep_last=2", "objective.num_anchors=4",
        *overrides,
    ]).train_spec()


class _Stream:
    """A broker fed by a producer thread, over a file:// store in tmp_path."""

    def __init__(self, tmp_path, target):
        self.store_uri = (tmp_path / "features").as_uri()
        self.store = FeatureStore(self.store_uri)
        contract = _contract(target)
        self.broker = start_sample_broker(4, max_inflight=MAX_INFLIGHT, contract=contract, store_uri=self.store_uri)
        self.samples = _samples("s", NUM_SAMPLES, target.vocab_size)
        self.producer = _Producer(self.broker, CaptureServer(target, contract, self.store), self.samples)
        self.producer.start()

    def finish(self, result) -> None:
        """Audit the ledger after the run and check the broker's bound held."""
        import ray

        self.producer.check()
        report = audit(Ledger(result.ledger_uri), source_ids=[s.sample_id for s in self.samples], store=self.store)
        assert report.ok, report.summary()
        assert report.trained == NUM_SAMPLES
        stats = ray.get(self.broker.stats.remote(), timeout=60)
        assert stats["ended"] and stats["inflight"] == 0
        assert stats["peak_inflight"] <= MAX_INFLIGHT

    def close(self) -> None:
        import ray

        self.producer.stop.set()
        self.producer.join(timeout=30)
        ray.kill(self.broker)


@pytest.fixture
def stream(ray_cluster, debug_target, tmp_path):
    stream = _Stream(tmp_path, debug_target)
    yield stream
    stream.close()


@pytest.mark.parametrize("fault", [
    pytest.param(dict(point="mid_window", step=3, rank=1, after=1), id="mid-window"),
    pytest.param(dict(point="after_step_before_checkpoint", step=4, rank=0), id="after-step-before-checkpoint"),
    pytest.param(dict(point="during_delete", step=2, rank=0, after=3), id="during-delete"),
])
def test_a_crash_is_recovered_with_every_sample_trained_exactly_once(stream, tmp_path, fault):
    plan = FaultPlan(marker=str(tmp_path / "crashed"), **fault)
    result = run_trainer_gang(_cfg(tmp_path, "crash"), num_workers=2, storage_path=str(tmp_path / "ray"),
                              broker=stream.broker, fault=plan, max_failures=1, timeout_s=TIMEOUT_S)
    assert (tmp_path / "crashed").exists()  # the fault fired once
    stream.finish(result)
    assert [a["parent"] for a in result.attempts] == [None, {"attempt": 0, "step": 2}]
    assert result.step == 5  # windows 4, 4, 4, 4 and the final 2
    assert [r["step"] for r in result.metrics] == [1, 2, 3, 4, 5]
    assert [r["attempt"] for r in result.metrics] == [0, 0, 1, 1, 1]
    assert load_checkpoint(result.checkpoint).step == 5


def test_resume_with_a_smaller_gang_resplits_the_windows(stream, tmp_path):
    cfg = _cfg(tmp_path, "shrink")
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


def test_the_gang_refuses_a_stream_it_would_deadlock_on(ray_cluster, debug_target, tmp_path):
    import ray

    cfg = _cfg(tmp_path, "refused")
    uri = (tmp_path / "features").as_uri()
    small = start_sample_broker(4, max_inflight=6, contract=_contract(debug_target), store_uri=uri)
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
    store_uri = (tmp_path / "features").as_uri()
    contract = _contract(debug_target)
    server = CaptureServer(debug_target, contract, FeatureStore(store_uri))
    refs = server.capture(_samples("m", 6, debug_target.vocab_size))
    manifest = write_manifest(str(tmp_path / "manifest.parquet"), refs, contract=contract, store_uri=store_uri)
    cfg = _cfg(tmp_path, "offline", f"data.manifest={manifest}", "optim.total_steps=4", "optim.accumulation_steps=1")
    result = run_trainer_gang(cfg, num_workers=2, storage_path=str(tmp_path / "ray"), timeout_s=TIMEOUT_S)
    assert result.step == 4 and [r["step"] for r in result.metrics] == [1, 2, 3, 4]
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
