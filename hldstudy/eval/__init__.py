"""Evaluation: the lm-eval adapter (`HLDStudyLM`, model type `hldstudy`), offline
task overrides, corpus perplexity and `python -m hldstudy.eval`.

    from hldstudy.eval import evaluate
    evaluate("runs/tiny", ["hellaswag", "wikitext", "synthetic_ppl"],
             limit=100, offline_data="eval/fixtures", out="runs/tiny/eval/results.json")

Importing this package is cheap; lm-eval and JAX load on first use.
"""

from __future__ import annotations

__all__ = ["evaluate", "HLDStudyLM", "corpus_perplexity"]


def __getattr__(name):
    if name == "evaluate":
        from hldstudy.eval.runner import evaluate

        return evaluate
    if name == "HLDStudyLM":
        from hldstudy.eval.adapter import HLDStudyLM

        return HLDStudyLM
    if name == "corpus_perplexity":
        from hldstudy.eval.perplexity import corpus_perplexity

        return corpus_perplexity
    raise AttributeError(name)
