"""One node's torchrun agent on the local backend: ``python -m airflow_torchrun.backends.local.agent
[TORCHRUN ARGS...]``.

It is torchrun: ``torch.distributed.run.main`` with the same arguments, its ``@record`` error file,
its signal handling and its exit status (0; 1 with the traceback on stderr for an exception, a
``ChildFailedError`` or a ``SignalException`` alike; a ``SystemExit``'s own code, 2 and "run.py:
error: ..." for a usage error). What differs is the end: once torchrun has stopped its workers and
returned, the atexit handlers run (logging's flush among them), Python's and C's output buffers are
flushed, and the process exits at once, without the interpreter's teardown of torch's modules. That
teardown took 0.7 to 1.9 s after every agent's last act on a 2-core machine (``bench/bench_group.py``
measures it), and a failed group's teardown, an in-try restart and "rank death -> every process
gone" all wait for the agents to be gone. By then torchrun itself has stopped its tail threads
(their output written), closed its files and written its error file.

Node 0's agent hosts the static rendezvous's store, and every agent's exit barrier ends with a wait
on it: when node 0 passes the barrier it cannot know that the others have received their answer, and
an agent still on its way to its wait found the store gone ("Error waiting on exit barrier", a
traceback; torchrun has the same race, narrowed only by the second its own teardown takes). So each
other agent says so in the store once its wait is over, and node 0 leaves when all have, or after
``RELEASE_WAIT`` seconds (an agent killed in between never says it).

The other nodes' agents join node 0's store once it listens. torchrun's agent of a node other than 0
connects at once, and a store not listening yet sends its client into a back-off that came back 0.37
to 0.62 s after the store was up (measured on this 2-core machine: a ``TCPStore`` client started
0.05 to 0.8 s before its server). With agents that start as new interpreters, node 0's was still
importing torch in about half the launches, and the group started that much later. Here such an agent
tries a plain TCP connection every ``STORE_POLL_S`` until node 0's port accepts one, then lets torchrun
connect: it finds the store up. The wait is bounded by the rendezvous's timeout, as torchrun's, and ends
in the error torchrun's client raises when it cannot connect (``DistNetworkError``), naming that timeout.

One more difference: a termination signal after the first is ignored. torchrun's handler raises
where the agent happens to be, so a second SIGTERM (a teardown reaches the agent directly and through
its node's supervisor) broke off its wait for the workers it had just signalled: it left them
running, unwaited, with a second traceback. The first signal still stops the agent as torchrun's
does; the teardown's SIGKILL after its grace still ends whatever does not stop.

And each rank's line reaches the node's log whole. torchrun's tee reads a rank's output file a
line at a time and, at its end, writes what it has, so a line whose end was not written yet (Python
unbuffered writes a ``print``'s text and its newline apart) came out in two, each with its prefix,
and another rank's line could land between them: ``loss=5.67[node 0 rank 1] ...``. Here a line is
written once its newline (or ``\r``) is there, its file has ended, or it reached
``MAX_PARTIAL_LINE`` characters, as a container runtime's log splits a long line.

And a logged exception's traceback is formatted by the standard library, not by torch's log
formatter, which imports ``torch._dynamo`` for it (1.5 s, each time a forked rank fails): the lines
read the same.

Only the local backend runs it (its Python is this package's); a Kubernetes pod runs
``torch.distributed.run`` as the image has it.
"""

from __future__ import annotations

import atexit
import json
import logging
import os
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable
from types import FrameType
from typing import Any, TextIO

logger = logging.getLogger(__name__)

# Node 0's longest wait for the other agents to leave their exit barrier; each does within
# milliseconds of the barrier passing, unless it was killed then.
RELEASE_WAIT = 10.0
_LEFT_KEY = "airflow_torchrun/left_exit_barrier"
_NVML_CHECK = "PYTORCH_NVML_BASED_CUDA_CHECK"
# The longest part of a line the tee holds back waiting for its end (Docker's and the CRI's size).
MAX_PARTIAL_LINE = 16 * 1024
# How often an agent of a node other than 0 tries node 0's store port before it lets torchrun connect.
STORE_POLL_S = 0.005


