"""``specray pipeline run``: capture → train → export → serve → bench on Ray, ending in a report.

    specray pipeline run manifests/quickstart.yaml [section.field=value …]
    ray job submit --working-dir . -- specray pipeline run manifests/quickstart.yaml

Stages (each timed into ``report.json``'s ``stage_seconds``):

    regenerate     with ``regenerate.enabled`` (offline): the target answers ``data.dataset``'s
                   prompts on Ray actors, eval prompts excluded (pipeline/jobs/regenerate.py);
                   capture reads its answers
    capture        offline: CaptureServer actors write features + a Parquet manifest
    train          offline: the trainer gang (Ray Train) trains on the manifest; a progress bar
                   shows rank 0's step, loss, position-1 accuracy, tokens/s and the latest live
                   tau (``train.live_eval``, measured at each checkpoint), and the gang's records
                   land in ``<run_dir>/train/metrics.jsonl`` and ``curves.png``
    capture+train  online, one stage: capture actors and the gang run at once; SampleRefs flow
                   through the SampleBroker in whole windows, acks go to the durable ledger,
                   consumed features are deleted after the checkpoint that covers them, the
                   store never holds more than ``online.max_inflight_samples`` features, and a
                   ledger audit (each sample trained exactly once, none left) ends the stage
    export    the gang's final checkpoint → a drafter directory (drafters/format.py)
    serve     the export is published to the drafter registry; Ray Serve replicas load it and
              answer smoke requests through the OpenAI API
    bench     the exported drafter vs our AR on held-out prompts: tau, tokens/s, speedup

Everything the driver alone reads lands in the run dir (default ``runs/<name>/``);
``report.json`` holds ``tau``, ``speedup_vs_ar``, ``stage_seconds`` and ``drafter_dir`` among the
rest. What another node or a later driver reads lives on the run's storage, so a cluster of
several machines (the KubeRay RayJob, with ``store.uri``, ``train.storage`` and
``serve.registry`` on ``s3://``) finishes: the training manifest next to its features
(``<store.uri>/manifests/<name>.parquet``), checkpoints and the ledger in ``train.storage``
(export fetches the final checkpoint from there), drafter versions in the registry. A pipeline owns its
run dir: a rerun of the same name replaces it (a directory it did not make is refused). What a
rerun cannot replace is refused too: when ``train.storage`` or ``online.ledger`` lie outside
the run dir (as in the KubeRay RayJob) and already hold this run's ledger transactions or
checkpoints, a run without ``--resume`` stops with the fix instead of silently continuing them.

Resuming: a crashed trainer worker is restarted by Ray Train from the last checkpoint
(``train.max_failures``) within the run, and the ledger makes that exactly-once. A crashed
*driver* (the process running this, killed with everything it started) is resumed by
``specray pipeline run --resume MANIFEST``, which keeps the run dir (or starts an empty one
when the run's state lives in ``train.storage`` only, e.g. a RayJob on a new pod):

- offline: a complete capture (its manifest in the store exists; it is written last) is reused,
  and the trainer gang resumes from its newest checkpoint (same storage and name, actors/trainer.py);
- online: the gang resumes from its newest checkpoint and re-dispatches every sample the
  ledger says was dispatched outside that checkpoint's history (their features are read, or
  captured again when gone); the producer captures only samples the ledger has never seen.
  The audit at the end covers both runs: every sample trained exactly once. Only the stream's
  own keys (its samples' and those the ledger dispatched) are deleted or audited: other
  datasets may share the store root;
- a stage that finished in the interrupted run is not run again (pipeline/jobs/stages.py: its
  record in ``<run_dir>/stages/`` holds its report parts and output, keyed by the config
  sections it reads), unless its config changed; an unfinished regenerate stage appends to its
  answers and skips the conversations already there. Serving with ``serve.keep_running``
  always starts again (its replicas died with the driver).
"""

from __future__ import annotations

import json
import shutil
import threading
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from specray.pipeline.config import PipelineConfig
from specray.pipeline.jobs.rundir import MARKER, fresh_run_dir
from specray.pipeline.jobs.stages import StageLog


