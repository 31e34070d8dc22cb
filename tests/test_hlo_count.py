"""FLOPs counted from a compiled program's HLO (hldstudy.flops.hlo_count) against closed
forms and against XLA's own cost analysis: a matmul, convolutions (padded, input-dilated),
a loop's body times its trip count (which the cost analysis counts once; read from the
loop's condition where none is recorded), and the train step of a scanned stack equal to
the unrolled one's."""

import dataclasses
import re

import jax
import jax.numpy as jnp
import pytest

from hldstudy.config import Config, DataConfig, DistillConfig
from hldstudy.flops.hlo_count import hlo_flops
from hldstudy.model.presets import preset
from hldstudy.train.probe import cost_analysis
from hldstudy.train.program import abstract_train_program


def _compiled(fn, *args):
    return jax.jit(fn).lower(*args).compile()


def test_a_matmul_is_its_closed_form_and_xlas_count():
    a, b = jnp.ones((8, 16)), jnp.ones((16, 4))
    compiled = _compiled(lambda a, b: a @ b, a, b)
    count = hlo_flops(compiled.as_text())
    assert count.flops == 2 * 8 * 4 * 16 == cost_analysis(compiled)["flops"]
    assert (count.loops, count.uncounted_kernels) == (0, [])


def test_a_batched_dot_counts_its_batch():
    a, b = jnp.ones((3, 8, 16)), jnp.ones((3, 16, 4))
    compiled = _compiled(lambda a, b: jnp.einsum("bij,bjk->bik", a, b), a, b)
    assert hlo_flops(compiled.as_text()).flops == 2 * 3 * 8 * 4 * 16


def test_a_depthwise_convolution_is_its_closed_form():
    """The DeltaNet's causal conv: each of C channels convolved with its own kernel of K."""
    b, t, c, k = 2, 32, 6, 4
    x, w = jnp.ones((b, t, c)), jnp.ones((k, 1, c))
    conv = lambda x, w: jax.lax.conv_general_dilated(  # noqa: E731
        x, w, (1,), [(k - 1, 0)], dimension_numbers=("NWC", "WIO", "NWC"),
        feature_group_count=c)
    compiled = _compiled(conv, x, w)
    # The causal padding's taps multiply nothing: the first k - 1 positions see 1..k-1 real
    # inputs (XLA's cost analysis counts the same).
    real_taps = t * k - k * (k - 1) // 2
    assert hlo_flops(compiled.as_text()).flops == 2 * b * c * real_taps \
        == cost_analysis(compiled)["flops"]


def test_a_loops_body_counts_times_its_trips():
    """XLA's cost analysis counts a while loop's body once; the HLO count multiplies it by
    the trip count XLA knows."""
    trips = 5
    w = jnp.ones((16, 16))

    def loop(x, w):
        return jax.lax.fori_loop(0, trips, lambda i, x: jnp.tanh(x @ w), x)

    compiled = _compiled(loop, jnp.ones((8, 16)), w)
    count = hlo_flops(compiled.as_text())
    one = 2 * 8 * 16 * 16
    assert count.flops == trips * one
    assert count.loops == 1 and count.unknown_trip_loops == 0
    assert cost_analysis(compiled)["flops"] < 2 * one  # the body once (plus its tanh)


@pytest.mark.parametrize("start", [0, 2])
def test_a_loop_without_a_recorded_trip_count_counts_its_condition(start):
    """libtpu records no trip counts: the count reads the loop's condition (counter < bound)
    and the counter's initial value. The CPU program with its record removed counts the same
    as with it."""
    trips = 7
    w = jnp.ones((16, 16))

    def loop(x, w):
        return jax.lax.fori_loop(start, trips, lambda i, x: jnp.tanh(x @ w), x)

    text = _compiled(loop, jnp.ones((8, 16)), w).as_text()
    assert "known_trip_count" in text
    bare = re.sub(r'"known_trip_count":\{[^}]*\},?', "", text)
    assert "known_trip_count" not in bare
    count = hlo_flops(bare)
    assert count.flops == hlo_flops(text).flops == (trips - start) * 2 * 8 * 16 * 16
    assert count.loops == 1 and count.unknown_trip_loops == 0


