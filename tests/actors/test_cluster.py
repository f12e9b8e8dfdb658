"""Joining Ray: the shared test cluster is local and on loopback, ``specray serve`` from a fresh HOME
listens on loopback only, ``connect`` forwards no credentials, and the ``ray start --head`` recipe
of docs/pipeline.md (token authentication) works on a machine that never made a Ray token."""

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from ports import free_port
from ray_processes import bound_sockets, is_loopback, processes_of, stop_only

pytestmark = pytest.mark.ray


def test_cluster_is_local_and_loopback(ray_cluster):
    import ray

    assert ray.cluster_resources()["CPU"] == 4
    assert ray_cluster.dashboard_url.startswith("http://127.0.0.1:")

    @ray.remote(num_cpus=1)
    def where():
        return ray.util.get_node_ip_address()

    assert ray.get(where.remote(), timeout=60) == "127.0.0.1"


def _docs_recipe() -> list[str]:
    """The shell lines of docs/pipeline.md's ``ray job submit`` recipe (continuations joined, comments cut)."""
    text = Path("docs/pipeline.md").read_text()
    start = text.index("```bash", text.index("## `ray job submit`"))
    block = text[start + len("```bash"):text.index("```", start + len("```bash"))]
    return [line.split("  #")[0].strip() for line in block.replace("\\\n", " ").splitlines() if line.strip()]


def test_the_docs_head_node_recipe_works_from_a_fresh_home(ray_cluster, tmp_path):
    """The recipe's own lines, with a HOME that has no ~/.ray and on free loopback ports (beside
    the shared test cluster): the head starts with token authentication, a job submitted with the
    token runs, and one submitted without it is refused."""
    lines = _docs_recipe()
    setup = [line for line in lines if line.startswith(("export ", "ray get-auth-token", "ray start"))]
    submit = next(line for line in lines if line.startswith("ray job submit"))
    gcs, dashboard, client, agent = (free_port() for _ in range(4))
    temp_dir = tempfile.mkdtemp(prefix="rt", dir="/tmp")  # short: Ray's socket paths must fit 107 bytes
    start = next(i for i, line in enumerate(setup) if line.startswith("ray start"))
    assert "--port=6379" in setup[start] and "--address http://127.0.0.1:8265 " in submit
    setup[start] = (setup[start].replace("--port=6379", f"--port={gcs}") + f" --dashboard-port={dashboard}"
                    f" --ray-client-server-port={client} --dashboard-agent-listen-port={agent}"
                    f" --temp-dir={temp_dir} --num-cpus=1")
    submit = submit.replace("8265", str(dashboard)).split(" --working-dir")[0]
    script = "\n".join([*setup, f"{submit} -- python -c \"print('specray-job-' + 'ok')\""])
    home = tmp_path / "home"
    home.mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")} | {"HOME": str(home)}
    log = tmp_path / "recipe.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(["bash", "-euo", "pipefail", "-c", script], stdout=out, stderr=subprocess.STDOUT,
                                env=env, start_new_session=True)
    try:
        rc = proc.wait(timeout=300)
        output = log.read_text()
        assert rc == 0, output[-3000:]
        assert "specray-job-ok" in output and "succeeded" in output, output[-3000:]
        assert (home / ".ray" / "auth_token").stat().st_size > 0
        with pytest.raises(urllib.error.HTTPError) as refused:  # the job server wants the token
            urllib.request.urlopen(f"http://127.0.0.1:{dashboard}/api/jobs/", timeout=30)
        assert refused.value.code in (401, 403)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        left = stop_only(proc.pid, temp_dir)
        if not left:
            shutil.rmtree(temp_dir, ignore_errors=True)
    assert left == [], f"processes of the test's head node still running: {left}"


def test_connect_forwards_settings_never_credentials():
    from specray.actors.cluster import FORWARDED_ENV

    assert "SPECRAY_S3_ENDPOINT" in FORWARDED_ENV and "AWS_DEFAULT_REGION" in FORWARDED_ENV
    secret = [k for k in FORWARDED_ENV if any(w in k for w in ("SECRET", "KEY", "TOKEN", "PASSWORD", "SESSION"))]
    assert secret == [], f"connect() would put these into every job's runtime_env: {secret}"


