"""Which JAX platforms a command starts: the CPU on a machine without an accelerator, and
the accelerator plugins (the `aot` extra: CUDA, libtpu) kept quiet where they cannot run.

Design notes: `docs/infrastructure.md`, under this file's name.
"""

from __future__ import annotations

import contextlib
import glob
import importlib.util
import os
import sys
import tempfile

# What CUDA's stub prints when JAX loads it on a machine without a GPU (each line; the
# absl preamble before it).
_CUDA_STUB_NOISE = ("cudart_stub.cc", "All log messages before absl::InitializeLog()")
# What tells an NVIDIA GPU or a TPU is attached (a device node, or a TPU VM's settings).
_GPU_NODES = ("/dev/nvidiactl", "/dev/nvidia0", "/dev/dxg")
_TPU_GLOBS = ("/dev/accel*", "/dev/vfio/[0-9]*")
_TPU_ENV = ("TPU_ACCELERATOR_TYPE", "TPU_NAME", "TPU_WORKER_HOSTNAMES")


def accelerator_present() -> bool:
    return (any(os.path.exists(p) for p in _GPU_NODES)
            or any(glob.glob(g) for g in _TPU_GLOBS)
            or any(os.environ.get(k) for k in _TPU_ENV))


def _cpu_only() -> bool:
    platforms = os.environ.get("JAX_PLATFORMS", "")
    return bool(platforms) and set(platforms.lower().split(",")) <= {"cpu"}


@contextlib.contextmanager
def _stderr_captured():
    """Everything written to file descriptor 2 in the block (C++ logs included), as a
    list of lines filled when the block ends."""
    lines: list[str] = []
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile(mode="w+b") as tmp:
        os.dup2(tmp.fileno(), 2)
        try:
            yield lines
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            tmp.seek(0)
            lines.extend(tmp.read().decode("utf-8", "replace").splitlines())


def settle() -> None:
    """Called by every command before JAX starts a backend. With accelerator plugins
    installed: on a machine without an accelerator and JAX_PLATFORMS unset, JAX runs on
    the CPU (a host with a GPU or TPU keeps choosing it); and when only the CPU runs, what
    the plugins print while JAX loads them (CUDA's missing drivers, their tracebacks) is
    dropped. Anything else they print, and everything on an accelerator host, passes."""
    if importlib.util.find_spec("jax_plugins") is None:
        return  # no plugin installed: nothing loads, nothing to quiet
    if "JAX_PLATFORMS" not in os.environ and not accelerator_present():
        os.environ["JAX_PLATFORMS"] = "cpu"
        if "jax" in sys.modules:  # read at import: tell a JAX already imported too
            sys.modules["jax"].config.update("jax_platforms", "cpu")
    if "jax" not in sys.modules and _cpu_only():
        # Importing JAX loads CUDA's stub, which says there is no GPU, three times.
        lines: list[str] = []
        try:
            with _stderr_captured() as lines:
                import jax  # noqa: F401
        finally:  # what JAX said besides the stub's lines (all of it, if the import failed)
            for line in lines:
                if not any(n in line for n in _CUDA_STUB_NOISE):
                    print(line, file=sys.stderr)
    from jax._src import xla_bridge

    discover = xla_bridge.discover_pjrt_plugins
    if getattr(discover, "_hldstudy_quiet", False):
        return

    def quiet_discover() -> None:
        if not _cpu_only():
            return discover()
        with _stderr_captured():
            discover()

    quiet_discover._hldstudy_quiet = True
    xla_bridge.discover_pjrt_plugins = quiet_discover
