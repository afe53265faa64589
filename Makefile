# The two commands of the README. Each creates the Python 3.12 environment (.venv) if missing.
PY = $(shell ./scripts/env)

.PHONY: demo test gpu-wheels
demo:  ## dry-run plan of a real recipe with overlays (CPU is enough)
	$(PY) train.py recipe=llama3_70b_pretrain '+mem=[expandable_segments,selective_recompute,dist_optimizer]' run.dry_run=true

# Compiled bytecode is kept (in .venv/pycache) even where PYTHONDONTWRITEBYTECODE is set, as on the CI host: the venv
# is installed without .pyc files, so otherwise every process compiles what it imports from source again, each
# worker's `import megatron.bridge` (36 -> 17 CPU-s) and each of the suite's child processes (`mbmem list` 0.50 ->
# 0.18 CPU-s, `train.py --help` 3.3 -> 1.1, `import torch` 5.7 -> 2.6). What the last run compiled under /tmp (the
# packages tests install into temporary folders) is dropped first, so the folder does not grow run after run.
PYCACHE_DIR = $(CURDIR)/.venv/pycache
PYCACHE = PYTHONDONTWRITEBYTECODE= PYTHONPYCACHEPREFIX=$(PYCACHE_DIR)

test:  ## the whole CPU test suite (what CI runs), on one pytest-xdist worker per core (at most 4)
	rm -rf $(PYCACHE_DIR)/tmp
	$(PYCACHE) $(PY) -m pytest -n auto --maxprocesses 4

gpu-wheels:  ## the wheels scripts/gpu_check carries to a GPU machine (requirements/gpu.lock), with their size
	scripts/gpu_wheels
