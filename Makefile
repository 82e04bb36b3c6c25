# Everything a person runs. Each target sets up what it needs (virtualenv, packages, services).
SHELL := /bin/bash
.DEFAULT_GOAL := help

PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
SERVICES := deploy/local/services.sh
# Point every target at the local services unless the caller says otherwise.
LOCAL_ENV = eval "$$(OUTBOX_KEEP=1 $(SERVICES) env)";

.PHONY: help venv services services-stop cluster cluster-stop pg-ha pg-ha-stop migrate test test-spark-oldest test-unit test-fast demo bench soak conformance chaos chaos-ranges chaos-long lint serve publish clean tools lock audit

help:  ## list the targets
	@grep -hE '^[a-z-]+:.*## ' $(MAKEFILE_LIST) | awk -F':.*## ' '{printf "  make %-14s %s\n", $$1, $$2}'

LOCK = requirements-dev.lock

$(VENV)/.installed: pyproject.toml $(LOCK)
	@command -v $(PYTHON) >/dev/null || { echo "need $(PYTHON) (3.11+)"; exit 1; }
	@[ -x $(PY) ] || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip setuptools
	$(PY) -m pip install -q -c $(LOCK) -e '.[dev]'
	@touch $@

venv: $(VENV)/.installed  ## create the virtualenv and install the package with its test tools

# The oldest PySpark the writers support, in a virtualenv of its own (the lock pins the newest).
SPARK_OLDEST ?= 3.5.9
VENV_OLDEST  := .venv-spark35
$(VENV_OLDEST)/.installed: pyproject.toml $(LOCK)
	@[ -x $(VENV_OLDEST)/bin/python ] || $(PYTHON) -m venv $(VENV_OLDEST)
	$(VENV_OLDEST)/bin/python -m pip install -q --upgrade pip setuptools
	grep -v '^pyspark==' $(LOCK) > $(VENV_OLDEST)/constraints.txt
	$(VENV_OLDEST)/bin/python -m pip install -q -c $(VENV_OLDEST)/constraints.txt -e '.[dev]' 'pyspark==$(SPARK_OLDEST)'
	@touch $@

tools:  ## Java 17+, jq, promtool, chromium and chromium-driver (Debian packages when missing)
	@deploy/local/ensure-tools.sh

lock:  ## rewrite requirements-dev.lock from a fresh resolve, and the image's hashed lock (then make test)
	rm -rf .venv-lock && $(PYTHON) -m venv .venv-lock && .venv-lock/bin/pip install -q -e '.[dev]'
	{ sed -n 1,3p $(LOCK); .venv-lock/bin/pip freeze --exclude-editable | grep -v '^outbox-sink'; } > $(LOCK).new
	mv $(LOCK).new $(LOCK) && rm -rf .venv-lock
	$(PY) deploy/image_lock.py

audit: venv  ## known vulnerabilities in the locked dependencies (pip-audit; NOT RUN when its database is unreachable)
	@$(PY) -m pip install -q pip-audit >/dev/null 2>&1 || { echo "make audit: NOT RUN (pip-audit not installable)"; exit 0; }
	@out=$$($(PY) -m pip_audit -r $(LOCK) --no-deps --disable-pip --progress-spinner off 2>&1); rc=$$?; \
	echo "$$out"; \
	pins=$$(grep -c '==' $(LOCK)); skipped=$$(echo "$$out" | grep -c 'could not be audited'); \
	if [ "$$skipped" -ge "$$pins" ] || { [ $$rc -ne 0 ] && echo "$$out" | grep -qiE "connection|timed out|network"; }; then \
	  echo "make audit: NOT RUN (the vulnerability database could not be reached: $$skipped of $$pins packages skipped)"; exit 0; fi; \
	exit $$rc

services:  ## start RabbitMQ and PostgreSQL on 127.0.0.1 (idempotent)
	@$(SERVICES) start
	@$(SERVICES) status

services-stop:  ## stop the services that `make services` started
	@$(SERVICES) stop

cluster:  ## start a three-node RabbitMQ cluster on 127.0.0.1:5691-5693 (quorum queues; see deploy/local/cluster.sh)
	@deploy/local/cluster.sh start
	@deploy/local/cluster.sh env

cluster-stop:  ## stop the three-node cluster that `make cluster` started
	@deploy/local/cluster.sh stop

pg-ha:  ## start a PostgreSQL primary and synchronous standby (Patroni + etcd) on 127.0.0.1:5461-5462 (see deploy/local/pg-ha.sh)
	@deploy/local/pg-ha.sh start
	@deploy/local/pg-ha.sh env

pg-ha-stop:  ## stop the PostgreSQL HA pair and etcd that `make pg-ha` started
	@deploy/local/pg-ha.sh stop

migrate: venv services  ## create or upgrade the outbox schema (OUTBOX_DATABASE_URL, default local PostgreSQL)
	@$(LOCAL_ENV) $(VENV)/bin/outbox migrate

# Two workers (pytest-xdist): the tests wait on brokers, databases and processes more than they
# compute. A module, or modules sharing a slow or port-bound fixture, run on one worker
# (UNITS in tests/conftest.py).
# PYTEST_WORKERS=0 runs in one process.
PYTEST_WORKERS ?= 2
XDIST = $(if $(filter-out 0,$(PYTEST_WORKERS)),-n $(PYTEST_WORKERS) --dist loadscope)

test: venv services tools  ## run the whole test suite against the local services
	@$(VENV)/bin/pytest $(XDIST) $(PYTEST_ARGS)