def main(argv: list[str] | None = None) -> int:
    """torchrun's ``main`` on ``argv``; its exit status, as Python would have made it."""
    from torch.distributed import run

    _stop_once()
    _tracebacks_without_dynamo()
    _whole_lines()
    _hold_the_store_for_the_exit_barrier()
    _connect_once_node_0_listens()
    _fork_our_ranks()
    sys.argv[0] = run.__file__  # its usage and error lines name run.py, as `python -m torch.distributed.run`'s do
    try:
        run.main(argv)  # None: sys.argv[1:], as torchrun reads them
    except SystemExit as exc:  # argparse's usage error, or torchrun's own exit
        if exc.code is None or isinstance(exc.code, int):
            return exc.code or 0
        print(exc.code, file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        raise  # Python ends the process by SIGINT: left to the interpreter
    except BaseException:
        sys.excepthook(*sys.exc_info())  # the traceback Python prints for an uncaught exception
        return 1
    return 0


def _stop_once() -> None:
    """torchrun's termination handler, made to ignore every handled signal once the first came."""
    from torch.distributed.elastic.multiprocessing import api

    raise_signal = api._terminate_process_handler

    def first_only(signum: int, frame: FrameType | None) -> None:
        for sig in signal.valid_signals():  # every signal torchrun gave this handler, whichever it chose
            if signal.getsignal(sig) is first_only:
                signal.signal(sig, signal.SIG_IGN)
        raise_signal(signum, frame)

    # torchrun installs it when its workers start, by this module-level name.
    api._terminate_process_handler = first_only


class _PlainTraceback(logging.Filter):
    """Formats a record's exception into its message with the standard library, before torch's
    formatter sees it; a process that has imported ``torch._dynamo`` already is left as it is."""

    _formatter = logging.Formatter()

    def filter(self, record: logging.LogRecord) -> bool:
        if record.exc_info and "torch._dynamo" not in sys.modules:
            record.msg = f"{record.getMessage()}\n{self._formatter.formatException(record.exc_info)}"
            record.args = None
            record.exc_info = None
        return True


def _tracebacks_without_dynamo() -> None:
    """torch's log formatter imports ``torch._dynamo`` (sympy and inductor with it: 1.5 s of CPU) to
    format any record that carries an exception, and torchrun logs one the moment a forked rank
    fails: each agent of a failed group spent that long before its exit, which everything after a
    rank's death waits for. The traceback reads the same, formatted here."""
    loggers = logging.root.manager.loggerDict.items()  # PlaceHolders (no logger made yet) have no handlers
    for logger_ in [logging.getLogger("torch"), *(v for k, v in loggers if k.startswith("torch."))]:
        for handler in getattr(logger_, "handlers", ()):
            if not any(isinstance(f, _PlainTraceback) for f in handler.filters):  # a handler two loggers share
                handler.addFilter(_PlainTraceback())


def tail_whole_lines(
    header: str,
    file: str,
    dst: TextIO,
    finished: threading.Event,
    interval_sec: float,
    log_line_filter: Callable[[str], bool] | None = None,
) -> None:
    """torchrun's ``tail_logfile`` (same arguments, same prefix per line), but a line is written
    whole: a part read before its end was written waits for the rest."""
    while not os.path.exists(file):
        if finished.is_set():
            return
        time.sleep(interval_sec)
    with open(file, errors="replace") as fp:  # universal newlines: a progress bar's \r ends a line
        pending = ""
        while True:
            ended = finished.is_set()  # before the read: what was written by then, this read gets
            part = fp.readline()
            pending += part
            if not (pending.endswith("\n") or len(pending) >= MAX_PARTIAL_LINE):
                if part:
                    continue  # a line's start: its end may be written already
                if not ended:
                    time.sleep(interval_sec)
                    continue
                if not pending:
                    return
                pending += "\n"  # the file ended inside a line
            if log_line_filter is None or log_line_filter(pending):
                dst.write(f"{header}{pending}")
            if ended and not part:
                return
            pending = ""


def _whole_lines() -> None:
    """torchrun's tee, writing each rank's line whole (:func:`tail_whole_lines`)."""
    from torch.distributed.elastic.multiprocessing import tail_log

    # TailLog submits it by this module-level name.
    tail_log.tail_logfile = tail_whole_lines


def _fork_our_ranks() -> None:
    """Ranks that run our launcher are forked from this agent, torch imported (torchrun's own
    ``--start-method=fork`` for a function entry point), instead of each starting an interpreter
    that imports torch again: 1.3 s of CPU per rank and per restart on a 2-core machine. What a new
    interpreter would differ in is put back in the rank (:func:`airflow_torchrun.worker.launch.forked`).
    ``AIRFLOW_TORCHRUN_RANK_START=exec`` keeps torchrun's way. Which pid is which rank goes to the
    file ``AIRFLOW_TORCHRUN_RANKS_FILE`` names (a forked rank's environment from exec is this
    agent's, without ``RANK``)."""
    from torch.distributed import run
    from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent

    from airflow_torchrun.contract.launch import FUNCTION_ENTRY, RANK_START_VAR, RANKS_FILE_VAR, WORKER_ENTRY
    from airflow_torchrun.worker import launch

    if os.environ.get(RANK_START_VAR, "fork") != "fork":
        return
    original = run.config_from_args

    def config_from_args(args: Any) -> Any:
        # torchrun's LaunchConfig asks torch.cuda.is_available(), whose default answer initialises
        # CUDA in the agent, and a process forked after that cannot use CUDA. NVML's answer does not.
        before = os.environ.get(_NVML_CHECK)
        os.environ[_NVML_CHECK] = "1"
        try:
            config, cmd, cmd_args = original(args)
        finally:
            if before is None:
                del os.environ[_NVML_CHECK]
            else:
                os.environ[_NVML_CHECK] = before
        if not cuda_untouched():
            logger.warning("the CUDA driver is loaded in this agent: its ranks start as new interpreters")
            return config, cmd, cmd_args
        if cmd == sys.executable and cmd_args[:3] == ["-u", "-m", WORKER_ENTRY]:  # script=
            config.start_method = "fork"
            return config, launch.forked, cmd_args[3:]
        if cmd == sys.executable and cmd_args[:2] == ["-m", FUNCTION_ENTRY]:  # @task.torchrun (--no-python)
            config.start_method = "fork"
            return config, launch.forked_function, cmd_args[2:]
        return config, cmd, cmd_args

    run.config_from_args = config_from_args
    ranks_file = os.environ.get(RANKS_FILE_VAR)
    if not ranks_file:
        return
    start_workers = LocalElasticAgent._start_workers

    def and_record_ranks(agent: Any, worker_group: Any) -> dict[int, int]:
        pids = start_workers(agent, worker_group)
        ranks = {str(pid): [worker_group.workers[local].global_rank, local] for local, pid in pids.items()}
        try:
            with open(ranks_file) as fp:
                ranks = {**json.load(fp), **ranks}
        except (OSError, ValueError):
            pass
        tmp = f"{ranks_file}.{os.getpid()}"
        try:
            with open(tmp, "w") as fp:
                json.dump(ranks, fp)
            os.replace(tmp, ranks_file)
        except OSError as exc:  # a record only: the node's outcomes then name no rank
            logger.warning("could not record which worker is which rank in %s: %s", ranks_file, exc)
        return pids

    LocalElasticAgent._start_workers = and_record_ranks  # type: ignore[method-assign]


def cuda_untouched(maps: str | None = None) -> bool:
    """No CUDA driver in this process (``/proc/self/maps``, or ``maps``, lists no ``libcuda.so``):
    a process forked from it can still initialise CUDA."""
    if maps is None:
        try:
            with open("/proc/self/maps") as fp:
                maps = fp.read()
        except OSError:
            return False
    return "/libcuda.so" not in maps


def _hold_the_store_for_the_exit_barrier() -> None:
    """torchrun's exit barrier, followed on a static rendezvous by node 0 waiting for the others to leave it."""
    from torch.distributed import DistError
    from torch.distributed.elastic.agent.server.api import SimpleElasticAgent
    from torch.distributed.elastic.rendezvous.static_tcp_rendezvous import StaticTCPRendezvous

    exit_barrier = SimpleElasticAgent._exit_barrier

    def then_release(agent: Any) -> None:
        exit_barrier(agent)  # only on success; it logs and returns when the barrier times out
        group = agent._worker_group
        if not isinstance(group.spec.rdzv_handler, StaticTCPRendezvous) or group.group_world_size < 2:
            return  # another rendezvous's store lives elsewhere: as torchrun
        if group.group_rank != 0:  # node 0 hosts the store (StaticTCPRendezvous: rank 0 is master)
            try:
                agent._store.add(_LEFT_KEY, 1)
            except DistError as exc:  # node 0 left already (its wait ran out): nothing left to tell it
                logger.debug("node 0 left first: %s", exc)
            return
        others = group.group_world_size - 1
        deadline = time.monotonic() + RELEASE_WAIT
        while (left := agent._store.add(_LEFT_KEY, 0)) < others:
            if time.monotonic() > deadline:
                logger.warning(
                    "%d of %d agents did not leave their exit barrier in %.0f s", others - left, others, RELEASE_WAIT
                )
                return
            time.sleep(0.01)

    # torchrun's agent calls it by this name once its workers succeeded.
    SimpleElasticAgent._exit_barrier = then_release  # type: ignore[method-assign]


def until_listening(host: str, port: int, timeout_s: float) -> bool:
    """Whether ``host:port`` accepted a TCP connection within ``timeout_s`` (tried every ``STORE_POLL_S``)."""
    deadline = time.monotonic() + timeout_s
    while True:
        left = deadline - time.monotonic()
        try:
            with socket.create_connection((host, port), timeout=min(1.0, max(left, STORE_POLL_S))):
                return True
        except OSError:
            if time.monotonic() >= deadline:
                return False
            time.sleep(STORE_POLL_S)


def _connect_once_node_0_listens() -> None:
    """A static rendezvous's client (every node but 0) connects once node 0's store port listens."""
    from torch.distributed import DistNetworkError
    from torch.distributed.elastic.rendezvous.static_tcp_rendezvous import StaticTCPRendezvous

    next_rendezvous = StaticTCPRendezvous.next_rendezvous

    def when_listening(handler: Any) -> Any:
        if handler.rank != 0 and handler._store is None:
            host, port, timeout = handler.master_addr, handler.master_port, handler.timeout.total_seconds()
            if not until_listening(host, port, timeout):
                # What torchrun's client raises when it cannot connect, but after the rendezvous's
                # timeout once (torchrun's own connect would start a second one) and naming it.
                raise DistNetworkError(
                    f"node 0's rendezvous store at {host}:{port} did not accept a connection within the "
                    f"rendezvous timeout of {timeout:.0f} s (rdzv_timeout): node 0's agent did not start, "
                    "or something between the nodes refuses the port"
                )
        return next_rendezvous(handler)

    StaticTCPRendezvous.next_rendezvous = when_listening  # type: ignore[method-assign,assignment]


def _exit_now(code: int) -> None:
    # atexit's handlers are what a normal exit runs before the teardown (logging.shutdown flushes
    # the agent's log handlers); _run_exitfuncs is how a program runs them itself.
    from airflow_torchrun.worker.launch import exit_now

    atexit._run_exitfuncs()
    exit_now(code)


if __name__ == "__main__":
    _exit_now(main())
