"""Capture on CUDA GPUs (skips without one; ``make gpu-check`` runs them): the features of a target on
the GPU equal the CPU's, ``auto`` captures in bfloat16 there, and a target placed across two GPUs
(``device_map="auto"``) captures what one GPU captures."""

import pytest
import torch

from specray.capture.contract import build_contract
from specray.capture.data import RenderedSample
from specray.capture.server import CaptureServer
from specray.capture.store import FeatureStore
from specray.capture.target import load_target, target_placement

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def _samples(vocab_size: int) -> list[RenderedSample]:
    generator = torch.Generator().manual_seed(1)
    out = []
    for i, length in enumerate((17, 40, 33)):
        mask = torch.zeros(length, dtype=torch.bool)
        mask[5:] = True
        out.append(RenderedSample(f"c{i}", torch.randint(3, vocab_size, (length,), generator=generator), mask, False))
    return out


def _features(target, tmp_path, algorithm="eagle3"):
    contract = build_contract(algorithm, target_fingerprint=target.target_fingerprint,
                              template_fingerprint=target.template_fingerprint, num_target_layers=target.num_layers,
                              hidden_size=target.hidden_size, dtype="float32")
    server = CaptureServer(target, contract, FeatureStore((tmp_path / "f").as_uri()))
    try:
        return server.extract(_samples(target.vocab_size))
    finally:
        server.close()


@pytest.fixture(autouse=True)
def exact_matmuls():
    saved = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32 = saved


def test_features_on_cuda_equal_the_cpus(tmp_path):
    cpu = _features(load_target("debug"), tmp_path / "cpu")
    gpu = _features(load_target("debug", device="cuda", dtype="float32"), tmp_path / "gpu")
    for a, b in zip(cpu, gpu):
        assert b["hidden_states"].device.type == "cpu"  # written from host memory
        torch.testing.assert_close(b["hidden_states"], a["hidden_states"], rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(b["last_hidden_states"], a["last_hidden_states"], rtol=1e-4, atol=1e-4)


def test_auto_runs_the_target_in_bfloat16_on_the_gpu():
    target = load_target("debug", device="auto", dtype="auto")
    assert target.model.device.type == "cuda" and target.model.dtype == torch.bfloat16


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_a_target_across_two_gpus_captures_what_one_captures(tmp_path):
    one = _features(load_target("debug", device="cuda", dtype="float32"), tmp_path / "one")
    placement = target_placement(torch.device("cuda"), 2)
    assert placement == {"device_map": "auto"}
    spread = load_target("debug", dtype="float32", **placement)  # check_placement: every module on a GPU
    two = _features(spread, tmp_path / "two")
    for a, b in zip(one, two):
        torch.testing.assert_close(b["hidden_states"], a["hidden_states"], rtol=1e-4, atol=1e-4)
