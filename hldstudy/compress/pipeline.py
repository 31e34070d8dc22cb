"""The compression pipeline: dense -> 2:4 prune -> recover -> FP8, evaluated at every stage.

Design notes: `docs/compression.md`, under this file's name.
"""

from __future__ import annotations

import math
import os
import shutil
import time
import uuid
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from hldstudy.compress import data as cdata
from hldstudy.compress import fp8 as fp8_lib
from hldstudy.compress import hf_export
from hldstudy.compress.config import (
    CompressConfig,
    prune_names,
    to_dict,
    validate,
    write_json_atomic,
)
from hldstudy.compress.export import _param_items, save_run_dir, save_safetensors
from hldstudy.compress.fp8_forward import fp8_model
from hldstudy.compress.layout import Target, targets
from hldstudy.compress.prune import (
    check_prunable,
    masks_from_zeros,
    parse_prune,
    prune_model,
    sparsity_report,
)
from hldstudy.compress.recover import recover
from hldstudy.data import prepare_data
from hldstudy.data.pipeline import make_batches
from hldstudy.errors import ConfigError, InputError
from hldstudy.losses.kd import nll_per_token
from hldstudy.model.loading import load_model, model_config_of

NO_SPEEDUP = ("No speed-up is claimed: the 2:4 weights are stored and multiplied as dense "
              "matrices with zeros (no 2:4 sparse kernel runs on CPU, and JAX has none today), "
              "and FP8 is simulated on CPU (weights dequantized to float32 before each matmul). "
              "`weight_bytes_packed` is what a 2:4 + FP8 kernel would read, not a measured gain.")


def _load(path):
    """(model, tokenizer, config, which checkpoint was read) of any checkpoint the suite's
    loader reads; the last is {"step", "skipped": {newer step: why}} for a run directory
    (a damaged newest step falls back to the one before), else None."""
    loaded = load_model(path)
    read_from = (None if loaded.step is None else
                 {"step": loaded.step, "skipped": {str(k): v for k, v in loaded.skipped.items()}})
    return loaded.model, loaded.tokenizer, loaded.config, read_from


# --------------------------------------------------------------------------- #
# Measurements
# --------------------------------------------------------------------------- #


def weight_bytes(model, *, sparse_keys=(), quantized=None, nm=(2, 4)) -> dict:
    """{weight_bytes, weight_bytes_packed} of one forward's weights (see module doc)."""
    quantized = quantized or {}
    # per parameter: (elements stored in FP8, scale bytes, elements in N:M matrices)
    fp8_n: dict[str, int] = {}
    scales: dict[str, int] = {}
    sparse_n: dict[str, int] = {}
    for key, (q, s) in quantized.items():
        pk = Target.from_key(key).param_key
        fp8_n[pk] = fp8_n.get(pk, 0) + int(np.asarray(q).size)
        scales[pk] = scales.get(pk, 0) + 4 * int(np.asarray(s).size)
    for key in sparse_keys:
        t = Target.from_key(key)
        size = int(np.prod(t.param(model)[...].shape[1 if t.expert is not None else 0:]))
        sparse_n[t.param_key] = sparse_n.get(t.param_key, 0) + size
    stored = packed = 0
    for key, value in _param_items(model).items():
        n = int(np.prod(value.shape))
        wide = jnp.dtype(value.dtype).itemsize
        n8 = fp8_n.get(key, 0)
        stored += n8 + (n - n8) * wide + scales.get(key, 0)
        ns = sparse_n.get(key, 0)
        width = 1 if n8 else wide  # a parameter is quantized whole (every expert) or not
        kept = ns * nm[0] // nm[1]
        index_bits = kept * math.ceil(math.log2(nm[1]))
        packed += (n - ns) * width + kept * width + index_bits // 8 + scales.get(key, 0)
    return {"weight_bytes": int(stored), "weight_bytes_packed": int(packed)}


BATCH_FIELDS = ("tokens", "positions", "segment_ids", "targets", "mask")


