/* lanes_avx2.c's tiles in one form of the dot-product step (kernels.h, `AVX2_FORM`): included once per form, each
 * inclusion defining iq4l_rows_<form>, q4l_rows_<form>, q5l_rows_<form>, q6l_rows_<form> and q8l_rows_<form>
 * compiled for that form's target. Not a
 * header of its own: lanes_avx2.c sets AVX2_FORM, the helpers and the QUAD, ROW_SCALE and AVX2_PASSES macros first. */

/* `iq4l_tile` on AVX2, output channels 16G .. 16G + 15 for rows r0 .. r0 + R - 1 (R ≤ AVX2_TILE, a constant): per
 * half of 8 channels (32 bytes of each quad vector), looked up in the grid with `pshufb`, and multiplied
 * with the row's quads by the sign trick (|grid value| as u8, the quad with its sign: the grid's -127..113 keep
 * vpmaddubsw's pairs below 2^15), each block's sums times its ls - 32 into the super-block's (kernels.h
 * `sub_scales`: the vpmaddubsw form as it sums the pairs), scaled by d · the row's scale after its last block. */
static inline __attribute__((always_inline)) AVX2_TARGET void AVX2_NAMED(iq4l_tile)(
    const Linear *w, int64_t G, const QuantizedRows *xq, int64_t r0, const int R, float *y, int64_t ldy
) {
    const int64_t k = w->k, blocks = k / 32;
    const uint8_t *qw = (const uint8_t *)w->weight + G * blocks * 256;
    const int8_t *sc = (const int8_t *)w->scales + G * blocks * 16;
    const uint16_t *d = w->supers + G * (k / 256) * 16;
    const __m256i grid = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)IQ4_VALUES));
    const __m256i mask = _mm256_set1_epi8(0x0F);
    __m256 out[AVX2_TILE][2];
    __m256i super[AVX2_TILE][2];
    for (int r = 0; r < R; r++) out[r][0] = out[r][1] = _mm256_setzero_ps(), super[r][0] = super[r][1] = _mm256_setzero_si256();
    for (int64_t b = 0; b < blocks; b++) {
        __m256i pair[2];
        iq4l_pairs_avx2(sc + b * 16, pair);
        for (int h = 0; h < 2; h++) {
            __m256i acc[AVX2_TILE], more[AVX2_TILE]; /* more: a second chain at few rows (AVX2_CHAINS) */
            for (int r = 0; r < R; r++) acc[r] = more[r] = _mm256_setzero_si256();
            for (int m = 0; m < 4; m++) {
                const __m256i v = _mm256_loadu_si256((const __m256i *)(qw + b * 256 + 64 * m + 32 * h));
                const __m256i low = _mm256_shuffle_epi8(grid, _mm256_and_si256(v, mask));
                const __m256i high = _mm256_shuffle_epi8(grid, _mm256_and_si256(_mm256_srli_epi16(v, 4), mask));
                const __m256i low_size = _mm256_sign_epi8(low, low), high_size = _mm256_sign_epi8(high, high);
                for (int r = 0; r < R; r++) {
                    const __m256i x_low = _mm256_sign_epi8(QUAD(r, m), low), x_high = _mm256_sign_epi8(QUAD(r, 4 + m), high);
                    if (!AVX2_ACCUMULATES) {
                        super[r][h] = quad_dot_scaled_maddubs(super[r][h], low_size, x_low, pair[h]);
                        super[r][h] = quad_dot_scaled_maddubs(super[r][h], high_size, x_high, pair[h]);
                        continue;
                    }
                    acc[r] = AVX2_QUAD_DOT(acc[r], low_size, x_low);
                    if (AVX2_CHAINS(R)) more[r] = AVX2_QUAD_DOT(more[r], high_size, x_high);
                    else acc[r] = AVX2_QUAD_DOT(acc[r], high_size, x_high);
                }
            }
            for (int r = 0; AVX2_ACCUMULATES && r < R; r++)
                super[r][h] = _mm256_add_epi32(super[r][h], AVX2_BLOCK_SCALED(_mm256_add_epi32(acc[r], more[r]), pair[h]));
            if (b % 8 < 7) continue;
            const __m256 scale = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(d + b / 8 * 16 + 8 * h)));
            for (int r = 0; r < R; r++) {
                out[r][h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(super[r][h]), _mm256_mul_ps(scale, ROW_SCALE(r)), out[r][h]);
                super[r][h] = _mm256_setzero_si256();
            }
        }
    }
    for (int h = 0; h < 2; h++) {
        const __m256 bias = w->bias ? _mm256_loadu_ps(w->bias + G * 16 + 8 * h) : _mm256_setzero_ps();
        for (int r = 0; r < R; r++) _mm256_storeu_ps(y + (r0 + r) * ldy + G * 16 + 8 * h, _mm256_add_ps(out[r][h], bias));
    }
}

