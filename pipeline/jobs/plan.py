"""``specray plan``: each stage's memory and bytes for a pipeline manifest, before anything runs.

    specray plan manifests/quickstart.yaml
    specray plan manifests/quickstart-eagle3.yaml --device cuda --gpu-memory 80GiB target.name=DIR

Nothing is loaded but the target's ``config.json`` (and its tokenizer when the directory has one):
no weights, no dataset, no Ray. ``target.name`` may be a directory holding only a config
(``tests/pipeline/fixtures/llama-3.1-8b``: Llama-3.1-8B's shape). The stages:

- **target**: its parameters (a meta-device build of the config) in the target's dtype;
- **regenerate actor** (``regenerate.enabled``): the target and its KV cache for
  ``regenerate.batch_size`` conversations of the longest context plus one answer;
- **capture actor**: the weights it holds (split over ``capture.num_gpus_per_actor`` GPUs) and a
  forward of ``capture.max_batch_tokens`` padded tokens (``capture/server.py::forward_memory``);
- **features**: bytes per token (the contract's tensors in ``capture.dtype``), per sample and for
  the dataset, at most: every sample counted at ``data.max_length`` tokens, or ``--tokens-per-sample``;
- **online window**: what ``online.max_inflight_samples`` features take in the store;
- **trainer rank**: the heads, the drafter's parameters, gradients and AdamW state, a micro-batch
  of ``train.optim.micro_batch_size × data.max_length`` tokens and its activations
  (``trainer/memory.py``), and rank 0's live evaluation (the whole target and its KV cache).

``--device`` decides the dtypes ``auto`` resolves to (bf16 target and autocast on CUDA, fp32 on
the CPU); ``--gpu-memory`` marks each device stage as fitting or not.
"""

from __future__ import annotations

import json
import re
from dataclasses import asdict, dataclass
from pathlib import Path
from types import SimpleNamespace

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from specray.capture.contract import build_contract
from specray.capture.devices import dtype_name, resolve_dtype, resolve_precision, visible_gpus
from specray.capture.server import forward_memory
from specray.capture.target import Target, resolve_target_dir
from specray.pipeline.config import PipelineConfig
from specray.serving.regenerate import engine_max_len
from specray.serving.sampling import SamplingParams
from specray.trainer.memory import FP32, StepShape, rank_memory
from specray.trainer.strategies import get_strategy

UNITS = {"": 1, "b": 1, "kb": 1e3, "mb": 1e6, "gb": 1e9, "tb": 1e12, "kib": 2**10, "mib": 2**20, "gib": 2**30,
         "tib": 2**40}
SAMPLE_HEADER = 4096  # a blob's safetensors header and metadata, at most (the producer's estimate too)
KV_SLACK = 64  # live evaluation's KV rows beyond prompt + max_tokens (serving/live_eval.py)


def parse_bytes(text: str) -> float:
    """``80GiB``, ``80GB``, ``8e10`` -> bytes."""
    match = re.fullmatch(r"\s*([0-9.]+(?:e[0-9]+)?)\s*([a-zA-Z]*)\s*", text)
    if not match or match.group(2).lower() not in UNITS:
        raise ValueError(f"--gpu-memory {text!r}: give a size such as 80GiB, 141GB or 8e10")
    return float(match.group(1)) * UNITS[match.group(2).lower()]


def human(num_bytes: float) -> str:
    for unit, size in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if num_bytes >= size:
            return f"{num_bytes / size:.2f} {unit}"
    return f"{num_bytes:.0f} B"


@dataclass(frozen=True)
class Stage:
    name: str
    bytes: float  # the stage's memory (or size, for stored bytes)
    detail: str
    device: bool = False  # held in one device's memory (checked against --gpu-memory)
    fits: bool | None = None

    def line(self) -> str:
        fit = "" if self.fits is None else ("  fits" if self.fits else "  DOES NOT FIT")
        return f"{self.name:<16} {human(self.bytes):>11}  {self.detail}{fit}"


# a target directory with a config only: nothing is chosen from its tokenizer (a MASK id changes no shape)
NO_TOKENIZER = SimpleNamespace(mask_token_id=None, unk_token_id=None, pad_token_id=None, eos_token_id=None)


