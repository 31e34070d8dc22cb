"""The training loop: thin, method-agnostic, resumable.

Design notes: `docs/training.md`, under this file's name.
"""

from __future__ import annotations

import functools
import math
import signal
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from hldstudy import sharding as mesh_lib
from hldstudy.checkpoint import Checkpointer, abstract_like, check_writable
from hldstudy.config import (
    Config,
    config_to_dict,
    fields_where,
    flatten,
    read_config,
    save_config,
    validate,
)
from hldstudy.distill import methods
from hldstudy.distill.base import make_strategy
from hldstudy.errors import ConfigError, InputError, RuntimeFault, note, warn
from hldstudy.fileio import write_json_atomic
from hldstudy.flops.budget import StagePlan, plan_stages, total_steps
from hldstudy.model import Transformer
from hldstudy.rundir import CHECKPOINTS_DIR, RESULTS_FILE, checkpoint_steps, job_owns
from hldstudy.signals import Interrupted, StopSignals  # noqa: F401  (Interrupted re-exported)
from hldstudy.teacher import load_teacher, with_teacher_tokenizer
from hldstudy.teacher.base import NO_FEED, StageFeed
from hldstudy.train.metrics import MetricsLogger
from hldstudy.train.optim import carry_moments, lr_schedule, make_optimizer
from hldstudy.train.program import make_eval_step, microbatch_candidates, train_program
from hldstudy.train.step import GraphDefs, split_params, to_master

# Config fields a resumed run may change (tagged `resume` in hldstudy.config); a
# mesh change restores the checkpoint resharded onto the new mesh.
RESUMABLE_CHANGES = fields_where("resume")


class _StopFlag(StopSignals):
    """StopSignals plus a step at which to stop as if signalled (tests, sweeps)."""

    stop_at_step: int | None = None


class _NoLogger:
    """The metrics sink of a process other than 0 in a multi-process job (process 0 writes
    metrics.jsonl; every process computes the same records)."""

    def log(self, record: dict) -> None:
        pass

    def summary(self, values: dict) -> None:
        pass

    def close(self) -> None:
        pass


class _DamagedCheckpoint(Exception):
    """A checkpoint was found damaged (and marked so): look for the resume points again."""


def _one_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0][:200]}" if text else type(exc).__name__


def check_resume_compatible(cfg: Config, workdir: Path) -> None:
    """Refuses to resume a run directory under a different experiment. Only a directory
    that holds something trained (a checkpoint, or results.json) is compared: a run that
    failed before its first checkpoint (say, at data loading) takes a corrected retry."""
    path = workdir / "config.json"
    if not path.exists():
        return
    if not checkpoint_steps(workdir) and not (workdir / RESULTS_FILE).exists():
        return
    try:
        old = flatten(config_to_dict(read_config(path)))
    except ValueError as e:
        if isinstance(e, ConfigError):
            raise
        raise InputError(f"{path} is not a readable config ({_one_line(e)}); restore it (the "
                         "run's checkpoints need it) or use a new --workdir") from None
    new = flatten(config_to_dict(cfg))
    for key in sorted(new):
        if key not in RESUMABLE_CHANGES and old.get(key) != new[key]:
            raise ConfigError(key, f"{workdir} was trained with {old.get(key)!r}, now {new[key]!r}",
                              "use a new --workdir, or restore the original value")



def scalars(metrics: dict) -> dict:
    """The metrics a log line holds: the per-batch lists stay in results.json."""
    return {k: v for k, v in metrics.items() if not isinstance(v, list)}

