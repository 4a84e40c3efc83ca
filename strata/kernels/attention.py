"""Attention of a chunk after a cached prefix (prefill) and of one decode row, RoPE on q/k rows, and the KV cache's dtype.

Knows nothing of layers or stages: tensors in, tensors out. The CUDA paths are arguments (`cuda_path`, `fused`),
which the model's layers take from the rig's `attention` and `kernels.prefill`; so is `triton_state`, the caller's
strata.triton_state.TritonState, on which a strata.kernels.fused kernel that fails falls back (None: no holder, the kernel
is tried on every call)."""
from __future__ import annotations

import logging
import time

import torch
import torch.nn.functional as F

from strata.triton_state import TritonState

# The CUDA prefill attention of `attention: auto`. "flash": one lower-right causal call. "cudnn-split": the cached
# prefix unmasked plus the chunk's own keys causal and square, both through cuDNN (its fast cases; performance.md).
CUDA_ATTENTION_DEFAULT = "cudnn-split"


def apply_rope(x: torch.Tensor, cos: torch.Tensor, ssin: torch.Tensor, fused: bool = True,
               triton_state: TritonState | None = None) -> torch.Tensor:
    """Rotate-half RoPE (HF layout; GGUF q/k rows are un-permuted on load): one Triton kernel on CUDA
    (strata.kernels.fused.rope), else 3 torch ops instead of the textbook 5.

    x: (1, T, heads, hd), any strides; cos, ssin: (T, 1, hd), ssin from `_signed_sin`. cat((-x2, x1)) * sin
    is cat((x2, x1)) * cat((-sin1, sin2)), the same products; the swap is a cat (not a roll, which copies a
    strided x first). Returns a new contiguous (1, T, heads, hd) tensor. cos narrower than hd: partial rotary,
    the first cos.shape[-1] values of each head rotate, the rest pass. fused=False: the torch formula on CUDA too
    (kernels.prefill: torch, the A/B)."""
    if cos.shape[-1] < x.shape[-1]:
        r = cos.shape[-1]
        return torch.cat((apply_rope(x[..., :r], cos, ssin, fused, triton_state), x[..., r:]), -1)
    if x.is_cuda and fused:
        from strata.kernels.fused import rope
        y = rope(x, cos, ssin, triton_state)  # one pass instead of three
        if y is not None:
            return y
    half = x.shape[-1] // 2
    return torch.addcmul(x * cos, torch.cat((x[..., half:], x[..., :half]), dim=-1), ssin)


def chunk_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pos: int, scale: float | None = None,
                    cuda_path: str = CUDA_ATTENTION_DEFAULT, fused: bool = True,
                    triton_state: TritonState | None = None, cudnn_shapes=None) -> torch.Tensor:
    """Queries of one chunk at `pos` against keys [0, pos + T): causal, bottom-right aligned.

    q: (1, nh, T, hd); k, v: (1, nkv, pos + T, hd); scale: of q.k (None: hd ** -0.5). Never builds a dense
    (T, pos + T) mask. cuda_path: "flash" or "cudnn-split" on CUDA (the rig's `attention`); fused: the split's
    log-sum-exp merge as one Triton kernel (kernels.prefill). cudnn_shapes: the (pos, T) chunks the split takes
    (the warm-up's schedules, Attention.cudnn_shapes); any other takes flash (None: every chunk takes the split).
    """
    T, S = q.shape[2], k.shape[2]
    if pos == 0:  # square: top-left and bottom-right alignment coincide
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True, scale=scale)
    if q.is_cuda:
        if cuda_path == "cudnn-split" and q.dtype != torch.float32:
            # cuDNN builds a graph for every new shape: 0.16-0.2 s on an H100 for the 8B's question after a restored
            # 16,384-token document (2026-12-06), where its attention takes ~1 ms. A chunk outside the schedules
            # the warm-up built (a prompt's last partial chunk, a question after a restored prefix) takes torch's
            # flash kernel for both parts, which builds nothing
            kept = cudnn_shapes is None or (pos, T) in cudnn_shapes
            return _split_attention(q, k, v, pos, _cudnn_with_lse if kept else _flash_with_lse, scale, fused,
                                    triton_state)
        # flash (memory-efficient for fp32) handles the lower-right alignment natively.
        # Imported here: torch.nn.attention.bias pulls in dynamo, ~1 s at every process start.
        from torch.nn.attention.bias import causal_lower_right
        return F.scaled_dot_product_attention(q, k, v, attn_mask=causal_lower_right(T, S), enable_gqa=True,
                                              scale=scale)
    # CPU: the lower-right bias would materialise a mask; split instead
    return _split_attention(q, k, v, pos, _cpu_with_lse, scale, fused, triton_state)


# cached positions of an 8-bit (or otherwise narrower) cache widened at once for a chunk's attention: the prefix goes
# in blocks, so a stage holds one block's keys and values in the compute dtype, not the context's (a 32B-class
# layer at 131,072 positions: 64 MiB against 0.5 GiB). The least a stage takes: the planner gives a CUDA stage
# the whole context where its memory holds that (Attention.prefix_block), since one attention call over the
# widened prefix is faster than blocks merged by log-sum-exp (8B, 122,880 tokens, one H200: prefill at 97 % of a
# bf16 cache's with the whole prefix on 2026-12-03, 89 % in blocks of 16,384 on 2026-12-05)
PREFIX_BLOCK = 16384


