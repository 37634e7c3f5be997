"""benchmarks/precision.py --quick: the rows, the wire-byte ratios and the errors it reports."""

import json
import math

import pytest

from helpers import load_benchmark


FIELDS = {"preset", "param_dtype", "reduce", "wire_dtype", "wire_bytes", "wire_dtypes", "temp_bytes",
          "argument_bytes", "worst_leaf_rel_error", "num_buckets"}


def _load():
    return load_benchmark("precision")


@pytest.mark.gpu_compile
def test_quick_run_reports_bytes_and_errors(tmp_path):
    precision = _load()
    assert precision.main(["--quick", "--out", str(tmp_path)]) == 0
    rows = json.loads((tmp_path / "precision.json").read_text())
    assert "| params | reduce |" in (tmp_path / "precision.md").read_text()
    assert [(r["param_dtype"], r["wire_dtype"], r["reduce"]) for r in rows] == list(precision.QUICK_RUNS)
    for r in rows:
        assert FIELDS <= r.keys(), FIELDS - r.keys()
        assert r["wire_bytes"] > 0 and r["temp_bytes"] > 0 and r["num_buckets"] > 1
        assert math.isfinite(r["worst_leaf_rel_error"])
    row = {(r["param_dtype"], r["wire_dtype"], r["reduce"]): r for r in rows}
    bf16_accum, int8 = row["bfloat16", None, "fp32_accum"], row["bfloat16", None, "int8_accum"]
    f32, f32_bf16_wire = row["float32", None, "fp32_accum"], row["float32", "bfloat16", "fp32_accum"]

    # Quantized wire: one byte per element plus a float32 scale per block of 256.
    assert int8["wire_bytes"] <= 0.55 * bf16_accum["wire_bytes"]
    assert int8["wire_dtypes"] == ["s8"] and bf16_accum["wire_dtypes"] == ["bf16"]
    # wire_dtype=bfloat16 halves a float32 model's all-to-all bytes.
    assert f32_bf16_wire["wire_bytes"] * 2 == f32["wire_bytes"]
    assert f32["wire_dtypes"] == ["f32"] and f32_bf16_wire["wire_dtypes"] == ["bf16"]
    assert f32_bf16_wire["wire_ratio"] == 1.0

    # float32 sums of bf16 inputs are near exact; the bf16 wire and int8 round each input once.
    assert bf16_accum["worst_leaf_rel_error"] < 1e-6 and f32["worst_leaf_rel_error"] < 1e-6
    assert 1e-4 < f32_bf16_wire["worst_leaf_rel_error"] < 5e-3
    assert 1e-3 < int8["worst_leaf_rel_error"] < 2e-2
