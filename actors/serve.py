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
from specray.drafters.format import check_export
from specray.serving.engine import Engine, EngineLoop
from specray.serving.http_guard import HttpLimits, is_loopback, normalize_api_key
from specray.serving.openai_api import create_app
from specray.serving.recorder import RecordSettings, TrafficRecorder
from specray.serving.poller import RegistryPoller, rejection_scope
from specray.serving.registry import DrafterRegistry

if TYPE_CHECKING:
    from specray.pipeline.config import ServeJobConfig

log = logging.getLogger(__name__)
METRICS_INTERVAL_S = 5.0  # how often a replica refreshes its Ray Serve metrics
MAX_CONSTRUCTOR_RETRIES = 3  # a vLLM replica that fails to start this often fails its rollout
GRACEFUL_SHUTDOWN_S = 300.0  # a retired vLLM replica finishes its requests within this

# engine stats -> Ray Serve metrics: (name, stats key, description)
_GAUGES = (("tokens_per_second", "tokens_per_second", "generated tokens per second over the last minute"),
           ("requests_running", "requests_running", "requests in KV slots"),
           ("requests_waiting", "requests_waiting", "requests queued for a slot"),
           ("tau", "tau", "mean tokens per round of the active drafter version (accepted drafts + 1)"))
_COUNTERS = (("tokens_generated", "tokens_generated", "tokens generated"),
             ("requests_served", "requests_served", "requests finished"),
             ("requests_aborted", "requests_aborted", "requests aborted"),
             ("requests_failed", "requests_failed", "requests failed"))


class _Periodic:
    """Runs ``tick()`` every ``interval_s`` on a daemon thread from ``start()`` to ``stop()``; a tick
    that raises goes to ``tick_failed`` and the next interval tries again."""

    thread_name = "specray-periodic"
    interval_s: float

    def start(self):
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name=self.thread_name)
        self._thread.start()
        return self

    def stop(self, timeout: float = 30.0) -> None:
        if getattr(self, "_thread", None) is not None:
            self._stop.set()
            self._thread.join(timeout)

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self.tick()
            except Exception as e:  # noqa: BLE001 - a failed tick must not end the thread: the next one retries
                self.tick_failed(e)

    def tick(self) -> None:
        raise NotImplementedError

    def tick_failed(self, error: Exception) -> None:
        log.warning("%s: %s", self.thread_name, error)


class ReplicaMetrics(_Periodic):
    """A replica's engine stats as Ray Serve metrics (``ray.serve.metrics``), so Ray's Prometheus
    endpoint holds every replica's: Serve tags each with ``deployment``, ``replica`` and
    ``application``; specray adds ``model`` and ``version`` (the drafter version, ``ar`` without
    one). Names (Prometheus adds Ray's ``ray_`` prefix): ``specray_tokens_per_second``,
    ``specray_requests_running``, ``specray_requests_waiting``, ``specray_tau`` (the active
    version's), ``specray_version_tau`` (every version this replica served), and the counters
    ``specray_tokens_generated``, ``specray_requests_served`` / ``_aborted`` / ``_failed``
    (counted under the version active when they were counted). ``update()`` reads the engine
    once; ``start()`` calls it every ``interval_s`` on a thread until ``stop()``."""

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

    thread_name = "specray-serve-metrics"

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

    def tick(self) -> None:
        self.update()

    def tick_failed(self, error: Exception) -> None:  # metrics never take a replica down
        log.warning("updating the Ray Serve metrics failed: %s", error)


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
    backend: str = "specray"  # specray | vllm
    vllm_args: dict = field(default_factory=dict)  # vLLM engine arguments (the config's vllm section, not default)
    drafter_version: int | None = None  # vllm: the registry version this replica serves (None = engine.drafter / AR)
    num_gpus: float = 0.0  # GPUs Ray grants each replica


