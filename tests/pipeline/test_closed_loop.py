"""The closed loop (``mode: closed_loop``, pipeline/jobs/closed_loop.py) on the debug target.

- Configs: an iteration is a valid online pipeline from the current drafter on its snapshot;
  the loop refuses to run without serving or with autoscaled replicas.
- Live tau per version adds up rounds over the replicas.
- On the shared Ray cluster: two Serve replicas recording greedy HumanEval traffic from the
  load generator; two iterations each snapshot new shards, train online from the previous
  version, publish, and both replicas hot-load the new version; the audit is clean and no
  request fails.
"""

import json
from pathlib import Path

import pytest
import torch

from specray.capture.contract import build_contract
from specray.drafters.dflash import DFlashDrafter
from specray.drafters.format import save_drafter
from specray.pipeline.jobs.closed_loop import _versions, derived_config
from specray.pipeline.config import ConfigError, PipelineConfig, load_config


def _export(target, section, out) -> str:
    """An untrained DFlash drafter of the manifest's ``train.drafter`` section on the debug target,
    exported like a trained one (the chat drafter the loop starts from)."""
    contract = build_contract("dflash", target_fingerprint=target.target_fingerprint,
                              template_fingerprint=target.template_fingerprint, num_target_layers=target.num_layers,
                              hidden_size=target.hidden_size)
    torch.manual_seed(0)
    model = DFlashDrafter(section.drafter_config(target, contract.layer_ids),
                          embed_tokens=target.model.model.embed_tokens, lm_head=target.model.lm_head)
    return str(save_drafter(out, model, contract=json.loads(contract.to_json()), provenance={"run": "random"}))


TINY = [
    "target.name=debug", "data.max_length=1024", "capture.max_batch_size=2", "capture.num_cpus_per_actor=0.5",
    "train.drafter.num_layers=1", "train.drafter.block_size=4", "train.drafter.draft_vocab_size=null",
    "train.optim.warmup_steps=1", "train.optim.micro_batch_size=2", "train.checkpoint_every=2",
    "train.live_eval.enabled=false",  # the replicas measure each version's live tau on the served traffic
    "online.max_inflight_samples=8", "serve.engine.max_len=1024", "serve.engine.num_threads=1",
    "serve.engine.speculation=static", "serve.replica.num_cpus=0.5", "serve.autoscaling.min_replicas=2",
    "serve.autoscaling.max_replicas=2", "serve.record.flush_interval_s=1", "serve.record.records_per_shard=2",
    "closed_loop.iterations=2", "closed_loop.records_per_iteration=4", "closed_loop.records_timeout_s=300",
    "closed_loop.hot_load_timeout_s=300", "closed_loop.load.num_prompts=8", "closed_loop.load.clients=2",
    "closed_loop.load.max_tokens=8", "closed_loop.load.pause_s=0.5",
]


def test_an_iteration_is_an_online_pipeline_from_the_current_drafter(tmp_path):
    cfg = load_config(PipelineConfig, "manifests/closed-loop.yaml", [*TINY, f"output.run_dir={tmp_path}",
                                                                      "online.ledger=/ledgers"])
    sub = derived_config(cfg, name="loop-0002", mode="online", run_dir=tmp_path / "iterations" / "0002",
                         dataset=f"jsonl:{tmp_path}/0002.jsonl", init_from="/exports/v2")
    assert (sub.mode, sub.data.dataset, sub.data.max_samples) == ("online", f"jsonl:{tmp_path}/0002.jsonl", None)
    assert sub.train.drafter.init_from == "/exports/v2" and sub.train.drafter.num_layers == 1
    assert not sub.serve.enabled and not sub.bench.enabled
    assert sub.online.ledger == "/ledgers/loop-0002"  # each iteration's stream has its own ledger
    assert sub.run_dir == tmp_path / "iterations" / "0002"


def test_an_export_of_another_architecture_is_refused_before_serving(debug_target, tmp_path):
    from specray.pipeline.jobs.closed_loop import check_starts_from

    section = load_config(PipelineConfig, "manifests/closed-loop.yaml", TINY).train.drafter
    export = _export(debug_target, section, tmp_path / "export")
    check_starts_from(section, export)
    with pytest.raises(ValueError, match=r"block_size: section 8, export 4.*train.drafter.block_size=4"):
        check_starts_from(section.model_copy(update={"block_size": 8}), export)


