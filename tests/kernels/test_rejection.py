"""kernels/rejection.py: hand-built greedy and sampling cases, seeded determinism, statistical
losslessness (and its failure with the wrong q), Triton kernel == reference, input checks.

Run: ``pytest -q tests/kernels/test_rejection.py`` (conftest sets TRITON_INTERPRET=1). On a
CUDA machine, ``TRITON_INTERPRET=0 pytest -q tests/kernels -k cuda`` runs the compiled kernel
against the reference (the ``cuda`` tests skip elsewhere).
"""

import os

import pytest
import torch

from specray.kernels.rejection import rejection_sample, rejection_sample_reference

PATHS = [pytest.param(False, id="reference"), pytest.param(True, id="triton")]
PAD = 123456  # a padding draft id far outside the vocabulary: must never be read


def peaked(argmaxes: list[int], V: int) -> torch.Tensor:
    """One row per entry, mass 0.5 on that token and the rest spread evenly: ``[len, V]``."""
    rows = torch.full((len(argmaxes), V), 0.5 / (V - 1))
    rows[torch.arange(len(argmaxes)), argmaxes] = 0.5
    return rows


def one_hot(tokens: list[int], V: int) -> torch.Tensor:
    return torch.nn.functional.one_hot(torch.tensor(tokens), V).float()


# ----------------------------------------------------------------------------- greedy
# V = 8, m = 3, target row argmaxes [5, 7, 2, 4]; row 0 of the "tie" case has 3 and 6 tied.
GREEDY_CASES = {
    # name: (drafts, num_draft, expected output, expected num_emitted)
    "all_accepted_bonus": ([5, 7, 2], 3, [5, 7, 2, 4], 4),
    "first_rejected": ([1, 7, 2], 3, [5, -1, -1, -1], 1),
    "middle_rejected": ([5, 3, 2], 3, [5, 7, -1, -1], 2),
    "no_drafts_bonus_row0": ([PAD, PAD, PAD], 0, [5, -1, -1, -1], 1),
    "ragged_all_accepted": ([5, 7, PAD], 2, [5, 7, 2, -1], 3),
    "tie_lowest_id": ([6, PAD, PAD], 1, [3, -1, -1, -1], 1),
}


def greedy_inputs(names: list[str]):
    V = 8
    target = peaked([5, 7, 2, 4], V).expand(len(names), 4, V).clone()  # [R, M, V]
    for i, name in enumerate(names):
        if name == "tie_lowest_id":
            target[i, 0] = 0.1 / 6
            target[i, 0, [3, 6]] = 0.45
    drafts = torch.tensor([GREEDY_CASES[n][0] for n in names])  # [R, m]
    num_draft = torch.tensor([GREEDY_CASES[n][1] for n in names])  # [R]
    out = torch.tensor([GREEDY_CASES[n][2] for n in names])  # [R, M]
    emitted = torch.tensor([GREEDY_CASES[n][3] for n in names])  # [R]
    return target, drafts, num_draft, out, emitted


@pytest.mark.parametrize("use_triton", PATHS)
@pytest.mark.parametrize("name", list(GREEDY_CASES))
def test_greedy_single_case(name, use_triton):
    target, drafts, num_draft, out, emitted = greedy_inputs([name])
    got_out, got_emitted = rejection_sample(target, drafts, num_draft, use_triton=use_triton)
    assert torch.equal(got_out, out), (got_out, out)
    assert torch.equal(got_emitted, emitted)


@pytest.mark.parametrize("use_triton", PATHS)
def test_greedy_ragged_batch(use_triton):
    names = list(GREEDY_CASES) * 2
    target, drafts, num_draft, out, emitted = greedy_inputs(names)
    got_out, got_emitted = rejection_sample(target, drafts, num_draft.int(), use_triton=use_triton)
    assert torch.equal(got_out, out)
    assert torch.equal(got_emitted, emitted)


