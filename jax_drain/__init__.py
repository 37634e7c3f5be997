"""jax_drain: bucketed, drained, fp32-accumulated data-parallel gradient sync for JAX meshes.

The JAX counterpart of Megatron-LM's distributed data parallel with
``reduce_scatter_with_fp32_accumulation`` and "drain predecessor reduce-scatter at dispatch
time" (Megatron-LM PR #4940). See README.md for a tour and BUILD.md for the architecture.
"""

from jax_drain import _quiet

_quiet.start()  # before jax starts: no CUDA-plugin noise where there is no GPU (see jax_drain/_quiet.py)

from jax_drain.chain import BucketChain
from jax_drain.checkpoint import (
    CheckpointBusyError, CheckpointCorruptError, CheckpointMismatchError, CheckpointSaveError,
    CheckpointStepExistsError, latest_step,
    restore_checkpoint, save_checkpoint, save_checkpoint_async,
)
from jax_drain.collectives import REDUCE_MODES, reduce_scatter_bucket
from jax_drain.drain import sequenced_map
from jax_drain.layout import Bucket, BucketLayout, LeafSlot
from jax_drain.losses import WeightedLoss
from jax_drain.optimizer import (
    DistributedOptimizer, DistState, FlatShards, adamw, clip_by_global_norm, global_norm, masked,
)
from jax_drain.order import grad_ready_order, remat_groups
from jax_drain.peers import PEER_FAILURE_EXIT, PeerWatch, watch_peers
from jax_drain.scan import ScanGradSync, ScanShards, stacked_leaves
from jax_drain.shardings import declared_specs
from jax_drain.sync import GradSync, Shards, local_params
from jax_drain.train import StepMetrics, TrainConfig, TrainState, TrainStep, global_batch_shape, make_train_step

__version__ = "0.1.0"

__all__ = [
    "Bucket",
    "BucketChain",
    "BucketLayout",
    "CheckpointBusyError",
    "CheckpointCorruptError",
    "CheckpointMismatchError",
    "CheckpointSaveError",
    "CheckpointStepExistsError",
    "DistState",
    "DistributedOptimizer",
    "FlatShards",
    "GradSync",
    "LeafSlot",
    "PEER_FAILURE_EXIT",
    "PeerWatch",
    "REDUCE_MODES",
    "ScanGradSync",
    "ScanShards",
    "Shards",
    "StepMetrics",
    "TrainConfig",
    "TrainState",
    "TrainStep",
    "WeightedLoss",
    "adamw",
    "clip_by_global_norm",
    "declared_specs",
    "global_norm",
    "grad_ready_order",
    "latest_step",
    "local_params",
    "global_batch_shape",
    "make_train_step",
    "masked",
    "reduce_scatter_bucket",
    "remat_groups",
    "restore_checkpoint",
    "save_checkpoint",
    "save_checkpoint_async",
    "sequenced_map",
    "stacked_leaves",
    "watch_peers",
]


def __getattr__(name: str):
    # ``jd.plan``: the compile-only planner, imported on first use only (the runtime never loads it).
    if name == "plan":
        import importlib

        return importlib.import_module("jax_drain.plan")
    raise AttributeError(f"module 'jax_drain' has no attribute {name!r}")
