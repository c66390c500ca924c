/* Kettle's CPU decode kernels, one op a call (AVX2 + FMA + F16C), built on first use by kettle/kernels/build.py.
 *
 * Decode on a CPU reads every weight once per step for a handful of activation rows, so these kernels stream
 * the quantized weights once per tile of up to MAX_TILE rows and unpack them in registers. The activations
 * arrive in float32 (PyTorch's packed int4/int8 kernels want bfloat16 for their fast path, converted in software
 * on AVX2, a cast each way per call) and are either used as they are (`*_linear`, exact to the dequantized
 * weights) or quantized to int16 per block of 32 for integer dot products (`*_linear_qa`, the default).
 * Threads split the output channels; the OpenMP runtime is the one PyTorch loaded (same soname), so both share
 * one thread pool. The weight layouts and the row-level building blocks are in kernels.h; decoder_step.c runs
 * a whole decode step of a Llama-family model on the same blocks in one call.
 */
#include <omp.h>
#include <string.h>

#include "kernels.h"

int kettle_context_parts = MAX_PARTS;
int kettle_channel_one = 1;
int kettle_channel_avx512 = -1;
int kettle_cpu_vnni512 = 0;

__attribute__((constructor)) static void ask_the_cpu(void) {
    __builtin_cpu_init(); /* a library's constructor may run before libgcc's own, which fills in the CPU model */
    kettle_cpu_vnni512 = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                         __builtin_cpu_supports("avx512vnni");
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
        const uint16_t *row_s = scales + j * groups;
        const Minimums row_m = channel_minimums(mins, scales, groups, j);
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
    const uint8_t *qw, const uint16_t *scales, const uint16_t *mins, int64_t n, int64_t k, int group, int lanes,
    const uint16_t *supers, float *out, int threads
) {
    const Linear w = {lanes ? LINEAR_Q4L : LINEAR_Q4, group, n, k, qw, scales, mins, NULL, supers};
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t j = 0; j < n; j++) dequant_channel(&w, j, out + j * k);
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

/* y = x Wᵀ (+ bias) over the float32 tiles (kernels.h), channel pairs split across threads; -1 when out of memory. */
static int linear_tiled(const Linear *w, const float *x, int64_t ldx, int64_t rows, float *y, int64_t ldy, int threads) {
    int failed = 0;
#pragma omp parallel num_threads(threads) reduction(| : failed)
    {
        float *buffer = malloc(sizeof(float) * (size_t)(TILE_CHANNELS * w->k));
        failed = buffer == NULL;
#pragma omp for schedule(static)
        for (int64_t p = 0; p < (w->n + TILE_CHANNELS - 1) / TILE_CHANNELS; p++)
            if (buffer) linear_channels_f32(w, p, x, ldx, rows, y, ldy, buffer);
        free(buffer);
    }
    return failed ? -1 : 0;
}

static int linear_qa(const Linear *w, const float *x, int64_t ldx, int64_t rows, float *y, int64_t ldy, int threads);

/* y = x Wᵀ (+ bias) for a weight in the rows layouts (Q4, Q8G, Q8) with each row's bits those of the row alone
 * (`KETTLE_BATCH_INVARIANT`): the rows quantized to int16, then `linear_channel_rows` channel by channel, or from
 * `kettle_row_gemm_rows` rows on gemm.c's row panels. -1 when out of memory (nothing written). */
static int linear_rows_invariant(const Linear *w, const float *x, int64_t ldx, int64_t rows, float *y, int64_t ldy,
                                 int threads) {
    QuantizedRows xq;
    if (alloc_rows(rows, w->k, &xq)) return free_rows(&xq), -1;
    const int panels = rows >= kettle_row_gemm_rows;
    const int64_t per_thread = panels ? row_panel_floats(w->k) : 0;
    float *buffers = panels ? aligned_alloc(64, sizeof(float) * (size_t)(threads * per_thread)) : NULL;
    if (panels && !buffers) return free_rows(&xq), -1;
#pragma omp parallel num_threads(threads)
    {
#pragma omp for schedule(static)
        for (int64_t r = 0; r < rows; r++) quantize_row(x + r * ldx, w->k, w->group, &xq, r);
        if (panels) {
            gemm_row_panels(w, &xq, rows, y, ldy, buffers + omp_get_thread_num() * per_thread);
        } else {
#pragma omp for schedule(static)
            for (int64_t j = 0; j < w->n; j++) linear_channel_rows(w, &xq, rows, j, y, ldy);
        }
    }
    free(buffers);
    free_rows(&xq);
    return 0;
}

/* How the several-row entries below multiply (kettle/kernels/ops.py's `path`): the float32 tiles, gemm.c's float32
 * panels or its integer panels (on CPUs with AVX-512 VNNI), or each row as alone (`linear_rows_invariant`). */
