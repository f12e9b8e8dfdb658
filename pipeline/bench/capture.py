"""``specray bench capture --json FILE`` times, on the same padded batches of the same
samples, alternating order each repeat:

- ``forward``: the plain target forward (``model(input_ids, attention_mask)``, logits and all);
- ``forward+hidden``: the same with ``output_hidden_states=True`` (a naive capture's cost
  before it has written anything);
- ``trunk``: all decoder layers + final norm, no LM head (``model.model``): what capture
  costs with no hooks, no early stop and no writes — ``capture / trunk`` isolates our overhead;
- ``capture``: ``CaptureServer.capture_all`` — hooked forward, cast, and the blobs written
  to the store (a fresh temporary ``file://`` store unless ``store.uri`` is set).

It reports median tokens/s of each (real tokens, padding excluded), the capture/forward
ratio of the medians, and stored bytes/token next to the contract's minimum.
"""

from __future__ import annotations

import statistics
import tempfile
import time
from pathlib import Path
from typing import Callable

import torch

from specray.capture.server import CaptureServer, pack_batches, pad_batch
from specray.capture.store import FeatureStore
from specray.capture.target import load_target
from specray.serving.sidebyside import environment
from specray.pipeline.config import CaptureJobConfig
from specray.pipeline.jobs.capture import contract_for, render_dataset

BENCH_CAPTURE_DEFAULTS = ["name=bench-capture", "data.max_samples=32", "data.max_length=512"]


def bench_capture(cfg: CaptureJobConfig, *, repeats: int = 3) -> dict:
    if repeats < 1:
        raise ValueError("--repeats must be >= 1")
    target = load_target(cfg.target.name, dtype=cfg.target.dtype, device=cfg.target.device)
    contract = contract_for(target, cfg)
    samples, _ = render_dataset(target, cfg)
    batches = pack_batches(samples, max_batch_tokens=cfg.capture.max_batch_tokens, max_batch_size=cfg.capture.max_batch_size)
    padded = [pad_batch(b, target.pad_token_id) for b in batches]
    tokens = sum(s.num_tokens for s in samples)
    model = target.model

    def forward(module: torch.nn.Module, **extra) -> Callable[[], None]:
        @torch.inference_mode()
        def run() -> None:
            for ids, mask in padded:
                module(input_ids=ids.to(model.device), attention_mask=mask.to(model.device), use_cache=False, **extra)
        return run

    with tempfile.TemporaryDirectory(prefix="specray-bench-") as tmp:
        store = FeatureStore(cfg.store.uri or Path(tmp).as_uri(), endpoint_url=cfg.store.endpoint_url)
        server = CaptureServer(target, contract, store, key_prefix="bench-capture")
        refs: list = []

        def capture() -> None:
            refs.clear()
            for batch_refs in server.capture_all(batches):
                refs.extend(batch_refs)

        systems = {
            "forward": forward(model),
            "forward+hidden": forward(model, output_hidden_states=True),
            "trunk": forward(model.model),
            "capture": capture,
        }
        times: dict[str, list[float]] = {name: [] for name in systems}
        server.capture(batches[0])  # warm-up: allocator, thread pools, first write
        systems["forward"]()
        for r in range(repeats):
            order = list(systems) if r % 2 == 0 else list(reversed(systems))
            for name in order:
                start = time.perf_counter()
                systems[name]()
                times[name].append(time.perf_counter() - start)
        stored = sum(ref.num_bytes for ref in refs)
        for ref in refs:
            store.delete(ref.key)
        server.close()

    tps = {name: tokens / statistics.median(t) for name, t in times.items()}
    return {
        "benchmark": "capture",
        "target": cfg.target.name,
        "algorithm": contract.algorithm,
        "layer_ids": list(contract.layer_ids),
        "dtype": contract.dtype,
        "samples": len(samples),
        "batches": len(batches),
        "tokens": tokens,
        "padded_tokens": sum(int(ids.numel()) for ids, _ in padded),
        "repeats": repeats,
        "seconds": times,
        "forward_tokens_per_s": tps["forward"],
        "forward_hidden_tokens_per_s": tps["forward+hidden"],
        "trunk_tokens_per_s": tps["trunk"],
        "capture_tokens_per_s": tps["capture"],
        "ratio": tps["capture"] / tps["forward"],
        "ratio_vs_trunk": tps["capture"] / tps["trunk"],
        "bytes_per_token": stored / tokens,
        "min_bytes_per_token": contract.min_bytes_per_token,
        "header_bytes_per_sample": (stored - contract.min_bytes_per_token * tokens) / len(samples),
        "store": cfg.store.uri or "file:// (temporary)",
        "environment": environment(),
    }


def capture_table(result: dict) -> str:
    base = result["forward_tokens_per_s"]
    lines = [f"{'system':<16} {'tokens/s':>10} {'vs forward':>11}"]
    for label, key in (("forward", "forward_tokens_per_s"), ("forward+hidden", "forward_hidden_tokens_per_s"),
                       ("trunk", "trunk_tokens_per_s"), ("capture", "capture_tokens_per_s")):
        lines.append(f"{label:<16} {result[key]:>10.0f} {result[key] / base:>10.2f}x")
    lines.append(
        f"bytes/token {result['bytes_per_token']:.2f} (contract minimum {result['min_bytes_per_token']}, "
        f"header {result['header_bytes_per_sample']:.0f} B/sample); {result['tokens']} tokens in "
        f"{result['samples']} samples, {result['batches']} batches, median of {result['repeats']}"
    )
    return "\n".join(lines)
