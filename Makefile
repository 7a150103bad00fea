# The two commands of the README, plus the pieces they are made of.
.PHONY: setup up test bench proto

VENV := .venv
STAMP := $(VENV)/.installed

setup: $(STAMP)

$(STAMP): pyproject.toml scripts/setup.sh
	./scripts/setup.sh
	touch $@

proto: setup
	$(VENV)/bin/python -m shardline.protogen

up: setup
	$(VENV)/bin/shardline up

test: setup
	$(VENV)/bin/python -m pytest -q -p no:cacheprovider --durations=15

bench: setup
	$(VENV)/bin/python -m benchmarks.engine_vs_hf
	$(VENV)/bin/shardline bench --launch --engine
