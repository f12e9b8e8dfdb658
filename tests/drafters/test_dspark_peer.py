"""The DSpark speculators export (drafters/peer.py): the config fields speculators' ``dspark`` reads,
the weight names, and parity of every sequence-head variant with speculators 0.9.0's
``DSparkDraftModel`` (its whole forward on the same features and previous tokens, its loss replaced
by a recorder of the corrected logits and confidence logits). The vanilla head, with and without a
draft vocabulary, is also in the conformance suite."""

import json
from dataclasses import replace

import pytest
import torch
from peer_parity import (LAYER_IDS, TOLERANCE, ascending, build, features, fix_anchors, peer_export, peer_model,
                         randomise)
from safetensors.torch import load_file
from speculators.models.dspark import DSparkDraftModel
from speculators.models.dspark import core as peer_dspark

from specray.drafters import dspark
from specray.drafters.peer import PeerFormatError


def _spread(name, p):
    """Norms around 1, every other parameter around 0, std 0.2; ``block_key_bias`` kept."""
    if name.endswith("block_key_bias"):
        return None
    return (1.0, 0.2) if "norm" in name else (0.0, 0.2)


def _dspark(target, **overrides):
    cfg = replace(dspark.debug_config(target, LAYER_IDS), **overrides)
    return randomise(build(dspark.DSparkDrafter, cfg, target), _spread)


@pytest.mark.parametrize("head, with_markov", [("gated", True), ("rnn", True), ("vanilla", False)])
def test_dspark_speculators_parity(debug_target, tmp_path, monkeypatch, head, with_markov):
    model = _dspark(debug_target, markov_head_type=head, confidence_head_with_markov=with_markov)
    peer = peer_model(DSparkDraftModel, peer_export(tmp_path, debug_target, model))

    S, B, anchors = 24, model.config.block_size, torch.tensor([3, 9, 15])
    hidden, ids, _ = features(debug_target, S)
    prev = ids[:, anchors[:, None] + torch.arange(B)]  # [1, N, B]
    seen = {}
    fix_anchors(monkeypatch, anchors)
    monkeypatch.setattr(peer_dspark, "compute_metrics", lambda logits, targets, confidence, *args, **kwargs:
                        seen.update(logits=logits, confidence=confidence) or (logits.sum(), {}))
    with torch.no_grad():
        logits, confidence = model(hidden, torch.ones(1, S, dtype=torch.bool), ids[:, anchors], anchors[None], prev)
        peer(ascending(hidden), ids, torch.ones(1, S), torch.randn(1, S, debug_target.hidden_size),
             torch.zeros(1, S, dtype=torch.long), max_anchors=len(anchors))
    theirs = seen["logits"].view(1, len(anchors), B, -1)
    assert logits.shape == theirs.shape and logits.std() > 0.5 and confidence.std() > 0.1
    assert (logits - theirs).abs().max() <= TOLERANCE
    assert (confidence - seen["confidence"].view(1, len(anchors), B)).abs().max() <= TOLERANCE


def test_dspark_speculators_config_and_weights(debug_target, tmp_path):
    model = _dspark(debug_target, markov_head_type="rnn", markov_rank=8)
    out = peer_export(tmp_path, debug_target, model)
    config = json.loads((out / "config.json").read_text())
    assert config["speculators_model_type"] == "dspark" and config["sample_from_anchor"] is True
    assert (config["markov_rank"], config["markov_head_type"]) == (8, "rnn")
    assert config["enable_confidence_head"] is True and config["confidence_head_with_markov"] is True
    assert config["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == model.config.block_size
    tensors = load_file(out / "model.safetensors")
    state = model.state_dict()
    for name in ("markov_head.markov_w1.weight", "markov_head.markov_w2.weight", "markov_head.joint_proj.weight",
                 "markov_head.joint_proj.bias", "confidence_head.proj.weight", "confidence_head.proj.bias"):
        assert torch.equal(tensors[name], state[name]), name


def test_dspark_refuses_what_the_peer_cannot_express(debug_target, tmp_path):
    model = _dspark(debug_target, block_key_bias=4.0)
    with pytest.raises(PeerFormatError, match=r"drafter\.block_key_bias"):
        peer_export(tmp_path, debug_target, model)
