"""One teacher replica set for a whole sweep (`python -m hldstudy.sweep SWEEP --cohort K
--teacher-replicas N`).

Design notes: `docs/sweeps.md`, under this file's name.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import secrets
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from hldstudy.config import save_config
from hldstudy.distill import methods
from hldstudy.distill.base import make_strategy
from hldstudy.errors import ConfigError, InputError, RuntimeFault
from hldstudy.fileio import write_text_atomic
from hldstudy.sweep.cohort_exec import cohort_id
from hldstudy.sweep.spec import Run
from hldstudy.teacher import protocol as proto
from hldstudy.teacher.base import method_needs
from hldstudy.teacher.remote import GrpcLink, ReplicaDown, Security
from hldstudy.teacher_source import SCHEME, is_remote

log = logging.getLogger("hldstudy.sweep")

TEACHER_DIR = ".sweep/teacher"
STATS_FILE = "stats.json"
EXECUTORS = ("local", "slurm")


@dataclass(frozen=True)
class ReplicaOptions:
    """How the sweep's replica set runs. replicas: how many; window / lag_timeout_s: the
    fan-out window and laggard deadline (`hldstudy.teacher.fanout`); ready_timeout_s: the
    bound on the wait for every replica to answer; restarts: how often a local replica
    that dies is started again; stop_grace_s: SIGTERM to SIGKILL."""

    replicas: int
    window: int = 4
    lag_timeout_s: float = 20.0
    ready_timeout_s: float = 600.0
    restarts: int = 3
    stop_grace_s: float = 20.0

    def __post_init__(self):
        if isinstance(self.replicas, bool) or not isinstance(self.replicas, int) \
                or self.replicas < 1:
            raise ConfigError("--teacher-replicas", f"must be an integer >= 1, got "
                              f"{self.replicas!r}", "one replica set serves every cohort; "
                              "start at least one")
        if isinstance(self.window, bool) or not isinstance(self.window, int) or self.window < 1:
            raise ConfigError("--teacher-window", f"must be an integer >= 1, got {self.window!r}")
        for name, v in (("--teacher-lag-timeout-s", self.lag_timeout_s),
                        ("--teacher-ready-timeout-s", self.ready_timeout_s),
                        ("stop_grace_s", self.stop_grace_s)):
            if isinstance(v, bool) or not isinstance(v, (int, float)) \
                    or not 0 < v < math.inf:
                raise ConfigError(name, f"must be a positive number of seconds, got {v!r}")
        if isinstance(self.restarts, bool) or not isinstance(self.restarts, int) \
                or self.restarts < 0:
            raise ConfigError("restarts", f"must be an integer >= 0, got {self.restarts!r}")


@dataclass(frozen=True)
class GridMember:
    """One cohort's trainer process, as the replicas declare it: its id (the cohort id),
    method, the teacher's final state (and head) and the block layers its stages need."""

    id: str
    method: str
    final: bool
    layers: tuple[int, ...]
    runs: tuple[str, ...]

    def declaration(self) -> str:
        return f"{self.id}=" + ",".join((["final"] if self.final else [])
                                        + [str(i) for i in self.layers])


def cohort_spec(members: list[GridMember]) -> str:
    """The replicas' `--cohort` text."""
    return ";".join(m.declaration() for m in members)


def union_layers(members: list[GridMember]) -> tuple[bool, tuple[int, ...]]:
    return (any(m.final for m in members),
            tuple(sorted({i for m in members for i in m.layers})))


def grid_members(cohorts: list[list[Run]], teacher_model) -> list[GridMember]:
    """One member per cohort (those that still train) of a method that needs a teacher;
    its layers the union over the method's stages (`method_needs`, range-checked against `teacher_model`: a layer the
    teacher does not have is a ConfigError naming the run)."""
    out = []
    for members in cohorts:
        lead = members[0]
        if not methods.get(lead.method).needs_teacher:
            continue
        cfg = lead.config
        try:
            needs = method_needs(make_strategy(cfg, cfg.model, teacher_model), teacher_model)
        except ConfigError as e:
            raise ConfigError(e.field, f"run {lead.run_id} ({lead.method}): the teacher "
                              f"({teacher_model.n_layers} layers) cannot serve it: "
                              f"{str(e).split(': ', 1)[-1]}") from None
        out.append(GridMember(cohort_id(members), lead.method, needs.final, needs.layers,
                              tuple(r.run_id for r in members)))
    return out


