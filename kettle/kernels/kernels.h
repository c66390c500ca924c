/* Building blocks of Kettle's CPU kernels (AVX2 + FMA + F16C), shared by the op-at-a-time entry points (linear.c,
 * cpu_kernels.c, decode_attention.c) and the fused decoder step (decoder_step.c): the weight layouts, the weight-type
 * table's struct (its rows: weight_types.c), the path chooser's interface, the row-level kernels. Everything here
 * works on one row, one output channel or one attention item: the callers own the loops, and with them the
 * threads.
 *
 * Q4 layout (kettle/quantization/q4.py packs it): weight [N, K], K a multiple of 64, in chunks of 64 input
 * channels; chunk c of row n is 32 bytes at qw[n*K/2 + c*32], byte j = q[c*64 + j] | q[c*64 + 32 + j] << 4,
 * q in 0..15, so one 32-byte load and a mask (or shift and mask) give 32 consecutive weights in order.
 * Group g (a multiple of 32) of row n has a float16 scale and minimum at [n*K/g + k/g]: w = q*scale + minimum.
 * A symmetric weight (GGUF's Q4_0, w = d*(q - 8)) has no minimums: its minimum is -8*scale (`Minimums`).
 *
 * Q8 layout: weight [N, K] int8 row-major, one float32 scale per output channel: w = q*scale.
 *
 * Q4L layout (LINEAR_Q4L, "lanes": Q4 with N a multiple of 16, AVX-512 VNNI or AVX2, lanes_avx2.c): the
 * weight is stored 16 output channels at a time, so that one vector holds those 16 channels' weights for a few
 * inputs and `vpdpbusd` multiplies it with those inputs of one activation row broadcast (lanes.c): 16 channels
 * advance by four inputs in one instruction, every scale is applied once per block of 32 inputs for 16 channels together, and
 * several rows share each weight vector. Every lanes layout stores a block's bytes in the order the tile multiplies
 * them, in quads: byte 4c + t of a quad vector m holds channel 16G + c's input i(m, t) = 4m + (0, 2, 1, 3)[t] of the
 * block (the int8 rows' quad m holds the same inputs, `QuantizedRows`), so a decode step loads each vector straight
 * into `vpdpbusd` (interleaving two 32-byte units there cost a third of the loop: a 1.7B Q4_K_M file's projections
 * computed at 65 GB/s on 2 threads from cache, 88 without). weight [N/16][K/32][256] bytes: for channels
 * 16G .. 16G + 15 and block b, 4 quad vectors of 64 bytes, byte 4c + t of vector m holding
 * q[16G + c][32b + i(m, t)] | q[16G + c][32b + 16 + i(m, t)] << 4.
 * Scales and minimums [N/16][K/group][16] float16 (minimums NULL: symmetric, as Q4). kettle/quantization/q4.py
 * packs it. A Q4L weight with `supers` holds GGUF Q4_K's own scales instead (group 32): scales and minimums
 * [N/16][K/32][16] uint8, the 6-bit sc and m of each sub-block, and supers [N/16][K/256][2][16] float16, each
 * super-block's d and dmin: scale = d · sc, minimum = -(dmin · m), products exact in float32 as in GGUF's own
 * dequantization, and 148 bytes a channel's 256 weights where float16 scales and minimums take 160 (the file: 144).
 *
 * Q8L layout (LINEAR_Q8L: GGUF's Q8_0 in lanes, N a multiple of 16, AVX-512 VNNI or AVX2): weight
 * [N/16][K/32][512] int8, 8 quad vectors of 64 bytes, byte 4c + t of vector m holding q[16G + c][32b + i(m, t)];
 * scales [N/16][K/32][16] float16. kettle/quantization/q8.py packs it.
 *
 * Q6L layout (LINEAR_Q6L: GGUF's Q6_K in lanes, N a multiple of 16, K of 256, AVX-512 VNNI or AVX2):
 * w = d · sc · (q - 32), q in 0..63, sc an int8 per 16 inputs, d a float16 per 256. weight [N/16][K/32][384] bytes:
 * - the low 4 bits of q as Q4L's 256 bytes;
 * - 2 vectors of 64 bytes of high 2 bits, byte 4c + t of vector p holding inputs i(2p, t) and 16 + i(2p, t)'s at bits
 *   4-5 and 6-7, i(2p + 1, t) and 16 + i(2p + 1, t)'s at bits 0-1 and 2-3.
 * scales [N/16][K/16][16] int8, supers [N/16][K/256][16] float16 (d); 6.56 bits a weight as in the file.
 * kettle/quantization/q6.py and gguf_pack.c pack it.
 *
 * Q5L layout (LINEAR_Q5L: GGUF's Q5_K, Q5_0 and Q5_1 in lanes, N a multiple of 16, AVX-512 VNNI or AVX2): q in 0..31, with
 * Q4_K's scales (w = d · sc · q - dmin · m; sc, m 6-bit per 32 inputs, d and dmin per 256, K a multiple of 256) in
 * Q4L's tables (scales, mins, supers), or without `supers` a float16 scale and minimum per 32 inputs in Q4L's tables
 * (w = q · scale + minimum: Q5_1's d and m, Q5_0's d and -16 · d, exact in float16).
 * weight [N/16][K/32][320] bytes: for block b, 64 bytes of fifth-bit planes (Q5L_PLANES), then the low 4 bits of q as
 * Q4L's 256 bytes (Q5L_QUADS): plane byte 4c + t, beside every quad vector's byte 4c + t, holds at bit m the fifth bit
 * of quad vector m's input i(m, t) of channel 16G + c and at bit 4 + m that of input 16 + i(m, t), so that one shift
 * and a mask move a quad vector's fifth bits to bit 4 of its bytes (AVX2), or one test makes them a byte mask
 * (AVX-512). 5.5 bits a weight as in the file. kettle/kernels/gguf_pack.c packs it from the file's blocks.
 *
 * IQ4L layout (LINEAR_IQ4L: GGUF's IQ4_XS in lanes, N a multiple of 16, K of 256, AVX-512 VNNI or AVX2): w = d · (ls - 32) ·
 * IQ4_VALUES[q], q in 0..15 an index into a fixed non-uniform grid, ls a 6-bit scale per 32 inputs, d a float16 per
 * 256. weight [N/16][K/32][256] bytes of indices laid out as Q4L's nibbles; scales [N/16][K/32][16] int8 (ls - 32),
 * supers [N/16][K/256][16] float16 (d); no minimums. 4.25 bits a weight as in the file. gguf_pack.c packs it.
 */
#ifndef KETTLE_KERNELS_H
#define KETTLE_KERNELS_H

/* Where a Q5L block's planes and quad vectors start. The planes come first because the tiles read them first: with
 * them after the quads, each block's reads went back 256 bytes and the hardware's prefetch fell behind (AVX-512, one
 * thread, a 2,048 × 65,536 weight from memory: 16.2 GB/s, against 30.6-31.9 with the planes first). */
#define Q5L_PLANES 0
#define Q5L_QUADS 64

#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* The AVX-512 paths' target and the CPU's answer for them. Built with EMULATE_AVX512 (build.py, for tests on a
 * CPU without AVX-512: `KETTLE_TUNING=emulate-avx512=on`), the AVX-512 intrinsics are SIMDe's portable ones compiled
 * for AVX2 and every AVX-512 path is taken, so that its bits are tested on any CPU, slowly. */
#ifdef EMULATE_AVX512
#define SIMDE_ENABLE_NATIVE_ALIASES
#include <simde/x86/avx512.h>
#include "avx512_emulation.h"
#define AVX512_TARGET(features) __attribute__((target("avx2,fma,f16c")))
#define CPU_HAS_AVX512(feature) 1
#else
#define AVX512_TARGET(features) __attribute__((target(features)))
#define CPU_HAS_AVX512(feature) __builtin_cpu_supports(feature)
#endif

#define MAX_TILE 4

/* Runs ROW(tile) over the activation rows in tiles of up to MAX_TILE, each tile size a compile-time constant at
 * its call (so the row functions unroll over it), then STORE(m) for each row m of the tile: m0 is its first. */
#define FOR_EACH_TILE(rows, ROW, STORE)                                                                       \
    for (int64_t m0 = 0; m0 < (rows); m0 += MAX_TILE) {                                                      \
        const int64_t tile = (rows) - m0 < MAX_TILE ? (rows) - m0 : MAX_TILE;                                \
        if (tile == 4) ROW(4);                                                                                \
        else if (tile == 3) ROW(3);                                                                           \
        else if (tile == 2) ROW(2);                                                                           \
        else ROW(1);                                                                                          \
        for (int64_t m = 0; m < tile; m++) STORE(m);                                                          \
    }

enum {
    LINEAR_Q4 = 1,
    LINEAR_Q8 = 2,
    LINEAR_F32 = 3,
    LINEAR_Q8G = 4,
    LINEAR_Q4L = 5,
    LINEAR_Q8L = 6,
    LINEAR_Q6L = 7,
    LINEAR_Q5L = 8,
    LINEAR_IQ4L = 9
};

/* IQ4_NL's and IQ4_XS's grid (ggml's kvalues_iq4nl): the value each 4-bit index stands for. */
static const int8_t IQ4_VALUES[16] = {-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113};

/* One projection y = x Wᵀ (+ bias): quantized, or float32 (the fused decode step's dense weights). Q8G is
 * GGUF's Q8_0: int8 weights with one float16 scale per block of 32 inputs, W = q · d exactly. */
typedef struct Linear {
    int64_t kind, group, n, k; /* group: Q4's group size (Q8G: 32; Q8, F32: k) */
    const void *weight;        /* Q4: packed [N, K/2] uint8; Q8, Q8G: [N, K] int8; F32: [N, K] float */
    const void *scales;        /* Q4, Q8G: [N, K/group] float16; Q8: [N] float32; Q6L: int8 (the layouts above) */
    const uint16_t *mins;      /* Q4: [N, K/group] float16, or NULL for a symmetric weight (`Minimums`) */
    const float *bias;         /* [N] or NULL */
    const uint16_t *supers;    /* Q4L with Q4_K's scales: d and dmin; Q6L: d (the layouts above); else NULL */
    /* The next part of a projection stacked along its outputs, or NULL: a fused q/k/v whose parts a file stores in
     * different types (GGUF's Q4_K_M keeps some layers' v in Q6_K) keeps each part's own type, its outputs after
     * this part's n. Every part reads the same input rows (quantized once, in groups of the first part's
     * group, which every part with minimums shares). */
    const struct Linear *next;
} Linear;

/* How one projection multiplies (`choose_path`, linear.c, picks one for a row count; the op-at-a-time entry and the
 * fused decode step both run it through `team_linear`). */
enum {
    PATH_PLAIN = 0,     /* float32 rows, one pass over the weights (the rows layouts' `plain` kernels) */
    PATH_TILES = 1,     /* each channel dequantized once, every row multiplied in float32 (`linear_channels_f32`) */
    PATH_QUANTIZED = 2, /* quantized rows (int8 in lanes, int16 in rows), one pass (`quantized_rows`: a channel at a time, or 16 in lanes) */
    PATH_INVARIANT = 3, /* int16 rows, each row's bits those of the row alone (`invariant_rows`, the row panels) */
    PATH_GEMM = 4,      /* gemm.c's float32 panels */
    PATH_INT_GEMM = 5,  /* gemm.c's integer panels over int8 rows (AVX-512 VNNI; on AVX2 the `avx2_panels` types) */
    PATHS = 6
};
/* What the op-at-a-time entry takes instead of a path: the chooser's pick for decode rows, or for prompt rows (a
 * prompt chunk's rows under batch invariance take the prompt GEMM, whose sums per row follow the row alone). */
enum { PATH_DECODE_ROWS = -1, PATH_PROMPT_ROWS = -2 };

/* The measurement switches the chooser reads (kettle/settings.py's tuning, passed with every call). */
typedef struct {
    int64_t quantized_activations; /* 0: float32 rows everywhere (exact to the dequantized weights) */
    int64_t invariant;             /* 1 (the default): each row's arithmetic whatever shares its step */
    int64_t integer_gemm;          /* 1 (the default): the integer panels where they run (`integer_panels_run`) */
    int64_t float_rows;            /* the float32 tiles from this many rows on: -1 each type's own, 0 never */
    int64_t gemm_rows;             /* the panels from this many rows on: -1 the defaults (below), 0 never */
} Tuning;

/* A Q4 channel's minimums, each read as factor · table[g]. A symmetric weight stores none (mins NULL): its scales
 * are read as -8 · scale. -8 is a power of two, so every minimum and every product with one is exactly what a
 * stored -8 · scale would give, bit for bit, and the weight carries 2 bytes less per group (10% of a Q4_0 file's
 * weight bytes, which a one-row step reads from memory every token). */
typedef struct {
    const uint16_t *table;
    float factor;
} Minimums;

/* Channel j's minimums for a weight of `groups` groups a row (`mins` NULL: symmetric, read from `scales`). */
static inline Minimums channel_minimums(const uint16_t *mins, const void *scales, int64_t groups, int64_t j) {
    if (mins) return (Minimums){mins + j * groups, 1.0f};
    return (Minimums){(const uint16_t *)scales + j * groups, -8.0f};
}

/* Minimum g of a channel as a float. */
static inline float minimum_at(Minimums m, int64_t g) { return m.factor * _cvtsh_ss(m.table[g]); }

static inline float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

static inline int32_t hsum_epi32(__m256i v) {
    __m128i x = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    x = _mm_add_epi32(x, _mm_shuffle_epi32(x, 0x4E));
    return _mm_cvtsi128_si32(_mm_add_epi32(x, _mm_shuffle_epi32(x, 0xB1)));
}

/* 32 weights in 0..15 (one byte each) as four float vectors, dequantized with a group's scale and minimum. */
static inline void q4_dequant(__m256i q, __m256 scale, __m256 minimum, __m256 w[4]) {
    const __m128i lo = _mm256_castsi256_si128(q), hi = _mm256_extracti128_si256(q, 1);
    w[0] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(lo)), scale, minimum);
    w[1] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(lo, 8))), scale, minimum);
    w[2] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(hi)), scale, minimum);
    w[3] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(hi, 8))), scale, minimum);
}

/* The two 32-weight halves of one Q4 chunk, one byte a weight. */
static inline void q4_chunk(const uint8_t *src, __m256i halves[2]) {
    const __m256i bytes = _mm256_loadu_si256((const __m256i *)src), mask = _mm256_set1_epi8(0x0F);
    halves[0] = _mm256_and_si256(bytes, mask);
    halves[1] = _mm256_and_si256(_mm256_srli_epi16(bytes, 4), mask);
}

