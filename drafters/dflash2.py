"""DFlash 2 drafter (seed §6): DFlash plus a grouped dynamic convolution and a candidate selector.

The backbone is DFlash's (``drafters/dflash.py``: block input, KV injection, mask, shared
embedding and LM head). Two parts are added, each initialised so that a fresh DFlash 2 computes
exactly what the DFlash with the same backbone weights computes (a safe warm start, §6.3–§6.4):

**Grouped dynamic depthwise convolution (§6.3).** Around the attention and the MLP of every
layer, a causal convolution over the block's positions, ``kernel`` taps, channels in groups of
``G`` (``conv_group_size``) sharing the dynamic part of their coefficients::

    y[j, c] = Σ_t (base[t, c] + Δ[j, t, c // G]) · x[j − t, c]      x[j − t] = 0 before the block's start

``Δ`` is a projection of the sublayer's input (``kernel_projection``), one projection giving
the coefficients of both sides: ``prepare`` convolves the sublayer's input and keeps the output
side's ``Δ``; ``finish`` convolves the sublayer's output with it. Taps never cross a block: the
position inside the block is the row index modulo B (blocks lie back to back). Initialisation:
``base[0] = 1``, the other taps 0, the projection 0 — the identity.

**Candidate selector (§6.2).** Per draft position ``j`` the top-K of the unary logits ``U_j``
(the LM head's, K = ``selector_top_k``, at most the draft vocabulary) are the candidates; the
edge score of candidate ``c`` after predecessor ``p`` is::

    S_j(p, c) = U_j(c) + ⟨pred[p] ⊙ W_h h_j, succ[c]⟩            rank r = selector_rank

with ``h_j`` the final normed hidden state (the LM head's input), ``pred`` / ``succ`` codebooks
over the target vocabulary (predecessors include the anchor, any target token). The lattice
``[..., m, K, K]`` holds every edge between adjacent positions' candidates (position 0's
predecessor is the anchor, its K rows are one row repeated); drafting walks it causally
(``kernels/selector_walk.py``). ``succ`` starts at zero, so a fresh selector's edge scores are
the unary logits and its greedy walk is DFlash's argmax.

Parameter names follow speculators' DFlash 2 (``attention_conv`` / ``mlp_conv`` with
``base_kernel [2, kernel, D]`` and ``kernel_projection``; ``candidate_selector`` with
``predecessor_codebook``, ``successor_codebook``, ``hidden_projection``), so its peer export is a
renaming (``drafters/peer.py``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

import torch
from pydantic import Field
from torch import nn

from specray.drafters.common import MAX_RANK_MULTIPLE, Linear
from specray.drafters.dflash import (MAX_BLOCK_SIZE, DFlashConfig, DFlashDrafter, DFlashLayer, DFlashSection,
                                     block_rows)
from specray.drafters.dflash import debug_config as dflash_debug_config


@dataclass(frozen=True)
class DFlash2Config(DFlashConfig):
    conv_kernel_size: int = 2  # taps: the position itself and kernel − 1 before it, inside the block
    conv_group_size: int = 16  # G: channels sharing one dynamic coefficient
    selector_top_k: int = 16  # K: candidates per draft position (capped at the draft vocabulary)
    selector_rank: int = 256  # r: rank of the codebooks and the hidden projection

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.conv_group_size < 1 or self.hidden_size % self.conv_group_size:
            raise ValueError(f"conv_group_size ({self.conv_group_size}) must divide hidden_size ({self.hidden_size})")
        if not 1 <= self.conv_kernel_size <= self.block_size:
            raise ValueError(f"conv_kernel_size must be in [1, block_size={self.block_size}], "
                             f"got {self.conv_kernel_size}")
        if self.selector_top_k < 1 or self.selector_rank < 1:
            raise ValueError(f"selector_top_k and selector_rank must be >= 1, got {self.selector_top_k}, "
                             f"{self.selector_rank}")

    @classmethod
    def limits(cls, hidden_size: int, vocab_size: int) -> dict[str, tuple[float, float]]:
        """DFlash's bounds, the convolution's (taps <= MAX_BLOCK_SIZE, groups of at most D channels) and
        the selector's (K <= V, rank <= MAX_RANK_MULTIPLE · D)."""
        return {**super().limits(hidden_size, vocab_size), "conv_kernel_size": (1, MAX_BLOCK_SIZE),
                "conv_group_size": (1, hidden_size), "selector_top_k": (1, vocab_size),
                "selector_rank": (1, MAX_RANK_MULTIPLE * hidden_size)}

    @property
    def num_candidates(self) -> int:
        """K actually used: ``selector_top_k`` capped at the vocabulary the drafter predicts over."""
        return min(self.selector_top_k, self.draft_vocab_size or self.vocab_size)


