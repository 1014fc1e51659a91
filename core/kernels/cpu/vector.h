/* The CPU kernels' vector layer, #included by kernels.c after common.h: vf / vi (VW floats per vector,
 * the same names on AVX-512 and AVX2), loads and stores of every dtype, vexp, to_f32 / from_f32, and
 * the vdpbf16ps helpers the GEMV and the decode attention share (BST_BF16DOT: sum16v, dot_bf16). */
#ifndef BST_VECTOR_H
#define BST_VECTOR_H

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

#endif /* BST_VECTOR_H */
