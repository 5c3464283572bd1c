/* Strata C core: runtime CPU dispatch, the worker pool, and the public API (dequantize, get_rows, matmul). */
#define _GNU_SOURCE
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <time.h>

#include "common.h"
#include "strata_cpu.h"

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#define ST_PAUSE() _mm_pause()
#else
#define ST_PAUSE() ((void)0)
#endif

float st_fp16_table[65536];

float st_h2f_compute(uint16_t h) {
    const uint32_t sign = (uint32_t)(h & 0x8000) << 16;
    const uint32_t exp = (h >> 10) & 0x1f, mant = h & 0x3ff;
    uint32_t f;
    if (exp == 0) {
        float v = (float)mant * (1.0f / 16777216.0f); /* subnormal: mant * 2^-24 */
        memcpy(&f, &v, 4);
        f |= sign;
    } else if (exp == 31) {
        f = sign | 0x7f800000u | (mant << 13);
    } else {
        f = sign | ((exp + 112) << 23) | (mant << 13);
    }
    float out; memcpy(&out, &f, 4);
    return out;
}

/* ---------------- dispatch ---------------- */

static const st_kernels *g_k;
static pthread_once_t g_once = PTHREAD_ONCE_INIT;

int strata_cpu_has_avx2(void) {
#if (defined(__x86_64__) || defined(_M_X64)) && defined(__GNUC__)
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
#else
    return 0;
#endif
}

int strata_cpu_has_avxvnni(void) {
#if ST_HAVE_AVXVNNI
    return strata_cpu_has_avx2() && __builtin_cpu_supports("avxvnni");
#else
    return 0;
#endif
}

int strata_cpu_has_avx512(void) {
#if ST_HAVE_AVX512
    return strata_cpu_has_avxvnni() && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
           __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") &&
           __builtin_cpu_supports("avx512vnni");
#else
    return 0;
#endif
}

static const st_kernels *pick(const char *name) {
    if (!name || !*name || !strcmp(name, "auto")) {
#if ST_HAVE_AVX512
        if (strata_cpu_has_avx512()) return st_kernels_avx512();
#endif
#if ST_HAVE_AVXVNNI
        if (strata_cpu_has_avxvnni()) return st_kernels_avxvnni();
#endif
#if defined(__x86_64__) || defined(_M_X64)
        if (strata_cpu_has_avx2()) return st_kernels_avx2();
#endif
        return st_kernels_portable();
    }
    if (!strcmp(name, "portable")) return st_kernels_portable();
#if defined(__x86_64__) || defined(_M_X64)
    if (!strcmp(name, "avx2") && strata_cpu_has_avx2()) return st_kernels_avx2();
#endif
#if ST_HAVE_AVXVNNI
    if (!strcmp(name, "avxvnni") && strata_cpu_has_avxvnni()) return st_kernels_avxvnni();
#endif
#if ST_HAVE_AVX512
    if (!strcmp(name, "avx512") && strata_cpu_has_avx512()) return st_kernels_avx512();
#endif
    return NULL;
}

static void init_once(void) {
    for (uint32_t i = 0; i < 65536; i++) st_fp16_table[i] = st_h2f_compute((uint16_t)i);
    /* every table this CPU can run is filled here, once (a later pick() only reads); a set the CPU lacks is never
       touched: its table fill is compiled for its own instructions (gcc vectorizes it with them) */
    (void)st_kernels_portable();
#if defined(__x86_64__) || defined(_M_X64)
    if (strata_cpu_has_avx2()) (void)st_kernels_avx2();
#endif
#if ST_HAVE_AVXVNNI
    if (strata_cpu_has_avxvnni()) (void)st_kernels_avxvnni();
#endif
#if ST_HAVE_AVX512
    if (strata_cpu_has_avx512()) (void)st_kernels_avx512();
#endif
    const st_kernels *k = pick(getenv("STRATA_CPU_PATH"));
    g_k = k ? k : pick("auto");
}

static inline const st_kernels *K(void) { pthread_once(&g_once, init_once); return g_k; }

const char *strata_cpu_path(void) { return K()->name; }

