"""Ray Serve deployment of the OpenAI-compatible server: autoscaled replicas that hot-load drafters.

    handle = start_serving(load_config(ServeJobConfig, "manifests/serve.yaml"))
    client = openai.OpenAI(base_url=handle.base_url, api_key=handle.api_key or "unused")
    client.chat.completions.create(model=handle.model, messages=[{"role": "user", "content": "Hi"}])
    handle.stop()

or ``specray serve -c manifests/serve.yaml [section.field=value …]`` (until Ctrl-C).

Each replica (``SpecrayReplica``) loads the target, owns an ``Engine`` stepped by an
``EngineLoop`` thread and, with a registry, a ``RegistryPoller`` that keeps it on the version it
should serve (the pinned one, else the newest good one), hot-loaded between engine steps, and
reports what it serves to the registry (serving/engine.py, serving/poller.py, serving/registry.py).
Its HTTP app is serving/openai_api.py's, built in the replica (a FastAPI ingress) behind its
request guard (API key or loopback clients only, body and prompt limits: ``http.limits``), so Ray
adds only what Ray is for: the metrics API (``ReplicaMetrics``: every replica's stats in Ray's
Prometheus endpoint, tagged with its replica id and drafter version), the proxy on
``http.host:http.port`` (127.0.0.1 by default; any other host is refused without an API key),
Serve's autoscaler between ``min_replicas`` and ``max_replicas`` aiming at
``target_ongoing_requests`` per replica, and replacement of a replica that died or whose engine
loop thread stopped (``check_health``). With ``record.uri`` each replica records its finished
requests under ``<record.uri>/<replica id>/`` (serving/recorder.py). Local paths in the config
are made absolute for the replicas; on a cluster of several machines use an ``s3://`` registry,
since replicas may run where the driver's files are not.
"""

from __future__ import annotations

import logging
import os
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import ray
from ray import serve

from specray.actors.cluster import connect, serve_replica_on_loopback
from specray.capture.chat import resolve_chat_template
from specray.capture.devices import resolve_device
from specray.capture.target import load_target
from specray.serving.engine import Engine, EngineLoop
from specray.serving.http_guard import HttpLimits, is_loopback, normalize_api_key
from specray.serving.openai_api import create_app
from specray.serving.recorder import RecordSettings, TrafficRecorder
from specray.serving.poller import RegistryPoller
from specray.serving.registry import DrafterRegistry

if TYPE_CHECKING:
    from specray.pipeline.config import ServeJobConfig

log = logging.getLogger(__name__)
METRICS_INTERVAL_S = 5.0  # how often a replica refreshes its Ray Serve metrics

# engine stats -> Ray Serve metrics: (name, stats key, description)
_GAUGES = (("tokens_per_second", "tokens_per_second", "generated tokens per second over the last minute"),
           ("requests_running", "requests_running", "requests in KV slots"),
           ("requests_waiting", "requests_waiting", "requests queued for a slot"),
           ("tau", "tau", "mean tokens per round of the active drafter version (accepted drafts + 1)"))
_COUNTERS = (("tokens_generated", "tokens_generated", "tokens generated"),
             ("requests_served", "requests_served", "requests finished"),
             ("requests_aborted", "requests_aborted", "requests aborted"),
             ("requests_failed", "requests_failed", "requests failed"))


