"""``specray train``: a captured manifest → a trained drafter run directory.

    specray train -c manifests/train-dflash-quickstart.yaml [section.field=value …]

Writes ``<run_dir>/checkpoints/step-*/``, ``metrics.jsonl``, ``curves.png`` (loss and
per-position accuracy), ``train.json`` (summary) and ``config.yaml``. With
``trainer.world_size > 1`` the same code runs as DDP ranks (torch.distributed, gloo,
127.0.0.1) spawned on this machine; a rerun resumes from the latest checkpoint.
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

from specray.capture.contract import CaptureContract, build_contract
from specray.capture.store import Manifest, open_store, read_manifest
from specray.capture.target import Target, load_target
from specray.drafters import DRAFTERS
from specray.pipeline.config import DrafterSection, TrainJobConfig
from specray.trainer.core import OptimSettings, TrainerCore
from specray.trainer.loader import FeatureLoader
from specray.trainer.loop import Trainer
from specray.trainer.plots import plot_training
from specray.trainer.strategies import get_strategy
from specray.trainer.vocab import DraftVocabulary, draft_vocabulary


def default_mask_token_id(tokenizer) -> int:
    for candidate in (getattr(tokenizer, "mask_token_id", None), tokenizer.unk_token_id):
        if candidate is not None:
            return int(candidate)
    return 0


def drafter_config(d: DrafterSection, target: Target, layer_ids):
    """The algorithm's model config for a ``drafter`` section, with unset sizes taken from the target."""
    config_cls, _ = DRAFTERS[d.algorithm]
    tcfg = target.model.config
    return config_cls(
        hidden_size=target.hidden_size, vocab_size=target.vocab_size, target_layer_ids=tuple(layer_ids),
        mask_token_id=d.mask_token_id if d.mask_token_id is not None else default_mask_token_id(target.tokenizer),
        num_layers=d.num_layers,
        num_heads=d.num_heads or tcfg.num_attention_heads,
        num_kv_heads=d.num_kv_heads or tcfg.num_key_value_heads,
        head_dim=d.head_dim or getattr(tcfg, "head_dim", None) or target.hidden_size // tcfg.num_attention_heads,
        intermediate_size=d.intermediate_size or tcfg.intermediate_size,
        block_size=d.block_size, attention=d.attention, sliding_window=d.sliding_window,
        draft_vocab_size=d.draft_vocab_size,
        rms_norm_eps=tcfg.rms_norm_eps,
        rope_theta=float((getattr(tcfg, "rope_parameters", None) or {}).get("rope_theta", 10000.0)),
    )


@dataclass
class RankParts:
    """One rank's drafter, optimizer and checkpoint metadata, whatever feeds it features."""

    core: TrainerCore
    expected: CaptureContract  # the contract this drafter trains on: the target's, at the captured layers
    extra: dict  # carried by every checkpoint for export: algorithm, drafter config, contract, provenance


def _keeps_export_vocab(cfg: TrainJobConfig) -> bool:
    """True when ``drafter.init_from`` supplies the draft vocabulary (an export with one of the same size)."""
    from specray.drafters.format import read_drafter_config

    if not cfg.drafter.init_from:
        return False
    size = read_drafter_config(cfg.drafter.init_from)["architecture"].get("draft_vocab_size")
    return size is not None and size == cfg.drafter.draft_vocab_size


def _init_from_export(model, model_cfg, export_dir: str, target: Target, contract: CaptureContract) -> None:
    """Start ``model`` from an export's weights (fresh optimizer and schedule: a fine-tune, not a resume).

    The architecture must match, except the draft vocabulary size: the LM head is the target's,
    so a full-vocabulary export restricted to a draft vocabulary keeps its logits on those rows.
    The vocabulary is the export's when it has one of the configured size (``_keeps_export_vocab``),
    else the one ``build_rank`` installs from the training manifest."""
    from specray.drafters.format import load_drafter

    source = load_drafter(export_dir, embed_tokens=target.model.model.embed_tokens, lm_head=target.model.lm_head,
                          target_fingerprint=target.target_fingerprint,
                          template_fingerprint=target.template_fingerprint, contract=json.loads(contract.to_json()))
    have, want = source.config.to_dict(), model_cfg.to_dict()
    diffs = ", ".join(f"{k}: export {have.get(k)!r} vs config {want.get(k)!r}"
                      for k in sorted(set(have) | set(want)) if have.get(k) != want.get(k) and k != "draft_vocab_size")
    if diffs:
        raise ValueError(f"drafter.init_from={export_dir} has another architecture ({diffs}); set the drafter "
                         "section to match the export")
    state = source.state_dict()
    if have.get("draft_vocab_size") != want.get("draft_vocab_size"):
        state.pop("draft_vocab", None)
    missing, unexpected = model.load_state_dict(state, strict=False)
    if set(missing) - {"draft_vocab"} or unexpected:
        raise ValueError(f"drafter.init_from={export_dir}: weights do not fit (missing {missing}, extra {unexpected})")


