/* The quantized projections of the torch backend on the CPU (spec/quant.py).
 *
 * `quantized_product` is QUANT-A8-1, the activation-quantized linear that GGUF
 * engines compute: each row of x quantized to int8 in blocks of 32 (absmax / 127,
 * round half to even), integer dot products with the weights' codes, then the
 * block's scales. A 4-bit weight row is read once per token at half a byte a
 * weight, and its products cost `maddubs` and `madd` (AVX2) instead of conversions
 * and float FMAs.
 *
 * 4-bit weights are multiplied in tiles of eight rows (`pack_int4_tiles`, from the
 * spec's layout at load): each of a vector's eight lanes is one weight row, so a
 * block's sums need no horizontal additions and its scales are one vector, and a
 * tile's codes are unpacked once for four activation rows. 8-bit weights stay in
 * the spec's layout, their sums gathered eight blocks to a vector, a row's codes
 * loaded once for four activation rows (`int8_row_x4`). Each (weight row,
 * activation row) sum runs in one order, block after block, whatever the number of
 * rows and however the work is split among threads: a row's result never depends on
 * its batch. On a 2-core AVX2 machine the product takes well under half of
 * PyTorch's kernels' time (tests/benchmarks/quantized_product.py).
 *
 * The spec's layout (QUANT-CODES-1): int4 codes uint8 [N, K/2], element k in byte
 * k/2, low nibble for even k; int8 codes int8 [N, K]; float32 scales and offsets
 * [N, K/G]. A weight whose every scale and offset is a float16 value (GGUF's Q4_0,
 * Q4_1 and Q8_0 store them so) is held with them in float16 (`half`): converted back
 * exactly, the same bits at a sixth fewer bytes to read for each token (4-bit), and
 * an 8-bit weight whose offsets are all zero holds none.
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

/* Whether the CPU has AVX2, FMA and F16C. */
static int cpu_avx2(void) {
#if defined(__x86_64__)
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
           __builtin_cpu_supports("f16c");
#else
    return 0;
#endif
}

/* Whether the AVX2 loops of the attention and the float32 product run: the CPU has AVX2,
 * and DECODESPEC_NATIVE_ISA is not "scalar" (which the tests set to run the scalar loops
 * of CPUs without it). */
static int has_avx2(void) {
    static int known = -1;
    if (known < 0) {
        const char *isa = getenv("DECODESPEC_NATIVE_ISA");
        known = !(isa && strcmp(isa, "scalar") == 0) && cpu_avx2();
    }
    return known;
}

/* Whether they run, for native_step.c's attention. */
int native_avx2(void) { return has_avx2(); }

