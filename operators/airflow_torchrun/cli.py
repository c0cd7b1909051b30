"""The ``airflow-torchrun`` command.

``airflow-torchrun render --dag-file dags/x.py --task-id train`` prints, as multi-document YAML,
exactly the Kubernetes objects that task would create (its Indexed Job and headless Service), for
review and for ``kubectl apply --dry-run=server -f -``. Nothing is sent to a cluster and no
metadata database is needed; the task's templated fields are rendered with a small context
(``run_id``, ``ds``, ``ts``, ``logical_date``, ``params``, ``dag_run.conf``, ``try_number``,
``map_index``, and ``ti.xcom_pull``), with ``--conf`` merged over the DAG's params as a triggered
run's conf is. An upstream task's output (``shard.output``, ``ti.xcom_pull(...)``) is shown as a
placeholder that names it: it exists only at run time.

The variables the operator resolves at launch with I/O (checkpoint location and resume point,
MLflow run) are shown as the operator's ``contract_env_preview(context)`` gives them, without I/O.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
import os
import sys
from collections.abc import Iterator, Sequence
from datetime import UTC, datetime
from pathlib import Path
from types import SimpleNamespace
from typing import IO, TYPE_CHECKING, Any, cast

from airflow_torchrun.errors import TorchrunError

if TYPE_CHECKING:
    from airflow_torchrun.compat import Context
    from airflow_torchrun.operators.group import GroupOperator

DEFAULT_RUN_ID = "manual__render"


class CliError(Exception):
    """A problem the user can fix; printed without a traceback."""


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="airflow-torchrun", description="Tools for airflow-torchrun training groups.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    render = sub.add_parser(
        "render",
        help="print the Kubernetes objects a training task would create",
        description=(
            "Print, as multi-document YAML, the Indexed Job and headless Service that a "
            "task with backend='kubernetes' (DistributedTrainingOperator, EvaluateModelOperator, "
            "@task.torchrun) would create for the given run and try. Nothing is sent to a cluster. Left "
            "out: the Service's ownerReference to the Job and its controller-uid selector (they need the "
            "Job's uid); the variables resolved at launch (resume point, MLflow run) are shown as "
            "placeholders. Review the output, or check it with: "
            "airflow-torchrun render ... | kubectl apply --dry-run=server -f -"
        ),
    )
    render.add_argument("--dag-file", required=True, type=Path, help="the Python file that defines the DAG")
    render.add_argument("--task-id", required=True, help="the training task's task_id")
    render.add_argument("--dag-id", help="the DAG's dag_id; needed only when the file defines several DAGs")
    render.add_argument(
        "--run-id",
        default=DEFAULT_RUN_ID,
        help=f"the DAG run's run_id; object names and labels derive from it (default: {DEFAULT_RUN_ID})",
    )
    render.add_argument("--try-number", type=int, default=1, help="the task try; part of the names (default: 1)")
    render.add_argument(
        "--map-index", type=int, default=-1, help="map index of a mapped task instance (default: -1, not mapped)"
    )
    render.add_argument(
        "--logical-date",
        help="logical date for templates, ISO 8601 (default: now, UTC)",
    )
    render.add_argument(
        "--conf",
        type=_json_object,
        default={},
        help="the run's conf, a JSON object, as the Trigger form sends it: merged over the DAG's params and "
        'checked against them, e.g. \'{"backend": "kubernetes"}\' (default: {})',
    )
    render.add_argument(
        "--namespace",
        help="namespace of the objects (default: the task's, else [torchrun] kubernetes_namespace, else default)",
    )
    render.add_argument(
        "--runtimes-file",
        type=Path,
        help="read runtimes from this YAML file instead of [torchrun] runtimes_file and the Airflow Variable",
    )
    return parser


def _json_object(text: str) -> dict[str, Any]:
    try:
        value = json.loads(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"not JSON ({exc}): {text!r}") from exc
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"a JSON object is needed, e.g. '{{\"epochs\": 3}}', got {text!r}")
    return value


def _load_task(dag_file: Path, dag_id: str | None, task_id: str) -> GroupOperator:
    if not dag_file.is_file():
        raise CliError(f"--dag-file {dag_file} does not exist")
    from airflow.dag_processing.dagbag import DagBag

    bag = DagBag(dag_folder=str(dag_file), safe_mode=False)
    if bag.import_errors:
        errors = "\n".join(f"{path}:\n{err}" for path, err in bag.import_errors.items())
        raise CliError(f"the DAG file does not import:\n{errors}")
    if not bag.dags:
        raise CliError(f"{dag_file} defines no DAG")
    if dag_id is None:
        if len(bag.dags) > 1:
            raise CliError(f"{dag_file} defines several DAGs ({', '.join(sorted(bag.dags))}); choose one with --dag-id")
        dag = next(iter(bag.dags.values()))
    elif dag_id in bag.dags:
        dag = bag.dags[dag_id]
    else:
        raise CliError(f"{dag_file} has no DAG {dag_id!r}; it defines {', '.join(sorted(bag.dags))}")
    if not dag.has_task(task_id):
        raise CliError(f"DAG {dag.dag_id} has no task {task_id!r}; its tasks: {', '.join(sorted(dag.task_ids))}")
    task = dag.get_task(task_id)
    from airflow_torchrun.operators.group import GroupOperator

    if type(task).__name__ == "MappedOperator":
        raise CliError(
            f"task {dag.dag_id}.{task_id} is mapped (.expand()): its arguments exist only once the run has "
            "expanded it, so render cannot show its objects; render an unmapped task with the same arguments"
        )
    if not isinstance(task, GroupOperator):
        raise CliError(
            f"task {dag.dag_id}.{task_id} is a {type(task).__name__}, not an operator that runs a torchrun group "
            "(DistributedTrainingOperator, EvaluateModelOperator)"
        )
    return task


def _context(task: Any, args: argparse.Namespace) -> dict[str, Any]:
    logical = datetime.fromisoformat(args.logical_date) if args.logical_date else datetime.now(tz=UTC)
    if logical.tzinfo is None:
        logical = logical.replace(tzinfo=UTC)
    params = copy.deepcopy(task.params)  # the DAG's, with the task's own over them
    try:
        for key, value in args.conf.items():
            params[key] = value  # a DAG param checks the value it is given
        resolved = params.validate() if hasattr(params, "validate") else dict(params or {})
    except Exception as exc:  # ParamValidationError, and what a Param's schema raises
        # jsonschema's first paragraph says it; the schema and instance dumps after it do not help.
        reason = str(exc).split("\n\n", 1)[0]
        raise CliError(
            f"the run's params (the DAG's, with --conf over them) are invalid: {reason}; "
            "give the values the Trigger form would with --conf '{\"name\": value}'"
        ) from exc
    return {
        "dag": task.dag,
        "task": task,
        "run_id": args.run_id,
        "dag_run": SimpleNamespace(run_id=args.run_id, conf=dict(args.conf), logical_date=logical),
        "logical_date": logical,
        "ds": logical.strftime("%Y-%m-%d"),
        "ds_nodash": logical.strftime("%Y%m%d"),
        "ts": logical.isoformat(),
        "ts_nodash": logical.strftime("%Y%m%dT%H%M%S"),
        "params": resolved,
        "try_number": args.try_number,
        "map_index": args.map_index,
    }


def _for_templates(context: dict[str, Any]) -> dict[str, Any]:
    """``context`` plus a task instance for templates alone, whose ``xcom_pull`` gives placeholders.
    The operator's own preview gets ``context`` without it: no task instance means "no run", and
    nothing is created for one (the deployment's Variable, say)."""
    ti = SimpleNamespace(
        dag_id=context["dag"].dag_id,
        task_id=context["task"].task_id,
        run_id=context["run_id"],
        try_number=context["try_number"],
        map_index=context["map_index"],
        xcom_pull=_pending_xcom,
    )
    return {**context, "ti": ti, "task_instance": ti}


class _Pending(str):
    """What an upstream task will have pushed, as text that names it
    (``<XCom 'return_value' of task train['final_checkpoint'], resolved at run time>``). A template
    may read into it (``[key]``, ``.attr``, ``.get(key)``), iterate it (one element) or filter it
    (``join``, ``length``, ``tojson``): each gives a placeholder, never an error or a hang."""

    what: str

    def __new__(cls, what: str) -> _Pending:
        from airflow_torchrun.spec import placeholder

        pending = super().__new__(cls, placeholder(what))
        pending.what = what
        return pending

    def __getitem__(self, key: object) -> _Pending:
        return _Pending(f"{self.what}[{key!r}]")

    def __getattr__(self, name: str) -> _Pending:
        # Names Jinja's sandbox probes (``unsafe_callable``, ``alters_data``) and dunders are absent.
        if name.startswith("_") or name in ("unsafe_callable", "alters_data", "jinja_pass_arg"):
            raise AttributeError(name)
        return _Pending(f"{self.what}.{name}")

    def __call__(self, *args: object, **kwargs: object) -> _Pending:
        given = [repr(a) for a in args] + [f"{k}={v!r}" for k, v in kwargs.items()]
        return _Pending(f"{self.what}({', '.join(given)})")

    def __iter__(self) -> Iterator[str]:
        yield _Pending(f"an element of {self.what}")


def _pending_xcom(
    task_ids: str | Sequence[str] | None = None,
    dag_id: str | None = None,
    key: str = "return_value",
    include_prior_dates: bool = False,
    **_: Any,
) -> _Pending:
    """``ti.xcom_pull`` as Airflow 3's task instance takes it, giving a placeholder."""
    return _Pending(f"XCom {key!r} of task {task_ids}")


def render_task(args: argparse.Namespace) -> str:
    """The YAML for ``args`` (the ``render`` subcommand's work, without printing)."""
    from airflow_torchrun.backends.kubernetes.backend import KubernetesBackend, deployment_name
    from airflow_torchrun.backends.kubernetes.render import to_yaml
    from airflow_torchrun.backends.kubernetes.runtimes import load_runtimes
    from airflow_torchrun.naming import GroupIdentity
    from airflow_torchrun.spec import with_placeholders

    task = _load_task(args.dag_file, args.dag_id, args.task_id)
    context = _context(task, args)
    for field in task.template_fields:  # no upstream output exists yet: each is shown as a placeholder
        setattr(task, field, with_placeholders(getattr(task, field, None)))
    try:
        task.render_template_fields(cast("Context", _for_templates(context)))
    except Exception as exc:
        raise CliError(
            f"rendering the templated fields of {task.dag_id}.{task.task_id} failed: {exc}. `render` only offers "
            "run_id, ds, ts, logical_date, params, dag_run.conf, ti.xcom_pull, try_number and map_index to templates"
        ) from exc
    spec = task.group_spec()
    if spec.backend != KubernetesBackend.name:
        raise CliError(
            f"task {task.dag_id}.{task.task_id} uses backend={spec.backend!r}; render prints the objects of "
            "backend='kubernetes' tasks only"
        )
    # The operator's own variables (checkpoint, resume point, MLflow run) are resolved at launch,
    # with I/O a dry run must not do: the operator previews them without it.
    catalog = load_runtimes(file=str(args.runtimes_file), variable="") if args.runtimes_file else None
    backend = KubernetesBackend(
        namespace=args.namespace or task.namespace,
        deployment=deployment_name(create=False),
        runtimes=catalog,
        active_deadline_seconds=task.task_backend_options().active_deadline_seconds,
    )
    try:
        extra_env = dict(task.contract_env_preview(cast("Context", context)))
    except Exception as exc:
        raise CliError(f"the operator's contract_env_preview failed: {exc}") from exc
    identity = GroupIdentity(
        dag_id=task.dag_id,
        task_id=task.task_id,
        run_id=args.run_id,
        try_number=args.try_number,
        map_index=args.map_index,
    )
    rendered = backend.render(backend.plan(spec, identity, extra_env))
    header = (
        f"# airflow-torchrun render: {task.dag_id}.{task.task_id}, run {args.run_id}, try {args.try_number}, "
        f"namespace {rendered.namespace}, deployment {backend.deployment}\n"
        "# At launch the Service also gets an ownerReference to the Job, and selects the Job's pods by its\n"
        "# batch.kubernetes.io/controller-uid (both need the Job's uid).\n"
    )
    return header + to_yaml(rendered.objects)


@contextlib.contextmanager
def _stdout_kept_for(writer: list[IO[str]]) -> Iterator[None]:
    """Send everything written to stdout (Airflow logs there while it loads a DAG) to stderr,
    and hand out a writer for the real stdout, so that stdout carries the YAML alone."""
    try:
        fd = sys.stdout.fileno()
    except (AttributeError, OSError, ValueError):  # stdout is not a file (embedded, captured)
        writer.append(sys.stdout)
        with contextlib.redirect_stdout(sys.stderr):
            yield
        return
    sys.stdout.flush()
    saved = os.dup(fd)
    writer.append(os.fdopen(os.dup(fd), "w"))
    os.dup2(sys.stderr.fileno(), fd)
    try:
        yield
    finally:
        sys.stdout.flush()
        os.dup2(saved, fd)
        os.close(saved)


def main(argv: Sequence[str] | None = None) -> int:
    """Console script ``airflow-torchrun``; returns the exit status."""
    args = _parser().parse_args(argv)
    writer: list[IO[str]] = []
    try:
        with _stdout_kept_for(writer):
            text = render_task(args)
    except (CliError, TorchrunError) as exc:
        print(f"airflow-torchrun {args.command}: error: {exc}", file=sys.stderr)
        return 1
    writer[0].write(text)
    writer[0].flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
