"""kernels/rejection.py: hand-built greedy and sampling cases, seeded determinism, statistical
losslessness (and its failure with the wrong q), a mixed ragged batch in one call, Triton kernel ==
reference (negative logits included), input checks.

Run: ``pytest -q tests/kernels/test_rejection.py`` (conftest sets TRITON_INTERPRET=1). On a
CUDA machine, ``TRITON_INTERPRET=0 pytest -q tests/kernels -k cuda`` runs the compiled kernel
against the reference (the ``cuda`` tests skip elsewhere).
"""

import os

import pytest
import torch

from specray.kernels.rejection import rejection_sample, rejection_sample_reference

PATHS = [pytest.param(False, id="reference"), pytest.param(True, id="triton")]


def ragged(p, d, n, q=None, u=None, greedy=None) -> dict:
    """Padded inputs — p [R, M, V], drafts [R, m], n [R], q [R, m, V], u [R, m] — in the flat
    layout: request r keeps rows p[r, :n_r + 1] and drafts d[r, :n_r]."""
    n = [int(x) for x in n]
    R = len(n)
    cu = torch.tensor([0] + n).cumsum(0)
    kw = dict(target=torch.cat([p[r, : n[r] + 1] for r in range(R)]).contiguous(),
              draft_token_ids=torch.cat([d[r, : n[r]] for r in range(R)]).long().contiguous(), cu_num_draft=cu,
              greedy=torch.full((R,), q is None) if greedy is None else greedy)
    if q is not None:
        kw["draft_probs"] = torch.cat([q[r, : n[r]] for r in range(R)]).contiguous()
    if u is not None:
        kw["uniforms"] = torch.cat([u[r, : n[r]] for r in range(R)]).contiguous()
    return kw


def padded(output: torch.Tensor, cu: torch.Tensor, M: int) -> torch.Tensor:
    """The flat output back to [R, M], -1 past each request's rows."""
    R = len(cu) - 1
    out = torch.full((R, M), -1)
    for r in range(R):
        rows = output[int(cu[r]) + r : int(cu[r + 1]) + r + 1]
        out[r, : len(rows)] = rows
    return out


def verify(kw: dict, M: int, **options):
    out, emitted = rejection_sample(**kw, **options)
    return padded(out, kw["cu_num_draft"], M), emitted


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
    "no_drafts_bonus_row0": ([0, 0, 0], 0, [5, -1, -1, -1], 1),
    "ragged_all_accepted": ([5, 7, 0], 2, [5, 7, 2, -1], 3),
    "tie_lowest_id": ([6, 0, 0], 1, [3, -1, -1, -1], 1),
    "negative_logits": ([5, 7, 2], 3, [5, 7, 2, 4], 4),  # every logit < -1: argmax as torch's
    "max_exactly_minus_one": ([5, 7, 1], 3, [5, 7, 2, -1], 3),
}


def greedy_inputs(names: list[str]):
    V = 8
    target = peaked([5, 7, 2, 4], V).expand(len(names), 4, V).clone()  # [R, M, V]
    for i, name in enumerate(names):
        if name == "tie_lowest_id":
            target[i, 0] = 0.1 / 6
            target[i, 0, [3, 6]] = 0.45
        if name == "negative_logits":
            target[i] = target[i].log() - 10.0
        if name == "max_exactly_minus_one":
            target[i] = -1.0 - 3 * target[i].flip(-1)  # the smallest becomes the largest: -1 exactly
            target[i, torch.arange(4), [5, 7, 2, 4]] = -1.0
    drafts = torch.tensor([GREEDY_CASES[n][0] for n in names])  # [R, m]
    num_draft = torch.tensor([GREEDY_CASES[n][1] for n in names])  # [R]
    out = torch.tensor([GREEDY_CASES[n][2] for n in names])  # [R, M]
    emitted = torch.tensor([GREEDY_CASES[n][3] for n in names])  # [R]
    return target, drafts, num_draft, out, emitted


