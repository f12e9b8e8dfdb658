"""The serving replicas as a Ray Serve *application builder*, for Serve config files and KubeRay.

    # serve_config.yaml (or a RayService's serveConfigV2)
    applications:
      - name: specray
        route_prefix: /
        import_path: specray.pipeline.serve_app:build_app
        args:
          config: manifests/serve.yaml          # a specray serve manifest (optional)
          overrides: ["registry.uri=s3://bucket/registry"]

    serve run serve_config.yaml

Serve owns the HTTP proxy there (its ``http_options``), so the manifest's ``http.host/port``
are not used; ``http.api_key`` (or ``$SPECRAY_API_KEY``) still protects every route.
"""

from __future__ import annotations

import os

from specray.pipeline.config import ServeJobConfig, load_config


def build_app(args: dict):
    """``args``: ``config`` (a serve manifest path, optional) and ``overrides`` (``section.field=value`` list)."""
    from specray.actors.serve import application

    unknown = set(args) - {"config", "overrides"}
    if unknown:
        raise ValueError(f"unknown application args {sorted(unknown)}; use 'config' (a serve manifest) and 'overrides'")
    cfg = load_config(ServeJobConfig, args.get("config"), list(args.get("overrides", [])))
    return application(cfg, cfg.http.api_key or os.environ.get("SPECRAY_API_KEY") or None)
