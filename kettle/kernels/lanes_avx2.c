/* The lanes kernels on AVX2 CPUs: tiles for Q4L, Q8L and IQ4L (weight_types.c's `quantized_rows_avx2`), so that
 * those types (Q4_0, Q4_1, Q4_K and int4; Q8_0; IQ4_XS) are held in lanes with int8 rows on any AVX2 CPU. A unit of
 * 32 bytes is two halves of 16 (channels 16G .. 16G + 7, then + 8 .. + 15); two units' bytes interleaved give each
 * channel its quad (lanes.c). `vpmaddubsw` (an unsigned byte times a signed one, pairs summed into int16) then
 * `vpmaddwd` by ones give each channel's quad sums in its int32 lane: Q4's unsigned q directly, signed values
 * (IQ4_XS's grid, Q8_0's q) through the sign trick (`quad_dot`). These are the integer sums of AVX-512's `vpdpbusd`
 * over q + offset less offset · the inputs' sum, exactly, and every float operation is lane by lane the AVX-512
 * tile's: a row's outputs have the same bits on either CPU (tests/unit/test_weight_types.py holds them equal).
 *
 * Measured on the 1.7B files with AVX-512 off (2 Zen 4 cores, one process alternating the two loads, medians, tok/s
 * decode / prefill of 512; runs on this shared machine moved by up to ~15%): Q4_K_M 23.5 / 49.1 in the rows layout
 * (int16 rows), 28.0 / 45.4 in lanes; Q8_0 17.3 / 47.3 in rows, 18.2 / 43.1 in lanes. Prompts took the float32
 * panels, which then dequantized a lanes channel from strided bytes; since they read Q4L and Q8L 16 channels at a
 * time (the table's `panel_group`) Q4_K_M's prompts run as from rows (49.0 against 48.6, decode 31.5 against
 * 24.9, alternated in one process). Prompts of 64 rows and more now take the integer panels' AVX2 micro-kernel
 * (gemm.c), fewer these tiles: int8 rows with these tiles' bits (Q4_K_M's prefill 52.3 → 84.3 tok/s). Q6L and
 * Q5L have no AVX2 tile: with int8 rows theirs lost to int8 per channel, where Q6_K, Q5_K, Q5_0 and Q5_1 stay on such
 * CPUs (the nearest scheme): Q6_K 19.6 against 20.5 (its high bits moved and interleaved per unit pair; a Q4_K_M
 * file's Q6_K tensors 28.1 against 27.4, within the noise, prompts 0.96x), Q5_K_M 15.3 against 18.3 (its fifth-bit
 * masks widened to bytes, `vpshufb` and a compare per 32; with int16 rows, before, 1.7x slower). */
#include "kernels.h"

/* Rows a pass: 4 rows × 2 halves of int32 sums and float outputs in AVX2's 16 registers, with the weights beside. */
#define AVX2_TILE 4

/* AVX-512 for the lanes tiles where the CPU has it: -1 (the default) the CPU's answer, 0 the AVX2 ones (tests). */
int kettle_lanes_avx512 = -1;

/* Sum of each channel's four products of w (signed bytes) and the broadcast quad x, in its int32 lane. */
static inline __m256i quad_dot(__m256i w, __m256i x) {
    const __m256i pairs = _mm256_maddubs_epi16(_mm256_sign_epi8(w, w), _mm256_sign_epi8(x, w));
    return _mm256_madd_epi16(pairs, _mm256_set1_epi16(1));
}

/* `iq4l_tile` on AVX2, output channels 16G .. 16G + 15 for rows r0 .. r0 + R - 1 (R ≤ AVX2_TILE, a constant): per
 * half of 8 channels, each pair of units' halves interleaved, looked up in the grid with `pshufb`, and multiplied
 * with the row's quads. */
