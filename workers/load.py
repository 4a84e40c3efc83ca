"""A stage's slice of the model: loaded with the decode weights its device can use, then warmed up before ready."""
from __future__ import annotations

import logging
import sys
import time

import torch

import strata.kernels.attention
from strata.comm import messages as M
from strata.models.args import ModelArgs
from strata.weights.checkpoint import load_stage, weights_mode
from strata.config import kernel_spec
from strata.decode.graphs import GraphedDecode
from strata.models.model import Transformer
from strata.kvcache.prefix_cache import BLOCK, stateful
from strata.plan.schedule import chunk_schedule, cut_at, kept_state_cut


def load_slice(spec: M.StageJob, device: torch.device, dtype: torch.dtype,
               log: logging.Logger) -> tuple[Transformer, str]:
    """This stage's slice (weights resident as GGUF blocks or dequantized) and its KV cache; with the weights
    mode taken (`weights_mode`)."""
    args = ModelArgs(**spec.args)
    weights = weights_mode(spec.model, device.type, spec.weights, args)
    cpu_decode = spec.decode_weights if spec.decode_weights != "none" and device.type == "cpu" else None
    if cpu_decode == "auto":
        from strata.kernels.attention import kv_dtype_of
        from strata.weights.checkpoint import has_quantized
        from strata.kernels.cpu_decode import auto_kind
        kind, why = auto_kind(args, has_quantized(spec.model, args), weights, kv_dtype_of(spec.kv_dtype, dtype))
        log.info("decode_weights=auto: %s (%s)", kind, why)
        cpu_decode = None if kind == "none" else kind
    if cpu_decode == "blocks":
        from strata.kernels.cpu_decode import BuildError, library
        try:
            library()  # built once per machine; a machine without a C compiler decodes as before
        except BuildError as e:
            log.warning("decode_weights=blocks: %s; decoding with the dense weights", e)
            cpu_decode = None
        if cpu_decode and args.extras():  # the C decoder implements the Llama core only
            log.warning("decode_weights=blocks: not for %s (%s); decoding with the dense weights",
                        args.arch, ", ".join(args.extras()))
            cpu_decode = None
    model = load_stage(spec.model, args, spec.start, spec.end, device=device, dtype=dtype,
                       seed=spec.seed, weights=weights, kv_dtype=spec.kv_dtype, max_len=spec.max_len,
                       decode_weights=cpu_decode, max_chunk=spec.max_chunk,
                       # the head's choices (the planner sized activations for the same attention path)
                       kernels=kernel_spec(spec.kernels), attention=spec.attention, seqs=spec.max_seqs,
                       prefix_block=spec.prefix_block, pool=spec.kv_pool)
    if model.kernels.window_attention == "flex" and any(getattr(b.attn, "window", None) is not None
                                                       for b in model.layers.values()):
        why = strata.kernels.attention.flex_unavailable(device, dtype, model.triton_state)
        log.info("kernels.window_attention=flex: %s", f"{why}; window layers take the band path" if why
                 else "window layers through FlexAttention")
    # decode options: weight-only copies are a CPU kernel path, graphs a CUDA one
    if cpu_decode == "blocks":
        from strata.kernels.cpu_decode import BUILDS
        b = model._blocks
        log.info("decode_weights=blocks: %d matrices as stored, %d quantized to 8 bits, %.1f MB, %s build",
                 b.exact, b.requantized, b.nbytes / 1e6, BUILDS.get(b.lib.strata_simd(), "?"))
    elif spec.decode_weights not in ("none", "auto") and device.type != "cpu":
        log.info("decode_weights=%s: CPU stages only; %s decodes with its own weights", spec.decode_weights, device)
    return model, weights


