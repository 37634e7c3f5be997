"""What is live at XLA's memory peak: the buffers of the compiled program's highest point.

``compiled.memory_analysis()`` gives one number, the temp bytes. To say *what* sits there, XLA's
own liveness is read: compiling with ``xla_dump_to`` makes XLA write the module's live ranges
(``*-live-range.txt``), which name every buffer live at the peak with its bytes. Each is matched
to its instruction in the scheduled HLO, whose ``op_name`` metadata says what made it (the JAX
operation, under jax_drain's ``named_scope``s), and sorted into kinds:

* ``argument``: an entry parameter (counted in ``argument_size_in_bytes``, not in temp);
* ``output``: live to the program's end, the step's result (``output_size_in_bytes``);
* ``sync``: made under a bucket's reduce scope (``jax_drain/.../bucket<k>``): the wire copy,
  the received chunks, the accumulated shard;
* ``gather``: made under the parameter gather scope (``jax_drain/gather/...``);
* ``backward`` / ``forward``: the model's own, by whether JAX's ``transpose(...)`` (the
  backward pass) names it;
* ``other``: an instruction without metadata (XLA's copies, constants).

Example::

    compiled, peak = peak_contents(jax.jit(step).lower(*abstract_args))
    print(peak.table())              # kinds and the largest buffers at the peak
    peak.bytes_by_kind()["sync"]     # what the gradient sync holds there
"""

from __future__ import annotations

import dataclasses
import glob
import os
import re
import tempfile
from typing import Any, Mapping

from jax_drain.planner.schedule import Instruction, parse_schedule

__all__ = ["KINDS", "PeakBuffer", "PeakContents", "parse_peak", "peak_contents"]

#: The kinds a buffer at the peak is sorted into (see the module docstring).
KINDS = ("argument", "output", "sync", "gather", "backward", "forward", "other")

_PEAK_RE = re.compile(r"^\s*Live ranges at (\d+) \(peak\):\s*$")
_BUFFER_RE = re.compile(r"^\s+(\S+?)(\{[^}]*\}): (\d+) bytes")
_BUCKET_RE = re.compile(r"bucket(\d+)")
_MAX_RE = re.compile(r"^HloLiveRange \(max (\d+)\):")
_RANGE_RE = re.compile(r"^\s+(\S+?\{[^}]*\}):(\d+)-(\d+)\s*$")


@dataclasses.dataclass(frozen=True)
class PeakBuffer:
    """One buffer live at the peak: ``name`` is its instruction (``{i}``: tuple element ``i``)."""

    name: str
    bytes: int
    kind: str
    op_name: str = ""
    opcode: str = ""

    @property
    def bucket(self) -> int | None:
        """The bucket number its scope names, if any (``sync`` and ``gather`` buffers)."""
        m = _BUCKET_RE.search(self.op_name) if self.kind in ("sync", "gather") else None
        return int(m.group(1)) if m else None


@dataclasses.dataclass(frozen=True)
class PeakContents:
    """The buffers live at XLA's peak (``index``: its position in the schedule), largest first."""

    index: int
    buffers: tuple[PeakBuffer, ...]

    @property
    def temp_bytes(self) -> int:
        """Bytes at the peak besides the arguments and the outputs: XLA's temp there."""
        return sum(b.bytes for b in self.buffers if b.kind not in ("argument", "output"))

    def bytes_by_kind(self) -> dict[str, int]:
        """Bytes at the peak per kind (every kind of :data:`KINDS`, zeros included)."""
        out = dict.fromkeys(KINDS, 0)
        for b in self.buffers:
            out[b.kind] += b.bytes
        return out

    def sync_buckets(self) -> list[int]:
        """The buckets whose reduce buffers are live at the peak, in order."""
        return sorted({b.bucket for b in self.buffers if b.kind == "sync" and b.bucket is not None})

    def summary(self) -> dict[str, Any]:
        """JSON-ready: MiB per kind, the sync buckets live, and the five largest temp buffers."""
        mib = lambda n: round(n / 2**20, 1)  # noqa: E731
        largest = self._temp()[:5]
        return {"temp_mib": mib(self.temp_bytes), **{f"{k}_mib": mib(v) for k, v in self.bytes_by_kind().items()},
                "sync_buckets": self.sync_buckets(),
                "largest": [{"mib": mib(b.bytes), "kind": b.kind, "op": _short(b.op_name) or b.opcode}
                            for b in largest]}

    def table(self, top: int = 8) -> str:
        """Markdown: MiB per kind, then the ``top`` largest buffers besides the arguments."""
        kinds = self.bytes_by_kind()
        lines = [f"peak at schedule position {self.index}: {self.temp_bytes / 2**20:,.1f} MiB besides "
                 f"{kinds['argument'] / 2**20:,.1f} MiB of arguments and {kinds['output'] / 2**20:,.1f} MiB of "
                 "outputs", "", "| kind | MiB |", "|---|---:|"]
        lines += [f"| {k} | {v / 2**20:,.1f} |" for k, v in kinds.items() if k not in ("argument", "output")]
        lines += ["", "| MiB | kind | made by |", "|---:|---|---|"]
        lines += [f"| {b.bytes / 2**20:,.1f} | {b.kind} | {_short(b.op_name) or b.opcode} |"
                  for b in self._temp()[:top]]
        return "\n".join(lines)

    def _temp(self) -> list[PeakBuffer]:
        return [b for b in self.buffers if b.kind not in ("argument", "output")]


