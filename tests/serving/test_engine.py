"""Engine behaviour on the debug target: lossless greedy decoding with a (random) DFlash drafter,
batching, stops, round statistics, and bad input."""

import pytest
import torch

from specray.serving.engine import Engine
from specray.serving.requests import encode_prompt
from specray.serving.sampling import SamplingParams
from specray.serving.workers import StepOutput, Worker
from specray.serving.workers.deferred import DeferredRows

PROMPTS = ["Hi", "Tell me about dragons and castles.", "1 2 3 4 5 6", "A much longer prompt " * 6]


@pytest.fixture(scope="module")
def random_drafter(export_drafter):
    return export_drafter()


@pytest.fixture(scope="module")
def vocab_drafter(debug_target, export_drafter):
    """The same, drafting over every third token id only (a draft vocabulary of 87 of 259)."""
    return export_drafter(draft_vocab=torch.arange(0, debug_target.vocab_size, 3))


def _hf_greedy(target, ids, max_new):
    with torch.inference_mode():
        out = target.model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                                    max_new_tokens=max_new, do_sample=False, pad_token_id=target.pad_token_id)
    tokens = out[0, len(ids):].tolist()
    eos = target.tokenizer.eos_token_id
    return tokens[: tokens.index(eos)] if eos in tokens else tokens


@pytest.mark.parametrize("use_drafter", [False, True])
def test_greedy_equals_transformers_generate(debug_target, random_drafter, use_drafter):
    engine = Engine(debug_target, str(random_drafter) if use_drafter else None, max_batch=3, max_len=512)
    params = SamplingParams(max_tokens=40)
    outputs = engine.generate(PROMPTS, params)
    for out in outputs:
        assert out.token_ids == _hf_greedy(debug_target, out.prompt_ids, 40)
    if use_drafter:
        assert all(out.rounds >= 1 for out in outputs)


def test_batch_equals_each_request_alone(debug_target, random_drafter):
    engine = Engine(debug_target, str(random_drafter), max_batch=4, max_len=512)
    params = [SamplingParams(max_tokens=n) for n in (5, 17, 30, 9)]
    together = engine.generate(PROMPTS, params)
    alone = [engine.generate([p], [sp])[0] for p, sp in zip(PROMPTS, params)]
    assert [o.token_ids for o in together] == [o.token_ids for o in alone]
    assert [len(o.token_ids) for o in together] == [5, 17, 30, 9]


def test_sampling_is_seeded(debug_target, random_drafter):
    """A seed reproduces a request under a fixed round schedule (static speculation; the automatic
    one sizes rounds from measured times, so there only the distribution is reproduced)."""
    engine = Engine(debug_target, str(random_drafter), max_batch=2, max_len=512, speculation="static")
    p = SamplingParams(max_tokens=20, temperature=0.8, top_p=0.9, seed=7)
    a = engine.generate(PROMPTS[:2], p)
    b = engine.generate(PROMPTS[:2], p)
    assert [o.token_ids for o in a] == [o.token_ids for o in b]
    c = engine.generate(PROMPTS[:2], SamplingParams(max_tokens=20, temperature=0.8, top_p=0.9, seed=8))
    assert [o.token_ids for o in a] != [o.token_ids for o in c]


def test_stops_cut_inside_an_accepted_block(debug_target, random_drafter):
    engine = Engine(debug_target, str(random_drafter), max_batch=1, max_len=512)
    full = engine.generate([PROMPTS[1]], SamplingParams(max_tokens=30))[0].token_ids
    stop_at = full[6]
    cut = engine.generate([PROMPTS[1]], SamplingParams(max_tokens=30, stop_token_ids=(stop_at,)))[0]
    assert cut.token_ids == full[: full.index(stop_at)] and cut.finish_reason == "stop"
    exact = engine.generate([PROMPTS[1]], SamplingParams(max_tokens=7))[0]
    assert exact.token_ids == full[:7] and exact.finish_reason == "length"
    text = debug_target.tokenizer.decode(full)
    needle = text[10:13]
    stopped = engine.generate([PROMPTS[1]], SamplingParams(max_tokens=30, stop=(needle,)))[0]
    assert stopped.text == text[: text.index(needle)] and stopped.finish_reason == "stop"