# What differs between PySpark versions (the tests marked spark_api: the writers' use of the
# Spark API), on PostgreSQL; the rest of the Spark tests ran on the newest in make test.
test-spark-oldest: $(VENV_OLDEST)/.installed services tools  ## the version-specific Spark tests on the oldest supported PySpark (3.5)
	@$(VENV_OLDEST)/bin/pytest -m spark_api -k "not sqlite" tests/spark $(PYTEST_ARGS)

test-unit: venv  ## the pure tests: no service started, no Spark, seconds
	@$(VENV)/bin/pytest tests/unit -m "not spark and not slow and not chaos" $(PYTEST_ARGS)

test-fast: venv services tools  ## the suite without Spark, slow scenarios and the fault matrix
	@$(VENV)/bin/pytest $(XDIST) -m "not spark and not slow and not chaos" $(PYTEST_ARGS)

bench: venv services tools  ## measure the product against bare publishing loops (BENCH_SCALE=4 for bigger)
	@bench/ensure-jdbc.sh
	@$(LOCAL_ENV) $(PY) -m bench.run

soak: venv services tools  ## steady load for 30 min: latency per window, RSS, sizes, charts (SOAK_ARGS="--minutes 5")
	@$(LOCAL_ENV) $(PY) -m bench.soak $(SOAK_ARGS)

# The confirm core against generated broker schedules (tests/conformance; make test plays 150):
# the fake broker on loopback and a SQLite file per schedule, no service needed.
CONFORMANCE_EXAMPLES ?= 5000
conformance: venv  ## the confirm core over 5,000 generated broker schedules (CONFORMANCE_EXAMPLES=N)
	@CONFORMANCE_EXAMPLES=$(CONFORMANCE_EXAMPLES) $(VENV)/bin/pytest tests/conformance -p no:cacheprovider $(PYTEST_ARGS)

# The matrix starts (and stops) a RabbitMQ and a PostgreSQL of its own with $(SERVICES) on ports
# 5683/5443, data in .local/chaos: it stops and kills them, so it never touches the shared ones.
# Two lanes side by side, each on servers of its own (chaos/lanes.py): a scenario mostly waits.
CHAOS_LANES ?= 2
chaos: venv tools  ## fault matrix: every fault injected mid-flow, every message accounted (CHAOS_ARGS="--only 1,4 --rows 2000")
	@$(PY) -m chaos.run --lanes $(CHAOS_LANES) $(CHAOS_ARGS)

# The same matrix with every PostgreSQL publisher settling by ranges (issue 47, being built:
# docs/ranges-build.md); the matrix derives statuses from the ranges. Not part of CI until
# ranges become the default.
chaos-ranges: venv tools  ## the fault matrix with OUTBOX_SETTLEMENT=ranges (about 12 min)
	@CHAOS_SETTLEMENT=ranges $(PY) -m chaos.run --lanes $(CHAOS_LANES) $(CHAOS_ARGS)

# Not part of make chaos nor make test: each fault lasts minutes (17c-long: the quorum queue
# leaderless for 10 minutes; 18a/18b: the broker, then PostgreSQL, stopped for 10 minutes; 18c: a
# disk alarm for 3; CHAOS_LONG_OUTAGE / CHAOS_DISK_ALARM=seconds to change them; 19-long: the
# primary of the Patroni pair down 10 minutes with no promotion, CHAOS_PG_DOWN), or they add
# variants of a regular scenario (19d, 19e: a Spark write through a failover of the pair; 20b:
# the queue's leader cut off with the publisher; 21a: 5 publisher kills into a stream, which
# make test's test_streams.py proves too; 21a-c-long: 20 publisher kills, 10 broker kills
# and 3 stream-leader kills into a stream), run apart.
chaos-long: venv tools  ## the faults that last minutes, and variants (about 64 min; CHAOS_ARGS="--only 18a")
	@$(PY) -m chaos.run --long $(CHAOS_ARGS)

LINT_PATHS = $(wildcard app spark_writer migrations tests bench chaos)
lint: venv  ## ruff (lint and format) and mypy --strict on app/ and spark_writer/
	$(VENV)/bin/ruff check $(LINT_PATHS)
	$(VENV)/bin/ruff format --check $(LINT_PATHS)
	$(VENV)/bin/mypy app $(if $(wildcard spark_writer/*.py),spark_writer)

demo: venv tools  ## the main job end to end: Spark -> outbox (SQLite default) -> RabbitMQ, verified
	@rmq_was_up=$$($(SERVICES) status | grep -c '^rabbitmq: *running' || true); \
	pg_was_up=$$($(SERVICES) status | grep -c '^postgresql: *running' || true); \
	[ -n "$${OUTBOX_AMQP_URL:-}" ] || { $(SERVICES) start rabbitmq && eval "$$($(SERVICES) env | grep AMQP)"; }; \
	case "$${OUTBOX_DATABASE_URL:-}" in *127.0.0.1:5433*) $(SERVICES) start postgres ;; esac; \
	$(PY) -m app.demo $(DEMO_ARGS); rc=$$?; \
	if [ -z "$(KEEP_SERVICES)" ]; then \
	  [ "$$rmq_was_up" = 1 ] || $(SERVICES) stop rabbitmq; \
	  [ "$$pg_was_up" = 1 ] || $(SERVICES) stop postgres >/dev/null 2>&1; \
	fi; exit $$rc

clean:  ## remove the virtualenv, local service data and caches (stops the services first)
	-@$(SERVICES) stop
	rm -rf $(VENV) .local .pytest_cache .mypy_cache .ruff_cache .hypothesis outbox.db* demo-data
