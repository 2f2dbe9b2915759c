# Two entry points: `make demo` and `make test`. Each sets up what it needs first.
#
# The Python environment (.venv) is keyed by a hash of the requirement files: a second run with the same
# requirements installs nothing; a changed file updates the environment in place.

PYTHON ?= python3
# Environments are installed by uv (about 10× faster than pip here: the whole .venv in about a minute
# from a warm network), itself installed into each environment by its pip, pinned.
UV_VERSION := 0.13.9
# $(call uv_install,VENV): uv pip install into that environment (arguments follow). Not quiet: uv shows
# what it resolves, downloads and installs (progress bars on a terminal), so a first install of a few
# minutes is seen to move.
uv_install = $(1)/bin/python -m pip install --quiet --disable-pip-version-check uv==$(UV_VERSION) && echo "installing into $(1) (uv; the first time takes a few minutes)" && $(1)/bin/uv pip install --python $(1)/bin/python
VENV := .venv
PY := $(VENV)/bin/python
# Horovod is built from source against the venv's TensorFlow (≈4 minutes on 2 cores); the wheel is kept
# in the user's cache (beside uv's), keyed by the build script and the TensorFlow pin, so a rebuilt venv or
# a fresh checkout reinstalls it without compiling. Only `make test` (and bench) need it: the demo's hosts
# run one trainer process each.
HOROVOD_BUILD := training/images/tensorflow/build-horovod.sh
WHEEL_CACHE ?= $(or $(XDG_CACHE_HOME),$(HOME)/.cache)/heterogeneous-training
HOROVOD_WHEELS := $(WHEEL_CACHE)/horovod-$(shell cat $(HOROVOD_BUILD) requirements/dlc-tensorflow.txt | sha256sum | cut -c1-16)
REQUIREMENTS := pyproject.toml requirements/dev.txt requirements/client.txt requirements/dlc-pytorch.txt requirements/xla.txt requirements/infra.txt requirements/test.txt requirements/docs.txt \
                requirements/dlc-tensorflow.txt training/images/pytorch/requirements.txt training/images/neuron/requirements.txt \
                training/images/tensorflow/requirements.txt $(HOROVOD_BUILD)
REQUIREMENTS_HASH := $(shell cat $(REQUIREMENTS) | sha256sum | cut -c1-16)
STAMP := $(VENV)/.requirements-$(REQUIREMENTS_HASH)
HOROVOD_STAMP := $(VENV)/.horovod-$(REQUIREMENTS_HASH)
PROTO := training/data_service/data_service.proto
# The client with the SageMaker Python SDK (hetero/sdk.py), apart: the SDK brings mlflow and pins of its own.
SDK_VENV := .venv-sdk
SDK_PY := $(SDK_VENV)/bin/python
SDK_STAMP := $(SDK_VENV)/.requirements-$(shell cat pyproject.toml requirements/client.txt requirements/sdk.txt requirements/sdk-test.txt | sha256sum | cut -c1-16)
# The template scanners (checkov, cfn-lint: tests/infra/test_template_scanners.py), apart: checkov pins dozens of its own.
SCAN_VENV := .venv-scan
SCAN_STAMP := $(SCAN_VENV)/.requirements-$(shell cat requirements/scan.txt | sha256sum | cut -c1-16)
NODE_STAMP := node_modules/.installed-$(shell cat package.json package-lock.json | sha256sum | cut -c1-16)
# jsii (under aws-cdk-lib) prints a banner on Node 20; the machine's Node is 20.
export JSII_SILENCE_WARNING_END_OF_LIFE_NODE_VERSION := 20

.PHONY: venv horovod sdk-venv scan-venv node test test-quick test-times demo docs docs-serve bench bench-gpu lint proto synth deploy clean

venv: $(STAMP)

horovod: $(HOROVOD_STAMP)

$(HOROVOD_STAMP): $(STAMP)
	@ls $(HOROVOD_WHEELS)/horovod-*.whl >/dev/null 2>&1 || $(HOROVOD_BUILD) $(PY) $(HOROVOD_WHEELS)
	$(VENV)/bin/uv pip install --quiet --python $(PY) --no-deps --reinstall $(HOROVOD_WHEELS)/horovod-*.whl
	@rm -f $(VENV)/.horovod-*
	@touch $@

node: $(NODE_STAMP)

sdk-venv: $(SDK_STAMP)