/* One output channel for `tile` float32 activation rows (tile is a compile-time constant at each call site). */
static inline __attribute__((always_inline)) void q4_row(
    const float *x, int64_t ldx, int tile, int64_t k, int group, const uint8_t *qw, const uint16_t *scales,
    Minimums mins, float *out
) {
    __m256 acc[MAX_TILE][2];
    for (int m = 0; m < tile; m++) acc[m][0] = acc[m][1] = _mm256_setzero_ps();
    for (int64_t c = 0; c < k / 64; c++) {
        __m256i halves[2];
        q4_chunk(qw + c * 32, halves);
        for (int h = 0; h < 2; h++) {
            const int64_t col = c * 64 + h * 32, g = col / group;
            __m256 w[4];
            q4_dequant(halves[h], _mm256_set1_ps(_cvtsh_ss(scales[g])), _mm256_set1_ps(minimum_at(mins, g)), w);
            for (int m = 0; m < tile; m++) {
                const float *xr = x + m * ldx + col;
                /* Two chains per row: at tile 1 the FMA latency would otherwise bound the loop. */
                acc[m][0] = _mm256_fmadd_ps(w[0], _mm256_loadu_ps(xr), acc[m][0]);
                acc[m][1] = _mm256_fmadd_ps(w[1], _mm256_loadu_ps(xr + 8), acc[m][1]);
                acc[m][0] = _mm256_fmadd_ps(w[2], _mm256_loadu_ps(xr + 16), acc[m][0]);
                acc[m][1] = _mm256_fmadd_ps(w[3], _mm256_loadu_ps(xr + 24), acc[m][1]);
            }
        }
    }
    for (int m = 0; m < tile; m++) out[m] = hsum(_mm256_add_ps(acc[m][0], acc[m][1]));
}

/* One int8 output channel for `tile` activation rows. */
static inline __attribute__((always_inline)) void q8_row(
    const float *x, int64_t ldx, int tile, int64_t k, const int8_t *qw, float *out
) {
    __m256 acc[MAX_TILE][2];
    for (int m = 0; m < tile; m++) acc[m][0] = acc[m][1] = _mm256_setzero_ps();
    for (int64_t col = 0; col < k; col += 16) {
        const __m128i bytes = _mm_loadu_si128((const __m128i *)(qw + col));
        const __m256 w0 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(bytes));
        const __m256 w1 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(bytes, 8)));
        for (int m = 0; m < tile; m++) {
            const float *xr = x + m * ldx + col;
            acc[m][0] = _mm256_fmadd_ps(w0, _mm256_loadu_ps(xr), acc[m][0]);
            acc[m][1] = _mm256_fmadd_ps(w1, _mm256_loadu_ps(xr + 8), acc[m][1]);
        }
    }
    for (int m = 0; m < tile; m++) out[m] = hsum(_mm256_add_ps(acc[m][0], acc[m][1]));
}

/* ---- quantized activations, per block of 32 inputs, each row twice from the same floats:
 * - int16 (absmax / 32767) for the rows layouts' dot products (`madd_epi16`: products of 16-bit pairs summed into
 *   32-bit lanes, exact): the outputs move by ~1e-5 relative from float32 rows;
 * - int8 (absmax / 127, Q8_0's rounding) for the lanes kernels and the integer panels (`vpdpbusd`: four u8 weights
 *   times four s8 inputs into each 32-bit lane, twice the multiply-adds of `vpdpwssd` an instruction, which is what
 *   prompt chunks are bound by; a 1.7B Q4_K_M prompt 60 → 110 tok/s). llama.cpp makes the same choice (its Q8
 *   activations, per 256 inputs for the K-quants). On the bundled model over 1,024 tokens of text: perplexity 40.61
 *   against 40.60 with float32 rows (int16: 40.61), next-token KL to float32 rows 3.8e-3 (int16: 9e-7). For the
 *   weights whose kernels sum a super-block in integers (the K-quants' and IQ4_XS's scales, `int8_span`) the int8 scale is
 *   one per 256 inputs, as llama.cpp's Q8_K.
 * The int8 values of a block are stored as 8 quads, quad m holding inputs 4m, 4m + 2, 4m + 1, 4m + 3 (one int32 to
 * broadcast): the order of each channel's 4 bytes in a lanes quad vector. */

typedef struct {
    int16_t *q;    /* [rows, K], 32-byte aligned */
    float *scale;  /* [rows, K/32] */
    float *sum;    /* [rows, K/group]: the exact float sum of each weight group's inputs (the minimum term) */
    float *lanes;  /* the int8 rows 16 to a vector for gemm.c's integer panels (`lay_out_lanes`), or NULL */
    int32_t *half; /* [rows, K/16]: the sum of each 16 int8 values, for the weights stored with an offset (`offset`) */
    int8_t *b;     /* [rows, K] int8 in quads, 64-byte aligned */
    float *scale8; /* [rows, K/32] */
    /* [rows, K/group]: each group's sum of the int8 rows' values (scale · integer sum per block, in block order).
     * The int8 kernels' minimum terms take this one: with the exact sum they would multiply each q by the rounded
     * input but the minimum by the exact one, and the rounding errors, no longer centred, add up (the bundled model's
     * next-token KL to float32 rows 4x larger). */
    float *sum8;
} QuantizedRows;

/* One weight type: what differs between the layouts (`LINEAR_*`), each a row of WEIGHT_TYPES (weight_types.c). The
 * rows and lanes layouts of the same bits are two types, as ggml's repacked types are. The kernels a type lacks are
 * NULL, and `choose_path` never picks their path for it. Channel ranges [j0, j1) are a thread's share of the outputs
 * (in lanes: multiples of 16). */
typedef struct {
    const char *name;
    int lanes;         /* output channels stored 16 at a time (N a multiple of 16; AVX-512 VNNI, or AVX2 tiles) */
    int quantized;     /* 0: float32 weights, read in place by the tiles at every row count */
    int sub_blocks;    /* scales per 16 inputs (Q6_K) */
    int wide_values;   /* values past 0..15 (Q5L's 0..31, Q6L's 0..63): the AVX2 kernels sum them in int32 a quad (the
                        * tiles) or two (the panels) at a time, where `vpmaddubsw`'s int16 pairs would overflow summed
                        * over a block as Q4L's are */
    int offset;        /* the kernels hold q + offset as u8 (`vpdpbusd`'s unsigned side): Q6's q, Q8's and IQ4's
                        * q + 128; the sums take offset · (the inputs' sum) off per block (sub-block) */
    int minimums;      /* a minimum per group (w = q · scale + minimum), which the integer panels add */
    int channel_scale; /* one float32 scale per output channel (`scales[j]`), applied after the channel's sum */
    int64_t float_rows; /* the float32 tiles beat int16 rows from these many rows on (measured; 0: never) */
    /* Channel j as K floats (without a channel_scale, which the callers apply). */
    void (*dequantize)(const Linear *w, int64_t j, float *dst);
    /* y[:, j0 .. j1) for float32 rows x in one pass over the weights. */
    void (*plain)(const Linear *w, const float *x, int64_t ldx, int64_t rows, int64_t j0, int64_t j1, float *y,
                  int64_t ldy);
    /* y[:, j0 .. j1) for the rows quantized in xq, one pass over the weights. */
    void (*quantized_rows)(const Linear *w, const QuantizedRows *xq, int64_t rows, int64_t j0, int64_t j1, float *y,
                           int64_t ldy);
    /* The same on AVX2 CPUs for a lanes layout (lanes_avx2.c, the same bits: Q4L, Q8L, IQ4L, Q6L), or NULL (Q5L):
     * the type is held in lanes only where the CPU has AVX-512 VNNI. */
    void (*quantized_rows_avx2)(const Linear *w, const QuantizedRows *xq, int64_t rows, int64_t j0, int64_t j1,
                                float *y, int64_t ldy);
    /* The same with each row's bits those of the row alone (lanes: `quantized_rows` is that already, NULL here). */
    void (*invariant_rows)(const Linear *w, const QuantizedRows *xq, int64_t rows, int64_t j0, int64_t j1, float *y,
                           int64_t ldy);
    /* The integer panels: channel j's values q + offset as K u8 in the int8 rows' quad order, and (NULL where
     * `sub_scales` gives them all) its scales per block and minimums per group. */
    void (*widen)(const Linear *w, int64_t j, uint8_t *dst);
    void (*scales)(const Linear *w, int64_t j, float *scale, float *minimum);
    /* For a weight with `supers` whose sub-block scales are small integers (Q4_K's and Q5_K's 6 bits, IQ4_XS's
     * ls - 32, Q6_K's int8 per 16 inputs), or NULL:
     * channel j's scale per block of 32 as an int16 pair (`block_scaled`; Q6_K's `sub_entries`: each sub-block's,
     * then 32 · (sc₀, sc₁), the offset's term) and its float d per 256 inputs. Its integer
     * kernels then sum a super-block's blocks in int32 over int8 rows scaled per 256 (`int8_span`), and a row's
     * float operations are, per block, + minimum · (the block's int8 sum) where it has minimums, then at the
     * super-block's last block
     * + (Σ scale · sums) · (d · the row's scale): a conversion and an FMA per 256 inputs where each block took a
     * conversion, a multiply and an FMA (a 1.7B Q4_K_M prompt 82 → 92 tok/s on a Zen 3; Q6_K's AVX2 panels 150 →
     * 179 GOP/s a core). */
    void (*sub_scales)(const Linear *w, int64_t j, int32_t *pairs, float *super_d);
    /* The integer panels have an AVX2 micro-kernel for the type (gemm.c, `vpmaddubsw`), with the bits of its AVX2
     * tiles: `widen`'s values must then be 0..15 (offset 0: summed in int16 over a block), int8 + 128 (offset 128:
     * flipped back to int8, the sign trick) or, wide, 0..31 and 0..63 (summed in int32 two quads at a time). The lanes
     * types with AVX2 tiles: Q4L, Q8L, IQ4L, Q6L. */
    int avx2_panels;
    /* The float32 panels, for a lanes layout that has it (else channel by channel through `dequantize`): the 16
     * channels of group G into panel columns, rows `ld` floats apart, the same values as `dequantize`. */
    void (*panel_group)(const Linear *w, int64_t G, float *panel, int64_t ld);
    /* The row panels (invariant rows from `kettle_row_gemm_rows` on): channel j as K int16, its scales per block. */
    void (*widen_row)(const Linear *w, int64_t j, int16_t *dst, float *scale);
    /* At load: channel c of group G (16 channels), its blocks of 32 inputs [b0, b1), from its row of a GGUF tensor's
     * blocks of type `source` (gguf_pack.c); -1 for a source type it does not pack (`row` NULL: only that answer). */
    int (*pack)(const Linear *w, int source, const uint8_t *row, int64_t G, int c, int64_t b0, int64_t b1);
} WeightType;

#define INTERNAL __attribute__((visibility("hidden")))

INTERNAL extern const WeightType WEIGHT_TYPES[];

static inline const WeightType *type_of(const Linear *w) { return &WEIGHT_TYPES[w->kind]; }

static inline void free_rows(QuantizedRows *rows) {
    free(rows->q);
    free(rows->scale);
    free(rows->sum);
    free(rows->lanes);
    free(rows->half);
    free(rows->b);
    free(rows->scale8);
    free(rows->sum8);
}

/* Room for `rows` rows of up to `k` channels; -1 when out of memory. */
static inline int alloc_rows(int64_t rows, int64_t k, QuantizedRows *out) {
    *out = (QuantizedRows){NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL};
    out->q = aligned_alloc(32, sizeof(int16_t) * (size_t)(rows * k + 32));
    out->scale = malloc(sizeof(float) * (size_t)(rows * (k / 32) + 1));
    out->sum = malloc(sizeof(float) * (size_t)(rows * (k / 32) + 1));
    out->half = malloc(sizeof(int32_t) * (size_t)(rows * (k / 16) + 1));
    out->b = aligned_alloc(64, (size_t)((rows * k + 63) / 64 * 64 + 64));
    out->scale8 = malloc(sizeof(float) * (size_t)(rows * (k / 32) + 1));
    out->sum8 = malloc(sizeof(float) * (size_t)(rows * (k / 32) + 1));
    return out->q && out->scale && out->sum && out->half && out->b && out->scale8 && out->sum8 ? 0 : -1;
}

/* Floats of one group of 16 int8 rows laid out in lanes for K (quads [K/4][16], scale [K/32][16], sum [K/32][16],
 * half [K/16][16]). */
static inline int64_t lane_floats(int64_t k) { return (k / 4 + 2 * (k / 32) + k / 16) * 16; }

/* Room in `out` (allocated by alloc_rows) for `rows` rows in lanes; -1 when out of memory. */
static inline int alloc_lanes(int64_t rows, int64_t k, QuantizedRows *out) {
    out->lanes = aligned_alloc(64, sizeof(float) * (size_t)((rows + 15) / 16 * lane_floats(k)));
    return out->lanes ? 0 : -1;
}

/* Bytes in input order to the quad order, within each 128-bit lane: byte 4m + t takes input 4m + QUAD_INPUT[t]
 * (the int8 rows' quads, the lanes layouts' quad vectors). The order is its own inverse. */
static const int QUAD_INPUT[4] = {0, 2, 1, 3};
static inline __m128i quad_order16(__m128i natural) {
    return _mm_shuffle_epi8(natural, _mm_setr_epi8(0, 2, 1, 3, 4, 6, 5, 7, 8, 10, 9, 11, 12, 14, 13, 15));
}
static inline __m256i quad_order(__m256i natural) {
    const __m256i order = _mm256_setr_epi8(0, 2, 1, 3, 4, 6, 5, 7, 8, 10, 9, 11, 12, 14, 13, 15,
                                           0, 2, 1, 3, 4, 6, 5, 7, 8, 10, 9, 11, 12, 14, 13, 15);
    return _mm256_shuffle_epi8(natural, order);
}

/* 32 int8 values (four vectors of 8 int32, inputs in order) in the quad order. packs leave them as the quads
 * 0, 2, 4, 6 | 1, 3, 5, 7; a dword permute puts the quads in order, a byte shuffle each quad's inputs. */
