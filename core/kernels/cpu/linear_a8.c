/* Part of kernels.c, the one translation unit of the CPU kernels: #included there in order, after
 * common.h, vector.h and linear_rows.c (its row tiles, w_off, ROWS), before linear.c (bst_linear calls
 * a8_linear for DT_I8A8; never compiled alone). int8 weights x int8 activations (W8A8, dynamic):
 *
 *   DT_I8A8 = 9  the DT_I8T row tiles (8 rows, blocks of 32 codes) with one float scale s_w[r] per row and
 *                c[r, b] = 128 sum_{k in block b} W[r, k] as floats (bst_linear's `sz`), in the same row tiles:
 *                [n / 8][nb][8] (the VNNI build's correction, below; the others do not read it)
 *
 * Each input row i is quantized on the fly, symmetric, per block b of A8_BLOCK features (the last one may
 * be shorter, a multiple of 32; nb = ceil(k / A8_BLOCK) blocks), as llama.cpp's Q8_0 does per 32:
 *     s[i, b] = max_{k in b} |x[i, k]| / 127,   q[i, k] = round(x[i, k] * (127 / max_{k in b} |x[i, k]|))
 * (float32 products, rounded to nearest even: core.kernels.cpu.ops.a8_quantize_ref computes the same codes),
 * and   y[i, r] = s_w[r] sum_b s[i, b] d[i, r, b] + bias[r],   d[i, r, b] = sum_{k in b} q[i, k] W[r, k]
 * Each block's integer dot product d is exact (int32), and the float32 sum over the blocks runs in the same
 * order for every row whatever the batch, the tile shapes or the thread count: batch-invariant.
 *
 *   BST_ISA 3  vpdpbusd (AVX512_VNNI: u8 x s8, 4 products per int32 lane, 64 multiply-adds an
 *              instruction): the codes are stored as u = q + 128 (0..255); sum_b s[i, b] (sum_k u W) exceeds
 *              the wanted sum by sum_b s[i, b] c[r, b], subtracted once per output
 *   BST_ISA 1/2  vpmaddubsw + vpmaddwd on 256 bits: |W| (u8) x sign(W) q (s8), pairs summed in int16
 *              (at most 2 * 127 * 127 < 2^15: no saturation), then in int32
 *   BST_ISA 0  scalar C
 * A block holding a NaN or an infinity gets a NaN scale: its row's outputs are NaN. Zero blocks read as 0. */

#define DT_I8A8 9
#define A8_BLOCK 64 /* features per activation scale (SmolLM2: 128 cost +1.2% perplexity over W8A16, 64 +0.5%) */
#define A8_MT 3      /* input rows per tile (VNNI: 4 row pairs x 3 inputs x (int32 + float) = 24 accumulators) */
#define A8_VNNI (BST_ISA == 3)

INLINE int64_t a8_blocks(int64_t k) { return (k + A8_BLOCK - 1) / A8_BLOCK; }

/* one block x [len] -> its codes q [len] and scale (module comment); len % 32 == 0 on the vector builds */
INLINE float a8_block(const float *x, int64_t len, int8_t *q) {
    float amax = 0.f, bad = 0.f; /* bad: x * 0 summed, NaN once a NaN or an infinity was seen */
    int64_t j = 0;
#if BST_SIMD
    vf mx = vzero(), bv = vzero();
    for (; j + VW <= len; j += VW) {
        vf v = vloadu(x + j);
        mx = vmax(mx, vabs(v));
        bv = vadd(bv, vmul(v, vzero()));
    }
    float lanes[VW];
    vstoreu(lanes, mx);
    for (int l = 0; l < VW; l++) amax = lanes[l] > amax ? lanes[l] : amax;
    bad = vsum(bv);
#endif
    for (; j < len; j++) {
        float a = fabsf(x[j]);
        amax = a > amax ? a : amax;
        bad += x[j] * 0.f;
    }
    if (bad != 0.f || !(amax < INFINITY) || amax == 0.f) { /* NaN / inf: NaN; all zeros: zeros */
        for (j = 0; j < len; j++) q[j] = (int8_t)(A8_VNNI ? -128 : 0); /* (u = 128: q = 0) */
        return amax == 0.f && bad == 0.f ? 0.f : NAN;
    }
    const float inv = 127.f / amax;
    j = 0;
#if BST_SIMD
    for (; j + VW <= len; j += VW) {
        vi c = vcvt_i32(vround(vmul(vloadu(x + j), vset1(inv)))); /* -127..127 */
        if (A8_VNNI) c = vi_add(c, vi_set1(128));
        vstore_i8(q + j, c); /* (VNNI: a lane of 1..255 stored as its low byte, the uint8 code) */
    }
#endif
    for (; j < len; j++) {
        int c = (int)nearbyintf(x[j] * inv);
        q[j] = (int8_t)(uint8_t)(A8_VNNI ? c + 128 : c);
    }
    return amax / 127.f;
}

