/* The torch backend's decode step between its projections, in C (native_step.py).
 *
 * A decoder layer of spec/forward.py is its projections (QUANT-A8-1's C product,
 * native_quantized.c, float32 in and out) and some seventy small tensor
 * operations between them: norms, RoPE, the KV append, attention, SiLU, the
 * residual adds. At one token a step, dispatching those operations one by one
 * costs more than computing them. Here they are three functions over float32
 * rows, with the same arithmetic, and `decoder_layers` runs every layer, its
 * products included, in one call.
 *
 * Attention is `attention`, `decoder_layers'` fused step, which computes the
 * new rows and then calls native_attention.c's `append_kv` and
 * `paged_attention`, the stage contract's operations (native_attention.py wraps
 * them for the conformance suite), so the suite checks the very code the
 * engine runs.
 *
 * Callers (native_step.py, native_attention.py) validate every shape and
 * index first; these loops trust them.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* The compiler that built this library, for the engine's report of which path runs. */
const char *compiler_version(void) { return __VERSION__; }

/* x[t] += add[t] (rows `add_stride` floats apart; none when add is NULL),
 * then out[t] = weight · x[t] / sqrt(mean(x[t]²) + eps)  (FWD-NORM-1, FWD-LAYER-1). */
void add_rms_norm(float *x, const float *add, int64_t add_stride, const float *weight,
                  float eps, float *out, int64_t tokens, int64_t hidden) {
    for (int64_t t = 0; t < tokens; t++) {
        float *row = x + t * hidden;
        if (add) {
            const float *a = add + t * add_stride;
            for (int64_t i = 0; i < hidden; i++) row[i] += a[i];
        }
        if (!out) continue; /* the last residual add: the final norm is PyTorch's */
        float sum = 0.0f;
        for (int64_t i = 0; i < hidden; i++) sum += row[i] * row[i];
        float inv = 1.0f / sqrtf(sum / (float)hidden + eps);
        float *o = out + t * hidden;
        for (int64_t i = 0; i < hidden; i++) o[i] = weight[i] * (row[i] * inv);
    }
}

#if defined(__x86_64__)
#include <immintrin.h>
#define AVX2 __attribute__((target("avx2,fma")))

/* native_attention.c: e^x on eight lanes for x <= 0 (its softmax's exp). */
AVX2 __m256 exp_nonpositive_lanes(__m256 x);

/* silu(g) · u on eight lanes: silu(g) = g / (1 + e^-g) with e^-|g| from the softmax's
 * exp: g / (1 + e) for g >= 0, g e / (1 + e) below (e^-g would overflow). */
AVX2 __attribute__((always_inline)) static inline __m256 silu_mul8(__m256 g, __m256 u) {
    const __m256 e = exp_nonpositive_lanes(_mm256_or_ps(g, _mm256_set1_ps(-0.0f)));
    const __m256 numerator = _mm256_blendv_ps(g, _mm256_mul_ps(g, e), g); /* by g's sign */
    return _mm256_mul_ps(_mm256_div_ps(numerator, _mm256_add_ps(_mm256_set1_ps(1.0f), e)), u);
}

/* o = silu(g) · u over n floats, eight at a time, where `expf` was a call per value;
 * the last ones through the same lanes, padded: each value's bits are a function of
 * its g and u alone. */
AVX2 static void silu_mul_avx2(const float *g, const float *u, float *o, int64_t n) {
    int64_t i = 0;
    for (; i + 8 <= n; i += 8)
        _mm256_storeu_ps(o + i, silu_mul8(_mm256_loadu_ps(g + i), _mm256_loadu_ps(u + i)));
    if (i < n) {
        float gs[8] = {0}, us[8] = {0}, os[8];
        memcpy(gs, g + i, sizeof(float) * (size_t)(n - i));
        memcpy(us, u + i, sizeof(float) * (size_t)(n - i));
        _mm256_storeu_ps(os, silu_mul8(_mm256_loadu_ps(gs), _mm256_loadu_ps(us)));
        memcpy(o + i, os, sizeof(float) * (size_t)(n - i));
    }
}
#endif

/* native_quantized.c: whether its AVX2 loops run; SiLU's follow it. */
int native_avx2(void);

/* out[t] = silu(gate[t]) · up[t], gate and up the two halves of a row of `stride`
 * floats (FWD-MLP-1). */
void silu_mul(const float *gate_up, int64_t stride, int64_t intermediate, float *out,
              int64_t tokens) {
#if defined(__x86_64__)
    if (native_avx2()) {
        for (int64_t t = 0; t < tokens; t++)
            silu_mul_avx2(gate_up + t * stride, gate_up + t * stride + intermediate,
                          out + t * intermediate, intermediate);
        return;
    }
#endif
    for (int64_t t = 0; t < tokens; t++) {
        const float *g = gate_up + t * stride, *u = g + intermediate;
        float *o = out + t * intermediate;
        for (int64_t i = 0; i < intermediate; i++) o[i] = g[i] / (1.0f + expf(-g[i])) * u[i];
    }
}

