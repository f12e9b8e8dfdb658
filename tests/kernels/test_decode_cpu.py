"""The fused CPU kernels against their plain-torch references (kernels/decode_cpu.py)."""

import platform
import shutil

import pytest
import torch

from specray.drafters.rope import RopeSpec, rope_table
from specray.kernels import decode_cpu

needs_kernels = pytest.mark.skipif(not decode_cpu.available(), reason=f"{decode_cpu.unavailable_reason()}")


def _isa_levels() -> list[str]:
    """-march levels to check: native (what serving builds), AVX2 + FMA when this CPU has them
    (the vector path of CPUs without AVX-512), and x86-64-v2 (none of our vector paths)."""
    if platform.machine() != "x86_64":
        return ["native"]
    flags = set(decode_cpu._cpu_flags().split())
    return ["native", *(["x86-64-v3"] if {"avx2", "fma"} <= flags else []), "x86-64-v2"]


@pytest.fixture(autouse=True, params=_isa_levels())
def isa(request, monkeypatch):
    """Every test below runs on the kernels built for each level (``decode_cpu._build``)."""
    if request.param != "native":
        if not decode_cpu.available():
            pytest.skip(f"{decode_cpu.unavailable_reason()}")
        monkeypatch.setattr(decode_cpu, "_LIB", decode_cpu._build(request.param))
    return request.param


def test_the_kernels_build_where_there_is_a_compiler():
    """On x86-64 with a C compiler the runner must not quietly fall back to its torch path."""
    if platform.machine() != "x86_64" or shutil.which("cc") is None:
        pytest.skip("no x86-64 C toolchain here")
    assert decode_cpu.available(), decode_cpu.unavailable_reason()


@needs_kernels
@pytest.mark.parametrize("R, D", [(1, 576), (5, 64), (16, 33)])
@pytest.mark.parametrize("with_residual", [True, False])
def test_add_rms_norm_matches_the_reference(R, D, with_residual):
    torch.manual_seed(R * D)
    x, y, w = torch.randn(R, D) * 3, torch.randn(R, D), torch.randn(D)
    x_ref, x_got = x.clone(), x.clone()
    want = decode_cpu.add_rms_norm_reference(x_ref, y if with_residual else None, w, 1e-5)
    got = decode_cpu.add_rms_norm(x_got, y if with_residual else None, w, 1e-5)
    torch.testing.assert_close(got, want, atol=2e-6, rtol=2e-6)
    torch.testing.assert_close(x_got, x_ref, atol=0, rtol=0)  # the residual add, in place


@needs_kernels
@pytest.mark.parametrize("R, I", [(1, 1536), (3, 17), (16, 64)])
def test_silu_mul_matches_the_reference(R, I):
    torch.manual_seed(R + I)
    gate_up = torch.randn(R, 2 * I) * 6
    torch.testing.assert_close(decode_cpu.silu_mul(gate_up), decode_cpu.silu_mul_reference(gate_up),
                               atol=1e-5, rtol=1e-5)


