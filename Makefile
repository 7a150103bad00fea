# The two commands of the README, plus the pieces they are made of.
.PHONY: up test bench proto kernels

VENV := .venv
# What setup.sh builds from: a change to any of them reruns it (the kernels' build is incremental).
SETUP_INPUTS := pyproject.toml setup.py scripts/setup.sh $(wildcard protos/shardline/v1/*.proto) \
	$(wildcard gpu_worker_svc/model/layers/kernels/*.cpp gpu_worker_svc/model/layers/kernels/*.h \
	gpu_worker_svc/model/layers/kernels/*.inc)

# `make up` installs what serving needs; `make test` adds the test tools and Chromium.
$(VENV)/.serve: $(SETUP_INPUTS)
	./scripts/setup.sh serve
	touch $@

$(VENV)/.test: $(SETUP_INPUTS)
	./scripts/setup.sh test
	touch $@ $(VENV)/.serve

up: $(VENV)/.serve
	$(VENV)/bin/shardline up

test: $(VENV)/.test
	$(VENV)/bin/python -m pytest -q -p no:cacheprovider --durations=15

proto: $(VENV)/.serve
	$(VENV)/bin/python -m shardline.protogen

kernels: $(VENV)/.serve
	$(VENV)/bin/python -m gpu_worker_svc.model.layers.kernels.kernel_build

bench: $(VENV)/.test
	$(VENV)/bin/python -m benchmarks.engine_vs_hf
	$(VENV)/bin/shardline bench --launch --engine
