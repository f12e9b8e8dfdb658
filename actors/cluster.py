"""Joining a Ray cluster: the one place ``ray.init`` is called (``specray pipeline run``, ``specray serve``).

``connect(address, num_cpus)`` joins, in this order: the configured ``address``, the job's
cluster (``RAY_ADDRESS``, set by ``ray job submit``), or a new local cluster on loopback
(``address="local"``: a new one even when a head node from ``ray start`` runs on this machine,
or a stale ``/tmp/ray/ray_current_cluster`` says one does). The environment that workers need
and do not inherit on another node — the specray cache, the S3 endpoint and credentials, the
Triton interpreter switch — travels as the job's ``runtime_env``.
"""

from __future__ import annotations

import os

import ray

FORWARDED_ENV = ("SPECRAY_CACHE", "SPECRAY_S3_ENDPOINT", "TRITON_INTERPRET",
                 "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_DEFAULT_REGION")


def connect(address: str | None = None, num_cpus: int | None = None) -> None:
    """Join or start a cluster (module docstring); a no-op when Ray is already initialised."""
    if ray.is_initialized():
        return
    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    runtime_env = {"env_vars": {k: os.environ[k] for k in FORWARDED_ENV if k in os.environ}}
    address = address or os.environ.get("RAY_ADDRESS")
    if address:
        ray.init(address=address, runtime_env=runtime_env, log_to_driver=False)
    else:
        ray.init(address="local", num_cpus=num_cpus, include_dashboard=False, _node_ip_address="127.0.0.1",
                 runtime_env=runtime_env, log_to_driver=False)
