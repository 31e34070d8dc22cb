"""`python -m hldstudy.aot` without the aot extra: its bad-input lines and exit codes, the
target names, the shipped GPU target configs against hldstudy.chips, `auto` resolved
against the target (not this CPU host), and a lowering-only smoke of the trainer's own
step for TPU and CUDA at tiny shapes (no compiler installed: `lowering_platforms`).

The full compiles (libtpu, the CUDA plugin) are tests/test_aot_compile.py (marker aot).
"""

import dataclasses
import importlib.util
import re

import pytest

from hldstudy.aot.__main__ import main as aot_main
from hldstudy.aot.compile import Choices, lower_train, resolve_for_target
from hldstudy.aot.targets import GPU_TARGET_FILES, GPU_TARGETS_DIR, gpu_target_config, parse_target
from hldstudy.chips import CHIPS
from hldstudy.config import load_experiment
from hldstudy.errors import ConfigError
from hldstudy.model.presets import preset
from hldstudy.model.transformer import Transformer

HAVE_LIBTPU = importlib.util.find_spec("libtpu") is not None


def _run(capsys, *argv):
    with pytest.raises(SystemExit) as e:
        aot_main(list(argv))
    return e.value.code, capsys.readouterr()


@pytest.mark.parametrize("text,spec,topology", [
    ("v5e:2x4", "v5e:2x4", "2x4"), ("V4:2x2x1", "v4:2x2x1", "2x2x1"),
    ("h100:8", "h100:8", "1x1x8"), ("8xh100", "h100:8", "1x1x8"), ("a100", "a100:1", "1x1x1"),
    ("h200:2x8", "h200:2x8", "1x2x8"),  # two hosts of 8: the step's collectives cross hosts
])
def test_target_names(text, spec, topology):
    t = parse_target(text)
    assert (t.spec, t.topology) == (spec, topology)
    assert t.chip is CHIPS[spec.split(":")[0]]


@pytest.mark.parametrize("text", ["tpu9:2x2", "v5e", "v5e:8", "h100:0", "h100:two", "cpu:1",
                                  "h100:0x8", "h100:2x"])
def test_unknown_or_malformed_target_is_a_config_error(text):
    with pytest.raises(ConfigError, match="--target"):
        parse_target(text)


def test_cli_unknown_target_is_one_line_exit_2(capsys):
    code, out = _run(capsys, "--config", "tiny_distill", "--teacher-preset", "tiny-teacher",
                     "--target", "tpu9:2x2")
    assert code == 2
    assert out.out == ""
    lines = out.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("hldstudy.aot: error: --target:")
    assert "unknown target 'tpu9:2x2'" in lines[0] and "v5e:2x4" in lines[0]


@pytest.mark.skipif(HAVE_LIBTPU, reason="the aot extra is installed here (tests/test_aot_compile)")
@pytest.mark.parametrize("target, compiler", [("v5e:2x4", "libtpu"),
                                              ("h100:8", "CUDA plugin")])
def test_cli_without_the_aot_extra_says_how_to_install_it(capsys, target, compiler):
    code, out = _run(capsys, "--config", "tiny_distill", "--teacher-preset", "tiny-teacher",
                     "--target", target)
    assert code == 2
    lines = out.err.strip().splitlines()
    assert len(lines) == 1, out.err
    assert compiler in lines[0] and "pip install -e '.[aot]'" in lines[0]


def test_cli_teacher_shape_missing_is_exit_2(capsys):
    code, out = _run(capsys, "--config", "tiny_distill", "--target", "v5e:2x4")
    assert code == 2
    assert "--teacher-preset" in out.err and len(out.err.strip().splitlines()) == 1


@pytest.mark.parametrize("name", sorted(GPU_TARGET_FILES))
def test_gpu_target_configs_hold_the_chip_table_memory(name):
    """The GPU compiler schedules against the config's device memory: it is the chip
    table's, one number in two places held equal here."""
    text = gpu_target_config(CHIPS[name])
    mem = int(re.search(r"device_memory_size: (\d+)", text).group(1))
    assert mem == CHIPS[name].device_memory_bytes
    smem = int(re.search(r"shared_memory_per_block_optin: (\d+)", text).group(1))
    assert smem == CHIPS[name].onchip_bytes
    assert (GPU_TARGETS_DIR / GPU_TARGET_FILES[name]).is_file()


def _tiny():
    return load_experiment("experiments/tiny_distill.py"), preset("tiny-teacher")


