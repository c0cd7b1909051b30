"""The function-call wire format of ``@task.torchrun``: how the operator ships a function to every rank.

Two variables of every rank's environment (the same on both backends): ``AIRFLOW_TORCHRUN_FUNCTION_SOURCE``
(the function's source, its decorators removed) and ``AIRFLOW_TORCHRUN_FUNCTION_CALL`` (JSON: name,
file and first line, rendered arguments, where rank 0 writes its result, the process group
backend). Built by :mod:`airflow_torchrun.decorators`, run by :mod:`airflow_torchrun.worker.function`.
Standard library only.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from airflow_torchrun.contract.launch import FUNCTION_ENTRY

SOURCE_ENV = "AIRFLOW_TORCHRUN_FUNCTION_SOURCE"

CALL_ENV = "AIRFLOW_TORCHRUN_FUNCTION_CALL"


# Linux refuses to exec with one "NAME=value" string longer than MAX_ARG_STRLEN (32 pages,
# 131072 bytes), in the Airflow worker and in every pod alike; this leaves room for the name.
ENV_VALUE_LIMIT = 128 * 1024 - 1024

AUTO = "auto"


@dataclass(frozen=True)
class FunctionCall:
    """What one rank runs: the function and its arguments, as shipped."""

    name: str
    source: str
    filename: str
    first_line: int
    args: list[Any]
    kwargs: dict[str, Any]
    result_uri: str | None
    process_group_backend: str | None = AUTO

    def call_json(self) -> str:
        return json.dumps(
            {
                "name": self.name,
                "filename": self.filename,
                "first_line": self.first_line,
                "args": self.args,
                "kwargs": self.kwargs,
                "result_uri": self.result_uri,
                "process_group_backend": self.process_group_backend,
            },
            sort_keys=True,
        )

    def to_env(self) -> dict[str, str]:
        return {SOURCE_ENV: self.source, CALL_ENV: self.call_json()}

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> FunctionCall:
        missing = [v for v in (SOURCE_ENV, CALL_ENV) if not env.get(v)]
        if missing:
            raise RuntimeError(
                f"{' and '.join(missing)} not set: python -m {FUNCTION_ENTRY} runs inside the ranks of a "
                "@task.torchrun task, which sets them"
            )
        call = json.loads(env[CALL_ENV])
        return cls(
            name=call["name"],
            source=env[SOURCE_ENV],
            filename=call["filename"],
            first_line=int(call["first_line"]),
            args=list(call["args"]),
            kwargs=dict(call["kwargs"]),
            result_uri=call.get("result_uri"),
            process_group_backend=call.get("process_group_backend", AUTO),
        )
