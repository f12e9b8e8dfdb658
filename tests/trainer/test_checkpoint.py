"""Training checkpoints: round trip, RNG restore, retention, the latest pointer, crash leftovers."""

import random
import shutil

import numpy as np
import pytest
import torch

from specray.trainer.checkpoint import (
    capture_rng_state,
    latest_checkpoint,
    load_checkpoint,
    restore_rng_state,
    save_checkpoint,
)


def _trained():
    """A tiny model, AdamW and a scheduler after one step (so the optimizer has state)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.GELU(), torch.nn.Linear(8, 3))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
    _step(model, opt, sched)
    return model, opt, sched


def _step(model, opt, sched):
    g = torch.Generator().manual_seed(1)
    loss = model(torch.randn(5, 4, generator=g)).pow(2).mean()
    loss.backward()
    opt.step()
    sched.step()
    opt.zero_grad()


def _save(directory, step, keep_last=3, model=None, **kwargs):
    model = model or {"w": torch.full((2, 3), float(step))}
    return save_checkpoint(
        directory, step, model=model, optimizer={}, scheduler={}, loader={"epoch": 0, "position": step},
        rng=capture_rng_state(), keep_last=keep_last, **kwargs,
    )


def test_round_trip_of_every_field(tmp_path):
    model, opt, sched = _trained()
    weights = {"w": torch.randn(3, 4).t(), "b": torch.arange(5)}  # a non-contiguous tensor too
    loader = {"epoch": 2, "position": 8, "seed": 3, "num_samples": 11}
    extra = {"config": {"lr": 1e-2}, "metrics": [{"step": 1, "loss": 0.5}]}
    path = save_checkpoint(
        tmp_path / "ckpt", 12, model=weights | dict(model.state_dict()), optimizer=opt.state_dict(),
        scheduler=sched.state_dict(), loader=loader, rng=capture_rng_state(), extra=extra,
    )
    assert path == tmp_path / "ckpt" / "step-00000012"
    assert sorted(p.name for p in path.iterdir()) == ["model.safetensors", "state.pt"]

    ckpt = load_checkpoint(path)
    assert ckpt.path == path and ckpt.step == 12
    assert ckpt.loader == loader and ckpt.extra == extra and ckpt.scheduler == sched.state_dict()
    assert set(ckpt.model) == set(weights) | set(model.state_dict())
    for name, tensor in (weights | model.state_dict()).items():
        assert ckpt.model[name].dtype == tensor.dtype and torch.equal(ckpt.model[name], tensor)

    # a fresh model + AdamW restored from the checkpoint continues exactly like the original
    fresh = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.GELU(), torch.nn.Linear(8, 3))
    fresh.load_state_dict({k: v for k, v in ckpt.model.items() if k not in weights})
    fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=1e-2, weight_decay=0.1)
    fresh_sched = torch.optim.lr_scheduler.LambdaLR(fresh_opt, lambda s: 1.0 / (1 + s))  # before loading: it sets lr
    fresh_opt.load_state_dict(ckpt.optimizer)
    fresh_sched.load_state_dict(ckpt.scheduler)
    for index, state in opt.state_dict()["state"].items():
        for key, value in state.items():
            assert torch.equal(fresh_opt.state_dict()["state"][index][key], value), key
    _step(model, opt, sched)
    _step(fresh, fresh_opt, fresh_sched)
    for a, b in zip(model.parameters(), fresh.parameters()):
        assert torch.equal(a, b)


def test_rng_restore_reproduces_draws(tmp_path):
    torch.manual_seed(123)
    random.seed(123)
    np.random.seed(123)
    _save(tmp_path, 1)  # captures the RNG state
    expected = (torch.rand(4), random.random(), np.random.rand(3))
    _ = (torch.rand(7), random.random(), np.random.rand(2))  # move every RNG on
    restore_rng_state(load_checkpoint(tmp_path).rng)
    got = (torch.rand(4), random.random(), np.random.rand(3))
    assert torch.equal(got[0], expected[0]) and got[1] == expected[1] and np.array_equal(got[2], expected[2])


def test_rng_state_must_be_complete():
    with pytest.raises(ValueError, match="capture_rng_state"):
        restore_rng_state({"torch": torch.get_rng_state()})


def test_keep_last_retention(tmp_path):
    for step in range(1, 6):
        _save(tmp_path / "a", step, keep_last=2)
        _save(tmp_path / "all", step, keep_last=None)
    assert sorted(p.name for p in (tmp_path / "a").glob("step-*")) == ["step-00000004", "step-00000005"]
    assert len(list((tmp_path / "all").glob("step-*"))) == 5
    # resuming from an earlier step never deletes the checkpoint just written
    _save(tmp_path / "a", 2, keep_last=2)
    assert sorted(p.name for p in (tmp_path / "a").glob("step-*")) == ["step-00000002", "step-00000005"]
    assert load_checkpoint(tmp_path / "a").step == 2
    with pytest.raises(ValueError, match="keep_last"):
        _save(tmp_path / "a", 7, keep_last=0)


def test_latest_pointer(tmp_path):
    assert latest_checkpoint(tmp_path) is None
    for step in (3, 10, 7):
        _save(tmp_path, step, keep_last=None)
    assert (tmp_path / "latest").read_text().strip() == "step-00000007"
    assert latest_checkpoint(tmp_path) == tmp_path / "step-00000007"  # the pointer, not the highest step
    ckpt = load_checkpoint(tmp_path)
    assert ckpt.step == 7 and torch.equal(ckpt.model["w"], torch.full((2, 3), 7.0))
    (tmp_path / "latest").write_text("step-00000099\n")  # points to a missing dir
    assert latest_checkpoint(tmp_path) == tmp_path / "step-00000010"
    (tmp_path / "latest").unlink()
    assert latest_checkpoint(tmp_path) == tmp_path / "step-00000010"


def test_saving_the_same_step_again_replaces_it(tmp_path):
    _save(tmp_path, 4)
    _save(tmp_path, 4, model={"w": torch.ones(1)})
    assert torch.equal(load_checkpoint(tmp_path).model["w"], torch.ones(1))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "step-00000004"]


def test_crash_leftovers_are_ignored(tmp_path):
    _save(tmp_path, 5)
    # a save that crashed before its rename: complete files, but under the temporary name
    shutil.copytree(tmp_path / "step-00000005", tmp_path / ".tmp-step-00000009-dead")
    # a step dir without state.pt (e.g. copied by hand, or a foreign tool)
    (tmp_path / "step-00000008").mkdir()
    shutil.copy(tmp_path / "step-00000005" / "model.safetensors", tmp_path / "step-00000008")
    (tmp_path / "latest").unlink()
    assert latest_checkpoint(tmp_path) == tmp_path / "step-00000005"
    assert load_checkpoint(tmp_path).step == 5
    with pytest.raises(FileNotFoundError, match="state.pt"):
        load_checkpoint(tmp_path / "step-00000008")
    _save(tmp_path, 6)
    assert not list(tmp_path.glob(".tmp-*")), "the next save removes crashed temporaries"


def test_missing_checkpoint_is_file_not_found(tmp_path):
    with pytest.raises(FileNotFoundError, match="no checkpoint at"):
        load_checkpoint(tmp_path / "nowhere")
    with pytest.raises(FileNotFoundError, match="no complete checkpoint under"):
        load_checkpoint(tmp_path)


def test_state_loads_with_weights_only(tmp_path):
    """Nothing in state.pt needs pickle's code execution: torch.load(weights_only=True) reads it."""
    model, opt, sched = _trained()
    np.random.seed(7)
    np.random.rand(3)  # a numpy state with a cached position
    np.random.standard_normal()  # and a cached gaussian
    path = save_checkpoint(tmp_path, 3, model=dict(model.state_dict()), optimizer=opt.state_dict(),
                           scheduler=sched.state_dict(), loader={"epoch": 0}, rng=capture_rng_state(),
                           extra={"config": {"betas": (0.9, 0.95), "name": "x"}})
    state = torch.load(path / "state.pt", weights_only=True)
    assert state["step"] == 3 and state["extra"]["config"]["name"] == "x"
    expected = (np.random.rand(2), np.random.standard_normal())
    restore_rng_state(load_checkpoint(path).rng)
    got = (np.random.rand(2), np.random.standard_normal())
    assert np.array_equal(got[0], expected[0]) and got[1] == expected[1]


def test_a_state_that_needs_pickle_is_refused_before_it_is_written(tmp_path):
    from pathlib import PurePosixPath

    with pytest.raises(TypeError, match=r"extra\['where'\].*PurePosixPath.*plain"):
        _save(tmp_path, 1, extra={"where": PurePosixPath("/x")})
    with pytest.raises(TypeError, match=r"extra\['metrics'\]\[0\]\['loss'\] is a float64"):
        _save(tmp_path, 1, extra={"metrics": [{"loss": np.float64(0.5)}]})  # a float, but pickled as numpy
    assert latest_checkpoint(tmp_path) is None


class _Payload:
    """A pickled object that runs code when loaded, as a hostile state.pt would."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))


def test_a_checkpoint_that_runs_code_when_unpickled_is_refused(tmp_path):
    path = _save(tmp_path, 2)
    marker = tmp_path / "pwned"
    state = torch.load(path / "state.pt", weights_only=True)
    state["extra"] = {"payload": _Payload(marker)}
    torch.save(state, path / "state.pt")
    with pytest.raises(ValueError, match=r"state.pt .*weights_only.*re-?save|older specray|untrusted"):
        load_checkpoint(path)
    assert not marker.exists(), "loading the checkpoint ran code from it"
