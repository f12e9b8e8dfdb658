"""``specray bench load``: streaming OpenAI clients against Ray Serve replicas while the drafter
registry and the replicas are faulted.

    specray bench load --drafter runs/quickstart/train/exports/final --clients 4 --minutes 2 \\
        --json bench/load.json [-c manifests/serve.yaml] [section.field=value …]

Before the run (untimed): the greedy answers of the autoregressive target (our ``Engine`` without
a drafter, in this process) to the first ``num_prompts`` prompts of the dataset; a drafter
registry (a temporary directory unless ``registry.uri`` is given) holding ``--drafter`` as a new
version; ``replicas`` Ray Serve replicas (actors/serve.py, autoscaling pinned to that count)
awaited until each serves that version.

The run: ``clients`` threads, each an ``openai`` client streaming greedy chat completions of the
prompts in turn over loopback, for ``minutes``. At fractions of the run:

- ``publish_at``: ``--next-drafter`` (else ``--drafter`` again) is published as the next version;
- ``bad_at``: a copy of that export whose weights are corrupted (its sha256 no longer matches
  ``export.json``) is published: every replica must refuse it and keep the version it serves;
- ``oversized_at``: a copy of that export whose ``config.json`` claims
  ``architecture.intermediate_size = 2**21`` (weights unchanged) is published: every replica must
  refuse it at the bounds check, before it allocates anything the export claims;
- ``kill_at``: one replica actor is killed (``ray.kill``); Serve starts a replacement;
- ``s3_outage_at`` (an ``s3://`` registry or a training stream): for ``s3_outage_s`` seconds every
  request through the fault proxies (below) is answered ``503 SlowDown``.

``backend: vllm`` replicas serve one version each: a publish rolls them onto new replicas, and the
ones it stops (seen last before the run ended) are counted as retired, not live. Such a run needs
room for twice the replicas (actors/serve.py ``rollout_room``): the bench refuses to start without it.

With an ``s3://`` registry (``registry.endpoint_url``, else ``$SPECRAY_S3_ENDPOINT``, an
``http://`` endpoint) the replicas reach S3 through a fault proxy in this process
(pipeline/bench/s3faults.py, on 127.0.0.1: replicas and driver share one machine); the driver
publishes to S3 directly. After the run the driver samples ``/metrics`` until every live replica
serves the newest good version (the first or the next one: not the corrupt, not the oversized),
for at most ``settle_timeout_s``.

With ``train_manifest`` (an online pipeline manifest, pipeline/jobs/pipeline.py, its feature store
on ``s3://``) the driver runs that capture-and-train stream beside the clients, with serving and
bench stages off: its capture actors, broker and trainer gang reach the feature store through a
second fault proxy, which the outage refuses too. The stream starts first; the run (its clock,
clients and faults) starts once the stream deletes its first features (after its first durable
checkpoint, DESIGN.md §4): the gang is training and the producers refill the room the deletion
freed, so the fractions of the run fall in the stream's capture and training, not in its
start-up. Its ledger audit (every sample trained exactly once, none left in the store) is
reported. The ledger and the checkpoints stay where the manifest puts them, not behind a proxy
(on ``s3://`` the gang reaches them through ``$SPECRAY_S3_ENDPOINT``).

A failed attempt (an HTTP error status, an error event in the stream, a dropped connection, a
stream that ends without a finish reason) is retried up to ``retries`` times; retries are
counted apart. A failure is *from the kill* when the attempt was running at the kill or started
within ``kill_window_s`` after it. Each is either *answered* (the server sent an error: a status
or an error event in the stream), *raised* by the client without an answer (a dropped connection,
a timeout), or a stream that ends without a finish reason, which the client does not raise.
Twice a second the driver reads ``/metrics`` through the proxy (which replica answered, its
active and rejected versions).

Reported: requests served and failed (by reason), TTFT and per-token latency (p50, p99), every
greedy answer compared with the AR reference (text and token count), the drafter versions that
served (the response's ``system_fingerprint``), each replica's versions and rejections, when the
replacement replica first answered, when the live replicas all served the newest good version,
and with an ``s3://`` registry the proxy's counts (forwarded, refused in the outage, upstream
errors) and the outage window, and the training stream's audit. Needs the ``openai`` package (the
``dev`` extra).
"""

from __future__ import annotations

import gc
import json
import os
import secrets
import shutil
import socket
import tempfile
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor, wait
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Literal

import httpx2
import numpy as np
import openai
import ray
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from specray.pipeline.bench.s3faults import S3FaultProxy
from specray.pipeline.config import PipelineConfig, ServeJobConfig, load_config
from specray.pipeline.jobs.clients import TRUNCATED, StreamAttempt, stream_chat
from specray.serving.sidebyside import environment

SAMPLE_INTERVAL_S = 0.5  # the driver reads /metrics this often during the run
BAD_EXPORT_FAULT = "corrupt weights (model.safetensors bytes flipped; sha256 differs from export.json)"
OVERSIZED_FIELD, OVERSIZED_VALUE = "intermediate_size", 2 ** 21  # the claim of the oversized export's config.json
OVERSIZED_EXPORT_FAULT = f"config.json claims architecture.{OVERSIZED_FIELD} = {OVERSIZED_VALUE} (weights unchanged)"