static inline __m256i int8_quads(const __m256i q[4]) {
    const __m256i bytes = _mm256_packs_epi16(_mm256_packs_epi32(q[0], q[1]), _mm256_packs_epi32(q[2], q[3]));
    return quad_order(_mm256_permutevar8x32_epi32(bytes, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
}

/* Whether a projection's integer kernels combine its sub-blocks in integers (`w->supers` with the table's
 * `sub_scales`: the K-quants' and IQ4_XS's integer scales under a float16 d per 256 inputs), so its int8 rows take
 * one scale per 256 inputs, as llama.cpp's Q8_K; a fused projection's parts share the rows (`Linear.next`), so any
 * such part makes them so. The other kernels read the rows' scale per block as ever, the super-block's at each of its 8 blocks. */
static inline int int8_span(const Linear *w) {
    for (; w; w = w->next)
        if (w->supers && type_of(w)->sub_scales) return 256;
    return 32;
}

/* The int32 entries a block of `sub_scales` writes: a pair per sub-block, and Q6_K's (`sub_blocks`) offset pair. */
static inline int sub_entries(const WeightType *type) { return type->sub_blocks ? 3 : 1; }

/* Blocks [first, last) of row `r` of `out` (laid out for w: K = w->k, groups of w->group) from x[K]: int16 and int8
 * values with their scales per block (int8: one absmax per `span` inputs, the projection's `int8_span`, written at each
 * of its blocks), each group's float sum of x and of the int8 values, the int8 sums per 16. first and last are whole
 * spans and groups (`quantized_piece_blocks`). */
static inline void quantize_blocks(const float *x, const Linear *w, int64_t span, QuantizedRows *out, int64_t r,
                                   int64_t first, int64_t last) {
    const int64_t k = w->k, group = w->group, blocks = k / 32, groups = k / group;
    span /= 32; /* blocks a span */
    const __m256 sign = _mm256_set1_ps(-0.0f);
    float *sums = out->sum + r * groups, *sums8 = out->sum8 + r * groups;
    for (int64_t g = first * 32 / group; g < last * 32 / group; g++) sums[g] = sums8[g] = 0.0f;
    for (int64_t s0 = first; s0 < last; s0 += span) {
        float amax[8], amax8 = 0.0f; /* each block's absmax, and the span's */
        for (int64_t b = s0; b < s0 + span; b++) {
            const float *src = x + b * 32;
            __m256 m = _mm256_setzero_ps();
            for (int i = 0; i < 4; i++) m = _mm256_max_ps(m, _mm256_andnot_ps(sign, _mm256_loadu_ps(src + 8 * i)));
            __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
            m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
            m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
            amax[b - s0] = _mm_cvtss_f32(m4);
            amax8 = amax[b - s0] > amax8 ? amax[b - s0] : amax8;
        }
        const float d8 = amax8 / 127.0f;
        const __m256 inv8 = _mm256_set1_ps(d8 > 0.0f ? 1.0f / d8 : 0.0f);
        for (int64_t b = s0; b < s0 + span; b++) {
            const float *src = x + b * 32;
            __m256 v[4];
            for (int i = 0; i < 4; i++) v[i] = _mm256_loadu_ps(src + 8 * i);
            const float d = amax[b - s0] / 32767.0f;
            const __m256 inv = _mm256_set1_ps(d > 0.0f ? 1.0f / d : 0.0f);
            __m256i q[4], q8[4]; /* rounded to nearest */
            for (int i = 0; i < 4; i++) q[i] = _mm256_cvtps_epi32(_mm256_mul_ps(v[i], inv));
            for (int i = 0; i < 4; i++) q8[i] = _mm256_cvtps_epi32(_mm256_mul_ps(v[i], inv8));
            const int32_t first = hsum_epi32(_mm256_add_epi32(q8[0], q8[1])), second = hsum_epi32(_mm256_add_epi32(q8[2], q8[3]));
            out->half[r * (k / 16) + 2 * b] = first;
            out->half[r * (k / 16) + 2 * b + 1] = second;
            sums8[b * 32 / group] += d8 * (float)(first + second);
            _mm256_storeu_si256((__m256i *)(out->b + r * k + b * 32), int8_quads(q8));
            out->scale8[r * blocks + b] = d8;
            /* packs works within 128-bit lanes: [0-3, 8-11 | 4-7, 12-15]; the permute restores the order. */
            int16_t *dst = out->q + r * k + b * 32;
            _mm256_store_si256((__m256i *)dst, _mm256_permute4x64_epi64(_mm256_packs_epi32(q[0], q[1]), 0xD8));
            _mm256_store_si256((__m256i *)(dst + 16), _mm256_permute4x64_epi64(_mm256_packs_epi32(q[2], q[3]), 0xD8));
            out->scale[r * blocks + b] = d;
            sums[b * 32 / group] += hsum(_mm256_add_ps(_mm256_add_ps(v[0], v[1]), _mm256_add_ps(v[2], v[3])));
        }
    }
}

/* `quantize_blocks` over the whole row. */
static inline void quantize_row(const float *x, const Linear *w, int64_t span, QuantizedRows *out, int64_t r) {
    quantize_blocks(x, w, span, out, r, 0, w->k / 32);
}

/* Blocks of 32 inputs a piece of a row must hold so that `quantize_blocks` can run the pieces apart: whole int8 spans
 * and whole groups (each span's scale and each group's sums come from its own blocks only, in their order). */
static inline int64_t quantized_piece_blocks(const Linear *w, int64_t span) {
    return (span > w->group ? span : w->group) / 32;
}

/* The integer dot product of one block of 32 weights (as two vectors of 16 int16) with 32 int16 activations. */
static inline __m256 block_dot(__m256i w_lo, __m256i w_hi, const int16_t *x) {
    const __m256i lo = _mm256_madd_epi16(w_lo, _mm256_load_si256((const __m256i *)x));
    const __m256i hi = _mm256_madd_epi16(w_hi, _mm256_load_si256((const __m256i *)(x + 16)));
    return _mm256_cvtepi32_ps(_mm256_add_epi32(lo, hi));
}

/* acc + minimum_g · (Σ x over group g) lane by lane over the whole vectors of 8 groups (the rest, groups / 8 · 8
 * on, is the caller's). */
static inline __m256 minimum_lanes(const uint16_t *mins, const float *sums, int64_t groups, __m256 acc) {
    for (int64_t g = 0; g + 8 <= groups; g += 8)
        acc = _mm256_fmadd_ps(_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(mins + g))), _mm256_loadu_ps(sums + g), acc);
    return acc;
}

/* total + the rest of the minimums' term, groups / 8 · 8 on, that `minimum_lanes` leaves to its caller. */
static inline float minimum_tail(const uint16_t *mins, const float *sums, int64_t groups, float total) {
    for (int64_t g = groups / 8 * 8; g < groups; g++) total += _cvtsh_ss(mins[g]) * sums[g];
    return total;
}

/* Σ_g minimum_g · (Σ x over group g): the minimums' share of one output, 8 groups per step, over the table's
 * values and times the factor once at the end (a power of two commutes with every rounding on the way: the bits
 * of the sum over factor · table[g]). */
static inline float minimum_term(Minimums mins, const float *sums, int64_t groups) {
    const float raw = minimum_tail(mins.table, sums, groups, hsum(minimum_lanes(mins.table, sums, groups, _mm256_setzero_ps())));
    return mins.factor * raw;
}

/* One Q4 output channel for `tile` quantized activation rows: Σ_blocks (d_x · scale_g) · (q · x_q), plus the
 * minimums' term. Each half of a chunk's 32 bytes is widened to 16-bit lanes straight from memory, then masked
 * (channels c..c+31 of the chunk) or shifted (c+32..c+63): fewer shuffles than splitting the nibbles first
 * (1.3x on one thread at one row). The weight scale is folded into each row's activation scale per block (a
 * scalar multiply) rather than applied at each group's end: with Q4_1's 32-wide groups that flush was every
 * block. One or two rows keep two accumulators each (even and odd blocks), so their FMAs do not wait on each
 * other. */
static inline __attribute__((always_inline)) void q4_row_qa(
    const QuantizedRows *xq, int64_t row0, int tile, int64_t k, int group, const uint8_t *qw,
    const uint16_t *scales, Minimums mins, float *out
) {
    const int64_t blocks = k / 32, groups = k / group;
    const int blocks_per_group = group / 32, chains = tile <= 2 ? 2 : 1;
    const __m256i mask = _mm256_set1_epi16(0x0F);
    __m256 total[MAX_TILE][2];
    for (int m = 0; m < tile; m++) total[m][0] = total[m][1] = _mm256_setzero_ps();
    int64_t g = 0;
    int in_group = 0;
    for (int64_t c = 0; c < k / 64; c++) {
        const __m256i lo = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)(qw + c * 32)));
        const __m256i hi = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)(qw + c * 32 + 16)));
        const __m256i w[2][2] = {{_mm256_and_si256(lo, mask), _mm256_and_si256(hi, mask)},
                                 {_mm256_srli_epi16(lo, 4), _mm256_srli_epi16(hi, 4)}};
        for (int h = 0; h < 2; h++) {
            const int64_t block = 2 * c + h;
            const float scale = _cvtsh_ss(scales[g]);
            for (int m = 0; m < tile; m++) {
                const int64_t r = row0 + m;
                const __m256 d = _mm256_set1_ps(xq->scale[r * blocks + block] * scale);
                __m256 *acc = &total[m][h % chains];
                *acc = _mm256_fmadd_ps(block_dot(w[h][0], w[h][1], xq->q + r * k + block * 32), d, *acc);
            }
            if (++in_group == blocks_per_group) g++, in_group = 0;
        }
    }
    for (int m = 0; m < tile; m++)
        out[m] = hsum(_mm256_add_ps(total[m][0], total[m][1])) + minimum_term(mins, xq->sum + (row0 + m) * groups, groups);
}

extern int kettle_channel_one; /* 0: one row through the tiles' kernels too (cpu_kernels.c; for measurement) */

/* Each block's combined scale d_x · scale_g for one output channel, 8 at a time where every block is its own group
 * (GGUF's 32-wide grids), into combined[K/32]. */
static inline void combined_scales(const QuantizedRows *xq, int64_t blocks, int64_t per_group, const uint16_t *scales,
                                   float *combined) {
    int64_t b = 0;
    if (per_group == 1)
        for (; b + 8 <= blocks; b += 8) {
            const __m256 scale = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(scales + b)));
            _mm256_storeu_ps(combined + b, _mm256_mul_ps(scale, _mm256_loadu_ps(xq->scale + b)));
        }
    for (; b < blocks; b++) combined[b] = _cvtsh_ss(scales[b / per_group]) * xq->scale[b];
}

/* `q4_row_qa` for one activation row, with the per-channel work taken out of the loop: each block's combined
 * scale (d_x · scale_g) computed 8 at a time before it (a broadcast from memory per block inside), and the
 * minimums' term accumulated in the same vector as the blocks, so one horizontal sum ends the channel. At one row
 * the per-channel work was ~30% of a 576-wide channel's time (the same kernel on rows 8x longer ran 1.4x faster). */
static inline __attribute__((always_inline)) float q4_channel_one_at(
    const QuantizedRows *xq, int64_t k, int group, const uint8_t *qw, const uint16_t *scales, const uint16_t *mins,
    const float factor
) {
    const int64_t blocks = k / 32, groups = k / group;
    float combined[blocks];
    combined_scales(xq, blocks, group / 32, scales, combined);
    /* The minimums' lanes start the first accumulator, their factor applied once (see `minimum_term`). */
    __m256 acc0 = _mm256_mul_ps(minimum_lanes(mins, xq->sum, groups, _mm256_setzero_ps()), _mm256_set1_ps(factor));
    __m256 acc1 = _mm256_setzero_ps();
    const float tail = factor * minimum_tail(mins, xq->sum, groups, 0.0f);
    const __m256i mask = _mm256_set1_epi16(0x0F);
    for (int64_t c = 0; c < k / 64; c++) {
        const __m256i lo = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)(qw + c * 32)));
        const __m256i hi = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)(qw + c * 32 + 16)));
        const __m256 first = block_dot(_mm256_and_si256(lo, mask), _mm256_and_si256(hi, mask), xq->q + c * 64);
        const __m256 second = block_dot(_mm256_srli_epi16(lo, 4), _mm256_srli_epi16(hi, 4), xq->q + c * 64 + 32);
        acc0 = _mm256_fmadd_ps(first, _mm256_broadcast_ss(combined + 2 * c), acc0);
        acc1 = _mm256_fmadd_ps(second, _mm256_broadcast_ss(combined + 2 * c + 1), acc1);
    }
    return hsum(_mm256_add_ps(acc0, acc1)) + tail;
}

/* `q4_channel_one_at` with the factor a constant in each branch: the multiplies by 1 fold away, so a weight with
 * stored minimums runs exactly the loop it ran before symmetric weights had none. */
static inline float q4_channel_one(const QuantizedRows *xq, int64_t k, int group, const uint8_t *qw,
                                   const uint16_t *scales, Minimums mins) {
    if (mins.factor == 1.0f) return q4_channel_one_at(xq, k, group, qw, scales, mins.table, 1.0f);
    return q4_channel_one_at(xq, k, group, qw, scales, mins.table, -8.0f);
}

/* One int8 output channel for `tile` quantized activation rows, widened from memory as in `q4_row_qa` (one
 * accumulator per row: two measured ~5% slower here at one row). With `scales` (Q8G: a float16 scale per block of
 * 32), each block's scale is folded into the row's activation scale, as `q4_row_qa` does; without, the channel's
 * one scale is applied by the caller. */
static inline __attribute__((always_inline)) void q8_row_qa(
    const QuantizedRows *xq, int64_t row0, int tile, int64_t k, const int8_t *qw, const uint16_t *scales, float *out
) {
    const int64_t blocks = k / 32;
    __m256 acc[MAX_TILE];
    for (int m = 0; m < tile; m++) acc[m] = _mm256_setzero_ps();
    for (int64_t b = 0; b < blocks; b++) {
        const __m256i w_lo = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(qw + b * 32)));
        const __m256i w_hi = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(qw + b * 32 + 16)));
        const float scale = scales ? _cvtsh_ss(scales[b]) : 1.0f;
        for (int m = 0; m < tile; m++) {
            const int64_t r = row0 + m;
            const __m256 d = _mm256_set1_ps(xq->scale[r * blocks + b] * scale);
            acc[m] = _mm256_fmadd_ps(block_dot(w_lo, w_hi, xq->q + r * k + b * 32), d, acc[m]);
        }
    }
    for (int m = 0; m < tile; m++) out[m] = hsum(acc[m]);
}

/* `q8_row_qa` over GGUF's Q8_0 (a scale per block) for one activation row, its scales combined before the loop as
 * in `q4_channel_one`. */
