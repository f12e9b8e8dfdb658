"""SGLang serves our SGLang-format exports (drafters/sglang.py), EAGLE-3 and DFlash: the check on a GPU.

SGLang 0.5.23 imports only with CUDA (sgl-kernel, flashinfer), so this runs where a Python with
SGLang and a GPU is named by ``$SGLANG_PYTHON`` (skipped otherwise):

    SGLANG_PYTHON=/opt/sglang/bin/python timeout 3600 .venv/bin/python -m pytest tests/drafters/test_sglang_peer.py -q -s

The drafters of tests/drafters/test_vllm_peer.py memorise the target's greedy answers to three
MT-Bench prompts (DFlash over the whole vocabulary: SGLang's DFlash has no draft vocabulary);
SGLang loads each export (tests/drafters/sglang_peer_run.py) with the
embedded target's directory as ``--model-path``. SGLang skips a weight whose name its loader does
not know, so a wrong name shows as acceptance near 1 token per round: the check is that SGLang's
speculative output equals its plain greedy output (lossless) and that it accepts at least 80 % of
what our engine accepts per round on the same export (GPU bf16 kernels may flip a close draft).
"""

import json
import os
import subprocess
from pathlib import Path

import pytest
import torch

from specray.capture.contract import build_contract
from specray.drafters.format import save_drafter
from specray.drafters.sglang import write_sglang_export
from specray.serving.engine import Engine
from specray.serving.sampling import SamplingParams

SGLANG_PYTHON = os.environ.get("SGLANG_PYTHON")
pytestmark = [pytest.mark.slow, pytest.mark.timeout(3600),
              pytest.mark.skipif(not SGLANG_PYTHON, reason="needs $SGLANG_PYTHON: a Python with sglang 0.5.23 "
                                                           "on a CUDA machine")]

from test_vllm_peer import K, MAX_TOKENS, MEMORISE, answers  # noqa: E402,F401  (answers: a fixture)

ALGORITHMS = {"eagle3": "EAGLE3", "dflash": "DFLASH"}  # ours -> --speculative-algorithm


def _sglang(target, drafter: Path | None, algorithm: str, prompts, tmp_path: Path) -> dict:
    request = {"target": str(target.path), "drafter": str(drafter) if drafter else None, "algorithm": algorithm,
               "num_speculative_tokens": K, "prompts": prompts, "max_tokens": MAX_TOKENS,
               "eos": target.tokenizer.eos_token_id}
    name = "drafter" if drafter else "plain"
    (tmp_path / f"{name}.json").write_text(json.dumps(request))
    subprocess.run([SGLANG_PYTHON, str(Path(__file__).with_name("sglang_peer_run.py")), str(tmp_path / f"{name}.json"),
                    str(tmp_path / f"{name}-result.json")], check=True, timeout=1800)
    return json.loads((tmp_path / f"{name}-result.json").read_text())


@pytest.mark.parametrize("algorithm", sorted(ALGORITHMS))
def test_sglang_serves_the_export(smollm2, answers, tmp_path, algorithm):  # noqa: F811
    prompts, answers = answers
    memorise, default_layer_ids = MEMORISE[algorithm]
    layer_ids = default_layer_ids(smollm2.num_layers)
    sequences = [torch.tensor(p + a) for p, a in zip(prompts, answers)]
    vocab = torch.arange(smollm2.vocab_size) if algorithm == "dflash" else torch.unique(torch.cat(sequences))
    model = memorise(smollm2, sequences, [len(p) for p in prompts], layer_ids, vocab)
    contract = build_contract(algorithm, target_fingerprint=smollm2.target_fingerprint,
                              template_fingerprint=smollm2.template_fingerprint, num_target_layers=smollm2.num_layers,
                              hidden_size=smollm2.hidden_size, layer_ids=layer_ids)
    export = save_drafter(tmp_path / "export", model, contract=json.loads(contract.to_json()),
                          provenance={"run": "memorised", "target": smollm2.name})
    out = write_sglang_export(export, tmp_path / "export-sglang", target=smollm2, verifier_name_or_path=str(smollm2.path))

    engine = Engine(smollm2, str(export), max_batch=1, num_speculative_tokens=K, speculation="static")
    ours = engine.generate(prompts, SamplingParams(max_tokens=MAX_TOKENS))
    ours_accept = sum(len(o.token_ids) for o in ours) / sum(o.rounds for o in ours)
    plain = _sglang(smollm2, None, ALGORITHMS[algorithm], prompts, tmp_path)
    speculative = _sglang(smollm2, out, ALGORITHMS[algorithm], prompts, tmp_path)
    print(f"\n{algorithm} tokens per round: ours {ours_accept:.2f}, SGLang {speculative['accept_length']:.2f}")
    assert speculative["token_ids"] == plain["token_ids"]
    assert speculative["accept_length"] >= 0.8 * ours_accept and ours_accept > 1.5
