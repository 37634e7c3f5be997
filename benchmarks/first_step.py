"""Time to first result: ``jd.make_train_step`` against a plain ``jax.jit`` optax step.

On 8 virtual CPU devices, for each model and each variant in a fresh process (no compile cache
shared between them):

* ``build``: ``make_train_step(..., example_batch=...)`` + ``init()`` for jax_drain; for ``jit``,
  splitting the nnx model, placing the params replicated on the mesh and a jitted ``tx.init``;
* ``first``: the first step (trace, lower, compile, run), until its metrics are ready;
* ``steady``: the median of the next ``--steps`` steps.

The same model (a ``jax_drain.models.GPT`` as an ``nnx.Module``), loss, ``optax.adamw`` and
batch (split over a ``("data",)`` mesh; the ``jit`` step keeps its params replicated).

On compile-only 8xH100 devices (``jax_drain.plan.gpu_mesh``): the same train step (gradient
and AdamW update) of a Llama-3-8B-shaped model, timed from building it to
``.lower(...).compile()`` done.

Each jax_drain variant is compared with a plain ``jax.jit`` optax step that has the same
shardings (:data:`BASELINE_OF`):

* ``jd`` (``TrainConfig()``, ZeRO-1) against ``jit``, params replicated over ``("data",)``;
* ``jd_zero3`` (``shard_params=True``) against ``jit_fsdp``, every leaf sharded FSDP-style
  (``jax_drain.planner.plan.fsdp_spec``, the planner's ``gspmd_fsdp`` rule);
* ``jd_gspmd`` (``tensor_parallel="gspmd"`` with Megatron's split of the blocks' matrices as
  ``param_specs``) against ``jit_tp``, the same specs on a ``("data", "model")`` = 4x2 mesh.

The ``jit``/``jd`` pair trains the ``nnx.Module`` on CPU; the others its params pytree
(``jax_drain.models.make_loss``), both members of a pair alike.

``--baseline-tree DIR`` adds a ``jd@<label>`` variant that imports jax_drain from another
checkout (e.g. ``git archive HEAD~3 jax_drain | tar -x -C /tmp/before``), so that before and
after are measured side by side, interleaved, in one run.

    python benchmarks/first_step.py --out benchmarks/results
    python benchmarks/first_step.py --baseline-tree /tmp/before --baseline-label 7a4fc26 --out benchmarks/results
"""

from __future__ import annotations

import os

os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import argparse  # noqa: E402
import dataclasses  # noqa: E402
import json  # noqa: E402
import pathlib  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from typing import Any  # noqa: E402

#: CPU models: (GPTConfig fields, global batch). ``gpt-8m``: 8 blocks, 8.4M parameters.
CPU_MODELS: dict[str, tuple[dict[str, Any], int]] = {
    "gpt-8m": (dict(num_layers=8, d_model=256, num_heads=4, seq_len=64, vocab_size=8192), 16),
    "gpt-132k": (dict(num_layers=2, d_model=64, num_heads=4, seq_len=64, vocab_size=512), 16),
}

#: Llama-3-8B's shape in GPT blocks: d_model 4096, 32 heads, vocabulary 128256, 32 layers
#: (a 4x GELU MLP and a tied embedding instead of SwiGLU and a separate head: 7.0B parameters).
GPU_MODEL = dict(d_model=4096, num_heads=32, seq_len=2048, vocab_size=128256)
GPU_LAYERS = 32

BUCKET_SIZE = 1_000_000  # CPU models: about 8 buckets for gpt-8m

#: Each jax_drain variant's baseline: plain ``jax.jit`` with the same parameter shardings.
BASELINE_OF = {"jd": "jit", "jd_zero3": "jit_fsdp", "jd_gspmd": "jit_tp"}
VARIANTS = ("jit", "jd", "jit_fsdp", "jd_zero3", "jit_tp", "jd_gspmd")
#: The tensor-parallel pair's mesh; the others are data parallel over all 8 devices.
TP_MESH = ((4, 2), ("data", "model"))