def check_grid(runs: list[Run], options: ReplicaOptions) -> None:
    """ConfigError unless one replica set can serve every run that needs a teacher: the
    same data (so the same `batch_at(step)`), teacher checkpoint and dtype, a local
    checkpoint to serve, and a `teacher.timeout_s` above the lag timeout."""
    taught = [r for r in runs if methods.get(r.method).needs_teacher]
    if not taught:
        raise ConfigError("--teacher-replicas", "no run of this sweep needs a teacher",
                          "drop --teacher-replicas")
    ref = taught[0].config
    if not ref.teacher.checkpoint or is_remote(ref.teacher.checkpoint):
        raise ConfigError("teacher.checkpoint", f"{ref.teacher.checkpoint!r} is not a local "
                          "checkpoint the sweep's replicas can load",
                          "give the teacher's run directory, .gguf file or HF directory")
    for r in taught[1:]:
        c = r.config
        for name, mine, theirs in (("data", c.data, ref.data),
                                   ("teacher.checkpoint", c.teacher.checkpoint,
                                    ref.teacher.checkpoint),
                                   ("teacher.dtype", c.teacher.dtype, ref.teacher.dtype)):
            if mine != theirs:
                field = name
                if name == "data":
                    diff = [f.name for f in dataclasses.fields(mine)
                            if getattr(mine, f.name) != getattr(theirs, f.name)]
                    field = f"data.{diff[0]}"
                raise ConfigError(field, f"runs {taught[0].run_id} and {r.run_id} differ; one "
                                  "teacher replica set serves runs that read the same batches "
                                  "from the same teacher", "make them equal, or run the "
                                  "methods as separate sweeps (--methods)")
    for r in taught:
        if r.config.teacher.timeout_s <= options.lag_timeout_s:
            raise ConfigError("teacher.timeout_s", f"{r.config.teacher.timeout_s:g} s (run "
                              f"{r.run_id}) is not above the replicas' lag timeout "
                              f"({options.lag_timeout_s:g} s): a member waiting for the "
                              "slowest would take the replica for dead",
                              f"--set teacher.timeout_s={2 * options.lag_timeout_s:g} or a "
                              "lower --teacher-lag-timeout-s")


# --------------------------------------------------------------------------- #
# The replica set
# --------------------------------------------------------------------------- #


def last_error_line(log_path: Path) -> str:
    """The replica's one-line error (its `...: error: ...` line), else its last line."""
    try:
        lines = [ln.strip() for ln in log_path.read_text(errors="replace").splitlines()
                 if ln.strip()]
    except OSError:
        return "(no log)"
    errors = [ln for ln in lines if ": error: " in ln]
    return (errors or lines or ["(empty log)"])[-1][:400]


