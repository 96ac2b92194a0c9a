# The two set-up commands of the README. Both build .venv on first use.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.meshpipe-installed

.PHONY: demo test bench clean

# torch is installed first and pinned: an unpinned torch resolves the newest CUDA build.
$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet -e '.[test,hf]'
	touch $(STAMP)

demo: $(STAMP)
	$(PY) -m meshpipe demo

test: $(STAMP)
	$(PY) -m pytest -q

bench: $(STAMP)
	$(PY) benchmarks/schedule_scale.py

clean:
	rm -rf $(VENV) $(GPU_VENV) out .pytest_cache .hypothesis

# One command for a GPU machine (README "GPU check"). Nothing is installed or run unless
# nvidia-smi lists a GPU. It uses .venv when its torch sees CUDA, else $(GPU_VENV) with
# torch==2.13.0 from $(TORCH_INDEX_URL) (PyPI's Linux wheel is the CUDA build; for another
# CUDA version give e.g. TORCH_INDEX_URL=https://download.pytorch.org/whl/cu126), then runs
# pytest -m gpu, benchmarks/gpu_check.py $(GPU_CHECK_ARGS) and, with GPU_BENCH=1 (the
# default), benchmarks/gpu_bench.py. Exit status 1 if any of them failed.
GPU_VENV ?= .venv-gpu
TORCH_INDEX_URL ?= https://pypi.org/simple
GPU_CHECK_ARGS ?=
GPU_BENCH ?= 1
GPU_STAMP := $(GPU_VENV)/.meshpipe-installed
SEES_CUDA := import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)

.PHONY: gpu-check
gpu-check:
	@if ! nvidia-smi -L 2>/dev/null | grep -q '^GPU '; then \
		echo "make gpu-check: no NVIDIA GPU found on this machine (nvidia-smi lists none); nothing was installed or run"; \
		exit 0; \
	fi; \
	set -e; \
	nvidia-smi -L; \
	if [ -x $(PY) ] && $(PY) -c '$(SEES_CUDA)' 2>/dev/null; then \
		py=$(PY); \
	else \
		py=$(GPU_VENV)/bin/python; \
		if [ "$$(cat $(GPU_STAMP) 2>/dev/null)" != "$(TORCH_INDEX_URL)" ]; then \
			echo "make gpu-check: installing torch==2.13.0 from $(TORCH_INDEX_URL), then meshpipe[test,hf], into $(GPU_VENV)"; \
			$(PYTHON) -m venv $(GPU_VENV); \
			$$py -m pip install --quiet --index-url $(TORCH_INDEX_URL) torch==2.13.0; \
			$$py -m pip install --quiet -e '.[test,hf]'; \
			echo "$(TORCH_INDEX_URL)" > $(GPU_STAMP); \
		fi; \
		if ! $$py -c '$(SEES_CUDA)'; then \
			echo "make gpu-check: torch in $(GPU_VENV) does not see the GPU (a driver older than its CUDA build?); pick a CUDA build with TORCH_INDEX_URL=https://download.pytorch.org/whl/cuXYZ" >&2; \
			exit 1; \
		fi; \
	fi; \
	$$py -c 'import torch; print("make gpu-check: torch", torch.__version__, "CUDA", torch.version.cuda, "on", torch.cuda.device_count(), "x", torch.cuda.get_device_name(0))'; \
	status=0; \
	$$py -m pytest -q -m gpu -rs || status=1; \
	$$py benchmarks/gpu_check.py $(GPU_CHECK_ARGS) || status=1; \
	if [ "$(GPU_BENCH)" = 1 ]; then $$py benchmarks/gpu_bench.py || status=1; fi; \
	exit $$status
