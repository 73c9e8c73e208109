# The two commands a user types: `make demo` and `make test`. Both install first when needed.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-v2
BACKEND ?= $(or $(HP_BACKEND),torch)

.PHONY: install demo example test bench torch-compat clean

install: $(STAMP)

# Idempotent: re-runs only when the project's dependency list changes.
$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q "torch==2.13.0" || $(PY) -m pip install -q "torch>=2.13,<=2.14.1"
	$(PY) -m pip install -q "mindspore==2.10.0" "numpy<2"
	$(PY) -m pip install -q -e ".[test,bench]"
	touch $(STAMP)

demo: install
	HP_BACKEND=$(BACKEND) $(PY) examples/train_mlp.py --nproc 2

# ~13M-parameter Llama-style model, 120 steps on 2 CPU ranks (a few minutes), checkpoints
# every 60 steps and the loss curve in runs/train_lm/; EXAMPLE_ARGS adds train_lm.py options
example: install
	$(PY) examples/train_lm.py --backend $(BACKEND) --nproc 2 --ckpt-every 60 $(EXAMPLE_ARGS)

test: install
	$(PY) -m pytest -q

bench: install
	$(PY) benchmarks/run.py $(BENCH_ARGS)

# The demo and the torch half of the suite under another torch release, in a venv of its
# own (.venv-torch-$(TORCH), without MindSpore): pyproject.toml's torch range is what the
# suite has passed at both ends (2.13.0 is .venv's). TORCH_COMPAT_ARGS adds pytest options.
TORCH ?= 2.14.1
torch-compat:
	PYTHON=$(PYTHON) tools/torch_compat.sh $(TORCH) $(TORCH_COMPAT_ARGS)

clean:
	rm -rf $(VENV) .venv-torch-* .pytest_cache
