"""The peer export format: an export written as a ``speculators`` checkpoint, which vLLM loads.

    specray export runs/x/exports/final --format speculators [--verifier meta-llama/Llama-3.1-8B-Instruct]
    vllm serve runs/x/exports/final-speculators                     # the verifier its config names

(or ``vllm serve TARGET --speculative-config '{"model": DIR, "method": "dflash"}'``: given only
``model``, vLLM guesses the method from the directory's name and falls back to a plain draft model.)

    <out>/config.json          speculators_model_type, a complete transformer_layer_config (vLLM
                               fills in nothing; its RoPE both as rope_parameters and as the
                               legacy top-level rope_theta / rope_scaling, ``rope_fields``; the
                               legacy keys also at the config's top level),
                               speculators_config (a greedy proposal of k tokens; the verifier:
                               the name the user gives, else the target's recorded name, never a
                               local cache path), and the algorithm's fields
    <out>/model.safetensors    the drafter's weights under the peer names; with a draft
                               vocabulary also d2t, t2d and lm_head.weight; the target's
                               embedding and LM head where the peer model reads them from it
    <out>/specray_export.json  our provenance: the source export's config.json (fingerprints,
                               capture contract) and export.json (sha256 of its weights), the
                               target it was checked against, the verifier, how to serve it,
                               the sha256 of this model.safetensors
    <out>/README.md            the model card (drafters/card.py); every file readable by others

Weights, ours -> peer (speculators 0.9.0 ``DFlashDraftModel`` / ``Eagle3DraftModel``)::

    DFlash                                    peer
    fc.weight                                 fc.weight (input blocks in ascending layer order)
    context_norm.weight                       hidden_norm.weight
    layers.N.input_norm.weight                layers.N.input_layernorm.weight
    layers.N.attn.{q,k,v,o}_proj.weight       layers.N.self_attn.{q,k,v,o}_proj.weight
    layers.N.attn.{q,k}_norm.weight           layers.N.self_attn.{q,k}_norm.weight
    layers.N.post_norm.weight                 layers.N.post_attention_layernorm.weight
    layers.N.{gate,up,down}_proj.weight       layers.N.mlp.{gate,up,down}_proj.weight
    norm.weight                               norm.weight
    layers.N.attn.block_key_bias              (none: refused unless all zero)

    DFlash 2 (``DFlash2DraftModel``): DFlash's names, and the convolutions and the selector under
    the same names as ours (drafters/dflash2.py): layers.N.{attention,mlp}_conv.base_kernel,
    layers.N.{attention,mlp}_conv.kernel_projection.weight, candidate_selector.{predecessor,
    successor}_codebook, candidate_selector.hidden_projection.weight. No draft vocabulary
    (speculators' DFlash 2 predicts over the target's vocabulary only).

    DSpark (``DSparkDraftModel``, ``sample_from_anchor`` true: every block row drafts, the anchor's
    too): DFlash's names, and the heads under the same names as ours (drafters/dspark.py):
    markov_head.markov_w1.weight [V, r] (target ids), markov_head.markov_w2.weight [V_d, r],
    markov_head.{gate_proj,joint_proj}.{weight,bias} (gated / rnn), confidence_head.proj.{weight,bias}.

    EAGLE-3: the drafter's module names are the peer's (drafters/eagle3.py), fc.weight's input
    blocks reordered as for DFlash.

    draft_vocab [V_d] (target ids)            d2t [V_d] int64 offsets (target id = i + d2t[i]),
                                              t2d [V] bool, lm_head.weight [V_d, D] (the target
                                              head's rows); none of the three without one
    (the target's, shared by reference)       EAGLE-3 only: embed_tokens.weight [V, D], and
                                              without a draft vocabulary lm_head.weight [V, D]

speculators' ``Eagle3DraftModel`` reads the embedding and the LM head from the checkpoint (one
missing is left uninitialised), its ``DFlashDraftModel`` reloads them from the verifier; vLLM
takes the target's when they are absent or equal to it. Layer ids: our capture contract counts
decoder-layer *outputs* (``i`` = the residual leaving layer ``i``, capture/contract.py); the
peer counts layer *inputs*, so the same tensor is ``i + 1`` there, listed ascending.

A drafter the peer model cannot express is refused (``PeerFormatError`` naming the field and
the fix) rather than exported to give other logits: DFlash's learned in-block key bias and its
sliding attention (vLLM slides the window per query row; ours ends at the block's anchor).

The pieces the SGLang format (drafters/sglang.py) and the import (drafters/peer_import.py) share
live here: ``load_source`` (an export checked against its target), ``peer_name`` /
``rename_state`` (the name mapping), ``decoder_config`` (a complete transformers config of the
draft layers) and ``write_directory`` (the atomic, readable directory with its card).
"""

