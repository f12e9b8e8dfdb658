"""Serve's http options belong to whoever started Serve on the cluster: an application that started
it shuts it down when it stops, so the next application on the same cluster (another test, the
next pipeline run, a load bench) binds its own host and port instead of timing out on the old one."""

import urllib.request

import pytest
from ports import free_port

from specray.pipeline.config import ServeJobConfig, load_config

pytestmark = pytest.mark.ray


def _config(tmp_path, port: int) -> ServeJobConfig:
    return load_config(ServeJobConfig, "manifests/serve.yaml", [
        f"name=restart-{port}", "target.name=debug", "registry.uri=null", f"http.port={port}", "engine.max_len=256",
        "engine.num_threads=1", "autoscaling.max_replicas=1", f"output.run_dir={tmp_path / str(port)}",
    ])


def _healthy(url: str) -> bool:
    with urllib.request.urlopen(f"{url}/health", timeout=10) as response:
        return response.status == 200


def test_an_application_that_started_serve_stops_it_and_the_next_binds_its_own_port(ray_cluster, tmp_path):
    from specray.actors.serve import _serve_is_running, start_serving

    assert not _serve_is_running(), "an earlier test left Serve running on the shared cluster"
    first = start_serving(_config(tmp_path, free_port()), timeout_s=300)
    try:
        assert first.started_serve and _healthy(first.url)
    finally:
        first.stop()
    assert not _serve_is_running()
    second = start_serving(_config(tmp_path, free_port()), timeout_s=300)  # before: its /health never answered
    try:
        assert second.started_serve and _healthy(second.url)
    finally:
        second.stop()
    assert not _serve_is_running()
