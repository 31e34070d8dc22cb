"""`python -m hldstudy.sweep SWEEP --cohort K` end to end: a tiny grid trained as cohorts,
one cohort stopped mid-way (the cohort's own stop: a SIGTERM at that step) and the sweep
rerun; finished members are skipped, the half-finished cohort resumes, every run is done
and evaluated, the analysis counts each run once, and every member's losses equal the
solo sweep's."""

import json
import signal
from pathlib import Path

import numpy as np
import pytest

from hldstudy.config import Config, DataConfig, TrainConfig
from hldstudy.model import preset
from hldstudy.sweep.__main__ import main as sweep_main
from hldstudy.train.cohort import CohortTrainer
from hldstudy.train.loop import train

DATA = dict(seq_len=64, batch_size=8, tokenizer_vocab_size=384, synthetic_docs=600,
            synthetic_valid_docs=50)
RTOL = 1e-5


@pytest.fixture(scope="module")
def teacher_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("teacher") / "teacher"
    cfg = Config(name="teacher", model=preset("tiny-teacher", vocab_size=384),
                 data=DataConfig(**DATA),
                 train=TrainConfig(steps=4, warmup_steps=1, log_every=2, checkpoint_every=0,
                                   eval_batches=1, progress=False))
    train(cfg, d)
    return d


def _sweep_file(tmp_path: Path, teacher: Path) -> Path:
    f = tmp_path / "tiny_cohort_sweep.py"
    f.write_text(f'''"""Tiny cohort test sweep."""
from hldstudy.config import Config, DataConfig, DistillConfig, TrainConfig
from hldstudy.model import preset
from hldstudy.sweep import Sweep


def get_sweep():
    base = Config(name="s", model=preset("tiny", vocab_size=384), data=DataConfig(**{DATA!r}),
                  train=TrainConfig(warmup_steps=1, log_every=1, checkpoint_every=0,
                                    eval_batches=1),
                  distill=DistillConfig(alpha=0.5))
    return Sweep(name="tiny", base=base, methods=("baseline", "kd"), lr=(3e-3, 1e-2),
                 temperature=(1.0, 2.0), budget_baseline_steps=8, teacher={str(teacher)!r},
                 eval_tasks=("synth_mc",), eval_limit=8, eval_batch_size=8)
''')
    return f


def _losses(run_dir: Path) -> dict[int, float]:
    out = {}
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        rec = json.loads(line)
        if "loss" in rec:
            out[rec["step"]] = rec["loss"]
    return out


def _stop_cohort_of(victim: str, at: int):
    """CohortTrainer.run, stopping the cohort that holds `victim` at step `at` (as a
    SIGTERM there), once."""
    original = CohortTrainer.run
    fired = []

    def run(self, stop_at_step=None):
        if not fired and any(m.workdir.name == victim for m in self.members):
            fired.append(True)
            stop_at_step = at
        return original(self, stop_at_step)

    return run


@pytest.mark.slow
def test_cohort_sweep_interrupted_resumed_equals_solo(tmp_path, teacher_dir, monkeypatch,
                                                       capsys):
    sweep = _sweep_file(tmp_path, teacher_dir)
    co, solo = tmp_path / "cohort", tmp_path / "solo"
    base = [str(sweep), "--no-progress"]

    assert sweep_main([*base, "--workdir", str(co), "--dry-run", "--json", "--cohort", "2"]) == 0
    listing = json.loads(capsys.readouterr().out)
    ids = [r["run_id"] for r in listing]
    cohorts: dict[str, list[str]] = {}
    for r in listing:
        cohorts.setdefault(r["cohort"], []).append(r["run_id"])
    assert sorted(map(len, cohorts.values())) == [2, 2, 2]  # 2 baseline, 4 kd runs
    assert all(len({rid.split("_")[0] for rid in c}) == 1 for c in cohorts.values())
    victim = ids[-1]
    partner = next(c for c in cohorts.values() if victim in c)
    finished_first = [rid for rid in ids if rid not in partner]

    # 1st launch: the cohort holding the victim is stopped at step 3.
    monkeypatch.setattr(CohortTrainer, "run", _stop_cohort_of(victim, 3))
    rc = sweep_main([*base, "--workdir", str(co), "--cohort", "2"])
    assert rc == 128 + signal.SIGTERM
    err = capsys.readouterr().err
    for rid in partner:
        assert f"{rid}: interrupted (checkpoint at step 3)" in err
        assert not (co / rid / "results.json").exists()
        assert (co / rid / "checkpoints" / "3").is_dir()
    for rid in finished_first:
        assert json.loads((co / rid / "results.json").read_text())["status"] == "done"
    before = {rid: (co / rid / "metrics.jsonl").read_text().splitlines() for rid in partner}

    # 2nd launch: finished members skipped, the half-finished cohort resumes at step 3.
    assert sweep_main([*base, "--workdir", str(co), "--cohort", "2"]) == 0
    err = capsys.readouterr().err
    for rid in finished_first:
        assert f"{rid}: skipped" in err
    assert "6 run(s): 2 trained, 4 already done" in err
    for rid in partner:
        after = (co / rid / "metrics.jsonl").read_text().splitlines()
        assert after[:len(before[rid])] == before[rid]  # steps 1-3 were not retrained
        steps = next(r["steps"] for r in listing if r["run_id"] == rid)
        assert sorted(_losses(co / rid)) == list(range(1, steps + 1))

    # 3rd launch: nothing to do.
    assert sweep_main([*base, "--workdir", str(co), "--cohort", "2"]) == 0
    assert "0 trained, 6 already done" in capsys.readouterr().err

    # The same grid, every run alone.
    assert sweep_main([*base, "--workdir", str(solo)]) == 0
    capsys.readouterr()
    for rid in ids:
        rc_, rs = (json.loads((d / rid / "results.json").read_text()) for d in (co, solo))
        assert rc_["status"] == rs["status"] == "done" and rc_["run_id"] == rid
        assert "acc" in rc_["eval"]["synth_mc"]
        for key in ("steps", "flops_spent", "flops_budget", "stages"):
            assert rc_[key] == rs[key], (rid, key)
        a, b = _losses(co / rid), _losses(solo / rid)
        assert sorted(a) == sorted(b)
        np.testing.assert_allclose([a[s] for s in sorted(a)], [b[s] for s in sorted(b)],
                                   rtol=RTOL, err_msg=rid)
        assert rc_["valid_nll"] == pytest.approx(rs["valid_nll"], rel=RTOL)

    from hldstudy.analysis import build_report

    summary = build_report(co, tmp_path / "report", n_resamples=200)
    assert sorted(summary["runs"]) == sorted(ids)  # every run exactly once
    accounting = (tmp_path / "report" / "tables" / "accounting.csv").read_text().splitlines()
    assert sorted(line.split(",")[0] for line in accounting[1:]) == sorted(ids)
