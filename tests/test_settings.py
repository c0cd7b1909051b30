"""An invalid task lists every problem at once: the group spec and the task settings together."""

from __future__ import annotations

import pytest

from airflow_torchrun.errors import InvalidSpecError


def test_spec_and_settings_problems_come_in_one_error(tiny_script):
    from airflow.sdk import DAG

    from airflow_torchrun import DistributedTrainingOperator

    with DAG("bad_everything", schedule=None), pytest.raises(InvalidSpecError) as err:
        DistributedTrainingOperator(
            task_id="train",
            script=str(tiny_script),
            num_nodes=0,  # spec
            env={"TRAIN_RESUME_FROM": "s3://x/y"},  # spec (contract name)
            keep_last=-1,  # checkpoint settings (0 keeps every one)
            checkpoint_uri="s3://",  # checkpoint settings
            poll_interval=-1,  # run settings
            progress_timeout=0,  # run settings
            max_preemptions=-2,  # run settings
        )
    text = str(err.value)
    for expected in (
        "num_nodes must be at least 1",
        "TRAIN_RESUME_FROM",
        "keep_last must be a whole number >= 0 (0 keeps every committed checkpoint)",
        "checkpoint_uri:",
        "poll_interval must be a positive number",
        "progress_timeout must be a positive number",
        "max_preemptions must be a whole number >= 0",
    ):
        assert expected in text, f"{expected!r} missing from:\n{text}"
    assert text.startswith("Invalid torchrun group spec for task bad_everything.train")


def test_evaluation_has_only_the_arguments_it_means(tiny_script):
    from airflow.sdk import DAG

    from airflow_torchrun import DistributedTrainingOperator, EvaluateModelOperator

    with DAG("eval_args", schedule=None):
        for training_only in ("keep_last", "resume", "track", "all_ranks_logs", "mlflow_experiment"):
            with pytest.raises(TypeError, match=training_only):
                EvaluateModelOperator(
                    task_id=f"e_{training_only}",
                    script=str(tiny_script),
                    checkpoint="file:///c/step-1",
                    **{training_only: 1},
                )
        evaluate = EvaluateModelOperator(task_id="e", script=str(tiny_script), checkpoint="file:///c/step-00000001")
    assert not isinstance(evaluate, DistributedTrainingOperator)
    assert (evaluate.num_nodes, evaluate.nproc_per_node) == (1, 1)


def test_keep_last_0_keeps_every_checkpoint_in_the_operator_as_in_the_worker(tiny_script):
    """One meaning of keep_last=0 (the worker's save_checkpoint: keep all) on both sides."""
    from airflow.sdk import DAG

    from airflow_torchrun import DistributedTrainingOperator

    with DAG("keep_all", schedule=None):
        task = DistributedTrainingOperator(task_id="train", script=str(tiny_script), keep_last=0)
    assert task.training.keep_last == 0
