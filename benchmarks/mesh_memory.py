"""HSDP x tensor parallel on a virtual 2-host, 16-GPU mesh: memory and collectives per strategy.

Compiles one gradient step of a Megatron-style tensor-parallel MLP block stack
(:func:`jax_drain.plan.build_mesh_step`: column-parallel ``w_in``, row-parallel ``w_out``, one
``psum`` over ``"model"`` per block) on ``("replica", "data", "model") = 2 x 4 x 2`` compile-only
H100s (topology ``1x2x8``: ``"replica"`` crosses the hosts, ``"data"`` x ``"model"`` is one
host), with :class:`jax_drain.GradSync` ``outer_axis="replica"``: each bucket is
reduce-scattered within a host over the 4 ``"data"`` GPUs (an all-to-all of the bucket, summed
in float32), then its shard all-reduced across the 2 hosts. Optionally (``--expert``) also the
expert mesh ``("replica", "data", "expert", "model") = 2 x 2 x 2 x 2``, whose expert params run
in their own bucket chain.

For each strategy it reports XLA's temp bytes, the most buckets in flight per chain, and the
collectives grouped by kind, dtype and devices per group. Run::

    python benchmarks/mesh_memory.py --out benchmarks/results          # mesh_memory.{md,json}
    python benchmarks/mesh_memory.py --layers 2 --d-model 512 --json rows.json
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("JAX_PLATFORMS", "cpu")  # compile-only GPU devices need the CPU platform

from jax_drain import plan  # noqa: E402
from jax_drain.planner.targets import gpu_mesh  # noqa: E402

#: (reduce mode, drained): fp32_accum with and without the drain, and Megatron's bf16 baseline.
STRATEGIES = (("fp32_accum", False), ("fp32_accum", True), ("bf16", True))
MESHES = {
    "hsdp_tp": ((2, 4, 2), ("replica", "data", "model")),
    "hsdp_tp_expert": ((2, 2, 2, 2), ("replica", "data", "expert", "model")),
}
# XLA:GPU keeps one async collective in flight unless allowed more; allow more so that only the
# drain bounds the buckets in flight (otherwise the undrained row would look drained).
OVERLAP = {"xla_gpu_experimental_parallel_collective_overlap_limit": 4}


def collective_groups(report: plan.Plan) -> list[dict[str, Any]]:
    """The sync's collectives grouped by (kind, dtype, devices per group), with count and bytes.

    Example::

        >>> collective_groups(report)[0]  # doctest: +SKIP
        {'kind': 'all-to-all', 'dtype': 'bf16', 'group_size': 4, 'count': 16, 'bytes': 33554432}
    """
    groups: dict[tuple, list[int]] = collections.defaultdict(lambda: [0, 0])
    for c in report.collectives:
        g = groups[c.kind, c.dtype, c.group_size]
        g[0], g[1] = g[0] + 1, g[1] + c.bytes
    return [dict(kind=k, dtype=d, group_size=n, count=cnt, bytes=b)
            for (k, d, n), (cnt, b) in sorted(groups.items(), key=lambda kv: (kv[0][0], str(kv[0][1]), kv[0][2] or 0))]


def run_one(mesh_name: str, reduce: str, drain: bool, layers: int, d_model: int, tokens: int,
            target: str) -> dict[str, Any]:
    """Plans one (mesh, strategy) and returns a JSON-ready row."""
    shape, names = MESHES[mesh_name]
    mesh = gpu_mesh(shape, names, target=target, topology="1x2x8")
    strategy = reduce + ("+drain" if drain else "")
    step, args, sync = plan.build_mesh_step(mesh, layers=layers, d_model=d_model, reduce=reduce, drain=drain,
                                            expert=mesh_name.endswith("expert"), tokens_per_device=tokens)
    report = plan.plan(step, *args, target=target, topology="1x2x8", compiler_options=OVERLAP,
                       strategy=strategy, num_buckets=sync.num_buckets + sync.num_expert_buckets,
                       bucket_size=max(sync.bucket_sizes))
    row = report.to_json()
    row.update(mesh=mesh_name, mesh_shape=dict(zip(names, shape)), layers=layers, d_model=d_model,
               tokens_per_device=tokens, dense_buckets=sync.num_buckets, expert_buckets=sync.num_expert_buckets,
               collective_groups=collective_groups(report))
    return row


def _groups_cell(row: dict[str, Any]) -> str:
    return "; ".join(f"{g['count']}x {g['kind']} {g['dtype']} /{g['group_size']} ({g['bytes'] / 2**20:,.1f} MiB)"
                     for g in row["collective_groups"])


def table(rows: list[dict[str, Any]]) -> str:
    """A plain-text table, one row per (mesh, strategy)."""
    head = ("mesh", "strategy", "buckets", "temp MiB", "in flight", "per chain", "collectives (count kind dtype /group)")
    lines = [head]
    for r in rows:
        chains = ", ".join(f"{k} {v}" for k, v in r["chains_in_flight"].items())
        buckets = f"{r['dense_buckets']}" + (f"+{r['expert_buckets']}" if r["expert_buckets"] else "")
        lines.append((r["mesh"], r["strategy"], buckets, f"{r['temp_bytes'] / 2**20:,.1f}",
                      str(r["buckets_in_flight"]), chains, _groups_cell(r)))
    widths = [max(len(line[i]) for line in lines) for i in range(len(head))]
    return "\n".join("  ".join(v.ljust(w) for v, w in zip(line, widths)).rstrip() for line in lines)


def markdown(rows: list[dict[str, Any]], header: str) -> str:
    """The same table as markdown, under ``header``."""
    out = [header, "", "| mesh | strategy | buckets (dense+expert) | temp MiB | buckets in flight | per chain | "
           "collectives: count x kind dtype /devices per group (bytes) |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        chains = ", ".join(f"{k} {v}" for k, v in r["chains_in_flight"].items())
        buckets = f"{r['dense_buckets']}" + (f"+{r['expert_buckets']}" if r["expert_buckets"] else "")
        out.append(f"| {r['mesh']} | {r['strategy']} | {buckets} | {r['temp_bytes'] / 2**20:,.1f} | "
                   f"{r['buckets_in_flight']} | {chains} | {_groups_cell(r)} |")
    return "\n".join(out) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=int, default=8, help="MLP blocks (default 8)")
    p.add_argument("--d-model", type=int, default=2048, help="model width (default 2048)")
    p.add_argument("--tokens", type=int, default=1024, help="tokens per data-parallel device (default 1024)")
    p.add_argument("--target", default="h100", help="GPU target: h100, h200, a100")
    p.add_argument("--no-expert", action="store_true", help="skip the expert mesh")
    p.add_argument("--json", metavar="FILE", help="write the rows as JSON")
    p.add_argument("--out", metavar="DIR", help="write DIR/mesh_memory.md and DIR/mesh_memory.json")
    args = p.parse_args(argv)

    meshes = ["hsdp_tp"] + ([] if args.no_expert else ["hsdp_tp_expert"])
    rows = []
    for mesh_name in meshes:
        for reduce, drain in STRATEGIES:
            start = time.perf_counter()
            rows.append(run_one(mesh_name, reduce, drain, args.layers, args.d_model, args.tokens, args.target))
            print(f"  {mesh_name} {rows[-1]['strategy']}: {time.perf_counter() - start:.1f} s", file=sys.stderr)
    for r in rows:
        del r["collectives"]  # per-collective detail: plan.plan's table has it; keep the rows small
    header = (f"### {args.layers} tensor-parallel MLP blocks, d_model {args.d_model}, {args.tokens} tokens per "
              f"data-parallel device, 16x {args.target} on 2 hosts (topology 1x2x8)\n\n"
              "hsdp_tp: (replica, data, model) = 2x4x2; hsdp_tp_expert: (replica, data, expert, model) = "
              "2x2x2x2 with a stack of experts per block in its own bucket chain. Inner: all-to-all within a "
              "host over the data-parallel GPUs (/4 dense, /2 experts); outer: all-reduce across the 2 hosts "
              "(/2). Compiled with XLA's parallel collective overlap limit at 4, so the drain alone bounds "
              "the buckets in flight.")
    print(table(rows))
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "mesh_memory.md").write_text(markdown(rows, header))
        (out / "mesh_memory.json").write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
