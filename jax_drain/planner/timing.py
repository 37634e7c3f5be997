"""What a step costs in time, as XLA's GPU scheduler prices it: read from its schedule dump.

XLA:GPU's latency-hiding scheduler prices every instruction and every asynchronous collective
with its latency estimator, and orders the program to hide the collectives behind compute.
With ``xla_dump_latency_hiding_schedule`` it writes what it decided, per computation it
scheduled, as a text ``ScheduleProto``: each instruction's start and end, the estimator's
cycles per microsecond, and its statistics (the total, and the time each collective kind
leaves exposed: "wasted cycles"). That is the supported interface this module reads; it is
the price list the scheduler optimised, for the very program whose memory the planner reports.

What the figures are (jaxlib 0.10, the H100 target of :mod:`jax_drain.planner.targets`):

* The estimator is XLA's default on this target, the speed-of-light one: collectives from
  their bytes and the target's link model, GEMMs from a table of measured shapes, other
  fusions from XLA's GPU performance model, everything else at ~0. Its unit is the
  microsecond (the dump says 1 cycle per microsecond).
* A ``while`` loop costs ~0 in the computation that runs it; its body is scheduled on its own.
  :func:`parse_schedule_dump` adds each body's total times its known trip count, and a
  ``conditional``'s dearest branch. A body the scheduler did not schedule (one with no
  asynchronous collective) has no price: the step's time is then ``None``, with the reason,
  never a silent undercount.
* These are XLA's estimates, not measurements, and have not been checked against a GPU. On
  a compile-only target nothing is autotuned: GEMMs XLA emits as Triton fusions are priced by
  the performance model far above their FLOPs at the target's peak (BUILD.md, "Time").

Example::

    options = schedule_dump_options(directory)
    compiled = jitted.lower(*args).compile(compiler_options=options)
    time = read_schedule_dump(directory)
    time.step_s, time.exposed_comm_s, time.exposed_comm_by_kind
"""

from __future__ import annotations

import dataclasses
import pathlib
import re
from typing import Any

__all__ = ["ScheduleDumpError", "StepTime", "parse_schedule_dump", "parse_text_proto", "read_schedule_dump",
           "schedule_dump_options"]

_FIELD = re.compile(r"^([A-Za-z_]\w*)\s*:\s*(.*)$")
_OPEN = re.compile(r"^([A-Za-z_]\w*)\s*\{$")
_WASTED = re.compile(r"^(\w+)_wasted_cycles$")
_TRIP_COUNT = re.compile(r'known_trip_count\W+n\W+(\d+)')


class ScheduleDumpError(ValueError):
    """XLA's schedule dump is missing or not in the form this version reads."""


def schedule_dump_options(directory: str | pathlib.Path) -> dict[str, Any]:
    """Compile options that make XLA write the latency-hiding schedule to ``directory``
    (and no HLO dumps). They change no pass: the program compiled is the same."""
    return {"xla_dump_to": str(directory), "xla_dump_latency_hiding_schedule": True,
            "xla_dump_hlo_module_re": "^$"}


@dataclasses.dataclass(frozen=True)
class StepTime:
    """XLA's predicted time of one step, in seconds (``None`` where it cannot be priced).

    ``step_s``: the scheduled program's total. ``exposed_comm_s``: the time collectives
    leave exposed (the scheduler's wasted cycles), ``exposed_comm_by_kind`` per collective
    kind (``"all-to-all"``, ...). ``hidden_compute_s``: compute that runs while a collective
    is in flight, the compute the communication hides behind. ``compute_s``: every
    instruction's own cost. ``unpriced``: why a figure is ``None``.
    """

    step_s: float | None
    exposed_comm_s: float | None
    exposed_comm_by_kind: dict[str, float]
    hidden_compute_s: float | None
    compute_s: float | None
    unpriced: tuple[str, ...] = ()

    def to_json(self) -> dict[str, Any]:
        """``predicted_step_s``, ``exposed_comm_s``, ``exposed_comm_by_kind``,
        ``hidden_compute_s``, ``compute_s`` (seconds) and ``unpriced``."""
        return {"predicted_step_s": self.step_s, "exposed_comm_s": self.exposed_comm_s,
                "exposed_comm_by_kind": dict(self.exposed_comm_by_kind),
                "hidden_compute_s": self.hidden_compute_s, "compute_s": self.compute_s,
                "unpriced": list(self.unpriced)}

    def summary(self) -> str:
        """``"predicted step 17.85 ms, exposed communication 2.49 ms (all-to-all 2.49), ..."``."""
        if self.step_s is None:
            return "predicted step: not priced (" + "; ".join(self.unpriced) + ")"
        kinds = ", ".join(f"{k} {v * 1e3:.2f}" for k, v in self.exposed_comm_by_kind.items() if v)
        return (f"predicted step {self.step_s * 1e3:.2f} ms (XLA's estimate), exposed communication "
                f"{self.exposed_comm_s * 1e3:.2f} ms" + (f" ({kinds})" if kinds else "")
                + f", compute under communication {self.hidden_compute_s * 1e3:.2f} ms")


