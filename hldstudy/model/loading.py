"""One loader for every checkpoint a path can name: an hldstudy run directory, a Gemma
GGUF file or a Hugging Face safetensors directory.

    load_model(path, step=None) -> LoadedModel(model, tokenizer, config, kind, source)
    model_config_of(path) -> ModelConfig | None   (reads the config only, no weights)

The teacher (colocated and served), evaluation, sweeps and the FLOP CLI all
load through here, so "what a path means" is decided once. Local paths only.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import jax
from flax import nnx

from hldstudy import rundir
from hldstudy.checkpoint import restore_partial
from hldstudy.config import Config, ModelConfig
from hldstudy.data.tokenizer import Tokenizer
from hldstudy.errors import InputError
from hldstudy.model import importers
from hldstudy.model.presets import preset
from hldstudy.model.transformer import Transformer
from hldstudy.teacher_source import is_remote


@dataclass
class LoadedModel:
    model: Transformer
    tokenizer: Tokenizer | None  # None when the checkpoint carries none
    config: Config | None  # the run's resolved config (run directories only)
    kind: str  # "run" | "gguf" | "hf"
    source: str  # the path as given
    step: int | None = None  # a run's checkpoint step that was read
    skipped: dict | None = None  # newer steps of the run that could not be read: {step: why}


def _is_run(path: Path) -> bool:
    """An hldstudy run directory, trained or not: config.json is an hldstudy config (a
    Hugging Face config.json names a `model_type`; ours has a `model` section)."""
    if rundir.is_run_dir(path):
        return True
    cfg_file = path / rundir.CONFIG_FILE
    if not (path.is_dir() and cfg_file.is_file()):
        return False
    try:
        raw = json.loads(cfg_file.read_text())
    except ValueError:
        return False
    return isinstance(raw, dict) and isinstance(raw.get("model"), dict) and "model_type" not in raw


def load_run_model(run_dir: str | Path, step: int | None = None
                   ) -> tuple[Config, Transformer, int, dict]:
    """(Config, Transformer, the step read, {newer step skipped: why}) from a run
    directory's latest restorable (or given) checkpoint.

    Reads only the student's parameters (no optimizer state), onto the first
    local device; the result is an ordinary NNX module.
    """
    run_dir = Path(run_dir)
    cfg = rundir.read_config(run_dir)
    abstract = nnx.eval_shape(lambda: Transformer(cfg.model, rngs=nnx.Rngs(0)))
    graphdef, abstract_params = nnx.split(abstract, nnx.Param)
    device = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
    target = {"params": {"student": jax.tree_util.tree_map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=device), abstract_params)}}
    restored = restore_partial(run_dir / rundir.CHECKPOINTS_DIR, target, step)
    model = nnx.merge(graphdef, restored.state["params"]["student"])
    return cfg, model, restored.step, restored.skipped


def load_model(path: str | Path, step: int | None = None) -> LoadedModel:
    """The model behind `path`, its tokenizer (None if it has none) and, for a run
    directory, its config. `step` picks a run's checkpoint (default: the latest)."""
    source = str(path)
    path = Path(path)
    if not path.exists():
        raise InputError(f"{source} does not exist (give an hldstudy run directory, a .gguf "
                         "file or a Hugging Face directory)")
    if _is_run(path):
        cfg, model, used, skipped = load_run_model(path, step)
        tok = rundir.tokenizer_path(path, cfg)
        return LoadedModel(model, Tokenizer.load(tok) if tok else None, cfg, "run", source,
                           used, skipped)
    kind = importers.checkpoint_format(path)
    model, tokenizer = importers.load_pretrained(path)
    return LoadedModel(model, tokenizer, None, kind, source)


def model_config_of(path: str | Path | None) -> ModelConfig | None:
    """The ModelConfig of the checkpoint at `path`, reading only its config (a run's
    config.json, an HF config.json, a GGUF header). None for no path, a remote:// address
    or a path that does not exist (yet); InputError for a path that is no checkpoint."""
    if not path or is_remote(str(path)):
        return None
    path = Path(path)
    if not path.exists():
        return None
    if _is_run(path):
        return rundir.read_config(path).model
    if importers.checkpoint_format(path) == "gguf":
        return importers.gguf_model_config(path)
    return importers.hf_model_config(path)


def teacher_model_config(checkpoint: str | None, preset_name: str | None) -> ModelConfig | None:
    """The teacher's ModelConfig, read from its checkpoint (`model_config_of`: a run
    directory, an HF directory, a GGUF header), else the named preset (a teacher not
    trained or downloaded yet: `teacher.preset`); None when nothing says."""
    try:
        model = model_config_of(checkpoint)
    except InputError:  # not a checkpoint (yet): count with the preset
        model = None
    if model is None and preset_name:
        model = preset(preset_name)
    return model
