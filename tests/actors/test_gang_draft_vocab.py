"""An online trainer gang (no manifest) with ``drafter.draft_vocab_from``: the driver counts the draft
vocabulary from the dataset once, every rank trains on it, and the checkpoint carries it and its source."""

import json

import pytest
from transformers import AutoTokenizer

from specray.actors.trainer import run_trainer_gang
from specray.capture.target import resolve_target_dir
from specray.trainer.checkpoint import load_checkpoint
from specray.trainer.vocab import dataset_vocabulary

from gang_support import TIMEOUT_S, Stream, train_spec

pytestmark = pytest.mark.ray

SIZE = 16


def test_an_online_gang_trains_on_the_vocabulary_of_draft_vocab_from(ray_cluster, debug_target, tmp_path):
    chats = tmp_path / "chats.jsonl"
    chats.write_text("".join(json.dumps({"messages": [{"role": "user", "content": f"Count to {n}."},
                                                      {"role": "assistant", "content": " ".join(map(str, range(n)))}]})
                             + "\n" for n in (3, 5, 8)))
    expected = dataset_vocabulary(f"jsonl:{chats}", AutoTokenizer.from_pretrained(resolve_target_dir("debug")), SIZE)
    stream = Stream(tmp_path, debug_target)
    try:
        spec = train_spec(tmp_path, "vocab", f"drafter.draft_vocab_size={SIZE}",
                          f"drafter.draft_vocab_from=jsonl:{chats}")
        result = run_trainer_gang(spec, num_workers=2, storage_path=str(tmp_path / "ray"), broker=stream.broker,
                                  max_failures=0, timeout_s=TIMEOUT_S)
        stream.finish(result)
    finally:
        stream.close()
    checkpoint = load_checkpoint(result.checkpoint)
    assert checkpoint.model["draft_vocab"].tolist() == expected.token_ids
    assert checkpoint.extra["provenance"]["draft_vocab"]["source"] == f"jsonl:{chats}"
