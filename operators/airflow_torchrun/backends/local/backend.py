"""The embedded default: every node is a torchrun agent process on this machine, on loopback.

Layout of one group (one try of one task) under the state directory::

    groups/<group_id>/group.json                 the handle
    groups/<group_id>/node-<n>/node.log          the agent's and its ranks' output, prefixed
    groups/<group_id>/node-<n>/supervisor.json   written when the node starts (pids)
    groups/<group_id>/node-<n>/supervisor.log    the supervisor's own output
    groups/<group_id>/node-<n>/agent-error.json  torchrun's error file of the agent, if it failed
    groups/<group_id>/node-<n>/exit.json         written when the node is gone (code, signal)
    groups/<group_id>/node-<n>/torchrun/...      torchrun's per-rank logs and error files
    groups/<group_id>/gate.json                  a held group's gate: its ranks run once it is there

Everything a watcher needs is on disk, so another process (a trigger) can follow the group.
"""

from __future__ import annotations

import asyncio
import errno
import json
import logging
import os
import secrets
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from airflow_torchrun import diagnosis
from airflow_torchrun.backends.base import Backend, FailureReport, Relaunch, RelaunchKind
from airflow_torchrun.backends.handles import (
    MAX_NODES,
    MAX_RELAUNCH,
    MAX_WORLD_SIZE,
    GroupHandle,
    LocalHandle,
    bounded_int,
)
from airflow_torchrun.backends.local import zygote
from airflow_torchrun.backends.local.procs import (
    group_pids,
    groups_running,
    pid_alive,
    signal_pids,
    stop_group,
    until_readable,
)
from airflow_torchrun.backends.local.supervisor import RANK_FAILED_FILE, WORKERS_FILE
from airflow_torchrun.contract.launch import AGENT_START_VAR, GATE_FILE, RANK_START_VAR
from airflow_torchrun.errors import GroupLaunchError
from airflow_torchrun.naming import GroupIdentity
from airflow_torchrun.spec import DEFAULT_TEARDOWN_GRACE, GroupSpec, is_templated
from airflow_torchrun.state import state_dir as default_state_dir
from airflow_torchrun.status import GroupStatus, NodeObservation, NodePhase, ProgressMark
from airflow_torchrun.wiring import GroupPlan, holds_at_gate, plan

if TYPE_CHECKING:
    from airflow_torchrun.backends.base import BackendOptions

LOOPBACK = "127.0.0.1"
# Each node's agent: torchrun, ended without the interpreter's teardown (the module's docstring).
AGENT_MODULE = "airflow_torchrun.backends.local.agent"
# The ranks' AWS profile (source keys of an assume-role connection): staged under the state dir by
# rank_storage_env, moved into the group's directory at launch, removed at teardown; a staged one a
# crash left behind is removed after STAGED_MAX_AGE_S, a group's by the next try's start.
CREDENTIALS_DIR = "credentials"
STAGED_PREFIX = "staged-"
GROUP_PROFILE = "aws-profile.ini"
STAGED_MAX_AGE_S = 600.0
# Every rank of a local group runs on one machine: more than this is a typo or a fork bomb.
LOCAL_MAX_RANKS = 256
# What a failure report reads of each node's log: its end, where the failure is (a log of a long run
# can be gigabytes, and the report may be asked for by the API server's view).
EXPLAIN_READ_BYTES = 8 << 20


