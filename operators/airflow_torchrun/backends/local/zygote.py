"""A process that has imported torch once and forks the local nodes' supervisors, which fork their
agents: ``python -m airflow_torchrun.backends.local.zygote`` (started by a launch, never by hand).

Each local node runs a supervisor and a torchrun agent, and an agent started as a new interpreter
spends 1.4 s of CPU importing torch before it does anything (a 2-core machine): most of a small
group's start, and half of ``make test``'s CPU. The zygote imports torch, torchrun and this
package's node modules once. A launch asks it for each node's supervisor: forked, with the node's
environment, directory, umask and files; the supervisor then forks its agent from itself, torch
already in memory (:func:`fork_agent`), and the agent forks its ranks as before. The supervisors
are forked ahead of the requests (:data:`SPARES` of them wait, each taking one request), so a
launch does not wait for the forks.

One zygote serves one kind of caller: the same Python, user and groups, cgroup, namespaces and
resource limits, the same torch and package files, and the same values of the variables read
before anything runs (:func:`keyed`: torch's, OpenMP's, the loader's, Python's). Another kind gets
another zygote (:func:`fingerprint` names its socket). It listens in a directory only its user can
enter (``AIRFLOW_TORCHRUN_ZYGOTE_DIR``, default ``$XDG_RUNTIME_DIR`` or ``/tmp``, then
``airflow-torchrun-zygotes-<uid>``), answers only its own user, and leaves after ``IDLE_S`` without
a request (``AIRFLOW_TORCHRUN_ZYGOTE_IDLE``). A launch that finds none starts one and starts its own
nodes as new interpreters meanwhile; a zygote that is gone or does not answer changes nothing but
the speed. ``[torchrun] local_agent_start = exec`` does without.

What a forked process would lack against an exec'd one is put back: the node's environment, working
directory, umask, standard files, session, default signal handlers, ``OMP_NUM_THREADS``, ``sys.argv``
and ``sys.path[0]``, a fresh random seed. And what others read of it: the kernel shows a process's
environment and command line as they were at its exec, and the local backend finds a group's
processes by the markers in that environment (``procs.group_pids``). So the zygote is exec'd with
room for both (filler), and each forked supervisor and agent writes its own environment and command
line over that room (:func:`mark`), as ``setproctitle`` does: ``ps`` and ``/proc/<pid>/environ``
show what an exec'd one would.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import fcntl
import hashlib
import importlib
import importlib.util
import json
import logging
import os
import random
import resource
import select
import signal
import site
import socket
import stat
import struct
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import IO, Any

from airflow_torchrun.backends.local.procs import exit_now, pid_alive, run_main, stat_fields

logger = logging.getLogger(__name__)

DIR_VAR = "AIRFLOW_TORCHRUN_ZYGOTE_DIR"
IDLE_VAR = "AIRFLOW_TORCHRUN_ZYGOTE_IDLE"
IDLE_S = 600.0
# A zygote forks within milliseconds; one that has not answered by then is stuck or gone.
ANSWER_TIMEOUT_S = 5.0
SUPERVISOR_MODULE = "airflow_torchrun.backends.local.supervisor"
AGENT_MODULE = "airflow_torchrun.backends.local.agent"
# What the zygote imports: what every node's supervisor, agent and forked ranks import.
PRELOAD = (
    "torch",
    "torch.distributed.run",
    SUPERVISOR_MODULE,
    AGENT_MODULE,
    "airflow_torchrun.worker.launch",
    "airflow_torchrun.worker.function",
)
# Variables read while Python, the loader, OpenMP and torch start (not later, from each forked
# process's own environment): a zygote is made with them, so they name it. OMP_NUM_THREADS differs
# from task to task and is applied to each forked process (:func:`_become`); PyTorch's NVML switch is
# read when CUDA is asked about (Lightning sets it in whoever imports it).
_KEYED_PREFIXES = ("TORCH_", "PYTORCH_", "OMP_", "MKL_", "KMP_", "GOMP_", "LD_", "PYTHON", "MALLOC_")
_KEYED_NAMES = ("LOGLEVEL", "GLIBC_TUNABLES")
_UNKEYED = ("OMP_NUM_THREADS", "PYTORCH_NVML_BASED_CUDA_CHECK")
# Passed on to a zygote besides the keyed ones (what Python's start may read); none is a secret.
_BASE = ("PATH", "HOME", "LANG", "LANGUAGE", "LC_ALL", "LC_CTYPE", "TZ", "TMPDIR", "USER", "LOGNAME")
# The room a zygote is exec'd with for what the processes it forks show as their environment and
# command line; a larger environment is exec'd instead.
_ENV_ROOM_VAR = "AIRFLOW_TORCHRUN_ZYGOTE_ROOM"
_ENV_ROOM = 64 * 1024
_ARGV_ROOM = 16384
_FILLER = "."
_MAX_REQUEST = 16 << 20
# /proc/<pid>/stat fields after the command name: arg_start, arg_end, env_start, env_end (48-51).
_ARG_START, _ENV_START = 45, 47


def keyed(name: str) -> bool:
    """A variable a zygote is made with (:data:`_KEYED_PREFIXES`), so one that names it."""
    if name.startswith(_UNKEYED):
        return False
    return name.startswith(_KEYED_PREFIXES) or name in _KEYED_NAMES


def zygote_dir() -> Path | None:
    """The directory of this user's zygotes, made if need be; None (and a warning) when it is not
    this user's alone: its socket would let another user run commands as this one."""
    base = os.environ.get(DIR_VAR) or os.path.join(
        os.environ.get("XDG_RUNTIME_DIR") or tempfile.gettempdir(), f"airflow-torchrun-zygotes-{os.getuid()}"
    )
    path = Path(base)
    with contextlib.suppress(FileExistsError):
        path.mkdir(mode=0o700, parents=True)
    try:
        st = os.lstat(path)
    except OSError as exc:
        logger.warning("no zygote: cannot use %s (%s); agents start as new interpreters", path, exc)
        return None
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & 0o077:
        logger.warning(
            "no zygote: %s must be a directory of uid %d that only it can enter (it is mode %o, uid %d); "
            "agents start as new interpreters",
            path,
            os.getuid(),
            stat.S_IMODE(st.st_mode),
            st.st_uid,
        )
        return None
    return path


