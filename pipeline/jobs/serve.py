"""The serving replicas as a Ray Serve *application builder*, for Serve config files and KubeRay.

    # serve_config.yaml (or a RayService's serveConfigV2)
    applications:
      - name: specray
        route_prefix: /
        import_path: specray.pipeline.jobs.serve:build_app
        args:
          config: manifests/serve.yaml          # a specray serve manifest (optional)
          overrides: ["registry.uri=s3://bucket/registry"]
          limits: {max_body_bytes: 1048576}     # HttpLimits (serving/http_guard.py) over the manifest's http.limits, optional

    serve run serve_config.yaml

Serve owns the HTTP proxy there (its ``http_options``), so the manifest's ``http.host/port``
are not used; ``http.api_key`` (or ``$SPECRAY_API_KEY``) protects every route but /health.
Without a key the replicas answer loopback clients only, since the proxy may bind any address
(a RayService binds 0.0.0.0): set the key to serve anyone else. With ``backend: vllm`` the
replicas serve the registry version that is wanted when the application is built, and stay on it
(hot-load by rolling update needs ``specray serve``'s driver, docs/serving.md).
"""

from __future__ import annotations

import logging
import os

from pydantic import ValidationError

from specray.pipeline.config import ServeJobConfig, load_config
from specray.serving.http_guard import HttpLimits

log = logging.getLogger(__name__)


def build_app(args: dict):
    """``args``: ``config`` (a serve manifest path, optional), ``overrides`` (``section.field=value``
    list) and ``limits`` (``HttpLimits`` fields over the manifest's ``http.limits``, optional)."""
    from specray.actors.serve import application

    unknown = set(args) - {"config", "overrides", "limits"}
    if unknown:
        raise ValueError(f"unknown application args {sorted(unknown)}; use 'config' (a serve manifest), "
                         "'overrides' and 'limits'")
    cfg = load_config(ServeJobConfig, args.get("config"), list(args.get("overrides", [])))
    try:  # the arg's fields over the manifest's http.limits
        limits = HttpLimits.model_validate({**cfg.http.limits.model_dump(), **(args.get("limits") or {})})
    except ValidationError as e:
        problems = "; ".join(f"limits.{'.'.join(map(str, err['loc']))}: {err['msg']}" for err in e.errors())
        raise ValueError(f"application arg {problems} (HttpLimits fields: {', '.join(HttpLimits.model_fields)})") from None
    cfg = cfg.model_copy(update={"http": cfg.http.model_copy(update={"limits": limits})})
    api_key = cfg.http.api_key or os.environ.get("SPECRAY_API_KEY") or None
    if api_key is None:
        log.warning("no API key (http.api_key or $SPECRAY_API_KEY): the replicas answer loopback clients only")
    version = None
    if cfg.backend == "vllm" and cfg.registry.uri:  # vLLM replicas serve the version they are built with
        from specray.actors.serve import registry_version

        version = registry_version(cfg)[2]
    return application(cfg, api_key, version)
