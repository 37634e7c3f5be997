"""jax_drain.planner.schedule: parsing hand-written and real XLA:GPU scheduled HLO."""

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import PartitionSpec as P

from jax_drain.planner.schedule import (
    Collective,
    expand_op_name,
    parse_schedule,
    replica_group_size,
    shape_bytes,
    shape_dtypes,
)
from jax_drain.planner.targets import gpu_mesh


# Indices below are schedule positions in ENTRY; the comments give them.
ASYNC_PAIRS = """HloModule pairs, is_scheduled=true, entry_computation_layout={(f32[1024]{0})->f32[]}

%add (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %s = f32[] add(%a, %b)
}

ENTRY %main (p0: f32[1024], p1: bf16[64,32]) -> (f32[512], f32[]) {
  %p0 = f32[1024]{0} parameter(0)
  %p1 = bf16[64,32]{1,0} parameter(1)
  %rs0 = ((f32[1024]{0}), f32[512]{0}) reduce-scatter-start(%p0), channel_id=1, replica_groups={{0,1}}, dimensions={0}, to_apply=%add, metadata={op_name="jit(f)/jax_drain/bucket0/reduce_scatter" scheduling_name="rs0"}, backend_config={"operation_queue_id":"0","collective_backend_config":{"is_sync":false,"is_pipelined":false}}
  %rs1 = ((f32[1024]{0}), f32[512]{0}) reduce-scatter-start(%p0), channel_id=2, replica_groups={{0,1}}, dimensions={0}, to_apply=%add, metadata={op_name="jit(f)/jax_drain/bucket1/reduce_scatter"}, backend_config={"collective_backend_config":{"is_sync":false}}
  %ag0 = (bf16[64,32]{1,0}, bf16[128,32]{1,0}) all-gather-start(%p1), channel_id=3, replica_groups={{0,1}}, dimensions={0}, metadata={op_name="jit(f)/all_gather"}, backend_config={"collective_backend_config":{"is_sync":false}}
  %gemm = (bf16[64,64]{1,0}, s8[1024]{0}) custom-call(%p1, %p1), custom_call_target="__cublas$lt$matmul", metadata={op_name="jit(f)/dot_general"}
  %rs0d = f32[512]{0} reduce-scatter-done(%rs0), metadata={op_name="jit(f)/jax_drain/bucket0/reduce_scatter"}
  %ag0d = bf16[128,32]{1,0} all-gather-done(%ag0)
  %rs2 = ((f32[1024]{0}), f32[512]{0}) reduce-scatter-start(%p0), channel_id=4, replica_groups={{0,1}}, dimensions={0}, to_apply=%add, metadata={op_name="jit(f)/jax_drain/bucket2/reduce_scatter"}, backend_config={"collective_backend_config":{"is_sync":true}}
  %rs2d = f32[512]{0} reduce-scatter-done(%rs2)
  %rs1d = f32[512]{0} reduce-scatter-done(%rs1)
  %c = f32[] constant(1)
  %ar = f32[] all-reduce(%c), channel_id=5, replica_groups={{0,1}}, to_apply=%add
  %cp = (f32[1024]{0}, f32[1024]{0}) collective-permute-start(%p0), channel_id=6, source_target_pairs={{0,1},{1,0}}, backend_config={"collective_backend_config":{"is_sync":false}}
  %bc = f32[32,32]{1,0} bitcast(%p0)
  %cpd = f32[1024]{0} collective-permute-done(%cp)
  ROOT %t = (f32[512]{0}, f32[], /*index=2*/f32[1024]{0}) tuple(%rs1d, %ar, %cpd)
}
"""
# In flight: rs0 [2,6], rs1 [3,10], ag0 [4,7], rs2 sync at 8, ar sync at 12, cp [13,15].


def by_name(sched, name: str) -> Collective:
    (c,) = [c for c in sched.collectives if c.name == name]
    return c


