"""Speculative workers, one per algorithm, behind ``WORKERS`` (plus the plain AR worker)."""

from specray.serving.workers.ar import ARWorker
from specray.serving.workers.dflash import DFlashWorker

WORKERS = {"dflash": DFlashWorker}

__all__ = ["ARWorker", "DFlashWorker", "WORKERS"]
