"""What OpenAI and vLLM clients send, through the official ``openai`` client (no Ray): neutral
values of unimplemented fields are accepted, other values are 400s naming the field, logprobs
match the engine's, content parts and the developer role, and the hardening of odd input
(lone surrogates, bools as token ids, invalid UTF-8, deep JSON), the API key as a secret file
writes it, keyless mode behind a proxy, and a non-streaming client that disconnects under uvicorn.
Each holds on both backends (tests/serving/backends.py)."""

import json
import logging
import socket
import threading
import time

import openai
import pytest
import uvicorn
from fastapi.testclient import TestClient
from ports import free_port

from backends import BACKENDS, serving
from specray.serving.openai_api import create_app
from specray.serving.sampling import SamplingParams

KEY = "sk-compat"
AUTH = {"Authorization": f"Bearer {KEY}"}
HI = [{"role": "user", "content": "Hi there"}]


@pytest.fixture(scope="module", params=BACKENDS)
def served(request):
    served = serving(request.param, request, max_batch=2, max_len=2048).start()
    yield served
    served.stop()


@pytest.fixture(scope="module")
def engine(served):
    """The engine behind the app."""
    return served.engine


@pytest.fixture(scope="module")
def reference(served):
    """Our engine on the same target, and how close the app's logprobs must be to its."""
    return served.reference, served.logprob_tolerance


@pytest.fixture(scope="module")
def http(engine):
    with TestClient(create_app(engine, model_name="debug", api_key=KEY), headers=AUTH) as client:
        yield client


@pytest.fixture(scope="module")
def client(http):
    return openai.OpenAI(base_url="http://testserver/v1", api_key=KEY, http_client=http, max_retries=0)


def _chat(client, **kwargs):
    return client.chat.completions.create(model="debug", messages=kwargs.pop("messages", HI), max_tokens=8,
                                          temperature=0, **kwargs)


# -- neutral values ---------------------------------------------------------------------------


def test_neutral_values_of_unimplemented_fields_are_accepted(client):
    """What chat UIs send with their defaults answers exactly as the plain request does."""
    plain = _chat(client).choices[0].message.content
    neutral = _chat(client, frequency_penalty=0, presence_penalty=0.0, logit_bias={}, n=1,
                    response_format={"type": "text"}, tool_choice="none", parallel_tool_calls=True, store=False,
                    metadata={"session": "abc"}, service_tier="auto", user="u-1", top_p=None, stop=None,
                    extra_body={"repetition_penalty": 1.0, "min_p": 0, "top_k": -1, "min_tokens": 0,
                                "stop_token_ids": [], "include_stop_str_in_output": False, "echo": False,
                                "add_generation_prompt": True, "chat_template_kwargs": {}, "tools": [],
                                "skip_special_tokens": False, "use_beam_search": False, "length_penalty": 1})
    assert neutral.choices[0].message.content == plain
    text = client.completions.create(model="debug", prompt="Once", max_tokens=6, temperature=0).choices[0].text
    same = client.completions.create(model="debug", prompt="Once", max_tokens=6, temperature=0, frequency_penalty=0,
                                     presence_penalty=0, best_of=1, echo=False, logit_bias={}, n=1, suffix=None,
                                     extra_body={"repetition_penalty": 1, "add_special_tokens": True})
    assert same.choices[0].text == text


@pytest.mark.parametrize("kind, field, value", [
    ("chat", "frequency_penalty", 0.5), ("chat", "presence_penalty", -1.0), ("chat", "logit_bias", {"5": 10}),
    ("chat", "response_format", {"type": "json_object"}), ("chat", "n", 2), ("chat", "reasoning_effort", "low"),
    ("chat", "tools", [{"type": "function", "function": {"name": "f", "parameters": {}}}]),
    ("chat", "tool_choice", "required"), ("chat", "repetition_penalty", 1.2), ("chat", "min_p", 0.1),
    ("chat", "skip_special_tokens", True), ("chat", "guided_json", {"type": "object"}), ("chat", "echo", True),
    ("completion", "echo", True), ("completion", "best_of", 2), ("completion", "suffix", "end"),
    ("completion", "frequency_penalty", 1), ("completion", "min_tokens", 4),
])
def test_other_values_are_refused_naming_the_field(client, engine, kind, field, value):
    before = engine.stats()["requests_served"]
    with pytest.raises(openai.BadRequestError) as refused:
        if kind == "chat":
            _chat(client, extra_body={field: value})
        else:
            client.completions.create(model="debug", prompt="Once", max_tokens=4, extra_body={field: value})
    error = refused.value.body
    assert error["param"] == field and error["message"].startswith(f"{field}: ")
    assert "not implemented" in error["message"] or "less than or equal to 1" in error["message"]
    assert engine.stats()["requests_served"] == before  # refused before anything was generated