# A counted loop as XLA GPU leaves one without a recorded trip count: its condition's
# compare fused into a computation of its own, the bound a constant inside it.
FUSED_BOUND_LOOP = """HloModule loop

%body (p: (s32[], f32[8,16], f32[16,16])) -> (s32[], f32[8,16], f32[16,16]) {
  %p = (s32[], f32[8,16]{1,0}, f32[16,16]{1,0}) parameter(0)
  %i = s32[] get-tuple-element(%p), index=0
  %x = f32[8,16]{1,0} get-tuple-element(%p), index=1
  %w = f32[16,16]{1,0} get-tuple-element(%p), index=2
  %one = s32[] constant(1)
  %next = s32[] add(%i, %one)
  %y = f32[8,16]{1,0} dot(%x, %w), lhs_contracting_dims={1}, rhs_contracting_dims={0}
  ROOT %t = (s32[], f32[8,16]{1,0}, f32[16,16]{1,0}) tuple(%next, %y, %w)
}

%fused_compare (param_0: s32[]) -> pred[] {
  %param_0 = s32[] parameter(0)
  %bound = s32[] constant(7)
  ROOT %lt = pred[] compare(%param_0, %bound), direction=LT
}

%cond (q: (s32[], f32[8,16], f32[16,16])) -> pred[] {
  %q = (s32[], f32[8,16]{1,0}, f32[16,16]{1,0}) parameter(0)
  %c = s32[] get-tuple-element(%q), index=0
  ROOT %f = pred[] fusion(%c), kind=kLoop, calls=%fused_compare
}

ENTRY %main (a: f32[8,16], b: f32[16,16]) -> f32[8,16] {
  %a = f32[8,16]{1,0} parameter(0)
  %b = f32[16,16]{1,0} parameter(1)
  %zero = s32[] constant(0)
  %init = (s32[], f32[8,16]{1,0}, f32[16,16]{1,0}) tuple(%zero, %a, %b)
  %loop = (s32[], f32[8,16]{1,0}, f32[16,16]{1,0}) while(%init), condition=%cond, body=%body
  ROOT %out = f32[8,16]{1,0} get-tuple-element(%loop), index=1
}
"""


def test_a_loop_whose_bound_is_fused_into_its_compare_counts_its_trips():
    """XLA GPU fuses a loop's compare with its constant bound (a Qwen3.5 pair's train step
    on h100:8 had one such loop in five unknown; the 35B programs read 36 loops of unknown
    trips): the bound is read inside the fused computation."""
    count = hlo_flops(FUSED_BOUND_LOOP)
    assert count.flops == 7 * 2 * 8 * 16 * 16
    assert count.loops == 1 and count.unknown_trip_loops == 0


