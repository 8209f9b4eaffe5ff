/* The float32 projections of the torch backend on the CPU: y [M, N] = x [M, K] · Wᵀ.
 *
 * A BLAS picks its kernel and its summation order by the shape of the whole product,
 * so a row of y comes out in other bits among 16 rows than alone (issue 40: PyTorch's
 * CPU GEMM on an Intel AVX-512 machine). Here each (weight row, activation row) sum
 * has one order, fixed by K alone, whatever M, N, the tile it falls in or the thread
 * that computes it:
 *
 *     eight lanes, lane j summing w[k] x[k] for k = j, j + 8, j + 16, ... (a fused
 *     multiply-add each), up to the last multiple of 8; then the lanes added in a
 *     fixed tree, ((0+4) + (2+6)) + ((1+5) + (3+7)); then the last K % 8 products,
 *     in order, each a fused multiply-add.
 *
 * The AVX2 loops compute it eight lanes to a register; the scalar loops (CPUs without
 * AVX2 and FMA, or DECODESPEC_NATIVE_ISA=scalar) compute the same lanes one by one
 * with `fmaf`, which rounds once as the instruction does: both give the same bits.
 *
 * Tiles of 4 weight rows by 3 activation rows keep twelve sums in registers (each
 * weight vector loaded once for three rows, each activation vector once for four);
 * rows at the edges take the same loop with fewer lanes of the tile filled, since a
 * sum's order is its own. Weight rows are split among the threads in tiles.
 */
#pragma GCC optimize("no-associative-math") /* the order above is the definition */
#include <math.h>
#include <stdint.h>
#if defined(__x86_64__)
#include <immintrin.h>
#endif

typedef void (*task_fn)(const void *args, int64_t begin, int64_t end, int part);
void parallel_parts(task_fn fn, const void *args, int64_t rows, int64_t align, int threads);
int native_avx2(void);

#define LANES 8
#define TILE_N 4 /* weight rows a tile */
#define TILE_M 3 /* activation rows a tile */

typedef struct {
    const float *w, *x;
    float *y;
    int64_t n, k, m;
} dense_args;

/* The lanes' fixed tree, then the tail's products in order. */
static inline float finish(const float lane[LANES], const float *w, const float *x, int64_t from,
                           int64_t k) {
    float s = ((lane[0] + lane[4]) + (lane[2] + lane[6])) + ((lane[1] + lane[5]) + (lane[3] + lane[7]));
    for (int64_t i = from; i < k; i++) s = fmaf(w[i], x[i], s);
    return s;
}

static float dot_scalar(const float *w, const float *x, int64_t k) {
    float lane[LANES] = {0};
    const int64_t body = k - k % LANES;
    for (int64_t i = 0; i < body; i += LANES)
        for (int j = 0; j < LANES; j++) lane[j] = fmaf(w[i + j], x[i + j], lane[j]);
    return finish(lane, w, x, body, k);
}

/* Weight rows [begin, end) of every activation row, one sum at a time. */
static void dense_scalar(const void *a, int64_t begin, int64_t end, int part) {
    const dense_args *p = a;
    (void)part;
    for (int64_t n = begin; n < end; n++)
        for (int64_t m = 0; m < p->m; m++)
            p->y[m * p->n + n] = dot_scalar(p->w + n * p->k, p->x + m * p->k, p->k);
}

#if defined(__x86_64__)
#define AVX2 __attribute__((target("avx2,fma")))

/* The tile of weight rows n0 .. n0 + rows and activation rows m0 .. m0 + cols
 * (rows <= TILE_N, cols <= TILE_M): each sum in its own register, in the order above. */
AVX2 static void tile_avx2(const dense_args *p, int64_t n0, int rows, int64_t m0, int cols) {
    const int64_t k = p->k, body = k - k % LANES;
    const float *w[TILE_N], *x[TILE_M];
    for (int r = 0; r < TILE_N; r++) w[r] = p->w + (n0 + (r < rows ? r : 0)) * k;
    for (int c = 0; c < TILE_M; c++) x[c] = p->x + (m0 + (c < cols ? c : 0)) * k;
    __m256 acc[TILE_N][TILE_M];
    for (int r = 0; r < TILE_N; r++)
        for (int c = 0; c < TILE_M; c++) acc[r][c] = _mm256_setzero_ps();
    if (rows == TILE_N && cols == TILE_M) { /* the common case, fully unrolled */
        for (int64_t i = 0; i < body; i += LANES) {
            const __m256 x0 = _mm256_loadu_ps(x[0] + i), x1 = _mm256_loadu_ps(x[1] + i),
                         x2 = _mm256_loadu_ps(x[2] + i);
            for (int r = 0; r < TILE_N; r++) {
                const __m256 v = _mm256_loadu_ps(w[r] + i);
                acc[r][0] = _mm256_fmadd_ps(v, x0, acc[r][0]);
                acc[r][1] = _mm256_fmadd_ps(v, x1, acc[r][1]);
                acc[r][2] = _mm256_fmadd_ps(v, x2, acc[r][2]);
            }
        }
    } else if (cols == 1) { /* a decode step: one activation row, four weight rows */
        for (int64_t i = 0; i < body; i += LANES) {
            const __m256 x0 = _mm256_loadu_ps(x[0] + i);
            for (int r = 0; r < rows; r++)
                acc[r][0] = _mm256_fmadd_ps(_mm256_loadu_ps(w[r] + i), x0, acc[r][0]);
        }
    } else {
        for (int64_t i = 0; i < body; i += LANES)
            for (int r = 0; r < rows; r++) {
                const __m256 v = _mm256_loadu_ps(w[r] + i);
                for (int c = 0; c < cols; c++)
                    acc[r][c] = _mm256_fmadd_ps(v, _mm256_loadu_ps(x[c] + i), acc[r][c]);
            }
    }
    float lane[LANES];
    for (int r = 0; r < rows; r++)
        for (int c = 0; c < cols; c++) {
            _mm256_storeu_ps(lane, acc[r][c]);
            p->y[(m0 + c) * p->n + n0 + r] = finish(lane, w[r], x[c], body, k);
        }
}

/* Weight rows [begin, end) (a multiple of TILE_N but at the last) of every activation row. */
AVX2 static void dense_avx2(const void *a, int64_t begin, int64_t end, int part) {
    const dense_args *p = a;
    (void)part;
    for (int64_t n = begin; n < end; n += TILE_N) {
        const int rows = (int)(end - n < TILE_N ? end - n : TILE_N);
        for (int64_t m = 0; m < p->m; m += TILE_M)
            tile_avx2(p, n, rows, m, (int)(p->m - m < TILE_M ? p->m - m : TILE_M));
    }
}
#endif

/* y [M, N] (contiguous float32) = x [M, K] · Wᵀ, W [N, K] and x contiguous float32, each
 * sum in the order the header fixes, on up to `threads` threads. */
void dense_product(const float *w, int64_t n, int64_t k, const float *x, int64_t m, float *y,
                   int64_t threads) {
    const dense_args args = {w, x, y, n, k, m};
    task_fn rows = dense_scalar;
#if defined(__x86_64__)
    if (native_avx2()) rows = dense_avx2;
#endif
    parallel_parts(rows, &args, n, TILE_N, (int)threads);
}

/* Which loops `dense_product` runs: "avx2" or "scalar". */
const char *dense_isa(void) { return native_avx2() ? "avx2" : "scalar"; }
