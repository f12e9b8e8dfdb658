import json
import threading
import time
from collections import Counter

import pytest

from specray.capture.contract import build_contract
from specray.capture.data import ChatRenderer, Conversation
from specray.capture.server import CaptureServer, pack_batches
from specray.capture.store import FeatureStore, read_manifest
from specray.pipeline.jobs.capture import run_capture, run_capture_on_ray
from specray.pipeline.config import CaptureJobConfig, load_config

pytestmark = pytest.mark.ray

CPUS = 0.5  # per actor: two pools of two actors fit the 4-CPU test cluster


@pytest.fixture(scope="module")
def contract(debug_target):
    t = debug_target
    return build_contract("dflash", target_fingerprint=t.target_fingerprint, template_fingerprint=t.template_fingerprint,
                          num_target_layers=t.num_layers, hidden_size=t.hidden_size, dtype="float32")


@pytest.fixture(scope="module")
def batches(debug_target):
    """24 batches of 2 samples, as (batch_id, samples)."""
    renderer = ChatRenderer(debug_target.tokenizer, max_length=256)
    conversations = [
        Conversation(f"c{i:02d}", (("user", f"Question {i}: " + "why? " * (i % 7)), ("assistant", "Because. " * (1 + i % 11))))
        for i in range(48)
    ]
    packed = pack_batches([renderer.render(c) for c in conversations], max_batch_tokens=1 << 20, max_batch_size=2)
    assert len(packed) == 24
    return [(f"b{i:02d}", batch) for i, batch in enumerate(packed)]


@pytest.fixture(scope="module")
def reference(debug_target, contract, batches, tmp_path_factory):
    """sample_id -> checksum when the same batches are captured in this process."""
    server = CaptureServer(debug_target, contract, FeatureStore(tmp_path_factory.mktemp("reference").as_uri()))
    refs = [ref for _, batch in batches for ref in server.capture(batch)]
    server.close()
    return {r.sample_id: r.checksum for r in refs}


@pytest.fixture(scope="module")
def pool(ray_cluster, contract, tmp_path_factory):
    from specray.actors.capture import CapturePool

    with CapturePool("debug", contract, tmp_path_factory.mktemp("pool").as_uri(), num_actors=2,
                     num_cpus_per_actor=CPUS, max_inflight_batches=2) as pool:
        pool.wait_ready()  # both actors take batches from the first one on
        yield pool


def _collect():
    delivered: dict[str, list] = {}
    calls = Counter()

    def on_refs(batch_id, refs):
        calls[batch_id] += 1
        delivered[batch_id] = refs

    return delivered, calls, on_refs


def _check_exactly_once(delivered, calls, batches, reference, store):
    assert set(calls) == {batch_id for batch_id, _ in batches} and set(calls.values()) == {1}
    refs = [ref for batch_refs in delivered.values() for ref in batch_refs]
    assert sorted(r.sample_id for r in refs) == sorted(reference)
    assert {r.sample_id: r.checksum for r in refs} == reference  # re-captured batches give the same bytes
    for ref in refs:
        assert store.get(ref)["input_ids"].numel() == ref.num_tokens  # readable, checksum verified


def _job_config(tmp_path, name):
    return load_config(CaptureJobConfig, "manifests/capture-quickstart.yaml", [
        f"name={name}", "target.name=debug", "data.max_samples=10", "data.max_length=128",
        "capture.max_batch_size=3", f"output.run_dir={tmp_path / name}", "output.overwrite=false",
    ])


def test_ray_capture_job_writes_what_the_in_process_job_writes(ray_cluster, tmp_path):
    local = run_capture(_job_config(tmp_path, "local"), progress=False)
    on_ray = run_capture_on_ray(_job_config(tmp_path, "ray"), num_actors=2, num_cpus_per_actor=CPUS, progress=False)

    def rows(summary):
        manifest = read_manifest(summary.manifest)
        return [(r.sample_id, r.key, r.checksum, r.num_bytes, r.tensors) for r in manifest.refs], manifest.contract

    assert rows(on_ray) == rows(local)
    assert local.samples > 3  # several batches
    varying = {"seconds", "tokens_per_s", "store_uri", "manifest"}
    saved = json.loads((tmp_path / "ray" / "capture.json").read_text())
    assert {k: v for k, v in saved.items() if k not in varying} == {
        k: v for k, v in json.loads((tmp_path / "local" / "capture.json").read_text()).items() if k not in varying
    }
    assert saved["samples"] == on_ray.samples and (tmp_path / "ray" / "config.yaml").exists()


