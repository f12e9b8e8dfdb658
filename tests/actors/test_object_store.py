import time
import uuid

import pytest
import torch

from specray.capture import store as store_module
from specray.capture.store import FeatureChecksumError, FeatureNotFoundError, FeatureStore, open_store

pytestmark = pytest.mark.ray

CONTRACT_ID = "c0ffee"


def _tensors(T: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(T)
    return {
        "input_ids": torch.arange(T, dtype=torch.int32),
        "loss_mask": torch.arange(T) % 2 == 0,
        "hidden_states": torch.randn(T, 24, generator=g).to(torch.bfloat16),
    }


def _writer_cls():
    """A Ray actor that owns what it puts (defined here so Ray pickles it by value)."""
    import ray

    @ray.remote(num_cpus=0, max_restarts=0)
    class Writer:
        def __init__(self, uri: str):
            import specray.actors.object_store  # noqa: F401

            self.store = open_store(uri)

        def put(self, key: str, T: int):
            g = torch.Generator().manual_seed(T)
            tensors = {
                "input_ids": torch.arange(T, dtype=torch.int32),
                "loss_mask": torch.arange(T) % 2 == 0,
                "hidden_states": torch.randn(T, 24, generator=g).to(torch.bfloat16),
            }
            return self.store.put(key, tensors, sample_id=key, num_tokens=T, contract=CONTRACT_ID)

    return Writer


@pytest.fixture
def ray_store(ray_cluster):
    from specray.actors.object_store import RayObjectStore

    return RayObjectStore(f"ray://test-{uuid.uuid4().hex[:8]}", timeout_s=20)


def test_unknown_scheme_is_a_clear_error():
    with pytest.raises(ValueError, match=r"unknown scheme gs://; use one of \['file://', 'ray://', 's3://'\]"):
        open_store("gs://bucket/features")


def test_ray_scheme_before_the_backend_is_loaded_names_the_fix(monkeypatch):
    monkeypatch.delitem(store_module._BACKENDS, "ray", raising=False)
    with pytest.raises(ValueError, match=r"ray:// backend is not loaded .*`import specray.actors.object_store`"):
        open_store("ray://run")


def test_round_trip_same_ref_as_file_store_then_delete(ray_store, tmp_path):
    key = "features/c/s0.safetensors"
    ref = ray_store.put(key, _tensors(7), sample_id="s0", num_tokens=7, contract=CONTRACT_ID)
    file_ref = FeatureStore(tmp_path.as_uri()).put(key, _tensors(7), sample_id="s0", num_tokens=7, contract=CONTRACT_ID)
    assert ref == file_ref  # same bytes, same checksum: the backends are interchangeable
    got = ray_store.get(ref)
    for name, tensor in _tensors(7).items():
        assert torch.equal(got[name], tensor)
    assert ray_store.exists(key) and ray_store.size() == 1
    assert isinstance(open_store(ray_store.uri), type(ray_store))  # the scheme is registered
    ray_store.delete(key)
    ray_store.delete(key)  # idempotent
    assert not ray_store.exists(key) and ray_store.size() == 0
    with pytest.raises(FeatureNotFoundError, match=f"no feature blob at key {key!r}"):
        ray_store.get(ref)


def test_corrupt_blob_is_detected(ray_store):
    ref = ray_store.put("k/s1.safetensors", _tensors(5), sample_id="s1", num_tokens=5, contract=CONTRACT_ID)
    data = bytearray(ray_store.get_bytes(ref.key))
    data[-1] ^= 1
    ray_store.put_bytes(ref.key, bytes(data))
    with pytest.raises(FeatureChecksumError, match="'k/s1.safetensors' .* is corrupt or truncated"):
        ray_store.get(ref)
    with pytest.raises(ValueError, match="invalid store key"):
        ray_store.put_bytes("../escape", b"x")


def test_blob_written_by_an_actor_is_read_by_the_driver_and_a_task(ray_store):
    import ray

    writer = _writer_cls().remote(ray_store.uri)
    ref = ray.get(writer.put.remote("w/s2.safetensors", 9), timeout=60)

    @ray.remote(num_cpus=0)
    def read(uri, sample_ref):
        import specray.actors.object_store  # noqa: F401

        return open_store(uri).get(sample_ref)

    expected = _tensors(9)
    for got in (ray_store.get(ref), ray.get(read.remote(ray_store.uri, ref), timeout=60)):
        assert all(torch.equal(got[name], expected[name]) for name in expected)
    ray.kill(writer)


def test_owner_death_loses_the_feature_without_hanging(ray_store):
    import ray

    writer = _writer_cls().remote(ray_store.uri)
    ref = ray.get(writer.put.remote("w/s3.safetensors", 4), timeout=60)
    assert ray_store.get(ref)["input_ids"].numel() == 4
    ray.kill(writer)
    with pytest.raises(ray.exceptions.RayActorError):  # returns once the owner is really dead
        ray.get(writer.put.remote("w/s4.safetensors", 4), timeout=60)
    # Readers learn of the death within about a second; until then they may still get the
    # (valid) bytes. Each read returns promptly either way: no hang on a lost object.
    deadline = time.monotonic() + 15
    while True:
        start = time.monotonic()
        try:
            assert ray_store.get(ref)["input_ids"].numel() == 4
        except FeatureNotFoundError as e:
            assert "lost with the process that captured it" in str(e)
            break
        finally:
            assert time.monotonic() - start < ray_store.timeout_s
        assert time.monotonic() < deadline, "the owner's death was never reported"
        time.sleep(0.2)
    assert not ray_store.exists(ref.key)


def test_endpoint_url_is_ignored_with_a_warning(ray_store):
    with pytest.warns(UserWarning, match="endpoint_url='http://s3' is ignored"):
        open_store(ray_store.uri, endpoint_url="http://s3")