def _absolute_uri(uri: str) -> str:
    """Replicas run in other working directories: make paths and relative file:// URIs absolute."""
    if uri.startswith("s3://"):
        return uri
    return Path(uri.removeprefix("file://")).resolve().as_uri()


def replica_spec(cfg: ServeJobConfig, api_key: str | None, drafter_version: int | None = None) -> ReplicaSpec:
    """``drafter_version``: the registry version a vLLM replica serves (``VersionRollout``)."""
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
        backend=cfg.backend, vllm_args=cfg.vllm.model_dump(exclude_defaults=True), drafter_version=drafter_version,
        num_gpus=cfg.num_gpus_per_replica,
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


class VersionRefusedError(ValueError):
    """A vLLM replica cannot serve its drafter version: rejected in the registry (by it or before)."""


@serve.deployment
@serve.ingress()
class VllmReplica:
    """One vLLM serving replica (``backend: vllm``): the drafter version it was deployed with, for
    its whole life. A version it cannot serve (the registry refuses the pull, our checks refuse
    the export, vLLM refuses the drafter) is rejected in the registry and the constructor raises,
    so Serve's rolling update keeps the old replicas (``VersionRollout``)."""

    def __init__(self, spec: ReplicaSpec):
        from specray.serving.vllm_engine import VllmEngine, serves_without_drafter, speculators_drafter

        serve_replica_on_loopback()
        self.spec = spec
        self.replica = serve.get_replica_context().replica_id.unique_id
        if spec.speculation == "auto":
            log.info("backend vllm drafts engine.num_speculative_tokens every step (engine.speculation=auto chooses "
                     "round sizes on the specray backend only)")
        # the tokenizer, template and fingerprints, and the embedding and head the conversion reads
        target = load_target(spec.target, dtype=spec.dtype, weights="heads", chat_template=spec.chat_template,
                             chat_template_kwargs=spec.chat_template_kwargs)
        self.registry = (DrafterRegistry(spec.registry_uri, endpoint_url=spec.registry_endpoint_url)
                         if spec.registry_uri else None)
        self.scope = rejection_scope(target.target_fingerprint)
        version, export = spec.drafter_version, spec.drafter_dir
        cache = Path(spec.cache_dir)
        if version is not None:
            self._refuse_if_rejected(version)
            try:
                export = str(self.registry.pull(version, cache))
            except ValueError as e:  # RejectedVersionError: a marker or files that cannot be pulled safely
                self._reject(version, f"the registry refused the pull: {e}")
        elif export is not None:
            version = 0
        drafter = None
        if export is not None:
            k = spec.num_speculative_tokens
            out = cache / "speculators" / f"{Path(export).name}-{self.scope}-k{k or 'default'}"
            out.parent.mkdir(parents=True, exist_ok=True)
            try:
                drafter = speculators_drafter(export, target, out, k=k)
            except ValueError as e:  # InvalidDrafterError, PeerFormatError: refused before vLLM allocates anything
                self._reject(version, f"the export cannot be served: {e}")
        target.model = None  # the heads were for the conversion
        try:
            self.engine = VllmEngine(target, drafter, version=version, max_batch=spec.max_batch,
                                     max_len=spec.max_len, num_speculative_tokens=spec.num_speculative_tokens,
                                     engine_args=spec.vllm_args).start()
        except (ValueError, TypeError, NotImplementedError) as e:  # vLLM refuses the drafter or its config
            if drafter is None or not serves_without_drafter(target, max_batch=spec.max_batch, max_len=spec.max_len,
                                                             engine_args=spec.vllm_args):
                raise  # the configuration's fault, not the version's: nothing is rejected
            self._reject(version, f"vLLM refused the drafter: {type(e).__name__}: {e}")
        self.metrics = ReplicaMetrics(self.engine, spec.model_name).start()
        self.recorder = TrafficRecorder(spec.record, self.replica).start() if spec.record.enabled else None
        self._stop = threading.Event()
        self._reporter = None
        if self.registry is not None:
            self._reporter = threading.Thread(target=self._report_loop, daemon=True, name="specray-registry-report")
            self._reporter.start()

    def _refuse_if_rejected(self, version: int) -> None:
        rejected = self.registry.rejected_for(self.scope).get(version)
        if rejected is not None:
            raise VersionRefusedError(f"drafter version {version} is rejected ({rejected.scope}: {rejected.reason})")

    def _reject(self, version: int | None, reason: str):
        """Record the rejection (a local export without a registry is only refused) and raise."""
        if self.registry is not None and version:
            self.registry.reject(version, self.scope, reason, by=self.replica)
        raise VersionRefusedError(f"drafter version {version}: {reason}")

    def _report_loop(self) -> None:
        from specray.serving.poller import replica_report

        while True:
            try:
                self.registry.report(self.replica, replica_report(self.engine.stats(), owner=self.replica,
                                                                  interval_s=self.spec.poll_interval_s))
            except Exception as e:  # noqa: BLE001 - the report goes stale, and status says so; retried
                log.warning("reporting to the registry failed: %s", e)
            if self._stop.wait(self.spec.poll_interval_s):
                return

    def __serve_build_asgi_app__(self):
        return create_app(self.engine, model_name=self.spec.model_name, api_key=self.spec.api_key,
                          limits=self.spec.limits, replica_id=self.replica, replica_info=self.info,
                          recorder=self.recorder)

    def info(self) -> dict:
        """Shown by /metrics: the versions rejected in the registry for this target, and the pin (what
        ``VersionRollout`` follows; this replica serves the version it started with)."""
        if self.registry is None:
            return {"registry_error": None, "registry_rejected": {}, "registry_pinned": None}
        try:
            rejected = {v: f"{r.scope}: {r.reason}" for v, r in self.registry.rejected_for(self.scope).items()}
            return {"registry_error": None, "registry_rejected": rejected, "registry_pinned": self.registry.pinned()}
        except Exception as e:  # noqa: BLE001 - a registry outage must not fail /metrics
            return {"registry_error": str(e), "registry_rejected": {}, "registry_pinned": None}

    def check_health(self) -> None:
        if not self.engine.alive:
            raise RuntimeError("the vLLM engine loop thread is not running")

    def __del__(self):
        stop = getattr(self, "_stop", None)
        if stop is not None:
            stop.set()
            if self.registry is not None:
                try:
                    self.registry.forget(self.replica)
                except Exception as e:  # noqa: BLE001 - the report goes stale instead
                    log.warning("removing the report of %s failed: %s", self.replica, e)
        for part in ("metrics", "engine"):
            if hasattr(self, part):
                getattr(self, part).stop(timeout=5)
        if getattr(self, "recorder", None) is not None:
            self.recorder.close(timeout=10)


