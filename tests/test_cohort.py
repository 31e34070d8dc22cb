"""Cohort training: a member equals its solo run, resumes exactly, diverges alone.

The default suite keeps the traced-hyperparameter checks and the divergence test (which
also holds two members to their solo runs); member == solo per method, resume after
SIGTERM / kill -9 / a damaged checkpoint are `-m slow` (40-120 s each on 2 cores)."""

import dataclasses
import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers.runs import train_and_kill

from hldstudy.config import Config, DataConfig, DistillConfig, TrainConfig
from hldstudy.losses import fused_kd_loss
from hldstudy.model import preset
from hldstudy.rundir import checkpoint_steps
from hldstudy.train.cohort import DIVERGED, CohortTrainer
from hldstudy.train.loop import Interrupted, Trainer
from hldstudy.train.optim import lr_schedule

ROOT = Path(__file__).resolve().parent.parent
VOCAB = 384
RTOL = 1e-5
DEV = jax.devices()[:1]


def _data():
    return DataConfig(seq_len=64, batch_size=8, tokenizer_vocab_size=VOCAB, synthetic_docs=600,
                      synthetic_valid_docs=50)


def _train(steps, **kw):
    return TrainConfig(steps=steps, lr=3e-3, warmup_steps=2, log_every=1, checkpoint_every=4,
                       eval_batches=2, progress=False, **kw)


@pytest.fixture(scope="module")
def teacher_dir(tmp_path_factory):
    work = tmp_path_factory.mktemp("teacher")
    cfg = Config(name="teacher", model=preset("tiny-teacher", vocab_size=VOCAB), data=_data(),
                 train=_train(8))  # a fixed network is all the members need of it
    Trainer(cfg, work, devices=DEV).run()
    return work


def _member(method, teacher_dir, name, steps=8, lr=3e-3, seed=0, **distill):
    if method == "hldf":
        distill.setdefault("hldf_stage1_share", 0.5)
    if method == "patient":
        distill.setdefault("patient_pairs", 2)
    return Config(name=name, model=preset("tiny", vocab_size=VOCAB), data=_data(),
                  train=dataclasses.replace(_train(steps), lr=lr, seed=seed),
                  distill=DistillConfig(method=method, **distill),
                  teacher=dataclasses.replace(Config().teacher, checkpoint=str(teacher_dir)))


def _cohort(method, teacher_dir, steps=8):
    """Three members differing in every per-member hyperparameter the method uses."""
    return [_member(method, teacher_dir, "a", steps),
            _member(method, teacher_dir, "b", steps, lr=1e-3, seed=1, temperature=2.0,
                    alpha=0.3, hidden_weight=0.5),
            _member(method, teacher_dir, "c", steps, lr=5e-3, seed=2, temperature=0.7,
                    hidden_weight=2.0)]


def _losses(workdir):
    out = {}
    for line in (Path(workdir) / "metrics.jsonl").read_text().splitlines():
        rec = json.loads(line)
        if "loss" in rec:
            out[rec["step"]] = rec["loss"]
    return out


def _assert_close(a: dict, b: dict):
    assert sorted(a) == sorted(b)
    np.testing.assert_allclose([b[s] for s in sorted(b)], [a[s] for s in sorted(a)], rtol=RTOL)


# --------------------------------------------------------------------------- #
# Traced hyperparameters


@pytest.mark.parametrize("divergence", ["forward_kl", "reverse_kl"])
def test_fused_loss_traced_hparams_match_static(divergence):
    k = jax.random.split(jax.random.PRNGKey(0), 5)
    h_s, w_s = jax.random.normal(k[0], (40, 16)), 0.3 * jax.random.normal(k[1], (16, 100))
    h_t, w_t = jax.random.normal(k[2], (40, 24)), 0.3 * jax.random.normal(k[3], (24, 100))
    labels, mask = jax.random.randint(k[4], (40,), 0, 100), jnp.arange(40) < 35
    taus, alphas = jnp.array([1.0, 2.0, 0.5]), jnp.array([0.5, 0.2, 0.9])

    def loss(hs, ws, tau, alpha):
        return fused_kd_loss(hs, ws, h_t, w_t, labels, mask, temperature=tau, alpha=alpha,
                             divergence=divergence, softcap=30.0, backend="xla")[0]

    grad = jax.value_and_grad(loss, argnums=(0, 1))
    # One compiled program for the three members.
    many = jax.jit(jax.vmap(grad, in_axes=(None, None, 0, 0)))(h_s, w_s, taus, alphas)
    for i in range(3):
        one = grad(h_s, w_s, float(taus[i]), float(alphas[i]))
        np.testing.assert_allclose(many[0][i], one[0], rtol=1e-6)
        for a, b in zip(many[1], one[1], strict=True):
            np.testing.assert_allclose(a[i], b, rtol=1e-5, atol=1e-7)


