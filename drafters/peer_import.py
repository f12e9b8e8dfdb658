"""Import a drafter published in a peer format into a specray export (``specray import``).

    specray import z-lab/Qwen3-8B-DFlash-b16 --out runs/imported/dflash --target /models/Qwen3-8B
    drafter.init_from: /path/to/speculators-drafter        # train, evaluate, serve: imported on use

Formats read (``detect``): speculators (``speculators_model_type``: eagle3, dflash, dspark,
dflash2; what vLLM serves), SGLang / SpecForge EAGLE-3 (``LlamaForCausalLMEagle3``) and z-lab's
DFlash family (``DFlashDraftModel``, ``DFlash2DraftModel``, ``DSparkDraftModel`` with
``dflash_config``; what SGLang serves). The names and conventions are the inverse of the writers'
(``drafters/peer.py``, ``drafters/sglang.py``): a tensor's name is the one our writer gives the
same weight, layer ids are converted to decoder-layer outputs (speculators counts inputs: ``i −
1``), and the contract lists them in the order the peer's fc reads them (ascending for
speculators and SGLang, as listed for z-lab), so fc.weight is taken as is.

The checks are an export's (``drafters/format.py``), against the target named by ``--target``
(the verifier a speculators config names, by default) before anything is loaded:

- every architecture field within the bounds of the target (``check_architecture``), the
  target's hidden size, vocabulary and layer count, the captured layers inside it;
- the config fields our drafter cannot compute are refused by name (``PeerFormatError``):
  sliding or causal in-block attention, biases, another activation or RoPE type, z-lab's output
  multiplier / soft-capping / embedding scale / attention sinks, norm placements EAGLE-3 drafts
  may add, DSpark without its confidence head or anchor row;
- the tensors in the safetensors headers are exactly those the architecture implies, with their
  shapes; the LM head rows and embedding a peer checkpoint carries must equal the target's
  (ours share the target's): a checkpoint of another target is refused;
- a directory our writers made (``specray_export.json``) must carry this target's fingerprints.

The result is a complete export (provenance: the peer directory, its format and config, the
checks) that ``load_drafter`` then validates like any other. A DSpark directory's SGLang STS
files (``sts_calibration.{greedy,sampling}.json``) become its ``calibration.json``.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file

from specray.capture.contract import build_contract, eagle3_layer_ids
from specray.capture.target import Target, cache_dir, load_target
from specray.drafters.rope import ROPE_TYPES
from specray.drafters import get_drafter
from specray.drafters.card import PEER_RECORD
from specray.drafters.format import (MAX_CONFIG_BYTES, check_architecture, load_drafter, read_safetensors_header,
                                     save_drafter)
from specray.drafters.peer import PEER_LAYOUTS, PeerFormatError, peer_name
from specray.drafters.sglang import SGLANG_LAYOUTS, STS_FILE

SPECULATORS_ALGORITHMS = ("eagle3", "dflash", "dspark", "dflash2")
ZLAB_ARCHITECTURES = {"DFlashDraftModel": "dflash", "DFlash2DraftModel": "dflash2", "DSparkDraftModel": "dspark",
                      "Qwen3DSparkModel": "dspark"}
TARGET_TENSORS = ("d2t", "t2d", "lm_head.weight", "embed_tokens.weight")  # what a peer may carry of the target
ZLAB_MASK_TOKEN = "<|MASK|>"  # SGLang's default dflash_config.mask_token


@dataclass
class PeerDrafter:
    """A peer directory read into our terms (nothing loaded but its config)."""

    path: Path
    fmt: str  # "speculators", "sglang" (EAGLE-3) or "zlab" (the DFlash family)
    algorithm: str
    config: dict  # the peer's config.json
    arch: dict  # our architecture (the algorithm's config ``to_dict()``), draft_vocab_size from the header
    layer_ids: list[int]  # decoder-layer outputs, in the order the peer's fc reads them
    renames: tuple[tuple[str, str], ...]  # our key -> the peer's (drafters/peer.py, drafters/sglang.py)
    verifier: str | None  # the verifier the config names, if any


def _read_config(path: Path) -> dict:
    file = path / "config.json"
    if not file.is_file():
        raise PeerFormatError(f"{path} has no config.json: give a drafter directory (speculators, SGLang / "
                              "SpecForge or z-lab format)")
    if file.stat().st_size > MAX_CONFIG_BYTES:
        raise PeerFormatError(f"{file} is larger than {MAX_CONFIG_BYTES} bytes: not a drafter's config")
    config = json.loads(file.read_text())
    if not isinstance(config, dict):
        raise PeerFormatError(f"{file} is not a JSON object")
    return config


def is_peer_directory(path: str | Path) -> bool:
    """True for a directory with a config.json that is not a specray export's (no ``format_version``)."""
    file = Path(path) / "config.json"
    if not file.is_file() or file.stat().st_size > MAX_CONFIG_BYTES:
        return False
    config = json.loads(file.read_text())
    return isinstance(config, dict) and "format_version" not in config