static inline float q8g_channel_one(const QuantizedRows *xq, int64_t k, const int8_t *qw, const uint16_t *scales) {
    const int64_t blocks = k / 32;
    float combined[blocks];
    combined_scales(xq, blocks, 1, scales, combined);
    __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
    int64_t b = 0;
    for (; b + 2 <= blocks; b += 2) { /* two chains, so the FMAs do not wait on each other */
        for (int i = 0; i < 2; i++) {
            const int8_t *q = qw + (b + i) * 32;
            const __m256i lo = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)q));
            const __m256i hi = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(q + 16)));
            __m256 *acc = i ? &acc1 : &acc0;
            *acc = _mm256_fmadd_ps(block_dot(lo, hi, xq->q + (b + i) * 32), _mm256_broadcast_ss(combined + b + i), *acc);
        }
    }
    if (b < blocks) {
        const __m256i lo = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(qw + b * 32)));
        const __m256i hi = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(qw + b * 32 + 16)));
        acc0 = _mm256_fmadd_ps(block_dot(lo, hi, xq->q + b * 32), _mm256_broadcast_ss(combined + b), acc0);
    }
    return hsum(_mm256_add_ps(acc0, acc1));
}

/* ---- a row's arithmetic whatever the number of rows (`batch-invariant` in KETTLE_TUNING, on by default) ----
 *
 * A request's tokens must not depend on what else shares its step. So in the rows layouts (Q4, Q8G, Q8: the
 * weights not in lanes) each row of a step is computed exactly as a row alone is
 * (`q4_channel_one`, `q8g_channel_one`, `q8_row_qa`): the same int16 rows, the same integer block sums in the same
 * 8 lanes (exact, so any grouping of the products gives them), the same float chains over the blocks in the same
 * order (even blocks in one, odd ones in the other), the same horizontal sum and the same last additions. The
 * kernels below share one unpacking of a channel among the rows of a pass; gemm.c's row panels do it for prompt
 * chunks and large steps. tests/unit/test_batch_invariance.py holds every path to one row's bits. */

/* Rows one pass of `q4_channel_rows` / `q8g_channel_rows` takes (their accumulators and the unpacked weights fill the
 * 16 AVX2 registers; passes of 8 rows, one chain at a time, measured ~5% slower). */
#define ROWS_PASS 4

/* Row r of xq (laid out for K = k, groups of `group`) as a one-row QuantizedRows, as the one-row channels read it. */
static inline QuantizedRows quantized_row(const QuantizedRows *xq, int64_t r, int64_t k, int64_t group) {
    const QuantizedRows row = {xq->q + r * k, xq->scale + r * (k / 32), xq->sum + r * (k / group), NULL, NULL, NULL, NULL, NULL};
    return row;
}

/* One Q4 output channel for rows r0 .. r0 + R - 1 of xq (R ≤ ROWS_PASS, a constant at each call), each row's bits
 * those of `q4_channel_one_at` on that row alone. */
static inline __attribute__((always_inline)) void q4_channel_rows_at(
    const QuantizedRows *xq, int64_t r0, const int R, int64_t k, int group, const uint8_t *qw, const uint16_t *scales,
    const uint16_t *mins, const float factor, float *out
) {
    const int64_t blocks = k / 32, groups = k / group;
    float combined[ROWS_PASS][blocks], tail[ROWS_PASS];
    __m256 acc0[ROWS_PASS], acc1[ROWS_PASS];
    const int16_t *x[ROWS_PASS];
    for (int r = 0; r < R; r++) {
        const QuantizedRows row = quantized_row(xq, r0 + r, k, group);
        combined_scales(&row, blocks, group / 32, scales, combined[r]);
        acc0[r] = _mm256_mul_ps(minimum_lanes(mins, row.sum, groups, _mm256_setzero_ps()), _mm256_set1_ps(factor));
        acc1[r] = _mm256_setzero_ps();
        tail[r] = factor * minimum_tail(mins, row.sum, groups, 0.0f);
        x[r] = row.q;
    }
    const __m256i mask = _mm256_set1_epi16(0x0F);
    for (int64_t c = 0; c < k / 64; c++) {
        const __m256i lo = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)(qw + c * 32)));
        const __m256i hi = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)(qw + c * 32 + 16)));
        const __m256i w00 = _mm256_and_si256(lo, mask), w01 = _mm256_and_si256(hi, mask);
        const __m256i w10 = _mm256_srli_epi16(lo, 4), w11 = _mm256_srli_epi16(hi, 4);
        for (int r = 0; r < R; r++) {
            const __m256 first = block_dot(w00, w01, x[r] + c * 64), second = block_dot(w10, w11, x[r] + c * 64 + 32);
            acc0[r] = _mm256_fmadd_ps(first, _mm256_broadcast_ss(combined[r] + 2 * c), acc0[r]);
            acc1[r] = _mm256_fmadd_ps(second, _mm256_broadcast_ss(combined[r] + 2 * c + 1), acc1[r]);
        }
    }
    for (int r = 0; r < R; r++) out[r] = hsum(_mm256_add_ps(acc0[r], acc1[r])) + tail[r];
}

/* `q4_channel_rows_at` with the factor a constant in each branch, as `q4_channel_one`. */
static inline __attribute__((always_inline)) void q4_channel_rows(const QuantizedRows *xq, int64_t r0, const int R,
                                                                  int64_t k, int group, const uint8_t *qw,
                                                                  const uint16_t *scales, Minimums mins, float *out) {
    if (mins.factor == 1.0f) q4_channel_rows_at(xq, r0, R, k, group, qw, scales, mins.table, 1.0f, out);
    else q4_channel_rows_at(xq, r0, R, k, group, qw, scales, mins.table, -8.0f, out);
}

/* One Q8G output channel for rows r0 .. r0 + R - 1 of xq, each row's bits those of `q8g_channel_one` alone: block b
 * in chain b % 2. */
static inline __attribute__((always_inline)) void q8g_channel_rows(const QuantizedRows *xq, int64_t r0, const int R,
                                                                   int64_t k, const int8_t *qw, const uint16_t *scales,
                                                                   float *out) {
    const int64_t blocks = k / 32;
    float combined[ROWS_PASS][blocks];
    __m256 acc[ROWS_PASS][2];
    const int16_t *x[ROWS_PASS];
    for (int r = 0; r < R; r++) {
        const QuantizedRows row = quantized_row(xq, r0 + r, k, 32);
        combined_scales(&row, blocks, 1, scales, combined[r]);
        acc[r][0] = acc[r][1] = _mm256_setzero_ps();
        x[r] = row.q;
    }
    for (int64_t b = 0; b < blocks; b++) {
        const __m256i lo = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(qw + b * 32)));
        const __m256i hi = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(qw + b * 32 + 16)));
        for (int r = 0; r < R; r++)
            acc[r][b % 2] = _mm256_fmadd_ps(block_dot(lo, hi, x[r] + b * 32), _mm256_broadcast_ss(combined[r] + b), acc[r][b % 2]);
    }
    for (int r = 0; r < R; r++) out[r] = hsum(_mm256_add_ps(acc[r][0], acc[r][1]));
}

/* Runs ROW(R) over `rows` rows in passes of ROWS_PASS (R a constant at each call), then STORE(m) for each row m of
 * the pass (m0 its first). One row alone takes the one-row channel (ONE), which the passes reproduce. */
#define FOR_EACH_PASS(rows, ONE, ROW, STORE)                                                                  \
    if ((rows) == 1) {                                                                                        \
        const int64_t m0 = 0;                                                                                 \
        out[0] = ONE;                                                                                         \
        STORE(0);                                                                                             \
    } else                                                                                                    \
        for (int64_t m0 = 0; m0 < (rows); m0 += ROWS_PASS) {                                                  \
            const int64_t pass = (rows) - m0 < ROWS_PASS ? (rows) - m0 : ROWS_PASS;                           \
            if (pass == 4) ROW(4);                                                                            \
            else if (pass == 3) ROW(3);                                                                       \
            else if (pass == 2) ROW(2);                                                                       \
            else ROW(1);                                                                                      \
            for (int64_t m = 0; m < pass; m++) STORE(m);                                                      \
        }

/* ---- the one-row channels in 512-bit vectors (AVX-512 VNNI): a block of 32 inputs is one vector of int16 pairs,
 * summed by one vpdpwssd where AVX2 takes two vpmaddwd and an add. The block sums are the same integers; only the
 * float accumulation runs over 16 lanes instead of 8. */

#define ONE512 AVX512_TARGET("avx512f,avx512bw,avx512vnni")

/* AVX-512 for the one-row channels: -1 where the CPU has it (`one_row_avx512`), 0 or 1 to force (tests, measurement). */
extern int kettle_channel_avx512;
/* Whether this CPU has what the 512-bit one-row channels need: asked once when the library loads (cpu_kernels.c),
 * not per channel, where a single stream's step runs ~50,000 of them. */
extern int kettle_cpu_vnni512;

static inline ONE512 __m512 block_dot512(__m512i w, const int16_t *x) {
    return _mm512_cvtepi32_ps(_mm512_dpwssd_epi32(_mm512_setzero_si512(), w, _mm512_loadu_si512(x)));
}

/* `q4_channel_one` in 512-bit vectors: each 32 bytes of the channel widened once, their low nibbles one block and
 * their high nibbles the next. */
static inline __attribute__((always_inline)) ONE512 float q4_channel_one512_at(
    const QuantizedRows *xq, int64_t k, int group, const uint8_t *qw, const uint16_t *scales, const uint16_t *mins,
    const float factor
) {
    const int64_t blocks = k / 32, groups = k / group;
    float combined[blocks];
    combined_scales(xq, blocks, group / 32, scales, combined);
    /* The factor applied once (see `minimum_term`). */
    const __m256 minimums = _mm256_mul_ps(minimum_lanes(mins, xq->sum, groups, _mm256_setzero_ps()), _mm256_set1_ps(factor));
    const float tail = factor * minimum_tail(mins, xq->sum, groups, 0.0f);
    const __m512i mask = _mm512_set1_epi16(0x0F);
    __m512 acc0 = _mm512_setzero_ps(), acc1 = _mm512_setzero_ps();
    for (int64_t c = 0; c < k / 64; c++) {
        const __m512i bytes = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)(qw + c * 32)));
        const __m512 first = block_dot512(_mm512_and_si512(bytes, mask), xq->q + c * 64);
        const __m512 second = block_dot512(_mm512_srli_epi16(bytes, 4), xq->q + c * 64 + 32);
        acc0 = _mm512_fmadd_ps(first, _mm512_set1_ps(combined[2 * c]), acc0);
        acc1 = _mm512_fmadd_ps(second, _mm512_set1_ps(combined[2 * c + 1]), acc1);
    }
    return _mm512_reduce_add_ps(_mm512_add_ps(acc0, acc1)) + hsum(minimums) + tail;
}

/* `q4_channel_one512_at` with a constant factor, as `q4_channel_one`. */
static inline ONE512 float q4_channel_one512(const QuantizedRows *xq, int64_t k, int group, const uint8_t *qw,
                                      const uint16_t *scales, Minimums mins) {
    if (mins.factor == 1.0f) return q4_channel_one512_at(xq, k, group, qw, scales, mins.table, 1.0f);
    return q4_channel_one512_at(xq, k, group, qw, scales, mins.table, -8.0f);
}

/* acc + block b of a Q8_0 channel's products with the row, in one 512-bit vector. */
static inline ONE512 __m512 q8g_block512(const QuantizedRows *xq, const int8_t *qw, const float *combined, int64_t b,
                                         __m512 acc) {
    const __m512i w = _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i *)(qw + b * 32)));
    return _mm512_fmadd_ps(block_dot512(w, xq->q + b * 32), _mm512_set1_ps(combined[b]), acc);
}

/* `q8g_channel_one` in 512-bit vectors: one block of 32 int8 weights widened to one vector. */
static inline ONE512 float q8g_channel_one512(const QuantizedRows *xq, int64_t k, const int8_t *qw, const uint16_t *scales) {
    const int64_t blocks = k / 32;
    float combined[blocks];
    combined_scales(xq, blocks, 1, scales, combined);
    __m512 even = _mm512_setzero_ps(), odd = _mm512_setzero_ps(); /* two chains: the FMAs do not wait on each other */
    for (int64_t b = 0; b < blocks; b += 2) {
        even = q8g_block512(xq, qw, combined, b, even);
        if (b + 1 < blocks) odd = q8g_block512(xq, qw, combined, b + 1, odd);
    }
    return _mm512_reduce_add_ps(_mm512_add_ps(even, odd));
}

/* Rows a pass of the lanes kernels (lanes.c); a batch of more rows takes several passes over each group of 16
 * channels, whose weights the first pass left in L1 or L2. At 8 rows a pass the Q4_K and Q5_K tiles' three
 * accumulators a row (int32 sums, the super-block's sums, float outputs) no longer fit AVX-512's 32 registers, and
 * GCC kept all three in memory, a load and a store per row and block. 4 rows a pass, with the prefetch from two rows
 * on (`prefetch_ahead`), the 1.7B Q4_K_M file's decode step in process (Zen 4, 2 threads, alternated): 4 rows
 * 46.4-48.1 → 42.9-44.8 ms, 8 rows 90.5-94.1 → 73.2-73.3, 16 rows 162-171 → 134-143, 64 rows 587-606 → 460-500;
 * Q5_K_M 4 rows 61.6 → 48.9, 16 rows 158 → 147; IQ4_XS 4 rows 44.2 → 40.7; Q8_0 even. One row is as before. */
#define LANES_TILE 4

/* Output channels j0 .. j1 - 1 (multiples of 16) of a weight in lanes for every row quantized in xq (lanes.c). */
INTERNAL void q4l_rows(const Linear *w, const QuantizedRows *xq, int64_t rows, int64_t j0, int64_t j1, float *y, int64_t ldy);
INTERNAL void q8l_rows(const Linear *w, const QuantizedRows *xq, int64_t rows, int64_t j0, int64_t j1, float *y, int64_t ldy);
INTERNAL void q6l_rows(const Linear *w, const QuantizedRows *xq, int64_t rows, int64_t j0, int64_t j1, float *y, int64_t ldy);
INTERNAL void q5l_rows(const Linear *w, const QuantizedRows *xq, int64_t rows, int64_t j0, int64_t j1, float *y, int64_t ldy);
INTERNAL void iq4l_rows(const Linear *w, const QuantizedRows *xq, int64_t rows, int64_t j0, int64_t j1, float *y, int64_t ldy);
/* Their AVX2 tiles (lanes_avx2.c), and whether the lanes tiles (and the integer panels of the `avx2_panels` types) run
 * in 512-bit vectors: `kettle_lanes_avx512` (-1: the CPU's answer; tests set 0 to run the AVX2 ones here). */
