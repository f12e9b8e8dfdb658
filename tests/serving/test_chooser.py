"""The round-cost table and the chooser: synthetic tables, acceptance models, file errors, the CLI."""

import json

import pytest

from specray.serving.chooser import MAX_EXPLORE_GAP, BudgetAcceptance, ChainAcceptance, RoundChooser
from specray.serving.cost_table import CostEntry, CostTable, CostTableError, MachineDescription, describe_machine, profile

MACHINE = MachineDescription(cpu="test cpu", logical_cpus=2, threads=2, torch="2.13.0", device="cpu",
                             target="sha256:abc", dtype="float32")


def table(cost, batches=(1, 2, 4), rows=(1, 2, 4, 8), machine=MACHINE) -> CostTable:
    """A full grid with ``cost(batch, rows)`` seconds per forward."""
    return CostTable(machine=machine, context_tokens=256, repeats=1, created="2026-11-30T00:00:00+00:00",
                     entries=[CostEntry(batch=b, rows=r, seconds=cost(b, r)) for b in batches for r in rows])


def trained(chooser: RoundChooser, accept: float, rounds: int = 400, batch: int = 1) -> RoundChooser:
    """Feed ``rounds`` chain rounds of the largest size where each draft survives with ``accept``
    (deterministically: accepted = the expected count, rounded down per round cycle)."""
    k = chooser.sizes[-1]
    for i in range(rounds):
        accepted = 0
        while accepted < k and ((i * 7919 + accepted * 104729) % 1000) / 1000 < accept:
            accepted += 1
        chooser.record(batch, k, chooser.table.seconds(batch, k + 1), [k] * batch, [accepted] * batch, batch)
    return chooser


def test_table_interpolates_inside_and_extends_linearly_outside():
    t = table(lambda b, r: 0.01 * b + 0.001 * r)
    assert t.seconds(2, 4) == pytest.approx(0.024)
    assert t.seconds(3, 3) == pytest.approx(0.033)  # bilinear: exact for a bilinear cost
    assert t.seconds(8, 16) == pytest.approx(0.096)  # past both edges: linear
    with pytest.raises(ValueError, match="full batch × rows grid"):
        CostTable(machine=MACHINE, context_tokens=1, repeats=1, created="x",
                  entries=[CostEntry(batch=1, rows=1, seconds=1.0), CostEntry(batch=2, rows=2, seconds=1.0)])


def test_chooser_takes_a_plain_step_when_every_round_loses():
    """Verify rows cost as much as decode steps (rows × step): no speculative size can pay."""
    chooser = trained(RoundChooser(table(lambda b, r: 0.02 * r * b), (1, 2, 3, 4, 5, 6, 7)), accept=0.6)
    assert chooser.choose(1) == 0 and chooser.choose(4) == 0


def test_chooser_takes_the_largest_size_when_verify_rows_are_free():
    chooser = trained(RoundChooser(table(lambda b, r: 0.02 * b), (1, 2, 3, 4, 5, 6, 7)), accept=0.6)
    assert chooser.choose(1) == 7 and chooser.choose(4) == 7


def test_chooser_balances_acceptance_against_cost_and_respects_the_bounds():
    """Each row costs 30 % of a step: with acceptance 0.5 the best chain is short (k = 1 or 2);
    with acceptance 0.95 a long one pays. A batch above max_speculative_batch never speculates."""
    cost = table(lambda b, r: 0.02 * b * (1 + 0.3 * (r - 1)))
    low = trained(RoundChooser(cost, (1, 2, 3, 4, 5, 6, 7)), accept=0.5)
    high = trained(RoundChooser(cost, (1, 2, 3, 4, 5, 6, 7)), accept=0.95)
    assert 1 <= low.choose(1) <= 2 and high.choose(1) >= 5
    rates = {s: (lambda t, sec: t / sec)(*high.predict(1, s)) for s in (0, *high.sizes)}
    assert high.choose(1) == max(rates, key=rates.get)  # the argmax of the predicted tokens/s
    bounded = trained(RoundChooser(cost, (1, 2, 3), max_speculative_batch=2), accept=0.95)
    assert bounded.choose(2) > 0 and bounded.choose(4) == 0
    static = RoundChooser(cost, (1, 2, 3), static=True)
    assert static.choose(1) == 3


