/* Kettle's CPU row kernels, one op a call (AVX2 + FMA + F16C), built on first use by kettle/kernels/build.py: the
 * element-wise ops of a decoder layer (`kettle_rows`), the KV cache's writes and the greedy choice. The projections
 * are linear.c's, the attention decode_attention.c's and prefill_attention.c's, a whole decode step
 * decoder_step.c's. Threads run on the OpenMP runtime PyTorch loaded (same soname), so both share one pool.
 */
#include <cpuid.h>
#include <omp.h>
#include <string.h>

#include "kernels.h"

int kettle_context_parts = MAX_PARTS;
int kettle_channel_one = 1;
int kettle_channel_avx512 = -1;
int kettle_cpu_vnni512 = 0;
int kettle_cpu_vnni256 = AVX2_DOT_MADDUBS;
int kettle_avx2_vnni = -1;

/* AVX-VNNI (VEX `vpdpbusd ymm`): cpuid leaf 7 subleaf 1, EAX bit 4, asked directly (gcc 12's and older clangs'
 * __builtin_cpu_supports do not all know it). The OS saves ymm state wherever AVX2 runs, which the library needs. */
static int has_avxvnni(void) {
    unsigned a, b, c, d;
    return __get_cpuid_count(7, 1, &a, &b, &c, &d) && (a >> 4 & 1);
}

__attribute__((constructor)) static void ask_the_cpu(void) {
    __builtin_cpu_init(); /* a library's constructor may run before libgcc's own, which fills in the CPU model */
    /* BW for the byte widening, VL for the integer panels' 8-lane groups */
    kettle_cpu_vnni512 = CPU_HAS_AVX512("avx512f") && CPU_HAS_AVX512("avx512bw") &&
                         CPU_HAS_AVX512("avx512vnni") && CPU_HAS_AVX512("avx512vl");
    /* The VEX form where the CPU has it (the AVX2 kernels' CPUs: Intel's client cores); the EVEX form only where
     * AVX-512's own kernels are switched off (tests, measurement), as `avx2_dot` runs these kernels for no other. */
    if (has_avxvnni()) kettle_cpu_vnni256 = AVX2_DOT_AVXVNNI;
    else if (CPU_HAS_AVX512("avx512vnni") && CPU_HAS_AVX512("avx512vl")) kettle_cpu_vnni256 = AVX2_DOT_VNNI256;
}

/* ---- element-wise kernels of a decoder layer (float32): each replaces a chain of PyTorch ops whose fixed
 * per-op cost dominates at decode sizes. Rows run in parallel only when there is enough work to pay for it. */

#define PARALLEL_ELEMENTS 65536

/* out = RMSNorm(x or residual + x) · weight per row of `dim`; with `residual`, the sum goes to `total`. */
static void rms_norm(
    const float *x, const float *residual, const float *weight, int64_t rows, int64_t dim, float eps, float *out,
    float *total, int threads
) {
#pragma omp parallel for num_threads(threads) schedule(static) if (rows * dim >= PARALLEL_ELEMENTS)
    for (int64_t r = 0; r < rows; r++)
        rms_norm_row(x + r * dim, residual ? residual + r * dim : NULL, weight, dim, eps, out + r * dim,
                     residual ? total + r * dim : NULL);
}

/* out [T, I] = silu(gate) · up for gate_up [T, 2I]. */
static void silu_mul(const float *gate_up, int64_t rows, int64_t inner, float *out, int threads) {
#pragma omp parallel for num_threads(threads) schedule(static) if (rows * inner >= PARALLEL_ELEMENTS)
    for (int64_t r = 0; r < rows; r++) {
        const float *gate = gate_up + r * 2 * inner; /* its up half follows it */
        silu_mul_span(gate, gate + inner, inner, out + r * inner);
    }
}

/* out [T, I] = gelu_tanh(gate) · up for gate_up [T, 2I]. */
static void gelu_tanh_mul(const float *gate_up, int64_t rows, int64_t inner, float *out, int threads) {
#pragma omp parallel for num_threads(threads) schedule(static) if (rows * inner >= PARALLEL_ELEMENTS)
    for (int64_t r = 0; r < rows; r++) {
        const float *gate = gate_up + r * 2 * inner; /* its up half follows it */
        gelu_tanh_mul_span(gate, gate + inner, inner, out + r * inner);
    }
}

/* RoPE for x [T, heads, D] whose rows are `stride` floats apart (a view into the fused qkv output) into a
 * contiguous out; cos/sin [T, D], sin already signed. */
static void rope(
    const float *x, int64_t stride, const float *cos, const float *sin, int64_t rows, int64_t heads, int64_t dim,
    float *out, int threads
) {
#pragma omp parallel for num_threads(threads) schedule(static) if (rows * heads * dim >= PARALLEL_ELEMENTS)
    for (int64_t t = 0; t < rows; t++) rope_row(x + t * stride, cos + t * dim, sin + t * dim, heads, dim, out + t * heads * dim);
}

/* The new tokens' K and V rows (`width` floats each; rows ld_k / ld_v floats apart, e.g. views of the fused qkv
 * output) into their cache slots, converted to the caches' `kv_dtype` (rounded to nearest-even when 16-bit):
 * one call for both caches instead of two index_copy_ calls, each its own parallel region over a prompt chunk. */
