"""The draft vocabulary: the ``V_d`` target tokens a drafter predicts over (EAGLE-3's d2t).

``draft_vocabulary(manifest, store, size)`` counts the *supervised* tokens (``loss_mask``) of
every sample in a manifest — what the drafter is trained to predict — and keeps the ``size``
most frequent, ties broken by the smaller id, so the same manifest always gives the same
vocabulary. Every blob is read through ``store.get`` (checksum verified). The result also
reports ``coverage``: the fraction of supervised tokens inside the vocabulary, i.e. the best
position-1 accuracy the drafter could reach on this data.

``dataset_vocabulary(dataset, tokenizer, size)`` counts the same tokens without captured
features: a dataset spec (``sharegpt``, ``jsonl:PATH``, ``records:URI``; capture/data.py) is
rendered with the target's chat template (``ChatRenderer``, as capture renders it) and the
assistant-answer tokens of its ``loss_mask`` are counted — so online training, which has no
manifest when it starts, can use a reduced vocabulary (``drafter.draft_vocab_from``). The same
conversations give the same counts as a manifest captured from them.

Example: counts ``{5: 10, 9: 10, 2: 3, 7: 1}`` and ``size = 2`` give ids ``[5, 9]`` and
coverage ``20 / 24``.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from specray.capture.data import DATASETS, ChatRenderer, Truncation, load_conversations
from specray.capture.store import BlobStore, Manifest

RENDER_MAX_LENGTH = 2048  # tokens per rendered sample when counting a dataset (capture's default data.max_length)


@dataclass(frozen=True)
class DraftVocabulary:
    token_ids: list[int]  # ascending target ids
    coverage: float  # fraction of the counted supervised tokens inside the vocabulary
    counted_tokens: int  # supervised tokens counted
    source: str  # what was counted (a manifest URI)

    def save(self, path: str | Path) -> None:
        """Atomically: a run killed mid-write must not leave a half file for its resume to load."""
        path = Path(path)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(asdict(self)) + "\n")
        os.replace(tmp, path)

    @classmethod
    def load(cls, path: str | Path) -> "DraftVocabulary":
        return cls(**json.loads(Path(path).read_text()))


def is_dataset_spec(source: str) -> bool:
    """True for a dataset spec (``sharegpt``, ``jsonl:PATH``, ``records:URI``), False for a manifest URI."""
    return source in DATASETS or source.startswith(("jsonl:", "records:"))


def _add_counts(counts: torch.Tensor, input_ids: torch.Tensor, loss_mask: torch.Tensor) -> torch.Tensor:
    """``counts`` plus the supervised tokens of one sample (input_ids, loss_mask: [T]), grown as needed."""
    found = torch.bincount(input_ids[loss_mask.bool()].long())
    if len(found) > len(counts):
        counts = torch.cat([counts, counts.new_zeros(len(found) - len(counts))])
    counts[: len(found)] += found
    return counts


def supervised_token_counts(manifest: Manifest, store: BlobStore) -> torch.Tensor:
    """int64 counts of the loss-masked tokens of every sample in ``manifest``, indexed by token id
    (as long as the largest id seen + 1)."""
    counts = torch.zeros(0, dtype=torch.long)
    for ref in manifest.refs:
        tensors = store.get(ref)
        counts = _add_counts(counts, tensors["input_ids"], tensors["loss_mask"])
    return counts


def dataset_token_counts(dataset: str, tokenizer, *, max_length: int = RENDER_MAX_LENGTH,
                         truncation: Truncation = "truncate", limit: int | None = None,
                         endpoint_url: str | None = None) -> torch.Tensor:
    """``supervised_token_counts`` of a dataset's conversations (at most ``limit``) rendered with
    ``tokenizer``'s chat template exactly as capture renders them; samples capture would skip are skipped."""
    renderer = ChatRenderer(tokenizer, max_length=max_length, truncation=truncation)
    counts = torch.zeros(0, dtype=torch.long)
    for conversation in load_conversations(dataset, purpose="train", limit=limit, endpoint_url=endpoint_url):
        sample = renderer.render(conversation)
        if sample is not None:
            counts = _add_counts(counts, sample.input_ids, sample.loss_mask)
    return counts


def top_tokens(counts: torch.Tensor, size: int) -> torch.Tensor:
    """The ``size`` most frequent ids (ties: smaller id first), ascending; ids never seen count 0."""
    if size < 1:
        raise ValueError(f"draft vocabulary size must be >= 1, got {size}")
    if len(counts) < size:
        counts = torch.cat([counts, counts.new_zeros(size - len(counts))])
    # A stable sort of the negated counts keeps equal counts in id order.
    order = torch.sort(-counts, stable=True).indices
    return order[:size].sort().values


def draft_vocabulary(manifest: Manifest, store: BlobStore, size: int, *, source: str) -> DraftVocabulary:
    return vocabulary_from_counts(supervised_token_counts(manifest, store), size, source=source)


def dataset_vocabulary(dataset: str, tokenizer, size: int, *, max_length: int = RENDER_MAX_LENGTH,
                       limit: int | None = None, endpoint_url: str | None = None,
                       source: str | None = None) -> DraftVocabulary:
    """The draft vocabulary of a dataset spec's rendered answers (``dataset_token_counts``);
    ``source`` (default: the dataset spec) is what the vocabulary records it was counted from."""
    counts = dataset_token_counts(dataset, tokenizer, max_length=max_length, limit=limit, endpoint_url=endpoint_url)
    return vocabulary_from_counts(counts, size, source=source or dataset)


def vocabulary_from_counts(counts: torch.Tensor, size: int, *, source: str) -> DraftVocabulary:
    """The ``size`` most counted ids of ``counts`` (indexed by token id) and their coverage."""
    total = int(counts.sum())
    if total == 0:
        raise ValueError(f"{source} has no supervised tokens to build a draft vocabulary from")
    ids = top_tokens(counts, size)
    covered = int(counts[ids[ids < len(counts)]].sum())  # ids past the counts (never seen) cover nothing
    return DraftVocabulary(token_ids=ids.tolist(), coverage=covered / total,
                           counted_tokens=total, source=source)
