"""Model pieces every drafter shares: the small-M linear, the frozen target linear, RMSNorm, RoPE,
the draft vocabulary, and the base of the manifest's ``drafter`` section.

- ``small_m_linear`` / ``Linear``: at inference with a handful of rows on CPU, ``x @ Wᵀ`` takes
  ``(W @ xᵀ)ᵀ`` (``weight_major_linear``); training keeps ``F.linear``.
- ``FrozenLinear``: the serving runner's product for a frozen target weight (oneDNN on a
  prepacked copy; for a few fp32 rows our own product on the weight as stored or ``F.linear``,
  where ``pick_kernels`` measured it faster on this machine).
- ``chunked_rows``: attention computed a bounded number of queries at a time
  (``ATTENTION_QUERY_CHUNK``), each chunk recomputed in the backward, so the scores alive at any
  moment are ``[chunk, keys]`` and what the backward keeps is linear in the sequence; the
  trainer's vocabulary losses run through it the same way (``trainer/vocab_loss.py``).
- ``RMSNorm``; RoPE lives in ``drafters/rope.py`` (transformers' inverse frequencies for every
  RoPE type; ``apply_rope`` with angles per position, ``rope_table`` / ``apply_rope_table`` from a
  precomputed, sign-folded table, the serving runner's form), re-exported here.
- **Draft vocabulary** (EAGLE-3's ``d2t`` / ``t2d``): a drafter may predict over ``V_d`` target
  tokens only, the ascending ids of its ``draft_vocab`` buffer. ``DraftVocabHead`` gives a drafter
  the buffer, the frozen target LM head restricted to those rows (``logits``) and the mappings
  ``target_to_draft`` / ``draft_to_target`` / ``to_target_distribution``, so verification stays
  over the whole target vocabulary (zero probability outside the draft vocabulary).
  ``d2t_offsets`` / ``t2d_mask`` are the same mapping in the peer format's encoding.
- ``DrafterSectionBase``: the fields every drafter section has (``algorithm``, ``init_from``,
  ``init_layers``, ``draft_vocab_size``, ``draft_vocab_from``, ``draft_vocab_samples``); each
  algorithm adds its own fields and ``drafter_config``.
- ``DrafterSpec``: what the drafter registry (``specray.drafters.DRAFTERS``) holds per algorithm.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Literal

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint
from pydantic import BaseModel, ConfigDict, Field, model_validator
from torch import nn

from specray.drafters.rope import RopeSpec, apply_rope, apply_rope_table, rope_frequencies, rope_table  # noqa: F401
from specray.drafters.target_spec import check_supported
from specray.kernels import decode_cpu

SMALL_M = 64  # inference products with at most this many rows take the (W @ xᵀ)ᵀ layout
ATTENTION_QUERY_CHUNK = 256  # queries whose attention scores are computed together (``chunked_rows``)


def chunked_rows(rows: Callable[[int, int], Any], count: int, chunk: int, *, dim: int = -2) -> Any:
    """``rows(start, stop)`` over ``0 … count`` in ranges of ``chunk``, its outputs (a tensor or a tuple
    of tensors) concatenated on ``dim``.

    One range is one call. With several, under autograd each range is checkpointed (no
    re-entrant autograd, no RNG state: the functions draw nothing): its forward keeps only its
    outputs, and the backward recomputes the range, one range at a time. So an attention over
    ``count`` queries and ``K`` keys never holds more than ``chunk × K`` scores, and keeps
    ``count × head_dim`` for its backward instead of ``count × K``; a loss over a vocabulary keeps
    one chunk's ``[chunk, V]`` logits at a time."""
    if count <= chunk:
        return rows(0, count)
    ranges = [(start, min(start + chunk, count)) for start in range(0, count, chunk)]
    if torch.is_grad_enabled():
        parts = [checkpoint(rows, start, stop, use_reentrant=False, preserve_rng_state=False) for start, stop in ranges]
    else:
        parts = [rows(start, stop) for start, stop in ranges]
    if isinstance(parts[0], tuple):
        return tuple(torch.cat(column, dim=dim) for column in zip(*parts))
    return torch.cat(parts, dim=dim)