INTERNAL void iq4l_rows_avx2(const Linear *w, const QuantizedRows *xq, int64_t rows, int64_t j0, int64_t j1, float *y, int64_t ldy);
INTERNAL void q4l_rows_avx2(const Linear *w, const QuantizedRows *xq, int64_t rows, int64_t j0, int64_t j1, float *y, int64_t ldy);
INTERNAL void q8l_rows_avx2(const Linear *w, const QuantizedRows *xq, int64_t rows, int64_t j0, int64_t j1, float *y, int64_t ldy);
INTERNAL void q5l_rows_avx2(const Linear *w, const QuantizedRows *xq, int64_t rows, int64_t j0, int64_t j1, float *y, int64_t ldy);
INTERNAL void q6l_rows_avx2(const Linear *w, const QuantizedRows *xq, int64_t rows, int64_t j0, int64_t j1, float *y, int64_t ldy);
extern int kettle_lanes_avx512;
static inline int lanes_avx512(void) { return kettle_lanes_avx512 < 0 ? kettle_cpu_vnni512 : kettle_lanes_avx512; }

/* Asks for the `bytes` (whole lines) of the weight block `ahead` bytes past `block`, for the decode tiles whose reads
 * the hardware's prefetch alone does not follow: Q6L's (a quad vector, then the bits vector 256 bytes on, then the
 * next quad vector), Q5L's AVX2 tile, and every AVX-512 tile from two rows a pass on, whose arithmetic per block
 * leaves fewer of the block's loads in flight (`LANES_TILE`). At one row the tiles that read their blocks in order
 * do better without it (below).
 * Always inlined: GCC 12 dropped the prefetches of a plain `static inline` helper inlined into the always-inline
 * AVX-512 and AVX2 tiles (no prefetch instruction in the library from the commit that introduced this helper until
 * this attribute). With them back, Zen 4, 2 threads, the tiles over a 2,048 × 65,536 weight from memory (a
 * throwaway bench, medians of six alternations): Q6L 33-35 → 37 GB/s, its AVX2 tile 48 → 54.5, Q5L's AVX2 tile
 * 51 → 59; the 1.7B Q6_K file's decode in process 29.1-29.8 → 31.9-32.6 tok/s, Q4_K_M's (its Q6_K tensors)
 * 40.9-41.6 → 43.2-44.3. The same prefetch in the in-order tiles measured slower: AVX-512 Q4L 41 → 38, IQ4L 67 → 58,
 * Q8L 63 → 50; AVX2 Q8L 62 → 59, IQ4L 56 → 53.5, Q4L even. */
static inline __attribute__((always_inline)) void prefetch_ahead(const void *block, int bytes, int ahead) {
    for (int line = 0; line < bytes; line += 64) _mm_prefetch((const char *)block + ahead + line, _MM_HINT_T0);
}

/* ---- the AVX2 int8 kernels' dot-product step (lanes_avx2.c's tiles, gemm.c's `micro_avx2_int`): u8 × s8 quads
 * summed into int32 lanes. Their loops are written once (lanes_avx2_tiles.h, int_panels_avx2.h) and compiled once per
 * form of this step, named by AVX2_FORM where they are included:
 *   maddubs  plain AVX2: `vpmaddubsw` (pairs into int16) and `vpmaddwd` by ones (the quad into int32), 2-3
 *            instructions per 32 products;
 *   avxvnni  AVX-VNNI's VEX `vpdpbusd ymm` (Intel's client cores since Alder Lake, which have no AVX-512): one;
 *   vnni256  the same operation in AVX512-VNNI + VL's EVEX encoding, for CPUs with those but the 512-bit kernels off
 *            (tests and measurement on AVX-512 machines, which need not have AVX-VNNI).
 * Every form's integer sums are exact (no int16 saturation: see the callers' bounds), so all three give the bits of
 * the others and of the AVX-512 kernels. Only functions compiled for their form's target hold its instructions: the
 * avxvnni ones none of AVX-512's (an EVEX instruction faults on those CPUs). */
enum { AVX2_DOT_MADDUBS = 0, AVX2_DOT_AVXVNNI = 1, AVX2_DOT_VNNI256 = 2 };
/* The 256-bit vpdpbusd this CPU runs (asked at load: cpu_kernels.c): AVX2_DOT_AVXVNNI where it has AVX-VNNI, else
 * AVX2_DOT_VNNI256 where it has AVX512-VNNI + VL, else AVX2_DOT_MADDUBS. */
extern int kettle_cpu_vnni256;
/* Whether the AVX2 int8 kernels use it: -1 (the default) and 1 where the CPU has it, 0 the vpmaddubsw form (tests,
 * measurement). 1 cannot select an encoding the CPU lacks. */
extern int kettle_avx2_vnni;
static inline int avx2_dot(void) { return kettle_avx2_vnni == 0 ? AVX2_DOT_MADDUBS : kettle_cpu_vnni256; }

#define AVX2_TARGET_maddubs
#define AVX2_TARGET_avxvnni __attribute__((target("avxvnni")))
#define AVX2_TARGET_vnni256 AVX512_TARGET("avx512vnni,avx512vl")
#define AVX2_CAT_(a, b) a##b
#define AVX2_CAT(a, b) AVX2_CAT_(a, b)
/* name_<form> and the form's target attribute, for the template headers' functions. */
#define AVX2_NAMED(name) AVX2_CAT(name##_, AVX2_FORM)
#define AVX2_TARGET AVX2_CAT(AVX2_TARGET_, AVX2_FORM)
/* 1 where the form's step adds into its accumulator (`vpdpbusd`), 0 where its products are summed apart (vpmaddubsw). */
#define AVX2_ACCUMULATES_maddubs 0
#define AVX2_ACCUMULATES_avxvnni 1
#define AVX2_ACCUMULATES_vnni256 1
#define AVX2_ACCUMULATES AVX2_CAT(AVX2_ACCUMULATES_, AVX2_FORM)
/* The form's steps below, as the template headers call them. */
#define AVX2_QUAD_DOT AVX2_CAT(quad_dot_, AVX2_FORM)
#define AVX2_QUAD_PAIR_DOT AVX2_CAT(quad_pair_dot_, AVX2_FORM)
#define AVX2_BLOCK_DOT AVX2_CAT(block_dot_, AVX2_FORM)
#define AVX2_BLOCK_SUMS AVX2_CAT(block_sums_, AVX2_FORM)
#define AVX2_BLOCK_SCALED AVX2_CAT(block_scaled_, AVX2_FORM)

/* acc + v, the sum written over acc's own register. GCC otherwise adds an accumulator of the AVX2 micro-kernels into
 * the product's register and copies it back, one `vmovdqa` per product (a quarter of the loop's instructions): on a
 * Zen 3, whose loop is bound by the instructions it issues, the Q4L panels ran at 174 GOP/s a core that way, 193 so. */
static inline __m256i add_into_epi16(__m256i acc, __m256i v) {
    __asm__("vpaddw %1, %0, %0" : "+x"(acc) : "x"(v));
    return acc;
}
static inline __m256i add_into_epi32(__m256i acc, __m256i v) {
    __asm__("vpaddd %1, %0, %0" : "+x"(acc) : "x"(v));
    return acc;
}

/* acc (int32) + each lane's quad of u (u8) times s (s8), summed: `quad_dot`. */
static inline __m256i quad_dot_maddubs(__m256i acc, __m256i u, __m256i s) {
    return add_into_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1)));
}
static inline AVX2_TARGET_avxvnni __m256i quad_dot_avxvnni(__m256i acc, __m256i u, __m256i s) {
    return _mm256_dpbusd_avx_epi32(acc, u, s);
}
static inline AVX2_TARGET_vnni256 __m256i quad_dot_vnni256(__m256i acc, __m256i u, __m256i s) {
    return _mm256_dpbusd_epi32(acc, u, s);
}
/* `quad_dot` of two quads (u0 with s0, u1 with s1) for the `wide_values` types' u ≤ 63: the two quads' int16 pairs
 * sum to at most 4 · 63 · 128 = 32,256 < 2^15, so `vpmaddubsw` takes one `vpmaddwd` for both (a block of eight would
 * overflow). One thread, the panels in cache on a Zen 3: Q6L 146 -> 170 GOP/s, Q5L 175 -> 204. */
static inline __m256i quad_pair_dot_maddubs(__m256i acc, __m256i u0, __m256i s0, __m256i u1, __m256i s1) {
    const __m256i pairs = _mm256_add_epi16(_mm256_maddubs_epi16(u0, s0), _mm256_maddubs_epi16(u1, s1));
    return add_into_epi32(acc, _mm256_madd_epi16(pairs, _mm256_set1_epi16(1)));
}
static inline AVX2_TARGET_avxvnni __m256i quad_pair_dot_avxvnni(__m256i acc, __m256i u0, __m256i s0, __m256i u1,
                                                                __m256i s1) {
    return quad_dot_avxvnni(quad_dot_avxvnni(acc, u0, s0), u1, s1);
}
static inline AVX2_TARGET_vnni256 __m256i quad_pair_dot_vnni256(__m256i acc, __m256i u0, __m256i s0, __m256i u1,
                                                                __m256i s1) {
    return quad_dot_vnni256(quad_dot_vnni256(acc, u0, s0), u1, s1);
}
/* A block's sums of small unsigned u (Q4's 0..15) times s, in two steps: `block_dot` adds one vector's products to
 * acc in the form's own accumulator (maddubs: int16 pair sums, which a block of 32 inputs keeps below 2^15, so one
 * vpmaddwd a block; VNNI: int32 quad sums already), `block_sums` gives the int32 quad sums. */
static inline __m256i block_dot_maddubs(__m256i acc, __m256i u, __m256i s) {
    return add_into_epi16(acc, _mm256_maddubs_epi16(u, s));
}
static inline __m256i block_sums_maddubs(__m256i acc) { return _mm256_madd_epi16(acc, _mm256_set1_epi16(1)); }
#define block_dot_avxvnni quad_dot_avxvnni
#define block_dot_vnni256 quad_dot_vnni256
static inline __m256i block_sums_avxvnni(__m256i acc) { return acc; }
#define block_sums_vnni256 block_sums_avxvnni
/* A block's sums, as `block_dot` leaves them in the form's accumulator, times each lane's sub-block scale, in int32
 * (`sub_scales`): `pair` holds the scale in both int16 halves of each lane, so vpmaddubsw's int16 pair sums take it
 * in the one vpmaddwd that sums them (|sums| · 63 · 2 < 2^31); the VNNI forms' int32 sums multiply by it. */
static inline __m256i block_scaled_maddubs(__m256i acc, __m256i pair) { return _mm256_madd_epi16(acc, pair); }
static inline __m256i block_scaled_avxvnni(__m256i acc, __m256i pair) {
    return _mm256_mullo_epi32(acc, _mm256_srai_epi32(pair, 16)); /* the scale's sign too (IQ4_XS's ls - 32) */
}
#define block_scaled_vnni256 block_scaled_avxvnni
/* `quad_dot` of the vpmaddubsw form whose int16 pair sums take the scale in `pair` in place of ones (the sign
 * trick's signed types: |pairs| · 32 · 2 < 2^31). */
static inline __m256i quad_dot_scaled_maddubs(__m256i acc, __m256i u, __m256i s, __m256i pair) {
    return add_into_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), pair));
}
/* `quad_pair_dot` whose int16 pair sums take the scale in `pair` (as `block_scaled`) in place of ones: the
 * vpmaddubsw form's wide values (Q5L) scaled at no cost. */
static inline __m256i quad_pair_scaled_maddubs(__m256i acc, __m256i u0, __m256i s0, __m256i u1, __m256i s1,
                                               __m256i pair) {
    const __m256i pairs = _mm256_add_epi16(_mm256_maddubs_epi16(u0, s0), _mm256_maddubs_epi16(u1, s1));
    return add_into_epi32(acc, _mm256_madd_epi16(pairs, pair));
}
/* Whether the integer panels can run a weight of `type` on this CPU: any type they widen where it has AVX-512 VNNI,
 * else those with an AVX2 micro-kernel (`avx2_panels`). */
static inline int integer_panels_run(const WeightType *type) {
    return type->widen && (kettle_cpu_vnni512 || type->avx2_panels);
}

/* Whether the one-row channels run in 512-bit vectors: `kettle_channel_avx512`, or the CPU's answer. */
static inline int one_row_avx512(void) { return kettle_channel_avx512 < 0 ? kettle_cpu_vnni512 : kettle_channel_avx512; }

/* Units [0, units) of work run by every thread of the calling team, ending with its barrier: thread t runs its
 * `schedule(static)` share in order (kernel(context, u0, u1) over [u0, u1)) but for the last 1/tail of it, and those
 * tails go, one unit at a time, round-robin over the shares, to whichever thread is free (linear.c). */
typedef void UnitsKernel(const void *context, int64_t u0, int64_t u1);
INTERNAL void team_units(int64_t units, int64_t tail, UnitsKernel *kernel, const void *context);
/* gemm.c's float32 panels, run by every thread of the calling team (orphaned `omp for`s), with a per-thread buffer
 * of gemm_buffer_floats(K) floats, 64-byte aligned. */
INTERNAL void gemm_panels(const Linear *w, const float *x, int64_t ldx, int64_t m, float *y, int64_t ldy, float *buffer);
INTERNAL int64_t gemm_buffer_floats(int64_t k);
/* The integer panels (AVX-512 VNNI; AVX2 for the `avx2_panels` types) over rows quantized to int8 and laid out in
 * lanes by the team, as `gemm_panels`. */
INTERNAL void lay_out_lanes(const QuantizedRows *xq, int64_t rows, int64_t k, int64_t group);
INTERNAL void gemm_panels_int(const Linear *w, const QuantizedRows *xq, int64_t m, float *y, int64_t ldy, float *buffer);
/* gemm.c's row panels (AVX2): a weight in the rows layouts over rows quantized in xq, each row's bits those of the
 * row alone (`invariant_rows`), as `gemm_panels` with a per-thread buffer of row_panel_floats(K) floats; from
 * `kettle_row_gemm_rows` rows on they replace `invariant_rows`. */
