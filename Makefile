# The README's two commands: `make demo` and `make test`. Each builds .venv from nothing if needed.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
# The CPU build of torch (a bare `torch` resolves to a multi-GB CUDA build).
TORCH_PIN := torch==2.13.0
# The Airflow release this is tested on (the package accepts any 3.3+; unpinned, pip may settle lower).
AIRFLOW_PIN := apache-airflow==3.3.2

export AIRFLOW_HOME ?= $(CURDIR)/.state/airflow
export AIRFLOW__CORE__DAGS_FOLDER ?= $(CURDIR)/dags
export AIRFLOW__CORE__LOAD_EXAMPLES ?= False
export AIRFLOW__TORCHRUN__STATE_DIR ?= $(CURDIR)/.state/torchrun

.PHONY: demo test lint install clean bench chaos image-test ui

$(STAMP): pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet "$(TORCH_PIN)"
	$(PY) -m pip install --quiet -e ".[airflow,worker,s3,mlflow,examples,ecosystem,dev]" "$(TORCH_PIN)" "$(AIRFLOW_PIN)"
	# setuptools leaves the metadata in the source root too; on sys.path through the editable
	# install it makes Airflow see the distribution twice ("Plugin ... already registered").
	rm -rf operators/*.egg-info
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(PY) -m airflow_torchrun.demo

# The Airflow UI (airflow standalone) and the MLflow UI on the demo's state; prints both URLs.
ui: $(STAMP)
	$(PY) -m airflow_torchrun.ui.serve

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy

test: lint
	$(VENV)/bin/pytest -q

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
BENCH_ARGS ?= --publish
bench: $(STAMP)
	$(PY) bench/run.py $(BENCH_ARGS)

# The trainer image built from nothing (cached under .state/image-test) and the rendered pods of a
# 2-node Job run as containers of it; needs docker.io and debootstrap (see images/image_test.py).
image-test: $(STAMP)
	$(PY) images/image_test.py

clean:
	rm -rf .state
