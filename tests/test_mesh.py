"""GradSync on real meshes: tensor parallel, hierarchical (replica x data), expert params.

Values against float64 references computed from the same inputs; the schedule on XLA's GPU
compiler (compile-only 2-host meshes); clear errors for wrong axis declarations.

The value checks are plain functions of a device list so that tests/test_gpu_devices.py runs
them unchanged on real GPUs.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, PartitionSpec as P

import jax_drain as jd
from jax_drain import _compat
from jax_drain.planner import plan
from jax_drain.planner.schedule import parse_schedule
from jax_drain.planner.targets import gpu_mesh
from jax_drain.sync import EXPERT_SCOPE, SCOPE_PREFIX, Shards

from helpers import (
    DEVICE_SUM_RTOL, assert_bf16_sum_close, assert_padding_zero, assert_tree_close, assert_within_rounding, leaves_of, random_tree,
    rounding_chain, scale_by,
)

SDS = jax.ShapeDtypeStruct
BF16, F32 = jnp.bfloat16, jnp.float32

# Every kind of leaf: replicated, column/row tensor parallel, a float32 norm, stacked experts.
PARAMS = {
    "embed": SDS((40, 16), BF16),
    "layers": [
        {
            "w_in": SDS((16, 32), BF16),
            "w_out": SDS((32, 16), BF16),
            "norm": SDS((16,), F32),
            "experts": SDS((4, 16, 8), BF16),
        }
        for _ in range(2)
    ],
    "head": SDS((16, 10), BF16),
    # Odd sizes: a final norm (float32, 13) and a bf16 (3, 5, 7) block.
    "final_norm": SDS((13,), F32),
    "pos": SDS((3, 5, 7), BF16),
}
TP_SPECS = {"layers": [{"w_in": P(None, "model"), "w_out": P("model", None), "norm": None,
                        "experts": None} for _ in range(2)], "embed": None, "head": None,
            "final_norm": None, "pos": None}
IS_EXPERT = lambda path: "/experts" in path


def mesh_kinds(devices) -> dict[str, tuple[Mesh, dict]]:
    """Mesh kind -> (mesh, GradSync keyword arguments) over ``devices`` (a multiple of 4 >= 4,
    or 2: then every kind still runs, with some axes of size 1)."""
    n = len(devices)
    d = np.array(devices)
    if n < 2 or (n > 2 and n % 4):
        raise ValueError(f"mesh kinds need 2 or a multiple of 4 devices, got {n}")
    half, q, r = n // 2, max(n // 4, 1), 2 if n >= 4 else 1  # r * q * 2 == n
    moe_specs = {**TP_SPECS, "layers": [{**TP_SPECS["layers"][0], "w_in": None, "w_out": None,
                                         "experts": P("expert")} for _ in range(2)]}
    moe_tp_specs = {**TP_SPECS, "layers": [{**TP_SPECS["layers"][0], "experts": P("expert", None, "model")}
                                           for _ in range(2)]}
    return {
        "dp": (Mesh(d, ("data",)), {}),
        "tp": (Mesh(d.reshape(half, 2), ("data", "model")), dict(param_specs=TP_SPECS)),
        "hier": (Mesh(d.reshape(2, half), ("replica", "data")), dict(outer_axis="replica")),
        "hier_tp": (Mesh(d.reshape(r, q, 2), ("replica", "data", "model")),
                    dict(outer_axis="replica", param_specs=TP_SPECS)),
        "moe": (Mesh(d.reshape(half, 2), ("data", "expert")),
                dict(axis=("data", "expert"), param_specs=moe_specs, expert=IS_EXPERT, expert_axis="data")),
        # 8 devices: 2 x 2 x 2 x 1; the model axis only checks that a size-1 TP axis is harmless.
        "moe_hier_tp": (Mesh(d.reshape(r, q, 2, 1), ("replica", "data", "expert", "model")),
                        dict(axis=("data", "expert"), outer_axis="replica", param_specs=moe_tp_specs,
                             expert=IS_EXPERT, expert_axis="data")),
    }


# -- float64 reference of GradSync.reduce_scatter, per leaf ------------------------------------

# Gradient scales: in each dtype, leaves of ~1e-3 share buckets with leaves of ~1 (the layer
# norms next to the final norm, the (3, 5, 7) block next to the embedding).
SCALES = scale_by({"/norm": 1e-3, "pos": 1e-3, "layers/1/experts": 1e-2, "head": 30.0})


def random_grads(rng: np.random.Generator, sync: jd.GradSync, mesh: Mesh):
    """Different random gradients on every device: leaves shaped ``(*mesh.shape, *local_shape)``."""
    return random_tree(rng, sync.local_shapes, leading=tuple(mesh.shape.values()), scale=SCALES)


def chains(sync: jd.GradSync):
    """(layout, full-tree leaf indices, inner axes) per chain, dense first."""
    out = [(sync.layout, sync.dense_leaves, sync.axes)]
    if sync.expert_layout is not None:
        out.append((sync.expert_layout, sync.expert_leaves, sync.expert_axes))
    return out


def out_spec(mesh: Mesh, sync: jd.GradSync, inner: tuple[str, ...]) -> P:
    """Shards split over ``inner`` after every axis that is not reduced (mesh order)."""
    return P(others_of(mesh, sync, inner) + inner)


def others_of(mesh: Mesh, sync: jd.GradSync, inner: tuple[str, ...]) -> tuple[str, ...]:
    """The mesh axes a chain does not reduce over (its buckets differ along them)."""
    return tuple(a for a in mesh.axis_names if a not in inner + sync.outer_axes)


def run_reduce_scatter(sync: jd.GradSync, grads, mesh: Mesh) -> list[list[np.ndarray]]:
    """Per chain, per bucket: the gathered shards reshaped to ``(*other axes, bucket size)``."""
    lead = len(mesh.axis_names)

    def step(stacked):
        return sync.reduce_scatter(jax.tree.map(lambda g: g.reshape(g.shape[lead:]), stacked))

    specs = [out_spec(mesh, sync, inner) for _, _, inner in chains(sync)]
    out_specs = specs[0] if len(specs) == 1 else Shards(*specs)
    out = jax.jit(_compat.shard_map(step, mesh=mesh, in_specs=P(*mesh.axis_names), out_specs=out_specs))(grads)
    per_chain = [out] if len(specs) == 1 else list(out)
    result = []
    for (layout, _, inner), shards in zip(chains(sync), per_chain):
        others = [mesh.shape[a] for a in others_of(mesh, sync, inner)]
        result.append([np.asarray(s).reshape(*others, size) for s, size in zip(shards, layout.bucket_sizes)])
    return result


def _device_views(mesh: Mesh, axes: tuple[str, ...]):
    """(label, mesh index) of one device per distinct position along ``axes``."""
    seen = {}
    for idx in np.ndindex(*mesh.shape.values()):
        at = dict(zip(mesh.axis_names, idx))
        label = ",".join(f"{a}={at[a]}" for a in axes) or "all"
        seen.setdefault(label, at)
    return seen.items()


def result_leaves(sync: jd.GradSync, out, mesh: Mesh) -> dict[str, object]:
    """The reduced gradient tree seen by each distinct device (``label -> tree``, float64): its
    chains' whole buckets through ``sync.unflatten``. Padding is checked to be zero."""
    per_chain = [others_of(mesh, sync, inner) for _, _, inner in chains(sync)]
    axes = tuple(a for a in mesh.axis_names if any(a in o for o in per_chain))
    trees = {}
    for (layout, _, _), buckets in zip(chains(sync), out):
        assert_padding_zero(layout, buckets)
    for label, at in _device_views(mesh, axes):
        mine = [[b[tuple(at[a] for a in others)] for b in buckets] for others, buckets in zip(per_chain, out)]
        trees[label] = leaves_of(sync, mine[0] if len(mine) == 1 else Shards(*mine))
    return trees


