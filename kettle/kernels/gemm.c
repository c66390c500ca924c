/* Prefill GEMM for int4/int8 weights: y[M, N] = x[M, K] · Wᵀ (+ bias) for prompt chunks of many rows.
 *
 * A prompt chunk is compute bound: every weight meets hundreds of rows. So the weight is dequantized panel by
 * panel, PANEL output channels at a time, into a per-thread float32 buffer laid out [K][PANEL] (74 KB at
 * K = 576: it stays in L2 while every row multiplies it), and never as a whole matrix. A register-blocked
 * micro-kernel then computes a tile of rows × PANEL outputs with broadcast-FMAs, keeping the whole tile in
 * registers over K: each weight vector loaded feeds one FMA per row of the tile, each broadcast activation one
 * per vector of the panel, so the loop runs at the FMA units' rate instead of the loads'. The result is exact to
 * the dequantized weights (the same products as a float32 GEMM over `kettle_q4_dequantize`'s matrix, summed in
 * another order).
 *
 * Two micro-kernels, chosen once per call: AVX-512 (12 rows × 32 channels, 24 accumulators) where the CPU has
 * it, else AVX2 (6 rows × 16 channels, 12 accumulators, run over each half of the panel). Threads split the
 * panels; rows go block by block so a block's activations stay in L2 while every panel of the thread meets them.
 *
 * Where the CPU has AVX-512 VNNI, the integer panels at the end of this file run instead (on an AVX2 CPU for the lanes
 * types with AVX2 tiles; `KETTLE_TUNING=integer-gemm=off` keeps these): int8 rows, as one row of decode quantizes
 * them, against the weights widened to u8.
 */
#include <omp.h>

#include "kernels.h"

#define PANEL 32 /* output channels per dequantized panel */
/* The panels' share of each thread handed out to whichever thread is free (`team_units`): the last half, where the
 * one-row kernels give out an eighth (linear.c SHARED_TAIL), since a panel is arithmetic on data in cache, not a
 * stream whose order the prefetcher follows. Zen 4, 2 threads, the 1.7B Q4_K_M file's 512-token prefill in process,
 * alternated medians, with another process busy on one core: static shares 60-71, an eighth 70-72, a half 73-90,
 * all of it 77-84 tok/s; on a quiet host all within the noise (bench/RESULTS.md). */
#define PANEL_TAIL 2

/* Eight rows of 8 floats (r[0..7], each 8 consecutive inputs of one channel) transposed in registers: r[t]
 * becomes input t's 8 channels. */
static inline void transpose8(__m256 r[8]) {
    __m256 t[8], u[8];
    for (int i = 0; i < 8; i += 2) t[i] = _mm256_unpacklo_ps(r[i], r[i + 1]), t[i + 1] = _mm256_unpackhi_ps(r[i], r[i + 1]);
    for (int i = 0; i < 8; i += 4) {
        u[i] = _mm256_shuffle_ps(t[i], t[i + 2], 0x44), u[i + 1] = _mm256_shuffle_ps(t[i], t[i + 2], 0xEE);
        u[i + 2] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0x44), u[i + 3] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0xEE);
    }
    for (int i = 0; i < 4; i++) {
        r[i] = _mm256_permute2f128_ps(u[i], u[i + 4], 0x20);
        r[i + 4] = _mm256_permute2f128_ps(u[i], u[i + 4], 0x31);
    }
}

/* Bytes 4c + t (v[t]) of a lanes quad vector's 64 (16 channels × 4 inputs, kernels.h): each input's 16 channels, the
 * block's inputs i(m, t) = 4m + QUAD_INPUT[t]. Each 4 channels' bytes grouped by t, then a 4 × 4 transpose of
 * 32-bit pieces. */
