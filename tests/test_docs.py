"""The docs stay true to the code and to the measurements: README.md and docs/*.md.

- **Figures.** A *figure* is a number with a unit (`1.11×`, `0.96–1.00×`, `2 %`, `201 s`,
  `11 min`, `31.8 ms`, `4.3 GB`, `77 tokens/s`) or a date (`2026-12-02`). Every figure the README
  states outside code appears verbatim in docs/benchmarks.md. In the README's `## Figures` table
  every row links to its benchmark entries, and every figure and every other number of the row
  appears in those entries (the linked headings' sections).
- **Commands.** Every `specray …` command in a ```bash block or in inline code parses as the CLI
  parses it (`specray.pipeline.cli.parse_args`; `--help` and `--version` count), and its `section.field=value` overrides are valid against
  the command's config (its manifest loaded with them, as the CLI loads it). Inline code that
  names only subcommands (`specray bench serve`) must name existing ones. Placeholders are
  UPPERCASE words (`EXPORT`, `DIR`, `PROMPT`) or `<name>`: argparse takes them as they are, so
  they stand only where the argument is a string (a path, a name), never a number or a choice.
  Other fences (plain ```, ```python, ```json, ```mermaid) are listings and output, not checked.
- **Links.** Every relative link resolves to an existing file, and a `#anchor` to a heading of
  that file (GitHub's slugs).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import re
import shlex
from pathlib import Path

import pytest

from specray.pipeline.cli import build_parser, parse_args
from specray.pipeline.config import (CaptureJobConfig, ConfigError, PipelineConfig, ServeJobConfig, TrainJobConfig,
                                     load_config)

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
BENCHMARKS = ROOT / "docs" / "benchmarks.md"
DOCS = [README, *sorted((ROOT / "docs").glob("*.md"))]

FENCE = re.compile(r"^```(\w*)[^\n]*\n(.*?)^```[ \t]*$", re.S | re.M)
INLINE = re.compile(r"`([^`]+)`")
LINK = re.compile(r"\[(?P<text>(?:[^\[\]]|`[^`]*`)*)\]\((?P<target>[^)\s]+)\)")
HEADING = re.compile(r"^(#{1,6})[ \t]+(.+?)[ \t]*#*[ \t]*$", re.M)
NUMBER = r"(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?"
UNITS = r"(?:\s?(?:×|%)|\s(?:ms|s|min|h|GB|MB|GiB|MiB|KiB|KB|tokens/s)(?![\w/]))"
FIGURE = re.compile(rf"(?<![\w.]){NUMBER}(?:–{NUMBER})?{UNITS}")
DATE = re.compile(r"(?<!\d)\d{4}-\d{2}-\d{2}(?!\d)")
BARE_NUMBER = re.compile(rf"(?<![\w.]){NUMBER}")
SHELL_STOP = {"&&", "||", ";", "|", ">", ">>", "2>", "&", "2>&1"}


# -- markdown --------------------------------------------------------------------------------


def _prose(text: str) -> str:
    """The text outside fenced blocks: a block's characters blanked, so offsets and lines stay."""
    return FENCE.sub(lambda m: re.sub(r"[^\n]", " ", m.group(0)), text)


def _without_code(text: str) -> str:
    """Prose without inline code and link targets: what a reader reads as text."""
    text = LINK.sub(lambda m: m.group("text"), _prose(text))
    return INLINE.sub(" ", text)


def _slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading).lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def _anchors(path: Path) -> set[str]:
    seen: dict[str, int] = {}
    anchors = set()
    for match in HEADING.finditer(_prose(path.read_text())):
        slug = _slug(match.group(2))
        anchors.add(slug if slug not in seen else f"{slug}-{seen[slug]}")
        seen[slug] = seen.get(slug, 0) + 1
    return anchors


def _section(path: Path, anchor: str) -> str:
    """The text of the heading with this anchor, up to the next heading of its level or above."""
    text = path.read_text()
    headings = list(HEADING.finditer(_prose(text)))
    for i, match in enumerate(headings):
        if _slug(match.group(2)) == anchor:
            level = len(match.group(1))
            end = next((h.start() for h in headings[i + 1:] if len(h.group(1)) <= level), len(text))
            return text[match.start():end]
    raise AssertionError(f"{path.name} has no heading #{anchor}")


