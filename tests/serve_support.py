"""Drafters for the serving tests: an untrained DFlash drafter for a target, exported like a
trained one (what a registry version or ``engine.drafter`` holds)."""

import json
from pathlib import Path

import torch

from specray.capture.contract import build_contract
from specray.drafters.dflash import DFlashConfig, DFlashDrafter
from specray.drafters.format import save_drafter


def random_dflash_export(target, out: Path, seed: int = 0) -> Path:
    """A small DFlash drafter (1 layer, B = 4) initialised from ``seed`` on ``target``'s embedding and head."""
    contract = build_contract("dflash", target_fingerprint=target.target_fingerprint,
                              template_fingerprint=target.template_fingerprint, num_target_layers=target.num_layers,
                              hidden_size=target.hidden_size)
    cfg = DFlashConfig(hidden_size=target.hidden_size, vocab_size=target.vocab_size, target_layer_ids=contract.layer_ids,
                       mask_token_id=0, num_layers=1, num_heads=4, num_kv_heads=2, head_dim=16, intermediate_size=128,
                       block_size=4)
    torch.manual_seed(seed)
    model = DFlashDrafter(cfg, embed_tokens=target.model.model.embed_tokens, lm_head=target.model.lm_head)
    return save_drafter(out, model, contract=json.loads(contract.to_json()), provenance={"run": f"random-{seed}"})
