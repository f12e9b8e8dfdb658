"""Importing peer drafters (drafters/peer_import.py): directories the peer packages write themselves
(speculators' ``from_training_args`` + ``save_pretrained``, z-lab dflash's and SpecForge's
``save_pretrained``) import into our format, draft what the peer model drafts, and export back in
the peer's format with the same tensors; our DFlash, DSpark and DFlash 2 exports go through
``specray export --format sglang`` (z-lab's format) and ``specray import`` back to the same tensors
and architecture; what we cannot compute is refused by name, before anything is loaded; a
checkpoint of another target is refused.
"""

import json
import warnings

import pytest
import torch
from dflash import DFlash2DraftModel, DFlashDraftModel
from peer_parity import (LAYER_IDS, TOLERANCE, ascending, build, by_name, features, fix_anchors, peer_model,
                         randomise, save_export)
from safetensors.torch import load_file, save_file
from speculators.models.dflash import DFlashDraftModel as SpeculatorsDFlash
from speculators.models.eagle3 import Eagle3DraftModel
from speculators.train.cli import create_transformer_layer_config
from transformers import LlamaConfig, Qwen3Config

from specray.drafters import DRAFTERS
from specray.drafters.format import load_drafter, read_drafter_config
from specray.drafters.peer import PeerFormatError, write_peer_export
from specray.drafters.peer_import import as_export, import_peer, is_peer_directory, peer_summary
from specray.drafters.sglang import write_sglang_export
from specray.pipeline.cli import main

with warnings.catch_warnings():  # "flash_attn is not found": SpecForge's training kernels, not used here
    warnings.simplefilter("ignore", UserWarning)
    from specforge.modeling.draft.llama3_eagle import LlamaForCausalLMEagle3

VOCAB = torch.arange(0, 259, 2)  # a draft vocabulary of 130 of the debug target's 259 ids


def _randomise(model):
    """Norms around 1, the rest around 0 (std 0.2), seed 0; the embedding, LM head and verifier kept."""
    return randomise(model, by_name(0.2, keep=("embed", "lm_head", "verifier")))


def _vocab_maps(vocab):
    t2d = torch.zeros(259, dtype=torch.bool)
    t2d[vocab] = True
    return t2d, vocab - torch.arange(len(vocab))


def _same_tensors(a, b, renamed=()):
    ta, tb = load_file(a / "model.safetensors"), load_file(b / "model.safetensors")
    for old, new in renamed:
        ta = {k.replace(old, new): v for k, v in ta.items()}
    assert ta.keys() == tb.keys(), (sorted(set(ta) ^ set(tb)))
    for k in ta:
        assert ta[k].dtype == tb[k].dtype and torch.equal(ta[k], tb[k]), k


def _load(export, target):
    return load_drafter(export, embed_tokens=target.model.get_input_embeddings(),
                        lm_head=target.model.get_output_embeddings(), target_fingerprint=target.target_fingerprint,
                        template_fingerprint=target.template_fingerprint)


# -- speculators ------------------------------------------------------------------------------------


def _speculators_dflash(target, path, vocab=VOCAB):
    layer = create_transformer_layer_config(str(target.path), 1, "qwen3", None, None, [0])  # full attention
    t2d, d2t = _vocab_maps(vocab)
    model = SpeculatorsDFlash.from_training_args(layer, t2d=t2d, d2t=d2t, verifier_name_or_path=str(target.path),
                                                 draft_vocab_size=len(vocab), block_size=4,
                                                 target_layer_ids=[2, 5, 6], mask_token_id=0)
    _randomise(model).save_pretrained(path)
    return path


def _speculators_eagle3(target, path, norm_before_residual=False):
    layer = create_transformer_layer_config(str(target.path), 1, "llama", None, None, [0])
    t2d, d2t = _vocab_maps(VOCAB)
    model = Eagle3DraftModel.from_training_args(layer, t2d=t2d, d2t=d2t, verifier_name_or_path=str(target.path),
                                                draft_vocab_size=len(VOCAB), norm_before_residual=norm_before_residual,
                                                ttt_steps=3, target_layer_ids=[2, 5, 6])
    _randomise(model).save_pretrained(path)
    return path


