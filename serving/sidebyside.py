"""Our engines timed side by side on the same prompts: AR, a drafter, and whatever else runs beside them.

The measuring core of ``specray bench serve`` (pipeline/bench/serve.py, which adds transformers
and vLLM) and of the pipeline's bench stage (the drafter against our AR): every system is
warmed up, then ``repeats`` passes run with the systems taking turns per batch of prompts
(``timed``); a drafter's speedup over our AR is reported as the ratio of medians, per pass, and
pooled over every batch the two ran back to back (``paired_ratio``, with a bootstrap interval).

    engines = build_engines(target, drafter_dir, max_batch=4)
    prompts = [engines["specray-ar"].encode(messages) for messages in conversations]
    comparison = compare(engines, prompts, max_tokens=64, batch_sizes=(1, 4))
    summary = drafter_summary(engines, comparison, batch_sizes=(1, 4), png=None)
"""

from __future__ import annotations

import os
import platform
import random
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from specray.serving.sampling import SamplingParams


@dataclass
class Generated:
    tokens: list[list[int]]  # per prompt, the generated tokens without EOS
    tau: float | None = None  # mean tokens emitted per target step after prefill (speculative systems)
    rounds: list[int] | None = None  # those per-step counts, where the system reports them

    @classmethod
    def joined(cls, parts: list[Generated]) -> Generated:
        """One pass's output from its chunks' (tau over all their steps)."""
        tokens = [t for part in parts for t in part.tokens]
        if any(part.rounds is None for part in parts):
            return cls(tokens)
        rounds = [k for part in parts for k in part.rounds]
        return cls(tokens, sum(rounds) / len(rounds), rounds)


Chunk = list[list[int]]  # the prompts (token ids) one call of ``generate`` runs together: a batch
System = Callable[[Chunk], "Generated"]  # generates one chunk greedily


def timed(systems: dict[str, System], chunks: list[Chunk],
          repeats: int) -> dict[str, tuple[float, Generated, list[float], list[list[float]]]]:
    """Each system's median seconds over ``repeats`` passes over ``chunks``, its last pass's output,
    every pass's seconds and every chunk's seconds per pass (pass ``i`` of two systems ran
    interleaved, chunk by chunk: their ratio is paired, and so is each chunk's).

    Interleaved chunk by chunk: every system runs a chunk before any runs the next, in an order
    reversed every other chunk and every other pass. The load of a shared machine drifts over
    seconds to minutes; systems that take turns per chunk see the same drift, where whole passes
    run one after another would not (one pass here swings ±8 %, which is larger than the effects
    the ratios are read for)."""
    names = list(systems)
    chunk_times: dict[str, list[list[float]]] = {name: [] for name in names}
    last: dict[str, Generated] = {}
    for r in range(repeats):
        seconds, parts = {name: [] for name in names}, {name: [] for name in names}
        for c, chunk in enumerate(chunks):
            for name in names if (r + c) % 2 == 0 else names[::-1]:
                start = time.perf_counter()
                parts[name].append(systems[name](chunk))
                seconds[name].append(time.perf_counter() - start)
        for name in names:
            chunk_times[name].append(seconds[name])
            last[name] = Generated.joined(parts[name])
    passes = {name: [sum(c) for c in chunk_times[name]] for name in names}
    return {name: (statistics.median(passes[name]), last[name], passes[name], chunk_times[name]) for name in names}


def cut_eos(tokens: list[int], eos: int) -> list[int]:
    return tokens[: tokens.index(eos)] if eos in tokens else tokens


def engine_system(engine, params) -> System:
    def run(chunk: Chunk) -> Generated:
        results = engine.generate(chunk, params)
        rounds = None if engine.drafter is None else [k for r in results for k in r.emitted_per_round]
        return Generated([r.token_ids for r in results], rounds=rounds)
    return run


