"""The exception tree of airflow-torchrun.

Every error says what happened, why it likely happened and what to change.
``InvalidSpecError`` is a ``ValueError`` so that a DAG file with a bad spec fails
to import with the message in Airflow's import-error list.
"""

from __future__ import annotations


class TorchrunError(Exception):
    """Base class of every error raised by airflow-torchrun."""


class InvalidSpecError(TorchrunError, ValueError):
    """The group spec cannot run as written; nothing was started.

    Carries every problem found, not just the first, so one fix-and-reparse cycle is enough.
    """

    def __init__(self, problems: list[str], where: str = "") -> None:
        self.problems = list(problems)
        head = f"Invalid torchrun group spec{f' for {where}' if where else ''}"
        body = "\n".join(f"  - {p}" for p in self.problems)
        super().__init__(f"{head}:\n{body}")


class GroupLaunchError(TorchrunError):
    """The group could not be started (for example the rendezvous port is taken)."""


class GroupFailedError(TorchrunError):
    """A rank of the group failed; the group has been torn down.

    ``retryable`` tells whether running the task again can help (a killed or timed-out rank can,
    a script that does not exist or fails to import cannot).
    """

    def __init__(self, message: str, *, retryable: bool = True) -> None:
        self.retryable = retryable
        super().__init__(message)


class StorageError(TorchrunError):
    """A checkpoint or dataset location cannot be used (bad URI, unreachable, no access)."""
