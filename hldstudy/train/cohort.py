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
its stages, initialises and evaluates itself. The cohort only drives the steps. A
member is charged its solo run's FLOPs and trains its solo run's steps.

Commit and resume: at a checkpoint step s every member saves step s, then
`COHORT_FILE` (in the cohort directory) records s; old checkpoints are pruned
only after that, so the last step every member saved is always on disk. A cohort
resumes from the newest step that every unfinished member holds (checkpoints of
an uncommitted later step are dropped), after SIGTERM (saved at once) or kill -9.

Divergence: the step keeps, per member, the first step whose loss or gradient
norm was not finite (on the device). A member found non-finite at a log step or
before a save is stopped alone: it is not saved again (its last good checkpoint
stays), its results.json says `"status": "diverged"` with a one-line reason, and
the others go on (its lane keeps computing, unread, until the stage ends).
"""

from __future__ import annotations

import copy
import dataclasses
import json
import math
import os
import shutil
import signal
import time
from pathlib import Path

import jax
import jax.numpy as jnp

from hldstudy import sharding as mesh_lib
from hldstudy.config import Config, config_to_dict, field_rules, flatten, traced_members
from hldstudy.errors import ConfigError, InputError, RuntimeFault, warn
from hldstudy.fileio import write_json_atomic
from hldstudy.rundir import RESULTS_FILE, TOKENIZER_FILE, read_results
from hldstudy.signals import StopSignals
from hldstudy.train.loop import Interrupted, Trainer, check_fits
from hldstudy.train.metrics import MetricsLogger
from hldstudy.train.optim import make_optimizer
from hldstudy.train.step import make_train_step

COHORT_FILE = "cohort.json"
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
        teacher = None
        if teacher_in is not None:
            teacher = teacher_forward(teacher_in, batch) if teacher_forward else teacher_in
            teacher = jax.lax.stop_gradient(teacher)

        def member(state, hp, bad_k):
            opt = make_opt(hp["lr"]) if "lr" in hp else optimizer
            train_step = make_train_step(with_hparams(strategy, hp), stage, graphdefs, opt)
            state, metrics = train_step(state, batch, teacher)
            finite = jnp.isfinite(metrics["loss"]) & jnp.isfinite(metrics["grad_norm"])
            bad_k = jnp.where((bad_k == 0) & ~finite, state["step"], bad_k)
            return state, metrics, bad_k

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


def stack(trees):
    return jax.tree_util.tree_map(lambda *xs: jnp.stack(xs), *trees)


def unstack(tree, k: int):
    return jax.tree_util.tree_map(lambda x: x[k], tree)


class _StopFlag(StopSignals):
    stop_at_step: int | None = None


class _DamagedMember(Exception):
    """Member `index`'s checkpoint of `step` cannot be restored."""

    def __init__(self, index: int, step: int, reason: str):
        super().__init__(f"member {index}: step {step}: {reason}")
        self.index, self.step, self.reason = index, step, reason


def _one_line(exc: BaseException) -> str:
    text = f"{type(exc).__name__}: {exc}".strip().splitlines()
    return (text[0] if text else type(exc).__name__)[:300]


