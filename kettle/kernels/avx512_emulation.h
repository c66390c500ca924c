/* The AVX-512 intrinsics the kernels use that SIMDe's portable headers (Debian's libsimde-dev 0.7.4) leave out, lane
 * by lane with the instructions' results: only for the emulated build (kernels.h, EMULATE_AVX512), after
 * SIMDe's own. Each is defined only where SIMDe has not named it, so a newer SIMDe's own wins. */
#ifndef KETTLE_AVX512_EMULATION_H
#define KETTLE_AVX512_EMULATION_H

#define EMULATED static inline __attribute__((unused))

#ifndef _mm512_cvtepi32_ps
EMULATED simde__m512 emulated_cvtepi32_ps(simde__m512i a) {
    const simde__m512i_private in = simde__m512i_to_private(a);
    simde__m512_private out;
    for (int i = 0; i < 16; i++) out.f32[i] = (float)in.i32[i];
    return simde__m512_from_private(out);
}
#define _mm512_cvtepi32_ps emulated_cvtepi32_ps
#endif

/* vcvtps2dq: to the nearest, ties to even (the default rounding the kernels run under); out of range 0x80000000 */
#ifndef _mm512_cvtps_epi32
EMULATED simde__m512i emulated_cvtps_epi32(simde__m512 a) {
    const simde__m512_private in = simde__m512_to_private(a);
    simde__m512i_private out;
    for (int i = 0; i < 16; i++) {
        const float v = nearbyintf(in.f32[i]);
        out.i32[i] = v >= -2147483648.0f && v < 2147483648.0f ? (int32_t)v : INT32_MIN;
    }
    return simde__m512i_from_private(out);
}
#define _mm512_cvtps_epi32 emulated_cvtps_epi32
#endif

#ifndef _mm512_cvtph_ps
EMULATED simde__m512 emulated_cvtph_ps(simde__m256i a) {
    const simde__m256i_private in = simde__m256i_to_private(a);
    simde__m512_private out;
    for (int i = 0; i < 16; i++) out.f32[i] = _cvtsh_ss(in.u16[i]);
    return simde__m512_from_private(out);
}
#define _mm512_cvtph_ps emulated_cvtph_ps
#endif

#ifndef _mm512_cvtepu8_epi32
EMULATED simde__m512i emulated_cvtepu8_epi32(simde__m128i a) {
    const simde__m128i_private in = simde__m128i_to_private(a);
    simde__m512i_private out;
    for (int i = 0; i < 16; i++) out.i32[i] = in.u8[i];
    return simde__m512i_from_private(out);
}
#define _mm512_cvtepu8_epi32 emulated_cvtepu8_epi32
#endif

#ifndef _mm512_cvtepi8_epi32
EMULATED simde__m512i emulated_cvtepi8_epi32(simde__m128i a) {
    const simde__m128i_private in = simde__m128i_to_private(a);
    simde__m512i_private out;
    for (int i = 0; i < 16; i++) out.i32[i] = in.i8[i];
    return simde__m512i_from_private(out);
}
#define _mm512_cvtepi8_epi32 emulated_cvtepi8_epi32
#endif

#ifndef _mm512_cvtepu8_epi16
EMULATED simde__m512i emulated_cvtepu8_epi16(simde__m256i a) {
    const simde__m256i_private in = simde__m256i_to_private(a);
    simde__m512i_private out;
    for (int i = 0; i < 32; i++) out.i16[i] = in.u8[i];
    return simde__m512i_from_private(out);
}
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

#undef EMULATED
#endif
