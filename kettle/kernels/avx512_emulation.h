/* The AVX-512 intrinsics the kernels use that SIMDe's portable headers (Debian's libsimde-dev 0.7.4) leave out, lane
 * by lane with the instructions' results: only for the emulated build (kernels.h, EMULATE_AVX512), after
 * SIMDe's own. Each is defined only where SIMDe has not named it, so a newer SIMDe's own wins. */
#ifndef KETTLE_AVX512_EMULATION_H
#define KETTLE_AVX512_EMULATION_H

#define EMULATED static inline __attribute__((unused))

/* emulated_<name>: out lane i = `expr` of the input's lanes `in` (SIMDe's private unions) for `lanes` lanes */
#define LANEWISE(name, In, Out, lanes, out_lane, expr)                                                               \
    EMULATED simde__##Out emulated_##name(simde__##In a) {                                                           \
        const simde__##In##_private in = simde__##In##_to_private(a);                                                \
        simde__##Out##_private out;                                                                                  \
        for (int i = 0; i < (lanes); i++) out.out_lane[i] = (expr);                                                  \
        return simde__##Out##_from_private(out);                                                                     \
    }

/* vcvtps2dq: to the nearest, ties to even (the default rounding the kernels run under); out of range 0x80000000 */
EMULATED int32_t nearest_int32(float x) {
    const float v = nearbyintf(x);
    return v >= -2147483648.0f && v < 2147483648.0f ? (int32_t)v : INT32_MIN;
}

#ifndef _mm512_cvtepi32_ps
LANEWISE(cvtepi32_ps, m512i, m512, 16, f32, (float)in.i32[i])
#define _mm512_cvtepi32_ps emulated_cvtepi32_ps
#endif
#ifndef _mm512_cvtps_epi32
LANEWISE(cvtps_epi32, m512, m512i, 16, i32, nearest_int32(in.f32[i]))
#define _mm512_cvtps_epi32 emulated_cvtps_epi32
#endif
#ifndef _mm512_cvtph_ps
LANEWISE(cvtph_ps, m256i, m512, 16, f32, _cvtsh_ss(in.u16[i]))
#define _mm512_cvtph_ps emulated_cvtph_ps
#endif
#ifndef _mm512_cvtepu8_epi32
LANEWISE(cvtepu8_epi32, m128i, m512i, 16, i32, in.u8[i])
#define _mm512_cvtepu8_epi32 emulated_cvtepu8_epi32
#endif
#ifndef _mm512_cvtepi8_epi32
LANEWISE(cvtepi8_epi32, m128i, m512i, 16, i32, in.i8[i])
#define _mm512_cvtepi8_epi32 emulated_cvtepi8_epi32
#endif
#ifndef _mm512_cvtepu8_epi16
LANEWISE(cvtepu8_epi16, m256i, m512i, 32, i16, in.u8[i])
#define _mm512_cvtepu8_epi16 emulated_cvtepu8_epi16
#endif

/* GCC's own order of the sums (avx512fintrin.h): the halves, then the quarters, then pairs, so the bits match */
#ifndef _mm512_reduce_add_ps
EMULATED float emulated_reduce_add_ps(simde__m512 a) {
    const simde__m512_private in = simde__m512_to_private(a);
    float half[8], quarter[4];
    for (int i = 0; i < 8; i++) half[i] = in.f32[8 + i] + in.f32[i];
    for (int i = 0; i < 4; i++) quarter[i] = half[4 + i] + half[i];
    return (quarter[0] + quarter[2]) + (quarter[1] + quarter[3]);
}
#define _mm512_reduce_add_ps emulated_reduce_add_ps
#endif

/* AVX512-VL's masked 8-float load and store: masked-off lanes read as zero and are never touched */
#ifndef _mm256_maskz_loadu_ps
EMULATED __m256 emulated_maskz_loadu_ps(uint8_t mask, const void *p) {
    float lanes[8];
    for (int i = 0; i < 8; i++) lanes[i] = mask >> i & 1 ? ((const float *)p)[i] : 0.0f;
    return _mm256_loadu_ps(lanes);
}
#define _mm256_maskz_loadu_ps emulated_maskz_loadu_ps
#endif

#ifndef _mm256_mask_storeu_ps
EMULATED void emulated_mask_storeu_ps(void *p, uint8_t mask, __m256 v) {
    float lanes[8];
    _mm256_storeu_ps(lanes, v);
    for (int i = 0; i < 8; i++)
        if (mask >> i & 1) ((float *)p)[i] = lanes[i];
}
#define _mm256_mask_storeu_ps emulated_mask_storeu_ps
#endif

#undef LANEWISE
#undef EMULATED
#endif
