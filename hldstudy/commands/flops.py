"""`hldstudy flops`: FLOPs per step of a method, steps per budget, XLA's count.

CLI: `hldstudy flops --config experiments/X.py --method kd
--teacher-preset tiny-teacher --budget 1e15 --check-xla --json`.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys

from hldstudy.cli_common import EXPERIMENTS, find_builtin, finite_number, warn_long_sequence
from hldstudy.config import apply_overrides, load_experiment, validate
from hldstudy.distill import methods
from hldstudy.errors import ConfigError, user_errors
from hldstudy.flops import FUSED_XLA_ROW_BLOCK, step_flops, xla_count_is_complete
from hldstudy.flops.budget import plan_stages
from hldstudy.model.loading import teacher_model_config
from hldstudy.model.presets import preset
from hldstudy.teacher_source import LAYOUTS


def _fmt(x: float) -> str:
    return f"{x:.4g}"


def _stage_report(cfg, method, stage, share, teacher_model, steps, check_xla,
                  layout="colocated") -> dict:
    b = step_flops(cfg, method, stage, teacher_model)
    rep = {"share": share, "analytic_flops_per_step": b.total,
           "hardware_flops_per_step": b.hardware_flops(layout), "breakdown": b.as_dict()}
    if steps is not None:
        rep["steps"] = steps
    if check_xla:
        from hldstudy.train.probe import xla_flops_for  # compiles the real step: loads the trainer

        x = xla_flops_for(cfg, method, stage, teacher_model, layout=layout)
        rep["xla_flops_per_step"] = x
        rep["xla_over_hardware"] = x / b.hardware_flops(layout)
        rep["xla_over_analytic"] = x / b.total
        if not xla_count_is_complete(cfg, method, stage, teacher_model):
            rep["xla_warning"] = (f"XLA counts a loop body once: the fused loss's row windows "
                                  f"(low for more than {FUSED_XLA_ROW_BLOCK} tokens per step; "
                                  f"--set distill.loss_impl=materialized) or a DeltaNet's "
                                  f"chunks (low for data.seq_len above model.deltanet_chunk)")
    return rep


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="hldstudy flops", description=__doc__.split("\n")[0])
    ap.add_argument("--config", required=True, help="an experiment file")
    ap.add_argument("--method", choices=methods.names(), default=None)
    ap.add_argument("--set", dest="overrides", action="append", default=[], metavar="K=V")
    ap.add_argument("--budget", type=float, default=None, help="FLOP budget (default budget.flops)")
    ap.add_argument("--teacher-preset", default=None, help="teacher model preset name")
    ap.add_argument("--count-teacher", action="store_true", default=None,
                    help="count the teacher forward in the budget (default budget.count_teacher)")
    ap.add_argument("--check-xla", action="store_true", help="compile the step, compare with XLA")
    ap.add_argument("--layout", choices=LAYOUTS, default="colocated",
                    help="teacher layout of the hardware figure and of --check-xla")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--debug", action="store_true")
    args = ap.parse_args(argv)
    with user_errors(args.debug, prog="hldstudy.flops"):
        if args.budget is not None:
            finite_number("--budget", args.budget,
                          fix="a FLOP budget, e.g. 1e15; omit it to use budget.flops")
        cfg = apply_overrides(load_experiment(find_builtin(args.config, EXPERIMENTS)),
                              args.overrides)
        method = args.method or cfg.distill.method
        cfg = dataclasses.replace(cfg, distill=dataclasses.replace(cfg.distill, method=method))
        if args.count_teacher:
            cfg = dataclasses.replace(cfg, budget=dataclasses.replace(cfg.budget,
                                                                      count_teacher=True))
        # The teacher's shape may come from --teacher-preset (checked below).
        validate(cfg, check_paths=False, need_teacher=False)
        warn_long_sequence("hldstudy.flops", "data.seq_len", cfg.data.seq_len)
        if args.teacher_preset:
            teacher_model = preset(args.teacher_preset)
        else:
            teacher_model = teacher_model_config(cfg.teacher.checkpoint, cfg.teacher.preset)
        if methods.get(method).needs_teacher and teacher_model is None:
            raise ConfigError("teacher", f"method {method!r} needs the teacher's shape",
                              "pass --teacher-preset NAME, or a teacher.checkpoint run directory")
        budget = args.budget if args.budget is not None else (cfg.budget.flops or None)
        if budget is not None:
            try:
                plans = plan_stages(cfg, teacher_model, method, budget_flops=budget)
            except ConfigError as e:
                if args.budget is None or e.field != "budget.flops":
                    raise
                raise ConfigError("--budget", str(e)[len(e.field) + 2:]) from None
            steps = {p.stage.name: p.steps for p in plans}
        else:
            steps = {}
        stages = {st.name: _stage_report(cfg, method, st.name, st.share, teacher_model,
                                         steps.get(st.name), args.check_xla, args.layout)
                  for st in methods.get(method).resolve_stages(cfg)}
        result = {"method": method, "layout": args.layout,
                  "tokens_per_step": cfg.data.batch_size * cfg.data.seq_len,
                  "count_teacher": cfg.budget.count_teacher, "budget": budget, "stages": stages}
        if len(stages) == 1:
            only = next(iter(stages.values()))
            result.update({k: v for k, v in only.items() if k != "share"})
        if args.json:
            print(json.dumps(result, indent=None, sort_keys=True))
            return 0
        print(f"method {method}  tokens/step {result['tokens_per_step']}  "
              f"teacher counted in budget: {cfg.budget.count_teacher}  "
              f"losses counted: {cfg.budget.count_loss}")
        cols = ("nonemb", "deembed", "attention", "regressor", "teacher", "loss", "total")
        print(f"{'stage':8s} {'share':>6s} " + " ".join(f"{c:>11s}" for c in cols)
              + f" {'hardware':>11s} {'xla':>11s} {'steps':>10s}")
        for st, rep in stages.items():
            bd = rep["breakdown"]
            print(f"{st:8s} {rep['share']:6.3f} " + " ".join(f"{_fmt(bd[c]):>11s}" for c in cols)
                  + f" {_fmt(rep['hardware_flops_per_step']):>11s}"
                  + f" {_fmt(rep['xla_flops_per_step']) if 'xla_flops_per_step' in rep else '-':>11s}"
                  + f" {rep.get('steps', '-')!s:>10s}")
        for st, rep in stages.items():
            terms = rep["breakdown"]["loss_terms"]
            if terms:
                print(f"loss ({st}): " + ", ".join(f"{k} {_fmt(v)}" for k, v in terms.items()))
        for st, rep in stages.items():
            if "xla_warning" in rep:
                print(f"warning ({st}): {rep['xla_warning']}")
        print("total = model FLOPs (causal attention, no recompute) = the budget figure "
              "(loss in it with budget.count_loss); "
              f"hardware = executed estimate ({args.layout} teacher), compared with XLA")
    return 0


if __name__ == "__main__":
    sys.exit(main())