# ----------------------------------------------------------------------------- sampling
def sampling_case(name: str):
    """Forced outcomes, V = 6, m = 2: ``(p [1,3,V], q [1,2,V], drafts, n, u, E, out, emitted)``."""
    V = 6
    mixed = torch.tensor([[0.1, 0.2, 0.3, 0.15, 0.15, 0.1], [0.3, 0.1, 0.1, 0.2, 0.2, 0.1]])
    u = torch.tensor([0.999999, 0.999999])  # as close to 1 as float32 allows below it
    E = torch.ones(V)
    if name == "q_equals_p_accepts_all":  # u * q(d) < p(d) = q(d) for every u < 1
        p, q, d, n = torch.cat([mixed, one_hot([4], V)]), mixed, [2, 0], 2
        out, emitted = [2, 0, 4], 3  # the bonus comes from the one-hot row 2
    elif name == "p_zero_rejects_residual":  # p(d) = 0: never accepted; residual = p's support
        p, q, d, n = torch.cat([one_hot([3], V), mixed]), mixed, [1, 0], 2
        u = torch.zeros(2)
        out, emitted = [3, -1, -1], 1
    elif name == "second_rejected":
        p, q, d, n = torch.cat([mixed[:1], one_hot([5], V), mixed[:1]]), mixed, [2, 0], 2
        out, emitted = [2, 5, -1], 2
    elif name == "race_picks_by_E":  # n = 0: bonus from row 0 by argmax p / E = [2, .2, .3, ...]
        p, q, d, n = torch.cat([mixed[:1], mixed]), mixed, [PAD, PAD], 0
        E = torch.tensor([0.05, 1.0, 1.0, 1.0, 1.0, 1.0])
        out, emitted = [0, -1, -1], 1
    elif name == "zero_residual_falls_back_to_p":  # q > p at d by "rounding": residual is all 0
        p0 = torch.tensor([0.5, 0.5, 0, 0, 0, 0])
        q0 = torch.tensor([0.6, 0.5, 0, 0, 0, 0])
        p, q, d, n = torch.stack([p0, p0, p0]), torch.stack([q0, q0]), [0, 0], 2
        E = torch.tensor([1.0, 0.5, 1.0, 1.0, 1.0, 1.0])  # p / E = [.5, 1, 0, ...] -> token 1
        out, emitted = [1, -1, -1], 1
    else:
        raise KeyError(name)
    return (p[None].contiguous(), q[None].contiguous(), torch.tensor([d]), torch.tensor([n]),
            u[None].contiguous(), E[None].contiguous(), torch.tensor([out]), torch.tensor([emitted]))


SAMPLING_CASES = ["q_equals_p_accepts_all", "p_zero_rejects_residual", "second_rejected",
                  "race_picks_by_E", "zero_residual_falls_back_to_p"]


@pytest.mark.parametrize("use_triton", PATHS)
@pytest.mark.parametrize("name", SAMPLING_CASES)
def test_sampling_forced_case(name, use_triton):
    p, q, d, n, u, E, out, emitted = sampling_case(name)
    got_out, got_emitted = rejection_sample(p, d, n, q, u, E, use_triton=use_triton)
    assert torch.equal(got_out, out), (got_out, out)
    assert torch.equal(got_emitted, emitted)


def test_q_equals_p_accepts_all_for_any_draw():
    R, m, V = 256, 3, 7
    g = torch.Generator().manual_seed(3)
    p = torch.softmax(torch.randn(R, m + 1, V, generator=g), -1)
    q = p[:, :m].contiguous()
    d = torch.multinomial(q.reshape(-1, V), 1, generator=g).reshape(R, m)
    out, emitted = rejection_sample(p, d, torch.full((R,), m), q, generator=g)
    assert torch.equal(emitted, torch.full((R,), m + 1))
    assert torch.equal(out[:, :m], d)


# ----------------------------------------------------------------------------- determinism
def random_batch(R: int, m: int, V: int, seed: int, sharp: float = 1.0):
    """Random target rows, q = a blend of p and noise, drafts drawn from q, ragged num_draft."""
    g = torch.Generator().manual_seed(seed)
    p = torch.softmax(torch.randn(R, m + 1, V, generator=g) * sharp, -1)  # [R, M, V]
    noise = torch.softmax(torch.randn(R, m, V, generator=g) * sharp, -1)
    q = (0.7 * p[:, :m] + 0.3 * noise).contiguous()  # [R, m, V]
    d = torch.multinomial(q.reshape(-1, V), 1, generator=g).reshape(R, m)  # [R, m]
    n = torch.randint(0, m + 1, (R,), generator=g)
    n[:2] = torch.tensor([0, m])
    return p, q, d, n


