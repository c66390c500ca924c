/* gemm.c's AVX2 micro-kernel of the integer panels in one form of the dot-product step (kernels.h, `AVX2_FORM`):
 * included once per form, each inclusion defining int_channels_<form> compiled for that form's target. Not a header
 * of its own: gemm.c's LaneRows, IntChannels, LANES and AVX2_CHANNELS come first. */

/* Quad i of the group's rows, and quad i + 1 where `wide` (a constant), in `halves` of 8 lanes. */
static inline __attribute__((always_inline)) AVX2_TARGET void AVX2_NAMED(row_quads)(const LaneRows *x, int64_t i,
                                                                                    const int halves, const int wide,
                                                                                    __m256i a[2], __m256i next[2]) {
    for (int h = 0; h < halves; h++) a[h] = _mm256_load_si256((const __m256i *)(x->quads + i * LANES + 8 * h));
    for (int h = 0; wide && h < halves; h++) next[h] = _mm256_load_si256((const __m256i *)(x->quads + (i + 1) * LANES + 8 * h));
}

/* Channel c's widened quad i broadcast (`q`), and beside it (`second`) its |q| where `is_signed` (the signed quads)
 * or quad i + 1 where `wide` (constants). */
static inline __attribute__((always_inline)) AVX2_TARGET void AVX2_NAMED(weight_quads)(const IntChannels *w, int c,
                                                                                      int64_t i, const int is_signed,
                                                                                      const int wide, __m256i *q,
                                                                                      __m256i *second) {
    const int32_t *row = (const int32_t *)(w->q + c * w->stride);
    *q = _mm256_set1_epi32(row[is_signed ? 2 * i : i]);
    *second = is_signed ? _mm256_set1_epi32(row[2 * i + 1]) : wide ? _mm256_set1_epi32(row[i + 1]) : *q;
}

/* `channels` (≤ AVX2_CHANNELS, a constant at each call) output channels from c0 of w × `halves` (1 or 2, a constant)
 * halves of 8 lanes of x into tile [channel][16 lanes]; `is_signed` (a constant): the weights are int8 beside their
 * sizes (`signed_quads`, the sign trick), else widened u8 q + `offset`, whose term comes off each block's start (as
 * `micro_vnni8`): a non-zero offset only where the sums are int32 from the first product (the VNNI forms, or
 * `wide`). `wide` (a constant): values past 0..15, summed two quads at a time into int32 (kernels.h `wide_values`). */
