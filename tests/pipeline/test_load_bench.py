"""``specray bench load``: two Serve replicas of the debug target under two streaming clients
while a new drafter, a corrupt export and a replica kill happen; the report's invariants."""

import json
from types import SimpleNamespace

import pytest
import torch

from specray.capture.contract import build_contract
from specray.drafters.dflash import DFlashDrafter, debug_config
from specray.drafters.format import InvalidDrafterError, save_drafter
from specray.pipeline.bench.load import (
    LoadBenchOptions,
    _corrupt_copy,
    _failures,
    _greedy,
    _Reference,
    bench_load,
    load_table,
)
from specray.pipeline.jobs.clients import StreamAttempt
from specray.serving.engine import Engine


def _export(target, out, seed: int):
    """An untrained DFlash drafter for the debug target, exported like a trained one."""
    contract = build_contract("dflash", target_fingerprint=target.target_fingerprint,
                              template_fingerprint=target.template_fingerprint, num_target_layers=target.num_layers,
                              hidden_size=target.hidden_size)
    torch.manual_seed(seed)
    model = DFlashDrafter(debug_config(target, contract.layer_ids), embed_tokens=target.model.model.embed_tokens,
                          lm_head=target.model.lm_head)
    return save_drafter(out, model, contract=json.loads(contract.to_json()), provenance={"run": f"random-{seed}"})


def test_options_are_checked(tmp_path):
    with pytest.raises(ValueError, match="not a drafter export"):
        LoadBenchOptions(drafter=str(tmp_path))
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ValueError, match="must come before bad_at"):
        LoadBenchOptions(drafter=str(tmp_path), publish_at=0.6, bad_at=0.5)
    with pytest.raises(ValueError, match="replicas"):
        LoadBenchOptions(drafter=str(tmp_path), replicas=1)


def test_the_corrupt_copy_is_refused_at_load(debug_target, tmp_path):
    good = _export(debug_target, tmp_path / "good", seed=0)
    bad = _corrupt_copy(good, tmp_path / "bad")
    assert (bad / "model.safetensors").stat().st_size == (good / "model.safetensors").stat().st_size
    assert Engine(debug_target, str(good)).drafter is not None
    with pytest.raises(InvalidDrafterError, match="sha256"):
        Engine(debug_target, str(bad))


def test_failures_are_attributed_to_the_kill_by_time_and_greedy_answers_compared():
    run = SimpleNamespace(events=[{"what": "kill", "at_s": 10.0}], options=SimpleNamespace(kill_window_s=2.0), attempts=[
        StreamAttempt(0, 0, 0, prompt=0, start_s=8.0, end_s=10.5, error="connection failed: RemoteProtocolError"),
        StreamAttempt(0, 0, 1, prompt=0, start_s=11.5, end_s=12.0, text="ab", tokens=2),  # its retry
        StreamAttempt(1, 0, 0, prompt=1, start_s=12.5, end_s=13.0, error="HTTP 500", server_error=True),  # after the window
        StreamAttempt(1, 1, 0, prompt=1, start_s=13.0, end_s=14.0, text="xy", tokens=2),
    ])
    failures, last = _failures(run)
    assert (failures["attempts_failed_from_kill"], failures["attempts_failed_not_from_kill"]) == (1, 1)
    assert failures["requests_failed_after_retries"] == 1 and failures["in_flight_at_kill"] == 1
    assert failures["by_reason"]["HTTP 500"] == {"count": 1, "from_kill": 0, "server_error": True, "example": None}
    served = [a for a in last.values() if a.error is None]
    greedy = _greedy(served, [_Reference("ab", 2), _Reference("xz", 2)])
    assert (greedy["compared"], greedy["mismatches"]) == (2, 1) and greedy["examples"][0]["prompt"] == 1


@pytest.mark.ray
def test_load_and_faults_on_two_replicas(ray_cluster, debug_target, tmp_path):
    options = LoadBenchOptions(drafter=str(_export(debug_target, tmp_path / "v1", seed=0)),
                               next_drafter=str(_export(debug_target, tmp_path / "v2", seed=1)),
                               clients=2, minutes=0.75, max_tokens=12, num_prompts=4, startup_timeout_s=300)
    result = bench_load(options, None, ["target.name=debug", "engine.max_len=1024", "engine.num_threads=1"])
    print(load_table(result))

    checks = result["checks"]
    assert checks["greedy_all_match_ar"], result["greedy"]  # every answer, whichever version drafted it
    assert result["greedy"]["compared"] == result["requests"]["served"] >= 8
    assert checks["failures_only_from_kill"] and checks["no_request_failed_after_retries"], result["failures"]
    assert checks["bad_version_rejected_by_every_live_replica"] and checks["bad_version_never_served"], result["replicas"]
    assert checks["new_version_served"] and checks["clients_finished"]
    # a stream cut by the kill is raised by the client (a dropped connection), so it can be retried;
    # Serve's proxy cannot send an error body for a replica that died mid-stream
    assert checks["failures_raised_by_the_client"], result["failures"]
    assert [e["what"] for e in result["events"]] == ["publish", "publish-bad", "kill"]
    assert [e.get("version") for e in result["events"]] == [2, 3, None]
    assert "specray-drafter-v1" in result["versions_seen"]
    killed = [r for r in result["replicas"].values() if r["killed"]]
    assert len(killed) == 1 and any(r["replacement"] for r in result["replicas"].values())
    assert "sha256" in next(r for r in result["replicas"].values() if not r["killed"])["rejected"]["3"]
    assert result["ttft_s"]["p50"] > 0 and result["ttft_s"]["p99"] >= result["ttft_s"]["p50"]
    assert result["tpot_s"]["n"] > 0
