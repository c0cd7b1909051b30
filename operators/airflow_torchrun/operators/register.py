"""``RegisterModelOperator``: put a trained model in the MLflow Model Registry behind a quality gate;
``PromoteModelOperator``: move the champion alias to it, after a human approved (see
:mod:`airflow_torchrun.operators.approval`)."""

from __future__ import annotations

import ast
import json
import math
import operator
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from airflow_torchrun.compat import AirflowFailException, AirflowSkipException, BaseOperator
from airflow_torchrun.errors import InvalidSpecError
from airflow_torchrun.links import ModelVersionLink
from airflow_torchrun.settings import tracking_uri_problems
from airflow_torchrun.spec import is_templated

if TYPE_CHECKING:
    from mlflow import MlflowClient
    from mlflow.entities.model_registry import ModelVersion

    from airflow_torchrun.compat import Context

_COMPARISONS: dict[str, Callable[[float, float], bool]] = {
    ">=": operator.ge,
    ">": operator.gt,
    "<=": operator.le,
    "<": operator.lt,
}
#: Tags on each registered version: which DAG run registered it (the idempotency key)...
TAG_DAG_ID = "airflow.dag_id"
TAG_RUN_ID = "airflow.run_id"
TAG_TASK_ID = "airflow.task_id"
#: ...and that its aliases were set (a try that died in between finishes the job on retry).
TAG_DONE = "airflow.registration_complete"
#: The metrics' values, so a later run (and the approval's comparison) can compare against this version.
METRIC_TAG_PREFIX = "metric."
#: At most this many metrics are tagged on a version (a tag each): the gate's first, then the rest by name.
MAX_METRIC_TAGS = 30


@dataclass(frozen=True)
class Proposal:
    """Whether a registered version should become the champion, and why: what an approver reads."""

    promote: bool
    why: str
    champion_version: int | None  # the champion it was compared with (None: there was none)
    champion_metrics: dict[str, float]

    def to_dict(self) -> dict[str, Any]:
        return {
            "promote": self.promote,
            "why": self.why,
            "champion_version": self.champion_version,
            "champion_metrics": dict(self.champion_metrics),
        }


@dataclass(frozen=True)
class GateRule:
    """One condition of the quality gate, e.g. ``accuracy >= 0.9``."""

    metric: str
    op: str
    threshold: float

    @property
    def higher_is_better(self) -> bool:
        return self.op in (">=", ">")

    def passes(self, value: float) -> bool:
        return _COMPARISONS[self.op](value, self.threshold)

    def better(self, value: float, than: float) -> bool:
        """Strictly better in this rule's direction (a tie keeps the current champion)."""
        return value > than if self.higher_is_better else value < than

    def __str__(self) -> str:
        return f"{self.metric} {self.op} {self.threshold:g}"


def _mapping(value: object, what: str) -> Mapping[str, Any] | None:
    """A mapping from a mapping, a JSON object string or a Python dict literal (a rendered template)."""
    if value is None or value == "":
        return None
    if isinstance(value, Mapping):
        return value
    if isinstance(value, str):
        for parse in (json.loads, ast.literal_eval):
            try:
                parsed = parse(value)
            except (ValueError, SyntaxError):
                continue
            if isinstance(parsed, Mapping):
                return parsed
    raise InvalidSpecError([f"{what} must be a mapping (or its JSON), got {value!r}"])


def parse_gate(gate: object) -> list[GateRule]:
    """Parse ``{"accuracy": ">= 0.9", "loss": "< 0.5"}`` into rules (in the given order).

    Operators: ``>=`` and ``>`` (higher is better), ``<=`` and ``<`` (lower is better).
    """
    mapping = _mapping(gate, "gate")
    if not mapping:
        return []
    rules: list[GateRule] = []
    problems: list[str] = []
    for metric, condition in mapping.items():
        text = str(condition).strip()
        op = next((o for o in (">=", "<=", ">", "<") if text.startswith(o)), None)
        try:
            threshold = float(text[len(op) :]) if op else math.nan
        except ValueError:
            threshold = math.nan
        if op is None or math.isnan(threshold):
            problems.append(
                f"gate condition for {metric!r} must be an operator and a number, like '>= 0.9' or '< 0.5' "
                f"(operators: >=, >, <=, <), got {condition!r}"
            )
            continue
        rules.append(GateRule(str(metric), op, threshold))
    if problems:
        raise InvalidSpecError(problems, "the quality gate")
    return rules


