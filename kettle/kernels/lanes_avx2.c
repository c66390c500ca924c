/* The lanes kernels on AVX2 CPUs: tiles for every lanes type (weight_types.c's `quantized_rows_avx2`), so that
 * Q4_0, Q4_1, Q4_K and int4, Q8_0, IQ4_XS, Q6_K and Q5_* are held in lanes with int8 rows on any AVX2 CPU. A unit of
 * 64 bytes (a quad vector, kernels.h) is two halves of 32 (channels 16G .. 16G + 7, then + 8 .. + 15), each channel's
 * quad in its 32-bit lane (lanes.c). `vpmaddubsw` (an unsigned byte times a signed one, pairs summed into int16) then
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
 * (gemm.c), fewer these tiles: int8 rows with these tiles' bits (Q4_K_M's prefill 52.3 → 84.3 tok/s). Q6L's and
 * Q5L's first tiles lost to requantizing them to Q8_0's blocks (Q6_K 19.6 against 20.5 tok/s, Q5_K_M 15.3 against
 * 18.3) while they interleaved unit pairs in the loop; stored in quad order (kernels.h) they read the file's own
 * bits as fast or faster: a 1.7B Q6_K file decodes at 28-30 tok/s against 25-31 in Q8_0's blocks, its prompts 78-82
 * against 73 with `vpmaddubsw` (99-103 against 120 with VNNI-256); a Q4_K_M file's Q6_K parts 39-41 against 27-33;
 * Q5_K_M 1.28-1.45x llama.cpp's AVX2 build against 0.96-1.42x with `vpmaddubsw`, 1.44-1.61x against 1.59x with
 * VNNI-256 (prompts 1.27-1.34x against 1.21x, 1.85-1.98x against 2.12x).
 *
 * The tiles themselves are lanes_avx2_tiles.h, compiled once per form of the u8 × s8 dot-product step (kernels.h,
 * `avx2_dot`): `vpmaddubsw` + `vpmaddwd` on plain AVX2, one `vpdpbusd ymm` where the CPU has AVX-VNNI (VEX) or
 * AVX512-VNNI + VL (EVEX), the same exact sums and so the same bits; q4l_rows_avx2 and the others pick one per call. */
#include "kernels.h"

/* Rows a pass: 4 rows × 2 halves of int32 sums and float outputs in AVX2's 16 registers, with the weights beside. */
#define AVX2_TILE 4

/* AVX-512 for the lanes tiles where the CPU has it: -1 (the default) the CPU's answer, 0 the AVX2 ones (tests). */
int kettle_lanes_avx512 = -1;

/* ---- Q4L and Q8L: both halves of a quad vector at once ----
 * Q4's q are unsigned: `vpmaddubsw` multiplies them with the signed quads directly, and its pair sums add in int16
 * over the whole block (at most 15 · 128 · 2 · 8 < 2^15), then one `vpmaddwd` by ones (`vpdpbusd` sums them in int32
 * at once): exact integers, the AVX-512 tile's block sums. */

/* 16 channels' float16 values (a table's row of 16) as floats, 8 a half. */
static inline void lanes_ph(const uint16_t *p, __m256 out[2]) {
    out[0] = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p));
    out[1] = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(p + 8)));
}

/* 16 channels' unsigned bytes as floats, 8 a half, exact. */
static inline void lanes_bytes(const uint8_t *p, __m256 out[2]) {
    out[0] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)p)));
    out[1] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(p + 8))));
}

/* out + bias into channels 16G .. 16G + 15 of y's row. */
static inline void store_lanes(const __m256 out[2], const float *bias, float *y) {
    _mm256_storeu_ps(y, _mm256_add_ps(out[0], bias ? _mm256_loadu_ps(bias) : _mm256_setzero_ps()));
    _mm256_storeu_ps(y + 8, _mm256_add_ps(out[1], bias ? _mm256_loadu_ps(bias + 8) : _mm256_setzero_ps()));
}

/* Q4_K's scales for the AVX2 tiles, in halves, each super-block's part read once for its 8 groups (as lanes.c's
 * `q4k_dmin`): d and -dmin of the super-block holding group g (`q4k_super_avx2`, at g % 8 == 0), then d · sc and
 * -dmin · m of group g (`q4k_group_avx2`): the same products, since -dmin · m is -(dmin · m) to the bit. Per group
 * the float16 conversions and the sign flip had cost the tiles a quarter of their time at 4 rows (Zen 3, one thread,
 * 1,024 × 2,048 Q4_K in cache, alternated: 4 rows 152 → 162 GOP/s, 2 rows 114 → 140, 1 row 110 → 116). */
static inline void q4k_super_avx2(const Linear *w, int64_t G, int64_t g, __m256 d[2], __m256 negative_dmin[2]) {
    const uint16_t *super = w->supers + (G * (w->k / 256) + g / 8) * 32;
    lanes_ph(super, d);
    lanes_ph(super + 16, negative_dmin);
    for (int h = 0; h < 2; h++) negative_dmin[h] = _mm256_xor_ps(negative_dmin[h], _mm256_set1_ps(-0.0f));
}

static inline void q4k_group_avx2(const Linear *w, int64_t G, int64_t g, const __m256 d[2],
                                  const __m256 negative_dmin[2], __m256 scale[2], __m256 minimum[2]) {
    const int64_t at = (G * (w->k / 32) + g) * 16;
    __m256 sc[2], m[2];
    lanes_bytes((const uint8_t *)w->scales + at, sc);
    lanes_bytes((const uint8_t *)w->mins + at, m);
    for (int h = 0; h < 2; h++) {
        scale[h] = _mm256_mul_ps(d[h], sc[h]);
        minimum[h] = _mm256_mul_ps(negative_dmin[h], m[h]);
    }
}

