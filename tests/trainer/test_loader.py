"""FeatureLoader over a real manifest captured from the debug target (see trainer/loader.py)."""

import dataclasses
import re
import shutil

import pytest
import torch

from specray.capture.contract import ContractMismatchError, build_contract
from specray.capture.data import ChatRenderer, Conversation
from specray.capture.server import CaptureServer
from specray.capture.store import FeatureChecksumError, FeatureStore, Manifest, read_manifest, write_manifest
from specray.trainer.loader import FeatureLoader

NUM_SAMPLES = 11  # odd, so drop_last matters for every world size / micro-batch size used below


@dataclasses.dataclass
class Run:
    manifest: Manifest
    store: FeatureStore
    root: object  # pathlib.Path of the store


def _conversations(n):
    return [
        Conversation(f"conv/{i}", (("user", f"Question {i}: " + "why " * (i % 5)), ("assistant", "Because " + "so " * (i % 3))))
        for i in range(n)
    ]


def _capture(target, root, algorithm, dtype, n):
    contract = build_contract(
        algorithm, target_fingerprint=target.target_fingerprint, template_fingerprint=target.template_fingerprint,
        num_target_layers=target.num_layers, hidden_size=target.hidden_size, dtype=dtype,
    )
    store = FeatureStore(root.as_uri())
    renderer = ChatRenderer(target.tokenizer, max_length=256)
    server = CaptureServer(target, contract, store)
    refs = server.capture([renderer.render(c) for c in _conversations(n)])
    server.close()
    uri = (root / "manifest.parquet").as_uri()
    write_manifest(uri, refs, contract=contract, store_uri=store.uri)
    return Run(read_manifest(uri), store, root)


@pytest.fixture(scope="module")
def dflash(debug_target, tmp_path_factory):
    """bfloat16 features, no last_hidden_states."""
    return _capture(debug_target, tmp_path_factory.mktemp("dflash"), "dflash", "bfloat16", NUM_SAMPLES)


@pytest.fixture(scope="module")
def dspark(debug_target, tmp_path_factory):
    """float16 features with last_hidden_states."""
    return _capture(debug_target, tmp_path_factory.mktemp("dspark"), "dspark", "float16", 5)


def _loader(run, **kwargs):
    kwargs.setdefault("micro_batch_size", 2)
    kwargs.setdefault("seed", 0)
    return FeatureLoader(run.manifest, run.store, **kwargs)


def _read(loader, k):
    return [loader.next_batch() for _ in range(k)]


def _ids(batches):
    return [sid for b in batches for sid in b.sample_ids]


def _perm_ids(run, seed, epoch):
    """The documented order, spelled out here rather than imported, so the contract is tested."""
    perm = torch.randperm(len(run.manifest.refs), generator=torch.Generator().manual_seed(seed * 1_000_003 + epoch))
    return [run.manifest.refs[i].sample_id for i in perm.tolist()]


def _assert_batches_equal(got, expected):
    assert [b.sample_ids for b in got] == [b.sample_ids for b in expected]
    for a, b in zip(got, expected):
        for name in ("input_ids", "loss_mask", "attention_mask", "hidden_states"):
            assert torch.equal(getattr(a, name), getattr(b, name)), name
        assert a.num_tokens == b.num_tokens


def _check_batch_against_store(run, batch, max_length=None):
    refs = {r.sample_id: r for r in run.manifest.refs}
    for row, sid in enumerate(batch.sample_ids):
        stored = {k: v[:max_length] for k, v in run.store.get(refs[sid]).items()}
        n = stored["input_ids"].shape[0]
        assert batch.attention_mask[row].sum().item() == n and batch.attention_mask[row, :n].all()
        assert torch.equal(batch.input_ids[row, :n], stored["input_ids"].long())
        assert torch.equal(batch.loss_mask[row, :n], stored["loss_mask"])
        assert torch.equal(batch.hidden_states[row, :n], stored["hidden_states"].float())
        # padding: 0 ids, no loss, no attention, zero features
        assert (batch.input_ids[row, n:] == 0).all() and not batch.loss_mask[row, n:].any()
        assert not batch.attention_mask[row, n:].any() and (batch.hidden_states[row, n:] == 0).all()
        if "last_hidden_states" in stored:
            assert torch.equal(batch.last_hidden_states[row, :n], stored["last_hidden_states"].float())
            assert (batch.last_hidden_states[row, n:] == 0).all()


def test_batch_shapes_padding_and_masks(dflash):
    contract = dflash.manifest.contract
    with _loader(dflash, micro_batch_size=4) as loader:
        batches = _read(loader, 2)
    for batch in batches:
        lengths = [r.num_tokens for sid in batch.sample_ids for r in dflash.manifest.refs if r.sample_id == sid]
        B, T = 4, max(lengths)
        assert len(set(lengths)) > 1, "the batch must mix lengths to exercise padding"
        assert batch.input_ids.shape == (B, T) and batch.input_ids.dtype == torch.int64
        assert batch.loss_mask.shape == (B, T) and batch.loss_mask.dtype == torch.bool
        assert batch.attention_mask.shape == (B, T) and batch.attention_mask.dtype == torch.bool
        assert batch.hidden_states.shape == (B, T, len(contract.layer_ids) * contract.hidden_size)
        assert batch.hidden_states.dtype == torch.float32
        assert batch.last_hidden_states is None
        assert batch.num_tokens == sum(lengths) == batch.attention_mask.sum().item()
        _check_batch_against_store(dflash, batch)


