"""The SGLang export format (drafters/sglang.py).

- DFlash family, z-lab's format: the ``dflash`` package (0.1.0, z-lab's own model code) loads the
  export with ``from_pretrained`` and drafts our logits on the same features and tokens (max
  |Δ| <= 1e-4): DFlash's block logits, DFlash 2's unary logits and its selector's greedy path,
  DSpark's backbone (its heads are SGLang's, checked by name and config below).
- EAGLE-3 as ``LlamaForCausalLMEagle3``: SpecForge 0.2.0's ``LlamaForCausalLMEagle3`` (the layout
  SpecForge exports for SGLang) loads the export's tensors by name and computes our logits at every
  training-time-test step, run as SpecForge's trainer runs it (``backbone`` with its hidden cache).
  SGLang 0.5.23 does not import without CUDA, so the test also states its loader's rules
  (``sglang/srt/models/llama_eagle3.py::load_weights``, read from its source) and applies them to
  the export: every tensor lands on a parameter SGLang builds from the config (it skips unknown
  names silently), every parameter it needs is written, ``d2t`` gives the draft vocabulary
  (``hot_token_id = d2t + arange``), the aux layer ids are decoder-layer outputs, ascending, with
  fc.weight's input blocks in that order. tests/drafters/test_sglang_peer.py is the check on a GPU
  with SGLang installed.
"""

import json
import re
import warnings
from dataclasses import replace

import pytest
import torch
from dflash import DFlash2DraftModel, DFlashDraftModel
from peer_parity import LAYER_IDS, TOLERANCE, ascending, build, by_name, features, random_vocab, randomise, save_export
from safetensors.torch import load_file
from transformers import LlamaConfig

from specray.drafters import DRAFTERS
from specray.drafters.peer import PeerFormatError
from specray.drafters.sglang import write_sglang_export
from specray.kernels.selector_walk import selector_walk_reference

with warnings.catch_warnings():  # "flash_attn is not found, falling back to flex_attention": not used here
    warnings.simplefilter("ignore", UserWarning)
    from specforge.modeling.draft.llama3_eagle import LlamaForCausalLMEagle3


def _drafter(target, algorithm, layer_ids=LAYER_IDS, **overrides):
    """A drafter (LAYER_IDS are not ascending on purpose: both peers concatenate the captured layers
    ascending), its logits spread over several units (a 1e-4 match means something): norms around 1,
    the rest around 0, ``block_key_bias`` kept."""
    spec = DRAFTERS[algorithm]
    model = build(spec.model, replace(spec.debug_config(target, layer_ids), **overrides), target)
    return randomise(model, by_name(0.2, keep=("block_key_bias",)))


def _sglang(tmp_path, target, model, **kwargs):
    return write_sglang_export(save_export(tmp_path, target, model), tmp_path / "sglang", target=target, **kwargs)


def _inputs(target, S=24):
    """Features in our (contract) order and in the peers' (ascending layers), tokens [1, S]."""
    hidden, ids, _ = features(target, S)
    return hidden, ascending(hidden), ids


def _zlab_block(peer, target, ascending, ids, anchor: int, block_size: int, mask_token_id: int):
    """z-lab's draft forward for the block anchored at ``anchor`` (as its dflash_generate runs it):
    the context strictly before the anchor, the block [a, MASK × (B − 1)], positions 0 … a + B − 1."""
    block = torch.full((1, block_size), mask_token_id)
    block[0, 0] = ids[0, anchor]
    return peer(target_hidden=ascending[:, :anchor], noise_embedding=target.model.get_input_embeddings()(block),
                position_ids=torch.arange(anchor + block_size)[None])  # [1, B, D]


ANCHORS = (3, 9, 15)