@pytest.mark.parametrize("use_triton", PATHS)
@pytest.mark.parametrize("name", list(GREEDY_CASES))
def test_greedy_single_case(name, use_triton):
    target, drafts, num_draft, out, emitted = greedy_inputs([name])
    got_out, got_emitted = verify(ragged(target, drafts, num_draft), 4, use_triton=use_triton)
    assert torch.equal(got_out, out), (got_out, out)
    assert torch.equal(got_emitted, emitted)


@pytest.mark.parametrize("use_triton", PATHS)
def test_greedy_ragged_batch(use_triton):
    names = list(GREEDY_CASES) * 2
    target, drafts, num_draft, out, emitted = greedy_inputs(names)
    kw = ragged(target, drafts, num_draft)
    kw["cu_num_draft"] = kw["cu_num_draft"].int()
    got_out, got_emitted = verify(kw, 4, use_triton=use_triton)
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
        p, q, d, n = torch.cat([mixed[:1], mixed]), mixed, [0, 0], 0
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
    got_out, got_emitted = verify(ragged(p, d, n, q, u), 3, exponentials=E, use_triton=use_triton)
    assert torch.equal(got_out, out), (got_out, out)
    assert torch.equal(got_emitted, emitted)


def test_q_equals_p_accepts_all_for_any_draw():
    R, m, V = 256, 3, 7
    g = torch.Generator().manual_seed(3)
    p = torch.softmax(torch.randn(R, m + 1, V, generator=g), -1)
    q = p[:, :m].contiguous()
    d = torch.multinomial(q.reshape(-1, V), 1, generator=g).reshape(R, m)
    out, emitted = verify(ragged(p, d, [m] * R, q), m + 1, generators=[g] * R)
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
    kw = ragged(p, d, n, q)
    run = lambda seed: rejection_sample(**kw, generators=[torch.Generator().manual_seed(seed + r) for r in range(64)])
    a, b, c = run(7), run(7), run(8)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    assert not torch.equal(a[0], c[0])
    # Request r draws its n_r uniforms, then V exponentials, from its own generator.
    u, E = [], []
    for r in range(64):
        g = torch.Generator().manual_seed(7 + r)
        u.append(torch.rand(int(n[r]), generator=g))
        E.append(torch.empty(10).exponential_(generator=g))
    explicit = rejection_sample(**kw, uniforms=torch.cat(u), exponentials=torch.stack(E))
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


def stat_batch(q_claimed: torch.Tensor, seed: int = 0) -> tuple[dict, torch.Tensor]:
    """N_STAT requests drafted from Q_PEAKED (ragged n), verified with ``q_claimed``: the inputs, with
    explicit uniforms and exponentials, and n."""
    R, m = N_STAT, M_STAT - 1
    g = torch.Generator().manual_seed(seed)
    p = P_STAT.expand(R, M_STAT, V_STAT)
    d = torch.multinomial(Q_PEAKED, R * m, replacement=True, generator=g).reshape(R, m)
    n = torch.randint(0, m + 1, (R,), generator=g)
    kw = ragged(p, d, n, q_claimed.expand(R, m, V_STAT))
    kw["uniforms"] = torch.rand(len(kw["draft_token_ids"]), generator=g)
    kw["exponentials"] = torch.empty(R, V_STAT).exponential_(generator=g)
    return kw, n


def emitted_chi2(out: torch.Tensor, emitted: torch.Tensor) -> list[tuple[float, int]]:
    """Per output position k, the chi-square of the k-th emitted token (over requests that emitted
    it, i.e. accepted drafts 1..k) against P_STAT[k], and how many requests that was."""
    stats = []
    for k in range(M_STAT):
        tokens = out[emitted > k, k]
        count = torch.bincount(tokens, minlength=V_STAT).double()
        expected = P_STAT[k].double() * len(tokens)
        stats.append((float(((count - expected) ** 2 / expected).sum()), len(tokens)))
    return stats


def test_output_distribution_matches_target():
    """STYLE rule 8: every emitted position follows the target row, whatever q was (q != p)."""
    kw, _ = stat_batch(Q_PEAKED)
    for k, (chi2, count) in enumerate(emitted_chi2(*verify(kw, M_STAT))):
        assert count > 1000, f"position {k}: only {count} samples"
        assert chi2 < CHI2_CRIT_DF4, f"position {k}: chi2 {chi2:.1f} over {count} samples"


