"""python -m hldstudy.compress --checkpoint RUN --prune {magnitude,wanda,sparsegpt}-2:4 --out DIR

Design notes: `docs/compression.md`, under this file's name.
"""

from __future__ import annotations

import argparse
import sys

from hldstudy.cli_common import quiet_libraries
from hldstudy.compress.config import CompressConfig
from hldstudy.config import field_rules
from hldstudy.distill import methods
from hldstudy.errors import user_errors

# The command's --help text.
HELP = """python -m hldstudy.compress --checkpoint RUN --prune {magnitude,wanda,sparsegpt}-2:4 --out DIR

    [--calibration-batches N] [--recover-steps N | --recover-flops F] [--teacher T]
    [--method kd|patient] [--divergence forward_kl|reverse_kl] [--quantize fp8]
    [--quantize-in-loop] [--eval TASKS] [--calibration-data PATH [--calibration-tfds NAME]]
    [--calibration-tokens N] [--export compressed-tensors] [--config FILE]
    [--set compress.FIELD=VALUE ...]

Prunes a run's block linears to 2:4 along the input dimension, optionally
recovers with distillation (masks held), optionally quantizes to FP8, and
evaluates every stage. Writes DIR/report.json, DIR/report.md, DIR/config.json
(the resolved `compress` section), DIR/model.safetensors and DIR/model/ (a run
directory `python -m hldstudy.eval` reads). The flags are shorthands for the
fields of hldstudy.compress.config.CompressConfig.
"""

PROG = "python -m hldstudy.compress"

# flag dest -> compress field
SHORTHANDS = {"checkpoint": "checkpoint", "prune": "prune", "out": "out",
              "calibration_batches": "calibration_batches", "recover_steps": "recover_steps",
              "recover_flops": "recover_flops", "teacher": "teacher", "method": "method",
              "divergence": "divergence", "quantize": "quantize",
              "quantize_in_loop": "quantize_in_loop", "eval": "eval", "eval_limit": "eval_limit",
              "calibration_data": "calibration_data", "calibration_tokens": "calibration_tokens",
              "calibration_tfds": "calibration_tfds", "export": "export",
              "save_stages": "save_stages"}


def _choices(field: str) -> tuple:
    """The values a compress field's declared domain allows (its flag's choices)."""
    return field_rules(CompressConfig)[field]["domain"].choices


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=PROG, description=HELP.split("\n\n")[2],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--checkpoint", help="hldstudy run directory, GGUF file or Hugging Face "
                                        "directory to compress")
    p.add_argument("--prune", help="magnitude-2:4 | wanda-2:4 | sparsegpt-2:4 (default)")
    p.add_argument("--out", help="output directory")
    p.add_argument("--calibration-batches", type=int,
                   help="batches of the run's training data for Wanda / SparseGPT (default 16)")
    p.add_argument("--calibration-data", help="text/JSONL file or folder, or a TFDS data_dir "
                   "(with --calibration-tfds): calibration, recovery and held-out text")
    p.add_argument("--calibration-tokens", type=int,
                   help="calibration tokens (default: --calibration-batches batches)")
    p.add_argument("--calibration-tfds", help="TFDS dataset name read from --calibration-data")
    p.add_argument("--export", choices=_choices("export"),
                   help="also write DIR/compressed-tensors/ (a Hugging Face directory)")
    p.add_argument("--recover-steps", type=int, help="recovery distillation steps (0 = none)")
    p.add_argument("--recover-flops", type=float, help="recovery FLOP budget (wins over steps)")
    p.add_argument("--teacher", help="recovery teacher (default: the dense checkpoint)")
    p.add_argument("--method", choices=_choices("method"),
                   help=f"recovery method (default {methods.REFERENCE})")
    p.add_argument("--divergence", choices=_choices("divergence"),
                   help="recovery divergence (default forward_kl)")
    p.add_argument("--quantize", choices=_choices("quantize"), help="quantize the block linears to FP8")
    p.add_argument("--quantize-in-loop", action="store_true", default=None,
                   help="quantize before recovery and recover with FP8 in the loop")
    p.add_argument("--eval", help="downstream tasks per stage, e.g. synth_mc,synth_cloze")
    p.add_argument("--eval-limit", type=int, help="items per downstream task")
    p.add_argument("--save-stages", action="store_true", default=None,
                   help="also save every intermediate stage's model under OUT/stages/")
    p.add_argument("--config", help="JSON file with a compress section (e.g. a previous "
                                    "DIR/config.json) or a .py with get_compress_config()")
    p.add_argument("--set", dest="overrides", action="append", default=[],
                   metavar="compress.FIELD=VALUE", help="override a compress field")
    p.add_argument("--no-progress", action="store_true", help="hide progress bars")
    p.add_argument("--debug", action="store_true", help="show tracebacks")
    return p


def resolve(args: argparse.Namespace):
    import dataclasses

    from hldstudy.compress.config import CompressConfig, apply_overrides, load_file, validate

    cfg = load_file(args.config) if args.config else CompressConfig()
    flags = {field: getattr(args, dest) for dest, field in SHORTHANDS.items()
             if getattr(args, dest) is not None}
    if args.no_progress:
        flags["progress"] = False
    cfg = dataclasses.replace(cfg, **flags)
    cfg = apply_overrides(cfg, args.overrides)
    return validate(cfg)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.no_progress:
        import os

        os.environ.setdefault("TQDM_DISABLE", "1")
    quiet_libraries()
    with user_errors(args.debug, prog=PROG):
        cfg = resolve(args)
        from hldstudy.compress.pipeline import run

        report = run(cfg)
        from hldstudy.compress.pipeline import render

        sys.stdout.write(render(report))
        extra = f", {cfg.export}/" if cfg.export else ""
        print(f"wrote {cfg.out}/report.json, report.md, model.safetensors, model/{extra}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
