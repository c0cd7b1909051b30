"""``@task.torchrun``: a plain Python function as the distributed training loop (TaskFlow).

The decorated function runs on every rank of a torchrun group, with everything
:class:`~airflow_torchrun.DistributedTrainingOperator` gives (wiring, fail fast, retries that
resume from checkpoints, tracking, both backends); rank 0's return value is the task's XCom.

Where things travel: nothing is written when the DAG is parsed. At launch, the function's source
and its rendered arguments (JSON) go into every rank's environment (see
:mod:`airflow_torchrun.worker.function`, which each rank runs through torchrun); on Kubernetes
they are part of the Job's pod template. Rank 0 writes its return value as JSON under the task's
``checkpoint_uri``, where the operator reads it once the group succeeded.
"""

from __future__ import annotations

import ast
import builtins
import dis
import inspect
import json
import textwrap
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from types import CodeType
from typing import TYPE_CHECKING, Any, ClassVar

from airflow.sdk.bases.decorator import DecoratedOperator, task_decorator_factory

from airflow_torchrun.compat import AirflowFailException
from airflow_torchrun.contract.function import AUTO, CALL_ENV, ENV_VALUE_LIMIT, SOURCE_ENV, FunctionCall
from airflow_torchrun.contract.launch import FUNCTION_ENTRY
from airflow_torchrun.errors import InvalidSpecError
from airflow_torchrun.naming import function_result_uri
from airflow_torchrun.operators.training import DistributedTrainingOperator
from airflow_torchrun.operators.training_contract import TrainingContract, TrainingSettings
from airflow_torchrun.spec import GroupSpec, is_templated, with_placeholders

if TYPE_CHECKING:
    from airflow.sdk.bases.decorator import TaskDecorator

    from airflow_torchrun.backends.handles import GroupHandle
    from airflow_torchrun.compat import Context
    from airflow_torchrun.operators.contracts import TaskIO
    from airflow_torchrun.watch import Verdict

XCOM_SUMMARY = "training_summary"
# Context keys a function may take as parameters (by name, like @task); JSON values only reach a rank.
_CONTEXT_KEYS = frozenset({"run_id", "ds", "ds_nodash", "ts", "ts_nodash", "params", "map_index", "try_number"})
_NOT_YOURS = ("script", "command", "script_args")
_JSON_HINT = (
    "the ranks receive the arguments as JSON: pass plain values (numbers, strings, lists, dicts), or a "
    "URI and load the object inside the function"
)


@dataclass(frozen=True)
class ShippedFunction:
    """The function as it travels: its own source (decorators removed) and where it came from."""

    name: str
    source: str
    filename: str
    first_line: int


def ship_function(fn: Callable[..., Any]) -> tuple[ShippedFunction | None, list[str]]:
    """The function's source, or every reason it cannot run from its source alone on a rank."""
    name = getattr(fn, "__name__", repr(fn))
    fix = "define it with def at module level of the DAG file, import what it needs inside it, pass values as arguments"
    if name == "<lambda>":
        return None, [f"a lambda cannot be shipped to the ranks; {fix}"]
    if not inspect.isfunction(fn):
        return None, [f"{name} is a {type(fn).__name__}, not a plain function; {fix}"]
    if inspect.iscoroutinefunction(fn) or inspect.isasyncgenfunction(fn):
        return None, [f"{name}() is async; the ranks call it synchronously: make it a plain def"]
    try:
        lines, start = inspect.getsourcelines(fn)
        filename = inspect.getsourcefile(fn) or fn.__code__.co_filename
    except (OSError, TypeError) as exc:
        return None, [f"the source of {name}() cannot be read ({exc}); {fix}"]
    text = textwrap.dedent("".join(lines))
    try:
        tree = ast.parse(text)
    except SyntaxError as exc:
        return None, [f"the source of {name}() does not parse on its own ({exc}); {fix}"]
    node = tree.body[0] if tree.body else None
    if not isinstance(node, ast.FunctionDef) or node.name != name:
        return None, [f"the source of {name}() could not be isolated from its file; {fix}"]

    problems: list[str] = []
    free = fn.__code__.co_freevars
    if free:
        problems.append(
            f"{name}() is a closure over {', '.join(free)} of the function it is defined in; only its own source "
            f"travels to the ranks: {fix}"
        )
    outer = sorted(_global_names(fn.__code__) - {name, "__name__", "__file__"})
    if outer:
        problems.append(
            f"{name}() uses the module-level name(s) {', '.join(outer)}, which do not travel with its source: "
            "import them inside the function (e.g. `import torch` as its first line) and pass values as arguments"
        )
    defaults = sorted(_names_in([*node.args.defaults, *(d for d in node.args.kw_defaults if d is not None)]))
    if defaults:
        problems.append(
            f"default values of {name}()'s parameters use {', '.join(defaults)}, which the ranks do not have: use "
            "literals as defaults, or pass the values as arguments"
        )
    others = [ast.unparse(d) for d in node.decorator_list if "torchrun" not in ast.unparse(d)]
    if others:
        problems.append(
            f"{name}() has other decorators ({', '.join('@' + d for d in others)}); only the function's own source "
            "travels to the ranks: apply them inside the function, or drop them"
        )
    body = text.splitlines(keepends=True)[node.lineno - 1 : node.end_lineno]
    source = textwrap.dedent("".join(body))
    shipped = ShippedFunction(name=name, source=source, filename=filename, first_line=start + node.lineno - 1)
    return (None if problems else shipped), problems