def narrow_cache_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, pos: int,
                           scale: float | None = None, fused: bool = True, remainder: str = "flash",
                           triton_state: TritonState | None = None, block: int = PREFIX_BLOCK) -> torch.Tensor:
    """chunk_attention of q (1, nh, T, hd) at `pos` against a cache narrower than q's dtype (global rows:
    position p in row p), widening it `block` positions at a time: the chunk's own keys causal, then each
    block of the prefix, merged by their log-sum-exps (on CUDA one Triton pass per merge).
    remainder: the kernel of the last, partial block on CUDA. Its length changes with every chunk, and cuDNN
    builds a graph per shape (32B widths, chunk 448: 55 ms a new shape against 1.1 ms warm, one H200); torch's
    flash kernel builds none (1.2 ms) and is what it takes ("flash"); "cudnn" was its arm."""
    T, dt = q.shape[2], q.dtype
    ts = triton_state
    out, lse = _with_lse(q, from_cache(k_cache[:, :, pos:pos + T], dt, ts),
                         from_cache(v_cache[:, :, pos:pos + T], dt, ts), True, scale)
    lse = lse.float()
    for a in range(0, pos, block):
        b = min(pos, a + block)
        kb, vb = from_cache(k_cache[:, :, a:b], dt, ts), from_cache(v_cache[:, :, a:b], dt, ts)
        if remainder == "flash" and q.is_cuda and b - a < block:
            o, l = _flash_packed_with_lse(q, kb, vb, scale)
        else:
            o, l = _with_lse(q, kb, vb, False, scale)
        l = l.float()
        merged = None
        if q.is_cuda and fused:
            from strata.kernels.fused import lse_merge
            merged = lse_merge(o, l, out, lse, ts)
        out = merge_lse(o, l, out, lse) if merged is None else merged
        lse = torch.logaddexp(lse, l)
    return out


def sink_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pos: int, sinks: torch.Tensor,
                   scale: float | None = None) -> torch.Tensor:
    """chunk_attention with gpt-oss's sinks: a per-head logit (nh,) in every softmax's denominator with no
    value, so each output row is scaled by sigmoid(lse - sink). The prefix and the chunk's own keys as two
    flash-type calls (causal only in the second) merged by their log-sum-exps, as _split_attention: no mask
    over the prefix, work and memory as a plain chunk's."""
    if pos == 0:
        out, lse = _with_lse(q, k, v, True, scale)
    else:
        out_p, lse_p = _with_lse(q, k[:, :, :pos], v[:, :, :pos], False, scale)
        out_s, lse_s = _with_lse(q, k[:, :, pos:], v[:, :, pos:], True, scale)
        lse = torch.logaddexp(lse_p.float(), lse_s.float())
        out = out_p.float() * torch.exp(lse_p - lse).unsqueeze(-1) + out_s.float() * torch.exp(lse_s - lse).unsqueeze(-1)
    lse = lse.float().view(1, q.shape[1], q.shape[2])
    return _sink_scaled(out, lse, sinks, q.dtype)


