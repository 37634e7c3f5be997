"""The ``gspmd_fsdp`` baseline on XLA's GPU compiler: ZeRO-3 by sharding annotations, per XLA flag set.

Compiles one gradient step (forward, backward, gradient sync; no optimizer) of the GPT presets
for a virtual 8xH100 host (compile-only devices; no GPU needed) with the planner's
``gspmd_fsdp`` strategy (:func:`jax_drain.planner.plan.build_user_step`): params in and
gradients out sharded over ``data`` along each leaf's dimension from
:func:`jax_drain.planner.plan.fsdp_spec` (the smallest divisible one: ``d_model``, MaxText's
``embed``), the batch split over ``data``; XLA inserts the all-gathers and reduce-scatters. Each
preset is compiled once per XLA flag set a MaxText user would try (:data:`FLAG_SETS`), and, for
comparison, with the replicated ``gspmd`` baseline and jax_drain's ``fp32_accum+drain`` at 24
buckets (both hold every param on every device: their argument bytes are the whole model).

Per row: XLA's temp, argument and output bytes (``memory_analysis()``), temp + argument (what
the step needs besides its outputs), compile seconds, and from the schedule how XLA placed the
FSDP gathers: the most gathered-param bytes alive at once (a liveness walk over each
computation's schedule, :func:`gathered_liveness`; approximate like
:meth:`jax_drain.planner.schedule.Schedule.live_bytes`), in layers' worth of weights, and for a
scanned preset what each while body gathers and carries into its next iteration.

A last section compiles the ``largest``-dimension rule (``fsdp_spec(rule="largest")``) and the
tied preset, with XLA's default flags, to show how much the choice of sharded dimension matters
without activation sharding constraints.

    python benchmarks/fsdp_baseline.py --out benchmarks/results     # fsdp_baseline.{json,md}
    python benchmarks/fsdp_baseline.py --presets tiny --no-rules    # a quick look

35 compiles, about 5 minutes on 2 cores.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("JAX_PLATFORMS", "cpu")  # compile-only GPU devices need the CPU platform

import jax  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: E402

from jax_drain import models  # noqa: E402
from jax_drain.planner import plan as planner  # noqa: E402
from jax_drain.planner.schedule import Schedule, parse_schedule, shape_bytes  # noqa: E402
from jax_drain.planner.schedule import _tuple_elements  # noqa: E402  (tuple shapes, element by element)
from jax_drain.planner.targets import gpu_mesh  # noqa: E402
from jax_drain.scan import stacked_leaves  # noqa: E402

MiB = 2**20
LHS = "xla_gpu_enable_latency_hiding_scheduler"
AG, RS, AR = ("xla_gpu_all_gather_combine_threshold_bytes", "xla_gpu_reduce_scatter_combine_threshold_bytes",
              "xla_gpu_all_reduce_combine_threshold_bytes")

#: The knobs a MaxText user tries on GPU, as compiler options: name -> (options, scanned only).
#: ``maxtext`` is the memory-relevant part of the flag list MaxText's GPU scripts and NVIDIA's
#: JAX-Toolbox recipes pass (combine thresholds 128/64/128 MiB, everything pipelined, loop
#: double-buffering, no combining by dimension, XLA's rematerialization pass off); the
#: loop-only flags are tried alone on scanned presets, where they have a loop to act on.
FLAG_SETS: dict[str, tuple[dict[str, Any], bool]] = {
    "default": ({}, False),
    "lhs_off": ({LHS: False}, False),
    "lhs": ({LHS: True}, False),
    "lhs+combine_0": ({LHS: True, AG: 0, RS: 0}, False),
    "lhs+ag_combine_0": ({LHS: True, AG: 0}, False),
    "lhs+rs_combine_0": ({LHS: True, RS: 0}, False),
    "lhs+combine_32M": ({LHS: True, AG: 32 * MiB, RS: 32 * MiB}, False),
    "lhs+combine_128M/64M": ({LHS: True, AG: 128 * MiB, RS: 64 * MiB}, False),
    "lhs+combine_1G": ({LHS: True, AG: 1024 * MiB, RS: 1024 * MiB}, False),
    "lhs+combine_128M/64M+overlap2": (
        {LHS: True, AG: 128 * MiB, RS: 64 * MiB, "xla_gpu_experimental_parallel_collective_overlap_limit": 2},
        False),
    "lhs+pipelined_ag": ({LHS: True, "xla_gpu_enable_pipelined_all_gather": True}, True),
    "lhs+double_buffer": ({LHS: True, "xla_gpu_enable_while_loop_double_buffering": True}, True),
    "lhs+pipelined_ag_rs+double_buffer": (
        {LHS: True, "xla_gpu_enable_pipelined_all_gather": True, "xla_gpu_enable_pipelined_reduce_scatter": True,
         "xla_gpu_enable_while_loop_double_buffering": True}, True),
    "maxtext": ({
        LHS: True, AG: 128 * MiB, RS: 64 * MiB, AR: 128 * MiB,
        "xla_gpu_enable_pipelined_all_gather": True, "xla_gpu_enable_pipelined_reduce_scatter": True,
        "xla_gpu_enable_pipelined_all_reduce": True, "xla_gpu_enable_while_loop_double_buffering": True,
        "xla_gpu_enable_all_gather_combine_by_dim": False, "xla_gpu_enable_reduce_scatter_combine_by_dim": False,
        "xla_gpu_enable_highest_priority_async_stream": True,
        "xla_disable_hlo_passes": "rematerialization",
    }, False),
    "maxtext+remat_pass": ({
        LHS: True, AG: 128 * MiB, RS: 64 * MiB, AR: 128 * MiB,
        "xla_gpu_enable_pipelined_all_gather": True, "xla_gpu_enable_pipelined_reduce_scatter": True,
        "xla_gpu_enable_pipelined_all_reduce": True, "xla_gpu_enable_while_loop_double_buffering": True,
        "xla_gpu_enable_all_gather_combine_by_dim": False, "xla_gpu_enable_reduce_scatter_combine_by_dim": False,
        "xla_gpu_enable_highest_priority_async_stream": True,
    }, False),
}
PRESETS = ("gpt-blocks", "gpt-blocks-scan")
COMPARE = (("gspmd", None), ("fp32_accum+drain", 24))  # (strategy, requested buckets)
RULE_PRESETS = ("gpt-blocks", "gpt-blocks-scan", "gpt-tied")

# Ops that pass a buffer on without using it: its owners flow through them.
_VIEWS = frozenset({"bitcast", "get-tuple-element", "tuple", "opt-barrier", "while"})


def _flat(owner: Any) -> frozenset:
    return frozenset().union(*owner) if isinstance(owner, tuple) else owner


def gathered_liveness(sched: Schedule, computation: str) -> dict[str, Any]:
    """How the all-gathers of one computation live, walking its schedule.

    Each gathered buffer (each element of a combined all-gather) is live from its start to its
    last real use (views, tuples, ``get-tuple-element`` and ``while`` pass it on; a ``while``
    uses it throughout); one that reaches ROOT (an output, or a loop's next iteration) is live
    to the end. Returns the most gathered bytes alive at once and how many gathered buffers
    that is, the gathered bytes alive at each schedule index (``curve``) and what reaches ROOT.
    """
    instrs = list(sched.computations[computation])
    by_output: dict[int, Any] = {}
    for c in sched.collectives:
        if c.computation == computation and c.kind == "all-gather":
            by_output[c.done] = c
    owners: dict[str, Any] = {}
    size: dict[tuple[str, int], int] = {}
    born: dict[tuple[str, int], int] = {}
    last: dict[tuple[str, int], int] = {}
    end = len(instrs) - 1
    for i, ins in enumerate(instrs):
        if ins.opcode not in _VIEWS or ins.opcode == "while":
            for o in ins.operands:
                for key in _flat(owners.get(o, frozenset())):
                    last[key] = i
        if i in by_output:
            c = by_output[i]
            elements = _tuple_elements(ins.shape)
            keys = [(c.name, e) for e in range(len(elements))]
            for key, shape in zip(keys, elements):
                size[key], born[key], last[key] = shape_bytes(shape), c.start, i
            owners[ins.name] = tuple(frozenset({k}) for k in keys) if len(keys) > 1 else frozenset(keys)
        elif ins.opcode == "tuple":
            owners[ins.name] = tuple(_flat(owners.get(o, frozenset())) for o in ins.operands)
        elif ins.opcode == "get-tuple-element":
            src = owners.get(ins.operands[0], frozenset())
            index = int(m.group(1)) if (m := re.search(r"index=(\d+)", ins.attributes)) else -1
            owners[ins.name] = src[index] if isinstance(src, tuple) and 0 <= index < len(src) else _flat(src)
        elif ins.opcode in _VIEWS:
            owners[ins.name] = owners.get(ins.operands[0], frozenset()) if ins.operands else frozenset()
        if ins.is_root:
            for key in _flat(owners.get(ins.name, frozenset())):
                last[key] = end
    curve, count = [0] * (len(instrs) + 1), [0] * (len(instrs) + 1)
    for key, nbytes in size.items():
        curve[born[key]] += nbytes
        curve[last[key] + 1] -= nbytes
        count[born[key]] += 1
        count[last[key] + 1] -= 1
    live, n, out, counts = 0, 0, [], []
    for delta, dn in zip(curve[:-1], count[:-1]):
        live, n = live + delta, n + dn
        out.append(live)
        counts.append(n)
    peak = max(range(len(out)), key=out.__getitem__, default=0)
    root = [k for k in size if last[k] == end]
    return {
        "gathers": len({k[0] for k in size}),
        "gathered_bytes": sum(size.values()),
        "max_live_gathered_bytes": out[peak] if out else 0,
        "max_live_gathered_buffers": counts[peak] if counts else 0,
        "reaching_root_bytes": sum(size[k] for k in root),
        "curve": out,
    }


def pending_reduce_scatter(sched: Schedule, computation: str) -> int:
    """The most gradient bytes alive at once waiting for their reduce-scatter in one
    computation: each reduce-scatter operand (the full-size, unreduced gradient) from the
    instruction that produced it (through bitcasts and tuple plumbing) to the reduce-scatter's
    done. A combined reduce-scatter keeps all its operands until it is done."""
    instrs = list(sched.computations[computation])
    index = {ins.name: i for i, ins in enumerate(instrs)}

    def origin(name: str) -> int:
        i = index.get(name, 0)
        while instrs[i].opcode in ("bitcast", "get-tuple-element") and instrs[i].operands \
                and instrs[i].operands[0] in index:
            i = index[instrs[i].operands[0]]
        return i

    curve = [0] * (len(instrs) + 1)
    for c in sched.collectives:
        if c.computation != computation or c.kind != "reduce-scatter":
            continue
        for o in instrs[c.start].operands:
            if o in index:
                nbytes = shape_bytes(instrs[index[o]].shape)
                curve[origin(o)] += nbytes
                curve[c.done + 1] -= nbytes
    live = best = 0
    for delta in curve[:-1]:
        live += delta
        best = max(best, live)
    return best


def gather_report(sched: Schedule, layer_bytes: int) -> dict[str, Any]:
    """Per computation with all-gathers: :func:`gathered_liveness` without its curve, in
    layers' worth of weights; for ENTRY also the gathered bytes alive where XLA's approximate
    live bytes peak."""
    comps = list(dict.fromkeys(c.computation for c in sched.collectives
                               if c.kind in ("all-gather", "reduce-scatter")))
    out: dict[str, Any] = {}
    loops = 0
    for comp in comps:
        info = gathered_liveness(sched, comp)
        curve = info.pop("curve")
        info["max_live_gathered_layers"] = round(info["max_live_gathered_bytes"] / layer_bytes, 2)
        info["reduce_scatters"] = sum(1 for c in sched.collectives if c.computation == comp
                                      and c.kind == "reduce-scatter")
        info["max_pending_reduce_scatter_bytes"] = pending = pending_reduce_scatter(sched, comp)
        info["max_pending_reduce_scatter_layers"] = round(pending / layer_bytes, 2)
        if comp == sched.entry:
            live = sched.live_bytes()
            peak = max(range(len(live)), key=live.__getitem__)
            info["at_live_peak_gathered_bytes"] = curve[peak]
            info["at_live_peak_gathered_layers"] = round(curve[peak] / layer_bytes, 2)
            info["live_peak_index"], info["length"] = peak, len(live)
        if comp == sched.entry:
            out["ENTRY"] = info
        else:  # a while body (a scanned preset): forward, or backward when it reduce-scatters
            loops += 1
            info["computation"] = comp
            out[f"loop{loops} ({'bwd' if info['reduce_scatters'] else 'fwd'})"] = info
    return out


def compile_row(step, args, options: dict[str, Any] | None, layer_bytes: int) -> dict[str, Any]:
    """Lowers and compiles (timed like :func:`jax_drain.planner.plan.plan`), reads memory and
    schedule."""
    start = time.perf_counter()
    lowered = step.lower(*args)
    compiled = lowered.compile(compiler_options=options) if options else lowered.compile()
    compile_s = time.perf_counter() - start
    memory = compiled.memory_analysis()
    sched = parse_schedule(compiled.as_text())
    pairs = [c for c in sched.collectives if c.done != c.start]
    temp, arg = int(memory.temp_size_in_bytes), int(memory.argument_size_in_bytes)
    return {
        "temp_bytes": temp, "argument_bytes": arg, "output_bytes": int(memory.output_size_in_bytes),
        "temp_plus_argument": temp + arg, "compile_s": round(compile_s, 2),
        "peak_live_bytes": max(sched.live_bytes(), default=0),
        "collectives": planner.summarize_collectives(sched.collectives),
        "collective_counts": planner.collective_counts(sched.collectives),
        "pairs": len(pairs), "overlapped": sum(1 for c in pairs if c.overlapped),
        "gathers": gather_report(sched, layer_bytes),
    }


def fsdp_step(config: models.GPTConfig, mesh, rule: str):
    """``build_user_step("gspmd_fsdp", ...)`` with :func:`fsdp_spec`'s ``rule`` (the planner's
    build path for the default rule)."""
    if rule == "smallest":
        step, args, _ = planner.build_step("gspmd_fsdp", config, mesh)
        return step, args
    params = models.abstract_params(config)
    batch = models.example_batch(config, mesh.shape["data"])
    loss_fn = models.make_loss(config)
    stacked = stacked_leaves(loss_fn, params, batch) if config.scan_layers else \
        jax.tree.map(lambda _: False, params)
    shardings = jax.tree.map(lambda p, s: NamedSharding(mesh, planner.fsdp_spec(p.shape, mesh.shape["data"], "data", bool(s), rule)),
                             params, stacked)
    step = jax.jit(jax.grad(loss_fn), in_shardings=(shardings, NamedSharding(mesh, P("data"))),
                   out_shardings=shardings)
    return step, (params, batch)


def layer_bytes_of(config: models.GPTConfig) -> int:
    blocks = models.abstract_params(config)["blocks"]
    return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(blocks)) // config.num_layers


def describe(config: models.GPTConfig, preset: str) -> dict[str, Any]:
    params = models.abstract_params(config)
    return {"preset": preset, "params": config.num_params(), "layers": config.num_layers,
            "d_model": config.d_model, "seq": config.seq_len, "scan_layers": config.scan_layers,
            "param_bytes": sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(params)),
            "layer_bytes": layer_bytes_of(config)}


def run(presets: list[str], flag_sets: list[str], rules: bool, say=print) -> list[dict[str, Any]]:
    mesh = gpu_mesh((8,), ("data",))
    rows: list[dict[str, Any]] = []

    def add(row: dict[str, Any]) -> None:
        rows.append(row)
        if "error" in row:
            say(f"{row['preset']:16s} {row['strategy']:18s} {row['flag_set']:34s} ERROR {row['error'][:120]}")
            return
        gathers = row.get("gathers", {}).values()
        most = lambda key: max((g[key] for g in gathers), default="-")
        say(f"{row['preset']:16s} {row['strategy']:18s} {row['flag_set']:34s} temp {row['temp_bytes'] / MiB:7.0f} "
            f"arg {row['argument_bytes'] / MiB:6.0f} temp+arg {row['temp_plus_argument'] / MiB:7.0f} MiB  "
            f"compile {row['compile_s']:5.1f} s  layers gathered live {most('max_live_gathered_layers')}, "
            f"grads pending {most('max_pending_reduce_scatter_layers')}")

    def attempt(base: dict[str, Any], build, options, layer_bytes) -> None:
        try:
            step, args = build()
            add({**base, **compile_row(step, args, options, layer_bytes)})
        except Exception as e:  # a flag this XLA refuses: say so in its row
            add({**base, "error": f"{type(e).__name__}: {e}".splitlines()[0]})

    for preset in presets:
        config = planner.preset_config(preset)
        info = describe(config, preset)
        for name in flag_sets:
            options, scanned_only = FLAG_SETS[name]
            if scanned_only and not config.scan_layers:
                continue
            base = {**info, "strategy": "gspmd_fsdp", "rule": "smallest", "flag_set": name, "options": options}
            attempt(base, lambda: fsdp_step(config, mesh, "smallest"), options, info["layer_bytes"])
        for strategy, buckets in COMPARE:
            start = time.perf_counter()
            try:
                report = planner.plan_preset(config, strategy, num_buckets=buckets)
            except Exception as e:
                add({**info, "strategy": strategy, "flag_set": "default", "error": f"{type(e).__name__}: {e}"})
                continue
            add({**info, "strategy": strategy, "flag_set": "default", "options": {}, "requested_buckets": buckets,
                 "num_buckets": report.num_buckets, "temp_bytes": report.temp_bytes,
                 "argument_bytes": report.argument_bytes, "output_bytes": report.output_bytes,
                 "temp_plus_argument": report.temp_bytes + report.argument_bytes,
                 "compile_s": round(report.compile_s, 2), "wall_s": round(time.perf_counter() - start, 2),
                 "peak_live_bytes": max(report.live_bytes, default=0),
                 "collectives": report.collectives_summary(), "collective_counts": report.collective_counts(),
                 "pairs": report.pairs, "overlapped": report.overlapped})
    if rules:
        for preset in RULE_PRESETS:
            config = planner.preset_config(preset)
            info = describe(config, preset)
            for rule in ("smallest", "largest"):
                if rule == "smallest" and preset in presets and "default" in flag_sets:
                    continue  # already a row above
                base = {**info, "strategy": "gspmd_fsdp", "rule": rule, "flag_set": "default", "options": {},
                        "section": "rules"}
                attempt(base, lambda: fsdp_step(config, mesh, rule), None, info["layer_bytes"])
    return rows


def mib(b: int | None) -> str:
    return "-" if b is None else f"{b / MiB:,.0f}" if b >= 100 * MiB else f"{b / MiB:,.1f}"


def markdown(rows: list[dict[str, Any]]) -> str:
    out = ["# gspmd_fsdp: ZeRO-3 by sharding annotations on 8x H100 (compile-only), per XLA flag set\n",
           "One gradient step (forward, backward, gradient sync; no optimizer), micro-batch 1, bf16 params, "
           "remat. Bytes per device from XLA's `memory_analysis()`; temp+arg = what the step needs besides "
           "its outputs (the gradients). `gspmd` and `fp32_accum+drain` (24 requested buckets) hold replicated "
           "params; `gspmd_fsdp` 1/8 of each (`fsdp_spec`: the smallest divisible dimension, `d_model`). "
           "`fp32_accum+drain` returns float32 gradient shards (its out bytes are twice the others'). "
           "Gathered live: the most all-gathered weight bytes alive at once (a liveness walk over each "
           "computation's schedule, approximate) in layers' worth of one block's weights; `at live peak`: "
           "those alive where the approximate live bytes of ENTRY peak; for a scanned preset per while body "
           "(`carries N on`: gathered for the next iteration). Unreduced grads pending: the most full-size "
           "gradient bytes alive at once waiting for their reduce-scatter, from the instruction that "
           "made each to the reduce-scatter's done, in the same layers.\n"]
    main = [r for r in rows if r.get("section") != "rules"]
    for preset in dict.fromkeys(r["preset"] for r in main):
        mine = [r for r in main if r["preset"] == preset]
        first = mine[0]
        out.append(f"## {preset}: {first['params'] / 1e6:.0f}M params ({mib(first['param_bytes'])} MiB bf16), "
                   f"{first['layers']} blocks{' scanned' if first['scan_layers'] else ''}, d_model {first['d_model']}, "
                   f"seq {first['seq']}; one block's weights {mib(first['layer_bytes'])} MiB\n")
        out.append("| strategy | flag set | temp MiB | arg MiB | out MiB | temp+arg MiB | compile s | gathered live "
                   "(layers) | unreduced grads pending (layers) | collectives |")
        out.append("|---|---|---:|---:|---:|---:|---:|---|---|---|")
        for r in mine:
            if "error" in r:
                out.append(f"| {r['strategy']} | {r['flag_set']} | error: {r['error'][:100]} |||||||| ")
                continue
            out.append(f"| {r['strategy']}{' (' + str(r['num_buckets']) + ' buckets)' if r.get('num_buckets') else ''} "
                       f"| {r['flag_set']} | {mib(r['temp_bytes'])} | {mib(r['argument_bytes'])} | "
                       f"{mib(r['output_bytes'])} | **{mib(r['temp_plus_argument'])}** | {r['compile_s']:.1f} | "
                       f"{_gathered_cell(r)} | {_pending_cell(r)} | {r['collectives']} |")
        fsdp = [r for r in mine if r["strategy"] == "gspmd_fsdp" and "error" not in r]
        if fsdp:
            # On a tie the simplest flag set (fewest options, then the order tried) wins.
            best = min(fsdp, key=lambda r: (r["temp_plus_argument"], len(r["options"]), fsdp.index(r)))
            ties = [r["flag_set"] for r in fsdp if r["temp_plus_argument"] == best["temp_plus_argument"]]
            out.append(f"\nbest gspmd_fsdp flag set (lowest temp+arg): **{best['flag_set']}**, "
                       f"{mib(best['temp_plus_argument'])} MiB"
                       + (f" (tied: {', '.join(ties)})" if len(ties) > 1 else "")
                       + f"; options `{json.dumps(best['options'])}`\n")
    rules = [r for r in rows if r["strategy"] == "gspmd_fsdp" and r["flag_set"] == "default"]
    if any(r.get("rule") == "largest" for r in rules):
        out.append("## Which dimension to shard (XLA's default flags)\n")
        out.append("`smallest`: each leaf's smallest divisible dimension (`d_model`, MaxText's `embed`; the "
                   "baseline's rule). `largest`: its largest divisible one (qkv's 3d, the MLP's 4d, the "
                   "vocabulary).\n")
        out.append("| preset | rule | temp MiB | arg MiB | temp+arg MiB | collectives |")
        out.append("|---|---|---:|---:|---:|---|")
        for r in sorted(rules, key=lambda r: (RULE_PRESETS.index(r["preset"]) if r["preset"] in RULE_PRESETS else 99,
                                              r["rule"] != "smallest")):
            if "error" in r:
                out.append(f"| {r['preset']} | {r['rule']} | error: {r['error'][:100]} ||||")
                continue
            out.append(f"| {r['preset']} | {r['rule']} | {mib(r['temp_bytes'])} | {mib(r['argument_bytes'])} | "
                       f"{mib(r['temp_plus_argument'])} | {r['collectives']} |")
        out.append("")
    return "\n".join(out) + "\n"


def _gathered_cell(r: dict[str, Any]) -> str:
    g = r.get("gathers")
    if not g:
        return "-"
    parts = []
    for comp, info in g.items():
        if not info["gathers"]:
            continue
        cell = f"{comp} {info['max_live_gathered_layers']:g}"
        if comp == "ENTRY" and info.get("at_live_peak_gathered_layers") is not None:
            cell += f" (at live peak {info['at_live_peak_gathered_layers']:g})"
        if comp != "ENTRY" and info["reaching_root_bytes"]:
            cell += f", carries {info['reaching_root_bytes'] / r['layer_bytes']:.2g} on"
        parts.append(cell)
    return "; ".join(parts) or "-"


def _pending_cell(r: dict[str, Any]) -> str:
    g = r.get("gathers")
    if not g:
        return "-"
    return "; ".join(f"{comp} {info['max_pending_reduce_scatter_layers']:g}" for comp, info in g.items()
                     if info["reduce_scatters"]) or "-"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--presets", default=",".join(PRESETS), help="comma-separated model presets")
    p.add_argument("--flag-sets", default=",".join(FLAG_SETS), help=f"of {', '.join(FLAG_SETS)}")
    p.add_argument("--no-rules", action="store_true", help="skip the sharded-dimension comparison")
    p.add_argument("--out", metavar="DIR", help="write fsdp_baseline.json and fsdp_baseline.md here")
    p.add_argument("--from-json", metavar="FILE", help="re-render a previous run's rows; compile nothing")
    args = p.parse_args(argv)
    if args.from_json:
        rows = json.loads(Path(args.from_json).read_text())
    else:
        unknown = [f for f in args.flag_sets.split(",") if f not in FLAG_SETS]
        if unknown:
            p.error(f"unknown flag sets {unknown}; choose from {', '.join(FLAG_SETS)}")
        start = time.perf_counter()
        rows = run(args.presets.split(","), args.flag_sets.split(","), not args.no_rules,
                   say=lambda line: print(line, flush=True))
        print(f"{len(rows)} compiles in {time.perf_counter() - start:.0f} s")
    table = markdown(rows)
    print("\n" + table)
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "fsdp_baseline.json").write_text(json.dumps(rows, indent=1))
        (out / "fsdp_baseline.md").write_text(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
