#!/bin/bash
# The GPU check of issue 55's one layer body (strata/models/layer.py, strata/decode/graph_ops.py): the CUDA-graph captures and the
# eager CUDA paths give main's bits, and the GPU tests pass. Run from the repository root on a CUDA machine:
#
#     bench/device_layer.sh [BASE]     # BASE: a tree of main before the change (default build/base, made from
#                                      # 0b02601 with git worktree if it is not there)
#
# 1. bench/graph_bits.py: one-sequence graph replays over two buckets and three slots' batch graphs (rows and
#    steps), per family in bfloat16, resident Q4_K_M with dp4a products, BASE against this tree, torch.equal;
# 2. bench/layer_bits.py on CUDA: prefill chunks (fused RoPE, FlexAttention windows, cuDNN/flash), prefill groups,
#    eager decode rows and batches, BASE against this tree, torch.equal.
# 3. (last: the comparisons matter most) tests/test_gpu.py and tests/test_batch_graphs.py -m gpu (known before the change: test_gpu.py's
#    test_resident_batch_rows_close_to_each_step_alone fails on an H100 by 0.034 against its 0.03 bound, issue 55
#    item 5);
# Exit status: non-zero when a comparison differs (test failures are reported, not fatal: see 3.).
set -u
BASE=${1:-build/base}
PY=${PY:-python}
OUT=${OUT:-/tmp/device_layer}
mkdir -p "$OUT"
if [ ! -d "$BASE/strata" ]; then
    git worktree add --detach "$BASE" 0b02601 || { echo "no BASE tree at $BASE"; exit 2; }
fi
nvidia-smi --query-gpu=name --format=csv,noheader
bad=0
echo "== graph decode, $BASE against this tree (and against itself: a kernel that is not deterministic run to run"
echo "   would show there first, and then a difference below says nothing about the change)"
$PY bench/graph_bits.py record "$BASE" "$OUT/graph_base.pt" | tail -3 && \
    $PY bench/graph_bits.py record "$BASE" "$OUT/graph_base2.pt" | tail -1 && \
    $PY bench/layer_bits.py compare "$OUT/graph_base.pt" "$OUT/graph_base2.pt" | tail -1 && \
    $PY bench/graph_bits.py record . "$OUT/graph_after.pt" | tail -3 && \
    $PY bench/layer_bits.py compare "$OUT/graph_base.pt" "$OUT/graph_after.pt" || bad=1
echo "== eager paths on CUDA, $BASE against this tree"
$PY bench/layer_bits.py record "$BASE" "$OUT/eager_base.pt" --device=cuda | tail -1 && \
    $PY bench/layer_bits.py record . "$OUT/eager_after.pt" --device=cuda | tail -1 && \
    $PY bench/layer_bits.py compare "$OUT/eager_base.pt" "$OUT/eager_after.pt" || bad=1
echo "== tests"
$PY -m pytest -q -p no:cacheprovider tests/test_gpu.py 2>&1 | tail -8
$PY -m pytest -q -p no:cacheprovider -m gpu tests/test_batch_graphs.py 2>&1 | tail -4
echo "== $([ $bad = 0 ] && echo 'same bits' || echo 'BITS DIFFER')"
exit $bad
