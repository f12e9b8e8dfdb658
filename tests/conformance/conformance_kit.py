"""Helpers of the conformance suite (tests/conformance): the prompts, the registry check, drafters
built from the registry alone, their exports, transformers' greedy reference, and the seeded debug
training run of each algorithm (capture, then its quickstart manifest, with the overrides its golden
loss file records).

Drafters come in three kinds (``build_drafter``), which the serving tests run:

- ``random``: the algorithm's registered debug config with random weights (scaled so drafts
  differ from one another): drafts are mostly rejected;
- ``one_token``: the same with a one-token draft vocabulary, the token the target emits most
  often under greedy decoding of the test prompts: every draft is that token, accepted inside
  the target's runs of it and rejected elsewhere, so rounds accept every count from 0 to k;
- ``two_token``: the two most frequent tokens: drafts are often accepted and the draft
  distribution q still depends on the drafter's state (with one token q is always 1).
"""

import json
import os
import sys
from collections import Counter
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch

from specray.capture.contract import CONTRACT_SPECS, build_contract
from specray.drafters import DRAFTERS
from specray.drafters.format import save_drafter
from specray.kernels import rejection
from specray.pipeline.jobs.capture import run_capture
from specray.pipeline.config import CaptureJobConfig, TrainJobConfig, load_config
from specray.serving.workers import WORKERS
from specray.trainer.checkpoint import load_checkpoint
from specray.trainer.strategies import STRATEGIES

PROMPTS = ["Hi", "Tell me about dragons and castles.", "1 2 3 4 5 6", "A much longer prompt " * 6,
           "What is 2+2?", "Write a poem."]
MAX_NEW = 24  # greedy tokens per prompt on the debug target
VOCAB_OF_KIND = {"random": None, "one_token": 1, "two_token": 2}  # draft vocabulary size (None: the target's)
REGISTRIES = {"specray.drafters.DRAFTERS": DRAFTERS, "specray.trainer.strategies.STRATEGIES": STRATEGIES,
              "specray.serving.workers.WORKERS": WORKERS, "specray.capture.contract.CONTRACT_SPECS": CONTRACT_SPECS}


def registered() -> list[str]:
    """Every algorithm with a drafter, a train strategy or a serving worker."""
    return sorted(set(DRAFTERS) | set(STRATEGIES) | set(WORKERS))


def hf_greedy(target, ids: list[int], max_new: int) -> list[int]:
    """transformers' greedy ``generate``, up to (without) the first EOS: what the engine emits."""
    with torch.inference_mode():
        out = target.model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                                    max_new_tokens=max_new, do_sample=False, pad_token_id=target.pad_token_id)
    tokens = out[0, len(ids):].tolist()
    eos = target.tokenizer.eos_token_id
    return tokens[: tokens.index(eos)] if eos in tokens else tokens


def frequent_tokens(continuations, first: int | None = None) -> list[int]:
    """Tokens by frequency among the ``first`` tokens of each continuation (all by default)."""
    return [t for t, _ in Counter(t for tokens in continuations for t in tokens[:first]).most_common()]


def build_drafter(algorithm: str, target, kind: str, *, frequent: list[int], seed: int = 0):
    """A drafter of ``algorithm`` for ``target`` from its registered debug config (module docstring);
    ``frequent``: the target's greedy tokens by frequency."""
    spec = DRAFTERS[algorithm]
    config = spec.debug_config(target)
    vocab = frequent[: VOCAB_OF_KIND[kind]] if VOCAB_OF_KIND[kind] else None
    if vocab is not None:
        config = spec.config.from_dict({**config.to_dict(), "draft_vocab_size": len(vocab)})
    torch.manual_seed(seed)
    model = spec.model(config, embed_tokens=target.model.get_input_embeddings(),
                       lm_head=target.model.get_output_embeddings())
    with torch.no_grad():  # larger than the init's scale: the drafts depend on the context
        for p in model.parameters():
            if p.dim() == 2:
                p.mul_(4.0)
    if vocab is not None:
        model.set_draft_vocab(torch.tensor(vocab))
    return model.eval().requires_grad_(False)


