"""The planner's command line: ``python -m jax_drain.plan`` (``jax_drain/plan.py`` runs :func:`run`).

Three sources of a step: a built-in ``--preset``; your model, ``--loss/--params/--batch``
(compared over several strategies, :func:`jax_drain.planner.compare.plan_model`); or your own
step, ``--step MODULE:FUNCTION``. ``MODULE`` is an importable module or a path to a ``.py`` file.
``--memory-budget MiB`` (a preset or ``--loss``) searches the configurations for the fastest
that fits instead (:mod:`jax_drain.planner.search`).

Exit status: 0 planned; 2 bad input, the step did not plan or nothing fits the memory budget
(one line on stderr; with ``--json`` the search is written first, its ``choice`` null); 3 no usable
CUDA PJRT plugin (the one-line :class:`~jax_drain.planner.targets.GpuCompileUnavailable`
message on stderr).
"""

from __future__ import annotations

import argparse
import hashlib
import importlib
import importlib.util
import inspect
import json
import math
import pathlib
import re
import sys
from typing import Any, Callable, NoReturn, Sequence

import jax

from jax_drain import models
from jax_drain.collectives import REDUCE_MODES
from jax_drain.planner._report import Progress, total_buckets
from jax_drain.planner.compare import (
    DEFAULT_STRATEGIES, Comparison, Row, abstract_tree, describe_model, largest_leaf, plan_model,
)
from jax_drain.planner.plan import (
    SCOPE_PREFIX, Plan, Strategy, StrategyUnavailable, plan, plan_preset, preset_config,
)
from jax_drain.planner.search import BudgetTooSmall, search_model, search_preset
from jax_drain.planner.targets import GpuCompileUnavailable, gpu_devices, gpu_mesh, parse_topology

#: Size flags that reach a user's PARAMS/BATCH/FUNCTION as keywords of the same name.
SIZE_KEYWORDS = ("layers", "d_model", "heads", "seq", "micro_batch")
_DEFAULT_NUM_BUCKETS = 24

_STEP_HELP = (
    "your own step: FUNCTION(mesh, **keywords) returns (jitted_step, abstract_args) or (jitted_step, "
    "abstract_args, sync), its arrays on `mesh` (compile-only GPUs, axis 'data'). It is called once per "
    "strategy with strategy=<jax_drain.plan.Strategy> (.name, .reduce: None for gspmd/no_comm, "
    ".max_in_flight: None undrained, .split) if it has a `strategy` parameter (then the default "
    "strategies are those of --loss), else once; and with bucket_size=, num_buckets=, layers=, d_model=, "
    "heads=, seq=, micro_batch= if it has parameters of those names and the flags are given"
)


