"""The OpenAI API's request bodies as this server reads them (serving/openai_api.py serves them).

What an OpenAI or vLLM client sends is read like vLLM's server reads it, with one rule: a value
this server cannot honour is a 400 that names the field, never ignored.

- Implemented: ``model, temperature, top_p, top_k, max_tokens, max_completion_tokens, stop,
  stop_token_ids, seed, stream, stream_options, n`` (1), ``ignore_eos, user``; ``logprobs`` and
  ``top_logprobs`` (chat) or ``logprobs`` (completions): each output token's log-probability
  under the target's raw distribution and up to ``MAX_LOGPROBS`` alternatives. ``null`` means
  the field's default.
- Accepted at their neutral values only (``NEUTRAL``): sampling and formatting fields this
  server does not implement — ``frequency_penalty: 0``, ``presence_penalty: 0``,
  ``repetition_penalty: 1``, ``logit_bias: {}``, ``response_format: {"type": "text"}``,
  ``tools: []``, ``echo: false`` … Any other value is a 400 naming the field and what it accepts.
  Hints that change no output (``metadata``, ``prompt_cache_key``, ``safety_identifier``,
  ``service_tier: auto``) are accepted and ignored.
- Messages: roles ``system``, ``user``, ``assistant`` and ``developer`` (read as ``system``);
  ``content`` a string or a list of text parts (joined with newlines, as vLLM does; image,
  audio and file parts are refused by name); ``name`` is handed to the chat template. Tool
  and function messages are refused (no tool calling).
- A field neither OpenAI's nor vLLM's is a 400 (``unknown field``), as OpenAI answers it.
- Text must be Unicode: a string holding a lone UTF-16 surrogate (``"\\ud800"``, valid JSON) is a
  400 naming the field. A prompt of token ids holds integers (``true`` is not a token id); a
  list of one prompt is read as that prompt, a batch of several is refused.
"""

from __future__ import annotations

from typing import Any, Callable, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, create_model, field_validator

from specray.serving.sampling import MAX_LOGPROBS, MAX_STOP_CHARS, MAX_STOP_STRINGS, SamplingParams

DEFAULT_CHAT_MAX_TOKENS = 256  # when a chat request sets neither max_tokens nor max_completion_tokens
DEFAULT_COMPLETION_MAX_TOKENS = 16  # OpenAI's
MAX_STOP_TOKEN_IDS = 64
CHAT_ROLES = ("system", "user", "assistant", "developer")


