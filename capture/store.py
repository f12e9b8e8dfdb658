"""Feature store: captured tensors as checksummed safetensors blobs behind fsspec.

``FeatureStore(uri)`` supports ``file://`` (also a plain path; the embedded default) and
``s3://bucket/prefix`` through s3fs (any S3: AWS, SeaweedFS, MinIO; the endpoint comes from
``endpoint_url=`` or ``$SPECRAY_S3_ENDPOINT``, the region from ``$AWS_DEFAULT_REGION``).

Every blob is described by a ``SampleRef``: metadata only (key, shapes, dtypes, token count,
size, sha256, contract id), which is all that travels through the control plane. ``get``
verifies size and checksum before deserialising, so a corrupt or truncated blob raises
``FeatureChecksumError`` naming the key and is never trained on.

Other schemes plug in through ``register_store_backend``; open every store by URI with
``open_store(uri)``. ``ray://NAME`` (features in the Ray object store) is registered by
``import specray.actors.object_store``, which keeps ``capture/`` free of Ray.

Manifests are immutable Parquet tables of SampleRefs with the capture contract and a schema
version in the table metadata (``write_manifest`` / ``read_manifest``).
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable

import fsspec
import pyarrow as pa
import pyarrow.parquet as pq
import torch
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from specray.capture.contract import CaptureContract

MANIFEST_SCHEMA_VERSION = 1
_DTYPE_NAMES = {
    torch.bfloat16: "bfloat16", torch.float16: "float16", torch.float32: "float32",
    torch.int32: "int32", torch.int64: "int64", torch.bool: "bool", torch.uint8: "uint8",
}


class FeatureChecksumError(IOError):
    """A stored blob does not match the size or sha256 its SampleRef recorded."""


class FeatureNotFoundError(FileNotFoundError):
    """No blob under the requested key."""


@dataclass(frozen=True)
class TensorMeta:
    name: str
    shape: tuple[int, ...]
    dtype: str


@dataclass(frozen=True)
class SampleRef:
    """Metadata of one stored sample; never holds tensors."""

    sample_id: str
    key: str  # path of the blob relative to the store root
    tensors: tuple[TensorMeta, ...]
    num_tokens: int
    num_bytes: int
    checksum: str  # "sha256:<hex>" of the blob bytes
    contract: str  # CaptureContract.contract_id

    def tensor(self, name: str) -> TensorMeta:
        for meta in self.tensors:
            if meta.name == name:
                return meta
        raise KeyError(f"{self.key} has no tensor {name!r}; it has {[m.name for m in self.tensors]}")


def check_ref(ref: SampleRef) -> SampleRef:
    """Raise ``TypeError`` unless ``ref`` holds plain JSON values of its fields' types (what the ledger writes)."""
    if not isinstance(ref, SampleRef):
        raise TypeError(f"expected a SampleRef, got a {type(ref).__name__}")
    sid = ref.sample_id if type(ref.sample_id) is str else repr(ref.sample_id)

    def need(value, kind: type, name: str) -> None:
        if type(value) is not kind:
            raise TypeError(f"sample {sid!r}: SampleRef.{name} must be {kind.__name__}, got {type(value).__name__}; "
                            "SampleRefs travel as JSON (broker, ledger): convert it (e.g. int(tensor))")

    for name in ("sample_id", "key", "checksum", "contract"):
        need(getattr(ref, name), str, name)
    for name in ("num_tokens", "num_bytes"):
        need(getattr(ref, name), int, name)
    need(ref.tensors, tuple, "tensors")
    for i, meta in enumerate(ref.tensors):
        if not isinstance(meta, TensorMeta):
            raise TypeError(f"sample {sid!r}: SampleRef.tensors[{i}] must be TensorMeta, got {type(meta).__name__}")
        need(meta.name, str, f"tensors[{i}].name")
        need(meta.dtype, str, f"tensors[{i}].dtype")
        need(meta.shape, tuple, f"tensors[{i}].shape")
        for j, size in enumerate(meta.shape):
            need(size, int, f"tensors[{i}].shape[{j}]")
    return ref


