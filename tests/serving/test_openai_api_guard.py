"""The OpenAI app's guard and request bounds (no Ray): the key is checked before the body is
read, a server without a key answers loopback clients only, bodies and prompts are capped
before any tokenizing, stop strings are bounded, a full wait queue is a 503 to retry, the API
docs are off and /health reveals no paths or errors; the engine keeps serving after each refusal.
Each holds on both backends (tests/serving/backends.py)."""

import asyncio
import json

import pytest
from fastapi.testclient import TestClient

from backends import BACKENDS, serving
from specray.serving.engine import QueueFullError
from specray.serving.openai_api import create_app
from specray.serving.sampling import SamplingParams

KEY = "sk-guard-test"
AUTH = {"Authorization": f"Bearer {KEY}"}
LOOPBACK = ("127.0.0.1", 50000)


class _Spy:
    """The engine, counting the calls that cost time (tokenizing, submitting)."""

    def __init__(self, engine):
        self.engine, self.calls = engine, []

    def tokenize(self, text):
        self.calls.append("tokenize")
        return self.engine.tokenize(text)

    def submit(self, prompt, params):
        self.calls.append("submit")
        return self.engine.submit(prompt, params)

    def stats(self):
        return self.engine.stats()


@pytest.fixture(scope="module", params=BACKENDS)
def engine(request):
    served = serving(request.param, request, max_batch=2, max_len=256).start()
    yield served.engine
    served.stop()


def _app(engine, **kwargs):
    spy = _Spy(engine)
    return spy, create_app(spy, model_name="debug", **kwargs)


def _still_serving(client, headers=AUTH):
    ok = client.post("/v1/completions", json={"prompt": "x", "max_tokens": 2}, headers=headers)
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] >= 1, ok.text


def _asgi(app, path: str, headers: list[tuple[bytes, bytes]], chunks: list[bytes]):
    """One POST straight through the ASGI interface; returns (status, body, body chunks read)."""
    read, sent = [], []

    async def receive():
        if not chunks:  # the client waits for its answer; it disconnects only once it is sent
            await asyncio.Event().wait()
        read.append(chunks.pop(0))
        return {"type": "http.request", "body": read[-1], "more_body": bool(chunks)}

    async def send(message):
        sent.append(message)

    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST", "scheme": "http",
             "path": path, "raw_path": path.encode(), "root_path": "", "query_string": b"",
             "headers": [(b"host", b"testserver"), (b"content-type", b"application/json"), *headers],
             "client": LOOPBACK, "server": ("127.0.0.1", 8000)}
    asyncio.run(app(scope, receive, send))
    status = next(m["status"] for m in sent if m["type"] == "http.response.start")
    body = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")
    return status, json.loads(body), len(read)


# -- item 12: the key, loopback-only without one, the body cap, docs, /health ------------------------


def test_the_key_is_checked_before_the_body_is_read(engine):
    spy, app = _app(engine, api_key=KEY)
    body = json.dumps({"prompt": "x", "max_tokens": 2}).encode()
    for headers in ([], [(b"authorization", b"Bearer wrong")], [(b"authorization", KEY.encode())]):
        status, error, read = _asgi(app, "/v1/completions", headers, [body[:5], body[5:]])
        assert (status, error["error"]["code"], read) == (401, "invalid_api_key", 0)
    status, out, read = _asgi(app, "/v1/completions", [(b"authorization", f"Bearer {KEY}".encode())],
                              [body[:5], body[5:]])
    assert status == 200 and read == 2 and out["usage"]["completion_tokens"] >= 1
    assert spy.calls == ["tokenize", "submit"]


