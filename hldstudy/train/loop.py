"""The training loop: thin, method-agnostic, resumable.

`train(cfg, workdir)` runs every stage of the configured method. The batch
of global step i is `data.train.batch_at(i)` (a pure function of the seed),
so a resumed run, a 4-device run and a remote teacher all see the same
sequence. Checkpoints carry the train state plus the stage, step and FLOPs
spent; SIGTERM / Ctrl-C saves one and exits.

Nothing lost, nothing hangs:

- every step folds "loss and gradient norm finite" into a device-side record of the
  first non-finite step; the host reads it at log steps and before every save, so a
  non-finite state is never saved (the last good checkpoint stays) and the run stops
  with a `RuntimeFault` naming the step (exit 3);
- the checkpoint directory is checked writable before any work, and a save that
  fails is one line (`RuntimeFault`) and returns at once;
- the train step is compiled before the first step and XLA's memory analysis of it
  is compared with the memory available: a configuration that cannot fit is refused
  (`RuntimeFault`, naming data.batch_size / data.seq_len) instead of being killed;
- resuming falls back: a latest checkpoint that cannot be restored is reported,
  moved to `checkpoints.damaged/`, and the previous one is restored.
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
from hldstudy.errors import ConfigError, InputError, RuntimeFault, warn
from hldstudy.fileio import write_json_atomic
from hldstudy.flops.budget import StagePlan, plan_stages, total_steps
from hldstudy.model import Transformer
from hldstudy.rundir import CHECKPOINTS_DIR, RESULTS_FILE, checkpoint_steps, job_owns
from hldstudy.signals import Interrupted, StopSignals  # noqa: F401  (Interrupted re-exported)
from hldstudy.teacher import load_teacher, with_teacher_tokenizer
from hldstudy.teacher.base import NO_FEED, StageFeed
from hldstudy.train.metrics import MetricsLogger
from hldstudy.train.optim import make_optimizer
from hldstudy.train.step import (
    GraphDefs,
    make_eval_step,
    make_train_step,
    split_params,
    to_master,
)

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
    """A checkpoint step whose state cannot be restored (the run falls back)."""

    def __init__(self, step: int, reason: str):
        self.step, self.reason = step, reason
        super().__init__(f"step {step}: {reason}")


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


class Trainer:
    """Holds what stages share: mesh, data, strategy, teacher, logger, checkpointer."""

    def __init__(self, cfg: Config, workdir: str | Path, *, teacher=None, data=None,
                 devices=None):
        # A multi-process job is joined before anything touches a device (hldstudy.sharding).
        mesh_lib.maybe_initialize_distributed()
        cfg = validate(with_teacher_tokenizer(cfg))
        self.cfg = cfg
        self.workdir = Path(workdir)
        self.workdir.mkdir(parents=True, exist_ok=True)
        check_writable(self.workdir / CHECKPOINTS_DIR)
        check_resume_compatible(cfg, self.workdir)
        if mesh_lib.is_primary():  # process 0 writes the run's files; all save checkpoints
            save_config(cfg, self.workdir / "config.json")
        self.mesh = mesh_lib.make_mesh(cfg.train, devices)
        mesh_lib.check_batch_divisible(cfg.data.batch_size, self.mesh)
        if data is None:
            from hldstudy.data import prepare_data

            # Process 0 trains the tokenizer / fills the data cache; the others then read it.
            if mesh_lib.is_primary():
                data = prepare_data(cfg.data, self.workdir)
            mesh_lib.sync("hldstudy-data-prepared")
            if data is None:
                data = prepare_data(cfg.data, self.workdir)
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
        self._eval_steps: dict = {}
        self.ckpt = Checkpointer(self.workdir / CHECKPOINTS_DIR, cfg.train.keep_checkpoints)

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
                params = {**params, "student": to_master(carried)}
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
        if count == 0:
            raise InputError("the validation data gave no tokens to evaluate on "
                             "(give more validation data: data.synthetic_valid_docs, or a "
                             "larger validation split)")
        nll = total / count
        return {"valid_nll": nll, "valid_ppl": float(math.exp(min(nll, 700.0))),
                "valid_tokens": int(count)}

    def run(self, stop_at_step: int | None = None) -> dict:
        """Trains to the end, or to `stop_at_step` (behaves exactly as a SIGTERM there).

        Resumes from the newest checkpoint that restores: a damaged one (unreadable
        metadata or state) is reported and skipped; once an older one restored, the
        damaged ones are moved to checkpoints.damaged/. When none restores, nothing is
        moved and an `InputError` lists them."""
        damaged: dict[int, str] = {}
        try:
            while True:
                try:
                    return self._run(stop_at_step, damaged)
                except _DamagedCheckpoint as e:
                    damaged[e.step] = e.reason
                    warn(f"checkpoint {self.ckpt.step_dir(e.step)} cannot be restored "
                         f"({e.reason}); falling back to the previous one", "hldstudy.train")
        finally:
            self.ckpt.close()
            if self.teacher is not None:
                self.teacher.close()

    def _restore_point(self, damaged: dict[int, str]) -> tuple[int | None, dict | None]:
        """The newest step (not known damaged) whose metadata reads, and that metadata."""
        for step in self.ckpt.steps():
            if step in damaged:
                continue
            try:
                meta = self.ckpt.restore_meta(step)
                if not isinstance(meta, dict) or not {"stage", "flops_spent"} <= set(meta):
                    raise ValueError(f"metadata without stage/flops_spent: {meta!r}"[:200])
            except Exception as e:  # noqa: BLE001 - any unreadable checkpoint is damaged
                damaged[step] = _one_line(e)
                warn(f"checkpoint {self.ckpt.step_dir(step)} cannot be restored "
                     f"({damaged[step]}); falling back to the previous one", "hldstudy.train")
                continue
            return step, meta
        if damaged:
            listed = "; ".join(f"step {s}: {r}" for s, r in sorted(damaged.items(), reverse=True))
            raise InputError(f"no checkpoint in {self.ckpt.directory} can be restored ({listed}); "
                             f"move {self.ckpt.directory} aside to start the run over")
        return None, None

    def _set_damaged_aside(self, damaged: dict[int, str], resumed: int) -> None:
        """After a successful restore: the damaged steps leave checkpoints/ (a later save of
        the same step must not find them, keep-last-k must not count them)."""
        if not damaged:
            return
        if mesh_lib.is_primary():  # process 0 moves them; the others wait, then look again
            for step in sorted(damaged):
                if step in self.ckpt.steps():
                    dest = self.ckpt.quarantine(step)
                    warn(f"moved the damaged checkpoint of step {step} to {dest}; resumed "
                         f"from step {resumed}", "hldstudy.train")
        mesh_lib.sync("hldstudy-damaged-aside")
        self.ckpt.manager.reload()
        damaged.clear()

    def _run(self, stop_at_step: int | None, damaged: dict[int, str]) -> dict:
        cfg = self.cfg
        latest, meta = self._restore_point(damaged)
        resume_step = latest or 0
        if meta is not None and latest > self.total_steps:
            raise ConfigError("train.steps",
                              f"{self.workdir} already holds step {latest} > {self.total_steps}",
                              "ask for at least as many steps as the run already has")
        logger = (MetricsLogger(self.workdir, cfg, resume_step) if mesh_lib.is_primary()
                  else _NoLogger())
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
                        try:
                            state, _ = self.ckpt.restore(resume_step,
                                                         abstract_like(state, shardings))
                        except Exception as e:  # noqa: BLE001 - fall back to the previous step
                            raise _DamagedCheckpoint(resume_step, _one_line(e)) from e
                        self._set_damaged_aside(damaged, resume_step)
                    state, flops_spent = self._run_stage(plan, graphdefs, optimizer, state,
                                                         shardings, logger, stop, flops_spent)
                    carried = state["params"]["student"]
                    meta = None
                if meta is not None:  # no stage of this run holds the checkpoint's step
                    raise ConfigError("train.steps", f"the checkpoint of step {resume_step} "
                                      f"(stage {meta['stage']!r}) is outside that stage under "
                                      f"this run's plan of {self.total_steps} steps",
                                      "restore the original train.steps / budget.flops")
                result = self._finish(graphdefs, state, flops_spent, logger)
        finally:
            logger.close()
        return result

    def _compile_step(self, train_step, args, plan: StagePlan):
        """Compiles the train step for `args` and refuses it, before it runs, when XLA's
        memory analysis says it cannot fit in the memory available."""
        compiled = train_step.lower(*args).compile()
        check_fits(compiled, self.mesh, self.cfg, plan.stage.name)
        return compiled

    def _check_finite(self, bad_step, plan: StagePlan, step: int, last_saved: int | None,
                      loss: float | None = None) -> None:
        """Raises RuntimeFault when a step so far had a non-finite loss or gradient norm
        (`bad_step`, the device-side record), or when `loss` (on the host) is not finite."""
        bad = int(jax.device_get(bad_step))
        if bad == 0 and (loss is None or math.isfinite(loss)):
            return
        cfg = self.cfg
        stage = f" (stage {plan.stage.name})" if len(self.plans) > 1 else ""
        seen = f"; the loss was {loss} at step {step}" if loss is not None else ""
        kept = (f"the last checkpoint, step {last_saved}, is intact" if last_saved
                else "no checkpoint was saved")
        raise RuntimeFault(f"non-finite training state: the loss or gradient norm first became "
                           f"non-finite at step {bad or step}{stage}{seen}; it was not saved "
                           f"({kept}). Lower train.lr (now {cfg.train.lr:g}) or "
                           f"train.grad_clip (now {cfg.train.grad_clip:g}), or check the data")

    def _run_stage(self, plan, graphdefs, optimizer, state, shardings, logger, stop, flops_spent):
        cfg = self.cfg
        end = plan.start + plan.steps
        step = int(state["step"])
        feed = self._teacher_feed(plan)
        feed.begin(step, end, self.workdir)
        train_step = jax.jit(
            _with_finite_record(make_train_step(self.strategy, plan.stage, graphdefs, optimizer,
                                                feed.forward)),
            out_shardings=(shardings, None, None), donate_argnums=(0,))
        compiled = None
        # The first step (global numbering) whose loss or gradient norm was not finite; 0: none.
        bad_step = jax.device_put(jnp.zeros((), jnp.int32), mesh_lib.replicated(self.mesh))
        last_saved = self.ckpt.latest_step()
        tokens_per_step = cfg.data.batch_size * cfg.data.seq_len
        bar = None
        if cfg.train.progress and mesh_lib.is_primary():
            from tqdm.auto import tqdm

            bar = tqdm(total=self.total_steps, initial=step, desc=f"{cfg.name}:{plan.stage.name}",
                       unit="step", dynamic_ncols=True)
        t_last, steps_since = time.perf_counter(), 0
        while step < end:
            batch = mesh_lib.put_batch(self.data.train.batch_at(step), self.mesh)
            args = (state, batch, feed.inputs(step, batch), bad_step)
            if compiled is None:
                compiled = self._compile_step(train_step, args, plan)
            state, metrics, bad_step = compiled(*args)
            del args
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
                self._check_finite(bad_step, plan, step, last_saved, metrics["loss"])
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
                self._check_finite(bad_step, plan, step, last_saved)  # never save non-finite
                self.ckpt.save(step, state, {"stage": plan.stage.name, "step": step,
                                             "flops_spent": flops_spent,
                                             "data": {"next_batch": step},
                                             "seed": cfg.train.seed})
                last_saved = step
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
        if mesh_lib.is_primary():
            write_json_atomic(self.workdir / "results.json", result)
        return result


def _with_finite_record(train_step):
    """`step(state, batch, teacher_in, bad_step) -> (state, metrics, bad_step)`: the train
    step, plus the first global step whose loss or gradient norm was not finite (kept on
    the device, so checking it costs no host sync per step)."""

    def step(state, batch, teacher_in, bad_step):
        state, metrics = train_step(state, batch, teacher_in)
        finite = jnp.isfinite(metrics["loss"]) & jnp.isfinite(metrics["grad_norm"])
        bad_step = jnp.where((bad_step == 0) & ~finite, state["step"], bad_step)
        return state, metrics, bad_step

    return step


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


def check_fits(compiled, mesh, cfg: Config, stage: str = "") -> None:
    """Refuses (RuntimeFault) a compiled train step that cannot fit: what it allocates
    beyond its (already resident) arguments, per XLA's memory analysis (outputs +
    temporaries - outputs aliased to donated inputs), against `memory_available`."""
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
        f"(now {d.seq_len})")


def train(cfg: Config, workdir: str | Path, **kwargs) -> dict:
    # The job owns the run directory (run.lock, held by process 0) before anything is written.
    with job_owns(workdir, "hldstudy.train"):
        return Trainer(cfg, workdir, **kwargs).run()