def _installed() -> list[Path]:
    """The files whose change (an upgrade) makes a zygote stale: torch's, this package's, the site dirs."""
    files: list[Path] = []
    spec = importlib.util.find_spec("torch")  # found, not imported
    if spec is not None and spec.origin:
        files += [Path(spec.origin), Path(spec.origin).with_name("version.py")]
    package = Path(__file__).resolve().parents[2]
    files += sorted(package.rglob("*.py"))
    files += [Path(p) for p in site.getsitepackages()]
    return files


def fingerprint(env: Mapping[str, str], process: str | None = None) -> str:
    """What a zygote must share with a process it forks for: see the module's docstring.
    ``process``: :func:`process_stamp`'s, made once for the nodes of one launch."""
    digest = hashlib.sha256((process or process_stamp()).encode())
    digest.update(repr(sorted((k, v) for k, v in env.items() if keyed(k))).encode())
    return digest.hexdigest()[:24]


def process_stamp() -> str:
    """The part of :func:`fingerprint` that is this process's, not its environment's (a few ms: it
    looks at every installed file's time and size)."""
    digest = hashlib.sha256()

    def add(*parts: object) -> None:
        digest.update(repr(parts).encode())

    add(sys.executable, sys.version, os.getuid(), os.getgid(), sorted(os.getgroups()))
    add(os.getpriority(os.PRIO_PROCESS, 0), sorted(os.sched_getaffinity(0)))
    for ns in ("cgroup", "ipc", "mnt", "net", "pid", "user", "uts"):
        with contextlib.suppress(OSError):
            add(ns, os.readlink(f"/proc/self/ns/{ns}"))
    with contextlib.suppress(OSError):
        add(Path("/proc/self/cgroup").read_text())
    for name in sorted(n for n in dir(resource) if n.startswith("RLIMIT_")):
        with contextlib.suppress(ValueError, OSError):
            add(name, resource.getrlimit(getattr(resource, name)))
    for path in _installed():
        with contextlib.suppress(OSError):
            st = path.stat()
            add(str(path), st.st_mtime_ns, st.st_size)
    return digest.hexdigest()[:24]


