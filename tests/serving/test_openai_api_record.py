"""Recording through the OpenAI app (debug-target engine, TestClient, no Ray): one record per
request that finished normally, streamed or not, holding the prompt and exactly the answer the
client got; refused requests and a failing store write no record and fail no request; without a
recorder nothing is written; /metrics shows the counters."""

import json

import pytest
from fastapi.testclient import TestClient

from specray.capture.data import list_record_shards, load_conversations, read_record_shards
from specray.serving.engine import Engine, EngineLoop
from specray.serving.openai_api import create_app
from specray.serving.recorder import RecordSettings, TrafficRecorder


@pytest.fixture(scope="module")
def engine(debug_target):
    engine = Engine(debug_target, None, max_batch=2, max_len=256)
    loop = EngineLoop(engine).start()
    yield engine
    loop.stop()


KEY = "sk-test-key"
CHAT = {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}],
        "max_tokens": 8, "temperature": 0}


def _client(engine, recorder: TrafficRecorder | None) -> TestClient:
    app = create_app(engine, model_name="debug", api_key=KEY, recorder=recorder)
    return TestClient(app, headers={"Authorization": f"Bearer {KEY}"})


def _stream_text(client, path: str, body: dict, key: str) -> str:
    with client.stream("POST", path, json=body | {"stream": True}) as r:
        lines = [line.removeprefix("data: ") for line in r.iter_lines() if line]
    chunks = [json.loads(line) for line in lines[:-1]]
    return "".join(c["choices"][0]["delta"].get("content", "") if key == "chat" else c["choices"][0]["text"]
                   for c in chunks)


def test_each_finished_request_is_recorded_once(engine, tmp_path):
    uri = str(tmp_path / "traffic")
    recorder = TrafficRecorder(RecordSettings(uri=uri, records_per_shard=100), replica_id="replica-0").start()
    with _client(engine, recorder) as client:
        chat = client.post("/v1/chat/completions", json=CHAT).json()
        streamed = _stream_text(client, "/v1/chat/completions", CHAT | {"temperature": 0.7, "seed": 3}, "chat")
        completion = client.post("/v1/completions", json={"prompt": "Once upon", "max_tokens": 5, "temperature": 0,
                                                          "ignore_eos": True}).json()
        assert client.post("/v1/completions", json={"prompt": "x", "max_tokens": 1000}).status_code == 400
        recorder.close()
        metrics = client.get("/metrics").json()["recording"]
        prometheus = client.get("/metrics?format=prometheus").text
    assert (metrics["recorded"], metrics["dropped"], metrics["shards_written"], metrics["write_errors"]) == (3, 0, 1, 0)
    assert 'specray_records_written_total{model="debug"} 3' in prometheus
    assert 'specray_records_dropped_total{model="debug"} 0' in prometheus
    records = list(read_record_shards(list_record_shards(uri)))
    assert [r["endpoint"] for r in records] == ["chat", "chat", "completions"]
    first, second, third = records
    answer = chat["choices"][0]["message"]["content"]
    assert first["id"] == chat["id"] and first["messages"] == CHAT["messages"] + [
        {"role": "assistant", "content": answer}]
    assert (first["temperature"], first["top_p"], first["max_tokens"], first["model"]) == (0.0, 1.0, 8, "debug")
    assert first["finish_reason"] == chat["choices"][0]["finish_reason"]
    assert (first["prompt_tokens"], first["completion_tokens"]) == (chat["usage"]["prompt_tokens"],
                                                                    chat["usage"]["completion_tokens"])
    assert first["drafter_version"] is None
    assert second["messages"][-1] == {"role": "assistant", "content": streamed} and second["temperature"] == 0.7
    assert third["prompt"] == "Once upon" and third["completion"] == completion["choices"][0]["text"]
    assert third["finish_reason"] == "length" and third["completion_tokens"] == 5
    conversations = list(load_conversations(f"records:{uri}"))
    assert [c.id for c in conversations] == [first["id"], second["id"]]


def test_a_failing_store_fails_no_request(engine, tmp_path):
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("a file where the record store should be")
    recorder = TrafficRecorder(RecordSettings(uri=str(blocker), records_per_shard=1), replica_id="r").start()
    with _client(engine, recorder) as client:
        for _ in range(2):
            assert client.post("/v1/chat/completions", json=CHAT).status_code == 200
        recorder.close()
        stats = client.get("/metrics").json()["recording"]
    assert (stats["recorded"], stats["dropped"], stats["write_errors"]) == (0, 2, 2)
    assert stats["last_error"]


def test_recording_off_writes_nothing(engine, tmp_path):
    with _client(engine, None) as client:
        assert client.post("/v1/chat/completions", json=CHAT).status_code == 200
        body = client.get("/metrics").json()
        prometheus = client.get("/metrics?format=prometheus").text
    assert body["recording"] is None and "specray_records" not in prometheus
    assert list(tmp_path.iterdir()) == []
