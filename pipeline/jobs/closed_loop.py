"""``specray pipeline run`` with ``mode: closed_loop``: serve, record the traffic, retrain on it, hot-load.

    specray pipeline run manifests/closed-loop.yaml [section.field=value …] [--resume]

The loop (each step timed into ``report.json``):

    initial    the first drafter: ``train.drafter.init_from``, or (init_from null) an offline
               pipeline on ``data`` in ``<run_dir>/initial`` (capture → train → export); it is
               published to the drafter registry as the first version
    serve      Ray Serve replicas (``serve.*``, a fixed number) load it from the registry and record
               every finished request (``serve.record``; its uri defaults to ``<run_dir>/records``);
               a load generator of ``openai`` clients streams greedy chat completions of
               ``closed_loop.load``'s prompts through them, in order, for the whole loop
    iteration  once shards no iteration took hold ``records_per_iteration`` chat records:
               snapshot  the oldest of them that hold that many (whole shards; the rest wait for the
                         next iteration): their conversations → ``<run_dir>/iterations/NNNN.jsonl``,
                         the shard list → the loop state ``<run_dir>/closed-loop.json``
               train     an online pipeline (pipeline_job.py) on the snapshot in
                         ``<run_dir>/iterations/NNNN/``: capture actors → store → SampleBroker →
                         trainer gang from the current drafter (``init_from``), the ack ledger and
                         its exactly-once audit, export
               publish   the export → the registry as the next version
               hot-load  until every replica serves it (read from each replica's ``/metrics``)
    end        the newest version serves ``records_per_iteration`` requests; the load stops; each
               replica's ``/metrics`` gives tau and acceptance by position of every version over
               the traffic that version served (``versions``)

Each iteration trains *online* on its snapshot rather than capturing it to a manifest first:
recorded traffic grows without end, and the online stream deletes each feature once a
checkpoint covers it (the store holds at most ``online.max_inflight_samples``), ends with the
ledger audit (every record trained exactly once, no feature left), and overlaps capture with
training, which shortens the time from traffic to a new version.

Failed requests are every failed attempt of the load generator (it never retries); those
running while a version was being hot-loaded (publish → every replica serves it) are counted
apart and must be 0.

Resuming (``--resume``, after the driver died): the state file names the shards every iteration
took, so no shard is trained twice; an iteration whose snapshot exists but whose version was not
published resumes its online pipeline (``run_pipeline(resume=True)``: the ledger makes it
exactly-once); a finished initial stage and published versions are kept, and the replicas start
on the registry's newest version.
"""

from __future__ import annotations

import itertools
import json
import os
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from specray.pipeline.config import PipelineConfig
from specray.pipeline.jobs.pipeline import run_pipeline
from specray.pipeline.jobs.rundir import MARKER, fresh_run_dir, resumable_run_dir

STATE = "closed-loop.json"
SUB_RUNS = ("initial", "iterations")  # the pipelines this loop runs inside its run dir (rundir.fresh_run_dir)
POLL_S = 1.0  # seconds between reads of the record store and of /metrics while waiting


@dataclass
class ClosedLoopReport:
    name: str
    mode: str
    run_dir: str
    initial: dict | None = None  # the first drafter: export, version, how it was made
    iterations: list[dict] = field(default_factory=list)
    versions: dict[str, dict] = field(default_factory=dict)  # "v2" -> live tau, rounds, acceptance, requests
    requests: dict | None = None  # the load generator's: served, failed, failed during hot-loads
    serve: dict | None = None
    stage_seconds: dict[str, float] = field(default_factory=dict)

    def table(self) -> str:
        lines = [f"pipeline    {self.name} (closed_loop), run dir {self.run_dir}",
                 f"initial     v{self.initial['version']} from {self.initial['export']}"]
        for it in self.iterations:
            audit = it["audit"]
            lines.append(f"iteration {it['iteration']}  v{it['version']}: {it['records']} records from "
                         f"{len(it['shards'])} shards, {it['wall_s']:.0f} s (records {it['wait_records_s']:.0f} s, "
                         f"train {it['train_s']:.0f} s, hot-load {it['hot_load_s']:.0f} s); ledger "
                         f"{audit['trained']} trained exactly once: {audit['ok']}; failed requests {it['failed_requests']}")
        for name, v in self.versions.items():
            tau = "n/a" if v["tau"] is None else f"{v['tau']:.3f}"
            accept = " ".join(f"{a:.2f}" for a in v["acceptance_by_position"][:4])
            lines.append(f"{name:<11} tau {tau} over {v['rounds']} rounds, {v['requests']} requests; "
                         f"acceptance by position {accept}")
        r = self.requests
        lines.append(f"requests    {r['served']} served, {r['failed']} failed "
                     f"({r['failed_during_hot_load']} during hot-loads)")
        stages = "  ".join(f"{k} {v:.0f}s" for k, v in self.stage_seconds.items())
        lines += [f"stages      {stages}", f"report      {Path(self.run_dir) / 'report.json'}"]
        return "\n".join(lines)


