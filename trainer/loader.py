"""FeatureLoader: seeded, resumable, DDP-aware micro-batches of captured features.

The loader reads a ``Manifest`` (``capture/store.py``) through any ``FeatureStore``
(``file://`` or ``s3://``) and yields padded ``TrainBatch``es. Usage::

    with FeatureLoader(read_manifest(uri), store, micro_batch_size=4, seed=0,
                       rank=rank, world_size=world_size, expected=contract) as loader:
        batch = loader.next_batch()           # this rank's next micro-batch
        ckpt["loader"] = loader.state_dict()  # {"epoch", "position", "seed", "num_samples"}

Order (identical on every rank, so no communication is needed):

- Epoch ``e`` reads the manifest's refs (``N = len(manifest.refs)``) in the order
  ``torch.randperm(N, generator=torch.Generator().manual_seed(seed * 1_000_003 + e))``.
- One *global micro-step* consumes ``world_size * micro_batch_size`` consecutive entries of
  that permutation, starting at ``position``; rank ``r`` takes the slice
  ``[position + r * mb, position + (r + 1) * mb)``. Example with ``world_size=2, mb=2``:
  ``perm = [7, 3, 9, 0, 5, ...]``, position 0 -> rank 0 reads ``[7, 3]``, rank 1 ``[9, 0]``,
  and the position becomes 4.
- An optimizer step of ``A = accumulation_steps`` micro-batches reads one *window* of
  ``Q = A * world_size * mb`` entries (DESIGN.md §4's quantum), rank-major: micro-batch ``i``
  of rank ``r`` is the window's ``(r * A + i)``-th slice of ``mb`` entries (the core keys its
  random draws by the same ``r * A + i``), so 1 rank × A accumulation steps and A ranks × 1
  read the same samples, each with the same draws, in every step. With ``A = 1`` this is the
  global micro-step above.
- When fewer than ``Q`` entries remain in the epoch at the start of a window they are skipped
  (drop_last) and the next epoch starts at position 0. The state is kept in this normal
  form: ``state_dict()`` never reports a position from which no full step fits.
- ``position`` counts *global* entries, so a state saved under one world size loads under
  another: the union of what the ranks read continues exactly where it stopped (only which
  tail an epoch drops depends on the world size; ``load_state_dict`` normalises a position
  from which the new world size cannot take a full step to the start of the next epoch).

``state_dict()`` describes what ``next_batch()`` has *returned*, never what the background
prefetch (a small thread pool holding up to ``prefetch`` upcoming micro-batches of this
rank) has fetched; ``load_state_dict`` discards stale prefetches.

Every blob is read with ``store.get``, which verifies its checksum: a corrupt blob raises
``FeatureChecksumError`` naming the key when its batch is returned, and is never trained on.
"""

from __future__ import annotations

from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, replace

import torch

from specray.capture.contract import CaptureContract, ContractMismatchError
from specray.capture.store import FeatureStore, Manifest, SampleRef

SEED_STRIDE = 1_000_003  # epoch e of seed s is seeded with s * SEED_STRIDE + e