def test_the_summed_gradient_of_micro_batches_is_sharded_like_the_params():
    """In K micro-batches the planner adds the summed gradient beside the micro-batch's own;
    over an FSDP mesh both are each device's share: K = 2 over 8 devices costs one eighth
    of the gradient more than the same micro-batch run as the whole step (the DisaggKD
    student on 8 x H100 read 1.42x its compiled peak while the sum stayed whole)."""
    from hldstudy.aot.report import predicted_train_memory
    from hldstudy.flops import trainable_params

    cfg, teacher = _tiny()
    cfg, teacher, choices = resolve_for_target(cfg, teacher, parse_target("h100:8"))
    whole = dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, batch_size=8))
    split = dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, batch_size=16),
                                train=dataclasses.replace(cfg.train, microbatches=2))
    one, two = (predicted_train_memory(c, teacher, "kd", "main", 8, 8, choices, None, "gpu",
                                       "colocated") for c in (whole, split))
    grads = trainable_params(cfg.model) * 4
    assert two["temp_bytes"] - one["temp_bytes"] == pytest.approx(grads / 8, rel=0.02)


@pytest.mark.parametrize("target,family,mode", [("v5e:2x4", "pallas_mosaic", "vmap"),
                                                 ("h100:8", "pallas_triton", "vmap")])
def test_auto_is_resolved_against_the_target_not_the_host(target, family, mode):
    cfg, teacher = _tiny()
    assert cfg.distill.fused_backend == "auto"
    out, t_out, ch = resolve_for_target(cfg, teacher, parse_target(target))
    assert out.distill.fused_backend == family == ch.fused_backend
    assert ch.cohort_mode == mode  # the CPU host itself would pick "map"
    assert out.model.attention == ch.attention and t_out.attention == ch.teacher_attention


@pytest.mark.parametrize("target,marker", [("v5e:2x4", "tpu_custom_call"),
                                           ("h100:8", "__gpu$xla.gpu.triton")])
def test_the_trainers_kd_step_lowers_for_the_target(target, marker):
    """Lowering only (no libtpu, no plugin): the solo KD step with the fused loss's
    Pallas kernels of the target's family, in the target's own custom call."""
    cfg, teacher = _tiny()
    tg = parse_target(target)
    cfg, teacher, _ = resolve_for_target(cfg, teacher, tg)
    text = lower_train(cfg, teacher, "kd", "main", tg).as_text()
    assert marker in text


def test_a_lowered_programs_hash_follows_the_program():
    """What a kept compile record is keyed by (hldstudy.aot.fingerprint): the same run
    lowers to the same sha256 twice, one that computes something else (a wider MLP) to
    another."""
    from hldstudy.aot.fingerprint import program_sha256

    cfg, teacher = _tiny()
    tg = parse_target("h100:8")

    def digest(c):
        c, t, _ = resolve_for_target(c, teacher, tg)
        return program_sha256(lower_train(c, t, "kd", "main", tg))

    first = digest(cfg)
    assert first == digest(cfg) and len(first) == 64
    wider = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model,
                                                               d_ff=2 * cfg.model.d_ff))
    assert digest(wider) != first


def test_the_source_hash_covers_the_code_that_lowers_and_nothing_else(tmp_path):
    """A kept record needs lowering again only when code that can shape its program
    changed: every module a lowering loads (a subprocess lowers a KD step and lists
    them, the strategies named by string included) is in `lowering_sources`; the map's
    page is not, so editing it keeps the hash, and editing a layer changes it."""
    import shutil
    import subprocess
    import sys
    from pathlib import Path

    from hldstudy.aot.fingerprint import lowering_sources, source_sha256

    root = Path(__file__).resolve().parent.parent / "hldstudy"
    probe = ("import sys, tests.test_aot as t; t.test_a_lowered_programs_hash_follows_the_program();"
             "from hldstudy.distill import methods; from hldstudy.distill.base import "
             "strategy_class; [strategy_class(methods.get(m)) for m in methods.names()];"
             "print(' '.join(m.__file__ for n, m in sys.modules.items() "
             "if n.startswith('hldstudy') and getattr(m, '__file__', None)))")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                         cwd=root.parent, check=True).stdout.split()
    sources = set(lowering_sources(root))
    loaded = {Path(f).resolve() for f in out} & set(root.rglob("*.py"))
    assert len(loaded) > 50 and loaded <= sources
    assert root / "commands" / "decision_map_page.py" not in sources

    copy = tmp_path / "hldstudy"
    shutil.copytree(root, copy, ignore=shutil.ignore_patterns("__pycache__"))
    first = source_sha256(copy)
    assert first == source_sha256.__wrapped__(root)
    page = copy / "commands" / "decision_map_page.py"
    page.write_text(page.read_text() + "\n# an edit\n")
    assert source_sha256.__wrapped__(copy) == first
    layers = copy / "model" / "layers.py"
    layers.write_text(layers.read_text() + "\n# an edit\n")
    assert source_sha256.__wrapped__(copy) != first


