"""`hldstudy <command>`: the package's front door.

    hldstudy quickstart [--size small|medium|large] [--workdir DIR]
    hldstudy train ...     (same as python -m hldstudy.train)
    hldstudy flops ...     (FLOPs per step, steps per budget, XLA's count)
    hldstudy plan ...      (memory / network planner; --sweep, --check-compile)
    hldstudy data prepare  (tokenize a corpus once into token shards)
    hldstudy study real-text --workdir DIR  (HLD vs KD on real text, corpus to verdicts)
    hldstudy eval|sweep|analysis ...  (same as python -m hldstudy.eval, .sweep, .analysis)
    hldstudy serve ...     (same as python -m hldstudy.teacher.serve)
    hldstudy compress ...  (same as python -m hldstudy.compress)
"""

from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    commands = {
        "quickstart": "hldstudy.quickstart",
        "train": "hldstudy.train.__main__",
        "flops": "hldstudy.commands.flops",
        "plan": "hldstudy.commands.plan",
        "data": "hldstudy.commands.data",
        "study": "hldstudy.study.__main__",
        "eval": "hldstudy.eval.__main__",
        "sweep": "hldstudy.sweep.__main__",
        "analysis": "hldstudy.analysis.__main__",
        "serve": "hldstudy.teacher.serve",
        "compress": "hldstudy.compress.__main__",
    }
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__.strip())
        return 0
    if argv[0] not in commands:
        import difflib

        near = difflib.get_close_matches(argv[0], commands, n=1)
        print(f"hldstudy: error: unknown command {argv[0]!r}"
              + (f" (did you mean {near[0]!r}?)" if near else "")
              + f"; the commands: {', '.join(commands)} (hldstudy --help)", file=sys.stderr)
        return 2
    import importlib

    return importlib.import_module(commands[argv[0]]).main(argv[1:]) or 0


if __name__ == "__main__":
    sys.exit(main())
