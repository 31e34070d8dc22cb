"""Compile a run's steps for a named target without it: the trainer's own programs
(`hldstudy.train.program`) over abstract inputs
(`jax.ShapeDtypeStruct`s placed on the config's mesh over the target's compile-only
devices), lowered and compiled by the target's compiler (libtpu, the CUDA plugin).

Design notes: `docs/aot.md`, under this file's name.
"""

from __future__ import annotations

import dataclasses
import re
import tempfile
import time

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from hldstudy import sharding as mesh_lib
from hldstudy.aot.fingerprint import program_sha256
from hldstudy.aot.peak import DUMP_OPTIONS, PeakGroup, peak_groups
from hldstudy.aot.targets import Target, device_kind
from hldstudy.chips import for_device_kind, traced_target
from hldstudy.config import Config, ModelConfig
from hldstudy.distill import methods
from hldstudy.distill.base import make_strategy
from hldstudy.errors import RuntimeFault
from hldstudy.flops.hlo_count import HloCount, hlo_flops
from hldstudy.model.attention import resolve_implementation
from hldstudy.model.transformer import Transformer
from hldstudy.plan.step_memory import fits_device, xla_memory
from hldstudy.teacher.base import method_needs
from hldstudy.teacher.colocated import forward_config, teacher_forward_fn
from hldstudy.teacher.microbatch import (
    compiler_checked,
    device_memory,
    micro_batched,
    replica_candidates,
    replica_devices,
    replica_forward_memory,
    replica_mesh,
    served,
)
from hldstudy.train.probe import cost_analysis
from hldstudy.train.program import (
    abstract_batch,
    abstract_train_program,
    default_mode,
    make_eval_step,
    microbatch_candidates,
)
from hldstudy.train.step import split_params

# How many of the peak's largest groups a CompiledStep keeps.
PEAK_GROUPS = 6

# `distill.fused_backend` auto / pallas -> the kernel family the target runs.
FUSED_FAMILY = {"tpu": "pallas_mosaic", "gpu": "pallas_triton"}


@dataclasses.dataclass(frozen=True)
class Choices:
    """What `auto` became for the target, and why where it is not what a run there does."""

    attention: str          # the student's attention path
    teacher_attention: str  # the teacher's
    fused_backend: str      # distill.fused_backend as compiled
    cohort_mode: str        # vmap | map (a cohort step's)
    notes: tuple[str, ...]


@dataclasses.dataclass(frozen=True)
class CompiledStep:
    """One compiled program: what the target's compiler reports for one device."""

    name: str               # "train kd", "train hldf:align", "teacher forward", "eval"
    kind: str               # "train" | "teacher" | "eval"
    method: str
    stage: str | None
    memory: dict[str, float]  # hldstudy.plan.xla_memory keys, per device ({} if refused)
    flops: float | None     # cost_analysis() per device (TPU); None where not reported
    seconds: float          # lowering + compiling
    # The compiler's line when it refused the step for want of memory (the TPU compiler
    # does: "Ran out of memory on HBM ..."), and the bytes it said the step needs.
    refused: str | None = None
    needs_bytes: float | None = None
    # The buffers live at the compiled program's peak, grouped by the JAX operation that
    # made them, largest first (hldstudy.aot.peak); None / () where the compiler dumps
    # no live ranges or refused the step.
    peak_bytes: int | None = None
    peak: tuple[PeakGroup, ...] = ()
    # A teacher replica's forward: the planner's figures for the micro-batch compiled, as
    # the target's compiler schedules it (`replica_forward_memory`); None for other steps.
    planner: dict[str, float] | None = None
    # Devices a teacher replica's forward is split over (teacher.replica_devices).
    replica_devices: int = 1
    # Trips of a loop XLA's cost analysis counts once (a replica's micro-batches run in a
    # `lax.map`): its FLOPs are then about 1 / loop_trips of the program's.
    loop_trips: int = 1
    # A train step's micro-batches (train.microbatches as compiled; auto: the fewest that
    # fit the device) and the sequences one call of the program processes.
    microbatches: int = 1
    sequences: int | None = None
    # FLOPs counted from the optimized HLO (dots, convolutions, GEMM calls, declared
    # kernel costs; loop bodies times their trips): hldstudy.flops.hlo_count.
    hlo: HloCount | None = None
    # Where the teacher runs for this program (LAYOUTS): a train step's teacher
    # forward inside it (colocated) or its outputs streamed in; a replica's is disaggregated.
    layout: str = "colocated"
    # sha256 of the lowered program (hldstudy.aot.fingerprint): what a kept record of this
    # compile is checked against.
    program_sha256: str | None = None


