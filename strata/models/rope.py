"""RoPE inverse frequencies and attention factor (default, linear, llama3, yarn; dynamic NTK, whose frequencies
follow the sequence's length), from HF or GGUF metadata."""
from __future__ import annotations

import math

import torch

from strata.errors import ModelError

ROPE_TYPES = ("llama3", "yarn", "linear", "dynamic")

# The parameters each type reads, in the normalized dict's order.
_KEYS = {
    "linear": ("factor",),
    "dynamic": ("factor",),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
    "yarn": ("factor", "original_max_position_embeddings", "beta_fast", "beta_slow", "mscale", "mscale_all_dim",
             "attention_factor", "truncate"),
}
# In the dict but not ours: the type's name (old and new spelling), theta (the caller reads it) and the
# pretraining length (only the types that read it have a ramp that depends on it).
_IGNORED = ("rope_type", "type", "rope_theta", "original_max_position_embeddings")
# Values of keys a type does not read that change nothing (None never does).
_NEUTRAL = {"partial_rotary_factor": 1.0, "factor": 1.0}
_SEQ_DEPENDENT = ("its frequencies change with the running sequence length, "
                  "so keys cached at one length would not match")
_REFUSED = {"longrope": _SEQ_DEPENDENT}


def _unknown(kind) -> str:
    if kind in _REFUSED:
        return f"rope scaling {kind!r} is not supported: {_REFUSED[kind]}"
    return f"rope scaling {kind!r} is not implemented (implemented: {', '.join(ROPE_TYPES)})"


def yarn_attention_factor(factor: float, mscale=None, mscale_all_dim=None) -> float:
    """HF's yarn cos/sin multiplier when none is given: 0.1 ln(factor) + 1, or (DeepSeek) the ratio of that
    with each mscale when both are set (HF tests truthiness: a 0 mscale falls back to the plain form)."""
    def m(mul):
        return 1.0 if factor <= 1 else 0.1 * mul * math.log(factor) + 1.0
    return m(mscale) / m(mscale_all_dim) if mscale and mscale_all_dim else m(1.0)


def scaling_from_hf(rs: dict | None, where: str, *, max_position_embeddings: int | None = None,
                    original_max_position_embeddings: int | None = None) -> dict | None:
    """An HF config's rope_scaling / rope_parameters dict as {"rope_type", *its parameters} with HF's defaults,
    or None for plain RoPE. The two keywords are the config's top-level fields of those names, which HF uses for
    llama3/yarn's original length: the top-level original one wins (Phi-3), then the dict's, then
    max_position_embeddings. rope_theta is the caller's; a partial_rotary_factor other than 1 is refused, so a
    caller that handles it (rotary_dim) pops it first."""
    if not rs:
        return None
    kind = rs.get("rope_type", rs.get("type", "default"))  # "type" is the pre-4.45 spelling
    if kind != "default" and kind not in ROPE_TYPES:
        raise ModelError(f"{where}: {_unknown(kind)}")
    used = _KEYS.get(kind, ())
    for k, v in rs.items():
        if k not in used and k not in _IGNORED and v is not None and _NEUTRAL.get(k) != v:
            raise ModelError(f"{where}: rope_scaling key {k!r} = {v!r} is not implemented")
    if kind == "default":
        return None

    def need(k):
        if rs.get(k) is None:
            raise ModelError(f"{where}: {kind} rope_scaling lacks {k!r}")
        return rs[k]

    if kind == "linear":
        return {"rope_type": kind, "factor": float(need("factor"))}
    if kind == "dynamic":  # HF scales from max_position_embeddings itself, not an original length
        if max_position_embeddings is None:
            raise ModelError(f"{where}: dynamic rope_scaling needs max_position_embeddings")
        return {"rope_type": kind, "factor": float(need("factor")),
                "max_position_embeddings": int(max_position_embeddings)}
    orig = original_max_position_embeddings or rs.get("original_max_position_embeddings") or max_position_embeddings
    if orig is None:
        raise ModelError(f"{where}: {kind} rope_scaling lacks 'original_max_position_embeddings'")
    if kind == "llama3":
        return {"rope_type": kind, "factor": float(need("factor")), "low_freq_factor": float(need("low_freq_factor")),
                "high_freq_factor": float(need("high_freq_factor")), "original_max_position_embeddings": int(orig)}
    # yarn. HF requires the key but lets it be None (DeepSeek-V3): then the factor is the context's growth.
    if "factor" not in rs:
        raise ModelError(f"{where}: yarn rope_scaling lacks 'factor'")
    factor = rs["factor"]
    if factor is None:
        if max_position_embeddings is None:
            raise ModelError(f"{where}: yarn rope_scaling has factor None and no max_position_embeddings")
        factor = max_position_embeddings / orig
    mscale, mscale_all_dim, att = rs.get("mscale"), rs.get("mscale_all_dim"), rs.get("attention_factor")
    return {"rope_type": kind, "factor": float(factor), "original_max_position_embeddings": int(orig),
            # HF's `or`: a 0 beta also means the default
            "beta_fast": float(rs.get("beta_fast") or 32), "beta_slow": float(rs.get("beta_slow") or 1),
            "mscale": mscale, "mscale_all_dim": mscale_all_dim,
            "attention_factor": float(yarn_attention_factor(factor, mscale, mscale_all_dim) if att is None else att),
            # HF reads .get("truncate", True): an explicit None does not truncate
            "truncate": bool(rs.get("truncate", True))}