def test_seeded_determinism():
    p, q, d, n = random_batch(64, 3, 10, seed=0)
    run = lambda seed: rejection_sample(p, d, n, q, generator=torch.Generator().manual_seed(seed))
    a, b, c = run(7), run(7), run(8)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    assert not torch.equal(a[0], c[0])
    # The wrapper draws uniforms, then exponentials, from the generator.
    g = torch.Generator().manual_seed(7)
    u = torch.rand((64, 3), generator=g)
    E = torch.empty(64, 10).exponential_(generator=g)
    explicit = rejection_sample(p, d, n, q, u, E)
    assert torch.equal(explicit[0], a[0]) and torch.equal(explicit[1], a[1])


# ----------------------------------------------------------------------------- losslessness
V_STAT, M_STAT, N_STAT = 5, 4, 20_000  # vocab, verify rows (m = 3), requests
P_STAT = torch.tensor([  # [M, V] target rows: each position has its own distribution
    [0.10, 0.20, 0.30, 0.25, 0.15],
    [0.40, 0.05, 0.15, 0.20, 0.20],
    [0.20, 0.20, 0.20, 0.10, 0.30],
    [0.05, 0.50, 0.15, 0.15, 0.15],
])
Q_PEAKED = torch.tensor([0.60, 0.10, 0.10, 0.10, 0.10])  # what the drafts are drawn from
CHI2_CRIT_DF4 = 18.47  # chi-square, 4 degrees of freedom, p = 0.001


def emitted_chi2(q_claimed: torch.Tensor, seed: int = 0) -> list[tuple[float, int]]:
    """Draft from Q_PEAKED, verify with ``q_claimed``; per output position k, the chi-square of
    the k-th emitted token (over requests that emitted it, i.e. accepted drafts 1..k) against
    P_STAT[k], and how many requests that was."""
    R, m = N_STAT, M_STAT - 1
    g = torch.Generator().manual_seed(seed)
    p = P_STAT.expand(R, M_STAT, V_STAT).contiguous()
    d = torch.multinomial(Q_PEAKED, R * m, replacement=True, generator=g).reshape(R, m)
    n = torch.randint(0, m + 1, (R,), generator=g)
    q = q_claimed.expand(R, m, V_STAT).contiguous()
    out, emitted = rejection_sample(p, d, n, q, generator=g)
    stats = []
    for k in range(M_STAT):
        tokens = out[emitted > k, k]
        count = torch.bincount(tokens, minlength=V_STAT).double()
        expected = P_STAT[k].double() * len(tokens)
        stats.append((float(((count - expected) ** 2 / expected).sum()), len(tokens)))
    return stats


def test_output_distribution_matches_target():
    """STYLE rule 8: every emitted position follows the target row, whatever q was (q != p)."""
    for k, (chi2, count) in enumerate(emitted_chi2(Q_PEAKED)):
        assert count > 1000, f"position {k}: only {count} samples"
        assert chi2 < CHI2_CRIT_DF4, f"position {k}: chi2 {chi2:.1f} over {count} samples"


def test_wrong_q_is_detectably_off():
    """Claiming uniform q for drafts drawn from a peaked q over-emits the peaked token."""
    stats = emitted_chi2(torch.full((V_STAT,), 1.0 / V_STAT))
    assert stats[0][0] > 20 * CHI2_CRIT_DF4, stats  # first token: far off p_0
    assert all(chi2 > CHI2_CRIT_DF4 for chi2, _ in stats[:3]), stats  # positions with drafts