static inline void quad_inputs(const uint8_t *quads, __m128i v[4]) {
    const __m128i order = _mm_setr_epi8(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
    __m128i x[4];
    for (int i = 0; i < 4; i++) x[i] = _mm_shuffle_epi8(_mm_loadu_si128((const __m128i *)(quads + 16 * i)), order);
    const __m128i lo01 = _mm_unpacklo_epi32(x[0], x[1]), hi01 = _mm_unpackhi_epi32(x[0], x[1]);
    const __m128i lo23 = _mm_unpacklo_epi32(x[2], x[3]), hi23 = _mm_unpackhi_epi32(x[2], x[3]);
    v[0] = _mm_unpacklo_epi64(lo01, lo23), v[1] = _mm_unpackhi_epi64(lo01, lo23);
    v[2] = _mm_unpacklo_epi64(hi01, hi23), v[3] = _mm_unpackhi_epi64(hi01, hi23);
}

/* 16 values (u8 or s8 as `is_signed`) of one input for 16 channels, as floats at panel row `dst`: q · scale + minimum
 * (`q4_dequant`'s fused multiply-add) or, without minimums, q · scale (as `q8l_dequant_row`), lane by lane. */
static inline void panel_row16(__m128i q, int is_signed, const __m256 scale[2], const __m256 *minimum, float *dst) {
    for (int h = 0; h < 2; h++) {
        const __m128i part = h ? _mm_srli_si128(q, 8) : q;
        const __m256 v = _mm256_cvtepi32_ps(is_signed ? _mm256_cvtepi8_epi32(part) : _mm256_cvtepu8_epi32(part));
        _mm256_storeu_ps(dst + 8 * h, minimum ? _mm256_fmadd_ps(v, scale[h], minimum[h]) : _mm256_mul_ps(v, scale[h]));
    }
}

/* The 16 channels of lanes group G of a Q4L weight straight into panel columns (`panel` at the group's first column,
 * rows `ld` floats apart; the table's `panel_group`): each quad vector's bytes split by input once, no channel gathered
 * byte by byte and no transpose. The values are the table's `dequantize` ones, bit for bit. */
void q4l_panel_group(const Linear *w, int64_t G, float *panel, int64_t ld) {
    const int64_t blocks = w->k / 32;
    const uint8_t *base = (const uint8_t *)w->weight + G * blocks * 256;
    const __m128i mask = _mm_set1_epi8(0x0F);
    for (int64_t b = 0; b < blocks; b++) {
        float d[16], m[16];
        for (int c = 0; c < 16; c++) q4l_scale(w, G * 16 + c, b * 32 / w->group, d + c, m + c);
        const __m256 scale[2] = {_mm256_loadu_ps(d), _mm256_loadu_ps(d + 8)}, minimum[2] = {_mm256_loadu_ps(m), _mm256_loadu_ps(m + 8)};
        for (int m = 0; m < 4; m++) {
            __m128i v[4];
            quad_inputs(base + b * 256 + m * 64, v);
            for (int t = 0; t < 4; t++) {
                float *row = panel + (b * 32 + 4 * m + QUAD_INPUT[t]) * ld;
                panel_row16(_mm_and_si128(v[t], mask), 0, scale, minimum, row);
                panel_row16(_mm_and_si128(_mm_srli_epi16(v[t], 4), mask), 0, scale, minimum, row + 16 * ld);
            }
        }
    }
}

/* `q4l_panel_group` for a Q8L weight: each quad vector's bytes split by input, times the block's scales. */
void q8l_panel_group(const Linear *w, int64_t G, float *panel, int64_t ld) {
    const int64_t blocks = w->k / 32;
    const uint8_t *base = (const uint8_t *)w->weight + G * blocks * 512;
    for (int64_t b = 0; b < blocks; b++) {
        float d[16];
        for (int c = 0; c < 16; c++) d[c] = q8l_scale(w, G * 16 + c, b);
        const __m256 scale[2] = {_mm256_loadu_ps(d), _mm256_loadu_ps(d + 8)};
        for (int m = 0; m < 8; m++) {
            __m128i v[4];
            quad_inputs(base + b * 512 + m * 64, v);
            for (int t = 0; t < 4; t++) panel_row16(v[t], 1, scale, NULL, panel + (b * 32 + 4 * m + QUAD_INPUT[t]) * ld);
        }
    }
}

/* Channels j0 .. j0 + count - 1 of w dequantized into panel[i * PANEL + c] (channel j0 + c, input i); missing
 * channels of a short last panel are zero. `rows` holds 8·K floats: eight channels are dequantized row by row,
 * then written into the panel's layout 8 × 8 at a time through a register transpose (a scalar scatter of every
 * weight cost about as much as a 16-row tile's FMAs). Q8's per-channel scale is folded in, as its dense path
 * (`Int8Linear.dequantized`) does. */
static void dequant_panel(const Linear *w, int64_t j0, int count, float *rows, float *panel) {
    const int64_t k = w->k; /* a multiple of 8 (of 32 for every quantized kind) */
    if (type_of(w)->panel_group) { /* a panel is one or two whole lanes groups */
        for (int c0 = 0; c0 < PANEL; c0 += 16) {
            if (c0 < count) type_of(w)->panel_group(w, (j0 + c0) / 16, panel + c0, PANEL);
            else for (int64_t i = 0; i < k; i++) memset(panel + i * PANEL + c0, 0, 16 * sizeof(float));
        }
        return;
    }
    for (int c0 = 0; c0 < PANEL; c0 += 8) {
        __m256 scale[8];
        for (int c = 0; c < 8; c++) {
            const int64_t channel = j0 + c0 + c;
            if (c0 + c < count) dequant_channel(w, channel, rows + c * k);
            else for (int64_t i = 0; i < k; i++) rows[c * k + i] = 0.0f;
            scale[c] = _mm256_set1_ps(type_of(w)->channel_scale && c0 + c < count ? ((const float *)w->scales)[channel] : 1.0f);
        }
        for (int64_t i = 0; i < k; i += 8) {
            __m256 r[8];
            for (int c = 0; c < 8; c++) r[c] = _mm256_mul_ps(_mm256_loadu_ps(rows + c * k + i), scale[c]);
            transpose8(r);
            for (int t = 0; t < 8; t++) _mm256_storeu_ps(panel + (i + t) * PANEL + c0, r[t]);
        }
    }
}

/* Stores a tile's `rows` × `count` outputs (held in `tile`, PANEL floats a row) into y with the bias. */
static inline void store_tile(const float *tile, int rows, int count, const float *bias, int64_t j0, float *y, int64_t ldy) {
    for (int r = 0; r < rows; r++)
        for (int c = 0; c < count; c++) y[r * ldy + j0 + c] = tile[r * PANEL + c] + (bias ? bias[j0 + c] : 0.0f);
}

/* AVX2: `rows` (≤ 6, a constant at each call) rows × 16 channels (columns c0 .. c0 + 15 of the panel). */
static inline __attribute__((always_inline)) void micro_avx2(
    const float *x, int64_t ldx, int rows, int64_t k, const float *panel, int c0, float *tile
) {
    __m256 acc[6][2];
    for (int r = 0; r < rows; r++) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
    for (int64_t i = 0; i < k; i++) {
        const __m256 b0 = _mm256_loadu_ps(panel + i * PANEL + c0), b1 = _mm256_loadu_ps(panel + i * PANEL + c0 + 8);
        for (int r = 0; r < rows; r++) {
            const __m256 a = _mm256_broadcast_ss(x + r * ldx + i);
            acc[r][0] = _mm256_fmadd_ps(a, b0, acc[r][0]);
            acc[r][1] = _mm256_fmadd_ps(a, b1, acc[r][1]);
        }
    }
    for (int r = 0; r < rows; r++) {
        _mm256_storeu_ps(tile + r * PANEL + c0, acc[r][0]);
        _mm256_storeu_ps(tile + r * PANEL + c0 + 8, acc[r][1]);
    }
}

static void panel_rows_avx2(const float *x, int64_t ldx, int64_t m, int64_t k, const float *panel, float *tile, int64_t r0) {
    const float *xr = x + r0 * ldx;
    for (int c0 = 0; c0 < PANEL; c0 += 16) {
        switch (m - r0 < 6 ? m - r0 : 6) {
        case 6: micro_avx2(xr, ldx, 6, k, panel, c0, tile); break;
        case 5: micro_avx2(xr, ldx, 5, k, panel, c0, tile); break;
        case 4: micro_avx2(xr, ldx, 4, k, panel, c0, tile); break;
        case 3: micro_avx2(xr, ldx, 3, k, panel, c0, tile); break;
        case 2: micro_avx2(xr, ldx, 2, k, panel, c0, tile); break;
        default: micro_avx2(xr, ldx, 1, k, panel, c0, tile);
        }
    }
}

/* AVX-512: `rows` (≤ 12) rows × the panel's 32 channels in two 16-wide vectors. */
static inline __attribute__((always_inline)) AVX512_TARGET("avx512f") void micro_avx512(
    const float *x, int64_t ldx, int rows, int64_t k, const float *panel, float *tile
) {
    __m512 acc[12][2];
    for (int r = 0; r < rows; r++) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
    for (int64_t i = 0; i < k; i++) {
        const __m512 b0 = _mm512_loadu_ps(panel + i * PANEL), b1 = _mm512_loadu_ps(panel + i * PANEL + 16);
        for (int r = 0; r < rows; r++) {
            const __m512 a = _mm512_set1_ps(x[r * ldx + i]);
            acc[r][0] = _mm512_fmadd_ps(a, b0, acc[r][0]);
            acc[r][1] = _mm512_fmadd_ps(a, b1, acc[r][1]);
        }
    }
    for (int r = 0; r < rows; r++) {
        _mm512_storeu_ps(tile + r * PANEL, acc[r][0]);
        _mm512_storeu_ps(tile + r * PANEL + 16, acc[r][1]);
    }
}

static AVX512_TARGET("avx512f") void panel_rows_avx512(
    const float *x, int64_t ldx, int64_t m, int64_t k, const float *panel, float *tile, int64_t r0
) {
    const float *xr = x + r0 * ldx;
#define CASE(t) case t: micro_avx512(xr, ldx, t, k, panel, tile); break;
    switch (m - r0 < 12 ? m - r0 : 12) {
        CASE(12) CASE(11) CASE(10) CASE(9) CASE(8) CASE(7) CASE(6) CASE(5) CASE(4) CASE(3) CASE(2)
        default: micro_avx512(xr, ldx, 1, k, panel, tile);
    }
#undef CASE
}

/* Which micro-kernel runs: -1 picks AVX-512 where the CPU has it; tests set 0 (AVX2) or 1 to check both. */
int kettle_gemm_avx512 = -1;

/* Rows multiplied per pass over a thread's panels: their activations (ROW_BLOCK × K floats, 442 KB at K = 576)
 * stay in L2 while every panel meets them, instead of streaming from L3 once per panel. Each panel is dequantized
 * again per block, a few percent of the block's FMAs. */
#define ROW_BLOCK_BYTES (448 * 1024)

/* Rows r0 .. r1 - 1 of y for one panel already dequantized. */
static void panel_rows(const Linear *w, const float *x, int64_t ldx, int64_t r0, int64_t r1, const float *panel,
                       float *tile, int wide, int64_t j0, int count, float *y, int64_t ldy) {
    const int64_t tile_rows = wide ? 12 : 6;
    for (int64_t r = r0; r < r1; r += tile_rows) {
        if (wide) panel_rows_avx512(x, ldx, r1, w->k, panel, tile, r);
        else panel_rows_avx2(x, ldx, r1, w->k, panel, tile, r);
        store_tile(tile, r1 - r < tile_rows ? (int)(r1 - r) : (int)tile_rows, count, w->bias, j0, y + r * ldy, ldy);
    }
}

/* Floats of the per-thread buffer a panel needs for an input width of k: the panel, eight dequantized rows and a
 * tile's outputs (64-byte multiples); as much as the integer panels' widest (gemm_panels_int: 48 channels widened,
 * their scales and signed quads, ~41K + 2,304). */
int64_t gemm_buffer_floats(int64_t k) { return (k * PANEL + 16 * k + 96 * PANEL + 15) / 16 * 16; }

static int wide_kernel(void) { return kettle_gemm_avx512 < 0 ? CPU_HAS_AVX512("avx512f") : kettle_gemm_avx512; }

/* Panel p of w dequantized into `buffer` (gemm_buffer_floats(K) floats), then multiplied with rows r0 .. r1 - 1. */
static void panel_gemm(const Linear *w, int64_t p, const float *x, int64_t ldx, int64_t r0, int64_t r1, float *buffer,
                       int wide, float *y, int64_t ldy) {
    const int64_t j0 = p * PANEL;
    const int count = w->n - j0 < PANEL ? (int)(w->n - j0) : PANEL;
    float *rows = buffer + w->k * PANEL, *tile = rows + 8 * w->k;
    dequant_panel(w, j0, count, rows, buffer);
    panel_rows(w, x, ldx, r0, r1, buffer, tile, wide, j0, count, y, ldy);
}

typedef struct {
    const Linear *w;
    const float *x;
    int64_t ldx, r0, r1, ldy;
    float *buffer, *y;
    int wide;
} FloatPanels;

static void float_panel_units(const void *context, int64_t p0, int64_t p1) {
    const FloatPanels *f = context;
    for (int64_t p = p0; p < p1; p++) panel_gemm(f->w, p, f->x, f->ldx, f->r0, f->r1, f->buffer, f->wide, f->y, f->ldy);
}

/* y = x Wᵀ (+ bias) for m rows, run by every thread of the calling team (its panels split by `team_units`, whose
 * closing barrier makes y complete): the rows ROW_BLOCK_BYTES at a time, so a block's activations stay in L2 while
 * every panel of the thread meets them (each panel is dequantized again per block, a few percent of the block's
 * FMAs). `buffer`: this thread's gemm_buffer_floats(K) floats, 64-byte aligned. */
void gemm_panels(const Linear *w, const float *x, int64_t ldx, int64_t m, float *y, int64_t ldy, float *buffer) {
    const int64_t block = ROW_BLOCK_BYTES / (int64_t)sizeof(float) / w->k / 12 * 12 + 12;
    FloatPanels f = {w, x, ldx, 0, 0, ldy, buffer, y, wide_kernel()};
    for (f.r0 = 0; f.r0 < m; f.r0 += block) {
        f.r1 = m - f.r0 < block ? m : f.r0 + block;
        team_units((w->n + PANEL - 1) / PANEL, PANEL_TAIL, float_panel_units, &f); /* a panel's 32 columns: two cache lines */
    }
}

/* ---- integer panels (AVX-512 VNNI; an AVX2 micro-kernel further down), for prompt chunks and decode steps of `ops.panel_rows()` rows and more: the rows
 * quantized to int8 per block of 32 (kernels.h `quantize_row`, as at one row) meet the weights widened to u8 (q +
 * the type's offset), and vpdpbusd sums quads of products into int32 lanes, exact within a block; each block's sums
 * then lose offset · the inputs' sum and take the row's and the weight's scales in float32, as lanes.c's tiles do,
 * so a row has the same bits on either. The lanes are 16 rows (laid out quads-major once per projection), so each
 * weight quad is a broadcast straight from the channel's widened row: no transpose of the weights, whose cost per
 * panel would weigh on a 16-row step as much as the products. Per 16 rows, channel and block of 32 inputs that is
 * 8 vpdpbusd and 3 float instructions, against 32 float32 FMAs per 16 rows and 16 channels' worth of the float32
 * panels. `KETTLE_TUNING=integer-gemm=off` keeps the float32 panels, exact to the dequantized weights. */

#define LANES 16        /* rows per vector */
#define INT_CHANNELS 12 /* output channels per micro-kernel call: 12 float and 12 int32 accumulators */
#define VNNI AVX512_TARGET("avx512f,avx512bw,avx512vnni")
#define VNNI8 AVX512_TARGET("avx512f,avx512bw,avx512vnni,avx512vl") /* 256-bit vpdpbusd */

/* Group g of 16 rows in lanes (kernels.h `lane_floats`): quads [K/4][16] (each row's int8 quad as one int32), scale
 * [K/32][16], sum [K/group][16], half [K/16][16] (int32); rows past the last are zero. */
typedef struct {
    const int32_t *quads;
    const float *scale, *sum;
    const int32_t *half;
} LaneRows;

static inline LaneRows lane_group(const QuantizedRows *xq, int64_t g, int64_t k) {
    const float *base = xq->lanes + g * lane_floats(k), *scale = base + k / 4 * LANES, *sum = scale + k / 32 * LANES;
    return (LaneRows){(const int32_t *)base, scale, sum, (const int32_t *)(sum + k / 32 * LANES)};
}

/* xq's rows laid out in lanes by the calling team (an orphaned `omp for`, whose barrier makes them complete): 8
 * quads of 8 rows at a time through the register transpose, each row's scales and sums beside them. */
void lay_out_lanes(const QuantizedRows *xq, int64_t rows, int64_t k, int64_t group) {
    const int64_t groups = (rows + LANES - 1) / LANES, steps = k / 32; /* 8 quads a step */
#pragma omp for schedule(static)
    for (int64_t u = 0; u < groups * steps; u++) {
        const int64_t g = u / steps, i = u % steps * 8;
        float *base = xq->lanes + g * lane_floats(k);
        for (int half = 0; half < 2; half++) {
            __m256 r[8];
            for (int c = 0; c < 8; c++) {
                const int64_t row = g * LANES + half * 8 + c;
                r[c] = row < rows ? _mm256_loadu_ps((const float *)(xq->b + row * k) + i) : _mm256_setzero_ps();
            }
            transpose8(r);
            for (int t = 0; t < 8; t++) _mm256_store_ps(base + (i + t) * LANES + half * 8, r[t]);
        }
        if (i) continue;
        float *scale = base + k / 4 * LANES, *sum = scale + k / 32 * LANES;
        int32_t *halves = (int32_t *)(sum + k / 32 * LANES);
        for (int64_t l = 0, row = g * LANES; l < LANES; l++, row++) {
            for (int64_t b = 0; b < k / 32; b++) scale[b * LANES + l] = row < rows ? xq->scale8[row * (k / 32) + b] : 0.0f;
            for (int64_t q = 0; q < k / group; q++) sum[q * LANES + l] = row < rows ? xq->sum8[row * (k / group) + q] : 0.0f;
            for (int64_t h = 0; h < k / 16; h++) halves[h * LANES + l] = row < rows ? xq->half[row * (k / 16) + h] : 0;
        }
    }
}

/* Signed int8 values + 128 as u8 (Q8's and IQ4's offset). */
static inline __m256i flipped(__m256i values) { return _mm256_xor_si256(values, _mm256_set1_epi8((char)0x80)); }

/* The widening runs under both micro-kernels, so it is compiled for AVX2 only: an AVX-512 target may let the compiler
 * emit EVEX encodings, which fault on an AVX2 CPU. */
#define WIDEN __attribute__((target("avx2,fma,f16c")))

/* Channel j's values q + offset as K u8 in quad order, 32 at a time (the table's `widen`): Q4L's 0..15. */
WIDEN void q4l_widen(const Linear *w, int64_t j, uint8_t *dst) {
    const __m128i mask = _mm_set1_epi8(0x0F);
    for (int64_t b = 0; b < w->k / 32; b++) {
        const __m128i quads = lanes_quads((const uint8_t *)w->weight + (j / 16 * (w->k / 32) + b) * 256, j % 16);
        _mm256_storeu_si256((__m256i *)(dst + b * 32), _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(quads, 4), mask), _mm_and_si128(quads, mask)));
    }
}

