"""Speculative workers, one per algorithm, behind ``WORKERS`` (plus the plain AR worker).

Every worker follows the protocol in ``serving/workers/base.py``; a speculative one is built as
``WORKERS[algorithm](runner, drafter, num_speculative_tokens=..., max_speculative_batch=...)``."""

from specray.serving.workers.ar import ARWorker
from specray.serving.workers.base import StepOutput, Worker
from specray.serving.workers.dflash import DFlashWorker
from specray.serving.workers.eagle3 import Eagle3Worker

WORKERS = {"dflash": DFlashWorker, "eagle3": Eagle3Worker}

__all__ = ["ARWorker", "DFlashWorker", "StepOutput", "WORKERS", "Worker"]