class Trainer:
    """One run: its config, run directory, mesh, data, strategy, teacher, stage plans and
    checkpoints, and what the loop asks of it (resume point, restore, save, evaluate,
    finish). `run` trains it alone through `train_members`; a cohort trains several."""

    def __init__(self, cfg: Config, workdir: str | Path, *, teacher=None, data=None,
                 devices=None, init_student=None, wrap_optimizer=None):
        """init_student: the student's parameters the first stage starts from (instead of
        a fresh init); wrap_optimizer: applied to every stage's optimizer (e.g. to hold a
        pruning mask; `hldstudy.compress.recover`)."""
        self.init_student, self.wrap_optimizer = init_student, wrap_optimizer
        # A multi-process job is joined before anything touches a device (hldstudy.sharding).
        mesh_lib.maybe_initialize_distributed()
        cfg = validate(with_teacher_tokenizer(cfg))
        self.cfg = cfg
        self.workdir = Path(workdir)
        self.workdir.mkdir(parents=True, exist_ok=True)
        check_writable(self.workdir / CHECKPOINTS_DIR)
        check_resume_compatible(cfg, self.workdir)
        # config.json is written once every check has passed, the data cursor's included
        # (`write_config`, as training starts): a refused resume leaves the old one.
        self.mesh = mesh_lib.make_mesh(cfg.train, devices)
        mesh_lib.check_batch_divisible(cfg.data.batch_size, self.mesh)
        if data is None:
            from hldstudy.data import prepare_data

            # Process 0 trains the tokenizer / fills the data cache; the others then read it.
            # From prepared shards, each process reads only its own rows of every batch.
            rows = (mesh_lib.process_rows(self.mesh, cfg.data.batch_size)
                    if cfg.data.source == "shards" else None)
            if mesh_lib.is_primary():
                data = prepare_data(cfg.data, self.workdir, rows=rows)
            mesh_lib.sync("hldstudy-data-prepared")
            if data is None:
                data = prepare_data(cfg.data, self.workdir, rows=rows)
            if rows is not None:
                data.train.gather_cursor = functools.partial(
                    mesh_lib.gather_cursor, batch_size=cfg.data.batch_size)
        self.data = data
        if not self.data.valid_batches(1):
            raise InputError("the data has no validation documents, so the run could not be "
                             "evaluated (set data.valid_holdout_docs >= 1 or data.valid_path; "
                             "a corpus of one document cannot be split)")
        if self.data.tokenizer.vocab_size > cfg.model.vocab_size:
            raise ConfigError("model.vocab_size",
                              f"{cfg.model.vocab_size} is smaller than the tokenizer's "
                              f"{self.data.tokenizer.vocab_size} pieces")
        self.teacher = teacher
        if teacher is None and methods.get(cfg.distill.method).needs_teacher:
            self.teacher = load_teacher(cfg, self.data.tokenizer)
        teacher_model_cfg = self.teacher.model_cfg if self.teacher is not None else None
        self.strategy = make_strategy(cfg, cfg.model, teacher_model_cfg)
        self.plans = plan_stages(cfg, teacher_model_cfg)
        self.total_steps = total_steps(self.plans)
        if self._continues() and self.init_student is not None:
            raise ConfigError("train.stage_boundary", "continue carries the optimizer from "
                              "a stage the run trains; a run started from given weights "
                              "restarts", "set train.stage_boundary=restart")
        self._eval_steps: dict = {}
        self.ckpt = Checkpointer(self.workdir / CHECKPOINTS_DIR, cfg.train.keep_checkpoints)
        self.damaged: dict[int, str] = {}  # step -> why it cannot be restored

    # ------------------------------------------------------------------ #

    def _continues(self) -> bool:
        return self.cfg.train.stage_boundary == "continue" and len(self.plans) > 1

    def schedule_steps(self, plan: StagePlan) -> int:
        """The steps the optimizer's schedule of `plan`'s stage spans: the run's total with
        train.stage_boundary=continue (one schedule, its count carried), else the stage's."""
        return self.total_steps if self._continues() else plan.steps

    def lr_at(self, plan: StagePlan, step: int) -> float:
        """The learning rate of the update that brought the run to global `step`."""
        if self._continues():  # one schedule over the run, its count carried across stages
            return float(lr_schedule(self.cfg.train, self.total_steps)(step - 1))
        return float(lr_schedule(self.cfg.train, plan.steps)(step - 1 - plan.start))

    def _init_state(self, plan: StagePlan, student_params=None, carried_opt=None):
        """Fresh (or stage-carried) params + optimizer state, sharded on the mesh; with
        train.stage_boundary=continue, one schedule over the run and `carried_opt` (the
        previous stage's optimizer state) carried into it."""
        cfg, stage = self.cfg, plan.stage
        seed = cfg.train.seed
        optimizer = make_optimizer(cfg.train, self.schedule_steps(plan),
                                   trainable_layers=self.strategy.trainable_student_layers(stage))
        if self.wrap_optimizer is not None:
            optimizer = self.wrap_optimizer(optimizer)
        if student_params is None and self.init_student is not None:
            # host arrays: the jitted init places them on the trainer's mesh
            student_params = jax.tree_util.tree_map(np.asarray, self.init_student)

        def build():
            student = Transformer(cfg.model, rngs=nnx.Rngs(seed))
            aux = self.strategy.init_aux(stage, nnx.Rngs(seed + 1))
            return student, aux

        abstract_student, abstract_aux = nnx.eval_shape(build)
        graphdefs, abstract_params = split_params(abstract_student, abstract_aux)

        def init(carried):
            student, aux = build()
            _, params = split_params(student, aux)
            if carried is not None:
                params = {**params, "student": to_master(carried)}
            return {"params": params, "opt_state": optimizer.init(params),
                    "step": jnp.asarray(plan.start, jnp.int32)}

        abstract_state = jax.eval_shape(init, student_params)
        shardings = mesh_lib.tree_shardings(self.mesh, abstract_state)
        state = jax.jit(init, out_shardings=shardings)(student_params)
        if carried_opt is not None and self._continues():
            # Through a jit: every leaf its own buffer (the carried count fills two fields,
            # and the step donates each one).
            state = jax.jit(lambda s: s, out_shardings=shardings)(
                {**state, "opt_state": carry_moments(carried_opt, state["opt_state"])})
        return graphdefs, optimizer, state, shardings

    def _teacher_feed(self, plan: StagePlan) -> StageFeed:
        if self.teacher is None:
            return NO_FEED
        return self.teacher.stage_feed(self.strategy, plan.stage, self.mesh)

    def evaluate(self, graphdefs: GraphDefs, params, n_batches: int) -> dict:
        """Validation NLL over the first `n_batches` batches (0: the whole split), and each
        batch's mean NLL and tokens (`valid_batch_nll`, `valid_batch_tokens`): what the
        analysis reads the evaluation's own standard error from."""
        # One compiled eval step per student graph (not one per call).
        eval_step = self._eval_steps.get(graphdefs.student)
        if eval_step is None:
            eval_step = self._eval_steps[graphdefs.student] = jax.jit(make_eval_step(graphdefs))
        sums, counts = [], []
        for batch in self.data.valid_batches(n_batches or None):
            # Traced under the mesh as the train step is (and as hldstudy.aot compiles
            # it): what `auto` decides while tracing sees the mesh's chip.
            with jax.set_mesh(self.mesh):
                s, c = eval_step(params, mesh_lib.put_batch(batch, self.mesh))
            sums.append(float(s))
            counts.append(float(c))
        total, count = sum(sums), sum(counts)
        if count == 0:
            raise InputError("the validation data gave no tokens to evaluate on "
                             "(give more validation data: data.synthetic_valid_docs, or a "
                             "larger validation split)")
        nll = total / count
        return {"valid_nll": nll, "valid_ppl": float(math.exp(min(nll, 700.0))),
                "valid_tokens": int(count),
                "valid_batch_nll": [a / b if b else math.nan for a, b in zip(sums, counts,
                                                                              strict=True)],
                "valid_batch_tokens": [int(b) for b in counts]}

    def run(self, stop_at_step: int | None = None) -> dict:
        """Trains to the end, or to `stop_at_step` (behaves exactly as a SIGTERM there):
        `train_members` with this run alone."""
        return train_members([self], SOLO, stop_at_step=stop_at_step)[0]

    # -- what the one loop (`train_members`) asks of each run ------------ #

    def resume_point(self) -> tuple[int, dict | None]:
        """The newest step (not known damaged) whose metadata reads, and that metadata;
        (0, None) when nothing was saved. A damaged one (unreadable metadata or state) is
        reported and skipped; it is moved to checkpoints.damaged/ once an older one
        restored. When none restores, nothing is moved and an `InputError` lists them."""
        for step in self.ckpt.steps():
            if step in self.damaged:
                continue
            try:
                meta = self.ckpt.restore_meta(step)
                if not isinstance(meta, dict) or not {"stage", "flops_spent"} <= set(meta):
                    raise ValueError(f"metadata without stage/flops_spent: {meta!r}"[:200])
            except Exception as e:  # noqa: BLE001 - any unreadable checkpoint is damaged
                self._mark_damaged(step, _one_line(e))
                continue
            if step > self.total_steps:
                raise ConfigError("train.steps",
                                  f"{self.workdir} already holds step {step} > {self.total_steps}",
                                  "ask for at least as many steps as the run already has")
            return step, meta
        if self.damaged:
            listed = "; ".join(f"step {s}: {r}" for s, r in sorted(self.damaged.items(),
                                                                  reverse=True))
            raise InputError(f"no checkpoint in {self.ckpt.directory} can be restored ({listed}); "
                             f"move {self.ckpt.directory} aside to start the run over")
        return 0, None

    def _mark_damaged(self, step: int, reason: str) -> None:
        self.damaged[step] = reason
        warn(f"checkpoint {self.ckpt.step_dir(step)} cannot be restored ({reason}); falling "
             "back to the previous one", "hldstudy.train")

    def restore(self, step: int, state, shardings):
        """Checkpoint `step`'s state into `state`'s shapes and `shardings`. One that cannot
        be restored is marked damaged (`_DamagedCheckpoint`: look for the resume points
        again); after a restore, the damaged steps leave checkpoints/ (a later save of the
        same step must not find them, keep-last-k must not count them)."""
        try:
            state, _ = self.ckpt.restore(step, abstract_like(state, shardings))
        except Exception as e:  # noqa: BLE001 - fall back to the previous step
            self._mark_damaged(step, _one_line(e))
            raise _DamagedCheckpoint() from e
        if self.damaged:
            if mesh_lib.is_primary():  # process 0 moves them; the others wait, then look again
                for s in sorted(self.damaged):
                    if s in self.ckpt.steps():
                        dest = self.ckpt.quarantine(s)
                        warn(f"moved the damaged checkpoint of step {s} to {dest}; resumed "
                             f"from step {step}", "hldstudy.train")
            mesh_lib.sync("hldstudy-damaged-aside")
            self.ckpt.manager.reload()
            self.damaged.clear()
        return state

    def write_config(self) -> None:
        """The run's resolved config beside its results (process 0 writes the run's files;
        all save checkpoints)."""
        if mesh_lib.is_primary():
            save_config(self.cfg, self.workdir / "config.json")

    def open_logger(self, resume_step: int):
        return (MetricsLogger(self.workdir, self.cfg, resume_step) if mesh_lib.is_primary()
                else _NoLogger())

    def save(self, step: int, state, stage: str, flops_spent: float, data_cursor: dict) -> None:
        """data_cursor: the training stream's cursor of batch `step` (`state_at`), which a
        resume restores instead of replaying the stream."""
        self.ckpt.save(step, state, {"stage": stage, "step": step, "flops_spent": flops_spent,
                                     "data": data_cursor, "seed": self.cfg.train.seed})

    def restore_data(self, step: int, meta: dict) -> str:
        """Positions the training stream at the checkpoint's data cursor; says how."""
        cursor = meta.get("data")
        if isinstance(cursor, dict) and "version" in cursor:
            try:
                at = self.data.train.restore(cursor)
            except InputError as e:
                raise InputError(f"{e}{self._data_changes()}") from None
            if at != step:
                raise InputError(f"the checkpoint of step {step} holds the data cursor of "
                                 f"batch {cursor['step']}")
            return "from the checkpoint's data cursor"
        return "with no data cursor in the checkpoint (saved by an older version)"

    def _data_changes(self) -> str:
        """The data fields changed since the run's config.json (still the checkpoint's)."""
        try:
            old = flatten(config_to_dict(read_config(self.workdir / "config.json")))
        except (OSError, ValueError):
            return ""
        new = flatten(config_to_dict(self.cfg))
        changed = [f"{k} {old.get(k)!r} -> {v!r}" for k, v in sorted(new.items())
                   if k.startswith("data.") and old.get(k) != v]
        if not changed:  # the config is the run's own: the checkpoint is not
            return (f"; this run's config.json has not changed, so the checkpoints in "
                    f"{self.workdir / CHECKPOINTS_DIR} were written by another run: move them "
                    "aside, or use another --workdir")
        return (f"; changed since the checkpoint: {', '.join(changed)} (restore them, or "
                "train from scratch in a new --workdir)")

    def nonfinite(self, plan: StagePlan, bad: int, step: int, loss: float | None,
                  last_saved: int | None) -> str:
        """The one-line account of a non-finite state first seen at step `bad`."""
        stage = f" (stage {plan.stage.name})" if len(self.plans) > 1 else ""
        seen = f"; the loss was {loss} at step {step}" if loss is not None else ""
        kept = (f"the last checkpoint, step {last_saved}, is intact" if last_saved
                else "no checkpoint was saved")
        return (f"non-finite training state: the loss or gradient norm first became "
                f"non-finite at step {bad}{stage}{seen}; it was not saved ({kept}). Lower "
                f"train.lr (now {self.cfg.train.lr:g}) or train.grad_clip (now "
                f"{self.cfg.train.grad_clip:g}), or check the data")

    def _finish(self, graphdefs, state, flops_spent, logger) -> dict:
        cfg = self.cfg
        metrics = self.evaluate(graphdefs, state["params"], cfg.train.eval_batches)
        result = {"status": "done", "name": cfg.name, "method": cfg.distill.method,
                  "steps": int(state["step"]), "flops_spent": flops_spent,
                  "flops_budget": cfg.budget.flops, "count_teacher": cfg.budget.count_teacher,
                  "stages": {p.stage.name: {"steps": p.steps, "flops_per_step": p.flops_per_step}
                             for p in self.plans},
                  **metrics}
        logger.log({"step": int(state["step"]), **scalars(metrics)})
        logger.summary(scalars(metrics))
        if mesh_lib.is_primary():
            write_json_atomic(self.workdir / "results.json", result)
        return result


