/* A whole decode step of a decoder-only model in one call: every layer's norms, projections, RoPE, KV cache
 * write, paged attention and MLP, then the final norm (the LM head stays with the caller).
 *
 * Why one call: at decode sizes a layer is ~10 small ops. Called one at a time from Python each pays the
 * interpreter, a tensor allocation, a ctypes crossing and an OpenMP fork/join (measured on the bundled
 * SmolLM2 int4: more than half of a single-stream step outside the kernels). Here one parallel region spans
 * the step and the stages are separated by the team's barriers; the activations stay in one scratch buffer.
 *
 * One description covers the families' blocks (kettle/models/decoder.py `BlockPlan`): RMSNorm or LayerNorm;
 * sequential or parallel residuals (the MLP reading the attention's normed input or a norm of its own);
 * Gemma 2's norms of each branch output; RoPE over the whole head or its first `rot_dim` dimensions, in
 * halves or interleaved pairs, or none, each layer from its own table of the step's cos/sin (Gemma 3's local and
 * global bases); per-head q/k norms; soft-capped scores; a gated or plain MLP with SiLU, tanh-GELU, erf-GELU or
 * ReLU; or a top-k mixture of gated experts. Where a stage exists op at a time (kernels.h) the step runs the same
 * code in the same order, so Llama-family models compute the same numbers on both paths.
 * kettle/models/decoder_step.py fills the description through kettle/kernels/decoder_step.py.
 */
#include <omp.h>
#include <string.h>

#include "kernels.h"

enum { NORM_NONE = 0, NORM_RMS = 1, NORM_LAYER = 2 };
enum { ACT_SILU = 0, ACT_GELU_TANH = 1, ACT_GELU = 2, ACT_RELU = 3 };
enum { MAX_EXPERTS = 64 }; /* routing state per row (kettle/models/decoder_step.py refuses more) */

typedef struct {
    int64_t kind;              /* NORM_* */
    const float *weight, *bias; /* [dim]; bias: LayerNorm's, or NULL */
    float eps;
} Norm;

typedef struct {
    int64_t num_experts, top_k;
    const float *router; /* [num_experts, hidden] float32 */
    const Linear *up;    /* [num_experts] gate_up projections ([gate; up] rows) */
    const Linear *down;  /* [num_experts] */
} Experts;

typedef struct {
    Norm input_norm;
    Norm mlp_norm;                    /* sequential: before the MLP; parallel: of the block input (NONE: shares input_norm's) */
    Norm attn_out_norm, mlp_out_norm; /* of each branch's output before its residual add (Gemma 2), or NONE */
    Norm q_norm, k_norm;              /* per head over head_dim before RoPE (Qwen3, Phi), or NONE */
    Linear qkv, o, up, down;          /* qkv rows: [q heads; k heads; v heads]; up: [gate; up] when gated, else fc */
    int64_t window, parallel, gated, act;
    int64_t rope_table; /* which of the step's cos/sin tables this layer rotates with (Decoder.rope_tables) */
    float scale, softcap;
    const Experts *experts; /* non-NULL: the MLP is this mixture (gated experts), `up`/`down` unused */
} Layer;

/* One projection's LoRA deltas for the step: the present adapters' matrices stacked (kettle/layers/lora.py
 * `_Stack`). Row r of the batch adds Σ_j mask[slot_r, j] · (A_j · x_r) · B_j[cols_j .. cols_j + widths_j). */
typedef struct {
    int64_t rank;              /* stacked rows R (0: no delta on this projection this step) */
    const float *a, *b;        /* A [R, K]; B [R, N], each row's scale folded in, zero outside its slice */
    const float *mask;         /* [adapters + 1, R]: 1 where row j belongs to the adapter of that slot */
    const int64_t *cols, *widths; /* [R]: the output columns each stacked row writes */
} Lora;

enum { LORA_QKV = 0, LORA_O = 1, LORA_UP = 2, LORA_DOWN = 3, LORA_PER_LAYER = 4 };

typedef struct {
    int64_t num_layers, hidden, heads, kv_heads, head_dim, inner, block_size;
    int64_t rot_dim, interleaved; /* RoPE over the first rot_dim of each head (0: no RoPE) */
    /* The step's cos/sin tables (0 without RoPE): one per distinct RoPE setting of the layers, every table the same
     * rot_dim and layout, only the angles differ (Gemma 3's sliding layers a local base, its full layers a global) */
    int64_t rope_tables;
    const Layer *layers;
    Norm final_norm;
    int64_t kv_dtype; /* the cache's KV_* element type (kernels.h), set per step from the cache */
    /* The chooser's switches, set per step (batch invariance among them: each row computed as a row alone is,
     * whatever the step's rows, and the paths then only pick between kernels of the same bits) */
    Tuning tuning;
} Decoder;

