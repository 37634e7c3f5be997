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

Parameter sharding (ZeRO-3), where the point is argument memory, not temp:

* ``zero3+drain`` / ``zero3+drain2`` / ``zero3+drain+blocks``: :mod:`jax_drain.zero3` (planner strategy ``zero3``):
  each device holds its shard of every parameter bucket, gathered at its first use; gradients
  reduced by the drained ``fp32_accum`` chain, one (two) buckets in flight; on a scanned
  stack each layer gathered and reduced inside the scan body. ``+blocks``: no bucket
  spans two remat blocks (``TrainConfig(bucket_boundaries="remat")``), the bucket size chosen for
  the requested count with the blocks' boundaries counted (``fp32_accum+drain+blocks`` likewise).
* ``fp32_accum_streamed+drain+zero3``: ``zero3+drain`` reducing with the drained
  ``fp32_accum_streamed`` chain: the same wire bytes and float32 sums, a chunk of scratch per
  bucket instead of the all-to-all's whole bucket.
* ``gspmd_fsdp``: params and gradients sharded by annotations, XLA gathers (planner
  ``gspmd_fsdp``), XLA's default flags; ``gspmd_fsdp+best_flags``: the same with the flag set
  that had the lowest temp + arguments in ``benchmarks/fsdp_baseline.py``
  (:data:`BEST_FSDP_FLAGS`). Neither depends on the bucket count: compiled once per preset.

Every row records XLA's temp, argument and output bytes; the parameter-sharding table shows
temp, arguments and temp + arguments.

Run ``python benchmarks/memory.py --out benchmarks/results`` for the full table (markdown,
JSON and a PNG); ``--json FILE`` writes only the rows. It takes a while: each compile is a
few seconds on 2 cores. ``--merge`` compiles only ``--strategies`` and merges their rows into
the previous rows (``<out>/memory.json``; a row of the same preset, strategy and bucket count
is replaced), then renders all of them, e.g.::

    python benchmarks/memory.py --presets gpt-blocks,gpt-tied \\
        --strategies zero3+drain,zero3+drain2,gspmd_fsdp,gspmd_fsdp+best_flags --merge --out benchmarks/results
    python benchmarks/memory.py --presets gpt-blocks-scan --buckets 7,28 \\
        --strategies zero3+drain,zero3+drain2,gspmd_fsdp,gspmd_fsdp+best_flags --merge --out benchmarks/results

``--from-json FILE --out DIR`` re-renders rows without compiling.
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
    "fp32_accum_streamed", "fp32_accum_streamed+drain", "fp32_accum+drain+blocks",
)
DEPTH_STRATEGIES = ("fp32_accum+drain2", "fp32_accum+drain4")
DEPTH_COUNTS = (14, 28)  # bucket counts of DEPTH_STRATEGIES (zero3+drainK runs at every count)
ZERO3_STRATEGIES = ("zero3+drain", "zero3+drain2", "zero3+drain+blocks", "fp32_accum_streamed+drain+zero3")
#: The ZeRO-3 rows compared with XLA's FSDP: the all-to-all chain and the streamed one (the same
#: wire bytes and float32 sums, a chunk of scratch instead of a bucket).
ZERO3_VS_FSDP = ("zero3+drain", "fp32_accum_streamed+drain+zero3")
FSDP_STRATEGIES = ("gspmd_fsdp", "gspmd_fsdp+best_flags")
#: The parameter-sharding table's rows: replicated params (jax_drain's ZeRO-2), ZeRO-3, XLA's FSDP.
SHARDING_STRATEGIES = ("fp32_accum+drain",) + ZERO3_STRATEGIES + FSDP_STRATEGIES
#: Compiled once per preset (XLA decides the collectives; no bucket layout): one row per preset.
ONCE = ("gspmd", "gspmd_fsdp", "gspmd_fsdp+best_flags")

_LHS = "xla_gpu_enable_latency_hiding_scheduler"
_AG, _RS = "xla_gpu_all_gather_combine_threshold_bytes", "xla_gpu_reduce_scatter_combine_threshold_bytes"
#: ``gspmd_fsdp+best_flags``: the flag set of ``benchmarks/fsdp_baseline.py`` (its name there)
#: with the lowest temp + arguments (benchmarks/results/fsdp_baseline.md), by whether the blocks
#: are scanned: searched on gpt-blocks and gpt-blocks-scan; gpt-tied (not searched there) gets
#: gpt-blocks' set.
BEST_FSDP_FLAGS = {
    False: ("lhs+combine_0", {_LHS: True, _AG: 0, _RS: 0}),
    True: ("lhs+combine_128M/64M", {_LHS: True, _AG: 128 * 2**20, _RS: 64 * 2**20}),
}