def test_bad_requests_are_refused_and_the_engine_keeps_serving(debug_target, random_drafter):
    engine = Engine(debug_target, str(random_drafter), max_batch=2, max_len=128)
    for kwargs, message in [
        ({"temperature": -1}, "temperature must be >= 0"),
        ({"top_p": 0}, r"top_p must be in \(0, 1\]"),
        ({"top_p": 1.5}, r"top_p must be in \(0, 1\]"),
        ({"max_tokens": 0}, "max_tokens must be >= 1"),
    ]:
        with pytest.raises(ValueError, match=message):
            SamplingParams(**kwargs)
    with pytest.raises(ValueError, match="the prompt is empty"):
        engine.generate([[]], SamplingParams(max_tokens=4))
    with pytest.raises(ValueError, match="does not fit the engine's context of 128"):
        engine.generate(["x" * 200], SamplingParams(max_tokens=4))
    assert engine.generate(["Hi"], SamplingParams(max_tokens=4))[0].token_ids


def test_drafter_of_another_target_is_refused(random_drafter):
    from specray.capture.target import load_target
    from specray.drafters.format import InvalidDrafterError

    with pytest.raises(InvalidDrafterError, match="trained for another target"):
        Engine(load_target("debug:1"), str(random_drafter))


class OracleWorker:
    """Wraps DFlashWorker; proposes the target's own greedy continuation, with one corrupted
    position per round (cycling) when ``corrupt``, so rounds accept 0..m drafts and every path
    is exercised (else every draft is accepted)."""

    def __init__(self, worker, target, corrupt: bool = True):
        self.worker, self.target, self.corrupt = worker, target, corrupt
        self.committed: dict[int, list[int]] = {}
        self.round = 0
        worker.propose = self.propose

    def __getattr__(self, name):  # max_verify_rows, release, stats: the wrapped worker's
        return getattr(self.worker, name)

    def prefill(self, slots, prompts):
        for slot, p in zip(slots, prompts):
            self.committed[slot] = list(p)
        return self.worker.prefill(slots, prompts)

    def propose(self, slots, anchors, params, generators, m):
        drafts = []
        for slot, a in zip(slots, anchors):
            cont = (_hf_greedy_raw(self.target, self.committed[slot] + [a], m) + [0] * m)[:m]
            k = self.round % (m + 1)
            if self.corrupt and k < m:
                cont[k] = (cont[k] + 1) % self.target.vocab_size
            drafts.append(cont)
        self.round += 1
        return torch.tensor(drafts), [None] * len(slots)

    def step(self, slots, anchors, params, generators, size) -> StepOutput:
        out = self.worker.step(slots, anchors, params, generators, size)
        for slot, a, tokens in zip(slots, anchors, out.tokens):
            self.committed[slot] += [a] + tokens[:-1]
        return out


def _hf_greedy_raw(target, ids, max_new):
    with torch.inference_mode():
        out = target.model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                                    max_new_tokens=max_new, do_sample=False, pad_token_id=target.pad_token_id)
    return out[0, len(ids):].tolist()


def test_accepted_blocks_are_lossless_and_committed(debug_target, random_drafter):
    engine = Engine(debug_target, str(random_drafter), max_batch=2, max_len=512, speculation="static")
    engine.worker = OracleWorker(engine.worker, debug_target)
    outputs = engine.generate(PROMPTS[:2], SamplingParams(max_tokens=30))
    for out in outputs:
        assert out.token_ids == _hf_greedy(debug_target, out.prompt_ids, 30)
        assert max(out.emitted_per_round) == 4 and min(out.emitted_per_round) == 1  # all and none accepted
        assert out.tau > 1.5
    # a stop token inside a fully accepted block cuts the output exactly there
    full = outputs[1].token_ids
    engine.worker = OracleWorker(engine.worker.worker, debug_target)
    cut = engine.generate([PROMPTS[1]], SamplingParams(max_tokens=30, stop_token_ids=(full[9],)))[0]
    assert cut.token_ids == full[: full.index(full[9])]


