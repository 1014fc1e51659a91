/* bestiary CPU kernels: the batch-1 / small-batch decode ops, one source for four builds.
 *
 * Built by bestiary.core.kernels.cpu.build (gcc -O3 -fopenmp and one ISA's flags) the first time they
 * are needed, loaded with ctypes. The ISA follows from the compiler's predefined macros:
 *
 *   BST_ISA 3  AVX-512 + AVX512_BF16 + AVX512_VNNI   BST_ISA 2, and where both operands are
 *                                                    bfloat16 (bf16 weights x bf16 inputs,
 *                                                    bf16 q . bf16 keys) vdpbf16ps dot products;
 *                                                    int8 weights x bf16 inputs: vpdpwssd (q16)
 *   BST_ISA 2  AVX-512 (F, BW, VL; with FMA, F16C)   16-float vectors, masked tails
 *   BST_ISA 1  AVX2 + FMA + F16C                     8-float vectors
 *   BST_ISA 0  scalar C (what the compiler makes of it for the baseline target)
 *
 * The vector code is written once against the thin `vf` / `vi` layer below (intrinsics per
 * ISA); where the two ISAs want different algorithms (the int4 GEMV), each has its own.
 * vdpbf16ps (BST_ISA 3) multiplies pairs of bfloat16 exactly (8-bit significands: the product
 * fits a float) and adds them to float32 accumulators, rounding each add (denormals flushed):
 * the sums the widening + FMA path forms, in another order. It runs only where both operands
 * already are bfloat16 (a bf16 engine's activations and weights / q and keys), so nothing is
 * rounded that the other builds keep: float32 inputs take the FMA path on every build.
 * Each op has a torch reference in bestiary.core.kernels.cpu.ops, and the tests compare every build
 * with it. Tensors are passed as raw pointers, contiguous, in these dtypes:
 *
 *   DT_F32 = 0   float
 *   DT_BF16 = 1  bfloat16 (uint16 bit pattern; rounding to nearest even, as torch)
 *   DT_I8 = 2    int8 weights, one float scale per output row
 *   DT_I4 = 3    int4 weights, two per byte (low nibble = even k), float scale s and s * zero
 *                per row and group of G input features
 *   DT_F8 = 4    float8 e4m3fn KV cache codes (DT_I8 too: int8 KV codes), x ~ code * scale
 *   DT_I4D = 5   DT_I4 in the dot layout (int4d_tile4_bf16): the AVX-512 + BF16 build only
 *   DT_I8T = 6   DT_I8 in row tiles (w_off): a tile's GEMV reads one sequential stream
 *   DT_BF16T = 7 DT_BF16 W [n, k] in the same row tiles (decode; the prefill GEMM untiles it)
 *   DT_F32T = 8  DT_F32 W [n, k] in the same row tiles
 *
 * Threads: OpenMP, with the libgomp that torch already loaded (same soname), so there is one
 * thread pool in the process. Every op takes the number of threads to use.
 */
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

/* ---------------------------------------------------------------------------------------- */
/* the vector layer: VW floats per vector, the same names on AVX-512 and AVX2               */
/* ---------------------------------------------------------------------------------------- */

#if BST_AVX512
#define VW 16
typedef __m512 vf;
typedef __m512i vi;
INLINE vf vzero(void) { return _mm512_setzero_ps(); }
INLINE vf vset1(float a) { return _mm512_set1_ps(a); }
INLINE vf vloadu(const float *p) { return _mm512_loadu_ps(p); }
INLINE void vstoreu(float *p, vf a) { _mm512_storeu_ps(p, a); }
INLINE vf vadd(vf a, vf b) { return _mm512_add_ps(a, b); }
INLINE vf vsub(vf a, vf b) { return _mm512_sub_ps(a, b); }
INLINE vf vmul(vf a, vf b) { return _mm512_mul_ps(a, b); }
INLINE vf vdiv(vf a, vf b) { return _mm512_div_ps(a, b); }
INLINE vf vmax(vf a, vf b) { return _mm512_max_ps(a, b); }
INLINE vf vmin(vf a, vf b) { return _mm512_min_ps(a, b); }
INLINE vf vabs(vf a) { return _mm512_abs_ps(a); }
INLINE vf vfmadd(vf a, vf b, vf c) { return _mm512_fmadd_ps(a, b, c); }    /* a b + c */
INLINE vf vfmsub(vf a, vf b, vf c) { return _mm512_fmsub_ps(a, b, c); }    /* a b - c */
INLINE vf vfnmadd(vf a, vf b, vf c) { return _mm512_fnmadd_ps(a, b, c); }  /* c - a b */
INLINE vf vfmaddsub(vf a, vf b, vf c) { return _mm512_fmaddsub_ps(a, b, c); } /* a b -+ c (even -, odd +) */
INLINE float vsum(vf a) { return _mm512_reduce_add_ps(a); }
INLINE vf vround(vf a) { return _mm512_roundscale_ps(a, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
INLINE vf vselect_lt(vf a, vf b, vf x, vf y) { return _mm512_mask_blend_ps(_mm512_cmp_ps_mask(a, b, _CMP_LT_OQ), y, x); }
INLINE vi vcvt_i32(vf a) { return _mm512_cvtps_epi32(a); } /* a integral */
INLINE vi vf_as_i(vf a) { return _mm512_castps_si512(a); }
INLINE vf vi_as_f(vi a) { return _mm512_castsi512_ps(a); }
INLINE vi vi_set1(int a) { return _mm512_set1_epi32(a); }
INLINE vi vi_add(vi a, vi b) { return _mm512_add_epi32(a, b); }
INLINE vi vi_sub(vi a, vi b) { return _mm512_sub_epi32(a, b); }
INLINE vi vi_and(vi a, vi b) { return _mm512_and_si512(a, b); }
INLINE vi vi_or(vi a, vi b) { return _mm512_or_si512(a, b); }
#define vi_srli(a, n) _mm512_srli_epi32(a, n)
#define vi_slli(a, n) _mm512_slli_epi32(a, n)
INLINE vi vi_select_lt(vf a, vf b, vi x, vi y) { return _mm512_mask_blend_epi32(_mm512_cmp_ps_mask(a, b, _CMP_LT_OQ), y, x); }
INLINE vi vi_select_nan(vf a, vi x, vi y) { return _mm512_mask_blend_epi32(_mm512_cmp_ps_mask(a, a, _CMP_UNORD_Q), y, x); }
INLINE vf vload_bf16(const uint16_t *p) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16));
}
INLINE vf vload_i8(const int8_t *p) { return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p))); }
INLINE vi vload_u8i(const uint8_t *p) { return _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)p)); } /* VW bytes */
INLINE vf vi_to_f(vi a) { return _mm512_cvtepi32_ps(a); }
/* the VW nibbles of VW / 2 bytes as floats, low nibble first: byte j -> lanes 2j (low), 2j + 1 (high) */
INLINE vf vload_nibbles(const uint8_t *p) {
    const __m128i dup = _mm_setr_epi8(0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7);
    const __m512i shift = _mm512_setr_epi32(0, 4, 0, 4, 0, 4, 0, 4, 0, 4, 0, 4, 0, 4, 0, 4);
    __m512i b = _mm512_cvtepu8_epi32(_mm_shuffle_epi8(_mm_loadl_epi64((const __m128i *)p), dup));
    return _mm512_cvtepi32_ps(_mm512_and_si512(_mm512_srlv_epi32(b, shift), _mm512_set1_epi32(15)));
}
INLINE vf vload_lut8(const uint8_t *p, const float *table) { /* table[p[j]] */
    return _mm512_i32gather_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)p)), table, 4);
}
INLINE void vstore_u16(uint16_t *p, vi a) { _mm256_storeu_si256((__m256i *)p, _mm512_cvtepi32_epi16(a)); }
INLINE void vstore_i8(int8_t *p, vi a) { _mm_storeu_si128((__m128i *)p, _mm512_cvtepi32_epi8(a)); }
INLINE void vstore_u8(uint8_t *p, vi a) { _mm_storeu_si128((__m128i *)p, _mm512_cvtepi32_epi8(a)); }
INLINE vf vdup_pairs(const float *p) { /* p[0] p[0] p[1] p[1] ... p[7] p[7] */
    const __m512i idx = _mm512_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7);
    return _mm512_permutexvar_ps(idx, _mm512_castps256_ps512(_mm256_loadu_ps(p)));
}
INLINE vf vswap_pairs(vf a) { return _mm512_permute_ps(a, 0xb1); }
#elif BST_ISA == 1
#define VW 8
typedef __m256 vf;
typedef __m256i vi;
INLINE vf vzero(void) { return _mm256_setzero_ps(); }
INLINE vf vset1(float a) { return _mm256_set1_ps(a); }
INLINE vf vloadu(const float *p) { return _mm256_loadu_ps(p); }
INLINE void vstoreu(float *p, vf a) { _mm256_storeu_ps(p, a); }
INLINE vf vadd(vf a, vf b) { return _mm256_add_ps(a, b); }
INLINE vf vsub(vf a, vf b) { return _mm256_sub_ps(a, b); }
INLINE vf vmul(vf a, vf b) { return _mm256_mul_ps(a, b); }
INLINE vf vdiv(vf a, vf b) { return _mm256_div_ps(a, b); }
INLINE vf vmax(vf a, vf b) { return _mm256_max_ps(a, b); }
INLINE vf vmin(vf a, vf b) { return _mm256_min_ps(a, b); }
INLINE vf vabs(vf a) { return _mm256_andnot_ps(_mm256_set1_ps(-0.f), a); }
INLINE vf vfmadd(vf a, vf b, vf c) { return _mm256_fmadd_ps(a, b, c); }
INLINE vf vfmsub(vf a, vf b, vf c) { return _mm256_fmsub_ps(a, b, c); }
INLINE vf vfnmadd(vf a, vf b, vf c) { return _mm256_fnmadd_ps(a, b, c); }
INLINE vf vfmaddsub(vf a, vf b, vf c) { return _mm256_fmaddsub_ps(a, b, c); }
INLINE float vsum(vf a) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}
INLINE vf vround(vf a) { return _mm256_round_ps(a, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
INLINE vf vselect_lt(vf a, vf b, vf x, vf y) { return _mm256_blendv_ps(y, x, _mm256_cmp_ps(a, b, _CMP_LT_OQ)); }
INLINE vi vcvt_i32(vf a) { return _mm256_cvtps_epi32(a); }
INLINE vi vf_as_i(vf a) { return _mm256_castps_si256(a); }
INLINE vf vi_as_f(vi a) { return _mm256_castsi256_ps(a); }
INLINE vi vi_set1(int a) { return _mm256_set1_epi32(a); }
INLINE vi vi_add(vi a, vi b) { return _mm256_add_epi32(a, b); }
INLINE vi vi_sub(vi a, vi b) { return _mm256_sub_epi32(a, b); }
INLINE vi vi_and(vi a, vi b) { return _mm256_and_si256(a, b); }
INLINE vi vi_or(vi a, vi b) { return _mm256_or_si256(a, b); }
#define vi_srli(a, n) _mm256_srli_epi32(a, n)
#define vi_slli(a, n) _mm256_slli_epi32(a, n)
INLINE vi vi_select_lt(vf a, vf b, vi x, vi y) {
    return _mm256_castps_si256(_mm256_blendv_ps(_mm256_castsi256_ps(y), _mm256_castsi256_ps(x), _mm256_cmp_ps(a, b, _CMP_LT_OQ)));
}
INLINE vi vi_select_nan(vf a, vi x, vi y) {
    return _mm256_castps_si256(_mm256_blendv_ps(_mm256_castsi256_ps(y), _mm256_castsi256_ps(x), _mm256_cmp_ps(a, a, _CMP_UNORD_Q)));
}
INLINE vf vload_bf16(const uint16_t *p) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p)), 16));
}
INLINE vf vload_i8(const int8_t *p) { return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p))); }
INLINE vi vload_u8i(const uint8_t *p) { return _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)p)); }
INLINE vf vi_to_f(vi a) { return _mm256_cvtepi32_ps(a); }
INLINE vf vload_nibbles(const uint8_t *p) {
    int32_t four;
    memcpy(&four, p, 4);
    const __m128i dup = _mm_setr_epi8(0, 0, 1, 1, 2, 2, 3, 3, -1, -1, -1, -1, -1, -1, -1, -1);
    __m256i b = _mm256_cvtepu8_epi32(_mm_shuffle_epi8(_mm_cvtsi32_si128(four), dup));
    b = _mm256_srlv_epi32(b, _mm256_setr_epi32(0, 4, 0, 4, 0, 4, 0, 4));
    return _mm256_cvtepi32_ps(_mm256_and_si256(b, _mm256_set1_epi32(15)));
}
INLINE vf vload_lut8(const uint8_t *p, const float *table) {
    return _mm256_i32gather_ps(table, _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)p)), 4);
}
INLINE __m128i vpack16(vi a) { /* 8 lanes in 0..65535 -> 8 uint16 */
    return _mm_packus_epi32(_mm256_castsi256_si128(a), _mm256_extracti128_si256(a, 1));
}
INLINE void vstore_u16(uint16_t *p, vi a) { _mm_storeu_si128((__m128i *)p, vpack16(a)); }
INLINE void vstore_i8(int8_t *p, vi a) { /* lanes in -128..127 */
    __m128i h = _mm_packs_epi32(_mm256_castsi256_si128(a), _mm256_extracti128_si256(a, 1));
    _mm_storel_epi64((__m128i *)p, _mm_packs_epi16(h, h));
}
INLINE void vstore_u8(uint8_t *p, vi a) { /* lanes in 0..255 */
    __m128i h = _mm_packs_epi32(_mm256_castsi256_si128(a), _mm256_extracti128_si256(a, 1));
    _mm_storel_epi64((__m128i *)p, _mm_packus_epi16(h, h));
}
INLINE vf vdup_pairs(const float *p) {
    return _mm256_permutevar8x32_ps(_mm256_castps128_ps256(_mm_loadu_ps(p)), _mm256_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3));
}
INLINE vf vswap_pairs(vf a) { return _mm256_permute_ps(a, 0xb1); }
#endif

#if BST_SIMD
/* VW elements of p (dtype dt: float, bfloat16 or int8) from element off, as floats */
INLINE vf vload_any(const void *p, int dt, int64_t off) {
    if (dt == DT_F32) return vloadu((const float *)p + off);
    if (dt == DT_BF16) return vload_bf16((const uint16_t *)p + off);
    return vload_i8((const int8_t *)p + off);
}

/* the first n < VW of them, zeros after */
INLINE vf vload_any_part(const void *p, int dt, int64_t off, int64_t n) {
#if BST_AVX512
    __mmask16 mask = (__mmask16)((1u << n) - 1);
    if (dt == DT_F32) return _mm512_maskz_loadu_ps(mask, (const float *)p + off);
    if (dt == DT_BF16)
        return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(mask, (const uint16_t *)p + off)), 16));
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_maskz_loadu_epi8(mask, (const int8_t *)p + off)));
#else
    float buf[VW] = {0.f};
    for (int64_t j = 0; j < n; j++) buf[j] = dt == DT_I8 ? (float)((const int8_t *)p)[off + j] : load_f(p, dt, off + j);
    return vloadu(buf);
#endif
}

/* the bfloat16 bit patterns of a (round to nearest even, NaN stays NaN), in the low 16 bits */
INLINE vi vbf16_bits(vf a) {
    vi u = vf_as_i(a);
    vi r = vi_srli(vi_add(u, vi_add(vi_set1(0x7fff), vi_and(vi_srli(u, 16), vi_set1(1)))), 16);
    return vi_select_nan(a, vi_or(vi_srli(u, 16), vi_set1(0x40)), r);
}

/* a rounded to bfloat16 (and back to float) */
INLINE vf vround_bf16(vf a) { return vi_as_f(vi_slli(vbf16_bits(a), 16)); }

/* VW floats / bfloat16 of p (dtype dt) from element off */
INLINE void vstore_any(void *p, int dt, int64_t off, vf a) {
    if (dt == DT_F32)
        vstoreu((float *)p + off, a);
    else
        vstore_u16((uint16_t *)p + off, vbf16_bits(a));
}

/* e^x, Cephes' single-precision polynomial (~1 ulp on [-87.3, 88.3]; clamped outside) */
INLINE vf vexp(vf x) {
    x = vmin(vmax(x, vset1(-87.33654f)), vset1(88.37626f));
    vf n = vround(vmul(x, vset1(1.44269504088896341f)));
    vf r = vfnmadd(n, vset1(0.693359375f), x);
    r = vfnmadd(n, vset1(-2.12194440e-4f), r);
    vf p = vset1(1.9875691500e-4f);
    p = vfmadd(p, r, vset1(1.3981999507e-3f));
    p = vfmadd(p, r, vset1(8.3334519073e-3f));
    p = vfmadd(p, r, vset1(4.1665795894e-2f));
    p = vfmadd(p, r, vset1(1.6666665459e-1f));
    p = vfmadd(p, r, vset1(5.0000001201e-1f));
    p = vfmadd(vmul(p, r), r, vadd(r, vset1(1.f)));
    return vmul(p, vi_as_f(vi_slli(vi_add(vcvt_i32(n), vi_set1(127)), 23)));
}
#endif

/* a [n] float32 copy of p (dtype dt) into dst */
static void to_f32(const void *p, int dt, int64_t n, float *dst) {
    if (dt == DT_F32) {
        memcpy(dst, p, (size_t)n * sizeof(float));
        return;
    }
    int64_t i = 0;
#if BST_SIMD
    for (; i + VW <= n; i += VW) vstoreu(dst + i, vload_bf16((const uint16_t *)p + i));
#endif
    for (; i < n; i++) dst[i] = bf16_to_f32(((const uint16_t *)p)[i]);
}

static void from_f32(const float *src, int64_t n, void *p, int dt) {
    if (dt == DT_F32) {
        memcpy(p, src, (size_t)n * sizeof(float));
        return;
    }
    int64_t i = 0;
#if BST_SIMD
    for (; i + VW <= n; i += VW) vstore_u16((uint16_t *)p + i, vbf16_bits(vloadu(src + i)));
#endif
    for (; i < n; i++) ((uint16_t *)p)[i] = f32_to_bf16(src[i]);
}

/* ---------------------------------------------------------------------------------------- */
/* linear: y[m, n] = sum_k x[m, k] W[n, k] (* scale[n]) + bias[n]                           */
/* ---------------------------------------------------------------------------------------- */

#define ROWS 8  /* most weight rows per tile (a single input row: 8 independent FMA chains) */
#define MT 4    /* most input rows per tile (each weight vector loaded once, used MT times) */
#define Q16_BLOCK 64 /* features per scale of the int16 inputs of the int8 x bf16 GEMV (q16, below) */

/* the input rows a tile reads: floats (xf [m, k]), or for the q16 path int16 codes (xq [m, k]) and
 * their block scales (xs [m, ceil(k / Q16_BLOCK)]) */
typedef struct {
    const float *xf;
    const int16_t *xq;
    const float *xs;
} tile_inputs;

/* the number of Q16_BLOCK-feature blocks (scales) of an input row of k features */
INLINE int64_t q16_blocks(int64_t k) { return (k + Q16_BLOCK - 1) / Q16_BLOCK; }

/* the same inputs from row i0 on */
INLINE tile_inputs inputs_at(tile_inputs in, int64_t i0, int64_t k) {
    tile_inputs at = {in.xf ? in.xf + i0 * k : NULL, in.xq ? in.xq + i0 * k : NULL,
                      in.xs ? in.xs + i0 * q16_blocks(k) : NULL};
    return at;
}

