"""The JSON file every benchmark writes (its figures and ``serving/sidebyside.py``'s ``environment``)."""

from __future__ import annotations

import json
from pathlib import Path


def write_json(result: dict, path: str | None) -> None:
    if path:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps(result, indent=2) + "\n")
