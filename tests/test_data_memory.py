"""The finite (text/jsonl) path reads from disk: the corpus is streamed through the
tokenizer and packer into the run's row cache, and training reads the rows memory-mapped,
so a process's peak RSS does not grow with the corpus. Measured in fresh subprocesses on
a jsonl corpus and on one 10x larger (the same documents, ten times)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from hldstudy.data.synthetic import generate_documents

ROOT = Path(__file__).resolve().parent.parent

_MEASURE = r"""
import resource, sys
from hldstudy.config import DataConfig
from hldstudy.data import prepare_data
cfg = DataConfig(source="jsonl", path=sys.argv[1], tokenizer=sys.argv[2], seq_len=64,
                 batch_size=8, valid_holdout_docs=50)
bundle = prepare_data(cfg, sys.argv[3])
for i in range(200):
    bundle.train.batch_at(i)
bundle.valid_batches(4)
print(len(bundle.train.rows), resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)
"""


def _peak(corpus: Path, tokenizer: str, workdir: Path) -> tuple[int, int]:
    out = subprocess.run([sys.executable, "-c", _MEASURE, str(corpus), tokenizer, str(workdir)],
                         capture_output=True, text=True, cwd=ROOT, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    rows, kib = out.stdout.split()
    return int(rows), int(kib)


def test_peak_rss_does_not_grow_with_the_corpus(tmp_path, tokenizer_path):
    lines = "".join(json.dumps({"text": t}) + "\n" for t in generate_documents(16000, seed=3))
    small, large = tmp_path / "small.jsonl", tmp_path / "large.jsonl"
    small.write_text(lines)
    large.write_text(lines * 10)
    rows_small, peak_small = _peak(small, tokenizer_path, tmp_path / "run_small")
    rows_large, peak_large = _peak(large, tokenizer_path, tmp_path / "run_large")
    assert rows_large > 9 * rows_small
    print(f"peak RSS: {peak_small} KiB ({rows_small} rows), {peak_large} KiB ({rows_large} rows)")
    assert peak_large <= 1.2 * peak_small, (peak_small, peak_large)
    # The cache is read memory-mapped on a second start (nothing is tokenized again).
    rows_again, _ = _peak(large, tokenizer_path, tmp_path / "run_large")
    assert rows_again == rows_large