NOTES = """\
Columns. CPU: *build* is `make_train_step(..., example_batch=...)` + `init()` for jax_drain, and
for `jit` splitting the model, placing the params and a jitted `tx.init`; *first step* is the
first call until its metrics are ready (trace, lower, compile, run); *steady step* the median of
the next steps; *build + first - steady* what starting costs beyond one step, the comparison
that holds when the two steps run at different speeds. GPU: *build* is `make_train_step`
(or `jax.jit`), *lower* `abstract_state()` + `.lower(...)`, *compile* `.compile()` for 8
compile-only H100s. `jd@<commit>` is jax_drain before the changes, run side by side.

Pairs: each jax_drain variant against a plain `jax.jit` optax step with the same shardings.
`jd` (ZeRO-1, `TrainConfig()`) against `jit`, params replicated over 8 devices; `jd_zero3`
(`shard_params=True`) against `jit_fsdp`, every parameter and optimizer leaf sharded along its
smallest dimension that 8 divides (the planner's `gspmd_fsdp` rule); `jd_gspmd`
(`tensor_parallel="gspmd"`, Megatron's split of the blocks' matrices as `param_specs`) against
`jit_tp`, the same specs on a 4x2 `("data", "model")` mesh. The `jit`/`jd` pair trains the
`nnx.Module`, the others its params pytree (`jax_drain.models.make_loss`).

XLA:CPU runs the `jit` step's gradient all-reduces (one per parameter, 71 for gpt-8m) as
rendezvous of the 8 virtual devices' threads: on 2 cores that step is several times slower than
jax_drain's (7 bucket reduce-scatters), so its first step is too; on a machine with a core per
device the two steady steps are equal. The GPU model is Llama-3-8B's shape in
`jax_drain.models.GPT` blocks (d_model 4096, 32 heads, 32 layers, vocabulary 128256, seq 2048,
one sequence per device; a 4x GELU MLP and a tied embedding: 7.0B parameters), bf16 parameters,
`TrainConfig()` defaults (40M-element buckets).
"""
LEARNING_RATE = 1e-3


# -- workers: one measurement in this process ----------------------------------------------------


def _mesh_of(variant: str, make_mesh):
    return make_mesh(*TP_MESH) if variant in ("jit_tp", "jd_gspmd") else make_mesh((8,), ("data",))


def _shardings(variant: str, tree: Any, mesh: Any) -> Any:
    """The ``NamedSharding`` of each leaf of ``tree`` (params or optimizer state) for a ``jit``
    variant: replicated (``jit``), FSDP-style (``jit_fsdp``) or tensor parallel (``jit_tp``)."""
    import jax
    from jax.sharding import NamedSharding, PartitionSpec as P

    from jax_drain.models import tensor_parallel_specs
    from jax_drain.planner.plan import fsdp_spec

    if variant == "jit_tp":  # the optimizer state's moments split like their parameters
        specs = tensor_parallel_specs(tree)
    else:
        specs = jax.tree.map(lambda leaf: fsdp_spec(leaf.shape, mesh.shape["data"]) if variant == "jit_fsdp" else P(),
                             tree)
    return jax.tree.map(lambda spec: NamedSharding(mesh, spec), specs, is_leaf=lambda x: isinstance(x, P))


def _jit_step(variant: str, loss_fn: Any, tx: Any, params: Any, mesh: Any) -> tuple[Any, Any, Any]:
    """A plain ``jax.jit`` optax step with ``variant``'s shardings: the jitted step and the
    shardings of the params and of the optimizer state."""
    import jax
    import optax
    from jax.sharding import NamedSharding, PartitionSpec as P

    param_shardings = _shardings(variant, params, mesh)
    opt_shardings = _shardings(variant, jax.eval_shape(tx.init, params), mesh)

    def train_step(params, opt_state, batch):
        loss, grads = jax.value_and_grad(loss_fn)(params, batch)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    jitted = jax.jit(train_step, in_shardings=(param_shardings, opt_shardings, NamedSharding(mesh, P("data"))),
                     out_shardings=(param_shardings, opt_shardings, NamedSharding(mesh, P())),
                     donate_argnums=(0, 1))
    return jitted, param_shardings, opt_shardings