def test_generate_cli(debug_target, random_drafter, capsys):
    from specray.pipeline.cli import main

    assert main(["generate", "--target", "debug", "--drafter", str(random_drafter), "--prompt", "Hi",
                 "--max-tokens", "8"]) == 0
    out = capsys.readouterr().out
    assert "tau=" in out and "tokens/s" in out and "8 tokens, finish=length" in out
    assert main(["generate", "--target", "debug", "--prompt", "Hi", "--temperature", "-1"]) == 2
    assert "temperature must be >= 0" in capsys.readouterr().err


def test_bench_serve_writes_json_and_plot(debug_target, random_drafter, tmp_path, capsys):
    import json

    from specray.pipeline.cli import main

    from specray.serving.cost_table import profile

    path, table = tmp_path / "serve.json", tmp_path / "cost.json"
    profile(debug_target, batch_sizes=(1, 2), rows=(1, 4), context_tokens=16, repeats=1).save(table)
    # static rounds (k = 3, the block) and a sweep system at k = 1, sized with the given cost table
    assert main(["bench", "serve", "--target", "debug", "--drafter", str(random_drafter), "--num-prompts", "2",
                 "--max-tokens", "6", "--batch-sizes", "1", "2", "--json", str(path), "--png", str(tmp_path / "a.png"),
                 "--speculation", "static", "--static-sizes", "1", "--cost-table", str(table)]) == 0
    result = json.loads(path.read_text())
    systems = {(r["system"], r["batch_size"]) for r in result["runs"]}
    assert {("specray-ar", 1), ("specray-drafter", 2), ("specray-drafter-k1", 2), ("hf-generate", 1),
            ("hf-prompt-lookup", 1)} <= systems
    assert result["algorithm"] == "dflash" and result["cost_table"] == str(table)
    rounds = {(r["system"], r["batch_size"]): r.get("rounds") for r in result["runs"]}
    assert set(rounds["specray-drafter", 1]["rounds_by_size"]) == {"3"} and rounds["specray-ar", 1] is None
    assert set(rounds["specray-drafter-k1", 2]["rounds_by_size"]) <= {"1"}  # groups of 2, then of 1 as requests end
    assert rounds["specray-drafter", 1]["predicted_tokens_per_s"] > 0 and "prediction_error" in rounds["specray-drafter", 1]
    assert set(result["speedup_vs_ar_by_batch"]["2"]) == {"specray-drafter", "specray-drafter-k1"}
    runs = {(r["system"], r["batch_size"]): r for r in result["runs"]}
    k1, ar = runs["specray-drafter-k1", 2], runs["specray-ar", 2]  # one pass each (--repeats 1): paired ratio = ratio
    assert result["speedup_vs_ar_by_pass"]["2"]["specray-drafter-k1"] == pytest.approx(
        [(k1["tokens"] / k1["pass_seconds"][0]) / (ar["tokens"] / ar["pass_seconds"][0])])
    assert k1["pass_seconds"] == [k1["seconds"]] and k1["chunk_seconds"] == [[k1["seconds"]]]  # 2 prompts: one chunk
    paired = result["speedup_vs_ar_paired"]["2"]["specray-drafter-k1"]  # one chunk pair: the pass ratio, no spread
    assert paired["pairs"] == 1 and paired["ratio"] == pytest.approx(result["speedup_vs_ar_by_pass"]["2"]["specray-drafter-k1"][0])
    assert paired["ci95"] == [pytest.approx(paired["ratio"])] * 2
    for key in ("tau", "speedup_vs_ar", "speedup_vs_hf_generate", "bound_ratio", "greedy_match"):
        assert result[key] is not None
    assert result["speedup_vs_vllm_ar"] is None and result["greedy_match"] == 1.0
    assert len(result["accept_rate_by_pos"]) == 3 and (tmp_path / "a.png").exists()
    phases = result["round_ms"]  # where a round's time goes, at batch 1
    assert set(phases) == {"draft", "verify", "accept", "commit", "other", "wall"}
    assert all(phases[k] > 0 for k in ("draft", "verify", "accept", "commit", "wall"))
    assert sum(phases[k] for k in ("draft", "verify", "accept", "commit")) <= phases["wall"]
    out = capsys.readouterr().out
    assert "tau" in out and "ms per speculative round: draft" in out