# ----------------------------------------------------------------------------- Triton == reference
@pytest.mark.parametrize("greedy", [True, False], ids=["greedy", "sampling"])
def test_triton_matches_reference(greedy):
    R, m, V = 12, 4, 150  # V is not a multiple of block_v = 64: three chunks, the last partial
    p, q, d, n = random_batch(R, m, V, seed=1, sharp=0.5)
    if greedy:  # make acceptances likely; tie the row maximum across chunks in two rows
        d = torch.where(torch.arange(R)[:, None] % 3 > 0, p[:, :m].argmax(-1), d)
        p[2, 0], p[3, 1] = 1.0 / V, 1.0 / V
        p[2, 0, [5, 70, 140]], p[3, 1, [66, 130]] = 0.2, 0.2
        d[2, 0], d[3, 0], d[3, 1] = 70, p[3, 0].argmax(), 130  # ties go to the lowest id
        n[2], n[3] = m, m
    g = torch.Generator().manual_seed(2)
    u = torch.rand((R, m), generator=g)
    E = torch.empty(R, V).exponential_(generator=g)
    extra = (None, None, None) if greedy else (q, u, E)
    ref = rejection_sample_reference(p, d, n.int(), *extra)
    out, emitted = rejection_sample(p, d, n.int(), *extra, use_triton=True, block_v=64)
    assert (out != -999).all() and (emitted != -999).all(), "the kernel left slots unwritten"
    assert torch.equal(out, ref[0]), (out, ref[0])
    assert torch.equal(emitted, ref[1])
    assert 1 < emitted.float().mean() < m + 1, "the batch should mix acceptances and rejections"
    if greedy:
        assert out[2, 0] == 5 and out[3, 1] == 66


CUDA = pytest.mark.skipif(not torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1",
                          reason="needs a CUDA GPU and compiled Triton (TRITON_INTERPRET=0)")


@CUDA
@pytest.mark.parametrize("shape", [(12, 4, 150), (64, 7, 49152)], ids=["small", "smollm2_vocab"])
@pytest.mark.parametrize("greedy", [True, False], ids=["greedy", "sampling"])
def test_triton_cuda_matches_reference(greedy, shape):
    """The compiled kernel on a GPU emits exactly what the CPU reference emits, at the real vocab size."""
    R, m, V = shape
    p, q, d, n = random_batch(R, m, V, seed=3, sharp=0.5)
    if greedy:  # most drafts are the row argmax, so blocks are accepted at various lengths
        d = torch.where(torch.rand(R, m, generator=torch.Generator().manual_seed(4)) < 0.8, p[:, :m].argmax(-1), d)
    g = torch.Generator().manual_seed(5)
    u = torch.rand((R, m), generator=g)
    E = torch.empty(R, V).exponential_(generator=g)
    extra = (None, None, None) if greedy else (q, u, E)
    ref = rejection_sample_reference(p, d, n.int(), *extra)
    cuda = [t if t is None else t.cuda() for t in (p, d, n.int(), *extra)]
    out, emitted = rejection_sample(*cuda, use_triton=True)
    assert out.is_cuda and (out != -999).all() and (emitted != -999).all(), "the kernel left slots unwritten"
    assert torch.equal(out.cpu(), ref[0]), (out.cpu(), ref[0])
    assert torch.equal(emitted.cpu(), ref[1])
    assert 1 < emitted.float().mean() < m + 1, "the batch should mix acceptances and rejections"


@CUDA
def test_output_distribution_matches_target_cuda():
    """The statistical losslessness test through the compiled kernel (q != p; uniforms drawn on the CPU)."""
    R, m = N_STAT, M_STAT - 1
    g = torch.Generator().manual_seed(0)
    p = P_STAT.expand(R, M_STAT, V_STAT).contiguous()
    d = torch.multinomial(Q_PEAKED, R * m, replacement=True, generator=g).reshape(R, m)
    n = torch.randint(0, m + 1, (R,), generator=g)
    q = Q_PEAKED.expand(R, m, V_STAT).contiguous()
    u = torch.rand((R, m), generator=g)
    E = torch.empty(R, V_STAT).exponential_(generator=g)
    out, emitted = (t.cpu() for t in rejection_sample(*(t.cuda() for t in (p, d, n, q, u, E)), use_triton=True))
    for k in range(M_STAT):
        tokens = out[emitted > k, k]
        count = torch.bincount(tokens, minlength=V_STAT).double()
        expected = P_STAT[k].double() * len(tokens)
        chi2 = float(((count - expected) ** 2 / expected).sum())
        assert len(tokens) > 1000 and chi2 < CHI2_CRIT_DF4, f"position {k}: chi2 {chi2:.1f} over {len(tokens)}"


