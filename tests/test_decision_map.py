"""The seed's decision map (`hldstudy plan --decision-map`): each cell is the planner's plan at
the fewest micro-batches that fit, the replica the fewest devices that hold the teacher, the
compiled cells' commands carry the planner's choices, records are reused only for the same
command, and the committed docs/decision_map.md is what the command writes from the
committed records."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
from pathlib import Path

import pytest

from hldstudy.aot.fingerprint import source_sha256, toolchain
from hldstudy.aot.targets import parse_target
from hldstudy.chips import CHIPS
from hldstudy.commands import decision_map as cmd
from hldstudy.commands import decision_map_page as page
from hldstudy.commands import decision_map_records as store
from hldstudy.commands.plan import main as plan_main
from hldstudy.config import load_experiment
from hldstudy.errors import ConfigError
from hldstudy.flops.hlo_count import COUNT_VERSION
from hldstudy.model.presets import preset
from hldstudy.plan import plan_model
from hldstudy.plan.decision_map import (
    PAIRS,
    TARGETS,
    decision_map,
    map_cell,
    replica_device_counts,
    slice_spec,
)

ROOT = Path(__file__).resolve().parent.parent
HLD, SMALL, LARGE = PAIRS  # the HLD study's pair, the two MoE pairs


def _cells():
    targets = [(t, parse_target(t).chip, parse_target(t).n_devices) for t in TARGETS]
    return decision_map(PAIRS, targets, shape_of=plan_model, sizes_of=cmd.cell_sizes)


def _record(args, **figures):
    """A record as `run_compile` keeps one: this host's tools, a lowered program's hash."""
    return {"command": store.command_key(args), "config_sha256": store.config_digest(args),
            "program_sha256": "a" * 64, "toolchain": toolchain(store.backend_of(args)),
            "source_sha256": source_sha256(), "hlo_count_version": COUNT_VERSION, **figures}


@pytest.mark.parametrize("pair, target", [(SMALL, "h100:8"), (LARGE, "v5p:2x2x2"),
                                          (LARGE, "h100:8")])
def test_a_cell_is_aots_planner_at_the_fewest_microbatches_that_fit(pair, target):
    """One memory model: a cell's figures are aot's planner (`hldstudy.aot.planned`, what
    `python -m hldstudy.aot` prints beside the same compile), at the fewest micro-batches
    whose band's pessimistic end fits 90% of the device; the replica at the fewest
    devices that hold it."""
    from hldstudy.aot.check import load_run
    from hldstudy.aot.planned import planned_replica, planned_train
    from hldstudy.plan.compilers import validation_band

    t = parse_target(target)
    sizes = cmd.cell_sizes(pair, target)
    cell = map_cell(plan_model(pair.teacher), plan_model(pair.student), t.chip, t.n_devices,
                    sizes, tokens_per_step=pair.tokens_per_step, seq_len=pair.seq_len)
    limit = t.chip.device_memory_bytes * 0.9
    cfg, method, teacher = load_run(pair.config, [], None, None)

    def at(layout, k):
        run = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, microbatches=k))
        return planned_train(run, teacher, method, t, layout)["total_bytes"]

    def fits(nbytes):
        return validation_band(nbytes, t.backend)[1] <= limit

    counts = [d for d in range(1, 257) if (256 // t.n_devices) % d == 0]
    for layout in ("colocated", "disaggregated"):
        k = cell[layout]["microbatches"]
        assert cell[layout]["peak_bytes"] == at(layout, k)
        if fits(at(layout, k)):  # fewer micro-batches than chosen would not fit
            assert not any(fits(at(layout, d)) for d in counts if d < k)
        else:  # none fits: the most micro-batches (one sequence per device)
            assert k == counts[-1]
    dis = cell["disaggregated"]
    r, batch = dis["replica_devices"], dis["replica_batch"]
    run = dataclasses.replace(cfg, teacher=dataclasses.replace(cfg.teacher, replica_batch=batch))
    spec = slice_spec(t.chip, r)
    assert dis["replica_peak_bytes"] == planned_replica(run, teacher, method,
                                                        parse_target(spec))["total_bytes"]
    assert batch * dis["replica_microbatches"] == 256 and r in replica_device_counts(t.chip)
    assert dis["devices_total"] == t.n_devices + dis["replicas"] * r


def test_the_map_reads_against_the_seed():
    """The planner's reading: the 35B-A3B -> 9B pair fits colocated on one node of each;
    the 122B-A10B -> 35B-A3B pair is out of memory colocated on 8 x H100 and v5p:2x2x2
    (the 35B student's float32 state and Adam over 8 devices, with the 122B teacher's
    weights) and, read at the pessimistic end of the planner's band, fits disaggregated on
    two nodes (h200:2x8, v5p:2x2x4); both layouts stream well under the link."""
    cells = {(c["pair"], c["target"]): c for c in _cells()}
    assert all(cells[(SMALL.name, t)]["colocated"]["fits"] for t in ("h100:8", "v5p:2x2x2"))
    for t in ("h100:8", "v5p:2x2x2"):
        assert not cells[(LARGE.name, t)]["colocated"]["fits"]
    assert all(cells[(LARGE.name, t)]["disaggregated"]["verdict"] == "fits"
               for t in ("h200:2x8", "v5p:2x2x4"))
    assert all(c["disaggregated"]["need_gbps"] < c["disaggregated"]["link_gbps"]
               for c in cells.values())


def test_a_chip_without_link_figures_is_refused_by_name():
    with pytest.raises(ConfigError, match="target.*v5e has no compute or link figures"):
        map_cell(plan_model("qwen3.5-35b-a3b"), plan_model("qwen3.5-9b"), CHIPS["v5e"], 8,
                 cmd.cell_sizes(SMALL, "h100:8"),
                 tokens_per_step=1 << 20, seq_len=4096)


def test_compile_commands_carry_the_planners_choices():
    cell = next(c for c in _cells() if c["pair"] == LARGE.name and c["target"] == "v5p:2x2x2")
    cmds = store.compile_commands(cell)
    assert cmds["colocated"][cmds["colocated"].index("--set") + 1] == \
        f"train.microbatches={cell['colocated']['microbatches']}"
    assert "disaggregated" in cmds["disaggregated"] and "train" in cmds["disaggregated"]
    rep = cmds["replica"]
    assert rep[rep.index("--target") + 1] == slice_spec(CHIPS["v5p"],
                                                       cell["disaggregated"]["replica_devices"])
    assert f"teacher.replica_batch={cell['disaggregated']['replica_batch']}" in rep
    assert slice_spec(CHIPS["v5p"], 8) == "v5p:2x2x2" and slice_spec(CHIPS["h100"], 2) == "h100:2"
    assert replica_device_counts(CHIPS["v5p"]) == (4, 8, 16)


def test_records_are_reused_only_for_the_same_command():
    cells = _cells()
    cell = next(c for c in cells if c["pair"] == SMALL.name and c["target"] == "h100:8")
    args = store.compile_commands(cell)["colocated"]
    rec = _record(args, fits=True, total_bytes=50 * 2**30)
    # A record of the experiment file as it was before an edit is not this file's compile.
    edited = dict(rec, config_sha256="0" * 64)
    missing = store.attach(cells, {rec["command"]: edited})
    assert cell["compiled"] == {} and (cell, "colocated", args) in missing
    stale = dict(rec, command=rec["command"].replace("train.microbatches=", "train.microbatches=9"))
    missing = store.attach(cells, {rec["command"]: rec, stale["command"]: stale})
    assert cell["compiled"] == {"colocated": [rec]}
    assert (cell, "colocated", args) not in missing
    assert sum(1 for c, _, _ in missing if c is cell) == 2  # disaggregated, replica
    assert len(missing) == 3 * len(cells) - 1  # every cell's three programs are compiled
    text = page.format_map(cells)
    row = next(ln for ln in text.splitlines() if ln.startswith(f"| {SMALL.name} | h100:8 |"))
    assert "compiled **50.0** (fits)" in row
    assert "partly compiled (disaggregated, replica: planner only: not compiled yet)" in row
    # A train step that does not fit at the planner's micro-batches is compiled again at the
    # next count in the planner's order (the next divisor up, not straight to the most); it is out of
    # memory only if the last count is too. Fits reads the planner's rule: 90% of the
    # device, so aot's "fits" at 96% (76 of 79.65 GiB) is out of memory here.
    k = cell["colocated"]["microbatches"]
    up = next(d for d in range(k + 1, 33) if 32 % d == 0)  # the next count of 32 per device
    oom = dict(rec, fits=True, total_bytes=76.3 * 2**30)
    missing = store.attach(cells, {rec["command"]: oom})
    again = [a for c, p, a in missing if c is cell and p == "colocated"]
    assert again and f"train.microbatches={up}" in again[0]
    row = next(ln for ln in page.format_map(cells).splitlines()
               if ln.startswith(f"| {SMALL.name} | h100:8 |"))
    assert "colocated OOM" in row
    missing = store.attach(cells, {rec["command"]: oom, store.command_key(again[0]): dict(
        rec, command=store.command_key(again[0]), microbatches=up)})
    assert page._fits(cell, "colocated") and len(cell["compiled"]["colocated"]) == 2
    # A replica's next compile is its next smaller forward, in the same order (the step's
    # 256 sequences dealt over the replica's devices: 4 on v5p, 2 then 1 per device
    # per forward ...); one sequence per device is the last there is.
    v5p = next(c for c in cells if c["pair"] == SMALL.name and c["target"] == "v5p:2x2x2")
    rep_args = store.compile_commands(v5p)["replica"]
    batch = v5p["disaggregated"]["replica_batch"]
    assert rep_args[-1] == f"teacher.replica_batch={batch}" and batch > 4
    # over the four chips of the slice the map counts for it (the file's own replica runs
    # on one device: the program and the map's count of devices would disagree)
    assert rep_args[-4:-2] == ["--set", "teacher.replica_devices=4"]
    assert store.next_args(v5p, "replica", rep_args)[-1] == f"teacher.replica_batch={batch // 2}"
    last = [a if not a.startswith("teacher.replica_batch=") else "teacher.replica_batch=4"
            for a in rep_args]
    assert store.next_args(v5p, "replica", last) is None


def test_a_record_of_another_program_or_toolchain_is_not_current():
    """A record is read as current only for the program the code lowers now (its sha256,
    where --compile lowered it again) compiled by the tools this host has; otherwise it is
    asked for again and shown as stale with why, its figure out of the verdict."""
    cells = _cells()
    cell = next(c for c in cells if c["pair"] == SMALL.name and c["target"] == "h100:8")
    args = store.compile_commands(cell)["colocated"]
    rec = _record(args, fits=True, total_bytes=50 * 2**30)
    key = rec["command"]
    store.attach(cells, {key: rec}, {key: "a" * 64})
    assert cell["compiled"] == {"colocated": [rec]} and cell["stale"] == {}
    # A host without the target's compiler cannot contradict the record's compiler version.
    elsewhere = dict(rec, toolchain=dict(rec["toolchain"], **{"jax-cuda12-plugin": "0.10.2"}))
    if rec["toolchain"]["jax-cuda12-plugin"] is None:
        store.attach(cells, {key: elsewhere}, {key: "a" * 64})
        assert cell["compiled"] == {"colocated": [elsewhere]}
    for other, programs, why in [
            (rec, {key: "b" * 64}, "the lowered program changed"),
            (dict(rec, toolchain=dict(rec["toolchain"], jaxlib="0.4.1")), {},
             "jaxlib 0.4.1 -> "),
            # the compiler's own version, where this host has it (it can say otherwise)
            *([(dict(rec, toolchain=dict(rec["toolchain"], **{"jax-cuda12-plugin": "0.0.1"})),
                {}, "jax-cuda12-plugin 0.0.1 -> ")]
              if rec["toolchain"]["jax-cuda12-plugin"] else []),
            ({k: v for k, v in rec.items() if k != "program_sha256"}, {},
             "without its program's hash")]:
        missing = store.attach(cells, {key: other}, programs)
        assert cell["compiled"] == {} and (cell, "colocated", args) in missing
        assert why in cell["stale"]["colocated"][1]
        row = page.format_map(cells).split(f"| {SMALL.name} | h100:8 |")[1].splitlines()[0]
        assert "stale compile 50.0" in row and why.split(" ->")[0] in row
        assert not page._fits(cell, "colocated") == cell["colocated"]["fits"] is False \
            or page._fits(cell, "colocated") == cell["colocated"]["fits"]  # the planner's


def test_a_record_is_lowered_again_only_where_the_code_changed(monkeypatch):
    """--compile checks each kept record against the program as this checkout lowers it:
    a record compiled by this very source is that program (no lowering: minutes for a 35B
    GPU program); another source's is lowered, and stamped with this source only when its
    program is the same, so a changed program stays stale."""
    cells = _cells()
    cell = next(c for c in cells if c["pair"] == SMALL.name and c["target"] == "h100:8")
    cmds = store.compile_commands(cell)
    same = _record(cmds["colocated"], fits=True, total_bytes=2**30,
                   source_sha256=source_sha256())
    unchanged = _record(cmds["disaggregated"], fits=True, total_bytes=2**30,
                        source_sha256="0" * 64)
    changed = _record(cmds["replica"], fits=True, total_bytes=2**30, source_sha256="0" * 64)
    records = {r["command"]: r for r in (same, unchanged, changed)}
    lowered = {unchanged["command"]: "a" * 64, changed["command"]: "b" * 64}
    asked, saves = [], []

    def lower(args):  # what `python -m hldstudy.aot --lower-only` would hash
        asked.append(store.command_key(args))
        return lowered[store.command_key(args)]

    monkeypatch.setattr(store, "lowered_program", lower)
    store.attach(cells, records)
    programs = store.programs_now(cells, records, lambda: saves.append(1))
    assert sorted(asked) == sorted(lowered) and same["command"] not in asked
    assert programs == {same["command"]: "a" * 64, **lowered}
    assert unchanged["source_sha256"] == source_sha256() and saves == [1]
    assert changed["source_sha256"] == "0" * 64
    store.attach(cells, records, programs)
    assert set(cell["compiled"]) == {"colocated", "disaggregated"}
    assert "the lowered program changed" in cell["stale"]["replica"][1]


def test_the_committed_map_is_what_the_command_writes(tmp_path, capsys):
    out = tmp_path / "not" / "made" / "yet" / "map.md"  # its folders are made
    assert plan_main(["--decision-map", "--out", str(out),
                      "--records", str(ROOT / cmd.RECORDS)]) == 0
    assert out.read_text() == (ROOT / "docs" / "decision_map.md").read_text()
    records = json.loads((ROOT / cmd.RECORDS).read_text())["compiled"]
    assert all("error" not in r for r in records)
    # Every cell is compiled, or its row says in one line why not (never compiled, or a
    # stale record shown with why).
    cells = _cells()
    missing = store.attach(cells, {r["command"]: r for r in records})
    text = page.format_map(cells)
    for cell, program, _ in missing:
        row = next(ln for ln in text.splitlines()
                   if ln.startswith(f"| {cell['pair']} | {cell['target']} |"))
        assert program in cell["stale"] or "not compiled yet" in row
    assert any(c["compiled"] for c in cells)  # the compiles of this round are read


@pytest.mark.parametrize("flag", ["--out", "--records"])
def test_bad_paths_are_one_line(tmp_path, capsys, flag):
    blocker = tmp_path / "file"
    blocker.write_text("{not json")
    bad = str(blocker / "map.md") if flag == "--out" else str(blocker)
    with pytest.raises(SystemExit) as exit_:
        plan_main(["--decision-map", flag, bad])
    assert exit_.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and flag in err[0]


def test_the_pair_presets_are_the_experiment_files_models():
    for pair in PAIRS:
        cfg = load_experiment(ROOT / pair.config)
        assert cfg.teacher.preset == pair.teacher
        assert cfg.model == preset(pair.student, dtype="bfloat16", remat=True,
                                   scan_layers=True, attention=cfg.model.attention)
        assert cfg.data.batch_size * cfg.data.seq_len == pair.tokens_per_step
        assert cfg.data.seq_len == pair.seq_len


def test_the_seeds_first_branch_a_small_teacher_colocated():
    """The seed's first branch has a pair: the HLD study's 3.4B teacher beside its 123M
    student fits colocated (fused loss) on one node of every target, by the planner, and
    the page reads it as that branch, with the faster layout."""
    cells = [c for c in _cells() if c["pair"] == HLD.name]
    assert len(cells) == len(TARGETS)
    assert all(c["colocated"]["fits"] for c in cells)
    text = page.format_map(_cells())
    line = next(ln for ln in text.splitlines() if f"({HLD.name})" in ln)
    assert line.startswith(f"- *{HLD.branch}*") and "colocated fits on h100:8" in line
    assert "Faster: colocated on h100:8" in line


def test_a_pair_whose_vocabularies_differ_is_refused_by_name():
    from hldstudy.plan.decision_map import MapPair

    odd = MapPair("gemma3-1b", "paper-123m", "experiments/c4_123m_kd.py")
    targets = [("h100:8", CHIPS["h100"], 8)]
    with pytest.raises(ConfigError, match="gemma3-1b -> paper-123m.*vocabulary"):
        decision_map((odd,), targets, shape_of=plan_model, sizes_of=cmd.cell_sizes)


def test_a_failed_compile_is_not_recorded_and_ends_in_one_line(tmp_path, capsys, monkeypatch):
    """A compile that fails (the extra missing, the process killed) is reported, the others
    go on, nothing of it is kept in the records (so the next --compile tries it again), and
    the command ends in one line, exit 3."""
    records = tmp_path / "records.json"
    calls = []

    def fake_compile(args):  # a test double: the real one runs python -m hldstudy.aot
        calls.append(args)
        if len(calls) == 1:
            return {"command": store.command_key(args), "exit": 1, "seconds": 0.1, "error": "killed"}
        return _record(args, exit=0, seconds=0.1, fits=True, total_bytes=2**30, largest=[])

    monkeypatch.setattr(cmd, "run_compile", fake_compile)
    monkeypatch.setattr(cmd, "check_installed", lambda target: None)
    with pytest.raises(SystemExit) as exit_:
        plan_main(["--decision-map", "--compile", "--records", str(records),
                   "--out", str(tmp_path / "map.md")])
    assert exit_.value.code == 3
    kept = json.loads(records.read_text())["compiled"]
    programs = {store.command_key(a) for c in _cells() for a in store.compile_commands(c).values()}
    assert len(kept) == len(calls) - 1 == len(programs) - 1  # one compile per program
    assert store.command_key(calls[0]) not in {r["command"] for r in kept}
    # one node's cells first, the smaller pairs first within each (the replicas' own
    # targets are smaller: the train steps say the order)
    trains = [a for a in calls if a[a.index("--parts") + 1] == "train"]
    order = [(parse_target(a[a.index("--target") + 1]).n_devices,
              [p.config for p in PAIRS].index(a[a.index("--config") + 1])) for a in trains]
    assert order == sorted(order)
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("hldstudy plan --decision-map: error: 1 compile(s) failed")
    assert (tmp_path / "map.md").exists()


def test_the_planners_ratio_reads_libtpus_peak_and_the_gpus_total():
    """The map's planner-over-compiler spans hold the planner to what aot holds it to
    (`hldstudy.aot.report.compiled_peak`): libtpu's own peak on a TPU (it reserves its code
    generation's allocations beyond it), the total on a GPU."""
    cells = _cells()
    records = {}
    for target in ("v5p:2x2x2", "h100:8"):
        cell = next(c for c in cells if c["pair"] == SMALL.name and c["target"] == target)
        args = store.compile_commands(cell)["colocated"]
        planned = cell["colocated"]["peak_bytes"]
        records[store.command_key(args)] = _record(args, fits=True, total_bytes=2 * planned,
                                          peak_memory_bytes=planned)
    store.attach(cells, records)
    spans = page.format_map(cells).split("where both sized the same program")[1]
    assert "colocated 0.50-1.00 (2)" in spans


