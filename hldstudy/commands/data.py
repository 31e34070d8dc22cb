"""`hldstudy data prepare`: tokenize a config's corpus once into token shards.

CLI: `hldstudy data prepare --config experiments/c4_123m_kd.py --set data.path=/data/tfds
--out /data/c4-shards --workers 8`; then train with `--set data.source=shards
--set data.path=/data/c4-shards`. Killed and rerun with the same arguments, it continues.
"""

from __future__ import annotations

import argparse
import sys

from hldstudy.cli_common import (
    EXPERIMENTS,
    find_builtin,
    make_output_dir,
    quiet_libraries,
    remove_if_empty,
)
from hldstudy.config import apply_overrides, check_fields, load_experiment
from hldstudy.data.prepare import DOCS_PER_SHARD, prepare
from hldstudy.errors import ConfigError, user_errors


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="hldstudy data", description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="command", required=True)
    prep = sub.add_parser("prepare", help="tokenize the config's corpus into token shards")
    prep.add_argument("--config", required=True, help="an experiment file (its data section)")
    prep.add_argument("--set", dest="overrides", action="append", default=[], metavar="K=V")
    prep.add_argument("--out", required=True, help="the directory of the shards and manifest")
    prep.add_argument("--workers", type=int, default=1, help="tokenizing processes (default 1)")
    prep.add_argument("--docs-per-shard", type=int, default=None,
                      help="documents per shard file (default 8192)")
    prep.add_argument("--no-progress", action="store_true", help="no progress bar")
    prep.add_argument("--debug", action="store_true", help="show tracebacks")
    args = ap.parse_args(argv)
    quiet_libraries()
    with user_errors(args.debug, "hldstudy data"):
        cfg = apply_overrides(load_experiment(find_builtin(args.config, EXPERIMENTS)),
                              args.overrides)
        check_fields(cfg)
        if cfg.data.source != "synthetic" and not cfg.data.path:
            raise ConfigError("data.path", f"data.source={cfg.data.source!r} needs a path",
                              "pass --set data.path=/local/path")
        per_shard = DOCS_PER_SHARD if args.docs_per_shard is None else args.docs_per_shard
        if per_shard < 1:
            raise ConfigError("--docs-per-shard", f"must be >= 1, got {per_shard}")
        made = make_output_dir(args.out, "--out")
        try:
            manifest = prepare(cfg.data, args.out, workers=args.workers,
                               docs_per_shard=per_shard, progress=not args.no_progress)
        except KeyboardInterrupt:
            remove_if_empty(made)
            print(f"hldstudy data: interrupted; the shards written to {args.out} so far are "
                  "kept: run the same command again to continue", file=sys.stderr)
            return 130
        except BaseException:
            remove_if_empty(made)
            raise
        parts = ", ".join(f"{k}: {v['documents']} documents, {v['tokens']} tokens in "
                          f"{len(v['shards'])} shards" for k, v in manifest["splits"].items())
        print(f"prepared {args.out} ({parts}); train with --set data.source=shards "
              f"--set data.path={args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