def test_overhead_is_learned_from_measured_rounds():
    """Drafting that costs 3 steps per round (measured, not in the table) makes speculation lose."""
    cost = table(lambda b, r: 0.02 * b)  # verify rows are free in the table
    chooser = trained(RoundChooser(cost, (1, 2, 3)), accept=0.6)
    assert chooser.choose(1) == 3
    for _ in range(20):
        chooser.record(1, 3, 0.02 + 0.06, [3], [1], 2)
    assert chooser.choose(1) == 0
    assert chooser.predict(2, 3)[1] > chooser.predict(1, 3)[1]  # an unseen batch borrows it, scaled


def test_plain_steps_explore_the_best_speculative_size_now_and_then():
    chooser = trained(RoundChooser(table(lambda b, r: 0.02 * r * b), (1, 2, 3), explore_every=4), accept=0.5)
    picks = [chooser.choose(1) for _ in range(8)]
    assert picks.count(0) == 6 and all(p in (0, 1, 2, 3) for p in picks)


def test_speculation_explores_a_plain_step_now_and_then_and_a_slow_first_estimate_is_corrected():
    """Two plain steps measured 10× slow (a batch size's first forwards) make speculation look
    better; the plain step explored every 4 speculative decisions measures it again, and once
    its estimate holds real steps the chooser goes back to plain steps."""
    t = table(lambda b, r: 0.02 * b * (1 + 0.3 * (r - 1)))
    chooser = trained(RoundChooser(t, (1, 2, 3), explore_every=4), accept=0.2)
    for _ in range(2):
        chooser.record(1, 0, 10 * t.seconds(1, 1), [0], [0], 1)
    picks = [chooser.choose(1) for _ in range(4)]
    assert picks[:3] != [0, 0, 0] and picks[3] == 0  # speculating, then the explored plain step
    for _ in range(40):
        chooser.record(1, 0, t.seconds(1, 1), [0], [0], 1)
    assert chooser.choose(1) == 0


def test_chain_acceptance_predicts_untried_positions_from_the_ones_before():
    model = ChainAcceptance(4)
    for _ in range(200):
        model.record(2, 1)  # position 1 always accepted, position 2 never: positions 3, 4 never tried
    alphas = model.alphas()
    assert alphas[0] > 0.95 and alphas[1] < 0.05 and alphas[2] == pytest.approx(alphas[1], abs=1e-9)
    assert model.expected(1) == pytest.approx(alphas[0]) and model.expected(4) < alphas[0] + 0.05


def test_budget_acceptance_uses_measured_means_per_budget():
    model = BudgetAcceptance(max_depth=4)
    for _ in range(10):
        model.record(8, 4, 3)
    assert model.expected(8, 4) == pytest.approx(3.0)
    assert 0 < model.expected(2, 4) < 4  # untried budget: the chain model over depths


def test_summary_reports_rounds_by_size_and_prediction_error():
    chooser = RoundChooser(table(lambda b, r: 0.01 * b), (1, 2))
    chooser.record(2, 2, 0.02, [2, 2], [2, 0], 4)
    chooser.record(2, 0, 0.01, [0, 0], [0, 0], 2)
    summary = chooser.summary()["2"]
    assert summary["rounds_by_size"] == {"0": 1, "2": 1}
    assert summary["measured_tokens_per_s"] == pytest.approx(6 / 0.03)
    assert summary["prediction_error"] == pytest.approx(summary["predicted_tokens_per_s"] / summary["measured_tokens_per_s"] - 1)


