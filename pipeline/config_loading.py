"""Loading run configs: YAML plus ``section.field=value`` overrides into a pydantic model, and
errors that name each field and its fix (``ConfigError``).

Unknown keys get a close match or the drafter section they belong to (another algorithm's
field); a missing field says how to give it; a check across fields keeps its own message.

Values are taken as written: a manifest is validated in pydantic's strict mode (``true`` is no
integer, ``8.0`` no count, ``"3"`` no number), every float must be finite (``.inf`` and
``.nan`` are YAML numbers, never a learning rate or an interval), a key given twice in one
mapping is an error rather than the later one winning, ``1e-4`` reads as a number (YAML 1.2;
PyYAML alone reads it as a string), and a YAML tag (``!!python/…``) or a syntax error is a
``ConfigError`` with its line and column.
"""

from __future__ import annotations

import difflib
import math
import re
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ValidationError

from specray.drafters import DEFAULT_ALGORITHM, DRAFTERS, get_drafter
from specray.trainer.strategies import get_strategy

STRICT = {"strict": True}
"""The validation context of a loaded config: the model validators that validate a section
themselves (the ``drafter`` union, the strategy's ``objective``) validate it strictly too."""


class ConfigError(ValueError):
    """A config file or override is invalid; the message names each field and its fix."""


class _ManifestLoader(yaml.SafeLoader):
    """PyYAML's safe loader with YAML 1.2 exponent floats and duplicate keys refused."""

    def construct_mapping(self, node, deep=False):
        seen: dict[Any, Any] = {}
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":
                continue
            key = self.construct_object(key_node, deep=True)
            if isinstance(key, (str, int, float, bool)) and key in seen:
                raise yaml.constructor.ConstructorError(
                    "while reading a mapping", node.start_mark,
                    f"found the key {key!r} twice (the first one at line {seen[key].line + 1})", key_node.start_mark)
            seen[key] = key_node.start_mark
        return super().construct_mapping(node, deep=deep)


# ``1e-4``, ``-2E+3``, ``5.e-1``: floats in YAML 1.2, strings to PyYAML's YAML 1.1 resolver (which wants a dot).
_ManifestLoader.add_implicit_resolver(
    "tag:yaml.org,2002:float", re.compile(r"^[-+]?(?:[0-9][0-9_]*)(?:\.[0-9_]*)?[eE][-+]?[0-9]+$"),
    list("-+0123456789"))


def _yaml_fix(error: yaml.YAMLError) -> str:
    problem = str(getattr(error, "problem", "") or "")
    if "could not determine a constructor" in problem:
        return ("manifests take plain YAML only: drop the tag (the `!…` before the value) and write the value as a "
                "string, number, list or mapping")
    if "twice" in problem:
        return "keep one of them (a repeated key would silently replace the first)"
    return ("check the indentation (spaces, not tabs) and the quoting at that line; quote a value that holds ': ', "
            "' #' or starts with a special character ([ { & * ! | > % @ `)")


def _parse_yaml(text: str, where: str) -> Any:
    """``text`` parsed by ``_ManifestLoader``; any YAML error is a ConfigError naming ``where``, line and column."""
    try:
        return yaml.load(text, Loader=_ManifestLoader)  # noqa: S506 - a SafeLoader subclass
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None) or getattr(e, "context_mark", None)
        at = f", line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        what = " ".join(str(p) for p in (getattr(e, "context", None), getattr(e, "problem", None)) if p) or str(e)
        raise ConfigError(f"{where}{at}: {what}. Fix: {_yaml_fix(e)}") from None


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
        node[parts[-1]] = _parse_yaml(raw, f"override {item!r}")
    return data


def _non_finite(data: Any, loc: tuple = ()) -> list[tuple[tuple, float]]:
    """(location, value) of every NaN or infinite float in parsed config data."""
    if isinstance(data, float):
        return [] if math.isfinite(data) else [(loc, data)]
    if isinstance(data, dict):
        return [found for key, value in data.items() for found in _non_finite(value, (*loc, key))]
    if isinstance(data, (list, tuple)):
        return [found for i, value in enumerate(data) for found in _non_finite(value, (*loc, i))]
    return []


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
    fix = _TYPE_FIXES.get(err["type"])
    return f"{loc}: {message} (got {err.get('input')!r})" + (f". Fix: {fix.format(loc=loc)}" if fix else "")


_TYPE_FIXES = {  # the strict types' errors: what to write instead
    "int_type": "give a whole number without quotes, e.g. {loc}=2 (true, false and 2.0 are not counts)",
    "float_type": "give a number without quotes, e.g. {loc}=0.5",
    "bool_type": "give true or false",
    "string_type": "give a string (quote it where YAML would read a number, a date or a boolean)",
    "finite_number": "give a finite number",
}


def load_config(model: type[BaseModel], path: str | Path | None = None, overrides: list[str] | None = None):
    """Load YAML (optional) + overrides into ``model``, strictly (module docstring); raise ConfigError on any problem."""
    data: dict[str, Any] = {}
    if path is not None:
        file = Path(path)
        if not file.is_file():
            raise ConfigError(f"config file {file} does not exist")
        try:
            text = file.read_text(encoding="utf-8")
        except UnicodeDecodeError as e:
            raise ConfigError(f"{file}: not UTF-8 text (byte {e.start}); save the manifest as UTF-8") from None
        data = _parse_yaml(text, str(file)) or {}
        if not isinstance(data, dict):
            raise ConfigError(f"{file}: the top level must be a mapping of sections")
    data = apply_overrides(data, overrides or [])
    where = f" in {path}" if path else ""
    non_finite = {loc: value for loc, value in _non_finite(data)}
    lines = [f"{'.'.join(map(str, loc))}: must be a finite number (got {value!r}). Fix: give a finite value; "
             "YAML reads .inf and .nan as numbers" for loc, value in non_finite.items()]
    try:
        cfg = model.model_validate(data, strict=True, context=STRICT)
    except ValidationError as e:
        lines += [_format_error(model, err, data, Path(path) if path is not None else None)
                  for err in e.errors() if tuple(err["loc"]) not in non_finite]
    if lines:
        raise ConfigError(f"invalid config{where}:\n  " + "\n  ".join(lines))
    return cfg
