"""A model's shape and the variations its family chooses (`ModelArgs`), and named shape presets for synthetic models."""
from __future__ import annotations

import math
from dataclasses import dataclass, replace

# the families whose arithmetic the decoder core implements (strata.models.families declares each: its files' names and keys)
ARCHITECTURES = ("llama", "qwen2", "qwen3", "gemma3", "phi3", "qwen3_moe", "glm4_moe", "gpt_oss", "qwen3_5",
                 "deepseek_v3", "deepseek_v32", "glm_moe_dsa")
# strata.models.moe: softmax over all, top k; sigmoid scores chosen with a bias (glm4_moe); top k logits (with a bias), then
# a softmax over those (gpt_oss)
ROUTERS = ("softmax", "sigmoid", "topk_softmax")
EXPERT_ACTS = ("silu", "clamped")  # SwiGLU, or gpt-oss's clamped gate * sigmoid(alpha * gate) * (up + 1)
DECODE_T = 4  # forward() with at most this many rows takes the decode path (strata.models.layer.RowsOps): a "chunk"
ACTIVATIONS = ("silu", "gelu_tanh")  # the MLP's gate: SwiGLU or GeGLU (tanh-approximated GELU)


@dataclass(frozen=True)
class ModelArgs:
    arch: str = "llama"
    vocab_size: int = 32000
    dim: int = 4096                  # hidden size (residual width)
    n_layers: int = 32
    n_heads: int = 32
    n_kv_heads: int = 8              # < n_heads: grouped-query attention
    head_dim: int = 128
    ffn_dim: int = 14336             # SwiGLU inner width
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None  # strata.models.rope's normalized form: rope_type (llama3, yarn, linear) + its parameters
    tie_embeddings: bool = False
    qkv_bias: bool = False           # qwen2 has q/k/v biases
    max_seq_len: int = 8192
    bos_id: int | None = None
    eos_id: int | None = None
    # -- what a family varies beyond the Llama core (each default is Llama's) --
    qk_norm: bool = False            # an RMSNorm over each head's q and k before RoPE (qwen3, gemma3)
    norm_offset: bool = False        # norms scale by (1 + w), computed in float32 (gemma)
    post_norms: bool = False         # a norm on the attention's and the MLP's outputs before each residual add (gemma3)
    activation: str = "silu"         # ACTIVATIONS
    embed_scale: float = 1.0         # embeddings times this, rounded to the compute dtype (gemma: sqrt(dim))
    attn_scale: float | None = None  # softmax scale of q.k; None: head_dim ** -0.5 (gemma: query_pre_attn_scalar ** -0.5)
    sliding_window: int | None = None  # a window layer's query sees the last `sliding_window` positions, itself included
    window_layers: tuple | None = None  # per layer True where windowed; None with a sliding_window: every layer
    window_rope_theta: float | None = None  # RoPE base of the window layers, unscaled (gemma3); None: as the others
    final_softcap: float | None = None  # logits -> c * tanh(logits / c) (gemma 2/3 style)
    # -- a mixture of experts in place of the MLP (strata.models.moe): mixtral, qwen3_moe --
    n_experts: int = 0               # 0: a dense MLP
    n_experts_used: int = 0          # experts a token goes to (top k of a softmax over all)
    expert_ffn_dim: int = 0          # one expert's SwiGLU inner width
    router_renorm: bool = False      # the chosen experts' weights renormalized to sum 1
    router: str = "softmax"          # ROUTERS
    router_groups: int = 1           # sigmoid: experts in this many groups, the best `router_groups_used` kept
    router_groups_used: int = 1
    routed_scale: float = 1.0        # the chosen experts' weights times this
    shared_ffn_dim: int = 0          # > 0: a shared SwiGLU of this width beside the routed experts (glm4_moe)
    shared_gate: bool = False        # the shared expert's output times sigmoid(x . w) (qwen3_5 with experts)
    first_dense_layers: int = 0      # layers [0, k) keep a dense MLP of ffn_dim (glm4_moe's first_k_dense_replace)
    rotary_dim: int | None = None    # RoPE over the first rotary_dim values of each head; None: all (partial: glm4)
    attn_sinks: bool = False         # a learned logit per head in each softmax's denominator, with no value (gpt-oss)
    o_bias: bool = False             # a bias on the attention's output projection (gpt-oss)
    expert_bias: bool = False        # biases on the experts' gate/up and down products (gpt-oss)
    expert_act: str = "silu"         # EXPERT_ACTS
    swiglu_alpha: float = 1.702      # clamped: the sigmoid's slope
    swiglu_limit: float = 7.0        # clamped: gate <= limit, |up| <= limit
    # -- hybrid linear attention (qwen3_5): Gated DeltaNet layers between gated full-attention ones --
    linear_layers: tuple | None = None  # per layer True where linear attention (a fixed-size state, no KV cache)
    lin_k_heads: int = 0             # its q/k heads, and their width
    lin_k_dim: int = 0
    lin_v_heads: int = 0             # its value heads (a multiple of the q/k heads), and their width
    lin_v_dim: int = 0
    lin_conv: int = 4                # the causal depthwise convolution's kernel over q, k, v
    attn_gate: bool = False          # full attention's output times sigmoid(a gate from q_proj's other half)
    # -- multi-head latent attention (deepseek_v3: DeepSeek V3 / R1 / V3.1, Kimi K2; strata.models.mla) --
    # q/k heads of head_dim = qk_nope + qk_rope_dim values, the RoPE on the last qk_rope_dim; keys and values come
    # from a latent of kv_lora_rank values per token (cached with the shared roped key: kv_lora_rank + qk_rope_dim)
    kv_lora_rank: int = 0            # > 0: MLA (n_kv_heads == n_heads, as transformers requires)
    q_lora_rank: int = 0             # > 0: queries through q_a (to this rank), its norm, q_b; 0: one q projection
    qk_rope_dim: int = 0             # the roped part of each q/k head (its frequencies are over these dims)
    v_head_dim: int = 0              # a value head's width (head_dim is q/k's)
    rope_interleave: bool = False    # the file's roped q/k values are in adjacent pairs (DeepSeek's), not two halves
    # -- DeepSeek sparse attention (DSA: DeepSeek V3.2, GLM-5; strata.models.dsa) on MLA: a lightning indexer scores
    # the prefix and each query attends to its index_topk best positions --
    index_topk: int = 0              # > 0: DSA
    index_heads: int = 0             # the indexer's query heads, of index_head_dim, its first qk_rope_dim roped
    index_head_dim: int = 0          # (its one key per position is cached beside the latent)
    index_rope_interleave: bool = False  # the indexer's roped values in adjacent pairs (GLM-5), not halves (V3.2)
    index_shared: tuple | None = None  # per layer True where it reuses the layer before's selection (GLM-5)

    def __post_init__(self):
        if self.arch not in ARCHITECTURES:
            raise ValueError(f"unsupported architecture {self.arch!r} (supported: {', '.join(ARCHITECTURES)})")
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"n_heads {self.n_heads} is not a multiple of n_kv_heads {self.n_kv_heads}")
        if self.activation not in ACTIVATIONS:
            raise ValueError(f"unsupported activation {self.activation!r} (supported: {', '.join(ACTIVATIONS)})")
        if self.window_layers is not None:  # a list after msgpack: kept hashable
            object.__setattr__(self, "window_layers", tuple(bool(w) for w in self.window_layers))
            if len(self.window_layers) != self.n_layers:
                raise ValueError(f"window_layers lists {len(self.window_layers)} layers, the model has {self.n_layers}")
            if self.sliding_window is None and any(self.window_layers):
                raise ValueError("window_layers without a sliding_window")
        if self.sliding_window is not None and self.sliding_window < 1:
            raise ValueError(f"sliding_window {self.sliding_window} is not a positive length")
        if self.n_experts and not (0 < self.n_experts_used <= self.n_experts and self.expert_ffn_dim > 0):
            raise ValueError(f"{self.n_experts_used} of {self.n_experts} experts of width {self.expert_ffn_dim}")
        if self.expert_act not in EXPERT_ACTS:
            raise ValueError(f"unsupported expert activation {self.expert_act!r} (supported: {', '.join(EXPERT_ACTS)})")
        if self.router not in ROUTERS:
            raise ValueError(f"unsupported router {self.router!r} (supported: {', '.join(ROUTERS)})")
        if self.n_experts % self.router_groups or not 0 < self.router_groups_used <= self.router_groups:
            raise ValueError(f"{self.router_groups_used} of {self.router_groups} expert groups over {self.n_experts}")
        if self.linear_layers is not None:
            object.__setattr__(self, "linear_layers", tuple(bool(x) for x in self.linear_layers))
            if len(self.linear_layers) != self.n_layers:
                raise ValueError(f"linear_layers lists {len(self.linear_layers)} layers, the model has {self.n_layers}")
            if any(self.linear_layers) and not (self.lin_k_heads and self.lin_v_heads % self.lin_k_heads == 0
                                                and self.lin_k_dim and self.lin_v_dim):
                raise ValueError("linear attention layers without their head counts and widths")
        if self.kv_lora_rank and not (self.n_kv_heads == self.n_heads and 0 < self.qk_rope_dim < self.head_dim
                                      and self.qk_rope_dim % 2 == 0 and self.v_head_dim > 0):
            raise ValueError(f"latent attention of {self.n_heads}/{self.n_kv_heads} heads, q/k {self.head_dim} "
                             f"(rope {self.qk_rope_dim}), v {self.v_head_dim}")
        if self.index_topk and not (self.latent and self.q_lora_rank and self.index_heads
                                    and self.qk_rope_dim <= self.index_head_dim):
            raise ValueError(f"sparse attention needs MLA with a low-rank q and indexer heads ({self.index_heads} of "
                             f"{self.index_head_dim})")
        if self.index_shared is not None:
            object.__setattr__(self, "index_shared", tuple(bool(x) for x in self.index_shared))
            if len(self.index_shared) != self.n_layers or (self.index_shared and self.index_shared[0]):
                raise ValueError(f"index_shared lists {len(self.index_shared)} layers (the first may not share)")
        if self.rotary_dim is not None and (self.rotary_dim % 2 or not 0 < self.rotary_dim <= self.head_dim):
            raise ValueError(f"rotary_dim {self.rotary_dim} is not an even part of head_dim {self.head_dim}")

    def is_linear(self, layer: int) -> bool:
        """Whether layer `layer` is a linear-attention (Gated DeltaNet) layer: a state, not a KV cache."""
        return self.linear_layers is not None and self.linear_layers[layer]

    def group_refusal(self) -> str | None:
        """Why several sequences' prefill chunks cannot go as one (Transformer.forward_group); None: they can."""
        if self.linear_layers is not None and any(self.linear_layers):
            return "linear-attention layers (each sequence's state steps through its chunk alone)"
        if self.rope_scaling and self.rope_scaling.get("rope_type") == "dynamic":
            return "dynamic NTK rope (each prompt's own frequencies)"
        return None

    @property
    def latent(self) -> bool:
        """Whether the attention is MLA: a cache of latents, not keys and values (strata.models.mla)."""
        return self.kv_lora_rank > 0

    def kv_rows(self) -> tuple[tuple[int, int], tuple[int, int]]:
        """(heads, width) of an attention layer's two cache tensors per position: K and V, (n_kv_heads, head_dim)
        each; MLA's K is [normed latent | roped shared key] (1, kv_lora_rank + qk_rope_dim), its V empty
        (strata.models.mla)."""
        if self.latent:  # (DSA: the indexer's key after them, index_head_dim values)
            return (1, self.kv_lora_rank + self.qk_rope_dim + (self.index_head_dim if self.index_topk else 0)), (1, 0)
        return (self.n_kv_heads, self.head_dim), (self.n_kv_heads, self.head_dim)

    def kv_values(self) -> int:
        """Values one position takes in one attention layer's cache (both tensors)."""
        return sum(h * w for h, w in self.kv_rows())

    def stage_start_refusal(self, layer: int) -> str | None:
        """Why a stage cannot start at layer `layer` (None: it can): a DSA layer that takes the layer before's
        selection (GLM-5's shared indexer) needs that layer on its own stage."""
        if self.index_shared is not None and 0 < layer < self.n_layers and self.index_shared[layer]:
            return f"layer {layer} takes layer {layer - 1}'s sparse-attention selection (indexer_types shared)"
        return None

    def is_moe(self, layer: int) -> bool:
        """Whether layer `layer`'s MLP is the mixture of experts."""
        return self.n_experts > 0 and layer >= self.first_dense_layers

    def window(self, layer: int) -> int | None:
        """Layer `layer`'s attention window (None: it sees every earlier position)."""
        if self.sliding_window is None or (self.window_layers is not None and not self.window_layers[layer]):
            return None
        return self.sliding_window

    def kv_positions(self, layer: int, max_len: int, max_chunk: int | None = None) -> int:
        """Rows of layer `layer`'s KV cache: every position up to max_len, or for a window layer (with the
        largest chunk known) a ring of window + chunk - 1 rows: a chunk's queries see at most window - 1 earlier
        positions, and its own rows must not overwrite any of those."""
        if self.is_linear(layer):
            return 0
        w = self.window(layer)
        if w is None or max_chunk is None:
            return max_len
        return min(max_len, w + max(max_chunk, DECODE_T) - 1)

    def extras(self) -> tuple[str, ...]:
        """The variations beyond the Llama core this model uses: the fast decode paths that implement only that
        core (CUDA decode graphs, the C decoder) decline a model that lists any."""
        out = [n for n in ("qk_norm", "norm_offset", "post_norms", "final_softcap", "window_rope_theta")
               if getattr(self, n)]
        if self.sliding_window is not None:
            out.append("sliding_window")
        if self.activation != "silu":
            out.append(f"activation {self.activation}")
        if self.embed_scale != 1.0:
            out.append("embed_scale")
        if self.attn_scale is not None:
            out.append("attn_scale")
        if self.n_experts:
            out.append("experts")
        if self.rotary_dim not in (None, self.head_dim):
            out.append("partial rotary")
        if self.attn_sinks:
            out.append("sinks")
        if self.linear_layers is not None and any(self.linear_layers):
            out.append("linear attention")
        if self.attn_gate:
            out.append("attention gate")
        if self.latent:
            out.append("latent attention")
        if self.index_topk:
            out.append("sparse attention")
        if self.o_bias:
            out.append("o_bias")
        if self.rope_scaling and self.rope_scaling.get("rope_type", "llama3") != "llama3":
            out.append(f"rope {self.rope_scaling['rope_type']}")
        return tuple(out)

    def layer_param_count(self, layer: int | None = None) -> int:
        """Parameters of layer `layer` (None: the most of any layer's: an MoE layer's where the model has experts,
        else the largest of its attention and linear-attention layers'). tests/test_planner.py holds it to the
        parameters of each preset's layers built on the meta device."""
        if layer is None:
            kinds = {(self.is_linear(i), self.is_moe(i)): i for i in range(self.n_layers)}
            return max(self.layer_param_count(i) for i in kinds.values())
        hd, d = self.head_dim, self.dim
        if self.is_linear(layer):  # Gated DeltaNet: q, k, v (convolved), the output gate z, beta and decay, out
            kdim, vdim = self.lin_k_heads * self.lin_k_dim, self.lin_v_heads * self.lin_v_dim
            conv = 2 * kdim + vdim
            attn = d * (conv + vdim + 2 * self.lin_v_heads) + conv * self.lin_conv + 2 * self.lin_v_heads \
                + self.lin_v_dim + d * vdim
        elif self.latent:  # q (low-rank with its norm, or direct), kv_a, its norm, kv_b, o; DSA's indexer
            nh, r = self.n_heads, self.kv_lora_rank
            q = (d * self.q_lora_rank + self.q_lora_rank + self.q_lora_rank * nh * hd if self.q_lora_rank
                 else d * nh * hd)
            attn = q + d * (r + self.qk_rope_dim) + r + r * nh * (hd - self.qk_rope_dim + self.v_head_dim) \
                + nh * self.v_head_dim * d
            if self.index_topk:
                ih, idim = self.index_heads, self.index_head_dim
                attn += self.q_lora_rank * ih * idim + d * idim + 2 * idim + d * ih
        else:
            q = self.n_heads * hd * (2 if self.attn_gate else 1)
            attn = d * (q + 2 * self.n_kv_heads * hd) + d * self.n_heads * hd \
                + (self.n_heads * hd + 2 * self.n_kv_heads * hd if self.qkv_bias else 0) \
                + (d if self.o_bias else 0) + (self.n_heads if self.attn_sinks else 0) \
                + (2 * hd if self.qk_norm else 0)
        norms = (4 if self.post_norms else 2) * d
        if self.n_experts and self.is_moe(layer):
            E, effn = self.n_experts, self.expert_ffn_dim
            mlp = E * (3 * d * effn + d) + 3 * d * self.shared_ffn_dim \
                + (E if self.router != "softmax" else 0) + (E * (2 * effn + d) if self.expert_bias else 0) \
                + (d if self.shared_gate else 0)
        else:
            mlp = 3 * d * self.ffn_dim
        return attn + mlp + norms

    def layer_active_params(self) -> int:
        """Parameters a token multiplies by in an MoE layer (attention, the router, its k experts and the shared
        one): what its compute scales with. A dense model's layer_param_count."""
        if not self.n_experts:
            return self.layer_param_count()
        k, E = self.n_experts_used, self.n_experts
        experts = self.n_experts * 3 * self.dim * self.expert_ffn_dim
        return self.layer_param_count() - experts + experts * k // E

    def param_count(self, start: int, end: int) -> int:
        """Parameters held by the slice [start, end) (embedding on the first, head on the last)."""
        n = sum(self.layer_param_count(i) for i in range(start, end))
        if start == 0:
            n += self.vocab_size * self.dim
        if end == self.n_layers:
            n += self.dim + (0 if self.tie_embeddings and start == 0 else self.vocab_size * self.dim)
        return n


