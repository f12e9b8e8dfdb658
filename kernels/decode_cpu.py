"""Fused fp32 CPU kernels around the serving runner's products, each paired with a plain-torch
reference in this module.

A decode step of a small target on CPU is the weights' product chain plus a few hundred small
ops between the products (norms, residual adds, RoPE, the KV write, attention, SiLU·up), and
each op costs a dispatch, an allocation and a pass over memory. ``decode_cpu.c`` does the work
between two products in one call each, per layer:

- ``add_rms_norm``: ``x += y`` (the residual add) then RMSNorm, one pass;
- ``attention``: RoPE of q and k, the K/V write into the slot cache, and softmax attention of
  every query head over its request's committed keys and the new rows it may see (a causal
  chain, or any mask over the new rows: a tree), reading the cache in place;
- ``silu_mul``: ``silu(gate) * up`` on the fused ``[gate; up]`` output;
- ``linear``: the products themselves for a few rows, on the weights as stored (where timing on
  the model's chain says it beats oneDNN and BLAS, ``drafters/common.py::FrozenLinear``).

The C source is compiled at first use with the machine's C compiler (``cc``, ``-O3
-march=native -fopenmp``) into ``$SPECRAY_CACHE/kernels/`` (keyed by the source, the compiler
and the CPU's flags) and loaded with ctypes. The exp, softmax and dot-product loops have AVX-512
and AVX2 + FMA paths (the widest the CPU has), the products AVX2 + FMA tiles; elsewhere plain C
the compiler vectorises. Its OpenMP loops run on the libgomp torch has loaded, with
``torch.get_num_threads()`` threads. ``available()`` says whether the kernels
loaded (and ``unavailable_reason()`` why not: no compiler, a build error, a non-x86 CPU,
or ``SPECRAY_NATIVE_KERNELS=0``); the runner then stays on its torch path, the same math.

Results equal the references up to float rounding (different summation order, an FMA, a
polynomial exp within 2 ulp). Non-finite inputs stay non-finite in the outputs.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

import torch

log = logging.getLogger(__name__)

_SOURCE = Path(__file__).with_name("decode_cpu.c")
_FLAGS = ["-O3", "-fopenmp", "-shared", "-fPIC", "-std=gnu11"]
_LOCK = threading.Lock()
_LIB: ctypes.CDLL | None = None
_REASON: str | None = None
_LOADED = False


def _cache_dir() -> Path:
    return Path(os.environ.get("SPECRAY_CACHE", Path.home() / ".cache" / "specray")) / "kernels"


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    return platform.processor()


def _build(march: str = "native") -> ctypes.CDLL:
    """Compile (or reuse from the cache) and load the kernels for ``-march={march}``: ``native`` in
    serving; the tests also build the narrower ISA levels this CPU runs (``x86-64-v3``: AVX2 + FMA;
    ``x86-64-v2``: no vector path of ours), so that each vector path is checked where it runs."""
    flags = [*_FLAGS, f"-march={march}"]
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        raise RuntimeError("no C compiler (cc or gcc) on PATH")
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True, check=True).stdout
    source = _SOURCE.read_bytes()
    key = hashlib.sha256(b"\0".join([source, version.encode(), " ".join(flags).encode(),
                                     _cpu_flags().encode()])).hexdigest()[:16]
    target = _cache_dir() / f"decode_cpu-{key}.so"
    if not target.exists():
        target.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
            built = Path(tmp) / target.name
            proc = subprocess.run([compiler, *flags, str(_SOURCE), "-o", str(built), "-lm"],
                                  capture_output=True, text=True)
            if proc.returncode != 0:
                raise RuntimeError(f"{compiler} failed on {_SOURCE.name}:\n{proc.stderr[-2000:]}")
            os.replace(built, target)  # atomic: concurrent builders each write a whole file
    lib = ctypes.CDLL(str(target))
    p, i64, f32, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float, ctypes.c_int
    lib.specray_add_rms_norm.argtypes = [p, p, p, p, i64, i64, f32, i32]
    lib.specray_silu_mul.argtypes = [p, p, i64, i64, i32]
    lib.specray_linear.argtypes = [p, p, p, i64, i64, i64, i32]
    lib.specray_attention.argtypes = [p, i64, i64, p, i64, i64, i64, p, p, p, p, i64, p, p, p, p, f32, p, i32]
    for fn in (lib.specray_add_rms_norm, lib.specray_silu_mul, lib.specray_attention, lib.specray_linear):
        fn.restype = None
    return lib


def _lib() -> ctypes.CDLL | None:
    global _LIB, _REASON, _LOADED
    if _LOADED:
        return _LIB
    with _LOCK:
        if not _LOADED:
            if os.environ.get("SPECRAY_NATIVE_KERNELS", "1") == "0":
                _REASON = "SPECRAY_NATIVE_KERNELS=0"
            elif platform.machine() not in ("x86_64", "AMD64"):
                _REASON = f"built for x86-64 only (this machine: {platform.machine()})"
            else:
                try:
                    _LIB = _build()
                except Exception as e:  # noqa: BLE001 - any build or load failure leaves the torch path
                    _REASON = f"could not build {_SOURCE.name}: {e}"
            if _REASON is not None:
                log.warning("fused CPU kernels unavailable (%s); the serving runner uses its torch path", _REASON)
            _LOADED = True
    return _LIB


def available() -> bool:
    """Whether the compiled kernels are loaded (building them on first call)."""
    return _lib() is not None


def unavailable_reason() -> str | None:
    _lib()
    return _REASON


def _run(name: str, fn, *args) -> None:
    """Call a kernel; under ``torch.profiler`` as a ``specray::<name>`` range (``specray bench step``)."""
    if torch.autograd._profiler_enabled():
        with torch.profiler.record_function(f"specray::{name}"):
            fn(*args)
    else:
        fn(*args)


def _check(name: str, t: torch.Tensor, shape: tuple[int, ...] | None = None, dtype=torch.float32) -> int:
    if t.dtype != dtype or t.device.type != "cpu" or not t.is_contiguous():
        raise ValueError(f"{name}: expected a contiguous CPU {dtype} tensor, got {t.dtype} on {t.device} "
                         f"(contiguous={t.is_contiguous()})")
    if shape is not None and tuple(t.shape) != shape:
        raise ValueError(f"{name}: expected shape {shape}, got {tuple(t.shape)}")
    return t.data_ptr()


# ---- add + RMSNorm ---------------------------------------------------------------------------

def add_rms_norm_reference(x: torch.Tensor, y: torch.Tensor | None, weight: torch.Tensor,
                           eps: float) -> torch.Tensor:
    """x [R, D] (updated in place: ``x += y`` when y is given) -> RMSNorm(x) * weight [R, D]."""
    if y is not None:
        x.add_(y)
    return torch.nn.functional.rms_norm(x, (x.shape[-1],), weight, eps)


def add_rms_norm(x: torch.Tensor, y: torch.Tensor | None, weight: torch.Tensor, eps: float) -> torch.Tensor:
    R, D = x.shape
    out = torch.empty_like(x)
    _run("add_rms_norm", _lib().specray_add_rms_norm, _check("x", x), None if y is None else _check("y", y, (R, D)),
         _check("weight", weight, (D,)), out.data_ptr(), R, D, eps, torch.get_num_threads())
    return out


# ---- the products, for a few rows --------------------------------------------------------------

def linear_reference(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x [M, K] @ weight [N, K]ᵀ -> [M, N]."""
    return torch.nn.functional.linear(x, weight)


def linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``linear_reference`` on the weight as stored, for the few rows of a decode step or a small
    verify: it streams the weight once and does every row's work on each part of it while it is
    in registers (``drafters/common.py::FrozenLinear`` picks it by timing, per row count)."""
    M, K = x.shape
    N = weight.shape[0]
    out = x.new_empty(M, N)
    _run("linear", _lib().specray_linear, _check("x", x), _check("weight", weight, (N, K)), out.data_ptr(),
         M, K, N, torch.get_num_threads())
    return out


# ---- SiLU · up -------------------------------------------------------------------------------

def silu_mul_reference(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up [R, 2I] ([gate; up] fused) -> silu(gate) * up [R, I]."""
    gate, up = gate_up.chunk(2, dim=-1)
    return torch.nn.functional.silu(gate) * up


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    R, I2 = gate_up.shape
    out = gate_up.new_empty(R, I2 // 2)
    _run("silu_mul", _lib().specray_silu_mul, _check("gate_up", gate_up), out.data_ptr(), R, I2 // 2,
         torch.get_num_threads())
    return out


# ---- attention over the slot cache -----------------------------------------------------------

def _row_offsets(B: int, T: int | None, lengths: torch.Tensor | None) -> torch.Tensor:
    """[B + 1] first row of each request in the forward's rows: ``T`` rows each, or ``lengths`` packed."""
    if (T is None) == (lengths is None):
        raise ValueError("give T (rows per request, padded) or lengths (rows packed back to back), not both")
    if lengths is None:
        return torch.arange(B + 1, dtype=torch.int64, device="cpu") * T
    if lengths.shape != (B,) or int(lengths.min()) < 1:
        raise ValueError(f"lengths: expected {B} row counts >= 1, got {lengths.tolist()}")
    return torch.cat([torch.zeros(1, dtype=torch.int64, device="cpu"), lengths.to(torch.int64).cumsum(0)])


def attention_reference(qkv: torch.Tensor, *, B: int, T: int | None = None, num_heads: int, num_kv_heads: int,
                        cos: torch.Tensor, sin: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                        slots: torch.Tensor, start: torch.Tensor, num_new: torch.Tensor | None = None,
                        visible: torch.Tensor | None = None, lengths: torch.Tensor | None = None) -> torch.Tensor:
    """qkv [R, (H + 2Hkv)*hd] -> attention output [R, H*hd]; writes the rows' rotated K and V
    at cache rows ``start[b] + t`` of slot ``slots[b]`` (caches [num_slots, Hkv, max_len, hd]).

    Rows: ``T`` per request (R = B*T; row t of request b is row b*T + t; rows ``t >= num_new[b]``
    padding), or with ``lengths`` [B] (a prefill) ``lengths[b]`` per request packed back to back,
    all real (``num_new`` and ``visible`` unused). Row t of request b sees its committed keys and,
    with ``visible`` [B, T, T] None (a causal chain), the new rows ``j <= t`` (a padding row key 0
    only); else new row j iff ``visible[b, t, j]``. cos/sin [R, hd]: rows of ``rope_table``
    (sines sign-folded)."""
    H, Hkv = num_heads, num_kv_heads
    hd = k_cache.shape[-1]
    g = H // Hkv
    first = _row_offsets(B, T, lengths)
    R = int(first[-1])
    x = qkv.view(R, H + 2 * Hkv, hd)
    rot = x[:, : H + Hkv] * cos[:, None] + x[:, : H + Hkv].view(R, H + Hkv, 2, hd // 2).flip(2).reshape(
        R, H + Hkv, hd) * sin[:, None]
    out = qkv.new_empty(R, H * hd)
    for b in range(B):
        slot, s, rows = int(slots[b]), int(start[b]), slice(int(first[b]), int(first[b + 1]))
        n = rows.stop - rows.start
        real = n if lengths is not None else int(num_new[b])
        k_cache[slot, :, s : s + n] = rot[rows, H:].transpose(0, 1)
        v_cache[slot, :, s : s + n] = x[rows, H + Hkv :].transpose(0, 1)
        for t in range(n):
            if visible is None:
                seen = torch.arange(s + t + 1) if t < real else torch.tensor([0])
            else:
                seen = torch.cat([torch.arange(s), s + visible[b, t].nonzero()[:, 0]])
            r = rows.start + t
            for h in range(H):
                keys, values = k_cache[slot, h // g, seen], v_cache[slot, h // g, seen]  # [n, hd]
                p = (keys @ rot[r, h] * hd**-0.5).softmax(-1)
                out[r, h * hd : (h + 1) * hd] = p @ values
    return out


class Attention:
    """One forward's attention over the layers of a slot cache, checked once and then called per
    layer: ``Attention(...)(layer, qkv)`` is ``attention_reference`` on ``k_cache[layer]``,
    ``v_cache[layer]`` (caches [L, num_slots, Hkv, max_len, hd]; other arguments as there)."""

    def __init__(self, *, B: int, T: int | None = None, num_heads: int, num_kv_heads: int, cos: torch.Tensor,
                 sin: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor,
                 start: torch.Tensor, num_new: torch.Tensor | None = None, visible: torch.Tensor | None = None,
                 lengths: torch.Tensor | None = None):
        H, Hkv = num_heads, num_kv_heads
        L, num_slots, _, max_len, hd = k_cache.shape
        if k_cache.shape[2] != Hkv or v_cache.shape != k_cache.shape:
            raise ValueError(f"caches {tuple(k_cache.shape)} / {tuple(v_cache.shape)} do not hold {Hkv} KV heads")
        if H % Hkv or hd % 2:
            raise ValueError(f"{H} query heads over {Hkv} KV heads of size {hd}")
        first = _row_offsets(B, T, lengths)
        counts = first[1:] - first[:-1]  # [B] rows per request
        if int((start + counts).max()) > max_len or int(slots.max()) >= num_slots or int(slots.min()) < 0:
            raise ValueError("a request's rows or slot fall outside the cache")
        if lengths is not None:  # packed: every row is real, and a mask over ragged rows has no [B, T, T] form
            if visible is not None:
                raise ValueError("visible (a mask over T rows per request) needs T, not lengths")
            num_new, T = counts, int(counts.max())
        elif num_new is None:
            raise ValueError("num_new (the real rows of each request's T) is required with T")
        if visible is not None:
            visible = visible.to(torch.uint8).contiguous()
            _check("visible", visible, (B, T, T), torch.uint8)
        R = int(first[-1])
        first = first.contiguous() if lengths is not None else None  # the kernel's uniform path needs no offsets
        self._keep = (cos, sin, k_cache, v_cache, slots, start, num_new, visible, first)  # alive while pointers are used
        self._k, self._v = _check("k_cache", k_cache), _check("v_cache", v_cache)
        self._layer_bytes = k_cache[0].numel() * k_cache.element_size()
        self._width, self._out = (H + 2 * Hkv) * hd, H * hd
        self._rows, self._layers = R, L
        self._args = (B, T, None if first is None else first.data_ptr(), H, Hkv, hd,
                      _check("cos", cos, (R, hd)), _check("sin", sin, (R, hd)))
        self._rest = (max_len, _check("slots", slots, (B,), torch.int64), _check("start", start, (B,), torch.int64),
                      _check("num_new", num_new, (B,), torch.int64),
                      None if visible is None else visible.data_ptr(), hd**-0.5)
        self._fn = _lib().specray_attention

    def __call__(self, layer: int, qkv: torch.Tensor) -> torch.Tensor:
        if not 0 <= layer < self._layers:
            raise IndexError(f"layer {layer} outside 0..{self._layers - 1}")
        _check("qkv", qkv, (self._rows, self._width))
        out = qkv.new_empty(self._rows, self._out)
        offset = layer * self._layer_bytes
        _run("attention", self._fn, qkv.data_ptr(), *self._args, self._k + offset, self._v + offset, *self._rest,
             out.data_ptr(), torch.get_num_threads())
        return out


def attention(qkv: torch.Tensor, *, k_cache: torch.Tensor, v_cache: torch.Tensor, **kwargs) -> torch.Tensor:
    """``attention_reference`` in one call (same arguments; caches of one layer)."""
    return Attention(k_cache=k_cache[None], v_cache=v_cache[None], **kwargs)(0, qkv)