def detect(config: dict, path: Path) -> tuple[str, str]:
    """(format, algorithm) of a peer config."""
    if "speculators_model_type" in config:
        kind = config["speculators_model_type"]
        if kind not in SPECULATORS_ALGORITHMS:
            raise PeerFormatError(f"{path}: speculators_model_type {kind!r} has no specray drafter; importable: "
                                  f"{list(SPECULATORS_ALGORITHMS)}")
        return "speculators", kind
    architectures = config.get("architectures") or []
    if "LlamaForCausalLMEagle3" in architectures:
        return "sglang", "eagle3"
    for name in architectures:
        if name in ZLAB_ARCHITECTURES:
            return "zlab", ZLAB_ARCHITECTURES[name]
    raise PeerFormatError(f"{path}: architectures {architectures} is no drafter format specray reads: speculators "
                          "(speculators_model_type), LlamaForCausalLMEagle3 (SGLang / SpecForge) or "
                          f"{sorted(ZLAB_ARCHITECTURES)} (z-lab)")


# -- the architecture, per format -------------------------------------------------------------------


def _refuse(path: Path, field: str, value, why: str) -> None:
    raise PeerFormatError(f"{path}: {field} = {value!r}: {why}; specray cannot compute this drafter exactly, so it "
                          "is not imported")


def _decoder(layer: dict, path: Path, where: str) -> dict:
    """Our decoder fields from a transformers config dict of the draft layers."""
    for field, ok in (("hidden_act", lambda v: v in (None, "silu")), ("attention_bias", lambda v: not v),
                      ("mlp_bias", lambda v: not v), ("partial_rotary_factor", lambda v: v in (None, 1, 1.0)),
                      ("use_gemma_norm", lambda v: not v)):
        if not ok(layer.get(field)):
            _refuse(path, f"{where}{field}", layer.get(field), "specray's draft layers are SiLU MLPs without biases "
                                                                "with plain RMSNorm and full rotary")
    rope = layer.get("rope_parameters") or layer.get("rope_scaling") or {}
    kind = rope.get("rope_type") or rope.get("type") or "default"
    if kind not in ROPE_TYPES:
        _refuse(path, f"{where}rope_parameters.rope_type", kind, f"specray's drafters compute RoPE types {list(ROPE_TYPES)}")
    # the type's fields besides theta (our drafter config's rope_scaling; None for the default type)
    scaling = None if kind == "default" else {**{k: v for k, v in rope.items() if k not in ("rope_theta", "type")},
                                              "rope_type": kind}
    heads, width, head_dim = layer["num_attention_heads"], layer["hidden_size"], layer.get("head_dim")
    if head_dim is None and isinstance(heads, int) and isinstance(width, int) and heads > 0:
        head_dim = width // heads  # transformers' default; a bad value is named by check_architecture
    return {"hidden_size": width, "vocab_size": layer["vocab_size"],
            "num_layers": layer["num_hidden_layers"], "num_heads": heads,
            "num_kv_heads": heads if layer.get("num_key_value_heads") is None else layer["num_key_value_heads"],
            "head_dim": head_dim,
            "intermediate_size": layer["intermediate_size"], "rms_norm_eps": layer["rms_norm_eps"],
            "rope_theta": float(rope.get("rope_theta", layer.get("rope_theta", 10000.0))), "rope_scaling": scaling,
            "max_position_embeddings": layer.get("max_position_embeddings")}