def test_table_files_name_the_file_and_refuse_another_machine(tmp_path):
    path = tmp_path / "cost.json"
    with pytest.raises(CostTableError, match=f"{path} does not exist.*specray profile"):
        CostTable.load(path)
    path.write_text("{not json")
    with pytest.raises(CostTableError, match=f"{path} is malformed"):
        CostTable.load(path)
    path.write_text(json.dumps({"machine": MACHINE.model_dump(), "entries": []}))
    with pytest.raises(CostTableError, match="malformed"):
        CostTable.load(path)
    path.unlink()
    table(lambda b, r: 0.01).save(path)
    assert CostTable.load(path).seconds(1, 1) == pytest.approx(0.01)
    table(lambda b, r: 0.02).save(path)  # the same machine: replaced
    other = table(lambda b, r: 0.03, machine=MACHINE.model_copy(update={"cpu": "another cpu"}))
    with pytest.raises(CostTableError, match="another machine description.*cpu: 'test cpu' vs 'another cpu'.*--force"):
        other.save(path)
    other.save(path, force=True)
    with pytest.raises(CostTableError, match="measured on another machine"):
        CostTable.load(path).check_machine(MACHINE, str(path))


def test_profile_measures_the_target_on_this_machine(debug_target):
    t = profile(debug_target, batch_sizes=(1, 2), rows=(1, 3), context_tokens=16, repeats=1)
    assert t.machine == describe_machine(debug_target) and t.machine.target == debug_target.target_fingerprint
    assert {(e.batch, e.rows) for e in t.entries} == {(1, 1), (1, 3), (2, 1), (2, 3)}
    assert all(e.seconds > 0 for e in t.entries)


def test_profile_cli_writes_and_refuses_to_overwrite_another_machine(tmp_path, capsys):
    from specray.pipeline.cli import main

    out = tmp_path / "cost.json"
    args = ["profile", "--target", "debug", "--out", str(out), "--batch-sizes", "1", "2", "--rows", "1", "2",
            "--context-tokens", "16", "--repeats", "1"]
    assert main(args) == 0
    assert "batch\\rows" in capsys.readouterr().out and CostTable.load(out).machine.cpu
    data = json.loads(out.read_text())
    data["machine"]["cpu"] = "another cpu"
    out.write_text(json.dumps(data))
    assert main(args) == 2
    assert "another machine description" in capsys.readouterr().err
    assert main([*args, "--force"]) == 0


def test_the_engine_sizes_rounds_automatically_and_stays_lossless(debug_target, export_drafter):
    """Default engine (speculation auto, a measured table): greedy output equals plain AR; the
    chooser's rounds show in stats() and in /metrics' Prometheus text."""
    from specray.serving.engine import Engine
    from specray.serving.openai_api import _prometheus
    from specray.serving.sampling import SamplingParams

    prompts = ["Hi", "Tell me about dragons and castles.", "1 2 3 4 5 6"]
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    expected = [o.token_ids for o in Engine(debug_target, None, max_batch=3, max_len=256).generate(prompts, params)]
    engine = Engine(debug_target, str(export_drafter()), max_batch=3, max_len=256)
    assert [o.token_ids for o in engine.generate(prompts, params)] == expected
    stats = engine.stats()
    chosen = {size: n for report in stats["chooser"].values() for size, n in report["rounds_by_size"].items()}
    assert set(chosen) <= {"0", "1", "2", "3"} and all(r["measured_tokens_per_s"] > 0 for r in stats["chooser"].values())
    assert 'specray_rounds_total{model="debug",size="' in _prometheus(stats, "debug")


def test_noisy_timings_never_make_more_rows_cheaper():
    noisy = {(1, 1): 0.03, (1, 2): 0.02, (1, 4): 0.05, (2, 1): 0.01, (2, 2): 0.04, (2, 4): 0.03}
    t = CostTable(machine=MACHINE, context_tokens=1, repeats=1, created="x",
                  entries=[CostEntry(batch=b, rows=r, seconds=v) for (b, r), v in noisy.items()])
    assert [t.seconds(1, r) for r in (1, 2, 4)] == [0.03, 0.03, 0.05]
    assert [t.seconds(2, r) for r in (1, 2, 4)] == [0.03, 0.04, 0.05]