def wanted_version(registry: DrafterRegistry, scope: str, served: int | None,
                   skip: set[int] = frozenset()) -> tuple[int | None, str | None]:
    """The version replicas of ``scope`` should serve, as the poller chooses it (serving/poller.py):
    the pin, else the newest good version, never below ``served`` unless ``served`` is rejected;
    ``skip``: versions waiting out a backoff. Returns (version, why the pin cannot be followed)."""
    rejected = registry.rejected_for(scope)
    versions = registry.versions()
    try:
        pinned = registry.pinned()
    except ValueError as e:
        return served, str(e)
    if pinned is not None:
        if pinned not in versions:
            return served, f"the pinned version {pinned} is not a complete version of {registry.uri}"
        if pinned in rejected:
            return served, f"the pinned version {pinned} is rejected: {rejected[pinned].reason}"
        return pinned, None
    good = [v for v in versions if v not in rejected and v not in skip]
    if served is not None and served not in rejected:
        good = [v for v in good if v >= served]
        return max(good, default=served), None
    return max(good, default=None), None


def registry_version(cfg: ServeJobConfig, target=None) -> tuple[DrafterRegistry, str, int | None]:
    """The registry of ``cfg``, its target's rejection scope, and the version its replicas should
    serve now (``wanted_version``). ``target``: the target already loaded (``weights="none"`` is enough)."""
    registry = DrafterRegistry(_absolute_uri(cfg.registry.uri), endpoint_url=cfg.registry.endpoint_url)
    target = target or load_target(cfg.target.name, weights="none")
    scope = rejection_scope(target.target_fingerprint)
    version, problem = wanted_version(registry, scope, None)
    if problem:
        log.warning("%s", problem)
    return registry, scope, version


