/* The lanes kernels: weights stored 16 output channels side by side (kernels.h's Q4L, Q8L and Q6L layouts) times a
 * few int16 activation rows, 16 channels advancing by two inputs per `vpdpwssd` (AVX-512 VNNI). Decode steps and
 * small batches run here, op by op (linear.c) and in the fused step (decoder_step.c); one translation unit
 * holds the tiles, so the library compiles them once. */

#include "kernels.h"

/* Scales and minimums of group g (a sub-block of 32) of channels 16G .. 16G + 15 of a Q4L weight with Q4_K's scales
 * (`supers`): d · sc and -(dmin · m), sc and m widened from bytes (the products exact, as GGUF computes them). */
static inline ONE512 void q4k_lanes(const Linear *w, int64_t G, int64_t g, __m512 *scale, __m512 *minimum) {
    const int64_t groups = w->k / 32, at = (G * groups + g) * 16;
    const uint16_t *super = w->supers + (G * (groups / 8) + g / 8) * 32;
    const __m128i sc = _mm_loadu_si128((const __m128i *)((const uint8_t *)w->scales + at));
    const __m128i m = _mm_loadu_si128((const __m128i *)((const uint8_t *)w->mins + at));
    const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)super));
    const __m512 dmin = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(super + 16)));
    *scale = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(sc)));
    const __m512i sign = _mm512_set1_epi32((int)0x80000000); /* -(dmin · m) bit for bit as `q4l_scale`, zeros too */
    const __m512 product = _mm512_mul_ps(dmin, _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(m)));
    *minimum = _mm512_castsi512_ps(_mm512_xor_si512(_mm512_castps_si512(product), sign));
}

/* Output channels 16G .. 16G + 15 of a Q4L weight for rows r0 .. r0 + R - 1 of xq (R ≤ LANES_TILE, a constant at
 * each call): per block, each unit of 32 bytes widened once gives two vectors of input pairs (low and high nibbles)
 * that every row multiplies by its broadcast pair (`vpdpwssd`), the block's int32 sums then scaled for the 16
 * channels at once. The products are those of `q4_channel_one`; the float sums run per block, not per lane. */
static inline __attribute__((always_inline)) ONE512 void q4l_tile(const Linear *w, int64_t G, const QuantizedRows *xq,
                                                                  int64_t r0, const int R, float *y, int64_t ldy) {
    const int64_t k = w->k, blocks = k / 32, per_group = w->group / 32, groups = k / w->group;
    const uint8_t *qw = (const uint8_t *)w->weight + G * blocks * 256;
    const uint16_t *scales = (const uint16_t *)w->scales + G * groups * 16;
    const uint16_t *mins = w->mins ? w->mins + G * groups * 16 : NULL;
    const __m512i mask = _mm512_set1_epi16(0x0F);
    __m512 out[LANES_TILE];
    for (int r = 0; r < R; r++) out[r] = _mm512_setzero_ps();
    for (int64_t b = 0; b < blocks; b++) {
        __m512i acc[LANES_TILE];
        for (int r = 0; r < R; r++) acc[r] = _mm512_setzero_si512();
        for (int u = 0; u < 8; u++) {
            const __m512i bytes = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)(qw + b * 256 + u * 32)));
            const __m512i low = _mm512_and_si512(bytes, mask), high = _mm512_srli_epi16(bytes, 4);
            for (int r = 0; r < R; r++) {
                const int32_t *pairs = (const int32_t *)(xq->q + (r0 + r) * k + b * 32);
                acc[r] = _mm512_dpwssd_epi32(acc[r], low, _mm512_set1_epi32(pairs[u]));
                acc[r] = _mm512_dpwssd_epi32(acc[r], high, _mm512_set1_epi32(pairs[u + 8]));
            }
        }
        const int64_t g = b / per_group; /* the group's minimum term once, with its first block */
        __m512 d, m;
        if (w->supers) {
            q4k_lanes(w, G, g, &d, &m);
        } else {
            d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(scales + g * 16)));
            m = mins ? _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(mins + g * 16)))
                     : _mm512_mul_ps(d, _mm512_set1_ps(-8.0f));
        }
        for (int r = 0; r < R; r++) {
            const __m512 combined = _mm512_mul_ps(d, _mm512_set1_ps(xq->scale[(r0 + r) * blocks + b]));
            out[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc[r]), combined, out[r]);
            if (b % per_group == 0) out[r] = _mm512_fmadd_ps(m, _mm512_set1_ps(xq->sum[(r0 + r) * groups + g]), out[r]);
        }
    }
    const __m512 bias = w->bias ? _mm512_loadu_ps(w->bias + G * 16) : _mm512_setzero_ps();
    for (int r = 0; r < R; r++) _mm512_storeu_ps(y + (r0 + r) * ldy + G * 16, _mm512_add_ps(out[r], bias));
}

