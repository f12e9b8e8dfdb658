"""Fixtures of the peer-format parity tests (drafters/peer.py against speculators 0.9.0,
drafters/sglang.py against z-lab's dflash and SpecForge, drafters/peer_import.py, and the export
conformance suite): drafters with spread weights, their export, the peer model loaded from the
speculators export, and the features both models read. It lives in tests/ (on ``sys.path`` through
tests/conftest.py), so tests/drafters, tests/conformance and tests/trainer import it as ``peer_parity``.

    model = randomise(build(dflash.DFlashDrafter, cfg, target))
    peer = peer_model(DFlashDraftModel, peer_export(tmp_path, target, model))   # our export, then the peer's
    hidden, ids, g = features(target, S)            # ours: hidden; the peer's: ascending(hidden)
    fix_anchors(monkeypatch, anchors)               # the peer's DFlash core drafts at our anchors
"""

from __future__ import annotations

import json

import torch

from specray.capture.contract import build_contract
from specray.drafters.format import save_drafter
from specray.drafters.peer import write_peer_export

LAYER_IDS = (5, 1, 3)  # not ascending on purpose: the peers' fc takes its inputs ascending
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


def by_name(std: float, keep: tuple[str, ...] = ()):
    """The rule: parameters whose name contains "norm" around 1, the others around 0, both with
    ``std``; those whose name contains one of ``keep`` (e.g. the embedding, the LM head) kept."""
    def rule(name: str, p: torch.Tensor) -> tuple[float, float] | None:
        if any(part in name for part in keep):
            return None
        return (1.0, std) if "norm" in name else (0.0, std)
    return rule


def randomise(model, mean_std=by_rank, seed: int | None = 0):
    """Every parameter drawn from ``normal(*mean_std(name, p))`` in ``named_parameters`` order under
    ``seed`` (``None``: the global generator as it stands), ``None`` from the rule keeps it; so the
    logits spread over several units and a 1e-4 match means something. Returns the model in eval."""
    if seed is not None:
        torch.manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            spread = mean_std(name, p)
            if spread is not None:
                p.normal_(*spread)
    return model.eval()


def random_vocab(target, size: int) -> torch.Tensor:
    """A random draft vocabulary: ``size`` of the target's ids, from a generator seeded 2."""
    return torch.randperm(target.vocab_size, generator=torch.Generator().manual_seed(2))[:size]


def save_export(tmp_path, target, model, vocab_size=None, name: str = "export"):
    """``model`` saved as our export under ``tmp_path / name`` (a ``random_vocab`` of ``vocab_size``
    tokens first)."""
    if vocab_size is not None:
        model.set_draft_vocab(random_vocab(target, vocab_size))
    contract = build_contract(model.algorithm, target_fingerprint=target.target_fingerprint,
                              template_fingerprint=target.template_fingerprint, num_target_layers=target.num_layers,
                              hidden_size=target.hidden_size, layer_ids=model.config.target_layer_ids, dtype="float32")
    return save_drafter(tmp_path / name, model, contract=json.loads(contract.to_json()),
                        provenance={"run": "random", "target": "debug"})


def peer_export(tmp_path, target, model, vocab_size=None):
    """``save_export``, then its speculators export under ``tmp_path / "peer"`` with the target's
    local directory as the verifier (what the peer model loads); returns that directory."""
    return write_peer_export(save_export(tmp_path, target, model, vocab_size), tmp_path / "peer", target=target,
                             verifier_name_or_path=str(target.path))


def peer_model(model_cls, path):
    """The speculators model of a speculators directory, in eager attention (CPU)."""
    config = model_cls.config_class.from_pretrained(path)
    config.transformer_layer_config._attn_implementation = "eager"
    return model_cls.from_pretrained(path, config=config).eval()


def features(target, length: int, layer_ids: tuple[int, ...] = LAYER_IDS):
    """Random captured features ``[1, S, L·D]`` (``L = len(layer_ids)``, in that order) and token ids
    ``[1, S]``, from a generator seeded 1; the generator is returned for any further draws."""
    g = torch.Generator().manual_seed(1)
    hidden = torch.randn(1, length, len(layer_ids) * target.hidden_size, generator=g)
    ids = torch.randint(0, target.vocab_size, (1, length), generator=g)
    return hidden, ids, g


def ascending(hidden: torch.Tensor, layer_ids: tuple[int, ...] = LAYER_IDS) -> torch.Tensor:
    """Our features ``[.., L·D]`` in the contract's order ``layer_ids`` -> the peer's ascending layer order."""
    blocks = hidden.chunk(len(layer_ids), dim=-1)
    return torch.cat([blocks[i] for i in sorted(range(len(layer_ids)), key=layer_ids.__getitem__)], dim=-1)


def fix_anchors(monkeypatch, anchors: torch.Tensor) -> None:
    """The peer's DFlash core (DFlash, DSpark, DFlash 2) drafts at ``anchors`` instead of sampling them."""
    from speculators.models import dflash as speculators_dflash  # imported where a peer model runs

    monkeypatch.setattr(speculators_dflash.core, "select_anchors",
                        lambda loss_mask, n, block: (anchors, torch.ones(n, dtype=torch.bool)))
