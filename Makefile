# Two entry points: `make demo` and `make test`. Each sets up what it needs first.
#
# The Python environment (.venv) is keyed by a hash of the requirement files: a second run with the same
# requirements installs nothing; a changed file updates the environment in place.

PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
REQUIREMENTS := requirements/pytorch.txt requirements/dlc-pytorch.txt requirements/test.txt \
                training/images/pytorch/requirements.txt
REQUIREMENTS_HASH := $(shell cat $(REQUIREMENTS) | sha256sum | cut -c1-16)
STAMP := $(VENV)/.requirements-$(REQUIREMENTS_HASH)
PROTO := training/data_service/data_service.proto

.PHONY: venv test demo bench lint proto clean

venv: $(STAMP)

$(STAMP):
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --disable-pip-version-check -r requirements/pytorch.txt
	@rm -f $(VENV)/.requirements-*
	@touch $@

test: venv
	$(PY) -m ruff check .
	$(PY) -m pytest

demo: venv
	$(PY) -m training.local.demo

bench: venv
	$(PY) bench/transport.py
	$(PY) bench/offload.py

lint: venv
	$(PY) -m ruff check .

# Regenerate the committed gRPC stubs after editing the .proto (a test fails when they are stale).
proto: venv
	$(PY) -m grpc_tools.protoc -I. \
		--python_out=. --grpc_python_out=. $(PROTO)

clean:
	rm -rf $(VENV) .pytest_cache
