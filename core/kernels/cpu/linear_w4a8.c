/* Part of kernels.c, the one translation unit of the CPU kernels: #included there in order, after
 * linear_a8.c (its a8_inputs / a8_block / a8_blocks quantize the inputs) and before linear.c (bst_linear
 * calls w4a8_linear for DT_I4A8; never compiled alone). int4 weights x int8 activations (W4A8, dynamic):
 *
 *   DT_I4A8 = 10  the DT_I4 checkpoint codes as they are, uint8 [n, k / 2] (low nibble = even k, unsigned
 *                 codes qw 0..15), k % 32 == 0, groups of G features (G % 32 == 0, the last may be short);
 *                 `scale` s_w and `sz` the zero points z (8 when symmetric; NOT s * z as DT_I4), both float32
 *                 in tiles of 8 rows: [ceil(n / 8)][groups][8] (the last tile padded)
 *
 * Each input row t is quantized as linear_a8.c does (a8_inputs: symmetric int8 codes qx and a scale s_x per
 * A8_BLOCK = 64 features). The features split into segments j, the intersections of an activation block b(j)
 * and a weight group g(j) (each 32 or 64 features: both boundaries are multiples of 32), in increasing k, and
 *
 *     D[t, n, j] = sum_{k in j} qx[t, k] qw[n, k]       X[t, j] = sum_{k in j} qx[t, k]       (exact, int32)
 *     e = fmaf(-z[n, g(j)], (float)X, (float)D)          (exact when z is an integer)
 *     acc = fmaf(s_x[t, b(j)] * s_w[n, g(j)], e, acc)    (float32, from acc = 0, segment by segment)
 *     y[t, n] = acc + bias[n]
 *
 * so a row's output bits depend on neither the other rows of the call, the tile shapes nor the thread
 * count (batch-invariant), and the scalar build gives the same bits as the vector one.
 * core.kernels.cpu.ops.linear_w4a8_ref computes the same in torch.
 *
 *   BST_SIMD (the avx2, avx512 and avx512bf16 builds: 256-bit AVX2 only) a row's 32 bytes of a 64-feature
 *              block: & 15, its 32 even-k codes; >> 4 & 15, its 32 odd-k ones; the input codes are permuted
 *              per block the same way once per call (w4a8_inputs). vpmaddubsw(codes u8, qx s8) sums pairs in
 *              int16 (at most 2 * 15 * 127 = 3810; the even and odd products added in int16: 7620 < 2^15, no
 *              saturation), vpmaddwd(.., 1) into int32 (the low 128 bits: the block's first 32 features, the
 *              high 128 bits the next 32); 8 rows' sums are reduced together (vphaddd) into one vector, lane r
 *              row r, the two halves added, or kept apart where a group boundary splits the block. A tile of
 *              8 rows x up to W4A8_MT inputs unpacks each weight block once for all its inputs.
 *   BST_ISA 0  scalar C, the same sums one code at a time.
 * A block of an input row holding a NaN or an infinity has a NaN scale (a8_block): the row's outputs are NaN. */

#define DT_I4A8 10
#define W4A8_MT 4 /* input rows per tile (the weight block unpacked once for all of them) */
#define W4A8_CHUNK 32

/* the stride of a row of w4a8_inputs' codes: whole A8_BLOCKs (the last one zero-padded) */
INLINE int64_t w4a8_stride(int64_t k) { return a8_blocks(k) * A8_BLOCK; }

/* a8_inputs' codes xq [m, k] -> xp [m, w4a8_stride(k)]: signed codes, per A8_BLOCK block [its 32 even k | its 32
 * odd k] (the order w4a8_tile unpacks the nibbles in; a short last block [16 even, 16 zeros | 16 odd, 16 zeros];
 * the scalar build keeps k's order), and xc [m, k / 32] the codes' sums per 32 features */
static void w4a8_inputs(const int8_t *xq, int64_t m, int64_t k, int8_t *xp, int32_t *xc) {
    const int64_t chunks = k / W4A8_CHUNK, kp = w4a8_stride(k);
    memset(xp, 0, (size_t)(m * kp));
    for (int64_t i = 0; i < m; i++)
        for (int64_t c = 0; c < chunks; c++) {
            const int64_t k0 = c * W4A8_CHUNK, b0 = k0 / A8_BLOCK * A8_BLOCK, h = (k0 - b0) / 2; /* h: 0 or 16 */
            int32_t sum = 0;
            for (int j = 0; j < W4A8_CHUNK; j++) {
                const int8_t v = xq[i * k + k0 + j];
                const int8_t q = A8_VNNI ? (int8_t)((uint8_t)v ^ 0x80) : v; /* (VNNI: u = q + 128) */
                xp[i * kp + (BST_SIMD ? b0 + (j & 1) * 32 + h + j / 2 : k0 + j)] = q;
                sum += q;
            }
            xc[i * chunks + c] = sum;
        }
}