def test_pool_keeps_max_inflight_batches_per_actor(pool, batches, reference):
    delivered, calls, on_refs = _collect()
    stats = pool.run(batches, on_refs)
    _check_exactly_once(delivered, calls, batches, reference, pool.store)
    assert stats.max_inflight == 2 * 2  # both actors, two batches each, never more
    assert (stats.batches, stats.samples, stats.restarts, stats.redispatched) == (24, 48, 0, 0)
    assert stats.tokens == sum(r.num_tokens for refs in delivered.values() for r in refs)


def test_blocking_admit_holds_dispatch_while_batches_keep_arriving(pool, batches, reference):
    """admit lets one batch be outstanding; it unblocks only when on_refs has the previous one.

    Without the pool delivering while admit blocks, this deadlocks (the test times out).
    """
    delivered, calls, on_refs = _collect()
    capacity = threading.Semaphore(1)
    admitted = []

    def admit(batch):
        assert capacity.acquire(timeout=60), "admit was never released: the pool stopped delivering"
        admitted.append(batch[0])

    def sink(batch_id, refs):
        assert batch_id in admitted  # dispatched only after admit returned
        on_refs(batch_id, refs)
        capacity.release()

    stats = pool.run(batches, sink, admit=admit)
    _check_exactly_once(delivered, calls, batches, reference, pool.store)
    assert stats.max_inflight == 1 and admitted == [batch_id for batch_id, _ in batches]


def test_admit_errors_and_repeated_batch_ids_stop_the_run(pool, batches):
    def admit(batch):
        raise RuntimeError(f"broker closed before {batch[0]}")

    with pytest.raises(RuntimeError, match="broker closed before b00"):
        pool.run(batches[:2], lambda *_: None, admit=admit)
    with pytest.raises(ValueError, match="batch id 'b01' appears twice"):
        pool.run([batches[1], batches[1]], lambda *_: None)


def test_killed_actor_loses_no_batch_and_delivers_none_twice(ray_cluster, contract, batches, reference, tmp_path):
    """First kill: Ray restarts the actor (max_restarts=1). Second kill, for good: the pool replaces it."""
    import ray

    from specray.actors.capture import CapturePool

    inflight = 6
    with CapturePool("debug", contract, tmp_path.as_uri(), num_actors=2, num_cpus_per_actor=CPUS,
                     max_restarts=1, max_inflight_batches=inflight) as pool:
        for restart in (True, False):
            pool.wait_ready()  # so the first 2 * inflight batches are dispatched without a wait
            victim = pool.actors[0]

            def source():
                for i, batch in enumerate(batches):
                    if i == 2 * inflight:  # both actors hold `inflight` batches; none is delivered yet
                        ray.kill(victim, no_restart=not restart)
                    yield batch

            delivered, calls, on_refs = _collect()
            stats = pool.run(source(), on_refs)
            _check_exactly_once(delivered, calls, batches, reference, pool.store)
            assert stats.restarts == 1 and stats.redispatched >= 1
            assert (pool.actors[0] is victim) == restart
        pool.wait_ready()
        assert ray.get(pool.actors[0].ready.remote(), timeout=60) > 0  # the replacement serves


def test_batch_lost_while_admit_waits_for_its_room_is_resent(ray_cluster, contract, batches, reference, tmp_path):
    """The online deadlock: admit waits for room only a lost batch frees (delivering it frees room).

    Room for 2 batches; both are in flight on one actor when it is killed. admit for the third
    blocks until one of them is delivered, so the pool must re-send them *while* admit waits;
    otherwise nothing ever frees room and the run hangs (admit's acquire times out).
    """
    import ray

    from specray.actors.capture import CapturePool

    delivered, calls, on_refs = _collect()
    room = threading.Semaphore(2)
    with CapturePool("debug", contract, tmp_path.as_uri(), num_actors=1, num_cpus_per_actor=CPUS,
                     max_restarts=1, max_inflight_batches=2) as pool:
        pool.wait_ready()
        victim = pool.actors[0]

        def admit(batch):
            if batch[0] == batches[2][0]:  # b00 and b01 are in flight: kill them with their actor
                ray.kill(victim, no_restart=False)
            assert room.acquire(timeout=120), "the lost batches were never re-sent while admit waited"

        def sink(batch_id, refs):
            on_refs(batch_id, refs)
            room.release()

        stats = pool.run(batches[:6], sink, admit=admit)
    ids = {s.sample_id for _, batch in batches[:6] for s in batch}
    _check_exactly_once(delivered, calls, batches[:6], {k: v for k, v in reference.items() if k in ids}, pool.store)
    assert stats.restarts == 1 and stats.redispatched >= 1