class LoadBenchOptions(BaseModel):
    """What ``specray bench load`` runs: the drafters, the load, and when the faults happen."""

    model_config = ConfigDict(extra="forbid")

    drafter: str = Field(..., description="export directory the replicas serve first")
    next_drafter: str | None = Field(None, description="export published as the next version (None = drafter again)")
    dataset: Literal["mtbench", "humaneval"] = Field("mtbench", description="eval prompts, sent in turn")
    num_prompts: int = Field(16, gt=0, description="distinct prompts (AR references are computed for each)")
    clients: int = Field(4, gt=0, description="concurrent streaming clients")
    minutes: float = Field(2.0, gt=0, description="length of the run; requests running at the end finish")
    max_tokens: int = Field(64, gt=0, description="tokens per answer at most")
    replicas: int = Field(2, ge=2, description="Serve replicas (one is killed, so at least 2)")
    publish_at: float = Field(0.25, gt=0, lt=1, description="fraction of the run at which the next version is published")
    bad_at: float = Field(0.5, gt=0, lt=1, description="fraction of the run at which a corrupt export is published")
    oversized_at: float = Field(0.6, gt=0, lt=1, description="fraction of the run at which an export whose "
                                "config.json claims an oversized intermediate_size is published")
    kill_at: float = Field(0.75, gt=0, lt=1, description="fraction of the run at which one replica is killed")
    s3_outage_at: float | None = Field(None, gt=0, lt=1, description="fraction of the run at which requests "
                                       "through the fault proxies start being answered 503 SlowDown (None = no "
                                       "outage; needs an s3:// registry.uri or a train_manifest)")
    s3_outage_s: float = Field(10.0, gt=0, description="length of the S3 outage in seconds")
    settle_timeout_s: float = Field(120.0, gt=0, description="after the run, how long the live replicas have to "
                                    "serve the newest good version")
    train_manifest: str | None = Field(None, description="online pipeline manifest run beside the clients, its "
                                       "feature store on s3:// behind the fault proxy (None = no training stream)")
    train_overrides: list[str] = Field([], description="section.field=value overrides of train_manifest")
    train_timeout_s: float = Field(600.0, gt=0, description="after the run, how long the training stream has to finish")
    kill_window_s: float = Field(5.0, ge=0, description="attempts started this long after the kill may fail from it")
    retries: int = Field(2, ge=0, description="times a client retries a failed attempt")
    retry_backoff_s: float = Field(1.0, ge=0, description="wait before a retry")
    request_timeout_s: float = Field(120.0, gt=0, description="an attempt taking longer fails (timeout)")
    startup_timeout_s: float = Field(600.0, gt=0, description="replicas must serve the first version, and the "
                                     "training stream delete its first features, within this")
    max_requests_per_client: int = Field(100_000, gt=0, description="bound on each client's loop")

    @field_validator("drafter", "next_drafter")
    @classmethod
    def _is_export(cls, value: str | None) -> str | None:
        if value is not None and not (Path(value) / "config.json").is_file():
            raise ValueError(f"{value} is not a drafter export (no config.json); pass a directory `specray export` wrote")
        return value

    @model_validator(mode="after")
    def _faults_in_order(self) -> LoadBenchOptions:
        for name in ("bad_at", "oversized_at"):
            if not self.publish_at < getattr(self, name):
                raise ValueError(f"publish_at ({self.publish_at}) must come before {name} ({getattr(self, name)}): "
                                 "the faulty export is a copy of the published one")
        if self.s3_outage_at is not None and self.s3_outage_at * 60 * self.minutes + self.s3_outage_s >= 60 * self.minutes:
            raise ValueError(f"the S3 outage (s3_outage_at={self.s3_outage_at} of {60 * self.minutes:g} s, "
                             f"s3_outage_s={self.s3_outage_s:g}) must end before the run does: start it earlier, "
                             "shorten it or lengthen minutes")
        if self.train_overrides and self.train_manifest is None:
            raise ValueError(f"train_overrides {self.train_overrides} without train_manifest: give the online "
                             "pipeline manifest they apply to, or drop them")
        return self