/* `q4l_tile` (lanes.c) on AVX2: per block, each quad vector's two halves, the nibbles' products with each row's
 * quads summed over the block in the form's accumulator (maddubs: int16, at most 15 · 128 · 2 · 8 < 2^15), then
 * the AVX-512 tile's float operations lane by lane. */
static inline __attribute__((always_inline)) AVX2_TARGET void AVX2_NAMED(q4l_tile)(
    const Linear *w, int64_t G, const QuantizedRows *xq, int64_t r0, const int R, float *y, int64_t ldy
) {
    const int64_t k = w->k, blocks = k / 32, per_group = w->group / 32, groups = k / w->group;
    const uint8_t *qw = (const uint8_t *)w->weight + G * blocks * 256;
    const uint16_t *scales = (const uint16_t *)w->scales + G * groups * 16;
    const uint16_t *mins = w->mins ? w->mins + G * groups * 16 : NULL;
    const __m256i mask = _mm256_set1_epi8(0x0F);
    __m256 out[AVX2_TILE][2], super_d[2], super_dmin[2];
    __m256i super[AVX2_TILE][2]; /* Q4_K's: the super-block's scaled sums (kernels.h `sub_scales`) */
    for (int r = 0; r < R; r++) out[r][0] = out[r][1] = _mm256_setzero_ps(), super[r][0] = super[r][1] = _mm256_setzero_si256();
    for (int64_t b = 0; b < blocks; b++) {
        if (w->supers && b % 8 == 0)
            for (int r = 0; r < R; r++) super[r][0] = super[r][1] = _mm256_setzero_si256();
        __m256i acc[AVX2_TILE][2], more[AVX2_TILE][2];
        for (int r = 0; r < R; r++) acc[r][0] = acc[r][1] = more[r][0] = more[r][1] = _mm256_setzero_si256();
        for (int m = 0; m < 4; m++) {
            __m256i low[2], high[2];
            for (int h = 0; h < 2; h++) {
                const __m256i v = _mm256_loadu_si256((const __m256i *)(qw + b * 256 + 64 * m + 32 * h));
                low[h] = _mm256_and_si256(v, mask);
                high[h] = _mm256_and_si256(_mm256_srli_epi16(v, 4), mask);
            }
            for (int r = 0; r < R; r++) {
                const __m256i first = QUAD(r, m), second = QUAD(r, 4 + m);
                for (int h = 0; h < 2; h++) {
                    if (AVX2_CHAINS(R)) {
                        acc[r][h] = AVX2_BLOCK_DOT(acc[r][h], low[h], first);
                        more[r][h] = AVX2_BLOCK_DOT(more[r][h], high[h], second);
                    } else {
                        acc[r][h] = AVX2_BLOCK_DOT(AVX2_BLOCK_DOT(acc[r][h], low[h], first), high[h], second);
                    }
                }
            }
        }
        const int64_t g = b / per_group; /* the group's minimum term once, with its first block */
        __m256 d[2], mn[2];
        if (w->supers) { /* groups of 32: g is b */
            if (g % 8 == 0) q4k_super_avx2(w, G, g, super_d, super_dmin);
            q4k_group_avx2(w, G, g, super_d, super_dmin, d, mn);
            __m256i pair[2];
            q4k_pairs_avx2(w, G, g, pair);
            for (int r = 0; r < R; r++)
                for (int h = 0; h < 2; h++) {
                    const __m256i scaled = AVX2_CHAINS(R) ? AVX2_BLOCK_SCALED(_mm256_add_epi32(acc[r][h], more[r][h]), pair[h])
                                                          : AVX2_BLOCK_SCALED(acc[r][h], pair[h]);
                    super[r][h] = _mm256_add_epi32(super[r][h], scaled);
                    out[r][h] = _mm256_fmadd_ps(mn[h], _mm256_set1_ps(xq->sum8[(r0 + r) * groups + g]), out[r][h]);
                    if (b % 8 == 7)
                        out[r][h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(super[r][h]), _mm256_mul_ps(super_d[h], ROW_SCALE(r)), out[r][h]);
                }
            continue;
        } else {
            lanes_ph(scales + g * 16, d);
            if (mins) lanes_ph(mins + g * 16, mn);
            else for (int h = 0; h < 2; h++) mn[h] = _mm256_mul_ps(d[h], _mm256_set1_ps(-8.0f));
        }
        for (int r = 0; r < R; r++) {
            const __m256 dx = ROW_SCALE(r);
            for (int h = 0; h < 2; h++) {
                __m256i total = AVX2_BLOCK_SUMS(acc[r][h]);
                if (AVX2_CHAINS(R)) total = _mm256_add_epi32(total, AVX2_BLOCK_SUMS(more[r][h]));
                const __m256 sums = _mm256_cvtepi32_ps(total);
                out[r][h] = _mm256_fmadd_ps(sums, _mm256_mul_ps(d[h], dx), out[r][h]);
                if (b % per_group == 0)
                    out[r][h] = _mm256_fmadd_ps(mn[h], _mm256_set1_ps(xq->sum8[(r0 + r) * groups + g]), out[r][h]);
            }
        }
    }
    for (int r = 0; r < R; r++) store_lanes(out[r], w->bias ? w->bias + G * 16 : NULL, y + (r0 + r) * ldy + G * 16);
}

