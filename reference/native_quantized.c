/* The quantized projections of the torch backend on the CPU (spec/quant.py).
 *
 * `quantized_product` is QUANT-A8-1, the activation-quantized linear that GGUF
 * engines compute: each row of x quantized to int8 in blocks of 32 (absmax / 127,
 * round half to even), integer dot products with the weights' codes, then the
 * block's scales. A 4-bit weight row is read once per token at half a byte a
 * weight, and 32 products cost one multiply-add instruction pair (AVX2
 * `maddubs`/`madd`) instead of four conversions and four float FMAs: on a 2-core
 * AVX2 machine a decode step's projections take about half of PyTorch's kernels'
 * time (tests/benchmarks/quantized_product.py). Each (weight row, activation row)
 * sum runs in one order, block after block, whatever the number of rows and
 * however the rows are split among threads: a row's result never depends on its
 * batch.
 *
 * `dequantize` writes group-quantized weights as float32 (QUANT-GROUP-1, bit for
 * bit `spec.quant.dequantize_weight`), for the float32 GEMM of long passes.
 *
 * The spec's layout (QUANT-CODES-1): int4 codes uint8 [N, K/2], element k in byte
 * k/2, low nibble for even k; int8 codes int8 [N, K]; float32 scales and offsets
 * [N, K/G].
 *
 * Rows are split among a small pool of threads (pthreads, started on first use and
 * again in a forked child), which spin briefly between the products of one forward
 * pass and sleep between passes.
 */
#include <math.h>
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>
#if defined(__x86_64__)
#include <immintrin.h>
#endif

#define BLOCK 32 /* QUANT-A8-1's activations per scale */

static int has_avx2(void) {
#if defined(__x86_64__)
    static int known = -1;
    if (known < 0) known = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
    return known;
#else
    return 0;
#endif
}

/* Which inner loops run: "avx2" or "scalar" (the engine's path line names it). */
const char *quantized_isa(void) { return has_avx2() ? "avx2" : "scalar"; }

