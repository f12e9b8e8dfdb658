import uuid

import pytest
import torch

from specray.capture.contract import build_contract
from specray.capture.store import (
    FeatureChecksumError,
    FeatureNotFoundError,
    FeatureStore,
    read_manifest,
    write_manifest,
)

CONTRACT = build_contract(
    "eagle3", target_fingerprint="sha256:t", template_fingerprint="sha256:c", num_target_layers=8, hidden_size=4,
)


@pytest.fixture(params=["file", pytest.param("s3", marks=pytest.mark.s3)])
def store(request, tmp_path):
    if request.param == "file":
        return FeatureStore((tmp_path / "store").as_uri())
    server = request.getfixturevalue("seaweedfs")
    return FeatureStore(server.uri(f"features-{uuid.uuid4().hex[:8]}"), endpoint_url=server.endpoint)


def _tensors(T=5):
    g = torch.Generator().manual_seed(T)
    return {
        "input_ids": torch.arange(T, dtype=torch.int32),
        "loss_mask": torch.arange(T) % 2 == 0,
        "hidden_states": torch.randn(T, 12, generator=g).to(torch.bfloat16),
        "last_hidden_states": torch.randn(T, 4, generator=g).to(torch.bfloat16),
    }


def _put(store, key="a/s0.safetensors", T=5):
    return store.put(key, _tensors(T), sample_id=key, num_tokens=T, contract=CONTRACT.contract_id)


def test_round_trip(store):
    ref = _put(store)
    assert store.exists(ref.key)
    got = store.get(ref)
    for name, tensor in _tensors().items():
        assert got[name].dtype == tensor.dtype and torch.equal(got[name], tensor)
    assert ref.tensor("hidden_states").shape == (5, 12) and ref.tensor("hidden_states").dtype == "bfloat16"
    assert ref.num_bytes == len(store.get_bytes(ref.key))


def test_delete_is_idempotent_and_missing_key_is_named(store):
    ref = _put(store)
    store.delete(ref.key)
    store.delete(ref.key)
    assert not store.exists(ref.key)
    with pytest.raises(FeatureNotFoundError, match="a/s0.safetensors"):
        store.get(ref)


@pytest.mark.parametrize("damage", ["flip", "truncate"])
def test_corrupt_or_truncated_blob_is_detected(store, damage):
    ref = _put(store)
    data = bytearray(store.get_bytes(ref.key))
    if damage == "flip":
        data[-3] ^= 0xFF  # inside the tensor payload: safetensors alone would not notice
    else:
        data = data[:-7]
    store.put_bytes(ref.key, bytes(data))
    with pytest.raises(FeatureChecksumError, match=r"'a/s0.safetensors'.*corrupt or truncated"):
        store.get(ref)


def test_manifest_round_trip(store, tmp_path):
    refs = [_put(store, f"a/s{i}.safetensors", T=3 + i) for i in range(4)]
    # the manifest lives on the same backend as the features (a local file or an S3 object)
    uri = str(tmp_path / "run" / "manifest.parquet") if store.protocol == "file" else f"{store.uri}/manifest.parquet"
    write_manifest(uri, refs, contract=CONTRACT, store_uri=store.uri, metadata={"dataset": "unit"},
                   endpoint_url=store.endpoint_url)
    manifest = read_manifest(uri, endpoint_url=store.endpoint_url)
    assert manifest.refs == refs
    assert manifest.contract == CONTRACT
    assert manifest.store_uri == store.uri and manifest.metadata == {"dataset": "unit"}
    assert manifest.num_tokens == 3 + 4 + 5 + 6
    with pytest.raises(FileExistsError, match="immutable"):
        write_manifest(uri, refs, contract=CONTRACT, store_uri=store.uri, endpoint_url=store.endpoint_url)
    write_manifest(uri, refs[:1], contract=CONTRACT, store_uri=store.uri, overwrite=True, endpoint_url=store.endpoint_url)
    assert len(read_manifest(uri, endpoint_url=store.endpoint_url).refs) == 1


def test_manifest_checks(tmp_path):
    import pyarrow.parquet as pq

    store = FeatureStore(tmp_path.as_uri())
    ref = _put(store)
    other = build_contract("dflash", target_fingerprint="sha256:t", template_fingerprint="sha256:c",
                           num_target_layers=8, hidden_size=4)
    with pytest.raises(ValueError, match="cannot go in a manifest"):
        write_manifest(str(tmp_path / "m.parquet"), [ref], contract=other, store_uri=store.uri)
    uri = str(tmp_path / "m.parquet")
    write_manifest(uri, [ref], contract=CONTRACT, store_uri=store.uri)
    table = pq.read_table(uri)
    meta = dict(table.schema.metadata)
    meta[b"specray.schema_version"] = b"99"
    pq.write_table(table.replace_schema_metadata(meta), uri)
    with pytest.raises(ValueError, match="schema version '99'"):
        read_manifest(uri)
    with pytest.raises(FileNotFoundError, match="no manifest"):
        read_manifest(str(tmp_path / "none.parquet"))