def _unavailable(row: dict) -> bool:
    return row.get("available") is False


def _key(row: dict) -> tuple:
    """A row's identity for --merge: preset, strategy and (unless compiled once) bucket count."""
    once = row["strategy"] in ONCE
    return row["preset"], row["strategy"], None if once else row["requested_buckets"]


def merge_rows(old: list[dict], new: list[dict]) -> list[dict]:
    """``old`` with each row that ``new`` has again replaced in place, then ``new``'s others."""
    fresh = {_key(r): r for r in new}
    merged = [fresh.pop(_key(r), r) for r in old]
    return merged + [r for r in new if _key(r) in fresh]


def run_one(preset: str, config, strategy: str, buckets: int, target: str, topology: str) -> dict:
    """One compile's row; a strategy the planner refuses (``StrategyUnavailable``) gives a row
    with ``available: False`` and the reason in ``unavailable`` instead of the numbers."""
    options, extra = None, {}
    planned = strategy
    if strategy == "gspmd_fsdp+best_flags":
        planned = "gspmd_fsdp"
        flag_set, options = BEST_FSDP_FLAGS[bool(config.scan_layers)]
        extra = {"flag_set": flag_set, "xla_options": dict(options)}
    depth = plan.Strategy.parse(planned).max_in_flight
    if depth and depth > 1:
        options = {"xla_gpu_experimental_parallel_collective_overlap_limit": depth}
    common = dict(preset=preset, requested_buckets=buckets, max_in_flight=depth,
                  params=config.num_params(), layers=config.num_layers, d_model=config.d_model,
                  seq=config.seq_len, **extra)
    try:
        report = plan.plan_preset(config, planned, target=target, topology=topology,
                                  num_buckets=buckets, compiler_options=options)
    except plan.StrategyUnavailable as e:
        return {"strategy": strategy, "available": False, "unavailable": str(e), "target": target,
                "topology": topology, "num_buckets": None, "temp_bytes": None, "argument_bytes": None,
                "output_bytes": None, **common}
    row = report.to_json()
    del row["collectives"]
    row.update(strategy=strategy, **common)
    return row


def mib(b: int) -> str:
    return f"{b / 2**20:,.0f}"


def markdown(rows: list[dict]) -> str:
    """The temp tables (one per preset; the parameter-sharding strategies have their own)."""
    new = set(ZERO3_STRATEGIES + FSDP_STRATEGIES)
    rows = [r for r in rows if r["strategy"] not in new and not _unavailable(r)]
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


def _cell(r: dict | None, real: bool = True) -> str:
    if r is None:
        return ""
    if _unavailable(r):
        return "unavailable"
    t, a = r["temp_bytes"], r["argument_bytes"]
    buckets = f" ({r['num_buckets'] or '-'})" if real else ""
    return f"{mib(t)} + {mib(a)} = **{mib(t + a)}**{buckets}"


