"""Entry point every rank runs: ``python -m airflow_torchrun.worker.launch SCRIPT [ARGS...]``.

It runs the user's unmodified script as ``__main__`` under torchrun's own error-file mechanism
(what ``@record`` does), so the task's failure message can show the *first* failing rank's
traceback even when the script does not use ``@record``. A non-zero ``sys.exit`` is recorded too,
with the command-line parser's ``error:`` line when the exit code is 2 (argparse, jsonargparse and
``HfArgumentParser`` print it to stderr just before exiting), and a failure raised by one of the
script's module-level imports is marked ``"phase": "import"`` (a retry cannot fix either).

Two more things for the operator, on both backends:

* ``${TRAIN_CHECKPOINT_DIR}`` (and the other names of :data:`EXPANDED`) in the script's arguments
  are replaced by the rank's value, so ``script_args=["--output_dir", "${TRAIN_CHECKPOINT_DIR}"]``
  hands a script's own flag the task's checkpoint location.
* Which process group the script's rank joined: when ``torch.distributed.init_process_group``
  succeeds, ``process_group.json`` (rank, world size, backend) is written beside torchrun's error
  file; a rank that exits without joining one writes ``{"joined": false}`` there. The local
  backend reads them to tell a distributed run from N independent copies (Hugging Face Trainer
  without ``--use_cpu``, accelerate without ``ACCELERATE_USE_CPU=1``).
* When the process group is ready: a progress record ``event: "rendezvous"`` on the rank's stdout
  (the goodput ledger's end of rendezvous, also for a script that uses no helper).
* A rank of a group started during the teardown of the one before it is held at a gate before the
  script (:mod:`airflow_torchrun.worker.gate`), its imports done; its arguments are expanded, and its
  script run, only once the gate is open (the resume point is in the gate's variables).
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import faulthandler
import gc
import importlib.abc
import importlib.machinery
import json
import os
import re
import runpy
import signal
import sys
import threading
import time
import traceback
import weakref
from collections.abc import Callable, Iterator, Sequence
from types import ModuleType
from typing import Any, NoReturn, TextIO

from airflow_torchrun import contract
from airflow_torchrun.contract.launch import PROCESS_GROUP_FILE
from airflow_torchrun.worker.gate import Held, hold
from airflow_torchrun.worker.progress import mark_rendezvous

# Contract variables a script argument may name as ``${NAME}``; replaced on every rank.
EXPANDED = (contract.CHECKPOINT_DIR, contract.CHECKPOINT_URI, contract.RESUME_FROM)
_PLACEHOLDER = re.compile(r"\$\{(" + "|".join(EXPANDED) + r")\}")
USAGE_EXIT_CODE = 2
# The stderr kept to find a parser's ``error:`` line (it is the last thing printed before exit).
_STDERR_TAIL = 8192
_C10D = "torch.distributed.distributed_c10d"
_PR_SET_PDEATHSIG = 1
# When this rank's interpreter got to the launcher (the script's imports come next): the try's
# timeline takes the last rank's as its ``ranks_started`` (airflow_torchrun.timeline).
_STARTED_AT = time.time()
# A held rank's wait at its gate (None: not held), recorded beside its process group.
_HELD: list[Held] = []


def expand_args(args: Sequence[str], env: dict[str, str] | None = None) -> list[str]:
    """``${TRAIN_CHECKPOINT_DIR}`` and the other :data:`EXPANDED` names replaced by their values."""
    env = dict(os.environ) if env is None else env
    return [_PLACEHOLDER.sub(lambda m: env.get(m.group(1), ""), a) for a in args]


class _StderrTail:
    """``sys.stderr`` passed through, its last few KiB kept (to quote a parser's ``error:`` line)."""

    def __init__(self, stream: TextIO) -> None:
        self._stream = stream
        self.tail = ""

    def write(self, text: str) -> int:
        self.tail = (self.tail + text)[-_STDERR_TAIL:]
        return self._stream.write(text)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)