static inline int64_t max64(int64_t a, int64_t b) { return a > b ? a : b; }

/* The path projection `w` takes for the step's `rows` rows (linear.c, as op at a time). */
static inline int path_of(const Decoder *m, const Linear *w, int64_t rows) { return choose_path(w, rows, 0, &m->tuning); }

/* Whether `w`'s input rows are quantized (into xq) for `rows` rows (for any part of a stacked one). */
static inline int quantized_input(const Decoder *m, const Linear *w, int64_t rows) {
    for (; w; w = w->next)
        if (reads_quantized(path_of(m, w, rows))) return 1;
    return 0;
}

/* ---- rows: norms, activations, RoPE ---- */

static void layer_norm_row(const float *x, const Norm *n, int64_t dim, float *dst) {
    float mean = 0.0f, var = 0.0f;
    for (int64_t i = 0; i < dim; i++) mean += x[i];
    mean /= (float)dim;
    for (int64_t i = 0; i < dim; i++) var += (x[i] - mean) * (x[i] - mean);
    const float inv = 1.0f / sqrtf(var / (float)dim + n->eps);
    for (int64_t i = 0; i < dim; i++) dst[i] = (x[i] - mean) * inv * n->weight[i] + (n->bias ? n->bias[i] : 0.0f);
}

/* dst = norm(x) over dim (dst may be x). */
static inline void norm_row(const Norm *n, const float *x, int64_t dim, float *dst) {
    if (n->kind == NORM_RMS) rms_norm_row(x, NULL, n->weight, dim, n->eps, dst, NULL);
    else layer_norm_row(x, n, dim, dst);
}

/* erf for 8 floats (Abramowitz & Stegun 7.1.26, absolute error below 1.5e-7). */
static inline __m256 erf_ps(__m256 x) {
    const __m256 sign = _mm256_and_ps(x, _mm256_set1_ps(-0.0f)), a = _mm256_andnot_ps(_mm256_set1_ps(-0.0f), x);
    const __m256 one = _mm256_set1_ps(1.0f);
    const __m256 t = _mm256_div_ps(one, _mm256_fmadd_ps(_mm256_set1_ps(0.3275911f), a, one));
    __m256 p = _mm256_set1_ps(1.061405429f);
    p = _mm256_fmadd_ps(p, t, _mm256_set1_ps(-1.453152027f));
    p = _mm256_fmadd_ps(p, t, _mm256_set1_ps(1.421413741f));
    p = _mm256_fmadd_ps(p, t, _mm256_set1_ps(-0.284496736f));
    p = _mm256_fmadd_ps(p, t, _mm256_set1_ps(0.254829592f));
    p = _mm256_mul_ps(p, t);
    const __m256 e = exp_ps(_mm256_sub_ps(_mm256_setzero_ps(), _mm256_mul_ps(a, a)));
    return _mm256_or_ps(sign, _mm256_fnmadd_ps(p, e, one));
}

/* act(x) for 8 floats. */
static inline __m256 act_ps(int64_t act, __m256 x) {
    const __m256 one = _mm256_set1_ps(1.0f), half = _mm256_set1_ps(0.5f);
    if (act == ACT_SILU) return _mm256_div_ps(x, _mm256_add_ps(one, exp_ps(_mm256_sub_ps(_mm256_setzero_ps(), x))));
    if (act == ACT_RELU) return _mm256_max_ps(x, _mm256_setzero_ps());
    if (act == ACT_GELU) return _mm256_mul_ps(_mm256_mul_ps(half, x), _mm256_add_ps(one, erf_ps(_mm256_mul_ps(x, _mm256_set1_ps(0.70710678118654752f)))));
    const __m256 u = _mm256_mul_ps(_mm256_set1_ps(0.7978845608028654f), _mm256_fmadd_ps(_mm256_mul_ps(_mm256_set1_ps(0.044715f), x), _mm256_mul_ps(x, x), x));
    return _mm256_mul_ps(_mm256_mul_ps(half, x), _mm256_add_ps(one, tanh_ps(u)));
}

static inline float act_scalar(int64_t act, float x) {
    if (act == ACT_SILU) return x / (1.0f + expf(-x));
    if (act == ACT_RELU) return x > 0.0f ? x : 0.0f;
    if (act == ACT_GELU) return 0.5f * x * (1.0f + erff(x * 0.70710678118654752f));
    return 0.5f * x * (1.0f + tanhf(0.7978845608028654f * (x + 0.044715f * x * x * x)));
}

/* dst[n] = act(x) (· up when `up` is given). SiLU and tanh-GELU gates take kernels.h's spans, which the op-at-a-time
 * MLP runs too (over whole rows: every element is its own, so pieces of a row give the row's bits). */