def test_async_pairs_kinds_bytes_and_indices():
    sched = parse_schedule(ASYNC_PAIRS)
    assert sched.entry == "main"
    got = {(c.name, c.kind, c.dtype, c.bytes, c.start, c.done) for c in sched.collectives}
    assert got == {
        ("rs0", "reduce-scatter", "f32", 2048, 2, 6),
        ("rs1", "reduce-scatter", "f32", 2048, 3, 10),
        ("ag0", "all-gather", "bf16", 8192, 4, 7),
        ("rs2", "reduce-scatter", "f32", 2048, 8, 9),
        ("ar", "all-reduce", "f32", 4, 12, 12),
        ("cp", "collective-permute", "f32", 4096, 13, 15),
    }
    assert {c.computation for c in sched.collectives} == {"main"}
    assert by_name(sched, "rs0").op_name == "jit(f)/jax_drain/bucket0/reduce_scatter"
    assert by_name(sched, "cp").op_name == ""


def test_async_pairs_sync_and_overlap():
    sched = parse_schedule(ASYNC_PAIRS)
    flags = {c.name: (c.is_sync, c.overlapped) for c in sched.collectives}
    assert flags == {
        "rs0": (False, True),  # the cuBLAS custom-call sits between start and done
        "rs1": (False, True),
        "ag0": (False, True),
        "rs2": (True, False),  # sync: runs on the compute stream, nothing overlaps
        "ar": (True, False),  # plain synchronous op
        "cp": (False, False),  # only a bitcast in between
    }


def test_max_in_flight_with_selectors():
    sched = parse_schedule(ASYNC_PAIRS)
    assert sched.max_in_flight() == 3  # rs0, rs1, ag0 at indices 4-6
    assert sched.max_in_flight("reduce-scatter") == 2
    assert sched.max_in_flight(lambda c: c.in_scope("jax_drain/bucket")) == 2
    assert sched.max_in_flight(lambda c: c.in_scope("jax_drain/bucket0")) == 1
    assert sched.max_in_flight("all-to-all") == 0
    with pytest.raises(ValueError, match="reduce-scatter"):
        sched.max_in_flight("reducescatter")


def test_sync_collective_counts_only_at_its_start():
    # A sync op whose done is printed far away still runs at its start (on the compute stream).
    text = ASYNC_PAIRS.replace('"is_sync":false,"is_pipelined"', '"is_sync":true,"is_pipelined"')
    assert text != ASYNC_PAIRS
    sched = parse_schedule(text)
    assert by_name(sched, "rs0").is_sync and not by_name(sched, "rs0").overlapped
    assert sched.max_in_flight("reduce-scatter") == 2  # rs1 with rs2 at 8
    assert sched.max_in_flight() == 2