@pytest.mark.parametrize("start", [0, 1])
def test_a_loop_that_steps_its_counter_by_two_counts_its_real_trips(start):
    """libtpu widens loops (its windowed matmuls: `wide.windowed_dot_general_body`) to run
    two windows a trip, the counter stepping by 2 to the same bound: counted as +1 a trip,
    every such loop counted twice (the 735M KD step on v5e read 1.7x its model FLOPs). The
    count reads the step from the body's counter update."""
    w = jnp.ones((16, 16))

    def loop(x, w):
        def body(carry):
            i, x = carry
            return i + 2, jnp.tanh(jnp.tanh(x @ w) @ w)  # two windows a trip
        return jax.lax.while_loop(lambda c: c[0] < 8, body, (jnp.int32(start), x))[1]

    text = _compiled(loop, jnp.ones((8, 16)), w).as_text()
    bare = re.sub(r'"known_trip_count":\{[^}]*\},?', "", text)
    assert "known_trip_count" not in bare
    trips = -(-(8 - start) // 2)
    count = hlo_flops(bare)
    assert count.flops == trips * 2 * (2 * 8 * 16 * 16)
    assert count.loops == 1 and count.unknown_trip_loops == 0


@pytest.mark.parametrize("lhs_dilation, padding", [((1,), [(3, 3)]), ((4,), [(3, 3)]),
                                                   ((3,), [(0, 0)])])
def test_a_padded_or_dilated_convolution_counts_its_real_taps(lhs_dilation, padding):
    """libtpu writes batched matmuls as convolutions over padded or input-dilated windows
    (a window of 32 over one padded input value): the taps on padding and inserted zeros
    multiply nothing. Equal to XLA's cost analysis, which counts them so too."""
    x, w = jnp.ones((2, 5, 3)), jnp.ones((4, 3, 6))
    conv = lambda x, w: jax.lax.conv_general_dilated(  # noqa: E731
        x, w, (1,), padding, lhs_dilation=lhs_dilation,
        dimension_numbers=("NWC", "WIO", "NWC"))
    compiled = _compiled(conv, x, w)
    assert "convolution(" in compiled.as_text()
    assert hlo_flops(compiled.as_text()).flops == cost_analysis(compiled)["flops"]


@pytest.mark.slow  # four train-step compiles, about a minute
@pytest.mark.parametrize("name", ["tiny", "tiny-qwen"])
def test_the_scanned_train_step_counts_as_the_unrolled_one(name):
    cfg = Config(model=preset(name, n_layers=8, vocab_size=256),
                 data=DataConfig(batch_size=2, seq_len=64),
                 distill=DistillConfig(method="kd", loss_impl="materialized"))
    teacher = preset("tiny-teacher" if name == "tiny" else "tiny-qwen-moe", vocab_size=256)
    counts = {}
    for scan in (False, True):
        c = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, scan_layers=scan))
        program, args = abstract_train_program(c, "kd", "main", teacher)
        compiled = jax.jit(program, donate_argnums=(0,)).lower(*args).compile()
        counts[scan] = hlo_flops(compiled.as_text())
    assert counts[True].loops >= 2 and counts[True].unknown_trip_loops == 0  # the scans
    assert counts[True].flops == pytest.approx(counts[False].flops, rel=1e-3)


def test_a_kernel_counts_the_flops_its_name_scope_declares():
    """A Mosaic GPU kernel keeps no cost in the HLO: hldstudy.model.grouped_matmul calls it
    under a `declared_flops_<n>` name scope (chips.KERNEL_FLOPS_SCOPE), and the innermost
    such scope on the custom call's op_name is its count (an outer one is the caller's);
    a kernel with none is listed as uncounted."""
    from hldstudy.chips import KERNEL_FLOPS_SCOPE

    def call(name, op_name):
        return (f'  %{name} = bf16[64,32]{{1,0}} custom-call(s32[4]{{0}} %s, bf16[64,16]{{1,0}} '
                f'%x, bf16[4,16,32]{{2,1,0}} %w), custom_call_target="mosaic_gpu_v2", '
                f'metadata={{op_name="{op_name}"}}')

    text = "\n".join([
        "ENTRY %main (s: s32[4], x: bf16[64,16], w: bf16[4,16,32]) -> bf16[64,32] {",
        "  %s = s32[4]{0} parameter(0)",
        "  %x = bf16[64,16]{1,0} parameter(1)",
        "  %w = bf16[4,16,32]{2,1,0} parameter(2)",
        call("a", f"jit(f)/{KERNEL_FLOPS_SCOPE}999/moe/{KERNEL_FLOPS_SCOPE}65536/body/mpmd_map"),
        call("b", "jit(f)/body/mpmd_map"),
        "  ROOT %c = bf16[64,32]{1,0} add(bf16[64,32]{1,0} %a, bf16[64,32]{1,0} %b)",
        "}"])
    count = hlo_flops(text)
    assert count.flops == 65536 == 2 * 64 * 16 * 32
    assert count.uncounted_kernels == ["mosaic_gpu_v2"]


