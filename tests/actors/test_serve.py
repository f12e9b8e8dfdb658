"""Ray Serve replicas through the real ``openai`` client: completions, chat, streaming, concurrent
clients, a hot-load under load with no failed request, a refused bad version, and a replica
replaced when it was killed or its engine loop stopped. One Serve app (debug target, file://
registry) is shared by the module."""

import json
import threading
import time
import urllib.request
from pathlib import Path

import openai
import pytest
from ports import free_port
from serve_support import random_dflash_export

from specray.pipeline.config import ServeJobConfig, load_config
from specray.serving.registry import DrafterRegistry

pytestmark = pytest.mark.ray

KEY = "sk-serve-test"
GREEDY = {"temperature": 0, "max_tokens": 12, "extra_body": {"ignore_eos": True}}


def _get(url: str) -> dict:
    request = urllib.request.Request(url, headers={"Authorization": f"Bearer {KEY}"})
    with urllib.request.urlopen(request, timeout=10) as response:
        return json.loads(response.read())


def _content(chunks) -> str:
    return "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)


def _wait_for(predicate, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            value = predicate()
            if value:
                return value
        except (OSError, openai.APIError):  # the app is not answering yet
            pass
        time.sleep(0.5)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}")


def test_a_public_host_without_api_key_is_refused(monkeypatch, capsys):
    from specray.pipeline.cli import main

    monkeypatch.delenv("SPECRAY_API_KEY", raising=False)
    assert main(["serve", "-c", "manifests/serve.yaml", "http.host=0.0.0.0"]) == 2  # before Ray or Serve start
    assert "set http.api_key" in capsys.readouterr().err


@pytest.fixture(scope="module")
def served(ray_cluster, debug_target, tmp_path_factory):
    from ray import serve

    from specray.actors.serve import start_serving

    root = tmp_path_factory.mktemp("serve")
    registry = DrafterRegistry(str(root / "registry"))
    assert registry.publish(random_dflash_export(debug_target, root / "export-1", seed=0)) == 1
    cfg = load_config(ServeJobConfig, "manifests/serve.yaml", [
        "name=specray-test", "target.name=debug", f"registry.uri={root / 'registry'}", "registry.poll_interval_s=0.5",
        f"http.port={free_port()}", f"http.api_key={KEY}", "engine.max_len=256", "engine.num_threads=1",
        "autoscaling.max_replicas=1", f"output.run_dir={root}",
    ])
    handle = start_serving(cfg, timeout_s=300)
    try:
        _wait_for(lambda: _get(f"{handle.url}/metrics")["active_version"] == 1, 120, "drafter v1 to load")
        client = openai.OpenAI(base_url=handle.base_url, api_key=KEY, timeout=120, max_retries=0)
        yield handle, client, registry, root
    finally:
        handle.stop()
        serve.shutdown()


def test_completions_chat_and_streaming(served):
    handle, client, _, _ = served
    completion = client.completions.create(model=handle.model, prompt="Once upon a time", **GREEDY)
    assert completion.usage.completion_tokens == 12 and completion.system_fingerprint == "specray-drafter-v1"
    messages = [{"role": "user", "content": "Hi"}]
    chat = client.chat.completions.create(model=handle.model, messages=messages, **GREEDY)
    assert chat.choices[0].message.role == "assistant" and chat.choices[0].finish_reason == "length"
    stream = client.chat.completions.create(model=handle.model, messages=messages, stream=True, **GREEDY)
    chunks = list(stream)
    assert len(chunks) > 2 and _content(chunks) == chat.choices[0].message.content
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=handle.base_url, api_key="wrong", max_retries=0).models.list()
    with pytest.raises(openai.BadRequestError, match="temperature"):
        client.completions.create(model=handle.model, prompt="x", temperature=-1)
    assert [m.id for m in client.models.list()] == ["debug"]


def _clients(handle, client, stop: threading.Event, results: list, errors: list, n: int = 8):
    """n threads sending the same greedy chat request until ``stop`` (each at least twice)."""

    def run():
        sent = 0
        while sent < 2 or not stop.is_set():
            try:
                stream = sent % 2 == 1
                reply = client.chat.completions.create(model=handle.model, messages=[{"role": "user", "content": "Hi"}],
                                                       stream=stream, **GREEDY)
                if stream:
                    chunks = list(reply)
                    results.append((chunks[0].system_fingerprint, _content(chunks)))
                else:
                    results.append((reply.system_fingerprint, reply.choices[0].message.content))
            except Exception as e:  # noqa: BLE001 - every failure is counted and reported by the test
                errors.append(repr(e))
            sent += 1

    threads = [threading.Thread(target=run) for _ in range(n)]
    for t in threads:
        t.start()
    return threads


