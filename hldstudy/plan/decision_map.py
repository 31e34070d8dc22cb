"""The seed's decision map from the planner: for a teacher -> student pair on a target (a chip
and how many of it), whether the colocated step (fused loss) fits, whether the disaggregated
layout (the student on the target's devices, the teacher on replicas of its own) fits, the
peak per device of each, and the stream's network need against the link.
Design notes: `docs/planner.md`, under this file's name.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

from hldstudy.chips import Chip
from hldstudy.errors import ConfigError
from hldstudy.plan.compilers import validation_band
from hldstudy.plan.layouts import PlanInputs, plan
from hldstudy.shapes import ModelShape


@dataclasses.dataclass(frozen=True)
class MapPair:
    teacher: str          # model presets
    student: str
    config: str           # the experiment file its compiled cells compile
    tokens_per_step: int = 1_048_576
    seq_len: int = 4096
    branch: str = ""      # the branch of the seed's rule the pair stands for

    @property
    def name(self) -> str:
        return f"{self.teacher} -> {self.student}"


PAIRS = (
    # The seed's first branch: a small teacher beside its student on one or two nodes, where
    # colocated with the fused loss should do (the HLD study's own pair, 256 x 2048 tokens).
    MapPair("paper-teacher-3.4b", "paper-123m", "experiments/c4_123m_kd.py",
            tokens_per_step=524_288, seq_len=2048,
            branch="a small teacher on one or two nodes: colocated with the fused loss "
                   "should suffice"),
    MapPair("qwen3.5-35b-a3b", "qwen3.5-9b", "experiments/disaggkd_qwen35.py",
            branch="a teacher that fits beside its student: disaggregate where it is faster"),
    MapPair("qwen3.5-122b-a10b", "qwen3.5-35b-a3b", "experiments/disaggkd_qwen35_122b.py",
            branch="a teacher too large to sit beside its student: disaggregate"),
)
# One node of each (8 GPUs; v5p:2x2x2 is two 4-chip hosts, 8 chips) and twice each: 16 GPUs
# as two hosts of 8 (the collectives that cross the hosts then cross the NIC in the program).
TARGETS = ("h100:8", "h200:8", "v5p:2x2x2", "h100:2x8", "h200:2x8", "v5p:2x2x4")
# A replica's devices: powers of two (its micro-batch rows are dealt over them), from one
# GPU; a TPU replica is a slice of its own, a whole host (v5p: 2x2x1) at the least.
REPLICA_DEVICES = (1, 2, 4, 8, 16)
# The model FLOPs utilisation the map's times assume, for student and replica alike: an
# estimate until a lent device measures a step (benchmarks/device_suite.py sets its
# measured time beside this one).
ESTIMATE_MFU = 0.4


def replica_device_counts(chip: Chip) -> tuple[int, ...]:
    if chip.platform == "tpu":
        return tuple(n for n in REPLICA_DEVICES if n >= chip.devices_per_node)
    return REPLICA_DEVICES


def slice_spec(chip: Chip, n: int) -> str:
    """The aot target of `n` devices of `chip`: h100:4, v5p:2x2x1 (TPU slices of 4, 8, 16
    chips as 2x2xN)."""
    if chip.platform == "tpu":
        return f"{chip.name}:2x2x{n // 4}"
    return f"{chip.name}:{n}"


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


@dataclasses.dataclass(frozen=True)
class CellSizes:
    """The memory model a cell is sized with, bytes per device as the target's compiler
    would schedule each program (`hldstudy.aot.planned`: the planner aot holds to the
    compiler): `train(layout, microbatches)` the student's step, `replica(devices,
    sequences per forward)` one replica's forward; `backend` the target compiler whose
    validation band (`plan.compilers.validation_band`) a verdict reads."""

    train: Callable[[str, int], float]
    replica: Callable[[int, int], float]
    backend: str


def map_cell(teacher: ModelShape, student: ModelShape, chip: Chip, n_devices: int,
             sizes: CellSizes, *, tokens_per_step: int, seq_len: int, usable: float = 0.9,
             mfu: float = ESTIMATE_MFU) -> dict:
    """One cell: both layouts on `n_devices` of `chip`, sized by `sizes`, each at the
    fewest micro-batches whose band's pessimistic end fits `usable` of the device (the
    most when none does: its figure then says by how much); the replica over the fewest
    devices (`replica_device_counts`) that hold the teacher's forward, as many replicas as
    keep the student busy. Times and the stream's need from the planner's FLOPs
    (`plan.layouts.plan`) at `mfu`: the stream's need per device (the student's inbound,
    a replica device's outbound) is held against `chip.scale_out_gbps`."""
    if not (chip.bf16_tflops and chip.scale_out_gbps):
        raise ConfigError("target", f"{chip.name} has no compute or link figures in "
                          "hldstudy.chips", "choose a chip with them: h100, h200 or v5p")
    sequences = tokens_per_step // seq_len
    if tokens_per_step % seq_len or sequences % n_devices:
        raise ConfigError("tokens_per_step", f"{tokens_per_step} tokens of {seq_len} do not "
                          f"split into whole sequences over {n_devices} devices")
    limit = chip.device_memory_bytes * usable

    def fits(nbytes: float, kind: str = "train") -> bool:  # the band's pessimistic end
        return validation_band(nbytes, sizes.backend, kind)[1] <= limit

    def fewest(layout: str) -> tuple[int, float]:
        counts = divisors(sequences // n_devices)
        for k in counts:
            nbytes = sizes.train(layout, k)
            if fits(nbytes):
                return k, nbytes
        return counts[-1], nbytes

    (k_col, col_bytes), (k_dis, dis_bytes) = fewest("colocated"), fewest("disaggregated")
    base = PlanInputs(teacher=teacher, student=student, tokens_per_step=tokens_per_step,
                      devices=n_devices, link_gbps=chip.scale_out_gbps, seq_len=seq_len,
                      remat=True, tflops=chip.bf16_tflops, mfu=mfu)
    col = plan(dataclasses.replace(base, grad_accum=k_col))["colocated"]
    run = plan(dataclasses.replace(base, grad_accum=k_dis))
    dis = run["disaggregated"]
    replica = _replica(sizes, sequences, fits, replica_device_counts(chip))
    # Teacher devices that keep up with the student (the planner's count at one step's
    # FLOPs), in whole replicas.
    keep_up = dis["teacher_devices_for_throughput"]
    r_dev = replica["devices"]
    replicas = max(1, math.ceil(keep_up / r_dev))
    teacher_time = dis["teacher_step_time_s"] * n_devices / (replicas * r_dev)
    step_time = max(dis["student_step_time_s"], teacher_time)
    hidden = run["network_bytes_per_step"]["hidden"]
    need = 8 * hidden / min(n_devices, replicas * r_dev) / step_time / 1e9
    # What streaming the teacher's logits instead would need (the alternative the seed
    # argues against): the vocabulary's width per token, not the hidden state's.
    logits_need = need * run["network_bytes_per_step"]["logits_over_hidden"]
    student_fits = fits(dis_bytes)
    if not (student_fits and replica["fits"]):
        verdict = "out of memory"
    elif need > chip.scale_out_gbps:
        verdict = "network-bound"
    else:
        verdict = "fits"
    return {
        "devices": n_devices, "device_memory_bytes": chip.device_memory_bytes,
        "tokens_per_step": tokens_per_step, "seq_len": seq_len,
        "limit_bytes": limit, "usable": usable, "backend": sizes.backend,
        "colocated": {"fits": fits(col_bytes), "microbatches": k_col,
                      "peak_bytes": col_bytes,
                      "band_bytes": list(validation_band(col_bytes, sizes.backend)),
                      "step_time_s": col["step_time_s"],
                      # every device counted: here the target's, disaggregated the
                      # replicas' too (the planner's FLOPs at `mfu`: an estimate)
                      "tokens_per_s_per_device":
                          tokens_per_step / col["step_time_s"] / n_devices},
        "disaggregated": {
            "fits": verdict == "fits", "verdict": verdict, "microbatches": k_dis,
            "peak_bytes": dis_bytes, "student_fits": student_fits,
            "band_bytes": list(validation_band(dis_bytes, sizes.backend)),
            "replica_devices": r_dev, "replica_microbatches": replica["microbatches"],
            "replica_batch": sequences // replica["microbatches"],
            "replica_peak_bytes": replica["peak_bytes"], "replica_fits": replica["fits"],
            "replica_band_bytes": list(validation_band(replica["peak_bytes"], sizes.backend,
                                                       "replica")),
            "replicas": replicas, "devices_total": n_devices + replicas * r_dev,
            "step_time_s": step_time, "hidden_bytes_per_step": hidden,
            "tokens_per_s_per_device":
                tokens_per_step / step_time / (n_devices + replicas * r_dev),
            "need_gbps": need, "logits_need_gbps": logits_need,
            "link_gbps": chip.scale_out_gbps},
    }


def _replica(sizes: CellSizes, sequences: int, fits, counts: tuple[int, ...]) -> dict:
    """The fewest replica devices of `counts` that hold the teacher's forward, at the fewest
    micro-batches (its step's sequences dealt over the devices); the most devices at the
    most micro-batches when none does."""
    last = None
    for n in counts:
        if sequences % n:
            continue
        for m in divisors(sequences // n):
            peak = sizes.replica(n, sequences // m)
            last = {"devices": n, "microbatches": m, "peak_bytes": peak,
                    "fits": fits(peak, "replica")}
            if last["fits"]:
                return last
    return last


def check_vocabularies(teacher: ModelShape, student: ModelShape, field: str,
                       who: str = "") -> None:
    """Distillation matches the teacher's vocabulary: a pair whose vocabularies differ is
    refused, naming `field` (and `who`, the pair)."""
    if teacher.vocab_size != student.vocab_size:
        raise ConfigError(field, f"{who}the teacher's vocabulary ({teacher.vocab_size:,}) "
                          f"is not the student's ({student.vocab_size:,})",
                          "pair models that share a tokenizer")


def decision_map(pairs=PAIRS, targets: tuple[tuple[str, Chip, int], ...] = (), *,
                 shape_of=None, sizes_of=None, usable: float = 0.9,
                 mfu: float = ESTIMATE_MFU) -> list[dict]:
    """Every (pair, target) cell: `targets` as (spec, chip, devices); `shape_of(preset)` the
    planner's shape of a model preset (`hldstudy.plan.plan_model`), `sizes_of(pair, spec)`
    the cell's CellSizes."""
    cells = []
    for pair in pairs:
        t, s = shape_of(pair.teacher), shape_of(pair.student)
        check_vocabularies(t, s, "pair", f"{pair.name}: ")
        for spec, chip, n in targets:
            cell = map_cell(t, s, chip, n, sizes_of(pair, spec),
                            tokens_per_step=pair.tokens_per_step, seq_len=pair.seq_len,
                            usable=usable, mfu=mfu)
            cell.update({"pair": pair.name, "config": pair.config, "target": spec,
                         "chip": chip.name})
            cells.append(cell)
    return cells
