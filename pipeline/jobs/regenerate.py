"""``specray regenerate``: answer training prompts with the target itself (self-distillation).

    specray regenerate --dataset sharegpt --num 512 --out data/sharegpt-smollm2.jsonl

Takes the first user turn of each conversation, generates the target's answer with the engine
(continuous batching, ``batch_size`` answers at once; greedy by default, so the data is exactly what greedy serving will produce), and
writes one ``{"id", "messages": [user, assistant], "finish_reason"}`` line per conversation: the
format ``specray capture`` reads as ``data.dataset=jsonl:PATH`` (an answer cut at ``max_tokens``,
``finish_reason: "length"``, has its end-of-turn token unsupervised). A drafter trained on the target's own
outputs sees the distribution it will be verified against, so it is accepted far more often.
Appends to an existing file and skips ids already there, so an interrupted run resumes.
"""

from __future__ import annotations

import json
from pathlib import Path

from tqdm import tqdm

from specray.capture.data import load_conversations
from specray.capture.target import load_target
from specray.serving.engine import Engine
from specray.serving.sampling import SamplingParams


def regenerate(*, target_name: str, dataset: str, num: int, out: str, skip: int = 0, batch_size: int = 4,
               max_prompt_tokens: int = 512, params: SamplingParams, progress: bool = True) -> dict:
    target = load_target(target_name)
    engine = Engine(target, None, max_batch=batch_size, max_len=max_prompt_tokens + params.max_tokens + 8,
                    max_waiting=None)  # every prompt is queued at once
    path = Path(out)
    path.parent.mkdir(parents=True, exist_ok=True)
    done = {json.loads(line)["id"] for line in path.read_text().splitlines()} if path.exists() else set()
    todo, too_long = [], 0
    for conv in load_conversations(dataset, purpose="train", limit=num, skip=skip):
        user = next((c for r, c in conv.messages if r == "user"), None)
        if user is None or conv.id in done:
            continue
        if len(engine.encode(user)) > max_prompt_tokens:
            too_long += 1
            continue
        todo.append((conv.id, user))
    tokens = 0
    # Continuous batching: every prompt is queued at once; the engine keeps batch_size of them
    # running, and an answer is written (and flushed: a rerun resumes) the step it finishes.
    with open(path, "a") as f, tqdm(total=len(todo), unit="prompt", desc="regenerate", disable=not progress) as bar:
        live = [(cid, user, engine.submit(user, params)) for cid, user in todo]
        while live:
            engine.step()
            finished = [item for item in live if item[2].done]
            live = [item for item in live if not item[2].done]
            for cid, user, handle in finished:
                result = handle.result()
                messages = [{"role": "user", "content": user}, {"role": "assistant", "content": result.text}]
                # an answer cut at max_tokens has no end of turn of its own (capture/data.py: Conversation.cut)
                f.write(json.dumps({"id": cid, "messages": messages, "finish_reason": result.finish_reason}) + "\n")
                tokens += len(result.token_ids)
            if finished:
                f.flush()
                bar.update(len(finished))
    return {"written": len(todo), "already_there": len(done), "skipped_too_long": too_long, "tokens": tokens, "out": str(path)}