static inline float bf16_to_float(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

/* A float16 value as float32, exactly (every float16 value is a float32 one). */
static inline float half_to_float(uint16_t h) {
    const uint32_t sign = (uint32_t)(h >> 15) << 31, exponent = (h >> 10) & 31, m = h & 1023;
    if (exponent == 0) { /* zero or subnormal: m · 2^-24, exact */
        const float magnitude = (float)m * 0x1p-24f;
        return sign ? -magnitude : magnitude;
    }
    const uint32_t bits = sign | (exponent == 31 ? 255u << 23 : (exponent + 112) << 23) | m << 13;
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

/* Scale or offset i of an array of them: float16 when `half`, else float32. */
static inline float field_at(const void *fields, int64_t half, int64_t i) {
    return half ? half_to_float(((const uint16_t *)fields)[i]) : ((const float *)fields)[i];
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
    int64_t rows, align, grab; /* grab: units a thread takes at a time */
    atomic_long next;          /* the first unit no thread has taken */
    int parts;
} pool = {.busy = PTHREAD_MUTEX_INITIALIZER, .lock = PTHREAD_MUTEX_INITIALIZER,
          .wake = PTHREAD_COND_INITIALIZER};

/* Part `part`'s share of the posted task: `grab` units at a time, until none are left.
 * Shares follow how fast each thread runs (a core another process or the server's own
 * threads take for a while gets less), and a unit's result is the same whoever
 * computes it. */
static void run_part(int part) {
    const int64_t units = (pool.rows + pool.align - 1) / pool.align;
    for (;;) {
        const int64_t first = atomic_fetch_add_explicit(&pool.next, pool.grab,
                                                        memory_order_relaxed);
        if (first >= units) return;
        const int64_t last = first + pool.grab < units ? first + pool.grab : units;
        const int64_t end = last * pool.align < pool.rows ? last * pool.align : pool.rows;
        pool.fn(pool.args, first * pool.align, end, part);
    }
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
        if (index < pool.parts) run_part(index);
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

/* Runs fn over units [0, rows) in at most `threads` parts, numbered from 0, the calling
 * thread taking part 0; each part takes `align` units or a multiple at a time
 * (`run_part`), so one part may call fn several times. The pool serves one
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
        pool.grab = (units + 8 * threads - 1) / (8 * threads); /* about 8 takes a thread */
        pool.parts = threads;
        atomic_store(&pool.next, 0);
        atomic_store(&pool.pending, pool.workers);
        pthread_mutex_lock(&pool.lock);
        atomic_fetch_add_explicit(&pool.generation, 1, memory_order_release);
        pthread_cond_broadcast(&pool.wake);
        pthread_mutex_unlock(&pool.lock);
        run_part(0);
        wait_for_workers();
    }
    pthread_mutex_unlock(&pool.busy);
}

/* parallel_parts for loops of little work a row (activation codes, SiLU): a prompt's
 * rows split among the threads, a decode step's few on this one, which they take less
 * time than waking another. */
void parallel_rows(task_fn fn, const void *args, int64_t rows, int threads) {
    parallel_parts(fn, args, rows, 1, rows >= 16 ? threads : 1);
}

/* ---------------------------------------------------------------- QUANT-A8-1 */

/* Blocks per float step of the 8-bit AVX2 loops: the integer sums of eight blocks are
 * gathered into one vector, block by block in its lanes, so that eight blocks cost one
 * conversion, one multiply and one FMA. The last K/32 % 8 blocks go one at a time. */
#define CHUNK 8

/* One block of 32 values quantized (QUANT-A8-1): codes in element order, returning
 * the scale, absmax / 127; *sum is the codes' sum. NaN values are skipped by the
 * absmax and get code 0. */
static float quantize_block(const float *v, int8_t *codes, int *sum) {
    float amax = 0.0f;
    for (int j = 0; j < BLOCK; j++) {
        const float a = fabsf(v[j]);
        amax = a > amax ? a : amax;
    }
    const float scale = amax / 127.0f, inverse = scale != 0.0f ? 1.0f / scale : 0.0f;
    *sum = 0;
    for (int j = 0; j < BLOCK; j++) {
        const float r = nearbyintf(v[j] * inverse); /* the default mode: half to even */
        codes[j] = (int8_t)(r >= -127.0f && r <= 127.0f ? (int)r : 0); /* NaN: 0 */
        *sum += codes[j];
    }
    return scale;
}

#if defined(__x86_64__)
/* quantize_block's AVX2 form, the same operations lane by lane: the same bits. */
__attribute__((target("avx2,fma"))) static float quantize_block_avx2(const float *v,
                                                                     int8_t *codes, int *sum) {
    const __m256 magnitude = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
    __m256 values[4], amax = _mm256_setzero_ps();
    for (int i = 0; i < 4; i++) {
        values[i] = _mm256_loadu_ps(v + 8 * i);
        /* max(a, amax) is amax where a is NaN, as the scalar comparison */
        amax = _mm256_max_ps(_mm256_and_ps(values[i], magnitude), amax);
    }
    __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
    m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
    m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
    const float scale = _mm_cvtss_f32(m4) / 127.0f, inverse = scale != 0.0f ? 1.0f / scale : 0.0f;
    __m256i c[4], total = _mm256_setzero_si256();
    for (int i = 0; i < 4; i++) {
        const __m256 r = _mm256_round_ps(_mm256_mul_ps(values[i], _mm256_set1_ps(inverse)),
                                         _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        const __m256 valid = _mm256_and_ps(_mm256_cmp_ps(r, _mm256_set1_ps(-127.0f), _CMP_GE_OQ),
                                           _mm256_cmp_ps(r, _mm256_set1_ps(127.0f), _CMP_LE_OQ));
        c[i] = _mm256_and_si256(_mm256_cvttps_epi32(r), _mm256_castps_si256(valid));
        total = _mm256_add_epi32(total, c[i]);
    }
    /* int32 -> int8 in element order: packs interleave the 128-bit lanes, the permute
     * puts them back */
    const __m256i bytes = _mm256_packs_epi16(_mm256_packs_epi32(c[0], c[1]),
                                             _mm256_packs_epi32(c[2], c[3]));
    const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
    _mm256_storeu_si256((__m256i *)codes, _mm256_permutevar8x32_epi32(bytes, order));
    __m128i s = _mm_add_epi32(_mm256_castsi256_si128(total), _mm256_extracti128_si256(total, 1));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4e));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xb1));
    *sum = _mm_cvtsi128_si32(s);
    return scale;
}
#endif