class VersionRollout(_Periodic):
    """Keeps ``backend: vllm`` replicas on the version they should serve (``wanted_version``): every
    ``interval_s`` it compares that with the deployed one and, when they differ, checks the version
    (``check``: it returns why the export cannot be served, allocating nothing) and redeploys the
    application with it. A version the check refuses is rejected in the registry at once, and no
    replica restarts for it. Serve then rolls the replicas (``max_surge_percent=100``): replicas on
    the new version start beside the old ones, which are stopped only once the new ones run, after
    their requests finish. A version whose replicas fail to start anyway is left behind: rejected
    in the registry when the replica could say why (``VllmReplica``), else retried with backoff
    (``retry_s`` doubling up to ``max_retry_s``), as is a version the check could not read (a pull
    that failed). The replicas of the version served keep serving throughout (Serve keeps them when
    a rollout fails), and the application is redeployed on that version, which rolls them once more
    onto fresh replicas of it."""

    def __init__(self, registry: DrafterRegistry, scope: str, version: int | None, deploy, *, interval_s: float,
                 check=None, retry_s: float | None = None, max_retry_s: float = 600.0):
        self.registry, self.scope, self.version, self.deploy = registry, scope, version, deploy
        self.check = check or (lambda version: None)
        self.interval_s, self.retry_s, self.max_retry_s = interval_s, retry_s or interval_s, max_retry_s
        self.last_error: str | None = None
        self._backoff: dict[int, tuple[int, float]] = {}  # version -> (failures, monotonic time of the next try)

    thread_name = "specray-vllm-rollout"

    def poll(self) -> int | None:
        """One check: roll to the wanted version if it differs. Returns the version rolled to, or None."""
        now = time.monotonic()
        waiting = {v for v, (_, at) in self._backoff.items() if at > now}
        want, problem = wanted_version(self.registry, self.scope, self.version, waiting)
        self.last_error = problem
        if want == self.version:
            return None
        if want is not None:
            try:
                refused = self.check(want)
            except Exception as e:  # noqa: BLE001 - not the version's fault (a pull that failed): retried
                self._retry_later(want, f"version {want} could not be checked: {e}")
                return None
            if refused:
                self.registry.reject(want, self.scope, refused, by="rollout")
                self.last_error = f"version {want} rejected: {refused}"
                log.warning("%s; serving version %s", self.last_error, self.version)
                return None
        log.info("rolling the vLLM replicas from drafter version %s to %s", self.version, want)
        try:
            self.deploy(want)
        except Exception as e:  # noqa: BLE001 - the old replicas still serve: back to them
            if want is not None and want in self.registry.rejected_for(self.scope):
                self._backoff.pop(want, None)  # rejected for good: never tried again
                self.last_error = f"version {want} did not start: {e}"
            else:
                self._retry_later(want, f"version {want} did not start: {e}")
            log.warning("%s; serving version %s", self.last_error, self.version)
            self.deploy(self.version)
            return None
        self._backoff.pop(want, None)
        self.version = want
        return want

    def _retry_later(self, version: int | None, error: str) -> None:
        self.last_error = error
        if version is not None:
            failures = self._backoff.get(version, (0, 0.0))[0] + 1
            self._backoff[version] = (failures, time.monotonic() + min(self.retry_s * 2 ** (failures - 1),
                                                                       self.max_retry_s))

    def tick(self) -> None:
        self.poll()

    def tick_failed(self, error: Exception) -> None:  # a registry hiccup: the next poll tries again
        self.last_error = str(error)
        log.warning("checking the registry for a drafter version failed: %s", error)