def weight_major_linear(weight: torch.Tensor, x: torch.Tensor, residual: torch.Tensor | None = None, *,
                        row_major: bool = True) -> torch.Tensor:
    """``x @ weightᵀ (+ residual)``: x [M, in] row-major, weight [out, in] -> [M, out].

    Computed as ``(weight @ xᵀ)ᵀ``: for M >= 2 MKL's gemm then streams the weights at several
    times the speed of the ``x @ Wᵀ`` kernel ``F.linear`` uses at small M (docs/benchmarks.md).
    The product is [out, M]; the residual add writes it back row-major, or ``row_major=False``
    leaves the transposed view for ops that copy anyway.
    """
    out = torch.mm(weight, x.t()).t()  # [M, out], a transposed view of the [out, M] product
    if residual is not None:
        return residual + out
    return out.contiguous() if row_major else out


def small_m_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ weightᵀ (+ bias)`` for x [..., in]; at inference with few rows on CPU, ``weight_major_linear``.

    Serving runs a drafter on a handful of rows, where ``F.linear``'s ``x @ Wᵀ`` takes a slow
    small-M path on CPU (2–6× slower than the weight-major gemm for SmolLM2's shapes). A lone
    row is computed twice: a 2-row gemm beats the mat-vec (an expanded view's zero stride sends
    ``mm`` to a slow path, so the copy is contiguous). Training (grad enabled) keeps ``F.linear``.
    """
    flat = x.reshape(-1, x.shape[-1])
    if not 0 < flat.shape[0] <= SMALL_M or torch.is_grad_enabled() or flat.device.type != "cpu":
        return F.linear(x, weight, bias)
    rows = flat if len(flat) > 1 else flat.expand(2, -1).contiguous()
    out = weight_major_linear(weight, rows, row_major=False)[: len(flat)]
    if bias is not None:
        out = out + bias
    return out.reshape(*x.shape[:-1], out.shape[-1])


class FrozenLinear:
    """``x @ weightᵀ (+ bias) (+ residual)`` for a frozen [out, in] weight (and optional [out] bias)
    at inference: x [M, in] -> [M, out].

    The serving runner's product (``serving/runner.py``), with a kernel per row count M:

    - ``packed``: oneDNN's matmul on a copy of the weight prepacked once in its blocked layout
      (the kernel vLLM-CPU runs its linears with); every M in bf16, and every M above the picked
      counts;
    - ``native``: ``kernels/decode_cpu.py::linear`` on the weight as stored (fp32 on CPU, where
      the fused kernels built): streams the weight once for a few rows;
    - ``blas``: ``F.linear`` on the weight as stored.

    Which is fastest for a few rows depends on the CPU (its vector width, its BLAS, its memory),
    so ``pick_kernels`` times them on a model's chain of products and sets ``kernels`` (the
    runner does this once per model). Measured on the embedded target's chain
    (docs/benchmarks.md, Our AR against vLLM-CPU): on an Intel Sapphire Rapids VM ``F.linear`` 26 ms at 1-2
    rows against 32-36 ms prepacked; on an AMD EPYC (Zen 4) VM, where MKL takes a generic path,
    ``F.linear`` 51 / 88 ms at 1 / 2 rows against 27 ms prepacked; on an AMD EPYC VM without
    AVX-512, ``native`` 36 / 53 ms at 1 / 4 rows against 48 / 66 ms prepacked, and prepacked at 16
    rows. Until picked, fp32 takes ``F.linear`` for 1-2 rows.

    Without oneDNN's prepacked kernel (a torch build without mkldnn, a non-CPU weight, or bf16 on
    a CPU without AVX-512 or AVX-NE-CONVERT, where oneDNN refuses to pack it) every M takes
    ``F.linear``. The packed copy costs the weight's size again in memory.
    """

    PACK_ROWS = 16  # the row count oneDNN lays the packed weight out for (it serves any M)

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None):
        self.weight = weight.detach()  # [out, in]
        self.bias = None if bias is None else bias.detach().contiguous()  # [out], added by every kernel
        self.packed = _prepack(self.weight, self.PACK_ROWS)
        # (rows, kernel) ascending: M takes the kernel of the first entry with rows >= M; past the last, packed
        self.kernels: list[tuple[int, str]] = [(2, "blas")] if self.weight.dtype == torch.float32 else []

    def kernel(self, rows: int) -> str:
        if self.packed is None:
            return "blas"
        return next((kernel for upto, kernel in self.kernels if rows <= upto), "packed")

    def product(self, kernel: str, x: torch.Tensor) -> torch.Tensor:
        """``x @ weightᵀ (+ bias)`` [M, out] with ``kernel`` ("packed", "native" or "blas")."""
        if kernel == "packed":
            return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")
        if kernel == "native":
            out = decode_cpu.linear(x.contiguous(), self.weight)
            return out if self.bias is None else out.add_(self.bias)
        return F.linear(x, self.weight, self.bias)

    def __call__(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        out = self.product(self.kernel(len(x)), x)
        return out if residual is None else out.add_(residual)


def _prepack(weight: torch.Tensor, rows: int) -> torch.Tensor | None:
    """oneDNN's blocked copy of ``weight`` for ``_linear_pointwise``, or None where it has none."""
    if weight.device.type != "cpu" or not torch.backends.mkldnn.is_available():
        return None
    try:
        return torch.ops.mkldnn._reorder_linear_weight(weight, rows)
    except RuntimeError:  # e.g. "bf16 path needs the cpu support avx_ne_convert or avx512bw, ..."
        return None


