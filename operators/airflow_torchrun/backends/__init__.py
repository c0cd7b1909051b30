"""Where the agents of a group run: one folder per backend, and the one registry of them.

``base`` declares what every backend answers (:class:`~airflow_torchrun.backends.base.Backend`),
``handles`` the typed handles; ``local/`` is the embedded default, ``kubernetes/`` runs a group as
an Indexed Job. The registry below names them; a backend's module is imported only when the
backend is used (it imports nothing heavy: the Kubernetes client and the provider's hooks load on
its first request).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from airflow_torchrun.backends.base import Backend

DEFAULT_BACKEND = "local"
# name -> (module, class)
_REGISTRY = {
    "local": ("airflow_torchrun.backends.local.backend", "LocalBackend"),
    "kubernetes": ("airflow_torchrun.backends.kubernetes.backend", "KubernetesBackend"),
}


def backend_names() -> tuple[str, ...]:
    return tuple(_REGISTRY)


def backend_class(name: str) -> type[Backend[Any]]:
    """A backend's class by name."""
    try:
        module, attr = _REGISTRY[name]
    except KeyError:
        raise ValueError(f"unknown backend {name!r}; known: {', '.join(_REGISTRY)}") from None
    cls: type[Backend[Any]] = getattr(importlib.import_module(module), attr)
    return cls