@dataclass
class TrainBatch:
    """One rank's padded micro-batch; ``B`` samples right-padded to the longest ``T``."""

    input_ids: torch.Tensor  # [B, T] int64, right-padded with 0
    loss_mask: torch.Tensor  # [B, T] bool, False on padding
    attention_mask: torch.Tensor  # [B, T] bool, True on real tokens
    hidden_states: torch.Tensor  # [B, T, L*D] float32, zeros on padding
    last_hidden_states: torch.Tensor | None  # [B, T, D] float32 when the contract stores it, else None
    sample_ids: list[str]
    num_tokens: int  # real tokens in the batch (attention_mask.sum())
    # [B, T] bool: the only positions a block (or chain) may start at, e.g. the anchors a served
    # round used (pipeline/bench/fidelity.py); None = every valid anchor (training)
    anchor_mask: torch.Tensor | None = None

    def to(self, device: torch.device, *, non_blocking: bool = False) -> "TrainBatch":
        """This batch's tensors on ``device`` (the batch itself when they are there already); from
        pinned memory ``non_blocking`` copies overlap the host's next work."""
        if self.input_ids.device == torch.device(device):
            return self
        move = lambda t: None if t is None else t.to(device, non_blocking=non_blocking)  # noqa: E731
        return replace(self, input_ids=move(self.input_ids), loss_mask=move(self.loss_mask),
                       attention_mask=move(self.attention_mask), hidden_states=move(self.hidden_states),
                       last_hidden_states=move(self.last_hidden_states), anchor_mask=move(self.anchor_mask))

    def pin_memory(self) -> "TrainBatch":
        """This batch in page-locked host memory (what a ``non_blocking`` copy to CUDA needs)."""
        pin = lambda t: None if t is None else t.pin_memory()  # noqa: E731
        return replace(self, input_ids=pin(self.input_ids), loss_mask=pin(self.loss_mask),
                       attention_mask=pin(self.attention_mask), hidden_states=pin(self.hidden_states),
                       last_hidden_states=pin(self.last_hidden_states), anchor_mask=pin(self.anchor_mask))


def epoch_permutation(num_samples: int, seed: int, epoch: int) -> torch.Tensor:
    """The order of epoch ``epoch``: ``[N]`` int64 indices into ``manifest.refs``."""
    generator = torch.Generator().manual_seed(seed * SEED_STRIDE + epoch)
    return torch.randperm(num_samples, generator=generator)


def collate(samples: list[dict[str, torch.Tensor]], sample_ids: list[str], *, max_length: int | None = None) -> TrainBatch:
    """Right-pad per-sample feature dicts (as stored, ``[T]``/``[T, W]``) into a ``TrainBatch``."""
    if max_length is not None:
        samples = [{name: t[:max_length] for name, t in s.items()} for s in samples]
    lengths = [int(s["input_ids"].shape[0]) for s in samples]
    B, T = len(samples), max(lengths)
    width = samples[0]["hidden_states"].shape[-1]
    has_last = "last_hidden_states" in samples[0]
    input_ids = torch.zeros(B, T, dtype=torch.int64)  # [B, T]
    loss_mask = torch.zeros(B, T, dtype=torch.bool)  # [B, T]
    attention_mask = torch.zeros(B, T, dtype=torch.bool)  # [B, T]
    hidden = torch.zeros(B, T, width, dtype=torch.float32)  # [B, T, L*D]
    last = torch.zeros(B, T, samples[0]["last_hidden_states"].shape[-1], dtype=torch.float32) if has_last else None  # [B, T, D]
    for row, (sample, n) in enumerate(zip(samples, lengths)):
        input_ids[row, :n] = sample["input_ids"]
        loss_mask[row, :n] = sample["loss_mask"]
        attention_mask[row, :n] = True
        hidden[row, :n] = sample["hidden_states"]
        if last is not None:
            last[row, :n] = sample["last_hidden_states"]
    return TrainBatch(input_ids, loss_mask, attention_mask, hidden, last, list(sample_ids), sum(lengths))


def check_refs(manifest: Manifest) -> None:
    """Every ref must carry the manifest's contract id and the tensors that contract stores."""
    contract = manifest.contract
    foreign = [r.sample_id for r in manifest.refs if r.contract != contract.contract_id]
    if foreign:
        raise ContractMismatchError(
            f"{len(foreign)} sample(s) of the manifest (e.g. {foreign[:3]}) were captured under another contract "
            f"than the manifest's {contract.contract_id}; rebuild the manifest from one capture run"
        )
    widths = contract.tensor_widths()
    for ref in manifest.refs:
        stored = {meta.name: meta.shape for meta in ref.tensors}
        for name, (width, _) in widths.items():
            shape = stored.get(name)
            if shape is None:
                raise ContractMismatchError(
                    f"sample {ref.sample_id!r} ({ref.key}) has no {name!r} tensor (it has {sorted(stored)}), "
                    f"but contract {contract.contract_id} stores it; re-capture it"
                )
            if shape[0] != ref.num_tokens or (width and tuple(shape[1:]) != (width,)):
                raise ContractMismatchError(
                    f"sample {ref.sample_id!r} ({ref.key}) stores {name} with shape {shape}, but contract "
                    f"{contract.contract_id} implies [{ref.num_tokens}{', ' + str(width) if width else ''}]; re-capture it"
                )


