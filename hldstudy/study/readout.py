"""The real-text study's report: the setting (corpus, teacher, students, tokens per
parameter), phase 1's runs and picks (exploratory), phase 2's arms paired by seed and the
paper's three claims read from them (`hldstudy.analysis.arms`), into DIR/report/.

Design notes: `docs/study.md`, under this file's name.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pandas as pd

from hldstudy.analysis import arms as paired
from hldstudy.analysis.plots import plot_paired_arms
from hldstudy.analysis.runs import load_runs
from hldstudy.config import config_from_dict, load_experiment
from hldstudy.data.shards import read_manifest
from hldstudy.distill import methods
from hldstudy.fileio import write_json_atomic, write_text_atomic
from hldstudy.flops import step_flops
from hldstudy.shapes import count_params

METRICS = ("hellaswag/acc", "hellaswag/acc_norm", "lambada_openai/acc")


def _run_facts(run_dir: Path) -> dict:
    """Parameters, tokens trained and tokens per parameter of one run directory."""
    cfg = config_from_dict(json.loads((run_dir / "config.json").read_text()))
    res = json.loads((run_dir / "results.json").read_text()) \
        if (run_dir / "results.json").exists() else {}
    params = count_params(cfg.model)["total"]
    tokens = int(res.get("steps", cfg.train.steps)) * cfg.data.batch_size * cfg.data.seq_len
    return {"params": params, "tokens": tokens, "tokens_per_param": tokens / params,
            "valid_ppl": res.get("valid_ppl"), "flops": res.get("flops_spent")}


def quickstart_teacher_flops(experiments: Path) -> float:
    """The quickstart teacher's training compute (experiments/tiny_teacher.py, its 200
    steps): the unit the study's teacher is sized in."""
    cfg = load_experiment(experiments / "tiny_teacher.py")
    return step_flops(cfg, methods.BASELINE).total * cfg.train.steps


def _metrics(df: pd.DataFrame) -> list[str]:
    return [m for m in METRICS if m in df.columns]


def write_report(study, picks: dict, by_arm: dict) -> dict:
    out = study.dir / "report"
    (out / "tables").mkdir(parents=True, exist_ok=True)
    explore = pd.concat([load_runs(d) for d in study.explore_dirs], ignore_index=True)
    confirm = load_runs(study.dir / "confirm")
    metrics = _metrics(confirm)
    seeds = paired.per_seed(confirm, {a: v["runs"] for a, v in by_arm.items()})
    table = paired.arm_table(seeds, metrics)
    facts = {a: _run_facts(study.dir / "confirm" / v["runs"][0]) for a, v in by_arm.items()}
    table["tokens_per_param"] = [facts[a]["tokens_per_param"] for a in table["arm"]]
    contrasts = paired.contrast_table(seeds, [paired.Contrast(*c)
                                              for c in study.plan.CONTRASTS])
    readings, down = paired.claims(seeds, metrics, paired.ClaimArms(**study.plan.CLAIM_ARMS))
    picked = {p["run_id"] for k, p in picks.items() if isinstance(p, dict) and "run_id" in p}
    ex = explore[explore["status"] == "done"].copy()
    ex["picked"] = ex["run_id"].astype(str).isin(picked)
    ex_cols = ["run_id", "method", "lr", "temperature", "alpha", "hldf_stage1_share",
               "stage_boundary", "hidden_weight", "valid_ppl", *_metrics(ex), "picked"]
    ex = ex[[c for c in ex_cols if c in ex.columns]]
    teacher = _run_facts(study.teacher)
    teacher["compute_x_quickstart"] = teacher["flops"] / quickstart_teacher_flops(
        study.plan.EXPERIMENTS)
    corpus = json.loads((study.corpus / "corpus.json").read_text())
    manifest = read_manifest(study.shards)
    teacher["epochs"] = teacher["tokens"] / manifest["splits"]["train"]["tokens"]
    record = study._record()
    for name, frame in (("exploratory", ex), ("arms", table), ("contrasts", contrasts),
                        ("downstream", down)):
        write_text_atomic(out / "tables" / f"{name}.csv", frame.to_csv(index=False))
    best_student = float(table["valid_ppl"].min()) if len(table) else math.nan
    summary = {
        "study": "real-text", "size": study.size_name,
        "teacher_valid_ppl": teacher["valid_ppl"],
        "teacher": teacher, "best_student_valid_ppl": best_student,
        "teacher_below_best_student_pct": 100 * (1 - teacher["valid_ppl"] / best_student)
        if best_student == best_student else math.nan,
        "corpus": {k: corpus[k] for k in ("valid_books", "task_books", "documents", "words",
                                          "task_counts")},
        "tokens": {k: v["tokens"] for k, v in manifest["splits"].items()},
        "picks": picks,
        "arms": [{"name": r["run_id"], "phase": "exploratory", "method": r["method"],
                  "seeds": [int(study.plan.EXPLORATORY_SEED)],
                  "tokens_per_param": _run_facts(_explore_dir(study, r["run_id"]))
                  ["tokens_per_param"], "valid_ppl": float(r["valid_ppl"]),
                  "picked": bool(r["picked"])} for _, r in ex.iterrows()]
        + [{"name": r["arm"], "phase": "confirmatory", "method": by_arm[r["arm"]]["method"],
            "params": by_arm[r["arm"]]["params"],
            "seeds": sorted(int(s) for s in seeds[seeds["arm"] == r["arm"]]["seed"]),
            "tokens_per_param": r["tokens_per_param"], "valid_ppl": r["valid_ppl"],
            "valid_ppl_sd": r["valid_ppl_sd"], **{m: r[m] for m in metrics}}
           for _, r in table.iterrows()],
        "contrasts": contrasts.to_dict("records"),
        "claims": readings,
        "seconds": record.get("seconds", {}),
    }
    figure = plot_paired_arms(seeds, contrasts, out / "figures" / "arms.png",
                              paired.PAPER_GAP_PCT, title="Confirmatory arms, paired by seed")
    summary["figure"] = str(figure.relative_to(out)) if figure else None
    write_json_atomic(out / "summary.json", _finite_or_none(summary))
    write_text_atomic(out / "report.md", render(summary, table, contrasts, down, ex))
    return summary


