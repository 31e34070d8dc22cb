"""`hldstudy study real-text`: HLD vs KD on real English text, from the corpus to the
verdicts, in one resumable command. The phases and the pick rule are sweeps/real_text.py;
this module runs them in order and keeps what each step made under the study's directory.

Design notes: `docs/study.md`, under this file's name.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import threading
import time
from pathlib import Path

from hldstudy.cli_common import SWEEPS
from hldstudy.config import apply_overrides, load_experiment, validate
from hldstudy.data.prepare import prepare
from hldstudy.errors import InputError, RuntimeFault
from hldstudy.fileio import write_json_atomic
from hldstudy.rundir import job_owns
from hldstudy.study.corpus import CorpusSpec, write_corpus
from hldstudy.study.readout import write_report
from hldstudy.sweep.grid_exec import run_grid
from hldstudy.sweep.gridteach import ReplicaOptions
from hldstudy.sweep.launch import prepare_workdir
from hldstudy.sweep.spec import SEED_AXIS, expand
from hldstudy.sweeps import real_text as plan  # the phases and the pick rule
from hldstudy.train.loop import Trainer

SWEEP_FILE = SWEEPS / "real_text.py"
PHASES = ("all", "exploratory", "confirmatory", "report")
STUDY_FILE = "study.json"
EXPLORE_KD, EXPLORE_HLD = "explore/kd", "explore/hld"  # phase 1a's and 1b's runs
PICKS_FILE = "picks.json"
COHORT = 6  # phase 1a's whole KD grid is one cohort
TICK_S = 60.0  # how often a running step's seconds are saved


class Study:
    """One study directory at one size."""

    def __init__(self, workdir: str | Path, size: str = "full", *, progress: bool = True,
                 wheel: str | None = None):
        self.plan = plan
        if size not in self.plan.SIZES:
            raise InputError(f"--size: unknown size {size!r}; choose one of "
                             f"{', '.join(self.plan.SIZES)}")
        self.dir = Path(workdir).absolute()
        self.size_name, self.size = size, self.plan.SIZES[size]
        self.progress, self.wheel = progress, wheel
        self.corpus, self.shards = self.dir / "corpus", self.dir / "shards"
        self.teacher = self.dir / "teacher"
        self.explore_dirs = (self.dir / EXPLORE_KD, self.dir / EXPLORE_HLD)

    # -- bookkeeping -------------------------------------------------------------------

    def _record(self) -> dict:
        path = self.dir / STUDY_FILE
        if path.exists():
            rec = json.loads(path.read_text())
            if rec.get("size") != self.size_name:
                raise InputError(f"--size: {self.dir} holds the {rec.get('size')!r} size of "
                                 f"the study; give --size {rec.get('size')} to continue it, "
                                 "or another --workdir")
            return rec
        return {"study": "real-text", "size": self.size_name,
                "size_spec": dataclasses.asdict(self.size), "seconds": {}}

    def _timed(self, step: str, fn):
        """Runs `fn`, adding its wall time to study.json's seconds[step]: rewritten every
        TICK_S while it runs, so a sitting that is killed (no `finally` runs on SIGKILL)
        loses at most TICK_S of its time, not all of it."""
        base = self._record()["seconds"].get(step, 0.0)
        t0, done = time.time(), threading.Event()

        def save():
            rec = self._record()
            rec["seconds"][step] = round(base + time.time() - t0, 1)
            write_json_atomic(self.dir / STUDY_FILE, rec)

        def tick():
            while not done.wait(TICK_S):
                save()

        ticker = threading.Thread(target=tick, name="study-clock", daemon=True)
        ticker.start()
        try:
            return fn()
        finally:
            done.set()
            ticker.join()
            save()

    # -- steps -------------------------------------------------------------------------

    def prepare(self) -> dict:
        manifest = write_corpus(self.corpus, CorpusSpec(train_chapters=self.size.train_chapters,
                                                        valid_chapters=self.size.valid_chapters,
                                                        task_items=self.size.task_items),
                                self.wheel)
        cfg = self.teacher_config(check_paths=False)
        data = dataclasses.replace(cfg.data, source="jsonl", path=str(self.corpus / "train.jsonl"),
                                   valid_path=str(self.corpus / "valid.jsonl"))
        prepare(data, self.shards, progress=self.progress)
        return manifest

    def teacher_config(self, check_paths: bool = True):
        cfg = load_experiment(self.plan.EXPERIMENTS / "real_text_teacher.py")
        cfg = apply_overrides(cfg, list(self.plan.size_overrides(self.size)) + [
            f"data.path={self.shards}", f"train.steps={self.size.teacher_steps}",
            f"train.checkpoint_every={max(self.size.teacher_steps // 6, 5)}",
            f"train.progress={str(self.progress).lower()}"])
        return validate(cfg, check_paths=check_paths)

    def train_teacher(self) -> dict:
        res_path = self.teacher / "results.json"
        if res_path.exists():
            res = json.loads(res_path.read_text())
            if res.get("status") == "done" and res.get("steps") == self.size.teacher_steps:
                return res
        with job_owns(self.teacher, "hldstudy study"):
            return Trainer(self.teacher_config(), self.teacher).run()

    def _sources(self) -> tuple[str, str, str]:
        return str(self.teacher), str(self.shards), str(self.corpus / "tasks")

    def train(self, sweep, runs, runs_dir: Path) -> None:
        """`runs` trained (those done skipped), one teacher replica per data order."""
        prepare_workdir(sweep, runs, runs, runs_dir, sweep_file=SWEEP_FILE)
        out = run_grid(runs, sweep, runs_dir, k=COHORT, options=ReplicaOptions(replicas=1),
                       progress=self.progress)
        if out.signum is not None:
            raise SystemExit(out.exit_code)
        if out.failed:
            run_id, why = next(iter(out.failed.items()))
            raise RuntimeFault(f"{len(out.failed)} run(s) of {runs_dir} failed ({run_id}: "
                               f"{why}); their logs are in the run directories; rerun the "
                               "same command to retry them")

    def explore(self) -> dict:
        """Phase 1, then the picks (written once; a rerun reads them back)."""
        picks_path = self.dir / PICKS_FILE
        if picks_path.exists():
            return json.loads(picks_path.read_text())
        kd_sweep = self.plan.explore_kd(self.size, *self._sources())
        kd_runs = expand(kd_sweep, check_paths=True)
        self.train(kd_sweep, kd_runs, self.dir / EXPLORE_KD)
        kd_pick = pick(kd_runs, self.dir / EXPLORE_KD)
        hld_sweep = self.plan.explore_hld(self.size, *self._sources(), kd_pick["params"])
        hld_runs = expand(hld_sweep, check_paths=True)
        self.train(hld_sweep, hld_runs, self.dir / EXPLORE_HLD)
        picks = {"rule": "lowest validation perplexity at the exploratory seed; a tie goes to "
                         "the configuration listed first (sweeps/real_text.py)",
                 "seed": self.plan.EXPLORATORY_SEED, plan.PICKED[0]: kd_pick}
        for method in plan.PICKED[1:]:
            picks[method] = pick([r for r in hld_runs if r.method == method],
                                 self.dir / EXPLORE_HLD)
        write_json_atomic(picks_path, picks)
        return picks

    def read_picks(self) -> dict:
        path = self.dir / PICKS_FILE
        if not path.exists():
            raise InputError(f"--phase confirmatory: the exploratory picks ({', '.join(plan.PICKED)}) "
                             f"are not in {path}; run --phase exploratory first")
        picks = json.loads(path.read_text())
        missing = [m for m in plan.PICKED if m not in picks]
        if missing:
            raise InputError(f"--phase confirmatory: {path} lacks the picks of "
                             f"{', '.join(missing)}; run --phase exploratory again")
        return picks

    def confirm_runs(self, picks: dict) -> tuple[list, dict]:
        """Phase 2's runs (one per distinct run id) and {arm name: [run ids by seed]}."""
        runs, by_arm = {}, {}
        sweep = None
        for arm in self.plan.arms(*(picks[m]["params"] for m in plan.PICKED)):
            sweep = self.plan.confirm_sweep(arm, self.size, *self._sources())
            arm_runs = expand(sweep, check_paths=True)
            by_arm[arm.name] = {"method": arm.method, "params": arm.params,
                                "runs": [r.run_id for r in arm_runs]}
            for r in arm_runs:
                runs.setdefault(r.run_id, r)
        return list(runs.values()), by_arm, sweep

    def confirm(self) -> dict:
        picks = self.read_picks()
        runs, by_arm, sweep = self.confirm_runs(picks)
        (self.dir / "confirm").mkdir(parents=True, exist_ok=True)
        write_json_atomic(self.dir / "confirm" / "arms.json", by_arm)
        self.train(sweep, runs, self.dir / "confirm")
        return by_arm

    def report(self) -> dict:
        picks = self.read_picks()
        _, by_arm, _ = self.confirm_runs(picks)
        return write_report(self, picks, by_arm)

    def reproduce(self, arm: str) -> dict:
        """Phase 2's runs of `arm` trained again under DIR/reproduce/ARM through the same
        path (cohorts, grid teacher), their numbers compared with the originals' bit for
        bit: {run id: [differing keys]} (empty lists: reproduced), in compare.json."""
        picks = self.read_picks()
        runs, by_arm, sweep = self.confirm_runs(picks)
        if arm not in by_arm:
            raise InputError(f"--reproduce: no arm {arm!r}; the arms: {', '.join(by_arm)}")
        ids = set(by_arm[arm]["runs"])
        todo = [r for r in runs if r.run_id in ids]
        unfinished = [r.run_id for r in todo
                      if not (self.dir / "confirm" / r.run_id / "results.json").exists()]
        if unfinished:
            raise InputError(f"--reproduce {arm}: {len(unfinished)} of its runs are not "
                             f"finished ({unfinished[0]}); finish the study first")
        where = self.dir / "reproduce" / arm
        self.train(sweep, todo, where)
        diff = {r.run_id: differing_numbers(self.dir / "confirm" / r.run_id, where / r.run_id)
                for r in todo}
        write_json_atomic(where / "compare.json", diff)
        return diff

    def _setup(self) -> None:
        self.dir.mkdir(parents=True, exist_ok=True)
        self._record()  # a directory of another size is refused before anything runs
        # Every process of the study (trainers, teacher replicas) shares one compilation
        # cache: the seeds of phase 2 compile the same programs, once.
        os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", str(self.dir / ".jax_cache"))
        os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0.2")

    def run_reproduce(self, arm: str) -> dict:
        self._setup()
        return self.reproduce(arm)

    def run(self, phase: str = "all") -> dict:
        if phase not in PHASES:
            raise InputError(f"--phase: unknown phase {phase!r}; one of {', '.join(PHASES)}")
        self._setup()
        if phase in ("all", "exploratory"):
            self._timed("corpus", self.prepare)
            self._timed("teacher", self.train_teacher)
            self._timed("exploratory", self.explore)
        if phase in ("all", "confirmatory"):
            self.read_picks()
            self._timed("confirmatory", self.confirm)
        if phase in ("all", "report"):
            return self._timed("report", self.report)
        return {}


