/* The lanes kernels on AVX2 CPUs, for the weight types that only have a lanes layout (Q5L: Q5_K, Q5_0, Q5_1; IQ4L:
 * IQ4_XS): without them those types were requantized to int8 per channel on such CPUs. A unit of 32 bytes widened to
 * int16 is two vectors of 16 (channels 16G .. 16G + 7, then + 8 .. + 15, each an input pair), `vpmaddwd` with the
 * row's pair broadcast gives each channel's pair sum in its int32 lane (AVX-512's `vpdpwssd`, without the add), and
 * every float operation is lane by lane the AVX-512 tile's: a row's outputs have the same bits on either CPU
 * (tests/unit/test_weight_types.py holds them equal). */
#include "kernels.h"

/* Rows a pass: 4 rows × 2 halves of int32 sums and float outputs in AVX2's 16 registers, with the weights beside. */
#define AVX2_TILE 4

/* AVX-512 for the lanes tiles where the CPU has it: -1 (the default) the CPU's answer, 0 the AVX2 tiles (tests). */
int kettle_lanes_avx512 = -1;

/* Lane i of 16 int16: 16 where bit i of `bits` is set, else 0 (a unit half's fifth bits). */
static inline __m256i fifth_bits(uint32_t bits) {
    const __m256i lanes = _mm256_setr_epi16(1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, -32768);
    const __m256i set = _mm256_cmpeq_epi16(_mm256_and_si256(_mm256_set1_epi16((short)bits), lanes), lanes);
    return _mm256_and_si256(set, _mm256_set1_epi16(16));
}

/* The block's int16 values of channel half h (8 channels × an input pair) for unit u: low (inputs 2u + e) and high
 * (16 + 2u + e), as `q5l_tile` widens them. */
static inline void q5l_half(const uint8_t *block, int u, int h, __m256i *low, __m256i *high) {
    const __m256i bytes = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)(block + u * 32 + 16 * h)));
    uint32_t masks[2];
    memcpy(masks, block + 256 + 8 * u, 8);
    const __m256i mask = _mm256_set1_epi16(0x0F);
    *low = _mm256_add_epi16(_mm256_and_si256(bytes, mask), fifth_bits(masks[0] >> 16 * h));
    *high = _mm256_add_epi16(_mm256_srli_epi16(bytes, 4), fifth_bits(masks[1] >> 16 * h));
}

/* The scale and minimum of block b for channel half h of group G of a Q5L weight, 8 lanes: Q4_K's d · sc and
 * -(dmin · m) (as `q4k_lanes`), or the float16 table's. */
static inline void q5l_scales(const Linear *w, int64_t G, int64_t b, int h, __m256 *d, __m256 *m) {
    const int64_t blocks = w->k / 32, at = (G * blocks + b) * 16 + 8 * h;
    if (!w->supers) {
        *d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)((const uint16_t *)w->scales + at)));
        *m = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(w->mins + at)));
        return;
    }
    const uint16_t *super = w->supers + (G * (blocks / 8) + b / 8) * 32 + 8 * h;
    const __m256 sc = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)((const uint8_t *)w->scales + at))));
    const __m256 mn = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)((const uint8_t *)w->mins + at))));
    *d = _mm256_mul_ps(_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)super)), sc);
    const __m256 product = _mm256_mul_ps(_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(super + 16))), mn);
    *m = _mm256_xor_ps(product, _mm256_set1_ps(-0.0f)); /* -(dmin · m) bit for bit, zeros too */
}

/* `q5l_tile` on AVX2: output channels 16G .. 16G + 15 for rows r0 .. r0 + R - 1 (R ≤ AVX2_TILE, a constant). */
static inline __attribute__((always_inline)) void q5l_tile_avx2(const Linear *w, int64_t G, const QuantizedRows *xq,
                                                                int64_t r0, const int R, float *y, int64_t ldy) {
    const int64_t k = w->k, blocks = k / 32;
    const uint8_t *qw = (const uint8_t *)w->weight + G * blocks * 320;
    __m256 out[AVX2_TILE][2];
    for (int r = 0; r < R; r++) out[r][0] = out[r][1] = _mm256_setzero_ps();
    for (int64_t b = 0; b < blocks; b++) {
        for (int h = 0; h < 2; h++) {
            __m256i acc[AVX2_TILE];
            for (int r = 0; r < R; r++) acc[r] = _mm256_setzero_si256();
            for (int u = 0; u < 8; u++) {
                __m256i low, high;
                q5l_half(qw + b * 320, u, h, &low, &high);
                for (int r = 0; r < R; r++) {
                    const int32_t *pairs = (const int32_t *)(xq->q + (r0 + r) * k + b * 32);
                    acc[r] = _mm256_add_epi32(acc[r], _mm256_madd_epi16(low, _mm256_set1_epi32(pairs[u])));
                    acc[r] = _mm256_add_epi32(acc[r], _mm256_madd_epi16(high, _mm256_set1_epi32(pairs[u + 8])));
                }
            }
            __m256 d, m;
            q5l_scales(w, G, b, h, &d, &m);
            for (int r = 0; r < R; r++) {
                const __m256 combined = _mm256_mul_ps(d, _mm256_set1_ps(xq->scale[(r0 + r) * blocks + b]));
                out[r][h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(acc[r]), combined, out[r][h]);
                out[r][h] = _mm256_fmadd_ps(m, _mm256_set1_ps(xq->sum[(r0 + r) * blocks + b]), out[r][h]);
            }
        }
    }
    for (int h = 0; h < 2; h++) {
        const __m256 bias = w->bias ? _mm256_loadu_ps(w->bias + G * 16 + 8 * h) : _mm256_setzero_ps();
        for (int r = 0; r < R; r++) _mm256_storeu_ps(y + (r0 + r) * ldy + G * 16 + 8 * h, _mm256_add_ps(out[r][h], bias));
    }
}