# --------------------------------------------------------------------------- #
# The teacher replica's forward and the eval step, compiled as the run runs them
# --------------------------------------------------------------------------- #


def test_the_teacher_replica_forward_is_one_device_holding_the_whole_batch():
    """`hldstudy.teacher.serve` runs its forward on one device for the whole global
    batch (params and inputs on its default device, no mesh): compiled so on this
    host's devices, its arguments are the teacher's params plus the whole batch's
    tokens, positions and segment ids, not a mesh's share of them."""
    import jax
    import numpy as np
    from flax import nnx

    from hldstudy.aot.compile import compile_teacher_forward

    cfg, teacher = _tiny()
    assert len(jax.devices()) > 1 and cfg.data.batch_size % len(jax.devices()) == 0
    step = compile_teacher_forward(cfg, teacher, "kd", jax.devices())
    abstract = nnx.eval_shape(lambda: Transformer(teacher, rngs=nnx.Rngs(0)))
    n_params = sum(int(np.prod(x.shape)) for x in
                   jax.tree_util.tree_leaves(nnx.state(abstract, nnx.Param)))
    batch = 3 * cfg.data.batch_size * cfg.data.seq_len * 4  # int32 tokens, positions, segments
    param_bytes = n_params * np.dtype(cfg.teacher.dtype).itemsize
    assert step.memory["argument_bytes"] == param_bytes + batch


def test_a_replica_over_several_devices_holds_its_share_of_weights_and_batch():
    """teacher.replica_devices=0: the replica's forward compiled over all of the host's
    devices, each holding its share of the teacher's weights (matrices split by FSDP
    where a dimension divides, vectors whole) and of the batch."""
    import jax
    import numpy as np
    from flax import nnx

    from hldstudy.aot.compile import compile_teacher_forward

    cfg, teacher = _tiny()
    cfg = dataclasses.replace(cfg, teacher=dataclasses.replace(cfg.teacher, replica_devices=0))
    n = len(jax.devices())
    step = compile_teacher_forward(cfg, teacher, "kd", jax.devices())
    assert f"over {n} devices" in step.name
    abstract = nnx.eval_shape(lambda: Transformer(teacher, rngs=nnx.Rngs(0)))
    leaves = jax.tree_util.tree_leaves(nnx.state(abstract, nnx.Param))
    itemsize = np.dtype(cfg.teacher.dtype).itemsize
    whole = sum(int(np.prod(x.shape)) for x in leaves) * itemsize
    split = sum(int(np.prod(x.shape)) // (n if len(x.shape) >= 2 and any(
        d % n == 0 for d in x.shape) else 1) for x in leaves) * itemsize  # vectors whole
    batch = 3 * cfg.data.batch_size * cfg.data.seq_len * 4 // n
    assert step.memory["argument_bytes"] == split + batch < whole


def test_the_trainers_eval_step_is_traced_under_its_mesh(monkeypatch):
    """Trainer.evaluate traces its step under the mesh (`jax.set_mesh`) as the train step
    is and as hldstudy.aot compiles it, so what `auto` decides sees the mesh's chip."""
    from types import SimpleNamespace

    import jax
    import numpy as np
    from flax import nnx

    from hldstudy import sharding as mesh_lib
    from hldstudy.train import loop
    from hldstudy.train.program import make_eval_step
    from hldstudy.train.step import split_params

    seen = []

    def spying_make_eval_step(graphdefs):  # test double: records the mesh seen while tracing
        step = make_eval_step(graphdefs)

        def traced(params, batch):
            seen.append(dict(jax.sharding.get_abstract_mesh().shape))
            return step(params, batch)

        return traced

    monkeypatch.setattr(loop, "make_eval_step", spying_make_eval_step)
    cfg, _ = _tiny()
    mesh = mesh_lib.make_mesh(cfg.train, jax.devices())
    graphdefs, params = split_params(Transformer(cfg.model, rngs=nnx.Rngs(0)), None)
    b, t = len(jax.devices()), 16
    tokens = np.arange(b * t, dtype=np.int32).reshape(b, t) % cfg.model.vocab_size
    batch = {"tokens": tokens, "positions": np.tile(np.arange(t, dtype=np.int32), (b, 1)),
             "segment_ids": np.ones((b, t), np.int32), "targets": tokens,
             "mask": np.ones((b, t), np.int32)}
    fake = SimpleNamespace(_eval_steps={}, mesh=mesh,
                           data=SimpleNamespace(valid_batches=lambda n: [batch] * n))
    out = loop.Trainer.evaluate(fake, graphdefs, params, 2)
    assert out["valid_tokens"] == 2 * b * t
    assert seen == [dict(mesh.shape)]  # traced once, under the run's mesh


