/* The lanes kernels: weights stored 16 output channels side by side (kernels.h's Q4L, Q5L, IQ4L, Q8L and Q6L
 * layouts) times a few int8 activation rows, 16 channels advancing by four inputs per `vpdpbusd` (AVX-512 VNNI).
 * Decode steps and small batches run here, op by op (linear.c) and in the fused step (decoder_step.c); one
 * translation unit holds the tiles, so the library compiles them once.
 *
 * Each quad vector of a block (64 bytes, stored in this order: kernels.h) gives each channel four bytes in its 32-bit
 * lane. Their low nibbles are the channel's inputs 4m, 4m + 2, 4m + 1, 4m + 3, the int8 rows' quad m, and their high
 * nibbles the same inputs + 16 (quad 4 + m): one `vpdpbusd` per quad and row, the weight the unsigned side. A signed
 * type is held as q + offset (kernels.h `WeightType.offset`), and offset · (the inputs' sum) comes off the block's
 * integer sums, exactly. */

#include "kernels.h"

#define LANES512 AVX512_TARGET("avx512f,avx512bw,avx512vnni")

/* dmin of the super-block holding block b of channels 16G .. 16G + 15 (Q4_K's scales, `supers`), as floats: read
 * once per super-block by the tiles. Converted at every block, with a sign flip per block for the minimum (now
 * `q4k_block`'s vfnmadd), the tiles ran 8% slower from L2 (Zen 4, one thread, 2,048 × 256: Q4L 51.9 → 56.4 GB/s,
 * Q5L 46.4 → 49.1); a 1.7B decode step, which streams its weights from memory, ran even either way. */
static inline LANES512 __m512 q4k_dmin(const Linear *w, int64_t G, int64_t b) {
    return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(w->supers + (G * (w->k / 256) + b / 8) * 32 + 16)));
}

/* dmin · m of block b of the 16 channels, m widened from bytes (the product exact, as GGUF computes it): the block's
 * minimum is minus it, which `q4k_block` subtracts (`vfnmadd`: -(a · b) + c is fmadd(-a, b, c) bit for bit, signed
 * zeros too, so the sums are `q4l_scale`'s -(dmin · m) to the bit). */
static inline LANES512 __m512 q4k_minimum(const Linear *w, int64_t G, int64_t b, __m512 dmin) {
    const __m128i m = _mm_loadu_si128((const __m128i *)((const uint8_t *)w->mins + (G * (w->k / 32) + b) * 16));
    return _mm512_mul_ps(dmin, _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(m)));
}

/* Block g's 6-bit scales of 16 channels as int32 (Q4_K's `sub_scales`, kernels.h). */
static inline LANES512 __m512i q4k_subs(const Linear *w, int64_t G, int64_t g) {
    return _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)((const uint8_t *)w->scales + (G * (w->k / 32) + g) * 16)));
}

/* A block of a weight with Q4_K's scales into its super-block's sums `super` and `out` (kernels.h `sub_scales`): the
 * block's sums times its scales, - dmin · m (`q4k_minimum`) · (the block's int8 sum), then at the super-block's last
 * block its sums times d · the row's scale. */
static inline LANES512 void q4k_block(const Linear *w, int64_t G, int64_t b, const __m512i sums, __m512i *super,
                                      __m512 minimum, float sum8, float row_scale, __m512 *out) {
    const __m512i scaled = _mm512_mullo_epi32(sums, q4k_subs(w, G, b));
    *super = b % 8 ? _mm512_add_epi32(*super, scaled) : scaled;
    *out = _mm512_fnmadd_ps(minimum, _mm512_set1_ps(sum8), *out);
    if (b % 8 < 7) return;
    const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(w->supers + (G * (w->k / 256) + b / 8) * 32)));
    *out = _mm512_fmadd_ps(_mm512_cvtepi32_ps(*super), _mm512_mul_ps(d, _mm512_set1_ps(row_scale)), *out);
}

