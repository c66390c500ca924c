/* The one matmul driver: y = x Wᵀ (+ bias) for every weight type (weight_types.c's table), on the path
 * `choose_path` picks for the row count, the CPU and the tuning. The op-at-a-time entry (`kettle_linear`) and the
 * fused decode step (decoder_step.c) both run a projection through `team_linear`, so a row computes the same bits
 * on either, and the rules that pick a path are written once, here; kettle/kernels/ops.py asks `kettle_linear`
 * (with no output) which path a call takes (for /info and the tests) instead of deciding it.
 */
#include <omp.h>

#include "kernels.h"

#define NEVER ((int64_t)1 << 62)
/* From this many rows the panels beat the float32 tiles: at 16 rows the float32 panels beat them on the bundled
 * model's shapes (down_proj 133 vs 170 us, the whole fused step 1.10x; equal at 8 rows). */
#define GEMM_ROWS 16
/* The integer panels pay for their 16 lanes from fewer rows: a group of 10-15 rows padded to 16 costs what 16 do,
 * less than the few-row paths' passes (bundled model, Zen 4, 2 threads, the fused step at 12 and 14 sequences:
 * 30.3 / 36.8-38.2 ms on the float32 tiles, 24.0 / 24.1-25.0 ms on the panels). */
#define INTEGER_ROWS 10
/* A weight in lanes keeps its own kernel up to here: the panels widen every weight again per call, which a batch of
 * decode rows does not amortize (bundled model's layers op by op, 2 threads: 16 rows 2.8 against 4.3 ms on the
 * panels, 64 rows 7.2 against 10.0, even at 128 and 256, 512 rows 81 against 72). */
#define LANES_GEMM_ROWS 128
/* On an AVX2 CPU from fewer: its tiles meet each weight vector twice as often, 8 channels a vector (the
 * 1.7B model's gate and up, 16,384 × 2,048, one thread, AVX-512 off: Q4_K 48 rows 21.9 against 22.7 ms on the tiles,
 * 64 rows 27.0 against 30.0, 96 rows 37.5 against 48.7; IQ4_XS 64 rows 44.8 against 50.2). */
#define AVX2_LANES_GEMM_ROWS 64

static inline int64_t min64(int64_t a, int64_t b) { return a < b ? a : b; }

/* Whether the panels are the integer ones for a weight of `type`: switched on, over int8 rows, where they run it
 * (AVX-512 VNNI; on an AVX2 CPU the `avx2_panels` types). */
static int integer_panels(const Tuning *t, const WeightType *type) {
    return t->integer_gemm && t->quantized_activations && integer_panels_run(type);
}

/* Rows from which the panels run (for a weight in lanes not before LANES_GEMM_ROWS, on AVX2 AVX2_LANES_GEMM_ROWS). */
static int64_t panel_rows(const Tuning *t, const WeightType *type) {
    const int64_t gemm = t->gemm_rows < 0 ? GEMM_ROWS : t->gemm_rows ? t->gemm_rows : NEVER;
    const int64_t rows = integer_panels(t, type) ? min64(gemm, t->gemm_rows < 0 ? INTEGER_ROWS : gemm) : gemm;
    const int64_t lanes = kettle_cpu_vnni512 ? LANES_GEMM_ROWS : AVX2_LANES_GEMM_ROWS;
    return type->lanes && rows < lanes ? lanes : rows;
}

/* Rows from which the float32 tiles replace int16 rows for a weight in the rows layouts. */
static int64_t float_rows(const Tuning *t, const WeightType *type) {
    const int64_t rows = t->float_rows < 0 ? type->float_rows : t->float_rows;
    return rows ? rows : NEVER;
}

/* The panels for `rows` rows: the integer ones where they run and the rows are whole blocks, else the float32 ones. */
static int panels_path(const Linear *w, const Tuning *t) {
    return integer_panels(t, type_of(w)) && w->k % 32 == 0 ? PATH_INT_GEMM : PATH_GEMM;
}