/* native_quantized.c's thread pool: fn over rows [0, rows), split among the threads
 * when there are a prompt's. */
typedef void (*task_fn)(const void *args, int64_t begin, int64_t end, int part);
void parallel_rows(task_fn fn, const void *args, int64_t rows, int threads);

typedef struct {
    const float *gate_up;
    int64_t stride, intermediate;
    float *out;
} silu_args;

/* silu_mul of tokens [begin, end): a prompt's rows split among the product's threads,
 * each row's arithmetic its own (the same bits on any thread). On one thread it was
 * about a sixth of a 500-token prefill, the other core idle. */
static void silu_rows(const void *a, int64_t begin, int64_t end, int part) {
    const silu_args *p = a;
    (void)part;
    silu_mul(p->gate_up + begin * p->stride, p->stride, p->intermediate,
             p->out + begin * p->intermediate, end - begin);
}

static void rope(float *x, const float *cos, const float *sin, int64_t half) {
    for (int64_t i = 0; i < half; i++) {
        float x1 = x[i], x2 = x[i + half];
        x[i] = x1 * cos[i] - x2 * sin[i];
        x[i + half] = x2 * cos[i] + x1 * sin[i];
    }
}

/* native_attention.c: the stage contract's append and attention. */
void append_kv(const char *key, int64_t key_stride, const char *value, int64_t value_stride,
               char *k_cache, char *v_cache, int64_t row_bytes, const int64_t *slot_mapping,
               int64_t tokens);
int paged_attention(const float *q, int64_t q_stride, int64_t heads, int64_t kv_heads,
                    int64_t head_dim, float scale, const float *k_cache, const float *v_cache,
                    int64_t block_size, const int64_t *block_table, int64_t max_blocks,
                    const int64_t *seq_lens, const int64_t *query_start, int64_t batch,
                    float *out, float *lse, int64_t threads);

/* One layer's attention for the decode step's packed tokens (FWD-ATTN-1):
 * q, k, v from the float32 rows of `qkv` (+ `bias` unless NULL), RoPE
 * on q and k by `cos`/`sin` `[tokens, head_dim / 2]`; then `append_kv` writes
 * every token's k and v to the float32 paged cache at `slot_mapping` (rows
 * attend to later rows' keys of their own sequence only causally, but all are
 * written first), and `paged_attention` attends. `scratch` holds
 * `tokens · (heads + 2 kv_heads) · head_dim` floats.
 * out: `[tokens, heads · head_dim]` float32. Returns 0, or -1 when out of memory. */
static int attention(const float *qkv, int64_t qkv_stride, const float *bias, int64_t heads,
                      int64_t kv_heads, int64_t head_dim, const float *cos, const float *sin,
                      float *k_cache, float *v_cache, int64_t block_size,
                      const int64_t *slot_mapping, const int64_t *block_table,
                      int64_t max_blocks, const int64_t *seq_lens, const int64_t *query_start,
                      int64_t batch, float *scratch, float *out, int64_t threads) {
    const int64_t width = (heads + 2 * kv_heads) * head_dim, half = head_dim / 2;
    const int64_t tokens = query_start[batch];
    float *rows = scratch; /* [tokens, width]: q, k, v of each token, side by side */
    for (int64_t t = 0; t < tokens; t++) {
        const float *src = qkv + t * qkv_stride;
        float *row = rows + t * width;
        for (int64_t i = 0; i < width; i++) row[i] = src[i] + (bias ? bias[i] : 0.0f);
        for (int64_t h = 0; h < heads + kv_heads; h++)
            rope(row + h * head_dim, cos + t * half, sin + t * half, half);
    }
    const int64_t k_at = heads * head_dim, v_at = k_at + kv_heads * head_dim;
    const int64_t stride = width * (int64_t)sizeof(float);
    append_kv((const char *)(rows + k_at), stride, (const char *)(rows + v_at), stride,
              (char *)k_cache, (char *)v_cache, kv_heads * head_dim * (int64_t)sizeof(float),
              slot_mapping, tokens);
    return paged_attention(rows, width, heads, kv_heads, head_dim,
                           1.0f / sqrtf((float)head_dim), k_cache, v_cache, block_size,
                           block_table, max_blocks, seq_lens, query_start, batch, out, NULL,
                           threads);
}

/* native_quantized.c: QUANT-A8-1's product, y [m, n] = x [m, k] · W (float32 here). */
int quantized_product(const uint8_t *codes, const void *scales, const void *offsets,
                      int64_t bits, int64_t n, int64_t k, int64_t group, int64_t half,
                      const void *x, int64_t x_bf16, int64_t m, void *y, int64_t y_bf16,
                      int64_t threads);

