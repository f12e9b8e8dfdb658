"""The DSpark speculators export (drafters/peer.py): the config fields speculators' ``dspark`` reads,
the weight names, and parity of every sequence-head variant with speculators 0.9.0's
``DSparkDraftModel`` (its whole forward on the same features and previous tokens, its loss replaced
by a recorder of the corrected logits and confidence logits). The vanilla head, with and without a
draft vocabulary, is also in the conformance suite."""

import json
from dataclasses import replace

import pytest
import torch
from safetensors.torch import load_file
from speculators.models import dflash as peer_dflash
from speculators.models.dspark import DSparkDraftModel
from speculators.models.dspark import core as peer_dspark

from specray.capture.contract import build_contract
from specray.drafters import dspark
from specray.drafters.format import save_drafter
from specray.drafters.peer import PeerFormatError, write_peer_export

LAYER_IDS = (5, 1, 3)  # not ascending on purpose: the peer's fc takes its inputs ascending
TOLERANCE = 1e-4


def _dspark(target, **overrides):
    cfg = replace(dspark.debug_config(target, LAYER_IDS), **overrides)
    model = dspark.DSparkDrafter(cfg, embed_tokens=target.model.get_input_embeddings(),
                                 lm_head=target.model.get_output_embeddings())
    torch.manual_seed(0)
    with torch.no_grad():  # logits spread over several units: a 1e-4 match means something
        for name, p in model.named_parameters():
            if not name.endswith("block_key_bias"):
                p.normal_(1.0, 0.2) if "norm" in name else p.normal_(0.0, 0.2)
    return model.eval()


def _export(tmp_path, target, model):
    contract = build_contract(model.algorithm, target_fingerprint=target.target_fingerprint,
                              template_fingerprint=target.template_fingerprint, num_target_layers=target.num_layers,
                              hidden_size=target.hidden_size, layer_ids=model.config.target_layer_ids, dtype="float32")
    return save_drafter(tmp_path / "export", model, contract=json.loads(contract.to_json()),
                        provenance={"run": "random", "target": "debug"})


def _ascending(hidden):
    blocks = hidden.chunk(len(LAYER_IDS), dim=-1)
    return torch.cat([blocks[i] for i in sorted(range(len(LAYER_IDS)), key=LAYER_IDS.__getitem__)], dim=-1)


@pytest.mark.parametrize("head, with_markov", [("gated", True), ("rnn", True), ("vanilla", False)])
def test_dspark_speculators_parity(debug_target, tmp_path, monkeypatch, head, with_markov):
    model = _dspark(debug_target, markov_head_type=head, confidence_head_with_markov=with_markov)
    out = write_peer_export(_export(tmp_path, debug_target, model), tmp_path / "peer", target=debug_target,
                            verifier_name_or_path=str(debug_target.path))
    config = DSparkDraftModel.config_class.from_pretrained(out)
    config.transformer_layer_config._attn_implementation = "eager"
    peer = DSparkDraftModel.from_pretrained(out, config=config).eval()

    S, B, anchors = 24, model.config.block_size, torch.tensor([3, 9, 15])
    g = torch.Generator().manual_seed(1)
    hidden = torch.randn(1, S, len(LAYER_IDS) * debug_target.hidden_size, generator=g)
    ids = torch.randint(0, debug_target.vocab_size, (1, S), generator=g)
    prev = ids[:, anchors[:, None] + torch.arange(B)]  # [1, N, B]
    seen = {}
    monkeypatch.setattr(peer_dflash.core, "select_anchors",
                        lambda loss_mask, n, block: (anchors, torch.ones(n, dtype=torch.bool)))
    monkeypatch.setattr(peer_dspark, "compute_metrics", lambda logits, targets, confidence, *args, **kwargs:
                        seen.update(logits=logits, confidence=confidence) or (logits.sum(), {}))
    with torch.no_grad():
        logits, confidence = model(hidden, torch.ones(1, S, dtype=torch.bool), ids[:, anchors], anchors[None], prev)
        peer(_ascending(hidden), ids, torch.ones(1, S), torch.randn(1, S, debug_target.hidden_size),
             torch.zeros(1, S, dtype=torch.long), max_anchors=len(anchors))
    theirs = seen["logits"].view(1, len(anchors), B, -1)
    assert logits.shape == theirs.shape and logits.std() > 0.5 and confidence.std() > 0.1
    assert (logits - theirs).abs().max() <= TOLERANCE
    assert (confidence - seen["confidence"].view(1, len(anchors), B)).abs().max() <= TOLERANCE


def test_dspark_speculators_config_and_weights(debug_target, tmp_path):
    model = _dspark(debug_target, markov_head_type="rnn", markov_rank=8)
    out = write_peer_export(_export(tmp_path, debug_target, model), tmp_path / "peer", target=debug_target,
                            verifier_name_or_path=str(debug_target.path))
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
        write_peer_export(_export(tmp_path, debug_target, model), tmp_path / "peer", target=debug_target,
                          verifier_name_or_path=str(debug_target.path))
