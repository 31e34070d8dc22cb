"""A new grid axis is one line in hldstudy/config.py: the package is copied, one `knob`
line is added to its DistillConfig (checked to be the whole difference), and a fresh
interpreter on that copy shows the field flowing into a sweep's keywords, axes and run
ids, the cohort's traced hyperparameters (trained: each member's loss is scaled by its
own value inside one compiled step), and the analysis' columns and folder-name reader.

Which methods use the field is the method's declaration, and what it does is the loss'
code: here a method declared in the script (as tests/test_registry.py declares one)
whose loss is `kd_scale x` logit KD."""

import difflib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import hldstudy

LINE = '    kd_scale: float = knob(1.0, domain=POSITIVE, member="traced", axis=8, short="ks")'
ANCHOR = "class DistillConfig:\n"

# Run in the copy. Registers the method that uses the new field, then reports what the
# suite made of the field as one JSON object on the last line of stdout.
SCRIPT = r'''
import json, sys
from pathlib import Path

import hldstudy
from hldstudy.config import Config, DataConfig, TrainConfig, flatten, config_to_dict
from hldstudy.distill import methods
from hldstudy.distill.base import Strategy
from hldstudy.distill.methods import KD_FIELDS, MethodSpec, StageSpec


class ScaledKD(Strategy):
    """Logit KD scaled by distill.kd_scale (read from the config the cohort hands it)."""

    def loss(self, stage, student, aux, batch, teacher):
        loss, metrics = super().loss(stage, student, aux, batch, teacher)
        return self.cfg.distill.kd_scale * loss, {**metrics, "unscaled": loss}


methods.register(MethodSpec("scaledkd", (StageSpec("main", ("kd",)),),
                            fields=KD_FIELDS + ("distill.kd_scale",), strategy=ScaledKD))
mode, work = sys.argv[1], Path(sys.argv[2])
DATA = dict(seq_len=64, batch_size=8, tokenizer_vocab_size=384, synthetic_docs=600,
            synthetic_valid_docs=50)
out = {"package": hldstudy.__file__}


def sweep_file(teacher, preset_name):
    f = work / "scaled_sweep.py"
    f.write_text(f"""
from hldstudy.config import Config, DataConfig, TrainConfig
from hldstudy.model import preset
from hldstudy.sweep import Sweep


def get_sweep():
    base = Config(name="t", model=preset("tiny", vocab_size=384), data=DataConfig(**{DATA!r}),
                  train=TrainConfig(warmup_steps=1, log_every=1, checkpoint_every=0,
                                    eval_batches=1))
    return Sweep(name="scaled", base=base, methods=("kd", "scaledkd"), temperature=(2.0,),
                 kd_scale=(0.5, 2.0), budget_baseline_steps=2, teacher={teacher!r},
                 teacher_preset={preset_name!r})
""")
    return str(f)


from hldstudy.sweep.__main__ import main as sweep_main
from hldstudy.train import program as cohort_program

if mode == "plan":
    import io, contextlib
    from hldstudy.analysis.runs import BASE_COLUMNS, name_mismatches
    from hldstudy.distill.base import make_strategy
    from hldstudy.model import preset
    from hldstudy.sweep.spec import Sweep, expand, load_sweep

    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        rc = sweep_main([sweep_file(None, "tiny-teacher"), "--dry-run", "--json",
                         "--cohort", "2", "--workdir", str(work / "runs")])
    out["dry_run_rc"] = rc
    out["dry_run"] = json.loads(buf.getvalue())
    sweep = load_sweep(work / "scaled_sweep.py")
    out["sweep_keywords"] = [f for f in Sweep.__dataclass_fields__]
    out["axes"] = [[k, list(v)] for k, v in sweep.axes()]
    out["hparams"] = {k: list(v) for k, v in cohort_program.HPARAMS.items()}
    run = next(r for r in expand(sweep) if r.method == "scaledkd")
    strategy = make_strategy(run.config, run.config.model, preset("tiny-teacher", vocab_size=384))
    out["with_hparams"] = cohort_program.with_hparams(strategy, {"kd_scale": 0.25}).cfg.distill.kd_scale
    out["base_columns"] = BASE_COLUMNS
    flat = flatten(config_to_dict(run.config))
    out["run_id"] = run.run_id
    out["name_check_same"] = name_mismatches(run.run_id, flat)
    out["name_check_other"] = name_mismatches(run.run_id.replace("_ks", "_ks3"), flat)
else:
    from hldstudy.analysis.runs import load_runs
    from hldstudy.model import preset
    from hldstudy.train.loop import train

    teacher = work / "teacher"
    train(Config(name="teacher", model=preset("tiny-teacher", vocab_size=384),
                 data=DataConfig(**DATA),
                 train=TrainConfig(steps=2, warmup_steps=1, log_every=1, checkpoint_every=0,
                                   eval_batches=1, progress=False)), teacher)
    runs = work / "runs"
    out["sweep_rc"] = sweep_main([sweep_file(str(teacher), None), "--workdir", str(runs),
                                  "--cohort", "2", "--no-progress", "--methods", "scaledkd"])
    out["cohorts"] = sorted(p.name for p in (runs / ".sweep" / "cohorts").iterdir())
    out["steps"] = {}
    for d in sorted(runs.glob("scaledkd_*")):
        recs = [json.loads(l) for l in (d / "metrics.jsonl").read_text().splitlines()]
        out["steps"][d.name] = [[r["loss"], r["unscaled"]] for r in recs if "unscaled" in r]
    df = load_runs(runs)
    out["columns"] = list(df.columns)
    out["rows"] = df[["run_id", "status", "arm", "temperature", "kd_scale"]].to_dict("records")
print(json.dumps(out))
'''


