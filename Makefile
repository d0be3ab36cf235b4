# Trainyard — the two commands a newcomer needs: `make run` and `make test`.
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
GEN_STAMP := gen/.stamp
PROTOS := $(shell find proto -name '*.proto')
BENCH ?=

.PHONY: run test lint bench proto deps etcd clean help

help:
	@echo "make run    start a local cluster (etcd, scheduler, checkpoint-store, gateway, 2 simulated nodes)"
	@echo "make test   run the test suite (installs what it needs first)"
	@echo "make lint   ruff + mypy"
	@echo "make bench  run every benchmark in bench/ (BENCH=name runs one)"
	@echo "make chaos  the long chaos run: random faults against a local cluster (CHAOS_DURATION_S=900, CHAOS_SEED=n replays)"
	@echo "make proto  regenerate gen/ from proto/"

deps: $(STAMP) etcd

$(STAMP): pyproject.toml requirements.lock
	@$(PYTHON) -c 'import sys; sys.exit(0 if sys.version_info >= (3, 11) else 1)' || \
	  { echo "Trainyard needs Python >= 3.11 (found $$($(PYTHON) --version 2>&1)). Install python3.11 or set PYTHON=..."; exit 1; }
	@test -x $(PY) || $(PYTHON) -m venv $(VENV) || \
	  { echo "cannot create a virtual environment: install the python3-venv package (apt-get install python3-venv)"; exit 1; }
	@# gen/ must exist before the editable install, or the install does not map the generated package.
	$(PY) -m pip install --quiet --disable-pip-version-check -c requirements.lock grpcio-tools mypy-protobuf
	@set -o pipefail; $(PY) tools/gen_proto.py 2>&1 | { grep -v "^Writing mypy to" || true; }
	$(PY) -m pip install --quiet --disable-pip-version-check -c requirements.lock -e '.[dev]'
	@touch $(STAMP)

etcd:
	@if command -v etcd >/dev/null 2>&1 || test -x /usr/bin/etcd; then exit 0; fi; \
	if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
	  echo "installing etcd-server with apt-get ..."; \
	  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq etcd-server) >/dev/null || \
	    { echo "apt-get could not install etcd-server"; exit 1; }; \
	else \
	  echo "etcd is missing. Install the Debian package: sudo apt-get install -y etcd-server"; exit 1; \
	fi

$(GEN_STAMP): $(PROTOS) tools/gen_proto.py $(STAMP)
	@set -o pipefail; $(PY) tools/gen_proto.py 2>&1 | { grep -v "^Writing mypy to" || true; }
	@touch $(GEN_STAMP)

proto: $(GEN_STAMP)

run: deps proto
	$(VENV)/bin/trainyard local up

test: deps proto
	$(PY) -m pytest; rc=$$?; if [ $$rc -eq 5 ]; then echo "pytest collected no tests"; exit 1; fi; exit $$rc

lint: deps proto
	$(VENV)/bin/ruff check .
	$(VENV)/bin/mypy libs services/scheduler/trainyard_scheduler services/node-agent/trainyard_agent \
	  services/checkpoint-store/trainyard_checkpoint services/gateway/trainyard_gateway

bench: deps proto
	$(PY) -m bench $(BENCH)

# The bounded chaos run (about 3 minutes) is part of `make test`; this is the long one.
CHAOS_DURATION_S ?= 900
.PHONY: chaos
chaos: deps proto
	CHAOS_DURATION_S=$(CHAOS_DURATION_S) $(PY) -m pytest tests/chaos

clean:
	rm -rf gen .trainyard .pytest_cache .mypy_cache .ruff_cache bench/results