def test_dflash_export_loads_in_zlab_dflash_with_our_logits(debug_target, tmp_path):
    model = _drafter(debug_target, "dflash")
    out = _sglang(tmp_path, debug_target, model)
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["DFlashDraftModel"] and config["model_type"] == "qwen3"
    assert config["dflash_config"] == {"target_layer_ids": [1, 3, 5], "mask_token_id": model.config.mask_token_id,
                                       "block_size": 4, "num_target_layers": 8}
    assert config["layer_types"] == ["full_attention"]
    peer = DFlashDraftModel.from_pretrained(out).eval()
    assert peer.target_layer_ids == [1, 3, 5] and peer.block_size == 4
    hidden, ascending, ids = _inputs(debug_target)
    S, B, anchors = hidden.shape[1], model.config.block_size, torch.tensor(ANCHORS)
    with torch.no_grad():
        ours = model(hidden, torch.ones(1, S, dtype=torch.bool), ids[:, anchors], anchors[None])  # [1, N, B-1, V]
        for n, a in enumerate(ANCHORS):
            h = _zlab_block(peer, debug_target, ascending, ids, a, B, peer.mask_token_id)
            theirs = peer.compute_logits(h, debug_target.model.get_output_embeddings())[:, 1:]  # the anchor row drafts nothing
            assert ours[:, n].std() > 0.5
            assert (ours[:, n] - theirs).abs().max() <= TOLERANCE, a


def test_dflash2_export_loads_in_zlab_dflash2_with_our_logits_and_path(debug_target, tmp_path):
    model = _drafter(debug_target, "dflash2")
    out = _sglang(tmp_path, debug_target, model)
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["DFlash2DraftModel"]
    draft = config["dflash_config"]
    assert (draft["conv_kernel_size"], draft["conv_group_size"], draft["selector_rank"], draft["selector_top_k"]) == \
        (model.config.conv_kernel_size, model.config.conv_group_size, 8, 4)
    peer = DFlash2DraftModel.from_pretrained(out).eval()
    head = debug_target.model.get_output_embeddings()
    hidden, ascending, ids = _inputs(debug_target)
    S, B, anchors = hidden.shape[1], model.config.block_size, torch.tensor(ANCHORS)
    with torch.no_grad():
        block = model.block_hidden(hidden, torch.ones(1, S, dtype=torch.bool), ids[:, anchors], anchors[None])[:, :, 1:]
        unary = model.logits(block)  # [1, N, m, V]
        _, cand_ids, lattice = model.lattice(unary, block, ids[:, anchors])
        path, _ = selector_walk_reference(lattice[0].float(), torch.zeros(len(ANCHORS)),
                                          torch.zeros(len(ANCHORS), B - 1))
        ours_path = cand_ids[0].gather(-1, path[..., None])[..., 0]  # [N, m] target ids
        for n, a in enumerate(ANCHORS):
            h = _zlab_block(peer, debug_target, ascending, ids, a, B, peer.mask_token_id)[:, 1:]
            theirs = peer.compute_logits(h, head)
            assert unary[:, n].std() > 0.5 and (unary[:, n] - theirs).abs().max() <= TOLERANCE, a
            their_path, _, _ = peer.propose(h, ids[:, a], head, temperature=0.0)
            assert torch.equal(their_path[0], ours_path[n]), a


def test_dspark_export_zlab_backbone_and_sglang_head_fields(debug_target, tmp_path):
    model = _drafter(debug_target, "dspark", markov_head_type="rnn", markov_rank=8)
    out = _sglang(tmp_path, debug_target, model)
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["DSparkDraftModel"]
    for where in (config, config["dflash_config"]):  # SGLang's head builder reads the top level, its parser both
        assert (where["markov_rank"], where["markov_head_type"], where["confidence_head_with_markov"],
                where["enable_confidence_head"], where["sample_from_anchor"]) == (8, "rnn", True, True, True)
    assert config["dflash_config"]["block_size"] == model.config.block_size  # SGLang's gamma: B drafts per round
    tensors, state = load_file(out / "model.safetensors"), model.state_dict()
    for name in ("markov_head.markov_w1.weight", "markov_head.markov_w2.weight", "markov_head.joint_proj.weight",
                 "markov_head.joint_proj.bias", "confidence_head.proj.weight", "confidence_head.proj.bias"):
        assert torch.equal(tensors[name], state[name]), name  # SGLang's DSpark parameter names
    peer = DFlashDraftModel.from_pretrained(out).eval()  # the backbone, in z-lab's DFlash (heads skipped)
    hidden, ascending, ids = _inputs(debug_target)
    S, B, anchors = hidden.shape[1], model.config.block_size, torch.tensor(ANCHORS)
    with torch.no_grad():
        ours = model.block_hidden(hidden, torch.ones(1, S, dtype=torch.bool), ids[:, anchors], anchors[None])
        for n, a in enumerate(ANCHORS):  # every row drafts in DSpark: all B rows
            theirs = _zlab_block(peer, debug_target, ascending, ids, a, B, peer.mask_token_id)
            assert (ours[:, n] - theirs).abs().max() <= TOLERANCE, a


