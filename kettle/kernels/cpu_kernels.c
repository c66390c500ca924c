/* Kettle's CPU decode kernels (AVX2 + FMA + F16C), built on first use by kettle/kernels/build.py.
 *
 * Decode on a CPU reads every weight once per step for a handful of activation rows, so these kernels stream
 * the quantized weights once per tile of up to MAX_TILE rows and unpack them in registers. The activations
 * arrive in float32 (PyTorch's packed int4/int8 kernels want bfloat16 for their fast path, converted in software
 * on AVX2, a cast each way per call) and are either used as they are (`*_linear`, exact to the dequantized
 * weights) or quantized to int16 per block of 32 for integer dot products (`*_linear_qa`, the default).
 * Threads split the output channels; the OpenMP runtime is the one PyTorch loaded (same soname), so both share
 * one thread pool.
 *
 * Q4 layout (kettle/quantization/q4.py packs it): weight [N, K], K a multiple of 64, in chunks of 64 input
 * channels; chunk c of row n is 32 bytes at qw[n*K/2 + c*32], byte j = q[c*64 + j] | q[c*64 + 32 + j] << 4,
 * q in 0..15, so one 32-byte load and a mask (or shift and mask) give 32 consecutive weights in order.
 * Group g (a multiple of 32) of row n has a float16 scale and minimum at [n*K/g + k/g]: w = q*scale + minimum.
 *
 * Q8 layout: weight [N, K] int8 row-major, one float32 scale per output channel: w = q*scale.
 */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

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

