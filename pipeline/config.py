"""Typed run configs: YAML manifests load into these pydantic models; the CLI only overrides.

Every model forbids unknown keys, and every error is reported as ``section.field: problem``
with the fix (``ConfigError``). Overrides use dotted keys: ``data.max_samples=8``; the
value is parsed as YAML (``capture.layer_ids=[1,5,9]``, ``store.uri=null``).
"""

from __future__ import annotations

import difflib
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from specray.capture.contract import CONTRACT_SPECS, STORAGE_DTYPES
from specray.capture.data import DATASETS
from specray.capture.target import DEFAULT_TARGET, DTYPES


class ConfigError(ValueError):
    """A config file or override is invalid; the message names each field and its fix."""


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class TargetConfig(Section):
    name: str = Field(DEFAULT_TARGET, description="embedded:<name>, debug[:seed], or a local HF model directory")
    dtype: Literal["float32", "bfloat16", "float16"] = Field("float32", description="compute dtype of the target forward")
    device: str = Field("cpu", description="torch device for the target")


class DataConfig(Section):
    dataset: str = Field("sharegpt", description="sharegpt, or jsonl:PATH (mtbench/humaneval are eval-only)")
    max_samples: int | None = Field(None, gt=0, description="use at most this many conversations (None = all)")
    max_length: int = Field(2048, gt=0, description="maximum tokens per rendered sample")
    truncation: Literal["truncate", "drop"] = Field(
        "truncate", description="truncate: keep the first max_length tokens; drop: skip longer samples"
    )

    @field_validator("dataset")
    @classmethod
    def _known_dataset(cls, value: str) -> str:
        if value.startswith("jsonl:"):
            if not value.removeprefix("jsonl:"):
                raise ValueError("jsonl: needs a path, e.g. jsonl:data/chats.jsonl")
            return value
        if value not in DATASETS:
            raise ValueError(f"unknown dataset {value!r}; use one of {sorted(DATASETS)} or jsonl:PATH")
        if DATASETS[value].split == "eval":
            raise ValueError(f"{value!r} is held out for evaluation; capture training data from sharegpt or jsonl:PATH")
        return value


class CaptureConfig(Section):
    algorithm: str = Field("dflash", description=f"feature contract to capture: {sorted(CONTRACT_SPECS)}")
    layer_ids: list[int] | None = Field(
        None, description="decoder-layer output ids in concatenation order (None = the algorithm's default)"
    )
    dtype: str = Field("bfloat16", description=f"storage dtype of features: {sorted(STORAGE_DTYPES)}")
    max_batch_tokens: int = Field(8192, gt=0, description="padded tokens per forward (batch size x longest sample)")
    max_batch_size: int = Field(32, gt=0, description="samples per forward")

    @field_validator("algorithm")
    @classmethod
    def _known_algorithm(cls, value: str) -> str:
        if value not in CONTRACT_SPECS:
            raise ValueError(f"unknown algorithm {value!r}; use one of {sorted(CONTRACT_SPECS)}")
        return value

    @field_validator("dtype")
    @classmethod
    def _known_dtype(cls, value: str) -> str:
        if value not in STORAGE_DTYPES:
            raise ValueError(f"unknown storage dtype {value!r}; use one of {sorted(STORAGE_DTYPES)}")
        return value


class StoreConfig(Section):
    uri: str | None = Field(None, description="file://… or s3://bucket/prefix (None = <run_dir>/features)")
    endpoint_url: str | None = Field(None, description="S3 endpoint, e.g. http://127.0.0.1:8333 (else $SPECRAY_S3_ENDPOINT)")

    @field_validator("uri")
    @classmethod
    def _known_scheme(cls, value: str | None) -> str | None:
        if value is not None and "://" in value and not value.startswith(("file://", "s3://")):
            raise ValueError(f"store URI {value!r}: use file://PATH or s3://BUCKET/PREFIX")
        return value


class OutputConfig(Section):
    run_dir: str | None = Field(None, description="where manifest and summary go (None = runs/<name>)")
    overwrite: bool = Field(False, description="replace an existing manifest of the same run (deletes its features)")


class CaptureJobConfig(Section):
    """``specray capture``: render a dataset, capture features, write a manifest."""

    name: str = Field("capture", description="run name; the default run dir is runs/<name>")
    target: TargetConfig = TargetConfig()
    data: DataConfig = DataConfig()
    capture: CaptureConfig = CaptureConfig()
    store: StoreConfig = StoreConfig()
    output: OutputConfig = OutputConfig()

    @property
    def run_dir(self) -> Path:
        return Path(self.output.run_dir or Path("runs") / self.name)

    @property
    def store_uri(self) -> str:
        return self.store.uri or (self.run_dir / "features").resolve().as_uri()


def apply_overrides(data: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """``["data.max_samples=8", …]`` applied to a nested dict (values parsed as YAML)."""
    for item in overrides:
        key, sep, raw = item.partition("=")
        if not sep or not key:
            raise ConfigError(f"override {item!r} must look like section.field=value")
        node = data
        parts = key.split(".")
        for part in parts[:-1]:
            child = node.setdefault(part, {})
            if not isinstance(child, dict):
                raise ConfigError(f"override {item!r}: {part!r} is a value, not a section")
            node = child
        node[parts[-1]] = yaml.safe_load(raw)
    return data


def _format_error(model: type[BaseModel], err: dict) -> str:
    loc = ".".join(str(p) for p in err["loc"])
    if err["type"] == "extra_forbidden":
        section = model
        for part in err["loc"][:-1]:
            section = section.model_fields[part].annotation if part in section.model_fields else section
        valid = sorted(section.model_fields) if isinstance(section, type) and issubclass(section, BaseModel) else []
        close = difflib.get_close_matches(str(err["loc"][-1]), valid, n=1)
        hint = f"did you mean {close[0]!r}? " if close else ""
        return f"{loc}: unknown key. Fix: {hint}valid keys here are {valid}"
    message = err["msg"].removeprefix("Value error, ")
    return f"{loc}: {message} (got {err.get('input')!r})"


def load_config(model: type[BaseModel], path: str | Path | None = None, overrides: list[str] | None = None):
    """Load YAML (optional) + overrides into ``model``; raise ConfigError on any problem."""
    data: dict[str, Any] = {}
    if path is not None:
        file = Path(path)
        if not file.is_file():
            raise ConfigError(f"config file {file} does not exist")
        data = yaml.safe_load(file.read_text()) or {}
        if not isinstance(data, dict):
            raise ConfigError(f"{file}: the top level must be a mapping of sections")
    data = apply_overrides(data, overrides or [])
    try:
        return model.model_validate(data)
    except ValidationError as e:
        where = f" in {path}" if path else ""
        lines = [_format_error(model, err) for err in e.errors()]
        raise ConfigError(f"invalid config{where}:\n  " + "\n  ".join(lines)) from None
