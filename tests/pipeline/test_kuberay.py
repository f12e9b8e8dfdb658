"""The KubeRay manifests point at things that exist: the RayJob's entrypoint is a valid
``specray pipeline run`` (manifest + overrides) that finishes with its store, checkpoints and
registry on S3 (SeaweedFS here; nothing a later stage or another node reads stays on the driver's
disk), and the RayService's Serve config validates against Ray's own schema and its import path
builds our application from its args."""

import json
import os
import shlex
import subprocess
import uuid
from pathlib import Path

import pytest
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


@pytest.mark.ray
@pytest.mark.s3
@pytest.mark.timeout(1500)
def test_the_rayjob_entrypoint_finishes_with_everything_on_s3(ray_cluster, seaweedfs, tmp_path):
    """The RayJob's entrypoint and runtime env with its s3:// prefix on SeaweedFS and a debug-sized override,
    run as KubeRay runs it: a driver process on the cluster (``RAY_ADDRESS``)."""
    from ports import free_port
    from test_pipeline import TINY

    from specray.capture.store import open_fs

    job = yaml.safe_load((KUBERAY / "rayjob-quickstart.yaml").read_text())
    prefix = seaweedfs.uri(f"rayjob-{uuid.uuid4().hex[:8]}")
    argv = shlex.split(job["spec"]["entrypoint"].replace("s3://specray/quickstart", prefix))
    run_dir = tmp_path / "quickstart"  # the driver's (the head pod's) local disk
    argv += [*TINY, "train.drafter.draft_vocab_size=128", "bench.enabled=false", f"output.run_dir={run_dir}",
             f"serve.http.port={free_port()}"]
    # the job's runtime env; S3 endpoint and credentials come from the specray-s3 secret on the pods (here: os.environ)
    env = {**os.environ, **yaml.safe_load(job["spec"]["runtimeEnvYAML"])["env_vars"], "RAY_ADDRESS": ray_cluster.address}
    driver = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=1200)
    assert driver.returncode == 0, driver.stdout[-4000:] + driver.stderr[-4000:]

    report = json.loads((run_dir / "report.json").read_text())
    cfg = load_config(PipelineConfig, argv[3], argv[4:])
    assert (cfg.store_uri, cfg.train.storage, cfg.registry_uri) == (f"{prefix}/features", f"{prefix}/ray-train",
                                                                    f"{prefix}/registry")
    assert report["capture"]["manifest"] == f"{prefix}/features/manifests/quickstart.parquet"
    assert report["train"]["steps"] == 4 and report["train"]["checkpoint"].startswith(f"{prefix}/ray-train/")
    assert report["train"]["ledger"] == f"{prefix}/ray-train/quickstart-train/ledger"
    assert report["serve"]["registry"] == f"{prefix}/registry" and report["serve"]["version"] == 1
    assert report["serve"]["smoke_requests"] == 2
    assert set(report["stage_seconds"]) == {"capture", "train", "export", "serve"}
    provenance = json.loads((run_dir / "exports" / "final" / "export.json").read_text())
    assert provenance["checkpoint"] == report["train"]["checkpoint"]  # exported from S3
    fs, root, _ = open_fs(report["train"]["checkpoint"])
    assert fs.isdir(root)
    assert not (run_dir / "ray-train").exists() and not (run_dir / "features").exists()  # all on S3
    assert "report" in driver.stdout and "tau" in driver.stdout  # the job log ends with the report table


def test_rayservice_serve_config_validates_and_builds_the_app():
    from ray.serve.schema import ServeDeploySchema

    from specray.pipeline.jobs.serve import build_app

    service = yaml.safe_load((KUBERAY / "rayservice.yaml").read_text())
    assert service["kind"] == "RayService"
    serve_config = ServeDeploySchema.model_validate(yaml.safe_load(service["spec"]["serveConfigV2"]))
    (app,) = serve_config.applications
    module, name = app.import_path.split(":")
    assert (module, name) == ("specray.pipeline.jobs.serve", "build_app")
    built = build_app(app.args)
    assert type(built).__name__ == "Application"


def test_dockerfile_installs_torch_exactly_first():
    text = (KUBERAY / "Dockerfile").read_text()
    assert "FROM rayproject/ray:2.60.0-py311-cpu" in text
    assert text.index("torch==2.13.0") < text.index("-c constraints.txt .")
