# Self-documenting Makefile: `make help` lists the targets.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
# Caches live inside the repo so runs never write to unknown places.
export XDG_CACHE_HOME ?= $(CURDIR)/.cache
export TORCHINDUCTOR_CACHE_DIR ?= $(CURDIR)/.cache/inductor
export TRITON_CACHE_DIR ?= $(CURDIR)/.cache/triton
export TORCH_EXTENSIONS_DIR ?= $(CURDIR)/.cache/torch_extensions
export PIP_DISABLE_PIP_VERSION_CHECK := 1

.DEFAULT_GOAL := help
.PHONY: help venv venv211 train test test-slow test-gpu test-slurm libaio gpu-pass gpu-stamp gpu-publish gpu-wheels lint bench bench-strategies bench-nvme bench-attention bench-optimizers bench-recompute bench-pipeline profile experiments experiments-gpu clean

help: ## list the targets
	@grep -E '^[a-z0-9-]+:.*## ' $(MAKEFILE_LIST) | awk -F':.*## ' '{printf "  %-17s %s\n", $$1, $$2}'

$(STAMP): requirements.txt requirements-test.txt constraints.txt pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -c constraints.txt -r requirements.txt -r requirements-test.txt
	$(PY) -m pip install -q --no-deps -e .
	touch $(STAMP)

venv: $(STAMP) ## create .venv with the pinned requirements (torch held by constraints.txt)

# torch 2.11 beside the pinned one, for op_sac's 2.11-only path (tests/test_private_apis.py,
# docs/torch_versions.md): PyPI's torch 2.11.0 is its CUDA 13 build (about 5 GB with its CUDA
# libraries, no pip cache kept) and runs on CPU. The other pins are only what that test imports.
VENV211 := .cache/venv211
TORCH211_WITH := hydra-core|omegaconf|numpy|psutil|rich|tokenizers|xxhash|pytest|pytest-timeout
$(VENV211)/.installed: requirements.txt
	$(PYTHON) -m venv --clear $(VENV211)
	$(VENV211)/bin/python -m pip install -q --no-cache-dir torch==2.11.0 \
		$$(grep -E '^($(TORCH211_WITH))==' requirements.txt | cut -d' ' -f1)
	touch $@

venv211: $(VENV211)/.installed ## .cache/venv211: torch 2.11 for the slow test of op_sac's 2.11 path

train: $(STAMP) ## run the default training (small GPT, BPE, standard-library corpus)
	$(PY) train.py $(ARGS)

test: $(STAMP) ## the fast test suite (CI runs this)
	$(PY) -m pytest -m "not slow and not gpu" --durations=25 $(ARGS)

test-slow: $(STAMP) ## the slow tests (longer runs, bigger shapes); SHARD=checkpoints|parallel|training runs a third
	files=$$($(PY) scripts/slow_shards.py $(SHARD)) && $(PY) -m pytest -m "slow and not gpu" $$files $(ARGS)

test-gpu: $(STAMP) ## the CUDA tests (needs a GPU)
	$(PY) -m pytest -m gpu $(ARGS)

test-slurm: $(STAMP) ## the Slurm tests on a one-host cluster they start and stop (apt-installs slurm-wlm if missing)
	command -v slurmctld >/dev/null || { apt-get update -qq && apt-get install -y -qq slurm-wlm; }
	$(PY) -m pytest -m slurm $(ARGS)

# DeepSpeed's NVMe offload swaps with its async_io op, JIT-built against libaio's headers and
# library (docs/zero.md, "DeepSpeed's NVMe offload, the peer"); pip cannot provide them.
libaio: ## libaio for DeepSpeed's NVMe offload (apt-installs libaio-dev if missing)
	test -e /usr/include/libaio.h || { apt-get update -qq && apt-get install -y -qq libaio-dev; }

