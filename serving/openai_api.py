"""OpenAI-compatible HTTP API over the engine: responses, errors, metrics and the FastAPI app.

    engine = Engine(load_target("debug")); loop = EngineLoop(engine).start()
    app = create_app(engine, model_name="debug")        # serve with Ray Serve (actors/serve.py),
                                                          # uvicorn, or fastapi's TestClient

Routes: ``POST /v1/completions`` (prompt: text, continued as is, or token ids) and
``POST /v1/chat/completions`` (messages, rendered with the target's chat template), both with
``stream: true`` for server-sent events (``data: {chunk}`` lines ending with ``data: [DONE]``);
``GET /v1/models``; ``GET /health``; ``GET /metrics`` (JSON: tokens/s, tau, acceptance per
draft position, active drafter version; Prometheus text with ``?format=prometheus``). Each
replica reports its own metrics. The response's ``system_fingerprint`` names the drafter
version that served the request (``specray-drafter-v3``; ``specray-ar`` without a drafter).
Which fields a request may carry, and which values of those this server does not implement it
accepts, is serving/openai_protocol.py. With ``logprobs`` a choice carries each output token's
log-probability under the target's raw distribution (its logits' log-softmax, before temperature,
top-k and top-p, as vLLM's default ``raw_logprobs``), read from the target row the token was drawn
from — a speculative round's verify rows give them for every accepted draft — and the most
likely alternatives there (chat: ``top_logprobs``; completions: ``logprobs`` N, the chosen token
always listed too).

Every route but /health sits behind serving/http_guard.py: with an API key, a missing or wrong
``Authorization: Bearer KEY`` is a 401 before the body is read; without one, only loopback
clients are served (403); a body over ``HttpLimits.max_body_bytes`` is a 413. /docs, /redoc
and /openapi.json exist only with ``HttpLimits.docs``. /health says only that the replica is up,
which model and drafter version it serves, and its id.

Errors use OpenAI's body ``{"error": {"message", "type", "param", "code"}}``: a malformed body
(not JSON, not UTF-8, nested past the parser's depth) or an out-of-range field is a 400 naming the
field (FastAPI's 422 becomes 400), a prompt over ``HttpLimits.max_prompt_bytes`` a 400 before it
is tokenized, a request the engine refuses (empty prompt, longer than the context) a 400 with the
engine's message; an unknown route is a 404 in the same shape. The engine keeps serving after
any of them. A client that disconnects frees its slot: a stream ends with it, and a
non-streaming request is aborted as soon as the server sees the disconnect (also under plain
uvicorn, which does not cancel the handler).

With a ``recorder`` (serving/recorder.py, the serve config's ``record`` section), every request
that finished normally (``stop`` or ``length``; not errors, aborts or cancellations) is offered to
it as a record of its prompt and answer; the recorder never blocks or fails the request, and its
counters appear in /metrics (``recording`` in JSON; ``specray_records_*`` in Prometheus).

The app needs an engine-like object, not Ray: ``submit(prompt, SamplingParams) ->
RequestHandle``, ``tokenize(text)``, ``decode(ids)``, ``stats()``; someone else steps it
(``EngineLoop``).
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from typing import AsyncIterator, Callable, Literal

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from starlette.exceptions import HTTPException

from specray.serving.engine import GenerationOutput, QueueFullError, RequestHandle, StreamDelta
from specray.serving.http_guard import DOCS_PATHS, HttpLimits, RequestGuard, error_response, normalize_api_key
from specray.serving.openai_protocol import (DEFAULT_COMPLETION_MAX_TOKENS, ChatCompletionRequest, CompletionRequest,
                                             _SamplingFields)
from specray.serving.recorder import FINISHED, TrafficRecorder, chat_record, completion_record
from specray.serving.requests import TokenLogprob

RETRY_AFTER_S = 1  # told to clients when the engine's wait queue is full


# -- errors ------------------------------------------------------------------------------


class APIError(Exception):
    """An error answered with OpenAI's error body."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.headers = headers

    @property
    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return error_response(self.status, self.message, type=self.type, param=self.param, code=self.code,
                              headers=self.headers)