def check_text(text: str, what: str = "the text") -> str:
    """``text`` if it encodes as UTF-8; a ValueError naming the first lone surrogate otherwise."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError(f"{what} holds a lone UTF-16 surrogate ({text[e.start]!r}) at character {e.start}, "
                         "which is not Unicode text; send valid UTF-8") from None
    return text


# -- fields accepted at their neutral value only ---------------------------------------------------


def _is(*values) -> Callable[[Any], bool]:
    """A predicate: the value is one of ``values`` (numbers by value, never booleans; None is null)."""

    def same(value, accepted) -> bool:
        if accepted is None or isinstance(accepted, bool):
            return value is accepted
        if isinstance(accepted, (int, float)):
            return type(value) in (int, float) and value == accepted
        return value == accepted

    return lambda value: any(same(value, a) for a in values)


_ANY: Callable[[Any], bool] = lambda value: True  # noqa: E731 - a hint that changes no output
_OFF = _is(None)
_EMPTY = _is(None, [], {})

# field -> (accepts, what it accepts). Every one is an OpenAI or vLLM request field.
NEUTRAL_COMMON: dict[str, tuple[Callable[[Any], bool], str]] = {
    "frequency_penalty": (_is(None, 0), "0 (no penalty)"),
    "presence_penalty": (_is(None, 0), "0 (no penalty)"),
    "repetition_penalty": (_is(None, 1), "1 (no penalty)"),
    "length_penalty": (_is(None, 1), "1"),
    "logit_bias": (_EMPTY, "{} (no bias)"),
    "min_p": (_is(None, 0), "0 (off)"),
    "min_tokens": (_is(None, 0), "0"),
    "best_of": (_is(None, 1), "1"),
    "use_beam_search": (_is(None, False), "false"),
    "include_stop_str_in_output": (_is(None, False), "false"),
    "skip_special_tokens": (_is(None, False), "false (special tokens are returned as text)"),
    "spaces_between_special_tokens": (_is(None, True), "true"),
    "truncate_prompt_tokens": (_OFF, "null (prompts are never truncated)"),
    "prompt_logprobs": (_OFF, "null"),
    "allowed_token_ids": (_OFF, "null"),
    "bad_words": (_EMPTY, "[]"),
    "structured_outputs": (_OFF, "null (no constrained decoding)"),
    "guided_json": (_OFF, "null (no constrained decoding)"),
    "guided_regex": (_OFF, "null (no constrained decoding)"),
    "guided_choice": (_OFF, "null (no constrained decoding)"),
    "guided_grammar": (_OFF, "null (no constrained decoding)"),
    "guided_decoding_backend": (_OFF, "null"),
    "guided_whitespace_pattern": (_OFF, "null"),
    "logits_processors": (_OFF, "null"),
    "priority": (_is(None, 0), "0"),
    "return_tokens_as_token_ids": (_is(None, False), "false"),
    "return_token_ids": (_is(None, False), "false"),
    "kv_transfer_params": (_OFF, "null"),
    "vllm_xargs": (_OFF, "null"),
    "store": (_is(None, False), "false (nothing is stored)"),
    "service_tier": (_is(None, "auto", "default"), "'auto' or 'default'"),
    "metadata": (_ANY, "anything (ignored)"),
    "prompt_cache_key": (_ANY, "anything (ignored)"),
    "prompt_cache_retention": (_ANY, "anything (ignored)"),
    "prompt_cache_options": (_ANY, "anything (ignored)"),
    "cache_salt": (_ANY, "anything (ignored)"),
    "safety_identifier": (_ANY, "anything (ignored)"),
}
NEUTRAL_CHAT = {
    **NEUTRAL_COMMON,
    "response_format": (_is(None, {"type": "text"}), "{'type': 'text'} (no JSON mode or schema)"),
    "tools": (_EMPTY, "[] (no tool calling)"),
    "tool_choice": (_is(None, "none", "auto"), "'none' (no tool calling)"),
    "parallel_tool_calls": (_ANY, "anything (no tool calling)"),
    "functions": (_EMPTY, "[] (no function calling)"),
    "function_call": (_is(None, "none", "auto"), "'none' (no function calling)"),
    "modalities": (_is(None, ["text"]), "['text']"),
    "audio": (_OFF, "null (text only)"),
    "prediction": (_OFF, "null"),
    "web_search_options": (_OFF, "null"),
    "reasoning_effort": (_OFF, "null"),
    "verbosity": (_OFF, "null"),
    "moderation": (_OFF, "null"),
    "echo": (_is(None, False), "false"),
    "add_generation_prompt": (_is(None, True), "true"),
    "continue_final_message": (_is(None, False), "false"),
    "add_special_tokens": (_is(None, False), "false (the chat template places special tokens)"),
    "documents": (_OFF, "null"),
    "chat_template": (_OFF, "null (the target's own template)"),
    "chat_template_kwargs": (_EMPTY, "{}"),
    "mm_processor_kwargs": (_OFF, "null"),
}
NEUTRAL_COMPLETION = {
    **NEUTRAL_COMMON,
    "echo": (_is(None, False), "false (prompt logprobs are not implemented)"),
    "suffix": (_is(None, ""), "null (no insertion)"),
    "add_special_tokens": (_is(None, True), "true"),
}


def _neutral_fields(name: str, table: dict[str, tuple[Callable[[Any], bool], str]]) -> type[BaseModel]:
    """A model of ``table``'s fields (default null) whose validator refuses a value it does not accept."""

    def neutral(cls, value, info):
        accepts, says = table[info.field_name]
        if not accepts(value):
            raise ValueError(f"not implemented by this server, which accepts only {says}")
        return value

    fields = {f: (Any, Field(None, description=f"not implemented: only {says}")) for f, (_, says) in table.items()}
    return create_model(name, __config__=ConfigDict(extra="forbid"), **fields,
                        __validators__={"_neutral": field_validator(*table)(neutral)})


