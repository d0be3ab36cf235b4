# Trainyard — the two commands a newcomer needs: `make run` and `make test`.
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
GEN_STAMP := gen/.stamp
PROTOS := $(shell find proto -name '*.proto')
BENCH ?=

.PHONY: run test lint bench proto deps sysdeps-run sysdeps-test clean help

help:
	@echo "make run    start a local cluster (etcd, scheduler, checkpoint-store, gateway, 2 simulated nodes)"
	@echo "make test   run the test suite (installs what it needs first)"
	@echo "make lint   ruff + mypy"
	@echo "make bench  run every benchmark in bench/ (BENCH=name runs one)"
	@echo "make chaos  the long chaos run: random faults against a local cluster (CHAOS_DURATION_S=900, CHAOS_SEED=n replays)"
	@echo "make proto  regenerate gen/ from proto/"
	@echo "make certs  a development CA and certificates for deploy/ under deploy/pki/ (NODES=\"gpu-01 gpu-02\")"

deps: $(STAMP) sysdeps-run

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

# System packages (Debian): installed when missing and root, else the exact apt-get command is printed.
sysdeps-run:
	@bash tools/sysdeps.sh run

sysdeps-test:
	@bash tools/sysdeps.sh test

$(GEN_STAMP): $(PROTOS) tools/gen_proto.py $(STAMP)
	@set -o pipefail; $(PY) tools/gen_proto.py 2>&1 | { grep -v "^Writing mypy to" || true; }
	@touch $(GEN_STAMP)

proto: $(GEN_STAMP)

run: deps proto
	$(VENV)/bin/trainyard local up

test: deps sysdeps-test proto
	$(PY) -m pytest --durations=15; rc=$$?; if [ $$rc -eq 5 ]; then echo "pytest collected no tests"; exit 1; fi; exit $$rc

lint: deps proto
	$(VENV)/bin/ruff check .
	$(VENV)/bin/mypy libs services/scheduler/trainyard_scheduler services/node-agent/trainyard_agent \
	  services/checkpoint-store/trainyard_checkpoint services/gateway/trainyard_gateway

bench: deps sysdeps-test proto
	$(PY) -m bench $(BENCH)

# The bounded chaos run (70 s of faults, about 2 minutes) is part of `make test`; this is the long one.
CHAOS_DURATION_S ?= 900
.PHONY: chaos
chaos: deps proto
	CHAOS_DURATION_S=$(CHAOS_DURATION_S) $(PY) -m pytest tests/chaos

# A development PKI for deploy/ (docs/security.md says how to bring your own CA instead): the services, a
# tool certificate for operators' scripts, one certificate per node named in NODES, and the job issuer the
# scheduler mints workers' checkpoint-store credentials with. Idempotent.
NODES ?=
.PHONY: certs
# etcd's server certificate names ETCD_HOSTS; etcd-user-trainyard (the services) and etcd-user-root (the
# operator's etcdctl) are client certificates whose CN is the etcd user (docs/security.md, etcd).
ETCD_HOSTS ?= etcd1 etcd2 etcd3
certs: deps
	$(PY) -m trainyard_core.security.pki --dir deploy/pki --job-issuer scheduler gateway checkpoint-store tool/admin \
	  $(foreach n,$(NODES),node/$(n)) --etcd-client trainyard --etcd-client root $(foreach h,$(ETCD_HOSTS),--etcd-server-dns $(h))

clean:
	rm -rf gen .trainyard .pytest_cache .mypy_cache .ruff_cache bench/results