/* `iq4l_tile` on AVX2: the indices of a unit half looked up in the grid with `pshufb`, then as `q5l_tile_avx2`. */
static inline __attribute__((always_inline)) void iq4l_tile_avx2(const Linear *w, int64_t G, const QuantizedRows *xq,
                                                                 int64_t r0, const int R, float *y, int64_t ldy) {
    const int64_t k = w->k, blocks = k / 32;
    const uint8_t *qw = (const uint8_t *)w->weight + G * blocks * 256;
    const int8_t *sc = (const int8_t *)w->scales + G * blocks * 16;
    const uint16_t *d = w->supers + G * (k / 256) * 16;
    const __m128i grid = _mm_loadu_si128((const __m128i *)IQ4_VALUES), mask = _mm_set1_epi8(0x0F);
    __m256 out[AVX2_TILE][2];
    for (int r = 0; r < R; r++) out[r][0] = out[r][1] = _mm256_setzero_ps();
    for (int64_t b = 0; b < blocks; b++) {
        for (int h = 0; h < 2; h++) {
            __m256i acc[AVX2_TILE];
            for (int r = 0; r < R; r++) acc[r] = _mm256_setzero_si256();
            for (int u = 0; u < 8; u++) {
                const __m128i bytes = _mm_loadu_si128((const __m128i *)(qw + b * 256 + u * 32 + 16 * h));
                const __m256i low = _mm256_cvtepi8_epi16(_mm_shuffle_epi8(grid, _mm_and_si128(bytes, mask)));
                const __m256i high = _mm256_cvtepi8_epi16(_mm_shuffle_epi8(grid, _mm_and_si128(_mm_srli_epi16(bytes, 4), mask)));
                for (int r = 0; r < R; r++) {
                    const int32_t *pairs = (const int32_t *)(xq->q + (r0 + r) * k + b * 32);
                    acc[r] = _mm256_add_epi32(acc[r], _mm256_madd_epi16(low, _mm256_set1_epi32(pairs[u])));
                    acc[r] = _mm256_add_epi32(acc[r], _mm256_madd_epi16(high, _mm256_set1_epi32(pairs[u + 8])));
                }
            }
            const __m256 scale = _mm256_mul_ps(_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(d + b / 8 * 16 + 8 * h))),
                                               _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(sc + b * 16 + 8 * h)))));
            for (int r = 0; r < R; r++) {
                const __m256 combined = _mm256_mul_ps(scale, _mm256_set1_ps(xq->scale[(r0 + r) * blocks + b]));
                out[r][h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(acc[r]), combined, out[r][h]);
            }
        }
    }
    for (int h = 0; h < 2; h++) {
        const __m256 bias = w->bias ? _mm256_loadu_ps(w->bias + G * 16 + 8 * h) : _mm256_setzero_ps();
        for (int r = 0; r < R; r++) _mm256_storeu_ps(y + (r0 + r) * ldy + G * 16 + 8 * h, _mm256_add_ps(out[r][h], bias));
    }
}

#define AVX2_PASSES(tile_fn)                                                                                 \
    for (int64_t r0 = 0; r0 < rows; r0 += AVX2_TILE) {                                                     \
        switch (rows - r0 < AVX2_TILE ? rows - r0 : AVX2_TILE) {                                           \
        case 4: tile_fn(w, G, xq, r0, 4, y, ldy); break;                                                   \
        case 3: tile_fn(w, G, xq, r0, 3, y, ldy); break;                                                   \
        case 2: tile_fn(w, G, xq, r0, 2, y, ldy); break;                                                   \
        default: tile_fn(w, G, xq, r0, 1, y, ldy);                                                         \
        }                                                                                                  \
    }

void q5l_rows_avx2(const Linear *w, const QuantizedRows *xq, int64_t rows, int64_t j0, int64_t j1, float *y,
                   int64_t ldy) {
    for (int64_t G = j0 / 16; G < j1 / 16; G++) AVX2_PASSES(q5l_tile_avx2)
}

void iq4l_rows_avx2(const Linear *w, const QuantizedRows *xq, int64_t rows, int64_t j0, int64_t j1, float *y,
                    int64_t ldy) {
    for (int64_t G = j0 / 16; G < j1 / 16; G++) AVX2_PASSES(iq4l_tile_avx2)
}
#undef AVX2_PASSES
