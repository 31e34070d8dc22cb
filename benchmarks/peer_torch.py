"""The KD train step, hldstudy vs PyTorch + transformers, side by side on this CPU.

    python benchmarks/peer_torch.py                  # float32 and bfloat16, 5 rounds
    python benchmarks/peer_torch.py --rounds 3 --dtypes float32
    python benchmarks/peer_torch.py --tiny           # seconds: a smoke run of every worker

Shape (issue 14): the paper-123m student (18 layers, d 640, V 32768, Gemma 3
layout), seq 256, batch 4, a 6-layer d 256 teacher of the same layout, logit KD
`alpha * NLL + (1 - alpha) * tau^2 * KL(p_t || p_s)` (forward KL, tau = 2,
alpha = 0.5), AdamW with global-norm clipping 1.0, one optimizer step per call.

- **ours**: hldstudy's own train step, built from the trainer's pieces
  (`make_strategy`, the colocated teacher's `teacher_forward_fn`,
  `make_optimizer`, `train_program`, jitted with the state donated, as
  `train/loop.py` does): teacher forward, student forward, fused KD loss
  (never builds `[T, V]` logits) or `distill.loss_impl=materialized`, backward,
  AdamW. `model.attention=auto` (the default a study run gets on CPU).
- **torch**: transformers' `Gemma3ForCausalLM` (sdpa attention) for both
  models, loaded from our own weights written by `export_hf` (so both sides
  start from the same parameters: the first-step losses are compared as a
  check that they compute the same objective), materialized logits,
  `cross_entropy` + `kl_div(log_target=True)`, `torch.optim.AdamW`,
  `clip_grad_norm_`. bfloat16: `torch.autocast` on float32 parameters (the
  usual mixed precision); ours: `model.dtype=bfloat16` with float32 parameters.

Each implementation runs in its own worker process; all workers of a dtype are
started, compiled and warmed up first, then the driver asks them for one step
each in turn for `--rounds` rounds (A B C A B C ...), so every ratio compares
steps taken seconds apart under the same machine load (this box is shared;
absolute times move, side-by-side ratios much less). Reported: the median step
time per worker, tokens/s, and the median over rounds of the per-round ratio
to torch's step. Without torch/transformers it prints one line and exits 0.

Writes benchmarks/results/peer_torch.{json,md}.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results"

BATCH, SEQ, VOCAB = 4, 256, 32768
TEMPERATURE, ALPHA = 2.0, 0.5


def model_configs(tiny: bool = False):
    """(student, teacher) ModelConfigs: paper-123m and a 6-layer d 256 teacher of its layout."""
    from hldstudy.model import preset

    if tiny:
        student = preset("tiny", vocab_size=1024)
        teacher = preset("tiny-teacher", vocab_size=1024)
        return student, teacher
    student = preset("paper-123m", max_seq_len=512)
    teacher = dataclasses.replace(student, n_layers=6, d_model=256, n_heads=4, n_kv_heads=1,
                                  head_dim=64, d_ff=1024)
    return student, teacher


def shapes(tiny: bool):
    return (2, 64) if tiny else (BATCH, SEQ)


def make_batch(vocab: int, batch: int, seq: int, seed: int = 0):
    import numpy as np

    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, vocab, (batch, seq)).astype(np.int32)
    targets = np.concatenate([tokens[:, 1:], rng.integers(0, vocab, (batch, 1))], axis=1)
    return tokens, targets.astype(np.int32)


# ---------------------------------------------------------------------------
# Ours: the trainer's step.


def build_ours(dtype: str = "float32", loss_impl: str = "fused", *, tiny: bool = False,
               attention: str = "auto", seed: int = 0):
    """Returns (step, state, batch, teacher_params, cfg): `step(state, batch, teacher_params, {}, 0)[:2]`
    is the jitted (state-donating) KD train step the trainer runs."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from hldstudy.config import Config, DataConfig, DistillConfig, TrainConfig
    from hldstudy.distill.base import make_strategy
    from hldstudy.model import Transformer
    from hldstudy.teacher.colocated import teacher_forward_fn
    from hldstudy.train.optim import make_optimizer
    from hldstudy.train.program import train_program
    from hldstudy.train.step import split_params

    student_cfg, teacher_cfg = model_configs(tiny)
    b, t = shapes(tiny)
    student_cfg = dataclasses.replace(student_cfg, dtype=dtype, attention=attention)
    teacher_cfg = dataclasses.replace(teacher_cfg, dtype=dtype, attention=attention)
    cfg = Config(model=student_cfg, data=DataConfig(seq_len=t, batch_size=b),
                 train=TrainConfig(),
                 distill=DistillConfig(method="kd", loss_impl=loss_impl,
                                       temperature=TEMPERATURE, alpha=ALPHA))
    strategy = make_strategy(cfg, student_cfg, teacher_cfg)
    stage = strategy.stages()[0]
    student = Transformer(student_cfg, rngs=nnx.Rngs(seed))
    teacher = Transformer(teacher_cfg, rngs=nnx.Rngs(seed + 1))
    graphdefs, params = split_params(student, None)
    gd_t, teacher_params = nnx.split(teacher, nnx.Param)
    forward = teacher_forward_fn(gd_t, strategy.teacher_layers(stage),
                                 strategy.teacher_needs_head(stage))
    optimizer = make_optimizer(cfg.train, 1000)
    state = {"params": params, "opt_state": optimizer.init(params), "step": jnp.int32(0)}
    step = jax.jit(train_program(strategy, stage, graphdefs, optimizer, forward),
                   donate_argnums=(0,))
    tokens, targets = make_batch(student_cfg.vocab_size, b, t)
    batch = {"tokens": jnp.asarray(tokens), "targets": jnp.asarray(targets),
             "positions": jnp.tile(jnp.arange(t, dtype=jnp.int32), (b, 1)),
             "segment_ids": jnp.ones((b, t), jnp.int32), "mask": jnp.ones((b, t), jnp.float32)}
    return step, state, batch, teacher_params, cfg