PICK_ROWS = (1, 2, 4, 8, 16)  # the row counts pick_kernels times (a decode step to a batch-16 step)
PICK_BLAS_ROWS = 2  # F.linear is timed up to here only: on no CPU measured did it win at more rows
PICK_PRODUCTS = 33  # the first products of the chain timed (8 layers of 4 and the LM head; more than a cache)


def pick_kernels(chain: list[FrozenLinear], *, rows: tuple[int, ...] = PICK_ROWS, repeats: int = 3) -> dict[int, str]:
    """Time the kernels (``FrozenLinear``) on ``chain`` (a forward's products, in order: its first
    ``PICK_PRODUCTS`` and its last, enough weights to stream from memory as a forward does) at each
    of ``rows``: the best of ``repeats`` interleaved runs after a warm-up. Set every product's
    ``kernels`` so that a row count takes the kernel that was fastest at the smallest timed count
    at or above it (packed past the largest), and return {rows: kernel}. Only fp32 chains with
    packed weights have a choice."""
    if not chain or any(lin.packed is None or lin.weight.dtype != torch.float32 for lin in chain):
        return {}
    import time

    timed = chain[:PICK_PRODUCTS] + chain[-1:] if len(chain) > PICK_PRODUCTS else chain
    native = decode_cpu.available() and all(lin.weight.is_contiguous() for lin in chain)

    def run(kernel: str, inputs: list[torch.Tensor]) -> float:
        begin = time.perf_counter()
        for x, lin in zip(inputs, timed):
            lin.product(kernel, x)
        return time.perf_counter() - begin

    picked = {}
    with torch.inference_mode():
        for count in sorted(rows):
            inputs = [torch.randn(count, lin.weight.shape[1]) for lin in timed]
            candidates = ["packed", *(["native"] if native else []), *(["blas"] if count <= PICK_BLAS_ROWS else [])]
            times = {kernel: [] for kernel in candidates}
            for rep in range(repeats + 1):
                for kernel in candidates:
                    elapsed = run(kernel, inputs)
                    if rep:  # the first pass warms each
                        times[kernel].append(elapsed)
            picked[count] = min(candidates, key=lambda kernel: min(times[kernel]))
    for lin in chain:
        lin.kernels = sorted(picked.items())
    return picked