void kettle_cache_write(
    const float *k_new, int64_t ld_k, const float *v_new, int64_t ld_v, const int64_t *slots, int64_t tokens,
    int64_t width, void *k_cache, void *v_cache, int kv_dtype, int threads
) {
    const int64_t row_bytes = width * kv_size(kv_dtype);
#pragma omp parallel for num_threads(threads) schedule(static) if (tokens * width >= PARALLEL_ELEMENTS)
    for (int64_t t = 0; t < tokens; t++) {
        store_kv_row((char *)k_cache + slots[t] * row_bytes, k_new + t * ld_k, width, kv_dtype);
        store_kv_row((char *)v_cache + slots[t] * row_bytes, v_new + t * ld_v, width, kv_dtype);
    }
}

/* ---- greedy choice: each row's first maximum and its log-softmax value, in two passes over the row, with no
 * [rows, vocab] log-softmax written (PyTorch's log_softmax, argmax and gather took 75 µs for one row of 49,152
 * scores here and 580 µs for 16; this takes 25 and 188). */

/* The first index of row's maximum (NaN scores are never chosen). */
static inline int64_t first_maximum(const float *row, int64_t n) {
    int64_t i = 0, best = 0;
    float top = -INFINITY;
    if (n >= 8) { /* each lane keeps its own first maximum; the lowest index among the lanes at the top wins */
        __m256 maxima = _mm256_set1_ps(-INFINITY);
        __m256i where = _mm256_setzero_si256(), at = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
        for (; i + 8 <= n; i += 8, at = _mm256_add_epi32(at, _mm256_set1_epi32(8))) {
            const __m256 v = _mm256_loadu_ps(row + i);
            const __m256 greater = _mm256_cmp_ps(v, maxima, _CMP_GT_OQ);
            maxima = _mm256_blendv_ps(maxima, v, greater);
            where = _mm256_blendv_epi8(where, at, _mm256_castps_si256(greater));
        }
        float lanes[8];
        int32_t indices[8];
        _mm256_storeu_ps(lanes, maxima);
        _mm256_storeu_si256((__m256i *)indices, where);
        best = -1;
        for (int l = 0; l < 8; l++)
            if (lanes[l] > top || (lanes[l] == top && indices[l] < best)) top = lanes[l], best = indices[l];
        if (best < 0) best = 0; /* a row of -inf or NaN: index 0, as the tail loop would give */
    }
    for (; i < n; i++)
        if (row[i] > top) top = row[i], best = i;
    return best;
}

/* Σ e^{row − top}: four vector sums of 8 lanes (exp_ps), so each float32 sum takes a quarter of the terms (and
 * the four exponentials overlap), combined in double; the tail in scalar. */
static inline double exp_total(const float *row, int64_t n, float top) {
    int64_t i = 0;
    __m256 sums[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
    const __m256 shift = _mm256_set1_ps(top);
    for (; i + 32 <= n; i += 32)
        for (int s = 0; s < 4; s++)
            sums[s] = _mm256_add_ps(sums[s], exp_ps(_mm256_sub_ps(_mm256_loadu_ps(row + i + 8 * s), shift)));
    for (; i + 8 <= n; i += 8) sums[0] = _mm256_add_ps(sums[0], exp_ps(_mm256_sub_ps(_mm256_loadu_ps(row + i), shift)));
    double total = 0.0;
    for (int s = 0; s < 4; s++) total += hsum(sums[s]);
    for (; i < n; i++) total += expf(row[i] - top);
    return total;
}

/* For scores [rows, vocab] (rows ld floats apart): ids[r] = the first maximum of row r (as argmax picks it) and
 * logprobs[r] = its log-softmax value, −log Σ e^{score − max}. */
void greedy_rows(const float *scores, int64_t rows, int64_t vocab, int64_t ld, int64_t *ids, float *logprobs,
                 int threads) {
#pragma omp parallel for num_threads(threads) schedule(static) if (rows > 1)
    for (int64_t r = 0; r < rows; r++) {
        const float *row = scores + r * ld;
        const int64_t best = first_maximum(row, vocab);
        ids[r] = best;
        logprobs[r] = (float)-log(exp_total(row, vocab, row[best]));
    }
}

enum { ROWS_RMS_NORM = 0, ROWS_SILU_MUL = 1, ROWS_GELU_TANH_MUL = 2, ROWS_ROPE = 3, ROWS_GREEDY = 4 };

/* One row-wise op over `rows` rows of x (ldx floats apart), by `op` (kettle/kernels/ops.py names the arguments):
 * ROWS_RMS_NORM out = RMSNorm(x or a + x) · b over `width`, with `a` (the residual) the sum into out2;
 * ROWS_SILU_MUL / ROWS_GELU_TANH_MUL out [rows, width] = act(gate) · up for x [rows, 2 · width];
 * ROWS_ROPE out [rows, heads, width] = RoPE of x's heads with a = cos, b = sin [rows, width] (sin signed);
 * ROWS_GREEDY out [rows] int64 = each row's first maximum over `width` scores, out2 [rows] its log-softmax value. */
void kettle_rows(int op, const float *x, int64_t ldx, const float *a, const float *b, int64_t rows, int64_t width,
                 int64_t heads, float eps, void *out, void *out2, int threads) {
    switch (op) {
    case ROWS_RMS_NORM: rms_norm(x, a, b, rows, width, eps, out, out2, threads); break;
    case ROWS_SILU_MUL: silu_mul(x, rows, width, out, threads); break;
    case ROWS_GELU_TANH_MUL: gelu_tanh_mul(x, rows, width, out, threads); break;
    case ROWS_ROPE: rope(x, ldx, a, b, rows, heads, width, out, threads); break;
    default: greedy_rows(x, rows, width, ldx, out, out2, threads);
    }
}
