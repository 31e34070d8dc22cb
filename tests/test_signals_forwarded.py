"""A stop signal is never forgotten: one caught by an inner scope (a trainer at its last
step, or while it finishes) reaches the scope around it, so a sweep stops before it
starts new work, exit 143, everything resumable. The signal is sent from inside the
step or the evaluation (os.kill of this process), never on a timer."""

import json
import os
import signal

import pytest
from test_sweep_e2e import _sweep_file

from hldstudy.signals import StopSignals
from hldstudy.sweep.__main__ import main as sweep_main
from hldstudy.sweep.worker import Worker
from hldstudy.train.loop import Trainer


def test_a_signal_caught_inside_reaches_the_scope_around_it():
    before = signal.getsignal(signal.SIGTERM)
    with StopSignals() as outer:
        with StopSignals() as inner:
            os.kill(os.getpid(), signal.SIGTERM)
        assert inner.signum == signal.SIGTERM
        assert outer.signum == signal.SIGTERM  # passed on when the inner scope ended
    # The outermost scope restores the handler it found and, that being the default
    # (which would kill), hands it nothing: this process is still here.
    assert signal.getsignal(signal.SIGTERM) == before


def _kill_when(monkeypatch, cls, name, when):
    original = getattr(cls, name)

    def wrapped(self, *args, **kwargs):
        out = original(self, *args, **kwargs)
        if when(self, *args):
            os.kill(os.getpid(), signal.SIGTERM)
        return out

    monkeypatch.setattr(cls, name, wrapped)


def _at_last_step(trainer, step, *args):
    return step == trainer.total_steps


def _done(runs_dir):
    return sorted(d.name for d in runs_dir.iterdir()
                  if (d / "results.json").exists()
                  and json.loads((d / "results.json").read_text()).get("status") == "done")


WHERE = {  # where the signal is sent from
    "last step": (Trainer, "save", _at_last_step),
    "final validation": (Trainer, "evaluate", lambda t, *a: True),  # inside the trainer
    "downstream evaluation": (Worker, "evaluate", lambda w, *a: True),  # after it
}


SLOW = pytest.mark.slow  # ~15-25 s each on 2 quiet cores; one solo and one cohort case stay


@pytest.mark.parametrize("where,cohort", [
    ("last step", None), ("final validation", 2),
    pytest.param("last step", 2, marks=SLOW), pytest.param("final validation", None, marks=SLOW),
    pytest.param("downstream evaluation", None, marks=SLOW),
    pytest.param("downstream evaluation", 2, marks=SLOW)])
def test_sigterm_while_a_run_finishes_stops_the_sweep_before_new_work(
        tmp_path, monkeypatch, capsys, where, cohort):
    # 2 seeds x 2 lrs of the baseline: solo, 4 runs one after another; in cohorts of 2,
    # one cohort per seed (a seed sets the data order).
    sweep = _sweep_file(tmp_path, None, methods=("baseline",), seeds=(0, 1),
                        eval_tasks=("synth_mc",) if where == "downstream evaluation" else ())
    runs_dir = tmp_path / "runs"
    args = [str(sweep), "--workdir", str(runs_dir), "--no-progress"]
    args += ["--cohort", str(cohort)] if cohort else []
    cls, name, when = WHERE[where]
    with monkeypatch.context() as m:
        _kill_when(m, cls, name, when)
        rc = sweep_main(args)
    assert rc == 128 + signal.SIGTERM
    err = capsys.readouterr().err
    assert "stopped by a signal" in err
    done = _done(runs_dir)
    # The work under way finished (the signal came as it ended); nothing new started.
    assert len(done) == (2 if cohort else 1), (done, err)
    started = [d.name for d in runs_dir.iterdir() if d.is_dir() and not d.name.startswith(".")]
    assert sorted(started) == done
    # Resumable: the same command finishes the rest, retraining nothing.
    assert sweep_main(args) == 0
    assert f"{4 - len(done)} trained, {len(done)} already done" in capsys.readouterr().err
