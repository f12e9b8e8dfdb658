"""The draft vocabulary: the ``V_d`` target tokens a drafter predicts over (EAGLE-3's d2t).

``draft_vocabulary(manifest, store, size)`` counts the *supervised* tokens (``loss_mask``) of
every sample in a manifest — what the drafter is trained to predict — and keeps the ``size``
most frequent, ties broken by the smaller id, so the same manifest always gives the same
vocabulary. Every blob is read through ``store.get`` (checksum verified). The result also
reports ``coverage``: the fraction of supervised tokens inside the vocabulary, i.e. the best
position-1 accuracy the drafter could reach on this data.

Example: counts ``{5: 10, 9: 10, 2: 3, 7: 1}`` and ``size = 2`` give ids ``[5, 9]`` and
coverage ``20 / 24``.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from specray.capture.store import BlobStore, Manifest


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


def supervised_token_counts(manifest: Manifest, store: BlobStore) -> torch.Tensor:
    """int64 counts of the loss-masked tokens of every sample in ``manifest``, indexed by token id
    (as long as the largest id seen + 1)."""
    counts = torch.zeros(0, dtype=torch.long)
    for ref in manifest.refs:
        tensors = store.get(ref)
        found = torch.bincount(tensors["input_ids"][tensors["loss_mask"].bool()].long())
        if len(found) > len(counts):
            counts = torch.cat([counts, counts.new_zeros(len(found) - len(counts))])
        counts[: len(found)] += found
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
    counts = supervised_token_counts(manifest, store)
    total = int(counts.sum())
    if total == 0:
        raise ValueError(f"{source} has no supervised tokens to build a draft vocabulary from")
    ids = top_tokens(counts, size)
    covered = int(counts[ids[ids < len(counts)]].sum())  # ids past the counts (never seen) cover nothing
    return DraftVocabulary(token_ids=ids.tolist(), coverage=covered / total,
                           counted_tokens=total, source=source)
