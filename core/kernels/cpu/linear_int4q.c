/* Part of kernels.c, the one translation unit of the CPU kernels: #included there in order, after
 * linear_rows.c (q16_inputs), linear_int4.c (group_sums), linear_a8.c and linear_w4a8.c (the q16 path is its
 * integer walk of the quads on int16 codes: quads_linear, w4a8_dots16) and before linear.c (bst_linear calls
 * i4q_linear for DT_I4Q; never compiled alone). int4 weights in quads x float inputs (W4A16 on the AVX2 build):
 *
 *   DT_I4Q = 11  the int4 codes (unsigned q 0..15, two a byte: low nibble = even k) in quads
 *                (packing.pack_int4_quads, as DT_I4A8's): per tile of 8 rows (the last one n % 8 rows), per
 *                8 features, the tile's rows' 4 bytes one after another, so a tile is one sequential stream
 *                and one 32-byte load holds 8 features of each of its 8 rows, row r in 32-bit lane r, feature
 *                8 c + j in bits 4 j .. 4 j + 3; uint8 [n, k / 2] in all, k % 8 == 0; groups of G features
 *                (G % 32 == 0, the last may be short); `scale` s and `sz` the zero points z (NOT s * z as
 *                DT_I4) in tiles of 8 rows: [ceil(n / 8)][groups][8] (the last tile zero-padded), float32, or
 *                bfloat16 with W_SCALES_BF16 in the weight-kind code (as DT_I4A8's); sz NULL when symmetric (z = 8)
 *
 * Two paths, each a row's sums in a fixed order (a row's output bits depend on neither the other rows of the
 * call, the tile shapes nor the thread count: batch-invariant):
 *
 * float (float32 inputs, the scalar build, or k % 32 != 0): for each group g in increasing order, from acc = 0,
 *     a_j = sum over the group's features k with k % 4 == j, in increasing k, of fmaf(q[n, k], x[k], a_j)
 *     acc = fmaf(s[n, g], fmaf(-z[n, g], X[g], (a_0 + a_1) + (a_2 + a_3)), acc)
 *                                            X[g] = the group's x summed in increasing k (float32)
 *   BST_SIMD per quad and feature j: >> 4 j, & 15, vcvtdq2ps (row r's code in lane r), one FMA per input with
 *   x[k] broadcast; the scalar build the same operations one row at a time (the same bits).
 *
 * q16 (bfloat16 inputs on the vector builds, k % 32 == 0): x is read as linear_rows.c's int8 x bfloat16 GEMV
 * reads it, per 64-feature block b as qx 2^(e_b - 15) (q16_inputs: every x of the block within 2^7 of its
 * largest is exact, the others rounded by at most max |x| 2^-15), and, over the segments j of linear_w4a8.c
 * (a 64-feature block intersected with a group: 32 or 64 features) in increasing k, from acc = 0:
 *     D = sum_{k in j} qx[k] q[n, k]       X = sum_{k in j} qx[k]             (exact, int32: |D| < 2^25)
 *     acc = fmaf(2^(e_b - 15) s[n, g], fmaf(-z[n, g], (float)X, (float)D), acc)   ((float)D rounds past 2^24)
 *   per quad: & 15 and >> 4 & 15 (each row's 4 even and 4 odd codes as bytes), widened to 16 bits (4 rows a
 *   register, 4 codes each), vpmaddwd with the quad's 4 even or 4 odd input codes (the inputs permuted once
 *   per call, quads_inputs) in each 64 bits: 16 multiply-adds an instruction against 8 of a float FMA after a
 *   conversion per code; one vphaddd per 32 features puts row r's sum in lane r (linear_w4a8.c's w4a8_dots16).
 *
 * y[n] = acc + bias[n]. Compared with the checkpoint layout's AVX2 GEMV (DT_I4: a 64-bit load and a widening
 * per row and 8 features, a horizontal sum per row) a quad is one load for 8 rows: ~1.4x on the float path. */

#define DT_I4Q 11
#define I4Q_AHEAD 2048 /* bytes of the stream fetched ahead */

