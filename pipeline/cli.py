"""The ``specray`` command line.

    specray capture -c manifests/capture-quickstart.yaml [section.field=value …]
    specray train -c manifests/train-dflash-quickstart.yaml [section.field=value …]
    specray export runs/train-dflash-quickstart [--out DIR] [--format speculators|sglang [--verifier ID]]
    specray import PEER_DIR --out EXPORT [--target NAME]   (speculators, SGLang / SpecForge, z-lab drafters)
    specray push EXPORT --repo ID [--revision BRANCH] [--private]   (to the Hugging Face Hub, verified)
    specray evaluate EXPORT_DIR --manifest runs/<held-out capture>/manifest.parquet [objective.field=value …]
    specray evaluate EXPORT_DIR --live [--dataset mtbench|humaneval|jsonl:PATH --num-prompts 16 --max-tokens 32]
    specray calibrate EXPORT_DIR --manifest runs/<held-out capture>/manifest.parquet   (DSpark: STS of its confidence)
    specray generate --drafter EXPORT_DIR --prompt "…" [--max-tokens 128] [--temperature 0]
    specray profile --out cost.json [--target NAME] [--force]   (the round-cost table of this machine)
    specray regenerate --out data/self.jsonl --num 256   (self-distilled training conversations)
    specray pipeline run manifests/quickstart.yaml [section.field=value …]   (capture → … → bench on Ray)
    specray serve -c manifests/serve.yaml [section.field=value …]   (OpenAI API on Ray Serve, until Ctrl-C)
    specray plan manifests/quickstart.yaml [--device cuda --gpu-memory 80GiB] [section.field=value …]   (memory, bytes)
    specray inspect runs/capture-quickstart/manifest.parquet [--verify]
    specray registry list|publish EXPORT|pin N|unpin|rollback|status (--uri URI | -c SERVE_CONFIG)
    specray bench capture --json bench/capture.json [-c CONFIG] [--repeats 3] [overrides …]
    specray bench train --json bench/train.json [-c CONFIG] [overrides …]
    specray bench load --drafter EXPORT_DIR --clients 4 --minutes 2 --json bench/load.json [-c SERVE_CONFIG] [overrides …]
    specray --version   (the package version, and the git commit when run from a checkout)

Config mistakes, bad data and bad paths exit with status 2 and a one-paragraph message that
names the field and the fix; ``inspect --verify`` lists every missing or corrupt blob and
exits with status 1; anything else is a bug and keeps its traceback.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from specray.capture.defaults import DEFAULT_TARGET

# ConfigError and ContractMismatchError are ValueErrors: nothing heavy is imported to catch them (`--help`
# answers at once because the commands import torch, transformers and Ray only when they run).
USER_ERRORS = (ValueError, FileExistsError, FileNotFoundError)


def _cmd_capture(args: argparse.Namespace) -> int:
    from specray.pipeline.config import CaptureJobConfig, load_config
    from specray.pipeline.jobs.capture import run_capture

    cfg = load_config(CaptureJobConfig, args.config, args.overrides)
    summary = run_capture(cfg, progress=not args.quiet)
    print(summary.table())
    return 0


def _cmd_train(args: argparse.Namespace) -> int:
    from specray.pipeline.config import TrainJobConfig, load_config
    from specray.pipeline.jobs.train import run_training

    cfg = load_config(TrainJobConfig, args.config, args.overrides)
    summary = run_training(cfg, progress=not args.quiet)
    print(summary.table())
    return 0


def _cmd_export(args: argparse.Namespace) -> int:
    from specray.trainer.export import export_checkpoint

    if args.format == "specray":
        if args.verifier is not None:
            raise ValueError("--verifier names the verifier in a peer format's config; use it with "
                             "--format speculators or --format sglang")
        out = export_checkpoint(args.checkpoint, args.out)
        print(f"exported   {out}")
        return 0
    from specray.trainer.export import write_peer_format

    source = Path(args.checkpoint)
    if not (source / "export.json").is_file():  # a checkpoint: our export first, where `specray export` puts it
        source = export_checkpoint(source)
        print(f"exported   {source}")
    out, record = write_peer_format(args.format, source, args.out or f"{source}-{args.format}", target=args.target,
                                    verifier=args.verifier)
    print(f"exported   {out} ({record['format']}; verifier {record['verifier']})")
    for command in record["serve_commands"]:
        print(f"serve      {command}")
    return 0


def _cmd_import(args: argparse.Namespace) -> int:
    import json

    from specray.drafters.peer_import import import_peer, is_peer_directory

    if not is_peer_directory(args.source):
        if (Path(args.source) / "config.json").is_file():
            raise ValueError(f"{args.source} is already a specray export; evaluate, serve or fine-tune it as it is")
        raise FileNotFoundError(f"{args.source} has no config.json: give a drafter directory (speculators, SGLang / "
                                "SpecForge or z-lab format)")
    out = import_peer(args.source, args.out, target=args.target, capture_dtype=args.capture_dtype)
    provenance = json.loads((out / "export.json").read_text())
    config = json.loads((out / "config.json").read_text())
    print(f"imported   {out} from {provenance['imported_format']} {config['algorithm']} ({args.source}) for "
          f"{provenance['target']}: layers {config['capture_contract']['layer_ids']}")
    print(f"checked    {'; '.join(provenance['import_checks'])}")
    return 0


def _cmd_push(args: argparse.Namespace) -> int:
    from huggingface_hub.errors import HfHubHTTPError

    from specray.trainer.hub import PushVerificationError, push_export

    try:
        result = push_export(args.export, args.repo, revision=args.revision, private=args.private, token=args.token,
                             endpoint=args.endpoint)
    except HfHubHTTPError as e:  # refused by the Hub: a token, a repo id or a permission to fix
        print(f"specray push: error: the Hub refused the push: {e}", file=sys.stderr)
        return 2
    except PushVerificationError as e:
        print(f"specray push: verification failed: {e}", file=sys.stderr)
        return 1
    print(f"pushed     {args.export} -> {result.repo_id}@{result.revision} (commit {result.commit[:12]})")
    for name, info in sorted(result.files.items()):
        print(f"verified   {name:<24} {info['size']:>12} bytes  {info['sha256']}")
    print(f"url        {result.url}")
    return 0


def _cmd_evaluate(args: argparse.Namespace) -> int:
    import json
    import os

    from specray.capture.store import read_manifest
    from specray.drafters.peer_import import is_peer_directory
    from specray.pipeline.config import ConfigError, apply_overrides
    from specray.pipeline.jobs.train import evaluate_export

    if is_peer_directory(args.export):  # imported under the dtype the features it is evaluated on are stored in
        dtype = "bfloat16" if args.manifest is None else read_manifest(args.manifest, endpoint_url=args.endpoint_url) \
            .contract.dtype
        args.export = _drafter_dir(args.export, args.target, capture_dtype=dtype)
    if args.manifest is None and not args.live:  # the default: the target's own answers to held-out prompts
        from specray.pipeline.jobs.heldout import heldout_manifest

        args.manifest = heldout_manifest(args.target, args.export)
        print(f"held-out   {args.manifest} (the target's greedy answers to held-out ShareGPT prompts)")
    overrides = apply_overrides({}, args.overrides)
    if set(overrides) - {"objective"}:
        raise ConfigError(f"evaluate takes objective.field=value overrides only, got {sorted(overrides)}")
    result = {"export": str(args.export)}
    if args.manifest is not None:
        result.update(evaluate_export(args.export, args.manifest, target_name=args.target,
                                      endpoint_url=args.endpoint_url, objective=overrides.get("objective")))
        acc = " ".join(f"{a:.3f}" for a in result["acc_by_pos"])
        print(f"samples    {result['samples']}\nloss       {result['loss']:.4f}\n"
              f"acc by pos {acc}\ntau_tf     {result['tau_tf']:.3f}\ncoverage   {result['coverage']:.3f} "
              "(labels inside the drafter's vocabulary)")
    if args.live:
        result.update(_live_evaluation(args))
    if os.access(args.export, os.W_OK):  # the export's evaluation.json and model card record it
        from specray.drafters.card import record_evaluation

        print(f"recorded   {record_evaluation(args.export, result)} (evaluation.json)")
    else:
        print(f"note       {args.export} is not writable: its model card does not record this evaluation")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    return 0


def _drafter_dir(path: str, target_name: str, *, capture_dtype: str = "bfloat16") -> str:
    """``path``, or the export a peer drafter's directory imports to for ``target_name`` (cached)."""
    from specray.drafters.peer_import import as_export, is_peer_directory

    if path is None or not is_peer_directory(path):
        return path
    from specray.capture.target import load_target

    export = as_export(path, load_target(target_name), capture_dtype=capture_dtype)
    print(f"imported   {path} -> {export}")
    return str(export)


