"""EAGLE-3 worker on the debug target: lossless greedy chains, the drafter's cache after every round
equals a fresh prefill of the accepted text, and sampled rounds keep the target's distribution."""

import json

import pytest
import torch
from lossless_chi2 import CHI2_8_P001, accepted_of, candidate_vocab, chi_square, exact_two_tokens, sample_two_tokens

from specray.capture.contract import build_contract
from specray.drafters.eagle3 import Eagle3Drafter, debug_config
from specray.drafters.format import save_drafter
from specray.serving.engine import Engine
from specray.serving.runner import LlamaRunner
from specray.serving.sampling import SamplingParams, sample_next
from specray.serving.workers.deferred import DeferredRows
from specray.serving.workers.eagle3 import DEFAULT_NUM_DRAFTS, Eagle3Worker
from specray.serving.workers.eagle3_tree import Eagle3TreeWorker

PROMPTS = ["Hi", "Tell me about dragons and castles.", "1 2 3 4 5 6"]


def _drafter(target, draft_vocab=None, seed=0):
    torch.manual_seed(seed)
    cfg = debug_config(target, draft_vocab_size=None if draft_vocab is None else len(draft_vocab))
    model = Eagle3Drafter(cfg, embed_tokens=target.model.model.embed_tokens, lm_head=target.model.lm_head)
    with torch.no_grad():  # a larger scale than the init's: drafts that differ from one another
        for p in model.parameters():
            p.mul_(4.0) if p.dim() == 2 else None
    if draft_vocab is not None:
        model.set_draft_vocab(draft_vocab)
    return model.eval().requires_grad_(False)


def _worker(target, drafter, k=3, slots=3):
    runner = LlamaRunner(target.model, num_slots=slots, max_len=512, capture_layer_ids=drafter.config.target_layer_ids)
    return Eagle3Worker(runner, drafter, num_speculative_tokens=k)


def _encode(target, text):
    return target.tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                                tokenize=True, return_dict=True)["input_ids"]


def _generate(worker, prompts, max_new, params=None, seed=0, release=True, size=None):
    """Drive the worker as the engine does: prefill, sample the first anchor, step (``size``
    drafts, default the worker's largest verify size) until max_new tokens, release. Returns the
    tokens per request and the StepOutput of every round."""
    size = worker.verify_sizes[-1] if size is None else size
    B = len(prompts)
    params = params or SamplingParams()
    generators = [torch.Generator().manual_seed(seed + b) for b in range(B)]
    logits = worker.prefill(list(range(B)), prompts)
    out = [[sample_next(logits[b], params, generators[b])] for b in range(B)]
    rounds = []
    while min(len(o) for o in out) < max_new:
        step = worker.step(list(range(B)), [o[-1] for o in out], [params] * B, generators, size)
        for o, tokens in zip(out, step.tokens):
            o += tokens
        rounds.append(step)
    for slot in range(B) if release else ():  # the engine frees finished requests' slots and drafter state
        worker.runner.cache.release(slot)
        worker.release(slot)
    return [o[:max_new] for o in out], rounds


def _hf_greedy(target, ids, max_new):
    with torch.inference_mode():
        out = target.model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                                    max_new_tokens=max_new, do_sample=False, pad_token_id=target.pad_token_id)
    return out[0, len(ids):].tolist()


def _to_eos(target, tokens):
    """The tokens up to and including the first EOS (where transformers' generate stops)."""
    eos = target.tokenizer.eos_token_id
    return tokens[: tokens.index(eos) + 1] if eos in tokens else tokens


@pytest.fixture(scope="module")
def eagle3_export(debug_target, tmp_path_factory):
    """An untrained EAGLE-3 drafter for the debug target, exported like a trained one."""
    contract = build_contract("eagle3", target_fingerprint=debug_target.target_fingerprint,
                              template_fingerprint=debug_target.template_fingerprint,
                              num_target_layers=debug_target.num_layers, hidden_size=debug_target.hidden_size)
    return save_drafter(tmp_path_factory.mktemp("eagle3") / "export", _drafter(debug_target),
                        contract=json.loads(contract.to_json()), provenance={"run": "random"})


