"""The serving engine on any device: the runner, the KV caches and every worker allocate each tensor
on an explicit device (the target's for compute, the CPU for bookkeeping), never on torch's default.

- Here (any machine): every worker's prefill, speculative rounds and plain steps, greedy and
  sampled, on both runner paths, run under ``torch.device("meta")`` as the default device: a
  tensor made without a device lands on ``meta`` and the step fails or computes another result
  (the CUDA case, where an implicit CPU tensor meets CUDA ones). The outputs must equal a run
  without it.
- On a CUDA machine (skipped elsewhere): the runner's logits equal transformers' on CUDA, and
  every worker's greedy output equals greedy AR decoding on CUDA, with the Triton kernels
  (rejection sampling, DSpark's schedule, DFlash 2's walk); sampled requests run through too.

    pytest tests/serving/test_engine_devices.py
"""

import json

import pytest
import torch

from specray.capture.contract import build_contract
from specray.capture.target import load_target
from specray.drafters import DRAFTERS
from specray.drafters.format import save_drafter
from specray.kernels import decode_cpu
from specray.serving.engine import Engine
from specray.serving.requests import encode_prompt
from specray.serving.runner import LlamaRunner
from specray.serving.sampling import SamplingParams, sample_next
from specray.serving.workers import TREE_WORKERS, WORKERS, ARWorker

PROMPTS = ["Hi", "Tell me about dragons and castles.", "1 2 3 4 5 6"]
CASES = [("ar", False)] + [(a, False) for a in sorted(WORKERS)] + [(a, True) for a in sorted(TREE_WORKERS)]
IDS = [f"{a}{'-tree' if t else ''}" for a, t in CASES]


def _drafter(algorithm, target, seed=0):
    spec = DRAFTERS[algorithm]
    torch.manual_seed(seed)
    model = spec.model(spec.debug_config(target), embed_tokens=target.model.get_input_embeddings(),
                       lm_head=target.model.get_output_embeddings())
    with torch.no_grad():  # drafts that depend on the context (the conformance kit's scale)
        for p in model.parameters():
            if p.dim() == 2:
                p.mul_(4.0)
    return model.eval().requires_grad_(False)


def _worker(target, algorithm, tree, native):
    if algorithm == "ar":
        return ARWorker(LlamaRunner(target.model, num_slots=len(PROMPTS), max_len=256, native=native))
    drafter = _drafter(algorithm, target)
    runner = LlamaRunner(target.model, num_slots=len(PROMPTS), max_len=256,
                         capture_layer_ids=drafter.config.target_layer_ids, native=native)
    return (TREE_WORKERS if tree else WORKERS)[algorithm](runner, drafter)


def _drive(worker, target):
    """Prefill, then rounds of the largest size, a plain step, size 1, a plain step, the largest again;
    request 0 greedy, the others sampled (seeded). Returns every step's tokens and accepted counts."""
    prompts = [encode_prompt(target.tokenizer, p) for p in PROMPTS]
    slots = list(range(len(prompts)))
    params = [SamplingParams()] + [SamplingParams(temperature=1.0)] * (len(prompts) - 1)
    generators = [torch.Generator(device="cpu").manual_seed(10 + s) for s in slots]
    logits = worker.prefill(slots, prompts)
    anchors = [sample_next(logits[s], params[s], generators[s]) for s in slots]
    largest = worker.verify_sizes[-1] if worker.verify_sizes else 0
    if getattr(worker, "verify_layout", None) == "ragged":  # DSpark's size is the batch's draft budget
        largest *= len(slots)
    trace = []
    for size in (largest, 0, min(1, largest), 0, largest):
        out = worker.step(slots, anchors, params, generators, size)
        assert all(e is None for e in out.errors), out.errors
        trace.append((out.tokens, out.accepted))
        anchors = [tokens[-1] for tokens in out.tokens]
    return trace


@pytest.mark.parametrize("native", [True, False], ids=["fused", "torch"])
@pytest.mark.parametrize("algorithm, tree", CASES, ids=IDS)
def test_serving_steps_allocate_nothing_on_the_default_device(debug_target, algorithm, tree, native):
    if native and not decode_cpu.available():
        pytest.skip(f"fused CPU kernels unavailable: {decode_cpu.unavailable_reason()}")
    reference = _drive(_worker(debug_target, algorithm, tree, native), debug_target)
    worker = _worker(debug_target, algorithm, tree, native)  # built as usual: modules on the target's device
    with torch.device("meta"):  # every tensor made without a device in a step is a meta tensor
        trace = _drive(worker, debug_target)
    assert trace == reference


# -- on CUDA -----------------------------------------------------------------------------------

def cuda(test):  # make gpu-check selects these with -m cuda
    return pytest.mark.cuda(pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")(test))


@pytest.fixture(scope="module")
def cuda_target():
    return load_target("debug", device="cuda")


def _export(drafter, target, out):
    contract = build_contract(drafter.algorithm, target_fingerprint=target.target_fingerprint,
                              template_fingerprint=target.template_fingerprint, num_target_layers=target.num_layers,
                              hidden_size=target.hidden_size, layer_ids=drafter.config.target_layer_ids,
                              dtype="float32")
    return str(save_drafter(out, drafter, contract=json.loads(contract.to_json()), provenance={"run": "cuda"}))


@cuda
def test_runner_logits_equal_transformers_on_cuda(cuda_target):
    runner = LlamaRunner(cuda_target.model, num_slots=2, max_len=512, capture_layer_ids=(1, 3))
    assert not runner.native and runner.cache.k.is_cuda and runner.cos.is_cuda
    ids = torch.randint(3, cuda_target.vocab_size, (300,), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        reference = cuda_target.model(input_ids=ids[None].cuda(), output_hidden_states=True)
    prefill = runner.prefill([ids[:296].tolist()], torch.tensor([1]), every_row=True)
    runner.cache.commit(1, 296)
    verify = runner.forward(ids[None, 296:], torch.tensor([1]), torch.tensor([4]))
    logits = torch.cat([prefill.logits[0], verify.logits[0]])
    assert logits.is_cuda
    torch.testing.assert_close(logits, reference.logits[0], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(verify.hidden[3][0], reference.hidden_states[4][0, 296:], atol=1e-4, rtol=1e-4)


@cuda
@pytest.mark.parametrize("algorithm, tree", CASES[1:], ids=IDS[1:])
def test_greedy_speculative_equals_greedy_ar_on_cuda(cuda_target, algorithm, tree, tmp_path):
    ar = Engine(cuda_target, max_batch=len(PROMPTS), max_len=256)
    greedy = [out.token_ids for out in ar.generate(PROMPTS, SamplingParams(max_tokens=24))]
    drafter = _drafter(algorithm, cuda_target)
    engine = Engine(cuda_target, _export(drafter, cuda_target, tmp_path / "export"), max_batch=len(PROMPTS),
                    max_len=256, speculation="static", tree=tree)
    assert next(engine.drafter.parameters()).is_cuda and engine.runner.device.type == "cuda"
    assert [out.token_ids for out in engine.generate(PROMPTS, SamplingParams(max_tokens=24))] == greedy
    sampled = engine.generate(PROMPTS, SamplingParams(max_tokens=16, temperature=1.0, seed=1))
    assert all(len(out.token_ids) > 0 for out in sampled)