enum { ROWS_TILES = 0, ROWS_GEMM = 1, ROWS_INT_GEMM = 2, ROWS_INVARIANT = 3 };

static int linear_rows(const Linear *w, const float *x, int64_t ldx, int64_t rows, float *y, int64_t ldy, int path,
                       int threads) {
    if (path == ROWS_INVARIANT) /* lanes are that already: their tiles' rows are independent */
        return in_lanes(w) ? linear_qa(w, x, ldx, rows, y, ldy, threads) : linear_rows_invariant(w, x, ldx, rows, y, ldy, threads);
    if (path == ROWS_INT_GEMM) return quant_gemm_int(w, x, ldx, rows, y, ldy, threads);
    if (path == ROWS_GEMM) return quant_gemm(w, x, ldx, rows, y, ldy, threads);
    return linear_tiled(w, x, ldx, rows, y, ldy, threads);
}

/* `kettle_q4_linear` for several rows, by `path`. */
int kettle_q4_linear_rows(
    const float *x, int64_t ldx, int64_t rows, int64_t k, const uint8_t *qw, const uint16_t *scales,
    const uint16_t *mins, int64_t n, int group, int lanes, const uint16_t *supers, const float *bias, float *y,
    int64_t ldy, int path, int threads
) {
    const Linear w = {lanes ? LINEAR_Q4L : LINEAR_Q4, group, n, k, qw, scales, mins, bias, supers};
    return linear_rows(&w, x, ldx, rows, y, ldy, path, threads);
}

/* `kettle_q8_linear` for several rows, as `kettle_q4_linear_rows` (K a multiple of 16; of 32 for the integer
 * panels). */
int kettle_q8_linear_rows(
    const float *x, int64_t ldx, int64_t rows, int64_t k, const int8_t *qw, const float *scales, int64_t n,
    const float *bias, float *y, int64_t ldy, int path, int threads
) {
    const Linear w = {LINEAR_Q8, k, n, k, qw, scales, NULL, bias};
    return linear_rows(&w, x, ldx, rows, y, ldy, path, threads);
}

/* x [rows, K] (rows ldx floats apart) quantized for a weight with groups of `group` (with `halves`, the sums a Q6L
 * weight reads); -1 when out of memory. */
static int quantize_rows(const float *x, int64_t ldx, int64_t rows, int64_t k, int64_t group, int halves,
                         QuantizedRows *out) {
    if (alloc_rows(rows, k, out) || (halves && alloc_halves(rows, k, out))) return -1;
    for (int64_t m = 0; m < rows; m++) quantize_row(x + m * ldx, k, group, out, m);
    return 0;
}

/* y = x Wᵀ (+ bias) with x quantized to int16 per block of 32 (groups of w->group for the minimum terms): a weight in
 * lanes 16 channels at a time (`lanes_group`), else channel by channel. -1 when out of memory (nothing written). */
static int linear_qa(const Linear *w, const float *x, int64_t ldx, int64_t rows, float *y, int64_t ldy, int threads) {
    QuantizedRows xq;
    if (quantize_rows(x, ldx, rows, w->k, w->group, w->kind == LINEAR_Q6L, &xq)) return free_rows(&xq), -1;
    if (in_lanes(w)) {
#pragma omp parallel for num_threads(threads) schedule(static)
        for (int64_t g = 0; g < w->n / 16; g++) lanes_group(w, g, &xq, rows, y, ldy);
    } else {
#pragma omp parallel for num_threads(threads) schedule(static)
        for (int64_t j = 0; j < w->n; j++) linear_channel_qa(w, &xq, rows, j, y, ldy);
    }
    free_rows(&xq);
    return 0;
}

/* `kettle_q4_linear` with quantized activations, for either Q4 layout (`lanes`: Q4L, kernels.h). Returns -1 when out
 * of memory (nothing written). */
int kettle_q4_linear_qa(
    const float *x, int64_t ldx, int64_t rows, int64_t k, const uint8_t *qw, const uint16_t *scales,
    const uint16_t *mins, int64_t n, int group, int lanes, const uint16_t *supers, const float *bias, float *y,
    int64_t ldy, int threads
) {
    const Linear w = {lanes ? LINEAR_Q4L : LINEAR_Q4, group, n, k, qw, scales, mins, bias, supers};
    return linear_qa(&w, x, ldx, rows, y, ldy, threads);
}

/* `kettle_q8_linear` with quantized activations (K a multiple of 32). Returns -1 when out of memory. */
int kettle_q8_linear_qa(
    const float *x, int64_t ldx, int64_t rows, int64_t k, const int8_t *qw, const float *scales, int64_t n,
    const float *bias, float *y, int64_t ldy, int threads
) {
    const Linear w = {LINEAR_Q8, k, n, k, qw, scales, NULL, bias};
    return linear_qa(&w, x, ldx, rows, y, ldy, threads);
}