#if defined(__x86_64__)
/* The float32 values of float16 ones, eight at a time; returns how many it widened
 * (the rest, fewer than eight, are the caller's). */
__attribute__((target("avx2,f16c"))) static int64_t widen_halves_f16c(const uint16_t *halves,
                                                                      int64_t count, float *out) {
    int64_t i = 0;
    for (; i + 8 <= count; i += 8)
        _mm256_storeu_ps(out + i, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(halves + i))));
    return i;
}
#endif

/* Row m of x (float32, or bfloat16 when x_bf16) quantized: codes [K] in element order,
 * the block scales d [K/32] and d * sum(codes). */
static void quantize_row(const void *x, int64_t x_bf16, int64_t m, int64_t k, int8_t *codes,
                         float *d, float *d_sum) {
    const int64_t blocks = k / BLOCK;
    const int avx2 = has_avx2();
    for (int64_t b = 0; b < blocks; b++) {
        float widened[BLOCK];
        const float *v = (const float *)x + m * k + b * BLOCK;
        if (x_bf16) {
            for (int j = 0; j < BLOCK; j++)
                widened[j] = bf16_to_float(((const uint16_t *)x)[m * k + b * BLOCK + j]);
            v = widened;
        }
        int sum;
#if defined(__x86_64__)
        const float scale = avx2 ? quantize_block_avx2(v, codes + b * BLOCK, &sum)
                                 : quantize_block(v, codes + b * BLOCK, &sum);
#else
        const float scale = quantize_block(v, codes + b * BLOCK, &sum);
        (void)avx2;
#endif
        d[b] = scale;
        d_sum[b] = scale * (float)sum;
    }
}

/* ---------------------------------------------------------------- 4-bit tiles */

/* The layout 4-bit weights are multiplied in (`pack_int4_tiles` writes it from the
 * spec's): rows in tiles of TILE_ROWS, the last one padded with zero rows, each tile
 * block after block. A tile's block is `tile_block_bytes`: four quarters of 32 bytes of
 * codes, then the eight rows' scales and their offsets (float32, or float16 when
 * `half`; a group of several blocks repeats its own in each). In quarter q, byte 4r + i holds row r's element
 * 4q + i in its low nibble and its element 16 + 4q + i in its high one. One `maddubs`
 * then multiplies four elements of each of the eight rows by the same four activation
 * codes, broadcast: each row's sums stay in its own lane, with no horizontal sums, and a
 * block's scales are one vector for the eight rows. */
#define TILE_ROWS 8
#define TILE_CODES (4 * 32)

static inline int64_t tile_block_bytes(int64_t half) {
    return TILE_CODES + 2 * TILE_ROWS * (half ? 2 : 4);
}

/* The bytes of the tiles of an [n, k] weight. */
int64_t int4_tiles_bytes(int64_t n, int64_t k, int64_t half) {
    return (n + TILE_ROWS - 1) / TILE_ROWS * (k / BLOCK) * tile_block_bytes(half);
}

/* The tiles of the 4-bit weight in the spec's layout (QUANT-CODES-1: codes uint8 [n, k/2],
 * scales and offsets [n, k/group], float32, or float16 when `half`); k and group
 * multiples of 32. */