int strata_cpu_set_path(const char *name) {
    K();
    const st_kernels *k = pick(name);
    if (!k) return -1;
    g_k = k;
    return 0;
}

typedef struct { int type, blck, size; } st_type_info;

static int type_info(int type, int *blck, int *size) {
    switch (type) {
    case ST_F32: *blck = 1; *size = 4; return 1;
    case ST_F16: case ST_BF16: *blck = 1; *size = 2; return 1;
    case ST_Q4_0: *blck = 32; *size = sizeof(block_q4_0); return 1;
    case ST_Q4_1: *blck = 32; *size = sizeof(block_q4_1); return 1;
    case ST_Q5_0: *blck = 32; *size = sizeof(block_q5_0); return 1;
    case ST_Q5_1: *blck = 32; *size = sizeof(block_q5_1); return 1;
    case ST_Q8_0: *blck = 32; *size = sizeof(block_q8_0); return 1;
    case ST_Q2_K: *blck = 256; *size = sizeof(block_q2_K); return 1;
    case ST_Q3_K: *blck = 256; *size = sizeof(block_q3_K); return 1;
    case ST_Q4_K: *blck = 256; *size = sizeof(block_q4_K); return 1;
    case ST_Q5_K: *blck = 256; *size = sizeof(block_q5_K); return 1;
    case ST_Q6_K: *blck = 256; *size = sizeof(block_q6_K); return 1;
    case ST_Q8_K: *blck = 256; *size = sizeof(block_q8_K); return 1;
    case ST_IQ2_XXS: *blck = 256; *size = sizeof(block_iq2_xxs); return 1;
    case ST_IQ2_XS: *blck = 256; *size = sizeof(block_iq2_xs); return 1;
    case ST_IQ2_S: *blck = 256; *size = sizeof(block_iq2_s); return 1;
    case ST_IQ3_XXS: *blck = 256; *size = sizeof(block_iq3_xxs); return 1;
    case ST_IQ3_S: *blck = 256; *size = sizeof(block_iq3_s); return 1;
    case ST_IQ1_S: *blck = 256; *size = sizeof(block_iq1_s); return 1;
    case ST_IQ1_M: *blck = 256; *size = sizeof(block_iq1_m); return 1;
    case ST_IQ4_NL: *blck = 32; *size = sizeof(block_iq4_nl); return 1;
    case ST_IQ4_XS: *blck = 256; *size = sizeof(block_iq4_xs); return 1;
    default: *blck = 0; *size = 0; return 0;
    }
}

int strata_block_size(int type) { int b, s; type_info(type, &b, &s); return b; }
int strata_type_size(int type) { int b, s; type_info(type, &b, &s); return s; }
int strata_can_matmul(int type) { return type >= 0 && type < ST_N_TYPES && K()->dot[type] != NULL; }

/* ---------------- worker pool ----------------
 * Persistent threads; a task is published by bumping a generation counter packed with its thread count.
 * Workers spin briefly (STRATA_SPIN_US, default 200 us) and then sleep on a condition variable, so
 * back-to-back matmuls in decode do not pay a thread wake-up each. Tasks hand out work through atomic
 * counters, and a worker must "join" a task before touching it: when the calling thread has finished all
 * the work it closes the task and waits only for workers that joined. A worker that was descheduled (an
 * oversubscribed machine) therefore never delays a call. Callers are serialized. */

#define ST_MAX_THREADS 256
#define JOIN_CLOSED (1ull << 16)
typedef void (*st_task_fn)(void *arg, int ith, int nth);

static struct {
    pthread_mutex_t run_mu, mu;
    pthread_cond_t cv, done_cv;
    int n_workers;
    _Atomic uint64_t ctl;  /* (generation << 16) | nth */
    _Atomic uint64_t join; /* (generation << 17) | closed << 16 | joined workers still running */
    st_task_fn fn;
    void *arg;
    long spin_ns;
    _Atomic int park; /* set by strata_park_workers: spinning workers go to sleep now */
} P = {PTHREAD_MUTEX_INITIALIZER, PTHREAD_MUTEX_INITIALIZER, PTHREAD_COND_INITIALIZER, PTHREAD_COND_INITIALIZER};