@needs_kernels
@pytest.mark.parametrize("M, K, N", [(1, 576, 1536), (1, 20, 13), (2, 64, 12), (3, 37, 9), (5, 576, 40), (16, 72, 24)])
def test_linear_matches_the_reference(M, K, N):
    """Every tile shape and tail: one row against 8 weight rows, pairs against 4, a lone row, K
    and N not multiples of the vector width."""
    torch.manual_seed(M * K + N)
    x, w = torch.randn(M, K), torch.randn(N, K)
    torch.testing.assert_close(decode_cpu.linear(x, w), decode_cpu.linear_reference(x, w), atol=1e-4, rtol=1e-5)
    x[M - 1, K // 2] = float("nan")  # non-finite stays in its row
    out = decode_cpu.linear(x, w)
    assert out[M - 1].isnan().all() and out[: M - 1].isfinite().all()
    with pytest.raises(ValueError, match="weight: expected shape"):
        decode_cpu.linear(x, w[:, :-1].contiguous())


@needs_kernels
def test_exp_holds_over_the_float_range():
    """SiLU and softmax through the kernels' exp over its whole range: underflow to 0, overflow to
    inf (silu -> -0), and the large scores whose softmax is a near one-hot."""
    gate_up = torch.linspace(-120, 120, 2 * 1000).view(2, 1000)
    torch.testing.assert_close(decode_cpu.silu_mul(gate_up), decode_cpu.silu_mul_reference(gate_up),
                               atol=1e-5, rtol=1e-5)
    case = _attention_case(2, 3, 4, 2, 32, [29, 13], [3, 2], seed=11)
    case["qkv"] *= 8  # scores in the hundreds
    _compare(case)


def _attention_case(B, T, H, Hkv, hd, starts, num_new, seed):
    g = torch.Generator().manual_seed(seed)
    max_len, num_slots = max(starts) + T + 3, B + 2
    cos, sin = rope_table(max_len, RopeSpec.of(hd, 10000.0), torch.float32)
    slots = torch.randperm(num_slots, generator=g)[:B]
    start = torch.tensor(starts)
    positions = (start[:, None] + torch.arange(T)).view(-1)
    return dict(qkv=torch.randn(B * T, (H + 2 * Hkv) * hd, generator=g), B=B, T=T, num_heads=H, num_kv_heads=Hkv,
                cos=cos[positions].contiguous(), sin=sin[positions].contiguous(),
                k_cache=torch.randn(num_slots, Hkv, max_len, hd, generator=g),
                v_cache=torch.randn(num_slots, Hkv, max_len, hd, generator=g),
                slots=slots, start=start, num_new=torch.tensor(num_new))


def _compare(case, visible=None):
    ref = {**case, "k_cache": case["k_cache"].clone(), "v_cache": case["v_cache"].clone()}
    got = {**case, "k_cache": case["k_cache"].clone(), "v_cache": case["v_cache"].clone()}
    want = decode_cpu.attention_reference(**ref, visible=visible)
    out = decode_cpu.attention(**got, visible=visible)
    torch.testing.assert_close(out, want, atol=2e-6, rtol=2e-5)
    for name in ("k_cache", "v_cache"):  # the rows' K/V writes, and nothing else touched
        torch.testing.assert_close(got[name], ref[name], atol=1e-6, rtol=1e-6)


@needs_kernels
@pytest.mark.parametrize("B, T, H, Hkv, hd, starts, num_new", [
    (1, 1, 9, 3, 64, [40], [1]),  # a decode step
    (4, 1, 4, 4, 16, [0, 3, 17, 9], [1, 1, 1, 1]),  # no grouping, a request with no context
    (3, 5, 6, 2, 8, [7, 0, 12], [5, 2, 3]),  # a ragged verify: padding rows see key 0 only
])
def test_chain_attention_matches_the_reference(B, T, H, Hkv, hd, starts, num_new):
    _compare(_attention_case(B, T, H, Hkv, hd, starts, num_new, seed=B * 100 + T))


@needs_kernels
@pytest.mark.parametrize("lengths, starts", [
    ([1], [0]),  # one prompt of one token
    ([37, 5, 1, 20], [0, 9, 0, 3]),  # ragged prompts, some after committed context (a later turn)
])
def test_packed_prefill_attention_matches_the_reference(lengths, starts):
    """Prompts packed back to back (no padding rows): each row sees its committed keys and its
    own prompt's rows up to itself, never another prompt's."""
    B, H, Hkv, hd, R = len(lengths), 6, 2, 16, sum(lengths)
    g = torch.Generator().manual_seed(R)
    max_len, num_slots = max(s + n for s, n in zip(starts, lengths)) + 2, B + 1
    cos, sin = rope_table(max_len, RopeSpec.of(hd, 10000.0), torch.float32)
    positions = torch.cat([torch.arange(s, s + n) for s, n in zip(starts, lengths)])
    case = dict(qkv=torch.randn(R, (H + 2 * Hkv) * hd, generator=g), B=B, lengths=torch.tensor(lengths),
                num_heads=H, num_kv_heads=Hkv, cos=cos[positions].contiguous(), sin=sin[positions].contiguous(),
                k_cache=torch.randn(num_slots, Hkv, max_len, hd, generator=g),
                v_cache=torch.randn(num_slots, Hkv, max_len, hd, generator=g),
                slots=torch.randperm(num_slots, generator=g)[:B], start=torch.tensor(starts))
    _compare(case)
    if B > 1:  # each prompt alone (the padded layout, T = its length) gives the same rows
        want = decode_cpu.attention(**{**case, "k_cache": case["k_cache"].clone(), "v_cache": case["v_cache"].clone()})
        first = 0
        for b, n in enumerate(lengths):
            one = {**case, "qkv": case["qkv"][first : first + n], "B": 1, "T": n, "lengths": None,
                   "cos": case["cos"][first : first + n], "sin": case["sin"][first : first + n],
                   "slots": case["slots"][b : b + 1], "start": case["start"][b : b + 1], "num_new": torch.tensor([n])}
            got = decode_cpu.attention(**{**one, "k_cache": case["k_cache"].clone(), "v_cache": case["v_cache"].clone()})
            torch.testing.assert_close(got, want[first : first + n], atol=2e-6, rtol=2e-5)
            first += n
    with pytest.raises(ValueError, match="not both"):
        decode_cpu.attention(**{**case, "T": 4})
    with pytest.raises(ValueError, match="needs T, not lengths"):
        decode_cpu.attention(**{**case, "visible": torch.ones(B, 2, 2, dtype=torch.bool)})


@needs_kernels
def test_tree_attention_matches_the_reference():
    """Rows of a tree: each sees the committed keys and its ancestors among the new rows only."""
    case = _attention_case(2, 4, 6, 3, 16, [5, 11], [4, 4], seed=7)
    # request 0: a -> (x, y), x -> z; request 1: a chain of 3 and a padding row seeing itself
    visible = torch.tensor([[[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 1, 0, 1]],
                            [[1, 0, 0, 0], [1, 1, 0, 0], [1, 1, 1, 0], [0, 0, 0, 1]]], dtype=torch.bool)
    _compare(case, visible)
    chain = torch.ones(4, 4).tril().bool().expand(2, 4, 4)
    with pytest.raises(AssertionError):  # the mask matters: a chain's output differs from the tree's
        want = decode_cpu.attention_reference(**{**case, "k_cache": case["k_cache"].clone(),
                                                 "v_cache": case["v_cache"].clone()}, visible=visible)
        got = decode_cpu.attention(**{**case, "k_cache": case["k_cache"].clone(),
                                      "v_cache": case["v_cache"].clone()}, visible=chain)
        torch.testing.assert_close(got, want)


@needs_kernels
def test_non_finite_inputs_stay_non_finite():
    case = _attention_case(2, 1, 4, 2, 16, [6, 6], [1, 1], seed=3)
    case["qkv"][0, 0] = float("nan")  # request 0's first query head
    out = decode_cpu.attention(**case)
    assert out[0, :16].isnan().all() and out[0, 16:].isfinite().all() and out[1].isfinite().all()
    case = _attention_case(1, 1, 2, 1, 8, [4], [1], seed=4)
    case["k_cache"][case["slots"][0], 0, 2] = float("inf")  # a committed key
    assert decode_cpu.attention(**case).isnan().all()
    gate_up = torch.randn(2, 8)
    gate_up[0, 0], gate_up[1, 1] = float("nan"), float("inf")
    out = decode_cpu.silu_mul(gate_up)
    assert out[0, 0].isnan() and not out[1, 1].isfinite()
    x = torch.randn(2, 8)
    x[1, 3] = float("nan")
    normed = decode_cpu.add_rms_norm(x, None, torch.ones(8), 1e-6)
    assert normed[1].isnan().all() and normed[0].isfinite().all()


@needs_kernels
def test_bad_arguments_are_refused_before_the_kernel_runs():
    case = _attention_case(2, 1, 4, 2, 16, [6, 6], [1, 1], seed=5)
    with pytest.raises(ValueError, match="qkv: expected shape"):
        decode_cpu.attention(**{**case, "qkv": case["qkv"][:, :-1].contiguous()})
    with pytest.raises(ValueError, match="qkv: expected a contiguous CPU torch.float32"):
        decode_cpu.attention(**{**case, "qkv": case["qkv"].double()})
    with pytest.raises(ValueError, match="outside the cache"):
        decode_cpu.attention(**{**case, "start": torch.tensor([6, case["k_cache"].shape[2]])})
    with pytest.raises(ValueError, match="outside the cache"):
        decode_cpu.attention(**{**case, "slots": torch.tensor([0, case["k_cache"].shape[0]])})
    with pytest.raises(ValueError, match="y: expected shape"):
        decode_cpu.add_rms_norm(torch.randn(2, 8), torch.randn(2, 7), torch.ones(8), 1e-6)
