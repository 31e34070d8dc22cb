"""Joining a multi-process JAX job, and what only process 0 decides (below sharding).

Design notes: `docs/infrastructure.md`, under this file's name.
"""

from __future__ import annotations

import contextlib
import errno
import itertools
import os
import socket
import sys
import threading
import time

from hldstudy.errors import EXIT_RUNTIME, HLDError, InputError, RuntimeFault

JAX_VARS = ("JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID")
SLURM_SWITCH = "HLDSTUDY_DISTRIBUTED"
# Seconds a process waits for the others to join (the coordinator's barrier at start).
INIT_TIMEOUT_ENV = "HLDSTUDY_DISTRIBUTED_TIMEOUT_S"
INIT_TIMEOUT_DEFAULT_S = 300
# Seconds a process other than 0 tries to reach the coordinator before giving up: long
# enough for process 0 to start up (imports take a few seconds), well under a minute.
PROBE_ENV = "HLDSTUDY_DISTRIBUTED_PROBE_S"
PROBE_DEFAULT_S = 20
# JAX's own limit is set this far past the watchdog's, so that ours always speaks first.
_JAX_MARGIN_S = 30
_KV_PREFIX = "hldstudy/"
# Every process of a job runs the same program, so the n-th decision has the same number
# on each: a key is never set twice (the store refuses that) when a job decides the same
# thing again (e.g. trains the same run directory twice).
_decisions = itertools.count()


def _env_number(name: str, fix: str, cast=int):
    raw = os.environ.get(name)
    if raw is None or raw.strip() == "":
        return None
    try:
        return cast(raw)
    except ValueError:
        raise InputError(f"{name}={raw!r} is not {'an integer' if cast is int else 'a number'} "
                         f"({fix})") from None


def requested() -> bool:
    """Whether the environment asks for a multi-process job (any of its variables set)."""
    return any(os.environ.get(v, "").strip() for v in JAX_VARS) or \
        os.environ.get(SLURM_SWITCH) == "1"


def under_slurm() -> bool:
    return bool(os.environ.get("SLURM_JOB_ID"))


def check_environment() -> tuple[str | None, int | None, int | None]:
    """(coordinator address, number of processes, process id) from the environment, all
    None under SLURM (JAX reads them there); `InputError` naming what is set and what is
    missing for a partial setting, or a value out of range."""
    if os.environ.get(SLURM_SWITCH) == "1" and under_slurm():
        return None, None, None
    set_ = [v for v in JAX_VARS if os.environ.get(v, "").strip()]
    missing = [v for v in JAX_VARS if v not in set_]
    if missing:
        why = (f"{SLURM_SWITCH}=1 outside SLURM (no SLURM_JOB_ID) needs" if not set_ else
               f"{', '.join(set_)} {'is' if len(set_) == 1 else 'are'} set, so a multi-process "
               "job needs")
        raise InputError(f"incomplete multi-process setting: {why} {', '.join(missing)} too "
                         f"(set all of {', '.join(JAX_VARS)}, or none for one process)")
    address = os.environ["JAX_COORDINATOR_ADDRESS"].strip()
    n = _env_number("JAX_NUM_PROCESSES", "the number of processes of the job")
    pid = _env_number("JAX_PROCESS_ID", "this process's index, 0..JAX_NUM_PROCESSES-1")
    if n < 1:
        raise InputError(f"JAX_NUM_PROCESSES={n} must be >= 1")
    if not 0 <= pid < n:
        raise InputError(f"JAX_PROCESS_ID={pid} must be in 0..{n - 1} (JAX_NUM_PROCESSES={n})")
    split_address(address)
    return address, n, pid


def split_address(address: str) -> tuple[str, int]:
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise InputError(f"JAX_COORDINATOR_ADDRESS={address!r} is not host:port "
                         "(process 0's host name or address and a free port, e.g. node0:12345)")
    return host.strip("[]"), int(port)


def probe_coordinator(address: str, wait_s: float) -> None:
    """Returns once a TCP connect to `address` succeeds; `RuntimeFault` naming it after
    `wait_s` seconds of refused or unanswered connects."""
    host, port = split_address(address)
    deadline = time.monotonic() + wait_s
    reason = "no answer"
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            break
        try:
            with socket.create_connection((host, port), timeout=min(2.0, left)):
                return
        except socket.gaierror as e:
            raise RuntimeFault(f"the coordinator address JAX_COORDINATOR_ADDRESS={address} "
                               f"does not resolve ({e.strerror}); set it to process 0's "
                               "host:port") from None
        except OSError as e:
            reason = e.strerror or str(e) or type(e).__name__
        time.sleep(min(0.5, max(0.0, deadline - time.monotonic())))
    raise RuntimeFault(f"the coordinator at {address} did not answer within {wait_s:g} s "
                       f"({reason}); start process 0 of the job first, or set "
                       f"JAX_COORDINATOR_ADDRESS to process 0's host:port "
                       f"({PROBE_ENV} sets the wait)")


