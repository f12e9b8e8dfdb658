"""Devices and dtypes as configuration: ``auto | cpu | cuda``, resolved where the work runs.

A config names a device kind; the process that runs the work (a capture actor, a trainer rank,
``specray capture`` in-process) resolves it against what it was given:

- ``gpus``: the GPUs this process was granted. Ray sets it (``ray.get_gpu_ids()`` in an actor or
  a gang worker: a worker that asked for no GPU may still *see* every GPU of its node, so what
  it sees is not what it was granted); without Ray it is what torch sees
  (``torch.cuda.device_count()``).
- ``auto``: CUDA when ``gpus > 0``, else the CPU. ``cuda`` with ``gpus == 0``: a ``ValueError``
  naming the config field and the fix. ``cuda:N`` (a driver that picked the device, e.g. a Ray
  Train rank's ``ray.train.torch.get_device()``) is taken as it is.
- dtype ``auto``: bfloat16 on CUDA, float32 on the CPU (the CPU's lossless tests compare with
  transformers in float32).
- precision ``auto`` (the drafter's training compute): bf16 autocast on CUDA, fp32 on the CPU.

    device = resolve_device("auto", field="train.device")          # cpu here, cuda on a GPU box
    dtype = resolve_dtype("auto", device)                          # torch.float32 / torch.bfloat16
"""

from __future__ import annotations

import torch

DEVICE_KINDS = ("auto", "cpu", "cuda")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
DTYPE_NAMES = ("auto", *DTYPES)
PRECISIONS = ("auto", "fp32", "bf16")


def visible_gpus() -> int:
    """GPUs torch sees in this process (0 on a CPU build)."""
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def resolve_device(requested: str | torch.device, *, field: str, gpus: int | None = None,
                   fix: str | None = None) -> torch.device:
    """The device ``requested`` (``auto | cpu | cuda | cuda:N``) means in this process.

    ``gpus`` is what this process was granted (None: what torch sees). ``field`` names the config
    field in errors; ``fix`` replaces the default advice (e.g. the Ray resource to raise)."""
    granted = visible_gpus() if gpus is None else gpus
    if isinstance(requested, str) and requested == "auto":
        if granted == 0:
            return torch.device("cpu")
        requested = "cuda"
    try:
        device = torch.device(requested)
    except RuntimeError:
        raise ValueError(f"{field}={requested!r}: use one of {list(DEVICE_KINDS)}") from None
    if device.type == "cpu":
        return device
    if device.type != "cuda":
        raise ValueError(f"{field}={requested}: use one of {list(DEVICE_KINDS)}")
    if granted == 0:
        where = "this process was granted no GPU" if gpus is not None else "torch sees no CUDA device here"
        raise ValueError(f"{field}=cuda but {where}; "
                         + (fix or f"set {field}=auto (CUDA where a GPU is granted, else the CPU) or {field}=cpu"))
    seen = visible_gpus()
    if seen == 0:
        raise ValueError(f"{field}: {granted} GPU(s) granted, but torch {torch.__version__} sees no CUDA device (a CPU "
                         f"build of torch, or no driver); install a CUDA build of torch or set {field}=cpu")
    if device.index is not None and device.index >= seen:
        raise ValueError(f"{field}={requested}: this process sees {seen} CUDA device(s); use cuda or cuda:0 … "
                         f"cuda:{seen - 1}")
    return device


def resolve_dtype(requested: str, device: torch.device, *, field: str = "target.dtype") -> torch.dtype:
    """``auto``: bfloat16 on CUDA, float32 elsewhere; else the named dtype."""
    if requested == "auto":
        return torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32
    if requested not in DTYPES:
        raise ValueError(f"{field}={requested!r} is not supported; use one of {list(DTYPE_NAMES)}")
    return DTYPES[requested]


CPU_BF16_FLAGS = ("avx512_bf16", "amx_bf16")  # /proc/cpuinfo flags of CPUs that compute in bf16


def cpu_flags() -> set[str] | None:
    """This CPU's feature flags (Linux ``/proc/cpuinfo``), or None where they cannot be read."""
    try:
        text = open("/proc/cpuinfo").read()
    except OSError:
        return None
    return {flag for line in text.splitlines() if line.startswith("flags") for flag in line.split(":", 1)[1].split()}


def resolve_precision(requested: str, device: torch.device, *, field: str = "train.precision") -> bool:
    """Whether the drafter's forward runs under bf16 autocast: ``auto`` = on CUDA only. ``bf16`` on a
    CPU whose flags show no bf16 unit (``CPU_BF16_FLAGS``) is refused: it would emulate bf16, slower
    than fp32 and less exact."""
    if requested not in PRECISIONS:
        raise ValueError(f"{field}={requested!r}: use one of {list(PRECISIONS)}")
    if requested == "auto":
        return torch.device(device).type == "cuda"
    if requested == "bf16" and torch.device(device).type == "cpu":
        flags = cpu_flags()
        if flags is not None and not flags & set(CPU_BF16_FLAGS):
            raise ValueError(f"{field}=bf16 on this CPU: its flags (lscpu) have none of {list(CPU_BF16_FLAGS)}, so "
                             "bf16 would be emulated, slower than fp32 and less exact; set "
                             f"{field}=fp32 (or auto), or train on a CPU with AVX-512 BF16 or AMX, or on a GPU")
    return requested == "bf16"


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.bfloat16`` -> ``"bfloat16"`` (the config's spelling)."""
    return next(name for name, value in DTYPES.items() if value == dtype)


def check_ray_devices(device: str, gpus: float, *, device_field: str, gpus_field: str, who: str) -> None:
    """A Ray worker's device kind against the GPUs it asks Ray for: ``cuda`` needs some (Ray grants
    none otherwise), ``cpu`` wastes them."""
    if device == "cuda" and gpus == 0:
        raise ValueError(f"{device_field}=cuda, but {who} ask Ray for no GPU ({gpus_field}=0), so none is granted "
                         f"to them: set {gpus_field}=1 (or more), or {device_field}=auto")
    if device == "cpu" and gpus > 0:
        raise ValueError(f"{gpus_field}={gpus:g} reserves GPUs that {who} never use with {device_field}=cpu: set "
                         f"{gpus_field}=0 or {device_field}=auto")