static inline float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
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
    const uint16_t *mins, float *out
) {
    __m256 acc[MAX_TILE][2];
    for (int m = 0; m < tile; m++) acc[m][0] = acc[m][1] = _mm256_setzero_ps();
    for (int64_t c = 0; c < k / 64; c++) {
        __m256i halves[2];
        q4_chunk(qw + c * 32, halves);
        for (int h = 0; h < 2; h++) {
            const int64_t col = c * 64 + h * 32, g = col / group;
            __m256 w[4];
            q4_dequant(halves[h], _mm256_set1_ps(_cvtsh_ss(scales[g])), _mm256_set1_ps(_cvtsh_ss(mins[g])), w);
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

/* y[M, N] = x[M, K] · Wᵀ (+ bias) for a Q4 weight; rows of x and y are ldx / ldy floats apart. */
void kettle_q4_linear(
    const float *x, int64_t ldx, int64_t rows, int64_t k, const uint8_t *qw, const uint16_t *scales,
    const uint16_t *mins, int64_t n, int group, const float *bias, float *y, int64_t ldy, int threads
) {
    const int64_t groups = k / group;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t j = 0; j < n; j++) {
        const uint8_t *row_q = qw + j * (k / 2);
        const uint16_t *row_s = scales + j * groups, *row_m = mins + j * groups;
        const float b = bias ? bias[j] : 0.0f;
        float out[MAX_TILE];
#define ROW(t) q4_row(x + m0 * ldx, ldx, t, k, group, row_q, row_s, row_m, out)
#define STORE(m) y[(m0 + m) * ldy + j] = out[m] + b
        FOR_EACH_TILE(rows, ROW, STORE)
#undef ROW
#undef STORE
    }
}

/* W [N, K] float32 from its Q4 form, for the dense GEMM of large prefills (parallel over rows). */
void kettle_q4_dequantize(
    const uint8_t *qw, const uint16_t *scales, const uint16_t *mins, int64_t n, int64_t k, int group, float *out,
    int threads
) {
    const int64_t groups = k / group;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t j = 0; j < n; j++) {
        for (int64_t c = 0; c < k / 64; c++) {
            __m256i halves[2];
            q4_chunk(qw + j * (k / 2) + c * 32, halves);
            for (int h = 0; h < 2; h++) {
                const int64_t col = c * 64 + h * 32, g = j * groups + col / group;
                __m256 w[4];
                q4_dequant(halves[h], _mm256_set1_ps(_cvtsh_ss(scales[g])), _mm256_set1_ps(_cvtsh_ss(mins[g])), w);
                for (int i = 0; i < 4; i++) _mm256_storeu_ps(out + j * k + col + 8 * i, w[i]);
            }
        }
    }
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

/* y[M, N] = x[M, K] · Wᵀ (+ bias) for a per-channel int8 weight (K a multiple of 16). */
void kettle_q8_linear(
    const float *x, int64_t ldx, int64_t rows, int64_t k, const int8_t *qw, const float *scales, int64_t n,
    const float *bias, float *y, int64_t ldy, int threads
) {
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t j = 0; j < n; j++) {
        const int8_t *row_q = qw + j * k;
        const float b = bias ? bias[j] : 0.0f;
        float out[MAX_TILE];
#define ROW(t) q8_row(x + m0 * ldx, ldx, t, k, row_q, out)
#define STORE(m) y[(m0 + m) * ldy + j] = out[m] * scales[j] + b
        FOR_EACH_TILE(rows, ROW, STORE)
#undef ROW
#undef STORE
    }
}

/* ---- int16-activation variants: activations quantized per block of 32 (absmax / 32767), integer dot products
 * (`madd_epi16`: products of 16-bit pairs summed into 32-bit lanes, exact). A block costs a few integer
 * instructions instead of a float dequantization per weight, and the activations keep ~15 bits: the outputs
 * move by ~1e-5 relative. (8-bit activations, llama.cpp's choice, were ~1.3x faster again here but moved the
 * bundled model's int4 next-token distribution 26x further from float32's: outlier channels.) */

typedef struct {
    int16_t *q;    /* [rows, K] */
    float *scale;  /* [rows, K/32] */
    float *sum;    /* [rows, K/group]: the exact float sum of each weight group's inputs (the minimum term) */
} QuantizedRows;

static void free_rows(QuantizedRows *rows) {
    free(rows->q);
    free(rows->scale);
    free(rows->sum);
}

static int quantize_rows(const float *x, int64_t ldx, int64_t rows, int64_t k, int64_t group, QuantizedRows *out) {
    const int64_t blocks = k / 32, groups = k / group;
    out->q = aligned_alloc(32, sizeof(int16_t) * (size_t)(rows * k + 32));
    out->scale = malloc(sizeof(float) * (size_t)(rows * blocks));
    out->sum = calloc((size_t)(rows * groups), sizeof(float));
    if (!out->q || !out->scale || !out->sum) return -1;
    const __m256 sign = _mm256_set1_ps(-0.0f);
    for (int64_t m = 0; m < rows; m++) {
        for (int64_t b = 0; b < blocks; b++) {
            const float *src = x + m * ldx + b * 32;
            __m256 v[4];
            for (int i = 0; i < 4; i++) v[i] = _mm256_loadu_ps(src + 8 * i);
            const __m256 amax8 = _mm256_max_ps(
                _mm256_max_ps(_mm256_andnot_ps(sign, v[0]), _mm256_andnot_ps(sign, v[1])),
                _mm256_max_ps(_mm256_andnot_ps(sign, v[2]), _mm256_andnot_ps(sign, v[3]))
            );
            __m128 amax4 = _mm_max_ps(_mm256_castps256_ps128(amax8), _mm256_extractf128_ps(amax8, 1));
            amax4 = _mm_max_ps(amax4, _mm_movehl_ps(amax4, amax4));
            amax4 = _mm_max_ss(amax4, _mm_movehdup_ps(amax4));
            const float d = _mm_cvtss_f32(amax4) / 32767.0f;
            const __m256 inv = _mm256_set1_ps(d > 0.0f ? 1.0f / d : 0.0f);
            __m256i q[4]; /* rounded to nearest */
            for (int i = 0; i < 4; i++) q[i] = _mm256_cvtps_epi32(_mm256_mul_ps(v[i], inv));
            /* packs works within 128-bit lanes: [0-3, 8-11 | 4-7, 12-15]; the permute restores the order. */
            int16_t *dst = out->q + m * k + b * 32;
            _mm256_store_si256((__m256i *)dst, _mm256_permute4x64_epi64(_mm256_packs_epi32(q[0], q[1]), 0xD8));
            _mm256_store_si256((__m256i *)(dst + 16), _mm256_permute4x64_epi64(_mm256_packs_epi32(q[2], q[3]), 0xD8));
            out->scale[m * blocks + b] = d;
            out->sum[m * groups + b * 32 / group] += hsum(_mm256_add_ps(_mm256_add_ps(v[0], v[1]), _mm256_add_ps(v[2], v[3])));
        }
    }
    return 0;
}

/* The integer dot product of one block of 32 weights (as two vectors of 16 int16) with 32 int16 activations. */
static inline __m256 block_dot(__m256i w_lo, __m256i w_hi, const int16_t *x) {
    const __m256i lo = _mm256_madd_epi16(w_lo, _mm256_load_si256((const __m256i *)x));
    const __m256i hi = _mm256_madd_epi16(w_hi, _mm256_load_si256((const __m256i *)(x + 16)));
    return _mm256_cvtepi32_ps(_mm256_add_epi32(lo, hi));
}

/* Σ_g minimum_g · (Σ x over group g): the minimums' share of one output, 8 groups per step. */
static inline float minimum_term(const uint16_t *mins, const float *sums, int64_t groups) {
    __m256 acc = _mm256_setzero_ps();
    int64_t g = 0;
    for (; g + 8 <= groups; g += 8)
        acc = _mm256_fmadd_ps(_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(mins + g))), _mm256_loadu_ps(sums + g), acc);
    float total = hsum(acc);
    for (; g < groups; g++) total += _cvtsh_ss(mins[g]) * sums[g];
    return total;
}

