"""Cohort training: K students of one method and one shape, one teacher forward per step.

The members of a cohort differ only in config fields tagged `member`
(`hldstudy.config`): the peak learning rate, the KD temperature and NLL weight,
the alignment weight and the init seed. Everything else (method, shapes, data,
teacher, budget, stage steps) is the same, so at every step they read the same
`batch_at(step)` and need the same teacher outputs. One jitted step runs the
teacher once and the K students stacked on a leading axis (params, optimizer state
and the per-member hyperparameters; the batch and the teacher's outputs are
shared), either batched (`jax.vmap`, accelerators) or one after the other inside
the step (`jax.lax.map`, the CPU default: see `default_mode`). A hyperparameter that varies within the cohort is
a traced value (the fused KD loss takes temperature / alpha as operands, the
optimizer is built in the step around a traced peak lr); one that does not stays a
constant of the program, exactly as in a solo run. The cohort compiles once per
stage.

Each member is a `Trainer` (`hldstudy.train.loop`): it validates its config, writes
its run directory (config.json, metrics.jsonl, checkpoints/, results.json), plans
its stages, initialises, saves, restores and evaluates itself. The members train
through the solo run's own loop (`hldstudy.train.loop.train_members`) with
`CohortSteps`: the stacked step, and a diverging member stopped alone. A member is
charged its solo run's FLOPs and trains its solo run's steps.

Resume: each member resumes from its own newest checkpoint (after SIGTERM, saved at
once, or kill -9); the members furthest behind are brought forward alone up to the
next member's step, then the cohort goes on together (`train_members` says why).
No intact checkpoint is deleted; a damaged one is moved to checkpoints.damaged/.

Divergence: the step keeps, per member, the first step whose loss or gradient
norm was not finite (on the device). A member found non-finite at a log step or
before a save is stopped alone: it is not saved again (its last good checkpoint
stays), its results.json says `"status": "diverged"` with a one-line reason, and
the others go on (its lane keeps computing, unread, until the stage ends).
"""

from __future__ import annotations

import copy
import dataclasses
import os
import shutil
from pathlib import Path

import jax
import jax.numpy as jnp

from hldstudy.config import Config, config_to_dict, field_rules, flatten, traced_members
from hldstudy.errors import ConfigError
from hldstudy.fileio import write_json_atomic
from hldstudy.rundir import RESULTS_FILE, TOKENIZER_FILE, read_results
from hldstudy.train.loop import Trainer, train_members
from hldstudy.train.optim import make_optimizer
from hldstudy.train.step import make_train_step, teacher_outputs, with_finite_record

DIVERGED = "diverged"

# Per-member hyperparameters that enter the compiled step: {name: (section, field)} of the
# fields tagged member="traced" (train.seed, member="init", only seeds the init).
HPARAMS = traced_members()


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


def with_hparams(strategy, hp: dict):
    """A view of `strategy` whose distill.* member fields are `hp`'s (traced) values."""
    changes = {k: v for k, v in hp.items() if HPARAMS[k][0] == "distill"}
    if not changes:
        return strategy
    view = copy.copy(strategy)
    view.cfg = dataclasses.replace(strategy.cfg,
                                   distill=dataclasses.replace(strategy.cfg.distill, **changes))
    return view


MODES = ("vmap", "map")


def default_mode(platform: str) -> str:
    """How the members run inside the step. "map" (`jax.lax.map`: one member after the
    other, each the solo step's shapes) on the CPU, where the batched (vmapped) layers
    of the tiny models run slower than K solo steps (benchmarks/cohort.py: the
    quickstart's kd cohort trained at 2,500 tokens/s per member under vmap vs 15,000 for
    a solo run); "vmap" (one batched step, K x the solo step's work in wider matmuls)
    on accelerators. Either way the teacher runs once per step. The environment variable
    HLDSTUDY_COHORT_MODE (vmap or map) overrides it (benchmarks/cohort.py measures both)."""
    forced = os.environ.get("HLDSTUDY_COHORT_MODE")
    if forced:
        if forced not in MODES:
            raise ConfigError("HLDSTUDY_COHORT_MODE", f"{forced!r} is not one of "
                              f"{', '.join(MODES)}")
        return forced
    return "map" if platform == "cpu" else "vmap"


