/* The quantized projections of the torch backend on the CPU (spec/quant.py).
 *
 * `quantized_product` is QUANT-A8-1, the activation-quantized linear that GGUF
 * engines compute: each row of x quantized to int8 in blocks of 32 (absmax / 127,
 * round half to even), integer dot products with the weights' codes, then the
 * block's scales. A 4-bit weight row is read once per token at half a byte a
 * weight, and 64 products (two blocks) cost two `maddubs` and one `madd` (AVX2)
 * instead of eight conversions and eight float FMAs: on a 2-core AVX2 machine a
 * decode step's projections take well under half of PyTorch's kernels' time
 * (tests/benchmarks/quantized_product.py). With several tokens, a weight row's codes
 * are loaded and unpacked once for four activation rows (`int4_row_x4`, `int8_row_x4`),
 * and the four rows' sums are reduced together (`finish_x4`). Each (weight row, activation row)
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

/* Whether the AVX2 loops run: the CPU has AVX2 and FMA, and DECODESPEC_NATIVE_ISA is not
 * "scalar" (which the tests set to run the scalar loops of CPUs without them). */
static int has_avx2(void) {
#if defined(__x86_64__)
    static int known = -1;
    if (known < 0) {
        const char *isa = getenv("DECODESPEC_NATIVE_ISA");
        known = !(isa && strcmp(isa, "scalar") == 0) && __builtin_cpu_supports("avx2") &&
                __builtin_cpu_supports("fma");
    }
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

/* ---------------------------------------------------------------- QUANT-A8-1 */

/* Blocks per float step of the AVX2 loops: the integer sums of eight blocks are gathered
 * into one vector (`chunk_sums`), block by block in its lanes, so that eight blocks cost
 * one conversion, one multiply and one FMA. The last K/32 % 8 blocks go one at a time. */
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

/* Row m of x (float32, or bfloat16 when x_bf16) quantized: codes [K], the block scales
 * d [K/32] and d * sum(codes). The codes are in element order, or with `paired` in the
 * order the AVX2 4-bit loop reads them. There each chunk of eight blocks is four pairs,
 * blocks (0, 4), (1, 5), (2, 6), (3, 7): a pair is its first block's even elements, its
 * second's even elements, then the first's odd and the second's odd ones, so that a
 * byte's low nibbles meet the even elements and its high nibbles the odd ones, two blocks
 * at a time. Past the last whole chunk, consecutive blocks pair up in the same way, and
 * a last block left alone is its even elements, then its odd ones. */
static void quantize_row(const void *x, int64_t x_bf16, int64_t m, int64_t k, int paired,
                         int8_t *codes, float *d, float *d_sum) {
    const int64_t blocks = k / BLOCK, in_chunks = blocks - blocks % CHUNK;
    const int avx2 = has_avx2();
    for (int64_t b = 0; b < blocks; b++) {
        float widened[BLOCK];
        const float *v = (const float *)x + m * k + b * BLOCK;
        if (x_bf16) {
            for (int j = 0; j < BLOCK; j++)
                widened[j] = bf16_to_float(((const uint16_t *)x)[m * k + b * BLOCK + j]);
            v = widened;
        }
        int8_t block[BLOCK];
        int sum;
#if defined(__x86_64__)
        const float scale = avx2 ? quantize_block_avx2(v, block, &sum)
                                 : quantize_block(v, block, &sum);
#else
        const float scale = quantize_block(v, block, &sum);
        (void)avx2;
#endif
        /* the pair holding block b: its first block, and which of the two b is */
        int64_t pair = -1, half = 0;
        if (b < in_chunks)
            pair = b - b % CHUNK + 2 * (b % (CHUNK / 2)), half = b % CHUNK / 4;
        else if ((b - in_chunks) % 2 == 1 || b + 1 < blocks)
            pair = b - (b - in_chunks) % 2, half = (b - in_chunks) % 2;
        if (!paired)
            memcpy(codes + b * BLOCK, block, BLOCK);
        else if (pair >= 0)
            for (int j = 0; j < BLOCK; j++)
                codes[pair * BLOCK + (j % 2) * BLOCK + half * (BLOCK / 2) + j / 2] = block[j];
        else
            for (int j = 0; j < BLOCK; j++)
                codes[b * BLOCK + (j % 2) * (BLOCK / 2) + j / 2] = block[j];
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

/* The scalar form (x codes in element order). */
static float dot_scalar(const product_args *p, int64_t n, int64_t m) {
    const int64_t blocks = p->k / BLOCK, groups = p->k / p->group;
    const int8_t *c = p->x_codes + m * p->k;
    float total = 0.0f, offset = 0.0f;
    for (int64_t b = 0; b < blocks; b++) {
        const int64_t g = b * BLOCK / p->group;
        int sum = 0;
        for (int64_t e = b * BLOCK; e < (b + 1) * BLOCK; e++) {
            const int q = p->bits == 4 ? (p->codes[n * (p->k / 2) + e / 2] >> (4 * (e % 2))) & 15
                                       : ((const int8_t *)p->codes)[n * p->k + e];
            sum += q * c[e];
        }
        total += p->scales[n * groups + g] * p->d[m * blocks + b] * (float)sum;
        offset += p->offsets[n * groups + g] * p->d_sum[m * blocks + b];
    }
    return total + offset;
}

#if defined(__x86_64__)
#define AVX2 __attribute__((target("avx2,fma")))

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

/* An 8-bit block against its 32 activation codes x: 8 int32 lanes of its sums (`maddubs`
 * takes one unsigned operand: |w| times x with w's sign). */
AVX2 __attribute__((always_inline)) static inline __m256i int8_block_sums(int8_block w,
                                                                           const int8_t *x) {
    const __m256i pairs = _mm256_maddubs_epi16(
        w.magnitude, _mm256_sign_epi8(_mm256_loadu_si256((const __m256i *)x), w.codes));
    return _mm256_madd_epi16(pairs, _mm256_set1_epi16(1));
}

/* Block b alone: 8 int32 lanes of its sums. A 4-bit block's activation codes are its
 * even elements, then its odd ones (the last block of an odd tail); an 8-bit block is
 * in element order. */
AVX2 __attribute__((always_inline)) static inline __m256i block_sums(const uint8_t *row,
                                                                      const int8_t *c, int64_t b,
                                                                      const int bits) {
    if (bits == 8) return int8_block_sums(int8_weights(row, b), c + b * BLOCK);
    const __m256i x = _mm256_loadu_si256((const __m256i *)(c + b * BLOCK));
    const __m128i bytes = _mm_loadu_si128((const __m128i *)(row + b * (BLOCK / 2)));
    const __m256i codes =
        _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(bytes, 4), bytes), _mm256_set1_epi8(15));
    return _mm256_madd_epi16(_mm256_maddubs_epi16(codes, x), _mm256_set1_epi16(1));
}

/* Two 4-bit weight blocks' 32 bytes of codes, `first`'s in the low 128 bits and
 * `second`'s in the high ones, unpacked: the low nibbles (the even elements) and the
 * high ones (the odd elements). A batch unpacks them once for all its rows. */
typedef struct {
    __m256i even, odd;
} nibbles;

AVX2 __attribute__((always_inline)) static inline nibbles int4_nibbles(const uint8_t *row,
                                                                        int64_t first,
                                                                        int64_t second) {
    const __m256i nibble = _mm256_set1_epi8(15);
    const __m256i bytes = _mm256_loadu2_m128i((const __m128i *)(row + second * (BLOCK / 2)),
                                              (const __m128i *)(row + first * (BLOCK / 2)));
    return (nibbles){_mm256_and_si256(bytes, nibble),
                     _mm256_and_si256(_mm256_srli_epi16(bytes, 4), nibble)};
}

/* A pair of 4-bit blocks against its 64 activation codes x in quantize_row's pair
 * layout: the low nibbles times the two blocks' even elements and the high nibbles times
 * their odd ones (one `maddubs` each), added in int16 (|sum| <= 4 · 15 · 127 < 2^15) and
 * widened by one `madd`: 8 int32, the first block's sums in the low 4 lanes and the
 * second's in the high 4. */
AVX2 __attribute__((always_inline)) static inline __m256i int4_pair_sums(nibbles w,
                                                                          const int8_t *x) {
    const __m256i even = _mm256_maddubs_epi16(w.even, _mm256_loadu_si256((const __m256i *)x));
    const __m256i odd =
        _mm256_maddubs_epi16(w.odd, _mm256_loadu_si256((const __m256i *)(x + BLOCK)));
    return _mm256_madd_epi16(_mm256_add_epi16(even, odd), _mm256_set1_epi16(1));
}

/* Four 8-bit blocks' sums, lane j + 4h the sum of block j's half h. */
AVX2 __attribute__((always_inline)) static inline __m256i int8_quad(const __m256i s[4]) {
    return _mm256_hadd_epi32(_mm256_hadd_epi32(s[0], s[1]), _mm256_hadd_epi32(s[2], s[3]));
}

AVX2 __attribute__((always_inline)) static inline __m128i fold(__m256i v) {
    return _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
}

/* The four pairs' sums of a 4-bit chunk, slot s holding blocks s and s + 4, folded by
 * integer additions (exact): each block's whole sum in lane s and s + 4. */
AVX2 __attribute__((always_inline)) static inline __m256i chunk_of_pairs(const __m256i s[4]) {
    return _mm256_hadd_epi32(_mm256_hadd_epi32(s[0], s[1]), _mm256_hadd_epi32(s[2], s[3]));
}

/* Blocks b to b + 7: each block's whole sum in lane b + j. */
AVX2 __attribute__((always_inline)) static inline __m256i chunk_sums(const uint8_t *row,
                                                                      const int8_t *c, int64_t b,
                                                                      const int bits) {
    __m256i s[4];
    if (bits == 8) {
        __m128i quads[2];
        for (int quad = 0; quad < 2; quad++) {
            for (int j = 0; j < 4; j++) s[j] = block_sums(row, c, b + 4 * quad + j, 8);
            quads[quad] = fold(int8_quad(s));
        }
        return _mm256_set_m128i(quads[1], quads[0]);
    }
    for (int slot = 0; slot < 4; slot++)
        s[slot] = int4_pair_sums(int4_nibbles(row, b + slot, b + slot + 4),
                                 c + (b + 2 * slot) * BLOCK);
    return chunk_of_pairs(s);
}

/* One activation row's running sums against one weight row: `total`, the float32 lanes
 * of the integer sums times the weight's and the activations' scales; `offset`, the
 * offset terms wo · d · sum(codes). Vectors only: the library is built with
 * -fassociative-math, and a scalar chain of sums may be reordered differently where a
 * function is inlined for one row and for four. */
typedef struct {
    __m256 total, offset;
} row_sums;

typedef struct { /* activation row m's codes and scales */
    const int8_t *c;
    const float *d, *d_sum;
} activations;

AVX2 __attribute__((always_inline)) static inline activations activation_row(
    const product_args *p, int64_t m) {
    const int64_t blocks = p->k / BLOCK;
    return (activations){p->x_codes + m * p->k, p->d + m * blocks, p->d_sum + m * blocks};
}

/* The 8 block sums of the chunk at b into the row's sums: one conversion, one multiply
 * and one FMA for eight blocks. */
AVX2 __attribute__((always_inline)) static inline void add_chunk(row_sums *r, __m256i sums,
                                                                 const float *ws,
                                                                 const float *wo,
                                                                 activations a, int64_t b) {
    const __m256 scale = _mm256_mul_ps(_mm256_loadu_ps(ws + b), _mm256_loadu_ps(a.d + b));
    r->total = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums), scale, r->total);
    r->offset = _mm256_fmadd_ps(_mm256_loadu_ps(wo + b), _mm256_loadu_ps(a.d_sum + b), r->offset);
}