class DFlash2Section(DFlashSection):
    """The manifest's ``drafter`` section for ``algorithm: dflash2`` (DFlash's fields and these)."""

    algorithm: Literal["dflash2"] = Field("dflash2", description="drafter to train; its features must be "
                                                                 "captured with capture.algorithm=dflash2")
    conv_kernel_size: int = Field(2, ge=1, description="taps of the grouped dynamic convolution (<= block_size)")
    conv_group_size: int = Field(16, ge=1, description="channels sharing one dynamic coefficient (divides hidden)")
    selector_top_k: int = Field(16, ge=1, description="K: unary candidates the selector walks per position")
    selector_rank: int = Field(256, ge=1, description="rank of the selector's codebooks and hidden projection")

    def drafter_config(self, target: Any, layer_ids: tuple[int, ...]) -> DFlash2Config:
        base = super().drafter_config(target, layer_ids).to_dict()
        return DFlash2Config(**base, conv_kernel_size=self.conv_kernel_size, conv_group_size=self.conv_group_size,
                             selector_top_k=self.selector_top_k, selector_rank=self.selector_rank)


def debug_config(target: Any, layer_ids: tuple[int, ...] | None = None) -> DFlash2Config:
    """DFlash's debug config (``drafters/dflash.py``) with K = 4 candidates of rank 8."""
    base = dflash_debug_config(target, layer_ids).to_dict()
    return DFlash2Config(**base, conv_group_size=16, selector_top_k=4, selector_rank=8)


