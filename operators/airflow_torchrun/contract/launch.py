"""What the wiring, the ranks' launchers and the backends share: process markers, entry points, files.

Standard library only.
"""

from __future__ import annotations

# Which process is a worker of which group: every agent and rank inherits these, and teardown
# finds stragglers (torchrun puts each worker in a session of its own) by them.
GROUP_ID_VAR = "AIRFLOW_TORCHRUN_GROUP_ID"
NODE_RANK_VAR = "AIRFLOW_TORCHRUN_NODE_RANK"
# What every rank of a script= task runs under torchrun, and of a @task.torchrun task.
WORKER_ENTRY = "airflow_torchrun.worker.launch"
FUNCTION_ENTRY = "airflow_torchrun.worker.function"
# Written by the launcher beside torchrun's per-rank error file: the process group a rank joined.
PROCESS_GROUP_FILE = "process_group.json"
