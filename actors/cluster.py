"""Joining a Ray cluster: the one place ``ray.init`` is called (``specray pipeline run``, ``specray serve``).

``connect(address, num_cpus)`` joins, in this order: the configured ``address``, the job's
cluster (``RAY_ADDRESS``, set by ``ray job submit``), or a new local cluster on loopback
(``address="local"``: a new one even when a head node from ``ray start`` runs on this machine,
or a stale ``/tmp/ray/ray_current_cluster`` says one does).

Loopback holds whatever imported ``ray`` first. Ray reads ``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER``
once, at ``import ray``; unless it was ``0`` then, Ray on Linux replaces a ``127.0.0.1`` it is
given (the node address, an ``address`` to join) by the machine's external address, and
``gcs_server`` and the raylet listen on every interface. So ``connect`` turns that replacement
off for this process (``ray_constants.ENABLE_RAY_CLUSTER``, read at call time) and, for a new
local cluster, for the processes it starts (they inherit the variable). Multi-node clusters are
unaffected: their nodes are started by ``ray start`` (KubeRay), not here.

The environment that workers need and do not inherit on another node (the specray cache, the
S3 endpoint and region, the Triton interpreter switch) travels as the job's ``runtime_env``,
except the variables a submitted job's runtime env sets already (``ray job submit
--runtime-env-json``, a RayJob's ``runtimeEnvYAML``): workers get those from the job, and Ray
refuses a driver that sets one again.
Credentials never do: anyone who can list the cluster's jobs or actors reads a runtime_env
(``ray list actors --detail``). Workers get credentials from their own environment: a local
cluster's processes inherit the driver's, KubeRay pods read a Secret (``envFrom``,
manifests/kuberay/secrets.yaml), cloud nodes use instance roles.
"""

from __future__ import annotations

import json
import os

import ray
from ray._private import ray_constants
from ray._private.runtime_env.constants import RAY_JOB_CONFIG_JSON_ENV_VAR

FORWARDED_ENV = ("SPECRAY_CACHE", "SPECRAY_S3_ENDPOINT", "TRITON_INTERPRET", "AWS_DEFAULT_REGION")
LOOPBACK_ENV = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"  # "0": Ray keeps 127.0.0.1 as given (module docstring)


def connect(address: str | None = None, num_cpus: int | None = None) -> None:
    """Join or start a cluster (module docstring); a no-op when Ray is already initialised."""
    if ray.is_initialized():
        return
    ray_constants.ENABLE_RAY_CLUSTER = False  # this driver keeps 127.0.0.1 as given
    given = _submitted_job_env_vars()
    runtime_env = {"env_vars": {k: os.environ[k] for k in FORWARDED_ENV if k in os.environ and k not in given}}
    address = address or os.environ.get("RAY_ADDRESS")
    if address:
        ray.init(address=address, runtime_env=runtime_env, log_to_driver=False)
    else:
        os.environ[LOOPBACK_ENV] = "0"  # the GCS, raylet, agents and workers of the new cluster
        ray.init(address="local", num_cpus=num_cpus, include_dashboard=False, _node_ip_address="127.0.0.1",
                 runtime_env=runtime_env, log_to_driver=False)


def _submitted_job_env_vars() -> set[str]:
    """The variables the runtime env of the submitted job this driver runs for sets (none outside a job)."""
    injected = os.environ.get(RAY_JOB_CONFIG_JSON_ENV_VAR)
    if not injected:
        return set()
    return set((json.loads(injected).get("runtime_env") or {}).get("env_vars") or {})


def serve_replica_on_loopback() -> None:
    """Inside a Serve replica on a loopback node: the replica's inter-deployment gRPC server binds
    127.0.0.1 instead of every interface.

    Ray Serve 2.60 binds that server to ``[::]:0`` whatever the node's address
    (``ray/serve/_private/replica.py`` ``_on_initialized``, after the user class's ``__init__``);
    on a node whose address is 127.0.0.1 no other machine may reach it, and callers on the node
    dial 127.0.0.1. On any other node Ray's binding is kept (replicas on other nodes dial it)."""
    from ray.serve._private import replica as serve_replica

    if ray.util.get_node_ip_address() != "127.0.0.1":
        return
    add = serve_replica.add_port_to_grpc_server  # an AttributeError here: Ray changed, review this function
    if getattr(add, "loopback_only", False):
        return

    def add_on_loopback(server, address: str):
        host, _, port = address.rpartition(":")
        return add(server, f"127.0.0.1:{port}" if host in ("[::]", "0.0.0.0", "") else address)

    add_on_loopback.loopback_only = True
    serve_replica.add_port_to_grpc_server = add_on_loopback


def check_cluster_gpus(needed: float, *, gpus_field: str, who: str) -> None:
    """Refuse ``needed`` GPUs that this Ray cluster does not hold now: Ray would queue the request
    without a word until a GPU node joins, which on a cluster without one never happens."""
    if needed <= 0:
        return
    held = ray.cluster_resources().get("GPU", 0.0)
    if held < needed:
        raise ValueError(
            f"{gpus_field}: the {who} ask Ray for GPUs, {needed:g} in all, but this Ray cluster holds {held:g}, so "
            f"they would wait for them forever: set {gpus_field}=0 with a cpu or auto device, or run on a cluster "
            "whose GPU nodes are up (an autoscaling cluster: a minimum of GPU workers that covers the job)")