def test_without_a_key_only_loopback_clients_are_served(engine):
    """The Serve-config / RayService path cannot see where Serve's proxy binds (0.0.0.0 there):
    without a key, a request from any other address is refused."""
    spy, app = _app(engine)
    remote = TestClient(app, client=("203.0.113.7", 40000))
    for method, path in (("POST", "/v1/completions"), ("POST", "/v1/chat/completions"), ("GET", "/v1/models"),
                         ("GET", "/metrics")):
        r = remote.request(method, path, json={"prompt": "x", "max_tokens": 2})
        assert r.status_code == 403, (path, r.text)
        assert r.json()["error"]["code"] == "api_key_required" and "http.api_key" in r.json()["error"]["message"]
    assert spy.calls == [] and remote.get("/health").status_code == 200  # probes come from the node
    _still_serving(TestClient(app, client=LOOPBACK), headers={})
    _still_serving(TestClient(app, client=("::1", 40000)), headers={})


def test_the_body_is_capped(engine):
    spy, app = _app(engine, api_key=KEY)
    client = TestClient(app, client=LOOPBACK)
    big = {"prompt": [1] * 600_000, "max_tokens": 2}  # 1.2 MB of JSON: over the 1 MiB default
    r = client.post("/v1/completions", json=big, headers=AUTH)
    assert r.status_code == 413 and "max_body_bytes" in r.json()["error"]["message"], r.text
    assert spy.calls == []
    # without a Content-Length (chunked): refused once the cap is passed, the rest never read
    chunks = [b'{"prompt": [' + b"1," * 200_000] * 8 + [b"1]}"]
    status, error, read = _asgi(app, "/v1/completions", [(b"authorization", f"Bearer {KEY}".encode())], chunks)
    assert (status, error["error"]["code"], read) == (413, "request_too_large", 3)
    _still_serving(client)


def test_the_body_cap_is_configurable(engine):
    from specray.serving.http_guard import HttpLimits

    _, app = _app(engine, api_key=KEY, limits=HttpLimits(max_body_bytes=100))
    client = TestClient(app, client=LOOPBACK)
    assert client.post("/v1/completions", json={"prompt": "x" * 100}, headers=AUTH).status_code == 413
    _still_serving(client)


def test_docs_are_off_unless_configured(engine):
    from specray.serving.http_guard import HttpLimits

    _, app = _app(engine, api_key=KEY)
    client = TestClient(app, client=LOOPBACK)
    for path in ("/docs", "/redoc", "/openapi.json"):
        assert client.get(path, headers=AUTH).status_code == 404, path
    _, app = _app(engine, api_key=KEY, limits=HttpLimits(docs=True))
    client = TestClient(app, client=LOOPBACK)
    assert client.get("/openapi.json").json()["info"]["title"] == "specray" and client.get("/docs").status_code == 200


def test_health_reveals_no_paths_or_errors(engine):
    secret = "version 3 rejected: /home/ops/secrets/registry/v000003/config.json: bad"
    _, app = _app(engine, api_key=KEY, replica_id="r-1", replica_info=lambda: {"registry_error": secret})
    client = TestClient(app, client=LOOPBACK)
    health = client.get("/health")
    assert health.status_code == 200
    assert health.json() == {"status": "ok", "model": "debug", "drafter_version": None, "replica": "r-1"}
    metrics = client.get("/metrics", headers=AUTH).json()  # behind the key, the operator sees why
    assert metrics["registry_error"] == secret and metrics["replica"] == "r-1"


# -- item 13: bounds checked at the HTTP layer, before tokenizing ---------------------------------


def test_a_long_prompt_is_refused_by_its_bytes_before_tokenizing(engine):
    spy, app = _app(engine, api_key=KEY)
    client = TestClient(app, client=LOOPBACK)
    r = client.post("/v1/completions", json={"prompt": "é" * 150_000, "max_tokens": 2}, headers=AUTH)  # 300 kB
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert (error["param"], error["code"]) == ("prompt", "prompt_too_long") and "300000 bytes" in error["message"]
    messages = [{"role": "user", "content": "x" * 200_000}, {"role": "user", "content": "y" * 100_000}]
    r = client.post("/v1/chat/completions", json={"messages": messages}, headers=AUTH)
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages", r.text
    assert spy.calls == []  # neither tokenized nor rendered
    _still_serving(client)


