"""Versioned drafter exports on any fsspec store: publish, pull, pin, reject, and what replicas report.

    registry = DrafterRegistry("s3://bucket/drafters", endpoint_url="http://127.0.0.1:8333")
    version = registry.publish("runs/train-dflash/exports/step-00002000")    # 1, 2, 3, …
    local_dir = registry.pull(registry.latest(), cache_dir="/tmp/specray-drafters")
    registry.pin(3); registry.unpin(); registry.reject(4, OPERATOR, "rolled back")

or ``specray registry list | publish | pin | unpin | rollback | status --uri URI``. The poller that
hot-loads versions into a replica is serving/poller.py.

Layout under the root URI::

    v000001/CLAIM         the publisher that took number 1 (created exclusively, first)
    v000001/<files>       a copy of one export directory (drafters/format.py)
    v000001/COMPLETE      written last: only versions that have it are listed
    PIN                   {"version": 3, …}: replicas serve version 3 (absent: the newest good one)
    rejected/v000004/<scope>.json    why version 4 is not served, and by whom
    attempts/v000004/<owner>.json    a replica is loading version 4 (removed when it is done)
    replicas/<replica>.json          what each replica serves (its version, live tau), refreshed by it

**Publish is race-safe.** A publisher takes the next number (one more than the highest version
directory present) by creating its ``CLAIM`` exclusively — ``O_EXCL`` on ``file://``, a PUT with
``If-None-Match: *`` on ``s3://`` — and takes the next number when another publisher holds it, so
two publishers never write one version. An S3 server that ignores ``If-None-Match`` would let both
PUTs succeed: before its first publish a registry checks the server honours it (two exclusive
PUTs of one probe key) and refuses to publish on one that does not. A publish that crashed leaves
a claimed directory without a marker, never listed, whose number is never reused.

**A version holds the export files and nothing else** (``EXPORT_FILES``). ``pull`` trusts no name
it reads from the registry: a marker listing anything else (``../x``, an absolute path, a
sub-directory, an unknown file) or a file that is not a regular file (a symlink on a ``file://``
registry) rejects the whole version (``RejectedVersionError``) before anything is written. The
export's content is not validated here: an export for another target, or with corrupt weights,
publishes fine and is refused where it is loaded (``load_drafter`` checks fingerprints, contract,
bounds and sha256).

**Rejections are kept in the registry**, one record per version and *scope*: ``registry`` (the
version cannot be pulled safely: every replica refuses it), ``operator`` (``specray registry
rollback``), or ``target-<hash>`` (a replica of that target refused to load it; replicas of
another target sharing the registry are not bound by it). A replica skips every version rejected
in the ``registry`` or ``operator`` scope or in its own, so after a crash or a restart no replica
retries what the others already refused. ``attempts/`` records each load in progress: a version
whose load killed replicas (its attempt outlives the replica's reports) is rejected after
``MAX_LOAD_CRASHES`` such deaths, so one crafted publish cannot crash-loop every replica.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import re
import shutil
import socket
import tempfile
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

from specray.capture.store import open_fs

log = logging.getLogger(__name__)

MARKER = "COMPLETE"
CLAIM = "CLAIM"
PIN = "PIN"
REGISTRY, OPERATOR = "registry", "operator"  # rejection scopes every replica honours
MAX_LOAD_CRASHES = 2  # replicas that may die loading one version before it is rejected for all
# drafters/format.py's export directory (its model card included), and the files `specray calibrate`
# (DSpark) and `specray evaluate` may add
EXPORT_FILES = ("config.json", "export.json", "model.safetensors", "README.md", "calibration.json", "evaluation.json")
_VERSION_DIR = re.compile(r"^v(\d{6,})$")
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,127}$")  # a scope, replica or owner id: one path component


def version_dir(version: int) -> str:
    return f"v{version:06d}"


class RejectedVersionError(ValueError):
    """A version whose completion marker or files cannot be pulled safely; it is never pulled."""


class ConditionalWriteError(ValueError):
    """The S3 server does not honour ``If-None-Match: *``, so publishes could not be race-safe."""


@dataclass(frozen=True)
class Rejection:
    version: int
    scope: str  # REGISTRY, OPERATOR or "target-<hash>"
    reason: str
    by: str  # a replica id, "operator", or the host that rejected it
    at: float  # unix time


def check_name(name: str, what: str) -> str:
    if not isinstance(name, str) or not _NAME.match(name):
        raise ValueError(f"{what} {name!r} must be one path component of letters, digits, '_', '.' and '-' "
                         "(at most 128, starting with a letter or digit)")
    return name


def _who() -> str:
    return f"{socket.gethostname()}:{os.getpid()}"


class DrafterRegistry:
    """The registry under one root URI (module docstring): versions, pin, rejections, attempts, replicas."""

    def __init__(self, uri: str, endpoint_url: str | None = None):
        self.uri = uri
        self.fs, root, self.protocol = open_fs(uri, endpoint_url=endpoint_url)
        self.root = root.rstrip("/")
        self._exclusive_checked = self.protocol == "file"  # O_EXCL needs no check

    def __repr__(self) -> str:
        return f"DrafterRegistry({self.uri!r})"

    # -- bytes -------------------------------------------------------------------------------

    def _path(self, *parts: str) -> str:
        return "/".join([self.root, *parts])

    def _read_json(self, path: str) -> dict | None:
        """The JSON object at ``path``; None if it is missing or not a JSON object (logged: a
        record anyone with write access may have garbled must not stop the readers)."""
        try:
            data = json.loads(self.fs.cat_file(path))
        except FileNotFoundError:
            return None
        except (ValueError, UnicodeDecodeError) as e:
            log.warning("%s/%s is not JSON (%s); ignored", self.uri, path.removeprefix(self.root + "/"), e)
            return None
        if not isinstance(data, dict):
            log.warning("%s/%s is not a JSON object; ignored", self.uri, path.removeprefix(self.root + "/"))
            return None
        return data

    def _write_json(self, path: str, data: dict) -> None:
        if self.protocol == "file":  # readers never see half a record: write aside, then rename
            Path(path).parent.mkdir(parents=True, exist_ok=True)
            tmp = f"{path}.tmp-{uuid.uuid4().hex[:8]}"
            Path(tmp).write_text(json.dumps(data, indent=2))
            os.replace(tmp, path)
        else:  # an S3 PUT is atomic
            self.fs.pipe_file(path, json.dumps(data, indent=2).encode())

    def _create_exclusive(self, path: str, data: bytes) -> bool:
        """Create ``path`` with ``data`` unless it exists: True if this call created it, False if it
        was there (another writer's). Atomic: of concurrent callers exactly one gets True."""
        if self.protocol == "file":
            Path(path).parent.mkdir(parents=True, exist_ok=True)
            try:
                fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            except FileExistsError:
                return False
            with os.fdopen(fd, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            return True
        for attempt in range(8):
            try:
                self.fs.pipe_file(path, data, mode="create")
                return True
            except OSError as e:
                code = _s3_error_code(e)
                if isinstance(e, FileExistsError) or code in ("PreconditionFailed", "412"):
                    return False
                if code != "ConditionalRequestConflict":  # AWS: a conditional PUT of this key is in flight
                    raise
                time.sleep(0.05 * 2 ** attempt)
        raise OSError(errno.EBUSY, f"{path}: conditional PUTs kept conflicting; retry the publish")

    def _check_exclusive(self) -> None:
        """Refuse (``ConditionalWriteError``) an S3 server that lets a second exclusive PUT of one key succeed."""
        if self._exclusive_checked:
            return
        probe = self._path(f".conditional-write-probe-{uuid.uuid4().hex}")
        try:
            first, second = self._create_exclusive(probe, b"1"), self._create_exclusive(probe, b"2")
        finally:
            if self.fs.exists(probe):
                self.fs.rm_file(probe)
        if not (first and not second):
            raise ConditionalWriteError(
                f"the S3 server of {self.uri} does not honour 'If-None-Match: *' on PUT (a second exclusive "
                "write of one key succeeded), so two publishers could take one version number; publish to a "
                "server with conditional writes (AWS S3, MinIO, SeaweedFS 3.80 or later) or to a file:// registry")
        self._exclusive_checked = True

    # -- versions ----------------------------------------------------------------------------

    def _numbers(self) -> dict[int, str]:
        """Every version directory, complete or not: number -> path."""
        self.fs.invalidate_cache(self.root)  # pollers must see what other processes published
        if not self.fs.exists(self.root):
            return {}
        found = {}
        for path in self.fs.ls(self.root, detail=False):
            match = _VERSION_DIR.match(path.rstrip("/").rsplit("/", 1)[-1])
            if match:
                found[int(match.group(1))] = path.rstrip("/")
        return found

    def versions(self) -> list[int]:
        """Complete versions, ascending."""
        return sorted(n for n, path in self._numbers().items() if self.fs.exists(f"{path}/{MARKER}"))

    def latest(self) -> int | None:
        versions = self.versions()
        return versions[-1] if versions else None

    def describe(self, version: int) -> dict:
        """A complete version's marker: ``version, source, published_at, files {name: bytes}``."""
        marker = self._read_json(self._path(version_dir(version), MARKER))
        if marker is None:
            raise FileNotFoundError(f"{self.uri} has no complete version {version}; it has {self.versions()}")
        return marker

    def publish(self, export_dir: str | Path) -> int:
        """Copy an export directory in as the next version; returns its number (race-safe: module docstring)."""
        source = Path(export_dir)
        files = sorted(source.iterdir()) if source.is_dir() else []
        if not files:
            raise FileNotFoundError(f"{source} is not a directory with files; publish an export dir (specray export)")
        foreign = [p.name for p in files if p.name not in EXPORT_FILES or p.is_symlink() or not p.is_file()]
        if foreign:
            raise ValueError(f"{source} holds {foreign}, which a version cannot carry: an export directory holds "
                             f"regular files named {', '.join(EXPORT_FILES)} only (specray export writes them)")
        self._check_exclusive()
        claim = json.dumps({"by": _who(), "claimed_at": time.time(), "source": str(source.resolve())}).encode()
        version = max(self._numbers(), default=0) + 1
        while not self._create_exclusive(self._path(version_dir(version), CLAIM), claim):
            version += 1  # another publisher holds it
        target = self._path(version_dir(version))
        for path in files:
            self.fs.put_file(str(path), f"{target}/{path.name}")
        marker = {"version": version, "source": str(source.resolve()), "published_at": time.time(), "by": _who(),
                  "files": {p.name: p.stat().st_size for p in files}}
        self.fs.pipe_file(f"{target}/{MARKER}", json.dumps(marker, indent=2).encode())  # last: the version is visible
        return version

    def pull(self, version: int, cache_dir: str | Path) -> Path:
        """A local copy of ``version`` under ``cache_dir`` (reused when already pulled)."""
        local = Path(cache_dir) / version_dir(version)
        if (local / MARKER).is_file():
            return local
        source = self._path(version_dir(version))
        if not self.fs.exists(f"{source}/{MARKER}"):
            raise FileNotFoundError(f"{self.uri} has no complete version {version}; it has {self.versions()}")
        marker_bytes = self.fs.cat_file(f"{source}/{MARKER}")
        files = self._checked_files(version, source, marker_bytes)
        local.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(dir=local.parent, prefix=f".{local.name}-"))
        try:
            for name, size in files.items():
                self.fs.get_file(f"{source}/{name}", str(tmp / name))
                if (tmp / name).stat().st_size != size:
                    raise OSError(f"{source}/{name}: {(tmp / name).stat().st_size} bytes, the registry recorded {size}")
            (tmp / MARKER).write_bytes(marker_bytes)
            os.chmod(tmp, 0o755)
            try:
                os.rename(tmp, local)
            except OSError:  # another replica on this node pulled it first: use theirs
                if not (local / MARKER).is_file():
                    raise
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        return local

    def _checked_files(self, version: int, source: str, marker_bytes: bytes) -> dict[str, int]:
        """The marker's ``{name: size}``, once every name is a plain export file name and every file
        a regular file; else ``RejectedVersionError`` (nothing has been written yet)."""
        try:
            files = json.loads(marker_bytes)["files"]
        except (ValueError, TypeError, KeyError) as e:
            raise RejectedVersionError(f"{self.uri} version {version}: its {MARKER} marker is not a file list "
                                       f"({type(e).__name__}: {e})") from None
        if not isinstance(files, dict) or not all(type(size) is int and size >= 0 for size in files.values()):
            raise RejectedVersionError(f"{self.uri} version {version}: its {MARKER} marker must map file names "
                                       f"to sizes in bytes, got {str(files)[:200]}")
        for name in files:
            if name not in EXPORT_FILES:
                raise RejectedVersionError(
                    f"{self.uri} version {version} lists the file {name!r}; a version holds only "
                    f"{', '.join(EXPORT_FILES)} (no paths), so it is not pulled")
            info = self.fs.info(f"{source}/{name}")
            if info["type"] != "file" or info.get("islink"):
                kind = "a symlink" if info.get("islink") else info["type"]
                raise RejectedVersionError(f"{self.uri} version {version}: {name} is not a regular file ({kind}), "
                                           "so it is not pulled")
        return files

    # -- pin ---------------------------------------------------------------------------------

    def pinned(self) -> int | None:
        """The pinned version, or None. A ``PIN`` that does not name a version is a ``ValueError``
        (replicas keep what they serve until it is fixed: ``specray registry pin N`` or ``unpin``)."""
        path = self._path(PIN)
        self.fs.invalidate_cache(self.root)
        if not self.fs.exists(path):
            return None
        record = self._read_json(path)
        version = None if record is None else record.get("version")
        if type(version) is not int or version < 1:
            raise ValueError(f"{self.uri}/{PIN} does not name a version ({str(record)[:200]}); "
                             "fix it with `specray registry pin N` or `specray registry unpin`")
        return version

    def pin(self, version: int, *, reason: str = "") -> None:
        """Serve ``version`` on every replica, newer versions or not. It must be complete and not
        rejected by a replica or the registry; an operator's rejection (a rollback) is lifted."""
        if version not in self.versions():
            raise ValueError(f"{self.uri} has no complete version {version} to pin; it has {self.versions()}")
        refused = [r for r in self.rejections().get(version, []) if r.scope != OPERATOR]
        if refused:
            raise ValueError(f"version {version} was rejected ({refused[0].scope}: {refused[0].reason}); replicas "
                             "cannot serve it, so it is not pinned: publish a fixed export")
        self.unreject(version, OPERATOR)
        self._write_json(self._path(PIN), {"version": version, "pinned_at": time.time(), "by": _who(),
                                           "reason": reason})

    def unpin(self) -> int | None:
        """Serve the newest good version again; returns the version that was pinned (None: none was)."""
        path = self._path(PIN)
        if not self.fs.exists(path):
            return None
        record = self._read_json(path) or {}
        self.fs.rm_file(path)
        return record.get("version")

    # -- rejections --------------------------------------------------------------------------

    def reject(self, version: int, scope: str, reason: str, *, by: str | None = None) -> None:
        """Record that ``version`` is not to be served in ``scope`` (module docstring)."""
        check_name(scope, "a rejection scope")
        self._write_json(self._path("rejected", version_dir(version), f"{scope}.json"),
                         {"version": version, "scope": scope, "reason": reason[:2000], "by": by or _who(),
                          "at": time.time()})

    def unreject(self, version: int, scope: str) -> bool:
        """Drop ``version``'s rejection in ``scope``; True if there was one."""
        path = self._path("rejected", version_dir(version), f"{check_name(scope, 'a rejection scope')}.json")
        if not self.fs.exists(path):
            return False
        self.fs.rm_file(path)
        return True

    def rejections(self) -> dict[int, list[Rejection]]:
        """Every version's rejection records, by version."""
        base = self._path("rejected")
        self.fs.invalidate_cache(base)
        if not self.fs.exists(base):
            return {}
        found: dict[int, list[Rejection]] = {}
        for path in sorted(self.fs.find(base)):
            if not path.endswith(".json"):
                continue
            record = self._read_json(path)
            match = _VERSION_DIR.match(path.rsplit("/", 2)[-2])
            if record is None or match is None:
                continue
            version = int(match.group(1))
            found.setdefault(version, []).append(Rejection(
                version, path.rsplit("/", 1)[-1].removesuffix(".json"), str(record.get("reason", "")),
                str(record.get("by", "")), float(record.get("at", 0.0) or 0.0)))
        return found

    def rejected_for(self, scope: str) -> dict[int, Rejection]:
        """The versions a replica of ``scope`` does not serve, with one reason each."""
        honoured = {REGISTRY, OPERATOR, scope}
        return {v: next(r for r in records if r.scope in honoured)
                for v, records in self.rejections().items() if any(r.scope in honoured for r in records)}

    # -- load attempts -----------------------------------------------------------------------

    def begin_attempt(self, version: int, owner: str, replica: str | None) -> str:
        """Record that ``owner`` (a poller) is loading ``version``; returns the record's path."""
        path = self._path("attempts", version_dir(version), f"{check_name(owner, 'an attempt owner')}.json")
        self._write_json(path, {"version": version, "owner": owner, "replica": replica, "started_at": time.time()})
        return path

    def end_attempt(self, path: str) -> None:
        if self.fs.exists(path):
            self.fs.rm_file(path)

    def attempts(self, version: int) -> list[dict]:
        """The load attempts of ``version`` not ended: running, or whose replica died."""
        base = self._path("attempts", version_dir(version))
        self.fs.invalidate_cache(base)
        if not self.fs.exists(base):
            return []
        records = (self._read_json(p) for p in sorted(self.fs.find(base)) if p.endswith(".json"))
        return [r for r in records if r is not None]

    # -- replicas ----------------------------------------------------------------------------

    def report(self, replica: str, record: dict) -> None:
        """Publish what ``replica`` serves (serving/poller.py refreshes it every poll interval)."""
        self._write_json(self._path("replicas", f"{check_name(replica, 'a replica id')}.json"),
                         {**record, "replica": replica, "reported_at": time.time()})

    def forget(self, replica: str) -> None:
        path = self._path("replicas", f"{check_name(replica, 'a replica id')}.json")
        if self.fs.exists(path):
            self.fs.rm_file(path)

    def replicas(self) -> list[dict]:
        """Every replica's last report (``reported_at``: unix time), oldest report first."""
        base = self._path("replicas")
        self.fs.invalidate_cache(base)
        if not self.fs.exists(base):
            return []
        records = (self._read_json(p) for p in self.fs.ls(base, detail=False) if p.endswith(".json"))
        return sorted((r for r in records if r is not None), key=lambda r: r.get("reported_at", 0))


def _s3_error_code(error: OSError) -> str | None:
    """The S3 error code behind an s3fs ``OSError`` (its cause is botocore's ``ClientError``)."""
    cause = error.__cause__
    response = getattr(cause, "response", None)
    if not isinstance(response, dict):
        return None
    return str(response.get("Error", {}).get("Code") or response.get("ResponseMetadata", {}).get("HTTPStatusCode"))
