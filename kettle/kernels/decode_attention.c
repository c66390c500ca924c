/* Paged decode attention's work item, for both callers (`kettle_attention` below, decoder_step.c's fused step,
 * through kernels.h `paged_attention`): one sequence's whole context or one piece of it, every head, with the head
 * size and the cache's dtype as compile-time constants; and the one attention entry, decode or prefill
 * (prefill_attention.c).
 */
#include <omp.h>

#include "kernels.h"

/* Share `share` of `shares` of the cache lines of the block of slots `block` (bs rows of `stride` elements, one
 * contiguous range) fetched into L2: each pass walks a block KV head by KV head, a column at a time, and fetches
 * the next block meanwhile, a share per head, so that the lines arrive in address order, which the memory serves
 * fastest, and before the pass reaches them. Into L2, not L1 (`_MM_HINT_T1`): a block of SmolLM2-1.7B's is 64 KiB,
 * twice L1, and fetched into L1 it evicted the lines the pass was reading (19 → 28-30 GB/s from memory on 2 threads,
 * 1,024 tokens of 24 layers). */
static inline __attribute__((always_inline)) void fetch_block(const void *cache, int64_t block, int64_t bs,
                                                              int64_t stride, const int dtype, int64_t share,
                                                              int64_t shares) {
    const int64_t bytes = bs * stride * (dtype == KV_F32 ? 4 : 2), lines = bytes / 64, per = (lines + shares - 1) / shares;
    const char *start = (const char *)cache + block * bytes;
    for (int64_t line = share * per; line < (share + 1) * per && line < lines; line++)
        _mm_prefetch(start + line * 64, _MM_HINT_T1);
}

/* Block b's positions [t0, t1) within a piece [first, len), and where their rows start: position t's row at
 * base + t · stride elements (the block's slots are table[b] · bs ..). */
typedef struct {
    int64_t t0, t1, base;
} BlockSpan;

static inline BlockSpan block_span(const int64_t *table, int64_t b, int64_t bs, int64_t stride, int64_t first,
                                   int64_t len) {
    return (BlockSpan){b * bs > first ? b * bs : first, (b + 1) * bs < len ? (b + 1) * bs : len,
                       (table[b] - b) * bs * stride};
}

/* hsum(a[t]) for t = 0 .. 7 as one vector, bit for bit: each sum ((v0 + v4) + (v2 + v6)) + ((v1 + v5) + (v3 + v7)) in
 * hsum's order, the eight reduced together (transposing as they go) where eight reductions took 48 shuffles and adds. */