/* `q4l_tile` for a Q5L weight (Q4_K's scales, or Q5_0's and Q5_1's per block): each unit's nibbles widened once, the fifth bits added lane by lane
 * from the unit's two masks (one masked add of 16 each), then the same products and scales. */
static inline __attribute__((always_inline)) ONE512 void q5l_tile(const Linear *w, int64_t G, const QuantizedRows *xq,
                                                                  int64_t r0, const int R, float *y, int64_t ldy) {
    const int64_t k = w->k, blocks = k / 32;
    const uint8_t *qw = (const uint8_t *)w->weight + G * blocks * 320;
    const __m512i mask = _mm512_set1_epi16(0x0F), sixteen = _mm512_set1_epi16(16);
    __m512 out[LANES_TILE];
    for (int r = 0; r < R; r++) out[r] = _mm512_setzero_ps();
    for (int64_t b = 0; b < blocks; b++) {
        __m512i acc[LANES_TILE];
        for (int r = 0; r < R; r++) acc[r] = _mm512_setzero_si512();
        const uint8_t *block = qw + b * 320;
        for (int u = 0; u < 8; u++) {
            const __m512i bytes = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)(block + u * 32)));
            uint32_t fifth[2];
            memcpy(fifth, block + 256 + 8 * u, 8);
            const __m512i nibbles = _mm512_and_si512(bytes, mask), upper = _mm512_srli_epi16(bytes, 4);
            const __m512i low = _mm512_mask_add_epi16(nibbles, (__mmask32)fifth[0], nibbles, sixteen);
            const __m512i high = _mm512_mask_add_epi16(upper, (__mmask32)fifth[1], upper, sixteen);
            for (int r = 0; r < R; r++) {
                const int32_t *pairs = (const int32_t *)(xq->q + (r0 + r) * k + b * 32);
                acc[r] = _mm512_dpwssd_epi32(acc[r], low, _mm512_set1_epi32(pairs[u]));
                acc[r] = _mm512_dpwssd_epi32(acc[r], high, _mm512_set1_epi32(pairs[u + 8]));
            }
        }
        __m512 d, m;
        if (w->supers) {
            q4k_lanes(w, G, b, &d, &m);
        } else { /* Q5_0, Q5_1: a float16 scale and minimum per block */
            d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)((const uint16_t *)w->scales + (G * blocks + b) * 16)));
            m = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(w->mins + (G * blocks + b) * 16)));
        }
        for (int r = 0; r < R; r++) {
            const __m512 combined = _mm512_mul_ps(d, _mm512_set1_ps(xq->scale[(r0 + r) * blocks + b]));
            out[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc[r]), combined, out[r]);
            out[r] = _mm512_fmadd_ps(m, _mm512_set1_ps(xq->sum[(r0 + r) * blocks + b]), out[r]);
        }
    }
    const __m512 bias = w->bias ? _mm512_loadu_ps(w->bias + G * 16) : _mm512_setzero_ps();
    for (int r = 0; r < R; r++) _mm512_storeu_ps(y + (r0 + r) * ldy + G * 16, _mm512_add_ps(out[r], bias));
}