static inline long now_ns(void) {
    struct timespec ts; clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec * 1000000000L + ts.tv_nsec;
}

/* Generation current when worker i was created (it must not miss the task published right after). */
static uint64_t g_start_gen[ST_MAX_THREADS];

static void *worker_main(void *argp) {
    const int ith = (int)(intptr_t)argp;
    uint64_t seen = g_start_gen[ith];
    for (;;) {
        uint64_t c = atomic_load_explicit(&P.ctl, memory_order_acquire);
        if ((c >> 16) == seen) {
            const long t0 = now_ns();
            for (int i = 1;; i++) {
                ST_PAUSE();
                c = atomic_load_explicit(&P.ctl, memory_order_acquire);
                if ((c >> 16) != seen) break;
                if ((i & 63) == 0 && (atomic_load_explicit(&P.park, memory_order_relaxed) || now_ns() - t0 > P.spin_ns)) {
                    pthread_mutex_lock(&P.mu);
                    while (((c = atomic_load_explicit(&P.ctl, memory_order_acquire)) >> 16) == seen)
                        pthread_cond_wait(&P.cv, &P.mu);
                    pthread_mutex_unlock(&P.mu);
                    break;
                }
            }
        }
        seen = c >> 16;
        const int nth = (int)(c & 0xffff);
        if (ith >= nth) continue;
        uint64_t j = atomic_load_explicit(&P.join, memory_order_acquire);
        int joined = 0;
        while ((j >> 17) == (seen & ((1ull << 47) - 1)) && !(j & JOIN_CLOSED)) {
            if (atomic_compare_exchange_weak_explicit(&P.join, &j, j + 1, memory_order_acq_rel, memory_order_acquire)) {
                joined = 1;
                break;
            }
        }
        if (!joined) continue;
        P.fn(P.arg, ith, nth);
        const uint64_t after = atomic_fetch_sub_explicit(&P.join, 1, memory_order_acq_rel) - 1;
        if ((after & 0xffff) == 0 && (after & JOIN_CLOSED)) {
            pthread_mutex_lock(&P.mu);
            pthread_cond_signal(&P.done_cv);
            pthread_mutex_unlock(&P.mu);
        }
    }
    return NULL;
}

/* Run fn(arg, ith, nth) on up to nth threads (the caller is ith 0). fn must share out its work through
 * atomic counters so that any subset of the threads completes it. */
static void run_task(st_task_fn fn, void *arg, int nth) {
    if (nth > ST_MAX_THREADS) nth = ST_MAX_THREADS;
    if (nth <= 1) { fn(arg, 0, 1); return; }
    pthread_mutex_lock(&P.run_mu);
    if (P.spin_ns == 0) {
        const char *s = getenv("STRATA_SPIN_US");
        P.spin_ns = (s ? atol(s) : 200) * 1000L;
        if (P.spin_ns <= 0) P.spin_ns = 1;
    }
    while (P.n_workers < nth - 1) {
        pthread_t th;
        pthread_attr_t attr;
        pthread_attr_init(&attr);
        pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
        g_start_gen[P.n_workers + 1] = atomic_load_explicit(&P.ctl, memory_order_relaxed) >> 16;
        if (pthread_create(&th, &attr, worker_main, (void *)(intptr_t)(P.n_workers + 1)) != 0) {
            pthread_attr_destroy(&attr);
            break;
        }
        pthread_attr_destroy(&attr);
        P.n_workers++;
    }
    if (nth > P.n_workers + 1) nth = P.n_workers + 1;
    if (nth <= 1) { pthread_mutex_unlock(&P.run_mu); fn(arg, 0, 1); return; }
    P.fn = fn;
    P.arg = arg;
    atomic_store_explicit(&P.park, 0, memory_order_relaxed);
    const uint64_t gen = (atomic_load_explicit(&P.ctl, memory_order_relaxed) >> 16) + 1;
    atomic_store_explicit(&P.join, (gen & ((1ull << 47) - 1)) << 17, memory_order_release);
    pthread_mutex_lock(&P.mu);
    atomic_store_explicit(&P.ctl, (gen << 16) | (uint64_t)nth, memory_order_release);
    pthread_cond_broadcast(&P.cv);
    pthread_mutex_unlock(&P.mu);
    fn(arg, 0, nth);
    /* all work is handed out; close the task and wait for the workers that joined */
    atomic_fetch_or_explicit(&P.join, JOIN_CLOSED, memory_order_acq_rel);
    const long t0 = now_ns();
    for (int i = 1; atomic_load_explicit(&P.join, memory_order_acquire) & 0xffff; i++) {
        ST_PAUSE();
        if ((i & 63) == 0 && now_ns() - t0 > P.spin_ns) {
            pthread_mutex_lock(&P.mu);
            while (atomic_load_explicit(&P.join, memory_order_acquire) & 0xffff) pthread_cond_wait(&P.done_cv, &P.mu);
            pthread_mutex_unlock(&P.mu);
            break;
        }
    }
    pthread_mutex_unlock(&P.run_mu);
}

