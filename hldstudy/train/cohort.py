"""Cohort training: K students of one method and one shape, one teacher forward per step.

Design notes: `docs/training.md`, under this file's name.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import jax.numpy as jnp

from hldstudy.config import Config, config_to_dict, field_rules, flatten
from hldstudy.errors import ConfigError
from hldstudy.fileio import write_json_atomic
from hldstudy.rundir import RESULTS_FILE, TOKENIZER_FILE, read_results
from hldstudy.train.loop import Trainer, train_members
from hldstudy.train.optim import make_optimizer
from hldstudy.train.program import HPARAMS, MODES, Members, default_mode, train_program

DIVERGED = "diverged"

def _value(cfg: Config, name: str) -> float:
    section, field = HPARAMS[name]
    return float(getattr(getattr(cfg, section), field))


def check_members(cfgs: list[Config]) -> None:
    """ConfigError unless the configs differ only in `member` fields (and names)."""
    if not cfgs:
        raise ConfigError("cohort", "a cohort has at least one member")
    rules = field_rules()
    shared = {k for k, r in rules.items() if r["drift"] and not r["member"] and k != "name"}
    first = flatten(config_to_dict(cfgs[0]))
    for cfg in cfgs[1:]:
        flat = flatten(config_to_dict(cfg))
        for key in sorted(shared):
            if flat.get(key) != first.get(key):
                raise ConfigError(key, f"cohort members {cfgs[0].name!r} and {cfg.name!r} "
                                  f"differ ({first.get(key)!r} vs {flat.get(key)!r}); only "
                                  "member fields (lr, seed, temperature, alpha, hidden_weight) "
                                  "may differ within a cohort")


class CohortSteps:
    """What differs for a cohort in the one training loop (`train_members`; the solo
    counterpart is `hldstudy.train.loop.SoloSteps`): the members' states stacked on
    axis 0 (`hldstudy.train.program`), with the hyperparameters that vary in the
    cohort traced; a non-finite member is stopped alone."""

    stacked = True

    def __init__(self, varying: list[str], mode: str | None):
        self.varying, self.mode = varying, mode  # mode None: default_mode of the platform

    def build(self, members: list[Trainer], plan, graphdefs, optimizer, feed,
              microbatches: int = 1):
        lead = members[0]
        trainable = lead.strategy.trainable_student_layers(plan.stage)

        def make_opt(lr):  # the schedule each member's solo run follows, at its own peak
            return make_optimizer(lead.cfg.train, lead.schedule_steps(plan),
                                  trainable_layers=trainable, lr=lr)

        hps = {n: jnp.asarray([_value(m.cfg, n) for m in members], jnp.float32)
               for n in self.varying}
        mode = self.mode or default_mode(lead.mesh.devices.flat[0].platform)
        return train_program(lead.strategy, plan.stage, graphdefs, optimizer, feed.forward,
                             Members(make_opt, mode), microbatches), hps

    def fit_hint(self, k: int) -> str:
        return f"; or train fewer students per cohort (now {k}: --cohort K, or --cohort auto)"

    def diverged(self, member: Trainer, line: str, bad: int, last_saved: int | None) -> dict:
        cfg = member.cfg
        result = {"status": DIVERGED, "name": cfg.name, "method": cfg.distill.method,
                  "step": int(bad), "last_checkpoint": last_saved,
                  "error": f"{line} (this cohort member was stopped alone)"}
        write_json_atomic(member.workdir / RESULTS_FILE, result)
        return result


class CohortTrainer:
    """Trains the members (`cfgs[i]` in `workdirs[i]`) as one cohort.

    teacher / data: shared by every member (loaded once from the first member's config
    when None).
    """

    def __init__(self, cfgs: list[Config], workdirs: list[str | Path], *, teacher=None,
                 data=None, devices=None, mode: str | None = None):
        if len(cfgs) != len(workdirs):
            raise ValueError("one workdir per member")
        check_members(cfgs)
        names = [c.name for c in cfgs]
        if len(set(map(str, workdirs))) != len(workdirs):
            raise ConfigError("cohort", f"members share a run directory: {names}")
        if mode is not None and mode not in MODES:
            raise ConfigError("cohort", f"mode {mode!r} is not one of {', '.join(MODES)}")
        self.members: list[Trainer] = []
        prepared_in = None if data is not None else Path(workdirs[0])
        for cfg, wd in zip(cfgs, workdirs, strict=True):
            tok = prepared_in / TOKENIZER_FILE if prepared_in is not None else None
            if tok is not None and tok.is_file() and Path(wd) != prepared_in:
                # The data is prepared once; each run directory still holds the tokenizer
                # it trained with (what evaluation and the teacher checks read).
                Path(wd).mkdir(parents=True, exist_ok=True)
                shutil.copyfile(tok, Path(wd) / TOKENIZER_FILE)
            m = Trainer(cfg, wd, teacher=teacher, data=data, devices=devices)
            teacher, data = m.teacher, m.data
            self.members.append(m)
        plans = [[(p.stage.name, p.steps) for p in m.plans] for m in self.members]
        if any(p != plans[0] for p in plans):
            raise ConfigError("cohort", f"members plan different stage steps: {plans}")
        self.steps = CohortSteps([n for n in HPARAMS if len({_value(c, n) for c in cfgs}) > 1],
                                 mode)

    def run(self, stop_at_step: int | None = None) -> dict[str, dict]:
        """Trains every unfinished member to the end (or to `stop_at_step`, as a SIGTERM
        there); returns {member name: its results.json}. Raises `Interrupted` (every
        member saved) when stopped by a signal."""
        finished = {}
        for i, m in enumerate(self.members):
            res = read_results(m.workdir)
            if res is not None and res.get("status") in ("done", DIVERGED):
                finished[i] = res
        out = train_members(self.members, self.steps, stop_at_step=stop_at_step,
                            outcomes=finished)
        return {self.members[i].cfg.name: out[i] for i in sorted(out)}


def train_cohort(cfgs: list[Config], workdirs: list[str | Path], **kwargs) -> dict[str, dict]:
    return CohortTrainer(cfgs, workdirs, **kwargs).run()
