"""Target runner: our own Llama-family forward over a ``SlotKVCache``.

Why not ``model(...)`` with transformers' cache: at batch 1 on CPU, ``generate`` spends a large
share of each step in framework overhead (cache objects, mask builders, generation config
checks). This runner keeps the weights fused (``[q; k; v]`` and ``[gate; up]`` in one matmul
each), precomputes RoPE tables, and writes K/V straight into preallocated slots.

``forward(input_ids [B, T], slots [B], num_new [B])`` runs ``T`` new rows per request at
positions ``committed[slot] + t`` (``num_new[b] <= T`` real rows, the rest padding), writes their
K/V as scratch (``serving/kv_cache.py``; nothing is committed here), and returns logits for all
rows and the decoder-layer outputs of ``capture_layer_ids`` (the drafter's context features,
same capture point as ``capture/contract.py``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from specray.serving.kv_cache import SlotKVCache, attention_mask


@dataclass
class RunnerOutput:
    logits: torch.Tensor  # [B, T, V] float32
    hidden: dict[int, torch.Tensor]  # layer id -> [B, T, D] decoder-layer output


def pad_rows(seqs: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-pad token lists: (ids [B, T_max], lengths [B])."""
    lengths = torch.tensor([len(s) for s in seqs])
    ids = torch.zeros(len(seqs), int(lengths.max()), dtype=torch.long)
    for b, s in enumerate(seqs):
        ids[b, : len(s)] = torch.tensor(s)
    return ids, lengths


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return x * cos + torch.cat([-x[..., half:], x[..., :half]], dim=-1) * sin


class LlamaRunner:
    def __init__(self, model, *, num_slots: int, max_len: int, capture_layer_ids: tuple[int, ...] = ()):
        cfg = model.config
        if cfg.model_type not in ("llama",):
            raise ValueError(f"the serving runner supports Llama-family targets, got model_type={cfg.model_type!r}")
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = cfg.num_key_value_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        self.eps = cfg.rms_norm_eps
        self.capture_layer_ids = tuple(capture_layer_ids)
        if any(not 0 <= i < cfg.num_hidden_layers for i in self.capture_layer_ids):
            raise ValueError(f"capture_layer_ids {self.capture_layer_ids} outside 0..{cfg.num_hidden_layers - 1}")
        dtype = model.lm_head.weight.dtype
        self.embed = model.model.embed_tokens.weight  # [V, D]
        self.lm_head = model.lm_head.weight  # [V, D] (tied on SmolLM2: the same tensor)
        self.final_norm = model.model.norm.weight
        self.layers = []
        for layer in model.model.layers:
            a, m = layer.self_attn, layer.mlp
            self.layers.append({
                "in_norm": layer.input_layernorm.weight,
                "qkv": torch.cat([a.q_proj.weight, a.k_proj.weight, a.v_proj.weight]).detach(),  # [(H+2Hkv)hd, D]
                "o": a.o_proj.weight,
                "post_norm": layer.post_attention_layernorm.weight,
                "gate_up": torch.cat([m.gate_proj.weight, m.up_proj.weight]).detach(),  # [2I, D]
                "down": m.down_proj.weight,
            })
        theta = float((getattr(cfg, "rope_parameters", None) or {}).get("rope_theta", getattr(cfg, "rope_theta", 10000.0)))
        inv_freq = 1.0 / (theta ** (torch.arange(0, self.head_dim, 2, dtype=torch.float32) / self.head_dim))
        angles = torch.arange(max_len, dtype=torch.float32)[:, None] * inv_freq  # [max_len, hd/2]
        self.cos = torch.cat([angles.cos(), angles.cos()], dim=-1).to(dtype)  # [max_len, hd]
        self.sin = torch.cat([angles.sin(), angles.sin()], dim=-1).to(dtype)
        self.cache = SlotKVCache(num_layers=len(self.layers), num_slots=num_slots, max_len=max_len,
                                 num_kv_heads=self.num_kv_heads, head_dim=self.head_dim, dtype=dtype)

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, slots: torch.Tensor, num_new: torch.Tensor) -> RunnerOutput:
        B, T = input_ids.shape
        H, Hkv, hd = self.num_heads, self.num_kv_heads, self.head_dim
        start = self.cache.committed[slots]  # [B]
        positions = start[:, None] + torch.arange(T)  # [B, T]
        length = int((start + T).max())
        if length > self.cache.max_len:
            raise ValueError(f"context of {length} tokens exceeds the engine's max_len {self.cache.max_len}")
        # A single new row sees every committed row: no mask needed (the common decode case).
        mask = None if (B == 1 and T == 1) else attention_mask(start, num_new, T, length)[:, None]  # [B, 1, T, length]
        cos, sin = self.cos[positions][:, None], self.sin[positions][:, None]  # [B, 1, T, hd]
        x = F.embedding(input_ids, self.embed)  # [B, T, D]
        index = self.cache.index(slots)
        hidden: dict[int, torch.Tensor] = {}
        for i, w in enumerate(self.layers):
            h = _rms_norm(x, w["in_norm"], self.eps)
            q, k, v = F.linear(h, w["qkv"]).split([H * hd, Hkv * hd, Hkv * hd], dim=-1)
            q = _rotate(q.view(B, T, H, hd).transpose(1, 2), cos, sin)  # [B, H, T, hd]
            k = _rotate(k.view(B, T, Hkv, hd).transpose(1, 2), cos, sin)  # [B, Hkv, T, hd]
            v = v.view(B, T, Hkv, hd).transpose(1, 2)
            self.cache.write(i, slots, start, k, v)
            keys, values = self.cache.read(i, index, length)  # [B, Hkv, length, hd]
            attn = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, enable_gqa=True)
            x = x + F.linear(attn.transpose(1, 2).reshape(B, T, H * hd), w["o"])
            h = _rms_norm(x, w["post_norm"], self.eps)
            gate, up = F.linear(h, w["gate_up"]).chunk(2, dim=-1)
            x = x + F.linear(F.silu(gate) * up, w["down"])
            if i in self.capture_layer_ids:
                hidden[i] = x
        logits = F.linear(_rms_norm(x, self.final_norm, self.eps), self.lm_head)
        return RunnerOutput(logits.float(), hidden)
