"""benchmarks/memory.py: the time tables read each compiled row's predicted step and exposed time."""


import pytest

from helpers import load_benchmark


@pytest.fixture(scope="module")
def memory():
    return load_benchmark("memory")


def _row(strategy, buckets, step_ms, exposed_ms, preset="gpt-blocks"):
    return {"preset": preset, "strategy": strategy, "requested_buckets": buckets,
            "predicted_step_s": None if step_ms is None else step_ms * 1e-3,
            "exposed_comm_s": None if exposed_ms is None else exposed_ms * 1e-3}


def test_time_table_has_a_cell_per_compiled_row_and_repeats_rows_compiled_once(memory):
    rows = [_row("gspmd", 7, 50.0, 4.0), _row("fp32_accum+drain", 7, 60.25, 9.5),
            _row("fp32_accum+drain", 28, 55.0, 2.0), _row("no_comm", 28, 40.0, 0.0),
            _row("no_comm", 7, None, None),  # unpriced: left blank
            {**_row("zero3+drain", 28, 1.0, 1.0), "available": False}]
    text = memory.time_markdown(rows)
    lines = text.splitlines()
    assert "| strategy | 7 | 28 |" in lines
    assert "| gspmd | 50.0 (4.0) * | 50.0 (4.0) * |" in lines
    assert "| fp32_accum+drain | 60.2 (9.5) | 55.0 (2.0) |" in lines
    assert "| no_comm |  | 40.0 (0.0) |" in lines
    assert "zero3+drain" not in text  # unavailable rows have no time
    assert memory.time_markdown([_row("no_comm", 7, None, None)]) == ""