def yarn_positions(n: int, scaling: dict | None) -> int:
    """The positions a model with `n` declared (max_position_embeddings, a GGUF's context_length) takes: with YaRN,
    at least factor times its original length, the context the stretch is made for. Qwen's recipe past a model's
    native context adds YaRN to rope_parameters and leaves max_position_embeddings at the native length (Qwen3:
    40,960 with x4 over 32,768, for 131,072; Qwen3.5: x4 over 262,144, for 1,048,576), and llama.cpp's converter
    writes that length as context_length; where both agree (gpt-oss: 32 x 4,096 = 131,072) nothing changes."""
    if scaling and scaling.get("rope_type") == "yarn":
        return max(n, int(scaling["factor"] * scaling["original_max_position_embeddings"]))
    return n


def scaling_from_gguf(get, arch: str, where: str) -> dict | None:
    """llama.cpp's {arch}.rope.scaling.* metadata (get(key, default=None) reads one without the arch prefix) as the
    dict scaling_from_hf gives for the HF model it was converted from; None for no scaling. Keys llama.cpp's
    converter writes from HF fields (yarn_attn_factor, yarn_beta_*) are read as HF meant them."""
    kind = get("rope.scaling.type")
    factor = get("rope.scaling.factor")
    if factor is None:
        factor = get("rope.scale_linear")  # the old name llama.cpp still reads
    if kind is None:
        kind = "linear"  # llama.cpp's default: a bare factor is linear scaling

    def refuse(key, ok):
        v = get(key)
        if v is not None and not ok(v):
            raise ModelError(f"{where}: GGUF key {arch}.{key} = {v!r} is not implemented")

    if kind not in ("none", "linear", "yarn", "llama3"):
        raise ModelError(f"{where}: {_unknown(kind)}")
    # llama.cpp multiplies every type's cos/sin by attn_factor; alpha is Hunyuan's dynamic NTK base.
    refuse("rope.scaling.attn_factor", lambda v: v == 1)
    refuse("rope.scaling.alpha", lambda v: v == 0)
    # yarn_log_multiplier is mscale_all_dim, or 0.1 x it for DeepSeek-2, and llama.cpp assumes mscale = 1.
    refuse("rope.scaling.yarn_log_multiplier", lambda v: v == 0)
    # ext_factor weights the yarn ramp (1 for yarn, 0 otherwise; negative means unset); HF has no such knob.
    refuse("rope.scaling.yarn_ext_factor", lambda v: v < 0 or v == (1 if kind == "yarn" else 0))
    if kind != "yarn":
        refuse("rope.scaling.yarn_attn_factor", lambda v: v == 1)
    if kind != "llama3":
        refuse("rope.scaling.low_freq_factor", lambda v: False)
        refuse("rope.scaling.high_freq_factor", lambda v: False)

    if kind == "none" or (kind == "linear" and not factor):
        return None  # llama.cpp: type none never scales; a factor of 0 means 1
    if kind == "linear":
        return scaling_from_hf({"rope_type": "linear", "factor": factor}, where)
    if kind == "llama3":  # not a llama.cpp type: only when all four are spelled out
        ks = ("factor", "low_freq_factor", "high_freq_factor", "original_context_length")
        vals = {k: get(f"rope.scaling.{k}") for k in ks}
        for k, v in vals.items():
            if v is None:
                raise ModelError(f"{where}: llama3 rope scaling lacks GGUF key {arch}.rope.scaling.{k}")
        return scaling_from_hf({"rope_type": "llama3", "factor": vals["factor"], "low_freq_factor":
                                vals["low_freq_factor"], "high_freq_factor": vals["high_freq_factor"],
                                "original_max_position_embeddings": vals["original_context_length"]}, where)
    # yarn: llama.cpp falls back to the training context for the original length, and always truncates.
    orig = get("rope.scaling.original_context_length") or get("context_length")
    if not orig:
        raise ModelError(f"{where}: yarn rope scaling lacks GGUF key {arch}.rope.scaling.original_context_length")
    return scaling_from_hf({"rope_type": "yarn", "factor": float(factor or 1.0),
                            "original_max_position_embeddings": orig,
                            "beta_fast": get("rope.scaling.yarn_beta_fast"),
                            "beta_slow": get("rope.scaling.yarn_beta_slow"),
                            "attention_factor": get("rope.scaling.yarn_attn_factor"), "truncate": True}, where)


