"""`python -m hldstudy.sweep SWEEP [--executor local|slurm|wandb] [--parallel N] [--dry-run]
[--json] [--workdir DIR] [--set key=value ...] [--force] [--cohort K] [--methods a,b]
[--teacher-replicas N] [--confirm SEEDS]`.

Design notes: `docs/sweeps.md`, under this file's name.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path

from hldstudy.errors import InputError, user_errors

# The command's --help text.
HELP = """`python -m hldstudy.sweep SWEEP [--executor local|slurm|wandb] [--parallel N] [--dry-run]
[--json] [--workdir DIR] [--set key=value ...] [--force] [--cohort K] [--methods a,b]
[--teacher-replicas N] [--confirm SEEDS]`.

Expands the sweep file's grid into runs (one directory each under WORKDIR,
default runs/<sweep name>), writes WORKDIR/sweep.json listing every expected
run, trains the runs that are not finished (resuming interrupted ones from
their checkpoints), evaluates each (`eval` in its results.json), and prints
the analysis command. `--dry-run` lists the runs with the steps and FLOPs
each gets (`--json`: one JSON object per run). A run directory whose
config.json no longer matches what the grid asks for is refused (the message
names the field) unless --force, which moves it to WORKDIR/.sweep/stale/ and
reruns it.

`--cohort K` (local executor) trains compatible runs (one method, differing only in
lr, seed, temperature, alpha, hidden_weight) as cohorts of at most K sharing one
teacher forward per step (`hldstudy.train.cohort`); each run keeps its own
directory, steps and FLOPs, and `--dry-run --json` gives each its `cohort` id.
`--methods a,b` restricts the sweep to some of its methods.

`--confirm SEEDS` (e.g. 3-12), once the grid is finished: picks each arm's best
configuration by the analysis' rule (lowest seed-mean validation perplexity over the
sweep's seeds), writes the picks to WORKDIR/confirm.json, and trains them at these fresh
seeds (never the sweep's own). The analysis then reads best vs best on those seeds alone,
paired by seed with the reference's pick: the only best-vs-best verdicts (the rest is
exploratory). The picks are never chosen again: a later `--confirm` adds seeds, and a
plain rerun resumes the confirmation runs too.

`--teacher-replicas N` (with `--cohort K`, local or slurm) starts N teacher replicas
for the whole sweep (`hldstudy.sweep.gridteach`): every cohort of every method that
still trains is one member of their fan-out cohort, with the union of the layers its
method's stages need, so each step is computed once for the grid (the longest
schedule's steps in all). The cohorts train at once (one process, or one submitit job,
each); the replicas are stopped however the sweep ends, a local one that dies is
restarted, and their counters land in WORKDIR/.sweep/teacher/stats.json.

SWEEP is a sweep file or the name of a built-in one (sweeps/):

    python -m hldstudy.sweep cpu --dry-run
    python -m hldstudy.sweep cpu --parallel 2 --set teacher.checkpoint=runs/quickstart/teacher
    python -m hldstudy.sweep c4_123m --executor slurm --parallel 16         --slurm slurm_partition=gpu --slurm gpus_per_node=8 --set data.path=/data/tfds
    python -m hldstudy.sweep my_sweeps/grid.py --executor wandb
    python -m hldstudy.sweep cpu --methods kd,hldf,hldc --cohort 4 --teacher-replicas 1
    python -m hldstudy.analysis runs/cpu --out runs/cpu/report
