"""Devices in the configs and in Ray's requests: ``target.device`` / ``train.device`` take
``auto | cpu | cuda``, capture actors and gang workers ask Ray for the GPUs their device needs, the
gang runs NCCL on GPUs and gloo on CPUs, and ``cuda`` where no GPU exists is refused naming the field."""

import pytest
import torch

from specray.actors.capture import actor_options
from specray.actors.trainer import gang_scaling
from specray.capture.devices import visible_gpus
from specray.pipeline.cli import main
from specray.pipeline.config import ConfigError, PipelineConfig, TrainJobConfig, load_config

QUICKSTART = "manifests/quickstart.yaml"


def test_devices_default_to_auto_and_resolve_to_the_cpu_here():
    cfg = load_config(PipelineConfig, QUICKSTART, [])
    assert (cfg.target.device, cfg.target.dtype, cfg.train.device, cfg.train.precision) == ("auto",) * 4
    assert (cfg.capture.num_gpus_per_actor, cfg.train.gpus_per_worker) == (0, 0)
    spec = cfg.train_job("m.parquet").train_spec(device_field="train.device")
    assert (spec.device, spec.precision, spec.device_field, spec.precision_field) == (
        "auto", "auto", "train.device", "train.precision")
    assert not spec.optim.bf16  # resolved on the rank's device (build_rank), not in the driver


@pytest.mark.parametrize("overrides, message", [
    (["train.device=cuda"], r"train\.device=cuda, but trainer gang workers ask Ray for no GPU \(train\.gpus_per_worker=0\)"
                            r", so none is granted to them: set train\.gpus_per_worker=1"),
    (["target.device=cuda"], r"target\.device=cuda, but capture actors ask Ray for no GPU "
                             r"\(capture\.num_gpus_per_actor=0\).*set capture\.num_gpus_per_actor=1"),
    (["train.device=cpu", "train.gpus_per_worker=1"], r"train\.gpus_per_worker=1 reserves GPUs that trainer gang "
                                                      r"workers never use with train\.device=cpu"),
    (["capture.num_gpus_per_actor=2.5"], r"capture\.num_gpus_per_actor: .*use a whole number \(2 or 3\)"),
    (["train.device=gpu"], r"train\.device: Input should be 'auto', 'cpu' or 'cuda'"),
    (["train.precision=fp16"], r"train\.precision: Input should be 'auto', 'fp32' or 'bf16'"),
    (["target.dtype=int8"], r"target\.dtype: Input should be 'auto', 'float32', 'bfloat16' or 'float16'"),
])
def test_a_device_without_its_ray_resources_is_refused_naming_the_field(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config(PipelineConfig, QUICKSTART, overrides)


def test_gpu_requests_reach_ray():
    load_config(PipelineConfig, QUICKSTART, ["train.device=cuda", "train.gpus_per_worker=1",
                                            "target.device=cuda", "capture.num_gpus_per_actor=2"])
    scaling, backend = gang_scaling(2, 4.0, 1)
    assert scaling.use_gpu and scaling.num_workers == 2 and backend.backend == "nccl"
    assert scaling.resources_per_worker == {"CPU": 4.0, "GPU": 1}
    scaling, backend = gang_scaling(3, 1.0, 0)
    assert not scaling.use_gpu and scaling.resources_per_worker == {"CPU": 1.0} and backend.backend == "gloo"
    assert actor_options(2.0, 0.5, 3) == {"num_cpus": 2.0, "num_gpus": 0.5, "max_restarts": 3, "max_task_retries": 0}


@pytest.mark.skipif(visible_gpus() > 0, reason="this machine has a GPU")
def test_specray_train_on_cuda_without_a_gpu_exits_2_naming_the_field(tmp_path, capsys):
    code = main(["train", "-c", "manifests/train-dflash-quickstart.yaml", "target.name=debug",
                 f"data.manifest={tmp_path / 'none.parquet'}", f"output.run_dir={tmp_path / 'run'}",
                 "trainer.device=cuda"])
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err
    assert "trainer.device=cuda but torch sees no CUDA device here; set trainer.device=auto" in err


def test_specray_train_config_carries_device_and_precision():
    cfg = load_config(TrainJobConfig, "manifests/train-dflash-quickstart.yaml",
                      ["trainer.device=cpu", "trainer.precision=bf16"])
    spec = cfg.train_spec()
    assert (spec.device, spec.precision, spec.device_field) == ("cpu", "bf16", "trainer.device")
    with pytest.raises(ConfigError, match=r"optim\.bf16: unknown key"):  # precision replaces it
        load_config(TrainJobConfig, "manifests/train-dflash-quickstart.yaml", ["optim.bf16=true"])
    assert torch.device(spec.device).type == "cpu"


def test_bf16_training_on_a_cpu_without_a_bf16_unit_is_refused(monkeypatch):
    import specray.capture.devices as devices

    monkeypatch.setattr(devices, "cpu_flags", lambda: {"avx2", "fma"})
    with pytest.raises(ValueError, match=r"train\.precision=bf16 on this CPU.*avx512_bf16.*set train\.precision=fp32"):
        devices.resolve_precision("bf16", torch.device("cpu"))
    assert devices.resolve_precision("fp32", torch.device("cpu")) is False
    monkeypatch.setattr(devices, "cpu_flags", lambda: {"avx2", "avx512_bf16"})
    assert devices.resolve_precision("bf16", torch.device("cpu")) is True
    monkeypatch.setattr(devices, "cpu_flags", lambda: {"amx_bf16"})
    assert devices.resolve_precision("bf16", torch.device("cpu")) is True