@pytest.mark.parametrize("algorithm, overrides, field", [
    ("dflash", {"block_key_bias": 2.0}, "drafter.block_key_bias"),
    ("dflash", {"attention": "sliding", "sliding_window": 8}, "drafter.attention=sliding"),
    ("dspark", {"draft_vocab_size": 40}, "drafter.draft_vocab_size"),
    ("dflash2", {"draft_vocab_size": 40}, "drafter.draft_vocab_size"),
    ("eagle3", {"norm_before_residual": True}, "drafter.norm_before_residual"),
])
def test_what_sglang_cannot_express_is_refused(debug_target, tmp_path, algorithm, overrides, field):
    model = _drafter(debug_target, algorithm, **overrides)
    if overrides.get("draft_vocab_size"):
        model.set_draft_vocab(torch.arange(40))
    with pytest.raises(PeerFormatError, match=re.escape(field)):
        _sglang(tmp_path, debug_target, model)
    assert not (tmp_path / "sglang").exists()


def test_eagle3_export_loads_in_specforge_with_our_logits(debug_target, tmp_path):
    model = _drafter(debug_target, "eagle3", draft_vocab_size=40)
    model.set_draft_vocab(random_vocab(debug_target, 40))
    out = _sglang(tmp_path, debug_target, model)
    # SpecForge's loader (export/checkpoint_io.py materialize_draft): load_state_dict, the embedding left out
    peer = LlamaForCausalLMEagle3(LlamaConfig.from_pretrained(out)).eval()
    missing, unexpected = peer.load_state_dict(load_file(out / "model.safetensors"), strict=False)
    assert (missing, unexpected) == (["embed_tokens.weight"], [])
    hidden, ascending, ids = _inputs(debug_target, S=12)
    S, steps = 12, 3
    with torch.no_grad():
        ours = model(hidden, ids, torch.ones(steps, 1, S, dtype=torch.bool))  # per step [S, V_d]
        state = peer.project_hidden_states(ascending)
        mask = peer.prepare_decoder_attention_mask(attention_mask=torch.ones(1, S, dtype=torch.bool),
                                                   hidden_states=state, batch_size=1, seq_length=S,
                                                   past_key_values_length=0)
        cache, tokens = [[], []], torch.cat([ids[:, 1:], ids.new_zeros(1, 1)], dim=1)  # row t: state t, token t + 1
        for step in range(steps):  # SpecForge's TTT loop (algorithms/eagle3/model.py)
            embeds = debug_target.model.get_input_embeddings()(tokens)
            state = peer.backbone(input_embeds=embeds, hidden_states=state, cache_hidden=cache, attention_mask=mask,
                                  position_ids=torch.arange(S)[None], use_cache=True)
            theirs = peer.compute_logits(state)[0]
            assert ours[step].std() > 0.5 and (ours[step] - theirs).abs().max() <= TOLERANCE, step
            tokens = torch.cat([tokens[:, 1:], tokens.new_zeros(1, 1)], dim=1)


# -- EAGLE-3: SGLang's loader rules (sglang/srt/models/llama_eagle3.py, 0.5.23) ----------------------


