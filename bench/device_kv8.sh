#!/usr/bin/env bash
# kv_dtype q8_0 on one H200 (issue 26 item 1): setup (wheels, llama.cpp's CUDA build in the background, the 8B Q4_K_M
# random-block file) and the GPU tests of the 8-bit caches; then `time`: decode after 122,880 tokens with a bfloat16
# and a q8_0 cache (CUDA graphs, the default), their prefill (ttft) of the same prompt, and llama.cpp's decode after
# the same depth with its f16 and q8_0 caches, on the same file; `splitk`: split-K alone over 122,880 keys, bf16 and
# each q8_0 arm (bench/splitk.py); `arms`: the q8_0 decode after 122,880 with kernels.q8_attention int8 and int8x2
# (the `time` step's q8_0 row is the default arm, int8x2); `narrow`: one layer's prefill attention over 122,880
# tokens with a bf16 cache and a q8_0 cache widened in blocks of 16,384 / 32,768 / 65,536 / the whole prefix
# (bench/narrow_prefill.py --prefill); `serve`: the server with 1, 4 and 16 streams of token-id prompts (max_seqs 16)
# beside llama-batched-bench on the same file (bench/serve_concurrency.py; issue 29; carry the server's wheels in
# .whl: ../shared/tools/device-wheels.sh uvicorn starlette anyio h11 click sniffio httpx httpcore certifi idna jinja2
# markupsafe); `batch`: the GPU tests of decode batches in graphs and of strata/quant/rows.py (`batch-tests`: only
# those), then a batch's time by rows in graphs (kernels.gemv_rows mma-float, the default, and dp4a), each against
# the float32 model (bench/decode_rows.py); `serve-rows`: the server's 4 and 16 streams with kernels.gemv_rows $ROWS
# (default dp4a), no peer; `sweep`: the batch's products alone by kernel and launch options (bench/rows_sweep.py);
# `serve-ahead`: the server's 1, 4 and 16 streams with the rig's batch_ahead $AHEAD (default 3), no peer (run after
# `serve`, the same call: its llama.cpp row); `serve-profile`: the server's 16 streams under py-spy (head and stage
# processes, idle frames too: where a step's wall time goes besides the graph's, read by bench/pyspy_top.py; carry
# the py-spy wheel in .whl: ../shared/tools/device-wheels.sh py-spy); `prefix-tiers`: the GPU test of the prefix
# cache's device tier, then four documents of $DOC tokens (default 32,768) asked about again, from the host tier and
# from the device tier (bench/prefix_tiers.py; PROFILE=1: the head's profile of the re-asks; QUESTIONS: the
# lengths asked after them, ARMS: host,device); `short-chunk`: one question's chunk after a cached prefix of $DOC tokens
# outside the server: its wall, host-issue and GPU-busy time and syncs (bench/short_chunk.py); `gguf`: the 8B file alone (no build); `tier-test`: that GPU test
# alone; `ahead-ab`: the server's 4 and 16 streams with batch_ahead 0, with $AHEAD, and with 0 and
# kernels.slot_spin on, no peer (a short call's A/B); `serve-ab`: the server's 4 and 16 streams with the defaults,
# prefill_groups on and off, beside llama-batched-bench, then with groups on and batch_ahead 0 without slot_spin (the
# defaults before 2026-12-06), and with batch_ahead each of $AHEADS (default 7) with the spin; `serve-text`: 16
# streams of the 8B with SmolLM2's vocabulary (bench/make_gguf.py --vocab; carry .whl/smollm2-vocab.gguf, made
# by `python bench/make_gguf.py --preset smoke --vocab smollm2 --vocab-only --out .whl/smollm2-vocab.gguf`): token-id
# prompts to the file without a vocabulary beside llama-batched-bench, then chat requests of text, then streamed.
# Usage: bash bench/device_kv8.sh setup tests | time | splitk arms | narrow | batch | batch-tests | serve
# | serve-ahead | serve-rows | serve-profile | prefix-tiers | short-chunk | gguf | tier-test | ahead-ab | serve-ab
# | serve-text | sweep
LOG=${LOG:-/tmp/kv8}; mkdir -p "$LOG"
. bench/device_common.sh
wheels zmq gguf
for step in "$@"; do case $step in
setup)
  build
  el "gguf 8B Q4_K_M"
  [ -f /tmp/8b-q4km.gguf ] || timeout 120 python3 bench/make_gguf.py --preset llama-3-8b --qtype Q4_K_M \
    --out /tmp/8b-q4km.gguf --device cuda 2>&1 | tail -1 ;;
