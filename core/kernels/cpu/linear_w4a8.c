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
 *   BST_SIMD (the avx2, avx512 and avx512bf16 builds: 256-bit AVX2 only) the 16 bytes of a 32-feature
 *              chunk broadcast to both halves of a vector, the high half shifted right by 4, & 15: the 32
 *              codes [even k | odd k]; the input codes are permuted per chunk the same way once per call
 *              (w4a8_inputs). vpmaddubsw(codes u8, qx s8) sums pairs in int16 (at most 2 * 15 * 127 = 3810;
 *              the two chunks of a 64-feature segment added in int16: 7620 < 2^15, no saturation),
 *              vpmaddwd(.., 1) in int32; 8 rows' sums are reduced together (hadd) into one vector, lane r
 *              row r. A tile of 8 rows x up to W4A8_MT inputs unpacks each weight chunk once for its inputs.
 *   BST_ISA 0  scalar C, the same sums one code at a time.
 * A block of an input row holding a NaN or an infinity has a NaN scale (a8_block): the row's outputs are NaN. */

#define DT_I4A8 10
#define W4A8_MT 4 /* input rows per tile (the weight chunk unpacked once for all of them) */
#define W4A8_CHUNK 32

/* the segments (block x group intersections) of k features: seg[2 j] = first 32-feature chunk, seg[2 j + 1]
 * = chunks in it (1 or 2); returns their count */
static int64_t w4a8_segments(int64_t k, int64_t group, int32_t *seg) {
    const int64_t chunks = k / W4A8_CHUNK;
    int64_t count = 0;
    for (int64_t c = 0; c < chunks;) {
        const int64_t next = (c + 1) * W4A8_CHUNK;
        const int len = c + 1 < chunks && next % A8_BLOCK != 0 && next % group != 0 ? 2 : 1;
        seg[2 * count] = (int32_t)c;
        seg[2 * count + 1] = len;
        count++;
        c += len;
    }
    return count;
}

/* a8_inputs' codes -> xp [m, k]: signed codes, per 32-feature chunk [the 16 even k | the 16 odd k] (the order
 * w4a8_tile unpacks the nibbles in; the scalar build keeps k's order), and xc [m, k / 32] the chunks' code sums */
static void w4a8_inputs(const int8_t *xq, int64_t m, int64_t k, int8_t *xp, int32_t *xc) {
    const int64_t chunks = k / W4A8_CHUNK;
    for (int64_t i = 0; i < m; i++)
        for (int64_t c = 0; c < chunks; c++) {
            const int8_t *src = xq + i * k + c * W4A8_CHUNK;
            int8_t *dst = xp + i * k + c * W4A8_CHUNK;
            int32_t sum = 0;
            for (int j = 0; j < W4A8_CHUNK; j++) {
                const int8_t q = A8_VNNI ? (int8_t)((uint8_t)src[j] ^ 0x80) : src[j]; /* (VNNI: u = q + 128) */
                dst[BST_SIMD ? (j & 1) * 16 + j / 2 : j] = q;
                sum += q;
            }
            xc[i * chunks + c] = sum;
        }
}

#if BST_SIMD
/* the 32 codes of chunk c of a row (16 bytes at p): [low nibbles (even k) | high nibbles (odd k)] */
INLINE __m256i w4a8_codes(const uint8_t *p) {
    const __m256i b = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)p));
    return _mm256_and_si256(_mm256_srlv_epi32(b, _mm256_setr_epi32(0, 0, 0, 0, 4, 4, 4, 4)), _mm256_set1_epi8(15));
}