@dataclass
class PipelineReport:
    name: str
    mode: str
    run_dir: str
    drafter_dir: str | None = None
    tau: float | None = None
    speedup_vs_ar: float | None = None
    stage_seconds: dict[str, float] = field(default_factory=dict)
    capture: dict | None = None
    train: dict | None = None
    online: dict | None = None  # ledger audit and peak in-flight features (online mode)
    serve: dict | None = None
    bench: dict | None = None
    regenerate: dict | None = None  # the regenerate stage's selection, throughput and answer lengths
    stages_reused: list[str] = field(default_factory=list)  # done in an interrupted run; --resume kept them

    def table(self) -> str:
        def fmt(value, spec: str) -> str:
            return "n/a" if value is None else format(value, spec)

        lines = [
            f"pipeline    {self.name} ({self.mode}), run dir {self.run_dir}",
            f"tau         {fmt(self.tau, '.3f')} (mean tokens per speculative round, greedy, held-out prompts)",
            f"speedup     {fmt(self.speedup_vs_ar, '.2f')} (tokens/s vs our autoregressive engine)",
            f"drafter     {self.drafter_dir}",
        ]
        if self.serve:
            lines.append(f"serve       {self.serve['url']} (drafter v{self.serve['version']}, "
                         f"{self.serve['smoke_requests']} smoke requests ok)")
        if self.online:
            audit = self.online["audit"]
            lines.append(f"ledger      {audit['trained']} samples trained exactly once: {audit['ok']}; "
                         f"peak in-flight {self.online['peak_inflight_samples']} <= {self.online['bound']}")
        if self.regenerate:
            r, sel = self.regenerate, self.regenerate["selection"]
            rate = "n/a" if r["tokens_per_s"] is None else f"{r['tokens_per_s']:.0f}"
            ar = (self.bench or {}).get("tokens_per_s", {}).get("specray-ar@1")
            if r["tokens_per_s"] and ar:
                rate += f" = {r['tokens_per_s'] / ar:.1f}x our AR at batch 1"
            lines.append(f"regenerate  {r['answers']['conversations']} conversations, {r['answers']['answers']} answers "
                         f"({rate} tokens/s, {r['answers']['cut_share']:.0%} cut at max_tokens); "
                         f"{sel['excluded']} overlapping eval prompts excluded")
        stages = "  ".join(f"{k} {v:.0f}s" + (" (reused)" if k in self.stages_reused else "")
                           for k, v in self.stage_seconds.items())
        lines += [f"stages      {stages}", f"report      {Path(self.run_dir) / 'report.json'}"]
        return "\n".join(lines)


def run_pipeline(cfg: PipelineConfig, *, progress: bool = True, resume: bool = False) -> tuple[PipelineReport, object | None]:
    """Run every stage; returns the report and, with ``serve.keep_running``, the live ServeHandle.

    ``resume`` continues an interrupted run in its run dir (module docstring) instead of replacing it.
    ``mode: closed_loop`` is pipeline/jobs/closed_loop.py's (online runs of this one around live
    replicas; ``jobs.run_manifest`` picks the driver by mode)."""
    if cfg.mode == "closed_loop":
        raise ValueError("mode: closed_loop runs in pipeline/jobs/closed_loop.py: call jobs.run_manifest(cfg)")
    from specray.pipeline.jobs.plan import check_before_running

    check_before_running(cfg)  # the drafter against the target's config, before hours of regenerate and capture
    run_dir = _resumed_run_dir(cfg) if resume else fresh_run_dir(cfg.run_dir, refuse=_earlier_run(cfg))
    report = PipelineReport(cfg.name, cfg.mode, str(run_dir.resolve()))
    stages = StageLog(run_dir, cfg, report, resume=resume, progress=progress)
    from specray.actors.cluster import connect

    connect(cfg.ray.address, cfg.ray.num_cpus)
    if cfg.regenerate.enabled:
        stages.run("regenerate", ("target", "data", "regenerate"), ("regenerate",),
                   lambda: _regenerate(cfg, report, progress))
    if cfg.mode == "offline":
        manifest = stages.run("capture", ("target", "data", "capture", "store"), ("capture",),
                              lambda: _capture(cfg, report, progress, reuse=resume))
        checkpoint = stages.run("train", ("train",), ("train",), lambda: _train_offline(cfg, manifest, report, progress))
    else:  # capture and training overlap: that is the point
        checkpoint = stages.run("capture+train", ("target", "data", "capture", "store", "train", "online"),
                                ("train", "online"),
                                lambda: _train_online(cfg, report, progress))
    stages.run("export", (), ("drafter_dir",), lambda: _export(checkpoint, run_dir, report))
    handle = None
    if cfg.serve.enabled:
        def serve() -> None:
            nonlocal handle
            report.serve, handle = _serve(cfg, report.drafter_dir)
            if not cfg.serve.keep_running:  # free the replicas' cores before timing the bench
                handle.stop()
                handle = None

        stages.run("serve", ("serve",), ("serve",), serve, reusable=not cfg.serve.keep_running)
    try:
        if cfg.bench.enabled:
            stages.run("bench", ("bench", "serve"), ("bench", "tau", "speedup_vs_ar"), lambda: _bench(cfg, report))
    except BaseException:
        if handle is not None:
            handle.stop()
        raise
    (run_dir / "report.json").write_text(json.dumps(asdict(report), indent=2) + "\n")
    return report, handle


