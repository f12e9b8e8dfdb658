"""The OpenAI-compatible app through FastAPI's TestClient (no Ray), on both backends
(tests/serving/backends.py): answers match our engine, streams add up, bad requests are 400s that
name the field, a wrong key is a 401, and the engine keeps serving after each of them."""

import json

import pytest
from fastapi.testclient import TestClient

from backends import BACKENDS, serving
from specray.serving.openai_api import create_app
from specray.serving.sampling import SamplingParams

KEY = "sk-test-key"
AUTH = {"Authorization": f"Bearer {KEY}"}


@pytest.fixture(scope="module", params=BACKENDS)
def served(request):
    """(our engine on the served target, a client of the app)."""
    engine = serving(request.param, request, max_batch=2, max_len=256).start()
    with TestClient(create_app(engine.engine, model_name="debug", api_key=KEY)) as client:
        yield engine.reference, client
    engine.stop()


def _events(response) -> list:
    lines = [line for line in response.iter_lines() if line]
    assert all(line.startswith("data: ") for line in lines) and lines[-1] == "data: [DONE]"
    return [json.loads(line.removeprefix("data: ")) for line in lines[:-1]]


def test_completions_match_the_engine(served):
    engine, client = served
    expected = engine.generate([engine.tokenize("Once upon a time")], SamplingParams(max_tokens=6, ignore_eos=True))[0]
    body = {"model": "debug", "prompt": "Once upon a time", "max_tokens": 6, "temperature": 0, "ignore_eos": True}
    r = client.post("/v1/completions", json=body, headers=AUTH)
    assert r.status_code == 200, r.text
    out = r.json()
    assert out["object"] == "text_completion" and out["system_fingerprint"] == "specray-ar"
    assert out["choices"][0]["text"] == expected.text and out["choices"][0]["finish_reason"] == "length"
    assert out["usage"]["completion_tokens"] == 6 and out["usage"]["prompt_tokens"] == len(expected.prompt_ids)
    by_ids = client.post("/v1/completions", json=body | {"prompt": expected.prompt_ids}, headers=AUTH).json()
    assert by_ids["choices"][0]["text"] == expected.text
    with client.stream("POST", "/v1/completions", json=body | {"stream": True}, headers=AUTH) as r:
        chunks = _events(r)
    assert "".join(c["choices"][0]["text"] for c in chunks) == expected.text
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"


def test_chat_and_streaming_chat(served):
    _, client = served
    body = {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}],
            "max_completion_tokens": 12, "temperature": 0}
    r = client.post("/v1/chat/completions", json=body, headers=AUTH)
    assert r.status_code == 200, r.text
    message, finish = r.json()["choices"][0]["message"], r.json()["choices"][0]["finish_reason"]
    assert r.json()["object"] == "chat.completion" and message["role"] == "assistant"
    with client.stream("POST", "/v1/chat/completions", headers=AUTH,
                       json=body | {"stream": True, "stream_options": {"include_usage": True}}) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        chunks = _events(r)
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks[:-1]) == message["content"]
    assert chunks[-2]["choices"][0] == {"index": 0, "delta": {}, "finish_reason": finish}
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] >= 1
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)


@pytest.mark.parametrize("path, body, status, param, message", [
    ("/v1/completions", {"prompt": "x", "temperature": -1}, 400, "temperature", "greater than or equal to 0"),
    ("/v1/completions", {"prompt": "x", "top_p": 1.5}, 400, "top_p", "less than or equal to 1"),
    ("/v1/completions", {"prompt": "x", "top_p": 0}, 400, "top_p", "greater than 0"),
    ("/v1/completions", {"prompt": ""}, 400, "prompt", "prompt: the prompt is empty"),
    ("/v1/completions", {"prompt": "x", "max_tokens": 1000}, 400, None, "does not fit the engine's context of 256"),
    ("/v1/completions", {"prompt": [10**6]}, 400, None, "outside the vocabulary"),
    ("/v1/completions", {"prompt": "x", "stop": [""]}, 400, None, "stop strings must be non-empty"),
    ("/v1/completions", {"prompt": "x", "logprobz": 2}, 400, "logprobz", "logprobz: unknown field"),
    ("/v1/completions", {"prompt": "x", "frequency_penalty": 0.5}, 400, "frequency_penalty",
     "frequency_penalty: not implemented by this server, which accepts only 0"),
    ("/v1/completions", {"temperature": 0}, 400, "prompt", "prompt: required"),
    ("/v1/completions", {"prompt": "x", "model": "gpt-4"}, 404, "model", "'gpt-4' is not served here"),
    ("/v1/chat/completions", {"messages": []}, 400, "messages", "at least 1 item"),
    ("/v1/chat/completions", {"messages": [{"role": "robot", "content": "x"}]}, 400, "messages", "messages.0.role"),
])
def test_bad_requests_are_openai_errors(served, path, body, status, param, message):
    _, client = served
    r = client.post(path, json=body, headers=AUTH)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert error["param"] == param and message in error["message"] and error["type"] == "invalid_request_error"
    ok = client.post("/v1/completions", json={"prompt": "x", "max_tokens": 2}, headers=AUTH)
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] >= 1  # still serving


def test_malformed_json_is_a_400(served):
    _, client = served
    r = client.post("/v1/completions", content=b"{not json", headers=AUTH | {"Content-Type": "application/json"})
    assert r.status_code == 400 and "JSON" in r.json()["error"]["message"]


def test_api_key(served):
    _, client = served
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}):
        r = client.post("/v1/completions", json={"prompt": "x", "max_tokens": 1}, headers=headers)
        assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
        assert "Authorization: Bearer" in r.json()["error"]["message"]
    assert client.get("/v1/models").status_code == 401 and client.get("/metrics").status_code == 401
    assert client.get("/health").json()["status"] == "ok"  # probes need no key


def test_models_and_metrics(served):
    _, client = served
    assert [m["id"] for m in client.get("/v1/models", headers=AUTH).json()["data"]] == ["debug"]
    client.post("/v1/completions", json={"prompt": "x", "max_tokens": 3}, headers=AUTH)
    stats = client.get("/metrics", headers=AUTH).json()
    assert stats["model"] == "debug" and stats["active_version"] is None and stats["algorithm"] == "ar"
    assert stats["requests_served"] >= 1 and stats["tokens_per_second"] > 0 and stats["tau"] == 1.0
    text = client.get("/metrics?format=prometheus", headers=AUTH).text
    assert 'specray_tokens_per_second{model="debug"}' in text and "# TYPE specray_requests_served_total counter" in text
    bad = client.get("/metrics?format=xml", headers=AUTH)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "format"