def _full_attention(layer: dict, path: Path, where: str) -> None:
    types = layer.get("layer_types") or []
    if any(t != "full_attention" for t in types):
        _refuse(path, f"{where}layer_types", types, "sliding-window layers slide per query row, specray's window "
                                                    "ends at the block's anchor")
    if layer.get("is_causal"):
        _refuse(path, f"{where}is_causal", True, "specray's DFlash attends bidirectionally inside the block")


def _zlab_extras(draft: dict, path: Path) -> None:
    for field, neutral in (("output_multiplier", 1.0), ("input_embedding_scale", 1.0)):
        if float(draft.get(field, neutral)) != neutral:
            _refuse(path, f"dflash_config.{field}", draft[field], "specray's drafters read the target's embedding "
                                                                  "and LM head unscaled")
    for field in ("final_logit_softcapping", "attention_sink_bias", "attention_value_scale"):
        if draft.get(field):
            _refuse(path, f"dflash_config.{field}", draft[field], "specray's DFlash family has no such part")
    projector = draft.get("projector_type")
    if projector == "dspark" and draft.get("sample_from_anchor") is not True:
        _refuse(path, "dflash_config.projector_type", projector, "SpecForge's DSpark drafts from the block's MASK "
                                                                 "rows only, specray's from every row (the anchor's "
                                                                 "too: sample_from_anchor true)")
    if projector not in (None, "dspark"):
        _refuse(path, "dflash_config.projector_type", projector, "specray's DFlash family has no such projector")


def _mask_token(draft: dict, config: dict, target: Target, path: Path) -> int:
    mask = draft.get("mask_token_id", config.get("mask_token_id"))
    if mask is not None:
        return int(mask)
    token = draft.get("mask_token", config.get("mask_token", ZLAB_MASK_TOKEN))
    mask = target.tokenizer.convert_tokens_to_ids(token)
    if mask is None or mask == target.tokenizer.unk_token_id:
        raise PeerFormatError(f"{path}: the config names no mask_token_id and the target's tokenizer has no "
                              f"{token!r} token; set dflash_config.mask_token_id in its config.json to the MASK id "
                              "the drafter was trained with")
    return int(mask)