static inline float bf16_to_float(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

static inline uint16_t float_to_bf16(float f) { /* round to nearest, ties to even */
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    if ((u & 0x7fffffff) > 0x7f800000) return (uint16_t)((u >> 16) | 0x40); /* a quiet NaN */
    return (uint16_t)((u + 0x7fff + ((u >> 16) & 1)) >> 16);
}

/* ---------------------------------------------------------------- thread pool */

/* A task computes units [begin, end) as part `part` of its call (scratch of its own). */
typedef void (*task_fn)(const void *args, int64_t begin, int64_t end, int part);

#define MAX_THREADS 64
#define SPIN_SECONDS 2e-4 /* about the gap between two products of one forward pass */

static struct {
    pthread_mutex_t busy; /* held by the one caller the pool serves at a time */
    pthread_mutex_t lock;
    pthread_cond_t wake;
    int workers;     /* started */
    long started_at; /* the generation when they were started */
    pid_t pid;       /* of the process that started them */
    atomic_long generation;
    atomic_int pending;
    task_fn fn;
    const void *args;
    int64_t rows, align;
    int parts;
} pool = {.busy = PTHREAD_MUTEX_INITIALIZER, .lock = PTHREAD_MUTEX_INITIALIZER,
          .wake = PTHREAD_COND_INITIALIZER};

static void part_range(int part, int parts, int64_t rows, int64_t align, int64_t *begin,
                       int64_t *end) {
    int64_t units = (rows + align - 1) / align;
    int64_t b = units * part / parts * align, e = units * (part + 1) / parts * align;
    *begin = b < rows ? b : rows;
    *end = e < rows ? e : rows;
}

static double seconds(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + 1e-9 * t.tv_nsec;
}

static inline void cpu_relax(void) {
#if defined(__x86_64__)
    _mm_pause();
#endif
}

static void *worker_main(void *index_arg) {
    int index = (int)(intptr_t)index_arg;
    long seen = pool.started_at; /* not the current one: the first task may be posted */
    for (;;) {
        double start = seconds();
        int spins = 0;
        while (atomic_load_explicit(&pool.generation, memory_order_acquire) == seen) {
            cpu_relax(); /* then, past SPIN_SECONDS, sleep until woken */
            if (++spins % 256 == 0 && seconds() - start > SPIN_SECONDS) {
                pthread_mutex_lock(&pool.lock);
                while (atomic_load(&pool.generation) == seen)
                    pthread_cond_wait(&pool.wake, &pool.lock);
                pthread_mutex_unlock(&pool.lock);
            }
        }
        seen = atomic_load(&pool.generation);
        if (index < pool.parts) {
            int64_t begin, end;
            part_range(index, pool.parts, pool.rows, pool.align, &begin, &end);
            if (begin < end) pool.fn(pool.args, begin, end, index);
        }
        atomic_fetch_sub_explicit(&pool.pending, 1, memory_order_release);
    }
    return NULL;
}

/* Waits for the workers' parts: spinning first (they finish within microseconds of
 * the caller's own part), then yielding the core, which a worker descheduled on a busy
 * machine needs. */
static void wait_for_workers(void) {
    for (long spins = 0; atomic_load_explicit(&pool.pending, memory_order_acquire) > 0; spins++) {
        if (spins < 4096)
            cpu_relax();
        else
            sched_yield();
    }
}

/* Runs fn over units [0, rows) in at most `threads` parts of multiples of `align`
 * units, numbered from 0, the calling thread taking part 0. The pool serves one
 * caller at a time: a second thread calling meanwhile (two engines in one process)
 * computes all its units itself as part 0, and a unit's result is the same either
 * way. native_step.c's attention runs on it too. */
void parallel_parts(task_fn fn, const void *args, int64_t rows, int64_t align, int threads) {
    int64_t units = (rows + align - 1) / align;
    if (threads > MAX_THREADS) threads = MAX_THREADS;
    if (threads > units) threads = (int)units;
    if (threads <= 1 || pthread_mutex_trylock(&pool.busy) != 0) {
        fn(args, 0, rows, 0);
        return;
    }
    if (pool.pid != getpid()) { /* first use, or a fork's child: its parent's threads are gone */
        pthread_mutex_init(&pool.lock, NULL);
        pthread_cond_init(&pool.wake, NULL);
        pool.workers = 0;
        pool.pid = getpid();
    }
    if (pool.workers < threads - 1) {
        pool.started_at = atomic_load(&pool.generation);
        while (pool.workers < threads - 1) {
            pthread_t thread;
            pthread_attr_t attr;
            pthread_attr_init(&attr);
            pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
            int failed = pthread_create(&thread, &attr, worker_main,
                                        (void *)(intptr_t)(pool.workers + 1));
            pthread_attr_destroy(&attr);
            if (failed) break; /* fewer threads, same results: a row's sums are its own */
            pool.workers++;
        }
    }
    if (threads > pool.workers + 1) threads = pool.workers + 1;
    if (threads <= 1) {
        fn(args, 0, rows, 0);
    } else {
        pool.fn = fn, pool.args = args, pool.rows = rows, pool.align = align;
        pool.parts = threads;
        atomic_store(&pool.pending, pool.workers);
        pthread_mutex_lock(&pool.lock);
        atomic_fetch_add_explicit(&pool.generation, 1, memory_order_release);
        pthread_cond_broadcast(&pool.wake);
        pthread_mutex_unlock(&pool.lock);
        int64_t begin, end;
        part_range(0, threads, rows, align, &begin, &end);
        fn(args, begin, end, 0);
        wait_for_workers();
    }
    pthread_mutex_unlock(&pool.busy);
}

/* ---------------------------------------------------------------- QUANT-A8-1 */

/* Row m of x (float32, or bfloat16 when x_bf16) quantized: codes [K] (for 4-bit
 * weights each block reordered even elements first, then odd, to meet a byte's low
 * nibbles and then its high ones), the block scales d [K/32] and d * sum(codes). */
static void quantize_row(const void *x, int64_t x_bf16, int64_t m, int64_t k, int reorder,
                         int8_t *codes, float *d, float *d_sum) {
    for (int64_t b = 0; b < k / BLOCK; b++) {
        float v[BLOCK], amax = 0.0f;
        for (int j = 0; j < BLOCK; j++) {
            int64_t e = m * k + b * BLOCK + j;
            v[j] = x_bf16 ? bf16_to_float(((const uint16_t *)x)[e]) : ((const float *)x)[e];
            float a = fabsf(v[j]);
            amax = a > amax ? a : amax;
        }
        const float scale = amax / 127.0f, inverse = scale != 0.0f ? 1.0f / scale : 0.0f;
        int sum = 0;
        for (int j = 0; j < BLOCK; j++) {
            float r = nearbyintf(v[j] * inverse); /* the default mode: half to even */
            int c = r >= -127.0f && r <= 127.0f ? (int)r : 0; /* NaN: 0, not undefined */
            int at = reorder ? (j % 2) * (BLOCK / 2) + j / 2 : j;
            codes[b * BLOCK + at] = (int8_t)c;
            sum += c;
        }
        d[b] = scale;
        d_sum[b] = scale * (float)sum;
    }
}

typedef struct {
    const uint8_t *codes;
    const float *scales, *offsets;
    int64_t bits, k, group, m;
    const int8_t *x_codes; /* [M, K] */
    const float *d, *d_sum; /* [M, K/32] */
    void *y;
    int64_t y_bf16, n_rows; /* y is [M, n_rows] */
} product_args;

static inline void store(const product_args *p, int64_t m, int64_t n, int64_t rows, float v) {
    if (p->y_bf16)
        ((uint16_t *)p->y)[m * rows + n] = float_to_bf16(v);
    else
        ((float *)p->y)[m * rows + n] = v;
}

/* The scalar form (x codes in quantize_row's order). */
static float dot_scalar(const product_args *p, int64_t n, int64_t m) {
    const int64_t blocks = p->k / BLOCK, groups = p->k / p->group;
    const int8_t *c = p->x_codes + m * p->k;
    float total = 0.0f, offset = 0.0f;
    for (int64_t b = 0; b < blocks; b++) {
        const int64_t g = b * BLOCK / p->group;
        int sum = 0;
        for (int j = 0; j < BLOCK; j++) {
            if (p->bits == 4) {
                uint8_t byte = p->codes[n * (p->k / 2) + b * (BLOCK / 2) + j % (BLOCK / 2)];
                int q = j < BLOCK / 2 ? byte & 15 : byte >> 4;
                sum += q * c[b * BLOCK + j];
            } else {
                sum += ((const int8_t *)p->codes)[n * p->k + b * BLOCK + j] * c[b * BLOCK + j];
            }
        }
        total += p->scales[n * groups + g] * p->d[m * blocks + b] * (float)sum;
        offset += p->offsets[n * groups + g] * p->d_sum[m * blocks + b];
    }
    return total + offset;
}

#if defined(__x86_64__)
__attribute__((target("avx2,fma"))) static inline float hsum256(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* The AVX2 form: each block's 32 products summed exactly in integers (|sum| < 2^15
 * per pair of products), its float terms in 8 lanes. */
#define AVX2 __attribute__((target("avx2,fma")))
/* Weight row n times activation row m: blocks in order, even ones into one vector and
 * odd ones into another (two chains of FMAs, not one), added at the end. Groups of one
 * block (GGUF's) take a loop of their own, a third faster than the nested one. Each
 * pair of rows is computed alone: expanding a weight row's codes once for several
 * activation rows measured no faster (the products, not the codes, bound it). */
#define ROW_BLOCK_STEP(b, g)                                                                      \
    do {                                                                                          \
        __m256i x = _mm256_loadu_si256((const __m256i *)(c + (b) * BLOCK)), pairs;                \
        if (bits == 4) {                                                                          \
            const __m128i bytes = _mm_loadu_si128((const __m128i *)(row + (b) * (BLOCK / 2)));    \
            __m256i w = _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(bytes, 4), bytes),      \
                                         nibble);                                                 \
            pairs = _mm256_maddubs_epi16(w, x);                                                   \
        } else {                                                                                  \
            __m256i w = _mm256_loadu_si256((const __m256i *)(row + (b) * BLOCK));                 \
            pairs = _mm256_maddubs_epi16(_mm256_sign_epi8(w, w), _mm256_sign_epi8(x, w));         \
        }                                                                                         \
        __m256 sums = _mm256_cvtepi32_ps(_mm256_madd_epi16(pairs, ones));                         \
        __m256 scale = _mm256_set1_ps(s[g] * d[b]);                                               \
        if ((b) % 2)                                                                              \
            odd = _mm256_fmadd_ps(scale, sums, odd);                                              \
        else                                                                                      \
            even = _mm256_fmadd_ps(scale, sums, even);                                            \
        offset += o[g] * d_sum[b];                                                                \
    } while (0)