def test_wrong_q_is_detectably_off():
    """Claiming uniform q for drafts drawn from a peaked q over-emits the peaked token."""
    kw, _ = stat_batch(torch.full((V_STAT,), 1.0 / V_STAT))
    stats = emitted_chi2(*verify(kw, M_STAT))
    assert stats[0][0] > 20 * CHI2_CRIT_DF4, stats  # first token: far off p_0
    assert all(chi2 > CHI2_CRIT_DF4 for chi2, _ in stats[:3]), stats  # positions with drafts


# ----------------------------------------------------------------------------- a mixed ragged batch
def mixed_batch(R: int, m: int, V: int, seed: int):
    """Every third request greedy (its rows: negative logits, most drafts the row argmax), the
    others sampled; n ragged over 0..m. Returns the flat inputs with explicit randoms, and n."""
    p, q, d, n = random_batch(R, m, V, seed=seed, sharp=0.5)
    greedy = torch.arange(R) % 3 == 0
    logits = p.log() - 5.0  # all < -1
    p = torch.where(greedy[:, None, None], logits, p)
    d = torch.where(greedy[:, None] & (torch.arange(m) < 2), p[:, :m].argmax(-1), d)
    g = torch.Generator().manual_seed(seed + 1)
    kw = ragged(p, d, n, q, torch.rand((R, m), generator=g), greedy=greedy)
    kw["exponentials"] = torch.empty(R, V).exponential_(generator=g)
    return kw, n, p, q, d


def test_mixed_batch_equals_each_request_alone():
    """One call over greedy and sampled requests with different n gives what each gets alone."""
    R, m, V = 12, 4, 40
    kw, n, *_ = mixed_batch(R, m, V, seed=11)
    out, emitted = verify(kw, m + 1)
    cu = kw["cu_num_draft"]
    for r in range(R):
        drafts, rows = slice(int(cu[r]), int(cu[r + 1])), slice(int(cu[r]) + r, int(cu[r + 1]) + r + 1)
        alone = {"target": kw["target"][rows], "draft_token_ids": kw["draft_token_ids"][drafts],
                 "cu_num_draft": torch.tensor([0, int(n[r])]), "greedy": kw["greedy"][r : r + 1]}
        if not kw["greedy"][r]:
            alone |= {"draft_probs": kw["draft_probs"][drafts], "uniforms": kw["uniforms"][drafts],
                      "exponentials": kw["exponentials"][r : r + 1]}
        one, k = verify(alone, m + 1)
        assert torch.equal(one[0], out[r]) and int(k[0]) == int(emitted[r]), r
    assert len(set(emitted.tolist())) > 2, "the batch should mix acceptance lengths"


def test_greedy_requests_read_no_draft_probs_or_randoms():
    """A greedy request's rows of draft_probs, uniforms and exponentials are never read: any value."""
    kw, *_ = mixed_batch(6, 3, 30, seed=12)
    ref = rejection_sample(**kw)
    owner = torch.repeat_interleave(torch.arange(6), kw["cu_num_draft"].diff())
    g = kw["greedy"]
    kw["draft_probs"][g[owner]] = 0.0
    kw["uniforms"][g[owner]] = 7.0
    kw["exponentials"][g] = -1.0
    again = rejection_sample(**kw)
    assert torch.equal(ref[0], again[0]) and torch.equal(ref[1], again[1])


