"""The conformance suite's fixtures: every registered algorithm, the debug target's greedy reference
and drafters for it (``conformance_kit.py`` says what each kind is).

An algorithm joins the suite by being registered (DESIGN.md §5, the algorithm seam): the
``algorithm`` fixture is parametrised over every name in the drafter, train-strategy and
serving-worker registries, and a name missing from any of them, or from the capture contracts,
fails every test of the suite instead of being skipped.
"""

import pytest
from conformance_kit import (MAX_NEW, PROMPTS, REGISTRIES, build_drafter, debug_run, frequent_tokens, hf_greedy,
                             one_thread, read_golden, registered)

from specray.pipeline.jobs.train import run_training
from specray.serving.requests import encode_prompt


@pytest.fixture(scope="module", autouse=True)
def single_thread():
    """The suite's tests run on one intra-op thread (``conformance_kit.one_thread``; the DDP ranks,
    separate processes, set their own)."""
    with one_thread():
        yield


@pytest.fixture(params=registered())
def algorithm(request) -> str:
    """A registered algorithm; fails (never skips) when one of the seam's registries lacks it."""
    name = request.param
    missing = [registry for registry, entries in REGISTRIES.items() if name not in entries]
    if missing:
        pytest.fail(f"algorithm {name!r} is registered but missing from {missing}: an algorithm is a drafter, "
                    "a train strategy, a serving worker and a capture contract (DESIGN.md §5)")
    return name


@pytest.fixture(scope="session")
def debug_greedy(debug_target) -> dict[tuple[int, ...], list[int]]:
    """transformers' greedy continuation (``MAX_NEW`` tokens, cut at EOS) of each of ``PROMPTS``."""
    prompts = [encode_prompt(debug_target.tokenizer, p) for p in PROMPTS]
    with one_thread():  # a session fixture: set up before the module's single_thread
        return {tuple(ids): hf_greedy(debug_target, ids, MAX_NEW) for ids in prompts}


@pytest.fixture
def debug_drafter(debug_target, debug_greedy):
    """``debug_drafter(algorithm, kind, prompts=PROMPTS, first=None)``: a drafter of that kind for the
    debug target, its draft vocabulary (if any) the tokens most frequent among the first ``first``
    greedy tokens of ``prompts``."""

    def build(algorithm: str, kind: str, prompts=PROMPTS, first: int | None = None):
        continuations = [debug_greedy[tuple(encode_prompt(debug_target.tokenizer, p))] for p in prompts]
        return build_drafter(algorithm, debug_target, kind, frequent=frequent_tokens(continuations, first))

    return build


@pytest.fixture(scope="session")
def debug_runs(tmp_path_factory):
    """``debug_runs(algorithm)``: its ``DebugRun`` (features captured once per session) and the run
    directory of its straight ``GOLDEN_STEPS``-step run (``specray train``'s path, trained once)."""
    runs = {}

    def get(algorithm: str):
        if algorithm not in runs:
            root = tmp_path_factory.mktemp(f"train-{algorithm}")
            run = debug_run(algorithm, root, read_golden(algorithm))
            run_training(run.config(root / "straight"), progress=False)
            runs[algorithm] = (run, root / "straight")
        return runs[algorithm]

    return get