def _global_names(code: CodeType) -> set[str]:
    """Global names a code object (and the code nested in it) loads, minus builtins and its own globals."""
    loaded: set[str] = set()
    stored: set[str] = set()
    todo = [code]
    while todo:
        current = todo.pop()
        for ins in dis.get_instructions(current):
            if ins.opname == "LOAD_GLOBAL":
                loaded.add(str(ins.argval))
            elif ins.opname in ("STORE_GLOBAL", "DELETE_GLOBAL"):
                stored.add(str(ins.argval))
        todo.extend(c for c in current.co_consts if isinstance(c, CodeType))
    return {n for n in loaded - stored if not hasattr(builtins, n)}


def _names_in(nodes: Sequence[ast.AST]) -> set[str]:
    return {n.id for expr in nodes for n in ast.walk(expr) if isinstance(n, ast.Name) and not hasattr(builtins, n.id)}


def json_problems(value: Any, where: str, *, allow_templates: bool) -> list[str]:
    """Why ``value`` cannot travel as JSON (nothing for an upstream output not known yet)."""
    if allow_templates and is_templated(value):
        return []
    if value is None or isinstance(value, str | bool | int | float):
        return []
    if isinstance(value, list | tuple):
        return [
            p for i, v in enumerate(value) for p in json_problems(v, f"{where}[{i}]", allow_templates=allow_templates)
        ]
    if isinstance(value, Mapping):
        problems = []
        for key, item in value.items():
            if not isinstance(key, str):
                problems.append(f"{where} has the key {key!r} ({type(key).__name__}); JSON keys are strings")
            problems += json_problems(item, f"{where}[{key!r}]", allow_templates=allow_templates)
        return problems
    text = repr(value)
    text = text if len(text) <= 60 else text[:57] + "..."
    return [f"{where} is {type(value).__name__} {text}, which is not JSON-serialisable; {_JSON_HINT}"]


def _entry_command(backend: object) -> list[str]:
    """torchrun runs it with --no-python: the backend's interpreter (this one locally, the image's
    ``python`` elsewhere; for a templated backend, ``python`` until it is rendered)."""
    from airflow_torchrun.settings import known_backend

    cls = known_backend(backend)
    return [cls.python if cls is not None else "python", "-m", FUNCTION_ENTRY]