/* x [m, k] floats -> codes xq [m, k] (q + 128 as uint8 on the VNNI build, else q) and scales xs [m, nb] */
static void a8_inputs(const float *xf, int64_t m, int64_t k, int8_t *xq, float *xs, int threads) {
    const int64_t nb = a8_blocks(k);
#pragma omp parallel for num_threads(m >= 16 ? threads : 1) schedule(static)
    for (int64_t i = 0; i < m; i++)
        for (int64_t b = 0; b < nb; b++) {
            const int64_t k0 = b * A8_BLOCK, len = k - k0 < A8_BLOCK ? k - k0 : A8_BLOCK;
            xs[i * nb + b] = a8_block(xf + i * k + k0, len, xq + i * k + k0);
        }
}

/* x [m, k] (xdt: float32 / bfloat16 / float16) -> codes xq [m, k] and block scales xs [m, nb] (a8_inputs): the
 * input side of every int8-activation linear (a8_linear, w4a8_linear) */
static void a8_quantize(const void *x, int xdt, int64_t m, int64_t k, int8_t *xq, float *xs, int threads) {
    float *xf = (float *)malloc(sizeof(float) * (size_t)(m * k) + 64);
    to_f32(x, xdt, m * k, xf);
    a8_inputs(xf, m, k, xq, xs, threads < 1 ? 1 : threads);
    free(xf);
}

/* the parts (threads) an int8-activation linear of n output rows splits its rows over: one below 64 rows a part */
INLINE int a8_parts(int64_t n, int threads) {
    const int parts = threads < 1 ? 1 : threads;
    return n < 64 * parts ? 1 : parts;
}

