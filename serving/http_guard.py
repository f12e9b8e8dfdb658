"""The guard in front of the OpenAI app: who may call it and how large a request may be.

    app = RequestGuard(fastapi_app, api_key="sk-…", limits=HttpLimits(), public_paths={"/health"})

``RequestGuard`` is plain ASGI middleware; it answers before the app sees the request, and
before the body is read:

- with an API key, a request without ``Authorization: Bearer <key>`` (compared in constant
  time) is a 401; without a key, only loopback clients are served and any other is a 403
  (the rule ``specray serve`` applies to the bind address, applied per request, since a Serve
  config or a KubeRay RayService binds its proxy where specray cannot see it);
- keyless mode trusts the connection's source address: every client in 127.0.0.0/8 (and ::1)
  is served, so behind a proxy or sidecar on the same machine every remote client looks
  local. A keyless server therefore refuses (401, saying to set a key) any request that carries
  ``X-Forwarded-For``, ``Forwarded`` or ``X-Real-IP``: the headers a proxy adds;
- a body over ``max_body_bytes`` is a 413, by its ``Content-Length`` or, without one, once
  that many bytes have arrived.

``public_paths`` (the health probe, and the API docs when enabled) need no key. Errors use
OpenAI's body ``{"error": {"message", "type", "param", "code"}}``.

``normalize_api_key`` reads a configured key: surrounding whitespace (a secret written with
``echo``: a trailing newline) is stripped with a warning; a key that is empty after that, or
holds characters an HTTP header cannot carry, is refused at start-up.
"""

from __future__ import annotations

import ipaddress
import json
import logging
import re
import secrets

from pydantic import BaseModel, ConfigDict, Field
from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

DOCS_PATHS = frozenset({"/docs", "/docs/oauth2-redirect", "/redoc", "/openapi.json"})
FORWARDED_HEADERS = (b"x-forwarded-for", b"forwarded", b"x-real-ip")
_KEY_CHARS = re.compile(r"^[\x21-\x7e]+$")  # what a bearer token in an HTTP header can hold: visible ASCII

log = logging.getLogger(__name__)


def normalize_api_key(key: str | None, source: str = "http.api_key") -> str | None:
    """``key`` as the server compares it (module docstring); None stays None."""
    if key is None:
        return None
    stripped = key.strip()
    if not stripped:
        raise ValueError(f"{source} is empty or only whitespace; set a key, or unset it to serve loopback clients only")
    if stripped != key:
        log.warning("%s has leading or trailing whitespace (%d characters, e.g. a newline from `echo`): it is "
                    "stripped, so clients send the key without it", source, len(key) - len(stripped))
    if not _KEY_CHARS.match(stripped):
        raise ValueError(f"{source} holds whitespace or characters outside visible ASCII, which an "
                         "'Authorization: Bearer <key>' header cannot carry; use letters, digits and punctuation")
    return stripped


class _JSON(JSONResponse):
    """JSON with non-ASCII escaped: an error may quote a request's text, lone surrogates included."""

    def render(self, content) -> bytes:
        return json.dumps(content, ensure_ascii=True, separators=(",", ":")).encode()


class HttpLimits(BaseModel):
    """Per-request bounds of the OpenAI API, checked before any tokenizing or engine work."""

    model_config = ConfigDict(extra="forbid")

    max_body_bytes: int = Field(1 << 20, gt=0, description="largest request body in bytes; larger ones are a 413")
    max_prompt_bytes: int = Field(
        256 << 10, gt=0, description="largest prompt text (a chat's message contents together) in UTF-8 bytes, "
                                     "refused before tokenizing; raise it for contexts above ~50k tokens")
    docs: bool = Field(False, description="serve /docs, /redoc and /openapi.json, without a key (off: 404)")


def error_response(status: int, message: str, *, type: str, param: str | None = None, code: str | None = None,
                   headers: dict[str, str] | None = None) -> JSONResponse:
    return _JSON({"error": {"message": message, "type": type, "param": param, "code": code}},
                 status_code=status, headers=headers)


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # a host name: only "localhost" is known to be loopback
        return False


def _header(scope: Scope, name: bytes) -> bytes | None:
    for key, value in scope["headers"]:
        if key.lower() == name:
            return value
    return None


class RequestGuard:
    """ASGI middleware: the key (or loopback) rule and the body cap (module docstring)."""

    def __init__(self, app: ASGIApp, *, api_key: str | None, limits: HttpLimits, public_paths: set[str]):
        self.app, self.limits, self.public_paths = app, limits, frozenset(public_paths)
        api_key = normalize_api_key(api_key)
        self.api_key = None if api_key is None else api_key.encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        refusal = self._refusal(scope)
        if refusal is None:
            try:
                body = await self._read_body(scope, receive)
            except _ClientGone:
                return
            if body is not None:
                await self.app(scope, _replay(body, receive), send)
                return
            refusal = error_response(413, f"the request body is over {self.limits.max_body_bytes} bytes "
                                          "(http limits.max_body_bytes)", type="invalid_request_error",
                                     code="request_too_large")
        await refusal(scope, receive, send)

    def _refusal(self, scope: Scope) -> JSONResponse | None:
        if scope["path"] in self.public_paths:
            return None
        if self.api_key is None:
            forwarded = [name.decode() for name in FORWARDED_HEADERS if _header(scope, name) is not None]
            if forwarded:
                return error_response(
                    401, f"this server has no API key and the request came through a proxy ({', '.join(forwarded)}), "
                         "so its client cannot be known to be local; start the server with http.api_key (or "
                         "$SPECRAY_API_KEY) set and send 'Authorization: Bearer <key>'",
                    type="authentication_error", code="api_key_required")
            client = scope.get("client")
            if client and is_loopback(client[0]):
                return None
            return error_response(
                403, "this server has no API key, so it answers loopback clients only; start it with http.api_key "
                     "(or $SPECRAY_API_KEY) set and send 'Authorization: Bearer <key>'",
                type="permission_error", code="api_key_required")
        scheme, _, key = (_header(scope, b"authorization") or b"").partition(b" ")
        if scheme.lower() == b"bearer" and secrets.compare_digest(key.strip(), self.api_key):
            return None
        return error_response(401, "invalid or missing API key: send the header 'Authorization: Bearer <key>'",
                              type="authentication_error", code="invalid_api_key")

    async def _read_body(self, scope: Scope, receive: Receive) -> bytes | None:
        """The whole body, or None once it is known to be over the cap (the rest is never read)."""
        limit = self.limits.max_body_bytes
        length = _header(scope, b"content-length")
        if length is not None and length.isdigit() and int(length) > limit:
            return None
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] != "http.request":
                raise _ClientGone
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > limit:
                return None
            chunks.append(chunk)
            if not message.get("more_body", False):
                return b"".join(chunks)


class _ClientGone(Exception):
    """The client disconnected before its body arrived: nobody is left to answer."""


def _replay(body: bytes, receive: Receive) -> Receive:
    """A receive that hands the app the buffered body, then the client's own messages (disconnect)."""
    sent = False

    async def replay() -> Message:
        nonlocal sent
        if sent:
            return await receive()
        sent = True
        return {"type": "http.request", "body": body, "more_body": False}

    return replay