def test_concurrent_clients_and_hot_load_without_failures(served, debug_target):
    handle, client, registry, root = served
    stop, results, errors = threading.Event(), [], []
    threads = _clients(handle, client, stop, results, errors)
    try:
        _wait_for(lambda: len(results) >= 8, 120, "a first round of answers")
        assert registry.publish(random_dflash_export(debug_target, root / "export-2", seed=1)) == 2  # while requests run
        _wait_for(lambda: _get(f"{handle.url}/metrics")["active_version"] == 2, 120, "drafter v2 to be active")
        seen = len(results)
        _wait_for(lambda: len(results) >= seen + 8, 120, "answers from v2")
    finally:
        stop.set()
        for t in threads:
            t.join(timeout=180)
    assert errors == [] and len(results) >= 16
    assert {f for f, _ in results} == {"specray-drafter-v1", "specray-drafter-v2"}
    assert len({text for _, text in results}) == 1  # greedy output is the target's, whichever drafter drafted

    corrupt = root / "export-3"
    corrupt.mkdir()
    for f in (root / "export-2").iterdir():
        (corrupt / f.name).write_bytes(f.read_bytes())
    (corrupt / "model.safetensors").write_bytes(b"\0" * 64)
    assert registry.publish(corrupt) == 3
    metrics = _wait_for(lambda: (m := _get(f"{handle.url}/metrics"))["rejected_versions"] and m, 120, "v3 rejected")
    assert metrics["active_version"] == 2 and metrics["rejected_versions"][0]["version"] == 3
    assert "sha256" in metrics["rejected_versions"][0]["error"]
    after = client.completions.create(model=handle.model, prompt="x", **GREEDY)
    assert after.system_fingerprint == "specray-drafter-v2"


def test_operators_pin_roll_back_and_see_what_replicas_serve(served, capsys):
    """``specray registry`` while the replica serves: a pin holds an older version, unpin returns to
    the newest good one, rollback falls back to the one before; ``status`` shows the replica's
    version and live tau from its own reports."""
    from specray.pipeline.cli import main

    handle, client, registry, root = served
    uri, metrics = str(root / "registry"), f"{handle.url}/metrics"

    def serving(version: int, what: str) -> None:
        _wait_for(lambda: _get(metrics)["active_version"] == version, 120, what)
        reply = client.completions.create(model=handle.model, prompt="Once upon a time", **GREEDY)
        assert reply.system_fingerprint == f"specray-drafter-v{version}"

    assert main(["registry", "pin", "1", "--uri", uri]) == 0
    serving(1, "the pinned version 1")
    replica = _get(f"{handle.url}/health")["replica"]
    report = _wait_for(lambda: [r for r in registry.replicas() if r["replica"] == replica and r["version"] == 1
                                and r["pinned"] == 1], 60, "the replica's report of the pin")[0]
    assert report["tau"] is not None and report["tau"] >= 1.0
    capsys.readouterr()
    assert main(["registry", "status", "--uri", uri, "--json"]) == 0
    status = json.loads(capsys.readouterr().out)
    [mine] = [r for r in status["replicas"] if r["replica"] == replica]
    assert (mine["version"], mine["state"], status["pinned"], status["newest_good"]) == (1, "serving", 1, 2)
    assert main(["registry", "unpin", "--uri", uri]) == 0
    serving(2, "the newest good version 2 after unpin")
    assert main(["registry", "rollback", "--uri", uri, "--reason", "test"]) == 0
    serving(1, "version 1 after rolling back version 2")
    assert main(["registry", "pin", "2", "--uri", uri]) == 0 and main(["registry", "unpin", "--uri", uri]) == 0
    serving(2, "version 2 pinned again, then unpinned")


def test_replica_metrics_reach_rays_prometheus_endpoint(served):
    """``ReplicaMetrics``: Ray's own Prometheus endpoint holds the replica's engine stats, tagged with
    its replica id and drafter version."""
    import ray

    handle, client, _, _ = served
    client.completions.create(model=handle.model, prompt="Once upon a time", **GREEDY)
    replica = _get(f"{handle.url}/health")["replica"]
    port = ray._private.worker.global_worker.node.metrics_export_port

    def scraped() -> list[str]:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
            lines = response.read().decode().splitlines()
        return [line for line in lines if line.startswith("ray_specray_") and replica in line]

    lines = _wait_for(lambda: (found := scraped()) and any(line.startswith("ray_specray_tau{") for line in found)
                      and found, 120, "the replica's metrics in Ray's Prometheus endpoint")
    tau = [line for line in lines if line.startswith("ray_specray_tau{")]
    assert tau and all('version="' in line and 'model="debug"' in line for line in tau)
    assert any(line.startswith("ray_specray_tokens_generated") for line in lines)
    text = urllib.request.urlopen(urllib.request.Request(f"{handle.url}/metrics?format=prometheus",
                                                         headers={"Authorization": f"Bearer {KEY}"})).read().decode()
    assert f'specray_tokens_generated_total{{model="debug",replica="{replica}"}}' in text