/* `q8l_tile` on AVX2: each quad vector's two halves, signed: the sign trick (|q| as u8, -128 too; pairs
 * at most 2 · 128 · 127 in int16), whose sums are the AVX-512 tile's (q + 128 less 128 · the block's inputs). */
static inline __attribute__((always_inline)) AVX2_TARGET void AVX2_NAMED(q8l_tile)(
    const Linear *w, int64_t G, const QuantizedRows *xq, int64_t r0, const int R, float *y, int64_t ldy
) {
    const int64_t k = w->k, blocks = k / 32, first = G * blocks;
    const uint8_t *qw = (const uint8_t *)w->weight + first * 512;
    const uint16_t *scales = (const uint16_t *)w->scales + first * 16;
    __m256 out[AVX2_TILE][2];
    for (int r = 0; r < R; r++) out[r][0] = out[r][1] = _mm256_setzero_ps();
    for (int64_t b = 0; b < blocks; b++) {
        __m256i acc[AVX2_TILE][2], more[AVX2_TILE][2]; /* more: the odd units at few rows (AVX2_CHAINS) */
        for (int r = 0; r < R; r++) acc[r][0] = acc[r][1] = more[r][0] = more[r][1] = _mm256_setzero_si256();
        /* Unrolled, the 16 loads of a block were issued out of order (offsets 0, 416, 448, 32, ...) and the stream
         * from memory lost the hardware's prefetch: a 1.7B Q8_0 file's decode with `vpmaddubsw` fell from 27 to 17
         * tok/s when the units' interleaving left the loop. In order: 29-31 (VNNI-256 30-31, as before). */
#pragma GCC unroll 1
        for (int m = 0; m < 8; m++) {
            __m256i v[2], size[2];
            for (int h = 0; h < 2; h++) {
                v[h] = _mm256_loadu_si256((const __m256i *)(qw + b * 512 + 64 * m + 32 * h));
                size[h] = _mm256_sign_epi8(v[h], v[h]);
            }
            for (int r = 0; r < R; r++) {
                const __m256i quad = QUAD(r, m);
                for (int h = 0; h < 2; h++) {
                    if (AVX2_CHAINS(R) && m % 2) more[r][h] = AVX2_QUAD_DOT(more[r][h], size[h], _mm256_sign_epi8(quad, v[h]));
                    else acc[r][h] = AVX2_QUAD_DOT(acc[r][h], size[h], _mm256_sign_epi8(quad, v[h]));
                }
            }
        }
        __m256 d[2];
        lanes_ph(scales + b * 16, d);
        for (int r = 0; r < R; r++) {
            const __m256 dx = ROW_SCALE(r);
            for (int h = 0; h < 2; h++) {
                const __m256i sums = AVX2_CHAINS(R) ? _mm256_add_epi32(acc[r][h], more[r][h]) : acc[r][h];
                out[r][h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums), _mm256_mul_ps(d[h], dx), out[r][h]);
            }
        }
    }
    for (int r = 0; r < R; r++) store_lanes(out[r], w->bias ? w->bias + G * 16 : NULL, y + (r0 + r) * ldy + G * 16);
}

