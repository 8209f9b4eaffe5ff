/* The stage contract's attention operations on float32, in C: `append_kv` (APPEND-*)
 * and `paged_attention` (ATTN-*). native_attention.py exposes them with the spec's
 * signatures for the conformance suite; native_step.c's `attention` calls them in
 * every decoder layer of the native step: the suite checks the code the engine runs.
 *
 * Callers validate every shape and index first; these loops trust them.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

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
    int64_t part_floats, score_row; /* floats: a part's scratch, a pair's scores */
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

/* e^x for x <= 0 (a score less its row's maximum) in float32 arithmetic the compiler
 * vectorizes, where `expf` is a call per value: x = n ln 2 + r with n an integer and
 * |r| <= ln 2 / 2, e^r by its Taylor polynomial of degree 6 (error below 2e-7 of it),
 * 2^n put in the exponent's bits. Below -87 (e^x under FLT_MIN) it is 0; NaN stays NaN.
 * One function of x: a score's weight has the same bits in any tile. */
__attribute__((always_inline)) static inline float exp_nonpositive(float x) {
    const float clamped = x < -87.0f ? -87.0f : x;
    const int32_t n = (int32_t)(clamped * 1.44269504f - 0.5f); /* round(x / ln 2), x <= 0 */
    const float r = clamped - (float)n * 0.693147181f;
    float p = 1.0f / 720.0f;
    p = p * r + 1.0f / 120.0f;
    p = p * r + 1.0f / 24.0f;
    p = p * r + 1.0f / 6.0f;
    p = p * r + 0.5f;
    p = p * r + 1.0f;
    p = p * r + 1.0f;
    const uint32_t bits = (uint32_t)(n + 127) << 23;
    float two_n;
    memcpy(&two_n, &bits, sizeof two_n);
    const float e = x < -87.0f ? 0.0f : p * two_n;
    return x != x ? x : e;
}

/* Unit u of the pass: tile u / (heads / unit_heads) (TILE_TOKENS query tokens of one
 * sequence, or its last ones) and query heads from (u % (heads / unit_heads)) · unit_heads,
 * all of one KV head: its whole group, or one head when the tiles are too few to keep the
 * threads busy otherwise (a decode step of one sequence). Pair i of the unit is token
 * first + i / unit_heads of sequence b and head h0 + i % unit_heads; it sees `seen` +
 * i / unit_heads positions (ATTN-CAUSAL-1: the tile's last token sees most). */
typedef struct {
    int64_t b, h0, g, first, pairs, seen, widest;
    const int64_t *blocks;
} attention_unit;

/* `*b` is the sequence of the unit before u (units go in order): it only moves on. */
static inline attention_unit locate(const attention_args *p, int64_t u, int64_t *b) {
    const int64_t per_tile = p->heads / p->unit_heads, tile = u / per_tile;
    while (p->tile_start[*b + 1] <= tile) ++*b;
    const int64_t q_len = p->query_start[*b + 1] - p->query_start[*b];
    const int64_t first = (tile - p->tile_start[*b]) * TILE_TOKENS;
    const int64_t tokens = q_len - first < TILE_TOKENS ? q_len - first : TILE_TOKENS;
    const int64_t h0 = u % per_tile * p->unit_heads, seen = p->seq_lens[*b] - q_len + first + 1;
    return (attention_unit){*b, h0, h0 / (p->heads / p->kv_heads), first, tokens * p->unit_heads,
                            seen, seen + tokens - 1, p->block_table + *b * p->max_blocks};
}

static inline int64_t pair_token(const attention_args *p, const attention_unit *w, int64_t i) {
    return p->query_start[w->b] + w->first + i / p->unit_heads;
}

static inline const float *pair_query(const attention_args *p, const attention_unit *w,
                                      int64_t i, int64_t head_dim) {
    return p->q + pair_token(p, w, i) * p->q_stride + (w->h0 + i % p->unit_heads) * head_dim;
}

/* The pair's context, and its keys (values) of cache block i_block from `start`. */
static inline int64_t in_block(const attention_unit *w, int64_t i, int64_t unit_heads,
                               int64_t start, int64_t block_size) {
    const int64_t context = w->seen + i / unit_heads;
    return context - start < block_size ? context - start : block_size;
}

static inline const float *cache_block(const attention_args *p, const float *cache,
                                       const attention_unit *w, int64_t i_block,
                                       int64_t head_dim) {
    return cache + (w->blocks[i_block] * p->block_size * p->kv_heads + w->g) * head_dim;
}