def parse_text_proto(text: str) -> dict[str, list[Any]]:
    """A protobuf text-format message as nested dicts: each field name maps to the list of
    its values (a string for a scalar, unquoted; a dict for a message), in order.

    Example::

        >>> parse_text_proto('a: 1\\nb {\\n  c: "x"\\n}\\n')
        {'a': ['1'], 'b': [{'c': ['x']}]}
    """
    root: dict[str, list[Any]] = {}
    stack = [root]
    for number, raw in enumerate(text.splitlines(), 1):
        line = raw.strip()
        if not line:
            continue
        if line == "}":
            if len(stack) == 1:
                raise ScheduleDumpError(f"line {number}: '}}' closes nothing")
            stack.pop()
        elif m := _OPEN.match(line):
            child: dict[str, list[Any]] = {}
            stack[-1].setdefault(m.group(1), []).append(child)
            stack.append(child)
        elif m := _FIELD.match(line):
            value = m.group(2)
            if value.startswith('"') and value.endswith('"') and len(value) >= 2:
                value = bytes(value[1:-1], "utf-8").decode("unicode_escape")
            stack[-1].setdefault(m.group(1), []).append(value)
        else:
            raise ScheduleDumpError(f"line {number} is not protobuf text format: {line[:80]!r}")
    if len(stack) != 1:
        raise ScheduleDumpError("the text ends inside a message")
    return root


def _one(message: dict[str, list[Any]], field: str, where: str) -> Any:
    try:
        return message[field][0]
    except (KeyError, IndexError):
        raise ScheduleDumpError(f"XLA's schedule dump has no {field!r} in {where}: this jaxlib writes "
                                "another format, which jax_drain.planner.timing must learn") from None


@dataclasses.dataclass
class _Computation:
    total: float  # the computation's own schedule, in its own units
    wasted: dict[str, float]
    compute: float
    hidden: float
    calls: list[tuple[str, int, list[str]]]  # (opcode, trip count, called computation ids)


def parse_schedule_dump(text: str) -> StepTime:
    """The :class:`StepTime` of XLA's schedule dump (the ``*.schedule.txt`` file written with
    :func:`schedule_dump_options`). Raises :class:`ScheduleDumpError` when a field it needs is
    missing, so that a changed format fails loudly rather than pricing a step wrongly."""
    root = parse_text_proto(text)
    module = _one(root, "hlo_module", "the dump")
    entry = _one(module, "entry_computation_id", "the HLO module")
    instructions: dict[str, dict[str, list[Any]]] = {}
    for comp in module.get("computations", []):
        for inst in comp.get("instructions", []):
            instructions[_one(inst, "id", "an instruction")] = inst
    computations: dict[str, _Computation] = {}
    per_microsecond = None
    for sched in root.get("computation_schedules", []):
        cid = _one(sched, "computation_id", "a computation schedule")
        stats = _one(sched, "scheduler_statistics", f"computation {cid}'s schedule")
        rate = float(_one(sched, "cycles_per_microsecond", f"computation {cid}'s schedule"))
        if per_microsecond not in (None, rate):
            raise ScheduleDumpError(f"computations scheduled at {per_microsecond} and {rate} cycles per microsecond")
        per_microsecond = rate
        wasted = {m.group(1).replace("_", "-"): float(v[0]) for k, v in stats.items()
                  if (m := _WASTED.match(k)) and m.group(1) != "total"}
        total = float(stats.get("total_cycles", ["0"])[0])
        if "total_cycles" not in stats and stats:
            raise ScheduleDumpError(f"computation {cid}'s scheduler statistics have no total_cycles: this jaxlib "
                                    "writes another format, which jax_drain.planner.timing must learn")
        computations[cid] = _price_schedule(sched, instructions, total, wasted)
    if entry not in computations:
        return StepTime(None, None, {}, None, None,
                        ("XLA scheduled no computation of the step: it has no asynchronous collective",))
    if not per_microsecond or per_microsecond <= 0:
        raise ScheduleDumpError(f"the dump gives {per_microsecond} cycles per microsecond")
    unpriced: list[str] = []
    total, wasted, compute, hidden = _unrolled(entry, computations, unpriced, set())
    if unpriced:
        return StepTime(None, None, {}, None, None, tuple(dict.fromkeys(unpriced)))
    seconds = 1e-6 / per_microsecond
    return StepTime(step_s=total * seconds, exposed_comm_s=sum(wasted.values()) * seconds,
                    exposed_comm_by_kind={k: v * seconds for k, v in wasted.items()},
                    hidden_compute_s=hidden * seconds, compute_s=compute * seconds)