static void activate_span(int64_t act, const float *x, const float *up, int64_t n, float *dst) {
    if (up && act == ACT_SILU) return silu_mul_span(x, up, n, dst);
    if (up && act == ACT_GELU_TANH) return gelu_tanh_mul_span(x, up, n, dst);
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
        __m256 v = act_ps(act, _mm256_loadu_ps(x + i));
        if (up) v = _mm256_mul_ps(v, _mm256_loadu_ps(up + i));
        _mm256_storeu_ps(dst + i, v);
    }
    for (; i < n; i++) dst[i] = act_scalar(act, x[i]) * (up ? up[i] : 1.0f);
}

/* RoPE over `heads` heads of one token, src → dst (heads `dim` floats apart): the whole head in halves layout
 * through kernels.h's row; else the first `rot` dimensions, partners i ± rot/2 (halves) or i ^ 1 (interleaved
 * pairs), the rest copied; rot 0 copies. cos/sin hold `rot` floats, sin signed. */
static void rope_heads(const Decoder *m, const float *src, const float *cos, const float *sin, int64_t heads, float *dst) {
    const int64_t dim = m->head_dim, rot = m->rot_dim, half = rot / 2;
    if (rot == dim && !m->interleaved) return rope_row(src, cos, sin, heads, dim, dst);
    for (int64_t h = 0; h < heads; h++, src += dim, dst += dim) {
        for (int64_t i = 0; i < rot; i++) {
            const int64_t partner = m->interleaved ? i ^ 1 : (i < half ? i + half : i - half);
            dst[i] = src[i] * cos[i] + src[partner] * sin[i];
        }
        if (dim > rot) memmove(dst + rot, src + rot, sizeof(float) * (size_t)(dim - rot));
    }
}

/* Pieces each row of an element-wise stage is cut into, in whole `unit`s of its n columns: one where the step has a
 * row a thread, else enough for every thread of the team. A one-row decode step ran its SiLU, its int8 rows and
 * their sums on one thread while the others waited at the barrier: on 2 threads 0.7-2.6% of a 1.7B step by the host's
 * state (bench/RESULTS.md), on many threads a larger share. Each element, block, span and group is computed as the
 * whole row computes it, so the bits do not depend on the cut. */
static inline int64_t row_pieces(int64_t rows, int64_t n, int64_t unit) {
    const int64_t team = omp_get_num_threads(), units = n / unit;
    if (rows >= team || units < 2) return 1;
    const int64_t per_row = (team + rows - 1) / rows;
    return per_row < units ? per_row : units;
}

/* Columns [*c0, *c1) of piece p of `pieces` over n (whole units; the last piece to the end). */
static inline void row_piece(int64_t n, int64_t unit, int64_t pieces, int64_t p, int64_t *c0, int64_t *c1) {
    const int64_t units = n / unit;
    *c0 = units * p / pieces * unit;
    *c1 = p == pieces - 1 ? n : units * (p + 1) / pieces * unit;
}

/* ---- the step ---- */

/* The step's activations, one allocation (rows = sequences). h: the residual stream; x: a norm's output;
 * out: the attention branch; mlp: the MLP branch; routing: each row's chosen experts and weights. */
typedef struct {
    float *h, *x, *qkv, *q, *k, *attn, *out, *gate_up, *act, *mlp, *gathered;
    int64_t *chosen;
    float *route;
    QuantizedRows xq;
    const Lora *loras;           /* [layers · LORA_PER_LAYER] for this step, or NULL: no adapter rows */
    const int64_t *lora_slot;    /* [rows]: each row's adapter slot (the last one: the base model) */
    float *lora_t;               /* [rows · widest rank]: each row's products with the A rows */
} Scratch;

/* What the step's projections need for `rows` rows: a per-thread buffer (floats), room for the int8 rows in lanes
 * (the integer panels). An expert meets any count of rows up to
 * `rows`, and each path starts from a row count on: its largest need is at `rows`, with the float32 tiles below. */
typedef struct {
    int64_t buffer;
    int lanes;
} Needs;

static void need(const Decoder *m, const Linear *w, int64_t rows, int expert, Needs *needs) {
    for (; w; w = w->next) {
        const int path = path_of(m, w, rows);
        needs->buffer = max64(needs->buffer, path_buffer_floats(w, path, rows));
        if (expert) needs->buffer = max64(needs->buffer, path_buffer_floats(w, PATH_TILES, rows));
        needs->lanes |= path == PATH_INT_GEMM;
    }
}