/* the float32 steps of one segment (module comment): acc += (s_x s_w) fmaf(-z, X, D) */
#if BST_SIMD
INLINE __m256 w4a8_step(__m256 acc, __m256i d, int32_t x, float sx, const float *sw, const float *z) {
    const __m256 e = _mm256_fnmadd_ps(_mm256_loadu_ps(z), _mm256_set1_ps((float)x), _mm256_cvtepi32_ps(d));
    return _mm256_fmadd_ps(_mm256_mul_ps(_mm256_set1_ps(sx), _mm256_loadu_ps(sw)), e, acc);
}

/* out[i][r] = acc (module comment) of rows row0.. (8, clamped to n - 1 past the end) for M inputs, A8_BLOCK
 * features at a time: a row's 32 bytes of a block -> lo = & 15 (its 32 even k), hi = >> 4 & 15 (odd k), against
 * the inputs' [even | odd] codes. The int16 pair sums of lo and hi added (at most 2 x 3810), vpmaddwd into int32:
 * the low 128 bits hold the block's first 32 features, the high 128 bits the next 32, kept apart through the
 * 8-row reduction where a group boundary splits the block into two segments. */
INLINE void w4a8_tile(const int8_t *xp, const int32_t *xc, const float *xs, int64_t k, const uint8_t *w, int64_t n,
                      const float *swt, const float *zt, int64_t group, int64_t row0, int M, float out[W4A8_MT][8]) {
    const int64_t chunks = k / W4A8_CHUNK, nb = a8_blocks(k), kh = k / 2, kp = w4a8_stride(k);
    const __m256i low4 = _mm256_set1_epi8(15), ones = _mm256_set1_epi16(1);
    const uint8_t *rp[8];
    for (int r = 0; r < 8; r++) rp[r] = w + (row0 + r < n ? row0 + r : n - 1) * kh;
    __m256 acc[W4A8_MT];
    for (int i = 0; i < M; i++) acc[i] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        const int64_t k0 = b * A8_BLOCK;
        const int full = k0 + A8_BLOCK <= k, split = !full || (k0 + W4A8_CHUNK) % group == 0;
        if (b % 2 == 0 && row0 + 8 < n) /* the next tile's rows, 64 bytes at a time */
            for (int r = 0; r < 8; r++) _mm_prefetch((const char *)(rp[r] + 8 * kh + k0 / 2), _MM_HINT_T0);
        __m256i h[W4A8_MT][2];
        for (int p = 0; p < 4; p++) { /* row pairs 2p, 2p + 1 */
            __m256i a[W4A8_MT][2];
            for (int half = 0; half < 2; half++) {
                const uint8_t *wr = rp[2 * p + half] + k0 / 2;
                const __m256i v = full ? _mm256_loadu_si256((const __m256i *)wr)
                                       : _mm256_zextsi128_si256(_mm_loadu_si128((const __m128i *)wr));
                const __m256i lo = _mm256_and_si256(v, low4), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), low4);
                for (int i = 0; i < M; i++) {
                    const int8_t *xi = xp + i * kp + k0;
                    const __m256i t = _mm256_add_epi16(_mm256_maddubs_epi16(lo, _mm256_loadu_si256((const __m256i *)xi)),
                                                       _mm256_maddubs_epi16(hi, _mm256_loadu_si256((const __m256i *)(xi + 32))));
                    a[i][half] = _mm256_madd_epi16(t, ones);
                }
            }
            for (int i = 0; i < M; i++) {
                const __m256i pair = _mm256_hadd_epi32(a[i][0], a[i][1]);
                if (p % 2 == 0) h[i][p / 2] = pair;
                else h[i][p / 2] = _mm256_hadd_epi32(h[i][p / 2], pair); /* rows 4q..4q+3: [first 32 | next 32] */
            }
        }
        const int64_t ga = k0 / group, gb = (k0 + W4A8_CHUNK) / group;
        for (int i = 0; i < M; i++) {
            const __m256i da = _mm256_permute2x128_si256(h[i][0], h[i][1], 0x20); /* lane r: row r, first 32 */
            const __m256i db = _mm256_permute2x128_si256(h[i][0], h[i][1], 0x31); /* the next 32 */
            const int32_t xa = xc[i * chunks + 2 * b], xb = full ? xc[i * chunks + 2 * b + 1] : 0;
            const float sx = xs[i * nb + b];
            if (!split) acc[i] = w4a8_step(acc[i], _mm256_add_epi32(da, db), xa + xb, sx, swt + ga * 8, zt + ga * 8);
            else {
                acc[i] = w4a8_step(acc[i], da, xa, sx, swt + ga * 8, zt + ga * 8);
                if (full) acc[i] = w4a8_step(acc[i], db, xb, sx, swt + gb * 8, zt + gb * 8);
            }
        }
    }
    for (int i = 0; i < M; i++) _mm256_storeu_ps(out[i], acc[i]);
}
#else
/* the same, one code at a time (BST_ISA 0; xp in k's order): segment by segment (a block, or its two halves
 * where a group boundary splits it) */