/* a tile: out[r][i] = sum_k W[row0 + r, k] x[i, k] for R rows and M inputs (unscaled) */
typedef void (*tile_fn)(tile_inputs in, int64_t k, const void *w, int wdt, int64_t row0, int R, int M,
                        float out[ROWS][MT]);

/* DT_I8T / DT_BF16T / DT_F32T: int8 / bfloat16 / float W [n, k] in tiles of TILE_ROWS rows
 * (n % 8 == 0, k % tile_k(dt) == 0): per tile, per block of tile_k(dt) features (32 bytes of int8,
 * 64 of bfloat16 or float), the 8 rows' blocks one after another. A tile's GEMV then reads one sequential
 * stream: the row-major layout interleaves 8 streams a row apart (half the bandwidth cache-cold),
 * the transposed one a stream per feature (~0.65x). */
#define TILE_ROWS 8
#define I8T_K 32
#define BF16T_K 32
#define F32T_K 16
INLINE int tiled_dt(int dt) { return dt == DT_I8T || dt == DT_BF16T || dt == DT_F32T; }
INLINE int64_t tile_k(int dt) { return dt == DT_BF16T ? BF16T_K : dt == DT_F32T ? F32T_K : I8T_K; }
/* the element type of a weight dtype (a tiled one's elements are int8 / bfloat16 / float) */
INLINE int elem_dt(int dt) { return dt == DT_I8T ? DT_I8 : dt == DT_BF16T ? DT_BF16 : dt == DT_F32T ? DT_F32 : dt; }
/* the element offset of W[row, kk] */
INLINE int64_t w_off(int dt, int64_t row, int64_t kk, int64_t k) {
    if (!tiled_dt(dt)) return row * k + kk;
    const int64_t tk = tile_k(dt);
    return row / TILE_ROWS * TILE_ROWS * k + kk / tk * (TILE_ROWS * tk) + row % TILE_ROWS * tk + kk % tk;
}

#if BST_SIMD
/* out[r][i] = dot(W row row0 + r, x row i) for R rows, M inputs (compile-time after inlining).
 * The weight stream of the row 64 features ahead is prefetched. */
INLINE void dense_block(const float *x, int64_t k, const void *w, int dt, int64_t row0, int R, int M,
                        float out[ROWS][MT]) {
    vf acc[ROWS][MT];
    for (int r = 0; r < R; r++)
        for (int i = 0; i < M; i++) acc[r][i] = vzero();
    int64_t kk = 0;
    const int ldt = elem_dt(dt);
    const int64_t esize = ldt == DT_F32 ? 4 : ldt == DT_BF16 ? 2 : 1, line = 64 / esize;
    for (; kk + VW <= k; kk += VW) {
        vf xv[MT];
        for (int i = 0; i < M; i++) xv[i] = vloadu(x + i * k + kk);
        if (tiled_dt(dt)) { /* one stream: 4 blocks ahead of this block's 8 rows */
            const int64_t tk = tile_k(dt), bytes = TILE_ROWS * tk * esize;
            if (kk % tk == 0) {
                const char *p = (const char *)w + w_off(dt, row0 / TILE_ROWS * TILE_ROWS, kk, k) * esize + 4 * bytes;
                for (int64_t b = 0; b < bytes; b += 64) _mm_prefetch(p + b, _MM_HINT_T0);
            }
        } else if (kk % line == 0) /* rows are short (a few cache lines): fetch the next tile's rows early */
            for (int r = 0; r < R; r++) _mm_prefetch((const char *)w + ((row0 + R + r) * k + kk) * esize, _MM_HINT_T0);
        for (int r = 0; r < R; r++) {
            vf wv = vload_any(w, ldt, w_off(dt, row0 + r, kk, k));
            for (int i = 0; i < M; i++) acc[r][i] = vfmadd(wv, xv[i], acc[r][i]);
        }
    }
    if (kk < k) { /* (DT_I8T: k % 32 == 0, never) */
        vf xv[MT];
        for (int i = 0; i < M; i++) xv[i] = vload_any_part(x, DT_F32, i * k + kk, k - kk);
        for (int r = 0; r < R; r++) {
            vf wv = vload_any_part(w, ldt, w_off(dt, row0 + r, kk, k), k - kk);
            for (int i = 0; i < M; i++) acc[r][i] = vfmadd(wv, xv[i], acc[r][i]);
        }
    }
    for (int r = 0; r < R; r++)
        for (int i = 0; i < M; i++) out[r][i] = vsum(acc[r][i]);
}
#endif

INLINE void dense_block_scalar(const float *x, int64_t k, const void *w, int dt, int64_t row0, int R, int M,
                               float out[ROWS][MT]) {
    for (int r = 0; r < R; r++)
        for (int i = 0; i < M; i++) {
            float s = 0.f;
            for (int64_t kk = 0; kk < k; kk++) {
                int64_t off = w_off(dt, row0 + r, kk, k);
                float wv = elem_dt(dt) == DT_I8 ? (float)((const int8_t *)w)[off] : load_f(w, elem_dt(dt), off);
                s += wv * x[i * k + kk];
            }
            out[r][i] = s;
        }
}

INLINE void dense_tile(tile_inputs in, int64_t k, const void *w, int dt, int64_t row0, int R, int M,
                       float out[ROWS][MT]) {
#if BST_SIMD
    dense_block(in.xf, k, w, dt, row0, R, M, out);
#else
    dense_block_scalar(in.xf, k, w, dt, row0, R, M, out);
#endif
}

/* The tile shapes (rows R x inputs M), each its own register-blocked loop per weight dtype:
 * 8 x 1, 4 x 2..4 (8 to 16 accumulators; AVX2, 16 registers: 2 x 3..4), and 1 x M for the
 * rows left at the end. */
#define TILE_SHAPES(FN, DT) \
    if (R == 8) FN(in, k, w, DT, row0, 8, 1, out); \
    else if (R == 4) { \
        if (M == 2) FN(in, k, w, DT, row0, 4, 2, out); \
        else if (M == 3) FN(in, k, w, DT, row0, 4, 3, out); \
        else FN(in, k, w, DT, row0, 4, 4, out); \
    } else if (R == 2) { \
        if (M == 3) FN(in, k, w, DT, row0, 2, 3, out); \
        else FN(in, k, w, DT, row0, 2, 4, out); \
    } else { \
        if (M == 1) FN(in, k, w, DT, row0, 1, 1, out); \
        else if (M == 2) FN(in, k, w, DT, row0, 1, 2, out); \
        else if (M == 3) FN(in, k, w, DT, row0, 1, 3, out); \
        else FN(in, k, w, DT, row0, 1, 4, out); \
    }

static void tile_any(tile_inputs in, int64_t k, const void *w, int wdt, int64_t row0, int R, int M,
                     float out[ROWS][MT]) {
    if (wdt == DT_F32) {
        TILE_SHAPES(dense_tile, DT_F32)
    } else if (wdt == DT_BF16) {
        TILE_SHAPES(dense_tile, DT_BF16)
    } else if (wdt == DT_I8) {
        TILE_SHAPES(dense_tile, DT_I8)
    } else if (wdt == DT_BF16T) {
        TILE_SHAPES(dense_tile, DT_BF16T)
    } else if (wdt == DT_F32T) {
        TILE_SHAPES(dense_tile, DT_F32T)
    } else {
        TILE_SHAPES(dense_tile, DT_I8T)
    }
}

/* Rows [r_begin, r_end) of y for all m inputs, ROWS rows at a time: every input against those rows
 * while they are in L1 (the weight streams once for any m), in tiles of R rows x M inputs, each
 * row's sum times scale[row] (if any) plus bias[row] (if any). */
static void dense_rows(tile_inputs in, int64_t m, int64_t k, const void *w, int wdt, tile_fn tile, const float *scale,
                       const float *bias, void *y, int ydt, int64_t n, int64_t r_begin, int64_t r_end) {
    float out[ROWS][MT];
    for (int64_t rows0 = r_begin; rows0 < r_end; rows0 += ROWS) {
        int64_t rows1 = rows0 + ROWS < r_end ? rows0 + ROWS : r_end;
        for (int64_t i0 = 0; i0 < m; i0 += MT) {
            int M = m - i0 >= MT ? MT : (int)(m - i0);
            int full = M == 1 ? 8 : (BST_ISA == 1 && M > 2) ? 2 : 4;
            const tile_inputs xi = inputs_at(in, i0, k);
            for (int64_t row0 = rows0; row0 < rows1;) {
                int R = rows1 - row0 >= full ? full : 1;
                tile(xi, k, w, wdt, row0, R, M, out);
                for (int r = 0; r < R; r++)
                    for (int i = 0; i < M; i++) {
                        float v = out[r][i];
                        if (scale) v *= scale[row0 + r];
                        if (bias) v += bias[row0 + r];
                        store_f(y, ydt, (i0 + i) * n + row0 + r, v);
                    }
                row0 += R;
            }
        }
    }
}

/* int8 weights (I8 with k % 32 == 0, I8T) x bfloat16 inputs in 16-bit integers (q16, BST_ISA >= 1).
 * Each input row is read per block of Q16_BLOCK features (the last one may be 32) as x = q 2^(e - 15),
 * q int16, with 2^(e - 1) <= max |x| < 2^e over the block. A bfloat16 x has an 8-bit significand, so
 * every x of the block with |x| >= 2^(e - 8) is exact; smaller ones are rounded to a multiple of
 * 2^(e - 15), an error of at most max |x| 2^-15 (bfloat16 itself keeps 2^-9 of each value).
 * A block's products are summed exactly in int32 (|q W| < 2^22, 64 of them; vpmaddwd, or vpdpwssd
 * with AVX512_VNNI: 32 multiply-adds an instruction, against 16 of a float FMA that first has to widen
 * and convert each code), and each block's sum joins the float32 accumulator times its 2^(e - 15):
 *     y[i, r] = scale[r] sum_blocks 2^(e_b - 15) sum_{k in b} W[r, k] q[i, k]   (+ bias[r])
 * Every row of y is summed in the same order whatever the batch (batch-invariant, as the float paths).
 * A block holding a NaN or an infinity gets a NaN scale, so its rows come out NaN. */
INLINE int q16_fits(int wdt, int xdt, int64_t k) {
    return BST_SIMD && xdt == DT_BF16 && ((wdt == DT_I8 && k % 32 == 0) || wdt == DT_I8T);
}

#if BST_SIMD
/* x [m, k] floats -> q [m, k] int16 and the block scales xs [m, ceil(k / Q16_BLOCK)] (k % 32 == 0) */
static void q16_inputs(const float *xf, int64_t m, int64_t k, int16_t *q, float *xs) {
    const int64_t nb = q16_blocks(k);
    for (int64_t i = 0; i < m; i++)
        for (int64_t b = 0; b < nb; b++) {
            const float *x = xf + i * k + b * Q16_BLOCK;
            int16_t *qb = q + i * k + b * Q16_BLOCK;
            const int64_t len = k - b * Q16_BLOCK < Q16_BLOCK ? k - b * Q16_BLOCK : Q16_BLOCK;
            vf mx = vzero(), bad = vzero(); /* bad: x * 0 summed, NaN once a NaN or an infinity was seen */
            for (int64_t j = 0; j < len; j += VW) {
                vf v = vloadu(x + j);
                mx = vmax(mx, vabs(v));
                bad = vadd(bad, vmul(v, vzero()));
            }
            float lanes[VW], amax = 0.f;
            vstoreu(lanes, mx);
            for (int j = 0; j < VW; j++) amax = lanes[j] > amax ? lanes[j] : amax;
            if (vsum(bad) != 0.f) amax = NAN;
            int e = 0;
            if (amax > 0.f && amax < INFINITY) frexpf(amax, &e);
            if (!(amax < INFINITY) || amax == 0.f || e < -100) { /* NaN / inf: a NaN row; zero (or below 2^-100): 0 */
                memset(qb, 0, sizeof(int16_t) * (size_t)len);
                xs[i * nb + b] = amax == amax && amax < INFINITY ? 0.f : NAN;
                continue;
            }
            xs[i * nb + b] = ldexpf(1.f, e - 15);
            const vf inv = vset1(ldexpf(1.f, 15 - e));
            for (int64_t j = 0; j < len; j += VW) {
#if BST_AVX512
                _mm256_storeu_si256((__m256i *)(qb + j), _mm512_cvtsepi32_epi16(vcvt_i32(vround(vmul(vloadu(x + j), inv)))));
#else
                __m256i v = vcvt_i32(vround(vmul(vloadu(x + j), inv)));
                _mm_storeu_si128((__m128i *)(qb + j), _mm_packs_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1)));
#endif
            }
        }
}

/* sum_{j < 32 c} W[j] q[j] in int32 lanes, for c = 1 or 2 runs of 32 codes (w0, w1) and 32 q each */
typedef vi q16v; /* 16-bit lanes in, int32 lanes out of the dot products */
#if BST_AVX512
INLINE q16v q16_w(const int8_t *w) { return _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i *)w)); }
INLINE q16v q16_x(const int16_t *q) { return _mm512_loadu_si512((const void *)q); }
INLINE q16v q16_dot(q16v w, q16v x) { return _mm512_madd_epi16(w, x); }
#if defined(__AVX512VNNI__)
INLINE q16v q16_dot_add(q16v acc, q16v w, q16v x) { return _mm512_dpwssd_epi32(acc, w, x); }
#else
INLINE q16v q16_dot_add(q16v acc, q16v w, q16v x) { return _mm512_add_epi32(acc, _mm512_madd_epi16(w, x)); }
#endif
#define Q16_PER 1 /* vectors per 32 codes */
#else
INLINE q16v q16_w(const int8_t *w) { return _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)w)); }
INLINE q16v q16_x(const int16_t *q) { return _mm256_loadu_si256((const __m256i *)q); }
INLINE q16v q16_dot(q16v w, q16v x) { return _mm256_madd_epi16(w, x); }
INLINE q16v q16_dot_add(q16v acc, q16v w, q16v x) { return _mm256_add_epi32(acc, _mm256_madd_epi16(w, x)); }
#define Q16_PER 2
#endif

/* acc[r][i] += 2^(e_b - 15) sum_{k in block b} W[row0 + r, k] q[i, k] for the block at kk (RUNS 32-code
 * runs: 2, or 1 for a last block of 32); R, M and RUNS are compile-time after inlining */
INLINE void q16_step(const int16_t *xq, const float *xs, int64_t k, int64_t nb, const int8_t *w, int dt,
                     int64_t row0, int R, int M, int64_t b, int RUNS, vf acc[ROWS][MT]) {
    const int64_t kk = b * Q16_BLOCK;
    q16v xv[MT][2 * Q16_PER];
    vf sb[MT];
    for (int i = 0; i < M; i++) {
        for (int v = 0; v < RUNS * Q16_PER; v++) xv[i][v] = q16_x(xq + i * k + kk + v * (32 / Q16_PER));
        sb[i] = vset1(xs[i * nb + b]);
    }
    for (int r = 0; r < R; r++) {
        q16v wv[2 * Q16_PER];
        for (int c = 0; c < RUNS; c++) {
            const int8_t *wr = w + w_off(dt, row0 + r, kk + 32 * c, k);
            for (int v = 0; v < Q16_PER; v++) wv[c * Q16_PER + v] = q16_w(wr + v * (32 / Q16_PER));
        }
        for (int i = 0; i < M; i++) {
            q16v s = q16_dot(wv[0], xv[i][0]);
            for (int v = 1; v < RUNS * Q16_PER; v++) s = q16_dot_add(s, wv[v], xv[i][v]);
            acc[r][i] = vfmadd(vi_to_f(s), sb[i], acc[r][i]);
        }
    }
}

/* out[r][i] = sum_k W[row0 + r, k] x[i, k] / scale for R rows, M inputs (compile-time after inlining) */
INLINE void q16_block(tile_inputs in, int64_t k, const int8_t *w, int dt, int64_t row0, int R, int M,
                      float out[ROWS][MT]) {
    const int16_t *xq = in.xq;
    const float *xs = in.xs;
    const int64_t nb = q16_blocks(k), whole = k / Q16_BLOCK;
    vf acc[ROWS][MT];
    for (int r = 0; r < R; r++)
        for (int i = 0; i < M; i++) acc[r][i] = vzero();
    for (int64_t b = 0; b < whole; b++) q16_step(xq, xs, k, nb, w, dt, row0, R, M, b, 2, acc);
    if (whole < nb) q16_step(xq, xs, k, nb, w, dt, row0, R, M, whole, 1, acc); /* the last 32 features */
    for (int r = 0; r < R; r++)
        for (int i = 0; i < M; i++) out[r][i] = vsum(acc[r][i]);
}

static void q16_any(tile_inputs in, int64_t k, const void *w, int wdt, int64_t row0, int R, int M,
                    float out[ROWS][MT]) {
    if (wdt == DT_I8T) {
        TILE_SHAPES(q16_block, DT_I8T)
    } else {
        TILE_SHAPES(q16_block, DT_I8)
    }
}
#endif

#if BST_BF16DOT
/* The lane sums of 16 vectors v[0..15] in one shuffle tree (45 instructions against ~8 for each
 * _mm512_reduce_add_ps): lane SUM16_LANE(j) of sum16v = sum of v[j]'s lanes. Each sum pairs its lanes as
 * _mm512_reduce_add_ps does (i + 8, then + 4, + 2, + 1), so it is the same float. */
#define SUM16_LANE(j) (4 * ((j) % 4) + (j) / 4)
/* permutexvar indices back to key order: lane i <- sum16v's lane SUM16_LANE(i) */
#define SUM16_KEY_ORDER _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15)
INLINE __m512 sum16v(const __m512 *v) {
    __m512 w[8], x[4], y[2];
    for (int p = 0; p < 8; p++) /* quarters [v2p: Q0+Q2, Q1+Q3 | v2p+1: Q0+Q2, Q1+Q3] */
        w[p] = _mm512_add_ps(_mm512_shuffle_f32x4(v[2 * p], v[2 * p + 1], 0x44),
                             _mm512_shuffle_f32x4(v[2 * p], v[2 * p + 1], 0xEE));
    for (int p = 0; p < 4; p++) /* quarter q: 4 lanes of v[4p + q] (lanes i + 8 + 4 folded) */
        x[p] = _mm512_add_ps(_mm512_shuffle_f32x4(w[2 * p], w[2 * p + 1], 0x88),
                             _mm512_shuffle_f32x4(w[2 * p], w[2 * p + 1], 0xDD));
    for (int p = 0; p < 2; p++) /* quarter q: [a0 + a2, b0 + b2, a1 + a3, b1 + b3], a = v[8p + q], b = v[8p + 4 + q] */
        y[p] = _mm512_add_ps(_mm512_unpacklo_ps(x[2 * p], x[2 * p + 1]), _mm512_unpackhi_ps(x[2 * p], x[2 * p + 1]));
    /* quarter q: the sums of v[q], v[4 + q], v[8 + q], v[12 + q] */
    return _mm512_add_ps(_mm512_shuffle_ps(y[0], y[1], _MM_SHUFFLE(1, 0, 1, 0)),
                         _mm512_shuffle_ps(y[0], y[1], _MM_SHUFFLE(3, 2, 3, 2)));
}

/* DT_BF16T rows row0 .. row0 + R of one tile (R <= 8) x M bfloat16 inputs as pairs (x2 [M, kh],
 * bst_linear): per block of 32 features a row's 64 bytes and an input's 16 pairs make one
 * vdpbf16ps; out[r][i] = the sum of row r's lanes. A row's sum has the same order for any M. */
