"""serving/workers/dflash2.py: a DFlash 2 warm-started from a DFlash drafts exactly what the DFlash
worker drafts (greedy); a sampled round's q is the walked selector rows scattered to the vocabulary
(zero outside the K candidates, each draft among its candidates with q > 0); sampled rounds through
the selector keep the target's distribution (chi-square). Greedy == transformers and the caches after
rejections are the conformance suite's."""

import torch
from lossless_chi2 import CHI2_8_P001, accepted_of, candidate_vocab, chi_square, exact_two_tokens, sample_two_tokens

from specray.drafters.dflash import DFlashConfig, DFlashDrafter
from specray.drafters.dflash2 import DFlash2Config, DFlash2Drafter
from specray.serving.runner import LlamaRunner
from specray.serving.sampling import SamplingParams
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


def test_sampled_rounds_through_the_selector_keep_the_targets_distribution(debug_target, one_thread):
    """Two tokens per request at temperature 1, top-k 3: the first from the prefill, the second from a
    round of 2 drafts walked through a reranking selector (K = 8 of an 11-token draft vocabulary); their
    joint frequency against the target's p(t1) p(t2 | t1). Handing verification a uniform q over the
    candidates instead of the walked rows gives chi2 > 100 here."""
    prompt = debug_target.tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}], add_generation_prompt=True,
                                                        tokenize=True, return_dict=True)["input_ids"]
    exact = exact_two_tokens(debug_target, prompt)
    _, drafter = _drafters(debug_target, candidate_vocab(exact), top_k=8)
    with torch.no_grad():
        drafter.candidate_selector.successor_codebook.normal_(0, 2.0)
    runner = LlamaRunner(debug_target.model, num_slots=8, max_len=128, capture_layer_ids=(1, 4))
    counts, steps = sample_two_tokens(DFlash2Worker(runner, drafter, num_speculative_tokens=2), prompt, 2)
    assert chi_square(counts, exact) < CHI2_8_P001, chi_square(counts, exact)
    accepted = accepted_of(steps)
    assert sum(r >= 1 for r in accepted) > 0.05 * len(accepted)  # accepted drafts: the accept path ran