/* Q8L's int8 values + 128. */
WIDEN void q8l_widen(const Linear *w, int64_t j, uint8_t *dst) {
    for (int64_t b = 0; b < w->k / 32; b++) {
        const uint8_t *quads = (const uint8_t *)w->weight + (j / 16 * (w->k / 32) + b) * 512;
        _mm256_storeu_si256((__m256i *)(dst + b * 32), flipped(_mm256_set_m128i(lanes_quads(quads + 256, j % 16), lanes_quads(quads, j % 16))));
    }
}

/* Q6L's q (0..63: q - 32 + 32). */
WIDEN void q6l_widen(const Linear *w, int64_t j, uint8_t *dst) {
    for (int64_t b = 0; b < w->k / 32; b++) {
        __m128i q[2];
        q6l_block(w, j, b, q);
        const __m256i values = _mm256_add_epi8(_mm256_set_m128i(q[1], q[0]), _mm256_set1_epi8(32));
        _mm256_storeu_si256((__m256i *)(dst + b * 32), quad_order(values));
    }
}

/* Q5L's 0..31: the nibbles as Q4L's, and byte t of the channel's 4 plane bytes holding quad M's byte t's fifth bit
 * at bit M. */
WIDEN void q5l_widen(const Linear *w, int64_t j, uint8_t *dst) {
    const __m128i mask = _mm_set1_epi8(0x0F);
    const __m256i bit = _mm256_setr_epi8(1, 1, 1, 1, 2, 2, 2, 2, 4, 4, 4, 4, 8, 8, 8, 8, 16, 16, 16, 16, 32, 32, 32, 32,
                                         64, 64, 64, 64, (char)128, (char)128, (char)128, (char)128);
    const __m256i source = _mm256_setr_epi8(0, 1, 2, 3, 0, 1, 2, 3, 0, 1, 2, 3, 0, 1, 2, 3,
                                            0, 1, 2, 3, 0, 1, 2, 3, 0, 1, 2, 3, 0, 1, 2, 3);
    for (int64_t b = 0; b < w->k / 32; b++) {
        const uint8_t *base = (const uint8_t *)w->weight + (j / 16 * (w->k / 32) + b) * 320;
        const __m128i quads = lanes_quads(base + Q5L_QUADS, j % 16);
        const __m256i nibbles = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(quads, 4), mask), _mm_and_si128(quads, mask));
        int32_t planes;
        memcpy(&planes, base + Q5L_PLANES + 4 * (j % 16), 4);
        const __m256i spread = _mm256_and_si256(_mm256_shuffle_epi8(_mm256_set1_epi32(planes), source), bit);
        const __m256i fifth = _mm256_and_si256(_mm256_cmpeq_epi8(spread, bit), _mm256_set1_epi8(0x10));
        _mm256_storeu_si256((__m256i *)(dst + b * 32), _mm256_or_si256(nibbles, fifth));
    }
}

/* IQ4L's grid values + 128. */
WIDEN void iq4l_widen(const Linear *w, int64_t j, uint8_t *dst) {
    const __m128i mask = _mm_set1_epi8(0x0F), grid = _mm_loadu_si128((const __m128i *)IQ4_VALUES);
    for (int64_t b = 0; b < w->k / 32; b++) {
        const __m128i quads = lanes_quads((const uint8_t *)w->weight + (j / 16 * (w->k / 32) + b) * 256, j % 16);
        const __m128i low = _mm_shuffle_epi8(grid, _mm_and_si128(quads, mask));
        const __m128i high = _mm_shuffle_epi8(grid, _mm_and_si128(_mm_srli_epi16(quads, 4), mask));
        _mm256_storeu_si256((__m256i *)(dst + b * 32), flipped(_mm256_set_m128i(high, low)));
    }
}

/* Q4's 0..15 (a chunk of 64: its low nibbles the first 32 inputs, its high ones the next 32). */
WIDEN void q4_widen(const Linear *w, int64_t j, uint8_t *dst) {
    const int64_t k = w->k;
    const uint8_t *src = (const uint8_t *)w->weight + j * (k / 2);
    const __m256i mask = _mm256_set1_epi8(0x0F);
    for (int64_t c = 0; c < k / 64; c++) {
        const __m256i bytes = _mm256_loadu_si256((const __m256i *)(src + c * 32));
        _mm256_storeu_si256((__m256i *)(dst + c * 64), quad_order(_mm256_and_si256(bytes, mask)));
        _mm256_storeu_si256((__m256i *)(dst + c * 64 + 32), quad_order(_mm256_and_si256(_mm256_srli_epi16(bytes, 4), mask)));
    }
}

/* The int8 values + 128 of Q8 and Q8_0 (rows). */
WIDEN void q8_widen(const Linear *w, int64_t j, uint8_t *dst) {
    const int8_t *src = (const int8_t *)w->weight + j * w->k;
    for (int64_t i = 0; i < w->k; i += 32)
        _mm256_storeu_si256((__m256i *)(dst + i), quad_order(flipped(_mm256_loadu_si256((const __m256i *)(src + i)))));
}

/* n float16 values as floats, 8 at a time. */
static inline void halves_to_floats(const uint16_t *src, int64_t n, float *dst) {
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(src + i))));
    for (; i < n; i++) dst[i] = _cvtsh_ss(src[i]);
}

/* Channel j's weight scale per block of 32 inputs (K/32 floats) and, where the type has them, its minimum per group
 * (the table's `scales`). */
void q4l_scales(const Linear *w, int64_t j, float *scale, float *minimum) {
    if (w->supers) { /* Q4_K's (groups of 32): `q4l_scale`'s products, each super-block's d and dmin read once */
        const int64_t blocks = w->k / 32, at = j / 16 * blocks * 16 + j % 16;
        const uint8_t *sc = (const uint8_t *)w->scales + at, *m = (const uint8_t *)w->mins + at;
        for (int64_t s = 0; s < blocks / 8; s++) {
            const uint16_t *super = w->supers + (j / 16 * (blocks / 8) + s) * 32 + j % 16;
            const float d = _cvtsh_ss(super[0]), dmin = _cvtsh_ss(super[16]);
            for (int64_t b = 8 * s; b < 8 * s + 8; b++) {
                scale[b] = d * (float)sc[b * 16];
                if (minimum) minimum[b] = -(dmin * (float)m[b * 16]);
            }
        }
        return;
    }
    float d, m;
    for (int64_t g = 0; g < w->k / w->group; g++) {
        q4l_scale(w, j, g, &d, &m);
        for (int64_t b = g * w->group / 32; b < (g + 1) * w->group / 32; b++) scale[b] = d;
        if (minimum) minimum[g] = m;
    }
}

