/* A whole decode step of a Llama-family model in one call: every layer's norms, quantized projections, RoPE,
 * KV cache write and paged attention, then the final norm (the LM head stays with the caller).
 *
 * Why one call: at decode sizes a layer is ~10 small ops. Called one at a time from Python each pays the
 * interpreter, a tensor allocation, a ctypes crossing and an OpenMP fork/join (measured on the bundled
 * SmolLM2 int4: more than half of a single-stream step outside the kernels). Here one parallel region spans
 * the step and the stages are separated by the team's barriers; the activations stay in one scratch buffer.
 * The stages are exactly the op-at-a-time kernels' (kernels.h), in the same order, so both paths compute the
 * same numbers. kettle/models/decoder_step.py describes the model's weights to it (through the ctypes
 * structures of kettle/kernels/decoder_step.py).
 */
#include <omp.h>
#include <string.h>

#include "kernels.h"

typedef struct {
    const float *input_norm, *post_norm; /* RMSNorm weights [hidden] */
    Linear qkv, o, gate_up, down;        /* qkv rows: [q heads; k heads; v heads]; gate_up: [gate; up] */
    int64_t window;                      /* sliding window, 0 for none */
    const float *q_norm, *k_norm;        /* per-head RMSNorm weights [head_dim] before RoPE (Qwen3), or NULL */
} Layer;

enum { ACT_SILU = 0, ACT_GELU_TANH = 1 }; /* the gate's activation */

typedef struct {
    int64_t num_layers, hidden, heads, kv_heads, head_dim, inner, block_size;
    int64_t float_rows_q4, float_rows_q8; /* from these many rows on, projections run the float32 tiles */
    float eps, scale;
    const Layer *layers;
    const float *final_norm;
    int64_t act; /* ACT_SILU or ACT_GELU_TANH */
} Decoder;

static inline int64_t max64(int64_t a, int64_t b) { return a > b ? a : b; }

/* Whether `w` runs over the float32 tiles for `rows` rows (else over rows quantized to int16). */
static inline int float_tiles(const Decoder *m, const Linear *w, int64_t rows) {
    if (w->kind == LINEAR_F32) return 1; /* float32 weights: the tiles at every size (no quantized rows) */
    return rows >= (w->kind == LINEAR_Q4 ? m->float_rows_q4 : m->float_rows_q8);
}

/* The step's activations, one allocation (rows = sequences). */
typedef struct {
    float *x, *residual, *qkv, *q, *attn, *out, *gate_up, *act;
    QuantizedRows xq;
} Scratch;

static int alloc_scratch(const Decoder *m, int64_t rows, Scratch *s) {
    const int64_t qkv = (m->heads + 2 * m->kv_heads) * m->head_dim, heads = m->heads * m->head_dim;
    const int64_t sizes[] = {m->hidden, m->hidden, qkv, heads, heads, m->hidden, 2 * m->inner, m->inner};
    float **slots[] = {&s->x, &s->residual, &s->qkv, &s->q, &s->attn, &s->out, &s->gate_up, &s->act};
    int64_t total = 0, widest = 0;
    for (int i = 0; i < 8; i++) total += sizes[i], widest = sizes[i] > widest ? sizes[i] : widest;
    float *base = malloc(sizeof(float) * (size_t)(rows * total));
    if (!base) return -1;
    if (alloc_rows(rows, widest, &s->xq)) return free(base), free_rows(&s->xq), -1;
    for (int i = 0; i < 8; i++) *slots[i] = base, base += rows * sizes[i];
    return 0;
}

static void free_scratch(Scratch *s) {
    free(s->x); /* the base of the one allocation */
    free_rows(&s->xq);
}

/* y [rows, N] = x · Wᵀ (+ bias), the output channels split across the team (an orphaned `omp for`, whose
 * closing barrier makes y complete for the next stage): float32 tiles from `float_rows_*` rows on (x [rows, K]),
 * else integer dot products with the rows quantized in xq. `buffer`: this thread's TILE_CHANNELS·K floats. */