def _jd_config(variant: str, params: Any, **fields: Any):
    import jax_drain as jd
    from jax_drain.models import tensor_parallel_specs

    if variant == "jd_zero3":
        return jd.TrainConfig(shard_params=True, **fields)
    if variant == "jd_gspmd":
        return jd.TrainConfig(tensor_parallel="gspmd", param_specs=tensor_parallel_specs(params), **fields)
    return jd.TrainConfig(**fields)


def _gpt_config(fields: dict[str, Any], dtype: str):
    import jax.numpy as jnp

    from jax_drain.models import GPTConfig

    return GPTConfig(**fields, param_dtype=jnp.dtype(dtype))


def cpu_worker(variant: str, model_name: str, steps: int) -> dict[str, Any]:
    import jax_drain as jd
    import jax
    import numpy as np
    import optax
    from flax import nnx

    from jax_drain import models

    fields, batch_size = CPU_MODELS[model_name]
    config = _gpt_config(fields, "float32")
    model = models.GPT(config, rngs=nnx.Rngs(0))
    # Auto axes: the jit steps are GSPMD programs, sharded by their in/out shardings.
    mesh = _mesh_of(variant, lambda shape, names: jax.make_mesh(
        shape, names, axis_types=(jax.sharding.AxisType.Auto,) * len(names)))
    rng = np.random.default_rng(0)
    batches = [{"tokens": rng.integers(0, config.vocab_size, (batch_size, config.seq_len + 1)).astype(np.int32)}
               for _ in range(4)]
    tx = optax.adamw(LEARNING_RATE)
    # The jit/jd pair trains the nnx model; the other pairs its params pytree, the same weights.
    nnx_model = variant in ("jit", "jd")
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    if nnx_model:
        loss_fn = lambda p, b: nnx.merge(graphdef, p, rest).loss(b)  # noqa: E731
    else:
        params, loss_fn = nnx.to_pure_dict(params), models.make_loss(config)

    start = time.perf_counter()
    if variant.startswith("jit"):
        jitted, param_shardings, opt_shardings = _jit_step(variant, loss_fn, tx, params, mesh)
        params = jax.device_put(params, param_shardings)
        state = (params, jax.jit(tx.init, out_shardings=opt_shardings)(params))
        jax.block_until_ready(state)

        def run(state, batch):
            params, opt_state, loss = jitted(*state, batch)
            return (params, opt_state), loss
    else:
        step = jd.make_train_step(model if nnx_model else params, (lambda m, b: m.loss(b)) if nnx_model else loss_fn,
                                  tx, mesh, _jd_config(variant, params, bucket_size=BUCKET_SIZE),
                                  example_batch=batches[0])
        state = step.init()
        jax.block_until_ready(state)

        def run(state, batch):
            state, metrics = step(state, batch)
            return state, metrics.loss
    build = time.perf_counter() - start

    start = time.perf_counter()
    state, loss = run(state, batches[0])
    jax.block_until_ready((state, loss))
    first = time.perf_counter() - start
    times, losses = [], [float(loss)]
    for i in range(steps):
        start = time.perf_counter()
        state, loss = run(state, batches[(i + 1) % len(batches)])
        jax.block_until_ready((state, loss))
        times.append(time.perf_counter() - start)
        losses.append(float(loss))
    num_params = sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
    return {"build_s": build, "first_s": first, "steady_s": statistics.median(times), "params": int(num_params),
            "losses": losses[:3], "jax_drain": os.path.dirname(jd.__file__)}


