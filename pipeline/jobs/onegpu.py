"""Self-distillation on one accelerator, in one process: regenerate → features in memory → train.

    python -m specray.pipeline.jobs.onegpu run --prompts P.jsonl[.gz] --out DIR --device cuda \\
        --variants '[{"name": "l1"}, {"name": "l2", "num_layers": 2}]'
    python -m specray.pipeline.jobs.onegpu export DIR/l1.safetensors --out runs/onegpu-l1/exports/final

The Ray pipeline (capture servers → object store → trainer gang, ``specray capture`` /
``specray train``) is the path that scales out. This is the path for a single machine whose
accelerator holds every feature at once (an H200 holds ~15k ShareGPT answers × 6 target layers
in bf16): no object store, no Ray, and the answers, the features and the drafters are made in
one sitting. It is built from the pipeline's own parts, so what it trains is what the pipeline
would train on the same data:

- **answers**: the target's greedy answer to the first user turn of each prompt, up to
  ``max_new_tokens`` (what ``specray regenerate`` writes, same JSONL format). They come from
  transformers ``generate`` on left-padded batches rather than from our engine (whose runner is
  a CPU runner); with fp32 weights and TF32 matmuls a near-tie can resolve differently from the
  CPU engine, which changes which answer is in the data, not how it is used;
- **samples**: ``ChatRenderer`` (same template, truncation and loss mask as ``specray capture``);
- **features**: ``decoder_layer_outputs`` (the hooks ``CaptureServer`` uses), rounded to bf16,
  the contracts' storage dtype, and kept on the device (contracts that also need the target's
  final hidden state are refused);
- **training**: the training core of ``specray train`` (``trainer/assembly.py`` builds each
  drafter and its strategy from the registries, ``trainer/loop.py::TrainRun`` steps it: same
  objective, draws, optimizer, schedule and metrics records). Several drafter variants train
  side by side on the same batches in the same run, so their held-out accuracies compare like
  for like. ``train_seconds`` is a budget: the step time is measured during warmup and
  ``total_steps`` set to fit it, so the cosine schedule completes;
- **draft vocabulary**: ``top_tokens`` over the supervised tokens of the training split.

``run`` writes to ``--out``: ``answers.jsonl`` (+ ``.gz``), one ``<variant>.safetensors`` per
variant (bf16 weights plus the draft vocabulary, with the drafter config and a digest of the
target's weights in the header) and ``summary.json`` (held-out per-position accuracy, each
variant's live acceptance on the serving engine — ``live``, measured on a CPU copy of the target
through the export path, ``--live-prompts`` MT-Bench prompts — and timings).
The weights travel as bf16 (half the bytes of an export) and ``export`` turns a variant file into
a normal export (``trainer/export.py``, the export path of ``specray export``), on any machine with the same target: it refuses a file
whose target digest differs from the local target's, since its drafter read another model's
hidden states.
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import json
import random
import shutil
import tempfile
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from pydantic import ValidationError
from safetensors.torch import save_file

from specray.capture.contract import CaptureContract, build_contract
from specray.capture.data import ChatRenderer, Conversation, RenderedSample, load_conversations
from specray.capture.server import decoder_layer_outputs, pack_batches, pad_batch
from specray.capture.target import DEFAULT_TARGET, Target, load_target
from specray.drafters import DEFAULT_ALGORITHM, get_drafter
from specray.drafters.common import DrafterSectionBase
from specray.trainer.assembly import fresh_drafter
from specray.trainer.core import OptimSettings, TrainerCore
from specray.trainer.evaluate import evaluate_batches
from specray.trainer.export import drafter_from_state, export_drafter
from specray.trainer.loader import TrainBatch
from specray.trainer.loop import TrainRun
from specray.trainer.strategies import get_strategy
from specray.trainer.vocab import top_tokens


@dataclass(frozen=True)
class Variant:
    """One drafter trained in the run: a name, the ``drafter`` section of ``specray train``
    (``algorithm``, default dflash, and that algorithm's fields; sizes left unset are the
    target's; ``draft_vocab_size`` defaults to 8,192 here), its ``objective`` (the algorithm's
    strategy's fields, defaults otherwise), the target layers it reads (None: the contract's
    default) and its lr."""

    name: str
    drafter: DrafterSectionBase
    objective: Any
    layer_ids: tuple[int, ...] | None = None
    lr: float = 1e-3

    @classmethod
    def parse(cls, data: dict) -> "Variant":
        data = dict(data)
        name, lr, layer_ids = data.pop("name", None), data.pop("lr", 1e-3), data.pop("layer_ids", None)
        objective = data.pop("objective", {})
        if name is None or not str(name).replace("-", "").replace("_", "").isalnum():
            raise ValueError(f"variant name {name!r}: give one of letters, digits, '-' and '_' (it names a file)")
        if data.get("init_from"):
            raise ValueError(f"variant {name!r}: only fresh drafters train here (no init_from)")
        data.setdefault("draft_vocab_size", 8192)
        try:
            strategy = get_strategy(data.setdefault("algorithm", DEFAULT_ALGORITHM))
        except ValueError as e:
            raise ValueError(f"variant {name!r}: {e}") from None
        section = get_drafter(data["algorithm"]).section
        try:
            drafter = section.model_validate(data)
            settings = strategy.objective.model_validate(objective)
        except ValidationError as e:
            problems = "; ".join(f"{'.'.join(map(str, err['loc']))}: {err['msg']}" for err in e.errors())
            raise ValueError(f"variant {name!r}: {problems} (a variant takes name, layer_ids, lr, objective "
                             f"({sorted(strategy.objective.model_fields)}) and the drafter section's fields: "
                             f"{sorted(section.model_fields)})") from None
        return cls(str(name), drafter, settings, None if layer_ids is None else tuple(layer_ids), float(lr))


@dataclass
class Features:
    """Every sample's features, packed: ``hidden[offsets[i] : offsets[i] + lengths[i]]`` is sample i."""

    layer_ids: tuple[int, ...]  # column blocks of ``hidden``, in this order
    hidden: torch.Tensor  # [N_tokens, len(layer_ids) * D] bf16, on the device
    input_ids: torch.Tensor  # [N_tokens] int64, on the device
    loss_mask: torch.Tensor  # [N_tokens] bool, on the device
    offsets: list[int] = field(default_factory=list)
    lengths: list[int] = field(default_factory=list)

    def batch(self, indices: list[int]) -> TrainBatch:
        """A right-padded ``TrainBatch`` of the given samples, with every layer's columns."""
        B, T = len(indices), max(self.lengths[i] for i in indices)
        device = self.hidden.device
        input_ids = torch.zeros((B, T), dtype=torch.long, device=device)
        loss_mask = torch.zeros((B, T), dtype=torch.bool, device=device)
        attention = torch.zeros((B, T), dtype=torch.bool, device=device)
        hidden = torch.zeros((B, T, self.hidden.shape[1]), dtype=torch.float32, device=device)
        for row, i in enumerate(indices):
            start, n = self.offsets[i], self.lengths[i]
            input_ids[row, :n] = self.input_ids[start:start + n]
            loss_mask[row, :n] = self.loss_mask[start:start + n]
            attention[row, :n] = True
            hidden[row, :n] = self.hidden[start:start + n]
        return TrainBatch(input_ids, loss_mask, attention, hidden, None, [str(i) for i in indices],
                          sum(self.lengths[i] for i in indices))

    def select(self, batch: TrainBatch, layer_ids: tuple[int, ...]) -> TrainBatch:
        """``batch`` (from ``self.batch``) with only the columns of ``layer_ids``, in that order."""
        if tuple(layer_ids) == self.layer_ids:
            return batch
        D = self.hidden.shape[1] // len(self.layer_ids)
        cols = torch.cat([torch.arange(D) + self.layer_ids.index(i) * D for i in layer_ids])
        return replace(batch, hidden_states=batch.hidden_states.index_select(-1, cols.to(self.hidden.device)))


