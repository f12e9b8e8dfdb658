"""The speculators ``dflash2`` export (drafters/peer.py): speculators 0.9.0's ``DFlash2DraftModel`` loads
it and computes our unary logits (convolutions included) and our selector's edge scores on the same
features, tokens and predecessors; a drafter with a draft vocabulary is refused.
"""

import json
from dataclasses import replace

import pytest
import torch
from peer_parity import (LAYER_IDS, TOLERANCE, ascending, build, features, fix_anchors, peer_export, peer_model,
                         randomise)
from speculators.models.dflash2 import DFlash2DraftModel

from specray.drafters import dflash2
from specray.drafters.peer import PeerFormatError


def _spread(name, p):
    """Vectors around 1, matrices around 0 (the selector's codebooks with std 1, the rest 0.2)."""
    return (1.0, 0.2) if p.dim() == 1 else (0.0, 1.0 if "codebook" in name else 0.2)


def _drafter(target, **overrides):
    cfg = replace(dflash2.debug_config(target, LAYER_IDS), **overrides)
    return randomise(build(dflash2.DFlash2Drafter, cfg, target), _spread)  # every part away from its initial value


def test_dflash2_speculators_parity(debug_target, tmp_path, monkeypatch):
    model = _drafter(debug_target)
    out = peer_export(tmp_path, debug_target, model)
    config = json.loads((out / "config.json").read_text())
    assert config["speculators_model_type"] == "dflash2" and config["selector_top_k"] == 4
    peer = peer_model(DFlash2DraftModel, out)

    S, B, anchors = 24, model.config.block_size, torch.tensor([3, 9, 15])
    hidden, ids, g = features(debug_target, S)
    predecessors = torch.randint(0, debug_target.vocab_size, (1, len(anchors), B - 1), generator=g)
    fix_anchors(monkeypatch, anchors)
    with torch.no_grad():
        ours = model(hidden, torch.ones(1, S, dtype=torch.bool), ids[:, anchors], anchors[None], predecessors)
        h, logits, *_ = peer._backbone_forward(
            ascending(hidden), ids, torch.ones(1, S), torch.randn(1, S, debug_target.hidden_size),
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
        peer_export(tmp_path, debug_target, model)
    assert not (tmp_path / "peer").exists()