"""

PROG = "python -m hldstudy.sweep"
log = logging.getLogger("hldstudy.sweep")


def parse_args(argv=None) -> argparse.Namespace:
    from hldstudy.sweep.executors import EXECUTORS

    p = argparse.ArgumentParser(prog=PROG, description=HELP.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=HELP.split("\n\n", 1)[1])
    p.add_argument("sweep", metavar="SWEEP",
                   help="sweep file with get_sweep(), or the name of a built-in one "
                        "(sweeps/<name>.py, e.g. cpu)")
    p.add_argument("--executor", default="local", choices=EXECUTORS)
    p.add_argument("--parallel", type=int, default=1,
                   help="local: worker processes; slurm: jobs; wandb: agent processes")
    p.add_argument("--dry-run", action="store_true", help="list the runs, train nothing")
    p.add_argument("--json", action="store_true", help="with --dry-run: print a JSON list")
    p.add_argument("--workdir", default=None, help="runs directory (default runs/<sweep name>)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a field of every run's config (e.g. teacher.checkpoint=DIR)")
    p.add_argument("--force", action="store_true",
                   help="move run directories whose config no longer matches the grid aside "
                        "(WORKDIR/.sweep/stale/) and rerun them")
    p.add_argument("--run-id", "--run_id", dest="run_id", default=None,
                   help="run only this run of the grid (what a W&B agent calls)")
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--cluster", default=None, choices=("slurm", "local", "debug"),
                   help="slurm executor: submitit cluster (default: slurm when available)")
    p.add_argument("--slurm", dest="slurm_params", action="append", default=[],
                   metavar="KEY=VALUE",
                   help="submitit parameter, e.g. slurm_partition=gpu, gpus_per_node=8, "
                        "timeout_min=1440")
    p.add_argument("--wait", action=argparse.BooleanOptionalAction, default=None,
                   help="slurm: wait for the jobs (default: only for --cluster local/debug)")
    p.add_argument("--sweep-id", default=None, help="wandb: join this existing W&B sweep")
    p.add_argument("--count", type=int, default=None, help="wandb: runs this agent executes")
    p.add_argument("--cohort", default=None, metavar="K|auto",
                   help="train compatible runs as cohorts of at most K students sharing one "
                        "teacher forward per step (local executor); auto: the largest K whose "
                        "cohort step fits the device's available memory (hldstudy.plan's "
                        "cohort_memory)")
    p.add_argument("--teacher-replicas", type=int, default=None, metavar="N",
                   help="start N teacher replicas for the whole sweep: every cohort of every "
                        "method streams its teacher from them, one forward per step for the "
                        "grid (local processes, or submitit jobs with --executor slurm); "
                        "stopped when the sweep ends")
    p.add_argument("--teacher-window", type=int, default=4, metavar="W",
                   help="with --teacher-replicas: steps each replica holds for the cohorts")
    p.add_argument("--teacher-lag-timeout-s", type=float, default=20.0, metavar="S",
                   help="with --teacher-replicas: a cohort that holds the window this long is "
                        "detached (its steps then recomputed for it alone)")
    p.add_argument("--teacher-ready-timeout-s", type=float, default=600.0, metavar="S",
                   help="with --teacher-replicas: how long to wait for every replica to answer")
    p.add_argument("--teacher-slurm", dest="teacher_slurm", action="append", default=[],
                   metavar="KEY=VALUE",
                   help="with --teacher-replicas and --executor slurm: submitit parameter of "
                        "the replicas' jobs (their own resources), e.g. gpus_per_node=1")
    p.add_argument("--methods", default=None, metavar="A,B",
                   help="only the runs of these methods (comma-separated)")
    p.add_argument("--confirm", default=None, metavar="SEEDS",
                   help="after the grid: train each arm's pick (chosen on the sweep's seeds, "
                        "written to WORKDIR/confirm.json) at these fresh seeds, e.g. 3-12")
    p.add_argument("--debug", action="store_true", help="show tracebacks")
    args = p.parse_args(argv)
    if args.cohort is not None and args.cohort != "auto":
        try:
            args.cohort = int(args.cohort)
        except ValueError:
            p.error(f"--cohort must be a number or auto, got {args.cohort!r}")
        if args.cohort < 1:
            p.error(f"--cohort must be >= 1, got {args.cohort}")
    if args.teacher_replicas is not None and args.executor == "wandb":
        p.error("--teacher-replicas goes with --executor local or slurm")
    if args.cohort is not None and args.cohort != 1 and args.executor != "local" \
            and not args.dry_run and args.teacher_replicas is None:
        p.error("--cohort goes with --executor local, or slurm with --teacher-replicas "
                "(otherwise slurm / wandb run one run per job)")
    if args.parallel < 1:
        p.error(f"--parallel must be >= 1, got {args.parallel}")
    if args.json and not args.dry_run:
        p.error("--json goes with --dry-run")
    return args


def _auto_cohort(sweep, runs) -> int:
    """`--cohort auto`: the largest K whose cohort step (`hldstudy.plan.cohort_memory`,
    worst method and stage of the grid) fits the memory available on this process's
    first device now (the host's on the CPU), less a 10% margin; says so on stderr."""
    import jax

    from hldstudy.model.loading import teacher_model_config
    from hldstudy.plan import GB
    from hldstudy.sweep.cohorts import auto_cohort
    from hldstudy.train.loop import memory_available

    device = jax.local_devices()[0]
    avail = memory_available(device)
    if avail is None:
        print(f"{PROG}: --cohort auto: the memory of {device.platform} devices is unknown; "
              "training every run alone (--cohort 1)", file=sys.stderr)
        return 1
    checkpoint = next((r.config.teacher.checkpoint for r in runs if r.config.teacher.checkpoint),
                      None)
    if checkpoint is not None:
        teacher = teacher_model_config(checkpoint, sweep.teacher_preset)
    else:
        from hldstudy.model import preset

        teacher = preset(sweep.teacher_preset) if sweep.teacher_preset else None
    from hldstudy.train.program import default_mode

    chosen = auto_cohort(runs, teacher, 0.9 * avail, mode=default_mode(device.platform))
    k = max(chosen["k"], 1)
    nxt = chosen["bytes_at_k_plus_1"]
    print(f"{PROG}: --cohort auto: K = {k} ({chosen['bytes_at_k'] / GB:.3g} GB predicted per "
          f"cohort step, {0.9 * avail / GB:.3g} GB usable of {device.platform} memory"
          + (f"; K = {k + 1} would need {nxt / GB:.3g} GB)" if nxt else
             "; every compatible run of a method in one cohort)"), file=sys.stderr)
    return k


def _parse_params(items: list[str]) -> dict:
    out = {}
    for item in items:
        if "=" not in item:
            raise InputError(f"--slurm {item!r}: expected KEY=VALUE")
        k, v = item.split("=", 1)
        try:
            out[k.strip()] = json.loads(v)
        except json.JSONDecodeError:
            out[k.strip()] = v
    return out


def _fmt_table(runs, statuses) -> str:
    rows = [("run_id", "method", "steps", "FLOPs", "status")]
    for r in runs:
        steps = r.steps if len(r.stage_steps) == 1 else \
            f"{r.steps} ({'+'.join(str(v) for v in r.stage_steps.values())})"
        rows.append((r.run_id, r.method, str(steps), f"{r.flops:.4e}", statuses[r.run_id]))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip()
                     for row in rows)