def test_num_speculative_tokens_caps_the_drafts_verified_per_round(debug_target, random_drafter):
    engine = Engine(debug_target, str(random_drafter), max_batch=2, max_len=512, num_speculative_tokens=2,
                    speculation="static")
    assert engine.worker.verify_sizes == (1, 2) and engine.worker.max_verify_rows == 3
    engine.worker = OracleWorker(engine.worker, debug_target)
    outputs = engine.generate(PROMPTS[:2], SamplingParams(max_tokens=30))
    for out in outputs:
        assert out.token_ids == _hf_greedy(debug_target, out.prompt_ids, 30)
        assert max(out.emitted_per_round) == 3 and min(out.emitted_per_round) == 1  # at most k + 1 per round
    assert len(engine.stats()["acceptance_by_position"]) == 2
    assert Engine(debug_target, str(random_drafter), num_speculative_tokens=50).worker.verify_sizes[-1] == 3  # <= m
    with pytest.raises(ValueError, match="num_speculative_tokens must be >= 1"):
        Engine(debug_target, str(random_drafter), num_speculative_tokens=0)


def test_draft_vocabulary_drafter_is_lossless_and_proposes_only_its_tokens(debug_target, vocab_drafter):
    engine = Engine(debug_target, str(vocab_drafter), max_batch=3, max_len=512)
    vocab = engine.drafter.draft_vocab
    for out in engine.generate(PROMPTS[:3], SamplingParams(max_tokens=30)):
        assert out.token_ids == _hf_greedy(debug_target, out.prompt_ids, 30)
    worker = engine.worker  # propose directly: the q handed to verification is over the target's vocabulary
    prompts = [engine.encode(p) for p in PROMPTS[:2]]
    worker.prefill([0, 1], prompts)
    worker.catch_up([0, 1])
    params = [SamplingParams(temperature=1.0), SamplingParams()]
    generators = [torch.Generator().manual_seed(0), torch.Generator().manual_seed(1)]
    drafts, qs = worker.propose([0, 1], [5, 7], params, generators, 3)
    assert drafts.shape == (2, 3) and torch.isin(drafts, vocab).all()
    q = qs[0]  # sampled request: [m, V], zero outside the draft vocabulary, the drafts drawn from it
    assert q.shape == (3, debug_target.vocab_size) and torch.allclose(q.sum(-1), torch.ones(3))
    outside = torch.ones(debug_target.vocab_size, dtype=torch.bool)
    outside[vocab] = False
    assert (q[:, outside] == 0).all() and (q[torch.arange(3), drafts[0]] > 0).all()
    assert qs[1] is None  # greedy request: argmax, no q