class FeatureLoader:
    """Seeded, exactly resumable micro-batches of one rank (see the module docstring).

    ``epoch``/``position`` name the next global micro-step to be returned.
    """

    def __init__(
        self, manifest: Manifest, store: FeatureStore, *, micro_batch_size: int, seed: int,
        rank: int = 0, world_size: int = 1, accumulation_steps: int = 1, expected: CaptureContract | None = None,
        max_length: int | None = None, prefetch: int = 2, pin_memory: bool = False,
    ):
        if micro_batch_size < 1:
            raise ValueError(f"micro_batch_size must be >= 1, got {micro_batch_size}")
        if accumulation_steps < 1:
            raise ValueError(f"accumulation_steps must be >= 1, got {accumulation_steps}")
        if world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {world_size}")
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is not in [0, world_size={world_size}); pass this process's DDP rank")
        if max_length is not None and max_length < 1:
            raise ValueError(f"max_length must be a positive number of tokens or None, got {max_length}")
        if prefetch < 0:
            raise ValueError(f"prefetch must be >= 0 micro-batches (0 = fetch synchronously), got {prefetch}")
        if expected is not None:  # before the size check: features of another contract are the deeper problem
            expected.check_compatible(manifest.contract, what="manifest features")
        check_refs(manifest)
        window = accumulation_steps * world_size * micro_batch_size
        if len(manifest.refs) < window:
            raise ValueError(
                f"the manifest has {len(manifest.refs)} samples, fewer than one global micro-step per accumulation "
                f"step: accumulation_steps * world_size * micro_batch_size = {accumulation_steps} * {world_size} * "
                f"{micro_batch_size} = {window}; capture more samples or lower micro_batch_size"
            )
        self.manifest = manifest
        self.store = store
        self.micro_batch_size = micro_batch_size
        self.seed = seed
        self.rank = rank
        self.world_size = world_size
        self.accumulation_steps = accumulation_steps
        self.max_length = max_length
        self.prefetch = prefetch
        self.pin_memory = pin_memory  # pinned batches (a CUDA rank copies them without blocking)
        self.num_samples = len(manifest.refs)
        self._epoch, self._position = 0, 0
        self._origin = (0, 0)  # (epoch, position) the run started reading at: windows start there + k * Q
        self._perms: dict[int, torch.Tensor] = {}
        self._pending: deque[tuple[tuple[int, int], Future]] = deque()  # ((epoch, position), future)
        self._pool = ThreadPoolExecutor(max_workers=prefetch, thread_name_prefix="specray-loader") if prefetch else None
        self._closed = False

    # -- position --------------------------------------------------------------------------

    @property
    def epoch(self) -> int:
        return self._epoch

    @property
    def position(self) -> int:
        return self._position

    @property
    def global_step_size(self) -> int:
        return self.world_size * self.micro_batch_size

    @property
    def window(self) -> int:
        """Q: the entries one optimizer step reads over every rank and accumulation step."""
        return self.accumulation_steps * self.global_step_size

    def _window_start(self, epoch: int, position: int) -> int:
        """Where the window holding ``position`` starts (windows start at the epoch's origin + k * Q)."""
        origin = self._origin[1] if epoch == self._origin[0] else 0
        return position - (position - origin) % self.window

    def _normalise(self, epoch: int, position: int) -> tuple[int, int]:
        """drop_last: a window start from which no full window fits moves to the next epoch (inside a
        window every micro-step fits: its window did)."""
        if position == self._window_start(epoch, position) and self.num_samples - position < self.window:
            return epoch + 1, 0
        return epoch, position

    def _advance(self, cursor: tuple[int, int]) -> tuple[int, int]:
        epoch, position = cursor
        return self._normalise(epoch, position + self.global_step_size)

    def _refs_at(self, cursor: tuple[int, int]) -> list[SampleRef]:
        epoch, position = cursor
        if epoch not in self._perms:
            self._perms = {e: p for e, p in self._perms.items() if e >= epoch - 1}  # keep at most two epochs
            self._perms[epoch] = epoch_permutation(self.num_samples, self.seed, epoch)
        window = self._window_start(epoch, position)
        micro = (position - window) // self.global_step_size  # i: this micro-step's index in its window
        start = window + (self.rank * self.accumulation_steps + micro) * self.micro_batch_size
        indices = self._perms[epoch][start : start + self.micro_batch_size].tolist()
        return [self.manifest.refs[i] for i in indices]

    # -- reading ---------------------------------------------------------------------------

    def _fetch(self, refs: list[SampleRef]) -> TrainBatch:
        samples = [self.store.get(ref) for ref in refs]  # verifies every checksum
        batch = collate(samples, [r.sample_id for r in refs], max_length=self.max_length)
        return batch.pin_memory() if self.pin_memory else batch  # in the prefetch thread, off the step's path

    def _fill(self) -> None:
        """Keep ``prefetch`` micro-batches in flight, starting at the current position."""
        cursor = self._pending[-1][0] if self._pending else None
        while len(self._pending) < self.prefetch:
            cursor = (self._epoch, self._position) if cursor is None else self._advance(cursor)
            self._pending.append((cursor, self._pool.submit(self._fetch, self._refs_at(cursor))))

    def next_batch(self) -> TrainBatch:
        """This rank's micro-batch at (epoch, position); then advance one global micro-step."""
        if self._closed:
            raise ValueError("this FeatureLoader is closed; create a new one to keep reading")
        cursor = (self._epoch, self._position)
        if self._pool is None:
            batch = self._fetch(self._refs_at(cursor))
        else:
            self._fill()
            head, future = self._pending.popleft()
            assert head == cursor, f"prefetch queue out of step: {head} != {cursor}"
            try:
                batch = future.result()  # re-raises FeatureChecksumError of this batch's blobs
            except BaseException:
                self._discard_prefetch()  # a retry refetches this very batch (position is unchanged)
                raise
        self._epoch, self._position = self._advance(cursor)
        if self._pool is not None:
            self._fill()
        return batch

    def __iter__(self):
        while True:
            yield self.next_batch()

    # -- state -----------------------------------------------------------------------------

    def state_dict(self) -> dict:
        return {"epoch": self._epoch, "position": self._position, "seed": self.seed, "num_samples": self.num_samples}

    def load_state_dict(self, state: dict) -> None:
        missing = {"epoch", "position", "seed", "num_samples"} - set(state)
        if missing:
            raise ValueError(f"loader state lacks {sorted(missing)}; pass what FeatureLoader.state_dict() returned")
        if state["seed"] != self.seed:
            raise ValueError(
                f"loader state was saved with seed {state['seed']}, this loader has seed {self.seed}: the sample "
                f"order would differ; construct the loader with seed={state['seed']} to resume"
            )
        if state["num_samples"] != self.num_samples:
            raise ValueError(
                f"loader state was saved over {state['num_samples']} samples, this manifest has {self.num_samples}: "
                "positions would point at other samples; resume with the manifest the run started with"
            )
        epoch, position = int(state["epoch"]), int(state["position"])
        if epoch < 0 or not 0 <= position <= self.num_samples:
            raise ValueError(f"loader state has epoch {epoch}, position {position}; need epoch >= 0 and 0 <= position <= {self.num_samples}")
        self._discard_prefetch()
        self._origin = (epoch, position)  # a checkpoint is taken between optimizer steps: a window starts here
        self._epoch, self._position = self._normalise(epoch, position)

    def _discard_prefetch(self) -> None:
        for _, future in self._pending:
            future.cancel()  # a running fetch finishes in the background and is ignored
        self._pending.clear()

    # -- lifetime --------------------------------------------------------------------------

    def close(self) -> None:
        self._discard_prefetch()
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
        self._closed = True

    def __enter__(self) -> "FeatureLoader":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self):
        pool = getattr(self, "_pool", None)
        if pool is not None:
            pool.shutdown(wait=False, cancel_futures=True)
