/* The weight types: one row of WEIGHT_TYPES per layout (`LINEAR_*`, kernels.h), holding what differs between them.
 * Everything else (which path a call takes, the threads, the buffers, the quantized rows) is linear.c's, once for all.
 *
 * The rows layouts' per-channel kernels are here (their loops over a thread's channels); the lanes layouts' are in
 * lanes.c, the panels' widening in gemm.c. A new GGUF type is one row here, its kernels, its decoder in
 * kettle/quantization and its row in the kernel tests' matrix (tests/unit/test_weight_types.py); the Python side
 * reads the table's order from kettle/kernels/structs.py, which a test holds to the enum in kernels.h.
 *
 * Batch invariance: in the rows layouts each row of a step is computed exactly as a row alone is (`invariant_rows`:
 * the same int16 rows, the same integer block sums in the same 8 lanes, the same float chains over the blocks in the
 * same order, the same horizontal sum and last additions), while the kernels share one unpacking of a channel among
 * the rows of a pass (kernels.h `q4_channel_rows`, `q8g_channel_rows`). The lanes' tiles keep each row's sums apart
 * already. tests/unit/test_batch_invariance.py holds every path to one row's bits. */
#include "kernels.h"

/* ---- Q4 (rows): packed nibbles, float16 scales and minimums per group ---- */

static void q4_plain(const Linear *w, const float *x, int64_t ldx, int64_t rows, int64_t j0, int64_t j1, float *y,
                     int64_t ldy) {
    const int64_t k = w->k, group = w->group, groups = k / group;
    for (int64_t j = j0; j < j1; j++) {
        const uint8_t *row_q = (const uint8_t *)w->weight + j * (k / 2);
        const uint16_t *row_s = (const uint16_t *)w->scales + j * groups;
        const Minimums row_m = channel_minimums(w->mins, w->scales, groups, j);
        const float b = w->bias ? w->bias[j] : 0.0f;
        float out[MAX_TILE];
#define ROW(t) q4_row(x + m0 * ldx, ldx, t, k, (int)group, row_q, row_s, row_m, out)
#define STORE(m) y[(m0 + m) * ldy + j] = out[m] + b
        FOR_EACH_TILE(rows, ROW, STORE)
#undef ROW
#undef STORE
    }
}

static void q4_quantized(const Linear *w, const QuantizedRows *xq, int64_t rows, int64_t j0, int64_t j1, float *y,
                         int64_t ldy) {
    const int64_t k = w->k, groups = k / w->group;
    const int group = (int)w->group, wide = one_row_avx512();
    for (int64_t j = j0; j < j1; j++) {
        const uint8_t *row_q = (const uint8_t *)w->weight + j * (k / 2);
        const uint16_t *row_s = (const uint16_t *)w->scales + j * groups;
        const Minimums row_m = channel_minimums(w->mins, w->scales, groups, j);
        const float b = w->bias ? w->bias[j] : 0.0f;
        if (rows == 1 && kettle_channel_one) {
            y[j] = (wide ? q4_channel_one512 : q4_channel_one)(xq, k, group, row_q, row_s, row_m) + b;
            continue;
        }
        float out[MAX_TILE];
#define ROW(t) q4_row_qa(xq, m0, t, k, group, row_q, row_s, row_m, out)
#define STORE(m) y[(m0 + m) * ldy + j] = out[m] + b
        FOR_EACH_TILE(rows, ROW, STORE)
#undef ROW
#undef STORE
    }
}

/* The one-row channels at 256 bits: `kettle_channel_avx512` has no say, so every CPU computes a row as an AVX2 one
 * does. */
