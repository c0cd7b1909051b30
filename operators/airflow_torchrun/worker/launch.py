"""Entry point every rank runs: ``python -m airflow_torchrun.worker.launch SCRIPT [ARGS...]``.

It runs the user's unmodified script as ``__main__`` under torchrun's own error-file mechanism
(what ``@record`` does), so the task's failure message can show the *first* failing rank's
traceback even when the script does not use ``@record``. A non-zero ``sys.exit`` is recorded too.
"""

from __future__ import annotations

import contextlib
import json
import os
import runpy
import sys
import time
import traceback
from collections.abc import Iterator


def _user_traceback(exc: BaseException, script: str) -> str:
    """The traceback from the user's script down, without this launcher's and runpy's frames."""
    tb = exc.__traceback__
    while tb is not None and tb.tb_frame.f_code.co_filename != script:
        tb = tb.tb_next
    return "".join(traceback.format_exception(type(exc), exc, tb or exc.__traceback__))


def _record(exc: BaseException, script: str) -> None:
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path:
        return
    if isinstance(exc, SystemExit):
        message = f"SystemExit: {exc.code}"
    else:
        message = f"{type(exc).__name__}: {exc}"
    data = {
        "message": {
            "message": message,
            "extraInfo": {
                "py_callstack": _user_traceback(exc, script),
                "timestamp": str(int(time.time())),
                # torchrun's timestamp has second resolution; ordering ranks needs better.
                "airflow_torchrun_time": repr(time.time()),
                "rank": os.environ.get("RANK", ""),
            },
        }
    }
    try:
        with open(path, "w") as fp:
            json.dump(data, fp)
    except OSError:
        pass


@contextlib.contextmanager
def recorded(script: str) -> Iterator[None]:
    """Record what escapes the block (a non-zero ``sys.exit`` too) in torchrun's error file, with
    the traceback from ``script``'s frames down, and let it go on."""
    try:
        yield
    except SystemExit as exc:
        if exc.code not in (0, None):
            _record(exc, script)
        raise
    except BaseException as exc:
        _record(exc, script)
        raise


def main() -> None:
    if len(sys.argv) < 2:
        sys.exit("usage: python -m airflow_torchrun.worker.launch SCRIPT [ARGS...]")
    script = os.path.abspath(sys.argv[1])
    sys.argv = sys.argv[1:]
    sys.path.insert(0, os.path.dirname(script))
    with recorded(script):
        runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    main()