/* One Q4 output channel for `tile` quantized activation rows: Σ_blocks (d_x · scale_g) · (q · x_q), plus the
 * minimums' term. The weight scale is folded into each row's activation scale per block (one multiply) rather
 * than applied at each group's end: with the 32-wide groups of Q4_1 checkpoints that flush was every block. */
static inline __attribute__((always_inline)) void q4_row_qa(
    const QuantizedRows *xq, int64_t row0, int tile, int64_t k, int group, const uint8_t *qw,
    const uint16_t *scales, const uint16_t *mins, float *out
) {
    const int64_t blocks = k / 32, groups = k / group;
    const int blocks_per_group = group / 32;
    __m256 total[MAX_TILE];
    for (int m = 0; m < tile; m++) total[m] = _mm256_setzero_ps();
    int64_t g = 0;
    int in_group = 0;
    for (int64_t c = 0; c < k / 64; c++) {
        __m256i halves[2];
        q4_chunk(qw + c * 32, halves);
        for (int h = 0; h < 2; h++) {
            const int64_t block = 2 * c + h;
            const __m256i w_lo = _mm256_cvtepu8_epi16(_mm256_castsi256_si128(halves[h]));
            const __m256i w_hi = _mm256_cvtepu8_epi16(_mm256_extracti128_si256(halves[h], 1));
            const __m256 scale = _mm256_set1_ps(_cvtsh_ss(scales[g]));
            for (int m = 0; m < tile; m++) {
                const int64_t r = row0 + m;
                const __m256 d = _mm256_mul_ps(_mm256_broadcast_ss(xq->scale + r * blocks + block), scale);
                total[m] = _mm256_fmadd_ps(block_dot(w_lo, w_hi, xq->q + r * k + block * 32), d, total[m]);
            }
            if (++in_group == blocks_per_group) g++, in_group = 0;
        }
    }
    for (int m = 0; m < tile; m++) out[m] = hsum(total[m]) + minimum_term(mins, xq->sum + (row0 + m) * groups, groups);
}

/* `kettle_q4_linear` with quantized activations. Returns -1 when out of memory (nothing written). */
int kettle_q4_linear_qa(
    const float *x, int64_t ldx, int64_t rows, int64_t k, const uint8_t *qw, const uint16_t *scales,
    const uint16_t *mins, int64_t n, int group, const float *bias, float *y, int64_t ldy, int threads
) {
    QuantizedRows xq;
    if (quantize_rows(x, ldx, rows, k, group, &xq)) return free_rows(&xq), -1;
    const int64_t groups = k / group;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t j = 0; j < n; j++) {
        const uint8_t *row_q = qw + j * (k / 2);
        const uint16_t *row_s = scales + j * groups, *row_m = mins + j * groups;
        const float b = bias ? bias[j] : 0.0f;
        float out[MAX_TILE];
#define ROW(t) q4_row_qa(&xq, m0, t, k, group, row_q, row_s, row_m, out)
#define STORE(m) y[(m0 + m) * ldy + j] = out[m] + b
        FOR_EACH_TILE(rows, ROW, STORE)
#undef ROW
#undef STORE
    }
    free_rows(&xq);
    return 0;
}

