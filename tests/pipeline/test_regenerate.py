import json

from specray.capture.data import load_conversations
from specray.pipeline.cli import main


def test_regenerate_writes_capturable_conversations_and_resumes(tmp_path, capsys):
    out = tmp_path / "self.jsonl"
    args = ["regenerate", "--target", "debug", "--out", str(out), "--num", "3", "--max-tokens", "5", "-q"]
    assert main(args) == 0
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(lines) == 3 and all([m["role"] for m in r["messages"]] == ["user", "assistant"] for r in lines)
    convs = list(load_conversations(f"jsonl:{out}"))  # what capture reads
    assert [c.id for c in convs] == [r["id"] for r in lines]
    assert main(args + ["--num", "4"]) == 0  # resumes: only the new one is generated
    assert len(out.read_text().splitlines()) == 4
    assert "already there 3" in capsys.readouterr().out