/* `q4l_tile` for an IQ4L weight: each unit's indices widened once and looked up in the grid (`vpermw`, 32 int16
 * entries: the 16 values twice), then the same products; the block's scale d · (ls - 32) for 16 channels at once. */
static inline __attribute__((always_inline)) ONE512 void iq4l_tile(const Linear *w, int64_t G, const QuantizedRows *xq,
                                                                   int64_t r0, const int R, float *y, int64_t ldy) {
    const int64_t k = w->k, blocks = k / 32;
    const uint8_t *qw = (const uint8_t *)w->weight + G * blocks * 256;
    const int8_t *sc = (const int8_t *)w->scales + G * blocks * 16;
    const uint16_t *d = w->supers + G * (k / 256) * 16;
    const __m512i mask = _mm512_set1_epi16(0x0F);
    const __m512i grid = _mm512_cvtepi8_epi16(_mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)IQ4_VALUES)));
    __m512 out[LANES_TILE];
    for (int r = 0; r < R; r++) out[r] = _mm512_setzero_ps();
    for (int64_t b = 0; b < blocks; b++) {
        __m512i acc[LANES_TILE];
        for (int r = 0; r < R; r++) acc[r] = _mm512_setzero_si512();
        for (int u = 0; u < 8; u++) {
            const __m512i bytes = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)(qw + b * 256 + u * 32)));
            const __m512i low = _mm512_permutexvar_epi16(_mm512_and_si512(bytes, mask), grid);
            const __m512i high = _mm512_permutexvar_epi16(_mm512_srli_epi16(bytes, 4), grid);
            for (int r = 0; r < R; r++) {
                const int32_t *pairs = (const int32_t *)(xq->q + (r0 + r) * k + b * 32);
                acc[r] = _mm512_dpwssd_epi32(acc[r], low, _mm512_set1_epi32(pairs[u]));
                acc[r] = _mm512_dpwssd_epi32(acc[r], high, _mm512_set1_epi32(pairs[u + 8]));
            }
        }
        const __m512 scale = _mm512_mul_ps(_mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(d + b / 8 * 16))),
                                           _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(sc + b * 16)))));
        for (int r = 0; r < R; r++) {
            const __m512 combined = _mm512_mul_ps(scale, _mm512_set1_ps(xq->scale[(r0 + r) * blocks + b]));
            out[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc[r]), combined, out[r]);
        }
    }
    const __m512 bias = w->bias ? _mm512_loadu_ps(w->bias + G * 16) : _mm512_setzero_ps();
    for (int r = 0; r < R; r++) _mm512_storeu_ps(y + (r0 + r) * ldy + G * 16, _mm512_add_ps(out[r], bias));
}

/* `q4l_tile` for a Q8L weight: each pair's 32 bytes widened once, then one `vpdpwssd` per row. */
static inline __attribute__((always_inline)) ONE512 void q8l_tile(const Linear *w, int64_t G, const QuantizedRows *xq,
                                                                  int64_t r0, const int R, float *y, int64_t ldy) {
    const int64_t k = w->k, blocks = k / 32, first = G * blocks;
    const int8_t *qw = (const int8_t *)w->weight + first * 512;
    const uint16_t *scales = (const uint16_t *)w->scales + first * 16;
    __m512 out[LANES_TILE];
    for (int r = 0; r < R; r++) out[r] = _mm512_setzero_ps();
    for (int64_t b = 0; b < blocks; b++) {
        __m512i acc[LANES_TILE];
        for (int r = 0; r < R; r++) acc[r] = _mm512_setzero_si512();
        for (int p = 0; p < 16; p++) {
            const __m512i pair = _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i *)(qw + b * 512 + p * 32)));
            for (int r = 0; r < R; r++) {
                const int32_t *x = (const int32_t *)(xq->q + (r0 + r) * k + b * 32);
                acc[r] = _mm512_dpwssd_epi32(acc[r], pair, _mm512_set1_epi32(x[p]));
            }
        }
        const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(scales + b * 16)));
        for (int r = 0; r < R; r++) {
            const __m512 combined = _mm512_mul_ps(d, _mm512_set1_ps(xq->scale[(r0 + r) * blocks + b]));
            out[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc[r]), combined, out[r]);
        }
    }
    const __m512 bias = w->bias ? _mm512_loadu_ps(w->bias + G * 16) : _mm512_setzero_ps();
    for (int r = 0; r < R; r++) _mm512_storeu_ps(y + (r0 + r) * ldy + G * 16, _mm512_add_ps(out[r], bias));
}

