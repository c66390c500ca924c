/* gemm.c's AVX2 micro-kernel of the integer panels in one form of the dot-product step (kernels.h, `AVX2_FORM`):
 * included once per form, each inclusion defining int_channels_<form> compiled for that form's target. Not a header
 * of its own: gemm.c's LaneRows, IntChannels, LANES and AVX2_CHANNELS come first. */

/* `channels` (≤ AVX2_CHANNELS, a constant at each call) output channels from c0 of w × `halves` (1 or 2, a constant)
 * halves of 8 lanes of x into tile [channel][16 lanes]; `is_signed` (a constant): the weights are int8 beside their
 * sizes (`signed_quads`, the sign trick), else widened u8 q + `offset`, whose term comes off each span's start (as
 * `micro_vnni8`): a non-zero offset only where the sums are int32 from the first product (the VNNI forms, or
 * `wide`). `wide` (a constant): values past 0..15, summed two quads at a time into int32 (kernels.h `wide_values`);
 * `sub_blocks` (a constant): each block's two spans of 16 inputs keep their own sums and scales (Q6_K), else a block
 * is one span. */
static inline __attribute__((always_inline)) AVX2_TARGET void AVX2_NAMED(micro_avx2_int)(
    const LaneRows *x, int64_t k, int64_t group, const IntChannels *w, int c0, const int channels, const int halves,
    const int is_signed, const int sub_blocks, const int wide, const int offset, float *tile
) {
    const int64_t blocks = k / 32, groups = k / group;
    const int spans = sub_blocks ? 2 : 1, quads = 8 / spans; /* a span's quads of int8 rows */
    __m256 acc[AVX2_CHANNELS][2];
    for (int c = 0; c < channels; c++)
        for (int h = 0; h < halves; h++) acc[c][h] = _mm256_setzero_ps();
    for (int64_t b = 0; b < blocks; b++) {
        __m256 part[AVX2_CHANNELS][2]; /* sub_blocks: the block's sums · scales so far, as `micro_vnni_q6` */
        for (int s = 0; s < spans; s++) {
            __m256i dot[AVX2_CHANNELS][2], start[2]; /* u8: the form's block sums (`block_dot`), else int32 quad sums */
            for (int h = 0; h < halves; h++) {
                /* the block's two halves' input sums, or the span's own */
                const __m256i *sum = (const __m256i *)(x->half + (2 * b + s) * LANES + 8 * h);
                const __m256i inputs = sub_blocks ? _mm256_load_si256(sum) : _mm256_add_epi32(_mm256_load_si256(sum), _mm256_load_si256(sum + LANES / 8));
                start[h] = offset ? _mm256_mullo_epi32(inputs, _mm256_set1_epi32(-offset)) : _mm256_setzero_si256();
            }
            for (int c = 0; c < channels; c++)
                for (int h = 0; h < halves; h++) dot[c][h] = start[h];
            /* `wide` takes two quads a step (`quad_pair_dot`), the others one */
            for (int64_t i = b * 8 + s * quads; i < b * 8 + (s + 1) * quads; i += 1 + wide) {
                __m256i a[2], next[2];
                for (int h = 0; h < halves; h++) a[h] = _mm256_load_si256((const __m256i *)(x->quads + i * LANES + 8 * h));
                if (wide)
                    for (int h = 0; h < halves; h++) next[h] = _mm256_load_si256((const __m256i *)(x->quads + (i + 1) * LANES + 8 * h));
                for (int c = 0; c < channels; c++) {
                    const int32_t *row = (const int32_t *)(w->q + (c0 + c) * w->stride);
                    const __m256i q = _mm256_set1_epi32(row[is_signed ? 2 * i : i]);
                    if (is_signed) {
                        const __m256i size = _mm256_set1_epi32(row[2 * i + 1]);
                        for (int h = 0; h < halves; h++) dot[c][h] = AVX2_QUAD_DOT(dot[c][h], size, _mm256_sign_epi8(a[h], q));
                    } else if (wide) {
                        const __m256i then = _mm256_set1_epi32(row[i + 1]);
                        for (int h = 0; h < halves; h++) dot[c][h] = AVX2_QUAD_PAIR_DOT(dot[c][h], q, a[h], then, next[h]);
                    } else {
                        for (int h = 0; h < halves; h++) dot[c][h] = AVX2_BLOCK_DOT(dot[c][h], q, a[h]);
                    }
                }
            }
            for (int h = 0; h < halves; h++) {
                const __m256 d = _mm256_load_ps(x->scale + b * LANES + 8 * h); /* the rows' scale of this block */
                for (int c = 0; c < channels; c++) {
                    const __m256i sums = is_signed || wide ? dot[c][h] : AVX2_BLOCK_SUMS(dot[c][h]);
                    const __m256 weight = _mm256_set1_ps(w->scale[((c0 + c) * blocks + b) * spans + s]);
                    if (!sub_blocks)
                        acc[c][h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums), _mm256_mul_ps(d, weight), acc[c][h]);
                    else if (s == 0)
                        part[c][h] = _mm256_mul_ps(_mm256_cvtepi32_ps(sums), weight);
                    else
                        acc[c][h] = _mm256_fmadd_ps(_mm256_fmadd_ps(_mm256_cvtepi32_ps(sums), weight, part[c][h]), d, acc[c][h]);
                }
            }
        }
        if (w->minimum && b % (group / 32) == 0) { /* as `micro_vnni`: where the tiles add it */
            const int64_t g = b / (group / 32);
            for (int h = 0; h < halves; h++) {
                const __m256 sum = _mm256_load_ps(x->sum + g * LANES + 8 * h);
                for (int c = 0; c < channels; c++)
                    acc[c][h] = _mm256_fmadd_ps(sum, _mm256_set1_ps(w->minimum[(c0 + c) * groups + g]), acc[c][h]);
            }
        }
    }
    for (int c = 0; c < channels; c++)
        for (int h = 0; h < halves; h++) _mm256_storeu_ps(tile + (c0 + c) * LANES + 8 * h, acc[c][h]);
}

/* The AVX2 micro-kernel over the `n` channels of c, AVX2_CHANNELS at a time: the group's first half of lanes only
 * where its `rows` fit there (as `micro_vnni8`). */
static AVX2_TARGET void AVX2_NAMED(int_channels)(const LaneRows *x, int64_t k, int64_t group, const IntChannels *w,
                                                 int n, int64_t rows, int is_signed, int sub_blocks, int wide,
                                                 int offset, float *tile) {
    const int halves = rows <= LANES / 2 ? 1 : 2;
    for (int c0 = 0; c0 < n; c0 += AVX2_CHANNELS) {
        const int channels = n - c0 < AVX2_CHANNELS ? n - c0 : AVX2_CHANNELS;
#define CALL(C, H, S, B, W) AVX2_NAMED(micro_avx2_int)(x, k, group, w, c0, C, H, S, B, W, offset, tile)
#define HALVES(C, S, B, W) if (halves == 2) CALL(C, 2, S, B, W); else CALL(C, 1, S, B, W);
#define CHANNELS(S, B, W) switch (channels) { case 4: HALVES(4, S, B, W) break; case 3: HALVES(3, S, B, W) break; case 2: HALVES(2, S, B, W) break; default: HALVES(1, S, B, W) }
        if (is_signed) { CHANNELS(1, 0, 0) }
        else if (sub_blocks) { CHANNELS(0, 1, 1) }
        else if (wide) { CHANNELS(0, 0, 1) }
        else { CHANNELS(0, 0, 0) }
#undef CHANNELS
#undef HALVES
#undef CALL
    }
}
