"""AWS access for storage: an Airflow connection or the environment -> s3fs options and the ranks' env.

On the Airflow side an operator's ``aws_conn_id`` is resolved by the Amazon provider
(:func:`storage_options_from_aws_conn_id`); otherwise S3 settings come from the standard AWS
variables (``AWS_ACCESS_KEY_ID``, ``AWS_SECRET_ACCESS_KEY``, ``AWS_SESSION_TOKEN``,
``AWS_DEFAULT_REGION``, ``AWS_ENDPOINT_URL``; any other credential source botocore knows works
too), overridden by an explicit ``storage_options`` dict (s3fs's arguments). The ranks get the same
access through their environment (:func:`storage_env`).

**Refreshable credentials for local ranks.** With ``role_arn`` the provider gives the worker a
temporary session, which would expire in the ranks of a run longer than the role's session (an hour
by default). Instead, when the connection carries the source keys and a plain ``assume_role``, the
ranks of a local group get an AWS config profile of their own (:class:`RankRole`: ``role_arn`` +
``source_profile``, a file readable by its owner only, named by ``AWS_CONFIG_FILE`` and
``AWS_PROFILE``): botocore, in every rank, assumes the role and refreshes the session before it
expires, as it does for any such profile. The source keys stay out of the rank's environment.
Connections this cannot express (SAML, web identity, extra assume-role arguments such as
``Policy``, source credentials from the worker's own chain) keep the worker's snapshot, and the
operator logs when it expires. On Kubernetes no credentials reach the pods at all (the runtime's
Secrets or service account provide them; IRSA refreshes by itself).

Airflow and the provider are imported only inside the functions that need them.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from airflow_torchrun import contract
from airflow_torchrun.errors import StorageError, is_transient

# The part of storage_options that is not an AWS_* variable reaches the ranks as JSON here.
STORAGE_OPTIONS_ENV = contract.CHECKPOINT_STORAGE_OPTIONS
# The s3fs options that are credentials: never in a pod spec (anyone who may read Jobs would see them).
SECRET_OPTIONS = frozenset({"key", "secret", "token"})


def s3_options_from_env(env: Mapping[str, str] | None = None) -> dict[str, Any]:
    """s3fs options that botocore would not pick up from the environment on every version.

    Credentials and region are left to botocore's own chain (env, profile, web identity, instance
    role); the endpoint is passed explicitly so that ``AWS_ENDPOINT_URL`` works with older botocore.
    """
    env = os.environ if env is None else env
    endpoint = env.get("AWS_ENDPOINT_URL_S3") or env.get("AWS_ENDPOINT_URL")
    return {"endpoint_url": endpoint} if endpoint else {}


def storage_options_from_aws_connection(
    login: str | None, password: str | None, extra: Mapping[str, Any] | None = None
) -> dict[str, Any]:
    """s3fs options from the fields of an Airflow AWS connection (no Airflow import here).

    ``login``/``password`` are the access key id and secret; ``extra`` may hold
    ``aws_session_token``, ``region_name``, ``endpoint_url`` (or ``service_config.s3.endpoint_url``,
    which wins, as in the Amazon provider). Empty fields are left to botocore's own chain.
    """
    extra = extra or {}
    options: dict[str, Any] = {}
    key = login or extra.get("aws_access_key_id")
    secret = password or extra.get("aws_secret_access_key")
    if key:
        options["key"] = key
    if secret:
        options["secret"] = secret
    if extra.get("aws_session_token"):
        options["token"] = extra["aws_session_token"]
    s3_config = (extra.get("service_config") or {}).get("s3") or {}
    endpoint = s3_config.get("endpoint_url") or extra.get("endpoint_url")
    if endpoint:
        options["endpoint_url"] = endpoint
    if extra.get("region_name"):
        options["client_kwargs"] = {"region_name": extra["region_name"]}
    return options


def storage_options_from_aws_conn_id(conn_id: str) -> dict[str, Any]:
    """s3fs options for the Airflow AWS connection ``conn_id``, resolved by the Amazon provider.

    The provider's ``AwsBaseHook`` builds the session exactly as every Amazon operator does (access
    keys, ``role_arn`` with assume-role, ``profile_name``, web identity, the worker's own chain),
    and the session's current credentials become ``key``/``secret``/``token``; region and the S3
    endpoint come from the connection (``service_config.s3.endpoint_url`` wins over
    ``endpoint_url``). These are what the operator itself uses; for the ranks of a ``role_arn``
    connection see :class:`RankRole` (they assume the role themselves, and refresh it).

    Imports Airflow and the provider when called (never at module import). Without the provider
    installed, the connection's own fields are used (:func:`storage_options_from_aws_connection`).
    Raises :class:`StorageError`: transient when STS or the endpoint did not answer properly.
    """
    try:
        from airflow.providers.amazon.aws.hooks.base_aws import AwsBaseHook
    except ImportError:  # pragma: no cover - the provider is a dependency of the airflow extra
        from airflow_torchrun.compat import BaseHook

        connection = BaseHook.get_connection(conn_id)
        return storage_options_from_aws_connection(connection.login, connection.password, connection.extra_dejson)
    from airflow_torchrun.compat import BaseHook

    try:
        # The provider quietly falls back to the worker's own chain for an unknown id: a typo
        # must not silently use other credentials.
        BaseHook.get_connection(conn_id)
    except Exception as exc:
        if type(exc).__name__ != "AirflowNotFoundException":
            raise
        message = f"aws_conn_id={conn_id!r}: no such Airflow connection; create it or fix the name"
        raise StorageError(message, transient=False) from exc
    hook = AwsBaseHook(aws_conn_id=conn_id, client_type="s3")
    try:
        credentials = hook.get_credentials()
    except AttributeError as exc:  # the session found no credentials at all
        raise StorageError(
            f"aws_conn_id={conn_id!r}: no AWS credentials found (not in the connection, nor in the worker's "
            "environment or profile); give the connection keys, a role_arn or a profile",
            transient=False,
        ) from exc
    except Exception as exc:
        raise StorageError(
            f"aws_conn_id={conn_id!r}: the Amazon provider could not get credentials from this connection "
            f"({type(exc).__name__}: {exc}); check its keys, role_arn, profile or web identity settings",
            transient=is_transient(exc),
        ) from exc
    options: dict[str, Any] = {}
    if credentials.access_key:
        options["key"] = credentials.access_key
    if credentials.secret_key:
        options["secret"] = credentials.secret_key
    if credentials.token:
        options["token"] = credentials.token
    config = hook.conn_config
    endpoint = config.get_service_endpoint_url("s3")
    if endpoint:
        options["endpoint_url"] = endpoint
    if config.region_name:
        options["client_kwargs"] = {"region_name": config.region_name}
    return options


def storage_env(storage_options: Mapping[str, Any] | None) -> dict[str, str]:
    """Environment that gives every rank the same S3 access as ``storage_options``.

    Credentials, region and endpoint become the standard ``AWS_*`` variables (botocore reads them);
    any other option travels as JSON in ``TRAIN_CHECKPOINT_STORAGE_OPTIONS``. On Kubernetes put the
    credentials in a Secret rather than in the pod spec.
    """
    options = dict(storage_options or {})
    env: dict[str, str] = {}
    for option, variable in (
        ("key", "AWS_ACCESS_KEY_ID"),
        ("secret", "AWS_SECRET_ACCESS_KEY"),
        ("token", "AWS_SESSION_TOKEN"),
        ("endpoint_url", "AWS_ENDPOINT_URL"),
    ):
        value = options.pop(option, None)
        if value:
            env[variable] = str(value)
    client_kwargs = dict(options.pop("client_kwargs", None) or {})
    region = client_kwargs.pop("region_name", None)
    if region:
        env["AWS_DEFAULT_REGION"] = str(region)
    endpoint = client_kwargs.pop("endpoint_url", None)
    if endpoint and "AWS_ENDPOINT_URL" not in env:
        env["AWS_ENDPOINT_URL"] = str(endpoint)
    if client_kwargs:
        options["client_kwargs"] = client_kwargs
    if options:
        try:
            env[STORAGE_OPTIONS_ENV] = json.dumps(options, sort_keys=True)
        except TypeError as exc:
            raise StorageError(f"storage_options must be JSON-serialisable to reach the ranks: {exc}") from exc
    return env


def merge_options(base: Mapping[str, Any], override: Mapping[str, Any]) -> dict[str, Any]:
    merged = dict(base)
    for key, value in override.items():
        if isinstance(value, Mapping) and isinstance(merged.get(key), Mapping):
            merged[key] = {**merged[key], **value}
        else:
            merged[key] = value
    return merged


def endpoint_of(options: Mapping[str, Any]) -> str:
    client_kwargs = options.get("client_kwargs") or {}
    return str(options.get("endpoint_url") or client_kwargs.get("endpoint_url") or "the default AWS S3 endpoint")


PROFILE = "airflow-torchrun"
SOURCE_PROFILE = "airflow-torchrun-source"
# assume_role_kwargs a profile can carry, and the profile key for each.
_PROFILE_KEYS = {
    "RoleSessionName": "role_session_name",
    "ExternalId": "external_id",
    "DurationSeconds": "duration_seconds",
}


# An IAM role's ARN (partition aws, aws-cn, aws-us-gov...; the path and name characters IAM allows).
_ROLE_ARN = re.compile(r"^arn:aws[a-z-]*:iam::\d{12}:role/[A-Za-z0-9+=,.@_/-]{1,512}$")
# A value that could end its line of the INI file or open a section of its own: botocore would read
# what follows as settings (a credential_process that it runs), whoever wrote the connection.
_INI_BREAKING = re.compile(r"[\r\n\[\]\x00]")


@dataclass(frozen=True)
class RankRole:
    """An assume-role for the ranks: the role, the source keys, and where STS is."""

    role_arn: str
    source_key: str
    source_secret: str
    source_token: str | None
    settings: tuple[tuple[str, str], ...]  # profile keys (role_session_name, external_id, ...)
    region: str | None
    sts_endpoint: str

    def __post_init__(self) -> None:
        """Refuse what would change the profile's meaning: every value goes into an INI file."""
        problems = []
        if not _ROLE_ARN.match(self.role_arn):
            problems.append(
                f"role_arn {self.role_arn!r} is not an IAM role ARN (arn:aws:iam::<12-digit account>:role/<name>)"
            )
        values = {
            "the access key id": self.source_key,
            "the secret access key": self.source_secret,
            "the session token": self.source_token or "",
            "region_name": self.region or "",
            "the STS endpoint": self.sts_endpoint,
            **{key: value for key, value in self.settings},
        }
        problems += [
            f"{what} holds a line break, a bracket or a NUL byte, which would add settings of its own to the ranks' "
            "AWS profile"
            for what, value in values.items()
            if _INI_BREAKING.search(value)
        ]
        if problems:
            raise StorageError(
                f"the AWS connection cannot be handed to the ranks: {'; '.join(problems)}. Fix the connection "
                "(an Airflow connection editor wrote these values)",
                transient=False,
            )

    def config_text(self) -> str:
        lines = [f"[profile {PROFILE}]", f"role_arn = {self.role_arn}", f"source_profile = {SOURCE_PROFILE}"]
        lines += [f"{key} = {value}" for key, value in self.settings]
        if self.region:
            lines.append(f"region = {self.region}")
        lines += [
            f"[profile {SOURCE_PROFILE}]",
            f"aws_access_key_id = {self.source_key}",
            f"aws_secret_access_key = {self.source_secret}",
        ]
        if self.source_token:
            lines.append(f"aws_session_token = {self.source_token}")
        return "\n".join(lines) + "\n"

    def write(self, path: Path) -> dict[str, str]:
        """Write the profile (mode 0600, in a 0700 folder) and return the ranks' environment.

        The environment blanks ``AWS_ACCESS_KEY_ID`` and friends (botocore takes keys from the
        environment before any profile, so inherited ones would win) and points STS at the
        connection's endpoint.
        """
        path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        os.chmod(path.parent, 0o700)
        # Atomically: a rank of another run of the same connection may be reading it.
        partial = path.with_name(f".{path.name}.{os.getpid()}")
        fd = os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as fh:
            fh.write(self.config_text())
        os.replace(partial, path)
        env = {
            "AWS_CONFIG_FILE": str(path),
            "AWS_PROFILE": PROFILE,
            "AWS_SHARED_CREDENTIALS_FILE": os.devnull,
            "AWS_ACCESS_KEY_ID": "",
            "AWS_SECRET_ACCESS_KEY": "",
            "AWS_SESSION_TOKEN": "",
            # Never the S3 endpoint that AWS_ENDPOINT_URL may name (a MinIO has no STS).
            "AWS_ENDPOINT_URL_STS": self.sts_endpoint,
        }
        return env