def _live_evaluation(args: argparse.Namespace) -> dict:
    """``evaluate --live``: the export's free-running acceptance on the serving engine (serving/live_eval.py)."""
    from specray.capture.target import load_target
    from specray.serving.live_eval import LiveEvalSettings, LiveEvaluator, live_table

    settings = LiveEvalSettings(dataset=args.dataset, num_prompts=args.num_prompts, max_tokens=args.max_tokens,
                                num_speculative_tokens=args.num_speculative_tokens, batch_size=args.batch_size)
    live = LiveEvaluator(load_target(args.target), settings).measure_export(args.export)
    print(live_table(live))
    return live


def _cmd_calibrate(args: argparse.Namespace) -> int:
    import json

    from specray.pipeline.jobs.calibrate import calibrate_export, calibration_table

    result = calibrate_export(args.export, args.manifest, target_name=args.target, endpoint_url=args.endpoint_url,
                              bins=args.bins)
    print(calibration_table(result))
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    return 0


def _cmd_generate(args: argparse.Namespace) -> int:
    import time

    from specray.capture.target import load_target
    from specray.serving.engine import Engine
    from specray.serving.sampling import SamplingParams

    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                            top_k=args.top_k, seed=args.seed)
    drafter = _drafter_dir(args.drafter, args.target)
    engine = Engine(load_target(args.target, dtype=args.dtype), drafter, max_batch=max(1, len(args.prompt)),
                    max_len=args.max_len, **_speculation_options(args))
    start = time.perf_counter()
    outputs = engine.generate(args.prompt, params)
    seconds = time.perf_counter() - start
    for out in outputs:
        print(out.text)
        print(f"-- {len(out.token_ids)} tokens, finish={out.finish_reason}, tau={out.tau:.2f}, rounds={out.rounds}")
    tokens = sum(len(o.token_ids) for o in outputs)
    mode = f"{engine.versions.active.algorithm} {args.drafter}" if args.drafter else "autoregressive"
    print(f"-- {tokens / seconds:.1f} tokens/s ({mode})")
    return 0


def _speculation_options(args: argparse.Namespace) -> dict:
    """The Engine options of ``_add_speculation_args``."""
    return {"num_speculative_tokens": args.num_speculative_tokens, "max_speculative_batch": args.max_speculative_batch,
            "speculation": args.speculation, "tree": args.tree, "cost_table": args.cost_table}


def _add_speculation_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"],
                        help="the target's weights; bfloat16 is faster on CPUs with AVX-512 BF16, but its greedy "
                             "output is not token-exact against transformers in bfloat16 (fp32 is)")
    parser.add_argument("--num-speculative-tokens", type=int, default=None,
                        help="the largest round: drafts verified (a chain) or tree depth (default: the worker's, "
                             "e.g. DFlash's block size - 1)")
    parser.add_argument("--speculation", choices=["auto", "static"], default="auto",
                        help="auto: each round's size from the cost table and measured acceptance (0 = a plain "
                             "step when no round pays); static: always the largest")
    parser.add_argument("--max-speculative-batch", type=int, default=None,
                        help="an upper bound: a larger batch takes plain steps (default: none)")
    parser.add_argument("--tree", action="store_true", help="draft trees (EAGLE-2 dynamic trees for EAGLE-3)")
    parser.add_argument("--cost-table", default=None,
                        help="a table from `specray profile` (default: measured when the drafter is loaded)")


def _cmd_profile(args: argparse.Namespace) -> int:
    from specray.pipeline.bench.profile import profile_machine

    profile_machine(args.target, args.out, dtype=args.dtype, batch_sizes=tuple(args.batch_sizes), rows=tuple(args.rows),
                    context_tokens=args.context_tokens, repeats=args.repeats, force=args.force)
    return 0


