# The two commands a new user runs: `make single-node-test` and `make test`.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
MODEL ?= models/tiny
DATA ?= data/sample
STEPS ?= 5
RESOLUTION ?= 0
METHOD ?= textual_inversion
OUT ?= $(METHOD)_output

.PHONY: venv venv-ipex single-node-test test test-fast test-ipex bench lint clean

# The venv is (re)made when pyproject.toml changes; torch is pinned to the CPU build there.
# `make test` builds the IPEX venv at the same time, and both editable installs write build/ and
# xeontune.egg-info here: they take turns on a lock (flock, where the system has it).
LOCK := $(if $(shell command -v flock),flock pyproject.toml)
$(BIN)/xeontune: pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(LOCK) $(BIN)/python -m pip install --quiet -e '.[dev]'
	touch $@

venv: $(BIN)/xeontune

single-node-test: venv
	HF_HUB_OFFLINE=1 $(BIN)/python scripts/single_node_test.py --model $(MODEL) --data $(DATA) --steps $(STEPS) --resolution $(RESOLUTION) --method $(METHOD) --output-dir $(OUT)

# Installs what the tests need (system packages too when run as root; the venvs), then runs them all:
# the main suite, then the IPEX tests in their own venv (SKIP_IPEX=1 leaves those out locally).
# Every suite runs even when an earlier one fails; the exit code is non-zero if any failed.
test:
	scripts/run-tests.sh

# The fast subset: no training runs, no clusters.
test-fast: venv
	HF_HUB_OFFLINE=1 $(BIN)/python -m pytest -q -m "not slow"

test-ipex:
	scripts/test-ipex.sh

# torch 2.8 + IPEX 2.8 in .venv-ipex (use it as .venv-ipex/bin/xeontune), optional: on an AMX Xeon
# stock torch with packed weights, the default, was faster than IPEX (docs/performance.md).
venv-ipex:
	scripts/ipex-venv.sh

bench: venv
	HF_HUB_OFFLINE=1 $(BIN)/xeontune bench --model sd15-arch --resolution 256 --batch-size 1 --steps 5

lint: venv
	$(BIN)/ruff check xeontune tests scripts

clean:
	rm -rf textual_inversion_output lora_output build dist *.egg-info