def target_digest(target: Target) -> str:
    """sha256 over the target's parameters as fp32 bytes, by name: equal iff the same function
    (unlike the directory fingerprint, it does not depend on how the weights were serialised)."""
    digest = hashlib.sha256()
    for name, tensor in sorted(target.model.state_dict().items()):
        digest.update(name.encode())
        digest.update(tensor.detach().float().cpu().contiguous().numpy().tobytes())
    return "sha256:" + digest.hexdigest()


def read_prompts(path: str | Path) -> list[tuple[str, str]]:
    """``(id, prompt)`` from JSONL lines ``{"id", "prompt"}`` (gzip if the name ends in .gz)."""
    opener = gzip.open if str(path).endswith(".gz") else open
    with opener(path, "rt") as f:
        rows = [json.loads(line) for line in f if line.strip()]
    return [(str(r["id"]), str(r["prompt"])) for r in rows]


@torch.inference_mode()
def generate_answers(target: Target, prompts: list[tuple[str, str]], *, batch_size: int, max_new_tokens: int,
                     seconds: float, out: Path, seed: int = 0, log=print) -> list[Conversation]:
    """Greedy answers in left-padded batches of similar length, batches in a seeded random order,
    until ``seconds`` have passed; each finished batch is appended to ``out`` (JSONL)."""
    tok, model = target.tokenizer, target.model
    device = model.device
    encoded = [(pid, text, tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                                   tokenize=True, return_dict=True)["input_ids"])
               for pid, text in prompts]
    encoded.sort(key=lambda e: len(e[2]))
    batches = [encoded[i:i + batch_size] for i in range(0, len(encoded), batch_size)]
    random.Random(seed).shuffle(batches)
    eos, pad = tok.eos_token_id, target.pad_token_id
    start, conversations, tokens = time.perf_counter(), [], 0
    with open(out, "a") as f:
        for number, batch in enumerate(batches):
            if time.perf_counter() - start > seconds:
                log(f"generate: time budget reached after {number}/{len(batches)} batches")
                break
            width = max(len(e[2]) for e in batch)
            ids = torch.full((len(batch), width), pad, dtype=torch.long)
            mask = torch.zeros((len(batch), width), dtype=torch.long)
            for row, (_, _, prompt_ids) in enumerate(batch):
                ids[row, width - len(prompt_ids):] = torch.tensor(prompt_ids)
                mask[row, width - len(prompt_ids):] = 1
            generated = model.generate(input_ids=ids.to(device), attention_mask=mask.to(device), do_sample=False,
                                       max_new_tokens=max_new_tokens, eos_token_id=eos, pad_token_id=pad,
                                       temperature=None, top_p=None, top_k=None)[:, width:].cpu()
            for (pid, text, _), row in zip(batch, generated.tolist()):
                answer = row[: row.index(eos)] if eos in row else row
                tokens += len(answer)
                reply = tok.decode(answer, skip_special_tokens=False)  # as the engine (and regenerate) decode
                cut = eos not in row  # stopped at max_new_tokens: the end of turn is not the target's
                conversations.append(Conversation(pid, (("user", text), ("assistant", reply)), cut=cut))
                f.write(json.dumps({"id": pid, "messages": [{"role": "user", "content": text},
                                                            {"role": "assistant", "content": reply}],
                                    "finish_reason": "length" if cut else "stop"}) + "\n")
            f.flush()
            log(f"generate: batch {number + 1}/{len(batches)}: {len(conversations)} answers, {tokens} tokens, "
                f"{time.perf_counter() - start:.0f} s")
    return conversations


