"""Tiny random-weight targets of each model family specray computes (``drafters/target_spec.py``),
built locally from a transformers config (``AutoModelForCausalLM.from_config``) with the debug
target's byte-level tokenizer and ChatML template (``capture/target.py::build_debug_tokenizer``),
saved with ``save_pretrained`` so that ``load_target(path)`` loads them as it loads any target.

``FAMILIES`` (name -> config):

- ``llama3``: Llama 3.1's RoPE (``rope_type: llama3``) with ``original_max_position_embeddings``
  256, so positions up to 4k fall in every band of the scaling (high frequencies kept, low ones
  divided by ``factor``, the middle band smoothed);
- ``qwen2``: Qwen2's q/k/v biases, rope_theta 1e6;
- ``qwen3``: Qwen3's per-head q/k RMSNorm, ``head_dim`` 32 where hidden / heads is 16;
- ``mistral``: Mistral with no sliding window (Mistral 7B v0.2+);
- ``tied``: a Llama with tied embeddings, ``attention_bias`` (q, k, v, o) and ``mlp_bias``,
  ``head_dim`` 24, and YaRN RoPE (its attention scaling multiplies cos and sin).

Every weight is random at a scale that gives peaked, input-dependent logits (the debug target's
0.15 for matrices); biases and norm weights are random too, so a runner that drops a bias or a
norm weight computes another model.
"""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config

from specray.capture.target import build_debug_tokenizer

COMMON = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=8, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=8192, rms_norm_eps=1e-6,
              bos_token_id=1, eos_token_id=2, pad_token_id=2)

FAMILIES = {
    "llama3": lambda vocab: LlamaConfig(
        vocab_size=vocab, **COMMON, tie_word_embeddings=False,
        rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                         "high_freq_factor": 4.0, "original_max_position_embeddings": 256}),
    "qwen2": lambda vocab: Qwen2Config(vocab_size=vocab, **COMMON, tie_word_embeddings=False,
                                       rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}),
    "qwen3": lambda vocab: Qwen3Config(vocab_size=vocab, **COMMON, head_dim=32, tie_word_embeddings=False,
                                       rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}),
    "mistral": lambda vocab: MistralConfig(vocab_size=vocab, **COMMON, sliding_window=None, tie_word_embeddings=False),
    "tied": lambda vocab: LlamaConfig(
        vocab_size=vocab, **COMMON, head_dim=24, tie_word_embeddings=True, attention_bias=True, mlp_bias=True,
        rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                         "original_max_position_embeddings": 2048}),
}


def randomise(model: torch.nn.Module, seed: int) -> None:
    """Matrices N(0, 0.15²) (the debug target's scale), biases N(0, 0.1²), norm weights N(1, 0.1²)."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 2:
                p.copy_(torch.randn(p.shape, generator=generator) * 0.15)
            elif "norm" in name:
                p.copy_(1.0 + torch.randn(p.shape, generator=generator) * 0.1)
            else:  # a bias
                p.copy_(torch.randn(p.shape, generator=generator) * 0.1)


def build_family(name: str, out: Path, *, seed: int = 0, config=None) -> Path:
    """Save the family ``name``'s tiny random model (or one of ``config``) and the debug tokenizer at ``out``."""
    tokenizer = build_debug_tokenizer()
    config = config if config is not None else FAMILIES[name](len(tokenizer))
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    randomise(model, seed)
    model.config.name_or_path = f"family:{name}"
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out