static inline __attribute__((always_inline)) __m256 hsum8(const __m256 a[8]) {
    __m256 halves[4], pairs[2];
    for (int i = 0; i < 4; i++) /* [a_2i lo + hi | a_2i+1 lo + hi] */
        halves[i] = _mm256_add_ps(_mm256_permute2f128_ps(a[2 * i], a[2 * i + 1], 0x20),
                                  _mm256_permute2f128_ps(a[2 * i], a[2 * i + 1], 0x31));
    for (int i = 0; i < 2; i++) /* per lane [s0 + s2, s1 + s3] of two rows */
        pairs[i] = _mm256_add_ps(_mm256_shuffle_ps(halves[2 * i], halves[2 * i + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                                 _mm256_shuffle_ps(halves[2 * i], halves[2 * i + 1], _MM_SHUFFLE(3, 2, 3, 2)));
    const __m256 sums = _mm256_add_ps(_mm256_shuffle_ps(pairs[0], pairs[1], _MM_SHUFFLE(2, 0, 2, 0)),
                                      _mm256_shuffle_ps(pairs[0], pairs[1], _MM_SHUFFLE(3, 1, 3, 1)));
    return _mm256_permutevar8x32_ps(sums, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)); /* [t0 t2 t4 t6 | t1 t3 ..] */
}

/* Scores of `g` query heads (rows of qs, dim apart; g ≤ 4, a constant) against the 8 keys at rows column + t · stride,
 * t = 0 .. 7, into scores[j · span + t]: each key widened once for the g heads (a GQA group's), each score `dot_kv`'s
 * arithmetic (two chains of fmas over 16 dims at a time, added, then hsum's order), the 8 reduced together. */
static inline __attribute__((always_inline)) void score_tile(const float *qs, const void *cache, int64_t column,
                                                             int64_t stride, float *scores, int64_t span, float scale,
                                                             const int g, const int64_t dim, const int dtype) {
    __m256 sums[4][8];
    for (int t = 0; t < 8; t++) {
        __m256 acc[4][2];
        for (int j = 0; j < g; j++) acc[j][0] = acc[j][1] = _mm256_setzero_ps();
        for (int64_t i = 0; i < dim; i += 16) {
            const __m256 k0 = load8_kv(cache, column + t * stride + i, dtype);
            const __m256 k1 = load8_kv(cache, column + t * stride + i + 8, dtype);
            for (int j = 0; j < g; j++) {
                acc[j][0] = _mm256_fmadd_ps(_mm256_loadu_ps(qs + j * dim + i), k0, acc[j][0]);
                acc[j][1] = _mm256_fmadd_ps(_mm256_loadu_ps(qs + j * dim + i + 8), k1, acc[j][1]);
            }
        }
        for (int j = 0; j < g; j++) sums[j][t] = _mm256_add_ps(acc[j][0], acc[j][1]);
    }
    for (int j = 0; j < g; j++) _mm256_storeu_ps(scores + j * span, _mm256_mul_ps(hsum8(sums[j]), _mm256_set1_ps(scale)));
}

/* Query heads h .. h + g − 1 (one KV head's, g ≤ 4) scored against positions [t0, t1) of one block: 8 at a time
 * (`score_tile`, a head size of whole 16s), the rest one by one. */
static inline __attribute__((always_inline)) void score_heads(const PagedDecode *p, const float *qs, int64_t column,
                                                              int64_t t0, int64_t t1, float *scores, int64_t span,
                                                              const int g, const int64_t dim, const int dtype) {
    const int64_t stride = p->kv_heads * dim;
    int64_t t = t0;
    if (dim % 16 == 0)
        for (; t + 8 <= t1; t += 8)
            score_tile(qs, p->k_cache, column + t * stride, stride, scores + t, span, p->scale, g, dim, dtype);
    for (; t < t1; t++)
        for (int j = 0; j < g; j++)
            scores[j * span + t] = dot_kv(qs + j * dim, p->k_cache, column + t * stride, dim, dtype) * p->scale;
}

/* `call` with G a constant, the query heads left of one KV head's (`left`) capped at 4: the tiles below unrolled for
 * 1 to 4 heads, one dispatch per KV head and block. */
#define WITH_HEADS(left, call)                                                                                \
    switch (left) {                                                                                           \
    case 1: { const int G = 1; call; } break;                                                                 \
    case 2: { const int G = 2; call; } break;                                                                 \
    case 3: { const int G = 3; call; } break;                                                                 \
    default: { const int G = 4; call; }                                                                       \
    }

/* The K pass of `attend_rows`: scores [H, len - first] of every query head against positions [first, len), block
 * by block, each block KV head by KV head (its query heads up to 4 at a time: a key widened once for them), the next
 * block (after the last, the V pass's first) fetched meanwhile. */
static inline __attribute__((always_inline)) void score_keys(const PagedDecode *p, const int64_t *table,
                                                             const float *qs, int64_t first, int64_t len,
                                                             float *scores, const int64_t dim, const int dtype) {
    const int64_t kv_heads = p->kv_heads, group = p->heads / kv_heads, bs = p->block_size, stride = kv_heads * dim;
    const int64_t span = len - first, last = (len - 1) / bs;
    fetch_block(p->k_cache, table[first / bs], bs, stride, dtype, 0, 1);
    for (int64_t b = first / bs; b <= last; b++) {
        const BlockSpan at = block_span(table, b, bs, stride, first, len);
        for (int64_t kv = 0; kv < kv_heads; kv++) {
            if (b < last) fetch_block(p->k_cache, table[b + 1], bs, stride, dtype, kv, kv_heads);
            else fetch_block(p->v_cache, table[first / bs], bs, stride, dtype, kv, kv_heads);
            const int64_t column = at.base + kv * dim;
            for (int64_t h = kv * group; h < (kv + 1) * group; h += 4) {
                float *row = scores + h * span - first; /* row[t]: head h, position t */
                WITH_HEADS((kv + 1) * group - h,
                           score_heads(p, qs + h * dim, column, at.t0, at.t1, row, span, G, dim, dtype))
            }
        }
    }
}

/* dst rows of query heads h .. h + g − 1 (one KV head's, g ≤ 4) += Σ_t weights · V[t] over positions [t0, t1) of one
 * block: `width` of their elements at a time (g · width / 8 ≤ 8 sums in registers), each value row widened once for
 * the g heads; each element one fma chain over t ascending. */
static inline __attribute__((always_inline)) void weigh_heads(const PagedDecode *p, const float *weights,
                                                              int64_t span, int64_t column, int64_t t0, int64_t t1,
                                                              float *dst, int64_t dst_stride, const int g,
                                                              const int64_t dim, const int dtype) {
    const int64_t stride = p->kv_heads * dim, width = g == 1 ? 64 : g == 2 ? 32 : 16, n = width / 8;
    for (int64_t d0 = 0; d0 < dim; d0 += width) {
        if (dim - d0 < width) { /* a head size that is not a multiple of `width`: the remainder row by row */
            for (int j = 0; j < g; j++)
                for (int64_t t = t0; t < t1; t++)
                    axpy_kv(dst + j * dst_stride + d0, weights[j * span + t], p->v_cache, column + t * stride + d0,
                            dim - d0, dtype);
            continue;
        }
        __m256 acc[4][8];
        for (int j = 0; j < g; j++)
            for (int i = 0; i < n; i++) acc[j][i] = _mm256_loadu_ps(dst + j * dst_stride + d0 + 8 * i);
        for (int64_t t = t0; t < t1; t++) {
            __m256 v[8];
            for (int i = 0; i < n; i++) v[i] = load8_kv(p->v_cache, column + t * stride + d0 + 8 * i, dtype);
            for (int j = 0; j < g; j++) {
                const __m256 w = _mm256_set1_ps(weights[j * span + t]);
                for (int i = 0; i < n; i++) acc[j][i] = _mm256_fmadd_ps(w, v[i], acc[j][i]);
            }
        }
        for (int j = 0; j < g; j++)
            for (int i = 0; i < n; i++) _mm256_storeu_ps(dst + j * dst_stride + d0 + 8 * i, acc[j][i]);
    }
}

/* The V pass of `attend_rows`: dst[h · dst_stride ..] += Σ_t weights[h][t] · V[t] for every query head, in the same
 * walk as `score_keys`; within a block the sums stay in registers, carried across blocks through dst, so each element
 * is one fma chain over t ascending (out = fma(w_t, v_t, out)) as one position at a time would be. */
static inline __attribute__((always_inline)) void weigh_values(const PagedDecode *p, const int64_t *table,
                                                               int64_t first, int64_t len, const float *scores,
                                                               float *dst, int64_t dst_stride, const int64_t dim,
                                                               const int dtype) {
    const int64_t kv_heads = p->kv_heads, group = p->heads / kv_heads, bs = p->block_size, stride = kv_heads * dim;
    const int64_t span = len - first, last = (len - 1) / bs;
    for (int64_t b = first / bs; b <= last; b++) {
        const BlockSpan at = block_span(table, b, bs, stride, first, len);
        for (int64_t kv = 0; kv < kv_heads; kv++) {
            if (b < last) fetch_block(p->v_cache, table[b + 1], bs, stride, dtype, kv, kv_heads);
            const int64_t column = at.base + kv * dim;
            for (int64_t h = kv * group; h < (kv + 1) * group; h += 4) {
                const float *weights = scores + h * span - first; /* weights[t]: head h, position t */
                WITH_HEADS((kv + 1) * group - h, weigh_heads(p, weights, span, column, at.t0, at.t1,
                                                             dst + h * dst_stride, dst_stride, G, dim, dtype))
            }
        }
    }
}

#undef WITH_HEADS

/* Item (sequence s, piece `part` of its context): q [S, H, D] → out [S, H, D] for every query head, or their records
 * of the piece when the context is cut. A slot's row holds every KV head ([slots, Hkv, D]), so a head's rows lie a
 * whole row apart (4 KiB for SmolLM2-1.7B's 32 heads of 64): an item per KV head (as this was) read 128 bytes of each,
 * a stride the prefetchers do not follow, at 8 GB/s a thread from memory against 25 for contiguous rows. Here each
 * pass walks the piece block by block (a block's rows are one contiguous range), each block KV head by KV head, and
 * fetches the next block meanwhile in address order (`fetch_block`): 1,024 tokens of 24 layers read at 28-30 GB/s
 * against 12.5 on 2 threads (Llama-3.1-8B's 8 heads of 128: 14-18 against 9.6). Each query head's arithmetic is the
 * per-head item's, in the same order: its scores by `dot_kv`'s arithmetic (8 at a time, `score_tile`), the softmax,
 * then out = fma(w_t, v_t, out) from zero over t ascending, carried across blocks through `out` (in registers within
 * a block). `dim` and `dtype` (the cache's) are compile-time constants where the caller dispatches on them. */
static inline __attribute__((always_inline)) void attend_rows(const PagedDecode *p, const float *q, int64_t s,
                                                              int64_t part, float *scores, float *out,
                                                              const int64_t dim, const int dtype) {
    const int64_t heads = p->heads, parts = p->parts, mine = sequence_parts(p, s);
    int64_t len = p->positions[s] + 1, first = p->window > 0 && len > p->window ? len - p->window : 0;
    if (part >= mine) return; /* this sequence is cut into fewer pieces than the call's most */
    /* Cut: this item attends piece `part` of [first, len) and leaves, per query head, its unnormalized output,
     * maximum and sum in a record of the partials, (sequence, head, part) → dim + 2 floats. */
    float *record = NULL;
    const int64_t record_stride = parts * (dim + 2); /* from one query head's record to the next head's */
    if (mine > 1) {
        const int64_t piece = (len - first + mine - 1) / mine, lo = first + part * piece;
        record = p->partials + (s * heads * parts + part) * (dim + 2);
        first = lo < len ? lo : len, len = lo + piece < len ? lo + piece : len;
        if (first == len) { /* nothing left for this piece: it weighs nothing in the sum */
            for (int64_t h = 0; h < heads; h++) {
                record[h * record_stride + dim] = -INFINITY;
                record[h * record_stride + dim + 1] = 0.0f;
            }
            return;
        }
    }
    const int64_t span = len - first;
    score_keys(p, p->tables + s * p->max_blocks, q + s * heads * dim, first, len, scores, dim, dtype);
    if (p->softcap > 0.0f) softcap_rows(scores, heads * span, p->softcap);
    softmax_rows(scores, heads, span, record ? record + dim : NULL, record ? record + dim + 1 : NULL, record_stride);
    float *dst = record ? record : out + s * heads * dim;
    const int64_t dst_stride = record ? record_stride : dim; /* from one query head's output to the next's */
    for (int64_t h = 0; h < heads; h++) memset(dst + h * dst_stride, 0, sizeof(float) * (size_t)dim);
    weigh_values(p, p->tables + s * p->max_blocks, first, len, scores, dst, dst_stride, dim, dtype);
}

/* `attend_rows` for the call's head size and cache type: one dispatch per item, constants inside. */
#define ATTEND_TYPED(dim_)                                                                                    \
    switch (p->kv_dtype) {                                                                                    \
    case KV_F16: attend_rows(p, q, s, part, scores, out, dim_, KV_F16); break;                               \
    case KV_BF16: attend_rows(p, q, s, part, scores, out, dim_, KV_BF16); break;                             \
    default: attend_rows(p, q, s, part, scores, out, dim_, KV_F32);                                          \
    }

/* kernels.h `attend_item`: the head size and cache type dispatched once per item. */
void attend_item(const PagedDecode *p, const float *q, int64_t item, float *scores, float *out) {
    const int64_t part = item % p->parts, s = item / p->parts;
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
    const int64_t parts = call_parts(positions, seqs, threads, per_sequence);
    const int64_t scores_size = heads * (longest + 1);
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
