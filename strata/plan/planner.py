"""Layer split planning: contiguous layer ranges that make the slowest stage as fast as possible
while every stage fits its memory (weights, KV cache for the whole prompt, one chunk's
activations and scratch, hand-off buffers, the process's own runtime).

Pure arithmetic: nothing here starts a process or touches a device. Speeds come from the rig or
from `strata.plan.calibrate`; memory caps from the rig or from the device (see `plan.build_plan`).

Cost model. A stage holding n layers (and the final norm and head when it is the last one)
spends, over a prompt of N tokens,

    t = n * (linear / s.linear + attention / s.attention) + [last] head / s.head

with per layer linear = 2 * P_layer * N FLOPs, attention = 2 * n_heads * head_dim * N^2 (causal:
QK^T and PV over half the square) and head = 2 * vocab * dim * N (the perplexity's logits for
every prompt row). Speeds in FLOP/s give seconds; relative speeds (`speed:` in the rig) give
comparable units, so only the shares mean anything.
"""
from __future__ import annotations

from dataclasses import dataclass

from strata.kernels.attention import PREFIX_BLOCK
from strata.errors import PlanError
from strata.models.args import ModelArgs
from strata.weights.storage import Storage

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
GiB = 2**30
# Beyond the tensors a stage allocates: a CPU stage process's interpreter and torch (anonymous
# memory after the imports, measured ~0.2-0.3 GB RSS); a CUDA stage's cuBLAS workspaces (32 MiB a stream
# on Hopper: the compute stream, the decode graphs' warm-up and capture streams), the decode graphs' shared
# pool (73 MB on smoke-wide, 54-93 MB on 8B stages, measured on H200) and the caching allocator's rounding.
# The CUDA context itself is not in here: a cap measured on the device already excludes one (see
# calibrate.py); a cap from the rig has CUDA_CONTEXT taken off.
CPU_RUNTIME_BYTES = 256 * 2**20
CUDA_RUNTIME_BYTES = 256 * 2**20
CUDA_CONTEXT_BYTES = 512 * 2**20
NLL_BLOCK = 1024  # rows of full-vocabulary logits at once in Transformer.nll


def _gib(n: int | float) -> str:
    return f"{n / GiB:.2f} GiB"


POOL_GRAIN = 64  # kv_pool: a sequence's extent is whole multiples of this many positions (fewer odd gaps)


@dataclass(frozen=True)
class StageNeed:
    weights: int
    kv_cache: int
    activations: int
    handoff: int
    runtime: int = 0
    kv_seqs: int = 1           # sequences the KV cache holds (max_seqs)
    prefix_cache: int = 0      # a CUDA stage's device tier of the prefix cache (prefix_cache_device_bytes)

    @property
    def total(self) -> int:
        return self.weights + self.kv_cache + self.activations + self.handoff + self.runtime + self.prefix_cache

    def describe(self) -> str:
        seqs = f" for {self.kv_seqs} sequences (max_seqs)" if self.kv_seqs > 1 else ""
        parts = [f"weights {_gib(self.weights)}", f"KV cache {_gib(self.kv_cache)}{seqs}",
                 f"activations {_gib(self.activations)}"]
        if self.handoff:
            parts.append(f"hand-off {_gib(self.handoff)}")
        if self.runtime:
            parts.append(f"runtime {_gib(self.runtime)}")
        if self.prefix_cache:
            parts.append(f"prefix cache (device tier) {_gib(self.prefix_cache)}")
        return ", ".join(parts)

    def as_dict(self) -> dict:
        return {"weights": self.weights, "kv_cache": self.kv_cache, "activations": self.activations,
                "handoff": self.handoff, "runtime": self.runtime, "prefix_cache": self.prefix_cache,
                "total": self.total}


def kv_rows(args: ModelArgs, n: int, tokens: int, chunk: int, start: int | None = None) -> int:
    """KV cache rows n layers hold for `tokens` positions: layers [start, start + n) exactly, or (start None, while
    a split is searched) the most that any n consecutive layers hold. A window layer keeps a ring of its window
    plus a chunk (ModelArgs.kv_positions), a global layer every position."""
    if args.sliding_window is None and args.linear_layers is None:
        return n * tokens
    rows = [args.kv_positions(i, tokens, chunk) for i in range(args.n_layers)]
    if start is not None:
        return sum(rows[start:start + n])
    return max(sum(rows[s:s + n]) for s in range(args.n_layers - n + 1))


