"""``specray bench step``: the forward's time split by op kind, and the product chain per kernel."""

import json
import subprocess
import sys

import pytest

from specray.kernels import decode_cpu
from specray.pipeline.bench.step import KINDS, OTHER, PYTHON, bench_step, kind_of, step_table


def test_op_kinds():
    assert kind_of("mkldnn::_linear_pointwise") == "products"
    assert kind_of("specray::attention") == "attention" and kind_of("specray::add_rms_norm") == "norms"
    assert kind_of("aten::baddbmm") == "attention"
    assert kind_of("aten::rms_norm") == "norms"
    assert kind_of("aten::index_copy_") == "kv_writes"
    assert kind_of("aten::silu") == OTHER  # not a kind of its own: counted with the rest


def test_breakdown_accounts_for_the_forward(debug_target):
    result = bench_step(debug_target, batch_sizes=(2, 1), rows=3, context_tokens=16, repeats=2)
    paths = ["fused", "torch"] if decode_cpu.available() else ["torch"]
    assert [(r["batch"], r["path"]) for r in result["results"]] == [(b, p) for b in (1, 2) for p in paths]  # sorted
    for r in result["results"]:
        assert r["rows"] == 3 and r["forward_ms"] > 0
        assert set(r["kinds_ms"]) == {*KINDS, OTHER, PYTHON}
        # every ms of the profiled forward is in one kind or in the Python between ops
        assert sum(r["kinds_ms"].values()) == pytest.approx(r["profiled_forward_ms"], rel=1e-6)
        assert sum(r["shares"].values()) == pytest.approx(1.0)
        # the runner runs each in every forward (the fused attention does the KV writes)
        for kind in ("products", "attention", "norms") + (("kv_writes",) if r["path"] == "torch" else ()):
            assert r["kinds_ms"][kind] > 0, kind
        assert set(r["products_ms"]) >= {"F.linear", "runner"} and min(r["products_ms"].values()) > 0
    assert result["machine"]["dtype"] == "float32"
    assert "products" in step_table(result)


def test_bad_arguments_are_refused(debug_target):
    with pytest.raises(ValueError, match="repeats >= 1"):
        bench_step(debug_target, repeats=0)
    with pytest.raises(ValueError, match="positive batch sizes"):
        bench_step(debug_target, batch_sizes=(0,))


def test_cli_writes_json(tmp_path):
    out = tmp_path / "step.json"
    run = subprocess.run([sys.executable, "-m", "specray.pipeline.cli", "bench", "step", "--target", "debug",
                          "--batch-sizes", "1", "--context-tokens", "8", "--repeats", "1", "--json", str(out)],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    result = json.loads(out.read_text())
    assert result["command"].startswith("specray bench step") and {r["batch"] for r in result["results"]} == {1}
    assert "share of a profiled forward" in run.stdout
