#!/bin/bash
# Device call: the GPU test suite (first failure shown in full), the FP8 probe, Unsloth's env imports.
# carry: .whl    bash bench/call_probe.sh
set -u
T0=$(date +%s)
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false TORCH_CUDA_ARCH_LIST=9.0
O=${OUT:-/tmp/out_local}; mkdir -p "$O"
pip_t() { t=$1; shift; python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target $t "$@" >/tmp/pip_$(basename $t).log 2>&1 || { echo "install $t failed"; tail -5 /tmp/pip_$(basename $t).log; }; }
pip_t /tmp/site_lm .whl/lm/*.whl .whl/bnb/*.whl .whl/ao/*.whl
pip_t /tmp/site_uns .whl/uns/*.whl .whl/bnb/*.whl .whl/ao/*.whl
echo "wheels $(( $(date +%s)-T0 ))s"
PYTHONPATH=/tmp/site_lm:src timeout 100 python3 bench/probe_fp8.py 2>&1 | tee "$O/probe_fp8.jsonl" | tail -12
echo "probe $(( $(date +%s)-T0 ))s"
PYTHONPATH=/tmp/site_uns timeout 90 python3 -c "import unsloth, importlib.metadata as m; print('unsloth import ok', m.version('unsloth'))" 2>&1 | tail -3
echo "uns $(( $(date +%s)-T0 ))s"
PYTHONPATH=/tmp/site_lm:src timeout $(( 560 - ($(date +%s)-T0) )) python3 -m pytest -p no:cacheprovider -m gpu tests \
  -v -x -rf --continue-on-collection-errors --ignore=tests/unit/test_webui_form.py --ignore=tests/integration/test_api.py --ignore=tests/integration/test_webui.py --ignore=tests/unit/webui --ignore=tests/unit/infer --ignore=tests/integration/test_chat.py --ignore=tests/integration/test_server.py --ignore=tests/integration/test_api_soak.py 2>&1 | tail -60 > "$O/gpu_tests.log"; tail -45 "$O/gpu_tests.log"
echo "done $(( $(date +%s)-T0 ))s"