@pytest.mark.skipif(importlib.util.find_spec("libtpu") is not None,
                    reason="the aot extra is installed here")
def test_compile_without_the_compilers_is_one_line_and_writes_nothing(tmp_path, capsys):
    """--compile on a host without libtpu / the CUDA plugin: refused before any work, in
    one line naming the extra, with neither the map nor the records written."""
    out, records = tmp_path / "map.md", tmp_path / "records.json"
    with pytest.raises(SystemExit) as exit_:
        plan_main(["--decision-map", "--compile", "--records", str(records),
                   "--out", str(out)])
    assert exit_.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "pip install -e '.[aot]'" in err[0]
    assert not out.exists() and not records.exists()


def test_speed_counts_every_device_and_names_the_faster_layout():
    """Tokens/s per device: the step's tokens over its time over every device it holds (the
    replicas' too when disaggregated); the faster layout among those that fit, with its
    margin, marked an estimate; where one layout is out of memory the other is the answer."""
    cells = _cells()
    cell = next(c for c in cells if c["pair"] == SMALL.name and c["target"] == "h100:8")
    col, dis = cell["colocated"], cell["disaggregated"]
    assert col["tokens_per_s_per_device"] == pytest.approx(
        cell["tokens_per_step"] / col["step_time_s"] / cell["devices"])
    assert dis["tokens_per_s_per_device"] == pytest.approx(
        cell["tokens_per_step"] / dis["step_time_s"] / dis["devices_total"])
    margin = 100 * (col["tokens_per_s_per_device"] / dis["tokens_per_s_per_device"] - 1)
    assert margin > 0 and page._faster(cell) == \
        f"; faster: colocated by {margin:.0f}% (estimate, unproven)"
    alone = dict(cell, colocated=dict(col, fits=False))  # colocated out of memory
    assert page._faster(alone) == "; faster: disaggregated, the only one that fits"
    assert "- Speed (the planner's estimate)" in page.format_map(cells)


