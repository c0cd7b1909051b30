"""Held at the gate: a rank of a group started while the group before it is still being torn down.

When a group fails and a restart within the try is likely, the run engine starts the next group at
once, in parallel with the failed group's teardown (see ``RunEngine.drive``). Its ranks pay for the
interpreter and torch's imports then, and wait here, before the user's script, until the engine
writes the gate: a JSON file ``{"env": {...}}`` with what only the group before leaves behind (the
resume point its save on SIGTERM committed), resolved once that group is completely gone. torchrun's
own restarts start their workers only after the old ones are gone, and pay for the imports each time.

A held rank runs nothing of the user's: it leaves (exit code 1, one line on stderr) when the gate
is not there within its timeout (the group's ``startup_timeout``: whoever was to open it is gone),
or when its torchrun agent is gone; a teardown's SIGTERM ends it as any rank. Standard library only,
until it imports torch for the script.
"""

from __future__ import annotations

import importlib
import json
import os
import time
from collections.abc import Callable, MutableMapping
from dataclasses import dataclass

from airflow_torchrun.contract.launch import GATE_TIMEOUT_VAR, GATE_VAR, HELD_FILE

POLL_S = 0.01  # a look at the gate every 10 ms: a stat call, next to nothing while held
# What a held rank imports for the script: the costly part of a rank's start (torch alone took
# 2.9 s on a 2-core machine), and torch.distributed is what every torchrun script imports.
PRELOADED = ("torch", "torch.distributed")


@dataclass(frozen=True)
class Held:
    """How a rank waited at its gate (the epoch times its launcher records beside its process group)."""

    imported_at: float  # its imports were done: it was ready
    released_at: float  # the gate was there and its variables applied

    def to_dict(self) -> dict[str, float]:
        return {"imported_at": self.imported_at, "released_at": self.released_at}


class GateError(SystemExit):
    """The rank leaves without running the script: exit code 1, the message on stderr (and in
    torchrun's error file, through the launcher's record)."""


def read_gate(path: str) -> dict[str, str] | None:
    """The gate's variables once the gate is there (written whole, by a rename); None before."""
    try:
        with open(path) as fp:
            data = json.load(fp)
    except FileNotFoundError:
        return None
    except ValueError as exc:
        raise GateError(f"the gate {path} is not valid JSON ({exc}); the group that wrote it is broken") from exc
    env = data.get("env") if isinstance(data, dict) else None
    if not isinstance(env, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in env.items()):
        raise GateError(f"the gate {path} holds no {{'env': {{name: value}}}} mapping")
    return env


def wait_for_gate(
    path: str,
    timeout: float,
    *,
    parent: int,
    parent_now: Callable[[], int] = os.getppid,
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], None] = time.sleep,
) -> dict[str, str]:
    """The gate's variables, once it is there. Raises :class:`GateError` after ``timeout`` seconds,
    or as soon as ``parent`` (the torchrun agent) is no longer this process's parent."""
    deadline = clock() + timeout
    while True:
        env = read_gate(path)
        if env is not None:
            return env
        if parent_now() != parent:
            raise GateError(f"held at the gate {path}, but its torchrun agent (pid {parent}) is gone: not starting")
        if clock() >= deadline:
            raise GateError(
                f"held at the gate {path} for {timeout:g}s (startup_timeout) and it was never opened: the engine "
                "that started this group is gone; not starting"
            )
        sleep(POLL_S)


def hold(environ: MutableMapping[str, str] | None = None) -> Held | None:
    """For a gated rank (``AIRFLOW_TORCHRUN_GATE`` set): import what the script will, wait for the
    gate, add its variables to the environment; None, at once, for any other rank."""
    env = os.environ if environ is None else environ
    path = env.get(GATE_VAR)
    if not path:
        return None
    try:
        timeout = float(env.get(GATE_TIMEOUT_VAR) or "600")
    except ValueError:
        timeout = 600.0
    for module in PRELOADED:
        try:
            importlib.import_module(module)
        except ImportError:  # the script fails on it itself, with its own traceback
            break
    imported_at = time.time()
    _note_ready(env, imported_at)
    released = wait_for_gate(path, timeout, parent=os.getppid())
    env.update(released)
    env.pop(GATE_VAR, None)  # the script's own children are no held ranks
    env.pop(GATE_TIMEOUT_VAR, None)
    return Held(imported_at=imported_at, released_at=time.time())


def _note_ready(env: MutableMapping[str, str], imported_at: float) -> None:
    """``held.json`` beside torchrun's error file: this rank is ready at the gate (an account only)."""
    error_file = env.get("TORCHELASTIC_ERROR_FILE")
    if not error_file:
        return
    try:
        with open(os.path.join(os.path.dirname(error_file), HELD_FILE), "w") as fp:
            json.dump({"imported_at": imported_at, "rank": env.get("RANK", "")}, fp)
    except OSError:
        pass