def _normalise(text: str) -> str:
    return re.sub(r"\s+", " ", text.replace("\u00a0", " "))


def _figures(text: str) -> list[str]:
    return [_normalise(m.group(0)) for m in FIGURE.finditer(text)] + DATE.findall(text)


# -- figures ---------------------------------------------------------------------------------


def _figure_rows() -> list[str]:
    text = README.read_text()
    start = text.index("\n## Figures\n")
    end = text.find("\n## ", start + 1)
    rows = [line for line in text[start:end if end > 0 else None].splitlines() if line.startswith("|")]
    return [row for row in rows[2:]]  # past the header and its separator


def test_the_readme_has_a_figures_table():
    assert len(_figure_rows()) >= 8


@pytest.mark.parametrize("row", _figure_rows(), ids=lambda row: row.split("|")[1].strip()[:40])
def test_each_readme_figure_is_in_its_benchmark_entry(row):
    targets = [m.group("target") for m in LINK.finditer(row)]
    anchors = [t.split("#", 1)[1] for t in targets if t.split("#", 1)[0] == "docs/benchmarks.md" and "#" in t]
    assert anchors, f"the row links no docs/benchmarks.md#entry: {row}"
    entries = _normalise(" ".join(_section(BENCHMARKS, anchor) for anchor in anchors))
    stated = _normalise(INLINE.sub(" ", LINK.sub(lambda m: m.group("text"), row)))
    missing = [f for f in _figures(stated) if f not in entries]
    numbers = set(BARE_NUMBER.findall(entries))
    missing += [n for n in BARE_NUMBER.findall(DATE.sub(" ", stated)) if n not in numbers]
    assert not missing, f"not in {anchors}: {missing}"


def test_every_readme_figure_is_in_the_benchmarks():
    benchmarks = _normalise(BENCHMARKS.read_text())
    stated = _figures(_normalise(_without_code(README.read_text())))
    assert len(stated) >= 10
    assert not [f for f in stated if f not in benchmarks]


# -- commands --------------------------------------------------------------------------------


def _commands() -> list[tuple[str, list[str]]]:
    """(``file:line``, the arguments after ``specray``) of every command in the docs."""
    found = []
    for path in DOCS:
        text = path.read_text()
        for block in FENCE.finditer(text):
            if block.group(1) not in ("bash", "sh", "shell"):
                continue
            first = text.count("\n", 0, block.start(2)) + 1
            lines = block.group(2).split("\n")
            i = 0
            while i < len(lines):
                start, line = i, lines[i]
                while line.rstrip().endswith("\\") and i + 1 < len(lines):
                    i += 1
                    line = line.rstrip()[:-1] + " " + lines[i]
                i += 1
                args = _specray_args(shlex.split(line, comments=True))
                if args is not None:
                    found.append((f"{path.name}:{first + start}", args))
        prose = _prose(text)
        for span in INLINE.finditer(prose.replace("\n", " ")):
            args = _specray_args(shlex.split(span.group(1)))
            if args is not None:
                found.append((f"{path.name}:{prose.count(chr(10), 0, span.start()) + 1}", args))
    return found


def _specray_args(tokens: list[str]) -> list[str] | None:
    """The arguments after the first ``specray`` token (``specray``, ``.venv/bin/specray``), up to
    a shell operator; None when the tokens run no specray command."""
    for i, token in enumerate(tokens):
        if token in SHELL_STOP:
            return None
        if Path(token).name == "specray" and not token.startswith("-"):
            args = tokens[i + 1:]
            stop = next((j for j, t in enumerate(args) if t in SHELL_STOP), len(args))
            return args[:stop]
    return None


def _subcommands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    actions = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return dict(actions[0].choices) if actions else {}


def _command_path(args: list[str]) -> tuple[str, ...]:
    parser, path = build_parser(), []
    for token in args:
        choices = _subcommands(parser)
        if token not in choices:
            break
        parser, path = choices[token], [*path, token]
    return tuple(path)