def _names(spec) -> tuple[str, ...]:
    return () if spec is None else (spec,) if isinstance(spec, str) else tuple(spec)


def reduced_axes(kwargs: dict, path: str) -> tuple[str, ...]:
    """The mesh axes leaf ``path``'s gradient is summed over, from the GradSync arguments alone:
    ``expert_axis`` for expert leaves, else ``axis``; and ``outer_axis``."""
    expert = kwargs.get("expert")
    inner = kwargs["expert_axis"] if expert is not None and expert(path) else kwargs.get("axis", "data")
    return _names(inner) + _names(kwargs.get("outer_axis"))


def reference(kwargs: dict, grads, mesh: Mesh, average: bool = True):
    """float64 per leaf: each leaf summed over its :func:`reduced_axes`, divided by the number of
    data-parallel devices (``axis`` x ``outer_axis``) when averaging. Returns ``label -> tree``
    like :func:`result_leaves`, and the per-element magnitudes (the same sums of |g|)."""
    reduced = [reduced_axes(kwargs, path) for path in jd.layout.leaf_paths(grads)]
    dp_axes = _names(kwargs.get("axis", "data")) + _names(kwargs.get("outer_axis"))
    divisor = math.prod(mesh.shape[a] for a in dp_axes) if average else 1
    views = _device_views(mesh, tuple(a for a in mesh.axis_names if any(a not in r for r in reduced)))
    lead = len(mesh.axis_names)

    def per_view(absolute: bool) -> dict[str, object]:
        sums = []
        for g, axes in zip(jax.tree.leaves(grads), reduced):
            g = np.asarray(g, np.float64)
            dims = tuple(i for i, a in enumerate(mesh.axis_names) if a in axes)
            sums.append((np.abs(g) if absolute else g).sum(axis=dims, keepdims=True) / divisor)
        full = jax.tree.unflatten(jax.tree.structure(grads), sums)
        # A device's view: its own index along the axes a leaf is not reduced over.
        pick = lambda x, at: x[tuple(0 if x.shape[d] == 1 else at[a] for d, a in enumerate(mesh.axis_names))]
        return {label: jax.tree.map(lambda x: pick(x, at).reshape(x.shape[lead:]), full) for label, at in views}

    return per_view(False), per_view(True)


