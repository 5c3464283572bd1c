"""The CUDA plans' settings and launch-shape rules: the few environment switches that stay (each default-on and
tested), the measured constants behind them, and the pure functions that size launches (attention splits, rows and
row pairs per warp). Experiments that lost left with their switches: their numbers are in docs/cuda.md and
bench/results/ (issue #20 lists them)."""
from __future__ import annotations

import os

from strata.backend.cuda.library import lib

_OFF = ("0", "false", "no", "off", "")   # the values that turn an on / off switch off


def env_on(name: str, default: bool = True) -> bool:
    """An on / off switch from the environment: off for 0 / false / no / off / empty, on for anything else."""
    v = os.environ.get(name)
    return default if v is None else v.strip().lower() not in _OFF


# Decode matvecs on int8 (q8_1) activations with __dp4a for Q4_0/Q4_1/Q8_0/Q4_K/Q5_K/Q6_K weights, the activations
# rounded to q8_1 blocks by the kernel that produces them (RMSNorm, attention, SwiGLU), as llama.cpp's mmvq and
# Strata's CPU backend do. STRATA_CUDA_DP4A=0 keeps f32 activations (f32 dequantize-and-dot kernel): ~3e-4 rel. L2 in
# the logits instead of 5e-3..1.4e-2 (tests/test_cuda_parity.py runs both).
DP4A = env_on("STRATA_CUDA_DP4A")

# Decode attention kernel: "auto" (default) = the first split-K kernel ("v1": per-head splits, the last block of a
# head merging them) below AUTO_V2_FROM positions and the GQA-shared self-merging split-K kernel ("v2") from there
# (and for a q8_0 cache always), as measured on the H200 (bench/cuda_kernels.py: 6.7 vs 9.7 us at 512 positions,
# 18.4 vs 13.8 at 4096). STRATA_CUDA_ATTN=v1|v2|auto (tests/test_cuda_parity.py compares them).
ATTN = os.environ.get("STRATA_CUDA_ATTN", "auto")
AUTO_V2_FROM = 4096
FLASH_HEAD_DIMS = (64, 128)           # prefill attention through FlashAttention-2 (strata_fa2_prefill)
ATTN_HEAD_DIMS = (32, 64, 128, 256)   # head sizes of the decode attention kernels


def glu_settings(env: str | None) -> tuple[bool, bool]:
    """(llama graph, hybrid graph) use of the fused SwiGLU matvec for a STRATA_CUDA_GLU value (None: unset)."""
    if env is None:
        return True, False
    return env.strip().lower() not in _OFF, env.strip().lower() not in _OFF


# SwiGLU fused into the gate/up decode matvec (strata_matvec_q8w_glu: the block that makes 32 activations also
# writes their q8_1 block, one launch fewer per layer; bit-identical). Measured on the H200 (interleaved rounds, same
# tokens): in the llama decode graph with the down projection on strata_matvec_q8b it wins (1.7B Q4_K: +1.5-2.0%;
# SmolLM2 +4-6% at depth 0), in the hybrid decode graph it loses 14% (684 -> 588 tok/s at depth 0), so the llama
# graph uses it and the hybrid one does not. STRATA_CUDA_GLU=1 / 0 forces it on / off in both (tests/test_cuda_policy).
GLU, GLU_HYBRID = glu_settings(os.environ.get("STRATA_CUDA_GLU"))


def graphs_enabled() -> bool:
    """STRATA_CUDA_GRAPHS (default on): off launches a plan's decode kernels eagerly instead of replaying its
    captured graphs (same numerics; tests/test_cuda_qwen35.py compares them)."""
    return env_on("STRATA_CUDA_GRAPHS")


def hybrid_prefill_enabled() -> bool:
    """STRATA_CUDA_HYBRID_PREFILL (default on): off sends a hybrid model's n > 8 tokens through the model's own
    forward instead of its plan's prefill (the feature's reference in bench/gpu_hybrid_model.py; tested)."""
    return env_on("STRATA_CUDA_HYBRID_PREFILL")


def mtp_graph_enabled() -> bool:
    """STRATA_CUDA_MTP_GRAPH (default on): off drafts through the model's own mtp_hidden / mtp_head on the device
    (the reference bench/spec_decode.py compares the graph step with)."""
    return env_on("STRATA_CUDA_MTP_GRAPH")