def sharding_markdown(rows: list[dict]) -> str:
    """The parameter-sharding table: ZeRO-3 (jax_drain.zero3) vs XLA's FSDP vs replicated params,
    temp + arguments per preset and bucket count."""
    mine_all = [r for r in rows if r["strategy"] in SHARDING_STRATEGIES]
    if not any(r["strategy"] != "fp32_accum+drain" for r in mine_all):
        return ""
    out = ["## parameter sharding: ZeRO-3 vs XLA FSDP\n",
           "One training step (forward, backward, gradient sync; no optimizer), micro-batch 1, bf16 params, "
           "compile-only 8x H100. Each cell: XLA temp MiB + argument MiB = **temp + arguments** MiB per "
           "device (real buckets in brackets); arguments are what the step holds as inputs (the params, "
           "replicated or sharded, and the batch), so they are where ZeRO-3 saves. Outputs (the gradient "
           "shards) are not counted: float32 shards for fp32_accum+drain and zero3 "
           "(2x the bf16 shards gspmd_fsdp returns).\n",
           "* `fp32_accum+drain`: jax_drain's drained gradient sync with replicated params (ZeRO-2: "
           "every device holds all params), the rows of the table above.",
           "* `zero3+drain` / `zero3+drain2`: `jax_drain.zero3`, params held as bucket shards, each bucket "
           "all-gathered at its first use (inside each remat block: gathered again in the backward), "
           "gradients through the drained fp32_accum chain, one / two buckets in flight (`drain2` compiled "
           "with `xla_gpu_experimental_parallel_collective_overlap_limit=2`).",
           "* `fp32_accum_streamed+drain+zero3`: `zero3+drain` with the gradients through the drained "
           "`fp32_accum_streamed` chain (`TrainConfig(shard_params=True, reduce=\"fp32_accum_streamed\")`): "
           "the same bf16 wire bytes and float32 sums, each bucket reduced in `axis_size - 1` point-to-point "
           "steps with a chunk of scratch instead of the all-to-all's whole bucket.",
           "* `zero3+drain+blocks`: `zero3+drain` with no bucket spanning two remat blocks "
           "(`TrainConfig(bucket_boundaries=\"remat\")`), the bucket size chosen for the requested count with "
           "the blocks' boundaries counted.",
           "* `gspmd_fsdp`: params and gradients sharded by annotations (`fsdp_spec`, `d_model`), XLA "
           "inserts the gathers and reduce-scatters; XLA's default flags.",
           "* `gspmd_fsdp+best_flags`: the same with the flag set of `benchmarks/fsdp_baseline.py` with the "
           "lowest temp + arguments (benchmarks/results/fsdp_baseline.md): "
           + "; ".join(f"{'scanned' if scanned else 'unrolled'} presets `{name}` = `{json.dumps(opts)}`"
                       for scanned, (name, opts) in BEST_FSDP_FLAGS.items())
           + " (found on gpt-blocks and gpt-blocks-scan; gpt-tied was not searched there and gets gpt-blocks' set).",
           "* `gspmd_fsdp` rows do not depend on the bucket count: each is compiled once per preset and its "
           "value repeated in every column (marked *).",
           "* columns: requested bucket counts; overlap: async collective pairs with compute between start and "
           "done / pairs, at the largest bucket count (zero3: its parameter all-gathers and gradient "
           "reduce-scatters; gspmd_fsdp: every collective of the program).\n"]
    for preset in dict.fromkeys(r["preset"] for r in mine_all):
        mine = [r for r in mine_all if r["preset"] == preset]
        if all(r["strategy"] == "fp32_accum+drain" for r in mine):
            continue
        counts = sorted({r["requested_buckets"] for r in mine if r["strategy"] not in ONCE})
        first = next(r for r in rows if r["preset"] == preset and not _unavailable(r))
        out.append(f"### {preset}: {first['params'] / 1e6:.0f}M params, {first['layers']} blocks"
                   f"{' scanned' if preset.endswith('-scan') else ''}, d_model {first['d_model']}, "
                   f"seq {first['seq']}\n")
        out.append("| strategy | " + " | ".join(str(c) for c in counts) + " | overlap |")
        out.append("|---" + "|---:" * len(counts) + "|---|")
        reasons = {}
        for s in SHARDING_STRATEGIES:
            by_count = {r["requested_buckets"]: r for r in mine if r["strategy"] == s}
            if not by_count:
                continue
            if s in ONCE:
                r = next(iter(by_count.values()))
                cells = [_cell(r, real=False) + (" *" if not _unavailable(r) else "") for _ in counts]
            else:
                cells = [_cell(by_count.get(c)) for c in counts]
            last = by_count[max(by_count)]
            if _unavailable(last):
                reasons[s] = last["unavailable"]
                overlap = "-"
            else:
                overlap = f"{last['overlapped']}/{last['pairs']}" if last["pairs"] else "-"
            out.append(f"| {s} | " + " | ".join(cells) + f" | {overlap} |")
        out.append("")
        out.extend(f"{s} unavailable: {why}" for s, why in reasons.items())
        if reasons:
            out.append("")
    return "\n".join(out)