def test_where_the_memory_goes_names_the_ops_live_at_a_compiled_steps_peak():
    """The buffers live at the peak of a compiled train step (here on this host's CPU
    devices), read from the buffer assignment the compiler dumps: the step's arguments
    in one group, the rest by the JAX operation that made them; the table says so in
    its "Where the memory goes" lines."""
    import jax

    from hldstudy.aot.compile import compile_train, mesh_for
    from hldstudy.aot.report import where_the_memory_goes

    cfg, teacher = _tiny()
    cfg = dataclasses.replace(cfg, distill=dataclasses.replace(cfg.distill, loss_impl="materialized"))
    step = compile_train(cfg, teacher, "kd", "main", mesh_for(cfg, jax.devices()))
    groups = {g.op: g for g in step.peak}
    assert step.peak_bytes >= sum(g.bytes for g in step.peak) > 0
    assert [g.bytes for g in step.peak] == sorted((g.bytes for g in step.peak), reverse=True)
    # The arguments live at the peak: all of them but a few scalars (the step counters).
    assert 0 <= step.memory["argument_bytes"] - groups["arguments"].bytes <= 64
    # The rest by the JAX operation (the differentiated forward's, here), none by an HLO name.
    assert any(op.startswith("jvp(") for op in groups)
    assert not [op for op in groups if re.search(r"fusion|^param|\.\d+$", op)]
    lines = where_the_memory_goes([{"step": step.name, "peak": {
        "bytes": step.peak_bytes, "largest": [dataclasses.asdict(g) for g in step.peak]}}])
    assert lines[1].startswith("Where the memory goes") and lines[2].startswith("- train kd")


@pytest.mark.parametrize("name,teacher", [("c4_123m_kd", "paper-teacher-3.4b"),
                                          ("c4_735m_hldf", "paper-teacher-3.4b"),
                                          ("disaggkd_qwen35", "qwen3.5-35b-a3b")])
def test_the_study_experiments_compile_without_data_and_name_their_teacher(name, teacher,
                                                                           capsys):
    """What a compile or a FLOP count needs is in the experiment file: no data path (nothing
    reads data), the teacher's shape from teacher.preset; a run still needs the path."""
    from hldstudy.aot.check import load_run
    from hldstudy.commands.flops import main as flops_main
    from hldstudy.config import validate
    from hldstudy.errors import ConfigError
    from hldstudy.model.presets import preset

    cfg, method, model = load_run(f"experiments/{name}.py", [], None, None)
    assert cfg.data.path is None and cfg.teacher.preset == teacher
    assert model == preset(teacher)
    assert flops_main(["--config", f"experiments/{name}.py"]) == 0
    assert "teacher" in capsys.readouterr().out
    with pytest.raises(ConfigError, match="data.path"):
        validate(load_experiment(f"experiments/{name}.py"))


