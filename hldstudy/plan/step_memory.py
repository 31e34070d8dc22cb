"""What XLA reports for one compiled train step (solo or cohort) or teacher forward, predicted
in closed form.

`predict_step_memory` maps the planner's terms (`hldstudy.plan.terms`) onto the
four numbers of `compiled.memory_analysis()` for hldstudy's own step (small
configs, one device); `cohort_memory` does the same for the cohort step of K
students sharing one teacher (`hldstudy.train.cohort`), `predict_teacher_forward_memory`
for the teacher's forward alone (a replica, the disaggregated teacher side); `xla_memory` reads
XLA's report in the same keys, so tests compare the two.
"""

from __future__ import annotations

from hldstudy.config import Config, ModelConfig, experts_run_dense, moe_dispatch_for
from hldstudy.distill import methods
from hldstudy.errors import ConfigError
from hldstudy.flops import step_flops, trainable_params
from hldstudy.plan.compilers import CPU, peak_habits
from hldstudy.plan.terms import (
    capacity_bytes,
    dtype_bytes,
    grouped_dense_bytes,
    layer_activation_bytes_per_token,
    logits_bytes_fused,
    logits_bytes_materialized,
    train_activation_bytes,
)
from hldstudy.shapes import ModelShape as PlanModel
from hldstudy.shapes import scanned_layers


def predict_step_memory(cfg: Config, teacher_model: ModelConfig | None = None, *,
                        method: str | None = None, stage: str | None = None,
                        layout: str = "colocated", donate: bool = True,
                        attention: str = "dense", compiler: str = "cpu") -> dict:
    """Predicted `compiled.memory_analysis()` of one train step on one device, as
    `compiler` ("cpu", "gpu", "tpu": `hldstudy.plan.compilers`) schedules it.

    Terms map onto XLA's report:
      argument_bytes: the train state (student params + regressors, AdamW mu
        and nu of the *trainable* ones in the param dtype, step counter), the
        batch (tokens, positions, segment ids, targets int32 + mask bool), and
        the teacher's input: its params (colocated) or the streamed hidden
        states and head (disaggregated).
      output_bytes: the new state (+ a few scalar metrics).
      alias_bytes: the state again when it is donated (the trainer donates).
      temp_bytes: the student's peak + the teacher's kept outputs (colocated; its
        forward's working set only where it exceeds the student's peak, as it runs
        first). The student's peak: gradients + saved activations of the layers run
        + the logits peak where the compiler keeps them together (XLA CPU, GPU); on
        the TPU the larger of activations + logits (the forward/backward turn) and
        gradients + one block's working set (the end of the backward).
      total_bytes: argument + output - alias + temp (resident at the peak).

    method / stage default to the config's; layout: "colocated" or
    "disaggregated" (ignored for baseline).
    """
    spec = methods.get(method or cfg.distill.method)
    method = spec.name
    m = cfg.model
    s = PlanModel.from_model_config(m, "student")
    pb, cb = dtype_bytes(m.param_dtype), dtype_bytes(m.dtype)
    b, seq = cfg.data.batch_size, cfg.data.seq_len
    tok = b * seq
    bd = step_flops(cfg, method, stage, teacher_model if spec.needs_teacher else None)
    d_t = teacher_model.d_model if teacher_model is not None else 0
    n_pairs = len(bd.layer_pairs)
    aux = n_pairs * (m.d_model * d_t + d_t) * 4  # float32 regressors
    trainable = trainable_params(m, None if bd.student_head else bd.student_layers) * pb + aux
    params = s.total_params() * pb + aux
    state = params + 2 * trainable + 4
    batch = tok * (4 * 4 + 1)
    acts = train_activation_bytes(s, tok, seq, cb, remat=m.remat, attention=attention,
                                  n_layers=bd.student_layers)
    acts += n_pairs * 2 * tok * d_t * 4  # regressor outputs and their error
    if not bd.student_head:
        logits = 0.0
    elif not bd.teacher_head:
        logits = logits_bytes_materialized(tok, m.vocab_size, with_teacher=False)
    elif cfg.distill.loss_impl == "fused":
        logits = logits_bytes_fused(tok, m.vocab_size, m.d_model, 64, 1 << 20)
    else:
        logits = logits_bytes_materialized(tok, m.vocab_size, with_teacher=True)
    habits = peak_habits(compiler)
    block = tok * max((layer_activation_bytes_per_token(s, seq, cb, attention, i)
                       for i in range(bd.student_layers)), default=0.0)
    terms = {"params": params, "optimizer": 2 * trainable, "batch": batch, "grads": trainable,
             "activations": acts, "logits": logits, "block_working": min(block, acts),
             "scan_stack": scan_stack_bytes(s, tok, seq, cb, m, bd.student_layers,
                                            [ls for ls, _ in bd.layer_pairs], attention)}
    argument = state + batch
    temp, overlap = _member_peak(terms, habits)
    working = 0.0
    if spec.needs_teacher:
        t = PlanModel.from_model_config(teacher_model, "teacher")
        tpb = dtype_bytes(cfg.teacher.dtype)
        kept = tok * d_t * tpb * (len({tt for _, tt in bd.layer_pairs}) + int(bd.teacher_head))
        head = t.head_params * tpb if bd.teacher_head else 0.0
        if layout == "colocated":
            # jit drops unused arguments: HLDF stage 1 passes only the blocks it runs.
            terms["teacher_params"] = trainable_params(
                teacher_model, None if bd.teacher_head else bd.teacher_layers) * tpb
            working = habits.teacher_forward_share * tok * \
                layer_activation_bytes_per_token(t, seq, tpb, attention)
            terms["teacher_outputs"] = max(kept, habits.teacher_live_copies * tok * d_t * tpb)
            terms["teacher_activations"] = max(0.0, working - overlap)
            argument += terms["teacher_params"]
            temp += terms["teacher_outputs"] + terms["teacher_activations"]
        elif layout == "disaggregated":
            terms["teacher_inputs"] = kept + head
            argument += terms["teacher_inputs"]
        else:
            raise ConfigError("layout", f"{layout!r} is not one of colocated, disaggregated")
    output = state + 4 * 4
    alias = state if donate else 0.0
    return {"argument_bytes": argument, "output_bytes": output, "alias_bytes": alias,
            "temp_bytes": temp, "total_bytes": argument + output - alias + temp, "terms": terms,
            "state_bytes": state, "teacher_working_bytes": working if layout == "colocated" else 0.0}