def bench_load(options: LoadBenchOptions, config: str | None = None, overrides: list[str] | None = None) -> dict:
    """Run the load-and-fault benchmark (module docstring) on the Serve config ``config`` + ``overrides``."""

    from specray.actors.cluster import connect
    from specray.actors.serve import rollout_room, start_serving
    from specray.serving.registry import DrafterRegistry

    with tempfile.TemporaryDirectory(prefix="specray-bench-load-") as tmp:
        cfg = load_config(ServeJobConfig, config, _serve_overrides(options, Path(tmp)) + list(overrides or []))
        if cfg.registry.uri is None:
            raise ValueError("registry.uri=null: the load bench publishes versions to a registry; drop the override "
                             "(a temporary one is used) or give a path or s3:// URI")
        stream = _stream_config(options, Path(tmp)) if options.train_manifest else None
        proxies = _proxies(options, cfg, stream)  # started once Ray is up
        prompts = _prompts(options)
        references = _references(cfg, prompts, options.max_tokens)
        registry = DrafterRegistry(cfg.registry.uri, endpoint_url=cfg.registry.endpoint_url)
        first = registry.publish(options.drafter)
        ray_was_up = ray.is_initialized()
        connect(cfg.ray.address, cfg.ray.num_cpus)
        cramped = rollout_room(cfg, ray.cluster_resources())
        if cramped:  # the publish would wait for room the cluster may never get
            if not ray_was_up:
                ray.shutdown()
            raise ValueError(cramped)
        for proxy in proxies.values():
            proxy.start()
        try:
            handle = start_serving(_behind(cfg, "registry", proxies.get("registry")), timeout_s=options.startup_timeout_s)
            try:
                monitor = _Monitor(handle.url, handle.api_key)
                monitor.wait(lambda: monitor.serving(first) >= options.replicas, options.startup_timeout_s,
                             f"{options.replicas} replicas serving version {first}")
                training = None if stream is None else _TrainingStream(_behind(stream, "store", proxies["store"]))
                if training is not None:
                    training.start()
                    monitor.wait(lambda: "DELETE" in proxies["store"].first_request_at or not training.is_alive(),
                                 options.startup_timeout_s, "the training stream's first deletion of features")
                run = _Run(options, handle, prompts, registry, Path(tmp), monitor, proxies, first, training)
                run.execute()
                run.settled_at_s = monitor.settle(options.replicas, run.killed_replica, run.newest_good,
                                                  options.settle_timeout_s, run.t0)
                if training is not None:
                    training.join(options.train_timeout_s)
            finally:
                handle.stop()  # and Serve, when this run started it
                if not ray_was_up:
                    ray.shutdown()
        finally:
            for proxy in proxies.values():
                proxy.stop()
    return _report(options, cfg, references, first, run, monitor)


def _s3_endpoint(uri: str, endpoint_url: str | None, field: str) -> str:
    endpoint = endpoint_url or os.environ.get("SPECRAY_S3_ENDPOINT")
    if endpoint is None:
        raise ValueError(f"{uri} has no endpoint: the load bench reaches S3 through a loopback fault proxy, which "
                         f"needs the server's http:// endpoint: give {field}=http://host:port")
    return endpoint


def _proxies(options: LoadBenchOptions, cfg: ServeJobConfig, stream: PipelineConfig | None) -> dict[str, S3FaultProxy]:
    """The fault proxies (not started): ``registry`` for the replicas of an ``s3://`` registry, ``store``
    for the training stream's feature store."""
    proxies = {}
    if cfg.registry.uri.startswith("s3://"):
        proxies["registry"] = S3FaultProxy(_s3_endpoint(cfg.registry.uri, cfg.registry.endpoint_url,
                                                        "registry.endpoint_url"))
    if stream is not None:
        proxies["store"] = S3FaultProxy(_s3_endpoint(stream.store.uri, stream.store.endpoint_url,
                                                     "store.endpoint_url (in train_overrides)"))
    if options.s3_outage_at is not None and not proxies:
        raise ValueError(f"s3_outage_at={options.s3_outage_at} needs an s3:// registry (registry.uri="
                         f"{cfg.registry.uri}) or a train_manifest: give registry.uri=s3://bucket/prefix and "
                         "registry.endpoint_url, or drop s3_outage_at")
    return proxies


def _behind(cfg, section: str, proxy: S3FaultProxy | None):
    """``cfg`` with ``<section>.endpoint_url`` moved to ``proxy``, when there is one."""
    if proxy is None:
        return cfg
    part = getattr(cfg, section)
    return cfg.model_copy(update={section: part.model_copy(update={"endpoint_url": proxy.endpoint_url})})


def _stream_config(options: LoadBenchOptions, tmp: Path) -> PipelineConfig:
    """The training stream's pipeline config: ``train_manifest`` + ``train_overrides``, with no serving
    or bench stage, in a run dir of its own."""
    forced = ["serve.enabled=false", "bench.enabled=false", f"output.run_dir={tmp / 'train'}"]
    cfg = load_config(PipelineConfig, options.train_manifest, [*options.train_overrides, *forced])
    if cfg.mode != "online":
        raise ValueError(f"train_manifest {options.train_manifest} has mode: {cfg.mode}; the load bench runs an "
                         "online stream beside the clients: give an online manifest (manifests/online.yaml)")
    if not (cfg.store.uri or "").startswith("s3://"):
        raise ValueError(f"train_manifest {options.train_manifest}: store.uri={cfg.store.uri} is not on S3; the "
                         "stream's features go through the fault proxy: give store.uri=s3://bucket/prefix")
    return cfg