AVX2 __attribute__((always_inline)) static inline void row_avx2(const product_args *p, int64_t n,
                                                                int64_t m, const int bits) {
    const int64_t blocks = p->k / BLOCK, groups = p->k / p->group, per_group = p->group / BLOCK;
    const uint8_t *row = p->codes + n * (bits == 4 ? p->k / 2 : p->k);
    const float *s = p->scales + n * groups, *o = p->offsets + n * groups;
    const int8_t *c = p->x_codes + m * p->k;
    const float *d = p->d + m * blocks, *d_sum = p->d_sum + m * blocks;
    const __m256i ones = _mm256_set1_epi16(1), nibble = _mm256_set1_epi8(15);
    __m256 even = _mm256_setzero_ps(), odd = _mm256_setzero_ps();
    float offset = 0.0f;
    if (per_group == 1)
        for (int64_t b = 0; b < blocks; b++) ROW_BLOCK_STEP(b, b);
    else
        for (int64_t g = 0, b = 0; g < groups; g++)
            for (int64_t i = 0; i < per_group; i++, b++) ROW_BLOCK_STEP(b, g);
    store(p, m, n, p->n_rows, hsum256(_mm256_add_ps(even, odd)) + offset);
}

/* Weight rows n and n + 1 times activation row m, groups of one block: each row's sums
 * exactly as row_avx2 makes them (the same bits), the two rows interleaved to share
 * the activation's loads and to give the core two independent chains. From 4
 * activation rows it is 3-10% faster (SmolLM2's gate/up and down at 4 and 16 rows);
 * for one row, slower (down's 1,536-wide rows: 2.3 against 1.6 ms for 30 layers). */