# ----------------------------------------------------------------------------- Triton == reference
def _kernel_equals_reference(kw: dict, **options) -> torch.Tensor:
    ref = rejection_sample_reference(kw["target"], kw["draft_token_ids"], kw["cu_num_draft"], kw["greedy"],
                                     kw.get("draft_probs"), kw.get("uniforms"), kw.get("exponentials"))
    out, emitted = rejection_sample(**kw, use_triton=True, **options)
    assert (out != -999).all() and (emitted != -999).all(), "the kernel left slots unwritten"
    assert torch.equal(out, ref[0]), (out, ref[0])
    assert torch.equal(emitted, ref[1])
    return emitted


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
    kw = ragged(p, d, n) if greedy else ragged(p, d, n, q, u) | {"exponentials": E}
    kw["cu_num_draft"] = kw["cu_num_draft"].int()
    emitted = _kernel_equals_reference(kw, block_v=64)
    assert 1 < emitted.float().mean() < m + 1, "the batch should mix acceptances and rejections"
    if greedy:
        out = padded(rejection_sample(**kw)[0], kw["cu_num_draft"], m + 1)
        assert out[2, 0] == 5 and out[3, 1] == 66


@pytest.mark.parametrize("case", ["all_negative", "max_exactly_minus_one", "max_below_minus_one_in_last_chunk",
                                  "negative_inf_but_one"])
def test_triton_greedy_negative_logits_match_reference(case):
    """Greedy rows carry raw logits: a row whose maximum is <= -1 must still give its argmax."""
    R, m, V = 6, 3, 150
    g = torch.Generator().manual_seed(4)
    logits = -2.0 - 5 * torch.rand(R, m + 1, V, generator=g)  # every logit < -1
    if case == "max_exactly_minus_one":
        logits[:, :, 77] = -1.0
    if case == "max_below_minus_one_in_last_chunk":
        logits[:, :, 149] = -1.5
    if case == "negative_inf_but_one":
        logits[:] = float("-inf")
        logits[:, :, 100] = -3.0
    d = logits[:, :m].argmax(-1)
    d[::2, 1] = (d[::2, 1] + 1) % V  # every other request rejects its second draft
    kw = ragged(logits, d, [m, m, 2, 1, 0, m])
    emitted = _kernel_equals_reference(kw, block_v=64)
    out = padded(rejection_sample(**kw, use_triton=True, block_v=64)[0], kw["cu_num_draft"], m + 1)
    argmax = logits.argmax(-1)  # [R, M]
    for r in range(R):
        k = int(emitted[r]) - 1
        assert torch.equal(out[r, : k + 1], argmax[r, : k + 1]), (r, out[r], argmax[r])


def test_triton_mixed_ragged_batch_matches_reference():
    R, m, V = 18, 4, 150
    kw, n, *_ = mixed_batch(R, m, V, seed=13)
    emitted = _kernel_equals_reference(kw, block_v=64)
    assert len(set(emitted.tolist())) > 2 and (n == 0).any() and (n == m).any()


CUDA = pytest.mark.skipif(not torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1",
                          reason="needs a CUDA GPU and compiled Triton (TRITON_INTERPRET=0)")


def _on_cuda(kw: dict) -> dict:
    return {k: v.cuda() for k, v in kw.items()}


@pytest.mark.cuda
@CUDA
@pytest.mark.parametrize("shape", [(12, 4, 150), (64, 7, 49152)], ids=["small", "smollm2_vocab"])
@pytest.mark.parametrize("kind", ["greedy", "sampling", "mixed"])
def test_triton_cuda_matches_reference(kind, shape):
    """The compiled kernel on a GPU emits exactly what the CPU reference emits, at the real vocab size."""
    R, m, V = shape
    kw, *_ = mixed_batch(R, m, V, seed=3)
    kw["greedy"] = {"greedy": torch.ones(R, dtype=torch.bool), "sampling": torch.zeros(R, dtype=torch.bool),
                    "mixed": kw["greedy"]}[kind]
    ref = rejection_sample(**kw)
    out, emitted = rejection_sample(**_on_cuda(kw), use_triton=True)
    assert out.is_cuda and (out != -999).all() and (emitted != -999).all(), "the kernel left slots unwritten"
    assert torch.equal(out.cpu(), ref[0]), (out.cpu(), ref[0])
    assert torch.equal(emitted.cpu(), ref[1])
    assert 1 < emitted.float().mean() < m + 1, "the batch should mix acceptances and rejections"