def _serve_overrides(options: LoadBenchOptions, tmp: Path) -> list[str]:
    """The bench's Serve settings (a user override after them wins): a fresh registry polled every
    second, exactly ``replicas`` replicas, a free loopback port and a random API key."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return ["name=bench-load", f"registry.uri={tmp / 'registry'}", "registry.poll_interval_s=1",
            f"autoscaling.min_replicas={options.replicas}", f"autoscaling.max_replicas={options.replicas}",
            "http.host=127.0.0.1", f"http.port={port}", f"http.api_key=sk-bench-{secrets.token_hex(8)}",
            f"output.run_dir={tmp / 'serve'}"]


def _prompts(options: LoadBenchOptions) -> list[list[dict]]:
    from specray.capture.data import load_conversations

    return [c.as_chat() for c in load_conversations(options.dataset, purpose="eval", limit=options.num_prompts)]


@dataclass(frozen=True)
class _Reference:
    text: str
    tokens: int


def _references(cfg: ServeJobConfig, prompts: list[list[dict]], max_tokens: int) -> list[_Reference]:
    """Greedy answers of the target alone (our engine without a drafter), computed here once."""
    from specray.capture.target import load_target
    from specray.serving.engine import Engine
    from specray.serving.sampling import SamplingParams

    target = load_target(cfg.target.name, dtype=cfg.target.dtype, device=cfg.target.device)
    engine = Engine(target, None, max_batch=cfg.engine.max_batch, max_len=cfg.engine.max_len)
    outputs = engine.generate(prompts, SamplingParams(max_tokens=max_tokens, temperature=0.0))
    del engine, target
    gc.collect()
    return [_Reference(o.text, len(o.token_ids)) for o in outputs]


def _oversized_copy(export: Path, out: Path) -> Path:
    """``export`` whose ``config.json`` claims ``OVERSIZED_VALUE`` for ``architecture.OVERSIZED_FIELD``
    (weights unchanged): a load refuses it at the bounds check, before building anything."""
    shutil.copytree(export, out)
    config = json.loads((out / "config.json").read_text())
    if OVERSIZED_FIELD not in config.get("architecture", {}):
        raise ValueError(f"{export}/config.json has no architecture.{OVERSIZED_FIELD} to oversize; publish an "
                         "export of an algorithm with an MLP (eagle3, dflash, dspark, dflash2) as --next-drafter")
    config["architecture"][OVERSIZED_FIELD] = OVERSIZED_VALUE
    (out / "config.json").write_text(json.dumps(config, indent=2))
    return out


def _corrupt_copy(export: Path, out: Path) -> Path:
    """``export`` with bytes of its weights flipped (same size): a load fails its sha256 check."""
    shutil.copytree(export, out)
    weights = out / "model.safetensors"
    data = bytearray(weights.read_bytes())
    for i in range(len(data) - 64, len(data)):  # tensor data, after the safetensors header
        data[i] ^= 0xFF
    weights.write_bytes(bytes(data))
    return out


# -- observing the replicas --------------------------------------------------------------


class _Monitor:
    """Reads ``/metrics`` through the proxy; each answer says which replica gave it and that
    replica's active and rejected drafter versions. Times are ``time.monotonic()``."""

    def __init__(self, url: str, api_key: str | None):
        self.url = url
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.replicas: dict[str, dict] = {}  # replica id -> first/last seen, active, first time each version was active, rejected
        self.errors: Counter = Counter()

    def sample(self) -> None:
        try:
            response = httpx2.get(f"{self.url}/metrics", headers=self.headers, timeout=10, trust_env=False)
            response.raise_for_status()
            metrics = response.json()
        except (httpx2.HTTPError, ValueError) as e:  # a replica going away: counted, sampled again next time
            self.errors[type(e).__name__] += 1
            return
        now = time.monotonic()
        r = self.replicas.setdefault(metrics["replica"], {"first_seen": now, "active_since": {}, "rejected": {}})
        r["last_seen"], r["active"] = now, metrics["active_version"]
        r["active_since"].setdefault(metrics["active_version"], now)
        for rejected in metrics["rejected_versions"]:
            r["rejected"].setdefault(rejected["version"], rejected["error"])
        for version, reason in (metrics.get("registry_rejected") or {}).items():  # skipped: rejected in the registry
            r["rejected"].setdefault(int(version), reason)

    def serving(self, version: int, excluded: str | None = None) -> int:
        """Replicas last seen with ``version`` active."""
        return sum(r["active"] == version for rid, r in self.replicas.items() if rid != excluded)

    def wait(self, predicate, timeout_s: float, what: str) -> None:
        deadline = time.monotonic() + timeout_s
        while not predicate():
            if time.monotonic() > deadline:
                raise TimeoutError(f"waited {timeout_s:.0f} s for {what}; replicas seen: "
                                   f"{ {rid: r['active'] for rid, r in self.replicas.items()} }, /metrics errors {dict(self.errors)}")
            self.sample()
            time.sleep(0.2)

    def settle(self, replicas: int, excluded: str | None, version: int, timeout_s: float, t0: float) -> float | None:
        """After the run: sample until ``replicas`` live replicas (the killed one aside) have answered
        since now and all of them serve ``version``, for at most ``timeout_s``. Returns when that
        held (seconds since ``t0``), or None if it did not within the time."""
        since = time.monotonic()
        deadline = since + timeout_s
        while time.monotonic() < deadline:
            self.sample()
            fresh = [r for rid, r in self.replicas.items() if rid != excluded and r["last_seen"] >= since]
            if len(fresh) >= replicas and all(r["active"] == version for r in fresh):
                return time.monotonic() - t0
            time.sleep(0.2)
        return None


