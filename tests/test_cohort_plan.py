"""Study-level planning: which runs share a teacher forward (cohorts), and what the whole
grid costs under the colocated, disaggregated and cohort layouts."""

import json

import pytest

from hldstudy.commands.plan import main as plan_main
from hldstudy.config import Config, DataConfig, TrainConfig
from hldstudy.model import preset
from hldstudy.sweep import Sweep, expand
from hldstudy.sweep.cohorts import cohort_key, group, run_flops, study_flops

TEACHER = preset("tiny-teacher", vocab_size=384)


def _sweep(**kw) -> Sweep:
    base = Config(name="c", model=preset("tiny", vocab_size=384),
                  data=DataConfig(seq_len=64, batch_size=8, tokenizer_vocab_size=384),
                  train=TrainConfig(warmup_steps=1))
    grid = dict(name="c", base=base, methods=("baseline", "kd", "hldf"), lr=(1e-3, 3e-3),
                temperature=(1.0, 2.0), budget_baseline_steps=20, teacher_preset="tiny-teacher")
    return Sweep(**{**grid, **kw})


def test_members_differ_only_in_member_fields():
    runs = expand(_sweep())
    cohorts = group(runs, 100)
    by_method = {c[0].method: [r.run_id for r in c] for c in cohorts}
    assert set(by_method) == {"baseline", "kd", "hldf"}
    assert len(by_method["kd"]) == 4 and len(by_method["hldf"]) == 4  # lr x temperature
    assert [len(c) for c in group(runs, 3) if c[0].method == "kd"] == [3, 1]
    assert all(len(c) == 1 for c in group(runs, 1))
    # A field that changes what is trained (not a member field) splits the cohort.
    split = expand(_sweep(extra_axes=(("distill.divergence", ("forward_kl", "reverse_kl")),)))
    kd = [r for r in split if r.method == "kd"]
    assert len({cohort_key(r) for r in kd}) == 2
    with pytest.raises(ValueError):
        group(runs, 0)