@contextmanager
def one_thread():
    """One intra-op thread: forwards of a few rows of small models gain little from two, and on a
    busy machine two threads spin-wait for each other (several times the CPU time)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


@contextmanager
def recorded_verification():
    """Every ``kernels/rejection.py::rejection_sample`` call's target rows, drafts and draft q
    (clones; the function still runs): where every worker hands what it drafted to verification."""
    calls = []
    original = rejection.rejection_sample

    def record(target, draft_token_ids, cu_num_draft, greedy, draft_probs=None, *args, **kwargs):
        calls.append({"target": target.clone(), "drafts": draft_token_ids.clone(),
                      "q": None if draft_probs is None else draft_probs.clone()})
        return original(target, draft_token_ids, cu_num_draft, greedy, draft_probs, *args, **kwargs)

    modules = [m for name, m in list(sys.modules.items())
               if name.startswith("specray.") and getattr(m, "rejection_sample", None) is original]
    for module in modules:
        module.rejection_sample = record
    try:
        yield calls
    finally:
        for module in modules:
            module.rejection_sample = original


def contract_of(model, target) -> dict:
    """The capture contract of ``model``'s target layers on ``target`` (what an export records)."""
    contract = build_contract(model.algorithm, target_fingerprint=target.target_fingerprint,
                              template_fingerprint=target.template_fingerprint, num_target_layers=target.num_layers,
                              hidden_size=target.hidden_size, layer_ids=model.config.target_layer_ids, dtype="float32")
    return json.loads(contract.to_json())


def export(model, target, out) -> str:
    return str(save_drafter(out, model, contract=contract_of(model, target), provenance={"run": "conformance"}))


# -- training on the debug target ---------------------------------------------------------------

GOLDEN_DIR = Path(__file__).parent.parent / "trainer" / "golden"
GOLDEN_STEPS = 12  # a straight run; resume: GOLDEN_STEPS // 2, resume, the rest
UPDATE_GOLDEN = "SPECRAY_UPDATE_GOLDEN"


def golden_path(algorithm: str) -> Path:
    return GOLDEN_DIR / f"{algorithm}_debug_loss.json"


def read_golden(algorithm: str) -> dict:
    """The golden loss file of ``algorithm``: ``capture`` and ``train`` (overrides of the debug run,
    ``debug_run``) and ``losses`` (one per step). Without one, a new file is written when
    ``SPECRAY_UPDATE_GOLDEN`` is set (no overrides) and the suite fails otherwise."""
    path = golden_path(algorithm)
    if not path.exists():
        if os.environ.get(UPDATE_GOLDEN):
            return {"capture": [], "train": [], "losses": None}
        raise AssertionError(f"{path} is missing: every algorithm has a seeded golden loss; write it with "
                             f"{UPDATE_GOLDEN}=1 pytest tests/conformance -k golden (and check it in)")
    golden = json.loads(path.read_text())
    missing = [key for key in ("capture", "train", "losses") if key not in golden]
    assert not missing, f"{path} lacks {missing}: 'capture'/'train' (config overrides of the run) and 'losses'"
    return golden


@dataclass(frozen=True)
class DebugRun:
    """A capture of debug features and the configured training run on them (not yet trained)."""

    algorithm: str
    manifest: Path
    overrides: list[str]  # of manifests/train-<algorithm>-quickstart.yaml

    def config(self, run_dir: Path, *extra: str) -> TrainJobConfig:
        return load_config(TrainJobConfig, train_manifest(self.algorithm), [
            "target.name=debug", f"data.manifest={self.manifest}", f"output.run_dir={run_dir}",
            f"optim.total_steps={GOLDEN_STEPS}", "optim.warmup_steps=2", "trainer.log_every=1",
            f"trainer.checkpoint_every={GOLDEN_STEPS // 2}", "trainer.keep_last=null", "live_eval.enabled=false",
            *self.overrides, *extra,
        ])


def train_manifest(algorithm: str) -> Path:
    path = Path("manifests") / f"train-{algorithm}-quickstart.yaml"
    assert path.exists(), f"{path} is missing: every algorithm ships its quickstart training manifest"
    return path


def debug_run(algorithm: str, root: Path, golden: dict) -> DebugRun:
    """Capture ``manifests/capture-quickstart.yaml`` on the debug target under ``algorithm``'s contract
    (float32, with the golden file's ``capture`` overrides)."""
    cfg = load_config(CaptureJobConfig, "manifests/capture-quickstart.yaml", [
        f"name=cap-{algorithm}", "target.name=debug", f"capture.algorithm={algorithm}", "capture.dtype=float32",
        f"output.run_dir={root / 'capture'}", *golden["capture"],
    ])
    run_capture(cfg, progress=False)
    return DebugRun(algorithm, root / "capture" / "manifest.parquet", list(golden["train"]))


def records(run_dir: Path) -> list[dict]:
    """The run's metrics records (``trainer/loop.py``), one per step with ``trainer.log_every=1``."""
    return [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]


def losses(run_dir: Path) -> list[float]:
    return [r["loss"] for r in records(run_dir)]


def final_weights(run_dir: Path) -> dict[str, torch.Tensor]:
    return load_checkpoint(Path(run_dir) / "checkpoints").model