def test_a_steps_cross_host_bytes_take_the_nics_time_hidden_or_added():
    """On two hosts a step's collectives cross the NIC: at the link's rate they are hidden
    under the kernels (overlapped: the longer of the two) or added to them (serialized),
    the disaggregated student's NIC carrying the stream's share too; where the faster
    layout changes between the two ends, the verdict says the overlap decides."""
    cells = _cells()
    cell = next(c for c in cells if c["pair"] == SMALL.name and c["target"] == "h100:2x8")
    cmds = store.compile_commands(cell)
    link = cell["disaggregated"]["link_gbps"] * 1e9 / 8  # bytes/s per device
    figures = {"colocated": (2.0, 1.5 * link), "disaggregated": (2.2, 0.0),
               "replica": (1.0, 0.0)}
    store.attach(cells, {store.command_key(a): _record(
        a, fits=True, total_bytes=2**30, roofline_s=figures[p][0],
        cross_host_bytes=figures[p][1]) for p, a in cmds.items()})
    roof = page.roofline(cell)
    col, dis = roof["colocated"], roof["disaggregated"]
    assert col["nic_s"] == pytest.approx(1.5)
    assert (col["overlapped"]["step_s"], col["serialized"]["step_s"]) == (2.0, 3.5)
    stream_s = cell["disaggregated"]["hidden_bytes_per_step"] / cell["devices"] / link
    assert dis["nic_s"] == pytest.approx(stream_s)
    assert dis["serialized"]["student_s"] == pytest.approx(2.2 + stream_s)
    tokens, n = cell["tokens_per_step"], cell["devices"]
    devices = n + cell["disaggregated"]["replica_devices"]  # one replica keeps up
    assert dis["overlapped"]["tokens_per_s_per_device"] == pytest.approx(
        tokens / 2.2 / devices)
    # colocated faster while its traffic hides, disaggregated when it does not
    assert tokens / 2.0 / n > tokens / 2.2 / devices > tokens / 3.5 / n
    assert "the overlap decides**: colocated by" in page._faster(cell)
    assert "disaggregated by" in page._faster(cell) and page._best(cell) == "either"
    row = next(ln for ln in page.format_map(cells).splitlines()
               if ln.startswith(f"| {SMALL.name} | h100:2x8 |"))
    assert "[NIC 1.50 s a step; serialized 3.50 s" in row and "NIC-bound" not in row
    # more bytes across hosts than the kernels take: the verdict says the NIC binds it
    store.attach(cells, {store.command_key(a): _record(
        a, fits=True, total_bytes=2**30, roofline_s=figures[p][0],
        cross_host_bytes=2 * figures[p][1]) for p, a in cmds.items()})
    assert "colocated **NIC-bound** (3.00 s of cross-host bytes a step against 2.00 s" \
        in page.format_rows([cell])[2]


