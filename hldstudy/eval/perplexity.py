"""Token-level corpus perplexity through hldstudy's own data pipeline.

Design notes: `docs/evaluation.md`, under this file's name.
"""

from __future__ import annotations

import dataclasses
import math
import os
from pathlib import Path

import numpy as np
from tqdm.auto import tqdm

from hldstudy.config import DataConfig
from hldstudy.errors import InputError


def perplexity(mean_nll: float) -> float:
    """exp of the mean NLL; infinite past ~709 nats a token (a diverged model), where
    exp overflows."""
    if mean_nll >= math.log(float(np.finfo(np.float64).max)):
        return math.inf
    return math.exp(mean_nll)

def corpus_data_config(task: str, base: DataConfig | None) -> DataConfig:
    base = base or DataConfig()
    if task == "valid_ppl":
        return base
    if task == "synthetic_ppl":
        if base.source == "synthetic":
            return base
        return dataclasses.replace(base, source="synthetic", path=None, valid_path=None,
                                   max_docs=0)
    if task == "c4_ppl":
        if base.source == "tfds" and base.tfds_name.startswith("c4") and base.path:
            return dataclasses.replace(base, valid_split="validation")
        path = os.environ.get("HLDSTUDY_C4_DIR") or os.environ.get("TFDS_DATA_DIR")
        if not path:
            raise InputError("c4_ppl: no TFDS data_dir with c4/en (set $HLDSTUDY_C4_DIR or "
                             "$TFDS_DATA_DIR to a prepared tensorflow_datasets folder; nothing "
                             "is downloaded)")
        return dataclasses.replace(base, source="tfds", tfds_name="c4/en", path=path,
                                   valid_split="validation", valid_path=None)
    raise InputError(f"unknown corpus task {task!r} (synthetic_ppl, valid_ppl, c4_ppl)")


def corpus_perplexity(lm, task: str, *, limit: int | None = None,
                      workdir: str | Path | None = None, progress: bool = True) -> dict[str, float]:
    """{perplexity, nll, nll_stderr, tokens} of `lm` (an HLDStudyLM) on a corpus task."""
    from hldstudy.data.pipeline import make_batches

    base = lm.config.data if lm.config is not None else None
    dc = corpus_data_config(task, base)
    dc = dataclasses.replace(dc, seq_len=lm.max_length, batch_size=lm.batch_size,
                             add_bos=lm.add_bos)
    stream = make_batches(dc, lm.tokenizer, dc.valid_split, workdir)
    n_batches = stream.num_batches
    if limit:
        want = math.ceil(int(limit) / lm.batch_size)
        n_batches = want if n_batches is None else min(n_batches, want)
    total = s1 = s2 = 0.0
    bar = tqdm(total=n_batches, desc=task, disable=not progress, leave=False)
    step = 0
    while n_batches is None or step < n_batches:
        try:
            b = stream.batch_at(step)
        except IndexError:
            break
        logp, _ = lm.scorer.score_batch(b["tokens"], b["targets"], b["positions"],
                                        b["segment_ids"])
        m = b["mask"] > 0
        nll = -logp[m].astype(np.float64)
        total += nll.size
        s1 += float(nll.sum())
        s2 += float((nll ** 2).sum())
        step += 1
        bar.update(1)
    bar.close()
    if total == 0:
        raise InputError(f"{task}: the validation split has no tokens to score")
    mean = s1 / total
    var = max(s2 / total - mean ** 2, 0.0)
    return {"perplexity": perplexity(mean), "nll": mean,
            "nll_stderr": math.sqrt(var / total), "tokens": float(total)}