def test_the_train_step_compiles_with_its_teacher_colocated_or_streamed():
    """--layout: the teacher's forward inside the step (its params an argument) or its
    outputs streamed in (no teacher params; its final hidden states split by batch over
    the devices as the trainer places them, and its head); compiled on this host's
    devices."""
    import jax
    import numpy as np
    from flax import nnx

    from hldstudy.aot.check import check_compile
    from hldstudy.aot.compile import compile_train, mesh_for

    cfg, teacher = _tiny()
    cfg = dataclasses.replace(cfg, distill=dataclasses.replace(cfg.distill, loss_impl="materialized"))
    mesh = mesh_for(cfg, jax.devices())
    colocated = compile_train(cfg, teacher, "kd", "main", mesh)
    streamed = compile_train(cfg, teacher, "kd", "main", mesh, layout="disaggregated")
    assert (colocated.layout, streamed.layout) == ("colocated", "disaggregated")
    assert colocated.name.startswith("train kd (")  # the micro-batches it compiled
    assert streamed.name.startswith("train kd, disaggregated (")
    n = len(jax.devices())
    t_params = sum(x.size for x in jax.tree_util.tree_leaves(nnx.state(nnx.eval_shape(
        lambda: Transformer(teacher, rngs=nnx.Rngs(0))), nnx.Param)))
    final_hidden = cfg.data.batch_size * cfg.data.seq_len * teacher.d_model // n
    itemsize = np.dtype(cfg.teacher.dtype).itemsize
    head = teacher.d_model * teacher.vocab_size
    assert (colocated.memory["argument_bytes"] - streamed.memory["argument_bytes"]
            == (t_params - final_hidden - head) * itemsize)
    # Counted from the HLO too; the streamed step runs no teacher forward.
    assert 0 < streamed.hlo.flops < colocated.hlo.flops
    with pytest.raises(ConfigError, match="--layout"):
        check_compile(cfg, "kd", teacher, "h100:8", layout="remote")


def test_a_step_that_does_not_fit_is_told_only_the_knobs_not_on_already():
    from hldstudy.aot.check import next_knobs

    cfg = load_experiment("experiments/c4_123m_kd.py")  # remat on, teacher in bf16, auto
    hint = next_knobs(cfg, {"kind": "train", "microbatches": 2}, 8)
    assert "model.remat" not in hint and "teacher.dtype" not in hint
    assert "train.microbatches, now auto: 2" in hint and "data.batch_size (now 256)" in hint
    hint = next_knobs(cfg, {"kind": "train", "microbatches": 32}, 8)  # one row each
    assert "micro-batches" not in hint
    assert "model.scan_layers" not in hint  # the study's students are scanned
    f32 = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, remat=False,
                                                             scan_layers=False),
                              teacher=dataclasses.replace(cfg.teacher, dtype="float32"))
    hint = next_knobs(f32, {"kind": "train", "microbatches": 1}, 8)
    assert "turn on model.remat" in hint and "teacher.dtype, now float32" in hint
    assert "model.scan_layers" in hint
    assert "serve in bfloat16" not in next_knobs(cfg, {"kind": "teacher"}, 8)
    assert "serve in bfloat16" in next_knobs(f32, {"kind": "teacher"}, 8)
    # A forward-only evaluation step has no micro-batches and no backward to remat.
    hint = next_knobs(f32, {"kind": "eval"}, 8)
    assert "micro-batches" not in hint and "remat" not in hint
    assert "data.batch_size (now 256)" in hint and "model.scan_layers" in hint


def test_a_replicas_flop_model_leaves_out_the_head_it_never_runs():
    """A replica serves the final hidden states and the head's weight; the student rebuilds
    the logits. Its forward's matmuls counted from the compiled HLO are the FLOP model's
    teacher forward without the de-embedding (elementwise, which the HLO count leaves out,
    is the few percent between them); with the head the model read 0.93."""
    import jax

    from hldstudy.aot.compile import compile_teacher_forward
    from hldstudy.aot.report import flop_model
    from hldstudy.flops import step_flops

    cfg, teacher = _tiny()
    step = compile_teacher_forward(cfg, teacher, "kd", jax.devices()[:1])
    model = flop_model(cfg, teacher, step, 1, backend="cpu")
    hw = step_flops(cfg, "kd", None, teacher, grouped_dense=True).hardware
    assert model == hw["teacher"] - hw["teacher_head"] > 0
    assert 0.95 <= step.hlo.flops / model <= 1.0
    assert step.hlo.flops / hw["teacher"] < 0.94
    # HLDF's replica serves both stages' needs (stage 1: a partial stack): the deepest
    step = compile_teacher_forward(cfg, teacher, "hldf", jax.devices()[:1])
    per_stage = [step_flops(cfg, "hldf", s, teacher, grouped_dense=True).hardware
                 for s in ("stage1", "stage2")]
    model = flop_model(cfg, teacher, step, 1, backend="cpu")
    assert model == max(h.get("teacher", 0.0) - h.get("teacher_head", 0.0) for h in per_stage)
    assert 0.95 <= step.hlo.flops / model <= 1.0


