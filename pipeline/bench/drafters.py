"""Several drafters side by side in one run, on several datasets:
``specray bench serve --drafter LABEL=DIR --drafter LABEL=DIR … --dataset mtbench humaneval``.

For each dataset, on the same prompt token ids:

- **live acceptance**: each drafter verifies its largest round every step (``speculation="static"``,
  as ``serving/live_eval.py`` measures at checkpoints), untimed: ``tau_live`` and acceptance by
  position;
- **throughput**: our AR (``specray-ar``) and our engine with each drafter (``specray-LABEL``, the
  speculation options given: the automatic chooser by default) timed side by side at each batch
  size (serving/sidebyside.py ``compare``: the systems take turns per chunk of prompts); per
  drafter, tokens/s, the speedup over our AR (median and paired), tau over every step, the share
  of the chooser's decisions that speculate (rounds of size ≥ 1; size 0 is a plain step), and
  greedy mismatches against our AR;
- **vLLM** (when importable and not skipped): vLLM's AR and vLLM serving one drafter's speculators
  export (``vllm-LABEL``, ``vllm_drafter``: the first drafter by default, drafting the live round
  size every step), each timed interleaved with our AR; their tau, acceptance and greedy mismatches.

The drafters share one target and one AR engine; each drafter measures its cost table once (or
uses ``cost_table``), reused on every dataset. vLLM runs after every dataset's runs of ours: once
started, it changes this process's threading.
"""

from __future__ import annotations

import importlib.util
import re
import tempfile
from pathlib import Path

from specray.drafters.format import read_drafter_config

LABEL = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,39}$")


def parse_drafters(values: list[str]) -> dict[str, str]:
    """``--drafter`` values, ``LABEL=DIR`` or ``DIR`` (labelled by its algorithm), as {label: dir}."""
    drafters: dict[str, str] = {}
    for value in values:
        label, sep, path = value.partition("=")
        if not sep or Path(value).is_dir():  # a directory whose name holds '='
            label, path = read_drafter_config(value)["algorithm"], value
        if not LABEL.match(label):
            raise ValueError(f"--drafter {value!r}: a label is 1-40 letters, digits, '_', '.' or '-', starting with a "
                             "letter or digit (LABEL=DIR)")
        if label in drafters:
            raise ValueError(f"--drafter label {label!r} is given twice: name each drafter, e.g. {label}-2={path}")
        drafters[label] = path
    return drafters


def bench_drafters(*, target_name: str, drafters: dict[str, str], datasets: tuple[str, ...], num_prompts: int,
                   max_tokens: int, batch_sizes: tuple[int, ...] = (1, 4, 16), repeats: int = 1, vllm: bool = True,
                   vllm_drafter: str | None = None, dtype: str = "float32", num_speculative_tokens: int | None = None,
                   max_speculative_batch: int | None = None, speculation: str = "auto",
                   cost_table: str | None = None) -> dict:
    """The side-by-side result (see the module docstring): ``{"datasets": {name: {...}}, ...}``."""
    from specray.capture.data import load_conversations
    from specray.capture.target import load_target
    from specray.serving.engine import Engine
    from specray.serving.live_eval import KV_SLACK
    from specray.serving.sidebyside import compare, environment, warm_up

    if not drafters:
        raise ValueError("name at least one drafter: --drafter LABEL=DIR")
    if not datasets:
        raise ValueError("name at least one dataset: --dataset mtbench humaneval")
    if repeats < 1:
        raise ValueError("--repeats must be >= 1")
    if vllm_drafter is not None and vllm_drafter not in drafters:
        raise ValueError(f"--vllm-drafter {vllm_drafter!r} is not a --drafter label; labels: {sorted(drafters)}")
    algorithms = {label: read_drafter_config(path)["algorithm"] for label, path in drafters.items()}
    target = load_target(target_name, dtype=dtype)
    tables: dict[str, object] = {}
    options = {"num_speculative_tokens": num_speculative_tokens, "max_speculative_batch": max_speculative_batch,
               "speculation": speculation}
    vllm_run = vllm and importlib.util.find_spec("vllm") is not None
    vllm_label = (vllm_drafter or next(iter(drafters))) if vllm_run else None
    max_batch = max(batch_sizes)
    ar = Engine(target, None, max_batch=max_batch)
    per_dataset, prompts, comparisons = {}, {}, {}
    for dataset in datasets:  # ours first: vLLM changes this process's threading once it has started
        encoded = prompts[dataset] = [ar.encode(c.as_chat())
                                      for c in load_conversations(dataset, purpose="eval", limit=num_prompts)]
        if not encoded:
            raise ValueError(f"--dataset {dataset!r} has no prompts")
        engines = {"specray-ar": ar}
        for label, path in drafters.items():
            engine = Engine(target, path, max_batch=max_batch, cost_table=tables.get(label, cost_table), **options)
            tables[label] = engine.versions.cost_table
            engines[f"specray-{label}"] = engine
        live = _live(target, drafters, encoded, max_tokens=max_tokens, batch=max_batch,
                     num_speculative_tokens=num_speculative_tokens, max_len=max(map(len, encoded)) + max_tokens + KV_SLACK)
        warm_up(engines, encoded)
        comparison = comparisons[dataset] = compare(engines, encoded, max_tokens=max_tokens, batch_sizes=batch_sizes,
                                                    repeats=repeats)
        per_dataset[dataset] = {"prompts": len(encoded), "runs": comparison.runs,
                                "drafters": {label: _drafter_figures(f"specray-{label}", comparison, batch_sizes, live[label])
                                             for label in drafters}}
        del engines, live
    if vllm_run:
        from specray.pipeline.bench.serve import vllm_systems

        k = per_dataset[datasets[0]]["drafters"][vllm_label]["live_num_speculative_tokens"]
        with tempfile.TemporaryDirectory(prefix="specray-bench-peer-") as tmp:  # the export, written once
            systems, drafter = vllm_systems(drafters[vllm_label], target, k, tmp)
            systems.pop("vllm-ngram")  # prompt lookup is `bench serve`'s single-drafter comparison
            if "vllm-drafter" in systems:
                systems[f"vllm-{vllm_label}"] = systems.pop("vllm-drafter")
            for dataset in datasets:
                entry = per_dataset[dataset]
                entry["vllm"] = _vllm(target_name, target, systems, ar, comparisons[dataset], prompts[dataset],
                                      max_tokens=max_tokens, batch_sizes=batch_sizes, repeats=repeats, dtype=dtype)
                entry["vllm"]["drafter"] = {"label": vllm_label, **drafter} if drafter else None
                entry["runs"] = entry["runs"] + entry["vllm"].pop("runs")
    return {"benchmark": "serve-drafters", "target": target_name, "dtype": dtype,
            "drafters": {label: {"dir": path, "algorithm": algorithms[label]} for label, path in drafters.items()},
            "max_tokens": max_tokens, "batch_sizes": list(batch_sizes), "repeats": repeats, **options,
            "cost_tables": "measured" if cost_table is None else cost_table,
            "vllm": {"available": importlib.util.find_spec("vllm") is not None, "skipped": not vllm,
                     "drafter": vllm_label},
            "datasets": per_dataset, "environment": environment()}


