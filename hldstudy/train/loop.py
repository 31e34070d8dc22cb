"""The training loop: thin, method-agnostic, resumable.

`train(cfg, workdir)` runs every stage of the configured method. The batch
of global step i is `data.train.batch_at(i)` (a pure function of the seed),
so a resumed run, a 4-device run and a remote teacher all see the same
sequence. Checkpoints carry the train state plus the stage, step and FLOPs
spent; SIGTERM / Ctrl-C saves one and exits.
"""

from __future__ import annotations

import math
import signal
import time
from pathlib import Path

import jax
import jax.numpy as jnp
from flax import nnx

from hldstudy import sharding as mesh_lib
from hldstudy.budget import StagePlan, plan_stages, total_steps
from hldstudy.checkpoint import Checkpointer, abstract_like
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
from hldstudy.errors import ConfigError
from hldstudy.fileio import write_json_atomic
from hldstudy.model import Transformer
from hldstudy.signals import Interrupted, StopSignals  # noqa: F401  (Interrupted re-exported)
from hldstudy.teacher import load_teacher, with_teacher_tokenizer
from hldstudy.teacher.base import NO_FEED, StageFeed
from hldstudy.train.metrics import MetricsLogger
from hldstudy.train.optim import make_optimizer
from hldstudy.train.step import GraphDefs, make_eval_step, make_train_step, split_params

# Config fields a resumed run may change (tagged `resume` in hldstudy.config); a
# mesh change restores the checkpoint resharded onto the new mesh.
RESUMABLE_CHANGES = fields_where("resume")


class _StopFlag(StopSignals):
    """StopSignals plus a step at which to stop as if signalled (tests, sweeps)."""

    stop_at_step: int | None = None


def check_resume_compatible(cfg: Config, workdir: Path) -> None:
    """Refuses to resume a run directory under a different experiment."""
    path = workdir / "config.json"
    if not path.exists():
        return
    old = flatten(config_to_dict(read_config(path)))
    new = flatten(config_to_dict(cfg))
    for key in sorted(new):
        if key not in RESUMABLE_CHANGES and old.get(key) != new[key]:
            raise ConfigError(key, f"{workdir} was trained with {old.get(key)!r}, now {new[key]!r}",
                              "use a new --workdir, or restore the original value")


