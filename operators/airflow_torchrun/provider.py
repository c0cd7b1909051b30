"""Provider metadata, so ``airflow providers list`` shows airflow-torchrun and its config options."""

from __future__ import annotations

from typing import Any

from airflow_torchrun import __version__


def _option(description: str, default: str | None, example: str | None = None) -> dict[str, Any]:
    return {
        "description": description,
        "version_added": "0.1.0",
        "type": "string",
        "example": example,
        "default": default,
    }


def get_provider_info() -> dict[str, Any]:
    return {
        "package-name": "airflow-torchrun",
        "name": "airflow-torchrun",
        "description": "Distributed PyTorch training (torchrun) as one Airflow task.",
        "versions": [__version__],
        "operators": [
            {
                "integration-name": "torchrun",
                "python-modules": ["airflow_torchrun.operators.training"],
            }
        ],
        "integrations": [
            {"integration-name": "torchrun", "external-doc-url": "https://pytorch.org/docs/stable/elastic/run.html"}
        ],
        "config": {
            "torchrun": {
                "description": "Defaults for airflow-torchrun's training groups.",
                "options": {
                    "default_backend": _option(
                        "Backend used when an operator does not name one: local or kubernetes.", "local", "kubernetes"
                    ),
                    "state_dir": _option(
                        "Where the local backend keeps each group's logs and status files.",
                        None,
                        "/var/lib/airflow/torchrun",
                    ),
                },
            }
        },
    }
