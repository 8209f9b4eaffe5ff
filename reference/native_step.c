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
 * Attention is three entry points: `append_kv` and `paged_attention`, the
 * stage contract's operations (native_attention.py wraps them for the
 * conformance suite), and `attention`, `decoder_layers'` fused step, which
 * computes the new rows and then calls those two, so the suite checks the
 * very code the engine runs.
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

/* out[t] = silu(gate[t]) · up[t], gate and up the two halves of a row of `stride`
 * floats (FWD-MLP-1). */
void silu_mul(const float *gate_up, int64_t stride, int64_t intermediate, float *out,
              int64_t tokens) {
    for (int64_t t = 0; t < tokens; t++) {
        const float *g = gate_up + t * stride, *u = g + intermediate;
        float *o = out + t * intermediate;
        for (int64_t i = 0; i < intermediate; i++) o[i] = g[i] / (1.0f + expf(-g[i])) * u[i];
    }
}

static void rope(float *x, const float *cos, const float *sin, int64_t half) {
    for (int64_t i = 0; i < half; i++) {
        float x1 = x[i], x2 = x[i + half];
        x[i] = x1 * cos[i] - x2 * sin[i];
        x[i + half] = x2 * cos[i] + x1 * sin[i];
    }
}

/* APPEND-SLOT-1, APPEND-SKIP-1: row t of `key` and `value` (`row_bytes` each,
 * `key_stride` / `value_stride` bytes apart) to row slot_mapping[t] of each cache
 * (rows of `row_bytes`); slot -1 writes nothing. Bytes are copied as they are: the
 * caller has rounded the rows to the cache's dtype (the engine's are float32 on
 * both sides), so any dtype is stored bit for bit. */
void append_kv(const char *key, int64_t key_stride, const char *value, int64_t value_stride,
               char *k_cache, char *v_cache, int64_t row_bytes, const int64_t *slot_mapping,
               int64_t tokens) {
    for (int64_t t = 0; t < tokens; t++) {
        const int64_t slot = slot_mapping[t];
        if (slot < 0) continue; /* APPEND-SKIP-1 */
        memcpy(k_cache + slot * row_bytes, key + t * key_stride, (size_t)row_bytes);
        memcpy(v_cache + slot * row_bytes, value + t * value_stride, (size_t)row_bytes);
    }
}

/* native_quantized.c's thread pool: fn over units [0, units) in parts numbered from 0. */
typedef void (*task_fn)(const void *args, int64_t begin, int64_t end, int part);
void parallel_parts(task_fn fn, const void *args, int64_t units, int64_t align, int threads);

typedef struct {
    const float *q;
    int64_t q_stride, heads, kv_heads, head_dim;
    float scale;
    const float *k_cache, *v_cache;
    int64_t block_size;
    const int64_t *block_table;
    int64_t max_blocks;
    const int64_t *seq_lens, *query_start;
    const int64_t *tile_start; /* [batch + 1]: sequence b's first tile */
    int64_t unit_heads;        /* query heads a unit takes: a KV head's group, or 1 */
    float *scratch;            /* part p's: scratch + p · part_floats */
    int64_t part_floats, longest;
    float *out, *lse;
} attention_args;

/* Query tokens of one sequence attended together: each key and value block is read
 * once for the tile's tokens and the query heads of one KV head (ATTN-GQA-1), from the
 * core's nearest cache, where one (token, head) at a time read the whole context from
 * memory for each (a 64-token prefill chunk read it 576 times a layer). */
#define TILE_TOKENS 8

/* On x86-64 the loops below are compiled twice, for AVX2 and for any CPU, and the
 * loader picks the one this CPU runs; elsewhere once. */
#if defined(__x86_64__) && defined(__GNUC__)
#define AVX2_CLONES __attribute__((target_clones("avx2", "default")))
#else
#define AVX2_CLONES
#endif

/* Units [begin, end): unit u is tile u / (heads / unit_heads) (TILE_TOKENS query tokens
 * of one sequence, or its last ones) and query heads from (u % (heads / unit_heads)) ·
 * unit_heads, all of one KV head: its whole group, or one head when the tiles are too
 * few to keep the threads busy otherwise (a decode step of one sequence). Each
 * (token, head) of the tile is computed in the same steps, in the same order, as it
 * would be alone: its scores position by position, their maximum, exp and sum, the
 * weights (score / sum), then the weighted values position by position; the tile only
 * interleaves the (token, head) pairs, block by block. Inlined for each common
 * head_dim, whose loops the compiler then unrolls and keeps in registers. */