#if A8_VNNI
/* sums[i][r] = sum_b s[i, b] sum_{k in b} u[i, k] W[row0 + r, k] (r = 0..7, one whole tile) for M inputs */
INLINE void a8_tile_vnni(const uint8_t *xq, const float *xs, int64_t k, const int8_t *w, int64_t row0, int M,
                         float sums[A8_MT][8]) {
    const int64_t nb = a8_blocks(k);
    __m512 accf[4][A8_MT];
    for (int p = 0; p < 4; p++)
        for (int i = 0; i < M; i++) accf[p][i] = _mm512_setzero_ps();
    const int8_t *tile = w + row0 * k; /* row0 % 8 == 0: the tile's first byte */
    for (int64_t b = 0; b < nb; b++) {
        const int64_t k0 = b * A8_BLOCK, k1 = k0 + A8_BLOCK < k ? k0 + A8_BLOCK : k;
        __m512i acc[4][A8_MT];
        for (int p = 0; p < 4; p++)
            for (int i = 0; i < M; i++) acc[p][i] = _mm512_setzero_si512();
        for (int64_t kk = k0; kk < k1; kk += I8T_K) {
            const int8_t *blk = tile + kk * TILE_ROWS; /* 8 rows x 32 codes: rows 2p, 2p + 1 in vector p */
            __m512i wv[4];
            for (int p = 0; p < 4; p++) wv[p] = _mm512_loadu_si512((const void *)(blk + 64 * p));
            for (int i = 0; i < M; i++) {
                __m512i xv = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)(xq + i * k + kk)));
                for (int p = 0; p < 4; p++) acc[p][i] = _mm512_dpbusd_epi32(acc[p][i], xv, wv[p]);
            }
        }
        for (int i = 0; i < M; i++) {
            const __m512 s = _mm512_set1_ps(xs[i * nb + b]);
            for (int p = 0; p < 4; p++) accf[p][i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc[p][i]), s, accf[p][i]);
        }
    }
    for (int i = 0; i < M; i++) { /* 4 vectors of (row 2p: lanes 0-7, row 2p + 1: lanes 8-15) -> 8 sums */
        __m512 a = accf[0][i], bb = accf[1][i], c = accf[2][i], d = accf[3][i];
        __m512 ab = _mm512_add_ps(_mm512_unpacklo_ps(a, bb), _mm512_unpackhi_ps(a, bb));
        __m512 cd = _mm512_add_ps(_mm512_unpacklo_ps(c, d), _mm512_unpackhi_ps(c, d));
        __m512 z = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(_mm512_castps_pd(ab), _mm512_castps_pd(cd))),
                                 _mm512_castpd_ps(_mm512_unpackhi_pd(_mm512_castps_pd(ab), _mm512_castps_pd(cd))));
        z = _mm512_add_ps(z, _mm512_shuffle_f32x4(z, z, _MM_SHUFFLE(2, 3, 0, 1)));
        __m128 even = _mm512_castps512_ps128(z), odd = _mm512_extractf32x4_ps(z, 2); /* rows 0 2 4 6 | 1 3 5 7 */
        _mm_storeu_ps(sums[i], _mm_unpacklo_ps(even, odd));
        _mm_storeu_ps(sums[i] + 4, _mm_unpackhi_ps(even, odd));
    }
}
#elif BST_SIMD
/* the same with vpmaddubsw: sums[i][r] = sum_b s[i, b] sum_{k in b} q[i, k] W[row0 + r, k] (q signed codes) */
INLINE void a8_tile_madd(const int8_t *xq, const float *xs, int64_t k, const int8_t *w, int64_t row0, int M,
                         float sums[A8_MT][8]) {
    const __m256i ones = _mm256_set1_epi16(1);
    const int64_t nb = a8_blocks(k);
    const int8_t *tile = w + row0 * k;
    for (int i = 0; i < M; i++) {
        __m256 accf = _mm256_setzero_ps(); /* lane r: row r */
        for (int64_t b = 0; b < nb; b++) {
            const int64_t k0 = b * A8_BLOCK, k1 = k0 + A8_BLOCK < k ? k0 + A8_BLOCK : k;
            __m256i acc[8];
            for (int r = 0; r < 8; r++) acc[r] = _mm256_setzero_si256();
            for (int64_t kk = k0; kk < k1; kk += I8T_K) {
                const int8_t *blk = tile + kk * TILE_ROWS;
                __m256i xv = _mm256_loadu_si256((const __m256i *)(xq + i * k + kk));
                for (int r = 0; r < 8; r++) {
                    __m256i wv = _mm256_loadu_si256((const __m256i *)(blk + 32 * r));
                    __m256i pairs = _mm256_maddubs_epi16(_mm256_abs_epi8(wv), _mm256_sign_epi8(xv, wv));
                    acc[r] = _mm256_add_epi32(acc[r], _mm256_madd_epi16(pairs, ones));
                }
            }
            __m256i h01 = _mm256_hadd_epi32(acc[0], acc[1]), h23 = _mm256_hadd_epi32(acc[2], acc[3]);
            __m256i h45 = _mm256_hadd_epi32(acc[4], acc[5]), h67 = _mm256_hadd_epi32(acc[6], acc[7]);
            __m256i h03 = _mm256_hadd_epi32(h01, h23), h47 = _mm256_hadd_epi32(h45, h67); /* [0-3 lo, 4-7 lo | hi] */
            __m256i rows = _mm256_add_epi32(_mm256_permute2x128_si256(h03, h47, 0x20),
                                            _mm256_permute2x128_si256(h03, h47, 0x31)); /* lane r: row r's d */
            accf = _mm256_fmadd_ps(_mm256_cvtepi32_ps(rows), _mm256_set1_ps(xs[i * nb + b]), accf);
        }
        _mm256_storeu_ps(sums[i], accf);
    }
}

