"""Regeneration on Ray: ``RegenerateActor`` holds one engine over the target and answers chunks of
conversations (``serving/regenerate.py``); ``regenerate_on_ray`` spreads chunks over N actors
and hands each chunk's records to the driver as it finishes.

An actor asks Ray for the capture actors' resources (``capture.num_cpus_per_actor`` /
``num_gpus_per_actor``), so the target answers where it is captured. Answering is a pure
function of the chunk under greedy decoding, so a chunk lost with its actor is answered again by
Ray (``max_task_retries``) with the same records.
"""

from __future__ import annotations

import os
from collections.abc import Callable

import ray

from specray.actors.capture import actor_options
from specray.actors.cluster import check_cluster_gpus
from specray.capture.devices import resolve_device
from specray.capture.target import load_target, target_placement
from specray.serving.engine import Engine
from specray.serving.regenerate import AnswerStats, PromptTurns, answer_conversations
from specray.serving.sampling import SamplingParams


@ray.remote
class RegenerateActor:
    def __init__(self, target: str, *, batch_size: int, max_len: int, target_dtype: str, target_device: str,
                 chat_template: str | None):
        gpus = len(ray.get_gpu_ids())
        device = resolve_device(target_device, field="target.device", gpus=gpus,
                                fix="set capture.num_gpus_per_actor=1 so that Ray grants each regenerate actor a GPU, "
                                    "or target.device=auto")
        placed = load_target(target, dtype=target_dtype, chat_template=chat_template, **target_placement(device, gpus))
        self.engine = Engine(placed, None, max_batch=batch_size, max_len=max_len, max_waiting=None)

    def ready(self) -> int:
        return os.getpid()

    def answer(self, prompts: list[PromptTurns], params: SamplingParams, max_prompt_tokens: int) -> tuple[list[dict], dict]:
        stats = AnswerStats()
        records = list(answer_conversations(self.engine, prompts, params, max_prompt_tokens=max_prompt_tokens,
                                            stats=stats))
        return records, vars(stats)


def regenerate_on_ray(target: str, chunks: list[list[PromptTurns]], params: SamplingParams, *, batch_size: int,
                      max_prompt_tokens: int, on_records: Callable[[list[dict], dict], None], num_actors: int = 1,
                      num_cpus_per_actor: float = 1.0, num_gpus_per_actor: float = 0.0, target_dtype: str = "float32",
                      target_device: str = "cpu", chat_template: str | None = None, max_restarts: int = 3) -> None:
    """Answer every chunk; ``on_records(records, stats)`` runs in the driver once per finished chunk."""
    if not chunks:
        return
    check_cluster_gpus(num_actors * num_gpus_per_actor, gpus_field="capture.num_gpus_per_actor",
                       who="regenerate actors")
    options = actor_options(num_cpus_per_actor, num_gpus_per_actor, max_restarts) | {"max_task_retries": 2}
    actors = [RegenerateActor.options(**options).remote(
        target, batch_size=batch_size, max_len=max_prompt_tokens + params.max_tokens + 8, target_dtype=target_dtype,
        target_device=target_device, chat_template=chat_template) for _ in range(min(num_actors, len(chunks)))]
    todo = list(reversed(chunks))
    pending: dict[ray.ObjectRef, ray.actor.ActorHandle] = {}
    try:
        for actor in actors:  # two chunks per actor: the next one is queued while one runs
            for _ in range(2):
                if todo:
                    pending[actor.answer.remote(todo.pop(), params, max_prompt_tokens)] = actor
        while pending:
            [done], _ = ray.wait(list(pending), num_returns=1)
            actor = pending.pop(done)
            records, stats = ray.get(done)
            on_records(records, stats)
            if todo:
                pending[actor.answer.remote(todo.pop(), params, max_prompt_tokens)] = actor
    finally:
        for actor in actors:
            ray.kill(actor)