def run_entry(system: str, batch: int, seconds: float, out: Generated, passes: list[float],
               chunks: list[list[float]]) -> dict:
    tokens = sum(len(t) for t in out.tokens)
    return {"system": system, "batch_size": batch, "tokens_per_s": tokens / seconds, "tokens": tokens,
            "seconds": seconds, "pass_seconds": passes, "chunk_seconds": chunks, "tau": out.tau}


def mismatches(a: Generated, b: Generated) -> int:
    """Prompts whose greedy outputs differ."""
    return sum(x != y for x, y in zip(a.tokens, b.tokens, strict=True))


def environment() -> dict:
    """The machine a measurement ran on (benchmark JSON files carry it)."""
    return {
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "cpus": os.cpu_count(),
        "machine": platform.machine(),
        "python": platform.python_version(),
        "load_average": list(os.getloadavg()),  # 1, 5, 15 min: other jobs sharing the CPUs
    }


@dataclass
class Comparison:
    """What ``compare`` measured: one run entry per system and batch size (``run_entry``), each
    system's last pass's output per batch size, and the first batch size's round phases."""

    runs: list[dict]
    outputs: dict[tuple[str, int], Generated]
    round_ms: dict | None


def warm_up(engines: dict, prompts: list[list[int]]) -> None:
    """One short generation per engine: allocator, thread pools, first-call paths."""
    for engine in engines.values():
        engine.generate(prompts[:1], SamplingParams(max_tokens=8))


def compare(engines: dict, prompts: list[list[int]], *, max_tokens: int, batch_sizes: tuple[int, ...],
            repeats: int = 1, peers: Callable[[int], dict[str, System]] | None = None) -> Comparison:
    """Our ``engines`` (``build_engines``) and ``peers(batch)`` (more systems at that batch size),
    timed side by side at each batch size on the same prompts; the engines' choosers report
    their rounds by size with each run."""
    if repeats < 1:
        raise ValueError("--repeats must be >= 1")
    params = SamplingParams(max_tokens=max_tokens)
    drafter = engines.get("specray-drafter")
    runs, outputs, phases = [], {}, None
    for batch in batch_sizes:
        systems = {name: engine_system(engine, params) for name, engine in engines.items()}
        systems.update(peers(batch) if peers else {})
        if drafter is not None and batch == batch_sizes[0]:
            timing_start = drafter.worker.stats()
        choosers = {name: e.versions.active.chooser for name, e in engines.items() if e.versions.active.chooser}
        before = {name: c.snapshot() for name, c in choosers.items()}
        chunks = [prompts[i : i + batch] for i in range(0, len(prompts), batch)]
        for name, result in timed(systems, chunks, repeats).items():
            runs.append(run_entry(name, batch, *result))
            if name in choosers:  # rounds by size, the cost model's predicted vs measured tokens/s
                runs[-1]["rounds"] = choosers[name].report(since=before[name])
            outputs[(name, batch)] = result[1]
        if drafter is not None and batch == batch_sizes[0]:
            run = find_run(runs, "specray-drafter", batch)
            phases = round_phases(timing_start, drafter.worker.stats(), repeats, run["seconds"])
    return Comparison(runs, outputs, phases)


def build_engines(target, drafter_dir: str | None, max_batch: int, *, static_sizes: tuple[int, ...] = (),
                  cost_table=None, **options) -> dict:
    """Our systems: AR, the drafter with ``options``, with ``tree`` also its chain (``specray-drafter-chain``),
    and the drafter at each static size (a node budget for trees), all sharing one cost table."""
    from specray.serving.engine import Engine

    engines = {"specray-ar": Engine(target, None, max_batch=max_batch)}
    if drafter_dir:
        drafter = engines["specray-drafter"] = Engine(target, drafter_dir, max_batch=max_batch, cost_table=cost_table,
                                                      **options)
        table = drafter.versions.cost_table
        if options.get("tree"):  # the same drafter's chain, for trees against chains in one run
            engines["specray-drafter-chain"] = Engine(target, drafter_dir, max_batch=max_batch, cost_table=table,
                                                      **{**options, "tree": False, "num_speculative_tokens": None})
        for k in static_sizes:
            engines[f"specray-drafter-k{k}"] = Engine(target, drafter_dir, max_batch=max_batch, cost_table=table,
                                                      **{**options, "num_speculative_tokens": k, "speculation": "static"})
    return engines


