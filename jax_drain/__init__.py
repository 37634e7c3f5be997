"""jax_drain: bucketed, drained, fp32-accumulated data-parallel gradient sync for JAX meshes.

The JAX counterpart of Megatron-LM's distributed data parallel with
``reduce_scatter_with_fp32_accumulation`` and "drain predecessor reduce-scatter at dispatch
time" (Megatron-LM PR #4940). See README.md for a tour.
"""

from jax_drain.collectives import REDUCE_MODES, reduce_scatter_bucket
from jax_drain.drain import sequenced_map
from jax_drain.layout import Bucket, BucketLayout, LeafSlot
from jax_drain.order import grad_ready_order
from jax_drain.sync import GradSync, local_params

__version__ = "0.1.0"

__all__ = [
    "Bucket",
    "BucketLayout",
    "GradSync",
    "LeafSlot",
    "REDUCE_MODES",
    "grad_ready_order",
    "local_params",
    "reduce_scatter_bucket",
    "sequenced_map",
]

# Distributed optimizer, train step and checkpoints (issue 4).
from jax_drain.checkpoint import CheckpointMismatchError, restore_checkpoint, save_checkpoint  # noqa: E402
from jax_drain.optimizer import DistributedOptimizer, DistState, clip_by_global_norm, global_norm, masked  # noqa: E402
from jax_drain.train import TrainConfig, TrainState, TrainStep, make_train_step  # noqa: E402

__all__ += [
    "CheckpointMismatchError", "DistState", "DistributedOptimizer", "TrainConfig", "TrainState",
    "TrainStep", "clip_by_global_norm", "global_norm", "make_train_step", "masked",
    "restore_checkpoint", "save_checkpoint",
]

# Scan-over-layers models: per-layer reduce-scatter inside the backward scan (issue 7).
from jax_drain.scan import ScanGradSync, ScanShards, stacked_leaves  # noqa: E402

__all__ += ["ScanGradSync", "ScanShards", "stacked_leaves"]

# Real meshes: tensor parallel, hierarchical (outer_axis), expert chains (issue 5).
from jax_drain.sync import Shards  # noqa: E402

__all__ += ["Shards"]
