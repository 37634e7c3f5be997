"""The compile-only planner: what a training step costs on XLA's GPU compiler, without a GPU.

Not part of the runtime (``jax_drain`` itself never imports it):

* :mod:`jax_drain.planner.targets`: GPU target configs, compile-only GPU devices and meshes
  (needs the CUDA PJRT plugin, ``pip install -e '.[gpu-compile]'``);
* :mod:`jax_drain.planner.schedule`: the parser of XLA's scheduled HLO;
* :mod:`jax_drain.planner.plan`: compile a step for a target, report memory and schedule;
* :mod:`jax_drain.planner.cli`: ``python -m jax_drain.plan``.

:mod:`jax_drain.plan` is the public entry: it re-exports the planner's public names.
"""