/* Row r's quad q of block b, broadcast to the 16 lanes. */
#define QUAD(r, q) _mm512_set1_epi32(((const int32_t *)(xq->b + (r0 + (r)) * k + b * 32))[q])
/* Row r's scale of block b, and offset · the sum of its 32 int8 inputs (`QuantizedRows.half`). */
#define ROW_SCALE(r) _mm512_set1_ps(xq->scale8[(r0 + (r)) * blocks + b])
#define BLOCK_SUM(r) (xq->half[(r0 + (r)) * (k / 16) + 2 * b] + xq->half[(r0 + (r)) * (k / 16) + 2 * b + 1])

/* Output channels 16G .. 16G + 15 of a Q4L weight for rows r0 .. r0 + R - 1 of xq (R ≤ LANES_TILE, a constant at
 * each call): per block, each quad vector gives two vectors of input quads (low and high nibbles)
 * that every row multiplies by its broadcast quad, the block's int32 sums then scaled for the 16 channels at once. */
static inline __attribute__((always_inline)) LANES512 void q4l_tile(const Linear *w, int64_t G, const QuantizedRows *xq,
                                                                    int64_t r0, const int R, float *y, int64_t ldy) {
    const int64_t k = w->k, blocks = k / 32, per_group = w->group / 32, groups = k / w->group;
    const uint8_t *qw = (const uint8_t *)w->weight + G * blocks * 256;
    const uint16_t *scales = (const uint16_t *)w->scales + G * groups * 16;
    const uint16_t *mins = w->mins ? w->mins + G * groups * 16 : NULL;
    const __m512i mask = _mm512_set1_epi8(0x0F);
    __m512 out[LANES_TILE], dmin = _mm512_setzero_ps();
    __m512i super[LANES_TILE];
    for (int r = 0; r < R; r++) out[r] = _mm512_setzero_ps(), super[r] = _mm512_setzero_si512();
    for (int64_t b = 0; b < blocks; b++) {
        if (R > 1) prefetch_ahead(qw + b * 256, 256, 1024); /* kernels.h `prefetch_ahead`: from 2 rows on */
        __m512i acc[LANES_TILE];
        for (int r = 0; r < R; r++) acc[r] = _mm512_setzero_si512();
        for (int m = 0; m < 4; m++) {
            const __m512i v = _mm512_loadu_si512(qw + b * 256 + m * 64);
            const __m512i low = _mm512_and_si512(v, mask), high = _mm512_and_si512(_mm512_srli_epi16(v, 4), mask);
            for (int r = 0; r < R; r++) {
                acc[r] = _mm512_dpbusd_epi32(acc[r], low, QUAD(r, m));
                acc[r] = _mm512_dpbusd_epi32(acc[r], high, QUAD(r, 4 + m));
            }
        }
        const int64_t g = b / per_group; /* the group's minimum term once, with its first block */
        __m512 d, mn;
        if (w->supers) { /* groups of 32: g is b */
            if (b % 8 == 0) dmin = q4k_dmin(w, G, b);
            mn = q4k_minimum(w, G, b, dmin);
            for (int r = 0; r < R; r++)
                q4k_block(w, G, b, acc[r], &super[r], mn, xq->sum8[(r0 + r) * groups + g], xq->scale8[(r0 + r) * blocks + b], &out[r]);
            continue;
        } else {
            d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(scales + g * 16)));
            mn = mins ? _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(mins + g * 16)))
                      : _mm512_mul_ps(d, _mm512_set1_ps(-8.0f));
        }
        for (int r = 0; r < R; r++) {
            out[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc[r]), _mm512_mul_ps(d, ROW_SCALE(r)), out[r]);
            if (b % per_group == 0) out[r] = _mm512_fmadd_ps(mn, _mm512_set1_ps(xq->sum8[(r0 + r) * groups + g]), out[r]);
        }
    }
    const __m512 bias = w->bias ? _mm512_loadu_ps(w->bias + G * 16) : _mm512_setzero_ps();
    for (int r = 0; r < R; r++) _mm512_storeu_ps(y + (r0 + r) * ldy + G * 16, _mm512_add_ps(out[r], bias));
}