def reduced_count(kwargs: dict, mesh: Mesh, path: str) -> int:
    """How many devices' gradients one element of leaf ``path`` sums."""
    return math.prod(mesh.shape[a] for a in reduced_axes(kwargs, path))


def assert_mesh_close(got, ref, magnitude, rtol: float, what: str, paths=None, atol: float | None = None
                      ) -> dict[str, float]:
    """Per device view and leaf: :func:`helpers.assert_tree_close` with the per-element bound
    ``atol`` (default ``rtol``) x sum of |g|; ``paths`` limits it to those leaves."""
    bound = {label: jax.tree.map(lambda m: (rtol if atol is None else atol) * m, t) for label, t in magnitude.items()}
    return assert_tree_close(_pick(got, paths), _pick(ref, paths), rtol, atol=_pick(bound, paths), what=what)


def _pick(trees, paths=None):
    """``{label: {path: leaf}}`` of each device view's leaves, those in ``paths`` if given."""
    keep = lambda p: paths is None or p in paths
    return {label: {p: x for p, x in zip(jd.layout.leaf_paths(t), jax.tree.leaves(t)) if keep(p)}
            for label, t in trees.items()}


def check_values(kind: str, devices, seed: int = 0) -> None:
    """reduce_scatter of random per-device grads vs float64, per leaf, for one mesh kind: fp32
    modes to DEVICE_SUM_RTOL, bf16 leaves visibly rounded by bf16 (float32 leaves not), the drain
    bit-identical to no drain."""
    mesh, kwargs = mesh_kinds(devices)[kind]
    grads = None
    results, got, errors = {}, {}, {}
    for reduce, drain in (("fp32_accum", True), ("fp32_accum", False), ("fp32", True), ("bf16", True)):
        sync = jd.GradSync(PARAMS, mesh, bucket_size=600, reduce=reduce, drain=drain, **kwargs)
        if grads is None:
            grads = random_grads(np.random.default_rng(seed), sync, mesh)
            ref, magnitude = reference(kwargs, grads, mesh)
            assert sync.num_buckets >= 2
        results[reduce, drain] = out = run_reduce_scatter(sync, grads, mesh)
        assert [[o.shape[-1] for o in c] for c in out] == [list(lay.bucket_sizes) for lay, _, _ in chains(sync)]
        got[reduce, drain] = result_leaves(sync, out, mesh)
    for mode in ("fp32_accum", "fp32"):
        errors[mode] = assert_mesh_close(got[mode, True], ref, magnitude, DEVICE_SUM_RTOL, f"{kind} {mode}")
    paths = jd.layout.leaf_paths(PARAMS)
    dtype_of = dict(zip(paths, (t.dtype for t in jax.tree.leaves(PARAMS))))
    bf16_paths = {p for p in paths if dtype_of[p] == BF16}
    f32_paths = set(paths) - bf16_paths
    # bf16 mode: bf16 buckets summed in bf16, within bf16's precision (a sum of at most the 8
    # devices' terms, rounded at each step of a ring on GPUs, and the mean's division), float32
    # ones in float32.
    bf16_err = assert_bf16_sum_close(_pick(got["bf16", True], bf16_paths), _pick(ref, bf16_paths),
                                     _pick(magnitude, bf16_paths), roundings=len(devices),
                                     what=f"{kind} bf16, bf16 leaves")
    assert_mesh_close(got["bf16", True], ref, magnitude, DEVICE_SUM_RTOL, f"{kind} bf16, float32 leaves", f32_paths)
    for key, err in bf16_err.items():  # label/path: measurably worse than fp32 where bf16 sums
        if reduced_count(kwargs, mesh, key.split("/", 1)[1]) > 1:
            fp32_worst = max(errors[mode][key] for mode in errors)
            assert err > 1e-4 and err > 100 * fp32_worst, (key, err, fp32_worst)
    for a, b in zip(results["fp32_accum", True], results["fp32_accum", False]):  # drain: schedule only
        for x, y in zip(a, b):
            np.testing.assert_array_equal(x, y)


# "dp" (a 1-D data mesh) is tests/test_sync.py's ground; it runs here on real GPUs only.
KINDS = ("tp", "hier", "hier_tp", "moe", "moe_hier_tp")


@pytest.mark.parametrize("kind", KINDS)
def test_reduce_scatter_matches_float64_on_mesh(kind, cpu_devices):
    check_values(kind, cpu_devices)