def test_traced_peak_lr_schedule_equals_constant():
    cfg = _train(50)
    fixed = lr_schedule(cfg, 50)
    traced = jax.jit(lambda lr, n: lr_schedule(cfg, 50, lr)(n))
    for n in (0, 1, 2, 10, 49):
        assert float(traced(jnp.float32(cfg.lr), n)) == pytest.approx(float(fixed(n)), rel=1e-7)


# --------------------------------------------------------------------------- #
# A member is its solo run


def _member_equals_solo(tmp_path, teacher_dir, method, steps=8, mode=None):
    cfgs = _cohort(method, teacher_dir, steps)
    for c in cfgs:
        Trainer(c, tmp_path / "solo" / c.name, devices=DEV).run()
    out = CohortTrainer(cfgs, [tmp_path / "co" / c.name for c in cfgs], devices=DEV,
                        mode=mode).run()
    for c in cfgs:
        solo, member = tmp_path / "solo" / c.name, tmp_path / "co" / c.name
        _assert_close(_losses(solo), _losses(member))
        rs, rm = (json.loads((d / "results.json").read_text()) for d in (solo, member))
        assert out[c.name]["status"] == rm["status"] == "done"
        # Accounting per run unchanged: the solo run's steps, stages and FLOPs.
        for key in ("steps", "flops_spent", "stages", "flops_budget", "count_teacher"):
            assert rs[key] == rm[key], key
        assert rm["valid_nll"] == pytest.approx(rs["valid_nll"], rel=RTOL)
        files = {"config.json", "metrics.jsonl", "checkpoints", "results.json"}
        assert files <= {p.name for p in member.iterdir()}
        assert (member / "checkpoints").is_dir()
    return cfgs


@pytest.mark.slow  # 40-120 s on 2 shared cores
@pytest.mark.parametrize("mode", ["map", "vmap"])  # one member after the other / batched
def test_kd_member_equals_solo(tmp_path, teacher_dir, mode):
    _member_equals_solo(tmp_path, teacher_dir, "kd", mode=mode)


@pytest.mark.slow  # 40-120 s on 2 shared cores
def test_hldf_member_equals_solo_across_stages(tmp_path, teacher_dir):
    cfgs = _member_equals_solo(tmp_path, teacher_dir, "hldf")
    stages = [json.loads(line).get("stage") for line in
              (tmp_path / "co" / cfgs[1].name / "metrics.jsonl").read_text().splitlines()]
    assert stages[:4] == ["stage1"] * 4 and stages[4] == "stage2"


@pytest.mark.slow
@pytest.mark.parametrize("method", ["baseline", "hldc", "patient"])
def test_member_equals_solo_other_methods(tmp_path, teacher_dir, method):
    _member_equals_solo(tmp_path, teacher_dir, method)


@pytest.mark.slow  # 40-120 s on 2 shared cores
def test_seed_only_members_match_their_solo_run(tmp_path, teacher_dir):
    """Members differing only in the seed: no traced hyperparameter. The first steps are
    bitwise; the vmapped (batched) matmuls may round differently later (measured: step 5
    differs by 6e-8 relative), so the rest is held to 1e-6."""
    cfgs = [_member("kd", teacher_dir, "s0", 5), _member("kd", teacher_dir, "s1", 5, seed=1)]
    Trainer(cfgs[1], tmp_path / "solo", devices=DEV).run()
    CohortTrainer(cfgs, [tmp_path / c.name for c in cfgs], devices=DEV).run()
    solo, member = _losses(tmp_path / "solo"), _losses(tmp_path / "s1")
    assert solo[1] == member[1]
    np.testing.assert_allclose([member[s] for s in sorted(member)],
                               [solo[s] for s in sorted(solo)], rtol=1e-6)


def _lrs(workdir):
    return {r["step"]: r["lr"] for r in map(json.loads, (Path(workdir) / "metrics.jsonl")
                                             .read_text().splitlines()) if "lr" in r}