/* `q4l_tile` for a Q5L weight (Q4_K's scales, or Q5_0's and Q5_1's per block): the nibbles as Q4L's, the fifth bits
 * of each quad vector's bytes tested in the block's planes (a byte mask) and added as 16 byte by byte. */
static inline __attribute__((always_inline)) LANES512 void q5l_tile(const Linear *w, int64_t G, const QuantizedRows *xq,
                                                                    int64_t r0, const int R, float *y, int64_t ldy) {
    const int64_t k = w->k, blocks = k / 32;
    const uint8_t *qw = (const uint8_t *)w->weight + G * blocks * 320;
    const __m512i mask = _mm512_set1_epi8(0x0F), sixteen = _mm512_set1_epi8(16);
    __m512 out[LANES_TILE], dmin = _mm512_setzero_ps();
    __m512i super[LANES_TILE];
    for (int r = 0; r < R; r++) out[r] = _mm512_setzero_ps(), super[r] = _mm512_setzero_si512();
    for (int64_t b = 0; b < blocks; b++) {
        if (R > 1) prefetch_ahead(qw + b * 320, 320, 1024);
        __m512i acc[LANES_TILE];
        for (int r = 0; r < R; r++) acc[r] = _mm512_setzero_si512();
        const uint8_t *block = qw + b * 320;
        const __m512i planes = _mm512_loadu_si512(block + Q5L_PLANES);
        for (int m = 0; m < 4; m++) { /* quad m's fifth bits: the planes' bit m (low nibbles), 4 + m (high) */
            const __m512i v = _mm512_loadu_si512(block + Q5L_QUADS + m * 64);
            const __mmask64 lo = _mm512_test_epi8_mask(planes, _mm512_set1_epi8((char)(1 << m)));
            const __mmask64 hi = _mm512_test_epi8_mask(planes, _mm512_set1_epi8((char)(16 << m)));
            const __m512i nibbles = _mm512_and_si512(v, mask), upper = _mm512_and_si512(_mm512_srli_epi16(v, 4), mask);
            const __m512i low = _mm512_mask_add_epi8(nibbles, lo, nibbles, sixteen);
            const __m512i high = _mm512_mask_add_epi8(upper, hi, upper, sixteen);
            for (int r = 0; r < R; r++) {
                acc[r] = _mm512_dpbusd_epi32(acc[r], low, QUAD(r, m));
                acc[r] = _mm512_dpbusd_epi32(acc[r], high, QUAD(r, 4 + m));
            }
        }
        __m512 d, mn;
        if (w->supers) {
            if (b % 8 == 0) dmin = q4k_dmin(w, G, b);
            mn = q4k_minimum(w, G, b, dmin);
            for (int r = 0; r < R; r++)
                q4k_block(w, G, b, acc[r], &super[r], mn, xq->sum8[(r0 + r) * blocks + b], xq->scale8[(r0 + r) * blocks + b], &out[r]);
            continue;
        } else { /* Q5_0, Q5_1: a float16 scale and minimum per block */
            d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)((const uint16_t *)w->scales + (G * blocks + b) * 16)));
            mn = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(w->mins + (G * blocks + b) * 16)));
        }
        for (int r = 0; r < R; r++) {
            out[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc[r]), _mm512_mul_ps(d, ROW_SCALE(r)), out[r]);
            out[r] = _mm512_fmadd_ps(mn, _mm512_set1_ps(xq->sum8[(r0 + r) * blocks + b]), out[r]);
        }
    }
    const __m512 bias = w->bias ? _mm512_loadu_ps(w->bias + G * 16) : _mm512_setzero_ps();
    for (int r = 0; r < R; r++) _mm512_storeu_ps(y + (r0 + r) * ldy + G * 16, _mm512_add_ps(out[r], bias));
}