def _positive_mib(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number of MiB, got {text!r}") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be a positive number of MiB, got {text!r}")
    return value


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text!r}")
    return value


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m jax_drain.plan",
        description="Compile a training step for a virtual GPU host (no GPU needed) and report "
        "XLA's memory and schedule for the gradient sync. With --loss/--params/--batch (your model) "
        "or several --strategy values: one table comparing the strategies, and a verdict on whether "
        "the activations or the gradient sync set the peak.",
        epilog="MODULE is an importable module (examples.my_model) or a path to a .py file "
        "(examples/my_model.py). PARAMS and BATCH are called with no arguments, or with the keywords "
        "num_devices=, layers=, d_model=, heads=, seq=, micro_batch= where they have parameters of "
        "those names (num_devices always, the others when given). exit status: 0 planned; 2 bad input "
        "or the step did not plan; 3 no usable CUDA PJRT plugin (pip install -e '.[gpu-compile]')",
    )
    src = p.add_mutually_exclusive_group()
    src.add_argument("--preset", default="gpt-blocks", help=f"model preset: {', '.join(models.PRESETS)}")
    src.add_argument("--loss", metavar="MODULE:LOSS_FN",
                     help="your model's LOSS_FN(params, batch): the per-device mean loss; needs --params and --batch")
    src.add_argument("--step", metavar="MODULE:FUNCTION", help=_STEP_HELP)
    p.add_argument("--params", metavar="MODULE:PARAMS",
                   help="with --loss: PARAMS() returns the params, global shapes (arrays or jax.ShapeDtypeStruct)")
    p.add_argument("--batch", metavar="MODULE:BATCH",
                   help="with --loss: BATCH() returns one step's global batch, split over the devices along "
                   "its leading axis (arrays or jax.ShapeDtypeStruct)")
    p.add_argument("--strategy", action="append", metavar="NAME[,NAME...]",
                   help="repeat or separate with commas: gspmd, gspmd+flags, gspmd_fsdp, no_comm, MODE, MODE+drain, "
                   f"MODE+drainK, MODE+drain+split, with +zero3, +blocks, +noreshard or +ppN (N pipeline stages; "
                   f"+1f1b or +1f1b_lockstep for that schedule) after (MODE: {', '.join(REDUCE_MODES)}). Default: "
                   f"fp32_accum+drain for a preset, {', '.join(DEFAULT_STRATEGIES)} for --loss")
    p.add_argument("--target", default="h100", help="GPU target: h100, h200, a100")
    p.add_argument("--topology", default="1x1x8", help="SLICESxHOSTSxGPUS, e.g. 1x1x8 or 1x2x8")
    size = p.add_mutually_exclusive_group()
    size.add_argument("--bucket-size", type=_positive_int, help="bucket size in elements")
    size.add_argument("--num-buckets", type=_positive_int,
                      help=f"about this many buckets (default {_DEFAULT_NUM_BUCKETS})")
    p.add_argument("--layers", type=_positive_int, help="the preset's number of blocks (or your PARAMS' layers=)")
    p.add_argument("--d-model", type=_positive_int, help="the preset's model width (or d_model=)")
    p.add_argument("--heads", type=_positive_int, help="the preset's attention heads (or heads=)")
    p.add_argument("--seq", type=_positive_int, help="the preset's sequence length (or your BATCH's seq=)")
    p.add_argument("--scan-layers", action="store_true",
                   help="run the blocks under nnx.scan; the sync reduce-scatters inside the backward scan "
                   "(with --loss: require a scanned loss; without it, scanned leaves are found by themselves)")
    p.add_argument("--micro-batch", type=_positive_int,
                   help="sequences per device (preset default 1; or your BATCH's micro_batch=)")
    p.add_argument("--model-axis", action="append", default=[], metavar="NAME=SIZE",
                   help="tensor parallel over a mesh axis NAME of SIZE devices besides 'data' (repeat for several); "
                   "the loss is written for global shapes and XLA partitions it (tensor_parallel='gspmd'). A "
                   "preset splits its blocks Megatron's way over one such axis; with --loss give --param-specs")
    p.add_argument("--param-specs", metavar="MODULE:SPECS",
                   help="with --loss and --model-axis: SPECS() (or SPECS(params)) returns a PartitionSpec per "
                   "parameter (a prefix of the params pytree) over the --model-axis names")
    p.add_argument("--xla-option", action="append", default=[], metavar="NAME=VALUE",
                   help="an XLA compile option, e.g. xla_gpu_experimental_parallel_collective_overlap_limit=2")
    p.add_argument("--memory-budget", type=_positive_mib, metavar="MiB",
                   help="search bucket size, drain depth, reduce mode, split leaves, bucket boundaries, ZeRO stage "
                   "and reshard_after_forward for the configuration with the lowest predicted step whose temp + "
                   "arguments per device fit this many MiB (a preset or --loss; --num-buckets: where it starts); "
                   "prints the time-memory frontier and the chosen TrainConfig")
    p.add_argument("--max-compiles", type=_positive_int, metavar="N",
                   help="with --memory-budget: compile at most N steps (default 24)")
    p.add_argument("--json", metavar="FILE", help="write the report as JSON: one row per strategy (a list) for "
                   "--loss, --step or several strategies; one preset strategy's full report otherwise; with "
                   "--memory-budget {\"rows\": [...], \"choice\": {\"config\": {...}, ...}, ...}")
    p.add_argument("--plot", metavar="FILE.png", help="plot live bytes over the schedule (with --memory-budget: "
                   "predicted step against memory, the frontier and the choice)")
    p.add_argument("-q", "--quiet", action="store_true",
                   help="no progress lines on stderr while compiling (one per strategy otherwise)")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        strategies = _strategy_list(args.strategy)
        options = _xla_options(args.xla_option)
        gpu_devices(args.target, args.topology)  # no usable plugin: its one-line error before any progress
        _check_tensor_parallel_flags(args)
        if args.memory_budget is not None:
            return _search(args, strategies, options)
        if args.max_compiles is not None:
            raise ValueError("--max-compiles bounds a search: give --memory-budget MiB too")
        if args.loss or args.params or args.batch:
            report: Plan | Comparison = _plan_user_model(args, strategies, options)
        elif args.step:
            report = _plan_user_step(args, strategies, options)
        elif args.model_axis:
            report = _plan_preset_tensor_parallel(args, strategies, options)
        elif strategies and len(strategies) > 1:
            report = _compare_preset(args, strategies, options)
        else:
            name = strategies[0] if strategies else "fp32_accum+drain"
            shown = Progress(not args.quiet, 1, f"preset {args.preset} on {_devices(args)}")
            shown.compiling(0, name)
            try:
                report = plan_preset(
                    _preset(args), name, args.target, args.topology,
                    bucket_size=args.bucket_size, num_buckets=None if args.bucket_size else _num_buckets_arg(args),
                    micro_batch=args.micro_batch or 1, compiler_options=options,
                )
            except BaseException:
                shown.failed()
                raise
            shown.compiled(report.temp_bytes)
        print(report)
        if args.json:
            _write_json(args.json, report.to_json())
        if args.plot:
            print(f"wrote {report.plot(args.plot)}")
    except GpuCompileUnavailable as e:  # no usable CUDA PJRT plugin: one line, no traceback
        print(f"error: {_one_line(e)}", file=sys.stderr)
        return 3
    except (ValueError, TypeError, RuntimeError, OSError) as e:
        print(f"error: {_one_line(e)}", file=sys.stderr)
        return 2
    return 0


