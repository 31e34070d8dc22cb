"""python -m hldstudy.eval --checkpoint DIR --tasks hellaswag,piqa,... --out results.json
   python -m hldstudy.eval --checkpoints DIR [DIR ...] --tasks ... [--out-dir OUT]

Design notes: `docs/evaluation.md`, under this file's name.
"""

from __future__ import annotations

import argparse
import os
import sys

from hldstudy.cli_common import check_output_file, make_output_dir, quiet_libraries, remove_if_empty
from hldstudy.errors import InputError, user_errors

# The command's --help text.
HELP = """python -m hldstudy.eval --checkpoint DIR --tasks hellaswag,piqa,... --out results.json
   python -m hldstudy.eval --checkpoints DIR [DIR ...] --tasks ... [--out-dir OUT]

Evaluates an hldstudy run directory (or an imported Gemma GGUF file / HF
directory) on lm-eval tasks by name (offline from local JSONL with
--offline-data DIR or $HLDSTUDY_EVAL_DATA; file names in eval/README.md),
on the synthetic downstream tasks synth_mc / synth_cloze, and on corpus
perplexity (synthetic_ppl, valid_ppl, c4_ppl). Writes the results JSON, a
markdown table next to it, and logs to W&B with --wandb (offline unless
$WANDB_MODE says otherwise). --checkpoints evaluates many checkpoints (or every
run of a sweep's folder) in one process, compiling the scorers once per model
shape: each one's results in OUT/<name>/results.json (without --out-dir: a
run's own <run>/eval/results.json), one table for all in OUT/table.md and
table.json, and printed.
"""

PROG = "python -m hldstudy.eval"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=PROG, description=HELP.split("\n\n")[1],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    which = p.add_mutually_exclusive_group(required=True)
    which.add_argument("--checkpoint",
                       help="hldstudy run directory, GGUF file or Hugging Face checkpoint directory")
    which.add_argument("--checkpoints", nargs="+", metavar="DIR",
                       help="many checkpoints evaluated in one process (a folder of runs, e.g. a "
                            "sweep's work directory, means every run in it with a checkpoint)")
    p.add_argument("--tasks", required=True,
                   help="comma-separated: hellaswag,piqa,winogrande,lambada_openai,arc_easy,"
                        "wikitext (or any lm-eval task), synth_mc, synth_cloze, synthetic_ppl, "
                        "valid_ppl, c4_ppl")
    p.add_argument("--limit", type=int, default=None,
                   help="at most N documents per task (N rows for corpus perplexity)")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--offline-data", default=None,
                   help="folder of <task>.jsonl files (default: $HLDSTUDY_EVAL_DATA); "
                        "without it, lm-eval tasks read the Hugging Face hub")
    p.add_argument("--out", default=None, help="results JSON (a .md table is written next to it)")
    p.add_argument("--out-dir", default=None,
                   help="with --checkpoints: folder for each checkpoint's results and the table")
    p.add_argument("--max-length", type=int, default=None,
                   help="model length in tokens (default: the run's data.seq_len capped by "
                        "model.max_seq_len; imports: model.max_seq_len capped at 2048)")
    p.add_argument("--rolling-context", type=int, default=None,
                   help="tokens of context kept between loglikelihood_rolling windows "
                        "(default: half the model length; 1 = lm-eval's disjoint chunks)")
    p.add_argument("--bootstrap-iters", type=int, default=1000,
                   help="lm-eval bootstrap iterations for stderr of non-mean metrics")
    p.add_argument("--wandb", action=argparse.BooleanOptionalAction, default=None,
                   help="log to W&B (default: the run config's wandb.enabled)")
    p.add_argument("--no-progress", action="store_true", help="hide progress bars")
    p.add_argument("--debug", action="store_true", help="show tracebacks")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.no_progress:
        os.environ.setdefault("TQDM_DISABLE", "1")  # read when tqdm is first imported
    quiet_libraries()
    made: list = []
    with user_errors(args.debug, prog=PROG):
        for flag, value, low in (("--max-length", args.max_length, 1),
                                 ("--rolling-context", args.rolling_context, 1),
                                 ("--bootstrap-iters", args.bootstrap_iters, 0)):
            if value is not None and value < low:
                raise InputError(f"{flag} must be >= {low}, got {value}")
        if args.checkpoints is not None and args.out:
            raise InputError("--out is for one --checkpoint; give --out-dir with --checkpoints")
        if args.checkpoint is not None and args.out_dir:
            raise InputError("--out-dir is for --checkpoints; give --out with one --checkpoint")
        if args.out:
            # Checked and made before the evaluation: a bad --out never costs the work.
            out = check_output_file(args.out, "--out")
            stem = out.with_suffix("") if out.suffix == ".json" else out
            for side in (f"{stem}.md", f"{stem}.meta.json"):
                check_output_file(side, "--out (written next to it)")
            made = make_output_dir(out.parent, "--out")
        if args.out_dir:
            made = make_output_dir(args.out_dir, "--out-dir")
        kwargs = dict(limit=args.limit, batch_size=args.batch_size,
                      offline_data=args.offline_data, bootstrap_iters=args.bootstrap_iters,
                      rolling_context=args.rolling_context, max_length=args.max_length,
                      wandb=args.wandb, progress=not args.no_progress)
        try:
            if args.checkpoints is not None:
                from hldstudy.eval.multi import evaluate_checkpoints

                table = evaluate_checkpoints(args.checkpoints, args.tasks, out_dir=args.out_dir,
                                             **kwargs)
                sys.stdout.write(table.markdown())
                if args.out_dir:
                    print(f"wrote {args.out_dir}/table.md")
                failed = [r for r in table.rows if "error" in r]
                if failed:
                    raise InputError(f"{len(failed)} of {len(table.rows)} checkpoints could not "
                                     "be evaluated: " + "; ".join(
                                         f"{r['label']}: {r['error']}" for r in failed))
                return 0
            from hldstudy.eval.runner import evaluate, markdown_table

            results = evaluate(args.checkpoint, args.tasks, out=args.out, **kwargs)
        except BaseException:
            remove_if_empty(made)  # a failed evaluation leaves no empty folder behind
            raise
        sys.stdout.write(markdown_table(results))
        if args.out:
            print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