def _attention_for(model: ModelConfig, seq_len: int, target: Target) -> tuple[str, str | None]:
    """(path compiled, note): `model.attention` resolved for the target. cuDNN's fused
    attention cannot be compiled without cuDNN on this host: it is compiled as chunked
    (same math and memory order), and said so."""
    impl = resolve_implementation(model.attention, dtype=model.dtype,
                                  softcap=model.attn_softcap, head_dim=model.head_dim,
                                  seq_len=seq_len, backend=target.backend)
    if impl == "cudnn":
        return "chunked", ("attention cudnn (what auto picks on this GPU) needs cuDNN to "
                           "compile; compiled as chunked here, left to a lent GPU")
    return impl, None


def resolve_for_target(cfg: Config, teacher_model: ModelConfig | None, target: Target,
                       cohort_mode: str | None = None):
    """(cfg, teacher_model, Choices) with every `auto` decided for `target`."""
    notes = []
    attn, note = _attention_for(cfg.model, cfg.data.seq_len, target)
    if note:
        notes.append(note)
    t_attn = "-"
    if teacher_model is not None:
        # Resolved as its forward runs (teacher.attention, teacher.dtype: cuDNN takes bf16).
        t_attn, t_note = _attention_for(forward_config(teacher_model, cfg.teacher),
                                        cfg.data.seq_len, target)
        teacher_model = dataclasses.replace(teacher_model, attention=t_attn)
        cfg = dataclasses.replace(cfg, teacher=dataclasses.replace(cfg.teacher, attention=t_attn))
        if t_note and t_note not in notes:
            notes.append("teacher " + t_note)
    fused = cfg.distill.fused_backend
    if fused in ("auto", "pallas"):
        fused = FUSED_FAMILY[target.backend]
    mode = cohort_mode or default_mode(target.backend)
    cfg = dataclasses.replace(
        cfg, model=dataclasses.replace(cfg.model, attention=attn),
        distill=dataclasses.replace(cfg.distill, fused_backend=fused))
    return cfg, teacher_model, Choices(attn, t_attn, fused, mode, tuple(notes))


def stage_names(cfg: Config, method: str, teacher_model: ModelConfig | None) -> list[str]:
    spec = methods.get(method)
    strategy = make_strategy(dataclasses.replace(
        cfg, distill=dataclasses.replace(cfg.distill, method=spec.name)), cfg.model,
        teacher_model if spec.needs_teacher else None)
    return [s.name for s in strategy.stages()]


def _placed(tree, shardings):
    return jax.tree_util.tree_map(
        lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), tree, shardings)


def _stacked_shardings(mesh, tree):
    """The shardings of K members' trees stacked on a new leading axis (replicated along
    it), each member as `tree_shardings` places it."""
    fsdp = mesh.shape["fsdp"]
    return jax.tree_util.tree_map(
        lambda x: NamedSharding(mesh, P(None, *mesh_lib.param_spec(tuple(x.shape[1:]), fsdp))),
        tree)


# libtpu's refusal: "... HLO temporaries (22.76G) exceeds available HBM (15.75G)"; the
# figure counts the arguments too (hldstudy.aot.report reads it as the total).
_NEEDS = re.compile(r"(?:required for HLO temporaries|memory required[^(]*)\(([\d.]+)G\)")


