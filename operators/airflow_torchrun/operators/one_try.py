"""One try of a group task: its engine, driven to a verdict, and the conclusion.

:class:`~airflow_torchrun.operators.group.GroupOperator` holds the task's arguments; this is what
its ``execute`` and ``execute_complete`` do with them. Both modes run through the same engine: sync
watches in the task's process; deferrable watches there for ``defer_after`` seconds, then hands the
group to the triggerer, and the trigger's event carries everything the re-entry needs (the handle,
the launches, the rank contract's state), so :func:`resume` reads nothing back from XCom.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, NoReturn

from airflow_torchrun.backends.base import backend_for_task, backend_from_handle
from airflow_torchrun.compat import AirflowFailException
from airflow_torchrun.errors import InvalidSpecError, TorchrunError
from airflow_torchrun.operators.contracts import TaskIO
from airflow_torchrun.operators.policy import under_policy

if TYPE_CHECKING:
    from airflow_torchrun.backends.base import Backend
    from airflow_torchrun.backends.handles import GroupHandle
    from airflow_torchrun.compat import Context
    from airflow_torchrun.engine import Launches, RunEngine
    from airflow_torchrun.operators.group import GroupOperator
    from airflow_torchrun.spec import GroupSpec
    from airflow_torchrun.watch import Verdict


def start(op: GroupOperator, context: Context) -> Any:
    """A new try: launch the group (after stopping what earlier tries left) and see it to its end."""
    began = time.time()
    spec = _rendered_spec(op)
    engine = _engine(op, context, spec, backend_for_task(spec.backend, op.task_backend_options()))
    return _drive(op, engine, context, lambda: engine.start(began))


def resume(op: GroupOperator, context: Context, event: dict[str, Any]) -> Any:
    """Re-entry after the trigger fired: everything rebuilt from the event, then on as sync mode goes."""
    from airflow_torchrun.triggers import GroupEvent

    group_event = GroupEvent.from_payload(event)
    handle, carry = group_event.handle, group_event.carry
    backend = backend_from_handle(handle)
    op.log.info("Group %s: trigger reported %s", handle.group_id, group_event.status.value)
    try:
        spec = _rendered_spec(op)  # the DAG or a runtime may have changed meanwhile
    except BaseException:
        backend.teardown(handle)  # whatever the trigger saw, nothing may run on unwatched
        raise
    engine = _engine(op, context, spec, backend, dict(carry.get("contract") or {}))
    engine.handle = handle
    launches = engine.restore(carry)
    return _drive(op, engine, context, lambda: (handle, launches), group_event.verdict(), group_event.seen)


def _rendered_spec(op: GroupOperator) -> GroupSpec:
    try:
        return op.group_spec()
    except InvalidSpecError as exc:  # permanent: no Airflow retry can mend it
        raise AirflowFailException(str(exc)) from exc


def _engine(
    op: GroupOperator, context: Context, spec: GroupSpec, backend: Backend[Any], state: dict[str, Any] | None = None
) -> RunEngine:
    """The engine of this try, with its rank contract (resolved anew for every launch); kept on the
    operator for ``on_kill`` and the OpenLineage facets."""
    from airflow_torchrun.engine import RunEngine

    io = TaskIO(
        context=context,
        where=op._where,
        log=op.log,
        backend=backend,
        preflight_budget=float(op.run_settings.preflight_budget),
        aws_conn_id=op.storage_conn_id(),
        storage_options=op.storage_options,
    )
    contract = op.rank_contract(io, state)
    # The engine's pushes go through the task's IO: its first one (after the launch) also sends
    # the accounts the preflight pushed ``soon``.
    op._engine = RunEngine.for_try(
        context, backend, spec, op.run_settings, contract, op.log, killed=op._killed, push=io.push
    )
    op._io = io
    return op._engine


def _drive(
    op: GroupOperator,
    engine: RunEngine,
    context: Context,
    begin: Callable[[], tuple[GroupHandle, Launches]],
    verdict: Verdict | None = None,
    seen: Mapping[str, Any] | None = None,
) -> Any:
    """Watch the group ``begin`` launched (or the trigger handed back, with its ``verdict``) to its
    end, and conclude."""
    try:
        handle, launches = begin()
        engine.deadline = engine.deadline_of(context, op.execution_timeout, handle.launched_at)
        handle, verdict = engine.drive(handle, launches, verdict=verdict, seen=seen, defer=_deferring(op, engine))
    except TorchrunError as exc:  # a launch the API refused, a teardown that did not get through
        raise under_policy(exc, op._where) from exc
    finally:
        # What the preflight pushed ``soon`` (the checkpoint root, the links' placeholders), where no
        # push after the launch sent it: a try that failed before it, a deferral; best effort.
        if op._io is not None:
            op._io.flush()
    return engine.conclude(handle, verdict)


def _deferring(op: GroupOperator, engine: RunEngine) -> Callable[[GroupHandle, Launches], NoReturn] | None:
    """Deferrable mode: hand the group to the trigger (``defer`` raises; the task re-enters later)."""
    if not op.run_settings.deferrable:
        return None

    def defer(handle: GroupHandle, launches: Launches) -> NoReturn:
        op.defer(trigger=engine.trigger(handle, launches), method_name="execute_complete")
        raise AssertionError("defer() returned")  # pragma: no cover - defer always raises

    return defer
