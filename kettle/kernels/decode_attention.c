/* Paged decode attention's work item, for both callers (`kettle_attention` below, decoder_step.c's fused step,
 * through kernels.h `paged_attention`): one sequence's KV head over its whole context or one piece of it, the query
 * heads of its group together, with the head size and the cache's dtype as compile-time constants; and the one
 * attention entry, decode or prefill (prefill_attention.c).
 */
#include <omp.h>

#include "kernels.h"

#ifndef KV_AHEAD
#define KV_AHEAD 8
#endif
/* Fetches the K or V row of this item's head at position t + KV_AHEAD into the cache, if that is still before `len`:
 * in the next block once t + KV_AHEAD passes this one's end (KV_AHEAD ≤ the block size). A head's rows lie one whole
 * cache row apart ([slots, Hkv, D]: 4 KiB for 32 heads of 64), a stride the hardware's prefetchers left to demand
 * misses: the passes read K/V at 6-12 GB/s, each row a miss to the last level cache or memory. */
static inline __attribute__((always_inline)) void fetch_ahead(const void *cache, const int64_t *table, int64_t b,
                                                              int64_t t, int64_t len, int64_t bs, int64_t stride,
                                                              int64_t column, const int64_t dim, const int dtype) {
    const int64_t ahead = t + KV_AHEAD;
    if (ahead >= len) return;
    const int64_t block = ahead < (b + 1) * bs ? b : b + 1;
    const int64_t bytes = dtype == KV_F32 ? 4 : 2;
    const char *row = (const char *)cache + ((table[block] * bs + ahead - block * bs) * stride + column) * bytes;
    for (int64_t line = 0; line < dim * bytes; line += 64) _mm_prefetch(row + line, _MM_HINT_T0);
}

/* Item (sequence s, KV head h): q [S, H, D] → out [S, H, D] for the `group` query heads of h. The context is
 * walked block by block (one table lookup per block, no division per position); `dim` is a compile-time
 * constant where the caller dispatches on the common head sizes, so the dot products unroll and each 64-wide
 * slice of an output head accumulates in registers over the whole context. `dtype` (the cache's) is a
 * compile-time constant too: 16-bit K/V rows are widened in registers as they are loaded. */
static inline __attribute__((always_inline)) void attend_dim(
    const PagedDecode *p, const float *q, int64_t s, int64_t h, int64_t part, float *scores, float *out,
    const int64_t dim, const int dtype
) {
    const int64_t group = p->heads / p->kv_heads, bs = p->block_size, parts = p->parts, mine = sequence_parts(p, s);
    int64_t len = p->positions[s] + 1, first = p->window > 0 && len > p->window ? len - p->window : 0;
    if (part >= mine) return; /* this sequence is cut into fewer pieces than the call's most */
    /* Cut: this item attends piece `part` of [first, len) and leaves, per query head, its unnormalized output,
     * maximum and sum in a record of the partials, (sequence, head, part) → dim + 2 floats. */
    float *record = NULL;
    const int64_t record_stride = parts * (dim + 2); /* from one query head's record to the next head's */
    if (mine > 1) {
        const int64_t piece = (len - first + mine - 1) / mine, lo = first + part * piece;
        record = p->partials + ((s * p->heads + h * group) * parts + part) * (dim + 2);
        first = lo < len ? lo : len, len = lo + piece < len ? lo + piece : len;
        if (first == len) { /* nothing left for this piece: it weighs nothing in the sum */
            for (int64_t g = 0; g < group; g++) {
                record[g * record_stride + dim] = -INFINITY;
                record[g * record_stride + dim + 1] = 0.0f;
            }
            return;
        }
    }
    const int64_t span = len - first;
    const int64_t stride = p->kv_heads * dim; /* elements from one slot to the next */
    const int64_t *table = p->tables + s * p->max_blocks;
    const float *qs = q + (s * p->heads + h * group) * dim;
    const void *k_cache = p->k_cache, *v_cache = p->v_cache;
    for (int64_t b = first / bs; b * bs < len; b++) {
        const int64_t t0 = b * bs > first ? b * bs : first, t1 = (b + 1) * bs < len ? (b + 1) * bs : len;
        const int64_t keys = table[b] * bs * stride + h * dim; /* position b·bs + i at keys + i·stride */
        for (int64_t t = t0; t < t1; t++) {
            fetch_ahead(k_cache, table, b, t, len, bs, stride, h * dim, dim, dtype);
            for (int64_t g = 0; g < group; g++)
                scores[g * span + t - first] =
                    dot_kv(qs + g * dim, k_cache, keys + (t - b * bs) * stride, dim, dtype) * p->scale;
        }
    }
    if (p->softcap > 0.0f) softcap_rows(scores, group * span, p->softcap);
    softmax_rows(scores, group, span, record ? record + dim : NULL, record ? record + dim + 1 : NULL, record_stride);
    for (int64_t g = 0; g < group; g++) {
        const float *weights = scores + g * span - first;
        float *dst = record ? record + g * record_stride : out + (s * p->heads + h * group + g) * dim;
        for (int64_t d0 = 0; d0 < dim; d0 += 64) {
            const int64_t width = dim - d0 < 64 ? dim - d0 : 64;
            if (width < 64) { /* a head size that is not a multiple of 64: the remainder row by row */
                for (int64_t d = 0; d < width; d++) dst[d0 + d] = 0.0f;
                for (int64_t t = first; t < len; t++) {
                    const int64_t slot = table[t / bs] * bs + t % bs;
                    axpy_kv(dst + d0, weights[t], v_cache, (slot * p->kv_heads + h) * dim + d0, width, dtype);
                }
                continue;
            }
            __m256 acc[8];
            for (int i = 0; i < 8; i++) acc[i] = _mm256_setzero_ps();
            for (int64_t b = first / bs; b * bs < len; b++) {
                const int64_t t0 = b * bs > first ? b * bs : first, t1 = (b + 1) * bs < len ? (b + 1) * bs : len;
                const int64_t values = table[b] * bs * stride + h * dim + d0;
                for (int64_t t = t0; t < t1; t++) {
                    if (d0 == 0) fetch_ahead(v_cache, table, b, t, len, bs, stride, h * dim, dim, dtype);
                    const __m256 w = _mm256_set1_ps(weights[t]);
                    const int64_t row = values + (t - b * bs) * stride;
                    for (int i = 0; i < 8; i++) acc[i] = _mm256_fmadd_ps(w, load8_kv(v_cache, row + 8 * i, dtype), acc[i]);
                }
            }
            for (int i = 0; i < 8; i++) _mm256_storeu_ps(dst + d0 + 8 * i, acc[i]);
        }
    }
}