def _client_loop(i: int, options: LoadBenchOptions, handle, prompts: list[list[dict]], t0: float, deadline: float,
                 stop: threading.Event, attempts: list[StreamAttempt]) -> None:
    """Client ``i``: prompts i, i + clients, … in turn until the deadline; failed attempts retried."""
    client = openai.OpenAI(base_url=handle.base_url, api_key=handle.api_key or "unused",
                           timeout=options.request_timeout_s, max_retries=0)
    for n in range(options.max_requests_per_client):
        if time.monotonic() >= deadline or stop.is_set():
            return
        p = (i + n * options.clients) % len(prompts)
        for retry in range(options.retries + 1):
            attempt = StreamAttempt(client=i, request=n, retry=retry, prompt=p, start_s=time.monotonic() - t0)
            stream_chat(client, handle.model, prompts[p], options.max_tokens, attempt, t0)
            attempts.append(attempt)
            if not attempt.retryable or stop.wait(options.retry_backoff_s):
                break


class _TrainingStream(threading.Thread):
    """``run_pipeline`` of an online manifest on a thread: its report's ledger audit, or the error
    that stopped it. Times are ``time.monotonic()``."""

    def __init__(self, cfg: PipelineConfig):
        super().__init__(daemon=True, name="bench-load-training")
        self.cfg = cfg
        self.online: dict | None = None
        self.error: str | None = None
        self.started = self.ended = None

    def run(self) -> None:
        from specray.pipeline.jobs.pipeline import run_pipeline

        self.started = time.monotonic()
        try:
            report, _ = run_pipeline(self.cfg, progress=False)  # serve.enabled=false: no handle
            self.online = report.online
        except Exception as e:  # noqa: BLE001 - reported, and the check fails: the run goes on to its report
            self.error = f"{type(e).__name__}: {e}"
        finally:
            self.ended = time.monotonic()


# -- the run -----------------------------------------------------------------------------


class _Run:
    """The clients plus the faults, each fired at its time by the driver thread."""

    def __init__(self, options: LoadBenchOptions, handle, prompts: list[list[dict]], registry, tmp: Path,
                 monitor: _Monitor, proxies: dict[str, S3FaultProxy], first: int, training: _TrainingStream | None):
        self.options, self.handle, self.prompts, self.registry = options, handle, prompts, registry
        self.tmp, self.monitor, self.proxies, self.first, self.training = tmp, monitor, proxies, first, training
        self.settled_at_s: float | None = None  # when every live replica served the newest good version
        self.attempts: list[StreamAttempt] = []
        self.events: list[dict] = []  # faults as they happened: at_s, what, version / replica
        self.killed_replica: str | None = None
        self.t0 = self.seconds = 0.0
        self.unfinished_clients = 0
        self.load_average_at_start: list[float] = []  # 1, 5, 15 min: the report's environment has the end's

    def execute(self) -> None:
        o = self.options
        self.seconds = 60.0 * o.minutes
        faults = [(o.publish_at, self._publish_next), (o.bad_at, self._publish_bad),
                  (o.oversized_at, self._publish_oversized), (o.kill_at, self._kill)]
        if o.s3_outage_at is not None:
            faults.append((o.s3_outage_at, self._s3_outage))
        faults.sort(key=lambda f: f[0])
        stop = threading.Event()
        self.load_average_at_start = list(os.getloadavg())
        self.t0 = time.monotonic()
        deadline = self.t0 + self.seconds
        pool = ThreadPoolExecutor(max_workers=o.clients, thread_name_prefix="bench-load-client")
        clients = [pool.submit(_client_loop, i, o, self.handle, self.prompts, self.t0, deadline, stop, self.attempts)
                   for i in range(o.clients)]
        try:
            while time.monotonic() < deadline:
                while faults and time.monotonic() - self.t0 >= faults[0][0] * self.seconds:
                    faults.pop(0)[1]()
                self.monitor.sample()
                time.sleep(max(0.0, min(SAMPLE_INTERVAL_S, deadline - time.monotonic())))
            done, pending = wait(clients, timeout=(o.request_timeout_s + o.retry_backoff_s) * (o.retries + 1))
        finally:
            stop.set()  # also when a fault failed: clients stop starting requests
            pool.shutdown(wait=False, cancel_futures=True)
        self.unfinished_clients = len(pending)
        for client in done:
            client.result()  # a client that raised is a bug in the bench: raise it here

    def _event(self, what: str, **details) -> None:
        self.events.append({"at_s": time.monotonic() - self.t0, "what": what, **details})

    def _publish_next(self) -> None:
        export = self.options.next_drafter or self.options.drafter
        self._event("publish", version=self.registry.publish(export), export=str(export))

    def _publish_bad(self) -> None:
        export = Path(self.options.next_drafter or self.options.drafter)
        bad = _corrupt_copy(export, self.tmp / "corrupt-export")
        self._event("publish-bad", version=self.registry.publish(bad), fault=BAD_EXPORT_FAULT)

    def _publish_oversized(self) -> None:
        export = Path(self.options.next_drafter or self.options.drafter)
        oversized = _oversized_copy(export, self.tmp / "oversized-export")
        self._event("publish-oversized", version=self.registry.publish(oversized), fault=OVERSIZED_EXPORT_FAULT)

    def _s3_outage(self) -> None:
        for proxy in self.proxies.values():
            proxy.outage(self.options.s3_outage_s)
        self._event("s3-outage", seconds=self.options.s3_outage_s)

    @property
    def newest_good(self) -> int:
        """The newest version published that is neither corrupt nor oversized."""
        return max([self.first] + [e["version"] for e in self.events if e["what"] == "publish"])

    def _kill(self) -> None:
        """Kill the replica actor that answered /metrics most recently (it is taking requests)."""
        names = {a["name"].rsplit("#", 1)[-1]: (a["name"], a["namespace"])
                 for a in ray.util.list_named_actors(all_namespaces=True)
                 if a["name"].startswith("SERVE_REPLICA::") and f"::{self.handle.app_name}#" in a["name"]}
        seen = sorted((r["last_seen"], rid) for rid, r in self.monitor.replicas.items() if rid in names)
        if not seen:
            raise RuntimeError(f"no replica actor of app {self.handle.app_name!r} has answered /metrics; "
                               f"replica actors: {sorted(names)}")
        self.killed_replica = seen[-1][1]
        name, namespace = names[self.killed_replica]
        ray.kill(ray.get_actor(name, namespace=namespace), no_restart=True)
        self._event("kill", replica=self.killed_replica)