# XLA CPU's (hldstudy.plan.compilers): calibrated on tests/test_cohort_plan.py's shapes
# (K = 2..8 within 10%).
VMAP_ACT_EXTRA = CPU.vmap_activation_extra


def scan_stack_bytes(s: PlanModel, tokens: float, seq_len: int, compute_bytes: int,
                     m: ModelConfig, n_run: int, stops, attention: str) -> float:
    """What a scanned stack (`model.scan_layers`) saves for its backward as stacked
    buffers, [groups, ...] per layer of its period: every scanned block's input under
    remat, its whole training working set without. Unlike an unrolled stack's, these are
    freed only when the backward's scan ends. 0 unscanned."""
    if not m.scan_layers:
        return 0.0
    layers = scanned_layers([s.layer_kind(i) for i in range(n_run)], n_run, stops)
    if m.remat:
        return tokens * len(layers) * s.d_model * compute_bytes
    # Without remat a scanned block saves what it would unrolled.
    return tokens * sum(layer_activation_bytes_per_token(s, seq_len, compute_bytes,
                                                         attention, i) for i in layers)


def _member_peak(terms: dict, habits, vmap_extra: float = 0.0) -> tuple[float, float]:
    """(bytes of one student's step at its peak, the part of it that a colocated teacher's
    forward working set overlaps: it runs before the student's backward).

    grads_beside_activations (XLA CPU, GPU): gradients + activations (+ `vmap_extra` of
    them) + logits, of which activations + logits overlap the teacher's forward. TPU: the
    larger of the forward/backward turn (activations + logits) and the end of the backward
    (gradients + one block's working set, and `block_backward_extra` of it for the
    block's backward, + a scanned stack's saved buffers, freed only
    when its backward ends), plus the stack again where libtpu's peak holds it twice
    (`scan_stack_extra_copies`); the teacher overlaps all of it."""
    acts = terms["activations"] * (1.0 + vmap_extra)
    turn = acts + terms["logits"]
    if habits.grads_beside_activations:
        return terms["grads"] + turn, terms["activations"] + terms["logits"]
    stack = terms.get("scan_stack", 0.0) * (1.0 + vmap_extra)
    block = (1.0 + habits.block_backward_extra) * terms["block_working"]
    peak = max(turn, terms["grads"] + block + stack)
    peak += habits.scan_stack_extra_copies * stack
    return peak, peak