class CohortTrainer:
    """Trains the members (`cfgs[i]` in `workdirs[i]`) as one cohort.

    teacher / data: shared by every member (loaded once from the first member's config
    when None). cohort_dir: where the commit marker lives (default: a folder next to
    the members, named after them).
    """

    def __init__(self, cfgs: list[Config], workdirs: list[str | Path], *, teacher=None,
                 data=None, devices=None, cohort_dir: str | Path | None = None,
                 mode: str | None = None):
        if len(cfgs) != len(workdirs):
            raise ValueError("one workdir per member")
        check_members(cfgs)
        names = [c.name for c in cfgs]
        if len(set(map(str, workdirs))) != len(workdirs):
            raise ConfigError("cohort", f"members share a run directory: {names}")
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
        self.teacher = teacher
        # Every member keeps all its checkpoints until the cohort commits a step; the
        # cohort prunes to train.keep_checkpoints afterwards (never the committed step).
        from hldstudy.checkpoint import Checkpointer

        for m in self.members:
            m.ckpt.close()
            m.ckpt = Checkpointer(m.ckpt.directory, None)
        plans = [[(p.stage.name, p.steps) for p in m.plans] for m in self.members]
        if any(p != plans[0] for p in plans):
            raise ConfigError("cohort", f"members plan different stage steps: {plans}")
        self.plans = self.members[0].plans
        if cohort_dir is None:
            parent = Path(workdirs[0]).parent
            cohort_dir = parent / ".cohorts" / "+".join(Path(w).name for w in workdirs)[:200]
        self.cohort_dir = Path(cohort_dir)
        self.cohort_dir.mkdir(parents=True, exist_ok=True)
        self.varying = [n for n in HPARAMS if len({_value(c, n) for c in cfgs}) > 1]
        if mode is not None and mode not in MODES:
            raise ConfigError("cohort", f"mode {mode!r} is not one of {', '.join(MODES)}")
        self.mode = mode  # None: default_mode of the devices' platform
        self.outcomes: dict[str, dict] = {}

    # ------------------------------------------------------------------ #

    def _commit(self, active: list[int], step: int, stage: str) -> None:
        write_json_atomic(self.cohort_dir / COHORT_FILE, {
            "members": [str(m.workdir) for m in self.members], "step": step, "stage": stage,
            "active": [self.members[i].cfg.name for i in active]})
        for i in active:
            m = self.members[i]
            keep = m.cfg.train.keep_checkpoints
            if keep and keep > 0:
                for s in m.ckpt.steps()[keep:]:
                    m.ckpt.manager.delete(s)

    def _resume_point(self, active: list[int]) -> int | None:
        """The newest step every active member holds; later (uncommitted) steps dropped."""
        held = [set(self.members[i].ckpt.steps()) for i in active]
        common = set.intersection(*held) if held else set()
        step = max(common) if common else None
        for i in active:
            m = self.members[i]
            for s in m.ckpt.steps():
                if step is None or s > step:
                    m.ckpt.manager.delete(s)
        return step

    def _diverge(self, i: int, plan, bad: int, loss: float | None, last_saved: int | None):
        m = self.members[i]
        kept = (f"the last checkpoint, step {last_saved}, is intact" if last_saved
                else "no checkpoint was saved")
        line = (f"non-finite training state: the loss or gradient norm first became "
                f"non-finite at step {bad} (stage {plan.stage.name}, loss {loss}); the member "
                f"was stopped alone and not saved ({kept}); lower train.lr (now "
                f"{m.cfg.train.lr:g}) or train.grad_clip")
        result = {"status": DIVERGED, "name": m.cfg.name, "method": m.cfg.distill.method,
                  "step": int(bad), "last_checkpoint": last_saved, "error": line}
        write_json_atomic(m.workdir / RESULTS_FILE, result)
        self.outcomes[m.cfg.name] = result

    def run(self, stop_at_step: int | None = None) -> dict[str, dict]:
        """Trains every unfinished member to the end (or to `stop_at_step`, as a SIGTERM
        there); returns {member name: its results.json}. Raises `Interrupted` after the
        commit when stopped by a signal."""
        loggers: dict[int, MetricsLogger] = {}
        damaged: list[tuple[int, int, str]] = []
        try:
            while True:
                try:
                    return self._run(stop_at_step, loggers)
                except _DamagedMember as e:
                    # As the Trainer does: a member's checkpoint that cannot be restored is
                    # moved to checkpoints.damaged/; the cohort then resumes from the newest
                    # step every member still holds (an older committed one).
                    for lg in loggers.values():
                        lg.close()
                    loggers.clear()
                    m = self.members[e.index]
                    damaged.append((e.index, e.step, e.reason))
                    dest = m.ckpt.quarantine(e.step)
                    warn(f"checkpoint {m.ckpt.step_dir(e.step)} of cohort member "
                         f"{m.cfg.name!r} cannot be restored ({e.reason}); moved to {dest}, "
                         "falling back to the previous step every member holds",
                         "hldstudy.train")
                    if not m.ckpt.steps():
                        listed = "; ".join(f"{self.members[i].cfg.name} step {s}: {r}"
                                           for i, s, r in damaged)
                        raise InputError(
                            f"no checkpoint of cohort member {m.cfg.name!r} in "
                            f"{m.ckpt.directory} can be restored ({listed}); move the "
                            "members' checkpoints aside to start the cohort over") from e
        finally:
            for lg in loggers.values():
                lg.close()
            for m in self.members:
                m.ckpt.close()
            if self.teacher is not None:
                self.teacher.close()

    def _run(self, stop_at_step, loggers) -> dict[str, dict]:
        active = []
        for i, m in enumerate(self.members):
            res = read_results(m.workdir)
            if res is not None and res.get("status") in ("done", DIVERGED):
                self.outcomes[m.cfg.name] = res
            else:
                active.append(i)
        if not active:
            return self.outcomes
        resume = self._resume_point(active)
        metas = {}
        for i in active if resume is not None else ():
            try:
                metas[i] = self.members[i].ckpt.restore_meta(resume)
                if not isinstance(metas[i], dict) or \
                        not {"stage", "flops_spent"} <= set(metas[i]):
                    raise ValueError(f"metadata without stage/flops_spent: {metas[i]!r}"[:200])
            except Exception as e:  # noqa: BLE001 - any unreadable checkpoint is damaged
                raise _DamagedMember(i, resume, _one_line(e)) from e
        for i in active:
            loggers[i] = MetricsLogger(self.members[i].workdir, self.members[i].cfg, resume or 0)
        flops = {i: float(metas[i]["flops_spent"]) if metas else 0.0 for i in active}
        stage_of = metas[active[0]]["stage"] if metas else None
        carried: dict[int, object] = {}
        states = graphdefs = None
        with _StopFlag() as stop:
            stop.stop_at_step = stop_at_step
            for plan in self.plans:
                end = plan.end
                here = resume is not None and stage_of == plan.stage.name \
                    and plan.start <= resume <= end
                if resume is not None and resume >= end and not here:
                    continue
                inits = [self.members[i]._init_state(plan, carried.get(i)) for i in active]
                graphdefs, optimizer = inits[0][0], inits[0][1]
                member_states = []
                for i, (_, _, state, shardings) in zip(active, inits, strict=True):
                    if here:
                        from hldstudy.checkpoint import abstract_like

                        try:
                            state, _ = self.members[i].ckpt.restore(
                                resume, abstract_like(state, shardings))
                        except Exception as e:  # noqa: BLE001 - fall back to an older step
                            raise _DamagedMember(i, resume, _one_line(e)) from e
                    member_states.append(state)
                active, member_states = self._run_stage(plan, graphdefs, optimizer, active,
                                                        member_states, loggers, stop, flops)
                carried = {i: s["params"]["student"] for i, s in
                           zip(active, member_states, strict=True)}
                states = member_states
                resume = None
            for i, state in zip(active, states or [], strict=True):
                m = self.members[i]
                self.outcomes[m.cfg.name] = m._finish(graphdefs, state, flops[i], loggers[i])
        return self.outcomes

    def _compile(self, cohort_step, args, stage: str, k: int):
        """Compiles the cohort step and refuses it, before it runs, when XLA's memory
        analysis says it cannot fit in the memory available (the Trainer's check)."""
        compiled = cohort_step.lower(*args).compile()
        lead = self.members[0]
        try:
            check_fits(compiled, lead.mesh, lead.cfg, f"{stage}, cohort of {k}")
        except RuntimeFault as e:
            raise RuntimeFault(f"{e}; or train fewer students per cohort (now {k}: "
                               "--cohort K, or --cohort auto)") from e
        return compiled

    def _run_stage(self, plan, graphdefs, optimizer, active, member_states, loggers, stop,
                   flops):
        lead = self.members[active[0]]
        cfg = lead.cfg
        end = plan.end
        step = int(member_states[0]["step"])
        stage = plan.stage
        strategy = lead.strategy
        trainable = strategy.trainable_student_layers(stage)

        def make_opt(lr):
            return make_optimizer(cfg.train, plan.steps, trainable_layers=trainable, lr=lr)

        feed = lead._teacher_feed(plan)
        feed.begin(step, end, lead.workdir)
        hps = {n: jnp.asarray([_value(self.members[i].cfg, n) for i in active], jnp.float32)
               for n in self.varying}
        states = stack(member_states)
        del member_states
        k = len(active)
        bad = jax.device_put(jnp.zeros((k,), jnp.int32), mesh_lib.replicated(lead.mesh))
        # The step's outputs keep its inputs' placement, so the one compiled program
        # (checked for memory before it runs) takes them back at every step.
        mode = self.mode or default_mode(lead.mesh.devices.flat[0].platform)
        cohort_step = jax.jit(make_cohort_step(strategy, stage, graphdefs, optimizer, make_opt,
                                               feed.forward, mode),
                              out_shardings=(jax.tree_util.tree_map(lambda x: x.sharding,
                                                                    states), None, bad.sharding),
                              donate_argnums=(0,))
        alive = [True] * k
        last_saved = {i: self.members[i].ckpt.latest_step() for i in active}
        tokens_per_step = cfg.data.batch_size * cfg.data.seq_len
        t_last, steps_since = time.perf_counter(), 0

        def check(step, losses=None):
            bad_host = jax.device_get(bad)
            for j, i in enumerate(active):
                loss = None if losses is None else float(losses[j])
                if alive[j] and (bad_host[j] != 0 or (loss is not None
                                                      and not math.isfinite(loss))):
                    alive[j] = False
                    self._diverge(i, plan, int(bad_host[j]) or step, loss, last_saved[i])

        compiled = None
        try:
            while step < end and any(alive):
                batch = mesh_lib.put_batch(lead.data.train.batch_at(step), lead.mesh)
                args = (states, batch, feed.inputs(step, batch), hps, bad)
                if compiled is None:
                    compiled = self._compile(cohort_step, args, stage.name, k)
                states, metrics, bad = compiled(*args)
                del args
                step += 1
                steps_since += 1
                for i in active:
                    flops[i] += plan.flops_per_step
                if step % cfg.train.log_every == 0 or step == end:
                    host = {key: jax.device_get(v) for key, v in metrics.items()}
                    check(step, host["loss"])
                    dt = time.perf_counter() - t_last
                    extra = feed.metrics()
                    for j, i in enumerate(active):
                        if not alive[j]:
                            continue
                        loggers[i].log({"step": step, "stage": stage.name,
                                        **{key: float(v[j]) for key, v in host.items()},
                                        "tokens_per_s": steps_since * tokens_per_step
                                        / max(dt, 1e-9),
                                        "flops_spent": flops[i], **extra})
                    t_last, steps_since = time.perf_counter(), 0
                if cfg.train.eval_every and step % cfg.train.eval_every == 0 and step < end:
                    for j, i in enumerate(active):
                        if alive[j]:
                            m = self.members[i]
                            loggers[i].log({"step": step, **m.evaluate(
                                graphdefs, unstack(states["params"], j), cfg.train.eval_batches)})
                boundary = cfg.train.checkpoint_every and step % cfg.train.checkpoint_every == 0
                if stop.stop_at_step is not None and step >= stop.stop_at_step:
                    stop.signum = signal.SIGTERM
                if boundary or step == end or stop.signum is not None:
                    check(step)  # never save a non-finite member
                    for j, i in enumerate(active):
                        if alive[j]:
                            m = self.members[i]
                            m.ckpt.save(step, unstack(states, j), {
                                "stage": stage.name, "step": step, "flops_spent": flops[i],
                                "data": {"next_batch": step}, "seed": m.cfg.train.seed,
                                "cohort": str(self.cohort_dir)})
                            last_saved[i] = step
                    self._commit([i for j, i in enumerate(active) if alive[j]], step,
                                 stage.name)
                if stop.signum is not None and step < end:
                    raise Interrupted(step, stop.signum)
        finally:
            feed.close()
        keep = [j for j in range(k) if alive[j]]
        return [active[j] for j in keep], [unstack(states, j) for j in keep]


def train_cohort(cfgs: list[Config], workdirs: list[str | Path], **kwargs) -> dict[str, dict]:
    return CohortTrainer(cfgs, workdirs, **kwargs).run()


def fault_of(result: dict) -> RuntimeFault | None:
    """The RuntimeFault a diverged member's result stands for (None for a finished one)."""
    if result.get("status") == DIVERGED:
        return RuntimeFault(result.get("error", "diverged"))
    return None


def read_marker(cohort_dir: str | Path) -> dict | None:
    try:
        return json.loads((Path(cohort_dir) / COHORT_FILE).read_text())
    except (OSError, ValueError):
        return None