# Shape presets for synthetic (random-weight) models: benchmarks and smoke tests.
# Qwen's own long-context recipe: YaRN x4 over its 32,768 native positions (Qwen3 model cards)
QWEN_YARN4 = dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=32768, beta_fast=32.0, beta_slow=1.0,
                  mscale=None, mscale_all_dim=None, attention_factor=0.1 * math.log(4.0) + 1.0, truncate=True)
PRESETS: dict[str, ModelArgs] = {
    "llama-3-8b": ModelArgs(vocab_size=128256, dim=4096, n_layers=32, n_heads=32, n_kv_heads=8,
                            head_dim=128, ffn_dim=14336, rope_theta=500000.0, max_seq_len=131072,
                            rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                                              original_max_position_embeddings=8192)),
    "llama-3-70b": ModelArgs(vocab_size=128256, dim=8192, n_layers=80, n_heads=64, n_kv_heads=8,
                             head_dim=128, ffn_dim=28672, rope_theta=500000.0, max_seq_len=131072,
                             rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                                               original_max_position_embeddings=8192)),
    # the dense families people split across cards now (shapes from their config.json files)
    "qwen3-8b": ModelArgs(arch="qwen3", vocab_size=151936, dim=4096, n_layers=36, n_heads=32, n_kv_heads=8,
                          head_dim=128, ffn_dim=12288, norm_eps=1e-6, rope_theta=1e6, qk_norm=True, max_seq_len=40960),
    # Qwen's own long-context recipe: YaRN x4 over its 32,768 native positions
    "qwen3-8b-yarn": ModelArgs(arch="qwen3", vocab_size=151936, dim=4096, n_layers=36, n_heads=32, n_kv_heads=8,
                               head_dim=128, ffn_dim=12288, norm_eps=1e-6, rope_theta=1e6, qk_norm=True,
                               max_seq_len=131072, rope_scaling=dict(QWEN_YARN4)),
    "qwen3-32b": ModelArgs(arch="qwen3", vocab_size=151936, dim=5120, n_layers=64, n_heads=64, n_kv_heads=8,
                           head_dim=128, ffn_dim=25600, norm_eps=1e-6, rope_theta=1e6, qk_norm=True, max_seq_len=40960),
    # the seed's model class (5,120 wide) at a long prompt: Qwen3-32B with its model card's YaRN x4
    "qwen3-32b-yarn": ModelArgs(arch="qwen3", vocab_size=151936, dim=5120, n_layers=64, n_heads=64, n_kv_heads=8,
                                head_dim=128, ffn_dim=25600, norm_eps=1e-6, rope_theta=1e6, qk_norm=True,
                                max_seq_len=131072, rope_scaling=dict(QWEN_YARN4)),
    "gemma-3-27b": ModelArgs(arch="gemma3", vocab_size=262208, dim=5376, n_layers=62, n_heads=32, n_kv_heads=16,
                             head_dim=128, ffn_dim=21504, norm_eps=1e-6, rope_theta=1e6, max_seq_len=131072,
                             rope_scaling=dict(rope_type="linear", factor=8.0), tie_embeddings=True, qk_norm=True,
                             post_norms=True, activation="gelu_tanh", embed_scale=5376 ** 0.5, attn_scale=168 ** -0.5,
                             sliding_window=1024, window_layers=tuple((i + 1) % 6 != 0 for i in range(62)),
                             window_rope_theta=10000.0),
    "mistral-small-24b": ModelArgs(vocab_size=131072, dim=5120, n_layers=40, n_heads=32, n_kv_heads=8, head_dim=128,
                                   ffn_dim=32768, rope_theta=1e8, max_seq_len=32768),
    # experts: Qwen3-30B-A3B-Instruct-2507 and gpt-oss-20b (its layers alternate a 128 window and full attention)
    "qwen3-30b-a3b": ModelArgs(arch="qwen3_moe", vocab_size=151936, dim=2048, n_layers=48, n_heads=32, n_kv_heads=4,
                               head_dim=128, ffn_dim=6144, norm_eps=1e-6, rope_theta=1e7, qk_norm=True,
                               max_seq_len=262144, n_experts=128, n_experts_used=8, expert_ffn_dim=768,
                               router_renorm=True),
    "gpt-oss-20b": ModelArgs(arch="gpt_oss", vocab_size=201088, dim=2880, n_layers=24, n_heads=64, n_kv_heads=8,
                             head_dim=64, ffn_dim=2880, norm_eps=1e-5, rope_theta=150000.0, qkv_bias=True,
                             max_seq_len=131072, rope_scaling=dict(
                                 rope_type="yarn", factor=32.0, original_max_position_embeddings=4096,
                                 beta_fast=32.0, beta_slow=1.0, mscale=None, mscale_all_dim=None,
                                 attention_factor=0.1 * math.log(32.0) + 1.0, truncate=False),
                             sliding_window=128, window_layers=tuple(i % 2 == 0 for i in range(24)),
                             n_experts=32, n_experts_used=4, expert_ffn_dim=2880, router="topk_softmax",
                             expert_bias=True, expert_act="clamped", attn_sinks=True, o_bias=True),
    # hybrid: Qwen3.5-27B (dense; Qwen/Qwen3.5-27B's config.json text_config: 64 layers, three Gated DeltaNet layers
    # to one gated full-attention layer (full_attention_interval 4), 24 q / 4 kv heads of 256 with a quarter rotary,
    # linear 16 q/k heads and 48 value heads of 128, conv 4, rope_theta 1e7, 262,144 positions; 15.8 GiB as
    # bench/make_gguf.py writes it in Q4_K_M)
    "qwen3.5-27b": ModelArgs(arch="qwen3_5", vocab_size=248320, dim=5120, n_layers=64, n_heads=24, n_kv_heads=4,
                             head_dim=256, ffn_dim=17408, norm_eps=1e-6, rope_theta=1e7, qk_norm=True, norm_offset=True,
                             max_seq_len=262144, rotary_dim=64, attn_gate=True,
                             linear_layers=tuple((i + 1) % 4 != 0 for i in range(64)), lin_k_heads=16, lin_k_dim=128,
                             lin_v_heads=48, lin_v_dim=128, lin_conv=4),
    # Qwen3.5-9B (Qwen/Qwen3.5-9B's text_config, transformers' Qwen3_5TextConfig defaults: 32 layers, 16 q / 4 kv
    # heads of 256, linear 16 q/k and 32 value heads of 128), at its 262,144 positions and with Qwen's recipe past
    # them: YaRN x4 over 262,144 (1,048,576 positions; the model card's "up to 1,010,000 tokens")
    "qwen3.5-9b": ModelArgs(arch="qwen3_5", vocab_size=248320, dim=4096, n_layers=32, n_heads=16, n_kv_heads=4,
                            head_dim=256, ffn_dim=12288, norm_eps=1e-6, rope_theta=1e7, qk_norm=True, norm_offset=True,
                            max_seq_len=262144, rotary_dim=64, attn_gate=True,
                            linear_layers=tuple((i + 1) % 4 != 0 for i in range(32)), lin_k_heads=16, lin_k_dim=128,
                            lin_v_heads=32, lin_v_dim=128, lin_conv=4),
    "smoke": ModelArgs(vocab_size=512, dim=128, n_layers=8, n_heads=4, n_kv_heads=2, head_dim=32,
                       ffn_dim=256, max_seq_len=65536),
    "smoke-moe": ModelArgs(arch="qwen3_moe", vocab_size=512, dim=256, n_layers=4, n_heads=4, n_kv_heads=2,
                           head_dim=64, ffn_dim=256, qk_norm=True, max_seq_len=65536, n_experts=8, n_experts_used=2,
                           expert_ffn_dim=256, router_renorm=True),
    "smoke-wide": ModelArgs(vocab_size=2048, dim=1024, n_layers=8, n_heads=16, n_kv_heads=4,
                            head_dim=64, ffn_dim=2816, max_seq_len=131072),
}
# DeepSeek V3 / R1's own (config.json): YaRN x40 over 4,096 positions with mscale = mscale_all_dim = 1, so the RoPE's
# magnitude stays 1 and the softmax scale takes (0.1 ln 40 + 1)^2 (transformers' yarn_get_mscale squared, what
# strata.models.families reads from that config and strata.models.deepseek from its GGUF)
DEEPSEEK_V3_YARN = dict(rope_type="yarn", factor=40.0, original_max_position_embeddings=4096, beta_fast=32.0,
                        beta_slow=1.0, mscale=1.0, mscale_all_dim=1.0, attention_factor=1.0, truncate=True)
