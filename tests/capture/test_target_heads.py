"""What each stage reads of a target: a trainer rank reads the embedding, the final norm and the LM
head by tensor name from the safetensors shards (asserted by the names ``safe_open`` hands out), a
driver reads none of the weights."""

import shutil

import pytest
import torch
from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

import specray.capture.target as target_module
from specray.capture.contract import build_contract
from specray.capture.target import load_target, resolve_target_dir
from specray.drafters.eagle3 import Eagle3Section
from specray.trainer.assembly import TrainSpec, build_rank
from specray.trainer.core import OptimSettings
from specray.trainer.strategies.eagle3 import Eagle3Objective

HEADS_UNTIED = {"model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"}


@pytest.fixture(scope="module")
def sharded_untied(tmp_path_factory):
    """A tiny untied Llama saved in several safetensors shards with an index, and the debug tokenizer."""
    out = tmp_path_factory.mktemp("sharded")
    tokenizer = AutoTokenizer.from_pretrained(resolve_target_dir("debug"))
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False,
                         max_position_embeddings=512)
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(out, max_shard_size="40KB")
    tokenizer.save_pretrained(out)
    assert (out / "model.safetensors.index.json").is_file() and len(list(out.glob("*.safetensors"))) > 3
    return out


def test_heads_of_a_sharded_checkpoint_are_read_by_name(sharded_untied, reads):
    heads = load_target(str(sharded_untied), weights="heads")
    assert sorted(reads) == sorted(HEADS_UNTIED)  # each once, nothing else
    full = load_target(str(sharded_untied))
    m, f = heads.model, full.model
    assert torch.equal(m.model.embed_tokens.weight, f.model.embed_tokens.weight)
    assert torch.equal(m.model.norm.weight, f.model.norm.weight)
    assert torch.equal(m.lm_head.weight, f.lm_head.weight) and m.lm_head.weight is not m.model.embed_tokens.weight
    assert all(p.is_meta for p in m.model.layers.parameters())  # the decoder layers hold no memory
    assert heads.target_fingerprint == full.target_fingerprint and heads.num_layers == 4


def test_a_tied_head_is_the_embedding_read_once(reads):
    heads = load_target("debug", weights="heads", dtype="bfloat16")
    assert sorted(reads) == ["model.embed_tokens.weight", "model.norm.weight"]
    assert heads.model.lm_head.weight is heads.model.model.embed_tokens.weight
    assert heads.model.lm_head.weight.dtype == torch.bfloat16


def test_a_driver_reads_no_weights(reads):
    described = load_target("debug", weights="none")
    assert reads == [] and described.model is None
    assert (described.num_layers, described.hidden_size) == (8, 64)
    assert described.target_fingerprint == load_target("debug").target_fingerprint


def test_a_checkpoint_without_safetensors_is_refused_with_the_fix(sharded_untied, tmp_path):
    bin_only = tmp_path / "bin"
    shutil.copytree(sharded_untied, bin_only)
    for file in [*bin_only.glob("*.safetensors"), bin_only / "model.safetensors.index.json"]:
        file.unlink()
    torch.save({}, bin_only / "pytorch_model.bin")
    with pytest.raises(ValueError, match=r"has no safetensors weights; a trainer rank reads .* save_pretrained"):
        load_target(str(bin_only), weights="heads")


def test_a_trainer_rank_reads_exactly_the_heads(sharded_untied, reads, tmp_path):
    """``build_rank`` (what ``specray train`` and every gang worker run) reads the three head tensors."""
    spec = TrainSpec(name="heads", run_dir=str(tmp_path), target=str(sharded_untied), target_dtype="auto",
                     drafter=Eagle3Section(), objective=Eagle3Objective(ttt_length=2), optim=OptimSettings(),
                     micro_batch_size=1, seed=0, manifest=None, endpoint_url=None, max_length=None, world_size=1,
                     log_every=1, checkpoint_every=1, keep_last=None, config={}, device="cpu")
    described = load_target(str(sharded_untied), weights="none")
    contract = build_contract("eagle3", target_fingerprint=described.target_fingerprint,
                              template_fingerprint=described.template_fingerprint, num_target_layers=4,
                              hidden_size=32, layer_ids=(0, 1, 2), dtype="float32")
    reads.clear()
    parts = build_rank(spec, contract)
    assert sorted(reads) == sorted(HEADS_UNTIED)
    assert parts.device == torch.device("cpu") and not parts.core.settings.bf16
    assert parts.target.weights == "heads" and parts.core.model.lm_head is parts.target.model.lm_head


def test_the_capture_driver_plans_without_loading_the_model(monkeypatch, tmp_path, reads):
    """``plan_capture`` (what the driver of Ray capture runs) renders, fingerprints and batches from the
    tokenizer, the config and the weight digests; only the capture actors load the model."""
    from specray.pipeline.config import CaptureJobConfig, load_config
    from specray.pipeline.jobs.capture import plan_capture

    def refuse(*args, **kwargs):
        raise AssertionError("the driver loaded the target's model")

    monkeypatch.setattr(target_module.AutoModelForCausalLM, "from_pretrained", refuse)
    cfg = load_config(CaptureJobConfig, None, ["target.name=debug", "data.max_samples=4",
                                               f"output.run_dir={tmp_path}"])
    plan = plan_capture(cfg)
    assert plan.target.model is None and reads == [] and len(plan.samples) == 4 and plan.batches
    assert plan.contract.target_fingerprint == load_target("debug", weights="none").target_fingerprint
