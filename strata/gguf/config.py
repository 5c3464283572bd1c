"""ModelConfig: a model's typed hyper-parameters, read from the GGUF's `{arch}.*` metadata keys."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

# RoPE pairing per architecture, as llama.cpp decides it (llama_model_rope_type in src/llama-model.cpp):
# LLAMA_ROPE_TYPE_NORM rotates adjacent pairs (2i, 2i+1); NEOX rotates (i, i + n_rot/2).
# The llama converter permutes Q/K rows so that NORM applies to HF llama weights.
# qwen35/qwen35moe use IMROPE in llama.cpp; for text-only positions (all sections at the same
# position) IMROPE equals NEOX.
ROPE_NORM_ARCHS = frozenset({"llama", "mistral", "granite", "deepseek", "deepseek2", "baichuan", "internlm2",
                             "minicpm", "command-r", "olmo", "arctic", "bitnet"})
ROPE_NEOX_ARCHS = frozenset({"qwen", "qwen2", "qwen2moe", "qwen3", "qwen3moe", "qwen3next", "qwen35", "qwen35moe",
                             "phi2", "phi3", "gemma", "gemma2", "gemma3", "stablelm", "starcoder2", "gptneox",
                             "falcon", "nemotron", "exaone"})

# {arch}.<key> names consumed into typed fields (the rest go to ModelConfig.extra)
_CONSUMED = {
    "block_count", "embedding_length", "attention.head_count", "attention.head_count_kv", "attention.key_length",
    "attention.value_length", "feed_forward_length", "vocab_size", "context_length", "rope.freq_base",
    "rope.dimension_count", "attention.layer_norm_rms_epsilon",
}


class ConfigError(ValueError):
    """Metadata is missing a required key or holds a value of the wrong kind (one-line message)."""


def _scalar_or_list(v: Any) -> tuple[int, list[int] | None]:
    """Some models store per-layer arrays (head_count_kv, feed_forward_length); return (max, list|None)."""
    if isinstance(v, (list, tuple)):
        vals = [int(x) for x in v]
        if not vals:
            raise ConfigError("empty per-layer array in metadata")
        return max(vals), vals
    return int(v), None


@dataclass
class ModelConfig:
    """Hyper-parameters of one model (units: counts of elements/tokens; rope_theta is the RoPE base).

    Fields are read from GGUF metadata keys `{arch}.*` (names as in gguf.constants.Keys.LLM /
    Keys.Attention / Keys.Rope). head_dim defaults to n_embd // n_head when `attention.key_length` is absent;
    rope_dim defaults to head_dim. Per-layer arrays (head_count_kv, feed_forward_length) are stored as their
    maximum with the list in ``extra["n_head_kv_per_layer"]`` / ``extra["n_ff_per_layer"]``. Every other
    `{arch}.*` key lands in ``extra`` under its name without the arch prefix (e.g. "ssm.conv_kernel",
    "expert_count", "full_attention_interval", "rope.scaling.type").
    """

    arch: str
    n_layer: int
    n_embd: int
    n_head: int
    n_head_kv: int
    head_dim: int
    n_ff: int
    n_vocab: int
    n_ctx_train: int
    rope_theta: float
    rope_dim: int
    rope_neox: bool
    rms_eps: float
    tie_embeddings: bool
    extra: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def from_metadata(cls, metadata: dict[str, Any], tensor_names: set[str] | None = None,
                      n_vocab_hint: int | None = None) -> "ModelConfig":
        """Build from a metadata dict (Python values). Raises ConfigError naming a missing key.

        tensor_names decides tie_embeddings (True when ``output.weight`` is absent); n_vocab_hint is used when
        neither ``{arch}.vocab_size`` nor ``tokenizer.ggml.tokens`` is present (e.g. token_embd rows).
        """
        arch = metadata.get("general.architecture")
        if not isinstance(arch, str):
            raise ConfigError("metadata has no general.architecture")
        p = arch + "."

        def req(key: str) -> Any:
            if p + key not in metadata:
                raise ConfigError(f"metadata key {p + key} is missing")
            return metadata[p + key]

        n_layer = int(req("block_count"))
        n_embd = int(req("embedding_length"))
        n_head, n_head_list = _scalar_or_list(req("attention.head_count"))
        extra: dict[str, Any] = {}
        if n_head_list is not None:
            extra["n_head_per_layer"] = n_head_list
        if p + "attention.head_count_kv" in metadata:
            n_head_kv, kv_list = _scalar_or_list(metadata[p + "attention.head_count_kv"])
            if kv_list is not None:
                extra["n_head_kv_per_layer"] = kv_list
        else:
            n_head_kv = n_head
        n_ff, ff_list = _scalar_or_list(metadata.get(p + "feed_forward_length", 0))
        if ff_list is not None:
            extra["n_ff_per_layer"] = ff_list
        if n_head <= 0:
            raise ConfigError(f"{p}attention.head_count must be > 0, got {n_head}")
        head_dim = int(metadata.get(p + "attention.key_length", n_embd // n_head))
        if p + "attention.value_length" in metadata:
            extra["head_dim_v"] = int(metadata[p + "attention.value_length"])
        if p + "vocab_size" in metadata:
            n_vocab = int(metadata[p + "vocab_size"])
        elif "tokenizer.ggml.tokens" in metadata:
            n_vocab = len(metadata["tokenizer.ggml.tokens"])
        elif n_vocab_hint is not None:
            n_vocab = int(n_vocab_hint)
        else:
            raise ConfigError(f"metadata key {p}vocab_size is missing")
        rope_dim = int(metadata.get(p + "rope.dimension_count", head_dim))
        for k, v in metadata.items():
            if k.startswith(p) and k[len(p):] not in _CONSUMED:
                extra[k[len(p):]] = v
        tie = True if tensor_names is None else ("output.weight" not in tensor_names)
        return cls(
            arch=arch, n_layer=n_layer, n_embd=n_embd, n_head=n_head, n_head_kv=n_head_kv, head_dim=head_dim,
            n_ff=n_ff, n_vocab=n_vocab, n_ctx_train=int(metadata.get(p + "context_length", 0)),
            rope_theta=float(metadata.get(p + "rope.freq_base", 10000.0)), rope_dim=rope_dim,
            rope_neox=arch in ROPE_NEOX_ARCHS, rms_eps=float(metadata.get(p + "attention.layer_norm_rms_epsilon", 1e-5)),
            tie_embeddings=tie, extra=extra,
        )