tests)
  el "GPU tests: 8-bit caches, split-K, graphs"
  timeout 300 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_kv_q8.py tests/test_decode_attention.py \
    tests/test_gpu.py -k "q8 or 8bit or split_k or graph" 2>&1 | tail -5
  build_wait ;;
time)
  build_wait
  el "Strata 8B Q4_K_M, 1 GPU: bf16 and q8_0 caches, decode after 122,880"
  timeout 240 python3 bench/generate.py --model /tmp/8b-q4km.gguf --devices cuda:0 --contexts 122880 --tokens 128 \
    --chunk 10240 --kv-dtype auto,q8_0 2>&1 | tail -4
  el "llama.cpp, the same file: f16 and q8_0 caches"
  [ -x "$LB" ] && timeout 240 python3 bench/generate.py --model /tmp/8b-q4km.gguf --devices cuda:0 --contexts 122880 \
    --tokens 128 --llama-only --llama-bench "$LB" --llama-kv f16,q8_0 2>&1 | tail -3 ;;
splitk)
  el "split-K alone: bf16, q8_0 widen / int8 / int8x2, 122,880 keys (bench/splitk.py)"
  timeout 200 python3 bench/splitk.py --keys 122880 2>&1 | tee "$LOG/splitk.log" | tail -45 ;;
arms)
  for arm in int8 int8x2; do
    el "Strata 8B Q4_K_M, 1 GPU: q8_0 cache, kernels.q8_attention $arm, decode after 122,880"
    [ -f /tmp/8b-q4km.gguf ] && STRATA_Q8_ATTENTION=$arm timeout 180 python3 bench/generate.py \
      --model /tmp/8b-q4km.gguf --devices cuda:0 --contexts 122880 --tokens 128 --chunk 10240 --kv-dtype q8_0 \
      2>&1 | tail -2
  done ;;
serve)
  build_wait
  wheels uvicorn starlette httpx
  el "the server, 8B Q4_K_M on one GPU: 1, 4, 16 streams (max_seqs 16), beside llama-batched-bench"
  timeout 420 python3 bench/serve_concurrency.py --model /tmp/8b-q4km.gguf --devices cuda:0 --prompt-ids 32 \
    --streams 1,4,16 --max-seqs 16 --tokens 128 --max-context 4096 --peer "$LL/build/bin/llama-batched-bench" 2>&1 \
    | tee "$LOG/serve.log" | tail -8 ;;
serve-ab)
  build_wait
  wheels uvicorn starlette httpx
  el "the server, 8B Q4_K_M on one GPU: 4 and 16 streams, prefill_groups on and off, beside llama-batched-bench"
  timeout 300 python3 bench/serve_concurrency.py --model /tmp/8b-q4km.gguf --devices cuda:0 --prompt-ids 32 \
    --streams 4,16 --max-seqs 16 --tokens 128 --max-context 4096 --prefill-groups on,off \
    --peer "$LL/build/bin/llama-batched-bench" 2>&1 | tee "$LOG/serve-ab.log" | tail -7
  for arm in old ${AHEADS:-7}; do  # prefill_groups on: old, the defaults before 2026-12-06 (batch_ahead 0, no
    a=$arm; spin=1; [ "$arm" = old ] && { a=0; spin=0; }  # slot_spin); else batch_ahead $arm with the spin
    el "the server, 8B Q4_K_M on one GPU, batch_ahead $a, slot_spin $spin: 4 and 16 streams, no peer"
    STRATA_SLOT_SPIN=$spin timeout 200 python3 bench/serve_concurrency.py --model /tmp/8b-q4km.gguf --devices cuda:0 \
      --prompt-ids 32 --streams 4,16 --max-seqs 16 --tokens 128 --max-context 4096 --peer '' --batch-ahead "$a" 2>&1 \
      | tee "$LOG/serve-ab-$arm.log" | tail -3
  done ;;
