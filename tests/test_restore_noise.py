"""The teardown filter of a failed restore drops Orbax's abandoned-read reports on both of
the channels they reach the terminal through, and nothing else.

A read task of Orbax's that fails and is garbage-collected with its error never retrieved
is reported by asyncio's logger ("Task exception was never retrieved"), not through
sys.unraisablehook: the channel that leaked once in a full suite run. The task here runs
a coroutine compiled under an Orbax-like file name (the test double: the real race needs
a damaged checkpoint and a timing that cannot be forced)."""

from __future__ import annotations

import asyncio
import gc
import logging

from hldstudy.checkpoint import install_teardown_filter


def _failing_coroutine(filename: str):
    namespace: dict = {}
    exec(compile("async def async_deserialize():\n    raise ValueError('OUT_OF_RANGE: Requested "
                 "byte range [0, 15826) is not valid for value of size 10')\n",
                 filename, "exec"), namespace)
    return namespace["async_deserialize"]


def _abandon_failed_task(filename: str) -> None:
    loop = asyncio.new_event_loop()
    try:
        task = loop.create_task(_failing_coroutine(filename)())
        loop.run_until_complete(asyncio.sleep(0))  # the task runs and fails
        loop.run_until_complete(asyncio.sleep(0))
        assert task.done()
    finally:
        loop.close()
    del task
    gc.collect()  # Task.__del__: the error was never retrieved -> asyncio logs it


def _logged(caplog, filename: str) -> list[str]:
    caplog.clear()
    with caplog.at_level(logging.ERROR, logger="asyncio"):
        _abandon_failed_task(filename)
    return [r.getMessage() for r in caplog.records if r.name == "asyncio"]


def _remove_filters() -> list[logging.Filter]:
    log = logging.getLogger("asyncio")
    ours = [f for f in log.filters if type(f).__name__ == "_AbandonedReadLogFilter"]
    for f in ours:
        log.removeFilter(f)
    return ours


def test_orbax_abandoned_read_log_is_dropped_and_others_are_kept(caplog):
    orbax_file = "/venv/site-packages/orbax/checkpoint/_src/serialization/serialization.py"
    other_file = "/venv/site-packages/mylib/reader.py"
    installed_before = _remove_filters()  # an earlier restore in this process installed it
    try:
        # Without the filter the report is logged: the double reproduces the leak.
        assert any("Task exception was never retrieved" in m
                   for m in _logged(caplog, orbax_file))
        install_teardown_filter()
        assert _logged(caplog, orbax_file) == []
        kept = _logged(caplog, other_file)
        assert len(kept) == 1 and kept[0].startswith("Task exception was never retrieved")
        install_teardown_filter()  # idempotent: one filter, not two
        assert len(_remove_filters()) == 1
    finally:
        _remove_filters()
        for f in installed_before:
            logging.getLogger("asyncio").addFilter(f)