def _time_cell(r: dict | None, once: bool) -> str:
    """``step (exposed)`` in ms; ``*`` marks a row compiled once and repeated."""
    if r is None:
        return ""
    exposed = r.get("exposed_comm_s")
    return (f"{r['predicted_step_s'] * 1e3:.1f}" + ("" if exposed is None else f" ({exposed * 1e3:.1f})")
            + (" *" if once else ""))


def time_markdown(rows: list[dict]) -> str:
    """XLA's predicted step and exposed communication, per preset, strategy and bucket count:
    the rows' ``predicted_step_s`` and ``exposed_comm_s`` (empty where a row has none)."""
    timed = [r for r in rows if not _unavailable(r) and r.get("predicted_step_s") is not None]
    if not timed:
        return ""
    out = ["## predicted time: XLA's estimates, not yet checked against a GPU\n",
           "Each cell: XLA's predicted step ms (communication it leaves exposed, ms) for the step compiled in "
           "the tables above, as its latency-hiding scheduler prices it on the compile-only target "
           "(`jax_drain.planner.timing`). Columns: requested bucket counts; rows compiled once (`gspmd`, "
           "`gspmd_fsdp`) are marked * and repeated.\n"]
    for preset in dict.fromkeys(r["preset"] for r in timed):
        mine = [r for r in timed if r["preset"] == preset]
        counts = sorted({r["requested_buckets"] for r in mine if r["strategy"] not in ONCE})
        out.append(f"### {preset}\n")
        out.append("| strategy | " + " | ".join(str(c) for c in counts) + " |")
        out.append("|---" + "|---:" * len(counts) + "|")
        for s in dict.fromkeys(r["strategy"] for r in mine):
            by_count = {r["requested_buckets"]: r for r in mine if r["strategy"] == s}
            once = s in ONCE
            cells = [_time_cell(next(iter(by_count.values())), True) for _ in counts] if once else [
                _time_cell(by_count.get(c), False) for c in counts]
            out.append(f"| {s} | " + " | ".join(cells) + " |")
        out.append("")
    return "\n".join(out)


def sharding_targets(rows: list[dict]) -> list[str]:
    """ZeRO-3's targets at 24+ requested buckets, per preset: its argument bytes <= 0.2 x the
    replicated (fp32_accum+drain) ones, and its temp + arguments <= XLA FSDP's."""
    lines = ["parameter sharding targets (at 24+ requested buckets):"]
    ta = lambda r: r["temp_bytes"] + r["argument_bytes"]
    for preset in dict.fromkeys(r["preset"] for r in rows):
        def pick(s, c=None):
            return next((r for r in rows if r["preset"] == preset and r["strategy"] == s
                         and (c is None or r["requested_buckets"] == c)), None)
        z3 = [r for r in rows if r["preset"] == preset and r["strategy"] == "zero3+drain"]
        if not z3:
            continue
        fsdp = {s: pick(s) for s in FSDP_STRATEGIES}
        for r in sorted(z3, key=lambda r: r["requested_buckets"]):
            c = r["requested_buckets"]
            if c < 24:
                continue
            if _unavailable(r):
                lines.append(f"  {preset} at {c} requested buckets: zero3+drain unavailable ({r['unavailable']}): "
                             "no target can be checked")
                continue
            lines.append(f"  {preset} at {c} requested ({r['num_buckets']} real) buckets:")
            rep = pick("fp32_accum+drain", c)
            if rep and not _unavailable(rep):
                ratio = r["argument_bytes"] / rep["argument_bytes"]
                verdict = (f"met ({0.2 - ratio:.3f} under)" if ratio <= 0.2 else f"MISSED by {ratio - 0.2:.3f}")
                lines.append(f"    args zero3+drain / fp32_accum+drain = {mib(r['argument_bytes'])} / "
                             f"{mib(rep['argument_bytes'])} MiB = {ratio:.3f} (target <= 0.2): {verdict}")
            else:
                lines.append(f"    args ratio: no fp32_accum+drain row at {c} buckets")
            for name in ZERO3_VS_FSDP:
                z = pick(name, c)
                if z is None or _unavailable(z):
                    lines.append(f"    temp+args {name}: no row at {c} buckets")
                    continue
                for s, f in fsdp.items():
                    if f is None or _unavailable(f):
                        lines.append(f"    temp+args vs {s}: no {s} row")
                        continue
                    mine, theirs = ta(z), ta(f)
                    verdict = (f"met ({mib(theirs - mine)} MiB under)" if mine <= theirs
                               else f"MISSED by {mib(mine - theirs)} MiB (+{(mine / theirs - 1) * 100:.0f}%)")
                    lines.append(f"    temp+args {name} {mib(mine)} MiB ({z['num_buckets']} buckets) vs {s} "
                                 f"{mib(theirs)} MiB = {mine / theirs:.2f} (target <= 1): {verdict}")
            for other in ("zero3+drain2", "zero3+drain+blocks"):
                z = pick(other, c)
                if z and not _unavailable(z):
                    lines.append(f"    ({other}: temp+args {mib(ta(z))} MiB, {z['num_buckets']} buckets)")
    return lines if len(lines) > 1 else []


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
    sharding = [r for r in rows if r["strategy"] in SHARDING_STRATEGIES]
    new = set(ZERO3_STRATEGIES + FSDP_STRATEGIES)
    has_sharding = any(r["strategy"] in new for r in sharding)
    rows = [r for r in rows if r["strategy"] not in new and not _unavailable(r)]
    strategies = list(dict.fromkeys(r["strategy"] for r in rows))
    cmap = plt.get_cmap("tab20")
    color = {s: cmap(i % 20) for i, s in enumerate(strategies)}  # one colour per strategy, all panels
    fig, axes = plt.subplots(1 + has_sharding, len(presets), figsize=(6 * len(presets) + 2, 4.5 * (1 + has_sharding)),
                             squeeze=False)
    handles = {}
    if has_sharding:
        plot_sharding(sharding, presets, axes[1])
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
               fontsize=7, loc="upper right", bbox_to_anchor=(1.0, 0.95 if has_sharding else 0.7))
    fig.subplots_adjust(right=0.85, hspace=0.35)
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)