/* The sums of blocks b and b + 1 past the last chunk (4 lanes each) into the row's sums. */
AVX2 __attribute__((always_inline)) static inline void add_pair(row_sums *r, __m256i sums,
                                                                const float *ws, const float *wo,
                                                                activations a, int64_t b) {
    const __m256 scale =
        _mm256_set_m128(_mm_set1_ps(ws[b + 1] * a.d[b + 1]), _mm_set1_ps(ws[b] * a.d[b]));
    r->total = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums), scale, r->total);
    r->offset = _mm256_add_ps(r->offset, _mm256_set_m128(_mm_set_ss(wo[b + 1] * a.d_sum[b + 1]),
                                                         _mm_set_ss(wo[b] * a.d_sum[b])));
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

/* The AVX2 form of weight row `row` (its block scales ws and offsets wo) times activation
 * row m. Each block's 32 products are summed exactly in integers, eight blocks to a
 * vector (`chunk_sums`), converted and scaled in float32 lanes (`add_chunk`). Past the
 * last whole chunk, 4-bit blocks go two at a time and 8-bit ones one at a time. Each pair
 * of rows is computed alone, in one order whatever the batch and the thread. */
AVX2 __attribute__((always_inline)) static inline float row_avx2(const product_args *p,
                                                                 const uint8_t *row,
                                                                 const float *ws,
                                                                 const float *wo, int64_t m,
                                                                 const int bits) {
    const int64_t blocks = p->k / BLOCK;
    const activations a = activation_row(p, m);
    row_sums r = {_mm256_setzero_ps(), _mm256_setzero_ps()};
    int64_t b = 0;
    for (; b + CHUNK <= blocks; b += CHUNK)
        add_chunk(&r, chunk_sums(row, a.c, b, bits), ws, wo, a, b);
    for (; bits == 4 && b + 2 <= blocks; b += 2)
        add_pair(&r, int4_pair_sums(int4_nibbles(row, b, b + 1), a.c + b * BLOCK), ws, wo, a, b);
    for (; b < blocks; b++) add_block(&r, block_sums(row, a.c, b, bits), ws, wo, a, b);
    return finish(r);
}

