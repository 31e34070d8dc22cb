"""Named compile targets: a chip (hldstudy.chips) and how many of them, as devices the
target's own compiler accepts without the hardware.

Design notes: `docs/aot.md`, under this file's name.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
import os
import re
from pathlib import Path

from hldstudy.chips import CHIPS, TPU_DEVICE_KINDS, Chip, chip
from hldstudy.errors import ConfigError, InputError

GPU_TARGETS_DIR = Path(__file__).resolve().parent / "gpu_targets"
# Our chip name -> its target config file in GPU_TARGETS_DIR.
GPU_TARGET_FILES = {"h100": "h100_80gb.txtpb", "a100": "a100_40gb.txtpb", "h200": "h200.txtpb"}
INSTALL_HINT = "pip install -e '.[aot]'"

_TPU_TOPOLOGY = re.compile(r"^\d+(x\d+){1,2}$")


@dataclasses.dataclass(frozen=True)
class Target:
    spec: str       # as given, normalised: "v5e:2x4", "h100:8"
    chip: Chip
    topology: str   # libtpu's "2x4" / the CUDA plugin's "1x1x8" (slices x hosts x devices)
    n_devices: int  # chips (TPU: libtpu may address a chip as more than one device, v4)

    @property
    def platform(self) -> str:
        """"tpu" | "cuda" (what `lowering_platforms` and the plugins call it)."""
        return self.chip.platform

    @property
    def backend(self) -> str:
        """jax.default_backend()'s name on such a machine: "tpu" | "gpu" (what the
        `auto` choices of the model and the losses compare against)."""
        return "gpu" if self.chip.platform == "cuda" else "tpu"


def parse_target(text: str, flag: str = "--target") -> Target:
    """The target `text` names; ConfigError (exit 2, naming `flag`: the option it came
    from) with the spellings otherwise."""
    spec = text.strip().lower()
    m = re.fullmatch(r"(\d+)x([a-z0-9]+)", spec)
    if m and m.group(2) in CHIPS:  # 8xh100
        name, count = m.group(2), m.group(1)
    else:
        name, _, count = spec.partition(":")
    if name not in CHIPS:
        raise ConfigError(flag, f"unknown target {text!r}",
                          f"choose a chip of {', '.join(CHIPS)}: e.g. v5e:2x4, h100:8")
    c = chip(name)
    if c.platform == "tpu":
        if not _TPU_TOPOLOGY.match(count):
            raise ConfigError(flag, f"{text!r} gives no TPU topology",
                              f"e.g. {name}:2x4 or {name}:2x2x1")
        n = 1
        for dim in count.split("x"):
            n *= int(dim)
        return Target(f"{name}:{count}", c, count, n)
    if count == "":
        count = "1"
    hosts, _, per_host = count.rpartition("x")  # h100:2x8: two hosts of 8 GPUs
    if not (hosts or "1").isdigit() or not per_host.isdigit() or int(hosts or 1) < 1 \
            or int(per_host) < 1:
        raise ConfigError(flag, f"{text!r}: the GPU count must be a whole number >= 1, or "
                          "hosts x GPUs per host", f"e.g. {name}:8, 8x{name} or {name}:2x8")
    h, n = int(hosts or 1), int(per_host)
    return Target(f"{name}:{h}x{n}" if h > 1 else f"{name}:{n}", c, f"1x{h}x{n}", h * n)


def gpu_target_config(c: Chip) -> str:
    """The text of chip `c`'s shipped GPU target config."""
    if c.name not in GPU_TARGET_FILES:
        raise ConfigError("--target", f"no GPU target config ships for {c.name!r}",
                          f"choose one of {', '.join(GPU_TARGET_FILES)}")
    return (GPU_TARGETS_DIR / GPU_TARGET_FILES[c.name]).read_text()


def device_kind(c: Chip) -> str:
    """What JAX calls chip `c`'s devices (`device.device_kind`): libtpu's name, the GPU
    target config's description."""
    if c.platform == "tpu":
        return next(kind for kind, name in TPU_DEVICE_KINDS.items() if name == c.name)
    return re.search(r'device_description_str: "([^"]+)"', gpu_target_config(c)).group(1)


def _need(module: str, what: str, target: Target) -> None:
    try:
        found = importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:  # its parent package (jax_plugins) is not installed either
        found = False
    if not found:
        raise InputError(f"compiling for {target.spec} needs {what}, which is not installed "
                         f"(the aot extra: {INSTALL_HINT})")


def check_installed(target: Target) -> None:
    """InputError (exit 2) saying how to install the aot extra when `target`'s compiler
    is missing."""
    if target.platform == "tpu":
        _need("libtpu", "libtpu (the TPU compiler)", target)
    else:
        _need("jax_plugins.xla_cuda12", "the JAX CUDA plugin (the GPU compiler)", target)


def _first_line(exc: BaseException) -> str:
    lines = [ln.strip() for ln in str(exc).splitlines() if ln.strip()]
    return lines[0][:300] if lines else type(exc).__name__


@functools.cache
def _topology_devices(platform: str, chip_name: str, topology: str) -> tuple:
    from jax.experimental import topologies

    if platform == "tpu":
        # Compile-only use opens no TPU, so several processes may load libtpu at once
        # (its lockfile would refuse the second); the hostnames silence libtpu's probe.
        os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
        os.environ.setdefault("TPU_WORKER_HOSTNAMES", "localhost")
        os.environ.setdefault("TPU_SKIP_MDS_QUERY", "1")
        desc = topologies.get_topology_desc(f"{chip_name}:{topology}", "tpu")
    else:
        desc = topologies.get_topology_desc(f"hldstudy-{chip_name}", "cuda",
                                            target_config=gpu_target_config(CHIPS[chip_name]),
                                            topology=topology)
    return tuple(desc.devices)


def devices(target: Target) -> list:
    """The target's compile-only devices (no hardware, no driver). InputError (exit 2)
    when the aot extra is missing or the target's compiler refuses the topology."""
    check_installed(target)
    try:
        devs = list(_topology_devices(target.platform, target.chip.name, target.topology))
    except Exception as e:  # noqa: BLE001 - libtpu / the plugin refuse with their own errors
        raise InputError(f"{'libtpu' if target.platform == 'tpu' else 'the CUDA plugin'} "
                         f"refuses the target {target.spec}: {_first_line(e)} (try another "
                         "topology, e.g. v5e:2x4, v4:2x2x1, v6e:2x2)") from None
    return devs
