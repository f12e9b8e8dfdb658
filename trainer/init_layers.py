"""Starting a drafter's decoder layers from the target's top layers (``drafter.init_layers=target``).

Draft layer ``i`` of ``k`` starts as a copy of target decoder layer ``L − k + i`` (the target's last
``k`` layers, in order), tensor by tensor. Which draft tensor has the role of which target-layer
tensor is the drafter's knowledge: its module's ``target_layer_tensors(index)`` (``drafters/<a>.py``),
e.g. ``attn.q_proj.weight`` ← ``self_attn.q_proj.weight``. A role the target's family lacks (a Llama
layer's q/k norms) is skipped, and every draft tensor not copied keeps its initialisation (``kept`` in
the report: e.g. the q/k/v of a layer that reads a 2D-wide input, a drafter's own parts).

The target's tensors are read by name from its safetensors shards, as a rank reads its heads
(``capture/target.py``, ``weights="heads"``): only the copied ones, never the whole model. Their
names come from the target's module tree (its decoder layers, built on the meta device).

Refused before anything trains, naming the field and the fix: a drafter whose heads, K/V heads,
head dim or MLP width differ from the target's (its ``hidden_size`` is the target's by
construction: the embedding is shared), and more draft layers than the target has. ``init_from``
with ``init_layers=target`` is refused by the drafter section (``drafters/common.py``).

``init_target_layers`` returns what it did (the target layers, the tensors copied, the draft-layer
tensors kept at their initialisation); ``build_rank`` records it in the run's provenance
(``provenance.init_layers``: every checkpoint and export carries it).
"""

from __future__ import annotations

import torch
from torch import nn

from specray.capture.target import Target, read_tensors
from specray.drafters.common import target_config
from specray.drafters.target_spec import check_supported

# (field of a drafter config and of TargetSpec, the target config field it is read from)
WIDTHS = (("num_heads", "num_attention_heads"), ("num_kv_heads", "num_key_value_heads"), ("head_dim", "head_dim"),
          ("intermediate_size", "intermediate_size"))


def check_init_layers(model_cfg, target: Target) -> None:
    """Raise ValueError naming the field unless the target's top layers fit a drafter of ``model_cfg``."""
    spec = check_supported(target_config(target))
    for field, target_field in WIDTHS:
        mine, theirs = getattr(model_cfg, field), getattr(spec, field)
        if mine != theirs:
            raise ValueError(f"drafter.init_layers=target copies the target's decoder layers, and drafter.{field}="
                             f"{mine} differs from the target's {target_field}={theirs}: leave drafter.{field} "
                             "unset (the target's) or set drafter.init_layers=random")
    if model_cfg.num_layers > spec.num_layers:
        raise ValueError(f"drafter.init_layers=target copies the target's top drafter.num_layers="
                         f"{model_cfg.num_layers} decoder layers, and the target has num_hidden_layers="
                         f"{spec.num_layers}: set drafter.num_layers <= {spec.num_layers} or "
                         "drafter.init_layers=random")


def target_layer_names(model: nn.Module, target: Target) -> dict[str, str]:
    """{drafter parameter name: target checkpoint tensor name} for ``model``'s k decoder layers and the
    target's top k, over the roles the target's layers have."""
    layers = target.model.model.layers
    prefix = next(name for name, module in target.model.named_modules() if module is layers)  # "model.layers"
    first = len(layers) - len(model.layers)
    pairs = {}
    for i in range(len(model.layers)):
        have = dict(layers[first + i].named_parameters())
        pairs.update({f"layers.{i}.{mine}": f"{prefix}.{first + i}.{role}"
                      for mine, role in model.target_layer_tensors(i).items() if role in have})
    return pairs


def init_target_layers(model: nn.Module, model_cfg, target: Target) -> dict:
    """Copy the target's top decoder layers into ``model``'s (module docstring), in place, and return
    the report: ``{"target_layers": [L − k … L − 1], "copied": {drafter tensor: target tensor},
    "kept": [draft-layer tensors at their initialisation]}``."""
    check_init_layers(model_cfg, target)
    pairs = target_layer_names(model, target)
    tensors = read_tensors(target.path, pairs.values(), fix="re-save it with save_pretrained, or set "
                                                            "drafter.init_layers=random")
    params = dict(model.named_parameters())
    with torch.no_grad():
        for mine, name in pairs.items():
            tensor = tensors[name]
            if tensor.shape != params[mine].shape:
                raise ValueError(f"drafter.init_layers=target: the target's {name} is {tuple(tensor.shape)} and the "
                                 f"drafter's {mine} {tuple(params[mine].shape)}; set drafter.init_layers=random")
            params[mine].copy_(tensor)
    k = len(model.layers)
    return {"target_layers": list(range(target.num_layers - k, target.num_layers)), "copied": pairs,
            "kept": [name for name in params if name.startswith("layers.") and name not in pairs]}