/* The pair's results: out, and lse = max + log(sum) (ATTN-LSE-1). */
static inline void finish_pair(const attention_args *p, const attention_unit *w, int64_t i,
                               const float *acc, float max, float total, int64_t head_dim) {
    const int64_t t = pair_token(p, w, i), h = w->h0 + i % p->unit_heads;
    if (p->lse) p->lse[t * p->heads + h] = max + logf(total);
    memcpy(p->out + (t * p->heads + h) * head_dim, acc, sizeof(float) * head_dim);
}

/* Units [begin, end), in plain C. Each (token, head) of a tile is computed in the same
 * steps, in the same order, as it would be alone: its scores position by position, their
 * maximum, exp and sum, the weights (score / sum), then the weighted values position by
 * position; the tile only interleaves the pairs, block by block. Inlined for each common
 * head_dim, whose loops the compiler then unrolls and keeps in registers. */
__attribute__((always_inline)) static inline void attend_units(const attention_args *p,
                                                               int64_t begin, int64_t end,
                                                               int part, const int64_t head_dim) {
    const int64_t unit_heads = p->unit_heads, block_size = p->block_size;
    const int64_t row = p->kv_heads * head_dim; /* a position's row in a cache block */
    /* part's scratch, for the tile's pairs: [pairs, head_dim] accumulators, maxima and
     * sums, then [pairs, score_row] scores */
    const int64_t most = TILE_TOKENS * (p->heads / p->kv_heads);
    float *acc = p->scratch + part * p->part_floats, *max = acc + most * head_dim;
    float *total = max + most, *scores = total + most;
    int64_t b = 0;
    for (int64_t u = begin; u < end; u++) {
        const attention_unit w = locate(p, u, &b);
        for (int64_t i = 0; i < w.pairs; i++) max[i] = -INFINITY;
        for (int64_t start = 0, i_block = 0; start < w.widest; start += block_size, i_block++) {
            const float *k_block = cache_block(p, p->k_cache, &w, i_block, head_dim);
            for (int64_t i = 0; i < w.pairs; i++) {
                const int64_t n = in_block(&w, i, unit_heads, start, block_size);
                const float *qh = pair_query(p, &w, i, head_dim), *k = k_block;
                float *s_i = scores + i * p->score_row;
                for (int64_t j = 0; j < n; j++, k += row) {
                    float s = 0.0f;
                    for (int64_t d = 0; d < head_dim; d++) s += qh[d] * k[d];
                    s *= p->scale;
                    s_i[start + j] = s;
                    if (s > max[i]) max[i] = s;
                }
            }
        }
        for (int64_t i = 0; i < w.pairs; i++) {
            const int64_t context = w.seen + i / unit_heads;
            float *s_i = scores + i * p->score_row;
            const float m = max[i];
            float sum = 0.0f; /* in a register: total[i] in memory made each step wait */
            for (int64_t j = 0; j < context; j++) {
                s_i[j] = exp_nonpositive(s_i[j] - m);
                sum += s_i[j];
            }
            total[i] = sum;
            for (int64_t j = 0; j < context; j++) s_i[j] = s_i[j] / sum;
            for (int64_t d = 0; d < head_dim; d++) acc[i * head_dim + d] = 0.0f;
        }
        for (int64_t start = 0, i_block = 0; start < w.widest; start += block_size, i_block++) {
            const float *v_block = cache_block(p, p->v_cache, &w, i_block, head_dim);
            for (int64_t i = 0; i < w.pairs; i++) {
                const int64_t n = in_block(&w, i, unit_heads, start, block_size);
                const float *weight = scores + i * p->score_row + start, *v = v_block;
                float sums[head_dim]; /* in registers for a constant head_dim */
                memcpy(sums, acc + i * head_dim, sizeof(float) * head_dim);
                for (int64_t j = 0; j < n; j++, v += row)
                    for (int64_t d = 0; d < head_dim; d++) sums[d] += weight[j] * v[d];
                memcpy(acc + i * head_dim, sums, sizeof(float) * head_dim);
            }
        }
        for (int64_t i = 0; i < w.pairs; i++)
            finish_pair(p, &w, i, acc + i * head_dim, max[i], total[i], head_dim);
    }
}

#if defined(__x86_64__)
#include <immintrin.h>
#define AVX2 __attribute__((target("avx2,fma")))