def test_an_unknown_field_is_refused_by_name(client):
    with pytest.raises(openai.BadRequestError, match="temprature: unknown field"):
        _chat(client, extra_body={"temprature": 0.7})


# -- logprobs ---------------------------------------------------------------------------------


def test_chat_logprobs_are_the_engines(client, reference):
    out = _chat(client, logprobs=True, top_logprobs=3)
    choice = out.choices[0]
    reference, tolerance = reference
    expected = reference.generate([HI], SamplingParams(max_tokens=8, logprobs=3))[0]
    content = choice.logprobs.content
    assert [c.logprob for c in content] == pytest.approx([lp.logprob for lp in expected.logprobs], abs=tolerance)
    assert "".join(c.token for c in content) == choice.message.content
    assert all(len(c.top_logprobs) == 3 and c.top_logprobs[0].logprob >= c.top_logprobs[-1].logprob for c in content)
    assert all(c.logprob == pytest.approx(c.top_logprobs[0].logprob) for c in content)  # greedy: the likeliest
    assert all(c.bytes == list(c.token.encode()) for c in content)
    assert _chat(client).choices[0].logprobs is None

    stream = _chat(client, logprobs=True, top_logprobs=1, stream=True)
    streamed = [c for chunk in stream for c in (chunk.choices[0].logprobs.content
                                                 if chunk.choices and chunk.choices[0].logprobs else [])]
    assert [c.token for c in streamed] == [c.token for c in content]
    assert [c.logprob for c in streamed] == pytest.approx([c.logprob for c in content], abs=1e-5)
    with pytest.raises(openai.BadRequestError, match="top_logprobs needs logprobs: true"):
        _chat(client, top_logprobs=2)
    with pytest.raises(openai.BadRequestError, match="top_logprobs: .*less than or equal to 20"):
        _chat(client, logprobs=True, top_logprobs=21)


def test_completion_logprobs(client, reference):
    out = client.completions.create(model="debug", prompt="Once upon", max_tokens=6, temperature=0, logprobs=2,
                                    extra_body={"ignore_eos": True})
    lp = out.choices[0].logprobs
    reference, tolerance = reference
    expected = reference.generate([reference.tokenize("Once upon")], SamplingParams(max_tokens=6, logprobs=2,
                                                                                   ignore_eos=True))[0]
    assert lp.token_logprobs == pytest.approx([e.logprob for e in expected.logprobs], abs=tolerance)
    assert "".join(lp.tokens) == out.choices[0].text and len(lp.tokens) == 6
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(6)]
    assert all(tok in top and 2 <= len(top) <= 3 for tok, top in zip(lp.tokens, lp.top_logprobs))


# -- messages -----------------------------------------------------------------------------------


def test_content_parts_developer_role_and_names(client):
    as_string = _chat(client, messages=[{"role": "system", "content": "Be brief.\nVery."},
                                        {"role": "user", "content": "Hi there"}]).choices[0].message.content
    as_parts = _chat(client, messages=[
        {"role": "developer", "content": [{"type": "text", "text": "Be brief."}, {"type": "text", "text": "Very."}]},
        {"role": "user", "content": [{"type": "text", "text": "Hi there"}], "name": "ada"}]).choices[0].message.content
    assert as_parts == as_string  # developer is system, parts join with a newline; the template ignores names
    assert _chat(client, messages=[*HI, {"role": "assistant", "content": None, "tool_calls": []},
                                   {"role": "user", "content": "More"}]).choices[0].message.content is not None
    for messages, where in (
            ([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}],
             "messages.0.content: part 0 is of type 'image_url'; this server takes text parts only"),
            ([*HI, {"role": "tool", "content": "42", "tool_call_id": "c1"}], "messages.1"),
            ([{"role": "narrator", "content": "x"}], "messages.0.role: a role is one of system, user, assistant")):
        with pytest.raises(openai.BadRequestError) as refused:
            _chat(client, messages=messages)
        assert where in refused.value.body["message"] and refused.value.body["param"] == "messages"


# -- odd input ----------------------------------------------------------------------------------


@pytest.mark.parametrize("path, body, param", [
    ("/v1/completions", b'{"prompt": "a\\ud800b"}', "prompt"),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "\\udfff"}]}', "messages"),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": [{"type": "text", "text": "\\ud800"}]}]}',
     "messages"),
    ("/v1/completions", b'{"prompt": "x", "stop": ["\\ud83d"]}', "stop"),
])
def test_a_lone_surrogate_is_a_400(http, path, body, param):
    r = http.post(path, content=body, headers={"Content-Type": "application/json"})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param and "lone UTF-16 surrogate" in r.json()["error"]["message"]


