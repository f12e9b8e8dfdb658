"""Training progress from the trainer gang's rank 0 to the driver's terminal.

    with ProgressFeed(lambda record: print(record["step"], record["loss"])) as feed:
        run_trainer_gang(spec, ..., progress=feed.board)

Rank 0 pushes each metrics record (``trainer/loop.py``: step, loss, ``acc_by_pos``, tokens/s,
and at a checkpoint the live fields ``tau_live`` … again, once measured) to a ``ProgressBoard``
actor; a driver thread polls the board and hands every new record, in order, to ``on_record``
(the pipeline draws a tqdm bar with it). A push does not wait for the driver: a slow terminal
never slows training, and records pushed by a restarted worker group follow the earlier ones.
"""

from __future__ import annotations

import threading
from typing import Callable

import ray

POLL_INTERVAL_S = 0.5


@ray.remote(num_cpus=0)
class ProgressBoard:
    """The records pushed so far, in push order (one rank pushes: Ray keeps one caller's calls in order)."""

    def __init__(self):
        self._records: list[dict] = []

    def push(self, record: dict) -> None:
        self._records.append(record)

    def since(self, seen: int) -> list[dict]:
        """Records after the first ``seen``."""
        return self._records[seen:]


class ProgressFeed:
    """Driver side: a ``ProgressBoard`` and a thread that hands its new records to ``on_record``."""

    def __init__(self, on_record: Callable[[dict], None], interval_s: float = POLL_INTERVAL_S):
        self.on_record, self.interval_s = on_record, interval_s
        self.board = None
        self._seen = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def __enter__(self) -> ProgressFeed:
        self.board = ProgressBoard.remote()
        self._thread = threading.Thread(target=self._poll, name="specray-progress", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(timeout=30)
        self._drain()  # the last records, pushed before the gang returned
        ray.kill(self.board)

    def _drain(self) -> None:
        for record in ray.get(self.board.since.remote(self._seen), timeout=60):
            self._seen += 1
            self.on_record(record)

    def _poll(self) -> None:
        while not self._stop.wait(self.interval_s):
            self._drain()
