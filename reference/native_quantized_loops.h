/* The x86 loops of the quantized product (native_quantized.c), written once for every
 * integer dot-product instruction that runs them and included once for each, with:
 *
 *   LOOPS(name)             this inclusion's name for function `name` (name_avx2, ...)
 *   LOOPS_TARGET            its functions' target attribute
 *   INT4_ADD(sums, u, x)    sums plus, in each 32-bit lane, the four products of u's
 *                           unsigned bytes (4-bit codes) and x's signed ones
 *   INT4_WIDE(sums)         a 4-bit block's accumulated sums as eight int32 lanes
 *   INT8_DOT(u, x)          eight int32 lanes, each the sum of four products u · x
 *
 * AVX2 gathers a 4-bit block's products in int16 (`maddubs`, widened once by `madd`);
 * VNNI's `vpdpbusd` adds four products straight into each int32 lane. Every integer is
 * exact either way (a 4-bit block's |sum| <= 32 · 15 · 127 and an 8-bit pair's
 * <= 2 · 128 · 127 fit int16: `maddubs` never saturates here), so each inclusion hands
 * the float32 steps the same integers, and gives the bits of every other: QUANT-A8-1's
 * order, on every x86 CPU (tests/engine/test_weight_formats.py runs each one the CPU has).
 */

/* Tile t against activation rows m to m + rows - 1 (1 to 4): a quarter's codes are loaded
 * and unpacked once for the rows, and each row's block sums gathered (`INT4_ADD`); then each
 * lane takes the steps of `int4_dot_scalar` for its weight row. A lane's result never
 * depends on the rows beside it: the same bits in any batch, on any thread. */
LOOPS_TARGET __attribute__((always_inline)) static inline void LOOPS(int4_tile)(const product_args *p,
                                                                      int64_t t, int64_t m,
                                                                      const int rows,
                                                                      const int half) {
    const int64_t blocks = p->k / BLOCK, block_bytes = tile_block_bytes(half);
    const uint8_t *tile = p->codes + t * blocks * block_bytes;
    const __m256i nibble = _mm256_set1_epi8(15);
    activations a[4];
    __m256 total[4];
    for (int i = 0; i < rows; i++) a[i] = activation_row(p, m + i), total[i] = _mm256_setzero_ps();
    for (int64_t b = 0; b < blocks; b++) {
        const uint8_t *block = tile + b * block_bytes;
        __m256i sums[4];
        for (int i = 0; i < rows; i++) sums[i] = _mm256_setzero_si256();
        for (int q = 0; q < 4; q++) {
            const __m256i bytes = _mm256_loadu_si256((const __m256i *)(block + 32 * q));
            const __m256i low = _mm256_and_si256(bytes, nibble);
            const __m256i high = _mm256_and_si256(_mm256_srli_epi16(bytes, 4), nibble);
            for (int i = 0; i < rows; i++) {
                int32_t x_low, x_high; /* elements 4q .. 4q + 3 and 16 + 4q .. 19 + 4q */
                memcpy(&x_low, a[i].c + b * BLOCK + 4 * q, 4);
                memcpy(&x_high, a[i].c + b * BLOCK + 16 + 4 * q, 4);
                sums[i] = INT4_ADD(INT4_ADD(sums[i], low, _mm256_set1_epi32(x_low)), high,
                                   _mm256_set1_epi32(x_high));
                /* here, not later: GCC would otherwise compute the block's 32 products first
                 * and add them as a tree, with more registers than AVX2 has */
                __asm__("" : "+x"(sums[i]));
            }
        }
        const uint8_t *scales = block + TILE_CODES;
        const __m256 ws = half ? _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)scales))
                               : _mm256_loadu_ps((const float *)scales);
        const __m256 wo = half ? _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)scales + 1))
                               : _mm256_loadu_ps((const float *)scales + TILE_ROWS);
        for (int i = 0; i < rows; i++) {
            const __m256 s = _mm256_cvtepi32_ps(INT4_WIDE(sums[i]));
            total[i] = _mm256_fmadd_ps(s, _mm256_mul_ps(ws, _mm256_set1_ps(a[i].d[b])), total[i]);
            total[i] = _mm256_fmadd_ps(wo, _mm256_set1_ps(a[i].d_sum[b]), total[i]);
        }
    }
    const int64_t first = t * TILE_ROWS;
    for (int i = 0; i < rows; i++) {
        if (!p->y_bf16 && first + TILE_ROWS <= p->n_rows) {
            _mm256_storeu_ps((float *)p->y + (m + i) * p->n_rows + first, total[i]);
            continue;
        }
        float lanes[TILE_ROWS];
        _mm256_storeu_ps(lanes, total[i]);
        for (int r = 0; r < TILE_ROWS && first + r < p->n_rows; r++)
            store(p, m + i, first + r, p->n_rows, lanes[r]);
    }
}

/* Tiles [begin, end) against every activation row, four at a time. */
LOOPS_TARGET __attribute__((always_inline)) static inline void LOOPS(int4_tiles_of)(const product_args *p,
                                                                     int64_t begin, int64_t end,
                                                                     const int half) {
    for (int64_t t = begin; t < end; t++) {
        int64_t m = 0;
        for (; m + 4 <= p->m; m += 4) LOOPS(int4_tile)(p, t, m, 4, half);
        if (p->m - m == 3) LOOPS(int4_tile)(p, t, m, 3, half);
        if (p->m - m == 2) LOOPS(int4_tile)(p, t, m, 2, half);
        if (p->m - m == 1) LOOPS(int4_tile)(p, t, m, 1, half);
    }
}

