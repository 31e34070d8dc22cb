import os
import shutil
import tempfile

import pytest

# Tests run on the CPU with a few virtual devices so sharded code paths run everywhere.
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=4")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("WANDB_MODE", "disabled")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
# Many tests (and the CLIs they start as subprocesses, which inherit the environment)
# compile the same tiny programs; a session-wide persistent compilation cache compiles
# each once. Same executable, same results, so bitwise comparisons are unaffected. It is
# set here, before anything imports jax (jax reads these variables once, on import), and
# removed when the session ends unless the caller chose the directory.
_OWN_CACHE = "JAX_COMPILATION_CACHE_DIR" not in os.environ
if _OWN_CACHE:
    os.environ["JAX_COMPILATION_CACHE_DIR"] = tempfile.mkdtemp(prefix="hldstudy-jax-cache-")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "-1")


def pytest_unconfigure(config):
    if _OWN_CACHE:
        shutil.rmtree(os.environ["JAX_COMPILATION_CACHE_DIR"], ignore_errors=True)


# --------------------------------------------------------------------------- #
# Session fixtures: built once per test session, read-only for the tests that use them.
# Builders and their configurations: tests/helpers/runs.py.


@pytest.fixture(scope="session")
def tokenizer_path(tmp_path_factory) -> str:
    """The tokenizer of the shared synthetic data (`helpers.runs.data_config()`)."""
    from helpers.runs import prepare_tokenizer

    return prepare_tokenizer(tmp_path_factory.mktemp("shared") / "tokenizer")


@pytest.fixture(scope="session")
def teacher_dir(tmp_path_factory, tokenizer_path):
    """A tiny teacher run directory named `teacher` (`helpers.runs.teacher_config()`),
    trained for 8 steps with checkpoints at steps 4 and 8, on `tokenizer_path`."""
    from helpers.runs import train_teacher

    return train_teacher(tmp_path_factory.mktemp("shared") / "teacher", tokenizer_path)