def nll_program(model):
    """(jitted f(state, *batch[BATCH_FIELDS]) -> (summed NLL, tokens), the model's state):
    the program every stage's perplexity runs."""
    graphdef, state = nnx.split(model)

    @jax.jit
    def f(state, tokens, positions, segment_ids, targets_, mask):
        m = nnx.merge(graphdef, state)
        logits = m(tokens, positions, segment_ids).logits
        nll = nll_per_token(logits, targets_)
        valid = mask > 0
        return jnp.sum(jnp.where(valid, nll, 0.0)), jnp.sum(valid.astype(jnp.float32))

    return f, state


def _make_nll(model):
    f, state = nll_program(model)
    return lambda b: f(state, *(jnp.asarray(b[k]) for k in BATCH_FIELDS))


def valid_perplexity(model, batches) -> dict:
    """Token-weighted NLL over the validation batches, as the trainer's evaluation."""
    f = _make_nll(model)
    total = count = 0.0
    for b in batches:
        s, c = f(b)
        total += float(s)
        count += float(c)
    if count == 0:
        raise InputError("the checkpoint's data has no validation tokens to evaluate on")
    nll = total / count
    return {"valid_nll": nll, "valid_ppl": math.exp(min(nll, 700.0)), "valid_tokens": int(count)}


def downstream(model, tokenizer, run_cfg, tasks: str, limit: int) -> dict:
    from hldstudy.eval import evaluate
    from hldstudy.eval.adapter import HLDStudyLM

    lm = HLDStudyLM(model=model, tokenizer=tokenizer,
                    max_length=min(run_cfg.data.seq_len, model.cfg.max_seq_len),
                    add_bos=run_cfg.data.add_bos, batch_size=16, progress=False)
    lm.config = run_cfg  # synthetic tasks read the corpus seed from the run's config
    res = evaluate(None, tasks, lm=lm, limit=limit or None, wandb=False, progress=False)
    out = {}
    for task, metrics in res.items():
        for name, v in metrics.items():
            if not name.endswith("_stderr"):
                out[f"{task}/{name}"] = v
    return out


# --------------------------------------------------------------------------- #
# Stages
# --------------------------------------------------------------------------- #


def quantize_model(model, names, fmt: str, granularity: str) -> dict:
    """Rounds every target matrix onto its FP8 grid in place (the model then holds the
    dequantized float32 values); returns {key: (q, scale)} for the export."""
    out = {}
    for t in targets(model, names):
        q, s = fp8_lib.quantize_fp8(t.get2d(model), fmt, granularity)
        t.set2d(model, fp8_lib.dequantize_fp8(q, s))
        out[t.key] = (q, s)
    return out


def calibration_batches(ccfg: CompressConfig, data, tokenizer, workdir: Path) -> list[dict]:
    """The first calibration batches of the source's training stream (enough for
    `calibration_tokens`, else `calibration_batches`), checked to hold the tokens asked."""
    dc = cdata.calibration_config(ccfg, data)
    try:
        stream = make_batches(dc, tokenizer, dc.train_split, workdir)
        batches = [stream.batch_at(i) for i in range(cdata.n_batches(ccfg, dc))]
    except (InputError, ConfigError, FileNotFoundError, IndexError, StopIteration) as e:
        raise cdata.read_error(e) from None
    cdata.check_tokens(ccfg, stream, batches)
    return batches


def evaluated_model(model, quantized: dict):
    """The model a stage is evaluated as: with FP8 weights (`quantized`), the FP8 forward
    (the real FP8 dot where the chip has one); else the model itself."""
    return fp8_model(model, quantized) if quantized else model