/* Q8's one scale per channel, at every block. */
void q8_scales(const Linear *w, int64_t j, float *scale, float *minimum) {
    (void)minimum;
    for (int64_t b = 0; b < w->k / 32; b++) scale[b] = ((const float *)w->scales)[j];
}

void iq4l_scales(const Linear *w, int64_t j, float *scale, float *minimum) {
    (void)minimum;
    for (int64_t b = 0; b < w->k / 32; b++) scale[b] = iq4l_scale(w, j, b);
}

void q8l_scales(const Linear *w, int64_t j, float *scale, float *minimum) {
    (void)minimum;
    for (int64_t b = 0; b < w->k / 32; b++) scale[b] = q8l_scale(w, j, b);
}

/* Q4_K's scales of a Q4L or Q5L weight (`sub_scales`): each block's 6-bit sc as an int16 pair, d per super-block. */
void q4k_sub_scales(const Linear *w, int64_t j, int32_t *pairs, float *super_d) {
    const int64_t blocks = w->k / 32;
    const uint8_t *sc = (const uint8_t *)w->scales + j / 16 * blocks * 16 + j % 16;
    for (int64_t b = 0; b < blocks; b++) pairs[b] = sc[b * 16] * 0x10001;
    for (int64_t s = 0; s < blocks / 8; s++) super_d[s] = _cvtsh_ss(w->supers[(j / 16 * (blocks / 8) + s) * 32 + j % 16]);
}

/* IQ4L's (`sub_scales`): each block's ls - 32 as an int16 pair, d per super-block. */
void iq4l_sub_scales(const Linear *w, int64_t j, int32_t *pairs, float *super_d) {
    const int64_t blocks = w->k / 32;
    const int8_t *sc = (const int8_t *)w->scales + j / 16 * blocks * 16 + j % 16;
    for (int64_t b = 0; b < blocks; b++) pairs[b] = (int32_t)((uint32_t)(uint16_t)sc[b * 16] * 0x10001u);
    for (int64_t s = 0; s < blocks / 8; s++) super_d[s] = _cvtsh_ss(w->supers[(j / 16 * (blocks / 8) + s) * 16 + j % 16]);
}

/* Q6L's (`sub_scales`, three a block): each sub-block's int8 sc as an int16 pair, then 32 · (sc₀, sc₁), the offset's
 * term against the rows' sums per 16 inputs (|32 · sc| ≤ 4,096 fits int16); d per super-block. */
void q6l_sub_scales(const Linear *w, int64_t j, int32_t *pairs, float *super_d) {
    const int64_t blocks = w->k / 32;
    const int8_t *sc = (const int8_t *)w->scales + j / 16 * (2 * blocks) * 16 + j % 16;
    for (int64_t b = 0; b < blocks; b++) {
        const uint32_t first = (uint16_t)sc[2 * b * 16], second = (uint16_t)sc[(2 * b + 1) * 16];
        pairs[3 * b] = (int32_t)(first * 0x10001u), pairs[3 * b + 1] = (int32_t)(second * 0x10001u);
        pairs[3 * b + 2] = (int32_t)((uint16_t)(32 * sc[2 * b * 16]) | (uint32_t)(uint16_t)(32 * sc[(2 * b + 1) * 16]) << 16);
    }
    for (int64_t s = 0; s < blocks / 8; s++) super_d[s] = _cvtsh_ss(w->supers[(j / 16 * (blocks / 8) + s) * 16 + j % 16]);
}

/* The rows layouts' float16 scales per group (Q4, Q8_0: groups of 32) and Q4's minimums. */
void group_scales(const Linear *w, int64_t j, float *scale, float *minimum) {
    const int64_t k = w->k, blocks = k / 32, groups = k / w->group;
    const uint16_t *halves = (const uint16_t *)w->scales + j * groups;
    if (groups == blocks) halves_to_floats(halves, blocks, scale); /* Q8G; Q4 with groups of 32 */
    else for (int64_t b = 0; b < blocks; b++) scale[b] = _cvtsh_ss(halves[b * 32 / w->group]);
    if (!minimum) return;
    const Minimums m = channel_minimums(w->mins, w->scales, groups, j);
    halves_to_floats(m.table, groups, minimum);
    for (int64_t g = 0; m.factor != 1.0f && g < groups; g++) minimum[g] *= m.factor; /* exact: -8 is a power of two */
}

/* The widened weights of a panel's C channels: q [C][stride] u8 (K of each row used), scale [C][K/32], minimum
 * [C][K/group] (Q4); with `sub_scales`, sub [C][K/32] (Q6L: [C][3K/32], `sub_entries`) and super [C][K/256]. */
typedef struct {
    uint8_t *q;
    float *scale, *minimum;
    int64_t stride; /* bytes from one channel's widened row to the next */
    int32_t *sub;
    float *super;
} IntChannels;

/* A widened row's stride: K plus one cache line. The micro-kernels read the same quad of every channel at once, and
 * at K a multiple of 4 KiB (an 8B model's 4,096 inputs, a 1.7B's down projection's 8,192) those 12 lines fall in
 * one set of the 8-way L1, which then misses on every quad: one thread, K = 8,192 in cache, 260 GOP/s at K against
 * 362 at K + 64. */
static inline int64_t widened_stride(int64_t k) { return k + 64; }

static inline int64_t channel_floats(int64_t k, int panel) {
    return panel * (widened_stride(k) / 4 + 3 * (k / 32) + k / 256);
}

/* The tile after a panel's channels: its channels rounded up to 16 × 16 lanes (`store_lanes` reads whole 8-channel
 * groups). */
static inline int64_t tile_floats(int panel) { return (panel + 15) / 16 * 16 * LANES; }

/* dot[c] += the products of quads i0 .. i1 - 1 of x's 16 lanes with channel c's widened quads, each broadcast. */
static inline __attribute__((always_inline)) VNNI void quad_dots(const LaneRows *x, const IntChannels *w, int channels,
                                                                 int64_t i0, int64_t i1, __m512i *dot) {
    for (int64_t i = i0; i < i1; i++) {
        const __m512i a = _mm512_load_si512(x->quads + i * LANES);
        for (int c = 0; c < channels; c++)
            dot[c] = _mm512_dpbusd_epi32(dot[c], _mm512_set1_epi32(((const int32_t *)(w->q + c * w->stride))[i]), a);
    }
}

/* `channels` (≤ INT_CHANNELS, a constant at each call) output channels for the 16 lanes of x into tile [C][16]; each
 * block's sums start at -offset · its inputs' sum. */
static inline __attribute__((always_inline)) VNNI void micro_vnni(
    const LaneRows *x, int64_t k, int64_t group, const IntChannels *w, int channels, int offset, float *tile
) {
    const int64_t blocks = k / 32, groups = k / group;
    __m512 acc[INT_CHANNELS];
    for (int c = 0; c < channels; c++) acc[c] = _mm512_setzero_ps();
    for (int64_t b = 0; b < blocks; b++) {
        __m512i start = _mm512_setzero_si512();
        if (offset) {
            const __m512i sum = _mm512_add_epi32(_mm512_load_si512(x->half + 2 * b * LANES), _mm512_load_si512(x->half + (2 * b + 1) * LANES));
            start = _mm512_mullo_epi32(sum, _mm512_set1_epi32(-offset));
        }
        __m512i dot[INT_CHANNELS];
        for (int c = 0; c < channels; c++) dot[c] = start;
        quad_dots(x, w, channels, b * 8, b * 8 + 8, dot);
        const __m512 d = _mm512_load_ps(x->scale + b * LANES); /* the rows' scale of this block */
        for (int c = 0; c < channels; c++)
            acc[c] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot[c]), _mm512_mul_ps(d, _mm512_set1_ps(w->scale[c * blocks + b])), acc[c]);
        /* minimum_g · (Σ x over group g) right after the group's first block, where lanes.c's tiles add it: a row
         * then has the same bits here as in a decode step of a few rows (batch invariance) */
        if (w->minimum && b % (group / 32) == 0) {
            const int64_t g = b / (group / 32);
            const __m512 sum = _mm512_load_ps(x->sum + g * LANES);
            for (int c = 0; c < channels; c++) acc[c] = _mm512_fmadd_ps(sum, _mm512_set1_ps(w->minimum[c * groups + g]), acc[c]);
        }
    }
    for (int c = 0; c < channels; c++) _mm512_storeu_ps(tile + c * LANES, acc[c]);
}

/* Q6_CHANNELS: `micro_vnni` for Q6_K's scales per sub-block of 16 inputs (q + 32, offset 32), as lanes.c's
 * `q6l_tile`: each sub-block's int32 sums (from -32 · its inputs' sum) times its sc into the super-block's sums (its
 * `sub_scales`: entries 3b and 3b + 1 of a channel's), scaled in float at the super-block's last block. Three vectors
 * a channel: 8 channels. */