class SoloSteps:
    """What differs for a run trained alone: its own train state through the solo train
    step, and a non-finite state stops the run (`RuntimeFault`, exit 3). The cohort's
    counterpart is `hldstudy.train.cohort.CohortSteps`."""

    stacked = False  # the state as it is (a cohort stacks its members' on axis 0)

    def build(self, members: list[Trainer], plan: StagePlan, graphdefs, optimizer, feed,
              microbatches: int = 1):
        """(step, hps): `step(states, batch, teacher_in, hps, bad) -> (states, metrics, bad)`."""
        lead = members[0]
        return train_program(lead.strategy, plan.stage, graphdefs, optimizer, feed.forward,
                             microbatches=microbatches), {}

    def fit_hint(self, k: int) -> str:
        return ""

    def diverged(self, member: Trainer, line: str, bad: int, last_saved: int | None) -> dict:
        raise RuntimeFault(line)


SOLO = SoloSteps()


def stack(trees):
    return jax.tree_util.tree_map(lambda *xs: jnp.stack(xs), *trees)


def unstack(tree, k: int):
    return jax.tree_util.tree_map(lambda x: x[k], tree)


def train_members(members: list[Trainer], steps, *, stop_at_step: int | None = None,
                  outcomes: dict[int, dict] | None = None) -> dict[int, dict]:
    """The training loop, for one run alone (`Trainer.run`) or for a cohort's members that
    share data, teacher and stage plans (`hldstudy.train.cohort`): trains every member
    not in `outcomes` to the end, or to `stop_at_step` (as a SIGTERM there: checkpoint,
    then `Interrupted`); returns {member index: its results.json} with `outcomes`.

    `steps` is what differs between the two (`SoloSteps`, `CohortSteps`): the compiled
    step, and what a non-finite member does (stops the run; stops alone).

    Each member resumes from its own newest checkpoint that restores; no intact one is
    deleted. Members at different steps (a crash between their saves, a damaged
    checkpoint moved aside, a member added to a cohort) are not dropped back to a
    common step: the ones furthest behind train together, alone, up to the next
    member's step (saving there), then on together. Chosen over splitting them into
    sub-cohorts that each train to the end: the teacher still runs once per step from
    that step on, and no member retrains a step it saved."""
    outcomes = dict(outcomes or {})
    try:
        with _StopFlag() as stop:
            stop.stop_at_step = stop_at_step
            while True:
                todo = [i for i in range(len(members)) if i not in outcomes]
                if not todo:
                    return outcomes
                try:
                    points = {i: members[i].resume_point() for i in todo}
                except _DamagedCheckpoint:
                    continue
                low = min(s for s, _ in points.values())
                group = [i for i in todo if points[i][0] == low]
                until = min((s for s, _ in points.values() if s > low), default=None)
                if until is not None:
                    ahead = [members[i].cfg.name for i in todo if i not in group]
                    warn(f"{', '.join(members[i].cfg.name for i in group)} resume(s) from step "
                         f"{low}, {', '.join(ahead)} from later steps: step {low} to {until} "
                         "is trained without the members that hold it", "hldstudy.train")
                try:
                    _train_group(members, group, points, steps, stop, until, outcomes)
                except _DamagedCheckpoint:
                    continue
                if until is None:
                    return outcomes
    finally:
        for m in members:
            m.ckpt.close()
        for teacher in {id(m.teacher): m.teacher for m in members
                        if m.teacher is not None}.values():
            teacher.close()