/* The Q8G (GGUF Q8_0) entry points: W = q [N, K] int8 · d [N, K/32] float16. K a multiple of 32. */

/* y[M, N] = x · Wᵀ (+ bias) by `path`: Q8G_TILES (float32 tiles, exact to W), Q8G_QUANTIZED (int16 activations),
 * Q8G_GEMM (gemm.c's float32 panels), Q8G_INT_GEMM (its integer panels, on CPUs with AVX-512 VNNI) or, in rows,
 * Q8G_INVARIANT (each row as alone: `linear_rows_invariant`). -1 when out of memory. */
enum { Q8G_TILES = 0, Q8G_QUANTIZED = 1, Q8G_GEMM = 2, Q8G_INT_GEMM = 3, Q8G_INVARIANT = 4 }; /* ops.py's `q8g_path` */
int kettle_q8g_linear(
    const float *x, int64_t ldx, int64_t rows, int64_t k, const int8_t *qw, const uint16_t *scales, int64_t n,
    int lanes, const float *bias, float *y, int64_t ldy, int path, int threads
) {
    const Linear w = {lanes ? LINEAR_Q8L : LINEAR_Q8G, 32, n, k, qw, scales, NULL, bias};
    if (path == Q8G_INVARIANT && !lanes) return linear_rows_invariant(&w, x, ldx, rows, y, ldy, threads);
    if (path == Q8G_INT_GEMM) return quant_gemm_int(&w, x, ldx, rows, y, ldy, threads);
    if (path == Q8G_GEMM) return quant_gemm(&w, x, ldx, rows, y, ldy, threads);
    if (path == Q8G_TILES) return linear_tiled(&w, x, ldx, rows, y, ldy, threads);
    return linear_qa(&w, x, ldx, rows, y, ldy, threads);
}

/* Rows `ids` [count] of W as float32 [count, K] (the embedding lookup of a tied Q8_0 table). */
void kettle_q8g_rows(
    const int8_t *qw, const uint16_t *scales, int64_t n, int64_t k, int lanes, const int64_t *ids, int64_t count,
    float *out, int threads
) {
    const Linear w = {lanes ? LINEAR_Q8L : LINEAR_Q8G, 32, n, k, qw, scales, NULL, NULL};
#pragma omp parallel for num_threads(threads) schedule(static) if (count > 8)
    for (int64_t i = 0; i < count; i++) dequant_channel(&w, ids[i], out + i * k);
}

/* The Q6L (GGUF Q6_K in lanes) entry points: qw [N/16][K/32][384] bytes, scales [N/16][K/16][16] int8, d
 * [N/16][K/256][16] float16 (kernels.h). */

/* y[M, N] = x · Wᵀ (+ bias) by `path`: rows quantized to int16 on the lanes kernel (-1), or `linear_rows`' paths
 * (the float32 tiles, exact to the dequantized weights, and gemm.c's float32 or integer panels). -1 when out of
 * memory. */
int kettle_q6_linear(
    const float *x, int64_t ldx, int64_t rows, int64_t k, const uint8_t *qw, const int8_t *scales, const uint16_t *d,
    int64_t n, const float *bias, float *y, int64_t ldy, int path, int threads
) {
    const Linear w = {LINEAR_Q6L, 32, n, k, qw, scales, NULL, bias, d};
    return path < 0 ? linear_qa(&w, x, ldx, rows, y, ldy, threads) : linear_rows(&w, x, ldx, rows, y, ldy, path, threads);
}

/* Rows `ids` [count] of W (every row when ids is NULL) as float32 [count, K]: an embedding table's lookup, or the
 * whole weight. */
void kettle_q6_rows(
    const uint8_t *qw, const int8_t *scales, const uint16_t *d, int64_t n, int64_t k, const int64_t *ids,
    int64_t count, float *out, int threads
) {
    const Linear w = {LINEAR_Q6L, 32, n, k, qw, scales, NULL, NULL, d};
#pragma omp parallel for num_threads(threads) schedule(static) if (count > 8)
    for (int64_t i = 0; i < count; i++) dequant_channel(&w, ids ? ids[i] : i, out + i * k);
}

/* Rows `ids` [count] of a Q4 weight as float32 [count, K]: the embedding lookup of a GGUF file's 4-bit table,
 * exactly what the projections multiply by (`q4_dequant_row`). */
void kettle_q4_rows(
    const uint8_t *qw, const uint16_t *scales, const uint16_t *mins, int64_t n, int64_t k, int group, int lanes,
    const uint16_t *supers, const int64_t *ids, int64_t count, float *out, int threads
) {
    const Linear w = {lanes ? LINEAR_Q4L : LINEAR_Q4, group, n, k, qw, scales, mins, NULL, supers};
#pragma omp parallel for num_threads(threads) schedule(static) if (count > 8)
    for (int64_t i = 0; i < count; i++) dequant_channel(&w, ids[i], out + i * k);
}