def test_a_submitted_jobs_own_variables_are_not_set_again(monkeypatch):
    """Under ``ray job submit --runtime-env-json`` (a RayJob's runtimeEnvYAML) Ray refuses a driver whose
    runtime env sets a variable the job's sets too: connect() leaves those to the job."""
    import json

    import ray
    from ray._private.runtime_env.constants import RAY_JOB_CONFIG_JSON_ENV_VAR

    from specray.actors import cluster

    calls = []
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "init", lambda **kwargs: calls.append(kwargs))
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    monkeypatch.setenv("SPECRAY_S3_ENDPOINT", "http://127.0.0.1:9")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "s3cr3t")
    monkeypatch.setenv(RAY_JOB_CONFIG_JSON_ENV_VAR,
                       json.dumps({"runtime_env": {"env_vars": {"AWS_DEFAULT_REGION": "us-east-1"}}}))
    cluster.connect("127.0.0.1:6379")
    (kwargs,) = calls
    assert kwargs["address"] == "127.0.0.1:6379"
    forwarded = kwargs["runtime_env"]["env_vars"]
    assert forwarded["SPECRAY_S3_ENDPOINT"] == "http://127.0.0.1:9"
    assert "AWS_DEFAULT_REGION" not in forwarded and "s3cr3t" not in json.dumps(kwargs)
    monkeypatch.delenv(RAY_JOB_CONFIG_JSON_ENV_VAR)
    cluster.connect("127.0.0.1:6379")
    assert calls[1]["runtime_env"]["env_vars"]["AWS_DEFAULT_REGION"] == "us-east-1"


def _wait_for(path: Path, text: str, proc: subprocess.Popen, timeout_s: float) -> str:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        output = path.read_text(errors="replace")
        if text in output:
            return output
        assert proc.poll() is None, f"exited with {proc.returncode}: {output[-3000:]}"
        time.sleep(1)
    raise AssertionError(f"no {text!r} within {timeout_s} s: {path.read_text(errors='replace')[-3000:]}")


@pytest.mark.timeout(900)
def test_specray_serve_from_a_fresh_home_listens_on_loopback_only(tmp_path):
    """``specray serve -c manifests/serve.yaml`` as a user runs it: no RAY_* variable set (the Makefile's
    RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 neither), a HOME without ~/.ray. Every socket its Ray cluster and the
    Serve proxy listen on (TCP) or bind (UDP) is on loopback."""
    home = tmp_path / "home"
    home.mkdir()
    temp_dir = tempfile.mkdtemp(prefix="rs", dir="/tmp")  # Ray's root (RAY_TMPDIR): short, and our PID marker
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")} | {"HOME": str(home),
                                                                              "RAY_TMPDIR": temp_dir}
    argv = [str(Path(sys.executable).with_name("specray")), "serve", "-c", str(Path("manifests/serve.yaml").resolve()),
            "target.name=debug", f"http.port={port}", "ray.num_cpus=2"]
    log = tmp_path / "serve.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=tmp_path,
                                start_new_session=True)
    try:
        _wait_for(log, "serving    ", proc, 600)
        time.sleep(5)  # the agents and the Serve proxy bind right after the first health answer
        sockets = bound_sockets(processes_of(proc.pid, temp_dir))
        exposed = sorted({s for s in sockets if not is_loopback(s[0])})
        assert exposed == [], f"listening beyond loopback: {exposed}"
        names = {name for _, _, name, _ in sockets}
        assert {"gcs_server", "raylet"} <= names and port in {p for _, p, _, _ in sockets}, sockets
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)  # Ctrl-C: the CLI stops the app and its cluster
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        left = stop_only(proc.pid, temp_dir)
        if not left:
            shutil.rmtree(temp_dir, ignore_errors=True)
    assert left == [], f"processes of the test's cluster still running: {left}"