def _train_group(members, group, points, steps, stop, until, outcomes) -> None:
    """Trains `group` (members resuming from the same step) to the end and finishes them,
    or, with `until`, up to step `until` (saved there)."""
    lead = members[group[0]]
    resume, meta = points[group[0]]
    flops = {i: float(points[i][1]["flops_spent"]) if points[i][1] else 0.0 for i in group}
    loggers = {}
    try:
        resumed = lead.restore_data(resume, meta) if meta is not None and resume else None
        for i in group:  # every check passed: the run's files are written from here on
            members[i].write_config()
            loggers[i] = members[i].open_logger(resume)
        carried, carried_opt, states, graphdefs = {}, {}, {}, None
        for plan in lead.plans:
            here = meta is not None and meta["stage"] == plan.stage.name \
                and plan.start <= resume <= plan.end
            if resume >= plan.end and not here:
                continue
            inits = {i: members[i]._init_state(plan, carried.get(i), carried_opt.get(i))
                     for i in group}
            graphdefs, optimizer = inits[group[0]][:2]
            states = {i: members[i].restore(resume, init[2], init[3]) if here else init[2]
                      for i, init in inits.items()}
            shardings = {i: init[3] for i, init in inits.items()}
            del inits
            states = _run_stage(members, group, plan, graphdefs, optimizer, states, shardings,
                                loggers, stop, flops, steps, until, outcomes, resumed)
            if plan.end > resume:  # its first batch said how the data resumed
                resumed = None
            group = list(states)
            carried = {i: s["params"]["student"] for i, s in states.items()}
            carried_opt = {i: s["opt_state"] for i, s in states.items()}
            meta = None
            if not group or (until is not None and until < lead.total_steps
                             and plan.end >= until):
                return
        if meta is not None:  # no stage of this run holds the checkpoint's step
            raise ConfigError("train.steps", f"the checkpoint of step {resume} (stage "
                              f"{meta['stage']!r}) is outside that stage under this run's plan "
                              f"of {lead.total_steps} steps",
                              "restore the original train.steps / budget.flops")
        for i in group:
            outcomes[i] = members[i]._finish(graphdefs, states[i], flops[i], loggers[i])
    finally:
        for logger in loggers.values():
            logger.close()