def _sink_scaled(out: torch.Tensor, lse: torch.Tensor, sinks: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Attention rows out (.., nh, T, hd) with gpt-oss's sinks (nh,) in their softmax's denominator: each row scaled
    by sigmoid(lse - sink), lse (.., nh, T) their log-sum-exp; float32 inside, rounded once to dtype."""
    return (out.float() * torch.sigmoid(lse.float() - sinks.float()[:, None]).unsqueeze(-1)).to(dtype)


def _with_lse(q, k, v, causal: bool, scale=None):
    """(out, lse (1, nh, T)) of q against k, v (causal: top-left aligned, q and k the same length): cuDNN on CUDA
    in 16 bits (grouped-query natively), else the memory-efficient kernel with the kv heads repeated; the CPU's
    flash kernel."""
    if not q.is_cuda:
        return _cpu_with_lse(q, k, v, causal, scale)
    if q.dtype != torch.float32:
        try:
            return _cudnn_with_lse(q, k, v, causal, scale)
        except RuntimeError:  # a shape or build cuDNN refuses: the kernel below
            pass
    g = q.shape[1] // k.shape[1]
    if g > 1:
        k, v = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
    out, lse = torch.ops.aten._scaled_dot_product_efficient_attention(q, k, v, None, True, 0.0, causal,
                                                                     scale=scale)[:2]
    return out, lse[:, :, :q.shape[2]]


def attention_with_lse(q, k, v, causal: bool, scale=None):
    """(out, log-sum-exp) of q (1, nh, T, hd) against k, v (1, nkv, S, hd) (causal: q and k the same length): a
    part of an attention that merge_lse joins with the others (MLA's blocks of expanded keys)."""
    return _with_lse(q, k, v, causal, scale)


# queries per call of window_attention: its mask and scores are (rows, rows + window - 1) a head
WINDOW_ROWS = 1024


def window_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, pos: int, window: int,
                     scale: float | None = None, sinks: torch.Tensor | None = None,
                     kernel: str = "band", triton_state: TritonState | None = None) -> torch.Tensor:
    """Queries at [pos, pos + T) of a sliding-window layer, whose keys are cached: the query at p sees keys
    (p - window, p].

    q: (1, nh, T, hd); k_cache, v_cache: (1, nkv, S, hd), position p in row p % S (a ring when S is shorter than
    the prompt; S >= window + T - 1, so the chunk's rows overwrote none it reads). In blocks of WINDOW_ROWS
    queries, each against its band of keys only (a view, or gathered where the band wraps round the ring),
    widened to q's dtype, with a boolean band mask: memory and work grow with the window, not the prefix.
    sinks (nh,): gpt-oss's per-head logit in every softmax's denominator with no value: each output row is
    scaled by sigmoid(lse - sink), from the attention's log-sum-exp (a layer without a window passes
    window = pos + T). kernel: "flex" (kernels.window_attention) takes FlexAttention where it runs (CUDA, 16 bits:
    flex_unavailable), whose block mask skips the band's masked-out work; "band", or where flex cannot, the above."""
    if kernel == "flex" and q.is_cuda and q.dtype in _FLEX_DTYPES and flex_failure(triton_state) is None:
        try:
            return flex_window_attention(q, k_cache, v_cache, pos, window, scale, sinks, triton_state=triton_state)
        except torch.cuda.OutOfMemoryError:
            raise  # the band would need more memory, not less
        except Exception as e:  # noqa: BLE001 - a compile or launch this torch cannot do: the band from now on
            _flex_fail(e, triton_state)
    T, S = q.shape[2], k_cache.shape[2]
    out = torch.empty_like(q)
    for a in range(0, T, WINDOW_ROWS):
        b = min(T, a + WINDOW_ROWS)
        k0 = max(0, pos + a + 1 - window)  # the block's first query's first key
        n, s = pos + b - k0, k0 % S
        if s + n <= S:
            ks, vs = k_cache[:, :, s:s + n], v_cache[:, :, s:s + n]
        else:
            rows = torch.arange(k0, pos + b, device=q.device) % S
            ks, vs = k_cache.index_select(2, rows), v_cache.index_select(2, rows)
        if ks.dtype != q.dtype:
            ks, vs = from_cache(ks, q.dtype, triton_state), from_cache(vs, q.dtype, triton_state)
        if q.is_cuda and ks.shape[1] != q.shape[1]:
            # CUDA's masked kernel (memory-efficient) has no grouped-query path: without this the band would go to
            # the math backend, which materializes the scores. The band's keys are few: repeating them is cheap
            g = q.shape[1] // ks.shape[1]
            ks, vs = ks.repeat_interleave(g, 1), vs.repeat_interleave(g, 1)
        qp = torch.arange(pos + a, pos + b, device=q.device)[:, None]
        kp = torch.arange(k0, pos + b, device=q.device)[None]
        band = (kp <= qp) & (kp > qp - window)
        if sinks is None:
            out[:, :, a:b] = F.scaled_dot_product_attention(q[:, :, a:b], ks, vs, attn_mask=band, enable_gqa=True,
                                                             scale=scale)
            continue
        y, lse = _masked_with_lse(q[:, :, a:b], ks, vs, band, scale)
        out[:, :, a:b] = _sink_scaled(y, lse, sinks, q.dtype)
    return out


def _masked_with_lse(q, k, v, band, scale):
    """Attention of q (1, nh, T, hd) over k, v (1, nh or nkv, S, hd) where band (T, S) is true -> (out, lse
    (nh, T) float32)."""
    if q.is_cuda:  # memory-efficient attention returns its log-sum-exp (padded past T); its bias rows must start
        # 16-byte aligned: a view of rows padded to a multiple of 8 keys
        S = band.shape[1]
        full = torch.zeros(band.shape[0], -(-S // 8) * 8, dtype=q.dtype, device=q.device)
        bias = full[:, :S].masked_fill_(~band, float("-inf"))
        out, lse = torch.ops.aten._scaled_dot_product_efficient_attention(
            q, k, v, bias.expand(1, q.shape[1], *band.shape), True, 0.0, False, scale=scale)[:2]
        return out, lse[0, :, :q.shape[2]]
    bias = torch.zeros(band.shape, dtype=q.dtype, device=q.device).masked_fill(~band, float("-inf"))
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, False, attn_mask=bias,
                                                                           scale=scale)
    return out, lse.view(q.shape[1], q.shape[2])


# kernels.window_attention: "flex". FlexAttention runs compiled, once per process and query shape (dynamic=False):
# a chunk's queries are padded to a bucket (flex_rows: FLEX_ROWS, its block size, then powers of two and 1.5 times
# them), so a prompt's last, shorter chunk and dynamic chunks reuse a few compiled kernels; the padded rows are
# computed and dropped (under a third of a chunk's window attention). The window's offsets are tensors the mask
# reads, not constants the compile would specialize on.
FLEX_ROWS = 128
_FLEX_DTYPES = (torch.bfloat16, torch.float16)
_flex = None  # (compiled flex_attention, eager flex_attention, create_block_mask, AuxRequest or None)
_block_masks: dict = {}  # (device, query rows, window, rows before position 0) -> BlockMask
BLOCK_MASKS = 64  # held at most (a long prompt uses one or two; the first chunks of a large window a few more)


def flex_rows(T: int) -> int:
    """The query rows a chunk of T rows is padded to for FlexAttention (one compile each): 128, 256, 384, 512, 768,
    1024, 1536, ...: whole blocks, a few dozen buckets up to any chunk."""
    p = max(FLEX_ROWS, 1 << (T - 1).bit_length())  # the power of two at or above T
    return p * 3 // 4 if p >= 4 * FLEX_ROWS and p * 3 // 4 >= T else p


def _flex_fns():
    global _flex
    if _flex is None:
        # imported on first use: it pulls in dynamo (~1 s), which a CPU stage never needs
        import torch._dynamo
        from torch.nn.attention import flex_attention as fa
        # dynamo keeps one compile per query bucket (and window) of flex_attention's one code object, 8 by default;
        # past that it would run flex eagerly, which materializes the scores: allow every bucket up to 2^17 rows
        cfg = torch._dynamo.config
        limit = "recompile_limit" if hasattr(cfg, "recompile_limit") else "cache_size_limit"
        setattr(cfg, limit, max(getattr(cfg, limit), 32))
        _flex = (torch.compile(fa.flex_attention, dynamic=False), fa.flex_attention, fa.create_block_mask,
                 getattr(fa, "AuxRequest", None))  # AuxRequest replaces return_lse (torch 2.9 on; both in 2.11-2.13)
    return _flex


def flex_unavailable(device, dtype: torch.dtype, state: TritonState | None = None) -> str | None:
    """Why kernels.window_attention=flex takes the band on this device and dtype (None: flex runs): it is compiled
    for CUDA in 16 bits; CPU stages and float32 keep the band; or it failed for the holder of `state`."""
    if torch.device(device).type != "cuda":
        return f"FlexAttention is taken on CUDA only, not {torch.device(device).type}"
    if dtype not in _FLEX_DTYPES:
        return f"FlexAttention is taken in bfloat16 or float16 only, not {str(dtype).removeprefix('torch.')}"
    if flex_failure(state) is not None:
        return flex_failure(state)
    try:
        _flex_fns()
    except ImportError as e:
        return f"torch.nn.attention.flex_attention is not importable ({e})"
    return None


def flex_failure(state: TritonState | None) -> str | None:
    """Why the flex path stopped for the holder of `state` (a failed compile or launch), or None; without a
    holder a call tries flex every time, as strata.kernels.fused' calls do."""
    return None if state is None else state.flex_failed


def _flex_fail(e: Exception, state: TritonState | None) -> None:
    why = f"FlexAttention failed ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})"
    if state is not None:
        state.flex_failed = why  # this model's window layers take the band from now on; another model still tries
    logging.getLogger("strata.kernels.attention").warning("%s; window layers take the band path", why)


def flex_window_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, pos: int, window: int,
                          scale: float | None = None, sinks: torch.Tensor | None = None,
                          compiled: bool = True, triton_state: TritonState | None = None) -> torch.Tensor:
    """window_attention's queries by FlexAttention: the chunk's rows padded to a bucket of Tp rows, keys of
    positions [pos + 1 - window, pos + Tp) in position order (_window_rows), and a block mask of causal-within-the-
    window in those coordinates, so only blocks the band touches are computed. Grouped-query natively (enable_gqa);
    sinks from the returned log-sum-exp (natural log: the wrapper converts its kernels' base-2 one in every torch
    that has it), as the band does. compiled=False: flex_attention eager (CPU tests: torch compiles it for CPU
    without the log-sum-exp only); it materializes the scores."""
    compiled_fn, eager_fn, create_block_mask, aux = _flex_fns()
    _, nh, T, hd = q.shape
    Tp = flex_rows(T)
    n = Tp + window - 1
    keys, vals = (_window_rows(c, q.dtype, pos, T, window, n, triton_state) for c in (k_cache, v_cache))
    qp = q
    if T != Tp or q.stride() != (T * nh * hd, hd, nh * hd, 1):
        # padded in PrefillOps.attend's layout (1, T, nh, hd): one layout, one compile per bucket
        qp = q.new_zeros(1, Tp, nh, hd).transpose(1, 2)
        qp[:, :, :T] = q
    lead = max(0, window - 1 - pos)  # key rows before position 0 (zeros)
    key = (q.device, Tp, window, lead)
    bm = _block_masks.get(key)
    if bm is None:
        if len(_block_masks) >= BLOCK_MASKS:
            _block_masks.clear()
        w = torch.tensor(window, device=q.device)
        first = torch.tensor(lead, device=q.device)

        def band(b, h, qi, ki):
            # query row qi is position pos + qi, key row ki position pos + 1 - window + ki: the query sees key rows
            # [qi, qi + window), those at positions >= 0
            return (ki >= qi) & (ki < qi + w) & (ki >= first)

        bm = _block_masks[key] = create_block_mask(band, None, None, Tp, n, device=q.device)
    fn = compiled_fn if compiled else eager_fn
    kw = dict(block_mask=bm, scale=scale, enable_gqa=True)
    if sinks is None:
        return fn(qp, keys, vals, **kw)[:, :, :T]
    if aux is not None:
        out, lse = fn(qp, keys, vals, return_aux=aux(lse=True), **kw)
        lse = lse.lse
    else:
        out, lse = fn(qp, keys, vals, return_lse=True, **kw)
    out, lse = out[:, :, :T], lse[:, :, :T]
    return _sink_scaled(out, lse, sinks, q.dtype)


def _window_rows(cache: torch.Tensor, dtype: torch.dtype, pos: int, T: int, window: int, n: int,
                 triton_state: TritonState | None = None) -> torch.Tensor:
    """(1, heads, n, hd) in dtype: the cached rows of positions [pos + 1 - window, pos + 1 - window + n) in position
    order (a slice of the ring, or two where it wraps), zeros where no position is cached (before 0, and past the
    chunk: the padded queries'). Always a new contiguous tensor, so the compiled kernel sees one layout; it is
    (Tp + window) rows a kv head, small beside the attention."""
    S = cache.shape[2]
    start, end = pos + 1 - window, pos + T
    k0 = max(0, start)
    s = k0 % S
    first = min(end - k0, S - s)
    parts = [cache[:, :, s:s + first]]
    if first < end - k0:  # the ring wraps inside [k0, end)
        parts.append(cache[:, :, :end - k0 - first])
    if cache.dtype != dtype:
        parts = [from_cache(p, dtype, triton_state) for p in parts]
    hd = parts[0].shape[3]
    if k0 > start:
        parts.insert(0, torch.zeros(1, cache.shape[1], k0 - start, hd, dtype=dtype, device=cache.device))
    if start + n > end:
        parts.append(torch.zeros(1, cache.shape[1], start + n - end, hd, dtype=dtype, device=cache.device))
    return torch.cat(parts, 2)


def store_rows(cache: torch.Tensor, x: torch.Tensor, pos: int) -> None:
    """x (1 or none, heads, T, hd) into the cache's rows for positions [pos, pos + T): row p % S, in one or two
    slices (a window layer's ring wraps). Casts (fp8: clamped first; q8_0: quantized; see to_cache)."""
    S, T = cache.shape[2], x.shape[-2]
    if cache.dtype != x.dtype:
        x = to_cache(x, cache.dtype)
    s = pos % S
    first = min(T, S - s)
    cache.narrow(2, s, first).copy_(x.narrow(-2, 0, first))
    if first < T:
        cache.narrow(2, 0, T - first).copy_(x.narrow(-2, first, T - first))


def _split_attention(q, k, v, pos, attend, scale=None, fused=True, triton_state=None):
    """Attention over [prefix | own chunk] as two calls merged by their log-sum-exp. fused: on CUDA the merge in
    one Triton pass (strata/kernels/fused.py) instead of ~8 float32 kernels; the torch formula where Triton is missing."""
    out_p, lse_p = attend(q, k[:, :, :pos], v[:, :, :pos], False, scale)
    out_s, lse_s = attend(q, k[:, :, pos:], v[:, :, pos:], True, scale)
    if q.is_cuda and fused:
        from strata.kernels.fused import lse_merge
        out = lse_merge(out_p, lse_p, out_s, lse_s, triton_state)
        if out is not None:
            return out
    return merge_lse(out_p, lse_p, out_s, lse_s)


def merge_lse(out_p, lse_p, out_s, lse_s):
    """Two attention parts over disjoint keys, (1, nh, T, hd) each with its log-sum-exp (1, nh, T), as
    one: each weighted by its share of the softmax, in float32, rounded once to the parts' dtype."""
    lse = torch.logaddexp(lse_p, lse_s)
    w_p = torch.exp(lse_p - lse).unsqueeze(-1)
    w_s = torch.exp(lse_s - lse).unsqueeze(-1)
    return (out_p.float() * w_p + out_s.float() * w_s).to(out_p.dtype)


def _cpu_with_lse(q, k, v, causal, scale=None):
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, scale=scale)
    return out, lse