void pack_int4_tiles(const uint8_t *codes, const void *scales, const void *offsets, int64_t n,
                     int64_t k, int64_t group, int64_t half, uint8_t *tiles) {
    const int64_t blocks = k / BLOCK, groups = k / group, tile_count = (n + TILE_ROWS - 1) / TILE_ROWS;
    const size_t size = half ? 2 : 4;
    static const uint8_t zero[4];
    for (int64_t t = 0; t < tile_count; t++)
        for (int64_t b = 0; b < blocks; b++) {
            uint8_t *block = tiles + (t * blocks + b) * tile_block_bytes(half);
            uint8_t *ws = block + TILE_CODES, *wo = ws + TILE_ROWS * size;
            for (int r = 0; r < TILE_ROWS; r++) {
                const int64_t row = t * TILE_ROWS + r;
                const uint8_t *src = codes + row * (k / 2) + b * (BLOCK / 2);
                for (int q = 0; q < 4; q++)
                    for (int i = 0; i < 4; i++) {
                        const int low = 4 * q + i, high = 16 + 4 * q + i; /* elements */
                        block[32 * q + 4 * r + i] =
                            row < n ? (uint8_t)(((src[low / 2] >> (4 * (low % 2))) & 15) |
                                                (((src[high / 2] >> (4 * (high % 2))) & 15) << 4))
                                    : 0;
                    }
                const int64_t at = (row * groups + b * BLOCK / group) * (int64_t)size;
                memcpy(ws + r * size, row < n ? (const uint8_t *)scales + at : zero, size);
                memcpy(wo + r * size, row < n ? (const uint8_t *)offsets + at : zero, size);
            }
        }
}

/* Row r's code of element e of a tile's block; its scale (which 0) or offset (1). */
static inline int tile_code(const uint8_t *block, int64_t r, int e) {
    const uint8_t byte = block[32 * (e % 16 / 4) + 4 * r + e % 4];
    return e < 16 ? byte & 15 : byte >> 4;
}

static inline float tile_scale(const uint8_t *block, int64_t r, int64_t half, int which) {
    return field_at(block + TILE_CODES, half, which * TILE_ROWS + r);
}

/* w [n, k] float32 = the tiles' weights dequantized (QUANT-GROUP-1: s · q + o, two
 * roundings), bit for bit `spec.quant.dequantize_weight` of the weight they were packed
 * from. */
void dequantize_int4_tiles(const uint8_t *tiles, int64_t n, int64_t k, int64_t half, float *w) {
    const int64_t blocks = k / BLOCK;
    for (int64_t row = 0; row < n; row++)
        for (int64_t b = 0; b < blocks; b++) {
            const uint8_t *block =
                tiles + (row / TILE_ROWS * blocks + b) * tile_block_bytes(half);
            const int64_t r = row % TILE_ROWS;
            const float ws = tile_scale(block, r, half, 0), wo = tile_scale(block, r, half, 1);
            for (int e = 0; e < BLOCK; e++) {
                const float s = ws * (float)tile_code(block, r, e);
                w[row * k + b * BLOCK + e] = s + wo;
            }
        }
}

/* ---------------------------------------------------------------- the product */

