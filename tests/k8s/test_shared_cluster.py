"""A namespace shared with others: what the backend may touch, what pods may do, what a Variable may set.

Against the fake API server (real HTTP through the provider's hooks) and the official schemas:
two Airflow deployments with the same dag and run ids never attach to or delete each other's
groups; deletes carry the Job's uid; pods are the Job's by its controller-uid and owner, not by a
label; the pod runs without the API token, on a read-only root, with a deadline of its own; the
runtimes Variable cannot loosen what the platform's runtimes file sets.
"""

from __future__ import annotations

import datetime
import json
from pathlib import Path

import kubernetes_validate
import pytest
import yaml

from airflow_torchrun.backends.kubernetes.backend import KubernetesBackend
from airflow_torchrun.backends.kubernetes.render import GROUP_LABEL
from airflow_torchrun.backends.kubernetes.runtimes import BUILTIN_RUNTIMES, clear_cache, load_runtimes, parse_runtime
from airflow_torchrun.errors import GroupLaunchError, InvalidSpecError
from airflow_torchrun.status import NodePhase

from .conftest import IDENTITY, NAMESPACE, make_spec
from .fake_api import FakeKubeAPI

NS = NAMESPACE
# Public names (kubectl selectors in runbooks use them): spelt out, not imported.
CONTROLLER_UID_LABEL = "batch.kubernetes.io/controller-uid"
DEPLOYMENT_LABEL = "airflow-torchrun/deployment"


def backend_of(kubeconfig: Path, deployment: str | None = None, **kwargs: object) -> KubernetesBackend:
    return KubernetesBackend(
        namespace=NS,
        config_file=str(kubeconfig),
        watch_seconds=1.0,
        runtimes=BUILTIN_RUNTIMES,
        **({"deployment": deployment} if deployment else {}),
        **kwargs,  # type: ignore[arg-type]
    )


def launch(backend: KubernetesBackend):
    return backend.launch(backend.plan(make_spec(), IDENTITY, {}))


# -- two deployments, one namespace ----------------------------------------------------------------
def test_two_deployments_with_the_same_ids_never_attach_to_or_delete_each_others_groups(
    fake_api: FakeKubeAPI, kubeconfig: Path
) -> None:
    prod, staging = backend_of(kubeconfig, "prod"), backend_of(kubeconfig, "staging")
    ours = launch(prod)
    assert staging.find_existing(IDENTITY, make_spec()) is None  # same dag/task/run/map index, other deployment
    theirs = launch(staging)
    assert theirs.job_name != ours.job_name
    assert fake_api.job(NS, ours.job_name)["metadata"]["labels"][DEPLOYMENT_LABEL] == "prod"
    staging.teardown(theirs)
    assert ("jobs", NS, ours.job_name) in fake_api.objects  # prod's group untouched
    found = prod.find_existing(IDENTITY, make_spec())
    assert found is not None and found.job_uid == ours.job_uid


def test_the_views_launches_table_names_the_jobs_the_deployment_made(fake_api: FakeKubeAPI, kubeconfig: Path) -> None:
    """Found on the real cluster: the table derived each launch's id without the deployment, so it
    listed a group no Job had."""
    from dataclasses import asdict, replace

    from airflow_torchrun.ui.api import _launches

    prod = backend_of(kubeconfig, "prod")
    relaunched = prod.launch(prod.plan(make_spec(), replace(IDENTITY, relaunch=1), {}))
    identity = {k: v for k, v in asdict(IDENTITY).items() if k in ("dag_id", "task_id", "run_id", "try_number")}
    rows = _launches(relaunched, prod, {**identity, "map_index": IDENTITY.map_index}, None)
    assert [r["group_id"] for r in rows][-1] == relaunched.group_id == relaunched.job_name
    assert rows[0]["group_id"] == prod.named(IDENTITY).group_id != IDENTITY.group_id


def test_a_bad_deployment_name_is_refused() -> None:
    with pytest.raises(InvalidSpecError, match="must be a Kubernetes label value"):
        KubernetesBackend(namespace=NS, deployment="prod eu", runtimes=BUILTIN_RUNTIMES)


