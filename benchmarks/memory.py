"""Gradient-sync memory and schedule on XLA's GPU compiler: jax_drain against its peers.

Compiles one training step (forward + backward + gradient sync) of a Flax GPT block stack for
a virtual 8xH100 host (compile-only devices; no GPU needed) with each strategy and bucket
count, and reads XLA's buffer assignment (temp bytes) and schedule (collective pairs and
whether they overlap compute). Strategies:

* ``gspmd``: plain ``jax.jit`` of ``jax.grad`` with replicated params, data-sharded batch and
  data-sharded gradients out; XLA decides everything.
* ``gspmd+flags``: the same with the knobs a user would try instead of jax_drain: the
  reduce-scatter combine threshold at the bucket's bytes, latency-hiding scheduler on.
* ``no_comm``: jax_drain's step with each bucket reduced over its own chunks locally (the same
  drain chain, no wire): the floor the collectives cannot go below.
* ``MODE`` / ``MODE+drain`` / ``MODE+drainK``: jax_drain with reduce mode MODE, undrained,
  drained (one bucket in flight) or K buckets in flight (compiled with XLA's parallel
  collective overlap limit raised to K, without which XLA keeps one in flight).

Run ``python benchmarks/memory.py --out benchmarks/results`` for the full table (markdown,
JSON and a PNG); ``--json FILE`` writes only the rows. It takes a while: each compile is a
few seconds on 2 cores.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")  # compile-only GPU devices need the CPU platform

from jax_drain import models, plan  # noqa: E402
from jax_drain.layout import BucketLayout  # noqa: E402
from jax_drain.order import grad_ready_order  # noqa: E402

BUCKET_COUNTS = (1, 2, 7, 14, 28, 56)
STRATEGIES = (
    "gspmd", "gspmd+flags", "no_comm",
    "bf16", "bf16+drain", "fp32", "fp32+drain", "fp32_accum", "fp32_accum+drain",
    "fp32_accum_streamed", "fp32_accum_streamed+drain",
)
DEPTH_STRATEGIES = ("fp32_accum+drain2", "fp32_accum+drain4")
DEPTH_COUNTS = (14, 28)


def run_one(preset: str, config, strategy: str, buckets: int, target: str, topology: str) -> dict:
    options = None
    depth = plan.Strategy.parse(strategy).max_in_flight
    if depth and depth > 1:
        options = {"xla_gpu_experimental_parallel_collective_overlap_limit": depth}
    report = plan.plan_preset(config, strategy, target=target, topology=topology,
                              num_buckets=buckets, compiler_options=options)
    row = report.to_json()
    del row["collectives"]
    row.update(preset=preset, requested_buckets=buckets, max_in_flight=depth,
               params=config.num_params(), layers=config.num_layers, d_model=config.d_model,
               seq=config.seq_len)
    return row


def mib(b: int) -> str:
    return f"{b / 2**20:,.0f}"


def markdown(rows: list[dict]) -> str:
    out = []
    for preset in dict.fromkeys(r["preset"] for r in rows):
        mine = [r for r in rows if r["preset"] == preset]
        counts = sorted({r["requested_buckets"] for r in mine})
        strategies = list(dict.fromkeys(r["strategy"] for r in mine))
        first = mine[0]
        out.append(f"### {preset}: {first['params'] / 1e6:.0f}M params, {first['layers']} blocks, "
                   f"d_model {first['d_model']}, seq {first['seq']}, micro-batch 1, "
                   f"{first['num_devices']}x {first['target']}\n")
        out.append("temp MiB per device (real buckets in brackets); last column: overlapped/pairs "
                   f"at {counts[-1]} requested buckets\n")
        out.append("| strategy | " + " | ".join(str(c) for c in counts) + " | overlap |")
        out.append("|---" * (len(counts) + 2) + "|")
        for s in strategies:
            by_count = {r["requested_buckets"]: r for r in mine if r["strategy"] == s}
            cells = []
            for c in counts:
                r = by_count.get(c)
                cells.append("" if r is None else f"{mib(r['temp_bytes'])} ({r['num_buckets'] or '-'})")
            last = by_count.get(max(by_count))
            overlap = f"{last['overlapped']}/{last['pairs']}" if last["pairs"] else "-"
            out.append(f"| {s} | " + " | ".join(cells) + f" | {overlap} |")
        out.append("")
    return "\n".join(out)


def largest_bucket(row: dict) -> int:
    """Elements in the largest real bucket of a row's layout (rebuilt: cheap, nothing compiled)."""
    config = plan.preset_config(row["preset"], row["layers"], row["d_model"], None, row["seq"])
    params = models.abstract_params(config)
    order = grad_ready_order(models.make_loss(config), params, models.example_batch(config, row["num_devices"]))
    layout = BucketLayout.build(params, row["bucket_size"], math.lcm(row["num_devices"], 128), order)
    return max(layout.bucket_sizes)


