"""DSpark's confidence scheduler through the serving path: the runner's packed verify returns every
row (equal to the padded forward), a ragged accept equals per-request accepts, a round verifies the
lengths the schedule gives for its budget and commits r + 1 rows, sampled rounds through the
schedule keep the target's distribution (chi-square), and the chooser's draft budgets."""

import json
from dataclasses import replace

import pytest
import torch
from lossless_chi2 import CHI2_8_P001, candidate_vocab, chi_square, exact_two_tokens, sample_two_tokens

from specray.capture.contract import build_contract
from specray.drafters import dspark
from specray.drafters.format import save_drafter
from specray.kernels.verify_schedule import schedule_verify_lens
from specray.serving.chooser import RoundChooser
from specray.serving.cost_table import CostEntry, CostTable, MachineDescription
from specray.serving.engine import Engine
from specray.serving.runner import LlamaRunner
from specray.serving.sampling import SamplingParams
from specray.serving.verify import accept_chains
from specray.serving.workers import dspark as dspark_worker
from specray.serving.workers.dspark import DSparkWorker


def _drafter(target, draft_vocab=None, seed=0):
    cfg = replace(dspark.debug_config(target), draft_vocab_size=None if draft_vocab is None else len(draft_vocab))
    torch.manual_seed(seed)
    model = dspark.DSparkDrafter(cfg, embed_tokens=target.model.get_input_embeddings(),
                                 lm_head=target.model.get_output_embeddings())
    with torch.no_grad():  # drafts and confidences that depend on the context and the previous token
        for name, p in model.named_parameters():
            if p.dim() == 2:
                p.mul_(4.0)
        model.markov_head.markov_w1.weight.normal_(0.0, 0.5)
        model.markov_head.markov_w2.weight.normal_(0.0, 1.0)
        model.confidence_head.proj.weight.normal_(0.0, 0.5)
    if draft_vocab is not None:
        model.set_draft_vocab(draft_vocab)
    return model.eval().requires_grad_(False)


def _worker(target, drafter, slots):
    runner = LlamaRunner(target.model, num_slots=slots, max_len=256, capture_layer_ids=drafter.config.target_layer_ids)
    return DSparkWorker(runner, drafter)


def _encode(target, text):
    return target.tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                                tokenize=True, return_dict=True)["input_ids"]


def test_packed_verify_returns_every_row_as_the_padded_forward(debug_target):
    runners = [LlamaRunner(debug_target.model, num_slots=3, max_len=64, capture_layer_ids=(1,)) for _ in range(2)]
    rows = [[5, 9, 31], [40], [12, 2, 2, 8]]
    for runner in runners:  # committed context of different lengths
        runner.prefill([[1, 2, 3, 4], [7, 8], [9]], torch.tensor([0, 1, 2]))
        for slot, n in enumerate((4, 2, 1)):
            runner.cache.commit(slot, n)
    packed = runners[0].prefill(rows, torch.tensor([0, 1, 2]), every_row=True)
    ids = torch.zeros(3, 4, dtype=torch.long)
    for b, r in enumerate(rows):
        ids[b, : len(r)] = torch.tensor(r)
    padded = runners[1].forward(ids, torch.tensor([0, 1, 2]), torch.tensor([3, 1, 4]))
    assert packed.logits.shape == padded.logits.shape
    for b, r in enumerate(rows):
        torch.testing.assert_close(packed.logits[b, : len(r)], padded.logits[b, : len(r)], atol=1e-5, rtol=1e-5)
        assert not packed.logits[b, len(r):].any()


def test_a_ragged_accept_equals_each_requests_own():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 4, 11, generator=g)  # [B, M, V]
    drafts = logits[:, :3].argmax(-1)  # target's argmaxes: every verified draft is accepted ...
    drafts[0, 1] = (drafts[0, 1] + 1) % 11  # ... but request 0's second
    params = [SamplingParams()] * 3
    num_drafts = [3, 0, 2]
    ragged = accept_chains(logits, drafts, params, [None] * 3, [None] * 3, num_drafts=num_drafts)
    for b, n in enumerate(num_drafts):
        alone = accept_chains(logits[b : b + 1, : n + 1], drafts[b : b + 1, :n], params[:1], [None], [None])
        assert ragged.tokens[b] == alone.tokens[0] and ragged.accepted[b] == alone.accepted[0]
    assert ragged.accepted == [1, 0, 2] and ragged.tokens[1] == [int(logits[1, 0].argmax())]  # row 0: the bonus