def round_phases(start: dict, end: dict, repeats: int, run_seconds: float) -> dict | None:
    """Where a speculative round's time goes at the first batch size, in ms per round (``step`` call),
    from the worker's ``stats()`` before and after the timed runs.

    ``draft`` (the drafter's block forward and sampling), ``verify`` (the target forward over
    the block), ``accept`` (rejection sampling), ``commit`` (KV commits and the drafter's
    context K/V of the accepted rows), and ``other``: the run's wall time per round minus those
    (scheduling, prefill, stop checks, detokenisation, and any plain steps the chooser took).
    None when no speculative round ran."""
    rounds = end["steps"] - start["steps"]
    if rounds == 0:
        return None
    steps = rounds / repeats  # rounds in one timed run
    phases = {name: 1000 * (seconds - start["phase_seconds"][name]) / rounds
              for name, seconds in end["phase_seconds"].items()}
    wall = 1000 * run_seconds / steps  # the median run's wall time per round
    return {**phases, "other": wall - sum(phases.values()), "wall": wall}


def find_run(runs: list[dict], system: str, batch: int) -> dict | None:
    return next((r for r in runs if r["system"] == system and r["batch_size"] == batch), None)


def tokens_per_s(runs: list[dict], system: str, batch: int) -> float | None:
    run = find_run(runs, system, batch)
    return run["tokens_per_s"] if run else None


def pass_ratios(run: dict, baseline: dict) -> list[float]:
    """``run``'s tokens/s over ``baseline``'s, pass by pass (pass i of each ran interleaved in one ``timed``)."""
    return [(run["tokens"] / s) / (baseline["tokens"] / b) for s, b in zip(run["pass_seconds"], baseline["pass_seconds"])]


def paired_ratio(run: dict, baseline: dict, resamples: int = 2000) -> dict:
    """``run``'s tokens/s over ``baseline``'s from every chunk the two ran back to back, all passes
    pooled: the ratio of their summed seconds (each pass's tokens are the same: greedy, same
    prompts), with a 95 % bootstrap interval over those chunk pairs (seeded: the same timings give
    the same interval). Pairs that ran seconds apart share the machine's load; the median pass
    ratio pairs whole passes, and the ratio of medians pairs nothing."""
    pairs = [(b, s) for b_pass, s_pass in zip(baseline["chunk_seconds"], run["chunk_seconds"])
             for b, s in zip(b_pass, s_pass, strict=True)]
    scale = run["tokens"] / baseline["tokens"]

    def pooled(sample: list[tuple[float, float]]) -> float:
        return scale * sum(b for b, _ in sample) / sum(s for _, s in sample)

    rng = random.Random(0)
    boots = sorted(pooled([pairs[rng.randrange(len(pairs))] for _ in pairs]) for _ in range(resamples))
    return {"ratio": pooled(pairs), "ci95": [boots[int(0.025 * resamples)], boots[int(0.975 * resamples) - 1]],
            "pairs": len(pairs)}


def ratio(numerator: float | None, denominator: float | None) -> float | None:
    """A speedup, or None when one side was not measured (a skipped peer)."""
    return numerator / denominator if numerator is not None and denominator else None