def state_bytes(args: ModelArgs, n: int, b: int, start: int | None = None) -> int:
    """The linear-attention states n layers hold (exactly for [start, start + n), else the most any n consecutive
    layers hold): the convolution's last inputs in the compute dtype, the delta rule's float32 state."""
    if args.linear_layers is None:
        return 0
    conv = 2 * args.lin_k_heads * args.lin_k_dim + args.lin_v_heads * args.lin_v_dim
    one = conv * (args.lin_conv - 1) * b + args.lin_v_heads * args.lin_k_dim * args.lin_v_dim * 4
    flags = [int(args.is_linear(i)) for i in range(args.n_layers)]
    if start is not None:
        return one * sum(flags[start:start + n])
    return one * max(sum(flags[s:s + n]) for s in range(args.n_layers - n + 1))


def _window(values, n: int, start: int | None):
    """The sum of values[start:start + n], or (start None, while a split is searched) the most any n consecutive
    values sum to."""
    if start is not None:
        return sum(values[start:start + n])
    return max(sum(values[s:s + n]) for s in range(len(values) - n + 1))


def _weights_kv(args: ModelArgs, n: int, first: bool, last: bool, tokens: int, b: int, st: Storage | None,
                chunk: int = 1, start: int | None = None):
    kvw = args.kv_values()  # one position's K and V values in one layer
    rows = kv_rows(args, n, tokens, chunk, start)
    states = state_bytes(args, n, b, start)  # counted with the KV: what the stage holds for the prompt's positions
    if st is not None:
        layers = _window(st.per_layer, n, start) if st.per_layer else n * st.layer
        weights = int(layers) + st.scratch + (st.embed if first else 0)
        if last:
            weights += st.norm + (0 if args.tie_embeddings and first else st.head)
        if st.pool:  # a global layer holds the pool once; a window layer's ring and a state stay one a sequence
            per = [0 if args.is_linear(i) else st.pool if args.window(i) is None
                   else args.kv_positions(i, tokens, chunk) * st.seqs for i in range(args.n_layers)]
            return weights, int(kvw * _window(per, n, start) * st.kv_elem) + states * st.seqs
        return weights, (int(kvw * rows * st.kv_elem) + states) * st.seqs
    # A tied head on a stage that does not also hold the embedding keeps its own copy of it.
    if args.first_dense_layers or args.linear_layers is not None:
        # layers differ: GLM's first ones keep a dense MLP; Qwen3.5's linear-attention layers are not its full ones
        per = [args.layer_param_count(i) for i in range(args.n_layers)]
        weights = _window(per, n, start)
    else:
        weights = n * args.layer_param_count()
    if first:
        weights += args.vocab_size * args.dim
    if last:
        weights += args.dim + (args.vocab_size * args.dim if not (args.tie_embeddings and first) else 0)
    return weights * b, kvw * rows * b + states


