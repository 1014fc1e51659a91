/* Part of kernels.c, the one translation unit of the CPU kernels: #included there in order, after
 * linear_w4a8.c and before linear.c (bst_linear calls i4q_linear for DT_I4Q; never compiled alone).
 * int4 weights in quads x float inputs (W4A16 on the AVX2 build):
 *
 *   DT_I4Q = 11  the int4 codes (unsigned q 0..15, two a byte: low nibble = even k) in quads
 *                (packing.pack_int4_quads, as DT_I4A8's): per tile of 8 rows (the last one n % 8 rows), per
 *                8 features, the tile's rows' 4 bytes one after another, so a tile is one sequential stream
 *                and one 32-byte load holds 8 features of each of its 8 rows, row r in 32-bit lane r, feature
 *                8 c + j in bits 4 j .. 4 j + 3; uint8 [n, k / 2] in all, k % 8 == 0; groups of G features
 *                (G % 32 == 0, the last may be short); `scale` s and `sz` s * z, float32 in tiles of 8 rows:
 *                [ceil(n / 8)][groups][8] (the last tile zero-padded)
 *
 * For an input row x (float32; bfloat16 inputs are widened exactly), row n and each group g in increasing order,
 * from acc = 0:
 *
 *     a_j = sum over the group's features k with k % 4 == j, in increasing k, of fmaf(q[n, k], x[k], a_j)
 *     acc = fmaf(s[n, g], (a_0 + a_1) + (a_2 + a_3), acc)
 *     acc = fmaf(-(s z)[n, g], X[g], acc)        X[g] = the group's x summed in increasing k (float32)
 *     y[n] = acc + bias[n]
 *
 * so a row's output bits depend on neither the other rows of the call, the tile shapes nor the thread count
 * (batch-invariant), and the scalar build gives the same bits as the vector one. Compared with the
 * checkpoint layout's AVX2 GEMV (DT_I4: a 64-bit load and a widening per row and 8 features, a horizontal
 * sum per row) a quad is one load for 8 rows and there are no horizontal sums: ~1.4x at TinyLlama's shapes.
 *
 *   BST_SIMD (the avx2, avx512 and avx512bf16 builds: 256-bit AVX2 only) per quad and feature j: >> 4 j, & 15,
 *              vcvtdq2ps (row r's code in lane r), one FMA per input with x[k] broadcast, into 4 accumulators
 *              per input (j % 4); per group one FMA with the 8 rows' scales and one with their s z. A tile of
 *              8 rows x up to I4Q_MT inputs unpacks each quad once for all its inputs.
 *   BST_ISA 0  scalar C, the same operations one row at a time. */

#define DT_I4Q 11
#define I4Q_MT 2       /* input rows per tile: 4 accumulators each, plus one total (3 spilled: slower) */
#define I4Q_AHEAD 1024 /* bytes of the stream fetched ahead */

/* xsum [m, groups]: each input row's features summed per group in increasing k (float32) */
static void i4q_sums(const float *xf, int64_t m, int64_t k, int64_t group, float *xsum) {
    const int64_t groups = (k + group - 1) / group;
    for (int64_t i = 0; i < m; i++)
        for (int64_t g = 0; g < groups; g++) {
            const int64_t end = (g + 1) * group < k ? (g + 1) * group : k;
            float v = 0.f;
            for (int64_t kk = g * group; kk < end; kk++) v += xf[i * k + kk];
            xsum[i * groups + g] = v;
        }
}

#if BST_SIMD
/* out[i][r] = acc (module comment) of the tile's rows r < nr for M inputs (x rows k apart) */
INLINE void i4q_tile(const float *x, const float *xsum, int64_t k, int64_t group, const uint8_t *tile, int nr,
                     const float *st, const float *szt, int M, float out[I4Q_MT][8]) {
    const int64_t groups = (k + group - 1) / group;
    const __m256i low4 = _mm256_set1_epi32(15);
    const __m256i rows = _mm256_cmpgt_epi32(_mm256_set1_epi32(nr), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
    __m256 tot[I4Q_MT];
    for (int i = 0; i < M; i++) tot[i] = _mm256_setzero_ps();
    for (int64_t g = 0; g < groups; g++) {
        const int64_t q0 = g * group / 8, q1 = ((g + 1) * group < k ? (g + 1) * group : k) / 8;
        __m256 a[I4Q_MT][4];
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
        const __m256 s = _mm256_loadu_ps(st + g * 8), sz = _mm256_loadu_ps(szt + g * 8);
        for (int i = 0; i < M; i++) {
            const __m256 sum = _mm256_add_ps(_mm256_add_ps(a[i][0], a[i][1]), _mm256_add_ps(a[i][2], a[i][3]));
            tot[i] = _mm256_fnmadd_ps(sz, _mm256_set1_ps(xsum[i * groups + g]), _mm256_fmadd_ps(s, sum, tot[i]));
        }
    }
    for (int i = 0; i < M; i++) _mm256_storeu_ps(out[i], tot[i]);
}
#else
/* the same, one row at a time (BST_ISA 0) */
INLINE void i4q_tile(const float *x, const float *xsum, int64_t k, int64_t group, const uint8_t *tile, int nr,
                     const float *st, const float *szt, int M, float out[I4Q_MT][8]) {
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
                acc = fmaf(st[g * 8 + r], (a[0] + a[1]) + (a[2] + a[3]), acc);
                acc = fmaf(-szt[g * 8 + r], xsum[i * groups + g], acc);
            }
            out[i][r] = acc;
        }
}
#endif