def test_one_lucky_round_is_pooled_with_the_batch_sizes_others():
    cost = table(lambda b, r: 0.02 * b)
    chooser = RoundChooser(cost, (1, 2, 3))
    for _ in range(20):
        chooser.record(1, 3, 0.02 + 0.06, [3], [0], 1)  # drafting costs 60 ms here
    chooser.record(1, 2, 0.02, [2], [0], 1)  # one round of size 2 that drafted in no time
    overhead = chooser.predict(1, 2)[1] - cost.seconds(1, 3)
    assert 0.03 < overhead < 0.06  # pulled toward its batch size's pooled 57 ms, not 0
    assert chooser.predict(1, 1)[1] - cost.seconds(1, 2) == pytest.approx((20 * 0.06 + 0) / 21)  # unseen: the pool


def test_deferred_drafter_work_counts_in_the_round_but_not_in_its_sizes_overhead():
    """A round that first ran rows earlier plain steps owed (``StepOutput.deferred_seconds``) is
    measured whole, but the overhead learned for its size excludes them."""
    t = table(lambda b, r: 0.02 * b)
    chooser = RoundChooser(t, (1, 2))
    chooser.record(1, 2, t.seconds(1, 3) + 0.005 + 0.5, [2], [1], 2, deferred_seconds=0.5)
    assert chooser.overhead[1, 2] == (1, pytest.approx(0.005))
    assert chooser.outcomes[1, 2].seconds == pytest.approx(t.seconds(1, 3) + 0.505)


def test_a_ragged_rounds_overhead_is_measured_against_its_mean_rows_per_request():
    """A draft budget K over B requests runs 1 + K/B rows per request: the overhead learned from a
    round that took the table's time for those rows plus 5 ms is 5 ms, and so is the prediction's."""
    t = table(lambda b, r: 0.02 * b + 0.004 * b * r)
    chooser = RoundChooser(t, (1, 2, 3, 4), layout="ragged")
    chooser.record(4, 8, t.seconds(4, 3) + 0.005, [2, 2, 2, 2], [1, 0, 0, 1], 6)
    assert chooser.overhead[4, 8] == (1, pytest.approx(0.005))
    assert chooser.predict(4, 8)[1] == pytest.approx(t.seconds(4, 3) + 0.005)


def test_static_chooser_needs_no_cost_table():
    """A static chooser picks the largest size and counts rounds without predicting; an automatic one needs a table."""
    static = RoundChooser(None, (1, 2, 3), static=True)
    assert static.choose(2) == 3
    static.record(2, 3, 0.5, [3, 3], [1, 2], 5)
    report = static.report()
    assert report["rounds_by_size"] == {"3": 1} and report["measured_tokens_per_s"] == 10.0
    assert report["predicted_tokens_per_s"] is None and report["prediction_error"] is None
    with pytest.raises(ValueError, match="cost table"):
        RoundChooser(None, (1, 2, 3))


def _drive(chooser: RoundChooser, t: CostTable, decisions: int, load: float) -> list[int]:
    """``decisions`` rounds at batch 1 on a machine ``load``× slower than the table, with a drafter
    whose drafts are accepted once in 20 rounds and cost 2 ms to make; returns the sizes chosen."""
    sizes = []
    for i in range(decisions):
        size = chooser.choose(1)
        accepted = 1 if size and i % 20 == 0 else 0
        seconds = load * (t.seconds(1, 1 + size) + (0.002 if size else 0.0))
        chooser.record(1, size, seconds, [size], [accepted], 1 + accepted)
        sizes.append(size)
    return sizes