class _Lanes:
    """The members a stage trains, one lane each of the (stacked) state: which are still
    alive, the step each last saved, and how a non-finite one is stopped."""

    def __init__(self, members, group, plan, steps, outcomes):
        self.members, self.group, self.plan, self.steps = members, group, plan, steps
        self.outcomes = outcomes
        self.alive = [True] * len(group)
        self.last_saved = [members[i].ckpt.latest_step() for i in group]

    def live(self):
        """(lane, member index) of every member still training."""
        return [(j, i) for j, i in enumerate(self.group) if self.alive[j]]

    def check(self, bad, step: int, losses=None) -> None:
        """Stops the members found non-finite (never saved, never logged again)."""
        bad_host = np.reshape(jax.device_get(bad), -1)
        for j, i in enumerate(self.group):
            loss = None if losses is None else float(np.reshape(losses, -1)[j])
            if self.alive[j] and (bad_host[j] != 0 or (loss is not None
                                                       and not math.isfinite(loss))):
                self.alive[j] = False
                m = self.members[i]
                first = int(bad_host[j]) or step
                line = m.nonfinite(self.plan, first, step, loss, self.last_saved[j])
                self.outcomes[i] = self.steps.diverged(m, line, first, self.last_saved[j])


def _progress_bar(lead, plan, step: int, k: int):
    if not (lead.cfg.train.progress and mesh_lib.is_primary()):
        return None
    from tqdm.auto import tqdm

    return tqdm(total=lead.total_steps, initial=step, unit="step", dynamic_ncols=True,
                desc=f"{lead.cfg.name}{f'+{k - 1}' if k > 1 else ''}:{plan.stage.name}")


