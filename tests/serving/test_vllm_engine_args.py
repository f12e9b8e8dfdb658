"""What a vLLM replica hands vLLM's ``EngineArgs`` (serving/vllm_engine.py ``engine_arguments``),
without vLLM: the speculators directory as the model (vLLM reads the verifier and the method
from it), engine.max_batch / max_len mapped, the user's arguments passed, specray's own refused."""

import os
from pathlib import Path
from types import SimpleNamespace

import pytest

from specray.serving import vllm_engine
from specray.serving.vllm_engine import RESERVED_ARGS, engine_arguments

# a Llama-3.1-8B-shaped config: 32 layers, 8 KV heads of 128
TARGET = SimpleNamespace(path=Path("/models/target"), config=SimpleNamespace(
    num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8, hidden_size=4096, head_dim=128))


@pytest.fixture(autouse=True)
def gpu_build(monkeypatch):
    """vLLM's platform, without vLLM: a GPU build unless a test says otherwise."""
    monkeypatch.setattr(vllm_engine, "_cpu_build", lambda: False)
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "unset")  # restored (removed) after the test
    monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE")


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


def test_the_kv_cache_size_reaches_vllm(monkeypatch):
    args = engine_arguments(TARGET, None, max_batch=4, max_len=2048, num_speculative_tokens=None,
                            engine_args={"kv_cache_memory_gib": 2.5})
    assert args["kv_cache_memory_bytes"] == int(2.5 * 2**30)
    monkeypatch.setattr(vllm_engine, "_cpu_build", lambda: True)
    args = engine_arguments(TARGET, None, max_batch=4, max_len=2048, num_speculative_tokens=None,
                            engine_args={"kv_cache_memory_gib": 2.5})
    assert "kv_cache_memory_bytes" not in args and os.environ["VLLM_CPU_KVCACHE_SPACE"] == "3"
    # unset on vLLM-CPU: what 4 requests of 1,024 tokens need in fp32 (1 GiB of KV for this shape), a quarter
    # more; never vLLM's default of 92 % of the node's memory
    engine_arguments(TARGET, None, max_batch=4, max_len=1024, num_speculative_tokens=None, engine_args={})
    assert os.environ["VLLM_CPU_KVCACHE_SPACE"] == "2"
