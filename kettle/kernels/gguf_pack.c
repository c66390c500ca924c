/* GGUF blocks packed straight into the kernels' layouts at load, 16 output channels a unit of work over all threads:
 * the table's `pack` (weight_types.c). A 1.7B Q4_K_M file's weights went through numpy and tensor-op reshuffles
 * before (5.4 of its 6.6 s load here, one pass of the whole file's bytes per reshuffle); here each block is read once
 * and each output byte written once.
 *
 * GGUF's blocks (gguf-py's quants.py, ggml-quants.c):
 * - Q6_K, 210 bytes a 256 inputs: ql[128], qh[64], scales[16] int8, d float16. Inputs 128h + 32i + l (h, i in 0..1
 *   .. 0..3, l in 0..31): low 4 bits in ql[64h + l + 32 (i % 2)] (low nibble for i < 2, high nibble else), high 2
 *   bits at bit 2i of qh[32h + l]; input 16s .. 16s + 15 scaled by scales[s]. w = d · scale · (q - 32).
 * - Q4_K, 144 bytes a 256 inputs: d, dmin float16, 12 bytes of 6-bit (sc, m) for 8 sub-blocks of 32, qs[128]:
 *   inputs 64j + l in the low nibbles of qs[32j + l], 64j + 32 + l in the high ones. w = d · sc · q - dmin · m.
 * - Q5_K, 176 bytes a 256 inputs: Q4_K's d, dmin and 12 scale bytes, qh[32], then Q4_K's qs[128]: the fifth bit of
 *   input 32i + l (sub-block i) is bit i of qh[l]. q in 0..31.
 * - Q4_0 (18 bytes a 32 inputs: d float16, qs[16]; w = d · (q - 8)) and Q4_1 (20 bytes: d, m float16, qs; w = d · q
 *   + m): input l < 16 in the low nibble of qs[l], 16 + l in its high one, exactly a Q4L unit's byte pair order.
 * - Q8_0 (34 bytes a 32 inputs: d float16, qs[32] int8; w = d · q).
 * - Q5_0 (22 bytes a 32 inputs: d float16, qh 4 bytes, qs[16]; w = d · (q - 16)) and Q5_1 (24 bytes: d, m float16,
 *   qh, qs; w = d · q + m): input l < 16 in the low nibble of qs[l], 16 + l in its high one, the fifth bit of input
 *   i bit i of qh (little-endian).
 * - IQ4_XS, 136 bytes a 256 inputs: d float16, scales_h (uint16), scales_l[4], qs[128]: sub-block i's 6-bit scale
 *   ls = (scales_l[i / 2] >> 4 (i % 2)) & 15 | ((scales_h >> 2i) & 3) << 4; its input l < 16 the low nibble of
 *   qs[16i + l], 16 + l its high nibble, each an index into IQ4_VALUES. w = d · (ls - 32) · value.
 * The destination layouts are kernels.h's Q6L and Q4L (with Q4_K's own scales in `supers`).
 */
#include <omp.h>

#include "kernels.h"

enum {
    GGML_Q4_0 = 2,
    GGML_Q4_1 = 3,
    GGML_Q5_0 = 6,
    GGML_Q5_1 = 7,
    GGML_Q8_0 = 8,
    GGML_Q4_K = 12,
    GGML_Q5_K = 13,
    GGML_Q6_K = 14,
    GGML_IQ4_XS = 23
}; /* gguf's GGMLQuantizationType numbers */

/* One channel's 16 bytes of a lanes block's 4 quad vectors (`quads`: the first's start), from unit order (byte 2u + e:
 * its input 2u + e, as the file's blocks hold them) to quad order, 4 bytes at 4c of each vector (kernels.h; the
 * inverse of `channel_quads`). Every packer writes its channel's bytes this way, 16 at a time. */
static inline void put_quads(uint8_t *quads, int c, __m128i bytes) {
    uint32_t pieces[4];
    _mm_storeu_si128((__m128i *)pieces, quad_order16(bytes));
    for (int m = 0; m < 4; m++) memcpy(quads + 64 * m + 4 * c, pieces + m, 4);
}