def _live(target, drafters: dict[str, str], prompts: list[list[int]], *, max_tokens: int, batch: int,
          num_speculative_tokens: int | None, max_len: int) -> dict[str, dict]:
    """Each drafter's live acceptance on ``prompts``: one static engine, each drafter a fresh version."""
    from specray.serving.engine import Engine
    from specray.serving.live_eval import measure

    engine = Engine(target, None, max_batch=batch, max_len=max_len, max_waiting=None, speculation="static",
                        num_speculative_tokens=num_speculative_tokens)
    live = {}
    for number, (label, path) in enumerate(drafters.items(), start=1):
        version = engine.versions.build(path, number)
        engine.versions.install(version)
        live[label] = {**measure(engine, prompts, max_tokens=max_tokens, batch_size=batch),
                       "num_speculative_tokens": version.worker.max_verify_rows - 1}
    return live


def _drafter_figures(system: str, comparison, batch_sizes: tuple[int, ...], live: dict) -> dict:
    """One drafter's row: live acceptance, and per batch size its throughput against our AR."""
    from specray.serving.sidebyside import find_run, mismatches, paired_ratio

    by_batch = {}
    for b in batch_sizes:
        run, ar = find_run(comparison.runs, system, b), find_run(comparison.runs, "specray-ar", b)
        rounds = (run.get("rounds") or {}).get("rounds_by_size", {})
        decisions = sum(rounds.values())
        by_batch[str(b)] = {
            "tokens_per_s": run["tokens_per_s"], "ar_tokens_per_s": ar["tokens_per_s"],
            "speedup_vs_ar": run["tokens_per_s"] / ar["tokens_per_s"], "speedup_vs_ar_paired": paired_ratio(run, ar),
            "tau": run["tau"],  # emitted tokens per target step, plain steps included
            "rounds_by_size": rounds,
            "speculating_share": (decisions - rounds.get("0", 0)) / decisions if decisions else None,
            "greedy_mismatches_vs_ar": mismatches(comparison.outputs[(system, b)], comparison.outputs[("specray-ar", b)]),
        }
    return {"tau_live": live["tau_live"], "accept_rate_by_pos": live["live_accept_by_pos"],
            "live_num_speculative_tokens": live["num_speculative_tokens"], "live_rounds": live["live_rounds"],
            "by_batch": by_batch}


