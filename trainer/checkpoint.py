"""Training checkpoints: everything needed to resume a run bit-for-bit (not the serving export).

Layout under a run's checkpoint directory::

    ckpt/
      step-00000012/
        model.safetensors   # the trainable drafter tensors the caller passed
        state.pt            # torch.save({step, optimizer, scheduler, loader, rng, extra})
      latest                # text file: "step-00000012"

``state.pt`` holds only tensors and plain values (dict, list, tuple, str, int, float, bool,
None), checked before it is written, and is read with ``torch.load(weights_only=True)``: a
checkpoint is data, and whoever can write checkpoint storage must not be able to run code in
the trainers or the driver. A ``state.pt`` that needs more (written by an older specray, which
pickled numpy's RNG state, or tampered with) is refused.

A save writes ``.tmp-step-…`` next to the final directory and renames it into place, then
replaces ``latest`` with ``os.replace``; a crash at any moment leaves either the previous
checkpoint or the new one, never a half-written directory that ``latest_checkpoint`` would
pick. Leftover ``.tmp-*`` directories of crashed saves are removed by the next save (one
writer per directory: rank 0). Usage::

    save_checkpoint("runs/x/ckpt", step, model=drafter_state, optimizer=opt.state_dict(),
                    scheduler=sched.state_dict(), loader=loader.state_dict(), rng=capture_rng_state())
    ckpt = load_checkpoint("runs/x/ckpt")   # the latest complete checkpoint
    restore_rng_state(ckpt.rng)
"""

from __future__ import annotations

import os
import pickle
import random
import re
import shutil
import uuid
import warnings
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file, save_file

MODEL_FILE = "model.safetensors"
STATE_FILE = "state.pt"
LATEST_FILE = "latest"
TMP_PREFIX = ".tmp-"
_STEP_DIR = re.compile(r"^step-(\d{8,})$")
# What torch.load(weights_only=True) reads, by exact type (a numpy float is a float, but not plain)
_MAPPINGS = (dict, OrderedDict)
_SEQUENCES = (list, tuple, torch.Size)
_SCALARS = (str, int, float, bool, type(None))


def capture_rng_state() -> dict:
    """Every RNG a training step draws from: torch CPU, python ``random``, numpy, and CUDA.

    Plain values and tensors only (numpy's state array becomes an int64 tensor), so the state
    loads with ``weights_only=True``.
    """
    name, keys, pos, has_gauss, cached_gaussian = np.random.get_state()
    numpy_state = {"bit_generator": name, "keys": torch.from_numpy(keys.astype(np.int64)),  # [624]
                   "pos": int(pos), "has_gauss": int(has_gauss), "cached_gaussian": float(cached_gaussian)}
    state = {"torch": torch.get_rng_state(), "python": random.getstate(), "numpy": numpy_state}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng_state(state: dict) -> None:
    """Inverse of ``capture_rng_state``; the next draws equal those after the capture."""
    missing = {"torch", "python", "numpy"} - set(state)
    if missing:
        raise ValueError(f"RNG state lacks {sorted(missing)}; pass what capture_rng_state() returned")
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    n = state["numpy"]
    np.random.set_state((n["bit_generator"], n["keys"].numpy().astype(np.uint32), n["pos"], n["has_gauss"],
                         n["cached_gaussian"]))
    if "cuda" in state:
        if torch.cuda.is_available():
            torch.cuda.set_rng_state_all(state["cuda"])
        else:
            warnings.warn("the checkpoint holds CUDA RNG state but CUDA is not available; it is not restored")


@dataclass
class Checkpoint:
    path: Path  # the step-* directory
    step: int
    model: dict[str, torch.Tensor]  # trainable drafter state (what the caller passed), on CPU
    optimizer: dict
    scheduler: dict
    loader: dict
    rng: dict
    extra: dict  # e.g. config, metrics history


def step_dir_name(step: int) -> str:
    return f"step-{step:08d}"


def _is_complete(path: Path) -> bool:
    return (path / MODEL_FILE).is_file() and (path / STATE_FILE).is_file()


def _step_dirs(directory: Path) -> list[tuple[int, Path]]:
    """All ``step-*`` directories (complete or not), by step."""
    found = []
    for entry in directory.iterdir() if directory.is_dir() else ():
        match = _STEP_DIR.match(entry.name)
        if match and entry.is_dir():
            found.append((int(match.group(1)), entry))
    return sorted(found)


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_latest(directory: Path, name: str) -> None:
    tmp = directory / f"{TMP_PREFIX}{LATEST_FILE}-{uuid.uuid4().hex}"
    tmp.write_text(name + "\n")
    _fsync(tmp)
    os.replace(tmp, directory / LATEST_FILE)
    _fsync(directory)


def _check_plain(value, where: str) -> None:
    """Raise ``TypeError`` naming the first value ``torch.load(weights_only=True)`` would refuse."""
    if type(value) in _MAPPINGS:
        for key, item in value.items():
            if type(key) not in (str, int):
                raise TypeError(f"checkpoint state {where} has a key of type {type(key).__name__}; use str or int keys")
            _check_plain(item, f"{where}[{key!r}]")
    elif type(value) in _SEQUENCES:
        for index, item in enumerate(value):
            _check_plain(item, f"{where}[{index}]")
    elif type(value) not in _SCALARS and not isinstance(value, torch.Tensor):
        raise TypeError(f"checkpoint state {where} is a {type(value).__name__}; a checkpoint holds only tensors and "
                        "plain values (dict, list, tuple, str, int, float, bool, None): convert it (e.g. str(path))")


