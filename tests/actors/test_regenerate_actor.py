"""Regeneration on Ray: conversations dealt out to actors come back as the answers one process
gives, every conversation once, also when an actor is killed in the middle of its share."""

import os
import signal

import pytest

from specray.serving.regenerate import PromptTurns
from specray.serving.sampling import SamplingParams

pytestmark = pytest.mark.ray

PROMPTS = [PromptTurns(f"c{i}", (f"Question {i}: tell me about {i * 7}.", "And then?"), kind="chat") for i in range(16)]
# the debug target never ends a turn by itself: a token it often writes stands for the end of turn,
# so some answers stop (and their conversations go on to the second turn) and some are cut
PARAMS = SamplingParams(max_tokens=24, stop_token_ids=(186,))


def _here() -> dict[str, dict]:
    from specray.capture.target import load_target
    from specray.serving.engine import Engine
    from specray.serving.regenerate import answer_conversations

    engine = Engine(load_target("debug"), None, max_batch=2, max_len=256, max_waiting=None)
    return {r["id"]: r for r in answer_conversations(engine, PROMPTS, PARAMS, max_prompt_tokens=200)}


@pytest.mark.parametrize("kill", [None, "poll-fails", "poll-reaches-the-restarted-actor"])
def test_actors_answer_as_one_process_does(ray_cluster, monkeypatch, kill):
    """Killed mid-share, an actor is seen dead by the next poll, or (once Ray has restarted it) as an
    actor with no share: either way it is given the rest of its share again."""
    import time

    from ray.util.state import list_actors

    import specray.actors.regenerate as regen

    monkeypatch.setattr(regen, "POLL_S", 0.1)
    got, killed = [], []

    def alive():
        return list_actors(address=ray_cluster.dashboard_url,
                           filters=[("class_name", "=", "RegenerateActor"), ("state", "=", "ALIVE")])

    def on_records(records, stats):
        got.extend(records)
        if kill and records and not killed:  # mid-share: some records handed over, the rest not yet
            victim = alive()[0]
            os.kill(victim.pid, signal.SIGKILL)
            killed.append(victim.pid)
            if kill == "poll-reaches-the-restarted-actor":
                deadline = time.monotonic() + 120
                while not any(a.actor_id == victim.actor_id and a.pid != victim.pid for a in alive()):
                    assert time.monotonic() < deadline, "Ray did not restart the killed actor"
                    time.sleep(0.2)

    regen.regenerate_on_ray("debug", PROMPTS, PARAMS, batch_size=2, max_prompt_tokens=200, on_records=on_records,
                            num_actors=2, num_cpus_per_actor=1)
    assert bool(killed) == bool(kill)
    assert sorted(r["id"] for r in got) == sorted(p.id for p in PROMPTS)  # each conversation once
    reference = _here()
    assert {r["id"]: r for r in got} == reference  # greedy: the same records wherever they were answered
    assert any(r["turns"] == 2 for r in got) and any(r["finish_reason"] == "length" for r in got)
