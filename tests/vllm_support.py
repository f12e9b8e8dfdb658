"""Drafters that memorise the embedded target's greedy answers to a few MT-Bench prompts, and
what our engine does with them: the reference the vLLM tests compare vLLM with
(tests/drafters/test_vllm_peer.py, tests/serving/test_vllm_backend.py).

A small drafter trained for a minute on exactly those answers drafts them mostly right, so equal
acceptance on them says vLLM computes the drafts ours computes.
"""

import json
from dataclasses import replace
from pathlib import Path

import torch
import torch.nn.functional as F

from specray.capture.contract import build_contract, eagle3_layer_ids, spread_layer_ids
from specray.capture.data import load_conversations
from specray.capture.server import decoder_layer_outputs
from specray.drafters import dflash, eagle3
from specray.drafters.format import save_drafter
from specray.serving.engine import Engine
from specray.serving.sampling import SamplingParams

REPO = Path(__file__).parents[1]
VLLM_PYTHON = REPO / ".venv-vllm" / "bin" / "python"
NUM_PROMPTS, MAX_TOKENS = 3, 48
K = 3  # drafts per round in both engines; DFlash's debug block (B = 4) drafts exactly K, as vLLM's does
STEPS = 100  # training passes over the three answers: most drafts right, not all


def _features(target, ids: torch.Tensor, layer_ids) -> torch.Tensor:
    """The captured features of one sequence: ids [S] -> [1, S, L·D]."""
    with torch.no_grad():
        out = decoder_layer_outputs(target.model, ids[None], torch.ones(1, len(ids)), layer_ids)
    return torch.cat([out[i] for i in layer_ids], dim=-1)


def _fit(model, batches, loss_of) -> None:
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    for _ in range(STEPS):
        for batch in batches:
            loss = loss_of(model, *batch)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()


def _seeded(drafter_class, cfg, target, vocab: torch.Tensor):
    """A drafter initialised from seed 0 on the target's embedding and LM head, over ``vocab``."""
    torch.manual_seed(0)
    model = drafter_class(cfg, embed_tokens=target.model.get_input_embeddings(),
                          lm_head=target.model.get_output_embeddings())
    model.set_draft_vocab(vocab)
    return model


def _memorise_dflash(target, sequences: list[torch.Tensor], starts: list[int], layer_ids, vocab) -> dflash.DFlashDrafter:
    """DFlash (no block-key bias: the peer has none) trained on the blocks anchored in each answer:
    sequences [S_i] token ids whose answers start at ``starts[i]``."""
    cfg = replace(dflash.debug_config(target, layer_ids), block_key_bias=0.0, draft_vocab_size=len(vocab),
                  num_heads=8, head_dim=64, intermediate_size=512)
    model = _seeded(dflash.DFlashDrafter, cfg, target, vocab)
    batches = []
    for ids, start in zip(sequences, starts):
        anchors = torch.arange(start - 1, len(ids) - 1)[None]  # [1, N]: the prompt's last token, then the answer
        at = anchors[..., None] + torch.arange(1, cfg.block_size)  # [1, N, B-1] positions drafted
        labels = torch.where(at < len(ids), model.target_to_draft(ids[at.clamp(max=len(ids) - 1)]), -100)
        batches.append((_features(target, ids, layer_ids), ids[anchors], anchors, labels))

    def loss_of(model, hidden, anchor_ids, anchors, labels):
        logits = model(hidden, torch.ones(hidden.shape[:2], dtype=torch.bool), anchor_ids, anchors)
        return F.cross_entropy(logits.flatten(0, 2), labels.flatten(), ignore_index=-100)

    _fit(model, batches, loss_of)
    return model.eval()


