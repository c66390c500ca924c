/* Flash-style prefill attention over the paged KV cache (float32 math, AVX2 + FMA), for one sequence's prompt chunk.
 *
 * The chunk's K/V are already in their cache slots (with any cached prefix before them), so the keys are read in
 * place through the block table: no gathered copy of the context, no [L, context] mask, no score matrix. A work
 * item is (KV head, tile of QUERY_TILE tokens or more): the group's query heads of those tokens, scored together so
 * each K/V row is loaded once for all of them. The item walks its keys KEY_TILE at a time (each tile inside one cache
 * block) with an online softmax: running maximum and sum per query row, the output rescaled by how much the
 * maximum grew. The queries are transposed once per item, so a key's scores for 8 query rows are one vector
 * (each key element broadcast from the cache row, no transposed copy of the keys) and the mask and softmax run 8
 * rows a vector; the value rows are read straight from the cache. Later tiles see more keys (causal), so items
 * are handed out longest first. A 16-bit cache (KV_F16, KV_BF16) has each key tile's K and V rows widened into a
 * float32 scratch once per item and tile: every row of the item then reads them as it reads a float32 cache.
 *
 * With AVX-512 the same walk runs 16 rows a vector in 32 registers: 8 keys × 48 rows of scores and 6 rows × 64
 * dimensions of output per register block, so each vector loaded feeds 6 to 8 FMAs where the 16 AVX2 registers
 * allow 1.5 (3 keys × 3 row vectors of scores, 6 rows × 16 dimensions of output). On a CPU that executes 512-bit
 * FMAs as two 256-bit halves (AMD Zen 4) the FMA rate is the same, so the gain is the loads and instructions saved
 * (1.4x on the kernel there, see docs/performance.md).
 */
#include "kernels.h"

#define QUERY_TILE 16 /* tokens per work item, at least */
#define ITEM_ROWS 64  /* query rows an item takes where its group is small: tokens × query heads per KV head */
/* ... and from LONG_KEYS keys on (cached and new): each item widens every key tile it sees, once, and those reads,
 * one head's 16 rows a whole cache row apart, stall once a layer's K/V outgrows L2 (a quarter of the attention's
 * time at 2,048 tokens of SmolLM2-1.7B's shape); twice the rows an item halve them, and cost an item's diagonal
 * tiles, whose masked half is wasted work, which only a short prompt notices. One layer of that shape, a bfloat16
 * cache, 2 threads, Zen 4, medians of alternated runs: 512 tokens 9.0 → 10.2-11.0 ms (not taken), 1,024 tokens
 * 39.2-42.4 → 38.6-39.4, 2,048 168-179 → 140-148, 4,096 600-664 → 543-557 (bench/RESULTS.md). */
#define LONG_ITEM_ROWS 128
#define LONG_KEYS 1024
#define KEY_TILE 16   /* keys per step (a cache block holds whole tiles) */

/* One prefill attention call: q rows `ldq` floats apart ([tokens, heads, dim] inside a wider row is fine). */
typedef struct {
    const float *q;
    const void *k_cache, *v_cache; /* [slots, kv_heads, dim] of kv_dtype */
    const int64_t *table;          /* the sequence's blocks */
    int64_t ldq, tokens, cache_len, heads, kv_heads, dim, block_size, window; /* window > 0: the last `window` */
    float scale;
    int kv_dtype; /* KV_F32, KV_F16 or KV_BF16 (kernels.h) */
} PagedPrefill;

#define MASKED -1e30f /* a masked score: finite, so a row that has seen no key yet never computes inf - inf */
#define A512 AVX512_TARGET("avx512f")

/* The vector width: -1 picks AVX-512 where the CPU has it; the tests set 0 or 1 to run each. */
int kettle_attention_avx512 = -1;

/* Per-thread state of one item. Its rows (group × its tokens, padded to a multiple of 8; row r = token r / group,
 * head r % group) lie along the vectors: the queries transposed once per item ([D][rows]), the scores of a key tile
 * as [KEY_TILE][rows], so the scores, the mask and the online softmax are vector operations over 8 rows. */