def _price_schedule(sched: dict[str, list[Any]], instructions: dict[str, Any], total: float,
                    wasted: dict[str, float]) -> _Computation:
    """One scheduled computation: its own costs, the compute inside collective windows, and
    the loops, branches and calls whose computations it runs."""
    times = {}
    for inst in sched.get("instructions", []):
        iid = _one(inst, "id", "a scheduled instruction")
        # Text format leaves out fields at their default, 0.
        times[iid] = (float(inst.get("start_timestamp_cycles", ["0"])[0]),
                      float(inst.get("end_timestamp_cycles", ["0"])[0]))
    windows, compute, calls = [], 0.0, []
    for iid, (start, end) in times.items():
        inst = instructions.get(iid)
        if inst is None:
            raise ScheduleDumpError(f"scheduled instruction {iid} is not in the dump's HLO module")
        opcode = _one(inst, "opcode", f"instruction {iid}")
        if opcode.endswith("-done") or opcode == "async-done":
            begun = times.get(_one(inst, "operand_ids", f"instruction {iid}"))
            if begun is not None:
                windows.append((begun[1], start))
        elif not opcode.endswith("-start") and opcode not in ("async-start", "async-update"):
            compute += end - start
        if opcode in ("while", "conditional", "call"):
            trips = _TRIP_COUNT.search(inst.get("backend_config", [""])[0]) if opcode == "while" else None
            calls.append((opcode, int(trips.group(1)) if trips else 0, inst.get("called_computation_ids", [])))
    hidden = 0.0
    for iid, (start, end) in times.items():
        opcode = _one(instructions[iid], "opcode", f"instruction {iid}")
        if end > start and "start" not in opcode and "done" not in opcode and opcode != "async-update":
            hidden += _covered(start, end, windows)
    return _Computation(total, wasted, compute, hidden, calls)


def _covered(start: float, end: float, windows: list[tuple[float, float]]) -> float:
    """How much of ``[start, end]`` lies in the union of ``windows``."""
    pieces = sorted((max(start, a), min(end, b)) for a, b in windows if b > start and a < end)
    covered, reach = 0.0, start
    for a, b in pieces:
        a = max(a, reach)
        if b > a:
            covered += b - a
            reach = b
    return covered


def _unrolled(cid: str, computations: dict[str, _Computation], unpriced: list[str],
              active: set[str]) -> tuple[float, dict[str, float], float, float]:
    """(total, wasted per kind, compute, hidden) of computation ``cid`` with every loop body
    at its trip count and every conditional at its dearest branch."""
    comp = computations[cid]
    total, wasted, compute, hidden = comp.total, dict(comp.wasted), comp.compute, comp.hidden
    for opcode, trips, called in comp.calls:
        priced = [c for c in called if c in computations and c not in active]
        if opcode == "while":
            if not priced:
                unpriced.append("a loop whose body XLA's scheduler did not schedule (no asynchronous collective "
                                "in it), so it gave the loop no time")
                continue
            if not trips:
                unpriced.append("a loop without a known trip count")
                continue
            parts = [_unrolled(c, computations, unpriced, active | {cid}) for c in priced]
            scale = trips
        else:
            if len(priced) < len(called) and opcode == "conditional":
                unpriced.append("a conditional branch XLA's scheduler did not schedule")
                continue
            parts = [_unrolled(c, computations, unpriced, active | {cid}) for c in priced]
            if opcode == "conditional" and parts:
                parts = [max(parts, key=lambda p: p[0])]
            scale = 1
        for t, w, c, h in parts:
            total += scale * t
            compute += scale * c
            hidden += scale * h
            for kind, v in w.items():
                wasted[kind] = wasted.get(kind, 0.0) + scale * v
    return total, wasted, compute, hidden


def read_schedule_dump(directory: str | pathlib.Path) -> StepTime:
    """:func:`parse_schedule_dump` of the one ``*.schedule.txt`` file in ``directory``; a
    step XLA wrote none for (nothing asynchronous to schedule) is unpriced, with that reason."""
    files = sorted(pathlib.Path(directory).glob("*.schedule.txt"))
    if len(files) > 1:
        raise ScheduleDumpError(f"{len(files)} schedule dumps in {directory}: compile one step per directory")
    if not files:
        return StepTime(None, None, {}, None, None,
                        ("XLA's scheduler wrote no schedule: the step has no asynchronous collective",))
    return parse_schedule_dump(files[0].read_text())
