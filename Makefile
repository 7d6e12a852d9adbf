# tpujob: `make demo` runs the main job locally, `make test` runs every test tier.
# Everything the targets need is installed by them; downloads and Go builds are cached by version
# under $(TPUJOB_CACHE) (default ~/.cache/tpujob), outside the repository.
SHELL := /bin/bash
export TPUJOB_CACHE ?= $(HOME)/.cache/tpujob
export PIP_CACHE_DIR ?= $(TPUJOB_CACHE)/pip
export UV_CACHE_DIR ?= $(TPUJOB_CACHE)/uv
# mypy's cache outside the clone: a clean clone checks only what changed (0.6 s where a cold run took 25).
export MYPY_CACHE_DIR ?= $(TPUJOB_CACHE)/mypy
# uv (PyPI) installs .venv: from its cache, 11-17 s on a clean clone where pip took 69-81 (every `make test` in CI).
UV_VERSION := 0.13.8
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
DEPS_STAMP := $(VENV)/.deps-$(shell cat requirements-dev.txt contract/pyproject.toml library/pyproject.toml operator/pyproject.toml trainer_image/pyproject.toml devcluster/pyproject.toml | sha1sum | cut -c1-12)
PYTEST_ARGS ?=
# make test: two pytest-xdist workers (the e2e tier, one devcluster, goes to one of them whole).
PYTEST_WORKERS ?= 2

.PHONY: setup venv binaries demo-binaries tools prometheus maxtext-venv checkov-venv docs-venv crds lint test test-unit test-integration test-trainer test-e2e sim up down demo bench bench-recovery bench-scale bench-elastic clean

setup: venv binaries tools prometheus

venv: $(DEPS_STAMP)
$(DEPS_STAMP):
	@echo "[venv] installing the Python packages into $(VENV) (the first time: a minute, then cached)"
	@start=$$SECONDS; test -x $(PY) || $(PYTHON) -m venv $(VENV); \
	$(PY) -m pip install -q uv==$(UV_VERSION) && \
	$(VENV)/bin/uv pip install -q --python $(PY) -r requirements-dev.txt \
	  -e contract -e 'library[flax]' -e operator -e trainer_image -e devcluster && \
	echo "[venv] ready in $$((SECONDS - start)) s"
	rm -f $(VENV)/.deps-* && touch $@

binaries:
	devcluster/build.sh >/dev/null

tools:
	devcluster/tools.sh >/dev/null

# Prometheus and promtool (Apache-2.0) from the Go module proxy: about 6 min once, cached by version.
prometheus:
	devcluster/prometheus.sh >/dev/null

# MaxText (PyPI, unchanged) in a Python 3.12 venv for the devcluster's MaxText image: 4-9 min and 2.2 GB
# once (downloads included, on 2 busy cores), then cached under $(TPUJOB_CACHE)/maxtext by version.
maxtext-venv:
	devcluster/maxtext_venv.sh >/dev/null

# checkov (PyPI) in its own Python 3.11 venv, so its dependencies never meet .venv's pins: about 1.5 min
# and 290 MB once, then cached under $(TPUJOB_CACHE)/checkov by version.
checkov-venv:
	devcluster/checkov_venv.sh >/dev/null

# mkdocs and mkdocs-material (PyPI) in their own Python 3.11 venv, for the docs site (mkdocs.yml): about
# 30 s and 170 MB once, then cached under $(TPUJOB_CACHE)/docs by version.
docs-venv:
	devcluster/docs_venv.sh >/dev/null

# checkov renders nothing itself: it reads the chart as helm renders it, with the defaults and with every
# optional object on. Skips, each with its reason: .checkov.yaml. Offline: no API key (BC_API_KEY unset,
# HOME an empty folder so no ~/.bridgecrew/credentials), no guideline or policy download, no version check.
CHECKOV_FEATURES := --set kueue.enabled=true --set 'watchNamespaces={a,b}' --set metrics.serviceMonitor.enabled=true \
  --set metrics.prometheusRule.enabled=true --set metrics.dashboard.enabled=true \
  --set 'spares.pools[0].name=v5e' --set 'spares.pools[0].accelerator=tpu-v5-lite-podslice' \
  --set 'spares.pools[0].topology=2x2' --set 'spares.pools[0].hosts=1'

crds: venv
	$(PY) -m tpujob_operator.crd
	$(PY) -m tpujob_operator.apidocs