def test_a_round_verifies_the_scheduled_lengths_and_commits_r_plus_one_rows(debug_target, monkeypatch):
    drafter = _drafter(debug_target)
    worker = _worker(debug_target, drafter, slots=3)
    prompts = [_encode(debug_target, t) for t in ("Hi", "1 2 3 4", "Tell me a story")]
    logits = worker.prefill([0, 1, 2], prompts)
    anchors = [int(x) for x in logits.argmax(-1)]
    assert torch.equal(worker.published_survival(), torch.ones(3, worker.verify_sizes[-1]))  # not drafted yet
    seen = []
    original = worker.draft_block
    monkeypatch.setattr(worker, "draft_block", lambda *a: seen.append(original(*a)) or seen[-1])
    k = worker.verify_sizes[-1]
    with pytest.raises(ValueError, match="draft budget"):
        worker.step([0, 1, 2], anchors, [SamplingParams()] * 3, [None] * 3, 3 * k + 1)
    out = worker.step([0, 1, 2], anchors, [SamplingParams()] * 3, [None] * 3, 5)
    (_, _, confidence), = seen
    expected = (schedule_verify_lens(confidence.cumprod(-1), 5) - 1).tolist()
    assert out.num_drafts == expected and sum(expected) == 5 and len(set(expected)) > 1  # ragged
    assert torch.equal(worker.published_survival(), confidence.cumprod(-1))  # for the next rounds' budgets
    for b, prompt in enumerate(prompts):
        assert len(out.tokens[b]) == out.accepted[b] + 1 <= out.num_drafts[b] + 1
        assert int(worker.runner.cache.committed[b]) == len(prompt) + out.accepted[b] + 1  # [a, d1 … dr]
        assert int(worker.context.committed[b]) == len(prompt) + out.accepted[b] + 1
    full = worker.step([0, 1, 2], [t[-1] for t in out.tokens], [SamplingParams()] * 3, [None] * 3, 3 * k)
    assert full.num_drafts == [k] * 3  # a budget of every slot: every request verifies k (the static setting)
    worker.release(1)
    assert len(worker.published_survival()) == 2


@pytest.mark.parametrize("peek", [False, True], ids=["schedule", "peeking_control"])
def test_sampled_rounds_through_the_schedule_keep_the_targets_distribution(debug_target, one_thread, peek,
                                                                           monkeypatch):
    """Eight requests per batch at temperature 1, top-k 3, a budget of 6 draft slots for the batch:
    the schedule gives each request 0 … k drafts from the confidences; each request's first two
    tokens (one from the prefill, one from the round) against p(t1) p(t2 | t1). The control: a
    schedule that verifies d1 only when it is q's most likely token (a decision that reads the
    draft itself, which the confidence schedule never does) fails the same test (chi2 ≈ 64)."""
    prompt = _encode(debug_target, "Hi")
    exact = exact_two_tokens(debug_target, prompt)
    worker = _worker(debug_target, _drafter(debug_target, candidate_vocab(exact), seed=2), slots=8)
    if peek:
        seen = []
        draft_block = worker.draft_block
        monkeypatch.setattr(worker, "draft_block", lambda *a: seen.append(draft_block(*a)) or seen[-1])
        monkeypatch.setattr(dspark_worker, "schedule_verify_lens", lambda survival, budget: torch.tensor(
            [2 if int(seen[-1][0][b, 0]) == int(q[0].argmax()) else 1 for b, q in enumerate(seen[-1][1])]))
    counts, steps = sample_two_tokens(worker, prompt, 6)
    chi2 = chi_square(counts, exact)
    assert (chi2 > CHI2_8_P001) if peek else (chi2 < CHI2_8_P001), chi2
    lengths = [n for step in steps for n in step.num_drafts]
    assert {0, 1} <= set(lengths)  # ragged: requests that verified nothing and requests that verified drafts


MACHINE = MachineDescription(cpu="test cpu", logical_cpus=2, threads=2, torch="2.13.0", device="cpu",
                             target="sha256:abc", dtype="float32")


def _table(cost) -> CostTable:
    return CostTable(machine=MACHINE, context_tokens=256, repeats=1, created="2026-11-30T00:00:00+00:00",
                     entries=[CostEntry(batch=b, rows=r, seconds=cost(b, r)) for b in (1, 2, 4) for r in (1, 2, 4, 8)])


