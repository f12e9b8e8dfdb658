"""drafters/target_spec.py: the one check of which targets specray computes. Every supported family
gives its spec; everything else is refused with the config field and its value named."""

import pytest
from transformers import (GPT2Config, LlamaConfig, MistralConfig, Qwen2Config, Qwen2MoeConfig, Qwen3Config,
                          Qwen3NextConfig)

from specray.drafters.target_spec import UnsupportedTargetError, check_supported

SMALL = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
             max_position_embeddings=1024)


def test_supported_families_give_their_spec():
    llama = check_supported(LlamaConfig(**SMALL, rope_parameters={
        "rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 256}))
    assert (llama.model_type, llama.head_dim, llama.qk_norm, llama.rope.rope_type) == ("llama", 16, False, "llama3")
    assert llama.rope.scaling == {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                  "high_freq_factor": 4.0, "original_max_position_embeddings": 256}
    qwen3 = check_supported(Qwen3Config(**SMALL, head_dim=32))
    assert (qwen3.head_dim, qwen3.qk_norm, qwen3.rope.scaling) == (32, True, None)
    assert check_supported(Qwen2Config(**SMALL)).model_type == "qwen2"
    mistral = check_supported(MistralConfig(**SMALL, sliding_window=None), max_len=4096)
    assert mistral.sliding_window is None
    assert check_supported(LlamaConfig(**SMALL, tie_word_embeddings=True)).tie_word_embeddings


@pytest.mark.parametrize("config, match", [
    (GPT2Config(n_embd=64, n_layer=2, n_head=4), r"model_type='gpt2' is not a family specray computes"),
    (Qwen2MoeConfig(**SMALL), r"model_type='qwen2_moe'"),
    (Qwen3NextConfig(**SMALL), r"model_type='qwen3_next'"),
    (LlamaConfig(**SMALL, num_local_experts=8), r"num_local_experts=8"),
    (Qwen2Config(**SMALL, use_sliding_window=True, sliding_window=64, max_window_layers=2),
     r"layer_types=\['sliding_attention'\] \(use_sliding_window=True\)"),
    (Qwen3Config(**SMALL, layer_types=["full_attention", "linear_attention"] * 2), r"layer_types=\['linear_attention'\]"),
    (LlamaConfig(**SMALL, hidden_act="gelu"), r"hidden_act='gelu'"),
    (LlamaConfig(**SMALL, rope_parameters={"rope_type": "longrope", "rope_theta": 1e4, "short_factor": [1.0] * 8,
                                           "long_factor": [1.0] * 8, "original_max_position_embeddings": 256}),
     r"rope_parameters.rope_type='longrope'"),
    (LlamaConfig(**SMALL, rope_parameters={"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.5}),
     r"partial_rotary_factor=0.5"),
    (LlamaConfig(**{**SMALL, "num_key_value_heads": 3}), r"num_key_value_heads=3 does not divide num_attention_heads=4"),
    (LlamaConfig(**SMALL, quantization_config={"quant_method": "gptq"}), r"quantization_config.quant_method='gptq'"),
], ids=["gpt2", "moe", "hybrid", "experts-field", "qwen-sliding", "linear-layers", "gelu", "longrope", "partial",
        "heads", "quantised"])
def test_unsupported_configs_are_refused_naming_the_field(config, match):
    with pytest.raises(UnsupportedTargetError, match=match):
        check_supported(config)


def test_per_layer_rope_is_refused():
    config = LlamaConfig(**SMALL)
    config.rope_parameters = {"full_attention": {"rope_type": "default", "rope_theta": 1e4},
                              "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}
    with pytest.raises(UnsupportedTargetError, match=r"rope_parameters=\['full_attention', 'sliding_attention'\] "
                                                     r"is per layer type"):
        check_supported(config)


def test_length_dependent_computations_are_refused_past_where_they_start():
    """Dynamic NTK past max_position_embeddings and a sliding window shorter than the engine: both
    would compute another model for long sequences; up to there they are exact."""
    dynamic = LlamaConfig(**SMALL, rope_parameters={"rope_type": "dynamic", "rope_theta": 1e4, "factor": 2.0})
    assert check_supported(dynamic, max_len=1024).rope.rope_type == "dynamic"
    with pytest.raises(UnsupportedTargetError, match=r"rope_type='dynamic'.*max_position_embeddings=1024.*max_len 1025"):
        check_supported(dynamic, max_len=1025)
    sliding = MistralConfig(**SMALL, sliding_window=512)
    assert check_supported(sliding, max_len=512).sliding_window == 512
    with pytest.raises(UnsupportedTargetError, match=r"sliding_window=512.*max_len 2048.*set max_len <= 512"):
        check_supported(sliding, max_len=2048)
