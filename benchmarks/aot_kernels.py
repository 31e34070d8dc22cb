"""Compile the fused-KD kernels, with the blocks `auto` chooses, for named targets.

    JAX_PLATFORMS=cpu python benchmarks/aot_kernels.py --targets v5e:2x2,v4:2x2x1,h100:1

Needs the `aot` extra (libtpu, the JAX CUDA plugin: pip install -e '.[aot]') and
`hldstudy.aot` (its targets). For each target x dtype x head shape (d, V) it asks
`kernel_blocks.for_target` for the blocks and limits, compiles every kernel of the
chip's family with the target's own compiler (no device) and writes one table
row per kernel: compiles or not (the compiler's reason when not), the on-chip
memory the block model gives (Mosaic: scoped VMEM, held above what libtpu reports
by tests/test_aot_kernels.py; Triton: pipelined shared memory) and the limit
(Mosaic: the `vmem_limit_bytes` the kernels set; Triton: the chip's shared memory
per block). Writes benchmarks/results/aot_kernels.{json,md}.

The choice depends on d and dtype, not on V (every study V is many blocks wide):
V changes the grid's length only.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")  # the CUDA plugin initialises only so

import jax.numpy as jnp  # noqa: E402
from jax.sharding import SingleDeviceSharding  # noqa: E402

from hldstudy.fileio import write_text_atomic  # noqa: E402
from hldstudy.losses import kernel_blocks, kernel_cases  # noqa: E402

STUDY_DIMS = (640, 1152, 2304, 2560)
STUDY_VOCABS = (32768, 128256, 256000, 262144)
DTYPES = ("float32", "bfloat16")
RESULTS = Path(__file__).resolve().parent / "results"


def _mib(n: int) -> str:
    return f"{n / 2**20:.2f} MiB" if n >= 2**20 else f"{n / 1024:.0f} KiB"


def rows_for_target(spec: str, dims, vocabs, dtypes, n_row_blocks: int = 4) -> list[dict]:
    from hldstudy.aot import targets

    target = targets.parse_target(spec)
    device = targets.devices(target)[0]
    sharding = SingleDeviceSharding(device)
    chip = target.chip
    rows = []
    for dtype in dtypes:
        for d in dims:
            for vocab in vocabs:
                try:
                    blocks = kernel_blocks.for_target(chip, d, vocab, jnp.dtype(dtype))
                except kernel_blocks.BlocksDoNotFit as e:  # auto takes the XLA path here
                    row = dict(target=spec, chip=chip.name, kernel="-", family="xla (auto)",
                               dtype=dtype, d=d, vocab=vocab, row_block=0, vocab_block=0,
                               compiles=None, refusal=str(e), onchip_model_bytes=0,
                               limit_bytes=0, seconds=0.0)
                    print(json.dumps(row), flush=True)
                    rows.append(row)
                    continue
                if blocks.family == "mosaic":
                    limit = blocks.vmem_limit_bytes
                else:
                    limit = chip.onchip_bytes
                for kernel in kernel_cases.KERNELS[blocks.family]:
                    if blocks.family == "mosaic":
                        need = kernel_blocks.mosaic_vmem_bytes(kernel, blocks.row_block,
                                                               blocks.vocab_block, d, d, dtype)
                    else:
                        need = kernel_blocks.triton_smem_bytes(blocks.row_block,
                                                               blocks.vocab_block, d, dtype)
                    fn, specs = kernel_cases.kernel_case(
                        kernel, blocks, d_s=d, d_t=d, vocab=vocab, dtype=jnp.dtype(dtype),
                        n_rows=n_row_blocks * blocks.row_block, sharding=sharding)
                    ok, why, seconds = kernel_cases.compile_case(fn, specs)
                    row = dict(target=spec, chip=chip.name, kernel=kernel, family=blocks.family,
                               dtype=dtype, d=d, vocab=vocab, row_block=blocks.row_block,
                               vocab_block=blocks.vocab_block, compiles=ok, refusal=why,
                               onchip_model_bytes=need, limit_bytes=limit,
                               seconds=round(seconds, 1))
                    print(json.dumps(row), flush=True)
                    rows.append(row)
    return rows


def markdown(rows: list[dict]) -> str:
    head = ("| target | kernel | dtype | d | V | blocks | compiles | on-chip (model) | limit |\n"
            "|---|---|---|---|---|---|---|---|---|\n")
    def verdict(r):
        if r["compiles"] is None:  # no Mosaic block fits: auto does not choose the kernels
            return "not chosen: no block fits, auto takes the XLA path"
        return "yes" if r["compiles"] else "NO: " + r["refusal"]

    body = "".join(
        f"| {r['target']} | {r['kernel']} ({r['family']}) | {r['dtype']} | {r['d']} | {r['vocab']} "
        f"| {r['row_block']}x{r['vocab_block']} | {verdict(r)} "
        f"| {_mib(r['onchip_model_bytes'])} | {_mib(r['limit_bytes'])} |\n" for r in rows)
    return head + body


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--targets", default="v5e:2x2,v4:2x2x1,h100:1")
    p.add_argument("--dims", default=",".join(map(str, STUDY_DIMS)))
    p.add_argument("--vocabs", default=",".join(map(str, STUDY_VOCABS)))
    p.add_argument("--dtypes", default=",".join(DTYPES))
    p.add_argument("--out", default=str(RESULTS / "aot_kernels"))
    a = p.parse_args(argv)
    ints = lambda text: tuple(int(x) for x in text.split(","))
    rows = []
    for spec in a.targets.split(","):
        rows += rows_for_target(spec, ints(a.dims), ints(a.vocabs), tuple(a.dtypes.split(",")))
    out = Path(a.out)
    write_text_atomic(out.with_suffix(".json"), json.dumps(rows, indent=1) + "\n")
    write_text_atomic(out.with_suffix(".md"), markdown(rows))
    print(markdown(rows))
    return 0 if all(r["compiles"] is not False for r in rows) else 3


if __name__ == "__main__":
    raise SystemExit(main())