__attribute__((always_inline)) static inline void attend_units(const attention_args *p,
                                                               int64_t begin, int64_t end,
                                                               int part, const int64_t head_dim) {
    const int64_t heads = p->heads, kv_heads = p->kv_heads, unit_heads = p->unit_heads;
    const int64_t group = heads / kv_heads, block_size = p->block_size;
    const int64_t row = kv_heads * head_dim; /* a position's row in a cache block */
    /* part's scratch, for the tile's (token, head) pairs: [pairs, head_dim] accumulators,
     * maxima and sums, then [pairs, longest] scores */
    float *acc = p->scratch + part * p->part_floats, *max = acc + TILE_TOKENS * group * head_dim;
    float *total = max + TILE_TOKENS * group, *scores = total + TILE_TOKENS * group;
    int64_t b = 0;
    for (int64_t u = begin; u < end; u++) {
        const int64_t tile = u / (heads / unit_heads);
        const int64_t h0 = u % (heads / unit_heads) * unit_heads;
        const int64_t g = h0 / group; /* ATTN-GQA-1 */
        while (p->tile_start[b + 1] <= tile) b++; /* the sequence of the tile */
        const int64_t q_len = p->query_start[b + 1] - p->query_start[b];
        const int64_t first = (tile - p->tile_start[b]) * TILE_TOKENS;
        const int64_t tokens = q_len - first < TILE_TOKENS ? q_len - first : TILE_TOKENS;
        const int64_t pairs = tokens * unit_heads; /* i: token first + i / unit_heads */
        const int64_t *blocks = p->block_table + b * p->max_blocks;
        /* the pairs' context lengths: ATTN-CAUSAL-1 (the tile's last token sees most) */
        const int64_t seen = p->seq_lens[b] - q_len + first + 1;
        const int64_t widest = seen + tokens - 1;
        for (int64_t i = 0; i < pairs; i++) max[i] = -INFINITY, total[i] = 0.0f;
        for (int64_t start = 0, i_block = 0; start < widest; start += block_size, i_block++) {
            const float *k_block =
                p->k_cache + (blocks[i_block] * block_size * kv_heads + g) * head_dim;
            for (int64_t i = 0; i < pairs; i++) {
                const int64_t context = seen + i / unit_heads;
                const int64_t t = p->query_start[b] + first + i / unit_heads;
                const int64_t n = context - start < block_size ? context - start : block_size;
                const float *qh = p->q + t * p->q_stride + (h0 + i % unit_heads) * head_dim;
                const float *k = k_block;
                float *s_i = scores + i * p->longest;
                for (int64_t j = 0; j < n; j++, k += row) {
                    float s = 0.0f;
                    for (int64_t d = 0; d < head_dim; d++) s += qh[d] * k[d];
                    s *= p->scale;
                    s_i[start + j] = s;
                    if (s > max[i]) max[i] = s;
                }
            }
        }
        for (int64_t i = 0; i < pairs; i++) {
            const int64_t context = seen + i / unit_heads;
            float *s_i = scores + i * p->longest;
            for (int64_t j = 0; j < context; j++) {
                s_i[j] = expf(s_i[j] - max[i]);
                total[i] += s_i[j];
            }
            for (int64_t j = 0; j < context; j++) s_i[j] = s_i[j] / total[i];
            for (int64_t d = 0; d < head_dim; d++) acc[i * head_dim + d] = 0.0f;
        }
        for (int64_t start = 0, i_block = 0; start < widest; start += block_size, i_block++) {
            const float *v_block =
                p->v_cache + (blocks[i_block] * block_size * kv_heads + g) * head_dim;
            for (int64_t i = 0; i < pairs; i++) {
                const int64_t context = seen + i / unit_heads;
                const int64_t n = context - start < block_size ? context - start : block_size;
                const float *weight = scores + i * p->longest + start, *v = v_block;
                float sums[head_dim]; /* in registers for a constant head_dim */
                memcpy(sums, acc + i * head_dim, sizeof(float) * head_dim);
                for (int64_t j = 0; j < n; j++, v += row)
                    for (int64_t d = 0; d < head_dim; d++) sums[d] += weight[j] * v[d];
                memcpy(acc + i * head_dim, sums, sizeof(float) * head_dim);
            }
        }
        for (int64_t i = 0; i < pairs; i++) {
            const int64_t t = p->query_start[b] + first + i / unit_heads, h = h0 + i % unit_heads;
            if (p->lse) p->lse[t * heads + h] = max[i] + logf(total[i]);
            memcpy(p->out + (t * heads + h) * head_dim, acc + i * head_dim,
                   sizeof(float) * head_dim);
        }
    }
}