@pytest.mark.parametrize("stop, message", [
    ([f"s{i}" for i in range(17)], "at most 16 stop strings, got 17"),
    ([f"s{i}" for i in range(40_000)], "at most 16 stop strings, got 40000"),
    ("x" * 257, "stop strings are at most 256 characters; stop[0] has 257"),
    (["ok", "y" * 1000], "stop[1] has 1000"),
])
def test_stop_strings_are_bounded(engine, stop, message):
    spy, app = _app(engine, api_key=KEY)
    client = TestClient(app, client=LOOPBACK)
    for path, body in (("/v1/completions", {"prompt": "x"}), ("/v1/chat/completions",
                                                              {"messages": [{"role": "user", "content": "x"}]})):
        r = client.post(path, json=body | {"stop": stop, "max_tokens": 2}, headers=AUTH)
        assert r.status_code == 400, r.text
        assert r.json()["error"]["param"] == "stop" and message in r.json()["error"]["message"]
    assert spy.calls == []
    ok = client.post("/v1/completions", json={"prompt": "x", "max_tokens": 2, "stop": [f"{i:02d}" + "z" * 254
                                                                                       for i in range(16)]},
                     headers=AUTH)
    assert ok.status_code == 200, ok.text


@pytest.mark.parametrize("content, headers, param, message", [
    (b"[1, 2]", {"Content-Type": "application/json"}, None, "the body must be a JSON object"),
    (b'"x"', {"Content-Type": "application/json"}, None, "the body must be a JSON object"),
    (b'{"prompt": "x"}', {"Content-Type": "text/plain"}, None, "Content-Type: application/json"),
    (b'{"prompt": {"a": 1}}', {"Content-Type": "application/json"}, "prompt", "a string or a list of token ids"),
    (b'{"prompt": "x", "max_tokens": "many"}', {"Content-Type": "application/json"}, "max_tokens", "valid integer"),
    (b'{"prompt": "x", "stream": "often"}', {"Content-Type": "application/json"}, "stream", "valid boolean"),
    (b'{"prompt": "x", "seed": 1180591620717411303424}', {"Content-Type": "application/json"}, "seed", "less than"),
    (b'{"prompt": "x", "n": 2}', {"Content-Type": "application/json"}, "n", "less than or equal to 1"),
])
def test_malformed_bodies_are_400s_that_say_why(engine, content, headers, param, message):
    spy, app = _app(engine, api_key=KEY)
    client = TestClient(app, client=LOOPBACK)
    r = client.post("/v1/completions", content=content, headers=AUTH | headers)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param and message in r.json()["error"]["message"], r.text
    assert spy.calls == []


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_full_wait_queue_is_a_503_to_retry(backend, request):
    """The engine refuses a request beyond max_waiting (QueueFullError): the client gets a 503
    with Retry-After, which openai's client retries, and the engine serves the queued ones."""
    served = serving(backend, request, max_batch=1, max_len=256, max_waiting=1)  # not started: nothing runs
    engine = served.engine
    _, app = _app(engine, api_key=KEY)
    queued = []
    with pytest.raises(QueueFullError):  # the slots (as the backend counts them) and the wait queue fill
        for _ in range(3):
            queued.append(engine.submit("Hi", SamplingParams(max_tokens=2)))
    # our engine counts every request not yet running as waiting; vLLM's engine, those past max_batch
    assert len(queued) == {"specray": 1, "vllm": 2}[backend]
    client = TestClient(app, client=LOOPBACK)
    for path, body in (("/v1/completions", {"prompt": "x"}), ("/v1/chat/completions",
                                                              {"messages": [{"role": "user", "content": "x"}]})):
        r = client.post(path, json=body | {"max_tokens": 2}, headers=AUTH)
        assert r.status_code == 503 and r.headers["retry-after"] == "1", r.text
        assert (r.json()["error"]["type"], r.json()["error"]["code"]) == ("server_error", "queue_full")
        assert "retry later" in r.json()["error"]["message"] and "max_waiting" in r.json()["error"]["message"]
    served.start()
    try:
        assert all(len(q.result(timeout=120).token_ids) >= 1 for q in queued)
        _still_serving(client)
    finally:
        served.stop()