def _one_line(e: BaseException) -> str:
    return " ".join(str(e).split()) or type(e).__name__


def _strategy_list(values: Sequence[str] | None) -> list[str] | None:
    """``--strategy`` values, repeated and/or comma-separated, checked; ``None`` when not given."""
    if not values:
        return None
    names = [name.strip() for value in values for name in value.split(",") if name.strip()]
    if not names:
        raise ValueError("--strategy needs at least one name")
    for name in names:
        Strategy.parse(name)
    return list(dict.fromkeys(names))


def _devices(args: argparse.Namespace) -> str:
    slices, hosts, gpus = parse_topology(args.topology)
    return f"{slices * hosts * gpus}x {args.target} ({args.topology})"


def _num_buckets_arg(args: argparse.Namespace) -> int:
    return args.num_buckets or _DEFAULT_NUM_BUCKETS


def _preset(args: argparse.Namespace) -> models.GPTConfig:
    return preset_config(args.preset, args.layers, args.d_model, args.heads, args.seq, args.scan_layers or None)


def _model_axes(args: argparse.Namespace) -> dict[str, int] | None:
    """``--model-axis NAME=SIZE`` values as ``{name: size}``; ``None`` when not given."""
    axes: dict[str, int] = {}
    for pair in args.model_axis:
        name, sep, size = pair.partition("=")
        if not sep or not name.isidentifier() or not re.fullmatch(r"[1-9]\d*", size.strip()):
            raise ValueError(f"--model-axis takes NAME=SIZE (an axis name and a positive integer), got {pair!r}")
        if name == "data" or name in axes:
            raise ValueError(f"--model-axis {pair!r}: {name!r} is " + (
                "the data-parallel axis, which gets the devices the model axes leave" if name == "data"
                else "given twice"))
        axes[name] = int(size)
    return axes or None