KV_DTYPES = ("f16", "q8_0")   # KV cache types of CudaPagePool (--kv)

MAX_SPLIT = 256          # split-K partitions of the v1 decode attention (about 64 positions each)
GQA_MAX_SPLIT = 256      # split-K partitions of the v2 decode attention (DA_MAX_SPLIT in the kernel)
V1_CHUNK = 64            # positions per block of the v1 decode attention's split

# The v2 decode attention's split: at least ATTN_CHUNK positions per block, about ATTN_BPS blocks per multiprocessor,
# at most ATTN_MAX_SPLIT splits (the last block's merge reads every split's partial), and no more splits than fit in
# one wave (n_kv x n_split <= the kernel's resident blocks per multiprocessor x multiprocessors; ATTN_ONE_WAVE).
# Measured on the H200 (bench/cuda_kernels.py sweeps, cuda_kernels_NVIDIA_H200.json, attn_split_sweep_NVIDIA_H200.json):
# 128 positions per block were best at 4096 positions; at 16384 positions 64 splits beat 128 (3 KV heads 33.0 -> 20.3
# us); one wave: 8 KV heads of 128 at 16K 36.6 -> 28.1 us. A decode plan sizes the split for the shortest length of
# its context-size class (n_split_class).
ATTN_CHUNK = 128
ATTN_BPS = 4
ATTN_MAX_SPLIT = 64
ATTN_ONE_WAVE = True

# The llama decode graph's down projection, when its rows hold at least this many 32-element sub-blocks (n_ff >=
# 4096), runs one block of 4 warps per MV_BLOCK_ROWS rows (strata_matvec_q8b) instead of one warp per row (H200: syn
# decode +2.3-3.8%).
MV_BLOCK_FROM = 128
MV_BLOCK_ROWS = 1

FUSED_NORM_R = 4         # QKV rows per warp of the decode graph's fused-norm matvec (fewer if staged rows do not fit)
HANDOFF_R = 4            # QKV rows per warp with the norm handoff
GLU_RP = 0               # gate/up row pairs per warp of the fused SwiGLU matvec (0: by size, glu_pairs_per_warp)


def glu_pairs_per_warp(n_ff: int, n_sm: int) -> int:
    """Row pairs per warp of strata_matvec_q8w_glu for n_ff activations: GLU_RP when set, else the most (4, 2) that
    still gives >= 16 warps per multiprocessor, else 1."""
    if GLU_RP:
        return GLU_RP
    for rp in (4, 2):
        if n_ff // rp >= 16 * n_sm:
            return rp
    return 1


def rows_per_warp(n_out: int) -> int:
    """Rows per warp of strata_matvec_q8w for a matrix of n_out rows: 1 up to 4096 rows and 2 above
    (bench/cuda_kernels.py: 1 is fastest or within 5% on the H200 at every size measured)."""
    return 1 if n_out <= 4096 else 2