# -- the caller's side: a launch -------------------------------------------------------------
def spawn(
    argv: Sequence[str], env: Mapping[str, str], cwd: str, stderr_path: Path, *, process: str | None = None
) -> int | None:
    """``python -m airflow_torchrun.backends.local.supervisor ARGV``, forked by the zygote of this
    kind of caller: in ``cwd``, with ``env``, stdin and stdout on /dev/null, stderr to
    ``stderr_path``, a session of its own. Its pid; None when no zygote answered (one is started
    for the next launch, when there is none): start the supervisor yourself. ``process``: this
    process's :func:`process_stamp`, when the caller has it already."""
    directory = zygote_dir()
    if directory is None:
        return None
    path = directory / f"{fingerprint(env, process)}.sock"
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    with sock:
        sock.settimeout(ANSWER_TIMEOUT_S)
        try:
            with _addressable(path) as address:
                sock.connect(address)
        except OSError:  # none (or a stale socket): start one for the next launch
            start(path, env)
            return None
        try:
            return _ask(sock, argv, env, cwd, stderr_path)
        except (OSError, ValueError) as exc:
            logger.info("zygote %s did not answer (%s): the node starts as a new interpreter", path.name, exc)
            return None


@contextlib.contextmanager
def _addressable(path: Path) -> Iterator[str]:
    """``path`` as a socket address: a Unix socket's is at most 107 bytes, and a longer one is
    reached through the directory's descriptor (``/proc/self/fd/N/name``)."""
    if len(os.fsencode(path)) < 100:
        yield str(path)
        return
    fd = os.open(path.parent, os.O_PATH | os.O_DIRECTORY)
    try:
        yield f"/proc/self/fd/{fd}/{path.name}"
    finally:
        os.close(fd)


def _umask() -> int | None:
    """This process's umask, read without changing it (``os.umask`` sets it, for every thread)."""
    try:
        with open("/proc/self/status") as fp:
            for line in fp:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    return None


def _ask(sock: socket.socket, argv: Sequence[str], env: Mapping[str, str], cwd: str, stderr_path: Path) -> int | None:
    request = json.dumps({"argv": list(argv), "env": dict(env), "cwd": cwd, "umask": _umask()}).encode()
    with (
        open(os.devnull, "rb") as stdin,
        open(os.devnull, "wb") as stdout,
        open(stderr_path, "wb") as stderr,
    ):
        socket.send_fds(sock, [struct.pack("!Q", len(request))], [stdin.fileno(), stdout.fileno(), stderr.fileno()])
        sock.sendall(request)
        reply = json.loads(_line(sock))
    if not isinstance(reply, dict) or not isinstance(reply.get("pid"), int):
        logger.info("zygote declined: %s", reply.get("error") if isinstance(reply, dict) else reply)
        return None
    sock.sendall(b"go\n")  # the forked supervisor starts only on this: a caller gone before it starts nothing
    return int(reply["pid"])


def _line(sock: socket.socket) -> bytes:
    data = b""
    while not data.endswith(b"\n"):
        chunk = sock.recv(4096)
        if not chunk:
            raise ValueError("connection closed")
        data += chunk
        if len(data) > 65536:
            raise ValueError("answer too long")
    return data.strip()


def start(path: Path, env: Mapping[str, str]) -> None:
    """Start the zygote that listens at ``path``, made with ``env``'s keyed variables (it returns at
    once: the zygote detaches, and one already starting for ``path`` makes this one leave)."""
    free = _locked(path)
    if free is None:
        return  # starting already (it imports torch before it listens), or serving
    free.close()
    zenv = {k: v for k, v in env.items() if keyed(k) or k in _BASE}
    zenv[_ENV_ROOM_VAR] = _FILLER * _ENV_ROOM
    idle = os.environ.get(IDLE_VAR) or str(IDLE_S)
    argv = [sys.executable, "-m", __name__, f"--socket={path}", f"--idle={idle}", "--room=" + _FILLER * _ARGV_ROOM]
    try:
        with open(f"{path}.log", "ab") as log:
            proc = subprocess.Popen(
                argv, env=zenv, cwd="/", start_new_session=True, stdin=subprocess.DEVNULL, stdout=log, stderr=log
            )
        proc.wait(timeout=ANSWER_TIMEOUT_S)  # the first process: it forks the zygote and returns
    except (OSError, subprocess.TimeoutExpired) as exc:
        logger.info("could not start a zygote at %s: %s", path, exc)