def _cmd_serve(args: argparse.Namespace) -> int:
    import time

    from specray.actors.serve import start_serving
    from specray.pipeline.config import ServeJobConfig, load_config

    cfg = load_config(ServeJobConfig, args.config, args.overrides)
    handle = start_serving(cfg)
    print(f"serving    {handle.model} at {handle.base_url} ({'API key required' if handle.api_key else 'no API key'}); "
          f"Ctrl-C stops", flush=True)
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        print("stopping", flush=True)
    finally:
        handle.stop()
    return 0


def _cmd_pipeline(args: argparse.Namespace) -> int:
    import time

    from specray.pipeline.config import PipelineConfig, load_config
    from specray.pipeline.jobs import run_manifest

    cfg = load_config(PipelineConfig, args.manifest, args.overrides)
    report, handle = run_manifest(cfg, progress=not args.quiet, resume=args.resume)
    print(report.table(), flush=True)
    if handle is None:
        return 0
    print(f"serving    {handle.model} at {handle.base_url}; Ctrl-C stops", flush=True)
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        print("stopping", flush=True)
    finally:
        handle.stop()
    return 0


def _cmd_plan(args: argparse.Namespace) -> int:
    from specray.pipeline.config import PipelineConfig, load_config
    from specray.pipeline.jobs.plan import parse_bytes, plan, plan_table, write_json

    cfg = load_config(PipelineConfig, args.manifest, args.overrides)
    gpu_memory = parse_bytes(args.gpu_memory) if args.gpu_memory else None
    stages = plan(cfg, device=args.device, gpu_memory=gpu_memory, tokens_per_sample=args.tokens_per_sample)
    print(plan_table(stages))
    if args.json:
        write_json(stages, args.json)
    return 0


def _cmd_regenerate(args: argparse.Namespace) -> int:
    from specray.pipeline.jobs.regenerate import regenerate
    from specray.serving.sampling import SamplingParams

    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, seed=args.seed)
    exclude = () if args.exclude == "none" else tuple(x for x in args.exclude.split(",") if x)
    summary = regenerate(target_name=args.target, dataset=args.dataset, num=args.num, out=args.out, skip=args.skip,
                         batch_size=args.batch_size, max_prompt_tokens=args.max_prompt_tokens, max_turns=args.max_turns,
                         exclude=exclude, mix=args.mix, params=params, progress=not args.quiet)
    sel, lengths = summary["selection"], summary["answers"] or {}
    rate = "n/a" if summary["tokens_per_s"] is None else f"{summary['tokens_per_s']:.1f}"
    print(f"wrote {summary['written']} conversations ({summary['tokens']} answer tokens, {rate} tokens/s) to "
          f"{summary['out']}; already there {summary['already_there']}, prompts too long {summary['too_long']}")
    print(f"selection: read {sel['read']}, excluded {sel['excluded']} overlapping {sel['eval_prompts_checked']} eval "
          f"prompts ({', '.join(exclude) or 'none'}), kinds {sel['kinds']}"
          + (f", short of {sel['short_of']}" if sel["short_of"] else ""))
    for train_id, eval_id in sel["excluded_examples"]:
        print(f"  excluded {train_id}: overlaps {eval_id}")
    if lengths:
        print(f"answers: {lengths['answers']} in {lengths['conversations']} conversations ({lengths['multi_turn']} "
              f"multi-turn), median {lengths['median_tokens_per_answer']} tokens, cut at --max-tokens "
              f"{lengths['cut_share']:.1%}")
    return 0


def _mix(text: str) -> dict[str, float]:
    """``chat=0.5,code=0.3,reasoning=0.2`` → shares, checked as the manifest's regenerate.mix is."""
    from specray.pipeline.config import RegenerateSection

    try:
        shares = {k.strip(): float(v) for k, v in (part.split("=") for part in text.split(","))}
        return RegenerateSection(mix=shares).mix
    except (ValueError, TypeError) as e:
        raise argparse.ArgumentTypeError(f"--mix {text!r}: use kind=share pairs over chat, code, reasoning summing "
                                         f"to 1, e.g. chat=0.5,code=0.3,reasoning=0.2 ({e})") from None


def _cmd_merge_manifests(args: argparse.Namespace) -> int:
    from specray.capture.store import merge_manifests

    merged = merge_manifests(args.manifests, args.out, endpoint_url=args.endpoint_url)
    print(f"manifest   {args.out}: {len(merged.refs)} samples, {merged.num_tokens} tokens from {len(args.manifests)} "
          f"manifests (store {merged.store_uri})")
    return 0


def _cmd_inspect(args: argparse.Namespace) -> int:
    from specray.capture.store import FeatureChecksumError, FeatureNotFoundError, FeatureStore, read_manifest

    manifest = read_manifest(args.manifest)
    c = manifest.contract
    tokens = manifest.num_tokens
    num_bytes = sum(r.num_bytes for r in manifest.refs)
    print(f"manifest   {args.manifest}")
    print(f"store      {manifest.store_uri}")
    print(f"contract   {c.contract_id}: {c.algorithm}, layers {list(c.layer_ids)} ({c.capture_point}), "
          f"last_hidden={c.last_hidden}, {c.dtype}, D={c.hidden_size}")
    print(f"target     {c.target_fingerprint}")
    print(f"template   {c.template_fingerprint}")
    print(f"samples    {len(manifest.refs)}, {tokens} tokens, {num_bytes / max(tokens, 1):.1f} bytes/token")
    if not args.verify:
        return 0
    store = FeatureStore(manifest.store_uri, endpoint_url=args.endpoint_url)
    bad = 0
    for ref in manifest.refs:
        try:
            store.get(ref)
        except (FeatureChecksumError, FeatureNotFoundError) as e:
            bad += 1
            print(f"BAD        {e}", file=sys.stderr)
    if bad:
        print(f"verify     {bad} of {len(manifest.refs)} blobs missing or corrupt", file=sys.stderr)
        return 1
    print(f"verified   {len(manifest.refs)} blobs: sizes and sha256 match")
    return 0