def describe(name: str) -> Target:
    """The target's config (and tokenizer when its directory has one): what the plan reads, no weights."""
    path = resolve_target_dir(name)
    config = AutoConfig.from_pretrained(path)
    has_tokenizer = any((path / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json"))
    tokenizer = AutoTokenizer.from_pretrained(path) if has_tokenizer else NO_TOKENIZER
    return Target(name, path, None, tokenizer, "unplanned", "unplanned", config=config, weights="none")


def target_parameters(config) -> tuple[int, int]:
    """(all parameters, the embedding's and LM head's: a tied head counted once) of a meta-device build."""
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    total = sum(p.numel() for p in model.parameters())
    heads = {id(p): p.numel() for m in (model.get_input_embeddings(), model.get_output_embeddings())
             for p in m.parameters()}
    return total, sum(heads.values())


def plan(cfg: PipelineConfig, *, device: str = "auto", gpu_memory: float | None = None,
         tokens_per_sample: int | None = None) -> list[Stage]:
    """The stages of ``cfg`` (module docstring) on ``device`` (``auto``: CUDA when torch sees a GPU)."""
    plan_device = torch.device("cuda" if device == "auto" and visible_gpus() else "cpu" if device == "auto" else device)
    target = describe(cfg.target.name)
    tcfg = target.config
    target_dtype = resolve_dtype(cfg.target.dtype, plan_device)
    tb = torch.finfo(target_dtype).bits // 8
    total, head_params = target_parameters(tcfg)
    weights = total * tb
    stages = [Stage("target", weights, f"{total / 1e9:.2f} B parameters in {dtype_name(target_dtype)} "
                                        f"({tcfg.num_hidden_layers} layers, hidden {tcfg.hidden_size}, vocab "
                                        f"{tcfg.vocab_size})")]
    if cfg.regenerate.enabled:
        r = cfg.regenerate
        rows = r.batch_size * engine_max_len(r.max_prompt_tokens, SamplingParams(max_tokens=r.max_tokens))
        kv = kv_cache_bytes(tcfg, rows, tb)
        stages.append(Stage("regenerate actor", weights + kv, f"weights {human(weights)} + KV cache {human(kv)} "
                            f"({r.batch_size} conversations of up to {r.max_prompt_tokens} + {r.max_tokens} tokens)",
                            device=True))
    contract = planned_contract(cfg, tcfg)
    gpus = cfg.capture.num_gpus_per_actor
    split = max(1, int(gpus)) if plan_device.type == "cuda" else 1
    activations = forward_memory(tcfg, contract, tb, max_batch_tokens=cfg.capture.max_batch_tokens,
                                 max_length=min(cfg.data.max_length, cfg.capture.max_batch_tokens))
    stages.append(Stage("capture actor", weights / split + activations, f"weights {human(weights / split)}"
                        + (f" (1/{split} of the target per GPU)" if split > 1 else "")
                        + f" + a forward of {cfg.capture.max_batch_tokens} padded tokens {human(activations)}",
                        device=True))
    per_token = contract.min_bytes_per_token
    tokens = tokens_per_sample or cfg.data.max_length
    per_sample = per_token * tokens + SAMPLE_HEADER
    bound = "" if tokens_per_sample else "at most "
    samples = cfg.data.max_samples
    stages.append(Stage("features", per_sample * samples if samples else per_sample,
                        f"{per_token} B/token ({contract.algorithm} layers {list(contract.layer_ids)}"
                        f"{' + last hidden' if contract.last_hidden else ''}, {contract.dtype}); {bound}"
                        f"{human(per_sample)}/sample of {tokens} tokens"
                        + (f"; the store for {samples} samples" if samples else "; per sample (data.max_samples: "
                           "all, count unknown before rendering)")))
    if cfg.mode != "offline":
        o = cfg.online
        window = o.max_inflight_samples * per_sample
        capped = min(window, o.max_inflight_bytes) if o.max_inflight_bytes else window
        stages.append(Stage("online window", capped, f"{o.max_inflight_samples} samples in flight ({bound}"
                            f"{human(window)}" + (f", capped at max_inflight_bytes {human(o.max_inflight_bytes)}"
                                                   if o.max_inflight_bytes else "") + ")"))
    stages += trainer_stages(cfg, target, contract, plan_device, head_params, weights)
    if gpu_memory is not None and plan_device.type == "cuda":
        stages = [Stage(s.name, s.bytes, s.detail, s.device, s.bytes <= gpu_memory) if s.device else s for s in stages]
    return stages


def planned_contract(cfg: PipelineConfig, tcfg):
    """The capture contract of ``cfg`` for a target of config ``tcfg`` (fingerprints unknown)."""
    return build_contract(cfg.capture.algorithm, target_fingerprint="unplanned", template_fingerprint="unplanned",
                          num_target_layers=tcfg.num_hidden_layers, hidden_size=tcfg.hidden_size,
                          layer_ids=cfg.capture.layer_ids, dtype=cfg.capture.dtype)


def planned_drafter(cfg: PipelineConfig, target: Target, contract):
    """The drafter's model config for ``target`` (a ``describe``d one: config and tokenizer only)."""
    drafter = cfg.train.drafter
    if target.tokenizer is NO_TOKENIZER and getattr(drafter, "mask_token_id", 0) is None:
        drafter = drafter.model_copy(update={"mask_token_id": 0})  # sized alike whatever token MASK is
    return drafter.drafter_config(target, contract.layer_ids)


def check_before_running(cfg: PipelineConfig) -> None:
    """Refuse, before the first stage runs, what the training stage would refuse only after regenerate and
    capture: a drafter that cannot be built for the target (its MASK token, sizes out of bounds) and
    ``drafter.init_layers=target`` with widths or depth the target's top layers do not have. Reads what
    ``plan`` reads: the target's config and tokenizer, no weights."""
    from specray.trainer.init_layers import check_init_layers

    target = describe(cfg.target.name)
    model_cfg = planned_drafter(cfg, target, planned_contract(cfg, target.config))
    if cfg.train.drafter.init_layers == "target":
        check_init_layers(model_cfg, target)


def trainer_stages(cfg: PipelineConfig, target: Target, contract, device: torch.device, head_params: int,
                   weights: float) -> list[Stage]:
    """The trainer rank and rank 0's live evaluation."""
    t = cfg.train
    bf16 = resolve_precision(t.precision, device)
    model_cfg = planned_drafter(cfg, target, contract)
    element = torch.finfo(resolve_dtype(cfg.target.dtype, device)).bits // 8 if bf16 else FP32
    heads_bytes = head_params * element + target.hidden_size * FP32
    width = sum(w for w, _ in contract.tensor_widths().values() if w)
    shape = StepShape(t.optim.micro_batch_size, cfg.data.max_length, act_bytes=2 if bf16 else FP32)
    memory = rank_memory(get_strategy(t.drafter.algorithm), model_cfg, t.objective, shape, heads_bytes=heads_bytes,
                         batch_width=width, head_element_bytes=element)
    act = memory.activations
    parts = ", ".join(f"{k} {human(v)}" for k, v in act.parts.items())
    stages = [Stage("trainer rank", memory.peak,
                    f"{t.drafter.algorithm} {memory.num_parameters / 1e6:.1f} M parameters, "
                    f"{'bf16 autocast' if bf16 else 'fp32'}, micro-batch {shape.batch} x {shape.seq_len} tokens: "
                    f"heads {human(memory.heads)}, parameters+AdamW {human(memory.parameters + memory.optimizer)}, "
                    f"gradients {human(memory.gradients)}, batch {human(memory.batch)}, activations peak "
                    f"{human(act.peak)} (kept: {parts})", device=True)]
    if t.live_eval.enabled:
        live = t.live_eval
        rows = live.batch_size * (cfg.data.max_length + live.max_tokens + KV_SLACK)
        kv = kv_cache_bytes(target.config, rows, torch.finfo(resolve_dtype(cfg.target.dtype, device)).bits // 8)
        stages.append(Stage("rank 0 live eval", memory.peak + weights + kv,
                            f"the trainer rank + the whole target {human(weights)} + KV cache {human(kv)} "
                            f"({live.batch_size} prompts of up to {cfg.data.max_length} + {live.max_tokens} tokens)",
                            device=True))
    return stages


def kv_cache_bytes(tcfg, rows: int, element_bytes: int) -> int:
    """The engine's K and V for ``rows`` token slots over every layer of the target."""
    hd = getattr(tcfg, "head_dim", None) or tcfg.hidden_size // tcfg.num_attention_heads
    return 2 * tcfg.num_hidden_layers * tcfg.num_key_value_heads * hd * rows * element_bytes


def plan_table(stages: list[Stage]) -> str:
    return "\n".join(s.line() for s in stages)


def write_json(stages: list[Stage], path: str) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps([asdict(s) for s in stages], indent=2) + "\n")