@dataclass(frozen=True)
class ServeHandle:
    """A running Serve application. ``base_url`` is what OpenAI clients take."""

    url: str  # http://127.0.0.1:8000
    model: str
    api_key: str | None
    app_name: str
    started_serve: bool = False  # Serve was not running on the cluster before this application
    rollout: VersionRollout | None = None  # backend vllm with a registry: what moves replicas to new versions

    @property
    def base_url(self) -> str:
        return f"{self.url}/v1"

    def stop(self) -> None:
        """Delete the application (its replicas). Serve itself (controller, proxy and its http options)
        is shut down too when this application started it and no other application is left on it."""
        if self.rollout is not None:
            self.rollout.stop()
        serve.delete(self.app_name)
        if self.started_serve and not serve.status().applications:
            serve.shutdown()


def _deployment_messages(app_name: str, limit: int = 4000) -> str:
    """What Serve says about the deployments of ``app_name`` (a failed replica's traceback), the end kept."""
    app = serve.status().applications.get(app_name)
    text = "\n".join(f"{name}: {d.message}" for name, d in (app.deployments if app else {}).items() if d.message)
    return text[-limit:]


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


def application(cfg: ServeJobConfig, api_key: str | None, drafter_version: int | None = None):
    """The bound Serve application (replicas + autoscaling) that ``serve.run`` or a Serve config deploys.
    Without ``api_key`` its replicas answer loopback clients only, wherever Serve's proxy binds; every
    request is bounded by ``cfg.http.limits``. The key is read by ``normalize_api_key`` (surrounding
    whitespace stripped with a warning, an empty key refused). ``drafter_version``: the registry
    version ``backend: vllm`` replicas serve (``VersionRollout``; specray replicas poll for theirs)."""
    api_key = normalize_api_key(api_key, "the API key")
    a = cfg.autoscaling
    spec = replica_spec(cfg, api_key, drafter_version)
    options = dict(
        autoscaling_config={"min_replicas": a.min_replicas, "initial_replicas": a.min_replicas,
                            "max_replicas": a.max_replicas, "target_ongoing_requests": a.target_ongoing_requests,
                            "upscale_delay_s": a.upscale_delay_s, "downscale_delay_s": a.downscale_delay_s},
        max_ongoing_requests=cfg.replica.max_ongoing_requests,
        ray_actor_options={"num_cpus": cfg.replica.num_cpus, "num_gpus": cfg.num_gpus_per_replica},
    )
    if cfg.backend == "specray":
        return SpecrayReplica.options(name="SpecrayReplica", **options).bind(spec)
    # every deploy is a rolling update: new replicas start beside the old ones, which stop once the new ones
    # run and their requests finished
    return VllmReplica.options(name="VllmReplica", max_surge_percent=100,
                               max_constructor_retry_count=MAX_CONSTRUCTOR_RETRIES,
                               graceful_shutdown_timeout_s=GRACEFUL_SHUTDOWN_S, **options).bind(spec)


def rollout_room(cfg: ServeJobConfig, resources: dict) -> str | None:
    """Why the Ray cluster (``resources``: ``ray.cluster_resources()``) cannot hold a rollout of
    ``backend: vllm`` replicas at their most (None: it can). A rollout starts the new replicas
    beside the old ones, so it needs room for twice ``autoscaling.max_replicas``; without the room
    Serve keeps the new ones pending, and the rollout waits, until an autoscaling cluster adds a node."""
    if cfg.backend != "vllm" or not cfg.registry.uri:
        return None
    replicas = 2 * cfg.autoscaling.max_replicas
    for field_name, per_replica, resource in (("replica.num_cpus", cfg.replica.num_cpus, "CPU"),
                                              ("num_gpus_per_replica", cfg.num_gpus_per_replica, "GPU")):
        have = resources.get(resource, 0.0)
        if per_replica and replicas * per_replica > have:
            return (f"a rollout to a new drafter version starts the new vLLM replicas beside the old ones: "
                    f"{replicas} replicas (2 x autoscaling.max_replicas={cfg.autoscaling.max_replicas}) x "
                    f"{field_name}={per_replica:g} = {replicas * per_replica:g} {resource}s, and the Ray cluster has "
                    f"{have:g}; lower {field_name} or autoscaling.max_replicas, or add nodes, else each rollout "
                    "waits for room")
    return None