/* The batched form (prefill, decode of several sequences): one 8-row x 32-code chunk of the tiles turned into
 * 8 "quads", quad j holding rows 0..7's codes 4j..4j+3 (lane r: row r), so that one vpmaddubsw + vpmaddwd per input
 * gives the 8 rows' dot products over 4 features in 8 int32 lanes: no horizontal sums, and each quad (and its
 * |W|) is reused by A8_MR inputs. An 8 x 8 transpose of 32-bit elements. */
#define A8_MR 8 /* inputs per pass over a block's quads (8 int32 accumulators + 2 weight vectors + constants) */

INLINE void a8_quads(const int8_t *blk, __m256i *wq, __m256i *wa) {
    __m256i r[8], t[8], u[8];
    for (int i = 0; i < 8; i++) r[i] = _mm256_loadu_si256((const __m256i *)(blk + 32 * i)); /* row i: quads 0..7 */
    for (int i = 0; i < 8; i += 2) { /* t[i]: rows i, i+1 of quads 0 1 | 4 5; t[i+1]: of quads 2 3 | 6 7 */
        t[i] = _mm256_unpacklo_epi32(r[i], r[i + 1]);
        t[i + 1] = _mm256_unpackhi_epi32(r[i], r[i + 1]);
    }
    for (int h = 0; h < 8; h += 4) { /* u[h + j]: rows h..h+3 of quad j | quad j + 4 */
        u[h + 0] = _mm256_unpacklo_epi64(t[h], t[h + 2]);
        u[h + 1] = _mm256_unpackhi_epi64(t[h], t[h + 2]);
        u[h + 2] = _mm256_unpacklo_epi64(t[h + 1], t[h + 3]);
        u[h + 3] = _mm256_unpackhi_epi64(t[h + 1], t[h + 3]);
    }
    for (int j = 0; j < 4; j++) {
        wq[j] = _mm256_permute2x128_si256(u[j], u[4 + j], 0x20);
        wq[j + 4] = _mm256_permute2x128_si256(u[j], u[4 + j], 0x31);
    }
    for (int j = 0; j < 8; j++) wa[j] = _mm256_abs_epi8(wq[j]);
}

/* acc[i] lane r = sum over the nq quads of x row i's codes times row r's (M inputs at xq, stride k) */
INLINE void a8_quad_dots(const int8_t *xq, int64_t k, const __m256i *wq, const __m256i *wa, int nq, int M,
                         __m256i acc[A8_MR]) {
    const __m256i ones = _mm256_set1_epi16(1);
    for (int i = 0; i < M; i++) acc[i] = _mm256_setzero_si256();
    for (int j = 0; j < nq; j++) {
        const __m256i w = wq[j], a = wa[j];
        for (int i = 0; i < M; i++) {
            int32_t quad;
            memcpy(&quad, xq + i * k + 4 * j, 4);
            const __m256i xv = _mm256_sign_epi8(_mm256_set1_epi32(quad), w); /* x sign(W): |W| (x sign(W)) = W x */
            acc[i] = _mm256_add_epi32(acc[i], _mm256_madd_epi16(_mm256_maddubs_epi16(a, xv), ones));
        }
    }
}