class ReplicaSet:
    """N replicas serving `members` for the sweep in `workdir` (see the module doc).
    `with ReplicaSet(...) as rs:` starts them and waits until they answer; `rs.spec` is
    the `remote://` address list the trainers dial, `rs.token_file` their secret."""

    def __init__(self, members: list[GridMember], config, workdir: Path,
                 options: ReplicaOptions, launcher):
        self.members, self.config, self.options = members, config, options
        self.launcher = launcher
        self.dir = Path(workdir) / TEACHER_DIR
        self.replicas: list = []
        self.addresses: list[str | None] = []
        self.restarted = [0] * options.replicas
        self._stopping = threading.Event()
        self._monitor: threading.Thread | None = None
        self.token_file: str | None = None
        self.stats: dict = {}

    # ----------------------------------------------------------- start / stop

    def __enter__(self) -> ReplicaSet:
        try:
            self.start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    @property
    def spec(self) -> str:
        return SCHEME + ",".join(a for a in self.addresses if a)

    def _argv(self, index: int, port: int) -> list[str]:
        cfg_path = self.dir / "replica_config.json"
        if not cfg_path.exists():
            save_config(self.config, cfg_path)
        argv = ["--config", str(cfg_path.absolute()),
                "--checkpoint", str(self.config.teacher.checkpoint),
                "--cohort", cohort_spec(self.members), "--window", str(self.options.window),
                "--lag-timeout-s", f"{self.options.lag_timeout_s:g}",
                "--max-streams", str(2 * len(self.members) + 2),
                "--host", self.launcher.bind_host, "--port", str(port),
                "--workdir", str((self.dir / f"replica{index}").absolute()),
                "--address-file", str(self._address_file(index).absolute())]
        if self.token_file:
            argv += ["--token-file", self.token_file]
        return argv

    def _address_file(self, index: int) -> Path:
        return self.dir / f"replica{index}.address"

    def _launch(self, index: int, port: int = 0):
        self._address_file(index).unlink(missing_ok=True)
        log_path = self.dir / f"replica{index}.log"
        return self.launcher.launch(index, self._argv(index, port), log_path)

    def start(self) -> None:
        self.dir.mkdir(parents=True, exist_ok=True)
        (self.dir / "replica_config.json").unlink(missing_ok=True)  # this launch's config
        if self.launcher.bind_host != "127.0.0.1":
            token = self.dir / "token"
            token.unlink(missing_ok=True)
            fd = os.open(token, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)  # never readable
            with os.fdopen(fd, "w") as f:                                      # by others
                f.write(secrets.token_hex(32) + "\n")
            self.token_file = str(token.absolute())
        n = self.options.replicas
        self.addresses = [None] * n
        for i in range(n):
            self.replicas.append(self._launch(i))
        deadline = time.monotonic() + self.options.ready_timeout_s
        for i in range(n):
            self.addresses[i] = self._wait_ready(i, deadline)
        if self.launcher.restartable:
            self._monitor = threading.Thread(target=self._watch, daemon=True,
                                             name="teacher-replicas")
            self._monitor.start()

    def _wait_ready(self, index: int, deadline: float) -> str:
        """The replica's address once it has written it and answers Info; a one-line
        error naming the replica (and its log) when it exits or the wait runs out."""
        rep = self.replicas[index]
        name = f"teacher replica {index} ({rep.name}, log {rep.log_path})"
        while True:
            code = rep.exit_code()
            if code is not None:
                line = last_error_line(rep.log_path)
                cls = InputError if code == 2 else RuntimeFault
                raise cls(f"{name} exited with code {code} before it answered: {line}")
            f = self._address_file(index)
            if f.exists():
                address = f.read_text().strip()
                link = GrpcLink(address, timeout_s=5.0, security=self._security())
                try:
                    link.info()
                    return address
                except ReplicaDown:
                    pass
                finally:
                    link.close()
            if time.monotonic() > deadline:
                raise RuntimeFault(f"{name} did not answer within "
                                   f"{self.options.ready_timeout_s:g} s "
                                   "(--teacher-ready-timeout-s); its last line: "
                                   f"{last_error_line(rep.log_path)}")
            time.sleep(0.2)

    def _security(self):
        return Security(proto.read_token(self.token_file, "token") if self.token_file
                        else None)

    def _watch(self) -> None:
        """Restarts a local replica that died, on its port (the trainers' rings take it
        back when it answers), at most `restarts` times each."""
        while not self._stopping.wait(0.5):
            for i, rep in enumerate(self.replicas):
                code = rep.exit_code()
                if code is None or self._stopping.is_set():
                    continue
                if self.restarted[i] >= self.options.restarts:
                    continue
                port = int(self.addresses[i].rpartition(":")[2])
                self.restarted[i] += 1
                log.warning("teacher replica %d (%s) exited with code %s: %s; restarting it on "
                            "port %d (%d of %d)", i, rep.name, code,
                            last_error_line(rep.log_path), port, self.restarted[i],
                            self.options.restarts)
                self.replicas[i] = self._launch(i, port)

    def read_stats(self) -> dict:
        """{address: the replica's counters (None if it does not answer)}."""
        security = self._security()
        out = {}
        for a in self.addresses:
            if a is None:
                continue
            try:
                out[a] = GrpcLink(a, timeout_s=5.0, security=security).stats()
            except Exception:  # noqa: BLE001 - a dead replica has no counters
                out[a] = None
        return out

    def stop(self) -> None:
        """Reads the counters (WORKDIR/.sweep/teacher/stats.json), stops every replica."""
        self._stopping.set()
        if self._monitor is not None:
            self._monitor.join(5.0)
        if self.replicas and any(self.addresses):
            self.stats = self.read_stats()
            record = {"members": [dataclasses.asdict(m) for m in self.members],
                      "restarts": self.restarted, "replicas": self.stats}
            write_text_atomic(self.dir / STATS_FILE, json.dumps(record, indent=2) + "\n")
        for rep in self.replicas:
            rep.stop(self.options.stop_grace_s)
        if self.token_file:
            Path(self.token_file).unlink(missing_ok=True)

    def summary(self) -> str:
        """One line: forwards, recomputed, members, per replica."""
        parts = []
        for a, s in self.stats.items():
            if s is None:
                parts.append(f"{a}: no answer")
                continue
            parts.append(f"{a}: {s.get('forwards', 0)} forwards ({s.get('recomputed', 0)} "
                         f"recomputed)")
        return (f"teacher replicas for {len(self.members)} cohort(s): " + "; ".join(parts)
                + f" (counters in {self.dir / STATS_FILE})")