def _compile(name, kind, method, stage, jitted, args, mesh,
             lower_only: bool = False) -> CompiledStep:
    """Lowers and compiles `jitted` for the devices its arguments are placed on (with
    `lower_only`, lowers it only: its `program_sha256`, no figures). A step
    the compiler refuses for want of memory comes back `refused` (with the bytes it
    said it needs, where it says); any other refusal (a kernel it cannot partition or
    lower) is a RuntimeFault naming the step and the compiler's first line."""
    t0 = time.perf_counter()
    digest = None
    dump = tempfile.TemporaryDirectory(prefix="hldstudy-aot-")
    # A program served from the persistent compilation cache is not compiled, so nothing is
    # dumped and its peak would go unexplained: this compile bypasses that cache.
    cached = jax.config.jax_enable_compilation_cache
    jax.config.update("jax_enable_compilation_cache", False)
    try:
        # Traced under the target's mesh: what sizes itself for the chip being traced
        # for (the fused loss's kernel blocks, chips.traced_target) sees the target.
        with jax.set_mesh(mesh):
            lowered = jitted.trace(*args).lower()
            digest = program_sha256(lowered)
            if lower_only:
                dump.cleanup()
                return CompiledStep(name, kind, method, stage, {}, None,
                                    time.perf_counter() - t0, program_sha256=digest)
            compiled = lowered.compile({"xla_dump_to": dump.name, **DUMP_OPTIONS})
    except Exception as e:  # noqa: BLE001 - the target compiler's refusals are its own types
        dump.cleanup()
        text = str(e)
        first = next((ln.strip() for ln in text.splitlines() if ln.strip()), type(e).__name__)
        if "RESOURCE_EXHAUSTED" in text or "out of memory" in text.lower():
            m = _NEEDS.search(text)
            return CompiledStep(name, kind, method, stage, {}, None,
                                time.perf_counter() - t0, refused=first[:600],
                                needs_bytes=float(m.group(1)) * 2**30 if m else None,
                                program_sha256=digest)
        hint = ""
        if "cannot be automatically partitioned" in text:  # Mosaic over a multi-device mesh
            hint = (" (the fused KD loss's Pallas kernels are not partitioned over the mesh; "
                    "--set distill.fused_backend=xla compiles the loss without them)")
        raise RuntimeFault(f"the {name} step does not compile for the target: "
                           f"{type(e).__name__}: {first[:400]}{hint}") from e
    finally:
        jax.config.update("jax_enable_compilation_cache", cached)
    flops = cost_analysis(compiled).get("flops") if _reports_flops(compiled) else None
    chip = for_device_kind(mesh.devices.flat[0].device_kind)
    hlo = hlo_flops(compiled.as_text(), host_size=nic_host_size(mesh),
                    peak_flops=(chip.bf16_tflops * 1e12) if chip else 0.0,
                    hbm_bytes_per_s=(chip.hbm_gbytes_per_s * 1e9) if chip else 0.0)
    with dump:
        try:
            peak_bytes, groups = peak_groups(dump.name)
        except (OSError, ValueError):  # a compiler that dumps no live ranges: no breakdown
            peak_bytes, groups = None, []
    return CompiledStep(name, kind, method, stage, xla_memory(compiled),
                        None if flops is None else float(flops), time.perf_counter() - t0,
                        peak_bytes=peak_bytes, peak=tuple(groups[:PEAK_GROUPS]), hlo=hlo,
                        program_sha256=digest)


def nic_host_size(mesh) -> int:
    """Devices per host whose collectives with other hosts cross the data-center network
    (`hldstudy.flops.hlo_count`): a GPU mesh over several processes (h100:2x8: 8); 0 for one
    host, and for a TPU slice, whose hosts' chips talk over ICI."""
    devs = list(mesh.devices.flat)
    hosts = {d.process_index for d in devs}
    if devs[0].platform == "tpu" or len(hosts) <= 1:
        return 0
    return len(devs) // len(hosts)


def _reports_flops(compiled) -> bool:
    try:
        return bool(cost_analysis(compiled))
    except Exception:  # noqa: BLE001 - the GPU compiler has no cost analysis
        return False


def mesh_for(cfg: Config, devices):
    mesh = mesh_lib.make_mesh(cfg.train, devices)
    mesh_lib.check_batch_divisible(cfg.data.batch_size, mesh)
    return mesh


def train_program(cfg: Config, teacher_model, method: str, stage: str, mesh,
                  cohort: int | None = None, mode: str = "vmap", layout: str = "colocated"):
    """(name, jitted, abstract args) of the train program the trainer compiles for
    (method, stage), one run or a cohort of K (`hldstudy.train.program`); state donated,
    outputs placed as its inputs, every argument placed on `mesh`."""
    rep = mesh_lib.replicated(mesh)
    fn, (state, batch, teacher_in, hps, bad) = abstract_train_program(
        cfg, method, stage, teacher_model, cohort=cohort, mode=mode, layout=layout)
    if cohort is None:
        state_sh = mesh_lib.tree_shardings(mesh, state)
    else:
        state_sh = _stacked_shardings(mesh, state)
    hps = {k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=rep) for k, v in hps.items()}
    bad = jax.ShapeDtypeStruct(bad.shape, bad.dtype, sharding=rep)
    state = _placed(state, state_sh)
    batch = _placed(batch, {k: mesh_lib.batch_sharding(mesh) for k in batch})
    if teacher_in is not None:
        teacher_in = _placed(teacher_in, _teacher_in_shardings(mesh, teacher_in, layout))
    jitted = jax.jit(fn, out_shardings=(state_sh, None, rep), donate_argnums=(0,))
    label = f"{method}:{stage}" if len(stage_names(cfg, method, teacher_model)) > 1 else method
    name = f"train {label}" + (f" (cohort of {cohort}, {mode})" if cohort else "")
    if layout != "colocated" and methods.get(method).needs_teacher:
        name += f", {layout}"
    return name, jitted, (state, batch, teacher_in, hps, bad)