/* Activation rows m to m + 3 and their empty sums, for the 4-row forms below. */
AVX2 __attribute__((always_inline)) static inline void start_x4(const product_args *p, int64_t m,
                                                                activations a[4],
                                                                row_sums r[4]) {
    for (int i = 0; i < 4; i++) {
        a[i] = activation_row(p, m + i);
        r[i] = (row_sums){_mm256_setzero_ps(), _mm256_setzero_ps()};
    }
}

/* `row_avx2` of a 4-bit weight row against activation rows m to m + 3 at once: the
 * row's nibbles are loaded and unpacked once for the four (the work a batch shares).
 * Each activation row's sums, conversions and FMAs are row_avx2's, in its order: every
 * result has the bits row_avx2 gives that row alone. */
AVX2 static inline void int4_row_x4(const product_args *p, const uint8_t *row, const float *ws,
                                    const float *wo, int64_t m, float out[4]) {
    const int64_t blocks = p->k / BLOCK;
    activations a[4];
    row_sums r[4];
    start_x4(p, m, a, r);
    int64_t b = 0;
    for (; b + CHUNK <= blocks; b += CHUNK) {
        __m256i s[4][4]; /* [row][slot] */
        for (int slot = 0; slot < 4; slot++) {
            const nibbles w = int4_nibbles(row, b + slot, b + slot + 4);
            for (int i = 0; i < 4; i++)
                s[i][slot] = int4_pair_sums(w, a[i].c + (b + 2 * slot) * BLOCK);
        }
        for (int i = 0; i < 4; i++) add_chunk(&r[i], chunk_of_pairs(s[i]), ws, wo, a[i], b);
    }
    for (; b + 2 <= blocks; b += 2) {
        const nibbles w = int4_nibbles(row, b, b + 1);
        for (int i = 0; i < 4; i++)
            add_pair(&r[i], int4_pair_sums(w, a[i].c + b * BLOCK), ws, wo, a[i], b);
    }
    for (; b < blocks; b++)
        for (int i = 0; i < 4; i++)
            add_block(&r[i], block_sums(row, a[i].c, b, 4), ws, wo, a[i], b);
    finish_x4(r, out);
}

