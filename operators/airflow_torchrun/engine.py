"""The run engine: attach -> launch -> watch -> relaunch -> finish, for every operator that runs a group.

An operator composes a :class:`RunEngine` with its own rank contract
(:class:`~airflow_torchrun.operators.contracts.RankContract`: the ranks' variables, the task's
result); the engine owns the group's life: it stops or attaches to what earlier tries left,
launches, pushes the handle at once, watches with the one watch (in this process, or in the
triggerer after ``defer_after`` seconds), tears the group down on every way out, decides whether a
group that ended badly is relaunched within the try (:class:`Launches`), and ends the try: the
contract's result, or the failure raised under the error policy (:meth:`RunEngine.conclude`).
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, NoReturn, TypeVar

from airflow_torchrun.backends.base import FailureReport, Relaunch, RelaunchKind
from airflow_torchrun.compat import AirflowException, AirflowFailException, AirflowTaskTimeout
from airflow_torchrun.contract import STOPPED_TO_SAVE_EXIT_CODE
from airflow_torchrun.contract.progress import MARKER
from airflow_torchrun.errors import retry_transient
from airflow_torchrun.operators.policy import NOT_RETRYING
from airflow_torchrun.progress import ProgressThresholds
from airflow_torchrun.status import NodePhase, Outcome
from airflow_torchrun.timeline import XCOM_TIMELINE, Mark, Timeline
from airflow_torchrun.watch import Note, Verdict, Watch, WatchConfig, watch_sync
from airflow_torchrun.wiring import gate_env

if TYPE_CHECKING:
    from airflow_torchrun.backends.base import Backend
    from airflow_torchrun.backends.handles import GroupHandle
    from airflow_torchrun.books import TryBooks
    from airflow_torchrun.naming import GroupIdentity
    from airflow_torchrun.operators.contracts import RankContract
    from airflow_torchrun.settings import RunSettings
    from airflow_torchrun.spec import GroupSpec

T = TypeVar("T")
PORT_RACE_RETRIES = 3
# The trigger fires no sooner than this after the deferral: the deferring process must have been
# reported finished by the executor before the trigger re-queues the task (Airflow 3.3 fails a
# task whose first process reports "success" while it is queued again).
DEFER_SETTLE_SECONDS = 10.0
XCOM_GROUP = "group"
XCOM_LAUNCHES = "launches"
XCOM_RESUME_AUDIT = "resume_audit"
# How the try's last group ended, as the engine concluded it: what the training view shows once the
# group itself is gone (a Kubernetes Job is deleted by the teardown, its pods and logs with it).
XCOM_GROUP_END = "group_end"


@dataclass
class Launches:
    """Relaunches within one try, each kind with its own budget; they never spend Airflow's retries.

    A lost rendezvous-port race (local, up to 3) and a preempted or evicted group (Kubernetes, up
    to ``max_preemptions``) are not the script's fault. A retryable failure of the script (a rank
    killed, a retryable exit code, a hang) is restarted up to ``max_restarts`` (Ray's
    ``max_failures``, JobSet's ``maxRestarts``). Everything else goes to Airflow's retries.
    ``history`` has one entry per relaunch: the group it replaced, the kind and why.
    """

    port_races: int = 0
    preemptions: int = 0
    restarts: int = 0
    history: list[dict[str, Any]] = field(default_factory=list)

    @property
    def count(self) -> int:
        return self.port_races + self.preemptions + self.restarts

    def to_dict(self) -> dict[str, Any]:
        return {
            "port_races": self.port_races,
            "preemptions": self.preemptions,
            "restarts": self.restarts,
            "history": list(self.history),
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any] | None) -> Launches:
        data = data or {}
        return cls(
            port_races=int(data.get("port_races", 0)),
            preemptions=int(data.get("preemptions", 0)),
            restarts=int(data.get("restarts", 0)),
            history=[dict(h) for h in data.get("history") or []],
        )

    def decide(
        self,
        group_id: str,
        relaunch: Relaunch | None,
        verdict: Verdict,
        settings: RunSettings,
        failure: Callable[[], tuple[str, str | None]],
    ) -> tuple[str | None, str | None]:
        """``(why relaunch, None)``, or ``(None, why not)`` / ``(None, None)`` when the try ends here.

        ``relaunch``: the backend's reason to relaunch whatever the budgets of restarts (a port
        race, a preemption); ``failure()``: what failed (the root cause's headline) and why it
        cannot be retried at all (None: it can). A relaunch is counted and recorded in ``history``.
        """
        why, why_not, kind = self._decide(relaunch, verdict, settings, failure)
        if why is not None:
            self.history.append({"group_id": group_id, "kind": kind, "why": why, "at": time.time()})
        return why, why_not

    def _decide(
        self,
        relaunch: Relaunch | None,
        verdict: Verdict,
        settings: RunSettings,
        failure: Callable[[], tuple[str, str | None]],
    ) -> tuple[str | None, str | None, str]:
        if verdict.outcome not in (Outcome.FAILED, Outcome.PROGRESS_TIMEOUT):
            return None, None, ""
        if relaunch is not None and relaunch.kind is RelaunchKind.PORT_RACE:
            if self.port_races >= PORT_RACE_RETRIES:
                return None, f"{relaunch.why}, {self.port_races} time(s) already; failing this try", ""
            self.port_races += 1
            return f"{relaunch.why} (port race {self.port_races} of {PORT_RACE_RETRIES})", None, "port_race"
        if relaunch is not None:
            max_preemptions = settings.max_preemptions
            if self.preemptions >= max_preemptions:
                return (
                    None,
                    (
                        f"the group was disrupted ({relaunch.why}) but its preemption budget is spent "
                        f"({self.preemptions} relaunch(es), max_preemptions={max_preemptions}); failing this try"
                    ),
                    "",
                )
            self.preemptions += 1
            why = f"the group was disrupted ({relaunch.why})"
            return f"{why}, preemption {self.preemptions} of max_preemptions={max_preemptions}", None, "preemption"
        if settings.max_restarts <= 0:
            return None, None, ""
        what, why_permanent = failure()
        if why_permanent:
            return None, f"{what}; not restarting: {why_permanent}", ""
        if self.restarts >= settings.max_restarts:
            return (
                None,
                (
                    f"{what}; the restart budget is spent ({self.restarts} of max_restarts={settings.max_restarts}): "
                    "failing this try (Airflow's retries, if any, take over)"
                ),
                "",
            )
        self.restarts += 1
        left = settings.max_restarts - self.restarts
        return (
            (
                f"{what}; restart {self.restarts} of max_restarts={settings.max_restarts} ({left} left), "
                "resuming from the latest committed checkpoint"
            ),
            None,
            "restart",
        )


def permanent_failure(report: FailureReport, settings: RunSettings) -> str | None:
    """Why a failed group must fail the task without restart or retry; None when it may be retried.

    A signal, a peer's death, the "stopped to save" code and an unknown exit code stay retryable
    whatever the exit-code lists say; the failure's own verdict (an import or syntax error, a
    missing image) is permanent whatever they say.
    """
    if not report.retryable:
        return "the failure is one a retry cannot fix"
    code = report.exit_code
    if report.signal or report.collateral or code is None or code == STOPPED_TO_SAVE_EXIT_CODE:
        return None
    if code in settings.fail_on_exit_codes:
        return f"exit code {code} is in fail_on_exit_codes={list(settings.fail_on_exit_codes)}"
    if settings.retry_on_exit_codes is not None and code not in settings.retry_on_exit_codes:
        return f"exit code {code} is not in retry_on_exit_codes={list(settings.retry_on_exit_codes)}"
    return None


@dataclass
class RunEngine:
    """One task instance's group, from launch (or attach) to the end of the try."""

    backend: Backend[Any]
    spec: GroupSpec
    settings: RunSettings
    log: Any  # the operator's logger
    push: Callable[[str, Any], None]  # XCom push of this try
    identity: Callable[[int], GroupIdentity]  # relaunch number -> identity
    contract: RankContract  # its env is resolved anew for every launch (its resume point)
    deadline: float | None = None  # epoch: the task's execution_timeout
    handle: GroupHandle | None = None
    held: GroupHandle | None = None  # a relaunch started during a teardown, its ranks held at a gate
    killed: bool = False
    timeline: Timeline = field(default_factory=Timeline)
    result: Any = None  # the contract's result once the try succeeded (OpenLineage's facets read it)
    books: TryBooks | None = None  # goodput and the resume audit (the contract's; None: not kept)
    _reports: dict[str, FailureReport] = field(default_factory=dict, repr=False)

    @classmethod
    def for_try(
        cls,
        context: Any,
        backend: Backend[Any],
        spec: GroupSpec,
        settings: RunSettings,
        contract: RankContract,
        log: Any,
        *,
        killed: bool = False,
        push: Callable[[str, Any], None] | None = None,
    ) -> RunEngine:
        """The engine of the try ``context`` is of: its launches are named after its task instance.
        ``push``: how it pushes XCom (the task's own, by default)."""
        from airflow_torchrun.naming import GroupIdentity

        ti = context["ti"]

        def identity(relaunch: int) -> GroupIdentity:
            return GroupIdentity(
                dag_id=ti.dag_id,
                task_id=ti.task_id,
                run_id=ti.run_id,
                try_number=ti.try_number,
                map_index=ti.map_index if ti.map_index is not None else -1,
                relaunch=relaunch,
            )

        return cls(
            backend=backend,
            spec=spec,
            settings=settings,
            log=log,
            push=push or (lambda key, value: ti.xcom_push(key=key, value=value)),
            identity=identity,
            contract=contract,
            killed=killed,
            books=contract.books(),
        )

    @staticmethod
    def deadline_of(context: Any, execution_timeout: Any, fallback: float) -> float | None:
        """The task's ``execution_timeout`` as an epoch deadline, from the try's start."""
        if execution_timeout is None:
            return None
        started = context["ti"].start_date
        start = started.timestamp() if started is not None else fallback
        return float(start + execution_timeout.total_seconds())

    # -- start ----------------------------------------------------------------------------------
    def start(self, began: float | None = None) -> tuple[GroupHandle, Launches]:
        """Stop (local) or attach to (Kubernetes) what earlier tries left; else launch a new group.

        The rank contract is resolved (and storage and tracking checked) once earlier tries are
        stopped, so the resume point sees what their save on SIGTERM committed; before anything is
        attached to or launched, so a bad store fails the task first. ``began``: when the try's
        ``execute()`` began, before this engine was made (the spec's rendering is the try's own time).
        """
        identity = self.identity(0)
        now = time.time()
        self.timeline.mark_once(Mark.TRY_STARTED, now if began is None else began)
        self.timeline.mark_once(Mark.PREPARED, now)
        for group_id in self._calm("stopping earlier tries", lambda: self.backend.stop_earlier_tries(identity)):
            self.log.warning("Stopped group %s, left running by an earlier try of this task", group_id)
        env = self._contract_env(0)
        found = self._calm(
            "looking for a group of an earlier try", lambda: self.backend.find_existing(identity, self.spec)
        )
        if found is not None:
            self.handle = found
            self.timeline.mark(Mark.ATTACHED, time.time(), found.relaunch, group_id=found.group_id)
            self.push(XCOM_GROUP, found.to_dict())
            self.log.info("Attaching to group %s, started by an earlier try of this task", found.group_id)
            # An attached relaunch keeps counting against the preemption budget.
            return found, Launches(preemptions=found.relaunch)
        return self.launch(0, env), Launches()

    def _contract_env(self, launch: int) -> Mapping[str, str]:
        """The rank contract of a launch: the first one's checked (the preflight), a relaunch's only
        read again where it changes (the resume point): the try checked storage and tracking once."""
        self.timeline.mark(Mark.CONTRACT_STARTED, time.time(), launch)
        env = self.contract.env() if launch == 0 else self.contract.relaunch_env()
        self.timeline.mark(Mark.CONTRACT_READY, time.time(), launch)
        return env

    def launch(self, relaunch: int, env: Mapping[str, str] | None = None) -> GroupHandle:
        plan = self.backend.plan(
            self.spec, self.identity(relaunch), self._contract_env(relaunch) if env is None else env
        )
        if self.killed:  # on_kill came while the contract was resolved: launch nothing
            raise AirflowException(f"Group {plan.group_id} was not launched: the task was killed (on_kill)")
        # In deferrable mode this process exits while the group runs: the group must not follow it.
        # A launch that failed left nothing behind, so a transient failure (API 5xx) is tried again.
        self.timeline.mark(Mark.LAUNCH_STARTED, time.time(), relaunch)
        handle = self._calm(
            f"launching group {plan.group_id}",
            lambda: self.backend.launch(plan, watch_caller=not self.settings.deferrable),
        )
        self.handle = handle
        self.timeline.mark(Mark.LAUNCHED, time.time(), relaunch, group_id=handle.group_id)
        try:
            # Push now so that on error (or a dead worker) the group can still be found.
            self.push(XCOM_GROUP, handle.to_dict())
            self.push(XCOM_TIMELINE, self.timeline.to_list())
            self._announce(handle, plan.master_addr, plan.master_port)
        except BaseException:
            self.settle(handle)  # a group nobody watches must not run on
            raise
        return handle

    def _announce(self, handle: GroupHandle, master_addr: str, master_port: int, *, during: str = "") -> None:
        """``during``: the group whose teardown a held launch overlaps (its ranks wait at the gate)."""
        held = (
            f"; a restart is likely: started during the teardown of group {during}, its ranks held before the "
            "script until that group is gone and the resume point read"
            if during
            else ""
        )
        self.log.info(
            "Launched group %s on backend %s: %d node(s) x %d proc(s), world size %d, rendezvous %s:%s%s",
            handle.group_id,
            self.backend.name,
            self.spec.num_nodes,
            self.spec.nproc_per_node,
            self.spec.world_size,
            master_addr,
            master_port,
            held,
        )
        if not during:
            self._log_locations(handle)

    def _log_locations(self, handle: GroupHandle) -> None:
        for path in self.backend.log_locations(handle):
            self.log.info("Group %s log: %s", handle.group_id, path)

    def _calm(self, what: str, call: Callable[[], T]) -> T:
        """A cluster or file-system call under the error policy: transient trouble is retried
        within ``preflight_budget``; past it, or on a permanent error, it is raised."""
        return retry_transient(call, budget=self.settings.preflight_budget, what=what, log=self.log)

    # -- run ------------------------------------------------------------------------------------
    def drive(
        self,
        handle: GroupHandle,
        launches: Launches,
        *,
        verdict: Verdict | None = None,
        seen: Mapping[str, Any] | None = None,
        defer: Callable[[GroupHandle, Launches], NoReturn] | None = None,
    ) -> tuple[GroupHandle, Verdict]:
        """Watch (or take ``verdict`` from the trigger), tear down, relaunch while allowed; the last verdict.

        With ``defer`` (deferrable mode), a group still running after ``defer_after`` seconds is
        handed to the triggerer: ``defer`` raises and this returns only on re-entry (``verdict`` and
        ``seen``: what the trigger's watch decided and saw first).
        """
        if seen:
            self._saw(handle, seen)
        while True:
            if verdict is None:
                verdict = self.watch(handle, launches, defer)
            self._exited(handle, verdict)
            self.timeline.mark(Mark.ENDED, time.time(), handle.relaunch, outcome=verdict.outcome.value)
            held = self._start_held(handle, verdict, launches)
            try:
                why = self._settle_and_decide(handle, verdict, launches)
                if why is None:
                    self._withdraw(held, "no relaunch after all")
                    return handle, verdict
                kind = launches.history[-1]["kind"] if launches.history else ""
                self.timeline.mark(Mark.RELAUNCH, time.time(), handle.relaunch, kind=kind, why=why)
                self.log.warning(
                    "Group %s: %s; relaunching (launch %d of this try)", handle.group_id, why, launches.count + 1
                )
                self.push(XCOM_LAUNCHES, launches.to_dict())
                if held is not None and held.relaunch != launches.count:  # not the launch it was started as
                    self._withdraw(held, f"started as launch {held.relaunch}, but this is launch {launches.count}")
                    held = None
                handle = self.launch(launches.count) if held is None else self._release(held)
            except BaseException:
                self._withdraw(held, "the try stopped before its gate opened", quiet=True)
                raise
            verdict = None

    def _settle_and_decide(self, handle: GroupHandle, verdict: Verdict, launches: Launches) -> str | None:
        """Tear the ended group down, account for it, and decide: why it is relaunched, or None."""
        self.settle(handle, verdict, books=True)
        self._ranks_account(handle)
        relaunch = (
            self.backend.relaunch_reason(handle, verdict.group_status()) if verdict.outcome is Outcome.FAILED else None
        )
        why, why_not = launches.decide(
            handle.group_id, relaunch, verdict, self.settings, functools.partial(self.failure, handle, verdict)
        )
        if why_not:
            self.log.warning("Group %s: %s", handle.group_id, why_not)
        return why

    # -- a relaunch held at a gate during the teardown -------------------------------------------
    def _start_held(self, handle: GroupHandle, verdict: Verdict, launches: Launches) -> GroupHandle | None:
        """When a restart is likely: the next launch started now, while ``handle`` is torn down, its
        ranks held before the script (their interpreters and imports overlap the teardown) until
        :meth:`_release` hands them the rank contract, resolved once ``handle`` is gone. None when a
        restart is not likely, the backend cannot hold ranks, or the start failed (the relaunch then
        launches after the teardown, as it would have). The decision itself is still taken after the
        teardown, from the whole story; a held launch it does not use is withdrawn."""
        s = self.settings
        likely = verdict.outcome in (Outcome.FAILED, Outcome.PROGRESS_TIMEOUT) and launches.restarts < s.max_restarts
        if self.killed or not likely:
            return None
        relaunch = launches.count + 1
        try:
            plan = self.backend.plan_gated(self.spec, self.identity(relaunch))
            if plan is None:
                return None
            if verdict.outcome is Outcome.FAILED and permanent_failure(
                self.backend.explain(handle, verdict.group_status()), s
            ):
                return None  # a failure no restart follows (its story as far as it is known now)
            started = time.time()
            held = self.backend.launch(plan, watch_caller=not s.deferrable)
        except Exception as exc:  # only a head start: the relaunch launches after the teardown instead
            self.log.warning(
                "Group %s: could not start its relaunch during its teardown (%s); it would start after it",
                handle.group_id,
                exc,
            )
            return None
        self.held = held
        self.timeline.mark(Mark.LAUNCH_STARTED, started, relaunch, held=True)
        self.timeline.mark(Mark.LAUNCHED, time.time(), relaunch, group_id=held.group_id, held=True)
        self._announce(held, plan.master_addr, plan.master_port, during=handle.group_id)
        return held

    def _release(self, held: GroupHandle) -> GroupHandle:
        """Open the held launch's gate with the rank contract resolved now (the group before is gone:
        the resume point is what its save on SIGTERM committed); it is the try's group from now on."""
        env = self._contract_env(held.relaunch)
        if self.killed:  # on_kill came while the contract was resolved: nothing runs
            raise AirflowException(f"Group {held.group_id} was not released: the task was killed (on_kill)")
        self._calm(
            f"opening the gate of group {held.group_id}", lambda: self.backend.open_gate(held, gate_env(self.spec, env))
        )
        self.held, self.handle = None, held
        self.timeline.mark(Mark.GATE_OPENED, time.time(), held.relaunch)
        try:
            self.push(XCOM_GROUP, held.to_dict())
            self.push(XCOM_TIMELINE, self.timeline.to_list())
        except BaseException:
            self.settle(held)  # a group nobody watches must not run on
            raise
        self.log.info(
            "Group %s: gate opened, its ranks run (started %.1fs ago, during the teardown before it)",
            held.group_id,
            time.time() - held.launched_at,
        )
        self._log_locations(held)
        return held

    def _withdraw(self, held: GroupHandle | None, why: str, *, quiet: bool = False) -> None:
        """Tear down a held launch whose gate never opened (idempotent: only while it is held).
        ``quiet``: on the way out of an error, a teardown that fails only logs (the error is the story)."""
        if held is None or self.held is not held:
            return
        self.held = None
        self.timeline.mark(Mark.WITHDRAWN, time.time(), held.relaunch, why=why)
        self._publish_timeline()  # also on the way out of an error, which ends the try without a conclusion
        self.log.info("Group %s: withdrawn before its gate opened (%s); tearing it down", held.group_id, why)
        try:
            self._calm(f"tearing down group {held.group_id}", lambda: self.backend.teardown(held))
        except Exception as exc:
            if not quiet:
                raise
            self.log.error("Group %s: tearing it down failed too: %s", held.group_id, exc)

    def watch(
        self, handle: GroupHandle, launches: Launches, defer: Callable[[GroupHandle, Launches], NoReturn] | None
    ) -> Verdict:
        s = self.settings
        config = WatchConfig(
            poll_interval=s.poll_interval,
            progress_timeout=s.progress_timeout,
            deadline=self.deadline,
            error_budget=s.observe_error_budget,
            thresholds=ProgressThresholds.from_conf(),
        )
        until = time.time() + s.defer_after if defer is not None else None
        watch = Watch.of(handle, config, time.time())
        try:
            verdict = watch_sync(
                self.backend,
                handle,
                watch,
                emit=self._emit,
                after_look=lambda: self._after_look(handle),
                until=until,
            )
        except BaseException:
            # on_kill, Airflow's own execution_timeout, the worker told to stop: nothing may stay.
            try:
                self.settle(handle)
            except Exception as exc:  # the reason the watch ended is what the task reports
                self.log.error("Group %s: tearing it down failed too: %s", handle.group_id, exc)
            raise
        self._saw(handle, watch.seen())
        if verdict is None:
            assert defer is not None  # watch_sync returns None only with ``until``
            self.timeline.mark(Mark.DEFERRED, time.time(), handle.relaunch)
            self.push(XCOM_LAUNCHES, launches.to_dict())
            self.push(XCOM_TIMELINE, self.timeline.to_list())
            self.log.info(
                "Group %s still running after %.0fs (defer_after); deferring: the triggerer watches it from now on",
                handle.group_id,
                s.defer_after,
            )
            defer(handle, launches)
        return verdict

    def _saw(self, handle: GroupHandle, seen: Mapping[str, Any]) -> None:
        """What a watch saw first, on the timeline (once per launch: a watch that starts again in
        the triggerer sees the same output for the first time too)."""
        launch = handle.relaunch
        if isinstance(seen.get("running_at"), int | float):
            self.timeline.mark_once(Mark.RUNNING, float(seen["running_at"]), launch)
        if isinstance(seen.get("first_output_at"), int | float):
            self.timeline.mark_once(Mark.FIRST_OUTPUT, float(seen["first_output_at"]), launch)
        if isinstance(seen.get("first_step_at"), int | float):
            step = seen.get("first_step")
            self.timeline.mark_once(Mark.FIRST_STEP, float(seen["first_step_at"]), launch, step=step)

    def close_books(self, handle: GroupHandle) -> None:
        """The launch's account from its ranks' records, and its resume audit (one log line); best effort."""
        books = self.books
        if books is None:
            return
        from airflow_torchrun.audit import AuditMode, AuditStatus
        from airflow_torchrun.books import read_launch_lines

        try:
            result = books.close_launch(handle.relaunch, read_launch_lines(handle))
        except Exception as exc:  # an account of the launch, never a reason to fail it
            self.log.warning(
                "Group %s: could not read its ranks' records for the goodput ledger: %s", handle.group_id, exc
            )
            return
        if result is None:
            return
        level = logging.WARNING if result.status is AuditStatus.DIVERGED else logging.INFO
        if result.status is AuditStatus.DIVERGED and books.mode is AuditMode.FAIL:
            level = logging.ERROR
        self.log.log(level, "Group %s: %s", handle.group_id, result.line())
        try:
            self.push(XCOM_RESUME_AUDIT, result.to_dict())
        except Exception as exc:
            self.log.warning("Could not publish the resume audit: %s", exc)

    def _ledger(self, *, final: bool) -> None:
        """The try's and the task's goodput ledger, as of now, for the contract to publish; at the
        end also XCom ``goodput`` (pushed once: a push is a round trip the task's end waits on), the
        task log's summary line and the try's account kept for later tries."""
        books = self.books
        if books is None:
            return
        from airflow_torchrun.goodput import XCOM_GOODPUT, summary_line

        try:
            published = books.make_ledger(self.timeline, time.time())
            if not final:
                return
            self.push(XCOM_GOODPUT, published)
            if books.ledger is not None and books.task is not None:
                self.log.info("%s", summary_line(books.ledger, books.task))
                books.keep()
        except Exception as exc:  # an account of the try, never a reason to fail it
            self.log.warning("Could not make the try's goodput ledger: %s", exc)

    def _exited(self, handle: GroupHandle, verdict: Verdict) -> None:
        """When the group ended on its nodes (the backend's record), before the watch's verdict."""
        ends = [n.finished_at for n in verdict.nodes if n.finished_at is not None]
        if verdict.outcome is not Outcome.SUCCEEDED:
            bad = [n.finished_at for n in verdict.nodes if n.phase is not NodePhase.SUCCEEDED]
            ends = [min(t for t in bad if t is not None)] if any(t is not None for t in bad) else []
        if ends:
            self.timeline.mark(Mark.EXITED, max(ends), handle.relaunch, outcome=verdict.outcome.value)

    def _ranks_account(self, handle: GroupHandle) -> None:
        """The ranks' own moments (their launchers' records): when the last one started, when the
        process group stood. An account only: a record that cannot be read marks nothing."""
        try:
            records = self.backend.process_groups(handle) or []
        except Exception:  # the timeline is an account, never a reason to fail a try
            return
        for mark, key in ((Mark.RANKS_STARTED, "started_at"), (Mark.RENDEZVOUS, "joined_at")):
            times = [float(r[key]) for r in records if isinstance(r.get(key), int | float)]
            if times and len(times) == len(records):
                self.timeline.mark_once(mark, max(times), handle.relaunch, ranks=len(times))

    def explain(self, handle: GroupHandle, verdict: Verdict) -> FailureReport:
        """The backend's story of a failed group (read once per group: it reads every node's log)."""
        cached = self._reports.get(handle.group_id)
        if cached is None:
            cached = self._reports[handle.group_id] = self.backend.explain(handle, verdict.group_status())
        return cached

    def permanent(self, handle: GroupHandle, verdict: Verdict) -> str | None:
        """Why this failure must not be restarted or retried (None: it may be). A hang caught by
        ``progress_timeout`` is always retryable."""
        return self.failure(handle, verdict)[1]

    def failure(self, handle: GroupHandle, verdict: Verdict) -> tuple[str, str | None]:
        """What failed, in one line (the diagnosis's root cause), and :meth:`permanent`'s answer."""
        if verdict.outcome is not Outcome.FAILED:
            return verdict.reason or verdict.outcome.value, None
        report = self.explain(handle, verdict)
        return report.headline or verdict.reason, permanent_failure(report, self.settings)

    def _emit(self, note: Note) -> None:
        self.log.log(note.level, "%s", note.message)

    def _after_look(self, handle: GroupHandle) -> None:
        self.flush_logs(handle)
        # After the look, not before: on_kill runs in a signal handler, often in the middle of
        # it, and what the look then sees (a deleted Job, stopped ranks) is on_kill's teardown.
        if self.killed:
            raise AirflowException(f"Group {handle.group_id} was stopped: the task was killed (on_kill)")

    def settle(self, handle: GroupHandle, verdict: Verdict | None = None, *, books: bool = False) -> None:
        """Teardown (on success it only confirms nothing is left), and the last log lines into the task log;
        with ``books``, the launch's account for the goodput ledger from its ranks' records too.

        Transient trouble is retried within ``preflight_budget``. After a success a teardown that
        still fails is only warned about: the training is done, whatever is left has finished too.
        """
        # The ranks' last lines and records: before the teardown where the logs go with the group
        # (pods), after it where they outlive it (a rank still exiting when a peer's failure ended
        # the group writes its last words and its last window during the teardown).
        outlive = self.backend.logs_outlive_teardown
        if not outlive:
            if books:
                self.close_books(handle)
            self.flush_logs(handle)
        self.timeline.mark(Mark.TEARDOWN_STARTED, time.time(), handle.relaunch)
        try:
            self._calm(f"tearing down group {handle.group_id}", lambda: self.backend.teardown(handle))
            self.timeline.mark(Mark.TEARDOWN_DONE, time.time(), handle.relaunch)
        except Exception as exc:
            if verdict is None or verdict.outcome is not Outcome.SUCCEEDED:
                raise
            self.log.warning("Group %s succeeded, but confirming its teardown failed: %s", handle.group_id, exc)
        if outlive:
            self.flush_logs(handle)
            if books:
                self.close_books(handle)

    def flush_logs(self, handle: GroupHandle) -> None:
        try:
            lines = self.backend.read_new_log_lines(handle)
        except Exception as exc:  # a log read must never fail a healthy group
            self.log.warning("Group %s: could not read its logs this time: %s", handle.group_id, exc)
            return
        for line in lines:
            if MARKER in line:  # a progress record: the watch summarises them; they stay in the node logs
                continue
            self.log.info("%s", line)

    def trigger(self, handle: GroupHandle, launches: Launches) -> Any:
        """The trigger that watches ``handle`` in the triggerer, carrying what the re-entry needs (the
        try's launches, the contract's state): the event hands it back."""
        from airflow_torchrun.triggers import GroupTrigger

        s = self.settings
        return GroupTrigger(
            handle=handle.to_dict(),
            poll_interval=max(float(s.poll_interval), 1.0),
            progress_timeout=s.progress_timeout,
            deadline=self.deadline,
            error_budget=float(s.observe_error_budget),
            not_before=time.time() + DEFER_SETTLE_SECONDS,
            carry={
                "launches": launches.to_dict(),
                "contract": self.contract.state(),
                "timeline": self.timeline.to_list(),
                "books": self.books.carry() if self.books is not None else None,
            },
        )

    def restore(self, carry: Mapping[str, Any]) -> Launches:
        """Take back what :meth:`trigger` carried through the deferral (the re-entry's engine is new):
        the timeline and the books; the try's launches are returned for :meth:`drive`."""
        self.timeline = Timeline.from_list(carry.get("timeline"))
        if self.books is not None:
            self.books.restore(carry.get("books"))
        return Launches.from_dict(carry.get("launches"))

    def conclude(self, handle: GroupHandle, verdict: Verdict) -> Any:
        """End the try: the contract's result, or the group's story raised (retryable or not)."""
        if verdict.outcome is Outcome.SUCCEEDED:
            self.timeline.mark(Mark.FINISH_STARTED, time.time(), handle.relaunch)
            self._audit_verdict(handle)
            self._ledger(final=False)  # what the finish publishes (the asset event): made, not pushed
            try:
                result = self.contract.finish(handle, verdict, self.spec)
            except BaseException:
                self._ended(handle, False)
                raise
            self._ended(handle, True)
            self.result = result
            return result
        # A resume that diverged and then failed is failed for the divergence: a retry would resume
        # from a checkpoint the diverged run wrote, and its audit would compare against that run.
        self._audit_verdict(handle)
        self._ended(handle, False)
        if verdict.outcome is Outcome.TIMEOUT:
            self._publish_end(handle, verdict, verdict.reason)
            raise AirflowTaskTimeout(f"Group {handle.group_id} was stopped: {verdict.reason}")
        if verdict.outcome in (Outcome.ERROR, Outcome.PROGRESS_TIMEOUT):
            where = ", ".join(self.backend.log_locations(handle))
            message = f"Group {handle.group_id} was torn down: {verdict.reason}. Its logs: {where}"
            self._publish_end(handle, verdict, message)
            if not verdict.transient:  # e.g. the cluster forbids looking at the group: a retry would too
                raise AirflowFailException(f"{message}\n{NOT_RETRYING}")
            raise AirflowException(message)
        report = self.explain(handle, verdict)
        self._publish_end(handle, verdict, report.message)
        self.log.error("%s", report.message)
        if not report.retryable:
            raise AirflowFailException(f"{report.message}\n{NOT_RETRYING}")
        why = self.permanent(handle, verdict)
        if why:
            raise AirflowFailException(f"{report.message}\n(Not retrying: {why}.)")
        raise AirflowException(report.message)

    def _publish_end(self, handle: GroupHandle, verdict: Verdict, failure: str | None) -> None:
        """XCom ``group_end``: how the try's group ended (each node, the failure's story), for the
        training view once the group is gone. An account only: a push that fails is a warning."""
        from dataclasses import asdict

        record = {
            "group_id": handle.group_id,
            "outcome": verdict.outcome.value,
            "nodes": [{**asdict(node), "phase": node.phase.value} for node in verdict.nodes],
            "failure": failure,
        }
        try:
            self.push(XCOM_GROUP_END, record)
        except Exception as exc:
            self.log.warning("Could not publish how group %s ended: %s", handle.group_id, exc)

    def _audit_verdict(self, handle: GroupHandle) -> None:
        """``resume_audit="fail"``: a resume that diverged fails the task, without retry (a retry
        would resume from a checkpoint the diverged run wrote)."""
        from airflow_torchrun.audit import AuditMode

        books = self.books
        diverged = books.diverged() if books is not None and books.mode is AuditMode.FAIL else None
        if diverged is None:
            return
        self._ended(handle, False)
        raise AirflowFailException(
            f"Group {handle.group_id}: {diverged.line()}\nresume_audit='fail': failing the task. {NOT_RETRYING}"
        )

    def _ended(self, handle: GroupHandle, succeeded: bool) -> None:
        """The try's outcome is known: the contract is told, the timeline completed and published,
        the goodput ledger made (XCom, the task log's summary, kept for later tries)."""
        self._ledger(final=False)  # what the contract publishes (MLflow) as it ends: made, not pushed
        try:
            self.contract.ended(handle, succeeded)
        finally:
            self.timeline.mark(Mark.TRY_ENDED, time.time(), outcome="succeeded" if succeeded else "failed")
            self._publish_timeline()
            self._ledger(final=True)

    def _publish_timeline(self) -> None:
        try:
            self.push(XCOM_TIMELINE, self.timeline.to_list())
        except Exception as exc:  # an account of the try, never a reason to fail it
            self.log.warning("Could not publish the try's timeline: %s", exc)

    def kill(self) -> None:
        """``on_kill``: stop the whole group (idempotent)."""
        self.killed = True
        for handle in (self.handle, self.held):
            if handle is not None:
                self.log.info("on_kill: tearing down group %s", handle.group_id)
                self.backend.teardown(handle)