def _teacher_in_shardings(mesh, teacher_in, layout: str):
    """Where the step's teacher input lies, as the trainer places it: a colocated
    teacher's params as the student's (FSDP); streamed outputs as `RemoteTeacher` puts
    them, the hidden states split by batch like the batch, the head as a parameter."""
    if layout == "colocated":
        return mesh_lib.tree_shardings(mesh, teacher_in)
    rows = mesh_lib.batch_sharding(mesh)
    head = teacher_in.head_weight
    return dataclasses.replace(
        teacher_in, final_hidden=None if teacher_in.final_hidden is None else rows,
        hidden={layer: rows for layer in teacher_in.hidden},
        head_weight=None if head is None else mesh_lib.tree_shardings(mesh, head))


def compile_train(cfg: Config, teacher_model, method: str, stage: str, mesh,
                  cohort: int | None = None, mode: str = "vmap",
                  layout: str = "colocated", lower_only: bool = False) -> CompiledStep:
    """`train_program`, compiled for the mesh's devices in the micro-batches the trainer
    would use there: train.microbatches, or (0, auto) the fewest that fit the device
    (`microbatch_candidates`, fewest first, as `hldstudy.train.loop` compiles them)."""
    memory = device_memory(mesh.devices.flat[0])
    with jax.set_mesh(mesh):
        backend = traced_target()[0]
    candidates = microbatch_candidates(cfg.train.microbatches, cfg.data.batch_size,
                                       mesh.devices.size)
    for i, k in enumerate(candidates):
        kcfg = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, microbatches=k))
        name, jitted, args = train_program(kcfg, teacher_model, method, stage, mesh, cohort,
                                           mode, layout)
        if len(candidates) > 1 or k > 1:
            name += f" ({k} micro-batch{'es' if k > 1 else ''})"
        step = dataclasses.replace(_compile(name, "train", method, stage, jitted, args, mesh,
                                            lower_only),
                                   microbatches=k, sequences=cfg.data.batch_size,
                                   layout=layout)
        fits = lower_only or not step.refused and (
            memory is None or fits_device(step.memory, backend, memory))
        if fits or i == len(candidates) - 1:
            return step
    raise AssertionError("no micro-batch candidate")


def replica_forward(cfg: Config, teacher_model: ModelConfig, method: str):
    """(the teacher's forward config, what it serves): the hidden states every stage of
    `method` asks a replica for (`method_needs`)."""
    strategy = make_strategy(dataclasses.replace(
        cfg, distill=dataclasses.replace(cfg.distill, method=method)), cfg.model,
        teacher_model)
    return forward_config(teacher_model, cfg.teacher), method_needs(strategy, teacher_model)


