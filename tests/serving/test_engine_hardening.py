"""The engine under bad requests and failing rounds (debug target): a request whose logits are not
finite fails alone, a round that raises fails its requests and the engine keeps serving, the wait
queue and the stop strings are bounded, and a stop string longer than any decode window stops."""

import pytest
import torch

from specray.serving.engine import Engine, QueueFullError
from specray.serving.sampling import NonFiniteLogitsError, SamplingParams

PROMPTS = ["Hi", "Tell me about dragons and castles.", "1 2 3 4 5 6"]


@pytest.fixture(scope="module")
def drafter(export_drafter):
    return str(export_drafter())


def poison(engine: Engine, slot: int, value: float, from_call: int):
    """From the ``from_call``-th target forward on, the logits of ``slot`` hold ``value`` (every row).
    Returns a function that undoes it."""
    forward, calls = engine.runner.forward, [0]

    def poisoned(input_ids, slots, num_new):
        out = forward(input_ids, slots, num_new)
        calls[0] += 1
        if calls[0] >= from_call:
            with torch.inference_mode():  # the runner's outputs are inference tensors
                out.logits[slots == slot] = value
        return out

    engine.runner.forward = poisoned
    return lambda: delattr(engine.runner, "forward")


NAN, INF = float("nan"), float("inf")
NON_FINITE_CASES = [  # (drafter?, temperature, first poisoned forward: 1 = the prefill, 3 = a later step, value)
    (False, 0.0, 1, NAN), (False, 0.8, 1, INF), (False, 0.0, 3, INF), (False, 0.8, 3, NAN),
    (True, 0.0, 1, INF), (True, 0.8, 1, NAN), (True, 0.0, 3, NAN), (True, 0.8, 3, INF),
]


@pytest.fixture(scope="module")
def clean_outputs(debug_target, drafter):
    """What each configuration generates for PROMPTS when nothing is poisoned."""
    cache = {}

    def get(use_drafter: bool, params: SamplingParams):
        if (use_drafter, params) not in cache:
            engine = Engine(debug_target, drafter if use_drafter else None, max_batch=3, max_len=256,
                            speculation="static")  # fixed rounds: a seeded sampled request draws the same randoms
            cache[use_drafter, params] = [o.token_ids for o in engine.generate(PROMPTS, params)]
        return cache[use_drafter, params]

    return get


@pytest.mark.parametrize("use_drafter, temperature, phase, value", NON_FINITE_CASES,
                         ids=[f"{'dflash' if d else 'ar'}-t{t}-{'prefill' if p == 1 else 'step'}-{v}"
                              for d, t, p, v in NON_FINITE_CASES])
def test_non_finite_logits_fail_that_request_alone(debug_target, drafter, clean_outputs, use_drafter, temperature,
                                                   phase, value):
    params = SamplingParams(max_tokens=12, ignore_eos=True, temperature=temperature, seed=1)
    clean = clean_outputs(use_drafter, params)
    engine = Engine(debug_target, drafter if use_drafter else None, max_batch=3, max_len=256, speculation="static")
    restore = poison(engine, slot=1, value=value, from_call=phase)
    handles = [engine.submit(p, params) for p in PROMPTS]
    while not all(h.done for h in handles):
        engine.step()
    with pytest.raises(NonFiniteLogitsError, match="not finite"):
        handles[1].result()
    assert [handles[i].result().token_ids for i in (0, 2)] == [clean[0], clean[2]]  # the others are unaffected
    assert not engine.runner.cache.in_use.any() and not engine.has_work()
    assert len(handles[1]._tokens) < 12 and engine.stats()["requests_failed"] == 1
    restore()
    assert engine.generate([PROMPTS[1]], params)[0].token_ids == clean[1]  # the engine keeps serving


def test_a_temperature_that_overflows_the_logits_is_refused():
    for bad in (1e-38, 1e-30, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="temperature"):
            SamplingParams(temperature=bad)
    assert SamplingParams(temperature=0.05).temperature == 0.05


class RaisesOnSlot:
    """A worker whose round raises whenever ``slot`` is stepped (its request's state is broken)."""

    def __init__(self, worker, slot: int):
        self._worker, self._slot = worker, slot

    def __getattr__(self, name):
        return getattr(self._worker, name)

    def step(self, slots, *args):
        if self._slot in slots:
            raise RuntimeError("boom")
        return self._worker.step(slots, *args)


def test_a_round_that_raises_fails_its_requests_and_later_generate_succeeds(debug_target):
    engine = Engine(debug_target, None, max_batch=2, max_len=256)
    engine.worker = RaisesOnSlot(engine.worker, slot=1)
    with pytest.raises(RuntimeError, match="boom"):
        engine.generate(PROMPTS[:2], SamplingParams(max_tokens=8))
    assert not engine.runner.cache.in_use.any() and not engine.has_work()
    for _ in range(2):  # slot 0 only: the worker does not raise, and nothing of the failed round is left
        assert len(engine.generate(["Hi"], SamplingParams(max_tokens=8, ignore_eos=True))[0].token_ids) == 8
    assert engine.stats()["requests_served"] == 2


def test_the_wait_queue_is_bounded(debug_target):
    engine = Engine(debug_target, None, max_batch=1, max_len=256, max_waiting=2)
    queued = [engine.submit("Hi", SamplingParams(max_tokens=2)) for _ in range(2)]
    with pytest.raises(QueueFullError, match="max_waiting=2"):
        engine.submit("Hi")
    engine.step()  # admits one: room for one more
    queued.append(engine.submit("Hi", SamplingParams(max_tokens=2)))
    while not all(h.done for h in queued):
        engine.step()
    assert all(len(h.result().token_ids) >= 1 for h in queued)
    with pytest.raises(ValueError, match="max_waiting must be >= 1"):
        Engine(debug_target, None, max_waiting=0)


def test_stop_strings_are_bounded():
    with pytest.raises(ValueError, match="at most 16 stop strings"):
        SamplingParams(stop=tuple(f"s{i}" for i in range(17)))
    with pytest.raises(ValueError, match="at most 256 characters"):
        SamplingParams(stop=("x" * 257,))
    assert len(SamplingParams(stop=tuple(f"{i:02d}" + "x" * 254 for i in range(16))).stop) == 16


def test_a_stop_string_longer_than_the_decode_window_stops(debug_target):
    engine = Engine(debug_target, None, max_batch=1, max_len=512)
    full = engine.generate(["Hi"], SamplingParams(max_tokens=300, ignore_eos=True))[0]
    stop = full.text[40:200]  # ~170 byte tokens: longer than a 64-token window
    assert len(engine.tokenizer(stop, add_special_tokens=False)["input_ids"]) > 64
    cut = engine.generate(["Hi"], SamplingParams(max_tokens=300, ignore_eos=True, stop=(stop,)))[0]
    assert cut.finish_reason == "stop" and cut.text == full.text[:40]
    assert len(cut.token_ids) < len(full.token_ids)