@torch.inference_mode()
def extract_features(target: Target, samples: list[RenderedSample], layer_ids: tuple[int, ...], *,
                     max_batch_tokens: int = 65536) -> Features:
    """Decoder-layer outputs of every sample, bf16, packed on the target's device (batched and
    right-padded as ``CaptureServer`` batches, so each token's features equal its solo run)."""
    device = target.model.device
    lengths = [s.num_tokens for s in samples]
    offsets = [0] * len(samples)
    total = 0
    for i in range(len(samples)):
        offsets[i], total = total, total + lengths[i]
    width = len(layer_ids) * target.hidden_size
    feats = Features(layer_ids, torch.empty((total, width), dtype=torch.bfloat16, device=device),
                     torch.empty(total, dtype=torch.long, device=device),
                     torch.empty(total, dtype=torch.bool, device=device), offsets, lengths)
    index = {id(s): i for i, s in enumerate(samples)}
    for batch in pack_batches(samples, max_batch_tokens=max_batch_tokens, max_batch_size=max(1, len(samples))):
        ids, mask = pad_batch(batch, target.pad_token_id)
        out = decoder_layer_outputs(target.model, ids.to(device), mask.to(device), layer_ids)
        hidden = torch.cat([out[i] for i in layer_ids], dim=-1).to(torch.bfloat16)
        for row, sample in enumerate(batch):
            s, n = offsets[index[id(sample)]], sample.num_tokens
            feats.hidden[s:s + n] = hidden[row, :n]
            feats.input_ids[s:s + n] = sample.input_ids.to(device)
            feats.loss_mask[s:s + n] = sample.loss_mask.to(device)
    return feats