_V3_MSCALE = 0.1 * 1.0 * math.log(40.0) + 1.0
# DeepSeek V3's shapes (deepseek-ai/DeepSeek-V3's config.json: MLA of 128 heads, q rank 1536, latent 512, q/k heads of
# 128 + 64 roped, values of 128; 256 experts of 2,048, top 8 in the best 4 of 8 groups, sigmoid scores renormalized and
# times 2.5, one shared expert; 18,432-wide dense layers) in a slice of 8 layers, its first 3 dense as the model's: one
# card holds it (bench/make_gguf.py's Q4_K_M file: ~38 GiB) beside llama.cpp (bench/device_deepseek.sh)
PRESETS["deepseek-v3-slice"] = ModelArgs(
    arch="deepseek_v3", vocab_size=129280, dim=7168, n_layers=8, n_heads=128, n_kv_heads=128, head_dim=128 + 64,
    ffn_dim=18432, norm_eps=1e-6, rope_theta=10000.0, rope_scaling=dict(DEEPSEEK_V3_YARN), max_seq_len=163840,
    attn_scale=(128 + 64) ** -0.5 * _V3_MSCALE ** 2, kv_lora_rank=512, q_lora_rank=1536, qk_rope_dim=64,
    v_head_dim=128, rope_interleave=True, n_experts=256, n_experts_used=8, expert_ffn_dim=2048, router="sigmoid",
    router_renorm=True, router_groups=8, router_groups_used=4, routed_scale=2.5, shared_ffn_dim=2048,
    first_dense_layers=3)
