"""Serve's autoscaler on specray replicas: under load the deployment grows from min_replicas to
max_replicas, and back once the load stops. The app has no API key, so it also shows that
loopback clients are served through Serve's proxy (the guard sees the real client address)."""

import threading
import time

import openai
import pytest
from ports import free_port

from specray.pipeline.config import ServeJobConfig, load_config

pytestmark = pytest.mark.ray

DEPLOYMENT = "SpecrayReplica"


def _running(app_name: str) -> int:
    from ray import serve

    app = serve.status().applications.get(app_name)
    if app is None or DEPLOYMENT not in app.deployments:
        return 0
    return app.deployments[DEPLOYMENT].replica_states.get("RUNNING", 0)


def _wait_for_replicas(app_name: str, count: int, timeout: float, what: str) -> float:
    start = time.monotonic()
    while _running(app_name) != count:
        assert time.monotonic() - start < timeout, f"{what}: {_running(app_name)} replicas after {timeout} s"
        time.sleep(0.5)
    return time.monotonic() - start


def test_replicas_scale_up_under_load_and_back_down(ray_cluster, tmp_path, monkeypatch):
    from ray import serve

    from specray.actors.serve import start_serving

    monkeypatch.delenv("SPECRAY_API_KEY", raising=False)
    cfg = load_config(ServeJobConfig, "manifests/serve.yaml", [
        "name=specray-autoscale", "target.name=debug", "registry.uri=null", f"http.port={free_port()}",
        "engine.max_len=256", "engine.num_threads=1", "autoscaling.min_replicas=1", "autoscaling.max_replicas=2",
        "autoscaling.target_ongoing_requests=1", "autoscaling.upscale_delay_s=0", "autoscaling.downscale_delay_s=1",
        f"output.run_dir={tmp_path}",
    ])
    handle = start_serving(cfg, timeout_s=300)
    stop, answered, errors = threading.Event(), [], []
    client = openai.OpenAI(base_url=handle.base_url, api_key="unused", timeout=120, max_retries=0)

    def load():
        while not stop.is_set():
            try:
                reply = client.completions.create(model=handle.model, prompt="Once upon a time", max_tokens=64,
                                                  temperature=0, extra_body={"ignore_eos": True})
                answered.append(reply.usage.completion_tokens)
            except Exception as e:  # noqa: BLE001 - every failure is counted and reported by the test
                errors.append(repr(e))

    threads = [threading.Thread(target=load) for _ in range(6)]
    try:
        assert _running(handle.app_name) == 1
        for t in threads:
            t.start()
        up = _wait_for_replicas(handle.app_name, 2, 150, "scale up to max_replicas=2 under 6 concurrent clients")
        served_before = len(answered)
        time.sleep(2)  # both replicas answer
        assert len(answered) > served_before
        stop.set()
        for t in threads:
            t.join(timeout=120)
        down = _wait_for_replicas(handle.app_name, 1, 150, "scale back down to min_replicas=1 once idle")
        print(f"scaled up in {up:.0f} s, down in {down:.0f} s; {len(answered)} requests answered")
    finally:
        stop.set()
        for t in threads:
            t.join(timeout=120)
        handle.stop()
        serve.shutdown()
    assert errors == [] and set(answered) == {64}