def variant_contract(algorithm: str, target: Target, layer_ids: tuple[int, ...] | None) -> CaptureContract:
    """The contract a variant trains on (validates its layer ids); refused when it needs more
    than the decoder-layer outputs this path keeps."""
    contract = build_contract(algorithm, target_fingerprint=target.target_fingerprint,
                              template_fingerprint=target.template_fingerprint, num_target_layers=target.num_layers,
                              hidden_size=target.hidden_size, layer_ids=layer_ids)
    if contract.last_hidden:
        raise ValueError(f"algorithm {algorithm!r} trains on the target's final hidden states too "
                         "(last_hidden_states), which onegpu does not keep; train it with specray capture + train")
    return contract


def variant_config(variant: Variant, target: Target):
    """The drafter config ``specray train`` builds for this drafter section."""
    contract = variant_contract(variant.drafter.algorithm, target, variant.layer_ids)
    return variant.drafter.drafter_config(target, contract.layer_ids)


def run(args: argparse.Namespace, log=print) -> dict:
    t0 = time.perf_counter()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    variants = [Variant.parse(v) for v in json.loads(args.variants)]
    if len({v.name for v in variants}) != len(variants):
        raise ValueError("variant names must be distinct")
    if args.device.startswith("cuda"):
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    target = load_target(args.target, device=args.device)
    renderer = ChatRenderer(target.tokenizer, max_length=args.max_length)
    # Fail before generating, not after: generation stops at the tokenizer's eos, and the samples
    # need the template to close assistant turns with it (a GGUF read by another transformers
    # version than the pinned one has given eos = <|im_start|> for SmolLM2).
    renderer.supervised_spans(Conversation("check", (("user", "hi"), ("assistant", "hello"))))
    digest = target_digest(target)
    t_load = time.perf_counter()
    log(f"target {args.target} on {args.device}: {digest[:23]}… ({t_load - t0:.0f} s)")

    if args.answers:  # answers of an earlier run (or of `specray regenerate`): no generation
        conversations = list(load_conversations(f"jsonl:{args.answers}"))
        if not (out / "answers.jsonl").exists():
            shutil.copyfile(args.answers, out / "answers.jsonl")
    else:
        prompts = read_prompts(args.prompts)[: args.max_prompts]
        conversations = generate_answers(target, prompts, batch_size=args.gen_batch_size,
                                         max_new_tokens=args.max_new_tokens, seconds=args.gen_seconds,
                                         out=out / "answers.jsonl", seed=args.seed, log=log)
    t_gen = time.perf_counter()

    samples = [s for s in (renderer.render(c) for c in conversations) if s is not None]
    # held out by id, not by position: the same answer is held out whatever the generation order
    is_held = [int(hashlib.sha256(s.sample_id.encode()).hexdigest(), 16) % 100 < args.heldout_percent for s in samples]
    held = [s for s, h in zip(samples, is_held) if h]
    train = [s for s, h in zip(samples, is_held) if not h]
    configs = {v.name: variant_config(v, target) for v in variants}
    layer_ids = tuple(sorted({i for c in configs.values() for i in c.target_layer_ids}))
    feats = extract_features(target, train + held, layer_ids)
    train_idx, held_idx = list(range(len(train))), list(range(len(train), len(train) + len(held)))
    supervised = torch.cat([s.input_ids[s.loss_mask] for s in train])
    counts = torch.bincount(supervised, minlength=target.vocab_size)
    t_feat = time.perf_counter()
    log(f"features: {len(train)} train + {len(held)} held-out samples, {sum(feats.lengths)} tokens, "
        f"{int(counts.sum())} supervised, layers {layer_ids} ({t_feat - t_gen:.0f} s)")

    runs, coverage = build_runs(variants, configs, target, counts, args)
    history, step, t_train = train_variants(runs, variants, configs, feats, train_idx, args, t0=t0, log=log)
    t_end = time.perf_counter()

    results = {}
    for v in variants:
        run, cfg = runs[v.name], configs[v.name]
        batches = (feats.select(feats.batch(held_idx[start:start + args.batch_size]), cfg.target_layer_ids)
                   for start in range(0, len(held_idx), args.batch_size))
        summary = evaluate_batches(run.core.model, cfg, run.core.strategy, batches)
        results[v.name] = {"config": cfg.to_dict(), "heldout": summary, "coverage": coverage.get(v.name)}
        save_variant(out / f"{v.name}.safetensors", run, v, cfg, digest=digest, target_name=args.target,
                     steps=step, train_samples=len(train))
        acc = summary.get("acc_by_pos", [])
        log(f"{v.name}: held-out acc by position {[round(a, 3) for a in acc]}, tau_tf {summary.get('tau_tf', 0):.3f}")

    if args.live_prompts:
        live = live_acceptance(out, variants, args)
        for name, result in live.items():
            results[name]["live"] = result
            log(f"{name}: live tau {result['tau_live']:.3f}, acceptance by position "
                f"{[round(a, 3) for a in result['live_accept_by_pos']]} ({result['live_seconds']:.0f} s)")
    t_live = time.perf_counter()

    report = {
        "target": args.target, "target_digest": digest, "device": args.device,
        "answers": len(conversations), "train_samples": len(train), "heldout_samples": len(held),
        "tokens": sum(feats.lengths), "supervised_tokens": int(counts.sum()), "steps": step,
        "batch_size": args.batch_size, "variants": results, "history": history,
        "seconds": {"load": t_load - t0, "generate": t_gen - t_load, "features": t_feat - t_gen,
                    "train": t_end - t_train, "live": t_live - t_end, "total": time.perf_counter() - t0},
    }
    (out / "summary.json").write_text(json.dumps(report, indent=2) + "\n")
    with open(out / "answers.jsonl", "rb") as src, gzip.open(out / "answers.jsonl.gz", "wb") as dst:
        dst.write(src.read())
    return report