/* `q5l_tile` (lanes.c) on AVX2: per block and half of 8 channels, the nibbles as Q4L's, each quad vector's fifth bits
 * moved from the half's planes to bit 4 of its bytes by a shift and a mask, and added (spread from bit masks with
 * `vpshufb` and a bit test, the tile took 5 more instructions a nibble vector: one thread, 1,024 × 2,048 in cache, one
 * row, 19.4 against 25.5 GB/s of weights);
 * q (0..31) times the row's quads: with `vpmaddubsw` summed in int16 over each nibble's 4 quads (at most
 * 4 · 2 · 31 · 127 = 31,496; over the whole block, as Q4L's, it would overflow), in the VNNI forms in int32 as
 * `AVX2_CHAINS` says (one projection of a 1.7B Q5_K_M file's step from memory, all layers: 36-38 ms either way,
 * where each form in the other's loop took 45-46); then the AVX-512 tile's float operations lane by lane. */
static inline __attribute__((always_inline)) AVX2_TARGET void AVX2_NAMED(q5l_tile)(
    const Linear *w, int64_t G, const QuantizedRows *xq, int64_t r0, const int R, float *y, int64_t ldy
) {
    const int64_t k = w->k, blocks = k / 32;
    const uint8_t *qw = (const uint8_t *)w->weight + G * blocks * 320;
    const __m256i mask = _mm256_set1_epi8(0x0F), sixteen = _mm256_set1_epi8(16);
    __m256 out[AVX2_TILE][2], super_d[2], super_dmin[2];
    __m256i super[AVX2_TILE][2], pair[2]; /* Q5_K's: as `q4l_tile`'s */
    for (int r = 0; r < R; r++) out[r][0] = out[r][1] = _mm256_setzero_ps(), super[r][0] = super[r][1] = _mm256_setzero_si256();
    for (int64_t b = 0; b < blocks; b++) {
        const uint8_t *block = qw + b * 320;
        prefetch_ahead(block, 320, 2048);
        __m256 d[2], mn[2];
        if (w->supers) {
            if (b % 8 == 0) {
                q4k_super_avx2(w, G, b, super_d, super_dmin);
                for (int r = 0; r < R; r++) super[r][0] = super[r][1] = _mm256_setzero_si256();
            }
            q4k_group_avx2(w, G, b, super_d, super_dmin, d, mn);
            q4k_pairs_avx2(w, G, b, pair);
        } else { /* Q5_0, Q5_1: a float16 scale and minimum per block */
            lanes_ph((const uint16_t *)w->scales + (G * blocks + b) * 16, d);
            lanes_ph(w->mins + (G * blocks + b) * 16, mn);
        }
        for (int h = 0; h < 2; h++) {
            __m256i acc[AVX2_TILE], more[AVX2_TILE]; /* the low nibbles' quads, the high ones' */
            for (int r = 0; r < R; r++) acc[r] = more[r] = _mm256_setzero_si256();
            const __m256i planes = _mm256_loadu_si256((const __m256i *)(block + Q5L_PLANES + 32 * h));
#pragma GCC unroll 4
            for (int m = 0; m < 4; m++) { /* quad m's fifth bits: the planes' bit m (low nibbles), 4 + m (high) */
                const __m256i v = _mm256_loadu_si256((const __m256i *)(block + Q5L_QUADS + 64 * m + 32 * h));
                const __m256i lo = _mm256_and_si256(_mm256_slli_epi16(planes, 4 - m), sixteen);
                const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(planes, m), sixteen);
                const __m256i low = _mm256_or_si256(_mm256_and_si256(v, mask), lo);
                const __m256i high = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(v, 4), mask), hi);
                for (int r = 0; r < R; r++) {
                    acc[r] = AVX2_BLOCK_DOT(acc[r], low, QUAD(r, m));
                    if (!AVX2_ACCUMULATES || AVX2_CHAINS(R)) more[r] = AVX2_BLOCK_DOT(more[r], high, QUAD(r, 4 + m));
                    else acc[r] = AVX2_BLOCK_DOT(acc[r], high, QUAD(r, 4 + m));
                }
            }
            for (int r = 0; r < R; r++) {
                if (w->supers) {
                    super[r][h] = _mm256_add_epi32(super[r][h], AVX2_ACCUMULATES ? AVX2_BLOCK_SCALED(_mm256_add_epi32(acc[r], more[r]), pair[h])
                                                                                 : _mm256_add_epi32(AVX2_BLOCK_SCALED(acc[r], pair[h]), AVX2_BLOCK_SCALED(more[r], pair[h])));
                    out[r][h] = _mm256_fmadd_ps(mn[h], _mm256_set1_ps(xq->sum8[(r0 + r) * blocks + b]), out[r][h]);
                    if (b % 8 == 7)
                        out[r][h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(super[r][h]), _mm256_mul_ps(super_d[h], ROW_SCALE(r)), out[r][h]);
                    continue;
                }
                const __m256i sums = _mm256_add_epi32(AVX2_BLOCK_SUMS(acc[r]), AVX2_BLOCK_SUMS(more[r]));
                out[r][h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums), _mm256_mul_ps(d[h], ROW_SCALE(r)), out[r][h]);
                out[r][h] = _mm256_fmadd_ps(mn[h], _mm256_set1_ps(xq->sum8[(r0 + r) * blocks + b]), out[r][h]);
            }
        }
    }
    for (int r = 0; r < R; r++) store_lanes(out[r], w->bias ? w->bias + G * 16 : NULL, y + (r0 + r) * ldy + G * 16);
}

