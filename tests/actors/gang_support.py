"""Helpers of the trainer-gang tests: debug samples, a producer thread feeding a broker, configs.

A ``Stream`` streams 18 debug-target samples (captured in the test process by a ``Producer``
thread through the broker, with backpressure) for a 2-rank gang with micro_batch 1 and 2
accumulation steps: Q = 4, windows 4/4/4/4/2, a checkpoint every 2 steps, and at most
Q × checkpoint_every = 8 features stored at once.
"""

import threading
from pathlib import Path

import torch

from specray.actors.broker import start_sample_broker
from specray.capture.contract import build_contract
from specray.capture.data import RenderedSample
from specray.capture.server import CaptureServer
from specray.capture.store import FeatureStore, write_manifest
from specray.pipeline.config import TrainJobConfig, load_config
from specray.trainer.assembly import TrainSpec
from specray.trainer.ledger import Ledger, audit

NUM_SAMPLES = 18
MAX_INFLIGHT = 8  # Q × checkpoint_every for 2 ranks
TIMEOUT_S = 300


def samples(prefix: str, n: int, vocab_size: int) -> list[RenderedSample]:
    generator = torch.Generator().manual_seed(0)
    out = []
    for i in range(n):
        length = 24 + (7 * i) % 17
        loss_mask = torch.zeros(length, dtype=torch.bool)
        loss_mask[length // 3:] = True
        input_ids = torch.randint(3, vocab_size, (length,), generator=generator)
        out.append(RenderedSample(f"{prefix}{i:03d}", input_ids, loss_mask, False))
    return out


def contract_of(target):
    return build_contract("dflash", target_fingerprint=target.target_fingerprint,
                          template_fingerprint=target.template_fingerprint, num_target_layers=target.num_layers,
                          hidden_size=target.hidden_size)


def train_spec(tmp_path, name: str, *overrides: str) -> TrainSpec:
    return load_config(TrainJobConfig, None, [
        f"name={name}", "target.name=debug", "data.manifest=null", f"output.run_dir={tmp_path / 'run'}",
        "optim.total_steps=100", "optim.warmup_steps=2", "optim.micro_batch_size=1", "optim.accumulation_steps=2",
        "trainer.checkpoint_every=2", "trainer.log_every=1", "trainer.keep_last=2", "objective.num_anchors=4",
        "live_eval.enabled=false", *overrides,
    ]).train_spec()


def offline_manifest(tmp_path, target, n: int = 6) -> str:
    """``n`` debug samples captured into a file:// store under ``tmp_path``, and their manifest."""
    store_uri = (tmp_path / "features").as_uri()
    contract = contract_of(target)
    refs = CaptureServer(target, contract, FeatureStore(store_uri)).capture(samples("m", n, target.vocab_size))
    return write_manifest(str(tmp_path / "manifest.parquet"), refs, contract=contract, store_uri=store_uri)


def corrupt_blob(store: FeatureStore, key: str) -> None:
    """Flip the last byte of a file:// blob (its size stays, its checksum does not)."""
    path = Path(store.root) / key
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF
    path.write_bytes(bytes(data))


class Producer(threading.Thread):
    """Captures samples in pairs: reserve room in the broker, write the blobs, offer the refs.

    ``corrupt``: sample ids whose blob is corrupted after it was written (before the offer).
    ``recapture``: enable re-capture and capture the samples the gang reports lost again, from
    their original pair (same bytes). ``fail_after``: after offering that many samples, fail the
    stream (``broker.fail``) instead of going on.
    """

    def __init__(self, broker, server: CaptureServer, items: list[RenderedSample], *, corrupt: set[str] = frozenset(),
                 recapture: bool = False, fail_after: int | None = None):
        super().__init__(name="test-producer", daemon=True)
        self.broker, self.server, self.samples = broker, server, items
        self.corrupt, self.recapture, self.fail_after = set(corrupt), recapture, fail_after
        self.stop = threading.Event()
        self.error: BaseException | None = None
        self.lock = threading.Lock()  # the capture server is used by the producer and the re-capture thread
        self.recaptured: list[str] = []

    def _pairs(self) -> list[list[RenderedSample]]:
        return [self.samples[start:start + 2] for start in range(0, len(self.samples), 2)]

    def run(self) -> None:
        import ray

        watcher = threading.Thread(target=self._serve_recaptures, daemon=True) if self.recapture else None
        try:
            if watcher is not None:
                ray.get(self.broker.enable_recapture.remote(), timeout=60)
                watcher.start()
            offered = 0
            for batch in self._pairs():
                if self.fail_after is not None and offered >= self.fail_after:
                    ray.get(self.broker.fail.remote("RuntimeError: injected: capture batch failed"), timeout=60)
                    return
                estimate = sum(self.server.contract.min_bytes_per_token * s.num_tokens + 4096 for s in batch)
                while not ray.get(self.broker.reserve.remote(len(batch), num_bytes=estimate, timeout=2), timeout=60):
                    if self.stop.is_set():  # backpressure until the gang frees room, or the test gave up
                        return
                with self.lock:
                    refs = self.server.capture(batch)
                for ref in refs:
                    if ref.sample_id in self.corrupt:
                        corrupt_blob(self.server.store, ref.key)
                ray.get(self.broker.offer.remote(refs, reserved_bytes=estimate), timeout=60)
                offered += len(refs)
            ray.get(self.broker.close.remote(), timeout=60)
            self.stop.wait()  # keep serving re-captures until the test is done
        except BaseException as e:  # noqa: BLE001 - re-raised by the test through check()
            self.error = e
        finally:
            if watcher is not None:
                self.stop.set()
                watcher.join(timeout=30)

    def _serve_recaptures(self) -> None:
        import ray

        pair_of = {s.sample_id: batch for batch in self._pairs() for s in batch}
        while not self.stop.is_set():
            for ref in ray.get(self.broker.take_lost.remote(timeout=0.5), timeout=60):
                with self.lock:
                    refs = self.server.capture(pair_of[ref.sample_id], only=[ref.sample_id])
                ray.get(self.broker.recaptured.remote(refs), timeout=60)
                self.recaptured.append(ref.sample_id)

    def check(self) -> None:
        self.stop.set()
        self.join(timeout=60)
        assert not self.is_alive(), "the producer is still blocked"
        if self.error is not None:
            raise self.error


class Stream:
    """A broker fed by a producer thread, over a file:// store in tmp_path (``num_samples`` samples,
    at most ``max_inflight`` stored)."""

    def __init__(self, tmp_path, target, *, num_samples: int = NUM_SAMPLES, max_inflight: int = MAX_INFLIGHT,
                 **producer_options):
        self.store_uri = (tmp_path / "features").as_uri()
        self.store = FeatureStore(self.store_uri)
        contract = contract_of(target)
        self.max_inflight = max_inflight
        self.broker = start_sample_broker(4, max_inflight=max_inflight, contract=contract, store_uri=self.store_uri)
        self.samples = samples("s", num_samples, target.vocab_size)
        self.producer = Producer(self.broker, CaptureServer(target, contract, self.store), self.samples,
                                 **producer_options)
        self.producer.start()

    def finish(self, result) -> None:
        """Audit the ledger after the run and check the broker's bound held."""
        import ray

        self.producer.check()
        report = audit(Ledger(result.ledger_uri), source_ids=[s.sample_id for s in self.samples], store=self.store)
        assert report.ok, report.summary()
        assert report.trained == len(self.samples)
        stats = ray.get(self.broker.stats.remote(), timeout=60)
        assert stats["ended"] and stats["inflight"] == 0
        assert stats["peak_inflight"] <= self.max_inflight

    def close(self) -> None:
        import ray

        self.producer.stop.set()
        self.producer.join(timeout=30)
        ray.kill(self.broker)