def compile_teacher_forward(cfg: Config, teacher_model: ModelConfig, method: str,
                            devices, lower_only: bool = False) -> CompiledStep:
    """A teacher replica's forward as `hldstudy.teacher.serve` runs it: the hidden states
    every stage of `method` asks for, in the teacher's inference dtype, for the whole
    global batch (`data.batch_size` sequences) on `teacher.replica_devices` of the
    target's devices (one: the whole batch and the weights on it; several: both split
    over them, `replica_mesh`), in the micro-batches the replica picks there
    (teacher.replica_batch, or `replica_candidates` against the target chip's memory,
    checked by the target's compiler as the replica checks it: `compiler_checked`)."""
    spec = methods.get(method)
    tcfg, needs = replica_forward(cfg, teacher_model, spec.name)
    graphdef, params = nnx.split(nnx.eval_shape(lambda: _transformer(tcfg, 2)), nnx.Param)
    tdt = jnp.dtype(cfg.teacher.dtype)
    params = jax.tree_util.tree_map(lambda x: jax.ShapeDtypeStruct(x.shape, tdt), params)
    run = served(teacher_forward_fn(graphdef, needs.layers, needs.final))  # as the server
    replica = replica_devices(cfg.teacher.replica_devices, devices)
    mesh = replica_mesh(replica)
    with jax.set_mesh(mesh):
        backend = traced_target()[0]
    b, n = cfg.data.batch_size, len(replica)
    memory = device_memory(mesh.devices.flat[0])
    candidates = replica_candidates(cfg.teacher.replica_batch, tcfg, b, cfg.data.seq_len,
                                    layers=needs.layers, head=needs.final,
                                    dtype=cfg.teacher.dtype, backend=backend, memory_bytes=memory,
                                    shards=n)
    params = _placed(params, mesh_lib.tree_shardings(mesh, params))
    batch = {k: v for k, v in abstract_batch(cfg, mesh_lib.batch_sharding(mesh)).items()
             if k in ("tokens", "positions", "segment_ids")}  # what TeacherServer.compute sends
    where = f"over {n} devices, " if n > 1 else ""

    def compile_micro(m: int) -> CompiledStep:
        step = _compile(f"teacher forward (one replica, {where}{b // m} x {m} sequences)",
                        "teacher", spec.name, None, jax.jit(micro_batched(run, b // m)),
                        (params, batch), mesh, lower_only)
        return dataclasses.replace(step, loop_trips=b // m, sequences=b, layout="disaggregated",
                                   replica_devices=n,
                                   planner=replica_forward_memory(
            tcfg, b, m, cfg.data.seq_len, layers=needs.layers, head=needs.final,
            dtype=cfg.teacher.dtype, backend=backend, shards=n))

    # One candidate: compiled once, whatever it needs (the table says whether it fits).
    return compiler_checked(
        candidates, compile_micro,
        lambda st: lower_only or memory is None or (
            not st.refused and fits_device(st.memory, backend, memory)))[1]


def compile_eval(cfg: Config, method: str, teacher_model, mesh,
                 lower_only: bool = False) -> CompiledStep:
    """The trainer's eval step (`make_eval_step`) on the student's params."""
    stage = stage_names(cfg, method, teacher_model)[-1]
    _, (state, *_) = abstract_train_program(cfg, method, stage, teacher_model)
    graphdefs, _ = split_params(*nnx.eval_shape(lambda: (_transformer(cfg.model, 0), None)))
    params = _placed(state["params"], mesh_lib.tree_shardings(mesh, state["params"]))
    return _compile("eval", "eval", method, stage, jax.jit(make_eval_step(graphdefs)),
                    (params, abstract_batch(cfg, mesh_lib.batch_sharding(mesh))), mesh,
                    lower_only)


def _transformer(model_cfg: ModelConfig, seed: int):
    return Transformer(model_cfg, rngs=nnx.Rngs(seed))


def compile_run(cfg: Config, teacher_model: ModelConfig | None, method: str, devices,
                *, cohort: int | None = None, mode: str = "vmap",
                parts: tuple[str, ...] = ("train", "teacher", "eval"),
                layout: str = "colocated", lower_only: bool = False) -> list[CompiledStep]:
    """Every program of one run on `devices` (`lower_only`: lowered, not compiled): the
    train step of each stage of `method` (the cohort step of K with `cohort`; its teacher
    in `layout`: its forward inside the step, or its outputs streamed in), the teacher
    replica's forward (a method with a teacher; on teacher.replica_devices of `devices`,
    as a replica runs it), and the eval step. `cfg` and `teacher_model` come resolved for
    the target (`resolve_for_target`)."""
    mesh = mesh_for(cfg, devices)
    spec = methods.get(method)
    out = []
    if "train" in parts:
        for stage in stage_names(cfg, method, teacher_model):
            out.append(compile_train(cfg, teacher_model, spec.name, stage, mesh, cohort, mode,
                                     layout, lower_only))
    if "teacher" in parts and spec.needs_teacher:
        out.append(compile_teacher_forward(cfg, teacher_model, spec.name, devices, lower_only))
    if "eval" in parts:
        out.append(compile_eval(cfg, spec.name, teacher_model, mesh, lower_only))
    return out


def lower_train(cfg: Config, teacher_model: ModelConfig | None, method: str, stage: str,
                target: Target):
    """The solo train step lowered for `target`'s platform on one abstract device, with
    no compiler installed (`lowering_platforms`): what the target's lowering rejects
    (a kernel block, an operation it lacks) fails here in about a second. `cfg` comes
    resolved for the target."""
    program, args = abstract_train_program(cfg, method, stage, teacher_model)
    jitted = jax.jit(program, donate_argnums=(0,))
    device = jax.sharding.AbstractDevice(device_kind=device_kind(target.chip), num_cores=1,
                                         platform=target.backend)
    with jax.sharding.use_abstract_mesh(
            jax.sharding.AbstractMesh((1,), ("x",), abstract_device=device)):
        return jitted.trace(*args).lower(
            lowering_platforms=(target.platform,))