def test_last_hidden_states_when_the_contract_stores_them(dspark):
    with _loader(dspark, micro_batch_size=2) as loader:
        batch = loader.next_batch()
    assert batch.last_hidden_states.shape == (*batch.input_ids.shape, dspark.manifest.contract.hidden_size)
    assert batch.last_hidden_states.dtype == torch.float32
    _check_batch_against_store(dspark, batch)


def test_max_length_cuts_every_tensor(dflash):
    with _loader(dflash, micro_batch_size=3, max_length=5) as loader:
        batch = loader.next_batch()
    assert batch.input_ids.shape[1] == 5 and batch.num_tokens == 15
    _check_batch_against_store(dflash, batch, max_length=5)


def test_order_is_the_documented_seeded_permutation(dflash):
    def epoch_ids(seed):
        with _loader(dflash, micro_batch_size=1, seed=seed, prefetch=3) as loader:
            return [_ids(_read(loader, NUM_SAMPLES)), _ids(_read(loader, NUM_SAMPLES))]

    first = epoch_ids(7)
    assert first == epoch_ids(7)
    assert first == [_perm_ids(dflash, 7, 0), _perm_ids(dflash, 7, 1)]
    assert first[0] != first[1], "each epoch reshuffles"
    assert first != epoch_ids(8)
    assert sorted(first[0]) == sorted(r.sample_id for r in dflash.manifest.refs)


def test_ranks_are_disjoint_and_cover_each_epoch_once(dflash):
    # world_size 2 x mb 2 = 4 per global step: 2 steps per epoch of 11, the last 3 are dropped
    ranks = [_loader(dflash, rank=r, world_size=2, seed=3) for r in range(2)]
    for epoch in range(2):
        reads = [_ids(_read(loader, 2)) for loader in ranks]
        assert not set(reads[0]) & set(reads[1])
        assert len(reads[0]) == len(reads[1]) == 4
        assert sorted(reads[0] + reads[1]) == sorted(_perm_ids(dflash, 3, epoch)[:8])
        assert all(loader.state_dict()["epoch"] == epoch + 1 and loader.position == 0 for loader in ranks)
    for loader in ranks:
        loader.close()


def test_resume_equals_an_uninterrupted_run(dflash):
    with _loader(dflash, seed=5, prefetch=2) as uninterrupted:
        expected = _read(uninterrupted, 10)  # 5 steps per epoch: crosses into epoch 1
    with _loader(dflash, seed=5, prefetch=2) as first:
        head = _read(first, 3)
        state = first.state_dict()
    assert state == {"epoch": 0, "position": 6, "seed": 5, "num_samples": NUM_SAMPLES}
    with _loader(dflash, seed=5, prefetch=2) as resumed:
        resumed.load_state_dict(state)
        tail = _read(resumed, 7)
    _assert_batches_equal(head + tail, expected)


def test_resume_across_a_world_size_change(dflash):
    single = _ids(_read(_loader(dflash, seed=1, prefetch=0), 5))  # mb 2: perm[0:10] of epoch 0
    ranks = [_loader(dflash, seed=1, rank=r, world_size=2) for r in range(2)]
    union = sorted(_ids([loader.next_batch() for loader in ranks]))  # one global step: perm[0:4]
    state = ranks[0].state_dict()
    assert state == ranks[1].state_dict() and state["position"] == 4
    resumed = _loader(dflash, seed=1, prefetch=0)
    resumed.load_state_dict(state)
    assert union == sorted(single[:4])
    assert _ids(_read(resumed, 3)) == single[4:10]

    # 1 -> 2: position 8 leaves 3 < 2 * 2 entries, so world_size 2 goes on at epoch 1
    one = _loader(dflash, seed=1, prefetch=0)
    _read(one, 4)
    two = [_loader(dflash, seed=1, rank=r, world_size=2) for r in range(2)]
    for loader in two:
        loader.load_state_dict(one.state_dict())
        assert (loader.epoch, loader.position) == (1, 0)
    assert [b.sample_ids for b in (two[0].next_batch(), two[1].next_batch())] == [
        _perm_ids(dflash, 1, 1)[0:2], _perm_ids(dflash, 1, 1)[2:4]
    ]
    for loader in ranks + two + [resumed, one]:
        loader.close()


