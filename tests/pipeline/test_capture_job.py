import json

import pytest

from specray.capture.store import FeatureStore, read_manifest
from specray.pipeline.cli import main


def _capture(tmp_path, *overrides, name="job"):
    return main([
        "capture", "-q", "-c", "manifests/capture-quickstart.yaml", f"name={name}", "target.name=debug",
        "data.max_samples=6", "data.max_length=256", f"output.run_dir={tmp_path / name}", "output.overwrite=false",
        *overrides,
    ])


def test_capture_cli_end_to_end(tmp_path, capsys):
    assert _capture(tmp_path) == 0
    out = capsys.readouterr().out
    for field in ("samples", "tokens", "bytes/token", "tokens/s", "store", "manifest"):
        assert field in out
    run = tmp_path / "job"
    summary = json.loads((run / "capture.json").read_text())
    manifest = read_manifest(str(run / "manifest.parquet"))
    assert summary["samples"] == len(manifest.refs) > 0
    assert summary["tokens"] == manifest.num_tokens
    assert manifest.contract.algorithm == "dflash" and manifest.contract.layer_ids == (1, 2, 3, 4, 5)
    assert manifest.metadata["dataset"] == "sharegpt"
    assert summary["min_bytes_per_token"] == 5 * 64 * 2 + 4 + 1
    assert summary["min_bytes_per_token"] <= summary["bytes_per_token"] < summary["min_bytes_per_token"] + 10
    store = FeatureStore(manifest.store_uri)
    for ref in manifest.refs:
        assert store.get(ref)["input_ids"].numel() == ref.num_tokens
    assert main(["inspect", str(run / "manifest.parquet"), "--verify"]) == 0
    assert "verified" in capsys.readouterr().out


def test_rerun_needs_overwrite_and_overwrite_drops_stale_blobs(tmp_path, capsys):
    assert _capture(tmp_path, "data.max_samples=6") == 0
    run = tmp_path / "job"
    old = read_manifest(str(run / "manifest.parquet"))
    assert _capture(tmp_path) == 2
    assert "manifests are immutable" in capsys.readouterr().err
    assert _capture(tmp_path, "data.max_samples=3", "output.overwrite=true") == 0
    new = read_manifest(str(run / "manifest.parquet"))
    store = FeatureStore(new.store_uri)
    assert {r.key for r in new.refs} < {r.key for r in old.refs}
    assert all(store.exists(r.key) for r in new.refs)
    assert not any(store.exists(r.key) for r in old.refs if r.key not in {n.key for n in new.refs})


def test_corrupt_blob_fails_verify_naming_the_key(tmp_path, capsys):
    assert _capture(tmp_path) == 0
    manifest = read_manifest(str(tmp_path / "job" / "manifest.parquet"))
    store = FeatureStore(manifest.store_uri)
    ref = manifest.refs[0]
    data = bytearray(store.get_bytes(ref.key))
    data[-1] ^= 1
    store.put_bytes(ref.key, bytes(data))
    store.delete(manifest.refs[1].key)
    assert main(["inspect", str(tmp_path / "job" / "manifest.parquet"), "--verify"]) == 1
    err = capsys.readouterr().err
    assert f"{ref.key!r}" in err and "corrupt or truncated" in err
    assert f"no feature blob at key {manifest.refs[1].key!r}" in err
    assert f"2 of {len(manifest.refs)} blobs missing or corrupt" in err


def test_layer_id_out_of_range_is_a_clear_error(tmp_path, capsys):
    assert _capture(tmp_path, "capture.layer_ids=[1, 8]") == 2
    assert "capture.layer_ids [8] out of range: the target has 8 decoder layers" in capsys.readouterr().err


@pytest.mark.s3
def test_capture_into_s3(tmp_path, seaweedfs, capsys):
    uri = seaweedfs.uri("capture-job")
    assert _capture(tmp_path, f"store.uri={uri}", f"store.endpoint_url={seaweedfs.endpoint}") == 0
    manifest = read_manifest(str(tmp_path / "job" / "manifest.parquet"))
    assert manifest.store_uri == uri
    store = FeatureStore(uri, endpoint_url=seaweedfs.endpoint)
    assert all(store.get(ref)["hidden_states"].shape[0] == ref.num_tokens for ref in manifest.refs)


