"""``specray capture``: dataset → rendered samples → CaptureServer → store + Parquet manifest.

Run it::

    specray capture -c manifests/capture-quickstart.yaml data.max_samples=16

It writes ``<run_dir>/manifest.parquet`` (SampleRefs + contract), ``<run_dir>/capture.json``
(the summary below) and ``<run_dir>/config.yaml`` (the resolved config), and the feature blobs
under the store URI.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, asdict
from pathlib import Path

import yaml
from tqdm import tqdm

from specray.capture.contract import CaptureContract, build_contract
from specray.capture.data import ChatRenderer, RenderedSample, load_conversations
from specray.capture.server import CaptureServer, pack_batches
from specray.capture.store import FeatureStore, read_manifest, write_manifest
from specray.capture.target import Target, load_target
from specray.pipeline.config import CaptureJobConfig


@dataclass(frozen=True)
class CaptureSummary:
    samples: int
    tokens: int
    supervised_tokens: int
    skipped: dict[str, int]
    truncated: int
    bytes: int
    bytes_per_token: float
    min_bytes_per_token: int
    seconds: float
    tokens_per_s: float
    store_uri: str
    manifest: str
    contract_id: str
    layer_ids: list[int]

    def table(self) -> str:
        rows = [
            ("samples", f"{self.samples} (skipped {sum(self.skipped.values())}: {self.skipped}; truncated {self.truncated})"),
            ("tokens", f"{self.tokens} ({self.supervised_tokens} supervised)"),
            ("bytes/token", f"{self.bytes_per_token:.1f} (contract minimum {self.min_bytes_per_token})"),
            ("tokens/s", f"{self.tokens_per_s:.0f} ({self.seconds:.1f} s)"),
            ("contract", f"{self.contract_id} layers {self.layer_ids}"),
            ("store", self.store_uri),
            ("manifest", self.manifest),
        ]
        width = max(len(k) for k, _ in rows)
        return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)


def contract_for(target: Target, cfg: CaptureJobConfig) -> CaptureContract:
    return build_contract(
        cfg.capture.algorithm,
        target_fingerprint=target.target_fingerprint,
        template_fingerprint=target.template_fingerprint,
        num_target_layers=target.num_layers,
        hidden_size=target.hidden_size,
        layer_ids=cfg.capture.layer_ids,
        dtype=cfg.capture.dtype,
    )


def render_dataset(target: Target, cfg: CaptureJobConfig) -> tuple[list[RenderedSample], dict[str, int]]:
    renderer = ChatRenderer(target.tokenizer, max_length=cfg.data.max_length, truncation=cfg.data.truncation)
    samples = []
    for conversation in load_conversations(cfg.data.dataset, purpose="train", limit=cfg.data.max_samples, skip=cfg.data.skip):
        sample = renderer.render(conversation)
        if sample is not None:
            samples.append(sample)
    return samples, dict(renderer.skipped)


def run_capture(cfg: CaptureJobConfig, *, progress: bool = True) -> CaptureSummary:
    run_dir = cfg.run_dir
    manifest_uri = str((run_dir / "manifest.parquet").resolve())
    store = FeatureStore(cfg.store_uri, endpoint_url=cfg.store.endpoint_url)
    previous = None
    if Path(manifest_uri).exists():
        if not cfg.output.overwrite:
            raise FileExistsError(
                f"{manifest_uri} exists and manifests are immutable; pick another name "
                f"(name=...) or replace it with output.overwrite=true"
            )
        previous = read_manifest(manifest_uri)

    target = load_target(cfg.target.name, dtype=cfg.target.dtype, device=cfg.target.device)
    contract = contract_for(target, cfg)
    samples, skipped = render_dataset(target, cfg)
    if not samples:
        raise ValueError(f"dataset {cfg.data.dataset!r} gave no usable samples (skipped: {skipped})")
    batches = pack_batches(samples, max_batch_tokens=cfg.capture.max_batch_tokens, max_batch_size=cfg.capture.max_batch_size)

    server = CaptureServer(target, contract, store)
    refs = []
    start = time.perf_counter()
    total = sum(s.num_tokens for s in samples)
    with tqdm(total=total, unit="tok", desc="capture", disable=not progress) as bar:
        for batch_refs in server.capture_all(batches):
            refs.extend(batch_refs)
            bar.update(sum(r.num_tokens for r in batch_refs))
    seconds = time.perf_counter() - start
    server.close()

    refs.sort(key=lambda r: r.sample_id)
    write_manifest(
        manifest_uri, refs, contract=contract, store_uri=cfg.store_uri, overwrite=cfg.output.overwrite,
        metadata={"dataset": cfg.data.dataset, "target": cfg.target.name, "run": cfg.name},
    )
    if previous is not None:
        # Only now that the new manifest is durable: drop blobs it no longer references.
        old_store = FeatureStore(previous.store_uri, endpoint_url=cfg.store.endpoint_url)
        kept = {r.key for r in refs} if previous.store_uri == cfg.store_uri else set()
        for ref in previous.refs:
            if ref.key not in kept:
                old_store.delete(ref.key)
    num_bytes = sum(r.num_bytes for r in refs)
    summary = CaptureSummary(
        samples=len(refs),
        tokens=total,
        supervised_tokens=int(sum(int(s.loss_mask.sum()) for s in samples)),
        skipped=skipped,
        truncated=sum(s.truncated for s in samples),
        bytes=num_bytes,
        bytes_per_token=num_bytes / total,
        min_bytes_per_token=contract.min_bytes_per_token,
        seconds=seconds,
        tokens_per_s=total / seconds,
        store_uri=cfg.store_uri,
        manifest=manifest_uri,
        contract_id=contract.contract_id,
        layer_ids=list(contract.layer_ids),
    )
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "capture.json").write_text(json.dumps(asdict(summary), indent=2))
    (run_dir / "config.yaml").write_text(yaml.safe_dump(cfg.model_dump(), sort_keys=False))
    return summary