serve-text)
  build_wait
  wheels uvicorn starlette httpx
  [ -f .whl/smollm2-vocab.gguf ] || { echo "serve-text: no .whl/smollm2-vocab.gguf (see the header)"; exit 1; }
  [ -f /tmp/8b-text.gguf ] || { timeout 120 python3 bench/make_gguf.py --preset llama-3-8b --qtype Q4_K_M \
    --vocab .whl/smollm2-vocab.gguf --out /tmp/8b-text.part --device cuda 2>&1 | tail -1 \
    && mv /tmp/8b-text.part /tmp/8b-text.gguf; }  # (a file cut short by the timeout is not taken later)
  el "the server, 8B Q4_K_M on one GPU, 16 streams: token ids (no vocabulary), beside llama-batched-bench"
  timeout 200 python3 bench/serve_concurrency.py --model /tmp/8b-q4km.gguf --devices cuda:0 --prompt-ids 32 \
    --streams 16 --max-seqs 16 --tokens 128 --max-context 4096 --peer "$LL/build/bin/llama-batched-bench" 2>&1 \
    | tee "$LOG/serve-text-ids.log" | tail -3
  for mode in chat stream; do
    el "the server, 8B Q4_K_M with SmolLM2's vocabulary on one GPU, 16 streams: $mode requests of text, no peer"
    timeout 200 python3 bench/serve_concurrency.py --model /tmp/8b-text.gguf --devices cuda:0 --streams 16 \
      --max-seqs 16 --tokens 128 --max-context 4096 --peer '' $([ $mode = stream ] && echo --stream) 2>&1 \
      | tee "$LOG/serve-text-$mode.log" | tail -3
  done ;;
serve-rows)
  wheels uvicorn starlette httpx
  el "the server, 8B Q4_K_M on one GPU, kernels.gemv_rows ${ROWS:-dp4a}: 4 and 16 streams (max_seqs 16), no peer"
  STRATA_GEMV_ROWS=${ROWS:-dp4a} timeout 300 python3 bench/serve_concurrency.py --model /tmp/8b-q4km.gguf \
    --devices cuda:0 --prompt-ids 32 --streams 4,16 --max-seqs 16 --tokens 128 --max-context 4096 --peer '' 2>&1 \
    | tee "$LOG/serve-rows.log" | tail -5 ;;
serve-ahead)
  wheels uvicorn starlette httpx
  el "the server, 8B Q4_K_M on one GPU, batch_ahead ${AHEAD:-3}: 1, 4, 16 streams (max_seqs 16), no peer"
  timeout 300 python3 bench/serve_concurrency.py --model /tmp/8b-q4km.gguf --devices cuda:0 --prompt-ids 32 \
    --streams 1,4,16 --max-seqs 16 --tokens 128 --max-context 4096 --peer '' --batch-ahead "${AHEAD:-3}" 2>&1 \
    | tee "$LOG/serve-ahead.log" | tail -6 ;;
serve-profile)
  wheels uvicorn starlette httpx
  el "the server's 16 streams, 8B Q4_K_M on one GPU, under py-spy (raw stacks in serve-profile.txt)"
  timeout 300 /tmp/site/bin/py-spy record --subprocesses --idle --format raw -r 500 -o "$LOG/serve-profile.txt" -- \
    python3 bench/serve_concurrency.py --model /tmp/8b-q4km.gguf --devices cuda:0 --prompt-ids 32 --streams 16 \
    --max-seqs 16 --tokens 128 --max-context 4096 --peer '' 2>&1 | tail -4
  python3 bench/pyspy_top.py "$LOG/serve-profile.txt" --top 30 > "$LOG/serve-profile-top.txt"
  gzip -f "$LOG/serve-profile.txt" ;;  # (the raw stacks are ~40 MB: too large to come back as they are)