def prepare_draft_vocab(cfg: TrainJobConfig, manifest: Manifest, store) -> DraftVocabulary | None:
    """The draft vocabulary of ``drafter.draft_vocab_size`` from the training manifest, counted once
    and kept in ``<run_dir>/draft_vocab.json`` (None without one, or when ``init_from`` supplies it)."""
    size = cfg.drafter.draft_vocab_size
    if size is None or _keeps_export_vocab(cfg):
        return None
    path, source = cfg.run_dir / "draft_vocab.json", str(cfg.data.manifest)
    if path.exists():
        vocab = DraftVocabulary.load(path)
        if len(vocab.token_ids) == size and vocab.source == source:
            return vocab
    vocab = draft_vocabulary(manifest, store, size, source=source)
    cfg.run_dir.mkdir(parents=True, exist_ok=True)
    vocab.save(path)
    return vocab


def build_rank(cfg: TrainJobConfig, contract: CaptureContract, *, rank: int = 0, world_size: int = 1,
               provenance: dict | None = None, draft_vocab: DraftVocabulary | None = None) -> RankParts:
    """Target, drafter and TrainerCore of one rank, for features captured under ``contract``.

    With ``drafter.draft_vocab_size`` the vocabulary comes from ``drafter.init_from`` or from
    ``draft_vocab`` (``prepare_draft_vocab``)."""
    strategy_cls = get_strategy(cfg.drafter.algorithm)
    target = load_target(cfg.target.name, dtype=cfg.target.dtype, device=cfg.target.device)
    expected = build_contract(
        cfg.drafter.algorithm, target_fingerprint=target.target_fingerprint,
        template_fingerprint=target.template_fingerprint, num_target_layers=target.num_layers,
        hidden_size=target.hidden_size, layer_ids=contract.layer_ids, dtype=contract.dtype,
    )
    model_cfg = drafter_config(cfg.drafter, target, expected.layer_ids)
    strategy = strategy_cls(num_anchors=cfg.objective.num_anchors, gamma=cfg.objective.gamma, seed=cfg.optim.seed)
    torch.manual_seed(cfg.optim.seed)  # identical initial weights on every rank
    model = strategy.build_model(model_cfg, embed_tokens=target.model.model.embed_tokens,
                                 lm_head=target.model.lm_head, final_norm=target.model.model.norm)
    if cfg.drafter.init_from:
        _init_from_export(model, model_cfg, cfg.drafter.init_from, target, contract)
    if model_cfg.draft_vocab_size is not None and not _keeps_export_vocab(cfg):
        if draft_vocab is None:
            raise ValueError("drafter.draft_vocab_size is counted from a training manifest (data.manifest) or taken "
                             "from drafter.init_from; online training has neither: set drafter.draft_vocab_size=null "
                             "or drafter.init_from=<an export with a draft vocabulary>")
        model.set_draft_vocab(torch.tensor(draft_vocab.token_ids))
    o = cfg.optim
    settings = OptimSettings(
        lr=o.lr, weight_decay=o.weight_decay, warmup_steps=o.warmup_steps, total_steps=o.total_steps,
        min_lr_ratio=o.min_lr_ratio, grad_clip=o.grad_clip, accumulation_steps=o.accumulation_steps, bf16=o.bf16,
    )
    core = TrainerCore(model, strategy, model_cfg, settings, rank=rank, world_size=world_size)
    extra = {
        "algorithm": cfg.drafter.algorithm,
        "drafter_config": model_cfg.to_dict(),
        "contract": json.loads(contract.to_json()),
        "provenance": {
            "run": cfg.name, "run_dir": str(cfg.run_dir.resolve()), "target": cfg.target.name,
            "world_size": world_size, "config": cfg.model_dump(mode="json"), **(provenance or {}),
            **({"draft_vocab": {"size": len(draft_vocab.token_ids), "coverage": draft_vocab.coverage,
                                "source": draft_vocab.source}} if draft_vocab is not None else {}),
        },
    }
    return RankParts(core, expected, extra)