def _stage(name: str, model, *, valid, sparse_keys, quantized, nm, ccfg, tokenizer, run_cfg,
           extra=None) -> dict:
    t0 = time.time()
    forward = evaluated_model(model, quantized)
    rec = {"stage": name, **valid_perplexity(forward, valid)}
    if ccfg.eval:
        rec.update(downstream(forward, tokenizer, run_cfg, ccfg.eval, ccfg.eval_limit))
    del forward
    rec.update(weight_bytes(model, sparse_keys=sparse_keys, quantized=quantized, nm=nm))
    sp = sparsity_report(model, prune_names(ccfg))
    rec["sparsity"] = sp["sparsity"]
    rec["is_2_4"] = sp["is_2_4"] if sparse_keys else False
    rec["eval_seconds"] = round(time.time() - t0, 1)
    rec.update(extra or {})
    return rec


def preflight(ccfg: CompressConfig):
    """Everything checkable before compute. Returns (model, tokenizer, run_cfg or None,
    which checkpoint step was read or None)."""
    validate(ccfg)
    check_out(Path(ccfg.out))
    path = Path(ccfg.checkpoint)
    if not path.exists():
        raise ConfigError("compress.checkpoint", f"{path} does not exist",
                          "give an hldstudy run directory, a GGUF file or a Hugging Face "
                          "directory")
    if ccfg.export:
        hf_export.check_available()
    model, tokenizer, run_cfg, read_from = _load(path)
    if tokenizer is None:
        where = ("its tokenizer.model" if run_cfg is not None else
                 "tokenizer metadata in the GGUF file" if path.is_file() else
                 "tokenizer.model or tokenizer.json in the directory")
        raise ConfigError("compress.checkpoint", f"{path}: no tokenizer found (looked for "
                          f"{where})", "calibration and evaluation tokenize with the "
                          "checkpoint's own tokenizer: put it beside the weights")
    if tokenizer.vocab_size > model.cfg.vocab_size:
        raise ConfigError("compress.checkpoint", f"{path}: its tokenizer has "
                          f"{tokenizer.vocab_size} tokens and the model's vocabulary "
                          f"{model.cfg.vocab_size}: tokens past the embedding cannot be read",
                          "put the model's own tokenizer beside the weights")
    if run_cfg is None and ccfg.calibration_data is None:
        cdata.data_config(ccfg, None, tokenizer_file="", add_bos=False)  # raises: no source
    seq_len = ccfg.calibration_seq_len or (run_cfg.data.seq_len if run_cfg else 0)
    if seq_len > model.cfg.max_seq_len:
        raise ConfigError("compress.calibration_seq_len",
                          f"{seq_len} exceeds model.max_seq_len={model.cfg.max_seq_len}")
    names = prune_names(ccfg)
    if ccfg.prune:
        method, _, m = parse_prune(ccfg.prune)
        check_prunable(model, m, names)
        if method in ("wanda", "sparsegpt") and ccfg.calibration_batches == 0 \
                and ccfg.calibration_tokens == 0:
            raise ConfigError("compress.calibration_batches",
                              f"{method} needs calibration data and 0 batches were asked for",
                              "pass --calibration-batches N with N > 0")
    recovering = ccfg.recover_steps > 0 or ccfg.recover_flops > 0
    if recovering and ccfg.teacher:
        tcfg = model_config_of(ccfg.teacher)
        if tcfg is None:
            raise ConfigError("compress.teacher", f"{ccfg.teacher} does not exist",
                              "give a run directory, GGUF file or HF directory")
        if tcfg.vocab_size != model.cfg.vocab_size:
            raise ConfigError("compress.teacher",
                              f"the teacher's vocabulary ({tcfg.vocab_size}) is not the "
                              f"student's ({model.cfg.vocab_size}); logit KD needs one "
                              "vocabulary", "pick a teacher trained with the student's tokenizer")
    return model, tokenizer, run_cfg, read_from