class Linear(nn.Linear):
    """``nn.Linear`` (same parameters and state-dict keys) whose inference takes ``small_m_linear``."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return small_m_linear(x, self.weight, self.bias)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


# -- the draft vocabulary (d2t / t2d) ----------------------------------------------------------


def check_draft_vocab(ids: torch.Tensor, draft_vocab_size: int | None, vocab_size: int) -> None:
    """Raise ValueError unless ``ids`` are ``draft_vocab_size`` distinct ascending ids in [0, V)."""
    if draft_vocab_size is None:
        raise ValueError("this drafter has no draft vocabulary (draft_vocab_size is None)")
    if ids.ndim != 1 or len(ids) != draft_vocab_size:
        raise ValueError(f"the draft vocabulary needs {draft_vocab_size} token ids, got shape {tuple(ids.shape)}")
    if len(ids) and (int(ids.min()) < 0 or int(ids.max()) >= vocab_size):
        raise ValueError(f"draft vocabulary ids must be in [0, {vocab_size}), got [{int(ids.min())}, {int(ids.max())}]")
    if len(ids) > 1 and not bool((ids[1:] > ids[:-1]).all()):
        raise ValueError("draft vocabulary ids must be distinct and ascending")


def target_to_draft(token_ids: torch.Tensor, draft_vocab: torch.Tensor | None, vocab_size: int) -> torch.Tensor:
    """Draft-vocabulary index of each target id, −1 outside it (the identity without a vocabulary).

    Example: draft_vocab ``[2, 5, 9]``: target ids ``[5, 3, 9] -> [1, -1, 2]``.
    """
    if draft_vocab is None:
        return token_ids
    lookup = torch.full((vocab_size,), -1, dtype=torch.long, device=token_ids.device)
    lookup[draft_vocab] = torch.arange(len(draft_vocab), device=token_ids.device)
    return lookup[token_ids]


def draft_to_target(index: torch.Tensor, draft_vocab: torch.Tensor | None) -> torch.Tensor:
    """Target ids of draft-vocabulary indices: draft_vocab ``[2, 5, 9]``: ``[1, 2] -> [5, 9]``."""
    return index if draft_vocab is None else draft_vocab[index]


def to_target_distribution(q: torch.Tensor, draft_vocab: torch.Tensor | None, vocab_size: int) -> torch.Tensor:
    """A distribution over the draft vocabulary [..., V_d] as one over the target's [..., V] (zeros outside)."""
    if draft_vocab is None:
        return q
    full = q.new_zeros(*q.shape[:-1], vocab_size)
    full[..., draft_vocab] = q
    return full


def d2t_offsets(draft_vocab: torch.Tensor) -> torch.Tensor:
    """[V_d] the peer format's ``d2t``: target id = draft index + d2t[index] (draft_vocab ``[2, 5, 9]`` -> ``[2, 4, 7]``)."""
    return draft_vocab - torch.arange(len(draft_vocab), device=draft_vocab.device)


