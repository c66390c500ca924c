/* The AVX2 int8 template `AVX2_TEMPLATE` (a header's name) compiled once per form of its u8 × s8 step (kernels.h's
 * AVX2_QUAD_DOT and its neighbours): vpmaddubsw + vpmaddwd, AVX-VNNI's VEX vpdpbusd, and its EVEX twin. Each
 * template names its functions after `AVX2_FORM`. */
#define AVX2_FORM maddubs
#include AVX2_TEMPLATE
#undef AVX2_FORM
#define AVX2_FORM avxvnni
#include AVX2_TEMPLATE
#undef AVX2_FORM
#define AVX2_FORM vnni256
#include AVX2_TEMPLATE
#undef AVX2_FORM
#undef AVX2_TEMPLATE
