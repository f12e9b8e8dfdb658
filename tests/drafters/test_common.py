"""drafters/common.py: the draft-vocabulary mapping, the two RoPE forms, the small-M and frozen linears, and
the drafter registry's contract (every registered drafter builds from its section and its debug config)."""

import pytest
import torch
import torch.nn.functional as F

from specray.drafters import ALGORITHMS, DRAFTERS, common, get_drafter
from specray.drafters.common import (FrozenLinear, apply_rope, apply_rope_table, d2t_offsets, draft_to_target,
                                     pick_kernels, rope_table, small_m_linear, t2d_mask, target_to_draft, to_target_distribution,
                                     weight_major_linear)
from specray.drafters.rope import RopeSpec, rope_frequencies
from specray.kernels import decode_cpu

VOCAB = torch.tensor([2, 5, 9])  # a draft vocabulary over V = 12 target ids


def test_draft_vocabulary_maps_both_ways_and_spreads_q_over_the_target_vocabulary():
    assert target_to_draft(torch.tensor([5, 3, 9, 2]), VOCAB, 12).tolist() == [1, -1, 2, 0]
    assert draft_to_target(torch.tensor([1, 2, 0]), VOCAB).tolist() == [5, 9, 2]
    q = torch.tensor([[0.5, 0.25, 0.25]])
    full = to_target_distribution(q, VOCAB, 12)
    assert full.shape == (1, 12) and full[0, [2, 5, 9]].tolist() == [0.5, 0.25, 0.25] and full.sum() == 1
    ids = torch.arange(12)
    assert torch.equal(target_to_draft(ids, None, 12), ids) and torch.equal(to_target_distribution(q, None, 3), q)


def test_peer_encoding_of_the_draft_vocabulary():
    d2t = d2t_offsets(VOCAB)
    assert d2t.tolist() == [2, 4, 7]
    assert (torch.arange(3) + d2t).tolist() == VOCAB.tolist()  # target id = draft index + d2t[index]
    t2d = t2d_mask(VOCAB, 12)
    assert t2d.dtype == torch.bool and t2d.nonzero().flatten().tolist() == [2, 5, 9]


