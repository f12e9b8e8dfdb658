"""Fixtures of the speculators parity tests (drafters/peer.py against speculators 0.9.0): drafters
with spread weights, their export, the peer model loaded from the speculators export, and the
features both models read.

    model = randomise(build(dflash.DFlashDrafter, cfg, target))
    peer = peer_model(DFlashDraftModel, peer_export(tmp_path, target, model))   # our export, then the peer's
    hidden, ids, g = features(target, S)            # ours: hidden; the peer's: ascending(hidden)
    fix_anchors(monkeypatch, anchors)               # the peer's DFlash core drafts at our anchors
"""

from __future__ import annotations

import json

import torch
from speculators.models import dflash as speculators_dflash

from specray.capture.contract import build_contract
from specray.drafters.format import save_drafter
from specray.drafters.peer import write_peer_export

LAYER_IDS = (5, 1, 3)  # not ascending on purpose: the peer's fc takes its inputs ascending
TOLERANCE = 1e-4


def build(drafter_cls, cfg, target):
    """A drafter on the target's embedding and LM head."""
    return drafter_cls(cfg, embed_tokens=target.model.get_input_embeddings(),
                       lm_head=target.model.get_output_embeddings())


def by_rank(name: str, p: torch.Tensor) -> tuple[float, float] | None:
    """Vectors (norms, biases) around 1, matrices around 0, both with std 0.2; ``block_key_bias`` kept."""
    if name.endswith("block_key_bias"):
        return None
    return (1.0, 0.2) if p.dim() == 1 else (0.0, 0.2)


def randomise(model, mean_std=by_rank):
    """Every parameter drawn from ``normal(*mean_std(name, p))`` under seed 0 (``None`` keeps it), so
    the logits spread over several units and a 1e-4 match means something. Returns the model in eval."""
    torch.manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            spread = mean_std(name, p)
            if spread is not None:
                p.normal_(*spread)
    return model.eval()


def save_export(tmp_path, target, model, vocab_size=None):
    """``model`` saved as our export under ``tmp_path / "export"`` (a random draft vocabulary of
    ``vocab_size`` tokens first, seed 2)."""
    if vocab_size is not None:
        generator = torch.Generator().manual_seed(2)
        model.set_draft_vocab(torch.randperm(target.vocab_size, generator=generator)[:vocab_size])
    contract = build_contract(model.algorithm, target_fingerprint=target.target_fingerprint,
                              template_fingerprint=target.template_fingerprint, num_target_layers=target.num_layers,
                              hidden_size=target.hidden_size, layer_ids=model.config.target_layer_ids, dtype="float32")
    return save_drafter(tmp_path / "export", model, contract=json.loads(contract.to_json()),
                        provenance={"run": "random", "target": "debug"})


def peer_export(tmp_path, target, model, vocab_size=None):
    """``save_export``, then its speculators export under ``tmp_path / "peer"`` with the target's
    local directory as the verifier (what the peer model loads); returns that directory."""
    return write_peer_export(save_export(tmp_path, target, model, vocab_size), tmp_path / "peer", target=target,
                             verifier_name_or_path=str(target.path))


def peer_model(model_cls, path):
    """The speculators model of a speculators export, in eager attention (CPU)."""
    config = model_cls.config_class.from_pretrained(path)
    config.transformer_layer_config._attn_implementation = "eager"
    return model_cls.from_pretrained(path, config=config).eval()


def features(target, length: int):
    """Random captured features ``[1, S, L·D]`` in ``LAYER_IDS`` order and token ids ``[1, S]``, from
    a generator seeded 1; the generator is returned for any further draws."""
    g = torch.Generator().manual_seed(1)
    hidden = torch.randn(1, length, len(LAYER_IDS) * target.hidden_size, generator=g)
    ids = torch.randint(0, target.vocab_size, (1, length), generator=g)
    return hidden, ids, g


def ascending(hidden: torch.Tensor) -> torch.Tensor:
    """Our features ``[.., L·D]`` in the contract's order -> the peer's ascending layer order."""
    blocks = hidden.chunk(len(LAYER_IDS), dim=-1)
    return torch.cat([blocks[i] for i in sorted(range(len(LAYER_IDS)), key=LAYER_IDS.__getitem__)], dim=-1)


def fix_anchors(monkeypatch, anchors: torch.Tensor) -> None:
    """The peer's DFlash core (DFlash, DSpark, DFlash 2) drafts at ``anchors`` instead of sampling them."""
    monkeypatch.setattr(speculators_dflash.core, "select_anchors",
                        lambda loss_mask, n, block: (anchors, torch.ones(n, dtype=torch.bool)))