def test_speculators_dflash_imports_drafts_the_same_and_exports_back(debug_target, tmp_path, monkeypatch):
    peer_dir = _speculators_dflash(debug_target, tmp_path / "peer")
    assert is_peer_directory(peer_dir) and peer_summary(peer_dir) == {"format": "speculators", "algorithm": "dflash",
                                                                      "draft_vocab_size": 130}
    out = import_peer(peer_dir, tmp_path / "ours", target=debug_target)
    config = read_drafter_config(out)
    assert config["algorithm"] == "dflash" and config["capture_contract"]["layer_ids"] == [1, 4, 5]  # inputs - 1
    assert config["architecture"]["draft_vocab_size"] == 130 and config["architecture"]["mask_token_id"] == 0
    provenance = json.loads((out / "export.json").read_text())
    assert provenance["imported_format"] == "speculators" and provenance["peer_verifier"] == str(debug_target.path)
    assert "lm_head.weight equals the target's" in provenance["import_checks"]
    ours = _load(out, debug_target)
    peer = peer_model(SpeculatorsDFlash, peer_dir)
    S, anchors = 24, torch.tensor([3, 9, 15])
    hidden, ids, _ = features(debug_target, S, layer_ids=(1, 4, 5))  # ascending layers: our contract order
    fix_anchors(monkeypatch, anchors)
    with torch.no_grad():
        mine = ours(hidden, torch.ones(1, S, dtype=torch.bool), ids[:, anchors], anchors[None])
        _, logits, *_ = peer._backbone_forward(hidden, ids, torch.ones(1, S), torch.randn(1, S, 64),
                                               torch.zeros(1, S, dtype=torch.long), max_anchors=3)
    theirs = logits.view(1, 3, 4, -1)[:, :, 1:]
    assert mine.std() > 0.5 and (mine - theirs).abs().max() <= TOLERANCE
    back = write_peer_export(out, tmp_path / "back", target=debug_target, verifier_name_or_path=str(debug_target.path))
    _same_tensors(peer_dir, back)


@pytest.mark.parametrize("norm_before_residual", [False, True])
def test_speculators_eagle3_imports_and_exports_back(debug_target, tmp_path, norm_before_residual):
    peer_dir = _speculators_eagle3(debug_target, tmp_path / "peer", norm_before_residual)
    out = import_peer(peer_dir, tmp_path / "ours", target=debug_target)  # the verifier the config names
    config = read_drafter_config(out)
    assert config["algorithm"] == "eagle3" and config["capture_contract"]["layer_ids"] == [1, 4, 5]
    assert config["architecture"]["norm_before_residual"] is norm_before_residual
    assert "embed_tokens.weight equals the target's" in json.loads((out / "export.json").read_text())["import_checks"]
    back = write_peer_export(out, tmp_path / "back", target=debug_target, verifier_name_or_path=str(debug_target.path))
    _same_tensors(peer_dir, back)


def test_a_speculators_drafter_of_another_target_is_refused(debug_target, tmp_path):
    peer_dir = _speculators_eagle3(debug_target, tmp_path / "peer")
    with pytest.raises(PeerFormatError, match=r"embed_tokens\.weight .* is not the target's|lm_head\.weight .* is not"):
        import_peer(peer_dir, tmp_path / "ours", target="debug:1")  # same shapes, other weights
    assert not (tmp_path / "ours").exists()


# -- z-lab (dflash) and SpecForge ---------------------------------------------------------------------


def _zlab_config(target, algorithm="dflash", **draft):
    config = Qwen3Config(vocab_size=target.vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-6,
                         max_position_embeddings=4096, tie_word_embeddings=False)
    config.architectures = [{"dflash": "DFlashDraftModel", "dflash2": "DFlash2DraftModel"}[algorithm]]
    config.num_target_layers, config.block_size = target.num_layers, 4
    config.dflash_config = {"target_layer_ids": [1, 3, 5], "mask_token_id": 1, **draft}
    return config