@pytest.mark.parametrize("k, tree", [(None, False), (1, False), (None, True)])
def test_engine_greedy_equals_transformers_generate(debug_target, eagle3_export, k, tree):
    """Chains and trees, round sizes chosen by the engine."""
    engine = Engine(debug_target, str(eagle3_export), max_batch=3, max_len=512, num_speculative_tokens=k, tree=tree)
    assert isinstance(engine.worker, Eagle3TreeWorker if tree else Eagle3Worker)
    assert engine.worker.max_verify_rows == (17 if tree else (k or DEFAULT_NUM_DRAFTS) + 1)
    outputs = engine.generate(PROMPTS, SamplingParams(max_tokens=24))
    for out in outputs:
        expected = _to_eos(debug_target, _hf_greedy(debug_target, out.prompt_ids, 24))
        assert out.token_ids == [t for t in expected if t != debug_target.tokenizer.eos_token_id]  # the engine stops at EOS
        assert out.rounds >= 1


@pytest.mark.parametrize("tree", [False, True])
def test_engine_seeded_sampling_repeats_under_static_rounds(debug_target, eagle3_export, tree):
    """A seed gives the same tokens again when every round has the same size (``SamplingParams.seed``)."""
    engine = Engine(debug_target, str(eagle3_export), max_batch=3, max_len=512, speculation="static", tree=tree)
    seeded = SamplingParams(max_tokens=12, temperature=0.8, seed=3)
    assert [o.token_ids for o in engine.generate(PROMPTS, seeded)] == \
        [o.token_ids for o in engine.generate(PROMPTS, seeded)]


class _Oracle:
    """Replaces ``propose``: the target's own greedy continuation with position ``round % (k+1)``
    corrupted, so rounds accept every r in 0..k while the drafter's chain still runs."""

    def __init__(self, worker, target, history, anchors):
        self.worker, self.target, self.history, self.anchors, self.round = worker, target, history, anchors, 0
        self.propose = worker.propose
        worker.propose = self

    def __call__(self, slots, params, generators, k):
        drafts, qs = self.propose(slots, params, generators, k)  # the chain runs (and writes its scratch rows)
        drafts, k = drafts.clone(), drafts.shape[1]
        for b, slot in enumerate(slots):
            cont = (_hf_greedy(self.target, self.history[slot] + [self.anchors[b]], k) + [0] * k)[:k]
            if self.round % (k + 1) < k:
                cont[self.round % (k + 1)] = (cont[self.round % (k + 1)] + 1) % self.target.vocab_size
            drafts[b] = torch.tensor(cont)
        self.round += 1
        return drafts, qs


