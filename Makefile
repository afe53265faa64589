# The two commands of the README. Each creates the Python 3.12 environment (.venv) if missing.
PY = $(shell ./scripts/env)

.PHONY: demo test gpu-wheels
demo:  ## dry-run plan of a real recipe with overlays (CPU is enough)
	$(PY) train.py recipe=llama3_70b_pretrain '+mem=[expandable_segments,selective_recompute,dist_optimizer]' run.dry_run=true

test:  ## the whole CPU test suite (what CI runs), on one pytest-xdist worker per core (at most 4)
	$(PY) -m pytest -n auto --maxprocesses 4

gpu-wheels:  ## the wheels scripts/gpu_check carries to a GPU machine (requirements/gpu.lock), with their size
	scripts/gpu_wheels