/* `attend_dim` for the call's head size and cache type: one dispatch per item, constants inside. */
#define ATTEND_TYPED(dim_)                                                                                    \
    switch (p->kv_dtype) {                                                                                    \
    case KV_F16: attend_dim(p, q, s, h, part, scores, out, dim_, KV_F16); break;                             \
    case KV_BF16: attend_dim(p, q, s, h, part, scores, out, dim_, KV_BF16); break;                           \
    default: attend_dim(p, q, s, h, part, scores, out, dim_, KV_F32);                                        \
    }

/* kernels.h `attend_item`: the head size and cache type dispatched once per item. */
void attend_item(const PagedDecode *p, const float *q, int64_t item, float *scores, float *out) {
    const int64_t parts = p->parts, part = item % parts, s = item / parts / p->kv_heads;
    const int64_t h = item / parts % p->kv_heads;
    if (p->dim == 64) ATTEND_TYPED(64)
    else if (p->dim == 128) ATTEND_TYPED(128)
    else ATTEND_TYPED(p->dim)
}
#undef ATTEND_TYPED

/* Paged decode attention: q [S, H, D], caches [slots, Hkv, D] of `kv_dtype` (KV_F32, KV_F16, KV_BF16),
 * tables [S, max_blocks], positions [S] (of the new token), out [S, H, D]. `window` > 0 keeps only the last
 * `window` positions; `per_sequence`: long contexts cut as each sequence alone would be (PagedDecode). -1 when out
 * of memory. */
static int paged_decode(
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

/* One attention call, decode or prefill (kernels.h `Attention`); -1 when out of memory. */
int kettle_attention(const Attention *a, int threads) {
    if (a->prefill)
        return paged_prefill(a->q, a->ldq, a->k_cache, a->v_cache, a->tables, a->rows, a->cache_len, a->heads,
                             a->kv_heads, a->dim, a->block_size, a->scale, a->window, a->out, (int)a->kv_dtype, threads);
    return paged_decode(a->q, a->k_cache, a->v_cache, a->tables, a->max_blocks, a->positions, a->rows, a->heads,
                        a->kv_heads, a->dim, a->block_size, a->scale, a->window, a->out, (int)a->kv_dtype,
                        (int)a->per_sequence, threads);
}