class ReplicaMetrics:
    """A replica's engine stats as Ray Serve metrics (``ray.serve.metrics``), so Ray's Prometheus
    endpoint holds every replica's: Serve tags each with ``deployment``, ``replica`` and
    ``application``; specray adds ``model`` and ``version`` (the drafter version, ``ar`` without
    one). Names (Prometheus adds Ray's ``ray_`` prefix): ``specray_tokens_per_second``,
    ``specray_requests_running``, ``specray_requests_waiting``, ``specray_tau`` (the active
    version's), ``specray_version_tau`` (every version this replica served), and the counters
    ``specray_tokens_generated``, ``specray_requests_served`` / ``_aborted`` / ``_failed``
    (counted under the version active when they were counted). ``update()`` reads the engine
    once; ``start()`` calls it every ``interval_s`` on a thread."""

    def __init__(self, engine, model: str, *, interval_s: float = METRICS_INTERVAL_S, metrics=None):
        if metrics is None:
            from ray.serve import metrics
        self.engine, self.model, self.interval_s = engine, model, interval_s
        tags = ("model", "version")
        self.gauges = {name: metrics.Gauge(f"specray_{name}", description=text, tag_keys=tags)
                       for name, _, text in _GAUGES}
        self.gauges["version_tau"] = metrics.Gauge("specray_version_tau", tag_keys=tags,
                                                   description="mean tokens per round of each drafter version served")
        self.counters = {name: metrics.Counter(f"specray_{name}", description=text, tag_keys=tags)
                         for name, _, text in _COUNTERS}
        self._counted = {name: 0 for name, _, _ in _COUNTERS}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def update(self) -> None:
        stats = self.engine.stats()
        tags = {"model": self.model, "version": _version_tag(stats["active_version"])}
        for name, key, _ in _GAUGES:
            if stats[key] is not None:
                self.gauges[name].set(stats[key], tags=tags)
        for entry in stats["versions"]:
            if entry["tau"] is not None:
                self.gauges["version_tau"].set(entry["tau"], tags={"model": self.model,
                                                                   "version": _version_tag(entry["version"])})
        for name, key, _ in _COUNTERS:
            if stats[key] > self._counted[name]:
                self.counters[name].inc(stats[key] - self._counted[name], tags=tags)
                self._counted[name] = stats[key]

    def start(self) -> ReplicaMetrics:
        self._thread = threading.Thread(target=self._run, daemon=True, name="specray-serve-metrics")
        self._thread.start()
        return self

    def stop(self, timeout: float = 5.0) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self.update()
            except Exception as e:  # noqa: BLE001 - metrics must never take a replica down; retried next interval
                log.warning("updating the Ray Serve metrics failed: %s", e)


def _version_tag(version: int | None) -> str:
    return "ar" if version is None else str(version)


@dataclass(frozen=True)
class ReplicaSpec:
    """What one replica needs, as plain values (built from a ServeJobConfig by ``replica_spec``)."""

    target: str
    dtype: str
    device: str
    model_name: str
    max_batch: int
    max_len: int
    drafter_dir: str | None  # absolute; the version to start with (None = autoregressive)
    registry_uri: str | None  # absolute file:// or s3://
    registry_endpoint_url: str | None
    poll_interval_s: float
    cache_dir: str  # absolute; pulled versions
    num_threads: int | None
    api_key: str | None
    num_speculative_tokens: int | None = None
    max_speculative_batch: int | None = None
    speculation: str = "auto"
    tree: bool = False
    cost_table: str | None = None  # absolute
    limits: HttpLimits = field(default_factory=HttpLimits)  # the config's http.limits
    record: RecordSettings = field(default_factory=RecordSettings)  # the config's record section; uri absolute
    chat_template: str | None = None  # template text (the config's chat_template resolved; None = the tokenizer's)
    chat_template_kwargs: dict = field(default_factory=dict)  # written into the template (capture/chat.py)


def _absolute_uri(uri: str) -> str:
    """Replicas run in other working directories: make paths and relative file:// URIs absolute."""
    if uri.startswith("s3://"):
        return uri
    return Path(uri.removeprefix("file://")).resolve().as_uri()