def test_a_peer_drafter_directory_starts_the_loop_as_its_import(debug_target, tmp_path):
    from specray.drafters.peer import write_peer_export
    from specray.pipeline.jobs.closed_loop import _imported, check_starts_from
    from specray.serving.registry import DrafterRegistry

    cfg = load_config(PipelineConfig, "manifests/closed-loop.yaml", [*TINY, f"output.run_dir={tmp_path}"])
    export = _export(debug_target, cfg.train.drafter, tmp_path / "export")
    peer = write_peer_export(export, tmp_path / "speculators", target=debug_target)  # what vLLM would serve
    imported = _imported(cfg, str(peer))
    assert imported != str(peer) and json.loads((Path(imported) / "export.json").read_text())["imported_format"] == \
        "speculators"
    assert json.loads((Path(imported) / "config.json").read_text())["capture_contract"]["dtype"] == cfg.capture.dtype
    check_starts_from(cfg.train.drafter, imported)
    assert DrafterRegistry(str(tmp_path / "registry")).publish(imported) == 1
    assert _imported(cfg, export) == export  # an export is published as it is


def test_the_loop_needs_serving_and_a_fixed_number_of_replicas():
    with pytest.raises(ConfigError, match="serve.enabled=true"):
        load_config(PipelineConfig, "manifests/closed-loop.yaml", ["serve.enabled=false"])
    with pytest.raises(ConfigError, match="max_replicas=1"):
        load_config(PipelineConfig, "manifests/closed-loop.yaml",
                    ["serve.autoscaling.min_replicas=1", "serve.autoscaling.max_replicas=2"])
    with pytest.raises(ConfigError, match="online.max_inflight_samples"):  # iterations train online
        load_config(PipelineConfig, "manifests/closed-loop.yaml", ["online.max_inflight_samples=1"])


def test_live_tau_per_version_is_weighted_by_rounds_over_the_replicas():
    class Load:
        def served_by(self, fingerprint):
            return {"specray-drafter-v1": 5, "specray-drafter-v2": 3}.get(fingerprint, 0)

    replicas = {
        "a": {"versions": [{"version": 1, "rounds": 10, "tau": 1.5, "acceptance_by_position": [0.5, 0.0]},
                           {"version": 2, "rounds": 0, "tau": None, "acceptance_by_position": []}]},
        "b": {"versions": [{"version": 1, "rounds": 30, "tau": 1.1, "acceptance_by_position": [0.1]},
                           {"version": 2, "rounds": 4, "tau": 2.0, "acceptance_by_position": [1.0, 0.0, 0.0]}]},
    }
    versions = _versions(replicas, Load())
    assert list(versions) == ["v1", "v2"]
    assert versions["v1"]["tau"] == pytest.approx((15 + 33) / 40) and versions["v1"]["rounds"] == 40
    assert versions["v1"]["acceptance_by_position"] == [pytest.approx(0.2), 0.0]
    assert versions["v1"]["requests"] == 5
    assert versions["v2"] == {"tau": 2.0, "rounds": 4, "acceptance_by_position": [1.0, 0.0, 0.0], "requests": 3}


def _shard(store, replica: str, name: str, ids: list[str], cut: tuple[str, ...] = ()) -> str:
    """A record shard as a replica writes it: ``<uri>/<replica>/<unix_ms>-<seq>-<token>.jsonl``
    (the answers of ``cut`` stopped at max_tokens)."""
    from specray.serving.recorder import chat_record

    fields = dict(created=0, model="debug", drafter_version=1, temperature=0.0, top_p=1.0, max_tokens=8,
                  prompt_tokens=3, completion_tokens=2)
    lines = [json.dumps(chat_record([{"role": "user", "content": f"q {i}"}], f"a {i}", id=i, **fields,
                                    finish_reason="length" if i in cut else "stop")) for i in ids]
    path = store / replica / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(line + "\n" for line in lines))
    return str(path)


