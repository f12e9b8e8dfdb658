"""trainer/assembly.py and the registries: the layering rule, registry shape, the capture fit
check and the drafter config a section derives from a target."""

import ast
from pathlib import Path

import pytest
from pydantic import BaseModel

from specray.capture.contract import CONTRACT_SPECS, ContractMismatchError
from specray.drafters import ALGORITHMS, DRAFTERS
from specray.drafters.dflash import DFlashSection
from specray.trainer.assembly import check_capture_fits
from specray.trainer.strategies import STRATEGIES, get_strategy

ROOT = Path(__file__).resolve().parents[2]


def _type_checking_only(tree: ast.Module) -> set[int]:
    """ids of the nodes under ``if TYPE_CHECKING:`` (annotations, never imported at run time)."""
    return {id(n) for node in ast.walk(tree) if isinstance(node, ast.If) and ast.unparse(node.test) == "TYPE_CHECKING"
            for stmt in node.body for n in ast.walk(stmt)}


def _imports(folder: str) -> dict[str, set[str]]:
    """Modules each file of ``folder`` imports at run time."""
    found = {}
    for path in sorted((ROOT / folder).glob("*.py")):
        names = set()
        tree = ast.parse(path.read_text())
        skip = _type_checking_only(tree)
        for node in ast.walk(tree):
            if id(node) in skip:
                continue
            if isinstance(node, ast.ImportFrom) and node.module:
                names.add(node.module)
            elif isinstance(node, ast.Import):
                names.update(a.name for a in node.names)
        found[path.name] = names
    return found


@pytest.mark.parametrize("folder, forbidden", [("actors", ("specray.pipeline",)),
                                               ("trainer", ("specray.pipeline", "specray.actors", "ray"))])
def test_layering(folder, forbidden):
    bad = {name: sorted(m for m in modules if m.split(".")[0] in forbidden or m.startswith(forbidden))
           for name, modules in _imports(folder).items()}
    assert not {k: v for k, v in bad.items() if v}, f"{folder}/ imports against DESIGN.md §1"


def test_registries_agree_on_the_seams_names():
    assert set(ALGORITHMS) == set(CONTRACT_SPECS)
    assert set(STRATEGIES) <= set(DRAFTERS) <= set(ALGORITHMS)
    for algorithm, strategy in STRATEGIES.items():
        assert strategy.algorithm == algorithm and issubclass(strategy.objective, BaseModel)
        assert strategy.objective.model_config.get("extra") == "forbid"
        strategy.objective.model_validate(strategy.evaluation)  # evaluation overrides are objective fields
    with pytest.raises(ValueError, match=r"unknown algorithm 'medusa'.*implemented: \['dflash'"):
        get_strategy("medusa")


def test_capture_fit_names_both_algorithms_and_the_fix():
    check_capture_fits("dflash", "dflash", field="train.drafter.algorithm")
    with pytest.raises(ContractMismatchError, match=r"train\.drafter\.algorithm=eagle3 needs features captured with "
                                                    r"capture\.algorithm=eagle3 \(got dflash\); set capture\.algorithm=eagle3"):
        check_capture_fits("eagle3", "dflash", field="train.drafter.algorithm")


def test_dflash_section_takes_unset_sizes_from_the_target(debug_target):
    tcfg = debug_target.model.config
    cfg = DFlashSection(block_size=4, num_heads=2, draft_vocab_size=32).drafter_config(debug_target, (2, 5))
    assert (cfg.hidden_size, cfg.vocab_size, cfg.target_layer_ids) == (tcfg.hidden_size, tcfg.vocab_size, (2, 5))
    assert (cfg.num_heads, cfg.num_kv_heads, cfg.intermediate_size) == (2, tcfg.num_key_value_heads,
                                                                        tcfg.intermediate_size)
    assert cfg.head_dim == tcfg.hidden_size // tcfg.num_attention_heads and cfg.rms_norm_eps == tcfg.rms_norm_eps
    assert (cfg.block_size, cfg.draft_vocab_size, cfg.num_layers) == (4, 32, 1)
    assert debug_target.tokenizer.mask_token_id is None  # no mask token: the token of byte 0xC0 stands for MASK
    assert (cfg.mask_token_id, cfg.mask_token_origin) == (195, "unused_byte_token")