def _check_tensor_parallel_flags(args: argparse.Namespace) -> None:
    """``--model-axis`` and ``--param-specs`` refused where they cannot reach, before any compile."""
    axes = _model_axes(args)
    if args.param_specs and not args.loss:
        raise ValueError("--param-specs goes with --loss (a preset splits its blocks Megatron's way by itself)")
    if args.param_specs and axes is None:
        raise ValueError("--param-specs needs --model-axis NAME=SIZE for the axes its specs name")
    if args.loss and axes and not args.param_specs:
        raise ValueError("--model-axis with --loss needs --param-specs MODULE:SPECS: how each parameter splits")
    if args.step and axes:
        raise ValueError("--model-axis does not reach --step: build the tensor-parallel mesh in your FUNCTION "
                         "(it receives a 'data' mesh), or give your model as --loss/--params/--batch")
    if axes and not args.loss and len(axes) != 1:
        raise ValueError(f"a preset splits its blocks over one --model-axis, got {len(axes)}")


def _tensor_parallel(args: argparse.Namespace, params: Any) -> dict[str, Any]:
    """``model_axes`` and ``param_specs`` for :func:`plan_model`/:func:`search_model`: from
    ``--param-specs`` (a user's model) or Megatron's split (a preset); ``{}`` without
    ``--model-axis``."""
    axes = _model_axes(args)
    if axes is None:
        return {}
    if args.param_specs:
        fn = load_callable(args.param_specs, "--param-specs")
        specs = _call(fn, args.param_specs, "--param-specs", **_offer(fn, {"params": params}))
    else:
        specs = models.tensor_parallel_specs(params, next(iter(axes)))
    return {"model_axes": axes, "param_specs": specs}


def _xla_options(pairs: Sequence[str]) -> dict[str, Any]:
    options: dict[str, Any] = {}
    for pair in pairs:
        name, sep, value = pair.partition("=")
        if not sep or not name:
            raise ValueError(f"--xla-option takes NAME=VALUE, got {pair!r}")
        lowered = value.lower()
        options[name] = (lowered == "true") if lowered in ("true", "false") else (
            int(value) if re.fullmatch(r"-?\d+", value) else value)
    return options


# -- MODULE:NAME ------------------------------------------------------------------------------

def _import(module_name: str, flag: str) -> Any:
    """The module ``module_name``: a path to a ``.py`` file (loaded once) or an importable name."""
    if module_name.endswith(".py") or "/" in module_name or "\\" in module_name:
        path = pathlib.Path(module_name)
        if not path.is_file():
            raise ValueError(f"{flag}: no such file {module_name!r}")
        path = path.resolve()
        stem = re.sub(r"\W", "_", path.stem)
        key = f"_jax_drain_user_{stem}_{hashlib.sha1(str(path).encode()).hexdigest()[:8]}"
        if key in sys.modules:
            return sys.modules[key]
        spec = importlib.util.spec_from_file_location(key, path)
        if spec is None or spec.loader is None:
            raise ValueError(f"{flag}: cannot load {module_name!r} as a Python module")
        module = importlib.util.module_from_spec(spec)
        if str(path.parent) not in sys.path:  # the file can import its neighbours, as a script could
            sys.path.insert(0, str(path.parent))
        sys.modules[key] = module
        try:
            spec.loader.exec_module(module)
        except Exception as e:
            del sys.modules[key]
            raise ValueError(f"{flag}: importing {module_name} failed: {type(e).__name__}: {e}") from None
        return module
    try:
        return importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        if e.name and (module_name == e.name or module_name.startswith(e.name + ".")):
            raise ValueError(f"{flag}: no module named {module_name!r} (run from the directory that holds it, "
                             "add that directory to PYTHONPATH, or give the path to the .py file)") from None
        raise ValueError(f"{flag}: importing {module_name} failed: {type(e).__name__}: {e}") from None
    except Exception as e:
        raise ValueError(f"{flag}: importing {module_name} failed: {type(e).__name__}: {e}") from None