/* 32 values of 4 bits as 16 bytes: byte i = v[i] | v[16 + i] << 4 (a lanes unit's pair order). */
static inline __m128i join_nibbles(__m256i v) {
    return _mm_or_si128(_mm256_castsi256_si128(v), _mm_slli_epi16(_mm256_extracti128_si256(v, 1), 4));
}

/* One channel's q (0..63) of Q6_K super-block `block` (q[32b ..]: its block b of 32 inputs), its 16 scales and its
 * d. */
static void q6_k_unpack(const uint8_t *block, __m256i q[8], int8_t scales[16], uint16_t *d) {
    const __m256i low4 = _mm256_set1_epi8(0x0F), low2 = _mm256_set1_epi8(3);
    for (int h = 0; h < 2; h++) {
        const __m256i ql0 = _mm256_loadu_si256((const __m256i *)(block + 64 * h));
        const __m256i ql1 = _mm256_loadu_si256((const __m256i *)(block + 64 * h + 32));
        const __m256i qh = _mm256_loadu_si256((const __m256i *)(block + 128 + 32 * h));
        for (int i = 0; i < 4; i++) { /* inputs 128h + 32i + l: nibble i / 2 of ql[64h + 32 (i % 2) + l], qh's bits 2i */
            const __m256i ql = i % 2 ? ql1 : ql0;
            const __m256i nibble = _mm256_and_si256(i < 2 ? ql : _mm256_srli_epi16(ql, 4), low4);
            const __m256i high = _mm256_and_si256(_mm256_srli_epi16(qh, 2 * i), low2);
            q[4 * h + i] = _mm256_or_si256(nibble, _mm256_slli_epi16(high, 4));
        }
    }
    memcpy(scales, block + 192, 16);
    memcpy(d, block + 208, 2);
}

/* Each packer writes channel c of group G (16 channels) of `w` from that channel's row of blocks in the file (`row`),
 * its blocks of 32 inputs [b0, b1) (multiples of 8 but the row's end: a K-quant's super-blocks whole), and returns -1
 * for a source type it does not pack into `w`'s layout; with `row` NULL it only answers that. The channels of one
 * group interleave in the same cache lines, so one thread packs a whole group (`kettle_pack`). */

/* Q6_K → Q6L. */
int pack_q6l(const Linear *w, int source, const uint8_t *row, int64_t G, int c, int64_t b0, int64_t b1) {
    if (source != GGML_Q6_K) return -1;
    if (!row) return 0;
    const int64_t k = w->k, supers = k / 256;
    uint8_t *weight = (uint8_t *)w->weight;
    int8_t *scales = (int8_t *)w->scales;
    uint16_t *d = (uint16_t *)w->supers;
    const __m256i low4 = _mm256_set1_epi8(0x0F), low2 = _mm256_set1_epi8(3);
    __m256i q[8];
    int8_t sc[16];
    for (int64_t s = b0 / 8; s < b1 / 8; s++) {
        q6_k_unpack(row + s * 210, q, sc, d + (G * supers + s) * 16 + c);
        for (int i = 0; i < 16; i++) scales[(G * (k / 16) + 16 * s + i) * 16 + c] = sc[i];
        for (int b8 = 0; b8 < 8; b8++) { /* the super-block's 8 blocks of 32, each its 16 bytes in t order */
            uint8_t *block = weight + (G * (k / 32) + 8 * s + b8) * 384;
            put_quads(block, c, join_nibbles(_mm256_and_si256(q[b8], low4)));
            /* byte i(m, t): the high 2 bits of input i(m, t) at 0-1 and of 16 + i(m, t) at 2-3; even m's to 4-7 */
            const __m256i two = _mm256_and_si256(_mm256_srli_epi16(q[b8], 4), low2);
            const __m128i fields = quad_order16(
                _mm_or_si128(_mm256_castsi256_si128(two), _mm_slli_epi16(_mm256_extracti128_si256(two, 1), 2)));
            const __m128i odd = _mm_srli_si128(fields, 4); /* vector m + 1's bytes beside vector m's */
            const __m128i high = _mm_or_si128(odd, _mm_slli_epi16(fields, 4));
            uint32_t words[4];
            _mm_storeu_si128((__m128i *)words, high);
            memcpy(block + 256 + 4 * c, words, 4);
            memcpy(block + 320 + 4 * c, words + 2, 4);
        }
    }
    return 0;
}