def _short(op_name: str, keep: int = 90) -> str:
    return op_name if len(op_name) <= keep else "..." + op_name[-keep:]


def kind_of(instruction: Instruction | None, *, entry_parameter: bool, to_the_end: bool) -> str:
    """A buffer's kind (:data:`KINDS`) from the instruction that defines it and whether it lives
    to the program's end."""
    if entry_parameter:
        return "argument"
    if to_the_end:
        return "output"
    op_name = instruction.op_name if instruction is not None else ""
    if not op_name:
        return "other"
    if "jax_drain/gather" in op_name:
        return "gather"
    if "jax_drain/" in op_name:
        return "sync"
    return "backward" if "transpose(" in op_name else "forward"


def parse_peak(live_range_text: str, instructions: Mapping[str, Instruction], entry_parameters: set[str]) -> PeakContents:
    """:class:`PeakContents` from XLA's live-range dump and the module's instructions by name."""
    lines = live_range_text.splitlines()
    start = next((i for i, line in enumerate(lines) if _PEAK_RE.match(line)), None)
    if start is None:
        raise ValueError("the live-range dump has no 'Live ranges at N (peak):' section")
    index = int(_PEAK_RE.match(lines[start]).group(1))
    last = next((int(m.group(1)) for line in lines if (m := _MAX_RE.match(line))), None)
    ends = {m.group(1): int(m.group(3)) for line in lines[:start] if (m := _RANGE_RE.match(line))}
    buffers = []
    for line in lines[start + 1:]:
        m = _BUFFER_RE.match(line)
        if m is None:
            break
        name, size = m.group(1), int(m.group(3))
        instruction = instructions.get(name)
        kind = kind_of(instruction, entry_parameter=name in entry_parameters,
                       to_the_end=last is not None and ends.get(name + m.group(2)) == last)
        buffers.append(PeakBuffer(name + m.group(2), size, kind,
                                  instruction.op_name if instruction else "", instruction.opcode if instruction else ""))
    buffers.sort(key=lambda b: -b.bytes)
    return PeakContents(index, tuple(buffers))


def peak_contents(lowered: Any, *, compiler_options: Mapping[str, Any] | None = None) -> tuple[Any, PeakContents]:
    """Compiles ``lowered`` (a ``jax.stages.Lowered``) with XLA's dumps on, and returns the
    compiled program and what is live at its memory peak."""
    with tempfile.TemporaryDirectory(prefix="jax_drain_peak_") as directory:
        options = {**(compiler_options or {}), "xla_dump_to": directory, "xla_dump_hlo_pass_re": "^$"}
        compiled = lowered.compile(compiler_options=options)
        ranges = glob.glob(os.path.join(directory, "*after_optimizations-live-range.txt"))
        if not ranges:
            raise RuntimeError("XLA wrote no live-range dump (needs XLA's GPU compiler: compile-only GPU devices)")
        ranges_file = max(ranges, key=os.path.getsize)
        text = open(ranges_file).read()
        # The module as dumped beside it: it also prints the async collectives' wrapped bodies,
        # whose instructions hold the collectives' buffers.
        module = open(ranges_file.removesuffix("-live-range.txt") + ".txt").read()
    schedule = parse_schedule(module)
    instructions = {ins.name: ins for comp in schedule.computations.values() for ins in comp}
    entry = {ins.name for ins in schedule.computations[schedule.entry] if ins.opcode == "parameter"}
    return compiled, parse_peak(text, instructions, entry)