def test_accumulation_steps_read_what_as_many_ranks_read(dflash):
    """An optimizer step reads one window of A * world_size * mb entries, rank-major: 1 rank x 4
    accumulation steps, 2 x 2 and 4 ranks x 1 read the same samples at the same global micro-batch
    index r * A + i in every step, across epochs (11 entries: each epoch drops 3)."""
    def steps(world_size, accumulation_steps, count=6):
        loaders = [_loader(dflash, micro_batch_size=1, seed=2, rank=r, world_size=world_size,
                           accumulation_steps=accumulation_steps, prefetch=r) for r in range(world_size)]
        # per step, in global micro-batch order r * A + i
        reads = [_ids([loader.next_batch() for loader in loaders for _ in range(accumulation_steps)])
                 for _ in range(count)]
        for loader in loaders:
            loader.close()
        return reads

    expected = [_perm_ids(dflash, 2, epoch)[start:start + 4] for epoch in range(3) for start in (0, 4)]
    assert steps(1, 4) == steps(2, 2) == steps(4, 1) == expected
    with pytest.raises(ValueError, match="accumulation_steps must be >= 1"):
        _loader(dflash, accumulation_steps=0)


@pytest.mark.parametrize("k", [0, 1, 4, 6])
def test_prefetch_does_not_change_state(dflash, k):
    with _loader(dflash, prefetch=0) as plain, _loader(dflash, prefetch=4) as ahead:
        assert _ids(_read(plain, k)) == _ids(_read(ahead, k))
        assert plain.state_dict() == ahead.state_dict()
        steps = NUM_SAMPLES // 2
        assert (ahead.epoch, ahead.position) == (k // steps, 2 * (k % steps))


def test_load_state_dict_discards_stale_prefetches(dflash):
    with _loader(dflash, prefetch=4) as loader:
        first = _read(loader, 2)
        loader.load_state_dict({"epoch": 0, "position": 0, "seed": 0, "num_samples": NUM_SAMPLES})
        again = _read(loader, 2)
    _assert_batches_equal(again, first)


def test_contract_mismatch_is_refused(dflash, debug_target):
    other = dataclasses.replace(dflash.manifest.contract, layer_ids=(1, 2))
    with pytest.raises(ContractMismatchError, match="layer_ids"):
        _loader(dflash, expected=other)
    _loader(dflash, expected=dflash.manifest.contract).close()
    refs = list(dflash.manifest.refs)
    refs[3] = dataclasses.replace(refs[3], contract="0123456789abcdef")
    foreign = dataclasses.replace(dflash.manifest, refs=refs)
    with pytest.raises(ContractMismatchError, match=re.escape(refs[3].sample_id)):
        FeatureLoader(foreign, dflash.store, micro_batch_size=1, seed=0)


def test_corrupt_blob_raises_naming_the_key(dflash, tmp_path):
    root = tmp_path / "copy"
    shutil.copytree(dflash.root, root)
    store = FeatureStore(root.as_uri())
    victim = dflash.manifest.refs[4]
    blob = root / victim.key
    data = bytearray(blob.read_bytes())
    data[-1] ^= 0xFF
    blob.write_bytes(bytes(data))
    read = []
    with FeatureLoader(dflash.manifest, store, micro_batch_size=1, seed=0, prefetch=3) as loader:
        with pytest.raises(FeatureChecksumError, match=re.escape(victim.key)):
            for _ in range(NUM_SAMPLES):
                read += loader.next_batch().sample_ids
        assert loader.position == len(read), "the corrupt batch is not counted as read"
        with pytest.raises(FeatureChecksumError, match=re.escape(victim.key)):
            loader.next_batch()  # a retry meets the same blob again, never skips it
    assert victim.sample_id not in read and read == _perm_ids(dflash, 0, 0)[: len(read)]


@pytest.mark.parametrize("kwargs, match", [
    ({"micro_batch_size": 0}, "micro_batch_size must be >= 1"),
    ({"rank": 2, "world_size": 2}, r"rank 2 is not in \[0, world_size=2\)"),
    ({"rank": -1}, "rank -1"),
    ({"micro_batch_size": 6, "world_size": 2}, "fewer than one global micro-step"),
    ({"max_length": 0}, "max_length"),
])
def test_bad_arguments(dflash, kwargs, match):
    with pytest.raises(ValueError, match=match):
        _loader(dflash, **kwargs)


@pytest.mark.parametrize("change, match", [
    ({"seed": 1}, "seed 1"),
    ({"num_samples": NUM_SAMPLES + 1}, f"{NUM_SAMPLES + 1} samples"),
    ({"position": NUM_SAMPLES + 1}, "position"),
])
def test_bad_state_is_refused(dflash, change, match):
    state = {"epoch": 0, "position": 0, "seed": 0, "num_samples": NUM_SAMPLES} | change
    with _loader(dflash) as loader, pytest.raises(ValueError, match=match):
        loader.load_state_dict(state)


def test_closed_loader_refuses_to_read(dflash):
    loader = _loader(dflash)
    loader.close()
    with pytest.raises(ValueError, match="closed"):
        loader.next_batch()