def _checksum(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


def open_fs(uri: str, *, endpoint_url: str | None = None, storage_options: dict | None = None):
    """(filesystem, path, protocol) for a ``file://``/plain-path or ``s3://`` URI."""
    options = dict(storage_options or {})
    protocol = uri.split("://", 1)[0] if "://" in uri else "file"
    if protocol not in ("file", "s3"):
        raise ValueError(f"URI {uri!r}: supported schemes are file:// and s3://")
    if protocol == "s3":
        endpoint_url = endpoint_url or os.environ.get("SPECRAY_S3_ENDPOINT")
        if endpoint_url:
            options.setdefault("client_kwargs", {})["endpoint_url"] = endpoint_url
    fs, path = fsspec.core.url_to_fs(uri, **options)
    return fs, path, protocol


class BlobStore(ABC):
    """Safetensors encoding and checksum verification over a backend's byte I/O.

    A backend implements ``put_bytes / get_bytes / exists / delete`` and sets ``uri``;
    ``put`` and ``get`` are shared, so every backend detects corruption the same way.
    """

    uri: str

    def put(self, key: str, tensors: dict[str, torch.Tensor], *, sample_id: str, num_tokens: int, contract: str) -> SampleRef:
        """Write one blob atomically (readers see all of it or nothing) and describe it.

        ``tensors`` is checked before anything is written: a value that is not a tensor, or a dtype
        the store does not record, is a ``TypeError`` naming the tensor."""
        check_tensors(tensors, sample_id)
        tensors = {k: v.contiguous() for k, v in tensors.items()}
        # One metadata entry: safetensors writes its metadata map in a per-process random order,
        # so two entries would give the same sample different bytes (and checksums) per process.
        data = st_save(tensors, metadata={"specray": json.dumps({"contract": contract, "sample_id": sample_id}, sort_keys=True)})
        self.put_bytes(key, data)
        return SampleRef(
            sample_id=sample_id,
            key=key,
            tensors=tuple(TensorMeta(k, tuple(v.shape), _DTYPE_NAMES[v.dtype]) for k, v in tensors.items()),
            num_tokens=num_tokens,
            num_bytes=len(data),
            checksum=_checksum(data),
            contract=contract,
        )

    def get(self, ref: SampleRef) -> dict[str, torch.Tensor]:
        data = self.get_bytes(ref.key)
        if len(data) != ref.num_bytes or _checksum(data) != ref.checksum:
            raise FeatureChecksumError(
                f"feature blob {ref.key!r} in {self.uri} is corrupt or truncated: "
                f"{len(data)} bytes (expected {ref.num_bytes}), checksum mismatch; re-capture this sample"
            )
        tensors = st_load(data)
        for meta in ref.tensors:
            got = tensors.get(meta.name)
            if got is None or tuple(got.shape) != meta.shape or _DTYPE_NAMES[got.dtype] != meta.dtype:
                raise FeatureChecksumError(f"feature blob {ref.key!r}: tensor {meta.name!r} does not match its SampleRef")
        return tensors

    @abstractmethod
    def put_bytes(self, key: str, data: bytes) -> None: ...

    @abstractmethod
    def get_bytes(self, key: str) -> bytes:
        """The blob's bytes; ``FeatureNotFoundError`` when there is none under ``key``."""

    @abstractmethod
    def exists(self, key: str) -> bool: ...

    @abstractmethod
    def delete(self, key: str) -> None:
        """Idempotent: deleting a missing key is not an error."""


def check_tensors(tensors: dict, sample_id: str) -> None:
    """``TypeError`` naming the tensor unless every value is a torch.Tensor of a dtype the store records."""
    if not isinstance(tensors, dict) or not tensors:
        raise TypeError(f"sample {sample_id!r}: tensors must be a non-empty dict of name -> torch.Tensor, "
                        f"got {type(tensors).__name__}")
    for name, value in tensors.items():
        if not isinstance(name, str):
            raise TypeError(f"sample {sample_id!r}: tensor names must be strings, got {name!r}")
        if not isinstance(value, torch.Tensor):
            raise TypeError(f"sample {sample_id!r}: tensors[{name!r}] must be a torch.Tensor, got "
                            f"{type(value).__name__}")
        if value.dtype not in _DTYPE_NAMES:
            raise TypeError(f"sample {sample_id!r}: tensors[{name!r}] has dtype {value.dtype}; the feature store "
                            f"records {sorted(_DTYPE_NAMES.values())}: cast it (e.g. .to(torch.bfloat16))")


KEY_READABLE_CHARS = 64  # characters of the sanitised sample id kept in its key, for people reading the store


def feature_key(contract_id: str, sample_id: str, prefix: str = "features") -> str:
    """Where a capture writes a sample: the same sample under the same contract always lands on one key,
    and distinct sample ids land on distinct keys.

    The file name is a readable prefix of the id (characters outside ``[A-Za-z0-9-_.]`` become
    ``_``, at most ``KEY_READABLE_CHARS``) and the first 128 bits of the sha256 of the exact id, so
    ``conv/1`` and ``conv_1`` share the prefix but not the key:
    ``features/<contract>/conv_1-<32 hex>.safetensors``."""
    if not isinstance(sample_id, str) or not sample_id:
        raise ValueError(f"a sample id must be a non-empty string, got {sample_id!r}")
    safe = "".join(c if c.isascii() and (c.isalnum() or c in "-_.") else "_" for c in sample_id[:KEY_READABLE_CHARS])
    digest = hashlib.sha256(sample_id.encode("utf-8", "surrogatepass")).hexdigest()[:32]
    return f"{prefix.strip('/')}/{contract_id}/{safe}-{digest}.safetensors"


TMP_MARK = ".tmp-"  # "<key>.tmp-<32 hex>": a file:// write not yet renamed over its key


def temp_name(key: str) -> str:
    """The one temp file every ``file://`` write of ``key`` goes through (``<key>.tmp-<32 hex>``)."""
    return f"{key}{TMP_MARK}{hashlib.sha256(key.encode()).hexdigest()[:32]}"


def is_temp_of(name: str, key: str) -> bool:
    """Whether ``name`` is a temp file of a write of ``key`` (both relative to one directory or root)."""
    suffix = name[len(key) + len(TMP_MARK):]
    return (name.startswith(key + TMP_MARK) and len(suffix) == 32
            and all(c in "0123456789abcdef" for c in suffix))


def check_key(key: str) -> str:
    if not key or key.startswith("/") or ".." in key.split("/"):
        raise ValueError(f"invalid store key {key!r}: use a relative path without '..'")
    return key


class FeatureStore(BlobStore):
    """``put / get / delete / exists`` of safetensors blobs under one root URI."""

    def __init__(self, uri: str, *, endpoint_url: str | None = None, storage_options: dict | None = None):
        self.uri = uri
        self.endpoint_url = endpoint_url
        self.fs, root, self.protocol = open_fs(uri, endpoint_url=endpoint_url, storage_options=storage_options)
        self.root = root.rstrip("/")
        if self.protocol == "file":
            self.fs.makedirs(self.root, exist_ok=True)

    def __repr__(self) -> str:
        return f"FeatureStore({self.uri!r})"

    def _path(self, key: str) -> str:
        return f"{self.root}/{check_key(key)}"

    def put_bytes(self, key: str, data: bytes) -> None:
        """Write ``data`` under ``key`` atomically and durably.

        ``file://``: the key's temp file (``temp_name``) next to the blob, written under an
        exclusive ``flock``, fsynced, renamed over the key, then the directory fsynced, so a
        ledger txn that names the key never outlives the bytes in a power loss. Every write of a
        key uses the same temp file, so ``delete`` finds a dead writer's leftover by name (O(1),
        no directory listing); the lock keeps two live writers of one key apart (a dead
        writer's lock dies with it). ``s3://``: one PUT (atomic).
        """
        path = self._path(key)
        if self.protocol != "file":
            self.fs.pipe_file(path, data)
            return
        directory = path.rsplit("/", 1)[0]
        self.fs.makedirs(directory, exist_ok=True)
        tmp = self._path(temp_name(key))
        fd = _locked_temp(tmp)
        try:
            os.ftruncate(fd, 0)
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view):]
            os.fsync(fd)
            os.replace(tmp, path)  # under the lock: no other writer of this key is between open and rename
        finally:
            os.close(fd)  # releases the lock
        fd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    def get_bytes(self, key: str) -> bytes:
        try:
            return self.fs.cat_file(self._path(key))
        except FileNotFoundError:
            raise FeatureNotFoundError(f"no feature blob at key {key!r} in {self.uri}") from None

    def exists(self, key: str) -> bool:
        return self.fs.exists(self._path(key))

    def delete(self, key: str) -> None:
        """Idempotent: deleting a missing key is not an error. The key's temp file goes too.

        That is a write of the key that died before its rename (``put_bytes``); once the key is
        deleted, whatever wrote it is finished or dead. Two unlinks by name, whatever the
        directory holds.
        """
        path = self._path(key)
        if self.protocol == "s3":
            try:
                self.fs.rm_file(path)
            except FileNotFoundError:
                pass
            self.fs.invalidate_cache(path)
            return
        for name in (path, self._path(temp_name(key))):
            try:
                os.unlink(name)
            except FileNotFoundError:
                pass