def _run_stage(members, group, plan, graphdefs, optimizer, states, shardings, loggers, stop,
               flops, steps, until, outcomes, resumed: str | None = None) -> dict:
    """Trains `group` through one stage (or to `until`); returns {member: state} of the
    members still training. resumed: how the data was positioned, when resuming."""
    lead = members[group[0]]
    cfg = lead.cfg
    end, k = plan.end, len(group)
    step = int(states[group[0]]["step"])
    feed = lead._teacher_feed(plan)
    feed.begin(step, end, lead.workdir, lead.data.train.state_at(step))
    bar = None
    try:
        def build(microbatches: int):
            return steps.build([members[i] for i in group], plan, graphdefs, optimizer, feed,
                               microbatches)

        hps = build(1)[1]  # the hyperparameters do not depend on the micro-batches
        if steps.stacked:
            packed = stack([states[i] for i in group])
            out_shardings = jax.tree_util.tree_map(lambda x: x.sharding, packed)
        else:
            packed, out_shardings = states[group[0]], shardings[group[0]]
        del states

        def lane(tree, j):
            return unstack(tree, j) if steps.stacked else tree

        # The first step (global numbering) whose loss or gradient norm was not finite,
        # per member; 0: none.
        bad = jax.device_put(jnp.zeros((k,) if steps.stacked else (), jnp.int32),
                             mesh_lib.replicated(lead.mesh))
        compiled = None
        lanes = _Lanes(members, group, plan, steps, outcomes)
        tokens_per_step = cfg.data.batch_size * cfg.data.seq_len
        bar = _progress_bar(lead, plan, step, k)
        t_last, steps_since = time.perf_counter(), 0
        replayed = lead.data.train.replayed
        while step < end and any(lanes.alive):
            batch = mesh_lib.put_batch(lead.data.train.batch_at(step), lead.mesh,
                                       cfg.data.batch_size)
            if resumed is not None:
                note(f"resumed at step {step}: the data {resumed}, replayed "
                     f"{lead.data.train.replayed - replayed} batches", "hldstudy.train")
                resumed = None
            args = (packed, batch, feed.inputs(step, batch), hps, bad)
            if compiled is None:
                compiled = _compile_fitting(build, args, (out_shardings, None, bad.sharding),
                                            lead, plan, k, steps.fit_hint(k))
            packed, metrics, bad = compiled(*args)
            del args
            step += 1
            steps_since += 1
            for i in group:
                flops[i] += plan.flops_per_step
            if step % cfg.train.log_every == 0 or step == end:
                host = jax.device_get(metrics)
                lanes.check(bad, step, host["loss"])
                tok_s = steps_since * tokens_per_step / max(time.perf_counter() - t_last, 1e-9)
                extra = feed.metrics()
                for j, i in lanes.live():
                    loggers[i].log({"step": step, "stage": plan.stage.name,
                                    **{key: float(lane(v, j)) for key, v in host.items()},
                                    "lr": members[i].lr_at(plan, step),
                                    "tokens_per_s": tok_s, "flops_spent": flops[i], **extra})
                if bar is not None:
                    bar.set_postfix(loss=f"{float(np.reshape(host['loss'], -1)[0]):.3f}",
                                    tok_s=f"{tok_s:.0f}")
                t_last, steps_since = time.perf_counter(), 0
            if bar is not None:
                bar.update(1)
            if cfg.train.eval_every and step % cfg.train.eval_every == 0 and step < end:
                for j, i in lanes.live():
                    loggers[i].log({"step": step, **scalars(members[i].evaluate(
                        graphdefs, lane(packed["params"], j), cfg.train.eval_batches))})
            boundary = cfg.train.checkpoint_every and step % cfg.train.checkpoint_every == 0
            if stop.stop_at_step is not None and step >= stop.stop_at_step:
                stop.signum = signal.SIGTERM
            pause = until is not None and step >= until
            if boundary or step == end or stop.signum is not None or pause:
                lanes.check(bad, step)  # never save a non-finite state
                cursor = lead.data.train.state_at(step)  # one stream: the cohort shares it
                for j, i in lanes.live():
                    members[i].save(step, lane(packed, j), plan.stage.name, flops[i],
                                    cursor)
                    lanes.last_saved[j] = step
            if stop.signum is not None and step < end:
                raise Interrupted(step, stop.signum)
            if pause:
                break
        return {i: lane(packed, j) for j, i in lanes.live()}
    finally:
        if bar is not None:
            bar.close()
        feed.close()