def _need(args: ModelArgs, n: int, first: bool, last: bool, tokens: int, chunk: int, dtype: str,
          on_cpu: bool, with_head: bool, attention: str = "auto", storage: Storage | None = None,
          start: int | None = None) -> StageNeed:
    b = DTYPE_BYTES[dtype]
    f4 = 4
    dim, hd, nh, nkv, ffn, V = args.dim, args.head_dim, args.n_heads, args.n_kv_heads, args.ffn_dim, args.vocab_size
    q, kvw = nh * hd, nkv * hd
    qkv = q + 2 * kvw

    # -- weights: layers (+ q/k/v biases), embedding on the first stage, norm and head on the last,
    # as stored; KV cache: allocated once for every position (prompt + continuation), every layer held
    weights, kv = _weights_kv(args, n, first, last, tokens, b, storage, chunk, start)

    # -- one chunk's activations at their peak, in bytes per row. Alive through a block: the
    # stage's input rows and the block's input (2 rows of dim). Then the largest of the phases:
    norm = dim * b + 2 * dim * f4                       # RMSNorm: float32 copy and square, result
    rope = qkv * b + 4 * q * b                          # fused q/k/v out + rotate-half temporaries of q
    split = on_cpu or (cuda_attention(attention) == "cudnn-split" and b != f4)
    if split:  # two attention calls (prefix, own keys) merged by log-sum-exp in float32
        attn = qkv * b + (q + kvw) * b + 2 * q * b + 3 * q * f4 + 5 * nh * f4
    else:      # flash / memory-efficient SDPA: the output and its log-sum-exp
        attn = qkv * b + (q + kvw) * b + q * b + nh * f4
    attn += dim * b                                     # the normed input feeding it
    mlp = 2 * dim * b + 4 * ffn * b                     # residual, normed input, gate|up, silu, product
    per_row = 2 * dim * b + max(norm, rope + dim * b, attn, mlp)
    act = chunk * per_row + chunk * hd * (2 * b + 3 * f4)  # + rope cos/sin tables
    if args.latent:
        # MLA's expanded form (strata.models.mla.expanded): a block of prefix positions and the chunk's own as
        # per-head keys, padded values and kv_b's product, each merge's float32 output
        block = min(tokens, storage.prefix_block if storage is not None else tokens) + chunk
        act += block * nh * (2 * hd + hd - args.qk_rope_dim + args.v_head_dim) * b + chunk * q * 2 * f4
        if args.index_topk:  # DSA (strata.models.dsa): a chunk's index scores over the prefix, one budget's scores
            from strata.models.dsa import BUDGET      # and gathered latents, each in float32 at most
            act += chunk * tokens * f4 + 2 * BUDGET["cpu" if on_cpu else "cuda"] * f4
    if storage is not None and storage.kv_elem < b:
        # a cache narrower than the compute dtype (8-bit) is widened for each layer's attention, prefix_block
        # positions of the prefix at a time beside the chunk's own (strata.kernels.attention.narrow_cache_attention), and
        # each block's output and log-sum-exp wait for their merge
        act += args.kv_values() * (min(tokens, storage.prefix_block) + chunk) * b + chunk * (q * b + nh * f4)
    if last:
        # the final norm and head: blocked float32 logits for the NLL (logits in dtype, their
        # float32 copy, log-softmax), while the chunk's output rows stay alive
        rows = min(chunk, NLL_BLOCK) if with_head else 1
        head = rows * V * (b + (f4 if b != f4 else 0) + f4) + rows * (dim * b + 2 * dim * f4)
        act = max(act, chunk * 2 * dim * b + head)

    # -- hand-off: on CPU the shared-memory buffers this stage maps (in from above, out below,
    # or the result row and the token ids); a CUDA stage's are pinned host memory, not on the card
    handoff = 0
    if on_cpu:
        handoff += (0 if first else chunk * dim * b) + (V * f4 if last else chunk * dim * b)
        handoff += (tokens + 1) * 4
    runtime = CPU_RUNTIME_BYTES if on_cpu else CUDA_RUNTIME_BYTES
    tier = storage.prefix_device if storage is not None and not on_cpu else 0
    return StageNeed(weights, kv, act, handoff, runtime, storage.seqs if storage is not None else 1, tier)


def cuda_attention(choice: str = "auto") -> str:
    """The CUDA attention path a stage will take: the rig's `attention`, or for auto the model's default."""
    if choice != "auto":
        return choice
    from strata.kernels.attention import CUDA_ATTENTION_DEFAULT
    return CUDA_ATTENTION_DEFAULT


def stage_need(args: ModelArgs, start: int, end: int, tokens: int, chunk: int, dtype: str,
               host_handoff: bool = False, with_head: bool = True, attention: str = "auto",
               storage: Storage | None = None) -> StageNeed:
    """Bytes a stage holding layers [start, end) needs: `tokens` KV positions (prompt + continuation),
    chunks of at most `chunk` rows. `host_handoff`: a CPU stage (its hand-off buffers are host memory
    it maps; its activations take the CPU attention path). `with_head`: the perplexity's blocked logits."""
    return _need(args, end - start, start == 0, end == args.n_layers, tokens, chunk, dtype, host_handoff, with_head,
                 attention, storage, start)


# -- speed and cost ------------------------------------------------------------------------------
@dataclass(frozen=True)
class Speed:
    """A device's throughput: FLOP/s (calibrated) or relative units (the rig's `speed:`)."""
    linear: float
    attention: float
    head: float

    @classmethod
    def of(cls, s: "Speed | float") -> "Speed":
        return s if isinstance(s, Speed) else cls(float(s), float(s), float(s))

    def as_dict(self) -> dict:
        return {"linear": self.linear, "attention": self.attention, "head": self.head}


def layer_flops(args: ModelArgs, tokens: int) -> tuple[float, float]:
    """(linear, attention) FLOPs of one layer over a prompt of `tokens`."""
    return 2.0 * args.layer_active_params() * tokens, 2.0 * args.n_heads * args.head_dim * tokens * tokens


def head_flops(args: ModelArgs, tokens: int) -> float:
    return 2.0 * args.vocab_size * args.dim * tokens