typedef struct {
    float *q, *out, *scores;   /* [D, rows] (scaled), [rows, D], [KEY_TILE, rows] */
    float *max, *sum, *alpha, *position; /* [rows] each: running maximum and sum, this tile's rescale, position */
    float *keys, *values;      /* [KEY_TILE, D] each: a 16-bit cache's key tile, widened */
} Scratch;

/* Scores of keys j0 .. j0 + keys_n - 1 against row vectors v0 .. v0 + count - 1 (both ≤ 3): each dimension's query
 * vectors loaded once into registers for every key, 9 accumulators. With 2 keys × 6 row vectors GCC read the queries
 * as memory operands of each FMA (12 accumulators left no room for them): 14 loads per 12 FMAs, and a 2,048-token
 * prefill's attention ran load-bound. */
static inline __attribute__((always_inline)) void score_keys(const Scratch *s, const float *keys, int64_t stride,
                                                             int j0, int keys_n, int64_t v0, int count, int64_t rows,
                                                             int64_t dim) {
    __m256 acc[3][3];
    for (int j = 0; j < keys_n; j++)
        for (int v = 0; v < count; v++) acc[j][v] = _mm256_setzero_ps();
    for (int64_t d = 0; d < dim; d++) {
        const float *qd = s->q + d * rows + v0 * 8;
        __m256 q[3];
        for (int v = 0; v < count; v++) q[v] = _mm256_loadu_ps(qd + 8 * v);
        for (int j = 0; j < keys_n; j++) {
            const __m256 k = _mm256_broadcast_ss(keys + (j0 + j) * stride + d);
            for (int v = 0; v < count; v++) acc[j][v] = _mm256_fmadd_ps(k, q[v], acc[j][v]);
        }
    }
    for (int j = 0; j < keys_n; j++)
        for (int v = 0; v < count; v++) _mm256_storeu_ps(s->scores + (j0 + j) * rows + (v0 + v) * 8, acc[j][v]);
}

static void score_tile(const Scratch *s, const float *keys, int64_t stride, int valid, int64_t rows, int64_t dim) {
    for (int64_t v0 = 0; v0 < rows / 8; v0 += 3) {
        const int64_t count = rows / 8 - v0 < 3 ? rows / 8 - v0 : 3;
        for (int j = 0; j < valid; j += 3) {
            const int keys_n = valid - j < 3 ? valid - j : 3;
#define KEYS(n, c) score_keys(s, keys, stride, j, n, v0, c, rows, dim)
#define COUNTS(n) \
    switch (count) { case 3: KEYS(n, 3); break; case 2: KEYS(n, 2); break; default: KEYS(n, 1); }
            switch (keys_n) { case 3: COUNTS(3) break; case 2: COUNTS(2) break; default: COUNTS(1) }
#undef COUNTS
#undef KEYS
        }
    }
}

/* The online softmax over keys key0 .. key0 + valid - 1, 8 rows a vector: masked scores (a key after the row's
 * position or before its window) weigh 0; each row's rescale factor goes to `alpha`. `seen_all` (a constant): every
 * row sees every key of the tile (`sees_whole_tile`), so nothing is masked: the same weights without the masks'
 * compares and blends, which most of a long prompt's tiles need not (an item of 64 tokens: all but the 4 or 5 tiles
 * its diagonal crosses). */
