"""``make check``'s promise, enforced: the tests it runs start no process.

``make check`` runs the tests not marked ``slow`` with ``--forbid-processes``. While that option is
on, every way Python starts a process (``subprocess``, ``multiprocessing``, ``os.fork``,
``os.posix_spawn``, ``os.system``) raises :class:`ProcessStarted` naming the test, and the test
fails even if it swallowed the exception. A test (or a fixture it uses) that needs a process
belongs in ``make test``: mark it ``@pytest.mark.slow``. So the fast loop cannot quietly grow slow,
and a test left out of it is left out by its marker, visibly.
"""

from __future__ import annotations

import _posixsubprocess  # type: ignore[import-not-found]
import os
import subprocess
import sys
from collections.abc import Callable, Generator
from typing import Any

import pytest

OPTION = "--forbid-processes"


class ProcessStarted(RuntimeError):
    """A test that ``make check`` runs tried to start a process."""


class ProcessGuard:
    """Wraps the process-starting primitives for the whole session; records who used them."""

    def __init__(self) -> None:
        self.current = "(outside any test)"
        self.seen: dict[str, list[str]] = {}
        self._saved: list[tuple[Any, str, Callable[..., Any]]] = []

    def install(self) -> None:
        for owner, name in (
            (subprocess, "_fork_exec"),  # subprocess.Popen (bound from _posixsubprocess at its import)
            (_posixsubprocess, "fork_exec"),  # multiprocessing's spawn and forkserver
            (os, "fork"),
            (os, "forkpty"),
            (os, "posix_spawn"),
            (os, "posix_spawnp"),
            (os, "system"),  # calls C's system(), past fork_exec
        ):
            original = getattr(owner, name, None)
            if original is not None:
                self._saved.append((owner, name, original))
                setattr(owner, name, self._refuse(name, original))

    def uninstall(self) -> None:
        for owner, name, original in reversed(self._saved):
            setattr(owner, name, original)
        self._saved.clear()

    def _refuse(self, name: str, original: Callable[..., Any]) -> Callable[..., Any]:
        def refuse(*args: Any, **kwargs: Any) -> Any:
            if _library_probe():
                return original(*args, **kwargs)
            what = f"{name}({_describe(args)})"
            self.seen.setdefault(self.current, []).append(what)
            raise ProcessStarted(
                f"{self.current} started a process ({what}) but make check runs only tests that start "
                "none: mark the test @pytest.mark.slow (make test runs it)"
            )

        return refuse

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_protocol(self, item: pytest.Item) -> Generator[None, None, None]:
        self.current = item.nodeid
        yield
        self.current = "(outside any test)"

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_makereport(self, item: pytest.Item, call: pytest.CallInfo[None]) -> Generator[None, Any, None]:
        outcome = yield
        report: pytest.TestReport = outcome.get_result()
        started = self.seen.get(item.nodeid)
        if started and report.when == "teardown" and not report.failed:
            report.outcome = "failed"
            report.longrepr = (
                f"{item.nodeid} started {len(started)} process(es) ({'; '.join(started[:3])}): make check runs "
                "only tests that start none; mark it @pytest.mark.slow"
            )

    def pytest_unconfigure(self) -> None:
        self.uninstall()


# Libraries that run a short probe of their own the first time they are used: the standard
# library's platform.processor() (`uname -p`, asked by MLflow's client) and MLflow's look-up of the
# git commit of the code that logs (GitPython runs `git`). No test starts those; they are let through.
LIBRARY_PROBES = ("platform.py", "/git/", "mlflow/utils/git_utils.py")


def _library_probe() -> bool:
    frame = sys._getframe(2)
    while frame is not None:
        if frame.f_code.co_filename.endswith(LIBRARY_PROBES[0]) or any(
            part in frame.f_code.co_filename for part in LIBRARY_PROBES[1:]
        ):
            return True
        frame = frame.f_back
    return False


def _describe(args: tuple[Any, ...]) -> str:
    for arg in args:
        if isinstance(arg, list | tuple) and arg and all(isinstance(a, str | bytes) for a in arg):
            return " ".join(os.fsdecode(a) for a in arg)[:200]
        if isinstance(arg, str | bytes):
            return os.fsdecode(arg)[:200]
    return ""


def addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        OPTION,
        action="store_true",
        help="fail any test that starts a process (make check: the fast loop runs only tests that start none)",
    )


def configure(config: pytest.Config) -> None:
    if config.getoption(OPTION):
        guard = ProcessGuard()
        guard.install()
        config.pluginmanager.register(guard, "process-guard")