def stage_time(args: ModelArgs, n: int, last: bool, speed: "Speed | float", tokens: int,
               with_head: bool = True) -> float:
    """Predicted time of a stage holding n layers (seconds when speed is in FLOP/s)."""
    s = Speed.of(speed)
    lin, att = layer_flops(args, tokens)
    t = n * (lin / s.linear + att / s.attention)
    if last and with_head:
        t += head_flops(args, tokens) / s.head
    return t


def predicted_times(args: ModelArgs, split: list[int], speeds: list, tokens: int,
                    with_head: bool = True) -> list[float]:
    return [stage_time(args, n, i == len(split) - 1, speeds[i], tokens, with_head) for i, n in enumerate(split)]


# -- the split -----------------------------------------------------------------------------------
def even_split(n_layers: int, n_stages: int) -> list[int]:
    base, extra = divmod(n_layers, n_stages)
    return [base + (1 if i < extra else 0) for i in range(n_stages)]


def _label(i: int, labels) -> str:
    return f"stage {i}" + (f" ({labels[i]})" if labels and labels[i] else "")


def _has(i: int, cap: int, notes) -> str:
    note = f"; {notes[i]}" if notes and notes[i] else ""
    return f"{cap:,} bytes ({_gib(cap)}{note})"


def plan_split(args: ModelArgs, n_stages: int, speeds: list, caps: list[int | None], tokens: int, chunk: int,
               dtype: str, host_handoff: list[bool] | None = None, with_head: bool = True,
               prompt_tokens: int | None = None, labels: list[str] | None = None,
               cap_notes: list[str] | None = None, attention: str = "auto",
               storage: list[Storage | None] | None = None) -> list[int]:
    """Optimal contiguous split (layer counts per stage), by dynamic programming.

    Minimises the slowest stage's predicted time subject to every stage's memory cap; among the
    splits that reach that minimum, the one with the least total time (the pipeline's fill and
    drain). `tokens`: KV positions (memory); `prompt_tokens` (default `tokens`): the work.
    Raises PlanError naming the stage that cannot fit and its bytes, broken down.
    """
    L, S = args.n_layers, n_stages
    host = host_handoff or [False] * S
    st = storage or [None] * S
    work = tokens if prompt_tokens is None else prompt_tokens
    if S > L:
        raise PlanError(f"{S} stages but the model has only {L} layers")
    nmax = L - (S - 1)  # every other stage holds at least one layer
    INF = float("inf")
    # time and fit of stage i holding n layers: position only matters through first / last
    t = [[INF] * (nmax + 1) for _ in range(S)]
    for i in range(S):
        for n in range(1, nmax + 1):
            need = _need(args, n, i == 0, i == S - 1, tokens, chunk, dtype, host[i], with_head, attention, st[i])
            if caps[i] is not None and need.total > caps[i]:
                break  # needs grow with n: no larger count fits either
            t[i][n] = stage_time(args, n, i == S - 1, speeds[i], work, with_head)

    def solve(threshold: float | None) -> tuple[float, list[int]] | None:
        # best[i][a]: stages i.. covering layers [a, L): min of max time (threshold None), or
        # min of total time with every stage under threshold
        best = [[INF] * (L + 1) for _ in range(S + 1)]
        pick = [[0] * (L + 1) for _ in range(S + 1)]
        best[S][L] = 0.0
        for i in range(S - 1, -1, -1):
            for a in range(i, L - (S - 1 - i)):
                for n in range(1, min(nmax, L - (S - 1 - i) - a) + 1):
                    ti, rest = t[i][n], best[i + 1][a + n]
                    if ti == INF:
                        break
                    if rest == INF or args.stage_start_refusal(a + n) is not None:
                        continue
                    if threshold is None:
                        v = max(ti, rest)
                    elif ti > threshold:
                        continue
                    else:
                        v = ti + rest
                    if v < best[i][a]:
                        best[i][a], pick[i][a] = v, n
        if best[0][0] == INF:
            return None
        split, a = [], 0
        for i in range(S):
            split.append(pick[i][a])
            a += pick[i][a]
        return best[0][0], split

    first = solve(None)
    if first is None:
        raise PlanError(explain_no_fit(args, S, caps, tokens, chunk, dtype, host, with_head, labels, cap_notes,
                                       attention, storage))
    bottleneck = first[0]
    second = solve(bottleneck * (1 + 1e-12))
    return second[1] if second is not None else first[1]