class _StderrHandler(logging.StreamHandler):
    """Writes to whatever sys.stderr is at emit time (tests swap it)."""

    @property
    def stream(self):
        return sys.stderr

    @stream.setter
    def stream(self, value):
        pass


def _log_to_stderr(level: int) -> None:
    if not any(isinstance(h, _StderrHandler) for h in log.handlers):
        h = _StderrHandler()
        h.setFormatter(logging.Formatter("%(name)s: %(levelname)s: %(message)s"))
        log.addHandler(h)
        log.propagate = False
    log.setLevel(level)


def main(argv=None) -> int:
    args = parse_args(argv)
    _log_to_stderr(logging.INFO if args.debug else logging.WARNING)
    from hldstudy.cli_common import quiet_libraries

    quiet_libraries()
    with user_errors(debug=args.debug, prog=PROG):
        return _main(args)


def _dry_run(args, sweep, runs, selected, workdir: Path) -> int:
    """--dry-run: the runs with their steps, FLOPs and status (--json: one object each)."""
    from hldstudy.sweep.spec import config_drift, run_status

    statuses = {}
    for r in selected:
        drift = config_drift(r, workdir / r.run_id)
        statuses[r.run_id] = (f"stale ({drift[0][0]})" if drift else
                              run_status(r, workdir / r.run_id, sweep.eval_tasks))
    if args.json:
        cohorts = {}
        if args.cohort is not None:
            from hldstudy.sweep.cohort_exec import cohort_ids

            cohorts = cohort_ids(selected, args.cohort)
        print(json.dumps([{**r.entry(), "status": statuses[r.run_id],
                           **({"cohort": cohorts[r.run_id]} if cohorts else {})}
                          for r in selected], indent=1))
    else:
        budget = runs[0].config.budget
        print(f"sweep {sweep.name}: {len(selected)} run(s), budget {budget.flops:.4e} FLOPs "
              f"each (teacher forward {'counted' if budget.count_teacher else 'not counted'})"
              f", workdir {workdir}")
        if sweep.launch:
            print(f"launch: {sweep.launch}")
        print(_fmt_table(selected, statuses))
    return 0


