#!/usr/bin/env bash
# The GPU checks of `--device cuda` (issue 30, item 7) in one command, for a machine with CUDA and a torch
# that sees it, from the repository root, without installing the package (PYTHONPATH=.):
#   1. the CUDA tests (skipped on every machine without CUDA, CI's among them);
#   2. the tiny model as released (MXFP4 experts), converted calibrated on cuda with 2 local workers (each opens
#      the device itself), validated and verified;
#   3. scripts/bench_gptq.py --device cuda: one routed-expert GPTQ on the device against the one-thread CPU path;
#   4. scripts/bench_calibrate_device.py: the bench checkpoint converted calibrated on the CPU (one worker per
#      core) and with --device cuda on 1 and 4 workers, phases and ratios.
# Each step has its own time limit (a step that runs out is reported and the next one runs); everything is
# printed and, where LOG is set, kept there.
#     bash scripts/check_device.sh [EXPERTS [TOKENS]]        (defaults 8 and 512)
set -u
EXPERTS=${1:-8}
TOKENS=${2:-512}
LOG=${LOG:-/dev/null}
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
export NUMBA_CACHE_DIR=${NUMBA_CACHE_DIR:-$(mktemp -d)}
CORES=$(nproc)

step() {  # step SECONDS NAME COMMAND...
    local limit=$1 name=$2
    shift 2
    echo "== $name (limit ${limit}s) $(date +%T)"
    local t0=$SECONDS
    timeout "$limit" "$@"
    local rc=$?
    echo "== $name: exit $rc after $((SECONDS - t0)) s$([ $rc = 124 ] && echo ' (time limit)')"
}

{
    nvidia-smi -L 2>&1
    python3 -c "import torch, numpy, numba; print('torch', torch.__version__, 'cuda', torch.version.cuda,
'available', torch.cuda.is_available(), '| numpy', numpy.__version__, '| numba', numba.__version__)"
    step 150 "CUDA tests" python3 -m pytest -q -p no:cacheprovider -o addopts="" \
        "tests/test_gptq.py::test_cuda_agrees_with_cpu" tests/test_calibrate_device.py tests/test_gptq_cuda.py \
        "tests/test_calibrate.py::test_calibrate_on_cuda_verifies_and_is_as_close_to_bf16"
    T=$(mktemp -d)
    for layout in mxfp4; do
        step 60 "tiny ($layout experts) on cuda, 2 workers" bash -c "
            python3 -m kimi_quant.cli synth --preset tiny --experts $layout -o $T/$layout &&
            python3 -m kimi_quant.cli convert $T/$layout -t a3 -o $T/out-$layout --calibrate --device cuda \
                --workers 2 --validate &&
            python3 -m kimi_quant.cli verify $T/out-$layout"
    done
    step 90 "GPTQ of one routed expert, cuda vs one CPU thread" python3 scripts/bench_gptq.py --device cuda --repeat 2
    step 240 "bench checkpoint, $EXPERTS experts, $TOKENS tokens: CPU ($CORES workers) vs cuda (1 and 4 workers)" \
        python3 scripts/bench_calibrate_device.py --device cuda --experts "$EXPERTS" --tokens "$TOKENS" \
        --workers 1,4 --cpu-workers "$CORES"
} 2>&1 | tee -a "$LOG"