from __future__ import annotations

import hashlib
import json
import re
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
from safetensors.torch import save_file
from transformers import LlamaConfig, PretrainedConfig, Qwen3Config

from specray.capture.target import Target, load_target
from specray.drafters.common import d2t_offsets, t2d_mask
from specray.drafters.card import CARD_FILE, PEER_RECORD
from specray.drafters.format import load_drafter, publish_directory, read_drafter_config

SPECULATORS_VERSION = "0.9.0"  # the speculators release whose format this writes (and the tests load)


class PeerFormatError(ValueError):
    """A drafter the peer format cannot express, or an export that cannot be converted."""


@dataclass(frozen=True)
class PeerLayout:
    """How one algorithm's export becomes a speculators checkpoint.

    - ``model_type``: ``speculators_model_type`` (vLLM's speculative method);
    - ``peer_architecture``: the speculators model class name (``architectures``);
    - ``layer_ids_field``: the config field of the captured layer ids (the peer's convention);
    - ``writes_target_head``: the checkpoint holds the target's embedding and, without a draft
      vocabulary, its whole LM head (the peer model reads them from the checkpoint only);
    - ``renames``: (pattern on our state-dict key, peer key template) in order, first match wins;
      a key no pattern matches is an error (a drafter module the layout does not know);
    - ``layer_config``: the transformers config class of the peer's decoder layers;
    - ``fields``: architecture -> the algorithm's top-level config fields;
    - ``speculative_tokens``: architecture -> the proposal's default k;
    - ``refusals``: (architecture, state) -> what the peer cannot express, one message each.
    """

    model_type: str
    peer_architecture: str
    layer_ids_field: str
    writes_target_head: bool
    renames: tuple[tuple[str, str], ...]
    layer_config: type[PretrainedConfig]
    fields: Callable[[dict], dict]
    speculative_tokens: Callable[[dict], int]
    refusals: Callable[[dict, dict[str, torch.Tensor]], list[str]]


def _dflash_refusals(arch: dict, state: dict[str, torch.Tensor]) -> list[str]:
    reasons = []
    biases = {k: v for k, v in state.items() if k.endswith("block_key_bias")}
    worst = max((float(v.abs().max()) for v in biases.values()), default=0.0)
    if worst != 0.0:
        reasons.append(
            f"drafter.block_key_bias: the drafter has a learned in-block key bias (max |bias| {worst:.3g} in "
            f"{sorted(biases)[0]}, …) that no peer model has, so vLLM and speculators would compute other "
            "logits; train with drafter.block_key_bias=0 (off) to export it as speculators, or serve it with specray"
        )
    if arch.get("attention") == "sliding":
        reasons.append(
            "drafter.attention=sliding: vLLM slides the window per query row, specray's ends at the block's anchor, "
            "so the peer would attend to other context; train with drafter.attention=full to export it as speculators"
        )
    return reasons


def _dflash_fields(arch: dict) -> dict:
    # sliding_window_non_causal: speculators reads it for sliding layers only (full attention is
    # bidirectional in the block there), but vLLM makes every draft layer causal when it is False.
    return {"block_size": arch["block_size"], "mask_token_id": arch["mask_token_id"],
            "sliding_window_non_causal": True, "sample_from_anchor": False}


def _eagle3_fields(arch: dict) -> dict:
    # norm_before_residual is always written: vLLM's default (True) is not speculators' (False).
    return {"norm_before_residual": bool(arch["norm_before_residual"]), "norm_before_fc": False,
            "fc_norm": False, "norm_output": False, "embed_requires_grad": False}