/* Under batch invariance every row keeps one arithmetic whatever the row count, so the choice is between kernels of
 * the same bits: a weight in lanes between its lanes kernel and the integer panels (both add a row's block sums in
 * one order; on an AVX2 CPU its AVX2 tiles and AVX2 panels), a rows layout's decode rows each as alone, its prompt
 * rows the prompt GEMM (whose sums for a row do not depend on how many rows a chunk has). Without it, each row count
 * takes its fastest kernel. */
int choose_path(const Linear *w, int64_t rows, int prompt, const Tuning *t) {
    const WeightType *type = type_of(w);
    const int blocks = t->quantized_activations && w->k % 32 == 0; /* whole blocks of quantized rows */
    const int float32 = type->plain ? PATH_PLAIN : PATH_TILES;      /* float32 rows below the tiles */
    if (!type->quantized) return PATH_TILES;
    if (t->invariant) {
        if (!blocks) return type->lanes ? PATH_TILES : float32;
        /* on an AVX2 CPU with the integer panels switched off, a lanes type's prompt rows take the float32 ones, whose
         * sums for a row do not depend on the chunk, and its decode rows its tiles, as the rows layouts split them */
        if (type->lanes && !kettle_cpu_vnni512 && !integer_panels(t, type)) return prompt ? PATH_GEMM : PATH_QUANTIZED;
        if (type->lanes) return rows >= panel_rows(t, type) ? PATH_INT_GEMM : PATH_QUANTIZED;
        return prompt ? panels_path(w, t) : PATH_INVARIANT;
    }
    const int64_t panels = panel_rows(t, type);
    /* Lanes share each weight vector among the rows of a pass for 16 channels at once: below the panels they beat
     * dequantizing every weight to float32 at any row count (the bundled model's fused step at 8 rows: 15 against
     * 25-35 ms in rows). */
    const int64_t several = type->lanes ? (t->quantized_activations ? panels : 0) : min64(float_rows(t, type), panels);
    if (rows >= several) return rows >= panels ? panels_path(w, t) : PATH_TILES;
    return blocks ? PATH_QUANTIZED : float32;
}

int64_t path_buffer_floats(const Linear *w, int path, int64_t rows) {
    int64_t floats = 0;
    if (path == PATH_TILES) floats = TILE_CHANNELS * w->k;
    if (path == PATH_GEMM || path == PATH_INT_GEMM) floats = gemm_buffer_floats(w->k);
    if (path == PATH_INVARIANT && rows >= kettle_row_gemm_rows) floats = row_panel_floats(w->k);
    return (floats + 15) / 16 * 16;
}

/* This thread's share [j0, j1) of w's output channels, in units of 16 for a weight in lanes, as `schedule(static)`
 * splits a loop: one call of the type's kernel per thread and projection. */
static void my_channels(const Linear *w, int64_t *j0, int64_t *j1) {
    const int64_t unit = type_of(w)->lanes ? 16 : 1, units = (w->n + unit - 1) / unit;
    const int64_t team = omp_get_num_threads(), me = omp_get_thread_num();
    *j0 = units * me / team * unit;
    *j1 = min64(w->n, units * (me + 1) / team * unit);
}

typedef void RowsKernel(const Linear *w, const QuantizedRows *xq, int64_t rows, int64_t j0, int64_t j1, float *y,
                        int64_t ldy);

/* The one-row kernels' tail (`team_units`): the last eighth of each thread's share is taken by whichever thread is
 * free. Each thread still streams the first 7/8 of its share in order (the hardware prefetcher's one stream: handing
 * out every unit dynamically lost to the static halves), and a thread that the host held up for a while no longer
 * keeps the other waiting at the barrier, where a 1.7B model's decode step had spent 6% of its time. */
#define SHARED_TAIL 8

