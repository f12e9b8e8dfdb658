"""Serving conformance of every registered worker (``serving/workers/base.py``):

- greedy decoding through the engine equals transformers' greedy ``generate``, with drafts
  mostly rejected (``random``) and often accepted (``one_token``), on the debug target and
  (``slow``) on the embedded SmolLM2 over 20 MT-Bench prompts;
- after rounds that rejected drafts, the target's KV equals the KV of a fresh prefill of the
  accepted text, and the worker's draft state is the one that prefill builds: the next round
  proposes the same drafts from the same distribution q (observed where every worker hands them
  to verification, ``kernels/rejection.py::rejection_sample``), with speculative rounds and with
  plain steps (rounds of size 0).

The engine runs with ``speculation="static"`` here: every round verifies the worker's largest
size, so every path of the worker runs (the chooser is tested in tests/serving/test_chooser.py).
"""

import pytest
import torch
from conformance_kit import (MAX_NEW, PROMPTS, build_drafter, export, frequent_tokens, hf_greedy,
                             recorded_verification)

from specray.serving.engine import Engine
from specray.serving.requests import encode_prompt
from specray.serving.runner import LlamaRunner
from specray.serving.sampling import SamplingParams, sample_next
from specray.serving.workers import TREE_WORKERS, WORKERS, Worker


@pytest.mark.parametrize("kind", ["random", "one_token"])
def test_engine_greedy_equals_transformers_generate(debug_target, debug_greedy, debug_drafter, algorithm, kind,
                                                    tmp_path):
    engine = Engine(debug_target, export(debug_drafter(algorithm, kind), debug_target, tmp_path / "export"),
                    max_batch=len(PROMPTS), max_len=512, speculation="static")
    assert isinstance(engine.worker, WORKERS[algorithm]) and isinstance(engine.worker, Worker)
    outputs = engine.generate(PROMPTS, SamplingParams(max_tokens=MAX_NEW))
    for out in outputs:
        assert out.token_ids == debug_greedy[tuple(out.prompt_ids)], PROMPTS[outputs.index(out)]
    stats = engine.stats()
    emitted = [n for out in outputs for n in out.emitted_per_round]
    assert stats["algorithm"] == algorithm and stats["versions"][0]["rounds"] == len(emitted) > 0
    assert any(n == 1 for n in emitted)  # rounds that rejected their first draft
    if kind == "one_token":  # and rounds that accepted drafts: the accept-and-commit path ran
        assert any(n > 1 for n in emitted), emitted


# -- caches after rejections --------------------------------------------------------------------


@pytest.fixture
def verified():
    with recorded_verification() as calls:
        yield calls


CACHE_PROMPTS = [PROMPTS[3], PROMPTS[1], PROMPTS[0]]  # the first two start with runs of a token


def _worker(target, drafter, algorithm, **options):
    runner = LlamaRunner(target.model, num_slots=len(CACHE_PROMPTS), max_len=512,
                         capture_layer_ids=drafter.config.target_layer_ids)
    return WORKERS[algorithm](runner, drafter, **options)


def _decode(worker, prompts, rounds, size):
    """Greedy rounds of ``size`` as the engine drives them; returns each request's text (prompt +
    emitted tokens, the last one the anchor) and each round's StepOutput."""
    slots = list(range(len(prompts)))
    generators = [torch.Generator().manual_seed(s) for s in slots]
    logits = worker.prefill(slots, prompts)
    texts = [list(p) + [sample_next(logits[s], SamplingParams(), generators[s])] for s, p in enumerate(prompts)]
    steps = []
    for _ in range(rounds):
        out = worker.step(slots, [t[-1] for t in texts], [SamplingParams()] * len(slots), generators, size)
        for text, tokens in zip(texts, out.tokens):
            text += tokens
        steps.append(out)
    return texts, steps


def _sampled_round(worker, slot, anchor, verified):
    """One sampled round of the request in ``slot`` alone; returns its StepOutput and what it verified."""
    before = len(verified)
    out = worker.step([slot], [anchor], [SamplingParams(temperature=1.0)], [torch.Generator().manual_seed(7)],
                      worker.verify_sizes[-1])
    assert len(verified) == before + 1, "a speculative round verifies through kernels/rejection.py::rejection_sample"
    return out, verified[-1]


@pytest.mark.parametrize("kind, plain", [("random", False), ("one_token", False), ("two_token", False),
                                         ("random", True)], ids=["random", "one_token", "two_token", "plain_steps"])