def _cmd_bench(args: argparse.Namespace) -> int:
    from specray.pipeline.bench.common import write_json
    from specray.pipeline.config import CaptureJobConfig, TrainJobConfig, load_config

    if args.benchmark == "serve" and (len(args.drafter or []) > 1 or len(args.dataset) > 1):
        from specray.pipeline.bench.drafters import bench_drafters, drafters_table, parse_drafters

        unused = [flag for flag, given in (("--png", args.png), ("--static-sizes", args.static_sizes), ("--tree", args.tree),
                                           ("--no-transformers", args.no_transformers)) if given]
        if unused:
            raise ValueError(f"{', '.join(unused)}: options of a single drafter on one dataset; several drafters or "
                             "datasets run our AR, each drafter and vLLM only (drop them)")
        result = bench_drafters(target_name=args.target, drafters=parse_drafters(args.drafter or []),
                                datasets=tuple(args.dataset), num_prompts=args.num_prompts, max_tokens=args.max_tokens,
                                batch_sizes=tuple(args.batch_sizes), repeats=args.repeats, vllm=not args.no_vllm,
                                vllm_drafter=args.vllm_drafter, dtype=args.dtype,
                                num_speculative_tokens=args.num_speculative_tokens,
                                max_speculative_batch=args.max_speculative_batch, speculation=args.speculation,
                                cost_table=args.cost_table)
        table = drafters_table(result)
    elif args.benchmark == "serve":
        from specray.pipeline.bench import serve as serve_bench
        from specray.pipeline.bench.drafters import parse_drafters

        if args.vllm_drafter is not None:
            raise ValueError("--vllm-drafter picks one of several --drafter labels; with one drafter vLLM serves it")
        drafter = next(iter(parse_drafters(args.drafter).values())) if args.drafter else None
        result = serve_bench.bench_serve(target_name=args.target, drafter_dir=drafter, dataset=args.dataset[0],
                                   num_prompts=args.num_prompts, max_tokens=args.max_tokens,
                                   batch_sizes=tuple(args.batch_sizes), png=args.png, repeats=args.repeats,
                                   vllm=not args.no_vllm, transformers=not args.no_transformers, dtype=args.dtype, static_sizes=tuple(args.static_sizes),
                                   **_speculation_options(args))
        table = serve_bench.serve_table(result)
    elif args.benchmark == "load":
        from specray.pipeline.bench.load import LoadBenchOptions, bench_load, load_table

        given = {k: getattr(args, k) for k in LoadBenchOptions.model_fields if getattr(args, k, None) is not None}
        result = bench_load(LoadBenchOptions(**given), args.config, args.overrides)
        table = load_table(result)
    elif args.benchmark == "fidelity":
        from specray.capture.target import load_target
        from specray.pipeline.bench.fidelity import fidelity, fidelity_table

        result = fidelity(load_target(args.target), args.export, dataset=args.dataset, num_prompts=args.num_prompts,
                          max_tokens=args.max_tokens, num_speculative_tokens=args.num_speculative_tokens,
                          capture_dtype=args.capture_dtype, heldout=args.heldout, endpoint_url=args.endpoint_url)
        table = fidelity_table(result)
    elif args.benchmark == "step":
        from specray.capture.target import load_target
        from specray.pipeline.bench.step import bench_step, step_table

        result = bench_step(load_target(args.target, dtype=args.dtype), batch_sizes=tuple(args.batch_sizes),
                            rows=args.rows, context_tokens=args.context_tokens, repeats=args.repeats)
        table = step_table(result)
    elif args.benchmark == "capture":
        from specray.pipeline.bench import capture

        cfg = load_config(CaptureJobConfig, args.config, capture.BENCH_CAPTURE_DEFAULTS + args.overrides)
        result = capture.bench_capture(cfg, repeats=args.repeats)
        table = capture.capture_table(result)
    else:
        from specray.pipeline.bench import train

        overrides = ["data.manifest=auto"] + train.BENCH_TRAIN_DEFAULTS + args.overrides
        cfg = load_config(TrainJobConfig, args.config, overrides)
        result = train.bench_train(cfg)
        table = train.train_table(result)
    result["command"] = "specray " + " ".join(args.argv)
    write_json(result, args.json)
    print(table)
    if args.json:
        print(f"wrote {args.json}")
    return 0


def _cmd_registry_open(args: argparse.Namespace):
    """The registry ``specray registry`` works on: ``--uri``, or a serve manifest's ``registry`` section."""
    from specray.pipeline.config import ConfigError, ServeJobConfig, load_config
    from specray.serving.registry import DrafterRegistry

    if args.uri is None and args.config is None:
        raise ConfigError("name the registry: --uri PATH|file://…|s3://BUCKET/PREFIX, or -c a serve manifest "
                          "(its registry.uri)")
    if args.uri is not None:
        return DrafterRegistry(args.uri, endpoint_url=args.endpoint_url)
    section = load_config(ServeJobConfig, args.config, []).registry
    if section.uri is None:
        raise ConfigError(f"{args.config} has no registry.uri; set it, or pass --uri")
    return DrafterRegistry(section.uri, endpoint_url=args.endpoint_url or section.endpoint_url)


def _cmd_registry_time(unix: float | None) -> str:
    import time

    return "-" if not unix else time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(unix))


def _cmd_registry(args: argparse.Namespace) -> int:
    import json

    registry = _cmd_registry_open(args)
    action = {"list": _cmd_registry_list, "publish": _cmd_registry_publish, "pin": _cmd_registry_pin,
              "unpin": _cmd_registry_unpin, "rollback": _cmd_registry_rollback,
              "status": _cmd_registry_status}[args.action]
    result = action(registry, args)
    if getattr(args, "json", False):
        print(json.dumps(result, indent=2))
    return 0


def _cmd_registry_list(registry, args: argparse.Namespace) -> dict:
    """Every complete version: when it was published, its bytes, whether it is pinned, rejected or served."""
    import time

    from specray.serving.poller import stale_after_s

    pinned, rejections = registry.pinned(), registry.rejections()
    serving: dict = {}  # version -> replicas serving it (reports that are not stale)
    for report in registry.replicas():
        if time.time() - report.get("reported_at", 0) <= stale_after_s(report):
            serving[report.get("version")] = serving.get(report.get("version"), 0) + 1
    rows = []
    for version in registry.versions():
        marker = registry.describe(version)
        state = [f"rejected ({r.scope}: {r.reason[:60]})" for r in rejections.get(version, [])]
        state += ["pinned"] if version == pinned else []
        state += [f"served by {serving[version]}"] if version in serving else []
        rows.append({"version": version, "published_at": marker.get("published_at"), "source": marker.get("source"),
                     "bytes": sum(marker.get("files", {}).values()), "state": state or ["good"]})
    if not args.json:
        print(f"registry   {registry.uri} ({'pinned to ' + str(pinned) if pinned else 'not pinned'})")
        print(f"{'version':>8}  {'published':19}  {'bytes':>11}  state / source")
        for r in rows:
            print(f"{r['version']:>8}  {_cmd_registry_time(r['published_at']):19}  {r['bytes']:>11}  "
                  f"{', '.join(r['state'])}  {r['source']}")
    return {"uri": registry.uri, "pinned": pinned, "versions": rows}