def _validation_error(exc: RequestValidationError) -> APIError:
    """FastAPI's 422 as a 400: every problem as ``field: message``; ``param`` is the first field."""
    lines, params = [], []
    for err in exc.errors():
        loc = [str(p) for p in err["loc"]]
        if loc and loc[0] in ("body", "query", "header"):
            loc = loc[1:]
        field = ".".join(loc) or "body"
        if err["type"] == "extra_forbidden":
            message = "unknown field; this server does not implement it"
        elif err["type"] == "json_invalid":
            field = "body"
            message = (f"not valid JSON: {err.get('ctx', {}).get('error', 'decode error')} at character "
                       f"{loc[0] if loc else '?'}")
        elif err["type"] == "model_attributes_type" and field == "body":
            message = "the body must be a JSON object, sent with 'Content-Type: application/json'"
        elif err["type"] == "missing":
            message = "required"
        else:
            got = repr(err.get("input"))
            message = f"{err['msg'].removeprefix('Value error, ')} (got {got if len(got) <= 80 else got[:77] + '...'})"
        lines.append(f"{field}: {message}")
        params.append(loc[0] if loc and err["type"] != "json_invalid" else None)
    return APIError(400, "; ".join(lines), param=params[0] if params else None)


def _http_error(exc: HTTPException) -> APIError:
    """Starlette's and FastAPI's own errors in OpenAI's shape: a body that could not be parsed (not
    UTF-8, JSON nested past the parser's depth) says why; an unknown route or method is a 404 / 405."""
    cause = exc.__cause__
    if isinstance(cause, UnicodeDecodeError):
        return APIError(400, f"the body is not valid UTF-8 (byte {cause.start} is {cause.object[cause.start]:#04x}); "
                             "send UTF-8 JSON", code="invalid_body")
    if isinstance(cause, RecursionError):
        return APIError(400, "the body's JSON is nested deeper than this server parses; send a flatter body",
                        code="invalid_body")
    if exc.status_code == 400:
        return APIError(400, f"the body could not be parsed ({type(cause).__name__ if cause else exc.detail}); "
                             "send a JSON object with 'Content-Type: application/json'", code="invalid_body")
    kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
    return APIError(exc.status_code, str(exc.detail), type=kind, headers=getattr(exc, "headers", None))


# -- responses ---------------------------------------------------------------------------


def _fingerprint(version: int | None) -> str:
    return "specray-ar" if version is None else f"specray-drafter-v{version}"


def _usage(handle: RequestHandle, completion_tokens: int) -> dict:
    prompt = len(handle.prompt_ids)
    return {"prompt_tokens": prompt, "completion_tokens": completion_tokens, "total_tokens": prompt + completion_tokens}


async def _client_gone(raw: Request) -> None:
    """Returns once the client disconnected (the body has been read: what comes next is the end)."""
    while (await raw.receive())["type"] != "http.disconnect":
        pass


def _sse(data: dict | str) -> str:
    return f"data: {data if isinstance(data, str) else json.dumps(data)}\n\n"