static Needs step_needs(const Decoder *m, int64_t rows) {
    Needs needs = {0, 0};
    for (int64_t i = 0; i < m->num_layers; i++) {
        const Layer *l = m->layers + i;
        const Linear *own[] = {&l->qkv, &l->o, &l->up, &l->down};
        for (int p = 0; p < 4; p++) if (!l->experts || p < 2) need(m, own[p], rows, 0, &needs);
        for (int64_t e = 0; l->experts && e < l->experts->num_experts; e++) {
            need(m, l->experts->up + e, rows, 1, &needs);
            need(m, l->experts->down + e, rows, 1, &needs);
        }
    }
    return needs;
}

static int alloc_scratch(const Decoder *m, int64_t rows, const Needs *needs, Scratch *s) {
    const int64_t qkv = (m->heads + 2 * m->kv_heads) * m->head_dim, heads = m->heads * m->head_dim;
    const int64_t kv = m->kv_heads * m->head_dim;
    const int64_t sizes[] = {m->hidden, m->hidden, qkv, heads, kv, heads, m->hidden, 2 * m->inner, m->inner, m->hidden, m->hidden};
    float **slots[] = {&s->h, &s->x, &s->qkv, &s->q, &s->k, &s->attn, &s->out, &s->gate_up, &s->act, &s->mlp, &s->gathered};
    s->loras = NULL, s->lora_slot = NULL, s->lora_t = NULL;
    int64_t total = MAX_EXPERTS, widest = 0; /* + each row's routing weights */
    for (int i = 0; i < 11; i++) total += sizes[i], widest = sizes[i] > widest ? sizes[i] : widest;
    float *base = malloc(sizeof(float) * (size_t)(rows * total));
    s->chosen = malloc(sizeof(int64_t) * (size_t)(rows * MAX_EXPERTS));
    if (!base || !s->chosen) return free(base), free(s->chosen), -1;
    if (alloc_rows(rows, widest, &s->xq) || (needs->lanes && alloc_lanes(rows, widest, &s->xq)))
        return free(base), free(s->chosen), free_rows(&s->xq), -1;
    for (int i = 0; i < 11; i++) *slots[i] = base, base += rows * sizes[i];
    s->route = base;
    return 0;
}

static void free_scratch(Scratch *s) {
    free(s->h); /* the base of the one allocation */
    free(s->chosen);
    free(s->lora_t);
    free_rows(&s->xq);
}

/* The step's LoRA state, with room for the widest stacked rank. -1 when out of memory. */
static int alloc_lora(const Decoder *m, const Lora *loras, const int64_t *slot, int64_t rows, Scratch *s) {
    int64_t widest = 0;
    s->loras = loras, s->lora_slot = slot, s->lora_t = NULL;
    for (int64_t i = 0; loras && i < m->num_layers * LORA_PER_LAYER; i++) widest = max64(widest, loras[i].rank);
    if (!widest) return 0;
    s->lora_t = malloc(sizeof(float) * (size_t)(rows * widest));
    return s->lora_t ? 0 : -1;
}

/* y [rows, N] += each row's LoRA delta over x [rows, K]: the products with the A rows of its own adapter (the
 * others are masked to zero and skipped), then the B rows they scale, each over its slice's columns. Split
 * across the team first by (row, A row), then by blocks of output columns. */
static void lora_delta(const Scratch *s, const Lora *l, const float *x, int64_t k, int64_t rows, float *y, int64_t n) {
    if (!l || !l->rank) return;
    const int64_t rank = l->rank;
    float *t = s->lora_t;
#pragma omp for schedule(static)
    for (int64_t i = 0; i < rows * rank; i++) {
        const int64_t r = i / rank, j = i % rank;
        const float on = l->mask[s->lora_slot[r] * rank + j];
        t[i] = on != 0.0f ? on * dot_f32(l->a + j * k, x + r * k, k) : 0.0f;
    }
#pragma omp for schedule(static)
    for (int64_t c0 = 0; c0 < n; c0 += 64) {
        const int64_t c1 = c0 + 64 < n ? c0 + 64 : n;
        for (int64_t r = 0; r < rows; r++)
            for (int64_t j = 0; j < rank; j++) {
                const float tj = t[r * rank + j];
                const int64_t lo = max64(c0, l->cols[j]), hi = l->cols[j] + l->widths[j] < c1 ? l->cols[j] + l->widths[j] : c1;
                if (tj != 0.0f && lo < hi) axpy_f32(y + r * n + lo, tj, l->b + j * n + lo, hi - lo);
            }
    }
}

/* The LoRA of projection `which` of layer `layer`, or NULL when the step has no adapter rows. */
static inline const Lora *lora_of(const Scratch *s, int64_t layer, int which) {
    return s->loras ? s->loras + layer * LORA_PER_LAYER + which : NULL;
}

/* y [rows, N] = x · Wᵀ (+ bias) on the path linear.c picks, run by the team (y complete for the next stage), with the
 * rows quantized in xq where the path reads them. `buffer`: this thread's share of the step's buffers. */