def test_capture_into_the_ray_object_store_lives_as_long_as_the_actors(ray_cluster, contract, batches, reference):
    import uuid

    from specray.actors.capture import CapturePool
    from specray.capture.store import FeatureNotFoundError

    pool = CapturePool("debug", contract, f"ray://capture-{uuid.uuid4().hex[:8]}", num_actors=1, num_cpus_per_actor=CPUS)
    delivered, calls, on_refs = _collect()
    pool.run(batches[:3], on_refs)
    expected = {sample.sample_id: reference[sample.sample_id] for _, batch in batches[:3] for sample in batch}
    _check_exactly_once(delivered, calls, batches[:3], expected, pool.store)  # read back in the driver
    pool.close()  # the actor owned every blob: they go with it
    ref = delivered["b00"][0]
    deadline = time.monotonic() + 15
    while pool.store.exists(ref.key):
        assert time.monotonic() < deadline, "features outlived the actor that owned them"
        time.sleep(0.2)
    with pytest.raises(FeatureNotFoundError):
        pool.store.get(ref)


def test_recapture_writes_only_the_lost_samples_with_the_first_bytes(ray_cluster, contract, batches, reference):
    import uuid

    from specray.actors.capture import CapturePool

    pool = CapturePool("debug", contract, f"ray://recapture-{uuid.uuid4().hex[:8]}", num_actors=1,
                       num_cpus_per_actor=CPUS)
    try:
        first, _, on_refs = _collect()
        pool.run(batches[:2], on_refs)
        lost = first["b01"][1]
        pool.store.delete(lost.key)
        pool.store.delete(first["b00"][0].key)  # trained and deleted: must not come back
        pool.recapture(batches[1], only=[lost.sample_id])
        again, calls, on_refs = _collect()
        stop = threading.Event()
        stop.set()  # serve what is queued, then return
        stats = pool.run([], on_refs, until=stop)
        assert (stats.batches, stats.samples, stats.recaptured) == (0, 0, 1)
        assert list(calls) == ["b01"] and [r.sample_id for r in again["b01"]] == [lost.sample_id]
        assert again["b01"][0] == lost  # same key, same checksum: the bytes of the first capture
        assert again["b01"][0].checksum == reference[lost.sample_id]
        assert pool.store.get(lost)["input_ids"].numel() == lost.num_tokens
        assert not pool.store.exists(first["b00"][0].key)
        with pytest.raises(ValueError, match="names no samples"):
            pool.recapture(batches[1], only=[])
    finally:
        pool.close()


def test_ray_capture_actors_render_with_the_jobs_chat_template(ray_cluster, tmp_path):
    """data.chat_template_kwargs change the template fingerprint: every actor loads the target with the
    plan's template, so its contract matches and the blobs equal the in-process capture's."""
    kwargs = ["data.chat_template=chatml", "data.chat_template_kwargs.unused_flag=true", "data.max_samples=4"]
    local = load_config(CaptureJobConfig, "manifests/capture-quickstart.yaml", [
        "name=local", "target.name=debug", "data.max_length=128", f"output.run_dir={tmp_path / 'local'}", *kwargs])
    on_ray = local.model_copy(update={"name": "ray", "output": local.output.model_copy(
        update={"run_dir": str(tmp_path / "ray")})})
    a = read_manifest(run_capture(local, progress=False).manifest)
    b = read_manifest(run_capture_on_ray(on_ray, num_actors=1, num_cpus_per_actor=CPUS, progress=False).manifest)
    assert a.chat_template is not None and a.chat_template == b.chat_template
    assert a.contract == b.contract
    assert [(r.key, r.checksum) for r in a.refs] == [(r.key, r.checksum) for r in b.refs]