def stop_all(directory: Path) -> list[int]:
    """SIGTERM every zygote with a pid file in ``directory`` (a test session's end); their pids.

    Only a process whose command line is that zygote's: a zygote killed with SIGKILL leaves its
    pid file behind, and its pid may since belong to any other process."""
    pids = []
    for pid_file in directory.glob("*.sock.pid"):
        with contextlib.suppress(OSError, ValueError):
            pid = int(pid_file.read_text())
            with open(f"/proc/{pid}/cmdline", "rb") as fp:
                argv = fp.read().split(b"\0")
            if os.fsencode(f"--socket={pid_file.with_suffix('')}") not in argv:
                continue
            os.kill(pid, signal.SIGTERM)
            pids.append(pid)
    return pids


# -- the marks a forked process carries ------------------------------------------------------
def _regions() -> tuple[tuple[int, int], tuple[int, int]]:
    """This process's exec-time command line and environment: (start, end) addresses of each."""
    fields = stat_fields("self")
    if fields is None:
        raise OSError("cannot read /proc/self/stat")
    arg = (int(fields[_ARG_START]), int(fields[_ARG_START + 1]))
    env = (int(fields[_ENV_START]), int(fields[_ENV_START + 1]))
    return arg, env


# Set in the zygote once it knows its room (the processes it forks inherit it): None elsewhere.
_REGIONS: tuple[tuple[int, int], tuple[int, int]] | None = None


def _as_shown(env: Mapping[str, str], argv: Sequence[str]) -> tuple[bytes, bytes] | None:
    """``argv`` and ``env`` as the kernel shows them, each NUL-terminated; None when either is
    larger than this process's room for it (or it has none: it was not forked from a zygote)."""
    if _REGIONS is None:
        return None
    (arg_start, arg_end), (env_start, env_end) = _REGIONS
    line = b"".join(os.fsencode(a) + b"\0" for a in argv)
    environ = b"".join(os.fsencode(k) + b"=" + os.fsencode(v) + b"\0" for k, v in env.items())
    if len(line) > arg_end - arg_start or len(environ) > env_end - env_start:
        return None
    return line, environ


def can_mark(env: Mapping[str, str], argv: Sequence[str]) -> bool:
    """This process can show ``env`` and ``argv`` as its own (:func:`mark`)."""
    return _as_shown(env, argv) is not None


def mark(env: Mapping[str, str], argv: Sequence[str]) -> None:
    """Write ``env`` over this process's exec-time environment and ``argv`` over its command line,
    the rest of each room NULs: what ``/proc/<pid>/environ`` and ``cmdline`` show of it (the group
    markers by which teardown finds a group's processes among them)."""
    shown = _as_shown(env, argv)
    if shown is None or _REGIONS is None:
        raise ValueError("no room for this environment and command line: not forked from a zygote, or too large")
    for (start, end), data in zip(_REGIONS, shown, strict=True):
        ctypes.memmove(start, data.ljust(end - start, b"\0"), end - start)


