"""The KubeRay manifests point at things that exist: the RayJob's entrypoint is a valid
``specray pipeline run`` (manifest + overrides), and the RayService's Serve config validates
against Ray's own schema and its import path builds our application from its args."""

import shlex
from pathlib import Path

import yaml

from specray.pipeline.config import PipelineConfig, load_config

KUBERAY = Path("manifests/kuberay")


def test_rayjob_entrypoint_is_a_valid_pipeline_run():
    job = yaml.safe_load((KUBERAY / "rayjob-quickstart.yaml").read_text())
    assert job["kind"] == "RayJob" and job["spec"]["rayClusterSpec"]["rayVersion"] == "2.60.0"
    argv = shlex.split(job["spec"]["entrypoint"])
    assert argv[:3] == ["specray", "pipeline", "run"]
    cfg = load_config(PipelineConfig, argv[3], argv[4:])
    assert cfg.store_uri.startswith("s3://") and cfg.train.storage.startswith("s3://")
    assert cfg.registry_uri.startswith("s3://")
    images = {c["image"] for group in [job["spec"]["rayClusterSpec"]["headGroupSpec"],
                                       *job["spec"]["rayClusterSpec"]["workerGroupSpecs"]]
              for c in group["template"]["spec"]["containers"]}
    assert images == {"specray:0.1.0"}


def test_rayservice_serve_config_validates_and_builds_the_app():
    from ray.serve.schema import ServeDeploySchema

    from specray.pipeline.serve_app import build_app

    service = yaml.safe_load((KUBERAY / "rayservice.yaml").read_text())
    assert service["kind"] == "RayService"
    serve_config = ServeDeploySchema.model_validate(yaml.safe_load(service["spec"]["serveConfigV2"]))
    (app,) = serve_config.applications
    module, name = app.import_path.split(":")
    assert (module, name) == ("specray.pipeline.serve_app", "build_app")
    built = build_app(app.args)
    assert type(built).__name__ == "Application"


def test_dockerfile_installs_torch_exactly_first():
    text = (KUBERAY / "Dockerfile").read_text()
    assert "FROM rayproject/ray:2.60.0-py311-cpu" in text
    assert text.index("torch==2.13.0") < text.index("-c constraints.txt .")