def _explore_dir(study, run_id: str) -> Path:
    for d in study.explore_dirs:
        if (d / run_id).exists():
            return d / run_id
    raise FileNotFoundError(run_id)


def _finite_or_none(obj):
    """NaN / inf written as null (JSON has neither)."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: _finite_or_none(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_finite_or_none(v) for v in obj]
    return obj


def _md(frame: pd.DataFrame, digits: int = 3) -> str:
    return frame.to_markdown(index=False, floatfmt=f".{digits}g") if len(frame) else "(none)"


def render(s: dict, table, contrasts, down, ex) -> str:
    t = s["teacher"]
    L = [f"# HLD vs KD on real English text ({s['size']} size)\n",
         "The World English Bible, split by book: training text, validation text and the "
         "downstream tasks' text come from disjoint books "
         f"(validation: {', '.join(s['corpus']['valid_books'])}; tasks: "
         f"{', '.join(s['corpus']['task_books'])}); the tokenizer saw the training books only. "
         f"Tokens: {s['tokens']}.\n",
         f"**Teacher**: {t['params']:,} parameters, {t['tokens']:,} tokens "
         f"({t['epochs']:.1f} epochs, {t['tokens_per_param']:.2f} tokens per parameter), "
         f"{t['compute_x_quickstart']:.1f}x the quickstart teacher's compute; validation "
         f"perplexity **{t['valid_ppl']:.2f}**, {s['teacher_below_best_student_pct']:.1f}% "
         f"below the best student's ({s['best_student_valid_ppl']:.2f}).\n",
         "## The paper's claims (confirmatory runs only)\n",
         "Each verdict reads the 95% t interval over the confirmatory seeds (picks from "
         "phase 1 never judge themselves); a call whose test does not survive one Holm "
         "correction over every test below reads `cannot tell`.\n"]
    for i, c in enumerate(s["claims"], 1):
        L.append(f"{i}. **{c['claim']}.** Verdict: **{c['verdict']}**"
                 + (f" (before the correction: {c['verdict_unadjusted']})"
                    if c["verdict"] != c["verdict_unadjusted"] else "")
                 + f". {c['shows']}.\n")
    L += ["## Confirmatory arms (paired by seed, every arm at KD's lr and T)\n",
          *([f"![arms]({s['figure']})\n"] if s.get("figure") else []),
          _md(table), "\n\n## Perplexity gaps, paired by seed (%, negative: the arm ahead)\n",
          _md(contrasts), "\n\n`eval_se_pct`: the evaluation's own standard error of one gap "
          "(per-batch NLL differences on the whole validation split), beside `seed_sd_pct`, "
          "the spread of the gap across seeds.\n",
          "\n## Downstream gaps vs KD (points)\n", _md(down),
          "\n\n## Phase 1 (exploratory, seed 0): every run, the picks marked\n", _md(ex),
          f"\n\nPick rule: {s['picks'].get('rule', '')}.\n"]
    if s.get("seconds"):
        L.append("\nWall time per step (seconds, summed over sittings): "
                 + ", ".join(f"{k} {v:.0f}" for k, v in s["seconds"].items())
                 + f"; total {sum(s['seconds'].values()):.0f} s.\n")
    return "\n".join(L)