def build_runs(variants: list[Variant], configs: dict, target: Target, counts: torch.Tensor,
               args: argparse.Namespace) -> tuple[dict[str, TrainRun], dict[str, float]]:
    """Each variant's ``TrainRun`` with its drafter (seeded as ``specray train`` seeds it) and
    draft vocabulary (the most frequent supervised training tokens), and that vocabulary's coverage."""
    runs, coverage = {}, {}
    for v in variants:
        cfg = configs[v.name]
        strategy = get_strategy(v.drafter.algorithm)(v.objective, seed=args.seed)
        model = fresh_drafter(cfg, strategy, target, seed=args.seed).to(args.device)
        if cfg.draft_vocab_size is not None:
            vocab = top_tokens(counts, cfg.draft_vocab_size)
            model.set_draft_vocab(vocab)
            coverage[v.name] = float(counts[vocab].sum() / counts.sum())
        settings = OptimSettings(lr=v.lr, warmup_steps=args.warmup_steps, total_steps=10**9, min_lr_ratio=0.1,
                                 grad_clip=1.0)
        runs[v.name] = TrainRun(TrainerCore(model, strategy, cfg, settings), log_every=args.log_every)
    return runs, coverage


def train_variants(runs: dict[str, TrainRun], variants: list[Variant], configs: dict, feats: Features,
                   train_idx: list[int], args: argparse.Namespace, *, t0: float, log=print) -> tuple[list, int, float]:
    """Train every variant on the same shuffled batches until the time budget's step count;
    returns (loss history per logged step, steps, start time)."""
    rng = random.Random(args.seed)
    order: list[int] = []
    step, history, total = 0, [], None
    t_train = time.perf_counter()
    while total is None or step < total:
        if not order:
            order = train_idx[:]
            rng.shuffle(order)
        indices, order = order[: args.batch_size], order[args.batch_size:]
        batch = feats.batch(indices)  # gathered once, each variant takes its layers' columns
        records = {v.name: runs[v.name].train_step([feats.select(batch, configs[v.name].target_layer_ids)])
                   for v in variants}
        step += 1
        if total is None and step == args.warmup_steps:
            # the schedule's cosine starts after warmup: fix total_steps to the budget now
            per_step = (time.perf_counter() - t_train) / step
            budget = args.train_seconds
            if args.deadline_seconds is not None:  # leave time to evaluate and save before the deadline
                budget = min(budget, args.deadline_seconds - (time.perf_counter() - t0) - args.reserve_seconds
                             + (time.perf_counter() - t_train))
            total = max(step + 1, int(budget / per_step))
            for run in runs.values():
                run.core.settings = replace(run.core.settings, total_steps=total)
            log(f"train: {per_step * 1000:.0f} ms/step for {len(variants)} variants -> {total} steps")
        if step == total:
            records = {name: record or runs[name].flush() for name, record in records.items()}
        if all(records.values()):
            losses = {name: record["loss"] for name, record in records.items()}
            history.append({"step": step, **losses})
            log(f"train: step {step}/{total}: " + ", ".join(f"{k} {x:.3f}" for k, x in losses.items()))
    return history, step, t_train


