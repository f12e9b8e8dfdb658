"""Family conformance: tiny random-weight targets of every family specray computes
(``families_kit.FAMILIES``: Llama with Llama 3.1 RoPE, Qwen2 with biases, Qwen3 with q/k norms,
Mistral, a tied-embedding Llama with biases and YaRN), each loaded through ``load_target``:

- the runner's logits equal transformers' within 1e-4 at positions up to 4k (fp32; chunked
  forwards over the cache, then decode steps and a verify), on both runner paths;
"""

import pytest
import torch
from families_kit import FAMILIES, build_family

from specray.capture.target import load_target
from specray.kernels import decode_cpu
from specray.serving.runner import LlamaRunner

TOLERANCE = 1e-4
LONG = 4096 + 8  # positions of the long check


@pytest.fixture(scope="session")
def family_targets(tmp_path_factory):
    """``family_targets(name)``: the family's tiny target, built and loaded once per session."""
    root, loaded = tmp_path_factory.mktemp("families"), {}

    def get(name: str):
        if name not in loaded:
            loaded[name] = load_target(str(build_family(name, root / name)))
        return loaded[name]

    return get


@pytest.fixture(params=sorted(FAMILIES))
def family(request) -> str:
    return request.param


def _native(flag: bool) -> bool:
    if flag and not decode_cpu.available():
        pytest.skip(f"fused CPU kernels unavailable: {decode_cpu.unavailable_reason()}")
    return flag


@pytest.mark.parametrize("native", [True, False], ids=["fused", "torch"])
def test_runner_logits_equal_transformers_up_to_4k_positions(family_targets, family, native):
    target = family_targets(family)
    ids = torch.randint(3, target.vocab_size, (LONG,), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        reference = target.model(input_ids=ids[None]).logits[0]  # [LONG, V]
    runner = LlamaRunner(target.model, num_slots=2, max_len=LONG, native=_native(native))
    slot = torch.tensor([1])
    chunks = [(0, 1500), (1500, 3000), (3000, LONG - 8)]  # forwards over the committed cache
    rows = []
    for start, end in chunks:
        out = runner.forward(ids[None, start:end], slot, torch.tensor([end - start]))
        runner.cache.commit(1, end - start)
        rows.append(out.logits[0])
    for t in range(LONG - 8, LONG - 4):  # decode steps
        rows.append(runner.forward(ids[None, t : t + 1], slot, torch.tensor([1])).logits[0])
        runner.cache.commit(1, 1)
    rows.append(runner.forward(ids[None, LONG - 4 :], slot, torch.tensor([4])).logits[0])  # a 4-row verify
    logits = torch.cat(rows)
    assert logits.shape == reference.shape and reference.std() > 0.5
    assert (logits - reference).abs().max() <= TOLERANCE