def warm_up(spec: M.StageJob, model: Transformer, graphs: GraphedDecode | None, log: logging.Logger) -> float:
    """CUDA: run the schedule's largest chunk twice (at position 0, then after a prefix: both attention
    branches) and build cuDNN's graphs of the later chunks' prefix lengths (and FlexAttention's compiles of their
    query buckets, for window layers) before saying ready, so one-time
    kernel set-up (cuDNN graphs, Triton compiles, cuBLAS workspaces) is paid at load and reported there
    (`warm_s`, inside `load_s`), never inside a timed prefill. The KV rows it writes are overwritten by the
    prefill. CPU kernels need no set-up. Returns the seconds it took."""
    device = torch.device(spec.device)
    if device.type != "cuda":
        return 0.0
    # a KV pool (kv_pool): the warm-up takes every slot to max_len, so each slot holds the pool's first max_len
    # positions meanwhile (the same rows: what they write is garbage anyway), and no position after it
    for s in range(model.n_slots if model.pool else 0):
        model.place_slot(s, 0, spec.max_len)
    try:
        return _warm_up(spec, model, graphs, log, device)
    finally:
        for s in range(model.n_slots if model.pool else 0):
            model.place_slot(s, 0, 0)


def _warm_up(spec: M.StageJob, model: Transformer, graphs: GraphedDecode | None, log: logging.Logger,
             device: torch.device) -> float:
    dtype, args = getattr(torch, spec.dtype), model.args
    first, last = spec.index == 0, spec.index == spec.n_stages - 1
    decoder = graphs if graphs is not None else model
    t = time.perf_counter()
    mem = [torch.cuda.memory_allocated(device)]  # what each part of the warm-up leaves allocated
    n = max(1, min(spec.max_chunk, spec.max_len // 2))
    for pos in (0, n) if 2 * n <= spec.max_len else (0,):
        if first:
            x = torch.zeros(1, n, dtype=torch.long, device=device)
        else:
            x = torch.zeros(1, n, args.dim, dtype=dtype, device=device)
        h = model(x, pos, decode=False)
        if last:
            model.logits(h[0, -1])
            if spec.perplexity:
                model.nll(h, torch.zeros(n, dtype=torch.long, device=device))
    if last:  # the head's rows kernels (kernels.gemv_rows) take a short chunk's logits rows (its perplexity, a
        # question's scores), one build per tile of 16 / 32 / 64 rows: now, not in the first short prompt (0.7-0.9 s
        # each inside a re-ask on an H100)
        for r in (16, 32, 64):
            model.logits(torch.zeros(r, args.dim, dtype=dtype, device=device))
    # every later chunk meets a new cached-prefix length (and with dynamic chunks a new length of its own), and
    # cuDNN builds a graph per shape: build those of the schedule's chunks (the configured prompt's first, then
    # any prompt's up to max_len) now, not one per chunk in the first prefill; bounded by
    # strata.kernels.attention.WARM_CHUNKS shapes and WARM_BUDGET_S seconds
    chunks = warm_shapes(spec, args)
    shapes = [c for c in chunks if c[0] > 0]  # (a chunk at position 0 has no cached prefix: no split)
    mem.append(torch.cuda.memory_allocated(device))
    strata.kernels.attention.keep_cudnn_shapes(model, shapes + [(n, n)])
    t_chunks = time.perf_counter()
    built = strata.kernels.attention.warm_chunk_attention(model, shapes)
    t_flex = time.perf_counter()
    flex = strata.kernels.attention.warm_window_attention(model, [c[1] for c in chunks])  # (window layers: flex at 0 too)
    mem.append(torch.cuda.memory_allocated(device))
    if built:  # fewer than the shapes: WARM_CHUNKS or WARM_BUDGET_S stopped it, and the rest build in a prefill
        log.info("chunk attention warmed for %d of %d chunk shapes (chunk %d) in %.1f s", built, len(shapes),
                 spec.max_chunk, t_flex - t_chunks)
    if flex:
        log.info("FlexAttention compiled for %d query buckets (rows %s) in %.1f s", len(flex),
                 ", ".join(map(str, flex)), time.perf_counter() - t_flex)
    if strata.kernels.attention.flex_failure(model.triton_state):
        log.warning("kernels.window_attention=flex: %s; window layers take the band path",
                    strata.kernels.attention.flex_failure(model.triton_state))
    # the decode step too (its kernels, cuBLAS's one-row GEMM set-up, the head's argmax), else the first
    # answer pays it; with cuda_graphs, every bucket of cache positions is captured now, not mid-answer
    x1 = (torch.zeros(1, 1, dtype=torch.long, device=device) if first
          else torch.zeros(1, 1, args.dim, dtype=dtype, device=device))
    positions = [0]
    if graphs is not None and graphs.graphable(x1):
        g = graphs.decode_graphs()  # the set the steps below capture into
        positions = sorted({g.bucket(p) - 1 for p in range(0, spec.max_len, 256)} | {0})
        log.info("decode: CUDA graphs, %d buckets", len({g.bucket(p) for p in positions}))
    elif graphs is not None and graphs.batchable(x1):  # several slots: every batch size in every bucket, now
        g = graphs.batch_graphs()
        positions = sorted({g.bucket(p) - 1 for p in range(0, spec.max_len, 256)} | {0})
        sizes = sorted({min(1 << j, model.n_slots) for j in range(g.max_rows.bit_length())})
        for pos in positions:
            for n in sizes:
                for blk in model.layers.values():  # (a linear layer's states taken as standing at pos, as below)
                    if blk.linear:
                        for s in range(n):
                            blk.attn.stand_at(s, pos)
                xs = x1.reshape(1, *x1.shape[2:]).expand(n, *x1.shape[2:])
                graphs.decode_seqs(xs, list(range(n)), [pos] * n)
        log.info("decode: CUDA graphs of decode batches, %d buckets x %s rows (at most %d a replay)",
                 len({g.bucket(p) for p in positions}), "/".join(str(r) for r in sorted({r for r, _ in g.graphs})),
                 g.max_rows)
    elif graphs is not None:
        why = graphs.batch_refusal(x1) if model.n_slots > 1 else None
        log.info("decode: eager (%s)", why or "the graphs do not cover " + (", ".join(args.extras()) or "these weights"))
    for pos in positions:
        for blk in model.layers.values():  # (a linear layer's state taken as standing at pos: the warm-up's steps
            if blk.linear:                 # leave it as unusable as the KV rows they write; a prompt starts at 0)
                blk.attn.state_pos = pos
        decoder.decode_token(x1, pos)
    mem.append(torch.cuda.memory_allocated(device))
    if graphs is not None and graphs.q8_fallback:
        log.warning("decode: kernels.q8_attention %s; the split-K reads the q8_0 cache widened", graphs.q8_fallback)
    log.info("warm-up: GPU memory allocated %s bytes (loaded; after the chunks; after cuDNN's shapes; "
             "after the decode steps)", " -> ".join(f"{m:,}" for m in mem))
    if "strata.kernels.decode_gemv" in sys.modules:  # the graphs' dense products: which kernel each shape measured faster
        log.info("decode GEMV: %s", sys.modules["strata.kernels.decode_gemv"].describe())
    torch.cuda.synchronize(device)
    return time.perf_counter() - t


def warm_shapes(spec: M.StageJob, args: ModelArgs) -> list[tuple[int, int]]:
    """The (pos, length) chunks a prefill may meet, which the warm-up builds attention for: those of the configured
    prompt's schedule, then any prompt's up to max_len, in the plan's chunks; for a model with kept states each
    also cut as KvRounds.keep_states cuts it where its prefix cache keeps them (a last chunk of at most a block:
    gpt-oss's 122,880-token prompt ended in 256 rows, whose FlexAttention compile took ~3.6 s of its first prefill
    on a new machine), and uncut where it does not (prefix_reuse chunks, no prefix cache)."""
    shapes: list[tuple[int, int]] = []
    for tokens in (spec.tokens, spec.max_len):
        chunks = chunk_schedule(tokens, spec.max_chunk, spec.dynamic_chunks, args)
        if stateful(args):
            chunks = chunks + cut_at(chunks, kept_state_cut(tokens, BLOCK))
        for c in chunks:
            if c not in shapes:
                shapes.append(c)
    return shapes