def replica_spec(cfg: ServeJobConfig, api_key: str | None) -> ReplicaSpec:
    return ReplicaSpec(
        target=str(Path(cfg.target.name).resolve()) if Path(cfg.target.name).is_dir() else cfg.target.name,
        dtype=cfg.target.dtype, device=cfg.target.device, model_name=cfg.served_model_name,
        max_batch=cfg.engine.max_batch, max_len=cfg.engine.max_len,
        drafter_dir=str(Path(cfg.engine.drafter).resolve()) if cfg.engine.drafter else None,
        registry_uri=_absolute_uri(cfg.registry.uri) if cfg.registry.uri else None,
        registry_endpoint_url=cfg.registry.endpoint_url, poll_interval_s=cfg.registry.poll_interval_s,
        cache_dir=str(Path(cfg.registry.cache_dir or cfg.run_dir / "drafter-cache").resolve()),
        num_threads=cfg.engine.num_threads, api_key=api_key,
        num_speculative_tokens=cfg.engine.num_speculative_tokens,
        max_speculative_batch=cfg.engine.max_speculative_batch, speculation=cfg.engine.speculation,
        tree=cfg.engine.tree, cost_table=str(Path(cfg.engine.cost_table).resolve()) if cfg.engine.cost_table else None,
        limits=cfg.http.limits,
        record=cfg.record.model_copy(update={"uri": _absolute_uri(cfg.record.uri)}) if cfg.record.uri else cfg.record,
        chat_template=resolve_chat_template(cfg.chat_template, field="chat_template"),
        chat_template_kwargs=dict(cfg.chat_template_kwargs),
    )


@serve.deployment
@serve.ingress()
class SpecrayReplica:
    """One serving replica: target + engine loop + registry poller; its ASGI app is built per replica."""

    def __init__(self, spec: ReplicaSpec):
        serve_replica_on_loopback()
        if spec.num_threads:
            torch.set_num_threads(spec.num_threads)
        self.spec = spec
        self.replica = serve.get_replica_context().replica_id.unique_id
        # auto = what Ray granted this replica (a replica without GPUs may still see its node's)
        device = resolve_device(spec.device, field="target.device", gpus=len(ray.get_gpu_ids()))
        target = load_target(spec.target, dtype=spec.dtype, device=device, chat_template=spec.chat_template,
                             chat_template_kwargs=spec.chat_template_kwargs)
        self.engine = Engine(target, spec.drafter_dir, max_batch=spec.max_batch, max_len=spec.max_len,
                             num_speculative_tokens=spec.num_speculative_tokens,
                             max_speculative_batch=spec.max_speculative_batch, speculation=spec.speculation,
                             tree=spec.tree, cost_table=spec.cost_table)
        self.loop = EngineLoop(self.engine).start()
        self.metrics = ReplicaMetrics(self.engine, spec.model_name).start()
        self.recorder = TrafficRecorder(spec.record, self.replica).start() if spec.record.enabled else None
        self.poller = None
        if spec.registry_uri:
            registry = DrafterRegistry(spec.registry_uri, endpoint_url=spec.registry_endpoint_url)
            self.poller = RegistryPoller(registry, self.engine, cache_dir=spec.cache_dir,
                                         interval_s=spec.poll_interval_s, replica_id=self.replica).start()

    def __serve_build_asgi_app__(self):
        return create_app(self.engine, model_name=self.spec.model_name, api_key=self.spec.api_key,
                          limits=self.spec.limits, replica_id=self.replica, replica_info=self.info,
                          recorder=self.recorder)

    def info(self) -> dict:
        """Shown by /metrics (behind the key): why hot-loading last failed, the versions this replica
        does not serve because they are rejected in the registry (by it or by another replica), the pin."""
        if self.poller is None:
            return {"registry_error": None, "registry_rejected": {}, "registry_pinned": None}
        return {"registry_error": self.poller.last_error, "registry_rejected": dict(self.poller.rejected),
                "registry_pinned": self.poller.pinned}

    def check_health(self) -> None:
        if not self.loop.alive:
            raise RuntimeError("the engine loop thread is not running")

    def __del__(self):
        if self.poller is not None:
            self.poller.stop(timeout=5)
        self.metrics.stop(timeout=5)
        self.loop.stop(timeout=5)
        if self.recorder is not None:  # writes what is queued and buffered
            self.recorder.close(timeout=10)