@pytest.mark.parametrize(
    ("stored", "told"),
    [
        # What a process without the deployment's fernet key reads (Airflow's NullFernet hands back the
        # ciphertext): seen when a test process loaded its config before an `airflow` command wrote a key.
        (
            "gAAAAABrE6onBoxXxNF7sqNRHUZuO0a8eZg0FzvwmcXPa04P-8p4H5B1nBDN-dp417KPp9zBTe95R0t5Gc2rkeAYxndNcWRgrw==",
            "fernet_key",
        ),
        ("prod eu", "must be a Kubernetes label value"),
    ],
)
def test_a_stored_deployment_name_that_is_no_name_is_refused_naming_the_variable(
    stored: str, told: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The Variable the deployment keeps its name in is data a user (or a key mismatch) can change:
    what it holds is checked where it is read, and the error names the Variable, not the config option."""
    from airflow.models.variable import Variable as StoredVariable
    from airflow.sdk import Variable

    from airflow_torchrun.deployment import DEPLOYMENT_VARIABLE, deployment_name, stored_deployment_name

    monkeypatch.delenv("AIRFLOW__TORCHRUN__DEPLOYMENT", raising=False)
    monkeypatch.setattr(Variable, "get", staticmethod(lambda key, default=None: stored))
    monkeypatch.setattr(StoredVariable, "get", staticmethod(lambda key, default_var=None: stored))
    for read in (deployment_name, stored_deployment_name):
        with pytest.raises(InvalidSpecError, match=DEPLOYMENT_VARIABLE) as raised:
            read()
        assert told in str(raised.value) and "[torchrun] deployment" in str(raised.value)


def test_teardown_deletes_only_the_job_it_launched(fake_api: FakeKubeAPI, kubeconfig: Path) -> None:
    """Someone deleted our Job and made another of the same name: the teardown's uid precondition
    fails (409) and the other Job survives; the teardown still counts as done."""
    backend = backend_of(kubeconfig)
    handle = launch(backend)
    job = fake_api.job(NS, handle.job_name)
    with fake_api._cond:
        fake_api._remove("jobs", NS, handle.job_name)
    fake_api.add_object("jobs", NS, {**job, "metadata": {**job["metadata"], "uid": "someone-elses-uid"}})
    backend.teardown(handle)
    (delete,) = [c for c in fake_api.calls_to("DELETE", "jobs") if c.path.endswith(handle.job_name)]
    assert delete.precondition_uid == handle.job_uid and delete.propagation_policy == "Foreground"
    assert fake_api.job(NS, handle.job_name)["metadata"]["uid"] == "someone-elses-uid"


def test_a_foreign_service_of_the_groups_name_is_left_alone(fake_api: FakeKubeAPI, kubeconfig: Path) -> None:
    backend = backend_of(kubeconfig)
    plan = backend.plan(make_spec(), IDENTITY, {})
    name = backend.render(plan).name
    fake_api.add_object(
        "services", NS, {"apiVersion": "v1", "kind": "Service", "metadata": {"name": name}, "spec": {"ports": []}}
    )
    with pytest.raises(GroupLaunchError, match="did not create for this group") as info:
        backend.launch(plan)
    assert info.value.transient is False
    assert ("services", NS, name) in fake_api.objects  # never deleted
    assert ("jobs", NS, name) not in fake_api.objects  # the Job created first is gone again
    assert not fake_api.calls_to("DELETE", "services")


def test_pods_are_the_jobs_by_its_uid_not_by_a_label(fake_api: FakeKubeAPI, kubeconfig: Path) -> None:
    backend = backend_of(kubeconfig)
    handle = launch(backend)
    name = handle.job_name
    fake_api.create_pods(NS, name)
    fake_api.set_running(NS, name)
    service = fake_api.objects[("services", NS, name)]
    assert service["spec"]["selector"] == {CONTROLLER_UID_LABEL: handle.job_uid}  # node 0's DNS name is the Job's
    # A pod anyone could make, copying every label of a real one but not its owner: a "failed rank 0".
    real = fake_api.pod(NS, name, 0)
    rogue = json.loads(json.dumps(real))
    rogue["metadata"].update(name=f"{name}-0-rogue", uid="rogue", ownerReferences=[])
    rogue["status"] = {
        "phase": "Failed",
        "containerStatuses": [
            {"name": "trainer", "state": {"terminated": {"exitCode": 1, "reason": "Error"}}, "ready": False}
        ],
    }
    fake_api.add_object("pods", NS, rogue)
    nodes = backend.observe(handle)
    assert [n.phase for n in nodes] == [NodePhase.RUNNING, NodePhase.RUNNING]
    assert fake_api.calls_to("GET", "pods")[-1].query["labelSelector"] == f"{CONTROLLER_UID_LABEL}={handle.job_uid}"
    assert all(GROUP_LABEL not in loc for loc in backend.log_locations(handle))


# -- the pod ---------------------------------------------------------------------------------------
def test_pods_get_no_token_a_read_only_root_and_a_deadline(fake_api: FakeKubeAPI, kubeconfig: Path) -> None:
    backend = backend_of(kubeconfig, active_deadline_seconds=3600.5)
    handle = launch(backend)
    job = fake_api.job(NS, handle.job_name)  # as the fake API server accepted it (schema-validated)
    pod = job["spec"]["template"]["spec"]
    assert job["spec"]["activeDeadlineSeconds"] == 3601
    assert pod["automountServiceAccountToken"] is False
    for container in pod["containers"] + pod["initContainers"]:
        assert container["securityContext"]["readOnlyRootFilesystem"] is True
        assert container["securityContext"]["allowPrivilegeEscalation"] is False
    (trainer,) = pod["containers"]
    mounts = {m["mountPath"]: m["name"] for m in trainer["volumeMounts"]}
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert volumes[mounts["/tmp"]] == {"name": "tmp", "emptyDir": {}}  # torchrun's logs and error files
    assert volumes[mounts["/dev/shm"]]["emptyDir"]["medium"] == "Memory"
    assert pod["terminationGracePeriodSeconds"] == 10  # the task's teardown_grace, no runtime setting


def test_the_runtime_sets_the_grace_period_token_and_writable_paths(fake_api: FakeKubeAPI, kubeconfig: Path) -> None:
    runtime = parse_runtime(
        "cpu",
        {
            "image": "t:1",
            "termination_grace_period": 300,
            "automount_service_account_token": True,
            "writable_paths": ["/home/trainer/.cache"],
        },
        "test",
    )
    backend = KubernetesBackend(namespace=NS, config_file=str(kubeconfig), runtimes={"cpu": runtime})
    handle = launch(backend)
    pod = fake_api.job(NS, handle.job_name)["spec"]["template"]["spec"]
    assert pod["terminationGracePeriodSeconds"] == 300
    assert handle.teardown_grace == 300  # the handle says what the pods get
    assert pod["automountServiceAccountToken"] is True
    assert {"name": "writable-0", "mountPath": "/home/trainer/.cache"} in pod["containers"][0]["volumeMounts"]
    for version in ("1.29.0", "1.37.0"):
        kubernetes_validate.validate(fake_api.job(NS, handle.job_name) | {"status": {}}, version, strict=True)


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("termination_grace_period", 0, "termination_grace_period must be a whole number >= 1"),
        ("termination_grace_period", "30s", "termination_grace_period must be a whole number >= 1"),
        ("ttl_seconds_after_finished", 0, "ttl_seconds_after_finished 0 is too short"),
        ("ttl_seconds_after_finished", 10, "give at least 60"),
        ("automount_service_account_token", "yes", "must be true or false"),
        ("read_only_root_filesystem", 1, "must be true or false"),
        ("writable_paths", ["relative"], "must be an absolute path"),
        ("writable_paths", ["/tmp"], "must be an absolute path other than /, /tmp and /dev/shm"),
    ],
)
def test_bad_runtime_values_are_refused(field: str, value: object, message: str) -> None:
    with pytest.raises(InvalidSpecError, match=message.replace("(", r"\(")):
        parse_runtime("r", {"image": "t:1", field: value}, "test")


# -- the runtimes Variable cannot loosen what the file sets -------------------------------------------
LOOSE = {
    "privileged": {"container_overrides": {"securityContext": {"privileged": True}}},
    "root": {"run_as_user": 0},
    "host_namespaces": {"pod_overrides": {"hostNetwork": True}},
    "host_path": {"pod_overrides": {"volumes": [{"name": "host", "hostPath": {"path": "/"}}]}},
    "service_account_token": {"automount_service_account_token": True},
    "writable_root": {"read_only_root_filesystem": False},
}


@pytest.mark.parametrize(
    "overrides",
    [
        {"pod_overrides": {"automountServiceAccountToken": True}},
        {
            "pod_overrides": {
                "volumes": [{"name": "tok", "projected": {"sources": [{"serviceAccountToken": {"path": "t"}}]}}]
            }
        },
        {"container_overrides": {"securityContext": {"readOnlyRootFilesystem": False}}},
        {"container_overrides": {"securityContext": {"appArmorProfile": {"type": "Unconfined"}}}},
        {"pod_overrides": {"securityContext": {"seLinuxOptions": {"type": "spc_t"}}}},
    ],
    ids=["automount-override", "projected-token", "writable-root-override", "apparmor", "selinux"],
)
def test_the_variable_cannot_loosen_security_through_overrides_either(
    overrides: dict[str, object], runtimes_file, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("AIRFLOW_VAR_TORCHRUN_RUNTIMES", json.dumps({"team": {"image": "t:1", **overrides}}))
    with pytest.raises(InvalidSpecError, match="does not allow for runtimes of the Variable"):
        load_runtimes(file=str(runtimes_file({"cpu": {"image": "t:1"}})), variable="torchrun_runtimes")


@pytest.fixture
def runtimes_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    def write(data: dict[str, object]) -> Path:
        path = tmp_path / "runtimes.yaml"
        path.write_text(yaml.safe_dump(data))
        clear_cache()
        return path

    yield write
    clear_cache()


@pytest.mark.parametrize("allowance", sorted(LOOSE))
def test_the_variable_cannot_loosen_security_unless_the_file_allows_it(
    allowance: str, runtimes_file, monkeypatch: pytest.MonkeyPatch
) -> None:
    variable = {"team": {"image": "t:1", **LOOSE[allowance]}}
    monkeypatch.setenv("AIRFLOW_VAR_TORCHRUN_RUNTIMES", json.dumps(variable))
    path = runtimes_file({"cpu": {"image": "t:1"}})
    with pytest.raises(InvalidSpecError) as info:
        load_runtimes(file=str(path), variable="torchrun_runtimes")
    assert "which the platform's runtimes file does not allow for runtimes of the Variable" in str(info.value)
    assert f"list {allowance!r} under _variable_policy.allow" in str(info.value)
    # The same runtime in the file itself is the platform's own choice.
    assert "team" in load_runtimes(file=str(runtimes_file({"team": variable["team"]})), variable="").runtimes
    # And the file may allow it for the Variable (overrides beyond the harmless few are an allowance too).
    overrides = ["overrides"] if {"pod_overrides", "container_overrides"} & set(LOOSE[allowance]) else []
    path = runtimes_file({"cpu": {"image": "t:1"}, "_variable_policy": {"allow": [allowance, *overrides]}})
    assert "team" in load_runtimes(file=str(path), variable="torchrun_runtimes").runtimes


def test_without_a_file_the_variable_may_not_loosen_either(monkeypatch: pytest.MonkeyPatch) -> None:
    clear_cache()
    monkeypatch.setenv("AIRFLOW_VAR_TORCHRUN_RUNTIMES", json.dumps({"team": {"image": "t:1", "run_as_user": 0}}))
    with pytest.raises(InvalidSpecError, match="run_as_user: 0"):
        load_runtimes(file="", variable="torchrun_runtimes")
    clear_cache()


def test_only_the_file_may_set_the_policy(runtimes_file, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AIRFLOW_VAR_TORCHRUN_RUNTIMES", json.dumps({"_variable_policy": {"allow": ["root"]}}))
    with pytest.raises(InvalidSpecError, match="may be set only in the platform's runtimes file"):
        load_runtimes(file=str(runtimes_file({"cpu": {"image": "t:1"}})), variable="torchrun_runtimes")
    with pytest.raises(InvalidSpecError, match="unknown allowance"):
        load_runtimes(file=str(runtimes_file({"_variable_policy": {"allow": ["everything"]}})), variable="")


# -- parse time: storage and tracking the pods cannot reach ---------------------------------------
def operator(**kwargs: object):
    from airflow_torchrun import DistributedTrainingOperator

    args: dict[str, object] = {"backend": "kubernetes", "runtime": "cpu", "script": "/opt/trainer/train.py"}
    return DistributedTrainingOperator(task_id="train", **{**args, **kwargs})


def test_a_local_default_checkpoint_root_fails_at_parse_time(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("AIRFLOW__TORCHRUN__CHECKPOINT_BASE", raising=False)
    with pytest.raises(InvalidSpecError) as info:
        operator(track=False)
    assert "checkpoint_uri is not set, and the default root [torchrun] checkpoint_base (file://" in str(info.value)
    assert "checkpoint_uri='s3://bucket/prefix'" in str(info.value)
    monkeypatch.setenv("AIRFLOW__TORCHRUN__CHECKPOINT_BASE", "s3://shared/ckpt")
    operator(track=False)  # shared storage: fine
    operator(track=False, checkpoint_uri="s3://ckpt-bucket/p")


@pytest.mark.parametrize("uri", ["sqlite:////root/.airflow-torchrun/mlflow/mlflow.db", "file:///mlruns", "./mlruns"])
def test_a_local_mlflow_store_fails_at_parse_time(uri: str) -> None:
    with pytest.raises(InvalidSpecError) as info:
        operator(checkpoint_uri="s3://ckpt-bucket/p", mlflow_tracking_uri=uri)
    assert "is a store on the Airflow worker's disk, which the pods (rank 0 logs there) cannot reach" in str(info.value)
    assert "mlflow_tracking_uri='http://<mlflow server>:5000'" in str(info.value)
    operator(checkpoint_uri="s3://ckpt-bucket/p", mlflow_tracking_uri="http://mlflow.ml.svc:5000")
    operator(
        checkpoint_uri="s3://ckpt-bucket/p", mlflow_tracking_uri=uri, backend="local", command=["true"], script=None
    )  # here: fine


def test_the_default_mlflow_store_fails_at_parse_time_too(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.delenv("AIRFLOW__TORCHRUN__MLFLOW_TRACKING_URI", raising=False)
    # track=True with no tracking URI configured: the SQLite default on the worker's disk.
    with pytest.raises(InvalidSpecError, match=r"sqlite:///.*is a store on the Airflow worker's disk"):
        operator(checkpoint_uri="s3://ckpt-bucket/p", track=True)
    operator(checkpoint_uri="s3://ckpt-bucket/p")  # track=None and nothing configured: no MLflow run, fine


def test_credentials_in_env_fail_at_parse_time() -> None:
    """env= values are part of the Job's pod spec: a credential there is readable by anyone who may
    read Jobs. Refused when the DAG is parsed, naming the variables (never their values) and the way
    that keeps them out of the spec; the local backend's processes may have them."""
    env = {"HF_TOKEN": "hf_s3cr3t", "db_password": "pw", "WANDB_API_KEY": "k", "TOKENIZERS_PARALLELISM": "false"}
    with pytest.raises(InvalidSpecError) as info:
        operator(checkpoint_uri="s3://ckpt-bucket/p", track=False, env=env)
    message = str(info.value)
    assert "env: HF_TOKEN, WANDB_API_KEY, db_password would be written into the Job's pod spec" in message, message
    assert "runtime's env_from_secrets" in message and "hf_s3cr3t" not in message
    # Templated values are refused by name too: the rendered value would land in the spec all the same.
    with pytest.raises(InvalidSpecError, match="env: AWS_SECRET_ACCESS_KEY would be written"):
        operator(checkpoint_uri="s3://ckpt-bucket/p", track=False, env={"AWS_SECRET_ACCESS_KEY": "{{ var.value.k }}"})
    # Settings whose names share the words are not refused.
    settings = {
        "TOKENIZERS_PARALLELISM": "false",
        "HF_HUB_DISABLE_IMPLICIT_TOKEN": "1",
        "GOOGLE_APPLICATION_CREDENTIALS": "/var/run/secrets/gcp/key.json",
        "EPOCHS": "3",
    }
    operator(checkpoint_uri="s3://ckpt-bucket/p", track=False, env=settings)
    operator(checkpoint_uri="s3://ckpt-bucket/p", track=False, env=env, backend="local", command=["true"], script=None)
    # With a templated script (checked once rendered), the env is checked at parse time all the same.
    with pytest.raises(InvalidSpecError, match="env: HF_TOKEN would be written"):
        operator(checkpoint_uri="s3://ckpt-bucket/p", track=False, script="{{ params.d }}/t.py", env={"HF_TOKEN": "x"})


def test_a_value_airflow_knows_as_secret_is_refused_whatever_its_name() -> None:
    """Once rendered: a connection's password, a sensitive Variable, anything the task masked, is
    held by Airflow's secrets masker; such a value under any name would reach the pod spec."""
    from airflow.sdk.log import mask_secret

    from airflow_torchrun.backends.kubernetes.checks import env_problems

    mask_secret("pw-from-a-connection-3f9a")
    problems = env_problems({"DB_URL": "postgres://ml:pw-from-a-connection-3f9a@db/ml", "EPOCHS": "3"})
    assert len(problems) == 1 and problems[0].startswith("env: DB_URL would be written"), problems
    assert "pw-from-a-connection" not in problems[0]
    assert env_problems({"DB_URL": "postgres://db/ml", "EPOCHS": "3"}) == []


def test_execution_timeout_becomes_the_jobs_deadline(monkeypatch: pytest.MonkeyPatch) -> None:
    task = operator(checkpoint_uri="s3://ckpt-bucket/p", track=False, execution_timeout=datetime.timedelta(hours=2))
    assert task.task_backend_options().active_deadline_seconds == 7200
    assert (
        operator(checkpoint_uri="s3://ckpt-bucket/p", track=False).task_backend_options().active_deadline_seconds
        is None
    )