INTERNAL int64_t row_panel_floats(int64_t k);
INTERNAL void gemm_row_panels(const Linear *w, const QuantizedRows *xq, int64_t m, float *y, int64_t ldy, float *buffer);
extern int kettle_row_gemm_rows;
/* The integer panels' widening per type (gemm.c). */
INTERNAL void q4_widen(const Linear *w, int64_t j, uint8_t *dst);
INTERNAL void q4l_widen(const Linear *w, int64_t j, uint8_t *dst);
INTERNAL void q8_widen(const Linear *w, int64_t j, uint8_t *dst);
INTERNAL void q8l_widen(const Linear *w, int64_t j, uint8_t *dst);
INTERNAL void q6l_widen(const Linear *w, int64_t j, uint8_t *dst);
INTERNAL void q5l_widen(const Linear *w, int64_t j, uint8_t *dst);
INTERNAL void iq4l_widen(const Linear *w, int64_t j, uint8_t *dst);
INTERNAL void iq4l_scales(const Linear *w, int64_t j, float *scale, float *minimum);
INTERNAL void group_scales(const Linear *w, int64_t j, float *scale, float *minimum);
INTERNAL void q4l_scales(const Linear *w, int64_t j, float *scale, float *minimum);
INTERNAL void q4k_sub_scales(const Linear *w, int64_t j, int32_t *pairs, float *super_d);
INTERNAL void iq4l_sub_scales(const Linear *w, int64_t j, int32_t *pairs, float *super_d);
INTERNAL void q6l_sub_scales(const Linear *w, int64_t j, int32_t *pairs, float *super_d);
INTERNAL void q8_scales(const Linear *w, int64_t j, float *scale, float *minimum);
INTERNAL void q8l_scales(const Linear *w, int64_t j, float *scale, float *minimum);
/* The float32 panels' 16 channels at a time from a lanes layout (gemm.c). */
INTERNAL void q4l_panel_group(const Linear *w, int64_t G, float *panel, int64_t ld);
INTERNAL void q8l_panel_group(const Linear *w, int64_t G, float *panel, int64_t ld);
/* GGUF blocks into the lanes layouts (gguf_pack.c). */
INTERNAL int pack_q4l(const Linear *w, int source, const uint8_t *row, int64_t G, int c, int64_t b0, int64_t b1);
INTERNAL int pack_q6l(const Linear *w, int source, const uint8_t *row, int64_t G, int c, int64_t b0, int64_t b1);
INTERNAL int pack_q8l(const Linear *w, int source, const uint8_t *row, int64_t G, int c, int64_t b0, int64_t b1);
INTERNAL int pack_q5l(const Linear *w, int source, const uint8_t *row, int64_t G, int c, int64_t b0, int64_t b1);
INTERNAL int pack_iq4l(const Linear *w, int source, const uint8_t *row, int64_t G, int c, int64_t b0, int64_t b1);
/* The row panels' widening per type (gemm.c). */
INTERNAL void q4_panel_row(const Linear *w, int64_t j, int16_t *dst, float *scale);
INTERNAL void q8_panel_row(const Linear *w, int64_t j, int16_t *dst, float *scale);
INTERNAL void q8g_panel_row(const Linear *w, int64_t j, int16_t *dst, float *scale);

/* The path `w` takes for `rows` rows (prompt rows: `prompt`) under tuning `t` (linear.c). */
INTERNAL int choose_path(const Linear *w, int64_t rows, int prompt, const Tuning *t);
/* Whether a path reads quantized rows (into the QuantizedRows the caller fills). */
static inline int reads_quantized(int path) {
    return path == PATH_QUANTIZED || path == PATH_INVARIANT || path == PATH_INT_GEMM;
}
/* Floats of the per-thread buffer `team_linear` needs for `w` on `path` at `rows` rows (a multiple of 16). */
INTERNAL int64_t path_buffer_floats(const Linear *w, int path, int64_t rows);
/* y = x Wᵀ (+ bias) on `path`, run by every thread of the calling team (y complete when it returns): x [rows, K]
 * float32 (ldx apart) and, for the paths that read them, the same rows in xq (for PATH_INT_GEMM with room for
 * lanes); `buffer` this thread's path_buffer_floats. */
INTERNAL void team_linear(const Linear *w, int path, const float *x, int64_t ldx, const QuantizedRows *xq,
                          int64_t rows, float *y, int64_t ldy, float *buffer);
/* The whole call on its own threads (the op-at-a-time entry, the fused step's LM head): `path` a PATH_*, or the
 * chooser's for decode or prompt rows; -1 when out of memory, -2 for a path `w` has no kernel for. */
int kettle_linear(const Linear *w, const float *x, int64_t ldx, int64_t rows, float *y, int64_t ldy, int path,
                  const Tuning *tuning, int threads);
/* Each row's first maximum and its log-softmax value (cpu_kernels.c; the greedy steps run it too). */
INTERNAL void greedy_rows(const float *scores, int64_t rows, int64_t vocab, int64_t ld, int64_t *ids, float *logprobs,
                          int threads);

/* ---- float32 tiles for several activation rows: each output channel's weights are dequantized once into a
 * per-thread buffer, then every row multiplies them in float32 (exact to the dequantized weights), three channels
 * by four rows at a time. From a few rows on this beats the quantized-activation dot products, whose per-block
 * conversions and scale products grow with the rows while the float32 tile costs one FMA per 8 weights and row
 * (thresholds measured in kettle/kernels/ops.py). */

/* Row j of a Q4 weight as K floats. */
static inline void q4_dequant_row(const Linear *w, int64_t j, float *dst) {
    const int64_t k = w->k, groups = k / w->group;
    const uint8_t *qw = (const uint8_t *)w->weight + j * (k / 2);
    const uint16_t *scales = (const uint16_t *)w->scales + j * groups;
    const Minimums mins = channel_minimums(w->mins, w->scales, groups, j);
    for (int64_t c = 0; c < k / 64; c++) {
        __m256i halves[2];
        q4_chunk(qw + c * 32, halves);
        for (int h = 0; h < 2; h++) {
            const int64_t col = c * 64 + h * 32, g = col / w->group;
            __m256 v[4];
            q4_dequant(halves[h], _mm256_set1_ps(_cvtsh_ss(scales[g])), _mm256_set1_ps(minimum_at(mins, g)), v);
            for (int i = 0; i < 4; i++) _mm256_storeu_ps(dst + col + 8 * i, v[i]);
        }
    }
}

/* Row j of a Q8 weight as K floats, without its scale (applied once to each output instead). */
static inline void q8_widen_row(const Linear *w, int64_t j, float *dst) {
    const int8_t *qw = (const int8_t *)w->weight + j * w->k;
    for (int64_t col = 0; col < w->k; col += 16) {
        const __m128i bytes = _mm_loadu_si128((const __m128i *)(qw + col));
        _mm256_storeu_ps(dst + col, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(bytes)));
        _mm256_storeu_ps(dst + col + 8, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(bytes, 8))));
    }
}

/* Row j of a Q8G weight as K floats: q · d per block (exactly GGUF's Q8_0 dequantization). */
static inline void q8g_dequant_row(const Linear *w, int64_t j, float *dst) {
    const int8_t *qw = (const int8_t *)w->weight + j * w->k;
    const uint16_t *scales = (const uint16_t *)w->scales + j * (w->k / 32);
    for (int64_t b = 0; b < w->k / 32; b++) {
        const __m256 d = _mm256_set1_ps(_cvtsh_ss(scales[b]));
        for (int64_t col = b * 32; col < b * 32 + 32; col += 16) {
            const __m128i bytes = _mm_loadu_si128((const __m128i *)(qw + col));
            _mm256_storeu_ps(dst + col, _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(bytes)), d));
            _mm256_storeu_ps(dst + col + 8, _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(bytes, 8))), d));
        }
    }
}

/* Channel c's 16 bytes of 4 quad vectors of a lanes block (`quads`: the first vector's start) as stored: its quad m
 * of the int8 rows' order (and m + 4, for nibbles), what the integer panels widen. Four 4-byte pieces 64 bytes apart
 * inserted one by one (four stores read back as one 16-byte load stall on store forwarding, in every block the
 * prefill panels widen). */
static inline __m128i lanes_quads(const uint8_t *quads, int64_t c) {
    const uint8_t *p = quads + 4 * c;
    uint32_t piece[4];
    for (int m = 0; m < 4; m++) memcpy(piece + m, p + 64 * m, 4);
    return _mm_setr_epi32((int)piece[0], (int)piece[1], (int)piece[2], (int)piece[3]);
}

/* `lanes_quads` in unit order: byte 2u + e is its byte of input 2u + e (and 16 + 2u + e, for nibbles) as in the
 * file's blocks (quad order is its own inverse). */
static inline __m128i channel_quads(const uint8_t *quads, int64_t c) { return quad_order16(lanes_quads(quads, c)); }

/* Block b of channel j of a Q4L weight as 16 bytes: byte i holds input i of the block in its low nibble and input
 * 16 + i in its high nibble. */
static inline __m128i q4l_block(const Linear *w, int64_t j, int64_t b) {
    return channel_quads((const uint8_t *)w->weight + (j / 16 * (w->k / 32) + b) * 256, j % 16);
}

/* Channel j's scale and minimum of group g of a Q4L weight (a symmetric weight's minimum -8 · scale, exactly). */
static inline void q4l_scale(const Linear *w, int64_t j, int64_t g, float *scale, float *minimum) {
    const int64_t at = (j / 16 * (w->k / w->group) + g) * 16 + j % 16;
    if (w->supers) { /* Q4_K's scales: d · sc and -(dmin · m), as the tiles subtract `q4k_minimum` (lanes.c) */
        const uint16_t *super = w->supers + (j / 16 * (w->k / 256) + g / 8) * 32 + j % 16;
        *scale = _cvtsh_ss(super[0]) * (float)((const uint8_t *)w->scales)[at];
        *minimum = -(_cvtsh_ss(super[16]) * (float)((const uint8_t *)w->mins)[at]);
        return;
    }
    *scale = _cvtsh_ss(((const uint16_t *)w->scales)[at]);
    *minimum = w->mins ? _cvtsh_ss(w->mins[at]) : -8.0f * *scale;
}

/* Row j of a Q4L weight as K floats: q · scale + minimum, one fused multiply-add as `q4_dequant`. */
static inline void q4l_dequant_row(const Linear *w, int64_t j, float *dst) {
    const __m128i mask = _mm_set1_epi8(0x0F);
    for (int64_t b = 0; b < w->k / 32; b++) {
        const __m128i bytes = q4l_block(w, j, b);
        float d, m;
        q4l_scale(w, j, b * 32 / w->group, &d, &m);
        const __m256i q = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(bytes, 4), mask), _mm_and_si128(bytes, mask));
        __m256 v[4];
        q4_dequant(q, _mm256_set1_ps(d), _mm256_set1_ps(m), v);
        for (int i = 0; i < 4; i++) _mm256_storeu_ps(dst + b * 32 + 8 * i, v[i]);
    }
}

/* Block b of channel j of a Q5L weight: its 32 values q (0..31) in input order, one a byte. */
static inline __m256i q5l_block(const Linear *w, int64_t j, int64_t b) {
    const uint8_t *base = (const uint8_t *)w->weight + (j / 16 * (w->k / 32) + b) * 320;
    const __m128i bytes = channel_quads(base + Q5L_QUADS, j % 16), mask = _mm_set1_epi8(0x0F);
    const __m256i nibbles = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(bytes, 4), mask), _mm_and_si128(bytes, mask));
    /* The fifth bits in vectors (the panels widen every block of every channel per call): the channel's 4 plane bytes
     * broadcast, input i(m, t) taking byte t's bit m (its low lane) or bit 4 + m (16 + i(m, t), the high one). */
    int32_t planes;
    memcpy(&planes, base + Q5L_PLANES + 4 * (j % 16), 4);
    const __m256i source = _mm256_setr_epi8(0, 2, 1, 3, 0, 2, 1, 3, 0, 2, 1, 3, 0, 2, 1, 3,
                                            0, 2, 1, 3, 0, 2, 1, 3, 0, 2, 1, 3, 0, 2, 1, 3);
    const __m256i bit = _mm256_setr_epi8(1, 1, 1, 1, 2, 2, 2, 2, 4, 4, 4, 4, 8, 8, 8, 8, 16, 16, 16, 16, 32, 32, 32, 32,
                                         64, 64, 64, 64, (char)128, (char)128, (char)128, (char)128);
    const __m256i spread = _mm256_and_si256(_mm256_shuffle_epi8(_mm256_set1_epi32(planes), source), bit);
    const __m256i fifth = _mm256_and_si256(_mm256_cmpeq_epi8(spread, bit), _mm256_set1_epi8(0x10));
    return _mm256_or_si256(nibbles, fifth);
}

/* Row j of a Q5L weight as K floats: q · (d · sc) - dmin · m, one fused multiply-add as `q4_dequant`. */
static inline void q5l_dequant_row(const Linear *w, int64_t j, float *dst) {
    for (int64_t b = 0; b < w->k / 32; b++) {
        float d, m;
        q4l_scale(w, j, b, &d, &m);
        __m256 v[4];
        q4_dequant(q5l_block(w, j, b), _mm256_set1_ps(d), _mm256_set1_ps(m), v);
        for (int i = 0; i < 4; i++) _mm256_storeu_ps(dst + b * 32 + 8 * i, v[i]);
    }
}

/* Channel j's weight scale of block b of an IQ4L weight: d · (ls - 32), exact in float32. */
static inline float iq4l_scale(const Linear *w, int64_t j, int64_t b) {
    const int8_t sc = ((const int8_t *)w->scales)[(j / 16 * (w->k / 32) + b) * 16 + j % 16];
    return _cvtsh_ss(w->supers[(j / 16 * (w->k / 256) + b / 8) * 16 + j % 16]) * (float)sc;
}

/* Block b of channel j of an IQ4L weight: its 32 grid values in input order, as int8. */
static inline __m256i iq4l_block(const Linear *w, int64_t j, int64_t b) {
    const __m128i bytes = q4l_block(w, j, b), mask = _mm_set1_epi8(0x0F);
    const __m128i grid = _mm_loadu_si128((const __m128i *)IQ4_VALUES);
    const __m128i low = _mm_shuffle_epi8(grid, _mm_and_si128(bytes, mask));
    const __m128i high = _mm_shuffle_epi8(grid, _mm_and_si128(_mm_srli_epi16(bytes, 4), mask));
    return _mm256_set_m128i(high, low);
}

/* Row j of an IQ4L weight as K floats: (d · (ls - 32)) · value, gguf's products bit for bit (each exact). */
static inline void iq4l_dequant_row(const Linear *w, int64_t j, float *dst) {
    for (int64_t b = 0; b < w->k / 32; b++) {
        const __m256i v = iq4l_block(w, j, b);
        const __m256 scale = _mm256_set1_ps(iq4l_scale(w, j, b));
        for (int h = 0; h < 2; h++) {
            const __m128i bytes = h ? _mm256_extracti128_si256(v, 1) : _mm256_castsi256_si128(v);
            _mm256_storeu_ps(dst + b * 32 + h * 16, _mm256_mul_ps(scale, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(bytes))));
            _mm256_storeu_ps(dst + b * 32 + h * 16 + 8, _mm256_mul_ps(scale, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(bytes, 8)))));
        }
    }
}

