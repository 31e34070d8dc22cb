"""Data loading at the study's shapes: prepared shards vs the streaming (TFDS) path, worker
processes, and the time to the first batch of a resume.

On a C4-like corpus it generates (the synthetic generator's documents, `--join` per record,
as a TFDS array_record dataset) with two tokenizers trained on it (SentencePiece, a
byte-level BPE tokenizer.json), in one run:

(a) tokens/s of the streaming path (as it was: one document per encode call; now: chunks
    of 256 in the training process; `data.workers=2`) and of
    prepared shards (`hldstudy data prepare`, then `data.source=shards`), at the DisaggKD
    shape (256 x 4096) with the BPE tokenizer and with SentencePiece; `batch_at` for
    consecutive steps after one warm-up batch (worker start-up reported apart);
(b) the time to the first batch of a resume (stream built, cursor restored, batch read)
    at step 10 and at step 40,000 of the c4_123m data section (256 x 2048), for both
    paths; the step-40,000 cursor is step 10's scaled to that step (documents at the same
    rate: a cursor a real run would hold there), and the replay a stream without a
    cursor needs is measured at step 10 and extrapolated.

    python benchmarks/data_loader.py [--docs 30000] [--join 4] [--batches 3] [--workdir DIR]

Writes benchmarks/results/data_loader.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "benchmarks" / "results"
DISAGG = (256, 4096)  # experiments/disaggkd_qwen35.py: sequences x tokens per step
C4_123M = (256, 2048)  # sweeps/_c4.py, the 123M student


def build_corpus(work: Path, docs: int, join: int) -> dict:
    from hldstudy.data.tfds_corpus import NAME, build_tfds

    t0 = time.perf_counter()
    if not (work / "tfds" / "hld_tiny_c4").exists():
        build_tfds(work / "tfds", docs, max(docs // 100, 10), join)
    return {"path": str(work / "tfds"), "name": NAME, "build_s": time.perf_counter() - t0}


def train_tokenizers(work: Path, corpus: dict) -> dict:
    """SentencePiece and byte-level BPE, each trained on the first 5,000 documents."""
    from hldstudy.config import DataConfig
    from hldstudy.data import sources
    from hldstudy.data.tokenizer import train_tokenizer

    cfg = DataConfig(source="tfds", path=corpus["path"], tfds_name=corpus["name"])
    docs = sources.tfds_documents(cfg, "train")
    texts = [docs[i] for i in range(min(5000, len(docs)))]
    spm = work / "spm.model"
    if not spm.exists():
        train_tokenizer(texts, 32000, work / "spm")
    bpe_dir = work / "bpe"
    if not (bpe_dir / "tokenizer.json").exists():
        from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

        tok = Tokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        tok.train_from_iterator(texts, trainers.BpeTrainer(
            vocab_size=32000, special_tokens=["<|endoftext|>", "<pad>"],
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
        bpe_dir.mkdir(exist_ok=True)
        tok.save(str(bpe_dir / "tokenizer.json"))
        (bpe_dir / "tokenizer_config.json").write_text(json.dumps(
            {"eos_token": "<|endoftext|>", "pad_token": "<pad>"}))
    return {"spm": str(spm), "bpe": str(bpe_dir / "tokenizer.json")}


def data_cfg(corpus: dict, tokenizer: str, shape, **kw):
    from hldstudy.config import DataConfig

    return DataConfig(source="tfds", path=corpus["path"], tfds_name=corpus["name"],
                      tokenizer=tokenizer, batch_size=shape[0], seq_len=shape[1], **kw)


def throughput(stream, batches: int) -> dict:
    t0 = time.perf_counter()
    first = stream.batch_at(0)
    warm = time.perf_counter() - t0
    tokens = 0
    t0 = time.perf_counter()
    for i in range(1, batches + 1):
        b = stream.batch_at(i)
        tokens += int((b["segment_ids"] != 0).sum())
    dt = time.perf_counter() - t0
    assert first["tokens"].shape == b["tokens"].shape
    return {"tokens_per_s": tokens / dt, "first_batch_s": warm, "batches": batches,
            "seconds": dt}


def streaming(cfg, tokenizer_path: str, batches: int, one_at_a_time: bool = False) -> dict:
    """one_at_a_time: the path as it was before the encoder (one document per encode
    call, in the training process)."""
    from hldstudy.data.encoding import DocumentEncoder
    from hldstudy.data.pipeline import make_batches
    from hldstudy.data.tokenizer import Tokenizer

    stream = make_batches(cfg, Tokenizer.load(tokenizer_path), cfg.train_split)
    if one_at_a_time:
        stream.encoder = DocumentEncoder(stream.documents, stream.tokenizer,
                                         add_bos=cfg.add_bos, chunk=1)
    try:
        return throughput(stream, batches)
    finally:
        stream.encoder.close()


def prepared(corpus: dict, tokenizer_path: str, work: Path, workers: int) -> tuple[Path, dict]:
    from hldstudy.data.prepare import prepare

    out = work / f"shards-{Path(tokenizer_path).stem}"
    shutil.rmtree(out, ignore_errors=True)
    cfg = data_cfg(corpus, tokenizer_path, DISAGG)
    t0 = time.perf_counter()
    manifest = prepare(cfg, out, workers=workers, docs_per_shard=2048, progress=False)
    dt = time.perf_counter() - t0
    tokens = manifest["splits"]["train"]["tokens"] + manifest["splits"]["valid"]["tokens"]
    return out, {"prepare_s": dt, "prepare_tokens_per_s": tokens / dt, "workers": workers,
                 "documents": manifest["splits"]["train"]["documents"],
                 "tokens": manifest["splits"]["train"]["tokens"]}


def shards_stream(shards: Path, shape):
    from hldstudy.config import DataConfig
    from hldstudy.data import prepare_data

    cfg = DataConfig(source="shards", path=str(shards), batch_size=shape[0], seq_len=shape[1])
    return prepare_data(cfg, tempfile.mkdtemp(prefix="hld-bench-")).train


def _scaled(cursor, factor: int):
    """A cursor of a later step: every document index scaled (offsets at a boundary)."""
    if isinstance(cursor[0], list):
        return [[int(c[0]) * factor, 0] for c in cursor]
    return [int(cursor[0]) * factor, 0]


def resume_times(make_stream) -> dict:
    """Time to the first batch of a resume at step 10 and 40,000 (`make_stream()` builds a
    fresh stream, as a restarted process does), and of a replay to step 10."""
    ref = make_stream()
    for i in range(10):
        ref.batch_at(i)
    state10 = ref.state_at(10)
    state40k = {**state10, "step": 40_000, "cursor": _scaled(state10["cursor"], 4000)}
    out = {}
    for name, state in (("step_10", state10), ("step_40000", state40k)):
        t0 = time.perf_counter()
        s = make_stream()
        s.restore(json.loads(json.dumps(state)))
        s.batch_at(state["step"])
        out[f"{name}_s"] = time.perf_counter() - t0
        out[f"{name}_replayed"] = s.replayed
    t0 = time.perf_counter()
    s = make_stream()
    s.batch_at(10)
    out["replay_to_10_s"] = time.perf_counter() - t0
    out["replay_to_40000_s_extrapolated"] = out["replay_to_10_s"] * 4000
    out["ratio_40000_over_10"] = out["step_40000_s"] / out["step_10_s"]
    return out


def run(args) -> dict:
    work = Path(args.workdir or tempfile.mkdtemp(prefix="hld-data-bench-"))
    work.mkdir(parents=True, exist_ok=True)
    res = {"machine": {"platform": platform.platform(), "cpus": os.cpu_count(),
                       "loadavg_start": os.getloadavg()[0]},
           "docs": args.docs, "join": args.join, "batches": args.batches}
    corpus = build_corpus(work, args.docs, args.join)
    toks = train_tokenizers(work, corpus)
    res["corpus"] = corpus
    rows = []
    for tname, tpath in toks.items():
        r = streaming(data_cfg(corpus, tpath, DISAGG), tpath, args.batches, one_at_a_time=True)
        rows.append({"tokenizer": tname, "path": "streaming, one document at a time (before)",
                     **r})
        print(rows[-1], flush=True)
        for workers in (0, 2):
            cfg = data_cfg(corpus, tpath, DISAGG, workers=workers)
            r = streaming(cfg, tpath, args.batches)
            rows.append({"tokenizer": tname, "path": f"streaming, {workers} workers", **r})
            print(rows[-1], flush=True)
        shards, prep = prepared(corpus, tpath, work, workers=2)
        r = throughput(shards_stream(shards, DISAGG), args.batches)
        rows.append({"tokenizer": tname, "path": "prepared shards", **r, "prepare": prep})
        print(rows[-1], flush=True)
    res["throughput"] = rows
    spm_shards = work / "shards-spm"
    res["resume"] = {
        "streaming": resume_times(lambda: _stream_c4(corpus, toks["spm"])),
        "shards": resume_times(lambda: shards_stream(spm_shards, C4_123M)),
    }
    res["machine"]["loadavg_end"] = os.getloadavg()[0]
    res["ratios"] = ratios(res)
    return res


def _stream_c4(corpus, spm):
    from hldstudy.data.pipeline import make_batches
    from hldstudy.data.tokenizer import Tokenizer

    cfg = data_cfg(corpus, spm, C4_123M)
    return make_batches(cfg, Tokenizer.load(spm), cfg.train_split)


def ratios(res: dict) -> dict:
    by = {(r["tokenizer"], r["path"]): r["tokens_per_s"] for r in res["throughput"]}
    out = {}
    for t in ("bpe", "spm"):
        before = by[(t, "streaming, one document at a time (before)")]
        chunked = by[(t, "streaming, 0 workers")]
        out[f"{t}_shards_over_streaming_before"] = by[(t, "prepared shards")] / before
        out[f"{t}_shards_over_streaming_chunked"] = by[(t, "prepared shards")] / chunked
        out[f"{t}_2_workers_over_1_process_before"] = by[(t, "streaming, 2 workers")] / before
        out[f"{t}_2_workers_over_1_process_chunked"] = by[(t, "streaming, 2 workers")] / chunked
    for path, r in res["resume"].items():
        out[f"{path}_resume_40000_over_10"] = r["ratio_40000_over_10"]
    return out


def write_markdown(res: dict, path: Path) -> None:
    m = res["machine"]
    lines = ["# Data loading: prepared shards, streaming workers, resume", "",
             f"{res['docs']} documents ({res['join']} generated documents each), "
             f"{m['cpus']} CPUs, load average {m['loadavg_start']:.1f} -> "
             f"{m['loadavg_end']:.1f}. `python benchmarks/data_loader.py`", "",
             f"## Tokens/s at the DisaggKD shape {DISAGG[0]} x {DISAGG[1]}", "",
             "| tokenizer | path | tokens/s | first batch s |", "|---|---|---:|---:|"]
    for r in res["throughput"]:
        lines.append(f"| {r['tokenizer']} | {r['path']} | {r['tokens_per_s']:,.0f} | "
                     f"{r['first_batch_s']:.2f} |")
    lines += ["", "Prepare (2 workers): " + "; ".join(
        f"{r['tokenizer']}: {r['prepare']['tokens']:,} tokens in {r['prepare']['prepare_s']:.1f} s"
        for r in res["throughput"] if "prepare" in r), "",
        f"## Time to the first batch of a resume ({C4_123M[0]} x {C4_123M[1]}, SentencePiece)",
        "", "| path | step 10 s | step 40,000 s | ratio | replayed | replay to 10 s | "
        "replay to 40,000 s (extrapolated) |", "|---|---:|---:|---:|---:|---:|---:|"]
    for p, r in res["resume"].items():
        lines.append(f"| {p} | {r['step_10_s']:.2f} | {r['step_40000_s']:.2f} | "
                     f"{r['ratio_40000_over_10']:.2f} | {r['step_40000_replayed']} | "
                     f"{r['replay_to_10_s']:.2f} | {r['replay_to_40000_s_extrapolated']:,.0f} |")
    lines += ["", "## Ratios (targets: shards >= 5x streaming, 2 workers >= 1.3x, resume "
              "40,000 / 10 <= 2)", "", "| ratio | value |", "|---|---:|"]
    lines += [f"| {k} | {v:.2f} |" for k, v in res["ratios"].items()]
    path.write_text("\n".join(lines) + "\n")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--docs", type=int, default=30000)
    ap.add_argument("--join", type=int, default=4)
    ap.add_argument("--batches", type=int, default=3)
    ap.add_argument("--workdir", default=None, help="keep the corpus and shards here")
    ap.add_argument("--render-only", action="store_true")
    args = ap.parse_args()
    OUT.mkdir(parents=True, exist_ok=True)
    if args.render_only:
        res = json.loads((OUT / "data_loader.json").read_text())
    else:
        res = run(args)
        (OUT / "data_loader.json").write_text(json.dumps(res, indent=2) + "\n")
    write_markdown(res, OUT / "data_loader.md")
    print((OUT / "data_loader.md").read_text())


if __name__ == "__main__":
    main()