#define Q6_CHANNELS 8
static inline __attribute__((always_inline)) VNNI void micro_vnni_q6(const LaneRows *x, int64_t k, const IntChannels *w,
                                                                     int channels, float *tile) {
    const int64_t blocks = k / 32;
    __m512 acc[Q6_CHANNELS];
    __m512i super[Q6_CHANNELS];
    for (int c = 0; c < channels; c++) acc[c] = _mm512_setzero_ps(), super[c] = _mm512_setzero_si512();
    for (int64_t b = 0; b < blocks; b++) {
        for (int s = 0; s < 2; s++) {
            const __m512i start = _mm512_mullo_epi32(_mm512_load_si512(x->half + (2 * b + s) * LANES), _mm512_set1_epi32(-32));
            __m512i dot[Q6_CHANNELS];
            for (int c = 0; c < channels; c++) dot[c] = start;
            quad_dots(x, w, channels, b * 8 + s * 4, b * 8 + s * 4 + 4, dot);
            for (int c = 0; c < channels; c++)
                super[c] = _mm512_add_epi32(super[c], _mm512_mullo_epi32(dot[c], _mm512_set1_epi32(w->sub[(c * blocks + b) * 3 + s] >> 16)));
        }
        if (b % 8 < 7) continue;
        const __m512 d = _mm512_load_ps(x->scale + b * LANES); /* the rows' scale of the super-block */
        for (int c = 0; c < channels; c++) {
            acc[c] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(super[c]), _mm512_mul_ps(d, _mm512_set1_ps(w->super[c * (blocks / 8) + b / 8])), acc[c]);
            super[c] = _mm512_setzero_si512();
        }
    }
    for (int c = 0; c < channels; c++) _mm512_storeu_ps(tile + c * LANES, acc[c]);
}

/* SCALED_CHANNELS: `micro_vnni` for a weight with `sub_scales` (kernels.h): each block's int32 sums (from -offset ·
 * its inputs' sum) times its scales into the super-block's sums, + minimum · (the block's int8 sum) per block where
 * the weight has minimums, the super-block's sums scaled in float at its last block, as the tiles (lanes.c
 * `q4l_tile`). Three vectors a channel (8 channels: 24 of the 32 registers). Written once for both widths:
 * micro_vnni_scaled (16 lanes) and micro_vnni8_scaled (the first 8 lanes, in 256-bit vectors, as `micro_vnni8`).
 * Looped by super-block, its 8 blocks' quads unrolled: with a test of b % 8 in each block GCC kept the sums rotating
 * through copies (Zen 4, one thread, 12 channels × 16 rows at K = 2,048 in cache: 309-336 → 349-353 GOP/s). */
#define SCALED_CHANNELS 8
#define SCALED_MICRO(name, target, vec, veci, load, loadi, zero, zeroi, set1, set1i, add, mullo, dpbusd, cvt, mul,  \
                     fmadd, store)                                                                                \
    static inline __attribute__((always_inline)) target void name(const LaneRows *x, int64_t k,                  \
                                                                  const IntChannels *w, int channels,            \
                                                                  int offset, float *tile) {                     \
        const int64_t blocks = k / 32;                                                                           \
        const int32_t *q[SCALED_CHANNELS];                                                                       \
        for (int c = 0; c < channels; c++) q[c] = (const int32_t *)(w->q + c * w->stride);                       \
        vec acc[SCALED_CHANNELS];                                                                                \
        for (int c = 0; c < channels; c++) acc[c] = zero();                                                      \
        for (int64_t b0 = 0; b0 < blocks; b0 += 8) {                                                             \
            veci super[SCALED_CHANNELS];                                                                         \
            for (int c = 0; c < channels; c++) super[c] = zeroi();                                               \
            for (int64_t b = b0; b < b0 + 8; b++) {                                                              \
                veci dot[SCALED_CHANNELS], start = zeroi();                                                      \
                if (offset) {                                                                                    \
                    const veci sum = add(loadi((const void *)(x->half + 2 * b * LANES)),                         \
                                         loadi((const void *)(x->half + (2 * b + 1) * LANES)));                  \
                    start = mullo(sum, set1i(-offset));                                                          \
                }                                                                                                \
                for (int c = 0; c < channels; c++) dot[c] = start;                                               \
                _Pragma("GCC unroll 8") for (int64_t i = b * 8; i < b * 8 + 8; i++) {                            \
                    const veci a = loadi((const void *)(x->quads + i * LANES));                                  \
                    for (int c = 0; c < channels; c++) dot[c] = dpbusd(dot[c], set1i(q[c][i]), a);               \
                }                                                                                                \
                for (int c = 0; c < channels; c++)                                                               \
                    super[c] = add(super[c], mullo(dot[c], set1i(w->sub[c * blocks + b] >> 16)));                \
                if (!w->minimum) continue;                                                                       \
                const vec sum = load(x->sum + b * LANES);                                                        \
                for (int c = 0; c < channels; c++) acc[c] = fmadd(sum, set1(w->minimum[c * blocks + b]), acc[c]); \
            }                                                                                                    \
            const vec d = load(x->scale + (b0 + 7) * LANES); /* the rows' scale of the super-block */            \
            for (int c = 0; c < channels; c++)                                                                   \
                acc[c] = fmadd(cvt(super[c]), mul(d, set1(w->super[c * (blocks / 8) + b0 / 8])), acc[c]);        \
        }                                                                                                        \
        for (int c = 0; c < channels; c++) store(tile + c * LANES, acc[c]);                                      \
    }
static inline VNNI __m512i load512i(const void *p) { return _mm512_load_si512(p); }
static inline __m256i load256i(const void *p) { return _mm256_load_si256((const __m256i *)p); }
SCALED_MICRO(micro_vnni_scaled, VNNI, __m512, __m512i, _mm512_load_ps, load512i, _mm512_setzero_ps, _mm512_setzero_si512,
             _mm512_set1_ps, _mm512_set1_epi32, _mm512_add_epi32, _mm512_mullo_epi32, _mm512_dpbusd_epi32,
             _mm512_cvtepi32_ps, _mm512_mul_ps, _mm512_fmadd_ps, _mm512_storeu_ps)
SCALED_MICRO(micro_vnni8_scaled, VNNI8, __m256, __m256i, _mm256_load_ps, load256i, _mm256_setzero_ps,
             _mm256_setzero_si256, _mm256_set1_ps, _mm256_set1_epi32, _mm256_add_epi32, _mm256_mullo_epi32,
             _mm256_dpbusd_epi32, _mm256_cvtepi32_ps, _mm256_mul_ps, _mm256_fmadd_ps, _mm256_storeu_ps)
#undef SCALED_MICRO

/* `micro_vnni` over the first 8 lanes only (256-bit vectors), for a group of 8 rows or fewer: half the
 * instructions where the lanes past them hold only padding (17-24 rows: the second group; a prompt chunk's last
 * group). Same layout, same sums: the lanes it leaves out are zero rows. */
static inline __attribute__((always_inline)) VNNI8 void micro_vnni8(
    const LaneRows *x, int64_t k, int64_t group, const IntChannels *w, int channels, int offset, float *tile
) {
    const int64_t blocks = k / 32, groups = k / group;
    __m256 acc[INT_CHANNELS];
    for (int c = 0; c < channels; c++) acc[c] = _mm256_setzero_ps();
    for (int64_t b = 0; b < blocks; b++) {
        __m256i start = _mm256_setzero_si256();
        if (offset) {
            const __m256i sum = _mm256_add_epi32(_mm256_load_si256((const __m256i *)(x->half + 2 * b * LANES)),
                                                 _mm256_load_si256((const __m256i *)(x->half + (2 * b + 1) * LANES)));
            start = _mm256_mullo_epi32(sum, _mm256_set1_epi32(-offset));
        }
        __m256i dot[INT_CHANNELS];
        for (int c = 0; c < channels; c++) dot[c] = start;
        for (int64_t i = b * 8; i < b * 8 + 8; i++) {
            const __m256i a = _mm256_load_si256((const __m256i *)(x->quads + i * LANES));
            for (int c = 0; c < channels; c++)
                dot[c] = _mm256_dpbusd_epi32(dot[c], _mm256_set1_epi32(((const int32_t *)(w->q + c * w->stride))[i]), a);
        }
        const __m256 d = _mm256_load_ps(x->scale + b * LANES);
        for (int c = 0; c < channels; c++)
            acc[c] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot[c]), _mm256_mul_ps(d, _mm256_set1_ps(w->scale[c * blocks + b])), acc[c]);
        if (w->minimum && b % (group / 32) == 0) { /* as `micro_vnni` */
            const int64_t g = b / (group / 32);
            const __m256 sum = _mm256_load_ps(x->sum + g * LANES);
            for (int c = 0; c < channels; c++) acc[c] = _mm256_fmadd_ps(sum, _mm256_set1_ps(w->minimum[c * groups + g]), acc[c]);
        }
    }
    for (int c = 0; c < channels; c++) _mm256_storeu_ps(tile + c * LANES, acc[c]);
}

/* Whether a group of 8 rows or fewer takes the 8-lane micro-kernel (1), or 16 lanes as every group (0: for the
 * tests, which compare the two, and for measurement). */
int kettle_integer_lanes8 = 1;

/* The micro-kernel for `channels` (a constant at each call) and the group's `rows`: 8 lanes when they hold them. */
static VNNI8 void int_channels(const LaneRows *x, int64_t k, int64_t group, const IntChannels *w, int channels,
                               int64_t rows, int offset, float *tile) {
#define CASE(t) case t: if (narrow) micro_vnni8(x, k, group, w, t, offset, tile); else micro_vnni(x, k, group, w, t, offset, tile); break;
    const int narrow = kettle_integer_lanes8 && rows <= LANES / 2;
    switch (channels) {
        CASE(12) CASE(11) CASE(10) CASE(9) CASE(8) CASE(7) CASE(6) CASE(5) CASE(4) CASE(3) CASE(2) CASE(1)
    }
#undef CASE
}

/* `int_channels` for Q6_K's scales per 16 inputs (16 lanes at any row count: its panels are a few layers' share),
 * Q6_CHANNELS at a time. */
static VNNI void int_channels_q6(const LaneRows *x, int64_t k, const IntChannels *w, int n, float *tile) {
    for (int c0 = 0; c0 < n; c0 += Q6_CHANNELS) {
        IntChannels part = *w;
        part.q += c0 * w->stride, part.sub += c0 * 3 * (k / 32), part.super += c0 * (k / 256);
#define CASE(t) case t: micro_vnni_q6(x, k, &part, t, tile + c0 * LANES); break;
        switch (n - c0 < Q6_CHANNELS ? n - c0 : Q6_CHANNELS) {
            CASE(8) CASE(7) CASE(6) CASE(5) CASE(4) CASE(3) CASE(2) CASE(1)
        }
#undef CASE
    }
}

