"""Rotary position embeddings, computed with transformers' own inverse-frequency functions.

One ``RopeSpec`` describes a model's RoPE: its head dim, transformers' ``rope_parameters``
(``rope_type``, ``rope_theta`` and the scaling fields of that type) and
``max_position_embeddings`` (read by ``dynamic`` and by ``yarn`` without a ``factor``). The
serving runner builds it from the target's config (``drafters/target_spec.py``), a drafter from
the fields its config records from the target (``rope_theta``, ``rope_scaling``,
``max_position_embeddings``), so target and drafters rotate by the same rule.

``rope_frequencies(spec)`` returns transformers' ``(inv_freq [hd/2], attention_scaling)``:
``ROPE_INIT_FUNCTIONS[rope_type]`` (``linear``, ``dynamic``, ``llama3``, ``yarn``) or, for
``default``, the family's ``compute_default_rope_parameters``; nothing here derives a formula.
``attention_scaling`` (yarn's mscale; 1 for the others) multiplies cos and sin, as transformers'
rotary modules do. ``dynamic`` is evaluated as transformers evaluates it at load (``seq_len`` =
``max_position_embeddings``), which is what it computes for every position below
``max_position_embeddings``; past it transformers recomputes the frequencies per sequence length,
which the runner refuses (``TargetSpec.check_max_len``).

Two forms of the rotation (Llama's rotate-half layout, ``x * cos + rotate_half(x) * sin``):

- ``apply_rope(x, positions, inv_freq, scaling)``: angles computed per call (the drafters: any
  positions, training and serving alike);
- ``rope_table`` / ``apply_rope_table``: cosines and sign-folded sines precomputed for positions
  ``0 … max_len − 1`` (the serving runner and the fused CPU kernels read rows of it).
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field

import torch

ROPE_TYPES = ("default", "linear", "dynamic", "llama3", "yarn")  # what the runner and the drafters compute

# model_type -> the module and class of its rotary embedding (whose compute_default_rope_parameters
# gives the default frequencies); a drafter's RoPE is Llama's
ROTARY_CLASSES = {
    "llama": ("transformers.models.llama.modeling_llama", "LlamaRotaryEmbedding"),
    "qwen2": ("transformers.models.qwen2.modeling_qwen2", "Qwen2RotaryEmbedding"),
    "qwen3": ("transformers.models.qwen3.modeling_qwen3", "Qwen3RotaryEmbedding"),
    "mistral": ("transformers.models.mistral.modeling_mistral", "MistralRotaryEmbedding"),
}


@dataclass(frozen=True)
class RopeSpec:
    """A model's RoPE: ``parameters`` is transformers' ``rope_parameters`` (``rope_type``,
    ``rope_theta`` and the fields of that type, e.g. llama3's ``factor``, ``low_freq_factor``,
    ``high_freq_factor``, ``original_max_position_embeddings``)."""

    head_dim: int
    parameters: dict = field(hash=False)
    max_position_embeddings: int | None = None
    family: str = "llama"  # model_type whose rotary class gives the default frequencies

    @property
    def rope_type(self) -> str:
        return self.parameters.get("rope_type", "default")

    @property
    def theta(self) -> float:
        return float(self.parameters["rope_theta"])

    @property
    def scaling(self) -> dict | None:
        """The parameters besides ``rope_theta`` (None for the default type): a drafter config's ``rope_scaling``."""
        if self.rope_type == "default":
            return None
        return {k: v for k, v in self.parameters.items() if k != "rope_theta"}

    @classmethod
    def of(cls, head_dim: int, theta: float, scaling: dict | None = None,
           max_position_embeddings: int | None = None) -> RopeSpec:
        """From a drafter config's fields: ``rope_theta``, ``rope_scaling`` (None = default) and
        ``max_position_embeddings``."""
        params = {"rope_type": "default", **(scaling or {}), "rope_theta": float(theta)}
        return cls(head_dim, params, max_position_embeddings)


def check_rope_parameters(parameters: dict, where: str, error: type[ValueError] = ValueError) -> None:
    """Raise ``error`` unless ``parameters`` is a RoPE this package computes exactly (``where``
    names the config field, e.g. ``rope_parameters`` of a target config or a drafter's ``rope_scaling``)."""
    rope_type = parameters.get("rope_type", parameters.get("type", "default"))
    if rope_type not in ROPE_TYPES:
        raise error(f"{where}.rope_type={rope_type!r} is not computed by specray's runner and drafters; "
                         f"supported RoPE types: {list(ROPE_TYPES)}")
    partial = parameters.get("partial_rotary_factor", 1.0)
    if partial is not None and float(partial) != 1.0:
        raise error(f"{where}.partial_rotary_factor={partial}: partial rotary embeddings are not computed by "
                         "specray (every head dim is rotated); use a target without partial_rotary_factor")


