"""Plan a training step on XLA's GPU compiler before renting GPUs: the planner's public entry.

Re-exports the public names of :mod:`jax_drain.planner` (``plan``, ``plan_preset``, ``Plan``,
``Strategy``, ``gpu_mesh``, ...); see :mod:`jax_drain.planner.plan`. CLI::

    python -m jax_drain.plan --preset gpt-blocks --strategy fp32_accum+drain --num-buckets 24 \\
        --json plan.json --plot plan.png
    python -m jax_drain.plan --loss my_model.py:loss --params my_model.py:params --batch my_model.py:batch

Python: ``print(plan_model(loss_fn, params, batch))`` compares the strategies on your model
(:mod:`jax_drain.planner.compare`) and prints the table and the verdict, with one progress line
per strategy on stderr while it compiles. ``search_model(loss_fn, params, batch, 600 * 2**20)``
(:mod:`jax_drain.planner.search`; CLI ``--memory-budget 600``) finds the configuration with the
lowest predicted step whose memory fits the budget. This module is also reachable as
``jd.plan`` after ``import jax_drain as jd``. With the ``gpu-compile`` extra installed it needs no environment variables: on a
machine without a GPU, ``import jax_drain`` registers the CUDA plugin for compile-only devices.
"""

from jax_drain.planner.cli import main
from jax_drain.planner.compare import DEFAULT_STRATEGIES, Comparison, Row, plan_model
from jax_drain.planner.plan import (
    BASELINES,
    CHAIN_SCOPES,
    BucketRef,
    Plan,
    PlanError,
    Strategy,
    StrategyUnavailable,
    bucket_size_for,
    bucket_spans,
    build_mesh_step,
    build_step,
    build_user_step,
    collective_buckets,
    collective_counts,
    max_overlap,
    mesh_block_loss,
    mesh_block_params,
    mesh_block_specs,
    plan,
    plan_preset,
    preset_config,
    split_supported,
    summarize_collectives,
)
from jax_drain.planner.search import (
    DEFAULT_CANDIDATES,
    SEARCH_MODES,
    BudgetTooSmall,
    Candidate,
    Pruned,
    Search,
    SearchRow,
    search_model,
    search_preset,
)
from jax_drain.planner.targets import (
    KNOWN_TARGETS,
    GpuCompileUnavailable,
    gpu_compile_available,
    gpu_devices,
    gpu_mesh,
    parse_topology,
    target_config,
)

__all__ = [
    "BASELINES",
    "CHAIN_SCOPES",
    "KNOWN_TARGETS",
    "BucketRef",
    "BudgetTooSmall",
    "Candidate",
    "Comparison",
    "DEFAULT_CANDIDATES",
    "DEFAULT_STRATEGIES",
    "GpuCompileUnavailable",
    "Plan",
    "PlanError",
    "Pruned",
    "Row",
    "SEARCH_MODES",
    "Search",
    "SearchRow",
    "Strategy",
    "StrategyUnavailable",
    "bucket_size_for",
    "bucket_spans",
    "build_mesh_step",
    "build_step",
    "build_user_step",
    "collective_buckets",
    "collective_counts",
    "gpu_compile_available",
    "gpu_devices",
    "gpu_mesh",
    "main",
    "max_overlap",
    "mesh_block_loss",
    "mesh_block_params",
    "mesh_block_specs",
    "parse_topology",
    "plan",
    "plan_model",
    "plan_preset",
    "preset_config",
    "search_model",
    "search_preset",
    "split_supported",
    "summarize_collectives",
    "target_config",
]

if __name__ == "__main__":
    from jax_drain.planner.cli import run

    run()
