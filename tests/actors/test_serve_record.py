"""Ray Serve replicas with ``record.uri``: through the real ``openai`` client, each finished request
becomes one record under ``<uri>/<replica id>/``, the replica's /metrics counts it, and the records
still buffered when the application is deleted are written on the replica's shutdown."""

import json
import urllib.request

import openai
import pytest
from ports import free_port

from specray.capture.data import list_record_shards, read_record_shards
from specray.pipeline.config import ServeJobConfig, load_config

pytestmark = pytest.mark.ray

KEY = "sk-record-test"


def _metrics(url: str) -> dict:
    request = urllib.request.Request(f"{url}/metrics", headers={"Authorization": f"Bearer {KEY}"})
    with urllib.request.urlopen(request, timeout=10) as response:
        return json.loads(response.read())


def test_a_replica_records_each_finished_request(ray_cluster, tmp_path):
    from ray import serve

    from specray.actors.serve import start_serving

    records = tmp_path / "records"
    cfg = load_config(ServeJobConfig, "manifests/serve.yaml", [
        "name=specray-record-test", "target.name=debug", "registry.uri=null", f"http.port={free_port()}",
        f"http.api_key={KEY}", "engine.max_len=256", "engine.num_threads=1", "autoscaling.max_replicas=1",
        f"output.run_dir={tmp_path}", f"record.uri={records}", "record.flush_interval_s=600",
    ])
    handle = start_serving(cfg, timeout_s=300)
    try:
        client = openai.OpenAI(base_url=handle.base_url, api_key=KEY, timeout=120, max_retries=0)
        messages = [{"role": "user", "content": "Hi"}]
        chat = client.chat.completions.create(model=handle.model, messages=messages, temperature=0, max_tokens=6)
        stream = client.chat.completions.create(model=handle.model, messages=messages, temperature=0, max_tokens=6,
                                                stream=True)
        streamed = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
        client.completions.create(model=handle.model, prompt="Once upon", temperature=0, max_tokens=4)
        with pytest.raises(openai.BadRequestError):
            client.completions.create(model=handle.model, prompt="x", max_tokens=10_000)
        recording = _metrics(handle.url)["recording"]
        assert (recording["offered"], recording["dropped"], recording["write_errors"]) == (3, 0, 0)
        assert list_record_shards(str(records)) == []  # buffered: neither 256 records nor 600 s yet
    finally:
        handle.stop()  # the replica's shutdown writes its buffer
        serve.shutdown()
    shards = list_record_shards(str(records))
    assert len(shards) == 1
    chats = [r for r in read_record_shards(shards) if r["endpoint"] == "chat"]
    assert [r["messages"][-1]["content"] for r in chats] == [chat.choices[0].message.content, streamed]
    assert chats[0]["id"] == chat.id and chats[0]["messages"][:-1] == messages
