"""Feature contracts: exactly what a drafter needs captured from the frozen target.

A contract is the interface between capture, training and serving (seed §7.3, DESIGN.md §3).
It fixes *which* target representations are stored, *where* they are taken and *in what
order* they are concatenated. Two contracts that differ in any of these fields describe
different features even when the tensor shapes agree, so a mismatch is an error.

Capture points (the precise definition used everywhere in specray):

- ``decoder_layer_output``: layer id ``i`` (0-based, ``0 <= i < num_target_layers``) is the
  residual stream *leaving* decoder layer ``i``, before any final norm. In transformers'
  ``output_hidden_states`` tuple (``[embeddings, out_0, …, norm(out_{L-1})]``) this is
  ``hidden_states[i + 1]`` for ``i < L - 1``; the last entry of that tuple is already
  normalised, which is why the last layer is exposed separately below.
  Engines that count layer *inputs* name the same tensors ``i + 1``: EAGLE-3's default
  ``[1, L//2 - 1, L - 4]`` as outputs is ``(2, L//2, L - 3)`` as inputs (DESIGN.md §3).
- ``final_norm_output`` (``last_hidden_states``): the output of the target's final norm,
  i.e. the exact input of the LM head; the teacher logits are ``lm_head(last_hidden_states)``.

Stored tensors per sample (``T`` real tokens, no padding):

- ``input_ids``          int32  ``[T]``
- ``loss_mask``          bool   ``[T]``  (assistant content + end-of-turn token)
- ``hidden_states``      dtype  ``[T, L * D]``  layers concatenated in ``layer_ids`` order
- ``last_hidden_states`` dtype  ``[T, D]``  only when the algorithm's spec asks for it

One name per meaning for every algorithm: EAGLE-3's "aux hidden states" are
``hidden_states`` here and its "target hidden" is ``last_hidden_states`` (the seed's §7.3
pitfall of the same field name meaning different things on disk and in the loss).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, fields
from typing import Callable

import torch

CONTRACT_VERSION = 1
CAPTURE_POINT = "decoder_layer_output"
LAST_HIDDEN_POINT = "final_norm_output"

STORAGE_DTYPES: dict[str, torch.dtype] = {
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "float32": torch.float32,
}
TOKEN_DTYPE = torch.int32
MASK_DTYPE = torch.bool


class ContractMismatchError(ValueError):
    """Features, a manifest or an export were produced under another capture contract."""


def eagle3_layer_ids(num_target_layers: int) -> tuple[int, ...]:
    """Low, mid and high decoder-layer outputs: ``[1, L//2 - 1, L - 4]`` (seed §3.4)."""
    if num_target_layers < 6:
        raise ValueError(
            f"eagle3 default layer ids need a target with >= 6 layers, got {num_target_layers}; "
            "set capture.layer_ids explicitly"
        )
    return (1, num_target_layers // 2 - 1, num_target_layers - 4)


def spread_layer_ids(num_target_layers: int, num_layers: int = 5) -> tuple[int, ...]:
    """``num_layers`` decoder-layer outputs spread evenly over ``[1, L - 3]`` (DFlash, seed §4.2).

    Example: ``L = 30, num_layers = 5 -> (1, 8, 14, 21, 27)`` (halves round up). Fewer ids are returned when
    the target is too shallow to give ``num_layers`` distinct layers.
    """
    first, last = 1, num_target_layers - 3
    if last < first:
        raise ValueError(
            f"the target has {num_target_layers} layers; a spread of context layers needs >= 4; "
            "set capture.layer_ids explicitly"
        )
    count = min(num_layers, last - first + 1)
    if count == 1:
        return (num_target_layers // 2,)
    return tuple(first + (i * (last - first) + (count - 1) // 2) // (count - 1) for i in range(count))


@dataclass(frozen=True)
class ContractSpec:
    """What one algorithm needs captured; the registry below is keyed by algorithm."""

    algorithm: str
    default_layer_ids: Callable[[int], tuple[int, ...]]
    needs_last_hidden: bool  # store final_norm_output as last_hidden_states
    num_layer_ids: int | None  # exact number of layers the drafter fuses, None = any
    supervision: str  # what the trainer reads besides hidden_states (for docs and errors)


CONTRACT_SPECS: dict[str, ContractSpec] = {
    "eagle3": ContractSpec(
        "eagle3", eagle3_layer_ids, needs_last_hidden=True, num_layer_ids=3,
        supervision="teacher logits = lm_head(last_hidden_states)",
    ),
    "dflash": ContractSpec(
        "dflash", spread_layer_ids, needs_last_hidden=False, num_layer_ids=None,
        supervision="data tokens (input_ids) under loss_mask",
    ),
    "dspark": ContractSpec(
        "dspark", spread_layer_ids, needs_last_hidden=True, num_layer_ids=None,
        supervision="data tokens + last_hidden_states indexed at label position - 1",
    ),
    "dflash2": ContractSpec(
        "dflash2", spread_layer_ids, needs_last_hidden=False, num_layer_ids=None,
        supervision="data tokens, their true predecessors, strict top-K membership",
    ),
}


def get_contract_spec(algorithm: str) -> ContractSpec:
    try:
        return CONTRACT_SPECS[algorithm]
    except KeyError:
        raise ValueError(
            f"unknown algorithm {algorithm!r}; valid algorithms: {sorted(CONTRACT_SPECS)}"
        ) from None


@dataclass(frozen=True)
class CaptureContract:
    """The full identity of a set of captured features.

    ``contract_id`` is a digest of every field, so equal ids mean interchangeable features.
    """

    algorithm: str
    target_fingerprint: str
    template_fingerprint: str
    num_target_layers: int
    hidden_size: int  # D
    layer_ids: tuple[int, ...]  # order matters: hidden_states = cat(out[i] for i in layer_ids)
    last_hidden: bool
    dtype: str  # storage dtype of the float features
    capture_point: str = CAPTURE_POINT
    version: int = CONTRACT_VERSION

    @property
    def contract_id(self) -> str:
        return hashlib.sha256(self.to_json().encode()).hexdigest()[:16]

    @property
    def torch_dtype(self) -> torch.dtype:
        return STORAGE_DTYPES[self.dtype]

    def tensor_widths(self) -> dict[str, tuple[int, torch.dtype]]:
        """Per-token width and dtype of every stored tensor (``0`` width = a 1-D tensor)."""
        widths = {
            "input_ids": (0, TOKEN_DTYPE),
            "loss_mask": (0, MASK_DTYPE),
            "hidden_states": (len(self.layer_ids) * self.hidden_size, self.torch_dtype),
        }
        if self.last_hidden:
            widths["last_hidden_states"] = (self.hidden_size, self.torch_dtype)
        return widths

    @property
    def min_bytes_per_token(self) -> int:
        """Raw tensor payload per token: the floor for any lossless encoding at this dtype."""
        return sum(max(w, 1) * dt.itemsize for w, dt in self.tensor_widths().values())

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True, separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str) -> "CaptureContract":
        data = json.loads(text)
        data["layer_ids"] = tuple(data["layer_ids"])
        return cls(**data)

    def check_compatible(self, other: "CaptureContract", what: str = "features") -> None:
        """Raise ``ContractMismatchError`` naming every field where ``other`` differs."""
        diffs = [
            f"{f.name}: expected {getattr(self, f.name)!r}, got {getattr(other, f.name)!r}"
            for f in fields(self)
            if getattr(self, f.name) != getattr(other, f.name)
        ]
        if diffs:
            raise ContractMismatchError(
                f"{what} were captured under another contract ({other.contract_id} vs "
                f"{self.contract_id}): " + "; ".join(diffs)
                + ". Re-capture with the expected target, template and layer ids."
            )


def build_contract(
    algorithm: str,
    *,
    target_fingerprint: str,
    template_fingerprint: str,
    num_target_layers: int,
    hidden_size: int,
    layer_ids: list[int] | tuple[int, ...] | None = None,
    dtype: str = "bfloat16",
) -> CaptureContract:
    """Validate a capture request against the algorithm's spec and the target's shape."""
    spec = get_contract_spec(algorithm)
    if dtype not in STORAGE_DTYPES:
        raise ValueError(f"unknown storage dtype {dtype!r}; valid dtypes: {sorted(STORAGE_DTYPES)}")
    ids = tuple(spec.default_layer_ids(num_target_layers) if layer_ids is None else layer_ids)
    if not ids:
        raise ValueError("capture.layer_ids is empty; list at least one decoder layer id")
    bad = [i for i in ids if not 0 <= i < num_target_layers]
    if bad:
        raise ValueError(
            f"capture.layer_ids {list(bad)} out of range: the target has {num_target_layers} "
            f"decoder layers, so valid ids are 0..{num_target_layers - 1} (decoder-layer outputs)"
        )
    if len(set(ids)) != len(ids):
        raise ValueError(f"capture.layer_ids {list(ids)} repeats a layer; list each layer once")
    if spec.num_layer_ids is not None and len(ids) != spec.num_layer_ids:
        raise ValueError(
            f"{algorithm} fuses exactly {spec.num_layer_ids} target layers, capture.layer_ids has "
            f"{len(ids)}; use e.g. {list(spec.default_layer_ids(num_target_layers))}"
        )
    return CaptureContract(
        algorithm=algorithm,
        target_fingerprint=target_fingerprint,
        template_fingerprint=template_fingerprint,
        num_target_layers=num_target_layers,
        hidden_size=hidden_size,
        layer_ids=ids,
        last_hidden=spec.needs_last_hidden,
        dtype=dtype,
    )
