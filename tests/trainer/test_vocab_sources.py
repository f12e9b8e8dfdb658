"""``drafter.draft_vocab_from``: the draft vocabulary counted from a dataset (rendered with the
target's chat template) equals the one counted from a manifest captured from the same
conversations, whether the conversations come from a jsonl file or from recorded traffic; a
training run without a manifest (online) counts it from the source and records it; the online
pipeline config accepts it and names the field when it is missing."""

import json

import pytest

from specray.capture.store import open_store, read_manifest
from specray.pipeline.cli import main
from specray.pipeline.config import PipelineConfig, TrainJobConfig
from specray.serving.recorder import RecordSettings, TrafficRecorder, chat_record
from specray.trainer.assembly import build_rank, count_draft_vocab
from specray.trainer.vocab import DraftVocabulary, dataset_vocabulary, draft_vocabulary

CONVERSATIONS = [
    [{"role": "user", "content": "Name three colours."}, {"role": "assistant", "content": "Red, green and blue."}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2 + 2?"},
     {"role": "assistant", "content": "4"}, {"role": "user", "content": "And 3 + 3?"},
     {"role": "assistant", "content": "6, of course."}],
    [{"role": "user", "content": "Say hello."}, {"role": "assistant", "content": "Hello hello hello!"}],
]
SIZE = 12


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    """The conversations as a jsonl file, as recorded traffic, and as a manifest captured from the file."""
    root = tmp_path_factory.mktemp("vocab-sources")
    jsonl = root / "chats.jsonl"
    jsonl.write_text("".join(json.dumps({"messages": c}) + "\n" for c in CONVERSATIONS))
    recorder = TrafficRecorder(RecordSettings(uri=str(root / "records"), records_per_shard=2), replica_id="r").start()
    for i, c in enumerate(CONVERSATIONS):
        recorder.offer(chat_record(c[:-1], c[-1]["content"], id=f"chatcmpl-{i}", created=i, model="debug",
                                   drafter_version=None, temperature=0.0, top_p=1.0, max_tokens=16,
                                   finish_reason="stop", prompt_tokens=1, completion_tokens=1))
    recorder.close()
    assert recorder.stats()["recorded"] == len(CONVERSATIONS)
    assert main(["capture", "-q", "-c", "manifests/capture-quickstart.yaml", "name=vocab", "target.name=debug",
                 f"data.dataset=jsonl:{jsonl}", "data.max_length=256", f"output.run_dir={root / 'capture'}"]) == 0
    return {"jsonl": f"jsonl:{jsonl}", "records": f"records:{root / 'records'}",
            "manifest": str(root / "capture" / "manifest.parquet")}


def test_a_dataset_counts_like_a_manifest_captured_from_it(sources, debug_target):
    manifest = read_manifest(sources["manifest"])
    assert len(manifest.refs) == len(CONVERSATIONS)
    from_manifest = draft_vocabulary(manifest, open_store(manifest.store_uri), SIZE, source="m")
    for name in ("jsonl", "records"):
        vocab = dataset_vocabulary(sources[name], debug_target.tokenizer, SIZE, max_length=256)
        assert vocab.source == sources[name]
        assert (vocab.token_ids, vocab.counted_tokens, vocab.coverage) == (
            from_manifest.token_ids, from_manifest.counted_tokens, from_manifest.coverage)
    assert 0 < from_manifest.coverage < 1  # a real choice: the answers hold more than SIZE distinct tokens


def _train_spec(tmp_path, **drafter):
    cfg = TrainJobConfig(name="t", target={"name": "debug"}, data={"manifest": None},
                         drafter={"algorithm": "dflash", "draft_vocab_size": SIZE, **drafter},
                         output={"run_dir": str(tmp_path / "run")})
    return cfg.train_spec()


def test_a_run_without_a_manifest_counts_from_draft_vocab_from(sources, tmp_path):
    manifest = read_manifest(sources["manifest"])
    expected = draft_vocabulary(manifest, open_store(manifest.store_uri), SIZE, source="m").token_ids
    spec = _train_spec(tmp_path, draft_vocab_from=sources["records"])
    vocab = count_draft_vocab(spec)
    assert vocab.token_ids == expected and vocab.source == sources["records"]
    assert DraftVocabulary.load(tmp_path / "run" / "draft_vocab.json") == vocab  # kept for resume and ranks
    parts = build_rank(spec, manifest.contract, draft_vocab=vocab)  # what every rank of an online gang gets
    assert parts.core.model.draft_vocab.tolist() == expected
    assert parts.extra["provenance"]["draft_vocab"] == {"size": SIZE, "coverage": vocab.coverage,
                                                        "source": sources["records"]}  # exported with the drafter
    limited = count_draft_vocab(_train_spec(tmp_path, draft_vocab_from=sources["jsonl"], draft_vocab_samples=1))
    assert limited.source == f"{sources['jsonl']}[:1]" and limited.counted_tokens < vocab.counted_tokens
    by_manifest = count_draft_vocab(_train_spec(tmp_path, draft_vocab_from=sources["manifest"]))
    assert by_manifest.token_ids == expected and by_manifest.source == sources["manifest"]
    assert count_draft_vocab(_train_spec(tmp_path)) is None  # no manifest, no source: the rank refuses it
    with pytest.raises(ValueError, match="draft_vocab_samples limits a dataset"):
        count_draft_vocab(_train_spec(tmp_path / "m", draft_vocab_from=sources["manifest"], draft_vocab_samples=1))


def test_the_drafter_section_checks_the_vocab_fields():
    with pytest.raises(ValueError, match="draft_vocab_from=sharegpt counts a draft vocabulary of draft_vocab_size"):
        TrainJobConfig(data={"manifest": None}, drafter={"draft_vocab_from": "sharegpt"})
    with pytest.raises(ValueError, match="draft_vocab_samples limits the conversations"):
        TrainJobConfig(data={"manifest": None}, drafter={"draft_vocab_size": 8, "draft_vocab_samples": 4})


def test_the_online_pipeline_accepts_draft_vocab_from():
    online = {"mode": "online", "online": {"max_inflight_samples": 1024}}
    cfg = PipelineConfig(**online, train={"drafter": {"draft_vocab_size": 64, "draft_vocab_from": "sharegpt",
                                                      "draft_vocab_samples": 100}})
    assert cfg.train_job(None).train_spec().drafter.draft_vocab_from == "sharegpt"
    with pytest.raises(ValueError, match=r"draft_vocab_size=64 .* set train\.drafter\.draft_vocab_from="):
        PipelineConfig(**online, train={"drafter": {"draft_vocab_size": 64}})