def t2d_mask(draft_vocab: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[V] bool, the peer format's ``t2d``: True where a target id is in the draft vocabulary."""
    mask = torch.zeros(vocab_size, dtype=torch.bool, device=draft_vocab.device)
    mask[draft_vocab] = True
    return mask


class DraftVocabHead:
    """Mixin for an ``nn.Module`` drafter whose LM head is the target's, optionally restricted.

    The drafter calls ``init_draft_vocab()`` in its constructor and keeps ``self.config``
    (``vocab_size``, ``draft_vocab_size``) and an ``lm_head`` property (the frozen target head).
    The ``draft_vocab`` buffer (target ids, ascending) is part of the drafter's state dict and
    export; ``set_draft_vocab`` installs it.
    """

    def init_draft_vocab(self) -> None:
        V_d = self.config.draft_vocab_size
        self.register_buffer("draft_vocab", None if V_d is None else torch.arange(V_d), persistent=True)
        self._head_cache: tuple[tuple, torch.Tensor, torch.Tensor | None] | None = None

    def validate_state(self) -> None:
        """Raise ValueError if loaded state is inconsistent with the config (a bad draft vocabulary)."""
        if self.draft_vocab is not None:
            check_draft_vocab(self.draft_vocab, self.config.draft_vocab_size, self.config.vocab_size)

    def set_draft_vocab(self, token_ids: torch.Tensor) -> None:
        """Install the draft vocabulary: ``draft_vocab_size`` distinct target token ids."""
        ids = torch.as_tensor(token_ids, dtype=torch.long).flatten().sort().values
        check_draft_vocab(ids, self.config.draft_vocab_size, self.config.vocab_size)
        self.draft_vocab.copy_(ids)

    def head(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The LM head rows the drafter predicts over: all V, or the draft vocabulary's V_d (cached)."""
        weight, bias = self.lm_head.weight, self.lm_head.bias
        if self.draft_vocab is None:
            return weight, bias
        key = (self.draft_vocab.data_ptr(), self.draft_vocab._version, weight.data_ptr(), weight._version)
        if self._head_cache is None or self._head_cache[0] != key:
            rows = weight.detach()[self.draft_vocab]  # frozen, so a copy is exact
            self._head_cache = (key, rows, None if bias is None else bias.detach()[self.draft_vocab])
        return self._head_cache[1], self._head_cache[2]

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The shared LM head over [..., D] -> [..., V], or [..., V_d] over the draft vocabulary's rows.

        Serving drafts a few rows: there, on CPU, ``x @ Wᵀ`` for the [V, D] head runs through a
        slow small-M path (35 ms for 7 rows of SmolLM2's 49,152 × 576 head, against 8 ms
        weight-major), so inference with at most ``SMALL_M`` rows takes ``small_m_linear``;
        training keeps ``F.linear`` (bit-identical gradients).
        """
        weight, bias = self.head()
        return small_m_linear(hidden.to(weight.dtype), weight, bias)

    def target_to_draft(self, token_ids: torch.Tensor) -> torch.Tensor:
        return target_to_draft(token_ids, self.draft_vocab, self.config.vocab_size)

    def draft_to_target(self, index: torch.Tensor) -> torch.Tensor:
        return draft_to_target(index, self.draft_vocab)

    def to_target_distribution(self, q: torch.Tensor) -> torch.Tensor:
        return to_target_distribution(q, self.draft_vocab, self.config.vocab_size)


# -- the manifest's drafter section ------------------------------------------------------------


class DrafterSectionBase(BaseModel):
    """Fields every algorithm's ``drafter`` section has.

    Each algorithm subclasses it with ``algorithm: Literal["<name>"]`` (the union's
    discriminator), its architecture fields, and ``drafter_config(target, layer_ids)``: the
    model config for this section, sizes left unset taken from the target (duck-typed:
    ``hidden_size``, ``vocab_size``, ``config``, ``tokenizer``), reading the captured
    ``layer_ids``.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    algorithm: str = Field(description="drafter to train; its features must be captured under its capture contract")
    init_from: str | None = Field(None, description="an export directory to start from (fine-tuning, e.g. on "
                                                    "self-distilled data), or a peer drafter's directory "
                                                    "(speculators, SGLang / SpecForge, z-lab), imported first; its "
                                                    "architecture must equal this section's")
    init_layers: Literal["random", "target"] = Field(
        "random", description="the decoder layers' initial weights: random, or target: draft layer i of k starts "
                              "as a copy of the target's decoder layer L-k+i (its top k layers), each tensor the "
                              "drafter names a target role for (trainer/init_layers.py); the drafter's widths must "
                              "be the target's")
    draft_vocab_size: int | None = Field(None, gt=0, description="draft over the V_d most frequent supervised tokens "
                                                                 "of the training manifest or draft_vocab_from "
                                                                 "(EAGLE-3's d2t; None = the target's whole "
                                                                 "vocabulary); with init_from, the export's vocabulary "
                                                                 "if it has one of this size")
    draft_vocab_from: str | None = Field(
        None, description="count the draft vocabulary from this instead of the training manifest (what online "
                          "training needs): a manifest URI, or a dataset (sharegpt, jsonl:PATH, records:URI) whose "
                          "answers are rendered with the target's chat template and counted")
    draft_vocab_samples: int | None = Field(
        None, gt=0, description="with a dataset draft_vocab_from: count its first N conversations (None = all)")

    @model_validator(mode="after")
    def _one_source_of_layers(self):
        if self.init_from is not None and self.init_layers == "target":
            raise ValueError(f"init_from={self.init_from} supplies every layer from an export and init_layers=target "
                             "copies the target's top layers: remove one (init_layers=random fine-tunes the export)")
        return self

    @model_validator(mode="after")
    def _vocab_source_needs_a_size(self):
        if self.draft_vocab_from is not None and self.draft_vocab_size is None:
            raise ValueError(f"draft_vocab_from={self.draft_vocab_from} counts a draft vocabulary of draft_vocab_size "
                             "tokens: set draft_vocab_size (e.g. 8192) or remove draft_vocab_from")
        if self.draft_vocab_samples is not None and self.draft_vocab_from is None:
            raise ValueError("draft_vocab_samples limits the conversations of a dataset draft_vocab_from: set "
                             "draft_vocab_from (e.g. sharegpt) or remove draft_vocab_samples")
        return self


def target_config(target: Any):
    """The target's transformers config: ``Target.config`` (set with any weights loaded, or none:
    capture/target.py), or a duck-typed target's ``model.config``."""
    config = getattr(target, "config", None)
    return config if config is not None else target.model.config


# -- bounds of a drafter config (checked before an export is built, drafters/format.py) ----------

MAX_DRAFT_LAYERS = 64  # decoder layers of a drafter, and captured target layers it reads
MAX_TARGET_LAYER_ID = 1023  # the highest target decoder-layer id a config may name
MAX_WIDTH_MULTIPLE = 16  # intermediate_size <= 16 D (Llama-family MLPs are 2.7-5.4 D)
MAX_HEADS_MULTIPLE = 8  # num_heads, num_kv_heads, head_dim, num_heads * head_dim <= 8 D
MAX_RANK_MULTIPLE = 8  # low-rank heads and codebooks: rank <= 8 D


def size_limits(hidden_size: int, vocab_size: int) -> dict[str, tuple[float, float]]:
    """Inclusive bounds of the fields every drafter config has, for a target of width ``D =
    hidden_size`` and vocabulary ``V = vocab_size``: the embedding and LM head are the target's,
    so ``hidden_size`` and ``vocab_size`` equal them; the sizes are positive and bounded by a
    multiple of D (the constants above). A config's ``limits`` adds its own fields; element
    bounds of ``target_layer_ids`` apply to each id (at most ``MAX_DRAFT_LAYERS`` of them)."""
    D, V = hidden_size, vocab_size
    return {
        "hidden_size": (D, D), "vocab_size": (V, V), "num_layers": (1, MAX_DRAFT_LAYERS),
        "num_heads": (1, MAX_HEADS_MULTIPLE * D), "num_kv_heads": (1, MAX_HEADS_MULTIPLE * D),
        "head_dim": (1, MAX_HEADS_MULTIPLE * D), "intermediate_size": (1, MAX_WIDTH_MULTIPLE * D),
        "draft_vocab_size": (1, V), "target_layer_ids": (0, MAX_TARGET_LAYER_ID),
        "rms_norm_eps": (1e-12, 0.1), "rope_theta": (1.0, 1e12), "max_position_embeddings": (1, 1 << 24),
    }


def target_sizes(target: Any) -> dict:
    """The target's shapes a drafter config defaults to: heads, KV heads, head dim, MLP width, norm
    eps, and its RoPE (``rope_theta``, ``rope_scaling``: transformers' rope parameters besides the
    theta, None for the default type, and ``max_position_embeddings``), from ``check_supported``:
    a drafter rotates by the target's rule (``drafters/rope.py``)."""
    spec = check_supported(target_config(target))
    return {
        "num_heads": spec.num_heads,
        "num_kv_heads": spec.num_kv_heads,
        "head_dim": spec.head_dim,
        "intermediate_size": spec.intermediate_size,
        "rms_norm_eps": spec.rms_norm_eps,
        **target_rope(target),
    }


def target_rope(target: Any) -> dict:
    """A drafter config's RoPE fields for ``target``: ``rope_theta``, ``rope_scaling`` and
    ``max_position_embeddings`` (``target_sizes``)."""
    rope = check_supported(target_config(target)).rope
    return {"rope_theta": rope.theta, "rope_scaling": rope.scaling,
            "max_position_embeddings": rope.max_position_embeddings}


def drafter_rope(config: Any) -> RopeSpec:
    """The ``RopeSpec`` of a drafter config (its ``head_dim``, ``rope_theta``, ``rope_scaling``,
    ``max_position_embeddings``)."""
    return RopeSpec.of(config.head_dim, config.rope_theta, config.rope_scaling, config.max_position_embeddings)


def check_drafter_rope(config: Any) -> None:
    """Raise ValueError naming the field unless a drafter config's RoPE is one ``drafters/rope.py`` computes."""
    rope_frequencies(drafter_rope(config))


class RotaryFrequencies:
    """A drafter attention's RoPE from its config's RoPE fields: transformers' ``inv_freq`` [hd/2]
    (float32, kept off the module: no state-dict entry, and a module cast to bf16 does not round
    it) and attention scaling; ``rotate(x, positions)`` is ``apply_rope`` with them."""

    def __init__(self, config: Any):
        inv_freq, self.scaling = rope_frequencies(drafter_rope(config))
        self._inv_freq = {inv_freq.device: inv_freq}  # device -> the float32 frequencies there

    def rotate(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """x [..., H, T, hd] at positions [..., T] -> rotated, the same shape."""
        inv_freq = self._inv_freq.get(x.device)
        if inv_freq is None:
            inv_freq = self._inv_freq[x.device] = next(iter(self._inv_freq.values())).to(x.device)
        return apply_rope(x, positions, inv_freq, self.scaling)


@dataclass(frozen=True)
class DrafterSpec:
    """One algorithm's drafter, as the registry (``specray.drafters.DRAFTERS``) holds it.

    - ``section``: its variant of the manifest's ``drafter`` union (a ``DrafterSectionBase``
      subclass with ``algorithm: Literal["<name>"]`` and ``drafter_config(target, layer_ids)``);
    - ``config``: its model config dataclass (``to_dict()`` / ``from_dict()``, the export's
      ``architecture``; fields ``hidden_size``, ``vocab_size``, ``target_layer_ids``,
      ``draft_vocab_size``; ``limits(hidden_size, vocab_size)``: the inclusive bounds of every
      numeric field, ``size_limits`` and the algorithm's own, checked before an export is built);
    - ``model``: its module, ``model(config, embed_tokens=, lm_head=)`` with a class attribute
      ``algorithm``, the target's embedding and LM head shared (not in its state dict),
      ``DraftVocabHead``'s methods, its decoder layers as ``layers`` and
      ``target_layer_tensors(index)``: {tensor of draft layer ``index``: the target decoder layer's
      tensor of the same role} (``drafter.init_layers=target``, ``trainer/init_layers.py``);
    - ``debug_config(target, layer_ids=None)``: a tiny config for tests on ``target``.
    """

    section: type[DrafterSectionBase]
    config: type
    model: type[nn.Module]
    debug_config: Callable[..., Any]