def n_split_for(length: int) -> int:
    """Split-K partitions for the v1 decode attention over length positions: ~V1_CHUNK (64) positions per block."""
    return max(1, min(MAX_SPLIT, (length + V1_CHUNK - 1) // V1_CHUNK))


def n_split_gqa(length: int, n_kv: int, n_sm: int, chunk: int | None = None, bps: int | None = None,
                resident: int = 0) -> int:
    """Split-K partitions for the v2 decode attention (grid n_kv x n_split): at least `chunk` (ATTN_CHUNK) positions
    per block, about `bps` (ATTN_BPS) blocks per multiprocessor, at most ATTN_MAX_SPLIT, and (ATTN_ONE_WAVE, given
    the kernel's `resident` blocks per multiprocessor, gqa_resident) no more blocks than run at once."""
    c = max(1, int(chunk or ATTN_CHUNK))
    b = max(1, int(bps or ATTN_BPS))
    s = max(1, min(ATTN_MAX_SPLIT, -(-length // c), max(1, b * n_sm // max(1, n_kv))))
    if ATTN_ONE_WAVE and resident > 0:
        s = min(s, max(1, resident * n_sm // max(1, n_kv)))
    return s


def n_split_class(size_class: int, n_kv: int, n_sm: int, resident: int = 0) -> int:
    """The v2 split of a decode plan's context-size class (lengths size_class / 2 + 1 .. size_class, or 1 .. 256 for
    the first class; one captured graph): n_split_gqa of the class's shortest length, so every length in it gets
    >= ATTN_CHUNK positions per block (sized for the longest, a step just past the class boundary got half that: 33
    vs 20 us at 16K positions)."""
    return n_split_gqa(max(1, size_class // 2), n_kv, n_sm, resident=resident)


# The short read (DecodePlan.short_read): a forward of 2..SHORT_READ_COLS new tokens of one sequence through the decode
# step's kernels over that many columns (each weight sub-block read once; row i bit-identical to decoding token i after
# rows 0..i-1); 16 is the exactness contract's bound (matvec_cols.cu takes at most 16 columns). A prompt read takes it
# up to the plan's crossover and the cuBLAS prefill above. The crossover is measured per plan (model, carve, GPU) by
# DecodePlan.measure_short_read, which the engine's warm-up runs before the daemon reports ready; a plan not measured
# uses SHORT_READ_DEFAULT; STRATA_CUDA_SHORT_READ_MAX (0..16; 0 or 1: no short read) overrides both.
SHORT_READ_COLS = 16
SHORT_READ_DEFAULT = 8
SHORT_READ_GRAPHS = 96   # captured short-read graphs kept per plan (least recently used dropped): 15 sizes x 2 x a few
#                          context-size classes; a graph of a 30-layer model at n = 16 holds ~1000 nodes


def _short_read_env(env: str | None) -> int | None:
    """STRATA_CUDA_SHORT_READ_MAX's value clamped to 0..SHORT_READ_COLS; None when unset or not an integer."""
    try:
        return max(0, min(SHORT_READ_COLS, int(env))) if env is not None else None
    except ValueError:
        return None


SHORT_READ_ENV = _short_read_env(os.environ.get("STRATA_CUDA_SHORT_READ_MAX"))


def short_read_limit(crossover: int | None = None) -> int:
    """The largest forward that takes the short read: STRATA_CUDA_SHORT_READ_MAX when set, else a plan's measured
    crossover (None: not measured), else SHORT_READ_DEFAULT."""
    if SHORT_READ_ENV is not None:
        return SHORT_READ_ENV
    return SHORT_READ_DEFAULT if crossover is None else max(0, min(SHORT_READ_COLS, int(crossover)))


def short_read(n: int, crossover: int | None = None) -> bool:
    """Whether a forward of n new tokens of one sequence goes through the plan's short read (2 <= n <=
    short_read_limit(crossover)) rather than its prefill: the one place the two paths are chosen between."""
    return 2 <= int(n) <= short_read_limit(crossover)


def size_class(length: int) -> int:
    """Context-size class of a decode step attending over `length` positions (one captured graph per class): the
    power of two >= max(256, length)."""
    c = 256
    while c < length:
        c *= 2
    return c


def fa2_splits(n: int, n_head: int, total: int, n_sm: int) -> int:
    """Key-range splits of the FA2 prefill kernel: enough blocks ((n / 64) * n_head * splits) for two waves of
    n_sm multiprocessors, each split at least 8 key tiles of 64, at most 16."""
    blocks = -(-n // 64) * n_head
    return max(1, min(16, -(-2 * n_sm // blocks), (total + 63) // 64 // 8))


_RESIDENT: dict[tuple, int] = {}


def gqa_resident(hd: int, g: int, q8: bool) -> int:
    """Blocks of the v2 decode attention kernel (head size hd, g query heads per KV head, q8_0 or f16 cache, and
    the STRATA_CUDA_ATTN_DB variant) resident per multiprocessor of the current GPU; 0 when the shape has no kernel
    or the query fails (then the split is not capped). Cached per shape and variant once known."""
    key = (int(hd), int(g), bool(q8), os.environ.get("STRATA_CUDA_ATTN_DB"))
    n = _RESIDENT.get(key)
    if n is None:
        n = max(0, int(lib().strata_attn_decode_gqa_occupancy(key[0], key[1], int(key[2]))))
        if n > 0:
            _RESIDENT[key] = n
    return n