AVX2 __attribute__((always_inline)) static inline void two_rows_avx2(const product_args *p,
                                                                     int64_t n, int64_t m,
                                                                     const int bits) {
    const int64_t blocks = p->k / BLOCK, row_bytes = bits == 4 ? p->k / 2 : p->k;
    const uint8_t *row0 = p->codes + n * row_bytes, *row1 = row0 + row_bytes;
    const float *s0 = p->scales + n * blocks, *s1 = s0 + blocks;
    const float *o0 = p->offsets + n * blocks, *o1 = o0 + blocks;
    const int8_t *c = p->x_codes + m * p->k;
    const float *d = p->d + m * blocks, *d_sum = p->d_sum + m * blocks;
    const __m256i ones = _mm256_set1_epi16(1), nibble = _mm256_set1_epi8(15);
    __m256 even0 = _mm256_setzero_ps(), odd0 = _mm256_setzero_ps();
    __m256 even1 = _mm256_setzero_ps(), odd1 = _mm256_setzero_ps();
    float offset0 = 0.0f, offset1 = 0.0f;
    for (int64_t b = 0; b < blocks; b++) {
        const __m256i x = _mm256_loadu_si256((const __m256i *)(c + b * BLOCK));
        __m256i pairs0, pairs1;
        if (bits == 4) {
            const __m128i bytes0 = _mm_loadu_si128((const __m128i *)(row0 + b * (BLOCK / 2)));
            const __m128i bytes1 = _mm_loadu_si128((const __m128i *)(row1 + b * (BLOCK / 2)));
            pairs0 = _mm256_maddubs_epi16(
                _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(bytes0, 4), bytes0), nibble), x);
            pairs1 = _mm256_maddubs_epi16(
                _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(bytes1, 4), bytes1), nibble), x);
        } else {
            const __m256i w0 = _mm256_loadu_si256((const __m256i *)(row0 + b * BLOCK));
            const __m256i w1 = _mm256_loadu_si256((const __m256i *)(row1 + b * BLOCK));
            pairs0 = _mm256_maddubs_epi16(_mm256_sign_epi8(w0, w0), _mm256_sign_epi8(x, w0));
            pairs1 = _mm256_maddubs_epi16(_mm256_sign_epi8(w1, w1), _mm256_sign_epi8(x, w1));
        }
        const __m256 sums0 = _mm256_cvtepi32_ps(_mm256_madd_epi16(pairs0, ones));
        const __m256 sums1 = _mm256_cvtepi32_ps(_mm256_madd_epi16(pairs1, ones));
        const __m256 scale0 = _mm256_set1_ps(s0[b] * d[b]), scale1 = _mm256_set1_ps(s1[b] * d[b]);
        if (b % 2) {
            odd0 = _mm256_fmadd_ps(scale0, sums0, odd0);
            odd1 = _mm256_fmadd_ps(scale1, sums1, odd1);
        } else {
            even0 = _mm256_fmadd_ps(scale0, sums0, even0);
            even1 = _mm256_fmadd_ps(scale1, sums1, even1);
        }
        offset0 += o0[b] * d_sum[b];
        offset1 += o1[b] * d_sum[b];
    }
    store(p, m, n, p->n_rows, hsum256(_mm256_add_ps(even0, odd0)) + offset0);
    store(p, m, n + 1, p->n_rows, hsum256(_mm256_add_ps(even1, odd1)) + offset1);
}