void strata_park_workers(void) { atomic_store_explicit(&P.park, 1, memory_order_relaxed); }

/* The pool for other files of the core (attention.c). */
void st_run_task(void (*fn)(void *arg, int ith, int nth), void *arg, int nth) { run_task(fn, arg, nth); }

/* ---------------- dequantize / get_rows ---------------- */

typedef struct {
    st_dequant_fn fn;
    const char *src; int64_t src_row_bytes, n_rows, n_in;
    float *dst;
    int64_t chunk;
    _Atomic int64_t next;
} dq_task;

static void dq_worker(void *arg, int ith, int nth) {
    (void)ith; (void)nth;
    dq_task *t = (dq_task *)arg;
    for (;;) {
        const int64_t r0 = atomic_fetch_add_explicit(&t->next, t->chunk, memory_order_relaxed);
        if (r0 >= t->n_rows) break;
        const int64_t r1 = r0 + t->chunk < t->n_rows ? r0 + t->chunk : t->n_rows;
        for (int64_t r = r0; r < r1; r++) t->fn(t->src + r * t->src_row_bytes, t->dst + r * t->n_in, t->n_in);
    }
}

static int check_rows(int type, int64_t src_row_bytes, int64_t n_rows, int64_t n_in, int *blck, int *size) {
    if (!type_info(type, blck, size)) return ST_ERR_TYPE;
    if (n_rows < 0 || n_in <= 0 || n_in % *blck != 0) return ST_ERR_SHAPE;
    if (src_row_bytes < (n_in / *blck) * *size) return ST_ERR_SHAPE;
    return ST_OK;
}

int strata_dequantize(int type, const void *src, int64_t src_row_bytes, int64_t n_rows, int64_t n_in,
                      float *dst, int n_threads) {
    int blck, size;
    const int err = check_rows(type, src_row_bytes, n_rows, n_in, &blck, &size);
    if (err) return err;
    dq_task t = {K()->dequant[type], (const char *)src, src_row_bytes, n_rows, n_in, dst, 1};
    if (!t.fn) return ST_ERR_TYPE;
    t.chunk = 16384 / n_in + 1; /* ~16K elements per claim */
    atomic_init(&t.next, 0);
    int nth = n_threads < 1 ? 1 : n_threads;
    const int64_t max_nth = (n_rows * n_in) / 65536 + 1; /* about 64K elements per thread at least */
    if (nth > max_nth) nth = (int)max_nth;
    if (nth > n_rows) nth = (int)(n_rows > 0 ? n_rows : 1);
    run_task(dq_worker, &t, nth);
    return ST_OK;
}

int strata_get_rows(int type, const void *src, int64_t src_row_bytes, int64_t n_rows, int64_t n_in,
                    const int64_t *ids, int64_t n_ids, float *dst) {
    int blck, size;
    const int err = check_rows(type, src_row_bytes, n_rows, n_in, &blck, &size);
    if (err) return err;
    const st_dequant_fn fn = K()->dequant[type];
    if (!fn) return ST_ERR_TYPE;
    for (int64_t i = 0; i < n_ids; i++)
        if (ids[i] < 0 || ids[i] >= n_rows) return ST_ERR_INDEX;
    for (int64_t i = 0; i < n_ids; i++) fn((const char *)src + ids[i] * src_row_bytes, dst + i * n_in, n_in);
    return ST_OK;
}