def usage_error(stderr_tail: str) -> str | None:
    """The last ``error:`` line a command-line parser printed (``prog: error: ...``), if any."""
    for line in reversed(stderr_tail.splitlines()):
        if re.match(r"^(?:[^:]+: )?error: ", line.strip()):  # the prog may be "train.py fit"
            return line.strip()
    return None


def _process_group_path() -> str | None:
    err = os.environ.get("TORCHELASTIC_ERROR_FILE")
    return os.path.join(os.path.dirname(err), PROCESS_GROUP_FILE) if err else None


def _write_process_group(record: dict[str, Any]) -> None:
    path = _process_group_path()
    if not path:
        return
    try:
        with open(path, "w") as fp:
            held = {"held": _HELD[0].to_dict()} if _HELD else {}
            json.dump({**record, "rank_env": os.environ.get("RANK", ""), "started_at": _STARTED_AT, **held}, fp)
    except OSError:
        pass


class _ProcessGroupWatch(importlib.abc.MetaPathFinder):
    """Wraps ``init_process_group`` as torch defines it, before ``torch.distributed`` re-exports it,
    without importing torch here (a script that never imports torch pays nothing)."""

    joined = False
    record: dict[str, Any] | None = None
    c10d: ModuleType | None = None

    def find_spec(self, fullname: str, path: Any, target: ModuleType | None = None) -> Any:
        if fullname != _C10D:
            return None
        sys.meta_path.remove(self)
        try:
            spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        finally:
            sys.meta_path.insert(0, self)
        if spec is None or spec.loader is None:
            return spec
        loader, watch = spec.loader, self

        class _Loader(importlib.abc.Loader):
            def create_module(self, spec: Any) -> ModuleType | None:
                return loader.create_module(spec)

            def exec_module(self, module: ModuleType) -> None:
                loader.exec_module(module)
                watch.patch(module)

        spec.loader = _Loader()
        return spec

    def patch(self, c10d: ModuleType) -> None:
        original_init, original_destroy = c10d.init_process_group, c10d.destroy_process_group
        self.c10d = c10d
        watch = self

        def init_process_group(*args: Any, **kwargs: Any) -> Any:
            result = original_init(*args, **kwargs)
            try:
                watch.joined = True
                watch.record = {
                    "joined": True,
                    "joined_at": time.time(),  # the process group stood (the timeline's ``rendezvous``)
                    "rank": c10d.get_rank(),
                    "world_size": c10d.get_world_size(),
                    "backend": str(c10d.get_backend()),
                }
                _write_process_group(watch.record)
                mark_rendezvous(int(watch.record["rank"]))
            except Exception:  # never fail a rank for the record
                pass
            return result

        def destroy_process_group(group: Any = None) -> Any:
            if group is None:
                watch.note_collectives()
            return original_destroy(group)

        for new, old in ((init_process_group, original_init), (destroy_process_group, original_destroy)):
            new.__wrapped__ = old  # type: ignore[attr-defined]
            new.__doc__ = old.__doc__
        c10d.init_process_group = init_process_group  # type: ignore[attr-defined]
        c10d.destroy_process_group = destroy_process_group  # type: ignore[attr-defined]
        # Imported already (a rank forked from its agent): torch.distributed's own names for them too.
        dist = sys.modules.get("torch.distributed")
        for name, new, old in (
            ("init_process_group", init_process_group, original_init),
            ("destroy_process_group", destroy_process_group, original_destroy),
        ):
            if dist is not None and getattr(dist, name, None) is old:
                setattr(dist, name, new)

    def note_collectives(self) -> None:
        """How many collectives ran on the default group (its sequence number), before it goes away:
        a group joined and never used is N independent copies too (Trainer without ``--use_cpu``)."""
        if self.record is None or self.c10d is None or "collectives" in self.record:
            return
        try:
            if not self.c10d.is_initialized():
                return
            seq = self.c10d._get_default_group()._get_sequence_number_for_group()
        except Exception:  # a backend without sequence numbers: nothing claimed
            return
        self.record = {**self.record, "collectives": int(seq)}
        _write_process_group(self.record)