@pytest.fixture(scope="module")
def package_with_new_axis(tmp_path_factory) -> Path:
    """A copy of the package under test with LINE added to its DistillConfig."""
    root = tmp_path_factory.mktemp("axis_pkg")
    shutil.copytree(Path(hldstudy.__file__).parent, root / "hldstudy",
                    ignore=shutil.ignore_patterns("__pycache__"))
    path = root / "hldstudy" / "config.py"
    before = path.read_text()
    assert before.count(ANCHOR) == 1
    after = before.replace(ANCHOR, ANCHOR + LINE + "\n")
    path.write_text(after)
    changed = [line for line in difflib.unified_diff(before.splitlines(), after.splitlines(),
                                                     lineterm="", n=0)
               if line[:1] in "+-" and not line.startswith(("+++", "---"))]
    assert changed == ["+" + LINE]
    return root


def _run(root: Path, mode: str, work: Path) -> dict:
    work.mkdir(parents=True, exist_ok=True)
    script = work / "axis_script.py"
    script.write_text(SCRIPT)
    env = {**os.environ, "PYTHONPATH": str(root), "TQDM_DISABLE": "1"}
    proc = subprocess.run([sys.executable, str(script), mode, str(work)], cwd=work, env=env,
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["package"] == str(root / "hldstudy" / "__init__.py")  # the copy ran
    return out


def test_a_new_axis_reaches_sweep_cohort_and_analysis(package_with_new_axis, tmp_path):
    out = _run(package_with_new_axis, "plan", tmp_path)
    # The sweep: a keyword of its own, its place among the axes (after the standard ones,
    # before the seed), its short name in run ids; kd does not declare it, so kd's runs
    # are not multiplied by it.
    assert "kd_scale" in out["sweep_keywords"]
    assert out["axes"] == [["distill.temperature", [2.0]], ["distill.kd_scale", [0.5, 2.0]],
                           ["train.seed", [0]]]
    assert out["dry_run_rc"] == 0
    ids = [r["run_id"] for r in out["dry_run"]]
    assert ids == ["kd_T2_s0", "scaledkd_T2_ks0.5_s0", "scaledkd_T2_ks2_s0"]
    scaled = [r for r in out["dry_run"] if r["method"] == "scaledkd"]
    assert [r["kd_scale"] for r in scaled] == [0.5, 2.0]
    assert scaled[0]["cohort"] == scaled[1]["cohort"]  # members of one cohort
    # The cohort: a traced per-member hyperparameter, handed to the loss' config.
    assert out["hparams"]["kd_scale"] == ["distill", "kd_scale"]
    assert set(out["hparams"]) == {"lr", "temperature", "alpha", "hidden_weight", "kd_scale"}
    assert out["with_hparams"] == 0.25
    # The analysis: a column, and a folder-name token checked against the config.
    cols = out["base_columns"]
    # the last grid axis: after the config's own, before the seed
    assert cols.index("kd_scale") == cols.index("hldf_stage1_share") + 1 == cols.index("seed") - 1
    assert out["run_id"] == "scaledkd_T2_ks0.5_s0" and out["name_check_same"] == []
    assert out["name_check_other"] == ["name says ks=30.5 but distill.kd_scale=0.5"]


@pytest.mark.slow
def test_a_new_axis_trains_traced_in_one_cohort_and_is_analysed(package_with_new_axis,
                                                                 tmp_path):
    out = _run(package_with_new_axis, "train", tmp_path)
    assert out["sweep_rc"] == 0
    assert len(out["cohorts"]) == 1  # both members in one cohort: one compiled step
    # Each member's loss is its own kd_scale x the KD loss, at every step.
    for run_id, scale in (("scaledkd_T2_ks0.5_s0", 0.5), ("scaledkd_T2_ks2_s0", 2.0)):
        steps = out["steps"][run_id]
        assert steps and all(loss == pytest.approx(scale * kd, rel=1e-5) for loss, kd in steps)
    # (kd_T2_s0 is in sweep.json but left out by --methods: "missing")
    rows = {r["run_id"]: r for r in out["rows"] if r["status"] == "done"}
    assert set(rows) == {"scaledkd_T2_ks0.5_s0", "scaledkd_T2_ks2_s0"}
    assert rows["scaledkd_T2_ks2_s0"]["kd_scale"] == 2.0
    # Used by one method only, the axis splits that method into arms.
    assert rows["scaledkd_T2_ks0.5_s0"]["arm"] == "scaledkd[ks=0.5]"
    assert "kd_scale" in out["columns"]