def drafter_summary(engines: dict, comparison: Comparison, *, batch_sizes: tuple[int, ...], png: str | None,
                    ar_vs_vllm_ar: float | None = None) -> dict:
    """The drafter's figures: tau, acceptance by position, its speedups over our AR (at the first
    batch size, by batch size, by pass and paired), over transformers generate and vLLM's AR where
    those ran (None otherwise)."""
    runs, batch = comparison.runs, batch_sizes[0]
    drafters = [r for r in runs if r["system"].startswith("specray-drafter")]
    summary = speculative_summary(engines, comparison.outputs, runs, batch, ar_vs_vllm_ar, png)
    summary["round_ms"] = comparison.round_ms
    summary["speedup_vs_ar_by_batch"] = {str(b): {r["system"]: ratio(r["tokens_per_s"], tokens_per_s(runs, "specray-ar", b))
                                                  for r in drafters if r["batch_size"] == b} for b in batch_sizes}
    summary["speedup_vs_ar_by_pass"] = {str(b): {r["system"]: pass_ratios(r, find_run(runs, "specray-ar", b))
                                                 for r in drafters if r["batch_size"] == b} for b in batch_sizes}
    summary["speedup_vs_ar_paired"] = {str(b): {r["system"]: paired_ratio(r, find_run(runs, "specray-ar", b))
                                                for r in drafters if r["batch_size"] == b} for b in batch_sizes}
    return summary


def speculative_summary(engines: dict, outputs: dict, runs: list[dict], batch: int, ar_vs_vllm_ar: float | None,
                        png: str | None) -> dict:
    """tau (tokens per target step, plain steps included), speedups and the bound ratio of our
    drafter's run at ``batch``; acceptance by position and tau over the speculative rounds of the
    whole bench (the version's round statistics)."""
    spec, ar = outputs[("specray-drafter", batch)], outputs[("specray-ar", batch)]
    m = engines["specray-drafter"].worker.max_verify_rows - 1  # the largest round
    stats = engines["specray-drafter"].stats()
    accept = stats["acceptance_by_position"]
    runner = engines["specray-ar"].runner
    t1, tB = step_time(runner, 1), step_time(runner, m + 1)
    speedup = tokens_per_s(runs, "specray-drafter", batch) / tokens_per_s(runs, "specray-ar", batch)
    if png and accept:
        plot_acceptance(accept, stats["tau"], png)
    return {"tau": spec.tau, "tau_speculative_rounds": stats["tau"], "accept_rate_by_pos": accept, "speedup_vs_ar": speedup,
            "speedup_vs_hf_generate": ratio(tokens_per_s(runs, "specray-drafter", batch), tokens_per_s(runs, "hf-generate", batch)),
            # the drafter vs our AR (first phase) × our AR vs vLLM AR (paired): each ratio measured side by side
            "speedup_vs_vllm_ar": speedup * ar_vs_vllm_ar if ar_vs_vllm_ar is not None else None,
            "t_step_1_s": t1, "t_step_B_s": tB, "bound_ratio": speedup / (spec.tau * t1 / tB),
            "greedy_match": 1 - mismatches(ar, spec) / len(ar.tokens)}


def step_time(runner, rows: int, context: int = 256, repeats: int = 7) -> float:
    """Median time of one target forward of ``rows`` rows over ``context`` committed rows."""
    slot = runner.cache.allocate()
    runner.forward(torch.zeros(1, context, dtype=torch.long), torch.tensor([slot]), torch.tensor([context]))
    runner.cache.commit(slot, context)
    ids = torch.zeros(1, rows, dtype=torch.long)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        runner.forward(ids, torch.tensor([slot]), torch.tensor([rows]))
        times.append(time.perf_counter() - start)
    runner.cache.release(slot)
    return statistics.median(times)


def plot_acceptance(accept: list[float], tau: float, png: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.bar(range(1, len(accept) + 1), accept)
    ax.set(xlabel="draft position j", ylabel="P(draft j accepted)", ylim=(0, 1), title=f"acceptance by position (tau {tau:.2f})")
    fig.tight_layout()
    Path(png).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(png, dpi=110)
    plt.close(fig)
