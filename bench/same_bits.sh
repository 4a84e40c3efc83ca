#!/usr/bin/env bash
# The Llama path before and after a change: the same rigs at two commits, their residual md5s, perplexities and
# tokens side by side (CPU; worktrees under /tmp). Usage: bash bench/same_bits.sh OLD_COMMIT [NEW_COMMIT]
set -euo pipefail
old=$1; new=${2:-HEAD}
py=${PYTHON:-$PWD/.venv/bin/python}
cat > /tmp/same-bits-smol.yaml <<'YAML'
model: smollm2
dtype: float32
stages: [{device: cpu, threads: 1}, {device: cpu, threads: 1}]
chunk: 256
prompt: {random: {tokens: 1024, seed: 0}}
generate: 8
dump_residual: true
decode_weights: blocks
YAML
for c in "$old" "$new"; do
  d=/tmp/same-bits-$(git rev-parse --short "$c")
  [ -d "$d" ] || git worktree add -q "$d" "$c"
  for cfg in configs/smoke.yaml /tmp/same-bits-smol.yaml; do
    out=$d/run-$(basename "$cfg" .yaml); rm -rf "$out"
    (cd "$d" && PYTHONPATH="$d" "$py" launcher.py --config "$cfg" --out "$out" --no-timeline > "$out.log" 2>&1)
    "$py" - "$out" "$c" "$cfg" <<'PY'
import glob, json, sys
r = json.load(open(glob.glob(sys.argv[1] + "/**/report.json", recursive=True)[0]))
print(f"{sys.argv[2]:>10} {sys.argv[3]:<28} md5 {r['residual_md5']}  perplexity {r['perplexity']:.10g}  "
      f"tokens {r.get('continuation_ids')}")
PY
  done
done