PEER_LAYOUTS: dict[str, PeerLayout] = {
    "dflash": PeerLayout(
        model_type="dflash", peer_architecture="DFlashSpeculator", layer_ids_field="aux_hidden_state_layer_ids",
        writes_target_head=False,
        renames=(
            (r"fc\.weight", "fc.weight"),
            (r"context_norm\.weight", "hidden_norm.weight"),
            (r"norm\.weight", "norm.weight"),
            (r"layers\.(\d+)\.input_norm\.weight", r"layers.\1.input_layernorm.weight"),
            (r"layers\.(\d+)\.attn\.([qkvo]_proj|[qk]_norm)\.weight", r"layers.\1.self_attn.\2.weight"),
            (r"layers\.(\d+)\.post_norm\.weight", r"layers.\1.post_attention_layernorm.weight"),
            (r"layers\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight", r"layers.\1.mlp.\2.weight"),
            (r"layers\.(\d+)\.attn\.block_key_bias", ""),  # all zero (else refused): nothing to write
        ),
        layer_config=Qwen3Config, fields=_dflash_fields,
        # vLLM's DFlash runs a block of 1 + k rows: only k = B - 1 attends over the rows ours does
        speculative_tokens=lambda arch: arch["block_size"] - 1,
        refusals=_dflash_refusals,
    ),
    "eagle3": PeerLayout(
        model_type="eagle3", peer_architecture="Eagle3Speculator", layer_ids_field="eagle_aux_hidden_state_layer_ids",
        writes_target_head=True,
        renames=((r"(fc\.weight|norm\.weight|layers\.\d+\..+)", r"\1"),),
        layer_config=LlamaConfig, fields=_eagle3_fields,
        speculative_tokens=lambda arch: 3,  # speculators' default TTT depth; vLLM's num_speculative_tokens overrides it
        refusals=lambda arch, state: [],
    ),
}


def _dflash2_refusals(arch: dict, state: dict[str, torch.Tensor]) -> list[str]:
    reasons = _dflash_refusals(arch, state)
    if arch.get("draft_vocab_size") is not None:
        reasons.append("drafter.draft_vocab_size: speculators' DFlash 2 predicts over the target's whole vocabulary; "
                       "train with drafter.draft_vocab_size=null to export it as speculators, or serve it with specray")
    return reasons


def _dflash2_fields(arch: dict) -> dict:
    # K is capped at the vocabulary here (drafters/dflash2.py); the peer refuses a larger selector_top_k
    return {**_dflash_fields(arch), "conv_kernel_size": arch["conv_kernel_size"],
            "conv_group_size": arch["conv_group_size"], "selector_rank": arch["selector_rank"],
            "selector_top_k": min(arch["selector_top_k"], arch["vocab_size"])}


PEER_LAYOUTS["dflash2"] = PeerLayout(
    model_type="dflash2", peer_architecture="DFlash2DraftModel", layer_ids_field="aux_hidden_state_layer_ids",
    writes_target_head=False,
    renames=PEER_LAYOUTS["dflash"].renames + (
        (r"layers\.(\d+)\.(attention_conv|mlp_conv)\.(base_kernel|kernel_projection\.weight)", r"layers.\1.\2.\3"),
        (r"candidate_selector\.(predecessor_codebook|successor_codebook|hidden_projection\.weight)",
         r"candidate_selector.\1"),
    ),
    layer_config=Qwen3Config, fields=_dflash2_fields, speculative_tokens=PEER_LAYOUTS["dflash"].speculative_tokens,
    refusals=_dflash2_refusals,
)


def _dspark_fields(arch: dict) -> dict:
    return {**_dflash_fields(arch), "sample_from_anchor": True, "markov_rank": arch["markov_rank"],
            "markov_head_type": arch["markov_head_type"], "enable_confidence_head": True,
            "confidence_head_with_markov": arch["confidence_head_with_markov"]}


PEER_LAYOUTS["dspark"] = PeerLayout(
    model_type="dspark", peer_architecture="DSparkSpeculator", layer_ids_field="aux_hidden_state_layer_ids",
    writes_target_head=False,
    renames=PEER_LAYOUTS["dflash"].renames + (
        (r"markov_head\.(markov_w1|markov_w2|gate_proj|joint_proj)\.(weight|bias)", r"markov_head.\1.\2"),
        (r"confidence_head\.proj\.(weight|bias)", r"confidence_head.proj.\1"),
    ),
    layer_config=Qwen3Config, fields=_dspark_fields,
    speculative_tokens=lambda arch: arch["block_size"],  # m = B: the anchor row drafts too
    refusals=_dflash_refusals,
)


def peer_layer_ids(layer_ids: list[int]) -> list[int]:
    """Our decoder-layer-output ids -> the peer's layer-input ids, ascending: ``[8, 1, 14] -> [2, 9, 15]``."""
    return sorted(i + 1 for i in layer_ids)


