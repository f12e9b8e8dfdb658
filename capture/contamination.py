"""Evaluation prompts kept out of training data, and a prompt's kind (chat, code, reasoning).

``EvalOverlap(["mtbench", "humaneval"])`` indexes every prompt of those eval sets (every turn,
``capture/data.py`` ``eval_prompts``). ``match(text)`` names the eval prompt a training text
overlaps, or returns None. Overlap is the usual n-gram test of decontamination: text is
lower-cased and split into words (``\\w+``), and a training text overlaps an eval prompt when
they share a run of ``n`` words (13 by default). An eval prompt shorter than ``n`` words overlaps a
text that contains all of its words in order, as one run. A training prompt that quotes an eval
question inside a longer request is caught as well as a verbatim copy.

``prompt_kind(text)`` sorts a prompt into ``code`` (source code or a programming request),
``reasoning`` (arithmetic, maths, logic puzzles, step-by-step questions) or ``chat`` (the rest),
by the words and symbols it holds. It is a heuristic: it steers a data mix, it is not a classifier.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

from specray.capture.data import eval_prompts

WORD = re.compile(r"\w+")
DEFAULT_NGRAM = 13

_CODE = re.compile(
    r"```|\bdef \w+\(|\bclass \w+[:(]|#include|\bimport \w+|\bfunction\s*\w*\(|console\.log|\bpublic static\b|"
    r"\bSELECT\b.+\bFROM\b|=>|\b(python|javascript|typescript|java|c\+\+|c#|golang|rust|sql|html|css|bash|regex|"
    r"api|code|function|script|program|compile|debug|algorithm|dataframe|json)\b", re.IGNORECASE,
)
_REASONING = re.compile(
    r"\d+\s*[-+*/^=×÷]\s*\d+|\b(solve|calculate|compute|prove|equation|probability|how many|how much|"
    r"percent|integer|derivative|integral|step by step|riddle|puzzle|logic|math|theorem|sum of|average)\b",
    re.IGNORECASE,
)
KINDS = ("chat", "code", "reasoning")


def words(text: str) -> tuple[str, ...]:
    return tuple(WORD.findall(text.lower()))


class EvalOverlap:
    """An index of eval prompts' word n-grams; ``match`` names the eval prompt a text overlaps."""

    def __init__(self, datasets: Iterable[str], *, n: int = DEFAULT_NGRAM,
                 extra: Iterable[tuple[str, str]] = ()):
        """``extra``: more ``(id, text)`` prompts to keep out, beside the eval sets'."""
        if n < 1:
            raise ValueError(f"n={n}: an n-gram has at least one word")
        self.n = n
        self.datasets = tuple(datasets)
        self.grams: dict[tuple[str, ...], str] = {}
        self.short: dict[int, dict[tuple[str, ...], str]] = {}  # eval prompts of fewer than n words, by length
        self.size = 0
        prompts = [p for name in self.datasets for p in eval_prompts(name)] + list(extra)
        for prompt_id, text in prompts:
            w = words(text)
            if not w:
                continue
            self.size += 1
            if len(w) < n:
                self.short.setdefault(len(w), {}).setdefault(w, prompt_id)
            for i in range(len(w) - n + 1):
                self.grams.setdefault(w[i:i + n], prompt_id)

    def match(self, text: str) -> str | None:
        w = words(text)
        for i in range(len(w) - self.n + 1):
            if (hit := self.grams.get(w[i:i + self.n])) is not None:
                return hit
        for length, prompts in self.short.items():
            for i in range(len(w) - length + 1):
                if (hit := prompts.get(w[i:i + length])) is not None:
                    return hit
        return None


def prompt_kind(text: str) -> str:
    if _CODE.search(text):
        return "code"
    if _REASONING.search(text):
        return "reasoning"
    return "chat"