def test_members_at_other_learning_rates_follow_their_solo_schedule_across_continue(
        tmp_path, teacher_dir):
    """train.stage_boundary=continue: one schedule over the run's steps, its count carried.
    Members at other peaks each follow their solo run's (the cohort once rebuilt them over
    the stage's steps), and log the lr their optimizer applies."""
    cfgs = [_member("hldf", teacher_dir, f"lr{lr:g}", 6, lr=lr, seed=i)
            for i, lr in enumerate((1e-2, 3e-3))]
    cfgs = [dataclasses.replace(c, train=dataclasses.replace(c.train, stage_boundary="continue"))
            for c in cfgs]
    for c in cfgs:
        Trainer(c, tmp_path / "solo" / c.name, devices=DEV).run()
    CohortTrainer(cfgs, [tmp_path / "co" / c.name for c in cfgs], devices=DEV).run()
    for c in cfgs:
        solo, member = tmp_path / "solo" / c.name, tmp_path / "co" / c.name
        _assert_close(_losses(solo), _losses(member))
        expected = lr_schedule(c.train, 6)  # one schedule over both stages
        lrs = _lrs(member)
        assert sorted(lrs) == list(range(1, 7))
        for step, lr in lrs.items():
            assert lr == pytest.approx(float(expected(step - 1)), rel=1e-6)
        assert _lrs(solo) == lrs


# --------------------------------------------------------------------------- #
# Resume and divergence


@pytest.mark.slow  # 40-120 s on 2 shared cores
def test_cohort_resumes_exactly_after_sigterm(tmp_path, teacher_dir):
    cfgs = _cohort("hldf", teacher_dir, steps=10)
    full = [tmp_path / "full" / c.name for c in cfgs]
    split = [tmp_path / "split" / c.name for c in cfgs]
    CohortTrainer(cfgs, full, devices=DEV).run()
    with pytest.raises(Interrupted):  # inside stage 2 (stage 1 = steps 1..5)
        CohortTrainer(cfgs, split, devices=DEV).run(stop_at_step=7)
    for d in split:  # every member saved step 7, in stage 2
        assert checkpoint_steps(d)[-1] == 7
        assert json.loads((d / "checkpoints" / "7" / "meta" / "metadata").read_text())[
            "stage"] == "stage2"
    assert not any((d / "results.json").exists() for d in split)
    CohortTrainer(cfgs, split, devices=DEV).run()
    for a, b in zip(full, split, strict=True):
        assert _losses(a) == _losses(b)  # bitwise: the same program from the same state


@pytest.mark.slow  # 40-120 s on 2 shared cores
def test_cohort_resumes_from_the_last_step_every_member_saved(tmp_path, teacher_dir):
    """A crash between members' saves: member a holds step 8, b and c step 4. b and c are
    brought forward to step 8 (a's checkpoint is kept), then all three go on."""
    cfgs = _cohort("kd", teacher_dir, steps=8)
    full = [tmp_path / "full" / c.name for c in cfgs]
    split = [tmp_path / "split" / c.name for c in cfgs]
    CohortTrainer(cfgs, full, devices=DEV).run()
    with pytest.raises(Interrupted):
        CohortTrainer(cfgs, split, devices=DEV).run(stop_at_step=4)
    # As if killed while saving step 8: member a saved it, b and c did not.
    import shutil

    shutil.copytree(full[0] / "checkpoints" / "8", split[0] / "checkpoints" / "8")
    shutil.copyfile(full[0] / "metrics.jsonl", split[0] / "metrics.jsonl")  # a logged to 8
    kept = (split[0] / "checkpoints" / "8" / "meta" / "metadata").read_bytes()
    CohortTrainer(cfgs, split, devices=DEV).run()
    assert (split[0] / "checkpoints" / "8" / "meta" / "metadata").read_bytes() == kept
    assert _losses(full[0]) == _losses(split[0])  # a was not retrained
    for a, b in zip(full[1:], split[1:], strict=True):  # b, c: 5-8 as a cohort of 2, not 3
        _assert_close(_losses(a), _losses(b))