def run_closed_loop(cfg: PipelineConfig, *, progress: bool = True, resume: bool = False):
    """Run the loop (module docstring); returns the report and, with ``serve.keep_running``, the ServeHandle."""
    from specray.actors.cluster import connect
    from specray.actors.serve import start_serving
    from specray.serving.registry import DrafterRegistry

    run_dir = resumable_run_dir(cfg.run_dir) if resume else fresh_run_dir(cfg.run_dir, sub_runs=SUB_RUNS)
    report = ClosedLoopReport(cfg.name, cfg.mode, str(run_dir.resolve()))
    state = _LoopState(run_dir / STATE)
    connect(cfg.ray.address, cfg.ray.num_cpus)
    registry = DrafterRegistry(cfg.registry_uri, endpoint_url=cfg.store.endpoint_url)
    start = time.perf_counter()
    report.initial = state.get("initial") or _initial(cfg, registry, state, progress, resume)
    report.stage_seconds["initial"] = round(time.perf_counter() - start, 2)
    serve_cfg = serve_config(cfg)
    handle = start_serving(serve_cfg)
    load = None
    try:
        replicas = _Replicas(handle, cfg.serve.autoscaling.min_replicas, registry)
        replicas.wait_serving(registry.latest(), cfg.closed_loop.hot_load_timeout_s)
        load = _LoadGenerator(handle, _prompts(cfg), cfg.closed_loop.load).start()
        loop = _Loop(cfg, serve_cfg.record, registry, state, replicas, load, progress)
        loop.run(report)
        load.stop()
        report.versions = _versions(replicas.final(), load)
        report.requests = loop.requests()
        report.serve = {"url": handle.base_url, "model": handle.model, "registry": cfg.registry_uri,
                        "record": serve_cfg.record.uri, "replicas": replicas.count}
    except BaseException:
        if load is not None:
            load.stop()
        handle.stop()
        raise
    report.stage_seconds["loop"] = round(time.perf_counter() - start - report.stage_seconds["initial"], 2)
    (run_dir / "report.json").write_text(json.dumps(asdict(report), indent=2) + "\n")
    if not cfg.serve.keep_running:
        handle.stop()
        handle = None
    return report, handle


def serve_config(cfg: PipelineConfig):
    """The loop's Serve config: the pipeline's, recording to ``<run_dir>/records`` unless ``serve.record.uri`` says."""
    serve = cfg.serve_job()
    if serve.record.uri is None:
        record = serve.record.model_copy(update={"uri": str((cfg.run_dir / "records").resolve())})
        serve = serve.model_copy(update={"record": record})
    return serve


def derived_config(cfg: PipelineConfig, *, name: str, mode: str, run_dir: Path, dataset: str | None = None,
                   init_from: str | None = None) -> PipelineConfig:
    """A pipeline the loop runs inside its run dir: the initial offline one, or an iteration's online one
    (no serve, no bench; an iteration's data is its snapshot and it starts from ``init_from``)."""
    data = cfg.model_dump()
    data.update(name=name, mode=mode, output={"run_dir": str(run_dir)})
    data["serve"]["enabled"] = data["bench"]["enabled"] = False
    if dataset is not None:
        data["data"].update(dataset=dataset, skip=0, max_samples=None)
    if init_from is not None:
        data["train"]["drafter"]["init_from"] = init_from
    if cfg.online.ledger:  # one ledger per stream: an iteration must not replay another's windows
        data["online"]["ledger"] = f"{cfg.online.ledger.rstrip('/')}/{name}"
    return PipelineConfig.model_validate(data)


