"""``export_checkpoint`` of a checkpoint on S3 (the trainer gang's storage on a cluster), on SeaweedFS:
it is fetched and exported like a local one."""

import json
import uuid

import pytest
import torch
from safetensors.torch import load_file

from specray.capture.store import open_fs
from specray.pipeline.jobs.capture import run_capture
from specray.pipeline.config import CaptureJobConfig, TrainJobConfig, load_config
from specray.pipeline.jobs.train import build_trainer
from specray.trainer.checkpoint import load_checkpoint
from specray.trainer.export import export_checkpoint

pytestmark = pytest.mark.s3


def test_a_checkpoint_on_s3_exports_like_a_local_one(seaweedfs, tmp_path):
    run_capture(load_config(CaptureJobConfig, "manifests/capture-quickstart.yaml", [
        "name=cap", "target.name=debug", "data.max_samples=8", "data.max_length=192", f"output.run_dir={tmp_path / 'cap'}",
    ]), progress=False)
    trainer = build_trainer(load_config(TrainJobConfig, "manifests/train-dflash-quickstart.yaml", [
        "target.name=debug", f"data.manifest={tmp_path / 'cap' / 'manifest.parquet'}", f"output.run_dir={tmp_path / 'run'}",
        "optim.total_steps=2", "optim.warmup_steps=1", "trainer.checkpoint_every=2", "objective.num_anchors=4",
        "live_eval.enabled=false",
    ]))
    trainer.fit(progress=False)
    trainer.loader.close()
    # the gang's layout: <storage>/<name>/checkpoint-aAAA-sSSSSSSSS/ holding a step dir and `latest`
    uri = seaweedfs.uri(f"ray-train-{uuid.uuid4().hex[:8]}/run/checkpoint-a000-s00000002")
    fs, root, _ = open_fs(uri)
    fs.put(f"{tmp_path / 'run' / 'checkpoints'}/", f"{root}/", recursive=True)

    out = export_checkpoint(uri, tmp_path / "export")
    trained, exported = load_checkpoint(tmp_path / "run" / "checkpoints").model, load_file(out / "model.safetensors")
    assert trained and all(torch.equal(exported[name], value) for name, value in trained.items())
    provenance = json.loads((out / "export.json").read_text())
    assert provenance["checkpoint"] == uri and provenance["step"] == 2  # the source, not the temporary copy
    with pytest.raises(FileNotFoundError, match="no checkpoint at s3://.*/missing"):
        export_checkpoint(seaweedfs.uri("missing"), tmp_path / "nothing")
