"""``ModelApprovalOperator``: a human approves (or rejects) a registered model version before the
champion alias moves to it, through Airflow's human-in-the-loop (the standard provider's
``ApprovalOperator``: the task waits in ``awaiting_input`` and shows on the Required Actions page).

Between ``RegisterModelOperator(promote=False)`` (the version gets ``candidate`` and a proposal) and
``PromoteModelOperator`` (``champion`` moves). The request's body, in Markdown, sets the candidate's
metrics beside the champion's, with the quality gate, the proposal's reason and the training run's
link. Approve: the promotion runs. Reject: nothing moves, the promotion is skipped, and the task log
says who decided, when, and why (the optional comment). ``require_approval=False`` promotes without
asking (unattended runs: ``make demo``, tests).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from airflow.providers.standard.operators.hitl import ApprovalOperator
from airflow.sdk import Param

from airflow_torchrun.compat import AirflowFailException, AirflowSkipException
from airflow_torchrun.errors import InvalidSpecError
from airflow_torchrun.operators.register import _mapping
from airflow_torchrun.spec import is_templated

if TYPE_CHECKING:
    from airflow_torchrun.compat import Context

#: XCom key of the decision: ``{"approved", "by", "at", "comment", "version", "asked"}``.
DECISION_KEY = "decision"
COMMENT_PARAM = "comment"


def parse_flag(value: object, what: str) -> bool:
    """A bool from a bool or its rendered template (``"True"``/``"false"``); anything else is refused
    (``bool("false")`` is True: a safety flag is never read that way)."""
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.strip().lower() in ("true", "false"):
        return value.strip().lower() == "true"
    raise InvalidSpecError([f"{what} must be true or false, got {value!r}"])


def _number(value: object) -> str:
    if not isinstance(value, int | float) or isinstance(value, bool):
        return "-"
    return f"{value:.4g}"


def approval_body(registration: Mapping[str, Any], run_url: str | None) -> str:
    """The request's Markdown: candidate and champion side by side, the gate, the proposal, the run."""
    name, version = registration.get("name"), registration.get("version")
    proposal = registration.get("proposal") or {}
    champion = proposal.get("champion_version")
    alias = registration.get("champion_alias") or "champion"
    mine: Mapping[str, Any] = registration.get("metrics") or {}
    theirs: Mapping[str, Any] = proposal.get("champion_metrics") or {}
    gate: Sequence[str] = registration.get("gate") or []
    gated = {rule.split(" ", 1)[0] for rule in gate}
    champion_head = f"champion: version {champion}" if champion is not None else "champion: none yet"
    lines = [
        f"### Promote `{name}` version {version} to `{alias}`?",
        "",
        f"| metric | candidate: version {version} | {champion_head} |",
        "| --- | ---: | ---: |",
    ]
    for metric in [*sorted(m for m in mine if m in gated), *sorted(m for m in mine if m not in gated)]:
        label = f"**{metric}** (gate)" if metric in gated else metric
        lines.append(f"| {label} | {_number(mine.get(metric))} | {_number(theirs.get(metric))} |")
    lines += [
        "",
        f"**Proposal:** {'promote' if proposal.get('promote') else 'keep the champion'}: {proposal.get('why', '')}",
        "",
        f"**Quality gate:** {'; '.join(gate) if gate else 'none'} (passed, or the version would not be registered)",
        "",
        f"**Training run:** [{registration.get('run_id')}]({run_url})"
        if run_url
        else f"**Training run:** `{registration.get('run_id')}`",
        "",
        f"*Approve* moves `{alias}` to version {version}. *Reject* leaves "
        f"{f'it on version {champion}' if champion is not None else 'the model without a champion'}; "
        "the version keeps its `candidate` alias either way.",
    ]
    return "\n".join(lines)


def _who(user: object) -> str:
    if isinstance(user, Mapping):
        return f"{user.get('name')} (id {user.get('id')})"
    return str(user)