def sglang_eagle3_parameters(config: dict) -> set[str]:
    """The parameters ``LlamaForCausalLMEagle3(config)`` builds (its ``named_parameters``): the draft
    layers with fused qkv / gate_up projections, fc, norm, the embedding (shared from the target
    at run time, never loaded) and, without tied embeddings, an lm_head of draft_vocab_size rows."""
    names = {"model.embed_tokens.weight", "model.fc.weight", "model.norm.weight", "lm_head.weight"}
    for i in range(config["num_hidden_layers"]):
        names |= {f"model.layers.{i}.{n}" for n in (
            "self_attn.qkv_proj.weight", "self_attn.o_proj.weight", "mlp.gate_up_proj.weight", "mlp.down_proj.weight",
            "input_layernorm.weight", "post_attention_layernorm.weight", "hidden_norm.weight")}
    return names


def sglang_eagle3_load(names: list[str], params: set[str]) -> dict[str, str]:
    """``load_weights``' name resolution: legacy ``midlayer`` -> ``layers.0``; ``d2t`` / ``t2d`` taken
    as buffers; q/k/v -> qkv_proj and gate/up -> gate_up_proj; a name not in ``params`` gets the
    ``model.`` prefix; a name that still matches nothing is skipped silently (returned as None)."""
    stacked = [(".qkv_proj", ".q_proj"), (".qkv_proj", ".k_proj"), (".qkv_proj", ".v_proj"),
               (".gate_up_proj", ".gate_proj"), (".gate_up_proj", ".up_proj")]
    resolved = {}
    for name in names:
        original = name
        name = name.replace("midlayer", "layers.0")
        if "d2t" in name or "t2d" in name:
            resolved[original] = "<buffer>"
            continue
        for param_name, weight_name in stacked:
            if weight_name in name:
                name = name.replace(weight_name, param_name)
                break
        name = name if name in params else f"model.{name}"
        resolved[original] = name if name in params else None
    return resolved


@pytest.mark.parametrize("vocab_size, num_layers", [(40, 1), (None, 2)], ids=["draft-vocab", "full-vocab-2-layers"])
def test_eagle3_export_follows_sglangs_loader(debug_target, tmp_path, vocab_size, num_layers):
    model = _drafter(debug_target, "eagle3", draft_vocab_size=vocab_size, num_layers=num_layers)
    vocab = random_vocab(debug_target, vocab_size or 0)
    if vocab_size:
        model.set_draft_vocab(vocab)
    out = _sglang(tmp_path, debug_target, model, verifier_name_or_path="org/target")
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLMEagle3"] and config["model_type"] == "llama"
    assert config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [1, 3, 5]  # outputs: SGLang captures i + 1
    assert config["num_hidden_layers"] == num_layers and config["tie_word_embeddings"] is False
    assert config["draft_vocab_size"] == (vocab_size or debug_target.vocab_size)
    assert config["target_hidden_size"] == debug_target.hidden_size and "norm_output" not in config
    assert config["rope_theta"] == model.config.rope_theta  # the legacy key SGLang's rope config reads first
    tensors = load_file(out / "model.safetensors")
    resolved = sglang_eagle3_load(list(tensors), sglang_eagle3_parameters(config))
    assert None not in resolved.values(), {k: v for k, v in resolved.items() if v is None}  # nothing skipped
    loaded = set(resolved.values()) - {"<buffer>"}
    unused = {f"model.layers.{i}.input_layernorm.weight" for i in range(1, num_layers)}  # later layers use hidden_norm
    assert sglang_eagle3_parameters(config) - loaded == {"model.embed_tokens.weight"} | unused
    state = model.state_dict()
    assert torch.equal(tensors["midlayer.self_attn.q_proj.weight"], state["layers.0.self_attn.q_proj.weight"])
    if num_layers > 1:
        assert torch.equal(tensors["layers.1.hidden_norm.weight"], state["layers.1.input_layernorm.weight"])
    blocks = state["fc.weight"].chunk(3, dim=1)  # contract order 5, 1, 3 -> ascending 1, 3, 5
    assert torch.equal(tensors["fc.weight"], torch.cat([blocks[1], blocks[2], blocks[0]], dim=1))
    hot = tensors["d2t"] + torch.arange(len(tensors["d2t"]))  # SGLang's hot_token_id: draft index -> target id
    ids = model.draft_vocab if vocab_size else torch.arange(debug_target.vocab_size)
    assert torch.equal(hot, ids) and torch.equal(tensors["t2d"].nonzero().flatten(), ids)
    assert torch.equal(tensors["lm_head.weight"], debug_target.model.get_output_embeddings().weight[ids])
    assert "embed_tokens.weight" not in tensors  # shared from the target (set_embed)
    card = (out / "README.md").read_text()
    assert "--speculative-algorithm EAGLE3" in card and "--model-path org/target" in card