#define ROWS_AVX2(name, bits)                                                                   \
    AVX2 static void name(const void *a, int64_t begin, int64_t end, int part) {                \
        const product_args *p = a;                                                              \
        (void)part;                                                                             \
        int64_t n = begin;                                                                      \
        if (p->group == BLOCK && p->m >= 4)                                                     \
            for (; n + 1 < end; n += 2)                                                         \
                for (int64_t m = 0; m < p->m; m++) two_rows_avx2(p, n, m, bits);                \
        for (; n < end; n++)                                                                    \
            for (int64_t m = 0; m < p->m; m++) row_avx2(p, n, m, bits);                         \
    }
ROWS_AVX2(int4_rows_avx2, 4)
ROWS_AVX2(int8_rows_avx2, 8)
#endif

static void product_rows(const void *a, int64_t begin, int64_t end, int part) {
    const product_args *p = a;
    (void)part;
    for (int64_t n = begin; n < end; n++)
        for (int64_t m = 0; m < p->m; m++) store(p, m, n, p->n_rows, dot_scalar(p, n, m));
}

/* y [M, N] = QUANT-A8-1's product of x [M, K] (contiguous float32, or bfloat16 when
 * x_bf16) and the quantized weight; y contiguous float32, or bfloat16 when y_bf16.
 * K and the group size multiples of 32. Returns 0, or -1 when out of memory. */
int quantized_product(const uint8_t *codes, const float *scales, const float *offsets,
                      int64_t bits, int64_t n, int64_t k, int64_t group, const void *x,
                      int64_t x_bf16, int64_t m, void *y, int64_t y_bf16, int64_t threads) {
    const int64_t blocks = k / BLOCK;
    char *scratch = malloc((size_t)(m * k + 2 * m * blocks * (int64_t)sizeof(float)));
    if (!scratch) return -1;
    float *d = (float *)scratch, *d_sum = d + m * blocks;
    int8_t *x_codes = (int8_t *)(d_sum + m * blocks);
    for (int64_t r = 0; r < m; r++)
        quantize_row(x, x_bf16, r, k, bits == 4, x_codes + r * k, d + r * blocks,
                     d_sum + r * blocks);
    product_args args = {codes, scales, offsets, bits, k, group, m, x_codes, d, d_sum, y, y_bf16,
                         n};
    task_fn rows = product_rows;
#if defined(__x86_64__)
    if (has_avx2()) rows = bits == 4 ? int4_rows_avx2 : int8_rows_avx2;
#endif
    parallel_parts(rows, &args, n, 16, (int)threads);
    free(scratch);
    return 0;
}