def _locked_temp(tmp: str) -> int:
    """An fd of ``tmp`` (created if missing) under an exclusive flock, still named ``tmp``.

    A writer that waited for the lock may find that the holder renamed the file over its key
    (or that a delete removed it): then the name is opened again."""
    while True:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT, 0o666)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            try:
                current = os.stat(tmp)
            except FileNotFoundError:
                current = None
            if current is not None and current.st_ino == os.fstat(fd).st_ino:
                return fd
        except BaseException:
            os.close(fd)
            raise
        os.close(fd)


# -- other schemes -------------------------------------------------------------------------

StoreFactory = Callable[..., BlobStore]  # factory(uri, *, endpoint_url) -> store
_BACKENDS: dict[str, StoreFactory] = {}
# Where the backends specray ships are registered, for the error when one is not loaded yet.
_BACKEND_MODULES = {"ray": "specray.actors.object_store"}


def register_store_backend(scheme: str, factory: StoreFactory) -> None:
    """Make ``open_store("<scheme>://…")`` call ``factory(uri, endpoint_url=…)``."""
    if scheme in ("file", "s3"):
        raise ValueError(f"{scheme}:// is served by FeatureStore and cannot be replaced")
    _BACKENDS[scheme] = factory


def open_store(uri: str, *, endpoint_url: str | None = None) -> BlobStore:
    """The store behind ``uri``: FeatureStore for ``file://``/plain paths and ``s3://``, else a registered backend."""
    scheme = uri.split("://", 1)[0] if "://" in uri else "file"
    if scheme in ("file", "s3"):
        return FeatureStore(uri, endpoint_url=endpoint_url)
    if scheme in _BACKENDS:
        return _BACKENDS[scheme](uri, endpoint_url=endpoint_url)
    if scheme in _BACKEND_MODULES:
        raise ValueError(
            f"store URI {uri!r}: the {scheme}:// backend is not loaded in this process; "
            f"fix: `import {_BACKEND_MODULES[scheme]}` before opening the store"
        )
    known = sorted({"file", "s3", *_BACKENDS, *_BACKEND_MODULES})
    raise ValueError(f"store URI {uri!r}: unknown scheme {scheme}://; use one of {[k + '://' for k in known]}")