def ascending_fc(fc_weight: torch.Tensor, layer_ids: list[int]) -> torch.Tensor:
    """fc.weight [D, L·D] with its input blocks (one per captured layer, in ``layer_ids`` order)
    reordered ascending by layer id: ids ``[8, 1]`` -> blocks ``[W_1 | W_8]``."""
    blocks = fc_weight.chunk(len(layer_ids), dim=1)  # each [D, D]
    return torch.cat([blocks[i] for i in sorted(range(len(layer_ids)), key=layer_ids.__getitem__)], dim=1)


def peer_name(renames: tuple[tuple[str, str], ...], key: str, fmt: str) -> str:
    """The peer's name of our state-dict key ``key`` (the first matching pattern of ``renames``; an
    empty template: the peer has no such tensor, "")."""
    for pattern, template in renames:
        if re.fullmatch(pattern, key):
            return re.sub(pattern, template, key) if template else ""
    raise PeerFormatError(f"weight {key!r} has no name in the {fmt} format; the drafter has a module this "
                          "specray cannot export (drafters/peer.py, drafters/sglang.py layouts)")


def rename_state(renames: tuple[tuple[str, str], ...], state: dict[str, torch.Tensor], layer_ids: list[int],
                 fmt: str) -> dict[str, torch.Tensor]:
    """The drafter's own weights under a peer's names (``peer_name``), fc.weight's input blocks
    ascending (``draft_vocab`` is handled by ``target_tensors``)."""
    out: dict[str, torch.Tensor] = {}
    for key, tensor in state.items():
        if key != "draft_vocab" and (name := peer_name(renames, key, fmt)):
            out[name] = tensor.detach().contiguous()
    out["fc.weight"] = ascending_fc(out["fc.weight"], layer_ids).contiguous()
    return out


def peer_state(layout: PeerLayout, state: dict[str, torch.Tensor], layer_ids: list[int]) -> dict[str, torch.Tensor]:
    """The drafter's own weights under the speculators names."""
    return rename_state(layout.renames, state, layer_ids, f"speculators {layout.model_type}")


def target_tensors(layout: PeerLayout, draft_vocab: torch.Tensor | None, embed_weight: torch.Tensor,
                   head_weight: torch.Tensor) -> dict[str, torch.Tensor]:
    """What the peer needs of the target: with a draft vocabulary [V_d], d2t [V_d], t2d [V] and the
    head's rows lm_head.weight [V_d, D]; where the layout says so, the embedding [V, D] and
    (without a draft vocabulary) the whole head [V, D]. Copies: a tied target shares their memory."""
    out: dict[str, torch.Tensor] = {}
    if draft_vocab is not None:
        ids = draft_vocab.long()
        out.update({"d2t": d2t_offsets(ids), "t2d": t2d_mask(ids, head_weight.shape[0]),
                    "lm_head.weight": head_weight.detach()[ids].contiguous()})
    if layout.writes_target_head:
        out["embed_tokens.weight"] = embed_weight.detach().clone()
        out.setdefault("lm_head.weight", head_weight.detach().clone())
    return out


def rope_fields(arch: dict) -> dict:
    """The drafter's RoPE in both encodings transformers has used: ``rope_parameters`` (transformers
    5: ``rope_type``, ``rope_theta`` and the type's fields) and the legacy top-level ``rope_theta``,
    with ``rope_scaling`` (the type's fields) where the type is not ``default``; a loader on
    transformers 4.x reads only the legacy keys and would otherwise take theta = 10000.

    Reads what the drafter config holds: ``rope_parameters`` or ``rope_scaling`` when it has one,
    and ``rope_theta``. Example: theta 5e5, llama3 scaling ->
    ``{"rope_parameters": {"rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0, ...},
    "rope_theta": 5e5, "rope_scaling": {"rope_type": "llama3", "factor": 8.0, ...}}``."""
    given = arch.get("rope_parameters") or arch.get("rope_scaling") or {}
    params = {k: v for k, v in given.items() if k != "type"}
    params["rope_type"] = given.get("rope_type") or given.get("type") or "default"
    theta = given.get("rope_theta", arch.get("rope_theta", 10000.0))
    params["rope_theta"] = float(theta)
    fields = {"rope_parameters": params, "rope_theta": params["rope_theta"]}
    if params["rope_type"] != "default":
        fields["rope_scaling"] = {k: v for k, v in params.items() if k != "rope_theta"}
    return fields


