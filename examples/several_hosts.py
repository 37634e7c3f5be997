"""Training on several hosts: data parallel over the hosts, tensor parallel within each host.

Every host runs this same script (one process per host, all of its accelerators). The
processes find each other through ``jax.distributed.initialize``:

* under SLURM (``srun python examples/several_hosts.py --ckpt /shared/run1``) JAX reads the job's
  variables itself;
* under a ``torchrun``-like launcher, set ``MASTER_ADDR``, ``MASTER_PORT``, ``RANK`` and
  ``WORLD_SIZE`` on every host (the coordinator is host 0).

The mesh is ``(data = hosts, model = accelerators per host)``: the model's declared shardings
(``nnx.with_partitioning``) split each weight over the host's own devices, and jax_drain reduces
the gradients over the hosts in drained, fp32-accumulated buckets. Each host reads only its own
rows of the batch (``step.local_batch``) and the checkpoint goes to a directory every host sees;
each host writes the shards it holds. ``jd.watch_peers`` ends every host, naming the one that
died, if a host dies: without it the others would wait in a collective until JAX's heartbeat
timeout aborts them.

Try it on one machine, as 2 "hosts" of 4 CPU devices each::

    python examples/several_hosts.py --local 2 --ckpt /tmp/several_hosts
"""

from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
import time

import numpy as np


def initialize() -> None:
    """Joins the other processes: SLURM is detected by JAX; a torchrun-like launch names the
    coordinator in ``MASTER_ADDR``/``MASTER_PORT``; neither means one process."""
    import jax

    env = os.environ
    if "MASTER_ADDR" in env:
        if env.get("JAX_PLATFORMS") == "cpu":
            jax.config.update("jax_cpu_collectives_implementation", "gloo")
        jax.distributed.initialize(coordinator_address=f"{env['MASTER_ADDR']}:{env['MASTER_PORT']}",
                                   num_processes=int(env["WORLD_SIZE"]), process_id=int(env["RANK"]))
    elif "SLURM_NTASKS" in env and int(env["SLURM_NTASKS"]) > 1:
        jax.distributed.initialize()


def train(ckpt: str, steps: int) -> None:
    import jax
    import jax.numpy as jnp
    import optax
    from flax import nnx

    import jax_drain as jd

    initialize()
    hosts, per_host = jax.process_count(), jax.local_device_count()
    mesh = jax.make_mesh((hosts, per_host), ("data", "model"))
    shard = lambda names: nnx.with_partitioning(nnx.initializers.lecun_normal(), names)  # noqa: E731

    class MLP(nnx.Module):  # written for global shapes; its weights declare their shardings
        def __init__(self, rngs: nnx.Rngs):
            self.up = nnx.Linear(32, 128, kernel_init=shard((None, "model")), rngs=rngs)
            self.down = nnx.Linear(128, 32, kernel_init=shard(("model", None)), rngs=rngs)

        def __call__(self, x):
            return self.down(nnx.gelu(self.up(x)))

    def loss_fn(model, batch):
        return jnp.mean((model(batch["x"]) - batch["y"]) ** 2)

    with jax.set_mesh(mesh):
        model = MLP(nnx.Rngs(0))
    rows = 16  # this host's rows of each batch
    rng = np.random.default_rng(1000 + jax.process_index())  # each host reads its own data

    def my_rows():
        x = rng.normal(size=(rows, 32)).astype(np.float32)
        return {"x": x, "y": np.tanh(x)}

    step = jd.make_train_step(model, loss_fn, optax.adamw(1e-2), mesh, jd.TrainConfig(bucket_size=2048),
                              example_batch=jd.global_batch_shape(my_rows()))
    state = step.init()
    if jd.latest_step(ckpt) is not None:  # resume: any host count that divides the batch
        state, _ = jd.restore_checkpoint(ckpt, step.abstract_state())
    with jd.watch_peers(timeout_seconds=60):  # a dead host ends the others within ~70 s, named
        for _ in range(steps):
            state, metrics = step(state, step.local_batch(my_rows()))
        jd.save_checkpoint(ckpt, state)
    if jax.process_index() == 0:
        print(f"{hosts} hosts x {per_host} devices: step {int(state.step)}, loss {float(metrics.loss):.4f}, "
              f"checkpoint {ckpt}/{int(state.step)}; up.kernel held as {state.params['up']['kernel'].addressable_shards[0].data.shape} "
              f"blocks of {state.params['up']['kernel'].shape}")


def launch_local(n: int, argv: list[str]) -> int:
    """Starts ``n`` processes of this script on this machine, 4 CPU devices each, as a
    torchrun-like launcher would, and waits for them (one failing stops the others: they would
    wait for it in a collective)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = []
    for rank in range(n):
        env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": str(rank),
               "WORLD_SIZE": str(n), "JAX_PLATFORMS": "cpu", "XLA_FLAGS": "--xla_force_host_platform_device_count=4"}
        procs.append(subprocess.Popen([sys.executable, __file__, *argv], env=env))
    try:
        while True:
            codes = [p.poll() for p in procs]
            if any(c not in (None, 0) for c in codes) or all(c == 0 for c in codes):
                return max(c or 0 for c in codes)
            time.sleep(0.2)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--ckpt", required=True, help="checkpoint directory every host can write")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--local", type=int, metavar="N", help="run N processes on this machine (CPU)")
    args = parser.parse_args()
    if args.local:
        return launch_local(args.local, ["--ckpt", args.ckpt, "--steps", str(args.steps)])
    train(args.ckpt, args.steps)
    return 0


if __name__ == "__main__":
    sys.exit(main())
