"""Which targets specray computes, decided once: ``check_supported(config) -> TargetSpec``.

The serving runner (``serving/runner.py``) computes the target itself, and every drafter reads the
target's shapes and RoPE; the capture loader (``capture/target.py::load_target``) refuses a target
at load that this check refuses, so nothing downstream meets a model it would compute wrongly.

Supported families (``FAMILIES``), each what transformers computes for it:

- ``llama`` (Llama 2 / 3.x, SmolLM2): optional ``attention_bias`` (q, k, v and o) and ``mlp_bias``;
- ``qwen2`` (Qwen2 / 2.5): biases on q, k and v;
- ``qwen3``: per-head RMSNorm of q and k (``q_norm`` / ``k_norm``) before RoPE, optional
  ``attention_bias``;
- ``mistral``: ``sliding_window`` — computed exactly while no sequence can reach past it, so an
  engine whose ``max_len`` exceeds the window is refused (``check_max_len``).

All of them: SiLU-gated MLP (``hidden_act: silu``), RMSNorm, grouped-query attention, ``head_dim``
independent of ``hidden_size / num_attention_heads``, tied or untied embeddings, and RoPE of the
types in ``drafters/rope.py::ROPE_TYPES`` from transformers' own functions.

Refused, with the config field and its value named (``UnsupportedTargetError``, a ValueError):
another ``model_type``; mixture-of-experts fields; layer types other than full attention
(sliding or linear/hybrid layers, Qwen's ``use_sliding_window``); another ``hidden_act``; a RoPE
type outside ``ROPE_TYPES``, per-layer RoPE, ``partial_rotary_factor``; a quantised checkpoint;
and, given the engine's ``max_len``: ``dynamic`` RoPE past ``max_position_embeddings`` (transformers
recomputes its frequencies per sequence length) and a ``sliding_window`` shorter than ``max_len``.
"""

from __future__ import annotations

from dataclasses import dataclass

from specray.drafters.rope import RopeSpec, check_rope_parameters

FAMILIES = ("llama", "qwen2", "qwen3", "mistral")
QK_NORM_FAMILIES = ("qwen3",)

# Fields that make a config compute something these families' transformers classes do not
# (mixture of experts, hybrid or linear attention, logit soft-capping, muP-style multipliers).
FOREIGN_FIELDS = (
    "num_experts", "num_local_experts", "n_routed_experts", "moe_intermediate_size", "num_experts_per_tok",
    "decoder_sparse_step", "linear_attention", "linear_num_key_heads", "full_attention_interval",
    "layers_block_type", "attn_type_list", "attn_logit_softcapping", "final_logit_softcapping",
    "logits_scaling", "embedding_multiplier", "residual_multiplier", "attention_multiplier", "no_rope_layers",
)


class UnsupportedTargetError(ValueError):
    """The target's config asks for a computation specray's runner and drafters do not do."""


@dataclass(frozen=True)
class TargetSpec:
    """What specray computes of a supported target (from its transformers config)."""

    model_type: str
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    rms_norm_eps: float
    rope: RopeSpec
    qk_norm: bool  # per-head RMSNorm of q and k before RoPE (Qwen3)
    sliding_window: int | None  # Mistral's window, None = full attention
    max_position_embeddings: int | None
    tie_word_embeddings: bool

    def check_max_len(self, max_len: int) -> None:
        """Refuse an engine of ``max_len`` positions where this target's computation depends on
        a sequence length the runner does not follow (module docstring)."""
        limit = self.max_position_embeddings
        if self.rope.rope_type == "dynamic" and limit is not None and max_len > limit:
            raise UnsupportedTargetError(
                f"target config rope_parameters.rope_type='dynamic' recomputes RoPE frequencies for sequences "
                f"longer than max_position_embeddings={limit}, which the runner does not; the engine's max_len "
                f"{max_len} exceeds it: set max_len <= {limit}")
        if self.sliding_window is not None and max_len > self.sliding_window:
            raise UnsupportedTargetError(
                f"target config sliding_window={self.sliding_window}: the runner attends to every earlier position, "
                f"so sequences longer than the window would differ from the target; the engine's max_len {max_len} "
                f"exceeds it: set max_len <= {self.sliding_window}")


