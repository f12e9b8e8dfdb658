"""Replaying the ack ledger (``trainer/ledger.py``): the transactions, and the state they add up to.

``LedgerState`` is what recovery and audit read: the attempts, every dispatched window's refs,
the trained steps of each attempt, the checkpoints and the deleted windows. It is built one
transaction at a time (``apply``), and ``apply`` refuses any transaction a gang cannot write
(the rules are in the class docstring), naming it and changing nothing. The ledger's writer
applies each transaction to its own state *before* writing it, so a writer never leaves a
history that replay refuses; a reader applies what it reads.

A state is plain data: ``to_json`` / ``from_json`` give the ledger's snapshots (a compacted
replay state written at each durable checkpoint) and ``fork`` a copy that later transactions
can be applied to without changing the original.
"""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass, field
from typing import Iterable

from specray.capture.store import SampleRef, TensorMeta

TXN_FILE = re.compile(r"^txn-(\d{10})\.json$")
TXN_FIELDS = {
    "attempt": ("attempt", "parent", "world_size", "quantum", "checkpoint", "run"),
    "dispatched": ("attempt", "step", "window", "refs"),
    "trained": ("attempt", "step", "window", "sample_ids"),
    "checkpointed": ("attempt", "step", "location"),
    "deleted": ("windows", "keys"),
}
ORIGIN_FIELDS = ("ledger", "attempt", "step", "location")  # an attempt's ``origin``: another ledger's checkpoint


class LedgerError(ValueError):
    """The ledger is torn, has a gap, has a second writer, or contradicts itself."""


class _Refused(Exception):
    """A transaction replay refuses (the problem; ``LedgerState.apply`` names the txn and the fix)."""


def txn_name(seq: int) -> str:
    return f"txn-{seq:010d}.json"


def ref_to_json(ref: SampleRef) -> dict:
    return asdict(ref)


def ref_from_json(data: dict) -> SampleRef:
    tensors = tuple(TensorMeta(t["name"], tuple(t["shape"]), t["dtype"]) for t in data["tensors"])
    return SampleRef(data["sample_id"], data["key"], tensors, data["num_tokens"], data["num_bytes"],
                     data["checksum"], data["contract"])


@dataclass(frozen=True)
class Txn:
    seq: int
    kind: str
    body: dict  # the kind's fields (TXN_FIELDS), plus "time" (and an attempt's "origin")