def default_zlab_layer_ids(num_target_layers: int, num_draft_layers: int) -> list[int]:
    """z-lab's ``build_target_layer_ids`` (dflash/model.py): one draft layer reads the middle target
    layer; more spread from layer 1 to L − 3."""
    if num_draft_layers == 1:
        return [num_target_layers // 2]
    span = num_target_layers - 4
    return [round(1 + i * span / (num_draft_layers - 1)) for i in range(num_draft_layers)]


def _dflash_family(algorithm: str, arch: dict, draft: dict, config: dict, path: Path, sample_from_anchor) -> dict:
    # the MASK id is the one the peer's config names (mask_token_origin "config", as for an id set in code)
    arch = dict(arch, attention="full", sliding_window=None, block_key_bias=0.0, mask_token_origin="config")
    if algorithm == "dspark":
        if sample_from_anchor is False:
            _refuse(path, "sample_from_anchor", False, "specray's DSpark drafts from every block row, the anchor's too")
        if draft.get("enable_confidence_head", True) is False:
            _refuse(path, "enable_confidence_head", False, "specray's DSpark has a confidence head")
        if not draft.get("markov_head_type"):
            raise PeerFormatError(f"{path}: a DSpark config names its markov_head_type (vanilla, gated or rnn)")
        arch.update(markov_rank=draft.get("markov_rank"), markov_head_type=draft["markov_head_type"],
                    confidence_head_with_markov=bool(draft.get("confidence_head_with_markov", True)))
    elif sample_from_anchor:
        _refuse(path, "sample_from_anchor", True, f"specray's {algorithm} anchor row drafts nothing")
    if algorithm == "dflash2":
        arch.update({k: draft.get(k) for k in ("conv_kernel_size", "conv_group_size", "selector_top_k",
                                                "selector_rank")})
    return arch


def _speculators(config: dict, algorithm: str, target: Target, path: Path) -> tuple[dict, list[int]]:
    layer = config.get("transformer_layer_config") or {}
    arch = _decoder(layer, path, "transformer_layer_config.")
    field = PEER_LAYOUTS[algorithm].layer_ids_field
    ids = config.get(field)
    if ids is None and algorithm == "eagle3":  # vLLM's default: inputs (2, L/2, L − 3)
        ids = [i + 1 for i in eagle3_layer_ids(target.num_layers)]
    if not ids:
        raise PeerFormatError(f"{path}: {field} is not set; the drafter's captured layers are needed")
    layer_ids = sorted(int(i) - 1 for i in ids)  # inputs -> outputs; the peer's fc reads them ascending
    target_hidden = config.get("target_hidden_size")
    if target_hidden not in (None, arch["hidden_size"]):
        _refuse(path, "target_hidden_size", target_hidden, "specray's drafters are as wide as the target")
    if algorithm == "eagle3":
        for name in ("norm_before_fc", "fc_norm", "norm_output"):
            if config.get(name):
                _refuse(path, name, True, "specray's EAGLE-3 fuses the captured layers and feeds its state without "
                                          "these norms")
        return dict(arch, norm_before_residual=bool(config.get("norm_before_residual", False))), layer_ids
    _full_attention(layer, path, "transformer_layer_config.")
    draft = dict(config, mask_token_id=config.get("mask_token_id"))
    if draft["mask_token_id"] is None:
        raise PeerFormatError(f"{path}: mask_token_id is not set; the drafter's MASK token is needed")
    return _dflash_family(algorithm, dict(arch, block_size=config.get("block_size"), mask_token_id=int(
        draft["mask_token_id"])), draft, config, path, config.get("sample_from_anchor")), layer_ids


def _sglang_eagle3(config: dict, target: Target, path: Path) -> tuple[dict, list[int]]:
    arch = _decoder(config, path, "")
    eagle = config.get("eagle_config") or {}
    ids = eagle.get("eagle_aux_hidden_state_layer_ids")
    layer_ids = sorted(ids) if ids else list(eagle3_layer_ids(target.num_layers))  # SGLang's default inputs - 1
    for name in ("norm_before_fc", "fc_norm", "use_aux_norm", "norm_output"):
        if config.get(name) or eagle.get(name):
            _refuse(path, name, True, "specray's EAGLE-3 fuses the captured layers and feeds its state without "
                                      "these norms")
    if config.get("target_hidden_size") not in (None, arch["hidden_size"]):
        _refuse(path, "target_hidden_size", config["target_hidden_size"], "specray's drafters are as wide as the "
                                                                          "target")
    if config.get("tie_word_embeddings"):
        _refuse(path, "tie_word_embeddings", True, "the draft's LM head would be the target's embedding")
    return dict(arch, norm_before_residual=False), layer_ids


def _zlab(config: dict, algorithm: str, target: Target, path: Path) -> tuple[dict, list[int]]:
    arch = _decoder(config, path, "")
    _full_attention(config, path, "")
    draft = {**config, **(config.get("dflash_config") or {})}
    _zlab_extras(draft, path)
    trained_for = draft.get("num_target_layers")
    if trained_for is not None and trained_for != target.num_layers:
        raise PeerFormatError(f"{path}: num_target_layers = {trained_for}, the target has {target.num_layers} "
                              "layers: the drafter was made for another target")
    ids = draft.get("target_layer_ids") or default_zlab_layer_ids(target.num_layers, arch["num_layers"])
    block = draft.get("block_size") or 16  # z-lab's and SGLang's default
    arch = dict(arch, block_size=int(block), mask_token_id=_mask_token(draft, config, target, path))
    return _dflash_family(algorithm, arch, draft, config, path, draft.get("sample_from_anchor")), [int(i) for i in ids]


def read_peer(path: str | Path, target: Target) -> PeerDrafter:
    """Read a peer directory's config into our architecture, checked against ``target`` (module doc)."""
    path = Path(path)
    config = _read_config(path)
    fmt, algorithm = detect(config, path)
    try:
        if fmt == "speculators":
            arch, layer_ids = _speculators(config, algorithm, target, path)
            renames = PEER_LAYOUTS[algorithm].renames
            verifier = ((config.get("speculators_config") or {}).get("verifier") or {}).get("name_or_path")
        elif fmt == "sglang":
            arch, layer_ids = _sglang_eagle3(config, target, path)
            renames, verifier = SGLANG_LAYOUTS[algorithm].renames, None
        else:
            arch, layer_ids = _zlab(config, algorithm, target, path)
            renames, verifier = SGLANG_LAYOUTS[algorithm].renames, None
    except KeyError as e:
        raise PeerFormatError(f"{path}/config.json has no {e.args[0]!r}: an incomplete {fmt} config") from None
    for field, ours in (("hidden_size", target.hidden_size), ("vocab_size", target.vocab_size)):
        if arch[field] != ours:
            raise PeerFormatError(f"{path}: {field} = {arch[field]}, the target {target.name} has {ours}: the drafter "
                                  "was made for another target (pass the one it was trained for with --target)")
    bad = [i for i in layer_ids if not 0 <= i < target.num_layers]
    if bad:
        raise PeerFormatError(f"{path}: the drafter reads target layers {layer_ids} (decoder-layer outputs); "
                              f"{target.name} has {target.num_layers}: it was made for another target")
    return PeerDrafter(path, fmt, algorithm, config, dict(arch, target_layer_ids=layer_ids), layer_ids, renames,
                       verifier)


# -- the tensors -------------------------------------------------------------------------------------


def weight_files(path: Path) -> list[Path]:
    """The safetensors files of a peer directory: ``model.safetensors``, or the shards its index names."""
    index = path / "model.safetensors.index.json"
    if index.is_file():
        shards = sorted(set(json.loads(index.read_text()).get("weight_map", {}).values()))
        files = [path / name for name in shards]
        bad = [str(f) for f in files if Path(f.name) != Path(str(f.relative_to(path))) or not f.is_file()]
        if not files or bad:
            raise PeerFormatError(f"{index} names shards that are not files beside it: {bad or 'none'}")
        return files
    if (path / "model.safetensors").is_file():
        return [path / "model.safetensors"]
    found = sorted(p.name for p in path.iterdir() if p.suffix in (".bin", ".pt", ".pth"))
    raise PeerFormatError(f"{path} has no model.safetensors" + (f" (only {found}: pickled weights are not read; "
                                                                  "convert them to safetensors)" if found else ""))


def _headers(files: list[Path]) -> dict[str, tuple[Path, str, tuple[int, ...]]]:
    """{tensor name: (file, dtype, shape)} over every file, from the headers only."""
    out: dict[str, tuple[Path, str, tuple[int, ...]]] = {}
    for file in files:
        for name, (dtype, shape) in read_safetensors_header(file).items():
            if name in out:
                raise PeerFormatError(f"tensor {name!r} is in both {out[name][0].name} and {file.name}")
            out[name] = (file, dtype, shape)
    return out


def _names(peer: PeerDrafter, expected: dict[str, torch.Tensor], header: dict) -> dict[str, str]:
    """Our key -> the peer tensor that holds it (z-lab's codebooks may carry a ``.weight`` suffix)."""
    names = {}
    for key in expected:
        if key == "draft_vocab":
            continue
        name = peer_name(peer.renames, key, peer.fmt)
        if name and name not in header and f"{name}.weight" in header:
            name = f"{name}.weight"
        if name:
            names[key] = name
    return names


def _check_tensors(peer: PeerDrafter, expected: dict[str, torch.Tensor], names: dict[str, str], header: dict) -> None:
    missing = sorted(n for n in names.values() if n not in header)
    extra = sorted(set(header) - set(names.values()) - set(TARGET_TENSORS))
    wrong = sorted(f"{n} {list(header[n][2])} (architecture: {list(expected[k].shape)})" for k, n in names.items()
                   if n in header and header[n][2] != tuple(expected[k].shape))
    if missing or extra or wrong:
        raise PeerFormatError(f"{peer.path}: its weights do not fit the {peer.fmt} {peer.algorithm} architecture its "
                              f"config describes (missing {missing}, tensors specray's drafter does not have {extra}, "
                              f"wrong shape {wrong})")


def _draft_vocab(peer: PeerDrafter, tensors: dict[str, torch.Tensor], vocab_size: int) -> torch.Tensor | None:
    """The draft vocabulary (target ids, ascending) from d2t (target id = i + d2t[i]); None for the whole one."""
    if "d2t" not in tensors:
        size = peer.config.get("draft_vocab_size")
        if size not in (None, vocab_size):
            raise PeerFormatError(f"{peer.path}: draft_vocab_size = {size} but the checkpoint has no d2t mapping")
        return None
    d2t = tensors["d2t"].long()
    ids = d2t + torch.arange(len(d2t))
    if len(ids) == 0 or len(ids) > vocab_size or int(ids.min()) < 0 or int(ids.max()) >= vocab_size or \
            (len(ids) > 1 and not bool((ids[1:] > ids[:-1]).all())):
        raise PeerFormatError(f"{peer.path}: d2t does not map draft ids to distinct ascending target ids in "
                              f"[0, {vocab_size})")
    if "t2d" in tensors and not torch.equal(tensors["t2d"].bool().nonzero().flatten(), ids):
        raise PeerFormatError(f"{peer.path}: t2d and d2t name different draft vocabularies")
    return None if len(ids) == vocab_size else ids


def _same_as_target(peer: PeerDrafter, name: str, tensor: torch.Tensor, ours: torch.Tensor) -> str:
    """Refuse a head or embedding that is not the target's (ours share it); returns what was checked."""
    if tensor.shape != ours.shape or not torch.equal(tensor, ours.detach().to(tensor.dtype)):
        raise PeerFormatError(f"{peer.path}: its {name} {list(tensor.shape)} is not the target's (specray's drafters "
                              "share the target's embedding and LM head): the drafter was trained for another target "
                              "or with its own head; pass the target it was trained for with --target")
    return f"{name} equals the target's"


def _record(path: Path, target: Target) -> dict | None:
    """A directory our writers made carries the fingerprints of the target it was checked against."""
    record = path / PEER_RECORD
    if not record.is_file():
        return None
    data = json.loads(record.read_text())
    for field in ("target_fingerprint", "template_fingerprint"):
        have = data.get("target", {}).get(field)
        if have != getattr(target, field):
            raise PeerFormatError(f"{path} was exported for another target: {PEER_RECORD} {field} {have} != "
                                  f"{getattr(target, field)}; import it with the target it was trained for")
    return data


def build_drafter(peer: PeerDrafter, target: Target) -> tuple[torch.nn.Module, list[str]]:
    """The drafter with the peer's weights (checked before anything is loaded) and the checks made."""
    spec = get_drafter(peer.algorithm)
    embed, head = target.model.get_input_embeddings(), target.model.get_output_embeddings()
    files = weight_files(peer.path)
    header = _headers(files)
    arch = dict(peer.arch, draft_vocab_size=None)
    if "d2t" in header:
        arch["draft_vocab_size"] = header["d2t"][2][0] if header["d2t"][2][0] != target.vocab_size else None
    where = f"{peer.path} (imported)"
    check_architecture(arch, spec.config, hidden_size=target.hidden_size, vocab_size=target.vocab_size, where=where)
    cfg = spec.config.from_dict(arch)
    with torch.device("meta"):
        expected = spec.model(cfg, embed_tokens=embed, lm_head=head).state_dict()
    names = _names(peer, expected, header)
    _check_tensors(peer, expected, names, header)
    tensors = {name: t for file in files for name, t in load_file(file).items()}
    vocab = _draft_vocab(peer, tensors, target.vocab_size)
    checks = ["architecture within the target's bounds", "tensor names and shapes", "layer ids inside the target"]
    rows = torch.arange(target.vocab_size) if vocab is None else vocab
    if "lm_head.weight" in tensors:
        checks.append(_same_as_target(peer, "lm_head.weight", tensors["lm_head.weight"], head.weight[rows]))
    if "embed_tokens.weight" in tensors:
        checks.append(_same_as_target(peer, "embed_tokens.weight", tensors["embed_tokens.weight"], embed.weight))
    model = spec.model(cfg, embed_tokens=embed, lm_head=head)
    state = {key: tensors[name] for key, name in names.items()}
    if vocab is not None:
        state["draft_vocab"] = vocab
    model.load_state_dict(state, strict=True)
    model.validate_state()
    return model.eval(), checks


def _sha256(files: list[Path]) -> str:
    digest = hashlib.sha256()
    for file in files:
        with open(file, "rb") as f:
            while chunk := f.read(1 << 22):
                digest.update(chunk)
    return "sha256:" + digest.hexdigest()


def import_peer(peer_dir: str | Path, out_dir: str | Path, *, target: Target | str | None = None,
                capture_dtype: str = "bfloat16") -> Path:
    """Import the peer directory ``peer_dir`` as a specray export at ``out_dir`` (module doc).

    ``target``: the target the drafter drafts for (a ``Target`` or a name; default: the verifier a
    speculators config names, when it is a name ``load_target`` resolves). ``capture_dtype``: the
    storage dtype of the capture contract the export records (features a fine-tune reads)."""
    path = Path(peer_dir)
    if not isinstance(target, Target):
        name = target or _speculators_verifier(path)
        if not name:
            raise PeerFormatError(f"{path}: its config names no verifier; pass the target the drafter was trained "
                                  "for with --target")
        target = load_target(name)
    peer = read_peer(path, target)
    record = _record(path, target)
    model, checks = build_drafter(peer, target)
    if record is not None:
        checks.append(f"{PEER_RECORD} fingerprints equal the target's")
    contract = build_contract(peer.algorithm, target_fingerprint=target.target_fingerprint,
                              template_fingerprint=target.template_fingerprint, num_target_layers=target.num_layers,
                              hidden_size=target.hidden_size, layer_ids=peer.layer_ids, dtype=capture_dtype)
    provenance = {"target": target.name, "imported_from": str(path.resolve()), "imported_format": peer.fmt,
                  "peer_config": peer.config, "peer_weights_sha256": _sha256(weight_files(path)),
                  "peer_verifier": peer.verifier, "import_checks": checks,
                  **({"peer_provenance": record.get("source_export")} if record else {})}
    calibration = _sts_tables(path, peer)  # checked before anything is written
    out = save_drafter(out_dir, model, contract=json.loads(contract.to_json()), provenance=provenance)
    if calibration is not None:  # before the load below, which reads it back against the new export
        from specray.drafters.dspark import write_calibration

        write_calibration(out, *calibration)
    load_drafter(out, embed_tokens=target.model.get_input_embeddings(), lm_head=target.model.get_output_embeddings(),
                 target_fingerprint=target.target_fingerprint, template_fingerprint=target.template_fingerprint,
                 contract=json.loads(contract.to_json()))
    return out


def _sts_tables(path: Path, peer: PeerDrafter) -> tuple[dict[str, list[float]], dict] | None:
    """A DSpark directory's confidence temperatures per serving mode, from its SGLang STS files
    (``STS_FILE``, one per mode, each naming its ``mode``): (tables, report) for ``write_calibration``,
    or None when it has none. A directory with the files of only some modes, a file for another mode
    or of another block size is refused: the scheduler needs both tables, and a table fitted for one
    survival event misreads the other (``drafters/dspark.py``)."""
    from specray.drafters.dspark import CALIBRATION_MODES

    files = {mode: path / STS_FILE.format(mode=mode) for mode in CALIBRATION_MODES}
    present = [mode for mode, f in files.items() if f.is_file()]
    if peer.algorithm != "dspark" or not present:
        return None
    fix = "remove the STS files to import it uncalibrated, then run `specray calibrate` on the import"
    if len(present) != len(files):
        raise PeerFormatError(f"{path}: STS tables for {present} only; the scheduler reads one per serving mode "
                              f"{list(CALIBRATION_MODES)}: {fix}")
    block = peer.arch["block_size"]
    tables, report = {}, {"imported_from": [str(f.resolve()) for f in files.values()], "modes": {}}
    for mode, file in files.items():
        if (size := file.stat().st_size) > MAX_CONFIG_BYTES:
            raise PeerFormatError(f"{file}: {size} bytes, more than an STS table holds: {fix}")
        sts = json.loads(file.read_text())
        temperatures = sts.get("temperatures")
        if sts.get("mode") != mode:
            raise PeerFormatError(f"{file}: mode {sts.get('mode')!r}, not {mode!r}: {fix}")
        if (not isinstance(temperatures, list) or len(temperatures) != block
                or not all(isinstance(t, (int, float)) and 0 < t < float("inf") for t in temperatures)):
            raise PeerFormatError(f"{file}: temperatures must be {block} positive numbers, one per draft position "
                                  f"of block_size {block}: {fix}")
        tables[mode] = [float(t) for t in temperatures]
        report["modes"][mode] = {ours: sts[theirs] for ours, theirs in (("ece_by_pos_before", "ece_before"),
                                                                        ("ece_by_pos_after", "ece_after"))
                                 if isinstance(sts.get(theirs), list)}
        report.setdefault("manifest", sts.get("dataset", ""))
        report.setdefault("blocks", sts.get("num_samples", 0))
    return tables, report


def _speculators_verifier(path: Path) -> str | None:
    config = _read_config(path)
    return ((config.get("speculators_config") or {}).get("verifier") or {}).get("name_or_path")


def as_export(path: str | Path, target: Target, *, capture_dtype: str = "bfloat16") -> Path:
    """``path`` itself when it is a specray export; a peer directory imported once (``import_peer``)
    into ``$SPECRAY_CACHE/imports/`` otherwise, keyed by its files, the target and the dtype."""
    path = Path(path)
    if not is_peer_directory(path):
        return path
    files = sorted(p for p in path.iterdir() if p.is_file())
    key = json.dumps([str(path.resolve()), [(p.name, p.stat().st_size, p.stat().st_mtime_ns) for p in files],
                      target.target_fingerprint, target.template_fingerprint, capture_dtype])
    out = cache_dir() / "imports" / hashlib.sha256(key.encode()).hexdigest()[:24]
    if not (out / "config.json").is_file():
        try:
            import_peer(path, out, target=target, capture_dtype=capture_dtype)
        except OSError:  # the rename into place lost a race: fine when another process imported it first
            if not (out / "config.json").is_file():
                raise
    return out


def peer_summary(path: str | Path) -> dict:
    """What a peer directory is without a target: its format, algorithm and draft vocabulary size
    (None for the target's whole vocabulary), from its config and the headers."""
    path = Path(path)
    config = _read_config(path)
    fmt, algorithm = detect(config, path)
    header = _headers(weight_files(path))
    size = header["d2t"][2][0] if "d2t" in header else None
    layer = config.get("transformer_layer_config") or config
    if size is not None and size == layer.get("vocab_size"):
        size = None
    return {"format": fmt, "algorithm": algorithm, "draft_vocab_size": size}