#if BST_SIMD
/* out[i][r] = acc of the float path (module comment) of the tile's rows r < nr for M inputs (x rows k apart) */
INLINE void i4q_tile(const float *x, const float *xsum, int64_t k, int64_t group, const uint8_t *tile, int nr,
                     const void *st, const void *zt, int sdt, int M, float out[W4A8_MT][8]) {
    const int64_t groups = (k + group - 1) / group;
    const __m256i low4 = _mm256_set1_epi32(15);
    const __m256i rows = _mm256_cmpgt_epi32(_mm256_set1_epi32(nr), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
    __m256 tot[QUADS_MT16];
    for (int i = 0; i < M; i++) tot[i] = _mm256_setzero_ps();
    for (int64_t g = 0; g < groups; g++) {
        const int64_t q0 = g * group / 8, q1 = ((g + 1) * group < k ? (g + 1) * group : k) / 8;
        __m256 a[QUADS_MT16][4];
        for (int i = 0; i < M; i++) a[i][0] = a[i][1] = a[i][2] = a[i][3] = _mm256_setzero_ps();
        for (int64_t q = q0; q < q1; q++) {
            const uint8_t *p = tile + q * nr * 4;
            _mm_prefetch((const char *)(p + I4Q_AHEAD), _MM_HINT_T0);
            const __m256i v = nr == 8 ? _mm256_loadu_si256((const __m256i *)p) : _mm256_maskload_epi32((const int *)p, rows);
            const float *xq = x + q * 8;
#pragma GCC unroll 8
            for (int j = 0; j < 8; j++) {
                const __m256i c = j == 7 ? _mm256_srli_epi32(v, 28) : _mm256_and_si256(_mm256_srli_epi32(v, 4 * j), low4);
                const __m256 cf = _mm256_cvtepi32_ps(c);
                for (int i = 0; i < M; i++) a[i][j & 3] = _mm256_fmadd_ps(cf, _mm256_broadcast_ss(xq + i * k + j), a[i][j & 3]);
            }
        }
        const __m256 s = load8_scales(scales_at(st, sdt, g * 8), sdt);
        const __m256 z = zt ? load8_scales(scales_at(zt, sdt, g * 8), sdt) : _mm256_set1_ps(8.f);
        for (int i = 0; i < M; i++) {
            const __m256 sum = _mm256_add_ps(_mm256_add_ps(a[i][0], a[i][1]), _mm256_add_ps(a[i][2], a[i][3]));
            tot[i] = _mm256_fmadd_ps(s, _mm256_fnmadd_ps(z, _mm256_set1_ps(xsum[i * groups + g]), sum), tot[i]);
        }
    }
    for (int i = 0; i < M; i++) _mm256_storeu_ps(out[i], tot[i]);
}

#else
/* the float path, one row at a time (BST_ISA 0) */
INLINE void i4q_tile(const float *x, const float *xsum, int64_t k, int64_t group, const uint8_t *tile, int nr,
                     const void *st, const void *zt, int sdt, int M, float out[W4A8_MT][8]) {
    const int64_t groups = (k + group - 1) / group;
    for (int r = 0; r < nr; r++)
        for (int i = 0; i < M; i++) {
            float acc = 0.f;
            for (int64_t g = 0; g < groups; g++) {
                const int64_t end = (g + 1) * group < k ? (g + 1) * group : k;
                float a[4] = {0.f, 0.f, 0.f, 0.f};
                for (int64_t kk = g * group; kk < end; kk++) {
                    const uint8_t byte = tile[kk / 8 * nr * 4 + r * 4 + kk % 8 / 2];
                    a[kk & 3] = fmaf((float)((kk & 1) ? byte >> 4 : byte & 15), x[i * k + kk], a[kk & 3]);
                }
                const float z = zt ? load_f(zt, sdt, g * 8 + r) : 8.f;
                acc = fmaf(load_f(st, sdt, g * 8 + r), fmaf(-z, xsum[i * groups + g], (a[0] + a[1]) + (a[2] + a[3])), acc);
            }
            out[i][r] = acc;
        }
}
#endif

/* tiles [t_begin, t_end) of y for all m inputs on the float path: float rows xf and their group sums xsum */
static void i4q_rows(const float *xf, const float *xsum, int64_t m, int64_t k, const uint8_t *w, int64_t n,
                     const void *st, const void *zt, int sdt, int64_t group, const float *bias, void *y, int ydt,
                     int64_t t_begin, int64_t t_end) {
    const int64_t groups = (k + group - 1) / group;
    float out[W4A8_MT][8];
    for (int64_t t = t_begin; t < t_end; t++) {
        const int64_t row0 = t * 8;
        const int nr = n - row0 < 8 ? (int)(n - row0) : 8;
        const uint8_t *tile = w + row0 * (k / 2);
        const void *s = scales_at(st, sdt, t * groups * 8), *z = scales_at(zt, sdt, t * groups * 8);
        for (int64_t i0 = 0; i0 < m; i0 += QUADS_MT16) {
            const int M = m - i0 >= QUADS_MT16 ? QUADS_MT16 : (int)(m - i0);
            const float *xi = xf + i0 * k, *si = xsum + i0 * groups;
            if (nr < 8) i4q_tile(xi, si, k, group, tile, nr, s, z, sdt, M, out); /* the short last tile */
            else if (M == 1) i4q_tile(xi, si, k, group, tile, 8, s, z, sdt, 1, out); /* (constants: unrolled) */
            else i4q_tile(xi, si, k, group, tile, 8, s, z, sdt, QUADS_MT16, out);
            quads_store(out, M, nr, i0, row0, n, bias, y, ydt);
        }
    }
}

/* True when a DT_I4Q call takes the q16 path (module comment) */
INLINE int i4q_reads_q16(int xdt, int64_t k) { return BST_SIMD && xdt == DT_BF16 && k % 32 == 0; }

/* bst_linear for DT_I4Q: y [m, n] (ydt) = x [m, k] (xdt) times the int4 quads w [n, k / 2] (k % 8 == 0) with s and
 * z tiled [ceil(n / 8)][groups][8] in sdt (z NULL: 8; module comment) */
static void i4q_linear(const void *x, int xdt, int64_t m, int64_t k, const uint8_t *w, int64_t n, const void *st,
                       const void *zt, int sdt, int64_t group, const float *bias, void *y, int ydt, int threads) {
    float *xf = (float *)malloc(sizeof(float) * (size_t)(m * k) + 64);
    to_f32(x, xdt, m * k, xf);
#if BST_SIMD
    if (i4q_reads_q16(xdt, k)) { /* (the inputs as q16 codes and block scales: linear_w4a8.c's integer walk) */
        int16_t *xq = (int16_t *)malloc(sizeof(int16_t) * (size_t)(m * k) + 64);
        float *xs = (float *)malloc(sizeof(float) * (size_t)(m * q16_blocks(k)));
        q16_inputs(xf, m, k, xq, xs);
        quads_linear(xq, 1, xs, m, k, w, n, st, zt, sdt, group, bias, y, ydt, threads);
        free(xs);
        free(xq);
        free(xf);
        return;
    }
#endif
    const int64_t tiles = (n + 7) / 8;
    const int parts = a8_parts(n, threads);
    float *xsum = group_sums(xf, m, k, k, group);
#pragma omp parallel for num_threads(parts) schedule(static, 1)
    for (int part = 0; part < parts; part++)
        i4q_rows(xf, xsum, m, k, w, n, st, zt, sdt, group, bias, y, ydt, tiles * part / parts,
                 tiles * (part + 1) / parts);
    free(xsum);
    free(xf);
}

/* row `row` of a DT_I4Q weight as floats dst [k]: q s - s z (bst_dequantize) */
static void i4q_dequantize_row(const uint8_t *w, int64_t row, int64_t n, int64_t k, const void *st, const void *zt,
                               int sdt, int64_t group, float *dst) {
    const int64_t groups = (k + group - 1) / group, t = row / 8, r = row % 8, at = t * groups * 8 + r;
    const int nr = n - t * 8 < 8 ? (int)(n - t * 8) : 8;
    const uint8_t *tile = w + t * 8 * (k / 2);
    for (int64_t q = 0; q < k / 8; q++) {
        const int64_t g = q * 8 / group;
        const float sg = load_f(st, sdt, at + g * 8), szg = sg * (zt ? load_f(zt, sdt, at + g * 8) : 8.f);
        int32_t word;
        memcpy(&word, tile + q * nr * 4 + r * 4, 4);
#if BST_SIMD /* the 8 codes of the word in 8 lanes */
        const __m256i c = _mm256_and_si256(_mm256_srlv_epi32(_mm256_set1_epi32(word), _mm256_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28)),
                                           _mm256_set1_epi32(15));
        _mm256_storeu_ps(dst + q * 8, _mm256_fmsub_ps(_mm256_cvtepi32_ps(c), _mm256_set1_ps(sg), _mm256_set1_ps(szg)));
#else
        for (int j = 0; j < 8; j++) dst[q * 8 + j] = (float)((uint32_t)word >> (4 * j) & 15) * sg - szg;
#endif
    }
}