/* A projection's outputs: a stacked one's parts side by side. */
static inline int64_t outputs(const Linear *w) {
    int64_t n = 0;
    for (; w; w = w->next) n += w->n;
    return n;
}

static void linear(const Decoder *m, const Linear *w, const float *x, const QuantizedRows *xq, int64_t rows, float *y,
                   float *buffer) {
    const int64_t n = outputs(w);
    for (int64_t at = 0; w; at += w->n, w = w->next) team_linear(w, path_of(m, w, rows), x, w->k, xq, rows, y + at, n, buffer);
}

/* x = norm(h + a + b) per row, with h updated to the sum first (a, b: branch outputs or NULL; b is added to a
 * before h, as the layer-by-layer forward adds a parallel block's branches), quantized for `next`. */
static void add_norm(const Decoder *m, Scratch *s, float *a, const float *b, const Norm *norm, const Linear *next,
                     int64_t rows) {
    const int64_t dim = m->hidden;
    const int quantize = next && quantized_input(m, next, rows); /* the path, chosen once for every row */
    const int64_t span = quantize ? int8_span(next) : 32;
#pragma omp for schedule(static)
    for (int64_t r = 0; r < rows; r++) {
        float *h = s->h + r * dim, *x = s->x + r * dim, *ar = a ? a + r * dim : NULL;
        if (b) for (int64_t i = 0; i < dim; i++) ar[i] += b[r * dim + i];
        if (ar && norm->kind == NORM_RMS) rms_norm_row(ar, h, norm->weight, dim, norm->eps, x, h); /* fused add */
        else {
            if (ar) for (int64_t i = 0; i < dim; i++) h[i] += ar[i];
            if (norm->kind != NORM_NONE) norm_row(norm, h, dim, x);
        }
        if (quantize) quantize_row(x, next, span, &s->xq, r);
    }
}

/* Each branch output normed in place (Gemma 2's post-attention and post-feedforward norms). */
static void norm_branch(const Decoder *m, const Norm *norm, float *y, int64_t rows) {
    if (norm->kind == NORM_NONE) return;
#pragma omp for schedule(static)
    for (int64_t r = 0; r < rows; r++) norm_row(norm, y + r * m->hidden, m->hidden, y + r * m->hidden);
}

static void norm_heads(const Decoder *m, const Norm *norm, float *row, int64_t heads) {
    for (int64_t h = 0; h < heads; h++) norm_row(norm, row + h * m->head_dim, m->head_dim, row + h * m->head_dim);
}

/* The q/k norms when the layer has them, then RoPE on q (into s->q) and k, k and v written to their cache slot
 * (rounded to nearest-even in a 16-bit cache). */
static void rope_and_store(const Decoder *m, const Layer *l, Scratch *s, const float *cos, const float *sin,
                           const int64_t *slots, void *k_cache, void *v_cache, int64_t rows) {
    const int dtype = (int)m->kv_dtype;
    const int64_t size = kv_size(dtype);
    const int64_t dim = m->head_dim, kv = m->kv_heads * dim;
#pragma omp for schedule(static)
    for (int64_t r = 0; r < rows; r++) {
        float *row = s->qkv + r * (m->heads * dim + 2 * kv);
        const float *c = cos ? cos + r * m->rot_dim : NULL, *sn = sin ? sin + r * m->rot_dim : NULL;
        if (l->q_norm.kind) norm_heads(m, &l->q_norm, row, m->heads), norm_heads(m, &l->k_norm, row + m->heads * dim, m->kv_heads);
        rope_heads(m, row, c, sn, m->heads, s->q + r * m->heads * dim);
        if (dtype == KV_F32) { /* rotated straight into the slot */
            rope_heads(m, row + m->heads * dim, c, sn, m->kv_heads, (float *)k_cache + slots[r] * kv);
        } else {
            rope_heads(m, row + m->heads * dim, c, sn, m->kv_heads, s->k + r * kv);
            store_kv_row((char *)k_cache + slots[r] * kv * size, s->k + r * kv, kv, dtype);
        }
        store_kv_row((char *)v_cache + slots[r] * kv * size, row + m->heads * dim + kv, kv, dtype);
    }
}

/* Rows of `x` [rows, dim] quantized for the projection `next` (when it takes quantized rows), a few rows in pieces
 * (`row_pieces`). */
static void quantize_for(const Decoder *m, const float *x, int64_t dim, const Linear *next, QuantizedRows *xq,
                         int64_t rows) {
    if (!quantized_input(m, next, rows)) return;
    const int64_t span = int8_span(next), unit = 32 * quantized_piece_blocks(next, span);
    const int64_t pieces = row_pieces(rows, dim, unit);
#pragma omp for schedule(static)
    for (int64_t i = 0; i < rows * pieces; i++) {
        int64_t c0, c1;
        row_piece(dim, unit, pieces, i % pieces, &c0, &c1);
        quantize_blocks(x + i / pieces * dim, next, span, xq, i / pieces, c0 / 32, c1 / 32);
    }
}