def _cmd_registry_publish(registry, args: argparse.Namespace) -> dict:
    version = registry.publish(args.export)
    print(f"published  {args.export} as version {version} of {registry.uri}")
    return {"version": version}


def _cmd_registry_pin(registry, args: argparse.Namespace) -> dict:
    registry.pin(args.version, reason=args.reason)
    print(f"pinned     version {args.version}: replicas serve it at their next poll, whatever is published after it")
    return {"pinned": args.version}


def _cmd_registry_unpin(registry, args: argparse.Namespace) -> dict:
    was = registry.unpin()
    what = f"version {was}" if was else "nothing was pinned"
    print(f"unpinned   {what}: replicas serve the newest good version")
    return {"unpinned": was}


def _cmd_registry_rollback(registry, args: argparse.Namespace) -> dict:
    """Reject the newest version no scope rejects, for every replica; they fall back to the one before."""
    from specray.serving.registry import OPERATOR

    pinned = registry.pinned()
    if pinned is not None:
        raise ValueError(f"version {pinned} is pinned, so replicas serve it whatever is rejected; pin another version "
                         "(specray registry pin N) or unpin first")
    rejected = registry.rejections()
    good = [v for v in registry.versions() if v not in rejected]
    if not good:
        raise ValueError(f"{registry.uri} has no version to roll back: every version is rejected or none is published")
    registry.reject(good[-1], OPERATOR, args.reason or "rolled back", by="operator")
    after = f"version {good[-2]}" if len(good) > 1 else "the drafter they started with (no good version is left)"
    print(f"rolled back version {good[-1]} (rejected for every replica; `specray registry pin {good[-1]}` serves it "
          f"again): replicas fall back to {after}")
    return {"rejected": good[-1], "serving": good[-2] if len(good) > 1 else None}


def _cmd_registry_status(registry, args: argparse.Namespace) -> dict:
    """Every replica's last report: the version it serves, its live tau, what it is loading, its last error."""
    import time

    from specray.serving.poller import stale_after_s

    pinned, rejected, now = registry.pinned(), registry.rejections(), time.time()
    good = [v for v in registry.versions() if v not in rejected]
    replicas = []
    for r in registry.replicas():
        age = now - r.get("reported_at", 0)
        state = "gone" if age > stale_after_s(r) else f"loading v{r['loading']}" if r.get("loading") else "serving"
        replicas.append({**r, "state": state, "age_s": round(age, 1)})
    if not args.json:
        print(f"registry   {registry.uri}: newest good version {good[-1] if good else None}, "
              f"{'pinned to ' + str(pinned) if pinned else 'not pinned'}")
        print(f"{'replica':24}  {'version':>7}  {'tau':>6}  {'state':14}  {'report':>8}  last error")
        for r in replicas:
            tau = "-" if r.get("tau") is None else f"{r['tau']:.3f}"
            version = "ar" if r.get("version") is None else r["version"]
            print(f"{r['replica'][:24]:24}  {version!s:>7}  {tau:>6}  {r['state']:14}  {r['age_s']:>6.0f} s  "
                  f"{(r.get('last_error') or '-')[:100]}")
    return {"uri": registry.uri, "pinned": pinned, "newest_good": good[-1] if good else None, "replicas": replicas}