/* one segment's int32 dot products of 8 rows (rp) x M inputs -> d[i]: lane r row r's D */
INLINE void w4a8_seg_dots(const int8_t *xp, int64_t k, const uint8_t *const rp[8], int64_t c0, int len, int M,
                          __m256i d[W4A8_MT]) {
    const __m256i ones = _mm256_set1_epi16(1);
    __m256i h[W4A8_MT][2];
    for (int p = 0; p < 4; p++) { /* row pairs 2p, 2p + 1 */
        __m256i a[W4A8_MT][2];
        for (int half = 0; half < 2; half++) {
            const uint8_t *wr = rp[2 * p + half] + c0 * (W4A8_CHUNK / 2);
            const __m256i w0 = w4a8_codes(wr);
            if (len == 2) {
                const __m256i w1 = w4a8_codes(wr + W4A8_CHUNK / 2);
                for (int i = 0; i < M; i++) {
                    const int8_t *xi = xp + i * k + c0 * W4A8_CHUNK;
                    __m256i t = _mm256_add_epi16(_mm256_maddubs_epi16(w0, _mm256_loadu_si256((const __m256i *)xi)),
                                                 _mm256_maddubs_epi16(w1, _mm256_loadu_si256((const __m256i *)(xi + 32))));
                    a[i][half] = _mm256_madd_epi16(t, ones);
                }
            } else
                for (int i = 0; i < M; i++) {
                    const __m256i xv = _mm256_loadu_si256((const __m256i *)(xp + i * k + c0 * W4A8_CHUNK));
                    a[i][half] = _mm256_madd_epi16(_mm256_maddubs_epi16(w0, xv), ones);
                }
        }
        for (int i = 0; i < M; i++) {
            const __m256i pair = _mm256_hadd_epi32(a[i][0], a[i][1]);
            if (p % 2 == 0) h[i][p / 2] = pair;
            else h[i][p / 2] = _mm256_hadd_epi32(h[i][p / 2], pair); /* rows 4q..4q+3 (lanes 0-3 | 4-7 halves) */
        }
    }
    for (int i = 0; i < M; i++)
        d[i] = _mm256_add_epi32(_mm256_permute2x128_si256(h[i][0], h[i][1], 0x20),
                                _mm256_permute2x128_si256(h[i][0], h[i][1], 0x31));
}

/* out[i][r] = acc (module comment) of rows row0.. (8, clamped to n - 1 past the end) for M inputs */
INLINE void w4a8_tile(const int8_t *xp, const int32_t *xc, const float *xs, int64_t k, const uint8_t *w, int64_t n,
                      const float *swt, const float *zt, const int32_t *seg, int64_t nseg, int64_t group, int64_t row0,
                      int M, float out[W4A8_MT][8]) {
    const int64_t chunks = k / W4A8_CHUNK, nb = a8_blocks(k), kh = k / 2;
    const uint8_t *rp[8];
    for (int r = 0; r < 8; r++) rp[r] = w + (row0 + r < n ? row0 + r : n - 1) * kh;
    __m256 acc[W4A8_MT];
    for (int i = 0; i < M; i++) acc[i] = _mm256_setzero_ps();
    for (int64_t j = 0; j < nseg; j++) {
        const int64_t c0 = seg[2 * j], g = c0 * W4A8_CHUNK / group, b = c0 * W4A8_CHUNK / A8_BLOCK;
        const int len = seg[2 * j + 1];
        if (c0 % 4 == 0 && row0 + 8 < n) /* the next tile's rows, 64 bytes ahead */
            for (int r = 0; r < 8; r++) _mm_prefetch((const char *)(rp[r] + 8 * kh + c0 * 16), _MM_HINT_T0);
        __m256i d[W4A8_MT];
        w4a8_seg_dots(xp, k, rp, c0, len, M, d);
        const __m256 sw = _mm256_loadu_ps(swt + g * 8), z = _mm256_loadu_ps(zt + g * 8);
        for (int i = 0; i < M; i++) {
            const int32_t x = xc[i * chunks + c0] + (len == 2 ? xc[i * chunks + c0 + 1] : 0);
            const __m256 e = _mm256_fnmadd_ps(z, _mm256_set1_ps((float)x), _mm256_cvtepi32_ps(d[i]));
            acc[i] = _mm256_fmadd_ps(_mm256_mul_ps(_mm256_set1_ps(xs[i * nb + b]), sw), e, acc[i]);
        }
    }
    for (int i = 0; i < M; i++) _mm256_storeu_ps(out[i], acc[i]);
}
#else
/* the same, one code at a time (BST_ISA 0; xp in k's order) */
INLINE void w4a8_tile(const int8_t *xp, const int32_t *xc, const float *xs, int64_t k, const uint8_t *w, int64_t n,
                      const float *swt, const float *zt, const int32_t *seg, int64_t nseg, int64_t group, int64_t row0,
                      int M, float out[W4A8_MT][8]) {
    const int64_t chunks = k / W4A8_CHUNK, nb = a8_blocks(k), kh = k / 2;
    for (int r = 0; r < 8; r++) {
        const uint8_t *wr = w + (row0 + r < n ? row0 + r : n - 1) * kh;
        for (int i = 0; i < M; i++) {
            float acc = 0.f;
            for (int64_t j = 0; j < nseg; j++) {
                const int64_t c0 = seg[2 * j], g = c0 * W4A8_CHUNK / group, b = c0 * W4A8_CHUNK / A8_BLOCK;
                const int len = seg[2 * j + 1];
                int32_t d = 0, x = 0;
                for (int64_t kk = c0 * W4A8_CHUNK; kk < (c0 + len) * W4A8_CHUNK; kk++) {
                    const int q = (kk & 1) ? wr[kk / 2] >> 4 : wr[kk / 2] & 15;
                    d += xp[i * k + kk] * q;
                }
                for (int c = 0; c < len; c++) x += xc[i * chunks + c0 + c];
                const float e = fmaf(-zt[g * 8 + r], (float)x, (float)d);
                acc = fmaf(xs[i * nb + b] * swt[g * 8 + r], e, acc);
            }
            out[i][r] = acc;
        }
    }
}
#endif