def _initial(cfg: PipelineConfig, registry, state: _LoopState, progress: bool, resume: bool) -> dict:
    """The first drafter, published as the first version; recorded in the state."""
    if cfg.train.drafter.init_from:
        export, how = _imported(cfg, str(Path(cfg.train.drafter.init_from).resolve())), "train.drafter.init_from"
        check_starts_from(cfg.train.drafter, export)
    else:
        sub = derived_config(cfg, name=f"{cfg.name}-initial", mode="offline", run_dir=cfg.run_dir / SUB_RUNS[0])
        if progress:
            print(f"== initial drafter: offline pipeline on {cfg.data.dataset} in {sub.run_dir}", flush=True)
        sub_report, _ = run_pipeline(sub, progress=progress, resume=resume and (sub.run_dir / MARKER).exists())
        export, how = sub_report.drafter_dir, f"offline pipeline on {cfg.data.dataset} ({sub.run_dir})"
    initial = {"export": export, "version": registry.publish(export), "made_by": how}
    state.update(initial=initial)
    return initial


def _imported(cfg: PipelineConfig, path: str) -> str:
    """``path``, or the export a peer drafter's directory imports to (drafters/peer_import.py), for the
    target and capture dtype of the loop (what every iteration captures and trains on)."""
    from specray.drafters.peer_import import as_export, is_peer_directory

    if not is_peer_directory(path):
        return path
    from specray.capture.target import load_target

    return str(as_export(path, load_target(cfg.target.name), capture_dtype=cfg.capture.dtype))


def check_starts_from(section, export: str) -> None:
    """Refuse, before serving starts, an ``init_from`` export whose architecture differs from a field
    the drafter section sets (every iteration trains the section's architecture from that export)."""
    from specray.drafters.format import read_drafter_config

    have = read_drafter_config(export)["architecture"]
    wrong = {k: (v, have[k]) for k, v in section.model_dump().items()
             if k in have and k != "draft_vocab_size" and v is not None and v != have[k]}
    if wrong:
        fix = " ".join(f"train.drafter.{k}={e}" for k, (_, e) in wrong.items())
        raise ValueError(f"train.drafter.init_from={export} has another architecture than the drafter section ("
                         + ", ".join(f"{k}: section {v!r}, export {e!r}" for k, (v, e) in wrong.items())
                         + f"); every iteration trains the section's architecture from it: set {fix}")


def _prompts(cfg: PipelineConfig) -> list[list[dict]]:
    from specray.capture.data import load_conversations

    load = cfg.closed_loop.load
    return [c.as_chat() for c in load_conversations(load.dataset, purpose="eval", limit=load.num_prompts)]


class _LoopState:
    """``<run_dir>/closed-loop.json``: the initial drafter and every iteration's shards, snapshot and
    version; rewritten whole (temp file + ``os.replace``) after every change, so it survives any crash."""

    def __init__(self, path: Path):
        self.path = path
        self.data = json.loads(path.read_text()) if path.exists() else {"initial": None, "iterations": []}

    def get(self, key: str):
        return self.data[key]

    def update(self, **values) -> None:
        self.data.update(values)
        tmp = self.path.with_name(f".{self.path.name}.tmp")
        tmp.write_text(json.dumps(self.data, indent=2) + "\n")
        os.replace(tmp, self.path)

    @property
    def taken(self) -> set[str]:
        """Shards some iteration took (finished or not): never given to another."""
        return {s for it in self.data["iterations"] for s in it["shards"]}

    @property
    def current_export(self) -> str:
        done = [it for it in self.data["iterations"] if it.get("version") is not None]
        return done[-1]["export"] if done else self.data["initial"]["export"]