static void q4_invariant(const Linear *w, const QuantizedRows *xq, int64_t rows, int64_t j0, int64_t j1, float *y,
                         int64_t ldy) {
    const int64_t k = w->k, groups = k / w->group;
    const int group = (int)w->group;
    for (int64_t j = j0; j < j1; j++) {
        const uint8_t *row_q = (const uint8_t *)w->weight + j * (k / 2);
        const uint16_t *row_s = (const uint16_t *)w->scales + j * groups;
        const Minimums row_m = channel_minimums(w->mins, w->scales, groups, j);
        const float b = w->bias ? w->bias[j] : 0.0f;
        float out[ROWS_PASS];
#define ONE q4_channel_one(xq, k, group, row_q, row_s, row_m)
#define ROW(t) q4_channel_rows(xq, m0, t, k, group, row_q, row_s, row_m, out)
#define STORE(m) y[(m0 + m) * ldy + j] = out[m] + b
        FOR_EACH_PASS(rows, ONE, ROW, STORE)
#undef ONE
#undef ROW
#undef STORE
    }
}

/* ---- Q8 (rows): int8 per output channel, one float32 scale each (`--quantize int8`, int4's LM head) ---- */

static void q8_plain(const Linear *w, const float *x, int64_t ldx, int64_t rows, int64_t j0, int64_t j1, float *y,
                     int64_t ldy) {
    const int64_t k = w->k;
    for (int64_t j = j0; j < j1; j++) {
        const int8_t *row_q = (const int8_t *)w->weight + j * k;
        const float scale = ((const float *)w->scales)[j], b = w->bias ? w->bias[j] : 0.0f;
        float out[MAX_TILE];
#define ROW(t) q8_row(x + m0 * ldx, ldx, t, k, row_q, out)
#define STORE(m) y[(m0 + m) * ldy + j] = out[m] * scale + b
        FOR_EACH_TILE(rows, ROW, STORE)
#undef ROW
#undef STORE
    }
}

/* `q8_row_qa` keeps one chain per row at any tile, so its rows are invariant already: one kernel for both paths. */
static void q8_quantized(const Linear *w, const QuantizedRows *xq, int64_t rows, int64_t j0, int64_t j1, float *y,
                         int64_t ldy) {
    const int64_t k = w->k;
    for (int64_t j = j0; j < j1; j++) {
        const int8_t *row_q = (const int8_t *)w->weight + j * k;
        const float scale = ((const float *)w->scales)[j], b = w->bias ? w->bias[j] : 0.0f;
        float out[MAX_TILE];
#define ROW(t) q8_row_qa(xq, m0, t, k, row_q, NULL, out)
#define STORE(m) y[(m0 + m) * ldy + j] = out[m] * scale + b
        FOR_EACH_TILE(rows, ROW, STORE)
#undef ROW
#undef STORE
    }
}

/* ---- Q8_0 (rows): GGUF's int8 with a float16 scale per block of 32 ---- */

static void q8g_quantized(const Linear *w, const QuantizedRows *xq, int64_t rows, int64_t j0, int64_t j1, float *y,
                          int64_t ldy) {
    const int64_t k = w->k;
    const int wide = one_row_avx512();
    for (int64_t j = j0; j < j1; j++) {
        const int8_t *row_q = (const int8_t *)w->weight + j * k;
        const uint16_t *row_s = (const uint16_t *)w->scales + j * (k / 32);
        const float b = w->bias ? w->bias[j] : 0.0f;
        if (rows == 1 && kettle_channel_one) {
            y[j] = (wide ? q8g_channel_one512 : q8g_channel_one)(xq, k, row_q, row_s) + b;
            continue;
        }
        float out[MAX_TILE];
#define ROW(t) q8_row_qa(xq, m0, t, k, row_q, row_s, out)
#define STORE(m) y[(m0 + m) * ldy + j] = out[m] + b
        FOR_EACH_TILE(rows, ROW, STORE)
#undef ROW
#undef STORE
    }
}

static void q8g_invariant(const Linear *w, const QuantizedRows *xq, int64_t rows, int64_t j0, int64_t j1, float *y,
                          int64_t ldy) {
    const int64_t k = w->k;
    for (int64_t j = j0; j < j1; j++) {
        const int8_t *row_q = (const int8_t *)w->weight + j * k;
        const uint16_t *row_s = (const uint16_t *)w->scales + j * (k / 32);
        const float b = w->bias ? w->bias[j] : 0.0f;
        float out[ROWS_PASS];
#define ONE q8g_channel_one(xq, k, row_q, row_s)
#define ROW(t) q8g_channel_rows(xq, m0, t, k, row_q, row_s, out)
#define STORE(m) y[(m0 + m) * ldy + j] = out[m] + b
        FOR_EACH_PASS(rows, ONE, ROW, STORE)
#undef ONE
#undef ROW
#undef STORE
    }
}