# The numbers a run reports: its results' scalars (and per-batch losses) and its
# evaluation's metrics; timings and paths aside.
COMPARED = ("valid_nll", "valid_ppl", "valid_tokens", "valid_batch_nll", "flops_spent",
            "steps", "status")


def differing_numbers(original: Path, again: Path) -> list[str]:
    """The keys whose values differ (bitwise: JSON round-trips floats exactly) between two
    runs' results.json and eval/results.json metrics."""
    def numbers(d: Path) -> dict:
        res = json.loads((d / "results.json").read_text())
        out = {k: res.get(k) for k in COMPARED}
        ev = d / "eval" / "results.json"
        if ev.exists():
            for task, metrics in json.loads(ev.read_text()).items():
                if isinstance(metrics, dict):
                    out.update({f"{task}/{m}": v for m, v in metrics.items()})
        return out

    a, b = numbers(original), numbers(again)
    return sorted(k for k in a.keys() | b.keys() if a.get(k) != b.get(k))


def pick(runs, runs_dir: Path) -> dict:
    """The pick rule: the run of lowest validation perplexity; a tie goes to the run listed
    first. {"run_id", "params" (its swept values but the seed), "valid_ppl"}."""
    best = None
    for r in runs:
        res_path = runs_dir / r.run_id / "results.json"
        res = json.loads(res_path.read_text()) if res_path.exists() else {}
        ppl = res.get("valid_ppl")
        if res.get("status") != "done" or not isinstance(ppl, (int, float)) \
                or not math.isfinite(ppl):
            raise RuntimeFault(f"{runs_dir / r.run_id} has no finished validation perplexity; "
                               "rerun the study to finish it before anything is picked")
        if best is None or ppl < best[1]:
            best = (r, ppl)
    run, ppl = best
    return {"run_id": run.run_id, "params": {k: v for k, v in run.params.items()
                                             if k != SEED_AXIS}, "valid_ppl": ppl}