class _VersionAction(argparse.Action):
    """``--version``: computed when asked (git runs only then), printed, exit 0."""

    def __init__(self, option_strings, dest=argparse.SUPPRESS, default=argparse.SUPPRESS, help=None):
        super().__init__(option_strings, dest=dest, default=default, nargs=0, help=help)

    def __call__(self, parser, namespace, values, option_string=None):
        from specray.pipeline.version import version_string

        print(version_string())
        parser.exit()


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="specray", description="capture -> train -> export -> serve for speculative drafters")
    parser.add_argument("--version", action=_VersionAction,
                        help="print the package version (and the git commit when run from a checkout) and exit")
    sub = parser.add_subparsers(dest="command", required=True)

    capture = sub.add_parser("capture", help="capture target features into a store and write a manifest")
    capture.add_argument("-c", "--config", help="YAML run manifest (e.g. manifests/capture-quickstart.yaml)")
    capture.add_argument("-q", "--quiet", action="store_true", help="no progress bar")
    capture.add_argument("overrides", nargs="*", metavar="section.field=value")
    capture.set_defaults(fn=_cmd_capture)

    train = sub.add_parser("train", help="train a drafter on a captured manifest")
    train.add_argument("-c", "--config", help="YAML run manifest (e.g. manifests/train-dflash-quickstart.yaml)")
    train.add_argument("-q", "--quiet", action="store_true", help="no progress bar")
    train.add_argument("overrides", nargs="*", metavar="section.field=value")
    train.set_defaults(fn=_cmd_train)

    export = sub.add_parser("export", help="turn a training checkpoint into a drafter directory for serving")
    export.add_argument("checkpoint", help="a run dir (its latest checkpoint), a checkpoints dir, or a step-* dir; "
                                           "with a peer --format also an export directory")
    export.add_argument("--out", default=None, help="export directory (default <run_dir>/exports/step-N; "
                                                    "a peer format: <export>-<format>)")
    export.add_argument("--format", choices=("specray", "speculators", "sglang"), default="specray",
                        help="specray: our serving format; speculators: the format vLLM and the speculators "
                             "package load (drafters/peer.py); sglang: EAGLE-3 as LlamaForCausalLMEagle3, the "
                             "DFlash family in z-lab's format, as SGLang loads them (drafters/sglang.py)")
    export.add_argument("--target", default=None, help="peer formats: the target the drafter was trained for "
                                                       "(default: the one named in its export.json)")
    export.add_argument("--verifier", default=None,
                        help="peer formats: the verifier the config and model card name, a Hugging Face id or a path "
                             "(default: the target's recorded name in export.json)")
    export.set_defaults(fn=_cmd_export)

    imp = sub.add_parser("import", help="a drafter in a peer format (speculators, SGLang / SpecForge EAGLE-3, z-lab "
                                        "DFlash family) as a specray export, checked against the target")
    imp.add_argument("source", help="the peer drafter's directory (config.json + safetensors)")
    imp.add_argument("--out", required=True, help="the export directory to write")
    imp.add_argument("--target", default=None, help="the target it drafts for (default: the verifier a speculators "
                                                    "config names; SGLang and z-lab configs name none)")
    imp.add_argument("--capture-dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"],
                     help="the feature dtype its capture contract records (what a fine-tune's capture stores)")
    imp.set_defaults(fn=_cmd_import)

    push = sub.add_parser("push", help="upload an export (ours or a peer format's) with its model card to a Hugging "
                                       "Face Hub model repo, then verify every file's size and hash there")
    push.add_argument("export", help="an export directory (specray export, with or without --format)")
    push.add_argument("--repo", required=True, help="the model repo id, e.g. me/qwen3-8b-dflash (created if missing)")
    push.add_argument("--revision", default=None, help="the branch to commit to (default main; created if missing)")
    push.add_argument("--private", action="store_true", help="create the repo private")
    push.add_argument("--token", default=None, help="a Hub token with write access (default $HF_TOKEN or the saved login)")
    push.add_argument("--endpoint", default=None, help="the Hub's URL (default $HF_ENDPOINT, else huggingface.co)")
    push.set_defaults(fn=_cmd_push)

    evaluate = sub.add_parser("evaluate", help="teacher-forced per-position accuracy of an export on a manifest "
                                               "(--manifest) and its live acceptance on the serving engine (--live)")
    evaluate.add_argument("export", help="an exported drafter directory")
    evaluate.add_argument("--manifest", default=None,
                          help="features to evaluate on (default without --live: the target's own greedy answers to "
                               "held-out ShareGPT prompts under the export's contract, built on first use and cached; "
                               "pipeline/jobs/heldout.py)")
    evaluate.add_argument("--live", action="store_true",
                          help="decode held-out prompts greedily on the serving engine, verifying the largest round "
                               "every round: tau_live and acceptance by position (as `specray bench serve` measures)")
    evaluate.add_argument("--dataset", default="mtbench", help="--live prompts: mtbench, humaneval or jsonl:PATH")
    evaluate.add_argument("--num-prompts", type=int, default=16, help="--live: prompts decoded")
    evaluate.add_argument("--max-tokens", type=int, default=32, help="--live: new tokens per prompt")
    evaluate.add_argument("--num-speculative-tokens", type=int, default=None,
                          help="--live: drafts verified every round (default: the worker's largest)")
    evaluate.add_argument("--batch-size", type=int, default=4, help="--live: prompts decoded at once")
    evaluate.add_argument("--target", default=DEFAULT_TARGET, help="the target the export was trained for")
    evaluate.add_argument("overrides", nargs="*", metavar="objective.field=value",
                          help="the strategy's objective for evaluation (default: its evaluation settings, "
                               "e.g. DFlash samples 64 anchors per sample)")
    evaluate.add_argument("--endpoint-url", default=None)
    evaluate.add_argument("--json", help="also write the result here")
    evaluate.set_defaults(fn=_cmd_evaluate)

    calibrate = sub.add_parser("calibrate", help="fit DSpark's confidence temperatures on held-out features "
                                                 "(writes calibration.json into the export)")
    calibrate.add_argument("export", help="an exported DSpark drafter directory")
    calibrate.add_argument("--manifest", required=True, help="held-out features (not the training capture)")
    calibrate.add_argument("--target", default=DEFAULT_TARGET, help="the target the export was trained for")
    calibrate.add_argument("--bins", type=int, default=10, help="bins of the calibration error reported")
    calibrate.add_argument("--endpoint-url", default=None)
    calibrate.add_argument("--json", help="also write the result here")
    calibrate.set_defaults(fn=_cmd_calibrate)

    generate = sub.add_parser("generate", help="generate with the engine (a drafter makes it speculative)")
    generate.add_argument("--prompt", action="append", required=True, help="a user message (repeat for a batch)")
    generate.add_argument("--drafter", default=None, help="an exported drafter directory (omit for autoregressive)")
    generate.add_argument("--target", default=DEFAULT_TARGET)
    generate.add_argument("--max-tokens", type=int, default=128)
    generate.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    generate.add_argument("--top-p", type=float, default=1.0)
    generate.add_argument("--top-k", type=int, default=0)
    generate.add_argument("--seed", type=int, default=None)
    generate.add_argument("--max-len", type=int, default=2048, help="KV capacity per request")
    _add_speculation_args(generate)
    generate.set_defaults(fn=_cmd_generate)

    from specray.serving.cost_grid import DEFAULT_BATCH_SIZES, DEFAULT_CONTEXT_TOKENS, DEFAULT_ROWS

    prof = sub.add_parser("profile", help="measure the target's forward time by batch size and rows (the cost table "
                                          "the engine sizes speculative rounds with)")
    prof.add_argument("--out", required=True, help="the cost table (JSON) to write")
    prof.add_argument("--target", default=DEFAULT_TARGET)
    prof.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    prof.add_argument("--batch-sizes", type=int, nargs="+", default=list(DEFAULT_BATCH_SIZES))
    prof.add_argument("--rows", type=int, nargs="+", default=list(DEFAULT_ROWS), help="rows per request")
    prof.add_argument("--context-tokens", type=int, default=DEFAULT_CONTEXT_TOKENS,
                      help="committed tokens per request while timing")
    prof.add_argument("--repeats", type=int, default=5, help="timings per entry (median)")
    prof.add_argument("--force", action="store_true", help="replace a table from another machine description")
    prof.set_defaults(fn=_cmd_profile)

    pipeline = sub.add_parser("pipeline", help="the whole pipeline on Ray: capture, train, export, serve, bench")
    pipeline_sub = pipeline.add_subparsers(dest="action", required=True)
    pipeline_run = pipeline_sub.add_parser("run", help="run a pipeline manifest; writes runs/<name>/report.json")
    pipeline_run.add_argument("manifest", help="YAML pipeline manifest (e.g. manifests/quickstart.yaml)")
    pipeline_run.add_argument("-q", "--quiet", action="store_true", help="no progress bars")
    pipeline_run.add_argument("--resume", action="store_true",
                              help="continue an interrupted run in its run dir (reuse a finished capture, resume "
                                   "the trainer from its newest checkpoint and the ledger) instead of replacing it")
    pipeline_run.add_argument("overrides", nargs="*", metavar="section.field=value")
    pipeline_run.set_defaults(fn=_cmd_pipeline)

    plan_cmd = sub.add_parser("plan", help="each stage's memory and bytes for a pipeline manifest, without running "
                                           "anything (pipeline/jobs/plan.py)")
    plan_cmd.add_argument("manifest", help="YAML pipeline manifest (e.g. manifests/quickstart.yaml)")
    plan_cmd.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto",
                          help="size the run for this device: bf16 target and autocast on cuda, fp32 on cpu "
                               "(auto: cuda when this machine has a GPU)")
    plan_cmd.add_argument("--gpu-memory", default=None, help="memory of one GPU, e.g. 80GiB: marks each device "
                                                             "stage as fitting or not")
    plan_cmd.add_argument("--tokens-per-sample", type=int, default=None,
                          help="mean tokens of a sample (default: data.max_length, an upper bound)")
    plan_cmd.add_argument("--json", help="also write the stages here")
    plan_cmd.add_argument("overrides", nargs="*", metavar="section.field=value")
    plan_cmd.set_defaults(fn=_cmd_plan)

    serve_cmd = sub.add_parser("serve", help="OpenAI-compatible Ray Serve replicas that hot-load drafters")
    serve_cmd.add_argument("-c", "--config", help="YAML serve manifest (e.g. manifests/serve.yaml)")
    serve_cmd.add_argument("overrides", nargs="*", metavar="section.field=value")
    serve_cmd.set_defaults(fn=_cmd_serve)

    reg = sub.add_parser("registry", help="operate a drafter registry: versions, publish, pin, rollback, replicas")
    reg_sub = reg.add_subparsers(dest="action", required=True)
    for action, text in (("list", "every version: published when, bytes, pinned / rejected / served"),
                         ("publish", "publish an export directory as the next version (race-safe)"),
                         ("pin", "serve one version on every replica, whatever is newer"),
                         ("unpin", "serve the newest good version again"),
                         ("rollback", "reject the newest good version for every replica: they fall back to the one "
                                      "before (refused while a version is pinned)"),
                         ("status", "every replica: the version it serves, its live tau, what it loads")):
        p = reg_sub.add_parser(action, help=text)
        p.add_argument("--uri", default=None, help="the registry: a path, file://… or s3://BUCKET/PREFIX")
        p.add_argument("-c", "--config", default=None, help="a serve manifest whose registry section names it")
        p.add_argument("--endpoint-url", default=None,
                       help="S3 endpoint (else the manifest's, or $SPECRAY_S3_ENDPOINT)")
        if action in ("list", "status"):
            p.add_argument("--json", action="store_true", help="print JSON instead of a table")
        if action == "publish":
            p.add_argument("export", help="an export directory (specray export)")
        if action == "pin":
            p.add_argument("version", type=int)
        if action in ("pin", "rollback"):
            p.add_argument("--reason", default="", help="recorded with the pin or the rejection")
        p.set_defaults(fn=_cmd_registry)

    regen = sub.add_parser("regenerate", help="answer training prompts with the target itself (self-distillation)")
    regen.add_argument("--out", required=True, help="JSONL to append to (capture reads it as jsonl:PATH)")
    regen.add_argument("--dataset", default="sharegpt")
    regen.add_argument("--num", type=int, default=256, help="conversations to take")
    regen.add_argument("--skip", type=int, default=0, help="skip the first N conversations")
    regen.add_argument("--target", default=DEFAULT_TARGET)
    regen.add_argument("--batch-size", type=int, default=16, help="conversations answered at once")
    regen.add_argument("--max-tokens", type=int, default=1024, help="tokens per answer (longer ones are cut)")
    regen.add_argument("--max-prompt-tokens", type=int, default=1024,
                       help="a turn whose context is longer ends its conversation")
    regen.add_argument("--max-turns", type=int, default=1, help="user turns answered per conversation")
    regen.add_argument("--exclude", default="mtbench,humaneval",
                       help="eval datasets whose prompts are kept out, comma-separated, or none")
    regen.add_argument("--mix", type=_mix, default=None, help="prompt kinds' shares, e.g. chat=0.5,code=0.3,reasoning=0.2")
    regen.add_argument("--temperature", type=float, default=0.0)
    regen.add_argument("--seed", type=int, default=None)
    regen.add_argument("-q", "--quiet", action="store_true")
    regen.set_defaults(fn=_cmd_regenerate)

    merge = sub.add_parser("merge-manifests", help="one manifest from several of one contract and store "
                                                   "(a dataset captured in parts)")
    merge.add_argument("manifests", nargs="+")
    merge.add_argument("--out", required=True, help="the new manifest (manifests are immutable)")
    merge.add_argument("--endpoint-url", default=None, help="S3 endpoint for s3:// manifests")
    merge.set_defaults(fn=_cmd_merge_manifests)

    inspect = sub.add_parser("inspect", help="summarise a manifest; --verify re-reads every blob")
    inspect.add_argument("manifest")
    inspect.add_argument("--verify", action="store_true")
    inspect.add_argument("--endpoint-url", default=None, help="S3 endpoint for s3:// stores")
    inspect.set_defaults(fn=_cmd_inspect)

    bench = sub.add_parser("bench", help="benchmarks that write JSON and print a table")
    bench_sub = bench.add_subparsers(dest="benchmark", required=True)
    bench_capture = bench_sub.add_parser("capture", help="capture tokens/s vs plain forward, bytes/token")
    bench_capture.add_argument("--json", help="write the result here")
    bench_capture.add_argument("-c", "--config", help="capture YAML to start from (defaults: 32 ShareGPT samples, 512 tokens)")
    bench_capture.add_argument("--repeats", type=int, default=3)
    bench_capture.add_argument("overrides", nargs="*", metavar="section.field=value")
    bench_capture.set_defaults(fn=_cmd_bench)
    bench_serve = bench_sub.add_parser("serve", help="ours (AR, drafters) vs transformers generate / prompt lookup / vLLM; "
                                                        "several drafters and datasets side by side")
    bench_serve.add_argument("--json", help="write the result here")
    bench_serve.add_argument("--drafter", action="append", default=None, metavar="[LABEL=]DIR",
                             help="exported drafter (omit: AR baselines only); give it again for several drafters "
                                  "side by side (LABEL names each; default: its algorithm)")
    bench_serve.add_argument("--dataset", nargs="+", default=["mtbench"], choices=["mtbench", "humaneval"],
                             help="one or more prompt sets (several: the side-by-side run on each)")
    bench_serve.add_argument("--vllm-drafter", default=None, metavar="LABEL",
                             help="with several drafters, the one vLLM also serves (default: the first)")
    bench_serve.add_argument("--target", default=DEFAULT_TARGET)
    bench_serve.add_argument("--num-prompts", type=int, default=20)
    bench_serve.add_argument("--max-tokens", type=int, default=128)
    bench_serve.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 4])
    bench_serve.add_argument("--png", default=None, help="acceptance-by-position plot")
    bench_serve.add_argument("--repeats", type=int, default=1, help="timed passes per system (median; order alternates)")
    bench_serve.add_argument("--no-vllm", action="store_true", help="skip the vLLM runs even when vllm is importable")
    bench_serve.add_argument("--no-transformers", action="store_true",
                             help="skip transformers generate and prompt lookup (our systems and vLLM only)")
    _add_speculation_args(bench_serve)
    bench_serve.add_argument("--static-sizes", type=int, nargs="*", default=[],
                             help="also time the drafter at these fixed round sizes (specray-drafter-kN), to compare "
                                  "the automatic choice with a sweep")
    bench_serve.set_defaults(fn=_cmd_bench, config=None, overrides=[])
    bench_train = bench_sub.add_parser("train", help="training tokens/s and step time split")
    bench_train.add_argument("--json", help="write the result here")
    bench_train.add_argument("-c", "--config", help="train YAML to start from (default: the built-in defaults: 1 layer, B=8, micro-batch 2, 16 anchors)")
    bench_train.add_argument("overrides", nargs="*", metavar="section.field=value")
    bench_train.set_defaults(fn=_cmd_bench)
    bench_fid = bench_sub.add_parser("fidelity", help="teacher-forced accuracy against served acceptance, decomposed "
                                                      "(pipeline/bench/fidelity.py)")
    bench_fid.add_argument("export", help="an exported drafter directory")
    bench_fid.add_argument("--json", help="write the result (with every round's anchor and acceptance) here")
    bench_fid.add_argument("--dataset", default="mtbench", help="prompts: mtbench, humaneval or jsonl:PATH")
    bench_fid.add_argument("--target", default=DEFAULT_TARGET)
    bench_fid.add_argument("--num-prompts", type=int, default=16)
    bench_fid.add_argument("--max-tokens", type=int, default=64)
    bench_fid.add_argument("--num-speculative-tokens", type=int, default=None,
                           help="drafts verified every round (default: the worker's largest)")
    bench_fid.add_argument("--capture-dtype", default="bfloat16", help="the feature dtype training reads")
    bench_fid.add_argument("--heldout", default=None, help="a held-out manifest of the training distribution")
    bench_fid.add_argument("--endpoint-url", default=None, help="S3 endpoint when --heldout is on s3://")
    bench_fid.set_defaults(fn=_cmd_bench, config=None, overrides=[])
    bench_step = bench_sub.add_parser("step", help="where one target forward's time goes, by batch size: op kinds "
                                                   "and the product chain per kernel (pipeline/bench/step.py)")
    bench_step.add_argument("--json", help="write the result here")
    bench_step.add_argument("--target", default=DEFAULT_TARGET)
    bench_step.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    bench_step.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 4, 16])
    bench_step.add_argument("--rows", type=int, default=1, help="new rows per request (1: a decode step; 1 + k: a verify)")
    bench_step.add_argument("--context-tokens", type=int, default=256, help="committed tokens per request")
    bench_step.add_argument("--repeats", type=int, default=7, help="forwards per timing (median) and per profile")
    bench_step.set_defaults(fn=_cmd_bench, config=None, overrides=[])
    bench_load = bench_sub.add_parser("load", help="streaming OpenAI clients on Serve replicas while a new drafter, "
                                                   "a corrupt and an oversized one, a replica kill, an S3 outage and "
                                                   "a training stream happen (pipeline/bench/load.py)")
    bench_load.add_argument("--json", help="write the result here")
    bench_load.add_argument("--drafter", required=True, help="export the replicas serve first")
    bench_load.add_argument("--next-drafter", default=None, help="export hot-loaded mid-run (default: --drafter again)")
    bench_load.add_argument("-c", "--config", help="serve YAML to start from (e.g. manifests/serve.yaml)")
    for field, kind, text in (  # unset: LoadBenchOptions' defaults (pipeline/bench/load.py)
            ("clients", int, "concurrent streaming clients (4)"), ("minutes", float, "length of the run (2)"),
            ("max_tokens", int, "tokens per answer at most (64)"), ("replicas", int, "Serve replicas, >= 2 (2)"),
            ("num_prompts", int, "distinct prompts, each with an AR reference (16)"),
            ("retries", int, "retries of a failed attempt per request (2)"),
            ("publish_at", float, "fraction of the run at which the next drafter is published (0.25)"),
            ("bad_at", float, "... a corrupt export is published (0.5)"),
            ("kill_at", float, "... one replica is killed (0.75)"),
            ("oversized_at", float, "... an export claiming an oversized layer is published (0.6)"),
            ("s3_outage_at", float, "... the replicas' and the stream's S3 answer 503 SlowDown (an s3:// registry)"),
            ("s3_outage_s", float, "length of that outage in seconds (10)"),
            ("settle_timeout_s", float, "after the run, seconds for the live replicas to reach the newest good version (120)"),
            ("train_manifest", str, "an online pipeline manifest trained beside the clients, its store on the proxied S3"),
            ("train_timeout_s", float, "after the run, seconds for the training stream to finish (600)")):
        bench_load.add_argument("--" + field.replace("_", "-"), type=kind, default=None, help=text)
    bench_load.add_argument("--train-override", dest="train_overrides", action="append", default=None,
                            metavar="section.field=value", help="an override of --train-manifest (repeatable)")
    bench_load.add_argument("overrides", nargs="*", metavar="section.field=value")
    bench_load.set_defaults(fn=_cmd_bench)
    return parser


def parse_args(argv: list[str]) -> argparse.Namespace:
    """``argv`` parsed as ``main`` parses it (argparse exits with status 2 on a usage error)."""
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if extra:  # overrides may follow options (``plan M --device cuda section.field=value``)
        if not hasattr(args, "overrides") or any(e.startswith("-") for e in extra):
            parser.error(f"unrecognized arguments: {' '.join(extra)}")
        args.overrides = [*args.overrides, *extra]
    return args


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    args.argv = argv
    try:
        return args.fn(args)
    except USER_ERRORS as e:
        print(f"specray {args.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
