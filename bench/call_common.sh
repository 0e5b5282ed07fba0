# Shared by the resumable H200 call scripts (bench/call_s3.sh, bench/call_s4.sh); sourced, never run.
# The caller sets TOTAL (seconds for the call) and PHASES (which of its phases run) before sourcing.
set -u
T0=$(date +%s)
left() { echo $(( TOTAL - ($(date +%s) - T0) )); }
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 DISABLE_VERSION_CHECK=1 TOKENIZERS_PARALLELISM=false PYTHONHASHSEED=0
export TORCH_CUDA_ARCH_LIST=9.0
O=${OUT:-/tmp/out_local}; mkdir -p "$O"
has() { case " $PHASES " in *" $1 "*) return 0;; esac; return 1; }
pip_t() {  # once per machine: a marker per target
  t=$1; shift
  [ -f "$t/.done" ] && return
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$t" "$@" \
    >"/tmp/pip_$(basename "$t").log" 2>&1 && touch "$t/.done" || { echo "install $t failed"; tail -5 "/tmp/pip_$(basename "$t").log"; }
}