/* act(fc(x)) or act(gate) · up for each row, quantized for the down projection when it takes quantized rows; a few
 * rows in pieces (`row_pieces`). */
static void activate(const Decoder *m, const Layer *l, Scratch *s, const Linear *next, int64_t rows) {
    const int64_t inner = m->inner, width = l->gated ? 2 * inner : inner;
    const int quantize = quantized_input(m, next, rows);
    const int64_t span = quantize ? int8_span(next) : 32, unit = quantize ? 32 * quantized_piece_blocks(next, span) : 64;
    const int64_t pieces = row_pieces(rows, inner, unit);
#pragma omp for schedule(static)
    for (int64_t i = 0; i < rows * pieces; i++) {
        const int64_t r = i / pieces;
        int64_t c0, c1;
        row_piece(inner, unit, pieces, i % pieces, &c0, &c1);
        const float *in = s->gate_up + r * width;
        activate_span(l->act, in + c0, l->gated ? in + inner + c0 : NULL, c1 - c0, s->act + r * inner + c0);
        if (quantize) quantize_blocks(s->act + r * inner, next, span, &s->xq, r, c0 / 32, c1 / 32);
    }
}

/* The MLP over x → s->mlp: up (gate_up or fc), the activation, down; with the layer's LoRA deltas when given. */
static void dense_mlp(const Decoder *m, const Layer *l, const Linear *up, const Linear *down, Scratch *s,
                      const float *x, int64_t rows, float *y, float *buffer, const Lora *lora_up, const Lora *lora_down) {
    quantize_for(m, x, m->hidden, up, &s->xq, rows);
    linear(m, up, x, &s->xq, rows, s->gate_up, buffer);
    lora_delta(s, lora_up, x, m->hidden, rows, s->gate_up, outputs(up));
    activate(m, l, s, down, rows);
    linear(m, down, s->act, &s->xq, rows, y, buffer);
    lora_delta(s, lora_down, s->act, m->inner, rows, y, outputs(down));
}

/* Each row's top-k experts and their weights (softmax over the router's logits, renormalised over the k). */
static void route(const Decoder *m, const Experts *e, Scratch *s, const float *x, int64_t rows) {
#pragma omp for schedule(static)
    for (int64_t r = 0; r < rows; r++) {
        float logits[MAX_EXPERTS], top = -INFINITY, total = 0.0f;
        for (int64_t i = 0; i < e->num_experts; i++) {
            logits[i] = dot_f32(x + r * m->hidden, e->router + i * m->hidden, m->hidden);
            top = fmaxf(top, logits[i]);
        }
        for (int64_t i = 0; i < e->num_experts; i++) logits[i] = expf(logits[i] - top);
        int64_t *chosen = s->chosen + r * e->top_k;
        float *weights = s->route + r * e->top_k;
        for (int64_t c = 0; c < e->top_k; c++) { /* the largest remaining, lowest index first on ties */
            int64_t best = -1;
            for (int64_t i = 0; i < e->num_experts; i++) {
                int taken = 0;
                for (int64_t d = 0; d < c; d++) taken |= chosen[d] == i;
                if (!taken && (best < 0 || logits[i] > logits[best])) best = i;
            }
            chosen[c] = best, weights[c] = logits[best], total += logits[best];
        }
        for (int64_t c = 0; c < e->top_k; c++) weights[c] /= total;
    }
}

/* The mixture over x → s->mlp: for each expert some row chose, its gated MLP over those rows (gathered), each
 * output weighted and added to its row. Rows are few at decode, so an expert's rows are found by a scan. */
static void moe_mlp(const Decoder *m, const Layer *l, Scratch *s, const float *x, int64_t rows, float *buffer) {
    const Experts *e = l->experts;
    const int64_t dim = m->hidden;
    route(m, e, s, x, rows);
#pragma omp for schedule(static)
    for (int64_t i = 0; i < rows * dim; i++) s->mlp[i] = 0.0f;
    for (int64_t ex = 0; ex < e->num_experts; ex++) {
        int64_t mine[rows], count = 0; /* rows that chose `ex` (every thread computes the same list) */
        float weight[rows];
        for (int64_t r = 0; r < rows; r++)
            for (int64_t c = 0; c < e->top_k; c++)
                if (s->chosen[r * e->top_k + c] == ex) mine[count] = r, weight[count++] = s->route[r * e->top_k + c];
        if (!count) continue;
#pragma omp for schedule(static)
        for (int64_t i = 0; i < count; i++) memcpy(s->gathered + i * dim, x + mine[i] * dim, sizeof(float) * (size_t)dim);
        dense_mlp(m, l, e->up + ex, e->down + ex, s, s->gathered, count, s->out, buffer, NULL, NULL);
#pragma omp for schedule(static)
        for (int64_t i = 0; i < count; i++) axpy_f32(s->mlp + mine[i] * dim, weight[i], s->out + i * dim, dim);
    }
}