def gpu_worker(variant: str, layers: int, micro_batch: int) -> dict[str, Any]:
    import jax_drain as jd
    import jax

    import optax

    from jax_drain import models
    from jax_drain.plan import gpu_mesh

    config = _gpt_config({**GPU_MODEL, "num_layers": layers}, "bfloat16")
    mesh = _mesh_of(variant, gpu_mesh)
    params = models.abstract_params(config)
    batch = models.example_batch(config, micro_batch * 8)
    loss_fn = models.make_loss(config)
    tx = optax.adamw(LEARNING_RATE)

    start = time.perf_counter()
    if variant.startswith("jit"):
        jitted, _, _ = _jit_step(variant, loss_fn, tx, params, mesh)
        built = time.perf_counter()
        lowered = jitted.lower(params, jax.eval_shape(tx.init, params), batch)
    else:
        step = jd.make_train_step(params, loss_fn, tx, mesh, _jd_config(variant, params), example_batch=batch)
        built = time.perf_counter()
        lowered = step.lower(step.abstract_state(), batch)
    lowered_at = time.perf_counter()
    compiled = lowered.compile()
    done = time.perf_counter()
    memory = compiled.memory_analysis()
    return {"build_s": built - start, "lower_s": lowered_at - built, "compile_s": done - lowered_at,
            "total_s": done - start, "params": int(config.num_params()),
            "temp_bytes": int(memory.temp_size_in_bytes), "jax_drain": os.path.dirname(jd.__file__)}


# -- the driver: fresh processes, interleaved ----------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Job:
    kind: str  # "cpu" or "gpu"
    variant: str  # one of VARIANTS, or "jd@<commit>"
    setting: str  # CPU model name or "8B-like/<layers>L"
    args: tuple[str, ...]
    tree: str | None = None  # another jax_drain checkout to import from


def _commit(tree: str | None) -> str:
    cwd = tree or pathlib.Path(__file__).resolve().parent
    out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=cwd, capture_output=True, text=True)
    dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no", "jax_drain"], cwd=cwd,
                           capture_output=True, text=True).stdout.strip()
    return (out.stdout.strip() or "unknown") + ("+changes" if dirty and tree is None else "")


