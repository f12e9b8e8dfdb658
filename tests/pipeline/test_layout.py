"""The tree's layering: pipeline/ as CLI + configs, jobs/ and bench/, imports pointing one way;
actors/ never importing pipeline/ at run time; the CLI's surface as recorded in a snapshot.

    pytest tests/pipeline/test_layout.py
    SPECRAY_UPDATE_SNAPSHOT=1 pytest tests/pipeline/test_layout.py   (after a deliberate CLI change)
"""

from __future__ import annotations

import argparse
import ast
import json
import os
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SNAPSHOT = Path(__file__).with_name("snapshots") / "cli_surface.json"


def _runtime_imports(path: Path) -> set[str]:
    """The ``specray.*`` modules a file imports outside ``if TYPE_CHECKING:`` blocks."""
    tree = ast.parse(path.read_text())
    skipped: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            skipped.update(id(n) for child in node.body for n in ast.walk(child))
    found = set()
    for node in ast.walk(tree):
        if id(node) in skipped:
            continue
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("specray"):
            found.add(node.module)
            found.update(f"{node.module}.{alias.name}" for alias in node.names)
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names if alias.name.startswith("specray"))
    return found


def _module(path: Path) -> str:
    return "specray." + ".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")


def test_actors_never_import_pipeline_at_run_time():
    offenders = {f"{p.relative_to(ROOT)}: {m}" for p in (ROOT / "actors").glob("*.py")
                 for m in _runtime_imports(p) if m.startswith("specray.pipeline")}
    assert not offenders


def test_jobs_never_import_bench():
    offenders = {f"{p.relative_to(ROOT)}: {m}" for p in (ROOT / "pipeline" / "jobs").glob("*.py")
                 for m in _runtime_imports(p) if m.startswith("specray.pipeline.bench")}
    assert not offenders


def test_pipeline_modules_import_without_a_circle():
    """Imports between pipeline/ modules (the lazy ones inside functions too) form no cycle."""
    files = sorted((ROOT / "pipeline").rglob("*.py"))
    modules = {_module(p): p for p in files}
    graph = {name: {m for m in _runtime_imports(path) if m in modules and m != name} for name, path in modules.items()}
    for name in graph:  # a package's __init__ is imported with its modules: not an edge of the design
        graph[name] -= {m for m in graph[name] if name.startswith(m + ".")}
    state: dict[str, int] = {}

    def visit(node: str, stack: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                pytest.fail("import circle: " + " -> ".join([*stack[stack.index(nxt):], nxt]))
            if nxt not in state:
                visit(nxt, [*stack, nxt])
        state[node] = 2

    for name in sorted(graph):
        if name not in state:
            visit(name, [name])


def _surface(parser: argparse.ArgumentParser) -> dict:
    """Every (sub)command's options and positionals with their choices and defaults: the CLI's surface."""
    out: dict = {"options": [], "commands": {}}
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            out["commands"] = {name: _surface(sub) for name, sub in sorted(action.choices.items())}
        elif not isinstance(action, argparse._HelpAction):
            out["options"].append({"flags": action.option_strings or [action.dest], "nargs": action.nargs,
                                   "choices": sorted(map(str, action.choices)) if action.choices else None,
                                   "default": repr(action.default) if action.default is not argparse.SUPPRESS else None})
    return out


def test_cli_surface_matches_the_snapshot():
    from specray.pipeline.cli import build_parser

    surface = _surface(build_parser())
    if os.environ.get("SPECRAY_UPDATE_SNAPSHOT"):
        SNAPSHOT.write_text(json.dumps(surface, indent=1, sort_keys=True) + "\n")
    assert surface == json.loads(SNAPSHOT.read_text()), "the CLI changed: if deliberately, rerun with SPECRAY_UPDATE_SNAPSHOT=1"


def test_every_subcommand_answers_help(capsys):
    from specray.pipeline.cli import build_parser

    def walk(parser: argparse.ArgumentParser, path: list[str]):
        yield path
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                for name, sub in action.choices.items():
                    yield from walk(sub, [*path, name])

    parser = build_parser()
    for path in walk(parser, []):
        with pytest.raises(SystemExit) as done:
            build_parser().parse_args([*path, "--help"])
        assert done.value.code == 0, path
        assert "usage: specray" in capsys.readouterr().out