/* facc[i] (8 rows, float) += s[i, b] d[i, b] for the M inputs of one pass over block b's quads */
INLINE void a8_quad_pass(const int8_t *xq, const float *xs, int64_t k, int64_t nb, int64_t b, const __m256i *wq,
                         const __m256i *wa, int nq, int M, float *facc) {
    __m256i acc[A8_MR];
    a8_quad_dots(xq, k, wq, wa, nq, M, acc);
    for (int i = 0; i < M; i++) {
        const __m256 s = _mm256_set1_ps(xs[i * nb + b]);
        _mm256_storeu_ps(facc + 8 * i, _mm256_fmadd_ps(_mm256_cvtepi32_ps(acc[i]), s, _mm256_loadu_ps(facc + 8 * i)));
    }
}

/* sums[i][r] for all m inputs of one tile (row0), as a8_tile_madd computes them (the same float operations in the
 * same order: bit for bit the same), the inputs A8_MR at a time over each block's transposed quads. facc [m][8] */
static void a8_tile_quads(const int8_t *xq, const float *xs, int64_t m, int64_t k, const int8_t *w, int64_t row0,
                          float *facc) {
    const int64_t nb = a8_blocks(k);
    const int8_t *tile = w + row0 * k;
    __m256i wq[A8_BLOCK / 4], wa[A8_BLOCK / 4];
    memset(facc, 0, sizeof(float) * 8 * (size_t)m);
    for (int64_t b = 0; b < nb; b++) {
        const int64_t k0 = b * A8_BLOCK, k1 = k0 + A8_BLOCK < k ? k0 + A8_BLOCK : k;
        const int nq = (int)(k1 - k0) / 4;
        for (int64_t kk = k0; kk < k1; kk += I8T_K) a8_quads(tile + kk * TILE_ROWS, wq + (kk - k0) / 4, wa + (kk - k0) / 4);
        int64_t i0 = 0;
        for (; i0 + A8_MR <= m; i0 += A8_MR)
            a8_quad_pass(xq + i0 * k + k0, xs + i0 * nb, k, nb, b, wq, wa, nq, A8_MR, facc + 8 * i0);
        switch ((int)(m - i0)) { /* the rest, with its count known to the compiler */
#define A8_REST(R) case R: a8_quad_pass(xq + i0 * k + k0, xs + i0 * nb, k, nb, b, wq, wa, nq, R, facc + 8 * i0); break;
            A8_REST(1) A8_REST(2) A8_REST(3) A8_REST(4) A8_REST(5) A8_REST(6) A8_REST(7)
#undef A8_REST
        default: break;
        }
    }
}
#define A8_QUADS 1
#define A8_QUADS_MIN 4 /* inputs from which a call runs a8_tile_quads (fewer: a8_tile_madd, no transposes) */
#else
/* the same, one code at a time (BST_ISA 0) */
INLINE void a8_tile_scalar(const int8_t *xq, const float *xs, int64_t k, const int8_t *w, int64_t row0, int M,
                           float sums[A8_MT][8]) {
    const int64_t nb = a8_blocks(k);
    for (int i = 0; i < M; i++)
        for (int r = 0; r < 8; r++) {
            float acc = 0.f;
            for (int64_t b = 0; b < nb; b++) {
                const int64_t k0 = b * A8_BLOCK, k1 = k0 + A8_BLOCK < k ? k0 + A8_BLOCK : k;
                int32_t d = 0;
                for (int64_t kk = k0; kk < k1; kk++) d += xq[i * k + kk] * w[w_off(DT_I8T, row0 + r, kk, k)];
                acc = fmaf((float)d, xs[i * nb + b], acc);
            }
            sums[i][r] = acc;
        }
}
#endif

/* one tile's sums for M inputs, each path (compile-time M after inlining) */
INLINE void a8_tile(const int8_t *xq, const float *xs, int64_t k, const int8_t *w, int64_t row0, int M,
                    float sums[A8_MT][8]) {
#if A8_VNNI
    a8_tile_vnni((const uint8_t *)xq, xs, k, w, row0, M, sums);
#elif BST_SIMD
    a8_tile_madd(xq, xs, k, w, row0, M, sums);
#else
    a8_tile_scalar(xq, xs, k, w, row0, M, sums);
#endif
}