/* `q4l_tile` for an IQ4L weight: each index looked up in the grid + 128 (`vpshufb`, the 16 values in every 128-bit
 * lane), then the same products less 128 · the block's inputs, times its ls - 32 into the super-block's sums, scaled
 * by d · the row's scale after its last block (kernels.h `sub_scales`). */
static inline __attribute__((always_inline)) LANES512 void iq4l_tile(const Linear *w, int64_t G, const QuantizedRows *xq,
                                                                     int64_t r0, const int R, float *y, int64_t ldy) {
    const int64_t k = w->k, blocks = k / 32;
    const uint8_t *qw = (const uint8_t *)w->weight + G * blocks * 256;
    const int8_t *sc = (const int8_t *)w->scales + G * blocks * 16;
    const uint16_t *d = w->supers + G * (k / 256) * 16;
    const __m512i mask = _mm512_set1_epi8(0x0F);
    const __m512i grid = _mm512_xor_si512(_mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i *)IQ4_VALUES)),
                                          _mm512_set1_epi8((char)0x80)); /* + 128 as u8 */
    __m512 out[LANES_TILE];
    __m512i super[LANES_TILE];
    for (int r = 0; r < R; r++) out[r] = _mm512_setzero_ps(), super[r] = _mm512_setzero_si512();
    for (int64_t b = 0; b < blocks; b++) {
        if (R > 1) prefetch_ahead(qw + b * 256, 256, 1024);
        __m512i acc[LANES_TILE];
        for (int r = 0; r < R; r++) acc[r] = _mm512_set1_epi32(-128 * BLOCK_SUM(r));
        for (int m = 0; m < 4; m++) {
            const __m512i v = _mm512_loadu_si512(qw + b * 256 + m * 64);
            const __m512i low = _mm512_shuffle_epi8(grid, _mm512_and_si512(v, mask));
            const __m512i high = _mm512_shuffle_epi8(grid, _mm512_and_si512(_mm512_srli_epi16(v, 4), mask));
            for (int r = 0; r < R; r++) {
                acc[r] = _mm512_dpbusd_epi32(acc[r], low, QUAD(r, m));
                acc[r] = _mm512_dpbusd_epi32(acc[r], high, QUAD(r, 4 + m));
            }
        }
        const __m512i subs = _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(sc + b * 16)));
        for (int r = 0; r < R; r++) super[r] = _mm512_add_epi32(super[r], _mm512_mullo_epi32(acc[r], subs));
        if (b % 8 < 7) continue;
        const __m512 scale = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(d + b / 8 * 16)));
        for (int r = 0; r < R; r++) {
            out[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(super[r]), _mm512_mul_ps(scale, ROW_SCALE(r)), out[r]);
            super[r] = _mm512_setzero_si512();
        }
    }
    const __m512 bias = w->bias ? _mm512_loadu_ps(w->bias + G * 16) : _mm512_setzero_ps();
    for (int r = 0; r < R; r++) _mm512_storeu_ps(y + (r0 + r) * ldy + G * 16, _mm512_add_ps(out[r], bias));
}