def _import_phase(exc: BaseException, script: str) -> bool:
    """Raised by one of the script's module-level imports (the script's own code never ran)."""
    tb = exc.__traceback__
    while tb is not None:
        code = tb.tb_frame.f_code
        if code.co_filename == script and code.co_name == "<module>":
            nxt = tb.tb_next
            if nxt is None:  # raised by the statement itself: a module that is not there
                return isinstance(exc, ImportError)
            # Python strips importlib's frames: the next one is the imported module's own body.
            return nxt.tb_frame.f_code.co_name == "<module>" or nxt.tb_frame.f_code.co_filename.startswith(
                "<frozen importlib"
            )
        tb = tb.tb_next
    return False


def _user_traceback(exc: BaseException, script: str) -> str:
    """The traceback from the user's script down, without this launcher's and runpy's frames."""
    tb = exc.__traceback__
    while tb is not None and tb.tb_frame.f_code.co_filename != script:
        tb = tb.tb_next
    return "".join(traceback.format_exception(type(exc), exc, tb or exc.__traceback__))


def _record(exc: BaseException, script: str, stderr_tail: str = "") -> None:
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path:
        return
    extra: dict[str, str] = {}
    if isinstance(exc, SystemExit):
        message = f"SystemExit: {exc.code}"
        said = usage_error(stderr_tail) if exc.code == USAGE_EXIT_CODE else None
        if said:
            extra["usage_error"] = said
    else:
        message = f"{type(exc).__name__}: {exc}"
    if _import_phase(exc, script):
        extra["phase"] = "import"
    data = {
        "message": {
            "message": message,
            "extraInfo": {
                "py_callstack": _user_traceback(exc, script),
                "timestamp": str(int(time.time())),
                # torchrun's timestamp has second resolution; ordering ranks needs better.
                "airflow_torchrun_time": repr(time.time()),
                "rank": os.environ.get("RANK", ""),
                **extra,
            },
        }
    }
    try:
        with open(path, "w") as fp:
            json.dump(data, fp)
    except OSError:
        pass


@contextlib.contextmanager
def recorded(script: str, stderr: _StderrTail | None = None) -> Iterator[None]:
    """Record what escapes the block (a non-zero ``sys.exit`` too) in torchrun's error file, with
    the traceback from ``script``'s frames down, and let it go on."""
    try:
        yield
    except SystemExit as exc:
        if exc.code not in (0, None):
            _record(exc, script, stderr.tail if stderr else "")
        raise
    except BaseException as exc:
        _record(exc, script)
        raise


def main() -> None:
    if len(sys.argv) < 2:
        sys.exit("usage: python -m airflow_torchrun.worker.launch SCRIPT [ARGS...]")
    script = os.path.abspath(sys.argv[1])
    watch = _ProcessGroupWatch()
    if _C10D in sys.modules:  # a rank forked from its agent: torch is imported
        watch.patch(sys.modules[_C10D])
    else:  # before a held rank imports torch.distributed
        sys.meta_path.insert(0, watch)
    stderr = _StderrTail(sys.stderr)
    sys.stderr = stderr
    try:
        with recorded(script, stderr):
            held = hold()
            if held is not None:
                _HELD.append(held)
            # After the gate: ${TRAIN_RESUME_FROM} is among its variables.
            sys.argv = [sys.argv[1], *expand_args(sys.argv[2:])]
            sys.path.insert(0, os.path.dirname(script))
            runpy.run_path(script, run_name="__main__")
    finally:
        if watch.joined:
            watch.note_collectives()
        else:
            _write_process_group({"joined": False})


def flush_output() -> None:
    """What Python's and C's output buffers hold, written: what a normal exit does before it ends."""
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError):  # a closed or broken stream: nothing left to keep
            stream.flush()
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None).fflush(None)


def exit_now(code: int) -> NoReturn:
    """End the process with ``code`` once its output is flushed, without the interpreter's teardown
    (the caller has run what must run before: atexit functions)."""
    flush_output()
    os._exit(code)