def _tokenizer_file(tokenizer, run_cfg, checkpoint: str, work: Path) -> Path:
    """A file holding the checkpoint's tokenizer (the data pipeline loads by path); a
    tokenizer rebuilt from GGUF metadata is written under `work`."""
    own = getattr(tokenizer, "model_path", None)
    if own is not None and Path(own).is_file():
        return Path(own)
    if run_cfg is not None and run_cfg.data.tokenizer:
        return Path(run_cfg.data.tokenizer)
    if run_cfg is not None:
        return Path(checkpoint) / "tokenizer.model"
    work.mkdir(parents=True, exist_ok=True)
    name = "tokenizer.json" if type(tokenizer).__name__ == "JsonTokenizer" else "tokenizer.model"
    (work / name).write_bytes(tokenizer.serialized())
    return work / name


def check_out(out: Path) -> None:
    """--out is absent or an empty directory, and can be made; makes nothing."""
    for parent in (out, *out.parents):
        if parent.exists() and not parent.is_dir():
            raise ConfigError("compress.out", f"{parent} is a file, not a folder",
                              "give --out a new or empty directory")
    if out.is_dir() and any(out.iterdir()):
        raise ConfigError("compress.out", f"{out} is not empty",
                          "give a new or empty directory; an earlier output is never "
                          "overwritten")
    base = next(p for p in (out.absolute(), *out.absolute().parents) if p.exists())
    if not os.access(base, os.W_OK | os.X_OK):
        raise ConfigError("compress.out", f"{out} cannot be made ({base} is not writable)",
                          "give a directory you can write to")


def run(ccfg: CompressConfig) -> dict:
    """Checks everything (`preflight`), then compresses into a temporary sibling of
    `ccfg.out`, renamed onto it when complete (see the module doc)."""
    loaded = preflight(ccfg)
    out = Path(ccfg.out).absolute()
    made = [p for p in out.parents if not p.exists()]
    out.parent.mkdir(parents=True, exist_ok=True)
    partial = out.parent / f".{out.name}.partial-{uuid.uuid4().hex[:12]}"
    partial.mkdir()
    try:
        report = _run_into(ccfg, partial, *loaded)
        if out.is_dir():
            out.rmdir()  # empty (checked in preflight); a file put there since fails here
        os.rename(partial, out)
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        for d in made:  # the parents this run made, deepest first
            try:
                d.rmdir()
            except OSError:
                break
        raise
    return report


def _compress_run_config(ccfg: CompressConfig, work: Path, model, tokenizer, run_cfg):
    """(run config, tokenizer file) that calibration, evaluation and recovery read."""
    tok_file = _tokenizer_file(tokenizer, run_cfg, ccfg.checkpoint, work)
    add_bos = run_cfg.data.add_bos if run_cfg is not None else tokenizer.bos_id >= 0
    data_cfg = cdata.data_config(ccfg, run_cfg.data if run_cfg is not None else None,
                                 tokenizer_file=str(tok_file), add_bos=add_bos)
    return cdata.run_config(ccfg, run_cfg, model.cfg, data_cfg), tok_file


def _compress_data(ccfg: CompressConfig, work: Path, run_cfg):
    """(data bundle, validation batches): what every stage is measured and recovered on."""
    try:
        bundle = prepare_data(run_cfg.data, work)
        valid = bundle.valid_batches(ccfg.eval_batches or None)
    except (InputError, FileNotFoundError) as e:
        if ccfg.calibration_data is None:
            raise
        raise cdata.read_error(e) from None
    if not valid:
        where = (f"{ccfg.calibration_data} has too few documents to hold any out"
                 if ccfg.calibration_data else f"{ccfg.checkpoint}: its data section has no "
                 "validation split")
        raise ConfigError(cdata.FIELD if ccfg.calibration_data else "compress.checkpoint", where)
    return bundle, valid