AVX2_CLONES static void attend(const void *a, int64_t begin, int64_t end, int part) {
    const attention_args *p = a;
    if (p->head_dim == 64)
        attend_units(p, begin, end, part, 64);
    else if (p->head_dim == 128)
        attend_units(p, begin, end, part, 128);
    else
        attend_units(p, begin, end, part, p->head_dim);
}

/* ATTN-LAYOUT-1 ... ATTN-EMPTY-1 on float32: each query row of `q` (rows of
 * `heads · head_dim` floats, `q_stride` floats apart) attends causally over its
 * sequence's positions in the paged float32 caches (query_start, seq_lens,
 * block_table `[batch, max_blocks]`). Each (row, head) is computed alone, its sums
 * in one fixed order whatever the batch, the tile and however the tiles are split
 * among `threads` (ATTN-INVARIANT-1). out: `[tokens, heads · head_dim]` float32; `lse`
 * `[tokens, heads]` float32 (ATTN-LSE-1) unless NULL. Returns 0, or -1 when out of
 * memory. */
int paged_attention(const float *q, int64_t q_stride, int64_t heads, int64_t kv_heads,
                    int64_t head_dim, float scale, const float *k_cache, const float *v_cache,
                    int64_t block_size, const int64_t *block_table, int64_t max_blocks,
                    const int64_t *seq_lens, const int64_t *query_start, int64_t batch,
                    float *out, float *lse, int64_t threads) {
    int64_t longest = 0;
    for (int64_t b = 0; b < batch; b++) longest = seq_lens[b] > longest ? seq_lens[b] : longest;
    const int64_t pairs = TILE_TOKENS * (heads / kv_heads);
    const int64_t part_floats = pairs * (head_dim + 2 + longest);
    const int64_t parts = threads > 1 ? threads : 1;
    int64_t *tile_start = malloc(sizeof(int64_t) * (size_t)(batch + 1));
    float *scratch = malloc(sizeof(float) * (size_t)(parts * part_floats));
    if (!tile_start || !scratch) {
        free(tile_start);
        free(scratch);
        return -1;
    }
    tile_start[0] = 0;
    for (int64_t b = 0; b < batch; b++) {
        const int64_t q_len = query_start[b + 1] - query_start[b];
        tile_start[b + 1] = tile_start[b] + (q_len + TILE_TOKENS - 1) / TILE_TOKENS;
    }
    /* a KV head's group a unit, unless that leaves fewer than four units a thread */
    const int64_t unit_heads = tile_start[batch] * kv_heads >= 4 * parts ? heads / kv_heads : 1;
    const attention_args args = {q, q_stride, heads, kv_heads, head_dim, scale, k_cache, v_cache,
                                 block_size, block_table, max_blocks, seq_lens, query_start,
                                 tile_start, unit_heads, scratch, part_floats, longest, out, lse};
    parallel_parts(attend, &args, tile_start[batch] * (heads / unit_heads), 1, (int)parts);
    free(tile_start);
    free(scratch);
    return 0;
}

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
int quantized_product(const uint8_t *codes, const float *scales, const float *offsets,
                      int64_t bits, int64_t n, int64_t k, int64_t group, const void *x,
                      int64_t x_bf16, int64_t m, void *y, int64_t y_bf16, int64_t threads);

/* A layer's row of `decoder_layers`' table: its four projections as quantized weights
 * (WEIGHT_FIELDS each: codes, scales, offsets addresses; bits, rows, columns, group
 * size), then the addresses of its two norms' weights and of its q, k and v biases
 * side by side (0: none). native_step.py writes it. */
enum { W_CODES, W_SCALES, W_OFFSETS, W_BITS, W_ROWS, W_COLUMNS, W_GROUP, WEIGHT_FIELDS };
enum { L_QKV = 0, L_O = WEIGHT_FIELDS, L_GATE_UP = 2 * WEIGHT_FIELDS, L_DOWN = 3 * WEIGHT_FIELDS,
       L_ATTN_NORM = 4 * WEIGHT_FIELDS, L_MLP_NORM, L_BIAS, LAYER_FIELDS };

static int product(const int64_t *w, const float *x, int64_t tokens, float *y, int64_t threads) {
    return quantized_product((const uint8_t *)w[W_CODES], (const float *)w[W_SCALES],
                             (const float *)w[W_OFFSETS], w[W_BITS], w[W_ROWS], w[W_COLUMNS],
                             w[W_GROUP], x, 0, tokens, y, 0, threads);
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
        silu_mul(gate_up, 2 * intermediate, intermediate, mlp, tokens);
        failed |= product(w + L_DOWN, mlp, tokens, out, threads);
        residual = out;
    }
    if (!failed) add_rms_norm(x, residual, hidden, NULL, eps, NULL, tokens, hidden);
    free(h);
    return failed ? -1 : 0;
}
