"""Assembling a training run: what one rank trains, built the same way for every driver.

``specray train`` (``pipeline/jobs/train.py``, one process or DDP ranks) and the Ray trainer gang
(``actors/trainer.py``) hand this module a ``TrainSpec`` — plain values and the validated
``drafter`` / ``objective`` sections, no pipeline config — and get the same target heads, drafter,
strategy and ``TrainerCore`` back (``build_rank``), on the rank's device. The algorithm comes from the registries
(``specray.drafters.DRAFTERS``, ``specray.trainer.strategies.STRATEGIES``): the drafter section
derives its model config (``drafter_config``), the strategy builds the model.

What a rank loads (DESIGN.md §7a): the target's embedding, final norm and LM head, read from its
safetensors by tensor name (``load_target(weights="heads")``), and, with ``drafter.init_layers=target``,
the tensors of its top layers the drafter's layers start from (``trainer/init_layers.py``); the
drafter is built on the CPU from the seed (the same weights on every device), then moved with its
optimizer state to the rank's device (``spec.device``: ``auto | cpu | cuda``, ``capture/devices.py``),
where the batches are copied (``TrainerCore``). Under bf16 precision the heads are read in the
target's dtype, else in float32. Rank 0's live evaluation runs the serving engine, which reads
the whole target: it is loaded on that device at the first checkpoint (``whole_target_hook``).

Also here: the checks that features fit the drafter (``check_capture_fits``), the draft
vocabulary counted once from the training manifest or ``drafter.draft_vocab_from``
(``prepare_draft_vocab``) and starting from an export (``drafter.init_from``; a peer drafter's
directory is imported first, ``drafters/peer_import.py``).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Callable

import torch
from torch import nn

from specray.capture.contract import CaptureContract, ContractMismatchError, build_contract
from specray.capture.devices import dtype_name, resolve_device, resolve_dtype, resolve_precision, visible_gpus
from specray.capture.store import Manifest, open_store, read_manifest
from specray.capture.target import Target, apply_chat_format, load_target, resolve_target_dir
from specray.drafters.common import DrafterSectionBase
from specray.trainer.core import OptimSettings, TrainerCore
from specray.trainer.init_layers import init_target_layers
from specray.trainer.loader import FeatureLoader
from specray.trainer.loop import CheckpointHook, Trainer, TrainRun
from specray.trainer.strategies import get_strategy
from specray.trainer.tracking import Tracker, TrackingSettings, open_tracker
from specray.trainer.vocab import (RENDER_MAX_LENGTH, DraftVocabulary, dataset_vocabulary, draft_vocabulary,
                                   is_dataset_spec)


@dataclass(frozen=True)
class TrainSpec:
    """Everything a training run needs, as plain values (picklable: the gang's workers get it)."""

    name: str  # the run's name (provenance; the gang's Ray Train run name)
    run_dir: str  # absolute: checkpoints, metrics.jsonl, draft_vocab.json
    target: str  # embedded:<name>, debug[:seed] or a local HF directory
    target_dtype: str  # auto | float32 | bfloat16 | float16 (capture/devices.py)
    drafter: DrafterSectionBase  # the algorithm's drafter section (drafters/<algorithm>.py)
    objective: Any  # the algorithm's strategy objective (trainer/strategies/<algorithm>.py)
    optim: OptimSettings
    micro_batch_size: int  # sequences per rank per micro-batch
    seed: int  # seeds init, data order and the strategy's draws
    manifest: str | None  # features to train on; None = an online stream
    endpoint_url: str | None  # S3 endpoint of the manifest and its store
    max_length: int | None  # cut samples to this many tokens
    world_size: int  # DP ranks of specray train (the gang's are its num_workers)
    log_every: int
    checkpoint_every: int
    keep_last: int | None  # checkpoints kept (None = all)
    config: dict  # the job's whole config as JSON, recorded in every checkpoint's provenance
    live_eval: Any = None  # serving/live_eval.py LiveEvalSettings: measured at each checkpoint (None = off)
    # the chat template the features were rendered with (a manifest's ``chat_template``; None = the tokenizer's)
    chat_template: str | None = None
    device: str = "auto"  # auto | cpu | cuda: where a rank trains (a driver may pass a concrete device to build_rank)
    precision: str = "auto"  # auto | fp32 | bf16: the drafter's compute (auto = bf16 on CUDA)
    device_field: str = "train.device"  # the config field ``device`` came from (errors name it)
    tracking: TrackingSettings | None = None  # trainer/tracking.py: rank 0 logs every metrics record (None = off)

    @property
    def algorithm(self) -> str:
        return self.drafter.algorithm

    @property
    def precision_field(self) -> str:
        return self.device_field.rpartition(".")[0] + ".precision"


def check_capture_fits(drafter_algorithm: str, capture_algorithm: str, *, field: str, where: str = "",
                       fix: str | None = None) -> None:
    """Refuse features captured under another algorithm's contract than the drafter trains on.

    A drafter trains on the tensors of its own algorithm's contract (``CONTRACT_SPECS``): the
    layer count, the order and ``last_hidden_states`` differ between algorithms.
    """
    if drafter_algorithm != capture_algorithm:
        raise ContractMismatchError(
            f"{field}={drafter_algorithm} needs features captured with capture.algorithm={drafter_algorithm} "
            f"(got {capture_algorithm}{where}); "
            + (fix or f"set capture.algorithm={drafter_algorithm}")
        )


def check_manifest_fits(spec: TrainSpec, contract: CaptureContract) -> None:
    """``check_capture_fits`` for ``specray train``'s manifest, before anything is trained."""
    check_capture_fits(spec.algorithm, contract.algorithm, field="drafter.algorithm",
                       where=f" in {spec.manifest}",
                       fix=f"capture a manifest with capture.algorithm={spec.algorithm}, or train "
                           f"drafter.algorithm={contract.algorithm}")


@dataclass
class RankParts:
    """One rank's drafter, optimizer and checkpoint metadata, whatever feeds it features."""

    core: TrainerCore
    expected: CaptureContract  # the contract this drafter trains on: the target's, at the captured layers
    extra: dict  # carried by every checkpoint for export: algorithm, drafter config, contract, provenance
    target: Target  # the target's heads the drafter reads (weights="heads"), on the rank's device
    device: torch.device  # where the drafter, its optimizer state and its batches live


def _keeps_export_vocab(drafter: DrafterSectionBase) -> bool:
    """True when ``drafter.init_from`` supplies the draft vocabulary (an export, or a peer drafter
    directory, with one of the same size)."""
    from specray.drafters.format import read_drafter_config
    from specray.drafters.peer_import import is_peer_directory, peer_summary

    if not drafter.init_from:
        return False
    if is_peer_directory(drafter.init_from):
        size = peer_summary(drafter.init_from)["draft_vocab_size"]
    else:
        size = read_drafter_config(drafter.init_from)["architecture"].get("draft_vocab_size")
    return size is not None and size == drafter.draft_vocab_size


def _init_from_export(model: nn.Module, model_cfg, export_dir: str, target: Target, contract: CaptureContract) -> None:
    """Start ``model`` from an export's weights (fresh optimizer and schedule: a fine-tune, not a resume).

    The architecture must match, except the draft vocabulary size: the LM head is the target's,
    so a full-vocabulary export restricted to a draft vocabulary keeps its logits on those rows.
    The vocabulary is the export's when it has one of the configured size (``_keeps_export_vocab``),
    else the one ``build_rank`` installs from the training manifest.

    A *warm start*: an export of an algorithm in the model's ``warm_starts_from`` (DFlash 2 from
    DFlash) gives the weights it has; its architecture fields must match the model's, the model's
    own parts keep their initialisation, and its capture contract may differ in the algorithm only."""
    from specray.drafters.format import load_drafter, read_drafter_config

    source_algorithm = read_drafter_config(export_dir)["algorithm"]
    warm = source_algorithm != model.algorithm
    if warm and source_algorithm not in getattr(model, "warm_starts_from", ()):
        raise ValueError(f"drafter.init_from={export_dir} is a {source_algorithm} export; a {model.algorithm} drafter "
                         f"starts from {[model.algorithm, *getattr(model, 'warm_starts_from', ())]} exports")
    expected = dict(json.loads(contract.to_json()), algorithm=source_algorithm)
    source = load_drafter(export_dir, embed_tokens=target.model.model.embed_tokens, lm_head=target.model.lm_head,
                          target_fingerprint=target.target_fingerprint,
                          template_fingerprint=target.template_fingerprint, contract=expected)
    have, want = source.config.to_dict(), model_cfg.to_dict()
    keys = set(have) if warm else set(have) | set(want)
    not_architecture = {"draft_vocab_size", "mask_token_origin"}  # a head restriction; how the MASK id was chosen
    diffs = ", ".join(f"{k}: export {have.get(k)!r} vs config {want.get(k)!r}"
                      for k in sorted(keys) if have.get(k) != want.get(k) and k not in not_architecture)
    if diffs:
        raise ValueError(f"drafter.init_from={export_dir} has another architecture ({diffs}); set the drafter "
                         "section to match the export")
    state = source.state_dict()
    if have.get("draft_vocab_size") != want.get("draft_vocab_size"):
        state.pop("draft_vocab", None)
    missing, unexpected = model.load_state_dict(state, strict=False)
    if (set(missing) - {"draft_vocab"} and not warm) or unexpected:
        raise ValueError(f"drafter.init_from={export_dir}: weights do not fit (missing {missing}, extra {unexpected})")


def _vocab_source(spec: TrainSpec) -> str | None:
    """What the draft vocabulary is counted from: ``drafter.draft_vocab_from``, else the training
    manifest (with a dataset's conversation limit, so a changed limit is another source)."""
    d = spec.drafter
    if d.draft_vocab_from is None:
        return spec.manifest
    if d.draft_vocab_samples is not None:
        if not is_dataset_spec(d.draft_vocab_from):
            raise ValueError(f"drafter.draft_vocab_samples limits a dataset's conversations, and "
                             f"drafter.draft_vocab_from={d.draft_vocab_from} is a manifest: remove draft_vocab_samples")
        return f"{d.draft_vocab_from}[:{d.draft_vocab_samples}]"
    return d.draft_vocab_from


def _count_vocab(spec: TrainSpec, manifest: Manifest | None, store) -> DraftVocabulary:
    """Count the vocabulary of ``_vocab_source(spec)``: a dataset rendered with the target's tokenizer
    (no model loaded), or a manifest's stored supervised tokens (``manifest``/``store`` when given)."""
    d, source = spec.drafter, _vocab_source(spec)
    if d.draft_vocab_from is not None and is_dataset_spec(d.draft_vocab_from):
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(resolve_target_dir(spec.target))
        apply_chat_format(tokenizer, spec.chat_template, None, spec.target)
        return dataset_vocabulary(d.draft_vocab_from, tokenizer, d.draft_vocab_size,
                                  max_length=spec.max_length or RENDER_MAX_LENGTH, limit=d.draft_vocab_samples,
                                  endpoint_url=spec.endpoint_url, source=source)
    if manifest is None or source != spec.manifest:
        manifest = read_manifest(source, endpoint_url=spec.endpoint_url)
        store = open_store(manifest.store_uri, endpoint_url=spec.endpoint_url)
    return draft_vocabulary(manifest, store, d.draft_vocab_size, source=source)


def prepare_draft_vocab(spec: TrainSpec, manifest: Manifest | None = None, store=None) -> DraftVocabulary | None:
    """The draft vocabulary of ``drafter.draft_vocab_size`` from ``drafter.draft_vocab_from`` or the
    training manifest (``manifest``/``store``: that manifest, already open), counted once and kept in
    ``<run_dir>/draft_vocab.json`` (None without a size or a source, or when ``init_from`` supplies it)."""
    size, source = spec.drafter.draft_vocab_size, _vocab_source(spec)
    if size is None or source is None or _keeps_export_vocab(spec.drafter):
        return None
    run_dir = Path(spec.run_dir)
    path = run_dir / "draft_vocab.json"
    if path.exists():
        vocab = DraftVocabulary.load(path)
        if len(vocab.token_ids) == size and vocab.source == source:
            return vocab
    vocab = _count_vocab(spec, manifest, store)
    run_dir.mkdir(parents=True, exist_ok=True)
    vocab.save(path)
    return vocab


def count_draft_vocab(spec: TrainSpec) -> DraftVocabulary | None:
    """``prepare_draft_vocab`` in the driver (so ranks do not each count it); online runs too, with
    ``drafter.draft_vocab_from``."""
    return prepare_draft_vocab(spec)


def expected_contract(algorithm: str, target: Target, features: CaptureContract) -> CaptureContract:
    """The contract a drafter of ``algorithm`` on ``target`` trains on, at the features' layers and dtype."""
    return build_contract(
        algorithm, target_fingerprint=target.target_fingerprint, template_fingerprint=target.template_fingerprint,
        num_target_layers=target.num_layers, hidden_size=target.hidden_size, layer_ids=features.layer_ids,
        dtype=features.dtype,
    )


def fresh_drafter(model_cfg, strategy, target: Target, *, seed: int) -> nn.Module:
    """A new drafter of ``model_cfg`` built by ``strategy`` on ``target``'s shared modules; its
    initial weights are a function of ``seed`` (identical on every rank)."""
    torch.manual_seed(seed)
    return strategy.build_model(model_cfg, embed_tokens=target.model.model.embed_tokens,
                                lm_head=target.model.lm_head, final_norm=target.model.model.norm)


def rank_device(spec: TrainSpec, *, rank: int = 0, world_size: int = 1, gpus: int | None = None) -> torch.device:
    """The device ``spec.device`` means for rank ``rank`` of ``world_size`` in this process (``gpus``:
    what Ray granted it, None: what torch sees): DDP ranks on one machine take one GPU each."""
    device = resolve_device(spec.device, field=spec.device_field, gpus=gpus)
    if device.type == "cuda" and device.index is None and world_size > 1:
        seen = visible_gpus()
        if world_size > seen:
            raise ValueError(f"{world_size} DDP ranks on CUDA need a GPU each, and this machine has {seen}: lower "
                             f"the world size to {seen} or set {spec.device_field}=cpu")
        device = torch.device("cuda", rank)
    return device


def heads_dtype(spec: TrainSpec, device: torch.device) -> str:
    """The dtype a rank reads the target's heads in: the target's under bf16 autocast, else float32
    (an fp32 drafter's activations meet them unconverted)."""
    bf16 = resolve_precision(spec.precision, device, field=spec.precision_field)
    return dtype_name(resolve_dtype(spec.target_dtype, device)) if bf16 else "float32"


def build_rank(spec: TrainSpec, contract: CaptureContract, *, rank: int = 0, world_size: int = 1,
               provenance: dict | None = None, draft_vocab: DraftVocabulary | None = None,
               device: torch.device | None = None) -> RankParts:
    """Target heads, drafter and TrainerCore of one rank, for features captured under ``contract``,
    on ``device`` (None: ``rank_device(spec, rank=, world_size=)``). With ``drafter.init_layers=target``
    the drafter's layers start from the target's top layers, and the provenance records which tensors.

    With ``drafter.draft_vocab_size`` the vocabulary comes from ``drafter.init_from`` or from
    ``draft_vocab`` (``prepare_draft_vocab``)."""
    device = rank_device(spec, rank=rank, world_size=world_size) if device is None else torch.device(device)
    optim = replace(spec.optim, bf16=resolve_precision(spec.precision, device, field=spec.precision_field))
    strategy = get_strategy(spec.algorithm)(spec.objective, seed=spec.seed)
    target = load_target(spec.target, dtype=heads_dtype(spec, device), device=device, weights="heads",
                         chat_template=spec.chat_template)
    expected = expected_contract(spec.algorithm, target, contract)
    model_cfg = spec.drafter.drafter_config(target, expected.layer_ids)
    model = fresh_drafter(model_cfg, strategy, target, seed=spec.seed)
    init_layers = {}
    if spec.drafter.init_layers == "target":  # reads the target's top layers by tensor name
        init_layers = {"init_layers": init_target_layers(model, model_cfg, target)}
    if spec.drafter.init_from:  # a peer drafter directory (speculators, SGLang, z-lab) is imported first
        from specray.drafters.peer_import import as_export

        source = as_export(spec.drafter.init_from, target, capture_dtype=contract.dtype)
        _init_from_export(model, model_cfg, str(source), target, contract)
    if model_cfg.draft_vocab_size is not None and not _keeps_export_vocab(spec.drafter):
        if draft_vocab is None:
            raise ValueError("drafter.draft_vocab_size is counted from drafter.draft_vocab_from or a training manifest "
                             "(data.manifest), or taken from drafter.init_from; online training has no manifest: set "
                             "drafter.draft_vocab_from=<a manifest, sharegpt, jsonl:PATH or records:URI>, "
                             "drafter.init_from=<an export with a draft vocabulary> or drafter.draft_vocab_size=null")
        model.set_draft_vocab(torch.tensor(draft_vocab.token_ids))
    core = TrainerCore(model.to(device), strategy, model_cfg, optim, rank=rank, world_size=world_size)
    vocab = {} if draft_vocab is None else {"draft_vocab": {
        "size": len(draft_vocab.token_ids), "coverage": draft_vocab.coverage, "source": draft_vocab.source}}
    extra = {
        "algorithm": spec.algorithm,
        "drafter_config": model_cfg.to_dict(),
        "contract": json.loads(contract.to_json()),
        "provenance": {"run": spec.name, "run_dir": spec.run_dir, "target": spec.target, "world_size": world_size,
                       "config": spec.config, "device": str(device), "bf16": optim.bf16, **(provenance or {}), **vocab,
                       **init_layers,
                       **({"chat_template": spec.chat_template} if spec.chat_template is not None else {})},
    }
    return RankParts(core, expected, extra, target, device)


def whole_target_hook(spec: TrainSpec, factory: Callable[[Target], CheckpointHook] | None,
                      device: torch.device) -> CheckpointHook | None:
    """Rank 0's checkpoint hook ``factory(target)`` on the whole target, which is loaded on ``device``
    (in ``spec.target_dtype``) at the first checkpoint: a run that never checkpoints reads only the heads."""
    if factory is None:
        return None
    made: list[CheckpointHook] = []

    def hook(run: TrainRun) -> dict:
        if not made:
            made.append(factory(load_target(spec.target, dtype=spec.target_dtype, device=device,
                                            chat_template=spec.chat_template)))
        return made[0](run)

    return hook


def feature_loader(spec: TrainSpec, manifest: Manifest, store, expected: CaptureContract, *, rank: int = 0,
                   world_size: int = 1, device: torch.device | None = None) -> FeatureLoader:
    """This rank's slice of a manifest, checked against the contract the drafter trains on (batches
    in pinned memory for a CUDA ``device``: the core copies them without blocking)."""
    return FeatureLoader(manifest, store, micro_batch_size=spec.micro_batch_size, seed=spec.seed, rank=rank,
                         world_size=world_size, accumulation_steps=spec.optim.accumulation_steps, expected=expected,
                         max_length=spec.max_length, pin_memory=device is not None and device.type == "cuda")


def rank_tracker(spec: TrainSpec, rank: int) -> Tracker | None:
    """Rank 0's experiment tracker of ``spec.tracking`` (None on other ranks or when none is configured)."""
    if rank != 0:
        return None
    return open_tracker(spec.tracking, run_name=spec.name, config=spec.config, run_dir=spec.run_dir)


def build_trainer(spec: TrainSpec, *, rank: int = 0, world_size: int = 1,
                  live_eval: Callable[[Target], CheckpointHook] | None = None) -> Trainer:
    """``specray train``'s rank: a ``Trainer`` on the spec's manifest; refuses features of another
    algorithm before anything is built. ``live_eval(target)`` builds rank 0's checkpoint hook (the
    driver's live evaluation) on the whole target (``whole_target_hook``)."""
    if spec.manifest is None:
        raise ValueError("data.manifest is required to train from a manifest; online training reads a "
                         "SampleBroker instead (actors/trainer.py run_trainer_gang)")
    manifest = read_manifest(spec.manifest, endpoint_url=spec.endpoint_url)
    check_manifest_fits(spec, manifest.contract)
    spec = replace(spec, chat_template=manifest.chat_template)  # render as the features were
    store = open_store(manifest.store_uri, endpoint_url=spec.endpoint_url)
    parts = build_rank(spec, manifest.contract, rank=rank, world_size=world_size,
                       provenance={"manifest": spec.manifest, "samples": len(manifest.refs)},
                       draft_vocab=prepare_draft_vocab(spec, manifest, store))
    loader = feature_loader(spec, manifest, store, parts.expected, rank=rank, world_size=world_size,
                            device=parts.device)
    run = TrainRun(parts.core, log_every=spec.log_every, extra=parts.extra)
    hook = whole_target_hook(spec, live_eval, parts.device) if rank == 0 else None
    run.tracker = rank_tracker(spec, rank)
    return Trainer(run, loader, run_dir=spec.run_dir, total_steps=spec.optim.total_steps,
                   checkpoint_every=spec.checkpoint_every, keep_last=spec.keep_last, on_checkpoint=hook)