def _save_final(ccfg: CompressConfig, out: Path, model, run_cfg, tokenizer, tok_file,
                final: str, quantized: dict, sparse_keys: tuple, nm: tuple):
    """The final model as safetensors and as a run directory, and the export asked for;
    returns the export's record (None without one)."""
    save_safetensors(model, out / "model.safetensors", quantized=quantized,
                     sparse_keys=sparse_keys, nm=nm,
                     fp8_format=ccfg.fp8_format if quantized else None,
                     granularity=ccfg.fp8_granularity if quantized else None,
                     extra={"stage": final, "source": str(ccfg.checkpoint)})
    save_run_dir(model, run_cfg, out / "model", tokenizer_file=tok_file,
                 meta={"compressed_stage": final})
    if ccfg.export == hf_export.FORMAT_NAME:
        return hf_export.write(model, tokenizer, quantized, sparse_keys, nm,
                               out / hf_export.FORMAT_NAME)
    return None


def _run_into(ccfg: CompressConfig, out: Path, model, tokenizer, run_cfg,
              read_from: dict | None = None) -> dict:
    write_json_atomic(out / "config.json", to_dict(ccfg))
    work = out / "work"
    names = prune_names(ccfg)
    method = n = m = None
    if ccfg.prune:
        method, n, m = parse_prune(ccfg.prune)
    run_cfg, tok_file = _compress_run_config(ccfg, work, model, tokenizer, run_cfg)
    calib = None
    if method in ("wanda", "sparsegpt"):
        calib = calibration_batches(ccfg, run_cfg.data, tokenizer, work)
    bundle, valid = _compress_data(ccfg, work, run_cfg)
    nm = (n or 2, m or 4)
    common = dict(valid=valid, nm=nm, ccfg=ccfg, tokenizer=tokenizer, run_cfg=run_cfg)
    stages = []
    timings = {}
    sparse_keys: tuple[str, ...] = ()
    quantized: dict = {}
    recovering = ccfg.recover_steps > 0 or ccfg.recover_flops > 0
    quant = (ccfg.fp8_format, ccfg.fp8_granularity) if ccfg.quantize else None
    # dense, pruned, FP8 in the loop, recovered, FP8 after: the last one is the final model
    planned = 1 + bool(method) + bool(quant) + recovering
    # where each stage's model can be read (relative paths are inside `out`)
    stage_models: dict[str, str] = {}

    def log(rec):
        stages.append(rec)
        if ccfg.progress:
            print(f"[compress] {rec['stage']}: valid ppl {rec['valid_ppl']:.4f}, "
                  f"{rec['weight_bytes']:,} B ({rec['weight_bytes_packed']:,} B packed), "
                  f"sparsity {rec['sparsity']:.3f}", flush=True)
        if len(stages) == 1:
            stage_models[rec["stage"]] = str(Path(ccfg.checkpoint).absolute())
        elif len(stages) == planned:
            stage_models[rec["stage"]] = "model"
        elif ccfg.save_stages:
            save_run_dir(model, run_cfg, out / "stages" / rec["stage"], tokenizer_file=tok_file,
                         meta={"compressed_stage": rec["stage"]})
            stage_models[rec["stage"]] = f"stages/{rec['stage']}"
        _write_report(out, ccfg, stages, timings, stage_models=stage_models,
                      read_from=read_from)

    log(_stage("dense", model, sparse_keys=(), quantized={}, **common))
    masks = {}
    if method:
        t0 = time.time()
        masks = prune_model(model, method, calib, n=n, m=m, names=names,
                            blocksize=ccfg.blocksize, percdamp=ccfg.percdamp,
                            progress=ccfg.progress)
        timings["prune_seconds"] = round(time.time() - t0, 1)
        sparse_keys = tuple(sorted(masks))
        log(_stage(f"{method}-{n}:{m}", model, sparse_keys=sparse_keys, quantized={}, **common))
    qname = f"fp8-{ccfg.fp8_format}-{ccfg.fp8_granularity}"

    def do_quantize(label):
        nonlocal quantized
        quantized = quantize_model(model, names, *quant)
        log(_stage(label, model, sparse_keys=sparse_keys, quantized=quantized, **common))

    if quant and ccfg.quantize_in_loop:
        do_quantize(qname)
    if recovering:
        teacher_path = ccfg.teacher or str(Path(ccfg.checkpoint).absolute())
        if not masks:
            masks = masks_from_zeros(model, names) if method else {}
        t0 = time.time()
        in_loop = quant if ccfg.quantize_in_loop else None
        model, result = recover(model, masks, run_cfg, ccfg, teacher_path=teacher_path,
                                data=bundle, workdir=out / "recover", quant=in_loop)
        timings["recover_seconds"] = round(time.time() - t0, 1)
        held = all(not np.any(np.asarray(Target.from_key(k).get2d(model))[~np.asarray(mk)])
                   for k, mk in masks.items())
        label = f"recovered-{ccfg.method}-{ccfg.divergence}"
        if in_loop:
            label += f"-{qname}-in-loop"
            quantized = quantize_model(model, names, *quant)  # exact grid values for export
        log(_stage(label, model, sparse_keys=sparse_keys, quantized=quantized, **common,
                   extra={"recover_steps": result.get("steps"),
                          "recover_flops": result.get("flops_spent"),
                          "teacher": teacher_path, "masks_held": bool(held)}))
    if quant and not ccfg.quantize_in_loop:
        do_quantize(qname)

    exported = _save_final(ccfg, out, model, run_cfg, tokenizer, tok_file, stages[-1]["stage"],
                           quantized, sparse_keys, nm)
    return _write_report(out, ccfg, stages, timings, exported, stage_models=stage_models,
                         read_from=read_from)