ROPE_CASES = {  # rope_type -> the rope_parameters of a test (theta, factors small enough to bite at 4k)
    "default": {"rope_type": "default", "rope_theta": 10000.0},
    "linear": {"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0},
    "dynamic": {"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0},
    "llama3": {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 256},
    "yarn": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 1024,
             "beta_fast": 32.0, "beta_slow": 1.0},
}


@pytest.mark.parametrize("rope_type", sorted(ROPE_CASES))
def test_rope_table_equals_transformers_rotary_embedding(rope_type):
    """``rope_table`` (the runner's) and ``apply_rope`` (the drafters') rotate as transformers' own
    rotary module does, for every RoPE type, at positions up to 4k: the same cos and sin (yarn's
    attention scaling included), and x * cos + rotate_half(x) * sin."""
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

    hd, positions = 32, torch.arange(4096)
    config = LlamaConfig(hidden_size=128, num_attention_heads=4, head_dim=hd, max_position_embeddings=8192,
                         rope_parameters=dict(ROPE_CASES[rope_type]))
    spec = RopeSpec(hd, dict(config.rope_parameters), 8192)
    hf = LlamaRotaryEmbedding(config)
    x = torch.randn(1, 2, len(positions), hd, generator=torch.Generator().manual_seed(0))
    cos_hf, sin_hf = hf(x, positions[None])  # [1, T, hd]
    cos, sin = rope_table(len(positions), spec, torch.float32)
    assert torch.equal(cos, cos_hf[0]) and torch.equal(sin[:, hd // 2 :], sin_hf[0, :, hd // 2 :])
    assert torch.equal(sin[:, : hd // 2], -sin_hf[0, :, : hd // 2])  # sign-folded
    want, _ = apply_rotary_pos_emb(x, x, cos_hf, sin_hf)
    inv_freq, scaling = rope_frequencies(spec)
    assert scaling == hf.attention_scaling and torch.equal(inv_freq, hf.inv_freq)
    torch.testing.assert_close(apply_rope(x, positions, inv_freq, scaling), want, rtol=0, atol=1e-6)
    table = apply_rope_table(x[0].transpose(0, 1), cos[:, None], sin[:, None])  # [T, H, hd]
    torch.testing.assert_close(table.transpose(0, 1)[None], want, rtol=0, atol=1e-6)
    if rope_type != "default":  # the scaling matters at these positions: plain RoPE is another rotation
        plain, _ = rope_table(len(positions), RopeSpec.of(hd, ROPE_CASES[rope_type]["rope_theta"]), torch.float32)
        assert (plain - cos).abs().max() > 0.1 if rope_type != "dynamic" else torch.equal(plain, cos)


def test_rope_position_zero_is_the_identity():
    x = torch.randn(3, 6, 8)
    inv_freq, scaling = rope_frequencies(RopeSpec.of(8, 10000.0))
    torch.testing.assert_close(apply_rope(x, torch.zeros(6), inv_freq, scaling), x)


@pytest.mark.parametrize("parameters, match", [
    ({"rope_type": "longrope", "rope_theta": 1e4, "short_factor": [1.0] * 4, "long_factor": [1.0] * 4,
      "original_max_position_embeddings": 64}, "rope_type='longrope'"),
    ({"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.5}, "partial_rotary_factor=0.5"),
])
def test_rope_types_not_computed_are_refused(parameters, match):
    with pytest.raises(ValueError, match=match):
        rope_frequencies(RopeSpec(8, parameters, 128))


@pytest.mark.parametrize("rows", [0, 1, 3, 65])  # 0: a TTT step of an evaluation block with no rows left
def test_small_m_linear_is_linear(rows):
    torch.manual_seed(0)
    x, w, b = torch.randn(rows, 16), torch.randn(24, 16), torch.randn(24)
    with torch.no_grad():
        torch.testing.assert_close(small_m_linear(x, w, b), F.linear(x, w, b), rtol=1e-5, atol=1e-5)
        if rows > 1:
            assert torch.equal(weight_major_linear(w, x), (w @ x.T).T.contiguous())


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("rows", [1, 2, 3, 17])
def test_frozen_linear_is_linear_plus_residual(rows, dtype, tol):
    """Every kernel a row count can take (F.linear, our product on the stored weight, oneDNN on the
    prepacked copy) matches x @ Wᵀ, with and without the residual."""
    torch.manual_seed(0)
    x, w, residual = torch.randn(rows, 40, dtype=dtype), torch.randn(72, 40, dtype=dtype), torch.randn(rows, 72, dtype=dtype)
    linear = FrozenLinear(w)
    if dtype == torch.float32:  # bf16 packs only where the CPU has AVX-512 or AVX-NE-CONVERT
        assert (linear.packed is not None) == torch.backends.mkldnn.is_available()
    expected = x.float() @ w.float().T
    kernels = ["blas", *(["packed"] if linear.packed is not None else []),
               *(["native"] if dtype == torch.float32 and decode_cpu.available() else [])]
    for kernel in kernels:
        linear.kernels = [(rows, kernel)]
        assert linear.kernel(rows) == kernel and linear.kernel(rows + 1) == ("packed" if linear.packed is not None else "blas")
        torch.testing.assert_close(linear(x).float(), expected, rtol=tol, atol=tol * 10)
        torch.testing.assert_close(linear(x, residual=residual).float(), expected + residual.float(), rtol=tol, atol=tol * 10)


@pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="no oneDNN: F.linear is the only kernel")
@pytest.mark.parametrize("fast", ["blas", "packed", "native"])
def test_pick_kernels_takes_the_kernel_that_measured_fastest(monkeypatch, fast):
    """With the other kernels made slow, the fast one is picked at every row count it is timed at
    (F.linear only up to PICK_BLAS_ROWS), and set on every product of the chain."""
    import time

    if fast == "native" and not decode_cpu.available():
        pytest.skip(f"{decode_cpu.unavailable_reason()}")
    chain = [FrozenLinear(torch.randn(64, 32)), FrozenLinear(torch.randn(32, 64))]

    def delayed(fn):
        def run(*args, **kwargs):
            time.sleep(0.02)  # far above a busy machine's stalls: the tiny products take microseconds
            return fn(*args, **kwargs)
        return run

    slow = {"blas": (common.F, "linear"), "packed": (torch.ops.mkldnn, "_linear_pointwise"), "native": (decode_cpu, "linear")}
    for kernel, (owner, name) in slow.items():
        if kernel != fast:
            monkeypatch.setattr(owner, name, delayed(getattr(owner, name)))
    picked = pick_kernels(chain, rows=(1, 2, 4), repeats=2)
    timed = [r for r in (1, 2, 4) if fast != "blas" or r <= common.PICK_BLAS_ROWS]
    assert all(picked[r] == fast for r in timed), picked
    assert [lin.kernels for lin in chain] == [sorted(picked.items())] * 2
    assert chain[0].kernel(3) == picked[4] and chain[0].kernel(5) == "packed"  # the next timed count; past the last
    assert pick_kernels([FrozenLinear(torch.randn(8, 8, dtype=torch.bfloat16))]) == {}  # bf16: always oneDNN


def test_unimplemented_and_unknown_algorithms_name_the_implemented_ones():
    assert set(DRAFTERS) <= set(ALGORITHMS)
    for missing in sorted(set(ALGORITHMS) - set(DRAFTERS)):
        with pytest.raises(ValueError, match=rf"algorithm '{missing}' has no drafter implemented yet; implemented: \["):
            get_drafter(missing)
    with pytest.raises(ValueError, match=r"unknown algorithm 'medusa'; algorithms: \['eagle3', 'dflash'"):
        get_drafter("medusa")


@pytest.mark.parametrize("algorithm", sorted(DRAFTERS))
def test_every_registered_drafter_builds_from_its_section_and_its_debug_config(algorithm, debug_target):
    spec = DRAFTERS[algorithm]
    section = spec.section()  # every field has a default; the discriminator is the registry key
    assert section.algorithm == algorithm
    shared = dict(embed_tokens=debug_target.model.model.embed_tokens, lm_head=debug_target.model.lm_head)
    for config in (section.drafter_config(debug_target, (1, 3, 5)), spec.debug_config(debug_target)):
        assert isinstance(config, spec.config) and config.vocab_size == debug_target.vocab_size
        assert spec.config.from_dict(config.to_dict()) == config
        model = spec.model(config, **shared)
        assert model.algorithm == algorithm
        assert not any(p is debug_target.model.lm_head.weight for p in model.parameters())  # shared, not owned
    assert tuple(section.drafter_config(debug_target, (1, 3, 5)).target_layer_ids) == (1, 3, 5)