_ChatNeutral = _neutral_fields("_ChatNeutral", NEUTRAL_CHAT)
_CompletionNeutral = _neutral_fields("_CompletionNeutral", NEUTRAL_COMPLETION)


# -- the bodies --------------------------------------------------------------------------------------


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid")  # a field neither OpenAI's nor vLLM's is refused, never ignored


class StreamOptions(_Body):
    include_usage: bool | None = Field(False, description="send a last chunk with token usage")
    continuous_usage_stats: StrictBool | None = Field(None, description="not implemented: only null or false")

    @field_validator("continuous_usage_stats")
    @classmethod
    def _off(cls, value: bool | None) -> bool | None:
        if value:
            raise ValueError("not implemented by this server, which accepts only false")
        return value


class _SamplingFields(_Body):
    model: str | None = Field(None, description="the served model's name (see /v1/models)")
    temperature: float | None = Field(None, ge=0, description="0 = greedy (default 1)")
    top_p: float | None = Field(None, gt=0, le=1, description="nucleus mass, in (0, 1] (default 1)")
    top_k: int | None = Field(None, ge=-1, description="keep the k most likely tokens; 0 or -1 = off")
    stop: str | list[str] | None = Field(
        None, description=f"stop strings (not included in the output): at most {MAX_STOP_STRINGS}, "
                          f"of at most {MAX_STOP_CHARS} characters each")
    stop_token_ids: list[StrictInt] | None = Field(None, max_length=MAX_STOP_TOKEN_IDS,
                                                   description="token ids that stop generation (not output)")
    seed: int | None = Field(None, ge=-(1 << 63), lt=1 << 64,
                             description="seeds sampling: the same output again when the engine runs fixed rounds "
                                         "(no drafter, or speculation: static); with automatic round sizes, the same "
                                         "distribution")
    stream: bool | None = Field(False, description="server-sent events, one chunk per engine step")
    stream_options: StreamOptions | None = None
    n: int | None = Field(1, ge=1, le=1, description="choices per request (only 1)")
    ignore_eos: bool | None = Field(False, description="keep generating past EOS (benchmarks)")
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
        for i, s in enumerate(stops):
            check_text(s, f"stop[{i}]")
        return stop

    @property
    def num_logprobs(self) -> int | None:
        """Alternatives per output token to report (None: no logprobs)."""
        return None

    def sampling_params(self, max_tokens: int) -> SamplingParams:
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        return SamplingParams(max_tokens=max_tokens, temperature=1.0 if self.temperature is None else self.temperature,
                              top_p=1.0 if self.top_p is None else self.top_p, top_k=max(0, self.top_k or 0),
                              stop=tuple(stop), stop_token_ids=tuple(self.stop_token_ids or ()), seed=self.seed,
                              ignore_eos=bool(self.ignore_eos), logprobs=self.num_logprobs)


