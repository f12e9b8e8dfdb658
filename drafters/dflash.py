"""DFlash drafter (seed §4): one forward drafts a whole block; target features enter every layer's K/V.

Input block ``[a, MASK × (B−1)]`` at positions ``p_a + 0 … p_a + B−1`` (RoPE positions are the
anchor's position in the sequence plus the offset, never reset per block). Each draft layer ``ℓ``:

    C        = context_norm(fc(cat(target hidden of the contract's layers)))     # [S, D]
    K_c, V_c = k_proj_ℓ(C), v_proj_ℓ(C)           (KV injection: projected target hidden, §4.2;
                                                  target K/V tensors are never copied)
    K_d, V_d = k_proj_ℓ(x), v_proj_ℓ(x)            x = the block's own hidden states
    x       += o_proj(Attention(q_proj_ℓ(x), [K_c; K_d], [V_c; V_d]; mask))
    x       += mlp(x)

then ``logits = lm_head(norm(x))``. The embedding (for the anchor and MASK tokens) and the LM
head are the target's, frozen and shared: the drafter keeps references to them, they are not
its parameters and are not in its ``state_dict`` (an export holds only the drafter's weights).

Mask (``block_attention_mask``), per query of the block anchored at ``a``:

- target context key ``k`` is visible iff ``k < a`` — strictly before the anchor (seed §4.3):
  the anchor's own target hidden does not exist yet at inference time;
- ``attention="full"``: every key of the same block (bidirectional inside the block, the
  paper's default); ``"sliding"``: block keys at offsets ``<=`` the query's (causal inside the
  block) and only the last ``sliding_window`` context positions before the anchor;
- nothing of any other block.

**Block-key bias (our addition, not in the seed or the DFlash reference).** Each head adds a
learned logit bias (initialised to ``block_key_bias``, default 4) to the keys of its own block.
Without it, at initialisation a MASK query spreads its attention uniformly over hundreds of
context keys, so the anchor — the one key that says which token the block continues — gets a
1/S share of the gradient and is found very slowly: on a synthetic task whose next token is a
function of the anchor, a 1-layer drafter reaches 50 % position-1 accuracy in 300 steps with
16 context positions but stays at chance with 256; with the bias it learns as fast at 256 as
at 16. The bias only re-weights keys the mask already allows, so the context rule
(``k < anchor``) and the block rule are unchanged.

**Draft vocabulary (EAGLE-3's d2t, optional).** With ``draft_vocab_size = V_d`` the drafter
predicts over only ``V_d`` target tokens — the most frequent supervised tokens of the training
data (``trainer/vocab.py``) — whose ids, ascending, are the ``draft_vocab`` buffer (saved in the
export). The LM head is the same frozen target head restricted to those rows, so the drafter
still owns no vocabulary weights; training and drafting cost ``V_d / V`` of the full head, the
part that dominates a small drafter on CPU. A draft token is always a target id
(``draft_to_target``), and a sampled draft's ``q`` is given to verification over the whole
target vocabulary, zero outside the draft vocabulary (``to_target_distribution``), so
verification stays lossless: tokens outside the draft vocabulary are simply never proposed.

The same module serves training (many blocks per sequence, ``forward``) and serving (one block
per request over cached context K/V, ``context_kv`` + ``forward_block``).

Note on the seed vs DESIGN.md: both describe the same contract; the seed's figure for the
context boundary (``kv_idx < anchor_pos``) is what is implemented, with the anchor position
being the position of the anchor token itself.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, fields
from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class DFlashConfig:
    hidden_size: int  # D, equal to the target's (shared embedding and LM head)
    vocab_size: int  # V, the target's
    target_layer_ids: tuple[int, ...]  # the capture contract's layer ids, in concatenation order
    mask_token_id: int
    num_layers: int = 2
    num_heads: int = 8
    num_kv_heads: int = 2
    head_dim: int = 64
    intermediate_size: int = 1536
    block_size: int = 8  # B = 1 anchor + m = B − 1 draft tokens
    attention: Literal["full", "sliding"] = "full"
    sliding_window: int | None = None  # context positions visible in "sliding" mode
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    block_key_bias: float = 4.0  # initial value of the learned per-head logit bias on in-block keys
    draft_vocab_size: int | None = None  # V_d: draft over the V_d most frequent answer tokens (None = all V)

    def __post_init__(self) -> None:
        object.__setattr__(self, "target_layer_ids", tuple(self.target_layer_ids))
        if self.block_size < 2:
            raise ValueError(f"block_size must be >= 2 (one anchor + at least one draft token), got {self.block_size}")
        if not self.target_layer_ids:
            raise ValueError("target_layer_ids is empty; use the capture contract's layer ids")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})")
        if not 0 <= self.mask_token_id < self.vocab_size:
            raise ValueError(f"mask_token_id {self.mask_token_id} is outside the vocabulary [0, {self.vocab_size})")
        if self.attention not in ("full", "sliding"):
            raise ValueError(f"attention must be 'full' or 'sliding', got {self.attention!r}")
        if self.attention == "sliding" and not (self.sliding_window and self.sliding_window > 0):
            raise ValueError("attention='sliding' needs a positive sliding_window (context positions visible)")
        if self.draft_vocab_size is not None and not 0 < self.draft_vocab_size <= self.vocab_size:
            raise ValueError(f"draft_vocab_size must be in [1, {self.vocab_size}] (the target's vocabulary) or None, "
                             f"got {self.draft_vocab_size}")

    @property
    def num_draft_tokens(self) -> int:  # m
        return self.block_size - 1

    def to_dict(self) -> dict:
        data = asdict(self)
        data["target_layer_ids"] = list(self.target_layer_ids)
        return data

    @classmethod
    def from_dict(cls, data: dict) -> "DFlashConfig":
        known = {f.name for f in fields(cls)}
        unknown = set(data) - known
        if unknown:
            raise ValueError(f"unknown DFlash config keys {sorted(unknown)}; valid keys: {sorted(known)}")
        return cls(**data)


SMALL_M = 64  # inference products with at most this many rows take the (W @ xᵀ)ᵀ layout


def small_m_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ weightᵀ (+ bias)`` for x [..., in]; at inference with few rows on CPU, as ``(W @ xᵀ)ᵀ``.

    Serving runs the drafter on a handful of rows, where ``F.linear``'s ``x @ Wᵀ`` takes a slow
    small-M path on CPU (2–6× slower than MKL's gemm with the weight as the left operand for
    SmolLM2's shapes, docs/benchmarks.md), the layout ``serving/runner.py`` uses too. A lone row
    is computed twice: a 2-row gemm beats the mat-vec (an expanded view's zero stride sends ``mm``
    to a slow path, so the copy is contiguous). Training (grad enabled) keeps ``F.linear``.
    """
    flat = x.reshape(-1, x.shape[-1])
    if flat.shape[0] > SMALL_M or torch.is_grad_enabled() or flat.device.type != "cpu":
        return F.linear(x, weight, bias)
    rows = flat if len(flat) > 1 else flat.expand(2, -1).contiguous()
    out = (weight @ rows.T).T[: len(flat)]
    if bias is not None:
        out = out + bias
    return out.reshape(*x.shape[:-1], out.shape[-1])


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