INLINE void bf16t_block_acc(const uint32_t *x2, int64_t kh, int64_t k, const uint16_t *w, int64_t row0, int R, int M,
                            __m512 acc[ROWS][MT]) {
    for (int r = 0; r < R; r++)
        for (int i = 0; i < M; i++) acc[r][i] = _mm512_setzero_ps();
    const uint16_t *tile = w + row0 / TILE_ROWS * TILE_ROWS * k + row0 % TILE_ROWS * BF16T_K;
    for (int64_t kk = 0; kk < k; kk += BF16T_K) {
        /* this block's first row (w_off); no software prefetch: 4 or 8 blocks ahead measured 20-30%
         * slower cache-cold than the hardware prefetcher alone on this one stream */
        const uint16_t *blk = tile + kk * TILE_ROWS;
        __m512bh xv[MT];
        for (int i = 0; i < M; i++) xv[i] = (__m512bh)_mm512_loadu_si512(x2 + i * kh + kk / 2);
        for (int r = 0; r < R; r++) {
            __m512bh wv = (__m512bh)_mm512_loadu_si512(blk + r * BF16T_K);
            for (int i = 0; i < M; i++) acc[r][i] = _mm512_dpbf16_ps(acc[r][i], wv, xv[i]);
        }
    }
}

/* 4 rows x 4 inputs: the 16 sums in sum16v's lanes (lane 4 i + r) */
INLINE __m512 bf16t_dot_4x4(const uint32_t *x2, int64_t kh, int64_t k, const uint16_t *w, int64_t row0) {
    __m512 acc[ROWS][MT], v[16];
    bf16t_block_acc(x2, kh, k, w, row0, 4, 4, acc);
    for (int r = 0; r < 4; r++)
        for (int i = 0; i < 4; i++) v[r * 4 + i] = acc[r][i];
    return sum16v(v);
}

/* out[r][i] = row r0 + r's sum for input i (R rows x M inputs) */
INLINE void bf16t_block_dot(const uint32_t *x2, int64_t kh, int64_t k, const uint16_t *w, int64_t row0, int R, int M,
                            float out[ROWS][MT]) {
    __m512 acc[ROWS][MT];
    bf16t_block_acc(x2, kh, k, w, row0, R, M, acc);
    for (int r = 0; r < R; r++)
        for (int i = 0; i < M; i++) out[r][i] = _mm512_reduce_add_ps(acc[r][i]);
}

/* y rows [r0, r0 + 4) of inputs [i0, i0 + 4) from 16 sums in sum16v's lanes (lane 4 i + r: input i,
 * row r), + bias: per input one store of 4 floats or 4 bfloat16 (rounded as store_f rounds). */
INLINE void store_4x4(void *y, int ydt, int64_t n, int64_t i0, int64_t r0, __m512 sv, const float *bias) {
    sv = _mm512_add_ps(sv, bias ? _mm512_broadcast_f32x4(_mm_loadu_ps(bias + r0)) : _mm512_setzero_ps());
    if (ydt == DT_F32) {
        float *yf = (float *)y + i0 * n + r0;
        _mm_storeu_ps(yf, _mm512_extractf32x4_ps(sv, 0));
        _mm_storeu_ps(yf + n, _mm512_extractf32x4_ps(sv, 1));
        _mm_storeu_ps(yf + 2 * n, _mm512_extractf32x4_ps(sv, 2));
        _mm_storeu_ps(yf + 3 * n, _mm512_extractf32x4_ps(sv, 3));
    } else {
        __m256i b = _mm512_cvtepi32_epi16(vbf16_bits(sv));
        __m128i lo = _mm256_castsi256_si128(b), hi = _mm256_extracti128_si256(b, 1);
        uint16_t *yb = (uint16_t *)y + i0 * n + r0;
        _mm_storel_epi64((__m128i *)yb, lo);
        _mm_storeh_pd((double *)(yb + n), _mm_castsi128_pd(lo));
        _mm_storel_epi64((__m128i *)(yb + 2 * n), hi);
        _mm_storeh_pd((double *)(yb + 3 * n), _mm_castsi128_pd(hi));
    }
}

/* 8 rows x 2 inputs: the 16 sums in one shuffle tree (v[2 r + i]: row r, input i), permuted to
 * [input][row] lanes, then each input's 8 rows stored at once with bias */
INLINE void bf16t_dot_8x2_store(const uint32_t *x2, int64_t kh, int64_t k, const uint16_t *w, int64_t row0,
                                void *y, int ydt, int64_t n, int64_t i0, const float *bias) {
    __m512 acc[ROWS][MT], v[16];
    bf16t_block_acc(x2, kh, k, w, row0, 8, 2, acc);
    for (int r = 0; r < 8; r++)
        for (int i = 0; i < 2; i++) v[r * 2 + i] = acc[r][i];
    const __m512i perm = _mm512_setr_epi32(0, 8, 1, 9, 2, 10, 3, 11, 4, 12, 5, 13, 6, 14, 7, 15); /* SUM16_LANE(2 r + i) */
    __m512 sv = _mm512_permutexvar_ps(perm, sum16v(v)); /* lane 8 i + r */
    __m256 b8 = bias ? _mm256_loadu_ps(bias + row0) : _mm256_setzero_ps();
    __m512 b = _mm512_castps256_ps512(b8);
    sv = _mm512_add_ps(sv, _mm512_shuffle_f32x4(b, b, 0x44));
    if (ydt == DT_F32) {
        _mm256_storeu_ps((float *)y + i0 * n + row0, _mm512_castps512_ps256(sv));
        _mm256_storeu_ps((float *)y + (i0 + 1) * n + row0, _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(sv), 1)));
    } else {
        __m256i h = _mm512_cvtepi32_epi16(vbf16_bits(sv));
        _mm_storeu_si128((__m128i *)((uint16_t *)y + i0 * n + row0), _mm256_castsi256_si128(h));
        _mm_storeu_si128((__m128i *)((uint16_t *)y + (i0 + 1) * n + row0), _mm256_extracti128_si256(h, 1));
    }
}

/* DT_BF16T rows [r_begin, r_end) (whole tiles) of y for m bfloat16 inputs (x2 [m, kh]): tile by
 * tile, every input against a tile while it is in L1 (the weight streams once for any m). */
static void bf16t_rows(const uint32_t *x2, int64_t m, int64_t k, const uint16_t *w, const float *bias, void *y,
                       int ydt, int64_t n, int64_t r_begin, int64_t r_end) {
    const int64_t kh = k / 2;
    float out[ROWS][MT];
    for (int64_t row0 = r_begin; row0 < r_end; row0 += TILE_ROWS) {
        for (int64_t i0 = 0; i0 < m; i0 += MT) {
            int M = m - i0 >= MT ? MT : (int)(m - i0);
            const uint32_t *xi = x2 + i0 * kh;
            for (int half = 0; half < (M == MT ? 2 : 1); half++) { /* 4 inputs: 4 rows at a time (16 sums) */
                int R = M == MT ? 4 : 8;
                int64_t r0 = row0 + half * 4;
                if (M == 4) { /* 16 sums in sum16v's order, stored 4 at a time */
                    store_4x4(y, ydt, n, i0, r0, bf16t_dot_4x4(xi, kh, k, w, r0), bias);
                    continue;
                }
                if (M == 2) { /* 8 rows of each input stored at once (1 input: memory-bound, the loop below) */
                    bf16t_dot_8x2_store(xi, kh, k, w, r0, y, ydt, n, i0, bias);
                    continue;
                }
                if (M == 1) bf16t_block_dot(xi, kh, k, w, r0, 8, 1, out);
                else bf16t_block_dot(xi, kh, k, w, r0, 8, 3, out);
                for (int r = 0; r < R; r++)
                    for (int i = 0; i < M; i++)
                        store_f(y, ydt, (i0 + i) * n + r0 + r, out[r][i] + (bias ? bias[r0 + r] : 0.f));
            }
        }
    }
}
#endif

/* int4: W[row, k] = q * s - s * z for the nibble q of feature k (byte k / 2, low nibble = even
 * k) and the scales of its group (group % 32 == 0). Per block of I4B = 2 VW features, VW bytes:
 * the input is permuted once per call so that a block reads [VW even k..., VW odd k...] (xp),
 * which matches [low nibbles, high nibbles] of its VW bytes. */
#if BST_SIMD
#define I4B (2 * VW)
#else
#define I4B 1
#endif
INLINE float int4_weight(const uint8_t *wr, const float *sr, const float *szr, int64_t kk, int64_t group) {
    uint8_t byte = wr[kk / 2];
    float q = (float)((kk & 1) ? byte >> 4 : byte & 15);
    return q * sr[kk / group] - szr[kk / group];
}

#if BST_AVX512
/* res[r][i] += sum over the 32-blocks of k < kb of W[row0 + r, k] x[i, k] for R rows and M
 * inputs (constants after inlining); low and high nibbles accumulate apart (2 R M independent
 * FMA chains). */
INLINE void int4_tile(const float *xp, int64_t m_stride, int64_t k, int64_t kb, const uint8_t *w, const float *s,
                      const float *sz, int64_t group, int64_t row0, int R, int M, float res[4][MT]) {
    const int64_t groups = (k + group - 1) / group;
    const __m128i low4 = _mm_set1_epi8(0x0f);
    const __m512 iota = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    __m512 acc[4][MT][2], lut[4];
    for (int r = 0; r < R; r++) {
        lut[r] = _mm512_setzero_ps();
        for (int i = 0; i < M; i++) acc[r][i][0] = acc[r][i][1] = _mm512_setzero_ps();
    }
    for (int64_t kk = 0; kk < kb; kk += 32) {
        __m512 xlo[MT], xhi[MT];
        for (int i = 0; i < M; i++) {
            xlo[i] = _mm512_loadu_ps(xp + i * m_stride + kk);
            xhi[i] = _mm512_loadu_ps(xp + i * m_stride + kk + 16);
        }
        for (int r = 0; r < R; r++) {
            const uint8_t *wr = w + (row0 + r) * (k / 2);
            if (kk % group == 0) { /* a new group: its table lut[q] = q * s - s * z */
                int64_t g = (row0 + r) * groups + kk / group;
                lut[r] = _mm512_fmsub_ps(iota, _mm512_set1_ps(s[g]), _mm512_set1_ps(sz[g]));
            }
            if (kk % 128 == 0) /* a row is a few cache lines: fetch the next tile's early */
                _mm_prefetch((const char *)(wr + R * (k / 2) + kk / 2), _MM_HINT_T0);
            __m128i b = _mm_loadu_si128((const __m128i *)(wr + kk / 2));
            __m512 lo = _mm512_permutexvar_ps(_mm512_cvtepu8_epi32(_mm_and_si128(b, low4)), lut[r]);
            __m512 hi = _mm512_permutexvar_ps(_mm512_cvtepu8_epi32(_mm_and_si128(_mm_srli_epi16(b, 4), low4)), lut[r]);
            for (int i = 0; i < M; i++) {
                acc[r][i][0] = _mm512_fmadd_ps(lo, xlo[i], acc[r][i][0]);
                acc[r][i][1] = _mm512_fmadd_ps(hi, xhi[i], acc[r][i][1]);
            }
        }
    }
    for (int r = 0; r < R; r++)
        for (int i = 0; i < M; i++) res[r][i] = _mm512_reduce_add_ps(_mm512_add_ps(acc[r][i][0], acc[r][i][1]));
}
#elif BST_ISA == 1
/* AVX2 (no 16-entry table permute): res[r][i] = sum over the groups g below kb of
 * s_g sum_{k in g} q_k x_k, the codes converted to floats (one 8-byte load gives the 16 codes
 * of a block: low nibbles even k, high nibbles odd k). The zero-point term
 * - sum_g (s z)_g sum_{k in g} x_k is int4_rows' (xsum). 2 R M independent FMA chains. */
INLINE void int4_tile(const float *xp, int64_t m_stride, int64_t k, int64_t kb, const uint8_t *w, const float *s,
                      const float *sz, int64_t group, int64_t row0, int R, int M, float res[4][MT]) {
    const int64_t groups = (k + group - 1) / group;
    const __m256i low4 = _mm256_set1_epi32(15);
    vf tot[4][MT];
    (void)sz;
    for (int r = 0; r < R; r++)
        for (int i = 0; i < M; i++) tot[r][i] = vzero();
    for (int64_t g0 = 0; g0 < kb; g0 += group) {
        int64_t g1 = g0 + group < kb ? g0 + group : kb;
        vf acc[4][MT][2];
        for (int r = 0; r < R; r++)
            for (int i = 0; i < M; i++) acc[r][i][0] = acc[r][i][1] = vzero();
        for (int64_t kk = g0; kk < g1; kk += I4B) {
            vf xe[MT], xo[MT];
            for (int i = 0; i < M; i++) {
                xe[i] = vloadu(xp + i * m_stride + kk);
                xo[i] = vloadu(xp + i * m_stride + kk + VW);
            }
            if (kk % 128 == 0) /* a row is a few cache lines: fetch the next tile's early */
                for (int r = 0; r < R; r++) _mm_prefetch((const char *)(w + (row0 + R + r) * (k / 2) + kk / 2), _MM_HINT_T0);
            for (int r = 0; r < R; r++) {
                const uint8_t *wr = w + (row0 + r) * (k / 2);
                __m256i b = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(wr + kk / 2)));
                vf lo = _mm256_cvtepi32_ps(_mm256_and_si256(b, low4)), hi = _mm256_cvtepi32_ps(_mm256_srli_epi32(b, 4));
                for (int i = 0; i < M; i++) {
                    acc[r][i][0] = vfmadd(lo, xe[i], acc[r][i][0]);
                    acc[r][i][1] = vfmadd(hi, xo[i], acc[r][i][1]);
                }
            }
        }
        for (int r = 0; r < R; r++) {
            vf sv = vset1(s[(row0 + r) * groups + g0 / group]);
            for (int i = 0; i < M; i++) tot[r][i] = vfmadd(vadd(acc[r][i][0], acc[r][i][1]), sv, tot[r][i]);
        }
    }
    for (int r = 0; r < R; r++)
        for (int i = 0; i < M; i++) res[r][i] = vsum(tot[r][i]);
}
#endif

/* int4 rows [r_begin, r_end) of y for all m inputs: tiles of 4 rows x 1 input or 1 row x up
 * to 4 inputs, then the features past the last I4B-block one by one. xsum [m, groups]: the
 * sums of x over each group's features below kb (AVX2's zero-point term; NULL otherwise). */
static void int4_rows(const float *xf, const float *xp, const float *xsum, int64_t m, int64_t k, const uint8_t *w,
                      const float *s, const float *sz, int64_t group, const float *bias, void *y, int ydt, int64_t n,
                      int64_t r_begin, int64_t r_end) {
    int64_t groups = (k + group - 1) / group, kb = BST_SIMD ? k / I4B * I4B : 0;
    (void)xp;
    for (int64_t i0 = 0; i0 < m; i0 += MT) {
        int M = m - i0 >= MT ? MT : (int)(m - i0);
        for (int64_t row0 = r_begin; row0 < r_end;) {
            int R = M == 1 && r_end - row0 >= 4 ? 4 : 1;
            float res[4][MT] = {{0.f}};
#if BST_SIMD
            const float *xi = xp + i0 * k;
            if (R == 4) int4_tile(xi, k, k, kb, w, s, sz, group, row0, 4, 1, res);
            else if (M == 1) int4_tile(xi, k, k, kb, w, s, sz, group, row0, 1, 1, res);
            else if (M == 2) int4_tile(xi, k, k, kb, w, s, sz, group, row0, 1, 2, res);
            else if (M == 3) int4_tile(xi, k, k, kb, w, s, sz, group, row0, 1, 3, res);
            else int4_tile(xi, k, k, kb, w, s, sz, group, row0, 1, 4, res);
#endif
            for (int r = 0; r < R; r++) {
                const uint8_t *wr = w + (row0 + r) * (k / 2);
                const float *sr = s + (row0 + r) * groups, *szr = sz + (row0 + r) * groups;
                for (int i = 0; i < M; i++) {
                    const float *xr = xf + (i0 + i) * k;
                    float v = res[r][i];
                    if (xsum)
                        for (int64_t g = 0; g < groups; g++) v -= szr[g] * xsum[(i0 + i) * groups + g];
                    for (int64_t kk = kb; kk < k; kk++) v += int4_weight(wr, sr, szr, kk, group) * xr[kk];
                    store_f(y, ydt, (i0 + i) * n + row0 + r, v + (bias ? bias[row0 + r] : 0.f));
                }
            }
            row0 += R;
        }
    }
}

/* int4 in the dot layout (DT_I4D; only the vdpbf16ps build packs it, k % 64 == 0): per row,
 * blocks of 64 features in 32 bytes, byte j of block b = code(64 b + j) | code(64 b + 32 + j) << 4,
 * so each nibble plane is 32 consecutive features and pairs with 32 consecutive inputs. Rows are
 * held in tiles of I4D_ROWS (the last one n % 4 rows): per tile, block by block, the rows' 32
 * bytes one after another (i4d_off), so a 4-row tile's GEMV reads one sequential stream; s and
 * sz = s * zero as for DT_I4. With bfloat16 inputs a code q becomes the bfloat16 16 + q (bits
 * 0x4180 | q << 3: exact), one vdpbf16ps per 32-feature chunk multiplies the pairs exactly and
 * sums them in float32, and
 *     W x = sum_g s_g sum_{k in g} x_k (16 + q_k) - (16 s_g + sz_g) sum_{k in g} x_k.
 * float32 inputs take the FMA path on the same layout: sum_g s_g sum_{k in g} x_k q_k - sz_g xsum_g.
 * cg[c]: the group of chunk c (features 32 c .. 32 c + 31). */
#define I4D_ROWS 4
/* where block `block` (of `unit` elements) of row `row` is in an [n, width] array held in tiles of
 * I4D_ROWS rows (the last one n % 4): per tile, block by block, the rows' blocks in turn */
INLINE int64_t i4d_tiled(int64_t row, int64_t block, int64_t width, int64_t unit, int64_t n) {
    int64_t t0 = row / I4D_ROWS * I4D_ROWS, rows = n - t0 < I4D_ROWS ? n - t0 : I4D_ROWS;
    return t0 * width + block * rows * unit + (row - t0) * unit;
}

/* the byte offset of row `row`'s 32 bytes of block kk / 64 in a DT_I4D weight [n, k / 2] */
INLINE int64_t i4d_off(int64_t row, int64_t kk, int64_t k, int64_t n) { return i4d_tiled(row, kk / 64, k / 2, 32, n); }

/* the index of row `row`'s group g in DT_I4D scales (s, sz) [n, groups], tiled as the codes */
INLINE int64_t i4d_soff(int64_t row, int64_t g, int64_t groups, int64_t n) { return i4d_tiled(row, g, groups, 1, n); }

#if BST_BF16DOT
/* one row (of the short last tile) x M bfloat16 inputs: the row's 32 bytes of a block widened to
 * 16-bit words, each nibble plane made the bfloat16 16 + q, one vdpbf16ps per 32-feature chunk,
 * times the chunk's group scale */
