"""The pure, frozen description of a training group, validated once.

Nothing here does I/O beyond checking that a local script path exists; nothing here imports
Airflow or torch. Each backend renders the same spec (see :mod:`airflow_torchrun.wiring`).
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

from airflow_torchrun.backends import DEFAULT_BACKEND, backend_names
from airflow_torchrun.contract import CONTRACT_ENV
from airflow_torchrun.errors import InvalidSpecError

DEFAULT_RDZV_TIMEOUT = 900.0
DEFAULT_STARTUP_TIMEOUT = 600.0
DEFAULT_TEARDOWN_GRACE = 10.0

_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
# Variables the operator owns; letting a user set them would silently break the group.
RESERVED_ENV = frozenset(
    {
        "RANK",
        "LOCAL_RANK",
        "WORLD_SIZE",
        "LOCAL_WORLD_SIZE",
        "GROUP_RANK",
        "MASTER_ADDR",
        "MASTER_PORT",
        "TORCHELASTIC_RUN_ID",
        "TORCHELASTIC_ERROR_FILE",
        "AIRFLOW_TORCHRUN_GROUP_ID",
        "AIRFLOW_TORCHRUN_NODE_RANK",
        "AIRFLOW_TORCHRUN_GATE",
        "AIRFLOW_TORCHRUN_GATE_TIMEOUT",
    }
)


def is_templated(value: object) -> bool:
    """True when ``value`` is only known at run time: Jinja markup, or an upstream task's output
    (an ``XComArg``); either is checked again after rendering."""
    if isinstance(value, str):
        return "{{" in value or "{%" in value
    return callable(getattr(value, "resolve", None)) and callable(getattr(value, "iter_references", None))


def placeholder(what: str) -> str:
    """The text that stands for ``what`` until a run makes it (an upstream output, say)."""
    return f"<{what}, resolved at run time>"


def with_placeholders(value: Any) -> Any:
    """``value`` with each upstream output (an ``XComArg``, in lists and dicts too) replaced by text that
    names it: what ``airflow-torchrun render`` and the parse-time checks see before it exists."""
    if is_templated(value) and not isinstance(value, str):
        names = ", ".join(f"{key!r} of task {op.task_id}" for op, key in value.iter_references())
        return placeholder(f"XCom {names}")
    if isinstance(value, list | tuple):
        return type(value)(with_placeholders(v) for v in value)
    if isinstance(value, Mapping):
        return {k: with_placeholders(v) for k, v in value.items()}
    return value


@dataclass(frozen=True)
class GroupSpec:
    """What to run and on how many agents.

    Build it with :meth:`create`, which validates; the dataclass itself never changes.
    """

    num_nodes: int
    nproc_per_node: int
    script: str | None = None
    command: tuple[str, ...] = ()
    script_args: tuple[str, ...] = ()
    env: Mapping[str, str] = field(default_factory=lambda: MappingProxyType({}))
    backend: str = DEFAULT_BACKEND
    runtime: str | None = None
    rdzv_port: int | None = None
    rdzv_timeout: float = DEFAULT_RDZV_TIMEOUT
    startup_timeout: float = DEFAULT_STARTUP_TIMEOUT
    teardown_grace: float = DEFAULT_TEARDOWN_GRACE
    threads_per_proc: int | None = None

    @property
    def world_size(self) -> int:
        return self.num_nodes * self.nproc_per_node

    @classmethod
    def create(
        cls,
        *,
        num_nodes: object = 1,
        nproc_per_node: object = 1,
        script: object = None,
        command: object = None,
        script_args: object = (),
        env: object = None,
        backend: object = DEFAULT_BACKEND,
        runtime: object = None,
        rdzv_port: object = None,
        rdzv_timeout: object = DEFAULT_RDZV_TIMEOUT,
        startup_timeout: object = DEFAULT_STARTUP_TIMEOUT,
        teardown_grace: object = DEFAULT_TEARDOWN_GRACE,
        threads_per_proc: object = None,
        where: str = "",
        allow_templates: bool = False,
    ) -> GroupSpec:
        """Validate raw (possibly user-typed) values and return a frozen spec.

        With ``allow_templates`` (DAG parse time) values that still hold Jinja markup are not
        checked; the operator validates again once they are rendered. At parse time a value is
        what the DAG author wrote, so it must have its type (``2``, not ``'2'``; ``env`` values
        text); rendered values are text, and numbers in it are taken.
        """
        problems: list[str] = []

        def positive_int(name: str, value: object, hint: str) -> int:
            if allow_templates and is_templated(value):
                return 1  # checked again once rendered
            if allow_templates and isinstance(value, str):
                problems.append(
                    f"{name}={value!r} is text; write {name}={value.strip()} (a whole number)"
                    if value.strip().isdigit()
                    else f"{name} must be a whole number, got {value!r} (str)"
                )
                return 1
            if isinstance(value, str) and value.strip().isdigit():
                value = int(value)  # a rendered template ("{{ params.num_nodes }}" -> "2")
            if isinstance(value, bool) or not isinstance(value, int):
                problems.append(f"{name} must be a whole number, got {value!r} ({type(value).__name__})")
                return 1
            if value < 1:
                problems.append(f"{name} must be at least 1, got {value}. {hint}")
                return 1
            return value

        def seconds(name: str, value: object) -> float:
            if isinstance(value, bool) or not isinstance(value, int | float) or value <= 0:
                problems.append(f"{name} must be a positive number of seconds, got {value!r}")
                return 1.0
            return float(value)

        n = positive_int("num_nodes", num_nodes, "It is the number of torchrun agents (machines or pods).")
        p = positive_int("nproc_per_node", nproc_per_node, "It is the number of ranks each agent starts.")

        if (script is None) == (command is None or command == ()):
            problems.append(
                "give exactly one of script (a path to a Python training script) or command "
                "(a list: an executable and its arguments, run by torchrun with --no-python)"
            )
        script_str: str | None = None
        if script is not None:
            if not isinstance(script, str) or not script.strip():
                problems.append(f"script must be a non-empty path string, got {script!r}")
            else:
                script_str = script
                if not is_templated(script) and not script.endswith(".py"):
                    problems.append(
                        f"script {script!r} is not a .py file; to run another executable use command=[...] instead"
                    )
        cmd: tuple[str, ...] = ()
        if command is not None and command != ():
            if isinstance(command, str) or not isinstance(command, Sequence):
                problems.append(f"command must be a list of strings, got {command!r}")
            elif not all(isinstance(c, str) and c for c in command):
                problems.append(f"command must hold non-empty strings only, got {list(command)!r}")
            else:
                cmd = tuple(command)

        if isinstance(script_args, str) or not isinstance(script_args, Sequence):
            problems.append(f"script_args must be a list of strings, got {script_args!r}")
            args: tuple[str, ...] = ()
        else:
            for i, a in enumerate(script_args):
                if isinstance(a, bool) or not (isinstance(a, str | int | float) or is_templated(a)):
                    problems.append(
                        f"script_args[{i}] is {a!r} ({type(a).__name__}): give each argument as text "
                        "(e.g. '--epochs', '3'), a number, or a template"
                    )
            args = tuple(str(a) for a in script_args)

        env_map: dict[str, str] = {}
        if env is None:
            pass
        elif not isinstance(env, Mapping):
            problems.append(f"env must be a mapping of variable name to value, got {type(env).__name__}")
        else:
            for key, value in env.items():
                if not isinstance(key, str) or not _ENV_NAME.match(key):
                    problems.append(f"env: {key!r} is not a valid environment variable name")
                    continue
                if key in RESERVED_ENV:
                    problems.append(
                        f"env: {key} is set by torchrun/airflow-torchrun for every rank and cannot "
                        "be overridden; remove it from env"
                    )
                    continue
                if key in CONTRACT_ENV:
                    # Each comes from an operator argument; a copy in env would disagree with what
                    # the operator checked (storage, the resume point) and recorded.
                    problems.append(
                        f"env: {key} is part of the rank contract the operator sets for every rank; {CONTRACT_ENV[key]}"
                    )
                    continue
                if allow_templates and not isinstance(value, str) and not is_templated(value):
                    problems.append(
                        f"env[{key!r}] is {value!r} ({type(value).__name__}): environment values are text; "
                        f"write {str(value)!r}"
                    )
                    continue
                env_map[key] = str(value)

        names = backend_names()
        if allow_templates and is_templated(backend):
            backend_str = str(backend)  # checked again once rendered
        elif not isinstance(backend, str) or backend not in names:
            problems.append(f"backend {backend!r} is unknown; choose one of {', '.join(names)}")
            backend_str = DEFAULT_BACKEND
        else:
            backend_str = backend

        if runtime is not None and (not isinstance(runtime, str) or not runtime):
            problems.append(f"runtime must be a runtime name (string), got {runtime!r}")

        port: int | None = None
        if rdzv_port is not None:
            if isinstance(rdzv_port, bool) or not isinstance(rdzv_port, int) or not 1 <= rdzv_port <= 65535:
                problems.append(
                    f"rdzv_port must be a TCP port between 1 and 65535, got {rdzv_port!r}; "
                    "leave it unset to have a free port chosen"
                )
            else:
                port = rdzv_port

        threads: int | None = None
        if threads_per_proc is not None:
            threads = positive_int("threads_per_proc", threads_per_proc, "It sets OMP_NUM_THREADS per rank.")

        spec_timeout = seconds("rdzv_timeout", rdzv_timeout)
        spec_startup = seconds("startup_timeout", startup_timeout)
        spec_grace = seconds("teardown_grace", teardown_grace)

        if problems:
            raise InvalidSpecError(problems, where)

        spec = cls(
            num_nodes=n,
            nproc_per_node=p,
            script=script_str,
            command=cmd,
            script_args=args,
            env=MappingProxyType(env_map),
            backend=backend_str,
            runtime=runtime if isinstance(runtime, str) else None,
            rdzv_port=port,
            rdzv_timeout=spec_timeout,
            startup_timeout=spec_startup,
            teardown_grace=spec_grace,
            threads_per_proc=threads,
        )
        spec.check_rendered(where, allow_templates=allow_templates)
        return spec

    def check_rendered(self, where: str = "", *, allow_templates: bool = False) -> None:
        """Checks that need final values: no Jinja left (what a backend cannot run is its own
        question: :meth:`Backend.spec_problems <airflow_torchrun.backends.base.Backend.spec_problems>`)."""
        problems = []
        leftovers = [v for v in (self.script, *self.command, *self.script_args, *self.env.values()) if is_templated(v)]
        if leftovers and not allow_templates:
            problems.append(f"values still hold template markup after rendering: {leftovers!r}")
        if problems:
            raise InvalidSpecError(problems, where)