/* The table, in the order of kernels.h's `LINEAR_*` (entry 0 unused). float_rows: measured on the bundled model's
 * shapes (2 AVX2 cores): int4's tiles win from 8 rows (16 rows: 1.3x), int8's cheaper integer path lasts to ~32. */
const WeightType WEIGHT_TYPES[] = {
    [LINEAR_Q4] = {.name = "q4", .quantized = 1, .minimums = 1, .float_rows = 8, .dequantize = q4_dequant_row,
                   .plain = q4_plain, .quantized_rows = q4_quantized, .invariant_rows = q4_invariant,
                   .widen = q4_widen, .scales = group_scales, .widen_row = q4_panel_row},
    [LINEAR_Q8] = {.name = "q8", .quantized = 1, .offset = 128, .channel_scale = 1, .float_rows = 32, .dequantize = q8_widen_row,
                   .plain = q8_plain, .quantized_rows = q8_quantized, .invariant_rows = q8_quantized,
                   .widen = q8_widen, .scales = q8_scales, .widen_row = q8_panel_row},
    [LINEAR_F32] = {.name = "f32", .dequantize = f32_row},
    [LINEAR_Q8G] = {.name = "q8_0", .quantized = 1, .offset = 128, .float_rows = 32, .dequantize = q8g_dequant_row,
                    .quantized_rows = q8g_quantized, .invariant_rows = q8g_invariant, .widen = q8_widen,
                    .scales = group_scales, .widen_row = q8g_panel_row},
    [LINEAR_Q4L] = {.name = "q4_lanes", .lanes = 1, .quantized = 1, .minimums = 1, .dequantize = q4l_dequant_row,
                    .quantized_rows = q4l_rows, .quantized_rows_avx2 = q4l_rows_avx2, .widen = q4l_widen,
                    .scales = q4l_scales, .sub_scales = q4k_sub_scales, .avx2_panels = 1, .panel_group = q4l_panel_group, .pack = pack_q4l},
    [LINEAR_Q8L] = {.name = "q8_0_lanes", .lanes = 1, .quantized = 1, .offset = 128, .dequantize = q8l_dequant_row,
                    .quantized_rows = q8l_rows, .quantized_rows_avx2 = q8l_rows_avx2, .widen = q8l_widen,
                    .scales = q8l_scales, .avx2_panels = 1, .panel_group = q8l_panel_group, .pack = pack_q8l},
    [LINEAR_Q5L] = {.name = "q5_lanes", .lanes = 1, .quantized = 1, .minimums = 1, .wide_values = 1,
                    .dequantize = q5l_dequant_row, .quantized_rows = q5l_rows, .quantized_rows_avx2 = q5l_rows_avx2,
                    .widen = q5l_widen, .scales = q4l_scales, .sub_scales = q4k_sub_scales, .avx2_panels = 1, .pack = pack_q5l},
    [LINEAR_IQ4L] = {.name = "iq4_xs_lanes", .lanes = 1, .quantized = 1, .offset = 128, .dequantize = iq4l_dequant_row,
                     .quantized_rows = iq4l_rows, .quantized_rows_avx2 = iq4l_rows_avx2, .widen = iq4l_widen,
                     .scales = iq4l_scales, .sub_scales = iq4l_sub_scales, .avx2_panels = 1, .pack = pack_iq4l},
    [LINEAR_Q6L] = {.name = "q6_k_lanes", .lanes = 1, .quantized = 1, .sub_blocks = 1, .wide_values = 1, .offset = 32,
                    .dequantize = q6l_dequant_row, .quantized_rows = q6l_rows, .quantized_rows_avx2 = q6l_rows_avx2,
                    .widen = q6l_widen, .sub_scales = q6l_sub_scales, .avx2_panels = 1, .pack = pack_q6l},
};