INLINE void int4d_row_bf16(const uint16_t *x, int64_t k, int64_t n, const uint8_t *w, const float *s,
                           int64_t groups, const int32_t *cg, int64_t row, int M, float res[4][MT]) {
    const __m512i one6 = _mm512_set1_epi16(0x4180), code = _mm512_set1_epi16(0x0078);
    __m512 tot[MT][2];
    for (int i = 0; i < M; i++) tot[i][0] = tot[i][1] = _mm512_setzero_ps();
    for (int64_t kk = 0; kk < k; kk += 64) {
        const int32_t *g = cg + kk / 32;
        const uint8_t *wr = w + i4d_off(row, kk, k, n);
        __m512i b = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)wr)); /* [32] u16 */
        /* (b << 3 & 0x78) | 0x4180: the bfloat16 16 + q of each low nibble; >> 1: the high ones */
        __m512i q0 = _mm512_ternarylogic_epi32(_mm512_slli_epi16(b, 3), code, one6, 0xEA);
        __m512i q1 = _mm512_ternarylogic_epi32(_mm512_srli_epi16(b, 1), code, one6, 0xEA);
        __m512 s0 = _mm512_set1_ps(s[i4d_soff(row, g[0], groups, n)]);
        __m512 s1 = _mm512_set1_ps(s[i4d_soff(row, g[1], groups, n)]);
        for (int i = 0; i < M; i++) {
            __m512 d0 = _mm512_dpbf16_ps(_mm512_setzero_ps(), (__m512bh)q0, (__m512bh)_mm512_loadu_si512(x + i * k + kk));
            __m512 d1 = _mm512_dpbf16_ps(_mm512_setzero_ps(), (__m512bh)q1, (__m512bh)_mm512_loadu_si512(x + i * k + kk + 32));
            tot[i][0] = _mm512_fmadd_ps(d0, s0, tot[i][0]);
            tot[i][1] = _mm512_fmadd_ps(d1, s1, tot[i][1]);
        }
    }
    for (int i = 0; i < M; i++) res[0][i] = _mm512_reduce_add_ps(_mm512_add_ps(tot[i][0], tot[i][1]));
}

/* x (one bfloat16 input row) as int4d_tile4_bf16 reads it: per 64-feature block b, 4 vectors of
 * 16 pairs, lanes 8-15 repeating lanes 0-7: (x[4l], x[4l + 2]), (x[32 + 4l], x[32 + 4l + 2]),
 * (x[4l + 1], x[4l + 3]), (x[32 + 4l + 1], x[32 + 4l + 3]) of the block, l = 0..7. */
static uint32_t *int4d_pairs(const uint16_t *x, int64_t k) {
    uint32_t *xq = (uint32_t *)aligned_alloc(64, sizeof(uint32_t) * (size_t)(k / 64 * 64));
    for (int64_t b = 0; b < k / 64; b++)
        for (int v = 0; v < 4; v++)
            for (int l = 0; l < 16; l++) {
                const uint16_t *xb = x + 64 * b + (v & 1) * 32 + (v >> 1) + 4 * (l % 8);
                xq[(b * 4 + v) * 16 + l] = xb[0] | (uint32_t)xb[2] << 16;
            }
    return xq;
}

INLINE float hsum8(__m256 a) {
    __m128 h = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    h = _mm_add_ps(h, _mm_movehl_ps(h, h));
    return _mm_cvtss_f32(_mm_add_ss(h, _mm_movehdup_ps(h)));
}

/* 4 rows (a whole tile) x NI (1 or 2) bfloat16 inputs (columns i0.. of res): one 64-byte load
 * holds two rows' 32 bytes of a block; its 16-bit word w = code(2w) | code(32 + 2w) << 4 |
 * code(2w + 1) << 8 | code(33 + 2w) << 12 of the row, so the four nibble planes, each made the
 * bfloat16 16 + q as in int4d_row_bf16, pair with the four vectors of int4d_pairs, the low 8
 * lanes for one row and the high 8 for the other, without widening; the planes are made once for
 * the NI inputs. Per row pair and input, each plane has its own vdpbf16ps chain (the same sums
 * for any NI: batch-invariant); a chunk's sums are kept until its group ends (one scale multiply
 * per group). */
INLINE void int4d_tile4_bf16(uint32_t *const *xq, int NI, int64_t k, int64_t n, const uint8_t *w, const float *s,
                             int64_t groups, const int32_t *cg, int64_t row0, float res[4][MT], int i0) {
    const __m512i one6 = _mm512_set1_epi16(0x4180), code = _mm512_set1_epi16(0x0078);
    const int64_t chunks = k / 32;
    const __m512i pair_idx[2] = {_mm512_set_epi32(1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0),
                                 _mm512_set_epi32(3, 3, 3, 3, 3, 3, 3, 3, 2, 2, 2, 2, 2, 2, 2, 2)};
    /* per row pair, input and nibble plane: planes 0 and 2 hold the low 32 features of the blocks,
     * 1 and 3 the high ones */
    __m512 tot[2][2], acc[2][2][4];
    for (int p = 0; p < 2; p++)
        for (int i = 0; i < NI; i++)
            tot[p][i] = acc[p][i][0] = acc[p][i][1] = acc[p][i][2] = acc[p][i][3] = _mm512_setzero_ps();
    for (int64_t kk = 0; kk < k; kk += 64) {
        const uint8_t *blk = w + i4d_off(row0, kk, k, n); /* the 4 rows' 32 bytes */
        const char *ahead = (const char *)blk + 512;
        _mm_prefetch(ahead, _MM_HINT_T0);
        _mm_prefetch(ahead + 64, _MM_HINT_T0);
        for (int p = 0; p < 2; p++) {
            __m512i b = _mm512_loadu_si512(blk + 64 * p);
            __m512i q[4];
            q[0] = _mm512_ternarylogic_epi32(_mm512_slli_epi16(b, 3), code, one6, 0xEA);
            q[1] = _mm512_ternarylogic_epi32(_mm512_srli_epi16(b, 1), code, one6, 0xEA);
            q[2] = _mm512_ternarylogic_epi32(_mm512_srli_epi16(b, 5), code, one6, 0xEA);
            q[3] = _mm512_ternarylogic_epi32(_mm512_srli_epi16(b, 9), code, one6, 0xEA);
            for (int i = 0; i < NI; i++) {
                const __m512i *xv = (const __m512i *)(xq[i] + kk / 64 * 64);
                for (int j = 0; j < 4; j++) acc[p][i][j] = _mm512_dpbf16_ps(acc[p][i][j], (__m512bh)q[j], (__m512bh)xv[j]);
            }
        }
        /* a chunk whose group ends here: its sums times the scales (low and high chunk of the block) */
        int64_t c = kk / 32;
        int end_lo = c + 2 >= chunks || cg[c + 2] != cg[c], end_hi = c + 3 >= chunks || cg[c + 3] != cg[c + 1];
        if (end_lo && end_hi && cg[c] == cg[c + 1]) { /* one group: one multiply */
            __m512 s4 = _mm512_castps128_ps512(_mm_loadu_ps(s + i4d_soff(row0, cg[c], groups, n))); /* 4 rows */
            for (int p = 0; p < 2; p++) {
                __m512 sp = _mm512_permutexvar_ps(pair_idx[p], s4);
                for (int i = 0; i < NI; i++) {
                    __m512 *a = acc[p][i];
                    tot[p][i] = _mm512_fmadd_ps(_mm512_add_ps(_mm512_add_ps(a[0], a[2]), _mm512_add_ps(a[1], a[3])), sp, tot[p][i]);
                    a[0] = a[1] = a[2] = a[3] = _mm512_setzero_ps();
                }
            }
        } else
            for (int h = 0; h < 2; h++) { /* the low chunk (planes 0, 2), then the high one (1, 3) */
                if (!(h ? end_hi : end_lo)) continue;
                __m512 s4 = _mm512_castps128_ps512(_mm_loadu_ps(s + i4d_soff(row0, cg[c + h], groups, n)));
                for (int p = 0; p < 2; p++) {
                    __m512 sp = _mm512_permutexvar_ps(pair_idx[p], s4);
                    for (int i = 0; i < NI; i++) {
                        __m512 *a = acc[p][i];
                        __m512 sum = h ? _mm512_add_ps(a[1], a[3]) : _mm512_add_ps(a[0], a[2]);
                        tot[p][i] = _mm512_fmadd_ps(sum, sp, tot[p][i]);
                        if (h) a[1] = a[3] = _mm512_setzero_ps();
                        else a[0] = a[2] = _mm512_setzero_ps();
                    }
                }
            }
    }
    for (int p = 0; p < 2; p++)
        for (int i = 0; i < NI; i++) {
            __m256 lo = _mm512_castps512_ps256(tot[p][i]);
            __m256 hi = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(tot[p][i]), 1));
            res[2 * p][i0 + i] = hsum8(lo);
            res[2 * p + 1][i0 + i] = hsum8(hi);
        }
}

INLINE void int4d_tile_f32(const float *x, int64_t k, int64_t n, const uint8_t *w, const float *s, int64_t groups,
                           const int32_t *cg, int64_t row0, int R, int M, float res[4][MT]) {
    const __m128i low4 = _mm_set1_epi8(0x0f);
    __m512 tot[4][MT];
    for (int r = 0; r < R; r++)
        for (int i = 0; i < M; i++) tot[r][i] = _mm512_setzero_ps();
    for (int64_t kk = 0; kk < k; kk += 64) {
        const int32_t *g = cg + kk / 32;
        const char *ahead = (const char *)(w + i4d_off(row0, kk, k, n)) + 512;
        _mm_prefetch(ahead, _MM_HINT_T0);
        _mm_prefetch(ahead + 64, _MM_HINT_T0);
        for (int r = 0; r < R; r++) {
            const uint8_t *wr = w + i4d_off(row0 + r, kk, k, n);
            __m128i b0 = _mm_loadu_si128((const __m128i *)wr), b1 = _mm_loadu_si128((const __m128i *)(wr + 16));
            __m512 q[4]; /* features kk + 16 j .. kk + 16 j + 15 */
            q[0] = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(b0, low4)));
            q[1] = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(b1, low4)));
            q[2] = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(_mm_srli_epi16(b0, 4), low4)));
            q[3] = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(_mm_srli_epi16(b1, 4), low4)));
            __m512 s0 = _mm512_set1_ps(s[i4d_soff(row0 + r, g[0], groups, n)]);
            __m512 s1 = _mm512_set1_ps(s[i4d_soff(row0 + r, g[1], groups, n)]);
            for (int i = 0; i < M; i++) {
                const float *xi = x + i * k + kk;
                __m512 d0 = _mm512_fmadd_ps(q[1], _mm512_loadu_ps(xi + 16), _mm512_mul_ps(q[0], _mm512_loadu_ps(xi)));
                __m512 d1 = _mm512_fmadd_ps(q[3], _mm512_loadu_ps(xi + 48), _mm512_mul_ps(q[2], _mm512_loadu_ps(xi + 32)));
                tot[r][i] = _mm512_fmadd_ps(d1, s1, _mm512_fmadd_ps(d0, s0, tot[r][i]));
            }
        }
    }
    for (int r = 0; r < R; r++)
        for (int i = 0; i < M; i++) res[r][i] = _mm512_reduce_add_ps(tot[r][i]);
}

/* sum over row `row`'s groups g of (offset s_g + sz_g) xsum_g: the codes' offset and zero point */
INLINE float group_terms(const float *s, const float *sz, const float *xsum, int64_t row, int64_t groups, int64_t n,
                         float offset) {
    float v = 0.f;
    for (int64_t g = 0; g < groups; g++) {
        int64_t j = i4d_soff(row, g, groups, n);
        v += (offset * s[j] + sz[j]) * xsum[g];
    }
    return v;
}

/* group_terms of a whole 4-row tile (scales from st, szt: [groups][4]), 4 groups per vector */
INLINE void group_terms4(const float *st, const float *szt, const float *xsum, int64_t groups, float offset,
                         float out[4]) {
    const __m512i spread = _mm512_set_epi32(3, 3, 3, 3, 2, 2, 2, 2, 1, 1, 1, 1, 0, 0, 0, 0); /* xsum_g per row */
    __m512 acc = _mm512_setzero_ps(), off = _mm512_set1_ps(offset);
    for (int64_t g = 0; g < groups; g += 4) {
        int64_t left = groups - g >= 4 ? 4 : groups - g;
        __mmask16 lanes = (__mmask16)((1u << (4 * left)) - 1);
        __m512 c = _mm512_fmadd_ps(off, _mm512_maskz_loadu_ps(lanes, st + 4 * g), _mm512_maskz_loadu_ps(lanes, szt + 4 * g));
        __m512 xs = _mm512_permutexvar_ps(spread, _mm512_castps128_ps512(_mm_maskz_loadu_ps((__mmask8)((1u << left) - 1), xsum + g)));
        acc = _mm512_fmadd_ps(c, xs, acc);
    }
    __m256 h = _mm256_add_ps(_mm512_castps512_ps256(acc), _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(acc), 1)));
    _mm_storeu_ps(out, _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1)));
}

/* DT_I4D rows [r_begin, r_end) of y for all m inputs: whole 4-row tiles with int4d_tile4_bf16 per
 * input (bfloat16 inputs; the tile stays in L1 for the next input) or int4d_tile_f32 (4 rows x up
 * to 4 inputs), the short last tile row by row. Each row's sums run in the same order whatever m
 * is (batch-invariant). xb: the bfloat16 inputs (or NULL: xf, float32), xsum [m, groups] the
 * inputs' group sums. */
static void int4d_rows(const float *xf, const uint16_t *xb, const float *xsum, int64_t m, int64_t k,
                       const uint8_t *w, const float *s, const float *sz, int64_t group, const float *bias, void *y,
                       int ydt, int64_t n, int64_t r_begin, int64_t r_end) {
    const int64_t groups = (k + group - 1) / group;
    int32_t *cg = (int32_t *)malloc(sizeof(int32_t) * (size_t)(k / 32));
    for (int64_t c = 0; c < k / 32; c++) cg[c] = (int32_t)(c * 32 / group);
    const float offset = xb ? 16.f : 0.f; /* the codes' bfloat16 offset (16 + q) */
    for (int64_t i0 = 0; i0 < m; i0 += MT) {
        int M = m - i0 >= MT ? MT : (int)(m - i0);
        uint32_t *xq[MT] = {NULL}; /* the inputs as int4d_tile4_bf16 reads them */
        for (int64_t row0 = r_begin; row0 < r_end;) {
            int R = r_end - row0 >= I4D_ROWS ? I4D_ROWS : 1; /* a whole tile, or a row of the short one */
            float res[4][MT], terms[MT][4];
            if (xb && R == 4) {
                for (int i = 0; i < M; i++)
                    if (!xq[i]) xq[i] = int4d_pairs(xb + (i0 + i) * k, k);
                for (int i = 0; i < M; i += 2) /* two inputs a pass (the planes made once) */
                    if (M - i >= 2) int4d_tile4_bf16(xq + i, 2, k, n, w, s, groups, cg, row0, res, i);
                    else int4d_tile4_bf16(xq + i, 1, k, n, w, s, groups, cg, row0, res, i);
            } else if (xb) {
                const uint16_t *xi = xb + i0 * k;
                if (M == 1) int4d_row_bf16(xi, k, n, w, s, groups, cg, row0, 1, res);
                else if (M == 2) int4d_row_bf16(xi, k, n, w, s, groups, cg, row0, 2, res);
                else if (M == 3) int4d_row_bf16(xi, k, n, w, s, groups, cg, row0, 3, res);
                else int4d_row_bf16(xi, k, n, w, s, groups, cg, row0, 4, res);
            } else {
                const float *xi = xf + i0 * k;
                if (R == 4) {
                    if (M == 1) int4d_tile_f32(xi, k, n, w, s, groups, cg, row0, 4, 1, res);
                    else if (M == 2) int4d_tile_f32(xi, k, n, w, s, groups, cg, row0, 4, 2, res);
                    else if (M == 3) int4d_tile_f32(xi, k, n, w, s, groups, cg, row0, 4, 3, res);
                    else int4d_tile_f32(xi, k, n, w, s, groups, cg, row0, 4, 4, res);
                } else if (M == 1) int4d_tile_f32(xi, k, n, w, s, groups, cg, row0, 1, 1, res);
                else if (M == 2) int4d_tile_f32(xi, k, n, w, s, groups, cg, row0, 1, 2, res);
                else if (M == 3) int4d_tile_f32(xi, k, n, w, s, groups, cg, row0, 1, 3, res);
                else int4d_tile_f32(xi, k, n, w, s, groups, cg, row0, 1, 4, res);
            }
            for (int i = 0; i < M; i++) {
                if (R == 4)
                    group_terms4(s + i4d_soff(row0, 0, groups, n), sz + i4d_soff(row0, 0, groups, n),
                                 xsum + (i0 + i) * groups, groups, offset, terms[i]);
                else
                    terms[i][0] = group_terms(s, sz, xsum + (i0 + i) * groups, row0, groups, n, offset);
                for (int r = 0; r < R; r++)
                    store_f(y, ydt, (i0 + i) * n + row0 + r, res[r][i] - terms[i][r] + (bias ? bias[row0 + r] : 0.f));
            }
            row0 += R;
        }
        for (int i = 0; i < MT; i++) free(xq[i]);
    }
    free(cg);
}
#endif

/* the code of feature kk of row `row` of a DT_I4D weight [n, k / 2] (the dot layout above) */
INLINE int int4d_code(const uint8_t *w, int64_t row, int64_t kk, int64_t k, int64_t n) {
    uint8_t byte = w[i4d_off(row, kk, k, n) + kk % 32];
    return (kk % 64 < 32) ? byte & 15 : byte >> 4;
}

/* Float weights held transposed, Wt [k, n] (the layout the CPU GEMMs of torch read too):
 * y[i, c] = sum_k x[i, k] Wt[k, c]. A tile is M inputs x C vectors of VW columns; each step
 * over k loads C weight vectors and broadcasts M inputs. Column blocks of 64 stay in L2
 * while every 4-row tile of x passes over them. */
#define TCOLS 8 /* most VW-column vectors per tile (a single input row) */
#define CM (BST_AVX512 ? 4 : 2) /* vectors per tile for several input rows (M C accumulators) */

#if BST_SIMD
/* out[i, VW c + j] (+)= sum over k0 <= kk < k1 of x[i, kk] Wt[kk, col0 + VW c + j]: adds to out
 * unless k0 == 0. */
INLINE void cols_block(const float *x, int64_t k, int64_t k0, int64_t k1, const void *wt, int dt, int64_t n,
                       int64_t col0, int C, int M, float *out, int64_t out_stride) {
    vf acc[MT][TCOLS];
    for (int i = 0; i < M; i++)
        for (int c = 0; c < C; c++) acc[i][c] = k0 == 0 ? vzero() : vloadu(out + i * out_stride + VW * c);
    for (int64_t kk = k0; kk < k1; kk++) {
        vf wv[TCOLS];
        for (int c = 0; c < C; c++) wv[c] = vload_any(wt, dt, kk * n + col0 + VW * c);
        for (int i = 0; i < M; i++) {
            vf xb = vset1(x[i * k + kk]);
            for (int c = 0; c < C; c++) acc[i][c] = vfmadd(wv[c], xb, acc[i][c]);
        }
    }
    for (int i = 0; i < M; i++)
        for (int c = 0; c < C; c++) vstoreu(out + i * out_stride + VW * c, acc[i][c]);
}
#endif

#if BST_ISA == 1
/* AVX2, bfloat16 weights: one 256-bit load holds 16 columns; the even ones are the low halves
 * of its 32-bit lanes (shifted up: their floats), the odd ones the high halves (masked): no
 * widening shuffles. As cols_block for C16 groups of 16 columns, with out holding each group
 * as [8 even columns, 8 odd columns] (cols_range puts them back in order). */