typedef struct {
    const uint8_t *codes; /* 4-bit: the tiles; 8-bit: the spec's codes [N, K] */
    const void *scales, *offsets; /* 8-bit: [N, K/group], float16 when half; offsets
                                   * NULL when all zero */
    int64_t bits, k, group, half, m;
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

/* A 4-bit weight row n times activation row m, block after block: the block's integer sum
 * s, then t = fma(s, ws · d, t) and t = fma(wo, d · sum(codes), t), one rounding each.
 * `int4_tile_avx2` computes these very steps in each of its lanes: the same bits. */
static float int4_dot_scalar(const product_args *p, int64_t n, int64_t m) {
    const int64_t blocks = p->k / BLOCK, r = n % TILE_ROWS;
    const int8_t *c = p->x_codes + m * p->k;
    float total = 0.0f;
    for (int64_t b = 0; b < blocks; b++) {
        const uint8_t *block =
            p->codes + (n / TILE_ROWS * blocks + b) * tile_block_bytes(p->half);
        int sum = 0;
        for (int e = 0; e < BLOCK; e++) sum += tile_code(block, r, e) * c[b * BLOCK + e];
        total = fmaf((float)sum, tile_scale(block, r, p->half, 0) * p->d[m * blocks + b], total);
        total = fmaf(tile_scale(block, r, p->half, 1), p->d_sum[m * blocks + b], total);
    }
    return total;
}

/* `count` float16 values as float32: F16C's conversion eight at a time where the AVX2
 * loops run, the same values. */
static void widen_halves(const uint16_t *halves, int64_t count, float *out, int avx2) {
    int64_t i = 0;
#if defined(__x86_64__)
    if (avx2) i = widen_halves_f16c(halves, count, out);
#else
    (void)avx2;
#endif
    for (; i < count; i++) out[i] = half_to_float(halves[i]);
}

/* An 8-bit weight row's scales and offsets, one to a block, in float32. */
typedef struct {
    const float *scales, *offsets;
} block_fields;

/* Weight row n's: the arrays' own where they already are (float32, groups of one block,
 * offsets held); otherwise laid out in `scales` and `offsets` [K/32] (zeros for offsets
 * not held). Both product loops take a row's fields from here, so that a weight held in
 * float16 sums in the very code, and with the very values, of one held in float32. It
 * runs once per weight row and call, which for a decode step's one token is a row's
 * whole product: inlined, and F16C widens GGUF's Q8_0 scales eight at a time. */
__attribute__((always_inline)) static inline block_fields int8_block_fields(
    const product_args *p, int64_t n, int avx2, float *scales, float *offsets) {
    const int64_t blocks = p->k / BLOCK, groups = p->k / p->group, per_group = p->group / BLOCK;
    const int64_t first = n * groups;
    if (per_group == 1 && !p->half && p->offsets)
        return (block_fields){(const float *)p->scales + first,
                              (const float *)p->offsets + first};
    if (per_group == 1 && p->half) {
        widen_halves((const uint16_t *)p->scales + first, blocks, scales, avx2);
        if (p->offsets)
            widen_halves((const uint16_t *)p->offsets + first, blocks, offsets, avx2);
        else
            memset(offsets, 0, sizeof(float) * (size_t)blocks);
        return (block_fields){scales, offsets};
    }
    for (int64_t g = 0, b = 0; g < groups; g++) {
        const float scale = field_at(p->scales, p->half, first + g);
        const float offset = p->offsets ? field_at(p->offsets, p->half, first + g) : 0.0f;
        for (int64_t j = 0; j < per_group; j++, b++) scales[b] = scale, offsets[b] = offset;
    }
    return (block_fields){scales, offsets};
}

/* The scalar form of an 8-bit weight (x codes in element order), its row's fields `f`:
 * the AVX2 loops' steps lane by lane (`int8_row_avx2`), so that it gives their bits.
 * Blocks go eight to a chunk, block b + j's exact sum in lane j: t_j = fma(s, ws · d, t_j)
 * and o_j = fma(wo, d · sum(codes), o_j); a block past the last whole chunk goes in eight
 * lanes of four products each, l: t_l = fma(s_l, ws · d, t_l), its offset term added to
 * lane 0. Then lanes v_j = t_j + o_j, summed as ((v0 + v1) + (v2 + v3)) + ((v4 + v5) + (v6 +
 * v7)). Not reassociated (the library's flags allow it elsewhere): this order is the
 * definition of these bits. */
__attribute__((optimize("no-associative-math"))) static float int8_dot_scalar(
    const product_args *p, block_fields f, int64_t n, int64_t m) {
    const int64_t blocks = p->k / BLOCK;
    const int8_t *c = p->x_codes + m * p->k, *w = (const int8_t *)p->codes + n * p->k;
    const float *d = p->d + m * blocks, *d_sum = p->d_sum + m * blocks;
    float total[CHUNK] = {0}, offset[CHUNK] = {0};
    int64_t b = 0;
    for (; b + CHUNK <= blocks; b += CHUNK)
        for (int j = 0; j < CHUNK; j++) {
            int sum = 0;
            for (int64_t e = (b + j) * BLOCK; e < (b + j + 1) * BLOCK; e++) sum += w[e] * c[e];
            total[j] = fmaf((float)sum, f.scales[b + j] * d[b + j], total[j]);
            offset[j] = fmaf(f.offsets[b + j], d_sum[b + j], offset[j]);
        }
    for (; b < blocks; b++) {
        for (int l = 0; l < CHUNK; l++) {
            int sum = 0;
            for (int64_t e = b * BLOCK + 4 * l; e < b * BLOCK + 4 * l + 4; e++) sum += w[e] * c[e];
            total[l] = fmaf((float)sum, f.scales[b] * d[b], total[l]);
        }
        offset[0] = offset[0] + f.offsets[b] * d_sum[b];
    }
    float v[CHUNK];
    for (int j = 0; j < CHUNK; j++) v[j] = total[j] + offset[j];
    return ((v[0] + v[1]) + (v[2] + v[3])) + ((v[4] + v[5]) + (v[6] + v[7]));
}

/* Units [begin, end) of the product: 4-bit tiles, or 8-bit rows. */
static void product_scalar(const void *a, int64_t begin, int64_t end, int part) {
    const product_args *p = a;
    (void)part;
    const int64_t blocks = p->k / BLOCK;
    float scales[blocks], offsets[blocks];
    for (int64_t u = begin; u < end; u++) {
        if (p->bits == 8) {
            const block_fields f = int8_block_fields(p, u, 0, scales, offsets);
            for (int64_t m = 0; m < p->m; m++)
                store(p, m, u, p->n_rows, int8_dot_scalar(p, f, u, m));
            continue;
        }
        for (int64_t n = u * TILE_ROWS; n < (u + 1) * TILE_ROWS && n < p->n_rows; n++)
            for (int64_t m = 0; m < p->m; m++) store(p, m, n, p->n_rows, int4_dot_scalar(p, n, m));
    }
}

#if defined(__x86_64__)
#define AVX2 __attribute__((target("avx2,fma,f16c")))

typedef struct { /* activation row m's codes and scales */
    const int8_t *c;
    const float *d, *d_sum;
} activations;

AVX2 __attribute__((always_inline)) static inline activations activation_row(
    const product_args *p, int64_t m) {
    const int64_t blocks = p->k / BLOCK;
    return (activations){p->x_codes + m * p->k, p->d + m * blocks, p->d_sum + m * blocks};
}

/* An 8-bit weight block (32 codes) and its magnitudes: a batch loads them once for all
 * its rows. */
typedef struct {
    __m256i codes, magnitude;
} int8_block;

AVX2 __attribute__((always_inline)) static inline int8_block int8_weights(const uint8_t *row,
                                                                           int64_t b) {
    const __m256i w = _mm256_loadu_si256((const __m256i *)(row + b * BLOCK));
    return (int8_block){w, _mm256_sign_epi8(w, w)};
}

/* Four 8-bit blocks' sums, lane j + 4h the sum of block j's half h. */
AVX2 __attribute__((always_inline)) static inline __m256i int8_quad(const __m256i s[4]) {
    return _mm256_hadd_epi32(_mm256_hadd_epi32(s[0], s[1]), _mm256_hadd_epi32(s[2], s[3]));
}

AVX2 __attribute__((always_inline)) static inline __m128i fold(__m256i v) {
    return _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
}

/* One activation row's running sums against one 8-bit weight row: `total`, the float32
 * lanes of the integer sums times the weight's and the activations' scales; `offset`, the
 * offset terms wo · d · sum(codes). Vectors only: the library is built with
 * -fassociative-math, and a scalar chain of sums may be reordered differently where a
 * function is inlined for one row and for four. */
typedef struct {
    __m256 total, offset;
} row_sums;

/* The 8 block sums of the chunk at b (blocks b to b + 7, one to a lane) into the row's
 * sums: one conversion, one multiply and one FMA for eight blocks. */
AVX2 __attribute__((always_inline)) static inline void add_chunk(row_sums *r, __m256i sums,
                                                                 const float *ws,
                                                                 const float *wo,
                                                                 activations a, int64_t b) {
    const __m256 scale = _mm256_mul_ps(_mm256_loadu_ps(ws + b), _mm256_loadu_ps(a.d + b));
    r->total = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums), scale, r->total);
    r->offset = _mm256_fmadd_ps(_mm256_loadu_ps(wo + b), _mm256_loadu_ps(a.d_sum + b), r->offset);
}