def _flash_packed_with_lse(q, k, v, scale=None):
    """Unmasked (out, lse) by torch's flash kernel, which builds nothing per shape: each kv head's g query heads
    as g*T query rows of one head (exact without a mask: a row's position does not matter)."""
    _, nh, T, hd = q.shape
    nkv = k.shape[1]
    qp = q.contiguous().view(1, nkv, nh // nkv * T, hd)
    try:
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention(qp, k, v, 0.0, False, False, scale=scale)[:2]
    except RuntimeError:  # a GPU or head dim without torch's flash kernel
        return _with_lse(q, k, v, False, scale)
    return out.reshape(1, nh, T, hd), lse.reshape(1, nh, T)  # (whatever layout the kernel gave out in)


def _flash_with_lse(q, k, v, causal, scale=None):
    """(out, lse) by torch's flash kernel: unmasked with the query heads packed (_flash_packed_with_lse), or causal
    (q and k the same length: a chunk's own keys, few) with the kv heads repeated."""
    if not causal:
        return _flash_packed_with_lse(q, k, v, scale)
    g = q.shape[1] // k.shape[1]
    kg, vg = (k, v) if g == 1 else (k.repeat_interleave(g, 1), v.repeat_interleave(g, 1))
    try:
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention(q, kg, vg, 0.0, True, False, scale=scale)[:2]
    except RuntimeError:  # a GPU or head dim without torch's flash kernel
        return _with_lse(q, k, v, True, scale)
    return out, lse.view(q.shape[:3])


def _cudnn_with_lse(q, k, v, causal, scale=None):
    # grouped-query attention natively: fewer key/value heads than query heads, no expansion
    out, lse = torch.ops.aten._scaled_dot_product_cudnn_attention(q, k, v, None, True, 0.0, causal, False,
                                                                  scale=scale)[:2]
    return out, lse.view(q.shape[:3])



def decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None = None) -> torch.Tensor:
    """One query row at the last position against all keys k, v (1, nkv, S, hd): nothing masked.

    q: (1, nh, 1, hd) or already (1, nkv, g, hd). Grouped-query attention runs as plain multi-head
    attention: a kv head's g query heads are g query rows against it, so no backend needs GQA
    support and each key is read once. One call, no split; on CUDA flash (efficient for fp32),
    whose kernels do not depend on the key length (cuDNN builds a graph per length)."""
    nkv, hd = k.shape[1], k.shape[3]
    qg = q.reshape(1, nkv, -1, hd)
    if q.is_cuda:
        try:
            if q.dtype in (torch.float16, torch.bfloat16):
                out = torch.ops.aten._scaled_dot_product_flash_attention(qg, k, v, scale=scale)[0]
            else:
                out = torch.ops.aten._scaled_dot_product_efficient_attention(qg, k, v, None, False, scale=scale)[0]
        except RuntimeError:  # a shape or GPU those kernels refuse: the generic dispatcher
            out = F.scaled_dot_product_attention(qg, k, v, scale=scale)
    else:
        out = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(qg, k, v, 0.0, False, scale=scale)[0]
    return out.reshape(q.shape)