# -- the report --------------------------------------------------------------------------


def _percentiles(values: list[float]) -> dict:
    if not values:
        return {"p50": None, "p99": None, "n": 0}
    p50, p99 = np.percentile(values, [50, 99])
    return {"p50": float(p50), "p99": float(p99), "n": len(values)}


def _failures(run: _Run) -> dict:
    kill = next((e["at_s"] for e in run.events if e["what"] == "kill"), None)
    window = run.options.kill_window_s

    def from_kill(a: StreamAttempt) -> bool:
        return kill is not None and a.end_s >= kill and a.start_s <= kill + window

    failed = [a for a in run.attempts if a.error]
    groups: dict[str, dict] = {}
    for a in failed:
        g = groups.setdefault(a.error, {"count": 0, "from_kill": 0, "server_error": a.server_error,
                                          "example": a.detail})
        g["count"] += 1
        g["from_kill"] += from_kill(a)
    last = {}
    for a in run.attempts:  # a request's outcome is its last attempt's
        last[(a.client, a.request)] = a
    return {
        "attempts_failed": len(failed),
        "attempts_failed_from_kill": sum(map(from_kill, failed)),
        "attempts_failed_not_from_kill": sum(not from_kill(a) for a in failed),
        "attempts_failed_without_server_error": sum(not a.server_error for a in failed),
        "attempts_failed_without_server_error_not_from_kill": sum(not a.server_error and not from_kill(a) for a in failed),
        "requests_failed_after_retries": sum(a.error is not None for a in last.values()),
        "in_flight_at_kill": sum(a.start_s <= kill <= a.end_s for a in run.attempts) if kill is not None else 0,
        "by_reason": groups,
    }, last


def _greedy(served: list[StreamAttempt], references: list[_Reference]) -> dict:
    mismatches = [a for a in served
                  if (a.text, a.tokens) != (references[a.prompt].text, references[a.prompt].tokens)]
    return {"compared": len(served), "mismatches": len(mismatches),
            "mismatches_by_version": dict(Counter(a.fingerprint for a in mismatches)),
            "examples": [{"prompt": a.prompt, "version": a.fingerprint, "got": a.text[:200],
                          "tokens": a.tokens, "expected": references[a.prompt].text[:200],
                          "expected_tokens": references[a.prompt].tokens} for a in mismatches[:3]]}


def _replicas(run: _Run, monitor: _Monitor) -> dict:
    kill = next((e["at_s"] for e in run.events if e["what"] == "kill"), None)
    out = {}
    for rid, r in monitor.replicas.items():
        first = r["first_seen"] - run.t0
        out[rid] = {"first_seen_s": first, "last_seen_s": r["last_seen"] - run.t0, "active_version": r["active"],
                    "active_since_s": {str(v): t - run.t0 for v, t in r["active_since"].items()},
                    "rejected": {str(v): e for v, e in r["rejected"].items()},
                    "killed": rid == run.killed_replica,
                    # stopped by a rolling update (backend vllm): last seen before the run ended
                    "retired": rid != run.killed_replica and r["last_seen"] - run.t0 < run.seconds,
                    "replacement": kill is not None and first > kill}
    return out


