"""Reading XLA's latency-hiding schedule dump: the step's predicted time (jax_drain.planner.timing)."""

import gzip
import pathlib

import pytest

from jax_drain.planner.timing import ScheduleDumpError, StepTime, parse_schedule_dump, parse_text_proto, read_schedule_dump

# A step whose entry runs a 4-trip loop, then an all-reduce over a 5 us fusion that it waits 1
# us for; the loop body sends an all-to-all over a 10 us fusion and waits 2 us for it.
# Times in cycles of 1 us.
DUMP = """hlo_module {
  entry_computation_id: 10
  computations {
    id: 10
    instructions {
      name: "p"
      opcode: "parameter"
      id: 1
    }
    instructions {
      name: "loop"
      opcode: "while"
      id: 2
      called_computation_ids: 20
      called_computation_ids: 21
      backend_config: "{\\"known_trip_count\\":{\\"n\\":\\"4\\"}}"
    }
    instructions {
      name: "ars"
      opcode: "all-reduce-start"
      id: 3
    }
    instructions {
      name: "f"
      opcode: "fusion"
      id: 4
    }
    instructions {
      name: "ard"
      opcode: "all-reduce-done"
      id: 5
      operand_ids: 3
    }
  }
  computations {
    id: 20
    instructions {
      name: "a2a"
      opcode: "async-start"
      id: 6
    }
    instructions {
      name: "g"
      opcode: "fusion"
      id: 7
    }
    instructions {
      name: "a2a-done"
      opcode: "async-done"
      id: 8
      operand_ids: 6
    }
  }
}
computation_schedules {
  computation_id: 20
  instructions {
    id: 6
    end_timestamp_cycles: 1
  }
  instructions {
    id: 7
    start_timestamp_cycles: 1
    end_timestamp_cycles: 11
  }
  instructions {
    id: 8
    start_timestamp_cycles: 13
    end_timestamp_cycles: 14
  }
  scheduler_statistics {
    all_to_all_wasted_cycles: 2
    total_wasted_cycles: 2
    total_cycles: 14
  }
  cycles_per_microsecond: 1
}
computation_schedules {
  computation_id: 10
  instructions {
    id: 1
  }
  instructions {
    id: 2
    end_timestamp_cycles: 0.01
  }
  instructions {
    id: 3
    start_timestamp_cycles: 0.01
    end_timestamp_cycles: 1.01
  }
  instructions {
    id: 4
    start_timestamp_cycles: 1.01
    end_timestamp_cycles: 6.01
  }
  instructions {
    id: 5
    start_timestamp_cycles: 7.01
    end_timestamp_cycles: 8.01
  }
  scheduler_statistics {
    all_reduce_wasted_cycles: 1
    total_wasted_cycles: 1
    total_cycles: 8.01
  }
  cycles_per_microsecond: 1
}
"""

RECORDED = pathlib.Path(__file__).parent / "data" / "tiny_drained.schedule.txt.gz"


def test_text_proto_fields_and_messages():
    assert parse_text_proto('a: 1\nb {\n  c: "x\\"y"\n  c: E\n}\n') == {"a": ["1"], "b": [{"c": ['x"y', "E"]}]}
    for bad in ("a {\n", "}\n", "a = 1\n"):
        with pytest.raises(ScheduleDumpError):
            parse_text_proto(bad)


def test_a_loop_counts_its_trips_and_each_kind_its_exposed_time():
    time = parse_schedule_dump(DUMP)
    us = 1e-6
    assert time.step_s == pytest.approx((8.01 + 4 * 14) * us)
    assert time.exposed_comm_by_kind == pytest.approx({"all-reduce": 1 * us, "all-to-all": 4 * 2 * us})
    assert time.exposed_comm_s == pytest.approx(9 * us)
    assert time.hidden_compute_s == pytest.approx((5 + 4 * 10) * us)  # the fusions inside the windows
    assert time.compute_s == pytest.approx((0.01 + 5 + 4 * 10) * us)
    assert time.unpriced == () and time.to_json()["predicted_step_s"] == time.step_s


def test_cycles_per_microsecond_scale_every_figure():
    time = parse_schedule_dump(DUMP.replace("cycles_per_microsecond: 1", "cycles_per_microsecond: 1000"))
    assert time.step_s == pytest.approx((8.01 + 4 * 14) * 1e-9)


def test_a_loop_the_scheduler_did_not_price_makes_the_step_unpriced_not_free():
    unscheduled = DUMP[:DUMP.index("computation_schedules {")] + DUMP[DUMP.index("computation_schedules {\n  computation_id: 10"):]
    time = parse_schedule_dump(unscheduled)
    assert time.step_s is None and time.exposed_comm_s is None
    assert "did not schedule" in time.unpriced[0] and "not priced" in time.summary()
    no_trips = parse_schedule_dump(DUMP.replace('known_trip_count', 'unknown_count'))
    assert no_trips.step_s is None and "known trip count" in no_trips.unpriced[0]


def test_a_changed_format_fails_loudly():
    with pytest.raises(ScheduleDumpError, match="total_cycles"):
        parse_schedule_dump(DUMP.replace("total_cycles: 14", "all_cycles: 14"))
    with pytest.raises(ScheduleDumpError, match="hlo_module"):
        parse_schedule_dump(DUMP.replace("hlo_module {", "module {"))
    with pytest.raises(ScheduleDumpError, match="not in the dump's HLO module"):
        parse_schedule_dump(DUMP.replace("id: 7\n    start", "id: 70\n    start"))


def test_no_dump_means_nothing_asynchronous_to_schedule(tmp_path):
    time = read_schedule_dump(tmp_path)
    assert time == StepTime(None, None, {}, None, None, time.unpriced) and "no asynchronous collective" in time.unpriced[0]
    (tmp_path / "a.schedule.txt").write_text(DUMP)
    assert read_schedule_dump(tmp_path).step_s == pytest.approx(64.01e-6)
    (tmp_path / "b.schedule.txt").write_text(DUMP)
    with pytest.raises(ScheduleDumpError, match="one step per directory"):
        read_schedule_dump(tmp_path)


def test_a_recorded_dump_of_a_drained_step():
    """XLA's own dump (jaxlib 0.10.2, the tiny preset's ``fp32_accum+drain`` step with 3 buckets
    on 8x H100, trimmed by ``tests/data/trim_schedule_dump.py``): the format this version reads."""
    time = parse_schedule_dump(gzip.decompress(RECORDED.read_bytes()).decode())
    assert time.unpriced == () and time.step_s > 0
    assert set(time.exposed_comm_by_kind) == {"all-to-all"}  # the buckets' wire; the loss's all-reduce hides
    assert time.exposed_comm_s == pytest.approx(sum(time.exposed_comm_by_kind.values()))
    # The scheduler's total: every instruction's cost plus the waits, so compute and exposed fit in it.
    assert time.compute_s + time.exposed_comm_s <= time.step_s * (1 + 1e-12)
    assert 0 < time.hidden_compute_s <= time.compute_s
