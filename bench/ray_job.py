"""``bench/job.py`` under Ray Train's ``TorchTrainer``: the Ray anchor of ``bench/bench_recovery.py``.

Runs in the benchmark's own Ray virtualenv (``bench/ray_venv.py``), never in the package's: Ray is
no dependency of airflow-torchrun. The job's settings come from the environment, as for the
other launchers; ``RAY_WORKERS`` CPU workers (default 2), ``RAY_MAX_FAILURES`` is
``FailureConfig(max_failures=...)`` (default 0), ``RAY_STORAGE`` Ray's run storage. Exit 0 when
``fit()`` returned without error.

Run: ``.state/bench/ray-venv/bin/python bench/ray_job.py`` with ``STEPS`` etc. set.
"""

from __future__ import annotations

import os
import sys

JOB_VARS = ("STEPS", "CKPT", "CKPT_EVERY", "EVENTS", "KILL_AT", "KILL_MARK", "PIDS")


def loop(config: dict[str, dict[str, str]]) -> None:
    os.environ.update(config["env"])
    os.environ["DESTROY"] = "0"  # Ray owns the process group
    from job import train

    train()


def main() -> int:
    import ray
    from ray.train import FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchConfig, TorchTrainer

    workers = int(os.environ.get("RAY_WORKERS", "2"))
    ray.init(num_cpus=workers, include_dashboard=False, logging_level="WARNING", log_to_driver=False)
    env = {k: os.environ[k] for k in JOB_VARS if k in os.environ}
    trainer = TorchTrainer(
        loop,
        train_loop_config={"env": env},
        torch_config=TorchConfig(backend="gloo"),
        scaling_config=ScalingConfig(num_workers=workers, use_gpu=False),
        run_config=RunConfig(
            name="bench",
            storage_path=os.environ["RAY_STORAGE"],
            failure_config=FailureConfig(max_failures=int(os.environ.get("RAY_MAX_FAILURES", "0"))),
        ),
    )
    result = trainer.fit()
    ray.shutdown()
    return 0 if result.error is None else 1


if __name__ == "__main__":
    sys.exit(main())
