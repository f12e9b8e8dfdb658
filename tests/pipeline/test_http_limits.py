"""``http.limits`` in a serve manifest bounds every replica's requests (serving/http_guard.py
``HttpLimits``): ``specray serve`` / ``start_serving``, the pipeline's serve stage and ``build_app``
(the Serve config / RayService path, whose ``limits`` arg overrides single fields)."""

import pytest
from fastapi.testclient import TestClient

from specray.actors.serve import application
from specray.pipeline.config import ConfigError, PipelineConfig, ServeJobConfig, load_config
from specray.pipeline.jobs.serve import build_app
from specray.serving.http_guard import HttpLimits
from specray.serving.openai_api import create_app

LIMITS = ["http.limits.max_body_bytes=4096", "http.limits.max_prompt_bytes=512", "http.limits.docs=true"]


def _spec(app):
    (spec,) = app._bound_deployment.init_args  # what every replica is constructed with
    return spec


def test_a_serve_manifest_sets_the_request_limits_of_every_replica():
    cfg = load_config(ServeJobConfig, "manifests/serve.yaml", LIMITS)
    spec = _spec(application(cfg, None))  # what start_serving deploys
    assert spec.limits == HttpLimits(max_body_bytes=4096, max_prompt_bytes=512, docs=True)
    replica = TestClient(create_app(object(), model_name=spec.model_name, api_key=None, limits=spec.limits),
                         client=("127.0.0.1", 50000))  # a loopback client: no key needed
    assert replica.post("/v1/completions", content=b"x" * 5000).status_code == 413
    assert replica.get("/openapi.json").status_code == 200

    assert load_config(ServeJobConfig, "manifests/serve.yaml").http.limits == HttpLimits()  # the defaults
    pipeline = load_config(PipelineConfig, "manifests/quickstart.yaml", [f"serve.{item}" for item in LIMITS])
    assert pipeline.serve_job().http.limits == spec.limits


def test_build_app_takes_the_manifests_limits_and_its_arg_over_them():
    app = build_app({"config": "manifests/serve.yaml", "overrides": LIMITS, "limits": {"docs": False}})
    assert _spec(app).limits == HttpLimits(max_body_bytes=4096, max_prompt_bytes=512, docs=False)


def test_bad_limits_name_the_field():
    with pytest.raises(ConfigError, match=r"http.limits.max_body_bytes: Input should be greater than 0"):
        load_config(ServeJobConfig, "manifests/serve.yaml", ["http.limits.max_body_bytes=0"])
    with pytest.raises(ConfigError, match=r"http.limits.max_body"):
        load_config(ServeJobConfig, "manifests/serve.yaml", ["http.limits.max_body=1"])