batch|batch-tests)
  el "GPU tests: decode batches in graphs (strata/decode/batch_graphs.py), rows on CUDA, several slots end to end"
  timeout 300 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_gpu.py tests/test_quant_rows.py \
    -k "batch_graphs or rows_on_cuda or max_seqs or gpu_rows" 2>&1 | tail -5
  [ "$step" = batch-tests ] && continue
  el "a decode batch by rows, 8B Q4_K_M, 2,048 tokens a slot: the batch graphs (mma-float, dp4a) against float32"
  timeout 300 python3 bench/decode_rows.py --model /tmp/8b-q4km.gguf --device cuda:0 --dtype bfloat16 \
    --weights resident --arms f32,graphs,graphs-dp4a --rows 8,16 --prompt 2048 2>&1 \
    | tee "$LOG/batch.log" | tail -14 ;;
gguf)
  el "gguf 8B Q4_K_M (no llama.cpp build)"
  [ -f /tmp/8b-q4km.gguf ] || timeout 120 python3 bench/make_gguf.py --preset llama-3-8b --qtype Q4_K_M \
    --out /tmp/8b-q4km.gguf --device cuda 2>&1 | tail -1 ;;
tier-test)
  el "GPU test: the prefix cache's device tier"
  timeout 120 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_prefix_cache.py -k device_tier 2>&1 | tail -3 ;;
ahead-ab)
  wheels uvicorn starlette httpx
  for arm in 0 "${AHEAD:-3}" spin; do  # spin: batch_ahead 0 with kernels.slot_spin on
    a=$arm; spin=0; [ "$arm" = spin ] && { a=0; spin=1; }
    el "the server, 8B Q4_K_M on one GPU, batch_ahead $a, slot_spin $spin: 4 and 16 streams (max_seqs 16), no peer"
    STRATA_SLOT_SPIN=$spin timeout 200 python3 bench/serve_concurrency.py --model /tmp/8b-q4km.gguf --devices cuda:0 \
      --prompt-ids 32 --streams 4,16 --max-seqs 16 --tokens 128 --max-context 4096 --peer '' --batch-ahead "$a" 2>&1 \
      | tee "$LOG/ahead-ab-$arm.log" | tail -3
  done ;;
prefix-tiers)
  el "GPU test: the prefix cache's device tier"
  timeout 120 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_prefix_cache.py -k device_tier 2>&1 | tail -3
  el "documents asked about again, 8B Q4_K_M on one GPU: the prefix cache's host tier vs its device tier"
  timeout 360 python3 bench/prefix_tiers.py --model /tmp/8b-q4km.gguf --tokens ${DOC:-32768} ${PROFILE:+--profile} \
    ${QUESTIONS:+--questions $QUESTIONS} ${ARMS:+--arms $ARMS} 2>&1 \
    | tee "$LOG/prefix-tiers.log" | tail -n "$([ -n "$PROFILE" ] && echo 90 || echo 14)" ;;
short-chunk)
  el "a question's chunk after a cached prefix of ${DOC:-16384}, 8B Q4_K_M on one GPU: wall, host-issue, GPU-busy (bench/short_chunk.py)"
  timeout 300 python3 bench/short_chunk.py --model /tmp/8b-q4km.gguf --prefix ${DOC:-16384} \
    --rows ${QUESTIONS:-24,40,57,73} 2>&1 | grep -v "^USDT" | tee "$LOG/short-chunk.log" | tail -80 ;;
sweep)
  el "a decode batch's products alone by kernel and options, 8B Q4_K_M shapes (bench/rows_sweep.py)"
  timeout 240 python3 bench/rows_sweep.py --rows 16 2>&1 | tee "$LOG/sweep.log" | tail -40 ;;
narrow)
  el "one layer's prefill attention, bf16 cache vs q8_0 widened in blocks (bench/narrow_prefill.py --prefill)"
  timeout 200 python3 bench/narrow_prefill.py --prefill --chunk 10240 --heads 32 --kv-heads 8 --keys 122880 \
    --blocks 16384,32768,65536,0 2>&1 | tee "$LOG/narrow.log" | tail -8 ;;
esac; done
el end
