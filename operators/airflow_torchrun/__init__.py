"""airflow-torchrun: run a distributed PyTorch training group as one Airflow task.

The operators are imported lazily so that ``airflow_torchrun.worker`` (used inside ranks) never
imports Airflow, and importing the operators never imports torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

_LAZY = {
    "DistributedTrainingOperator": "airflow_torchrun.operators.training",
    "EvaluateModelOperator": "airflow_torchrun.operators.evaluate",
    "ShardDatasetOperator": "airflow_torchrun.operators.shard",
    "RegisterModelOperator": "airflow_torchrun.operators.register",
    "PromoteModelOperator": "airflow_torchrun.operators.register",
    "ModelApprovalOperator": "airflow_torchrun.operators.approval",
}

if TYPE_CHECKING:
    from airflow_torchrun.operators.approval import ModelApprovalOperator
    from airflow_torchrun.operators.evaluate import EvaluateModelOperator
    from airflow_torchrun.operators.register import PromoteModelOperator, RegisterModelOperator
    from airflow_torchrun.operators.shard import ShardDatasetOperator
    from airflow_torchrun.operators.training import DistributedTrainingOperator

__all__ = [
    "DistributedTrainingOperator",
    "EvaluateModelOperator",
    "ModelApprovalOperator",
    "PromoteModelOperator",
    "RegisterModelOperator",
    "ShardDatasetOperator",
    "__version__",
]


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'airflow_torchrun' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(module), name)
