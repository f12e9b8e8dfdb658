"""``specray regenerate`` and the pipeline's regenerate stage: the target answers the training prompts.

    specray regenerate --dataset sharegpt --num 512 --out data/sharegpt-smollm2.jsonl
    specray pipeline run manifests/recipe.yaml          # regenerate.enabled: the stage before capture

Prompts come from a training dataset (``select_prompts``): every user turn of a conversation, up
to ``max_turns``, and its system message. A conversation is dropped when any of its user turns
overlaps a prompt of an eval set in ``exclude`` (``capture/contamination.py``: a shared run of
13 words, or the whole of a shorter prompt), so a drafter is never trained on the target's
answers to the prompts it is benchmarked on; the count and the first overlaps are reported.
With ``mix`` ({chat, code, reasoning} shares) conversations are taken in dataset order while
their kind's share has room. The target answers every turn with its own earlier answers in
context (``serving/regenerate.py``), greedy by default, so the data is what greedy serving
produces. Each conversation is one line of the output JSONL, the format ``specray capture``
reads as ``data.dataset=jsonl:PATH``: ``{"id", "messages", "finish_reason", "answer_tokens",
"turns", "kind"}``; a last answer cut at ``max_tokens`` has ``finish_reason: "length"``, and
its end-of-turn token is not supervised.

The output is appended to, a line per finished conversation, and ids already there are skipped,
so an interrupted run resumes (a line torn by a kill is dropped and answered again). ``specray
regenerate`` answers in this process; the pipeline stage answers on Ray actors with the capture
actors' resources (``actors/regenerate.py``), so a GPU cluster answers on its GPUs.
"""

from __future__ import annotations

import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path

from tqdm import tqdm

from specray.capture.contamination import KINDS, EvalOverlap, prompt_kind
from specray.capture.data import load_conversations
from specray.serving.regenerate import PromptTurns
from specray.serving.sampling import SamplingParams

def select_prompts(dataset: str, *, num: int, skip: int = 0, exclude: tuple[str, ...] = (), mix: dict | None = None,
                   max_turns: int = 1, done: set[str] = frozenset(), id_field: str | None = None,
                   endpoint_url: str | None = None, overlap: EvalOverlap | None = None) -> tuple[list[PromptTurns], dict]:
    """The first ``num`` usable conversations after ``skip`` (module docstring), less those in ``done``.

    Returns the prompts still to answer and what the selection saw: conversations read, excluded
    (with the first few overlaps), kinds taken, and kinds the dataset ran out of."""
    overlap = overlap if overlap is not None else (EvalOverlap(exclude) if exclude else None)
    quota = {k: round(share * num) for k, share in mix.items()} if mix else None
    taken = {k: 0 for k in KINDS}
    prompts, read, excluded, examples, total = [], 0, 0, [], 0
    for conv in load_conversations(dataset, purpose="train", skip=skip, id_field=id_field, endpoint_url=endpoint_url):
        if total >= num or (quota is not None and all(taken[k] >= quota.get(k, 0) for k in KINDS)):
            break
        read += 1
        users = tuple(c for r, c in conv.messages if r == "user")[:max_turns]
        if not users:
            continue
        if overlap is not None and (hits := [h for u in users if (h := overlap.match(u)) is not None]):
            excluded += 1
            if len(examples) < 10:
                examples.append([conv.id, hits[0]])
            continue
        kind = prompt_kind(users[0])
        if quota is not None and taken[kind] >= quota.get(kind, 0):
            continue
        taken[kind] += 1
        total += 1
        if conv.id not in done:
            system = conv.messages[0][1] if conv.messages[0][0] == "system" else None
            prompts.append(PromptTurns(conv.id, users, system, kind))
    short = {k: quota[k] - taken[k] for k in KINDS if quota is not None and taken[k] < quota.get(k, 0)}
    return prompts, {"read": read, "excluded": excluded, "excluded_examples": examples, "kinds": taken,
                     "short_of": short, "eval_prompts_checked": overlap.size if overlap is not None else 0}


def answered(path: Path) -> set[str]:
    """Ids already in an output file; a last line torn by a kill is cut off (it is answered again)."""
    if not path.exists():
        return set()
    text = path.read_text()
    lines, ids = text.splitlines(keepends=True), set()
    good = 0
    for n, line in enumerate(lines, 1):
        try:
            ids.add(json.loads(line)["id"])
        except (json.JSONDecodeError, KeyError, TypeError):
            if n == len(lines):
                break
            raise ValueError(f"{path}: a line that is not a regenerated conversation: {line[:120]!r}; move the file "
                             "away or pick another output") from None
        good += len(line)
    if good < len(text):
        with open(path, "r+") as f:
            f.truncate(len(text[:good].encode()))
    return ids


def answer_lengths(path: Path) -> dict:
    """Answer lengths of a finished output: how many tokens, and how many were cut at max_tokens."""
    records = [json.loads(line) for line in path.read_text().splitlines()]
    per_answer = [r["answer_tokens"] / max(r["turns"], 1) for r in records]
    return {"conversations": len(records), "answers": sum(r["turns"] for r in records),
            "tokens": sum(r["answer_tokens"] for r in records),
            "median_tokens_per_answer": round(statistics.median(per_answer), 1) if per_answer else None,
            "cut_share": round(sum(r["finish_reason"] == "length" for r in records) / max(len(records), 1), 3),
            "multi_turn": sum(r["turns"] > 1 for r in records)}


