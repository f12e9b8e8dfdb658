"""``specray train``: a captured manifest → a trained drafter run directory.

    specray train -c manifests/train-dflash-quickstart.yaml [section.field=value …]

Writes ``<run_dir>/checkpoints/step-*/``, ``metrics.jsonl``, ``curves.png`` (loss,
per-position accuracy, and the live acceptance measured at each checkpoint with ``live_eval``:
``serving/live_eval.py``), ``train.json`` (summary) and ``config.yaml``. With
``trainer.world_size > 1`` the same code runs as DDP ranks spawned on this machine
(torch.distributed on 127.0.0.1: NCCL with one GPU per rank when ``trainer.device`` resolves to
CUDA, gloo on the CPU); a rerun resumes from the latest checkpoint.
"""

from __future__ import annotations

import json
import os
import socket
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import yaml

from specray.capture.store import open_store, read_manifest
from specray.capture.target import load_target
from specray.pipeline.config import TrainJobConfig
from specray.serving.live_eval import checkpoint_hook
from specray.trainer.assembly import check_manifest_fits, count_draft_vocab, rank_device
from specray.trainer.assembly import build_trainer as build_spec_trainer
from specray.trainer.loader import FeatureLoader
from specray.trainer.loop import Trainer
from specray.trainer.plots import plot_training
from specray.trainer.strategies import get_strategy


def build_trainer(cfg: TrainJobConfig, *, rank: int = 0, world_size: int = 1) -> Trainer:
    """Everything one rank needs (``trainer/assembly.py``), rank 0 with the live evaluation of
    ``cfg.live_eval`` as its checkpoint hook; raises clear errors for a manifest of another contract."""
    spec = cfg.train_spec()
    return build_spec_trainer(spec, rank=rank, world_size=world_size, live_eval=checkpoint_hook(spec.live_eval))


@dataclass(frozen=True)
class TrainSummary:
    run_dir: str
    steps: int
    resumed_from: int
    tokens: int
    final: dict  # the last metrics record
    curves: str

    def table(self) -> str:
        f = self.final
        acc = " ".join(f"{a:.2f}" for a in f["acc_by_pos"])
        return "\n".join([
            f"run dir     {self.run_dir} (steps {self.resumed_from} -> {self.steps}, {self.tokens} tokens)",
            f"loss        {f['loss']:.4f}",
            f"acc by pos  {acc}",
            f"tau_tf      {f['tau_tf']:.3f} (teacher-forced accepted length)",
            *([f"tau_live    {f['tau_live']:.3f} (serving engine, {f['live_prompts']} held-out prompts); accept by pos "
               + " ".join(f"{a:.2f}" for a in f["live_accept_by_pos"])] if f.get("tau_live") is not None else []),
            *([f"coverage    {f['coverage']:.3f} (labels inside the draft vocabulary)"] if f.get("coverage", 1) < 1 else []),
            f"tokens/s    {f['tokens_per_s']:.0f}",
            f"curves      {self.curves}",
        ])


def _run_rank(rank: int, cfg: TrainJobConfig, world_size: int, port: int | None, progress: bool) -> TrainSummary | None:
    if world_size > 1:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))
        device = rank_device(cfg.train_spec(), rank=rank, world_size=world_size)
        if device.type == "cuda":
            torch.cuda.set_device(device)  # NCCL's object collectives run on the current device
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo", rank=rank, world_size=world_size)
    trainer = None
    try:
        trainer = build_trainer(cfg, rank=rank, world_size=world_size)
        start = trainer.resume() if cfg.output.resume else 0
        if not cfg.output.resume and trainer.checkpoint_dir.exists() and any(trainer.checkpoint_dir.iterdir()):
            raise FileExistsError(f"{trainer.checkpoint_dir} has checkpoints and output.resume=false; use a new name")
        trainer.extra["provenance"]["resumed_from"] = start
        records = trainer.fit(progress=progress) if start < cfg.optim.total_steps else []
        trainer.loader.close()
        if rank != 0:
            return None
        if not trainer.metrics_path.exists():
            raise ValueError(f"{cfg.run_dir} already finished {start} steps; raise optim.total_steps to train more")
        curves = plot_training(trainer.metrics_path, cfg.run_dir / "curves.png")
        final = records[-1] if records else json.loads(trainer.metrics_path.read_text().splitlines()[-1])
        summary = TrainSummary(str(cfg.run_dir), trainer.step, start, trainer.run.tokens_seen, final, str(curves))
        (cfg.run_dir / "train.json").write_text(json.dumps(summary.__dict__, indent=2))
        (cfg.run_dir / "config.yaml").write_text(yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False))
        return summary
    finally:
        if trainer is not None:
            trainer.run.close()  # the tracker's files complete
        if world_size > 1:
            dist.destroy_process_group()


def _spawned(rank: int, cfg: TrainJobConfig, world_size: int, port: int, progress: bool) -> None:
    _run_rank(rank, cfg, world_size, port, progress)


def run_training(cfg: TrainJobConfig, *, progress: bool = True) -> TrainSummary:
    """Train ``cfg``; features captured for another algorithm are refused before anything trains."""
    spec = cfg.train_spec()
    world_size = cfg.trainer.world_size
    rank_device(spec, world_size=world_size)  # refuses a device this machine lacks before anything is read
    if spec.tracking is not None:
        spec.tracking.check_installed()
    if spec.manifest is not None:
        check_manifest_fits(spec, read_manifest(spec.manifest, endpoint_url=spec.endpoint_url).contract)
    cfg.run_dir.mkdir(parents=True, exist_ok=True)
    if world_size == 1:
        return _run_rank(0, cfg, 1, None, progress)
    count_draft_vocab(spec)  # once here, not by every rank
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_spawned, args=(cfg, world_size, port, progress), nprocs=world_size, join=True)
    train = json.loads((cfg.run_dir / "train.json").read_text())
    return TrainSummary(**train)


def evaluate_export(export_dir: str, manifest_uri: str, *, target_name: str, endpoint_url: str | None = None,
                    objective: dict | None = None) -> dict:
    """Teacher-forced metrics of an exported drafter on every sample of a manifest, with its
    strategy's evaluation objective (``evaluation``) and ``objective`` overrides."""
    from specray.drafters.format import load_drafter, read_drafter_config
    from specray.trainer.evaluate import evaluate

    manifest = read_manifest(manifest_uri, endpoint_url=endpoint_url)
    # the drafter reads the embedding and LM head only; rendered as the manifest was
    target = load_target(target_name, weights="heads", chat_template=manifest.chat_template)
    contract = json.loads(manifest.contract.to_json())
    model = load_drafter(export_dir, embed_tokens=target.model.model.embed_tokens, lm_head=target.model.lm_head,
                         target_fingerprint=target.target_fingerprint,
                         template_fingerprint=target.template_fingerprint, contract=contract)
    strategy_cls = get_strategy(read_drafter_config(export_dir)["algorithm"])
    strategy = strategy_cls(strategy_cls.objective.model_validate({**strategy_cls.evaluation, **(objective or {})}))
    store = open_store(manifest.store_uri, endpoint_url=endpoint_url)
    with FeatureLoader(manifest, store, micro_batch_size=1, seed=0) as loader:
        result = evaluate(model, model.config, strategy, loader, num_batches=len(manifest.refs))
    return {"export": str(export_dir), "manifest": manifest_uri, "samples": len(manifest.refs), **result}