def targets(rows: list[dict]) -> list[str]:
    """The issue's targets, evaluated on this run (default preset)."""
    lines = []
    pick = lambda s, c: next((r for r in rows if r["preset"] == "gpt-blocks" and r["strategy"] == s
                              and r["requested_buckets"] == c), None)
    gspmd = pick("gspmd", BUCKET_COUNTS[0]) or next((r for r in rows if r["strategy"] == "gspmd"), None)
    for c in [c for c in BUCKET_COUNTS if c >= 24]:
        drained, undrained, floor = pick("fp32_accum+drain", c), pick("fp32_accum", c), pick("no_comm", c)
        if not (drained and undrained and floor and gspmd):
            continue
        bucket = largest_bucket(drained)
        bucket_bf16 = 2 * bucket
        lines += [
            f"at {c} requested ({drained['num_buckets']} real) buckets:",
            f"  drained/undrained fp32_accum temp = {drained['temp_bytes'] / undrained['temp_bytes']:.2f} (target <= 0.25)",
            f"  drained fp32_accum / gspmd temp = {drained['temp_bytes'] / gspmd['temp_bytes']:.2f} (target <= 0.3)",
            f"  sync's own cost temp(drained) - temp(no_comm) = {mib(drained['temp_bytes'] - floor['temp_bytes'])} MiB"
            f" = {(drained['temp_bytes'] - floor['temp_bytes']) / bucket_bf16:.2f} x the largest bucket's bf16 bytes"
            f" ({mib(bucket_bf16)} MiB) (target <= 3)",
            f"  overlapped pairs: {drained['overlapped']}/{drained['pairs']} (target >= 90%)",
        ]
        streamed = pick("fp32_accum_streamed+drain", c)
        if streamed:
            own = streamed["temp_bytes"] - floor["temp_bytes"]
            shard_f32 = 4 * bucket // drained["num_devices"]
            lines.append(f"  streamed drained temp = {mib(streamed['temp_bytes'])} MiB vs fp32_accum drained "
                         f"{mib(drained['temp_bytes'])} MiB; own cost {mib(own)} MiB = "
                         f"{own / (1.5 * shard_f32 + bucket_bf16):.2f} x (1.5 fp32 shard + 1 bf16 bucket) (target <= 1)")
    drained = [r for r in rows if r["preset"] == "gpt-blocks" and r["strategy"] == "fp32_accum+drain"]
    if len(drained) > 1:
        temps = [r["temp_bytes"] for r in sorted(drained, key=lambda r: r["requested_buckets"])]
        falls = all(b <= a for a, b in zip(temps[1:], temps[2:]))
        lines.append(f"drained temp by bucket count: {', '.join(mib(t) for t in temps)} MiB "
                     f"({'falls' if falls else 'does not fall monotonically'} from 2 buckets on)")
    big = max(BUCKET_COUNTS)
    d, u = pick("fp32_accum+drain", big), pick("fp32_accum", big)
    if d and u:
        lines.append(f"compile time at {big} buckets: drained {d['compile_s']:.1f} s / undrained "
                     f"{u['compile_s']:.1f} s = {d['compile_s'] / u['compile_s']:.2f} (target <= 1.5)")
    return lines


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    presets = list(dict.fromkeys(r["preset"] for r in rows))
    strategies = list(dict.fromkeys(r["strategy"] for r in rows))
    cmap = plt.get_cmap("tab20")
    color = {s: cmap(i % 20) for i, s in enumerate(strategies)}  # one colour per strategy, all panels
    fig, axes = plt.subplots(1, len(presets), figsize=(6 * len(presets) + 2, 4.5), squeeze=False)
    handles = {}
    for ax, preset in zip(axes[0], presets):
        mine = [r for r in rows if r["preset"] == preset]
        for s in dict.fromkeys(r["strategy"] for r in mine):
            pts = sorted((r["num_buckets"] or r["requested_buckets"], r["temp_bytes"] / 2**20)
                         for r in mine if r["strategy"] == s)
            if s == "gspmd":
                handles[s] = ax.axhline(pts[0][1], color="black", ls=":", lw=1.2, label=s)
                continue
            style = "-" if "drain" in s else "--"
            (handles[s],) = ax.plot([p[0] for p in pts], [p[1] for p in pts], style, marker="o", ms=3,
                                    lw=1.2, color=color[s], label=s)
        ax.set_xscale("log")
        ax.set_xlabel("real buckets")
        ax.set_ylabel("XLA temp MiB per device")
        ax.set_title(f"{preset}: one step on 8x H100 (compile-only)", fontsize=10)
        ax.grid(alpha=0.3)
    fig.legend([handles[s] for s in strategies if s in handles], [s for s in strategies if s in handles],
               fontsize=7, loc="center right")
    fig.subplots_adjust(right=0.85)
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--presets", default="gpt-blocks,gpt-tied", help="comma-separated model presets")
    p.add_argument("--buckets", default=",".join(map(str, BUCKET_COUNTS)), help="requested bucket counts")
    p.add_argument("--strategies", default=",".join(STRATEGIES + DEPTH_STRATEGIES))
    p.add_argument("--depth-buckets", default=",".join(map(str, DEPTH_COUNTS)),
                   help="bucket counts for the +drainK (K > 1) strategies")
    p.add_argument("--layers", type=int), p.add_argument("--d-model", type=int)
    p.add_argument("--heads", type=int), p.add_argument("--seq", type=int)
    p.add_argument("--target", default="h100"), p.add_argument("--topology", default="1x1x8")
    p.add_argument("--json", metavar="FILE", help="write the rows as JSON")
    p.add_argument("--out", metavar="DIR", help="write memory.md, memory.json and memory.png here")
    p.add_argument("--from-json", metavar="FILE", help="re-render a previous run's rows; compile nothing")
    args = p.parse_args(argv)
    if args.from_json:
        rows = json.loads(Path(args.from_json).read_text())
        report(rows, args.out, args.json)
        return 0

    counts = [int(c) for c in args.buckets.split(",")]
    depth_counts = [int(c) for c in args.depth_buckets.split(",")]
    rows: list[dict] = []
    start = time.perf_counter()
    for preset in args.presets.split(","):
        config = plan.preset_config(preset, args.layers, args.d_model, args.heads, args.seq)
        for strategy in args.strategies.split(","):
            depth = plan.Strategy.parse(strategy).max_in_flight
            # XLA decides gspmd's collectives: one compile stands for every bucket count.
            these = counts[:1] if strategy == "gspmd" else (
                [c for c in counts if c in depth_counts] if depth and depth > 1 else counts)
            for c in these:
                row = run_one(preset, config, strategy, c, args.target, args.topology)
                rows.append(row)
                print(f"{preset:10s} {strategy:28s} buckets {c:3d} ({row['num_buckets'] or '-':>3}) "
                      f"temp {mib(row['temp_bytes']):>6} MiB  pairs {row['pairs']:4d} "
                      f"overlapped {row['overlapped']:4d}  in flight {row['buckets_in_flight']}  "
                      f"compile {row['compile_s']:.1f} s", flush=True)
    print(f"{len(rows)} compiles in {time.perf_counter() - start:.0f} s")
    report(rows, args.out, args.json)
    return 0


def report(rows: list[dict], out_dir: str | None, json_path: str | None) -> None:
    """Prints the table and the targets; writes JSON, markdown and the plot where asked."""
    table = markdown(rows)
    summary = targets(rows)
    print("\n" + table + "\n" + "\n".join(summary))
    if json_path:
        Path(json_path).write_text(json.dumps(rows, indent=1))
    if out_dir:
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        (out / "memory.json").write_text(json.dumps(rows, indent=1))
        (out / "memory.md").write_text(table + "\n```\n" + "\n".join(summary) + "\n```\n")
        plot(rows, out / "memory.png")


if __name__ == "__main__":
    sys.exit(main())
