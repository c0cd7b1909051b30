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
(their output written), closed its files and written its error file; node 0's rendezvous store is
needed by no one once its exit barrier passed (every other agent has left its own wait).

One more difference: a termination signal after the first is ignored. torchrun's handler raises
where the agent happens to be, so a second SIGTERM (a teardown reaches the agent directly and through
its node's supervisor) broke off its wait for the workers it had just signalled: it left them
running, unwaited, with a second traceback. The first signal still stops the agent as torchrun's
does; the teardown's SIGKILL after its grace still ends whatever does not stop.

Only the local backend runs it (its Python is this package's); a Kubernetes pod runs
``torch.distributed.run`` as the image has it.
"""

from __future__ import annotations

import atexit
import ctypes
import os
import signal
import sys
from types import FrameType


def main(argv: list[str] | None = None) -> int:
    """torchrun's ``main`` on ``argv``; its exit status, as Python would have made it."""
    from torch.distributed import run

    _stop_once()
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
        names = os.environ.get("TORCHELASTIC_SIGNALS_TO_HANDLE", "SIGTERM,SIGINT,SIGHUP,SIGQUIT")
        for name in names.split(","):
            sig = getattr(signal, name.strip(), None)
            if isinstance(sig, signal.Signals):
                signal.signal(sig, signal.SIG_IGN)
        raise_signal(signum, frame)

    # torchrun installs it when its workers start, by this module-level name.
    api._terminate_process_handler = first_only


def _exit_now(code: int) -> None:
    # atexit's handlers are what a normal exit runs before the teardown (logging.shutdown flushes
    # the agent's log handlers); _run_exitfuncs is how a program runs them itself.
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed or broken stream: nothing left to keep
            pass
    try:  # what C and C++ code buffered in stdio (a normal exit flushes it too)
        ctypes.CDLL(None).fflush(None)
    except (OSError, AttributeError):
        pass
    os._exit(code)


if __name__ == "__main__":
    _exit_now(main())