def load_callable(spec: str, flag: str) -> Callable[..., Any]:
    """The callable ``MODULE:NAME`` names (``NAME`` may be dotted); a one-line ``ValueError``
    saying what is wrong otherwise."""
    module_name, sep, name = (spec or "").rpartition(":")
    if not sep or not module_name.strip() or not name.strip():
        raise ValueError(f"{flag} takes MODULE:NAME (a module or a path to a .py file, a colon, a function "
                         f"in it), got {spec!r}")
    obj = _import(module_name, flag)
    for part in name.split("."):
        if not hasattr(obj, part):
            public = sorted(k for k, v in vars(_import(module_name, flag)).items()
                            if callable(v) and not k.startswith("_"))[:8]
            raise ValueError(f"{flag}: {module_name} has no attribute {name!r}"
                             + (f" (its functions: {', '.join(public)})" if public else ""))
        obj = getattr(obj, part)
    if not callable(obj):
        raise ValueError(f"{flag}: {spec} is not callable: it is {type(obj).__name__} {obj!r:.60}")
    return obj


def _keywords(fn: Callable[..., Any]) -> set[str] | None:
    """Keyword names ``fn`` accepts; ``None`` when it takes ``**kwargs`` (any)."""
    try:
        parameters = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return set()
    if any(p.kind is p.VAR_KEYWORD for p in parameters):
        return None
    return {p.name for p in parameters if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}


def _offer(fn: Callable[..., Any], offered: dict[str, Any]) -> dict[str, Any]:
    """The keywords of ``offered`` that ``fn`` accepts."""
    accepted = _keywords(fn)
    return dict(offered) if accepted is None else {k: v for k, v in offered.items() if k in accepted}


def _call(fn: Callable[..., Any], spec: str, flag: str, *args: Any, **kwargs: Any) -> Any:
    try:
        return fn(*args, **kwargs)
    except StrategyUnavailable:
        raise
    except Exception as e:
        shown = ", ".join([*("mesh" for _ in args), *(f"{k}={v!r}" for k, v in kwargs.items())])
        raise ValueError(f"{flag}: {spec}({shown}) raised {type(e).__name__}: {e}") from None


def _given_sizes(args: argparse.Namespace) -> dict[str, int]:
    return {k: getattr(args, k) for k in SIZE_KEYWORDS if getattr(args, k) is not None}


def _refuse_unused(given: dict[str, Any], used: set[str], where: str) -> None:
    unused = [k for k in given if k not in used]
    if unused:
        flags = ", ".join("--" + k.replace("_", "-") for k in unused)
        names = " or ".join(f"`{k}`" for k in unused)
        raise ValueError(f"{flags} given, but {where} has no {names} parameter to receive it")


def _user_model(args: argparse.Namespace) -> tuple[Callable[..., Any], Any, Any, str]:
    """``(loss_fn, params, batch, name)`` of ``--loss/--params/--batch``, the size flags offered to
    PARAMS and BATCH."""
    missing = [flag for flag, value in (("--loss", args.loss), ("--params", args.params), ("--batch", args.batch))
               if not value]
    if missing:
        raise ValueError(f"your model needs --loss, --params and --batch (MODULE:NAME each); {', '.join(missing)} "
                         "missing")
    loss_fn = load_callable(args.loss, "--loss")
    params_fn = load_callable(args.params, "--params")
    batch_fn = load_callable(args.batch, "--batch")
    slices, hosts, gpus = parse_topology(args.topology)
    given = _given_sizes(args)
    offered = {**given, "num_devices": slices * hosts * gpus}
    values, used = {}, set()
    for flag, spec, fn in (("--params", args.params, params_fn), ("--batch", args.batch, batch_fn)):
        kwargs = _offer(fn, offered)
        used |= set(kwargs)
        value = _call(fn, spec, flag, **kwargs)
        if value is None:
            raise ValueError(f"{flag}: {spec}() returned None; it must return a pytree of arrays or "
                             "jax.ShapeDtypeStructs")
        values[flag] = abstract_tree(value, f"{flag}: {spec}()")
    _refuse_unused(given, used, f"neither {args.params} nor {args.batch}")
    name = args.loss.rpartition(":")[0]
    return loss_fn, values["--params"], values["--batch"], pathlib.Path(name).stem if name.endswith(".py") else name