/* ---------------- matmul ---------------- */

typedef struct {
    st_quant_act_fn quant;
    const float *x; int64_t n_in, n_tok;
    char *act; size_t act_row_bytes;
    _Atomic int64_t next;
} qa_task;

static void qa_worker(void *arg, int ith, int nth) {
    (void)ith; (void)nth;
    qa_task *t = (qa_task *)arg;
    for (;;) {
        const int64_t r = atomic_fetch_add_explicit(&t->next, 1, memory_order_relaxed);
        if (r >= t->n_tok) break;
        t->quant(t->x + r * t->n_in, t->act + r * t->act_row_bytes, t->n_in);
    }
}

/* The activation rows (block_a8) of a short read repacked for a column kernel (st_cols, common.h). */
static int pack_cols(const char *act, size_t act_row_bytes, int64_t n_tok, int nb, int with_neg, st_cols *c,
                     void **mem) {
    const int P = (int)((n_tok + 1) / 2);
    const int ds = ((2 * P + 7) / 8) * 8 + 8;
    const size_t qs_bytes = (size_t)nb * P * 64, neg_bytes = with_neg ? (size_t)nb * P * 64 : 0;
    const size_t f_bytes = (size_t)nb * ds * sizeof(float);
    char *buf = (char *)aligned_alloc(64, ((qs_bytes + neg_bytes + 2 * f_bytes) + 63) / 64 * 64);
    if (!buf) return ST_ERR_NOMEM;
    int8_t *qs = (int8_t *)buf;
    int32_t *neg = with_neg ? (int32_t *)(buf + qs_bytes) : NULL;
    float *d = (float *)(buf + qs_bytes + neg_bytes), *sv = d + (size_t)nb * ds;
    memset(d, 0, 2 * f_bytes);
    for (int b = 0; b < nb; b++)
        for (int p = 0; p < P; p++) {
            int8_t *q = qs + ((size_t)b * P + p) * 64;
            for (int h = 0; h < 2; h++) {
                const int64_t t = 2 * (int64_t)p + h;
                if (t >= n_tok) {
                    for (int g = 0; g < 8; g++) memset(q + 8 * g + 4 * h, 0, 4);
                    if (neg) for (int g = 0; g < 8; g++) neg[((size_t)b * P + p) * 16 + 2 * g + h] = 0;
                    continue;
                }
                const block_a8 *a = (const block_a8 *)(act + t * act_row_bytes) + b;
                for (int g = 0; g < 8; g++) {
                    memcpy(q + 8 * g + 4 * h, a->qs + 4 * g, 4);
                    if (neg)
                        neg[((size_t)b * P + p) * 16 + 2 * g + h] =
                            -128 * (a->qs[4 * g] + a->qs[4 * g + 1] + a->qs[4 * g + 2] + a->qs[4 * g + 3]);
                }
                d[(size_t)b * ds + t] = a->d;
                sv[(size_t)b * ds + t] = a->s;
            }
        }
    c->nb = nb; c->n_pairs = P; c->d_stride = ds; c->qs = qs; c->neg = neg; c->d = d; c->s = sv;
    *mem = buf;
    return ST_OK;
}

typedef struct {
    st_dot_cols_fn cols;
    const st_cols *pk;
    st_dot_fn dot;
    st_dot2_fn dot2;
    st_unpack_fn unpack;       /* non-NULL: each chunk's rows unpacked once, every tile dotted by dot_unpacked */
    st_dot_fn dot_unpacked;
    st_dot2_fn dot2_unpacked;  /* optional: two unpacked rows at a time */
    size_t unpacked_row_bytes;
    const char *w; size_t w_row_bytes; int nb;
    const char *act; size_t act_row_bytes;
    float *y; int64_t n_out, n_tok;
    int64_t chunk_rows, n_chunks;
    int nt_max;
    _Atomic int64_t next;
} mm_task;