@dataclass(frozen=True)
class ServeHandle:
    """A running Serve application. ``base_url`` is what OpenAI clients take."""

    url: str  # http://127.0.0.1:8000
    model: str
    api_key: str | None
    app_name: str
    started_serve: bool = False  # Serve was not running on the cluster before this application

    @property
    def base_url(self) -> str:
        return f"{self.url}/v1"

    def stop(self) -> None:
        """Delete the application (its replicas). Serve itself (controller, proxy and its http options)
        is shut down too when this application started it and no other application is left on it."""
        serve.delete(self.app_name)
        if self.started_serve and not serve.status().applications:
            serve.shutdown()


def _serve_is_running() -> bool:
    return any(a["name"] == "SERVE_CONTROLLER_ACTOR" for a in ray.util.list_named_actors(all_namespaces=True))


def _wait_ready(url: str, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=5) as response:
                if response.status == 200:
                    return
        except (urllib.error.URLError, ConnectionError, TimeoutError) as e:
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"the serve app is deployed but {url}/health does not answer ({e}); if Serve was already "
                    "running on this cluster with other http options, they were kept: stop it (serve.shutdown()) "
                    "or use its host and port"
                ) from None
        time.sleep(0.5)


def application(cfg: ServeJobConfig, api_key: str | None):
    """The bound Serve application (replicas + autoscaling) that ``serve.run`` or a Serve config deploys.
    Without ``api_key`` its replicas answer loopback clients only, wherever Serve's proxy binds; every
    request is bounded by ``cfg.http.limits``. The key is read by ``normalize_api_key`` (surrounding
    whitespace stripped with a warning, an empty key refused)."""
    api_key = normalize_api_key(api_key, "the API key")
    a = cfg.autoscaling
    return SpecrayReplica.options(
        name="SpecrayReplica",
        autoscaling_config={"min_replicas": a.min_replicas, "initial_replicas": a.min_replicas,
                            "max_replicas": a.max_replicas, "target_ongoing_requests": a.target_ongoing_requests,
                            "upscale_delay_s": a.upscale_delay_s, "downscale_delay_s": a.downscale_delay_s},
        max_ongoing_requests=cfg.replica.max_ongoing_requests,
        ray_actor_options={"num_cpus": cfg.replica.num_cpus},
    ).bind(replica_spec(cfg, api_key))


def start_serving(cfg: ServeJobConfig, *, timeout_s: float = 600.0) -> ServeHandle:
    """Deploy the replicas described by ``cfg`` and return once ``/health`` answers over HTTP."""
    source = "http.api_key" if cfg.http.api_key else "$SPECRAY_API_KEY"
    api_key = normalize_api_key(cfg.http.api_key or os.environ.get("SPECRAY_API_KEY") or None, source)
    if not is_loopback(cfg.http.host) and not api_key:
        raise ValueError(
            f"http.host={cfg.http.host!r} makes the server reachable from other machines; set http.api_key "
            "(or $SPECRAY_API_KEY) so requests need 'Authorization: Bearer <key>', or serve on http.host=127.0.0.1"
        )
    app = application(cfg, api_key)
    connect(cfg.ray.address, cfg.ray.num_cpus)
    host = "127.0.0.1" if cfg.http.host in ("0.0.0.0", "::") else cfg.http.host
    handle = ServeHandle(f"http://{host}:{cfg.http.port}", cfg.served_model_name, api_key, cfg.name,
                         started_serve=not _serve_is_running())
    serve.start(http_options={"host": cfg.http.host, "port": cfg.http.port})
    try:
        serve.run(app, name=cfg.name, route_prefix="/")
        _wait_ready(handle.url, timeout_s)
    except BaseException:
        handle.stop()  # nothing of a failed start stays deployed
        raise
    return handle