def _regenerate(cfg: PipelineConfig, report: PipelineReport, progress: bool) -> str:
    from specray.pipeline.jobs.regenerate import regenerate_stage

    report.regenerate = regenerate_stage(cfg, progress)
    return report.regenerate["out"]


def _export(checkpoint: str, run_dir: Path, report: PipelineReport) -> str:
    from specray.trainer.export import export_checkpoint

    export_dir = run_dir / "exports" / "final"
    if export_dir.exists():  # a resumed run: the pipeline owns its exports, the new model replaces it
        shutil.rmtree(export_dir)
    report.drafter_dir = str(export_checkpoint(checkpoint, export_dir).resolve())
    return report.drafter_dir


def _resumed_run_dir(cfg: PipelineConfig) -> Path:
    """The run dir to continue in: the interrupted run's, or a new one when its state lives in storage only.

    (A RayJob on a new pod has an empty run dir, but its ledger and checkpoints in ``train.storage``.)
    """
    if (cfg.run_dir / MARKER).exists():
        return cfg.run_dir
    if not _earlier_run(cfg):
        raise FileNotFoundError(f"nothing to resume: {cfg.run_dir} is not a pipeline run dir (no {MARKER}), and "
                                "train.storage / online.ledger hold no ledger or checkpoints of this run; run "
                                "without --resume to start the run")
    return fresh_run_dir(cfg.run_dir)


def _training_locations(cfg: PipelineConfig) -> tuple[str, str]:
    """(the gang's Ray Train run directory, the ledger) of this pipeline, as the gang resolves them."""
    storage = (cfg.train.storage or str(cfg.run_dir / "ray-train")).rstrip("/")
    run = f"{storage}/{cfg.train_job(None).name}"
    ledger = cfg.online.ledger if cfg.mode == "online" and cfg.online.ledger else f"{run}/ledger"
    return run, ledger


def _earlier_run(cfg: PipelineConfig) -> list[str]:
    """What an earlier run of this pipeline left outside its run dir: ledger transactions, checkpoints."""
    from specray.capture.store import open_fs
    from specray.trainer.ledger import Ledger

    run, ledger = _training_locations(cfg)
    found = []
    if not _inside(ledger, cfg.run_dir) and (count := Ledger(ledger).count()):
        found.append(f"the ledger {ledger} holds {count} transactions")
    if not _inside(run, cfg.run_dir):
        fs, root, _ = open_fs(run)
        try:
            names = sorted(p.rstrip("/").rsplit("/", 1)[-1] for p in fs.ls(root, detail=False))
        except FileNotFoundError:
            names = []
        checkpoints = [n for n in names if n.startswith("checkpoint-")]
        if checkpoints:
            found.append(f"{run} holds {len(checkpoints)} checkpoints (newest {checkpoints[-1]})")
    return found


def _inside(uri: str, run_dir: Path) -> bool:
    """Whether a path or URI lies in ``run_dir`` (which a fresh run replaces)."""
    if "://" in uri and not uri.startswith("file://"):
        return False
    return Path(uri.removeprefix("file://")).resolve().is_relative_to(run_dir.resolve())