# the same with V3.2's sparse attention (DeepseekV32Config: the indexer's 64 heads of 128, top 2,048 positions; its
# roped values in halves)
PRESETS["deepseek-v32-slice"] = replace(PRESETS["deepseek-v3-slice"], arch="deepseek_v32", index_topk=2048,
                                        index_heads=64, index_head_dim=128)
# deepseek-v3-slice's structure at small widths (MLA with a q rank, YaRN, grouped sigmoid routing, a shared expert, a
# dense first layer): CPU tests of bench/make_gguf.py's deepseek2 files
PRESETS["smoke-deepseek"] = replace(
    PRESETS["deepseek-v3-slice"], vocab_size=512, dim=256, n_layers=3, n_heads=4, n_kv_heads=4, head_dim=64 + 32,
    ffn_dim=512, attn_scale=(64 + 32) ** -0.5 * _V3_MSCALE ** 2, kv_lora_rank=256, q_lora_rank=256, qk_rope_dim=32,
    v_head_dim=64, n_experts=16, n_experts_used=4, expert_ffn_dim=256, router_groups=4, router_groups_used=2,
    shared_ffn_dim=256, first_dense_layers=1)
PRESETS["qwen3.5-9b-yarn"] = replace(PRESETS["qwen3.5-9b"], max_seq_len=4 * 262144, rope_scaling=dict(
    QWEN_YARN4, original_max_position_embeddings=262144))
