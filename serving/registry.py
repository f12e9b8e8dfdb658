"""Versioned drafter exports on any fsspec store, and the poller that hot-loads new ones.

    registry = DrafterRegistry("s3://bucket/drafters", endpoint_url="http://127.0.0.1:8333")
    version = registry.publish("runs/train-dflash/exports/step-00002000")    # 1, 2, 3, …
    local_dir = registry.pull(registry.latest(), cache_dir="/tmp/specray-drafters")

Layout: ``<uri>/v000001/`` holds a copy of one export directory (``drafters/format.py``) and a
``COMPLETE`` marker. The marker is written last, after every file, and only versions that have
it are listed, so a reader never sees a version half-copied; a publish that crashed leaves a
directory without a marker that is never listed and whose number is never reused. Versions
are monotonic: the next one is one more than the highest directory present. The registry
assumes one publisher at a time (the trainer or the pipeline driver that exports).

A version holds the export files and nothing else (``EXPORT_FILES``, the names
``drafters/format.py`` writes). ``pull`` trusts no name it reads from the registry: a marker
listing anything else (``../x``, an absolute path, a sub-directory, an unknown file) or a file
that is not a regular file (a symlink on a ``file://`` registry) rejects the whole version
(``RejectedVersionError``) before anything is written, and the poller reports it and never
retries it. The export's content is not validated here: an export for another target, or with
corrupt weights, publishes fine and is refused where it is loaded (``load_drafter`` checks
fingerprints, contract and sha256), so replicas keep serving the version they have.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import tempfile
import threading
import time
from pathlib import Path

from specray.capture.store import open_fs

log = logging.getLogger(__name__)

MARKER = "COMPLETE"
# drafters/format.py's export directory (its model card included), and the files `specray calibrate`
# (DSpark) and `specray evaluate` may add
EXPORT_FILES = ("config.json", "export.json", "model.safetensors", "README.md", "calibration.json", "evaluation.json")
_VERSION_DIR = re.compile(r"^v(\d{6,})$")


def version_dir(version: int) -> str:
    return f"v{version:06d}"


class RejectedVersionError(ValueError):
    """A version whose completion marker or files cannot be pulled safely; it is never pulled."""


class DrafterRegistry:
    """``publish / versions / latest / pull`` of drafter exports under one root URI."""

    def __init__(self, uri: str, endpoint_url: str | None = None):
        self.uri = uri
        self.fs, root, self.protocol = open_fs(uri, endpoint_url=endpoint_url)
        self.root = root.rstrip("/")

    def __repr__(self) -> str:
        return f"DrafterRegistry({self.uri!r})"

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

    def publish(self, export_dir: str | Path) -> int:
        """Copy an export directory in as the next version; returns its number."""
        source = Path(export_dir)
        files = sorted(source.iterdir()) if source.is_dir() else []
        if not files:
            raise FileNotFoundError(f"{source} is not a directory with files; publish an export dir (specray export)")
        foreign = [p.name for p in files if p.name not in EXPORT_FILES or p.is_symlink() or not p.is_file()]
        if foreign:
            raise ValueError(f"{source} holds {foreign}, which a version cannot carry: an export directory holds "
                             f"regular files named {', '.join(EXPORT_FILES)} only (specray export writes them)")
        version = max(self._numbers(), default=0) + 1
        target = f"{self.root}/{version_dir(version)}"
        self.fs.makedirs(target, exist_ok=True)
        for path in files:
            self.fs.put_file(str(path), f"{target}/{path.name}")
        marker = {"version": version, "source": str(source.resolve()), "published_at": time.time(),
                  "files": {p.name: p.stat().st_size for p in files}}
        self.fs.pipe_file(f"{target}/{MARKER}", json.dumps(marker, indent=2).encode())  # last: the version is visible
        return version

    def pull(self, version: int, cache_dir: str | Path) -> Path:
        """A local copy of ``version`` under ``cache_dir`` (reused when already pulled)."""
        local = Path(cache_dir) / version_dir(version)
        if (local / MARKER).is_file():
            return local
        source = f"{self.root}/{version_dir(version)}"
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


class RegistryPoller:
    """Every ``interval_s``, hand the newest usable version to ``engine.load_drafter`` (which
    validates it in the background and switches between steps). The versions published since the
    last poll are tried newest first: a version the registry refuses to pull or the engine rejects
    is recorded in ``last_error``, never retried, and the next older one is tried — so a replica
    that starts after a bad publish serves the newest good version, as the replicas that were
    already running do. A registry that cannot be read is retried at the next poll."""

    def __init__(self, registry: DrafterRegistry, engine, *, cache_dir: str | Path, interval_s: float = 10.0,
                 load_timeout_s: float = 600.0):
        if interval_s <= 0:
            raise ValueError(f"interval_s must be > 0, got {interval_s}")
        self.registry, self.engine = registry, engine
        self.cache_dir = Path(cache_dir)
        self.interval_s, self.load_timeout_s = interval_s, load_timeout_s
        self.seen: int = 0  # highest version considered (loaded, rejected, or passed over for a newer one)
        self.last_error: str | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def poll(self) -> int | None:
        """One check; blocks until a new version is ready in the engine. Returns the version that
        was loaded, or None (nothing new, or every new version was rejected)."""
        new = [v for v in self.registry.versions() if v > self.seen]
        if not new:
            return None
        self.seen = new[-1]
        errors = []
        for version in reversed(new):
            error = self._try(version)
            if error is None:
                self.last_error = "; ".join(errors) or None
                return version
            errors.append(f"version {version} rejected: {error}")
            log.warning("%s", errors[-1])
        self.last_error = "; ".join(errors)
        return None

    def _try(self, version: int) -> BaseException | None:
        """Pull ``version`` and load it into the engine; the error that refused it, or None."""
        try:
            local = self.registry.pull(version, self.cache_dir)
        except RejectedVersionError as e:
            return e
        return self.engine.load_drafter(str(local), version).exception(timeout=self.load_timeout_s)

    def start(self) -> RegistryPoller:
        self._thread = threading.Thread(target=self._run, daemon=True, name="specray-registry-poller")
        self._thread.start()
        return self

    def stop(self, timeout: float = 30.0) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)

    def _run(self) -> None:
        while True:  # the first poll at once: a new replica starts on the newest version
            try:
                self.poll()
            except Exception as e:  # noqa: BLE001 - a registry outage must not end hot-loading; retried next poll
                self.last_error = f"{type(e).__name__}: {e}"
                log.warning("polling %s failed: %s", self.registry.uri, self.last_error)
            if self._stop.wait(self.interval_s):
                return