INLINE void cols_block_bf16_pairs(const float *x, int64_t k, int64_t k0, int64_t k1, const uint16_t *wt, int64_t n,
                                  int64_t col0, int C16, int M, float *out, int64_t out_stride) {
    const __m256i high = _mm256_set1_epi32((int)0xffff0000u);
    vf acc[MT][TCOLS];
    for (int i = 0; i < M; i++)
        for (int c = 0; c < 2 * C16; c++) acc[i][c] = k0 == 0 ? vzero() : vloadu(out + i * out_stride + VW * c);
    for (int64_t kk = k0; kk < k1; kk++) {
        vf we[TCOLS / 2], wo[TCOLS / 2];
        /* rows are n apart (a page or more): fetch this row's next block (the next tile's) now */
        _mm_prefetch((const char *)(wt + kk * n + col0 + 16 * C16), _MM_HINT_T0);
        _mm_prefetch((const char *)(wt + kk * n + col0 + 16 * C16 + 32), _MM_HINT_T0);
        for (int c = 0; c < C16; c++) {
            __m256i w = _mm256_loadu_si256((const __m256i *)(wt + kk * n + col0 + 16 * c));
            we[c] = _mm256_castsi256_ps(_mm256_slli_epi32(w, 16));
            wo[c] = _mm256_castsi256_ps(_mm256_and_si256(w, high));
        }
        for (int i = 0; i < M; i++) {
            vf xb = vset1(x[i * k + kk]);
            for (int c = 0; c < C16; c++) {
                acc[i][2 * c] = vfmadd(we[c], xb, acc[i][2 * c]);
                acc[i][2 * c + 1] = vfmadd(wo[c], xb, acc[i][2 * c + 1]);
            }
        }
    }
    for (int i = 0; i < M; i++)
        for (int c = 0; c < 2 * C16; c++) vstoreu(out + i * out_stride + VW * c, acc[i][c]);
}
#endif

#if BST_BF16DOT
/* bfloat16 weights x bfloat16 inputs, vdpbf16ps: x2 [M, kh]: the inputs as pairs (x[2p] in the
 * low half, x[2p + 1] in the high half; 0 past k). Rows kk, kk + 1 of Wt (32 columns each) are
 * interleaved by 16-bit unpacks: in each 128-bit lane (8 columns) the low unpack holds columns
 * 0-3 and the high one columns 4-7 as (kk, kk + 1) pairs, one per 32-bit lane, and vdpbf16ps
 * adds W[kk] x[kk] + W[kk + 1] x[kk + 1] to each. C32 groups of 32 columns from col0, M inputs;
 * out holds each group as [16 low, 16 high] (cols_range puts them back in order). Adds to out
 * unless k0 == 0 (k0 even). */
INLINE void cols_block_dpbf16(const uint32_t *x2, int64_t kh, int64_t k, int64_t k0, int64_t k1, const uint16_t *wt,
                              int64_t n, int64_t col0, int C32, int M, float *out, int64_t out_stride) {
    __m512 acc[MT][TCOLS];
    for (int i = 0; i < M; i++)
        for (int c = 0; c < 2 * C32; c++)
            acc[i][c] = k0 == 0 ? _mm512_setzero_ps() : _mm512_loadu_ps(out + i * out_stride + 16 * c);
    for (int64_t kk = k0; kk < k1; kk += 2) {
        __m512i lo[TCOLS / 2], hi[TCOLS / 2];
        /* rows are n apart (a page or more): fetch these rows' next block (the next tile's) now */
        for (int r = 0; r < 2; r++) _mm_prefetch((const char *)(wt + (kk + r) * n + col0 + 32 * C32), _MM_HINT_T0);
        for (int c = 0; c < C32; c++) {
            const uint16_t *row = wt + kk * n + col0 + 32 * c;
            __m512i a = _mm512_loadu_si512(row), b = kk + 1 < k ? _mm512_loadu_si512(row + n) : _mm512_setzero_si512();
            lo[c] = _mm512_unpacklo_epi16(a, b);
            hi[c] = _mm512_unpackhi_epi16(a, b);
        }
        for (int i = 0; i < M; i++) {
            __m512bh xb = (__m512bh)_mm512_set1_epi32((int)x2[i * kh + kk / 2]);
            for (int c = 0; c < C32; c++) {
                acc[i][2 * c] = _mm512_dpbf16_ps(acc[i][2 * c], (__m512bh)lo[c], xb);
                acc[i][2 * c + 1] = _mm512_dpbf16_ps(acc[i][2 * c + 1], (__m512bh)hi[c], xb);
            }
        }
    }
    for (int i = 0; i < M; i++)
        for (int c = 0; c < 2 * C32; c++) _mm512_storeu_ps(out + i * out_stride + 16 * c, acc[i][c]);
}

/* cols_range's columns [c_begin, c_end) (a multiple of 32 of them) with cols_block_dpbf16: k in
 * chunks of 32 rows, column blocks of 128 (one input) or 64; out [m, width] from c_begin. Every
 * column sums its pairs in the same order whatever m is (batch-invariant). */
static void cols_dpbf16(const uint32_t *x2, int64_t m, int64_t k, const uint16_t *wt, int64_t n, int64_t c_begin,
                        int64_t c_end, float *out, int64_t width) {
    const int64_t KCHUNK = 32, block = m == 1 ? 16 * TCOLS : 64, kh = (k + 1) / 2;
    for (int64_t k0 = 0; k0 < k; k0 += KCHUNK) {
        int64_t k1 = k0 + KCHUNK < k ? k0 + KCHUNK : k;
        for (int64_t col = c_begin; col < c_end; col += block) {
            int G = (int)((c_end - col) / 32);
            if (G > block / 32) G = (int)(block / 32);
            for (int64_t i0 = 0; i0 < m; i0 += MT) {
                int M = m - i0 >= MT ? MT : (int)(m - i0);
                const uint32_t *xi = x2 + i0 * kh;
                float *o = out + i0 * width + (col - c_begin);
#define DOT_M(C32, g)                                                                                  \
    if (M == 1) cols_block_dpbf16(xi, kh, k, k0, k1, wt, n, col + 32 * (g), C32, 1, o + 32 * (g), width);      \
    else if (M == 2) cols_block_dpbf16(xi, kh, k, k0, k1, wt, n, col + 32 * (g), C32, 2, o + 32 * (g), width); \
    else if (M == 3) cols_block_dpbf16(xi, kh, k, k0, k1, wt, n, col + 32 * (g), C32, 3, o + 32 * (g), width); \
    else cols_block_dpbf16(xi, kh, k, k0, k1, wt, n, col + 32 * (g), C32, 4, o + 32 * (g), width);
                if (M == 1 && G == TCOLS / 2) {
                    cols_block_dpbf16(xi, kh, k, k0, k1, wt, n, col, TCOLS / 2, 1, o, width);
                } else {
                    int g = 0;
                    for (; M > 1 && g + 2 <= G; g += 2) { DOT_M(2, g) }
                    for (; g < G; g++) { DOT_M(1, g) }
                }
#undef DOT_M
            }
        }
    }
}

/* a . b over n bfloat16 (float32 sum; vdpbf16ps, masked tail) */
INLINE float dot_bf16(const uint16_t *a, const uint16_t *b, int64_t n) {
    __m512 acc = _mm512_setzero_ps();
    int64_t d = 0;
    for (; d + 32 <= n; d += 32)
        acc = _mm512_dpbf16_ps(acc, (__m512bh)_mm512_loadu_si512(a + d), (__m512bh)_mm512_loadu_si512(b + d));
    if (d < n) {
        __mmask32 mask = (__mmask32)((1ull << (n - d)) - 1);
        acc = _mm512_dpbf16_ps(acc, (__m512bh)_mm512_maskz_loadu_epi16(mask, a + d),
                               (__m512bh)_mm512_maskz_loadu_epi16(mask, b + d));
    }
    return _mm512_reduce_add_ps(acc);
}
#endif

/* Columns [c_begin, c_end) of y for all m inputs; out: a [m, c_end - c_begin] float scratch.
 * x2: the inputs as bfloat16 pairs (bst_linear; only with the vdpbf16ps build, bf16 x and W) or NULL. */
static void cols_range(const float *xf, const uint32_t *x2, int64_t m, int64_t k, const void *wt, int wdt,
                       const float *bias, void *y, int ydt, int64_t n, int64_t c_begin, int64_t c_end) {
    int64_t width = c_end - c_begin;
    if (width <= 0) return;
    float *out = (float *)malloc(sizeof(float) * (size_t)(m * width));
    int64_t dot_end = c_begin; /* [c_begin, dot_end): vdpbf16ps, groups of 32 columns */
    (void)x2;
#if BST_BF16DOT
    if (x2 && wdt == DT_BF16) {
        dot_end = c_begin + width / 32 * 32;
        cols_dpbf16(x2, m, k, (const uint16_t *)wt, n, c_begin, dot_end, out, width);
    }
#endif
    int64_t col = dot_end;
    const int pairs = BST_ISA == 1 && wdt == DT_BF16; /* cols_block_bf16_pairs' column order in out */
    (void)pairs;
#if BST_SIMD
    int64_t vec_end = dot_end + (c_end - dot_end) / (pairs ? 16 : VW) * (pairs ? 16 : VW);
    /* k in chunks of KCHUNK rows: each chunk streams KCHUNK rows of the thread's columns
     * (sequential within a row), partial sums kept in `out` (L1/L2) between chunks. */
    const int64_t KCHUNK = 32, block = m == 1 ? VW * TCOLS : 64;
    for (int64_t k0 = 0; k0 < k; k0 += KCHUNK) {
        int64_t k1 = k0 + KCHUNK < k ? k0 + KCHUNK : k;
        for (col = dot_end; col < vec_end; col += block) {
            int C = (int)((vec_end - col) / VW);
            if (C > block / VW) C = (int)(block / VW);
            for (int64_t i0 = 0; i0 < m; i0 += MT) {
                int M = m - i0 >= MT ? MT : (int)(m - i0);
                const float *xi = xf + i0 * k;
                float *o = out + i0 * width + (col - c_begin);
#define COLS_M(CC)                                                                                     \
    if (M == 1) cols_block(xi, k, k0, k1, wt, DTW, n, col + VW * c, CC, 1, o + VW * c, width);       \
    else if (M == 2) cols_block(xi, k, k0, k1, wt, DTW, n, col + VW * c, CC, 2, o + VW * c, width);  \
    else if (M == 3) cols_block(xi, k, k0, k1, wt, DTW, n, col + VW * c, CC, 3, o + VW * c, width);  \
    else cols_block(xi, k, k0, k1, wt, DTW, n, col + VW * c, CC, 4, o + VW * c, width);
#define COLS_ANY                                                                                       \
    if (C == TCOLS && M == 1) {                                                                        \
        cols_block(xi, k, k0, k1, wt, DTW, n, col, TCOLS, 1, o, width);                               \
    } else {                                                                                           \
        int c = 0;                                                                                     \
        for (; c + CM <= C; c += CM) { COLS_M(CM) }                                                    \
        for (; c < C; c++) { COLS_M(1) }                                                               \
    }
#if BST_ISA == 1
#define PAIRS_M(C16, c)                                                                                          \
    if (M == 1) cols_block_bf16_pairs(xi, k, k0, k1, (const uint16_t *)wt, n, col + VW * c, C16, 1, o + VW * c, width); \
    else if (M == 2) cols_block_bf16_pairs(xi, k, k0, k1, (const uint16_t *)wt, n, col + VW * c, C16, 2, o + VW * c, width); \
    else if (M == 3) cols_block_bf16_pairs(xi, k, k0, k1, (const uint16_t *)wt, n, col + VW * c, C16, 3, o + VW * c, width); \
    else cols_block_bf16_pairs(xi, k, k0, k1, (const uint16_t *)wt, n, col + VW * c, C16, 4, o + VW * c, width);
                if (pairs) { /* C is even: whole groups of 16 columns */
                    if (M == 1 && C == TCOLS) {
                        PAIRS_M(TCOLS / 2, 0)
                    } else {
                        for (int c = 0; c < C; c += 2) { PAIRS_M(1, c) }
                    }
                    continue;
                }
#undef PAIRS_M
#endif
                if (wdt == DT_F32) {
#define DTW DT_F32
                    COLS_ANY
#undef DTW
                } else {
#define DTW DT_BF16
                    COLS_ANY
#undef DTW
                }
#undef COLS_ANY
#undef COLS_M
            }
        }
    }
    col = vec_end;
#endif
    for (; col < c_end; col++) /* columns past the last full vector */
        for (int64_t i = 0; i < m; i++) {
            float acc = 0.f;
            for (int64_t kk = 0; kk < k; kk++) acc += xf[i * k + kk] * load_f(wt, wdt, kk * n + col);
            out[i * width + col - c_begin] = acc;
        }
    for (int64_t i = 0; i < m; i++)
        for (int64_t c = c_begin; c < c_end; c++) {
            int64_t j = c - c_begin;
#if BST_SIMD
            if (pairs && c < vec_end) j = j / 16 * 16 + (j & 1) * 8 + (j % 16) / 2; /* [8 even, 8 odd] */
            if (c < dot_end) j = j / 32 * 32 + (j % 8 >= 4) * 16 + (j % 32) / 8 * 4 + j % 4; /* [16 low, 16 high] */
#endif
            store_f(y, ydt, i * n + c, out[i * width + j] + (bias ? bias[c] : 0.f));
        }
    free(out);
}

/* Split rows [0, n) in `parts` ranges on multiples of ROWS. */
INLINE void row_range(int64_t n, int part, int parts, int64_t *b, int64_t *e) {
    int64_t blocks = (n + ROWS - 1) / ROWS;
    *b = blocks * part / parts * ROWS;
    *e = blocks * (part + 1) / parts * ROWS;
    if (*e > n) *e = n;
    if (*b > n) *b = n;
}

/* sums [m, ceil(k / group)] (calloc'd) of each input row's features kk < upto, group by group */
INLINE float *group_sums(const float *xf, int64_t m, int64_t k, int64_t upto, int64_t group) {
    int64_t groups = (k + group - 1) / group;
    float *sums = (float *)calloc((size_t)(m * groups), sizeof(float));
    for (int64_t i = 0; i < m; i++)
        for (int64_t kk = 0; kk < upto; kk++) sums[i * groups + kk / group] += xf[i * k + kk];
    return sums;
}

/* y [m, n] (ydt) = x [m, k] (xdt) @ W^T: F32 / BF16 weights held transposed, Wt [k, n]; I8
 * q [n, k] (I8T: in row tiles) with scale [n]; for I4 s and sz = s * zero [n, ceil(k / group)], group % 32 == 0; bias [n] float or NULL. */
void bst_linear(const void *x, int xdt, int64_t m, int64_t k, const void *w, int wdt, int64_t n,
                const float *scale, const float *sz, int64_t group, const float *bias, void *y, int ydt,
                int threads) {
    float *xf = (float *)malloc(sizeof(float) * (size_t)(m * k) * (wdt == DT_I4 ? 2 : 1) + 64);
    float *xp = NULL, *xsum = NULL;
    uint32_t *x2 = NULL;
    to_f32(x, xdt, m * k, xf);
#if BST_BF16DOT
    if ((wdt == DT_BF16 || wdt == DT_BF16T) && xdt == DT_BF16) { /* bf16 x as the pairs vdpbf16ps reads: no rounding */
        int64_t kh = (k + 1) / 2;
        const uint16_t *xs = (const uint16_t *)x;
        x2 = (uint32_t *)malloc(sizeof(uint32_t) * (size_t)(m * kh));
        for (int64_t i = 0; i < m; i++)
            for (int64_t p = 0; p < kh; p++)
                x2[i * kh + p] = xs[i * k + 2 * p] | (2 * p + 1 < k ? (uint32_t)xs[i * k + 2 * p + 1] << 16 : 0u);
    }
#endif
    if (wdt == DT_I4) { /* x permuted per I4B-block: [even features, odd features] (int4_rows) */
        xp = xf + m * k;
        for (int64_t i = 0; i < m; i++)
            for (int64_t kk = 0; kk + I4B <= k && I4B > 1; kk += I4B)
                for (int j = 0; j < I4B / 2; j++) {
                    xp[i * k + kk + j] = xf[i * k + kk + 2 * j];
                    xp[i * k + kk + I4B / 2 + j] = xf[i * k + kk + 2 * j + 1];
                }
#if BST_ISA == 1
        xsum = group_sums(xf, m, k, k / I4B * I4B, group); /* the zero-point term of the blocks */
#endif
    }
#if BST_BF16DOT
    if (wdt == DT_I4D) xsum = group_sums(xf, m, k, k, group); /* the zero point and the codes' offset */
#endif
    int16_t *xq = NULL;
    float *xs = NULL;
#if BST_SIMD
    if (q16_fits(wdt, xdt, k)) { /* int8 weights x bfloat16 inputs: 16-bit integer dot products */
        xq = (int16_t *)malloc(sizeof(int16_t) * (size_t)(m * k) + 64);
        xs = (float *)malloc(sizeof(float) * (size_t)(m * q16_blocks(k)));
        q16_inputs(xf, m, k, xq, xs);
    }
#endif
    int parts = threads < 1 ? 1 : threads;
    if (n < 64 * parts) parts = 1;
#pragma omp parallel for num_threads(parts) schedule(static, 1)
    for (int part = 0; part < parts; part++) {
        int64_t b, e;
        row_range(n, part, parts, &b, &e);
        if (wdt == DT_F32 || wdt == DT_BF16) {
            int64_t unit = x2 ? 32 : 16; /* columns split on whole vectors (vdpbf16ps: groups of 32) */
            int64_t vecs = (n + unit - 1) / unit, cb = vecs * part / parts * unit, ce = vecs * (part + 1) / parts * unit;
            cols_range(xf, x2, m, k, w, wdt, bias, y, ydt, n, cb < n ? cb : n, ce < n ? ce : n);
        } else if (wdt == DT_I4)
            int4_rows(xf, xp, xsum, m, k, (const uint8_t *)w, scale, sz, group, bias, y, ydt, n, b, e);
        else if (wdt == DT_I4D) {
#if BST_BF16DOT
            int4d_rows(xf, xdt == DT_BF16 ? (const uint16_t *)x : NULL, xsum, m, k, (const uint8_t *)w, scale, sz, group,
                       bias, y, ydt, n, b, e);
#else /* packed for the avx512bf16 build: NaN rather than a plausible wrong answer */
            for (int64_t i = 0; i < m; i++)
                for (int64_t r = b; r < e; r++) store_f(y, ydt, i * n + r, NAN);
#endif
        }
#if BST_BF16DOT
        else if (wdt == DT_BF16T && x2)
            bf16t_rows(x2, m, k, (const uint16_t *)w, bias, y, ydt, n, b, e);
#endif
#if BST_SIMD
        else if (xq)
            dense_rows((tile_inputs){NULL, xq, xs}, m, k, w, wdt, q16_any, scale, bias, y, ydt, n, b, e);
#endif
        else
            dense_rows((tile_inputs){xf, NULL, NULL}, m, k, w, wdt, tile_any, wdt == DT_I8 || wdt == DT_I8T ? scale : NULL,
                       bias, y, ydt, n, b, e);
    }
    free(x2);
    free(xsum);
    free(xq);
    free(xs);
    free(xf);
}

/* row `row` of W [n, k] (I8 / I8T with scale, I4 / I4D with s, sz, BF16T / F32T) as floats in dst [k]:
 * q * scale, q * s - s z, the value; float weights held transposed (F32 / BF16): NaN. */
