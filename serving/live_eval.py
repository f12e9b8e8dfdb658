"""Live acceptance: a drafter's free-running acceptance, measured by the serving engine.

    evaluator = LiveEvaluator(load_target(), LiveEvalSettings(dataset="mtbench", num_prompts=16, max_tokens=32))
    evaluator.measure_export("runs/train-dflash/exports/step-00000120")
    # {"tau_live": 1.9, "live_accept_by_pos": [0.52, 0.24, …], "live_prompts": 16, "live_tokens": 512, …}

The numbers users care about (DESIGN.md §5): the drafter decodes held-out prompts greedily on
the real ``Engine`` with its algorithm's registered worker, and every round verifies the
worker's largest size (``speculation="static"``): the automatic chooser would take plain steps
when a round does not pay and measure nothing at those positions. ``tau_live`` is the mean of
``r + 1`` over the rounds (``GenerationOutput.emitted_per_round``, as ``specray bench serve``
computes its ``tau``), ``live_accept_by_pos[j]`` the fraction of rounds whose draft ``j + 1``
was accepted (the version's ``RoundStats``, as the engine's ``/metrics`` report it). Prompts are
decoded in chunks of ``batch_size``, as ``bench serve`` does at that batch size, so both report
the same tau on the same prompts.

Training runs measure each checkpoint through ``on_checkpoint`` (the trainer's checkpoint hook,
``trainer/loop.py``): the drafter module is written as a temporary export and loaded as a new
drafter version of one engine on the training target, kept for the whole run (the checks,
the worker and the KV cache are those serving uses). ``specray evaluate EXPORT --live`` runs
``measure_export``.
"""

from __future__ import annotations

import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from torch import nn

from specray.capture.data import load_conversations
from specray.capture.target import Target
from specray.drafters.format import save_drafter
from specray.serving.engine import Engine
from specray.serving.requests import encode_prompt
from specray.serving.sampling import SamplingParams

LIVE_DATASETS = ("mtbench", "humaneval")  # or jsonl:PATH
KV_SLACK = 64  # KV rows beyond the longest prompt + max_tokens: one verify block of any drafter