/* `q4l_tile` for a Q6L weight: each unit's 32 bytes of low bits widened once with its high bits (one vector of
 * them per two units) into q, multiplied as Q4L's nibbles; the inputs 0..15 and 16..31 of a block (low and high
 * nibbles) are Q6_K's two sub-blocks of 16, so each keeps its own int32 sums, scaled by its own d · sc. The -32 is
 * taken once per sub-block and row (32 · the sub-block's sum of inputs, `QuantizedRows.half`), not per weight. */
static inline __attribute__((always_inline)) ONE512 void q6l_tile(const Linear *w, int64_t G, const QuantizedRows *xq,
                                                                  int64_t r0, const int R, float *y, int64_t ldy) {
    const int64_t k = w->k, blocks = k / 32;
    const uint8_t *qw = (const uint8_t *)w->weight + G * blocks * 384;
    const int8_t *sc = (const int8_t *)w->scales + G * (k / 16) * 16;
    const uint16_t *d = w->supers + G * (k / 256) * 16;
    const __m512i low4 = _mm512_set1_epi16(0x0F), high2 = _mm512_set1_epi16(0x30);
    __m512 out[LANES_TILE];
    for (int r = 0; r < R; r++) out[r] = _mm512_setzero_ps();
    for (int64_t b = 0; b < blocks; b++) {
        __m512i lo[LANES_TILE], hi[LANES_TILE]; /* each sub-block's sums */
        for (int r = 0; r < R; r++) lo[r] = hi[r] = _mm512_setzero_si512();
        const uint8_t *block = qw + b * 384;
        for (int u = 0; u < 8; u++) {
            const __m512i bytes = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)(block + u * 32)));
            const __m512i bits = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)(block + 256 + u / 2 * 32)));
            const int t = u % 2; /* this unit's bits: 4t, 4t + 1 (low nibbles), 4t + 2, 4t + 3 (high) */
            const __m512i first = _mm512_and_si512(t ? bits : _mm512_slli_epi16(bits, 4), high2);
            const __m512i second = _mm512_and_si512(t ? _mm512_srli_epi16(bits, 2) : _mm512_slli_epi16(bits, 2), high2);
            /* (bytes & 0x0F) | first in one instruction: first has no bits where the mask does */
            const __m512i low = _mm512_ternarylogic_epi32(bytes, low4, first, 0xEA);
            const __m512i high = _mm512_or_si512(_mm512_srli_epi16(bytes, 4), second);
            for (int r = 0; r < R; r++) {
                const int32_t *pairs = (const int32_t *)(xq->q + (r0 + r) * k + b * 32);
                lo[r] = _mm512_dpwssd_epi32(lo[r], low, _mm512_set1_epi32(pairs[u]));
                hi[r] = _mm512_dpwssd_epi32(hi[r], high, _mm512_set1_epi32(pairs[u + 8]));
            }
        }
        const __m512 scale = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(d + b / 8 * 16)));
        const __m128i *subs = (const __m128i *)(sc + 2 * b * 16);
        const __m512 first = _mm512_mul_ps(scale, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(subs))));
        const __m512 second = _mm512_mul_ps(scale, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(subs + 1))));
        for (int r = 0; r < R; r++) {
            const int32_t *half = xq->half + (r0 + r) * (k / 16) + 2 * b;
            const __m512 dx = _mm512_set1_ps(xq->scale[(r0 + r) * blocks + b]);
            const __m512i l = _mm512_sub_epi32(lo[r], _mm512_set1_epi32(32 * half[0]));
            const __m512i h = _mm512_sub_epi32(hi[r], _mm512_set1_epi32(32 * half[1]));
            out[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(l), _mm512_mul_ps(first, dx), out[r]);
            out[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(h), _mm512_mul_ps(second, dx), out[r]);
        }
    }
    const __m512 bias = w->bias ? _mm512_loadu_ps(w->bias + G * 16) : _mm512_setzero_ps();
    for (int r = 0; r < R; r++) _mm512_storeu_ps(y + (r0 + r) * ldy + G * 16, _mm512_add_ps(out[r], bias));
}