def plot_sharding(rows: list[dict], presets: list[str], axes) -> None:
    """The parameter-sharding panels: temp + arguments by bucket count; gspmd_fsdp (compiled
    once) as horizontal lines; an unavailable strategy named in the panel."""
    styles = {"fp32_accum+drain": dict(color="tab:blue", ls="-", marker="o"),
              "zero3+drain": dict(color="tab:red", ls="-", marker="s"),
              "zero3+drain2": dict(color="tab:orange", ls="-", marker="^"),
              "zero3+drain+blocks": dict(color="tab:purple", ls="--", marker="s"),
              "fp32_accum_streamed+drain+zero3": dict(color="tab:brown", ls="-", marker="D"),
              "gspmd_fsdp": dict(color="black", ls=":"),
              "gspmd_fsdp+best_flags": dict(color="tab:green", ls="-.")}
    for ax, preset in zip(axes, presets):
        mine = [r for r in rows if r["preset"] == preset]
        gone = []
        for s in SHARDING_STRATEGIES:
            these = [r for r in mine if r["strategy"] == s]
            ok = [r for r in these if not _unavailable(r)]
            if these and not ok:
                gone.append(s)
            if not ok:
                continue
            total = lambda r: (r["temp_bytes"] + r["argument_bytes"]) / 2**20
            if s in ONCE:
                ax.axhline(total(ok[0]), lw=1.2, label=f"{s} (any bucket count)", **styles[s])
                continue
            pts = sorted((r["num_buckets"] or r["requested_buckets"], total(r)) for r in ok)
            ax.plot([p[0] for p in pts], [p[1] for p in pts], ms=3, lw=1.2, label=s, **styles[s])
        if gone:
            ax.text(0.02, 0.03, "unavailable here: " + ", ".join(gone), transform=ax.transAxes, fontsize=7)
        ax.set_xscale("log")
        ax.set_xlabel("real buckets")
        ax.set_ylabel("XLA temp + argument MiB per device")
        ax.set_title(f"{preset}: parameter sharding, temp + arguments", fontsize=10)
        ax.grid(alpha=0.3)
        ax.set_ylim(bottom=0)
        ax.legend(fontsize=7, loc="best")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--presets", default="gpt-blocks,gpt-tied", help="comma-separated model presets")
    p.add_argument("--buckets", default=",".join(map(str, BUCKET_COUNTS)), help="requested bucket counts")
    p.add_argument("--strategies", default=",".join(STRATEGIES + DEPTH_STRATEGIES + ZERO3_STRATEGIES + FSDP_STRATEGIES))
    p.add_argument("--depth-buckets", default=",".join(map(str, DEPTH_COUNTS)),
                   help="bucket counts for the +drainK (K > 1) strategies")
    p.add_argument("--layers", type=int), p.add_argument("--d-model", type=int)
    p.add_argument("--heads", type=int), p.add_argument("--seq", type=int)
    p.add_argument("--target", default="h100"), p.add_argument("--topology", default="1x1x8")
    p.add_argument("--json", metavar="FILE", help="write the rows as JSON")
    p.add_argument("--out", metavar="DIR", help="write memory.md, memory.json and memory.png here")
    p.add_argument("--from-json", metavar="FILE", help="re-render a previous run's rows; compile nothing")
    p.add_argument("--merge", metavar="FILE", nargs="?", const="",
                   help="merge this run's rows into a previous run's (FILE, default <out>/memory.json): "
                        "rows of the same preset, strategy and bucket count are replaced, the rest kept")
    args = p.parse_args(argv)
    if args.from_json:
        rows = json.loads(Path(args.from_json).read_text())
        report(rows, args.out, args.json)
        return 0
    previous: list[dict] = []
    if args.merge is not None:
        source = args.merge or (str(Path(args.out) / "memory.json") if args.out else args.json)
        if not source or not Path(source).exists():
            p.error(f"--merge: no previous rows to merge into ({source or 'give FILE or --out'})")
        previous = json.loads(Path(source).read_text())

    counts = [int(c) for c in args.buckets.split(",")]
    depth_counts = [int(c) for c in args.depth_buckets.split(",")]
    rows: list[dict] = []
    start = time.perf_counter()
    for preset in args.presets.split(","):
        config = plan.preset_config(preset, args.layers, args.d_model, args.heads, args.seq)
        for strategy in args.strategies.split(","):
            parsed = plan.Strategy.parse(strategy.removesuffix("+best_flags"))
            depth = parsed.max_in_flight
            # XLA decides gspmd's (and gspmd_fsdp's) collectives: one compile stands for every bucket count.
            these = counts[:1] if strategy in ONCE else (
                [c for c in counts if c in depth_counts] if depth and depth > 1 and not parsed.zero3 else counts)
            for c in these:
                row = run_one(preset, config, strategy, c, args.target, args.topology)
                rows.append(row)
                if _unavailable(row):
                    print(f"{preset:10s} {strategy:28s} buckets {c:3d} unavailable: {row['unavailable']}", flush=True)
                    continue
                print(f"{preset:10s} {strategy:28s} buckets {c:3d} ({row['num_buckets'] or '-':>3}) "
                      f"temp {mib(row['temp_bytes']):>6} MiB  args {mib(row['argument_bytes']):>6} MiB  "
                      f"out {mib(row['output_bytes']):>5} MiB  pairs {row['pairs']:4d} "
                      f"overlapped {row['overlapped']:4d}  in flight {row['buckets_in_flight']}  "
                      f"compile {row['compile_s']:.1f} s", flush=True)
    print(f"{len(rows)} compiles in {time.perf_counter() - start:.0f} s")
    if args.merge is not None:
        rows = merge_rows(previous, rows)
        print(f"merged: {len(rows)} rows")
    report(rows, args.out, args.json)
    return 0


def report(rows: list[dict], out_dir: str | None, json_path: str | None) -> None:
    """Prints the table and the targets; writes JSON, markdown and the plot where asked."""
    table = markdown(rows)
    summary = targets(rows)
    sharding, sharding_summary = sharding_markdown(rows), sharding_targets(rows)
    times = time_markdown(rows)
    print("\n" + table + "\n" + "\n".join(summary))
    if sharding:
        print("\n" + sharding + "\n" + "\n".join(sharding_summary))
    if times:
        print("\n" + times)
    if json_path:
        Path(json_path).write_text(json.dumps(rows, indent=1))
    if out_dir:
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        (out / "memory.json").write_text(json.dumps(rows, indent=1))
        text = table + "\n```\n" + "\n".join(summary) + "\n```\n"
        if sharding:
            text += "\n" + sharding + "\n```\n" + "\n".join(sharding_summary) + "\n```\n"
        if times:
            text += "\n" + times
        (out / "memory.md").write_text(text)
        plot(rows, out / "memory.png")


if __name__ == "__main__":
    sys.exit(main())