def test_logprobs_and_neutral_fields_through_serve(served):
    handle, client, _, _ = served
    chat = client.chat.completions.create(model=handle.model, messages=[{"role": "developer", "content": "Be brief."},
                                                                        {"role": "user", "content": [
                                                                            {"type": "text", "text": "Hi"}]}],
                                          frequency_penalty=0, presence_penalty=0, logprobs=True, top_logprobs=2,
                                          **GREEDY)
    content = chat.choices[0].logprobs.content
    assert len(content) == 12 and all(len(c.top_logprobs) == 2 and c.logprob <= 0 for c in content)
    with pytest.raises(openai.BadRequestError, match="presence_penalty: not implemented"):
        client.chat.completions.create(model=handle.model, messages=[{"role": "user", "content": "Hi"}],
                                       presence_penalty=1.0)


def test_a_killed_replica_is_replaced(served):
    import ray

    handle, client, _, _ = served
    before = _get(f"{handle.url}/health")["replica"]
    names = [a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
             if a["name"].startswith("SERVE_REPLICA::") and handle.app_name in a["name"] and before in a["name"]]
    assert len(names) == 1
    ray.kill(ray.get_actor(names[0], namespace="serve"), no_restart=True)
    after = _wait_for(lambda: (h := _get(f"{handle.url}/health"))["replica"] != before and h, 240, "a new replica")
    assert after["status"] == "ok"
    reply = client.completions.create(model=handle.model, prompt="Once upon a time", **GREEDY)
    assert reply.usage.completion_tokens == 12


def test_a_replica_whose_engine_loop_stopped_is_replaced(served):
    """check_health fails once the engine loop thread is gone; Serve replaces that replica."""
    import ray

    def stop_engine_loops(replica_actor) -> int:
        """Runs inside the replica's process (pickled by value, being local): stop its EngineLoop
        thread as a crash would; the actor and its HTTP app stay up, only check_health can tell."""
        import gc

        from specray.serving.engine import EngineLoop

        gc.unfreeze()  # Ray workers freeze their GC, and frozen objects are not in gc.get_objects()
        loops = [o for o in gc.get_objects() if isinstance(o, EngineLoop) and o.alive]
        for loop in loops:
            loop.stop(timeout=30)
        return len(loops)

    handle, client, _, _ = served
    before = _get(f"{handle.url}/health")["replica"]
    (name,) = [a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
               if a["name"].startswith("SERVE_REPLICA::") and handle.app_name in a["name"] and before in a["name"]]
    replica = ray.get_actor(name, namespace="serve")
    assert ray.get(replica.__ray_call__.remote(stop_engine_loops), timeout=60) == 1
    after = _wait_for(lambda: (h := _get(f"{handle.url}/health"))["replica"] != before and h, 240,
                      "Serve to replace the replica whose engine loop stopped")
    assert after["status"] == "ok"
    reply = client.completions.create(model=handle.model, prompt="Once upon a time", **GREEDY)
    assert reply.usage.completion_tokens == 12


def test_replica_spec_carries_the_speculation_settings():
    """serve.engine's speculation settings reach every replica's Engine (a cost table as an absolute path)."""
    from specray.actors.serve import replica_spec

    cfg = load_config(ServeJobConfig, "manifests/serve.yaml",
                      ["engine.num_speculative_tokens=2", "engine.max_speculative_batch=3", "engine.speculation=static",
                       "engine.tree=true", "engine.cost_table=cost.json"])
    spec = replica_spec(cfg, None)
    assert (spec.num_speculative_tokens, spec.max_speculative_batch, spec.speculation, spec.tree) == (2, 3, "static", True)
    assert spec.cost_table == str(Path("cost.json").resolve())
    default = replica_spec(load_config(ServeJobConfig, "manifests/serve.yaml"), None)
    assert (default.speculation, default.max_speculative_batch, default.cost_table) == ("auto", None, None)