static inline __attribute__((always_inline)) void q8_row_qa(
    const QuantizedRows *xq, int64_t row0, int tile, int64_t k, const int8_t *qw, float *out
) {
    const int64_t blocks = k / 32;
    __m256 acc[MAX_TILE];
    for (int m = 0; m < tile; m++) acc[m] = _mm256_setzero_ps();
    for (int64_t b = 0; b < blocks; b++) {
        const __m256i w = _mm256_loadu_si256((const __m256i *)(qw + b * 32));
        const __m256i w_lo = _mm256_cvtepi8_epi16(_mm256_castsi256_si128(w));
        const __m256i w_hi = _mm256_cvtepi8_epi16(_mm256_extracti128_si256(w, 1));
        for (int m = 0; m < tile; m++) {
            const int64_t r = row0 + m;
            const __m256 d = _mm256_broadcast_ss(xq->scale + r * blocks + b);
            acc[m] = _mm256_fmadd_ps(block_dot(w_lo, w_hi, xq->q + r * k + b * 32), d, acc[m]);
        }
    }
    for (int m = 0; m < tile; m++) out[m] = hsum(acc[m]);
}

/* `kettle_q8_linear` with quantized activations (K a multiple of 32). Returns -1 when out of memory. */
int kettle_q8_linear_qa(
    const float *x, int64_t ldx, int64_t rows, int64_t k, const int8_t *qw, const float *scales, int64_t n,
    const float *bias, float *y, int64_t ldy, int threads
) {
    QuantizedRows xq;
    if (quantize_rows(x, ldx, rows, k, k, &xq)) return free_rows(&xq), -1;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t j = 0; j < n; j++) {
        const int8_t *row_q = qw + j * k;
        const float b = bias ? bias[j] : 0.0f;
        float out[MAX_TILE];
#define ROW(t) q8_row_qa(&xq, m0, t, k, row_q, out)
#define STORE(m) y[(m0 + m) * ldy + j] = out[m] * scales[j] + b
        FOR_EACH_TILE(rows, ROW, STORE)
#undef ROW
#undef STORE
    }
    free_rows(&xq);
    return 0;
}

/* ---- element-wise kernels of a decoder layer (float32): each replaces a chain of PyTorch ops whose fixed
 * per-op cost dominates at decode sizes. Rows run in parallel only when there is enough work to pay for it. */

#define PARALLEL_ELEMENTS 65536

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

/* out = x · rsqrt(mean(x²) + eps) · weight per row of `dim`; with `residual`, x is first replaced by
 * residual + x, which is also written to `total` (the residual stream the next block adds to). */
void kettle_rms_norm(
    const float *x, const float *residual, const float *weight, int64_t rows, int64_t dim, float eps, float *out,
    float *total, int threads
) {
#pragma omp parallel for num_threads(threads) schedule(static) if (rows * dim >= PARALLEL_ELEMENTS)
    for (int64_t r = 0; r < rows; r++) {
        const float *xr = x + r * dim;
        float *dst = out + r * dim;
        if (residual) {
            float *sum = total + r * dim;
            for (int64_t i = 0; i < dim; i++) sum[i] = residual[r * dim + i] + xr[i];
            xr = sum;
        }
        __m256 acc = _mm256_setzero_ps();
        int64_t i = 0;
        for (; i + 8 <= dim; i += 8) {
            const __m256 v = _mm256_loadu_ps(xr + i);
            acc = _mm256_fmadd_ps(v, v, acc);
        }
        float squares = hsum(acc);
        for (; i < dim; i++) squares += xr[i] * xr[i];
        const float inv = 1.0f / sqrtf(squares / (float)dim + eps);
        for (i = 0; i < dim; i++) dst[i] = xr[i] * inv * weight[i];
    }
}

/* out [T, I] = silu(gate) · up for gate_up [T, 2I] (gate first, as the fused projection stores them). */
void kettle_silu_mul(const float *gate_up, int64_t rows, int64_t inner, float *out, int threads) {
#pragma omp parallel for num_threads(threads) schedule(static) if (rows * inner >= PARALLEL_ELEMENTS)
    for (int64_t r = 0; r < rows; r++) {
        const float *gate = gate_up + r * 2 * inner, *up = gate + inner;
        float *dst = out + r * inner;
        int64_t i = 0;
        for (; i + 8 <= inner; i += 8) {
            const __m256 g = _mm256_loadu_ps(gate + i);
            const __m256 sig = _mm256_div_ps(g, _mm256_add_ps(_mm256_set1_ps(1.0f), exp_ps(_mm256_sub_ps(_mm256_setzero_ps(), g))));
            _mm256_storeu_ps(dst + i, _mm256_mul_ps(sig, _mm256_loadu_ps(up + i)));
        }
        for (; i < inner; i++) dst[i] = gate[i] / (1.0f + expf(-gate[i])) * up[i];
    }
}

