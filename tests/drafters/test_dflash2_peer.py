"""The speculators ``dflash2`` export (drafters/peer.py): speculators 0.9.0's ``DFlash2DraftModel`` loads
it and computes our unary logits (convolutions included) and our selector's edge scores on the same
features, tokens and predecessors; a drafter with a draft vocabulary is refused.
"""

import json
from dataclasses import replace

import pytest
import torch
from speculators.models import dflash as speculators_dflash
from speculators.models.dflash2 import DFlash2DraftModel

from specray.capture.contract import build_contract
from specray.drafters import dflash2
from specray.drafters.format import save_drafter
from specray.drafters.peer import PeerFormatError, write_peer_export

LAYER_IDS = (5, 1, 3)  # not ascending on purpose: the peer's fc takes its inputs ascending
TOLERANCE = 1e-4


def _drafter(target, **overrides):
    cfg = replace(dflash2.debug_config(target, LAYER_IDS), **overrides)
    model = dflash2.DFlash2Drafter(cfg, embed_tokens=target.model.get_input_embeddings(),
                                   lm_head=target.model.get_output_embeddings())
    torch.manual_seed(0)
    with torch.no_grad():  # every part away from its initial value, spread over several units
        for name, p in model.named_parameters():
            p.normal_(1.0, 0.2) if p.dim() == 1 else p.normal_(0.0, 1.0 if "codebook" in name else 0.2)
    return model.eval()


def _export(tmp_path, target, model):
    contract = build_contract(model.algorithm, target_fingerprint=target.target_fingerprint,
                              template_fingerprint=target.template_fingerprint, num_target_layers=target.num_layers,
                              hidden_size=target.hidden_size, layer_ids=model.config.target_layer_ids, dtype="float32")
    return save_drafter(tmp_path / "export", model, contract=json.loads(contract.to_json()),
                        provenance={"run": "random", "target": "debug"})


def test_dflash2_speculators_parity(debug_target, tmp_path, monkeypatch):
    model = _drafter(debug_target)
    out = write_peer_export(_export(tmp_path, debug_target, model), tmp_path / "peer", target=debug_target,
                            verifier_name_or_path=str(debug_target.path))
    config = json.loads((out / "config.json").read_text())
    assert config["speculators_model_type"] == "dflash2" and config["selector_top_k"] == 4
    peer_config = DFlash2DraftModel.config_class.from_pretrained(out)
    peer_config.transformer_layer_config._attn_implementation = "eager"
    peer = DFlash2DraftModel.from_pretrained(out, config=peer_config).eval()

    S, B, anchors = 24, model.config.block_size, torch.tensor([3, 9, 15])
    g = torch.Generator().manual_seed(1)
    hidden = torch.randn(1, S, len(LAYER_IDS) * debug_target.hidden_size, generator=g)
    blocks = hidden.chunk(len(LAYER_IDS), dim=-1)
    ascending = torch.cat([blocks[i] for i in sorted(range(len(LAYER_IDS)), key=LAYER_IDS.__getitem__)], dim=-1)
    ids = torch.randint(0, debug_target.vocab_size, (1, S), generator=g)
    predecessors = torch.randint(0, debug_target.vocab_size, (1, len(anchors), B - 1), generator=g)
    with torch.no_grad():
        ours = model(hidden, torch.ones(1, S, dtype=torch.bool), ids[:, anchors], anchors[None], predecessors)
        monkeypatch.setattr(speculators_dflash.core, "select_anchors",
                            lambda loss_mask, n, block: (anchors, torch.ones(n, dtype=torch.bool)))
        h, logits, *_ = peer._backbone_forward(
            ascending, ids, torch.ones(1, S), torch.randn(1, S, debug_target.hidden_size),
            torch.zeros(1, S, dtype=torch.long), max_anchors=len(anchors))  # [1, N·B, D], [1, N·B, V]
        theirs = logits.view(1, len(anchors), B, -1)[:, :, 1:]  # the anchor row drafts nothing
        ids_k = model.draft_to_target(ours.candidates)  # [1, N, m, K]
        their_scores = peer.candidate_selector.score_candidates(
            theirs, h.view(1, len(anchors), B, -1)[:, :, 1:], predecessors, ids_k)
    assert ours.logits.shape == theirs.shape and ours.logits.std() > 0.5
    assert (ours.logits - theirs).abs().max() <= TOLERANCE
    transition = ours.scores - ours.logits.gather(-1, ours.candidates)  # the selector's part of the edge scores
    assert transition.abs().max() > 0.5 and (ours.scores - their_scores).abs().max() <= TOLERANCE


def test_dflash2_with_a_draft_vocabulary_is_refused(debug_target, tmp_path):
    model = _drafter(debug_target, draft_vocab_size=40)
    model.set_draft_vocab(torch.arange(40))
    with pytest.raises(PeerFormatError, match="draft_vocab_size"):
        write_peer_export(_export(tmp_path, debug_target, model), tmp_path / "peer", target=debug_target,
                          verifier_name_or_path=str(debug_target.path))
    assert not (tmp_path / "peer").exists()
