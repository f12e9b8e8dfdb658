"""Recording served traffic: each finished request's prompt and answer, as JSONL shards in a store.

    recorder = TrafficRecorder(RecordSettings(uri="s3://bucket/traffic"), replica_id="r1").start()
    recorder.offer(chat_record(...))      # in the request path: never blocks, never raises
    recorder.close()                      # on shutdown: writes what is buffered

Off unless ``RecordSettings.uri`` is set (the serve manifest's ``record`` section). What is
stored are users' prompts and the answers served to them: treat the store as user data.

Layout (``capture/data.py``'s ``list_record_shards`` / ``read_record_shards`` read it)::

    <uri>/<replica_id>/<unix_ms:013d>-<seq:06d>-<token>.jsonl

``unix_ms`` is the shard's write time, ``seq`` counts this recorder's shards and ``token`` is
random per recorder, so names sort by creation time and never collide. A shard is written once
and never modified: locally through a hidden temporary file and ``os.replace``, on S3 as one put,
so a partial shard is never visible. One record per line (``chat_record`` /
``completion_record``).

The request path only puts the record on a bounded queue (``offer``); a background thread
drains it into a buffer written as a shard every ``records_per_shard`` records, every
``flush_interval_s`` seconds, and on ``close``. A full queue or a failed write drops the records
and counts them (``stats``: ``recorded``, ``dropped``, ``shards_written``, ``write_errors``).
For a greedy request the answer is the target's own output (verification is lossless): the
records are self-distillation data without a regeneration pass.
"""

from __future__ import annotations

import json
import os
import queue
import random
import re
import threading
import time
import uuid
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, field_validator

from specray.capture.store import open_fs

FINISHED = ("stop", "length")  # finish reasons of requests worth recording; aborts and errors are not


class RecordSettings(BaseModel):
    """The ``record`` section of a serve config: where and how much served traffic is recorded."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    uri: str | None = Field(None, description="store for the records: a path, file://… or s3://bucket/prefix "
                                              "(None = recording off; nothing is written)")
    endpoint_url: str | None = Field(None, description="S3 endpoint for an s3:// uri (else $SPECRAY_S3_ENDPOINT)")
    sample_rate: float = Field(1.0, ge=0, le=1, description="fraction of finished requests recorded (seeded draw)")
    seed: int = Field(0, description="seeds the sampling draw (with the replica id)")
    records_per_shard: int = Field(256, gt=0, description="a shard is written once it holds this many records")
    flush_interval_s: float = Field(60.0, gt=0, description="a shard is written when its oldest record is this old")
    max_queue: int = Field(1024, gt=0, description="records waiting for the writer at most; more are dropped")

    @field_validator("uri")
    @classmethod
    def _known_scheme(cls, value: str | None) -> str | None:
        if value is not None and "://" in value and not value.startswith(("file://", "s3://")):
            raise ValueError(f"record URI {value!r}: use a path, file://PATH or s3://BUCKET/PREFIX")
        return value

    @property
    def enabled(self) -> bool:
        return self.uri is not None


def _base(*, id: str, created: int, endpoint: str, model: str, drafter_version: int | None, temperature: float,
          top_p: float, max_tokens: int, finish_reason: str, prompt_tokens: int, completion_tokens: int) -> dict:
    return {"id": id, "created": created, "endpoint": endpoint, "model": model, "drafter_version": drafter_version,
            "temperature": temperature, "top_p": top_p, "max_tokens": max_tokens, "finish_reason": finish_reason,
            "prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens}


def chat_record(messages: list[dict], answer: str, **fields) -> dict:
    """A chat request's record: ``fields`` of ``_base`` and the conversation with the answer appended."""
    return _base(endpoint="chat", **fields) | {"messages": [*messages, {"role": "assistant", "content": answer}]}


def completion_record(prompt: str, completion: str, **fields) -> dict:
    """A completions request's record: ``fields`` of ``_base``, the prompt text and the completion."""
    return _base(endpoint="completions", **fields) | {"prompt": prompt, "completion": completion}


def _safe_name(replica_id: str) -> str:
    """The replica id as a directory name: letters, digits, ``_ . -`` kept, anything else ``_``."""
    return re.sub(r"[^A-Za-z0-9_.-]", "_", replica_id).strip(".") or "replica"


