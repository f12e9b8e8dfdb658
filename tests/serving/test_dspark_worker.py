"""DSpark worker on the debug target: its round sizes (the anchor row drafts), the q it hands to
verification (the sequence head's corrected distribution, never the backbone's), and sampled
rounds through the head keep the target's distribution (chi-square)."""

from dataclasses import replace

import pytest
import torch
from lossless_chi2 import CHI2_8_P001, accepted_of, candidate_vocab, chi_square, exact_two_tokens, sample_two_tokens

from specray.drafters import dspark
from specray.serving.runner import LlamaRunner
from specray.serving.sampling import SamplingParams, process
from specray.serving.workers.dspark import DSparkWorker


def _drafter(target, draft_vocab=None, head="vanilla", seed=0):
    cfg = replace(dspark.debug_config(target), markov_head_type=head,
                  draft_vocab_size=None if draft_vocab is None else len(draft_vocab))
    torch.manual_seed(seed)
    model = dspark.DSparkDrafter(cfg, embed_tokens=target.model.get_input_embeddings(),
                                 lm_head=target.model.get_output_embeddings())
    with torch.no_grad():  # drafts that depend on the context, and a head that moves q
        for name, p in model.named_parameters():
            if p.dim() == 2:
                p.mul_(4.0)
        model.markov_head.markov_w1.weight.normal_(0.0, 0.5)
        model.markov_head.markov_w2.weight.normal_(0.0, 1.0)
    if draft_vocab is not None:
        model.set_draft_vocab(draft_vocab)
    return model.eval().requires_grad_(False)


def _worker(target, drafter, k=None, slots=2):
    runner = LlamaRunner(target.model, num_slots=slots, max_len=256, capture_layer_ids=drafter.config.target_layer_ids)
    return DSparkWorker(runner, drafter, num_speculative_tokens=k)


def _encode(target, text):
    return target.tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                                tokenize=True, return_dict=True)["input_ids"]


def test_round_sizes_count_the_anchor_rows_draft(debug_target):
    drafter = _drafter(debug_target)
    B = drafter.config.block_size
    worker = _worker(debug_target, drafter)
    assert worker.verify_sizes == tuple(range(1, B + 1)) and worker.max_verify_rows == B + 1
    assert _worker(debug_target, drafter, k=2).verify_sizes == (1, 2)
    assert _worker(debug_target, drafter, k=99).verify_sizes[-1] == B
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        _worker(debug_target, drafter, k=0)


@pytest.mark.parametrize("head", ["vanilla", "rnn"])
def test_sampled_drafts_come_from_the_corrected_q_handed_to_verification(debug_target, head, monkeypatch):
    vocab = torch.arange(0, debug_target.vocab_size, 3)
    drafter = _drafter(debug_target, vocab, head)
    worker = _worker(debug_target, drafter)
    worker.prefill([0, 1], [_encode(debug_target, "Hi"), _encode(debug_target, "1 2 3")])
    worker.catch_up([0, 1])
    seen = []
    original = drafter.draft
    monkeypatch.setattr(drafter, "draft", lambda hidden, anchors, pick, greedy: seen.append((hidden, anchors))
                        or original(hidden, anchors, pick, greedy))
    params = [SamplingParams(temperature=0.7), SamplingParams()]
    B = drafter.config.block_size
    drafts, qs = worker.propose([0, 1], [5, 7], params, [torch.Generator().manual_seed(0), None], B)
    assert drafts.shape == (2, B) and torch.isin(drafts, vocab).all() and qs[1] is None  # greedy: no q
    (hidden, anchors), = seen
    prev = torch.cat([anchors[:, None], drafts[:, :-1]], dim=1)  # the drafts are the next rows' previous tokens
    with torch.no_grad():
        corrected, _ = drafter.corrected(hidden, prev)  # [2, B, V_d]
    expected = drafter.to_target_distribution(process(corrected[0], params[0]))  # [B, V]
    torch.testing.assert_close(qs[0], expected, rtol=1e-5, atol=1e-6)
    assert (qs[0][torch.arange(B), drafts[0]] > 0).all()
    backbone = drafter.to_target_distribution(process(drafter.logits(hidden[0]), params[0]))
    assert (qs[0] - backbone).abs().max() > 1e-2  # not the backbone's softmax
    assert torch.equal(drafts[1], drafter.draft_to_target(corrected[1].argmax(-1)))
    assert len(worker.stats()["confidence_by_pos"]) == B


def test_sampled_rounds_through_the_head_keep_the_targets_distribution(debug_target, one_thread):
    """Two tokens per request at temperature 1, top-k 3: the first from the prefill, the second from
    a round of 2 drafts; their joint frequency against the target's p(t1) p(t2 | t1). Handing
    verification the backbone's softmax instead of the corrected q gives chi2 > 200 here."""
    prompt = _encode(debug_target, "Hi")
    exact = exact_two_tokens(debug_target, prompt)
    worker = _worker(debug_target, _drafter(debug_target, candidate_vocab(exact), seed=2), k=2, slots=8)
    counts, steps = sample_two_tokens(worker, prompt, 2 * 8)  # budget: 2 drafts each
    assert chi_square(counts, exact) < CHI2_8_P001, chi_square(counts, exact)
    accepted = accepted_of(steps)
    assert sum(r >= 1 for r in accepted) > 0.05 * len(accepted)  # accepted drafts: the accept path ran


def test_a_greedy_and_a_sampled_request_read_their_own_calibration_tables(debug_target):
    """calibration.json holds a table per mode; a batch mixing modes calibrates each request's confidences
    with its own (the same drafter row gives σ(z / T_greedy) to one, σ(z / T_sampling) to the other), and the
    survival the chooser sizes budgets from is each request's own."""
    drafter = _drafter(debug_target)
    B = drafter.config.block_size
    drafter.confidence_temperature.copy_(torch.tensor([[0.5] * B, [4.0] * B]))  # rows: greedy, sampling
    worker = _worker(debug_target, drafter)
    prompt = _encode(debug_target, "Hi")
    worker.prefill([0, 1], [prompt, prompt])
    worker.catch_up([0, 1])
    params = [SamplingParams(), SamplingParams(temperature=1.0)]
    _, _, confidence = worker.draft_block([0, 1], [5, 5], params, [None, torch.Generator().manual_seed(0)], B)
    z = torch.logit(confidence[:, 0].double())  # row 0 reads only the anchor: the same raw logit for both
    torch.testing.assert_close(z[0] * 0.5, z[1] * 4.0, rtol=1e-4, atol=1e-5)
    assert confidence[0, 0] != confidence[1, 0]
    worker.step([0, 1], [5, 5], params, [None, torch.Generator().manual_seed(1)], size=2)
    published = worker.published_survival()  # [2, k]
    assert published.shape == (2, B) and not torch.equal(published[0], published[1])
