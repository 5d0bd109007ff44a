# gradserve — the README's commands. Everything runs in .venv (made on first use).
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed-dev
HOST   ?= 127.0.0.1
PORT   ?= 50051
RESULTS ?= results/gpu-check

.PHONY: run test bench bench-tf proto lint docker gpu-check gpu-kit demo golden clean

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip

# The package (editable) with its test and lint tools; redone when pyproject changes.
$(STAMP): pyproject.toml | $(PY)
	$(PY) -m pip install -q -e '.[dev]'
	touch $@

run: $(STAMP)  ## set up and start the server on the CPU
	$(VENV)/bin/gradserve serve --host $(HOST) --port $(PORT) --device cpu

test: $(STAMP)  ## set up and run every test (CPU only)
	$(PY) -m pytest -m "not gpu"

# The benchmarks' own processes (their in-process rows) run OpenBLAS as the server
# process does (server/transport/entry.py): its threads sleep 0.35 ms after a call, not
# 0.1 s; the CPU forward's FUSED teams compute only so (kernels/lstm_cpu.py).
bench bench-tf: export OPENBLAS_THREAD_TIMEOUT ?= 20

bench: $(STAMP)  ## benchmarks (figures, not pass/fail)
	$(PY) -m tests.benchmarks.bench_core
	$(PY) -m tests.benchmarks.bench_lstm
	$(PY) -m tests.benchmarks.bench_formulations
	$(PY) -m tests.benchmarks.bench_load
	$(PY) -m tests.benchmarks.bench_concurrent_lstm
	$(PY) -m tests.benchmarks.bench_hostile
	$(PY) -m tests.benchmarks.bench_wire
	$(PY) -m tests.benchmarks.bench_tape

# TensorFlow is never a dependency: install it by hand into its own venv, then e.g.
#   make bench-tf TF_PYTHON=/tmp/tf/bin/python
bench-tf: $(STAMP)  ## our CPU LSTM vs TensorFlow's own BlockLSTM kernels, same inputs
	@test -n "$(TF_PYTHON)" || { echo "set TF_PYTHON to a python with tensorflow-cpu"; exit 2; }
	$(PY) -m tests.benchmarks.bench_lstm_vs_tf --tf-python $(TF_PYTHON)

proto: $(STAMP)  ## regenerate the committed stubs from protos/
	cd protos && ../$(PY) -m grpc_tools.protoc -I. --python_out=. --pyi_out=. \
		--grpc_python_out=. gradserve/v1/*.proto

lint: $(STAMP)  ## ruff, mypy (strict on the domain), import-linter (the layers)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy
	$(VENV)/bin/lint-imports

docker:  ## CPU and CUDA images
	docker build -f docker/Dockerfile -t gradserve:cpu .
	docker build -f docker/Dockerfile.cuda -t gradserve:cuda .

gpu-check:  ## on a CUDA machine: GPU tests + GPU benchmark into $(RESULTS)/
	@if [ -d .whl ]; then bash tests/gpu_check.sh $(RESULTS); else \
		$(MAKE) $(STAMP) && $(PY) -m pip install -q -e '.[dev,cuda]' && \
		PYTHON=$(PY) bash tests/gpu_check.sh $(RESULTS); fi

gpu-kit: $(STAMP)  ## wheels in .whl/ for an offline gpu-check (KIT_PYTHON=3.12 by default)
	bash tests/gpu_kit.sh

demo: $(STAMP)  ## start a local server, train the example LSTM worker against it
	$(VENV)/bin/gradserve serve --port 50071 --device auto > /tmp/gradserve-demo.log 2>&1 & \
	pid=$$!; trap "kill $$pid" EXIT; \
	for i in $$(seq 50); do $(VENV)/bin/gradserve health --port 50071 >/dev/null 2>&1 && break; sleep 0.2; done; \
	$(PY) examples/train_lstm_worker.py --target 127.0.0.1:50071

# TensorFlow is never a dependency: install it by hand into its own venv, then e.g.
#   make golden TF_PYTHON=/tmp/tf/bin/python
golden:  ## re-record our own TensorFlow vectors in tests/golden/ (V1 LSTM, traces, bad inputs, signatures, TF grad)
	@test -n "$(TF_PYTHON)" || { echo "set TF_PYTHON to a python with tensorflow-cpu"; exit 2; }
	cd tests/golden && for s in record_lstm_v1.py record_tensor_array_traces.py record_tensor_array_dtype_traces.py \
		record_lstm_errors.py record_raw_ops_signatures.py record_tf_registered_gradient.py \
		record_python_conversions.py record_tape_programs.py; do TF_CPP_MIN_LOG_LEVEL=3 $(TF_PYTHON) $$s || exit 1; done

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .ruff_cache results .whl
