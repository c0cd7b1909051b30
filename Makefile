# The README's two commands: `make demo` and `make test`. Each builds .venv from nothing if needed.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
# The CPU build of torch: PyPI has only the CUDA build (about 3 GB with its NVIDIA libraries). Where
# a local folder of wheels holds PyTorch's CPU wheel (../shared/wheels on our machines), take it from
# there; elsewhere (a user's machine) plain torch from PyPI. TORCH_WHEELS= overrides the folder.
TORCH_WHEELS ?= $(firstword $(wildcard $(CURDIR)/../shared/wheels /work/shared/wheels))
ifneq ($(strip $(TORCH_WHEELS)),)
TORCH_PIN := torch==2.13.0+cpu
PIP_TORCH := --find-links $(TORCH_WHEELS)
else
TORCH_PIN := torch==2.13.0
PIP_TORCH :=
endif
# The Airflow release this is tested on (the package accepts any 3.3+; unpinned, pip may settle lower).
AIRFLOW_PIN := apache-airflow==3.3.2

# Bytecode is cached for everything make starts: with PYTHONDONTWRITEBYTECODE=1 (set in many
# containers) each process that imports the operators compiles them anew, 0.45 s of CPU every time
# (0.15 s for the ranks' helpers), and pytest rewrites every test module again in each worker.
unexport PYTHONDONTWRITEBYTECODE

export AIRFLOW_HOME ?= $(CURDIR)/.state/airflow
export AIRFLOW__CORE__DAGS_FOLDER ?= $(CURDIR)/dags
export AIRFLOW__CORE__LOAD_EXAMPLES ?= False
export AIRFLOW__TORCHRUN__STATE_DIR ?= $(CURDIR)/.state/torchrun

.PHONY: demo test check lint install clean bench chaos image-test ui cluster cluster-down cluster-status e2e-k8s

$(STAMP): pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet $(PIP_TORCH) "$(TORCH_PIN)"
	$(PY) -m pip install --quiet $(PIP_TORCH) -e ".[airflow,worker,s3,mlflow,openlineage,examples,ecosystem,dev]" "$(TORCH_PIN)" "$(AIRFLOW_PIN)"
	# setuptools leaves the metadata in the source root too; on sys.path through the editable
	# install it makes Airflow see the distribution twice ("Plugin ... already registered").
	rm -rf operators/*.egg-info
	touch $(STAMP)

install: $(STAMP)

# BACKEND=kubernetes: the same pipeline on the cluster of `make cluster` (its environment file
# names the Airflow connection, the runtimes, S3 and MLflow it serves).
BACKEND ?= local
CLUSTER_ENV := $(CURDIR)/.state/cluster/env
demo: $(STAMP)
ifeq ($(BACKEND),kubernetes)
	@test -f $(CLUSTER_ENV) || { echo "no cluster: run make cluster first" >&2; exit 1; }
	. $(CLUSTER_ENV) && $(PY) -m airflow_torchrun.demo --backend kubernetes
else
	$(PY) -m airflow_torchrun.demo
endif

# The Airflow UI (airflow standalone) and the MLflow UI on the demo's state; prints both URLs.
ui: $(STAMP)
	$(PY) -m airflow_torchrun.ui.serve

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy

# The fast loop (under 3 minutes): lint, types and the tests that start no process. The guard
# (tests/process_guard.py) fails any test it runs that starts one: such a test is marked `slow`.
# PYTEST_ARGS reaches pytest in both (e.g. PYTEST_ARGS="--durations=20" or "-k storage").
PYTEST_ARGS ?=
check: lint
	$(VENV)/bin/pytest -q -m "not slow" --forbid-processes --ignore=tests/e2e_k8s $(PYTEST_ARGS)

# Everything CI runs but the real cluster's suite: lint, types and the whole suite, spread over
# TEST_WORKERS (4) pytest-xdist workers: on 2 cores, because most tests wait (for a group, a
# standalone, a server restarting) as much as they compute. Measured on one machine, 2026-12-05: 2
# workers 1572 s, 4 workers 1324 s, both cores at least 85% busy (15 s samples) until the last
# minute. Tests that share a module's airflow standalone (or another costly fixture) stay on one
# worker (xdist_group, tests/conftest.py); each worker has its own Airflow home, state dir and
# servers. TEST_WORKERS=0 runs it in this one process. The e2e suite against the real cluster runs
# apart (make e2e-k8s): it needs make cluster.
TEST_WORKERS ?= 4
test: lint
	$(VENV)/bin/pytest -q --durations=10 $(if $(filter 0,$(TEST_WORKERS)),,-n $(TEST_WORKERS) --dist loadgroup) --ignore=tests/e2e_k8s $(PYTEST_ARGS)

# A real single-machine Kubernetes (cluster/): built from source once per version into
# ~/.cache/airflow-torchrun/cluster, started as host processes under .state/cluster.
cluster: $(STAMP)
	$(PY) -m cluster up

cluster-down: $(STAMP)
	$(PY) -m cluster down

cluster-status: $(STAMP)
	$(PY) -m cluster status

e2e-k8s: $(STAMP)
	$(VENV)/bin/pytest -q tests/e2e_k8s

# The fault matrix (tests/chaos): TRIALS per fault; the report goes to .state/chaos/report.md and .json.
# FAULTS runs only the faults whose name contains one of its comma-separated parts (case-insensitive),
# e.g. `make chaos TRIALS=20 FAULTS="kill -9 a"` (the random kills of a rank or agent);
# SEED replays the random steps and ranks of an earlier report (it prints its seed).
TRIALS ?= 3
FAULTS ?=
SEED ?=
chaos: $(STAMP)
	CHAOS_TRIALS=$(TRIALS) CHAOS_FAULTS="$(FAULTS)" $(if $(SEED),CHAOS_SEED=$(SEED)) $(VENV)/bin/pytest -q tests/chaos

# Every benchmark with its anchors (Ray Train in its own venv, .state/bench/ray-venv); the report
# goes to .state/bench/ and, published, to bench/results/ and the README. BENCH_ARGS=--quick: smoke run.
# CLUSTER=1: start the cluster of `make cluster` for the cluster rows only (then stop it), so that no
# control plane runs beside the other benchmarks; without it, those rows use a cluster already up.
BENCH_ARGS ?= --publish
bench: $(STAMP)
	$(PY) bench/run.py $(BENCH_ARGS) $(if $(filter 1,$(CLUSTER)),--cluster-up)

# The trainer image built from nothing (cached under .state/image-test) and the rendered pods of a
# 2-node Job run as containers of it; needs docker.io and debootstrap (see images/image_test.py).
image-test: $(STAMP)
	$(PY) images/image_test.py

clean:
	rm -rf .state