static inline __attribute__((always_inline)) void iq4l_tile_avx2(const Linear *w, int64_t G, const QuantizedRows *xq,
                                                                 int64_t r0, const int R, float *y, int64_t ldy) {
    const int64_t k = w->k, blocks = k / 32;
    const uint8_t *qw = (const uint8_t *)w->weight + G * blocks * 256;
    const int8_t *sc = (const int8_t *)w->scales + G * blocks * 16;
    const uint16_t *d = w->supers + G * (k / 256) * 16;
    const __m256i grid = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)IQ4_VALUES));
    const __m256i mask = _mm256_set1_epi8(0x0F);
    __m256 out[AVX2_TILE][2];
    for (int r = 0; r < R; r++) out[r][0] = out[r][1] = _mm256_setzero_ps();
    for (int64_t b = 0; b < blocks; b++) {
        for (int h = 0; h < 2; h++) {
            __m256i acc[AVX2_TILE];
            for (int r = 0; r < R; r++) acc[r] = _mm256_setzero_si256();
            for (int m = 0; m < 4; m++) {
                const __m128i first = _mm_loadu_si128((const __m128i *)(qw + b * 256 + 2 * m * 32 + 16 * h));
                const __m128i second = _mm_loadu_si128((const __m128i *)(qw + b * 256 + (2 * m + 1) * 32 + 16 * h));
                const __m256i v = _mm256_set_m128i(_mm_unpackhi_epi8(first, second), _mm_unpacklo_epi8(first, second));
                const __m256i low = _mm256_shuffle_epi8(grid, _mm256_and_si256(v, mask));
                const __m256i high = _mm256_shuffle_epi8(grid, _mm256_and_si256(_mm256_srli_epi16(v, 4), mask));
                for (int r = 0; r < R; r++) {
                    const int32_t *quads = (const int32_t *)(xq->b + (r0 + r) * k + b * 32);
                    acc[r] = _mm256_add_epi32(acc[r], quad_dot(low, _mm256_set1_epi32(quads[m])));
                    acc[r] = _mm256_add_epi32(acc[r], quad_dot(high, _mm256_set1_epi32(quads[4 + m])));
                }
            }
            const __m256 scale = _mm256_mul_ps(_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(d + b / 8 * 16 + 8 * h))),
                                               _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(sc + b * 16 + 8 * h)))));
            for (int r = 0; r < R; r++) {
                const __m256 combined = _mm256_mul_ps(scale, _mm256_set1_ps(xq->scale8[(r0 + r) * blocks + b]));
                out[r][h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(acc[r]), combined, out[r][h]);
            }
        }
    }
    for (int h = 0; h < 2; h++) {
        const __m256 bias = w->bias ? _mm256_loadu_ps(w->bias + G * 16 + 8 * h) : _mm256_setzero_ps();
        for (int r = 0; r < R; r++) _mm256_storeu_ps(y + (r0 + r) * ldy + G * 16 + 8 * h, _mm256_add_ps(out[r][h], bias));
    }
}

/* ---- Q4L and Q8L: both halves of a unit at once ----
 * Two whole units (32 bytes each) interleaved byte by byte within each 128-bit lane (`pair_units`) give the quads of
 * channels 0-3 and 8-11 of the 16 in one vector, of 4-7 and 12-15 in the other (the "lanes order" of these tiles,
 * which their scale tables are loaded in, `lanes_ph`, `lanes_bytes`, and their outputs stored back out of,
 * `store_lanes`): one load per unit instead of iq4l_tile_avx2's two halves. Q4's q are unsigned: `vpmaddubsw`
 * multiplies them with the signed quads directly, and its pair sums add in int16 over the whole block (at most
 * 15 · 127 · 2 · 8 < 2^15), then one `vpmaddwd` by ones: exact integers, the AVX-512 tile's block sums. */

/* Units p and p + 32 interleaved within each 128-bit lane: v[0] channels 0-3 | 8-11, v[1] channels 4-7 | 12-15. */
static inline void pair_units(const uint8_t *p, __m256i v[2]) {
    const __m256i first = _mm256_loadu_si256((const __m256i *)p), second = _mm256_loadu_si256((const __m256i *)(p + 32));
    v[0] = _mm256_unpacklo_epi8(first, second);
    v[1] = _mm256_unpackhi_epi8(first, second);
}

/* 16 channels' float16 values (a table's row of 16) as floats in lanes order. */
static inline void lanes_ph(const uint16_t *p, __m256 out[2]) {
    const __m256i v = _mm256_permute4x64_epi64(_mm256_loadu_si256((const __m256i *)p), 0xD8);
    out[0] = _mm256_cvtph_ps(_mm256_castsi256_si128(v));
    out[1] = _mm256_cvtph_ps(_mm256_extracti128_si256(v, 1));
}

/* 16 channels' unsigned bytes as floats in lanes order, exact. */
static inline void lanes_bytes(const uint8_t *p, __m256 out[2]) {
    const __m128i order = _mm_setr_epi8(0, 1, 2, 3, 8, 9, 10, 11, 4, 5, 6, 7, 12, 13, 14, 15);
    const __m128i v = _mm_shuffle_epi8(_mm_loadu_si128((const __m128i *)p), order);
    out[0] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(v));
    out[1] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_unpackhi_epi64(v, v)));
}