def test_zlab_dflash_imports_drafts_the_same_and_exports_back(debug_target, tmp_path):
    peer_dir = tmp_path / "zlab"
    _randomise(DFlashDraftModel(_zlab_config(debug_target))).save_pretrained(peer_dir)
    out = import_peer(peer_dir, tmp_path / "ours", target=debug_target)
    config = read_drafter_config(out)
    assert (config["algorithm"], config["capture_contract"]["layer_ids"]) == ("dflash", [1, 3, 5])
    assert (config["architecture"]["num_layers"], config["architecture"]["block_size"]) == (2, 4)
    ours, peer = _load(out, debug_target), DFlashDraftModel.from_pretrained(peer_dir).eval()
    hidden, ids, _ = features(debug_target, 20, layer_ids=(1, 3, 5))  # [1, 20, 3 · 64]: ascending, as z-lab's
    anchor = 11
    with torch.no_grad():
        mine = ours(hidden, torch.ones(1, 20, dtype=torch.bool), ids[:, [anchor]], torch.tensor([[anchor]]))[0, 0]
        block = torch.tensor([[ids[0, anchor], 1, 1, 1]])
        h = peer(target_hidden=hidden[:, :anchor], noise_embedding=debug_target.model.get_input_embeddings()(block),
                 position_ids=torch.arange(anchor + 4)[None])
        theirs = peer.compute_logits(h, debug_target.model.get_output_embeddings())[0, 1:]
    assert mine.std() > 0.5 and (mine - theirs).abs().max() <= TOLERANCE
    back = write_sglang_export(out, tmp_path / "back", target=debug_target)
    _same_tensors(peer_dir, back)


def test_zlab_dflash2_imports_and_exports_back(debug_target, tmp_path):
    peer_dir = tmp_path / "zlab2"
    config = _zlab_config(debug_target, "dflash2", conv_kernel_size=2, conv_group_size=16, selector_rank=8,
                          selector_top_k=4)
    _randomise(DFlash2DraftModel(config)).save_pretrained(peer_dir)
    out = import_peer(peer_dir, tmp_path / "ours", target=debug_target)
    arch = read_drafter_config(out)["architecture"]
    assert (arch["conv_kernel_size"], arch["selector_rank"], arch["selector_top_k"]) == (2, 8, 4)
    back = write_sglang_export(out, tmp_path / "back", target=debug_target)  # codebooks: no .weight in SGLang's names
    _same_tensors(peer_dir, back, renamed=[("_codebook.weight", "_codebook")])


def test_specforge_eagle3_for_sglang_imports_and_exports_back(debug_target, tmp_path):
    """SpecForge's SGLang export: the draft's save_pretrained without the embedding (export/to_sglang.py)."""
    config = LlamaConfig(vocab_size=debug_target.vocab_size, hidden_size=64, intermediate_size=128,
                         num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                         rms_norm_eps=1e-6, max_position_embeddings=4096, tie_word_embeddings=False)
    config.architectures, config.draft_vocab_size = ["LlamaForCausalLMEagle3"], len(VOCAB)
    config.eagle_config = {"eagle_aux_hidden_state_layer_ids": [1, 4, 5]}
    model = _randomise(LlamaForCausalLMEagle3(config))
    t2d, d2t = _vocab_maps(VOCAB)
    with torch.no_grad():  # the target head's rows: what specray's drafters predict with
        model.lm_head.weight.copy_(debug_target.model.get_output_embeddings().weight[VOCAB])
        model.t2d.copy_(t2d), model.d2t.copy_(d2t)
    peer_dir = tmp_path / "specforge"
    state = {k: v for k, v in model.state_dict().items() if "embed" not in k}
    model.save_pretrained(peer_dir, state_dict=state)
    out = import_peer(peer_dir, tmp_path / "ours", target=debug_target)
    config = read_drafter_config(out)
    assert config["algorithm"] == "eagle3" and config["capture_contract"]["layer_ids"] == [1, 4, 5]
    assert json.loads((out / "export.json").read_text())["imported_format"] == "sglang"
    back = write_sglang_export(out, tmp_path / "back", target=debug_target)
    _same_tensors(peer_dir, back)
    with torch.no_grad():  # SpecForge trains its own head: specray's drafters share the target's
        model.lm_head.weight.add_(0.1)
    save_file({k: v.contiguous() for k, v in model.state_dict().items() if "embed" not in k},
              peer_dir / "model.safetensors")
    with pytest.raises(PeerFormatError, match=r"lm_head\.weight \[130, 64\] is not the target's"):
        import_peer(peer_dir, tmp_path / "trained-head", target=debug_target)