/* exp_nonpositive on eight lanes (its steps, the polynomial by FMAs). */
AVX2 __attribute__((always_inline)) static inline __m256 exp_nonpositive8(__m256 x) {
    const __m256 lowest = _mm256_set1_ps(-87.0f);
    const __m256 clamped = _mm256_max_ps(x, lowest); /* NaN: lowest, then x again below */
    const __m256i n = _mm256_cvttps_epi32(
        _mm256_sub_ps(_mm256_mul_ps(clamped, _mm256_set1_ps(1.44269504f)), _mm256_set1_ps(0.5f)));
    const __m256 r =
        _mm256_sub_ps(clamped, _mm256_mul_ps(_mm256_cvtepi32_ps(n), _mm256_set1_ps(0.693147181f)));
    __m256 poly = _mm256_set1_ps(1.0f / 720.0f);
    const float terms[] = {1.0f / 120.0f, 1.0f / 24.0f, 1.0f / 6.0f, 0.5f, 1.0f, 1.0f};
    for (int c = 0; c < 6; c++) poly = _mm256_fmadd_ps(poly, r, _mm256_set1_ps(terms[c]));
    const __m256 two_n =
        _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(n, _mm256_set1_epi32(127)), 23));
    const __m256 e = _mm256_blendv_ps(_mm256_mul_ps(poly, two_n), _mm256_setzero_ps(),
                                      _mm256_cmp_ps(x, lowest, _CMP_LT_OQ));
    return _mm256_blendv_ps(e, x, _mm256_cmp_ps(x, x, _CMP_UNORD_Q));
}

/* exp_nonpositive8 for native_step.c's SiLU: a call, where the loops below inline it. */
AVX2 __m256 exp_nonpositive_lanes(__m256 x) { return exp_nonpositive8(x); }

/* The lane sums of four vectors, each as ((0 + 1) + (2 + 3)) + ((4 + 5) + (6 + 7)). */
AVX2 __attribute__((always_inline)) static inline __m128 sum_lanes4(const __m256 a[4]) {
    const __m256 h = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));
    return _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
}

/* The dot products of query q with eight keys: each key's eight lanes of FMAs over
 * head_dim, then summed as ((0 + 1) + (2 + 3)) + ((4 + 5) + (6 + 7)): a key's score is
 * the same in any of the eight places. Eight keys, not four: their eight chains of FMAs
 * keep both FMA units busy, where four chains waited on each other's latency. */
AVX2 __attribute__((always_inline)) static inline __m256 dot8(const float *q, const float *k[8],
                                                               const int64_t head_dim) {
    __m256 a[8];
    for (int c = 0; c < 8; c++) a[c] = _mm256_setzero_ps();
    for (int64_t d = 0; d < head_dim; d += 8) {
        const __m256 qd = _mm256_loadu_ps(q + d);
        for (int c = 0; c < 8; c++) a[c] = _mm256_fmadd_ps(qd, _mm256_loadu_ps(k[c] + d), a[c]);
    }
    return _mm256_set_m128(sum_lanes4(a + 4), sum_lanes4(a));
}

/* The lanes of the first `count` floats (all eight from 8 on): those inside the context. */
AVX2 __attribute__((always_inline)) static inline __m256i first_lanes(int64_t count) {
    return _mm256_cmpgt_epi32(_mm256_set1_epi32((int)count),
                              _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}

AVX2 __attribute__((always_inline)) static inline float max8(__m256 v) {
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    return _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)));
}

AVX2 __attribute__((always_inline)) static inline float sum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

/* attend_units in AVX2 for head_dim 64 or 128: scores eight keys at a time (`dot8`),
 * the maximum, exp and sum eight positions at a time, then the values weighted by FMAs,
 * position by position. A pair's steps depend on its own context length only: the same
 * bits alone and in any tile, on any thread. */