def test_a_burst_of_load_does_not_leave_the_chooser_at_a_losing_size():
    """Ten plain steps 3× slow (a burst of load elsewhere on the machine) made the plain step look
    slow while the speculative estimates were from before it: the chooser speculated at a loss
    until the burst's rounds left a 20-round median, one plain exploration in 32 decisions, about
    350 decisions. Two explorations that agree on the old cost now replace the burst's (64)."""
    t = table(lambda b, r: 0.02 * b * (1 + 0.3 * (r - 1)))  # a round of k drafts costs 1 + 0.3k steps
    chooser = trained(RoundChooser(t, (1, 2, 3), explore_every=32), accept=0.05, rounds=50)
    assert _drive(chooser, t, 200, load=1.0).count(0) >= 190  # speculation loses: plain steps
    _drive(chooser, t, 10, load=3.0)
    after = _drive(chooser, t, 400, load=1.0)
    assert sum(s > 0 for s in after) <= 2 * 32 + 400 // 32 + 4  # two explorations' worth, then exploration only
    assert after[100:].count(0) >= 290


def test_a_round_must_beat_a_noisy_plain_step_by_more_than_its_noise():
    """A drafter whose round predicts 4 % more tokens/s than the plain step: with steady plain
    steps (no spread) it speculates; with plain steps alternating 15 % above and below the same
    median (a shared machine) the median's standard error, about 6 %, is added to the margin and
    it takes plain steps — the 4 % is within what the median's noise could make up."""
    t = table(lambda b, r: 0.02 * b * (1 + 0.3 * (r - 1)))
    choosers = {}
    for spread in (0.0, 0.15):
        chooser = trained(RoundChooser(t, (1,)), accept=0.36)
        for i in range(20):
            chooser.record(1, 0, 0.02 * (1 + (spread if i % 2 else -spread)), [0], [0], 1)
        choosers[spread] = chooser
    rates = {s: (lambda tokens, seconds: tokens / seconds)(*choosers[0.0].predict(1, s)) for s in (0, 1)}
    assert 1.03 < rates[1] / rates[0] < 1.05  # the same predictions for both
    assert choosers[0.15].predict(1, 1) == choosers[0.0].predict(1, 1)
    assert choosers[0.15].noise(1, 0) == pytest.approx(1.2533 * 1.4826 * 0.003 / 20 ** 0.5)
    assert choosers[0.0].choose(1) == 1 and choosers[0.15].choose(1) == 0


def test_slow_rounds_within_a_stretch_are_not_a_shift():
    """Two slow plain steps in a row while plain steps run (a blip) join the median; only rounds
    run apart from each other (explorations) can replace a size's older estimates."""
    t = table(lambda b, r: 0.02 * b * (1 + 0.3 * (r - 1)))
    chooser = trained(RoundChooser(t, (1, 2, 3), explore_every=32), accept=0.05, rounds=50)
    _drive(chooser, t, 100, load=1.0)
    for _ in range(2):
        chooser.record(1, 0, 3 * t.seconds(1, 1), [0], [0], 1)
    assert chooser.overhead[1, 0][0] == 20 and chooser.choose(1) == 0


def test_a_stretch_is_counted_per_batch_size():
    """Plain steps whose group alternates between 3 and 4 requests (requests finishing and
    admitted) are one stretch at each batch size: two slow ones at batch 4 join its median."""
    t = table(lambda b, r: 0.02 * b * (1 + 0.3 * (r - 1)))
    chooser = RoundChooser(t, (1, 2, 3), explore_every=32)
    for i in range(40):
        b = 3 + i % 2
        chooser.record(b, 0, t.seconds(b, 1), [0] * b, [0] * b, b)
    for _ in range(2):
        chooser.record(3, 0, t.seconds(3, 1), [0] * 3, [0] * 3, 3)
        chooser.record(4, 0, 3 * t.seconds(4, 1), [0] * 4, [0] * 4, 4)
    assert chooser.overhead[4, 0][0] == 20 and chooser.overhead[4, 0][1] == pytest.approx(0.0, abs=1e-12)