/* `q4l_tile` for a Q8L weight: each quad vector + 128 (a sign flip) as u8, less 128 · the block's inputs. */
static inline __attribute__((always_inline)) LANES512 void q8l_tile(const Linear *w, int64_t G, const QuantizedRows *xq,
                                                                    int64_t r0, const int R, float *y, int64_t ldy) {
    const int64_t k = w->k, blocks = k / 32, first = G * blocks;
    const uint8_t *qw = (const uint8_t *)w->weight + first * 512;
    const uint16_t *scales = (const uint16_t *)w->scales + first * 16;
    const __m512i flip = _mm512_set1_epi8((char)0x80);
    __m512 out[LANES_TILE];
    for (int r = 0; r < R; r++) out[r] = _mm512_setzero_ps();
    for (int64_t b = 0; b < blocks; b++) {
        if (R > 1) prefetch_ahead(qw + b * 512, 512, 1024);
        __m512i acc[LANES_TILE];
        for (int r = 0; r < R; r++) acc[r] = _mm512_set1_epi32(-128 * BLOCK_SUM(r));
        for (int m = 0; m < 8; m++) {
            const __m512i quad = _mm512_xor_si512(_mm512_loadu_si512(qw + b * 512 + m * 64), flip);
            for (int r = 0; r < R; r++) acc[r] = _mm512_dpbusd_epi32(acc[r], quad, QUAD(r, m));
        }
        const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(scales + b * 16)));
        for (int r = 0; r < R; r++)
            out[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc[r]), _mm512_mul_ps(d, ROW_SCALE(r)), out[r]);
    }
    const __m512 bias = w->bias ? _mm512_loadu_ps(w->bias + G * 16) : _mm512_setzero_ps();
    for (int r = 0; r < R; r++) _mm512_storeu_ps(y + (r0 + r) * ldy + G * 16, _mm512_add_ps(out[r], bias));
}

/* `q4l_tile` for a Q6L weight: the low 4 bits as Q4L's, and each high-bits vector holds two quad vectors' high
 * bits, moved to bits 4-5 of their bytes by one shift each. The low nibbles (inputs 0..15) and high ones (16..31) are
 * Q6_K's two sub-blocks of 16, so each keeps its own int32 sums, less 32 · its inputs' sum, times its own sc into the
 * super-block's sums, scaled by d · the row's scale after its last block (kernels.h `sub_scales`). */
static inline __attribute__((always_inline)) LANES512 void q6l_tile(const Linear *w, int64_t G, const QuantizedRows *xq,
                                                                    int64_t r0, const int R, float *y, int64_t ldy) {
    const int64_t k = w->k, blocks = k / 32;
    const uint8_t *qw = (const uint8_t *)w->weight + G * blocks * 384;
    const int8_t *sc = (const int8_t *)w->scales + G * (k / 16) * 16;
    const uint16_t *d = w->supers + G * (k / 256) * 16;
    const __m512i low4 = _mm512_set1_epi8(0x0F), high2 = _mm512_set1_epi8(0x30);
    __m512 out[LANES_TILE];
    __m512i super[LANES_TILE];
    for (int r = 0; r < R; r++) out[r] = _mm512_setzero_ps(), super[r] = _mm512_setzero_si512();
    for (int64_t b = 0; b < blocks; b++) {
        __m512i lo[LANES_TILE], hi[LANES_TILE]; /* each sub-block's sums */
        for (int r = 0; r < R; r++) {
            const int32_t *half = xq->half + (r0 + r) * (k / 16) + 2 * b;
            lo[r] = _mm512_set1_epi32(-32 * half[0]), hi[r] = _mm512_set1_epi32(-32 * half[1]);
        }
        const uint8_t *block = qw + b * 384;
        /* The hardware's prefetch alone fell behind this loop once its blocks were stored in quad order: from
         * memory, a 1.7B file's projections read 39-41 GB/s against 43-44 before; fetched 1 KiB ahead, 47-48. */
        prefetch_ahead(block, 384, 1024);
        for (int m = 0; m < 4; m++) {
            const __m512i v = _mm512_loadu_si512(block + m * 64), bits = _mm512_loadu_si512(block + 256 + m / 2 * 64);
            /* even m: bits 4-5 and 6-7 (the latter shifted down by 2); odd m: bits 0-1 and 2-3, shifted up */
            const __m512i first = _mm512_and_si512(m % 2 ? _mm512_slli_epi16(bits, 4) : bits, high2);
            const __m512i second = _mm512_and_si512(m % 2 ? _mm512_slli_epi16(bits, 2) : _mm512_srli_epi16(bits, 2), high2);
            const __m512i low = _mm512_ternarylogic_epi32(v, low4, first, 0xEA); /* (v & 0x0F) | first */
            const __m512i high = _mm512_ternarylogic_epi32(_mm512_srli_epi16(v, 4), low4, second, 0xEA);
            for (int r = 0; r < R; r++) {
                lo[r] = _mm512_dpbusd_epi32(lo[r], low, QUAD(r, m));
                hi[r] = _mm512_dpbusd_epi32(hi[r], high, QUAD(r, 4 + m));
            }
        }
        const __m128i *subs = (const __m128i *)(sc + 2 * b * 16);
        const __m512i first = _mm512_cvtepi8_epi32(_mm_loadu_si128(subs)), second = _mm512_cvtepi8_epi32(_mm_loadu_si128(subs + 1));
        for (int r = 0; r < R; r++)
            super[r] = _mm512_add_epi32(super[r], _mm512_add_epi32(_mm512_mullo_epi32(lo[r], first), _mm512_mullo_epi32(hi[r], second)));
        if (b % 8 < 7) continue;
        const __m512 scale = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(d + b / 8 * 16)));
        for (int r = 0; r < R; r++) {
            out[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(super[r]), _mm512_mul_ps(scale, ROW_SCALE(r)), out[r]);
            super[r] = _mm512_setzero_si512();
        }
    }
    const __m512 bias = w->bias ? _mm512_loadu_ps(w->bias + G * 16) : _mm512_setzero_ps();
    for (int r = 0; r < R; r++) _mm512_storeu_ps(y + (r0 + r) * ldy + G * 16, _mm512_add_ps(out[r], bias));
}
#undef QUAD
#undef ROW_SCALE
#undef BLOCK_SUM