/* `int_channels` for a weight with `sub_scales`, SCALED_CHANNELS at a time. */
static VNNI8 void int_channels_scaled(const LaneRows *x, int64_t k, const IntChannels *w, int n, int64_t rows,
                                      int offset, float *tile) {
    const int narrow = kettle_integer_lanes8 && rows <= LANES / 2;
    for (int c0 = 0; c0 < n; c0 += SCALED_CHANNELS) {
        IntChannels part = *w;
        part.q += c0 * w->stride, part.sub += c0 * (k / 32), part.super += c0 * (k / 256);
        if (part.minimum) part.minimum += c0 * (k / 32);
#define CASE(t) case t: if (narrow) micro_vnni8_scaled(x, k, &part, t, offset, tile + c0 * LANES); else micro_vnni_scaled(x, k, &part, t, offset, tile + c0 * LANES); break;
        switch (n - c0 < SCALED_CHANNELS ? n - c0 : SCALED_CHANNELS) {
            CASE(8) CASE(7) CASE(6) CASE(5) CASE(4) CASE(3) CASE(2) CASE(1)
        }
#undef CASE
    }
}

/* The tile's outputs [channels][16 lanes] into y's rows (`rows` of them, ldy floats apart) at `channels` consecutive
 * columns, with the bias: 8 lanes × 8 channels at a time through the register transpose, so each row takes one
 * vector store instead of a strided scalar store per output. `tile` has room for 16 channels (the missing ones are
 * read, not stored). */
static inline VNNI8 void store_lanes(float *tile, int channels, int rows, const float *bias, float *y, int64_t ldy) {
    for (int c0 = 0; c0 < channels; c0 += 8) {
        const int width = channels - c0 < 8 ? channels - c0 : 8;
        /* AVX-512's masked stores: AVX's vmaskmovps stores run microcoded on AMD's cores, and cost the panels 5% of
         * the bundled model's prefill there. */
        const __mmask8 mask = (__mmask8)((1u << width) - 1);
        const __m256 b = bias ? _mm256_maskz_loadu_ps(mask, bias + c0) : _mm256_setzero_ps();
        for (int l0 = 0; l0 < rows; l0 += 8) {
            __m256 r[8];
            for (int c = 0; c < 8; c++) r[c] = _mm256_loadu_ps(tile + (c0 + c) * LANES + l0);
            transpose8(r);
            for (int t = 0; t < 8 && l0 + t < rows; t++) _mm256_mask_storeu_ps(y + (l0 + t) * ldy + c0, mask, _mm256_add_ps(r[t], b));
        }
    }
}

/* A group of 16 rows (`count` of them real) × the `n` channels widened in c, into y's rows at those channels with the
 * bias, by the AVX-512 micro-kernels. */
static VNNI8 void int_group_avx512(const LaneRows *x, int64_t k, const Linear *w, const IntChannels *c, int n,
                                   int64_t count, float *tile, const float *bias, float *y, int64_t ldy) {
    const WeightType *type = type_of(w);
    if (type->sub_blocks) int_channels_q6(x, k, c, n, tile);
    else if (c->sub) int_channels_scaled(x, k, c, n, count, type->offset, tile);
    else int_channels(x, k, w->group, c, n, count, type->offset, tile);
    store_lanes(tile, n, (int)count, bias, y, ldy);
}

/* ---- the integer panels on AVX2 (the types with `avx2_panels`: all the lanes types): the same laid-out int8 rows and
 * widened weights, each weight quad broadcast against 8 rows' quads (a half of the group's 16 lanes) by `vpmaddubsw`
 * (u8 × s8, pairs summed into int16) and `vpmaddwd` by ones (the quad's sum in its int32 lane), as lanes_avx2.c's
 * tiles do. Every block's integer sums are exact, and the float operations per lane those of `micro_vnni` (and of
 * the AVX2 and AVX-512 tiles): a row has the same bits here, on the AVX2 tiles and on AVX-512. Q4L's 0..15 times
 * the int8 rows sum in int16 over the whole block (pairs ≤ 2 · 15 · 127, eight quads ≤ 30,480 < 2^15), one
 * `vpmaddwd` a block; the signed types' q + 128 are flipped back to q and multiplied by the sign trick (|q| times x
 * with q's sign: pairs ≤ 2 · 128 · 127 < 2^15, so one `vpmaddwd` a quad), which saturation would otherwise break on
 * q + 128; Q5L's 0..31 and Q6L's 0..63 (pairs ≤ 2 · 63 · 128) are summed two quads at a time into int32
 * (`wide_values`, kernels.h `quad_pair_dot`), Q6L's per sub-block of 16 inputs. */

#define AVX2_CHANNELS 4 /* output channels per AVX2 micro-kernel call: 2 × 4 int and 2 × 4 float accumulators */
/* The same for `micro_avx2_scaled`, whose channels also hold their scales' pairs: at 4 the 16 registers no longer
 * held the rows' quads, reloaded per channel (one thread, 2,048 × 48 in cache, 512 rows, GOP/s at 4 → 3 channels:
 * Q4L 202 → 212, Q5L 179 → 195, Q6L 179 → 184, IQ4L even; at 2, 183, 181, 159). */
#define SCALED_AVX2_CHANNELS 3

/* A signed channel's K widened bytes (q + 128) as the AVX2 micro-kernel reads them: each quad of int8 q beside its
 * |q| (2K bytes), so that each is one broadcast (computing |q| per quad and channel cost the kernel ~10%). */
static void signed_quads(const uint8_t *widened, int64_t k, uint8_t *dst) {
    for (int64_t i = 0; i < k; i += 32) {
        const __m256i q = flipped(_mm256_loadu_si256((const __m256i *)(widened + i)));
        const __m256i size = _mm256_sign_epi8(q, q); /* |q| as u8, -128 too */
        /* per 128-bit lane: quads 0, 1 | 4, 5 each beside its size, then 2, 3 | 6, 7 */
        const __m256i low = _mm256_unpacklo_epi32(q, size), high = _mm256_unpackhi_epi32(q, size);
        _mm256_storeu_si256((__m256i *)(dst + 2 * i), _mm256_permute2x128_si256(low, high, 0x20));
        _mm256_storeu_si256((__m256i *)(dst + 2 * i + 32), _mm256_permute2x128_si256(low, high, 0x31));
    }
}

#define AVX2_TEMPLATE "int_panels_avx2.h"
#include "avx2_forms.h"

/* The AVX2 micro-kernels in the form this CPU runs (`avx2_dot`), indexed by it. */
typedef void IntChannelsAvx2(const LaneRows *x, int64_t k, int64_t group, const IntChannels *w, int n, int64_t rows,
                             int is_signed, int sub_blocks, int wide, int scaled, int offset, float *tile);
static IntChannelsAvx2 *const INT_CHANNELS_AVX2[] = {
    [AVX2_DOT_MADDUBS] = int_channels_maddubs, [AVX2_DOT_AVXVNNI] = int_channels_avxvnni, [AVX2_DOT_VNNI256] = int_channels_vnni256};

/* 8 floats of v into dst[0 .. width), width ≤ 8, without AVX's masked stores (microcoded on AMD's cores). */
static inline void store_first(float *dst, __m256 v, int width) {
    if (width == 8) {
        _mm256_storeu_ps(dst, v);
        return;
    }
    __m128 part = _mm256_castps256_ps128(v);
    if (width >= 4) {
        _mm_storeu_ps(dst, part);
        part = _mm256_extractf128_ps(v, 1), dst += 4, width -= 4;
    }
    float rest[4];
    _mm_storeu_ps(rest, part);
    for (int i = 0; i < width; i++) dst[i] = rest[i];
}

/* `store_lanes` in AVX2: the same transposes and additions, a short group of channels stored in pieces. */
static void store_lanes_avx2(const float *tile, int channels, int rows, const float *bias, float *y, int64_t ldy) {
    for (int c0 = 0; c0 < channels; c0 += 8) {
        const int width = channels - c0 < 8 ? channels - c0 : 8;
        float b8[8] = {0};
        for (int c = 0; bias && c < width; c++) b8[c] = bias[c0 + c];
        const __m256 b = _mm256_loadu_ps(b8);
        for (int l0 = 0; l0 < rows; l0 += 8) {
            __m256 r[8];
            for (int c = 0; c < 8; c++) r[c] = _mm256_loadu_ps(tile + (c0 + c) * LANES + l0);
            transpose8(r);
            for (int t = 0; t < 8 && l0 + t < rows; t++) store_first(y + (l0 + t) * ldy + c0, _mm256_add_ps(r[t], b), width);
        }
    }
}

/* Laid-out int8 rows multiplied per pass over the channels: each group of channels is widened again per block (on a
 * 1.7B model's 512-token prompt ~16% of the time at the float32 panels' 448 KB, whose blocks stay in L2), while the
 * int8 rows, a quarter of float32's bytes, stream well from L3. Same machine, alternated: 512 tokens 111-113 tok/s
 * at 448 KB, 126-128 at 2 MB, 130-134 at 8 MB; 2,048 tokens 94 at 448 KB, 104-106 at 8 MB, 97-102 at 16 MB. */
#define INT_ROW_BLOCK_BYTES ((int64_t)8 << 20)

/* Channels the AVX2 micro-kernels widen at a time: a multiple of INT_CHANNELS up to AVX2_PANEL_MAX, no more than keep
 * the widened bytes (signed quads: twice K) within AVX2_PANEL_BYTES of L2 beside a group of rows, nor than leave each
 * thread eight panels (an even static split on a many-core team). Each panel writes its channels' columns of every
 * row of the block: at 12 channels (48 bytes) most of a row's cache lines are written by two panels a whole pass over
 * the rows apart, and came back from L3 for the second. 512 rows × 2,048 → 8,192 Q4L: one thread 197 → 213 GOP/s at
 * 48 channels, two threads 375-395 → 413-422; at K 8,192 (the cache's bound: 12) 12, 24 and 48 ran even. */