void team_units(int64_t units, int64_t tail, UnitsKernel *kernel, const void *context) {
    const int64_t team = omp_get_num_threads(), me = omp_get_thread_num();
#define SHARE_END(t) (units * ((t) + 1) / team)
#define TAIL_START(t) (SHARE_END(t) - (SHARE_END(t) - units * (t) / team) / tail)
    const int64_t first = units * me / team, head = TAIL_START(me);
    if (head > first) kernel(context, first, head);
    const int64_t longest = (units + team - 1) / team / tail;
#pragma omp for schedule(dynamic, 1)
    for (int64_t i = 0; i < longest * team; i++) {
        const int64_t owner = i % team, unit = TAIL_START(owner) + i / team;
        if (unit < SHARE_END(owner)) kernel(context, unit, unit + 1);
    }
#undef TAIL_START
#undef SHARE_END
}

typedef struct {
    const Linear *w;
    RowsKernel *kernel;
    const QuantizedRows *xq;
    int64_t rows, ldy;
    float *y;
} Channels;

static void channel_units(const void *context, int64_t u0, int64_t u1) {
    const Channels *c = context;
    c->kernel(c->w, c->xq, c->rows, 16 * u0, min64(c->w->n, 16 * u1), c->y, c->ldy);
}

/* `kernel` over w's output channels by the team in units of 16 (`team_units`), ending with the team's barrier; each
 * unit whole in one thread, so a row's bits do not depend on who ran it. */
static void run_channels(const Linear *w, RowsKernel *kernel, const QuantizedRows *xq, int64_t rows, float *y,
                         int64_t ldy) {
    const Channels context = {w, kernel, xq, rows, ldy, y};
    team_units((w->n + 15) / 16, SHARED_TAIL, channel_units, &context);
}

void team_linear(const Linear *w, int path, const float *x, int64_t ldx, const QuantizedRows *xq, int64_t rows,
                 float *y, int64_t ldy, float *buffer) {
    const WeightType *type = type_of(w);
    int64_t j0, j1;
    my_channels(w, &j0, &j1);
    switch (path) {
    case PATH_PLAIN:
        type->plain(w, x, ldx, rows, j0, j1, y, ldy);
        break;
    case PATH_TILES:
#pragma omp for schedule(static)
        for (int64_t p = 0; p < (w->n + TILE_CHANNELS - 1) / TILE_CHANNELS; p++)
            linear_channels_f32(w, p, x, ldx, rows, y, ldy, buffer);
        return; /* the loop's barrier */
    case PATH_QUANTIZED: /* a lanes type on its AVX2 tiles where the CPU (or a test) says no AVX-512 */
        run_channels(w, type->quantized_rows_avx2 && !lanes_avx512() ? type->quantized_rows_avx2 : type->quantized_rows,
                     xq, rows, y, ldy);
        return; /* the loop's barrier */
    case PATH_INVARIANT:
        if (rows >= kettle_row_gemm_rows) gemm_row_panels(w, xq, rows, y, ldy, buffer);
        else run_channels(w, type->invariant_rows, xq, rows, y, ldy);
        return;
    case PATH_GEMM:
        gemm_panels(w, x, ldx, rows, y, ldy, buffer);
        return;
    default: /* PATH_INT_GEMM */
        lay_out_lanes(xq, rows, w->k, w->group);
        gemm_panels_int(w, xq, rows, y, ldy, buffer);
        return;
    }
#pragma omp barrier
}

/* Whether `w` has the kernels of `path` (a path the chooser would not pick can still be asked for: the tests' matrix
 * runs every type on every path it has). */
static int path_runs(const Linear *w, int path) {
    const WeightType *type = type_of(w);
    switch (path) {
    case PATH_PLAIN: return type->plain != NULL;
    case PATH_TILES: case PATH_GEMM: return 1;
    case PATH_QUANTIZED:
        return w->k % 32 == 0 && type->quantized_rows != NULL;
    case PATH_INVARIANT: return type->invariant_rows != NULL && w->k % 32 == 0;
    case PATH_INT_GEMM: return w->k % 32 == 0 && integer_panels_run(type);
    default: return 0;
    }
}