def _fail(field: str, value, why: str) -> UnsupportedTargetError:
    return UnsupportedTargetError(f"target config {field}={value!r} {why}")


def _check_layer_types(config) -> None:
    layer_types = getattr(config, "layer_types", None)
    if layer_types and any(t != "full_attention" for t in layer_types):
        other = sorted({t for t in layer_types if t != "full_attention"})
        sliding = getattr(config, "use_sliding_window", None)
        hint = f"(use_sliding_window={sliding}) " if sliding is not None else ""
        raise _fail("layer_types", other, f"{hint}is not computed by specray's runner (full-attention layers only)")


def _check_foreign(config) -> None:
    for name in FOREIGN_FIELDS:
        value = getattr(config, name, None)
        if value not in (None, 0, False, [], ()):
            raise _fail(name, value, "is a computation specray's runner does not do (mixture of experts, hybrid "
                                     "or linear attention, soft-capping or multipliers)")
    quantization = getattr(config, "quantization_config", None)
    if quantization:
        method = quantization.get("quant_method") if isinstance(quantization, dict) else quantization
        raise _fail("quantization_config.quant_method", method, "is a quantised checkpoint; specray computes dense "
                                                                "fp32/bf16 weights (dequantise it first)")


def _rope_spec(config, head_dim: int) -> RopeSpec:
    params = getattr(config, "rope_parameters", None)
    if params is None:
        params = {"rope_type": "default", "rope_theta": float(getattr(config, "rope_theta", 10000.0))}
        if getattr(config, "rope_scaling", None):
            params.update(config.rope_scaling)
    params = dict(params)
    if params and all(isinstance(v, dict) for v in params.values()):
        raise _fail("rope_parameters", sorted(params), "is per layer type; specray computes one RoPE for every layer")
    check_rope_parameters(params, "target config rope_parameters", error=UnsupportedTargetError)
    params.setdefault("rope_type", params.pop("type", "default"))
    return RopeSpec(head_dim, params, getattr(config, "max_position_embeddings", None), family=config.model_type)


def check_supported(config, *, max_len: int | None = None) -> TargetSpec:
    """The ``TargetSpec`` of a transformers config, or ``UnsupportedTargetError`` naming the field
    and its value (module docstring); with ``max_len`` also ``TargetSpec.check_max_len``."""
    model_type = getattr(config, "model_type", None)
    if model_type not in FAMILIES:
        raise _fail("model_type", model_type, f"is not a family specray computes; supported: {list(FAMILIES)}")
    _check_foreign(config)
    _check_layer_types(config)
    if config.hidden_act != "silu":
        raise _fail("hidden_act", config.hidden_act, "is not computed by specray's runner (SiLU-gated MLP only)")
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    if heads % kv_heads:
        raise _fail("num_key_value_heads", kv_heads, f"does not divide num_attention_heads={heads}")
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    if head_dim % 2:
        raise _fail("head_dim", head_dim, "is odd; rotary embeddings rotate pairs of dims")
    rope = _rope_spec(config, head_dim)
    spec = TargetSpec(
        model_type=model_type, num_layers=config.num_hidden_layers, hidden_size=config.hidden_size,
        num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim, intermediate_size=config.intermediate_size,
        vocab_size=config.vocab_size, rms_norm_eps=config.rms_norm_eps, rope=rope,
        qk_norm=model_type in QK_NORM_FAMILIES,
        sliding_window=getattr(config, "sliding_window", None) if model_type == "mistral" else None,
        max_position_embeddings=getattr(config, "max_position_embeddings", None),
        tie_word_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
    )
    if max_len is not None:
        spec.check_max_len(max_len)
    return spec