def inv_frequencies(head_dim: int, theta: float, scaling: dict | None,
                    rotary_dim: int | None = None) -> tuple[torch.Tensor, float]:
    """float64 CPU inverse frequencies (rotary_dim/2,) and the factor cos and sin are multiplied by (1.0 but for
    yarn). rotary_dim (default head_dim): only the first rotary_dim dims of a head rotate, as HF's
    partial_rotary_factor; the exponents are over rotary_dim, not head_dim."""
    dim = head_dim if rotary_dim is None else rotary_dim
    if dim <= 0 or dim % 2 or dim > head_dim:
        raise ModelError(f"rotary_dim {dim} must be even and within head_dim {head_dim}")
    # on the CPU, also inside a `torch.device("meta")` build (meta arange goes through torch's compiler)
    inv = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float64, device="cpu") / dim))
    kind = scaling.get("rope_type") if scaling else "default"  # a dict without one is refused below
    if kind in ("default", "dynamic"):  # dynamic: within max_position_embeddings (beyond: dynamic_inv_frequencies)
        return inv, 1.0
    if kind == "linear":  # position interpolation: p / factor, folded into the frequencies
        return inv / scaling["factor"], 1.0
    if kind == "llama3":
        factor, lo, hi = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
        orig = scaling["original_max_position_embeddings"]
        # wavelengths longer than orig/lo are interpolated, shorter than orig/hi kept, those between blended
        wavelen = 2 * math.pi / inv
        smooth = (orig / wavelen - lo) / (hi - lo)
        out = torch.where(wavelen > orig / lo, inv / factor, inv)
        mid = (wavelen >= orig / hi) & (wavelen <= orig / lo)
        return torch.where(mid, (1 - smooth) * inv / factor + smooth * inv, out), 1.0
    if kind == "yarn":
        factor, orig = scaling["factor"], scaling["original_max_position_embeddings"]

        def corr_dim(rotations):  # the (fractional) dim whose frequency turns `rotations` times over orig
            return dim * math.log(orig / (rotations * 2 * math.pi)) / (2 * math.log(theta))

        low, high = corr_dim(scaling["beta_fast"]), corr_dim(scaling["beta_slow"])
        if scaling.get("truncate", True):
            low, high = math.floor(low), math.ceil(high)
        low, high = max(low, 0), min(high, dim - 1)
        if low == high:
            high += 0.001  # HF's guard against a zero-width ramp
        # ramp 0 below `low` (fast dims extrapolate: kept), 1 above `high` (slow dims interpolate: / factor)
        ramp = ((torch.arange(dim // 2, dtype=torch.float64, device="cpu") - low) / (high - low)).clamp(0, 1)
        att = scaling.get("attention_factor")
        if att is None:
            att = yarn_attention_factor(factor, scaling.get("mscale"), scaling.get("mscale_all_dim"))
        return inv / factor * ramp + inv * (1 - ramp), float(att)
    raise ModelError(_unknown(kind))


def dynamic_inv_frequencies(head_dim: int, theta: float, scaling: dict, seq_len: int,
                            rotary_dim: int | None = None) -> torch.Tensor:
    """Dynamic NTK's float64 inverse frequencies for a sequence of seq_len positions (HF's "dynamic" rope): past
    max_position_embeddings m the base grows to theta * (factor * seq_len / m - (factor - 1)) ** (dim / (dim - 2));
    within m, plain RoPE. transformers gives a forward over positions [0, L) the frequencies of L, and a cached
    decode step at position p those of p + 1 (keys cached earlier keep theirs): Transformer.rope's rule."""
    dim = head_dim if rotary_dim is None else rotary_dim
    m, factor = scaling["max_position_embeddings"], scaling["factor"]
    seq = max(seq_len, m)
    base = theta * ((factor * seq / m) - (factor - 1)) ** (dim / (dim - 2))
    return 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float64, device="cpu") / dim))