def test_explorations_that_confirm_the_choice_space_out_and_a_win_brings_them_back():
    """A drafter whose rounds lose: each speculative exploration measures the loss and doubles the
    gap to the next (4, 8, 16, … up to MAX_EXPLORE_GAP × 4 decisions), so 1,000 plain decisions
    explore about 20 times, not 250. Once the drafter's rounds win (acceptance 0.9 on free rows),
    the next exploration measures a win and the chooser speculates again."""
    t = table(lambda b, r: 0.02 * b * (1 + 0.3 * (r - 1)))
    chooser = trained(RoundChooser(t, (1, 2, 3), explore_every=4), accept=0.0, rounds=50)
    sizes = []
    for _ in range(1000):
        size = chooser.choose(1)
        chooser.record(1, size, t.seconds(1, 1 + size), [size], [0], 1)
        sizes.append(size)
    explored = [i for i, s in enumerate(sizes) if s]
    gaps = [b - a for a, b in zip(explored, explored[1:])]
    assert gaps[:4] == [8, 16, 32, 64] and set(gaps[5:]) == {MAX_EXPLORE_GAP * 4}
    assert len(explored) <= 25
    better = []
    for _ in range(MAX_EXPLORE_GAP * 4 + 300):  # the drafter got better: its rounds accept every draft
        size = chooser.choose(1)
        chooser.record(1, size, t.seconds(1, 1 + size), [size], [size], 1 + size)
        better.append(size)
    first = next(i for i, s in enumerate(better) if s)
    assert first < MAX_EXPLORE_GAP * 4 and better[first + 4] > 0  # explored again 4 decisions on ...
    assert better[-10:].count(0) <= 1  # ... and the estimate followed: it speculates, with a plain exploration now and then


def test_an_exploration_that_measures_a_win_keeps_the_gap_short():
    """Explorations whose rounds measure more tokens/s than the plain step predicts (a lucky
    round of a drafter that still loses on average) leave the gap at explore_every."""
    t = table(lambda b, r: 0.02 * b * (1 + 0.3 * (r - 1)))
    chooser = trained(RoundChooser(t, (1, 2, 3), explore_every=4), accept=0.0, rounds=50)
    sizes = []
    for _ in range(40):
        size = chooser.choose(1)
        accepted = size  # every exploration accepts all its drafts; the shrunk estimate still says plain
        chooser.record(1, size, t.seconds(1, 1 + size), [size], [accepted], 1 + accepted)
        sizes.append(size)
        if size:
            chooser.chain.record(size, 0)  # keep the acceptance estimate low: plain stays the choice
            chooser.chain.record(size, 0)
    explored = [i for i, s in enumerate(sizes) if s]
    assert [b - a for a, b in zip(explored, explored[1:])] == [4] * (len(explored) - 1) and len(explored) >= 8


