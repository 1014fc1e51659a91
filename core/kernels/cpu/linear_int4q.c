/* Part of kernels.c, the one translation unit of the CPU kernels: #included there in order, after
 * linear_rows.c (q16_inputs), linear_int4.c (group_sums), linear_a8.c and linear_w4a8.c (its segments,
 * W4A8Block, and float step) and before linear.c (bst_linear calls i4q_linear for DT_I4Q; never compiled alone).
 * int4 weights in quads x float inputs (W4A16 on the AVX2 build):
 *
 *   DT_I4Q = 11  the int4 codes (unsigned q 0..15, two a byte: low nibble = even k) in quads
 *                (packing.pack_int4_quads, as DT_I4A8's): per tile of 8 rows (the last one n % 8 rows), per
 *                8 features, the tile's rows' 4 bytes one after another, so a tile is one sequential stream
 *                and one 32-byte load holds 8 features of each of its 8 rows, row r in 32-bit lane r, feature
 *                8 c + j in bits 4 j .. 4 j + 3; uint8 [n, k / 2] in all, k % 8 == 0; groups of G features
 *                (G % 32 == 0, the last may be short); `scale` s and `sz` the zero points z (NOT s * z as
 *                DT_I4), float32 in tiles of 8 rows: [ceil(n / 8)][groups][8] (the last tile zero-padded);
 *                sz NULL when symmetric (z = 8)
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
 *   per call, i4q_permute) in each 64 bits: 16 multiply-adds an instruction against 8 of a float FMA after a
 *   conversion per code; one vphaddd per 32 features puts row r's sum in lane r.
 *
 * y[n] = acc + bias[n]. Compared with the checkpoint layout's AVX2 GEMV (DT_I4: a 64-bit load and a widening
 * per row and 8 features, a horizontal sum per row) a quad is one load for 8 rows: ~1.4x on the float path. */

#define DT_I4Q 11
#define I4Q_MT 2       /* input rows per tile (each quad unpacked once for all of them; 4 measured no faster) */
#define I4Q_AHEAD 2048 /* bytes of the stream fetched ahead */

#if BST_SIMD
/* out[i][r] = acc of the float path (module comment) of the tile's rows r < nr for M inputs (x rows k apart) */
INLINE void i4q_tile(const float *x, const float *xsum, int64_t k, int64_t group, const uint8_t *tile, int nr,
                     const float *st, const float *zt, int M, float out[I4Q_MT][8]) {
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
        const __m256 s = _mm256_loadu_ps(st + g * 8), z = zt ? _mm256_loadu_ps(zt + g * 8) : _mm256_set1_ps(8.f);
        for (int i = 0; i < M; i++) {
            const __m256 sum = _mm256_add_ps(_mm256_add_ps(a[i][0], a[i][1]), _mm256_add_ps(a[i][2], a[i][3]));
            tot[i] = _mm256_fmadd_ps(s, _mm256_fnmadd_ps(z, _mm256_set1_ps(xsum[i * groups + g]), sum), tot[i]);
        }
    }
    for (int i = 0; i < M; i++) _mm256_storeu_ps(out[i], tot[i]);
}

/* d[i] lane r += sum over the 32 features at xq (input i at xq + i k: int16 codes, per 8 features [4 even k |
 * 4 odd k], i4q_permute) of their codes times row r's, from the 4 quads at q (nr * 4 bytes apart; a short tile's
 * lanes past nr read as 0) */
INLINE void i4q_dots16(const int16_t *xq, int64_t k, const uint8_t *q, int nr, __m256i rows, int M,
                       __m256i d[I4Q_MT]) {
    const __m256i low4 = _mm256_set1_epi8(15), zero = _mm256_setzero_si256();
    __m256i acc[I4Q_MT][2];
    for (int i = 0; i < M; i++) acc[i][0] = acc[i][1] = zero;
    for (int c = 0; c < 4; c++) {
        const uint8_t *p = q + c * nr * 4;
        const __m256i v = nr == 8 ? _mm256_loadu_si256((const __m256i *)p) : _mm256_maskload_epi32((const int *)p, rows);
        const __m256i lo = _mm256_and_si256(v, low4), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), low4);
        /* 16-bit codes, per 128-bit half rows (0, 1 | 4, 5) or (2, 3 | 6, 7), each row's 4 even or 4 odd ones */
        const __m256i e01 = _mm256_unpacklo_epi8(lo, zero), e23 = _mm256_unpackhi_epi8(lo, zero);
        const __m256i o01 = _mm256_unpacklo_epi8(hi, zero), o23 = _mm256_unpackhi_epi8(hi, zero);
        for (int i = 0; i < M; i++) {
            int64_t even, odd;
            memcpy(&even, xq + i * k + c * 8, 8);
            memcpy(&odd, xq + i * k + c * 8 + 4, 8);
            const __m256i xe = _mm256_set1_epi64x(even), xo = _mm256_set1_epi64x(odd);
            acc[i][0] = _mm256_add_epi32(acc[i][0], _mm256_add_epi32(_mm256_madd_epi16(e01, xe), _mm256_madd_epi16(o01, xo)));
            acc[i][1] = _mm256_add_epi32(acc[i][1], _mm256_add_epi32(_mm256_madd_epi16(e23, xe), _mm256_madd_epi16(o23, xo)));
        }
    }
    for (int i = 0; i < M; i++) /* [r0 r0 r1 r1 | r4 r4 r5 r5], [r2 r2 r3 r3 | ..] -> [r0 r1 r2 r3 | r4 r5 r6 r7] */
        d[i] = _mm256_add_epi32(d[i], _mm256_hadd_epi32(acc[i][0], acc[i][1]));
}