class TorchrunDecoratedOperator(DecoratedOperator, DistributedTrainingOperator):
    """The operator behind ``@task.torchrun``: the decorated function runs on every rank.

    Every argument of :class:`~airflow_torchrun.DistributedTrainingOperator` works (``num_nodes``,
    ``nproc_per_node``, ``backend``, ``runtime``, ``retries`` with ``resume``, ``track``...), except
    ``script``, ``command`` and ``script_args``: the function is what runs. Inside it, the ranks
    see the same contract as a script (torchrun's variables, ``TRAIN_*``, MLflow's) and the worker
    helpers (``save_checkpoint``, ``load_checkpoint``, ``resume_step``...) work as in a script.

    The function: a plain ``def`` that imports what it needs inside itself (only its own source
    travels: closures, lambdas and module-level names are refused when the DAG is parsed). Its
    arguments may be literals, templates or upstream outputs (``train(pick_lr())``); they reach the
    ranks as JSON (tuples become lists), checked at parse time where known and after rendering
    otherwise. Parameters named ``run_id``, ``ds``, ``ts``, ``params``, ``map_index`` or
    ``try_number`` receive that context value, as with ``@task``.

    The process group: by default initialised before the function is called (``gloo``, or
    ``cpu:gloo,cuda:nccl`` with the rank's GPU selected when CUDA is available); a
    ``torch.distributed.init_process_group(...)`` inside the function is then a no-op, so
    initialising twice never fails. The group is destroyed after the function returned.

    The result: rank 0's return value (JSON-serialisable; other ranks' are ignored) is the task's
    XCom ``return_value``; it travels through ``<checkpoint_uri>/results/``, so on Kubernetes
    ``checkpoint_uri`` must be storage the pods and the Airflow worker share (``s3://...``). The
    operator's summary (what ``DistributedTrainingOperator`` returns) is under the XCom key
    ``training_summary``.

    :param process_group_backend: Backend of the process group the decorator initialises:
        ``"auto"`` (default, see above), a torch backend string (``"nccl"``, ``"gloo"``,
        ``"cpu:gloo,cuda:nccl"``), or ``None``: the function initialises it itself.

    Size limits: the source and the JSON of the arguments each travel in one environment variable
    of at most 127 KiB (Linux refuses to start a process with a longer one, and on Kubernetes this
    also keeps the Job far below its ~1 MiB object limit). Pass large data by URI.
    """

    custom_operator_name = "@task.torchrun"
    template_fields: Sequence[str] = tuple(
        f for f in (*DistributedTrainingOperator.template_fields, "op_args", "op_kwargs") if f not in _NOT_YOURS
    )
    template_fields_renderers: ClassVar[dict[str, str]] = {"env": "json", "op_args": "py", "op_kwargs": "py"}
    shallow_copy_attrs: Sequence[str] = ("python_callable",)

    def __init__(
        self, *, python_callable: Callable[..., Any], process_group_backend: str | None = AUTO, **kwargs: Any
    ) -> None:
        given = [name for name in _NOT_YOURS if name in kwargs]
        if given:
            raise TypeError(
                f"@task.torchrun runs the decorated function on every rank; {', '.join(given)} belong to "
                "DistributedTrainingOperator: drop them and pass the function's arguments when calling it"
            )
        if getattr(python_callable, "__name__", "") == "<lambda>":  # before Airflow trips over its task_id
            raise InvalidSpecError(ship_function(python_callable)[1], "@task.torchrun")
        self.process_group_backend = process_group_backend
        super().__init__(python_callable=python_callable, command=_entry_command(kwargs.get("backend")), **kwargs)

    # -- checks -------------------------------------------------------------------------------
    def validate(self, *, allow_templates: bool) -> GroupSpec | None:
        """The training operator's checks plus the function's, in one error."""
        problems = self._function_problems(allow_templates=allow_templates)
        try:
            spec = super().validate(allow_templates=allow_templates)
        except InvalidSpecError as exc:
            raise InvalidSpecError([*exc.problems, *problems], self._where) from None
        if problems:
            raise InvalidSpecError(problems, self._where)
        return spec

    def _make_spec(self, *, allow_templates: bool) -> GroupSpec:
        self.command = _entry_command(self.backend)  # the backend may have been a template
        return super()._make_spec(allow_templates=allow_templates)

    def _function_problems(self, *, allow_templates: bool) -> list[str]:
        shipped, problems = ship_function(self.python_callable)
        for name, value in self._bound_arguments().items():
            problems += json_problems(value, f"argument {name}", allow_templates=allow_templates)
        if isinstance(self.env, Mapping):
            problems += [
                f"env: {key} carries the decorated function to the ranks; remove it from env"
                for key in (SOURCE_ENV, CALL_ENV)
                if key in self.env
            ]
        backend = self.process_group_backend
        if backend is not None and (not isinstance(backend, str) or not backend):
            problems.append(
                f"process_group_backend must be 'auto', a torch backend name such as 'gloo' or 'nccl', or None "
                f"(the function initialises the group), got {backend!r}"
            )
        if shipped is not None and not problems:
            # Upstream outputs are not known yet: counted as their placeholders, checked again at launch.
            known = with_placeholders(self._bound_arguments())
            problems += _size_problems(self._call(shipped, known, result_uri=None))
        return problems

    def _bound_arguments(self) -> dict[str, Any]:
        """Arguments by parameter name (positionals of ``*args`` as ``args[i]``)."""
        try:
            bound = inspect.signature(self.python_callable).bind_partial(*self.op_args, **self.op_kwargs)
        except TypeError:  # DecoratedOperator reported it already
            return {f"{i + 1}": v for i, v in enumerate(self.op_args)} | dict(self.op_kwargs)
        return dict(bound.arguments)

    def _call(self, shipped: ShippedFunction, arguments: Mapping[str, Any], result_uri: str | None) -> FunctionCall:
        signature = inspect.signature(self.python_callable)
        ordered = {name: arguments[name] for name in signature.parameters if name in arguments}
        bound = inspect.BoundArguments(signature, ordered)
        args, kwargs = list(bound.args), dict(bound.kwargs)
        params = list(signature.parameters.values())
        if not any(p.kind is inspect.Parameter.VAR_POSITIONAL and ordered.get(p.name) for p in params):
            # By name where the signature allows it: readable in the rendered pod spec and the logs.
            by_name = [p.name for p in params[: len(args)] if p.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD]
            args = args[: len(args) - len(by_name)]
            kwargs = {**{name: ordered[name] for name in by_name}, **kwargs}
        return FunctionCall(
            name=shipped.name,
            source=shipped.source,
            filename=shipped.filename,
            first_line=shipped.first_line,
            args=_jsonable(args),
            kwargs=_jsonable(kwargs),
            result_uri=result_uri,
            process_group_backend=self.process_group_backend,
        )

    # -- the call a rank gets -----------------------------------------------------------------
    def _context_arguments(self, context: Context, *, preview: bool) -> dict[str, Any]:
        """Parameters named after a context key, not given as arguments, get the context's value."""
        given = self._bound_arguments()
        out: dict[str, Any] = {}
        for name in inspect.signature(self.python_callable).parameters:
            if name in given or name not in _CONTEXT_KEYS:
                continue
            if name == "try_number" and "ti" in context:
                value: Any = context["ti"].try_number
            else:
                value = context.get(name)
            if isinstance(value, Mapping):
                value = value.dump() if hasattr(value, "dump") else dict(value)
            problems = json_problems(value, f"the context value {name}", allow_templates=False)
            if problems and preview:
                value = f"<{name} of the task's context>"
            elif problems:
                raise AirflowFailException(f"{self._where}: " + "; ".join(problems))
            out[name] = value
        return out

    def _function_env(self, context: Context, result_uri: str, *, preview: bool) -> dict[str, str]:
        shipped, problems = ship_function(self.python_callable)
        if shipped is None:  # refused at parse time already; a function changed since?
            raise AirflowFailException(f"{self._where}: " + "; ".join(problems))
        arguments = {**self._bound_arguments(), **self._context_arguments(context, preview=preview)}
        call = self._call(shipped, arguments, result_uri=result_uri)
        problems = _size_problems(call)
        if problems:
            raise AirflowFailException(f"{self._where}: " + "; ".join(problems))
        return call.to_env()

    def rank_contract(self, io: TaskIO, state: dict[str, Any] | None = None) -> FunctionContract:
        return FunctionContract(
            io,
            self.training,
            function_env=lambda uri, preview: self._function_env(io.context, uri, preview=preview),
            **self.contract_arguments(state),
        )