@pytest.mark.parametrize("kind, reduce, depth", [("hier_tp", "fp32_accum_streamed", 1),
                                                 ("moe", "fp32_accum_streamed", 1), ("hier_tp", "fp32_accum", 2)])
def test_streamed_mode_and_depth(kind, reduce, depth, cpu_devices):
    mesh, kwargs = mesh_kinds(cpu_devices)[kind]
    sync = jd.GradSync(PARAMS, mesh, bucket_size=600, reduce=reduce, max_in_flight=depth, **kwargs)
    grads = random_grads(np.random.default_rng(1), sync, mesh)
    got = result_leaves(sync, run_reduce_scatter(sync, grads, mesh), mesh)
    assert_mesh_close(got, *reference(kwargs, grads, mesh), DEVICE_SUM_RTOL, f"{kind} {reduce} depth {depth}")


# -- end to end: value_and_grad equals the gradient of the global mean loss ----------------------

D, H, E = 7, 26, 4  # odd width; the hidden width splits over the model axis (2)


def tp_loss(p, x, model_axis="model"):
    """A tensor-parallel MLP: column-parallel w_in/b_in, row-parallel w_out (psum over model)."""
    h = jax.nn.gelu(jnp.tanh(x * p["norm"]) @ p["w_in"] + p["b_in"])
    y = h @ p["w_out"]
    y = jax.lax.psum(y, model_axis) if model_axis else y
    return jnp.mean((y - x) ** 2)


def moe_loss(p, x):
    """Dense layer, then token block j to expert j (all-to-all over ``expert``: one expert per
    rank), and back."""
    h = jnp.tanh(x @ p["dense"])
    n = _compat.axis_size("expert")
    blocks = jax.lax.all_to_all(h.reshape(n, -1, D), "expert", 0, 0, tiled=True)
    out = jnp.einsum("ncd,de->nce", blocks, p["experts"][0])
    y = jax.lax.all_to_all(out, "expert", 0, 0, tiled=True).reshape(-1, D)
    return jnp.mean((y * p["scale"] - x) ** 2)


def global_grads(loss, params, batch, devices_batch: int, **no_axes):
    """float64 gradient of the mean over devices of the per-device loss, without shard_map."""
    with jax.enable_x64(True):
        p64 = jax.tree.map(lambda a: jnp.asarray(a, jnp.float64), params)
        x64 = jnp.asarray(batch, jnp.float64).reshape(devices_batch, -1, batch.shape[-1])
        mean = lambda p: jnp.mean(jax.vmap(lambda x: loss(p, x, **no_axes))(x64))
        value, grads = jax.value_and_grad(mean)(p64)
        return float(value), jax.tree.map(np.asarray, grads)


def check_tp_end_to_end(devices) -> None:
    """Hierarchical + tensor parallel, fp32_accum + drain: shards == d(global mean loss)."""
    mesh, kwargs = mesh_kinds(devices)["hier_tp"]
    rng = np.random.default_rng(7)
    # A small input norm scale: w_in's gradient is ~1e-3 of the others' in the same bucket.
    params = {"w_in": rng.normal(size=(D, H)) / 3, "b_in": rng.normal(size=(H,)),
              "w_out": rng.normal(size=(H, D)) / 3, "norm": rng.uniform(0.5, 2, size=(D,)) * 1e-3}
    params = jax.tree.map(lambda a: jnp.asarray(a, F32), params)
    specs = {"w_in": P(None, "model"), "b_in": P("model"), "w_out": P("model", None), "norm": None}
    sync = jd.GradSync(params, mesh, bucket_size=64, reduce="fp32_accum", outer_axis=kwargs["outer_axis"],
                       param_specs=specs)
    n_dp = sync.axis_size * sync.outer_size
    batch = jnp.asarray(rng.normal(size=(n_dp * 4, D)), F32)
    step = jax.jit(_compat.shard_map(sync.value_and_grad(tp_loss), mesh=mesh,
                                     in_specs=(sync.param_specs, sync.batch_spec),
                                     out_specs=(P(), sync.shard_spec)))
    assert sync.shard_spec == P(("model", "data"))
    loss, shards = step(params, batch)
    ref_loss, ref = global_grads(tp_loss, params, batch, n_dp, model_axis=None)
    additions = end_to_end_additions(tp_loss, params, batch, n_dp, model_axis=None)
    assert_within_rounding(loss, ref_loss, additions=additions, what="loss")
    m = mesh.shape["model"]
    got, want = {}, {}
    for rank in range(m):  # each model rank's buckets hold its own blocks
        got[f"model={rank}"] = leaves_of(sync, [np.asarray(s).reshape(m, -1)[rank] for s in shards])
        block = lambda a, dim: np.split(a, m, axis=dim)[rank]
        want[f"model={rank}"] = {"w_in": block(ref["w_in"], 1), "b_in": block(ref["b_in"], 0),
                                 "w_out": block(ref["w_out"], 0), "norm": ref["norm"]}
    assert_end_to_end_close(got, want, additions, "hierarchical tensor parallel")