def _refused_by_every_live_replica(version: int | None, live: list[dict], reason: str = "") -> bool:
    """``version`` rejected by each live replica (with ``reason`` in the message) and never active on one."""
    return version is not None and bool(live) and all(
        str(version) in r["rejected"] and reason in r["rejected"][str(version)]
        and str(version) not in r["active_since_s"] for r in live)


def _checks(run: _Run, failures: dict, greedy: dict, versions: Counter, replicas: dict, s3: dict | None,
            training: dict | None) -> dict:
    published = {e["what"]: e["version"] for e in run.events if "version" in e}
    bad, oversized = published.get("publish-bad"), published.get("publish-oversized")
    live = [r for r in replicas.values() if not r["killed"] and not r["retired"]]
    s3_checks = {} if s3 is None or s3["outage"] is None else {
        f"s3_outage_refused_{name}_requests": counts["refused"] > 0 for name, counts in s3["proxies"].items()}
    return {
        "greedy_all_match_ar": greedy["compared"] > 0 and greedy["mismatches"] == 0,
        "failures_only_from_kill": failures["attempts_failed_not_from_kill"] == 0,
        "failures_raised_by_the_client": TRUNCATED not in failures["by_reason"],
        # a stream the kill cut ends in a dropped connection (no replica is left to answer); any other
        # failure must be an answer: a status or an error event
        "failures_answered_with_an_error": failures["attempts_failed_without_server_error_not_from_kill"] == 0,
        "no_request_failed_after_retries": failures["requests_failed_after_retries"] == 0,
        "bad_version_rejected_by_every_live_replica": _refused_by_every_live_replica(bad, live),
        "bad_version_never_served": f"specray-drafter-v{bad}" not in versions,
        # the bounds check names the field: the replica refused the claim before building the drafter
        "oversized_version_rejected_by_every_live_replica": _refused_by_every_live_replica(
            oversized, live, f"architecture.{OVERSIZED_FIELD} = {OVERSIZED_VALUE} is outside"),
        "oversized_version_never_served": f"specray-drafter-v{oversized}" not in versions,
        "new_version_served": f"specray-drafter-v{published.get('publish')}" in versions,
        "live_replicas_on_newest_good_version": run.settled_at_s is not None and bool(live) and all(
            r["active_version"] == run.newest_good for r in live),
        **s3_checks,
        **({} if training is None else {"training_samples_exactly_once": training["error"] is None and training[
            "audit"]["ok"] and training["audit"]["trained"] > 0}),
        "clients_finished": run.unfinished_clients == 0,
    }


def _s3(run: _Run) -> dict | None:
    """Each fault proxy's counts and the outage window (seconds since the start)."""
    if not run.proxies:
        return None
    outage = next((e for e in run.events if e["what"] == "s3-outage"), None)
    window = None if outage is None else {"start_s": outage["at_s"], "end_s": outage["at_s"] + outage["seconds"]}
    def since_t0(at: float | None) -> float | None:
        return None if at is None else at - run.t0

    return {"proxies": {name: p.counts() | {"first_request_s": since_t0(min(p.first_request_at.values(), default=None)),
                                             "last_request_s": since_t0(p.last_request_at)}
                        for name, p in run.proxies.items()},
            "upstreams": {name: p.upstream for name, p in run.proxies.items()}, "outage": window}


def _training(run: _Run) -> dict | None:
    """The training stream: its manifest, when it ran (seconds since the start), its audit or error."""
    t = run.training
    if t is None:
        return None
    return {"manifest": run.options.train_manifest, "store": t.cfg.store.uri,
            "start_s": None if t.started is None else t.started - run.t0,
            "end_s": None if t.ended is None else t.ended - run.t0, "error": t.error or (
                f"not finished within train_timeout_s={run.options.train_timeout_s}" if t.ended is None else None),
            "audit": (t.online or {}).get("audit"), "capture": (t.online or {}).get("capture"),
            "peak_inflight_samples": (t.online or {}).get("peak_inflight_samples"),
            "ledger": (t.online or {}).get("ledger")}


def _report(options: LoadBenchOptions, cfg: ServeJobConfig, references: list[_Reference], first: int, run: _Run,
            monitor: _Monitor) -> dict:
    failures, last = _failures(run)
    served = [a for a in last.values() if a.error is None]
    versions = Counter(a.fingerprint for a in served)
    greedy = _greedy(served, references)
    replicas = _replicas(run, monitor)
    tokens = sum(a.tokens for a in served)
    s3, training = _s3(run), _training(run)
    return {
        "benchmark": "load", "target": cfg.target.name, "options": options.model_dump(),
        "serve": {"backend": cfg.backend, "engine": cfg.engine.model_dump(),
                  **({"vllm": cfg.vllm.model_dump()} if cfg.backend == "vllm" else {}),
                  "replica": cfg.replica.model_dump(), "num_gpus_per_replica": cfg.num_gpus_per_replica,
                  "registry_poll_interval_s": cfg.registry.poll_interval_s},
        "seconds": run.seconds, "first_version": first, "events": run.events,
        "requests": {"served": len(served), "failed": failures["requests_failed_after_retries"],
                     "attempts": len(run.attempts), "retries": sum(a.retry > 0 for a in run.attempts),
                     "retries_succeeded": sum(a.retry > 0 and a.error is None for a in run.attempts)},
        "failures": failures,
        "tokens": tokens, "tokens_per_s": tokens / run.seconds,
        "ttft_s": _percentiles([a.ttft_s for a in served if a.ttft_s is not None]),
        "tpot_s": _percentiles([a.tpot_s for a in served if a.tpot_s is not None]),
        "greedy": greedy,
        "versions_seen": dict(sorted(versions.items(), key=lambda kv: str(kv[0]))),
        "replicas": replicas, "metrics_read_errors": dict(monitor.errors),
        "newest_good_version": run.newest_good, "settled_at_s": run.settled_at_s, "s3": s3, "training": training,
        "checks": _checks(run, failures, greedy, versions, replicas, s3, training),
        "attempts": [asdict(a) | {"text": None} for a in run.attempts if a.error or a.retry],
        "environment": environment() | {"load_average_at_start": run.load_average_at_start},
    }


