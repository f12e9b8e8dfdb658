"""The speculators export (drafters/peer.py): the ``speculators`` package loads it and drafts the
same logits as our drafter on the same features and tokens; inexpressible drafters are refused.

The peer model runs its own forward (``DFlashDraftModel._backbone_forward`` with the anchors
fixed, ``Eagle3DraftModel.forward``'s training-time test) in eager attention on CPU.
"""

import json
from dataclasses import replace

import pytest
import torch
from peer_parity import (LAYER_IDS, TOLERANCE, ascending, build, features, fix_anchors, peer_export, peer_model,
                         randomise, save_export)
from safetensors.torch import load_file
from speculators.models.dflash import DFlashDraftModel
from speculators.models.eagle3 import Eagle3DraftModel

from specray.drafters import dflash, eagle3
from specray.drafters.format import InvalidDrafterError
from specray.drafters.peer import PeerFormatError, ascending_fc, peer_layer_ids, write_peer_export
from specray.pipeline.cli import main


def _dflash(target, **overrides):
    cfg = replace(dflash.debug_config(target, LAYER_IDS), **{"block_key_bias": 0.0, **overrides})
    return randomise(build(dflash.DFlashDrafter, cfg, target))


def _eagle3(target, **overrides):
    return randomise(build(eagle3.Eagle3Drafter, eagle3.debug_config(target, LAYER_IDS, **overrides), target))


def test_layer_ids_count_inputs_ascending_and_fc_follows():
    assert peer_layer_ids([8, 1, 14]) == [2, 9, 15]
    w = torch.cat([torch.full((2, 2), float(i)) for i in (8, 1, 14)], dim=1)  # [D=2, 3·D] blocks tagged by id
    assert torch.equal(ascending_fc(w, [8, 1, 14])[0], torch.tensor([1.0, 1, 8, 8, 14, 14]))


@pytest.mark.parametrize("vocab_size", [40, None], ids=["draft-vocab", "full-vocab"])
def test_dflash_speculators_parity(debug_target, tmp_path, monkeypatch, vocab_size):
    model = _dflash(debug_target, draft_vocab_size=vocab_size)
    out = peer_export(tmp_path, debug_target, model, vocab_size)
    peer = peer_model(DFlashDraftModel, out)

    S, B, anchors = 24, model.config.block_size, torch.tensor([3, 9, 15])
    hidden, ids, _ = features(debug_target, S)
    fix_anchors(monkeypatch, anchors)
    with torch.no_grad():
        ours = model(hidden, torch.ones(1, S, dtype=torch.bool), ids[:, anchors], anchors[None])  # [1, N, B-1, V_d]
        _, logits, *_ = peer._backbone_forward(
            ascending(hidden), ids, torch.ones(1, S), torch.randn(1, S, debug_target.hidden_size),
            torch.zeros(1, S, dtype=torch.long), max_anchors=len(anchors))  # logits [1, N·B, V_d]
    theirs = logits.view(1, len(anchors), B, -1)[:, :, 1:]  # the anchor row drafts nothing
    assert ours.shape == theirs.shape and ours.std() > 0.5
    assert (ours - theirs).abs().max() <= TOLERANCE


@pytest.mark.parametrize("vocab_size, norm_before_residual, num_layers", [(40, False, 1), (None, True, 2)],
                         ids=["draft-vocab", "full-vocab-nbr-2-layers"])
def test_eagle3_speculators_parity(debug_target, tmp_path, vocab_size, norm_before_residual, num_layers):
    model = _eagle3(debug_target, draft_vocab_size=vocab_size, norm_before_residual=norm_before_residual,
                    num_layers=num_layers)
    out = peer_export(tmp_path, debug_target, model, vocab_size)
    config = json.loads((out / "config.json").read_text())
    assert config["eagle_aux_hidden_state_layer_ids"] == [2, 4, 6]
    assert config["norm_before_residual"] is norm_before_residual
    tensors = load_file(out / "model.safetensors")  # the peer reads the target's embedding and head from here
    assert torch.equal(tensors["embed_tokens.weight"], debug_target.model.get_input_embeddings().weight)
    assert tensors["lm_head.weight"].shape[0] == (vocab_size or debug_target.vocab_size)
    peer = peer_model(Eagle3DraftModel, out)

    S, steps = 12, 3  # three TTT steps: the later ones are fed the drafter's own states
    hidden, ids, _ = features(debug_target, S)
    with torch.no_grad():
        ours = model(hidden, ids, torch.ones(steps, 1, S, dtype=torch.bool))  # per step [S, V_d]
        theirs = []  # per step [1, S, V_d]: the peer returns draft tokens; its LM head's outputs are the logits
        hook = peer.lm_head.register_forward_hook(lambda module, args, output: theirs.append(output))
        # row t of the peer pairs state t with token t (its data is shifted): ours reads x_{t+1} there
        peer(ascending(hidden), torch.cat([ids[:, 1:], ids.new_zeros(1, 1)], dim=1),
             torch.zeros(1, S, dtype=torch.long), ttt_steps=steps)
        hook.remove()
    assert len(theirs) == steps
    for step in range(steps):
        assert ours[step].std() > 0.5
        assert (ours[step] - theirs[step][0]).abs().max() <= TOLERANCE, step