/* The sums of block b alone into the row's sums. */
AVX2 __attribute__((always_inline)) static inline void add_block(row_sums *r, __m256i sums,
                                                                 const float *ws,
                                                                 const float *wo,
                                                                 activations a, int64_t b) {
    r->total = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums), _mm256_set1_ps(ws[b] * a.d[b]),
                               r->total);
    r->offset = _mm256_add_ps(r->offset,
                              _mm256_set_m128(_mm_setzero_ps(), _mm_set_ss(wo[b] * a.d_sum[b])));
}

/* The row's product: total and offset added lane by lane, the lanes summed as
 * ((0 + 1) + (2 + 3)) + ((4 + 5) + (6 + 7)). `finish_x4` sums four rows in these steps. */
AVX2 __attribute__((always_inline)) static inline float finish(row_sums r) {
    __m256 v = _mm256_add_ps(r.total, r.offset);
    v = _mm256_hadd_ps(v, v);
    v = _mm256_hadd_ps(v, v);
    return _mm_cvtss_f32(_mm_add_ss(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1)));
}

AVX2 __attribute__((always_inline)) static inline void finish_x4(const row_sums r[4],
                                                                 float out[4]) {
    __m256 v[4];
    for (int i = 0; i < 4; i++) v[i] = _mm256_add_ps(r[i].total, r[i].offset);
    const __m256 h = _mm256_hadd_ps(_mm256_hadd_ps(v[0], v[1]), _mm256_hadd_ps(v[2], v[3]));
    const __m128 sums = _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
    _mm_storeu_ps(out, sums);
}