class Trainer:
    """Holds what stages share: mesh, data, strategy, teacher, logger, checkpointer."""

    def __init__(self, cfg: Config, workdir: str | Path, *, teacher=None, data=None,
                 devices=None):
        cfg = validate(with_teacher_tokenizer(cfg))
        self.cfg = cfg
        self.workdir = Path(workdir)
        self.workdir.mkdir(parents=True, exist_ok=True)
        check_resume_compatible(cfg, self.workdir)
        save_config(cfg, self.workdir / "config.json")
        mesh_lib.maybe_initialize_distributed()
        self.mesh = mesh_lib.make_mesh(cfg.train, devices)
        mesh_lib.check_batch_divisible(cfg.data.batch_size, self.mesh)
        if data is None:
            from hldstudy.data import prepare_data

            data = prepare_data(cfg.data, self.workdir)
        self.data = data
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
        self._eval_steps: dict = {}
        self.ckpt = Checkpointer(self.workdir / "checkpoints", cfg.train.keep_checkpoints)

    # ------------------------------------------------------------------ #

    def _init_state(self, plan: StagePlan, student_params=None):
        """Fresh (or stage-carried) params + optimizer state, sharded on the mesh."""
        cfg, stage = self.cfg, plan.stage
        seed = cfg.train.seed
        optimizer = make_optimizer(cfg.train, plan.steps,
                                   trainable_layers=self.strategy.trainable_student_layers(stage))

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
                params = {**params, "student": carried}
            return {"params": params, "opt_state": optimizer.init(params),
                    "step": jnp.asarray(plan.start, jnp.int32)}

        abstract_state = jax.eval_shape(init, student_params)
        shardings = mesh_lib.tree_shardings(self.mesh, abstract_state)
        state = jax.jit(init, out_shardings=shardings)(student_params)
        return graphdefs, optimizer, state, shardings

    def _teacher_feed(self, plan: StagePlan) -> StageFeed:
        if self.teacher is None:
            return NO_FEED
        return self.teacher.stage_feed(self.strategy, plan.stage, self.mesh)

    def evaluate(self, graphdefs: GraphDefs, params, n_batches: int) -> dict:
        # One compiled eval step per student graph (not one per call).
        eval_step = self._eval_steps.get(graphdefs.student)
        if eval_step is None:
            eval_step = self._eval_steps[graphdefs.student] = jax.jit(make_eval_step(graphdefs))
        total, count = 0.0, 0.0
        for batch in self.data.valid_batches(n_batches):
            s, c = eval_step(params, mesh_lib.put_batch(batch, self.mesh))
            total += float(s)
            count += float(c)
        nll = total / max(count, 1.0)
        return {"valid_nll": nll, "valid_ppl": float(math.exp(min(nll, 700.0))),
                "valid_tokens": int(count)}

    def run(self, stop_at_step: int | None = None) -> dict:
        """Trains to the end, or to `stop_at_step` (behaves exactly as a SIGTERM there)."""
        cfg = self.cfg
        latest = self.ckpt.latest_step()
        meta = self.ckpt.restore_meta(latest) if latest is not None else None
        resume_step = latest or 0
        if meta is not None and latest > self.total_steps:
            raise ConfigError("train.steps",
                              f"{self.workdir} already holds step {latest} > {self.total_steps}",
                              "ask for at least as many steps as the run already has")
        logger = MetricsLogger(self.workdir, cfg, resume_step)
        flops_spent = float(meta["flops_spent"]) if meta else 0.0
        carried = None
        result = {}
        try:
            with _StopFlag() as stop:
                stop.stop_at_step = stop_at_step
                for plan in self.plans:
                    end = plan.start + plan.steps
                    if resume_step >= end and not (meta and meta["stage"] == plan.stage.name
                                                   and resume_step == end):
                        continue
                    graphdefs, optimizer, state, shardings = self._init_state(plan, carried)
                    if meta is not None and plan.start <= resume_step <= end \
                            and meta["stage"] == plan.stage.name:
                        state, _ = self.ckpt.restore(resume_step, abstract_like(state, shardings))
                    state, flops_spent = self._run_stage(plan, graphdefs, optimizer, state,
                                                         shardings, logger, stop, flops_spent)
                    carried = state["params"]["student"]
                    meta = None
                result = self._finish(graphdefs, state, flops_spent, logger)
        finally:
            logger.close()
            self.ckpt.close()
            if self.teacher is not None:
                self.teacher.close()
        return result

    def _run_stage(self, plan, graphdefs, optimizer, state, shardings, logger, stop, flops_spent):
        cfg = self.cfg
        end = plan.start + plan.steps
        step = int(state["step"])
        feed = self._teacher_feed(plan)
        feed.begin(step, end, self.workdir)
        train_step = jax.jit(
            make_train_step(self.strategy, plan.stage, graphdefs, optimizer, feed.forward),
            out_shardings=(shardings, None), donate_argnums=(0,))
        tokens_per_step = cfg.data.batch_size * cfg.data.seq_len
        bar = None
        if cfg.train.progress and jax.process_index() == 0:
            from tqdm.auto import tqdm

            bar = tqdm(total=self.total_steps, initial=step, desc=f"{cfg.name}:{plan.stage.name}",
                       unit="step", dynamic_ncols=True)
        t_last, steps_since = time.perf_counter(), 0
        while step < end:
            batch = mesh_lib.put_batch(self.data.train.batch_at(step), self.mesh)
            state, metrics = train_step(state, batch, feed.inputs(step, batch))
            step += 1
            steps_since += 1
            flops_spent += plan.flops_per_step
            if step % cfg.train.log_every == 0 or step == end:
                metrics = {k: float(v) for k, v in jax.device_get(metrics).items()}
                dt = time.perf_counter() - t_last
                record = {"step": step, "stage": plan.stage.name, **metrics,
                          "tokens_per_s": steps_since * tokens_per_step / max(dt, 1e-9),
                          "flops_spent": flops_spent,
                          **feed.metrics()}
                if not math.isfinite(metrics["loss"]):
                    raise FloatingPointError(f"loss became {metrics['loss']} at step {step}; "
                                             "lower train.lr or check the data")
                logger.log(record)
                if bar is not None:
                    bar.set_postfix(loss=f"{metrics['loss']:.3f}",
                                    tok_s=f"{record['tokens_per_s']:.0f}")
                t_last, steps_since = time.perf_counter(), 0
            if bar is not None:
                bar.update(1)
            if cfg.train.eval_every and step % cfg.train.eval_every == 0 and step < end:
                logger.log({"step": step, **self.evaluate(graphdefs, state["params"],
                                                          cfg.train.eval_batches)})
            boundary = (cfg.train.checkpoint_every and step % cfg.train.checkpoint_every == 0)
            if stop.stop_at_step is not None and step >= stop.stop_at_step:
                stop.signum = signal.SIGTERM
            if boundary or step == end or stop.signum is not None:
                self.ckpt.save(step, state, {"stage": plan.stage.name, "step": step,
                                             "flops_spent": flops_spent,
                                             "data": {"next_batch": step},
                                             "seed": cfg.train.seed})
            if stop.signum is not None and step < end:
                if bar is not None:
                    bar.close()
                raise Interrupted(step, stop.signum)
        if bar is not None:
            bar.close()
        return state, flops_spent

    def _finish(self, graphdefs, state, flops_spent, logger) -> dict:
        cfg = self.cfg
        metrics = self.evaluate(graphdefs, state["params"], cfg.train.eval_batches)
        result = {"status": "done", "name": cfg.name, "method": cfg.distill.method,
                  "steps": int(state["step"]), "flops_spent": flops_spent,
                  "flops_budget": cfg.budget.flops, "count_teacher": cfg.budget.count_teacher,
                  "stages": {p.stage.name: {"steps": p.steps, "flops_per_step": p.flops_per_step}
                             for p in self.plans},
                  **metrics}
        logger.log({"step": int(state["step"]), **metrics})
        logger.summary(metrics)
        if jax.process_index() == 0:
            write_json_atomic(self.workdir / "results.json", result)
        return result


def train(cfg: Config, workdir: str | Path, **kwargs) -> dict:
    return Trainer(cfg, workdir, **kwargs).run()
