import json
import shutil

import pytest
import torch

from specray.capture import target as target_mod
from specray.capture.target import load_target


def test_debug_target_is_a_small_llama_with_a_chat_template(debug_target):
    assert debug_target.num_layers == 8 and debug_target.hidden_size == 64
    assert debug_target.model.config.model_type == "llama"
    assert not any(p.requires_grad for p in debug_target.model.parameters())
    assert debug_target.tokenizer.chat_template
    assert debug_target.target_fingerprint.startswith("sha256:")


def test_fingerprints_are_cached_and_equal_to_a_fresh_computation(debug_target):
    fresh = target_mod.target_fingerprint(debug_target.path), target_mod.template_fingerprint(debug_target.tokenizer)
    assert fresh == (debug_target.target_fingerprint, debug_target.template_fingerprint)
    again = load_target("debug")
    assert again.target_fingerprint == debug_target.target_fingerprint


def test_other_weights_give_another_target_fingerprint(debug_target, tmp_path):
    other = load_target("debug:1")
    assert other.target_fingerprint != debug_target.target_fingerprint
    assert other.template_fingerprint == debug_target.template_fingerprint  # same tokenizer + template

    # a local copy of the same directory has the same identity; editing one weight changes it
    copy = tmp_path / "model"
    shutil.copytree(debug_target.path, copy)
    local = load_target(str(copy))
    assert local.target_fingerprint == debug_target.target_fingerprint
    from safetensors.torch import load_file, save_file

    weights = load_file(copy / "model.safetensors")
    name = next(iter(weights))
    weights[name] = weights[name] + 1e-3
    save_file(weights, copy / "model.safetensors", metadata={"format": "pt"})
    assert target_mod.target_fingerprint(copy) != debug_target.target_fingerprint


def test_bad_target_names(tmp_path):
    with pytest.raises(ValueError, match="unknown embedded target"):
        load_target("embedded:llama-70b")
    with pytest.raises(ValueError, match="local HF model directory"):
        load_target(str(tmp_path))
    with pytest.raises(ValueError, match="integer"):
        load_target("debug:abc")
    with pytest.raises(ValueError, match="target.dtype"):
        load_target("debug", dtype="int8")


@pytest.mark.slow
def test_embedded_smollm2_is_dequantised_and_cached(smollm2):
    cfg = smollm2.model.config
    assert (cfg.num_hidden_layers, cfg.hidden_size, cfg.vocab_size) == (30, 576, 49152)
    assert cfg.tie_word_embeddings
    assert smollm2.model.lm_head.weight.data_ptr() == smollm2.model.model.embed_tokens.weight.data_ptr()
    saved = json.loads((smollm2.path / "config.json").read_text())
    assert "quantization_config" not in saved
    assert list(smollm2.path.glob("*.safetensors")) and smollm2.path.is_relative_to(target_mod.cache_dir())
    # greedy answer is coherent text from the real model, not random weights
    ids = smollm2.tokenizer.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                                add_generation_prompt=True, return_tensors="pt", return_dict=True)
    with torch.inference_mode():
        out = smollm2.model.generate(**ids, max_new_tokens=12, do_sample=False)
    answer = smollm2.tokenizer.decode(out[0, ids["input_ids"].shape[1]:])
    assert "Paris" in answer


@pytest.mark.parametrize("family", ["gpt2", "sliding-qwen2"])
def test_unsupported_targets_are_refused_at_load_naming_the_field(tmp_path, family):
    """A target specray would compute wrongly never loads: the config is checked before the weights."""
    from transformers import AutoModelForCausalLM, GPT2Config, Qwen2Config

    from specray.drafters.target_spec import UnsupportedTargetError

    tokenizer = target_mod.build_debug_tokenizer()
    if family == "gpt2":
        config, match = GPT2Config(vocab_size=len(tokenizer), n_embd=32, n_layer=2, n_head=2), r"model_type='gpt2'"
    else:
        config = Qwen2Config(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                             num_attention_heads=2, num_key_value_heads=1, use_sliding_window=True, sliding_window=16,
                             max_window_layers=1)
        match = r"layer_types=\['sliding_attention'\] \(use_sliding_window=True\)"
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    with pytest.raises(UnsupportedTargetError, match=match):
        load_target(str(tmp_path))
