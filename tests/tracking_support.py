"""Readers of what the real trackers wrote: TensorBoard event files, a W&B offline run, an MLflow file store.

Each returns ``{metric name: {step: value}}``, read from the files the packages wrote (no mock)."""

import glob
import struct
from pathlib import Path


def tensorboard_scalars(logdir) -> dict[str, dict[int, float]]:
    """Every scalar in the event files under ``logdir`` (TFRecord framing: length, crc, Event proto, crc)."""
    from tensorboardX.proto import event_pb2

    out: dict[str, dict[int, float]] = {}
    files = sorted(Path(logdir).rglob("events.out.tfevents.*"))
    assert files, f"no TensorBoard event file under {logdir}"
    for path in files:
        data, pos = path.read_bytes(), 0
        while pos < len(data):
            (length,) = struct.unpack("<Q", data[pos:pos + 8])
            event = event_pb2.Event()
            event.ParseFromString(data[pos + 12:pos + 12 + length])
            pos += 12 + length + 4
            for value in event.summary.value:
                out.setdefault(value.tag, {})[event.step] = value.simple_value
    return out


def _wandb_records(path: str) -> list:
    """The Record protos of a W&B run file (W&B's LevelDB-style log: 32 KiB blocks of records, each
    crc32, length, type, then its bytes; a proto may span several records)."""
    from wandb.proto import wandb_internal_pb2

    data = Path(path).read_bytes()
    assert data[:4] == b":W&B", f"{path} is not a W&B run file"
    records, pos, chunk = [], 7, b""
    while pos + 7 <= len(data):
        left = 32768 - pos % 32768
        if left < 7:
            pos += left
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if kind == 0:  # the rest of the block is padding
            pos += left
            continue
        chunk += data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # a FULL record, or the LAST part of one
            record = wandb_internal_pb2.Record()
            record.ParseFromString(chunk)
            records.append(record)
            chunk = b""
    return records


def wandb_history(directory, timeout_s: float = 30.0) -> dict[str, dict[int, float]]:
    """The history rows of the W&B offline runs under ``directory``. W&B's service process writes a
    run file after ``finish`` returns: each is read once it holds the run's exit record."""
    import json
    import time

    files = sorted(glob.glob(f"{directory}/**/offline-run-*/run-*.wandb", recursive=True))
    assert files, f"no W&B offline run under {directory}"
    out: dict[str, dict[int, float]] = {}
    for path in files:
        deadline = time.monotonic() + timeout_s
        records = _wandb_records(path)
        while not any(r.WhichOneof("record_type") == "exit" for r in records):
            assert time.monotonic() < deadline, f"{path} has no exit record after {timeout_s} s"
            time.sleep(0.1)
            records = _wandb_records(path)
        for record in records:
            if record.WhichOneof("record_type") == "history":
                row = {item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in record.history.item}
                for key, value in row.items():
                    if not key.startswith("_"):
                        out.setdefault(key, {})[int(row["_step"])] = value
    return out


def mlflow_metrics(uri: str, experiment: str) -> dict[str, dict[int, float]]:
    """Every metric of the runs of ``experiment`` in the MLflow store at ``uri``."""
    import os

    from mlflow.tracking import MlflowClient

    if uri.startswith("file:"):
        os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")  # MLflow 3 opens a file store only with it
    client = MlflowClient(tracking_uri=uri)
    found = client.get_experiment_by_name(experiment)
    assert found is not None, f"no MLflow experiment {experiment!r} in {uri}"
    out: dict[str, dict[int, float]] = {}
    for run in client.search_runs([found.experiment_id]):
        for key in run.data.metrics:
            for metric in client.get_metric_history(run.info.run_id, key):
                out.setdefault(key, {})[metric.step] = metric.value
    return out