LOOPS_TARGET static void LOOPS(int4_tiles)(const void *a, int64_t begin, int64_t end, int part) {
    const product_args *p = a;
    (void)part;
    if (p->half)
        LOOPS(int4_tiles_of)(p, begin, end, 1);
    else
        LOOPS(int4_tiles_of)(p, begin, end, 0);
}

/* An 8-bit block against its 32 activation codes x: 8 int32 lanes of its sums (the
 * instructions take one unsigned operand: |w| times x with w's sign). */
LOOPS_TARGET __attribute__((always_inline)) static inline __m256i LOOPS(int8_block_sums)(
    int8_block w, const int8_t *x) {
    return INT8_DOT(w.magnitude,
                    _mm256_sign_epi8(_mm256_loadu_si256((const __m256i *)x), w.codes));
}

/* 8-bit weight row `row` (its block scales ws and offsets wo) times
 * activation row m. Each block's 32 products are summed exactly in integers, eight blocks
 * to a vector, converted and scaled in float32 lanes (`add_chunk`); the blocks past the
 * last whole chunk one at a time. Each pair of rows is computed alone, in one order
 * whatever the batch and the thread. */
LOOPS_TARGET __attribute__((always_inline)) static inline float LOOPS(int8_row)(const product_args *p,
                                                                      const uint8_t *row,
                                                                      const float *ws,
                                                                      const float *wo,
                                                                      int64_t m) {
    const int64_t blocks = p->k / BLOCK;
    const activations a = activation_row(p, m);
    row_sums r = {_mm256_setzero_ps(), _mm256_setzero_ps()};
    int64_t b = 0;
    for (; b + CHUNK <= blocks; b += CHUNK) {
        __m128i quads[2];
        for (int quad = 0; quad < 2; quad++) {
            __m256i s[4];
            for (int j = 0; j < 4; j++) {
                const int64_t block = b + 4 * quad + j;
                s[j] = LOOPS(int8_block_sums)(int8_weights(row, block), a.c + block * BLOCK);
            }
            quads[quad] = fold(int8_quad(s));
        }
        add_chunk(&r, _mm256_set_m128i(quads[1], quads[0]), ws, wo, a, b);
    }
    for (; b < blocks; b++)
        add_block(&r, LOOPS(int8_block_sums)(int8_weights(row, b), a.c + b * BLOCK), ws, wo, a, b);
    return finish(r);
}

/* `int8_row` against activation rows m to m + 3 at once: each block's codes and
 * magnitudes are loaded once for the four; every result has the bits int8_row gives
 * that row alone. */
LOOPS_TARGET static inline void LOOPS(int8_row_x4)(const product_args *p, const uint8_t *row, const float *ws,
                                    const float *wo, int64_t m, float out[4]) {
    const int64_t blocks = p->k / BLOCK;
    activations a[4];
    row_sums r[4];
    for (int i = 0; i < 4; i++) {
        a[i] = activation_row(p, m + i);
        r[i] = (row_sums){_mm256_setzero_ps(), _mm256_setzero_ps()};
    }
    int64_t b = 0;
    for (; b + CHUNK <= blocks; b += CHUNK) {
        __m128i quads[4][2]; /* [row][quad] */
        for (int quad = 0; quad < 2; quad++) {
            __m256i s[4][4]; /* [row][block] */
            for (int j = 0; j < 4; j++) {
                const int64_t block = b + 4 * quad + j;
                const int8_block w = int8_weights(row, block);
                for (int i = 0; i < 4; i++) s[i][j] = LOOPS(int8_block_sums)(w, a[i].c + block * BLOCK);
            }
            for (int i = 0; i < 4; i++) quads[i][quad] = fold(int8_quad(s[i]));
        }
        for (int i = 0; i < 4; i++)
            add_chunk(&r[i], _mm256_set_m128i(quads[i][1], quads[i][0]), ws, wo, a[i], b);
    }
    for (; b < blocks; b++) {
        const int8_block w = int8_weights(row, b);
        for (int i = 0; i < 4; i++)
            add_block(&r[i], LOOPS(int8_block_sums)(w, a[i].c + b * BLOCK), ws, wo, a[i], b);
    }
    finish_x4(r, out);
}

/* 8-bit rows [begin, end) of the weight against every activation row, each row's
 * scales and offsets one to a block in float32 (`int8_block_fields`), laid out once
 * for all activation rows. */
LOOPS_TARGET static void LOOPS(int8_rows)(const void *a, int64_t begin, int64_t end, int part) {
    const product_args *p = a;
    (void)part;
    const int64_t blocks = p->k / BLOCK;
    float block_scales[blocks], block_offsets[blocks];
    for (int64_t n = begin; n < end; n++) {
        const block_fields f = int8_block_fields(p, n, 1, block_scales, block_offsets);
        const float *ws = f.scales, *wo = f.offsets;
        const uint8_t *row = p->codes + n * p->k;
        int64_t m = 0;
        for (float four[4]; m + 4 <= p->m; m += 4) {
            LOOPS(int8_row_x4)(p, row, ws, wo, m, four);
            for (int r = 0; r < 4; r++) store(p, m + r, n, p->n_rows, four[r]);
        }
        for (; m < p->m; m++) store(p, m, n, p->n_rows, LOOPS(int8_row)(p, row, ws, wo, m));
    }
}

#undef LOOPS
#undef LOOPS_TARGET
#undef INT4_ADD
#undef INT4_WIDE
#undef INT8_DOT