def ours_worker(dtype: str, loss_impl: str, tiny: bool):
    import jax

    step, state, batch, teacher_params, _ = build_ours(dtype, loss_impl, tiny=tiny)
    t0 = time.perf_counter()
    state, metrics = step(state, batch, teacher_params, {}, 0)[:2]
    first = {k: float(v) for k, v in jax.device_get(metrics).items()}
    compile_s = time.perf_counter() - t0
    holder = {"state": state}

    def one_step():
        holder["state"], m = step(holder["state"], batch, teacher_params, {}, 0)[:2]
        jax.block_until_ready(m)
        return float(m["loss"])

    return one_step, {"compile_s": compile_s, "first_loss": first["loss"],
                      "first_nll": first.get("nll"), "first_kl": first.get("kl")}


# ---------------------------------------------------------------------------
# PyTorch + transformers.


def torch_worker(dtype: str, tiny: bool):
    import torch
    import torch.nn.functional as F
    from flax import nnx

    torch.set_num_threads(len(os.sched_getaffinity(0)))
    from transformers import AutoModelForCausalLM

    from hldstudy.model import Transformer
    from hldstudy.model.importers import export_hf

    student_cfg, teacher_cfg = model_configs(tiny)
    b, t = shapes(tiny)
    models = []
    with tempfile.TemporaryDirectory() as tmp:
        # Same parameters as ours (same seeds), through the project's HF exporter.
        for name, cfg, seed in (("student", student_cfg, 0), ("teacher", teacher_cfg, 1)):
            export_hf(Transformer(cfg, rngs=nnx.Rngs(seed)), Path(tmp) / name)
            models.append(AutoModelForCausalLM.from_pretrained(
                str(Path(tmp) / name), dtype=torch.float32, attn_implementation="sdpa"))
    student, teacher = models
    student.train()
    teacher.eval()
    for p in teacher.parameters():
        p.requires_grad_(False)
    opt = torch.optim.AdamW(student.parameters(), lr=3e-3, betas=(0.9, 0.95), weight_decay=0.1)
    tokens, targets = make_batch(student_cfg.vocab_size, b, t)
    tokens, targets = torch.from_numpy(tokens).long(), torch.from_numpy(targets).long()
    autocast = (torch.autocast("cpu", dtype=torch.bfloat16) if dtype == "bfloat16"
                else torch.autocast("cpu", enabled=False))
    vocab = student_cfg.vocab_size

    def one_step():
        with autocast:
            with torch.no_grad():
                z_t = teacher(input_ids=tokens, use_cache=False).logits
            z_s = student(input_ids=tokens, use_cache=False).logits
        z_s, z_t = z_s.float().reshape(-1, vocab), z_t.float().reshape(-1, vocab)
        nll = F.cross_entropy(z_s, targets.reshape(-1))
        kl = F.kl_div(F.log_softmax(z_s / TEMPERATURE, -1), F.log_softmax(z_t / TEMPERATURE, -1),
                      log_target=True, reduction="batchmean")
        loss = ALPHA * nll + (1 - ALPHA) * TEMPERATURE**2 * kl
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(student.parameters(), 1.0)
        opt.step()
        return float(loss.detach()), float(nll.detach()), float(kl.detach())

    t0 = time.perf_counter()
    loss, nll, kl = one_step()
    info = {"compile_s": time.perf_counter() - t0, "first_loss": loss, "first_nll": nll,
            "first_kl": kl, "torch": torch.__version__, "threads": torch.get_num_threads()}
    return (lambda: one_step()[0]), info