class _Responder:
    """Builds the completion or chat body and stream chunks for one request; ``token_text(id)``
    spells a token in logprobs."""

    def __init__(self, chat: bool, model: str, handle: RequestHandle, token_text: Callable[[int], str],
                 on_finish: Callable[[_Responder, GenerationOutput], None] | None = None):
        self.chat, self.model, self.handle, self.on_finish = chat, model, handle, on_finish
        self.token_text = token_text
        self.id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        self.chunk_object = "chat.completion.chunk" if chat else "text_completion"
        self.created = int(time.time())
        self.text_offset = 0  # completions' logprobs: characters of the tokens spelled so far

    def _envelope(self, object: str, choices: list[dict]) -> dict:
        return {"id": self.id, "object": object, "created": self.created, "model": self.model,
                "system_fingerprint": _fingerprint(self.handle.drafter_version), "choices": choices}

    def logprobs(self, entries: list[TokenLogprob] | None) -> dict | None:
        """OpenAI's ``logprobs`` of ``entries``: chat's ``{"content": [...]}``, completions' token lists."""
        if entries is None:
            return None
        if self.chat:
            def one(token_id: int, logprob: float) -> dict:
                text = self.token_text(token_id)
                return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8", "replace"))}
            return {"content": [one(e.token_id, e.logprob) | {"top_logprobs": [one(i, lp) for i, lp in e.top]}
                                for e in entries], "refusal": None}
        tokens = [self.token_text(e.token_id) for e in entries]
        offsets = []
        for text in tokens:
            offsets.append(self.text_offset)
            self.text_offset += len(text)
        top = [{tok: e.logprob} | {self.token_text(i): lp for i, lp in e.top} for tok, e in zip(tokens, entries)]
        return {"tokens": tokens, "token_logprobs": [e.logprob for e in entries], "top_logprobs": top,
                "text_offset": offsets}

    def body(self, out: GenerationOutput) -> dict:
        logprobs = self.logprobs(out.logprobs)
        if self.chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": out.text}, "logprobs": logprobs,
                      "finish_reason": out.finish_reason}
        else:
            choice = {"index": 0, "text": out.text, "logprobs": logprobs, "finish_reason": out.finish_reason}
        body = self._envelope("chat.completion" if self.chat else "text_completion", [choice])
        return body | {"usage": _usage(self.handle, len(out.token_ids))}

    def chunk(self, text: str | None, finish_reason: str | None, role: bool = False,
              logprobs: list[TokenLogprob] | None = None) -> dict:
        choice = {"index": 0}
        if self.chat:
            choice["delta"] = ({"role": "assistant"} if role else {}) | ({"content": text} if text is not None else {})
        else:
            choice["text"] = text or ""
        if logprobs or not self.chat:
            choice["logprobs"] = self.logprobs(logprobs) if logprobs else None
        return self._envelope(self.chunk_object, [choice | {"finish_reason": finish_reason}])

    async def stream(self, include_usage: bool) -> AsyncIterator[str]:
        tokens = 0
        try:
            if self.chat:
                yield _sse(self.chunk("", None, role=True))
            try:
                async for delta in self.handle:
                    tokens += len(delta.token_ids)
                    for chunk in self._delta_chunks(delta):
                        yield _sse(chunk)
            except Exception as e:  # noqa: BLE001 - the 200 is sent: an in-band error is all a client can get
                yield _sse(APIError(500, f"generation failed: {e}", type="server_error").body)
                return
            self.finished(self.handle.result(timeout=0))  # the last delta came: the output is there
            if include_usage:
                yield _sse(self._envelope(self.chunk_object, []) | {"usage": _usage(self.handle, tokens)})
            yield _sse("[DONE]")
        finally:
            if not self.handle.done:  # the client went away: free the slot
                self.handle.abort()

    def finished(self, out: GenerationOutput) -> None:
        """Hand a request that finished normally to ``on_finish`` (the traffic recorder)."""
        if self.on_finish is not None and out.finish_reason in FINISHED:
            self.on_finish(self, out)

    def _delta_chunks(self, delta: StreamDelta) -> list[dict]:
        """The chunks of one delta: its text with its tokens' logprobs (held-back text may leave a
        chunk of logprobs alone), then the finish reason."""
        chunks = []
        if delta.text or delta.logprobs:
            chunks.append(self.chunk(delta.text, None, logprobs=delta.logprobs))
        if delta.finish_reason is not None:
            chunks.append(self.chunk(None if self.chat else "", delta.finish_reason))
        return chunks


# -- the app -----------------------------------------------------------------------------