def _vllm(target_name: str, target, systems: dict[str, dict | None], ar, comparison, encoded: list[list[int]], *,
          max_tokens: int, batch_sizes: tuple[int, ...], repeats: int, dtype: str) -> dict:
    """vLLM's ``systems`` (``vllm_systems``: its AR and a drafter's speculators export), each
    paired with our AR; their figures against our AR."""
    from specray.capture.target import resolve_target_dir
    from specray.pipeline.bench.serve import _bench_vllm
    from specray.serving.sampling import SamplingParams
    from specray.serving.sidebyside import engine_system, mismatches

    ours = {"specray-ar": engine_system(ar, SamplingParams(max_tokens=max_tokens))}
    runs, outputs, details = _bench_vllm(resolve_target_dir(target_name), encoded, max_tokens, batch_sizes, repeats,
                                         target.tokenizer.eos_token_id, systems, ours, dtype, paired_with={})
    paired = details.pop("paired_specray_ar_tokens_per_s")
    by_system = {}
    for system in systems:
        by_batch = {}
        for b in batch_sizes:
            run = next(r for r in runs if r["system"] == system and r["batch_size"] == b)
            by_batch[str(b)] = {"tokens_per_s": run["tokens_per_s"], "paired_specray_ar_tokens_per_s": paired[system][str(b)],
                                "speedup_vs_specray_ar": run["tokens_per_s"] / paired[system][str(b)],
                                "tau": run.get("tau"), "accept_rate_by_pos": run.get("accept_rate_by_pos"),
                                "greedy_mismatches_vs_ar": mismatches(outputs[(system, b)],
                                                                      comparison.outputs[("specray-ar", b)])}
        by_system[system] = by_batch
    return {**details, "runs": runs, "systems": by_system}


def drafters_table(result: dict) -> str:
    """Per dataset: each drafter's live tau and acceptance, then tokens/s and the speedup over our
    AR by batch size with the share of decisions that speculate; vLLM's rows after ours."""
    batches = [str(b) for b in result["batch_sizes"]]
    lines = []
    for dataset, entry in result["datasets"].items():
        lines.append(f"{dataset} ({entry['prompts']} prompts x {result['max_tokens']} tokens, greedy)")
        lines.append(f"{'system':<24} {'tau_live':>8}  {'accept by position':<22} "
                     + " ".join(f"{'b' + b + ' tok/s':>10} {'vs AR':>6} {'spec':>5}" for b in batches))
        ar = {b: next(r["tokens_per_s"] for r in entry["runs"] if r["system"] == "specray-ar" and str(r["batch_size"]) == b)
              for b in batches}
        lines.append(f"{'specray-ar':<24} {'-':>8}  {'':<22} " + " ".join(f"{ar[b]:>10.1f} {'1.00x':>6} {'-':>5}" for b in batches))
        for label, row in entry["drafters"].items():
            accept = " ".join(f"{a:.2f}" for a in (row["accept_rate_by_pos"] or [])[:4])
            cells = []
            for b in batches:
                fig = row["by_batch"][b]
                share = f"{100 * fig['speculating_share']:.0f}%" if fig["speculating_share"] is not None else "-"
                cells.append(f"{fig['tokens_per_s']:>10.1f} {fig['speedup_vs_ar']:>5.2f}x {share:>5}")
            tau = f"{row['tau_live']:.3f}" if row["tau_live"] is not None else "-"
            lines.append(f"{'specray-' + label:<24} {tau:>8}  {accept:<22} " + " ".join(cells))
        vllm = entry.get("vllm")
        if vllm:
            for system, by_batch in vllm["systems"].items():
                first = by_batch[batches[0]]
                tau = f"{first['tau']:.3f}" if first["tau"] is not None else "-"
                accept = " ".join(f"{a:.2f}" for a in (first["accept_rate_by_pos"] or [])[:4])
                cells = [f"{by_batch[b]['tokens_per_s']:>10.1f} {by_batch[b]['speedup_vs_specray_ar']:>5.2f}x {'':>5}"
                         for b in batches]
                lines.append(f"{system:<24} {tau:>8}  {accept:<22} " + " ".join(cells))
            if vllm["drafter"] and "skipped" in vllm["drafter"]:
                lines.append(f"vLLM with {vllm['drafter']['label']}: skipped: {vllm['drafter']['skipped']}")
            lines.append(f"vLLM {vllm['version']}: each row's speedup is against our AR timed beside it")
        mismatched = {label: {b: row["by_batch"][b]["greedy_mismatches_vs_ar"] for b in batches}
                      for label, row in entry["drafters"].items()}
        lines.append("greedy mismatches against our AR (prompts): "
                     + "; ".join(f"{label} {m}" for label, m in mismatched.items()))
        lines.append("")
    if not result["vllm"]["available"]:
        lines.append("vLLM: not installed (pip install -e '.[vllm]' or make vllm-env to add it)")
    return "\n".join(lines).rstrip()

