"""CaptureServer: run the frozen target once per batch, store what the contract asks for.

A plain class (``actors/`` wraps it as a Ray actor later). One forward per batch:

- batches are right-padded with an attention mask; with right padding every real token keeps
  its own positions and never attends to a pad, so its features equal those of the sample run
  alone (tests check this against ``output_hidden_states``);
- forward hooks on the contract's decoder layers (and the final norm when the contract needs
  ``last_hidden_states``) collect the features; the forward stops right after the deepest
  module the contract needs, and the LM head never runs;
- features are cut back to each sample's real tokens, cast to the storage dtype and written
  as one blob per sample (see ``capture/contract.py`` for the tensor names and shapes).

Usage::

    server = CaptureServer(target, contract, FeatureStore("file:///tmp/features"))
    refs = server.capture(samples)          # list[SampleRef], one per sample
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from typing import Collection, Iterable, Iterator, Sequence

import torch

from specray.capture.contract import CaptureContract, TOKEN_DTYPE
from specray.capture.data import RenderedSample
from specray.capture.store import FeatureStore, SampleRef, feature_key
from specray.capture.target import Target


class _StopForward(Exception):
    """Raised by the hook on the deepest needed module: nothing after it is computed."""


def pack_batches(samples: Sequence[RenderedSample], *, max_batch_tokens: int, max_batch_size: int) -> list[list[RenderedSample]]:
    """Group samples into batches of similar length whose padded size fits the budget.

    Sorting by length first keeps padding small; each batch satisfies
    ``len(batch) * max_len(batch) <= max_batch_tokens`` (a sample longer than the budget
    gets a batch of its own).
    """
    if max_batch_tokens <= 0 or max_batch_size <= 0:
        raise ValueError("max_batch_tokens and max_batch_size must be positive")
    batches: list[list[RenderedSample]] = []
    current: list[RenderedSample] = []
    for sample in sorted(samples, key=lambda s: s.num_tokens):
        longest = max([s.num_tokens for s in current] + [sample.num_tokens])
        if current and ((len(current) + 1) * longest > max_batch_tokens or len(current) == max_batch_size):
            batches.append(current)
            current = []
        current.append(sample)
    if current:
        batches.append(current)
    return batches


def pad_batch(samples: Sequence[RenderedSample], pad_token_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-pad to ``[B, T_max]``; returns (input_ids, attention_mask)."""
    longest = max(s.num_tokens for s in samples)
    input_ids = torch.full((len(samples), longest), pad_token_id, dtype=torch.int64)
    attention_mask = torch.zeros((len(samples), longest), dtype=torch.int64)
    for row, sample in enumerate(samples):
        input_ids[row, : sample.num_tokens] = sample.input_ids
        attention_mask[row, : sample.num_tokens] = 1
    return input_ids, attention_mask


@torch.inference_mode()
def decoder_layer_outputs(model, input_ids: torch.Tensor, attention_mask: torch.Tensor, layer_ids: Sequence[int], *,
                          last_hidden: bool = False) -> dict[int | str, torch.Tensor]:
    """``{layer id: [B, T, D]}`` decoder-layer outputs of a HF Llama-family causal LM (plus
    ``"norm"``: the final norm's output when ``last_hidden``), on the model's device, in its dtype.

    Forward hooks collect them and the forward stops after the deepest module needed: neither
    the remaining layers nor the LM head run."""
    layers, norm = model.model.layers, model.model.norm
    outputs: dict[int | str, torch.Tensor] = {}
    deepest = "norm" if last_hidden else max(layer_ids)

    def hook(name: int | str):
        def fn(module, args, output):
            outputs[name] = output[0] if isinstance(output, tuple) else output  # [B, T, D]
            if name == deepest:
                raise _StopForward
        return fn

    handles = [layers[i].register_forward_hook(hook(i)) for i in layer_ids]
    if last_hidden:
        handles.append(norm.register_forward_hook(hook("norm")))
    try:
        model.model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False)
    except _StopForward:
        pass
    finally:
        for handle in handles:
            handle.remove()
    return outputs