def manifest_uri(cfg: PipelineConfig) -> str:
    """Where the offline training manifest lives: next to its features in the store, so that every
    node reads it (trainer workers on other machines, a resumed driver on a new pod)."""
    return f"{cfg.store_uri.rstrip('/')}/manifests/{cfg.name}.parquet"


def _capture(cfg: PipelineConfig, report: PipelineReport, progress: bool, *, reuse: bool = False) -> str:
    from specray.capture.store import open_fs, read_manifest, write_manifest
    from specray.pipeline.jobs.capture import run_capture_on_ray

    shared, endpoint = manifest_uri(cfg), cfg.store.endpoint_url
    fs, path, _ = open_fs(shared, endpoint_url=endpoint)
    if reuse and fs.exists(path):  # written last: its existence means the capture completed
        refs = read_manifest(shared, endpoint_url=endpoint).refs
        report.capture = {"samples": len(refs), "tokens": sum(r.num_tokens for r in refs), "manifest": shared,
                          "store": cfg.store_uri, "reused": True}
        return shared
    summary = run_capture_on_ray(cfg.capture_job(), num_actors=cfg.capture.num_actors,
                                 num_cpus_per_actor=cfg.capture.num_cpus_per_actor,
                                 num_gpus_per_actor=cfg.capture.num_gpus_per_actor, progress=progress)
    local = read_manifest(summary.manifest)  # the capture job's, on this machine's disk
    write_manifest(shared, local.refs, contract=local.contract, store_uri=local.store_uri, metadata=local.metadata,
                   overwrite=True, endpoint_url=endpoint)
    report.capture = {"samples": summary.samples, "tokens": summary.tokens, "tokens_per_s": round(summary.tokens_per_s, 1),
                      "bytes_per_token": round(summary.bytes_per_token, 1), "manifest": shared,
                      "store": summary.store_uri, "actors": cfg.capture.num_actors}
    return shared


def _train_offline(cfg: PipelineConfig, manifest: str, report: PipelineReport, progress: bool) -> str:
    from specray.actors.trainer import run_trainer_gang

    with _TrainProgress(cfg.train.optim.total_steps, progress) as on_record:
        result = run_trainer_gang(cfg.train_job(manifest).train_spec(device_field="train.device"),
                                  num_workers=cfg.train.num_workers,
                                  storage_path=cfg.train.storage or str(cfg.run_dir / "ray-train"),
                                  max_failures=cfg.train.max_failures, cpus_per_worker=cfg.train.cpus_per_worker,
                                  gpus_per_worker=cfg.train.gpus_per_worker, on_record=on_record)
    report.train = _train_summary(cfg, result)
    return result.checkpoint


class _TrainProgress:
    """The train stage's bar in the driver, fed with rank 0's metrics records (``actors/progress.py``):
    step, loss, position-1 accuracy, tau_tf, tokens/s and the latest tau_live."""

    def __init__(self, total_steps: int, progress: bool, *, position: int = 0):
        from tqdm import tqdm

        self.bar = tqdm(total=total_steps, unit="step", desc="train", disable=not progress, position=position)
        self.tau_live: float | None = None

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.bar.close()

    def __call__(self, record: dict) -> None:
        from specray.trainer.loop import progress_fields

        self.tau_live = record.get("tau_live", self.tau_live)
        self.bar.update(record["step"] - self.bar.n)
        self.bar.set_postfix(progress_fields(record, self.tau_live))


def _train_summary(cfg: PipelineConfig, result) -> dict:
    """The report's train section; the gang's records go to ``<run_dir>/train/metrics.jsonl`` and ``curves.png``."""
    from specray.trainer.plots import plot_training

    final = result.metrics[-1] if result.metrics else {}
    curves = None
    if result.metrics:
        train_dir = cfg.run_dir / "train"
        train_dir.mkdir(parents=True, exist_ok=True)
        (train_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in result.metrics))
        curves = str(plot_training(train_dir / "metrics.jsonl", train_dir / "curves.png").resolve())
    return {"steps": result.step, "workers": cfg.train.num_workers, "checkpoint": result.checkpoint,
            "ledger": result.ledger_uri, "attempts": len(result.attempts), "loss": final.get("loss"),
            "acc_by_pos": final.get("acc_by_pos"), "tau_tf": final.get("tau_tf"), "tau_live": final.get("tau_live"),
            "live_accept_by_pos": final.get("live_accept_by_pos"), "curves": curves}