static AVX2_TARGET void AVX2_NAMED(q5l_rows)(const Linear *w, const QuantizedRows *xq, int64_t rows, int64_t j0,
                                             int64_t j1, float *y, int64_t ldy) {
    for (int64_t G = j0 / 16; G < j1 / 16; G++) AVX2_PASSES(AVX2_NAMED(q5l_tile))
}

/* `q6l_tile` (lanes.c) on AVX2: per block and half of 8 channels, each quad vector's half with its high bits moved in
 * as the AVX-512 tile does, q (0..63) times the row's quads two quads a step (`QUAD_PAIR_DOT`: one vpmaddwd for both
 * quads' int16 pairs), each sub-block's sums times its sc into the super-block's sums (the vpmaddubsw form as it sums
 * the pairs, `quad_pair_scaled`), less 32 · (sc₀ · the sub-block's inputs' sum + sc₁ · the next's) in one vpmaddwd
 * of int16 pairs, scaled by d · the row's scale after the super-block's last block (kernels.h `sub_scales`). */
static inline __attribute__((always_inline)) AVX2_TARGET void AVX2_NAMED(q6l_tile)(
    const Linear *w, int64_t G, const QuantizedRows *xq, int64_t r0, const int R, float *y, int64_t ldy
) {
    const int64_t k = w->k, blocks = k / 32;
    const uint8_t *qw = (const uint8_t *)w->weight + G * blocks * 384;
    const int8_t *sc = (const int8_t *)w->scales + G * (k / 16) * 16;
    const uint16_t *d = w->supers + G * (k / 256) * 16;
    const __m256i low4 = _mm256_set1_epi8(0x0F), high2 = _mm256_set1_epi8(0x30);
    __m256 out[AVX2_TILE][2];
    __m256i super[AVX2_TILE][2];
    for (int r = 0; r < R; r++) out[r][0] = out[r][1] = _mm256_setzero_ps(), super[r][0] = super[r][1] = _mm256_setzero_si256();
    for (int64_t b = 0; b < blocks; b++) {
        const uint8_t *block = qw + b * 384;
        prefetch_ahead(block, 384, 1024);
        __m256i inputs[AVX2_TILE]; /* the row's int8 sums of the two sub-blocks as an int16 pair */
        for (int r = 0; r < R; r++) {
            const int32_t *half = xq->half + (r0 + r) * (k / 16) + 2 * b;
            inputs[r] = _mm256_set1_epi32((int32_t)((uint32_t)(uint16_t)half[0] | (uint32_t)half[1] << 16));
        }
        for (int h = 0; h < 2; h++) {
            __m256i pair[3]; /* sc₀ and sc₁ as int16 pairs, and 32 · (sc₀, sc₁) */
            q6l_pairs_avx2(sc + 2 * b * 16 + 8 * h, pair);
            __m256i lo[AVX2_TILE], hi[AVX2_TILE]; /* the VNNI forms' sums of each sub-block */
            for (int r = 0; r < R; r++) {
                super[r][h] = _mm256_sub_epi32(super[r][h], _mm256_madd_epi16(pair[2], inputs[r]));
                lo[r] = hi[r] = _mm256_setzero_si256();
            }
            for (int m = 0; m < 4; m += 2) { /* quads m and m + 1 share their high bits' vector */
                const __m256i bits = _mm256_loadu_si256((const __m256i *)(block + 256 + 64 * (m / 2) + 32 * h));
                __m256i low[2], high[2];
                for (int odd = 0; odd < 2; odd++) {
                    const __m256i v = _mm256_loadu_si256((const __m256i *)(block + 64 * (m + odd) + 32 * h));
                    const __m256i first = _mm256_and_si256(odd ? _mm256_slli_epi16(bits, 4) : bits, high2);
                    const __m256i second =
                        _mm256_and_si256(odd ? _mm256_slli_epi16(bits, 2) : _mm256_srli_epi16(bits, 2), high2);
                    low[odd] = _mm256_or_si256(_mm256_and_si256(v, low4), first);
                    high[odd] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(v, 4), low4), second);
                }
                for (int r = 0; r < R; r++) {
                    if (!AVX2_ACCUMULATES) {
                        super[r][h] = quad_pair_scaled_maddubs(super[r][h], low[0], QUAD(r, m), low[1], QUAD(r, m + 1), pair[0]);
                        super[r][h] = quad_pair_scaled_maddubs(super[r][h], high[0], QUAD(r, 4 + m), high[1], QUAD(r, 5 + m), pair[1]);
                        continue;
                    }
                    lo[r] = AVX2_QUAD_PAIR_DOT(lo[r], low[0], QUAD(r, m), low[1], QUAD(r, m + 1));
                    hi[r] = AVX2_QUAD_PAIR_DOT(hi[r], high[0], QUAD(r, 4 + m), high[1], QUAD(r, 5 + m));
                }
            }
            for (int r = 0; AVX2_ACCUMULATES && r < R; r++)
                super[r][h] = _mm256_add_epi32(super[r][h], _mm256_add_epi32(AVX2_BLOCK_SCALED(lo[r], pair[0]), AVX2_BLOCK_SCALED(hi[r], pair[1])));
            if (b % 8 < 7) continue;
            const __m256 scale = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(d + b / 8 * 16 + 8 * h)));
            for (int r = 0; r < R; r++) {
                out[r][h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(super[r][h]), _mm256_mul_ps(scale, ROW_SCALE(r)), out[r][h]);
                super[r][h] = _mm256_setzero_si256();
            }
        }
    }
    for (int r = 0; r < R; r++) store_lanes(out[r], w->bias ? w->bias + G * 16 : NULL, y + (r0 + r) * ldy + G * 16);
}