@dataclass
class LedgerState:
    """What replaying the transactions gives (built by ``Ledger.replay``).

    Replay checks that the history is one a gang can write, and raises ``LedgerError`` naming
    the first transaction that breaks it: attempt ids increase; an attempt resumes from a
    checkpoint the ledger recorded before it (``parent``, of an earlier attempt), or starts a
    stream from another ledger's checkpoint (``origin``: that ledger's position, provenance
    only), never both; a window is dispatched once, by a recorded attempt, at the step after
    the attempt's last trained one; an attempt trains consecutive steps from its start step
    (the parent's or origin's step, else 0) + 1, each the window dispatched for that step
    with exactly its samples; a checkpoint belongs to a recorded attempt, and one that
    dispatched windows checkpoints only its start step or a step it trained (an attempt that
    never dispatched, e.g. offline training, is not checked further).
    """

    attempts: dict[int, dict] = field(default_factory=dict)  # attempt id -> attempt txn body
    windows: dict[str, list[SampleRef]] = field(default_factory=dict)  # window id -> refs, in dispatch order
    trained: dict[int, list[dict]] = field(default_factory=dict)  # attempt -> trained bodies, by step
    checkpoints: list[dict] = field(default_factory=list)  # checkpointed bodies, in write order
    deleted_windows: set[str] = field(default_factory=set)
    seq: int = -1  # the last transaction applied (-1: none)
    _dispatched_by: dict[str, tuple[int, int, int]] = field(default_factory=dict, repr=False)  # window -> (seq, attempt, step)
    _dispatching: set[int] = field(default_factory=set, repr=False)  # attempts that dispatched a window
    _attempt_seq: dict[int, int] = field(default_factory=dict, repr=False)  # attempt -> seq of its txn

    @classmethod
    def from_txns(cls, txns: Iterable[Txn], *, start: "LedgerState | None" = None) -> "LedgerState":
        """Replay ``txns`` (the ones after ``start.seq``, when given: ``start`` is changed and returned)."""
        state = cls() if start is None else start
        for txn in txns:
            state.apply(txn)
        return state

    def apply(self, txn: Txn, *, writing: bool = False) -> None:
        """Apply the next transaction; a ``LedgerError`` naming it (and nothing changed) if replay refuses it.

        ``writing``: the writer checks a transaction it is about to write (the error says it was not written).
        """
        if txn.seq != self.seq + 1:
            raise LedgerError(f"{txn_name(txn.seq)} follows {txn_name(self.seq)}: transactions replay in sequence")
        try:
            getattr(self, f"_apply_{txn.kind}")(txn)
        except _Refused as e:
            fix = ("it was not written: the writer's history is not this ledger's (a resume point the ledger never "
                   "recorded, or a second writer)" if writing else "restore the ledger from a backup")
            raise LedgerError(f"{txn_name(txn.seq)} ({txn.kind}): {e}; {fix}") from None
        self.seq = txn.seq

    # -- the rules ---------------------------------------------------------------------------

    def start_step(self, attempt: int) -> int:
        """The step attempt ``attempt`` started at: its parent's or origin's step, else 0."""
        body = self.attempts[attempt]
        start = body["parent"] or body.get("origin")
        return start["step"] if start else 0

    def _last_step(self, attempt: int) -> int:
        trained = self.trained.get(attempt)
        return trained[-1]["step"] if trained else self.start_step(attempt)

    def unresumable(self, attempt: int, step: int) -> str | None:
        """Why the model of (attempt, step) is not one this ledger describes (None: it is)."""
        if attempt not in self.attempts:
            return f"attempt {attempt} has no attempt txn"
        trained = {t["step"] for t in self.trained.get(attempt, [])}
        if attempt in self._dispatching and step != self.start_step(attempt) and step not in trained:
            return (f"attempt {attempt} never trained step {step} (its last trained step is "
                    f"{self._last_step(attempt)})")
        return None

    def _apply_attempt(self, txn: Txn) -> None:
        body = txn.body
        attempt, parent, origin = body["attempt"], body["parent"], body.get("origin")
        if self.attempts and attempt <= max(self.attempts):
            raise _Refused(f"attempt {attempt} starts after attempt {max(self.attempts)}; attempt ids increase with "
                           "every start (a second writer?)")
        if parent and parent["attempt"] == attempt:
            raise _Refused(f"attempt {attempt} resumes from a checkpoint of itself")
        if parent and self.find_checkpoint(parent["attempt"], parent["step"]) is None:
            raise _Refused(f"attempt {attempt} resumes from checkpoint (attempt {parent['attempt']}, step "
                           f"{parent['step']}), which the ledger never recorded (no checkpointed txn before it)")
        if origin is not None:
            if parent:
                raise _Refused(f"attempt {attempt} names both a parent and an origin; an attempt resumes this ledger's "
                               "checkpoint or starts the stream from another ledger's, not both")
            if not isinstance(origin, dict) or set(origin) != set(ORIGIN_FIELDS):
                raise _Refused(f"attempt {attempt}'s origin {origin!r} is not {{{', '.join(ORIGIN_FIELDS)}}}")
        self.attempts[attempt] = body
        self._attempt_seq[attempt] = txn.seq

    def _apply_dispatched(self, txn: Txn) -> None:
        body = txn.body
        attempt, step, window = body["attempt"], body["step"], body["window"]
        if window in self._dispatched_by:
            raise _Refused(f"window {window} was dispatched already by {txn_name(self._dispatched_by[window][0])}")
        if attempt not in self.attempts:
            raise _Refused(f"attempt {attempt} dispatches window {window} but has no attempt txn before it")
        if step != self._last_step(attempt) + 1:
            raise _Refused(f"attempt {attempt} dispatches step {step}, but its next step is {self._last_step(attempt) + 1}")
        self.windows[window] = [ref_from_json(r) for r in body["refs"]]
        self._dispatched_by[window] = (txn.seq, attempt, step)
        self._dispatching.add(attempt)

    def _apply_trained(self, txn: Txn) -> None:
        body = txn.body
        attempt, step, window = body["attempt"], body["step"], body["window"]
        if window not in self._dispatched_by:
            raise _Refused(f"window {window} was trained but never dispatched")
        if step != self._last_step(attempt) + 1:
            raise _Refused(f"attempt {attempt} trains step {step} after step {self._last_step(attempt)}; an attempt "
                           "trains consecutive steps once each")
        seq, by, at = self._dispatched_by[window]
        if (by, at) != (attempt, step):
            raise _Refused(f"window {window} was dispatched for attempt {by} step {at} ({txn_name(seq)}), not attempt "
                           f"{attempt} step {step}")
        expected = sorted(ref.sample_id for ref in self.windows[window])
        if sorted(body["sample_ids"]) != expected:
            raise _Refused(f"attempt {attempt} step {step} acknowledged {sorted(body['sample_ids'])} but window "
                           f"{window} holds {expected}")
        self.trained.setdefault(attempt, []).append(body)

    def _apply_checkpointed(self, txn: Txn) -> None:
        attempt, step = txn.body["attempt"], txn.body["step"]
        problem = self.unresumable(attempt, step)
        if problem is not None:
            raise _Refused(f"a checkpoint of step {step} of attempt {attempt}, but {problem}")
        self.checkpoints.append(txn.body)

    def _apply_deleted(self, txn: Txn) -> None:
        self.deleted_windows.update(txn.body["windows"])

    # -- questions ---------------------------------------------------------------------------

    @property
    def next_attempt(self) -> int:
        return max(self.attempts, default=-1) + 1

    def last_checkpoint(self) -> dict | None:
        """The newest ``checkpointed`` body (the head of the live lineage), or None."""
        return self.checkpoints[-1] if self.checkpoints else None

    def find_checkpoint(self, attempt: int, step: int) -> dict | None:
        return next((c for c in self.checkpoints if (c["attempt"], c["step"]) == (attempt, step)), None)

    def _chain(self, attempt: int, step: int) -> list[tuple[int, int]]:
        """(attempt, step) of the checkpoint and of its ancestors, newest first."""
        chain: list[tuple[int, int]] = []
        current: tuple[int, int] | None = (attempt, step)
        while current is not None:
            a, s = current
            if a not in self.attempts:
                raise LedgerError(f"checkpoint (attempt {a}, step {s}) names an attempt the ledger has no attempt txn for")
            chain.append(current)
            parent = self.attempts[a]["parent"]  # an earlier attempt (checked by replay): the walk ends
            current = (parent["attempt"], parent["step"]) if parent else None
        return chain

    def lineage(self, attempt: int, step: int) -> list[dict]:
        """``trained`` bodies the model at checkpoint (attempt, step) is made of in this stream, oldest first.

        A stream started from another ledger's checkpoint (an ``origin``) begins with that
        model: what it was trained on is that ledger's lineage, not this one's (``origin``).
        """
        parts = [[t for t in self.trained.get(a, []) if t["step"] <= s] for a, s in self._chain(attempt, step)]
        return [t for part in reversed(parts) for t in part]

    def origin(self, attempt: int, step: int) -> dict | None:
        """The other ledger's checkpoint the lineage of (attempt, step) starts from (None: from scratch)."""
        root, _ = self._chain(attempt, step)[-1]
        return self.attempts[root].get("origin")

    # -- plain data (snapshots) --------------------------------------------------------------

    def fork(self) -> "LedgerState":
        """A copy to apply later transactions to; this state stays as it is (refs and bodies are
        shared: nothing changes them once applied)."""
        return LedgerState(dict(self.attempts), dict(self.windows), {a: list(t) for a, t in self.trained.items()},
                           list(self.checkpoints), set(self.deleted_windows), self.seq, dict(self._dispatched_by),
                           set(self._dispatching), dict(self._attempt_seq))

    def to_json(self) -> dict:
        """Every field as JSON (pairs lists keep int keys and the order windows were dispatched in)."""
        return {
            "seq": self.seq,
            "attempts": [[a, body] for a, body in self.attempts.items()],
            "windows": [[w, [ref_to_json(r) for r in refs]] for w, refs in self.windows.items()],
            "trained": [[a, bodies] for a, bodies in self.trained.items()],
            "checkpoints": self.checkpoints,
            "deleted_windows": sorted(self.deleted_windows),
            "dispatched_by": [[w, list(where)] for w, where in self._dispatched_by.items()],
            "dispatching": sorted(self._dispatching),
            "attempt_seq": [[a, s] for a, s in self._attempt_seq.items()],
        }

    @classmethod
    def from_json(cls, data: dict) -> "LedgerState":
        return cls(
            attempts={a: body for a, body in data["attempts"]},
            windows={w: [ref_from_json(r) for r in refs] for w, refs in data["windows"]},
            trained={a: bodies for a, bodies in data["trained"]},
            checkpoints=data["checkpoints"],
            deleted_windows=set(data["deleted_windows"]),
            seq=data["seq"],
            _dispatched_by={w: tuple(where) for w, where in data["dispatched_by"]},
            _dispatching=set(data["dispatching"]),
            _attempt_seq={a: s for a, s in data["attempt_seq"]},
        )
