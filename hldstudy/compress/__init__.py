"""Compression after distillation: 2:4 pruning (magnitude, Wanda, SparseGPT),
recovery distillation with masks held, FP8 weights, export, per-stage report.

    python -m hldstudy.compress --checkpoint RUN --prune sparsegpt-2:4 \
        --recover-steps 100 --quantize fp8 --out DIR

Pure math lives in `sparse` (masks, scores, SparseGPT) and `fp8` (quantize,
bounds, FP8 dot); `prune` applies it to a model layer by layer; `recover`
holds masks (and the FP8 grid) during training with the suite's Trainer;
`export` writes safetensors and run directories; `pipeline` runs the stages.
"""
