"""The public rank contract: one list of names (``airflow_torchrun.contract``), refused in ``env``,
never overridden by ``env`` in the plan, every one documented in README's table."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from airflow_torchrun import contract
from airflow_torchrun.contract import CONTRACT_ENV
from airflow_torchrun.errors import InvalidSpecError
from airflow_torchrun.naming import GroupIdentity
from airflow_torchrun.spec import GroupSpec
from airflow_torchrun.wiring import plan

README = Path(__file__).resolve().parents[1] / "README.md"
NAMES = sorted(CONTRACT_ENV)


@pytest.fixture
def script(tmp_path):
    path = tmp_path / "train.py"
    path.write_text("")
    return str(path)


def _plan(spec, extra_env=None, cpus_per_node=None):
    return plan(
        spec,
        GroupIdentity("d", "t", "r"),
        master_addr="h",
        master_port=1,
        cpus_per_node=cpus_per_node,
        extra_env=extra_env,
    )


def _readme_contract_names() -> set[str]:
    text = README.read_text()
    section = text.split("## What a rank sees (public contract)", 1)[1].split("\n#", 1)[0]
    names: set[str] = set()
    for line in section.splitlines():
        if line.startswith("| `"):
            names.update(re.findall(r"`([A-Z][A-Z0-9_]*)`", line.split("|")[1]))
    return names


def test_the_constants_and_the_table_are_the_same_names():
    constants = {v for k, v in vars(contract).items() if k.isupper() and isinstance(v, str)}
    assert constants == set(CONTRACT_ENV)


@pytest.mark.parametrize("name", NAMES)
def test_every_contract_name_is_refused_in_env(script, name):
    with pytest.raises(InvalidSpecError) as info:
        GroupSpec.create(script=script, env={name: "x"})
    message = str(info.value)
    assert f"env: {name} is part of the rank contract" in message
    assert CONTRACT_ENV[name] in message


def test_every_refusal_names_what_to_set_instead():
    for name, hint in CONTRACT_ENV.items():
        assert "=..." in hint or "track=True" in hint, name


def test_all_contract_names_in_env_are_listed_together(script):
    with pytest.raises(InvalidSpecError) as info:
        GroupSpec.create(script=script, env=dict.fromkeys(NAMES, "x"))
    assert all(f"env: {name} " in str(info.value) for name in NAMES)


@pytest.mark.parametrize("name", NAMES)
def test_every_contract_name_is_in_the_readme_table(name):
    assert name in _readme_contract_names()


@pytest.mark.parametrize("name", NAMES)
def test_a_colliding_user_env_never_overrides_the_contract(script, name):
    # GroupSpec() bypasses create()'s checks: the plan must still hold the operator's value.
    spec = GroupSpec(num_nodes=2, nproc_per_node=1, script=script, env={name: "from-user", "FOO": "bar"})
    nodes = _plan(spec, extra_env={name: "from-operator"}).nodes
    assert [n.env[name] for n in nodes] == ["from-operator", "from-operator"]
    assert all(n.env["FOO"] == "bar" for n in nodes)
    # and a contract name the operator did not set does not reach the ranks from env either
    assert name not in _plan(spec).nodes[0].env


def test_user_env_overrides_the_wiring_defaults(script):
    spec = GroupSpec.create(script=script, nproc_per_node=2, env={"OMP_NUM_THREADS": "3", "PYTHONUNBUFFERED": "0"})
    env = _plan(spec, cpus_per_node=8).nodes[0].env
    assert env["OMP_NUM_THREADS"] == "3" and env["PYTHONUNBUFFERED"] == "0"
    default = _plan(GroupSpec.create(script=script, nproc_per_node=2), cpus_per_node=8).nodes[0].env
    assert default["OMP_NUM_THREADS"] == "4" and default["PYTHONUNBUFFERED"] == "1"


def test_user_env_overrides_a_platform_default_but_not_the_contract(script):
    # On Kubernetes a runtime's env reaches the plan through extra_env; the task's env wins there.
    spec = GroupSpec.create(script=script, env={"NCCL_DEBUG": "INFO"})
    env = _plan(spec, extra_env={"NCCL_DEBUG": "WARN", contract.CHECKPOINT_URI: "file:///ck"}).nodes[0].env
    assert env["NCCL_DEBUG"] == "INFO" and env[contract.CHECKPOINT_URI] == "file:///ck"


def test_reserved_names_in_a_bypassing_spec_do_not_reach_the_plan(script):
    spec = GroupSpec(num_nodes=1, nproc_per_node=1, script=script, env={"AIRFLOW_TORCHRUN_GROUP_ID": "other"})
    p = _plan(spec)
    assert p.nodes[0].env["AIRFLOW_TORCHRUN_GROUP_ID"] == p.group_id


def test_worker_helpers_read_the_contract_constants():
    from airflow_torchrun.storage import aws as checkpoint
    from airflow_torchrun.worker import metrics, shards

    assert checkpoint.STORAGE_OPTIONS_ENV == contract.CHECKPOINT_STORAGE_OPTIONS
    assert metrics.METRICS_ENV == contract.EVAL_METRICS_URI
    assert shards.MANIFEST_ENV == contract.SHARD_MANIFEST
    worker_checkpoint = pytest.importorskip("airflow_torchrun.worker.checkpoint")  # imports torch
    assert (
        worker_checkpoint.ENV_CHECKPOINT_URI,
        worker_checkpoint.ENV_RESUME_FROM,
        worker_checkpoint.ENV_KEEP_LAST,
    ) == (
        contract.CHECKPOINT_URI,
        contract.RESUME_FROM,
        contract.CHECKPOINT_KEEP_LAST,
    )
