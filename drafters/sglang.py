"""The SGLang export format: EAGLE-3 as ``LlamaForCausalLMEagle3`` (SpecForge's layout), the DFlash
family in z-lab's format (``dflash_config``), both as SGLang 0.5.23 loads them.

    specray export runs/x/exports/final --format sglang [--verifier Qwen/Qwen3-8B]   # -> final-sglang
    python -m sglang.launch_server --model-path TARGET --speculative-algorithm EAGLE3 \\
        --speculative-draft-model-path runs/x/exports/final-sglang          # DFLASH / DSPARK / DFLASH2 likewise

**EAGLE-3** (``sglang/srt/models/llama_eagle3.py``; SpecForge's ``export/to_sglang.py`` writes the
same names). config.json is a complete ``LlamaConfig`` of the draft layers with
``architectures: ["LlamaForCausalLMEagle3"]``, ``draft_vocab_size``, ``target_hidden_size`` and
``eagle_config.eagle_aux_hidden_state_layer_ids``: SGLang's ids are decoder-layer *outputs*, ours
(it captures the input of layer ``i + 1``), and it concatenates the captured layers in ascending
order, so the ids are written ascending and fc.weight's input blocks follow. Weights::

    ours                                       SGLang / SpecForge
    fc.weight                                  fc.weight (input blocks ascending by layer id)
    layers.0.*                                 midlayer.*  (SGLang reads it as layers.0)
    layers.N.input_layernorm.weight, N > 0     layers.N.hidden_norm.weight (SGLang's later layers
                                               normalise the state with hidden_norm)
    layers.N.*, N > 0                          layers.N.*
    norm.weight                                norm.weight
    draft_vocab [V_d] / none                   lm_head.weight [V_d, D] (the target head's rows),
                                               d2t [V_d] (target id = i + d2t[i]), t2d [V] bool;
                                               without a draft vocabulary the whole head, d2t zeros
                                               and t2d all true (SpecForge's loader requires them)

SGLang shares the target's embedding (not written) and reads the state itself as the first
layer's residual: a drafter with ``norm_before_residual`` is refused. ``norm_output`` is not
written: SGLang reads it as "feed the normed state to the next step" (default false), SpecForge as
"normalise before the LM head" (default true), and both defaults are what ours computes.
SpecForge's own ``LlamaForCausalLMEagle3`` (0.2.0, which loads this directory for fine-tuning)
holds one draft layer (``midlayer``); SGLang reads any number.

**DFlash, DSpark, DFlash 2** (z-lab's ``dflash`` package; SGLang's ``models/dflash.py``,
``models/dspark.py``). config.json is a complete ``Qwen3Config`` of the draft layers with
``layer_types`` (all ``full_attention``: bidirectional in the block), ``num_target_layers`` and
``dflash_config``: ``target_layer_ids`` (decoder-layer outputs, ascending: z-lab concatenates them
in list order, SGLang in layer order), ``mask_token_id``, ``block_size``, ``num_target_layers``;
DFlash 2 adds ``conv_kernel_size``, ``conv_group_size``, ``selector_rank``, ``selector_top_k``;
DSpark adds its head fields (``markov_rank``, ``markov_head_type``, ``confidence_head_with_markov``,
``enable_confidence_head``, ``sample_from_anchor: true``) there and at the top level, where
SGLang's head builder reads them. Weights are the speculators names (``drafters/peer.py``): the
same in z-lab's and SGLang's loaders. A calibrated DSpark export (``specray calibrate``) also gets
``sts_calibration.greedy.json`` and ``sts_calibration.sampling.json``: its confidence temperatures
of each serving mode in SGLang's ``DSparkStsCalibration`` format with the ``mode`` they are for.
SGLang's ``--speculative-dspark-confidence-sts-path`` takes one table for all requests: the
record's serve commands name each file with the requests it fits. Neither format reads a draft
vocabulary (the target's head predicts), DFlash's learned block-key bias or its sliding attention:
those are refused.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
from transformers import LlamaConfig, PretrainedConfig, Qwen3Config

from specray.capture.target import Target
from specray.drafters.peer import (PEER_LAYOUTS, PeerFormatError, SourceExport, decoder_config, load_source,
                                   peer_record, rename_state, write_directory)

SGLANG_VERSION = "0.5.23"  # the SGLang release whose loaders this format follows


@dataclass(frozen=True)
class SglangLayout:
    """How one algorithm's export becomes an SGLang draft directory.

    - ``architecture``: the SGLang model class (``architectures``);
    - ``algorithm``: ``--speculative-algorithm``;
    - ``layer_config``: the transformers config class of the draft layers;
    - ``renames``: (pattern on our state-dict key, SGLang key template), first match wins;
    - ``fields``: (architecture, target) -> the format's own config fields;
    - ``target_tensors``: (draft vocabulary or None, the target head's weight) -> tensors of the target;
    - ``refusals``: (architecture, state) -> what the format cannot express, one message each;
    - ``extra_files``: (the loaded drafter, the source export) -> {file name: text} beside the weights.
    """

    architecture: str
    algorithm: str
    layer_config: type[PretrainedConfig]
    renames: tuple[tuple[str, str], ...]
    fields: Callable[[dict, Target], dict]
    target_tensors: Callable[[torch.Tensor | None, torch.Tensor], dict[str, torch.Tensor]]
    refusals: Callable[[dict, dict[str, torch.Tensor]], list[str]]
    extra_files: Callable[[torch.nn.Module, Path], dict[str, str]] = lambda model, source: {}


STS_FILE = "sts_calibration.{mode}.json"  # per serving mode: SGLang's --speculative-dspark-confidence-sts-path
STS_USE = {"greedy": "greedy requests (temperature 0): survival = argmax match",
           "sampling": "sampled requests: survival = overlap 1 - TV"}


def _dspark_calibration(model: torch.nn.Module, source: Path) -> dict[str, str]:
    """DSpark's confidence temperatures, when the export was calibrated (``specray calibrate``): one file
    per serving mode (``STS_FILE``), each in SGLang's ``DSparkStsCalibration`` format (one temperature per
    draft position, the mode's ECE per position before and after) with the ``mode`` it was fitted for
    (SGLang reads one table for every request, and ignores the fields it does not know)."""
    from specray.drafters.dspark import CALIBRATION_FILE, CALIBRATION_MODES, read_calibration

    if not (source / CALIBRATION_FILE).is_file():
        return {}
    body = json.loads((source / CALIBRATION_FILE).read_text())
    tables = read_calibration(source, model.config.block_size)  # checked against the export
    files = {}
    for mode in CALIBRATION_MODES:
        fitted = (body.get("modes") or {}).get(mode, {})
        sts = {"temperatures": tables[mode], "dataset": str(body.get("manifest", "")),
               "num_samples": int(body.get("blocks", 0)), "mode": mode, "use_for": STS_USE[mode]}
        for ours, theirs in (("ece_by_pos_before", "ece_before"), ("ece_by_pos_after", "ece_after")):
            if isinstance(fitted.get(ours), list):
                sts[theirs] = [float(v) for v in fitted[ours]]
        files[STS_FILE.format(mode=mode)] = json.dumps(sts, indent=2) + "\n"
    return files


def _eagle3_fields(arch: dict, target: Target) -> dict:
    # No norm_output: SGLang reads it as "feed the normed state to the next step" (default false),
    # SpecForge as "normalise before the LM head" (default true); both defaults are ours.
    return {"draft_vocab_size": arch["draft_vocab_size"] or arch["vocab_size"], "target_hidden_size": arch["hidden_size"],
            "eagle_config": {"eagle_aux_hidden_state_layer_ids": sorted(arch["target_layer_ids"]),
                             "use_aux_hidden_state": True},
            "norm_before_fc": False, "fc_norm": False}


def _eagle3_head(draft_vocab: torch.Tensor | None, head_weight: torch.Tensor) -> dict[str, torch.Tensor]:
    V = head_weight.shape[0]
    ids = torch.arange(V) if draft_vocab is None else draft_vocab.long()
    t2d = torch.zeros(V, dtype=torch.bool)
    t2d[ids] = True
    return {"lm_head.weight": head_weight.detach()[ids].contiguous(), "d2t": ids - torch.arange(len(ids)), "t2d": t2d}


def _eagle3_refusals(arch: dict, state: dict[str, torch.Tensor]) -> list[str]:
    if arch["norm_before_residual"]:
        return ["drafter.norm_before_residual=true: SGLang's LlamaForCausalLMEagle3 keeps the state itself as the "
                "first layer's residual; train with drafter.norm_before_residual=false to export it for SGLang, or "
                "export it as speculators (vLLM reads both)"]
    return []


def _dflash_fields(arch: dict, target: Target) -> dict:
    draft = {"target_layer_ids": sorted(arch["target_layer_ids"]), "mask_token_id": arch["mask_token_id"],
             "block_size": arch["block_size"], "num_target_layers": target.num_layers}
    return {"block_size": arch["block_size"], "num_target_layers": target.num_layers,
            "layer_types": ["full_attention"] * arch["num_layers"], "use_sliding_window": False,
            "sliding_window": None, "dflash_config": draft}


def _dflash2_fields(arch: dict, target: Target) -> dict:
    fields = _dflash_fields(arch, target)
    fields["dflash_config"].update(conv_kernel_size=arch["conv_kernel_size"], conv_group_size=arch["conv_group_size"],
                                   selector_rank=arch["selector_rank"],
                                   selector_top_k=min(arch["selector_top_k"], arch["vocab_size"]))
    return fields


def _dspark_fields(arch: dict, target: Target) -> dict:
    head = {"markov_rank": arch["markov_rank"], "markov_head_type": arch["markov_head_type"],
            "confidence_head_with_markov": arch["confidence_head_with_markov"], "enable_confidence_head": True,
            "sample_from_anchor": True}  # every block row drafts, the anchor's too (m = B)
    fields = _dflash_fields(arch, target)
    fields["dflash_config"].update(head)
    return {**fields, **head}


def _zlab_refusals(arch: dict, state: dict[str, torch.Tensor]) -> list[str]:
    reasons = []
    worst = max((float(v.abs().max()) for k, v in state.items() if k.endswith("block_key_bias")), default=0.0)
    if worst != 0.0:
        reasons.append(f"drafter.block_key_bias: the drafter has a learned in-block key bias (max |bias| {worst:.3g}) "
                       "that neither SGLang nor z-lab's dflash has, so they would compute other logits; train with "
                       "drafter.block_key_bias=0 (off) to export it for SGLang, or serve it with specray")
    if arch.get("attention") == "sliding":
        reasons.append("drafter.attention=sliding: SGLang and z-lab slide the window per query row, specray's ends "
                       "at the block's anchor; train with drafter.attention=full to export it for SGLang")
    if arch.get("draft_vocab_size") not in (None, arch["vocab_size"]):  # all V ids: the whole vocabulary
        reasons.append("drafter.draft_vocab_size: SGLang's and z-lab's DFlash-family drafts predict over the target's "
                       "whole vocabulary with its LM head; train with drafter.draft_vocab_size=null to export it for "
                       "SGLang, or export it as speculators (vLLM reads a draft vocabulary)")
    return reasons


def _no_target_tensors(draft_vocab: torch.Tensor | None, head_weight: torch.Tensor) -> dict[str, torch.Tensor]:
    return {}  # the target's embedding and LM head come from the target


SGLANG_LAYOUTS: dict[str, SglangLayout] = {
    "eagle3": SglangLayout(
        architecture="LlamaForCausalLMEagle3", algorithm="EAGLE3", layer_config=LlamaConfig,
        renames=((r"fc\.weight", "fc.weight"), (r"norm\.weight", "norm.weight"),
                 (r"layers\.0\.(.+)", r"midlayer.\1"),
                 (r"layers\.([1-9]\d*)\.input_layernorm\.weight", r"layers.\1.hidden_norm.weight"),
                 (r"layers\.([1-9]\d*)\.(.+)", r"layers.\1.\2")),
        fields=_eagle3_fields, target_tensors=_eagle3_head, refusals=_eagle3_refusals,
    ),
    "dflash": SglangLayout(
        architecture="DFlashDraftModel", algorithm="DFLASH", layer_config=Qwen3Config,
        renames=PEER_LAYOUTS["dflash"].renames, fields=_dflash_fields, target_tensors=_no_target_tensors,
        refusals=_zlab_refusals,
    ),
    "dflash2": SglangLayout(
        architecture="DFlash2DraftModel", algorithm="DFLASH2", layer_config=Qwen3Config,
        renames=PEER_LAYOUTS["dflash2"].renames, fields=_dflash2_fields, target_tensors=_no_target_tensors,
        refusals=_zlab_refusals,
    ),
    "dspark": SglangLayout(
        architecture="DSparkDraftModel", algorithm="DSPARK", layer_config=Qwen3Config,
        renames=PEER_LAYOUTS["dspark"].renames, fields=_dspark_fields, target_tensors=_no_target_tensors,
        refusals=_zlab_refusals, extra_files=_dspark_calibration,
    ),
}


def sglang_config(layout: SglangLayout, arch: dict, target: Target, dtype: torch.dtype) -> dict:
    """config.json of the SGLang draft directory: the draft layers' complete config and the format's fields."""
    config = decoder_config(layout.layer_config, arch, target, dtype)
    config.update(architectures=[layout.architecture], **layout.fields(arch, target))
    return config


def write_sglang_export(export_dir: str | Path, out_dir: str | Path, *, target: Target | str | None = None,
                        verifier_name_or_path: str | None = None) -> Path:
    """Write the specray export ``export_dir`` as an SGLang draft directory at ``out_dir``.

    ``target`` and ``verifier_name_or_path`` as for ``drafters/peer.py::write_peer_export``; the
    verifier is the ``--model-path`` the card's serve command names (SGLang's draft config has no
    field for it)."""
    out = Path(out_dir)
    if out.exists():
        raise FileExistsError(f"{out} exists; choose a new directory for the SGLang export")
    source: SourceExport = load_source(export_dir, target, verifier_name_or_path)
    algorithm = source.config["algorithm"]
    if algorithm not in SGLANG_LAYOUTS:
        raise PeerFormatError(f"algorithm {algorithm!r} has no SGLang layout; exportable: {sorted(SGLANG_LAYOUTS)}")
    layout = SGLANG_LAYOUTS[algorithm]
    arch, state = source.arch, source.model.state_dict()
    reasons = layout.refusals(arch, state)
    if reasons:
        raise PeerFormatError(f"{source.path} cannot be exported in the SGLang format: " + "; ".join(reasons))
    dtype = state["fc.weight"].dtype
    tensors = {**rename_state(layout.renames, state, list(arch["target_layer_ids"]), f"SGLang {layout.architecture}"),
               **layout.target_tensors(state.get("draft_vocab"), source.model.lm_head.weight.to(dtype))}
    extra = layout.extra_files(source.model, source.path)
    launch = (f"python -m sglang.launch_server --model-path {source.verifier} --speculative-algorithm "
              f"{layout.algorithm} --speculative-draft-model-path {out.name}")
    tables = [(STS_FILE.format(mode=mode), use) for mode, use in STS_USE.items() if STS_FILE.format(mode=mode) in extra]
    serve = ([f"{launch} --speculative-dspark-confidence-sts-path {out.name}/{name}    # {use}" for name, use in tables]
             or [launch])
    record = peer_record(source, fmt=f"SGLang {SGLANG_VERSION} ({layout.architecture})", format_name="sglang",
                         serve_commands=serve)
    return write_directory(out, sglang_config(layout, arch, source.target, dtype), tensors, record, extra)
