"""The KubeRay manifests point at things that exist: the RayJob's entrypoint is a valid
``specray pipeline run`` (manifest + overrides) that finishes with its store, checkpoints and
registry on S3 (SeaweedFS here; nothing a later stage or another node reads stays on the driver's
disk), and the RayService's Serve config validates against Ray's own schema and its import path
builds our application from its args."""

import ast
import json
import os
import shlex
import subprocess
import sys
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
    assert text.index("torch==2.13.0") < text.index("-c constraints.txt '.[tracking]'")


# -- the image and the manifests around it ------------------------------------------------------

ROOT = Path(__file__).resolve().parents[2]
DOCKERFILE = KUBERAY / "Dockerfile"


def _dockerfile_env() -> dict[str, str]:
    """The image's ENV lines (``ENV A=1 B=2``), as every process in a pod sees them."""
    env = {}
    for line in DOCKERFILE.read_text().splitlines():
        if line.startswith("ENV "):
            env.update(item.split("=", 1) for item in shlex.split(line[4:]))
    return env


def _cluster_specs() -> list[tuple[str, dict, dict]]:
    """(manifest, its cluster spec, the whole manifest) of the RayJob and the RayService."""
    job = yaml.safe_load((KUBERAY / "rayjob-quickstart.yaml").read_text())
    service = yaml.safe_load((KUBERAY / "rayservice.yaml").read_text())
    return [("rayjob-quickstart.yaml", job["spec"]["rayClusterSpec"], job),
            ("rayservice.yaml", service["spec"]["rayClusterConfig"], service)]


def _containers(spec: dict) -> list[dict]:
    groups = [spec["headGroupSpec"], *spec["workerGroupSpecs"]]
    return [c for group in groups for c in group["template"]["spec"]["containers"]]