class ShardWriter:
    """Writes whole shards under ``<uri>/<replica_id>/`` (local: temp file + ``os.replace``; S3: one put)."""

    def __init__(self, uri: str, replica_id: str, *, endpoint_url: str | None = None):
        self.fs, root, self.protocol = open_fs(uri, endpoint_url=endpoint_url)
        self.dir = f"{root.rstrip('/')}/{_safe_name(replica_id)}"
        self.token = uuid.uuid4().hex[:8]
        self.seq = 0

    def write(self, lines: list[str]) -> str:
        """Write one shard of ``lines`` (JSON, no newline); return its path."""
        name = f"{int(time.time() * 1000):013d}-{self.seq:06d}-{self.token}.jsonl"
        self.seq += 1
        data = "".join(line + "\n" for line in lines).encode()
        path = f"{self.dir}/{name}"
        if self.protocol == "file":
            Path(self.dir).mkdir(parents=True, exist_ok=True)
            tmp = Path(self.dir) / f".{name}.tmp"
            with open(tmp, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        else:
            self.fs.pipe_file(path, data)  # one put: the object appears whole or not at all
        return path


class TrafficRecorder:
    """A bounded queue of records and the thread that writes them as shards (see the module docstring)."""

    def __init__(self, settings: RecordSettings, replica_id: str, *, writer: ShardWriter | None = None):
        if not settings.enabled:
            raise ValueError("TrafficRecorder needs record.uri; without it recording is off")
        self.settings = settings
        self.writer = writer or ShardWriter(settings.uri, replica_id, endpoint_url=settings.endpoint_url)
        self._queue: queue.Queue[dict] = queue.Queue(settings.max_queue)
        self._draw = random.Random(f"{settings.seed}:{replica_id}")
        self._lock = threading.Lock()
        self._counts = {"offered": 0, "recorded": 0, "dropped": 0, "shards_written": 0, "write_errors": 0}
        self.last_error: str | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> TrafficRecorder:
        self._thread = threading.Thread(target=self._run, daemon=True, name="specray-traffic-recorder")
        self._thread.start()
        return self

    def offer(self, record: dict) -> bool:
        """Queue ``record`` if the sampling draw takes it; False when not taken or dropped. Never blocks."""
        with self._lock:
            self._counts["offered"] += 1
            if self._draw.random() >= self.settings.sample_rate:
                return False
        try:
            self._queue.put_nowait(record)
            return True
        except queue.Full:
            self._count("dropped", 1)
            return False

    def _count(self, key: str, n: int) -> None:
        with self._lock:
            self._counts[key] += n

    def stats(self) -> dict:
        """``recorded``: records in written shards; ``dropped``: lost to a full queue or a failed
        write; ``shards_written``; ``write_errors`` (failed shard writes, the last in ``last_error``);
        ``pending``: queued for the writer; ``offered``: finished requests seen."""
        with self._lock:
            return {"uri": self.settings.uri, "sample_rate": self.settings.sample_rate, **self._counts,
                    "pending": self._queue.qsize(), "last_error": self.last_error}

    def _run(self) -> None:
        buffer: list[str] = []
        oldest = 0.0  # monotonic time the buffer's first record arrived
        while not self._stop.is_set() or not self._queue.empty():
            wait = self.settings.flush_interval_s - (time.monotonic() - oldest) if buffer else 0.5
            try:
                record = self._queue.get(timeout=max(0.01, min(wait, 0.5)))
                if not buffer:
                    oldest = time.monotonic()
                buffer.append(json.dumps(record, ensure_ascii=False))
            except queue.Empty:
                pass
            full = len(buffer) >= self.settings.records_per_shard
            if buffer and (full or time.monotonic() - oldest >= self.settings.flush_interval_s):
                self._write(buffer)
                buffer = []
        if buffer:
            self._write(buffer)

    def _write(self, lines: list[str]) -> None:
        try:
            self.writer.write(lines)
        except Exception as e:  # noqa: BLE001 - a store failure must never reach requests: counted, reported
            self.last_error = f"{type(e).__name__}: {e}"
            self._count("write_errors", 1)
            self._count("dropped", len(lines))
            return
        self._count("shards_written", 1)
        self._count("recorded", len(lines))

    def close(self, timeout: float = 30.0) -> None:
        """Write everything queued and buffered, then stop the thread (within ``timeout`` seconds)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)
