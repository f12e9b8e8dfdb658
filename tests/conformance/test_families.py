"""Family conformance: tiny random-weight targets of every family specray computes
(``families_kit.FAMILIES``: Llama with Llama 3.1 RoPE, Qwen2 with biases, Qwen3 with q/k norms,
Mistral, a tied-embedding Llama with biases and YaRN), each saved with ``save_pretrained`` and
loaded through ``load_target`` like any local target. For each family:

- the runner's logits equal transformers' within 1e-4 at positions up to 4k (fp32; chunked
  forwards over the cache, decode steps and a verify), on both runner paths (and on CUDA where
  there is one), and for every RoPE type on a Llama;
- every worker's greedy output (AR, each registered algorithm's chain worker with random and
  one-token debug drafters, the EAGLE-3 tree worker) equals transformers' greedy ``generate``,
  on prompts that include one of ~600 tokens;
- captured features equal transformers' ``output_hidden_states`` at the contract's layers;
- each algorithm trains two steps on features captured from the family, and its export loads
  back and serves transformers' greedy continuation;
- every speculators layout's parity (``test_conformance_export.PEER_PARITY``) holds on the family.

    pytest tests/conformance/test_families.py
"""

import json

import pytest
import torch
from conformance_kit import (MAX_NEW, PROMPTS, VOCAB_OF_KIND, build_drafter, export, frequent_tokens, hf_greedy,
                             train_manifest)
from families_kit import FAMILIES, build_family
from test_conformance_export import PEER_PARITY, _peer_drafter

from specray.capture.contract import CONTRACT_SPECS, build_contract
from specray.capture.data import ChatRenderer, Conversation
from specray.capture.server import CaptureServer
from specray.capture.store import FeatureStore
from specray.capture.target import load_target
from specray.drafters import DRAFTERS
from specray.drafters.format import load_drafter
from specray.drafters.peer import PEER_LAYOUTS, write_peer_export
from specray.kernels import decode_cpu
from specray.pipeline.config import CaptureJobConfig, TrainJobConfig, load_config
from specray.pipeline.jobs.capture import run_capture
from specray.pipeline.jobs.train import run_training
from specray.serving.engine import Engine
from specray.serving.requests import encode_prompt
from specray.serving.runner import LlamaRunner
from specray.serving.sampling import SamplingParams
from specray.trainer.export import export_checkpoint

TOLERANCE = 1e-4
LONG = 4096 + 8  # positions of the long check
FAMILY_PROMPTS = PROMPTS + ["A much longer prompt about rotary embeddings and positions. " * 10]  # ~600 tokens
ALGORITHMS = sorted(DRAFTERS)


@pytest.fixture(scope="session")
def family_targets(tmp_path_factory):
    """``family_targets(name)``: the family's tiny target, built and loaded once per session."""
    root, loaded = tmp_path_factory.mktemp("families"), {}

    def get(name: str):
        if name not in loaded:
            loaded[name] = load_target(str(build_family(name, root / name)))
        return loaded[name]

    return get


@pytest.fixture(scope="session")
def family_greedy(family_targets):
    """``family_greedy(name)``: {prompt ids: transformers' greedy continuation} over ``FAMILY_PROMPTS``."""
    cache = {}

    def get(name: str):
        if name not in cache:
            target = family_targets(name)
            prompts = [encode_prompt(target.tokenizer, p) for p in FAMILY_PROMPTS]
            cache[name] = {tuple(ids): hf_greedy(target, ids, MAX_NEW) for ids in prompts}
        return cache[name]

    return get


@pytest.fixture(params=sorted(FAMILIES))
def family(request) -> str:
    return request.param


def _native(flag: bool) -> bool:
    if flag and not decode_cpu.available():
        pytest.skip(f"fused CPU kernels unavailable: {decode_cpu.unavailable_reason()}")
    return flag


