"""Test harnesses, not part of the runtime: :mod:`jax_drain.testing.multiprocess` runs the
multi-process check (launcher, worker, comparison) under ``jax.distributed``."""
