/* Part of kernels.c, the one translation unit of the CPU kernels: #included there in order, after
 * common.h, vector.h and the parts listed before it (never compiled alone). Linear, int4 weights: the
 * checkpoint layout (DT_I4; AVX-512 and AVX2 each their own tile) and the dot layout (DT_I4D, the
 * avx512bf16 build). Tiles of MT inputs (linear_rows.c). */

/* sums [m, ceil(k / group)] (calloc'd) of each input row's features kk < upto, group by group, each in increasing
 * k (float32): the zero-point terms of the int4 paths (DT_I4 on AVX2, DT_I4D, DT_I4Q's float path) */
INLINE float *group_sums(const float *xf, int64_t m, int64_t k, int64_t upto, int64_t group) {
    int64_t groups = (k + group - 1) / group;
    float *sums = (float *)calloc((size_t)(m * groups), sizeof(float));
    for (int64_t i = 0; i < m; i++)
        for (int64_t kk = 0; kk < upto; kk++) sums[i * groups + kk / group] += xf[i * k + kk];
    return sums;
}

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
                      const float *sz, int64_t group, int64_t row0, int R, int M, const float *qf, float res[4][MT]) {
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
            __m512 lo, hi;
            if (qf) { /* decoded once for all inputs (int4_decode_rows): the table's values */
                lo = _mm512_loadu_ps(qf + r * k + kk);
                hi = _mm512_loadu_ps(qf + r * k + kk + 16);
            } else {
                const uint8_t *wr = w + (row0 + r) * (k / 2);
                if (kk % group == 0) { /* a new group: its table lut[q] = q * s - s * z */
                    int64_t g = (row0 + r) * groups + kk / group;
                    lut[r] = _mm512_fmsub_ps(iota, _mm512_set1_ps(s[g]), _mm512_set1_ps(sz[g]));
                }
                if (kk % 128 == 0) /* a row is a few cache lines: fetch the next tile's early */
                    _mm_prefetch((const char *)(wr + R * (k / 2) + kk / 2), _MM_HINT_T0);
                __m128i b = _mm_loadu_si128((const __m128i *)(wr + kk / 2));
                lo = _mm512_permutexvar_ps(_mm512_cvtepu8_epi32(_mm_and_si128(b, low4)), lut[r]);
                hi = _mm512_permutexvar_ps(_mm512_cvtepu8_epi32(_mm_and_si128(_mm_srli_epi16(b, 4), low4)), lut[r]);
            }
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
                      const float *sz, int64_t group, int64_t row0, int R, int M, const float *qf, float res[4][MT]) {
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
            if (kk % 128 == 0 && !qf) /* a row is a few cache lines: fetch the next tile's early */
                for (int r = 0; r < R; r++) _mm_prefetch((const char *)(w + (row0 + R + r) * (k / 2) + kk / 2), _MM_HINT_T0);
            for (int r = 0; r < R; r++) {
                vf lo, hi;
                if (qf) { /* decoded once for all inputs (int4_decode_rows): the codes as floats */
                    lo = vloadu(qf + r * k + kk);
                    hi = vloadu(qf + r * k + kk + VW);
                } else {
                    const uint8_t *wr = w + (row0 + r) * (k / 2);
                    __m256i b = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(wr + kk / 2)));
                    lo = _mm256_cvtepi32_ps(_mm256_and_si256(b, low4));
                    hi = _mm256_cvtepi32_ps(_mm256_srli_epi32(b, 4));
                }
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

/* Inputs from which int4_rows decodes each block of ROWS rows once for all of them (SIMD builds) instead of once
 * per tile of MT inputs: the tile then reads the decoded floats from L1 (the same values and the same sums, so
 * a row's output does not depend on the batch either way). */
#define I4_DECODE_M 5
INLINE int int4_decodes(int64_t m) { return BST_SIMD && m >= I4_DECODE_M; }

#if BST_SIMD
/* the I4B-blocks (below kb) of rows [row0, row0 + R) as int4_tile reads them, per block [VW lows, VW highs]
 * (even features, then odd ones) of floats: AVX-512 the table's q s - s z, AVX2 the codes q: qf [R, k] */
static void int4_decode_rows(const uint8_t *w, const float *s, const float *sz, int64_t k, int64_t kb, int64_t group,
                             int64_t row0, int R, float *qf) {
    const int64_t groups = (k + group - 1) / group;
    for (int r = 0; r < R; r++) {
        const uint8_t *wr = w + (row0 + r) * (k / 2);
        float *q = qf + (int64_t)r * k;
        for (int64_t kk = 0; kk < kb; kk += I4B) {
#if BST_AVX512
            const int64_t g = (row0 + r) * groups + kk / group;
            const __m512 lut = _mm512_fmsub_ps(_mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                               _mm512_set1_ps(s[g]), _mm512_set1_ps(sz[g]));
            const __m128i b = _mm_loadu_si128((const __m128i *)(wr + kk / 2)), low4 = _mm_set1_epi8(0x0f);
            _mm512_storeu_ps(q + kk, _mm512_permutexvar_ps(_mm512_cvtepu8_epi32(_mm_and_si128(b, low4)), lut));
            _mm512_storeu_ps(q + kk + 16,
                             _mm512_permutexvar_ps(_mm512_cvtepu8_epi32(_mm_and_si128(_mm_srli_epi16(b, 4), low4)), lut));
#else
            (void)s, (void)sz, (void)groups;
            const __m256i b = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(wr + kk / 2)));
            vstoreu(q + kk, _mm256_cvtepi32_ps(_mm256_and_si256(b, _mm256_set1_epi32(15))));
            vstoreu(q + kk + VW, _mm256_cvtepi32_ps(_mm256_srli_epi32(b, 4)));
#endif
        }
    }
}
#endif

