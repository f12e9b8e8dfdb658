"""serving/workers/dflash2.py: a DFlash 2 warm-started from a DFlash drafts exactly what the DFlash
worker drafts (greedy); a sampled round's q is the walked selector rows scattered to the vocabulary
(zero outside the K candidates, each draft among its candidates with q > 0); sampled rounds through
the selector keep the target's distribution (chi-square). Greedy == transformers and the caches after
rejections are the conformance suite's."""

import pytest
import torch

from specray.drafters.dflash import DFlashConfig, DFlashDrafter
from specray.drafters.dflash2 import DFlash2Config, DFlash2Drafter
from specray.serving.runner import LlamaRunner
from specray.serving.sampling import SamplingParams, sample_next
from specray.serving.workers.dflash import DFlashWorker
from specray.serving.workers.dflash2 import DFlash2Worker


def _drafters(target, draft_vocab=None, top_k=6):
    shared = {"embed_tokens": target.model.get_input_embeddings(), "lm_head": target.model.get_output_embeddings()}
    base = dict(hidden_size=target.hidden_size, vocab_size=target.vocab_size, target_layer_ids=(1, 4),
                mask_token_id=0, num_layers=1, num_heads=4, num_kv_heads=2, head_dim=16, intermediate_size=128,
                block_size=5)
    torch.manual_seed(0)
    dflash = DFlashDrafter(DFlashConfig(**base), **shared)
    with torch.no_grad():
        for p in dflash.parameters():
            if p.dim() == 2:
                p.mul_(4.0)  # drafts that depend on the context
    vocab = {} if draft_vocab is None else {"draft_vocab_size": len(draft_vocab)}
    dflash2 = DFlash2Drafter(DFlash2Config(**base, **vocab, selector_top_k=top_k, selector_rank=8), **shared)
    dflash2.load_state_dict(dflash.state_dict(), strict=False)
    if draft_vocab is not None:
        dflash2.set_draft_vocab(draft_vocab)
    return dflash.eval(), dflash2.eval()


def _propose(worker_cls, drafter, target, prompts, params):
    runner = LlamaRunner(target.model, num_slots=len(prompts), max_len=128, capture_layer_ids=(1, 4))
    worker = worker_cls(runner, drafter)
    slots = list(range(len(prompts)))
    anchors = worker.prefill(slots, prompts).argmax(-1).tolist()
    generators = [torch.Generator().manual_seed(9) for _ in prompts]
    return worker.propose(slots, anchors, params, generators, 4)


def test_warm_started_dflash2_drafts_what_dflash_drafts(debug_target):
    dflash, dflash2 = _drafters(debug_target)
    prompts, greedy = [[5, 9, 13, 2, 7], [40, 41, 42]], [SamplingParams(), SamplingParams()]
    ours, _ = _propose(DFlashWorker, dflash, debug_target, prompts, greedy)
    theirs, qs = _propose(DFlash2Worker, dflash2, debug_target, prompts, greedy)
    assert torch.equal(ours, theirs) and qs == [None, None]


def test_sampled_q_is_the_walked_rows_scattered_to_the_vocabulary(debug_target):
    _, dflash2 = _drafters(debug_target)
    with torch.no_grad():
        dflash2.candidate_selector.successor_codebook.normal_(0, 3.0)  # a selector that reranks
    params = [SamplingParams(temperature=1.0), SamplingParams()]
    drafts, qs = _propose(DFlash2Worker, dflash2, debug_target, [[5, 9, 13, 2, 7], [40, 41, 42]], params)
    q = qs[0]  # [k, V]
    assert q.shape == (4, debug_target.vocab_size) and qs[1] is None
    assert torch.equal((q > 0).sum(-1), torch.full((4,), 6))  # K candidates, zero elsewhere
    torch.testing.assert_close(q.sum(-1), torch.ones(4))
    assert bool((q.gather(-1, drafts[0][:, None]) > 0).all())


@pytest.fixture
def one_thread():
    """1,024 tiny forwards: one intra-op thread keeps them from spinning on a busy machine."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


# 9 cells, 8 degrees of freedom: p = 0.001.
CHI2_8_P001 = 26.1


def test_sampled_rounds_through_the_selector_keep_the_targets_distribution(debug_target, one_thread):
    """Two tokens per request at temperature 1, top-k 3: the first from the prefill, the second from a
    round of 2 drafts walked through a reranking selector (K = 8 of an 11-token draft vocabulary); their
    joint frequency against the target's p(t1) p(t2 | t1). Handing verification a uniform q over the
    candidates instead of the walked rows gives chi2 > 100 here."""
    prompt = debug_target.tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}], add_generation_prompt=True,
                                                        tokenize=True, return_dict=True)["input_ids"]
    params = SamplingParams(temperature=1.0, top_k=3)
    with torch.inference_mode():
        first = torch.topk(debug_target.model(torch.tensor([prompt])).logits[0, -1], 3)
        exact = {}
        for t1, w1 in zip(first.indices.tolist(), first.values.softmax(-1).tolist()):
            second = torch.topk(debug_target.model(torch.tensor([prompt + [t1]])).logits[0, -1], 3)
            for t2, w2 in zip(second.indices.tolist(), second.values.softmax(-1).tolist()):
                exact[(t1, t2)] = w1 * w2
    # a draft vocabulary of the target's candidates, so drafts are sometimes accepted
    vocab = sorted({t for pair in exact for t in pair})
    _, drafter = _drafters(debug_target, torch.tensor(vocab), top_k=8)
    with torch.no_grad():
        drafter.candidate_selector.successor_codebook.normal_(0, 2.0)
    runner = LlamaRunner(debug_target.model, num_slots=8, max_len=128, capture_layer_ids=(1, 4))
    worker = DFlash2Worker(runner, drafter, num_speculative_tokens=2)
    counts: dict[tuple[int, int], int] = {}
    accepted = []
    for batch in range(128):
        generators = [torch.Generator().manual_seed(batch * 8 + b) for b in range(8)]
        logits = worker.prefill(list(range(8)), [prompt] * 8)
        firsts = [sample_next(logits[b], params, generators[b]) for b in range(8)]
        step = worker.step(list(range(8)), firsts, [params] * 8, generators, 2)
        accepted += step.accepted
        for slot, (t1, tokens) in enumerate(zip(firsts, step.tokens)):
            counts[(t1, tokens[0])] = counts.get((t1, tokens[0]), 0) + 1
            worker.runner.cache.release(slot)
            worker.release(slot)
    n = sum(counts.values())
    assert set(counts) <= set(exact)
    chi2 = sum((counts.get(c, 0) - n * p) ** 2 / (n * p) for c, p in exact.items())
    assert chi2 < CHI2_8_P001, chi2
    assert sum(r >= 1 for r in accepted) > 0.05 * len(accepted)  # accepted drafts: the accept path ran
