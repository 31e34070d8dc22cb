"""python -m hldstudy.train --config tiny [--set k=v ...] [--workdir DIR]

Trains (or resumes) one run. The resolved config lands in DIR/config.json,
metrics in DIR/metrics.jsonl, the final evaluation in DIR/results.json.

Exit codes: 0 done; 2 bad input or configuration; 3 a runtime fault (non-finite
state, a checkpoint that cannot be saved, a step that does not fit in memory);
128 + N stopped by signal N after saving a checkpoint (130 Ctrl-C, 143 SIGTERM).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from hldstudy.cli_common import add_config_args, check_output_dir, quiet_libraries, resolve_config
from hldstudy.distill import methods
from hldstudy.errors import HLDError, RuntimeFault, exit_code_for_signal, user_errors


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m hldstudy.train", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_config_args(parser)
    parser.add_argument("--workdir", default=None, help="run directory (default runs/<name>)")
    parser.add_argument("--method", default=None,
                        choices=methods.names(),
                        help="distillation method (same as --set distill.method=...)")
    args = parser.parse_args(argv)
    quiet_libraries()
    with user_errors(args.debug, prog="hldstudy.train"):
        extra = [f"distill.method={args.method}"] if args.method else []
        cfg = resolve_config(args, extra)
        from hldstudy.model.presets import check_teacher_preset

        check_teacher_preset(cfg.teacher.preset)
        workdir = Path(args.workdir or f"runs/{cfg.name}")
        check_output_dir(workdir, "--workdir" if args.workdir else "--workdir (runs/<name>)")
        from hldstudy.train.loop import Interrupted, train

        try:
            result = train(cfg, workdir)
        except Interrupted as e:
            print(f"hldstudy.train: {e} ({workdir})", file=sys.stderr)
            return exit_code_for_signal(e.signum)
        except MemoryError as e:
            raise _out_of_memory(cfg, e) from e
        except OSError as e:
            raise RuntimeFault(f"{e.strerror or e}{f': {e.filename}' if e.filename else ''} "
                               "(check the disk and the permissions of --workdir; "
                               "rerun to resume from the last checkpoint)") from e
        except HLDError:
            raise  # already ours (a failed save names itself)
        except Exception as e:
            if "RESOURCE_EXHAUSTED" in str(e) or "Out of memory" in str(e):
                raise _out_of_memory(cfg, e) from e
            raise
        print(f"done: {result['steps']} steps, valid_nll={result['valid_nll']:.4f} "
              f"(ppl {result['valid_ppl']:.2f}) -> {workdir / 'results.json'}")
    return 0


def _out_of_memory(cfg, exc: BaseException) -> RuntimeFault:
    first = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:160]
    return RuntimeFault(f"out of memory while training ({first}); lower data.batch_size "
                        f"(now {cfg.data.batch_size}) or data.seq_len (now {cfg.data.seq_len}), "
                        "then rerun to resume from the last checkpoint")


if __name__ == "__main__":
    sys.exit(main())