/* A layer's row of `decoder_layers`' table: its four projections as quantized weights
 * (WEIGHT_FIELDS each: codes, scales, offsets addresses; bits, rows, columns, group
 * size, half; a float32 weight: its address, 0, 0, 32, rows, columns, columns, 0), then the addresses of its two norms' weights and of its q, k and v biases
 * side by side (0: none). native_step.py writes it. */
enum { W_CODES, W_SCALES, W_OFFSETS, W_BITS, W_ROWS, W_COLUMNS, W_GROUP, W_HALF, WEIGHT_FIELDS };
enum { L_QKV = 0, L_O = WEIGHT_FIELDS, L_GATE_UP = 2 * WEIGHT_FIELDS, L_DOWN = 3 * WEIGHT_FIELDS,
       L_ATTN_NORM = 4 * WEIGHT_FIELDS, L_MLP_NORM, L_BIAS, LAYER_FIELDS };

/* native_dense.c: a float32 weight's product (W_BITS 32, W_CODES its [rows, columns]). */
void dense_product(const float *w, int64_t n, int64_t k, const float *x, int64_t m, float *y,
                   int64_t threads);

static int product(const int64_t *w, const float *x, int64_t tokens, float *y, int64_t threads) {
    if (w[W_BITS] == 32) {
        dense_product((const float *)w[W_CODES], w[W_ROWS], w[W_COLUMNS], x, tokens, y, threads);
        return 0;
    }
    return quantized_product((const uint8_t *)w[W_CODES], (const void *)w[W_SCALES],
                             (const void *)w[W_OFFSETS], w[W_BITS], w[W_ROWS], w[W_COLUMNS],
                             w[W_GROUP], w[W_HALF], x, 0, tokens, y, 0, threads);
}

/* Every decoder layer of the decode step for the packed tokens (FWD-LAYER-1), on the
 * float32 residual stream x [tokens, hidden]:
 *
 *     h = norm(x); a = attention(h W_qkvᵀ); x += a W_oᵀ;
 *     h = norm(x); x += (silu(h W_gateᵀ) · h W_upᵀ) W_downᵀ
 *
 * layer l's weights in row l of `table` (LAYER_FIELDS int64 each), its KV caches at
 * `caches[2 l]`, `caches[2 l + 1]`; `dims` = hidden, intermediate, heads, kv_heads,
 * head_dim. The other arguments are `attention`'s. On return x holds the residual
 * stream after the last layer (before the final norm). Returns 0, or -1 when out of
 * memory (x is then partly updated: the caller fails the pass). */
int decoder_layers(const int64_t *table, const int64_t *caches, int64_t layers,
                   const int64_t *dims, float eps, float *x, int64_t tokens, const float *cos,
                   const float *sin, int64_t block_size, const int64_t *slot_mapping,
                   const int64_t *block_table, int64_t max_blocks, const int64_t *seq_lens,
                   const int64_t *query_start, int64_t batch, int64_t threads) {
    const int64_t hidden = dims[0], intermediate = dims[1], heads = dims[2],
                  kv_heads = dims[3], head_dim = dims[4];
    const int64_t width = (heads + 2 * kv_heads) * head_dim;
    const int64_t floats =
        tokens * (2 * hidden + width + heads * head_dim + 3 * intermediate) + tokens * width;
    float *h = malloc(sizeof(float) * (size_t)floats);
    if (!h) return -1;
    float *qkv = h + tokens * hidden, *attended = qkv + tokens * width;
    float *out = attended + tokens * heads * head_dim; /* o, then down: [tokens, hidden] */
    float *gate_up = out + tokens * hidden, *mlp = gate_up + tokens * 2 * intermediate;
    float *scratch = mlp + tokens * intermediate;
    const float *residual = NULL; /* the previous layer's down projection */
    int failed = 0;
    for (int64_t l = 0; l < layers && !failed; l++) {
        const int64_t *w = table + l * LAYER_FIELDS;
        add_rms_norm(x, residual, hidden, (const float *)w[L_ATTN_NORM], eps, h, tokens, hidden);
        failed |= product(w + L_QKV, h, tokens, qkv, threads);
        failed |= attention(qkv, width, (const float *)w[L_BIAS], heads, kv_heads, head_dim,
                            cos, sin, (float *)caches[2 * l], (float *)caches[2 * l + 1],
                            block_size, slot_mapping, block_table, max_blocks, seq_lens,
                            query_start, batch, scratch, attended, threads);
        failed |= product(w + L_O, attended, tokens, out, threads);
        add_rms_norm(x, out, hidden, (const float *)w[L_MLP_NORM], eps, h, tokens, hidden);
        failed |= product(w + L_GATE_UP, h, tokens, gate_up, threads);
        const silu_args silu = {gate_up, 2 * intermediate, intermediate, mlp};
        parallel_rows(silu_rows, &silu, tokens, (int)threads);
        failed |= product(w + L_DOWN, mlp, tokens, out, threads);
        residual = out;
    }
    if (!failed) add_rms_norm(x, residual, hidden, NULL, eps, NULL, tokens, hidden);
    free(h);
    return failed ? -1 : 0;
}
