"""``ray://NAME``: captured features in the Ray object store, for same-cluster online runs.

Importing this module registers the ``ray`` scheme with ``capture.store.open_store``::

    import specray.actors.object_store  # noqa: F401  (registers ray://)
    store = open_store("ray://online-run")
    ref = store.put(key, tensors, sample_id=..., num_tokens=..., contract=...)   # in a capture actor
    tensors = store.get(ref)                                                      # in a trainer rank

How it works: ``put`` turns the safetensors blob into a ``uint8`` array and ``ray.put``\\ s
it from the writing process, which becomes the object's *owner* (a capture actor in the
online pipeline). A named directory actor (``StoreDirectory``, one per NAME, no CPU)
maps keys to those ObjectRefs. ``get`` looks the key up and reads the object: on the same
node the array is read from shared memory without a copy through disk, S3 or the control
plane; the blob is then checksummed and decoded exactly like a ``file://`` one, so a corrupt
blob raises ``FeatureChecksumError`` here too.

Semantics — the ``ray://`` store is a **cache**, not a durable store:

- an object lives only as long as its owner process: when a capture actor dies (or is
  restarted by Ray) every feature it wrote is gone, and ``get`` / ``exists`` report it as
  missing (``FeatureNotFoundError`` / ``False``) within ``timeout_s``, never hang. For about
  a second after the death a reader may still get a small blob (Ray inlines small objects
  into the refs it hands out); those bytes are the right ones, checksum verified;
- the directory lives as long as the process that first opened ``ray://NAME`` (open it in
  the driver first; ``CapturePool`` does), and the whole store ends with the Ray job;
- the durable truth is the ack ledger plus the sample source: a trainer rank that finds a
  dispatched feature gone asks the broker, and the online pipeline's producer captures the
  sample again from its original batch (same padding, so the same bytes and checksum); the
  window is trained as dispatched, never skipped or trained twice (``actors/broker.py``,
  re-capture). Use ``file://`` or ``s3://`` for features that must outlive the run
  (offline manifests).
"""

from __future__ import annotations

import warnings

import numpy as np
import ray
from ray.exceptions import GetTimeoutError, ObjectLostError

from specray.capture.store import BlobStore, FeatureNotFoundError, check_key, register_store_backend

SCHEME = "ray"
DIRECTORY_PREFIX = "specray-store:"


@ray.remote(num_cpus=0)
class StoreDirectory:
    """key → ObjectRef of one blob. Holding the ref keeps the object alive while its owner lives.

    Refs travel boxed in a one-element list so Ray hands over the ref, not its value.
    """

    def __init__(self) -> None:
        self._refs: dict[str, ray.ObjectRef] = {}

    def put(self, key: str, boxed: list[ray.ObjectRef]) -> None:
        self._refs[key] = boxed[0]  # dropping a replaced ref frees its object

    def get(self, key: str) -> list[ray.ObjectRef] | None:
        ref = self._refs.get(key)
        return None if ref is None else [ref]

    def delete(self, key: str) -> None:
        self._refs.pop(key, None)

    def size(self) -> int:
        return len(self._refs)


def parse_uri(uri: str) -> str:
    """``ray://NAME`` → NAME (letters, digits, ``-_.``)."""
    name = uri.removeprefix(f"{SCHEME}://")
    if not uri.startswith(f"{SCHEME}://") or not name or not all(c.isalnum() or c in "-_." for c in name):
        raise ValueError(f"store URI {uri!r}: use ray://NAME with NAME made of letters, digits, '-', '_', '.'")
    return name


class RayObjectStore(BlobStore):
    """``put / get / get_bytes / put_bytes / delete / exists`` over the Ray object store.

    ``timeout_s`` bounds every Ray call: a directory that does not answer, or a blob that
    cannot be fetched in time, is reported instead of hanging the caller.
    """

    def __init__(self, uri: str, *, endpoint_url: str | None = None, timeout_s: float = 60.0):
        if endpoint_url is not None:
            warnings.warn(f"endpoint_url={endpoint_url!r} is ignored by the {uri} store (it is for s3://)", stacklevel=2)
        if not ray.is_initialized():
            raise RuntimeError(f"store {uri}: connect to Ray first (ray.init(...)); the ray:// store lives in a Ray cluster")
        self.uri = uri
        self.name = parse_uri(uri)
        self.timeout_s = timeout_s
        self.directory = StoreDirectory.options(name=DIRECTORY_PREFIX + self.name, get_if_exists=True).remote()

    def __repr__(self) -> str:
        return f"RayObjectStore({self.uri!r})"

    def _call(self, method, *args):
        return ray.get(method.remote(*args), timeout=self.timeout_s)

    def put_bytes(self, key: str, data: bytes) -> None:
        """``ray.put`` from this process (its owner), then publish the ref under ``key``."""
        ref = ray.put(np.frombuffer(data, dtype=np.uint8))
        self._call(self.directory.put, check_key(key), [ref])

    def _fetch(self, key: str) -> np.ndarray:  # [num_bytes] uint8
        boxed = self._call(self.directory.get, check_key(key))
        if boxed is None:
            raise FeatureNotFoundError(f"no feature blob at key {key!r} in {self.uri}")
        try:
            return ray.get(boxed[0], timeout=self.timeout_s)
        except ObjectLostError as e:
            raise FeatureNotFoundError(
                f"feature blob {key!r} in {self.uri} was lost with the process that captured it "
                f"({type(e).__name__}); capture the sample again from its source"
            ) from None
        except GetTimeoutError:
            raise FeatureNotFoundError(
                f"feature blob {key!r} in {self.uri} could not be fetched within {self.timeout_s} s "
                "(its owner is unreachable); capture the sample again from its source"
            ) from None

    def get_bytes(self, key: str) -> bytes:
        return self._fetch(key).tobytes()

    def exists(self, key: str) -> bool:
        """Whether ``get`` would find the blob: a lost owner is only noticed by reading, so this fetches."""
        try:
            self._fetch(key)
        except FeatureNotFoundError:
            return False
        return True

    def delete(self, key: str) -> None:
        """Idempotent; the object is freed once no reader still holds its ref."""
        self._call(self.directory.delete, check_key(key))

    def size(self) -> int:
        """Number of keys in the directory (including blobs whose owner has died)."""
        return self._call(self.directory.size)


register_store_backend(SCHEME, RayObjectStore)
