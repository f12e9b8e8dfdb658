"""What a vLLM replica hands vLLM's ``EngineArgs`` (serving/vllm_engine.py ``engine_arguments``),
without vLLM: the speculators directory as the model (vLLM reads the verifier and the method
from it), engine.max_batch / max_len mapped, the user's arguments passed, specray's own refused."""

from pathlib import Path
from types import SimpleNamespace

import pytest

from specray.serving.vllm_engine import RESERVED_ARGS, engine_arguments

TARGET = SimpleNamespace(path=Path("/models/target"))


def test_a_drafter_is_vllms_model_and_the_target_its_verifier():
    args = engine_arguments(TARGET, Path("/cache/v000003-speculators"), max_batch=8, max_len=4096,
                            num_speculative_tokens=3, engine_args={"tensor_parallel_size": 2, "enforce_eager": True})
    assert args == {"model": "/cache/v000003-speculators", "speculative_config": {"num_speculative_tokens": 3},
                    "max_num_seqs": 8, "max_model_len": 4096, "disable_log_stats": False,
                    "tensor_parallel_size": 2, "enforce_eager": True}


def test_without_a_drafter_vllm_serves_the_target_alone():
    args = engine_arguments(TARGET, None, max_batch=4, max_len=2048, num_speculative_tokens=None,
                            engine_args={"max_model_len": 8192, "quantization": None})
    assert args == {"model": "/models/target", "tokenizer": "/models/target", "max_num_seqs": 4,
                    "max_model_len": 8192, "disable_log_stats": False}


@pytest.mark.parametrize("name", RESERVED_ARGS)
def test_what_specray_sets_cannot_be_passed(name):
    with pytest.raises(ValueError, match=rf"vllm.{name} is set by specray"):
        engine_arguments(TARGET, None, max_batch=4, max_len=2048, num_speculative_tokens=None,
                         engine_args={name: "x"})