/* Sub-block j's 6-bit scale and minimum of a Q4_K block's 12 bytes (ggml's get_scale_min_k4). */
static inline void q4_k_scale_min(const uint8_t *s, int j, uint8_t *sc, uint8_t *m) {
    if (j < 4) {
        *sc = s[j] & 63, *m = s[j + 4] & 63;
    } else {
        *sc = (uint8_t)((s[j + 4] & 0x0F) | (s[j - 4] >> 6) << 4);
        *m = (uint8_t)((s[j + 4] >> 4) | (s[j] >> 6) << 4);
    }
}

/* Q4_0 / Q4_1 → Q4L with float16 scales (and Q4_1's minimums; Q4_0's are none: -8 · scale, `Minimums`). */
static int pack_q4l_legacy(const Linear *w, int source, const uint8_t *row, int64_t G, int c, int64_t b0,
                           int64_t b1) {
    if (!row) return 0;
    const int64_t k = w->k, size = source == GGML_Q4_1 ? 20 : 18;
    uint8_t *weight = (uint8_t *)w->weight;
    uint16_t *scales = (uint16_t *)w->scales, *mins = (uint16_t *)w->mins;
    for (int64_t b = b0; b < b1; b++) {
        const uint8_t *block = row + b * size, *qs = block + size - 16;
        const int64_t at = (G * (k / 32) + b) * 16 + c;
        memcpy(scales + at, block, 2);
        if (mins) memcpy(mins + at, block + 2, 2);
        put_quads(weight + (G * (k / 32) + b) * 256, c, _mm_loadu_si128((const __m128i *)qs));
    }
    return 0;
}

/* Q4_K → Q4L with Q4_K's own scales (sc, m as bytes, d and dmin in `supers`); Q4_0 and Q4_1 into a Q4L weight without
 * `supers` (groups of 32; minimums only for Q4_1). */
int pack_q4l(const Linear *w, int source, const uint8_t *row, int64_t G, int c, int64_t b0, int64_t b1) {
    if (!w->supers && w->group == 32 && ((source == GGML_Q4_0 && !w->mins) || (source == GGML_Q4_1 && w->mins)))
        return pack_q4l_legacy(w, source, row, G, c, b0, b1);
    if (source != GGML_Q4_K || !w->supers) return -1;
    if (!row) return 0;
    const int64_t k = w->k, supers = k / 256;
    uint8_t *weight = (uint8_t *)w->weight, *scales = (uint8_t *)w->scales, *mins = (uint8_t *)w->mins;
    uint16_t *d = (uint16_t *)w->supers;
    for (int64_t s = b0 / 8; s < b1 / 8; s++) {
        const uint8_t *block = row + s * 144, *qs = block + 16;
        memcpy(d + ((G * supers + s) * 2) * 16 + c, block, 2);          /* d */
        memcpy(d + ((G * supers + s) * 2 + 1) * 16 + c, block + 2, 2);  /* dmin */
        for (int j = 0; j < 8; j++) {
            const int64_t b = 8 * s + j, at = (G * (k / 32) + b) * 16 + c;
            q4_k_scale_min(block + 4, j, scales + at, mins + at);
            /* sub-block j: qs[32 (j / 2) + l], low nibbles for even j, high for odd */
            const __m256i x = _mm256_loadu_si256((const __m256i *)(qs + 32 * (j / 2)));
            const __m256i v = _mm256_and_si256(j % 2 ? _mm256_srli_epi16(x, 4) : x, _mm256_set1_epi8(0x0F));
            put_quads(weight + (G * (k / 32) + b) * 256, c, join_nibbles(v));
        }
    }
    return 0;
}