static void dequantize_row(const void *w, int wdt, int64_t row, int64_t n, int64_t k, const float *scale,
                           const float *sz, int64_t group, float *dst) {
    const int64_t groups = wdt == DT_I4 || wdt == DT_I4D ? (k + group - 1) / group : 1;
    int64_t kk = 0;
#if BST_SIMD /* VW features never cross a block of a tiled layout (16 / 32 / 64 wide) or a group (% 32) */
    if (wdt == DT_I8 || wdt == DT_I8T) {
        const vf s = vset1(scale[row]);
        for (; kk + VW <= k; kk += VW) vstoreu(dst + kk, vmul(vload_i8((const int8_t *)w + w_off(wdt, row, kk, k)), s));
    } else if (wdt == DT_BF16T || wdt == DT_F32T) {
        for (; kk + VW <= k; kk += VW) vstoreu(dst + kk, vload_any(w, elem_dt(wdt), w_off(wdt, row, kk, k)));
    } else if (wdt == DT_I4) {
        const uint8_t *wr = (const uint8_t *)w + row * (k / 2);
        for (; kk + VW <= k; kk += VW) {
            int64_t g = row * groups + kk / group;
            vstoreu(dst + kk, vfmsub(vload_nibbles(wr + kk / 2), vset1(scale[g]), vset1(sz[g])));
        }
    } else if (wdt == DT_I4D) {
        for (; kk + VW <= k; kk += VW) {
            int64_t g = i4d_soff(row, kk / group, groups, n);
            vi b = vload_u8i((const uint8_t *)w + i4d_off(row, kk, k, n) + kk % 32);
            vf q = vi_to_f(kk % 64 >= 32 ? vi_srli(b, 4) : vi_and(b, vi_set1(15))); /* the high / low nibble plane */
            vstoreu(dst + kk, vfmsub(q, vset1(scale[g]), vset1(sz[g])));
        }
    }
#endif
    for (; kk < k; kk++) {
        float v;
        if (wdt == DT_I8 || wdt == DT_I8T) {
            v = (float)((const int8_t *)w)[w_off(wdt, row, kk, k)] * scale[row];
        } else if (wdt == DT_BF16T || wdt == DT_F32T) {
            v = load_f(w, elem_dt(wdt), w_off(wdt, row, kk, k));
        } else if (wdt == DT_I4) {
            v = int4_weight((const uint8_t *)w + row * (k / 2), scale + row * groups, sz + row * groups, kk, group);
        } else if (wdt == DT_I4D) {
            int64_t j = i4d_soff(row, kk / group, groups, n);
            v = (float)int4d_code((const uint8_t *)w, row, kk, k, n) * scale[j] - sz[j];
        } else {
            v = NAN; /* float weights are not dequantized */
        }
        dst[kk] = v;
    }
}

/* W [n, k] (I8 with scale / I4, I4D with s, sz) -> float rows [n, k] in ydt: the dequantized
 * weight the prefill GEMM multiplies by. */
void bst_dequantize(const void *w, int wdt, int64_t n, int64_t k, const float *scale, const float *sz,
                    int64_t group, void *y, int ydt, int threads) {
    const int parts = threads < 1 ? 1 : threads;
    float *rows = (float *)malloc(sizeof(float) * (size_t)(k * parts));
#pragma omp parallel for num_threads(parts) schedule(static)
    for (int64_t row = 0; row < n; row++) {
        float *dst = rows + k * omp_get_thread_num();
        dequantize_row(w, wdt, row, n, k, scale, sz, group, dst);
        from_f32(dst, k, (char *)y + (size_t)(row * k) * (ydt == DT_F32 ? 4 : 2), ydt);
    }
    free(rows);
}

/* ---------------------------------------------------------------------------------------- */
/* quantized KV cache codes: int8 and float8 e4m3fn                                         */
/* ---------------------------------------------------------------------------------------- */

static float e4m3_values[256]; /* code -> value (0x7f, 0xff: NaN) */

__attribute__((constructor)) static void init_e4m3(void) {
    for (int c = 0; c < 256; c++) {
        int e = (c >> 3) & 15, m = c & 7;
        float v = e == 0 ? ldexpf((float)m, -9) : ldexpf(1.f + (float)m / 8.f, e - 7);
        if ((c & 0x7f) == 0x7f) v = NAN;
        e4m3_values[c] = (c & 0x80) ? -v : v;
    }
}

/* float -> e4m3fn code, round to nearest even, |y| <= 448 (the caller clamps) */
INLINE uint8_t f32_to_e4m3(float y) {
    uint8_t sign = signbit(y) ? 0x80 : 0;
    float a = fabsf(y);
    int lo = 0, hi = 126; /* largest code c with value(c) <= a */
    while (lo < hi) {
        int mid = (lo + hi + 1) / 2;
        if (e4m3_values[mid] <= a) lo = mid; else hi = mid - 1;
    }
    if (lo < 126) {
        float below = a - e4m3_values[lo], above = e4m3_values[lo + 1] - a;
        if (above < below || (above == below && (lo & 1))) lo++;
    }
    return (uint8_t)(sign | lo);
}

/* the KV code of x: int8 clamp(round(x / s), -127, 127), e4m3fn(clamp(x / s, -448, 448)) */
INLINE void store_kv(void *pool, int dt, int64_t i, float x, float s) {
    float y = x / s;
    if (dt == DT_I8) {
        float r = nearbyintf(y);
        ((int8_t *)pool)[i] = (int8_t)(r > 127.f ? 127.f : r < -127.f ? -127.f : r);
    } else {
        ((uint8_t *)pool)[i] = f32_to_e4m3(y > 448.f ? 448.f : y < -448.f ? -448.f : y);
    }
}

#if BST_SIMD
/* the e4m3fn codes of y (|y| <= 448, not NaN), round to nearest even: a normal |y| keeps 3
 * mantissa bits (the carry may bump the exponent), code = bits >> 20 - (127 - 7) << 3; below
 * 2^-6 the code is the subnormal count round(|y| 2^9) (8 there is the smallest normal: equal). */
INLINE vi ve4m3_codes(vf y) {
    vf a = vabs(y);
    vi u = vf_as_i(a), sign = vi_and(vi_srli(vf_as_i(y), 24), vi_set1(0x80));
    vi normal = vi_sub(vi_srli(vi_add(u, vi_add(vi_set1(0x7ffff), vi_and(vi_srli(u, 20), vi_set1(1)))), 20),
                       vi_set1(120 << 3));
    vi sub = vcvt_i32(vround(vmul(a, vset1(512.f))));
    return vi_or(sign, vi_select_lt(a, vset1(0.015625f), sub, normal));
}

/* VW KV codes of x / s at pool element off: int8 clamp(round(x / s), -127, 127) or
 * e4m3fn(clamp(x / s, -448, 448)) (store_kv's, lane by lane) */
INLINE void vstore_kv(void *pool, int dt, int64_t off, vf x, float s) {
    vf y = vdiv(x, vset1(s));
    if (dt == DT_I8)
        vstore_i8((int8_t *)pool + off, vcvt_i32(vmin(vmax(vround(y), vset1(-127.f)), vset1(127.f))));
    else
        vstore_u8((uint8_t *)pool + off, ve4m3_codes(vmin(vmax(y, vset1(-448.f)), vset1(448.f))));
}
#endif

/* dst[d] = code(pool[off + d]) * s for a row of D codes */
static void load_kv_row(const void *pool, int dt, int64_t off, int64_t D, float s, float *dst) {
    int64_t d = 0;
#if BST_SIMD
    const vf sv = vset1(s);
    for (; d + VW <= D; d += VW) {
        const void *c = (const uint8_t *)pool + off + d;
        vf v = dt == DT_I8 ? vload_i8((const int8_t *)c) : vload_lut8((const uint8_t *)c, e4m3_values);
        vstoreu(dst + d, vmul(v, sv));
    }
#endif
    if (dt == DT_I8) {
        const int8_t *c = (const int8_t *)pool + off;
        for (; d < D; d++) dst[d] = (float)c[d] * s;
    } else {
        const uint8_t *c = (const uint8_t *)pool + off;
        for (; d < D; d++) dst[d] = e4m3_values[c[d]] * s;
    }
}

/* k / v rows [T, W] (src_stride elements apart, dtype sdt) -> pool slot rows (W = KVH * D); pools
 * in pdt: float (scales NULL) or int8 / e4m3 codes with scales (s_k, s_v). */
void bst_kv_write(const void *k, const void *v, int sdt, int64_t src_stride, void *k_pool, void *v_pool, int pdt,
                  const int64_t *slots, int64_t T, int64_t W, const float *scales) {
    for (int64_t t = 0; t < T; t++) {
        int64_t j = 0, src = t * src_stride, dst = slots[t] * W;
#if BST_SIMD
        for (; j + VW <= W; j += VW) {
            vf kx = vload_any(k, sdt, src + j), vx = vload_any(v, sdt, src + j);
            if (scales) {
                vstore_kv(k_pool, pdt, dst + j, kx, scales[0]);
                vstore_kv(v_pool, pdt, dst + j, vx, scales[1]);
            } else {
                vstore_any(k_pool, pdt, dst + j, kx);
                vstore_any(v_pool, pdt, dst + j, vx);
            }
        }
#endif
        for (; j < W; j++) {
            float kx = load_f(k, sdt, src + j), vx = load_f(v, sdt, src + j);
            if (scales) {
                store_kv(k_pool, pdt, dst + j, kx, scales[0]);
                store_kv(v_pool, pdt, dst + j, vx, scales[1]);
            } else {
                store_f(k_pool, pdt, dst + j, kx);
                store_f(v_pool, pdt, dst + j, vx);
            }
        }
    }
}

/* ---------------------------------------------------------------------------------------- */
/* decode attention over the paged pool                                                     */
/* ---------------------------------------------------------------------------------------- */

#define PAD 16 /* floats past a head's D in the stack rows: a vector tail reads zeros there */

/* out[b, h, :] = softmax_j(q[b, h] . K_j * scale + slope_h * (j - (L_b - 1))) V_j over the L_b =
 * kv_lens[b] cached keys of sequence b: K_j = k_pool[table[b, j / bs], j % bs, h / G], G = H / KVH.
 * q [B, H, D] (qdt; q_stride elements from one sequence's row to the next), pools [blocks, bs, KVH, D] (kvdt), tables [B, max_blocks] int64,
 * slopes [H] float or NULL, out [B, H, D] (odt). Quantized pools (kvdt DT_I8 / DT_F8) hold codes with
 * K = code * kv_scales[0], V = code * kv_scales[1]; float pools pass kv_scales NULL. windows [2, B] int64
 * (or NULL): each sequence's attention window W (0 = none) and sinks S (core.kernels.attention_window): the
 * query then sees only keys j < S and j >= L_b - (W - S), and no other key is read.
 *
 * A task is one sequence and up to GQ of the G query heads sharing a key head: each key and value row
 * is found, fetched and read once for them all (per head the sums run in the same order as for one). */
#define GQ 4
/* Sequence b's query heads h0 .. h0 + gc of key head kvh (see bst_decode_attention). */
static void attend_heads(const void *q, int qdt, int64_t q_stride, const void *k_pool, const void *v_pool, int kvdt,
                         const int64_t *tables, int64_t max_blocks, const int64_t *kv_lens, int64_t B, int64_t H,
                         int64_t KVH, int64_t D, int64_t bs, int bs_shift, float scale, const float *slopes, void *out,
                         int odt, const float *kv_scales, const int64_t *windows, int64_t b, int64_t kvh, int64_t h0,
                         int gc) {
    int64_t L = kv_lens[b];
    const int64_t *table = tables + b * max_blocks;
    /* windows [2, B] (or NULL): window W (0 = none) and sinks S of each sequence. The query at L - 1
     * sees keys j < S and j >= lo = max(0, L - (W - S)): n of them, key t of the walk at j_of(t). */
    int64_t W = windows ? windows[b] : 0, S = W ? windows[B + b] : 0;
    int64_t lo = W ? (L - (W - S) > 0 ? L - (W - S) : 0) : 0, ns = S < lo ? S : lo, n = ns + L - lo;
#define J_OF(t) ((t) < ns ? (t) : lo + (t) - ns)
#define SLOT_OF(j) (bs_shift >= 0 ? (table[(j) >> bs_shift] << bs_shift) + ((j) & (bs - 1)) : table[(j) / bs] * bs + (j) % bs)
/* the rows are scattered (blocks, other heads between): fetch key t + 16 ahead, and the value at
 * element off (key t's, its own head) for the weighted sum after the softmax; `fetch` bytes of each row.
 * Into L2 (T1): T0 fills the L1's few miss buffers and stalls the walk. benchmarks/attention_stream.py,
 * 64 sequences x 150-1500 keys, pools out of cache: 12.7-15.5 GB/s with T0 (and a task per sequence
 * over whole rows), 15.5-18.1 with T1 (the same), 18.5-18.9 with T1 and a task per key head; ~10
 * without software prefetch */
#define FETCH_ROWS(t, off)                                                                                        \
    do {                                                                                                          \
        if ((t) + 16 < n) {                                                                                       \
            int64_t offa = (SLOT_OF(J_OF((t) + 16)) * KVH + kvh) * D;                                             \
            for (int64_t c = 0; c < fetch; c += 64) _mm_prefetch((const char *)k_pool + offa * esize + c, _MM_HINT_T1); \
        }                                                                                                         \
        for (int64_t c = 0; c < fetch; c += 64) _mm_prefetch((const char *)v_pool + (off) * esize + c, _MM_HINT_T1); \
    } while (0)
    float qf[GQ][512 + PAD], acc[GQ][512 + PAD], row[512 + PAD], mx[GQ];
    float stack_scores[4096];
    float *scores = n * gc <= 4096 ? stack_scores : (float *)malloc(sizeof(float) * (size_t)(n * gc)); /* [gc, n] */
    for (int g = 0; g < gc; g++) {
        to_f32((const char *)q + (b * q_stride + (h0 + g) * D) * (qdt == DT_F32 ? 4 : 2), qdt, D, qf[g]);
        memset(qf[g] + D, 0, sizeof(float) * PAD);
        memset(acc[g], 0, sizeof(float) * (size_t)(D + PAD));
        mx[g] = -INFINITY;
    }
#if BST_BF16DOT
    /* bf16 q . bf16 keys: vdpbf16ps (exact products, float32 sums) */
    const int dot = qdt == DT_BF16 && kvdt == DT_BF16 && !kv_scales;
    const uint16_t *q16 = (const uint16_t *)q + b * q_stride + h0 * D;
#endif
#if BST_SIMD
    const int64_t esize = kvdt == DT_F32 ? 4 : kvdt == DT_BF16 ? 2 : 1; /* a pool element's bytes */
    const int64_t fetch = D * esize; /* bytes fetched ahead per row */
    for (int64_t t = 0; t < n && t < 16; t++) { /* the first 16 keys (the walk fetches 16 ahead) */
        int64_t offa = (SLOT_OF(J_OF(t)) * KVH + kvh) * D;
        for (int64_t c = 0; c < fetch; c += 64) _mm_prefetch((const char *)k_pool + offa * esize + c, _MM_HINT_T1);
    }
#endif
    int64_t scored = 0; /* keys [0, scored) have their scores */
#if BST_BF16DOT
    const __m512i key_order = SUM16_KEY_ORDER; /* the 16 keys' scores in key order */
    __m512 mxv[GQ];
    for (int g = 0; g < GQ; g++) mxv[g] = _mm512_set1_ps(-INFINITY);
    if (dot && D % 32 == 0) /* 16 keys at a time: their 16 dot products summed in one shuffle tree */
        for (; scored < n; scored += 16) {
            int nk = n - scored < 16 ? (int)(n - scored) : 16;
            int64_t offs[16];
            for (int i = nk; i < 16; i++) offs[i] = (SLOT_OF(J_OF(scored)) * KVH + kvh) * D;
            for (int i = 0; i < nk; i++) {
                int64_t t = scored + i, j = J_OF(t);
                offs[i] = (SLOT_OF(j) * KVH + kvh) * D;
                FETCH_ROWS(t, offs[i]);
            }
            const __mmask16 live = (__mmask16)((1u << nk) - 1);
            __m512 dist = _mm512_setzero_ps(); /* ALiBi: each key's j - (L - 1) */
            if (slopes)
                for (int i = 0; i < 16; i++) ((float *)&dist)[i] = (float)(J_OF(scored + (i < nk ? i : 0)) - (L - 1));
            for (int g = 0; g < gc; g++) {
                __m512 a[16];
                for (int i = 0; i < 16; i++) a[i] = _mm512_setzero_ps();
                for (int64_t d = 0; d < D; d += 32) { /* all 16 (a short block repeats its first key): a[] in registers */
                    __m512bh qv = (__m512bh)_mm512_loadu_si512(q16 + g * D + d);
                    for (int i = 0; i < 16; i++)
                        a[i] = _mm512_dpbf16_ps(a[i], qv, (__m512bh)_mm512_loadu_si512((const uint16_t *)k_pool + offs[i] + d));
                }
                /* score = sum * scale (+ slope * distance, rounded as the scalar sum of the two) */
                __m512 sc = _mm512_mul_ps(_mm512_permutexvar_ps(key_order, sum16v(a)), _mm512_set1_ps(scale));
                if (slopes) sc = _mm512_add_ps(sc, _mm512_mul_ps(_mm512_set1_ps(slopes[h0 + g]), dist));
                _mm512_mask_storeu_ps(scores + g * n + scored, live, sc);
                mxv[g] = _mm512_mask_max_ps(mxv[g], live, mxv[g], sc);
            }
        }
    for (int g = 0; g < gc; g++) {
        float m = _mm512_reduce_max_ps(mxv[g]);
        if (m > mx[g]) mx[g] = m;
    }
#endif
    for (int64_t t = scored; t < n; t++) {
        int64_t j = J_OF(t), off = (SLOT_OF(j) * KVH + kvh) * D;
#if BST_SIMD
        FETCH_ROWS(t, off);
#endif
        const void *kp = k_pool;
        int kdt = kvdt;
        if (kv_scales) { /* codes -> a float row */
            load_kv_row(k_pool, kvdt, off, D, kv_scales[0], row);
            kp = row, kdt = DT_F32, off = 0;
        }
        for (int g = 0; g < gc; g++) {
            float s = 0.f;
#if BST_BF16DOT
            if (dot) {
                s = dot_bf16(q16 + g * D, (const uint16_t *)k_pool + off, D);
            } else
#endif
#if BST_SIMD
            {
                vf a = vzero();
                int64_t d = 0;
                for (; d + VW <= D; d += VW) a = vfmadd(vloadu(qf[g] + d), vload_any(kp, kdt, off + d), a);
                if (d < D) a = vfmadd(vloadu(qf[g] + d), vload_any_part(kp, kdt, off + d, D - d), a);
                s = vsum(a);
            }
#else
            for (int64_t d = 0; d < D; d++) s += qf[g][d] * load_f(kp, kdt, off + d);
#endif
            s *= scale;
            if (slopes) s += slopes[h0 + g] * (float)(j - (L - 1));
            scores[g * n + t] = s;
            if (s > mx[g]) mx[g] = s;
        }
    }
    for (int g = 0; g < gc; g++) {
        float *sc = scores + g * n, sum = 0.f;
        int64_t t = 0;
#if BST_SIMD
        vf tv = vzero();
        for (; t + VW <= n; t += VW) {
            vf e = vexp(vsub(vloadu(sc + t), vset1(mx[g])));
            vstoreu(sc + t, e);
            tv = vadd(tv, e);
        }
        sum = vsum(tv);
#endif
        for (; t < n; t++) {
            sc[t] = expf(sc[t] - mx[g]);
            sum += sc[t];
        }
        t = 0; /* the weights p = e / total, a vector of divisions at a time (each as the scalar one) */
#if BST_SIMD
        for (; t + VW <= n; t += VW) vstoreu(sc + t, vdiv(vloadu(sc + t), vset1(sum)));
#endif
        for (; t < n; t++) sc[t] /= sum;
    }
    int in_registers = 0;
#if BST_SIMD
    in_registers = !kv_scales && D % VW == 0 && D <= 8 * VW;
    if (in_registers) { /* 4 vectors of every head's sum in registers (16 at most) per walk over the keys */
        const int64_t nd = D / VW;
        for (int64_t c0 = 0; c0 < nd; c0 += 4) {
            vf va[GQ][4];
            for (int g = 0; g < GQ; g++)
                for (int c = 0; c < 4; c++) va[g][c] = vzero();
            for (int64_t t = 0; t < n; t++) {
                int64_t j = J_OF(t), off = (SLOT_OF(j) * KVH + kvh) * D + c0 * VW;
                vf pv[GQ];
                for (int g = 0; g < GQ; g++)
                    if (g < gc) pv[g] = vset1(scores[g * n + t]);
                for (int c = 0; c < 4; c++)
                    if (c0 + c < nd) {
                        vf vr = vload_any(v_pool, kvdt, off + c * VW);
                        for (int g = 0; g < GQ; g++)
                            if (g < gc) va[g][c] = vfmadd(pv[g], vr, va[g][c]);
                    }
            }
            for (int g = 0; g < gc; g++)
                for (int c = 0; c < 4; c++)
                    if (c0 + c < nd) vstoreu(acc[g] + (c0 + c) * VW, va[g][c]);
        }
    }
#endif
    for (int64_t t = 0; t < n && !in_registers; t++) {
        int64_t j = J_OF(t), off = (SLOT_OF(j) * KVH + kvh) * D;
        const void *vp = v_pool;
        int vdt = kvdt;
        if (kv_scales) {
            load_kv_row(v_pool, kvdt, off, D, kv_scales[1], row);
            vp = row, vdt = DT_F32, off = 0;
        }
        for (int g = 0; g < gc; g++) {
            float p = scores[g * n + t];
#if BST_SIMD
            vf pv = vset1(p);
            int64_t d = 0;
            for (; d + VW <= D; d += VW) vstoreu(acc[g] + d, vfmadd(pv, vload_any(vp, vdt, off + d), vloadu(acc[g] + d)));
            if (d < D) vstoreu(acc[g] + d, vfmadd(pv, vload_any_part(vp, vdt, off + d, D - d), vloadu(acc[g] + d)));
#else
            for (int64_t d = 0; d < D; d++) acc[g][d] += p * load_f(vp, vdt, off + d);
#endif
        }
    }
    for (int g = 0; g < gc; g++)
        from_f32(acc[g], D, (char *)out + (b * H + h0 + g) * D * (odt == DT_F32 ? 4 : 2), odt);
    if (scores != stack_scores) free(scores);
#undef J_OF
#undef SLOT_OF
#undef FETCH_ROWS
}

