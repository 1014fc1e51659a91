/* The CPU kernels' common ground, #included first by kernels.c: the C headers, this build's ISA
 * (BST_ISA from the compiler's predefined macros; the table in kernels.c), the dtype codes DT_*,
 * INLINE, bst_isa / bst_has_avx512, and the scalar bfloat16 <-> float conversions. */
#ifndef BST_COMMON_H
#define BST_COMMON_H

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <omp.h>
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__FMA__) && defined(__AVX512BF16__) \
    && defined(__AVX512VNNI__)
#define BST_ISA 3
#elif defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__FMA__)
#define BST_ISA 2
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define BST_ISA 1
#else
#define BST_ISA 0
#endif
#if BST_ISA
#include <immintrin.h>
#endif
#define BST_AVX512 (BST_ISA >= 2)
#define BST_BF16DOT (BST_ISA == 3) /* vdpbf16ps: bf16 pairs multiplied exactly, summed in float32 */
#define BST_SIMD (BST_ISA > 0)

enum { DT_F32 = 0, DT_BF16 = 1, DT_I8 = 2, DT_I4 = 3, DT_F8 = 4, DT_I4D = 5, DT_I8T = 6, DT_BF16T = 7, DT_F32T = 8 };
#define INLINE static inline __attribute__((always_inline))

/* the ISA this library was built for: 3 AVX-512 + BF16, 2 AVX-512, 1 AVX2 + FMA + F16C, 0 scalar */
int bst_isa(void) { return BST_ISA; }
int bst_has_avx512(void) { return BST_AVX512; }

INLINE float bf16_to_f32(uint16_t v) {
    uint32_t u = (uint32_t)v << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

INLINE uint16_t f32_to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40); /* NaN stays NaN */
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

INLINE float load_f(const void *p, int dt, int64_t i) {
    return dt == DT_F32 ? ((const float *)p)[i] : bf16_to_f32(((const uint16_t *)p)[i]);
}

INLINE void store_f(void *p, int dt, int64_t i, float v) {
    if (dt == DT_F32)
        ((float *)p)[i] = v;
    else
        ((uint16_t *)p)[i] = f32_to_bf16(v);
}

#endif /* BST_COMMON_H */
