"""capture/devices.py and the placement logic of capture/target.py: devices and dtypes as configuration,
resolved against what a process was granted, with errors that name the field and the fix."""

import pytest
import torch

from specray.capture.devices import check_ray_devices, resolve_device, resolve_dtype, resolve_precision, visible_gpus
from specray.capture.target import check_placement, target_placement


def test_auto_is_the_cpu_without_a_granted_gpu_and_cuda_with_one():
    assert resolve_device("auto", field="train.device", gpus=0) == torch.device("cpu")
    assert resolve_device("cpu", field="train.device", gpus=4) == torch.device("cpu")
    if visible_gpus():
        assert resolve_device("auto", field="train.device", gpus=1).type == "cuda"
    else:  # a grant torch cannot use is refused, never silently trained on the CPU
        with pytest.raises(ValueError, match=r"train\.device: 1 GPU\(s\) granted, but torch .* sees no CUDA device"):
            resolve_device("auto", field="train.device", gpus=1)


def test_cuda_without_a_gpu_is_refused_naming_the_field_and_the_fix():
    with pytest.raises(ValueError, match=r"target\.device=cuda but this process was granted no GPU; set "
                                         r"capture\.num_gpus_per_actor=1"):
        resolve_device("cuda", field="target.device", gpus=0, fix="set capture.num_gpus_per_actor=1")
    with pytest.raises(ValueError, match=r"trainer\.device=cuda but this process was granted no GPU; set "
                                         r"trainer\.device=auto .* or trainer\.device=cpu"):
        resolve_device("cuda", field="trainer.device", gpus=0)
    with pytest.raises(ValueError, match=r"train\.device='tpu': use one of \['auto', 'cpu', 'cuda'\]"):
        resolve_device("tpu", field="train.device")


@pytest.mark.skipif(visible_gpus() > 0, reason="this machine has a GPU")
def test_cuda_where_torch_sees_no_gpu_is_refused():
    with pytest.raises(ValueError, match=r"target\.device=cuda but torch sees no CUDA device here"):
        resolve_device("cuda", field="target.device")


def test_dtype_and_precision_follow_the_device(monkeypatch):
    import specray.capture.devices as devices

    monkeypatch.setattr(devices, "cpu_flags", lambda: {"avx512_bf16"})  # a CPU with a bf16 unit
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert resolve_dtype("auto", cpu) == torch.float32 and resolve_dtype("auto", cuda) == torch.bfloat16
    assert resolve_dtype("float16", cpu) == torch.float16
    with pytest.raises(ValueError, match=r"target\.dtype='int8' is not supported"):
        resolve_dtype("int8", cpu)
    assert (resolve_precision("auto", cpu), resolve_precision("auto", cuda)) == (False, True)
    assert resolve_precision("bf16", cpu) and not resolve_precision("fp32", cuda)
    with pytest.raises(ValueError, match=r"train\.precision='fp16'"):
        resolve_precision("fp16", cpu)


def test_ray_workers_ask_for_the_gpus_their_device_needs():
    check_ray_devices("cuda", 1, device_field="train.device", gpus_field="train.gpus_per_worker", who="workers")
    check_ray_devices("auto", 0, device_field="train.device", gpus_field="train.gpus_per_worker", who="workers")
    with pytest.raises(ValueError, match=r"train\.device=cuda, but workers ask Ray for no GPU "
                                         r"\(train\.gpus_per_worker=0\).*set train\.gpus_per_worker=1"):
        check_ray_devices("cuda", 0, device_field="train.device", gpus_field="train.gpus_per_worker", who="workers")
    with pytest.raises(ValueError, match=r"capture\.num_gpus_per_actor=0\.5 reserves GPUs that actors never use "
                                         r"with target\.device=cpu"):
        check_ray_devices("cpu", 0.5, device_field="target.device", gpus_field="capture.num_gpus_per_actor",
                          who="actors")


def test_a_target_is_placed_across_gpus_only_with_more_than_one():
    assert target_placement(torch.device("cuda"), 1) == {"device": torch.device("cuda")}
    assert target_placement(torch.device("cuda"), 4) == {"device_map": "auto"}
    assert target_placement(torch.device("cpu"), 4) == {"device": torch.device("cpu")}  # target.device=cpu wins
    check_placement({"model.embed_tokens": 0, "model.layers.0": 1, "lm_head": "cuda:1"}, "big")
    with pytest.raises(ValueError, match=r"target 'big' does not fit on the .* GPU\(s\) of this process: accelerate "
                                         r"placed \['model.layers.1'\]… on \['cpu'\]; raise capture.num_gpus_per_actor"):
        check_placement({"model.embed_tokens": 0, "model.layers.0": 0, "model.layers.1": "cpu"}, "big")
