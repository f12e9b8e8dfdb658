"""``specray bench train``: it captures its features, trains, prints the step split and writes its JSON,
for an algorithm whose objective is not DFlash's (EAGLE-3 has no ``num_anchors``)."""

import json

from specray.pipeline.cli import main


def test_bench_train_runs_and_writes_its_json(tmp_path, capsys):
    out = tmp_path / "train.json"
    assert main(["bench", "train", "--json", str(out), "target.name=debug", "drafter.algorithm=eagle3",
                 "objective.ttt_length=2", "optim.total_steps=7", "optim.micro_batch_size=1",
                 f"output.run_dir={tmp_path / 'run'}"]) == 0
    result = json.loads(out.read_text())
    assert result["benchmark"] == "train" and result["algorithm"] == "eagle3"
    assert result["objective"]["ttt_length"] == 2 and result["steps_timed"] == 2  # 7 steps - 5 warm-up
    assert set(result["split_seconds"]) == {"data", "forward", "backward", "optimizer"}
    assert result["tokens_per_s"] > 0 and result["final_loss"] > 0
    assert result["command"].startswith("specray bench train --json")
    table = capsys.readouterr().out
    assert "tokens/s" in table and "eagle3" in table and f"wrote {out}" in table