def _main(args) -> int:
    from hldstudy.cli_common import SWEEPS, check_output_dir, find_builtin
    from hldstudy.sweep import confirm, executors
    from hldstudy.sweep.launch import prepare_workdir
    from hldstudy.sweep.spec import expand, load_sweep

    options = None
    if args.teacher_replicas is not None:  # refused in one line before anything is read
        from hldstudy.sweep.gridteach import ReplicaOptions

        options = ReplicaOptions(args.teacher_replicas, window=args.teacher_window,
                                 lag_timeout_s=args.teacher_lag_timeout_s,
                                 ready_timeout_s=args.teacher_ready_timeout_s)
    sweep_file = find_builtin(args.sweep, SWEEPS)
    sweep = load_sweep(sweep_file)
    warnings: list[str] = []
    runs = expand(sweep, args.overrides, check_paths=not args.dry_run, warnings=warnings)
    for w in warnings:
        print(f"{PROG}: warning: {w}", file=sys.stderr)
    workdir = Path(args.workdir or Path("runs") / sweep.name)
    selected = runs
    if args.methods is not None:
        from hldstudy.distill import methods as registry

        wanted = [m.strip() for m in args.methods.split(",") if m.strip()]
        for m in wanted:
            registry.get(m, "--methods")
        selected = [r for r in runs if r.method in wanted]
        if not selected:
            raise InputError(f"--methods {args.methods}: no run of {sweep.name} uses them "
                             f"(its methods: {', '.join(sorted({r.method for r in runs}))})")
    confirm_runs = confirm.plan(
        sweep, selected, workdir, confirm.parse_seeds(args.confirm) if args.confirm else None,
        args.overrides, write=not args.dry_run)
    confirm_runs = [r for r in confirm_runs if r.method in {s.method for s in selected}]
    runs, selected = runs + confirm_runs, selected + confirm_runs
    if args.run_id is not None:
        selected = [r for r in selected if r.run_id == args.run_id]
        if not selected:
            raise InputError(f"--run-id {args.run_id!r} is not a run of {sweep.name} "
                             f"(e.g. {', '.join(r.run_id for r in runs[:3])})")

    if args.cohort == "auto":
        args.cohort = _auto_cohort(sweep, selected)
    if args.dry_run:
        return _dry_run(args, sweep, runs, selected, workdir)

    check_output_dir(workdir, "--workdir" if args.workdir else "--workdir (runs/<sweep name>)")
    prepare_workdir(sweep, runs, selected, workdir, sweep_file=sweep_file,
                    overrides=args.overrides, force=args.force)

    progress = not args.no_progress
    if args.teacher_replicas is not None:
        from hldstudy.sweep.grid_exec import run_grid

        out = run_grid(selected, sweep, workdir, k=args.cohort or 1, options=options,
                       executor=args.executor, parallel=args.parallel, progress=progress,
                       cluster=args.cluster, params=_parse_params(args.slurm_params),
                       teacher_params=_parse_params(args.teacher_slurm))
    elif args.executor == "local" and args.cohort is not None and args.cohort > 1:
        from hldstudy.sweep.cohort_exec import run_local_cohorts

        out = run_local_cohorts(selected, sweep, workdir, k=args.cohort, parallel=args.parallel,
                                progress=progress)
    elif args.executor == "local":
        out = executors.run_local(selected, sweep, workdir, parallel=args.parallel,
                                  progress=progress)
    elif args.executor == "slurm":
        out = executors.run_slurm(selected, sweep, workdir, parallel=args.parallel,
                                  cluster=args.cluster, params=_parse_params(args.slurm_params),
                                  wait=args.wait, progress=progress)
    else:
        out = executors.run_wandb(selected, sweep, workdir, sweep_file=sweep_file,
                                  overrides=args.overrides, sweep_id=args.sweep_id,
                                  count=args.count, parallel=args.parallel)
    (workdir / ".sweep").mkdir(exist_ok=True)
    (workdir / ".sweep" / "last_launch.json").write_text(json.dumps(out.as_dict(), indent=2) + "\n")
    print_summary(out, workdir, len(selected))
    return out.exit_code


def print_summary(out, workdir: Path, n: int) -> None:
    parts = [f"{len(out.done)} trained", f"{len(out.skipped)} already done"]
    if out.failed:
        parts.append(f"{len(out.failed)} failed")
    if out.interrupted:
        parts.append(f"{len(out.interrupted)} interrupted (checkpointed)")
    print(f"sweep: {n} run(s): " + ", ".join(parts), file=sys.stderr)
    for rid, msg in out.failed.items():
        print(f"  failed {rid}: {msg}", file=sys.stderr)
    if out.no_eval:
        print(f"  {len(out.no_eval)} run(s) trained but not evaluated (hldstudy.eval missing); "
              "rerun the sweep to evaluate them", file=sys.stderr)
    if out.signum is not None:
        print("  stopped by a signal; rerun the same command to resume", file=sys.stderr)
    elif not out.failed:
        print(f"next: python -m hldstudy.analysis {workdir} --out {workdir}/report",
              file=sys.stderr)


if __name__ == "__main__":
    sys.exit(main())
