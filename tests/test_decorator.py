"""``@task.torchrun``: a plain function as the training loop, through ``dag.test()`` with real ranks.

The errors a DAG author can make (an argument that is not JSON, a function that cannot travel)
are checked without ranks, where Airflow reports them: the DAG file's import, or the task's run
before anything is launched.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap

import pytest

from airflow_torchrun.contract.function import CALL_ENV, ENV_VALUE_LIMIT, SOURCE_ENV
from airflow_torchrun.errors import InvalidSpecError
from airflow_torchrun.worker.function import _covers, result_json
from tests.conftest import DAGS_FOLDER

# Ray Train's canonical example, as a @task.torchrun function: DDP around nn.Linear(10, 1), an SGD
# loop, rank 0's metrics returned; its learning rate comes from an upstream task.
RAY_SHAPE = """
@task
def pick_lr():
    return 0.05

@task.torchrun(num_nodes=2, nproc_per_node=2, track=False)
def train_loop_per_worker(lr, epochs=4):
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    rank = dist.get_rank()  # the decorator initialised the process group
    with open("/proc/self/cmdline", "rb") as fp:  # forked from its node's agent (local_rank_start=fork)
        print(f"FORKED rank={rank} {b'airflow_torchrun.backends.local.agent' in fp.read()}", flush=True)
    torch.manual_seed(0)
    model = DDP(torch.nn.Linear(10, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    data = torch.Generator().manual_seed(rank)  # each rank its own shard
    for epoch in range(epochs):
        x = torch.randn(64, 10, generator=data)
        y = x.sum(dim=1, keepdim=True)
        loss = torch.nn.functional.mse_loss(model(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        print(f"METRICS rank={rank} epoch={epoch} loss={loss.item()!r}", flush=True)
    return {"rank": rank, "world_size": dist.get_world_size(), "epochs": epochs, "lr": lr, "loss": loss.item()}

train_loop_per_worker(pick_lr())
"""

# Every step's data comes from the torch RNG, which checkpoints carry: a resumed run must replay
# exactly. Rank 1 is SIGKILLed at step 5 on a fresh start only (the retry resumes from step 4).
RESUMABLE = """
@task.torchrun(num_nodes=2, nproc_per_node=1, track=False, retry_delay=timedelta(0))
def steps(kill_at, total=8, every=2):
    import hashlib
    import os
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP
    from airflow_torchrun.worker import load_checkpoint, resume_step, save_checkpoint

    dist.init_process_group("gloo")  # as a plain torchrun script does: a no-op here
    torch.manual_seed(0)
    model = torch.nn.Linear(10, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    state = load_checkpoint()
    if state is not None:
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
    ddp = DDP(model)
    for step in range(resume_step() + 1, total + 1):
        if step == kill_at and dist.get_rank() == 1 and not os.environ.get("TRAIN_RESUME_FROM"):
            os.kill(os.getpid(), 9)
        x = torch.randn(16, 10)
        loss = torch.nn.functional.mse_loss(ddp(x), x.sum(dim=1, keepdim=True))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if step % every == 0:
            save_checkpoint({"model": model.state_dict(), "optimizer": optimizer.state_dict()}, step)
    weights = b"".join(p.detach().numpy().tobytes() for p in model.parameters())
    return {"digest": hashlib.sha256(weights).hexdigest(), "resumed_at": resume_step()}

steps.override(task_id="uninterrupted")(kill_at=-1)
steps.override(task_id="killed", retries=1)(kill_at=5)
"""

FAILING = """
@task.torchrun(num_nodes=2, nproc_per_node=1, track=False)
def fails_on_rank_1(step):
    import torch.distributed as dist

    if dist.get_rank() == 1:
        raise ValueError(f"boom at step {step}")
    dist.barrier()

fails_on_rank_1(3)
"""


@pytest.mark.slow
def test_ray_train_shape_on_2x2_returns_rank_0_metrics(run_dag):
    result = run_dag(RAY_SHAPE, imports="from airflow.sdk import task")
    assert result.state == "success", result.log[-4000:]
    value = result.xcom("train_loop_per_worker")
    logs = result.node_logs("train_loop_per_worker")
    last = {int(r): float(v) for r, v in re.findall(r"METRICS rank=(\d) epoch=3 loss=(\S+)", logs)}
    assert sorted(last) == [0, 1, 2, 3]
    assert sorted(re.findall(r"FORKED rank=(\d) True", logs)) == ["0", "1", "2", "3"], logs[-3000:]
    assert value == {"rank": 0, "world_size": 4, "epochs": 4, "lr": 0.05, "loss": last[0]}
    assert len(set(last.values())) > 1  # the other ranks' values differed, and were ignored
    summary = result.xcom("train_loop_per_worker", key="training_summary")
    assert summary["world_size"] == 4 and summary["node_exit_codes"] == [0, 0]


@pytest.mark.slow
def test_killed_rank_resumes_and_ends_bit_identical(run_dag):
    result = run_dag(RESUMABLE, imports="from datetime import timedelta\nfrom airflow.sdk import task")
    assert result.state == "success", result.log[-4000:]
    reference, killed = result.xcom("uninterrupted"), result.xcom("killed")
    assert result.try_number("uninterrupted") == 1 and reference["resumed_at"] == 0
    assert result.try_number("killed") == 2 and killed["resumed_at"] == 4
    assert killed["digest"] == reference["digest"]
    assert "killed by signal 9" in result.log or "SIGKILL" in result.log


@pytest.mark.slow
def test_deferred_the_function_initialises_its_own_group_and_the_result_comes_back(run_dag):
    result = run_dag(
        """
        @task.torchrun(nproc_per_node=2, track=False, process_group_backend=None, deferrable=True, defer_after=0)
        def own_group(run_id, scale):
            import torch
            import torch.distributed as dist

            assert not dist.is_initialized()  # process_group_backend=None: left to the function
            dist.init_process_group("gloo")
            t = torch.tensor([float(dist.get_rank() + 1)])
            dist.all_reduce(t)
            return {"sum": t.item() * scale, "run_id": run_id}

        own_group(scale=2)
        """,
        imports="from airflow.sdk import task",
    )
    assert result.state == "success", result.log[-4000:]
    assert "deferring: the triggerer watches it" in result.log
    assert result.xcom("own_group") == {"sum": 6.0, "run_id": result.run_id}
    assert result.xcom("own_group", key="training_summary")["world_size"] == 2


@pytest.mark.slow
def test_a_failing_rank_is_reported_with_the_functions_traceback(run_dag):
    result = run_dag(FAILING, imports="from airflow.sdk import task")
    assert result.state == "failed"
    assert "ValueError: boom at step 3" in result.log
    # The traceback points into the DAG file, at the line that raised.
    source = (DAGS_FOLDER / f"{result.dag_id}.py").read_text()
    line = next(i for i, text in enumerate(source.splitlines(), 1) if "raise ValueError" in text)
    assert re.search(rf'File ".*{result.dag_id}\.py", line {line}, in fails_on_rank_1', result.log), result.log[-4000:]


@pytest.mark.slow
def test_an_upstream_value_that_is_not_json_fails_before_any_rank_starts(run_dag):
    result = run_dag(
        """
        @task
        def when():
            return pendulum.datetime(2026, 1, 1)

        @task.torchrun(track=False)
        def train(start):
            return start

        train(when())
        """,
        imports="from airflow.sdk import task",
    )
    assert result.task_states["train"] == "failed"
    assert "argument start is DateTime" in result.log
    assert "not JSON-serialisable; the ranks receive the arguments as JSON" in result.log
    assert result.xcom("train", key="group") is None  # nothing was launched


# -- parse time: no ranks ------------------------------------------------------------------------
def _dag(body: str, tmp_path, **kwargs):
    """Import a DAG file whose body is ``body`` (under ``with DAG(...)``), as the DAG processor does."""
    path = tmp_path / "dag_under_test.py"
    path.write_text(
        "import pendulum\nfrom airflow.sdk import DAG, task\n"
        "with DAG('d', schedule=None, start_date=pendulum.datetime(2026, 1, 1)) as dag:\n"
        + textwrap.indent(textwrap.dedent(body), "    ")
    )
    namespace: dict[str, object] = {"__name__": "dag_under_test", "__file__": str(path)}
    exec(compile(path.read_text(), str(path), "exec"), namespace)
    return namespace["dag"]


def test_registered_through_the_provider_and_named_in_the_ui(tmp_path):
    from airflow.sdk import task

    from airflow_torchrun.decorators import TorchrunDecoratedOperator, torchrun_task

    assert task.torchrun is torchrun_task
    dag = _dag(
        """
        @task.torchrun(num_nodes=2, track=False)
        def train(lr):
            return lr
        train(0.1)
        """,
        tmp_path,
    )
    op = dag.get_task("train")
    assert isinstance(op, TorchrunDecoratedOperator)
    assert op.operator_name == "@task.torchrun"
    assert op.group_spec().command[1:] == ("-m", "airflow_torchrun.worker.function")


def test_an_argument_that_is_not_json_fails_the_dag_import(tmp_path):
    with pytest.raises(InvalidSpecError) as err:
        _dag(
            """
            @task.torchrun(track=False)
            def train(model, cfg):
                return 1
            train(object(), cfg={"opt": {"lr": 0.1, "betas": {1, 2}}})
            """,
            tmp_path,
        )
    message = str(err.value)
    assert "argument model is object <object object at" in message
    assert "argument cfg['opt']['betas'] is set {1, 2}, which is not JSON-serialisable" in message
    assert "pass plain values (numbers, strings, lists, dicts), or a URI and load the object inside" in message


@pytest.mark.parametrize(
    ("body", "expected"),
    [
        (
            """
            def make(scale):
                @task.torchrun(track=False)
                def train(lr):
                    return lr * scale
                return train
            make(2)(0.1)
            """,
            "train() is a closure over scale of the function it is defined in; only its own source travels to the "
            "ranks: define it with def at module level of the DAG file, import what it needs inside it",
        ),
        (
            """
            import torch
            EPOCHS = 3
            @task.torchrun(track=False)
            def train(lr):
                return [torch.ones(1).item() * lr for _ in range(EPOCHS)]
            train(0.1)
            """,
            "train() uses the module-level name(s) EPOCHS, torch, which do not travel with its source: import "
            "them inside the function",
        ),
        ("task.torchrun(track=False)(lambda lr: lr)(0.1)", "a lambda cannot be shipped to the ranks"),
    ],
    ids=["closure", "module-level-names", "lambda"],
)
def test_a_function_that_cannot_travel_fails_the_dag_import(tmp_path, body, expected):
    if "import torch" in body:
        body = body.replace("import torch", "import math as torch")  # any module-level name will do
    with pytest.raises(InvalidSpecError) as err:
        _dag(body, tmp_path)
    assert expected in str(err.value).replace("\n    ", " ")


def test_a_nested_function_that_closes_over_nothing_travels(tmp_path):
    dag = _dag(
        """
        def build():
            @task.torchrun(track=False)
            def train(lr=0.1):
                import math
                return math.floor(lr)
            return train
        build()()
        """,
        tmp_path,
    )
    env = dag.get_task("train").contract_env_preview({"run_id": "r", "try_number": 1})
    assert env[SOURCE_ENV].startswith("def train(lr=0.1):\n    import math")


def test_script_arguments_belong_to_the_operator(tmp_path):
    with pytest.raises(TypeError, match="script belong to DistributedTrainingOperator"):
        _dag(
            """
            @task.torchrun(script="train.py")
            def train():
                pass
            train()
            """,
            tmp_path,
        )


def test_too_large_an_argument_is_refused_with_the_limit(tmp_path):
    with pytest.raises(InvalidSpecError) as err:
        _dag(
            f"""
            @task.torchrun(track=False)
            def train(vocabulary):
                return len(vocabulary)
            train(["w" * 1000] * {ENV_VALUE_LIMIT // 1000 + 10})
            """,
            tmp_path,
        )
    message = str(err.value)
    assert f"travel to every rank in the environment variable {CALL_ENV}, which holds at most 127 KiB" in message
    assert "pass large data by URI" in message


def test_the_preview_ships_source_and_arguments_with_lines_of_the_dag_file(tmp_path):
    import json

    dag = _dag(
        """
        @task.torchrun(track=False, checkpoint_uri="s3://ckpt/x")
        def train(lr, *, epochs=2, run_id=None):
            return lr
        train("{{ params.lr }}", epochs=(1, 2))
        """,
        tmp_path,
    )
    op = dag.get_task("train")
    env = op.contract_env_preview({"run_id": "manual__1", "try_number": 2})
    call = json.loads(env[CALL_ENV])
    assert call["kwargs"] == {"lr": "{{ params.lr }}", "epochs": [1, 2], "run_id": "manual__1"}
    lines = (tmp_path / "dag_under_test.py").read_text().splitlines()
    assert lines[call["first_line"] - 1].strip() == "def train(lr, *, epochs=2, run_id=None):"
    assert call["result_uri"] == "s3://ckpt/x/results/train-try2.json"
    assert env["TRAIN_CHECKPOINT_URI"] == "s3://ckpt/x"


def test_positional_and_variadic_arguments_reach_the_function_as_called(tmp_path):
    from airflow_torchrun.contract.function import FunctionCall
    from airflow_torchrun.worker.function import load_function

    dag = _dag(
        """
        @task.torchrun(track=False)
        def train(first, /, second, *rest, scale=1, **extra):
            return [first, second, list(rest), scale, extra]
        train(1, 2, 3, 4, scale=5, note="n")
        """,
        tmp_path,
    )
    env = dag.get_task("train").contract_env_preview({"run_id": "r", "try_number": 1})
    call = FunctionCall.from_env(env)
    assert (call.args, call.kwargs) == ([1, 2, 3, 4], {"scale": 5, "note": "n"})
    assert load_function(call)(*call.args, **call.kwargs) == [1, 2, [3, 4], 5, {"note": "n"}]


# -- the worker module ---------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("ours", "asked", "covered"),
    [
        ("gloo", None, True),
        ("gloo", "gloo", True),
        ("gloo", "nccl", False),
        ("cpu:gloo,cuda:nccl", "nccl", True),
        ("cpu:gloo,cuda:nccl", "cuda:nccl,cpu:gloo", True),
        ("cpu:gloo,cuda:nccl", "mpi", False),
    ],
)
def test_a_second_init_is_a_no_op_when_the_group_covers_it(ours, asked, covered):
    assert _covers(ours, asked) is covered


def test_a_return_value_that_is_not_json_says_what_to_return():
    class Tensor:
        def __repr__(self) -> str:
            return "tensor(0.25)"

    expected = r"train\(\) returned dict \{'loss': tensor\(0.25\)\} on rank 0.*Tensor is not JSON.*e.g. float\(loss\)"
    with pytest.raises(TypeError, match=expected):
        result_json("train", {"loss": Tensor()})


@pytest.mark.slow
def test_importing_the_decorator_and_the_worker_module_stays_cheap():
    code = (
        "import sys\n"
        "from airflow.sdk import task\n"
        "import airflow_torchrun.decorators\n"
        "task.torchrun\n"
        "print(sorted({'torch', 'kubernetes', 's3fs', 'mlflow'} & set(sys.modules)))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], check=False, capture_output=True, text=True, env=os.environ.copy()
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().splitlines()[-1] == "[]"
    # What every rank imports first: no Airflow, and torch only once the function is called.
    code = "import sys, airflow_torchrun.worker.function\nprint(sorted({'airflow', 'torch'} & set(sys.modules)))"
    done = subprocess.run([sys.executable, "-c", code], check=False, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"