GENERIC_ASYNC = """HloModule generic, is_scheduled=true

%add (x: f32[], y: f32[]) -> f32[] {
  %x = f32[] parameter(0)
  %y = f32[] parameter(1)
  ROOT %s = f32[] add(%x, %y)
}

%wrapped_a2a (p: bf16[8,16]) -> bf16[8,16] {
  %p = bf16[8,16]{1,0} parameter(0)
  ROOT %a2a = bf16[8,16]{1,0} all-to-all(%p), replica_groups={{0,1}}, dimensions={0}
}

%wrapped_rs (q: f32[8]) -> f32[4] {
  %q = f32[8]{0} parameter(0)
  ROOT %rs = f32[4]{0} reduce-scatter(%q), replica_groups={{0,1}}, dimensions={0}, to_apply=%add
}

%fused (f0: f32[8]) -> f32[8] {
  %f0 = f32[8]{0} parameter(0)
  ROOT %n = f32[8]{0} negate(%f0)
}

%copy_wrapped (w: f32[8]) -> f32[8] {
  %w = f32[8]{0} parameter(0)
  ROOT %cw = f32[8]{0} copy(%w)
}

%body (t: (s32[], f32[8])) -> (s32[], f32[8]) {
  %t = (s32[], f32[8]{0}) parameter(0)
  %i = s32[] get-tuple-element(%t), index=0
  %v = f32[8]{0} get-tuple-element(%t), index=1
  %rs-start = ((f32[8]{0}), f32[4]{0}) async-start(%v), calls=%wrapped_rs, metadata={op_name="jit(f)/while/body/jax_drain/bucket0/reduce_scatter"}, backend_config={"collective_backend_config":{"is_sync":false}}
  %f = f32[8]{0} fusion(%v), kind=kLoop, calls=%fused
  %rs-update = ((f32[8]{0}), f32[4]{0}) async-update(%rs-start), calls=%wrapped_rs
  %rs-done = f32[4]{0} async-done(%rs-update), calls=%wrapped_rs
  ROOT %r = (s32[], f32[8]{0}) tuple(%i, %f)
}

%cond (t2: (s32[], f32[8])) -> pred[] {
  %t2 = (s32[], f32[8]{0}) parameter(0)
  %i2 = s32[] get-tuple-element(%t2), index=0
  %k = s32[] constant(3)
  ROOT %lt = pred[] compare(%i2, %k), direction=LT
}

ENTRY %main (a: bf16[8,16], b: f32[8]) -> (bf16[8,16], (s32[], f32[8]), f32[8]) {
  %a = bf16[8,16]{1,0} parameter(0)
  %b = f32[8]{0} parameter(1)
  %a2a-start = ((bf16[8,16]{1,0}), bf16[8,16]{1,0}, u32[]) async-start(bf16[8,16]{1,0} %a),
      calls=%wrapped_a2a,
      backend_config={"collective_backend_config":{"is_sync":false}}
  %z = s32[] constant(0)
  %init = (s32[], f32[8]{0}) tuple(%z, %b)
  %loop = (s32[], f32[8]{0}) while(%init), condition=%cond, body=%body
  %a2a-done = bf16[8,16]{1,0} async-done(((bf16[8,16]{1,0}), bf16[8,16]{1,0}, u32[]) %a2a-start), calls=%wrapped_a2a
  %copy-start = ((f32[8]{0}), f32[8]{0}) async-start(%b), calls=%copy_wrapped
  %copy-done = f32[8]{0} async-done(%copy-start), calls=%copy_wrapped
  ROOT %out = (bf16[8,16]{1,0}, (s32[], f32[8]{0}), f32[8]{0}) tuple(%a2a-done, %loop, %copy-done)
}
"""


def test_generic_async_collectives_in_entry_and_while_body():
    sched = parse_schedule(GENERIC_ASYNC)
    got = {
        (c.name, c.kind, c.dtype, c.bytes, c.computation, c.start, c.done, c.overlapped)
        for c in sched.collectives
    }
    # The wrapped computations' plain collectives are the same ops, not extra ones; the
    # non-collective async copy is not a collective.
    assert got == {
        ("a2a-start", "all-to-all", "bf16", 256, "main", 2, 6, True),  # a while loop between
        ("rs-start", "reduce-scatter", "f32", 16, "body", 3, 6, True),  # through async-update
    }
    loop = sched.computations["main"][5]
    assert loop.opcode == "while" and set(loop.called) == {"cond", "body"}
    assert by_name(sched, "rs-start").in_scope("jax_drain/bucket0")


def test_long_form_operands_and_wrapped_lines():
    sched = parse_schedule(GENERIC_ASYNC)
    done = sched.computations["main"][6]
    assert done.name == "a2a-done" and done.operands == ("a2a-start",)
    start = sched.computations["main"][2]
    assert start.operands == ("a",) and start.called == ("wrapped_a2a",)


# XLA's all-reduce combiner merged the dense chain's last outer all-reduce and the expert
# chain's first into %merged, which has no op name; its operands' producers have.
COMBINED = """HloModule combined, is_scheduled=true

%add (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %s = f32[] add(%a, %b)
}

ENTRY %main (p0: bf16[64], p1: bf16[32]) -> (f32[16], f32[16]) {
  %p0 = bf16[64]{0} parameter(0)
  %p1 = bf16[32]{0} parameter(1)
  %a2a = bf16[64]{0} all-to-all(%p0), channel_id=1, replica_groups=[4,4]<=[16], dimensions={0}, metadata={op_name="jit(step)/jax_drain/bucket5/reduce_scatter"}
  %sum = f32[16]{0} fusion(%a2a), kind=kLoop, calls=%add, metadata={op_name="jit(step)/jax_drain/bucket5/reduce_scatter/reduce_sum"}
  %cvt = f32[32]{0} fusion(%p1), kind=kLoop, calls=%add, metadata={op_name="jit(step)/jax_drain/expert/bucket0/convert_element_type"}
  %bc = f32[16]{0} bitcast(%cvt)
  %merged = (f32[16]{0}, f32[16]{0}) all-reduce(%sum, %bc), channel_id=2, replica_groups={{0,8},{1,9}}, to_apply=%add
  %g0 = f32[16]{0} get-tuple-element(%merged), index=0
  %g1 = f32[16]{0} get-tuple-element(%merged), index=1
  ROOT %t = (f32[16]{0}, f32[16]{0}) tuple(%g0, %g1)
}
"""