static inline __attribute__((always_inline)) void online_softmax(const Scratch *s, int64_t key0, int valid, int64_t rows,
                                                               int64_t window, const int seen_all) {
    for (int64_t v = 0; v < rows / 8; v++) {
        const __m256 position = _mm256_loadu_ps(s->position + 8 * v);
        const __m256 oldest = _mm256_sub_ps(position, _mm256_set1_ps(window > 0 ? (float)window : 1e30f));
        __m256 top = _mm256_loadu_ps(s->max + 8 * v);
        for (int j = 0; j < valid; j++) {
            float *row = s->scores + j * rows + 8 * v;
            if (seen_all) {
                top = _mm256_max_ps(top, _mm256_loadu_ps(row));
                continue;
            }
            const __m256 key = _mm256_set1_ps((float)(key0 + j));
            const __m256 seen = _mm256_and_ps(_mm256_cmp_ps(key, position, _CMP_LE_OQ), _mm256_cmp_ps(key, oldest, _CMP_GT_OQ));
            const __m256 score = _mm256_blendv_ps(_mm256_set1_ps(MASKED), _mm256_loadu_ps(row), seen);
            _mm256_storeu_ps(row, score);
            top = _mm256_max_ps(top, score);
        }
        const __m256 previous = _mm256_loadu_ps(s->max + 8 * v);
        const __m256 alpha = exp_ps(_mm256_sub_ps(previous, top));
        __m256 sum = _mm256_mul_ps(_mm256_loadu_ps(s->sum + 8 * v), alpha);
        for (int j = 0; j < valid; j++) {
            float *row = s->scores + j * rows + 8 * v;
            const __m256 score = _mm256_loadu_ps(row);
            __m256 weight = exp_ps(_mm256_sub_ps(score, top));
            if (!seen_all) weight = _mm256_and_ps(weight, _mm256_cmp_ps(score, _mm256_set1_ps(MASKED), _CMP_GT_OQ));
            _mm256_storeu_ps(row, weight);
            sum = _mm256_add_ps(sum, weight);
        }
        _mm256_storeu_ps(s->max + 8 * v, top);
        _mm256_storeu_ps(s->sum + 8 * v, sum);
        _mm256_storeu_ps(s->alpha + 8 * v, alpha);
    }
}

static void softmax_tile(const Scratch *s, int64_t key0, int valid, int64_t rows, int64_t window, int seen_all) {
    if (seen_all) online_softmax(s, key0, valid, rows, window, 1);
    else online_softmax(s, key0, valid, rows, window, 0);
}

/* out[r] = alpha[r] · out[r] + Σ_j weight[j, r] · V[j] for rows r0 .. r0 + count - 1 (count ≤ 6), V rows read in
 * place (`stride` apart), `width` (1 or 2) vectors of dimensions at a time: each key's value vectors loaded once
 * into registers for every row, 12 accumulators (at 2 rows × 32 dimensions GCC read each value vector once per row,
 * as memory operands). */
static inline __attribute__((always_inline)) void accumulate_rows(const Scratch *s, int64_t r0, const int count,
                                                                  const int width, const float *values, int64_t stride,
                                                                  int valid, int64_t rows, int64_t dim) {
    for (int64_t d0 = 0; d0 < dim; d0 += 8 * width) {
        __m256 acc[6][2];
        for (int r = 0; r < count; r++) {
            const __m256 a = _mm256_set1_ps(s->alpha[r0 + r]);
            for (int i = 0; i < width; i++) acc[r][i] = _mm256_mul_ps(a, _mm256_loadu_ps(s->out + (r0 + r) * dim + d0 + 8 * i));
        }
        for (int j = 0; j < valid; j++) {
            __m256 v[2];
            for (int i = 0; i < width; i++) v[i] = _mm256_loadu_ps(values + j * stride + d0 + 8 * i);
            for (int r = 0; r < count; r++) {
                const __m256 w = _mm256_broadcast_ss(s->scores + j * rows + r0 + r);
                for (int i = 0; i < width; i++) acc[r][i] = _mm256_fmadd_ps(w, v[i], acc[r][i]);
            }
        }
        for (int r = 0; r < count; r++)
            for (int i = 0; i < width; i++) _mm256_storeu_ps(s->out + (r0 + r) * dim + d0 + 8 * i, acc[r][i]);
    }
}

/* Every used row's output over the tile's values, 6 rows a pass (dim a multiple of 8: 8 dimensions a step where it
 * is not one of 16). */
static inline __attribute__((always_inline)) void accumulate_tile(const Scratch *s, int64_t used, const float *values,
                                                                  int64_t stride, int valid, int64_t rows, int64_t dim) {
    const int two_vectors = dim % 16 == 0;
    for (int64_t r0 = 0; r0 < used; r0 += 6) {
#define ROWS(c)                                                                                                        \
    if (two_vectors) accumulate_rows(s, r0, c, 2, values, stride, valid, rows, dim);                                   \
    else accumulate_rows(s, r0, c, 1, values, stride, valid, rows, dim)
        switch (used - r0 < 6 ? used - r0 : 6) {
        case 6: ROWS(6); break;
        case 5: ROWS(5); break;
        case 4: ROWS(4); break;
        case 3: ROWS(3); break;
        case 2: ROWS(2); break;
        default: ROWS(1);
        }
#undef ROWS
    }
}