def max_layers(args: ModelArgs, i: int, n_stages: int, cap: int | None, tokens: int, chunk: int, dtype: str,
               on_cpu: bool, with_head: bool = True, attention: str = "auto", storage: Storage | None = None) -> int:
    """The most layers stage i of n_stages can hold under `cap` (0: not even one)."""
    nmax = args.n_layers - (n_stages - 1)
    if cap is None:
        return nmax
    m = 0
    for n in range(1, nmax + 1):
        if _need(args, n, i == 0, i == n_stages - 1, tokens, chunk, dtype, on_cpu, with_head, attention,
                 storage).total > cap:
            break
        m = n
    return m


def explain_no_fit(args: ModelArgs, n_stages: int, caps: list[int | None], tokens: int, chunk: int, dtype: str,
                   host_handoff: list[bool] | None = None, with_head: bool = True, labels=None,
                   cap_notes=None, attention: str = "auto", storage: list[Storage | None] | None = None) -> str:
    """Why no contiguous split fits: the tightest stage under the most favourable split.

    A stage's need grows with its layer count and otherwise depends only on whether it is first
    or last, so a split exists iff every stage fits one layer and the most each can hold sums
    to at least the model's layers. When it does not, giving every other stage its most leaves
    stage j the fewest layers it could possibly take; the stage named is the one that misses by
    the fewest bytes then. Its need is a lower bound over all splits."""
    L, S = args.n_layers, n_stages
    host = host_handoff or [False] * S
    st = storage or [None] * S

    def need(i, n):
        return _need(args, n, i == 0, i == S - 1, tokens, chunk, dtype, host[i], with_head, attention, st[i])

    m = [max_layers(args, i, S, caps[i], tokens, chunk, dtype, host[i], with_head, attention, st[i])
         for i in range(S)]
    for i in range(S):
        if m[i] == 0:
            nd = need(i, 1)
            return (f"no layer split fits: {_label(i, labels)} needs {nd.total:,} bytes ({_gib(nd.total)}) even "
                    f"with a single layer ({nd.describe()}) but has {_has(i, caps[i], cap_notes)}")
    if sum(m) >= L:  # cannot happen when called after the DP failed; kept for direct callers
        return "no layer split fits the stages' memory"
    worst = None
    for j in range(S):
        if caps[j] is None:
            continue
        n = L - (sum(m) - m[j])
        nd = need(j, n)
        over = nd.total - caps[j]
        if worst is None or over < worst[0]:
            worst = (over, j, n, nd)
    _, j, n, nd = worst
    per = ", ".join(f"{m[i]}" for i in range(S))
    return (f"no layer split fits: the stages hold at most {sum(m)} of the model's {L} layers (at most {per} "
            f"per stage); even with the most favourable split {_label(j, labels)} must take {n} layers and needs "
            f"{nd.total:,} bytes ({_gib(nd.total)}: {nd.describe()}) but has {_has(j, caps[j], cap_notes)}")


def check_split(args: ModelArgs, split: list[int], caps: list[int | None], tokens: int, chunk: int,
                dtype: str, host_handoff: list[bool] | None = None, prefix: str = "", with_head: bool = True,
                labels: list[str] | None = None, cap_notes: list[str] | None = None,
                attention: str = "auto", storage: list[Storage | None] | None = None) -> str | None:
    """None if every stage fits; else one line naming the first stage that does not."""
    host = host_handoff or [False] * len(split)
    st = storage or [None] * len(split)
    a = 0
    for i, n in enumerate(split):
        need = stage_need(args, a, a + n, tokens, chunk, dtype, host[i], with_head, attention, st[i])
        if caps[i] is not None and need.total > caps[i]:
            return (f"{prefix}{_label(i, labels)} (layers {a}-{a + n - 1}) needs {need.total:,} bytes "
                    f"({_gib(need.total)}: {need.describe()}) but has {_has(i, caps[i], cap_notes)}")
        a += n
    return None


def stage_needs(args: ModelArgs, split: list[int], tokens: int, chunk: int, dtype: str,
                host_handoff: list[bool] | None = None, with_head: bool = True,
                attention: str = "auto", storage: list[Storage | None] | None = None) -> list[StageNeed]:
    host = host_handoff or [False] * len(split)
    st = storage or [None] * len(split)
    out, a = [], 0
    for i, n in enumerate(split):
        out.append(stage_need(args, a, a + n, tokens, chunk, dtype, host[i], with_head, attention, st[i]))
        a += n
    return out