def cohort_memory(cfg: Config, teacher_model: ModelConfig | None, k: int, *,
                  method: str | None = None, stage: str | None = None,
                  layout: str = "colocated", varying: int = 2, donate: bool = True,
                  attention: str = "dense", mode: str = "vmap", compiler: str = "cpu") -> dict:
    """Predicted `compiled.memory_analysis()` of one cohort step (`hldstudy.train.cohort`):
    K students, one teacher, as `compiler` schedules it (`hldstudy.plan.compilers`).

    mode "vmap" (batched members, the accelerator default): every member's gradients,
    activations and logits are live at once. mode "map" (`jax.lax.map`, one member after
    the other, the CPU default): one member's working set, plus the stacked new states
    being written (K states) and the member being updated (one state) - measured on XLA
    CPU: temporaries grow by one state per member.

    Per member (x K): the train state (params + optimizer state, argument, output and
    aliased when donated), and in temporaries its gradients, activations and logits
    peak. Once: the batch, the teacher's params (colocated) or streamed outputs
    (disaggregated), the teacher's kept outputs, and its forward's working set where it
    exceeds the K students' peak (it runs first). Plus K x `varying` float32
    hyperparameters and the [K] int32 divergence record. Same keys as
    `predict_step_memory` (k = 1 is the solo step plus those few bytes), and
    "per_member_bytes" / "shared_bytes" (what one more member adds / what stays)."""
    if k < 1:
        raise ConfigError("cohort", f"a cohort has at least one member, got {k}")
    one = predict_step_memory(cfg, teacher_model, method=method, stage=stage, layout=layout,
                              donate=donate, attention=attention, compiler=compiler)
    habits = peak_habits(compiler)
    t = one["terms"]
    state = one["state_bytes"]
    if mode not in ("vmap", "map"):
        raise ConfigError("mode", f"{mode!r} is not one of vmap, map")
    # batched layers: the compiler may keep more of each member's activations
    extra = habits.vmap_activation_extra if k > 1 and mode == "vmap" else 0.0
    member_temp, overlap = _member_peak(t, habits, extra)
    small = k * (4 * varying + 4)  # hyperparameters and the divergence record
    argument = k * state + t["batch"] + t.get("teacher_params", 0.0) \
        + t.get("teacher_inputs", 0.0) + small
    output = k * (state + 4 * 4) + 4 * k
    alias = k * state if donate else 0.0
    live = k if mode == "vmap" else 1  # members whose working set is live at the peak
    teacher_temp = t.get("teacher_outputs", 0.0) \
        + max(0.0, one["teacher_working_bytes"] - live * overlap)
    if mode == "vmap":
        temp = k * member_temp + teacher_temp
        per_member = 2 * state + member_temp - (state if donate else 0.0)
    else:
        temp = member_temp + teacher_temp + ((k + 1) * state if k > 1 else 0.0)
        per_member = 3 * state - (state if donate else 0.0)
    total = argument + output - alias + temp
    return {"argument_bytes": argument, "output_bytes": output, "alias_bytes": alias,
            "temp_bytes": temp, "total_bytes": total, "k": k,
            "per_member_bytes": per_member, "shared_bytes": total - k * per_member}


def largest_cohort(fits, k_max: int) -> int:
    """The largest K in 1..k_max with fits(K) (memory grows with K); 0 when none fits."""
    best = 0
    for k in range(1, max(k_max, 0) + 1):
        if not fits(k):
            break
        best = k
    return best


def xla_memory(compiled) -> dict[str, float]:
    """The same keys from XLA's `compiled.memory_analysis()`, and `peak_memory_bytes`."""
    ma = compiled.memory_analysis()
    if isinstance(ma, (list, tuple)):
        ma = ma[0]
    out = {"argument_bytes": ma.argument_size_in_bytes, "output_bytes": ma.output_size_in_bytes,
           "alias_bytes": ma.alias_size_in_bytes, "temp_bytes": ma.temp_size_in_bytes}
    out["total_bytes"] = (out["argument_bytes"] + out["output_bytes"] - out["alias_bytes"]
                          + out["temp_bytes"])
    # The compiler's own peak where it reports one; what it counts differs by compiler
    # (compiled_peak).
    peak = getattr(ma, "peak_memory_in_bytes", 0)
    if peak > 0:
        out["peak_memory_bytes"] = peak
    return {k: float(v) for k, v in out.items()}