/* out[i][r] = acc of the q16 path (module comment) for M inputs: xq int16 codes [., k], xc their sums per 32
 * features, xs the block scales; a block of 64 features at a time, its one or two segments as linear_w4a8.c's */
INLINE void i4q_tile16(const int16_t *xq, const int32_t *xc, const float *xs, int64_t k, const uint8_t *tile, int nr,
                       const W4A8Block *blk, const float *st, const float *zt, int M, float out[I4Q_MT][8]) {
    const int64_t chunks = k / 32, nb = a8_blocks(k);
    const __m256i rows = _mm256_cmpgt_epi32(_mm256_set1_epi32(nr), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
    __m256 acc[I4Q_MT];
    for (int i = 0; i < M; i++) acc[i] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        const int64_t k0 = b * A8_BLOCK;
        const W4A8Block s = blk[b];
        for (int l = 0; l < 4; l++) _mm_prefetch((const char *)(tile + k0 / 2 * nr + I4Q_AHEAD + 64 * l), _MM_HINT_T0);
        const float *za = zt ? zt + s.ga * 8 : NULL, *zb = zt ? zt + s.gb * 8 : NULL;
        __m256i d[I4Q_MT];
        for (int i = 0; i < M; i++) d[i] = _mm256_setzero_si256();
        i4q_dots16(xq + k0, k, tile + k0 / 2 * nr, nr, rows, M, d);
        if (s.split)
            for (int i = 0; i < M; i++) {
                acc[i] = w4a8_step(acc[i], d[i], xc[i * chunks + 2 * b], xs[i * nb + b], st + s.ga * 8, za);
                d[i] = _mm256_setzero_si256();
            }
        if (!s.full) continue; /* (a short block is split: done) */
        i4q_dots16(xq + k0 + 32, k, tile + (k0 + 32) / 2 * nr, nr, rows, M, d);
        for (int i = 0; i < M; i++) { /* (not split: ga == gb, one step for the block's D and X) */
            const int32_t xb = xc[i * chunks + 2 * b + 1] + (s.split ? 0 : xc[i * chunks + 2 * b]);
            acc[i] = w4a8_step(acc[i], d[i], xb, xs[i * nb + b], st + s.gb * 8, zb);
        }
    }
    for (int i = 0; i < M; i++) _mm256_storeu_ps(out[i], acc[i]);
}
#else
/* the float path, one row at a time (BST_ISA 0) */
INLINE void i4q_tile(const float *x, const float *xsum, int64_t k, int64_t group, const uint8_t *tile, int nr,
                     const float *st, const float *zt, int M, float out[I4Q_MT][8]) {
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
                const float z = zt ? zt[g * 8 + r] : 8.f;
                acc = fmaf(st[g * 8 + r], fmaf(-z, xsum[i * groups + g], (a[0] + a[1]) + (a[2] + a[3])), acc);
            }
            out[i][r] = acc;
        }
}
#endif

/* the inputs of one call: float rows xf and their group sums (float path), or int16 codes xq, their sums per
 * 32 features xc, block scales xs and the segments' blocks (q16 path: xq non-NULL) */
typedef struct {
    const float *xf, *xsum;
    const int16_t *xq;
    const int32_t *xc;
    const float *xs;
    const W4A8Block *blk;
} I4QInputs;

/* out for M inputs from input row i0 on, on the path `in` holds (M a constant after inlining) */
INLINE void i4q_any(I4QInputs in, int64_t i0, int64_t k, int64_t group, const uint8_t *tile, int nr, const float *st,
                    const float *zt, int M, float out[I4Q_MT][8]) {
    const int64_t groups = (k + group - 1) / group;
#if BST_SIMD
    if (in.xq) {
        i4q_tile16(in.xq + i0 * k, in.xc + i0 * (k / 32), in.xs + i0 * a8_blocks(k), k, tile, nr, in.blk, st, zt, M, out);
        return;
    }
#endif
    i4q_tile(in.xf + i0 * k, in.xsum + i0 * groups, k, group, tile, nr, st, zt, M, out);
}

