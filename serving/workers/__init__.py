"""Speculative workers, one per algorithm, behind ``WORKERS`` (plus the plain AR worker).

Every worker follows the protocol in ``serving/workers/base.py``; a speculative one is built as
``WORKERS[algorithm](runner, drafter, num_speculative_tokens=...)``, and an algorithm that drafts
trees registers that worker in ``TREE_WORKERS`` (the engine's ``tree=True``)."""

from specray.serving.workers.ar import ARWorker
from specray.serving.workers.base import StepOutput, Worker
from specray.serving.workers.dflash import DFlashWorker
from specray.serving.workers.dflash2 import DFlash2Worker
from specray.serving.workers.dspark import DSparkWorker
from specray.serving.workers.eagle3 import Eagle3Worker
from specray.serving.workers.eagle3_tree import Eagle3TreeWorker

WORKERS = {"dflash": DFlashWorker, "dflash2": DFlash2Worker, "dspark": DSparkWorker, "eagle3": Eagle3Worker}
TREE_WORKERS = {"eagle3": Eagle3TreeWorker}

__all__ = ["ARWorker", "DFlashWorker", "Eagle3TreeWorker", "StepOutput", "TREE_WORKERS", "WORKERS", "Worker"]
