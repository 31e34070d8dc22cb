"""`python -m hldstudy.aot`: compile a run's steps for a TPU or NVIDIA target on this
machine, without the target, and say what the target's compiler reports per device.

    python -m hldstudy.aot --config experiments/c4_123m_kd.py --target v5e:2x4 [--cohort 4]
    python -m hldstudy.aot --config experiments/disaggkd_qwen35.py --target h100:8 \\
        --layout disaggregated --parts train [--json]

Targets: v4 / v5e / v5p / v6e with a topology (v5e:2x4, v4:2x2x1, v6e:2x2), h100:N,
a100:N, h200:N (or Nxh100). Needs the `aot` extra (pip install -e '.[aot]'); runs the
host on the CPU backend (JAX_PLATFORMS=cpu). Exit 2: bad input (unknown target, a
topology libtpu refuses, the extra missing); exit 3: a step does not fit the device.
"""

from __future__ import annotations

import argparse
import json
import sys

from hldstudy.aot.check import PARTS, check_compile, load_run
from hldstudy.errors import RuntimeFault, user_errors
from hldstudy.teacher_source import LAYOUTS

PROG = "hldstudy.aot"


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog=f"python -m {PROG}", description=__doc__.split("\n")[0])
    ap.add_argument("--config", required=True, help="experiment file or built-in name")
    ap.add_argument("--method", default=None, help="method (default: the config's)")
    ap.add_argument("--set", dest="overrides", action="append", default=[], metavar="K=V")
    ap.add_argument("--target", required=True, help="v5e:2x4, v4:2x2x1, h100:8, a100:8, ...")
    ap.add_argument("--cohort", type=int, default=None, metavar="K",
                    help="compile the cohort step of K students instead of the solo step")
    ap.add_argument("--teacher-preset", default=None,
                    help="the teacher's model preset (default: read teacher.checkpoint)")
    ap.add_argument("--layout", choices=LAYOUTS, default=None,
                    help="where the teacher runs: inside the train step (colocated) or on "
                         "replicas streaming its outputs (disaggregated); default: the one "
                         "teacher.checkpoint gives (remote:// is disaggregated)")
    ap.add_argument("--parts", default=",".join(PARTS),
                    help=f"which programs to compile, comma-separated of {', '.join(PARTS)}")
    ap.add_argument("--json", action="store_true", help="one JSON object instead of the table")
    ap.add_argument("--lower-only", action="store_true",
                    help="lower the programs without compiling them: each one's sha256, "
                         "what a kept compile record is checked against (seconds, not minutes)")
    ap.add_argument("--debug", action="store_true", help="show tracebacks")
    return ap


def main(argv: list[str] | None = None) -> int:
    a = build_parser().parse_args(argv)
    with user_errors(a.debug, prog=PROG):
        parts = tuple(p.strip() for p in a.parts.split(",") if p.strip())
        cfg, method, teacher = load_run(a.config, a.overrides, a.method, a.teacher_preset)
        report = check_compile(cfg, method, teacher, a.target, cohort=a.cohort, parts=parts,
                               layout=a.layout, lower_only=a.lower_only)
        if a.json:
            print(json.dumps({k: v for k, v in report.items() if k != "text"}, sort_keys=True))
        else:
            print(report["text"])
        sys.stdout.flush()
        if "does_not_fit" in report:
            raise RuntimeFault(report["does_not_fit"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
