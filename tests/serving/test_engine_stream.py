"""The engine's incremental API on the debug target: streaming adds up to ``generate``, aborts
free their slot, and drafter versions hot-load between steps without changing any output."""

import asyncio
import json
import shutil
import threading

import pytest

from specray.drafters.format import InvalidDrafterError
from specray.serving.engine import Engine, EngineLoop
from specray.serving.sampling import SamplingParams

PROMPTS = ["Hi", "Tell me about dragons and castles.", "1 2 3 4 5 6"]


@pytest.fixture(scope="module")
def drafters(export_drafter):
    """v1: the contract's layers, block 4; v2: other layers (1, 3) and block 3."""
    return {1: export_drafter(seed=0), 2: export_drafter(seed=1, layer_ids=(1, 3), block_size=3)}


def _drain(engine, handles):
    while not all(h.done for h in handles):
        engine.step()


def _joined(deltas):
    assert [d.finish_reason for d in deltas[:-1]] == [None] * (len(deltas) - 1) and deltas[-1].finish_reason
    return [t for d in deltas for t in d.token_ids], "".join(d.text for d in deltas)


def test_stream_adds_up_to_generate(debug_target, drafters):
    # static rounds: the seeded sampled request draws the same randoms in every run
    engine = Engine(debug_target, str(drafters[1]), max_batch=2, max_len=512, speculation="static")
    greedy = engine.generate([PROMPTS[0]], SamplingParams(max_tokens=30))[0]
    stop = greedy.text[12:15]  # a stop string in the middle: streamed text must hold back its prefix
    params = [SamplingParams(max_tokens=30, stop=(stop,)), SamplingParams(max_tokens=25, temperature=0.9, seed=3),
              SamplingParams(max_tokens=12)]
    expected = engine.generate(PROMPTS, params)
    assert expected[0].finish_reason == "stop" and expected[0].text == greedy.text[: greedy.text.index(stop)]

    handles = [engine.submit(p, sp) for p, sp in zip(PROMPTS, params)]  # stepped by hand, read by threads
    thread_deltas = [[] for _ in handles]
    readers = [threading.Thread(target=lambda h=h, out=out: out.extend(h)) for h, out in zip(handles, thread_deltas)]
    for reader in readers:
        reader.start()
    _drain(engine, handles)
    for reader in readers:
        reader.join(timeout=60)
    loop = EngineLoop(engine).start()  # stepped by the loop, read from asyncio

    async def consume():
        handles = [engine.submit(p, sp) for p, sp in zip(PROMPTS, params)]
        return await asyncio.gather(*[_collect(h) for h in handles])

    async def _collect(handle):
        return [d async for d in handle]

    try:
        async_deltas = asyncio.run(asyncio.wait_for(consume(), timeout=120))
    finally:
        loop.stop()
    for out, handle, *streams in zip(expected, handles, thread_deltas, async_deltas):
        for stream in (*streams, list(handle)):  # the last one read after the end: a single delta
            tokens, text = _joined(stream)
            assert tokens == out.token_ids and text == out.text
            assert stream[-1].finish_reason == out.finish_reason
        assert all(len(stream) > 2 for stream in streams)  # it streamed, rather than answering once at the end
        assert handle.result().token_ids == out.token_ids


def test_abort_frees_the_slot(debug_target):
    engine = Engine(debug_target, None, max_batch=1, max_len=256)
    long, queued = engine.submit("Hi", SamplingParams(max_tokens=100, ignore_eos=True)), engine.submit("Yo")
    engine.step(), engine.step()
    long.abort(), queued.abort()
    engine.step()
    assert long.result(timeout=1).finish_reason == "abort" and 0 < len(long.result().token_ids) < 100
    assert queued.result(timeout=1).finish_reason == "abort" and queued.result().token_ids == []
    assert not engine.runner.cache.in_use.any() and not engine.has_work()
    assert engine.stats()["requests_aborted"] == 2
    assert engine.generate(["Hi"], SamplingParams(max_tokens=3))[0].token_ids