@pytest.mark.slow  # 40-120 s on 2 shared cores
def test_cohort_falls_back_from_a_members_damaged_checkpoint(tmp_path, teacher_dir, capsys):
    """A member's latest checkpoint that cannot be restored is moved to
    checkpoints.damaged/; that member resumes from its previous step and is brought
    forward alone to the others' step."""
    cfgs = _cohort("kd", teacher_dir, steps=8)[:2]
    dirs = [tmp_path / c.name for c in cfgs]
    with pytest.raises(Interrupted):  # checkpoints 4 and 6 (checkpoint_every 4, stop at 6)
        CohortTrainer(cfgs, dirs, devices=DEV).run(stop_at_step=6)
    before = [_losses(d) for d in dirs]
    step6 = dirs[1] / "checkpoints" / "6"
    files = [p for p in (step6 / "state").rglob("*") if p.is_file() and "/d/" in str(p)]
    biggest = max(files, key=lambda p: p.stat().st_size)
    with open(biggest, "r+b") as fh:  # a torn write of member b's state
        fh.truncate(biggest.stat().st_size // 3)
    out = CohortTrainer(cfgs, dirs, devices=DEV).run()
    err = capsys.readouterr().err
    assert f"{step6} cannot be restored" in err and "resumed from step 4" in err, err
    assert (dirs[1] / "checkpoints.damaged" / "6").is_dir()
    for c, d, b in zip(cfgs, dirs, before, strict=True):
        assert out[c.name]["status"] == "done" and out[c.name]["steps"] == 8
        losses = _losses(d)
        assert sorted(losses) == list(range(1, 9))  # each step once
        assert [losses[s] for s in (5, 6)] == [b[s] for s in (5, 6)]  # again, bitwise


@pytest.mark.slow  # 26 s; the solo memory refusal is in test_reliability's default tests
def test_cohort_step_that_cannot_fit_is_refused_before_training(tmp_path, teacher_dir,
                                                              monkeypatch):
    """The Trainer's check: XLA's memory analysis of the compiled cohort step against the
    memory available, before the first step."""
    from hldstudy.errors import RuntimeFault
    from hldstudy.train import loop

    monkeypatch.setattr(loop, "memory_available", lambda device: 1 << 20)  # 1 MiB
    cfgs = _cohort("kd", teacher_dir, steps=4)[:2]
    dirs = [tmp_path / c.name for c in cfgs]
    with pytest.raises(RuntimeFault, match=r"does not fit.*fewer students per cohort \(now 2"):
        CohortTrainer(cfgs, dirs, devices=DEV).run()
    assert not any((d / "checkpoints").exists() and any((d / "checkpoints").iterdir())
                   for d in dirs)
    assert not any((d / "metrics.jsonl").exists() and "loss" in (d / "metrics.jsonl").read_text()
                   for d in dirs)


@pytest.mark.slow  # 33 s; a solo run's non-finite stop is in test_reliability's default tests
def test_diverging_member_stops_alone(tmp_path, teacher_dir):
    cfgs = _cohort("kd", teacher_dir, steps=8)
    cfgs[1] = dataclasses.replace(cfgs[1], train=dataclasses.replace(cfgs[1].train, lr=1e30))
    dirs = [tmp_path / c.name for c in cfgs]
    for c in (cfgs[0], cfgs[2]):
        Trainer(c, tmp_path / "solo" / c.name, devices=DEV).run()
    out = CohortTrainer(cfgs, dirs, devices=DEV).run()
    bad = json.loads((dirs[1] / "results.json").read_text())
    assert out["b"]["status"] == bad["status"] == DIVERGED and "non-finite" in bad["error"]
    # Its last good checkpoint stays; nothing non-finite was saved after it.
    steps = sorted(int(p.name) for p in (dirs[1] / "checkpoints").iterdir() if p.name.isdigit())
    assert all(s < bad["step"] for s in steps)
    for j in (0, 2):  # the others went on, unchanged
        assert out[cfgs[j].name]["status"] == "done"
        _assert_close(_losses(tmp_path / "solo" / cfgs[j].name), _losses(dirs[j]))
    # A rerun leaves the diverged member alone and the finished ones finished.
    again = CohortTrainer(cfgs, dirs, devices=DEV).run()
    assert again["b"]["status"] == DIVERGED and again["a"]["status"] == "done"


_CHILD = """
import sys, jax
from hldstudy.config import read_config
from hldstudy.train.cohort import CohortTrainer
paths = sys.argv[1:]
cfgs = [read_config(p + "/want.json") for p in paths]
CohortTrainer(cfgs, paths, devices=jax.devices()[:1]).run()
"""


@pytest.mark.slow
def test_cohort_resumes_exactly_after_kill_9(tmp_path, teacher_dir):
    cfgs = [dataclasses.replace(c, train=dataclasses.replace(c.train, checkpoint_every=3))
            for c in _cohort("kd", teacher_dir, steps=14)]
    full = [tmp_path / "full" / c.name for c in cfgs]
    split = [tmp_path / "split" / c.name for c in cfgs]
    CohortTrainer(cfgs, full, devices=DEV).run()
    train_and_kill(_CHILD, cfgs, split, 6)
    CohortTrainer(cfgs, split, devices=DEV).run()
    for a, b in zip(full, split, strict=True):
        assert _losses(a) == _losses(b)