def assert_end_to_end_close(got, want, additions: int, what: str) -> None:
    """float32 forward/backward against float64, per leaf and element: ``additions`` roundings
    of the leaf's own largest value."""
    assert_within_rounding(got, want, additions=additions, what=what)


def end_to_end_additions(loss, params, batch, devices_batch: int, **no_axes) -> int:
    """Roundings on the longest chain of one device's gradient of ``loss`` (its share of
    ``batch``), then the devices' sum and the mean."""
    local = batch[: batch.shape[0] // devices_batch]
    return rounding_chain(jax.grad(lambda p, x: loss(p, x, **no_axes)), params, local) + devices_batch + 1


def check_moe_end_to_end(devices) -> None:
    """Expert parallel over ``expert`` (all-to-all dispatch): expert shards carry the same mean as
    dense ones, i.e. equal d(global mean loss) / d(expert weights)."""
    mesh = Mesh(np.array(devices).reshape(-1, E if len(devices) >= E else len(devices)), ("data", "expert"))
    n_exp = mesh.shape["expert"]
    rng = np.random.default_rng(8)
    # A small output scale: the dense and expert gradients are ~1e-2 of the scale's.
    params = {"dense": rng.normal(size=(D, D)) / 3, "experts": rng.normal(size=(n_exp, D, D)) / 3,
              "scale": rng.uniform(0.5, 2, size=(D,)) * 1e-2}
    params = jax.tree.map(lambda a: jnp.asarray(a, F32), params)
    sync = jd.GradSync(params, mesh, axis=("data", "expert"), bucket_size=64, reduce="fp32_accum",
                       param_specs={"dense": None, "experts": P("expert"), "scale": None},
                       expert={"dense": False, "experts": True, "scale": False}, expert_axis="data")
    n_dp = sync.axis_size
    batch = jnp.asarray(rng.normal(size=(n_dp * n_exp * 2, D)), F32)
    step = jax.jit(_compat.shard_map(sync.value_and_grad(moe_loss), mesh=mesh,
                                     in_specs=(sync.param_specs, sync.batch_spec),
                                     out_specs=(P(), Shards(sync.shard_spec, sync.expert_shard_spec))))
    assert (sync.shard_spec, sync.expert_shard_spec) == (P(("data", "expert")), P(("expert", "data")))
    loss, shards = step(params, batch)
    assert isinstance(shards, Shards) and len(shards.dense) == sync.num_buckets
    assert len(shards.expert) == sync.num_expert_buckets >= 1
    ref_loss, ref, reference_loss = _moe_reference(params, batch, n_dp, n_exp)
    additions = end_to_end_additions(reference_loss, params, batch, n_dp)
    assert_within_rounding(loss, ref_loss, additions=additions, what="loss")
    got, want = {}, {}
    for rank in range(n_exp):
        expert = [np.asarray(s).reshape(n_exp, -1)[rank] for s in shards.expert]
        got[f"expert={rank}"] = leaves_of(sync, Shards([np.asarray(s) for s in shards.dense], expert))
        want[f"expert={rank}"] = {**ref, "experts": ref["experts"][rank:rank + 1]}
    assert_end_to_end_close(got, want, additions, "expert parallel")


def _moe_reference(params, batch, n_dp, n_exp):
    """The global mean loss: device r's token block j goes to expert j (as the all-to-all does)."""
    def loss(p, x):
        h = jnp.tanh(x @ p["dense"])
        y = jnp.einsum("ncd,nde->nce", h.reshape(n_exp, -1, D), p["experts"]).reshape(-1, D)
        return jnp.mean((y * p["scale"] - x) ** 2)

    with jax.enable_x64(True):
        p64 = jax.tree.map(lambda a: jnp.asarray(a, jnp.float64), params)
        x64 = jnp.asarray(batch, jnp.float64).reshape(n_dp, -1, D)
        value, grads = jax.value_and_grad(lambda p: jnp.mean(jax.vmap(lambda x: loss(p, x))(x64)))(p64)
        return float(value), jax.tree.map(np.asarray, grads), loss


def test_tensor_parallel_hierarchical_value_and_grad(cpu_devices):
    check_tp_end_to_end(cpu_devices)


def test_expert_parallel_value_and_grad_same_mean_as_dense(cpu_devices):
    check_moe_end_to_end(cpu_devices)


# -- API details ---------------------------------------------------------------------------------

def test_layouts_use_local_shapes_and_separate_chains(cpu_devices):
    _, kwargs = mesh_kinds(cpu_devices)["moe_hier_tp"]
    mesh = Mesh(np.array(cpu_devices).reshape(2, 1, 2, 2), ("replica", "data", "expert", "model"))
    sync = jd.GradSync(PARAMS, mesh, bucket_size=600, **kwargs)
    local = sync.local_shapes
    assert local["layers"][0]["w_in"].shape == (16, 16) and local["layers"][0]["w_out"].shape == (16, 16)
    assert local["layers"][1]["experts"].shape == (2, 16, 4)  # 4 experts / expert 2, 8 / model 2
    assert local["embed"].shape == (40, 16)
    expert_paths = {sync.expert_layout.slots[j].path for j in range(len(sync.expert_leaves))}
    assert expert_paths == {"layers/0/experts", "layers/1/experts"}
    assert {sync.layout.slots[j].path for j in range(len(sync.dense_leaves))}.isdisjoint(expert_paths)
    assert sync.shard_sizes == tuple(s // 2 for s in sync.bucket_sizes)  # data x expert = 1 x 2
    assert sync.expert_shard_sizes == sync.expert_bucket_sizes  # expert_axis "data" has size 1
    assert sync.batch_spec == P(("replica", "data", "expert"))
    assert sync.expert_shard_spec == P(("expert", "model", "data"))
    assert "expert chain (jax_drain/expert/bucket*)" in sync.table()
    assert "outer_axis='replica'" in repr(sync) and "num_expert_buckets=" in repr(sync)
    tree = jax.tree.map(lambda s: jnp.asarray(np.random.default_rng(0).normal(size=s.shape), s.dtype), local)
    flat = sync.flatten(tree)
    assert isinstance(flat, Shards) and [b.shape[0] for b in flat.expert] == list(sync.expert_bucket_sizes)
    for x, y in zip(jax.tree.leaves(tree), jax.tree.leaves(sync.unflatten(flat))):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    # Without experts nothing changes: tuples, the whole tree's layout, P("data").
    plain = jd.GradSync(PARAMS, Mesh(np.array(cpu_devices), ("data",)), bucket_size=600)
    assert isinstance(plain.flatten(jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), PARAMS)), tuple)
    assert plain.shard_spec == P("data") and plain.expert_layout is None and plain.num_expert_buckets == 0