@pytest.mark.parametrize("native", [True, False], ids=["fused", "torch"])
def test_runner_logits_equal_transformers_up_to_4k_positions(family_targets, family, native):
    target = family_targets(family)
    ids = torch.randint(3, target.vocab_size, (LONG,), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        reference = target.model(input_ids=ids[None]).logits[0]  # [LONG, V]
    runner = LlamaRunner(target.model, num_slots=2, max_len=LONG, native=_native(native))
    slot = torch.tensor([1])
    rows = []
    for start, end in [(0, 1500), (1500, 3000), (3000, LONG - 8)]:  # forwards over the committed cache
        rows.append(runner.forward(ids[None, start:end], slot, torch.tensor([end - start])).logits[0])
        runner.cache.commit(1, end - start)
    for t in range(LONG - 8, LONG - 4):  # decode steps
        rows.append(runner.forward(ids[None, t : t + 1], slot, torch.tensor([1])).logits[0])
        runner.cache.commit(1, 1)
    rows.append(runner.forward(ids[None, LONG - 4 :], slot, torch.tensor([4])).logits[0])  # a 4-row verify
    logits = torch.cat(rows)
    assert logits.shape == reference.shape and reference.std() > 0.5
    assert (logits - reference).abs().max() <= TOLERANCE


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_runner_logits_equal_transformers_on_cuda(family_targets, family):
    """The runner's plain-torch path on CUDA (the fused kernels are CPU-only), each family's biases,
    norms and RoPE, at positions up to 4k."""
    target = load_target(str(family_targets(family).path), device="cuda")
    ids = torch.randint(3, target.vocab_size, (LONG,), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        reference = target.model(input_ids=ids[None].cuda()).logits[0]
    runner = LlamaRunner(target.model, num_slots=1, max_len=LONG)
    assert not runner.native and runner.cache.k.is_cuda
    first = runner.forward(ids[None, : LONG - 4], torch.tensor([0]), torch.tensor([LONG - 4])).logits[0]
    runner.cache.commit(0, LONG - 4)
    rest = runner.forward(ids[None, LONG - 4 :], torch.tensor([0]), torch.tensor([4])).logits[0]
    torch.testing.assert_close(torch.cat([first, rest]), reference, atol=1e-4, rtol=1e-4)


ROPE_VARIANTS = {  # Llama targets of every RoPE type the runner computes (max_position_embeddings 1024)
    "linear": {"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0},
    "dynamic": {"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0},
    "yarn-mscale": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 8.0, "original_max_position_embeddings": 128,
                    "mscale": 2.0, "mscale_all_dim": 1.0, "beta_fast": 16.0},
    "yarn-attention-factor": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 2.0, "attention_factor": 0.8,
                              "original_max_position_embeddings": 512},
}


@pytest.mark.parametrize("variant", sorted(ROPE_VARIANTS))
def test_runner_logits_equal_transformers_for_every_rope_type(variant, tmp_path):
    """Every RoPE type at positions up to max_position_embeddings (dynamic NTK's whole exact range),
    attention scaling that multiplies cos and sin included."""
    from transformers import LlamaConfig

    from specray.capture.target import build_debug_tokenizer

    config = LlamaConfig(vocab_size=len(build_debug_tokenizer()), hidden_size=64, intermediate_size=128,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                         rope_parameters=dict(ROPE_VARIANTS[variant]))
    target = load_target(str(build_family(variant, tmp_path / variant, config=config)))
    ids = torch.randint(3, target.vocab_size, (1024,), generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        reference = target.model(input_ids=ids[None]).logits[0]
    for native in ([True, False] if decode_cpu.available() else [False]):
        runner = LlamaRunner(target.model, num_slots=1, max_len=1024, native=native)
        first = runner.forward(ids[None, :1000], torch.tensor([0]), torch.tensor([1000])).logits[0]
        runner.cache.commit(0, 1000)
        rest = runner.forward(ids[None, 1000:], torch.tensor([0]), torch.tensor([24])).logits[0]
        assert (torch.cat([first, rest]) - reference).abs().max() <= TOLERANCE, native
    if variant == "dynamic":  # past max_position_embeddings transformers recomputes the frequencies: refused
        with pytest.raises(ValueError, match=r"rope_type='dynamic'.*max_position_embeddings=1024"):
            LlamaRunner(target.model, num_slots=1, max_len=1025)


def test_runner_refuses_a_sliding_window_shorter_than_max_len(tmp_path):
    from transformers import MistralConfig

    from specray.capture.target import build_debug_tokenizer

    config = MistralConfig(vocab_size=len(build_debug_tokenizer()), hidden_size=64, intermediate_size=128,
                           num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, sliding_window=256)
    target = load_target(str(build_family("mistral-window", tmp_path / "m", config=config)))
    with pytest.raises(ValueError, match=r"sliding_window=256.*max_len 1024"):
        Engine(target, max_batch=1, max_len=1024)
    engine = Engine(target, max_batch=1, max_len=256)  # no sequence reaches past the window: exact
    ids = encode_prompt(target.tokenizer, "Hi")
    assert engine.generate([ids], SamplingParams(max_tokens=8))[0].token_ids == hf_greedy(target, ids, 8)


def _check_greedy(engine, greedy: dict) -> list[int]:
    outputs = engine.generate(FAMILY_PROMPTS, SamplingParams(max_tokens=MAX_NEW))
    for prompt, out in zip(FAMILY_PROMPTS, outputs):
        assert out.token_ids == greedy[tuple(out.prompt_ids)], prompt[:40]
    return [n for out in outputs for n in out.emitted_per_round]


def test_ar_greedy_equals_transformers_generate(family_targets, family_greedy, family):
    engine = Engine(family_targets(family), max_batch=len(FAMILY_PROMPTS), max_len=1024)
    _check_greedy(engine, family_greedy(family))


WORKER_CASES = [(algorithm, kind, False) for algorithm in ALGORITHMS for kind in ("random", "one_token")] + [
    ("eagle3", "random", True), ("eagle3", "eight_token", True)]  # the tree's width (4) needs >= 4 draft tokens


@pytest.mark.parametrize("algorithm, kind, tree", WORKER_CASES,
                         ids=[f"{a}-{k}{'-tree' if t else ''}" for a, k, t in WORKER_CASES])
def test_worker_greedy_equals_transformers_generate(family_targets, family_greedy, family, algorithm, kind, tree,
                                                    tmp_path, monkeypatch):
    monkeypatch.setitem(VOCAB_OF_KIND, "eight_token", 8)
    target, greedy = family_targets(family), family_greedy(family)
    drafter = build_drafter(algorithm, target, kind, frequent=frequent_tokens(greedy.values()))
    engine = Engine(target, export(drafter, target, tmp_path / "export"), max_batch=len(FAMILY_PROMPTS),
                    max_len=1024, speculation="static", tree=tree)
    emitted = _check_greedy(engine, greedy)
    assert any(n == 1 for n in emitted)  # rounds that rejected their first draft
    if kind != "random":
        assert any(n > 1 for n in emitted), emitted  # and rounds that accepted drafts


CONVERSATIONS = [
    Conversation("a", (("user", "Hi"), ("assistant", "Hello! How can I help?"))),
    Conversation("b", (("user", "Name three colours."), ("assistant", "Red, green and blue."), ("user", "More"),
                       ("assistant", "Cyan."))),
    Conversation("c", (("user", "Tell me about positions. " * 12), ("assistant", "They rotate."))),
]


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_captured_features_equal_transformers_hidden_states(family_targets, family, algorithm, tmp_path):
    target = family_targets(family)
    contract = build_contract(algorithm, target_fingerprint=target.target_fingerprint,
                              template_fingerprint=target.template_fingerprint, num_target_layers=target.num_layers,
                              hidden_size=target.hidden_size, dtype="float32")
    server = CaptureServer(target, contract, FeatureStore(tmp_path.as_uri()))
    samples = [ChatRenderer(target.tokenizer, max_length=1024).render(c) for c in CONVERSATIONS]
    for sample, features in zip(samples, server.extract(samples)):  # one padded batch of three lengths
        with torch.inference_mode():
            hs = target.model(input_ids=sample.input_ids[None], output_hidden_states=True).hidden_states
        expected = torch.cat([hs[i + 1][0] for i in contract.layer_ids], dim=-1)  # decoder-layer outputs
        # fp32 through 8 layers, features up to ~20: a padded batch and a lone sequence take other BLAS
        # blockings and differ by up to ~2e-5 on some CPUs; a dropped bias or norm weight is off by O(1).
        torch.testing.assert_close(features["hidden_states"], expected, atol=1e-4, rtol=1e-5)
        if contract.last_hidden:
            torch.testing.assert_close(features["last_hidden_states"], hs[-1][0], atol=1e-4, rtol=1e-5)
    server.close()


TRAIN_OVERRIDES = {"dflash": ["objective.num_anchors=4"], "dspark": ["objective.num_anchors=4", "drafter.markov_rank=16"],
                   "dflash2": ["objective.num_anchors=4", "drafter.selector_rank=16"],
                   "eagle3": ["drafter.draft_vocab_size=128"]}


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_training_step_and_export_round_trip(family_targets, family_greedy, family, algorithm, tmp_path):
    """Capture from the family, two optimizer steps, export, load the export back and serve greedy
    decoding with it: transformers' continuation. The drafter records the target's RoPE."""
    target = family_targets(family)
    capture = load_config(CaptureJobConfig, "manifests/capture-quickstart.yaml", [
        f"name=cap-{algorithm}", f"target.name={target.path}", f"capture.algorithm={algorithm}",
        "capture.dtype=float32", f"output.run_dir={tmp_path / 'capture'}", "data.max_samples=6", "data.max_length=192"])
    run_capture(capture, progress=False)
    train = load_config(TrainJobConfig, train_manifest(algorithm), [
        f"target.name={target.path}", f"data.manifest={tmp_path / 'capture' / 'manifest.parquet'}",
        f"output.run_dir={tmp_path / 'train'}", "optim.total_steps=2", "optim.warmup_steps=1", "trainer.log_every=1",
        "trainer.checkpoint_every=2", "live_eval.enabled=false", *TRAIN_OVERRIDES[algorithm]])
    run_training(train, progress=False)
    records = [json.loads(line) for line in (tmp_path / "train" / "metrics.jsonl").read_text().splitlines()]
    assert len(records) == 2 and all(torch.isfinite(torch.tensor(r["loss"])) for r in records)
    out = export_checkpoint(tmp_path / "train", tmp_path / "export")
    drafter = load_drafter(out, embed_tokens=target.model.get_input_embeddings(),
                           lm_head=target.model.get_output_embeddings(), target_fingerprint=target.target_fingerprint,
                           template_fingerprint=target.template_fingerprint)
    rope = target.model.config.rope_parameters
    assert drafter.config.rope_theta == rope["rope_theta"]
    assert drafter.config.rope_scaling == (None if rope["rope_type"] == "default"
                                           else {k: v for k, v in rope.items() if k != "rope_theta"})
    engine = Engine(target, str(out), max_batch=2, max_len=1024, speculation="static")
    prompts = FAMILY_PROMPTS[:2]
    outputs = engine.generate(prompts, SamplingParams(max_tokens=MAX_NEW))
    greedy = family_greedy(family)
    assert [o.token_ids for o in outputs] == [greedy[tuple(o.prompt_ids)] for o in outputs]


@pytest.mark.parametrize("algorithm", sorted(PEER_LAYOUTS))
def test_speculators_parity(family_targets, family, algorithm, tmp_path, monkeypatch):
    """The speculators model loaded from the peer export computes our logits on the same features:
    its decoder layers rotate by the RoPE the export's ``transformer_layer_config`` carries (the target's)."""
    target = family_targets(family)
    case = PEER_PARITY[algorithm]
    model = _peer_drafter(algorithm, target, case.expressible, None)
    out = write_peer_export(export(model, target, tmp_path / "export"), tmp_path / "peer", target=target)
    layer = json.loads((out / "config.json").read_text())["transformer_layer_config"]
    assert layer["rope_parameters"] == {"rope_theta": model.config.rope_theta,
                                        **(model.config.rope_scaling or {"rope_type": "default"})}
    with torch.no_grad():
        ours, theirs = case.logits(model, out, target, monkeypatch)
    assert ours.shape == theirs.shape and ours.std() > 0.5
    assert (ours - theirs).abs().max() <= TOLERANCE


def test_every_contract_has_distinct_layers_on_the_families(family_targets, family):
    """The families are deep enough for every algorithm's default layer ids (the suite relies on it)."""
    target = family_targets(family)
    for algorithm, spec in CONTRACT_SPECS.items():
        ids = spec.default_layer_ids(target.num_layers)
        assert len(set(ids)) == len(ids), (algorithm, ids)
