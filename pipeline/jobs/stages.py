"""A pipeline's finished stages, so that ``--resume`` does not run them again.

A stage that completes writes ``<run_dir>/stages/<stage>.json``: its key, its seconds, the parts
of the report it filled and its output (a manifest URI, a checkpoint, an export directory). The
key is a digest of the config sections the stage reads, chained with the key of the stage before
it. On ``--resume`` a stage whose record holds the same key is not run: its report parts, seconds
and output are restored, and the report lists it under ``stages_reused``. A stage whose sections
changed since, or that follows such a stage, runs again; so does a stage that never finished,
which continues from its own durable state where it has one (regenerate's output file, the
trainer's checkpoints). A fresh run replaces the run dir and its records with it.
"""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any


class StageLog:
    def __init__(self, run_dir: Path, cfg, report, *, resume: bool, progress: bool):
        self.dir = run_dir / "stages"
        self.cfg, self.report, self.resume, self.progress = cfg, report, resume, progress
        self.key = ""

    def run(self, name: str, sections: tuple[str, ...], fields: tuple[str, ...], fn: Callable[[], Any], *,
            reusable: bool = True) -> Any:
        """Run ``fn`` as stage ``name`` unless a finished record of it with this key exists.

        ``sections``: the config sections the stage reads; ``fields``: the report attributes it
        fills; ``reusable=False`` always runs it (a stage whose result is a live process)."""
        config = {s: self.cfg.model_dump(mode="json")[s] for s in sections}
        self.key = hashlib.sha256(json.dumps([self.key, config], sort_keys=True).encode()).hexdigest()[:16]
        path = self.dir / f"{name}.json"
        if self.resume and reusable and path.exists():
            record = json.loads(path.read_text())
            if record["key"] == self.key:
                for f in fields:
                    setattr(self.report, f, record["report"][f])
                self.report.stage_seconds[name] = record["seconds"]
                self.report.stages_reused.append(name)
                if self.progress:
                    print(f"== {name}: done in the interrupted run, reused", flush=True)
                return record["output"]
            if self.progress:
                print(f"== {name}: its config changed since the interrupted run; it runs again", flush=True)
        if self.progress:
            print(f"== {name}", flush=True)
        start = time.perf_counter()
        output = fn()
        seconds = round(time.perf_counter() - start, 2)
        self.report.stage_seconds[name] = seconds
        self.dir.mkdir(parents=True, exist_ok=True)
        record = {"key": self.key, "seconds": seconds, "output": output,
                  "report": {f: getattr(self.report, f) for f in fields}}
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(record, indent=2) + "\n")
        tmp.replace(path)  # whole or absent: a kill never leaves half a record
        return output
