"""Refreshable AWS credentials for the ranks of a local group: they assume the role themselves.

``aws_conn_id`` is resolved by the Amazon provider in the Airflow worker
(:func:`airflow_torchrun.checkpoint.storage_options_from_aws_conn_id`); with ``role_arn`` that
gives the worker a temporary session, which would expire in the ranks of a run longer than the
role's session (an hour by default). Instead, when the connection carries the source keys and a
plain ``assume_role``, the ranks get an AWS config profile of their own (``role_arn`` +
``source_profile``, a file readable by its owner only, named by ``AWS_CONFIG_FILE`` and
``AWS_PROFILE``): botocore, in every rank, assumes the role and refreshes the session before it
expires, as it does for any such profile. The source keys stay out of the rank's environment.

Connections this cannot express (SAML, web identity, extra assume-role arguments such as
``Policy``, source credentials from the worker's own chain) keep the worker's snapshot, and the
operator logs when it expires. On Kubernetes no credentials reach the pods at all (the runtime's
Secrets or service account provide them; IRSA refreshes by itself).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

PROFILE = "airflow-torchrun"
SOURCE_PROFILE = "airflow-torchrun-source"
# assume_role_kwargs a profile can carry, and the profile key for each.
_PROFILE_KEYS = {
    "RoleSessionName": "role_session_name",
    "ExternalId": "external_id",
    "DurationSeconds": "duration_seconds",
}


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