/* One layer (number `index`), run by every thread of the team: h (the residual stream) in, h out. */
static void layer_step(const Decoder *m, int64_t index, Scratch *s, void *k_cache, void *v_cache,
                       const PagedDecode *shape, const float *cos, const float *sin, const int64_t *slots,
                       float *scores, float *buffer, int64_t rows) {
    const Layer *l = m->layers + index;
    const int64_t heads = m->heads * m->head_dim;
    /* The layer's own table: cos/sin hold every table's rows, one table after another. */
    const int64_t table = l->rope_table * rows * m->rot_dim;
    PagedDecode p = *shape;
    p.k_cache = k_cache, p.v_cache = v_cache, p.window = l->window, p.scale = l->scale, p.softcap = l->softcap;
    p.kv_dtype = (int)m->kv_dtype;
    add_norm(m, s, NULL, NULL, &l->input_norm, &l->qkv, rows);
    linear(m, &l->qkv, s->x, &s->xq, rows, s->qkv, buffer);
    lora_delta(s, lora_of(s, index, LORA_QKV), s->x, m->hidden, rows, s->qkv, outputs(&l->qkv));
    rope_and_store(m, l, s, cos ? cos + table : NULL, sin ? sin + table : NULL, slots, k_cache, v_cache, rows);
    paged_attention(&p, s->q, rows, scores, s->attn);
    quantize_for(m, s->attn, heads, &l->o, &s->xq, rows);
    linear(m, &l->o, s->attn, &s->xq, rows, s->out, buffer);
    lora_delta(s, lora_of(s, index, LORA_O), s->attn, heads, rows, s->out, outputs(&l->o));
    if (l->parallel) {
        if (l->mlp_norm.kind) add_norm(m, s, NULL, NULL, &l->mlp_norm, NULL, rows); /* x = mlp_norm(h) */
    } else {
        norm_branch(m, &l->attn_out_norm, s->out, rows);
        add_norm(m, s, s->out, NULL, &l->mlp_norm, NULL, rows); /* h += out; x = mlp_norm(h) */
    }
    /* The MLP: the mixture writes s->mlp through s->out (as its scratch), so it follows the attention's add. */
    if (l->experts) {
        if (l->parallel) return; /* not described: decoder_step.py refuses parallel mixtures */
        moe_mlp(m, l, s, s->x, rows, buffer);
    } else {
        dense_mlp(m, l, &l->up, &l->down, s, s->x, rows, s->mlp, buffer, lora_of(s, index, LORA_UP),
                  lora_of(s, index, LORA_DOWN));
    }
    norm_branch(m, &l->mlp_out_norm, s->mlp, rows);
    if (l->parallel) add_norm(m, s, s->out, s->mlp, &(Norm){NORM_NONE, NULL, NULL, 0.0f}, NULL, rows);
    else add_norm(m, s, s->mlp, NULL, &(Norm){NORM_NONE, NULL, NULL, 0.0f}, NULL, rows);
}

/* embedded [rows, hidden] (one new token per sequence) → out [rows, hidden], the final norm's output; writes each
 * layer's new K/V into k_caches[l] / v_caches[l] at `slots`. cos/sin [rope_tables, rows, rot_dim] (sin signed; NULL
 * without RoPE; layer l reads table layers[l].rope_table), tables [rows, max_blocks], positions [rows] as for
 * `kettle_attention`'s decode; loras [layers · 4] and lora_slot [rows] when the step has adapter rows (else NULL).
 * -1 when out of memory. */