def test_an_iteration_takes_the_oldest_untaken_shards_and_the_state_keeps_them(tmp_path):
    """Shards another iteration took (the state file, which --resume reads) are never taken again;
    the oldest others are taken whole until they hold records_per_iteration records."""
    from specray.pipeline.jobs.closed_loop import _Loop, _LoopState
    from specray.serving.recorder import RecordSettings

    store = tmp_path / "records"
    old = _shard(store, "r1", "0000000000001-000000-aaaa.jsonl", ["c1", "c2"])
    a = _shard(store, "r2", "0000000000002-000000-bbbb.jsonl", ["c3"])
    b = _shard(store, "r1", "0000000000003-000001-aaaa.jsonl", ["c4", "c5"], cut=("c5",))
    c = _shard(store, "r2", "0000000000004-000001-bbbb.jsonl", ["c6"])
    cfg = load_config(PipelineConfig, "manifests/closed-loop.yaml", [*TINY, f"output.run_dir={tmp_path / 'loop'}",
                                                                      "closed_loop.records_per_iteration=3"])
    (tmp_path / "loop").mkdir()
    state = _LoopState(tmp_path / "loop" / "closed-loop.json")
    state.update(initial={"export": "/v1", "version": 1},
                 iterations=[{"iteration": 1, "shards": [old], "records": 2, "snapshot": "x", "export": "/v2",
                              "version": 2}])
    load = type("Load", (), {"check": lambda self: None, "summary": lambda self: {}})()
    loop = _Loop(cfg, RecordSettings(uri=str(store)), None, _LoopState(state.path), None, load, False)
    entry = loop.snapshot(2)
    assert entry["shards"] == [a, b] and entry["records"] == 3  # not `old` (taken), not `c` (enough without it)
    rows = [json.loads(line) for line in Path(entry["snapshot"]).read_text().splitlines()]
    assert [r["id"] for r in rows] == ["c3", "c4", "c5"]
    assert rows[0]["messages"] == [{"role": "user", "content": "q c3"}, {"role": "assistant", "content": "a c3"}]
    from specray.capture.data import load_conversations  # an answer cut at max_tokens stays cut in the snapshot

    assert [c.cut for c in load_conversations(f"jsonl:{entry['snapshot']}")] == [False, False, True]
    resumed = _LoopState(state.path)  # what --resume reads: iteration 2 took a and b, its version is pending
    assert resumed.taken == {old, a, b} and resumed.current_export == "/v2"
    assert [it.get("version") for it in resumed.get("iterations")] == [2, None]


@pytest.mark.ray
def test_two_iterations_publish_two_versions_that_every_replica_hot_loads(ray_cluster, debug_target, tmp_path):
    from ports import free_port
    from specray.pipeline.jobs import run_manifest
    from specray.serving.registry import DrafterRegistry

    overrides = [*TINY, f"output.run_dir={tmp_path / 'loop'}", f"serve.http.port={free_port()}"]
    section = load_config(PipelineConfig, "manifests/closed-loop.yaml", overrides).train.drafter
    initial = _export(debug_target, section, tmp_path / "chat-drafter")
    cfg = load_config(PipelineConfig, "manifests/closed-loop.yaml", [*overrides, f"train.drafter.init_from={initial}"])
    report, handle = run_manifest(cfg, progress=False)
    print(report.table())
    assert handle is None

    assert report.initial["version"] == 1 and report.initial["export"] == initial
    assert [it["version"] for it in report.iterations] == [2, 3]
    assert DrafterRegistry(str(tmp_path / "loop" / "registry")).versions() == [1, 2, 3]
    first, second = report.iterations
    assert first["init_from"] == initial and second["init_from"] == first["export"]  # each from the current drafter
    assert not set(first["shards"]) & set(second["shards"])  # no shard is trained twice
    for it in report.iterations:
        assert it["audit"] == {"ok": True, "trained": it["records"], "duplicates": 0, "missing": 0,
                               "leftover_features": 0}
        assert it["records"] >= 4 and it["train"]["steps"] == -(-it["records"] // 2)
        assert it["failed_requests"] == 0 and it["failed_during_hot_load"] == 0
    assert report.requests["failed"] == 0 and report.requests["failed_during_hot_load"] == 0
    assert report.requests["served"] >= 12
    # every version served traffic on the replicas (both of which hot-loaded v2 and v3) and has a live tau
    assert set(report.versions) == {"v1", "v2", "v3"}
    for version in report.versions.values():
        assert version["requests"] > 0 and version["rounds"] > 0 and version["tau"] >= 1.0
    assert report.versions["v3"]["requests"] >= 4  # the newest version serves records_per_iteration requests
    state = json.loads((tmp_path / "loop" / "closed-loop.json").read_text())
    assert [(it["iteration"], it["version"]) for it in state["iterations"]] == [(1, 2), (2, 3)]
    saved = json.loads((tmp_path / "loop" / "report.json").read_text())
    assert saved["mode"] == "closed_loop" and len(saved["iterations"]) == 2