/* QUANT-A8-1's activation codes [M, K] (in element order) and scales [M, K/32] of
 * float32 x, for the GEMM of long passes. */
void quantize_activations(const float *x, int64_t m, int64_t k, int8_t *codes, float *d) {
    float *d_sum = malloc(sizeof(float) * (size_t)(k / BLOCK));
    for (int64_t r = 0; r < m; r++)
        quantize_row(x, 0, r, k, 0, codes + r * k, d + r * (k / BLOCK), d_sum);
    free(d_sum);
}

/* ---------------------------------------------------------------- dequantize */

static void dequantize_scalar(const uint8_t *codes, const float *scales, const float *offsets,
                              int64_t bits, int64_t n, int64_t k, int64_t group, float *w) {
    const int64_t groups = k / group;
    for (int64_t r = 0; r < n; r++)
        for (int64_t e = 0; e < k; e++) {
            const float s = scales[r * groups + e / group], o = offsets[r * groups + e / group];
            const float q = bits == 4 ? (float)((codes[r * (k / 2) + e / 2] >> (4 * (e & 1))) & 15)
                                      : (float)((const int8_t *)codes)[r * k + e];
            w[r * k + e] = s * q + o;
        }
}

#if defined(__x86_64__)
/* groups a multiple of 16: 16 codes (8 bytes int4, 16 bytes int8) to 16 floats at a time */
__attribute__((target("avx2,fma"))) static void dequantize_avx2(
    const uint8_t *codes, const float *scales, const float *offsets, int64_t bits, int64_t n,
    int64_t k, int64_t group, float *w) {
    const int64_t groups = k / group;
    const __m128i nibble = _mm_set1_epi8(15);
    for (int64_t r = 0; r < n; r++)
        for (int64_t g = 0; g < groups; g++) {
            const __m256 s = _mm256_set1_ps(scales[r * groups + g]);
            const __m256 o = _mm256_set1_ps(offsets[r * groups + g]);
            for (int64_t e = g * group; e < (g + 1) * group; e += 16) {
                __m128i q; /* 16 codes as bytes, in element order */
                if (bits == 4) {
                    __m128i bytes = _mm_loadl_epi64((const __m128i *)(codes + r * (k / 2) + e / 2));
                    __m128i lo = _mm_and_si128(bytes, nibble);
                    __m128i hi = _mm_and_si128(_mm_srli_epi16(bytes, 4), nibble);
                    q = _mm_unpacklo_epi8(lo, hi);
                } else {
                    q = _mm_loadu_si128((const __m128i *)(codes + r * k + e));
                }
                __m256i q0 = bits == 4 ? _mm256_cvtepu8_epi32(q) : _mm256_cvtepi8_epi32(q);
                __m128i upper = _mm_srli_si128(q, 8);
                __m256i q1 = bits == 4 ? _mm256_cvtepu8_epi32(upper) : _mm256_cvtepi8_epi32(upper);
                /* s * q + o as two roundings, not a fused one: the spec's bits */
                __m256 w0 = _mm256_add_ps(_mm256_mul_ps(s, _mm256_cvtepi32_ps(q0)), o);
                __m256 w1 = _mm256_add_ps(_mm256_mul_ps(s, _mm256_cvtepi32_ps(q1)), o);
                _mm256_storeu_ps(w + r * k + e, w0);
                _mm256_storeu_ps(w + r * k + e + 8, w1);
            }
        }
}
#endif

/* w [N, K] float32 = dequantize(W) for `bits` 4 or 8 in the spec's layout. */
void dequantize(const uint8_t *codes, const float *scales, const float *offsets, int64_t bits,
                int64_t n, int64_t k, int64_t group, float *w) {
#if defined(__x86_64__)
    if (group % 16 == 0 && has_avx2()) {
        dequantize_avx2(codes, scales, offsets, bits, n, k, group, w);
        return;
    }
#endif
    dequantize_scalar(codes, scales, offsets, bits, n, k, group, w);
}