class RegisterModelOperator(BaseOperator):
    """Register a run's model in the MLflow Model Registry when it passes a quality gate.

    The new version gets the alias ``candidate``, and ``champion`` only when it beats the current
    champion on the gate's first metric (``>=``/``>``: higher is better, ``<=``/``<``: lower is
    better; a tie keeps the champion). When the gate fails the task is skipped, with the reason in
    the log. One DAG run registers at most one version: versions are tagged with the DAG id and
    run id, and a retry or a re-run returns the version already registered. Returns
    ``{"name", "version", "aliases", "run_id", "champion", "metrics", "gate", "proposal"}`` through
    XCom; ``proposal`` says whether the version should become champion and why, with the champion it
    was compared with and that champion's metrics.

    With ``promote=False`` the version gets ``candidate`` only: the proposal is left to a
    :class:`~airflow_torchrun.operators.approval.ModelApprovalOperator` and a
    :class:`PromoteModelOperator` downstream (a human approves before the champion alias moves).

    :param model_name: Registered model name (templated).
    :param run_id: MLflow run that logged the model (templated), e.g. the training task's run id
        from XCom.
    :param gate: Quality gate (templated), e.g. ``{"accuracy": ">= 0.9"}``; a JSON string works
        too. Empty: every model passes (and only the first becomes champion).
    :param metrics: The metrics the gate reads (templated; a mapping, e.g. the evaluation task's
        XCom). Default: the run's latest metrics in MLflow.
    :param model_artifact: Name under which the model was logged in the run
        (``RunLogger.log_model(model, name=...)``). Default ``"model"``.
    :param tracking_uri: MLflow tracking and registry URI; default as for training
        (``MLFLOW_TRACKING_URI``, else the SQLite store in the state directory).
    :param candidate_alias: Alias every registered version takes.
    :param champion_alias: Alias of the best version so far.
    :param promote: Move ``champion_alias`` here when the version beats the champion (default). False:
        only propose it (``proposal`` in the result) for an approval and a promotion task to act on.
    """

    template_fields: Sequence[str] = ("model_name", "run_id", "gate", "metrics", "model_artifact")
    template_fields_renderers = {"gate": "json", "metrics": "json"}
    operator_extra_links = (ModelVersionLink(),)
    ui_color = "#d6eaf8"

    def __init__(
        self,
        *,
        model_name: str,
        run_id: str,
        gate: Mapping[str, str] | str | None = None,
        metrics: Mapping[str, float] | str | None = None,
        model_artifact: str = "model",
        tracking_uri: str | None = None,
        candidate_alias: str = "candidate",
        champion_alias: str = "champion",
        promote: bool = True,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        if not isinstance(promote, bool):  # bool("false") is True: a flag is a bool or refused
            raise InvalidSpecError([f"promote must be True or False, got {promote!r}"], f"task {self.task_id}")
        self.promote = promote
        self.model_name = model_name
        self.run_id = run_id
        self.gate = dict(gate) if isinstance(gate, Mapping) else gate
        self.metrics = metrics
        self.model_artifact = model_artifact
        self.tracking_uri = tracking_uri
        self.candidate_alias = candidate_alias
        self.champion_alias = champion_alias
        problems = []
        if not isinstance(model_name, str) or not model_name.strip():
            problems.append(f"model_name must be a non-empty string, got {model_name!r}")
        if not isinstance(run_id, str) and not hasattr(run_id, "resolve"):
            problems.append(f"run_id must be an MLflow run id string (or a template / XComArg), got {run_id!r}")
        if candidate_alias == champion_alias:
            problems.append(f"candidate_alias and champion_alias must differ, both are {candidate_alias!r}")
        problems += tracking_uri_problems(tracking_uri, "tracking_uri")
        if problems:
            raise InvalidSpecError(problems, self._where)
        if not self._has_template(self.gate):
            parse_gate(self.gate)

    @staticmethod
    def _has_template(value: object) -> bool:
        if isinstance(value, Mapping):
            return any(is_templated(v) for v in value.values())
        return is_templated(value)

    @property
    def _where(self) -> str:
        dag_id = self.dag_id if self.has_dag() else "<no dag>"
        return f"task {dag_id}.{self.task_id}"

    # -- execute --------------------------------------------------------------------------------
    def execute(self, context: Context) -> dict[str, Any]:
        try:
            rules = parse_gate(self.gate)
            given_metrics = _mapping(self.metrics, "metrics")
        except InvalidSpecError as exc:
            raise AirflowFailException(str(exc)) from exc
        if not isinstance(self.run_id, str) or not self.run_id.strip():
            raise AirflowFailException(
                f"{self._where}: run_id rendered to {self.run_id!r}; it must be the MLflow run id of the "
                "training task (e.g. from its XCom)"
            )
        from airflow_torchrun.tracking import client as tracking_client

        client = tracking_client(self.tracking_uri)
        run_id = self.run_id.strip()
        metrics = self._metrics(client, run_id, given_metrics)

        failed = self._failed_rules(rules, metrics)
        if failed:
            reason = "quality gate failed: " + "; ".join(failed)
            self.log.warning("Not registering %s from run %s: %s", self.model_name, run_id, reason)
            raise AirflowSkipException(reason)
        if rules:
            self.log.info("Quality gate passed: %s", "; ".join(f"{r} (got {metrics[r.metric]:g})" for r in rules))

        ti = context["ti"]
        version = self._existing_version(client, ti.dag_id, ti.run_id)
        if version is not None and version.tags.get(TAG_DONE) == "true":
            self.log.info(
                "DAG run %s already registered %s version %s; registering nothing new",
                ti.run_id,
                self.model_name,
                version.version,
            )
            proposal = self.proposal(client, version, rules, metrics)
            return self._publish(
                context,
                self._result(
                    client,
                    version,
                    champion=self.champion_alias in (version.aliases or []),
                    rules=rules,
                    metrics=metrics,
                    proposal=proposal,
                ),
            )
        if version is None:
            version = self._create_version(client, run_id, ti, rules, metrics)
        client.set_registered_model_alias(self.model_name, self.candidate_alias, str(version.version))
        proposal = self.proposal(client, version, rules, metrics)
        champion = (
            self._take(client, version, proposal) if self.promote else proposal.champion_version == int(version.version)
        )
        if not self.promote:
            self.log.info(
                "Version %s of %s is %s; %s %s: %s (promotion left to the approval)",
                version.version,
                self.model_name,
                self.candidate_alias,
                "proposed as" if proposal.promote else "not proposed as",
                self.champion_alias,
                proposal.why,
            )
        client.set_model_version_tag(self.model_name, str(version.version), TAG_DONE, "true")
        return self._publish(
            context,
            self._result(client, version, champion=champion, rules=rules, metrics=metrics, proposal=proposal),
        )

    # -- OpenLineage (the openlineage extra; imported only when the provider asks) -------------------
    def get_openlineage_facets_on_start(self) -> Any:
        from airflow_torchrun.lineage_openlineage import run_model_lineage
        from airflow_torchrun.tracking import resolve_tracking_uri

        return run_model_lineage(self.run_id, resolve_tracking_uri(self.tracking_uri))

    def get_openlineage_facets_on_complete(self, task_instance: Any) -> Any:
        # execute()'s result, from memory: the provider calls this in a forked process, where an XCom
        # read through the task's supervisor channel hung until the listener killed it.
        from airflow_torchrun.lineage_openlineage import registration_lineage
        from airflow_torchrun.tracking import resolve_tracking_uri

        return registration_lineage(getattr(self, "_lineage_result", None), resolve_tracking_uri(self.tracking_uri))

    def get_openlineage_facets_on_failure(self, task_instance: Any) -> Any:
        """A failure after the version was made (the gate, an alias) still names it; before, the run only."""
        if getattr(self, "_lineage_result", None):
            return self.get_openlineage_facets_on_complete(task_instance)
        return self.get_openlineage_facets_on_start()

    def _metrics(self, client: MlflowClient, run_id: str, given: Mapping[str, Any] | None) -> dict[str, float]:
        from mlflow.exceptions import MlflowException

        if given is None:
            try:
                return dict(client.get_run(run_id).data.metrics)
            except MlflowException as exc:
                raise AirflowFailException(f"{self._where}: cannot read MLflow run {run_id!r}: {exc}") from exc
        metrics: dict[str, float] = {}
        for key, value in given.items():
            try:
                metrics[str(key)] = float(value)
            except (TypeError, ValueError):
                continue  # not a number (e.g. a path in the evaluation's XCom): not gateable
        return metrics

    def _failed_rules(self, rules: list[GateRule], metrics: Mapping[str, float]) -> list[str]:
        missing = [r.metric for r in rules if r.metric not in metrics]
        if missing:
            # A misnamed metric is a DAG bug, not a bad model: fail loudly instead of skipping.
            raise AirflowFailException(
                f"{self._where}: the quality gate reads {', '.join(map(repr, missing))} but the metrics have "
                f"only {', '.join(sorted(metrics)) or 'nothing'}; fix the gate or the metrics given"
            )
        return [
            f"{r.metric} = {metrics[r.metric]:g}, needs {r.op} {r.threshold:g}"
            for r in rules
            if not r.passes(metrics[r.metric])
        ]

    def _existing_version(self, client: MlflowClient, dag_id: str, dag_run_id: str) -> ModelVersion | None:
        from mlflow.exceptions import MlflowException

        from airflow_torchrun.tracking import quote_filter_value

        filter_string = (
            f"name = {quote_filter_value(self.model_name)} and tags.`{TAG_DAG_ID}` = {quote_filter_value(dag_id)} "
            f"and tags.`{TAG_RUN_ID}` = {quote_filter_value(dag_run_id)}"
        )
        try:
            found = client.search_model_versions(filter_string)
        except MlflowException:
            return None  # the registered model does not exist yet
        if not found:
            return None
        # Search results carry no aliases: read the version itself.
        first = min(found, key=lambda v: int(v.version))
        return client.get_model_version(self.model_name, str(first.version))

    def _create_version(
        self, client: MlflowClient, run_id: str, ti: Any, rules: list[GateRule], metrics: Mapping[str, float]
    ) -> ModelVersion:
        from mlflow.exceptions import MlflowException

        run = client.get_run(run_id)
        from airflow_torchrun.tracking import quote_filter_value

        name, source = quote_filter_value(self.model_artifact), quote_filter_value(run_id)
        found = client.search_logged_models(
            [run.info.experiment_id], filter_string=f"name = {name} AND source_run_id = {source}"
        )
        # Only finished uploads: a try that died while logging leaves a model that is not READY.
        models = [
            m for m in found if m.source_run_id == run_id and str(getattr(m.status, "value", m.status)) == "READY"
        ]
        if not models:
            raise AirflowFailException(
                f"{self._where}: MLflow run {run_id} has no logged model named {self.model_artifact!r}. Log it "
                "from rank 0 with RunLogger.log_model(model) (airflow_torchrun.worker.tracking), or pass "
                "model_artifact= the name it was logged under"
            )
        # A try that logged the model twice (it failed after logging): the newest is the final one.
        model = max(models, key=lambda m: m.creation_timestamp)
        try:
            client.create_registered_model(self.model_name)
        except MlflowException as exc:
            if "already exists" not in str(exc).lower() and getattr(exc, "error_code", "") not in (
                "RESOURCE_ALREADY_EXISTS",
                "ALREADY_EXISTS",
            ):
                raise
        tags = {
            TAG_DAG_ID: str(ti.dag_id),
            TAG_RUN_ID: str(ti.run_id),
            TAG_TASK_ID: str(ti.task_id),
            **{f"{METRIC_TAG_PREFIX}{name}": repr(metrics[name]) for name in _tagged(rules, metrics)},
        }
        version = client.create_model_version(
            self.model_name, source=f"models:/{model.model_id}", run_id=run_id, tags=tags, model_id=model.model_id
        )
        self.log.info("Registered %s version %s from run %s", self.model_name, version.version, run_id)
        return version

    def _champion_value(self, client: MlflowClient, champion: ModelVersion, rule: GateRule) -> float | None:
        tagged = (champion.tags or {}).get(f"{METRIC_TAG_PREFIX}{rule.metric}")
        if tagged is not None:
            try:
                return float(tagged)
            except ValueError:
                pass
        if champion.run_id:
            value = client.get_run(champion.run_id).data.metrics.get(rule.metric)
            return None if value is None else float(value)
        return None

    def _champion_metrics(self, client: MlflowClient, champion: ModelVersion) -> dict[str, float]:
        """The champion's metrics: its tags (written at its registration), else its run's metrics."""
        out: dict[str, float] = {}
        for key, value in (champion.tags or {}).items():
            if key.startswith(METRIC_TAG_PREFIX):
                try:
                    out[key[len(METRIC_TAG_PREFIX) :]] = float(value)
                except ValueError:
                    continue
        if out or not champion.run_id:
            return out
        from mlflow.exceptions import MlflowException

        try:
            return {str(k): float(v) for k, v in client.get_run(champion.run_id).data.metrics.items()}
        except MlflowException:
            return {}

    def proposal(
        self, client: MlflowClient, version: ModelVersion, rules: list[GateRule], metrics: Mapping[str, float]
    ) -> Proposal:
        """Whether ``version`` should take the champion alias: it beats the champion on the gate's first
        metric in that rule's direction (a tie keeps the champion), or there is no champion yet."""
        from mlflow.exceptions import MlflowException

        number = int(version.version)
        try:
            champion = client.get_model_version_by_alias(self.model_name, self.champion_alias)
        except MlflowException:
            champion = None
        if champion is None:
            return Proposal(True, "there is no champion yet", None, {})
        theirs = self._champion_metrics(client, champion)
        current = int(champion.version)
        if current == number:
            return Proposal(True, f"version {number} is the champion already", current, theirs)
        if not rules:
            return Proposal(False, f"no gate metric to compare with version {current}", current, theirs)
        rule = rules[0]
        value = self._champion_value(client, champion, rule)
        if value is None:
            return Proposal(True, f"champion version {current} has no {rule.metric} to compare", current, theirs)
        mine = metrics[rule.metric]
        direction = "higher" if rule.higher_is_better else "lower"
        why = f"{rule.metric} {mine:g} vs champion version {current}'s {value:g} ({direction} is better)"
        return Proposal(rule.better(mine, value), why, current, theirs)

    def _take(self, client: MlflowClient, version: ModelVersion, proposal: Proposal) -> bool:
        """Move the champion alias when the proposal says so (promote=True: no approval asked)."""
        name, number = self.model_name, str(version.version)
        if proposal.champion_version == int(number):
            return True
        if proposal.promote:
            client.set_registered_model_alias(name, self.champion_alias, number)
            self.log.info("Version %s of %s is the new %s: %s", number, name, self.champion_alias, proposal.why)
        else:
            self.log.info("Version %s of %s stays %s only: %s", number, name, self.candidate_alias, proposal.why)
        return proposal.promote

    def _publish(self, context: Context, result: dict[str, Any]) -> dict[str, Any]:
        """The version's link (XCom ``model_version_url``, the 'Registered model version' link and the
        training view read it) and the asset event's metadata: model name, version and aliases."""
        from airflow_torchrun.assets import annotate_outlets
        from airflow_torchrun.links import MODEL_VERSION_URL_KEY, mlflow_ui_base, model_version_url
        from airflow_torchrun.tracking import resolve_tracking_uri

        try:
            url = model_version_url(
                mlflow_ui_base(resolve_tracking_uri(self.tracking_uri)), result["name"], result["version"]
            )
            context["ti"].xcom_push(key=MODEL_VERSION_URL_KEY, value=url)
        except Exception as exc:  # only the link: never worth failing the registration for
            self.log.warning("Could not build the link of %s version %s: %s", result["name"], result["version"], exc)
        self._lineage_result = result
        annotate_outlets(
            context,
            self.outlets or (),
            {
                "model_name": result["name"],
                "version": result["version"],
                "aliases": result["aliases"],
                "run_id": result["run_id"],
            },
            self.log,
        )
        return result

    def _result(
        self,
        client: MlflowClient,
        version: ModelVersion,
        *,
        champion: bool,
        rules: list[GateRule],
        metrics: Mapping[str, float],
        proposal: Proposal,
    ) -> dict[str, Any]:
        fresh = client.get_model_version(self.model_name, str(version.version))
        return {
            "name": self.model_name,
            "version": int(fresh.version),
            "aliases": sorted(fresh.aliases or []),
            "run_id": fresh.run_id,
            "champion": champion,
            "metrics": {name: metrics[name] for name in _tagged(rules, metrics)},
            "gate": [str(r) for r in rules],
            "proposal": proposal.to_dict(),
            "champion_alias": self.champion_alias,
            "candidate_alias": self.candidate_alias,
        }


def _tagged(rules: Sequence[GateRule], metrics: Mapping[str, float]) -> list[str]:
    """The metrics worth keeping on a version: the gate's first, then the others by name (bounded)."""
    first = [r.metric for r in rules if r.metric in metrics]
    rest = sorted(k for k in metrics if k not in first)
    return (first + rest)[:MAX_METRIC_TAGS]


class PromoteModelOperator(BaseOperator):
    """Move the champion alias to the version a :class:`RegisterModelOperator` (``promote=False``)
    proposed, once it was approved (put it downstream of the approval: a rejection skips it).

    It moves nothing when the version was not proposed, and refuses (skips, saying why) when the
    champion changed since the proposal was made: the approver compared against that champion, not
    the new one. Running it again is harmless. Returns the registration's result with the new aliases.

    :param registration: The registration task's result (templated), e.g. ``register.output``.
    :param tracking_uri: MLflow tracking and registry URI; default as for registration.
    """

    template_fields: Sequence[str] = ("registration",)
    template_fields_renderers = {"registration": "json"}
    ui_color = "#d5f5e3"

    def __init__(self, *, registration: Mapping[str, Any] | str, tracking_uri: str | None = None, **kwargs: Any):
        super().__init__(**kwargs)
        self.registration = registration
        self.tracking_uri = tracking_uri

    # -- OpenLineage (the openlineage extra; imported only when the provider asks) -------------------
    def get_openlineage_facets_on_complete(self, task_instance: Any) -> Any:
        # execute()'s result, from memory: the provider calls this in a forked process, where an XCom
        # read through the task's supervisor channel hung until the listener killed it.
        from airflow_torchrun.lineage_openlineage import registration_lineage
        from airflow_torchrun.tracking import resolve_tracking_uri

        return registration_lineage(getattr(self, "_lineage_result", None), resolve_tracking_uri(self.tracking_uri))

    def execute(self, context: Context) -> dict[str, Any]:
        from mlflow.exceptions import MlflowException

        from airflow_torchrun.tracking import client as tracking_client

        try:
            reg = _mapping(self.registration, "registration")
        except InvalidSpecError as exc:
            raise AirflowFailException(str(exc)) from exc
        if not reg or "version" not in reg or "name" not in reg:
            raise AirflowFailException(
                f"task {self.task_id}: registration rendered to {self.registration!r}; give it the "
                "RegisterModelOperator's result (e.g. register.output)"
            )
        name, number = str(reg["name"]), str(reg["version"])
        alias = str(reg.get("champion_alias") or "champion")
        found = reg.get("proposal")
        proposal: Mapping[str, Any] = found if isinstance(found, Mapping) else {}
        if not proposal.get("promote"):
            raise AirflowSkipException(f"version {number} of {name} was not proposed as {alias}: {proposal.get('why')}")
        client = tracking_client(self.tracking_uri)
        try:
            current = client.get_model_version_by_alias(name, alias)
        except MlflowException:
            current = None
        now = None if current is None else int(current.version)
        if now == int(number):
            self.log.info("Version %s of %s is the %s already", number, name, alias)
        elif now != proposal.get("champion_version"):
            raise AirflowSkipException(
                f"not moving {alias} to version {number} of {name}: the champion is version {now} now, not "
                f"{proposal.get('champion_version')} as when the approval was asked; register again to compare"
            )
        else:
            client.set_registered_model_alias(name, alias, number)
            self.log.info(
                "Version %s of %s is the new %s (was %s): %s", number, name, alias, now or "none", proposal.get("why")
            )
        fresh = client.get_model_version(name, number)
        result: dict[str, Any] = {**reg, "aliases": sorted(fresh.aliases or []), "champion": True}
        from airflow_torchrun.assets import annotate_outlets

        extra = {"model_name": name, "version": int(number), "aliases": result["aliases"], "run_id": fresh.run_id}
        annotate_outlets(context, self.outlets or (), extra, self.log)
        self._lineage_result = result
        return result