class FunctionContract(TrainingContract):
    """Training's contract plus the function: its source and arguments in every rank's environment,
    rank 0's return value (written under the task's checkpoints) as the task's result."""

    def __init__(
        self, io: TaskIO, settings: TrainingSettings, *, function_env: Callable[[str, bool], dict[str, str]], **kw: Any
    ) -> None:
        super().__init__(io, settings, **kw)
        self._function_env = function_env
        self.result_uri = function_result_uri(self.checkpoint_uri, self.lineage.task_id, io.map_index, io.try_number)

    def preview(self) -> dict[str, str]:
        """The training contract and the shipped function, without I/O (``airflow-torchrun render``)."""
        return {**super().preview(), **self._function_env(self.result_uri, True)}

    def env(self) -> dict[str, str]:
        """The training contract, then the function (checked first: a bad argument launches nothing)."""
        function_env = self._function_env(self.result_uri, False)
        env = super().env()
        self.io.preflight("clearing an earlier launch's result", self._remove_result)
        return {**env, **function_env}

    def relaunch_env(self) -> dict[str, str]:
        """Training's, and the result of the launch before cleared (it is gone: nothing writes it now)."""
        env = super().relaunch_env()
        self.io.preflight("clearing an earlier launch's result", self._remove_result)
        return {**env, **self._function_env(self.result_uri, False)}

    def finish(self, handle: GroupHandle, verdict: Verdict, spec: GroupSpec) -> Any:
        """Rank 0's return value; the training summary goes to the XCom key ``training_summary``."""
        summary = super().finish(handle, verdict, spec)
        self.io.push(XCOM_SUMMARY, summary)
        text = self.io.preflight("reading rank 0's return value", self._read_result)
        if text is None:
            raise AirflowFailException(
                f"{self.io.where}: every rank exited 0 but rank 0's return value is not at {self.result_uri}. On "
                "Kubernetes, checkpoint_uri must be storage the pods and the Airflow worker share (s3://...), not "
                "a path inside the pods"
            )
        return json.loads(text)

    def _store_and_path(self) -> tuple[Any, str]:
        from airflow_torchrun.storage.checkpoints import CheckpointStore

        root, _, name = self.result_uri.rpartition("/")
        store = CheckpointStore(root, self.io.resolved_storage_options())
        return store, f"{store.path_of(root)}/{name}"

    def _read_result(self) -> str | None:
        store, path = self._store_and_path()
        try:
            with store.fs.open(path, "r") as fp:
                return str(fp.read())
        except FileNotFoundError:
            return None

    def _remove_result(self) -> None:
        store, path = self._store_and_path()
        if store.fs.exists(path):
            store.fs.rm(path)