class _Loop:
    """The iterations: wait for records, snapshot, train online, publish, hot-load (module docstring)."""

    def __init__(self, cfg: PipelineConfig, record, registry, state: _LoopState, replicas: _Replicas,
                 load: _LoadGenerator, progress: bool):
        self.cfg, self.c, self.record, self.registry, self.state = cfg, cfg.closed_loop, record, registry, state
        self.replicas, self.load, self.progress = replicas, load, progress
        self.hot_loads: list[tuple[float, float]] = []  # (publish, every replica serves it), load-generator seconds
        self.counts: dict[str, int] = {}  # shard -> chat records in it (shards are immutable)

    def say(self, message: str) -> None:
        if self.progress:
            print(message, flush=True)

    def run(self, report: ClosedLoopReport) -> None:
        began = time.monotonic()
        done = sum(it.get("version") is not None for it in self.state.get("iterations"))
        for index in range(done + 1, self.c.iterations + 1):
            if self.c.time_budget_s is not None and time.monotonic() - began > self.c.time_budget_s:
                self.say(f"== closed loop: time budget of {self.c.time_budget_s:.0f} s spent after {index - 1} iterations")
                break
            report.iterations.append(self.iteration(index))
        self.say(f"== closed loop: v{self.registry.latest()} serves {self.c.records_per_iteration} requests")
        newest = f"specray-drafter-v{self.registry.latest()}"
        self._wait(lambda: self.load.served_by(newest) >= self.c.records_per_iteration,
                   f"{self.c.records_per_iteration} requests served by {newest}")

    def iteration(self, index: int) -> dict:
        start = self.load.now()
        pending = [it for it in self.state.get("iterations") if it["iteration"] == index]
        entry = pending[0] if pending else self.snapshot(index)
        records_s = self.load.now() - start
        run_dir = self.cfg.run_dir / SUB_RUNS[1] / f"{index:04d}"
        sub = derived_config(self.cfg, name=f"{self.cfg.name}-{index:04d}", mode="online", run_dir=run_dir,
                             dataset=f"jsonl:{entry['snapshot']}", init_from=self.state.current_export)
        self.say(f"== iteration {index}: {entry['records']} records → online capture+train from "
                 f"{sub.train.drafter.init_from}")
        trained = self.load.now()
        sub_report, _ = run_pipeline(sub, progress=self.progress, resume=bool(pending) and (run_dir / MARKER).exists())
        published = self.load.now()
        version = self.registry.publish(sub_report.drafter_dir)
        entry.update(export=sub_report.drafter_dir, version=version)  # done: a resumed loop goes on from it
        self.state.update(iterations=[*(it for it in self.state.get("iterations") if it["iteration"] != index), entry])
        self.say(f"== iteration {index}: published v{version}; waiting for {self.replicas.count} replicas")
        self.replicas.wait_serving(version, self.c.hot_load_timeout_s)
        loaded = self.load.now()
        self.hot_loads.append((published, loaded))
        return {"iteration": index, "version": version, "export": sub_report.drafter_dir, "records": entry["records"],
                "shards": entry["shards"], "init_from": sub.train.drafter.init_from,
                "audit": sub_report.online["audit"], "train": sub_report.train,
                "wall_s": round(loaded - start, 2), "wait_records_s": round(records_s, 2),
                "train_s": round(published - trained, 2), "hot_load_s": round(loaded - published, 2),
                "stage_seconds": sub_report.stage_seconds, "failed_requests": self.load.failed_between(start, loaded),
                "failed_during_hot_load": self.load.failed_between(published, loaded),
                "tau_by_version": {k: v["tau"] for k, v in _versions(self.replicas.latest, self.load).items()}}

    def snapshot(self, index: int) -> dict:
        """Wait for ``records_per_iteration`` chat records in shards no iteration took; write the oldest
        such shards that hold that many as the iteration's jsonl dataset, and record them in the state
        before training on them."""
        from specray.capture.data import list_record_shards, record_conversations

        r, taken, want = self.record, self.state.taken, self.c.records_per_iteration
        self.say(f"== iteration {index}: waiting for {want} new records in {r.uri}")
        shards: list[str] = []

        def enough() -> bool:  # the oldest untaken shards (creation order) until they hold ``want`` records
            shards.clear()
            for shard in list_record_shards(r.uri, endpoint_url=r.endpoint_url):
                if shard in taken:
                    continue
                if shard not in self.counts:
                    self.counts[shard] = sum(1 for _ in record_conversations([shard], endpoint_url=r.endpoint_url))
                shards.append(shard)
                if sum(self.counts[s] for s in shards) >= want:
                    return True
            return False

        self._wait(enough, f"{want} new records in {r.uri}")
        path = (self.cfg.run_dir / "iterations" / f"{index:04d}.jsonl").resolve()
        path.parent.mkdir(parents=True, exist_ok=True)
        conversations = list(record_conversations(shards, endpoint_url=r.endpoint_url))
        tmp = path.with_name(f".{path.name}.tmp")
        lines = (json.dumps({"id": c.id, "messages": c.as_chat(), "finish_reason": "length" if c.cut else "stop"})
                 for c in conversations)  # a cut answer's end of turn stays unsupervised (Conversation.cut)
        tmp.write_text("".join(line + "\n" for line in lines))
        os.replace(tmp, path)
        entry = {"iteration": index, "shards": shards, "records": len(conversations), "snapshot": str(path)}
        self.state.update(iterations=[*self.state.get("iterations"), entry])
        return entry

    def _wait(self, ready, what: str) -> None:
        timeout_s = self.c.records_timeout_s
        deadline = time.monotonic() + timeout_s
        while not ready():
            self.load.check()
            if time.monotonic() > deadline:
                raise TimeoutError(f"waited {timeout_s:.0f} s for {what} (load generator: {self.load.summary()}); "
                                   "raise closed_loop.records_timeout_s or lower closed_loop.records_per_iteration")
            time.sleep(POLL_S)

    def requests(self) -> dict:
        failed = self.load.failed()
        return {**self.load.summary(), "failed_during_hot_load": sum(
                    self.load.failed_between(a, b) for a, b in self.hot_loads),
                "failures": [{"at_s": round(a.start_s, 2), "error": a.error, "detail": a.detail} for a in failed[:20]]}


