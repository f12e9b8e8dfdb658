"""Regeneration on Ray: ``RegenerateActor`` holds one engine over the target and answers its share
of the conversations (``serving/regenerate.py``) on a thread of its own; ``regenerate_on_ray``
deals the conversations out to N actors and polls each for the records finished since.

An actor asks Ray for the capture actors' resources (``capture.num_cpus_per_actor`` /
``num_gpus_per_actor``), so the target answers where it is captured. The driver hands records to
``on_records`` as they finish, so the output grows conversation by conversation. An actor that
dies loses only what it had not yet handed over: Ray restarts it (``max_restarts``) and the
driver gives it the rest of its share again; answering is a pure function of a conversation under
greedy decoding, so the records are the ones the lost actor would have written.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable

import ray
from ray.exceptions import ActorUnavailableError, RayActorError

from specray.actors.capture import actor_options
from specray.actors.cluster import check_cluster_gpus
from specray.capture.devices import resolve_device
from specray.capture.target import load_target, target_placement
from specray.serving.engine import Engine
from specray.serving.regenerate import AnswerStats, PromptTurns, answer_conversations, engine_max_len
from specray.serving.sampling import SamplingParams

POLL_S = 1.0


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
        self.lock = threading.Lock()
        self.records: list[dict] = []
        self.stats, self.sent = AnswerStats(), AnswerStats()
        self.error: str | None = None
        self.state = "idle"  # idle (no share yet: started, or restarted by Ray) -> running -> done

    def ready(self) -> int:
        return os.getpid()

    def start(self, prompts: list[PromptTurns], params: SamplingParams, max_prompt_tokens: int) -> None:
        """Answer ``prompts`` on a background thread; ``poll`` hands the records over."""
        if self.state != "idle":
            raise RuntimeError(f"this actor's share is {self.state} already")
        self.state = "running"

        def work() -> None:
            try:
                for record in answer_conversations(self.engine, prompts, params, max_prompt_tokens=max_prompt_tokens,
                                                   stats=self.stats):
                    with self.lock:
                        self.records.append(record)
            except BaseException as e:  # handed to the driver by poll
                self.error = f"{type(e).__name__}: {e}"
            finally:
                self.state = "done"

        threading.Thread(target=work, daemon=True).start()

    def poll(self) -> tuple[list[dict], dict, str]:
        """(records finished since the last poll, the stats they add, ``state``). ``idle`` after a
        ``start`` means Ray restarted the actor: the driver gives it the rest of its share again."""
        state = self.state  # read first: once it says done, every record is in the list below
        if self.error:
            raise RuntimeError(f"regenerate failed: {self.error}")
        with self.lock:
            records, self.records = self.records, []
            now = AnswerStats(**{k: v for k, v in vars(self.stats).items()})
        delta = {k: v - getattr(self.sent, k) for k, v in vars(now).items()}
        self.sent = now
        return records, delta, state


def regenerate_on_ray(target: str, prompts: list[PromptTurns], params: SamplingParams, *, batch_size: int,
                      max_prompt_tokens: int, on_records: Callable[[list[dict], dict], None], num_actors: int = 1,
                      num_cpus_per_actor: float = 1.0, num_gpus_per_actor: float = 0.0, target_dtype: str = "float32",
                      target_device: str = "cpu", chat_template: str | None = None, max_restarts: int = 3,
                      start_timeout_s: float = 600.0) -> None:
    """Answer every prompt; ``on_records(records, stats)`` runs in the driver as records finish."""
    if not prompts:
        return
    check_cluster_gpus(num_actors * num_gpus_per_actor, gpus_field="capture.num_gpus_per_actor",
                       who="regenerate actors")
    shares = [prompts[i::num_actors] for i in range(min(num_actors, len(prompts)))]
    options = actor_options(num_cpus_per_actor, num_gpus_per_actor, max_restarts)
    kwargs = {"batch_size": batch_size, "max_len": engine_max_len(max_prompt_tokens, params),
              "target_dtype": target_dtype, "target_device": target_device, "chat_template": chat_template}
    actors = [RegenerateActor.options(**options).remote(target, **kwargs) for _ in shares]
    left = [{p.id: p for p in share} for share in shares]  # what each actor has not handed over yet
    restarts = [0] * len(actors)
    try:
        for i, actor in enumerate(actors):
            _wait_ready(actor, start_timeout_s)
            actor.start.remote(list(left[i].values()), params, max_prompt_tokens)
        active = set(range(len(actors)))
        while active:
            time.sleep(POLL_S)
            for i in sorted(active):
                try:
                    records, stats, state = ray.get(actors[i].poll.remote())
                except (RayActorError, ActorUnavailableError):
                    state, records = "lost", []
                if state in ("lost", "idle"):  # died; a poll may also reach its restarted successor first
                    restarts[i] += 1
                    if restarts[i] > max_restarts:
                        raise RuntimeError(f"regenerate actor {i} died {restarts[i]} times; {len(left[i])} of its "
                                           "conversations are not answered")
                    _wait_ready(actors[i], start_timeout_s)  # restarted by Ray
                    actors[i].start.remote(list(left[i].values()), params, max_prompt_tokens)
                    continue
                for record in records:
                    left[i].pop(record["id"], None)
                on_records(records, stats)
                if state == "done":
                    active.discard(i)
    finally:
        for actor in actors:
            ray.kill(actor)


def _wait_ready(actor, timeout_s: float) -> None:
    """Until the actor answers (its target loaded); a restarting actor is unavailable for a while."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            ray.get(actor.ready.remote(), timeout=max(deadline - time.monotonic(), 0.1))
            return
        except ActorUnavailableError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.5)