def test_caches_after_rejections_equal_caches_of_the_accepted_prefix(debug_target, debug_drafter, algorithm, kind,
                                                                     plain, verified):
    drafter = debug_drafter(algorithm, kind, CACHE_PROMPTS, first=12)
    prompts = [encode_prompt(debug_target.tokenizer, p) for p in CACHE_PROMPTS]
    # plain: plain steps (size 0) for all three; the check rounds run one at a time
    worker = _worker(debug_target, drafter, algorithm)
    texts, steps = _decode(worker, prompts, rounds=8, size=0 if plain else worker.verify_sizes[-1])
    assert all(step.speculative is not plain for step in steps)
    if not plain:
        assert any(r < n for step in steps for r, n in zip(step.accepted, step.num_drafts))  # rejections
    if kind != "random":
        assert any(0 < r < n for step in steps for r, n in zip(step.accepted, step.num_drafts)), \
            [step.accepted for step in steps]  # a partly accepted round
    fresh = _worker(debug_target, drafter, algorithm)
    fresh.prefill([0, 1, 2], [text[:-1] for text in texts])  # the accepted text; its last token is the anchor
    cache, fresh_cache = worker.runner.cache, fresh.runner.cache
    for slot, text in enumerate(texts):
        n = len(text) - 1
        assert int(cache.committed[slot]) == int(fresh_cache.committed[slot]) == n
        torch.testing.assert_close(cache.k[:, slot, :, :n], fresh_cache.k[:, slot, :, :n], rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(cache.v[:, slot, :, :n], fresh_cache.v[:, slot, :, :n], rtol=1e-4, atol=1e-5)
        out, seen = _sampled_round(worker, slot, text[-1], verified)
        fresh_out, fresh_seen = _sampled_round(fresh, slot, text[-1], verified)
        assert torch.equal(seen["drafts"], fresh_seen["drafts"]), slot
        torch.testing.assert_close(seen["q"], fresh_seen["q"], rtol=1e-4, atol=1e-6)
        torch.testing.assert_close(seen["target"], fresh_seen["target"], rtol=1e-4, atol=1e-6)
        assert (out.tokens, out.accepted) == (fresh_out.tokens, fresh_out.accepted)


# -- the embedded target ---------------------------------------------------------------------


SMOL_PROMPTS = 20
SMOL_MAX_NEW = 16


@pytest.fixture(scope="module")
def smol_greedy(smollm2):
    from specray.capture.data import load_conversations

    prompts = [encode_prompt(smollm2.tokenizer, c.as_chat())
               for c in load_conversations("mtbench", purpose="eval", limit=SMOL_PROMPTS)]
    return {tuple(ids): hf_greedy(smollm2, ids, SMOL_MAX_NEW) for ids in prompts}


@pytest.mark.slow
@pytest.mark.timeout(1200)  # about 1.5 min on an idle 2-core machine, the reference included
def test_smollm2_greedy_equals_transformers_generate_on_mtbench(smollm2, smol_greedy, algorithm, tmp_path):
    """The one-token drafter: most rounds reject, the rounds inside the target's runs of its token accept."""
    drafter = build_drafter(algorithm, smollm2, "one_token", frequent=frequent_tokens(smol_greedy.values()))
    engine = Engine(smollm2, export(drafter, smollm2, tmp_path / "export"), max_batch=4, max_len=1024,
                    speculation="static")
    outputs = engine.generate([list(ids) for ids in smol_greedy], SamplingParams(max_tokens=SMOL_MAX_NEW))
    mismatched = [i for i, out in enumerate(outputs) if out.token_ids != smol_greedy[tuple(out.prompt_ids)]]
    assert len(outputs) == SMOL_PROMPTS and not mismatched, f"MT-Bench prompts {mismatched} differ from generate"
    emitted = [n for out in outputs for n in out.emitted_per_round]
    assert any(n == 1 for n in emitted) and any(n > 1 for n in emitted), emitted


# -- logprobs ---------------------------------------------------------------------------------


def _check_logprobs(target, outputs, top: int) -> None:
    """Each output token's logprob and top alternatives are the target's raw log-softmax at its
    position, computed by transformers over the whole sequence."""
    for out in outputs:
        ids = out.prompt_ids + out.token_ids
        with torch.inference_mode():
            logits = target.model(torch.tensor([ids])).logits[0].float()  # [T, V]
        ref = logits[len(out.prompt_ids) - 1 : len(ids) - 1].log_softmax(-1)  # [n, V]: the row each token came from
        assert len(out.logprobs) == len(out.token_ids)
        assert [lp.token_id for lp in out.logprobs] == out.token_ids
        got = torch.tensor([lp.logprob for lp in out.logprobs])
        torch.testing.assert_close(got, ref.gather(1, torch.tensor(out.token_ids)[:, None])[:, 0], atol=1e-4, rtol=0)
        values, index = ref.topk(top, dim=-1)
        assert [[i for i, _ in lp.top] for lp in out.logprobs] == index.tolist()
        torch.testing.assert_close(torch.tensor([[v for _, v in lp.top] for lp in out.logprobs]), values,
                                   atol=1e-4, rtol=0)


@pytest.mark.parametrize("temperature", [0.0, 0.3])
def test_logprobs_are_the_targets_at_every_emitted_position(debug_target, debug_drafter, algorithm, temperature,
                                                            tmp_path):
    """Speculative rounds emit several tokens per target forward: each one's logprob is read from
    the verify row it was drawn from, exactly what decoding one token at a time would report."""
    engine = Engine(debug_target, export(debug_drafter(algorithm, "one_token"), debug_target, tmp_path / "export"),
                    max_batch=len(PROMPTS), max_len=512, speculation="static")
    outputs = engine.generate(PROMPTS, SamplingParams(max_tokens=MAX_NEW, temperature=temperature, seed=3, logprobs=3))
    _check_logprobs(debug_target, outputs, 3)
    assert any(n > 1 for out in outputs for n in out.emitted_per_round)  # rounds that emitted accepted drafts
    assert engine.generate(PROMPTS[:1], SamplingParams(max_tokens=4))[0].logprobs is None  # off unless asked


@pytest.mark.parametrize("algorithm", sorted(TREE_WORKERS))
def test_logprobs_of_draft_trees_follow_the_accepted_path(debug_target, debug_drafter, algorithm, tmp_path):
    engine = Engine(debug_target, export(debug_drafter(algorithm, "random"), debug_target, tmp_path / "export"),
                    max_batch=len(PROMPTS), max_len=512, speculation="static", tree=True)
    outputs = engine.generate(PROMPTS, SamplingParams(max_tokens=MAX_NEW, logprobs=2))
    _check_logprobs(debug_target, outputs, 2)
    assert any(n > 1 for out in outputs for n in out.emitted_per_round)