def _ms(stats: dict) -> str:
    return "-" if stats["p50"] is None else f"p50 {1000 * stats['p50']:.0f} ms, p99 {1000 * stats['p99']:.0f} ms"


def _span(start: float | None, end: float | None) -> str:
    return "-" if start is None or end is None else f"{start:.1f}-{end:.1f} s"


def _event_detail(event: dict) -> str:
    if event["what"] == "s3-outage":
        return f"{event['seconds']:g} s"
    return str(event.get("version", event.get("replica")))


def load_table(result: dict) -> str:
    req, fail, g = result["requests"], result["failures"], result["greedy"]
    lines = [
        f"requests   {req['served']} served, {req['failed']} failed after retries; {req['attempts']} attempts, "
        f"{req['retries']} retries ({req['retries_succeeded']} succeeded)",
        f"failures   {fail['attempts_failed']} attempts ({fail['attempts_failed_from_kill']} from the kill, "
        f"{fail['attempts_failed_without_server_error']} without a server error); {fail['in_flight_at_kill']} in flight at the kill",
    ]
    lines += [f"  {n['count']:>4} x {reason} ({n['from_kill']} from the kill): {n['example']}"
              for reason, n in fail["by_reason"].items()]
    lines += [
        f"TTFT       {_ms(result['ttft_s'])};  per token {_ms(result['tpot_s'])};  "
        f"{result['tokens_per_s']:.1f} tokens/s over {result['seconds']:.0f} s",
        f"greedy     {g['compared'] - g['mismatches']} of {g['compared']} answers equal the AR reference",
        "versions   " + ", ".join(f"{v}: {n}" for v, n in result["versions_seen"].items()),
        "events     " + "; ".join(f"{e['at_s']:.1f} s {e['what']} " + _event_detail(e) for e in result["events"]),
        f"settled    every live replica on v{result['newest_good_version']} (the newest good) "
        + ("not within the settle time" if result["settled_at_s"] is None else f"at {result['settled_at_s']:.1f} s"),
        f"{'replica':<10} {'seen from':>9} {'to (s)':>7}  {'active since (s)':<24} rejected",
    ]
    for rid, r in result["replicas"].items():
        note = ("  (killed)" if r["killed"] else "  (retired)" if r["retired"]
                else "  (replacement)" if r["replacement"] else "")
        since = ", ".join(f"{'AR' if v == 'None' else 'v' + v} {t:.1f}" for v, t in r["active_since_s"].items())
        rejected = ",".join(f"v{v}" for v in r["rejected"]) or "-"
        lines.append(f"{rid[:10]:<10} {r['first_seen_s']:>9.1f} {r['last_seen_s']:>7.1f}  {since:<24} {rejected}{note}")
    s3, training = result["s3"], result["training"]
    if s3 is not None:
        outage = s3["outage"]
        lines.append("s3         " + ("no outage" if outage is None else
                                      f"outage {outage['start_s']:.1f}-{outage['end_s']:.1f} s (503 SlowDown)"))
        lines += [f"  {name:<9} proxy: {c['forwarded']} requests forwarded, {c['refused']} refused, "
                  f"{c['upstream_errors']} upstream errors; requests {_span(c['first_request_s'], c['last_request_s'])}"
                  for name, c in s3["proxies"].items()]
    if training is not None:
        audit = training["audit"]
        outcome = training["error"] if audit is None else (
            f"{audit['trained']} samples trained exactly once: {audit['ok']} ({audit['duplicates']} duplicated, "
            f"{audit['missing']} missing, {audit['leftover_features']} features left)")
        lines.append(f"training   {_span(training['start_s'], training['end_s'])}: {outcome}")
    env = result["environment"]
    lines.append(f"machine    {env['cpus']} CPUs; load average (1 min) {env['load_average_at_start'][0]:.1f} at the start, "
                 f"{env['load_average'][0]:.1f} at the end")
    lines.append("checks     " + ", ".join(f"{k} {'ok' if v else 'FAILED'}" for k, v in result["checks"].items()))
    return "\n".join(lines)