class _Replicas:
    """Each replica's latest ``/metrics``, read through the Serve proxy (which spreads reads over the
    replicas; the response names the replica that answered)."""

    def __init__(self, handle, count: int, registry):
        self.url, self.count, self.registry = handle.url, count, registry
        self.headers = {"Authorization": f"Bearer {handle.api_key}"} if handle.api_key else {}
        self.latest: dict[str, dict] = {}  # replica id -> its /metrics
        self.read_at: dict[str, float] = {}

    def read(self) -> None:
        import httpx2

        try:
            response = httpx2.get(f"{self.url}/metrics", headers=self.headers, timeout=30, trust_env=False)
            response.raise_for_status()
        except httpx2.HTTPError:  # a busy proxy: read again next time
            return
        metrics = response.json()
        self.latest[metrics["replica"]] = metrics
        self.read_at[metrics["replica"]] = time.monotonic()

    def wait_serving(self, version: int, timeout_s: float) -> None:
        """Until ``count`` replicas, read since now, serve ``version`` (a version rejected by a replica or in
        the registry fails at once)."""
        since, deadline = time.monotonic(), time.monotonic() + timeout_s
        while True:
            self.read()
            fresh = {rid: m for rid, m in self.latest.items() if self.read_at[rid] >= since}
            rejected = [(rid, r["error"]) for rid, m in fresh.items() for r in m["rejected_versions"]
                        if r["version"] == version]
            # a vLLM replica that cannot serve a version never answers: it rejects it in the registry
            rejected += [(r.by, r.reason) for r in self.registry.rejections().get(version, [])]
            if rejected:
                raise RuntimeError(f"replica {rejected[0][0]} rejected drafter v{version}: {rejected[0][1]}")
            if sum(m["active_version"] == version for m in fresh.values()) >= self.count:
                return
            if time.monotonic() > deadline:
                raise TimeoutError(f"{self.count} replicas did not all serve drafter v{version} within {timeout_s:.0f} s "
                                   f"(seen: { {rid: m['active_version'] for rid, m in fresh.items()} }); raise "
                                   "closed_loop.hot_load_timeout_s")
            time.sleep(POLL_S / 4)

    def final(self, timeout_s: float = 120.0) -> dict[str, dict]:
        """Every replica's /metrics read after the load stopped (bounded wait)."""
        since, deadline = time.monotonic(), time.monotonic() + timeout_s
        while sum(t >= since for t in self.read_at.values()) < self.count and time.monotonic() < deadline:
            self.read()
            time.sleep(0.1)
        return self.latest


