"""A bucket chain's timeline on XLA's GPU compiler: undrained against drained, side by side.

Compiles one gradient step of a GPT preset twice for a virtual 8xH100 host (compile-only
devices, no GPU needed), ``fp32_accum`` undrained and drained, and draws each program's final
schedule: one bar per bucket from its collective's start to its done. Undrained, XLA is free to
start the bucket collectives in any order once their gradients exist, and their scratch piles
up; drained, each bucket starts once its predecessor is done, one after another through
backward, and XLA's temp memory says what that saves.

    python benchmarks/chain_timeline.py --out benchmarks/results            # gpt-blocks, ~12 buckets
    python benchmarks/chain_timeline.py --layers 2 --d-model 512 --out /tmp  # a quick look

Writes ``chain_timeline.png`` and ``chain_timeline.json`` (per strategy: temp bytes, the
schedule's length, and each bucket collective's ``[start, done]`` schedule positions).
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import sys
from typing import Any

os.environ.setdefault("JAX_PLATFORMS", "cpu")  # compile-only GPU devices need the CPU platform

from jax_drain import plan as planner  # noqa: E402  (registers the compile-only CUDA plugin quietly)

STRATEGIES = ("fp32_accum", "fp32_accum+drain")
_MIB = 2**20


def timeline(p: planner.Plan) -> dict[str, Any]:
    """The plan's bucket collectives as ``{"bucket", "kind", "start", "done"}`` positions in the
    step's schedule, with the schedule's length and XLA's temp bytes."""
    if len({c.computation for c in p.collectives}) > 1:
        raise SystemExit("the sync's collectives are in several computations (a scanned stack's loop body): "
                         "use an unrolled preset, whose bucket collectives are all on the step's own schedule")
    spans = []
    for c in p.collectives:
        buckets = p.buckets_of(c)
        spans.append({"bucket": min((bucket for _chain, bucket in buckets), default=None), "kind": c.kind,
                      "start": c.start, "done": c.done})
    return {"strategy": p.strategy, "temp_bytes": p.temp_bytes, "num_buckets": p.num_buckets,
            "schedule_length": len(p.live_bytes), "spans": spans}


def plot(rows: list[dict[str, Any]], path: pathlib.Path, title: str) -> None:
    """One panel per strategy: a bar per bucket from its collective's start to its done."""
    import matplotlib  # noqa: PLC0415  (only when plotting)

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    fig, axes = plt.subplots(len(rows), 1, figsize=(9, 2.4 * len(rows)), sharex=True)
    for ax, row in zip(axes, rows):
        n = max(row["schedule_length"] - 1, 1)
        for k, s in enumerate(row["spans"]):
            y = s["bucket"] if s["bucket"] is not None else k
            ax.plot([s["start"] / n, max(s["done"], s["start"] + 1) / n], [y, y], color="tab:orange", lw=5,
                    solid_capstyle="butt")
        ax.yaxis.get_major_locator().set_params(integer=True)
        ax.set_ylabel("bucket")
        ax.set_xlim(0, 1)
        ax.set_title(f"{row['strategy']}: temp {row['temp_bytes'] / _MIB:,.0f} MiB, {row['num_buckets']} buckets",
                     fontsize="medium")
    axes[-1].set_xlabel("position in the step's final schedule (bars: a bucket's collective in flight)")
    fig.suptitle(title, fontsize="medium")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="gpt-blocks")
    p.add_argument("--layers", type=int, help="override the preset's number of blocks")
    p.add_argument("--d-model", type=int, help="override the preset's width")
    p.add_argument("--num-buckets", type=int, default=12)
    p.add_argument("--out", default="benchmarks/results", help="directory for chain_timeline.png/.json")
    args = p.parse_args(argv)
    config = planner.preset_config(args.preset, layers=args.layers, d_model=args.d_model)
    rows = []
    for strategy in STRATEGIES:
        print(f"compiling {strategy} ...", file=sys.stderr, flush=True)
        rows.append(timeline(planner.plan_preset(config, strategy, num_buckets=args.num_buckets)))
        r = rows[-1]
        print(f"{strategy:>18}: temp {r['temp_bytes'] / _MIB:8,.1f} MiB, {len(r['spans'])} bucket collectives")
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    title = (f"{args.preset} ({config.num_layers} blocks, d_model {config.d_model}) on 8x h100, "
             "compile-only: XLA's schedule")
    plot(rows, out / "chain_timeline.png", title)
    (out / "chain_timeline.json").write_text(json.dumps(
        {"preset": args.preset, "layers": config.num_layers, "d_model": config.d_model,
         "rows": rows}, indent=1))
    print(f"wrote {out / 'chain_timeline.png'} and {out / 'chain_timeline.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