def test_order_applies_to_both_chains(cpu_devices):
    mesh, kwargs = mesh_kinds(cpu_devices)["moe"]
    n = len(jax.tree.leaves(PARAMS))
    forward = jd.GradSync(PARAMS, mesh, bucket_size=1, order=tuple(range(n)), **kwargs)
    backward = jd.GradSync(PARAMS, mesh, bucket_size=1, **kwargs)
    first = lambda s, lay, idx: [lay.slots[lay.buckets[k].leaves[0]].path for k in range(lay.num_buckets)]
    assert first(forward, forward.expert_layout, forward.expert_leaves) == ["layers/0/experts", "layers/1/experts"]
    assert first(backward, backward.expert_layout, backward.expert_leaves) == ["layers/1/experts", "layers/0/experts"]
    assert first(forward, forward.layout, forward.dense_leaves)[0] == "embed"
    with pytest.raises(ValueError, match="order must be a permutation"):
        jd.GradSync(PARAMS, mesh, order=(0, 1), **kwargs)


def test_bad_axis_declarations(cpu_devices):
    mesh = Mesh(np.array(cpu_devices).reshape(2, 2, 2), ("replica", "data", "model"))
    w = {"w": SDS((8, 6), F32), "b": SDS((6,), F32)}
    with pytest.raises(ValueError, match=r"mesh has no axis 'tensor' \(in the PartitionSpec of param 'w'\)"):
        jd.GradSync(w, mesh, param_specs={"w": P(None, "tensor"), "b": None})
    with pytest.raises(ValueError, match=r"param 'w' is sharded along \['data'\].*remove those axes"):
        jd.GradSync(w, mesh, param_specs={"w": P("data"), "b": None})
    with pytest.raises(ValueError, match=r"param 'b' is sharded along \['replica'\]"):
        jd.GradSync(w, mesh, outer_axis="replica", param_specs={"w": None, "b": P("replica")})
    with pytest.raises(ValueError, match="axis and outer_axis both name \\['data'\\]"):
        jd.GradSync(w, mesh, axis=("data", "replica"), outer_axis=("data",))
    with pytest.raises(ValueError, match="mesh has no axis 'hosts' \\(outer_axis\\)"):
        jd.GradSync(w, mesh, outer_axis="hosts")
    with pytest.raises(ValueError, match="param 'w' dimension 1 has size 6, which does not split over \\('model', 'replica'\\)"):
        jd.GradSync(w, mesh, axis="data", param_specs={"w": P(None, ("model", "replica")), "b": None})
    with pytest.raises(ValueError, match="param 'b' has shape \\(6,\\) but its PartitionSpec"):
        jd.GradSync(w, mesh, param_specs={"w": None, "b": P(None, "model")})
    with pytest.raises(ValueError, match="names an axis twice"):
        jd.GradSync(w, mesh, param_specs={"w": P("model", "model"), "b": None})
    with pytest.raises(ValueError, match="param_specs must have the params' structure"):
        jd.GradSync(w, mesh, param_specs={"w": None})
    with pytest.raises(TypeError, match="param_specs entry for 'b' must be a PartitionSpec"):
        jd.GradSync(w, mesh, param_specs={"w": None, "b": "model"})

    moe = Mesh(np.array(cpu_devices).reshape(2, 4), ("data", "expert"))
    p = {"experts": SDS((4, 6), F32), "dense": SDS((6,), F32)}
    flags = {"experts": True, "dense": False}
    with pytest.raises(ValueError, match="expert params need expert_axis"):
        jd.GradSync(p, moe, axis=("data", "expert"), expert=flags)
    with pytest.raises(ValueError, match="expert_axis is given but expert is None"):
        jd.GradSync(p, moe, axis=("data", "expert"), expert_axis="data")
    with pytest.raises(ValueError, match=r"expert_axis \['model'\] is not among the data-parallel axes"):
        jd.GradSync(p, Mesh(np.array(cpu_devices).reshape(2, 2, 2), ("data", "expert", "model")),
                    axis=("data", "expert"), expert=flags, expert_axis="model")
    with pytest.raises(ValueError, match=r"expert param 'experts' .* neither sharded along nor reduced over "
                                         r"the data axes \['expert'\].*add them to its PartitionSpec"):
        jd.GradSync(p, moe, axis=("data", "expert"), expert=flags, expert_axis="data")
    with pytest.raises(ValueError, match=r"expert param 'experts' is sharded along \['data'\]"):
        jd.GradSync(p, moe, axis=("data", "expert"), expert=flags, expert_axis="data",
                    param_specs={"experts": P(("expert", "data")), "dense": None})
    with pytest.raises(ValueError, match="expert selects no parameter"):
        jd.GradSync(p, moe, axis=("data", "expert"), expert=lambda path: False, expert_axis="data")
    with pytest.raises(TypeError, match="expert entry for 'dense' must be a Python bool"):
        jd.GradSync(p, moe, axis=("data", "expert"), expert={"experts": True, "dense": 0}, expert_axis="data",
                    param_specs={"experts": P("expert"), "dense": None})