lint: venv tools prometheus checkov-venv docs-venv
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy
	$(PY) -m tpujob_operator.crd --check
	$(PY) -m tpujob_operator.apidocs --check
	$(VENV)/bin/hadolint Dockerfile trainer_image/Dockerfile examples/own-loop/Dockerfile
	unformatted="$$(gofmt -l trainer_image/init)" && test -z "$$unformatted" || { echo "gofmt: $$unformatted"; exit 1; }
	cd trainer_image/init && go vet ./...
	rendered="$$(mktemp -d)" && trap 'rm -rf "$$rendered"' EXIT && helm="$$(devcluster/tools.sh)/helm" && \
	NO_MKDOCS_2_WARNING=1 "$$(devcluster/docs_venv.sh)/mkdocs" build --strict --site-dir "$$rendered/site" && rm -rf "$$rendered/site" && \
	"$$helm" template tpujob charts/tpujob -n tpujob-system > "$$rendered/default.yaml" && \
	"$$helm" template tpujob charts/tpujob -n tpujob-system $(CHECKOV_FEATURES) > "$$rendered/features.yaml" && \
	"$$helm" template tpujob charts/tpujob --set metrics.prometheusRule.enabled=true -s templates/prometheusrule.yaml | \
	  $(PY) -c 'import sys, yaml; print(yaml.safe_dump(yaml.safe_load(sys.stdin)["spec"]))' > "$$rendered/rules.yml" && \
	"$$(devcluster/prometheus.sh)/promtool" check rules "$$rendered/rules.yml" && rm "$$rendered/rules.yml" && \
	mkdir "$$rendered/home" && env -u BC_API_KEY HOME="$$rendered/home" BC_SKIP_MAPPING=TRUE \
	  CKV_SKIP_PACKAGE_UPDATE_CHECK=TRUE "$$(devcluster/checkov_venv.sh)" --config-file .checkov.yaml \
	  -d "$$rendered" --framework kubernetes --skip-download --quiet --compact

# One tier alone: test-unit, test-integration, test-trainer, test-e2e.
test: setup lint maxtext-venv
	$(PY) -m pytest -n $(PYTEST_WORKERS) --dist loadgroup --durations=25 $(PYTEST_ARGS)

test-unit: venv
	$(PY) -m pytest tests/unit $(PYTEST_ARGS)

test-integration: setup
	$(PY) -m pytest tests/integration $(PYTEST_ARGS)

test-trainer: venv
	$(PY) -m pytest tests/trainer $(PYTEST_ARGS)

test-e2e: setup maxtext-venv
	$(PY) -m pytest tests/e2e $(PYTEST_ARGS)

# The simulation tier alone, as large as you like (make test runs 2,000 derandomized schedules):
# docs/concepts/invariants.md. SEED unset: the same schedules every run.
SCHEDULES ?= 20000
SEED ?=
sim: venv
	SIM_SCHEDULES=$(SCHEDULES) SIM_SEED=$(SEED) $(PY) -m pytest tests/sim $(PYTEST_ARGS)

up: setup
	$(PY) -m tpujob_devcluster up

down: venv
	$(PY) -m tpujob_devcluster down

# Only what the demo runs (no Kueue, no Prometheus), the venv's downloads beside Go's builds.
demo:
	@$(MAKE) --no-print-directory -j3 venv tools demo-binaries
	$(PY) -m tpujob_devcluster demo

demo-binaries:
	COMPONENTS=devcluster devcluster/build.sh >/dev/null

bench: venv
	$(PY) bench/checkpoint_policies.py

# Before/after in one run: the pre-issue-8 operator and trainer (a740187) alternate with this tree's.
RECOVERY_ARGS ?= --baseline-rev a740187 --rounds 3 --failures 5
bench-recovery: setup
	$(PY) bench/recovery.py $(RECOVERY_ARGS)

# The operator with 10 -> 100 -> 1,000 TrainingJobs (stub trainers); SCALE_ARGS=--operator-rev 1a1c00d for before.
SCALE_ARGS ?=
bench-scale: setup
	$(PY) bench/operator_scale.py $(SCALE_ARGS)

# Goodput over a scripted capacity loss, spec.elastic against waiting, side by side in one run.
ELASTIC_ARGS ?=
bench-elastic: setup
	$(PY) bench/elastic.py $(ELASTIC_ARGS)

clean: down
	rm -rf .devcluster