# From this many cached positions a CPU decode step attends over a bfloat16 cache as is (below, widening the
# prefix and the float32 flash kernel were faster on SmolLM2: 512 positions, 7.9 vs 11.7 ms a stage)
BF16_ATTENTION_FROM = 2048


def _bf16_cache_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None = None) -> torch.Tensor:
    """One query row (1, nh, hd) against a bfloat16 CPU cache k, v (1, nkv, S, hd) -> (1, nh * hd) bfloat16.

    Per kv head two bfloat16 GEMMs and a float32 softmax: at long contexts a decode step streams the cache
    from memory, and this reads it in half the bytes. Per head, because a batched GEMM over the narrowed
    cache (heads max_len apart) is slower than the float32 flash kernel; the flash kernel on bfloat16
    is slower still. The scores are rounded to bfloat16 before the softmax (relative 4e-3), as the cache is."""
    nkv, hd = k.shape[1], k.shape[3]
    qg = (q * (hd ** -0.5 if scale is None else scale)).to(torch.bfloat16).view(nkv, -1, hd)  # a kv head's query rows
    out = torch.empty(qg.shape, dtype=torch.bfloat16)
    for j in range(nkv):
        p = torch.mm(qg[j], k[0, j].t()).softmax(-1, dtype=torch.float32).to(torch.bfloat16)
        torch.mm(p, v[0, j], out=out[j])
    return out.view(1, -1)