/* Block b's 32 values q (0..31) of channel c into Q5L's quad vectors and fifth-bit planes (the channel's own bytes). */
static void put_q5l_block(uint8_t *block, int c, const uint8_t v[32]) {
    uint8_t nibbles[16];
    for (int i = 0; i < 16; i++) nibbles[i] = (uint8_t)((v[i] & 0x0F) | (v[16 + i] & 0x0F) << 4);
    put_quads(block + Q5L_QUADS, c, _mm_loadu_si128((const __m128i *)nibbles));
    for (int t = 0; t < 4; t++) {
        uint8_t planes = 0; /* the byte beside the quad vectors' byte 4c + t: bit m of quad m's low nibble, 4 + m high */
        for (int m = 0; m < 4; m++) {
            const int i = 4 * m + QUAD_INPUT[t];
            planes |= (uint8_t)((v[i] >> 4) << m | (v[16 + i] >> 4) << (4 + m));
        }
        block[Q5L_PLANES + 4 * c + t] = planes;
    }
}

/* Q5_0 / Q5_1 → Q5L with float16 scales and minimums per block. */
static int pack_q5l_legacy(const Linear *w, int source, const uint8_t *row, int64_t G, int c, int64_t b0,
                           int64_t b1) {
    if (!row) return 0;
    const int64_t k = w->k, size = source == GGML_Q5_1 ? 24 : 22;
    uint8_t *weight = (uint8_t *)w->weight;
    uint16_t *scales = (uint16_t *)w->scales, *mins = (uint16_t *)w->mins;
    for (int64_t b = b0; b < b1; b++) {
        const uint8_t *block = row + b * size;
        const uint8_t *qh = block + size - 20, *qs = block + size - 16;
        uint32_t high;
        memcpy(&high, qh, 4);
        const int64_t at = (G * (k / 32) + b) * 16 + c;
        memcpy(scales + at, block, 2);
        if (source == GGML_Q5_1) memcpy(mins + at, block + 2, 2);
        else mins[at] = _cvtss_sh(-16.0f * _cvtsh_ss(scales[at]), _MM_FROUND_TO_NEAREST_INT); /* exact */
        uint8_t v[32];
        for (int l = 0; l < 16; l++) {
            v[l] = (uint8_t)((qs[l] & 0x0F) | ((high >> l) & 1) << 4);
            v[16 + l] = (uint8_t)((qs[l] >> 4) | ((high >> (16 + l)) & 1) << 4);
        }
        put_q5l_block(weight + (G * (k / 32) + b) * 320, c, v);
    }
    return 0;
}

/* Q5_K → Q5L (each channel writes its own bytes of the fifth-bit planes); Q5_0 and Q5_1 into a
 * Q5L weight without `supers`. */
int pack_q5l(const Linear *w, int source, const uint8_t *row, int64_t G, int c, int64_t b0, int64_t b1) {
    if ((source == GGML_Q5_0 || source == GGML_Q5_1) && !w->supers)
        return pack_q5l_legacy(w, source, row, G, c, b0, b1);
    if (source != GGML_Q5_K || !w->supers) return -1;
    if (!row) return 0;
    const int64_t k = w->k, supers = k / 256;
    uint8_t *weight = (uint8_t *)w->weight, *scales = (uint8_t *)w->scales, *mins = (uint8_t *)w->mins;
    uint16_t *d = (uint16_t *)w->supers;
    for (int64_t s = b0 / 8; s < b1 / 8; s++) {
        const uint8_t *block = row + s * 176, *qh = block + 16, *qs = block + 48;
        memcpy(d + ((G * supers + s) * 2) * 16 + c, block, 2);
        memcpy(d + ((G * supers + s) * 2 + 1) * 16 + c, block + 2, 2);
        for (int j = 0; j < 8; j++) {
            const int64_t b = 8 * s + j, at = (G * (k / 32) + b) * 16 + c;
            q4_k_scale_min(block + 4, j, scales + at, mins + at);
            uint8_t v[32];
            for (int l = 0; l < 32; l++) {
                const uint8_t nibble = j % 2 ? qs[32 * (j / 2) + l] >> 4 : qs[32 * (j / 2) + l] & 0x0F;
                v[l] = (uint8_t)(nibble | ((qh[l] >> j) & 1) << 4);
            }
            put_q5l_block(weight + (G * (k / 32) + b) * 320, c, v);
        }
    }
    return 0;
}