def run_job(job: Job, timeout: float) -> dict[str, Any]:
    env = dict(os.environ)
    if job.tree is not None:  # its jax_drain first on the path
        env["PYTHONPATH"] = os.pathsep.join([job.tree, env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    variant = job.variant.split("@")[0]  # jd@<label>: the jd worker, imported from its tree
    cmd = [sys.executable, __file__, "--worker", job.kind, "--variant", variant, *job.args]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    if proc.returncode or not lines:
        raise RuntimeError(f"{job} failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
    return json.loads(lines[-1])


def _median(rows: list[dict[str, Any]], key: str) -> float:
    return statistics.median(r[key] for r in rows)


def summarize(results: dict[Job, list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """One row per (setting, variant): medians over the repeats; a jax_drain variant's ratios
    (``*_vs_jit``) to its baseline in :data:`BASELINE_OF`, the ``jit`` step with its shardings."""
    rows = []
    for job, runs in results.items():
        row: dict[str, Any] = {"kind": job.kind, "setting": job.setting, "variant": job.variant,
                               "params": runs[0]["params"], "repeats": len(runs)}
        keys = ("build_s", "first_s", "steady_s") if job.kind == "cpu" else ("build_s", "lower_s", "compile_s",
                                                                             "total_s")
        row.update({k: _median(runs, k) for k in keys})
        if job.kind == "cpu":
            row["to_first_s"] = _median([{"t": r["build_s"] + r["first_s"]} for r in runs], "t")
            # What starting costs beyond one step: building, tracing, lowering, compiling. The
            # fair comparison where the two steps run at different speeds (this CPU backend runs
            # the jit step's many small all-reduces slowly on few cores).
            row["one_off_s"] = _median([{"t": r["build_s"] + r["first_s"] - r["steady_s"]} for r in runs], "t")
            row["losses"] = runs[0]["losses"]
        else:
            row["temp_bytes"] = runs[0]["temp_bytes"]
        row["runs"] = runs
        rows.append(row)
    for row in rows:
        row["baseline"] = BASELINE_OF.get(row["variant"].split("@")[0])
        base = next((r for r in rows if r["setting"] == row["setting"] and r["variant"] == row["baseline"]), None)
        if base is None:
            continue
        for key in ("build_s", "first_s", "steady_s", "to_first_s", "one_off_s", "compile_s", "total_s"):
            if key in row and base.get(key):
                row[key[:-2] + "_vs_jit"] = row[key] / base[key]
    return rows


def table(rows: list[dict[str, Any]]) -> str:
    out = []
    cpu = [r for r in rows if r["kind"] == "cpu"]
    if cpu:
        out += ["8 virtual CPU devices (data parallel), nnx GPT, optax.adamw; seconds, median of "
                f"{cpu[0]['repeats']} fresh processes; in brackets, ratio to the jit step with the same shardings", "",
                "| model | params | variant | build | first step | build + first step | steady step | build + first - steady |",
                "|---|---:|---|---:|---:|---:|---:|---:|"]
        for r in cpu:
            ratio = lambda k: f" ({r[k]:.2f}x)" if k in r else ""  # noqa: E731
            out.append(f"| {r['setting']} | {r['params'] / 1e6:.2f}M | {r['variant']} | {r['build_s']:.2f}"
                       f"{ratio('build_vs_jit')} | {r['first_s']:.2f}{ratio('first_vs_jit')} | "
                       f"{r['to_first_s']:.2f}{ratio('to_first_vs_jit')} | {r['steady_s']:.2f}"
                       f"{ratio('steady_vs_jit')} | {r['one_off_s']:.2f}{ratio('one_off_vs_jit')} |")
    gpu = [r for r in rows if r["kind"] == "gpu"]
    if gpu:
        out += ["", "Compile-only 8xH100 (XLA's GPU compiler on 2 CPU cores), gradient + AdamW step; seconds; "
                "in brackets, ratio to the jit step with the same shardings", "",
                "| model | params | variant | build | lower | compile | total |", "|---|---:|---|---:|---:|---:|---:|"]
        for r in gpu:
            ratio = lambda k: f" ({r[k]:.2f}x)" if k in r else ""  # noqa: E731
            out.append(f"| {r['setting']} | {r['params'] / 1e9:.2f}B | {r['variant']} | {r['build_s']:.2f} | "
                       f"{r['lower_s']:.2f} | {r['compile_s']:.1f}{ratio('compile_vs_jit')} | "
                       f"{r['total_s']:.1f}{ratio('total_vs_jit')} |")
    return "\n".join(out)


def _variants(names: str) -> list[str]:
    chosen = [n for n in names.split(",") if n]
    unknown = sorted(set(chosen) - set(VARIANTS))
    if unknown:
        raise SystemExit(f"first_step.py: unknown variant(s) {', '.join(unknown)}; choose from {', '.join(VARIANTS)}")
    return chosen


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--worker", choices=("cpu", "gpu"), help=argparse.SUPPRESS)
    p.add_argument("--variant", default="jd", help=argparse.SUPPRESS)
    p.add_argument("--model", default="gpt-8m", help=argparse.SUPPRESS)
    p.add_argument("--models", default="gpt-8m,gpt-132k", help=f"CPU models, of {', '.join(CPU_MODELS)} ('' skips)")
    p.add_argument("--steps", type=int, default=10, help="steady steps timed after the first")
    p.add_argument("--repeats", type=int, default=3, help="fresh processes per CPU measurement")
    p.add_argument("--gpu-layers", default=str(GPU_LAYERS),
                   help="layers of the 8B-shaped model for the GPU compile, comma-separated (0 skips)")
    p.add_argument("--variants", default=",".join(VARIANTS), help=f"CPU variants, of {', '.join(VARIANTS)}")
    p.add_argument("--gpu-variants", default=",".join(VARIANTS), help="the same, compiled for 8xH100")
    p.add_argument("--gpu-repeats", type=int, default=1)
    p.add_argument("--micro-batch", type=int, default=1, help="GPU: sequences per device")
    p.add_argument("--baseline-tree", help="another jax_drain checkout, measured as jd@<label> beside jd")
    p.add_argument("--baseline-label", help="its label (default: its git commit)")
    p.add_argument("--timeout", type=float, default=3600)
    p.add_argument("--out", metavar="DIR", help="write first_step.json and first_step.md there")
    p.add_argument("--from-json", metavar="FILE", help="re-render a first_step.json (to --out), measure nothing")
    args = p.parse_args(argv)

    if args.from_json:
        saved = json.loads(pathlib.Path(args.from_json).read_text())
        return write(saved["rows"], saved["meta"], args.out)

    if args.worker == "cpu":
        print(json.dumps(cpu_worker(args.variant, args.model, args.steps)))
        return 0
    if args.worker == "gpu":
        print(json.dumps(gpu_worker(args.variant, int(args.gpu_layers), args.micro_batch)))
        return 0

    jd_variants = [("jd", None)]
    if args.baseline_tree:
        tree = str(pathlib.Path(args.baseline_tree).resolve())
        jd_variants.insert(0, (f"jd@{args.baseline_label or _commit(tree)}", tree))
    jobs: list[tuple[Job, int]] = []
    for model in filter(None, args.models.split(",")):
        for name in _variants(args.variants):
            for variant, tree in ([(name, None)] if name != "jd" else jd_variants):
                job = Job("cpu", variant, model, ("--model", model, "--steps", str(args.steps)), tree)
                jobs.append((job, args.repeats))
    for layers in (int(n) for n in args.gpu_layers.split(",") if int(n) > 0):
        for name in _variants(args.gpu_variants):
            for variant, tree in ([(name, None)] if name != "jd" else jd_variants):
                job = Job("gpu", variant, f"8B-like/{layers}L",
                          ("--gpu-layers", str(layers), "--micro-batch", str(args.micro_batch)), tree)
                jobs.append((job, args.gpu_repeats))

    results: dict[Job, list[dict[str, Any]]] = {job: [] for job, _ in jobs}
    for round_ in range(max(n for _, n in jobs)):  # interleaved: noise hits every variant alike
        for job, repeats in jobs:
            if round_ < repeats:
                result = run_job(job, args.timeout)
                results[job].append(result)
                print(f"  {job.setting} {job.variant}: " + ", ".join(
                    f"{k} {v:.2f}" for k, v in result.items() if k.endswith("_s")), file=sys.stderr, flush=True)
    rows = summarize(results)
    meta = {"command": "python benchmarks/first_step.py " + " ".join(sys.argv[1:] if argv is None else argv),
            "commit": _commit(None), "cpus": os.cpu_count(), "gpu_model": GPU_MODEL, "cpu_models": CPU_MODELS,
            "bucket_size": BUCKET_SIZE}
    return write(rows, meta, args.out)


def write(rows: list[dict[str, Any]], meta: dict[str, Any], out: str | None) -> int:
    """Prints the table; with ``out``, writes it (first_step.md) and the rows (first_step.json) there."""
    text = table(rows)
    print(text)
    if out:
        path = pathlib.Path(out)
        path.mkdir(parents=True, exist_ok=True)
        (path / "first_step.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
        (path / "first_step.md").write_text(
            f"# Time to first result (`{meta['command']}`, jax_drain {meta['commit']})\n\n{text}\n\n{NOTES}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
