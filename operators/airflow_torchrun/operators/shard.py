"""``ShardDatasetOperator``: split a dataset into one shard per training rank, plus an eval split."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from airflow_torchrun.compat import AirflowFailException, BaseOperator
from airflow_torchrun.errors import StorageError
from airflow_torchrun.naming import shard_root
from airflow_torchrun.sharding import (
    DatasetError,
    check_request,
    detect_format,
    shard_dataset,
)
from airflow_torchrun.spec import is_templated
from airflow_torchrun.state import state_dir
from airflow_torchrun.storage.uri import split_conn_id

if TYPE_CHECKING:
    from airflow_torchrun.compat import Context


def default_output_root() -> str:
    """Where shards go by default: ``shards/`` under the project's state directory.

    The state directory is ``[torchrun] state_dir``, else ``$AIRFLOW_TORCHRUN_STATE_DIR``,
    else ``<AIRFLOW_HOME>/torchrun`` (as for the local backend).
    """
    return str(state_dir() / "shards")


class ShardDatasetOperator(BaseOperator):
    """Split a dataset into ``num_shards`` shards plus a held-out evaluation split.

    Writes the shards, the evaluation split and a ``manifest.json`` (shard URIs, row counts,
    SHA-256 checksums, seed, source, format, columns) under ``output_uri`` and returns the
    manifest's URI (XCom ``return_value``); give it to the training task, which passes it to
    every rank as ``TRAIN_SHARD_MANIFEST``. It also pushes a short summary under the XCom key
    ``summary``.

    The split is a seeded permutation, so the same inputs give the same files; a retry reuses a
    finished manifest for the same source bytes and parameters, or rewrites identical files.
    Unknown formats, a missing file, an empty dataset and more shards than rows fail before
    anything is written (and are not retried).

    :param source_uri: The dataset (templated): a local path, ``file://`` or ``s3://`` URI of one
        Parquet, CSV or NumPy ``.npz`` file. ``s3://<conn_id>@bucket/key`` reads it through that
        Airflow AWS connection (as ``ObjectStoragePath`` does); the manifest records the plain URI.
    :param output_uri: Where to write (templated). Default:
        ``<[torchrun] state_dir>/shards/<dag_id>/<run_id>/<task_id>``.
    :param num_shards: Number of training shards (templated). Default: ``num_nodes * nproc_per_node``,
        one shard per rank of the training task it feeds.
    :param num_nodes: The training task's node count (templated), used when ``num_shards`` is not given.
    :param nproc_per_node: The training task's processes per node (templated), likewise.
    :param eval_fraction: Share of rows held out for evaluation, in ``[0, 1)``. Default 0.1.
    :param seed: Seed of the row permutation.
    :param format: ``"parquet"``, ``"csv"`` or ``"npz"`` (templated); by default from the extension.
    :param storage_options: fsspec options for both URIs (templated), e.g. an S3 ``endpoint_url``;
        they win over the connection's.
    """

    template_fields: Sequence[str] = (
        "source_uri",
        "output_uri",
        "num_shards",
        "num_nodes",
        "nproc_per_node",
        "format",
        "storage_options",
    )
    template_fields_renderers = {"storage_options": "json"}
    ui_color = "#f5e6c8"

    def __init__(
        self,
        *,
        source_uri: str,
        output_uri: str | None = None,
        num_shards: int | str | None = None,
        num_nodes: int | str | None = None,
        nproc_per_node: int | str | None = None,
        eval_fraction: float = 0.1,
        seed: int = 0,
        format: str | None = None,
        storage_options: Mapping[str, Any] | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        self.source_uri = source_uri
        self.output_uri = output_uri
        self.num_shards = num_shards
        self.num_nodes = num_nodes
        self.nproc_per_node = nproc_per_node
        self.eval_fraction = eval_fraction
        self.seed = seed
        self.format = format
        self.storage_options = dict(storage_options) if isinstance(storage_options, Mapping) else storage_options
        # Parse time: check what is not a template now, so a bad DAG fails to import.
        problems = self._problems(allow_templates=True)
        if problems:
            raise DatasetError(self._message(problems))

    @property
    def _where(self) -> str:
        dag_id = self.dag_id if self.has_dag() else "<no dag>"
        return f"task {dag_id}.{self.task_id}"

    def _message(self, problems: list[str]) -> str:
        return f"Invalid sharding request for {self._where}:\n" + "\n".join(f"  - {p}" for p in problems)

    def _problems(self, *, allow_templates: bool) -> list[str]:
        problems: list[str] = []
        # An upstream task's output or a template is checked once rendered.
        if not (allow_templates and is_templated(self.source_uri)):
            if not isinstance(self.source_uri, str) or not self.source_uri.strip():
                problems.append(f"source_uri must be a non-empty URI string, got {self.source_uri!r}")
            elif not (allow_templates and is_templated(self.format)):
                try:
                    detect_format(split_conn_id(self.source_uri)[1], self.format)
                except (DatasetError, StorageError) as exc:
                    problems.append(str(exc))
        uris = [u for u in (self.source_uri, self.output_uri) if isinstance(u, str)]
        if not any(allow_templates and is_templated(u) for u in uris):
            try:
                conns = {c for c in (split_conn_id(u)[0] for u in uris) if c}
            except StorageError as exc:
                problems.append(str(exc))
            else:
                if len(conns) > 1:
                    problems.append(
                        f"source_uri and output_uri name different connections ({', '.join(sorted(conns))}); "
                        "one task reads and writes through one: name it in one of them"
                    )
        shards = self._resolve_num_shards(problems, allow_templates=allow_templates)
        problems.extend(check_request(1 if shards is None else shards, self.eval_fraction, self.seed))
        return problems

    def _resolve_num_shards(self, problems: list[str], *, allow_templates: bool) -> int | None:
        """The shard count, or None while a template is still unrendered."""

        def whole(name: str, value: object) -> int | None:
            if value is None:
                return None
            if allow_templates and is_templated(value):
                return None
            # A rendered template is a string ("4") unless the DAG renders native objects.
            if isinstance(value, str) and value.strip().isdigit():
                return int(value.strip())
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                problems.append(f"{name} must be a whole number >= 1, got {value!r}")
                return None
            return value

        templated = any(
            allow_templates and is_templated(v) for v in (self.num_shards, self.num_nodes, self.nproc_per_node)
        )
        shards = whole("num_shards", self.num_shards)
        nodes = whole("num_nodes", self.num_nodes)
        procs = whole("nproc_per_node", self.nproc_per_node)
        if shards is not None:
            return shards
        if nodes is not None or procs is not None:
            return (nodes or 1) * (procs or 1)
        if self.num_shards is None and self.num_nodes is None and self.nproc_per_node is None:
            problems.append(
                "give num_shards, or num_nodes and nproc_per_node of the training task it feeds (one shard per rank)"
            )
        elif not templated and not problems:
            problems.append("could not work out the number of shards")
        return None

    def execute(self, context: Context) -> str:
        problems = self._problems(allow_templates=False)
        shards = self._resolve_num_shards([], allow_templates=False)
        if problems or shards is None:
            raise AirflowFailException(self._message(problems or ["could not work out the number of shards"]))
        ti = context["ti"]
        source_conn, source_uri = split_conn_id(self.source_uri)
        output_conn, output_uri = split_conn_id(self.output_uri or self._default_output_uri(ti))
        options = self._storage_options(source_conn or output_conn)
        try:
            result = shard_dataset(
                source_uri,
                output_uri,
                shards,
                eval_fraction=float(self.eval_fraction),
                seed=self.seed,
                format=self.format,
                storage_options=options,
            )
        except DatasetError as exc:
            # Bad data or a bad request: running the task again cannot change the answer.
            raise AirflowFailException(f"{self._where}: {exc}") from exc
        self._manifest_uri = result.manifest_uri
        m = result.manifest
        self.log.info(
            "%s %d shards of %s rows and an evaluation split of %d rows: %s",
            "Reused" if result.reused else "Wrote",
            m.num_shards,
            "/".join(str(s.rows) for s in m.shards),
            m.eval.rows if m.eval else 0,
            result.manifest_uri,
        )
        ti.xcom_push(
            key="summary",
            value={
                "manifest_uri": result.manifest_uri,
                "num_shards": m.num_shards,
                "rows_per_shard": [s.rows for s in m.shards],
                "eval_rows": m.eval.rows if m.eval else 0,
                "num_rows": m.num_rows,
                "format": m.format,
                "seed": m.seed,
                "reused": result.reused,
            },
        )
        return result.manifest_uri

    # -- OpenLineage (the openlineage extra; imported only when the provider asks) -------------------
    def get_openlineage_facets_on_start(self) -> Any:
        from airflow_torchrun.lineage_openlineage import shard_lineage

        return shard_lineage(self.source_uri, None)

    def get_openlineage_facets_on_complete(self, task_instance: Any) -> Any:
        # What execute() wrote, from memory: the provider calls this in a forked process, where an
        # XCom read through the task's supervisor channel hung until the listener killed it.
        from airflow_torchrun.lineage_openlineage import shard_lineage

        return shard_lineage(self.source_uri, getattr(self, "_manifest_uri", None))

    def get_openlineage_facets_on_failure(self, task_instance: Any) -> Any:
        return self.get_openlineage_facets_on_start()

    def _storage_options(self, conn_id: str | None) -> dict[str, Any] | None:
        """The connection's S3 options (keys, endpoint, region) under the task's own ``storage_options``."""
        given = dict(self.storage_options) if isinstance(self.storage_options, Mapping) else {}
        if conn_id is None:
            return given or None
        from airflow_torchrun.storage.aws import storage_options_from_aws_conn_id

        try:
            options = storage_options_from_aws_conn_id(conn_id)
        except Exception as exc:  # a missing or malformed connection: fixing it is the DAG's job
            raise AirflowFailException(f"{self._where}: cannot use the AWS connection {conn_id!r}: {exc}") from exc
        return {**options, **given}

    def _default_output_uri(self, ti: Any) -> str:
        map_index = getattr(ti, "map_index", None)
        return shard_root(
            default_output_root(), ti.dag_id, ti.run_id, ti.task_id, map_index if map_index is not None else -1
        )