/* `row_avx2` of an 8-bit weight row against activation rows m to m + 3 at once: each
 * block's codes and magnitudes are loaded once for the four; every result has the bits
 * row_avx2 gives that row alone. */
AVX2 static inline void int8_row_x4(const product_args *p, const uint8_t *row, const float *ws,
                                    const float *wo, int64_t m, float out[4]) {
    const int64_t blocks = p->k / BLOCK;
    activations a[4];
    row_sums r[4];
    start_x4(p, m, a, r);
    int64_t b = 0;
    for (; b + CHUNK <= blocks; b += CHUNK) {
        __m128i quads[4][2]; /* [row][quad] */
        for (int quad = 0; quad < 2; quad++) {
            __m256i s[4][4]; /* [row][block] */
            for (int j = 0; j < 4; j++) {
                const int64_t block = b + 4 * quad + j;
                const int8_block w = int8_weights(row, block);
                for (int i = 0; i < 4; i++) s[i][j] = int8_block_sums(w, a[i].c + block * BLOCK);
            }
            for (int i = 0; i < 4; i++) quads[i][quad] = fold(int8_quad(s[i]));
        }
        for (int i = 0; i < 4; i++)
            add_chunk(&r[i], _mm256_set_m128i(quads[i][1], quads[i][0]), ws, wo, a[i], b);
    }
    for (; b < blocks; b++) {
        const int8_block w = int8_weights(row, b);
        for (int i = 0; i < 4; i++)
            add_block(&r[i], int8_block_sums(w, a[i].c + b * BLOCK), ws, wo, a[i], b);
    }
    finish_x4(r, out);
}