static void linear(const Decoder *m, const Linear *w, const float *x, const QuantizedRows *xq, int64_t rows, float *y,
                   float *buffer) {
    const int64_t n = w->n, k = w->k;
    if (float_tiles(m, w, rows)) {
#pragma omp for schedule(static)
        for (int64_t p = 0; p < (n + TILE_CHANNELS - 1) / TILE_CHANNELS; p++)
            linear_channels_f32(w, p, x, k, rows, y, n, buffer);
    } else {
#pragma omp for schedule(static)
        for (int64_t j = 0; j < n; j++) linear_channel_qa(w, xq, rows, j, y, n);
    }
}

/* x = RMSNorm(residual + block output) (the first layer: of the embedding, which becomes the residual),
 * quantized for the projection `next` reads it. */
static void add_norm(const Decoder *m, Scratch *s, const float *block_out, const float *weight, const Linear *next,
                     int64_t rows) {
    const int64_t dim = m->hidden;
#pragma omp for schedule(static)
    for (int64_t r = 0; r < rows; r++) {
        float *residual = s->residual + r * dim, *x = s->x + r * dim;
        if (block_out) rms_norm_row(block_out + r * dim, residual, weight, dim, m->eps, x, residual);
        else rms_norm_row(residual, NULL, weight, dim, m->eps, x, NULL);
        if (!float_tiles(m, next, rows)) quantize_row(x, dim, next->group, &s->xq, r);
    }
}

/* Each of `heads` heads of `row` RMS-normalized in place over head_dim (the q/k norms). */
static void norm_heads(const Decoder *m, float *row, int64_t heads, const float *weight) {
    for (int64_t h = 0; h < heads; h++) rms_norm_row(row + h * m->head_dim, NULL, weight, m->head_dim, m->eps, row + h * m->head_dim, NULL);
}

/* The q/k norms when the layer has them, then RoPE on q (into s->q) and k (straight into its cache slot), v
 * copied to its slot. */
static void rope_and_store(const Decoder *m, const Layer *l, Scratch *s, const float *cos, const float *sin,
                           const int64_t *slots, float *k_cache, float *v_cache, int64_t rows) {
    const int64_t dim = m->head_dim, kv = m->kv_heads * dim;
#pragma omp for schedule(static)
    for (int64_t r = 0; r < rows; r++) {
        float *row = s->qkv + r * (m->heads * dim + 2 * kv);
        const float *c = cos + r * dim, *sn = sin + r * dim;
        if (l->q_norm) norm_heads(m, row, m->heads, l->q_norm), norm_heads(m, row + m->heads * dim, m->kv_heads, l->k_norm);
        rope_row(row, c, sn, m->heads, dim, s->q + r * m->heads * dim);
        rope_row(row + m->heads * dim, c, sn, m->kv_heads, dim, k_cache + slots[r] * kv);
        memcpy(v_cache + slots[r] * kv, row + m->heads * dim + kv, sizeof(float) * (size_t)kv);
    }
}

/* Rows of `x` [rows, dim] quantized for the projection `next` (when it takes quantized rows). */
static void quantize_for(const Decoder *m, const float *x, int64_t dim, const Linear *next, QuantizedRows *xq,
                         int64_t rows) {
    if (float_tiles(m, next, rows)) return;
#pragma omp for schedule(static)
    for (int64_t r = 0; r < rows; r++) quantize_row(x + r * dim, dim, next->group, xq, r);
}

/* act(gate) · up, quantized for the down projection when it takes quantized rows. */
static void gate_for(const Decoder *m, Scratch *s, const Linear *next, int64_t rows) {
#pragma omp for schedule(static)
    for (int64_t r = 0; r < rows; r++) {
        if (m->act == ACT_GELU_TANH) gelu_tanh_mul_row(s->gate_up + r * 2 * m->inner, m->inner, s->act + r * m->inner);
        else silu_mul_row(s->gate_up + r * 2 * m->inner, m->inner, s->act + r * m->inner);
        if (!float_tiles(m, next, rows)) quantize_row(s->act + r * m->inner, m->inner, next->group, &s->xq, r);
    }
}

