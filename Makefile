# perigee: `make up` starts the local stack, `make test` runs every test.
SHELL := /bin/bash
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: install up test lint unit e2e clean

install: $(STAMP)

$(STAMP): pyproject.toml Makefile
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e '.[dev]'
	touch $(STAMP)

up: install
	$(BIN)/perigee up

lint: install
	$(BIN)/ruff check .

unit: install
	$(BIN)/pytest -q tests/unit

e2e: install
	$(BIN)/pytest -q tests/e2e

test: install lint
	$(BIN)/pytest -q tests

clean:
	rm -rf $(VENV) .perigee