/* Block g's 6-bit scales of 16 channels as int16 pairs (`block_scaled`), 8 a half: Q4_K's `sub_scales`. One shuffle
 * a half puts each channel's byte in both halves of its lane (widening, shifting and or-ing it cost the one-row tile
 * 5% in cache). */
static inline void q4k_pairs_avx2(const Linear *w, int64_t G, int64_t g, __m256i pair[2]) {
    const __m256i bytes = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)((const uint8_t *)w->scales + (G * (w->k / 32) + g) * 16)));
    const char z = (char)0x80; /* a zero byte */
    pair[0] = _mm256_shuffle_epi8(bytes, _mm256_setr_epi8(0, z, 0, z, 1, z, 1, z, 2, z, 2, z, 3, z, 3, z,
                                                          4, z, 4, z, 5, z, 5, z, 6, z, 6, z, 7, z, 7, z));
    pair[1] = _mm256_shuffle_epi8(bytes, _mm256_setr_epi8(8, z, 8, z, 9, z, 9, z, 10, z, 10, z, 11, z, 11, z,
                                                          12, z, 12, z, 13, z, 13, z, 14, z, 14, z, 15, z, 15, z));
}

/* 16 IQ4L channels' ls - 32 of a block (`sc`) as int16 pairs (`block_scaled`), 8 a half: its `sub_scales`. */
static inline void iq4l_pairs_avx2(const int8_t *sc, __m256i pair[2]) {
    for (int h = 0; h < 2; h++) {
        const __m256i v = _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(sc + 8 * h)));
        pair[h] = _mm256_or_si256(_mm256_and_si256(v, _mm256_set1_epi32(0xFFFF)), _mm256_slli_epi32(v, 16));
    }
}

/* 8 Q6L channels' sc of a block's two sub-blocks (`sc`: the first's, the second's 16 bytes on) as int16 pairs
 * (`block_scaled`), and 32 · (sc₀, sc₁) as one pair: its `sub_scales`. */
static inline void q6l_pairs_avx2(const int8_t *sc, __m256i pair[3]) {
    const __m128i first = _mm_loadl_epi64((const __m128i *)sc), second = _mm_loadl_epi64((const __m128i *)(sc + 16));
    pair[0] = _mm256_cvtepi8_epi16(_mm_unpacklo_epi8(first, first));
    pair[1] = _mm256_cvtepi8_epi16(_mm_unpacklo_epi8(second, second));
    pair[2] = _mm256_slli_epi16(_mm256_cvtepi8_epi16(_mm_unpacklo_epi8(first, second)), 5);
}

/* Row r's quad q of block b, broadcast; its scale of block b. */
#define QUAD(r, q) _mm256_set1_epi32(((const int32_t *)(xq->b + (r0 + (r)) * k + b * 32))[q])
#define ROW_SCALE(r) _mm256_set1_ps(xq->scale8[(r0 + (r)) * blocks + b])
#define AVX2_PASSES(tile_fn)                                                                                 \
    for (int64_t r0 = 0; r0 < rows; r0 += AVX2_TILE) {                                                     \
        switch (rows - r0 < AVX2_TILE ? rows - r0 : AVX2_TILE) {                                           \
        case 4: tile_fn(w, G, xq, r0, 4, y, ldy); break;                                                   \
        case 3: tile_fn(w, G, xq, r0, 3, y, ldy); break;                                                   \
        case 2: tile_fn(w, G, xq, r0, 2, y, ldy); break;                                                   \
        default: tile_fn(w, G, xq, r0, 1, y, ldy);                                                         \
        }                                                                                                  \
    }

/* Whether a tile of R rows sums each block in two chains: `vpdpbusd` adds into its accumulator (latency ~4-5 cycles,
 * where vpmaddubsw's products are summed apart and added in 1), so at one or two rows a block's 8-16 steps into one
 * accumulator waited on each other (a 1.7B Q4_K_M decode 0.97x of vpmaddubsw with one chain). Exact integers either
 * way: the same bits. The vpmaddubsw form keeps one. */
#define AVX2_CHAINS(R) (AVX2_ACCUMULATES && (R) <= 2)

#define AVX2_TEMPLATE "lanes_avx2_tiles.h"
#include "avx2_forms.h"
#undef QUAD
#undef ROW_SCALE
#undef AVX2_PASSES
#undef AVX2_CHAINS

/* The tiles' entry points (the weight table's `quantized_rows_avx2`): the form this CPU runs (`avx2_dot`). */
#define AVX2_ROWS(name)                                                                                            \
    void name##_avx2(const Linear *w, const QuantizedRows *xq, int64_t rows, int64_t j0, int64_t j1, float *y,    \
                     int64_t ldy) {                                                                               \
        switch (avx2_dot()) {                                                                                      \
        case AVX2_DOT_AVXVNNI: name##_avxvnni(w, xq, rows, j0, j1, y, ldy); break;                                 \
        case AVX2_DOT_VNNI256: name##_vnni256(w, xq, rows, j0, j1, y, ldy); break;                                 \
        default: name##_maddubs(w, xq, rows, j0, j1, y, ldy);                                                      \
        }                                                                                                          \
    }
AVX2_ROWS(iq4l_rows)
AVX2_ROWS(q4l_rows)
AVX2_ROWS(q8l_rows)
AVX2_ROWS(q6l_rows)
AVX2_ROWS(q5l_rows)
#undef AVX2_ROWS