static void mm_worker(void *arg, int ith, int nth) {
    (void)ith; (void)nth;
    mm_task *m = (mm_task *)arg;
    /* this thread's unpacked rows of a chunk (without memory: the packed dots, the same results) */
    char *up = m->unpack ? (char *)aligned_alloc(64, ((size_t)m->chunk_rows * m->unpacked_row_bytes + 63) / 64 * 64)
                         : NULL;
    for (;;) {
        const int64_t c = atomic_fetch_add_explicit(&m->next, 1, memory_order_relaxed);
        if (c >= m->n_chunks) break;
        const int64_t r0 = c * m->chunk_rows;
        const int64_t r1 = r0 + m->chunk_rows < m->n_out ? r0 + m->chunk_rows : m->n_out;
        if (m->cols) {
            /* a short read: ST_COLS_ROWS rows at a time against every token pair, ST_COLS_PAIRS per call */
            const int P = m->pk->n_pairs;
            for (int64_t r = r0; r < r1; r += ST_COLS_ROWS) {
                const int nr = (int)(r1 - r < ST_COLS_ROWS ? r1 - r : ST_COLS_ROWS);
                for (int p0 = 0; p0 < P; p0 += ST_COLS_PAIRS) {
                    const int np = P - p0 < ST_COLS_PAIRS ? P - p0 : ST_COLS_PAIRS;
                    m->cols(m->w + r * m->w_row_bytes, m->w_row_bytes, nr, m->pk, p0, np,
                            (int)(m->n_tok - 2 * (int64_t)p0), m->y + 2 * (int64_t)p0 * m->n_out + r,
                            (size_t)m->n_out);
                }
            }
            continue;
        }
        if (up) {
            const size_t ur = m->unpacked_row_bytes;
            for (int64_t r = r0; r < r1; r++) m->unpack(m->nb, m->w + r * m->w_row_bytes, up + (size_t)(r - r0) * ur);
            for (int64_t t0 = 0; t0 < m->n_tok; t0 += m->nt_max) {
                const int nt = (int)(m->n_tok - t0 < m->nt_max ? m->n_tok - t0 : m->nt_max);
                const char *a = m->act + t0 * m->act_row_bytes;
                float *yy = m->y + t0 * m->n_out;
                int64_t r = r0;
                if (m->dot2_unpacked)
                    for (; r + 1 < r1; r += 2)
                        m->dot2_unpacked(m->nb, up + (size_t)(r - r0) * ur, ur, a, m->act_row_bytes, nt, yy + r,
                                         (size_t)m->n_out);
                for (; r < r1; r++)
                    m->dot_unpacked(m->nb, up + (size_t)(r - r0) * ur, a, m->act_row_bytes, nt, yy + r,
                                    (size_t)m->n_out);
            }
            continue;
        }
        for (int64_t t0 = 0; t0 < m->n_tok; t0 += m->nt_max) {
            const int nt = (int)(m->n_tok - t0 < m->nt_max ? m->n_tok - t0 : m->nt_max);
            const char *a = m->act + t0 * m->act_row_bytes;
            float *yy = m->y + t0 * m->n_out;
            int64_t r = r0;
            if (m->dot2)
                for (; r + 1 < r1; r += 2)
                    m->dot2(m->nb, m->w + r * m->w_row_bytes, m->w_row_bytes, a, m->act_row_bytes, nt, yy + r,
                            (size_t)m->n_out);
            for (; r < r1; r++)
                m->dot(m->nb, m->w + r * m->w_row_bytes, a, m->act_row_bytes, nt, yy + r, (size_t)m->n_out);
        }
    }
    free(up);
}

