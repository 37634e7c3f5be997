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
