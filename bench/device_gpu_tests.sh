#!/usr/bin/env bash
# The GPU tests on the device machine (one GPU), logs under $OUT (else /tmp/gpu-tests). Steps, in the order given:
#   all [S]      the whole GPU test set (pytest -m gpu tests/), in the background beside the steps after it, stopped
#                with SIGINT after S seconds (default 400: pytest still prints its summary), waited for at the end
#   figures [N]  N runs (default 3), each its own process, of tests/test_gpu.py's batch_rows_case with its figures
#                per row and per cache: the batch body (kernels.gemv_rows mma-float) against the float-x step alone
#                (word kernels), the dp4a step (int8 x) against that step, their ratio and the bound; and the body
#                against the dp4a step, the comparison before the bound was derived (a constant 3e-2 then)
#   test [N]     N runs (default 3), each its own process, of test_resident_batch_rows_close_to_each_step_alone
# The carried wheels (.whl) go in first where pyzmq or gguf is missing. E.g. in a run (carry [".whl"]):
#   bash bench/device_gpu_tests.sh all 400 figures 3      then      bash bench/device_gpu_tests.sh test 3
set -o pipefail
export PYTHONUNBUFFERED=1
LOG=${OUT:-/tmp/gpu-tests}; mkdir -p "$LOG"
t0=$(date +%s); el() { echo "=== [+$(( $(date +%s) - t0 )) s] $*"; }
python3 -c "import zmq, gguf" 2>/dev/null || {
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    || { echo "wheel install failed"; exit 1; }
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}; }
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
SUITE=
rc=0

figures() {
  python3 - <<'PY'
import sys, time
sys.path[:0] = ["tests", "."]
import test_gpu
t, seen = time.time(), []
test_gpu.batch_rows_case(seen)
f = lambda v: "-" if v is None else f"{v:.4f}"  # noqa: E731
print(f"{'row or cache':<40} {'body-float':>10} {'dp4a-float':>10} {'ratio':>6} {'bound':>7} {'body-dp4a':>9}")
for e in seen:
    if "same" in e:
        if not (e["same"] and e["old"] in (True, None)):
            print(f"{str(e['what']):<40} argmax: as the float-x step's {e['same']}, as the dp4a step's {e['old']}, "
                  f"near the float-x step's top {e['near_top']}")
        continue
    ratio = e["d"] / e["rounding"] if e["rounding"] else float("nan")
    print(f"{str(e['what']):<40} {f(e['d']):>10} {f(e['rounding']):>10} {ratio:>6.2f} {f(e['bound']):>7} "
          f"{f(e['old']):>9}")
rows = [e for e in seen if "d" in e and e["what"][-1] in ("h", "logits")]
caches = [e for e in seen if "d" in e and e not in rows]
for name, es in (("rows", rows), ("caches", caches)):
    print(f"{name}: body-float max {max(e['d'] for e in es):.4f}, dp4a-float max {max(e['rounding'] for e in es):.4f} "
          f"min {min(e['rounding'] for e in es):.4f}, largest ratio to its bound's distance "
          f"{max(e['d'] / (e['bound'] / test_gpu.BATCH_ROWS_MULTIPLE) for e in es):.2f}, "
          f"body-dp4a max {max(e['old'] for e in es):.4f}")
old = max(e["old"] for e in rows + caches) if all(e["old"] is not False for e in seen if "same" in e) else 1.0
new = all(e["d"] <= e["bound"] for e in rows + caches) and all(e["same"] or e["near_top"] for e in seen if "same" in e)
print(f"before (body-dp4a < 3e-2 everywhere): {'pass' if old < 3e-2 else 'FAIL'} ({old:.4f}); "
      f"now (x{test_gpu.BATCH_ROWS_MULTIPLE:g} the dp4a-float distance, argmax near the float-x step's top): "
      f"{'pass' if new else 'FAIL'}; {time.time() - t:.1f} s")
PY
}

while [ $# -gt 0 ]; do
  step=$1; shift
  n=3; case ${1:-} in [0-9]*) n=$1; shift;; esac
  case $step in
    all)
      el "the GPU test set, in the background, SIGINT after $n s (log suite.log)"
      timeout -s INT -k 30 "$n" python3 -m pytest -q -m gpu -p no:cacheprovider --continue-on-collection-errors \
        -rfEs --durations=15 tests/ > "$LOG/suite.log" 2>&1 &
      SUITE=$!;;
    figures)
      for i in $(seq "$n"); do
        el "figures, run $i of $n"
        figures 2>&1 | tee "$LOG/figures-$i.log" || rc=1
      done;;
    test)
      for i in $(seq "$n"); do
        el "test run $i of $n"
        python3 -m pytest -q -p no:cacheprovider -rfE \
          "tests/test_gpu.py::test_resident_batch_rows_close_to_each_step_alone" 2>&1 | tee "$LOG/test-$i.log" \
          || rc=1
      done;;
    *) echo "unknown step $step (all, figures, test)"; exit 2;;
  esac
done
if [ -n "$SUITE" ]; then
  el "waiting for the GPU test set"
  wait "$SUITE"; s=$?
  el "GPU test set: rc $s"; tail -40 "$LOG/suite.log"
  [ "$s" -eq 0 ] || rc=1
fi
el "done, rc $rc"
exit $rc
