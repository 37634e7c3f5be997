"""benchmarks/calibrate.py: XLA's predicted time beside a measured one, dry on CPU."""

import json

import pytest

from helpers import load_benchmark


@pytest.fixture(scope="module")
def calibrate():
    return load_benchmark("calibrate")


@pytest.mark.gpu_compile
def test_dry_run_prints_and_writes_measured_against_predicted(calibrate, tmp_path, capsys):
    assert calibrate.main(["--dry", "--repeats", "3", "--warmup", "1", "--out", str(tmp_path)]) == 0
    row = json.loads((tmp_path / "calibrate.json").read_text())
    assert row["dry"] and row["device"].startswith("cpu") and row["repeats"] == 3
    assert (row["preset"], row["num_layers"], row["d_model"]) == ("tiny", 1, 128)
    assert 0 < row["measured_min_s"] <= row["measured_s"]
    # XLA's prices of the compiled no_comm step: its compute is within its step.
    assert 0 < row["predicted_compute_s"] <= row["predicted_step_s"]
    assert row["ratio"] == row["measured_s"] / row["predicted_step_s"]
    text = (tmp_path / "calibrate.md").read_text()
    assert "Dry run on CPU" in text and f"| {row['ratio']:.2f} |" in text
    assert capsys.readouterr().out == text


def test_without_a_gpu_it_refuses_and_names_the_dry_run(calibrate):
    with pytest.raises(SystemExit, match="no GPU here .* add --dry"):
        calibrate.calibrate("tiny", layers=1, d_model=128)
    with pytest.raises(SystemExit):
        calibrate.main(["--dry", "--repeats", "0"])