def test_the_planner_and_fits_read_one_figure_the_compilers_peak():
    """Each compiler reports its own peak (`memory_analysis().peak_memory_in_bytes`: its
    buffer assignment's worst point) beside what it reserves (arguments + outputs -
    aliased + temporaries). On XLA GPU they are within 2%; libtpu reserves its code
    generation's allocations beyond it (the 9B DisaggKD student on v5p:2x2x2: peak 60.85
    GiB, reserved 81.94). One figure for both the planner's accuracy and `fits`
    (`hldstudy.plan.fits_device`): on a TPU libtpu's peak, the figure it admits a program
    by (it compiled the 9B student at 2 micro-batches with 123.19 GiB reserved on a 95.74
    GiB chip, peak 92.32); elsewhere the total."""
    import jax

    from hldstudy.aot.compile import compile_train, mesh_for
    from hldstudy.aot.report import step_rows
    from hldstudy.plan import compiled_peak

    cfg, teacher = _tiny()
    step = compile_train(cfg, teacher, "kd", "main", mesh_for(cfg, jax.devices()))
    mem = step.memory
    # XLA CPU's own "peak" is its arguments (the planner is held to the total there)
    assert mem["peak_memory_bytes"] < mem["total_bytes"] == compiled_peak(mem, "cpu")
    choices = Choices("dense", "dense", "xla", "vmap", ())
    (row,) = step_rows(cfg, teacher, parse_target("h100:1"), choices, [step], 1, 1)
    assert row["planner_over_compiled"] == row["planner"]["total_bytes"] / mem["total_bytes"]
    # libtpu's report of the same step: a peak below its reservation (the v5p 9B's
    # proportions), the reservation over the device while the peak is not: it fits, as
    # libtpu admitted it; a peak over the device does not
    limit = parse_target("v5e:1x1").chip.device_memory_bytes
    reserved = dict(mem, temp_bytes=mem["temp_bytes"] + 1.1 * limit,
                    total_bytes=mem["total_bytes"] + 1.1 * limit,
                    peak_memory_bytes=mem["total_bytes"])
    tpu = dataclasses.replace(step, memory=reserved)
    (row,) = step_rows(cfg, teacher, parse_target("v5e:1x1"), choices, [tpu], 1, 1)
    assert row["planner_over_compiled"] == row["planner"]["total_bytes"] / mem["total_bytes"]
    assert row["fits"] and row["planner_fits"]
    over = dataclasses.replace(step, memory=dict(reserved, peak_memory_bytes=1.01 * limit))
    (row,) = step_rows(cfg, teacher, parse_target("v5e:1x1"), choices, [over], 1, 1)
    assert not row["fits"]
    # On a GPU the reservation is the figure, whatever the compiler's peak says.
    h100 = parse_target("h100:1").chip.device_memory_bytes
    gpu = dataclasses.replace(step, memory=dict(reserved, total_bytes=1.01 * h100))
    (row,) = step_rows(cfg, teacher, parse_target("h100:1"), choices, [gpu], 1, 1)
    assert not row["fits"]


def test_planner_only_verdicts_read_the_validated_bands_pessimistic_end(monkeypatch):
    """aot's row carries the planner's band (the compiled figure its figure implies, from
    the validation list's span: `validated_band`) and its `planner_fits` reads the high
    end: a planner figure under the device whose band's high end is over it does not
    fit."""
    import jax

    from hldstudy.aot.compile import compile_train, mesh_for
    from hldstudy.aot.report import step_rows
    from hldstudy.plan import compilers

    cfg, teacher = _tiny()
    step = compile_train(cfg, teacher, "kd", "main", mesh_for(cfg, jax.devices()))
    choices = Choices("dense", "dense", "xla", "vmap", ())
    (row,) = step_rows(cfg, teacher, parse_target("h100:1"), choices, [step], 1, 1)
    planned = row["planner"]["total_bytes"]
    lo, hi = dict(compilers.GPU.validated_band).get("train", (1.0, 1.0))
    assert row["planner_band"] == [planned * min(1, 1 / hi), planned * max(1, 1 / lo)]
    # A band whose pessimistic end is 1.5x the figure, on a device between the two.
    wide = dataclasses.replace(compilers.GPU, validated_band=(("train", (2 / 3, 1.0)),))
    monkeypatch.setitem(compilers.COMPILERS, "gpu", wide)
    device = 1.2 * planned
    tight = dataclasses.replace(parse_target("h100:1"), chip=dataclasses.replace(
        parse_target("h100:1").chip, device_memory_bytes=device))
    (row,) = step_rows(cfg, teacher, tight, choices, [step], 1, 1)
    assert row["planner"]["total_bytes"] < device < row["planner_band"][1]
    assert row["planner_band"][1] == pytest.approx(1.5 * planned)
    assert not row["planner_fits"]