# ---------------------------------------------------------------------------
# Worker protocol: "step" -> one step, its seconds; "quit".


def worker_main(kind: str, dtype: str, tiny: bool, cores: int | None = None) -> None:
    if cores:  # before jax / torch size their thread pools
        os.sched_setaffinity(0, sorted(os.sched_getaffinity(0))[:cores])
    out = sys.stdout
    sys.stdout = sys.stderr  # library chatter must not corrupt the protocol
    if kind == "torch":
        one_step, info = torch_worker(dtype, tiny)
    else:
        one_step, info = ours_worker(dtype, kind.removeprefix("ours-"), tiny)
    one_step()  # warm-up (second step: caches, allocator)
    print(json.dumps({"ready": True, **info}), file=out, flush=True)
    for line in sys.stdin:
        if line.strip() != "step":
            break
        t0 = time.perf_counter()
        loss = one_step()
        print(json.dumps({"s": time.perf_counter() - t0, "loss": loss}), file=out, flush=True)


class Worker:
    def __init__(self, kind: str, dtype: str, tiny: bool, cores: int | None = None):
        self.kind, self.dtype = kind, dtype
        env = {**os.environ, "PYTHONPATH": str(REPO)}
        self.proc = subprocess.Popen(
            [sys.executable, __file__, "--worker", kind, "--dtypes", dtype]
            + (["--tiny"] if tiny else []) + ([f"--cores={cores}"] if cores else []),
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env, cwd=REPO)
        self.info = None
        self.times: list[float] = []

    def _read(self) -> dict:
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"worker {self.kind}/{self.dtype} died (exit {self.proc.wait()})")
        return json.loads(line)

    def ready(self) -> dict:
        self.info = self._read()
        return self.info

    def step(self) -> float:
        self.proc.stdin.write("step\n")
        self.proc.stdin.flush()
        s = self._read()["s"]
        self.times.append(s)
        return s

    def close(self) -> None:
        try:
            self.proc.stdin.write("quit\n")
            self.proc.stdin.close()
        except BrokenPipeError:
            pass
        self.proc.wait(timeout=60)


def loadavg() -> float:
    return os.getloadavg()[0]


def run_dtype(dtype: str, kinds: list[str], rounds: int, tiny: bool,
              cores: int | None = None) -> list[dict]:
    # Started one after another (compiles would fight for the two cores otherwise).
    workers = []
    try:
        for kind in kinds:
            w = Worker(kind, dtype, tiny, cores)
            w.ready()
            workers.append(w)
            print(f"[{dtype}] {kind} ready: {w.info}", flush=True)
        per_round = []
        for r in range(rounds):
            la = loadavg()
            times = {w.kind: w.step() for w in workers}
            per_round.append({"load1": la, **times})
            print(f"[{dtype}] round {r}: " + ", ".join(f"{k} {v:.2f}s" for k, v in times.items())
                  + f" (load {la:.1f})", flush=True)
    finally:
        for w in workers:
            w.close()
    b, t = shapes(tiny)
    rows = []
    for w in workers:
        med = statistics.median(w.times)
        ratios = [rd["torch"] / rd[w.kind] for rd in per_round] if "torch" in kinds else []
        rows.append({"impl": w.kind, "dtype": dtype, "step_s_median": med,
                     "step_s_min": min(w.times), "tokens_per_s": b * t / med,
                     "speedup_vs_torch": statistics.median(ratios) if ratios else None,
                     "speedup_vs_torch_per_round": ratios, "times": w.times,
                     "cores": cores or len(os.sched_getaffinity(0)), **w.info})
    return rows