def test_the_page_counts_the_compiled_programs_outside_the_planners_band():
    """The planner's band is checked on every program the map compiled, each once: one
    compiled at the planner's figure is inside it, one at ten times it is listed outside
    with its ratio and the band's."""
    cells = _cells()
    cell = next(c for c in cells if c["pair"] == SMALL.name and c["target"] == "h100:8")
    cmds = store.compile_commands(cell)
    col, dis = cell["colocated"], cell["disaggregated"]
    figures = {"colocated": col["peak_bytes"], "disaggregated": 10 * dis["peak_bytes"],
               "replica": dis["replica_peak_bytes"]}
    store.attach(cells, {store.command_key(a): _record(a, fits=True, total_bytes=figures[p])
                         for p, a in cmds.items()})
    text = page.format_map(cells)
    assert "held the compiler's figure for 2 of these 3 programs; outside it: " \
           "qwen3.5-9b disaggregated on h100:8 0.10 (band" in text


def test_compiled_rooflines_time_the_layouts_and_decide_the_faster(monkeypatch):
    """Where a cell's programs are compiled, speed is their roofline: the colocated step's
    time; disaggregated, the student's step beside one replica's time per served step,
    with as many replicas as keep the student fed (ceil of the ratio), every device
    counted; the verdict's faster layout then reads the roofline, not the estimate."""
    cells = _cells()
    cell = next(c for c in cells if c["pair"] == SMALL.name and c["target"] == "h100:8")
    cmds = store.compile_commands(cell)
    recs = {p: _record(a, fits=True, total_bytes=2**30, roofline_s=t, cross_host_bytes=0.0)
            for (p, a), t in zip(cmds.items(), (2.0, 1.0, 2.5), strict=True)}
    store.attach(cells, {r["command"]: r for r in recs.values()})
    roof = page.roofline(cell)
    tokens, r_dev = cell["tokens_per_step"], cell["disaggregated"]["replica_devices"]
    assert roof["colocated"]["overlapped"]["tokens_per_s_per_device"] == tokens / 2.0 / 8
    dis = roof["disaggregated"]["overlapped"]  # the stream's NIC time hides under 1 s
    assert (dis["replicas"], dis["step_s"]) == (3, 1.0)  # 2.5 s a step: three keep up
    assert dis["tokens_per_s_per_device"] == tokens / 1.0 / (8 + 3 * r_dev)
    rate = {"colocated": tokens / 16, "disaggregated": dis["tokens_per_s_per_device"]}
    best = max(rate, key=rate.get)
    assert page._faster(cell).startswith(f"; faster: {best} by") and "(roofline)" in \
        page._faster(cell)
    row = next(ln for ln in page.format_map(cells).splitlines()
               if ln.startswith(f"| {SMALL.name} | h100:8 |"))
    assert "**roofline**: col 2.00 s" in row and "col collectives 0.0" in row
    assert "(compiled)" in row
    # Counted by another hlo_count (the HLO is not kept): its memory still reads, its
    # roofline and collectives do not, and --compile compiles it again.
    older = {p: dict(r, hlo_count_version="0" * 16) for p, r in recs.items()}
    store.attach(cells, {r["command"]: r for r in older.values()})
    assert page.roofline(cell) is None and page._fits(cell, "colocated")
    row = next(ln for ln in page.format_map(cells).splitlines()
               if ln.startswith(f"| {SMALL.name} | h100:8 |"))
    assert "roofline from an earlier HLO count" in row and "col collectives -" in row
    asked = []
    records = {r["command"]: r for r in older.values()}
    monkeypatch.setattr(cmd, "run_compile", lambda args: asked.append(args) or recs[
        next(p for p, a in cmds.items() if a == args)])
    monkeypatch.setattr(cmd, "_save", lambda path, records: None)
    cmd._compile_needed([cell], records, {}, Path("unused.json"), [])
    assert sorted(map(store.command_key, asked)) == sorted(records)
    assert all(store.counted(r) for r in records.values())
    # Only figures the page reads are counted again: never an out-of-memory compile's,
    # nor the replica's of a student that does not fit (no disaggregated roofline).
    oom = dict(older["disaggregated"], total_bytes=2**50)
    cell["compiled"] = {"colocated": [older["colocated"]], "disaggregated": [oom],
                        "replica": [older["replica"]]}
    assert store.read_records(cell) == [older["colocated"]]