# -- manifests -----------------------------------------------------------------------------

_TENSOR_TYPE = pa.struct([("name", pa.string()), ("shape", pa.list_(pa.int64())), ("dtype", pa.string())])
MANIFEST_SCHEMA = pa.schema([
    ("sample_id", pa.string()),
    ("key", pa.string()),
    ("tensors", pa.list_(_TENSOR_TYPE)),
    ("num_tokens", pa.int64()),
    ("num_bytes", pa.int64()),
    ("checksum", pa.string()),
    ("contract", pa.string()),
])


@dataclass(frozen=True)
class Manifest:
    refs: list[SampleRef]
    contract: CaptureContract
    store_uri: str
    metadata: dict[str, Any] = field(default_factory=dict)

    @property
    def num_tokens(self) -> int:
        return sum(r.num_tokens for r in self.refs)

    @property
    def chat_template(self) -> str | None:
        """The chat template the samples were rendered with (``metadata["chat_template"]``, written by
        ``specray capture``); None when the manifest does not record one (the tokenizer's own)."""
        return self.metadata.get("chat_template")


def write_manifest(
    uri: str, refs: Iterable[SampleRef], *, contract: CaptureContract, store_uri: str,
    metadata: dict[str, Any] | None = None, overwrite: bool = False, endpoint_url: str | None = None,
) -> str:
    """Write an immutable Parquet manifest; refuses to replace one unless ``overwrite``."""
    refs = list(refs)
    foreign = {r.contract for r in refs} - {contract.contract_id}
    if foreign:
        raise ValueError(f"refs of contracts {sorted(foreign)} cannot go in a manifest of contract {contract.contract_id}")
    fs, path, protocol = open_fs(uri, endpoint_url=endpoint_url)
    if fs.exists(path) and not overwrite:
        raise FileExistsError(f"manifest {uri} exists and manifests are immutable; choose another path or pass overwrite")
    table = pa.table(
        {
            "sample_id": [r.sample_id for r in refs],
            "key": [r.key for r in refs],
            "tensors": [[{"name": t.name, "shape": list(t.shape), "dtype": t.dtype} for t in r.tensors] for r in refs],
            "num_tokens": [r.num_tokens for r in refs],
            "num_bytes": [r.num_bytes for r in refs],
            "checksum": [r.checksum for r in refs],
            "contract": [r.contract for r in refs],
        },
        schema=MANIFEST_SCHEMA,
    ).replace_schema_metadata({
        "specray.schema_version": str(MANIFEST_SCHEMA_VERSION),
        "specray.contract": contract.to_json(),
        "specray.store_uri": store_uri,
        "specray.metadata": json.dumps(metadata or {}, sort_keys=True),
    })
    if protocol != "file":  # an S3 object appears whole or not at all
        with fs.open(path, "wb") as f:
            pq.write_table(table, f)
        return uri
    fs.makedirs(path.rsplit("/", 1)[0], exist_ok=True)
    partial = f"{path}.{os.getpid()}.tmp"  # a reader never sees half a manifest
    with open(partial, "wb") as f:
        pq.write_table(table, f)
    os.replace(partial, path)
    return uri