/* out (lanes order) + bias into channels 16G .. 16G + 15 of y's row. */
static inline void store_lanes(const __m256 out[2], const float *bias, float *y) {
    const __m256 first = _mm256_permute2f128_ps(out[0], out[1], 0x20), second = _mm256_permute2f128_ps(out[0], out[1], 0x31);
    _mm256_storeu_ps(y, _mm256_add_ps(first, bias ? _mm256_loadu_ps(bias) : _mm256_setzero_ps()));
    _mm256_storeu_ps(y + 8, _mm256_add_ps(second, bias ? _mm256_loadu_ps(bias + 8) : _mm256_setzero_ps()));
}

/* `q4k_lanes` (lanes.c) in lanes order: d · sc and -(dmin · m) of group g, the same products and sign flip. */
static inline void q4k_lanes_avx2(const Linear *w, int64_t G, int64_t g, __m256 scale[2], __m256 minimum[2]) {
    const int64_t groups = w->k / 32, at = (G * groups + g) * 16;
    const uint16_t *super = w->supers + (G * (groups / 8) + g / 8) * 32;
    __m256 d[2], dmin[2], sc[2], m[2];
    lanes_ph(super, d);
    lanes_ph(super + 16, dmin);
    lanes_bytes((const uint8_t *)w->scales + at, sc);
    lanes_bytes((const uint8_t *)w->mins + at, m);
    const __m256 sign = _mm256_set1_ps(-0.0f);
    for (int h = 0; h < 2; h++) {
        scale[h] = _mm256_mul_ps(d[h], sc[h]);
        minimum[h] = _mm256_xor_ps(_mm256_mul_ps(dmin[h], m[h]), sign);
    }
}

/* Row r's quad q of block b, broadcast; its scale of block b. */
#define QUAD(r, q) _mm256_set1_epi32(((const int32_t *)(xq->b + (r0 + (r)) * k + b * 32))[q])
#define ROW_SCALE(r) _mm256_set1_ps(xq->scale8[(r0 + (r)) * blocks + b])

/* `q4l_tile` (lanes.c) on AVX2: per block, each pair of units interleaved once, the nibbles' products with each row's
 * quads summed in int16 over the block, then the AVX-512 tile's float operations lane by lane. */
static inline __attribute__((always_inline)) void q4l_tile_avx2(const Linear *w, int64_t G, const QuantizedRows *xq,
                                                                int64_t r0, const int R, float *y, int64_t ldy) {
    const int64_t k = w->k, blocks = k / 32, per_group = w->group / 32, groups = k / w->group;
    const uint8_t *qw = (const uint8_t *)w->weight + G * blocks * 256;
    const uint16_t *scales = (const uint16_t *)w->scales + G * groups * 16;
    const uint16_t *mins = w->mins ? w->mins + G * groups * 16 : NULL;
    const __m256i mask = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);
    __m256 out[AVX2_TILE][2];
    for (int r = 0; r < R; r++) out[r][0] = out[r][1] = _mm256_setzero_ps();
    for (int64_t b = 0; b < blocks; b++) {
        __m256i acc[AVX2_TILE][2]; /* int16 pair sums: at most 15 · 127 · 2 · 8 */
        for (int r = 0; r < R; r++) acc[r][0] = acc[r][1] = _mm256_setzero_si256();
        for (int m = 0; m < 4; m++) {
            __m256i v[2], low[2], high[2];
            pair_units(qw + b * 256 + m * 64, v);
            for (int h = 0; h < 2; h++) {
                low[h] = _mm256_and_si256(v[h], mask);
                high[h] = _mm256_and_si256(_mm256_srli_epi16(v[h], 4), mask);
            }
            for (int r = 0; r < R; r++) {
                const __m256i first = QUAD(r, m), second = QUAD(r, 4 + m);
                for (int h = 0; h < 2; h++)
                    acc[r][h] = _mm256_add_epi16(acc[r][h], _mm256_add_epi16(_mm256_maddubs_epi16(low[h], first),
                                                                             _mm256_maddubs_epi16(high[h], second)));
            }
        }
        const int64_t g = b / per_group; /* the group's minimum term once, with its first block */
        __m256 d[2], mn[2];
        if (w->supers) {
            q4k_lanes_avx2(w, G, g, d, mn);
        } else {
            lanes_ph(scales + g * 16, d);
            if (mins) lanes_ph(mins + g * 16, mn);
            else for (int h = 0; h < 2; h++) mn[h] = _mm256_mul_ps(d[h], _mm256_set1_ps(-8.0f));
        }
        for (int r = 0; r < R; r++) {
            const __m256 dx = ROW_SCALE(r);
            for (int h = 0; h < 2; h++) {
                const __m256 sums = _mm256_cvtepi32_ps(_mm256_madd_epi16(acc[r][h], ones));
                out[r][h] = _mm256_fmadd_ps(sums, _mm256_mul_ps(d[h], dx), out[r][h]);
                if (b % per_group == 0)
                    out[r][h] = _mm256_fmadd_ps(mn[h], _mm256_set1_ps(xq->sum8[(r0 + r) * groups + g]), out[r][h]);
            }
        }
    }
    for (int r = 0; r < R; r++) store_lanes(out[r], w->bias ? w->bias + G * 16 : NULL, y + (r0 + r) * ldy + G * 16);
}

