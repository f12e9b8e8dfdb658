"""Serving fixtures: untrained DFlash drafters for the debug target, exported like trained ones, and
one intra-op thread for tests of many tiny forwards."""

import json

import pytest
import torch

from specray.capture.contract import build_contract
from specray.drafters.dflash import DFlashConfig, DFlashDrafter
from specray.drafters.format import save_drafter


def _export_random_drafter(target, out, *, seed: int = 0, layer_ids: tuple[int, ...] | None = None,
                           block_size: int = 4, draft_vocab: torch.Tensor | None = None):
    contract = build_contract("dflash", target_fingerprint=target.target_fingerprint,
                              template_fingerprint=target.template_fingerprint, num_target_layers=target.num_layers,
                              hidden_size=target.hidden_size)
    cfg = DFlashConfig(hidden_size=target.hidden_size, vocab_size=target.vocab_size,
                       target_layer_ids=layer_ids or contract.layer_ids, mask_token_id=0, num_layers=1, num_heads=4,
                       num_kv_heads=2, head_dim=16, intermediate_size=128, block_size=block_size,
                       draft_vocab_size=None if draft_vocab is None else len(draft_vocab))
    torch.manual_seed(seed)
    model = DFlashDrafter(cfg, embed_tokens=target.model.model.embed_tokens, lm_head=target.model.lm_head)
    if draft_vocab is not None:
        model.set_draft_vocab(draft_vocab)
    return save_drafter(out, model, contract=json.loads(contract.to_json()), provenance={"run": f"random-{seed}"})


@pytest.fixture(scope="module")
def export_drafter(debug_target, tmp_path_factory):
    """``export_drafter(seed=0, layer_ids=None, block_size=4, draft_vocab=None)`` -> the export's directory."""
    root = tmp_path_factory.mktemp("drafters")
    count = iter(range(1_000_000))
    return lambda **kwargs: _export_random_drafter(debug_target, root / f"d{next(count)}", **kwargs)


@pytest.fixture
def one_thread():
    """Many tiny forwards (the chi-square harness runs 1,024): one intra-op thread keeps them from
    spinning on a busy machine."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
