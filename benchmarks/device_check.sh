#!/usr/bin/env bash
# The GPU paths in one run: the engine, stage and plugin tests on a CUDA machine, then the engine's
# step across dtypes / ZeRO stages and one RL step, as JSON under $OUT (or ./device_out).
#
# The machine needs torch and transformers; the rest travels as wheels in .whl/, made where pip
# works, for the machine's Python (3.12 on the H200 image checked, which lacked all of these):
#   pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#       --platform manylinux2014_x86_64 --platform manylinux_2_28_x86_64 -d .whl \
#       hjson pydantic pydantic_core annotated-types typing-inspection datasets dill multiprocess \
#       pyarrow math-verify latex2sympy2_extended antlr4-python3-runtime==4.13.2
#   pip wheel --no-deps deepspeed -w .whl && pip wheel --no-deps --no-build-isolation . -w .whl
# (pin the versions of the local venv; ~54 MB, pyarrow 50 of it), then there:
#   pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
# Prefect, MLflow and DVC are not needed: the stage runners are called directly, as their tests do.
set -uo pipefail
out="${OUT:-device_out}"
mkdir -p "$out"
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false

nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$out/gpu.txt"
python3 -c "import torch, transformers, deepspeed; print('torch', torch.__version__, 'transformers',
transformers.__version__, 'deepspeed', deepspeed.__version__, 'cuda', torch.cuda.is_available())" | tee -a "$out/gpu.txt"

parts="${*:-tests engine rl}"  # a subset by name: device_check.sh tests rl

if [[ $parts == *tests* ]]; then
# Tests: the flow tests' conftest starts a Prefect server; the stage tests need only its fixtures.
python3 - <<'EOF'
import re, pathlib
p = pathlib.Path("tests/flows/conftest.py")
s = p.read_text()
s = s.replace("from prefect.testing.utilities import prefect_test_harness\n", "")
s = re.sub(r'@pytest.fixture\(scope="session", autouse=True\)\ndef prefect_server\(\):.*?yield\n', "", s, flags=re.S)
p.write_text(s)
EOF
# two-rank tests start two processes on one machine: one GPU cannot hold two NCCL ranks
timeout 300 python3 -m pytest -q -p no:cacheprovider --timeout 150 -k "not two_ranks" \
    tests/core tests/plugins tests/flows/test_*_stage.py 2>&1 | tee "$out/tests.txt" | tail -40
fi

if [[ $parts == *engine* ]]; then
timeout 200 python3 benchmarks/engine_step.py --hidden 1536 --layers 16 --vocab 32000 --seq 1024 \
    --batch 16 --micro 8 --steps 5 --variants fp32:0 bf16:0 bf16:2 bf16:3 \
    >"$out/engine_step.json" 2>"$out/engine_step.err"; echo "engine_step rc=$?"; cat "$out/engine_step.json"
fi

if [[ $parts == *rl* ]]; then
python3 -c "from alignflow.core.task import write_datasets; write_datasets('/tmp/data')" >/dev/null
timeout 150 python3 benchmarks/rl_step.py --model builtin:tiny --dataset /tmp/data/rl.jsonl --steps 3 \
    >"$out/rl_step_tiny.json" 2>"$out/rl_step.err"; echo "rl_step tiny rc=$?"; cat "$out/rl_step_tiny.json"
# the same step on a 136M-parameter model of the tiny one's shape (random weights: every completion runs to 48 tokens)
python3 -c "from alignflow.core.models import build_tiny; build_tiny('/tmp/m136', hidden_size=1024,
intermediate_size=2816, num_hidden_layers=12, num_attention_heads=16, num_key_value_heads=4)"
timeout 150 python3 benchmarks/rl_step.py --model /tmp/m136 --dataset /tmp/data/rl.jsonl --steps 3 \
    >"$out/rl_step_136m.json" 2>>"$out/rl_step.err"; echo "rl_step 136m rc=$?"; cat "$out/rl_step_136m.json"
fi

if [[ $parts == *ranks* ]]; then  # only on a machine with 2+ GPUs: one GPU cannot hold two NCCL ranks
gpus=$(python3 -c "import torch; print(torch.cuda.device_count())")
if (( gpus >= 2 )); then
timeout 300 python3 benchmarks/ranks.py --model builtin:tiny --nproc "$gpus" --steps 3 \
    2>"$out/ranks.err" | tail -1 >"$out/ranks.json"; echo "ranks rc=$?"; cat "$out/ranks.json"
else
echo "ranks: skipped, $gpus GPU(s)"
fi
fi