def free_port() -> int:
    """A port free right now. Another process may still take it before node 0 binds it; the
    operator relaunches on a fresh port when node 0 reports EADDRINUSE."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((LOOPBACK, 0))
        return int(s.getsockname()[1])


RANK_STARTS = ("fork", "exec")


def _start_setting(option: str) -> str:
    from airflow_torchrun.compat import conf

    value = (conf.get("torchrun", option, fallback=None) or "fork").strip().lower()
    if value not in RANK_STARTS:
        raise GroupLaunchError(
            f"[torchrun] {option} = {value!r}: give one of {', '.join(RANK_STARTS)} "
            f"(AIRFLOW__TORCHRUN__{option.upper()})"
        )
    return value


def rank_start() -> str:
    """``[torchrun] local_rank_start``: how each node's agent starts the ranks that run a launcher of
    ours (:func:`airflow_torchrun.backends.local.agent._fork_our_ranks`)."""
    return _start_setting("local_rank_start")


def agent_start() -> str:
    """``[torchrun] local_agent_start``: how each node's supervisor and agent start
    (:mod:`airflow_torchrun.backends.local.zygote`)."""
    return _start_setting("local_agent_start")


class LocalBackend(Backend[LocalHandle]):
    name = "local"
    python = sys.executable
    shares_worker_files = True
    logs_outlive_teardown = True

    def __init__(self, state_dir: str | os.PathLike[str] | None = None, *, log_read_limit: int | None = None) -> None:
        """``log_read_limit``: bytes of each node's log one progress read may take (``None``: all that
        is new); a first read then starts that far from the end (the view reads a long run's log
        without holding all of it)."""
        self.state_dir = Path(state_dir) if state_dir else default_state_dir()
        # One reader per consumer: the task log and the progress records read the same files.
        self._log_reader = _LineReader()
        self._progress_reader = _LineReader(log_read_limit)
        self._folders: dict[Path, diagnosis.AgentTracebackFolder] = {}
        # Per group: how many nodes' outcomes (exit.json) the last look read (see :meth:`pause`).
        self._outcomes_seen: dict[str, int] = {}

    @classmethod
    def from_handle(cls, handle: LocalHandle) -> LocalBackend:
        # <state_dir>/groups/<group_id>
        return cls(state_dir=Path(handle.group_dir).parent.parent)

    # -- DAG parse time -----------------------------------------------------------------------
    @classmethod
    def for_task(cls, options: BackendOptions) -> LocalBackend:
        return cls(state_dir=default_state_dir())

    @classmethod
    def for_view(
        cls, identity: GroupIdentity, hint: Mapping[str, Any], *, log_read_limit: int
    ) -> tuple[LocalHandle, LocalBackend] | str | None:
        """This try's group under this machine's state directory: the launch ``hint`` names when it
        is there, else the last one. The directory is where the derived group id says, never where a
        handle says; the counts come from the group's own ``group.json``, bounded."""
        backend = cls(default_state_dir(), log_read_limit=log_read_limit)
        launches = backend.launches_of_try(identity)
        if not launches:
            return None
        wanted = bounded_int(hint.get("relaunch"), low=0, high=MAX_RELAUNCH)
        relaunch = wanted if wanted in launches else max(launches)
        group_dir = launches[relaunch]
        try:
            recorded = GroupHandle.from_dict(json.loads((group_dir / "group.json").read_text()))
        except (OSError, ValueError) as exc:
            return f"the handle of group {group_dir.name} cannot be read ({exc})"
        if not isinstance(recorded, LocalHandle):
            return f"{group_dir / 'group.json'} is not a local group's handle"
        nodes = bounded_int(recorded.num_nodes, low=1, high=MAX_NODES)
        if nodes is None or bounded_int(recorded.world_size, low=nodes, high=MAX_WORLD_SIZE) is None:
            return f"group {group_dir.name} claims {recorded.num_nodes!r} node(s) and {recorded.world_size!r} rank(s)"
        handle = replace(recorded, group_id=group_dir.name, group_dir=str(group_dir), relaunch=relaunch)
        return handle, backend

    @classmethod
    def resolve_script(cls, script: str, dag_file: str | None) -> str:
        """A relative script is looked up in the current directory, then beside the DAG file."""
        if os.path.isabs(script):
            return script
        if Path(script).is_file():
            return str(Path(script).resolve())
        if dag_file:
            beside_dag = Path(dag_file).parent / script
            if beside_dag.is_file():
                return str(beside_dag)
        return script

    @classmethod
    def spec_problems(cls, spec: GroupSpec) -> list[str]:
        problems = []
        if spec.world_size > LOCAL_MAX_RANKS:
            problems.append(
                f"num_nodes={spec.num_nodes} x nproc_per_node={spec.nproc_per_node} = {spec.world_size} ranks, but the "
                f"local backend starts every rank on the Airflow worker's machine (at most {LOCAL_MAX_RANKS}); lower "
                "them, or run the group on a cluster with backend='kubernetes'"
            )
        if spec.script and not is_templated(spec.script) and not Path(spec.script).is_file():
            problems.append(
                f"script {spec.script!r} does not exist (resolved to {Path(spec.script).resolve()}); "
                "give an absolute path, or one relative to the DAG file's folder or the worker's current directory"
            )
        for var in (RANK_START_VAR, AGENT_START_VAR):
            start = spec.env.get(var)
            if start is not None and not is_templated(start) and start not in RANK_STARTS:
                problems.append(f"env {var}={start!r}: give one of {', '.join(RANK_STARTS)}")
        return problems

    # -- storage ------------------------------------------------------------------------------
    def rank_storage_env(
        self, options: Mapping[str, Any], aws_conn_id: str | None, log: logging.Logger
    ) -> dict[str, str]:
        """The connection's credentials in the ranks' environment; with ``role_arn``, a private AWS
        profile instead, so that the ranks assume the role themselves and their session refreshes."""
        from airflow_torchrun.storage.aws import SECRET_OPTIONS, rank_role_for, storage_env

        if not aws_conn_id:
            return storage_env(options)
        role, why_not = rank_role_for(aws_conn_id)
        if role is None:
            if why_not:
                log.warning(
                    "aws_conn_id=%s: the ranks get the role's temporary session, which they cannot refresh (%s); "
                    "a run longer than the role's session duration loses access to storage",
                    aws_conn_id,
                    why_not,
                )
            return storage_env(options)
        env = storage_env({k: v for k, v in options.items() if k not in SECRET_OPTIONS})
        self.sweep_credentials()
        # Staged for this launch only: launch() moves it into the group's directory, teardown removes it.
        path = self.state_dir / CREDENTIALS_DIR / f"{STAGED_PREFIX}{secrets.token_hex(8)}.ini"
        env.update(role.write(path))
        log.info(
            "aws_conn_id=%s: the ranks assume %s themselves (AWS profile %s in a file only its owner can read), "
            "so their credentials refresh however long the run",
            aws_conn_id,
            role.role_arn,
            env["AWS_PROFILE"],
        )
        return env

    # -- planning ---------------------------------------------------------------------------
    def plan(self, spec: GroupSpec, identity: GroupIdentity, extra_env: Mapping[str, str]) -> GroupPlan:
        return self._plan(spec, identity, extra_env, gated=False)

    def plan_gated(self, spec: GroupSpec, identity: GroupIdentity) -> GroupPlan | None:
        """Held at ``<group_dir>/gate.json``; None for a ``command=`` of the user's (nothing of ours
        runs before it to hold it)."""
        return self._plan(spec, identity, {}, gated=True) if holds_at_gate(spec) else None

    def _plan(
        self, spec: GroupSpec, identity: GroupIdentity, extra_env: Mapping[str, str], *, gated: bool
    ) -> GroupPlan:
        group_dir = self.state_dir / "groups" / identity.group_id
        cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
        # the task's env= may choose otherwise
        extra_env = {RANK_START_VAR: rank_start(), AGENT_START_VAR: agent_start(), **extra_env}
        return plan(
            spec,
            identity,
            master_addr=LOOPBACK,
            master_port=spec.rdzv_port or free_port(),
            python=sys.executable,
            agent_module=AGENT_MODULE,
            log_dir=str(group_dir / "node-{node_rank}" / "torchrun"),
            # every node shares this machine's cores
            cpus_per_node=(cpus or 1) / spec.num_nodes,
            extra_env=extra_env,
            gate=str(group_dir / GATE_FILE) if gated else None,
        )

    # -- launching --------------------------------------------------------------------------
    def launch(self, plan: GroupPlan, *, watch_caller: bool = True) -> LocalHandle:
        group_dir = self.state_dir / "groups" / plan.group_id
        if group_dir.exists() and any(group_dir.iterdir()):
            # A previous launch of this very try: keep its logs, never overwrite them.
            stale = group_dir.with_name(f"{group_dir.name}.{int(time.time() * 1000)}")
            group_dir.rename(stale)
        handle = LocalHandle(
            group_id=plan.group_id,
            num_nodes=len(plan.nodes),
            world_size=plan.spec.world_size,
            launched_at=time.time(),
            startup_timeout=plan.spec.startup_timeout,
            teardown_grace=plan.spec.teardown_grace,
            relaunch=plan.identity.relaunch,
            group_dir=str(group_dir),
            master_port=plan.master_port,
        )
        try:
            profile = self._adopt_profile(
                [str(node.env.get("AWS_CONFIG_FILE") or "") for node in plan.nodes], group_dir
            )
            process: str | None = None  # the zygotes' process stamp, made once for every node
            for node in plan.nodes:
                node_dir = group_dir / f"node-{node.node_rank}"
                node_dir.mkdir(parents=True)
                env = {**os.environ, **node.env, "TORCHELASTIC_ERROR_FILE": str(node_dir / "agent-error.json")}
                if profile is not None:
                    env["AWS_CONFIG_FILE"] = str(profile)
                args = [f"--node-dir={node_dir}", f"--grace={plan.spec.teardown_grace}"]
                if watch_caller:
                    args.append(f"--watch-pid={os.getpid()}")
                args += ["--", *node.argv]
                if env.get(AGENT_START_VAR) == "fork":
                    process = process or zygote.process_stamp()
                    if zygote.spawn(args, env, os.getcwd(), node_dir / "supervisor.log", process=process):
                        continue  # forked by the zygote, torch imported
                subprocess.Popen(
                    [sys.executable, "-m", zygote.SUPERVISOR_MODULE, *args],
                    env=env,
                    cwd=os.getcwd(),
                    start_new_session=True,
                    stdin=subprocess.DEVNULL,
                    stdout=subprocess.DEVNULL,
                    stderr=open(node_dir / "supervisor.log", "wb"),  # noqa: SIM115 - owned by the child
                )
            (group_dir / "group.json").write_text(json.dumps(handle.to_dict(), indent=2))
        except OSError as exc:
            self.teardown(handle)
            # Out of processes, memory or file descriptors for a moment: a later launch may work.
            busy = exc.errno in (errno.EAGAIN, errno.ENOMEM, errno.EMFILE, errno.ENFILE)
            raise GroupLaunchError(
                f"could not start group {plan.group_id} in {group_dir}: {exc}", transient=busy
            ) from exc
        return handle

    def open_gate(self, handle: LocalHandle, env: Mapping[str, str]) -> None:
        """Write the gate its held ranks look for (whole, by a rename; only its owner can read it: it
        may hold storage credentials). A staged AWS profile moves into the group's directory first,
        as at launch, so that the group's teardown removes it."""
        group_dir = Path(handle.group_dir)
        env = dict(env)
        profile = self._adopt_profile([env.get("AWS_CONFIG_FILE") or ""], group_dir)
        if profile is not None:
            env["AWS_CONFIG_FILE"] = str(profile)
        gate = group_dir / GATE_FILE
        tmp = gate.with_name(f".{gate.name}.tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as fp:
            json.dump({"env": env, "opened_at": time.time()}, fp)
        os.replace(tmp, gate)

    # -- watching ---------------------------------------------------------------------------
    def observe(self, handle: LocalHandle) -> list[NodeObservation]:
        nodes = [self._observe_node(handle, n) for n in range(handle.num_nodes)]
        self._outcomes_seen[handle.group_id] = sum(n.exit_code is not None for n in nodes)
        return nodes

    async def observe_async(self, handle: LocalHandle) -> list[NodeObservation]:
        # Reading a few small files; run off the event loop all the same.
        return await asyncio.to_thread(self.observe, handle)

    def pause(self, handle: LocalHandle, seconds: float) -> None:
        """Sleep until the next look, or until a node's supervisor exits (its outcome is on disk then):
        a finished group is seen at once instead of up to ``poll_interval`` later. An outcome
        recorded since the last look (a supervisor that exited in between) ends it at once."""
        fds, outcomes = _running_supervisors(handle)
        try:
            if outcomes > self._outcomes_seen.get(handle.group_id, 0):
                return
            until_readable(fds, seconds)
        finally:
            for fd in fds:
                os.close(fd)

    async def pause_async(self, handle: LocalHandle, seconds: float) -> None:
        """:meth:`pause` on the triggerer's event loop, which watches the pidfds itself (found off it,
        like :meth:`observe_async`'s reads)."""
        fds, outcomes = await asyncio.to_thread(_running_supervisors, handle)
        loop = asyncio.get_running_loop()
        exited = loop.create_future()
        if outcomes > self._outcomes_seen.get(handle.group_id, 0):
            exited.set_result(None)

        def wake() -> None:
            if not exited.done():
                exited.set_result(None)

        try:
            for fd in fds:
                loop.add_reader(fd, wake)
            await asyncio.wait_for(exited, seconds)
        except TimeoutError:
            pass
        finally:
            for fd in fds:
                loop.remove_reader(fd)
                os.close(fd)

    def _observe_node(self, handle: LocalHandle, node_rank: int) -> NodeObservation:
        node_dir = Path(handle.group_dir) / f"node-{node_rank}"
        exit_info = _read_json(node_dir / "exit.json")
        if exit_info is not None:
            code = int(exit_info["returncode"])
            stopped_by = exit_info.get("stopped_by")
            # Stopped while it ran (a teardown, a SIGTERM to the group): not a success, whatever the
            # agent's exit code (a stopped group must never pass for a finished one).
            done = code == 0 and not stopped_by
            return NodeObservation(
                node_rank=node_rank,
                phase=NodePhase.SUCCEEDED if done else NodePhase.FAILED,
                exit_code=code,
                signal=exit_info.get("signal"),
                started_at=exit_info.get("started_at"),
                finished_at=exit_info.get("finished_at"),
                reason=None if done or code != 0 else f"stopped ({stopped_by}) before it finished",
                stopped_by=stopped_by,
            )
        sup = _read_json(node_dir / "supervisor.json")
        if sup is None:
            return NodeObservation(node_rank=node_rank, phase=NodePhase.PENDING)
        if not pid_alive(int(sup["pid"])):
            # The supervisor may have written exit.json between our two reads.
            if (node_dir / "exit.json").exists():
                return self._observe_node(handle, node_rank)
            return NodeObservation(
                node_rank=node_rank,
                phase=NodePhase.LOST,
                started_at=sup.get("started_at"),
                finished_at=time.time(),
                reason=f"its supervisor (pid {sup['pid']}) died without recording an outcome",
            )
        failed = _read_json(node_dir / RANK_FAILED_FILE)
        if failed is not None:
            # The agent saw a worker fail and is stopping the node: a failed node from now on, a
            # second or more before exit.json, so the rest of the group is stopped that much sooner.
            return NodeObservation(
                node_rank=node_rank,
                phase=NodePhase.FAILED,
                started_at=sup.get("started_at"),
                finished_at=failed.get("at"),
                reason=f"{_worker_failure(failed)}; its torchrun agent is stopping the node",
            )
        return NodeObservation(node_rank=node_rank, phase=NodePhase.RUNNING, started_at=sup.get("started_at"))

    # -- logs -------------------------------------------------------------------------------
    def log_locations(self, handle: LocalHandle) -> list[str]:
        return [str(Path(handle.group_dir) / f"node-{n}" / "node.log") for n in range(handle.num_nodes)]

    def read_new_log_lines(self, handle: LocalHandle) -> list[str]:
        """Complete lines written since the last call, node by node; agent lines get a prefix."""
        out: list[str] = []
        for node_rank, path_s in enumerate(self.log_locations(handle)):
            path = Path(path_s)
            folder = self._folders.setdefault(path, diagnosis.AgentTracebackFolder(str(path)))
            for raw in self._log_reader.read(path):
                line = raw.rstrip("\r")
                if line.startswith("[node "):
                    out.append(line)
                    continue
                out.extend(f"[node {node_rank} agent] {shown}" for shown in folder.feed(line))
        return out

    # -- failure ----------------------------------------------------------------------------
    def explain(self, handle: LocalHandle, status: GroupStatus) -> FailureReport:
        group_dir = Path(handle.group_dir)
        reported: list[diagnosis.RankFailure] = []
        error_files: list[tuple[int, str]] = []
        logs: dict[int, str] = {}
        for n in range(handle.num_nodes):
            node_dir = group_dir / f"node-{n}"
            logs[n] = _read_text(node_dir / "node.log", last=EXPLAIN_READ_BYTES)
            # The kernel's exit statuses (workers.json) win over the agent's summary, which is read
            # from the agent's own lines only: rank output shares the log.
            reported += diagnosis.parse_agent_report(n, diagnosis.agent_lines(logs[n]))
            reported += diagnosis.from_exit_statuses(n, (_read_json(node_dir / WORKERS_FILE) or {}).get("workers", []))
            for err in sorted((node_dir / "torchrun").glob("*/attempt_*/*/error.json")):
                error_files.append((n, _read_text(err)))
        failures = diagnosis.merge(reported, error_files)
        cause = diagnosis.root_cause(failures)
        node = cause.node_rank if cause else (status.failed_node or 0)
        tail = diagnosis.rank_lines(logs.get(node, ""), node, cause.rank if cause else None)
        message = diagnosis.failure_message(
            handle.group_id,
            failures,
            node_headline=status.reason,
            log_tail=tail,
            log_path=str(group_dir / f"node-{node}" / "node.log"),
        )
        if status.state.value == "startup_timeout":
            message = f"Training group {handle.group_id} could not start: {status.reason}.\n{message}"
        return FailureReport.of(message, diagnosis.retryable(failures), cause)

    def process_groups(self, handle: LocalHandle) -> list[dict[str, Any]] | None:
        """The launchers' ``process_group.json`` files beside torchrun's per-rank error files."""
        records: list[dict[str, Any]] = []
        for n in range(handle.num_nodes):
            for path in sorted(
                (Path(handle.group_dir) / f"node-{n}" / "torchrun").glob("*/attempt_*/*/process_group.json")
            ):
                try:
                    data = json.loads(path.read_text())
                except (OSError, ValueError):
                    continue
                if isinstance(data, dict):
                    records.append({**data, "node_rank": n})
        return records or None

    def relaunch_reason(self, handle: LocalHandle, status: GroupStatus) -> Relaunch | None:
        """Node 0 lost the race for the rendezvous port: :func:`free_port` found it free, then
        another process bound it before node 0's agent did. torchrun reports it only in words
        (its agent error file, else the node's log), so this is where those words are read, and
        only while node 0 has started no rank: the agent binds the port before it starts any, and
        once one ran, its output is in that log and its error in that file (a rank that printed
        "Address already in use" was relaunched as a port race, up to three times). A started
        rank shows twice: torchrun makes its ``attempt_*`` folder as it starts the ranks, and the
        supervisor lists each rank that ended in ``workers.json``."""
        node0 = Path(handle.group_dir) / "node-0"
        if any((node0 / "torchrun").glob("*/attempt_*")) or (_read_json(node0 / WORKERS_FILE) or {}).get("workers"):
            return None
        said = _read_text(node0 / "agent-error.json") or _read_text(node0 / "node.log")
        if "EADDRINUSE" in said or "Address already in use" in said:
            return Relaunch(
                RelaunchKind.PORT_RACE, f"its rendezvous port {handle.master_port} was taken by another process"
            )
        return None

    def read_progress_lines(self, handle: LocalHandle) -> list[str]:
        """Complete lines of the nodes' logs, since the last call, that carry a progress record."""
        from airflow_torchrun.contract.progress import MARKER

        out: list[str] = []
        for path in self.log_locations(handle):
            out += [line for line in self._progress_reader.read(Path(path)) if MARKER in line]
        return out

    def progress_mark(self, handle: LocalHandle) -> ProgressMark:
        """The sizes of the nodes' logs: every rank's output lands there."""
        sizes = []
        for path in self.log_locations(handle):
            try:
                sizes.append(os.stat(path).st_size)
            except FileNotFoundError:
                sizes.append(-1)
        return log_sizes_mark(sizes)

    # -- teardown ---------------------------------------------------------------------------
    def teardown(self, handle: LocalHandle) -> None:
        """Stop every process of the group: SIGTERM, then SIGKILL after the grace period.

        Idempotent and total: supervisors, agents and workers (whatever their session or parent)
        are found by the group's marker.
        """
        group_id, grace = handle.group_id, handle.teardown_grace
        failing = [n for n in range(handle.num_nodes) if self._agent_stopping(handle, n)]
        if failing:
            # Those agents are already stopping their nodes: let them end on their own (what they
            # print last names the failed rank) while every other node is stopped at once.
            deadline = time.monotonic() + grace
            for n in range(handle.num_nodes):
                if n not in failing:
                    signal_pids(group_pids(group_id, n), signal.SIGTERM)
            while time.monotonic() < deadline and any(group_pids(group_id, n) for n in failing):
                time.sleep(0.05)
            grace = max(0.0, deadline - time.monotonic())
        stop_group(group_id, grace=grace, last=_supervisors(Path(handle.group_dir)))
        _remove(Path(handle.group_dir) / GROUP_PROFILE)

    def _adopt_profile(self, named: Sequence[str], group_dir: Path) -> Path | None:
        """The ranks' staged AWS profile (of the ``AWS_CONFIG_FILE`` values ``named``), moved into this
        group's directory (one per group, so that teardown knows what to remove); None when none is staged."""
        staged_dir = (self.state_dir / CREDENTIALS_DIR).resolve()
        staged = [Path(p) for p in sorted(set(named) - {""}) if Path(p).resolve().parent == staged_dir]
        if not staged:
            return None
        group_dir.mkdir(parents=True, exist_ok=True)
        target = group_dir / GROUP_PROFILE
        os.replace(staged[0], target)
        for extra in staged[1:]:
            _remove(extra)
        return target

    def sweep_credentials(self) -> None:
        """Remove ranks' profiles nobody can still need: staged ones older than
        :data:`STAGED_MAX_AGE_S` (a launch that crashed), and the long-lived ones older versions kept."""
        folder = self.state_dir / CREDENTIALS_DIR
        try:
            entries = list(os.scandir(folder))
        except FileNotFoundError:
            return
        now = time.time()
        for entry in entries:
            if not entry.name.endswith(".ini"):
                continue
            staged = entry.name.startswith(STAGED_PREFIX)
            try:
                old = now - entry.stat().st_mtime > STAGED_MAX_AGE_S
            except FileNotFoundError:
                continue
            if not staged or old:
                _remove(Path(entry.path))

    @staticmethod
    def _agent_stopping(handle: LocalHandle, node_rank: int) -> bool:
        node_dir = Path(handle.group_dir) / f"node-{node_rank}"
        return (node_dir / RANK_FAILED_FILE).exists() and not (node_dir / "exit.json").exists()

    def stop_earlier_tries(self, identity: GroupIdentity) -> list[str]:
        """Stop groups that earlier tries of this task instance left running (a deferred task
        failed by the scheduler never re-enters to tear its group down), every relaunch of each
        try: one scan of the processes by their group id. Returns their ids."""
        earlier = [replace(identity, try_number=t, relaunch=0) for t in range(1, identity.try_number)]
        running = groups_running(lambda g: any(e.relaunch_of(g) is not None for e in earlier))
        stopped = []
        for group_id in sorted(running):
            group_dir = self.state_dir / "groups" / group_id
            grace = (_read_json(group_dir / "group.json") or {}).get("teardown_grace")
            stop_group(
                group_id,
                grace=float(grace) if isinstance(grace, int | float) else DEFAULT_TEARDOWN_GRACE,
                last=_supervisors(group_dir),
            )
            stopped.append(group_id)
        # What a crashed try left: its groups are stopped now, so their profiles are no one's.
        for earlier_try in earlier:
            for group_dir in self.launches_of_try(earlier_try).values():
                _remove(group_dir / GROUP_PROFILE)
        self.sweep_credentials()
        return stopped

    def launches_of_try(self, identity: GroupIdentity) -> dict[int, Path]:
        """Every launch of ``identity``'s try that wrote its handle here: relaunch -> group directory.
        Found by the try's id (a directory listing), however many relaunches there were."""
        out: dict[int, Path] = {}
        try:
            entries = list(os.scandir(self.state_dir / "groups"))
        except FileNotFoundError:
            return out
        for entry in entries:
            relaunch = identity.relaunch_of(entry.name)
            if relaunch is not None and os.path.isfile(os.path.join(entry.path, "group.json")):
                out[relaunch] = Path(entry.path)
        return dict(sorted(out.items()))

    def running_pids(self, handle: LocalHandle) -> list[int]:
        return group_pids(handle.group_id)


def log_sizes_mark(sizes: Sequence[int]) -> ProgressMark:
    """The nodes' log sizes (-1: not there yet) as a mark: output once any log has a byte."""
    return ProgressMark(tuple(sizes), output=any(size > 0 for size in sizes))


class _LineReader:
    """Complete lines appended to files since the last read (a line still being written waits).

    With ``limit``, one read takes at most that many bytes of a file, and the first read of a file
    starts that far from its end (at the next line)."""

    def __init__(self, limit: int | None = None) -> None:
        self._offsets: dict[Path, int] = {}
        self._partial: dict[Path, bytes] = {}
        self._limit = limit

    def read(self, path: Path) -> list[str]:
        skip_partial = False
        try:
            with open(path, "rb") as fp:
                offset = self._offsets.get(path)
                if offset is None:
                    offset = 0
                    if self._limit is not None:
                        size = os.fstat(fp.fileno()).st_size
                        offset = max(0, size - self._limit)
                        skip_partial = offset > 0
                fp.seek(offset)
                chunk = fp.read() if self._limit is None else fp.read(self._limit)
        except FileNotFoundError:
            return []
        self._offsets[path] = offset + len(chunk)
        if skip_partial:  # started inside a line: that line's end is not a line
            _, _, chunk = chunk.partition(b"\n")
        *lines, rest = (self._partial.pop(path, b"") + chunk).split(b"\n")
        # A line longer than one read's limit is dropped rather than held (what follows of it is
        # read as a line of its own, which holds no whole record).
        if rest and (self._limit is None or len(rest) <= self._limit):
            self._partial[path] = rest
        return [raw.decode("utf-8", "replace") for raw in lines]


def _worker_failure(outcome: Mapping[str, Any]) -> str:
    """``local rank 0 was killed by SIGKILL`` from the supervisor's record of a worker's exit status."""
    who = f"local rank {outcome['local_rank']}" if isinstance(outcome.get("local_rank"), int) else "a rank"
    if outcome.get("signal"):
        return f"{who} was killed by {outcome['signal']}"
    return f"{who} exited with code {outcome.get('exit_code')}"


def _remove(path: Path) -> None:
    try:
        path.unlink()
    except FileNotFoundError:
        pass


def _running_supervisors(handle: LocalHandle) -> tuple[list[int], int]:
    """A pidfd (readable once it exits) for the supervisor of each node whose outcome is not on disk
    yet, and how many outcomes are. One already gone without an outcome is left to the next look (it
    sees the node lost)."""
    fds: list[int] = []
    outcomes = 0
    for node_rank in range(handle.num_nodes):
        node_dir = Path(handle.group_dir) / f"node-{node_rank}"
        if (node_dir / "exit.json").exists():
            outcomes += 1
            continue
        sup = _read_json(node_dir / "supervisor.json")
        if sup is None or not isinstance(sup.get("pid"), int):
            continue
        try:
            fds.append(os.pidfd_open(sup["pid"]))
        except ProcessLookupError:
            continue
    return fds, outcomes


def _supervisors(group_dir: Path) -> set[int]:
    """The pids of the group's node supervisors, as they recorded them (a stop kills them last)."""
    found = (_read_json(sup) for sup in group_dir.glob("node-*/supervisor.json"))
    return {int(sup["pid"]) for sup in found if sup and isinstance(sup.get("pid"), int)}


def _read_json(path: Path) -> dict[str, Any] | None:
    try:
        data = json.loads(path.read_text())
    except (FileNotFoundError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def _read_text(path: Path, *, last: int | None = None) -> str:
    """The file's text (its ``last`` bytes only, from a line's start, when given); "" when missing."""
    try:
        with open(path, "rb") as fp:
            size = os.fstat(fp.fileno()).st_size
            start = max(0, size - last) if last is not None else 0
            fp.seek(start)
            data = fp.read()
    except FileNotFoundError:
        return ""
    if start:
        _, _, data = data.partition(b"\n")
    return data.decode("utf-8", "replace")