def test_max_speculative_batch_takes_plain_steps_above_it_and_stays_lossless(debug_target, random_drafter):
    """Three requests of different lengths with max_speculative_batch=1: plain steps while two or
    three run, speculative rounds once one is left; greedy output still equals transformers."""
    engine = Engine(debug_target, str(random_drafter), max_batch=3, max_len=512, max_speculative_batch=1,
                    speculation="static")
    params = [SamplingParams(max_tokens=n) for n in (6, 14, 40)]
    outputs = engine.generate(PROMPTS[:3], params)
    for out, p in zip(outputs, params):
        assert out.token_ids == _hf_greedy(debug_target, out.prompt_ids, p.max_tokens)
    stats = engine.stats()["versions"][0]
    assert stats["plain_steps"] > 0 and stats["rounds"] > 0  # both kinds ran
    assert stats["rounds"] + stats["plain_steps"] == sum(out.rounds for out in outputs)
    never = Engine(debug_target, str(random_drafter), max_batch=1, max_len=512, max_speculative_batch=0)
    out = never.generate([PROMPTS[1]], SamplingParams(max_tokens=12))[0]
    assert out.token_ids == _hf_greedy(debug_target, out.prompt_ids, 12)
    assert out.emitted_per_round == [1] * 11 and never.stats()["tau"] is None  # no speculative round
    with pytest.raises(ValueError, match="max_speculative_batch must be >= 0"):
        Engine(debug_target, str(random_drafter), max_speculative_batch=-1)