def test_grads_must_vary_along_every_reduced_axis(cpu_devices):
    mesh, kwargs = mesh_kinds(cpu_devices)["hier"]
    params = {"w": SDS((8, 16), F32)}
    sync = jd.GradSync(params, mesh, **kwargs)
    # A batch split over "data" only: the gradients are identical along "replica".
    fn = lambda p, x: sync.reduce_scatter(jax.grad(lambda q: jnp.sum(x @ q["w"]))(jd.local_params(p, "data")))
    fn = _compat.shard_map(fn, mesh=mesh, in_specs=(P(), P("data")), out_specs=P("data"))
    with pytest.raises(ValueError, match=r"do not vary along 'replica'.*batch split over P\(\('replica', 'data'\)"):
        jax.jit(fn).lower(params, SDS((16, 8), F32))
    outside = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), params)
    with pytest.raises(ValueError, match="inside jax.shard_map over a mesh with axis 'data'"):
        sync.reduce_scatter(outside)
    partial = _compat.shard_map(lambda g: sync.reduce_scatter(g), mesh=mesh, in_specs=P("data"),
                                out_specs=P("data"), axis_names={"data"})
    with pytest.raises(ValueError, match="with axis 'replica'"):
        jax.jit(partial).lower({"w": SDS((32, 16), F32)})


# -- the schedule on XLA's GPU compiler: two hosts, compile-only ---------------------------------

# XLA:GPU keeps one async collective in flight unless allowed more; allow more so that only the
# chains bound what is in flight.
OVERLAP_4 = {"xla_gpu_experimental_parallel_collective_overlap_limit": 4}
GPU_LAYERS, GD = 4, 256