def merge_manifests(uris: list[str], out: str, *, endpoint_url: str | None = None) -> Manifest:
    """Write one manifest holding the samples of several (e.g. a dataset captured in parts).

    They must share the contract and the store: a manifest names one store, and a later
    capture joins an earlier one by writing into its ``store.uri``. A sample id that appears
    twice must name the same blob (same key and checksum) and is kept once; otherwise it is an
    error, as is a differing contract or store."""
    if not uris:
        raise ValueError("merge needs at least one manifest")
    manifests = [read_manifest(u, endpoint_url=endpoint_url) for u in uris]
    first = manifests[0]
    for uri, m in zip(uris[1:], manifests[1:]):
        if m.contract.contract_id != first.contract.contract_id:
            raise ValueError(f"{uri} has contract {m.contract.contract_id}, {uris[0]} has "
                             f"{first.contract.contract_id}: only features of one contract train one drafter")
        if m.store_uri != first.store_uri:
            raise ValueError(f"{uri} lives in store {m.store_uri}, {uris[0]} in {first.store_uri}: a manifest names "
                             "one store; capture the later part with store.uri set to the first one's")
    refs: dict[str, SampleRef] = {}
    for uri, m in zip(uris, manifests):
        for ref in m.refs:
            seen = refs.setdefault(ref.sample_id, ref)
            if (seen.key, seen.checksum) != (ref.key, ref.checksum):
                raise ValueError(f"sample {ref.sample_id!r} of {uri} differs from an earlier one with that id "
                                 f"({ref.key} vs {seen.key})")
    write_manifest(out, refs.values(), contract=first.contract, store_uri=first.store_uri,
                   metadata={"merged_from": list(uris)}, endpoint_url=endpoint_url)
    return read_manifest(out, endpoint_url=endpoint_url)


def read_manifest(uri: str, *, endpoint_url: str | None = None) -> Manifest:
    fs, path, _ = open_fs(uri, endpoint_url=endpoint_url)
    if not fs.exists(path):
        raise FileNotFoundError(f"no manifest at {uri}")
    with fs.open(path, "rb") as f:
        table = pq.read_table(f)
    meta = {k.decode(): v.decode() for k, v in (table.schema.metadata or {}).items()}
    version = meta.get("specray.schema_version")
    if version != str(MANIFEST_SCHEMA_VERSION):
        raise ValueError(
            f"manifest {uri} has schema version {version!r}; this specray reads version "
            f"{MANIFEST_SCHEMA_VERSION}; re-capture or use the matching specray release"
        )
    contract = CaptureContract.from_json(meta["specray.contract"])
    refs = [
        SampleRef(
            sample_id=row["sample_id"], key=row["key"],
            tensors=tuple(TensorMeta(t["name"], tuple(t["shape"]), t["dtype"]) for t in row["tensors"]),
            num_tokens=row["num_tokens"], num_bytes=row["num_bytes"],
            checksum=row["checksum"], contract=row["contract"],
        )
        for row in table.to_pylist()
    ]
    return Manifest(refs, contract, meta["specray.store_uri"], json.loads(meta["specray.metadata"]))