def _rope_config(spec: RopeSpec):
    """A transformers config carrying exactly what the inverse-frequency functions read."""
    from transformers import LlamaConfig

    check_rope_parameters(spec.parameters, "rope_parameters")
    if spec.head_dim % 2:
        raise ValueError(f"head_dim={spec.head_dim} is odd; rotary embeddings rotate pairs of dims")
    if spec.rope_type in ("dynamic", "yarn") and spec.max_position_embeddings is None:
        raise ValueError(f"rope_type={spec.rope_type!r} reads max_position_embeddings; record the target's "
                         "(drafter config field max_position_embeddings)")
    return LlamaConfig(hidden_size=spec.head_dim, num_attention_heads=1, num_key_value_heads=1,
                       head_dim=spec.head_dim, max_position_embeddings=spec.max_position_embeddings or 2048,
                       rope_parameters=dict(spec.parameters))


def rope_frequencies(spec: RopeSpec) -> tuple[torch.Tensor, float]:
    """transformers' ``(inv_freq [head_dim / 2] float32, attention_scaling)`` for ``spec`` (module docstring)."""
    config = _rope_config(spec)
    rope_type = config.rope_parameters["rope_type"]
    if rope_type == "default":
        module, name = ROTARY_CLASSES.get(spec.family, ROTARY_CLASSES["llama"])
        init = getattr(importlib.import_module(module), name).compute_default_rope_parameters
    else:
        from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

        init = ROPE_INIT_FUNCTIONS[rope_type]
    with torch.device("cpu"):  # real numbers even inside a meta-device build (a model sized, not allocated)
        inv_freq, scaling = init(config, device="cpu")
    return inv_freq.float(), float(scaling)


def _cos_sin(angles: torch.Tensor, scaling: float) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 angles [..., hd/2] -> (cos, sin) [..., hd], times ``scaling``: transformers' rotary forward."""
    emb = torch.cat([angles, angles], dim=-1)
    return emb.cos() * scaling, emb.sin() * scaling


def apply_rope(x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor, scaling: float = 1.0) -> torch.Tensor:
    """Rotary embedding (Llama's rotate-half layout) of x [..., H, T, hd] at positions [..., T],
    with ``rope_frequencies``' inv_freq [hd/2] and attention scaling."""
    half = x.shape[-1] // 2
    angles = positions.to(torch.float32)[..., None] * inv_freq.to(device=x.device, dtype=torch.float32)  # [..., T, hd/2]
    cos, sin = _cos_sin(angles, scaling)
    cos, sin = cos.unsqueeze(-3).to(x.dtype), sin.unsqueeze(-3).to(x.dtype)  # [..., 1, T, hd]
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


def rope_table(max_len: int, spec: RopeSpec, dtype: torch.dtype, device: torch.device | str = "cpu"
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """Cosines and sign-folded sines of positions ``0 … max_len − 1``: ([max_len, hd], [max_len, hd]).

    The sines are stored as ``[−sin, sin]`` halves, so ``apply_rope_table`` needs one flip, no negation.
    """
    inv_freq, scaling = rope_frequencies(spec)
    angles = torch.arange(max_len, dtype=torch.float32)[:, None] * inv_freq  # [max_len, hd/2]
    cos, sin = _cos_sin(angles, scaling)
    half = spec.head_dim // 2
    sin = torch.cat([-sin[:, :half], sin[:, half:]], dim=-1)
    return cos.to(device=device, dtype=dtype), sin.to(device=device, dtype=dtype)


def apply_rope_table(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding of x [N, heads, hd] with rows of ``rope_table``: cos/sin [N, 1, hd].

    transformers: ``x * cos + rotate_half(x) * sin`` with ``rotate_half([x1, x2]) = [-x2, x1]``;
    here ``flip([x1, x2]) * [-s, s] = [-x2 * s, x1 * s]``, the same products exactly.
    """
    N, heads, hd = x.shape
    flipped = x.reshape(N, heads, 2, hd // 2).flip(2).reshape(N, heads, hd)
    return torch.addcmul(x * cos, flipped, sin)