def test_the_chooser_picks_a_batch_budget_from_measured_survival():
    chooser = RoundChooser(_table(lambda b, r: 0.02 * b), (1, 2, 3), "ragged")
    assert chooser.candidates(1) == (1, 2, 3) and chooser.candidates(4) == tuple(range(2, 13, 2))
    for _ in range(200):  # position 1 always accepted, position 2 half the time, position 3 never
        chooser.record(4, 12, 0.02 * 4, [3, 3, 3, 3], [1, 2, 1, 2], 10)
    alphas = chooser.chain.alphas()
    survival = [alphas[0], alphas[0] * alphas[1], alphas[0] * alphas[1] * alphas[2]]
    # budget 6 over 4 requests: every request's position 1, then two of position 2
    assert chooser.budget_accepted(4, 6) == pytest.approx(4 * survival[0] + 2 * survival[1])
    assert chooser.choose(4) == 12  # verify rows cost nothing here: the whole batch's drafts
    seed = RoundChooser(_table(lambda b, r: 0.02 * b), (1, 2, 3), "ragged",
                        survival=lambda: torch.tensor([[0.9, 0.6, 0.2], [0.8, 0.5, 0.1]]))
    predicted = [2 + seed.budget_accepted(2, K) for K in range(7)]  # seed §5.6.3's N column
    assert predicted == pytest.approx([2.0, 2.9, 3.7, 4.3, 4.8, 5.0, 5.1])
    # published for another group (2 requests, not 3): the measured chain survival, 0.5 before any round
    assert seed.budget_accepted(3, 3) == pytest.approx(3 * 0.5)
    assert RoundChooser(_table(lambda b, r: 0.02 * b), (1, 2, 3), "ragged", static=True).choose(4) == 12
    costly = RoundChooser(_table(lambda b, r: 0.02 * b * (1 + 0.45 * (r - 1))), (1, 2, 3), "ragged")
    costly.chain, costly.overhead = chooser.chain, {}
    assert 0 < costly.choose(4) < 12  # rows cost: a budget between nothing and everything


def _export(drafter, target, out) -> str:
    contract = build_contract("dspark", target_fingerprint=target.target_fingerprint,
                              template_fingerprint=target.template_fingerprint, num_target_layers=target.num_layers,
                              hidden_size=target.hidden_size, layer_ids=drafter.config.target_layer_ids,
                              dtype="float32")
    return str(save_drafter(out, drafter, contract=json.loads(contract.to_json()), provenance={"run": "test"}))


def test_the_engine_schedules_dspark_by_default_and_greedy_equals_generate(debug_target, tmp_path, one_thread):
    """speculation="auto" (the default) gives DSpark's chooser draft budgets; half the batch's drafts
    per round makes every round ragged, and greedy output is still transformers' ``generate``."""
    prompts = ["Hi", "1 2 3 4 5 6", "Write a poem."]
    table = _table(lambda b, r: 0.001 * b * (1 + 0.1 * (r - 1)))
    engine = Engine(debug_target, _export(_drafter(debug_target), debug_target, tmp_path / "export"), max_batch=3,
                    max_len=256, cost_table=table)
    chooser, k = engine.versions.active.chooser, engine.worker.verify_sizes[-1]
    assert chooser.layout == "ragged" and chooser.candidates(3)[-1] == 3 * k
    assert chooser.survival == engine.worker.published_survival  # budgets from the worker's published survival
    rounds = []
    step = engine.worker.step
    engine.worker.step = lambda *a: rounds.append(step(*a)) or rounds[-1]
    outputs = engine.generate(prompts, SamplingParams(max_tokens=16))  # the chooser's own budgets
    assert any(r.speculative for r in rounds)
    chooser.choose = lambda batch: max(1, batch * k // 2)
    outputs += engine.generate(prompts, SamplingParams(max_tokens=16))
    for out in outputs:
        ids = list(out.prompt_ids)
        with torch.inference_mode():
            want = debug_target.model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids)).long(),
                                               max_new_tokens=16, do_sample=False,
                                               pad_token_id=debug_target.pad_token_id)
        tokens = want[0, len(ids):].tolist()
        eos = debug_target.tokenizer.eos_token_id
        assert out.token_ids == (tokens[: tokens.index(eos)] if eos in tokens else tokens)
    assert any(len(set(r.num_drafts)) > 1 for r in rounds if len(r.num_drafts) > 1)  # ragged rounds ran