def _memorise_eagle3(target, sequences: list[torch.Tensor], starts: list[int], layer_ids, vocab) -> eagle3.Eagle3Drafter:
    """EAGLE-3 trained, over K training-time-test steps, on the rows that draft each answer: step
    ``i`` row ``t`` predicts ``x_{t+2+i}``, rows from the one that pairs the last prompt state
    with the first answer token."""
    cfg = eagle3.debug_config(target, layer_ids, draft_vocab_size=len(vocab), num_heads=8, head_dim=64,
                              intermediate_size=512)
    model = _seeded(eagle3.Eagle3Drafter, cfg, target, vocab)
    batches = []
    for ids, start in zip(sequences, starts):
        rows = torch.arange(len(ids))
        steps = torch.stack([(rows >= start - 1) & (rows + 2 + i < len(ids)) for i in range(K)])[:, None]  # [K, 1, S]
        labels = [model.target_to_draft(ids[rows[steps[i, 0]] + 2 + i]) for i in range(K)]
        batches.append((_features(target, ids, layer_ids), ids[None], steps, labels))

    def loss_of(model, hidden, input_ids, steps, labels):
        return sum(F.cross_entropy(logits, y) for logits, y in zip(model(hidden, input_ids, steps), labels))

    _fit(model, batches, loss_of)
    return model.eval()


MEMORISE = {"dflash": (_memorise_dflash, spread_layer_ids), "eagle3": (_memorise_eagle3, eagle3_layer_ids)}


def acceptance(outputs, k: int) -> list[float]:
    """Per draft position, the fraction of rounds whose draft there was accepted, over the rounds
    vLLM runs: those that start before ``MAX_TOKENS`` tokens. vLLM verifies all k drafts of the
    round that crosses max_tokens and counts them before it cuts the output; our engine cuts the
    round, so ours runs ``K`` tokens longer (that round whole) and the rounds after it are dropped."""
    accepted = []
    for o in outputs:
        emitted = 1  # the prefill's token
        for n in o.emitted_per_round:
            if emitted >= MAX_TOKENS:
                break
            accepted.append(n - 1)
            emitted += n
    return [sum(a > j for a in accepted) / len(accepted) for j in range(k)]


def our_greedy(target, export: Path, prompts) -> tuple[list[list[int]], list[float]]:
    # every round drafts K, as vLLM's do (the automatic choice may take plain steps where the cost table says so)
    engine = Engine(target, str(export), max_batch=1, num_speculative_tokens=K, speculation="static")
    outputs = engine.generate(prompts, SamplingParams(max_tokens=MAX_TOKENS + K))
    eos = target.tokenizer.eos_token_id
    return [[t for t in o.token_ids[:MAX_TOKENS] if t != eos] for o in outputs], acceptance(outputs, K)


def greedy_answers(target) -> tuple[list[list[int]], list[list[int]]]:
    """``NUM_PROMPTS`` MT-Bench prompts and the target's greedy answers to them (our AR engine)."""
    engine = Engine(target, None, max_batch=1)
    prompts = [engine.encode(c.as_chat()) for c in load_conversations("mtbench", purpose="eval", limit=NUM_PROMPTS)]
    return prompts, [o.token_ids for o in engine.generate(prompts, SamplingParams(max_tokens=MAX_TOKENS))]


def memorised_export(target, algorithm: str, prompts, answers, out: Path) -> Path:
    """A specray export of ``algorithm`` that memorised ``answers`` to ``prompts``."""
    memorise, default_layer_ids = MEMORISE[algorithm]
    layer_ids = default_layer_ids(target.num_layers)
    sequences = [torch.tensor(p + a) for p, a in zip(prompts, answers)]
    model = memorise(target, sequences, [len(p) for p in prompts], layer_ids, torch.unique(torch.cat(sequences)))
    contract = build_contract(algorithm, target_fingerprint=target.target_fingerprint,
                              template_fingerprint=target.template_fingerprint, num_target_layers=target.num_layers,
                              hidden_size=target.hidden_size, layer_ids=layer_ids)
    return save_drafter(out, model, contract=json.loads(contract.to_json()),
                        provenance={"run": "memorised", "target": target.name})