int kettle_decoder_step(
    const Decoder *m, void *const *k_caches, void *const *v_caches, const float *embedded, int64_t rows,
    const float *cos, const float *sin, const int64_t *slots, const int64_t *tables, int64_t max_blocks,
    const int64_t *positions, float *out, int threads, const Lora *loras, const int64_t *lora_slot
) {
    /* Per thread: attention scores, then the projections' buffer (a float32 tile's weight rows, a panel). */
    const Needs needs = step_needs(m, rows);
    const int64_t longest = longest_context(positions, rows);
    const int64_t parts = call_parts(positions, rows, threads, (int)m->tuning.invariant);
    const int64_t scores_size = (m->heads * (longest + 1) + 15) / 16 * 16;
    const int64_t per_thread = scores_size + needs.buffer; /* 64-byte aligned buffers for the panels */
    float *scores = aligned_alloc(64, sizeof(float) * (size_t)(threads * per_thread));
    float *partials = parts > 1 ? malloc(sizeof(float) * (size_t)partial_floats(rows, m->heads, parts, m->head_dim)) : NULL;
    Scratch s;
    if (!scores || (parts > 1 && !partials) || alloc_scratch(m, rows, &needs, &s)) return free(scores), free(partials), -1;
    if (alloc_lora(m, loras, lora_slot, rows, &s)) return free_scratch(&s), free(scores), free(partials), -1;
    memcpy(s.h, embedded, sizeof(float) * (size_t)(rows * m->hidden));
    const PagedDecode shape = {NULL, NULL, tables, positions, max_blocks, m->heads, m->kv_heads, m->head_dim,
                               m->block_size, 0, 0.0f, 0.0f, KV_F32, parts, partials, (int)m->tuning.invariant, threads};
#pragma omp parallel num_threads(threads)
    {
        float *own = scores + omp_get_thread_num() * per_thread, *buffer = own + scores_size;
        for (int64_t i = 0; i < m->num_layers; i++)
            layer_step(m, i, &s, k_caches[i], v_caches[i], &shape, cos, sin, slots, own, buffer, rows);
    }
    for (int64_t r = 0; r < rows; r++) norm_row(&m->final_norm, s.h + r * m->hidden, m->hidden, out + r * m->hidden);
    free_scratch(&s);
    free(scores), free(partials);
    return 0;
}

/* Row `token` of the embedding table (any weight type: float32, GGUF's quantized tables, int8 with a scale per row)
 * as float32. */
static void embed_row(const Linear *table, int64_t token, float *dst) {
    dequant_channel(table, token, dst);
    if (type_of(table)->channel_scale) {
        const float scale = ((const float *)table->scales)[token];
        for (int64_t i = 0; i < table->k; i++) dst[i] *= scale;
    }
}

/* `steps` greedy decode steps of `rows` sequences in one call, for batches whose tokens need nothing of the host
 * between steps (kettle/shard/greedy_window.py says which). Each step embeds the rows' last tokens (`tokens`,
 * updated in place) from `embedding`, runs `kettle_decoder_step`, the `head` (`kettle_linear` on the chooser's path)
 * and the greedy choice (`kettle_rows`): the functions, and so the numbers, of as many one-step calls. cos/sin are
 * [steps, rope_tables, rows, rot_dim] (a step's tables side by side, as one step takes them); step s reads slots and
 * positions [rows] at row s·rows of each; ids/logprobs [steps, rows] receive the choices. The window ends early
 * after a step in which some row chose one of `stop_ids` (its EOS ids): the host then stops that row before the
 * next. Returns the steps run, or -1 when out of memory. */
int kettle_greedy_steps(
    const Decoder *m, void *const *k_caches, void *const *v_caches, const Linear *embedding, const Linear *head,
    int64_t *tokens, int64_t rows, int64_t steps, const float *cos, const float *sin,
    const int64_t *slots, const int64_t *tables, int64_t max_blocks, const int64_t *positions,
    const int64_t *stop_ids, int64_t stops, int64_t *ids, float *logprobs, int threads
) {
    const int64_t dim = m->hidden, rope = m->rope_tables * rows * m->rot_dim; /* a step's cos (or sin) floats */
    float *embedded = malloc(sizeof(float) * (size_t)(rows * dim)), *hidden = malloc(sizeof(float) * (size_t)(rows * dim));
    float *logits = malloc(sizeof(float) * (size_t)(rows * head->n));
    int64_t done = 0, stopped = 0;
    while (embedded && hidden && logits && done < steps && !stopped) {
        const int64_t at = done * rows, angles = done * rope;
        for (int64_t r = 0; r < rows; r++) embed_row(embedding, tokens[r], embedded + r * dim);
        if (kettle_decoder_step(m, k_caches, v_caches, embedded, rows, cos ? cos + angles : NULL,
                                sin ? sin + angles : NULL, slots + at, tables, max_blocks, positions + at, hidden,
                                threads, NULL, NULL) ||
            kettle_linear(head, hidden, dim, rows, logits, head->n, PATH_DECODE_ROWS, &m->tuning, threads))
            break;
        greedy_rows(logits, rows, head->n, head->n, ids + at, logprobs + at, threads);
        for (int64_t r = 0; r < rows; r++) {
            tokens[r] = ids[at + r];
            for (int64_t e = 0; e < stops; e++) stopped |= tokens[r] == stop_ids[e];
        }
        done++;
    }
    const int failed = !embedded || !hidden || !logits || (done < steps && !stopped);
    free(embedded), free(hidden), free(logits);
    return failed ? -1 : (int)done;
}
