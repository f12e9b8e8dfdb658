"""The CLI answers at once: ``--help`` of every (sub)command imports neither torch nor Ray, and
``--version`` names the package version and, from a checkout, the commit (pipeline/cli.py)."""

import argparse
import subprocess
import sys
import time
from importlib.metadata import version
from pathlib import Path

import pytest

from specray.pipeline.cli import build_parser
from specray.pipeline.version import version_string

ROOT = Path(__file__).resolve().parents[2]
SPECRAY = Path(sys.executable).with_name("specray")
HELP_BOUND_S = 5.0  # generous: a cold start on a shared 2-core machine; the measured figure is ~0.1-0.3 s


def _command_paths(parser: argparse.ArgumentParser, path: tuple = ()):
    yield path
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from _command_paths(sub, (*path, name))


def test_every_help_answers_within_the_bound():
    slowest = (0.0, None)
    for path in _command_paths(build_parser()):
        start = time.perf_counter()
        done = subprocess.run([str(SPECRAY), *path, "--help"], capture_output=True, text=True, timeout=60)
        seconds = time.perf_counter() - start
        assert done.returncode == 0 and "usage: specray" in done.stdout, (path, done.stderr[-2000:])
        assert seconds < HELP_BOUND_S, f"specray {' '.join(path)} --help took {seconds:.2f} s"
        slowest = max(slowest, (seconds, path))
    print(f"slowest --help: specray {' '.join(slowest[1])} --help in {slowest[0]:.3f} s")


def test_building_the_parser_imports_no_heavy_package():
    probe = ("import sys; from specray.pipeline.cli import build_parser; build_parser(); "
             "print(sorted(m for m in ('torch', 'transformers', 'ray', 'numpy', 'pyarrow', 'pydantic', 'yaml') "
             "if m in sys.modules))")
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60, check=True)
    assert done.stdout.strip() == "[]"


def test_version_from_this_checkout_names_the_commit():
    commit = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short=12", "HEAD"], capture_output=True,
                            text=True, check=True).stdout.strip()
    done = subprocess.run([str(SPECRAY), "--version"], capture_output=True, text=True, timeout=60, cwd="/")
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith(f"specray {version('specray')} (git {commit}")
    assert done.stdout.strip() in (f"specray 0.1.0 (git {commit})", f"specray 0.1.0 (git {commit}, uncommitted changes)")


def test_an_installed_package_reports_its_version_alone(tmp_path):
    """No checkout at the package's root, or a checkout of another project around an installed package
    (a venv inside some repository): the version alone, never a commit that is not specray's."""
    assert version_string(tmp_path) == f"specray {version('specray')}"
    subprocess.run(["git", "init", "-q", str(tmp_path)], check=True)
    installed = tmp_path / ".venv" / "lib" / "site-packages" / "specray"
    installed.mkdir(parents=True)
    (installed / "pyproject.toml").write_text('[project]\nname = "specray"\n')
    assert version_string(installed) == f"specray {version('specray')}"
    (tmp_path / "pyproject.toml").write_text('[project]\nname = "other"\n')
    assert version_string(tmp_path) == f"specray {version('specray')}"


def test_a_checkout_with_changes_says_so(tmp_path):
    git = ["git", "-C", str(tmp_path), "-c", "user.email=t@t", "-c", "user.name=t"]
    subprocess.run(["git", "init", "-q", str(tmp_path)], check=True)
    (tmp_path / "pyproject.toml").write_text('[project]\nname = "specray"\n')
    subprocess.run([*git, "add", "pyproject.toml"], check=True)
    subprocess.run([*git, "commit", "-qm", "x"], check=True)
    commit = subprocess.run([*git, "rev-parse", "--short=12", "HEAD"], capture_output=True, text=True).stdout.strip()
    assert version_string(tmp_path) == f"specray {version('specray')} (git {commit})"
    (tmp_path / "pyproject.toml").write_text('[project]\nname = "specray"\nversion = "2"\n')
    assert version_string(tmp_path) == f"specray {version('specray')} (git {commit}, uncommitted changes)"


@pytest.mark.parametrize("argv", [["--version"], ["--version", "capture"]])
def test_version_needs_no_subcommand(argv, capsys):
    with pytest.raises(SystemExit) as done:
        build_parser().parse_args(argv)
    assert done.value.code == 0 and capsys.readouterr().out.startswith("specray ")