def _bench(cfg: PipelineConfig, report: PipelineReport) -> None:
    """The exported drafter against our AR on held-out prompts (serving/sidebyside.py), with what serving runs."""
    from specray.capture.data import load_conversations
    from specray.capture.target import load_target
    from specray.serving.sidebyside import build_engines, compare, drafter_summary, environment, warm_up

    b, engine = cfg.bench, cfg.serve.engine
    batch_sizes = tuple(b.batch_sizes)
    engines = build_engines(load_target(cfg.target.name), report.drafter_dir, max(batch_sizes),
                            num_speculative_tokens=engine.num_speculative_tokens,
                            max_speculative_batch=engine.max_speculative_batch, speculation=engine.speculation,
                            tree=engine.tree, cost_table=engine.cost_table)
    prompts = [engines["specray-ar"].encode(c.as_chat())
               for c in load_conversations(b.dataset, purpose="eval", limit=b.num_prompts)]
    warm_up(engines, prompts)
    comparison = compare(engines, prompts, max_tokens=b.max_tokens, batch_sizes=batch_sizes)
    result = {"benchmark": "pipeline", "target": cfg.target.name, "drafter": report.drafter_dir, "dataset": b.dataset,
              "prompts": len(prompts), "max_tokens": b.max_tokens, "runs": comparison.runs,
              "num_speculative_tokens": engines["specray-drafter"].worker.max_verify_rows - 1,
              "max_speculative_batch": engine.max_speculative_batch, "speculation": engine.speculation,
              "tree": engine.tree, "environment": environment(),
              **drafter_summary(engines, comparison, batch_sizes=batch_sizes, png=str(cfg.run_dir / "acceptance.png"))}
    (cfg.run_dir / "bench.json").write_text(json.dumps(result, indent=2) + "\n")
    report.tau, report.speedup_vs_ar = result.get("tau"), result.get("speedup_vs_ar")
    report.bench = {"json": str((cfg.run_dir / "bench.json").resolve()), "greedy_match": result.get("greedy_match"),
                    "tokens_per_s": {f"{r['system']}@{r['batch_size']}": round(r["tokens_per_s"], 2) for r in result["runs"]},
                    "accept_rate_by_pos": result.get("accept_rate_by_pos"),
                    "num_speculative_tokens": result.get("num_speculative_tokens"),
                    "max_speculative_batch": result.get("max_speculative_batch"),
                    "speculation": result.get("speculation"),
                    "rounds": {f"{r['system']}@{r['batch_size']}": r["rounds"] for r in result["runs"] if r.get("rounds")}}


