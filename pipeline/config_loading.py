"""Loading run configs: YAML plus ``section.field=value`` overrides into a pydantic model, and
errors that name each field and its fix (``ConfigError``).

Unknown keys get a close match or the drafter section they belong to (another algorithm's
field); a missing field says how to give it; a check across fields keeps its own message.
"""

from __future__ import annotations

import difflib
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ValidationError

from specray.drafters import DEFAULT_ALGORITHM, DRAFTERS, get_drafter
from specray.trainer.strategies import get_strategy


class ConfigError(ValueError):
    """A config file or override is invalid; the message names each field and its fix."""


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


def _algorithm_of(section_data: Any) -> str:
    """The drafter algorithm a section's input names (``drafter.algorithm``, default dflash)."""
    drafter = section_data.get("drafter") if isinstance(section_data, dict) else None
    if isinstance(drafter, BaseModel):
        return drafter.algorithm
    algorithm = drafter.get("algorithm", DEFAULT_ALGORITHM) if isinstance(drafter, dict) else DEFAULT_ALGORITHM
    return algorithm if algorithm in DRAFTERS else DEFAULT_ALGORITHM


def _field_model(section: Any, part: str, section_data: Any) -> Any:
    """The model class of field ``part`` of ``section`` for this input: the drafter union's
    variant of its algorithm, the objective of that algorithm's strategy, else the annotation."""
    if not (isinstance(section, type) and issubclass(section, BaseModel)) or part not in section.model_fields:
        return section
    if {"drafter", "objective"} <= set(section.model_fields) and part in ("drafter", "objective"):
        algorithm = _algorithm_of(section_data)
        return get_drafter(algorithm).section if part == "drafter" else get_strategy(algorithm).objective
    return section.model_fields[part].annotation


def _unknown_key_fix(section: Any, loc: tuple, path: Path | None) -> str:
    """The fix for an unknown key at ``loc`` of ``section``: a close match, or the drafter section
    it belongs to when it is another algorithm's field (and the manifest written for the chosen
    algorithm beside ``path``, ``<stem>-<algorithm>.yaml``, if there is one), and the valid keys."""
    valid = sorted(section.model_fields) if isinstance(section, type) and issubclass(section, BaseModel) else []
    key = str(loc[-1])
    close = difflib.get_close_matches(key, valid, n=1)
    hint = f"did you mean {close[0]!r}? " if close else ""
    owners = [name for name, spec in DRAFTERS.items() if spec.section is not section and key in spec.section.model_fields]
    if owners and section in {spec.section for spec in DRAFTERS.values()}:
        algorithm, where = section.model_fields["algorithm"].default, ".".join(str(p) for p in loc[:-1])
        hint = (f"{key!r} belongs to the {'/'.join(owners)} drafter section, not {algorithm}'s: drop it, or give the "
                f"whole section, e.g. {where}={{algorithm: {algorithm}}}; ")
        own = path.with_name(f"{path.stem}-{algorithm}{path.suffix}") if path is not None else None
        if own is not None and own.is_file():
            hint += f"or run {own}, written for {algorithm}; "
    return f"{hint}valid keys here are {valid}"


def _format_error(model: type[BaseModel], err: dict, data: dict, path: Path | None) -> str:
    loc = ".".join(str(p) for p in err["loc"])
    if err["type"] == "extra_forbidden":
        section, node = model, data
        for part in err["loc"][:-1]:
            section = _field_model(section, part, node)
            node = node.get(part) if isinstance(node, dict) else None
        return f"{loc}: unknown key. Fix: {_unknown_key_fix(section, err['loc'], path)}"
    if err["type"] == "missing":
        return f"{loc}: required and missing. Fix: add it to the YAML or pass {loc}=VALUE"
    message = err["msg"].removeprefix("Value error, ")
    if not err["loc"]:  # a check across fields: its message names them
        return message
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
        lines = [_format_error(model, err, data, Path(path) if path is not None else None) for err in e.errors()]
        raise ConfigError(f"invalid config{where}:\n  " + "\n  ".join(lines)) from None