def test_bench_capture_writes_json_and_prints_table(tmp_path, capsys):
    path = tmp_path / "bench.json"
    assert main(["bench", "capture", "--json", str(path), "--repeats", "1", "target.name=debug", "data.max_samples=4"]) == 0
    result = json.loads(path.read_text())
    for key in ("capture_tokens_per_s", "forward_tokens_per_s", "ratio", "bytes_per_token", "min_bytes_per_token"):
        assert result[key] > 0
    assert result["ratio"] == pytest.approx(result["capture_tokens_per_s"] / result["forward_tokens_per_s"])
    assert result["command"].startswith("specray bench capture")
    assert "capture" in capsys.readouterr().out


def test_ids_that_differ_only_in_unsafe_characters_are_both_captured_and_readable(tmp_path):
    """``conv/1`` and ``conv_1`` sanitise to one readable name; their keys still differ, so neither blob
    replaces the other."""
    chats = tmp_path / "chats.jsonl"
    rows = [("conv/1", "first answer"), ("conv_1", "another, longer answer"), ("conv 1", "third")]
    chats.write_text("".join(json.dumps({"id": sid, "messages": [{"role": "user", "content": "q"},
                                                                {"role": "assistant", "content": a}]}) + "\n"
                             for sid, a in rows))
    assert _capture(tmp_path, f"data.dataset=jsonl:{chats}", "data.max_samples=null") == 0
    manifest = read_manifest(str(tmp_path / "job" / "manifest.parquet"))
    assert sorted(r.sample_id for r in manifest.refs) == sorted(sid for sid, _ in rows)
    assert len({r.key for r in manifest.refs}) == 3
    store = FeatureStore(manifest.store_uri)
    lengths = {r.sample_id: store.get(r)["input_ids"].numel() for r in manifest.refs}  # checksums hold: no overwrite
    assert lengths["conv_1"] > lengths["conv/1"] > lengths["conv 1"]


def test_a_repeated_id_stops_capture_before_anything_is_written(tmp_path, capsys):
    chats = tmp_path / "chats.jsonl"
    line = json.dumps({"id": "dup", "messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]})
    chats.write_text(line + "\n" + line + "\n")
    assert _capture(tmp_path, f"data.dataset=jsonl:{chats}") == 2
    assert "repeats sample ids (1 ids: 'dup' at" in capsys.readouterr().err
    assert not (tmp_path / "job" / "manifest.parquet").exists() and not (tmp_path / "job" / "features").exists()


def test_chat_template_and_kwargs_are_recorded_and_the_trainer_renders_with_them(tmp_path):
    """The manifest records the template capture rendered with; training on it loads the target with that
    template (else the contract's template fingerprint would not match) and exports it in the provenance."""
    from pathlib import Path

    from specray.pipeline.config import TrainJobConfig, load_config
    from specray.pipeline.jobs.train import build_trainer

    template = Path(__file__).parents[1] / "capture" / "templates" / "qwen3.jinja"
    assert _capture(tmp_path, f"data.chat_template={template}", "data.chat_template_kwargs.enable_thinking=false",
                    "data.max_samples=4", "capture.algorithm=dflash") == 0
    manifest = read_manifest(str(tmp_path / "job" / "manifest.parquet"))
    recorded = manifest.chat_template
    assert recorded.startswith("{%- set enable_thinking = false -%}") and recorded.endswith(template.read_text())
    assert manifest.metadata["chat_template_kwargs"] == {"enable_thinking": False}
    cfg = load_config(TrainJobConfig, "manifests/train-dflash-quickstart.yaml", [
        "target.name=debug", f"data.manifest={tmp_path / 'job' / 'manifest.parquet'}", f"output.run_dir={tmp_path / 'run'}",
        "optim.total_steps=1", "optim.warmup_steps=0", "trainer.checkpoint_every=1", "objective.num_anchors=2",
        "live_eval.enabled=false",
    ])
    trainer = build_trainer(cfg)
    assert trainer.extra["provenance"]["chat_template"] == recorded
    assert trainer.extra["contract"]["template_fingerprint"] == manifest.contract.template_fingerprint