/* IQ4_XS → IQ4L. */
int pack_iq4l(const Linear *w, int source, const uint8_t *row, int64_t G, int c, int64_t b0, int64_t b1) {
    if (source != GGML_IQ4_XS) return -1;
    if (!row) return 0;
    const int64_t k = w->k, supers = k / 256;
    uint8_t *weight = (uint8_t *)w->weight;
    int8_t *scales = (int8_t *)w->scales;
    uint16_t *d = (uint16_t *)w->supers;
    for (int64_t s = b0 / 8; s < b1 / 8; s++) {
        const uint8_t *block = row + s * 136, *low = block + 4, *qs = block + 8;
        uint16_t high;
        memcpy(&high, block + 2, 2);
        memcpy(d + (G * supers + s) * 16 + c, block, 2);
        for (int i = 0; i < 8; i++) {
            const int64_t b = 8 * s + i;
            const int ls = ((low[i / 2] >> 4 * (i % 2)) & 15) | ((high >> 2 * i) & 3) << 4;
            scales[(G * (k / 32) + b) * 16 + c] = (int8_t)(ls - 32);
            /* byte l: input l (low nibble) and 16 + l (high) of the block */
            put_quads(weight + (G * (k / 32) + b) * 256, c, _mm_loadu_si128((const __m128i *)(qs + 16 * i)));
        }
    }
    return 0;
}

/* Q8_0 → Q8L. */
int pack_q8l(const Linear *w, int source, const uint8_t *row, int64_t G, int c, int64_t b0, int64_t b1) {
    if (source != GGML_Q8_0) return -1;
    if (!row) return 0;
    const int64_t k = w->k;
    uint8_t *weight = (uint8_t *)w->weight;
    uint16_t *scales = (uint16_t *)w->scales;
    for (int64_t b = b0; b < b1; b++) {
        const uint8_t *block = row + b * 34, *qs = block + 2;
        memcpy(scales + (G * (k / 32) + b) * 16 + c, block, 2);
        uint8_t *quads = weight + (G * (k / 32) + b) * 512; /* inputs 0..15 in the first 4 vectors, 16..31 after */
        put_quads(quads, c, _mm_loadu_si128((const __m128i *)qs));
        put_quads(quads + 256, c, _mm_loadu_si128((const __m128i *)(qs + 16)));
    }
    return 0;
}

/* Blocks of 32 inputs a pass over one group's 16 channels: the group's output for them (8-16 KiB in the lanes
 * layouts) stays in L1 while each channel writes its 2 bytes of every 32 into it. Channel by channel over a whole
 * row, a group's output (Q4L: 8 bytes an input, 64 KiB for 8,192 inputs) went through L1 16 times. A multiple of 8
 * (a K-quant's super-block). */
#define PACK_BLOCKS 32

/* `w`'s tensors (allocated by the caller in its layout) from a GGUF tensor's rows of blocks (`source`: its
 * GGMLQuantizationType; row_bytes apart; row r of the weight is source row order[r], order NULL: r), a group of 16
 * output channels a unit of work across the threads. -1 where this library has no packer from that type into w's. */
int kettle_pack(const Linear *w, int source, const uint8_t *blocks, int64_t row_bytes, const int64_t *order,
                int threads) {
    const WeightType *type = type_of(w);
    if (!type->pack || type->pack(w, source, NULL, 0, 0, 0, 0)) return -1;
    const int64_t n_blocks = w->k / 32;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t G = 0; G < w->n / 16; G++)
        for (int64_t b0 = 0; b0 < n_blocks; b0 += PACK_BLOCKS)
            for (int c = 0; c < 16; c++) {
                const int64_t row = 16 * G + c, b1 = b0 + PACK_BLOCKS < n_blocks ? b0 + PACK_BLOCKS : n_blocks;
                type->pack(w, source, blocks + (order ? order[row] : row) * row_bytes, G, c, b0, b1);
            }
    return 0;
}
