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
 */
#include <omp.h>

#include "kernels.h"

#define PANEL 32 /* output channels per dequantized panel */

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

/* Channels j0 .. j0 + count - 1 of w dequantized into panel[i * PANEL + c] (channel j0 + c, input i); missing
 * channels of a short last panel are zero. `rows` holds 8·K floats: eight channels are dequantized row by row,
 * then written into the panel's layout 8 × 8 at a time through a register transpose (a scalar scatter of every
 * weight cost about as much as a 16-row tile's FMAs). Q8's per-channel scale is folded in, as its dense path
 * (`Int8Linear.dequantized`) does. */
static void dequant_panel(const Linear *w, int64_t j0, int count, float *rows, float *panel) {
    const int64_t k = w->k; /* a multiple of 8 (of 32 for every quantized kind) */
    for (int c0 = 0; c0 < PANEL; c0 += 8) {
        __m256 scale[8];
        for (int c = 0; c < 8; c++) {
            const int64_t channel = j0 + c0 + c;
            if (c0 + c < count) dequant_channel(w, channel, rows + c * k);
            else for (int64_t i = 0; i < k; i++) rows[c * k + i] = 0.0f;
            scale[c] = _mm256_set1_ps(w->kind == LINEAR_Q8 && c0 + c < count ? ((const float *)w->scales)[channel] : 1.0f);
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
static inline __attribute__((always_inline, target("avx512f"))) void micro_avx512(
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

static __attribute__((target("avx512f"))) void panel_rows_avx512(
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
 * tile's outputs (64-byte multiples). */
int64_t gemm_buffer_floats(int64_t k) { return (k * PANEL + 8 * k + 12 * PANEL + 15) / 16 * 16; }

static int wide_kernel(void) { return kettle_gemm_avx512 < 0 ? __builtin_cpu_supports("avx512f") : kettle_gemm_avx512; }

/* Panel p of w dequantized into `buffer` (gemm_buffer_floats(K) floats), then multiplied with rows r0 .. r1 - 1. */
static void panel_gemm(const Linear *w, int64_t p, const float *x, int64_t ldx, int64_t r0, int64_t r1, float *buffer,
                       int wide, float *y, int64_t ldy) {
    const int64_t j0 = p * PANEL;
    const int count = w->n - j0 < PANEL ? (int)(w->n - j0) : PANEL;
    float *rows = buffer + w->k * PANEL, *tile = rows + 8 * w->k;
    dequant_panel(w, j0, count, rows, buffer);
    panel_rows(w, x, ldx, r0, r1, buffer, tile, wide, j0, count, y, ldy);
}

/* y = x Wᵀ (+ bias) for m rows, run by every thread of the calling team (an orphaned `omp for` over the panels,
 * whose closing barrier makes y complete): the decode step's projections from `gemm_rows` rows on. `buffer`:
 * this thread's gemm_buffer_floats(K) floats, 64-byte aligned. */
void gemm_panels(const Linear *w, const float *x, int64_t ldx, int64_t m, float *y, int64_t ldy, float *buffer) {
    const int wide = wide_kernel();
#pragma omp for schedule(static)
    for (int64_t p = 0; p < (w->n + PANEL - 1) / PANEL; p++) panel_gemm(w, p, x, ldx, 0, m, buffer, wide, y, ldy);
}

/* y = x Wᵀ (+ bias) panel by panel for prompt chunks: each thread owns a contiguous range of panels and walks the
 * rows block by block over them. -1 when out of memory. */
int quant_gemm(const Linear *w, const float *x, int64_t ldx, int64_t m, float *y, int64_t ldy, int threads) {
    const int wide = wide_kernel();
    const int64_t panels = (w->n + PANEL - 1) / PANEL, k = w->k;
    const int64_t block = ROW_BLOCK_BYTES / (int64_t)sizeof(float) / k / 12 * 12 + 12;
    int failed = 0;
#pragma omp parallel num_threads(threads) reduction(| : failed)
    {
        const int64_t team = omp_get_num_threads(), id = omp_get_thread_num();
        const int64_t p0 = panels * id / team, p1 = panels * (id + 1) / team;
        float *buffer = aligned_alloc(64, sizeof(float) * (size_t)gemm_buffer_floats(k));
        failed = buffer == NULL;
        for (int64_t r0 = 0; buffer && r0 < m; r0 += block)
            for (int64_t p = p0; p < p1; p++) panel_gemm(w, p, x, ldx, r0, m - r0 < block ? m : r0 + block, buffer, wide, y, ldy);
        free(buffer);
    }
    return failed ? -1 : 0;
}