def _compile_fitting(build, args, out_shardings, lead, plan, k: int, hint: str):
    """The stage's train program compiled in the fewest micro-batches that fit the device
    (train.microbatches, or 0: auto), checked against the memory available (`check_fits`)."""
    cfg = lead.cfg
    label = plan.stage.name if k == 1 else f"{plan.stage.name}, cohort of {k}"
    candidates = microbatch_candidates(cfg.train.microbatches, cfg.data.batch_size,
                                       lead.mesh.devices.size)
    for i, m in enumerate(candidates):
        # The step's outputs keep its inputs' placement, so the one compiled program
        # (checked for memory before it runs) takes them back at every step.
        jitted = jax.jit(build(m)[0], out_shardings=out_shardings, donate_argnums=(0,))
        # Traced under the mesh: the fused KD loss partitions itself over the batch.
        with jax.set_mesh(lead.mesh):
            compiled = jitted.lower(*args).compile()
        last = i == len(candidates) - 1
        if cfg.train.microbatches:
            more = f"; or train in more micro-batches (train.microbatches, now {m})"
        else:
            more = f" (train.microbatches=0 tried 1 to {m} micro-batches)"
        try:
            check_fits(compiled, lead.mesh, cfg, label, hint=hint + more)
        except RuntimeFault:
            if last:
                raise
            continue
        if m > 1 and not cfg.train.microbatches:
            warn(f"{label}: the whole batch does not fit; training it in {m} micro-batches of "
                 f"{cfg.data.batch_size // m} sequences (train.microbatches=0, auto)",
                 "hldstudy.train")
        return compiled
    raise AssertionError("no micro-batch candidate")  # candidates always hold 1 or more