def _prune(directory: Path, keep: Path, keep_last: int) -> None:
    """Keep ``keep`` (the checkpoint just written) and the newest ``keep_last - 1`` others."""
    others = [path for _, path in _step_dirs(directory) if path != keep]
    for path in others[: max(len(others) - (keep_last - 1), 0)]:
        shutil.rmtree(path)


def save_checkpoint(
    directory: str | Path, step: int, *, model: dict[str, torch.Tensor], optimizer: dict, scheduler: dict,
    loader: dict, rng: dict, extra: dict | None = None, keep_last: int | None = 3,
) -> Path:
    """Write ``directory/step-{step:08d}`` atomically, point ``latest`` at it, prune old ones.

    An existing directory of the same step (a run resumed from an earlier checkpoint) is
    replaced. ``keep_last=None`` keeps every checkpoint.
    """
    if step < 0:
        raise ValueError(f"step must be >= 0, got {step}")
    if keep_last is not None and keep_last < 1:
        raise ValueError(f"keep_last must be >= 1 (or None to keep every checkpoint), got {keep_last}")
    bad = [k for k, v in model.items() if not isinstance(v, torch.Tensor)]
    if bad:
        raise TypeError(f"model must map names to tensors; {bad} are not tensors (pass module.state_dict())")
    state = {"step": step, "optimizer": optimizer, "scheduler": scheduler, "loader": loader, "rng": rng, "extra": extra or {}}
    for name, value in state.items():
        _check_plain(value, name)
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    for leftover in directory.glob(f"{TMP_PREFIX}*"):  # crashed saves: never complete, never read
        if leftover.is_dir():
            shutil.rmtree(leftover)
        else:
            leftover.unlink()

    name = step_dir_name(step)
    final = directory / name
    tmp = directory / f"{TMP_PREFIX}{name}-{uuid.uuid4().hex}"
    tmp.mkdir()
    save_file({k: v.detach().cpu().contiguous() for k, v in model.items()}, str(tmp / MODEL_FILE))
    torch.save(state, tmp / STATE_FILE)
    for path in (tmp / MODEL_FILE, tmp / STATE_FILE, tmp):
        _fsync(path)
    if final.exists():  # move the old one aside first: rename cannot replace a non-empty directory
        old = directory / f"{TMP_PREFIX}{name}-replaced-{uuid.uuid4().hex}"
        os.rename(final, old)
        os.rename(tmp, final)
        shutil.rmtree(old)
    else:
        os.rename(tmp, final)
    _fsync(directory)
    _write_latest(directory, name)
    if keep_last is not None:
        _prune(directory, final, keep_last)
    return final


def latest_checkpoint(directory: str | Path) -> Path | None:
    """The step directory ``latest`` names if complete, else the highest complete one, else None."""
    directory = Path(directory)
    pointer = directory / LATEST_FILE
    if pointer.is_file():
        name = pointer.read_text().strip()
        if _STEP_DIR.match(name) and _is_complete(directory / name):
            return directory / name
    complete = [path for _, path in _step_dirs(directory) if _is_complete(path)]
    return complete[-1] if complete else None


def load_checkpoint(path_or_directory: str | Path) -> Checkpoint:
    """Load one ``step-*`` directory, or the latest complete one under a checkpoint directory.

    Tensors load on CPU; ``optimizer.load_state_dict`` moves its state to the parameters' device.
    """
    path = Path(path_or_directory)
    if not path.is_dir():
        raise FileNotFoundError(f"no checkpoint at {path}: give a step-* directory or the directory holding them")
    if not _STEP_DIR.match(path.name):
        found = latest_checkpoint(path)
        if found is None:
            raise FileNotFoundError(
                f"no complete checkpoint under {path} (a step-* directory with {MODEL_FILE} and {STATE_FILE}); "
                "start the run from scratch or point at another checkpoint directory"
            )
        path = found
    missing = [f for f in (MODEL_FILE, STATE_FILE) if not (path / f).is_file()]
    if missing:
        raise FileNotFoundError(f"checkpoint {path} is incomplete: {missing} missing; load another step")
    try:
        state = torch.load(path / STATE_FILE, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        needs = re.search(r"GLOBAL (\S+)", str(e))
        raise ValueError(
            f"checkpoint {path / STATE_FILE} holds objects that torch.load(weights_only=True) refuses "
            f"({'it needs ' + needs.group(1) if needs else 'not plain data'}): it was written by an older specray "
            "(which pickled numpy's RNG state) or tampered with, and loading it would run code from checkpoint "
            "storage. Resume from a checkpoint this specray wrote, or start from scratch"
        ) from None
    return Checkpoint(
        path=path, step=state["step"], model=load_file(str(path / MODEL_FILE)), optimizer=state["optimizer"],
        scheduler=state["scheduler"], loader=state["loader"], rng=state["rng"], extra=state["extra"],
    )