def rank_role(conn_config: Any) -> tuple[RankRole | None, str | None]:
    """The assume-role the ranks can do themselves, from the provider's connection wrapper.

    ``conn_config``: an ``AwsConnectionWrapper`` (``AwsBaseHook.conn_config``). Returns
    ``(role, None)``; ``(None, None)`` for a connection without ``role_arn``; ``(None, why)`` when
    it has one the ranks cannot assume themselves (another method than ``assume_role``, arguments a
    profile cannot carry, no source keys of its own).
    """
    role_arn = getattr(conn_config, "role_arn", None)
    if not role_arn:
        return None, None
    method = getattr(conn_config, "assume_role_method", None) or "assume_role"
    if method != "assume_role":
        return None, f"assume_role_method={method!r} (only 'assume_role' can be left to the ranks)"
    key, secret = conn_config.aws_access_key_id, conn_config.aws_secret_access_key
    if not key or not secret:
        return None, "the source credentials are not in the connection (they come from the worker's own chain)"
    kwargs = dict(getattr(conn_config, "assume_role_kwargs", None) or {})
    unsupported = sorted(set(kwargs) - set(_PROFILE_KEYS))
    if unsupported:
        return None, f"assume_role_kwargs {unsupported} have no AWS profile setting"
    conn_id = getattr(conn_config, "conn_id", None) or "connection"
    kwargs.setdefault("RoleSessionName", f"airflow-torchrun_{conn_id}")
    settings = tuple((_PROFILE_KEYS[name], str(value)) for name, value in sorted(kwargs.items()))
    # As the provider does for its own assume-role: the STS service endpoint, never the global one.
    sts = conn_config.get_service_endpoint_url("sts", sts_connection_assume=True)
    region = conn_config.region_name
    role = RankRole(
        role_arn=str(role_arn),
        source_key=str(key),
        source_secret=str(secret),
        source_token=conn_config.aws_session_token or None,
        settings=settings,
        region=str(region) if region else None,
        sts_endpoint=sts or (f"https://sts.{region}.amazonaws.com" if region else "https://sts.amazonaws.com"),
    )
    return role, None


def rank_role_for(conn_id: str) -> tuple[RankRole | None, str | None]:
    """:func:`rank_role` for an Airflow connection id (imports the Amazon provider when called)."""
    try:
        from airflow.providers.amazon.aws.hooks.base_aws import AwsBaseHook
    except ImportError:  # pragma: no cover - the provider is a dependency of the airflow extra
        return None, None
    return rank_role(AwsBaseHook(aws_conn_id=conn_id, client_type="s3").conn_config)