/* ---- the same tile steps 16 rows a vector (AVX-512F); rows padded to a multiple of 16 ---- */

/* e^x for 16 floats: exp_ps's polynomial (kernels.h). */
static inline A512 __m512 exp512(__m512 x) {
    x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.3f)), _mm512_set1_ps(88.3f));
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)), _MM_FROUND_TO_NEAREST_INT);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
    __m512 q = _mm512_set1_ps(1.9875691500e-4f);
    q = _mm512_fmadd_ps(q, r, _mm512_set1_ps(1.3981999507e-3f));
    q = _mm512_fmadd_ps(q, r, _mm512_set1_ps(8.3334519073e-3f));
    q = _mm512_fmadd_ps(q, r, _mm512_set1_ps(4.1665795894e-2f));
    q = _mm512_fmadd_ps(q, r, _mm512_set1_ps(1.6666665459e-1f));
    q = _mm512_fmadd_ps(q, r, _mm512_set1_ps(5.0000001201e-1f));
    q = _mm512_fmadd_ps(q, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
    const __m512i bits = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
    return _mm512_mul_ps(q, _mm512_castsi512_ps(bits));
}

/* Scores of keys j0 .. j0 + 7 against row vectors v0 .. v0 + count - 1 (count ≤ 3): 24 accumulators. Keys past
 * the tile's valid ones are scored too (they lie in the same cache block, or in the widened scratch) and never
 * read: the softmax only looks at valid keys. */
static inline __attribute__((always_inline)) A512 void score_keys16(const Scratch *s, const float *keys, int64_t stride,
                                                                    int j0, int64_t v0, int count, int64_t rows, int64_t dim) {
    __m512 acc[8][3];
    for (int j = 0; j < 8; j++)
        for (int v = 0; v < count; v++) acc[j][v] = _mm512_setzero_ps();
    for (int64_t d = 0; d < dim; d++) {
        const float *qd = s->q + d * rows + v0 * 16;
        __m512 q[3];
        for (int v = 0; v < count; v++) q[v] = _mm512_loadu_ps(qd + 16 * v);
        for (int j = 0; j < 8; j++) {
            const __m512 k = _mm512_set1_ps(keys[(j0 + j) * stride + d]);
            for (int v = 0; v < count; v++) acc[j][v] = _mm512_fmadd_ps(k, q[v], acc[j][v]);
        }
    }
    for (int j = 0; j < 8; j++)
        for (int v = 0; v < count; v++) _mm512_storeu_ps(s->scores + (j0 + j) * rows + (v0 + v) * 16, acc[j][v]);
}

static A512 void score_tile16(const Scratch *s, const float *keys, int64_t stride, int64_t rows, int64_t dim) {
    for (int64_t v0 = 0; v0 < rows / 16; v0 += 3) {
        const int64_t count = rows / 16 - v0 < 3 ? rows / 16 - v0 : 3;
        for (int j0 = 0; j0 < KEY_TILE; j0 += 8) {
            if (count == 3) score_keys16(s, keys, stride, j0, v0, 3, rows, dim);
            else if (count == 2) score_keys16(s, keys, stride, j0, v0, 2, rows, dim);
            else score_keys16(s, keys, stride, j0, v0, 1, rows, dim);
        }
    }
}