def test_bools_are_not_token_ids_and_one_prompt_is_a_batch_of_one(http):
    r = http.post("/v1/completions", json={"prompt": [True, False]})
    assert r.status_code == 400 and "true and false are not token ids" in r.json()["error"]["message"]
    assert http.post("/v1/completions", json={"prompt": [[True]]}).status_code == 400
    body = {"max_tokens": 3, "temperature": 0}
    one = http.post("/v1/completions", json=body | {"prompt": ["Once"]}).json()["choices"][0]["text"]
    assert one == http.post("/v1/completions", json=body | {"prompt": "Once"}).json()["choices"][0]["text"]
    r = http.post("/v1/completions", json={"prompt": ["a", "b"]})
    assert r.status_code == 400 and "a batch of 2 prompts is not implemented" in r.json()["error"]["message"]


@pytest.mark.parametrize("body, message", [
    (b'{"prompt": "caf\xe9"}', "not valid UTF-8 (byte 15 is 0xe9)"),
    (b"[" * 100_000 + b"]" * 100_000, "nested deeper than this server parses"),
    (b'{"prompt": ' + b"[" * 5000 + b"]" * 5000 + b"}", "nested deeper than this server parses"),
])
def test_unparseable_bodies_get_the_openai_error_shape(http, body, message):
    r = http.post("/v1/completions", content=body, headers={"Content-Type": "application/json"})
    assert r.status_code == 400, r.text
    assert set(r.json()) == {"error"} and message in r.json()["error"]["message"]
    r = http.get("/v1/nothing")
    assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error"


# -- the key and keyless mode ---------------------------------------------------------------------


def test_a_key_with_a_trailing_newline_is_stripped_with_a_warning(engine, caplog):
    with caplog.at_level(logging.WARNING):
        app = create_app(engine, model_name="debug", api_key=KEY + "\n")
    assert "trailing whitespace" in caplog.text and KEY not in caplog.text
    client = TestClient(app)
    assert client.get("/v1/models", headers=AUTH).status_code == 200
    assert client.get("/v1/models", headers={"Authorization": "Bearer wrong"}).status_code == 401
    for bad, message in (("\n", "empty or only whitespace"), ("sk two", "whitespace or characters outside"),
                         ("sk-ключ", "outside visible ASCII")):
        with pytest.raises(ValueError, match=message):
            create_app(engine, model_name="debug", api_key=bad)


@pytest.mark.parametrize("header", ["X-Forwarded-For", "Forwarded", "X-Real-IP"])
def test_keyless_mode_refuses_requests_through_a_proxy(engine, header):
    """Keyless mode serves loopback sources; a proxy on the same machine makes every client loopback."""
    keyless = TestClient(create_app(engine, model_name="debug"), client=("127.0.0.1", 50000))
    r = keyless.get("/v1/models", headers={header: "203.0.113.9"})
    assert r.status_code == 401 and header.lower() in r.json()["error"]["message"]
    assert "http.api_key" in r.json()["error"]["message"]
    assert keyless.get("/v1/models").status_code == 200
    keyed = TestClient(create_app(engine, model_name="debug", api_key=KEY), client=("127.0.0.1", 50000))
    assert keyed.get("/v1/models", headers={header: "203.0.113.9"} | AUTH).status_code == 200


# -- a client that disconnects under plain uvicorn --------------------------------------------------


def test_a_non_streaming_client_that_disconnects_frees_its_slot_under_uvicorn(engine):
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(create_app(engine, model_name="debug", api_key=KEY), host="127.0.0.1",
                                           port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        while not server.started:
            time.sleep(0.05)
        aborted = engine.stats()["requests_aborted"]
        body = json.dumps({"prompt": "Once", "max_tokens": 1900, "ignore_eos": True}).encode()
        with socket.create_connection(("127.0.0.1", port)) as sock:
            sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                         + f"Authorization: Bearer {KEY}\r\nContent-Length: {len(body)}\r\n\r\n".encode() + body)
            deadline = time.monotonic() + 10
            while engine.stats()["requests_running"] == 0:  # generating
                assert time.monotonic() < deadline
                time.sleep(0.01)
        gone = time.monotonic()  # the socket is closed: the client went away
        while engine.stats()["requests_aborted"] == aborted or engine.stats()["requests_running"]:
            assert time.monotonic() - gone < 5, "the request kept its slot after its client disconnected"
            time.sleep(0.01)
        assert engine.stats()["requests_running"] == 0
    finally:
        server.should_exit = True
        thread.join(10)
