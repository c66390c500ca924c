/* The lanes kernels on AVX2 CPUs, for IQ4_XS (IQ4L), which has no other layout: without them the type could not be
 * served on such CPUs. A unit of 32 bytes is two halves of 16 (channels 16G .. 16G + 7, then + 8 .. + 15); two units'
 * halves interleaved byte by byte give each channel its quad (lanes.c), the grid values are looked up signed, and
 * `vpmaddubsw` (|w| times the input with w's sign, pairs into int16: at most 2 · 127 · 127, no saturation) then
 * `vpmaddwd` by ones give each channel's quad sum in its int32 lane: the integer sums of AVX-512's `vpdpbusd` over w +
 * 128 less 128 · the inputs' sum, exactly, and every float operation is lane by lane the AVX-512 tile's: a row's
 * outputs have the same bits on either CPU (tests/unit/test_weight_types.py holds them equal). The 5-bit types' AVX2
 * tile ran 1.7x slower than int8 per channel on AVX2 (a 1.7B Q5_K_M file: 87 against 45-55 ms a step, its fifth bits
 * expanded per half unit): there they keep the nearest scheme. */
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
#undef AVX2_PASSES
