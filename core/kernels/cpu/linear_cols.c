/* Part of kernels.c, the one translation unit of the CPU kernels: #included there in order, after
 * common.h, vector.h and the parts listed before it (never compiled alone). Linear, column tiles: float32 /
 * bfloat16 weights held transposed (Wt [k, n]), with vdpbf16ps for bfloat16 x bfloat16 (BST_BF16DOT). */

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