def _prometheus(stats: dict, model: str, recording: dict | None = None, replica: str | None = None) -> str:
    """The replica's stats as Prometheus text, each sample labelled with the model and the replica
    (a scrape reaches whichever replica Serve routes it to; Ray's own endpoint has every replica's:
    actors/serve.py ``ReplicaMetrics``)."""
    lines = []
    base = f'model="{model}"' + (f',replica="{replica}"' if replica else "")

    def metric(name: str, kind: str, help: str, samples: list[tuple[str, float]]) -> None:
        lines.extend([f"# HELP specray_{name} {help}", f"# TYPE specray_{name} {kind}"])
        lines.extend(f"specray_{name}{{{base}{labels}}} {value}" for labels, value in samples)

    metric("tokens_per_second", "gauge", "generated tokens per second of engine steps over the last minute",
           [("", stats["tokens_per_second"])])
    metric("tokens_generated_total", "counter", "tokens generated", [("", stats["tokens_generated"])])
    metric("requests_served_total", "counter", "requests finished", [("", stats["requests_served"])])
    metric("requests_aborted_total", "counter", "requests aborted", [("", stats["requests_aborted"])])
    metric("requests_running", "gauge", "requests in KV slots", [("", stats["requests_running"])])
    metric("requests_waiting", "gauge", "requests queued for a slot", [("", stats["requests_waiting"])])
    metric("rejected_versions", "gauge", "drafter versions that failed validation",
           [("", len(stats["rejected_versions"]))])
    if stats["active_version"] is not None:
        metric("drafter_version", "gauge", "active drafter version", [("", stats["active_version"])])
    if stats["tau"] is not None:
        metric("tau", "gauge", "mean tokens per round of the active drafter (accepted drafts + 1)",
               [("", stats["tau"])])
    metric("version_tau", "gauge", "mean tokens per round of each drafter version this replica served",
           [(f',version="{v["version"] if v["version"] is not None else "ar"}"', v["tau"])
            for v in stats.get("versions", []) if v["tau"] is not None])
    metric("acceptance_rate", "gauge", "fraction of rounds whose draft at this position was accepted",
           [(f",position=\"{j + 1}\"", a) for j, a in enumerate(stats["acceptance_by_position"])])
    sizes: dict[int, int] = {}
    for report in (stats.get("chooser") or {}).values():
        for size, n in report["rounds_by_size"].items():
            sizes[int(size)] = sizes.get(int(size), 0) + n
    metric("rounds_total", "counter", "rounds of the active drafter by the size its chooser picked (0 = a plain step)",
           [(f",size=\"{size}\"", n) for size, n in sorted(sizes.items())])
    if recording is not None:
        metric("records_written_total", "counter", "finished requests recorded in written shards",
               [("", recording["recorded"])])
        metric("records_dropped_total", "counter", "records lost to a full queue or a failed shard write",
               [("", recording["dropped"])])
        metric("record_shards_written_total", "counter", "record shards written", [("", recording["shards_written"])])
        metric("record_write_errors_total", "counter", "record shard writes that failed",
               [("", recording["write_errors"])])
    return "\n".join(lines) + "\n"