/* tiles [t_begin, t_end) of y for all m inputs */
static void i4q_rows(const float *xf, const float *xsum, int64_t m, int64_t k, const uint8_t *w, int64_t n,
                     const float *st, const float *szt, int64_t group, const float *bias, void *y, int ydt,
                     int64_t t_begin, int64_t t_end) {
    const int64_t groups = (k + group - 1) / group;
    float out[I4Q_MT][8];
    for (int64_t t = t_begin; t < t_end; t++) {
        const int64_t row0 = t * 8;
        const int nr = n - row0 < 8 ? (int)(n - row0) : 8;
        const uint8_t *tile = w + row0 * (k / 2);
        const float *s = st + t * groups * 8, *sz = szt + t * groups * 8;
        for (int64_t i0 = 0; i0 < m; i0 += I4Q_MT) {
            const int M = m - i0 >= I4Q_MT ? I4Q_MT : (int)(m - i0);
            const float *xi = xf + i0 * k, *si = xsum + i0 * groups;
            if (nr < 8) i4q_tile(xi, si, k, group, tile, nr, s, sz, M, out); /* the short last tile */
            else if (M == 1) i4q_tile(xi, si, k, group, tile, 8, s, sz, 1, out); /* (constants: unrolled) */
            else i4q_tile(xi, si, k, group, tile, 8, s, sz, I4Q_MT, out);
            for (int i = 0; i < M; i++)
                for (int r = 0; r < nr; r++) {
                    const float v = out[i][r];
                    store_f(y, ydt, (i0 + i) * n + row0 + r, bias ? v + bias[row0 + r] : v);
                }
        }
    }
}

/* bst_linear for DT_I4Q: y [m, n] (ydt) = xf [m, k] (float32) times the int4 quads w [n, k / 2] (k % 8 == 0) with
 * s and s z tiled [ceil(n / 8)][groups][8] (module comment) */
static void i4q_linear(const float *xf, int64_t m, int64_t k, const uint8_t *w, int64_t n, const float *st,
                       const float *szt, int64_t group, const float *bias, void *y, int ydt, int threads) {
    float *xsum = (float *)malloc(sizeof(float) * (size_t)(m * ((k + group - 1) / group)) + 4);
    i4q_sums(xf, m, k, group, xsum);
    const int64_t tiles = (n + 7) / 8;
    int parts = threads < 1 ? 1 : threads;
    if (tiles < 8 * parts) parts = 1;
#pragma omp parallel for num_threads(parts) schedule(static, 1)
    for (int part = 0; part < parts; part++)
        i4q_rows(xf, xsum, m, k, w, n, st, szt, group, bias, y, ydt, tiles * part / parts, tiles * (part + 1) / parts);
    free(xsum);
}

/* row `row` of a DT_I4Q weight as floats dst [k]: q s - s z (bst_dequantize) */
static void i4q_dequantize_row(const uint8_t *w, int64_t row, int64_t n, int64_t k, const float *st, const float *szt,
                               int64_t group, float *dst) {
    const int64_t groups = (k + group - 1) / group, t = row / 8, r = row % 8;
    const int nr = n - t * 8 < 8 ? (int)(n - t * 8) : 8;
    const uint8_t *tile = w + t * 8 * (k / 2);
    const float *s = st + t * groups * 8 + r, *sz = szt + t * groups * 8 + r;
    for (int64_t q = 0; q < k / 8; q++) {
        const int64_t g = q * 8 / group;
        uint32_t word;
        memcpy(&word, tile + q * nr * 4 + r * 4, 4);
        for (int j = 0; j < 8; j++) dst[q * 8 + j] = (float)(word >> (4 * j) & 15) * s[g * 8] - sz[g * 8];
    }
}