@dataclass(frozen=True)
class LiveEvalSettings:
    """What a live measurement decodes (plain values: the Ray trainer gang's workers get them)."""

    dataset: str = "mtbench"  # mtbench | humaneval | jsonl:PATH (each record's turns before its first answer)
    num_prompts: int = 16
    max_tokens: int = 32  # new tokens per prompt
    num_speculative_tokens: int | None = None  # drafts verified every round (None = the worker's largest)
    batch_size: int = 4  # prompts decoded at once

    def __post_init__(self) -> None:
        if not (self.dataset in LIVE_DATASETS or self.dataset.startswith("jsonl:")):
            raise ValueError(f"live_eval.dataset {self.dataset!r}: use one of {list(LIVE_DATASETS)} or jsonl:PATH")
        for name in ("num_prompts", "max_tokens", "batch_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"live_eval.{name} must be >= 1, got {getattr(self, name)}")
        if self.num_speculative_tokens is not None and self.num_speculative_tokens < 1:
            raise ValueError(f"live_eval.num_speculative_tokens must be >= 1 or null (the worker's largest round), "
                             f"got {self.num_speculative_tokens}")


def prompt_turns(messages: list[dict[str, str]]) -> list[dict[str, str]]:
    """A conversation's turns before its first answer: what a user sent (``[sys, user, assistant, user]
    -> [sys, user]``); a conversation without an answer is all prompt."""
    roles = [m["role"] for m in messages]
    return messages[: roles.index("assistant")] if "assistant" in roles else messages


def live_prompts(tokenizer, dataset: str, num_prompts: int) -> list[list[int]]:
    """Token ids of the first ``num_prompts`` held-out prompts of ``dataset``, through the target's chat template."""
    prompts = [encode_prompt(tokenizer, prompt_turns(c.as_chat()))
               for c in load_conversations(dataset, purpose="eval", limit=num_prompts)]
    if not prompts:
        raise ValueError(f"live_eval.dataset {dataset!r} has no prompts")
    return prompts


def measure(engine: Engine, prompts: list[list[int]], *, max_tokens: int, batch_size: int) -> dict:
    """Greedy decoding of ``prompts`` on the engine's active drafter version, ``batch_size`` at a
    time; ``tau_live`` and ``live_accept_by_pos`` of those rounds (the version's stats must be fresh)."""
    version = engine.versions.active
    if version.drafter is None:
        raise ValueError("live acceptance needs a drafter; the engine runs plain autoregressive decoding")
    params = SamplingParams(max_tokens=max_tokens)
    start = time.perf_counter()
    results = [r for i in range(0, len(prompts), batch_size) for r in engine.generate(prompts[i:i + batch_size], params)]
    rounds = [k for r in results for k in r.emitted_per_round]
    stats = version.stats.summary()
    return {"tau_live": sum(rounds) / len(rounds) if rounds else None,
            "live_accept_by_pos": stats["acceptance_by_position"], "live_prompts": len(results),
            "live_tokens": sum(len(r.token_ids) for r in results), "live_rounds": stats["rounds"],
            "live_seconds": round(time.perf_counter() - start, 3)}


class LiveEvaluator:
    """One engine on ``target`` (static speculation at ``settings.num_speculative_tokens``) and the
    encoded prompts, kept across measurements; each measurement loads the drafter as a new version."""

    def __init__(self, target: Target, settings: LiveEvalSettings):
        self.target, self.settings = target, settings  # the engine runs on the target's device (CPU or CUDA)
        self._engine: Engine | None = None
        self._prompts: list[list[int]] = []
        self._versions = 0

    def _ready(self) -> Engine:
        if self._engine is None:  # built at the first measurement: a run that never checkpoints pays nothing
            s = self.settings
            self._prompts = live_prompts(self.target.tokenizer, s.dataset, s.num_prompts)
            max_len = max(len(p) for p in self._prompts) + s.max_tokens + KV_SLACK
            self._engine = Engine(self.target, None, max_batch=s.batch_size, max_len=max_len, max_waiting=None,
                                  num_speculative_tokens=s.num_speculative_tokens, speculation="static")
        return self._engine

    def measure_export(self, export_dir: str | Path) -> dict:
        """Live acceptance of the export in ``export_dir`` (validated as serving validates it)."""
        engine = self._ready()
        self._versions += 1
        version = engine.versions.build(str(export_dir), self._versions)
        engine.versions.install(version)
        s = self.settings
        result = measure(engine, self._prompts, max_tokens=s.max_tokens, batch_size=s.batch_size)
        return {**result, "live_num_speculative_tokens": version.worker.max_verify_rows - 1,
                "live_dataset": s.dataset}

    def measure_drafter(self, model: nn.Module, *, contract: dict) -> dict:
        """Live acceptance of an in-memory drafter (its weights, written as a temporary export)."""
        with tempfile.TemporaryDirectory(prefix="specray-live-") as tmp:
            export = save_drafter(Path(tmp) / "drafter", model, contract=contract, provenance={"live_eval": True})
            return self.measure_export(export)

    def on_checkpoint(self, run) -> dict:
        """The trainer's checkpoint hook (``trainer/loop.py``): the live fields of ``run``'s drafter."""
        return self.measure_drafter(run.core.model, contract=run.extra["contract"])


def checkpoint_hook(settings: LiveEvalSettings | None):
    """For ``trainer/assembly.py::build_trainer`` and the gang: a function of the rank's target giving
    its checkpoint hook (None when live evaluation is off)."""
    if settings is None:
        return None
    return lambda target: LiveEvaluator(target, settings).on_checkpoint


def live_table(result: dict) -> str:
    accept = " ".join(f"{a:.3f}" for a in result["live_accept_by_pos"])
    return "\n".join([
        f"dataset     {result['live_dataset']} ({result['live_prompts']} prompts, {result['live_tokens']} tokens, "
        f"{result['live_rounds']} rounds of {result['live_num_speculative_tokens']} drafts, greedy)",
        f"tau_live    {result['tau_live']:.3f} (mean accepted drafts + 1 per round, serving engine)",
        f"accept/pos  {accept}",
        f"seconds     {result['live_seconds']:.1f}",
    ])