def test_feeding_op_names_attribute_a_combined_unnamed_collective():
    from jax_drain.planner import plan

    sched = parse_schedule(COMBINED)
    a2a, merged = sched.collectives
    assert (a2a.group_size, merged.group_size) == (4, 2)
    assert merged.op_names == () and sched.op_names_of(a2a) == a2a.op_names
    assert sched.feeding_op_names(merged) == (
        "jit(step)/jax_drain/bucket5/reduce_scatter/reduce_sum",
        "jit(step)/jax_drain/expert/bucket0/convert_element_type",
    )
    assert plan.collective_buckets(sched, merged) == (("dense", 5), ("expert", 0))
    assert plan.bucket_spans(sched) == {"dense": {5: (2, 6)}, "expert": {0: (6, 6)}}
    assert replica_group_size("replica_groups={}") is None


LOCAL_SUMS = """HloModule sums, is_scheduled=true

%fused_reduce (p: bf16[8,256]) -> f32[256] {
  %p = bf16[8,256]{1,0} parameter(0)
  %cv = f32[8,256]{1,0} convert(%p)
  %z = f32[] constant(0)
  ROOT %r = f32[256]{0} reduce(%cv, %z), dimensions={0}, to_apply=%add
}

%fused_add (p: bf16[8,256]) -> f32[1,256] {
  %p = bf16[8,256]{1,0} parameter(0)
  %s0 = bf16[1,256]{1,0} slice(%p), slice={[0:1], [0:256]}
  %s1 = bf16[1,256]{1,0} slice(%p), slice={[1:2], [0:256]}
  %c0 = f32[1,256]{1,0} convert(%s0)
  %c1 = f32[1,256]{1,0} convert(%s1)
  ROOT %a = f32[1,256]{1,0} add(%c0, %c1)
}

%fused_half (p: bf16[8,256]) -> bf16[1,256] {
  %p = bf16[8,256]{1,0} parameter(0)
  %s0 = bf16[1,256]{1,0} slice(%p), slice={[0:1], [0:256]}
  %s1 = bf16[1,256]{1,0} slice(%p), slice={[1:2], [0:256]}
  ROOT %a = bf16[1,256]{1,0} add(%s0, %s1)
}

ENTRY %main (p0: bf16[8,256]) -> (f32[256], f32[1,256], bf16[1,256]) {
  %p0 = bf16[8,256]{1,0} parameter(0)
  %a0 = ((bf16[8,256]{1,0}), bf16[8,256]{1,0}) all-to-all-start(%p0), channel_id=1, replica_groups={{0,1,2,3,4,5,6,7}}, dimensions={0}
  %a0d = bf16[8,256]{1,0} all-to-all-done(%a0)
  %r = f32[256]{0} fusion(%a0d), kind=kLoop, calls=%fused_reduce
  %a1 = ((bf16[8,256]{1,0}), bf16[8,256]{1,0}) all-to-all-start(%p0), channel_id=2, replica_groups={{0,1,2,3,4,5,6,7}}, dimensions={0}
  %a1d = bf16[8,256]{1,0} all-to-all-done(%a1)
  %b1 = bf16[8,256]{1,0} bitcast(%a1d)
  %s = f32[1,256]{1,0} fusion(%b1), kind=kLoop, calls=%fused_add
  %a2 = ((bf16[8,256]{1,0}), bf16[8,256]{1,0}) all-to-all-start(%p0), channel_id=3, replica_groups={{0,1,2,3,4,5,6,7}}, dimensions={0}
  %a2d = bf16[8,256]{1,0} all-to-all-done(%a2)
  %h = bf16[1,256]{1,0} fusion(%a2d), kind=kLoop, calls=%fused_half
  ROOT %t = (f32[256]{0}, f32[1,256]{1,0}, bf16[1,256]{1,0}) tuple(%r, %s, %h)
}
"""