def test_bad_uris_and_keys(tmp_path):
    with pytest.raises(ValueError, match="file:// and s3://"):
        FeatureStore("gs://bucket/x")
    store = FeatureStore(str(tmp_path))  # a plain path means file://
    with pytest.raises(ValueError, match="invalid store key"):
        store.put_bytes("../escape", b"x")


def test_merge_manifests_of_one_store_and_contract(tmp_path, capsys):
    from specray.capture.store import merge_manifests
    from specray.pipeline.cli import main

    store = FeatureStore((tmp_path / "store").as_uri())
    a_refs = [_put(store, "part1/s0.safetensors", 5), _put(store, "part1/s1.safetensors", 6)]
    b_refs = [_put(store, "part2/s2.safetensors", 7), a_refs[1]]  # s1 again: the same blob, kept once
    a = write_manifest(str(tmp_path / "a.parquet"), a_refs, contract=CONTRACT, store_uri=store.uri)
    b = write_manifest(str(tmp_path / "b.parquet"), b_refs, contract=CONTRACT, store_uri=store.uri)
    merged = merge_manifests([a, b], str(tmp_path / "ab.parquet"))
    assert [r.sample_id for r in merged.refs] == ["part1/s0.safetensors", "part1/s1.safetensors",
                                                   "part2/s2.safetensors"]
    assert merged.num_tokens == 18 and merged.metadata == {"merged_from": [a, b]}
    assert all(store.get(r)["input_ids"].shape[0] == r.num_tokens for r in merged.refs)

    other_store = FeatureStore((tmp_path / "other").as_uri())
    c = write_manifest(str(tmp_path / "c.parquet"), [_put(other_store, "part3/s3.safetensors")], contract=CONTRACT,
                       store_uri=other_store.uri)
    with pytest.raises(ValueError, match="a manifest names one store"):
        merge_manifests([a, c], str(tmp_path / "ac.parquet"))
    dflash = build_contract("dflash", target_fingerprint="sha256:t", template_fingerprint="sha256:c",
                            num_target_layers=8, hidden_size=4)
    ref = store.put("part4/s4.safetensors", _tensors(3), sample_id="part4/s4.safetensors", num_tokens=3,
                    contract=dflash.contract_id)
    d = write_manifest(str(tmp_path / "d.parquet"), [ref], contract=dflash, store_uri=store.uri)
    with pytest.raises(ValueError, match="only features of one contract train one drafter"):
        merge_manifests([a, d], str(tmp_path / "ad.parquet"))
    clash = store.put("part5/s0.safetensors", _tensors(4), sample_id="part1/s0.safetensors", num_tokens=4,
                      contract=CONTRACT.contract_id)
    e = write_manifest(str(tmp_path / "e.parquet"), [clash], contract=CONTRACT, store_uri=store.uri)
    with pytest.raises(ValueError, match="sample 'part1/s0.safetensors' of .* differs from an earlier one"):
        merge_manifests([a, e], str(tmp_path / "ae.parquet"))
    assert not (tmp_path / "ae.parquet").exists()  # nothing written on error
    assert main(["merge-manifests", a, b, "--out", str(tmp_path / "cli.parquet")]) == 0
    assert "3 samples, 18 tokens from 2 manifests" in capsys.readouterr().out
    assert main(["merge-manifests", a, b, "--out", str(tmp_path / "cli.parquet")]) == 2  # immutable
    assert "immutable" in capsys.readouterr().err


def test_a_write_interrupted_before_its_rename_leaves_nothing_once_the_key_is_deleted(tmp_path, monkeypatch):
    import os

    import specray.capture.store as store_module

    store = FeatureStore((tmp_path / "store").as_uri())

    def crash(src, dst):  # the process dies between the temp file and the rename
        raise KeyboardInterrupt

    monkeypatch.setattr(store_module.os, "replace", crash)
    with pytest.raises(KeyboardInterrupt):
        _put(store)
    monkeypatch.undo()
    leftovers = sorted(p.name for p in (tmp_path / "store" / "a").iterdir())
    assert len(leftovers) == 1 and leftovers[0].startswith("s0.safetensors.tmp-")
    assert not store.exists("a/s0.safetensors")  # readers never see the partial write

    ref = _put(store)  # captured again (the batch was re-sent), trained, then deleted
    _put(store, "a/s0.safetensors.other")  # another key sharing the prefix is not a temp file of it
    store.delete(ref.key)
    assert sorted(os.listdir(tmp_path / "store" / "a")) == ["s0.safetensors.other"]