def test_a_seed_sets_the_data_order_and_cohorts_group_the_runs_of_one_seed():
    """A new run varies its initialisation and its data order: the seed axis sets both, so
    the runs of one seed (every configuration) share a cohort's batches and teacher
    forward; `seeds_vary_data_order=False` keeps one data order for every seed."""
    from hldstudy.sweep.grid_exec import data_streams

    runs = expand(_sweep(seeds=(0, 1)))
    kd = [r for r in runs if r.method == "kd"]
    assert {(r.params["train.seed"], r.config.data.seed) for r in kd} == {(0, 0), (1, 1)}
    for c in group(kd, 100):
        assert len({r.config.data.seed for r in c}) == 1 and len(c) == 4  # lr x T, one seed
    assert [len(s) for s in data_streams(runs)] == [len(runs) // 2] * 2
    old = expand(_sweep(seeds=(0, 1), seeds_vary_data_order=False))
    assert {r.config.data.seed for r in old} == {0}
    assert [len(c) for c in group([r for r in old if r.method == "kd"], 100)] == [8]
    assert len(data_streams(old)) == 1


def test_cohort_pays_one_teacher_forward_per_step():
    runs = expand(_sweep())
    per = {r.run_id: run_flops(r, TEACHER) for r in runs}
    out = study_flops(runs, TEACHER, 100)
    colo, coh = out["layouts"]["colocated"], out["layouts"]["cohort"]
    assert colo["teacher_flops"] == pytest.approx(sum(f.teacher for f in per.values()))
    assert out["layouts"]["disaggregated"] == colo
    kd = [r for r in runs if r.method == "kd"]
    hldf = [r for r in runs if r.method == "hldf"]
    # One kd member's and one hldf member's teacher forwards; the baseline has none.
    assert coh["teacher_flops"] == pytest.approx(per[kd[0].run_id].teacher
                                                 + per[hldf[0].run_id].teacher)
    assert per[runs[0].run_id].teacher == 0.0 and runs[0].method == "baseline"
    assert coh["student_flops"] == colo["student_flops"]
    assert coh["total_flops"] == pytest.approx(coh["teacher_flops"] + coh["student_flops"])
    # hldf's stage 1 runs the teacher only to its aligned layer: less than kd's forwards.
    assert per[hldf[0].run_id].teacher < per[kd[0].run_id].teacher


@pytest.mark.parametrize("sweep, total_at_least", [("c4_123m", 4.0), ("c4_735m", 2.0)])
def test_study_grid_with_one_cohort_per_method(sweep, total_at_least, capsys):
    assert plan_main(["--sweep", sweep, "--cohort", "12", "--json"]) == 0
    r = json.loads(capsys.readouterr().out)
    lay = r["layouts"]
    for name in ("colocated", "disaggregated", "cohort"):
        assert set(lay[name]) >= {"teacher_flops", "student_flops", "total_flops",
                                  "device_hours"}
    assert lay["colocated"]["teacher_flops"] / lay["cohort"]["teacher_flops"] >= 10.0
    assert lay["colocated"]["total_flops"] / lay["cohort"]["total_flops"] >= total_at_least
    assert r["cohorts"] == 4  # baseline(s) + kd + hldf + hldc


def test_bad_study_inputs_are_one_line(capsys):
    with pytest.raises(SystemExit) as e:
        plan_main(["--sweep", "c4_123m", "--cohort", "0"])
    assert e.value.code == 2
    assert capsys.readouterr().err.strip().count("\n") == 0


# --------------------------------------------------------------------------- #
# Memory: K students + one teacher


# vmap 2 / 4 and map 4 stay in the default suite; K = 1 and map 2 (~20 s each) are slow.
@pytest.mark.parametrize("mode,k", [pytest.param("vmap", 1, marks=pytest.mark.slow),
                                    ("vmap", 2), ("vmap", 4),
                                    pytest.param("map", 2, marks=pytest.mark.slow), ("map", 4)])
def test_cohort_memory_matches_xla(mode, k):
    """The planner's cohort step vs XLA's memory_analysis() of the compiled (donated)
    cohort step the trainer runs, within the planner's tolerance for the solo step."""
    import jax

    from hldstudy.config import DistillConfig
    from hldstudy.plan import cohort_memory, xla_memory
    from hldstudy.train.program import abstract_train_program

    cfg = Config(model=preset("tiny"), data=DataConfig(batch_size=4, seq_len=64),
                 distill=DistillConfig(method="kd", loss_impl="fused", fused_backend="xla"))
    teacher = preset("tiny-teacher")
    step, args = abstract_train_program(cfg, "kd", None, teacher, cohort=k, mode=mode)
    xla = xla_memory(jax.jit(step, donate_argnums=(0,)).lower(*args).compile())
    pred = cohort_memory(cfg, teacher, k, mode=mode)
    assert pred["argument_bytes"] == pytest.approx(xla["argument_bytes"], rel=0.02)
    assert pred["output_bytes"] == pytest.approx(xla["output_bytes"], rel=0.02)
    assert pred["alias_bytes"] == pytest.approx(xla["alias_bytes"], rel=0.02)
    assert pred["temp_bytes"] == pytest.approx(xla["temp_bytes"], rel=0.15)
    assert pred["total_bytes"] == pytest.approx(xla["total_bytes"], rel=0.15)


def test_cohort_memory_is_k_students_plus_one_teacher():
    from hldstudy.config import DistillConfig
    from hldstudy.plan import cohort_memory, predict_step_memory

    cfg = Config(model=preset("tiny"), data=DataConfig(batch_size=4, seq_len=64),
                 distill=DistillConfig(method="kd"))
    solo = predict_step_memory(cfg, TEACHER)
    one, four = cohort_memory(cfg, TEACHER, 1), cohort_memory(cfg, TEACHER, 4)
    assert one["total_bytes"] == pytest.approx(solo["total_bytes"], rel=1e-3)
    t = solo["terms"]
    # Each member: its state (params + optimizer) and its gradients / activations / logits.
    assert four["argument_bytes"] - one["argument_bytes"] == pytest.approx(
        3 * solo["state_bytes"], rel=1e-3)
    assert four["per_member_bytes"] >= t["params"] + t["optimizer"] + t["grads"]
    # The teacher is paid once: 4 students in one cohort < 4 colocated solo steps.
    assert four["total_bytes"] < 4 * solo["total_bytes"]
    from hldstudy.errors import ConfigError

    with pytest.raises(ConfigError):
        cohort_memory(cfg, TEACHER, 0)


def test_plan_cohort_auto_picks_the_largest_k_that_fits(capsys):
    from hldstudy.plan import GB
    from hldstudy.sweep.cohorts import auto_cohort

    runs = expand(_sweep())
    small = auto_cohort(runs, TEACHER, 1e12)
    assert small["k"] == small["largest_group"] == 4 and small["bytes_at_k_plus_1"] is None
    two = auto_cohort(runs, TEACHER, (small["bytes_at_k"] + auto_cohort(runs, TEACHER, 0)
                                      ["bytes_at_k"]) / 2)
    assert 1 <= two["k"] < 4 and two["bytes_at_k"] <= two["limit_bytes"] \
        < two["bytes_at_k_plus_1"]
    assert auto_cohort(runs, TEACHER, 1.0)["k"] == 0

    # The CLI on the 123M grid, its batch over 16 devices of 80 GB: K fits, K + 1 does not.
    assert plan_main(["--sweep", "c4_123m", "--cohort", "auto", "--hbm", "80", "--devices", "16",
                      "--json"]) == 0
    r = json.loads(capsys.readouterr().out)
    auto = r["cohort_auto"]
    assert r["cohort_size"] == auto["k"] >= 1
    assert auto["bytes_at_k"] <= 80 * GB * 0.9
    assert auto["bytes_at_k_plus_1"] is None or auto["bytes_at_k_plus_1"] > 80 * GB * 0.9
    assert plan_main(["--sweep", "c4_123m", "--cohort", "auto", "--hbm", "80", "--devices", "16",
                      "--usable", "0.5"]) == 0
    out = capsys.readouterr().out
    assert "--cohort auto: K = " in out and "(80 GB x 0.5 usable, the batch over 16" in out
    for bad in (["--cohort", "auto"],  # auto needs the device's memory
                ["--cohort", "auto", "--hbm", "80"]):  # 256 x 2048 tokens on one device
        with pytest.raises(SystemExit) as e:
            plan_main(["--sweep", "c4_123m", *bad])
        assert e.value.code == 2
        assert capsys.readouterr().err.strip().count("\n") == 0


def test_sweep_cohort_auto_from_the_available_memory(tmp_path, monkeypatch, capsys):
    """`python -m hldstudy.sweep SWEEP --cohort auto`: K from the memory available now."""
    from hldstudy.sweep.__main__ import main as sweep_main
    from hldstudy.sweep.cohorts import auto_cohort
    from hldstudy.train import loop

    f = tmp_path / "auto_sweep.py"
    f.write_text('''from hldstudy.config import Config, DataConfig, TrainConfig
from hldstudy.model import preset
from hldstudy.sweep import Sweep


def get_sweep():
    base = Config(name="c", model=preset("tiny", vocab_size=384),
                  data=DataConfig(seq_len=64, batch_size=8, tokenizer_vocab_size=384),
                  train=TrainConfig(warmup_steps=1))
    return Sweep(name="c", base=base, methods=("baseline", "kd", "hldf"), lr=(1e-3, 3e-3),
                 temperature=(1.0, 2.0), budget_baseline_steps=20, teacher_preset="tiny-teacher")
''')
    runs = expand(_sweep())
    one = auto_cohort(runs, TEACHER, 0)["bytes_at_k"]  # the worst single student's step
    for avail, want in ((1e12, 4), (one / 0.9 * 1.001, 1)):
        monkeypatch.setattr(loop, "memory_available", lambda device, a=avail: int(a))
        assert sweep_main([str(f), "--workdir", str(tmp_path / "runs"), "--dry-run", "--json",
                           "--cohort", "auto"]) == 0
        captured = capsys.readouterr()
        assert f"--cohort auto: K = {want} " in captured.err, captured.err
        listing = json.loads(captured.out)
        sizes: dict[str, int] = {}
        for r in listing:
            sizes[r["cohort"]] = sizes.get(r["cohort"], 0) + 1
        assert max(sizes.values()) == want


def test_tpu_counts_the_largest_working_set_not_their_sum():
    """The compilers differ only in temporaries: libtpu's peak is the larger of the
    forward/backward turn and the end of the backward (hldstudy.plan.compilers), XLA CPU
    keeps gradients, activations and logits together, and a colocated teacher's forward
    adds only where its working set exceeds the student's peak."""
    from hldstudy.config import DistillConfig
    from hldstudy.errors import ConfigError
    from hldstudy.plan import cohort_memory, predict_step_memory

    cfg = Config(model=preset("tiny", remat=True), data=DataConfig(batch_size=8, seq_len=128),
                 distill=DistillConfig(method="kd", loss_impl="fused", fused_backend="xla"))
    cpu = predict_step_memory(cfg, TEACHER, compiler="cpu")
    tpu = predict_step_memory(cfg, TEACHER, compiler="tpu")
    for key in ("argument_bytes", "output_bytes", "alias_bytes"):
        assert tpu[key] == cpu[key]
    t = tpu["terms"]
    assert 0 < t["block_working"] <= t["activations"]
    turn, end = t["activations"] + t["logits"], t["grads"] + t["block_working"]
    student = t["grads"] + t["activations"] + t["logits"]
    assert cpu["temp_bytes"] >= student
    assert max(turn, end) <= tpu["temp_bytes"] < cpu["temp_bytes"]
    # A vmapped cohort on the TPU: K members' peaks, the teacher once.
    k4 = cohort_memory(cfg, TEACHER, 4, compiler="tpu")
    assert k4["temp_bytes"] >= 4 * max(turn, end) + t["teacher_outputs"]
    assert k4["temp_bytes"] < cohort_memory(cfg, TEACHER, 4, compiler="cpu")["temp_bytes"]
    with pytest.raises(ConfigError, match="compiler"):
        predict_step_memory(cfg, TEACHER, compiler="npu")