static inline __attribute__((always_inline)) AVX2_TARGET void AVX2_NAMED(micro_avx2_int)(
    const LaneRows *x, int64_t k, int64_t group, const IntChannels *w, int c0, const int channels, const int halves,
    const int is_signed, const int wide, const int offset, float *tile
) {
    const int64_t blocks = k / 32, groups = k / group;
    __m256 acc[AVX2_CHANNELS][2];
    for (int c = 0; c < channels; c++)
        for (int h = 0; h < halves; h++) acc[c][h] = _mm256_setzero_ps();
    for (int64_t b = 0; b < blocks; b++) {
        __m256i dot[AVX2_CHANNELS][2], start[2]; /* u8: the form's block sums (`block_dot`), else int32 quad sums */
        for (int h = 0; h < halves; h++) {
            const __m256i *sum = (const __m256i *)(x->half + 2 * b * LANES + 8 * h); /* the block's two halves' sums */
            const __m256i inputs = _mm256_add_epi32(_mm256_load_si256(sum), _mm256_load_si256(sum + LANES / 8));
            start[h] = offset ? _mm256_mullo_epi32(inputs, _mm256_set1_epi32(-offset)) : _mm256_setzero_si256();
        }
        for (int c = 0; c < channels; c++)
            for (int h = 0; h < halves; h++) dot[c][h] = start[h];
        /* `wide` takes two quads a step (`quad_pair_dot`), the others one */
        for (int64_t i = b * 8; i < b * 8 + 8; i += 1 + wide) {
            __m256i a[2], next[2];
            AVX2_NAMED(row_quads)(x, i, halves, wide, a, next);
            for (int c = 0; c < channels; c++) {
                __m256i q, size; /* size: |q| (is_signed), or quad i + 1 (wide) */
                AVX2_NAMED(weight_quads)(w, c0 + c, i, is_signed, wide, &q, &size);
                if (is_signed) {
                    for (int h = 0; h < halves; h++) dot[c][h] = AVX2_QUAD_DOT(dot[c][h], size, _mm256_sign_epi8(a[h], q));
                } else if (wide) {
                    for (int h = 0; h < halves; h++) dot[c][h] = AVX2_QUAD_PAIR_DOT(dot[c][h], q, a[h], size, next[h]);
                } else {
                    for (int h = 0; h < halves; h++) dot[c][h] = AVX2_BLOCK_DOT(dot[c][h], q, a[h]);
                }
            }
        }
        for (int h = 0; h < halves; h++) {
            const __m256 d = _mm256_load_ps(x->scale + b * LANES + 8 * h); /* the rows' scale of this block */
            for (int c = 0; c < channels; c++) {
                const __m256i sums = is_signed || wide ? dot[c][h] : AVX2_BLOCK_SUMS(dot[c][h]);
                const __m256 weight = _mm256_set1_ps(w->scale[(c0 + c) * blocks + b]);
                acc[c][h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums), _mm256_mul_ps(d, weight), acc[c][h]);
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

/* `micro_avx2_int` for a weight with `sub_scales` (kernels.h): each block's sums times its scales (`block_scaled`;
 * the vpmaddubsw form's wide and signed values as it sums their pairs, `quad_pair_scaled`, `quad_dot_scaled`) into
 * the super-block's int32 sums, + minimum · (the block's int8 sum) per block where the weight has minimums, and the
 * super-block's sums times d · the rows' scale after its last block, as the tiles. `sub_blocks` (a constant, Q6_K):
 * each block's two sub-blocks of 16 inputs times their own sc, less the offset's term 32 · (sc₀ · the rows' sum of the
 * first + sc₁ · the second's) in one vpmaddwd of int16 pairs (the `sub_scales` entries 3b .. 3b + 2). A loop of its
 * own over the super-blocks: folded into `micro_avx2_int`'s block loop the same steps ran 5% slower than the
 * per-block float steps they replace, here 20% faster (one thread, 2,048 × 48 in cache, 512 rows: Q4L 175 → 206
 * GOP/s, Q5L 156 → 184, IQ4L 125 → 134). */
static inline __attribute__((always_inline)) AVX2_TARGET void AVX2_NAMED(micro_avx2_scaled)(
    const LaneRows *x, int64_t k, const IntChannels *w, int c0, const int channels, const int halves, const int wide,
    const int is_signed, const int with_offset, const int minimums, const int sub_blocks, int offset, float *tile
) {
    const int64_t blocks = k / 32;
    const int spans = sub_blocks ? 2 : 1, entries = sub_blocks ? 3 : 1, quads = 8 / spans;
    const int pair_scaled = (wide || is_signed) && !AVX2_ACCUMULATES;
    __m256 acc[AVX2_CHANNELS][2];
    for (int c = 0; c < channels; c++)
        for (int h = 0; h < halves; h++) acc[c][h] = _mm256_setzero_ps();
    for (int64_t s0 = 0; s0 < blocks; s0 += 8) {
        __m256i super[AVX2_CHANNELS][2];
        for (int c = 0; c < channels; c++)
            for (int h = 0; h < halves; h++) super[c][h] = _mm256_setzero_si256();
        for (int64_t b = s0; b < s0 + 8; b++) {
            const int32_t *sub = w->sub + b * entries; /* channel c's at c · blocks · entries */
            if (sub_blocks) {
                __m256i inputs[2]; /* the rows' sums of the two sub-blocks as int16 pairs (|sum| ≤ 16 · 127) */
                for (int h = 0; h < halves; h++) {
                    const __m256i *sum = (const __m256i *)(x->half + 2 * b * LANES + 8 * h);
                    inputs[h] = _mm256_blend_epi16(_mm256_load_si256(sum), _mm256_slli_epi32(_mm256_load_si256(sum + LANES / 8), 16), 0xAA);
                }
                for (int c = 0; c < channels; c++) {
                    const __m256i pair = _mm256_set1_epi32(sub[(c0 + c) * blocks * entries + 2]);
                    for (int h = 0; h < halves; h++) super[c][h] = _mm256_sub_epi32(super[c][h], _mm256_madd_epi16(pair, inputs[h]));
                }
            }
            for (int s = 0; s < spans; s++) {
                __m256i dot[AVX2_CHANNELS][2], start[2]; /* the VNNI forms' signed types: from -offset · the inputs' sum */
                for (int h = 0; h < halves; h++) {
                    const __m256i *sum = (const __m256i *)(x->half + 2 * b * LANES + 8 * h);
                    start[h] = with_offset ? _mm256_mullo_epi32(_mm256_add_epi32(_mm256_load_si256(sum), _mm256_load_si256(sum + LANES / 8)),
                                                                _mm256_set1_epi32(-offset))
                                           : _mm256_setzero_si256();
                }
                for (int c = 0; c < channels; c++)
                    for (int h = 0; h < halves; h++) dot[c][h] = with_offset ? start[h] : _mm256_setzero_si256();
                __m256i pair[AVX2_CHANNELS]; /* the span's scales, read once */
                for (int c = 0; c < channels; c++) pair[c] = _mm256_set1_epi32(sub[(c0 + c) * blocks * entries + s]);
                for (int64_t i = b * 8 + s * quads; i < b * 8 + (s + 1) * quads; i += 1 + wide) {
                    __m256i a[2], next[2];
                    AVX2_NAMED(row_quads)(x, i, halves, wide, a, next);
                    for (int c = 0; c < channels; c++) {
                        __m256i q, size; /* size: |q| (is_signed), or quad i + 1 (wide) */
                        AVX2_NAMED(weight_quads)(w, c0 + c, i, is_signed, wide, &q, &size);
                        if (is_signed) {
                            for (int h = 0; h < halves; h++) super[c][h] = quad_dot_scaled_maddubs(super[c][h], size, _mm256_sign_epi8(a[h], q), pair[c]);
                        } else if (pair_scaled) {
                            for (int h = 0; h < halves; h++) super[c][h] = quad_pair_scaled_maddubs(super[c][h], q, a[h], size, next[h], pair[c]);
                        } else if (wide) {
                            for (int h = 0; h < halves; h++) dot[c][h] = AVX2_QUAD_PAIR_DOT(dot[c][h], q, a[h], size, next[h]);
                        } else {
                            for (int h = 0; h < halves; h++) dot[c][h] = AVX2_BLOCK_DOT(dot[c][h], q, a[h]);
                        }
                    }
                }
                for (int c = 0; !pair_scaled && c < channels; c++)
                    for (int h = 0; h < halves; h++) super[c][h] = add_into_epi32(super[c][h], AVX2_BLOCK_SCALED(dot[c][h], pair[c]));
            }
            for (int h = 0; minimums && h < halves; h++) {
                const __m256 sum = _mm256_load_ps(x->sum + b * LANES + 8 * h);
                for (int c = 0; c < channels; c++)
                    acc[c][h] = _mm256_fmadd_ps(sum, _mm256_set1_ps(w->minimum[(c0 + c) * blocks + b]), acc[c][h]);
            }
        }
        for (int h = 0; h < halves; h++) {
            const __m256 d = _mm256_load_ps(x->scale + (s0 + 7) * LANES + 8 * h); /* the rows' scale of the super-block */
            for (int c = 0; c < channels; c++) {
                const __m256 weight = _mm256_set1_ps(w->super[(c0 + c) * (blocks / 8) + s0 / 8]);
                acc[c][h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(super[c][h]), _mm256_mul_ps(d, weight), acc[c][h]);
            }
        }
    }
    for (int c = 0; c < channels; c++)
        for (int h = 0; h < halves; h++) _mm256_storeu_ps(tile + (c0 + c) * LANES + 8 * h, acc[c][h]);
}

/* `micro_avx2_scaled` over the `n` channels of c (a weight with `sub_scales`), SCALED_AVX2_CHANNELS at a time, each
 * case's steps constant in its loop (a variable offset or minimum cost Q4L's and Q5L's loops 10-15%). A function apart
 * from `int_channels`: inlined there, its loops moved the others' code and Q6L's panels (then in float per block) ran
 * 30% slower (150 → 105 GOP/s, one thread in cache). */
static __attribute__((noinline)) AVX2_TARGET void AVX2_NAMED(scaled_channels)(const LaneRows *x, int64_t k,
                                                                              const IntChannels *w, int n,
                                                                              int halves, int is_signed, int sub_blocks,
                                                                              int wide, int offset, float *tile) {
    for (int c0 = 0; c0 < n; c0 += SCALED_AVX2_CHANNELS) {
        const int channels = n - c0 < SCALED_AVX2_CHANNELS ? n - c0 : SCALED_AVX2_CHANNELS;
#define SCALED(C, W, S, O, M, B) if (halves == 2) AVX2_NAMED(micro_avx2_scaled)(x, k, w, c0, C, 2, W, S, O, M, B, offset, tile); else AVX2_NAMED(micro_avx2_scaled)(x, k, w, c0, C, 1, W, S, O, M, B, offset, tile);
#define SCALED_FORMS(W, S, O, M, B) switch (channels) { case 3: SCALED(3, W, S, O, M, B) break; case 2: SCALED(2, W, S, O, M, B) break; default: SCALED(1, W, S, O, M, B) }
        if (sub_blocks) { SCALED_FORMS(1, 0, 0, 0, 1) }        /* Q6_K: its offset by the pairs */
        else if (wide) { SCALED_FORMS(1, 0, 0, 1, 0) }         /* Q5_K */
        else if (is_signed) { SCALED_FORMS(0, 1, 0, 0, 0) }    /* IQ4_XS, the sign trick */
        else if (offset) { SCALED_FORMS(0, 0, 1, 0, 0) }       /* IQ4_XS, the VNNI forms */
        else { SCALED_FORMS(0, 0, 0, 1, 0) }                   /* Q4_K */
#undef SCALED_FORMS
#undef SCALED
    }
}

/* The AVX2 micro-kernel over the `n` channels of c, AVX2_CHANNELS at a time: the group's first half of lanes only
 * where its `rows` fit there (as `micro_vnni8`). */
static AVX2_TARGET void AVX2_NAMED(int_channels)(const LaneRows *x, int64_t k, int64_t group, const IntChannels *w,
                                                 int n, int64_t rows, int is_signed, int sub_blocks, int wide,
                                                 int scaled, int offset, float *tile) {
    const int halves = rows <= LANES / 2 ? 1 : 2;
    if (scaled) {
        AVX2_NAMED(scaled_channels)(x, k, w, n, halves, is_signed, sub_blocks, wide, offset, tile);
        return;
    }
    for (int c0 = 0; c0 < n; c0 += AVX2_CHANNELS) {
        const int channels = n - c0 < AVX2_CHANNELS ? n - c0 : AVX2_CHANNELS;
#define CALL(C, H, S, W) AVX2_NAMED(micro_avx2_int)(x, k, group, w, c0, C, H, S, W, offset, tile)
#define HALVES(C, S, W) if (halves == 2) CALL(C, 2, S, W); else CALL(C, 1, S, W);
#define CHANNELS(S, W) switch (channels) { case 4: HALVES(4, S, W) break; case 3: HALVES(3, S, W) break; case 2: HALVES(2, S, W) break; default: HALVES(1, S, W) }
        if (is_signed) { CHANNELS(1, 0) }
        else if (wide) { CHANNELS(0, 1) }
        else { CHANNELS(0, 0) }
#undef CHANNELS
#undef HALVES
#undef CALL
    }
}
