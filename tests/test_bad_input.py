"""Bad configs and inputs fail before any compute: exit 2, one line on stderr naming the
field or file (and the fix), no traceback, and every file that was there before is
unchanged after (contents and modification times).

Most cases call a CLI's `main(argv)` in-process (what `python -m` runs, minus the
interpreter start); `test_process_boundary` runs a few as real subprocesses so the
exit status and stderr of the process itself are checked too.
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib
import json
import os
import subprocess
import sys
import typing
from dataclasses import dataclass
from pathlib import Path

import pytest

from hldstudy import config as C

TINY = "tiny"  # the built-in experiments/tiny.py, by name
ROOT = Path(__file__).resolve().parent.parent

MAINS = {
    "train": "hldstudy.train.__main__",
    "plan": "hldstudy.commands.plan",
    "flops": "hldstudy.commands.flops",
    "eval": "hldstudy.eval.__main__",
    "analysis": "hldstudy.analysis.__main__",
    "serve": "hldstudy.teacher.serve",
    "sweep": "hldstudy.sweep.__main__",
    "quickstart": "hldstudy.quickstart",
}
# `python -m` names of the CLIs (the subprocess cases); the top floor's commands run as
# `python -m hldstudy <command>`.
MODULES = {"train": "hldstudy.train", "plan": "hldstudy plan", "flops": "hldstudy flops",
           "eval": "hldstudy.eval", "analysis": "hldstudy.analysis",
           "serve": "hldstudy.teacher.serve", "sweep": "hldstudy.sweep"}

EXPERIMENT = '''\
from hldstudy.config import Config, DataConfig
from hldstudy.model.presets import preset


def get_config():
    return Config(name="exp", model=preset("tiny"), data=DataConfig(seq_len=64, batch_size=8))
'''


SWEEP = '''\
from hldstudy.config import Config, DataConfig
from hldstudy.model.presets import preset
from hldstudy.sweep import Sweep


def get_sweep():
    return Sweep(name="s", base=Config(model=preset("tiny"), data=DataConfig(seq_len=64)),
                 methods=("baseline",), budget_baseline_steps=2)
'''


def make_world(root: Path) -> None:
    """The files every case starts from; none of them may change."""
    (root / "exp.py").write_text(EXPERIMENT)
    (root / "sweep.py").write_text(SWEEP)
    run = root / "existing_run"
    run.mkdir()
    (run / "config.json").write_text('{"name": "existing"}\n')
    (run / "metrics.jsonl").write_text('{"step": 1, "loss": 2.0}\n')
    (root / "afile.txt").write_text("not a directory\n")
    (root / "adir").mkdir()
    (root / "adir" / "keep.txt").write_text("kept\n")
    (root / "config.json").write_text('{"train": {"steps": 3}}\n')
    (root / "runs").mkdir()
    (root / "runs" / "marker.txt").write_text("runs/ is not touched\n")


def snapshot(root: Path) -> dict[str, tuple]:
    """{relative path: (size, mtime_ns, sha1)} of every file below root."""
    out = {}
    for dirpath, _, files in os.walk(root):
        for name in files:
            p = Path(dirpath) / name
            st = p.lstat()
            out[str(p.relative_to(root))] = (st.st_size, st.st_mtime_ns,
                                             hashlib.sha1(p.read_bytes()).hexdigest())
    return out


def one_line(code, err: str, needles) -> str:
    assert code == 2, (code, err)
    assert "Traceback" not in err, err
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert len(lines) == 1, err  # one line
    for needle in needles:
        assert needle in lines[0], lines[0]
    return lines[0]


# --------------------------------------------------------------------------- #
# Cases: (cli, argv, needles, setup). "{tmp}" in argv is the case's directory.
# --------------------------------------------------------------------------- #


@dataclass
class Case:
    cli: str
    argv: list[str]
    needles: tuple
    setup: typing.Callable[[Path], None] | None = None
    id: str = ""
    # Refused by the trainer once it runs (mesh, teacher files): it may have added files
    # of its own to the new run directory (never changed one that was there).
    adds_files: bool = False


def _train(*extra, needles, setup=None, adds_files=False):
    return Case("train", ["--config", TINY, "--workdir", "{tmp}/runs/new", *extra],
                tuple(needles), setup, adds_files=adds_files)


def _set(*kvs):
    return [a for kv in kvs for a in ("--set", kv)]


PLAN = ["--teacher", "gemma3-4b", "--student", "gemma3-270m", "--tokens-per-step", "65536",
        "--devices", "8", "--link", "100"]


def _plan(*extra, needles):
    argv = list(PLAN)
    for flag, value in zip(extra[::2], extra[1::2], strict=True):
        if flag in argv:
            argv[argv.index(flag) + 1] = value
        else:
            argv += [flag, value]
    return Case("plan", argv, tuple(needles))


def _flops(*extra, needles):
    return Case("flops", ["--config", "{tmp}/exp.py", *extra], tuple(needles))


def _jsonl(lines: list[str], task: str = "piqa"):
    def setup(tmp: Path) -> None:
        (tmp / "offline").mkdir()
        (tmp / "offline" / f"{task}.jsonl").write_text("".join(f"{ln}\n" for ln in lines))
    return setup


PIQA = json.dumps({"goal": "g", "sol1": "a", "sol2": "b", "label": 0})


def _eval(*extra, needles, setup=None):
    return Case("eval", ["--checkpoint", "{tmp}/existing_run", "--tasks", "piqa",
                         "--offline-data", "{tmp}/offline", "--no-progress", *extra],
                tuple(needles), setup or _jsonl([PIQA]))


CASES: list[Case] = [
    # --- the config: unknown keys, types, cross-field rules (the original cases) ---
    _train(*_set("model.nonsense=3"), needles=["model.nonsense", "unknown key"]),
    _train(*_set("nosection.x=1"), needles=["nosection", "unknown section"]),
    _train(*_set("train.steps=many"), needles=["train.steps", "integer"]),
    _train(*_set("model.d_model=65"), needles=["model.d_model", "divisible by n_heads"]),
    _train(*_set("model.n_kv_heads=3"), needles=["model.n_kv_heads"]),
    _train(*_set("data.source=jsonl", "data.path=/no/such/file.jsonl"),
           needles=["data.path", "/no/such/file.jsonl"]),
    _train(*_set("data.source=text"), needles=["data.path", "needs a path"]),
    _train(*_set("data.source=parquet"), needles=["data.source", "parquet"]),
    _train(*_set("data.tokenizer=/no/tok.model"), needles=["data.tokenizer", "does not exist"]),
    _train(*_set("data.seq_len=4096"), needles=["data.seq_len", "max_seq_len"]),
    _train(*_set("train.lr=-1"), needles=["train.lr", "> 0"]),
    _train(*_set("train.schedule=step"), needles=["train.schedule"]),
    _train("--method", "kd", needles=["teacher.checkpoint", "needs a teacher"]),
    _train("--method", "kd", *_set("teacher.checkpoint=/tmp/none", "distill.alpha=1.5"),
           needles=["distill.alpha", "[0, 1]"]),
    _train("--method", "kd", *_set("teacher.checkpoint=/x", "distill.temperature=0"),
           needles=["distill.temperature", "> 0"]),
    _train("--method", "hldf", *_set("teacher.checkpoint=/x", "distill.hldf_stage1_share=1"),
           needles=["distill.hldf_stage1_share", "(0, 1)"]),
    _train(*_set("distill.layer_pairs=3-4"), needles=["distill.layer_pairs", "student:teacher"]),
    _train(*_set("model.dtype=float8"), needles=["model.dtype"]),
    _train(*_set("data.batch_size=6"), needles=["data.batch_size", "divisible"], adds_files=True),
    _train("--method", "kd", *_set("teacher.checkpoint=/definitely/missing"),
           needles=["teacher.checkpoint", "does not exist"], adds_files=True),
    # --- value domains declared in the field metadata ---
    _train(*_set("train.b2=1.5"), needles=["train.b2", "[0, 1)", "1.5"]),
    _train(*_set("train.b2=1"), needles=["train.b2", "[0, 1)"]),
    _train(*_set("train.b1=-0.1"), needles=["train.b1", "[0, 1)"]),
    _train(*_set("train.lr=Infinity"), needles=["train.lr", "finite", "inf"]),
    _train(*_set("train.lr=NaN"), needles=["train.lr", "finite", "nan"]),
    _train(*_set("train.lr=1e999"), needles=["train.lr", "finite"]),
    _train(*_set("budget.flops=Infinity"), needles=["budget.flops", "finite"]),
    _train(*_set("budget.flops=-1"), needles=["budget.flops", ">= 0", "train.steps decides"]),
    _train(*_set("teacher.timeout_s=0"), needles=["teacher.timeout_s", "> 0"]),
    _train(*_set("teacher.timeout_s=-5"), needles=["teacher.timeout_s", "> 0"]),
    _train(*_set("teacher.ring_size=-1"), needles=["teacher.ring_size", ">= 0"]),
    _train(*_set("data.max_docs=-1"), needles=["data.max_docs", ">= 0", "0 = all documents"]),
    _train(*_set("data.valid_holdout_docs=-1"), needles=["data.valid_holdout_docs", ">= 0"]),
    _train(*_set("data.synthetic_docs=0"), needles=["data.synthetic_docs", ">= 1"]),
    _train(*_set("data.seed=-3"), needles=["data.seed", ">= 0"]),
    _train(*_set("train.eval_batches=-1"), needles=["train.eval_batches", ">= 0"]),
    _train(*_set("train.log_every=0"), needles=["train.log_every", ">= 1"]),
    _train(*_set("train.steps=0"), needles=["train.steps", ">= 1"]),
    _train(*_set("train.warmup_steps=-1"), needles=["train.warmup_steps", ">= 0"]),
    _train(*_set("train.min_lr_ratio=2"), needles=["train.min_lr_ratio", "[0, 1]"]),
    _train(*_set("train.weight_decay=-0.1"), needles=["train.weight_decay", ">= 0"]),
    _train(*_set("train.grad_clip=Infinity"), needles=["train.grad_clip", "finite"]),
    _train(*_set("train.keep_checkpoints=0"), needles=["train.keep_checkpoints"]),
    _train(*_set("train.seed=-1"), needles=["train.seed", ">= 0"]),
    _train(*_set("train.mesh_data=-5"), needles=["train.mesh_data", "-1"]),
    _train(*_set("train.mesh_data=-1", "train.mesh_fsdp=-1"), needles=["train.mesh_data"]),
    _train(*_set("model.norm_eps=0"), needles=["model.norm_eps", "> 0"]),
    _train(*_set("model.rope_base_global=-1"), needles=["model.rope_base_global", "> 0"]),
    _train(*_set("model.sliding_window=0"), needles=["model.sliding_window", ">= 1"]),
    _train(*_set("model.attn_softcap=NaN"), needles=["model.attn_softcap", "finite"]),
    _train(*_set("model.attention=flash"), needles=["model.attention", "chunked"]),
    _train(*_set("model.param_dtype=int8"), needles=["model.param_dtype", "bfloat16"]),
    _train(*_set("teacher.dtype=int8"), needles=["teacher.dtype", "float32"]),
    _train(*_set("wandb.mode=sometimes"), needles=["wandb.mode", "offline"]),
    _train(*_set("distill.loss_impl=chunked"), needles=["distill.loss_impl", "materialized"]),
    _train(*_set("distill.fused_backend=cuda"), needles=["distill.fused_backend", "pallas"]),
    _train(*_set("distill.divergence=kl"), needles=["distill.divergence", "reverse_kl"]),
    _train(*_set("distill.jsd_beta=2"), needles=["distill.jsd_beta", "[0, 1]"]),
    _train(*_set("distill.hidden_weight=-1"), needles=["distill.hidden_weight", ">= 0"]),
    _train(*_set("distill.patient_pairs=0"), needles=["distill.patient_pairs", ">= 1"]),
    _train(*_set("distill.temperature=Infinity"), needles=["distill.temperature", "finite"]),
    _train("--method", "kd", *_set("teacher.checkpoint=remote://localhost:99999"),
           needles=["teacher.checkpoint", "99999", "1..65535"]),
    # --- a whole section: a mapping merges, anything else is refused ---
    _train(*_set('train={"steps": 3, "nope": 1}'), needles=["train.nope", "unknown key"]),
    _train(*_set("train=3"), needles=["train", "section"]),
    _train(*_set('train.steps={"a": 1}'), needles=["train.steps", "integer"]),
    # --- run names and paths ---
    Case("train", ["--config", TINY, "--set", "name=../.."], ("name", "'../..'")),
    Case("train", ["--config", TINY, "--set", "name=a/b"], ("name", "plain folder name")),
    Case("train", ["--config", "{tmp}/adir"], ("--config", "adir", "is a directory")),
    Case("train", ["--config", "{tmp}/config.json"], ("--config", "config.json", "Python file")),
    Case("train", ["--config", TINY, "--workdir", "{tmp}/afile.txt"],
         ("--workdir", "afile.txt", "is a file")),
    Case("train", ["--config", TINY, "--workdir", "{tmp}/afile.txt/run"],
         ("--workdir", "afile.txt", "is a file")),
    Case("sweep", ["{tmp}/sweep.py", "--workdir", "{tmp}/afile.txt"],
         ("--workdir", "afile.txt", "is a file")),
    Case("sweep", ["{tmp}/sweep.py", "--workdir", "{tmp}/afile.txt/runs"],
         ("--workdir", "afile.txt", "is a file")),
    Case("sweep", ["{tmp}/sweep.py", "--set", "train.b2=1.5"], ("train.b2", "[0, 1)")),
    Case("sweep", ["{tmp}/adir"], ("adir", "is a directory")),
    # --- the planner's inputs ---
    _plan("--link", "inf", needles=["--link", "finite"]),
    _plan("--link", "nan", needles=["--link", "finite"]),
    _plan("--mfu", "5", needles=["--mfu", "(0, 1]"]),
    _plan("--devices", "0", needles=["--devices", ">= 1"]),
    _plan("--devices", "-8", needles=["--devices", ">= 1"]),
    _plan("--link", "0", needles=["--link", "> 0"]),
    _plan("--link", "-1", needles=["--link", "> 0"]),
    _plan("--tokens-per-step", "0", needles=["--tokens-per-step", ">= 1"]),
    _plan("--tflops", "inf", needles=["--tflops", "finite"]),
    _plan("--hidden-layers", "-1", needles=["--hidden-layers", ">= 0"]),
    _plan("--teacher-devices", "0", needles=["--teacher-devices", ">= 1"]),
    _plan("--grad-accum", "0", needles=["--grad-accum"]),
    # --- the FLOP CLI ---
    _flops("--budget", "-1", needles=["--budget", "> 0"]),
    _flops("--budget", "1", needles=["--budget", "no steps"]),
    _flops("--budget", "inf", needles=["--budget", "finite"]),
    _flops("--budget", "0", needles=["--budget", "> 0"]),
    _flops("--set", "train.b2=2", needles=["train.b2", "[0, 1)"]),
    _flops("--set", "data.seq_len=1000000", needles=["data.seq_len", "max_seq_len"]),
    Case("flops", ["--config", "{tmp}/adir"], ("--config", "is a directory")),
    # --- evaluation: output paths and offline data, all before the model loads ---
    _eval("--out", "{tmp}/adir", needles=["--out", "adir", "is a directory"]),
    _eval("--out", "{tmp}/afile.txt/results.json", needles=["--out", "afile.txt", "is a file"]),
    _eval(needles=["piqa.jsonl:3:", "not JSON"], setup=_jsonl([PIQA, PIQA, "{oops", PIQA])),
    _eval(needles=["piqa.jsonl:2:", "lacks sol2"],
          setup=_jsonl([PIQA, json.dumps({"goal": "g", "sol1": "a", "label": 0})])),
    _eval(needles=["piqa.jsonl:2:", "JSON object"], setup=_jsonl([PIQA, "[1, 2]"])),
    _eval(needles=["piqa.jsonl", "no records"], setup=_jsonl([])),
    _eval("--max-length", "0", needles=["--max-length", ">= 1"]),
    _eval("--rolling-context", "0", needles=["--rolling-context", ">= 1"]),
    # --- the analysis ---
    Case("analysis", ["{tmp}/existing_run", "--out", "{tmp}/afile.txt"],
         ("--out", "afile.txt", "is a file")),
    Case("analysis", ["{tmp}/adir", "--out", "{tmp}/report", "--seed", "-1"], ("--seed",)),
    Case("analysis", ["{tmp}/adir", "--out", "{tmp}/report", "--ci", "1.5"], ("--ci",)),
    # --- the teacher service's command line (its checks: hldstudy/teacher/serve.py) ---
    Case("serve", ["--config", "{tmp}/exp.py", "--port", "99999"], ("--port", "99999")),
    Case("serve", ["--config", "{tmp}/exp.py", "--host", "256.1.1.1"], ("--host", "256.1.1.1")),
    # --config takes the built-in experiment names, as train and sweep do
    Case("serve", ["--config", TINY, "--checkpoint", "{tmp}/no_teacher"],
         ("--checkpoint", "no_teacher", "does not exist")),
    # --- validated early, each blamed on its own flag or field (issue 21) ---
    _train(*_set("model.attention.window=3"),
           needles=["model.attention", "is a field ('dense')", "not a section"]),
    _plan("--seq-len", "131072", needles=["--seq-len", "131072", "--tokens-per-step 65536"]),
    Case("quickstart", ["--workdir", "{tmp}/afile.txt", "--size", "tiny"],
         ("--workdir", "afile.txt", "is a file")),
    Case("quickstart", ["--workdir", "{tmp}/qs", "--size", "tiny", "--methods", "kd,bogus"],
         ("--methods", "'bogus'")),
]
for _i, _c in enumerate(CASES):
    _c.id = f"{_c.cli}-{_i:02d}-{_c.needles[0].strip('-')}"


def _argv(case: Case, tmp: Path) -> list[str]:
    return [a.replace("{tmp}", str(tmp)) for a in case.argv]


@pytest.fixture
def world(tmp_path, monkeypatch):
    make_world(tmp_path)
    monkeypatch.chdir(tmp_path)  # runs/<name> lands here
    monkeypatch.delenv("HLDSTUDY_EVAL_DATA", raising=False)
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return tmp_path


def _main(cli: str):
    module = importlib.import_module(MAINS[cli])
    if cli == "serve" and not hasattr(module, "check_port"):
        pytest.skip("the teacher service's --port/--host checks are not in this tree")
    return module.main


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_bad_input_is_one_line_and_changes_nothing(case, world, capsys):
    if case.setup:
        case.setup(world)
    main = _main(case.cli)
    before = snapshot(world)
    capsys.readouterr()
    with pytest.raises(SystemExit) as exc:
        main(_argv(case, world))
    one_line(exc.value.code, capsys.readouterr().err, case.needles)
    after = snapshot(world)
    assert {k: after.get(k) for k in before} == before  # nothing there before changed
    if not case.adds_files:
        assert after == before  # and nothing was added
        assert not (world / "report").exists() and not (world / "runs" / "new").exists()


def test_at_least_sixty_cases():
    assert len(CASES) >= 60


# --------------------------------------------------------------------------- #
# The same, across the process boundary (exit status and stderr of `python -m`)
# --------------------------------------------------------------------------- #

PROCESS_CASES = [
    Case("train", ["--config", "{tmp}/adir"], ("--config", "is a directory")),
    Case("train", ["--config", TINY, "--set", "train.b2=1.5"], ("train.b2",)),
    Case("plan", [*PLAN[:-2], "--link", "inf"], ("--link", "finite")),
    Case("flops", ["--config", "{tmp}/exp.py", "--budget", "-1"], ("--budget",)),
    Case("analysis", ["{tmp}/existing_run", "--out", "{tmp}/afile.txt"], ("--out", "is a file")),
]


@pytest.mark.parametrize("case", PROCESS_CASES, ids=[f"{c.cli}-{c.needles[0].strip('-')}"
                                                     for c in PROCESS_CASES])
def test_process_boundary(case, world):
    before = snapshot(world)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    r = subprocess.run([sys.executable, "-m", *MODULES[case.cli].split(), *_argv(case, world)],
                       capture_output=True, text=True, cwd=world, env=env, timeout=120)
    one_line(r.returncode, r.stderr, case.needles)
    assert snapshot(world) == before


# --------------------------------------------------------------------------- #
# Around the cases
# --------------------------------------------------------------------------- #


def test_debug_shows_the_traceback(tmp_path):
    from hldstudy.errors import ConfigError
    from hldstudy.train.__main__ import main as train_main

    with pytest.raises(ConfigError):
        train_main(["--config", TINY, "--debug", "--set", "train.lr=-1"])


def test_missing_experiment_file(world, capsys):
    from hldstudy.train.__main__ import main as train_main

    with pytest.raises(SystemExit) as e:
        train_main(["--config", str(world / "nope.py")])
    one_line(e.value.code, capsys.readouterr().err, ["nope.py", "does not exist"])


def test_experiment_without_get_config(world, capsys):
    from hldstudy.train.__main__ import main as train_main

    (world / "bad.py").write_text("x = 1\n")
    with pytest.raises(SystemExit) as e:
        train_main(["--config", str(world / "bad.py")])
    one_line(e.value.code, capsys.readouterr().err, ["bad.py", "get_config"])


def test_unwritable_workdir(world, capsys, monkeypatch):
    """Root ignores permission bits, so `os.access` says what a normal user would see."""
    from hldstudy.train.__main__ import main as train_main

    locked = world / "adir"
    real_access = os.access
    monkeypatch.setattr(os, "access", lambda p, mode, **kw:
                        False if Path(p) == locked else real_access(p, mode, **kw))
    before = snapshot(world)
    for workdir, needle in ((locked, "is not writable"), (locked / "run", "cannot be made")):
        with pytest.raises(SystemExit) as e:
            train_main(["--config", TINY, "--workdir", str(workdir)])
        one_line(e.value.code, capsys.readouterr().err, ["--workdir", "adir", needle])
    assert snapshot(world) == before


def test_a_section_mapping_merges_into_the_section():
    cfg = C.apply_overrides(C.Config(), ['train={"steps": 3, "lr": 0.01}',
                                        'model={"n_layers": 2}'])
    assert (cfg.train.steps, cfg.train.lr) == (3, 0.01)
    # every other field keeps its value: nothing is reset to a default
    assert dataclasses.replace(cfg.train, steps=100, lr=3e-3) == C.TrainConfig()
    assert dataclasses.replace(cfg.model, n_layers=18) == C.ModelConfig()
    tuned = C.apply_overrides(C.Config(), ["train.b2=0.99"])
    assert C.apply_overrides(tuned, ['train={"steps": 7}']).train.b2 == 0.99
    with pytest.raises(C.ConfigError, match="train.nope"):
        C.apply_overrides(C.Config(), ['train={"nope": 1}'])


def _numeric(tp) -> bool:
    args = typing.get_args(tp) or (tp,)
    return any(a in (int, float) for a in args)


def test_every_numeric_field_and_choice_declares_its_domain():
    hints = {}

    def walk(cls, prefix=""):
        th = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            if dataclasses.is_dataclass(th[f.name]):
                walk(th[f.name], f"{prefix}{f.name}.")
            else:
                hints[f"{prefix}{f.name}"] = (th[f.name], f)

    walk(C.Config)
    rules = C.field_rules()
    numeric = [k for k, (tp, _) in hints.items() if _numeric(tp)]
    assert len(numeric) > 40
    missing = [k for k in numeric if rules[k]["domain"] is None]
    assert not missing, f"numeric fields without a domain: {missing}"
    for k in ("model.dtype", "model.attention", "data.source", "train.schedule",
              "distill.divergence", "distill.loss_impl", "distill.fused_backend",
              "teacher.dtype", "wandb.mode"):
        assert rules[k]["domain"].choices, k
    for k, (_, f) in hints.items():  # every default lies in its own domain
        if rules[k]["domain"] is not None and f.default is not dataclasses.MISSING:
            rules[k]["domain"].check(k, f.default)
    C.validate(C.Config(), check_paths=False)


def test_domain_specs():
    d = C.Domain("[0, 1)")
    assert d.contains(0.0) and d.contains(0.99) and not d.contains(1.0)
    assert not d.contains(float("nan")) and not d.contains(-0.0 - 1e-9)
    assert C.Domain("> 0").describe() == "> 0" and not C.Domain("> 0").contains(0)
    assert C.Domain("(0, 1]").contains(1) and not C.Domain("(0, 1]").contains(0)
    assert C.Domain(">= 1", also=(-1,)).contains(-1) and not C.Domain(">= 1").contains(-1)
    assert C.Domain(("a", "b")).describe() == "one of a, b"
    with pytest.raises(TypeError):
        C.Domain("between 0 and 1")
    with pytest.raises(C.ConfigError, match=r"x: must be in \[0, 1\), got 2 \(why\)"):
        C.Domain("[0, 1)", note="why").check("x", 2)


def test_long_sequences_are_warned_about_before_compute(world, capsys):
    from hldstudy.commands.flops import main as flops_main
    from hldstudy.commands.plan import main as plan_main

    # Long, but a step still holds whole sequences (longer than the step is refused).
    plan = [*PLAN[:PLAN.index("--tokens-per-step") + 1], "1048576",
            *PLAN[PLAN.index("--tokens-per-step") + 2:]]
    assert plan_main([*plan, "--seq-len", "1000000"]) == 0
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "warning" in err[0] and "--seq-len 1000000" in err[0]
    assert flops_main(["--config", str(world / "exp.py"), "--set", "model.max_seq_len=1000000",
                       "--set", "data.seq_len=1000000", "--json"]) == 0
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "warning" in err[0] and "data.seq_len 1000000" in err[0]


def test_eval_makes_its_output_directory_before_evaluating(world, monkeypatch, capsys):
    from hldstudy.eval import runner
    from hldstudy.eval.__main__ import main as eval_main

    out = world / "new" / "deeper" / "results.json"
    seen = {}

    def fake_evaluate(checkpoint, tasks, **kw):
        seen["dir_exists"] = out.parent.is_dir()
        return {"piqa": {"acc": 0.5}}

    monkeypatch.setattr(runner, "evaluate", fake_evaluate)
    assert eval_main(["--checkpoint", str(world / "existing_run"), "--tasks", "piqa",
                      "--out", str(out)]) == 0
    assert seen == {"dir_exists": True}

    def failing_evaluate(checkpoint, tasks, **kw):
        assert out.parent.is_dir()
        raise runner.InputError("--tasks: unknown task 'nope'")

    monkeypatch.setattr(runner, "evaluate", failing_evaluate)
    out = world / "other" / "results.json"
    with pytest.raises(SystemExit) as e:
        eval_main(["--checkpoint", str(world / "existing_run"), "--tasks", "nope",
                   "--out", str(out)])
    one_line(e.value.code, capsys.readouterr().err, ["unknown task"])
    assert not (world / "other").exists()  # the folder it made for nothing is gone


# --------------------------------------------------------------------------- #
# compress: a refusal writes nothing; outputs appear whole (temporary sibling, rename)
# --------------------------------------------------------------------------- #


@pytest.fixture(scope="module")
def compress_run(tmp_path_factory):
    """A tiny run directory with random weights (compress needs only a loadable one)."""
    from flax import nnx

    from hldstudy.compress import export
    from hldstudy.data.synthetic import generate_documents
    from hldstudy.data.tokenizer import train_tokenizer
    from hldstudy.model import Transformer
    from hldstudy.model.presets import preset

    root = tmp_path_factory.mktemp("compress_src")
    data = C.DataConfig(seq_len=64, batch_size=4, tokenizer_vocab_size=512,
                        synthetic_docs=300, synthetic_valid_docs=30)
    tok = train_tokenizer(generate_documents(data.synthetic_docs, seed=0), 512, root / "tok")
    cfg = C.Config(name="src", model=preset("tiny"), data=data,
                   train=C.TrainConfig(steps=1, eval_batches=1, progress=False))
    model = Transformer(cfg.model, rngs=nnx.Rngs(3))
    return export.save_run_dir(model, cfg, root / "run", tokenizer_file=tok.model_path)


def _compress(argv, capsys):
    from hldstudy.compress.__main__ import main

    try:
        code = main([*argv, "--no-progress", "--set", "compress.eval_batches=1"])
    except SystemExit as e:
        code = e.code
    return code, capsys.readouterr().err


def _earlier_output(root: Path) -> Path:
    out = root / "earlier"
    (out / "model").mkdir(parents=True)
    (out / "config.json").write_text('{"prune": "sparsegpt-2:4"}\n')
    (out / "report.json").write_text('{"stages": []}\n')
    (out / "model" / "config.json").write_text('{"name": "earlier"}\n')
    return out


@pytest.mark.parametrize("argv", [
    ["--prune", "magnitude-2:4"],
    ["--prune", "wanda-2:4", "--calibration-batches", "0"],
    ["--prune", "magnitude-2:4", "--recover-steps", "2", "--teacher", "/no/teacher"],
])
def test_a_refused_compress_keeps_an_earlier_output(compress_run, tmp_path, capsys, argv):
    """An earlier output in --out is refused first, whatever else is wrong: it is never
    mixed with, or described by the config.json of, another run."""
    out = _earlier_output(tmp_path)
    before = snapshot(tmp_path)
    code, err = _compress(["--checkpoint", str(compress_run), "--out", str(out), *argv], capsys)
    one_line(code, err, ["compress.out", "is not empty"])
    assert snapshot(tmp_path) == before


@pytest.mark.parametrize("argv,needles", [
    (["--prune", "wanda-2:4", "--calibration-batches", "0"], ["compress.calibration_batches"]),
    (["--prune", "wanda-2:4", "--set", "compress.calibration_data=/no/calib.jsonl"],
     ["compress.calibration_data"]),
    (["--prune", "magnitude-2:3"], ["compress.prune"]),
    (["--prune", "magnitude-2:4", "--recover-steps", "2", "--teacher", "/no/teacher"],
     ["compress.teacher", "/no/teacher"]),
])
def test_a_refused_compress_creates_no_output(compress_run, tmp_path, capsys, argv, needles):
    out = tmp_path / "new" / "out"
    code, err = _compress(["--checkpoint", str(compress_run), "--out", str(out), *argv], capsys)
    one_line(code, err, needles)
    assert list(tmp_path.iterdir()) == []  # not --out, not its parent, no temporary sibling


def test_compress_writes_into_a_sibling_and_renames_it_when_complete(compress_run, tmp_path,
                                                                      capsys, monkeypatch):
    from hldstudy.compress import pipeline

    out = tmp_path / "empty"
    out.mkdir()  # an empty --out is accepted
    seen = {}
    real = pipeline._write_report

    def spy(where, *args, **kwargs):
        seen.setdefault("dirs", set()).add(Path(where))
        assert not (out / "report.json").exists()  # nothing in --out before the end
        return real(where, *args, **kwargs)

    monkeypatch.setattr(pipeline, "_write_report", spy)
    code, err = _compress(["--checkpoint", str(compress_run), "--out", str(out),
                           "--prune", "magnitude-2:4"], capsys)
    assert code == 0, err
    (partial,) = seen["dirs"]
    assert partial.parent == tmp_path and partial.name.startswith(".empty.partial-")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["empty"]  # the sibling is gone
    assert {"config.json", "report.json", "report.md", "model.safetensors", "model"} <= \
        {p.name for p in out.iterdir()}
    assert ".partial-" not in (out / "report.json").read_text()


def test_a_compress_that_fails_midway_leaves_nothing(compress_run, tmp_path, capsys,
                                                     monkeypatch):
    from hldstudy.compress import pipeline
    from hldstudy.errors import RuntimeFault

    def fail(*args, **kwargs):
        raise RuntimeFault("the disk filled up while saving (test)")

    monkeypatch.setattr(pipeline, "save_safetensors", fail)
    out = tmp_path / "out"
    code, err = _compress(["--checkpoint", str(compress_run), "--out", str(out),
                           "--prune", "magnitude-2:4"], capsys)
    assert code == 3 and "disk filled up" in err
    assert list(tmp_path.iterdir()) == []


def test_a_bad_serve_cohort_is_blamed_on_cohort(compress_run, tmp_path, capsys, monkeypatch):
    """A cohort member asking for a layer the teacher lacks: --cohort is named (the served
    layers are its union), and the check comes before the replica makes its data cache."""
    from hldstudy.teacher.serve import main

    monkeypatch.setenv("TMPDIR", str(tmp_path))
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", None)
    with pytest.raises(SystemExit) as e:
        main(["--checkpoint", str(compress_run), "--config", str(compress_run),
              "--cohort", "a=final;b=final,99", "--no-warmup"])
    line = one_line(e.value.code, capsys.readouterr().err, ["--cohort", "99"])
    assert "--layers" not in line
    assert list(tmp_path.iterdir()) == []  # no data cache left behind


def test_a_bad_compile_target_is_blamed_on_the_flag_that_gave_it(capsys):
    """plan --check-compile bogus names --check-compile, not --target."""
    from hldstudy.commands.plan import main as plan_main

    with pytest.raises(SystemExit) as e:
        plan_main(["--sweep", "cpu", "--check-compile", "bogus"])
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--check-compile: unknown target 'bogus'" in err[0]


def test_an_unknown_command_is_one_line_naming_it(capsys):
    from hldstudy.cli import main

    assert main(["trian"]) == 2
    out = capsys.readouterr()
    assert out.out == ""
    err = out.err.strip().splitlines()
    assert len(err) == 1 and "unknown command 'trian' (did you mean 'train'?)" in err[0]


def test_settings_that_do_not_apply_are_named_and_a_bogus_preset_refused(tmp_path, capsys,
                                                                        teacher_dir):
    """`--set` of a knob the method does not use: one warning line each, the run goes on;
    teacher.preset names a preset even beside a real checkpoint."""
    from hldstudy.cli_common import not_applying
    from hldstudy.config import Config, DistillConfig
    from hldstudy.train.__main__ import main as train_main

    kd = Config(distill=DistillConfig(method="kd"))
    lines = not_applying(kd, ["train.stage_boundary=continue", "distill.temperature=2",
                              "train.lr=1e-3"])
    assert len(lines) == 1 and "train.stage_boundary=continue" in lines[0] \
        and "one stage" in lines[0]
    base = Config(distill=DistillConfig(method="baseline"))
    lines = not_applying(base, ["distill.nmse=token", "teacher.dtype=bfloat16"])
    assert ["knob" in lines[0], "uses no teacher" in lines[1]] == [True, True]
    with pytest.raises(SystemExit) as e:
        train_main(["--config", "tiny", "--set", "distill.method=kd", "--set",
                    f"teacher.checkpoint={teacher_dir}", "--set", "teacher.preset=bogus",
                    "--workdir", str(tmp_path / "bogus")])
    assert e.value.code == 2
    line = capsys.readouterr().err.strip().splitlines()[-1]
    assert "teacher.preset: 'bogus' is not a model preset" in line
    assert not (tmp_path / "bogus").exists()
    assert train_main(["--config", "tiny", "--set", "train.steps=2", "--set",
                       "distill.nmse=token", "--workdir", str(tmp_path / "run")]) == 0
    err = capsys.readouterr().err
    assert "--set distill.nmse=token: does not apply to distill.method=baseline" in err


def test_a_failed_background_future_prints_nothing_after_quiet_libraries():
    """What an orbax restore of a damaged checkpoint leaves behind: a future whose
    exception nobody retrieved, reported by asyncio when collected (3 lines and a
    traceback without quiet_libraries)."""
    import subprocess
    import sys

    code = ("import asyncio, gc\n"
            "from hldstudy.cli_common import quiet_libraries\n"
            "quiet_libraries()\n"
            "loop = asyncio.new_event_loop()\n"
            "f = loop.create_future(); f.set_exception(OSError('damaged'))\n"
            "del f; gc.collect(); loop.close()\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0 and "Future exception was never retrieved" not in out.stderr