def test_plain_steps_owe_the_drafter_context_and_catch_up_to_a_prefills(debug_target, random_drafter):
    """A prefill and plain steps leave the drafter's context rows owed (no drafter work); after
    ``catch_up`` (what the next round runs first) the context equals the one a prefill of the
    same prefix and a catch-up build, and the one built eagerly from the target's features."""
    engine = Engine(debug_target, str(random_drafter), max_batch=1, max_len=512, max_speculative_batch=0)
    worker = engine.worker
    prompt = engine.encode(PROMPTS[1])
    calls = []
    project = worker.drafter.project_context
    worker.drafter.project_context = lambda feats: calls.append(feats.shape) or project(feats)
    first = int(worker.prefill([0], [prompt])[0].argmax())
    tokens = [first]
    for _ in range(5):
        out = worker.step([0], [tokens[-1]], [SamplingParams()], [None], 0)
        assert not out.speculative and out.num_drafts == [0] and len(out.tokens[0]) == 1
        tokens += out.tokens[0]
    n = len(prompt) + 5  # the last token is the anchor: no KV yet
    assert int(worker.context.committed[0]) == 0 and int(engine.runner.cache.committed[0]) == n and calls == []
    assert worker.catch_up([0]) > 0 and int(worker.context.committed[0]) == n
    assert [shape[1] for shape in calls] == [len(prompt), 5]  # the prompt's rows, then the plain steps'
    fresh = Engine(debug_target, str(random_drafter), max_batch=1, max_len=512).worker
    fresh.prefill([0], [prompt + tokens[:5]])
    fresh.catch_up([0])
    text = torch.tensor([prompt + tokens[:5]])
    with torch.no_grad():  # eagerly: the target's captured layers over the text, projected at once
        hidden = debug_target.model(text, output_hidden_states=True).hidden_states
        feats = torch.cat([hidden[i + 1] for i in worker.cfg.target_layer_ids], dim=-1)
        eager = worker.drafter.context_kv(project(feats), torch.arange(n)[None])
    for layer in range(len(worker.context.k)):
        torch.testing.assert_close(worker.context.k[layer, 0, :, :n], fresh.context.k[layer, 0, :, :n], rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(worker.context.v[layer, 0, :, :n], fresh.context.v[layer, 0, :, :n], rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(worker.context.k[layer, 0, :, :n], eager[layer][0][0], rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(worker.context.v[layer, 0, :, :n], eager[layer][1][0], rtol=1e-4, atol=1e-4)


def test_dflash_plain_steps_past_the_capacity_catch_up_and_end_on_a_prefills_context(debug_target, random_drafter):
    engine = Engine(debug_target, str(random_drafter), max_batch=1, max_len=512, max_speculative_batch=0)
    worker = engine.worker
    worker.deferred = DeferredRows(num_slots=1, width=worker.deferred.width, dtype=torch.float32, capacity=3)
    prompt = engine.encode(PROMPTS[1])
    tokens = [int(worker.prefill([0], [prompt])[0].argmax())]
    for _ in range(7):
        tokens += worker.step([0], [tokens[-1]], [SamplingParams()], [None], 0).tokens[0]
    assert int(worker.context.committed[0]) == len(prompt) + 6 and worker.deferred.owes(0) == 1
    worker.step([0], [tokens[-1]], [SamplingParams()], [None], worker.verify_sizes[0])  # a round catches up first
    n = int(engine.runner.cache.committed[0])
    assert int(worker.context.committed[0]) == n and worker.deferred.owes(0) == 0
    fresh = Engine(debug_target, str(random_drafter), max_batch=1, max_len=512).worker
    fresh.prefill([0], [prompt + tokens[:n - len(prompt)]])
    fresh.catch_up([0])
    for layer in range(len(worker.context.k)):
        torch.testing.assert_close(worker.context.k[layer, 0, :, :n], fresh.context.k[layer, 0, :, :n], rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(worker.context.v[layer, 0, :, :n], fresh.context.v[layer, 0, :, :n], rtol=1e-4, atol=1e-5)


class ProtocolOnly:
    """Exposes nothing of a worker but the protocol (serving/workers/base.py)."""

    def __init__(self, worker):
        self._worker = worker
        self.max_verify_rows, self.verify_sizes, self.verify_layout = (worker.max_verify_rows, worker.verify_sizes,
                                                                       worker.verify_layout)
        self.prefill, self.step, self.release, self.stats = worker.prefill, worker.step, worker.release, worker.stats


@pytest.mark.parametrize("use_drafter", [False, True], ids=["ar", "dflash"])
def test_the_engine_reads_only_the_worker_protocol(debug_target, random_drafter, use_drafter):
    engine = Engine(debug_target, str(random_drafter) if use_drafter else None, max_batch=2, max_len=256)
    assert isinstance(engine.worker, Worker)
    expected = engine.generate(PROMPTS[:3], SamplingParams(max_tokens=10))
    engine.worker = ProtocolOnly(engine.worker)
    assert isinstance(engine.worker, Worker)
    got = engine.generate(PROMPTS[:3], SamplingParams(max_tokens=10))
    assert [o.token_ids for o in got] == [o.token_ids for o in expected]
    assert engine.stats()["worker"]["steps"] > 0


def test_round_stats_count_only_tokens_before_a_stop(debug_target, random_drafter):
    """Every round accepts all 3 drafts (4 tokens); a stop inside a round counts that round as if it
    had ended there: tau and acceptance by position never count cut tokens."""
    full = _hf_greedy_raw(debug_target, encode_prompt(debug_target.tokenizer, PROMPTS[1]), 12)
    assert full[2] not in full[:2]

    def run(params):
        engine = Engine(debug_target, str(random_drafter), max_batch=1, max_len=512, speculation="static")
        engine.worker = OracleWorker(engine.worker, debug_target, corrupt=False)
        return engine.generate([PROMPTS[1]], params)[0], engine.stats()

    # prefill: 1 token; round 1: 4 (5 in all); round 2: 4 emitted, 1 kept by max_tokens = 6
    out, stats = run(SamplingParams(max_tokens=6, ignore_eos=True))
    assert out.token_ids == full[:6] and out.emitted_per_round == [4, 1]
    assert stats["tau"] == out.tau == 2.5 and stats["acceptance_by_position"] == [0.5, 0.5, 0.5]
    # round 1 emits full[1:5]; the stop token full[2] ends it after 2 tokens (the stop token included)
    out, stats = run(SamplingParams(max_tokens=30, stop_token_ids=(full[2],)))
    assert out.token_ids == full[:2] and out.finish_reason == "stop" and out.emitted_per_round == [2]
    assert stats["tau"] == 2.0 and stats["acceptance_by_position"] == [1.0, 0.0, 0.0]