/* RoPE in the halves layout: out[t, h, i] = x[t, h, i] · cos[t, i] + x[t, h, (i + D/2) % D] · sin[t, i], with
 * sin already signed; x rows are `stride` floats apart (a view into the fused qkv output), out is contiguous. */
void kettle_rope(
    const float *x, int64_t stride, const float *cos, const float *sin, int64_t rows, int64_t heads, int64_t dim,
    float *out, int threads
) {
    const int64_t half = dim / 2;
#pragma omp parallel for num_threads(threads) schedule(static) if (rows * heads * dim >= PARALLEL_ELEMENTS)
    for (int64_t t = 0; t < rows; t++) {
        const float *c = cos + t * dim, *s = sin + t * dim;
        for (int64_t h = 0; h < heads; h++) {
            const float *src = x + t * stride + h * dim;
            float *dst = out + (t * heads + h) * dim;
            for (int64_t i = 0; i < half; i++) dst[i] = src[i] * c[i] + src[i + half] * s[i];
            for (int64_t i = half; i < dim; i++) dst[i] = src[i] * c[i] + src[i - half] * s[i];
        }
    }
}

/* ---- paged decode attention (float32): one new query token per sequence, its K/V read in place from the
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

/* q [S, H, D], caches [slots, Hkv, D], tables [S, max_blocks], positions [S] (of the new token; the context
 * is positions + 1 long),
 * out [S, H, D]. `window` > 0 keeps only the last `window` positions. Returns -1 when out of memory. */
int kettle_paged_decode(
    const float *q, const float *k_cache, const float *v_cache, const int64_t *tables, int64_t max_blocks,
    const int64_t *positions, int64_t seqs, int64_t heads, int64_t kv_heads, int64_t dim, int64_t block_size,
    float scale, int64_t window, float *out, int threads
) {
    const int64_t group = heads / kv_heads;
    int64_t longest = 0;
    for (int64_t s = 0; s < seqs; s++) longest = positions[s] + 1 > longest ? positions[s] + 1 : longest;
    int failed = 0;
#pragma omp parallel num_threads(threads) reduction(| : failed)
    {
        float *scores = malloc(sizeof(float) * (size_t)(group * (longest + 1)));
        if (!scores) failed = 1;
#pragma omp for schedule(dynamic, 1)
        for (int64_t item = 0; item < seqs * kv_heads; item++) {
            if (!scores) continue;
            const int64_t s = item / kv_heads, h = item % kv_heads, len = positions[s] + 1;
            const int64_t first = window > 0 && len > window ? len - window : 0, span = len - first;
            const int64_t *table = tables + s * max_blocks;
            const float *qs = q + (s * heads + h * group) * dim;
            for (int64_t t = first; t < len; t++) {
                const int64_t slot = table[t / block_size] * block_size + t % block_size;
                const float *key = k_cache + (slot * kv_heads + h) * dim;
                for (int64_t g = 0; g < group; g++) scores[g * span + t - first] = dot_f32(qs + g * dim, key, dim) * scale;
            }
            for (int64_t g = 0; g < group; g++) {
                float *row = scores + g * span, top = -INFINITY, total = 0.0f;
                for (int64_t i = 0; i < span; i++) top = fmaxf(top, row[i]);
                int64_t i = 0;
                __m256 sums = _mm256_setzero_ps();
                for (; i + 8 <= span; i += 8) {
                    const __m256 e = exp_ps(_mm256_sub_ps(_mm256_loadu_ps(row + i), _mm256_set1_ps(top)));
                    _mm256_storeu_ps(row + i, e);
                    sums = _mm256_add_ps(sums, e);
                }
                total = hsum(sums);
                for (; i < span; i++) total += (row[i] = expf(row[i] - top));
                const float inv = 1.0f / total;
                for (i = 0; i < span; i++) row[i] *= inv;
                float *dst = out + (s * heads + h * group + g) * dim;
                for (int64_t d = 0; d < dim; d++) dst[d] = 0.0f;
            }
            for (int64_t t = first; t < len; t++) {
                const int64_t slot = table[t / block_size] * block_size + t % block_size;
                const float *value = v_cache + (slot * kv_heads + h) * dim;
                for (int64_t g = 0; g < group; g++)
                    axpy_f32(out + (s * heads + h * group + g) * dim, scores[g * span + t - first], value, dim);
            }
        }
        free(scores);
    }
    return failed ? -1 : 0;
}
