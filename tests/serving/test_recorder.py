"""The traffic recorder (serving/recorder.py): records land in whole, time-ordered shards under
``<uri>/<replica_id>/``, a full queue or a failing store drops and counts records without
raising, sampling is seeded; and capture/data.py reads the shards back (``records:URI``)."""

import json
import threading
import time
from pathlib import Path

import pytest

from specray.capture.data import list_record_shards, load_conversations, read_record_shards, record_conversations
from specray.serving.recorder import RecordSettings, ShardWriter, TrafficRecorder, chat_record, completion_record


def _fields(i: int) -> dict:
    return {"id": f"chatcmpl-{i}", "created": 1000 + i, "model": "debug", "drafter_version": None,
            "temperature": 0.0, "top_p": 1.0, "max_tokens": 8, "finish_reason": "stop", "prompt_tokens": 3,
            "completion_tokens": 2}


def _chat(i: int) -> dict:
    return chat_record([{"role": "user", "content": f"question {i}"}], f"answer {i}", **_fields(i))


def _wait(predicate, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


def test_records_are_sharded_in_order_and_read_back(tmp_path):
    settings = RecordSettings(uri=str(tmp_path / "traffic"), records_per_shard=2, flush_interval_s=60)
    recorder = TrafficRecorder(settings, replica_id="replica/1").start()
    for i in range(5):
        assert recorder.offer(_chat(i))
    _wait(lambda: recorder.stats()["shards_written"] == 2)  # 2 full shards; the fifth waits for close
    recorder.close()
    stats = recorder.stats()
    assert (stats["recorded"], stats["shards_written"], stats["dropped"], stats["write_errors"]) == (5, 3, 0, 0)
    shards = list_record_shards(str(tmp_path / "traffic"))
    assert [Path(s).parent.name for s in shards] == ["replica_1"] * 3  # the id made a safe directory name
    assert shards == sorted(shards) and all(Path(s).suffix == ".jsonl" for s in shards)
    assert [len(Path(s).read_text().splitlines()) for s in shards] == [2, 2, 1]
    records = list(read_record_shards(shards))
    assert [r["id"] for r in records] == [f"chatcmpl-{i}" for i in range(5)]
    assert records[0]["messages"] == [{"role": "user", "content": "question 0"},
                                      {"role": "assistant", "content": "answer 0"}]
    assert records[0]["endpoint"] == "chat" and records[0]["finish_reason"] == "stop"
    conversations = list(load_conversations(f"records:{tmp_path / 'traffic'}"))
    assert [c.messages for c in conversations[:1]] == [(("user", "question 0"), ("assistant", "answer 0"))]
    assert list(record_conversations(shards[1:2])) == conversations[2:4]  # a given subset of shards only


def test_flush_interval_writes_a_partial_shard(tmp_path):
    recorder = TrafficRecorder(RecordSettings(uri=str(tmp_path), flush_interval_s=0.2), replica_id="r").start()
    recorder.offer(_chat(0))
    _wait(lambda: recorder.stats()["recorded"] == 1)
    assert len(list_record_shards(str(tmp_path))) == 1
    recorder.close()


def test_shards_across_replicas_sort_by_creation_time_and_skip_temporaries(tmp_path):
    for replica, name in [("b", "0000000000002-000000-x.jsonl"), ("a", "0000000000003-000000-y.jsonl"),
                          ("a", "0000000000001-000000-y.jsonl")]:
        (tmp_path / replica).mkdir(exist_ok=True)
        (tmp_path / replica / name).write_text(json.dumps(_chat(0)) + "\n")
    (tmp_path / "a" / ".0000000000000-000001-y.jsonl.tmp").write_text("partial")
    shards = list_record_shards(str(tmp_path))
    assert [Path(s).name[:13] for s in shards] == ["0000000000001", "0000000000002", "0000000000003"]
    assert list_record_shards(str(tmp_path / "missing")) == []


def test_a_malformed_line_names_the_shard_and_line(tmp_path):
    (tmp_path / "r").mkdir()
    shard = tmp_path / "r" / "0000000000001-000000-t.jsonl"
    shard.write_text(json.dumps(_chat(0)) + "\n{not json\n")
    with pytest.raises(ValueError, match=rf"{shard}, line 2: not valid JSON"):
        list(read_record_shards([str(shard)]))
    shard.write_text(json.dumps({"id": "x"}) + "\n")
    with pytest.raises(ValueError, match="line 1: not a served-traffic record"):
        list(read_record_shards([str(shard)]))


def test_completion_records_are_not_conversations(tmp_path):
    recorder = TrafficRecorder(RecordSettings(uri=str(tmp_path)), replica_id="r").start()
    recorder.offer(completion_record("Once upon", " a time", **_fields(0) | {"id": "cmpl-0"}))
    recorder.offer(_chat(1))
    recorder.close()
    shards = list_record_shards(str(tmp_path))
    assert [r["endpoint"] for r in read_record_shards(shards)] == ["completions", "chat"]
    assert next(read_record_shards(shards))["prompt"] == "Once upon"
    assert [c.id for c in record_conversations(shards)] == ["chatcmpl-1"]


class _BlockedWriter:
    """A writer whose first write waits for ``release``: the queue fills behind it."""

    def __init__(self):
        self.release, self.started, self.shards = threading.Event(), threading.Event(), []

    def write(self, lines):
        self.started.set()
        self.release.wait(10)
        self.shards.append(lines)


def test_a_full_queue_drops_and_counts_without_blocking(tmp_path):
    writer = _BlockedWriter()
    settings = RecordSettings(uri=str(tmp_path), max_queue=2, records_per_shard=1)
    recorder = TrafficRecorder(settings, replica_id="r", writer=writer).start()
    recorder.offer(_chat(0))
    assert writer.started.wait(10)  # the writer holds record 0; the queue holds 2 more
    start = time.monotonic()
    taken = [recorder.offer(_chat(i)) for i in range(1, 6)]
    assert time.monotonic() - start < 1.0
    assert taken == [True, True, False, False, False] and recorder.stats()["dropped"] == 3
    writer.release.set()
    recorder.close()
    assert recorder.stats()["recorded"] == 3 and len(writer.shards) == 3


class _FailingWriter:
    def write(self, lines):
        raise OSError("the store is down")


def test_a_failing_store_counts_write_errors_and_never_raises(tmp_path):
    recorder = TrafficRecorder(RecordSettings(uri=str(tmp_path), records_per_shard=2), replica_id="r",
                               writer=_FailingWriter()).start()
    for i in range(4):
        recorder.offer(_chat(i))  # never raises into the caller
    recorder.close()
    stats = recorder.stats()
    assert (stats["recorded"], stats["dropped"], stats["write_errors"]) == (0, 4, 2)
    assert "the store is down" in stats["last_error"]


def test_local_shards_are_written_whole_through_a_temporary(tmp_path, monkeypatch):
    import specray.serving.recorder as recorder_module

    seen = []
    real_replace = recorder_module.os.replace

    def replace(src, dst):
        seen.append((Path(src).name, sorted(p.name for p in Path(dst).parent.iterdir())))
        real_replace(src, dst)

    monkeypatch.setattr(recorder_module.os, "replace", replace)
    path = ShardWriter(str(tmp_path), "r").write([json.dumps(_chat(0))])
    (tmp_name, before), = seen
    assert tmp_name.startswith(".") and before == [tmp_name]  # only the hidden temporary existed
    assert Path(path).read_text() == json.dumps(_chat(0)) + "\n"
    assert list_record_shards(str(tmp_path)) == [path]


def test_sampling_is_seeded(tmp_path):
    def taken(seed: int) -> list[bool]:
        recorder = TrafficRecorder(RecordSettings(uri=str(tmp_path), sample_rate=0.5, seed=seed), replica_id="r")
        return [recorder.offer(_chat(i)) for i in range(200)]

    first = taken(0)
    assert first == taken(0) and first != taken(1)
    assert 60 < sum(first) < 140
    none = TrafficRecorder(RecordSettings(uri=str(tmp_path), sample_rate=0.0), replica_id="r")
    assert not any(none.offer(_chat(i)) for i in range(20)) and none.stats()["offered"] == 20


def test_settings_refuse_an_unknown_scheme():
    with pytest.raises(ValueError, match="record URI 'gs://b/p'"):
        RecordSettings(uri="gs://b/p")
    with pytest.raises(ValueError, match="needs record.uri"):
        TrafficRecorder(RecordSettings(), replica_id="r")


@pytest.mark.s3
def test_shards_on_s3(seaweedfs):
    uri = seaweedfs.uri("traffic")
    recorder = TrafficRecorder(RecordSettings(uri=uri, endpoint_url=seaweedfs.endpoint, records_per_shard=2),
                               replica_id="r").start()
    for i in range(3):
        recorder.offer(_chat(i))
    recorder.close()
    assert recorder.stats()["write_errors"] == 0, recorder.stats()["last_error"]
    shards = list_record_shards(uri, endpoint_url=seaweedfs.endpoint)
    assert len(shards) == 2 and all(s.startswith(f"{uri}/r/") for s in shards)
    assert [c.id for c in load_conversations(f"records:{uri}")] == [f"chatcmpl-{i}" for i in range(3)]
    import s3fs

    other_process = s3fs.S3FileSystem(client_kwargs={"endpoint_url": seaweedfs.endpoint}, skip_instance_cache=True)
    shard = f"{uri.removeprefix('s3://')}/s/9999999999999-000000-t.jsonl"
    other_process.pipe_file(shard, json.dumps(_chat(3)).encode())
    again = list_record_shards(uri, endpoint_url=seaweedfs.endpoint)  # a poller sees new shards, not a cached listing
    assert again[:2] == shards and len(again) == 3 and "/s/" in again[2]
