"""A model's shape and the variations its family chooses (`ModelArgs`), and named shape presets for synthetic models."""
from __future__ import annotations

from dataclasses import dataclass

ARCHITECTURES = ("llama", "qwen2")


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
    rope_scaling: dict | None = None  # Llama-3 style: factor, low/high_freq_factor, original_max_position_embeddings
    tie_embeddings: bool = False
    qkv_bias: bool = False           # qwen2 has q/k/v biases
    max_seq_len: int = 8192
    bos_id: int | None = None
    eos_id: int | None = None

    def __post_init__(self):
        if self.arch not in ARCHITECTURES:
            raise ValueError(f"unsupported architecture {self.arch!r} (supported: {', '.join(ARCHITECTURES)})")
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"n_heads {self.n_heads} is not a multiple of n_kv_heads {self.n_kv_heads}")

    def layer_param_count(self) -> int:
        attn = self.dim * self.head_dim * (2 * self.n_heads + 2 * self.n_kv_heads)
        return attn + 3 * self.dim * self.ffn_dim + 2 * self.dim

    def param_count(self, start: int, end: int) -> int:
        """Parameters held by the slice [start, end) (embedding on the first, head on the last)."""
        n = (end - start) * self.layer_param_count()
        if start == 0:
            n += self.vocab_size * self.dim
        if end == self.n_layers:
            n += self.dim + (0 if self.tie_embeddings and start == 0 else self.vocab_size * self.dim)
        return n


# Shape presets for synthetic (random-weight) models: benchmarks and smoke tests.
PRESETS: dict[str, ModelArgs] = {
    "llama-3-8b": ModelArgs(vocab_size=128256, dim=4096, n_layers=32, n_heads=32, n_kv_heads=8,
                            head_dim=128, ffn_dim=14336, rope_theta=500000.0, max_seq_len=131072,
                            rope_scaling=dict(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                                              original_max_position_embeddings=8192)),
    "llama-3-70b": ModelArgs(vocab_size=128256, dim=8192, n_layers=80, n_heads=64, n_kv_heads=8,
                             head_dim=128, ffn_dim=28672, rope_theta=500000.0, max_seq_len=131072,
                             rope_scaling=dict(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                                               original_max_position_embeddings=8192)),
    "smoke": ModelArgs(vocab_size=512, dim=128, n_layers=8, n_heads=4, n_kv_heads=2, head_dim=32,
                       ffn_dim=256, max_seq_len=65536),
    "smoke-wide": ModelArgs(vocab_size=2048, dim=1024, n_layers=8, n_heads=16, n_kv_heads=4,
                            head_dim=64, ffn_dim=2816, max_seq_len=131072),
}