class CompletionRequest(_SamplingFields, _CompletionNeutral):
    prompt: Any = Field(..., description="text (continued as is, no chat template) or token ids; a list of one "
                                         "of them is that prompt")
    max_tokens: int | None = Field(None, ge=1, description=f"tokens to generate at most "
                                                           f"(default {DEFAULT_COMPLETION_MAX_TOKENS})")
    logprobs: StrictInt | None = Field(None, ge=0, le=MAX_LOGPROBS,
                                       description="report each token's logprob and this many alternatives")

    @field_validator("prompt")
    @classmethod
    def _one_prompt(cls, prompt: Any) -> str | list[int]:
        """Text or token ids (a list of one of them: that one)."""
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]
        elif isinstance(prompt, list) and prompt and all(isinstance(p, (str, list)) for p in prompt):
            raise ValueError(f"a batch of {len(prompt)} prompts is not implemented; send one prompt per request")
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("the prompt is empty")
            return check_text(prompt, "the prompt")
        if isinstance(prompt, list) and all(type(t) is int for t in prompt):
            if not prompt:
                raise ValueError("the prompt is empty")
            return prompt
        raise ValueError("a prompt is a string or a list of token ids (integers; true and false are not token ids)")

    @property
    def num_logprobs(self) -> int | None:
        return self.logprobs


class TextPart(_Body):
    type: Literal["text"]
    text: str


class ChatMessage(_Body):
    role: str = Field(..., description=f"one of {', '.join(CHAT_ROLES)} (developer is read as system)")
    content: str | list[dict] | None = Field(None, description="a string or a list of text parts")
    name: str | None = Field(None, description="the participant's name, handed to the chat template")
    refusal: None = None
    tool_calls: list | None = Field(None, max_length=0, description="only [] (no tool calling)")
    function_call: None = None

    @field_validator("role")
    @classmethod
    def _known_role(cls, role: str) -> str:
        if role in ("tool", "function", "ipython"):
            raise ValueError(f"{role!r} messages carry tool results, and this server implements no tool calling")
        if role not in CHAT_ROLES:
            raise ValueError(f"a role is one of {', '.join(CHAT_ROLES)}, got {role!r}")
        return role

    @field_validator("content")
    @classmethod
    def _text_parts(cls, content: str | list[dict] | None) -> str | list[dict] | None:
        if isinstance(content, str):
            return check_text(content, "the content")
        for i, part in enumerate(content or []):
            kind = part.get("type")
            if kind != "text":
                raise ValueError(f"part {i} is of type {kind!r}; this server takes text parts only "
                                 "({'type': 'text', 'text': ...})")
            check_text(TextPart.model_validate(part).text, f"part {i}'s text")
        return content

    @field_validator("name")
    @classmethod
    def _name_text(cls, name: str | None) -> str | None:
        return name if name is None else check_text(name, "the name")

    @property
    def text(self) -> str:
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        return "\n".join(part["text"] for part in self.content)

    def for_template(self) -> dict:
        """The message as the chat template reads it: developer as system, text parts joined."""
        message = {"role": "system" if self.role == "developer" else self.role, "content": self.text}
        return message | ({"name": self.name} if self.name is not None else {})


class ChatCompletionRequest(_SamplingFields, _ChatNeutral):
    messages: list[ChatMessage] = Field(..., min_length=1)
    max_tokens: int | None = Field(
        None, ge=1, description=f"tokens to generate at most (default {DEFAULT_CHAT_MAX_TOKENS})")
    max_completion_tokens: int | None = Field(None, ge=1, description="the same, newer name; wins over max_tokens")
    logprobs: StrictBool | None = Field(False, description="report each output token's logprob")
    top_logprobs: StrictInt | None = Field(None, ge=0, le=MAX_LOGPROBS,
                                           description="with logprobs: this many alternatives per token")

    @field_validator("top_logprobs")
    @classmethod
    def _top_needs_logprobs(cls, top: int | None, info) -> int | None:
        if top and not info.data.get("logprobs"):
            raise ValueError("top_logprobs needs logprobs: true")
        return top

    @property
    def num_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    @property
    def max_new_tokens(self) -> int:
        return self.max_completion_tokens or self.max_tokens or DEFAULT_CHAT_MAX_TOKENS