def rope_tables(cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Transformer.rope's (T, hd) rows as every layer reads them: cos and signed sin (T, 1, hd), made once per
    chunk or step, not once per layer."""
    return cos[:, None], _signed_sin(sin[:, None])


def _signed_sin(sin: torch.Tensor) -> torch.Tensor:
    """sin with its first half negated, once per step: rotate_half(x) * sin == roll(x) * signed_sin, bit for bit."""
    half = sin.shape[-1] // 2
    return torch.cat((-sin[..., :half], sin[..., half:]), dim=-1)


def rope_rows(x: torch.Tensor, cos: torch.Tensor, ssin: torch.Tensor) -> torch.Tensor:
    # x: (T, heads, hd); cos, ssin: (T, 1, hd), ssin from _signed_sin. The rotate-half form of apply_rope on all
    # heads at once, in 3 ops instead of 5 (a decode step is bound by per-op dispatch): cat((-x2, x1)) * sin is
    # cat((x2, x1)) * cat((-sin1, sin2)), the same products, and cat((x2, x1)) is a roll by half
    if cos.shape[-1] < x.shape[-1]:  # partial rotary: the rest of each head passes
        r = cos.shape[-1]
        return torch.cat((rope_rows(x[..., :r], cos, ssin), x[..., r:]), -1)
    return torch.addcmul(x * cos, x.roll(x.shape[-1] // 2, -1), ssin)


# cuDNN builds (and caches, process-wide) an execution graph per attention shape, and each chunk of a prompt
# meets a new cached-prefix length (and, with dynamic chunks, a new own-chunk length), so a cold prefill pays one
# set-up per chunk (8B, 122,880 tokens: 14.2 s cold vs 10.2 s warm, performance.md). Bounded: at most
# WARM_CHUNKS chunk shapes and WARM_BUDGET_S seconds of host time are spent building them ahead.
WARM_CHUNKS = 48
WARM_BUDGET_S = 30.0


def keep_cudnn_shapes(model, shapes) -> None:
    """The (pos, T) chunks of the schedules a stage expects, which cuDNN's split takes from now on (built ahead by
    warm_chunk_attention, or once in a prefill); every other chunk takes flash (chunk_attention)."""
    kept = frozenset((int(p), int(t)) for p, t in shapes)
    for blk in model.layers.values():
        if hasattr(blk.attn, "cudnn_shapes"):
            blk.attn.cudnn_shapes = kept


@torch.inference_mode()
def warm_chunk_attention(model, shapes, attend=None) -> int:
    """Build cuDNN's graphs for the attention of chunks (pos, n) ahead of a prefill: one layer's unmasked call
    against its cache's first `pos` keys, and the causal call on the chunk's own n keys (once per shape), with a
    zero q of the chunk's shape and layout (the same strides as PrefillOps.attend's (strata.models.layer), which the graph
    is keyed on).
    Only where chunk_attention takes the cuDNN split (CUDA, half precision); returns how many chunk shapes were
    built (0 elsewhere). Reads the cache, writes nothing. `attend`: the call to make instead (tests)."""
    device, dtype = model.device_dtype()
    if attend is None:
        if device.type != "cuda" or model.cuda_attention != "cudnn-split" or dtype == torch.float32:
            return 0
        attend = _cudnn_with_lse
    # a global layer's calls (a window layer's attention takes another path)
    attn = next((b.attn for b in model.layers.values() if b.attn.window is None and b.attn.k_cache is not None), None)
    if attn is None:
        return 0
    t0, built, own = time.perf_counter(), 0, set()
    for pos, n in list(shapes)[:WARM_CHUNKS]:
        if pos <= 0 or n <= 0 or pos + n > attn.k_cache.shape[2]:
            continue
        q = torch.zeros(1, n, attn.nh, attn.hd, device=device, dtype=dtype).transpose(1, 2)
        keys, vals = attn.cached(pos + n, dtype)
        attend(q, keys[:, :, :pos], vals[:, :, :pos], False, attn.scale)
        if (n, keys.stride()) not in own:  # a widened cache's strides move with pos: part of the key
            attend(q, keys[:, :, pos:], vals[:, :, pos:], True, attn.scale)
            own.add((n, keys.stride()))
        built += 1
        if time.perf_counter() - t0 > WARM_BUDGET_S:
            break
    if attend is _cudnn_with_lse:  # the flash kernels of the chunks outside these shapes: loaded now, not in a request
        pos = next((p for p, _ in shapes if 0 < p and p + 8 <= attn.k_cache.shape[2]), None)
        if pos is not None:
            q = torch.zeros(1, 8, attn.nh, attn.hd, device=device, dtype=dtype).transpose(1, 2)
            keys, vals = attn.cached(pos + 8, dtype)
            _split_attention(q, keys, vals, pos, _flash_with_lse, attn.scale, attn.fused, attn.triton_state)
    return built


@torch.inference_mode()
def warm_window_attention(model, lengths) -> list[int]:
    """Compile FlexAttention for the padded query rows (flex_window_attention's buckets) of chunks of these lengths
    ahead of a prefill, with one window layer's call on a zero q at a position past its window (reads the ring,
    writes nothing); a bucket is compiled once per process, so the rest are free. Only where its window layers
    take flex (kernels.window_attention, CUDA, 16 bits). Returns the buckets compiled (tests: their rows)."""
    device, dtype = model.device_dtype()
    attn = next((b.attn for b in model.layers.values()
                 if getattr(b.attn, "window", None) is not None and b.attn.k_cache is not None), None)
    if attn is None or attn.window_kernel != "flex" or flex_unavailable(device, dtype, attn.triton_state) is not None:
        return []
    largest: dict[int, int] = {}  # bucket -> the longest chunk in it (every chunk fits the ring)
    for n in lengths:
        if n > 0:
            largest[flex_rows(n)] = max(n, largest.get(flex_rows(n), 0))
    t0, done = time.perf_counter(), []
    for rows, T in sorted(largest.items()):
        q = torch.zeros(1, T, attn.nh, attn.hd, device=device, dtype=dtype).transpose(1, 2)
        window_attention(q, attn.k_cache, attn.v_cache, attn.window, attn.window, attn.scale, attn.sinks, "flex",
                         triton_state=attn.triton_state)
        if flex_failure(attn.triton_state) is not None:
            break
        done.append(rows)
        if time.perf_counter() - t0 > WARM_BUDGET_S:
            break
    return done


_FP8 = {torch.float8_e4m3fn: torch.finfo(torch.float8_e4m3fn).max}

# kv_dtype "q8_0": llama.cpp's q8_0 quantization (a float16 scale per 32 int8 values, 34 bytes a block), its blocks'
# parts regrouped in a cached row: the hd int8 values first, then the hd / 32 float16 scales (hd * 17 / 16 bytes), so
# that split-K loads a row's values in wide aligned vectors and each block's scale once (in llama.cpp's own order,
# scale then values per block, its loads were of single bytes: 37.5 tok/s against 116 with a bfloat16 cache, one
# H200). Held in a uint8 cache of (1, nkv, rows, hd * 17 / 16). e4m3 without a scale cost SmolLM2 1.79 % perplexity
# on the rig's text; a scale per 32 values keeps each block's own range.
Q8_0 = torch.uint8
Q8_BLOCK, Q8_BYTES = 32, 34


def q8_row_bytes(hd: int) -> int:
    if hd % Q8_BLOCK:
        raise ValueError(f"kv_dtype q8_0 needs a head dim that is a multiple of {Q8_BLOCK} (this model's is {hd})")
    return hd // Q8_BLOCK * Q8_BYTES


def q8_head_dim(row_bytes: int) -> int:
    """The values in a q8_0 row of row_bytes bytes (the inverse of q8_row_bytes)."""
    return row_bytes // Q8_BYTES * Q8_BLOCK


def cache_width(hd: int, kv: torch.dtype) -> int:
    """The last dimension of a cache holding hd values a row at storage dtype kv."""
    return q8_row_bytes(hd) if kv == Q8_0 else hd


def kv_value_bytes(kv: torch.dtype) -> float:
    """Bytes a cached value takes at storage dtype kv (q8_0: 34 / 32, its scales included)."""
    return Q8_BYTES / Q8_BLOCK if kv == Q8_0 else torch.empty((), dtype=kv).element_size()


def _roundf(y: torch.Tensor) -> torch.Tensor:
    # C's roundf (halves away from zero), as llama.cpp's and gguf-py's q8_0 quantizers round; floor(a + 0.5)
    # would round 0.49999997 up (the sum rounds to 1.0 in float32)
    a = y.abs()
    f = a.floor()
    return (f + (2 * (a - f)).floor()).copysign(y)


def to_q8_0(x: torch.Tensor) -> torch.Tensor:
    """x (..., hd) -> its q8_0 row (..., hd * 17 / 16) uint8: the hd int8 values, then the hd / 32 float16 scales,
    as llama.cpp's quantize_row_q8_0 (and gguf-py's Q8_0) compute them: d = amax / 127 rounded to float16, values
    round(x / d) with the float32 d."""
    hd = x.shape[-1]
    q8_row_bytes(hd)  # (refuses a head dim not of whole blocks)
    b = x.float().unflatten(-1, (hd // Q8_BLOCK, Q8_BLOCK))
    d = b.abs().amax(-1)
    d = d / 127
    inv = torch.where(d == 0, 0.0, 1.0 / d)
    out = torch.empty(*x.shape[:-1], q8_row_bytes(hd), dtype=torch.uint8, device=x.device)
    out[..., :hd] = _roundf(b * inv[..., None]).to(torch.int8).view(torch.uint8).flatten(-2)
    out[..., hd:] = d.to(torch.float16).view(torch.uint8)
    return out


def from_q8_0(x: torch.Tensor, dtype: torch.dtype, triton_state: TritonState | None = None) -> torch.Tensor:
    """q8_0 rows (..., hd * 17 / 16) uint8 -> (..., hd) values in dtype: each value times its block's scale in
    float32, rounded once (a CUDA cache in one Triton pass, strata.kernels.fused.q8_0_widen)."""
    if x.is_cuda and dtype != torch.float32:
        from strata.kernels.fused import q8_0_widen
        y = q8_0_widen(x, dtype, triton_state)
        if y is not None:
            return y
    hd = q8_head_dim(x.shape[-1])
    d = x[..., hd:].contiguous().view(torch.float16).float()
    q = x[..., :hd].view(torch.int8).float().unflatten(-1, (hd // Q8_BLOCK, Q8_BLOCK))
    return q.mul_(d[..., None]).flatten(-2).to(dtype)


def to_cache(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    # fp8 keys/values carry no per-tensor scale: values beyond +-448 are clamped on store (a cast would
    # make them NaN); K and V of Llama-family models sit well inside that range
    if dtype == Q8_0:
        return to_q8_0(x)
    if dtype in _FP8:
        return x.clamp(-_FP8[dtype], _FP8[dtype]).to(dtype)
    return x.to(dtype)


def from_cache(x: torch.Tensor, dtype: torch.dtype, triton_state: TritonState | None = None) -> torch.Tensor:
    """Cached keys or values widened to `dtype` for attention: x.to(dtype), the same bits; q8_0 blocks times
    their scales. An e4m3 cache on CPU goes by its bits, since torch's CPU cast converts one value at a time (a
    decode step widens the whole prefix: SmolLM2, 2 stages, 8,000 cached positions: 2.5 tok/s against 49.4 with
    a bfloat16 cache). Its sign, 4 exponent and 3 mantissa bits, moved 7 places left, are the float16 of
    value / 256 (exponent bias 15 against 7; subnormals alike); no e4m3 value (at most 448) rounds on the way.
    NaN (S.1111.111) is never stored."""
    if x.dtype == Q8_0:
        return from_q8_0(x, dtype, triton_state)
    if x.dtype != torch.float8_e4m3fn or x.is_cuda:
        return x.to(dtype)
    b = x.view(torch.uint8).to(torch.int16)
    h = (((b & 0x80) << 8) | ((b & 0x7F) << 7)).view(torch.float16)
    return h.to(dtype).mul_(256.0)


KV_DTYPES = ("auto", "float32", "bfloat16", "float16", "float8_e4m3fn", "q8_0")

def kv_dtype_of(kv_dtype, compute: torch.dtype) -> torch.dtype:
    """The cache's storage dtype for the rig's kv_dtype (q8_0: uint8 blocks, Q8_0)."""
    if isinstance(kv_dtype, torch.dtype):
        return kv_dtype
    if kv_dtype not in KV_DTYPES:
        raise ValueError(f"unknown kv_dtype {kv_dtype!r} (known: {', '.join(KV_DTYPES)})")
    if kv_dtype == "q8_0":
        return Q8_0
    return compute if kv_dtype == "auto" else getattr(torch, kv_dtype)