def apply_rope(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """Rotary embedding (Llama's rotate-half layout). x [..., H, T, hd], positions [..., T]."""
    half = x.shape[-1] // 2
    inv_freq = theta ** (-torch.arange(half, device=x.device, dtype=torch.float32) / half)  # [hd/2]
    angles = positions.to(torch.float32)[..., None] * inv_freq  # [..., T, hd/2]
    cos = torch.cat([angles.cos(), angles.cos()], dim=-1).unsqueeze(-3).to(x.dtype)  # [..., 1, T, hd]
    sin = torch.cat([angles.sin(), angles.sin()], dim=-1).unsqueeze(-3).to(x.dtype)
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


class DFlashAttention(nn.Module):
    def __init__(self, cfg: DFlashConfig):
        super().__init__()
        self.cfg = cfg
        D, H, Hkv, hd = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_proj = Linear(D, H * hd, bias=False)
        self.k_proj = Linear(D, Hkv * hd, bias=False)
        self.v_proj = Linear(D, Hkv * hd, bias=False)
        self.o_proj = Linear(H * hd, D, bias=False)
        self.q_norm = RMSNorm(hd, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(hd, cfg.rms_norm_eps)
        self.block_key_bias = nn.Parameter(torch.full((H,), float(cfg.block_key_bias)))

    def project_kv(self, x: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K/V of ``x`` [Bt, T, D] at ``positions`` [Bt, T] -> ([Bt, Hkv, T, hd], [Bt, Hkv, T, hd])."""
        Bt, T, _ = x.shape
        k = self.k_norm(self.k_proj(x).view(Bt, T, self.cfg.num_kv_heads, self.cfg.head_dim)).transpose(1, 2)
        v = self.v_proj(x).view(Bt, T, self.cfg.num_kv_heads, self.cfg.head_dim).transpose(1, 2)
        return apply_rope(k, positions, self.cfg.rope_theta), v

    def forward(self, x, positions, ctx_k, ctx_v, mask, query_rows: slice | None = None):
        """x [Bt, Q, D] block states; ctx_k/ctx_v [Bt, Hkv, S, hd]; mask [Bt, Q, S + Q] bool (True = attend).

        ``query_rows``: compute the output of only those block rows (every row still gives its K/V)."""
        Bt, Q, _ = x.shape
        xq, pq, mq = (x, positions, mask) if query_rows is None else (
            x[:, query_rows], positions[:, query_rows], mask[:, query_rows])
        Qq = xq.shape[1]
        q = self.q_norm(self.q_proj(xq).view(Bt, Qq, self.cfg.num_heads, self.cfg.head_dim)).transpose(1, 2)
        q = apply_rope(q, pq, self.cfg.rope_theta)  # [Bt, H, Qq, hd]
        k_d, v_d = self.project_kv(x, positions)
        k = torch.cat([ctx_k, k_d], dim=2)  # [Bt, Hkv, S + Q, hd]
        v = torch.cat([ctx_v, v_d], dim=2)
        S = ctx_k.shape[2]
        bias = torch.zeros(self.cfg.num_heads, 1, S + Q, dtype=q.dtype, device=q.device)
        bias[:, :, S:] = self.block_key_bias.to(q.dtype)[:, None, None]  # in-block keys only
        logit_bias = bias[None].masked_fill(~mq[:, None], float("-inf"))  # [Bt, H, Qq, S + Q]
        # Grouped-query attention without copying K/V per query head (head h reads KV head h // g).
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=logit_bias, enable_gqa=True)  # [Bt, H, Qq, hd]
        return self.o_proj(out.transpose(1, 2).reshape(Bt, Qq, -1))


class DFlashLayer(nn.Module):
    def __init__(self, cfg: DFlashConfig):
        super().__init__()
        self.input_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.attn = DFlashAttention(cfg)
        self.post_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.gate_proj = Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x, positions, ctx_k, ctx_v, mask, query_rows: slice | None = None):
        """``query_rows``: return only those rows (the attention still reads every row's K/V)."""
        out = self.attn(self.input_norm(x), positions, ctx_k, ctx_v, mask, query_rows)
        x = (x if query_rows is None else x[:, query_rows]) + out
        h = self.post_norm(x)
        return x + self.down_proj(F.silu(self.gate_proj(h)) * self.up_proj(h))


def block_attention_mask(
    anchors: torch.Tensor,  # [Bt, N] anchor positions (−1 = unused block slot)
    context_valid: torch.Tensor,  # [Bt, S] bool, False on padding
    block_size: int,
    attention: str = "full",
    sliding_window: int | None = None,
) -> torch.Tensor:
    """[Bt, N·B, S + N·B] bool mask for N blocks over S context positions (see module docstring).

    Example (S = 4, one block anchored at 2, B = 2, full): both block queries see context
    ``[0, 1]`` and both block keys: rows ``[1 1 0 0 | 1 1]``.
    """
    Bt, N = anchors.shape
    S = context_valid.shape[1]
    Q = N * block_size
    anchor_q = anchors.repeat_interleave(block_size, dim=1)  # [Bt, Q] anchor of each query
    k_pos = torch.arange(S, device=anchors.device)
    ctx = (k_pos[None, None, :] < anchor_q[:, :, None]) & context_valid[:, None, :]  # strictly before the anchor
    if attention == "sliding":
        ctx &= k_pos[None, None, :] >= (anchor_q[:, :, None] - sliding_window)
    block_q = torch.arange(Q, device=anchors.device) // block_size
    offset = torch.arange(Q, device=anchors.device) % block_size
    same = block_q[:, None] == block_q[None, :]  # [Q, Q]
    if attention == "sliding":
        same &= offset[None, :] <= offset[:, None]
    used = (anchor_q >= 0)  # [Bt, Q]
    blocks = same[None] & used[:, :, None] & used[:, None, :]
    mask = torch.cat([ctx & used[:, :, None], blocks], dim=-1)
    # An unused slot sees nothing; give it its own key so softmax stays finite (its loss is masked).
    diag = torch.zeros_like(blocks)
    diag[:, torch.arange(Q), torch.arange(Q)] = ~used
    mask[:, :, S:] |= diag
    return mask


def check_draft_vocab(ids: torch.Tensor, config: DFlashConfig) -> None:
    """Raise ValueError unless ``ids`` are ``draft_vocab_size`` distinct ascending ids in [0, V)."""
    if config.draft_vocab_size is None:
        raise ValueError("this drafter has no draft vocabulary (draft_vocab_size is None)")
    if ids.ndim != 1 or len(ids) != config.draft_vocab_size:
        raise ValueError(f"the draft vocabulary needs {config.draft_vocab_size} token ids, got shape {tuple(ids.shape)}")
    if len(ids) and (int(ids.min()) < 0 or int(ids.max()) >= config.vocab_size):
        raise ValueError(f"draft vocabulary ids must be in [0, {config.vocab_size}), got [{int(ids.min())}, {int(ids.max())}]")
    if len(ids) > 1 and not bool((ids[1:] > ids[:-1]).all()):
        raise ValueError("draft vocabulary ids must be distinct and ascending")


class DFlashDrafter(nn.Module):
    """The DFlash draft model; ``embed_tokens`` and ``lm_head`` are the target's (frozen, shared)."""

    algorithm = "dflash"

    def __init__(self, config: DFlashConfig, *, embed_tokens: nn.Embedding, lm_head: nn.Linear):
        super().__init__()
        if embed_tokens.weight.shape != (config.vocab_size, config.hidden_size):
            raise ValueError(
                f"the target's embedding is {tuple(embed_tokens.weight.shape)}, the config says "
                f"({config.vocab_size}, {config.hidden_size}); build the config from this target"
            )
        self.config = config
        L, D = len(config.target_layer_ids), config.hidden_size
        self.fc = Linear(L * D, D, bias=False)  # context projection of the concatenated target layers
        self.context_norm = RMSNorm(D, config.rms_norm_eps)
        self.layers = nn.ModuleList(DFlashLayer(config) for _ in range(config.num_layers))
        self.norm = RMSNorm(D, config.rms_norm_eps)
        self._init_weights()
        # A tuple hides the shared modules from nn.Module: not parameters, not in state_dict.
        self._target_modules = (embed_tokens, lm_head)
        # The draft vocabulary (target ids, ascending) is part of the export; set by set_draft_vocab.
        V_d = config.draft_vocab_size
        self.register_buffer("draft_vocab", None if V_d is None else torch.arange(V_d), persistent=True)
        self._head_cache: tuple[tuple, torch.Tensor, torch.Tensor | None] | None = None

    def _init_weights(self) -> None:
        for module in self.modules():
            if isinstance(module, nn.Linear):
                nn.init.normal_(module.weight, std=0.02)
        for layer in self.layers:  # residual branches start small (GPT-2 style scaling)
            scale = 0.02 / math.sqrt(2 * self.config.num_layers)
            nn.init.normal_(layer.attn.o_proj.weight, std=scale)
            nn.init.normal_(layer.down_proj.weight, std=scale)

    @property
    def embed_tokens(self) -> nn.Embedding:
        return self._target_modules[0]

    @property
    def lm_head(self) -> nn.Linear:
        return self._target_modules[1]

    def validate_state(self) -> None:
        """Raise ValueError if loaded state is inconsistent with the config (a bad draft vocabulary)."""
        if self.draft_vocab is not None:
            check_draft_vocab(self.draft_vocab, self.config)

    def set_draft_vocab(self, token_ids: torch.Tensor) -> None:
        """Install the draft vocabulary: ``draft_vocab_size`` distinct target token ids."""
        ids = torch.as_tensor(token_ids, dtype=torch.long).flatten().sort().values
        check_draft_vocab(ids, self.config)
        self.draft_vocab.copy_(ids)

    def _head(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The LM head rows the drafter predicts over: all V, or the draft vocabulary's V_d (cached)."""
        weight, bias = self.lm_head.weight, self.lm_head.bias
        if self.draft_vocab is None:
            return weight, bias
        key = (self.draft_vocab.data_ptr(), self.draft_vocab._version, weight.data_ptr(), weight._version)
        if self._head_cache is None or self._head_cache[0] != key:
            rows = weight.detach()[self.draft_vocab]  # frozen, so a copy is exact
            self._head_cache = (key, rows, None if bias is None else bias.detach()[self.draft_vocab])
        return self._head_cache[1], self._head_cache[2]

    def target_to_draft(self, token_ids: torch.Tensor) -> torch.Tensor:
        """Draft-vocabulary index of each target token id, −1 where it is not in the draft vocabulary."""
        if self.draft_vocab is None:
            return token_ids
        lookup = torch.full((self.config.vocab_size,), -1, dtype=torch.long, device=token_ids.device)
        lookup[self.draft_vocab] = torch.arange(len(self.draft_vocab), device=token_ids.device)
        return lookup[token_ids]

    def draft_to_target(self, index: torch.Tensor) -> torch.Tensor:
        """Target token ids of draft-vocabulary indices (the identity without a draft vocabulary)."""
        return index if self.draft_vocab is None else self.draft_vocab[index]

    def to_target_distribution(self, q: torch.Tensor) -> torch.Tensor:
        """A distribution over the draft vocabulary [..., V_d] as one over the target's [..., V] (zeros outside)."""
        if self.draft_vocab is None:
            return q
        full = q.new_zeros(*q.shape[:-1], self.config.vocab_size)
        full[..., self.draft_vocab] = q
        return full

    def project_context(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """Target features [Bt, S, L·D] -> context C [Bt, S, D]."""
        return self.context_norm(self.fc(hidden_states.to(self.fc.weight.dtype)))

    def context_kv(self, context: torch.Tensor, positions: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per-layer K/V of the context C [Bt, S, D] at positions [Bt, S] (what serving caches)."""
        return [layer.attn.project_kv(context, positions) for layer in self.layers]

    def block_inputs(self, anchor_ids: torch.Tensor) -> torch.Tensor:
        """Block token ids ``[a, MASK × (B−1)]`` for anchors [..., N] -> [..., N, B]."""
        masks = torch.full((*anchor_ids.shape, self.config.block_size - 1), self.config.mask_token_id,
                           dtype=anchor_ids.dtype, device=anchor_ids.device)
        return torch.cat([anchor_ids[..., None], masks], dim=-1)

    def forward_block(self, block_ids, positions, ctx_kv, mask, out_rows: slice | None = None) -> torch.Tensor:
        """block_ids/positions [Bt, Q]; ctx_kv per layer; mask [Bt, Q, S + Q] -> hidden [Bt, Q, D].

        ``out_rows`` returns only those block rows [Bt, |out_rows|, D]: the last layer computes
        queries, attention output and MLP for them alone (serving, which verifies k ≤ m drafts);
        earlier layers need every row, whose states feed the next layer's K/V."""
        x = self.embed_tokens(block_ids).to(self.fc.weight.dtype)
        last = len(self.layers) - 1
        for i, (layer, (k, v)) in enumerate(zip(self.layers, ctx_kv)):
            x = layer(x, positions, k, v, mask, out_rows if i == last else None)
        return self.norm(x)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The shared LM head over [..., D] -> [..., V], or [..., V_d] over the draft vocabulary's rows.

        Serving drafts a few rows (B × m): there, on CPU, ``x @ Wᵀ`` for the [V, D] head runs
        through a slow small-M path (35 ms for 7 rows of SmolLM2's 49,152 × 576 head, against
        8 ms for ``(W @ xᵀ)ᵀ``, the layout ``serving/runner.py`` uses too). Inference with at
        most 64 rows takes that layout, a lone row computed twice (as the runner does: a 2-row
        gemm beats the mat-vec, 0.5 against 1 ms for an 8,192-row head); training keeps
        ``F.linear`` (bit-identical gradients).
        """
        weight, bias = self._head()
        return small_m_linear(hidden.to(weight.dtype), weight, bias)

    def forward(self, hidden_states, context_valid, anchor_ids, anchors) -> torch.Tensor:
        """Training forward over many blocks per sequence.

        hidden_states [Bt, S, L·D] target features; context_valid [Bt, S] bool; anchor_ids
        [Bt, N] the tokens at the anchors; anchors [Bt, N] their positions (−1 = unused slot).
        Returns logits [Bt, N, B − 1, V] (V_d with a draft vocabulary): entry ``j − 1`` of block n predicts token ``anchor + j``
        (the anchor row predicts nothing in DFlash, so the LM head skips it).
        """
        Bt, S, _ = hidden_states.shape
        N, B = anchors.shape[1], self.config.block_size
        context = self.project_context(hidden_states)
        ctx_pos = torch.arange(S, device=hidden_states.device).expand(Bt, S)
        ctx_kv = self.context_kv(context, ctx_pos)
        block_ids = self.block_inputs(anchor_ids).reshape(Bt, N * B)
        positions = (anchors.clamp(min=0)[..., None] + torch.arange(B, device=anchors.device)).reshape(Bt, N * B)
        mask = block_attention_mask(anchors, context_valid, B, self.config.attention, self.config.sliding_window)
        hidden = self.forward_block(block_ids, positions, ctx_kv, mask).view(Bt, N, B, -1)
        return self.logits(hidden[:, :, 1:])
