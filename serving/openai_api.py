"""OpenAI-compatible HTTP API over the engine: request/response models and the FastAPI app.

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

Every route but /health sits behind serving/http_guard.py: with an API key, a missing or wrong
``Authorization: Bearer KEY`` is a 401 before the body is read; without one, only loopback
clients are served (403); a body over ``HttpLimits.max_body_bytes`` is a 413. /docs, /redoc
and /openapi.json exist only with ``HttpLimits.docs``. /health says only that the replica is up,
which model and drafter version it serves, and its id.

Errors use OpenAI's body ``{"error": {"message", "type", "param", "code"}}``: a malformed body
or an out-of-range field is a 400 naming the field (FastAPI's 422 becomes 400), a prompt over
``HttpLimits.max_prompt_bytes`` a 400 before it is tokenized, a request the engine refuses
(empty prompt, longer than the context) a 400 with the engine's message. The engine keeps
serving after any of them.

With a ``recorder`` (serving/recorder.py, the serve config's ``record`` section), every request
that finished normally (``stop`` or ``length``; not errors, aborts or cancellations) is offered to
it as a record of its prompt and answer; the recorder never blocks or fails the request, and its
counters appear in /metrics (``recording`` in JSON; ``specray_records_*`` in Prometheus).

The app needs an engine-like object, not Ray: ``submit(prompt, SamplingParams) ->
RequestHandle``, ``tokenize(text)``, ``decode(ids)``, ``stats()``; someone else steps it
(``EngineLoop``).
"""

from __future__ import annotations

import json
import time
import uuid
from typing import AsyncIterator, Callable, Literal

from fastapi import FastAPI
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, field_validator

from specray.serving.engine import GenerationOutput, QueueFullError, RequestHandle, StreamDelta
from specray.serving.http_guard import DOCS_PATHS, HttpLimits, RequestGuard, error_response
from specray.serving.recorder import FINISHED, TrafficRecorder, chat_record, completion_record
from specray.serving.sampling import MAX_STOP_CHARS, MAX_STOP_STRINGS, SamplingParams

DEFAULT_CHAT_MAX_TOKENS = 256  # when a chat request sets neither max_tokens nor max_completion_tokens
RETRY_AFTER_S = 1  # told to clients when the engine's wait queue is full


# -- protocol models ---------------------------------------------------------------------


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid")  # an option we do not implement is refused, never ignored


class StreamOptions(_Body):
    include_usage: bool = Field(False, description="send a last chunk with token usage")


class _SamplingFields(_Body):
    model: str | None = Field(None, description="the served model's name (see /v1/models)")
    temperature: float = Field(1.0, ge=0, description="0 = greedy")
    top_p: float = Field(1.0, gt=0, le=1, description="nucleus mass, in (0, 1]")
    top_k: int = Field(0, ge=-1, description="keep the k most likely tokens; 0 or -1 = off")
    stop: str | list[str] | None = Field(
        None, description=f"stop strings (not included in the output): at most {MAX_STOP_STRINGS}, "
                          f"of at most {MAX_STOP_CHARS} characters each")
    seed: int | None = Field(None, ge=-(1 << 63), lt=1 << 64,
                             description="seeds sampling: the same output again when the engine runs fixed rounds "
                                         "(no drafter, or speculation: static); with automatic round sizes, the same "
                                         "distribution")
    stream: bool = Field(False, description="server-sent events, one chunk per engine step")
    stream_options: StreamOptions | None = None
    n: int = Field(1, ge=1, le=1, description="choices per request (only 1)")
    ignore_eos: bool = Field(False, description="keep generating past EOS (benchmarks)")
    user: str | None = Field(None, description="end-user id (recorded nowhere)")

    @field_validator("stop")
    @classmethod
    def _bounded_stop(cls, stop: str | list[str] | None) -> str | list[str] | None:
        stops = [stop] if isinstance(stop, str) else stop or []
        if len(stops) > MAX_STOP_STRINGS:
            raise ValueError(f"at most {MAX_STOP_STRINGS} stop strings, got {len(stops)}")
        long = [i for i, s in enumerate(stops) if len(s) > MAX_STOP_CHARS]
        if long:
            raise ValueError(f"stop strings are at most {MAX_STOP_CHARS} characters; stop[{long[0]}] has "
                             f"{len(stops[long[0]])}")
        return stop

    def sampling_params(self, max_tokens: int) -> SamplingParams:
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        return SamplingParams(max_tokens=max_tokens, temperature=self.temperature, top_p=self.top_p,
                              top_k=max(0, self.top_k), stop=tuple(stop), seed=self.seed, ignore_eos=self.ignore_eos)


class CompletionRequest(_SamplingFields):
    prompt: str | list[int] = Field(..., description="text (continued as is, no chat template) or token ids")
    max_tokens: int = Field(16, ge=1, description="tokens to generate at most")

    @field_validator("prompt")
    @classmethod
    def _not_empty(cls, prompt: str | list[int]) -> str | list[int]:
        if not prompt:
            raise ValueError("the prompt is empty")
        return prompt


