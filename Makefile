# The two set-up commands of the README. Both build .venv on first use.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.meshpipe-installed

.PHONY: demo test test-slow test-all bench clean

# torch is installed first and pinned: an unpinned torch resolves the newest CUDA build.
$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet -e '.[test,hf,tb,data]'
	touch $(STAMP)

demo: $(STAMP)
	$(PY) -m meshpipe demo

# make test leaves out the tests marked slow (the longest end-to-end runs); make test-slow
# runs only those, make test-all everything. CI runs make test, then make test-slow.
test: $(STAMP)
	$(PY) -m pytest -q -m "not slow"

test-slow: $(STAMP)
	$(PY) -m pytest -q -m slow

test-all: $(STAMP)
	$(PY) -m pytest -q

bench: $(STAMP)
	$(PY) benchmarks/schedule_scale.py

clean:
	rm -rf $(VENV) $(GPU_VENV) out .pytest_cache .hypothesis

# One command for a GPU machine (docs/gpu.md). Nothing is installed or run unless
# nvidia-smi lists a GPU. The python is the first of: $(PY) (.venv) if its torch sees CUDA,
# $(PYTHON) (python3 on PATH) if its torch (>= 2.6) sees CUDA, else $(GPU_VENV), created with
# torch==2.13.0 from $(TORCH_INDEX_URL) (PyPI's Linux wheel is the CUDA build; for another
# CUDA version give e.g. TORCH_INDEX_URL=https://download.pytorch.org/whl/cu126). meshpipe
# itself is never installed: the source tree goes on PYTHONPATH, so no package index is
# touched on a machine that has what it needs (a missing package is one line naming it).
# Then pytest -m gpu, benchmarks/gpu_check.py $(GPU_CHECK_ARGS) and, with GPU_BENCH=1 (the
# default), benchmarks/gpu_bench.py $(GPU_BENCH_ARGS), benchmarks/gpu_bench_vision.py and
# benchmarks/moe_layer.py.
# Exit status 1 if any of them failed. make gpu-session finds its python the same way.
GPU_VENV ?= .venv-gpu
TORCH_INDEX_URL ?= https://pypi.org/simple
GPU_CHECK_ARGS ?=
GPU_BENCH_ARGS ?=
GPU_BENCH ?= 1
GPU_STAMP := $(GPU_VENV)/.meshpipe-installed
SEES_CUDA := import sys, torch; sys.exit(0 if torch.cuda.is_available() and tuple(map(int, torch.__version__.split(".")[:2])) >= (2, 6) else 1)
NEEDS := torch numpy matplotlib tqdm pytest hypothesis

define CUDA_PYTHON
if ! nvidia-smi -L 2>/dev/null | grep -q '^GPU '; then \
	echo "make $@: no NVIDIA GPU found on this machine (nvidia-smi lists none); nothing was installed or run"; \
	exit 0; \
fi; \
set -e; \
nvidia-smi -L; \
if [ -x $(PY) ] && $(PY) -c '$(SEES_CUDA)' 2>/dev/null; then \
	py=$(PY); \
elif command -v $(PYTHON) >/dev/null && $(PYTHON) -c '$(SEES_CUDA)' 2>/dev/null; then \
	py=$$(command -v $(PYTHON)); \
else \
	py=$(GPU_VENV)/bin/python; \
	if [ "$$(cat $(GPU_STAMP) 2>/dev/null)" != "$(TORCH_INDEX_URL)" ]; then \
		echo "make $@: no python here has a CUDA torch >= 2.6; installing torch==2.13.0 from $(TORCH_INDEX_URL) and the test packages into $(GPU_VENV)"; \
		$(PYTHON) -m venv $(GPU_VENV); \
		PIP_DEFAULT_TIMEOUT=20 $$py -m pip install --quiet --retries 1 --index-url $(TORCH_INDEX_URL) torch==2.13.0 || { echo "make $@: could not install torch from $(TORCH_INDEX_URL) (no network?); install a CUDA torch >= 2.6 for $(PYTHON) or into .venv" >&2; exit 1; }; \
		PIP_DEFAULT_TIMEOUT=20 $$py -m pip install --quiet --retries 1 numpy matplotlib tqdm pytest hypothesis transformers safetensors tokenizers; \
		echo "$(TORCH_INDEX_URL)" > $(GPU_STAMP); \
	fi; \
	if ! $$py -c '$(SEES_CUDA)'; then \
		echo "make $@: torch in $(GPU_VENV) does not see the GPU (a driver older than its CUDA build?); pick a CUDA build with TORCH_INDEX_URL=https://download.pytorch.org/whl/cuXYZ" >&2; \
		exit 1; \
	fi; \
fi; \
for package in $(NEEDS); do \
	$$py -c "import $$package" 2>/dev/null || { echo "make $@: $$py has no $$package; install it (pip install $$package)" >&2; exit 1; }; \
done; \
export PYTHONPATH="$(CURDIR)/src$${PYTHONPATH:+:$$PYTHONPATH}"; \
$$py -c 'import torch; print("make $@:", torch.__file__.rsplit("/torch/", 1)[0], "torch", torch.__version__, "CUDA", torch.version.cuda, "on", torch.cuda.device_count(), "x", torch.cuda.get_device_name(0))';
endef

.PHONY: gpu-check gpu-session
gpu-check:
	@$(CUDA_PYTHON) \
	status=0; \
	$$py -m pytest -q -m gpu -rs -p no:cacheprovider || status=1; \
	$$py benchmarks/gpu_check.py $(GPU_CHECK_ARGS) || status=1; \
	if [ "$(GPU_BENCH)" = 1 ]; then $$py benchmarks/gpu_bench.py $(GPU_BENCH_ARGS) || status=1; \
		$$py benchmarks/gpu_bench_vision.py || status=1; \
		$$py benchmarks/moe_layer.py || status=1; fi; \
	exit $$status

# The GPU session (benchmarks/gpu_session.py): what waits for a GPU, in order, within
# --budget-s, every result and log into --out ($OUT on a lent machine).
GPU_SESSION_ARGS ?=
gpu-session:
	@$(CUDA_PYTHON) \
	$$py benchmarks/gpu_session.py $(GPU_SESSION_ARGS)