# ----------------------------------------------------------------------------- bad input
def valid_inputs():
    p, q, d, n = random_batch(4, 3, 10, seed=5)
    return dict(target_probs=p, draft_token_ids=d, num_draft=n, draft_probs=q,
                uniforms=torch.full((4, 3), 0.5), exponentials=torch.ones(4, 10))


def _set(key, value_fn):
    def mutate(kw):
        kw[key] = value_fn(kw)
    return mutate


def _zero_q_at_draft(kw):
    n, d, q = kw["num_draft"], kw["draft_token_ids"], kw["draft_probs"].clone()
    n[1] = 2
    q[1, 1, d[1, 1]] = 0.0
    kw["draft_probs"] = q


BAD_INPUTS = {  # name: (mutation of valid_inputs(), expected message)
    "target_2d": (_set("target_probs", lambda kw: kw["target_probs"][0]), "target_probs must be"),
    "target_float64": (_set("target_probs", lambda kw: kw["target_probs"].double()), "dtype torch.float32"),
    "target_noncontiguous": (_set("target_probs", lambda kw: kw["target_probs"].transpose(0, 1)
                                  .contiguous().transpose(0, 1)), "contiguous"),
    "drafts_wrong_shape": (_set("draft_token_ids", lambda kw: kw["draft_token_ids"][:, :2]),
                           r"shape \[4, 3\]"),
    "drafts_int32": (_set("draft_token_ids", lambda kw: kw["draft_token_ids"].int()), "dtype torch.int64"),
    "num_draft_float": (_set("num_draft", lambda kw: kw["num_draft"].float()), "num_draft must have dtype"),
    "num_draft_above_m": (_set("num_draft", lambda kw: torch.tensor([0, 1, 4, 3])),
                          r"num_draft must lie in \[0, m=3\]"),
    "num_draft_negative": (_set("num_draft", lambda kw: torch.tensor([0, -1, 2, 3])), "num_draft must lie"),
    "draft_id_out_of_vocab": (_set("draft_token_ids", lambda kw: torch.full((4, 3), 10)),
                              "draft_token_ids must lie"),
    "q_wrong_shape": (_set("draft_probs", lambda kw: kw["draft_probs"][:, :, :9].contiguous()),
                      "draft_probs must have shape"),
    "q_zero_at_proposed_draft": (_zero_q_at_draft, "q = 0 to a proposed draft token"),
    "uniform_equal_one": (_set("uniforms", lambda kw: torch.ones(4, 3)), r"uniforms must lie in \[0, 1\)"),
    "exponential_zero": (_set("exponentials", lambda kw: torch.zeros(4, 10)), "exponentials must be > 0"),
}


@pytest.mark.parametrize("name", list(BAD_INPUTS))
def test_bad_input_raises(name):
    kw = valid_inputs()
    rejection_sample(**kw)  # the unmutated inputs are valid
    mutate, match = BAD_INPUTS[name]
    mutate(kw)
    with pytest.raises(ValueError, match=match):
        rejection_sample(**kw)


def test_padding_is_not_checked():
    """Slots past num_draft are padding: any id and q = 0 there are fine."""
    kw = valid_inputs()
    kw["num_draft"] = torch.tensor([0, 1, 2, 3])
    kw["draft_token_ids"][0] = -1
    kw["draft_probs"][1, 1:] = 0.0
    out, emitted = rejection_sample(**kw)
    assert (emitted <= kw["num_draft"] + 1).all()


def test_greedy_warns_about_ignored_randomness():
    p, _, d, n = random_batch(2, 3, 10, seed=6)
    with pytest.warns(UserWarning, match="ignores"):
        rejection_sample(p, d, n, generator=torch.Generator())