def check_port_free(address: str) -> None:
    """Process 0 serves the coordinator on `address`'s port: `RuntimeFault` when it is
    already taken (JAX would abort)."""
    _, port = split_address(address)
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind(("", port))
        except OSError as e:
            if e.errno == errno.EADDRINUSE:
                raise RuntimeFault(f"process 0 cannot serve the coordinator on port {port} "
                                   f"(JAX_COORDINATOR_ADDRESS={address}): it is in use; pick "
                                   "a free port") from None


# A join still waiting after this many seconds says so (then every _SAY_EVERY_S).
_SAY_AFTER_S = 5.0
_SAY_EVERY_S = 30.0


@contextlib.contextmanager
def _watchdog(seconds: float, address: str | None, n: int | None, pid: int | None):
    """Says what the block waits for while it waits (after 5 s, then every 30 s), and ends
    the process with one line and exit code 3 if it is still running after `seconds`
    (JAX's own timeout aborts with a C++ stack instead)."""
    done = threading.Event()
    who = f"process {pid} of {n}" if pid is not None else "this process"
    where = f"coordinator {address or 'from SLURM'}"

    def fire():
        start = time.monotonic()
        next_say = _SAY_AFTER_S
        while True:
            left = seconds - (time.monotonic() - start)
            if done.wait(max(0.0, min(left, next_say - (time.monotonic() - start)))):
                return
            waited = time.monotonic() - start
            if waited >= seconds:
                break
            if waited >= next_say:
                print(f"hldstudy: {who} is waiting for the other processes of the job to "
                      f"join ({where}): {waited:.0f} s of {seconds:g} s ({INIT_TIMEOUT_ENV})",
                      file=sys.stderr, flush=True)
                next_say = waited + _SAY_EVERY_S
        print(f"hldstudy: error: the multi-process job did not start within {seconds:g} s "
              f"({who}, {where}): start every process of the job, or raise "
              f"{INIT_TIMEOUT_ENV}", file=sys.stderr, flush=True)
        os._exit(EXIT_RUNTIME)

    thread = threading.Thread(target=fire, name="hldstudy-join-watchdog", daemon=True)
    thread.start()
    try:
        yield
    finally:
        done.set()


def initialize() -> None:
    """Joins the multi-process job the environment describes; a no-op when it describes
    none, and when already joined. Must run before anything uses a JAX device."""
    if not requested():
        return
    import jax
    from jax._src import xla_bridge

    if jax.distributed.is_initialized():
        return
    address, n, pid = check_environment()
    if xla_bridge.backends_are_initialized():
        raise RuntimeFault("the multi-process job cannot be joined: JAX already started its "
                           "devices in this process (call "
                           "hldstudy.sharding.maybe_initialize_distributed() first)")
    timeout = _env_number(INIT_TIMEOUT_ENV, "seconds to wait for the other processes")
    timeout = timeout or INIT_TIMEOUT_DEFAULT_S
    probe = _env_number(PROBE_ENV, "seconds to try reaching the coordinator", float)
    probe = PROBE_DEFAULT_S if probe is None else probe
    probe = min(probe, timeout)  # the job's whole start-up is bounded by its timeout
    if address is not None and pid == 0:
        check_port_free(address)
    elif address is not None:
        probe_coordinator(address, probe)
    # CPU collectives between processes (gloo is JAX's default; said here, not assumed).
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    with _watchdog(timeout, address, n, pid):
        jax.distributed.initialize(address, n, pid,
                                   initialization_timeout=timeout + _JAX_MARGIN_S)


def _client():
    from jax._src import distributed as jax_distributed

    return jax_distributed.global_state.client


@contextlib.contextmanager
def primary_decides(name: str, enter):
    """Runs the context manager `enter()` on process 0 only; every process of the job
    gets its outcome: when process 0's `enter` raises an `HLDError`, the others raise the
    same message (and exit code) instead of waiting on it in a collective."""
    import jax

    if jax.process_count() == 1:
        with enter() as value:
            yield value
        return
    key = f"{_KV_PREFIX}{next(_decisions)}/{name}"
    timeout_ms = 1000 * (_env_number(INIT_TIMEOUT_ENV, "seconds") or INIT_TIMEOUT_DEFAULT_S)
    if jax.process_index() != 0:
        outcome = _client().blocking_key_value_get(key, timeout_ms)
        if outcome != "ok":
            code, _, message = outcome.partition(":")
            fault = RuntimeFault(message) if int(code) == EXIT_RUNTIME else InputError(message)
            raise fault
        yield None
        return
    try:
        cm = enter()
        value = cm.__enter__()
    except HLDError as e:
        _client().key_value_set(key, f"{e.exit_code}:{e}")
        raise
    _client().key_value_set(key, "ok")
    with contextlib.ExitStack() as stack:
        stack.push(cm)
        yield value
