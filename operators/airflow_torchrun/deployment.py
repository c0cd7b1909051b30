"""This Airflow deployment's identity: in its checkpoint lineages and its Kubernetes Jobs' names.

Two deployments (staging and production, two ``AIRFLOW_HOME``s on one machine) run the same DAGs
with the same run ids (every ``scheduled__...`` is the same everywhere). What keeps their
checkpoint roots and their Jobs apart is this name: ``[torchrun] deployment`` when set, else one
the deployment makes on its first use and keeps in the Variable :data:`DEPLOYMENT_VARIABLE` of its
own metadata database. Airflow is imported only inside the functions.
"""

from __future__ import annotations

import logging
import secrets

from airflow_torchrun.errors import InvalidSpecError
from airflow_torchrun.naming import DEFAULT_DEPLOYMENT, LABEL_VALUE_RULE, is_label_value

log = logging.getLogger(__name__)


def torchrun_config(key: str) -> str | None:
    """``[torchrun] key``, or None when it is unset or empty (or Airflow is not importable)."""
    try:
        from airflow.sdk import conf
    except ImportError:
        return None
    value = conf.get("torchrun", key, fallback=None)
    return value or None


# The Variable in which a deployment keeps the identity it made itself, when ``[torchrun]
# deployment`` is unset: every worker of one deployment reads the same metadata database, and no
# other deployment does, so the name is shared where it must be and differs where it must.
DEPLOYMENT_VARIABLE = "torchrun_deployment"
_DEPLOYMENT_DESCRIPTION = (
    "airflow-torchrun: this Airflow deployment's identity in its checkpoint lineages and in the names and "
    "labels of its training Jobs, made on first use. Keep it while Jobs or checkpoints of this deployment may "
    "still be used; never copy it to another deployment (set [torchrun] deployment instead to choose the name)."
)


def deployment_name(*, create: bool = True) -> str:
    """This deployment's identity in its Jobs: ``[torchrun] deployment``, else its own Variable.

    With neither, inside a task (``create``) a random name is kept in :data:`DEPLOYMENT_VARIABLE`
    and read back (two tasks that both find it missing use the one stored last, unless one reads
    back before the other writes: a race of milliseconds, once per deployment). Where no
    Variable can be read or written (``render`` without a database, tests outside Airflow), the
    name is :data:`DEFAULT_DEPLOYMENT`, as before deployments had identities, with a warning when
    a task meant to create one.
    """
    configured = torchrun_config("deployment")
    if configured:
        return configured
    try:
        from airflow.sdk import Variable

        stored = Variable.get(DEPLOYMENT_VARIABLE, default=None)
        if stored is None and create:
            Variable.set(DEPLOYMENT_VARIABLE, f"af-{secrets.token_hex(5)}", description=_DEPLOYMENT_DESCRIPTION)
            stored = Variable.get(DEPLOYMENT_VARIABLE, default=None)
    except Exception as exc:  # no metadata database or API server here: the old shared default
        if create:
            log.warning(
                "The Variable %s (this deployment's identity in its Jobs) cannot be read or written here (%s); "
                "Jobs are named for deployment %r, which another Airflow deployment sharing the namespace may use "
                "too. Set [torchrun] deployment to a name of this deployment's own.",
                DEPLOYMENT_VARIABLE,
                exc,
                DEFAULT_DEPLOYMENT,
            )
        return DEFAULT_DEPLOYMENT
    return _checked(stored)


def _checked(stored: object) -> str:
    """The name the Variable holds, refused (nothing launched) when it cannot be one."""
    if not stored:
        return DEFAULT_DEPLOYMENT
    name = str(stored)
    if is_label_value(name):
        return name
    why = (
        "it looks encrypted with a fernet key this process does not have: give every Airflow process of this "
        "deployment the same [core] fernet_key"
        if name.startswith("gAAAA")
        else f"it must be {LABEL_VALUE_RULE}"
    )
    raise InvalidSpecError(
        [
            f"the Variable {DEPLOYMENT_VARIABLE} (this deployment's identity) holds {name[:80]!r}, which is not a "
            f"name: {why}; or set [torchrun] deployment (AIRFLOW__TORCHRUN__DEPLOYMENT) to this deployment's name"
        ],
        "this Airflow deployment",
    )


def stored_deployment_name() -> str:
    """This deployment's identity read where no task runs (the API server): ``[torchrun]
    deployment``, else the Variable its first Kubernetes task made, from the metadata database (the
    SDK's ``Variable.get`` answers only inside a task); :data:`DEFAULT_DEPLOYMENT` without either."""
    configured = torchrun_config("deployment")
    if configured:
        return configured
    try:
        from airflow.models.variable import Variable

        stored = Variable.get(DEPLOYMENT_VARIABLE, default_var=None)
    except Exception as exc:  # no metadata database here
        log.debug("Variable %s not readable here (%s)", DEPLOYMENT_VARIABLE, exc)
        stored = None
    return _checked(stored)