/* Room for `rows` quantized rows of K = w->k as `path` reads them (lanes for the integer panels); -1 when out of
 * memory. */
static int alloc_input(const Linear *w, int path, int64_t rows, QuantizedRows *xq) {
    if (alloc_rows(rows, w->k, xq)) return -1;
    return path == PATH_INT_GEMM && alloc_lanes(rows, w->k, xq) ? -1 : 0;
}

/* One part of `linear` (w->next NULL), its rows quantized with `span` inputs to an int8 scale. */
static int linear_part(const Linear *w, int64_t span, const float *x, int64_t ldx, int64_t rows, float *y, int64_t ldy,
                       int path, const Tuning *tuning, int threads) {
    if (path < 0) path = choose_path(w, rows, path == PATH_PROMPT_ROWS, tuning);
    if (!path_runs(w, path)) return -2;
    const int quantized = reads_quantized(path);
    const int64_t per_thread = path_buffer_floats(w, path, rows);
    QuantizedRows xq = {NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL};
    float *buffers = per_thread ? aligned_alloc(64, sizeof(float) * (size_t)(threads * per_thread)) : NULL;
    if ((per_thread && !buffers) || (quantized && alloc_input(w, path, rows, &xq))) return free(buffers), free_rows(&xq), -1;
#pragma omp parallel num_threads(threads)
    {
        if (quantized) {
#pragma omp for schedule(static)
            for (int64_t r = 0; r < rows; r++) quantize_row(x + r * ldx, w, span, &xq, r);
        }
        team_linear(w, path, x, ldx, &xq, rows, y, ldy, buffers ? buffers + omp_get_thread_num() * per_thread : NULL);
    }
    free(buffers);
    free_rows(&xq);
    return 0;
}

/* y [rows, N] = x [rows, K] · Wᵀ (+ bias) for any weight type (rows ldx and ldy floats apart), on `path` (PATH_*) or
 * on the chooser's pick for decode rows (PATH_DECODE_ROWS) or prompt rows (PATH_PROMPT_ROWS) under `tuning`. -1 when
 * out of memory (nothing written), -2 for a path `w` has no kernel for. With y NULL nothing is computed: the call
 * returns the path it would take (how Python asks, for /info and the tests). A stacked projection's parts each take
 * their own path, their outputs after the part before, over rows quantized as the fused step does for all of them. */
int kettle_linear(const Linear *w, const float *x, int64_t ldx, int64_t rows, float *y, int64_t ldy, int path,
                  const Tuning *tuning, int threads) {
    if (!y) return choose_path(w, rows, path == PATH_PROMPT_ROWS, tuning); /* asked which path, nothing computed */
    const int64_t span = int8_span(w);
    for (const Linear *p = w; p; y += p->n, p = p->next) {
        Linear part = *p;
        part.next = NULL;
        const int failed = linear_part(&part, span, x, ldx, rows, y, ldy, path, tuning, threads);
        if (failed) return failed;
    }
    return 0;
}

/* Rows `ids` [count] of W (every row when ids is NULL) as float32 [count, K], with a per-channel scale applied: an
 * embedding table's lookup, or the whole weight (the dense GEMM of large prefills, the tests' reference). */
void kettle_dequantize(const Linear *w, const int64_t *ids, int64_t count, float *out, int threads) {
#pragma omp parallel for num_threads(threads) schedule(static) if (count > 8)
    for (int64_t i = 0; i < count; i++) {
        int64_t j = ids ? ids[i] : i;
        const Linear *part = w; /* row j of a stacked projection: its part's row */
        while (j >= part->n && part->next) j -= part->n, part = part->next;
        const WeightType *type = type_of(part);
        float *dst = out + i * w->k;
        type->dequantize(part, j, dst);
        if (type->channel_scale)
            for (int64_t c = 0; c < w->k; c++) dst[c] *= ((const float *)part->scales)[j];
    }
}