/* The loops, once for each instruction set (native_quantized_loops.h). AVX2: a 4-bit
 * block's products gathered in int16, widened once. */
#define LOOPS(name) name##_avx2
#define LOOPS_TARGET AVX2
#define INT4_ADD(sums, u, x) _mm256_add_epi16(sums, _mm256_maddubs_epi16(u, x))
#define INT4_WIDE(sums) _mm256_madd_epi16(sums, _mm256_set1_epi16(1))
#define INT8_DOT(u, x) _mm256_madd_epi16(_mm256_maddubs_epi16(u, x), _mm256_set1_epi16(1))
#include "native_quantized_loops.h"

/* AVX-VNNI (VEX) and AVX-512 VNNI (EVEX, on 256-bit vectors): one `vpdpbusd` adds four
 * products into each int32 lane. */
#define LOOPS(name) name##_avxvnni
#define LOOPS_TARGET __attribute__((target("avx2,fma,f16c,avxvnni")))
#define INT4_ADD(sums, u, x) _mm256_dpbusd_avx_epi32(sums, u, x)
#define INT4_WIDE(sums) (sums)
#define INT8_DOT(u, x) _mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), u, x)
#include "native_quantized_loops.h"

#define LOOPS(name) name##_avx512vnni
#define LOOPS_TARGET __attribute__((target("avx2,fma,f16c,avx512vnni,avx512vl")))
#define INT4_ADD(sums, u, x) _mm256_dpbusd_epi32(sums, u, x)
#define INT4_WIDE(sums) (sums)
#define INT8_DOT(u, x) _mm256_dpbusd_epi32(_mm256_setzero_si256(), u, x)
#include "native_quantized_loops.h"

/* The VNNI loops with each `vpdpbusd` done by AVX2's `maddubs` and `madd` (the same
 * integers): DECODESPEC_NATIVE_ISA=avx2-dpbusd runs them, so that every machine's tests
 * check the VNNI loops' own code, not only the instruction. */
#define LOOPS(name) name##_dpbusd
#define LOOPS_TARGET AVX2
#define INT4_ADD(sums, u, x) _mm256_add_epi32(sums, INT8_DOT(u, x))
#define INT4_WIDE(sums) (sums)
#define INT8_DOT(u, x) _mm256_madd_epi16(_mm256_maddubs_epi16(u, x), _mm256_set1_epi16(1))
#include "native_quantized_loops.h"
#endif

/* The product's loops for each instruction set, best first; `runs` says whether this
 * CPU has what they need. */
typedef struct {
    const char *name;
    task_fn int4, int8;
    int (*runs)(void);
} product_loops;

static int always(void) { return 1; }
#if defined(__x86_64__)
static int cpu_avx512vnni(void) {
    return cpu_avx2() && __builtin_cpu_supports("avx512vnni") &&
           __builtin_cpu_supports("avx512vl");
}
static int cpu_avxvnni(void) { return cpu_avx2() && __builtin_cpu_supports("avxvnni"); }
#endif

static const product_loops PRODUCT_LOOPS[] = {
#if defined(__x86_64__)
    {"avx512vnni", int4_tiles_avx512vnni, int8_rows_avx512vnni, cpu_avx512vnni},
    {"avxvnni", int4_tiles_avxvnni, int8_rows_avxvnni, cpu_avxvnni},
    {"avx2", int4_tiles_avx2, int8_rows_avx2, cpu_avx2},
    {"avx2-dpbusd", int4_tiles_dpbusd, int8_rows_dpbusd, cpu_avx2}, /* never chosen unasked */
#endif
    {"scalar", product_scalar, product_scalar, always},
};
#define PRODUCT_LOOPS_COUNT (sizeof PRODUCT_LOOPS / sizeof PRODUCT_LOOPS[0])

