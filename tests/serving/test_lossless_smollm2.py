"""Greedy losslessness on the embedded SmolLM2 target with a trained DFlash drafter (slow marker).

The drafter is trained here (24 captured ShareGPT samples, 80 steps, about a minute): weak, but
trained, so rounds both accept drafts and reject them — the paths where a wrong commit or an
off-by-one in acceptance would change the output. The engine runs 20 MT-Bench prompts in
batches of 4 and must reproduce transformers' greedy ``generate`` token for token.
"""

import pytest
import torch

from specray.capture.data import load_conversations
from specray.pipeline.jobs.capture import run_capture
from specray.pipeline.config import CaptureJobConfig, TrainJobConfig, load_config
from specray.pipeline.jobs.train import run_training
from specray.serving.engine import Engine
from specray.serving.sampling import SamplingParams
from specray.trainer.export import export_checkpoint

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1200)]  # ~3 min on an idle 2-core machine

MAX_TOKENS = 32


@pytest.fixture(scope="module")
def trained_drafter(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("smol-drafter")
    capture = load_config(CaptureJobConfig, "manifests/capture-quickstart.yaml", [
        "name=smol", "data.max_samples=24", "data.max_length=384", f"output.run_dir={tmp / 'cap'}",
    ])
    run_capture(capture, progress=False)
    train = load_config(TrainJobConfig, "manifests/train-dflash-quickstart.yaml", [
        f"data.manifest={tmp / 'cap' / 'manifest.parquet'}", f"output.run_dir={tmp / 'run'}",
        "optim.total_steps=80", "trainer.checkpoint_every=1000",
    ])
    run_training(train, progress=False)
    return str(export_checkpoint(tmp / "run", tmp / "export"))


def _hf_greedy(target, ids: list[int], max_new: int) -> list[int]:
    with torch.inference_mode():
        out = target.model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                                    max_new_tokens=max_new, do_sample=False, pad_token_id=target.pad_token_id)
    tokens = out[0, len(ids):].tolist()
    eos = target.tokenizer.eos_token_id
    return tokens[: tokens.index(eos)] if eos in tokens else tokens


def test_dflash_greedy_equals_transformers_on_mtbench(smollm2, trained_drafter):
    prompts = [c.as_chat() for c in load_conversations("mtbench", purpose="eval", limit=20)]
    engine = Engine(smollm2, trained_drafter, max_batch=4, max_len=1024, speculation="static")
    outputs = engine.generate(prompts, SamplingParams(max_tokens=MAX_TOKENS))
    assert len(outputs) == 20
    mismatched = [i for i, out in enumerate(outputs) if out.token_ids != _hf_greedy(smollm2, out.prompt_ids, MAX_TOKENS)]
    assert not mismatched, f"prompts {mismatched} differ from transformers greedy generate"
    emitted = [k for out in outputs for k in out.emitted_per_round]
    # The trained drafter must exercise both paths: accepted drafts (k > 1) and rejections (k == 1).
    assert any(k > 1 for k in emitted) and any(k == 1 for k in emitted), emitted
