"""Peak host memory of checkpoints across processes, per process, against the shards it holds.

Launches 2 local processes x 4 CPU devices (``jax.distributed``, gloo) running
:func:`jax_drain.testing.multiprocess.run_host_memory`: a ZeRO-3 train state (MLP, 16.8M float32
parameters, Adam) spanning both processes is saved, restored onto the same layout, and restored
onto another bucket size (re-laid one parameter at a time). Each process reports the
host memory each call used at its peak beyond what it held before (``VmHWM`` after, ``VmRSS``
before, the high-water mark reset, freed heap returned to the OS first), in MiB and in units of
the bytes of the state's shards it holds. The process's first save is measured on its own, with
what it still holds after it (orbax's and tensorstore's pools start with it and stay); the other
figures follow a warm-up restore. On CPU devices
a restored state's own arrays are host memory, so a restore costs at least 1.0x.

    python benchmarks/host_memory.py --out benchmarks/results     # host_memory.{md,json}
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import numpy as np

from jax_drain.testing import multiprocess

CASES = (("first_save", "first save_checkpoint"), ("first_save_retained", "held after it"),
         ("save", "save_checkpoint"), ("restore", "restore, same layout"),
         ("relayout", "restore onto another bucket size"))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--processes", type=int, default=2)
    parser.add_argument("--devices-per-process", type=int, default=4)
    parser.add_argument("--out", help="directory for host_memory.md and host_memory.json")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        multiprocess.launch_local(args.processes, args.devices_per_process, Path(tmp) / "out", timeout=900,
                                  host_memory=Path(tmp) / "ckpt")
        results = [dict(np.load(Path(tmp) / "out" / f"process{i}.npz")) for i in range(args.processes)]
    rows = []
    for i, r in enumerate(results):
        held = int(r["mem/held"])
        rows.append({"process": i, "held_bytes": held, **{f"{k}_bytes": int(r[f"mem/{k}"]) for k, _ in CASES}})
    lines = [f"### Peak host memory per process, {args.processes} processes x {args.devices_per_process} CPU "
             "devices, ZeRO-3 state (MiB beyond what the process held; x: its shards' bytes)", "",
             "| process | shards held | " + " | ".join(name for _, name in CASES) + " |",
             "|---:|---:|" + "---:|" * len(CASES)]
    for row in rows:
        held = row["held_bytes"]
        cells = [f"{row[f'{k}_bytes'] / 2**20:,.0f} ({row[f'{k}_bytes'] / held:.2f}x)" for k, _ in CASES]
        lines.append(f"| {row['process']} | {held / 2**20:,.0f} | " + " | ".join(cells) + " |")
    text = "\n".join(lines)
    print(text)
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "host_memory.md").write_text(text + "\n")
        (out / "host_memory.json").write_text(json.dumps(rows, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