def _become(argv: Sequence[str], env: Mapping[str, str], cwd: str, umask: int | None) -> None:
    """This forked process as if exec'd as ``argv`` with ``env`` in ``cwd``."""
    os.chdir(cwd)
    if umask is not None:
        os.umask(umask)
    os.environ.clear()  # (C's environ drops its pointers into the exec-time area too)
    mark(env, argv)
    os.environ.update(env)
    for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGCHLD, signal.SIGUSR1, signal.SIGUSR2):
        signal.signal(sig, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    threads = env.get("OMP_NUM_THREADS", "")
    if "torch" in sys.modules and threads.isdigit() and int(threads) > 0:
        # OpenMP read it when torch loaded it, in the zygote, made without it: as that read would have
        sys.modules["torch"].set_num_threads(int(threads))
    sys.path[0] = os.getcwd()  # as `python -m` in cwd
    tempfile.tempdir = None  # the zygote's, cached: read TMPDIR again
    random.seed()


# -- the supervisor's side: its agent --------------------------------------------------------
class ForkedAgent:
    """A node's agent forked by its supervisor: what the supervisor asks of a ``Popen``."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            try:
                pid, status = os.waitpid(self.pid, os.WNOHANG)
            except ChildProcessError:  # reaped by the supervisor's reaper, which set returncode
                return self.returncode
            if pid:
                self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode


def fork_agent(command: Sequence[str], log: IO[bytes], env: Mapping[str, str]) -> ForkedAgent | None:
    """The node's agent ``command`` (``python -m airflow_torchrun.backends.local.agent ...``) forked
    from this supervisor when it was forked from a zygote (torch is imported, its markers have room),
    with stdin on /dev/null and stdout and stderr to ``log``; None otherwise: exec it."""
    if list(command[:3]) != [sys.executable, "-m", AGENT_MODULE] or AGENT_MODULE not in sys.modules:
        return None
    if not can_mark(env, command):
        return None
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    pid = os.fork()
    if pid:
        return ForkedAgent(pid)
    code = 1
    try:
        devnull = os.open(os.devnull, os.O_RDONLY)
        os.dup2(devnull, 0)
        os.dup2(log.fileno(), 1)
        os.dup2(log.fileno(), 2)
        os.close(devnull)
        _become(command, env, os.getcwd(), None)
        agent = sys.modules[AGENT_MODULE]
        sys.argv = [agent.__file__ or AGENT_MODULE, *command[3:]]
        code = run_main(agent.main, list(command[3:]))
        agent._exit_now(code)  # its atexit handlers, then its end without torch's teardown
    except BaseException:
        traceback.print_exc()
    exit_now(code)
    raise AssertionError("unreachable")


# -- the zygote ------------------------------------------------------------------------------
# Forked ahead of the requests: a fork of a process that holds torch takes 7 ms on 2 cores, which a
# launch would otherwise wait for, node after node. A spare blocks in ``accept``; the one the kernel
# hands a connection to becomes that node's supervisor, and the zygote forks the spares taken again
# once the launch's requests stop coming.
SPARES = 4
_PR_SET_PDEATHSIG = 1


def _spare(listener: socket.socket, taken: int, zygote: int) -> None:
    """A spare's life: wait for one request, say so on ``taken`` (its pid), serve it as its supervisor.
    Waiting, it dies with the zygote (pid ``zygote``: however the zygote ends, it kills no spare
    itself); serving, it outlives it (a running group never depends on it). One that took a request
    and died with the zygote before it answered leaves its caller to start the node itself."""
    global _LOCK
    libc = ctypes.CDLL(None, use_errno=True)
    code = 0
    try:
        if _LOCK is not None:  # (the zygote holds it; a spare left behind must not)
            _LOCK.close()
            _LOCK = None
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM})  # blocked by the zygote around the fork
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
        if os.getppid() != zygote:  # the zygote died before the line above
            exit_now(0)
        listener.settimeout(None)
        conn, _ = listener.accept()
        libc.prctl(_PR_SET_PDEATHSIG, 0)
        os.write(taken, struct.pack("!i", os.getpid()))
        os.close(taken)
        listener.close()
        with conn:
            _serve(conn)
    except BaseException:
        traceback.print_exc()
        code = 1
    exit_now(code)


def _taken(pipe: int) -> set[int]:
    """The spares that said they took a request (their pids, 4 bytes each: one write, never split)."""
    data = os.read(pipe, 4096)
    return {pid for (pid,) in struct.iter_unpack("!i", data[: len(data) // 4 * 4])}


def _serve(conn: socket.socket) -> None:
    """One request, in the spare that took it: it becomes the node's supervisor, answers its pid and
    starts on the caller's go."""
    creds = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    _pid, uid, _gid = struct.unpack("3i", creds)
    if uid != os.getuid():
        return
    conn.settimeout(ANSWER_TIMEOUT_S)
    header, fds, _flags, _addr = socket.recv_fds(conn, 8, 3)
    if len(header) != 8 or len(fds) != 3:
        return
    (length,) = struct.unpack("!Q", header)
    if length > _MAX_REQUEST:
        return
    data = b""
    while len(data) < length:
        chunk = conn.recv(min(length - len(data), 1 << 20))
        if not chunk:
            return
        data += chunk
    _supervisor(conn, fds, json.loads(data))


def _supervisor(conn: socket.socket, fds: list[int], request: dict[str, Any]) -> None:
    code = 1
    try:
        os.setsid()
        for target, fd in enumerate(fds):
            os.dup2(fd, target)
        for fd in fds:
            if fd > 2:
                os.close(fd)
        argv = [str(a) for a in request["argv"]]
        env = {str(k): str(v) for k, v in request["env"].items()}
        command = [sys.executable, "-m", SUPERVISOR_MODULE, *argv]
        if not can_mark(env, command):
            conn.sendall(
                json.dumps({"error": "environment or command line larger than the room for it"}).encode() + b"\n"
            )
            exit_now(0)
        _become(command, env, str(request["cwd"]), request.get("umask"))
        conn.sendall(json.dumps({"pid": os.getpid()}).encode() + b"\n")
        if _line(conn) != b"go":
            exit_now(0)
        conn.close()
        supervisor = sys.modules[SUPERVISOR_MODULE]
        sys.argv = [supervisor.__file__ or SUPERVISOR_MODULE, *argv]
        code = run_main(supervisor.main, argv)
    except BaseException:
        traceback.print_exc()
    exit_now(code)


_LOCK: IO[str] | None = None
# How often a zygote looks at its socket (replaced or removed: it leaves) and its spares.
_LOOK_S = 5.0
# How long after a request a zygote waits for the next one of the same launch before it replaces
# the spares taken.
_SETTLE_S = 0.05


def _locked(path: Path) -> IO[str] | None:
    """The lock of the zygote at ``path``, taken; None when a zygote holds it."""
    lock = open(f"{path}.lock", "a+")  # noqa: SIM115 - held as long as it is wanted
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        lock.close()
        return None
    return lock


def _ours(path: Path, inode: int) -> bool:
    try:
        return os.stat(path).st_ino == inode
    except OSError:
        return False


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--socket", required=True, type=Path)
    parser.add_argument("--idle", type=float, default=IDLE_S)
    parser.add_argument("--room", default="", help="room for the command lines of the processes it forks")
    args = parser.parse_args(argv)
    print(f"zygote {args.socket.name}: started by pid {os.getppid()}, idle {args.idle:g} s", flush=True)
    if os.fork():  # the starter reaps this one at once; the zygote is nobody's child
        os._exit(0)
    path: Path = args.socket
    global _LOCK, _REGIONS
    _LOCK = _locked(path)
    if _LOCK is None:
        return 0  # another zygote of this kind is starting or serving
    _REGIONS = _regions()
    for module in PRELOAD:
        __import__(module)
    with contextlib.suppress(FileNotFoundError):
        path.unlink()
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    with _addressable(path) as address:
        listener.bind(address)
    os.chmod(path, 0o600)
    listener.listen(64)
    inode = os.stat(path).st_ino
    pid_file = Path(f"{path}.pid")
    pid_file.write_text(str(os.getpid()))
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # the supervisors it forks are reaped by the kernel

    def leave(_signum: int, _frame: object) -> None:
        raise SystemExit(0)

    signal.signal(signal.SIGTERM, leave)
    taken_r, taken_w = os.pipe()
    zygote_pid = os.getpid()
    spares: set[int] = set()
    last = time.monotonic()
    try:
        while _ours(path, inode) and time.monotonic() - last < args.idle:
            spares = {pid for pid in spares if pid_alive(pid)}  # (one killed by hand is replaced)
            while len(spares) < SPARES:
                # SIGTERM waits until the spare has its own handler (the zygote's would run in it).
                signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
                pid = os.fork()
                if pid == 0:
                    os.close(taken_r)
                    _spare(listener, taken_w, zygote_pid)
                signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM})
                spares.add(pid)
            ready, _, _ = select.select([taken_r], [], [], min(_LOOK_S, args.idle))
            if ready:
                spares -= _taken(taken_r)
                # A launch takes one per node, in a row: the replacements are forked once it is
                # done (while spares last), not between its nodes, which would wait for the CPU.
                while spares and select.select([taken_r], [], [], _SETTLE_S)[0]:
                    spares -= _taken(taken_r)
                last = time.monotonic()
    finally:  # (the waiting spares die with this process: their PR_SET_PDEATHSIG)
        if _ours(path, inode):
            with contextlib.suppress(OSError):
                path.unlink()
            with contextlib.suppress(OSError):
                pid_file.unlink()
    return 0


if __name__ == "__main__":
    # As the package's module, not as __main__: the processes it forks find its state (_REGIONS)
    # where they import it from.
    sys.exit(importlib.import_module("airflow_torchrun.backends.local.zygote").main())
