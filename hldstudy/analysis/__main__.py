"""`python -m hldstudy.analysis RUNS_DIR --out REPORT_DIR [--wandb-report] [--allow-mixed-budgets]`.

Writes REPORT_DIR/report.md (tables, figures, how configs were chosen and
which statistics were used), REPORT_DIR/tables/*.csv, REPORT_DIR/summary.json
and REPORT_DIR/figures/*.png. User errors (empty runs directory, mixed FLOP
budgets, a config that no longer matches its directory) print one line and
exit 2; --debug shows the traceback.
"""

from __future__ import annotations

import argparse
import logging
import sys

from hldstudy.cli_common import check_output_dir
from hldstudy.distill import methods
from hldstudy.errors import InputError, user_errors

PROG = "python -m hldstudy.analysis"


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0])
    p.add_argument("runs_dir", metavar="RUNS_DIR", help="directory holding one folder per run")
    p.add_argument("--out", required=True, metavar="REPORT_DIR", help="where to write the report")
    p.add_argument("--wandb-report", action="store_true",
                   help="also build a W&B report when W&B is online (skipped with a message otherwise)")
    p.add_argument("--allow-mixed-budgets", action="store_true",
                   help="analyse each FLOP budget separately instead of refusing mixed budgets")
    p.add_argument("--no-name-check", action="store_true",
                   help="do not check hyperparameters encoded in run folder names against configs")
    p.add_argument("--reference", default=methods.REFERENCE,
                   help=f"method every other arm is compared to ({methods.REFERENCE})")
    p.add_argument("--n-resamples", type=int, default=10_000, help="bootstrap resamples (10000)")
    p.add_argument("--ci", type=float, default=0.95, help="bootstrap CI level (0.95)")
    p.add_argument("--seed", type=int, default=0, help="bootstrap seed (0)")
    p.add_argument("--ablation", action="store_true",
                   help="RUNS_DIR is sweeps/hldf_ablation.py's (or an earlier ablation report's "
                        "tables/gaps.csv): write its factor report instead")
    p.add_argument("--debug", action="store_true", help="show tracebacks")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.debug else logging.WARNING,
                        format="%(name)s: %(levelname)s: %(message)s", stream=sys.stderr)
    with user_errors(debug=args.debug, prog=PROG):
        if args.n_resamples < 1:
            raise InputError(f"--n-resamples must be >= 1, got {args.n_resamples}")
        if not 0 < args.ci < 1:
            raise InputError(f"--ci must be in (0, 1), got {args.ci}")
        if args.seed < 0:
            raise InputError(f"--seed must be >= 0, got {args.seed}")
        # Checked before the runs load: the report is written only where it can be.
        check_output_dir(args.out, "--out")
        if args.ablation:
            from hldstudy.analysis.ablation import write_report

            summary = write_report(args.runs_dir, args.out)
            print(f"wrote {args.out}/report.md ({summary['runs']} HLDF runs paired with KD); "
                  + "; ".join(f"{c['claim']}: {c['verdict']}" for c in summary["claims"]))
            return 0
        from hldstudy.analysis.report import build_report

        summary = build_report(args.runs_dir, args.out,
                               allow_mixed_budgets=args.allow_mixed_budgets,
                               check_names=not args.no_name_check,
                               n_resamples=args.n_resamples, level=args.ci, seed=args.seed,
                               reference=args.reference, wandb_report=args.wandb_report)
        n = len(summary["runs"])
        print(f"wrote {args.out}/report.md ({n} runs accounted for, "
              f"{len(summary['budgets'])} budget(s)); summary.json, tables/, figures/")
        if summary.get("wandb_report"):
            print(f"W&B report: {summary['wandb_report']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