static void attention(const Decoder *m, Scratch *s, const PagedDecode *p, float *scores, int64_t rows) {
#pragma omp for schedule(dynamic, 1)
    for (int64_t item = 0; item < rows * m->kv_heads; item++)
        attend_item(p, s->q, item / m->kv_heads, item % m->kv_heads, scores, s->attn);
}

/* One layer, run by every thread of the team. */
static void layer_step(const Decoder *m, const Layer *l, Scratch *s, float *k_cache, float *v_cache,
                       const PagedDecode *shape, const float *cos, const float *sin, const int64_t *slots,
                       float *scores, float *buffer, int64_t rows) {
    PagedDecode p = *shape;
    p.k_cache = k_cache, p.v_cache = v_cache, p.window = l->window;
    linear(m, &l->qkv, s->x, &s->xq, rows, s->qkv, buffer);
    rope_and_store(m, l, s, cos, sin, slots, k_cache, v_cache, rows);
    attention(m, s, &p, scores, rows);
    quantize_for(m, s->attn, m->heads * m->head_dim, &l->o, &s->xq, rows);
    linear(m, &l->o, s->attn, &s->xq, rows, s->out, buffer);
    add_norm(m, s, s->out, l->post_norm, &l->gate_up, rows);
    linear(m, &l->gate_up, s->x, &s->xq, rows, s->gate_up, buffer);
    gate_for(m, s, &l->down, rows);
    linear(m, &l->down, s->act, &s->xq, rows, s->out, buffer);
}

/* embedded [rows, hidden] (one new token per sequence) → out [rows, hidden], the final norm's output; writes each
 * layer's new K/V into k_caches[l] / v_caches[l] at `slots`. cos/sin [rows, head_dim] (sin signed), tables
 * [rows, max_blocks], positions [rows] as for `kettle_paged_decode`. -1 when out of memory (nothing written). */
int kettle_decoder_step(
    const Decoder *m, float *const *k_caches, float *const *v_caches, const float *embedded, int64_t rows,
    const float *cos, const float *sin, const int64_t *slots, const int64_t *tables, int64_t max_blocks,
    const int64_t *positions, float *out, int threads
) {
    /* Per thread: attention scores, then the dequantized weight rows of one float32 tile. */
    const int64_t widest = max64(max64(m->hidden, m->inner), m->heads * m->head_dim);
    const int64_t scores_size = (m->heads / m->kv_heads * (longest_context(positions, rows) + 1) + 7) / 8 * 8;
    const int64_t per_thread = scores_size + TILE_CHANNELS * widest;
    float *scores = malloc(sizeof(float) * (size_t)(threads * per_thread));
    Scratch s;
    if (!scores || alloc_scratch(m, rows, &s)) return free(scores), -1;
    memcpy(s.residual, embedded, sizeof(float) * (size_t)(rows * m->hidden));
    const PagedDecode shape = {NULL, NULL, tables, positions, max_blocks, m->heads, m->kv_heads, m->head_dim,
                               m->block_size, 0, m->scale};
#pragma omp parallel num_threads(threads)
    {
        float *own = scores + omp_get_thread_num() * per_thread, *buffer = own + scores_size;
        for (int64_t i = 0; i < m->num_layers; i++) {
            const Layer *l = m->layers + i;
            add_norm(m, &s, i ? s.out : NULL, l->input_norm, &l->qkv, rows);
            layer_step(m, l, &s, k_caches[i], v_caches[i], &shape, cos, sin, slots, own, buffer, rows);
        }
    }
    for (int64_t r = 0; r < rows; r++)
        rms_norm_row(s.out + r * m->hidden, s.residual + r * m->hidden, m->final_norm, m->hidden, m->eps,
                     out + r * m->hidden, s.residual + r * m->hidden);
    free_scratch(&s);
    free(scores);
    return 0;
}