def test_the_image_leaves_multi_node_clusters_on():
    """RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 makes Ray 2.60's `ray start --address` abort on Linux too."""
    from ray._private import ray_constants
    from ray.scripts import scripts

    assert "Multi-node Ray clusters are not supported" in Path(scripts.__file__).read_text()
    assert ray_constants.ENABLE_RAY_CLUSTERS_ENV_VAR == "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"
    assert _dockerfile_env().get("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "1") != "0"
    for name, spec, _ in _cluster_specs():
        for container in _containers(spec):
            env = {e["name"]: e.get("value") for e in container.get("env", [])}
            assert env.get("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "1") != "0", name


def test_every_dashboard_off_loopback_requires_a_token_and_no_token_is_written_down():
    for name, spec, _ in _cluster_specs():
        host = spec["headGroupSpec"]["rayStartParams"].get("dashboard-host", "127.0.0.1")
        if host not in ("127.0.0.1", "localhost"):
            assert spec.get("authOptions", {}).get("mode") == "token", f"{name}: dashboard on {host} without a token"
            assert float(spec["rayVersion"].rsplit(".", 1)[0]) >= 2.52, name  # Ray token auth exists from 2.52
    for path in [DOCKERFILE, *KUBERAY.glob("*.yaml")]:
        text = path.read_text()
        assert "RAY_AUTH_TOKEN=" not in text and "RAY_AUTH_TOKEN:" not in text, f"{path} writes a Ray token down"


def test_every_secret_the_pods_read_is_in_the_secrets_template():
    secrets = {doc["metadata"]["name"]: doc for doc in yaml.safe_load_all((KUBERAY / "secrets.yaml").read_text())}
    assert all(doc["kind"] == "Secret" for doc in secrets.values())
    used = set()
    for name, spec, _ in _cluster_specs():
        for container in _containers(spec):
            refs = {ref["secretRef"]["name"] for ref in container.get("envFrom", []) if "secretRef" in ref}
            refs |= {e["valueFrom"]["secretKeyRef"]["name"] for e in container.get("env", [])
                     if "secretKeyRef" in e.get("valueFrom", {})}
            assert refs <= set(secrets), f"{name}: {sorted(refs - set(secrets))} not in secrets.yaml"
            assert "specray-s3" in refs, f"{name}: every Ray container reads the S3 credentials"
            used |= refs
    assert used == set(secrets)
    assert set(secrets["specray-s3"]["stringData"]) >= {"AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"}
    assert set(secrets["specray-api-key"]["stringData"]) == {"SPECRAY_API_KEY"}
    values = [v for doc in secrets.values() for v in doc["stringData"].values()]
    assert set(values) == {"REPLACE-ME"}, "the template holds placeholders, never values"
    job = yaml.safe_load((KUBERAY / "rayjob-quickstart.yaml").read_text())
    forwarded = yaml.safe_load(job["spec"]["runtimeEnvYAML"])["env_vars"]
    assert not {k for k in forwarded if "SECRET" in k or "KEY" in k or "TOKEN" in k}, "credentials in a runtime_env"


def test_the_port_forward_names_the_service_kuberay_creates():
    """KubeRay names a RayService's Serve service ``<metadata.name>-serve-svc``; a RayJob's submitter
    Job has the RayJob's name."""
    import re

    service = yaml.safe_load((KUBERAY / "rayservice.yaml").read_text())
    named = re.findall(r"kubectl port-forward svc/(\S+)", (KUBERAY / "rayservice.yaml").read_text())
    assert named == [f"{service['metadata']['name']}-serve-svc"]
    job = yaml.safe_load((KUBERAY / "rayjob-quickstart.yaml").read_text())
    assert re.findall(r"kubectl logs -f job/(\S+)", (KUBERAY / "rayjob-quickstart.yaml").read_text()) == [
        job["metadata"]["name"]]


def test_the_docker_context_leaves_out_every_venv_and_run_output():
    import re

    ignored = {line.strip().rstrip("/") for line in Path(".dockerignore").read_text().splitlines() if line.strip()}
    makefile = Path("Makefile").read_text()
    venvs = set(re.findall(r"^(?:VENV|VLLM_VENV) \?= (\S+)$", makefile, flags=re.M))
    assert venvs == {".venv", ".venv-vllm"} and venvs <= ignored
    assert {"runs", "bench", ".git"} <= ignored


# -- what the image installs against what its entrypoints import ---------------------------------

PACKAGE_DIRS = {"pipeline", "actors", "capture", "trainer", "serving", "kernels", "drafters"}
LOADED_BY_NAME = {  # imported by a library from a name in the config, invisible to an import scan
    "s3fs": "fsspec opens s3:// URIs with it (store.uri, train.storage, serve.registry)",
    "gguf": "transformers reads the embedded target's GGUF file with it (capture/target.py)",
}


def _imports(tree: ast.AST) -> set[str]:
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found |= {node.module, *(f"{node.module}.{alias.name}" for alias in node.names)}
    return found


def _module_file(module: str) -> Path | None:
    parts = module.split(".")[1:]
    if not parts or parts[0] not in PACKAGE_DIRS:
        return None
    path = ROOT.joinpath(*parts)
    return path.with_suffix(".py") if path.with_suffix(".py").is_file() else (
        path / "__init__.py" if (path / "__init__.py").is_file() else None)


def _third_party_imports(start: set[str]) -> dict[str, str]:
    """Top-level modules outside specray and the standard library that the modules ``start`` names import
    (at module level or inside functions, every specray module they reach likewise): module -> an importer."""
    found, seen, todo = {}, set(), list(start)
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        path = _module_file(name)
        if path is None:
            continue
        for imported in _imports(ast.parse(path.read_text())):
            top = imported.split(".")[0]
            if top == "specray":
                parts = imported.split(".")
                todo += [".".join(parts[:k]) for k in range(2, len(parts) + 1)]
            elif top not in sys.stdlib_module_names and top != "__future__":
                found.setdefault(top, name)
    return found


def _cli_command_imports(command: str) -> set[str]:
    """What ``specray <command>`` runs: pipeline/cli.py's module-level imports and those of ``_cmd_<command>``."""
    tree = ast.parse((ROOT / "pipeline" / "cli.py").read_text())
    module_level = [n for n in tree.body if isinstance(n, (ast.Import, ast.ImportFrom))]
    top = _imports(ast.Module(body=module_level, type_ignores=[]))
    (fn,) = [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == f"_cmd_{command}"]
    return {m for m in top | _imports(fn) if m.startswith("specray.")}


def _image_distributions() -> dict[str, str]:
    """Every distribution the Dockerfile's pip lines install: the named requirements, ``.`` as specray,
    and their dependencies (from this venv's metadata, markers evaluated), ``--no-deps`` ones alone."""
    from importlib.metadata import distribution

    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name

    text = DOCKERFILE.read_text().replace("\\\n", " ")
    run = next(line for line in text.splitlines() if line.startswith("RUN ") and "pip install" in line)
    wanted: list[tuple[str, set[str], bool]] = []
    for command in run[4:].split("&&"):
        argv = shlex.split(command)
        assert argv[:2] == ["pip", "install"], command
        no_deps, skip = "--no-deps" in argv, False
        for arg in argv[2:]:
            if skip or arg.startswith("-"):
                skip = arg in ("-c", "--index-url", "-r") and not skip
                continue
            if arg.startswith("."):
                wanted.append(("specray", set(arg.partition("[")[2].rstrip("]").split(",")) - {""}, no_deps))
            else:
                req = Requirement(arg)
                wanted.append((req.name, set(req.extras), no_deps))
    installed: dict[str, str] = {}
    while wanted:
        name, extras, no_deps = wanted.pop()
        key = canonicalize_name(name)
        if key in installed and not extras:
            continue
        dist = distribution(name)
        installed[key] = dist.version
        if no_deps:
            continue
        for line in dist.requires or []:
            req = Requirement(line)
            if req.marker is None or any(req.marker.evaluate({"extra": e}) for e in extras | {""}):
                wanted.append((req.name, set(req.extras), False))
    return installed


def _providers(module: str) -> set[str]:
    from importlib.metadata import packages_distributions

    from packaging.utils import canonicalize_name

    return {canonicalize_name(d) for d in packages_distributions().get(module, [])}


NOT_IMPORTED = "not imported"


@pytest.mark.parametrize("entrypoint, start", [
    ("rayjob: specray pipeline run", lambda: _cli_command_imports("pipeline")),
    ("rayservice: specray.pipeline.jobs.serve:build_app", lambda: {"specray.pipeline.jobs.serve"}),
], ids=["rayjob", "rayservice"])
def test_the_image_installs_what_its_entrypoints_import(entrypoint, start):
    """Each third-party module the entrypoint can import (a superset: every function of every module it
    reaches), and each package it loads by name, comes from a distribution the image's pip lines install."""
    from specray.capture.data import DATASETS
    from specray.capture.target import EMBEDDED_TARGETS

    image = _image_distributions()
    imported = _third_party_imports(start())
    assert {"ray", "torch", "openai"} <= set(imported) or "build_app" in entrypoint, imported
    # backend: vllm needs an image with vLLM (docs/pipeline.md, KubeRay): reached through its engine module only
    assert imported.pop("vllm", NOT_IMPORTED) in (NOT_IMPORTED, "specray.serving.vllm_engine"), imported
    missing = {m: by for m, by in imported.items() if not _providers(m) & set(image)}
    assert not missing, f"{entrypoint}: imported but not installed in the image (module: importer): {missing}"

    job = yaml.safe_load((KUBERAY / "rayjob-quickstart.yaml").read_text())
    argv = shlex.split(job["spec"]["entrypoint"])
    cfg = load_config(PipelineConfig, argv[3], argv[4:])
    by_name = set(LOADED_BY_NAME)
    if cfg.target.name.startswith("embedded:"):
        by_name.add(EMBEDDED_TARGETS[cfg.target.name.removeprefix("embedded:")].package)
    by_name |= {DATASETS[d].package for d in (cfg.data.dataset, cfg.bench.dataset, cfg.train.live_eval.dataset)}
    from packaging.utils import canonicalize_name

    absent = {p for p in by_name if canonicalize_name(p) not in image}
    assert not absent, f"{entrypoint}: loaded by name but not installed in the image: {sorted(absent)}"


# -- the RayJob on a real two-node cluster ---------------------------------------------------------

LOOPBACK_RAY = ROOT / "tests" / "ray_loopback.py"


def _ray(*argv: str) -> list[str]:
    """Ray's CLI as this venv runs it."""
    return [sys.executable, "-m", "ray.scripts.scripts", *argv]


def _ray_keeping_loopback(*argv: str) -> list[str]:
    """Ray's CLI keeping 127.0.0.1 as given with multi-node on (tests/ray_loopback.py)."""
    return [sys.executable, str(LOOPBACK_RAY), *argv]


def _start_params(group: dict, **override: str) -> list[str]:
    """A group's rayStartParams as ``ray start`` flags (KubeRay passes them the same way), with overrides."""
    params = {**group["rayStartParams"], **override}
    return [f"--{key}={value}" for key, value in params.items()]


def _wait_for_nodes(env: dict, dashboard: str, count: int, timeout_s: float = 120) -> list[dict]:
    import time

    deadline = time.monotonic() + timeout_s
    while True:
        done = subprocess.run(_ray("list", "nodes", "--format", "json", "--address", dashboard), env=env,
                              capture_output=True, text=True, timeout=60)
        nodes = [n for n in json.loads(done.stdout or "[]") if n["state"] == "ALIVE"] if done.returncode == 0 else []
        if len(nodes) == count:
            return nodes
        assert time.monotonic() < deadline, f"{len(nodes)} of {count} nodes: {done.stdout[-2000:]} {done.stderr[-2000:]}"
        time.sleep(2)


@pytest.mark.ray
@pytest.mark.s3
@pytest.mark.timeout(1800)
def test_the_rayjob_runs_on_a_two_node_cluster_with_its_work_on_the_worker(seaweedfs, tmp_path):
    """The RayJob as KubeRay runs it, on one machine: a head node and a worker node started by ``ray start``
    with the manifest's rayStartParams (the head: no CPUs; the worker: the CPUs of its pod's limits), the
    image's environment (multi-node on), Ray token auth as ``authOptions`` sets it on every container, the
    S3 credentials in the nodes' own environment; ``ray job submit`` of the entrypoint with its runtime env.
    The job succeeds, its actors that need CPUs ran on the worker node, no actor's runtime env holds a
    credential, a request without the token is refused, and every socket the nodes listen on is loopback."""
    import secrets as token_source
    import tempfile
    import urllib.error
    import urllib.request

    from ports import free_port
    from ray_processes import bound_sockets, is_loopback, processes_of, stop_only
    from test_pipeline import TINY

    job = yaml.safe_load((KUBERAY / "rayjob-quickstart.yaml").read_text())
    spec = job["spec"]["rayClusterSpec"]
    assert spec["authOptions"]["mode"] == "token"
    token = token_source.token_hex(32)
    home = tmp_path / "home"
    home.mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")} | _dockerfile_env() | {
        "HOME": str(home), "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": token}  # what authOptions sets
    # One machine, not pods: the head's processes (its job agent joins the cluster with ray.init) keep 127.0.0.1
    # only with this set; the worker node runs with the image's environment, where it would refuse to join.
    head_env = env | {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}
    temp_dir = tempfile.mkdtemp(prefix="r2", dir="/tmp")  # short: Ray's socket paths must fit 107 bytes
    gcs, dashboard_port, client, head_agent, worker_agent, serve_port = (free_port() for _ in range(6))
    dashboard = f"http://127.0.0.1:{dashboard_port}"
    head_group, (worker_group,) = spec["headGroupSpec"], spec["workerGroupSpecs"]
    worker_cpus = worker_group["template"]["spec"]["containers"][0]["resources"]["limits"]["cpu"]
    node = ["--node-ip-address=127.0.0.1", "--object-store-memory=200000000", "--disable-usage-stats"]
    head = _ray("start", "--head", *node, f"--port={gcs}", f"--dashboard-port={dashboard_port}",
                f"--ray-client-server-port={client}", f"--dashboard-agent-listen-port={head_agent}",
                f"--temp-dir={temp_dir}", *_start_params(head_group, **{"dashboard-host": "127.0.0.1"}))
    worker = _ray_keeping_loopback("start", f"--address=127.0.0.1:{gcs}", *node,
                                   f"--dashboard-agent-listen-port={worker_agent}", f"--num-cpus={worker_cpus}",
                                   *_start_params(worker_group))
    starters = []
    try:
        for argv, node_env in ((head, head_env), (worker, env)):  # cwd: the image's workingDir (relative paths)
            starters.append(subprocess.Popen(argv, env=node_env, cwd=ROOT, stdout=subprocess.PIPE,
                                             stderr=subprocess.STDOUT, text=True, start_new_session=True))
            out, _ = starters[-1].communicate(timeout=180)
            assert starters[-1].returncode == 0, out[-3000:]
        nodes = _wait_for_nodes(env, dashboard, 2)
        (head_node,) = [n["node_id"] for n in nodes if n["is_head_node"]]
        (worker_node,) = [n["node_id"] for n in nodes if not n["is_head_node"]]
        assert {n["node_ip"] for n in nodes} == {"127.0.0.1"}

        with pytest.raises(urllib.error.HTTPError) as refused:  # the job server wants the token
            urllib.request.urlopen(f"{dashboard}/api/jobs/", timeout=30)
        assert refused.value.code == 401

        prefix = seaweedfs.uri(f"rayjob2-{uuid.uuid4().hex[:8]}")
        run_dir = tmp_path / "quickstart"
        entrypoint = shlex.split(job["spec"]["entrypoint"].replace("s3://specray/quickstart", prefix))
        entrypoint += [*TINY, "train.drafter.draft_vocab_size=128", "bench.enabled=false", f"output.run_dir={run_dir}",
                       f"serve.http.port={serve_port}"]
        runtime_env = yaml.safe_load(job["spec"]["runtimeEnvYAML"])
        submit = subprocess.run(_ray("job", "submit", "--address", dashboard, "--runtime-env-json",
                                     json.dumps(runtime_env), "--", *entrypoint),
                                env=env, capture_output=True, text=True, timeout=1200)
        assert submit.returncode == 0 and "succeeded" in submit.stdout, submit.stdout[-4000:] + submit.stderr[-3000:]
        report = json.loads((run_dir / "report.json").read_text())
        assert report["train"]["steps"] == 4 and report["serve"]["smoke_requests"] == 2

        listed = subprocess.run(_ray("list", "actors", "--detail", "--format", "json", "--limit", "10000",
                                     "--address", dashboard), env=env, capture_output=True, text=True, timeout=120)
        assert listed.returncode == 0, listed.stderr[-3000:]
        actors = json.loads(listed.stdout)
        working = [a for a in actors if any(k == "CPU" or k.startswith("CPU_group_") and v > 0
                                            for k, v in (a.get("required_resources") or {}).items())]
        kinds = {a["class_name"] for a in working}
        every = sorted({(a["class_name"], json.dumps(a.get("required_resources"))) for a in actors})
        assert "CaptureActor" in kinds and f"ServeReplica:{report['name']}:SpecrayReplica" in kinds, every
        assert any("Train" in k for k in kinds), every
        assert {a["node_id"] for a in working} == {worker_node}, [(a["class_name"], a["node_id"]) for a in working]
        assert head_node in {a["node_id"] for a in actors}  # the head ran its control actors (Serve's controller)
        assert os.environ["AWS_SECRET_ACCESS_KEY"] not in listed.stdout, "a credential in an actor's runtime env"

        sockets = bound_sockets(processes_of(starters[0].pid, temp_dir))
        assert sockets and not [s for s in sockets if not is_loopback(s[0])]
    finally:
        left = sorted({pid for p in starters for pid in stop_only(p.pid, temp_dir)})
        if not left:
            import shutil

            shutil.rmtree(temp_dir, ignore_errors=True)
    assert left == [], f"processes of the test's cluster still running: {left}"
