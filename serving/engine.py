"""The serving engine: requests in, tokens out, with or without a drafter.

    engine = Engine(load_target(), drafter_dir="runs/train-dflash/exports/step-00002000")
    outputs = engine.generate(["Write a haiku about CPUs."], SamplingParams(max_tokens=64))

Continuous batching: up to ``max_batch`` requests run at once, each in its own KV slot; a
finished request frees its slot and the next waiting one is prefilled. Every step runs one
round of the worker for all running requests (AR: one token; DFlash: propose → verify →
accept → commit). Stops — EOS, ``stop_token_ids``, ``stop`` strings, ``max_tokens`` — cut the
output at the exact token even inside an accepted block; later tokens of that block are
discarded. The KV capacity is checked up front: a prompt that cannot fit ``max_tokens`` plus
one verify block is refused with a clear error and the engine keeps serving.
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass, field

import torch

from specray.capture.target import Target
from specray.drafters.format import load_drafter, read_drafter_config
from specray.serving.runner import LlamaRunner
from specray.serving.sampling import SamplingParams
from specray.serving.workers import WORKERS, ARWorker
from specray.serving.workers.ar import sample_next


@dataclass
class GenerationOutput:
    prompt_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: str  # "stop" (EOS / stop token / stop string) or "length"
    rounds: int  # worker steps after prefill
    emitted_per_round: list[int] = field(default_factory=list)  # r + 1 per round
    seconds: float = 0.0

    @property
    def tau(self) -> float:
        """Mean tokens per round (accepted drafts + 1); 1.0 for AR."""
        return sum(self.emitted_per_round) / max(1, len(self.emitted_per_round))


@dataclass
class _Request:
    index: int
    prompt_ids: list[int]
    params: SamplingParams
    generator: torch.Generator
    slot: int = -1
    tokens: list[int] = field(default_factory=list)
    anchor: int = -1
    finish_reason: str | None = None
    emitted: list[int] = field(default_factory=list)
    start: float = 0.0  # perf_counter at admission
    seconds: float = 0.0  # admission to finish


class Engine:
    def __init__(self, target: Target, drafter_dir: str | None = None, *, max_batch: int = 4, max_len: int = 2048):
        self.target = target
        self.tokenizer = target.tokenizer
        self.max_len = max_len
        capture: tuple[int, ...] = ()
        self.drafter = None
        if drafter_dir is not None:
            config = read_drafter_config(drafter_dir)
            self.drafter = load_drafter(
                drafter_dir, embed_tokens=target.model.model.embed_tokens, lm_head=target.model.lm_head,
                target_fingerprint=target.target_fingerprint, template_fingerprint=target.template_fingerprint,
            )
            capture = tuple(config["architecture"]["target_layer_ids"])
        self.runner = LlamaRunner(target.model, num_slots=max_batch, max_len=max_len, capture_layer_ids=capture)
        self.worker = ARWorker(self.runner) if self.drafter is None else WORKERS[self.drafter.algorithm](self.runner, self.drafter)
        self.eos_ids = {target.tokenizer.eos_token_id}

    def encode(self, prompt) -> list[int]:
        """A string (rendered as one user turn), a chat message list, or token ids."""
        if isinstance(prompt, str):
            prompt = [{"role": "user", "content": prompt}]
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], dict):
            return self.tokenizer.apply_chat_template(prompt, add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"]
        if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
            return list(prompt)
        raise ValueError("a prompt is a string, a list of chat messages, or a list of token ids")

    def _check(self, ids: list[int], params: SamplingParams) -> None:
        if not ids:
            raise ValueError("the prompt is empty")
        need = len(ids) + params.max_tokens + self.worker.rows_per_round
        if need > self.max_len:
            raise ValueError(
                f"prompt of {len(ids)} tokens + max_tokens {params.max_tokens} does not fit the engine's "
                f"context of {self.max_len} tokens; shorten the prompt or lower max_tokens"
            )
        bad = [t for t in ids if not 0 <= t < self.target.vocab_size]
        if bad:
            raise ValueError(f"token ids {bad[:5]} are outside the vocabulary [0, {self.target.vocab_size})")

    def generate(self, prompts: list, params: SamplingParams | list[SamplingParams] | None = None) -> list[GenerationOutput]:
        params_list = params if isinstance(params, list) else [params or SamplingParams()] * len(prompts)
        requests = []
        for i, (prompt, p) in enumerate(zip(prompts, params_list, strict=True)):
            ids = self.encode(prompt)
            self._check(ids, p)
            g = torch.Generator().manual_seed(p.seed if p.seed is not None else random.getrandbits(63))
            requests.append(_Request(i, ids, p, g))
        waiting, running = list(requests), []
        while waiting or running:
            admitted = []
            while waiting and len(running) + len(admitted) < self.runner.cache.num_slots:
                request = waiting.pop(0)
                request.slot = self.runner.cache.allocate()
                request.start = time.perf_counter()
                admitted.append(request)
            if admitted:
                logits = self.worker.prefill([r.slot for r in admitted], [r.prompt_ids for r in admitted])
                for r, row in zip(admitted, logits):
                    self._emit(r, [sample_next(row, r.params, r.generator)])
                running += admitted
            running = self._retire(running)
            if running:
                new = self.worker.step([r.slot for r in running], [r.anchor for r in running],
                                       [r.params for r in running], [r.generator for r in running])
                for r, tokens in zip(running, new):
                    r.emitted.append(len(tokens))
                    self._emit(r, tokens)
                running = self._retire(running)
        return [self._output(r) for r in requests]

    def _emit(self, r: _Request, tokens: list[int]) -> None:
        """Append tokens up to the first stop; the last appended token is the next anchor."""
        p = r.params
        for token in tokens:
            if token in p.stop_token_ids or (token in self.eos_ids and not p.ignore_eos):
                r.finish_reason = "stop"
                return
            r.tokens.append(token)
            r.anchor = token
            if p.stop and any(s in self.tokenizer.decode(r.tokens[-64:]) for s in p.stop):
                r.finish_reason = "stop"
                return
            if len(r.tokens) >= p.max_tokens:
                r.finish_reason = "length"
                return

    def _retire(self, running: list[_Request]) -> list[_Request]:
        still = []
        for r in running:
            if r.finish_reason is None:
                still.append(r)
            else:
                self.runner.cache.release(r.slot)
                if self.drafter is not None:
                    self.worker.context.release(r.slot)
                r.seconds = time.perf_counter() - r.start
        return still

    def _output(self, r: _Request) -> GenerationOutput:
        text = self.tokenizer.decode(r.tokens, skip_special_tokens=False)
        for s in r.params.stop:
            if s in text:
                text = text[: text.index(s)]
        return GenerationOutput(r.prompt_ids, r.tokens, text, r.finish_reason or "length", len(r.emitted),
                                r.emitted, r.seconds)