class CaptureServer:
    """Frozen target + contract + store; ``capture(samples) -> SampleRefs``."""

    def __init__(self, target: Target, contract: CaptureContract, store: FeatureStore, *, key_prefix: str = "features", io_threads: int = 2):
        if contract.target_fingerprint != target.target_fingerprint:
            raise ValueError("the contract was built for another target (fingerprint differs)")
        if contract.template_fingerprint != target.template_fingerprint:
            raise ValueError("the contract was built for another chat template (fingerprint differs)")
        self.target = target
        self.contract = contract
        self.store = store
        self.key_prefix = key_prefix.strip("/")
        self._io = ThreadPoolExecutor(max_workers=io_threads, thread_name_prefix="specray-store")

    def close(self) -> None:
        self._io.shutdown(wait=True)

    def key_for(self, sample_id: str) -> str:
        """Deterministic: the same sample under the same contract always lands on one key."""
        return feature_key(self.contract.contract_id, sample_id, self.key_prefix)

    @torch.inference_mode()
    def extract(self, samples: Sequence[RenderedSample]) -> list[dict[str, torch.Tensor]]:
        """One padded forward; per-sample feature dicts, unpadded, in the storage dtype."""
        input_ids, attention_mask = pad_batch(samples, self.target.pad_token_id)
        device = self.target.model.device
        outputs = decoder_layer_outputs(self.target.model, input_ids.to(device), attention_mask.to(device),
                                        self.contract.layer_ids, last_hidden=self.contract.last_hidden)
        dtype = self.contract.torch_dtype
        # a target placed across GPUs leaves each layer's output on its own GPU: gather them on the first
        first = outputs[self.contract.layer_ids[0]].device
        hidden = torch.cat([outputs[i].to(first, dtype) for i in self.contract.layer_ids], dim=-1)  # [B, T, L*D]
        last = outputs["norm"].to(dtype) if self.contract.last_hidden else None  # [B, T, D]
        features = []
        for row, sample in enumerate(samples):
            n = sample.num_tokens
            item = {
                "input_ids": sample.input_ids.to(TOKEN_DTYPE),
                "loss_mask": sample.loss_mask,
                "hidden_states": hidden[row, :n].cpu(),
            }
            if last is not None:
                item["last_hidden_states"] = last[row, :n].cpu()
            features.append(item)
        return features

    def _write(self, samples: Sequence[RenderedSample], features: list[dict[str, torch.Tensor]]) -> list[Future]:
        return [
            self._io.submit(
                self.store.put, self.key_for(s.sample_id), f,
                sample_id=s.sample_id, num_tokens=s.num_tokens, contract=self.contract.contract_id,
            )
            for s, f in zip(samples, features)
        ]

    def capture(self, samples: Sequence[RenderedSample], *, only: Collection[str] | None = None) -> list[SampleRef]:
        """Extract and write every sample (or the ``only`` sample ids); returns once every blob is durable.

        ``only`` re-captures some samples of a batch: the forward still runs over the whole
        batch, padded exactly as the first time, so their bytes equal the first capture's.
        """
        features = self.extract(samples)
        if only is not None:
            unknown = set(only) - {s.sample_id for s in samples}
            if unknown:
                raise ValueError(f"only= names samples that are not in this batch: {sorted(unknown)[:5]}")
            kept = [(s, f) for s, f in zip(samples, features) if s.sample_id in only]
            samples, features = [s for s, _ in kept], [f for _, f in kept]
        return [f.result() for f in self._write(samples, features)]

    def capture_all(self, batches: Iterable[Sequence[RenderedSample]]) -> Iterator[list[SampleRef]]:
        """Yield each batch's refs once durable; the next forward overlaps the previous writes."""
        pending: list[Future] | None = None
        for batch in batches:
            futures = self._write(batch, self.extract(batch))
            if pending is not None:
                yield [f.result() for f in pending]
            pending = futures
        if pending is not None:
            yield [f.result() for f in pending]


def forward_memory(config, contract: CaptureContract, dtype_bytes: int, *, max_batch_tokens: int,
                   max_length: int) -> float:
    """Bytes a capture forward of ``max_batch_tokens`` padded tokens (sequences of ``max_length``) needs
    above the target's weights, in the target's dtype (``dtype_bytes`` per element), as ``extract``
    runs it: the captured layers' outputs kept by the hooks, one decoder layer's working set (its
    attention or its MLP, whichever is larger; the norms compute in fp32), the padding mask
    ``[B, 1, T, T]`` (boolean, and the float forms the attention makes of it), then the features
    in the storage dtype with their serialised copies (``specray plan``, ``pipeline/jobs/plan.py``)."""
    T, b = max_batch_tokens, dtype_bytes
    D, I, H = config.hidden_size, config.intermediate_size, config.num_attention_heads
    Hkv = config.num_key_value_heads
    hd = getattr(config, "head_dim", None) or D // H
    kept = (len(contract.layer_ids) + contract.last_hidden) * T * D * b
    norm = T * D * (2 * 4 + b)  # fp32 upcast and product, the normed output
    mask = T * max_length  # [B, 1, T, T] boolean, for the whole forward
    attention = T * (D * b + (3 * H + 4 * Hkv) * hd * b) + 7 * mask  # q/k/v, RoPE, GQA copies, float forms of the mask
    mlp = 3 * T * I * b
    layer = T * D * b + norm + mask + max(attention, mlp)  # the residual stream, then the larger sublayer
    features = T * sum(max(w, 1) * dt.itemsize for w, dt in contract.tensor_widths().values())
    return kept + max(layer, 2 * features)