/* Block b of channel j of a Q8L weight: its 32 int8 values in input order (16 from each half of its quad vectors). */
static inline __m256i q8l_block(const Linear *w, int64_t j, int64_t b) {
    const uint8_t *quads = (const uint8_t *)w->weight + (j / 16 * (w->k / 32) + b) * 512;
    return _mm256_set_m128i(channel_quads(quads + 256, j % 16), channel_quads(quads, j % 16));
}

/* Channel j's scale of block b of a Q8L weight. */
static inline float q8l_scale(const Linear *w, int64_t j, int64_t b) {
    return _cvtsh_ss(((const uint16_t *)w->scales)[(j / 16 * (w->k / 32) + b) * 16 + j % 16]);
}

/* Row j of a Q8L weight as K floats: q · d per block, as `q8g_dequant_row`. */
static inline void q8l_dequant_row(const Linear *w, int64_t j, float *dst) {
    for (int64_t b = 0; b < w->k / 32; b++) {
        const __m256i q = q8l_block(w, j, b);
        const __m256 d = _mm256_set1_ps(q8l_scale(w, j, b));
        for (int h = 0; h < 2; h++) {
            const __m128i bytes = h ? _mm256_extracti128_si256(q, 1) : _mm256_castsi256_si128(q);
            _mm256_storeu_ps(dst + b * 32 + h * 16, _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(bytes)), d));
            _mm256_storeu_ps(dst + b * 32 + h * 16 + 8, _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(bytes, 8))), d));
        }
    }
}

/* Block b of channel j of a Q6L weight: its 32 values q - 32 (-32..31) in input order, as two vectors of 16 bytes
 * (inputs 0..15, 16..31): the low bits as a Q4L block's, the high bits from the channel's 4 bytes of each high-bits
 * vector, spread to quad vector m's place (even m's the high nibble) and put in input order as `channel_quads`. */
static inline void q6l_block(const Linear *w, int64_t j, int64_t b, __m128i q[2]) {
    const uint8_t *block = (const uint8_t *)w->weight + (j / 16 * (w->k / 32) + b) * 384;
    const __m128i nibbles = channel_quads(block, j % 16), mask = _mm_set1_epi8(0x0F), two = _mm_set1_epi8(3);
    uint32_t high[2];
    for (int p = 0; p < 2; p++) memcpy(high + p, block + 256 + 64 * p + 4 * (j % 16), 4);
    const __m128i spread = _mm_shuffle_epi8(_mm_setr_epi32((int)high[0], (int)high[1], 0, 0),
                                            _mm_setr_epi8(0, 1, 2, 3, 0, 1, 2, 3, 4, 5, 6, 7, 4, 5, 6, 7));
    const __m128i even_m = _mm_setr_epi32(-1, 0, -1, 0);
    /* byte i: input i's high 2 bits at 0-1, input 16 + i's at 2-3 */
    const __m128i fields = quad_order16(_mm_and_si128(_mm_blendv_epi8(spread, _mm_srli_epi16(spread, 4), even_m), mask));
    const __m128i first = _mm_slli_epi16(_mm_and_si128(fields, two), 4);
    const __m128i second = _mm_slli_epi16(_mm_and_si128(_mm_srli_epi16(fields, 2), two), 4);
    const __m128i offset = _mm_set1_epi8(32);
    q[0] = _mm_sub_epi8(_mm_or_si128(_mm_and_si128(nibbles, mask), first), offset);
    q[1] = _mm_sub_epi8(_mm_or_si128(_mm_and_si128(_mm_srli_epi16(nibbles, 4), mask), second), offset);
}

/* Channel j's weight scale per sub-block of 16 inputs of a Q6L weight (K/16 floats): d · sc, exact in float32. */
static inline void q6l_scales(const Linear *w, int64_t j, float *scale) {
    const int8_t *sc = (const int8_t *)w->scales + j / 16 * (w->k / 16) * 16 + j % 16;
    const uint16_t *d = w->supers + j / 16 * (w->k / 256) * 16 + j % 16;
    for (int64_t s = 0; s < w->k / 16; s++) scale[s] = _cvtsh_ss(d[s / 16 * 16]) * (float)sc[s * 16];
}

/* Row j of a Q6L weight as K floats: (d · sc) · (q - 32), the products GGUF's dequantization forms, bit for bit. */
static inline void q6l_dequant_row(const Linear *w, int64_t j, float *dst) {
    float scale[w->k / 16];
    q6l_scales(w, j, scale);
    for (int64_t b = 0; b < w->k / 32; b++) {
        __m128i q[2];
        q6l_block(w, j, b, q);
        for (int h = 0; h < 2; h++) {
            const __m256 d = _mm256_set1_ps(scale[2 * b + h]);
            float *out = dst + b * 32 + 16 * h;
            _mm256_storeu_ps(out, _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q[h]))));
            _mm256_storeu_ps(out + 8, _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(q[h], 8)))));
        }
    }
}

/* Row j of a float32 weight (the fused step's dense projections and embedding tables). */
static inline void f32_row(const Linear *w, int64_t j, float *dst) {
    memcpy(dst, (const float *)w->weight + j * w->k, sizeof(float) * (size_t)w->k);
}

/* Channel j of any weight as K floats, without a per-channel scale (`WeightType.channel_scale`). */
static inline void dequant_channel(const Linear *w, int64_t j, float *dst) { type_of(w)->dequantize(w, j, dst); }

/* Output channels 3p .. 3p + 2 (fewer at the end) for all `rows` rows of x: y[m, j] = scale_j · (x[m] · w_j) +
 * bias_j. `buffer` holds 3·K floats. K is a multiple of 8. Four rows by three channels make twelve accumulators:
 * each x load feeds three FMAs, which keeps the rows' loads (from L2 once several rows no longer fit L1) below
 * what the FMAs consume. */
#define TILE_CHANNELS 3
static inline void linear_channels_f32(const Linear *w, int64_t p, const float *x, int64_t ldx, int64_t rows, float *y,
                                       int64_t ldy, float *buffer) {
    const WeightType *type = type_of(w);
    const int64_t j = TILE_CHANNELS * p, k = w->k;
    const int count = w->n - j < TILE_CHANNELS ? (int)(w->n - j) : TILE_CHANNELS;
    float scale[TILE_CHANNELS], bias[TILE_CHANNELS];
    const float *wc[TILE_CHANNELS];
    for (int c = 0; c < TILE_CHANNELS; c++) {
        const int64_t channel = j + (c < count ? c : 0); /* a short last tile repeats its first channel */
        if (!type->quantized) {
            wc[c] = (const float *)w->weight + channel * k; /* already float32: read in place */
        } else {
            wc[c] = buffer + (c < count ? c : 0) * k;
            if (c < count) dequant_channel(w, channel, buffer + c * k);
        }
        scale[c] = type->channel_scale ? ((const float *)w->scales)[channel] : 1.0f;
        bias[c] = w->bias ? w->bias[channel] : 0.0f;
    }
    int64_t m = 0;
    for (; m + 4 <= rows; m += 4) {
        __m256 acc[4][TILE_CHANNELS];
        for (int r = 0; r < 4; r++)
            for (int c = 0; c < TILE_CHANNELS; c++) acc[r][c] = _mm256_setzero_ps();
        const float *xm = x + m * ldx;
        for (int64_t i = 0; i < k; i += 8) {
            const __m256 v0 = _mm256_loadu_ps(wc[0] + i), v1 = _mm256_loadu_ps(wc[1] + i), v2 = _mm256_loadu_ps(wc[2] + i);
            for (int r = 0; r < 4; r++) {
                const __m256 xv = _mm256_loadu_ps(xm + r * ldx + i);
                acc[r][0] = _mm256_fmadd_ps(v0, xv, acc[r][0]);
                acc[r][1] = _mm256_fmadd_ps(v1, xv, acc[r][1]);
                acc[r][2] = _mm256_fmadd_ps(v2, xv, acc[r][2]);
            }
        }
        for (int r = 0; r < 4; r++)
            for (int c = 0; c < count; c++) y[(m + r) * ldy + j + c] = hsum(acc[r][c]) * scale[c] + bias[c];
    }
    for (; m < rows; m++) {
        __m256 acc[TILE_CHANNELS];
        for (int c = 0; c < TILE_CHANNELS; c++) acc[c] = _mm256_setzero_ps();
        for (int64_t i = 0; i < k; i += 8) {
            const __m256 xv = _mm256_loadu_ps(x + m * ldx + i);
            for (int c = 0; c < TILE_CHANNELS; c++) acc[c] = _mm256_fmadd_ps(_mm256_loadu_ps(wc[c] + i), xv, acc[c]);
        }
        for (int c = 0; c < count; c++) y[m * ldy + j + c] = hsum(acc[c]) * scale[c] + bias[c];
    }
}

/* ---- element-wise rows of a decoder layer (float32) ---- */

/* e^x for 8 floats (Cephes' polynomial on a range-reduced argument; relative error ~2e-7). */
static inline __m256 exp_ps(__m256 x) {
    x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.3f)), _mm256_set1_ps(88.3f));
    const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)), _MM_FROUND_TO_NEAREST_INT);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
    __m256 p = _mm256_set1_ps(1.9875691500e-4f);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
    p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
    const __m256i bits = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(bits));
}

/* dst = x · rsqrt(mean(x²) + eps) · weight over `dim`; with `residual`, x is first replaced by residual + x,
 * which is also written to `total` (the residual stream the next block adds to; it may be `residual` itself). */
static inline void rms_norm_row(
    const float *x, const float *residual, const float *weight, int64_t dim, float eps, float *dst, float *total
) {
    if (residual) {
        for (int64_t i = 0; i < dim; i++) total[i] = residual[i] + x[i];
        x = total;
    }
    __m256 acc = _mm256_setzero_ps();
    int64_t i = 0;
    for (; i + 8 <= dim; i += 8) {
        const __m256 v = _mm256_loadu_ps(x + i);
        acc = _mm256_fmadd_ps(v, v, acc);
    }
    float squares = hsum(acc);
    for (; i < dim; i++) squares += x[i] * x[i];
    const float inv = 1.0f / sqrtf(squares / (float)dim + eps);
    for (i = 0; i < dim; i++) dst[i] = x[i] * inv * weight[i];
}

/* dst[n] = silu(gate) · up over n elements: each element its own, so a row's pieces give the whole row's bits. */
static inline void silu_mul_span(const float *gate, const float *up, int64_t inner, float *dst) {
    int64_t i = 0;
    for (; i + 8 <= inner; i += 8) {
        const __m256 g = _mm256_loadu_ps(gate + i);
        const __m256 sig = _mm256_div_ps(g, _mm256_add_ps(_mm256_set1_ps(1.0f), exp_ps(_mm256_sub_ps(_mm256_setzero_ps(), g))));
        _mm256_storeu_ps(dst + i, _mm256_mul_ps(sig, _mm256_loadu_ps(up + i)));
    }
    for (; i < inner; i++) dst[i] = gate[i] / (1.0f + expf(-gate[i])) * up[i];
}

/* dst[n] = gelu_tanh(gate) · up over n elements, GELU's tanh approximation (Gemma's gate):
 * 0.5·g·(1 + tanh(√(2/π)·(g + 0.044715·g³))), with tanh(u) = 1 − 2 / (e^{2u} + 1). */
static inline void gelu_tanh_mul_span(const float *gate, const float *up, int64_t inner, float *dst) {
    const float c = 0.7978845608028654f, cube = 0.044715f;
    int64_t i = 0;
    for (; i + 8 <= inner; i += 8) {
        const __m256 g = _mm256_loadu_ps(gate + i), one = _mm256_set1_ps(1.0f);
        const __m256 u = _mm256_mul_ps(_mm256_set1_ps(c), _mm256_fmadd_ps(_mm256_mul_ps(_mm256_set1_ps(cube), g), _mm256_mul_ps(g, g), g));
        const __m256 e = exp_ps(_mm256_add_ps(u, u));
        const __m256 t = _mm256_sub_ps(one, _mm256_div_ps(_mm256_set1_ps(2.0f), _mm256_add_ps(e, one)));
        const __m256 gelu = _mm256_mul_ps(_mm256_mul_ps(_mm256_set1_ps(0.5f), g), _mm256_add_ps(one, t));
        _mm256_storeu_ps(dst + i, _mm256_mul_ps(gelu, _mm256_loadu_ps(up + i)));
    }
    for (; i < inner; i++) {
        const float g = gate[i], t = 1.0f - 2.0f / (expf(2.0f * c * (g + cube * g * g * g)) + 1.0f);
        dst[i] = 0.5f * g * (1.0f + t) * up[i];
    }
}

/* RoPE in the halves layout for `heads` heads of one token: dst[h, i] = src[h, i] · cos[i] +
 * src[h, (i + D/2) % D] · sin[i], with sin already signed; heads are `dim` floats apart in both. */
static inline void rope_row(const float *src, const float *cos, const float *sin, int64_t heads, int64_t dim, float *dst) {
    const int64_t half = dim / 2;
    for (int64_t h = 0; h < heads; h++, src += dim, dst += dim) {
        for (int64_t i = 0; i < half; i++) dst[i] = src[i] * cos[i] + src[i + half] * sin[i];
        for (int64_t i = half; i < dim; i++) dst[i] = src[i] * cos[i] + src[i - half] * sin[i];
    }
}

/* ---- paged decode attention (float32 math over a cache of any KV_* type): one new query token per sequence,
 * its K/V read in place from the
 * paged cache (no gather of the context into a contiguous copy). Work items are (sequence, KV head) pairs;
 * the `group` query heads sharing a KV head are scored together so each K/V row is loaded once. */

static inline float dot_f32(const float *a, const float *b, int64_t n) {
    __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) {
        acc0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc0);
        acc1 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i + 8), _mm256_loadu_ps(b + i + 8), acc1);
    }
    float total = hsum(_mm256_add_ps(acc0, acc1));
    for (; i < n; i++) total += a[i] * b[i];
    return total;
}

static inline void axpy_f32(float *y, float a, const float *x, int64_t n) {
    const __m256 va = _mm256_set1_ps(a);
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) _mm256_storeu_ps(y + i, _mm256_fmadd_ps(va, _mm256_loadu_ps(x + i), _mm256_loadu_ps(y + i)));
    for (; i < n; i++) y[i] += a * x[i];
}