/* The loops that run: those DECODESPEC_NATIVE_ISA names where this CPU runs them, else
 * the first this CPU runs (of those chosen unasked). Chosen once a process. */
static const product_loops *chosen_loops(void) {
    static const product_loops *chosen = NULL;
    if (!chosen) {
        const char *asked = getenv("DECODESPEC_NATIVE_ISA");
        for (size_t i = 0; i < PRODUCT_LOOPS_COUNT && !chosen; i++)
            if (asked && strcmp(asked, PRODUCT_LOOPS[i].name) == 0 && PRODUCT_LOOPS[i].runs())
                chosen = &PRODUCT_LOOPS[i];
        for (size_t i = 0; i < PRODUCT_LOOPS_COUNT && !chosen; i++)
            if (strcmp(PRODUCT_LOOPS[i].name, "avx2-dpbusd") != 0 && PRODUCT_LOOPS[i].runs())
                chosen = &PRODUCT_LOOPS[i];
    }
    return chosen;
}

/* Which loops run: "avx512vnni", "avxvnni", "avx2", "avx2-dpbusd" or "scalar" (the
 * engine's path line names it). */
const char *quantized_isa(void) { return chosen_loops()->name; }

typedef struct {
    const void *x;
    int64_t x_bf16, k, blocks;
    int8_t *codes;
    float *d, *d_sum;
} quantize_args;

/* quantize_row for rows [begin, end): a prompt's rows split among the threads, each
 * row's codes and scales its own (the same bits on any thread). */
static void quantize_rows(const void *a, int64_t begin, int64_t end, int part) {
    const quantize_args *p = a;
    (void)part;
    for (int64_t r = begin; r < end; r++)
        quantize_row(p->x, p->x_bf16, r, p->k, p->codes + r * p->k, p->d + r * p->blocks,
                     p->d_sum + r * p->blocks);
}

/* y [M, N] = QUANT-A8-1's product of x [M, K] (contiguous float32, or bfloat16 when
 * x_bf16) and the quantized weight: 4-bit, `codes` its tiles (`pack_int4_tiles`; scales
 * and offsets are in them, the two pointers unused); 8-bit, the spec's layout. `half`:
 * the scales and offsets are float16 (in the tiles, or the arrays); 8-bit offsets NULL:
 * all zero. y contiguous float32, or bfloat16 when y_bf16. K and the group size
 * multiples of 32. Returns 0, or -1 when out of memory. */
int quantized_product(const uint8_t *codes, const void *scales, const void *offsets,
                      int64_t bits, int64_t n, int64_t k, int64_t group, int64_t half,
                      const void *x, int64_t x_bf16, int64_t m, void *y, int64_t y_bf16,
                      int64_t threads) {
    const int64_t blocks = k / BLOCK;
    char *scratch = malloc((size_t)(m * k + 2 * m * blocks * (int64_t)sizeof(float)));
    if (!scratch) return -1;
    float *d = (float *)scratch, *d_sum = d + m * blocks;
    int8_t *x_codes = (int8_t *)(d_sum + m * blocks);
    const quantize_args rows = {x, x_bf16, k, blocks, x_codes, d, d_sum};
    parallel_rows(quantize_rows, &rows, m, (int)threads);
    product_args args = {codes, scales, offsets, bits, k, group, half, m, x_codes, d, d_sum,
                         y, y_bf16, n};
    const product_loops *loops = chosen_loops();
    const task_fn units = bits == 4 ? loops->int4 : loops->int8;
    if (bits == 4)
        parallel_parts(units, &args, (n + TILE_ROWS - 1) / TILE_ROWS, 1, (int)threads);
    else
        parallel_parts(units, &args, n, 16, (int)threads);
    free(scratch);
    return 0;
}

/* QUANT-A8-1's activation codes [M, K] (in element order) and scales [M, K/32] of
 * float32 x: the product's own, for the tests to hold against the spec's. */
void quantize_activations(const float *x, int64_t m, int64_t k, int8_t *codes, float *d) {
    float *d_sum = malloc(sizeof(float) * (size_t)(k / BLOCK));
    for (int64_t r = 0; r < m; r++)
        quantize_row(x, 0, r, k, codes + r * k, d + r * (k / BLOCK), d_sum);
    free(d_sum);
}