def test_collectives_count_the_bytes_each_device_sends_and_what_crosses_hosts():
    """An FSDP gradient on conftest's 4 CPU devices: the weight's all-gather sends (n-1)/n
    of the gathered weight, the gradient's reduction 2 (n-1)/n of it (ring algorithms), a
    loop's collectives times its trips; with 2 devices per host every group spans hosts,
    with 4 (one host) none does. The group spellings XLA prints parse to the same groups."""
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from hldstudy.flops.hlo_count import _groups

    mesh = jax.make_mesh((4,), ("fsdp",))
    w = jax.device_put(jnp.ones((64, 32)), NamedSharding(mesh, P("fsdp")))
    x = jax.device_put(jnp.ones((16, 64)), NamedSharding(mesh, P("fsdp")))

    def grad(w, x):
        return jax.grad(lambda w: jnp.sum(jnp.tanh(x @ w)))(w)

    def looped(w, x):  # the same gradient summed over 3 trips of a loop
        return jax.lax.fori_loop(0, 3, lambda i, g: g + grad(w, x * (i + 1)), jnp.zeros_like(w))

    weight = 64 * 32 * 4
    once = hlo_flops(_compiled(grad, w, x).as_text(), host_size=2)
    sent = sum(once.collective_bytes.values())
    assert once.collective_bytes.get("all-gather") == weight * 3 / 4
    assert sent == weight * 3 / 4 + weight * 2 * 3 / 4  # the gradient, reduced whole
    assert once.cross_host_bytes == sent
    assert hlo_flops(_compiled(grad, w, x).as_text(), host_size=4).cross_host_bytes == 0
    thrice = hlo_flops(_compiled(looped, w, x).as_text(), host_size=2)
    # (the weight's gather is loop-invariant: XLA hoists it out, once)
    assert thrice.collective_bytes["all-reduce"] == 3 * once.collective_bytes["all-reduce"]
    assert _groups("replica_groups={{0,1},{2,3}}") == [[0, 1], [2, 3]]
    assert _groups("replica_groups=[2,2]<=[4]") == [[0, 1], [2, 3]]
    assert _groups("replica_groups=[2,2]<=[2,2]T(1,0)") == [[0, 2], [1, 3]]
    assert _groups("replica_groups=mesh['a'=2,'b'=2] {'a'}") == [[0, 2], [1, 3]]


def test_the_roofline_is_each_kernel_at_its_bound_one_after_another():
    """A matmul then an elementwise fusion: the matmul at the peak's FLOP rate (its bytes
    take less), the fusion at the HBM bandwidth (its reads and writes, its intermediates on
    chip); a loop's body times its trips; no chip given, no roofline."""
    a = b = jnp.ones((1024, 1024))
    text = _compiled(lambda a, b: jnp.tanh(a @ b) + 1, a, b).as_text()
    peak, hbm = 1e12, 1e11
    got = hlo_flops(text, peak_flops=peak, hbm_bytes_per_s=hbm).roofline_s
    matrix = 1024 * 1024 * 4
    assert got == pytest.approx(2 * 1024**3 / peak + 2 * matrix / hbm)
    assert hlo_flops(text).roofline_s == 0.0

    def looped(a, b):
        return jax.lax.fori_loop(0, 4, lambda i, x: jnp.tanh(x @ b), a)

    four = hlo_flops(_compiled(looped, a, b).as_text(), peak_flops=peak, hbm_bytes_per_s=hbm)
    assert four.roofline_s >= 4 * 2 * 1024**3 / peak


def test_a_scans_step_reads_its_slice_of_the_stack_not_the_stack():
    """The roofline's bytes: a scanned layer reads its own weights from the stacked
    parameters (a dynamic-slice), and a loop's per-step output is written in place into
    its buffer (a dynamic-update-slice), not the whole stack read or written each step (the
    35B student's roofline on 8 H200s read 8x its estimate's step time)."""
    layers, d, b = 16, 256, 64
    stack, x_bytes, w_bytes = layers * d * d * 4, b * d * 4, d * d * 4

    def scan(x, w_LxDxD):
        return jax.lax.scan(lambda x, w: (jnp.tanh(x @ w), jnp.sum(x)), x, w_LxDxD)

    text = _compiled(scan, jnp.ones((b, d)), jnp.ones((layers, d, d))).as_text()
    moved = hlo_flops(text, peak_flops=1e30, hbm_bytes_per_s=1.0).roofline_s  # bytes
    assert layers * w_bytes <= moved <= layers * (4 * w_bytes + 8 * x_bytes) < layers * stack