def _assert_drafter_state_equals_a_fresh_prefill(target, drafter, worker, slot, text):
    """``text`` = prompt + emitted tokens; its last token is the current anchor."""
    fresh = _worker(target, drafter, slots=1)
    fresh.prefill([0], [text[:-1]])
    fresh._take_anchors([0], [text[-1]])
    fresh.catch_up([0])
    worker.catch_up([slot])  # rows owed by plain steps: what the next round runs first
    n = int(fresh.cache.committed[0])
    assert n == len(text) - 1 == int(worker.cache.committed[slot]) == int(worker.runner.cache.committed[slot])
    for layer in range(drafter.config.num_layers):
        torch.testing.assert_close(worker.cache.k[layer, slot, :, :n], fresh.cache.k[layer, 0, :, :n], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(worker.cache.v[layer, slot, :, :n], fresh.cache.v[layer, 0, :, :n], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(worker.state[slot], fresh.state[0], rtol=1e-5, atol=1e-5)


def test_drafter_cache_after_every_round_equals_a_fresh_prefill_of_the_accepted_text(debug_target):
    drafter = _drafter(debug_target)
    worker = _worker(debug_target, drafter, k=3, slots=2)
    prompts = [_encode(debug_target, p) for p in PROMPTS[:2]]
    history = {0: list(prompts[0]), 1: list(prompts[1])}
    logits = worker.prefill([0, 1], prompts)
    anchors = [int(logits[0].argmax()), int(logits[1].argmax())]
    oracle = _Oracle(worker, debug_target, history, anchors)
    accepted = set()
    for _ in range(6):
        step = worker.step([0, 1], anchors, [SamplingParams()] * 2, [None, None], 3)
        for b in (0, 1):
            history[b] += [anchors[b]] + step.tokens[b][:-1]
            anchors[b] = step.tokens[b][-1]
            accepted.add(step.accepted[b])
            _assert_drafter_state_equals_a_fresh_prefill(debug_target, drafter, worker, b, history[b] + [anchors[b]])
    assert accepted == {0, 1, 2, 3} and oracle.round == 6  # every rejection point, and a full acceptance


def test_plain_steps_keep_the_drafter_state_and_stay_lossless(debug_target):
    """Plain steps owe drafter rows; a slot owing ``capacity`` catches up before the next push,
    and after the last catch-up the drafter's state is a fresh prefill's."""
    drafter = _drafter(debug_target)
    worker = _worker(debug_target, drafter, k=2, slots=2)
    worker.deferred = DeferredRows(num_slots=2, width=drafter.fc.weight.shape[1], dtype=torch.float32, capacity=4)
    prompts = [_encode(debug_target, p) for p in PROMPTS[:2]]
    tokens, rounds = _generate(worker, prompts, 6, release=False, size=0)
    assert not any(step.speculative for step in rounds) and worker.stats()["steps"] == 0
    assert [worker.deferred.owes(s) for s in (0, 1)] == [2, 2]  # the first anchor's row + 5 plain rows: 4 caught up
    for prompt, got in zip(prompts, tokens):
        assert _to_eos(debug_target, got) == _hf_greedy(debug_target, prompt, 6)
        _assert_drafter_state_equals_a_fresh_prefill(debug_target, drafter, worker, prompts.index(prompt), prompt + got)


def test_a_prefill_owes_the_prompt_rows_and_runs_no_draft_layer(debug_target, monkeypatch):
    """The drafter's rows 0 … n−2 of a prompt wait in ``deferred`` (no draft layer runs at the
    prefill); the round's catch-up runs them first, and the state is then a fresh prefill's."""
    drafter = _drafter(debug_target)
    worker = _worker(debug_target, drafter, k=2, slots=2)
    prompts = [_encode(debug_target, p) for p in PROMPTS[:2]]
    calls = []
    forward = drafter.forward_cached
    monkeypatch.setattr(drafter, "forward_cached", lambda state, *a: calls.append(state.shape[1]) or forward(state, *a))
    logits = worker.prefill([0, 1], prompts)
    assert calls == [] and worker.cache.committed[:2].tolist() == [0, 0]
    assert {slot: len(values) for slot, (values, _) in worker.deferred.prompts.items()} == {0: len(prompts[0]) - 1,
                                                                                          1: len(prompts[1]) - 1}
    anchors = logits.argmax(-1).tolist()
    out = worker.step([0, 1], anchors, [SamplingParams()] * 2, [None, None], 1)
    assert calls[:2] == [max(len(p) for p in prompts) - 1, 1]  # the prompts' rows, then the anchors' pushed rows
    assert worker.deferred.prompts == {}
    for b, prompt in enumerate(prompts):
        text = prompt + [anchors[b]] + out.tokens[b]
        _assert_drafter_state_equals_a_fresh_prefill(debug_target, drafter, worker, b, text)


def test_sampled_drafts_come_from_the_q_handed_to_verification(debug_target):
    vocab = torch.arange(0, debug_target.vocab_size, 3)
    worker = _worker(debug_target, _drafter(debug_target, vocab), k=3, slots=2)
    prompts = [_encode(debug_target, p) for p in PROMPTS[:2]]
    worker.prefill([0, 1], prompts)
    worker._take_anchors([0, 1], [5, 7])
    worker.catch_up([0, 1])
    params = [SamplingParams(temperature=1.0), SamplingParams()]
    drafts, qs = worker.propose([0, 1], params, [torch.Generator().manual_seed(0), None], 3)
    assert drafts.shape == (2, 3) and torch.isin(drafts, vocab).all()
    q = qs[0]  # [k, V]: zero outside the draft vocabulary, the drafts drawn from it
    outside = torch.ones(debug_target.vocab_size, dtype=torch.bool)
    outside[vocab] = False
    assert q.shape == (3, debug_target.vocab_size) and torch.allclose(q.sum(-1), torch.ones(3))
    assert (q[:, outside] == 0).all() and (q[torch.arange(3), drafts[0]] > 0).all()
    assert qs[1] is None  # greedy: argmax, no q


def _two_sampled_tokens(target, make_worker, size):
    """The chi-square harness (``lossless_chi2``) on a worker over a drafter whose draft vocabulary
    is the target's candidates (drafts at the 1st and 2nd position are sometimes accepted). Returns
    (chi2; the rounds' accepted counts). A q that claims less than the drafts were drawn from
    (accepting too often) gives chi2 > 100 here."""
    prompt = _encode(target, "Hi")
    exact = exact_two_tokens(target, prompt)
    worker = make_worker(_drafter(target, candidate_vocab(exact), seed=2))
    counts, steps = sample_two_tokens(worker, prompt, size)
    return chi_square(counts, exact), accepted_of(steps)


def test_sampled_rounds_keep_the_targets_distribution(debug_target, one_thread):
    chi2, accepted = _two_sampled_tokens(debug_target, lambda drafter: _worker(debug_target, drafter, k=2, slots=8), 2)
    assert chi2 < CHI2_8_P001, chi2
    assert sum(r >= 1 for r in accepted) > 0.05 * len(accepted) and max(accepted) == 2  # both chain depths ran


# -- EAGLE-2 dynamic trees (serving/workers/eagle3_tree.py) --------------------------------------------


def _tree_worker(target, drafter, slots=3, **options):
    runner = LlamaRunner(target.model, num_slots=slots, max_len=512, capture_layer_ids=drafter.config.target_layer_ids)
    return Eagle3TreeWorker(runner, drafter, **options)


def test_tree_worker_sizes_and_options(debug_target):
    worker = _tree_worker(debug_target, _drafter(debug_target))
    assert worker.verify_layout == "tree" and worker.verify_sizes == (1, 2, 3, 4, 6, 8, 12, 16)
    assert worker.max_verify_rows == 17
    worker = _tree_worker(debug_target, _drafter(debug_target), depth=2, top_k=2, num_speculative_tokens=64)
    assert worker.verify_sizes == (1, 2, 3, 4, 6)  # a full tree of depth 2, width 2: 2 + 4 nodes
    with pytest.raises(ValueError, match="top_k"):
        _tree_worker(debug_target, _drafter(debug_target, torch.arange(3)), top_k=4)


@pytest.mark.parametrize("size", [2, 8])
def test_tree_greedy_equals_transformers_generate(debug_target, size):
    worker = _tree_worker(debug_target, _drafter(debug_target), depth=4, top_k=3, num_speculative_tokens=8)
    prompts = [_encode(debug_target, p) for p in PROMPTS]
    tokens, rounds = _generate(worker, prompts, 16, size=size)
    for prompt, got in zip(prompts, tokens):
        assert _to_eos(debug_target, got) == _hf_greedy(debug_target, prompt, 16)
    assert all(step.speculative and 1 <= min(step.num_drafts) <= max(step.num_drafts) <= min(size, 4) for step in rounds)


class _TreeOracle:
    """Replaces ``draft_tree``: the drafter's tree still grows (writing its scratch rows), but the
    nodes handed on are a caterpillar of depth d = size / 2: the target's greedy continuation as
    a path, each path node with a sibling leaf. Round i corrupts depth ``i % (d + 1)`` (none at
    d) and, every other cycle, puts the right token on that depth's sibling, so rounds accept
    every r in 0..d, through path rows and through a sibling (a non-contiguous path).
    ``greedy[b]``: request b's greedy continuation of this round (d + 1 tokens)."""

    def __init__(self, worker, target, history, anchors):
        self.worker, self.target, self.history, self.anchors, self.round = worker, target, history, anchors, 0
        self.draft_tree = worker.draft_tree
        self.greedy = {}
        worker.draft_tree = self

    def __call__(self, slots, params, size):
        self.draft_tree(slots, params, size)
        d, V = size // 2, self.target.vocab_size
        bad, via_sibling = self.round % (d + 1), (self.round // (d + 1)) % 2 == 1
        tokens, parents = [], []
        for b, slot in enumerate(slots):
            self.greedy[b] = _hf_greedy(self.target, self.history[slot] + [self.anchors[b]], d + 1)
            row_tokens, row_parents = [], []
            for j, right in enumerate((self.greedy[b] + [0] * d)[:d]):  # depth j + 1: path node 2j (parent 2j − 2), sibling 2j + 1
                path, sibling = right, (right + 2) % V
                if j == bad:
                    path = (right + 1) % V
                    sibling = right if via_sibling else sibling
                row_tokens += [path, sibling]
                row_parents += [2 * j - 2 if j else -1] * 2
            tokens.append(row_tokens)
            parents.append(row_parents)
        depth = torch.arange(d).repeat_interleave(2) + 1
        scores = -(depth + torch.tensor([0.0, 0.5]).repeat(d)).float().expand(len(slots), 2 * d)
        self.round += 1
        return torch.tensor(tokens), torch.tensor(parents), scores


def _assert_target_cache_equals_a_fresh_prefill(target, worker, slot, text):
    fresh = LlamaRunner(target.model, num_slots=1, max_len=512)
    fresh.forward(torch.tensor([text[:-1]]), torch.tensor([0]), torch.tensor([len(text) - 1]))
    n = len(text) - 1
    torch.testing.assert_close(worker.runner.cache.k[:, slot, :, :n], fresh.cache.k[:, 0, :, :n], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(worker.runner.cache.v[:, slot, :, :n], fresh.cache.v[:, 0, :, :n], rtol=1e-4, atol=1e-4)


def test_tree_caches_after_every_round_equal_a_fresh_prefill_of_the_accepted_text(debug_target):
    drafter = _drafter(debug_target)
    worker = _tree_worker(debug_target, drafter, slots=2, depth=3, top_k=2, num_speculative_tokens=4)
    prompts = [_encode(debug_target, p) for p in PROMPTS[:2]]
    history = {0: list(prompts[0]), 1: list(prompts[1])}
    logits = worker.prefill([0, 1], prompts)
    anchors = [int(logits[0].argmax()), int(logits[1].argmax())]
    oracle = _TreeOracle(worker, debug_target, history, anchors)
    accepted = set()
    for _ in range(6):
        step = worker.step([0, 1], anchors, [SamplingParams()] * 2, [None, None], 4)
        for b in (0, 1):
            assert step.tokens[b] == oracle.greedy[b][: len(step.tokens[b])]
            history[b] += [anchors[b]] + step.tokens[b][:-1]
            anchors[b] = step.tokens[b][-1]
            accepted.add(step.accepted[b])
            _assert_drafter_state_equals_a_fresh_prefill(debug_target, drafter, worker, b, history[b] + [anchors[b]])
            _assert_target_cache_equals_a_fresh_prefill(debug_target, worker, b, history[b] + [anchors[b]])
    assert accepted == {0, 1, 2} and oracle.round == 6 and step.num_drafts == [2, 2]


def test_tree_plain_steps_stay_lossless(debug_target):
    drafter = _drafter(debug_target)
    worker = _tree_worker(debug_target, drafter, slots=2)
    prompts = [_encode(debug_target, p) for p in PROMPTS[:2]]
    tokens, rounds = _generate(worker, prompts, 6, release=False, size=0)
    assert not any(step.speculative for step in rounds)
    for slot, (prompt, got) in enumerate(zip(prompts, tokens)):
        assert _to_eos(debug_target, got) == _hf_greedy(debug_target, prompt, 6)
        _assert_drafter_state_equals_a_fresh_prefill(debug_target, drafter, worker, slot, prompt + got)


def test_tree_sampled_rounds_keep_the_targets_distribution(debug_target, one_thread):
    """Trees of 4 nodes (top-2 children, depth 2): the anchor's two children, one grandchild each."""
    chi2, accepted = _two_sampled_tokens(debug_target, lambda drafter: _tree_worker(
        debug_target, drafter, slots=8, depth=2, top_k=2, num_speculative_tokens=4), 4)
    assert chi2 < CHI2_8_P001, chi2
    assert sum(r >= 1 for r in accepted) > 0.05 * len(accepted)  # rounds accepted a child of the anchor


def test_tree_node_scores_equal_the_drafters_chain_over_their_path(debug_target):
    """Every generated node's cumulative log-probability equals the one the drafter gives its
    root-to-node path run as a plain causal chain of rows: the tree rows' mask (committed rows,
    ancestors, itself) and positions (depth) are right, for two requests of different lengths."""
    worker = _tree_worker(debug_target, _drafter(debug_target), slots=2, depth=4, top_k=3, num_speculative_tokens=16)
    prompts = [_encode(debug_target, p) for p in PROMPTS[:2]]
    worker.prefill([0, 1], prompts)
    worker._take_anchors([0, 1], [5, 7])
    worker.catch_up([0, 1])
    tokens, parents, scores = worker.draft_tree([0, 1], [SamplingParams()] * 2, 16)
    assert tokens.shape == (2, 3 + 3 * 9)  # depth 1: 3 nodes; depths 2..4: 3 frontier nodes x 3 children
    for b in (0, 1):
        for node in range(tokens.shape[1]):
            path = []
            while node >= 0:
                path.insert(0, node)
                node = int(parents[b, node])
            slot, state, expected = torch.tensor([b]), worker.state[b], 0.0
            for depth, n in enumerate(path):  # the chain: row j (the path's j-th token) at scratch committed + j
                expected += float(worker.drafter.compute_logits(state).float().log_softmax(-1)[int(tokens[b, n])])
                state = worker._rows(slot, worker.cache.committed[slot] + depth, state[None, None], tokens[b, n][None, None])[0, 0]
            assert abs(float(scores[b, path[-1]]) - expected) < 1e-4, (b, path)