/* softmax_tile, 16 rows a vector. */
static A512 void softmax_tile16(const Scratch *s, int64_t key0, int valid, int64_t rows, int64_t window) {
    for (int64_t v = 0; v < rows / 16; v++) {
        const __m512 position = _mm512_loadu_ps(s->position + 16 * v);
        const __m512 oldest = _mm512_sub_ps(position, _mm512_set1_ps(window > 0 ? (float)window : 1e30f));
        const __m512 previous = _mm512_loadu_ps(s->max + 16 * v);
        __m512 top = previous;
        for (int j = 0; j < valid; j++) {
            const __m512 key = _mm512_set1_ps((float)(key0 + j));
            const __mmask16 seen = _mm512_cmp_ps_mask(key, position, _CMP_LE_OQ) & _mm512_cmp_ps_mask(key, oldest, _CMP_GT_OQ);
            float *row = s->scores + j * rows + 16 * v;
            const __m512 score = _mm512_mask_blend_ps(seen, _mm512_set1_ps(MASKED), _mm512_loadu_ps(row));
            _mm512_storeu_ps(row, score);
            top = _mm512_max_ps(top, score);
        }
        const __m512 alpha = exp512(_mm512_sub_ps(previous, top));
        __m512 sum = _mm512_mul_ps(_mm512_loadu_ps(s->sum + 16 * v), alpha);
        for (int j = 0; j < valid; j++) {
            float *row = s->scores + j * rows + 16 * v;
            const __m512 score = _mm512_loadu_ps(row);
            const __mmask16 seen = _mm512_cmp_ps_mask(score, _mm512_set1_ps(MASKED), _CMP_GT_OQ);
            const __m512 weight = _mm512_maskz_mov_ps(seen, exp512(_mm512_sub_ps(score, top)));
            _mm512_storeu_ps(row, weight);
            sum = _mm512_add_ps(sum, weight);
        }
        _mm512_storeu_ps(s->max + 16 * v, top);
        _mm512_storeu_ps(s->sum + 16 * v, sum);
        _mm512_storeu_ps(s->alpha + 16 * v, alpha);
    }
}

/* accumulate_rows for rows r0 .. r0 + count - 1 (count ≤ 6) and `width` (≤ 4) vectors of dimensions from d0:
 * 24 accumulators, each value vector loaded feeding `count` rows. */
static inline __attribute__((always_inline)) A512 void accumulate_block16(const Scratch *s, int64_t r0, int count, int64_t d0,
                                                                          int width, const float *values, int64_t stride,
                                                                          int valid, int64_t rows, int64_t dim) {
    __m512 acc[6][4];
    for (int r = 0; r < count; r++) {
        const __m512 a = _mm512_set1_ps(s->alpha[r0 + r]);
        for (int i = 0; i < width; i++) acc[r][i] = _mm512_mul_ps(a, _mm512_loadu_ps(s->out + (r0 + r) * dim + d0 + 16 * i));
    }
    for (int j = 0; j < valid; j++) {
        __m512 v[4];
        for (int i = 0; i < width; i++) v[i] = _mm512_loadu_ps(values + j * stride + d0 + 16 * i);
        for (int r = 0; r < count; r++) {
            const __m512 w = _mm512_set1_ps(s->scores[j * rows + r0 + r]);
            for (int i = 0; i < width; i++) acc[r][i] = _mm512_fmadd_ps(w, v[i], acc[r][i]);
        }
    }
    for (int r = 0; r < count; r++)
        for (int i = 0; i < width; i++) _mm512_storeu_ps(s->out + (r0 + r) * dim + d0 + 16 * i, acc[r][i]);
}

/* Every used row's output over the tile's values (dim a multiple of 16). */
static A512 void accumulate_tile16(const Scratch *s, int64_t used, const float *values, int64_t stride, int valid,
                                   int64_t rows, int64_t dim) {
    for (int64_t r0 = 0; r0 < used; r0 += 6) {
        const int count = used - r0 < 6 ? (int)(used - r0) : 6;
        for (int64_t d0 = 0; d0 < dim; d0 += 64) {
            const int width = dim - d0 < 64 ? (int)(dim - d0) / 16 : 4;
#define BLOCK(c, w) accumulate_block16(s, r0, c, d0, w, values, stride, valid, rows, dim)
#define WIDTHS(c) \
    switch (width) { case 4: BLOCK(c, 4); break; case 3: BLOCK(c, 3); break; case 2: BLOCK(c, 2); break; default: BLOCK(c, 1); }
            switch (count) {
            case 6: WIDTHS(6) break;
            case 5: WIDTHS(5) break;
            case 4: WIDTHS(4) break;
            case 3: WIDTHS(3) break;
            case 2: WIDTHS(2) break;
            default: WIDTHS(1)
            }
#undef WIDTHS
#undef BLOCK
        }
    }
}

/* `valid` rows of `dim` elements, `stride` apart from element `off` of a 16-bit K/V array, as floats [valid, dim]. */
static inline __attribute__((always_inline)) void widen_rows(float *dst, const void *src, int64_t off, int64_t stride,
                                                             int valid, int64_t dim, int dtype) {
    for (int j = 0; j < valid; j++)
        for (int64_t d = 0; d < dim; d += 8) _mm256_storeu_ps(dst + j * dim + d, load8_kv(src, off + j * stride + d, dtype));
}