def test_cli_export_sglang_names_the_verifier(debug_target, tmp_path, capsys):
    from specray.pipeline.cli import main

    export = save_export(tmp_path, debug_target, _drafter(debug_target, "dflash"))
    assert main(["export", str(export), "--format", "sglang", "--verifier", "Qwen/Qwen3-8B"]) == 0
    out = tmp_path / "export-sglang"
    assert json.loads((out / "config.json").read_text())["architectures"] == ["DFlashDraftModel"]
    record = json.loads((out / "specray_export.json").read_text())
    assert record["verifier"] == "Qwen/Qwen3-8B" and record["source_config"]["algorithm"] == "dflash"
    printed = capsys.readouterr().out
    assert "--model-path Qwen/Qwen3-8B --speculative-algorithm DFLASH" in printed
    assert "base_model: Qwen/Qwen3-8B" in (out / "README.md").read_text()
    assert main(["export", str(export), "--verifier", "x/y"]) == 2  # our format names no verifier
    assert "--verifier" in capsys.readouterr().err


def test_a_calibrated_dspark_export_carries_sglangs_sts_file_per_mode(debug_target, tmp_path):
    """One ``DSparkStsCalibration`` file per serving mode, each with the mode it was fitted for and its ECE
    per position; the serve commands name each with the requests it fits (SGLang reads one table)."""
    from specray.drafters.dspark import write_calibration

    model = _drafter(debug_target, "dspark")
    export = save_export(tmp_path, debug_target, model)
    tables = {"greedy": [0.1, 0.2, 0.3, 0.4], "sampling": [1.5, 0.8, 1.2, 2.0]}
    ece = {"greedy": ([0.9] * 4, [0.01] * 4), "sampling": ([0.2] * 4, [0.05] * 4)}
    write_calibration(export, tables, {"manifest": "heldout.parquet", "blocks": 64, "modes": {
        mode: {"ece_by_pos_before": before, "ece_by_pos_after": after} for mode, (before, after) in ece.items()}})
    out = write_sglang_export(export, tmp_path / "sglang", target=debug_target)
    record = json.loads((out / "specray_export.json").read_text())
    assert not (out / "sts_calibration.json").exists()  # no file that names no mode
    for mode, use, command in (("greedy", "greedy requests", record["serve_commands"][0]),
                               ("sampling", "sampled requests", record["serve_commands"][1])):
        sts = json.loads((out / f"sts_calibration.{mode}.json").read_text())
        assert sts == {"temperatures": tables[mode], "dataset": "heldout.parquet", "num_samples": 64, "mode": mode,
                       "use_for": sts["use_for"], "ece_before": ece[mode][0], "ece_after": ece[mode][1]}
        assert sts["use_for"].startswith(use)
        assert f"--speculative-dspark-confidence-sts-path sglang/sts_calibration.{mode}.json    # {use}" in command
    assert len(record["serve_commands"]) == 2
    uncalibrated = write_sglang_export(save_export(tmp_path, debug_target, model, name="plain"),
                                       tmp_path / "plain-sglang", target=debug_target)
    assert not list(uncalibrated.glob("sts_calibration*"))
    assert "sts-path" not in json.loads((uncalibrated / "specray_export.json").read_text())["serve_commands"][0]