def test_feeds_f32_sum_as_a_reduce_or_as_adds_but_not_in_the_wire_dtype():
    sched = parse_schedule(LOCAL_SUMS)
    got = {c.name: sched.feeds_f32_reduce(c) for c in sched.collectives}
    assert got == {"a0": True, "a1": True, "a2": False}


def test_shape_bytes_and_dtypes():
    assert shape_bytes("f32[]") == 4
    assert shape_bytes("bf16[128,1024]{1,0}") == 128 * 1024 * 2
    assert shape_bytes("(f32[128,1024]{1,0}, (s8[16]{0}, pred[3]), /*index=2*/u32[])") == (
        128 * 1024 * 4 + 16 + 3 + 4
    )
    assert shape_bytes("f32[8,128]{1,0:T(8,128)(2,1)}") == 8 * 128 * 4
    assert shape_bytes("f32[<=10,4]") == 160
    assert shape_bytes("f8e4m3fn[64]{0}") == 64
    assert shape_bytes("s4[3]") == 2
    assert shape_bytes("token[]") == 0
    assert shape_dtypes("(f32[8]{0}, bf16[4]{0}, f32[])") == ("f32", "bf16")
    with pytest.raises(ValueError, match="element type"):
        shape_bytes("q7[4]")


def test_expand_op_name():
    combined = "jit(f)/shard_map/jax_drain/(bucket0/reduce_scatter:bucket1/reduce_scatter)"
    assert expand_op_name(combined) == (
        "jit(f)/shard_map/jax_drain/bucket0/reduce_scatter",
        "jit(f)/shard_map/jax_drain/bucket1/reduce_scatter",
    )
    assert expand_op_name("jit(f)") == ("jit(f)",)
    assert expand_op_name("jit(f)/transpose(jvp())") == ("jit(f)/transpose(jvp())",)
    assert expand_op_name("a/(b:c/(d:e))") == ("a/b", "a/c/d", "a/c/e")


LIVENESS = """HloModule live, is_scheduled=true

ENTRY %main (p: f32[256]) -> (f32[64], f32[64]) {
  %p = f32[256]{0} parameter(0)
  %a = f32[256]{0} fusion(%p), kind=kLoop, calls=%f
  %b = f32[512]{0} fusion(%a), kind=kLoop, calls=%f
  %c = f32[128]{0} fusion(%b), kind=kLoop, calls=%f
  %bc = f32[16,8]{1,0} bitcast(%c)
  %rs = ((f32[16,8]{1,0}), f32[64]{0}) reduce-scatter-start(%bc), dimensions={0}, to_apply=%add
  %d = f32[64]{0} fusion(%p), kind=kLoop, calls=%f
  %rsd = f32[64]{0} reduce-scatter-done(%rs)
  ROOT %t = (f32[64]{0}, f32[64]{0}) tuple(%rsd, %d)
}
"""


def test_live_bytes_hand_computed():
    # p: argument memory; a dies after b; b after c; the bitcast aliases c, which the
    # reduce-scatter reads until its done; start allocates its result only; outputs live to the end.
    assert parse_schedule(LIVENESS).live_bytes() == [0, 1024, 3072, 2560, 512, 768, 1024, 1024, 512]


@pytest.mark.parametrize(
    "text, match",
    [
        ('module @jit_f attributes {mhlo.num_partitions = 8 : i32} {\n  func.func public @main', "StableHLO"),
        ("HloModule m\n\nENTRY %main () -> f32[] {\n  ROOT %c = f32[] constant(1)\n}\n", "is_scheduled"),
        ("HloModule m, is_scheduled=true\n\n%f () -> f32[] {\n  ROOT %c = f32[] constant(1)\n}\n", "ENTRY"),
        ("HloModule m, is_scheduled=true\n\nENTRY %main () -> f32[] {\n  ROOT %c = f32[] constant(1)\n", "closed"),
    ],
    ids=["stablehlo", "unscheduled", "no-entry", "unclosed"],
)
def test_rejects_text_it_cannot_read(text, match):
    with pytest.raises(ValueError, match=match):
        parse_schedule(text)


