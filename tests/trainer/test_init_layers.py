"""``drafter.init_layers=target`` (trainer/init_layers.py): a rank's drafter layers start as the
target's top layers, read by tensor name; the refusals name the field and the fix."""

import pytest
import torch
from pydantic import ValidationError
from transformers import Qwen3Config, Qwen3ForCausalLM

from specray.capture.contract import build_contract
from specray.capture.target import DEFAULT_TARGET, load_target
from specray.drafters import DRAFTERS
from specray.trainer.assembly import TrainSpec, build_rank
from specray.trainer.core import OptimSettings
from specray.trainer.loader import TrainBatch
from specray.trainer.strategies import get_strategy

DEBUG_LAYERS = 8  # the debug target's decoder layers (capture/target.py)
LLAMA_LAYER = {"input_layernorm.weight", "post_attention_layernorm.weight",
               *(f"self_attn.{p}_proj.weight" for p in "qkvo"),
               *(f"mlp.{p}_proj.weight" for p in ("gate", "up", "down"))}


def _rank(tmp_path, target="debug", algorithm="dflash", **drafter):
    """``build_rank`` of a drafter section with ``drafter`` fields on ``target``, on the CPU in fp32."""
    section = DRAFTERS[algorithm].section(**drafter)
    described = load_target(target, weights="none")
    L = described.num_layers
    layer_ids = (1, L // 2 - 1, L - 4) if algorithm == "eagle3" else (1, L // 2, L - 3)
    contract = build_contract(algorithm, target_fingerprint=described.target_fingerprint,
                              template_fingerprint=described.template_fingerprint, num_target_layers=L,
                              hidden_size=described.hidden_size, layer_ids=layer_ids, dtype="float32")
    spec = TrainSpec(name="init-layers", run_dir=str(tmp_path), target=target, target_dtype="float32",
                     drafter=section, objective=get_strategy(algorithm).objective(), optim=OptimSettings(),
                     micro_batch_size=1, seed=0, manifest=None, endpoint_url=None, max_length=None, world_size=1,
                     log_every=1, checkpoint_every=1, keep_last=None, config={}, device="cpu")
    return build_rank(spec, contract)


def _dflash_pairs(target_layers):
    """(draft layer index, DFlash tensor, target layer index, target tensor) of every role a Llama layer has."""
    names = {"input_norm.weight": "input_layernorm.weight", "post_norm.weight": "post_attention_layernorm.weight",
             **{f"attn.{p}_proj.weight": f"self_attn.{p}_proj.weight" for p in "qkvo"},
             **{f"{p}_proj.weight": f"mlp.{p}_proj.weight" for p in ("gate", "up", "down")}}
    return [(i, mine, j, theirs) for i, j in enumerate(target_layers) for mine, theirs in names.items()]


def test_dflash_layers_start_as_the_targets_top_layers_read_by_name(debug_target, reads, tmp_path):
    model = _rank(tmp_path, num_layers=2, block_size=4, init_layers="target").core.model
    layers = debug_target.model.model.layers
    pairs = _dflash_pairs([DEBUG_LAYERS - 2, DEBUG_LAYERS - 1])  # draft layer i <- target layer L - k + i
    for i, mine, j, theirs in pairs:
        assert torch.equal(model.layers[i].get_parameter(mine), layers[j].get_parameter(theirs)), (i, mine)
    for layer in model.layers:  # a Llama target has no q/k norms: the drafter's keep their initialisation
        assert torch.equal(layer.attn.q_norm.weight, torch.ones(16))
    copied = {f"model.layers.{j}.{theirs}" for _, _, j, theirs in pairs}
    assert sorted(reads) == sorted({"model.embed_tokens.weight", "model.norm.weight"} | copied)  # no other layer

    random = _rank(tmp_path, num_layers=2, block_size=4).core.model
    for i, mine, j, theirs in pairs:
        if "norm" not in mine:  # norms start at ones either way
            assert not torch.equal(random.layers[i].get_parameter(mine), layers[j].get_parameter(theirs)), (i, mine)


def test_the_provenance_reports_what_was_copied_and_what_kept_its_init(tmp_path):
    eagle3 = _rank(tmp_path, algorithm="eagle3", num_layers=2, init_layers="target").extra["provenance"]["init_layers"]
    assert eagle3["target_layers"] == [DEBUG_LAYERS - 2, DEBUG_LAYERS - 1]
    own = {"input_layernorm.weight", *(f"self_attn.{p}_proj.weight" for p in "qkv")}  # layer 0 reads [E(x); state]
    assert eagle3["copied"] == {**{f"layers.0.{n}": f"model.layers.6.{n}" for n in sorted(LLAMA_LAYER - own)},
                                **{f"layers.1.{n}": f"model.layers.7.{n}" for n in sorted(LLAMA_LAYER)}}
    assert set(eagle3["kept"]) == {f"layers.0.{n}" for n in own | {"hidden_norm.weight"}}
    dflash2 = _rank(tmp_path, algorithm="dflash2", init_layers="target").extra["provenance"]["init_layers"]
    assert dflash2["target_layers"] == [DEBUG_LAYERS - 1] and len(dflash2["copied"]) == len(LLAMA_LAYER)
    assert {n.split(".")[2] for n in dflash2["kept"]} == {"attn", "attention_conv", "mlp_conv"}  # q/k norms, convs
    assert "init_layers" not in _rank(tmp_path, algorithm="dspark").extra["provenance"]


@pytest.mark.parametrize("algorithm", sorted(DRAFTERS))
def test_each_drafters_roles_name_its_layer_tensors_and_a_target_layers(debug_target, algorithm):
    """Every role a drafter names is a tensor of its layer and of a Qwen3 layer (Llama's and its q/k norms)."""
    spec = DRAFTERS[algorithm]
    model = spec.model(spec.debug_config(debug_target), embed_tokens=debug_target.model.model.embed_tokens,
                       lm_head=debug_target.model.lm_head)
    config = Qwen3Config(vocab_size=16, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16)
    with torch.device("meta"):
        target_layer = dict(Qwen3ForCausalLM(config).model.layers[0].named_parameters())
    for index, layer in enumerate(model.layers):
        roles = model.target_layer_tensors(index)
        assert roles and set(roles) <= dict(layer.named_parameters()).keys()
        assert set(roles.values()) <= target_layer.keys()


def test_a_training_step_runs_from_the_copied_layers(tmp_path):
    core = _rank(tmp_path, num_layers=2, block_size=4, init_layers="target").core
    g = torch.Generator().manual_seed(0)
    B, T, V = 2, 24, core.model_config.vocab_size
    width = len(core.model_config.target_layer_ids) * core.model_config.hidden_size
    every = torch.ones(B, T, dtype=torch.bool)
    batch = TrainBatch(input_ids=torch.randint(3, V, (B, T), generator=g), loss_mask=every, attention_mask=every,
                       hidden_states=torch.randn(B, T, width, generator=g), last_hidden_states=None,
                       sample_ids=["a", "b"], num_tokens=B * T)
    before = core.model.layers[1].attn.q_proj.weight.detach().clone()
    result = core.train_step([batch], 0)
    assert torch.isfinite(torch.tensor(result.loss)) and result.grad_norm > 0
    assert not torch.equal(before, core.model.layers[1].attn.q_proj.weight)


@pytest.mark.parametrize("field, value, target_field", [
    ("num_heads", 2, "num_attention_heads=4"), ("num_kv_heads", 1, "num_key_value_heads=2"),
    ("head_dim", 32, "head_dim=16"), ("intermediate_size", 64, "intermediate_size=128"),
])
def test_widths_other_than_the_targets_are_refused_naming_both_fields(tmp_path, field, value, target_field):
    with pytest.raises(ValueError, match=rf"drafter\.{field}={value} differs from the target's {target_field}: leave "
                                         rf"drafter\.{field} unset .* or set drafter\.init_layers=random"):
        _rank(tmp_path, block_size=4, init_layers="target", **{field: value})
    _rank(tmp_path, block_size=4, **{field: value})  # random layers take any width


def test_more_draft_layers_than_the_target_has_are_refused(tmp_path):
    with pytest.raises(ValueError, match=r"drafter\.num_layers=9 decoder layers, and the target has "
                                         r"num_hidden_layers=8: set drafter\.num_layers <= 8"):
        _rank(tmp_path, algorithm="eagle3", num_layers=9, init_layers="target")


def test_init_from_and_init_layers_target_are_refused_together():
    with pytest.raises(ValidationError, match=r"init_from=runs/x/export supplies every layer .* init_layers=target"):
        DRAFTERS["dflash"].section(init_from="runs/x/export", init_layers="target")
    DRAFTERS["dflash"].section(init_from="runs/x/export")


@pytest.mark.slow
def test_the_embedded_targets_top_layer(smollm2, tmp_path):
    model = _rank(tmp_path, target=DEFAULT_TARGET, init_layers="target").core.model
    top = smollm2.num_layers - 1
    for i, mine, j, theirs in _dflash_pairs([top]):
        assert torch.equal(model.layers[i].get_parameter(mine), smollm2.model.model.layers[j].get_parameter(theirs))
