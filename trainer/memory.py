"""The memory of a trainer rank, estimated from shapes alone (``specray plan``; nothing is allocated).

A rank holds, for the whole run (``static``):

- the target's heads it reads (``load_target(weights="heads")``): embedding ``[V, D]``, the LM
  head ``[V, D]`` unless tied, the final norm; in the target's dtype under bf16 training, else fp32;
- the drafter's parameters ``P`` (fp32, counted on a meta-device build of the registered model)
  and AdamW's two moments (2 × P fp32); the gradients (P fp32) from the backward to ``zero_grad``;
- the micro-batch on the device: features ``[B, S, L·D]`` (+ ``[B, S, D]`` last hidden states)
  in fp32, token ids and masks.

On top of that, one micro-batch's forward keeps the tensors its backward needs, and short-lived
tensors (a softmax's scores, a loss's gradient) join them at moments (``ActivationMemory``). That
account comes from the algorithm's train strategy, ``activation_memory(config, objective, shape)``
on its class (``trainer/strategies/<algorithm>.py``), which counts the tensors its ``forward_loss``
builds, in order, with the helpers below (one per building block). Elements are
``shape.act_bytes`` wide (4 in fp32; 2 under bf16 autocast, where norms, softmaxes and losses
stay fp32).

The peak is ``static + activations.peak + gradients``. ``tests/pipeline/test_plan.py`` measures real steps
on the CPU (resident memory of a subprocess) and holds the estimate within 20 %.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from specray.trainer.vocab_loss import rows_per_chunk

FP32 = 4


@dataclass(frozen=True)
class StepShape:
    """One micro-batch: ``batch`` sequences of ``seq_len`` tokens, every token supervised (the worst case)."""

    batch: int  # B
    seq_len: int  # S
    act_bytes: int = FP32  # bytes per activation element: 4 (fp32) or 2 (bf16 autocast)

    @property
    def rows(self) -> int:
        return self.batch * self.seq_len


@dataclass
class ActivationMemory:
    """One micro-batch's activations, in bytes, counted in the order the step builds them: ``saved``
    (alive from then on) grows with ``keep``; ``spike`` marks a moment when short-lived tensors
    join what is alive so far; ``peak`` is the most at any moment. A tensor kept ``forward_only``
    (alive through the forward, saved by no backward: a teacher) is gone at a backward moment
    (``spike(..., backward=True)``: a recomputed chunk). ``parts`` names what is saved (the
    plan's table)."""

    saved: float = 0.0
    forward_only: float = 0.0
    peak: float = 0.0
    parts: dict[str, float] = field(default_factory=dict)

    def keep(self, name: str, num_bytes: float, *, forward_only: bool = False) -> None:
        """``num_bytes`` more alive from now, under ``name``: until the backward, or through the
        forward only."""
        self.saved += num_bytes
        self.forward_only += num_bytes if forward_only else 0.0
        self.parts[name] = self.parts.get(name, 0.0) + num_bytes
        self.peak = max(self.peak, self.saved)

    def spike(self, num_bytes: float, *, backward: bool = False) -> None:
        """Short-lived tensors of ``num_bytes`` alive now, on top of what is alive so far (in the
        backward, without what the forward alone held)."""
        self.peak = max(self.peak, self.saved - (self.forward_only if backward else 0.0) + num_bytes)

    def attention(self, costs: tuple[float, float, float]) -> None:
        """An attention's ``chunked_attention`` costs: its forward's short-lived tensors, its kept
        tensors, then its backward's short-lived tensors."""
        forward, kept, backward = costs
        self.spike(forward)
        self.keep("attention", kept)
        self.spike(backward, backward=True)


# -- building blocks: bytes a block's forward keeps for the backward ------------------------------


def rmsnorm(rows: float, width: int, a: int) -> float:
    """``RMSNorm`` (drafters/common.py) on ``rows × width``: the normalised product and the output
    (fp32 math; under bf16 the input's fp32 copy too)."""
    return rows * width * (2 * FP32 + (FP32 if a < FP32 else 0))


def rope(rows: float, heads: int, head_dim: int, a: int) -> float:
    """``apply_rope`` on ``rows × heads × head_dim``: the half-swapped copy and the rotated output
    (its input is kept too; the caller counts it, as the output of what produced it)."""
    return 2 * rows * heads * head_dim * a


def swiglu(rows: float, intermediate: int, a: int) -> float:
    """``down(silu(gate(x)) * up(x))``: gate, silu, up and their product, ``rows × intermediate`` each."""
    return 4 * rows * intermediate * a


def chunked_attention(batch: int, heads: int, queries: int, keys: int, a: int, *, chunk: int,
                      mask_rows: int = 0) -> tuple[float, float, float]:
    """Attention of ``queries`` rows over ``keys`` keys each through ``chunked_rows``, ``chunk`` rows at
    a time (``drafters/common.py``), fp32 softmax: (short-lived in the forward, kept, short-lived in
    the backward; ``ActivationMemory.attention``).

    In one chunk it keeps its probabilities (fp32, and their ``a``-byte copy under bf16) and its
    boolean mask (``mask_rows × keys`` bytes: ``batch × queries`` for a per-sequence mask, 0 for a
    shared one); two more score tensors live briefly, in the forward and the backward. In several
    chunks it keeps nothing (its backward recomputes each chunk): two tensors of one chunk's scores
    are alive at a time in the forward (the scores, the probabilities), three in the backward (the
    recomputed probabilities, their gradient, the scores' gradient)."""
    rows = min(queries, chunk)
    scores = batch * heads * rows * keys * FP32
    if queries <= chunk:
        return 2 * scores, scores * (1 + (a / FP32 if a < FP32 else 0)) + mask_rows * keys, 2 * scores
    return 2 * scores, 0.0, 3 * scores


def vocab_rows(rows: float, width: int, tensors: int) -> float:
    """``tensors`` fp32 ``[rows, width]`` tensors over a (draft) vocabulary of ``width``."""
    return rows * width * FP32 * tensors


def chunked_vocab(rows: float, width: int, *, kept: int, short: int) -> tuple[float, float]:
    """A loss over a ``width``-wide vocabulary on ``rows`` rows through ``over_rows``
    (``trainer/vocab_loss.py``): (kept, short-lived). In one chunk it keeps ``kept`` fp32
    ``[rows, width]`` tensors and ``short`` more live briefly; in several it keeps its per-row
    outputs only (a float and an index per row), and one chunk's ``kept + short`` tensors are alive
    at a time (its recomputation in the backward)."""
    chunk = rows_per_chunk(width)
    if rows <= chunk:
        return vocab_rows(rows, width, kept), vocab_rows(rows, width, short)
    return rows * (FP32 + 8), vocab_rows(chunk, width, kept + short)


# -- the whole rank -----------------------------------------------------------------------------


@dataclass(frozen=True)
class RankMemory:
    """A trainer rank's peak, in bytes, split as the module docstring says."""

    heads: float
    parameters: float
    gradients: float
    optimizer: float
    batch: float
    activations: ActivationMemory
    num_parameters: int

    @property
    def static(self) -> float:
        """What the rank holds through every step: heads, parameters, AdamW's moments, the micro-batch."""
        return self.heads + self.parameters + self.optimizer + self.batch

    @property
    def peak(self) -> float:
        """The static part, the activations' peak and the gradients: the backward fills the gradients
        while the activations of the layers it has not reached are still kept."""
        return self.static + self.activations.peak + self.gradients


def drafter_parameters(algorithm: str, model_cfg) -> int:
    """Trainable parameters of the registered drafter of ``model_cfg``, built on the meta device."""
    from specray.drafters import get_drafter

    with torch.device("meta"):
        embed = nn.Embedding(model_cfg.vocab_size, model_cfg.hidden_size)
        head = nn.Linear(model_cfg.hidden_size, model_cfg.vocab_size, bias=False)
        model = get_drafter(algorithm).model(model_cfg, embed_tokens=embed, lm_head=head)
    return sum(p.numel() for p in model.parameters())


def rank_memory(strategy, model_cfg, objective, shape: StepShape, *, heads_bytes: float, batch_width: int,
                head_element_bytes: int = FP32, num_parameters: int | None = None) -> RankMemory:
    """The peak of one rank training ``model_cfg`` with ``strategy`` (its class) on ``shape``.

    ``heads_bytes``: the target's heads as the rank reads them (``head_element_bytes`` per element);
    ``batch_width``: the features' fp32 elements per token (``L·D``, + ``D`` with last hidden states)."""
    P = drafter_parameters(strategy.algorithm, model_cfg) if num_parameters is None else num_parameters
    V_d = model_cfg.draft_vocab_size
    # a draft vocabulary's LM head rows, copied once (DraftVocabHead.head)
    head_rows = V_d * model_cfg.hidden_size * head_element_bytes if V_d is not None else 0.0
    batch = shape.rows * (batch_width * FP32 + 8 + 2)  # features, int64 ids, two bool masks
    return RankMemory(heads=heads_bytes + head_rows, parameters=P * FP32, gradients=P * FP32, optimizer=2 * P * FP32,
                      batch=batch, activations=strategy.activation_memory(model_cfg, objective, shape),
                      num_parameters=P)
