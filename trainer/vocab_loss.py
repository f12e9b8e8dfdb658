"""Losses over the (draft) vocabulary, a bounded number of rows at a time.

A loss over ``V`` tokens per row builds ``[rows, V]`` fp32 logits and log-probabilities (and, for
soft targets, the teacher's probabilities): at 4k supervised rows and a 128k vocabulary, 2 GB each.
``over_rows`` computes such a loss ``rows_per_chunk(V)`` rows at a time through ``chunked_rows``
(``drafters/common.py``). With several chunks each chunk's forward keeps only its per-row outputs
(a loss, an argmax) and the backward recomputes it, so one chunk's vocabulary tensors are alive at
a time; with one chunk (``rows × V`` within ``VOCAB_CHUNK_ELEMENTS``: the debug and embedded
targets' CPU runs) it is the plain computation, nothing recomputed.
"""

from __future__ import annotations

from typing import Any, Callable

from specray.drafters.common import chunked_rows

VOCAB_CHUNK_ELEMENTS = 2**26  # vocabulary entries per chunk: 256 MB per fp32 [rows, V] tensor


def rows_per_chunk(width: int) -> int:
    """Rows of a ``width``-wide vocabulary tensor per chunk."""
    return max(1, VOCAB_CHUNK_ELEMENTS // width)


def fits_one_chunk(rows: int, width: int) -> bool:
    """Whether ``rows`` rows of a ``width``-wide vocabulary tensor are one chunk."""
    return rows <= rows_per_chunk(width)


def over_rows(loss: Callable[[int, int], Any], count: int, width: int) -> Any:
    """``loss(start, stop)`` -> per-row tensors (one, or a tuple) of rows ``start … stop − 1``, over
    ``count`` rows of a ``width``-wide vocabulary; the outputs of the chunks concatenated on dim 0."""
    return chunked_rows(loss, count, rows_per_chunk(width), dim=0)