# ---- real XLA:GPU output, compiled for compile-only H100s -------------------------------------

B = N = 1024  # per-device rows and features


def mixed_program(x, w):
    """Every collective kind, three f32 gradient-like reduce-scatters and one in a loop."""
    h = x @ w  # (1024, 1024) bf16 per device
    with jax.named_scope("jax_drain/bucket0"):
        g0 = jax.lax.psum_scatter(h.astype(jnp.float32), "data", scatter_dimension=0, tiled=True)
    with jax.named_scope("jax_drain/bucket1"):
        g1 = jax.lax.psum_scatter(h[:512].astype(jnp.float32), "data", scatter_dimension=0, tiled=True)
    with jax.named_scope("jax_drain/bucket2"):
        g2 = jax.lax.psum_scatter(h[:, :256].astype(jnp.float32), "data", scatter_dimension=0, tiled=True)
    a2a = jax.lax.all_to_all(h, "data", 0, 0, tiled=True)
    ag = jax.lax.all_gather(g2, "data", tiled=True)
    total = jax.lax.psum(jnp.sum(a2a.astype(jnp.float32)) + jnp.sum(ag), "data")
    perm = jax.lax.ppermute(h, "data", [(i, (i + 1) % 8) for i in range(8)])

    def body(_, c):
        c = jnp.tanh(c @ w)
        rs = jax.lax.psum_scatter(c, "data", scatter_dimension=0, tiled=True)
        return jax.lax.all_gather(rs, "data", tiled=True)

    looped = jax.lax.fori_loop(0, 3, body, h)
    return g0, g1, g2, total, perm, looped


def compile_gpu(fn, in_specs, out_specs, args, **compiler_options):
    mesh = gpu_mesh((8,), ("data",), target="h100")
    sharded = jax.shard_map(fn, mesh=mesh, in_specs=in_specs, out_specs=out_specs)
    return jax.jit(sharded).lower(*args).compile(compiler_options=compiler_options)


MIXED_ARGS = (
    jax.ShapeDtypeStruct((8 * B, N), jnp.bfloat16),
    jax.ShapeDtypeStruct((N, N), jnp.bfloat16),
)
MIXED_SPECS = (P("data"), P()), (P("data"), P("data"), P("data"), P(), P("data"), P("data"))


@pytest.fixture(scope="module")
def mixed_uncombined():
    return compile_gpu(
        mixed_program, *MIXED_SPECS, MIXED_ARGS, xla_gpu_reduce_scatter_combine_threshold_bytes=0
    )


@pytest.fixture(scope="module")
def mixed_default():
    return compile_gpu(mixed_program, *MIXED_SPECS, MIXED_ARGS)


def bucket_collectives(sched):
    return [c for c in sched.collectives if c.in_scope("jax_drain/bucket")]