#define AVX2_PANEL_MAX 48
#define AVX2_PANEL_BYTES (192 << 10)
static int avx2_panel_channels(int64_t k, int64_t n, int is_signed) {
    const int64_t by_cache = AVX2_PANEL_BYTES / ((is_signed ? 2 : 1) * widened_stride(k) * INT_CHANNELS);
    const int64_t by_team = n / (8 * INT_CHANNELS * omp_get_num_threads());
    int64_t units = by_cache < by_team ? by_cache : by_team;
    if (units > AVX2_PANEL_MAX / INT_CHANNELS) units = AVX2_PANEL_MAX / INT_CHANNELS;
    return INT_CHANNELS * (int)(units < 1 ? 1 : units);
}

/* One call's panels: what every panel of `gemm_panels_int` reads, and this thread's widened channels and tile. */
typedef struct {
    const Linear *w;
    const WeightType *type;
    const QuantizedRows *xq;
    float *y, *tile;
    int64_t m, ldy, k, stride, b0, block;
    int panel, per_unit, wide, is_signed, scaled, entries, offset;
    IntChannels c, paired;
    IntChannelsAvx2 *int_channels_avx2;
} IntPanels;

/* Panel t: its channels widened, then every group of 16 rows of the block at b0 through the micro-kernels. */
static void int_panel(const IntPanels *p, int64_t t) {
    const Linear *w = p->w;
    const WeightType *type = p->type;
    const int64_t k = p->k, blocks = k / 32, groups = k / w->group, stride = p->stride, j0 = t * p->panel;
    const IntChannels *c = &p->c;
    const int n = w->n - j0 < p->panel ? (int)(w->n - j0) : p->panel;
    for (int i = 0; i < n; i++) {
        type->widen(w, j0 + i, c->q + i * stride);
        if (p->is_signed) signed_quads(c->q + i * stride, k, p->paired.q + i * p->paired.stride);
        if (type->scales) type->scales(w, j0 + i, c->scale + i * blocks, c->minimum ? c->minimum + i * groups : NULL);
        if (p->scaled) type->sub_scales(w, j0 + i, c->sub + i * p->entries * blocks, c->super + i * (blocks / 8));
    }
    const float *bias = w->bias ? w->bias + j0 : NULL;
    for (int64_t r0 = p->b0; r0 < p->m && r0 < p->b0 + p->block; r0 += LANES) {
        const LaneRows x = lane_group(p->xq, r0 / LANES, k);
        const int64_t count = p->m - r0 < LANES ? p->m - r0 : LANES;
        float *y = p->y + r0 * p->ldy + j0;
        if (p->wide) {
            int_group_avx512(&x, k, w, c, n, count, p->tile, bias, y, p->ldy);
        } else {
            p->int_channels_avx2(&x, k, w->group, p->is_signed ? &p->paired : c, n, count, p->is_signed,
                                 type->sub_blocks, type->wide_values, p->scaled, p->offset, p->tile);
            store_lanes_avx2(p->tile, n, (int)count, bias, y, p->ldy);
        }
    }
}

static void int_panel_units(const void *context, int64_t u0, int64_t u1) {
    const IntPanels *p = context;
    const int64_t panels = (p->w->n + p->panel - 1) / p->panel;
    for (int64_t t = u0 * p->per_unit; t < u1 * p->per_unit && t < panels; t++) int_panel(p, t);
}

/* Channels a unit of the team's work holds (`team_units`): whole panels, 192 bytes of each output row, so threads
 * running neighbouring units never write into one cache line. */
#define UNIT_CHANNELS 48

/* y = x Wᵀ (+ bias) for m rows quantized in xq and laid out in its lanes (`lay_out_lanes`, K = w->k, groups of
 * w->group), run by every thread of the calling team as `gemm_panels`: the team splits panels of INT_CHANNELS
 * channels (AVX2: `avx2_panel_channels`), each widened once for every group of 16 rows, by `team_units` (the last
 * half of each thread's share to whichever is free). `buffer`: gemm_buffer_floats(K) floats, 64-byte aligned. The
 * AVX-512 micro-kernels where the lanes kernels run at 512 bits (`lanes_avx512`), else the AVX2 ones of a type that
 * has them (`avx2_panels`; the chooser picks these panels on an AVX2 CPU for no other). */
void gemm_panels_int(const Linear *w, const QuantizedRows *xq, int64_t m, float *y, int64_t ldy, float *buffer) {
    const int64_t k = w->k, blocks = k / 32, stride = widened_stride(k);
    const WeightType *type = type_of(w);
    const int wide = lanes_avx512() || !type->avx2_panels, dot = avx2_dot();
    /* The signed types' q + 128 meet vpmaddubsw's int16 pairs only through the sign trick; vpdpbusd sums any u8 in
     * int32, so the VNNI forms multiply the widened bytes as the AVX-512 kernels do, the offset's term off each
     * block's start: no sign per quad and channel (one thread, 2,048 × 2,048 Q8_0 at 512 rows: 1.37x → 1.82x over
     * vpmaddubsw; bench/RESULTS.md). */
    const int is_signed = !wide && type->offset == 128 && dot == AVX2_DOT_MADDUBS;
    const int panel = wide ? INT_CHANNELS : avx2_panel_channels(k, w->n, is_signed);
    IntChannels c = {(uint8_t *)buffer, buffer + panel * stride / 4, NULL, stride, NULL, NULL};
    const int scaled = w->supers && type->sub_scales, entries = sub_entries(type);
    if (scaled) /* after the minimums (`channel_floats`); Q6L's three a block in the room of its scales and minimums */
        c.sub = (int32_t *)(c.scale + (3 - entries) * panel * blocks), c.super = c.scale + 3 * panel * blocks;
    if (type->minimums) c.minimum = c.scale + panel * blocks;
    float *tile = buffer + channel_floats(k, panel);
    memset(tile, 0, sizeof(float) * tile_floats(panel)); /* the channels past a short group's are read, never stored */
    /* the AVX2 micro-kernel's signed quads, after the tile (panel · (2K + 64) bytes: within gemm_buffer_floats) */
    IntChannels paired = c;
    paired.q = (uint8_t *)(tile + tile_floats(panel)), paired.stride = widened_stride(2 * k);
    /* Prompt chunks go INT_ROW_BLOCK_BYTES of laid-out rows at a time, so those stay in cache while every group of
     * channels meets them (each group is widened again per block). */
    const int64_t block = (INT_ROW_BLOCK_BYTES / (int64_t)sizeof(float) / lane_floats(k) + 1) * LANES;
    const int per_unit = UNIT_CHANNELS / panel < 1 ? 1 : UNIT_CHANNELS / panel;
    IntPanels p = {w, type, xq, y, tile, m, ldy, k, stride, 0, block, panel, per_unit, wide, is_signed, scaled,
                   entries, wide || is_signed ? 0 : type->offset, c, paired, INT_CHANNELS_AVX2[dot]};
    const int64_t units = ((w->n + panel - 1) / panel + per_unit - 1) / per_unit;
    for (p.b0 = 0; p.b0 < m; p.b0 += block) team_units(units, PANEL_TAIL, int_panel_units, &p);
}

/* ---- row panels (AVX2): a weight in the rows layouts (Q4, Q8G, Q8) over int16 rows, for prompt chunks and steps of
 * `kettle_row_gemm_rows` rows and more, each row's bits those of the row alone (batch invariance: kernels.h
 * `linear_channel_rows`, whose one-row channels they reproduce). A row's output is two float chains over the blocks of
 * 32 inputs (even blocks, odd blocks; Q8's one chain over all), each block adding its 8 lanes of integer sums times
 * the combined scale, then one horizontal sum. The chains are independent, so a tile runs the even blocks of all its
 * outputs, then the odd ones: TILE_R rows × TILE_C channels of one chain each stay in registers, the widened weights
 * and the rows in L1, and a block costs two vpmaddwd, an add, a conversion and an FMA per row and channel (the
 * float32 panels: four FMAs per 32 products), with no transposes. */

#define ROW_PANEL 24 /* output channels widened per panel */
#define TILE_R 3     /* rows of a tile (2 × 4, 4 × 3, 1 × 6 and one pass of both chains measured no faster) */
#define TILE_C 3     /* channels of a tile */

/* From these many rows on the row panels replace `linear_channel_rows` (the same bits either way: tests set 1 and
 * 1 << 30 to hold both to them). Below it the channels' passes of 4 rows ran as fast (3072 × 576 int4, one thread:
 * 16 rows 0.90 against 1.04 ms, 256 rows even); above it their rows no longer stay in L2 across the channels (512
 * rows 35.7 against 31.9 ms, 2048 rows 187 against 128). */
int kettle_row_gemm_rows = 256;

/* The panel's channels widened to int16 [ROW_PANEL][K], their scales per block [ROW_PANEL][K/32] and one tile's
 * combined scales [TILE_R][TILE_C][K/32]. */
int64_t row_panel_floats(int64_t k) {
    return (ROW_PANEL * k / 2 + ROW_PANEL * (k / 32) + TILE_R * TILE_C * (k / 32) + 15) / 16 * 16;
}

/* Channel j as K int16 in input order and its scale per block of 32 (the table's `widen_row`): Q4's 0..15, unpacked
 * as `q4_channel_one` unpacks a chunk. */