void bst_decode_attention(const void *q, int qdt, int64_t q_stride, const void *k_pool, const void *v_pool, int kvdt,
                          const int64_t *tables, int64_t max_blocks, const int64_t *kv_lens, int64_t B,
                          int64_t H, int64_t KVH, int64_t D, int64_t bs, float scale, const float *slopes,
                          void *out, int odt, const float *kv_scales, const int64_t *windows, int threads) {
    int64_t G = H / KVH, chunks = (G + GQ - 1) / GQ, parts = threads < 1 ? 1 : threads;
    int bs_shift = -1; /* log2(bs) when bs is a power of two: a key's block and row by shifts */
    for (int e = 0; e < 31; e++)
        if ((int64_t)1 << e == bs) bs_shift = e;
    /* a task per sequence, key head and group of its query heads */
#pragma omp parallel for num_threads(parts) schedule(dynamic, 1)
    for (int64_t u = 0; u < B * KVH * chunks; u++) {
        int64_t b = u / (KVH * chunks), kvh = u / chunks % KVH, h0 = kvh * G + u % chunks * GQ;
        int gc = (int)(kvh * G + G - h0 < GQ ? kvh * G + G - h0 : GQ); /* heads h0 .. h0 + gc */
        attend_heads(q, qdt, q_stride, k_pool, v_pool, kvdt, tables, max_blocks, kv_lens, B, H, KVH, D, bs, bs_shift,
                     scale, slopes, out, odt, kv_scales, windows, b, kvh, h0, gc);
    }
}
#undef GQ

/* Causal attention of n new queries over L keys (prefill), bfloat16, on the avx512bf16 build:
 * out[i, h] = sum_j softmax_j(q[i, h] . k[j, h / G] * scale) v[j, h / G] over the keys j <= L - n + i
 * (query i sits at position L - n + i; G = H / KVH). q row i of head h at q + i * q_stride + h * D,
 * key / value row j of key head c at k + j * k_stride + c * D (likewise v), out [n, H, D] contiguous.
 * D % 32 == 0, D <= PF_MAX_D. Flash-style: per task a head and PF_QB queries, keys PF_QB at a time;
 * the key block transposed once into dim pairs (transpose16), then each query's 16 scores in one
 * register, a vdpbf16ps per dim pair with the query's pair broadcast (exact products, float32 sums;
 * no lane sums: 1.35-1.4x the per-key dot products and shuffle tree this replaced), an online softmax in
 * float32, p v in vdpbf16ps over key pairs (p rounded to bfloat16 as torch's bf16 SDPA does, float32
 * sums). */
#define PF_QB 16
#define PF_MAX_D 256
#if BST_BF16DOT
/* m[i] lane j <- m[j] lane i: a 16 x 16 matrix of 32-bit elements (rows m[0..15]) transposed in
 * registers (32-bit, then 64-bit interleaves within 128-bit lanes, then two rounds of lane shuffles) */
INLINE void transpose16(__m512i m[16]) {
    __m512i a[16], b[16];
    for (int i = 0; i < 16; i += 2) {
        a[i] = _mm512_unpacklo_epi32(m[i], m[i + 1]);
        a[i + 1] = _mm512_unpackhi_epi32(m[i], m[i + 1]);
    }
    for (int i = 0; i < 16; i += 4) {
        b[i] = _mm512_unpacklo_epi64(a[i], a[i + 2]);
        b[i + 1] = _mm512_unpackhi_epi64(a[i], a[i + 2]);
        b[i + 2] = _mm512_unpacklo_epi64(a[i + 1], a[i + 3]);
        b[i + 3] = _mm512_unpackhi_epi64(a[i + 1], a[i + 3]);
    }
    for (int c = 0; c < 4; c++) { /* b[4 g + c] lane 4 l + u = m[4 g + u] lane 4 l + c (l: 128-bit lane) */
        __m512i y0 = _mm512_shuffle_i32x4(b[c], b[4 + c], 0x88), y1 = _mm512_shuffle_i32x4(b[c], b[4 + c], 0xDD);
        __m512i y2 = _mm512_shuffle_i32x4(b[8 + c], b[12 + c], 0x88), y3 = _mm512_shuffle_i32x4(b[8 + c], b[12 + c], 0xDD);
        m[c] = _mm512_shuffle_i32x4(y0, y2, 0x88);
        m[8 + c] = _mm512_shuffle_i32x4(y0, y2, 0xDD);
        m[4 + c] = _mm512_shuffle_i32x4(y1, y3, 0x88);
        m[12 + c] = _mm512_shuffle_i32x4(y1, y3, 0xDD);
    }
}

/* s[r] += the 16 scores q_r . k_t (lane t) of R query rows (qd[r]: row r's dims as bfloat16 pairs) against
 * a key block transposed in pairs (kt[p] lane t: key t's dims 2 p, 2 p + 1): per pair one vdpbf16ps per
 * row with the row's pair broadcast, R independent sums (called with R = 16 where it can: in registers) */
INLINE void pf_scores(__m512 *s, const uint32_t *const *qd, const __m512i *kt, int64_t pairs, const int R) {
    for (int r = 0; r < R; r++) s[r] = _mm512_setzero_ps();
    for (int64_t p = 0; p < pairs; p++)
        for (int r = 0; r < R; r++)
            s[r] = _mm512_dpbf16_ps(s[r], (__m512bh)kt[p], (__m512bh)_mm512_set1_epi32((int)qd[r][p]));
}

/* accr[:16 nd] = accr * cv + sum over key pairs kp < pairs of p[2 kp] v[2 kp] + p[2 kp + 1] v[2 kp + 1]:
 * pp[kp] holds the pair's two bfloat16 weights, vp[kp][u] dims 16 u .. 16 u + 15 of the two value rows
 * interleaved (vdpbf16ps; called with a constant nd where it can) */
INLINE void pf_pv(float *accr, const __m512i (*vp)[PF_MAX_D / 16], const uint32_t *pp, int pairs, __m512 cv,
                  const int nd) {
    __m512 av[PF_MAX_D / 16];
    for (int u = 0; u < nd; u++) av[u] = _mm512_mul_ps(_mm512_loadu_ps(accr + 16 * u), cv);
    for (int kp = 0; kp < pairs; kp++) {
        __m512bh pk = (__m512bh)_mm512_set1_epi32((int)pp[kp]);
        for (int u = 0; u < nd; u++) av[u] = _mm512_dpbf16_ps(av[u], (__m512bh)vp[kp][u], pk);
    }
    for (int u = 0; u < nd; u++) _mm512_storeu_ps(accr + 16 * u, av[u]);
}
#endif

void bst_prefill_attention(const uint16_t *q, int64_t q_stride, const uint16_t *k, int64_t k_stride, const uint16_t *v,
                           int64_t v_stride, uint16_t *out, int64_t n, int64_t L, int64_t H, int64_t KVH, int64_t D,
                           float scale, int threads) {
    int64_t G = H / KVH, blocks = (n + PF_QB - 1) / PF_QB;
#pragma omp parallel for num_threads(threads < 1 ? 1 : threads) schedule(dynamic, 1)
    for (int64_t task = 0; task < H * blocks; task++) {
        int64_t h = task % H, c = h / G, i0 = (blocks - 1 - task / H) * PF_QB; /* the longest blocks first */
        int rows = (int)(n - i0 < PF_QB ? n - i0 : PF_QB);
#if BST_BF16DOT
        float m[PF_QB], l[PF_QB];
        float acc[PF_QB][PF_MAX_D];
        __m512i vp[PF_QB / 2][PF_MAX_D / 16]; /* the block's value rows in key pairs (pf_pv) */
        __m512i kt[PF_MAX_D / 2];             /* the block's keys in pairs, transposed (pf_scores) */
        __m512 s[PF_QB];                      /* the scores of each query row (lane t: key t) */
        const uint32_t *qd[PF_QB];
        const int nd = (int)(D / 16);
        for (int r = 0; r < rows; r++) qd[r] = (const uint32_t *)(q + (i0 + r) * q_stride + h * D);
        for (int r = 0; r < rows; r++) {
            m[r] = -INFINITY, l[r] = 0.f;
            memset(acc[r], 0, sizeof(float) * (size_t)D);
        }
        int64_t kend = L - n + i0 + rows; /* keys the last query sees */
        for (int64_t j0 = 0; j0 < kend; j0 += PF_QB) {
            int nk = (int)(kend - j0 < PF_QB ? kend - j0 : PF_QB);
            const uint16_t *krow[PF_QB];
            for (int t = 0; t < nk; t++) krow[t] = k + (j0 + t) * k_stride + c * D;
            for (int kp = 0; kp < (nk + 1) / 2; kp++) { /* dims of keys 2 kp, 2 kp + 1 interleaved (a missing one: 0) */
                const uint16_t *va = v + (j0 + 2 * kp) * v_stride + c * D, *vb = va + v_stride;
                for (int u = 0; u < nd; u++) {
                    __m512i lo = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(va + 16 * u)));
                    __m512i hi = 2 * kp + 1 < nk ? _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(vb + 16 * u)))
                                                 : _mm512_setzero_si512();
                    vp[kp][u] = _mm512_or_si512(lo, _mm512_slli_epi32(hi, 16));
                }
            }
            for (int t = nk; t < PF_QB; t++) krow[t] = krow[0]; /* a short block: key j0 again (masked) */
            for (int64_t c = 0; c < D / 32; c++) { /* 32 dims (16 pairs) of the 16 keys at a time */
                __m512i m16[16];
                for (int t = 0; t < 16; t++) m16[t] = _mm512_loadu_si512(krow[t] + 32 * c);
                transpose16(m16);
                for (int p = 0; p < 16; p++) kt[16 * c + p] = m16[p];
            }
            if (rows == PF_QB)
                pf_scores(s, qd, kt, D / 2, PF_QB);
            else
                for (int r = 0; r < rows; r++) pf_scores(s + r, qd + r, kt, D / 2, 1);
            for (int r = 0; r < rows; r++) {
                int64_t lim = L - n + i0 + r + 1; /* keys < lim */
                if (j0 >= lim) continue;
                int nv = (int)(lim - j0 < nk ? lim - j0 : nk);
                __mmask16 valid = (__mmask16)((1u << nv) - 1u); /* keys past nv (key j0 again) masked */
                __m512 sv = _mm512_mask_mul_ps(_mm512_set1_ps(-INFINITY), valid, s[r], _mm512_set1_ps(scale));
                float bmax = _mm512_reduce_max_ps(sv);
                float mnew = m[r] > bmax ? m[r] : bmax; /* the running max moves in few blocks: e^0 and e^-inf skipped */
                float corr = mnew == m[r] ? 1.f : m[r] == -INFINITY ? 0.f : expf(m[r] - mnew);
                __m512 e = _mm512_maskz_mov_ps(valid, vexp(_mm512_sub_ps(sv, _mm512_set1_ps(mnew))));
                l[r] = l[r] * corr + _mm512_reduce_add_ps(e);
                m[r] = mnew;
                uint32_t pp[8]; /* the weights in key order, rounded to bfloat16, in pairs */
                _mm256_storeu_si256((__m256i *)pp, (__m256i)_mm512_cvtneps_pbh(e));
                __m512 cv = _mm512_set1_ps(corr); /* acc[r] = acc[r] * corr + sum_t p_t v_t */
                int pairs = (nv + 1) / 2;
                switch (nd) { /* the common head sizes with constant bounds: the sums in registers */
                    case 2: pf_pv(acc[r], vp, pp, pairs, cv, 2); break;
                    case 4: pf_pv(acc[r], vp, pp, pairs, cv, 4); break;
                    case 8: pf_pv(acc[r], vp, pp, pairs, cv, 8); break;
                    default: pf_pv(acc[r], vp, pp, pairs, cv, nd);
                }
            }
        }
        for (int r = 0; r < rows; r++) {
            float inv = 1.f / l[r];
            for (int64_t d = 0; d < D; d++) acc[r][d] *= inv;
            from_f32(acc[r], D, out + ((i0 + r) * H + h) * D, DT_BF16);
        }
#else /* called on the avx512bf16 build only: NaN rather than a plausible wrong answer */
        for (int r = 0; r < rows; r++)
            for (int64_t d = 0; d < D; d++) out[((i0 + r) * H + h) * D + d] = 0x7fc0;
        (void)q, (void)q_stride, (void)k, (void)k_stride, (void)v, (void)v_stride, (void)L, (void)c, (void)scale;
#endif
    }
}
#undef PF_QB

/* ---------------------------------------------------------------------------------------- */
/* greedy sampling                                                                           */
/* ---------------------------------------------------------------------------------------- */

/* out[b] = the first index of the largest of x[b, :V] (float32), as torch.argmax: a NaN counts as
 * the largest (the first NaN's index). One pass: per lane the largest value and where it first
 * was (a strictly larger value moves it), then the lanes' best, the lowest index among ties. */
void bst_argmax_rows(const float *x, int64_t B, int64_t V, int64_t *out, int threads) {
#pragma omp parallel for num_threads(threads < 1 ? 1 : threads) schedule(static) if (B > 1)
    for (int64_t b = 0; b < B; b++) {
        const float *r = x + b * V;
        int64_t j = 0, at = -1;
        float best = -INFINITY;
#if BST_SIMD
        vf m = vset1(-INFINITY);
        vi where = vi_set1(-1), idx, nan = vi_set1(0); /* where: each lane's first maximum; nan: lanes that saw one */
        int32_t lane[VW];
        for (int l = 0; l < VW; l++) lane[l] = l;
        idx = vf_as_i(vloadu((const float *)lane));
        for (; j + VW <= V && V < INT32_MAX; j += VW) {
            vf v = vloadu(r + j);
            where = vi_select_lt(m, v, idx, where); /* strictly larger: the lane's maximum moves */
            m = vselect_lt(m, v, v, m);
            nan = vi_or(nan, vi_select_nan(v, vi_set1(1), vi_set1(0)));
            idx = vi_add(idx, vi_set1(VW));
        }
        float lanes[VW];
        int32_t pos[VW], seen[VW];
        vstoreu(lanes, m);
        vstoreu((float *)pos, vi_as_f(where));
        vstoreu((float *)seen, vi_as_f(nan));
        int any_nan = 0;
        for (int l = 0; l < VW; l++) any_nan |= seen[l] != 0;
        if (any_nan) { /* the first NaN */
            for (at = 0; r[at] == r[at]; at++) {}
            out[b] = at;
            continue;
        }
        for (int l = 0; l < VW; l++)
            if (pos[l] >= 0 && (lanes[l] > best || (lanes[l] == best && pos[l] < at))) best = lanes[l], at = pos[l];
#endif
        for (; j < V; j++) {
            if (r[j] != r[j]) { /* the first NaN (the vector part had none) */
                at = j;
                break;
            }
            if (r[j] > best) best = r[j], at = j;
        }
        out[b] = at < 0 ? 0 : at;
    }
}

/* ---------------------------------------------------------------------------------------- */
/* elementwise: norms, rotary, gated activations                                            */
/* ---------------------------------------------------------------------------------------- */

/* h = x + residual (if residual; stored to h_out in dt), y = h / sqrt(mean(h^2) + eps) * w.
 * x, residual, h_out, y [T, H] in dt; w [H] in wdt. The sum is rounded to dt before the norm
 * (as the torch reference does). */
void bst_rms_norm(const void *x, const void *residual, void *h_out, void *y, int dt, const void *w, int wdt,
                  int64_t T, int64_t H, float eps, int threads) {
#pragma omp parallel for num_threads(threads < 1 ? 1 : threads) schedule(static) if (T > 1)
    for (int64_t t = 0; t < T; t++) {
        float hbuf[16384];
        float *h = H <= 16384 ? hbuf : (float *)malloc(sizeof(float) * (size_t)H);
        double ss = 0.0;
        int64_t i = 0;
#if BST_SIMD
        vf sv[2] = {vzero(), vzero()};
        for (; i + VW <= H; i += VW) {
            vf v = vload_any(x, dt, t * H + i);
            if (residual) {
                v = vadd(v, vload_any(residual, dt, t * H + i));
                if (dt == DT_BF16) v = vround_bf16(v);
                vstore_any(h_out, dt, t * H + i, v);
            }
            vstoreu(h + i, v);
            sv[(i / VW) & 1] = vfmadd(v, v, sv[(i / VW) & 1]);
        }
        ss = (double)vsum(vadd(sv[0], sv[1]));
#endif
        for (; i < H; i++) {
            float v = load_f(x, dt, t * H + i);
            if (residual) {
                v += load_f(residual, dt, t * H + i);
                if (dt == DT_BF16) v = bf16_to_f32(f32_to_bf16(v));
                store_f(h_out, dt, t * H + i, v);
            }
            h[i] = v;
            ss += (double)v * v;
        }
        float inv = 1.0f / sqrtf((float)(ss / (double)H) + eps);
        i = 0;
#if BST_SIMD
        for (; i + VW <= H; i += VW)
            vstore_any(y, dt, t * H + i, vmul(vmul(vloadu(h + i), vset1(inv)), vload_any(w, wdt, i)));
#endif
        for (; i < H; i++) store_f(y, dt, t * H + i, h[i] * inv * load_f(w, wdt, i));
        if (h != hbuf) free(h);
    }
}