@pytest.mark.cuda
@CUDA
def test_output_distribution_matches_target_cuda():
    """The statistical losslessness test through the compiled kernel (q != p; randoms drawn on the CPU)."""
    kw, _ = stat_batch(Q_PEAKED)
    out, emitted = rejection_sample(**_on_cuda(kw), use_triton=True)
    for k, (chi2, count) in enumerate(emitted_chi2(padded(out.cpu(), kw["cu_num_draft"], M_STAT), emitted.cpu())):
        assert count > 1000 and chi2 < CHI2_CRIT_DF4, f"position {k}: chi2 {chi2:.1f} over {count}"


# ----------------------------------------------------------------------------- bad input
def valid_inputs() -> dict:
    p, q, d, n = random_batch(4, 3, 10, seed=5)
    n = torch.tensor([1, 2, 3, 3])
    kw = ragged(p, d, n, q, torch.full((4, 3), 0.5))
    return kw | {"exponentials": torch.ones(4, 10)}


def _set(key, value_fn):
    def mutate(kw):
        kw[key] = value_fn(kw)
    return mutate


def _zero_q_at_draft(kw):
    q = kw["draft_probs"].clone()
    q[2, kw["draft_token_ids"][2]] = 0.0
    kw["draft_probs"] = q


BAD_INPUTS = {  # name: (mutation of valid_inputs(), expected message)
    "target_3d": (_set("target", lambda kw: kw["target"][None]), "target must be"),
    "target_float64": (_set("target", lambda kw: kw["target"].double()), "dtype torch.float32"),
    "target_noncontiguous": (_set("target", lambda kw: kw["target"].t().contiguous().t()), "contiguous"),
    "target_too_few_rows": (_set("target", lambda kw: kw["target"][:-1].contiguous()), r"shape \[8\]"),
    "drafts_wrong_shape": (_set("draft_token_ids", lambda kw: kw["draft_token_ids"][:-1].contiguous()),
                           r"shape \[9\]"),
    "drafts_int32": (_set("draft_token_ids", lambda kw: kw["draft_token_ids"].int()), "dtype torch.int64"),
    "cu_float": (_set("cu_num_draft", lambda kw: kw["cu_num_draft"].float()), "cu_num_draft must have dtype"),
    "cu_not_from_zero": (_set("cu_num_draft", lambda kw: torch.tensor([1, 2, 4, 7, 9])),
                         "cu_num_draft must rise from 0"),
    "cu_falls": (_set("cu_num_draft", lambda kw: torch.tensor([0, 4, 3, 6, 9])), "cu_num_draft must rise"),
    "greedy_not_bool": (_set("greedy", lambda kw: kw["greedy"].int()), "greedy must be a"),
    "draft_id_out_of_vocab": (_set("draft_token_ids", lambda kw: torch.full((9,), 10)),
                              "draft_token_ids must lie"),
    "q_missing": (_set("draft_probs", lambda kw: None), "draft_probs is required"),
    "q_wrong_shape": (_set("draft_probs", lambda kw: kw["draft_probs"][:, :9].contiguous()),
                      "draft_probs must have shape"),
    "q_zero_at_a_draft": (_zero_q_at_draft, "q = 0 to draft"),
    "uniform_equal_one": (_set("uniforms", lambda kw: torch.ones(9)), r"uniforms must lie in \[0, 1\)"),
    "exponential_zero": (_set("exponentials", lambda kw: torch.zeros(4, 10)), "exponentials must be > 0"),
    "generators_wrong_length": (_set("generators", lambda kw: [None] * 3), "one entry per request"),
}


@pytest.mark.parametrize("name", list(BAD_INPUTS))
def test_bad_input_raises(name):
    kw = valid_inputs()
    rejection_sample(**kw)  # the unmutated inputs are valid
    mutate, match = BAD_INPUTS[name]
    mutate(kw)
    with pytest.raises(ValueError, match=match):
        rejection_sample(**kw)


def test_greedy_warns_about_ignored_randomness():
    p, _, d, n = random_batch(2, 3, 10, seed=6)
    with pytest.warns(UserWarning, match="ignore"):
        rejection_sample(**ragged(p, d, n), generators=[torch.Generator(), None])
