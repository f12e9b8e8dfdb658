"""EAGLE-3 drafter (seed §3): fuse three target layers, one decoder layer, self-fed hidden state.

Notation: ``h_t`` the target's captured features at position ``t`` (the contract's low, mid and
high decoder-layer outputs, concatenated, ``[3D]``), ``x_t`` the token at ``t``. A draft row
pairs a *state* with the *next* token (seed §2.1: ``h_t`` with ``E(x_{t+1})``, never ``E(x_t)``):

    g_t      = fc(h_t)                                                    # [D], 3D -> D
    row t    = (state s, token x_{t+1}) at RoPE position t + 1
    a        = cat(input_layernorm(E(x_{t+1})), hidden_norm(s))          # [2D]: q/k/v read 2D
    r        = hidden_norm(s) if norm_before_residual else s              # the residual is the state
    y        = r + o_proj(Attention(q_proj(a), k_proj(a), v_proj(a)))
    s'       = y + mlp(post_attention_layernorm(y))                       # the row's output state
    q(x_{t+2}) = softmax(lm_head(norm(s')))                               # over the draft vocabulary

With the target's state (``s = g_t``) a row is a *step-0* row; a later row is fed the drafter's
own output ``s'`` of the row before it (``s = a_{t+1}``, seed §3.1: the target has not run the
draft token yet, so there is no ``g_{t+1}``). ``num_layers > 1`` stacks plain Llama decoder layers
(``input_layernorm`` → attention → MLP, D wide) after this first layer, as the peer format does.

**Module names are the peer format's** (``speculators`` Eagle3, the format vLLM loads):
``fc``, ``layers.N.{input_layernorm, hidden_norm, self_attn.{q,k,v,o}_proj,
post_attention_layernorm, mlp.{gate,up,down}_proj}``, ``norm``, so an export into that format
renames nothing in the drafter's own weights. The embedding and the LM head are the target's,
frozen and shared by reference (not in ``state_dict``); with ``draft_vocab_size`` the head is
the target head's rows of the ``draft_vocab`` buffer (``drafters/common.py``: its ``d2t``
offsets and ``t2d`` mask are the peer format's encoding of the same ids).

Two ways to run the layer stack, one per consumer:

- ``forward`` (training, ``trainer/strategies/eagle3.py``): the training-time test unrolled
  ``ttt_length`` steps over every row of a sequence at once, step ``i`` fed step ``i − 1``'s
  output states and the teacher-forced tokens ``x_{t+1+i}`` at positions ``t + 1 + i``, under
  ``ttt_attention_mask`` (computed by ``ttt_attention`` without materialising it, a bounded
  number of rows at a time: memory linear in the sequence);
- ``forward_cached`` (serving, ``serving/workers/eagle3.py``): new rows over a per-request KV
  cache with an explicit boolean mask (causal over the cache and the new rows).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from typing import Any, Callable, Literal

import torch
import torch.nn.functional as F
from pydantic import Field
from torch import nn

from specray.drafters.common import (ATTENTION_QUERY_CHUNK, DrafterSectionBase, DraftVocabHead, Linear, RMSNorm,
                                     RotaryFrequencies, check_drafter_rope, chunked_rows, size_limits, target_rope,
                                     target_sizes)


@dataclass(frozen=True)
class Eagle3Config:
    hidden_size: int  # D, equal to the target's (shared embedding and LM head)
    vocab_size: int  # V, the target's
    target_layer_ids: tuple[int, ...]  # the capture contract's layer ids (low, mid, high), fc's input order
    num_layers: int = 1
    num_heads: int = 8
    num_kv_heads: int = 2
    head_dim: int = 64
    intermediate_size: int = 1536
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    norm_before_residual: bool = False  # residual of the first layer: hidden_norm(state) instead of the state
    draft_vocab_size: int | None = None  # V_d: draft over the V_d most frequent answer tokens (None = all V)
    # the target's RoPE besides its theta (transformers' rope_parameters, e.g. llama3's factor and bands;
    # None = the default type) and its max_position_embeddings (drafters/rope.py)
    rope_scaling: dict | None = None
    max_position_embeddings: int | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "target_layer_ids", tuple(self.target_layer_ids))
        if not self.target_layer_ids:
            raise ValueError("target_layer_ids is empty; use the capture contract's layer ids (eagle3: three)")
        if self.num_layers < 1:
            raise ValueError(f"num_layers must be >= 1, got {self.num_layers}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})")
        if self.draft_vocab_size is not None and not 0 < self.draft_vocab_size <= self.vocab_size:
            raise ValueError(f"draft_vocab_size must be in [1, {self.vocab_size}] (the target's vocabulary) or None, "
                             f"got {self.draft_vocab_size}")
        check_drafter_rope(self)

    def to_dict(self) -> dict:
        data = asdict(self)
        data["target_layer_ids"] = list(self.target_layer_ids)
        return data

    @classmethod
    def from_dict(cls, data: dict) -> "Eagle3Config":
        known = {f.name for f in fields(cls)}
        unknown = set(data) - known
        if unknown:
            raise ValueError(f"unknown EAGLE-3 config keys {sorted(unknown)}; valid keys: {sorted(known)}")
        return cls(**data)

    @classmethod
    def limits(cls, hidden_size: int, vocab_size: int) -> dict[str, tuple[float, float]]:
        """Inclusive bounds of the numeric fields for a target of width D and vocabulary V (drafters/common.py)."""
        return size_limits(hidden_size, vocab_size)


class Eagle3Section(DrafterSectionBase):
    """The manifest's ``drafter`` section for ``algorithm: eagle3`` (sizes left unset are the target's)."""

    algorithm: Literal["eagle3"] = Field("eagle3", description="drafter to train; its features must be captured "
                                                               "with capture.algorithm=eagle3")
    num_layers: int = Field(1, gt=0, description="draft decoder layers (EAGLE-3 uses 1)")
    num_heads: int | None = Field(None, gt=0, description="attention heads (None = the target's)")
    num_kv_heads: int | None = Field(None, gt=0, description="K/V heads (None = the target's)")
    head_dim: int | None = Field(None, gt=0, description="per-head dim (None = the target's)")
    intermediate_size: int | None = Field(None, gt=0, description="MLP width (None = the target's)")
    norm_before_residual: bool = Field(False, description="first layer's residual: hidden_norm(state) (true) or the "
                                                          "state itself (false, EAGLE-3's reference)")

    def drafter_config(self, target: Any, layer_ids: tuple[int, ...]) -> Eagle3Config:
        """The model config of this section for ``target``, reading the captured ``layer_ids``."""
        sizes = target_sizes(target)
        return Eagle3Config(
            hidden_size=target.hidden_size, vocab_size=target.vocab_size, target_layer_ids=tuple(layer_ids),
            num_layers=self.num_layers, num_heads=self.num_heads or sizes["num_heads"],
            num_kv_heads=self.num_kv_heads or sizes["num_kv_heads"], head_dim=self.head_dim or sizes["head_dim"],
            intermediate_size=self.intermediate_size or sizes["intermediate_size"],
            rms_norm_eps=sizes["rms_norm_eps"], rope_theta=sizes["rope_theta"], rope_scaling=sizes["rope_scaling"],
            max_position_embeddings=sizes["max_position_embeddings"],
            norm_before_residual=self.norm_before_residual, draft_vocab_size=self.draft_vocab_size,
        )


def debug_config(target: Any, layer_ids: tuple[int, ...] | None = None, **overrides) -> Eagle3Config:
    """A tiny EAGLE-3 config for tests on ``target`` (1 layer, 4 heads of 16, MLP 128, the target's
    RoPE), reading ``layer_ids`` (None: the eagle3 contract's default ``(1, L // 2 − 1, L − 4)``)."""
    L = target.model.config.num_hidden_layers
    values = dict(
        hidden_size=target.hidden_size, vocab_size=target.vocab_size,
        target_layer_ids=tuple(layer_ids) if layer_ids is not None else (1, L // 2 - 1, L - 4),
        num_layers=1, num_heads=4, num_kv_heads=2, head_dim=16, intermediate_size=128,
        rms_norm_eps=target.model.config.rms_norm_eps, **target_rope(target),
    )
    return Eagle3Config(**{**values, **overrides})


# the first layer's tensors that have no target-layer counterpart (``Eagle3Drafter.target_layer_tensors``)
FIRST_LAYER_OWN = ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight",
                   "input_layernorm.weight")

# An attention core: (layer index, q [B, H, T, hd], k, v [B, Hkv, T, hd]) -> out [B, H, T, hd].
Attend = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


class Eagle3Attention(nn.Module):
    """Llama attention projections; ``in_features`` is 2D in the first layer (embedding ‖ state)."""

    def __init__(self, cfg: Eagle3Config, in_features: int):
        super().__init__()
        self.cfg = cfg
        H, Hkv, hd = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_proj = Linear(in_features, H * hd, bias=False)
        self.k_proj = Linear(in_features, Hkv * hd, bias=False)
        self.v_proj = Linear(in_features, Hkv * hd, bias=False)
        self.o_proj = Linear(H * hd, cfg.hidden_size, bias=False)
        self.rope = RotaryFrequencies(cfg)

    def project(self, x: torch.Tensor, positions: torch.Tensor):
        """x [B, T, in], positions [B, T] -> q [B, H, T, hd], k/v [B, Hkv, T, hd] (q and k rotated)."""
        B, T, _ = x.shape
        hd = self.cfg.head_dim
        q = self.q_proj(x).view(B, T, self.cfg.num_heads, hd).transpose(1, 2)
        k = self.k_proj(x).view(B, T, self.cfg.num_kv_heads, hd).transpose(1, 2)
        v = self.v_proj(x).view(B, T, self.cfg.num_kv_heads, hd).transpose(1, 2)
        return self.rope.rotate(q, positions), self.rope.rotate(k, positions), v


class Eagle3MLP(nn.Module):
    def __init__(self, cfg: Eagle3Config):
        super().__init__()
        self.gate_proj = Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Eagle3DecoderLayer(nn.Module):
    """A Llama decoder layer; the first one (``first=True``) reads ``cat(input_layernorm(E(x)),
    hidden_norm(state))`` (2D) and keeps the state as its residual (module docstring)."""

    def __init__(self, cfg: Eagle3Config, index: int, first: bool):
        super().__init__()
        D = cfg.hidden_size
        self.index, self.first = index, first
        self.norm_before_residual = cfg.norm_before_residual
        self.input_layernorm = RMSNorm(D, cfg.rms_norm_eps)
        if first:
            self.hidden_norm = RMSNorm(D, cfg.rms_norm_eps)
        self.self_attn = Eagle3Attention(cfg, 2 * D if first else D)
        self.post_attention_layernorm = RMSNorm(D, cfg.rms_norm_eps)
        self.mlp = Eagle3MLP(cfg)

    def forward(self, state: torch.Tensor, embeds: torch.Tensor, positions: torch.Tensor, attend: Attend):
        """state/embeds [B, T, D], positions [B, T] -> the rows' output states [B, T, D]."""
        if self.first:
            normed = self.hidden_norm(state)
            x = torch.cat([self.input_layernorm(embeds), normed], dim=-1)  # [B, T, 2D]: embedding first
            residual = normed if self.norm_before_residual else state
        else:
            x, residual = self.input_layernorm(state), state
        q, k, v = self.self_attn.project(x, positions)
        out = attend(self.index, q, k, v)  # [B, H, T, hd]
        B, T = state.shape[:2]
        y = residual + self.self_attn.o_proj(out.transpose(1, 2).reshape(B, T, -1))
        return y + self.mlp(self.post_attention_layernorm(y))


def ttt_attention_mask(seq_len: int, step: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """[S, (step + 1)·S] bool: what a query of TTT step ``step`` sees (True = attend).

    Keys are the rows of steps ``0 … step`` laid side by side. A query at row ``t`` sees the
    step-0 keys ``t' <= t`` (the target-fed context, causal) and key ``t`` of every later step
    ``1 … step`` (its own chain of self-fed rows), nothing of another row's chain — the extra
    diagonals that stop one simulated rollout from reading another's (seed §3.2). Example,
    S = 3, step 1: rows ``[1 0 0 | 1 0 0]``, ``[1 1 0 | 0 1 0]``, ``[1 1 1 | 0 0 1]``.
    """
    rows = torch.arange(seq_len, device=device)
    causal = rows[None, :] <= rows[:, None]  # [S, S]
    diagonal = rows[None, :] == rows[:, None]
    return torch.cat([causal] + [diagonal] * step, dim=1)


def ttt_attention(q: torch.Tensor, keys: list[torch.Tensor], values: list[torch.Tensor],
                  chunk: int = ATTENTION_QUERY_CHUNK) -> torch.Tensor:
    """Attention of step ``i = len(keys) − 1`` under ``ttt_attention_mask(S, i)``, without the
    ``(i + 1)·S``-wide key axis: block 0 is causal and every later block is a diagonal, whose scores
    are one dot product per row. Rows are taken ``chunk`` at a time (``chunked_rows``): a range of
    rows ``r0 … r1`` reads the step-0 keys ``< r1`` only, so no ``[S, S]`` score matrix exists.

    q [B, H, S, hd]; keys/values: per step ``0 … i``, [B, Hkv, S, hd] -> [B, H, S, hd].
    Grouped-query: query head ``h`` reads KV head ``h // (H / Hkv)``.
    """
    B, H, S, hd = q.shape
    Hkv = keys[0].shape[1]
    qg = q.view(B, Hkv, H // Hkv, S, hd)
    scale = hd**-0.5
    keys, values = list(keys), list(values)  # the caller's lists grow with later steps; a backward recomputes this one

    def rows(start: int, stop: int) -> torch.Tensor:  # [B, Hkv, g, stop − start, hd]
        qc = qg[:, :, :, start:stop] * scale  # [B, Hkv, g, C, hd]
        C = stop - start
        row = torch.arange(start, stop, device=q.device)
        hidden = torch.arange(stop, device=q.device)[None, :] > row[:, None]  # causal
        # the g query heads of a KV head as rows of one product (no copy of K/V per query head); each
        # intermediate of the chunk's size dies as soon as the next exists
        scores = torch.cat([
            (qc.flatten(2, 3) @ keys[0][:, :, :stop].transpose(-1, -2)).view(B, Hkv, H // Hkv, C, stop).masked_fill(
                hidden, float("-inf")),
            *[(qc * k[:, :, None, start:stop]).sum(-1, keepdim=True) for k in keys[1:]]], dim=-1)
        context, *chain = scores.softmax(-1, dtype=torch.float32).to(q.dtype).split([stop] + [1] * len(keys[1:]), -1)
        out = (context.flatten(2, 3) @ values[0][:, :, :stop]).view(B, Hkv, H // Hkv, C, hd)
        for p, v in zip(chain, values[1:]):
            out = out + p * v[:, :, None, start:stop]
        return out

    return chunked_rows(rows, S, chunk).reshape(B, H, S, hd)


class Eagle3Drafter(DraftVocabHead, nn.Module):
    """The EAGLE-3 draft model; ``embed_tokens`` and ``lm_head`` are the target's (frozen, shared)."""

    algorithm = "eagle3"
    # {draft layer tensor: the target decoder layer's tensor of the same role}: the names are a Llama layer's
    TARGET_LAYER_TENSORS = {name: name for name in (
        "input_layernorm.weight", *(f"self_attn.{p}_proj.weight" for p in "qkvo"), "post_attention_layernorm.weight",
        *(f"mlp.{p}_proj.weight" for p in ("gate", "up", "down")))}

    def __init__(self, config: Eagle3Config, *, embed_tokens: nn.Embedding, lm_head: nn.Linear):
        super().__init__()
        if embed_tokens.weight.shape != (config.vocab_size, config.hidden_size):
            raise ValueError(
                f"the target's embedding is {tuple(embed_tokens.weight.shape)}, the config says "
                f"({config.vocab_size}, {config.hidden_size}); build the config from this target"
            )
        self.config = config
        D = config.hidden_size
        self.fc = Linear(len(config.target_layer_ids) * D, D, bias=False)  # fuses the captured layers
        self.layers = nn.ModuleList(Eagle3DecoderLayer(config, i, first=i == 0) for i in range(config.num_layers))
        self.norm = RMSNorm(D, config.rms_norm_eps)
        for module in self.modules():
            if isinstance(module, nn.Linear):
                nn.init.normal_(module.weight, std=0.02)
        # A tuple hides the shared modules from nn.Module: not parameters, not in state_dict.
        self._target_modules = (embed_tokens, lm_head)
        self.init_draft_vocab()  # the draft vocabulary (target ids, ascending), part of the export

    @property
    def embed_tokens(self) -> nn.Embedding:
        return self._target_modules[0]

    @property
    def lm_head(self) -> nn.Linear:
        return self._target_modules[1]

    def target_layer_tensors(self, index: int) -> dict[str, str]:
        """{tensor of draft layer ``index``: the target layer's tensor of the same role}. The first
        layer's q/k/v projections read ``[E(x); state]`` (2D wide, not the residual stream) and its
        ``input_layernorm`` normalises the embedding: they, and ``hidden_norm``, keep their
        initialisation."""
        own = FIRST_LAYER_OWN if index == 0 else ()
        return {mine: theirs for mine, theirs in self.TARGET_LAYER_TENSORS.items() if mine not in own}

    def fuse(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """Target features [..., L·D] -> the target state g [..., D]."""
        return self.fc(hidden_states.to(self.fc.weight.dtype))

    def compute_logits(self, state: torch.Tensor) -> torch.Tensor:
        """Output states [..., D] -> logits [..., V_d] (V without a draft vocabulary)."""
        return self.logits(self.norm(state))

    def run_layers(self, state: torch.Tensor, token_ids: torch.Tensor, positions: torch.Tensor, attend: Attend):
        """Rows (state [B, T, D], token_ids [B, T], positions [B, T]) -> output states [B, T, D]."""
        embeds = self.embed_tokens(token_ids).to(state.dtype)
        for layer in self.layers:
            state = layer(state, embeds, positions, attend)
        return state

    def forward_cached(self, state, token_ids, positions, past_kv, mask):
        """Serving: T new rows per request over cached K/V.

        state [B, T, D]; token_ids/positions [B, T]; past_kv per layer (k, v) [B, Hkv, C, hd];
        mask [B, T, C + T] bool over the cached keys then the new rows'. Returns (output states
        [B, T, D], the new rows' (k, v) per layer [B, Hkv, T, hd], for the caller's cache)."""
        new_kv: list[tuple[torch.Tensor, torch.Tensor]] = []

        def attend(index, q, k, v):
            new_kv.append((k, v))
            keys = torch.cat([past_kv[index][0], k], dim=2)
            values = torch.cat([past_kv[index][1], v], dim=2)
            return F.scaled_dot_product_attention(q, keys, values, attn_mask=mask[:, None], enable_gqa=True)

        return self.run_layers(state, token_ids, positions, attend), new_kv

    def forward(self, hidden_states: torch.Tensor, input_ids: torch.Tensor, logit_rows: torch.Tensor,
                head: bool = True) -> list[torch.Tensor]:
        """Training: the training-time test over every row of right-padded sequences.

        hidden_states [B, S, L·D] target features; input_ids [B, S]; logit_rows [N_ttt, B, S] bool,
        the rows whose logits each TTT step returns. Step ``i`` row ``t`` reads token
        ``x_{t+1+i}`` (0 past the end) at position ``t + 1 + i`` and, at ``i = 0``, the target
        state ``g_t``, else its own output state of step ``i − 1``; it predicts ``x_{t+2+i}``.
        Returns per step the logits of its selected rows [N_i, V_d] (row-major over (b, t));
        ``head=False``: their normed states [N_i, D], which the LM head reads (a loss that applies
        the frozen head a chunk of rows at a time, ``trainer/vocab_loss.py``)."""
        B, S = input_ids.shape
        state = self.fuse(hidden_states)  # [B, S, D]
        keys: list[list[torch.Tensor]] = [[] for _ in self.layers]
        values: list[list[torch.Tensor]] = [[] for _ in self.layers]

        def attend(index, q, k, v):
            keys[index].append(k)
            values[index].append(v)
            return ttt_attention(q, keys[index], values[index])

        logits = []
        for step in range(logit_rows.shape[0]):
            shift = step + 1
            tokens = F.pad(input_ids[:, shift:], (0, min(shift, S)))  # [B, S]: x_{t+1+i}
            positions = (torch.arange(S, device=input_ids.device) + shift).expand(B, S)
            state = self.run_layers(state, tokens, positions, attend)
            rows = state[logit_rows[step]]
            logits.append(self.compute_logits(rows) if head else self.norm(rows))
        return logits