def _train_online(cfg: PipelineConfig, report: PipelineReport, progress: bool) -> str:
    """Capture actors and the trainer gang at once; the broker bounds what the store holds."""
    import ray

    from specray.actors.broker import start_sample_broker
    from specray.actors.capture import CapturePool
    from specray.actors.trainer import run_trainer_gang
    from specray.capture.store import feature_key, open_store
    from specray.pipeline.jobs.capture import plan_capture
    from specray.trainer.ledger import Ledger, audit, stream_keys

    job = cfg.capture_job()
    plan = plan_capture(job)
    t, o = cfg.train, cfg.online
    window = t.num_workers * t.optim.micro_batch_size * t.optim.accumulation_steps
    storage = t.storage or str(cfg.run_dir / "ray-train")
    ledger_uri = _training_locations(cfg)[1]
    # Samples an earlier run of this stream dispatched are the gang's to re-dispatch (from the
    # ledger, on resume); the producer captures only the ones never dispatched.
    state = Ledger(ledger_uri).replay()
    # One pass (the stream is consume-once). The gang counts its step target from the samples
    # left at each attempt start (stream_samples); this is that count from the ledger's newest
    # checkpoint, for the progress bar and the first attempt's schedule.
    last = state.last_checkpoint()
    done = {sid for txn in state.lineage(last["attempt"], last["step"]) for sid in txn["sample_ids"]} if last else set()
    steps = (last["step"] if last else 0) + -(-(len(plan.samples) - len(done)) // window)
    train_job = cfg.train_job(None).model_copy(update={"optim": t.optim.model_copy(update={"total_steps": steps})})
    dispatched = {r.sample_id for refs in state.windows.values() for r in refs}
    # The keys this stream writes: its planned samples' and every one the ledger dispatched.
    # Only these are ever deleted or audited; other datasets may share the store root.
    keys = {feature_key(plan.contract.contract_id, s.sample_id) for s in plan.samples} | stream_keys(state)
    broker = start_sample_broker(window, max_inflight=o.max_inflight_samples, max_inflight_bytes=o.max_inflight_bytes,
                                 contract=plan.contract, store_uri=cfg.store_uri, endpoint_url=cfg.store.endpoint_url)
    pool = CapturePool(cfg.target.name, plan.contract, cfg.store_uri, endpoint_url=cfg.store.endpoint_url,
                       num_actors=cfg.capture.num_actors, num_cpus_per_actor=cfg.capture.num_cpus_per_actor,
                       num_gpus_per_actor=cfg.capture.num_gpus_per_actor, target_dtype=cfg.target.dtype,
                       target_device=cfg.target.device, chat_template=plan.target.chat_template)
    if dispatched:
        _adopt_leftovers(state, broker, pool.store, keys)
    producer = _Producer(pool, broker, plan, progress, skip=dispatched)
    try:
        producer.start()
        try:
            with _TrainProgress(steps, progress, position=1) as on_record:  # below the capture bar
                # the gang renders (live evaluation) and fingerprints with the capture's chat template
                spec = replace(train_job.train_spec(device_field="train.device"), chat_template=plan.target.chat_template)
                result = run_trainer_gang(spec, num_workers=t.num_workers, storage_path=storage,
                                          ledger_uri=ledger_uri, broker=broker, stream_samples=len(plan.samples),
                                          max_failures=t.max_failures,
                                          cpus_per_worker=t.cpus_per_worker, gpus_per_worker=t.gpus_per_worker,
                                          on_record=on_record)
        except Exception:
            producer.raise_error()  # a failed stream fails the gang: report the cause, not its echo
            raise
        producer.check()
        stats = ray.get(broker.stats.remote(), timeout=60)
        checked = audit(Ledger(result.ledger_uri), source_ids=[s.sample_id for s in plan.samples],
                        store=open_store(cfg.store_uri, endpoint_url=cfg.store.endpoint_url), keys=keys)
    finally:
        producer.stop.set()
        pool.close()
        ray.kill(broker)
    report.train = _train_summary(cfg, result)
    report.online = {
        "audit": {"ok": checked.ok, "trained": checked.trained, "duplicates": len(checked.duplicates),
                  "missing": len(checked.missing), "leftover_features": len(checked.leftover_keys)},
        "peak_inflight_samples": stats["peak_inflight"], "bound": o.max_inflight_samples,
        "capture": producer.stats, "ledger": result.ledger_uri, "resumed_dispatched": len(dispatched),
    }
    if not checked.ok:
        raise RuntimeError(f"the online run's ledger audit failed: {checked.summary()}")
    return result.checkpoint


def _adopt_leftovers(state, broker, store, keys: set[str]) -> None:
    """Resuming a stream: count what the killed run left in the store against the bound.

    The features the gang will re-dispatch or delete (outside / inside the newest
    checkpoint's history) are held in the broker before the producer starts, so the bound
    still holds; the stream's other blobs (captured, never dispatched) and temp files of its
    interrupted writes are deleted: the producer captures those samples again, under the
    bound. Only ``keys``, the stream's own, are looked at.
    """
    import ray

    from specray.trainer.ledger import recovery_plan, store_keys

    last = state.last_checkpoint()
    plan = recovery_plan(state, (last["attempt"], last["step"]) if last else None, recapture=True)
    kept = {r.key: r for r in plan.redispatch} | {r.key: r for w in plan.delete_windows for r in state.windows[w]}
    for key in store_keys(store, keys):
        if key not in kept:
            store.delete(key)
    ray.get(broker.hold.remote(list(kept.values())), timeout=60)


class _Producer(threading.Thread):
    """Feeds the capture pool's batches into the broker: reserve room, capture, offer the refs.

    It also captures samples again on the gang's request (``actors/broker.py``, re-capture):
    a watcher thread takes the lost refs from the broker and queues their original batches on
    the pool with ``only=`` those samples; the pool serves them ahead of new batches, and after
    the last new batch until the gang is done (``stop``).
    """

    def __init__(self, pool, broker, plan, progress: bool, skip: set[str] = frozenset()):
        super().__init__(name="specray-producer", daemon=True)
        self.pool, self.broker, self.plan, self.progress = pool, broker, plan, progress
        self.stop = threading.Event()
        self.error: BaseException | None = None
        self.stats: dict | None = None
        self.reserved: dict[str, tuple[int, int]] = {}  # batch id -> (samples, bytes) reserved, not yet offered
        self.batches = [(f"batch-{i:06d}", batch) for i, batch in enumerate(plan.batches)]
        # Batches keep their composition across runs (a sample's bytes depend on its batch's
        # padding); a resumed run writes only the samples no earlier run dispatched.
        self.new = [(bid, batch, None if not skip else [s.sample_id for s in batch if s.sample_id not in skip])
                    for bid, batch in self.batches if any(s.sample_id not in skip for s in batch)]
        self.batch_of = {s.sample_id: i for i, (_, batch) in enumerate(self.batches) for s in batch}
        self.recaptures = 0
        self.recaptured_samples = 0

    def _estimate(self, samples) -> int:  # bytes a batch will occupy in the store (contract minimum + headers)
        return sum(self.plan.contract.min_bytes_per_token * s.num_tokens + 4096 for s in samples)

    def _admit(self, batch) -> None:
        import ray

        batch_id, samples = batch
        estimate = self._estimate(samples)
        while not ray.get(self.broker.reserve.remote(len(samples), num_bytes=estimate, timeout=2), timeout=60):
            if self.stop.is_set():
                raise RuntimeError("the pipeline stopped while the producer waited for room in the broker")
        self.reserved[batch_id] = (len(samples), estimate)

    def _deliver(self, batch_id: str, refs) -> None:
        import ray

        if batch_id.startswith("recapture-"):
            self.recaptured_samples += len(refs)
            ray.get(self.broker.recaptured.remote(refs), timeout=60)
        else:
            ray.get(self.broker.offer.remote(refs, reserved_bytes=self.reserved[batch_id][1]), timeout=60)
            del self.reserved[batch_id]

    def _watch_lost(self) -> None:
        """Take lost samples from the broker and queue their batches for re-capture."""
        import ray

        try:
            while not self.stop.is_set():
                lost = ray.get(self.broker.take_lost.remote(timeout=1.0), timeout=60)
                by_batch: dict[int, list[str]] = {}
                for ref in lost:
                    by_batch.setdefault(self.batch_of[ref.sample_id], []).append(ref.sample_id)
                for index, ids in sorted(by_batch.items()):
                    self.recaptures += 1
                    batch_id, samples = self.batches[index]
                    self.pool.recapture((f"recapture-{self.recaptures}/{batch_id}", samples), only=ids)
        except BaseException as e:  # noqa: BLE001 - re-raised in the driver by check()
            self._fail(e)

    def _fail(self, error: BaseException) -> None:
        """Fail the stream with ``error``: give back the room of batches never offered, wake every rank.

        Not a close: a closed stream with reservations outstanding never cuts its final window,
        and a closed one without would let the gang finish as if every sample had come. (When
        the driver tore the run down first, the broker is gone already: nothing left to tell.)
        """
        import ray

        self.error = self.error or error
        try:
            for batch_id, (samples, num_bytes) in list(self.reserved.items()):
                ray.get(self.broker.cancel.remote(samples, num_bytes), timeout=60)
                self.reserved.pop(batch_id, None)
            ray.get(self.broker.fail.remote(f"{type(self.error).__name__}: {self.error}"), timeout=60)
        except ray.exceptions.RayActorError:
            pass

    def run(self) -> None:
        import ray

        watcher = threading.Thread(target=self._watch_lost, name="specray-recapture", daemon=True)
        try:
            ray.get(self.broker.enable_recapture.remote(), timeout=60)
            watcher.start()
            stats = self.pool.run(self.new, self._deliver, admit=self._admit, progress=self.progress)
            self.stats = {"batches": stats.batches, "samples": stats.samples, "tokens": stats.tokens,
                          "restarts": stats.restarts, "redispatched": stats.redispatched}
            ray.get(self.broker.close.remote(), timeout=60)
            # The stream is complete; keep capturing lost samples again until the gang is done.
            self.pool.run([], self._deliver, until=self.stop)
        except BaseException as e:  # noqa: BLE001 - re-raised in the driver by check()
            self._fail(e)
        finally:
            self.stop.set()
            if watcher.is_alive():
                watcher.join(timeout=70)

    def check(self) -> None:
        """After the gang returned: stop serving re-captures, and raise what went wrong."""
        self.stop.set()
        self.join(timeout=120)
        if self.is_alive():
            raise RuntimeError("the capture producer is still running after the trainer finished")
        self.raise_error()
        self.stats.update(recaptures=self.recaptures, recaptured_samples=self.recaptured_samples)

    def raise_error(self) -> None:
        """Raise the producer's error, if it failed (the cause of a gang failure it made)."""
        if self.error is not None:
            raise RuntimeError(f"online capture failed: {type(self.error).__name__}: {self.error}") from self.error


def _serve(cfg: PipelineConfig, drafter_dir: str):
    """Publish the export, start the replicas, wait until they serve it, send smoke requests.

    Returns (summary, handle); the caller stops the handle unless ``serve.keep_running``."""
    import openai

    from specray.actors.serve import start_serving
    from specray.serving.registry import DrafterRegistry

    version = DrafterRegistry(cfg.registry_uri, endpoint_url=cfg.store.endpoint_url).publish(drafter_dir)
    handle = start_serving(cfg.serve_job())
    try:
        _wait_for_version(handle, version, timeout_s=300)
        client = openai.OpenAI(base_url=handle.base_url, api_key=handle.api_key or "unused", timeout=300)
        served = []
        for i in range(cfg.serve.smoke_requests):
            question = f"In one sentence, what is {['a CPU', 'a GPU', 'Ray', 'speculative decoding'][i % 4]}?"
            if i % 2 == 0:
                response = client.chat.completions.create(model=handle.model, max_tokens=16, temperature=0,
                                                          messages=[{"role": "user", "content": question}])
                text = response.choices[0].message.content
            else:
                response = client.completions.create(model=handle.model, prompt=question, max_tokens=16, temperature=0)
                text = response.choices[0].text
            served.append({"fingerprint": response.system_fingerprint, "tokens": response.usage.completion_tokens,
                           "text": text})
    except BaseException:
        handle.stop()
        raise
    wrong = [s for s in served if s["fingerprint"] != f"specray-drafter-v{version}"]
    if wrong:
        handle.stop()
        raise RuntimeError(f"replicas answered with {wrong[0]['fingerprint']}, not the published drafter v{version}")
    metrics = _replica_metrics(handle)
    summary = {"url": handle.base_url, "model": handle.model, "registry": cfg.registry_uri, "version": version,
               "backend": cfg.serve.backend, "smoke_requests": len(served), "sample": served[0]["text"],
               "tau": metrics.get("tau"), "acceptance_by_position": metrics.get("acceptance_by_position")}
    return summary, handle


def _replica_metrics(handle) -> dict:
    """One replica's /metrics (its live tau and acceptance over the smoke requests)."""
    import urllib.request

    request = urllib.request.Request(f"{handle.url}/metrics")
    if handle.api_key:
        request.add_header("Authorization", f"Bearer {handle.api_key}")
    with urllib.request.urlopen(request, timeout=30) as response:
        return json.loads(response.read())


def _wait_for_version(handle, version: int, timeout_s: float) -> None:
    import urllib.request

    request = urllib.request.Request(f"{handle.url}/health")
    if handle.api_key:
        request.add_header("Authorization", f"Bearer {handle.api_key}")
    deadline = time.monotonic() + timeout_s
    while True:
        with urllib.request.urlopen(request, timeout=30) as response:
            if json.loads(response.read()).get("drafter_version") == version:
                return
        if time.monotonic() > deadline:
            raise TimeoutError(f"the replicas did not load drafter v{version} within {timeout_s:.0f} s; "
                               f"see {handle.url}/metrics for rejected versions")
        time.sleep(1)
