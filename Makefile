# Two commands do all the set-up on a fresh machine:
#   make demo   builds .venv and fine-tunes the built-in model on the CPU
#   make test   builds .venv and runs the test suite
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: test test-kernels demo lint venv clean mutants

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# torch first and pinned: 2.13.0 is the CPU wheel on disk; an unpinned torch pulls a CUDA build
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e ".[test,diffusers,ocr]"
	touch $(STAMP)

venv: $(STAMP)

test: $(STAMP)
	$(PY) -m pytest -q

# the suite three times, with torch's CPU kernels forced to the plainest, to AVX2 and left at this
# CPU's best (docs/testing.md): a tolerance must not depend on the CPU (~3 × make test; not in CI)
test-kernels: $(STAMP)
	ATEN_CPU_CAPABILITY=default $(PY) -m pytest -q
	ATEN_CPU_CAPABILITY=avx2 $(PY) -m pytest -q
	$(PY) -c "import torch; print('best kernels:', torch.backends.cpu.get_cpu_capability())"
	$(PY) -m pytest -q

lint: $(STAMP)
	$(VENV)/bin/ruff check flowcredit tests benchmarks
	$(VENV)/bin/ruff format --check flowcredit tests benchmarks

mutants: $(STAMP)  # does the suite notice a broken loop? (docs/testing.md; ~8 min)
	$(PY) benchmarks/mutants/mutants.py

demo: $(STAMP)
	$(PY) -m flowcredit demo

clean:
	rm -rf $(VENV)