/* `q8l_tile` on AVX2: each two pairs interleaved give the quads, signed: `quad_dot`'s sign trick, whose sums are
 * the AVX-512 tile's (q + 128 less 128 · the block's inputs). */
static inline __attribute__((always_inline)) void q8l_tile_avx2(const Linear *w, int64_t G, const QuantizedRows *xq,
                                                                int64_t r0, const int R, float *y, int64_t ldy) {
    const int64_t k = w->k, blocks = k / 32, first = G * blocks;
    const uint8_t *qw = (const uint8_t *)w->weight + first * 512;
    const uint16_t *scales = (const uint16_t *)w->scales + first * 16;
    const __m256i ones = _mm256_set1_epi16(1);
    __m256 out[AVX2_TILE][2];
    for (int r = 0; r < R; r++) out[r][0] = out[r][1] = _mm256_setzero_ps();
    for (int64_t b = 0; b < blocks; b++) {
        __m256i acc[AVX2_TILE][2];
        for (int r = 0; r < R; r++) acc[r][0] = acc[r][1] = _mm256_setzero_si256();
        for (int m = 0; m < 8; m++) {
            __m256i v[2], size[2];
            pair_units(qw + b * 512 + m * 64, v);
            for (int h = 0; h < 2; h++) size[h] = _mm256_sign_epi8(v[h], v[h]); /* |q| as u8, -128 too */
            for (int r = 0; r < R; r++) {
                const __m256i quad = QUAD(r, m);
                for (int h = 0; h < 2; h++) {
                    const __m256i pairs = _mm256_maddubs_epi16(size[h], _mm256_sign_epi8(quad, v[h]));
                    acc[r][h] = _mm256_add_epi32(acc[r][h], _mm256_madd_epi16(pairs, ones));
                }
            }
        }
        __m256 d[2];
        lanes_ph(scales + b * 16, d);
        for (int r = 0; r < R; r++) {
            const __m256 dx = ROW_SCALE(r);
            for (int h = 0; h < 2; h++)
                out[r][h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(acc[r][h]), _mm256_mul_ps(d[h], dx), out[r][h]);
        }
    }
    for (int r = 0; r < R; r++) store_lanes(out[r], w->bias ? w->bias + G * 16 : NULL, y + (r0 + r) * ldy + G * 16);
}
#undef QUAD
#undef ROW_SCALE

#define AVX2_PASSES(tile_fn)                                                                                 \
    for (int64_t r0 = 0; r0 < rows; r0 += AVX2_TILE) {                                                     \
        switch (rows - r0 < AVX2_TILE ? rows - r0 : AVX2_TILE) {                                           \
        case 4: tile_fn(w, G, xq, r0, 4, y, ldy); break;                                                   \
        case 3: tile_fn(w, G, xq, r0, 3, y, ldy); break;                                                   \
        case 2: tile_fn(w, G, xq, r0, 2, y, ldy); break;                                                   \
        default: tile_fn(w, G, xq, r0, 1, y, ldy);                                                         \
        }                                                                                                  \
    }

void iq4l_rows_avx2(const Linear *w, const QuantizedRows *xq, int64_t rows, int64_t j0, int64_t j1, float *y,
                    int64_t ldy) {
    for (int64_t G = j0 / 16; G < j1 / 16; G++) AVX2_PASSES(iq4l_tile_avx2)
}

void q4l_rows_avx2(const Linear *w, const QuantizedRows *xq, int64_t rows, int64_t j0, int64_t j1, float *y,
                   int64_t ldy) {
    for (int64_t G = j0 / 16; G < j1 / 16; G++) AVX2_PASSES(q4l_tile_avx2)
}

void q8l_rows_avx2(const Linear *w, const QuantizedRows *xq, int64_t rows, int64_t j0, int64_t j1, float *y,
                   int64_t ldy) {
    for (int64_t G = j0 / 16; G < j1 / 16; G++) AVX2_PASSES(q8l_tile_avx2)
}
#undef AVX2_PASSES