static AVX2_TARGET void AVX2_NAMED(q6l_rows)(const Linear *w, const QuantizedRows *xq, int64_t rows, int64_t j0,
                                             int64_t j1, float *y, int64_t ldy) {
    for (int64_t G = j0 / 16; G < j1 / 16; G++) AVX2_PASSES(AVX2_NAMED(q6l_tile))
}

static AVX2_TARGET void AVX2_NAMED(iq4l_rows)(const Linear *w, const QuantizedRows *xq, int64_t rows, int64_t j0,
                                              int64_t j1, float *y, int64_t ldy) {
    for (int64_t G = j0 / 16; G < j1 / 16; G++) AVX2_PASSES(AVX2_NAMED(iq4l_tile))
}

static AVX2_TARGET void AVX2_NAMED(q4l_rows)(const Linear *w, const QuantizedRows *xq, int64_t rows, int64_t j0,
                                             int64_t j1, float *y, int64_t ldy) {
    for (int64_t G = j0 / 16; G < j1 / 16; G++) AVX2_PASSES(AVX2_NAMED(q4l_tile))
}

static AVX2_TARGET void AVX2_NAMED(q8l_rows)(const Linear *w, const QuantizedRows *xq, int64_t rows, int64_t j0,
                                             int64_t j1, float *y, int64_t ldy) {
    for (int64_t G = j0 / 16; G < j1 / 16; G++) AVX2_PASSES(AVX2_NAMED(q8l_tile))
}