$(SDK_STAMP):
	@test -x $(SDK_PY) || $(PYTHON) -m venv $(SDK_VENV)
	$(call uv_install,$(SDK_VENV)) -r requirements/sdk-test.txt
	$(SDK_VENV)/bin/uv pip install --quiet --python $(SDK_PY) --no-deps -e .
	@rm -f $(SDK_VENV)/.requirements-*
	@touch $@

scan-venv: $(SCAN_STAMP)

$(SCAN_STAMP):
	@test -x $(SCAN_VENV)/bin/python || $(PYTHON) -m venv $(SCAN_VENV)
	$(call uv_install,$(SCAN_VENV)) -r requirements/scan.txt
	@rm -f $(SCAN_VENV)/.requirements-*
	@touch $@

$(NODE_STAMP):
	npm ci --no-audit --no-fund --loglevel=error
	@rm -f node_modules/.installed-*
	@touch $@

$(STAMP):
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(call uv_install,$(VENV)) --compile-bytecode -r requirements/dev.txt
	$(VENV)/bin/uv pip install --quiet --python $(PY) --no-deps --no-build-isolation -e .
	@rm -f $(VENV)/.requirements-*
	@touch $@

# The whole suite on two pytest-xdist workers (most of it waits: timers, moto's Step Functions interpreter,
# process start-ups; tests that share a port or a cluster run share an xdist_group). It writes each file's
# and the 30 slowest tests' times to build/test-times.json and fails past the budget pyproject.toml sets
# (time_budget_s, test_time_limit_s), naming the slowest; `make test-times` prints them as a table.
PYTEST_WORKERS ?= 2
PYTEST_PARALLEL := -n $(PYTEST_WORKERS) --dist loadgroup
test: venv horovod node sdk-venv scan-venv
	$(PY) -m ruff check .
	$(PY) -m pytest $(PYTEST_PARALLEL) --check-time-budget
	$(SDK_PY) -m pytest tests/sdk --confcutdir=tests/sdk -p no:cacheprovider --test-times build/test-times-sdk.json

# While developing (a few minutes): the unit, contract and infrastructure tests, no emulated cluster and
# none of the state machines' long waits. CI runs the whole suite.
test-quick: venv node
	$(PY) -m ruff check .
	$(PY) -m pytest $(PYTEST_PARALLEL) -m "not cluster and not slow" --test-times build/test-times-quick.json

test-times:
	$(PY) -m tests.timing build/test-times.json

demo: venv
	$(VENV)/bin/hetero demo
	$(VENV)/bin/hetero demo --variant tensorflow
	$(VENV)/bin/hetero demo --workload examples/workloads/augmented_cnn
	$(PY) app.py > /dev/null && echo "synthesized the platform stack into cdk.out/ (cdk-nag clean)"

# The docs site into build/site (warnings, broken links and anchors are errors); the generated reference
# pages first (docs/generate.py: the CLI from the Typer app, the settings from the validator and trainers).
docs: venv
	$(PY) docs/generate.py
	NO_MKDOCS_2_WARNING=1 $(PY) -m mkdocs build --strict

docs-serve: venv
	NO_MKDOCS_2_WARNING=1 $(PY) -m mkdocs serve

synth: venv node
	node_modules/.bin/cdk synth --quiet

# Builds the training images (Docker) and deploys. The DLC base images live in AWS's account
# 763104351884; log in to that registry in the target region first.
REGION ?= $(shell $(PY) -c "import json; print(json.load(open('cdk.json'))['context']['platform']['region'])")
deploy: venv node
	aws ecr get-login-password --region $(REGION) | docker login --username AWS --password-stdin 763104351884.dkr.ecr.$(REGION).amazonaws.com
	node_modules/.bin/cdk deploy --require-approval broadening

bench: venv
	$(PY) bench/transport.py
	$(PY) bench/offload.py
	$(PY) bench/preprocess.py
	$(PY) bench/loader.py --train-steps 400
	$(PY) -m training.local.sizing
	$(PY) bench/faults.py

# On a CUDA machine: the PyTorch trainer's defaults against fp32, then homogeneous against heterogeneous.
bench-gpu: venv
	$(PY) bench/gpu.py

lint: venv
	$(PY) -m ruff check .

# Regenerate the committed gRPC stubs after editing the .proto (a test fails when they are stale).
proto: venv
	$(PY) -m grpc_tools.protoc -I. \
		--python_out=. --grpc_python_out=. $(PROTO)

clean:
	rm -rf $(VENV) $(SDK_VENV) $(SCAN_VENV) node_modules cdk.out build .pytest_cache .cache