/* rows [r_begin, r_end) (whole tiles) of y for all m inputs: y = s_w (sums - sum_b s c on VNNI) + bias */
static void a8_rows(const int8_t *xq, const float *xs, int64_t m, int64_t k, const int8_t *w, const float *scale,
                    const float *corr, const float *bias, void *y, int ydt, int64_t n, int64_t r_begin,
                    int64_t r_end) {
    const int64_t nb = a8_blocks(k);
    float sums[A8_MT][8];
#ifdef A8_QUADS
    if (m >= A8_QUADS_MIN) {
        float *facc = (float *)malloc(sizeof(float) * 8 * (size_t)m);
        for (int64_t row0 = r_begin; row0 < r_end; row0 += TILE_ROWS) {
            a8_tile_quads(xq, xs, m, k, w, row0, facc);
            for (int64_t i = 0; i < m; i++)
                for (int r = 0; r < 8; r++) {
                    const float v = facc[8 * i + r] * scale[row0 + r];
                    store_f(y, ydt, i * n + row0 + r, bias ? v + bias[row0 + r] : v);
                }
        }
        free(facc);
        return;
    }
#endif
    for (int64_t row0 = r_begin; row0 < r_end; row0 += TILE_ROWS)
        for (int64_t i0 = 0; i0 < m; i0 += A8_MT) {
            const int M = m - i0 >= A8_MT ? A8_MT : (int)(m - i0);
            const int8_t *xi = xq + i0 * k;
            const float *si = xs + i0 * nb;
            if (M == 3) a8_tile(xi, si, k, w, row0, 3, sums);
            else if (M == 2) a8_tile(xi, si, k, w, row0, 2, sums);
            else a8_tile(xi, si, k, w, row0, 1, sums);
            for (int i = 0; i < M; i++) {
#if A8_VNNI /* the codes' offset 128: minus sum_b s[i, b] c[r, b], the tile's 8 rows at once */
                const float *ct = corr + row0 * nb; /* [nb][8] */
                __m256 c = _mm256_setzero_ps();
                for (int64_t b = 0; b < nb; b++) c = _mm256_fmadd_ps(_mm256_set1_ps(si[i * nb + b]), _mm256_loadu_ps(ct + 8 * b), c);
                _mm256_storeu_ps(sums[i], _mm256_sub_ps(_mm256_loadu_ps(sums[i]), c));
#endif
                for (int r = 0; r < 8; r++) {
                    const float v = sums[i][r] * scale[row0 + r];
                    store_f(y, ydt, (i0 + i) * n + row0 + r, bias ? v + bias[row0 + r] : v);
                }
            }
        }
}

/* bst_linear for DT_I8A8: y [m, n] (ydt) = x [m, k] (xdt) quantized per row and block, times the int8 tiles
 * w (n % 8 == 0, k % 32 == 0) with scale [n] and corr [n / 8][nb][8] (module comment) */
static void a8_linear(const void *x, int xdt, int64_t m, int64_t k, const int8_t *w, int64_t n, const float *scale,
                      const float *corr, const float *bias, void *y, int ydt, int threads) {
    int8_t *xq = (int8_t *)malloc((size_t)(m * k) + 64);
    float *xs = (float *)malloc(sizeof(float) * (size_t)(m * a8_blocks(k)));
    a8_quantize(x, xdt, m, k, xq, xs, threads);
    const int parts = a8_parts(n, threads);
#pragma omp parallel for num_threads(parts) schedule(static, 1)
    for (int part = 0; part < parts; part++) {
        const int64_t tiles = n / TILE_ROWS, b = tiles * part / parts * TILE_ROWS, e = tiles * (part + 1) / parts * TILE_ROWS;
        a8_rows(xq, xs, m, k, w, scale, corr, bias, y, ydt, n, b, e);
    }
    free(xs);
    free(xq);
}