def layer_config(layout: PeerLayout, arch: dict, target: Target, dtype: torch.dtype) -> dict:
    """The complete transformers config of the peer's decoder layers (every field written)."""
    return decoder_config(layout.layer_config, arch, target, dtype)


def decoder_config(config_cls: type[PretrainedConfig], arch: dict, target: Target, dtype: torch.dtype) -> dict:
    """A complete ``config_cls`` (a transformers config) of the drafter's decoder layers, with the
    RoPE fields in both encodings (``rope_fields``)."""
    tcfg = target.model.config
    rope = rope_fields(arch)
    config = config_cls(
        vocab_size=arch["vocab_size"], hidden_size=arch["hidden_size"],
        intermediate_size=arch["intermediate_size"], num_hidden_layers=arch["num_layers"],
        num_attention_heads=arch["num_heads"], num_key_value_heads=arch["num_kv_heads"], head_dim=arch["head_dim"],
        hidden_act="silu", rms_norm_eps=arch["rms_norm_eps"], attention_bias=False,
        # the drafter's RoPE, which is the target's (drafters/rope.py): the peer's rotary class computes it
        rope_parameters=dict(rope["rope_parameters"]),
        max_position_embeddings=arch.get("max_position_embeddings") or tcfg.max_position_embeddings,
        tie_word_embeddings=False,
        pad_token_id=tcfg.pad_token_id, bos_token_id=tcfg.bos_token_id, eos_token_id=tcfg.eos_token_id,
    ).to_dict()
    config.update(rope)
    config["dtype"] = str(dtype).removeprefix("torch.")
    return config


def peer_config(layout: PeerLayout, arch: dict, target: Target, dtype: torch.dtype,
                num_speculative_tokens: int | None, verifier_name_or_path: str) -> dict:
    """config.json of the speculators checkpoint."""
    k = num_speculative_tokens if num_speculative_tokens is not None else layout.speculative_tokens(arch)
    return {
        "architectures": [layout.peer_architecture],
        "speculators_model_type": layout.model_type,
        "speculators_version": SPECULATORS_VERSION,
        "transformer_layer_config": layer_config(layout, arch, target, dtype),
        "draft_vocab_size": arch["draft_vocab_size"] or arch["vocab_size"],
        "target_hidden_size": arch["hidden_size"],
        # the legacy RoPE keys at the top level too: a loader that reads the draft's RoPE there (with the
        # length transformers' RoPE standardisation reads beside rope_scaling)
        **{k: v for k, v in rope_fields(arch).items() if k != "rope_parameters"},
        "max_position_embeddings": arch.get("max_position_embeddings") or target.config.max_position_embeddings,
        layout.layer_ids_field: peer_layer_ids(list(arch["target_layer_ids"])),
        **layout.fields(arch),
        "speculators_config": {
            "algorithm": layout.model_type,
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": k,
                                  "verifier_accept_k": 1, "accept_tolerance": 0.0}],
            "default_proposal_method": "greedy",
            "verifier": {"name_or_path": verifier_name_or_path,
                         "architectures": list(target.model.config.architectures or [])},
        },
        "dtype": str(dtype).removeprefix("torch."),
    }


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            digest.update(chunk)
    return "sha256:" + digest.hexdigest()


def _layout(algorithm: str) -> PeerLayout:
    if algorithm not in PEER_LAYOUTS:
        raise PeerFormatError(f"algorithm {algorithm!r} has no speculators layout; exportable: {sorted(PEER_LAYOUTS)}")
    return PEER_LAYOUTS[algorithm]


def _resolve_target(target: Target | str | None, export: dict, src: Path) -> Target:
    """``target`` itself, else the target named by it, else the one named in the export's provenance."""
    if isinstance(target, Target):
        return target
    name = target or export.get("target")
    if not name:
        raise PeerFormatError(f"{src}/export.json names no target; pass the target the drafter was trained for (--target)")
    return load_target(name)


@dataclass
class SourceExport:
    """A specray export, checked against its target, about to be written in a peer format."""

    path: Path
    config: dict  # its config.json
    export: dict  # its export.json
    target: Target
    model: torch.nn.Module  # the loaded drafter (the target's embedding and LM head shared)
    verifier: str  # what the peer config names as the verifier

    @property
    def arch(self) -> dict:
        return self.model.config.to_dict()