def make_cohort_step(strategy, stage, graphdefs, optimizer, make_opt, teacher_forward,
                     mode: str = "vmap"):
    """`step(states, batch, teacher_in, hps, bad) -> (states, metrics, bad)` (not jitted).

    states: the members' train states stacked on axis 0; hps: {name: [K] float32} for
    the hyperparameters that vary (the others are the program's constants); bad: [K]
    int32, the first step whose loss or gradient norm was not finite (0: none).
    The teacher runs once, outside the vmap; its outputs are shared by every member.
    """

    def step(states, batch, teacher_in, hps, bad):
        teacher = teacher_outputs(teacher_in, batch, teacher_forward)  # once for all

        def member(state, hp, bad_k):
            opt = make_opt(hp["lr"]) if "lr" in hp else optimizer
            train_step = make_train_step(with_hparams(strategy, hp), stage, graphdefs, opt)
            return with_finite_record(train_step)(state, batch, teacher, hp, bad_k)

        if mode == "map":  # sequential over the members: the solo step's shapes
            return jax.lax.map(lambda x: member(*x), (states, hps, bad))
        if mode != "vmap":
            raise ConfigError("cohort", f"mode {mode!r} is not one of {', '.join(MODES)}")
        return jax.vmap(member)(states, hps, bad)

    return step


def cohort_step_probe(cfg: Config, k: int, method: str | None = None, stage: str | None = None,
                      teacher_model=None, *, layout: str = "colocated",
                      varying: tuple[str, ...] = ("lr", "temperature"), mode: str = "vmap"):
    """`(step, args)` of the cohort step the trainer compiles, all abstract (nothing is
    allocated): `jax.jit(step, donate_argnums=(0,)).lower(*args)` for XLA's analyses.
    Built like `hldstudy.train.probe.train_step_probe`, with K stacked states and
    `varying` hyperparameters as [K] arrays."""
    from hldstudy.train.probe import train_step_probe

    # The solo probe gives the abstract state, batch and teacher input; the pieces of
    # the step are rebuilt exactly as the trainer builds them.
    _, state, batch, teacher_in = train_step_probe(cfg, method, stage, teacher_model,
                                                   layout=layout)
    from flax import nnx

    from hldstudy.distill import methods
    from hldstudy.distill.base import make_strategy
    from hldstudy.model.transformer import Transformer
    from hldstudy.teacher.colocated import teacher_forward_fn
    from hldstudy.train.step import split_params

    spec = methods.get(method or cfg.distill.method)
    st_name = spec.stage(cfg, stage).name
    cfg = dataclasses.replace(cfg, distill=dataclasses.replace(cfg.distill, method=spec.name))
    strategy = make_strategy(cfg, cfg.model, teacher_model if spec.needs_teacher else None)
    st = next(s for s in strategy.stages() if s.name == st_name)
    graphdefs, _ = split_params(*nnx.eval_shape(
        lambda: (Transformer(cfg.model, rngs=nnx.Rngs(0)), strategy.init_aux(st, nnx.Rngs(1)))))
    trainable = strategy.trainable_student_layers(st)
    optimizer = make_optimizer(cfg.train, cfg.train.steps, trainable_layers=trainable)

    def make_opt(lr):
        return make_optimizer(cfg.train, cfg.train.steps, trainable_layers=trainable, lr=lr)

    forward = None
    if spec.needs_teacher and layout == "colocated":
        tcfg = dataclasses.replace(teacher_model, dtype=cfg.teacher.dtype, remat=False)
        t_gd, _ = nnx.split(nnx.eval_shape(lambda: Transformer(tcfg, rngs=nnx.Rngs(2))),
                            nnx.Param)
        forward = teacher_forward_fn(t_gd, strategy.teacher_layers(st),
                                     strategy.teacher_needs_head(st))
    step = make_cohort_step(strategy, st, graphdefs, optimizer, make_opt, forward, mode)
    states = jax.tree_util.tree_map(
        lambda x: jax.ShapeDtypeStruct((k, *x.shape), x.dtype), state)
    hps = {n: jax.ShapeDtypeStruct((k,), jnp.float32) for n in varying}
    bad = jax.ShapeDtypeStruct((k,), jnp.int32)
    return step, (states, batch, teacher_in if spec.needs_teacher else None, hps, bad)


class CohortSteps:
    """What differs for a cohort in the one training loop (`train_members`; the solo
    counterpart is `hldstudy.train.loop.SoloSteps`): the members' states stacked on
    axis 0 through `make_cohort_step`, with the hyperparameters that vary in the
    cohort traced; a non-finite member is stopped alone."""

    stacked = True

    def __init__(self, varying: list[str], mode: str | None):
        self.varying, self.mode = varying, mode  # mode None: default_mode of the platform

    def build(self, members: list[Trainer], plan, graphdefs, optimizer, feed):
        lead = members[0]
        trainable = lead.strategy.trainable_student_layers(plan.stage)

        def make_opt(lr):
            return make_optimizer(lead.cfg.train, plan.steps, trainable_layers=trainable, lr=lr)

        hps = {n: jnp.asarray([_value(m.cfg, n) for m in members], jnp.float32)
               for n in self.varying}
        mode = self.mode or default_mode(lead.mesh.devices.flat[0].platform)
        return make_cohort_step(lead.strategy, plan.stage, graphdefs, optimizer, make_opt,
                                feed.forward, mode), hps

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
