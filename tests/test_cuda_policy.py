"""The CUDA decode plans' launch-shape rules (pure Python: they run without a GPU, in CI)."""
import pytest

from strata.backend.cuda import runner as R
from strata.backend.cuda import settings as S


@pytest.mark.parametrize("n_kv", [1, 3, 8, 32])
@pytest.mark.parametrize("n_sm", [46, 132])
def test_split_class_gives_every_length_its_chunk(n_kv, n_sm):
    """n_split_class: one split count per context-size class (a captured graph serves every length in it) with at
    least ATTN_CHUNK positions per block for the class's shortest length (so for all of them, unless one split
    already takes everything), at most ATTN_MAX_SPLIT splits and about ATTN_BPS blocks per multiprocessor at most."""
    prev = 0
    for cls in (256, 512, 1024, 2048, 4096, 8192, 16384, 32768, 65536, 131072):
        s = S.n_split_class(cls, n_kv, n_sm)
        shortest = 1 if cls == 256 else cls // 2 + 1
        assert 1 <= s <= S.ATTN_MAX_SPLIT <= S.GQA_MAX_SPLIT
        assert s == 1 or -(-shortest // s) >= S.ATTN_CHUNK     # positions per block of the kernel's own chunking
        assert s <= max(1, S.ATTN_BPS * n_sm // n_kv)
        assert s >= prev                                       # longer classes never get fewer splits
        prev = s


def test_split_class_is_the_measured_setting():
    """The H200 settings of docs/cuda.md: SmolLM2's 3 KV heads get 32 splits for the 8192 class (a 4097..8192
    context: >= 128 positions per block) and 64 for the 32768 class (not the 128 that sizing for the longest length
    gave: 20.3 vs 33.0 us at 16K positions)."""
    assert S.n_split_class(8192, 3, 132) == 32
    assert S.n_split_class(32768, 3, 132) == 64
    assert S.n_split_class(32768, 8, 132) == 64


@pytest.mark.parametrize("n_ff,n_sm,want", [(1536, 132, 1), (8192, 132, 2), (16384, 132, 4), (8192, 46, 4)])
def test_glu_pairs_per_warp(n_ff, n_sm, want, monkeypatch):
    """The fused SwiGLU kernel's row pairs per warp: the most (4, 2) that still leaves >= 16 warps per SM, else 1;
    settings.GLU_RP overrides."""
    monkeypatch.setattr(S, "GLU_RP", 0)
    assert S.glu_pairs_per_warp(n_ff, n_sm) == want
    monkeypatch.setattr(S, "GLU_RP", 2)
    assert S.glu_pairs_per_warp(n_ff, n_sm) == 2


def test_bench_host_load_names_build_processes(tmp_path):
    """bench/common.host_load reads a proc tree: the build tools running and the load average (the bench
    warns when a compiler runs beside it: its prefill rows are host-bound)."""
    from bench.common import host_load
    for pid, comm in ((1, "systemd"), (7, "cc1plus"), (8, "cc1plus"), (9, "nvcc"), (10, "python3")):
        (tmp_path / str(pid)).mkdir()
        (tmp_path / str(pid) / "comm").write_text(comm + "\n")
    (tmp_path / "11").mkdir()                                  # a process that exited: no comm file
    (tmp_path / "loadavg").write_text("7.50 3.00 1.00 2/300 12345\n")
    h = host_load(str(tmp_path))
    assert h["build_processes"] == ["cc1plus", "nvcc"] and h["n_build_processes"] == 3
    assert h["load_avg_1m"] == 7.5
    clean = tmp_path / "clean"
    clean.mkdir()
    assert host_load(str(clean)) == {"load_avg_1m": None, "n_cpu": h["n_cpu"], "build_processes": [],
                                     "n_build_processes": 0}


def test_check_sequence_names_the_problem():
    """cuda.check_sequence, the plans' shared pre-step check: a foreign pool or a KV length off the position is a
    one-line ValueError; a matching sequence passes."""
    from types import SimpleNamespace as NS

    pool, other = object(), object()
    R.check_sequence(pool, NS(kv=NS(pool=pool, length=5), pos=5))
    with pytest.raises(ValueError, match="not in this plan's pool"):
        R.check_sequence(other, NS(kv=NS(pool=pool, length=5), pos=5))
    with pytest.raises(ValueError, match="KV length 4 != sequence position 5"):
        R.check_sequence(pool, NS(kv=NS(pool=pool, length=4), pos=5))


def test_split_fits_one_wave(monkeypatch):
    """With the decode attention kernel's resident blocks per multiprocessor given, the split never makes more
    blocks than run at once (n_kv x n_split <= resident x n_sm); without it (or with settings.ATTN_ONE_WAVE off)
    the split is the chunk / ATTN_BPS rule alone. The H200 cases of the sweep: 8 KV heads with 3 resident blocks get
    49 splits at 16K positions (was 64: 1.29 waves), 3 KV heads keep 64."""
    monkeypatch.setattr(S, "ATTN_ONE_WAVE", True)
    for n_kv in (1, 3, 8, 32):
        for resident in (1, 2, 3, 5):
            for length in (1, 300, 4096, 16384, 131072):
                s = S.n_split_gqa(length, n_kv, 132, resident=resident)
                assert 1 <= s <= S.n_split_gqa(length, n_kv, 132)
                assert s == 1 or n_kv * s <= resident * 132
    assert S.n_split_class(32768, 8, 132, resident=3) == 49
    assert S.n_split_class(32768, 3, 132, resident=2) == 64
    assert S.n_split_class(32768, 8, 132) == 64
    monkeypatch.setattr(S, "ATTN_ONE_WAVE", False)
    assert S.n_split_gqa(16384, 8, 132, resident=3) == S.n_split_gqa(16384, 8, 132)


@pytest.mark.parametrize("env,want", [(None, (True, False)), ("1", (True, True)), ("0", (False, False)),
                                      ("off", (False, False)), ("", (False, False))])
def test_glu_settings(env, want):
    """The fused SwiGLU matvec is on in the llama decode graph and off in the hybrid one by default (measured:
    docs/cuda.md); STRATA_CUDA_GLU forces both."""
    assert S.glu_settings(env) == want


def test_short_read_crossover_is_one_function(monkeypatch):
    """settings.short_read: 2..the limit take the short read, the limit a plan's measured crossover (None: not
    measured, SHORT_READ_DEFAULT); STRATA_CUDA_SHORT_READ_MAX overrides it, clamped to 0..16, a bad value unset."""
    monkeypatch.setattr(S, "SHORT_READ_ENV", None)
    assert [n for n in range(0, 20) if S.short_read(n)] == list(range(2, S.SHORT_READ_DEFAULT + 1))
    assert [n for n in range(0, 20) if S.short_read(n, 12)] == list(range(2, 13))
    assert [n for n in range(0, 20) if S.short_read(n, 1)] == [] and S.short_read_limit(40) == 16
    assert S.SHORT_READ_DEFAULT == 8 and S.SHORT_READ_COLS == 16
    assert [S._short_read_env(v) for v in ("4", "99", "-3", "x", "", None)] == [4, 16, 0, None, None, None]
    monkeypatch.setattr(S, "SHORT_READ_ENV", 5)
    assert [n for n in range(0, 20) if S.short_read(n, 12)] == list(range(2, 6)) == \
        [n for n in range(0, 20) if S.short_read(n)]