LABELS = {"ours-fused": "hldstudy, fused KD loss (default)",
          "ours-materialized": "hldstudy, distill.loss_impl=materialized",
          "torch": "PyTorch + transformers Gemma3ForCausalLM (sdpa)"}


def write_results(rows: list[dict], meta: dict, stem: str) -> str:
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / f"{stem}.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=2))
    lines = [
        f"KD train step, paper-123m student (18 x d640, V {meta['vocab']}) + 6-layer d256 "
        f"teacher, batch {meta['batch']} x seq {meta['seq']}, forward KL tau {TEMPERATURE} + NLL, "
        f"AdamW. CPU: {meta['cpu']} ({meta['cores']} cores, shared; 1-min load "
        f"{meta['load_start']:.1f} at start). jax {meta['jax']}, torch {meta.get('torch')}. "
        f"{meta['rounds']} interleaved rounds; speedup = median over rounds of "
        "torch step / our step (same round).", "",
        "| implementation | dtype | cores | step s (median) | tokens/s | speedup vs torch | first loss |",
        "|---|---|---:|---:|---:|---:|---:|"]
    for r in rows:
        sp = "—" if r["speedup_vs_torch"] is None else f"{r['speedup_vs_torch']:.2f}x"
        lines.append(f"| {LABELS.get(r['impl'], r['impl'])} | {r['dtype']} | {r['cores']} | "
                     f"{r['step_s_median']:.2f} | {r['tokens_per_s']:.0f} | {sp} | "
                     f"{r['first_loss']:.4f} |")
    md = "\n".join(lines) + "\n"
    (RESULTS / f"{stem}.md").write_text(md)
    return md


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--dtypes", default="float32,bfloat16")
    p.add_argument("--impls", default="ours-fused,ours-materialized,torch")
    p.add_argument("--tiny", action="store_true", help="tiny models (smoke test)")
    p.add_argument("--cores", type=int, default=None,
                   help="pin every worker to this many cores (threads follow); default: all. "
                        "1 core = one thread each: no OpenMP/Eigen barrier spinning when "
                        "other jobs share the machine")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        worker_main(args.worker, args.dtypes, args.tiny, args.cores)
        return
    missing = [m for m in ("torch", "transformers") if importlib.util.find_spec(m) is None]
    if missing:
        print(f"peer_torch: skipped, {' and '.join(missing)} not installed "
              "(pip install -e '.[parity]')")
        return
    import jax
    import torch

    cpu = "cpu"
    try:
        cpu = next(line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo")
                   if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    b, t = shapes(args.tiny)
    meta = {"batch": b, "seq": t, "vocab": model_configs(args.tiny)[0].vocab_size,
            "cpu": cpu, "cores": os.cpu_count(), "jax": jax.__version__,
            "torch": torch.__version__, "rounds": args.rounds, "load_start": loadavg(),
            "tiny": args.tiny, "cores_arg": args.cores}
    rows = []
    impls = args.impls.split(",")
    for dtype in args.dtypes.split(","):
        kinds = [k for k in impls if not (dtype == "bfloat16" and k == "ours-materialized")]
        rows += run_dtype(dtype, kinds, args.rounds, args.tiny, args.cores)
    meta["load_end"] = loadavg()
    stem = "peer_torch" + ("_tiny" if args.tiny else "") + (f"_{args.cores}core" if args.cores else "")
    print(write_results(rows, meta, stem))


if __name__ == "__main__":
    main()