class _Writer:
    """Appends records as they come, flushed (a rerun resumes), and counts what this run generated."""

    def __init__(self, path: Path, total: int, progress: bool):
        path.parent.mkdir(parents=True, exist_ok=True)
        self.file = open(path, "a")
        self.bar = tqdm(total=total, unit="conv", desc="regenerate", disable=not progress)
        self.tokens = self.too_long = 0
        self.seconds = 0.0

    def __call__(self, records: list[dict], stats: dict | None = None) -> None:
        for record in records:
            self.file.write(json.dumps(record) + "\n")
        self.file.flush()
        self.bar.update(len(records) + (stats or {}).get("too_long", 0))
        if stats:
            self.tokens += stats["tokens"]
            self.seconds += stats["seconds"]
            self.too_long += stats["too_long"]
        if self.seconds:
            self.bar.set_postfix(tok_s=f"{self.tokens / self.seconds:.0f}")

    def close(self) -> None:
        self.bar.close()
        self.file.close()


def regenerate(*, target_name: str, dataset: str, num: int, out: str, params: SamplingParams, skip: int = 0,
               batch_size: int = 16, max_prompt_tokens: int = 1024, max_turns: int = 1,
               exclude: tuple[str, ...] = ("mtbench", "humaneval"), mix: dict | None = None,
               progress: bool = True, answer: Callable | None = None) -> dict:
    """Answer the selected prompts into ``out``; ``answer(prompts, on_records)`` does the generating
    (default: an engine in this process). Returns the summary the CLI and the pipeline report."""
    path = Path(out)
    done = answered(path)
    prompts, selection = select_prompts(dataset, num=num, skip=skip, exclude=tuple(exclude), mix=mix,
                                        max_turns=max_turns, done=done)
    writer = _Writer(path, len(prompts), progress)
    start = time.perf_counter()
    try:
        (answer or _answer_here(target_name, batch_size, max_prompt_tokens, params))(prompts, writer)
    finally:
        writer.close()
    wall = time.perf_counter() - start
    return {"out": str(path), "already_there": len(done), "written": len(prompts) - writer.too_long, "tokens": writer.tokens, "too_long": writer.too_long, "wall_s": round(wall, 1),
            "tokens_per_s": round(writer.tokens / writer.seconds, 1) if writer.seconds else None,
            "selection": selection, "answers": answer_lengths(path) if path.exists() else None}


def _answer_here(target_name: str, batch_size: int, max_prompt_tokens: int, params: SamplingParams) -> Callable:
    def answer(prompts: list[PromptTurns], on_records: Callable) -> None:
        from specray.capture.target import load_target
        from specray.serving.engine import Engine
        from specray.serving.regenerate import AnswerStats, answer_conversations, engine_max_len

        if not prompts:
            return
        engine = Engine(load_target(target_name), None, max_batch=batch_size,
                        max_len=engine_max_len(max_prompt_tokens, params), max_waiting=None)
        stats = AnswerStats()
        seen = (0, 0.0, 0)
        for record in answer_conversations(engine, prompts, params, max_prompt_tokens=max_prompt_tokens, stats=stats):
            on_records([record], {"tokens": stats.tokens - seen[0], "seconds": stats.seconds - seen[1],
                                  "too_long": stats.too_long - seen[2]})
            seen = (stats.tokens, stats.seconds, stats.too_long)
        if stats.too_long > seen[2]:
            on_records([], {"tokens": 0, "seconds": 0.0, "too_long": stats.too_long - seen[2]})
    return answer


def regenerate_stage(cfg, progress: bool) -> dict:
    """The pipeline's stage: ``cfg.data``'s prompts answered on Ray into ``cfg.regenerated``."""
    from specray.actors.regenerate import regenerate_on_ray
    from specray.capture.chat import resolve_chat_template
    from specray.capture.target import load_target

    r, c = cfg.regenerate, cfg.capture
    template = load_target(cfg.target.name, weights="none", chat_template=resolve_chat_template(cfg.data.chat_template),
                           chat_template_kwargs=cfg.data.chat_template_kwargs).chat_template  # as capture renders
    params = SamplingParams(max_tokens=r.max_tokens, temperature=r.temperature, seed=r.seed)

    def on_ray(prompts: list[PromptTurns], on_records: Callable) -> None:
        regenerate_on_ray(cfg.target.name, prompts, params,
                          batch_size=r.batch_size, max_prompt_tokens=r.max_prompt_tokens, on_records=on_records,
                          num_actors=c.num_actors, num_cpus_per_actor=c.num_cpus_per_actor,
                          num_gpus_per_actor=c.num_gpus_per_actor, target_dtype=cfg.target.dtype,
                          target_device=cfg.target.device, chat_template=template)

    summary = regenerate(target_name=cfg.target.name, dataset=cfg.data.dataset, num=cfg.data.max_samples,
                         out=str(cfg.regenerated), params=params, skip=cfg.data.skip, batch_size=r.batch_size,
                         max_prompt_tokens=r.max_prompt_tokens, max_turns=r.max_turns, exclude=tuple(r.exclude),
                         mix=r.mix, progress=progress, answer=on_ray)
    if not summary["answers"] or not summary["answers"]["conversations"]:
        raise ValueError(f"regenerate wrote no conversations from {cfg.data.dataset} (selection: "
                         f"{summary['selection']}); raise data.max_samples or regenerate.max_prompt_tokens")
    return summary
