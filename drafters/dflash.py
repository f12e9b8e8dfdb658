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

Mask (``BlockLayout``), per query of the block anchored at ``a``:

- target context key ``k`` is visible iff ``k < a`` — strictly before the anchor (seed §4.3):
  the anchor's own target hidden does not exist yet at inference time;
- ``attention="full"``: every key of the same block (bidirectional inside the block, the
  paper's default); ``"sliding"``: block keys at offsets ``<=`` the query's (causal inside the
  block) and only the last ``sliding_window`` context positions before the anchor;
- nothing of any other block.

**MASK token.** ``drafter.mask_token_id`` when set (0 included), else the ``drafter.init_from``
export's (the id its weights were trained with), else ``choose_mask_token``, which never picks id
0: the tokenizer's mask token, else the first embedding row past its vocabulary (Qwen3: 151669),
else its lowest reserved/unused special token (Llama-3: 128002), else its lowest special token
with no role that the chat template never writes (SmolLM2: ``<repo_name>``, 3), else the token of
a byte no UTF-8 text holds (the debug target: byte 0xC0, 195); no candidate is an error naming
``drafter.mask_token_id``. The id and how it was chosen (``mask_token_origin``) are in
the config, so in every export's ``config.json``; a saved config with id 0 that does not record its
origin is refused (``DFlashConfig.from_dict``), one that records it loads as saved.

**Block-key bias (our addition, not in the seed or the DFlash reference; off by default).** With
``block_key_bias > 0`` each head adds a learned logit bias (initialised to that value) to the keys
of its own block. No peer model (vLLM, speculators) has it, so a drafter trained with it cannot be
exported in their format (``drafters/peer.py``); docs/benchmarks.md records its A/B.
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

import json
import math
import re
from dataclasses import asdict, dataclass, fields
from typing import Any, Literal

import torch
import torch.nn.functional as F
from pydantic import Field, field_validator
from torch import nn

from specray.drafters.common import (ATTENTION_QUERY_CHUNK, DrafterSectionBase, DraftVocabHead, Linear, RMSNorm,
                                     RotaryFrequencies, check_drafter_rope, chunked_rows, size_limits, target_rope,
                                     target_sizes)

MAX_BLOCK_SIZE = 256  # B: block rows of one draft forward (DFlash uses 8-16)
MAX_SLIDING_WINDOW = 1 << 20  # context positions a sliding drafter sees


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
    block_key_bias: float = 0.0  # initial value of the learned per-head bias on in-block keys (0 = off: none)
    draft_vocab_size: int | None = None  # V_d: draft over the V_d most frequent answer tokens (None = all V)
    # how mask_token_id was chosen (MASK_ORIGINS: choose_mask_token's rule, or set by the user / in code)
    mask_token_origin: str = "config"
    # the target's RoPE besides its theta (transformers' rope_parameters, e.g. llama3's factor and bands;
    # None = the default type) and its max_position_embeddings (drafters/rope.py)
    rope_scaling: dict | None = None
    max_position_embeddings: int | None = None

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
        if self.mask_token_origin not in MASK_ORIGINS:
            raise ValueError(f"mask_token_origin must be one of {list(MASK_ORIGINS)}, got {self.mask_token_origin!r}")
        if self.attention not in ("full", "sliding"):
            raise ValueError(f"attention must be 'full' or 'sliding', got {self.attention!r}")
        if self.attention == "sliding" and not (self.sliding_window and self.sliding_window > 0):
            raise ValueError("attention='sliding' needs a positive sliding_window (context positions visible)")
        if self.block_key_bias < 0:
            raise ValueError(f"block_key_bias must be >= 0 (0 = off), got {self.block_key_bias}")
        if self.draft_vocab_size is not None and not 0 < self.draft_vocab_size <= self.vocab_size:
            raise ValueError(f"draft_vocab_size must be in [1, {self.vocab_size}] (the target's vocabulary) or None, "
                             f"got {self.draft_vocab_size}")
        check_drafter_rope(self)

    @property
    def num_draft_tokens(self) -> int:  # m
        return self.block_size - 1

    def to_dict(self) -> dict:
        data = asdict(self)
        data["target_layer_ids"] = list(self.target_layer_ids)
        return data

    @classmethod
    def from_dict(cls, data: dict) -> "DFlashConfig":
        """The config of a saved ``to_dict()`` (an export's architecture, a checkpoint's drafter config).

        One that does not record how its MASK was chosen and uses id 0 is refused: id 0 is an
        ordinary text token in many tokenizers (``!`` in Llama-3's and Qwen3's), so every block
        would be drafted from that token's embedding instead of a mask."""
        known = {f.name for f in fields(cls)}
        unknown = set(data) - known
        if unknown:
            raise ValueError(f"unknown DFlash config keys {sorted(unknown)}; valid keys: {sorted(known)}")
        if "mask_token_origin" not in data:
            if data.get("mask_token_id") == 0:
                raise ValueError(
                    "mask_token_id is 0 and the config does not record how it was chosen (mask_token_origin): id 0 "
                    "is an ordinary text token in many tokenizers ('!' in Llama-3's and Qwen3's), not a MASK. Train "
                    "it again with a MASK choice recorded (drafter.mask_token_id unset: a mask, unused or reserved "
                    "token of the tokenizer), or set drafter.mask_token_id=0 if id 0 is one the data never holds")
            data = {**data, "mask_token_origin": "unrecorded"}
        return cls(**data)

    @classmethod
    def limits(cls, hidden_size: int, vocab_size: int) -> dict[str, tuple[float, float]]:
        """Inclusive bounds of the numeric fields for a target of width D and vocabulary V (drafters/common.py)."""
        return {**size_limits(hidden_size, vocab_size), "mask_token_id": (0, vocab_size - 1),
                "block_size": (2, MAX_BLOCK_SIZE), "sliding_window": (1, MAX_SLIDING_WINDOW),
                "block_key_bias": (0.0, 1e4)}


# How a DFlash-family MASK token was chosen: set in the manifest (drafter.mask_token_id), built in code
# ("config"), one of choose_mask_token's rules (MASK_RULES), or an export that predates the record (a
# non-zero id). "tokenizer.unk_token" is no rule of choose_mask_token: exports that record it load as saved.
MASK_RULES = ("tokenizer.mask_token", "unused_embedding_row", "reserved_special_token", "unrendered_special_token",
              "unused_byte_token")
MASK_ORIGINS = ("drafter.mask_token_id", "drafter.init_from", "config", *MASK_RULES, "tokenizer.unk_token", "unrecorded")
RESERVED_TOKEN = re.compile(r"reserved|unused", re.IGNORECASE)  # Llama-3 <|reserved_special_token_0|>, Gemma <unused0>
TOKEN_ROLES = ("bos", "eos", "pad", "unk", "sep", "cls")  # special tokens text and templates use
# Bytes no UTF-8 text holds (overlong lead bytes, lead bytes past U+10FFFF): no text encodes to their tokens.
NON_UTF8_BYTES = (0xC0, 0xC1, *range(0xF5, 0x100))


def choose_mask_token(tokenizer, vocab_size: int) -> tuple[int, str]:
    """(MASK id, how it was chosen) for a target: a token no text the drafter drafts after is made of.

    The rules of ``MASK_RULES``, in order, each giving its lowest id inside the embedding and never
    id 0 (an ordinary text token in many tokenizers: ``!`` in Llama-3's and Qwen3's; only
    ``drafter.mask_token_id`` sets 0):

    - ``tokenizer.mask_token``: the tokenizer's mask token;
    - ``unused_embedding_row``: the first embedding row past every token the tokenizer knows (no
      text encodes to it: Qwen3's 151669, as z-lab's DFlash drafters use);
    - ``reserved_special_token``: a reserved or unused added special token (Llama-3's
      ``<|reserved_special_token_0|>``, 128002);
    - ``unrendered_special_token``: an added special token with no role (``TOKEN_ROLES``) that the
      chat template never writes (SmolLM2's ``<repo_name>``, 3);
    - ``unused_byte_token``: the token of a byte no UTF-8 text holds (``NON_UTF8_BYTES``), a
      byte-level BPE's or a byte-fallback ``<0xC0>`` (the debug target's ``À`` for byte 0xC0, 195).

    Otherwise a ``ValueError`` says how to set one."""
    candidates = {"tokenizer.mask_token": lambda: [getattr(tokenizer, "mask_token_id", None)],
                  "unused_embedding_row": lambda: [max(tokenizer.get_vocab().values()) + 1],
                  "reserved_special_token": lambda: _added_specials(tokenizer,
                                                                    lambda t: RESERVED_TOKEN.search(t.content)),
                  "unrendered_special_token": lambda: _unrendered_specials(tokenizer),
                  "unused_byte_token": lambda: _unused_byte_tokens(tokenizer)}  # each read only when reached
    for rule in MASK_RULES:
        ids = sorted(int(i) for i in candidates[rule]() if i is not None and 0 < i < vocab_size)
        if ids:
            return ids[0], rule
    raise ValueError("the target's tokenizer has no mask token (other than id 0), no embedding row past its "
                     "vocabulary, no reserved, unused or unrendered special token and no byte token that UTF-8 text "
                     "never holds to stand for MASK: set drafter.mask_token_id to the id of a token the training "
                     "data never holds (id 0 only if that is true of it)")


def _added_specials(tokenizer, keep) -> list[int]:
    """Ids of the tokenizer's added special tokens that ``keep(AddedToken)`` accepts."""
    return [i for i, token in tokenizer.added_tokens_decoder.items() if token.special and keep(token)]


def _unrendered_specials(tokenizer) -> list[int]:
    """Added special tokens with no role (``TOKEN_ROLES``) whose text no chat template of the tokenizer holds."""
    roles = {getattr(tokenizer, f"{role}_token_id", None) for role in TOKEN_ROLES}
    template = tokenizer.chat_template or ""
    templates = list(template.values()) if isinstance(template, dict) else [template]
    return [i for i in _added_specials(tokenizer, lambda t: not any(t.content in text for text in templates))
            if i not in roles]


def _unused_byte_tokens(tokenizer) -> list[int]:
    """Tokens of ``NON_UTF8_BYTES``: byte-fallback ``<0xC0>`` names, and for a byte-level BPE the
    character it maps the byte to (GPT-2's table maps bytes 0xAE-0xFF to themselves)."""
    vocab = tokenizer.get_vocab()
    names = [f"<0x{b:02X}>" for b in NON_UTF8_BYTES]
    if _byte_level(tokenizer):
        names += [chr(b) for b in NON_UTF8_BYTES]
    return [vocab[name] for name in names if name in vocab]


def _byte_level(tokenizer) -> bool:
    """True for a fast tokenizer whose pre-tokenizer is (or holds) tokenizers' ``ByteLevel``."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return False
    pre = json.loads(backend.to_str()).get("pre_tokenizer") or {}
    return pre.get("type") == "ByteLevel" or any(p.get("type") == "ByteLevel" for p in pre.get("pretokenizers") or [])


class DFlashSection(DrafterSectionBase):
    """The manifest's ``drafter`` section for ``algorithm: dflash`` (sizes left unset are the target's)."""

    algorithm: Literal["dflash"] = Field("dflash", description="drafter to train; its features must be captured "
                                                               "with capture.algorithm=dflash")
    num_layers: int = Field(1, gt=0, description="draft decoder layers")
    num_heads: int | None = Field(None, gt=0, description="attention heads (None = the target's)")
    num_kv_heads: int | None = Field(None, gt=0, description="K/V heads (None = the target's)")
    head_dim: int | None = Field(None, gt=0, description="per-head dim (None = the target's)")
    intermediate_size: int | None = Field(None, gt=0, description="MLP width (None = the target's)")
    block_size: int = Field(8, description="B: anchor + B-1 draft tokens per block (>= 2)")
    attention: Literal["full", "sliding"] = Field("full", description="full: bidirectional in block; sliding: causal + window")
    sliding_window: int | None = Field(None, gt=0, description="context positions visible with attention=sliding")
    mask_token_id: int | None = Field(None, ge=0, description="MASK token id (None = chosen from the tokenizer, "
                                                               "never 0: its mask token, else an embedding row past "
                                                               "its vocabulary, else a reserved special token, else "
                                                               "a special token its chat template never writes, else "
                                                               "a byte token no UTF-8 text holds)")
    block_key_bias: float = Field(0.0, ge=0, description="initial value of a learned per-head logit bias on the "
                                                         "block's own keys (in no peer model: a drafter with it cannot "
                                                         "be exported as speculators); 0 = off, no such parameter")

    @field_validator("block_size")
    @classmethod
    def _block(cls, value: int) -> int:
        if value < 2:
            raise ValueError("block_size must be >= 2 (one anchor + at least one draft token); DFlash uses 8-16")
        return value

    def mask_token(self, target: Any) -> tuple[int, str]:
        """(MASK id, origin): ``mask_token_id`` when set; else the ``init_from`` export's, whose weights
        were trained with it; else ``choose_mask_token``'s. A peer directory's MASK is checked
        against this choice when it is imported."""
        if self.mask_token_id is not None:
            return self.mask_token_id, "drafter.mask_token_id"
        if self.init_from:
            from specray.drafters.format import InvalidDrafterError, read_drafter_config  # the registry imports us

            try:
                mask = read_drafter_config(self.init_from)["architecture"].get("mask_token_id")
            except InvalidDrafterError:  # a peer directory: imported, and its MASK checked, when it is used
                mask = None
            if isinstance(mask, int):
                return mask, "drafter.init_from"
        return choose_mask_token(target.tokenizer, target.vocab_size)

    def drafter_config(self, target: Any, layer_ids: tuple[int, ...]) -> DFlashConfig:
        """The model config of this section for ``target``, reading the captured ``layer_ids``."""
        sizes = target_sizes(target)
        mask, origin = self.mask_token(target)
        return DFlashConfig(
            hidden_size=target.hidden_size, vocab_size=target.vocab_size, target_layer_ids=tuple(layer_ids),
            mask_token_id=mask, mask_token_origin=origin, num_layers=self.num_layers,
            num_heads=self.num_heads or sizes["num_heads"], num_kv_heads=self.num_kv_heads or sizes["num_kv_heads"],
            head_dim=self.head_dim or sizes["head_dim"],
            intermediate_size=self.intermediate_size or sizes["intermediate_size"],
            block_size=self.block_size, attention=self.attention, sliding_window=self.sliding_window,
            block_key_bias=self.block_key_bias, draft_vocab_size=self.draft_vocab_size,
            rms_norm_eps=sizes["rms_norm_eps"], rope_theta=sizes["rope_theta"], rope_scaling=sizes["rope_scaling"],
            max_position_embeddings=sizes["max_position_embeddings"],
        )


def debug_config(target: Any, layer_ids: tuple[int, ...] | None = None) -> DFlashConfig:
    """A tiny DFlash config for tests on ``target`` (1 layer, 4 heads of 16, B = 4, the target's RoPE),
    reading ``layer_ids`` (None: low, middle and high layers ``(1, L // 2, L - 3)``)."""
    L = target.model.config.num_hidden_layers
    mask, origin = choose_mask_token(target.tokenizer, target.vocab_size)
    return DFlashConfig(
        hidden_size=target.hidden_size, vocab_size=target.vocab_size,
        target_layer_ids=tuple(layer_ids) if layer_ids is not None else (1, L // 2, L - 3),
        mask_token_id=mask, mask_token_origin=origin, num_layers=1, num_heads=4, num_kv_heads=2,
        head_dim=16, intermediate_size=128, block_size=4, **target_rope(target),
    )


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
        # Off (0): no parameter at all, so the drafter and its export are what peer models compute.
        bias = nn.Parameter(torch.full((H,), float(cfg.block_key_bias))) if cfg.block_key_bias else None
        self.register_parameter("block_key_bias", bias)
        self.rope = RotaryFrequencies(cfg)

    def project_kv(self, x: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K/V of ``x`` [Bt, T, D] at ``positions`` [Bt, T] -> ([Bt, Hkv, T, hd], [Bt, Hkv, T, hd])."""
        Bt, T, _ = x.shape
        k = self.k_norm(self.k_proj(x).view(Bt, T, self.cfg.num_kv_heads, self.cfg.head_dim)).transpose(1, 2)
        v = self.v_proj(x).view(Bt, T, self.cfg.num_kv_heads, self.cfg.head_dim).transpose(1, 2)
        return self.rope.rotate(k, positions), v

    def forward(self, x, positions, ctx_k, ctx_v, layout: "BlockLayout", query_rows: slice | None = None):
        """x [Bt, N·B, D] the states of N blocks (block-major); positions [Bt, N·B]; ctx_k/ctx_v
        [Bt, Hkv, S, hd]; ``layout`` says what each block sees -> [Bt, N·R, D].

        ``query_rows``: compute the output of only those rows of every block (R of B; every row
        still gives its K/V). A query's scores are its context keys and its own block's B keys, a
        bounded number of blocks at a time (``chunked_rows``): no ``[Q, S + Q]`` tensor exists."""
        Bt = x.shape[0]
        B, H, Hkv, hd = self.cfg.block_size, self.cfg.num_heads, self.cfg.num_kv_heads, self.cfg.head_dim
        N = x.shape[1] // B
        offsets = torch.arange(B, device=x.device)[query_rows or slice(None)]
        R = len(offsets)
        xq, pq = block_rows(x, B, query_rows), block_rows(positions, B, query_rows)
        q = self.q_norm(self.q_proj(xq).view(Bt, N * R, H, hd)).transpose(1, 2)
        q = self.rope.rotate(q, pq).view(Bt, Hkv, H // Hkv, N, R, hd)  # query head h reads KV head h // g
        k_d, v_d = self.project_kv(x, positions)
        k_d, v_d = k_d.view(Bt, Hkv, 1, N, B, hd), v_d.view(Bt, Hkv, 1, N, B, hd)
        S, scale = ctx_k.shape[2], hd**-0.5
        bias = None if self.block_key_bias is None else self.block_key_bias.to(q.dtype).view(Hkv, -1, 1, 1, 1)

        def blocks(start: int, stop: int) -> torch.Tensor:  # [Bt, Hkv, g, (stop − start)·R, hd]
            qc = q[:, :, :, start:stop] * scale  # [Bt, Hkv, g, n, R, hd]
            n = stop - start
            own = qc @ k_d[:, :, :, start:stop].transpose(-1, -2)  # [Bt, Hkv, g, n, R, B]
            if bias is not None:
                own = own + bias  # the block's own keys only
            own = own.masked_fill(~layout.block_visible(start, stop, offsets)[:, None, None], float("-inf"))
            # the g query heads of a KV head as rows of one product (no copy of the context K/V per
            # head); each intermediate of the chunk's size dies as soon as the next exists
            scores = torch.cat([
                (qc.flatten(2, 4) @ ctx_k.transpose(-1, -2)).view(Bt, Hkv, H // Hkv, n * R, S).masked_fill(
                    ~layout.context_visible(start, stop, R)[:, None, None], float("-inf")),
                own.flatten(3, 4)], dim=-1)
            context, block = scores.softmax(-1, dtype=torch.float32).to(q.dtype).split([S, B], -1)
            out = (context.flatten(2, 3) @ ctx_v).view(Bt, Hkv, H // Hkv, n * R, hd)
            return out + (block.unflatten(3, (n, R)) @ v_d[:, :, :, start:stop]).flatten(3, 4)

        out = chunked_rows(blocks, N, max(1, ATTENTION_QUERY_CHUNK // R))  # [Bt, Hkv, g, N·R, hd]
        return self.o_proj(out.reshape(Bt, H, N * R, hd).transpose(1, 2).reshape(Bt, N * R, H * hd))


def block_rows(x: torch.Tensor, block_size: int, rows: slice | None) -> torch.Tensor:
    """Rows ``rows`` of every block of x [Bt, N·B, ...] (block-major) -> [Bt, N·R, ...]; None: all of x."""
    return x if rows is None else x.unflatten(1, (-1, block_size))[:, :, rows].flatten(1, 2)


class DFlashLayer(nn.Module):
    def __init__(self, cfg: DFlashConfig):
        super().__init__()
        self.input_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.attn = DFlashAttention(cfg)
        self.post_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.gate_proj = Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x, positions, ctx_k, ctx_v, layout: "BlockLayout", query_rows: slice | None = None):
        """``query_rows``: return only those rows of every block (the attention still reads every row's K/V)."""
        out = self.attn(self.input_norm(x), positions, ctx_k, ctx_v, layout, query_rows)
        x = block_rows(x, self.attn.cfg.block_size, query_rows) + out
        return x + self.mlp(self.post_norm(x))

    def mlp(self, h: torch.Tensor) -> torch.Tensor:
        """The SwiGLU MLP of normed states h [..., D] -> [..., D]."""
        return self.down_proj(F.silu(self.gate_proj(h)) * self.up_proj(h))


@dataclass(frozen=True)
class BlockLayout:
    """What the queries of N blocks over S context positions see (module docstring), as the blocks'
    anchors [Bt, N] (−1 = unused block slot) and the context's validity [Bt, S] (False on padding).

    The attention asks for the visibility of a few blocks at a time (``context_visible``,
    ``block_visible``); ``dense`` is the whole ``[Bt, N·B, S + N·B]`` mask, the reference.
    Example (S = 4, one block anchored at 2, B = 2, full): both block queries see context
    ``[0, 1]`` and both block keys: dense rows ``[1 1 0 0 | 1 1]``.
    """

    anchors: torch.Tensor
    context_valid: torch.Tensor
    block_size: int
    attention: str = "full"
    sliding_window: int | None = None

    def context_visible(self, start: int, stop: int, rows: int) -> torch.Tensor:
        """[Bt, (stop − start)·rows, S] bool: the context keys each of ``rows`` queries of blocks
        ``start … stop − 1`` sees — strictly before its anchor, valid, and inside the window
        with sliding attention; none for an unused slot (anchor −1)."""
        anchor = self.anchors[:, start:stop].repeat_interleave(rows, dim=1)[:, :, None]  # [Bt, n·R, 1]
        key = torch.arange(self.context_valid.shape[1], device=self.anchors.device)
        seen = (key < anchor) & self.context_valid[:, None, :]
        if self.attention == "sliding":
            seen &= key >= anchor - self.sliding_window
        return seen

    def block_visible(self, start: int, stop: int, offsets: torch.Tensor) -> torch.Tensor:
        """[Bt, n, R, B] bool: the own-block keys a query at block offset ``offsets`` [R] sees — every
        one (full) or those at offsets ``<=`` its own (sliding); an unused slot sees only its own
        row's key, so its softmax stays finite (its loss is masked)."""
        key = torch.arange(self.block_size, device=self.anchors.device)
        own = key[None, :] == offsets[:, None]  # [R, B]
        seen = torch.ones_like(own) if self.attention == "full" else key[None, :] <= offsets[:, None]
        used = (self.anchors[:, start:stop] >= 0)[:, :, None, None]  # [Bt, n, 1, 1]
        return torch.where(used, seen, own)

    def dense(self) -> torch.Tensor:
        """[Bt, N·B, S + N·B] bool: the whole mask, context keys then every block's keys."""
        Bt, N = self.anchors.shape
        B = self.block_size
        offsets = torch.arange(B, device=self.anchors.device)
        context = self.context_visible(0, N, B)
        blocks = torch.zeros(Bt, N, B, N, B, dtype=torch.bool, device=self.anchors.device)
        index = torch.arange(N, device=self.anchors.device)
        blocks[:, index, :, index] = self.block_visible(0, N, offsets).transpose(0, 1)
        return torch.cat([context, blocks.view(Bt, N * B, N * B)], dim=-1)


class DFlashDrafter(DraftVocabHead, nn.Module):
    """The DFlash draft model; ``embed_tokens`` and ``lm_head`` are the target's (frozen, shared)."""

    algorithm = "dflash"
    layer_class = DFlashLayer  # a variant (DFlash 2) swaps in its own decoder layer
    # {draft layer tensor: the target decoder layer's tensor of the same role} (drafter.init_layers=target)
    TARGET_LAYER_TENSORS = {
        "input_norm.weight": "input_layernorm.weight",
        **{f"attn.{p}_proj.weight": f"self_attn.{p}_proj.weight" for p in "qkvo"},
        **{f"attn.{n}_norm.weight": f"self_attn.{n}_norm.weight" for n in "qk"},
        "post_norm.weight": "post_attention_layernorm.weight",
        **{f"{p}_proj.weight": f"mlp.{p}_proj.weight" for p in ("gate", "up", "down")},
    }

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
        self.layers = nn.ModuleList(self.layer_class(config) for _ in range(config.num_layers))
        self.norm = RMSNorm(D, config.rms_norm_eps)
        self._init_weights()
        # A tuple hides the shared modules from nn.Module: not parameters, not in state_dict.
        self._target_modules = (embed_tokens, lm_head)
        self.init_draft_vocab()  # the draft vocabulary (target ids, ascending), part of the export

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

    def target_layer_tensors(self, index: int) -> dict[str, str]:
        """{tensor of draft layer ``index``: the target layer's tensor of the same role}: every layer
        is a Llama layer's attention and MLP (its k/v projections also read the context C)."""
        return self.TARGET_LAYER_TENSORS

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

    def forward_block(self, block_ids, positions, ctx_kv, layout: BlockLayout,
                      out_rows: slice | None = None) -> torch.Tensor:
        """block_ids/positions [Bt, N·B]; ctx_kv per layer; ``layout`` of the N blocks -> hidden [Bt, N·B, D].

        ``out_rows`` returns only those rows of every block [Bt, N·|out_rows|, D]: the last layer computes
        queries, attention output and MLP for them alone (serving, which verifies k ≤ m drafts);
        earlier layers need every row, whose states feed the next layer's K/V."""
        x = self.embed_tokens(block_ids).to(self.fc.weight.dtype)
        last = len(self.layers) - 1
        for i, (layer, (k, v)) in enumerate(zip(self.layers, ctx_kv)):
            x = layer(x, positions, k, v, layout, out_rows if i == last else None)
        return self.norm(x)

    def block_hidden(self, hidden_states, context_valid, anchor_ids, anchors) -> torch.Tensor:
        """The final hidden states of many blocks per sequence (training): [Bt, N, B, D].

        hidden_states [Bt, S, L·D] target features; context_valid [Bt, S] bool; anchor_ids
        [Bt, N] the tokens at the anchors; anchors [Bt, N] their positions (−1 = unused slot).
        Row ``k`` of block n is the block's row at position ``anchor + k``.
        """
        Bt, S, _ = hidden_states.shape
        N, B = anchors.shape[1], self.config.block_size
        context = self.project_context(hidden_states)
        ctx_pos = torch.arange(S, device=hidden_states.device).expand(Bt, S)
        ctx_kv = self.context_kv(context, ctx_pos)
        block_ids = self.block_inputs(anchor_ids).reshape(Bt, N * B)
        positions = (anchors.clamp(min=0)[..., None] + torch.arange(B, device=anchors.device)).reshape(Bt, N * B)
        layout = BlockLayout(anchors, context_valid, B, self.config.attention, self.config.sliding_window)
        return self.forward_block(block_ids, positions, ctx_kv, layout).view(Bt, N, B, -1)

    def forward(self, hidden_states, context_valid, anchor_ids, anchors, head: bool = True) -> torch.Tensor:
        """Training forward over many blocks per sequence (arguments as ``block_hidden``).

        Returns logits [Bt, N, B − 1, V] (V_d with a draft vocabulary): entry ``j − 1`` of block n predicts token ``anchor + j``
        (the anchor row predicts nothing in DFlash, so the LM head skips it). ``head=False``: the
        final states those logits are computed from [Bt, N, B − 1, D] (a loss that applies the
        frozen head a chunk of rows at a time, ``trainer/vocab_loss.py``).
        """
        hidden = self.block_hidden(hidden_states, context_valid, anchor_ids, anchors)  # [Bt, N, B, D]
        return self.logits(hidden[:, :, 1:]) if head else hidden[:, :, 1:]