def _plan_user_model(args: argparse.Namespace, strategies: list[str] | None, options: dict[str, Any]) -> Comparison:
    loss_fn, params, batch, name = _user_model(args)
    return plan_model(
        loss_fn, params, batch, strategies or DEFAULT_STRATEGIES,
        target=args.target, topology=args.topology, bucket_size=args.bucket_size,
        num_buckets=None if args.bucket_size else _num_buckets_arg(args), compiler_options=options or None,
        scan=True if args.scan_layers else None, name=name, progress=not args.quiet,
        **_tensor_parallel(args, params),
    )


def _plan_preset_tensor_parallel(args: argparse.Namespace, strategies: list[str] | None,
                                 options: dict[str, Any]) -> Comparison:
    """A preset on a tensor-parallel mesh: :func:`plan_model` of its loss, its blocks split
    Megatron's way, with each data-parallel device's ``--micro-batch`` sequences."""
    config = _preset(args)
    params = models.abstract_params(config)
    tp = _tensor_parallel(args, params)
    slices, hosts, gpus = parse_topology(args.topology)
    data = slices * hosts * gpus // math.prod(tp["model_axes"].values())
    batch = models.example_batch(config, (args.micro_batch or 1) * max(1, data))
    return plan_model(
        models.make_loss(config), params, batch, strategies or ("fp32_accum+drain",),
        target=args.target, topology=args.topology, bucket_size=args.bucket_size,
        num_buckets=None if args.bucket_size else _num_buckets_arg(args), compiler_options=options or None,
        scan=True if config.scan_layers else None, name=f"preset {args.preset}", progress=not args.quiet, **tp,
    )


def _search(args: argparse.Namespace, strategies: list[str] | None, options: dict[str, Any]) -> int:
    """``--memory-budget``: the search's table (and JSON, plot); exit 2 when nothing fits."""
    for flag, given in (("--strategy", strategies), ("--bucket-size", args.bucket_size), ("--step", args.step)):
        if given:
            raise ValueError(f"--memory-budget searches the strategies and bucket sizes itself: leave out {flag} "
                             "(--num-buckets sets where it starts; --step cannot be searched, give --loss)")
    budget = round(args.memory_budget * 2**20)
    common = dict(num_buckets=_num_buckets_arg(args), max_compiles=args.max_compiles or 24, target=args.target,
                  topology=args.topology, compiler_options=options or None, progress=not args.quiet,
                  scan=True if args.scan_layers else None)
    try:
        if args.loss or args.params or args.batch:
            loss_fn, params, batch, name = _user_model(args)
            found = search_model(loss_fn, params, batch, budget, name=name, **common,
                                 **_tensor_parallel(args, params))
        else:
            config = _preset(args)
            found = search_preset(config, budget, micro_batch=args.micro_batch or 1,
                                  **{**common, "name": f"preset {args.preset}"},
                                  **_tensor_parallel(args, models.abstract_params(config)))
    except BudgetTooSmall as e:
        if args.json:
            _write_json(args.json, e.search.to_json() if e.search is not None else _empty_search(budget, e))
        print(f"error: {_one_line(e)}", file=sys.stderr)
        return 2
    print(found)
    if args.json:
        _write_json(args.json, found.to_json())
    if args.plot:
        print(f"wrote {found.plot(args.plot)}")
    return 0


def _empty_search(budget: int, e: BudgetTooSmall) -> dict[str, Any]:
    """The JSON of a search that compiled nothing (the arguments alone were over the budget)."""
    return {"rows": [], "choice": None, "memory_budget_bytes": budget, "floor": None, "compiles": 0,
            "compile_s": 0.0, "search_s": 0.0, "pruned": [], "stopped": _one_line(e)}


def _write_json(path: str, value: Any) -> None:
    with open(path, "w") as f:
        json.dump(value, f, indent=1)
    print(f"wrote {pathlib.Path(path).absolute()}")