def build_trainer(cfg: TrainJobConfig, *, rank: int = 0, world_size: int = 1) -> Trainer:
    """Everything one rank needs; raises clear errors for a manifest of another contract."""
    if cfg.data.manifest is None:
        raise ValueError("data.manifest is required to train from a manifest; online training reads a "
                         "SampleBroker instead (actors/trainer.py run_trainer_gang)")
    manifest = read_manifest(cfg.data.manifest, endpoint_url=cfg.data.endpoint_url)
    store = open_store(manifest.store_uri, endpoint_url=cfg.data.endpoint_url)
    parts = build_rank(cfg, manifest.contract, rank=rank, world_size=world_size,
                       provenance={"manifest": str(cfg.data.manifest), "samples": len(manifest.refs)},
                       draft_vocab=prepare_draft_vocab(cfg, manifest, store))
    loader = FeatureLoader(
        manifest, store, micro_batch_size=cfg.optim.micro_batch_size, seed=cfg.optim.seed,
        rank=rank, world_size=world_size, expected=parts.expected, max_length=cfg.data.max_length,
    )
    return Trainer(parts.core, loader, run_dir=cfg.run_dir, total_steps=cfg.optim.total_steps,
                   checkpoint_every=cfg.trainer.checkpoint_every, log_every=cfg.trainer.log_every,
                   keep_last=cfg.trainer.keep_last, extra=parts.extra)


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
            *([f"coverage    {f['coverage']:.3f} (labels inside the draft vocabulary)"] if f.get("coverage", 1) < 1 else []),
            f"tokens/s    {f['tokens_per_s']:.0f}",
            f"curves      {self.curves}",
        ])


def _run_rank(rank: int, cfg: TrainJobConfig, world_size: int, port: int | None, progress: bool) -> TrainSummary | None:
    if world_size > 1:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))
        dist.init_process_group("gloo", rank=rank, world_size=world_size)
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
        summary = TrainSummary(str(cfg.run_dir), trainer.step, start, trainer.tokens_seen, final, str(curves))
        (cfg.run_dir / "train.json").write_text(json.dumps(summary.__dict__, indent=2))
        (cfg.run_dir / "config.yaml").write_text(yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False))
        return summary
    finally:
        if world_size > 1:
            dist.destroy_process_group()


def _spawned(rank: int, cfg: TrainJobConfig, world_size: int, port: int, progress: bool) -> None:
    _run_rank(rank, cfg, world_size, port, progress)


def run_training(cfg: TrainJobConfig, *, progress: bool = True) -> TrainSummary:
    cfg.run_dir.mkdir(parents=True, exist_ok=True)
    world_size = cfg.trainer.world_size
    if world_size == 1:
        return _run_rank(0, cfg, 1, None, progress)
    if cfg.drafter.draft_vocab_size is not None and cfg.data.manifest is not None:  # count once, not per rank
        manifest = read_manifest(cfg.data.manifest, endpoint_url=cfg.data.endpoint_url)
        prepare_draft_vocab(cfg, manifest, open_store(manifest.store_uri, endpoint_url=cfg.data.endpoint_url))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_spawned, args=(cfg, world_size, port, progress), nprocs=world_size, join=True)
    train = json.loads((cfg.run_dir / "train.json").read_text())
    return TrainSummary(**train)


def evaluate_export(export_dir: str, manifest_uri: str, *, target_name: str, endpoint_url: str | None = None,
                    num_anchors: int = 64) -> dict:
    """Teacher-forced metrics of an exported drafter on every sample of a manifest."""
    from specray.drafters.format import load_drafter, read_drafter_config
    from specray.trainer.evaluate import evaluate

    manifest = read_manifest(manifest_uri, endpoint_url=endpoint_url)
    target = load_target(target_name)
    contract = json.loads(manifest.contract.to_json())
    model = load_drafter(export_dir, embed_tokens=target.model.model.embed_tokens, lm_head=target.model.lm_head,
                         target_fingerprint=target.target_fingerprint,
                         template_fingerprint=target.template_fingerprint, contract=contract)
    strategy = get_strategy(read_drafter_config(export_dir)["algorithm"])(num_anchors=num_anchors)
    store = open_store(manifest.store_uri, endpoint_url=endpoint_url)
    with FeatureLoader(manifest, store, micro_batch_size=1, seed=0) as loader:
        result = evaluate(model, model.config, strategy, loader, num_batches=len(manifest.refs))
    return {"export": str(export_dir), "manifest": manifest_uri, "samples": len(manifest.refs), **result}