static void widen_tile(const PagedPrefill *p, int64_t off, int64_t stride, int valid, Scratch *s) {
    if (p->kv_dtype == KV_F16) {
        widen_rows(s->keys, p->k_cache, off, stride, valid, p->dim, KV_F16);
        widen_rows(s->values, p->v_cache, off, stride, valid, p->dim, KV_F16);
    } else {
        widen_rows(s->keys, p->k_cache, off, stride, valid, p->dim, KV_BF16);
        widen_rows(s->values, p->v_cache, off, stride, valid, p->dim, KV_BF16);
    }
}

/* Whether every one of an item's `rows` (tokens t0 .. t0 + count - 1, `used` of them real) sees keys key0 ..
 * key0 + valid - 1: no padding row (those see nothing), the last key at or before the first token's position, and
 * the first inside the last token's window. */
static int sees_whole_tile(const PagedPrefill *p, int64_t t0, int64_t count, int64_t used, int64_t rows, int64_t key0,
                           int valid) {
    const int64_t first = p->cache_len + t0, last = first + count - 1;
    return used == rows && key0 + valid - 1 <= first && (p->window <= 0 || key0 > last - p->window);
}

/* Item (KV head h, tokens t0 .. t0 + count - 1) into out [tokens, heads, dim]. */
static inline __attribute__((always_inline)) void attend_tile(const PagedPrefill *p, int64_t h, int64_t t0, int64_t count,
                                                              Scratch *s, float *out, const int64_t dim, int wide) {
    const int64_t group = p->heads / p->kv_heads, used = group * count, bs = p->block_size;
    const int64_t rows = wide ? (used + 15) / 16 * 16 : (used + 7) / 8 * 8;
    const int64_t stride = p->kv_heads * dim, keys = p->cache_len + t0 + count; /* keys this tile can see */
    const int64_t first = p->window > 0 && p->cache_len + t0 - p->window + 1 > 0 ? p->cache_len + t0 - p->window + 1 : 0;
    for (int64_t r = 0; r < rows; r++) {
        const float *src = p->q + (t0 + r / group) * p->ldq + (h * group + r % group) * dim;
        for (int64_t d = 0; d < dim; d++) s->q[d * rows + r] = r < used ? src[d] * p->scale : 0.0f;
        for (int64_t d = 0; d < dim; d++) s->out[r * dim + d] = 0.0f;
        s->max[r] = MASKED, s->sum[r] = 0.0f;
        s->position[r] = r < used ? (float)(p->cache_len + t0 + r / group) : -1.0f; /* padding sees nothing */
    }
    for (int64_t key0 = first / KEY_TILE * KEY_TILE; key0 < keys; key0 += KEY_TILE) {
        const int valid = keys - key0 < KEY_TILE ? (int)(keys - key0) : KEY_TILE;
        const int64_t slot0 = p->table[key0 / bs] * bs + key0 % bs, off = slot0 * stride + h * dim;
        const float *keys_f = (const float *)p->k_cache + off, *values = (const float *)p->v_cache + off;
        int64_t row_stride = stride;
        if (p->kv_dtype != KV_F32) { /* one branch per tile; the float32 cache is read in place as before */
            widen_tile(p, off, stride, valid, s);
            keys_f = s->keys, values = s->values, row_stride = dim;
        }
        if (wide) {
            score_tile16(s, keys_f, row_stride, rows, dim);
            softmax_tile16(s, key0, valid, rows, p->window);
            accumulate_tile16(s, used, values, row_stride, valid, rows, dim);
            continue;
        }
        score_tile(s, keys_f, row_stride, valid, rows, dim);
        softmax_tile(s, key0, valid, rows, p->window, sees_whole_tile(p, t0, count, used, rows, key0, valid));
        accumulate_tile(s, used, values, row_stride, valid, rows, dim);
    }
    for (int64_t r = 0; r < used; r++) {
        float *dst = out + ((t0 + r / group) * p->heads + h * group + r % group) * dim;
        const float inv = 1.0f / s->sum[r];
        for (int64_t d = 0; d < dim; d++) dst[d] = s->out[r * dim + d] * inv;
    }
}

