"""Runs a ``@task.torchrun`` function on every rank: ``python -m airflow_torchrun.worker.function``.
Never imports Airflow (torch only once the rank starts).

The operator ships the function in two variables of every rank's environment (the same on both
backends; on Kubernetes they are in the Job's pod template, where ``airflow-torchrun render``
shows them):

``AIRFLOW_TORCHRUN_FUNCTION_SOURCE``
    The function's source as written in the DAG file, its decorators removed.
``AIRFLOW_TORCHRUN_FUNCTION_CALL``
    JSON: the function's name, its file and first line (tracebacks point into the DAG file), its
    rendered arguments, and ``result_uri``, where rank 0 writes its return value as JSON.

Process group: before calling the function, every rank initialises the default process group
(``process_group_backend``: by default ``cpu:gloo,cuda:nccl`` when CUDA is available, with the
rank's ``LOCAL_RANK`` device selected, else ``gloo``). While the function runs,
``torch.distributed.init_process_group`` is a logged no-op when that group already exists and
covers the backend asked for, so a function written for plain torchrun (it initialises the group
itself) runs unchanged; a backend the group does not cover fails with what to set instead. With
``process_group_backend=None`` the decorator leaves initialising to the function. Whoever created
it, the group is destroyed after the function returned.

Failures are recorded in torchrun's error file exactly as :mod:`airflow_torchrun.worker.launch`
records a script's, so the task's failure message shows the first failing rank's traceback, from
the function's frame down, with the DAG file's line numbers.
"""

from __future__ import annotations
import __future__

import builtins
import contextlib
import json
import linecache
import os
import sys
from collections.abc import Callable, Iterator
from typing import Any

from airflow_torchrun.contract.function import AUTO, FunctionCall
from airflow_torchrun.worker.progress import mark_rendezvous


def load_function(call: FunctionCall) -> Callable[..., Any]:
    """Define the function in a fresh namespace, its lines where they are in the DAG file.

    Annotations stay strings (``from __future__ import annotations``): names they use need not
    exist on the rank.
    """
    padded = "\n" * (call.first_line - 1) + call.source
    # mtime None: linecache keeps this text even where the file does not exist (a pod) or changed.
    linecache.cache[call.filename] = (len(padded), None, padded.splitlines(True), call.filename)
    code = compile(padded, call.filename, "exec", flags=__future__.annotations.compiler_flag, dont_inherit=True)
    namespace: dict[str, Any] = {"__name__": "__torchrun_function__", "__file__": call.filename}
    namespace["__builtins__"] = builtins
    exec(code, namespace)
    fn = namespace.get(call.name)
    if not callable(fn):
        raise RuntimeError(f"the shipped source does not define a function {call.name}()")
    return fn


# -- the process group ------------------------------------------------------------------------
def default_backend() -> str:
    import torch

    return "cpu:gloo,cuda:nccl" if torch.cuda.is_available() else "gloo"


def _covers(ours: str, asked: object) -> bool:
    """Whether a group initialised with backend ``ours`` serves what a later call asks for: the
    same backend, or one of its device backends (``"nccl"`` is served by ``"cpu:gloo,cuda:nccl"``)."""
    if asked is None:
        return True
    names = {part.rpartition(":")[2] for part in ours.lower().replace(" ", "").split(",") if part}
    wanted = [part.rpartition(":")[2] for part in str(asked).lower().replace(" ", "").split(",") if part]
    return all(name in names for name in wanted)


@contextlib.contextmanager
def _process_group(backend: str | None) -> Iterator[None]:
    """The default process group around the call (see the module docstring)."""
    import torch
    import torch.distributed as dist
    import torch.distributed.distributed_c10d as c10d

    ours: str | None = None
    if backend is not None and not dist.is_initialized():
        ours = default_backend() if backend == AUTO else backend
        if torch.cuda.is_available() and "LOCAL_RANK" in os.environ:
            torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
        dist.init_process_group(backend=ours)
        mark_rendezvous(dist.get_rank())
    real_init = c10d.init_process_group

    def init_process_group(backend: object = None, *args: Any, **kwargs: Any) -> None:
        if not dist.is_initialized():
            real_init(backend, *args, **kwargs)  # type: ignore[arg-type]
            return
        if ours is None:  # the function's own group, initialised twice: torch's own error
            real_init(backend, *args, **kwargs)  # type: ignore[arg-type]
            return
        asked = backend if backend is not None else kwargs.get("backend")
        if not _covers(ours, asked):
            raise RuntimeError(
                f"@task.torchrun already initialised the default process group with backend {ours!r}; this "
                f"function asks for {asked!r}. Pass process_group_backend={asked!r} to @task.torchrun (or "
                "process_group_backend=None to initialise the group in the function yourself)"
            )
        # In the rank's log: the function's own arguments (timeout, device_id...) are not applied.
        print(
            f"@task.torchrun: init_process_group({asked!r}) uses the group already initialised ({ours})",
            file=sys.stderr,
        )

    patched = [(dist, "init_process_group"), (c10d, "init_process_group")]
    saved = [getattr(m, n) for m, n in patched]
    for module, name in patched:
        setattr(module, name, init_process_group)
    try:
        yield
    finally:
        for (module, name), value in zip(patched, saved, strict=True):
            setattr(module, name, value)
    if dist.is_initialized():
        dist.destroy_process_group()


# -- the result -------------------------------------------------------------------------------
def result_json(name: str, value: Any) -> str:
    try:
        return json.dumps(value)
    except (TypeError, ValueError) as exc:
        raise TypeError(
            f"{name}() returned {type(value).__name__!s} {_short(value)} on rank 0, which is not JSON-serialisable "
            f"({exc}). Rank 0's return value becomes the task's XCom return_value and travels as JSON: return "
            "plain values (numbers, strings, lists, dicts), e.g. float(loss) or loss.item() instead of a tensor, "
            "and save models with save_checkpoint()"
        ) from exc


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def write_result(uri: str, text: str) -> None:
    """Write rank 0's result where the operator reads it (the task's checkpoint storage)."""
    from airflow_torchrun.storage.aws import STORAGE_OPTIONS_ENV
    from airflow_torchrun.storage.checkpoints import CheckpointStore

    raw = os.environ.get(STORAGE_OPTIONS_ENV, "").strip()
    options = json.loads(raw) if raw else {}
    root, _, name = uri.rpartition("/")
    store = CheckpointStore(root, options)
    directory = store.path_of(root)
    store.fs.makedirs(directory, exist_ok=True)
    with store.fs.open(f"{directory}/{name}", "w") as fp:
        fp.write(text)


def run(call: FunctionCall) -> Any:
    """Call the function on this rank; rank 0 writes its return value to ``call.result_uri``."""
    fn = load_function(call)
    with _process_group(call.process_group_backend):
        value = fn(*call.args, **call.kwargs)
        checkpoint = sys.modules.get("airflow_torchrun.worker.checkpoint")
        if checkpoint is not None:  # a background save_checkpoint(blocking=False) must land first
            checkpoint.wait_for_checkpoint()
    if int(os.environ.get("RANK", "0")) == 0 and call.result_uri:
        write_result(call.result_uri, result_json(call.name, value))
    return value


def main() -> None:
    from airflow_torchrun.worker.gate import hold
    from airflow_torchrun.worker.launch import recorded

    with recorded(__file__):
        hold()  # a rank started during the teardown before it: the gate first (its resume point)
        call = FunctionCall.from_env(os.environ)
    with recorded(call.filename):  # the traceback from the function's frame down
        run(call)


if __name__ == "__main__":
    main()