def _plan_user_step(args: argparse.Namespace, strategies: list[str] | None, options: dict[str, Any]) -> Comparison:
    make = load_callable(args.step, "--step")
    accepted = _keywords(make)
    takes_strategy = accepted is None or "strategy" in accepted
    if strategies and not takes_strategy:
        raise ValueError(f"--step: {args.step} has no `strategy` parameter, so --strategy cannot reach it; add "
                         "one (it receives a jax_drain.plan.Strategy)")
    given = _given_sizes(args)
    given.update({k: getattr(args, k) for k in ("bucket_size", "num_buckets") if getattr(args, k) is not None})
    offered = _offer(make, given)
    _refuse_unused(given, set(offered), args.step)
    slices, hosts, gpus = parse_topology(args.topology)
    mesh = gpu_mesh((slices * hosts * gpus,), ("data",), target=args.target, topology=args.topology)
    rows = []
    names = (strategies or DEFAULT_STRATEGIES) if takes_strategy else ("step",)
    shown = Progress(not args.quiet, len(names), f"{args.step} on {_devices(args)}")
    for k, name in enumerate(names):
        kwargs = {**offered, **({"strategy": Strategy.parse(name)} if takes_strategy else {})}
        try:
            out = _call(make, args.step, "--step", mesh, **kwargs)
        except StrategyUnavailable as e:  # the step says it cannot build this strategy
            shown.unavailable(k, name)
            rows.append(Row(name, unavailable=str(e)))
            continue
        step, step_args, sync = _step_parts(out, args.step)
        shown.compiling(k, name)
        try:
            report = plan(step, *step_args, target=args.target, topology=args.topology,
                          compiler_options=options or None, scope=SCOPE_PREFIX,
                          strategy=name, num_buckets=total_buckets(sync) if hasattr(sync, "chains") else None,
                          bucket_size=args.bucket_size)
        except BaseException:
            shown.failed()
            raise
        shown.compiled(report.temp_bytes)
        rows.append(Row(name, report))
    return Comparison(tuple(rows), args.target, args.topology, mesh.size, args.step)


def _step_parts(out: Any, spec: str) -> tuple[Callable[..., Any], tuple[Any, ...], Any]:
    shape = "it must return (jitted_step, abstract_args) or (jitted_step, abstract_args, sync)"
    if out is None:
        raise ValueError(f"--step: {spec}(mesh) returned None; {shape}")
    if not isinstance(out, (tuple, list)) or len(out) not in (2, 3):
        raise ValueError(f"--step: {spec}(mesh) returned a {type(out).__name__}; {shape}")
    step, step_args, sync = (*out, None) if len(out) == 2 else out
    if not callable(step):
        raise ValueError(f"--step: {spec}(mesh) returned a {type(step).__name__} as its step; {shape}")
    if not isinstance(step_args, (tuple, list)):
        raise ValueError(f"--step: {spec}(mesh) returned a {type(step_args).__name__} as abstract_args, not a "
                         f"tuple of the step's arguments; {shape}")
    return step, tuple(step_args), sync


def _compare_preset(args: argparse.Namespace, strategies: list[str], options: dict[str, Any]) -> Comparison:
    config = _preset(args)
    slices, hosts, gpus = parse_topology(args.topology)
    params = models.abstract_params(config)
    batch = models.example_batch(config, (args.micro_batch or 1) * slices * hosts * gpus)
    model = f"preset {args.preset}: {describe_model(params, batch)}"
    shown = Progress(not args.quiet, len(strategies), f"{model} on {_devices(args)}")
    rows = []
    for k, name in enumerate(strategies):
        shown.compiling(k, name)
        try:
            report = plan_preset(config, name, args.target, args.topology, bucket_size=args.bucket_size,
                                 num_buckets=None if args.bucket_size else _num_buckets_arg(args),
                                 micro_batch=args.micro_batch or 1, compiler_options=options)
        except StrategyUnavailable as e:
            shown.failed("not available (see its row)")
            rows.append(Row(name, unavailable=str(e)))
            continue
        except BaseException:
            shown.failed()
            raise
        shown.compiled(report.temp_bytes)
        rows.append(Row(name, report))
    return Comparison(tuple(rows), args.target, args.topology, slices * hosts * gpus, model, largest_leaf(params))


def run() -> NoReturn:
    """The command line: plan on compile-only devices, never touching a local GPU."""
    jax.config.update("jax_platforms", "cpu")
    sys.exit(main())


if __name__ == "__main__":
    run()
