# Two entry points, both from a fresh clone: `make demo` (the main job) and `make test`.
PYTHON ?= python3.11
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
STAMP := $(VENV)/.installed

.PHONY: demo test lint format bench-codec clean

$(STAMP): requirements.txt constraints.txt pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q -c constraints.txt torch==2.13.0
	$(PIP) install -q -c constraints.txt --no-deps fbgemm-gpu-cpu==1.8.0 torchrec==1.8.0
	$(PIP) install -q -c constraints.txt -r requirements.txt
	$(PIP) install -q -c constraints.txt --no-deps triton==3.7.1
	$(PIP) install -q -c constraints.txt --no-deps -e .
	touch $(STAMP)

# The main job: the DLRM example on its embedded synthetic default, 2 processes, CPU (gloo),
# planned for a 1 Gbit/s link between the ranks (the netns cluster's): there comms.format auto
# picks the codec; on the bare localhost it would pick raw, and the plan says so.
demo: $(STAMP)
	$(VENV)/bin/torchrun --standalone --nproc_per_node=2 examples/dlrm_criteo.py --link-gbit 1

test: $(STAMP)
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/ruff check .
	$(PY) -m pytest --durations=15

bench-codec: $(STAMP)
	$(PY) benchmarks/codec_bench.py

clean:
	rm -rf $(VENV)
