"""``specray capture``: dataset → rendered samples → CaptureServer → store + Parquet manifest.

Run it::

    specray capture -c manifests/capture-quickstart.yaml data.max_samples=16

It writes ``<run_dir>/manifest.parquet`` (SampleRefs + contract), ``<run_dir>/capture.json``
(the summary below) and ``<run_dir>/config.yaml`` (the resolved config), and the feature blobs
under the store URI.

``run_capture`` captures in this process; ``run_capture_on_ray`` spreads the same batches
over N ``CaptureActor``\ s (``actors/capture.py``, each on the devices Ray grants it) and writes
the same manifest and summary. Both share ``plan_capture`` (render, contract, batches: from the
target's tokenizer, config and fingerprints, without its weights) and ``finish_capture``
(manifest, stale blobs, summary).
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, asdict
from pathlib import Path

import yaml
from tqdm import tqdm

from specray.capture.chat import resolve_chat_template
from specray.capture.contract import CaptureContract, build_contract
from specray.capture.data import ChatRenderer, RenderedSample, load_conversations
from specray.capture.server import CaptureServer, pack_batches
from specray.capture.store import Manifest, SampleRef, feature_key, open_store, read_manifest, write_manifest
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
    for conversation in load_conversations(cfg.data.dataset, purpose="train", limit=cfg.data.max_samples,
                                           skip=cfg.data.skip, id_field=cfg.data.id_field,
                                           endpoint_url=cfg.store.endpoint_url):
        sample = renderer.render(conversation)
        if sample is not None:
            samples.append(sample)
    return samples, dict(renderer.skipped)


def check_unique_keys(samples: list[RenderedSample], contract: CaptureContract) -> None:
    """Refuse a plan in which two samples share an id or a store key (one blob would replace the other)."""
    owners: dict[str, str] = {}
    for sample in samples:
        key = feature_key(contract.contract_id, sample.sample_id)
        other = owners.setdefault(key, sample.sample_id)
        if other is not sample.sample_id:
            what = "sample id" if other == sample.sample_id else "feature key"
            raise ValueError(f"samples {other!r} and {sample.sample_id!r} share one {what} ({key}): one blob "
                             "would replace the other; every sample needs its own id (data.id_field)")


def chat_record(target: Target, cfg: CaptureJobConfig) -> dict:
    """What the manifest records of the chat format: the template (when not the tokenizer's own, so the
    trainer renders and fingerprints as capture did) and the settings it came from."""
    if target.chat_template is None:
        return {}
    return {"chat_template": target.chat_template, "chat_template_source": cfg.data.chat_template,
            "chat_template_kwargs": dict(cfg.data.chat_template_kwargs)}


@dataclass(frozen=True)
class CapturePlan:
    """Everything decided before the first forward: the same for in-process and Ray capture."""

    manifest_uri: str
    previous: Manifest | None  # the manifest an overwrite replaces
    target: Target  # tokenizer, config and fingerprints only (weights="none")
    contract: CaptureContract
    samples: list[RenderedSample]
    skipped: dict[str, int]
    batches: list[list[RenderedSample]]


def plan_capture(cfg: CaptureJobConfig) -> CapturePlan:
    manifest_uri = str((cfg.run_dir / "manifest.parquet").resolve())
    previous = None
    if Path(manifest_uri).exists():
        if not cfg.output.overwrite:
            raise FileExistsError(
                f"{manifest_uri} exists and manifests are immutable; pick another name "
                f"(name=...) or replace it with output.overwrite=true"
            )
        previous = read_manifest(manifest_uri)

    # the driver renders and fingerprints (with the data section's chat template); actors load weights
    target = load_target(cfg.target.name, weights="none", chat_template=resolve_chat_template(cfg.data.chat_template),
                         chat_template_kwargs=cfg.data.chat_template_kwargs)
    contract = contract_for(target, cfg)
    samples, skipped = render_dataset(target, cfg)
    if not samples:
        raise ValueError(f"dataset {cfg.data.dataset!r} gave no usable samples (skipped: {skipped})")
    check_unique_keys(samples, contract)
    batches = pack_batches(samples, max_batch_tokens=cfg.capture.max_batch_tokens, max_batch_size=cfg.capture.max_batch_size)
    return CapturePlan(manifest_uri, previous, target, contract, samples, skipped, batches)


def run_capture(cfg: CaptureJobConfig, *, progress: bool = True) -> CaptureSummary:
    plan = plan_capture(cfg)
    target = load_target(cfg.target.name, dtype=cfg.target.dtype, device=cfg.target.device,
                         chat_template=plan.target.chat_template)  # the plan's chat template
    server = CaptureServer(target, plan.contract, open_store(cfg.store_uri, endpoint_url=cfg.store.endpoint_url))
    refs = []
    start = time.perf_counter()
    total = sum(s.num_tokens for s in plan.samples)
    with tqdm(total=total, unit="tok", desc="capture", disable=not progress) as bar:
        for batch_refs in server.capture_all(plan.batches):
            refs.extend(batch_refs)
            bar.update(sum(r.num_tokens for r in batch_refs))
    seconds = time.perf_counter() - start
    server.close()
    return finish_capture(cfg, plan, refs, seconds)


def run_capture_on_ray(cfg: CaptureJobConfig, *, num_actors: int, num_cpus_per_actor: float = 1.0,
                       num_gpus_per_actor: float = 0.0, progress: bool = True) -> CaptureSummary:
    """``run_capture`` on ``num_actors`` Ray CaptureActors (connect to Ray first): same batches, same output.
    Each actor asks Ray for ``num_gpus_per_actor`` GPUs and runs the target on ``target.device``."""
    from specray.actors.capture import CapturePool
    from specray.capture.devices import check_ray_devices

    check_ray_devices(cfg.target.device, num_gpus_per_actor, device_field="target.device",
                      gpus_field="capture.num_gpus_per_actor", who="capture actors")
    plan = plan_capture(cfg)
    refs: list[SampleRef] = []
    with CapturePool(cfg.target.name, plan.contract, cfg.store_uri, endpoint_url=cfg.store.endpoint_url,
                     num_actors=num_actors, num_cpus_per_actor=num_cpus_per_actor, num_gpus_per_actor=num_gpus_per_actor,
                     target_dtype=cfg.target.dtype, target_device=cfg.target.device,
                     chat_template=plan.target.chat_template) as pool:
        pool.wait_ready()  # capture time (tokens/s) excludes the actors' start-up
        stats = pool.run(((f"batch-{i:06d}", batch) for i, batch in enumerate(plan.batches)),
                         lambda _, batch_refs: refs.extend(batch_refs), progress=progress)
    return finish_capture(cfg, plan, refs, stats.seconds)


def finish_capture(cfg: CaptureJobConfig, plan: CapturePlan, refs: list[SampleRef], seconds: float) -> CaptureSummary:
    """Write the manifest, drop blobs an overwritten manifest no longer references, write the summary."""
    contract, samples, previous = plan.contract, plan.samples, plan.previous
    refs = sorted(refs, key=lambda r: r.sample_id)
    write_manifest(
        plan.manifest_uri, refs, contract=contract, store_uri=cfg.store_uri, overwrite=cfg.output.overwrite,
        metadata={"dataset": cfg.data.dataset, "target": cfg.target.name, "run": cfg.name,
                  **chat_record(plan.target, cfg)},
    )
    if previous is not None:
        # Only now that the new manifest is durable: drop blobs it no longer references.
        old_store = open_store(previous.store_uri, endpoint_url=cfg.store.endpoint_url)
        kept = {r.key for r in refs} if previous.store_uri == cfg.store_uri else set()
        for ref in previous.refs:
            if ref.key not in kept:
                old_store.delete(ref.key)
    total = sum(s.num_tokens for s in samples)
    num_bytes = sum(r.num_bytes for r in refs)
    summary = CaptureSummary(
        samples=len(refs),
        tokens=total,
        supervised_tokens=int(sum(int(s.loss_mask.sum()) for s in samples)),
        skipped=plan.skipped,
        truncated=sum(s.truncated for s in samples),
        bytes=num_bytes,
        bytes_per_token=num_bytes / total,
        min_bytes_per_token=contract.min_bytes_per_token,
        seconds=seconds,
        tokens_per_s=total / seconds,
        store_uri=cfg.store_uri,
        manifest=plan.manifest_uri,
        contract_id=contract.contract_id,
        layer_ids=list(contract.layer_ids),
    )
    cfg.run_dir.mkdir(parents=True, exist_ok=True)
    (cfg.run_dir / "capture.json").write_text(json.dumps(asdict(summary), indent=2))
    (cfg.run_dir / "config.yaml").write_text(yaml.safe_dump(cfg.model_dump(), sort_keys=False))
    return summary