def _jsonable(value: Any) -> Any:
    """Tuples as lists, as JSON will make them; everything else as it is (checked before)."""
    if isinstance(value, list | tuple):
        return [_jsonable(v) for v in value]
    if isinstance(value, Mapping):
        return {k: _jsonable(v) for k, v in value.items()}
    return value


def _size_problems(call: FunctionCall) -> list[str]:
    try:
        env = call.to_env()
    except (TypeError, ValueError) as exc:  # json_problems missed something: still say what
        return [f"the arguments of {call.name}() are not JSON-serialisable ({exc}); {_JSON_HINT}"]
    problems = []
    for key, what, hint in (
        (SOURCE_ENV, "source", "move code into a module installed on the workers (or in the image) and import it"),
        (CALL_ENV, "arguments (as JSON)", "pass large data by URI (a file on checkpoint storage, a shard manifest)"),
    ):
        size = len(env[key].encode())
        if size > ENV_VALUE_LIMIT:
            problems.append(
                f"the {what} of {call.name}() take {size / 1024:.0f} KiB; they travel to every rank in the "
                f"environment variable {key}, which holds at most {ENV_VALUE_LIMIT // 1024} KiB (Linux's limit "
                f"on one variable, in every pod too): {hint}"
            )
    return problems


def torchrun_task(
    python_callable: Callable[..., Any] | None = None, multiple_outputs: bool | None = None, **kwargs: Any
) -> TaskDecorator:
    """``@task.torchrun(num_nodes=..., nproc_per_node=..., ...)``: run the function on every rank.

    Takes every argument of :class:`TorchrunDecoratedOperator` (that is, of
    :class:`~airflow_torchrun.DistributedTrainingOperator`, without ``script``/``command``/``script_args``).
    """
    return task_decorator_factory(
        python_callable=python_callable,
        multiple_outputs=multiple_outputs,
        decorated_operator_class=TorchrunDecoratedOperator,
        **kwargs,
    )
