"""``specray bench load``: two Serve replicas of the debug target under two streaming clients
while a new drafter, a corrupt export, an oversized export, an S3 outage and a replica kill
happen beside an online training stream; the report's invariants."""

import json
import uuid
from collections import Counter
from types import SimpleNamespace

import pytest
import torch

from specray.capture.contract import build_contract
from specray.drafters.dflash import DFlashDrafter, debug_config
from specray.drafters.format import InvalidDrafterError, save_drafter
from specray.pipeline.bench.load import (
    LoadBenchOptions,
    OVERSIZED_VALUE,
    _checks,
    _corrupt_copy,
    _failures,
    _greedy,
    _oversized_copy,
    _Reference,
    _replicas,
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
    with pytest.raises(ValueError, match="must come before oversized_at"):
        LoadBenchOptions(drafter=str(tmp_path), publish_at=0.3, oversized_at=0.2)
    with pytest.raises(ValueError, match="replicas"):
        LoadBenchOptions(drafter=str(tmp_path), replicas=1)
    with pytest.raises(ValueError, match="s3_outage_at"):
        LoadBenchOptions(drafter=str(tmp_path), s3_outage_at=1.0)
    with pytest.raises(ValueError, match="must end before the run does"):
        LoadBenchOptions(drafter=str(tmp_path), minutes=1, s3_outage_at=0.9, s3_outage_s=6)
    LoadBenchOptions(drafter=str(tmp_path), minutes=1, s3_outage_at=0.9, s3_outage_s=5.5)
    with pytest.raises(ValueError, match="without train_manifest"):
        LoadBenchOptions(drafter=str(tmp_path), train_overrides=["data.max_samples=8"])


def test_an_s3_outage_needs_an_s3_registry_with_an_endpoint(tmp_path, monkeypatch):
    (tmp_path / "config.json").write_text("{}")
    options = LoadBenchOptions(drafter=str(tmp_path), s3_outage_at=0.2)
    with pytest.raises(ValueError, match="needs an s3:// registry"):
        bench_load(options, None, ["target.name=debug"])
    monkeypatch.delenv("SPECRAY_S3_ENDPOINT", raising=False)
    with pytest.raises(ValueError, match="registry.endpoint_url=http://host:port"):
        bench_load(options, None, ["target.name=debug", "registry.uri=s3://bucket/drafters"])
    with pytest.raises(ValueError, match="must be an http://host:port S3 endpoint"):
        bench_load(options, None, ["target.name=debug", "registry.uri=s3://bucket/drafters",
                                   "registry.endpoint_url=https://s3.amazonaws.com"])


def test_the_training_stream_is_an_online_manifest_with_its_store_on_s3(tmp_path, monkeypatch):
    (tmp_path / "config.json").write_text("{}")
    monkeypatch.delenv("SPECRAY_S3_ENDPOINT", raising=False)  # set while the session's S3 server runs
    for manifest, overrides, error in (
            ("manifests/quickstart.yaml", [], "has mode: offline"),
            ("manifests/online.yaml", [], "store.uri=None is not on S3"),
            ("manifests/online.yaml", ["store.uri=s3://bucket/features"], "give store.endpoint_url")):
        options = LoadBenchOptions(drafter=str(tmp_path), train_manifest=manifest,
                                   train_overrides=["target.name=debug", *overrides])
        with pytest.raises(ValueError, match=error):
            bench_load(options, None, ["target.name=debug"])


def test_the_corrupt_copy_is_refused_at_load(debug_target, tmp_path):
    good = _export(debug_target, tmp_path / "good", seed=0)
    bad = _corrupt_copy(good, tmp_path / "bad")
    assert (bad / "model.safetensors").stat().st_size == (good / "model.safetensors").stat().st_size
    assert Engine(debug_target, str(good)).drafter is not None
    with pytest.raises(InvalidDrafterError, match="sha256"):
        Engine(debug_target, str(bad))


def test_the_oversized_copy_is_refused_at_the_bounds_check(debug_target, tmp_path, monkeypatch):
    good = _export(debug_target, tmp_path / "good", seed=0)
    oversized = _oversized_copy(good, tmp_path / "oversized")
    assert (oversized / "model.safetensors").read_bytes() == (good / "model.safetensors").read_bytes()
    assert json.loads((oversized / "config.json").read_text())["architecture"]["intermediate_size"] == OVERSIZED_VALUE

    def build(*args, **kwargs):
        raise AssertionError("the drafter was built: the export's claim was not checked first")

    monkeypatch.setattr(DFlashDrafter, "__init__", build)  # nothing that allocates may run
    with pytest.raises(InvalidDrafterError, match=f"architecture.intermediate_size = {OVERSIZED_VALUE} is outside"):
        Engine(debug_target, str(oversized))


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
    # the stream the kill cut dropped its connection: the only failure allowed to end without an answer
    assert failures["attempts_failed_without_server_error"] == 1
    assert failures["attempts_failed_without_server_error_not_from_kill"] == 0
    run.attempts.append(StreamAttempt(1, 2, 0, prompt=1, start_s=20.0, end_s=21.0, error="timeout"))
    assert _failures(run)[0]["attempts_failed_without_server_error_not_from_kill"] == 1
    served = [a for a in last.values() if a.error is None]
    greedy = _greedy(served, [_Reference("ab", 2), _Reference("xz", 2)])
    assert (greedy["compared"], greedy["mismatches"]) == (2, 1) and greedy["examples"][0]["prompt"] == 1


def test_replicas_a_rolling_update_stopped_are_retired_not_live():
    """backend vllm: a publish replaces the replicas; the ones stopped never see later versions,
    and the checks judge the replicas alive at the end."""
    t0 = 100.0
    seen = {"old": (0.0, 170.0, {1: 0.0}, {}), "new": (170.0, 367.0, {2: 170.0}, {3: "sha256", 4: "bad"}),
            "gone": (173.0, 270.0, {2: 173.0}, {3: "sha256", 4: "bad"})}
    monitor = SimpleNamespace(replicas={rid: {"first_seen": t0 + a, "last_seen": t0 + b, "active": max(since),
                                              "active_since": {v: t0 + t for v, t in since.items()},
                                              "rejected": rejected}
                                        for rid, (a, b, since, rejected) in seen.items()})
    run = SimpleNamespace(t0=t0, seconds=360.0, killed_replica="gone", settled_at_s=367.0, unfinished_clients=0,
                          events=[{"what": "publish", "version": 2, "at_s": 90.0},
                                  {"what": "publish-bad", "version": 3, "at_s": 180.0},
                                  {"what": "kill", "at_s": 270.0}], newest_good=2)
    replicas = _replicas(run, monitor)
    assert [(r["killed"], r["retired"]) for r in replicas.values()] == [(False, True), (False, False), (True, False)]
    failures = {"attempts_failed_not_from_kill": 0, "by_reason": {}, "requests_failed_after_retries": 0,
                "attempts_failed_without_server_error_not_from_kill": 0}
    checks = _checks(run, failures, {"compared": 1, "mismatches": 0}, Counter({"specray-drafter-v2": 1}), replicas,
                     None, None)
    assert checks["bad_version_rejected_by_every_live_replica"] and checks["live_replicas_on_newest_good_version"]
    replicas["old"]["retired"] = False  # counted live, it never saw v3
    assert not _checks(run, failures, {"compared": 1, "mismatches": 0}, Counter(), replicas, None, None)[
        "bad_version_rejected_by_every_live_replica"]


@pytest.mark.ray
@pytest.mark.s3
def test_load_and_faults_on_two_replicas(ray_cluster, seaweedfs, debug_target, tmp_path):
    # 60 s: S3 outage 0.6-10.6 s (the next version is published at 3 s, inside it), corrupt export at
    # 21 s, oversized export at 27 s, kill at 39 s; an online capture-and-train stream, its features on
    # S3 behind the outage too (the run starts at its first deletion: the outage falls in its training)
    prefix = f"load-bench-{uuid.uuid4().hex[:8]}"
    stream = ["target.name=debug", "data.max_samples=16", "data.max_length=256", "capture.max_batch_size=2",
              "capture.num_cpus_per_actor=0.5", "train.optim.warmup_steps=1", "train.checkpoint_every=2",
              "train.live_eval.num_prompts=2", "train.live_eval.max_tokens=8", "online.max_inflight_samples=6",
              f"store.uri={seaweedfs.uri(prefix + '/features')}", f"store.endpoint_url={seaweedfs.endpoint}"]
    options = LoadBenchOptions(drafter=str(_export(debug_target, tmp_path / "v1", seed=0)),
                               next_drafter=str(_export(debug_target, tmp_path / "v2", seed=1)),
                               clients=2, minutes=1.0, max_tokens=12, num_prompts=4, startup_timeout_s=300,
                               publish_at=0.05, bad_at=0.35, oversized_at=0.45, kill_at=0.65,
                               s3_outage_at=0.01, s3_outage_s=10.0, train_manifest="manifests/online.yaml",
                               train_overrides=stream, train_timeout_s=300)
    registry = seaweedfs.uri(f"{prefix}/drafters")
    result = bench_load(options, None, ["target.name=debug", "engine.max_len=1024", "engine.num_threads=1",
                                        "replica.num_cpus=0.5", f"registry.uri={registry}",
                                        f"registry.endpoint_url={seaweedfs.endpoint}"])
    print(load_table(result))

    checks = result["checks"]
    assert checks["greedy_all_match_ar"], result["greedy"]  # every answer, whichever version drafted it
    assert result["greedy"]["compared"] == result["requests"]["served"] >= 8
    assert checks["failures_only_from_kill"] and checks["no_request_failed_after_retries"], result["failures"]
    assert checks["bad_version_rejected_by_every_live_replica"] and checks["bad_version_never_served"], result["replicas"]
    assert checks["oversized_version_rejected_by_every_live_replica"], result["replicas"]
    assert checks["oversized_version_never_served"] and checks["new_version_served"] and checks["clients_finished"]
    # a stream cut by the kill is raised by the client (a dropped connection), so it can be retried;
    # Serve's proxy cannot send an error body for a replica that died mid-stream
    assert checks["failures_raised_by_the_client"] and checks["failures_answered_with_an_error"], result["failures"]
    assert [e["what"] for e in result["events"]] == ["s3-outage", "publish", "publish-bad", "publish-oversized", "kill"]
    assert [e.get("version") for e in result["events"]] == [None, 2, 3, 4, None]
    assert "specray-drafter-v1" in result["versions_seen"]
    killed = [r for r in result["replicas"].values() if r["killed"]]
    assert len(killed) == 1 and any(r["replacement"] for r in result["replicas"].values())
    live = [r for r in result["replicas"].values() if not r["killed"]]
    assert "sha256" in live[0]["rejected"]["3"] and "intermediate_size" in live[0]["rejected"]["4"]
    assert result["newest_good_version"] == 2 and all(r["active_version"] == 2 for r in live)
    assert checks["live_replicas_on_newest_good_version"] and result["settled_at_s"] >= result["seconds"]
    # the replicas polled S3 through one proxy, the training stream its store through another: both
    # were refused during the outage only, and the stream lost and duplicated no sample
    s3, training = result["s3"], result["training"]
    assert s3["outage"] == {"start_s": result["events"][0]["at_s"], "end_s": result["events"][0]["at_s"] + 10.0}
    assert set(s3["proxies"]) == {"registry", "store"}
    for counts in s3["proxies"].values():
        assert counts["refused"] > 0 and counts["forwarded"] > 0 and counts["upstream_errors"] == 0, s3
    assert checks["s3_outage_refused_registry_requests"] and checks["s3_outage_refused_store_requests"]
    assert training["error"] is None and checks["training_samples_exactly_once"], training
    assert training["audit"] == {"ok": True, "trained": training["capture"]["samples"], "duplicates": 0,
                                 "missing": 0, "leftover_features": 0}
    assert training["start_s"] < 0 < training["end_s"], training  # it ran into the run, and its outage
    # v2 was published inside the outage: no replica served it before the outage ended
    assert min(float(r["active_since_s"]["2"]) for r in live if "2" in r["active_since_s"]) >= s3["outage"]["end_s"] - 1
    assert result["ttft_s"]["p50"] > 0 and result["ttft_s"]["p99"] >= result["ttft_s"]["p50"]
    assert result["tpot_s"]["n"] > 0