def default_verifier(export: dict, target: Target) -> str:
    """The verifier a peer config names when the user names none: the target's recorded name (the
    name the drafter was trained with, export.json's ``target``), never a local cache path."""
    return str(export.get("target") or target.name)


def load_source(export_dir: str | Path, target: Target | str | None, verifier: str | None) -> SourceExport:
    """Read and check the specray export ``export_dir`` against ``target`` (default: the one its
    export.json names), as serving would (``load_drafter``)."""
    src = Path(export_dir)
    config = read_drafter_config(src)
    export = json.loads((src / "export.json").read_text())
    target = _resolve_target(target, export, src)
    model = load_drafter(src, embed_tokens=target.model.get_input_embeddings(),
                         lm_head=target.model.get_output_embeddings(),
                         target_fingerprint=target.target_fingerprint, template_fingerprint=target.template_fingerprint)
    if verifier is not None and not verifier.strip():
        raise PeerFormatError("--verifier is empty; name the verifier as a Hugging Face id or a path, or leave it "
                              "out for the target's recorded name")
    return SourceExport(src, config, export, target, model, verifier or default_verifier(export, target))


def peer_record(source: SourceExport, *, fmt: str, format_name: str, serve_commands: list[str]) -> dict:
    """A peer export's ``specray_export.json``: where it came from (the source export's config.json
    and export.json, the target it was checked against), the verifier it names, how to serve it."""
    t = source.target
    return {"source": str(source.path.resolve()), "format": fmt, "format_name": format_name,
            "verifier": source.verifier, "serve_commands": serve_commands,
            "target": {"name": t.name, "target_fingerprint": t.target_fingerprint,
                       "template_fingerprint": t.template_fingerprint},
            "source_config": source.config, "source_export": source.export}


def write_peer_export(export_dir: str | Path, out_dir: str | Path, *, target: Target | str | None = None,
                      num_speculative_tokens: int | None = None, verifier_name_or_path: str | None = None) -> Path:
    """Write the specray export ``export_dir`` as a speculators checkpoint at ``out_dir``.

    ``target``: the target the drafter was trained for (a loaded ``Target`` or a name; default:
    the one named in export.json); the export is checked against its fingerprints and its LM
    head gives ``lm_head.weight``. ``num_speculative_tokens``: the proposal's k (default: the
    layout's). ``verifier_name_or_path``: what the config names as verifier, an HF id or a path
    (default: the target's recorded name, ``default_verifier``).
    """
    out = Path(out_dir)
    if out.exists():
        raise FileExistsError(f"{out} exists; choose a new directory for the speculators export")
    source = load_source(export_dir, target, verifier_name_or_path)
    layout = _layout(source.config["algorithm"])
    arch, state = source.arch, source.model.state_dict()
    reasons = layout.refusals(arch, state)
    if reasons:
        raise PeerFormatError(f"{source.path} cannot be exported in the speculators format: " + "; ".join(reasons))
    dtype = state["fc.weight"].dtype
    model = source.model
    tensors = {**peer_state(layout, state, list(arch["target_layer_ids"])),
               **target_tensors(layout, state.get("draft_vocab"), model.embed_tokens.weight.to(dtype),
                                model.lm_head.weight.to(dtype))}
    peer = peer_config(layout, arch, source.target, dtype, num_speculative_tokens, source.verifier)
    record = peer_record(source, fmt=f"speculators {SPECULATORS_VERSION}", format_name="speculators",
                         serve_commands=[f"vllm serve {out.name}    # serves the verifier {source.verifier}"])
    return write_directory(out, peer, tensors, record)


def write_directory(out: Path, config: dict, tensors: dict[str, torch.Tensor], record: dict,
                    extra: dict[str, str] | None = None) -> Path:
    """Write a peer export atomically (a temporary sibling renamed into place): ``model.safetensors``,
    ``config.json``, ``specray_export.json`` (``record`` and this file's sha256), the model card and
    the ``extra`` files (name -> text), every file readable by other users."""
    from specray.drafters.card import render_card

    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{out.name}-"))
    try:
        save_file(tensors, tmp / "model.safetensors", metadata={"format": "pt"})
        (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        record = dict(record, weights_sha256=_sha256(tmp / "model.safetensors"))
        (tmp / PEER_RECORD).write_text(json.dumps(record, indent=2, default=str) + "\n")
        for name, text in (extra or {}).items():
            (tmp / name).write_text(text)
        (tmp / CARD_FILE).write_text(render_card(tmp))
        publish_directory(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out