class ChatMessage(_Body):
    role: Literal["system", "user", "assistant"]
    content: str


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(..., min_length=1)
    max_tokens: int | None = Field(
        None, ge=1, description=f"tokens to generate at most (default {DEFAULT_CHAT_MAX_TOKENS})")
    max_completion_tokens: int | None = Field(None, ge=1, description="the same, newer name; wins over max_tokens")


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
        elif err["type"] == "model_attributes_type" and field == "body":
            message = "the body must be a JSON object, sent with 'Content-Type: application/json'"
        elif err["type"] == "missing":
            message = "required"
        else:
            got = repr(err.get("input"))
            message = f"{err['msg'].removeprefix('Value error, ')} (got {got if len(got) <= 80 else got[:77] + '...'})"
        lines.append(f"{field}: {message}")
        params.append(loc[0] if loc else None)
    return APIError(400, "; ".join(lines), param=params[0] if params else None)


# -- responses ---------------------------------------------------------------------------


def _fingerprint(version: int | None) -> str:
    return "specray-ar" if version is None else f"specray-drafter-v{version}"


def _usage(handle: RequestHandle, completion_tokens: int) -> dict:
    prompt = len(handle.prompt_ids)
    return {"prompt_tokens": prompt, "completion_tokens": completion_tokens, "total_tokens": prompt + completion_tokens}


def _sse(data: dict | str) -> str:
    return f"data: {data if isinstance(data, str) else json.dumps(data)}\n\n"


class _Responder:
    """Builds the completion or chat body and stream chunks for one request."""

    def __init__(self, chat: bool, model: str, handle: RequestHandle,
                 on_finish: Callable[[_Responder, GenerationOutput], None] | None = None):
        self.chat, self.model, self.handle, self.on_finish = chat, model, handle, on_finish
        self.id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        self.chunk_object = "chat.completion.chunk" if chat else "text_completion"
        self.created = int(time.time())

    def _envelope(self, object: str, choices: list[dict]) -> dict:
        return {"id": self.id, "object": object, "created": self.created, "model": self.model,
                "system_fingerprint": _fingerprint(self.handle.drafter_version), "choices": choices}

    def body(self, out: GenerationOutput) -> dict:
        if self.chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": out.text},
                      "finish_reason": out.finish_reason}
        else:
            choice = {"index": 0, "text": out.text, "logprobs": None, "finish_reason": out.finish_reason}
        body = self._envelope("chat.completion" if self.chat else "text_completion", [choice])
        return body | {"usage": _usage(self.handle, len(out.token_ids))}

    def chunk(self, text: str | None, finish_reason: str | None, role: bool = False) -> dict:
        if self.chat:
            delta = ({"role": "assistant"} if role else {}) | ({"content": text} if text is not None else {})
            return self._envelope(self.chunk_object, [{"index": 0, "delta": delta, "finish_reason": finish_reason}])
        return self._envelope(self.chunk_object, [{"index": 0, "text": text or "", "logprobs": None,
                                                   "finish_reason": finish_reason}])

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
        chunks = []
        if delta.text:
            chunks.append(self.chunk(delta.text, None))
        if delta.finish_reason is not None:
            chunks.append(self.chunk(None if self.chat else "", delta.finish_reason))
        return chunks


# -- the app -----------------------------------------------------------------------------


def _prometheus(stats: dict, model: str, recording: dict | None = None) -> str:
    lines = []

    def metric(name: str, kind: str, help: str, samples: list[tuple[str, float]]) -> None:
        lines.extend([f"# HELP specray_{name} {help}", f"# TYPE specray_{name} {kind}"])
        lines.extend(f"specray_{name}{{model=\"{model}\"{labels}}} {value}" for labels, value in samples)

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
    docs = {"docs_url": "/docs", "redoc_url": "/redoc", "openapi_url": "/openapi.json"} if limits.docs else {
        "docs_url": None, "redoc_url": None, "openapi_url": None}
    app = FastAPI(title="specray", description="OpenAI-compatible speculative decoding server", **docs)
    app.add_middleware(RequestGuard, api_key=api_key, limits=limits,
                       public_paths={"/health"} | (DOCS_PATHS if limits.docs else set()))
    info = replica_info or dict
    app.add_exception_handler(APIError, lambda request, exc: exc.response())
    app.add_exception_handler(RequestValidationError, lambda request, exc: _validation_error(exc).response())
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

    async def answer(chat: bool, request: _SamplingFields, handle: RequestHandle, prompt):
        responder = _Responder(chat, model_name, handle, on_finish=record(prompt))
        if request.stream:
            include_usage = bool(request.stream_options and request.stream_options.include_usage)
            return StreamingResponse(responder.stream(include_usage), media_type="text/event-stream")
        try:
            out = await handle.aresult()
            responder.finished(out)
            return responder.body(out)
        finally:
            if not handle.done:  # cancelled: the client went away
                handle.abort()

    @app.post("/v1/completions")
    async def completions(request: CompletionRequest):
        check_model(request.model)
        if isinstance(request.prompt, str):
            check_prompt_bytes([request.prompt], "prompt")
        prompt = engine.tokenize(request.prompt) if isinstance(request.prompt, str) else request.prompt
        handle = submit(prompt, request, request.max_tokens)
        return await answer(False, request, handle, request.prompt)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: ChatCompletionRequest):
        check_model(request.model)
        check_prompt_bytes([m.content for m in request.messages], "messages")
        max_tokens = request.max_completion_tokens or request.max_tokens or DEFAULT_CHAT_MAX_TOKENS
        messages = [m.model_dump() for m in request.messages]
        handle = submit(messages, request, max_tokens)
        return await answer(True, request, handle, messages)

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
            return PlainTextResponse(_prometheus(stats, model_name, recording), media_type="text/plain; version=0.0.4")
        return {"model": model_name, "replica": replica_id} | stats | info() | {"recording": recording}

    return app