def compiled_peak(compiled: dict, backend: str) -> float:
    """The compiled program's peak, bytes per device, that the planner predicts. libtpu
    ("tpu") reports its own (`peak_memory_bytes`: `memory_analysis().peak_memory_in_bytes`,
    its buffer assignment's worst point, arguments included: the 123M KD step on v5p
    18.83 GiB against the dumped live ranges' 18.75) and reserves its code generation's
    allocations beyond it (the total: 21.41 there; the 9B DisaggKD student 60.85 against
    81.94). A refused compile's figure is the buffer assignment's too (arguments + its
    temporaries). Elsewhere the total: XLA GPU's peak is within 2% of it, XLA CPU's counts
    the arguments only."""
    if backend == "tpu" and compiled.get("peak_memory_bytes"):
        return compiled["peak_memory_bytes"]
    return compiled["total_bytes"]


def fits_device(memory: dict, backend: str, limit: float) -> bool:
    """The one rule for whether a compiled program fits `limit` bytes per device, read by
    aot's `fits`, the auto micro-batch searches, a replica's runtime check, the planner's
    accuracy and the decision map alike: its `compiled_peak` (xla_memory's keys) within
    the limit. On a TPU that is libtpu's own peak, not its total, because that is the
    figure libtpu admits a program by: it refuses on its buffer assignment (the 123M step
    on v5e: \"HLO temporaries (22.76G)\" = arguments 13.62 + temporaries 9.14) and
    compiled the 35B-A3B -> 9B student on v5p at 2 micro-batches with a total of 123.19
    GiB on a 95.74 GiB chip (peak 92.32). Whether such a program also runs is for a lent
    TPU to show."""
    return compiled_peak(memory, backend) <= limit


def predict_teacher_forward_memory(teacher_model: ModelConfig, batch_size: int, seq_len: int,
                                   *, layers: tuple[int, ...] = (), head: bool = True,
                                   dtype: str = "float32", attention: str = "dense",
                                   grouped_dense: bool | None = None,
                                   compiler: str = "cpu") -> dict:
    """Predicted `compiled.memory_analysis()` of the teacher's forward alone (what a
    replica or the disaggregated teacher side runs: `teacher_forward_fn`), one device, as
    `compiler` ("cpu", "gpu", "tpu": `hldstudy.plan.compilers`) schedules it.

      argument_bytes: the teacher's params in `dtype` (every expert; without the head only
        the embedding and the blocks run), the batch (tokens, positions, segment ids, int32).
      output_bytes: the streamed `TeacherOutputs`: each requested layer's hidden states,
        the final hidden states and the head weight when the head is needed.
      temp_bytes: the forward's working set: the compiler's `replica_forward_share` (with
        a memory-efficient attention path, `replica_forward_share_flash`) of the
        largest block's training activations plus the kept hidden states; and for an MoE,
        where `ragged_dot` runs dense over all experts (grouped_dense; None: as the
        model's `moe_dispatch` runs under `compiler`, `config.experts_run_dense`) the
        expanded experts (`grouped_dense_bytes`), where it runs by capacity one layer's
        buffers (`capacity_bytes`), and where the Hopper kernels run it (ragged on a GPU)
        one layer's routed rows exactly: the capacity buffers at factor 1 (the compiled
        35B-A3B replica holds the sorted rows, the kernel's output and the scattered
        result, each [tokens x k, d], with the gate and up products).
    """
    t = PlanModel.from_model_config(teacher_model, "teacher")
    c = dtype_bytes(dtype)
    tok = batch_size * seq_len
    # Without the head only the blocks up to the deepest requested layer run, and jit drops
    # the unused parameters.
    n_run = t.n_layers if head else max(layers)
    argument = trainable_params(t, None if head else n_run) * c + 3 * tok * 4
    n_out = len(layers) + int(head)
    output = n_out * tok * t.d_model * c + (t.head_params * c if head else 0.0)
    block = max(layer_activation_bytes_per_token(t, seq_len, c, attention, i)
                for i in range(n_run))
    habits = peak_habits(compiler)
    share = habits.replica_forward_share
    if attention != "dense" and habits.replica_forward_share_flash is not None:
        share = habits.replica_forward_share_flash
    temp = tok * (share * block + (1 + n_out) * t.d_model * c)
    if grouped_dense is None:
        grouped_dense = experts_run_dense(teacher_model.moe_dispatch, compiler)
    if grouped_dense:
        temp += grouped_dense_bytes(t, tok, c, n_run)
    elif moe_dispatch_for(teacher_model.moe_dispatch, compiler) == "capacity":
        temp += capacity_bytes(t, tok, c, teacher_model.moe_capacity_factor)
    elif compiler == "gpu":
        temp += capacity_bytes(t, tok, c, 1.0)
    return {"argument_bytes": float(argument), "output_bytes": float(output),
            "alias_bytes": 0.0, "temp_bytes": temp, "total_bytes": argument + output + temp}