def test_speculators_config_and_provenance(debug_target, tmp_path):
    model = _dflash(debug_target, draft_vocab_size=40)
    export = save_export(tmp_path, debug_target, model, 40)
    out = write_peer_export(export, tmp_path / "peer", target=debug_target,
                            verifier_name_or_path=str(debug_target.path))
    config = json.loads((out / "config.json").read_text())
    assert config["speculators_model_type"] == "dflash"
    assert config["aux_hidden_state_layer_ids"] == [2, 4, 6]
    assert config["block_size"] == 4 and config["draft_vocab_size"] == 40
    assert config["sliding_window_non_causal"] is True  # False makes every vLLM DFlash layer causal
    assert config["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == 3
    layer = config["transformer_layer_config"]
    for key in ("num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim", "intermediate_size",
                "rms_norm_eps", "rope_parameters", "max_position_embeddings", "vocab_size", "hidden_act", "model_type"):
        assert layer[key] is not None, key
    tensors = load_file(out / "model.safetensors")
    ids = model.draft_vocab
    assert torch.equal(tensors["d2t"] + torch.arange(40), ids)
    assert tensors["t2d"].dtype == torch.bool and torch.equal(tensors["t2d"].nonzero().flatten(), ids)
    assert torch.equal(tensors["lm_head.weight"], debug_target.model.get_output_embeddings().weight[ids])
    assert "embed_tokens.weight" not in tensors
    provenance = json.loads((out / "specray_export.json").read_text())
    source = json.loads((export / "export.json").read_text())
    assert provenance["source_export"]["weights_sha256"] == source["weights_sha256"]
    assert provenance["source_config"]["target_fingerprint"] == debug_target.target_fingerprint
    assert provenance["weights_sha256"].startswith("sha256:")


def test_refuses_block_key_bias(debug_target, tmp_path):
    model = _dflash(debug_target, block_key_bias=4.0)
    with pytest.raises(PeerFormatError, match=r"drafter\.block_key_bias.*block_key_bias=0"):
        peer_export(tmp_path, debug_target, model)
    assert not (tmp_path / "peer").exists()


def test_refuses_sliding_attention(debug_target, tmp_path):
    model = _dflash(debug_target, attention="sliding", sliding_window=8)
    with pytest.raises(PeerFormatError, match=r"drafter\.attention=sliding.*attention=full"):
        peer_export(tmp_path, debug_target, model)


def test_refuses_another_target(debug_target, tmp_path):
    export = save_export(tmp_path, debug_target, _dflash(debug_target))
    with pytest.raises(InvalidDrafterError, match="target_fingerprint"):
        write_peer_export(export, tmp_path / "peer", target="debug:1")


def test_cli_export_speculators(debug_target, tmp_path, capsys):
    export = save_export(tmp_path, debug_target, _dflash(debug_target))  # export.json names the target: debug
    assert main(["export", str(export), "--format", "speculators"]) == 0
    out = tmp_path / "export-speculators"
    assert json.loads((out / "config.json").read_text())["speculators_model_type"] == "dflash"
    biased = save_export(tmp_path / "biased", debug_target, _dflash(debug_target, block_key_bias=4.0))
    assert main(["export", str(biased), "--format", "speculators"]) == 2
    assert "drafter.block_key_bias" in capsys.readouterr().err


def test_speculators_config_carries_the_legacy_rope_keys(debug_target, tmp_path):
    """transformers 4.x (the vLLM versions most deployed) reads the top-level ``rope_theta`` only: without
    it, theta = 10000 and acceptance collapses without an error."""
    model = _dflash(debug_target, rope_theta=500000.0)
    out = write_peer_export(save_export(tmp_path, debug_target, model), tmp_path / "peer", target=debug_target)
    config = json.loads((out / "config.json").read_text())
    layer = config["transformer_layer_config"]
    assert layer["rope_theta"] == 500000.0 and layer["rope_parameters"] == {"rope_type": "default",
                                                                            "rope_theta": 500000.0}
    assert config["rope_theta"] == 500000.0  # and at the top level
    assert "rope_scaling" not in layer and "rope_scaling" not in config  # the default type has no scaling fields


def test_rope_fields_write_a_scaled_rope_in_both_encodings():
    from transformers import LlamaConfig

    from specray.drafters.peer import rope_fields

    llama3 = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
              "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
    for arch in ({"rope_parameters": llama3, "rope_theta": 500000.0},
                 {"rope_scaling": {k: v for k, v in llama3.items() if k != "rope_theta"}, "rope_theta": 500000.0}):
        fields = rope_fields(arch)
        assert fields["rope_parameters"] == llama3 and fields["rope_theta"] == 500000.0
        assert fields["rope_scaling"] == {k: v for k, v in llama3.items() if k != "rope_theta"}
        legacy = LlamaConfig(rope_theta=fields["rope_theta"], rope_scaling=fields["rope_scaling"],
                             max_position_embeddings=131072)  # how a legacy-keys reader builds it
        assert legacy.rope_parameters == llama3
        assert LlamaConfig(max_position_embeddings=131072, **fields).rope_parameters == llama3


def test_the_verifier_is_the_recorded_name_or_the_one_named(debug_target, tmp_path):
    export = save_export(tmp_path, debug_target, _dflash(debug_target))
    out = write_peer_export(export, tmp_path / "peer", target=debug_target)
    verifier = json.loads((out / "config.json").read_text())["speculators_config"]["verifier"]
    assert verifier["name_or_path"] == "debug"  # export.json's target, not the local cache directory
    assert verifier["architectures"] == ["LlamaForCausalLM"]
    named = write_peer_export(export, tmp_path / "named", target=debug_target, verifier_name_or_path="org/model")
    assert json.loads((named / "config.json").read_text())["speculators_config"]["verifier"]["name_or_path"] == \
        "org/model"
    assert "base_model: org/model" in (named / "README.md").read_text()
    assert all(p.stat().st_mode & 0o777 == 0o644 for p in named.iterdir())