class ModelApprovalOperator(ApprovalOperator):
    """Ask a human to approve a registered version's promotion to champion (Airflow's Required Actions).

    Skipped (and with it the promotion) when the registration did not propose the version, or when
    it is the champion already: there is nothing to approve. The approver may leave a comment; the
    decision, who made it and when go to the task log and to XCom ``decision``.

    :param registration: The registration task's result (templated), e.g. ``register.output`` of a
        ``RegisterModelOperator(promote=False)``.
    :param require_approval: Ask (default). False, or a template rendering ``"False"`` (e.g.
        ``"{{ params.require_approval }}"``): approve without asking, for unattended runs.
    :param tracking_uri: MLflow tracking URI, for the training run's link in the request.

    Every other argument (``subject``, ``assigned_users``, ``response_timeout``, ``notifiers``...)
    is ``ApprovalOperator``'s; the body is written by this operator.
    """

    template_fields: Sequence[str] = (*ApprovalOperator.template_fields, "registration", "require_approval")
    template_fields_renderers = {"registration": "json", "body": "md"}
    ui_color = "#fdebd0"

    def __init__(
        self,
        *,
        registration: Mapping[str, Any] | str,
        require_approval: bool | str = True,
        subject: str = "Promote the registered model to champion?",
        tracking_uri: str | None = None,
        **kwargs: Any,
    ) -> None:
        params = dict(kwargs.pop("params", None) or {})
        params.setdefault(
            COMMENT_PARAM,
            Param(None, type=["null", "string"], description="Why (optional): the task log records it"),
        )
        super().__init__(subject=subject, params=params, **kwargs)
        self.registration = registration
        self.require_approval = require_approval
        self.tracking_uri = tracking_uri
        if not is_templated(require_approval):
            parse_flag(require_approval, f"task {self.task_id}: require_approval")

    # The request's form is the comment alone. A task re-created from the serialized DAG to resume
    # carries the DAG's Params too (the trigger form's), and the base class then refused every
    # answer that had a comment ("params_input ... does not match params ...").
    @property
    def serialized_params(self) -> dict[str, dict[str, Any]]:
        return {COMMENT_PARAM: self.params.get_param(COMMENT_PARAM).serialize()} if COMMENT_PARAM in self.params else {}

    def validate_params_input(self, params_input: Mapping[str, Any]) -> None:
        unknown = set(params_input) - {COMMENT_PARAM}
        if unknown:
            raise ValueError(f"the approval takes only {COMMENT_PARAM!r}, got {sorted(unknown)}")
        comment = params_input.get(COMMENT_PARAM)
        if comment is not None and not isinstance(comment, str):
            raise ValueError(f"{COMMENT_PARAM!r} must be text, got {comment!r}")

    def execute(self, context: Context) -> Any:
        try:
            require = parse_flag(self.require_approval, "require_approval")
            reg = _mapping(self.registration, "registration") or {}
        except InvalidSpecError as exc:
            raise AirflowFailException(f"task {self.task_id}: {exc}") from exc
        if "version" not in reg or not isinstance(reg.get("proposal"), Mapping):
            raise AirflowFailException(
                f"task {self.task_id}: registration rendered to {self.registration!r}; give it the result of a "
                "RegisterModelOperator(promote=False) (e.g. register.output)"
            )
        name, version = reg.get("name"), reg["version"]
        proposal = reg["proposal"]
        alias = reg.get("champion_alias") or "champion"
        if proposal.get("champion_version") == version:
            raise AirflowSkipException(f"version {version} of {name} is the {alias} already: nothing to approve")
        if not proposal.get("promote"):
            raise AirflowSkipException(
                f"nothing to approve: version {version} of {name} stays candidate ({proposal.get('why')})"
            )
        self.subject = f"Promote {name} version {version} to {alias}?"
        self.body = approval_body(reg, self._run_url(reg.get("run_id")))
        if not require:
            self.log.info(
                "require_approval is off: version %s of %s moves to %s without asking (%s)",
                version,
                name,
                alias,
                proposal.get("why"),
            )
            self._record(context, reg, approved=True, by=None, at=None, comment=None, asked=False)
            return {"chosen_options": [self.APPROVE], "params_input": {}, "responded_by_user": None}
        self.log.info("Asking for approval to promote version %s of %s to %s (Required actions)", version, name, alias)
        return super().execute(context)

    def execute_complete(self, context: Context, event: dict[str, Any]) -> Any:
        reg = _mapping(self.registration, "registration") or {}
        chosen = (event.get("chosen_options") or [None])[0]
        who = _who(event.get("responded_by_user"))
        at = event.get("responded_at")
        comment = (event.get("params_input") or {}).get(COMMENT_PARAM)
        name, version = reg.get("name"), reg.get("version")
        champion = (reg.get("proposal") or {}).get("champion_version")
        alias = reg.get("champion_alias") or "champion"
        # Logged before the base class acts on it (a reject skips the promotion there).
        if chosen == self.APPROVE:
            self.log.info(
                "Approved by %s at %s: version %s of %s moves to %s%s",
                who,
                at,
                version,
                name,
                alias,
                f" (comment: {comment})" if comment else "",
            )
        elif chosen == self.REJECT:
            self.log.info(
                "Rejected by %s at %s: %s stays %s, version %s keeps only candidate; the promotion is skipped%s",
                who,
                at,
                alias,
                f"on version {champion}" if champion is not None else "unset",
                version,
                f" (comment: {comment})" if comment else "",
            )
        # Before the base class: on a reject it skips the promotion by raising (the Task SDK's skip).
        self._record(
            context,
            reg,
            approved=chosen == self.APPROVE,
            by=event.get("responded_by_user"),
            at=str(at) if at is not None else None,
            comment=comment,
            asked=True,
        )
        return super().execute_complete(context=context, event=event)

    def _record(
        self,
        context: Context,
        reg: Mapping[str, Any],
        *,
        approved: bool,
        by: object,
        at: str | None,
        comment: str | None,
        asked: bool,
    ) -> None:
        decision = {
            "approved": approved,
            "asked": asked,
            "by": dict(by) if isinstance(by, Mapping) else None,
            "at": at,
            "comment": comment,
            "model_name": reg.get("name"),
            "version": reg.get("version"),
        }
        context["ti"].xcom_push(key=DECISION_KEY, value=decision)

    def _run_url(self, run_id: object) -> str | None:
        if not isinstance(run_id, str) or not run_id:
            return None
        try:
            from airflow_torchrun.tracking import run_url

            return run_url(run_id, self.tracking_uri)
        except Exception as exc:  # only the link: the approver still sees the run id
            self.log.warning("Could not build the link of MLflow run %s: %s", run_id, exc)
            return None