def forked(script: str, *args: str) -> None:
    """:func:`main` in a rank forked from its node's torchrun agent (the local backend's
    :mod:`airflow_torchrun.backends.local.agent`), torch imported already."""
    global _STARTED_AT
    _STARTED_AT = time.time()
    as_a_new_process(main, [__file__, script, *args])


def forked_function(*args: str) -> None:
    """:mod:`airflow_torchrun.worker.function`'s ``main`` (a ``@task.torchrun`` rank), forked so."""
    from airflow_torchrun.worker import function

    as_a_new_process(function.main, [function.__file__, *args])


def as_a_new_process(entry: Callable[[], None], argv: list[str]) -> None:
    """Run ``entry`` in a process forked from a torchrun agent as if it had a new interpreter of its
    own (torch's import aside). What the agent and torch's worker wrapper set is put back first:
    signal handlers, atexit functions and weakref finalizers of the agent's (the standard library's
    own exit hooks kept), the signal on the agent's death (none, as for an exec'd rank: the node's
    supervisor stops orphans with SIGTERM, so a save on stop still runs), faulthandler (on only with
    ``PYTHONFAULTHANDLER``), numpy's global random state. The end is a process's end: non-daemon
    threads joined (the script's own: a thread still writing a file), the script's atexit functions run,
    the exit status and traceback as Python gives them, C's buffered output flushed."""
    me = os.getpid()
    with contextlib.suppress(OSError, AttributeError):  # torch's wrapper asked for SIGINT when the agent dies
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, 0)
    if not os.environ.get("PYTHONFAULTHANDLER"):
        faulthandler.disable()  # torch's wrappers enable it; a new interpreter has it off
    for sig in signal.valid_signals():
        if callable(signal.getsignal(sig)) and sig != signal.SIGINT:
            signal.signal(sig, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    atexit._clear()
    with contextlib.suppress(AttributeError):  # the agent's objects' finalizers are not the script's
        weakref.finalize._registry.clear()  # type: ignore[attr-defined]
        weakref.finalize._registered_with_atexit = False  # type: ignore[attr-defined]
    # What the standard library registered when the agent imported it (a new interpreter would have
    # registered them when the script imported it): log handlers flushed, multiprocessing children ended.
    if "logging" in sys.modules:
        atexit.register(sys.modules["logging"].shutdown)
    if "multiprocessing.util" in sys.modules:
        atexit.register(sys.modules["multiprocessing.util"]._exit_function)
    if "numpy" in sys.modules:  # its legacy global generator: each rank its own seed, as when imported anew
        sys.modules["numpy"].random.seed()
    sys.argv = argv
    code = 0
    interrupted = False
    try:
        entry()
    except SystemExit as exc:
        if exc.code is None or isinstance(exc.code, int):
            code = exc.code or 0
        else:
            print(exc.code, file=sys.stderr)
            code = 1
    except KeyboardInterrupt:
        sys.excepthook(*sys.exc_info())
        interrupted = True
    except BaseException:
        sys.excepthook(*sys.exc_info())  # the traceback Python prints for an uncaught exception
        code = 1
    finally:
        threading._shutdown()  # type: ignore[attr-defined]  # as Python: non-daemon threads first, then atexit
        atexit._run_exitfuncs()
    if code or interrupted or os.getpid() != me:  # (a process the script forked ends here too, as itself)
        if interrupted:  # as Python ends on an uncaught KeyboardInterrupt: by SIGINT
            flush_output()
            signal.signal(signal.SIGINT, signal.SIG_DFL)
            os.kill(os.getpid(), signal.SIGINT)
        exit_now(code)
    # 0: back to torchrun's worker wrapper, which hands the agent its return value and waits for the
    # node's other ranks to finish. Meanwhile it is done: a teardown's SIGTERM ends it at once (the
    # script's handler for a save on stop has nothing left to save), and its garbage goes.
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, signal.SIG_DFL)
    gc.collect()


if __name__ == "__main__":
    main()