def _write_report(out: Path, ccfg: CompressConfig, stages: list[dict], timings: dict,
                  exported: dict | None = None, *, stage_models: dict | None = None,
                  read_from: dict | None = None) -> dict:
    """read_from: the run's checkpoint step that was compressed and the newer ones that
    could not be read (`_load`)."""
    report = {"checkpoint": str(ccfg.checkpoint), "prune": ccfg.prune, "export": exported,
              "checkpoint_step": None if read_from is None else read_from["step"],
              "skipped_steps": {} if read_from is None else read_from["skipped"],
              "quantize": ccfg.quantize, "stages": stages, "seconds": timings,
              "stage_models": dict(stage_models or {}),
              "note": NO_SPEEDUP, "backend": jax.default_backend(),
              "fp8_matmul_hardware": fp8_lib.backend_has_fp8_matmul()}
    write_json_atomic(out / "report.json", report)
    (out / "report.md").write_text(render(report))
    return report


def render(report: dict) -> str:
    stages = report["stages"]
    base = stages[0]["valid_ppl"] if stages else None
    extra = sorted({k for s in stages for k in s if k.endswith(("/acc", "/acc_norm"))})
    head = ("| stage | valid ppl | vs dense | weight bytes | packed 2:4 bytes | sparsity | 2:4 | "
            + "".join(f"{k} | " for k in extra))
    lines = [f"# Compression of `{report['checkpoint']}`", ""]
    if report.get("checkpoint_step") is not None:
        skipped = "; ".join(f"step {k} could not be read ({v})"
                            for k, v in report.get("skipped_steps", {}).items())
        lines += [f"From its checkpoint of step {report['checkpoint_step']}"
                  + (f" (the newer: {skipped})" if skipped else "") + ".", ""]
    lines += [head,
             "|---|---:|---:|---:|---:|---:|:-:|" + "---:|" * len(extra)]
    for s in stages:
        rel = f"{100 * (s['valid_ppl'] / base - 1):+.2f}%" if base else "-"
        lines.append(f"| {s['stage']} | {s['valid_ppl']:.4f} | {rel} | {s['weight_bytes']:,} | "
                     f"{s['weight_bytes_packed']:,} | {s['sparsity']:.3f} | "
                     f"{'yes' if s.get('is_2_4') else '-'} | "
                     + "".join(f"{s.get(k, float('nan')):.4f} | " for k in extra))
    lines += ["", report["note"], "",
              f"Backend: {report['backend']}; FP8 matmul hardware: "
              f"{'yes' if report['fp8_matmul_hardware'] else 'no (simulated)'}."]
    return "\n".join(lines) + "\n"
