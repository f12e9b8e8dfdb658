"""The two engines behind the OpenAI app, for the app's tests that must hold on both backends:
our engine over the debug target, and vLLM (``VllmEngine``) over the embedded target, which
needs vLLM installed: it runs in ``.venv-vllm`` (``make vllm-env``), where
``.venv-vllm/bin/python -m pytest -m vllm tests/serving`` selects it, and
tests/serving/test_vllm_backend.py runs it from the main venv. Elsewhere it skips.
"""

import importlib.util
from dataclasses import dataclass

import pytest

from specray.serving.engine import Engine, EngineLoop

HAS_VLLM = importlib.util.find_spec("vllm") is not None
BACKENDS = ["specray", pytest.param("vllm", marks=[
    pytest.mark.vllm, pytest.mark.slow,
    pytest.mark.skipif(not HAS_VLLM, reason="vLLM is not installed here: run under .venv-vllm (make vllm-env)")])]
# exact greedy parity with our engine: vLLM computes in float32 too; eager skips torch.compile
VLLM_TEST_ARGS = {"enforce_eager": True, "dtype": "float32"}


@dataclass
class Served:
    """An engine serving the OpenAI app, and our engine on the same target: the reference its
    greedy answers equal (the served engine itself on the specray backend)."""

    backend: str
    engine: object
    reference: Engine
    _loop: EngineLoop | None = None

    @property
    def logprob_tolerance(self) -> float:
        """How far the app's logprobs may be from the reference's: vLLM's float32 kernels sum in
        another order than ours (1e-5 apart on the embedded target)."""
        return 1e-4 if self.backend == "vllm" else 1e-5

    def start(self) -> "Served":
        if self.backend == "vllm":
            self.engine.start()
        else:
            self._loop = EngineLoop(self.engine).start()
        return self

    def stop(self) -> None:
        if self._loop is not None:
            self._loop.stop()
        elif self.backend == "vllm":
            self.engine.stop()


def serving(backend: str, request, *, max_batch: int, max_len: int, max_waiting: int | None = 256) -> Served:
    """``backend``'s engine, not yet started (``Served.start``), without a drafter."""
    if backend == "specray":
        engine = Engine(request.getfixturevalue("debug_target"), None, max_batch=max_batch, max_len=max_len,
                        max_waiting=max_waiting)
        return Served(backend, engine, engine)
    from specray.serving.vllm_engine import VllmEngine

    target = request.getfixturevalue("smollm2")
    engine = VllmEngine(target, None, max_batch=max_batch, max_len=max_len, max_waiting=max_waiting,
                        engine_args=VLLM_TEST_ARGS)
    return Served(backend, engine, Engine(target, None, max_batch=1, max_len=max_len))