/* Rotate the n heads of one token (x: its first head, heads D apart) in place: pair (a, b) =
 * (i, i + rot/2) (neox) or (2i, 2i + 1) (gptj), i < rot/2, by the angle with cos[i], sin[i]:
 * a' = a cos - b sin, b' = b cos + a sin. Vectors: neox reads VW a's and VW b's; gptj reads
 * VW / 2 interleaved pairs, the cos / sin of each pair duplicated, b a swapped within pairs. */
static void rotary_token(void *x, int dt, int64_t base, int64_t n, int64_t D, const void *cos, const void *sin,
                         int64_t cs_off, int csdt, int64_t rot, int gptj) {
    int64_t half = rot / 2, i0 = 0;
#if BST_SIMD
    float cb[512], sb[512];
    if (half <= 512) {
        int64_t esize = csdt == DT_F32 ? 4 : 2;
        to_f32((const char *)cos + cs_off * esize, csdt, half, cb);
        to_f32((const char *)sin + cs_off * esize, csdt, half, sb);
        i0 = gptj ? half / (VW / 2) * (VW / 2) : half / VW * VW; /* the pairs the vectors take */
        for (int64_t hd = 0; hd < n; hd++) {
            int64_t hb = base + hd * D;
            if (gptj) {
                for (int64_t i = 0; i < i0; i += VW / 2) {
                    vf v = vload_any(x, dt, hb + 2 * i);
                    vstore_any(x, dt, hb + 2 * i, vfmaddsub(v, vdup_pairs(cb + i), vmul(vswap_pairs(v), vdup_pairs(sb + i))));
                }
            } else {
                for (int64_t i = 0; i < i0; i += VW) {
                    vf a = vload_any(x, dt, hb + i), b = vload_any(x, dt, hb + half + i);
                    vf c = vloadu(cb + i), sn = vloadu(sb + i);
                    vstore_any(x, dt, hb + i, vfmsub(a, c, vmul(b, sn)));
                    vstore_any(x, dt, hb + half + i, vfmadd(b, c, vmul(a, sn)));
                }
            }
        }
    }
#endif
    for (int64_t hd = 0; hd < n; hd++)
        for (int64_t i = i0; i < half; i++) {
            int64_t ia = base + hd * D + (gptj ? 2 * i : i), ib = base + hd * D + (gptj ? 2 * i + 1 : i + half);
            float a = load_f(x, dt, ia), b = load_f(x, dt, ib);
            float c = load_f(cos, csdt, cs_off + i), s = load_f(sin, csdt, cs_off + i);
            store_f(x, dt, ia, a * c - b * s);
            store_f(x, dt, ib, b * c + a * s);
        }
}

/* x [T, n, D] (x_stride elements between tokens) rotated in place with cos / sin rows
 * [T, rot/2] (cs_stride elements between tokens, dtype csdt). */
void bst_rotary(void *x, int dt, int64_t T, int64_t n, int64_t D, int64_t x_stride, const void *cos,
                const void *sin, int64_t cs_stride, int csdt, int64_t rot, int gptj) {
    for (int64_t t = 0; t < T; t++) rotary_token(x, dt, t * x_stride, n, D, cos, sin, t * cs_stride, csdt, rot, gptj);
}

/* The same at positions[t] of a float32 table cos_sin [P, rot] = [cos | sin]. */
static void rotary_at(void *x, int dt, int64_t T, int64_t n, int64_t D, int64_t x_stride, const int64_t *positions,
                      const float *cos_sin, int64_t rot, int gptj) {
    for (int64_t t = 0; t < T; t++) {
        const float *cs = cos_sin + positions[t] * rot;
        rotary_token(x, dt, t * x_stride, n, D, cs, cs + rot / 2, 0, DT_F32, rot, gptj);
    }
}

INLINE float act_of(float f, int act) {
    if (act == 0) return f / (1.f + expf(-f));
    if (act == 1) return 0.5f * f * (1.f + erff(f * 0.7071067811865476f));
    if (act == 2) return 0.5f * f * (1.f + tanhf(0.7978845608028654f * (f + 0.044715f * f * f * f)));
    return f > 0.f ? f : 0.f;
}

#if BST_SIMD
/* act_of on a vector. silu f / (1 + e^-f); gelu 0.5 f (1 + erf(z)), z = f / sqrt 2, with
 * 1 + erf(z) = 2 - erfc(z) (z >= 0) or erfc(|z|) (z < 0) and erfc(|z|) = t P(t) e^(-z^2),
 * t = 1 / (1 + 0.3275911 |z|) (Abramowitz & Stegun 7.1.26, |error| < 1.5e-7); gelu_new
 * 0.5 f (1 + tanh u) = f / (1 + e^(-2u)) (no cancellation); relu max(f, 0). */
INLINE vf vact(vf f, int act) {
    if (act == 0) return vdiv(f, vadd(vset1(1.f), vexp(vsub(vzero(), f))));
    if (act == 1) {
        vf z = vmul(f, vset1(0.7071067811865476f)), za = vabs(z);
        vf t = vdiv(vset1(1.f), vfmadd(za, vset1(0.3275911f), vset1(1.f)));
        vf poly = vfmadd(t, vset1(1.061405429f), vset1(-1.453152027f));
        poly = vfmadd(poly, t, vset1(1.421413741f));
        poly = vfmadd(poly, t, vset1(-0.284496736f));
        poly = vfmadd(poly, t, vset1(0.254829592f));
        vf erfc = vmul(vmul(poly, t), vexp(vmul(vsub(vzero(), za), za)));
        return vmul(vmul(vset1(0.5f), f), vselect_lt(z, vzero(), erfc, vsub(vset1(2.f), erfc)));
    }
    if (act == 2) {
        vf u = vmul(vset1(0.7978845608028654f), vfmadd(vmul(vmul(f, f), f), vset1(0.044715f), f));
        return vdiv(f, vadd(vset1(1.f), vexp(vmul(vset1(-2.f), u))));
    }
    return vmax(f, vzero());
}
#endif

void bst_act_and_mul(const void *fg, void *y, int dt, int64_t T, int64_t I, int act, int threads) {
#pragma omp parallel for num_threads(threads < 1 ? 1 : threads) schedule(static) if (T * I >= 65536)
    for (int64_t t = 0; t < T; t++) {
        int64_t i = 0;
#if BST_SIMD
        for (; i + VW <= I; i += VW) {
            vf a = vact(vload_any(fg, dt, t * 2 * I + i), act), g = vload_any(fg, dt, t * 2 * I + I + i);
            if (dt == DT_BF16) a = vround_bf16(a); /* the reference rounds act(f) first */
            vstore_any(y, dt, t * I + i, vmul(a, g));
        }
#endif
        for (; i < I; i++) {
            float f = load_f(fg, dt, t * 2 * I + i), g = load_f(fg, dt, t * 2 * I + I + i);
            float a = act_of(f, act);
            if (dt == DT_BF16) a = bf16_to_f32(f32_to_bf16(a)); /* the reference rounds act(f) first */
            store_f(y, dt, t * I + i, a * g);
        }
    }
}

/* ---------------------------------------------------------------------------------------- */
/* LoRA rows: each row's own adapter's low-rank update, added in place to a linear's output */
/* ---------------------------------------------------------------------------------------- */

/* v[r] = scale[r0 + r] * sum_k xf[k] A[r0 + r, k] for r < n (A [R, K] in wdt) */
static void lora_dots(const float *xf, int64_t K, const void *A, int wdt, int64_t r0, int64_t n, const float *scale,
                      float *v) {
    int64_t r = 0;
#if BST_SIMD
    for (; r + 4 <= n; r += 4) { /* four rows share each x vector */
        const int64_t o = (r0 + r) * K;
        vf s0 = vzero(), s1 = vzero(), s2 = vzero(), s3 = vzero();
        int64_t k = 0;
        for (; k + VW <= K; k += VW) {
            vf xv = vloadu(xf + k);
            s0 = vfmadd(xv, vload_any(A, wdt, o + k), s0);
            s1 = vfmadd(xv, vload_any(A, wdt, o + K + k), s1);
            s2 = vfmadd(xv, vload_any(A, wdt, o + 2 * K + k), s2);
            s3 = vfmadd(xv, vload_any(A, wdt, o + 3 * K + k), s3);
        }
        if (k < K) {
            vf xv = vload_any_part(xf, DT_F32, k, K - k);
            s0 = vfmadd(xv, vload_any_part(A, wdt, o + k, K - k), s0);
            s1 = vfmadd(xv, vload_any_part(A, wdt, o + K + k, K - k), s1);
            s2 = vfmadd(xv, vload_any_part(A, wdt, o + 2 * K + k, K - k), s2);
            s3 = vfmadd(xv, vload_any_part(A, wdt, o + 3 * K + k, K - k), s3);
        }
        v[r] = vsum(s0) * scale[r0 + r];
        v[r + 1] = vsum(s1) * scale[r0 + r + 1];
        v[r + 2] = vsum(s2) * scale[r0 + r + 2];
        v[r + 3] = vsum(s3) * scale[r0 + r + 3];
    }
#endif
    for (; r < n; r++) {
        float acc = 0.f;
        for (int64_t k = 0; k < K; k++) acc += xf[k] * load_f(A, wdt, (r0 + r) * K + k);
        v[r] = acc * scale[r0 + r];
    }
}

/* out[n0 + j] (odt) += sum_{r < rank} v[r] Bp[r * rows + j] for j < rows (Bp^T [rank, rows] in wdt), summed
 * in float32 and rounded once */
static void lora_piece_add(const float *v, int64_t rank, const void *B, int wdt, int64_t b_off, int64_t rows,
                           void *out, int odt, int64_t n0) {
    int64_t j = 0;
#if BST_SIMD
    for (; j + 4 * VW <= rows; j += 4 * VW) { /* four independent FMA chains */
        vf c0 = vzero(), c1 = vzero(), c2 = vzero(), c3 = vzero();
        for (int64_t r = 0; r < rank; r++) {
            vf s = vset1(v[r]);
            int64_t o = b_off + r * rows + j;
            c0 = vfmadd(s, vload_any(B, wdt, o), c0);
            c1 = vfmadd(s, vload_any(B, wdt, o + VW), c1);
            c2 = vfmadd(s, vload_any(B, wdt, o + 2 * VW), c2);
            c3 = vfmadd(s, vload_any(B, wdt, o + 3 * VW), c3);
        }
        vstore_any(out, odt, n0 + j, vadd(vload_any(out, odt, n0 + j), c0));
        vstore_any(out, odt, n0 + j + VW, vadd(vload_any(out, odt, n0 + j + VW), c1));
        vstore_any(out, odt, n0 + j + 2 * VW, vadd(vload_any(out, odt, n0 + j + 2 * VW), c2));
        vstore_any(out, odt, n0 + j + 3 * VW, vadd(vload_any(out, odt, n0 + j + 3 * VW), c3));
    }
    for (; j + VW <= rows; j += VW) {
        vf c = vzero();
        for (int64_t r = 0; r < rank; r++) c = vfmadd(vset1(v[r]), vload_any(B, wdt, b_off + r * rows + j), c);
        vstore_any(out, odt, n0 + j, vadd(vload_any(out, odt, n0 + j), c));
    }
#endif
    for (; j < rows; j++) {
        float acc = 0.f;
        for (int64_t r = 0; r < rank; r++) acc += v[r] * load_f(B, wdt, b_off + r * rows + j);
        store_f(out, odt, n0 + j, load_f(out, odt, n0 + j) + acc);
    }
}

/* out [T, N] (odt) += each row's own adapter's update on x [T, K] (xdt); rows with idx[t] < 0 or >= L
 * are left alone. Adapter a = idx[t] adds, for each of its pieces (r0, rank, n0, rows, b_off):
 *
 *   v[r] = scale[r0 + r] * sum_k x[t, k] A[r0 + r, k]                         r < rank
 *   out[t, n0 + j] += sum_r v[r] B[b_off + r * rows + j]                      j < rows
 *
 * A [R, K] and B (its pieces' B^T [rank, rows] one after another) in wdt (float / bfloat16), scale
 * [R] float. layout (int64): L + 1 piece starts (adapter a's pieces are start[a] .. start[a + 1] - 1),
 * then 5 per piece as above. An adapter's pieces cover disjoint columns, so each output is read,
 * summed in float32 and rounded once. A == NULL: nothing to add. Rows are taken adapter by adapter
 * (an adapter's weights stay in cache across its rows), split over threads when the work is large. */
void bst_lora_rows(const void *x, int xdt, int64_t T, int64_t K, const void *A, const void *B, int wdt,
                   const float *scale, const int64_t *layout, int64_t L, const int64_t *idx, void *out, int odt,
                   int64_t N, int threads) {
    if (A == NULL || T <= 0) return;
    const int64_t *pieces = layout + L + 1;
    int64_t *order = (int64_t *)malloc(sizeof(int64_t) * (size_t)T);
    int64_t m = 0, work = 0, rmax = 1;
    for (int64_t p = 0; p < layout[L]; p++)
        if (pieces[5 * p + 1] > rmax) rmax = pieces[5 * p + 1];
    for (int64_t a = 0; a < L; a++)
        for (int64_t t = 0; t < T; t++)
            if (idx[t] == a) {
                order[m++] = t;
                for (int64_t p = layout[a]; p < layout[a + 1]; p++) work += pieces[5 * p + 1] * (K + pieces[5 * p + 3]);
            }
    if (m == 0) {
        free(order);
        return;
    }
    int parts = threads < 1 ? 1 : threads;
    if (parts > m) parts = (int)m;
    if (work < (1 << 18)) parts = 1; /* a few microseconds: not worth waking threads */
    const int64_t stride = K + rmax + 16;
    float *scratch = (float *)malloc(sizeof(float) * (size_t)(stride * parts));
    const size_t xs = xdt == DT_F32 ? 4 : 2, os = odt == DT_F32 ? 4 : 2;
#pragma omp parallel for num_threads(parts) schedule(static) if (parts > 1)
    for (int64_t i = 0; i < m; i++) {
        float *xf = scratch + stride * omp_get_thread_num(), *v = xf + K;
        int64_t t = order[i], a = idx[t];
        to_f32((const char *)x + (size_t)(t * K) * xs, xdt, K, xf);
        void *row = (char *)out + (size_t)(t * N) * os;
        for (int64_t p = layout[a]; p < layout[a + 1]; p++) {
            const int64_t *pc = pieces + 5 * p;
            lora_dots(xf, K, A, wdt, pc[0], pc[1], scale, v);
            lora_piece_add(v, pc[1], B, wdt, pc[4], pc[3], row, odt, pc[2]);
        }
    }
    free(scratch);
    free(order);
}

/* ---------------------------------------------------------------------------------------- */
/* step plans: a whole decode step as one list of ops, run by one call                      */
/* ---------------------------------------------------------------------------------------- */

/* One op of a plan (bestiary.core.runtime.cpu_plan builds them). Pointers are fixed when the plan is
 * built; what changes per step (token ids, positions, kv lengths, block tables, slots) lives
 * in buffers the ops point at. */
typedef struct {
    int64_t op;
    int64_t dt[4];
    void *p[8];
    int64_t i[8];
    float f[2];
} bst_op;

enum { OP_EMBED = 0, OP_RMS_NORM = 1, OP_LINEAR = 2, OP_ROTARY = 3, OP_KV_WRITE = 4, OP_ATTENTION = 5,
       OP_ACT_MUL = 6, OP_LORA = 7 };

/* out[t, :] = table[ids[t], :] with table element (v, h) at v * s0 + h * s1 (a tied embedding
 * may be held transposed), or where w_off puts it in a tiled table (a tied one in row tiles). */
static void embed(const void *table, int tdt, int64_t s0, int64_t s1, const int64_t *ids, void *out, int odt,
                  int64_t T, int64_t H) {
    for (int64_t t = 0; t < T; t++)
        for (int64_t h = 0; h < H; h++) {
            int64_t off = tiled_dt(tdt) ? w_off(tdt, ids[t], h, H) : ids[t] * s0 + h * s1;
            store_f(out, odt, t * H + h, load_f(table, elem_dt(tdt), off));
        }
}

void bst_run_plan(const bst_op *ops, int64_t n, int threads) {
    for (int64_t j = 0; j < n; j++) {
        const bst_op *o = ops + j;
        switch (o->op) {
            case OP_EMBED:
                embed(o->p[0], (int)o->dt[0], o->i[2], o->i[3], (const int64_t *)o->p[1], o->p[2], (int)o->dt[1],
                      o->i[0], o->i[1]);
                break;
            case OP_RMS_NORM:
                bst_rms_norm(o->p[0], o->p[1], o->p[2], o->p[3], (int)o->dt[0], o->p[4], (int)o->dt[1], o->i[0],
                             o->i[1], o->f[0], threads);
                break;
            case OP_LINEAR:
                bst_linear(o->p[0], (int)o->dt[0], o->i[0], o->i[1], o->p[1], (int)o->dt[1], o->i[2],
                           (const float *)o->p[2], (const float *)o->p[3], o->i[3], (const float *)o->p[4], o->p[5],
                           (int)o->dt[2], threads);
                break;
            case OP_ROTARY:
                rotary_at(o->p[0], (int)o->dt[0], o->i[0], o->i[1], o->i[2], o->i[3], (const int64_t *)o->p[1],
                          (const float *)o->p[2], o->i[4], (int)o->i[5]);
                break;
            case OP_KV_WRITE:
                bst_kv_write(o->p[0], o->p[1], (int)o->dt[0], o->i[2], o->p[2], o->p[3], (int)o->dt[1],
                             (const int64_t *)o->p[4], o->i[0], o->i[1], (const float *)o->p[5]);
                break;
            case OP_ATTENTION:
                bst_decode_attention(o->p[0], (int)o->dt[0], o->i[7], o->p[1], o->p[2], (int)o->dt[1],
                                     (const int64_t *)o->p[3], o->i[0], (const int64_t *)o->p[4], o->i[1], o->i[2],
                                     o->i[3], o->i[4], o->i[5], o->f[0], (const float *)o->p[5], o->p[6],
                                     (int)o->dt[2], (const float *)o->p[7],
                                     o->i[6] ? (const int64_t *)o->p[4] + o->i[1] : NULL, threads);
                break;
            case OP_ACT_MUL:
                bst_act_and_mul(o->p[0], o->p[1], (int)o->dt[0], o->i[0], o->i[1], (int)o->i[2], threads);
                break;
            case OP_LORA: /* p: x, A, B, scale, layout, idx, out; dt: x, weights, out; i: T, K, L, N */
                bst_lora_rows(o->p[0], (int)o->dt[0], o->i[0], o->i[1], o->p[1], o->p[2], (int)o->dt[1],
                              (const float *)o->p[3], (const int64_t *)o->p[4], o->i[2], (const int64_t *)o->p[5],
                              o->p[6], (int)o->dt[2], o->i[3], threads);
                break;
        }
    }
}

/* bst_run_plan one record at a time, adding each record's wall time (seconds) to seconds[j]: the
 * per-op profile of benchmarks/profile_step.py (core.runtime.cpu_plan.DecodePlan.start_profile). */
void bst_run_plan_timed(const bst_op *ops, int64_t n, int threads, double *seconds) {
    for (int64_t j = 0; j < n; j++) {
        struct timespec a, b;
        clock_gettime(CLOCK_MONOTONIC, &a);
        bst_run_plan(ops + j, 1, threads);
        clock_gettime(CLOCK_MONOTONIC, &b);
        seconds[j] += (double)(b.tv_sec - a.tv_sec) + 1e-9 * (double)(b.tv_nsec - a.tv_nsec);
    }
}
