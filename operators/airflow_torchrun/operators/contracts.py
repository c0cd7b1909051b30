"""Rank contracts: what an operator adds to every rank's environment, and how its task ends.

The run engine owns the group's life; an operator composes it with one rank contract (training's
checkpoints and MLflow run, evaluation's checkpoint and metrics, ``@task.torchrun``'s function).
A contract is built per try from the task's context and :class:`TaskIO`, and its :meth:`~RankContract.state`
travels through a deferral inside the trigger's event, so a re-entry continues from the event alone.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

from airflow_torchrun.operators.policy import preflight

if TYPE_CHECKING:
    from airflow_torchrun.backends.base import Backend
    from airflow_torchrun.backends.handles import GroupHandle
    from airflow_torchrun.books import TryBooks
    from airflow_torchrun.compat import Context
    from airflow_torchrun.spec import GroupSpec
    from airflow_torchrun.watch import Verdict

T = TypeVar("T")


@dataclass
class TaskIO:
    """What a rank contract may use of its task: the context, the log, XCom, the error policy, storage."""

    context: Context
    where: str  # "task <dag>.<task>", for messages
    log: Any  # the operator's logger
    backend: Backend[Any] | None  # None for a preview (no ranks, no storage)
    preflight_budget: float
    aws_conn_id: str | None = None
    storage_options: Mapping[str, Any] = field(default_factory=dict)
    _resolved: dict[str, Any] | None = field(default=None, repr=False)
    # What this try pushed, kept in memory: OpenLineage's facets are built in a forked process, where
    # an XCom read through the task's supervisor channel hung until the provider killed it.
    pushed: dict[str, Any] = field(default_factory=dict, repr=False)
    # Accounts pushed with ``soon``, not yet sent (see :meth:`push`).
    _soon: dict[str, Any] = field(default_factory=dict, repr=False)

    @property
    def ti(self) -> Any:
        return self.context["ti"]

    @property
    def try_number(self) -> int:
        """The try (from the context alone where there is no task instance: ``airflow-torchrun render``)."""
        ti = self.context.get("ti")
        return int((ti.try_number if ti is not None else self.context.get("try_number")) or 1)

    @property
    def map_index(self) -> int:
        ti = self.context.get("ti")
        index = ti.map_index if ti is not None else self.context.get("map_index", -1)
        return index if isinstance(index, int) else -1

    def push(self, key: str, value: Any, *, soon: bool = False) -> None:
        """XCom ``key``. ``soon``: an account only (what the UI and links show), sent after the next
        push that is not, or by :meth:`flush`: a push is a round trip to the API server, and the
        preflight's accounts would otherwise hold the launch up (the engine's first push follows the
        launch; a try that ends before it flushes on its way out)."""
        self.pushed[key] = value
        if soon:
            self._soon[key] = value
            return
        self._soon.pop(key, None)
        self.ti.xcom_push(key=key, value=value)
        self.flush()

    def flush(self) -> None:
        """Send the accounts pushed with ``soon``, in the order they were pushed; one that cannot be
        sent is a warning (an account, never a reason to fail a try or tear its group down)."""
        while self._soon:
            key = next(iter(self._soon))
            value = self._soon.pop(key)
            try:
                self.ti.xcom_push(key=key, value=value)
            except Exception as exc:
                self.log.warning("Could not publish XCom %s: %s", key, exc)

    def preflight(self, what: str, call: Callable[[], T]) -> T:
        return preflight(call, what=what, where=self.where, budget=self.preflight_budget, log=self.log)

    def resolved_storage_options(self) -> dict[str, Any]:
        """s3fs options: the AWS connection's (through the Amazon provider, once per try), then the
        task's own ``storage_options`` over them."""
        if self._resolved is None:
            options: dict[str, Any] = {}
            if self.aws_conn_id:
                from airflow_torchrun.storage.aws import storage_options_from_aws_conn_id

                conn_id = self.aws_conn_id
                options = self.preflight(
                    "resolving the AWS connection", lambda: storage_options_from_aws_conn_id(conn_id)
                )
            self._resolved = {**options, **self.storage_options}
        return dict(self._resolved)

    def rank_storage_env(self) -> dict[str, str]:
        """The ranks' storage access, as the backend allows it (no credentials in pod specs)."""
        if self.backend is None:
            raise RuntimeError("a preview has no backend: the ranks' storage access is resolved at launch")
        return self.backend.rank_storage_env(self.resolved_storage_options(), self.aws_conn_id, self.log)


class RankContract(Protocol):
    """One try's rank contract (see the module's docstring)."""

    def env(self) -> dict[str, str]:
        """The variables beyond torchrun's for the try's first launch; may do I/O, checked before any
        rank starts (storage, the lineage, tracking: the preflight)."""
        ...

    def relaunch_env(self) -> dict[str, str]:
        """A relaunch's variables within the try: :meth:`env`'s without the preflight it ran in this
        try (storage, lineage and tracking are checked once per try), what changes read anew: the
        resume point. Asked for once the group before is completely gone, so that the resume point
        is what its save on SIGTERM committed."""
        ...

    def preview(self) -> dict[str, str]:
        """What :meth:`env` will give, without I/O (``airflow-torchrun render``)."""
        ...

    def finish(self, handle: GroupHandle, verdict: Verdict, spec: GroupSpec) -> Any:
        """The task's result once every node ended well."""
        ...

    def ended(self, handle: GroupHandle, succeeded: bool) -> None:
        """The try's outcome is known (the group's and :meth:`finish`'s); best effort."""
        ...

    def state(self) -> dict[str, Any]:
        """JSON of what a re-entry after deferral needs to go on (restored by the operator)."""
        ...

    def books(self) -> TryBooks | None:
        """The try's books (goodput ledger, resume audit) the engine keeps and this contract
        publishes; None: none kept (the same object on every call)."""
        ...


class GroupContract:
    """The contract of a bare group: nothing added; the result is the group's id and exit codes."""

    def env(self) -> dict[str, str]:
        return {}

    def relaunch_env(self) -> dict[str, str]:
        return {}

    def preview(self) -> dict[str, str]:
        return {}

    def finish(self, handle: GroupHandle, verdict: Verdict, spec: GroupSpec) -> Any:
        return {"group_id": handle.group_id, "node_exit_codes": [n.exit_code for n in verdict.nodes]}

    def ended(self, handle: GroupHandle, succeeded: bool) -> None:
        return None

    def state(self) -> dict[str, Any]:
        return {}

    def books(self) -> TryBooks | None:
        return None
