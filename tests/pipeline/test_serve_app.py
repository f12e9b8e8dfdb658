"""``build_app`` (the Serve config / KubeRay RayService path): its replicas get the API key and the
HTTP limits, and without a key they answer loopback clients only, since the RayService binds its
proxy to 0.0.0.0 where specray cannot check it."""

import pytest
from fastapi.testclient import TestClient

from specray.pipeline.jobs.serve import build_app
from specray.serving.openai_api import create_app


def _spec(app):
    (spec,) = app._bound_deployment.init_args  # what every replica is constructed with
    return spec


def _replica_app(spec):
    """The app a replica builds from its spec (SpecrayReplica.__serve_build_asgi_app__), minus the engine."""
    return create_app(object(), model_name=spec.model_name, api_key=spec.api_key, limits=spec.limits)


def test_without_a_key_the_replicas_answer_loopback_clients_only(monkeypatch, caplog):
    monkeypatch.delenv("SPECRAY_API_KEY", raising=False)
    spec = _spec(build_app({"config": "manifests/serve.yaml"}))
    assert spec.api_key is None and "answer loopback clients only" in caplog.text
    remote = TestClient(_replica_app(spec), client=("10.0.0.12", 51000))  # another pod
    r = remote.post("/v1/completions", json={"prompt": "x"})
    assert r.status_code == 403 and "http.api_key" in r.json()["error"]["message"]


def test_the_key_and_limits_reach_the_replicas(monkeypatch):
    monkeypatch.setenv("SPECRAY_API_KEY", "sk-from-the-secret")
    spec = _spec(build_app({"config": "manifests/serve.yaml", "limits": {"max_body_bytes": 64, "docs": True}}))
    assert spec.api_key == "sk-from-the-secret" and (spec.limits.max_body_bytes, spec.limits.docs) == (64, True)
    client = TestClient(_replica_app(spec), client=("10.0.0.12", 51000))
    assert client.post("/v1/completions", json={"prompt": "x"}).status_code == 401
    r = client.post("/v1/completions", json={"prompt": "x" * 64}, headers={"Authorization": "Bearer sk-from-the-secret"})
    assert r.status_code == 413
    assert client.get("/openapi.json").status_code == 200


def test_bad_limits_are_refused_naming_the_field():
    with pytest.raises(ValueError, match=r"limits.max_body: Extra inputs .* \(HttpLimits fields: max_body_bytes, "):
        build_app({"limits": {"max_body": 1}})
    with pytest.raises(ValueError, match="limits.max_body_bytes: Input should be greater than 0"):
        build_app({"limits": {"max_body_bytes": 0}})
    with pytest.raises(ValueError, match="unknown application args \\['http'\\]"):
        build_app({"http": {}})


def test_a_key_from_a_secret_written_with_echo_is_stripped(monkeypatch, caplog):
    """A Kubernetes secret made with ``echo`` ends in a newline: the replicas compare the key
    without it (a warning says so), and a key of whitespace only is refused at start-up."""
    monkeypatch.setenv("SPECRAY_API_KEY", "sk-from-the-secret\n")
    spec = _spec(build_app({"config": "manifests/serve.yaml"}))
    assert spec.api_key == "sk-from-the-secret" and "trailing whitespace" in caplog.text
    client = TestClient(_replica_app(spec), client=("10.0.0.12", 51000))
    assert client.get("/v1/models", headers={"Authorization": "Bearer sk-from-the-secret"}).status_code == 200
    monkeypatch.setenv("SPECRAY_API_KEY", " \n")
    with pytest.raises(ValueError, match="empty or only whitespace"):
        build_app({"config": "manifests/serve.yaml"})
