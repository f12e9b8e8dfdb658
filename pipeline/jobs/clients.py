"""OpenAI streaming clients that record what each request met: the load bench's and the closed loop's.

    attempt = StreamAttempt(client=0, request=0, retry=0, prompt=3, start_s=0.0)
    stream_chat(openai.OpenAI(base_url=url, api_key=key), model, messages, 64, attempt, t0=time.monotonic())
    attempt.error, attempt.ttft_s, attempt.tokens
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import httpx2
import openai

TRUNCATED = "stream ended without a finish reason"  # a failure the openai client does not raise


@dataclass
class StreamAttempt:
    """One HTTP request of one client; times in seconds from the start of the run."""

    client: int
    request: int  # the client's n-th request (its retries share it)
    retry: int  # 0 = first attempt
    prompt: int
    start_s: float
    end_s: float = 0.0
    ttft_s: float | None = None
    tpot_s: float | None = None  # (last token time - first token time) / (tokens - 1)
    tokens: int = 0
    text: str = ""
    finish_reason: str | None = None
    fingerprint: str | None = None  # specray-drafter-vN, or specray-ar
    error: str | None = None  # the reason, grouped in the report
    detail: str | None = None  # the error's message
    server_error: bool = False  # the server answered with an error (a status or an error event in the stream)

    @property
    def retryable(self) -> bool:
        return self.error is not None and (not self.error.startswith("HTTP 4") or self.error == "HTTP 429")


def stream_chat(client: openai.OpenAI, model: str, messages: list[dict], max_tokens: int, attempt: StreamAttempt,
                t0: float) -> None:
    """One streaming greedy chat completion, recorded into ``attempt``."""
    start, first, last, parts = time.monotonic(), None, None, []
    try:
        stream = client.chat.completions.create(model=model, messages=messages, max_tokens=max_tokens, temperature=0,
                                                stream=True, stream_options={"include_usage": True})
        for chunk in stream:
            attempt.fingerprint = chunk.system_fingerprint or attempt.fingerprint
            if chunk.usage is not None:
                attempt.tokens = chunk.usage.completion_tokens
            for choice in chunk.choices:
                if choice.delta.content:
                    last = time.monotonic()
                    first = first or last
                    parts.append(choice.delta.content)
                attempt.finish_reason = choice.finish_reason or attempt.finish_reason
    except openai.APIStatusError as e:
        attempt.error, attempt.detail, attempt.server_error = f"HTTP {e.status_code}", str(e.message)[:300], True
    except openai.APITimeoutError as e:
        attempt.error, attempt.detail = "timeout", str(e)[:300]
    except openai.APIConnectionError as e:
        attempt.error, attempt.detail = f"connection failed: {type(e.__cause__).__name__}", str(e.__cause__)[:300]
    except openai.APIError as e:  # an error event inside a 200 stream
        attempt.error, attempt.detail, attempt.server_error = "error event in the stream", str(e.body or e.message)[:300], True
    except httpx2.TransportError as e:  # the connection dropped while the stream was read (openai's HTTP client)
        attempt.error, attempt.detail = f"stream dropped: {type(e).__name__}", str(e)[:300]
    attempt.end_s = time.monotonic() - t0
    if attempt.error is None and attempt.finish_reason is None:
        attempt.error = TRUNCATED
    attempt.text = "".join(parts)
    if first is not None:
        attempt.ttft_s = first - start
        attempt.tpot_s = (last - first) / (attempt.tokens - 1) if attempt.tokens > 1 else None