void q4_panel_row(const Linear *w, int64_t j, int16_t *dst, float *scale) {
    const int64_t k = w->k;
    const uint8_t *src = (const uint8_t *)w->weight + j * (k / 2);
    const __m256i mask = _mm256_set1_epi16(0x0F);
    for (int64_t c = 0; c < k / 64; c++) {
        const __m256i lo = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)(src + c * 32)));
        const __m256i hi = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)(src + c * 32 + 16)));
        _mm256_storeu_si256((__m256i *)(dst + c * 64), _mm256_and_si256(lo, mask));
        _mm256_storeu_si256((__m256i *)(dst + c * 64 + 16), _mm256_and_si256(hi, mask));
        _mm256_storeu_si256((__m256i *)(dst + c * 64 + 32), _mm256_srli_epi16(lo, 4));
        _mm256_storeu_si256((__m256i *)(dst + c * 64 + 48), _mm256_srli_epi16(hi, 4));
    }
    const uint16_t *halves = (const uint16_t *)w->scales + j * (k / w->group);
    for (int64_t b = 0; b < k / 32; b++) scale[b] = _cvtsh_ss(halves[b * 32 / w->group]);
}

/* The int8 values of a rows layout's channel. */
static void int8_row(const Linear *w, int64_t j, int16_t *dst) {
    const int8_t *src = (const int8_t *)w->weight + j * w->k;
    for (int64_t i = 0; i < w->k; i += 16)
        _mm256_storeu_si256((__m256i *)(dst + i), _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(src + i))));
}

/* Q8's: scale 1 per block, its one scale applied at the end as `q8_row_qa`'s caller does. */
void q8_panel_row(const Linear *w, int64_t j, int16_t *dst, float *scale) {
    int8_row(w, j, dst);
    for (int64_t b = 0; b < w->k / 32; b++) scale[b] = 1.0f;
}

/* Q8_0's: its float16 scale per block. */
void q8g_panel_row(const Linear *w, int64_t j, int16_t *dst, float *scale) {
    int8_row(w, j, dst);
    for (int64_t b = 0; b < w->k / 32; b++) scale[b] = _cvtsh_ss(((const uint16_t *)w->scales)[j * (w->k / 32) + b]);
}

/* Blocks first, first + step, .. of rows x[0 .. R) against channels q[0 .. C) (K int16 each, K apart) into acc[r][c],
 * as `block_dot` and the one-row channels add a block. */
static inline __attribute__((always_inline)) void row_chain(const int16_t *const *x, const int R, const int16_t *q,
                                                            int64_t k, const int C, const float *combined,
                                                            int64_t blocks, int64_t first, int64_t step,
                                                            __m256 acc[TILE_R][TILE_C]) {
    __m256 a[TILE_R][TILE_C]; /* a local copy the compiler keeps in registers (the caller's it stored every block) */
    for (int r = 0; r < R; r++)
        for (int c = 0; c < C; c++) a[r][c] = acc[r][c];
    for (int64_t b = first; b < blocks; b += step)
        for (int r = 0; r < R; r++) {
            const __m256i lo = _mm256_load_si256((const __m256i *)(x[r] + b * 32));
            const __m256i hi = _mm256_load_si256((const __m256i *)(x[r] + b * 32 + 16));
            for (int c = 0; c < C; c++) {
                const int16_t *wc = q + c * k + b * 32;
                const __m256i sums = _mm256_add_epi32(_mm256_madd_epi16(_mm256_loadu_si256((const __m256i *)wc), lo),
                                                      _mm256_madd_epi16(_mm256_loadu_si256((const __m256i *)(wc + 16)), hi));
                const __m256 scale = _mm256_broadcast_ss(combined + (r * TILE_C + c) * blocks + b);
                a[r][c] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums), scale, a[r][c]);
            }
        }
    for (int r = 0; r < R; r++)
        for (int c = 0; c < C; c++) acc[r][c] = a[r][c];
}

/* Rows r0 .. r0 + R - 1 × channels j0 .. j0 + C - 1 (widened in q, their block scales in `scale`) into y. */
static inline __attribute__((always_inline)) void row_tile(const Linear *w, const QuantizedRows *xq, int64_t r0,
                                                           const int R, const int16_t *q, const float *scale,
                                                           int64_t j0, const int C, float *combined, float *y,
                                                           int64_t ldy) {
    const int64_t k = w->k, blocks = k / 32, groups = k / w->group;
    const WeightType *type = type_of(w);
    const int16_t *x[TILE_R];
    __m256 acc0[TILE_R][TILE_C], acc1[TILE_R][TILE_C];
    float tail[TILE_R][TILE_C];
    for (int r = 0; r < R; r++) {
        const QuantizedRows row = quantized_row(xq, r0 + r, k, w->group);
        x[r] = row.q;
        for (int c = 0; c < C; c++) {
            float *into = combined + (r * TILE_C + c) * blocks; /* d_x · scale per block, as `combined_scales` */
            int64_t b = 0;
            for (; b + 8 <= blocks; b += 8)
                _mm256_storeu_ps(into + b, _mm256_mul_ps(_mm256_loadu_ps(scale + c * blocks + b), _mm256_loadu_ps(row.scale + b)));
            for (; b < blocks; b++) into[b] = scale[c * blocks + b] * row.scale[b];
            acc0[r][c] = acc1[r][c] = _mm256_setzero_ps(), tail[r][c] = 0.0f;
            if (type->minimums) { /* the minimums as `q4_channel_one_at` starts and ends with them */
                const Minimums mins = channel_minimums(w->mins, w->scales, groups, j0 + c);
                acc0[r][c] = _mm256_mul_ps(minimum_lanes(mins.table, row.sum, groups, _mm256_setzero_ps()), _mm256_set1_ps(mins.factor));
                tail[r][c] = mins.factor * minimum_tail(mins.table, row.sum, groups, 0.0f);
            }
        }
    }
    if (type->channel_scale) { /* one chain, then the channel's scale: `q8_row_qa` and its caller */
        row_chain(x, R, q, k, C, combined, blocks, 0, 1, acc0);
        for (int r = 0; r < R; r++)
            for (int c = 0; c < C; c++) {
                const int64_t j = j0 + c;
                y[(r0 + r) * ldy + j] = hsum(acc0[r][c]) * ((const float *)w->scales)[j] + (w->bias ? w->bias[j] : 0.0f);
            }
        return;
    }
    row_chain(x, R, q, k, C, combined, blocks, 0, 2, acc0);
    row_chain(x, R, q, k, C, combined, blocks, 1, 2, acc1);
    for (int r = 0; r < R; r++)
        for (int c = 0; c < C; c++) {
            const int64_t j = j0 + c;
            float out = hsum(_mm256_add_ps(acc0[r][c], acc1[r][c]));
            if (type->minimums) out += tail[r][c];
            y[(r0 + r) * ldy + j] = out + (w->bias ? w->bias[j] : 0.0f);
        }
}

/* Panel p of w (ROW_PANEL channels from p · ROW_PANEL) widened into `buffer`, then rows r0 .. r1 - 1 through it. */
static void row_panel(const Linear *w, int64_t p, const QuantizedRows *xq, int64_t r0, int64_t r1, float *buffer,
                      float *y, int64_t ldy) {
    const int64_t k = w->k, blocks = k / 32, j0 = p * ROW_PANEL;
    const int count = w->n - j0 < ROW_PANEL ? (int)(w->n - j0) : ROW_PANEL;
    int16_t *q = (int16_t *)buffer;
    float *scale = buffer + ROW_PANEL * k / 2, *combined = scale + ROW_PANEL * blocks;
    for (int i = 0; i < count; i++) type_of(w)->widen_row(w, j0 + i, q + i * k, scale + i * blocks);
    for (int64_t r = r0; r < r1; r += TILE_R) {
        const int R = r1 - r < TILE_R ? (int)(r1 - r) : TILE_R;
        for (int c = 0; c < count; c += TILE_C) {
            const int C = count - c < TILE_C ? count - c : TILE_C;
#define TILE(rr, cc) row_tile(w, xq, r, rr, q + c * k, scale + c * blocks, j0 + c, cc, combined, y, ldy)
#define CHANNELS(rr) if (C == 3) TILE(rr, 3); else if (C == 2) TILE(rr, 2); else TILE(rr, 1);
            if (R == 3) { CHANNELS(3) }
            else if (R == 2) { CHANNELS(2) }
            else { CHANNELS(1) }
#undef CHANNELS
#undef TILE
        }
    }
}

typedef struct {
    const Linear *w;
    const QuantizedRows *xq;
    int64_t b0, b1, ldy;
    float *buffer, *y;
} RowPanels;

/* Two row panels a unit: 48 columns, 192 bytes of each row, so neighbouring units never share a cache line. */
static void row_panel_units(const void *context, int64_t u0, int64_t u1) {
    const RowPanels *r = context;
    const int64_t panels = (r->w->n + ROW_PANEL - 1) / ROW_PANEL;
    for (int64_t p = 2 * u0; p < 2 * u1 && p < panels; p++) row_panel(r->w, p, r->xq, r->b0, r->b1, r->buffer, r->y, r->ldy);
}

/* y = x Wᵀ (+ bias) for m rows quantized in xq (K = w->k, groups of w->group), run by every thread of the calling
 * team (its panels split by `team_units`): ROW_BLOCK_BYTES of rows at a time, so they stay in L2 while every panel
 * of the thread meets them. `buffer`: this thread's row_panel_floats(K) floats, 64-byte aligned. */
void gemm_row_panels(const Linear *w, const QuantizedRows *xq, int64_t m, float *y, int64_t ldy, float *buffer) {
    const int64_t panels = (w->n + ROW_PANEL - 1) / ROW_PANEL;
    int64_t block = ROW_BLOCK_BYTES / (2 * w->k) / TILE_R * TILE_R;
    block = block < TILE_R ? TILE_R : block;
    RowPanels r = {w, xq, 0, 0, ldy, buffer, y};
    for (r.b0 = 0; r.b0 < m; r.b0 += block) {
        r.b1 = m - r.b0 < block ? m : r.b0 + block;
        team_units((panels + 1) / 2, PANEL_TAIL, row_panel_units, &r);
    }
}