/* tiles of rows [r_begin, r_end) (multiples of 8; the last tile may pass n) of y for all m inputs */
static void w4a8_rows(const int8_t *xp, const int32_t *xc, const float *xs, int64_t m, int64_t k, const uint8_t *w,
                      int64_t n, const float *swt, const float *zt, const int32_t *seg, int64_t nseg, int64_t group,
                      const float *bias, void *y, int ydt, int64_t r_begin, int64_t r_end) {
    const int64_t groups = (k + group - 1) / group, chunks = k / W4A8_CHUNK, nb = a8_blocks(k);
    float out[W4A8_MT][8];
    for (int64_t row0 = r_begin; row0 < r_end; row0 += 8) {
        const float *sw = swt + row0 / 8 * groups * 8, *z = zt + row0 / 8 * groups * 8;
        for (int64_t i0 = 0; i0 < m; i0 += W4A8_MT) {
            const int M = m - i0 >= W4A8_MT ? W4A8_MT : (int)(m - i0);
            const int8_t *xi = xp + i0 * k;
            const int32_t *ci = xc + i0 * chunks;
            const float *si = xs + i0 * nb;
            if (M == 4) w4a8_tile(xi, ci, si, k, w, n, sw, z, seg, nseg, group, row0, 4, out);
            else if (M == 3) w4a8_tile(xi, ci, si, k, w, n, sw, z, seg, nseg, group, row0, 3, out);
            else if (M == 2) w4a8_tile(xi, ci, si, k, w, n, sw, z, seg, nseg, group, row0, 2, out);
            else w4a8_tile(xi, ci, si, k, w, n, sw, z, seg, nseg, group, row0, 1, out);
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
    float *xf = (float *)malloc(sizeof(float) * (size_t)(m * k) + 64);
    int8_t *xq = (int8_t *)malloc((size_t)(m * k) + 64), *xp = (int8_t *)malloc((size_t)(m * k) + 64);
    float *xs = (float *)malloc(sizeof(float) * (size_t)(m * a8_blocks(k)));
    int32_t *xc = (int32_t *)malloc(sizeof(int32_t) * (size_t)(m * (k / W4A8_CHUNK)) + 4);
    int32_t *seg = (int32_t *)malloc(sizeof(int32_t) * (size_t)(2 * (k / W4A8_CHUNK)) + 8);
    to_f32(x, xdt, m * k, xf);
    int parts = threads < 1 ? 1 : threads;
    a8_inputs(xf, m, k, xq, xs, parts);
    w4a8_inputs(xq, m, k, xp, xc);
    const int64_t nseg = w4a8_segments(k, group, seg), tiles = (n + 7) / 8;
    if (n < 64 * parts) parts = 1;
#pragma omp parallel for num_threads(parts) schedule(static, 1)
    for (int part = 0; part < parts; part++) {
        const int64_t b = tiles * part / parts * 8, e = tiles * (part + 1) / parts * 8;
        w4a8_rows(xp, xc, xs, m, k, w, n, swt, zt, seg, nseg, group, bias, y, ydt, b, e);
    }
    free(seg);
    free(xc);
    free(xs);
    free(xp);
    free(xq);
    free(xf);
}