def _versions(latest: dict[str, dict], load: _LoadGenerator) -> dict[str, dict]:
    """Per drafter version, over all replicas: tau and acceptance by position of the rounds it ran
    (each replica's ``/metrics`` ``versions``), and the requests it answered (the load generator's)."""
    sums: dict[int | None, dict] = {}
    for metrics in latest.values():
        for v in metrics["versions"]:
            s = sums.setdefault(v["version"], {"rounds": 0, "emitted": 0.0, "accepted": []})
            rounds = v["rounds"]
            s["rounds"] += rounds
            s["emitted"] += (v["tau"] or 0.0) * rounds
            accepted = [a * rounds for a in v["acceptance_by_position"]]
            s["accepted"] = [x + y for x, y in itertools.zip_longest(s["accepted"], accepted, fillvalue=0.0)]
    out = {}
    for version in sorted(sums, key=lambda v: -1 if v is None else v):
        s, name = sums[version], "ar" if version is None else f"v{version}"
        rounds, requests = s["rounds"], load.served_by("specray-ar" if version is None else f"specray-drafter-v{version}")
        if rounds or requests:  # not the autoregressive start of a replica that never served with it
            out[name] = {"tau": s["emitted"] / rounds if rounds else None, "rounds": rounds,
                         "acceptance_by_position": [round(a / rounds, 4) for a in s["accepted"]] if rounds else [],
                         "requests": requests}
    return out


class _LoadGenerator:
    """``clients`` threads, each an ``openai`` client streaming greedy chat completions of the next
    prompt in turn (the prompts cycle), never retried: every failed attempt counts. Times are seconds
    since ``start``."""

    def __init__(self, handle, prompts: list[list[dict]], options):
        if not prompts:
            raise ValueError("closed_loop.load gave no prompts; check closed_loop.load.dataset")
        self.handle, self.prompts, self.options = handle, prompts, options
        self.attempts = []
        self.t0 = 0.0
        self._next = itertools.count()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self.error: BaseException | None = None

    def now(self) -> float:
        return time.monotonic() - self.t0

    def start(self) -> _LoadGenerator:
        self.t0 = time.monotonic()
        self._threads = [threading.Thread(target=self._client, args=(i,), daemon=True, name=f"closed-loop-client-{i}")
                         for i in range(self.options.clients)]
        for thread in self._threads:
            thread.start()
        return self

    def _client(self, i: int) -> None:
        import openai

        from specray.pipeline.jobs.clients import StreamAttempt, stream_chat

        client = openai.OpenAI(base_url=self.handle.base_url, api_key=self.handle.api_key or "unused",
                               timeout=self.options.request_timeout_s, max_retries=0)
        try:
            for n in itertools.count():
                if self._stop.is_set():
                    return
                with self._lock:
                    p = next(self._next) % len(self.prompts)
                attempt = StreamAttempt(client=i, request=n, retry=0, prompt=p, start_s=self.now())
                stream_chat(client, self.handle.model, self.prompts[p], self.options.max_tokens, attempt, self.t0)
                with self._lock:
                    self.attempts.append(attempt)
                self._stop.wait(self.options.pause_s)
        except BaseException as e:  # noqa: BLE001 - a bug in the client loop: raised in the driver by check()
            self.error = e

    def check(self) -> None:
        if self.error is not None:
            raise RuntimeError(f"the load generator failed: {type(self.error).__name__}: {self.error}") from self.error

    def stop(self) -> None:
        """Start no more requests; wait for the running ones to finish."""
        self._stop.set()
        for thread in self._threads:
            thread.join(self.options.request_timeout_s + 10)
        self.check()

    def _done(self) -> list:
        with self._lock:
            return list(self.attempts)

    def failed(self) -> list:
        return [a for a in self._done() if a.error is not None]

    def failed_between(self, start: float, end: float) -> int:
        """Failed attempts that were running at some time in [start, end]."""
        return sum(a.start_s <= end and a.end_s >= start for a in self.failed())

    def served_by(self, fingerprint: str) -> int:
        return sum(a.error is None and a.fingerprint == fingerprint for a in self._done())

    def summary(self) -> dict:
        done = self._done()
        return {"served": sum(a.error is None for a in done), "failed": sum(a.error is not None for a in done),
                "tokens": sum(a.tokens for a in done if a.error is None), "seconds": round(self.now(), 2)}