@pytest.mark.gpu_compile
def test_real_uncombined_reduce_scatters(mixed_uncombined):
    sched = parse_schedule(mixed_uncombined.as_text())
    rs = bucket_collectives(sched)
    assert all(c.kind == "reduce-scatter" and c.computation == sched.entry for c in rs)
    assert sorted((c.op_names[0].split("/")[-2], c.dtype, c.bytes) for c in rs) == [
        ("bucket0", "f32", B // 8 * N * 4),
        ("bucket1", "f32", 512 // 8 * N * 4),
        ("bucket2", "f32", B // 8 * 256 * 4),
    ]


@pytest.mark.gpu_compile
def test_real_collective_kinds_and_payloads(mixed_uncombined):
    sched = parse_schedule(mixed_uncombined.as_text())
    entry = {(c.kind, c.dtype, c.bytes) for c in sched.collectives if c.computation == sched.entry}
    assert ("all-to-all", "bf16", B * N * 2) in entry
    assert ("all-gather", "f32", B * 256 * 4) in entry
    assert ("all-reduce", "f32", 4) in entry
    assert ("collective-permute", "bf16", B * N * 2) in entry
    for c in sched.collectives:
        assert c.start <= c.done
        assert not (c.overlapped and c.is_sync)


@pytest.mark.gpu_compile
def test_real_collectives_in_while_body(mixed_uncombined):
    sched = parse_schedule(mixed_uncombined.as_text())
    whiles = [i for i in sched.computations[sched.entry] if i.opcode == "while"]
    assert len(whiles) == 1
    in_loop = {(c.kind, c.dtype, c.bytes) for c in sched.collectives if c.computation in whiles[0].called}
    assert in_loop == {("reduce-scatter", "bf16", B // 8 * N * 2), ("all-gather", "bf16", B * N * 2)}


@pytest.mark.gpu_compile
def test_default_combiner_merges_buckets_and_op_names(mixed_default):
    sched = parse_schedule(mixed_default.as_text())
    (rs,) = bucket_collectives(sched)  # the combiner merged the three reduce-scatters
    assert rs.kind == "reduce-scatter" and rs.dtype == "f32"
    assert rs.bytes == (B // 8 * N + 512 // 8 * N + B // 8 * 256) * 4
    assert [n.split("/")[-2] for n in rs.op_names] == ["bucket0", "bucket1", "bucket2"]
    assert rs.in_scope("jax_drain/bucket1")


@pytest.mark.gpu_compile
def test_live_bytes_peak_is_near_memory_analysis(mixed_default):
    sched = parse_schedule(mixed_default.as_text())
    curve = sched.live_bytes()
    assert len(curve) == len(sched.computations[sched.entry])
    mem = mixed_default.memory_analysis()
    # Approximate model (no while-body temporaries, no buffer reuse): same order of magnitude.
    reference = mem.temp_size_in_bytes + mem.output_size_in_bytes
    assert 0.5 * reference <= max(curve) <= 2 * reference


def independent_gemm(x, w, y):
    with jax.named_scope("jax_drain/bucket0"):
        g = jax.lax.psum_scatter(y.astype(jnp.float32), "data", scatter_dimension=0, tiled=True)
    return g, x @ w


@pytest.mark.gpu_compile
@pytest.mark.parametrize("triton_gemm", [True, False], ids=["triton-fusion", "cublas-custom-call"])
def test_real_gemm_overlaps_reduce_scatter(triton_gemm):
    args = (
        jax.ShapeDtypeStruct((8 * 2048, 2048), jnp.bfloat16),
        jax.ShapeDtypeStruct((2048, 2048), jnp.bfloat16),
        jax.ShapeDtypeStruct((8 * 2048, 2048), jnp.bfloat16),
    )
    compiled = compile_gpu(
        independent_gemm, (P("data"), P(), P("data")), (P("data"), P("data")), args,
        xla_gpu_enable_triton_gemm=triton_gemm,
    )
    sched = parse_schedule(compiled.as_text())
    (rs,) = sched.collectives
    assert rs.overlapped and not rs.is_sync
    between = sched.computations[rs.computation][rs.start + 1 : rs.done]
    gemms = [i for i in between if i.op_name.endswith("dot_general")]
    assert [g.opcode for g in gemms] == ["fusion" if triton_gemm else "custom-call"]


def layer_chain(x, ws):
    outs, h = [], x
    for i in range(4):
        h = jnp.tanh(h @ ws[i])
        with jax.named_scope(f"jax_drain/bucket{i}"):
            outs.append(jax.lax.psum_scatter(h.astype(jnp.float32), "data", scatter_dimension=0, tiled=True))
    return outs


@pytest.mark.gpu_compile
@pytest.mark.parametrize("overlap_limit, expected", [(None, 1), (4, 3)])
def test_real_in_flight_follows_parallel_overlap_limit(overlap_limit, expected):
    # XLA:GPU keeps one async collective in flight unless the overlap limit is raised.
    options = {"xla_gpu_reduce_scatter_combine_threshold_bytes": 0}
    if overlap_limit is not None:
        options["xla_gpu_experimental_parallel_collective_overlap_limit"] = overlap_limit
    args = (
        jax.ShapeDtypeStruct((8 * 2048, 2048), jnp.bfloat16),
        jax.ShapeDtypeStruct((4, 2048, 2048), jnp.bfloat16),
    )
    compiled = compile_gpu(layer_chain, (P("data"), P()), P("data"), args, **options)
    sched = parse_schedule(compiled.as_text())
    assert len(bucket_collectives(sched)) == 4
    assert sched.max_in_flight(lambda c: c.in_scope("jax_drain/bucket")) == expected