@pytest.mark.parametrize("algorithm, overrides", [
    ("dflash", {}), ("dspark", {"markov_head_type": "rnn", "markov_rank": 8, "confidence_head_with_markov": False}),
    ("dflash2", {})])
def test_our_export_through_zlabs_format_imports_back_the_same(debug_target, tmp_path, capsys, algorithm, overrides):
    """Our export -> ``specray export --format sglang`` (z-lab's format, ``dflash_config``) -> ``specray
    import``: the same architecture (MASK id, block size, DSpark's head fields, DFlash 2's selector), the
    layer ids ascending with fc.weight's input blocks in that order (what z-lab reads), every other tensor
    the same; exported again, the same z-lab directory."""
    spec = DRAFTERS[algorithm]
    cfg = spec.config.from_dict({**spec.debug_config(debug_target, LAYER_IDS).to_dict(), **overrides})
    model = randomise(build(spec.model, cfg, debug_target), by_name(0.2))
    export = save_export(tmp_path, debug_target, model)
    assert main(["export", str(export), "--format", "sglang"]) == 0
    zlab = tmp_path / "export-sglang"
    assert main(["import", str(zlab), "--out", str(tmp_path / "imported"), "--target", "debug"]) == 0
    assert f"from zlab {algorithm}" in capsys.readouterr().out
    config = read_drafter_config(tmp_path / "imported")
    assert config["algorithm"] == algorithm and config["capture_contract"]["layer_ids"] == sorted(LAYER_IDS)
    ours = dict(cfg.to_dict(), target_layer_ids=sorted(LAYER_IDS), mask_token_origin="config")  # named by the config
    assert config["architecture"] == ours
    assert (config["architecture"]["mask_token_id"], config["architecture"]["block_size"]) == (195, 4)
    imported = _load(tmp_path / "imported", debug_target).state_dict()
    state = model.state_dict()
    assert imported.keys() == state.keys()
    for key, tensor in state.items():
        want = ascending(tensor) if key == "fc.weight" else tensor  # input blocks by ascending layer id
        assert torch.equal(imported[key], want), key
    back = write_sglang_export(tmp_path / "imported", tmp_path / "back", target=debug_target)
    _same_tensors(zlab, back)
    assert json.loads((back / "config.json").read_text())["dflash_config"] == \
        json.loads((zlab / "config.json").read_text())["dflash_config"]