/* Rows [begin, end) of the weight against every activation row. With groups of more
 * than one block, a weight row's scales and offsets are first laid out per block, once
 * for all activation rows. */
#define ROWS_AVX2(name, bits)                                                                   \
    AVX2 static void name(const void *a, int64_t begin, int64_t end, int part) {                \
        const product_args *p = a;                                                              \
        (void)part;                                                                             \
        const int64_t blocks = p->k / BLOCK, groups = p->k / p->group;                          \
        const int64_t per_group = p->group / BLOCK;                                             \
        const int64_t laid_out = per_group == 1 ? 1 : blocks;                                   \
        float block_scales[laid_out], block_offsets[laid_out];                                  \
        for (int64_t n = begin; n < end; n++) {                                                 \
            const float *ws = p->scales + n * groups, *wo = p->offsets + n * groups;            \
            if (per_group != 1) {                                                               \
                for (int64_t g = 0, b = 0; g < groups; g++)                                     \
                    for (int64_t j = 0; j < per_group; j++, b++)                                \
                        block_scales[b] = ws[g], block_offsets[b] = wo[g];                      \
                ws = block_scales, wo = block_offsets;                                          \
            }                                                                                   \
            const uint8_t *row = p->codes + n * (bits == 4 ? p->k / 2 : p->k);                  \
            int64_t m = 0;                                                                      \
            for (float four[4]; m + 4 <= p->m; m += 4) {                                        \
                if (bits == 4)                                                                  \
                    int4_row_x4(p, row, ws, wo, m, four);                                       \
                else                                                                            \
                    int8_row_x4(p, row, ws, wo, m, four);                                       \
                for (int r = 0; r < 4; r++) store(p, m + r, n, p->n_rows, four[r]);             \
            }                                                                                   \
            for (; m < p->m; m++)                                                               \
                store(p, m, n, p->n_rows, row_avx2(p, row, ws, wo, m, bits));                   \
        }                                                                                       \
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
        quantize_row(x, x_bf16, r, k, bits == 4 && has_avx2(), x_codes + r * k, d + r * blocks,
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