def start_serving(cfg: ServeJobConfig, *, timeout_s: float = 600.0) -> ServeHandle:
    """Deploy the replicas described by ``cfg`` and return once ``/health`` answers over HTTP. With
    ``backend: vllm`` and a registry, the replicas start on the version ``wanted_version`` picks and
    the handle's ``VersionRollout`` moves them to each new one."""
    source = "http.api_key" if cfg.http.api_key else "$SPECRAY_API_KEY"
    api_key = normalize_api_key(cfg.http.api_key or os.environ.get("SPECRAY_API_KEY") or None, source)
    if not is_loopback(cfg.http.host) and not api_key:
        raise ValueError(
            f"http.host={cfg.http.host!r} makes the server reachable from other machines; set http.api_key "
            "(or $SPECRAY_API_KEY) so requests need 'Authorization: Bearer <key>', or serve on http.host=127.0.0.1"
        )
    rollout, version = None, None
    if cfg.backend == "vllm" and cfg.registry.uri:
        spec = replica_spec(cfg, api_key)  # the replicas' template: the fingerprint an export is checked against
        target = load_target(cfg.target.name, weights="none", chat_template=spec.chat_template,
                             chat_template_kwargs=spec.chat_template_kwargs)
        registry, scope, version = registry_version(cfg, target)
        cache = Path(spec.cache_dir)

        def check(drafter_version: int) -> str | None:
            """Why the replicas could not serve ``drafter_version`` (None: they can try)."""
            try:
                check_export(registry.pull(drafter_version, cache), vocab_size=target.vocab_size,
                             hidden_size=target.hidden_size, target_fingerprint=target.target_fingerprint,
                             template_fingerprint=target.template_fingerprint)
            except ValueError as e:  # RejectedVersionError, InvalidDrafterError
                return f"the export cannot be served: {e}"
            return None

        def deploy(drafter_version: int | None) -> None:
            try:
                serve.run(application(cfg, api_key, drafter_version), name=cfg.name, route_prefix="/")
            except RuntimeError as e:
                raise RuntimeError(f"{e}\n{_deployment_messages(cfg.name, limit=1000)}") from None

        rollout = VersionRollout(registry, scope, version, deploy, interval_s=cfg.registry.poll_interval_s,
                                 check=check)
    app = application(cfg, api_key, version)
    connect(cfg.ray.address, cfg.ray.num_cpus)
    if rollout is not None and (cramped := rollout_room(cfg, ray.cluster_resources())):
        log.warning("%s", cramped)
    host = "127.0.0.1" if cfg.http.host in ("0.0.0.0", "::") else cfg.http.host
    handle = ServeHandle(f"http://{host}:{cfg.http.port}", cfg.served_model_name, api_key, cfg.name,
                         started_serve=not _serve_is_running(), rollout=rollout)
    serve.start(http_options={"host": cfg.http.host, "port": cfg.http.port})
    try:
        try:
            serve.run(app, name=cfg.name, route_prefix="/")
        except RuntimeError as e:  # Serve's own message names no cause: the replicas' says why they did not start
            raise RuntimeError(f"{e}\n{_deployment_messages(cfg.name)}") from None
        _wait_ready(handle.url, timeout_s)
    except BaseException:
        handle.stop()  # nothing of a failed start stays deployed
        raise
    if rollout is not None:
        rollout.start()
    return handle