#define LANES_PASSES(tile_fn)                                                                                \
    for (int64_t r0 = 0; r0 < rows; r0 += LANES_TILE) {                                                    \
        switch (rows - r0 < LANES_TILE ? rows - r0 : LANES_TILE) {                                         \
        case 8: tile_fn(w, G, xq, r0, 8, y, ldy); break;                                                   \
        case 7: tile_fn(w, G, xq, r0, 7, y, ldy); break;                                                   \
        case 6: tile_fn(w, G, xq, r0, 6, y, ldy); break;                                                   \
        case 5: tile_fn(w, G, xq, r0, 5, y, ldy); break;                                                   \
        case 4: tile_fn(w, G, xq, r0, 4, y, ldy); break;                                                   \
        case 3: tile_fn(w, G, xq, r0, 3, y, ldy); break;                                                   \
        case 2: tile_fn(w, G, xq, r0, 2, y, ldy); break;                                                   \
        default: tile_fn(w, G, xq, r0, 1, y, ldy);                                                         \
        }                                                                                                  \
    }

/* Output channels j0 .. j1 - 1 (multiples of 16) of a weight in lanes for every row quantized in xq, LANES_TILE rows
 * a pass (the table's `quantized_rows`). */
ONE512 void q4l_rows(const Linear *w, const QuantizedRows *xq, int64_t rows, int64_t j0, int64_t j1, float *y,
                     int64_t ldy) {
    for (int64_t G = j0 / 16; G < j1 / 16; G++) LANES_PASSES(q4l_tile)
}

ONE512 void q8l_rows(const Linear *w, const QuantizedRows *xq, int64_t rows, int64_t j0, int64_t j1, float *y,
                     int64_t ldy) {
    for (int64_t G = j0 / 16; G < j1 / 16; G++) LANES_PASSES(q8l_tile)
}

ONE512 void q6l_rows(const Linear *w, const QuantizedRows *xq, int64_t rows, int64_t j0, int64_t j1, float *y,
                     int64_t ldy) {
    for (int64_t G = j0 / 16; G < j1 / 16; G++) LANES_PASSES(q6l_tile)
}

ONE512 void q5l_rows(const Linear *w, const QuantizedRows *xq, int64_t rows, int64_t j0, int64_t j1, float *y,
                     int64_t ldy) {
    for (int64_t G = j0 / 16; G < j1 / 16; G++) LANES_PASSES(q5l_tile)
}

ONE512 void iq4l_rows(const Linear *w, const QuantizedRows *xq, int64_t rows, int64_t j0, int64_t j1, float *y,
                      int64_t ldy) {
    for (int64_t G = j0 / 16; G < j1 / 16; G++) LANES_PASSES(iq4l_tile)
}
#undef LANES_PASSES