INLINE void w4a8_tile(const int8_t *xp, const int32_t *xc, const float *xs, int64_t k, const uint8_t *w, int64_t n,
                      const float *swt, const float *zt, int64_t group, int64_t row0, int M, float out[W4A8_MT][8]) {
    const int64_t chunks = k / W4A8_CHUNK, nb = a8_blocks(k), kh = k / 2, kp = w4a8_stride(k);
    for (int r = 0; r < 8; r++) {
        const uint8_t *wr = w + (row0 + r < n ? row0 + r : n - 1) * kh;
        for (int i = 0; i < M; i++) {
            float acc = 0.f;
            for (int64_t c0 = 0; c0 < chunks;) {
                const int64_t next = (c0 + 1) * W4A8_CHUNK, g = c0 * W4A8_CHUNK / group, b = c0 * W4A8_CHUNK / A8_BLOCK;
                const int len = c0 + 1 < chunks && next % A8_BLOCK != 0 && next % group != 0 ? 2 : 1;
                int32_t d = 0, x = 0;
                for (int64_t kk = c0 * W4A8_CHUNK; kk < (c0 + len) * W4A8_CHUNK; kk++) {
                    const int q = (kk & 1) ? wr[kk / 2] >> 4 : wr[kk / 2] & 15;
                    d += xp[i * kp + kk] * q;
                }
                for (int c = 0; c < len; c++) x += xc[i * chunks + c0 + c];
                const float e = fmaf(-zt[g * 8 + r], (float)x, (float)d);
                acc = fmaf(xs[i * nb + b] * swt[g * 8 + r], e, acc);
                c0 += len;
            }
            out[i][r] = acc;
        }
    }
}
#endif

/* tiles of rows [r_begin, r_end) (multiples of 8; the last tile may pass n) of y for all m inputs */
static void w4a8_rows(const int8_t *xp, const int32_t *xc, const float *xs, int64_t m, int64_t k, const uint8_t *w,
                      int64_t n, const float *swt, const float *zt, int64_t group, const float *bias, void *y, int ydt,
                      int64_t r_begin, int64_t r_end) {
    const int64_t groups = (k + group - 1) / group, chunks = k / W4A8_CHUNK, nb = a8_blocks(k), kp = w4a8_stride(k);
    float out[W4A8_MT][8];
    for (int64_t row0 = r_begin; row0 < r_end; row0 += 8) {
        const float *sw = swt + row0 / 8 * groups * 8, *z = zt + row0 / 8 * groups * 8;
        for (int64_t i0 = 0; i0 < m; i0 += W4A8_MT) {
            const int M = m - i0 >= W4A8_MT ? W4A8_MT : (int)(m - i0);
            const int8_t *xi = xp + i0 * kp;
            const int32_t *ci = xc + i0 * chunks;
            const float *si = xs + i0 * nb;
            if (M == 4) w4a8_tile(xi, ci, si, k, w, n, sw, z, group, row0, 4, out);
            else if (M == 3) w4a8_tile(xi, ci, si, k, w, n, sw, z, group, row0, 3, out);
            else if (M == 2) w4a8_tile(xi, ci, si, k, w, n, sw, z, group, row0, 2, out);
            else w4a8_tile(xi, ci, si, k, w, n, sw, z, group, row0, 1, out);
            for (int i = 0; i < M; i++)
                for (int r = 0; r < 8 && row0 + r < n; r++) {
                    const float v = out[i][r];
                    store_f(y, ydt, (i0 + i) * n + row0 + r, bias ? v + bias[row0 + r] : v);
                }
        }
    }
}

/* bst_linear for DT_I4A8: y [m, n] (ydt) = x [m, k] (xdt) quantized per row and block, times the int4 codes
 * w [n, k / 2] (k % 32 == 0) with s_w and z tiled [ceil(n / 8)][groups][8] (module comment) */
static void w4a8_linear(const void *x, int xdt, int64_t m, int64_t k, const uint8_t *w, int64_t n, const float *swt,
                        const float *zt, int64_t group, const float *bias, void *y, int ydt, int threads) {
    int8_t *xq = (int8_t *)malloc((size_t)(m * k) + 64), *xp = (int8_t *)malloc((size_t)(m * w4a8_stride(k)) + 64);
    float *xs = (float *)malloc(sizeof(float) * (size_t)(m * a8_blocks(k)));
    int32_t *xc = (int32_t *)malloc(sizeof(int32_t) * (size_t)(m * (k / W4A8_CHUNK)) + 4);
    a8_quantize(x, xdt, m, k, xq, xs, threads);
    w4a8_inputs(xq, m, k, xp, xc);
    const int64_t tiles = (n + 7) / 8;
    const int parts = a8_parts(n, threads);
#pragma omp parallel for num_threads(parts) schedule(static, 1)
    for (int part = 0; part < parts; part++) {
        const int64_t b = tiles * part / parts * 8, e = tiles * (part + 1) / parts * 8;
        w4a8_rows(xp, xc, xs, m, k, w, n, swt, zt, group, bias, y, ydt, b, e);
    }
    free(xc);
    free(xs);
    free(xp);
    free(xq);
}