int strata_matmul(int type, const void *w, int64_t w_row_bytes, int64_t n_out, int64_t n_in,
                  const float *x, int64_t n_tokens, float *y, int n_threads) {
    int blck, size;
    const int err = check_rows(type, w_row_bytes, n_out, n_in, &blck, &size);
    if (err) return err;
    const st_kernels *k = K();
    if (!k->dot[type]) return ST_ERR_TYPE;
    if (n_tokens <= 0 || n_out == 0) return n_tokens < 0 ? ST_ERR_SHAPE : ST_OK;
    if (n_in > INT32_MAX) return ST_ERR_SHAPE;
    const int is_k = blck == QK_K;
    /* float weights (a block of one element) take the float32 rows as they are; the others Q8 activations */
    const int is_float = blck == 1;
    const int nb = (int)(n_in / blck);
    const size_t act_row_bytes = (size_t)nb * (is_float ? sizeof(float) : is_k ? sizeof(block_q8_K) : sizeof(block_a8));
    int nth = n_threads < 1 ? 1 : n_threads;
    char *act = NULL;
    if (!is_float) {
        act = (char *)malloc(act_row_bytes * (size_t)n_tokens);
        if (!act) return ST_ERR_NOMEM;
        qa_task qa = {is_k ? k->quant_q8k : k->quant_a8, x, n_in, n_tokens, act, act_row_bytes};
        atomic_init(&qa.next, 0);
        int qnth = nth;
        if (qnth > n_tokens) qnth = (int)n_tokens;
        if (n_tokens * n_in < 32768) qnth = 1;
        run_task(qa_worker, &qa, qnth);
    }

    mm_task m;
    /* The one place a product chooses its kernel by token count: one token (decode) takes the dot kernels, 2 or
     * more take the type's column kernel where the kernel set has one (bit-identical per token), else the dot
     * kernels over tiles of the type's tile width (st_kernels.nt; also bit-identical per token). */
    st_cols pk;
    void *pk_mem = NULL;
    m.cols = NULL;
    m.pk = NULL;
    if (n_tokens >= 2 && k->dot_cols[type]) {
        const int perr = pack_cols(act, act_row_bytes, n_tokens, nb, type == ST_Q8_0, &pk, &pk_mem);
        if (perr) { free(act); return perr; }
        m.cols = k->dot_cols[type];
        m.pk = &pk;
    }
    m.dot = k->dot[type];
    m.dot2 = k->dot2[type];
    m.nt_max = k->nt[type] ? k->nt[type] : ST_NT;
    /* more than one tile of tokens: rows unpacked once where the kernel set can (bit-identical per token) */
    m.unpack = !m.cols && n_tokens > m.nt_max && k->unpack[type] ? k->unpack[type] : NULL;
    m.dot_unpacked = k->dot_unpacked[type];
    m.dot2_unpacked = k->dot2_unpacked[type];
    m.unpacked_row_bytes = (size_t)nb * k->unpacked_bytes[type];
    m.w = (const char *)w; m.w_row_bytes = (size_t)w_row_bytes; m.nb = nb;
    m.act = is_float ? (const char *)x : act; m.act_row_bytes = act_row_bytes;
    m.y = y; m.n_out = n_out; m.n_tok = n_tokens;
    /* Chunks of output rows: about 4 per thread for balance; for batches, at most ~32 KiB of weights (of
     * unpacked rows where they are unpacked) per chunk so a chunk stays in L1/L2 while every token tile passes
     * over it. */
    int64_t rows = (n_out + 4 * nth - 1) / (4 * nth);
    if (n_tokens > ST_NT) {
        const size_t row = m.unpack ? m.unpacked_row_bytes : (size_t)w_row_bytes;
        int64_t cap = 32768 / (int64_t)(row > 0 ? row : 1);
        if (cap < 4) cap = 4;
        if (rows > cap) rows = cap;
    }
    if (rows < 4) rows = 4;
    m.chunk_rows = rows;
    m.n_chunks = (n_out + rows - 1) / rows;
    atomic_init(&m.next, 0);
    /* Tiny products are not worth waking threads: ~1 MFLOP per thread at least. */
    const int64_t work = n_out * n_in * n_tokens;
    if (nth > 1 && work / nth < (1 << 18)) nth = (int)(work / (1 << 18)) + 1;
    if (nth > m.n_chunks) nth = (int)m.n_chunks;
    run_task(mm_worker, &m, nth);
    free(pk_mem);
    free(act);
    return ST_OK;
}