def save_variant(path: Path, run: TrainRun, variant: Variant, cfg, *, digest: str, target_name: str, steps: int,
                 train_samples: int) -> None:
    """The variant file: bf16 weights plus the draft vocabulary, with the config and target digest in its header."""
    state = {k: (t.to(torch.bfloat16) if t.is_floating_point() else t).detach().cpu().contiguous()
             for k, t in run.core.model.state_dict().items()}
    save_file(state, path, metadata={"algorithm": variant.drafter.algorithm, "config": json.dumps(cfg.to_dict()),
                                     "target_digest": digest, "target": target_name, "steps": str(steps),
                                     "train_samples": str(train_samples)})


def live_acceptance(out: Path, variants: list[Variant], args: argparse.Namespace) -> dict[str, dict]:
    """Each variant's live acceptance on the serving engine (``serving/live_eval.py``), as every
    training run reports it: its variant file exported for a CPU copy of the target (the serving
    runner is a CPU runner) and decoded greedily on ``--live-prompts`` MT-Bench prompts."""
    from specray.serving.live_eval import LiveEvalSettings, LiveEvaluator

    settings = LiveEvalSettings(num_prompts=args.live_prompts, max_tokens=args.live_max_tokens)
    evaluator = LiveEvaluator(load_target(args.target), settings)
    with tempfile.TemporaryDirectory(prefix="specray-onegpu-live-") as tmp:
        return {v.name: evaluator.measure_export(export(out / f"{v.name}.safetensors", Path(tmp) / v.name,
                                                        target_name=args.target)) for v in variants}