def _config_of(path: tuple[str, ...], ns: argparse.Namespace):
    """The config class, manifest and overrides the CLI loads for this command (None: it loads none)."""
    if path == ("bench", "capture"):
        from specray.pipeline.bench.capture import BENCH_CAPTURE_DEFAULTS

        return CaptureJobConfig, ns.config, BENCH_CAPTURE_DEFAULTS + ns.overrides
    if path == ("bench", "train"):
        from specray.pipeline.bench.train import BENCH_TRAIN_DEFAULTS

        return TrainJobConfig, ns.config, ["data.manifest=auto", *BENCH_TRAIN_DEFAULTS, *ns.overrides]
    return {("capture",): (CaptureJobConfig, getattr(ns, "config", None), getattr(ns, "overrides", [])),
            ("train",): (TrainJobConfig, getattr(ns, "config", None), getattr(ns, "overrides", [])),
            ("serve",): (ServeJobConfig, getattr(ns, "config", None), getattr(ns, "overrides", [])),
            ("bench", "load"): (ServeJobConfig, getattr(ns, "config", None), getattr(ns, "overrides", [])),
            ("pipeline", "run"): (PipelineConfig, getattr(ns, "manifest", None), getattr(ns, "overrides", [])),
            ("plan",): (PipelineConfig, getattr(ns, "manifest", None), getattr(ns, "overrides", [])),
            }.get(path)


COMMANDS = _commands()


def test_the_docs_hold_commands():
    assert len(COMMANDS) >= 80


@pytest.mark.parametrize("where, args", COMMANDS, ids=[f"{w} specray {' '.join(a)}"[:90] for w, a in COMMANDS])
def test_each_specray_command_parses_and_its_overrides_are_valid(where, args):
    if not args or set(args) <= {"-h", "--help", "--version"}:
        return  # the program's name, its help, its version
    path = _command_path(args)
    assert path, f"{where}: `specray {' '.join(args)}` names no subcommand"
    if len(path) == len(args):
        return  # a name (`specray export`, `specray bench serve`): every word a subcommand
    stderr = io.StringIO()
    with contextlib.redirect_stderr(stderr), contextlib.redirect_stdout(io.StringIO()):
        try:
            ns = parse_args(args)
        except SystemExit as e:
            if e.code == 0:
                return  # --help
            pytest.fail(f"{where}: `specray {' '.join(args)}` does not parse: {stderr.getvalue().strip()}")
    if path == ("evaluate",):
        bad = [o for o in ns.overrides if not o.startswith("objective.")]
        assert not bad, f"{where}: evaluate takes objective.field=value overrides only, got {bad}"
    loaded = _config_of(path, ns)
    if loaded is None:
        return
    model, manifest, overrides = loaded
    if manifest is not None:
        manifest = ROOT / manifest
        assert manifest.is_file(), f"{where}: no manifest {manifest}"
    try:
        load_config(model, manifest, overrides)
    except ConfigError as e:
        pytest.fail(f"{where}: `specray {' '.join(args)}`: {e}")


# -- links -----------------------------------------------------------------------------------


def _links() -> list[tuple[str, Path, str]]:
    found = []
    for path in DOCS:
        prose = _prose(path.read_text())
        for match in LINK.finditer(prose):
            target = match.group("target")
            if re.match(r"[a-z]+:", target):
                continue  # http:, https:, mailto:
            found.append((f"{path.name}:{prose.count(chr(10), 0, match.start()) + 1}", path, target))
    return found


LINKS = _links()


def test_the_docs_link_to_each_other():
    assert len(LINKS) >= 40


@pytest.mark.parametrize("where, source, target", LINKS, ids=[f"{w} {t}" for w, _, t in LINKS])
def test_each_relative_link_resolves(where, source, target):
    file, _, anchor = target.partition("#")
    path = (source.parent / file).resolve() if file else source
    assert path.exists(), f"{where}: {target} names no file"
    if anchor:
        assert path.suffix == ".md", f"{where}: {target} anchors into a file that is not markdown"
        assert anchor in _anchors(path), f"{where}: {path.name} has no heading #{anchor}"
