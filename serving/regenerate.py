"""The target's own answers to conversations, turn by turn, with the engine (self-distillation data).

``answer_conversations(engine, prompts, params)`` takes conversations' prompt turns (a system
message, if any, and the user turns) and yields one record per conversation as it completes:

    {"id", "messages": [system?, user, assistant, user, assistant, ...], "finish_reason",
     "answer_tokens", "turns"}

Turn ``i``'s answer is generated with every earlier user turn and the target's own earlier
answers in context, so a multi-turn record is what greedy serving produces for that conversation.
An answer ends where the engine stops: the end-of-turn token (``finish_reason: "stop"``, the
token itself not part of the text) or ``params.max_tokens`` (``"length"``). A cut answer ends
the conversation: later user turns are dropped, so only the last answer of a record can be cut,
which is what ``capture/data.py`` ``Conversation.cut`` marks. A turn whose context would exceed
``max_prompt_tokens`` ends the conversation before it (a conversation whose first turn is too
long yields nothing and is counted in ``stats["too_long"]``).

Conversations run under continuous batching: at most ``engine`` slots' worth at once, and a
conversation's next turn is queued as soon as its previous answer finishes, ahead of new
conversations.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

from specray.serving.sampling import SamplingParams

LEN_SLACK = 8  # an engine's max_len beyond max_prompt_tokens + max_tokens


def engine_max_len(max_prompt_tokens: int, params: SamplingParams) -> int:
    """The engine length a regenerating engine needs: the longest context plus one answer."""
    return max_prompt_tokens + params.max_tokens + LEN_SLACK


@dataclass
class PromptTurns:
    id: str
    users: tuple[str, ...]  # the user turns, in order
    system: str | None = None
    kind: str | None = None  # chat / code / reasoning (capture/contamination.py), carried into the record


@dataclass
class _Live:
    prompt: PromptTurns
    messages: list[dict] = field(default_factory=list)
    tokens: int = 0
    handle: object = None


@dataclass
class AnswerStats:
    conversations: int = 0
    answers: int = 0
    tokens: int = 0
    cut: int = 0  # records whose last answer stopped at max_tokens
    too_long: int = 0  # conversations whose first prompt exceeds max_prompt_tokens
    seconds: float = 0.0  # wall time of generation (the engine's steps)

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds if self.seconds else 0.0


def answer_conversations(engine, prompts: Iterable[PromptTurns], params: SamplingParams, *,
                         max_prompt_tokens: int, stats: AnswerStats | None = None) -> Iterator[dict]:
    """Yield each conversation's record as it completes (module docstring); ``stats`` is updated in place."""
    stats = stats if stats is not None else AnswerStats()
    queue, live = deque(prompts), []
    slots = engine.runner.cache.num_slots
    while queue or live:
        while queue and len(live) < slots:
            state = _Live(queue.popleft())
            if state.prompt.system is not None:
                state.messages.append({"role": "system", "content": state.prompt.system})
            if _ask(engine, state, params, max_prompt_tokens):
                live.append(state)
            else:
                stats.too_long += 1
        start = time.perf_counter()
        engine.step()
        stats.seconds += time.perf_counter() - start
        still = []
        for state in live:
            if not state.handle.done:
                still.append(state)
                continue
            result = state.handle.result()
            state.messages.append({"role": "assistant", "content": result.text})
            state.tokens += len(result.token_ids)
            stats.answers += 1
            stats.tokens += len(result.token_ids)
            if result.finish_reason == "stop" and _ask(engine, state, params, max_prompt_tokens):
                still.append(state)  # its next turn is queued
                continue
            stats.conversations += 1
            stats.cut += result.finish_reason == "length"
            yield _record(state, result.finish_reason)
        live = still


def _ask(engine, state: _Live, params: SamplingParams, max_prompt_tokens: int) -> bool:
    """Queue the conversation's next user turn; False when there is none or it does not fit."""
    turn = sum(m["role"] == "user" for m in state.messages)
    if turn >= len(state.prompt.users):
        return False
    messages = [*state.messages, {"role": "user", "content": state.prompt.users[turn]}]
    if len(engine.encode(messages)) > max_prompt_tokens:
        return False
    state.messages = messages
    state.handle = engine.submit(messages, params)
    return True


def _record(state: _Live, finish_reason: str) -> dict:
    record = {"id": state.prompt.id, "messages": state.messages, "finish_reason": finish_reason,
              "answer_tokens": state.tokens, "turns": sum(m["role"] == "assistant" for m in state.messages)}
    if state.prompt.kind is not None:
        record["kind"] = state.prompt.kind
    return record