AVX2 __attribute__((always_inline)) static inline void attend_units_avx2(
    const attention_args *p, int64_t begin, int64_t end, int part, const int64_t head_dim) {
    const int64_t unit_heads = p->unit_heads, block_size = p->block_size;
    const int64_t row = p->kv_heads * head_dim;
    const int64_t most = TILE_TOKENS * (p->heads / p->kv_heads);
    float *acc = p->scratch + part * p->part_floats, *max = acc + most * head_dim;
    float *total = max + most, *scores = total + most;
    const __m256 scale = _mm256_set1_ps(p->scale);
    int64_t b = 0;
    for (int64_t u = begin; u < end; u++) {
        const attention_unit w = locate(p, u, &b);
        for (int64_t start = 0, i_block = 0; start < w.widest; start += block_size, i_block++) {
            const float *k_block = cache_block(p, p->k_cache, &w, i_block, head_dim);
            for (int64_t i = 0; i < w.pairs; i++) {
                const int64_t n = in_block(&w, i, unit_heads, start, block_size);
                const float *qh = pair_query(p, &w, i, head_dim);
                float *s_i = scores + i * p->score_row + start;
                for (int64_t j = 0; j < n; j += 8) {
                    const float *k[8]; /* past n: the last key again, scored into the padding */
                    for (int c = 0; c < 8; c++) k[c] = k_block + (j + c < n ? j + c : n - 1) * row;
                    _mm256_storeu_ps(s_i + j, _mm256_mul_ps(dot8(qh, k, head_dim), scale));
                }
            }
        }
        for (int64_t i = 0; i < w.pairs; i++) {
            const int64_t context = w.seen + i / unit_heads;
            float *s_i = scores + i * p->score_row;
            __m256 m = _mm256_set1_ps(-INFINITY);
            for (int64_t j = 0; j < context; j += 8) {
                const __m256i lanes = first_lanes(context - j);
                const __m256 s = _mm256_loadu_ps(s_i + j); /* lanes past context: padding */
                /* max(s, m) is m where s is NaN, as the scalar comparison */
                m = _mm256_max_ps(_mm256_blendv_ps(_mm256_set1_ps(-INFINITY), s,
                                                   _mm256_castsi256_ps(lanes)), m);
            }
            max[i] = max8(m);
            const __m256 row_max = _mm256_set1_ps(max[i]);
            __m256 sum = _mm256_setzero_ps();
            for (int64_t j = 0; j < context; j += 8) {
                const __m256 s = _mm256_loadu_ps(s_i + j);
                const __m256 e = _mm256_and_ps(exp_nonpositive8(_mm256_sub_ps(s, row_max)),
                                               _mm256_castsi256_ps(first_lanes(context - j)));
                _mm256_storeu_ps(s_i + j, e);
                sum = _mm256_add_ps(sum, e);
            }
            total[i] = sum8(sum);
            const __m256 divisor = _mm256_set1_ps(total[i]);
            for (int64_t j = 0; j < context; j += 8)
                _mm256_storeu_ps(s_i + j, _mm256_div_ps(_mm256_loadu_ps(s_i + j), divisor));
            memset(acc + i * head_dim, 0, sizeof(float) * (size_t)head_dim);
        }
        for (int64_t start = 0, i_block = 0; start < w.widest; start += block_size, i_block++) {
            const float *v_block = cache_block(p, p->v_cache, &w, i_block, head_dim);
            for (int64_t i = 0; i < w.pairs; i++) {
                const int64_t n = in_block(&w, i, unit_heads, start, block_size);
                const float *weight = scores + i * p->score_row + start, *v = v_block;
                __m256 sums[head_dim / 8]; /* in registers */
                for (int64_t d = 0; d < head_dim / 8; d++)
                    sums[d] = _mm256_loadu_ps(acc + i * head_dim + 8 * d);
                for (int64_t j = 0; j < n; j++, v += row) {
                    const __m256 wj = _mm256_set1_ps(weight[j]);
                    for (int64_t d = 0; d < head_dim / 8; d++)
                        sums[d] = _mm256_fmadd_ps(wj, _mm256_loadu_ps(v + 8 * d), sums[d]);
                }
                for (int64_t d = 0; d < head_dim / 8; d++)
                    _mm256_storeu_ps(acc + i * head_dim + 8 * d, sums[d]);
            }
        }
        for (int64_t i = 0; i < w.pairs; i++)
            finish_pair(p, &w, i, acc + i * head_dim, max[i], total[i], head_dim);
    }
}

AVX2 static void attend_avx2(const void *a, int64_t begin, int64_t end, int part) {
    const attention_args *p = a;
    if (p->head_dim == 64)
        attend_units_avx2(p, begin, end, part, 64);
    else
        attend_units_avx2(p, begin, end, part, 128);
}
#endif

/* native_quantized.c: whether its AVX2 loops run (the CPU has them, the tests did not
 * ask for the scalar ones); the attention's follow it. */
int native_avx2(void);

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
    /* a pair's scores: its row holds whole vectors of eight past the longest context,
     * which the AVX2 loops read and write as padding (their values are never used) */
    const int64_t score_row = (longest + 15) / 8 * 8;
    const int64_t part_floats = pairs * (head_dim + 2 + score_row);
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
                                 tile_start, unit_heads, scratch, part_floats, score_row, out, lse};
    task_fn units = attend;
#if defined(__x86_64__)
    if (native_avx2() && (head_dim == 64 || head_dim == 128)) units = attend_avx2;
#endif
    parallel_parts(units, &args, tile_start[batch] * (heads / unit_heads), 1, (int)parts);
    free(tile_start);
    free(scratch);
    return 0;
}
