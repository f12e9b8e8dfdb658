"""Joining Ray: the shared test cluster is local and on loopback, and the ``ray start
--head`` recipe of docs/pipeline.md (token authentication) works on a machine that never made a Ray token."""

import os
import shutil
import signal
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from ports import free_port

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


def _processes_of(pgid: int, marker: str) -> list[int]:
    """PIDs in our process group, or whose command line names our head's temp dir (nothing else)."""
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            mine = os.getpgid(int(entry.name)) == pgid
            mine = mine or marker in (entry / "cmdline").read_bytes().decode(errors="replace")
        except (ProcessLookupError, FileNotFoundError, PermissionError):
            continue
        if mine:
            pids.append(int(entry.name))
    return pids


def _stop_only(pgid: int, marker: str) -> list[int]:
    """Stop the head node this test started, by PID (``ray stop`` would stop every Ray on the host)."""
    for sig, grace in ((signal.SIGTERM, 15), (signal.SIGKILL, 10)):
        for pid in _processes_of(pgid, marker):
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + grace
        while _processes_of(pgid, marker) and time.monotonic() < deadline:
            time.sleep(0.5)
    return _processes_of(pgid, marker)


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
        left = _stop_only(proc.pid, temp_dir)
        if not left:
            shutil.rmtree(temp_dir, ignore_errors=True)
    assert left == [], f"processes of the test's head node still running: {left}"