def hsdp_tp_step(mesh: Mesh, expert: bool = False, drain: bool = True):
    """(jitted step, abstract args, sync) on ``("replica", "data", ["expert",] "model")``: the
    step ``jax_drain.planner.plan.plan`` takes (one local ``w_in`` block per bucket)."""
    return plan.build_mesh_step(mesh, layers=GPU_LAYERS, d_model=GD, drain=drain, expert=expert,
                                bucket_size=4 * GD * GD // 2)


CHAIN = {SCOPE_PREFIX: "dense", EXPERT_SCOPE: "expert"}


def chain_spans(sched, scope: str) -> dict[int, tuple[int, int]]:
    """Bucket k of the chain -> (first start, last done) of its collectives in ENTRY, including
    combined collectives that carry it (see ``Schedule.feeding_op_names``)."""
    return plan.bucket_spans(sched).get(CHAIN[scope], {})


def chain_collectives(sched, scope: str, layout, shard_sizes, inner_group: int):
    """Per bucket: (found, expected) descriptions ``(kind, dtype, bytes, devices per group)``.
    Expected: an all-to-all of the whole bucket in its own dtype over the inner group, then a
    float32 all-reduce of the shard over the 2 hosts. A collective XLA combined across buckets
    (without an op name, see ``Schedule.feeding_op_names``, or with a combined one, depending on
    the XLA version) shows ``"combined"`` for its bytes."""
    hlo_dtype = {"bfloat16": "bf16", "float32": "f32"}
    out = []
    for k, (bucket, shard) in enumerate(zip(layout.buckets, shard_sizes)):
        mine = [c for c in sched.collectives if c.computation == sched.entry
                and (CHAIN[scope], k) in plan.collective_buckets(sched, c)]
        found = [(c.kind, c.dtype, c.bytes if len(plan.collective_buckets(sched, c)) == 1 else "combined",
                  c.group_size) for c in mine]
        expected = [("all-to-all", hlo_dtype[str(bucket.dtype)], bucket.padded_size * bucket.dtype.itemsize, inner_group),
                    ("all-reduce", "f32", shard * 4, 2)]
        out.append((found, expected))
    return out


def buckets_in_flight(spans: dict[int, tuple[int, int]]) -> int:
    return plan.max_overlap(list(spans.values()))


_compiled = {}


def compiled_schedule(expert: bool, drain: bool = True):
    if (expert, drain) not in _compiled:
        shape, names = ((2, 2, 2, 2), ("replica", "data", "expert", "model")) if expert else \
            ((2, 4, 2), ("replica", "data", "model"))
        mesh = gpu_mesh(shape, names, target="h100", topology="1x2x8")
        step, args, sync = hsdp_tp_step(mesh, expert, drain)
        compiled = step.lower(*args).compile(compiler_options=OVERLAP_4)
        _compiled[expert, drain] = sync, parse_schedule(compiled.as_text())
    return _compiled[expert, drain]


@pytest.mark.gpu_compile
def test_gpu_schedule_hierarchical_tp_one_bucket_in_flight():
    sync, sched = compiled_schedule(expert=False)
    spans = chain_spans(sched, SCOPE_PREFIX)
    assert sorted(spans) == list(range(sync.num_buckets)) and sync.num_buckets >= 4
    assert buckets_in_flight(spans) == 1
    # Inner: an all-to-all of the whole bucket in its dtype (bf16 wire for bf16 params) within a
    # host (the 4 GPUs of "data"); outer: a float32 all-reduce of the shard across the 2 hosts.
    for found, expected in chain_collectives(sched, SCOPE_PREFIX, sync.layout, sync.shard_sizes, 4):
        assert found == expected
    assert sched.max_in_flight(lambda c: c.in_scope(SCOPE_PREFIX)) == 1  # single collectives too
    assert {c.dtype for c in sched.collectives if c.kind == "all-to-all" and c.in_scope(SCOPE_PREFIX)} == {"bf16", "f32"}
    _, free = compiled_schedule(expert=False, drain=False)
    assert buckets_in_flight(chain_spans(free, SCOPE_PREFIX)) > 1


@pytest.mark.gpu_compile
def test_gpu_schedule_dense_and_expert_chains_each_one_bucket_in_flight():
    sync, sched = compiled_schedule(expert=True)
    dense, expert = chain_spans(sched, SCOPE_PREFIX), chain_spans(sched, EXPERT_SCOPE)
    assert sorted(dense) == list(range(sync.num_buckets)) and sync.num_buckets >= 2
    assert sorted(expert) == list(range(sync.num_expert_buckets)) and sync.num_expert_buckets >= 2
    assert buckets_in_flight(dense) == 1 and buckets_in_flight(expert) == 1
    # Experts: all-to-all over "data" (2 GPUs); dense: over "data" x "expert" (4 GPUs). XLA's
    # all-reduce combiner may merge one pair of outer all-reduces across the two chains (they
    # are independent and both over "replica"); each chain still has one bucket in flight.
    combined = []
    for scope, layout, shards, group in ((EXPERT_SCOPE, sync.expert_layout, sync.expert_shard_sizes, 2),
                                         (SCOPE_PREFIX, sync.layout, sync.shard_sizes, 4)):
        for k, (found, expected) in enumerate(chain_collectives(sched, scope, layout, shards, group)):
            if len(found) == 2 and found[1][2] == "combined":
                combined.append((scope, k))
                expected[1] = ("all-reduce", "f32", "combined", 2)
            assert found == expected
    assert len(combined) in (0, 2), combined
    _, free = compiled_schedule(expert=True, drain=False)
    assert buckets_in_flight(chain_spans(free, SCOPE_PREFIX)) > 1
    assert buckets_in_flight(chain_spans(free, EXPERT_SCOPE)) > 1
