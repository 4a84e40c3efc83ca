# Sourced by the device scripts (bench/device_families.sh, bench/device_qwen35.sh): their clock, deadline and
# llama.cpp build. Set LOG before sourcing; LL (default /tmp/ll) and DEADLINE (seconds since the start, default
# 570: the call ends inside the device's 600 s) may be set by the caller.
set -o pipefail
LL=${LL:-/tmp/ll}; LB=$LL/build/bin/llama-bench
DEADLINE=${DEADLINE:-570}
export PYTHONUNBUFFERED=1
t0=$(date +%s); el() { echo "=== [+$(( $(date +%s) - t0 )) s] $*"; }
left() { echo $(( DEADLINE - ($(date +%s) - t0) )); }
# fits NAME SECONDS: true when the step's usual time still fits before DEADLINE, else says it was skipped
fits() { if [ "$(left)" -ge "$2" ]; then return 0; fi; el "SKIPPED $1: needs ~$2 s, $(left) s left before the deadline"; return 1; }
BUILD_PID=

# wheels PACKAGE...: the carried wheels (.whl) into /tmp/site unless every package is there, then on PYTHONPATH
wheels() {
  local d
  for d in "$@"; do
    if [ ! -d "/tmp/site/$d" ]; then
      python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
        || { echo "wheel install failed"; exit 1; }
      break
    fi
  done
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
}

build() {
  if [ -x "$LB" ]; then el "build: llama-bench already built"; return; fi
  el "build: llama.cpp CUDA (background, nice 19)"
  rm -rf "$LL" && mkdir -p "$LL" && tar xzf .peer/llama.tgz -C "$LL" || { echo "untar failed"; return 1; }
  cmake -S "$LL" -B "$LL/build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90 \
    -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=OFF \
    -DLLAMA_BUILD_APP=OFF > "$LOG/build.log" 2>&1 || { tail -20 "$LOG/build.log"; return 1; }
  ( nice -n 19 timeout 480 cmake --build "$LL/build" -j "$(nproc)" --target llama-bench llama-batched-bench \
      >> "$LOG/build.log" 2>&1
    echo $? > "$LL/build.rc" ) &
  BUILD_PID=$!
}

build_wait() {
  if [ -n "$BUILD_PID" ]; then
    el "waiting for the llama.cpp build"
    wait "$BUILD_PID"
    BUILD_PID=
    el "build finished, rc $(cat "$LL/build.rc" 2>/dev/null)"; tail -2 "$LOG/build.log"
  elif [ -d "$LL/build" ] && [ ! -x "$LB" ] && [ ! -f "$LL/build.rc" ]; then
    # started by an earlier script of the same call (its background job outlives that script, not the call)
    el "waiting for the llama.cpp build an earlier script started"
    while [ ! -f "$LL/build.rc" ] && [ "$(left)" -gt 0 ]; do sleep 2; done
    el "build finished, rc $(cat "$LL/build.rc" 2>/dev/null)"
  fi
  [ -x "$LB" ] || { el "no llama-bench: the llama.cpp arms are left out"; return 1; }
}
