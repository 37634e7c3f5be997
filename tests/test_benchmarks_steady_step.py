"""benchmarks/steady_step.py: every variant trains side by side and the table is written."""

import json

from helpers import load_benchmark


def _load():
    return load_benchmark("steady_step")


def test_dry_run_times_both_jits_and_the_default_side_by_side(tmp_path):
    steady = _load()
    assert steady.main(["--model", "gpt-132k", "--variants", "jit,jit_1device,default", "--rounds", "2",
                        "--out", str(tmp_path)]) == 0
    rows = json.loads((tmp_path / "steady_step.json").read_text())
    assert [r["variant"] for r in rows] == ["jit", "jit_1device", "default"]
    jit, _, default = rows
    assert jit["vs_jit"] == 1.0 and default["vs_jit"] == default["median_s"] / jit["median_s"] > 0
    assert all(0 < r["min_s"] <= r["median_s"] for r in rows)
    assert "| gpt-132k | default |" in (tmp_path / "steady_step.md").read_text()