/* ---- element-wise kernels of a decoder layer (float32): each replaces a chain of PyTorch ops whose fixed
 * per-op cost dominates at decode sizes. Rows run in parallel only when there is enough work to pay for it. */

#define PARALLEL_ELEMENTS 65536

/* out = RMSNorm(x or residual + x) · weight per row of `dim`; with `residual`, the sum goes to `total`. */
void kettle_rms_norm(
    const float *x, const float *residual, const float *weight, int64_t rows, int64_t dim, float eps, float *out,
    float *total, int threads
) {
#pragma omp parallel for num_threads(threads) schedule(static) if (rows * dim >= PARALLEL_ELEMENTS)
    for (int64_t r = 0; r < rows; r++)
        rms_norm_row(x + r * dim, residual ? residual + r * dim : NULL, weight, dim, eps, out + r * dim,
                     residual ? total + r * dim : NULL);
}

/* out [T, I] = silu(gate) · up for gate_up [T, 2I]. */
void kettle_silu_mul(const float *gate_up, int64_t rows, int64_t inner, float *out, int threads) {
#pragma omp parallel for num_threads(threads) schedule(static) if (rows * inner >= PARALLEL_ELEMENTS)
    for (int64_t r = 0; r < rows; r++) silu_mul_row(gate_up + r * 2 * inner, inner, out + r * inner);
}

/* out [T, I] = gelu_tanh(gate) · up for gate_up [T, 2I]. */
void kettle_gelu_tanh_mul(const float *gate_up, int64_t rows, int64_t inner, float *out, int threads) {
#pragma omp parallel for num_threads(threads) schedule(static) if (rows * inner >= PARALLEL_ELEMENTS)
    for (int64_t r = 0; r < rows; r++) gelu_tanh_mul_row(gate_up + r * 2 * inner, inner, out + r * inner);
}

/* RoPE for x [T, heads, D] whose rows are `stride` floats apart (a view into the fused qkv output) into a
 * contiguous out; cos/sin [T, D], sin already signed. */
void kettle_rope(
    const float *x, int64_t stride, const float *cos, const float *sin, int64_t rows, int64_t heads, int64_t dim,
    float *out, int threads
) {
#pragma omp parallel for num_threads(threads) schedule(static) if (rows * heads * dim >= PARALLEL_ELEMENTS)
    for (int64_t t = 0; t < rows; t++) rope_row(x + t * stride, cos + t * dim, sin + t * dim, heads, dim, out + t * heads * dim);
}

/* Paged decode attention: q [S, H, D], caches [slots, Hkv, D] of `kv_dtype` (KV_F32, KV_F16, KV_BF16),
 * tables [S, max_blocks], positions [S] (of the new token), out [S, H, D]. `window` > 0 keeps only the last
 * `window` positions; `per_sequence`: long contexts cut as each sequence alone would be (PagedDecode). -1 when out
 * of memory. */
int kettle_paged_decode(
    const float *q, const void *k_cache, const void *v_cache, const int64_t *tables, int64_t max_blocks,
    const int64_t *positions, int64_t seqs, int64_t heads, int64_t kv_heads, int64_t dim, int64_t block_size,
    float scale, int64_t window, float *out, int kv_dtype, int per_sequence, int threads
) {
    const int64_t longest = longest_context(positions, seqs);
    const int64_t parts = call_parts(positions, seqs, kv_heads, threads, per_sequence);
    const int64_t scores_size = heads / kv_heads * (longest + 1);
    float *scores = malloc(sizeof(float) * (size_t)(threads * scores_size));
    float *partials = parts > 1 ? malloc(sizeof(float) * (size_t)partial_floats(seqs, heads, parts, dim)) : NULL;
    if (!scores || (parts > 1 && !partials)) return free(scores), free(partials), -1;
    const PagedDecode p = {k_cache, v_cache, tables, positions, max_blocks, heads, kv_heads, dim, block_size, window,
                           scale, 0.0f, kv_dtype, parts, partials, per_sequence, threads};
#pragma omp parallel num_threads(threads)
    paged_attention(&p, q, seqs, scores + omp_get_thread_num() * scores_size, out);
    free(scores), free(partials);
    return 0;
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
void kettle_greedy(const float *scores, int64_t rows, int64_t vocab, int64_t ld, int64_t *ids, float *logprobs,
                   int threads) {
#pragma omp parallel for num_threads(threads) schedule(static) if (rows > 1)
    for (int64_t r = 0; r < rows; r++) {
        const float *row = scores + r * ld;
        const int64_t best = first_maximum(row, vocab);
        ids[r] = best;
        logprobs[r] = (float)-log(exp_total(row, vocab, row[best]));
    }
}