def test_feature_data_is_fsynced_before_the_rename_and_the_directory_after(tmp_path, monkeypatch):
    import os

    import specray.capture.store as store_module

    store = FeatureStore((tmp_path / "store").as_uri())
    calls = []
    fsync, replace = os.fsync, os.replace

    def recorded_fsync(fd):
        calls.append(("fsync", os.path.isdir(f"/proc/self/fd/{fd}")))
        fsync(fd)

    def recorded_replace(src, dst):
        calls.append(("replace", dst.endswith("s0.safetensors")))
        replace(src, dst)

    monkeypatch.setattr(store_module.os, "fsync", recorded_fsync)
    monkeypatch.setattr(store_module.os, "replace", recorded_replace)
    _put(store)
    assert calls == [("fsync", False), ("replace", True), ("fsync", True)]  # data, rename, directory


def test_distinct_sample_ids_get_distinct_keys():
    from specray.capture.store import feature_key

    ids = ["conv/1", "conv_1", "conv 1", "conv\\1", "Conv_1", "é", "_", "x" * 200, "x" * 200 + "y"]
    keys = [feature_key("c0ffee", sid) for sid in ids]
    assert len(set(keys)) == len(ids)
    assert keys[0].startswith("features/c0ffee/conv_1-") and keys[1].startswith("features/c0ffee/conv_1-")
    assert feature_key("c0ffee", "conv/1") == keys[0]  # deterministic: a re-capture lands on the same key
    assert all(len(k.rsplit("/", 1)[1]) < 255 for k in keys)  # a file name on every filesystem
    with pytest.raises(ValueError, match="non-empty string"):
        feature_key("c0ffee", "")


@pytest.mark.parametrize("tensors, message", [
    ({"input_ids": [1, 2, 3]}, r"tensors\['input_ids'\] must be a torch.Tensor, got list"),
    ({"hidden_states": torch.zeros(2, 2, dtype=torch.float64)}, r"tensors\['hidden_states'\] has dtype torch.float64"),
    ({"x": torch.zeros(2, dtype=torch.complex64)}, r"tensors\['x'\] has dtype torch.complex64"),
    ({}, "non-empty dict"),
])
def test_put_refuses_bad_tensors_before_writing(tmp_path, tensors, message):
    root = tmp_path / "store"
    store = FeatureStore(root.as_uri())
    with pytest.raises(TypeError, match=message):
        store.put("a/s0.safetensors", tensors, sample_id="s0", num_tokens=3, contract=CONTRACT.contract_id)
    assert not any(p.is_file() for p in root.rglob("*"))  # no blob, no temp file


def test_delete_does_not_list_the_directory(tmp_path, monkeypatch):
    """A file:// delete is two unlinks by name: its cost does not grow with the blobs beside it."""
    import os

    import specray.capture.store as store_module

    store = FeatureStore((tmp_path / "store").as_uri())
    refs = [_put(store, f"a/s{i}.safetensors") for i in range(20)]

    def crash(src, dst):
        raise KeyboardInterrupt

    monkeypatch.setattr(store_module.os, "replace", crash)
    with pytest.raises(KeyboardInterrupt):
        _put(store, "a/dead.safetensors")  # a writer killed before its rename
    monkeypatch.undo()

    def no_listing(*args, **kwargs):
        raise AssertionError("delete listed a directory")

    for name in ("listdir", "scandir", "walk"):
        monkeypatch.setattr(store_module.os, name, no_listing)
    monkeypatch.setattr(store.fs, "ls", no_listing)
    monkeypatch.setattr(store.fs, "glob", no_listing)
    store.delete("a/dead.safetensors")
    for ref in refs[:10]:
        store.delete(ref.key)
    monkeypatch.undo()
    assert sorted(os.listdir(tmp_path / "store" / "a")) == sorted(f"s{i}.safetensors" for i in range(10, 20))


def test_concurrent_writes_of_one_key_never_publish_a_torn_blob(tmp_path):
    """Writers of the same key share its temp file under a lock: each rename publishes one whole write."""
    from concurrent.futures import ThreadPoolExecutor

    store = FeatureStore((tmp_path / "store").as_uri())
    payloads = [bytes([i]) * (1 << 20) for i in range(8)]
    with ThreadPoolExecutor(8) as pool:
        list(pool.map(lambda data: store.put_bytes("a/k.safetensors", data), payloads * 4))
    assert store.get_bytes("a/k.safetensors") in payloads
    assert sorted(p.name for p in (tmp_path / "store" / "a").iterdir()) == ["k.safetensors"]