/* ---- the KV cache's element type. With `--kv-cache-dtype fp16 | bf16` the cache holds K/V in 16 bits (half
 * the memory per token, so twice the tokens in the same budget) while every product and sum stays float32:
 * elements are widened as they are loaded and rounded to nearest-even once, when a row is written. The helpers
 * take the type as an argument that is a compile-time constant wherever the callers dispatch on it (once per
 * call, through always_inline), so the float32 path compiles to the plain loads it always had and no element
 * pays a branch. */
enum { KV_F32 = 0, KV_F16 = 1, KV_BF16 = 2 }; /* kettle/kernels/ops.py's KV_DTYPES */

static inline int64_t kv_size(int dtype) { return dtype == KV_F32 ? 4 : 2; }

/* Elements i .. i + 7 of a K/V array of `dtype` as floats. bfloat16 is the high half of a float32: a shift. */
static inline __attribute__((always_inline)) __m256 load8_kv(const void *base, int64_t i, int dtype) {
    if (dtype == KV_F32) return _mm256_loadu_ps((const float *)base + i);
    const __m128i half = _mm_loadu_si128((const __m128i *)((const uint16_t *)base + i));
    if (dtype == KV_F16) return _mm256_cvtph_ps(half);
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(half), 16));
}

/* Element i of a K/V array of `dtype` as a float. */
static inline __attribute__((always_inline)) float load1_kv(const void *base, int64_t i, int dtype) {
    if (dtype == KV_F32) return ((const float *)base)[i];
    const uint16_t half = ((const uint16_t *)base)[i];
    if (dtype == KV_F16) return _cvtsh_ss(half);
    const uint32_t bits = (uint32_t)half << 16;
    float value;
    memcpy(&value, &bits, sizeof value);
    return value;
}

/* float32 → bfloat16, rounded to nearest-even as PyTorch's `.to(torch.bfloat16)` (NaN → 0x7FC0). */
static inline uint16_t bf16_round(float value) {
    uint32_t bits;
    memcpy(&bits, &value, sizeof bits);
    if ((bits & 0x7FFFFFFFu) > 0x7F800000u) return 0x7FC0;
    return (uint16_t)((bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16);
}

/* 8 floats → 8 bfloat16, as `bf16_round`. */
static inline __m128i bf16_round8(__m256 v) {
    const __m256i bits = _mm256_castps_si256(v);
    const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
    __m256i r = _mm256_srli_epi32(_mm256_add_epi32(bits, _mm256_add_epi32(odd, _mm256_set1_epi32(0x7FFF))), 16);
    r = _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7FC0), _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q)));
    return _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1)); /* values fit 16 bits */
}

/* dst[0 .. n) (a K/V row of `dtype`) = src[0 .. n) float32, rounded to nearest-even when 16-bit. */
static inline void store_kv_row(void *dst, const float *src, int64_t n, int dtype) {
    if (dtype == KV_F32) {
        memcpy(dst, src, sizeof(float) * (size_t)n);
        return;
    }
    uint16_t *out = dst;
    int64_t i = 0;
    if (dtype == KV_F16) {
        for (; i + 8 <= n; i += 8)
            _mm_storeu_si128((__m128i *)(out + i), _mm256_cvtps_ph(_mm256_loadu_ps(src + i), _MM_FROUND_TO_NEAREST_INT));
        for (; i < n; i++) out[i] = _cvtss_sh(src[i], _MM_FROUND_TO_NEAREST_INT);
    } else {
        for (; i + 8 <= n; i += 8) _mm_storeu_si128((__m128i *)(out + i), bf16_round8(_mm256_loadu_ps(src + i)));
        for (; i < n; i++) out[i] = bf16_round(src[i]);
    }
}

/* a · b[off ..] over n elements, b a K/V array of `dtype` (two chains, as `dot_f32`). */
static inline __attribute__((always_inline)) float dot_kv(const float *a, const void *b, int64_t off, int64_t n,
                                                          int dtype) {
    __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) {
        acc0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), load8_kv(b, off + i, dtype), acc0);
        acc1 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i + 8), load8_kv(b, off + i + 8, dtype), acc1);
    }
    float total = hsum(_mm256_add_ps(acc0, acc1));
    for (; i < n; i++) total += a[i] * load1_kv(b, off + i, dtype);
    return total;
}

/* y += a · x[off ..] over n elements, x a K/V array of `dtype`. */
static inline __attribute__((always_inline)) void axpy_kv(float *y, float a, const void *x, int64_t off, int64_t n,
                                                          int dtype) {
    const __m256 va = _mm256_set1_ps(a);
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) _mm256_storeu_ps(y + i, _mm256_fmadd_ps(va, load8_kv(x, off + i, dtype), _mm256_loadu_ps(y + i)));
    for (; i < n; i++) y[i] += a * load1_kv(x, off + i, dtype);
}

/* The shape of one paged decode attention call. */
typedef struct {
    const void *k_cache, *v_cache; /* [slots, kv_heads, dim] of kv_dtype */
    const int64_t *tables;         /* [seqs, max_blocks] */
    const int64_t *positions;      /* [seqs]: of the new token; the context is position + 1 long */
    int64_t max_blocks, heads, kv_heads, dim, block_size, window; /* window > 0: the last `window` positions */
    float scale;
    float softcap; /* > 0: scores → softcap · tanh(scores / softcap) after scaling (Gemma 2); 0: none */
    int kv_dtype; /* KV_F32 (0, what an initializer that leaves it out gets), KV_F16 or KV_BF16 */
    /* Each context cut into `parts` pieces (`context_parts`, at least 1; 1: whole); then `partials` holds a record of
     * dim + 2 floats per (sequence, query head, piece): the piece's unnormalized output, softmax maximum and sum. */
    int64_t parts;
    float *partials;
    /* 1 (batch invariance): each sequence cut as it would be alone (`sequence_parts`), so its bits do not
     * depend on the batch; `parts` is then the most any sequence of the call takes. 0: every one into `parts`. */
    int per_sequence;
    int threads;
} PagedDecode;

#define MAX_PARTS 32 /* pieces of one context at most: 2 a thread for batch 1 on 16 threads */
extern int kettle_context_parts; /* at most this many (cpu_kernels.c; 1 turns cutting off, for measurement) */
#define PART_KEYS 32 /* keys of a piece at least (an item is every head: 32 keys of SmolLM2-1.7B are 256 KiB of K/V) */

/* Pieces per context for a call, so that its items (sequences × pieces, each over every head: decode_attention.c)
 * give every thread work: one sequence on 2 threads was one item, one thread idle; a long context at batch 1 on 16
 * threads left most of them idle. 1 (no cut) when the call has 2 items per thread already or its contexts are
 * short. */
static inline int64_t context_parts(int64_t longest, int64_t seqs, int threads) {
    if (seqs >= 2 * (int64_t)threads) return 1;
    int64_t parts = (2 * threads + seqs - 1) / seqs;
    if (parts > longest / PART_KEYS) parts = longest / PART_KEYS;
    if (parts > kettle_context_parts) parts = kettle_context_parts;
    return parts < 1 ? 1 : parts > MAX_PARTS ? MAX_PARTS : parts;
}

/* Pieces of sequence s's context in a call: the call's `parts`, or with `per_sequence` as many as the sequence
 * alone on the same threads would take (a cut changes the softmax's sums, so the count must follow the sequence,
 * not its batch). */
static inline int64_t sequence_parts(const PagedDecode *p, int64_t s) {
    return p->per_sequence ? context_parts(p->positions[s] + 1, 1, p->threads) : p->parts;
}

/* The longest context of the call, which sizes each thread's scores (heads · (longest + 1) floats). */
static inline int64_t longest_context(const int64_t *positions, int64_t seqs) {
    int64_t longest = 0;
    for (int64_t s = 0; s < seqs; s++) longest = positions[s] + 1 > longest ? positions[s] + 1 : longest;
    return longest;
}

/* A call's `parts` over `seqs` sequences (`per_sequence`: the most any of them takes alone). */
static inline int64_t call_parts(const int64_t *positions, int64_t seqs, int threads, int per_sequence) {
    return context_parts(longest_context(positions, seqs), per_sequence ? 1 : seqs, threads);
}

/* Floats of a call's partials. */
static inline int64_t partial_floats(int64_t seqs, int64_t heads, int64_t parts, int64_t dim) {
    return seqs * heads * parts * (dim + 2);
}


/* tanh(u) = 1 − 2 / (e^{2u} + 1) for 8 floats (exp_ps saturates, so large |u| gives ±1). */
static inline __m256 tanh_ps(__m256 u) {
    const __m256 one = _mm256_set1_ps(1.0f);
    return _mm256_sub_ps(one, _mm256_div_ps(_mm256_set1_ps(2.0f), _mm256_add_ps(exp_ps(_mm256_add_ps(u, u)), one)));
}

/* x → cap · tanh(x / cap) over n scores in place (Gemma 2's attention logit soft-capping). */
static inline void softcap_rows(float *x, int64_t n, float cap) {
    const __m256 vcap = _mm256_set1_ps(cap), inv = _mm256_set1_ps(1.0f / cap);
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) _mm256_storeu_ps(x + i, _mm256_mul_ps(vcap, tanh_ps(_mm256_mul_ps(_mm256_loadu_ps(x + i), inv))));
    for (; i < n; i++) x[i] = cap * tanhf(x[i] / cap);
}

/* The softmax of each of the `group` rows of `span` scores, in place; with `tops`, the rows are left unnormalized
 * (e^{score − top}) and each row's maximum and sum go to tops[g · stride] and totals[g · stride]. */
static inline void softmax_rows(float *scores, int64_t group, int64_t span, float *tops, float *totals,
                                int64_t stride) {
    for (int64_t g = 0; g < group; g++) {
        float *row = scores + g * span, top = -INFINITY;
        int64_t i = 0;
        if (span >= 8) { /* the maximum 8 lanes at a time: a scalar fmaxf call per score cost ~10% of the item */
            __m256 maxima = _mm256_loadu_ps(row);
            for (i = 8; i + 8 <= span; i += 8) maxima = _mm256_max_ps(maxima, _mm256_loadu_ps(row + i));
            float lanes[8];
            _mm256_storeu_ps(lanes, maxima);
            for (int l = 0; l < 8; l++) top = fmaxf(top, lanes[l]);
        }
        for (; i < span; i++) top = fmaxf(top, row[i]);
        i = 0;
        __m256 sums = _mm256_setzero_ps();
        for (; i + 8 <= span; i += 8) {
            const __m256 e = exp_ps(_mm256_sub_ps(_mm256_loadu_ps(row + i), _mm256_set1_ps(top)));
            _mm256_storeu_ps(row + i, e);
            sums = _mm256_add_ps(sums, e);
        }
        float total = hsum(sums);
        for (; i < span; i++) total += (row[i] = expf(row[i] - top));
        if (tops) {
            tops[g * stride] = top, totals[g * stride] = total;
            continue;
        }
        const float inv = 1.0f / total;
        for (i = 0; i < span; i++) row[i] *= inv;
    }
}

/* Work item `item` of a decode attention call: (sequence, piece of the context), every head → out [S, H, D], or the
 * partials when the contexts are cut (then `combine_parts` finishes each query head). Compiled once, in
 * decode_attention.c: both the op-at-a-time entry and the fused step call it, and as a static function here it was
 * compiled into each of them (1.6 s of the fused step's 3.2 s of compiler time on a first start). */
INTERNAL void attend_item(const PagedDecode *p, const float *q, int64_t item,
                                                           float *scores, float *out);

/* One attention call over the paged cache (`kettle_attention`): decode, one new query token per sequence (`rows`
 * sequences at `positions`, block tables [rows, max_blocks]), or prefill, one sequence's `rows` new tokens at
 * positions cache_len .. (its block table [max_blocks]), their K/V already written. q rows ldq floats apart (decode:
 * contiguous [rows, heads, dim]); out [rows, heads, dim]; caches [slots, kv_heads, dim] of kv_dtype. */
typedef struct {
    int64_t prefill;
    const float *q;
    int64_t ldq;
    const void *k_cache, *v_cache;
    const int64_t *tables;
    int64_t max_blocks;
    const int64_t *positions; /* decode: of each new token; the context is position + 1 long */
    int64_t rows, cache_len, heads, kv_heads, dim, block_size, window; /* window > 0: the last `window` positions */
    float scale;
    int64_t kv_dtype;
    int64_t per_sequence; /* decode: contexts cut as each sequence alone would be (`PagedDecode.per_sequence`) */
    float *out;
} Attention;

/* prefill_attention.c's causal attention of one sequence's new tokens; -1 when out of memory. */
INTERNAL int paged_prefill(const float *q, int64_t ldq, const void *k_cache, const void *v_cache, const int64_t *table,
                           int64_t tokens, int64_t cache_len, int64_t heads, int64_t kv_heads, int64_t dim,
                           int64_t block_size, float scale, int64_t window, float *out, int kv_dtype, int threads);

/* Query head `head` (of all S · H) of a cut call: out = Σ_p e^{m_p − M} o_p / Σ_p e^{m_p − M} l_p over its pieces'
 * records (M the largest maximum m_p; a piece with no keys has m_p = −∞ and weighs 0). */
static inline void combine_parts(const PagedDecode *p, int64_t head, float *out) {
    const int64_t dim = p->dim, parts = p->parts, mine = sequence_parts(p, head / p->heads);
    if (mine == 1) return; /* not cut: its item wrote the output */
    const float *records = p->partials + head * parts * (dim + 2);
    float top = -INFINITY, total = 0.0f;
    for (int64_t i = 0; i < mine; i++) top = fmaxf(top, records[i * (dim + 2) + dim]);
    float *dst = out + head * dim;
    for (int64_t d = 0; d < dim; d++) dst[d] = 0.0f;
    for (int64_t i = 0; i < mine; i++) {
        const float *record = records + i * (dim + 2);
        if (record[dim + 1] == 0.0f) continue;
        const float weight = expf(record[dim] - top);
        total += weight * record[dim + 1];
        axpy_kv(dst, weight, record, 0, dim, KV_F32);
    }
    const float inv = 1.0f / total;
    for (int64_t d = 0; d < dim; d++) dst[d] *= inv;
}

/* A whole decode attention call over `seqs` sequences, run by the calling team (orphaned `omp for`s): every item
 * (sequence, piece) with this thread's `scores`, then, when the contexts are cut, each query head's pieces combined
 * into out. */
static inline void paged_attention(const PagedDecode *p, const float *q, int64_t seqs, float *scores, float *out) {
#pragma omp for schedule(dynamic, 1)
    for (int64_t item = 0; item < seqs * p->parts; item++) attend_item(p, q, item, scores, out);
    if (p->parts > 1) {
#pragma omp for schedule(static)
        for (int64_t head = 0; head < seqs * p->heads; head++) combine_parts(p, head, out);
    }
}

#endif