/* the int4 tile for R rows x M inputs (int4_block's shapes), weights from Q (decoded floats, or NULL: nibbles) */
#define INT4_TILES(Q) \
    { \
        if (R == 4) int4_tile(xi, k, k, kb, w, s, sz, group, row0, 4, 1, Q, res); \
        else if (M == 1) int4_tile(xi, k, k, kb, w, s, sz, group, row0, 1, 1, Q, res); \
        else if (M == 2) int4_tile(xi, k, k, kb, w, s, sz, group, row0, 1, 2, Q, res); \
        else if (M == 3) int4_tile(xi, k, k, kb, w, s, sz, group, row0, 1, 3, Q, res); \
        else int4_tile(xi, k, k, kb, w, s, sz, group, row0, 1, 4, Q, res); \
    }

/* int4 rows [row_lo, row_hi) of y for all m inputs: tiles of 4 rows x 1 input or 1 row x up to 4 inputs, then
 * the features past the last I4B-block one by one. qf: those rows decoded (int4_decode_rows, from row row_lo)
 * or NULL (the tiles decode the nibbles). */
static void int4_block(const float *xf, const float *xp, const float *xsum, int64_t m, int64_t k, const uint8_t *w,
                       const float *s, const float *sz, int64_t group, const float *bias, void *y, int ydt, int64_t n,
                       int64_t row_lo, int64_t row_hi, const float *qf) {
    int64_t groups = (k + group - 1) / group, kb = BST_SIMD ? k / I4B * I4B : 0;
    (void)xp, (void)qf;
    for (int64_t i0 = 0; i0 < m; i0 += MT) {
        int M = m - i0 >= MT ? MT : (int)(m - i0);
        for (int64_t row0 = row_lo; row0 < row_hi;) {
            int R = M == 1 && row_hi - row0 >= 4 ? 4 : 1;
            float res[4][MT] = {{0.f}};
#if BST_SIMD
            const float *xi = xp + i0 * k;
            if (qf) { /* (two copies of the tiles: each one's weight source known when it is compiled) */
                const float *q = qf + (row0 - row_lo) * k;
                INT4_TILES(q)
            } else
                INT4_TILES(NULL)
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

/* int4 rows [r_begin, r_end) of y for all m inputs (int4_block). xsum [m, groups]: the sums of x over each
 * group's features below kb (AVX2's zero-point term; NULL otherwise). With int4_decodes(m), a block of ROWS rows
 * at a time, decoded once into floats (a few KiB, in L1) that every input's tiles then read. */
static void int4_rows(const float *xf, const float *xp, const float *xsum, int64_t m, int64_t k, const uint8_t *w,
                      const float *s, const float *sz, int64_t group, const float *bias, void *y, int ydt, int64_t n,
                      int64_t r_begin, int64_t r_end) {
#if BST_SIMD
    if (int4_decodes(m)) {
        float *qf = (float *)malloc(sizeof(float) * (size_t)(ROWS * k) + 64);
        for (int64_t row0 = r_begin; row0 < r_end; row0 += ROWS) {
            const int64_t row1 = row0 + ROWS < r_end ? row0 + ROWS : r_end;
            int4_decode_rows(w, s, sz, k, k / I4B * I4B, group, row0, (int)(row1 - row0), qf);
            int4_block(xf, xp, xsum, m, k, w, s, sz, group, bias, y, ydt, n, row0, row1, qf);
        }
        free(qf);
        return;
    }
#endif
    int4_block(xf, xp, xsum, m, k, w, s, sz, group, bias, y, ydt, n, r_begin, r_end, NULL);
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

/* DT_I4D rows [r_begin, r_end) of y for all m inputs: tile by tile, every input against a tile while
 * it is in L1 (the weight streams once for any m: a verification step of a few rows reads it once),
 * whole 4-row tiles with int4d_tile4_bf16 per input (bfloat16 inputs) or int4d_tile_f32 (4 rows x up
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
    uint32_t **xqs = (uint32_t **)calloc((size_t)m, sizeof(uint32_t *)); /* the inputs as int4d_tile4_bf16 reads them */
    for (int64_t row0 = r_begin; row0 < r_end;) {
        int R = r_end - row0 >= I4D_ROWS ? I4D_ROWS : 1; /* a whole tile, or a row of the short one */
        for (int64_t i0 = 0; i0 < m; i0 += MT) {
            int M = m - i0 >= MT ? MT : (int)(m - i0);
            uint32_t **xq = xqs + i0;
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
        }
        row0 += R;
    }
    for (int64_t i = 0; i < m; i++) free(xqs[i]);
    free(xqs);
    free(cg);
}
#endif

/* the code of feature kk of row `row` of a DT_I4D weight [n, k / 2] (the dot layout above) */
INLINE int int4d_code(const uint8_t *w, int64_t row, int64_t kk, int64_t k, int64_t n) {
    uint8_t byte = w[i4d_off(row, kk, k, n) + kk % 32];
    return (kk % 64 < 32) ? byte & 15 : byte >> 4;
}
