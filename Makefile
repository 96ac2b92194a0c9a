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
	$(PY) -m pip install --quiet -e '.[test]'
	touch $(STAMP)

demo: $(STAMP)
	$(PY) -m meshpipe demo

test: $(STAMP)
	$(PY) -m pytest -q

bench: $(STAMP)
	$(PY) benchmarks/schedule_scale.py

clean:
	rm -rf $(VENV) out .pytest_cache .hypothesis