/* tiles [t_begin, t_end) of y for all m inputs */
static void i4q_rows(I4QInputs in, int64_t m, int64_t k, const uint8_t *w, int64_t n, const float *st, const float *zt,
                     int64_t group, const float *bias, void *y, int ydt, int64_t t_begin, int64_t t_end) {
    const int64_t groups = (k + group - 1) / group;
    float out[I4Q_MT][8];
    for (int64_t t = t_begin; t < t_end; t++) {
        const int64_t row0 = t * 8;
        const int nr = n - row0 < 8 ? (int)(n - row0) : 8;
        const uint8_t *tile = w + row0 * (k / 2);
        const float *s = st + t * groups * 8, *z = zt ? zt + t * groups * 8 : NULL;
        for (int64_t i0 = 0; i0 < m; i0 += I4Q_MT) {
            const int M = m - i0 >= I4Q_MT ? I4Q_MT : (int)(m - i0);
            if (nr < 8) i4q_any(in, i0, k, group, tile, nr, s, z, M, out); /* the short last tile */
            else if (M == 1) i4q_any(in, i0, k, group, tile, 8, s, z, 1, out); /* (constants: unrolled) */
            else i4q_any(in, i0, k, group, tile, 8, s, z, I4Q_MT, out);
            for (int i = 0; i < M; i++)
                for (int r = 0; r < nr; r++) {
                    const float v = out[i][r];
                    store_f(y, ydt, (i0 + i) * n + row0 + r, bias ? v + bias[row0 + r] : v);
                }
        }
    }
}

#if BST_SIMD
/* the q16 codes xq [count] (count % 32 == 0) in place, per 8 features [4 even k | 4 odd k] (the order the
 * quads' nibbles unpack in), and xc [count / 32] their sums per 32 features */
static void i4q_permute(int16_t *xq, int64_t count, int32_t *xc) {
    for (int64_t c = 0; c < count / 32; c++) {
        int32_t sum = 0;
        for (int64_t q = c * 32; q < c * 32 + 32; q += 8) {
            int16_t t[8];
            for (int j = 0; j < 8; j++) {
                t[j % 2 * 4 + j / 2] = xq[q + j];
                sum += xq[q + j];
            }
            memcpy(xq + q, t, sizeof(t));
        }
        xc[c] = sum;
    }
}
#endif

/* True when a DT_I4Q call takes the q16 path (module comment) */
INLINE int i4q_reads_q16(int xdt, int64_t k) { return BST_SIMD && xdt == DT_BF16 && k % 32 == 0; }

/* bst_linear for DT_I4Q: y [m, n] (ydt) = x [m, k] (xdt) times the int4 quads w [n, k / 2] (k % 8 == 0) with s and
 * z tiled [ceil(n / 8)][groups][8] (z NULL: 8; module comment) */
static void i4q_linear(const void *x, int xdt, int64_t m, int64_t k, const uint8_t *w, int64_t n, const float *st,
                       const float *zt, int64_t group, const float *bias, void *y, int ydt, int threads) {
    float *xf = (float *)malloc(sizeof(float) * (size_t)(m * k) + 64);
    float *xsum = NULL, *xs = NULL;
    int16_t *xq = NULL;
    int32_t *xc = NULL;
    W4A8Block *blk = NULL;
    to_f32(x, xdt, m * k, xf);
#if BST_SIMD
    if (i4q_reads_q16(xdt, k)) {
        xq = (int16_t *)malloc(sizeof(int16_t) * (size_t)(m * k) + 64);
        xs = (float *)malloc(sizeof(float) * (size_t)(m * q16_blocks(k)));
        xc = (int32_t *)malloc(sizeof(int32_t) * (size_t)(m * (k / 32)) + 4);
        blk = (W4A8Block *)malloc(sizeof(W4A8Block) * (size_t)a8_blocks(k));
        q16_inputs(xf, m, k, xq, xs);
        i4q_permute(xq, m * k, xc);
        w4a8_blocks(k, group, blk);
    }
#endif
    if (!xq) xsum = group_sums(xf, m, k, k, group);
    const I4QInputs in = {xf, xsum, xq, xc, xs, blk};
    const int64_t tiles = (n + 7) / 8;
    int parts = threads < 1 ? 1 : threads;
    if (tiles < 8 * parts) parts = 1;
#pragma omp parallel for num_threads(parts) schedule(static, 1)
    for (int part = 0; part < parts; part++)
        i4q_rows(in, m, k, w, n, st, zt, group, bias, y, ydt, tiles * part / parts, tiles * (part + 1) / parts);
    free(blk);
    free(xc);
    free(xs);
    free(xq);
    free(xsum);
    free(xf);
}

/* row `row` of a DT_I4Q weight as floats dst [k]: q s - s z (bst_dequantize) */
static void i4q_dequantize_row(const uint8_t *w, int64_t row, int64_t n, int64_t k, const float *st, const float *zt,
                               int64_t group, float *dst) {
    const int64_t groups = (k + group - 1) / group, t = row / 8, r = row % 8;
    const int nr = n - t * 8 < 8 ? (int)(n - t * 8) : 8;
    const uint8_t *tile = w + t * 8 * (k / 2);
    const float *s = st + t * groups * 8 + r, *z = zt ? zt + t * groups * 8 + r : NULL;
    for (int64_t q = 0; q < k / 8; q++) {
        const int64_t g = q * 8 / group;
        const float sg = s[g * 8], szg = sg * (z ? z[g * 8] : 8.f);
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