def memory_available(device) -> int | None:
    """Bytes that new buffers on `device` can take now; None when unknown. On the CPU, the
    host's available memory (shared by its devices); elsewhere the allocator's limit less
    what it holds."""
    if device.platform == "cpu":
        try:
            import psutil

            return int(psutil.virtual_memory().available)
        except ImportError:
            try:
                with open("/proc/meminfo") as fh:
                    for line in fh:
                        if line.startswith("MemAvailable:"):
                            return int(line.split()[1]) * 1024
            except OSError:
                return None
            return None
    try:
        stats = device.memory_stats() or {}
    except Exception:  # noqa: BLE001 - a backend without memory stats
        return None
    if "bytes_limit" not in stats:
        return None
    return int(stats["bytes_limit"]) - int(stats.get("bytes_in_use", 0))


def _gib(n: float) -> str:
    return f"{n / 2**30:.3g} GiB"


def check_fits(compiled, mesh, cfg: Config, stage: str = "", hint: str = "") -> None:
    """Refuses (RuntimeFault) a compiled train step that cannot fit: what it allocates
    beyond its (already resident) arguments, per XLA's memory analysis (outputs +
    temporaries - outputs aliased to donated inputs), against `memory_available`.
    `hint` ends the message (another way to make it fit)."""
    try:
        stats = compiled.memory_analysis()
    except Exception:  # noqa: BLE001 - a backend without memory analysis: nothing to compare
        return
    if stats is None:
        return
    arg, out = stats.argument_size_in_bytes, stats.output_size_in_bytes
    temp, alias = stats.temp_size_in_bytes, stats.alias_size_in_bytes
    new = max(out + temp - alias, 0)
    local = [d for d in mesh.devices.flat if d.process_index == jax.process_index()]
    if not local:
        return
    if local[0].platform == "cpu":  # the host's memory, shared by its devices
        need, avail, where = new * len(local), memory_available(local[0]), "host memory"
    else:
        avails = [memory_available(d) for d in local]
        if any(a is None for a in avails):
            return
        need, avail, where = new, min(avails), f"{local[0].platform} memory per device"
    if avail is None or need <= avail:
        return
    d = cfg.data
    raise RuntimeFault(
        f"the train step{f' ({stage})' if stage else ''} does not fit: it needs "
        f"{_gib(need)} more ({len(local)} device(s); XLA memory analysis per device: "
        f"arguments {_gib(arg)} + outputs {_gib(out)} + temporaries {_gib(temp)} - aliased "
        f"{_gib(alias)}, arguments already resident) but {_gib(avail)} of {where} is "
        f"available; lower data.batch_size (now {d.batch_size}) or data.seq_len "
        f"(now {d.seq_len}){hint}")


def train(cfg: Config, workdir: str | Path, **kwargs) -> dict:
    # The job owns the run directory (run.lock, held by process 0) before anything is written.
    with job_owns(workdir, "hldstudy.train"):
        return Trainer(cfg, workdir, **kwargs).run()