def test_a_calibrated_dspark_keeps_its_tables_through_sglangs_format(debug_target, tmp_path):
    """Calibrated export -> SGLang's format (an STS file per serving mode) -> import: the imported export's
    calibration.json holds both tables, checked against the new export and loaded by the drafter. Files
    of one mode only, or of another block size, are refused before anything is written."""
    from specray.drafters.dspark import read_calibration, write_calibration

    spec = DRAFTERS["dspark"]
    model = randomise(build(spec.model, spec.debug_config(debug_target, LAYER_IDS), debug_target), by_name(0.2))
    export = save_export(tmp_path, debug_target, model)
    tables = {"greedy": [0.25, 0.5, 0.75, 1.25], "sampling": [1.5, 0.8, 1.2, 2.0]}
    write_calibration(export, tables, {"manifest": "heldout.parquet", "blocks": 64, "modes": {
        "greedy": {"ece_by_pos_before": [0.1] * 4, "ece_by_pos_after": [0.01] * 4}}})
    sglang = write_sglang_export(export, tmp_path / "sglang", target=debug_target)
    out = import_peer(sglang, tmp_path / "imported", target=debug_target)
    assert read_calibration(out, 4) == tables
    body = json.loads((out / "calibration.json").read_text())
    assert body["modes"]["greedy"]["ece_by_pos_after"] == [0.01] * 4 and body["blocks"] == 64
    drafter = _load(out, debug_target)
    assert torch.equal(drafter.confidence_temperature, torch.tensor([tables["greedy"], tables["sampling"]]))

    (sglang / "sts_calibration.sampling.json").unlink()
    with pytest.raises(PeerFormatError, match=r"STS tables for \['greedy'\] only"):
        import_peer(sglang, tmp_path / "one-mode", target=debug_target)
    sts = json.loads((sglang / "sts_calibration.greedy.json").read_text())
    (sglang / "sts_calibration.sampling.json").write_text(json.dumps({**sts, "mode": "sampling",
                                                                      "temperatures": [1.0] * 8}))
    with pytest.raises(PeerFormatError, match="temperatures must be 4 positive numbers"):
        import_peer(sglang, tmp_path / "other-size", target=debug_target)
    assert not (tmp_path / "one-mode").exists() and not (tmp_path / "other-size").exists()


# -- refusals and the CLI ---------------------------------------------------------------------------


@pytest.mark.parametrize("change, field", [
    (lambda c: c.update(layer_types=["sliding_attention", "full_attention"], sliding_window=8), "layer_types"),
    (lambda c: c["dflash_config"].update(output_multiplier=2.0), "dflash_config.output_multiplier"),
    (lambda c: c.update(attention_bias=True), "attention_bias"),
    (lambda c: c.update(rope_parameters={"rope_type": "longrope", "factor": 4.0, "rope_theta": 1e6}),
     "rope_parameters.rope_type"),
    (lambda c: c.update(num_target_layers=32), "num_target_layers = 32"),
    (lambda c: c["dflash_config"].update(target_layer_ids=[1, 3, 9]), "reads target layers"),
    (lambda c: c.update(hidden_size=128), "hidden_size = 128"),
    (lambda c: c.update(intermediate_size=2**21), r"architecture\.intermediate_size"),
    (lambda c: c.update(num_key_value_heads=0), r"architecture\.num_kv_heads"),
])
def test_what_specray_cannot_compute_is_refused_before_loading(debug_target, tmp_path, change, field):
    peer_dir = tmp_path / "zlab"
    DFlashDraftModel(_zlab_config(debug_target)).save_pretrained(peer_dir)
    config = json.loads((peer_dir / "config.json").read_text())
    change(config)
    (peer_dir / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=field):
        import_peer(peer_dir, tmp_path / "ours", target=debug_target)
    assert not (tmp_path / "ours").exists()


def test_as_export_imports_once_and_keeps_exports(debug_target, tmp_path, monkeypatch):
    monkeypatch.setenv("SPECRAY_CACHE", str(tmp_path / "cache"))
    peer_dir = tmp_path / "zlab"
    _randomise(DFlashDraftModel(_zlab_config(debug_target))).save_pretrained(peer_dir)
    first = as_export(peer_dir, debug_target)
    assert first.parent == tmp_path / "cache" / "imports" and as_export(peer_dir, debug_target) == first
    assert as_export(first, debug_target) == first  # an export is used as it is


def test_cli_import(debug_target, tmp_path, capsys):
    peer_dir = _speculators_dflash(debug_target, tmp_path / "peer")
    assert main(["import", str(peer_dir), "--out", str(tmp_path / "ours"), "--capture-dtype", "float32"]) == 0
    printed = capsys.readouterr().out
    assert "imported" in printed and "speculators dflash" in printed
    assert read_drafter_config(tmp_path / "ours")["capture_contract"]["dtype"] == "float32"
    assert "Imported from a speculators directory" in (tmp_path / "ours" / "README.md").read_text()
    assert main(["import", str(tmp_path / "ours"), "--out", str(tmp_path / "again")]) == 2  # ours, not a peer's
    assert "already a specray export" in capsys.readouterr().err