def create_app(engine, *, model_name: str, api_key: str | None = None, limits: HttpLimits | None = None,
               replica_id: str | None = None, replica_info: Callable[[], dict] | None = None,
               recorder: TrafficRecorder | None = None) -> FastAPI:
    """The OpenAI-compatible app over ``engine`` behind its ``RequestGuard`` (see the module
    docstring). ``replica_id`` names the replica in /health and /metrics; ``replica_info()`` is
    added to /metrics only (its hot-load state may name paths and errors); ``recorder`` records
    the requests that finish normally."""
    limits = limits or HttpLimits()
    api_key = normalize_api_key(api_key)  # at start-up, not at the first request
    docs = {"docs_url": "/docs", "redoc_url": "/redoc", "openapi_url": "/openapi.json"} if limits.docs else {
        "docs_url": None, "redoc_url": None, "openapi_url": None}
    app = FastAPI(title="specray", description="OpenAI-compatible speculative decoding server", **docs)
    app.add_middleware(RequestGuard, api_key=api_key, limits=limits,
                       public_paths={"/health"} | (DOCS_PATHS if limits.docs else set()))
    info = replica_info or dict
    app.add_exception_handler(APIError, lambda request, exc: exc.response())
    app.add_exception_handler(RequestValidationError, lambda request, exc: _validation_error(exc).response())
    app.add_exception_handler(HTTPException, lambda request, exc: _http_error(exc).response())
    app.add_exception_handler(Exception, lambda request, exc: APIError(
        500, f"generation failed: {type(exc).__name__}: {exc}", type="server_error").response())

    def check_prompt_bytes(texts: list[str], param: str) -> None:
        size = sum(len(t.encode()) for t in texts)
        if size > limits.max_prompt_bytes:
            raise APIError(400, f"the prompt is {size} bytes; this server accepts at most {limits.max_prompt_bytes} "
                                "(http limits.max_prompt_bytes)", param=param, code="prompt_too_long")

    def check_model(model: str | None) -> None:
        if model is not None and model != model_name:
            raise APIError(404, f"model {model!r} is not served here; this server serves {model_name!r}",
                           param="model", code="model_not_found")

    def submit(prompt, request: _SamplingFields, max_tokens: int) -> RequestHandle:
        try:
            return engine.submit(prompt, request.sampling_params(max_tokens))
        except ValueError as e:  # SamplingParams and the engine's prompt checks: the request's fault
            raise APIError(400, str(e)) from None
        except QueueFullError as e:  # overloaded, not broken: the client retries (openai's client does)
            raise APIError(503, f"the server is busy, retry later: {e}", type="server_error", code="queue_full",
                           headers={"Retry-After": str(RETRY_AFTER_S)}) from None

    def record(prompt: list[dict] | str | list[int]) -> Callable[[_Responder, GenerationOutput], None] | None:
        """The ``on_finish`` that offers a finished request to the recorder (None without one)."""
        if recorder is None:
            return None

        def offer(responder: _Responder, out: GenerationOutput) -> None:
            fields = {"id": responder.id, "created": responder.created, "model": model_name,
                      "drafter_version": out.drafter_version, "temperature": responder.handle.params.temperature,
                      "top_p": responder.handle.params.top_p, "max_tokens": responder.handle.params.max_tokens,
                      "finish_reason": out.finish_reason, "prompt_tokens": len(out.prompt_ids),
                      "completion_tokens": len(out.token_ids)}
            if responder.chat:
                recorder.offer(chat_record(prompt, out.text, **fields))
            else:
                text = prompt if isinstance(prompt, str) else engine.decode(prompt)
                recorder.offer(completion_record(text, out.text, **fields))
        return offer

    def token_text(token_id: int) -> str:
        return engine.decode([token_id])

    async def answer(chat: bool, request: _SamplingFields, handle: RequestHandle, prompt, raw: Request):
        responder = _Responder(chat, model_name, handle, token_text, on_finish=record(prompt))
        if request.stream:  # StreamingResponse ends the stream (and so the request) when the client goes
            include_usage = bool(request.stream_options and request.stream_options.include_usage)
            return StreamingResponse(responder.stream(include_usage), media_type="text/event-stream")
        result, gone = asyncio.ensure_future(handle.aresult()), asyncio.ensure_future(_client_gone(raw))
        try:  # a server that does not cancel the handler on a disconnect (plain uvicorn) still frees the slot
            await asyncio.wait({result, gone}, return_when=asyncio.FIRST_COMPLETED)
            if not result.done():
                return error_response(499, "the client closed the connection", type="invalid_request_error",
                                      code="client_disconnected")
            out = result.result()
            responder.finished(out)
            return responder.body(out)
        finally:
            gone.cancel()
            result.cancel()
            if not handle.done:  # the client went away, or the handler was cancelled
                handle.abort()

    @app.post("/v1/completions")
    async def completions(request: CompletionRequest, raw: Request):
        check_model(request.model)
        if isinstance(request.prompt, str):
            check_prompt_bytes([request.prompt], "prompt")
        prompt = engine.tokenize(request.prompt) if isinstance(request.prompt, str) else request.prompt
        handle = submit(prompt, request, request.max_tokens or DEFAULT_COMPLETION_MAX_TOKENS)
        return await answer(False, request, handle, request.prompt, raw)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: ChatCompletionRequest, raw: Request):
        check_model(request.model)
        check_prompt_bytes([m.text for m in request.messages], "messages")
        messages = [m.for_template() for m in request.messages]
        handle = submit(messages, request, request.max_new_tokens)
        return await answer(True, request, handle, messages, raw)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": 0, "owned_by": "specray"}]}

    @app.get("/health")
    async def health():
        return {"status": "ok", "model": model_name, "drafter_version": engine.stats()["active_version"],
                "replica": replica_id}

    @app.get("/metrics")
    async def metrics(format: Literal["json", "prometheus"] = "json"):
        stats = engine.stats()
        recording = recorder.stats() if recorder is not None else None
        if format == "prometheus":
            return PlainTextResponse(_prometheus(stats, model_name, recording, replica_id),
                                     media_type="text/plain; version=0.0.4")
        return {"model": model_name, "replica": replica_id} | stats | info() | {"recording": recording}

    return app