#define LANES_PASSES(tile_fn)                                                                                \
    for (int64_t r0 = 0; r0 < rows; r0 += LANES_TILE) {                                                    \
        switch (rows - r0 < LANES_TILE ? rows - r0 : LANES_TILE) {                                         \
        case 4: tile_fn(w, G, xq, r0, 4, y, ldy); break;                                                   \
        case 3: tile_fn(w, G, xq, r0, 3, y, ldy); break;                                                   \
        case 2: tile_fn(w, G, xq, r0, 2, y, ldy); break;                                                   \
        default: tile_fn(w, G, xq, r0, 1, y, ldy);                                                         \
        }                                                                                                  \
    }

/* Output channels j0 .. j1 - 1 (multiples of 16) of a weight in lanes for every row quantized in xq, LANES_TILE rows
 * a pass (the table's `quantized_rows`). */
LANES512 void q4l_rows(const Linear *w, const QuantizedRows *xq, int64_t rows, int64_t j0, int64_t j1, float *y,
                     int64_t ldy) {
    for (int64_t G = j0 / 16; G < j1 / 16; G++) LANES_PASSES(q4l_tile)
}

LANES512 void q8l_rows(const Linear *w, const QuantizedRows *xq, int64_t rows, int64_t j0, int64_t j1, float *y,
                     int64_t ldy) {
    for (int64_t G = j0 / 16; G < j1 / 16; G++) LANES_PASSES(q8l_tile)
}

LANES512 void q6l_rows(const Linear *w, const QuantizedRows *xq, int64_t rows, int64_t j0, int64_t j1, float *y,
                     int64_t ldy) {
    for (int64_t G = j0 / 16; G < j1 / 16; G++) LANES_PASSES(q6l_tile)
}

LANES512 void q5l_rows(const Linear *w, const QuantizedRows *xq, int64_t rows, int64_t j0, int64_t j1, float *y,
                     int64_t ldy) {
    for (int64_t G = j0 / 16; G < j1 / 16; G++) LANES_PASSES(q5l_tile)
}

LANES512 void iq4l_rows(const Linear *w, const QuantizedRows *xq, int64_t rows, int64_t j0, int64_t j1, float *y,
                      int64_t ldy) {
    for (int64_t G = j0 / 16; G < j1 / 16; G++) LANES_PASSES(iq4l_tile)
}
#undef LANES_PASSES