def export(variant_file: str | Path, out_dir: str | Path, *, target_name: str = DEFAULT_TARGET) -> Path:
    """Turn a ``run`` variant file into an export for the local target (refused for another target)."""
    with safe_open(str(variant_file), "pt") as f:
        meta = f.metadata()
        state = {k: f.get_tensor(k) for k in f.keys()}
    target = load_target(target_name)
    local = target_digest(target)
    if meta["target_digest"] != local:
        raise ValueError(f"{variant_file} was trained on a target with weight digest {meta['target_digest']}, "
                         f"but {target_name} here has {local}: its drafter read another model's hidden states")
    algorithm = meta.get("algorithm", DEFAULT_ALGORITHM)  # a variant file without one holds a DFlash drafter
    model = drafter_from_state(algorithm, json.loads(meta["config"]),
                               {k: (t.float() if t.is_floating_point() else t) for k, t in state.items()},
                               embed_tokens=target.model.model.embed_tokens, lm_head=target.model.lm_head)
    contract = variant_contract(algorithm, target, model.config.target_layer_ids)
    provenance = {"run": Path(variant_file).stem, "source": "specray.pipeline.jobs.onegpu", "target": target_name,
                  "steps": int(meta["steps"]), "train_samples": int(meta["train_samples"]),
                  "weights_precision": "bf16 (stored as fp32)"}
    return export_drafter(model, out_dir, contract=json.loads(contract.to_json()), provenance=provenance)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m specray.pipeline.jobs.onegpu", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    r = sub.add_parser("run", help="regenerate, capture in memory and train drafter variants on one device")
    r.add_argument("--prompts", help='JSONL (or .jsonl.gz) of {"id", "prompt"} lines to answer')
    r.add_argument("--answers", help="reuse answers (JSONL conversations, as regenerate writes) instead of --prompts")
    r.add_argument("--out", required=True)
    r.add_argument("--target", default=DEFAULT_TARGET)
    r.add_argument("--device", default="cuda")
    r.add_argument("--variants", default='[{"name": "l1"}]', help="JSON list of variants (see Variant)")
    r.add_argument("--max-prompts", type=int, default=None)
    r.add_argument("--gen-batch-size", type=int, default=512)
    r.add_argument("--max-new-tokens", type=int, default=256)
    r.add_argument("--gen-seconds", type=float, default=180.0)
    r.add_argument("--max-length", type=int, default=1024)
    r.add_argument("--heldout-percent", type=int, default=2)
    r.add_argument("--batch-size", type=int, default=32)
    r.add_argument("--warmup-steps", type=int, default=50)
    r.add_argument("--train-seconds", type=float, default=180.0)
    r.add_argument("--deadline-seconds", type=float, default=None,
                   help="whole-run budget: training is shortened to end reserve-seconds before it")
    r.add_argument("--reserve-seconds", type=float, default=60.0)
    r.add_argument("--log-every", type=int, default=100)
    r.add_argument("--seed", type=int, default=0)
    r.add_argument("--live-prompts", type=int, default=16,
                   help="MT-Bench prompts each variant decodes on the serving engine (CPU) for its live acceptance "
                        "(0 = none)")
    r.add_argument("--live-max-tokens", type=int, default=32, help="new tokens per live prompt")
    e = sub.add_parser("export", help="turn a run's variant file into an export for the local target")
    e.add_argument("variant_file")
    e.add_argument("--out", required=True)
    e.add_argument("--target", default=DEFAULT_TARGET)
    args = parser.parse_args(argv)
    if args.command == "run":
        if not (args.prompts or args.answers):
            parser.error("run needs --prompts (to answer) or --answers (answered already)")
        report = run(args, log=lambda msg: print(msg, flush=True))
        print(json.dumps({k: report[k] for k in ("answers", "train_samples", "steps", "seconds")}, indent=2))
    else:
        print(export(args.variant_file, args.out, target_name=args.target))


if __name__ == "__main__":
    main()