static void prefill_item(const PagedPrefill *p, int64_t h, int64_t t0, int64_t count, Scratch *s, float *out, int wide) {
    if (wide) attend_tile(p, h, t0, count, s, out, p->dim, 1);
    else if (p->dim == 64) attend_tile(p, h, t0, count, s, out, 64, 0);
    else if (p->dim == 128) attend_tile(p, h, t0, count, s, out, 128, 0);
    else attend_tile(p, h, t0, count, s, out, p->dim, 0);
}

/* AVX-512 when the CPU has it (or the tests ask) and the head size is whole vectors of 16. */
static int wide_attention(int64_t dim) {
    const int avx512 = kettle_attention_avx512 < 0 ? CPU_HAS_AVX512("avx512f") : kettle_attention_avx512;
    return avx512 && dim % 16 == 0;
}

/* Room for one item's state (rows padded to a multiple of 16); NULL members when out of memory. */
static Scratch alloc_scratch(int64_t rows, int64_t dim) {
    rows = (rows + 15) / 16 * 16;
    Scratch s = {malloc(sizeof(float) * (size_t)(rows * dim)), malloc(sizeof(float) * (size_t)(rows * dim)),
                 malloc(sizeof(float) * (size_t)(rows * KEY_TILE)), malloc(sizeof(float) * (size_t)rows),
                 malloc(sizeof(float) * (size_t)rows), malloc(sizeof(float) * (size_t)rows),
                 malloc(sizeof(float) * (size_t)rows), malloc(sizeof(float) * (size_t)(KEY_TILE * dim)),
                 malloc(sizeof(float) * (size_t)(KEY_TILE * dim))};
    return s;
}

static void free_scratch(Scratch *s) {
    free(s->q), free(s->out), free(s->scores), free(s->max), free(s->sum), free(s->alpha), free(s->position);
    free(s->keys), free(s->values);
}

/* Causal attention of one sequence's `tokens` new queries (positions cache_len ..) over its paged context:
 * q rows ldq floats apart, each [heads, dim]; caches of `kv_dtype`; out [tokens, heads, dim]. dim a multiple
 * of 8, block_size of KEY_TILE. -1 when out of memory. */
int paged_prefill(
    const float *q, int64_t ldq, const void *k_cache, const void *v_cache, const int64_t *table, int64_t tokens,
    int64_t cache_len, int64_t heads, int64_t kv_heads, int64_t dim, int64_t block_size, float scale, int64_t window,
    float *out, int kv_dtype, int threads
) {
    const PagedPrefill p = {q,         k_cache,   v_cache, table,      ldq,    tokens, cache_len,
                            heads,     kv_heads,  dim,     block_size, window, scale,  kv_dtype};
    /* Tokens per item: QUERY_TILE, or more where a KV head has few query heads, so that each key tile (widened from
     * a 16-bit cache, scored, weighed) feeds ~64 query rows (~128 over long contexts): SmolLM2-1.7B's 16 rows an
     * item (32 heads of their own) spent 9% of a 2,048-token prefill widening the same key tiles again for each
     * item. A row's arithmetic does not depend on the rows beside it, so its output is the same bits either way. */
    const int64_t group = heads / kv_heads, item_rows = cache_len + tokens >= LONG_KEYS ? LONG_ITEM_ROWS : ITEM_ROWS;
    const int64_t per_item = group < item_rows / QUERY_TILE ? item_rows / group / QUERY_TILE : 1;
    const int64_t tile = per_item * QUERY_TILE, tiles = (tokens + tile - 1) / tile, rows = group * tile;
    const int wide = wide_attention(dim);
    int failed = 0;
#pragma omp parallel num_threads(threads) reduction(| : failed)
    {
        Scratch s = alloc_scratch(rows, dim);
        failed = !(s.q && s.out && s.scores && s.max && s.sum && s.alpha && s.position && s.keys && s.values);
#pragma omp for schedule(dynamic, 1)
        for (int64_t item = 0; item < tiles * kv_heads; item++) {
            const int64_t t0 = (tiles - 1 - item / kv_heads) * tile; /* the longest items first */
            if (!failed) prefill_item(&p, item % kv_heads, t0, tokens - t0 < tile ? tokens - t0 : tile, &s, out, wide);
        }
        free_scratch(&s);
    }
    return failed ? -1 : 0;
}