def test_each_decision_predicts_what_predict_gives_from_scratch():
    """A decision's predictions (kept for its ``record``; a stretch of plain steps reuses the
    speculative sizes' until a speculative round is recorded) equal ``predict``'s: twin choosers fed
    the same rounds, one deciding and one only recording, report the same predictions."""
    t = table(lambda b, r: 0.02 * b * (1 + 0.3 * (r - 1)))
    deciding, recording = RoundChooser(t, (1, 2, 3), explore_every=4), RoundChooser(t, (1, 2, 3), explore_every=4)
    sizes = []
    for i in range(400):
        batch = 1 + (i // 50) % 2
        size = deciding.choose(batch)
        accepted = [min(size, (i * 7 + b) % 4) for b in range(batch)]
        seconds = t.seconds(batch, 1 + size) * (1.5 if i % 7 == 0 else 1.0) + 0.004 * size
        for chooser in (deciding, recording):
            chooser.record(batch, size, seconds, [size] * batch, accepted, batch + sum(accepted))
        sizes.append(size)
    assert {0, 1}.issubset(sizes) or {0, 2}.issubset(sizes) or {0, 3}.issubset(sizes)  # both kinds ran
    assert deciding.outcomes.keys() == recording.outcomes.keys()
    for key, outcome in deciding.outcomes.items():
        other = recording.outcomes[key]
        assert (outcome.predicted_tokens, outcome.predicted_seconds) == pytest.approx(
            (other.predicted_tokens, other.predicted_seconds), rel=1e-12)


def test_a_slower_machine_slows_every_size_alike():
    """A drafter whose round of 1 draft loses 8 % to a plain step (26 ms for 1.2 tokens against
    20 ms for 1). The machine then runs 15 % slower for 300 decisions: the plain steps measure
    it, the round's estimate is from before. Without a shared speed factor the round looked 6 %
    better than the slowed plain step and ran in stretches; with it the slowdown is the machine's,
    both estimates carry it, and only explorations speculate."""
    t = table(lambda b, r: 0.02 * b * (1 + 0.3 * (r - 1)))
    chooser = trained(RoundChooser(t, (1,), explore_every=32), accept=0.2)
    sizes = {}
    for load, decisions in ((1.0, 200), (1.15, 300)):
        sizes[load] = []
        for i in range(decisions):
            size = chooser.choose(1)
            accepted = 1 if size and i % 5 == 0 else 0
            chooser.record(1, size, load * t.seconds(1, 1 + size), [size], [accepted], 1 + accepted)
            sizes[load].append(size)
    assert sum(sizes[1.0]) <= 200 // 32 + 1  # explorations only
    assert sum(sizes[1.15]) <= 300 // 32 + 1 and not any(a and b for a, b in zip(sizes[1.15], sizes[1.15][1:]))  # no stretch
    assert chooser.speeds[1] == pytest.approx(1.15)
    assert chooser.predict(1, 0)[1] == pytest.approx(1.15 * t.seconds(1, 1))
    assert chooser.overhead[1, 0][1] == pytest.approx(0.0, abs=1e-6)  # the plain step's estimate, at speed 1, is unchanged


def test_explorations_that_catch_up_costly_owed_work_wait_for_enough_plain_time():
    """At batch 16 a round explored from plain steps first catches up 0.5 s of drafter work
    their requests owe. Plain steps of 0.1 s: the next exploration waits for 50 s of them
    (EXPLORE_BUDGET 1 %), not for the 32 … decisions of the gap; with nothing owed the gap alone
    decides (the first two explorations 32 and 64 decisions apart)."""
    t = table(lambda b, r: 0.1 * (1 + 0.3 * (r - 1)), batches=(16,))
    explored = {}
    for owed in (0.5, 0.0):
        chooser = trained(RoundChooser(t, (1, 2, 3), explore_every=32), accept=0.0, rounds=50, batch=16)
        explored[owed] = []
        for i in range(1200):
            size = chooser.choose(16)
            chooser.record(16, size, t.seconds(16, 1 + size) + (owed if size else 0.0), [size] * 16, [0] * 16, 16,
                           deferred_seconds=owed if size else 0.0)
            if size:
                explored[owed].append(i)
    assert explored[0.0][:2] == [31, 95]
    assert explored[0.5][0] == 31 and all(b - a >= 500 for a, b in zip(explored[0.5], explored[0.5][1:]))
    assert 2 <= len(explored[0.5]) <= 3


def test_a_batch_size_not_yet_explored_expects_the_nearest_ones_owed_work_scaled():
    t = table(lambda b, r: 0.02 * b * (1 + 0.3 * (r - 1)), batches=(1, 2, 4, 8, 16))
    chooser = trained(RoundChooser(t, (1, 2, 3), explore_every=4), accept=0.0, rounds=50, batch=8)
    assert chooser._owed(16, 0) == 0.0  # nothing explored yet: the gap alone decides
    sizes = [chooser.choose(8) for _ in range(4)]
    assert sizes[:3] == [0, 0, 0] and sizes[3] > 0  # plain steps, then an exploration
    size = sizes[3]
    chooser.record(8, size, 0.3, [size] * 8, [0] * 8, 8, deferred_seconds=0.2)
    assert chooser._owed(8, 0) == 0.2 and chooser._owed(16, 0) == pytest.approx(0.4) and chooser._owed(16, 1) == 0.0