# The GPU pass: PART=1|2 (default both), OUT=folder, DRY=1 for the CPU code-path check.
# GPU_PY=python3 runs it with an environment of your own (a sealed GPU image) instead of .venv.
GPU_PY ?= $(PY)
OUT ?= outputs/gpu_pass
gpu-pass: $(if $(filter $(PY),$(GPU_PY)),$(STAMP)) ## every GPU figure: PART=1|2 OUT=DIR (DRY=1: on CPU, tiny; RESUME=DIR: keep an earlier call's rows but REDO=NAMES)
	$(GPU_PY) -m benchmarks.gpu_pass --part $(or $(PART),all) --out $(OUT) $(if $(DRY),--dry) $(if $(RESUME),--resume $(RESUME)) $(if $(REDO),--redo $(REDO))

gpu-stamp: $(STAMP) ## .gpu_pass_commit: the commit, dirty flag and file hashes, for a GPU copy of the tree without .git
	$(PY) -m benchmarks.gpu_pass.provenance

gpu-publish: $(STAMP) ## the GPU pass's tables into docs/: every record under docs/gpu_pass/, or OUT="DIR [DIR ...]"
	$(PY) -m benchmarks.gpu_pass.publish $(if $(filter command line environment,$(origin OUT)),--out $(OUT))
	$(PY) -m llm.attention.choose --from docs/gpu_pass

gpu-wheels: $(STAMP) ## .whl/: the wheels the GPU pass needs that a sealed GPU image lacks (requirements-gpu.txt)
	$(PY) -m benchmarks.gpu_pass.wheels

lint: $(STAMP) ## ruff
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

bench: $(STAMP) ## our training step against transformers' GPT2LMHeadModel
	$(PY) benchmarks/step_vs_transformers.py $(ARGS)

bench-strategies: $(STAMP) ## DDP, our ZeRO-1/2/3, FSDP2, DeepSpeed, tp and pp rows on 2 and 4 ranks, one table
	$(PY) benchmarks/strategies.py $(ARGS)

bench-nvme: $(STAMP) libaio ## our ZeRO-3 in memory, offloaded to CPU and to NVMe, beside DeepSpeed's NVMe offload
	$(PY) benchmarks/nvme_offload.py $(ARGS)

bench-attention: $(STAMP) ## attention backends: time, TFLOP/s, memory vs T (table + plot)
	$(PY) benchmarks/attention.py $(ARGS)

bench-recompute: $(STAMP) ## recompute policies: activations per layer, step peak, step-time overhead (table + plot)
	$(PY) benchmarks/recompute.py $(ARGS)

bench-pipeline: $(STAMP) ## pipeline schedules: bubble, activations in flight, bytes per stage boundary against the formulas
	$(PY) benchmarks/pipeline.py $(ARGS)

bench-optimizers: $(STAMP) ## each optimizer's step time and state bytes, ours against library versions
	$(PY) benchmarks/optimizers.py $(ARGS)

profile: $(STAMP) ## where a training step's time goes: top ops, categories, host reads, Chrome trace (ARGS: train.py's overrides)
	$(PY) -m benchmarks.profile_step $(ARGS)

experiments-gpu: $(STAMP) ## NAME=... [PART=...] OUT=DIR [RESUME=DIR0]: the GPU scale's missing jobs, each recorded in OUT (logger=none, as `python -m experiments list --gpu` prints them)
	$(PY) -m experiments run $(NAME) scale=gpu $(if $(PART),part=$(PART)) logger=none $(ARGS) --out $(OUT) $(if $(RESUME),--resume $(RESUME))

experiments: $(STAMP) ## run every small experiment, write each report and copy it to docs/experiments/
	for name in $$($(PY) -m experiments list --names); do \
		$(PY) -m experiments run $$name $(ARGS) --publish || exit 1; \
	done

clean: ## remove outputs and caches (keeps .venv)
	rm -rf outputs multirun .cache .pytest_cache .ruff_cache