def grouped_dynamic_conv(x: torch.Tensor, delta: torch.Tensor, base: torch.Tensor, block_size: int) -> torch.Tensor:
    """The convolution (module docstring) of x [Bt, T, D] whose rows are blocks back to back (or
    the first T <= B rows of one block); delta [Bt, T, kernel, D // G], base [kernel, D] -> [Bt, T, D].

    Example (B = 2, kernel 2, base [[1], [0.5]], Δ = 0): rows ``[a, b | c, d] -> [a, b + a/2 | c, d + c/2]``."""
    Bt, T, D = x.shape
    kernel, groups = base.shape[0], delta.shape[-1]
    offset = torch.arange(T, device=x.device) % block_size  # position inside the block
    out = torch.zeros_like(x)
    for t in range(kernel):
        shifted = torch.cat([x.new_zeros(Bt, t, D), x[:, : T - t]], dim=1)  # x[j − t]
        coeff = base[t].to(x.dtype) + delta[:, :, t].repeat_interleave(D // groups, dim=-1)  # [Bt, T, D]
        out = out + torch.where((offset >= t)[None, :, None], coeff * shifted, 0.0)
    return out


class GroupedDynamicConv(nn.Module):
    """``prepare`` / ``finish`` around one sublayer (module docstring), identity at initialisation."""

    def __init__(self, cfg: DFlash2Config):
        super().__init__()
        self.block_size, self.kernel = cfg.block_size, cfg.conv_kernel_size
        self.groups = cfg.hidden_size // cfg.conv_group_size
        self.base_kernel = nn.Parameter(torch.zeros(2, self.kernel, cfg.hidden_size))  # [input/output side, tap, D]
        self.kernel_projection = Linear(cfg.hidden_size, 2 * self.kernel * self.groups, bias=False)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        with torch.no_grad():
            self.base_kernel.zero_()
            self.base_kernel[:, 0] = 1.0
            self.kernel_projection.weight.zero_()

    def prepare(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Sublayer input x [Bt, T, D] -> (convolved x [Bt, T, D], the output side's Δ [Bt, T, kernel, D // G])."""
        delta = self.kernel_projection(x).view(*x.shape[:2], 2, self.kernel, self.groups)
        return grouped_dynamic_conv(x, delta[:, :, 0], self.base_kernel[0], self.block_size), delta[:, :, 1]

    def finish(self, y: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
        """Sublayer output y [Bt, T, D] convolved with ``prepare``'s output-side Δ."""
        return grouped_dynamic_conv(y, delta, self.base_kernel[1], self.block_size)


class DFlash2Layer(DFlashLayer):
    """DFlash's decoder layer with a convolution around its attention and its MLP."""

    def __init__(self, cfg: DFlash2Config):
        super().__init__(cfg)
        self.attention_conv = GroupedDynamicConv(cfg)
        self.mlp_conv = GroupedDynamicConv(cfg)

    def forward(self, x, positions, ctx_k, ctx_v, layout, query_rows: slice | None = None):
        """As DFlash's layer; ``query_rows`` rows are computed from the block's first row on (the
        convolution reads the rows before each), then cut."""
        rows = None if query_rows is None else slice(0, query_rows.stop)
        h, out_delta = self.attention_conv.prepare(self.input_norm(x))
        out = self.attn(h, positions, ctx_k, ctx_v, layout, rows)  # every row's K/V, queries of rows only
        B = self.attn.cfg.block_size
        x, out_delta = block_rows(x, B, rows), block_rows(out_delta, B, rows)
        x = x + self.attention_conv.finish(out, out_delta)
        h, out_delta = self.mlp_conv.prepare(self.post_norm(x))
        x = x + self.mlp_conv.finish(self.mlp(h), out_delta)
        return x if query_rows is None else block_rows(x, query_rows.stop, query_rows)


class CandidateSelector(nn.Module):
    """Top-K candidates and their edge scores (module docstring). Token ids here are target ids."""

    def __init__(self, cfg: DFlash2Config):
        super().__init__()
        self.top_k = cfg.num_candidates
        self.predecessor_codebook = nn.Parameter(torch.randn(cfg.vocab_size, cfg.selector_rank) * 0.02)
        # zero: edges start as the unary logits (no-op transition); it learns first, then the others get signal
        self.successor_codebook = nn.Parameter(torch.zeros(cfg.vocab_size, cfg.selector_rank))
        self.hidden_projection = Linear(cfg.hidden_size, cfg.selector_rank, bias=False)
        nn.init.normal_(self.hidden_projection.weight, std=0.02)

    def candidates(self, unary: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """unary [..., V_d] -> (indices [..., K] into the unary logits, their logits [..., K]), best first."""
        top = unary.topk(self.top_k, dim=-1)
        return top.indices, top.values

    def context(self, hidden: torch.Tensor, predecessor_ids: torch.Tensor) -> torch.Tensor:
        """pred[p] ⊙ W_h h: hidden [..., D], predecessor_ids [..., P] -> [..., P, r]."""
        projected = self.hidden_projection(hidden.to(self.hidden_projection.weight.dtype))  # [..., r]
        return self.predecessor_codebook[predecessor_ids] * projected[..., None, :]

    def edge_scores(self, unary_top: torch.Tensor, hidden: torch.Tensor, predecessor_ids: torch.Tensor,
                    candidate_ids: torch.Tensor) -> torch.Tensor:
        """S(p, c) for each predecessor: unary_top [..., K], hidden [..., D], predecessor_ids [..., P],
        candidate_ids [..., K] (target ids) -> [..., P, K]."""
        keys = self.successor_codebook[candidate_ids]  # [..., K, r]
        pair = torch.einsum("...pr,...cr->...pc", self.context(hidden, predecessor_ids), keys)
        return unary_top[..., None, :].float() + pair.float()

    def lattice(self, unary_top: torch.Tensor, hidden: torch.Tensor, anchor_ids: torch.Tensor,
                candidate_ids: torch.Tensor) -> torch.Tensor:
        """The lattice [..., m, K, K]: unary_top / candidate_ids [..., m, K], hidden [..., m, D], anchor_ids [...].

        Predecessors of position 0: the anchor, repeated K times; of position j: position j − 1's candidates."""
        K = candidate_ids.shape[-1]
        anchors = anchor_ids[..., None, None].expand(*anchor_ids.shape, 1, K)
        predecessors = torch.cat([anchors, candidate_ids[..., :-1, :]], dim=-2)  # [..., m, K]
        return self.edge_scores(unary_top, hidden, predecessors, candidate_ids)


@dataclass
class DFlash2Output:
    """The training forward's results for N blocks of Bt sequences (m = B − 1 draft positions)."""

    logits: torch.Tensor  # [Bt, N, m, V_d] unary logits (DFlash's)
    hidden: torch.Tensor  # [Bt, N, m, D] final normed hidden states (the LM head's input)
    candidates: torch.Tensor  # [Bt, N, m, K] indices into the unary logits, best first
    scores: torch.Tensor | None  # [Bt, N, m, K] edge scores after the given predecessors (None without them)


class DFlash2Drafter(DFlashDrafter):
    """The DFlash 2 draft model: DFlash's with ``DFlash2Layer``s and a ``candidate_selector``."""

    algorithm = "dflash2"
    layer_class = DFlash2Layer
    warm_starts_from = ("dflash",)  # drafter.init_from may name a DFlash export: its backbone, these parts fresh

    def __init__(self, config: DFlash2Config, *, embed_tokens: nn.Embedding, lm_head: nn.Linear):
        super().__init__(config, embed_tokens=embed_tokens, lm_head=lm_head)
        for layer in self.layers:  # DFlash's initialisation drew them as linears: back to the identity
            layer.attention_conv.reset_parameters()
            layer.mlp_conv.reset_parameters()
        self.candidate_selector = CandidateSelector(config)

    def select(self, unary: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """unary [..., V_d] -> (candidate indices [..., K], their target ids [..., K], their logits [..., K])."""
        index, top = self.candidate_selector.candidates(unary)
        return index, self.draft_to_target(index), top

    def lattice(self, unary: torch.Tensor, hidden: torch.Tensor, anchor_ids: torch.Tensor):
        """(candidate indices [..., m, K], target ids [..., m, K], lattice [..., m, K, K]) of unary
        logits [..., m, V_d] and hidden [..., m, D] after anchors [...] (target ids)."""
        index, ids, top = self.select(unary)
        return index, ids, self.candidate_selector.lattice(top, hidden, anchor_ids, ids)

    def forward(self, hidden_states, context_valid, anchor_ids, anchors, predecessor_ids=None,
                stop_gradient: bool = False) -> DFlash2Output:
        """DFlash's training forward (``DFlashDrafter.forward``) and the selector's scores.

        ``predecessor_ids`` [Bt, N, m] (target ids; the anchor for position 0): score each
        position's candidates after them (the selector objective's true predecessors);
        ``stop_gradient`` detaches the hidden states and unary logits the selector reads."""
        hidden = self.block_hidden(hidden_states, context_valid, anchor_ids, anchors)[:, :, 1:]  # [Bt, N, m, D]
        logits = self.logits(hidden)
        seen_hidden, seen_logits = (hidden.detach(), logits.detach()) if stop_gradient else (hidden, logits)
        index, ids, top = self.select(seen_logits)
        scores = None
        if predecessor_ids is not None:
            scores = self.candidate_selector.edge_scores(top, seen_hidden, predecessor_ids[..., None], ids)[..., 0, :]
        return DFlash2Output(logits, hidden, index, scores)