def test_a_failed_step_fails_its_requests_and_the_loop_keeps_serving(debug_target):
    engine = Engine(debug_target, None, max_batch=2, max_len=256)
    worker = engine.worker

    class Broken:
        max_verify_rows = 1
        prefill, release, stats = worker.prefill, worker.release, worker.stats

        def step(self, *args):
            raise RuntimeError("boom")

    engine.worker = Broken()
    loop = EngineLoop(engine).start()
    try:
        with pytest.raises(RuntimeError, match="boom"):
            engine.submit("Hi", SamplingParams(max_tokens=8)).result(timeout=60)
        engine.worker = worker
        assert len(engine.submit("Hi", SamplingParams(max_tokens=8, ignore_eos=True)).result(timeout=60).token_ids) == 8
    finally:
        loop.stop()
    stats = engine.stats()
    assert stats["requests_served"] == 1 and stats["requests_failed"] == 1 and not engine.runner.cache.in_use.any()


def test_hot_load_keeps_each_request_on_its_version(debug_target, drafters):
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    ar = Engine(debug_target, None, max_batch=2, max_len=256).generate(PROMPTS[:2], params)
    # static rounds: both versions speculate every step, so each has acceptance by position to report
    engine = Engine(debug_target, str(drafters[1]), max_batch=2, max_len=256, drafter_version=1, speculation="static")
    first = engine.submit(PROMPTS[0], params)
    engine.step(), engine.step()
    assert engine.load_drafter(drafters[2], 2).result(timeout=60) == 2
    assert engine.active_version == 1  # staged: switches at the next step, not in the middle of one
    engine.step()
    assert engine.active_version == 2 and engine.live_versions == [1, 2]
    assert engine.runner.capture_layer_ids == (1, 2, 3, 4, 5)  # the union while both run
    second = engine.submit(PROMPTS[1], params)
    _drain(engine, [first, second])
    a, b = first.result(), second.result()
    assert (first.drafter_version, a.drafter_version, second.drafter_version, b.drafter_version) == (1, 1, 2, 2)
    assert a.token_ids == ar[0].token_ids and b.token_ids == ar[1].token_ids  # lossless on both versions
    assert max(a.emitted_per_round) <= 4 and max(b.emitted_per_round) <= 3
    assert engine.live_versions == [2] and engine.runner.capture_layer_ids == (1, 3)  # v1 dropped
    stats = engine.stats()
    assert stats["active_version"] == 2 and len(stats["acceptance_by_position"]) == 2
    assert {v["version"] for v in stats["versions"]} == {1, 2} and stats["requests_served"] == 2
    assert stats["tau"] >= 1 and all(0 <= x <= 1 for x in stats["acceptance_by_position"])


def test_invalid_exports_are_rejected_and_the_old_version_keeps_serving(debug_target, drafters, tmp_path):
    corrupt = shutil.copytree(drafters[1], tmp_path / "corrupt")
    weights = bytearray((corrupt / "model.safetensors").read_bytes())
    weights[-100:] = bytes(100)
    (corrupt / "model.safetensors").write_bytes(bytes(weights))
    foreign = shutil.copytree(drafters[1], tmp_path / "foreign")
    config = json.loads((foreign / "config.json").read_text())
    config["target_fingerprint"] = "sha256:another-target"
    (foreign / "config.json").write_text(json.dumps(config))

    engine = Engine(debug_target, str(drafters[1]), max_batch=2, max_len=256, drafter_version=1)
    loop = EngineLoop(engine).start()
    try:
        running = engine.submit(PROMPTS[1], SamplingParams(max_tokens=40, ignore_eos=True))
        with pytest.raises(InvalidDrafterError, match="sha256"):
            engine.load_drafter(corrupt, 2).result(timeout=60)
        with pytest.raises(InvalidDrafterError, match="trained for another target"):
            engine.load_drafter(foreign, 3).result(timeout=60)
        assert len(running.result(timeout=120).token_ids) == 40
        after = engine.submit(PROMPTS[0], SamplingParams(max_tokens=8)).result(timeout=120)
    finally:
        loop.stop()
    assert running.drafter_version == after.drafter_version == 1 and after.token_ids
    stats = engine.stats()
    assert stats["active_version"] == 1 and [r["version"] for r in stats["rejected_versions"]] == [2, 3]
    assert "sha256" in stats["rejected_versions"][0]["error"]
