/* Part of kernels.c, the one translation unit of the CPU kernels: #included there in order, after
 * linear_a8.c (its a8_inputs / a8_block / a8_blocks quantize the inputs) and before linear.c (bst_linear
 * calls w4a8_linear for DT_I4A8; never compiled alone). int4 weights x int8 activations (W4A8, dynamic):
 *
 *   DT_I4A8 = 10  the int4 codes (unsigned qw 0..15, two a byte: low nibble = even k) in quads
 *                 (packing.pack_int4_quads): per tile of 8 rows (the last one n % 8 rows), per 8 features,
 *                 the tile's rows' 4 bytes one after another, so a tile is one sequential stream and one
 *                 32-byte load holds 8 features of each of its 8 rows, row r in 32-bit lane r; uint8
 *                 [n, k / 2] in all, k % 32 == 0; groups of G features (G % 32 == 0, the last may be
 *                 short); `scale` s_w and `sz` the zero points z (NOT s * z as DT_I4), both in tiles of 8 rows:
 *                 [ceil(n / 8)][groups][8] (the last tile padded), float32, or bfloat16 where the weight-kind code
 *                 carries W_SCALES_BF16 (a checkpoint's bfloat16 s and z, widened exactly: the same sums, 4 bytes
 *                 fewer per row and group against the group's 64 of codes at G = 128); sz NULL when symmetric:
 *                 z = 8 (a stream of them not read)
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
 *   BST_SIMD (the avx2, avx512 and avx512bf16 builds: 256-bit AVX2 only) a quad of 8 features: & 15, each
 *              row's 4 even-k codes in its lane; >> 4 & 15, its 4 odd-k ones; the input codes are permuted
 *              per 8 features the same way once per call ([4 even | 4 odd], quads_inputs) and each half
 *              broadcast to all lanes. vpmaddubsw(codes u8, qx s8) sums pairs in int16 (at most
 *              2 * 15 * 127 = 3810), the even and odd products of the 4 quads of 32 features added in int16
 *              (8 x 3810 = 30480 < 2^15: no saturation), then vpmaddwd(.., 1): lane r holds row r's D of the
 *              32 features, no horizontal sums. A tile of 8 rows x up to W4A8_MT inputs unpacks each quad once
 *              for all its inputs.
 *   BST_ISA 0  scalar C, the same sums one code at a time.
 * The same walk (quads_tile: blocks, segments, float steps) serves linear_int4q.c's q16 path on int16 codes
 * (`wide`; w4a8_dots16), QUADS_MT16 inputs a tile.
 * A block of an input row holding a NaN or an infinity has a NaN scale (a8_block): the row's outputs are NaN. */

#define DT_I4A8 10
#define W4A8_MT 5 /* input rows per tile (each quad unpacked once for all of them; 5 and 6 ~5% faster than 4 at 512) */
#define QUADS_MT16 2 /* the same for int16 codes and linear_int4q.c's float path (4 measured no faster) */
#define W4A8_CHUNK 32 /* features per int32 sum: a segment is one or two of them */
#define W4A8_QUAD 8   /* features per quad: 4 bytes of each row of a tile */
#define W4A8_AHEAD 2048 /* bytes of the stream fetched ahead (2 threads, cold weights: 10-20% faster than none) */
#define W_SCALES_BF16 256 /* flag of a DT_I4A8 / DT_I4Q weight-kind code: its s and z tiles are bfloat16 (else float32) */

/* the scale or zero-point tiles p (sdt: DT_F32 or DT_BF16) from element i on; NULL stays NULL */
INLINE const void *scales_at(const void *p, int sdt, int64_t i) {
    return p ? (const char *)p + i * (sdt == DT_BF16 ? 2 : 4) : NULL;
}

/* a block of A8_BLOCK features as the segments split it (module comment): its weight groups ga (first 32
 * features) and gb (the next 32), `full` when it has 64 features (else 32: the last block), `split` when its
 * two halves are segments of their own (a group boundary between them, or not full) */
typedef struct {
    int32_t ga, gb;
    int8_t full, split;
} W4A8Block;

static void w4a8_blocks(int64_t k, int64_t group, W4A8Block *blk) {
    for (int64_t b = 0; b < a8_blocks(k); b++) {
        const int64_t k0 = b * A8_BLOCK;
        blk[b].full = (int8_t)(k0 + A8_BLOCK <= k);
        blk[b].split = (int8_t)(!blk[b].full || (k0 + W4A8_CHUNK) % group == 0);
        blk[b].ga = (int32_t)(k0 / group);
        blk[b].gb = (int32_t)((k0 + W4A8_CHUNK) / group);
    }
}

/* the input codes [m, k] (int8, or int16 when `wide`: linear_int4q.c's q16 path) in place, per 8 features
 * [their 4 even k | their 4 odd k] (the order the quads unpack the nibbles in; the scalar build keeps k's order),
 * and xc [m, k / 32] their sums per 32 (k % 32 == 0). int8 codes of the VNNI build (u = q + 128) become q. */
static void quads_inputs(void *codes, int wide, int64_t m, int64_t k, int32_t *xc) {
    int8_t *c8 = (int8_t *)codes;
    int16_t *c16 = (int16_t *)codes;
    for (int64_t c = 0; c < m * k / W4A8_CHUNK; c++) {
        int32_t v[W4A8_CHUNK], sum = 0;
        for (int j = 0; j < W4A8_CHUNK; j++) {
            const int64_t at = c * W4A8_CHUNK + j;
            v[j] = wide ? c16[at] : A8_VNNI ? (int8_t)((uint8_t)c8[at] ^ 0x80) : c8[at];
            sum += v[j];
        }
        for (int j = 0; j < W4A8_CHUNK; j++) {
            const int64_t at = c * W4A8_CHUNK + (BST_SIMD ? j / W4A8_QUAD * W4A8_QUAD + (j & 1) * 4 + j % W4A8_QUAD / 2 : j);
            if (wide) c16[at] = (int16_t)v[j];
            else c8[at] = (int8_t)v[j];
        }
        xc[c] = sum;
    }
}

#if BST_SIMD
/* a tile's 8 scales or zero points at p as float32 (bfloat16 ones widened: exact) */
INLINE __m256 load8_scales(const void *p, int sdt) {
    if (sdt == DT_BF16)
        return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p)), 16));
    return _mm256_loadu_ps((const float *)p);
}

/* the float32 steps of one segment (module comment): acc += (s_x s_w) fmaf(-z, X, D) (z NULL: 8) */
INLINE __m256 w4a8_step(__m256 acc, __m256i d, int32_t x, float sx, const void *sw, const void *z, int sdt) {
    const __m256 zv = z ? load8_scales(z, sdt) : _mm256_set1_ps(8.f);
    const __m256 e = _mm256_fnmadd_ps(zv, _mm256_set1_ps((float)x), _mm256_cvtepi32_ps(d));
    return _mm256_fmadd_ps(_mm256_mul_ps(_mm256_set1_ps(sx), load8_scales(sw, sdt)), e, acc);
}

/* s[i] lane r += (int16 pairs) the 8 features at xp (input i at xp + i k) times row r's codes, from the one
 * quad at p (a tile of nr rows; a short tile's lanes past nr read as 0) */
INLINE void w4a8_quad(const int8_t *xp, int64_t k, const uint8_t *p, int nr, __m256i rows, int M, __m256i s[W4A8_MT]) {
    const __m256i low4 = _mm256_set1_epi8(15);
    const __m256i v = nr == 8 ? _mm256_loadu_si256((const __m256i *)p) : _mm256_maskload_epi32((const int *)p, rows);
    const __m256i lo = _mm256_and_si256(v, low4), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), low4);
    for (int i = 0; i < M; i++) {
        int32_t even, odd;
        memcpy(&even, xp + i * k, 4);
        memcpy(&odd, xp + i * k + 4, 4);
        const __m256i t = _mm256_add_epi16(_mm256_maddubs_epi16(lo, _mm256_set1_epi32(even)),
                                           _mm256_maddubs_epi16(hi, _mm256_set1_epi32(odd)));
        s[i] = _mm256_add_epi16(s[i], t);
    }
}

/* d[i] lane r += sum over the 32 features at xp (input i at xp + i k) of their codes times row r's, from the
 * 4 quads at q (quads nr * 4 bytes apart). The quads' loop is rolled when M > 1 (unrolled, gcc spilled the
 * int16 sums: ~20% slower at 512 inputs) and unrolled for the GEMV (M = 1: rolled, a little slower there). */
INLINE void w4a8_dots(const int8_t *xp, int64_t k, const uint8_t *q, int nr, __m256i rows, int M,
                      __m256i d[W4A8_MT]) {
    __m256i s[W4A8_MT];
    for (int i = 0; i < M; i++) s[i] = _mm256_setzero_si256();
    if (M == 1)
        for (int c = 0; c < W4A8_CHUNK / W4A8_QUAD; c++) w4a8_quad(xp + c * W4A8_QUAD, k, q + c * nr * 4, nr, rows, 1, s);
    else {
#pragma GCC unroll 1
        for (int c = 0; c < W4A8_CHUNK / W4A8_QUAD; c++) w4a8_quad(xp + c * W4A8_QUAD, k, q + c * nr * 4, nr, rows, M, s);
    }
    for (int i = 0; i < M; i++) d[i] = _mm256_add_epi32(d[i], _mm256_madd_epi16(s[i], _mm256_set1_epi16(1)));
}

/* the same from int16 codes (`wide`: linear_int4q.c's q16 path, xq per 8 features [4 even k | 4 odd k]): per
 * quad the even and odd codes widened to 16 bits (4 rows a register, 4 codes each), one vpmaddwd each against
 * the 4 even or 4 odd input codes in every 64 bits, one vphaddd per 32 features for row r's sum in lane r */
INLINE void w4a8_dots16(const int16_t *xq, int64_t k, const uint8_t *q, int nr, __m256i rows, int M,
                        __m256i d[W4A8_MT]) {
    const __m256i low4 = _mm256_set1_epi8(15), zero = _mm256_setzero_si256();
    __m256i acc[W4A8_MT][2];
    for (int i = 0; i < M; i++) acc[i][0] = acc[i][1] = zero;
    for (int c = 0; c < W4A8_CHUNK / W4A8_QUAD; c++) {
        const uint8_t *p = q + c * nr * 4;
        const __m256i v = nr == 8 ? _mm256_loadu_si256((const __m256i *)p) : _mm256_maskload_epi32((const int *)p, rows);
        const __m256i lo = _mm256_and_si256(v, low4), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), low4);
        /* 16-bit codes, per 128-bit half rows (0, 1 | 4, 5) or (2, 3 | 6, 7), each row's 4 even or 4 odd ones */
        const __m256i e01 = _mm256_unpacklo_epi8(lo, zero), e23 = _mm256_unpackhi_epi8(lo, zero);
        const __m256i o01 = _mm256_unpacklo_epi8(hi, zero), o23 = _mm256_unpackhi_epi8(hi, zero);
        for (int i = 0; i < M; i++) {
            int64_t even, odd;
            memcpy(&even, xq + i * k + c * W4A8_QUAD, 8);
            memcpy(&odd, xq + i * k + c * W4A8_QUAD + 4, 8);
            const __m256i xe = _mm256_set1_epi64x(even), xo = _mm256_set1_epi64x(odd);
            acc[i][0] = _mm256_add_epi32(acc[i][0], _mm256_add_epi32(_mm256_madd_epi16(e01, xe), _mm256_madd_epi16(o01, xo)));
            acc[i][1] = _mm256_add_epi32(acc[i][1], _mm256_add_epi32(_mm256_madd_epi16(e23, xe), _mm256_madd_epi16(o23, xo)));
        }
    }
    for (int i = 0; i < M; i++) /* [r0 r0 r1 r1 | r4 r4 r5 r5], [r2 r2 r3 r3 | ..] -> [r0 r1 r2 r3 | r4 r5 r6 r7] */
        d[i] = _mm256_add_epi32(d[i], _mm256_hadd_epi32(acc[i][0], acc[i][1]));
}

/* d[i] += the 32 features' dot products at feature `at` of the codes xp (int8, or int16 when `wide`) */
INLINE void quads_dots(const void *xp, int wide, int64_t at, int64_t k, const uint8_t *q, int nr, __m256i rows, int M,
                       __m256i d[W4A8_MT]) {
    if (wide) w4a8_dots16((const int16_t *)xp + at, k, q, nr, rows, M, d);
    else w4a8_dots((const int8_t *)xp + at, k, q, nr, rows, M, d);
}

/* out[i][r] = acc (module comment) of the tile's rows r < nr for M inputs with codes xp (int8, or int16 when
 * `wide`), a block of A8_BLOCK features at a time: its one or two chunks' sums added in int32 (M accumulators
 * live, not one set per chunk: no spills) */
INLINE void quads_tile(const void *xp, int wide, const int32_t *xc, const float *xs, int64_t k, const uint8_t *tile,
                       int nr, const W4A8Block *blk, const void *swt, const void *zt, int sdt, int M,
                       float out[W4A8_MT][8]) {
    const int64_t chunks = k / W4A8_CHUNK, nb = a8_blocks(k);
    const __m256i rows = _mm256_cmpgt_epi32(_mm256_set1_epi32(nr), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
    for (int i = 0; i < M; i++) _mm256_storeu_ps(out[i], _mm256_setzero_ps());
    for (int64_t b = 0; b < nb; b++) {
        const int64_t k0 = b * A8_BLOCK;
        const W4A8Block s = blk[b];
        for (int l = 0; l < 4; l++) _mm_prefetch((const char *)(tile + k0 / 2 * nr + W4A8_AHEAD + 64 * l), _MM_HINT_T0);
        const void *za = scales_at(zt, sdt, s.ga * 8), *zb = scales_at(zt, sdt, s.gb * 8);
        __m256i d[W4A8_MT];
        for (int i = 0; i < M; i++) d[i] = _mm256_setzero_si256();
        quads_dots(xp, wide, k0, k, tile + k0 / 2 * nr, nr, rows, M, d);
        if (s.split)
            for (int i = 0; i < M; i++) {
                _mm256_storeu_ps(out[i], w4a8_step(_mm256_loadu_ps(out[i]), d[i], xc[i * chunks + 2 * b], xs[i * nb + b],
                                                   scales_at(swt, sdt, s.ga * 8), za, sdt));
                d[i] = _mm256_setzero_si256();
            }
        if (!s.full) continue; /* (a short block is split: done) */
        quads_dots(xp, wide, k0 + W4A8_CHUNK, k, tile + (k0 + W4A8_CHUNK) / 2 * nr, nr, rows, M, d);
        for (int i = 0; i < M; i++) { /* (not split: ga == gb, one step for the block's D and X) */
            const int32_t xb = xc[i * chunks + 2 * b + 1] + (s.split ? 0 : xc[i * chunks + 2 * b]);
            _mm256_storeu_ps(out[i], w4a8_step(_mm256_loadu_ps(out[i]), d[i], xb, xs[i * nb + b],
                                               scales_at(swt, sdt, s.gb * 8), zb, sdt));
        }
    }
}
#else
/* row r's code of feature kk in a tile of nr rows (the quads) */
INLINE int w4a8_code(const uint8_t *tile, int nr, int r, int64_t kk) {
    const uint8_t byte = tile[kk / W4A8_QUAD * nr * 4 + r * 4 + kk % W4A8_QUAD / 2];
    return (kk & 1) ? byte >> 4 : byte & 15;
}

/* the same, one code at a time (BST_ISA 0: int8 codes xp in k's order; int16 ones are never `wide` here) */
INLINE void quads_tile(const void *codes, int wide, const int32_t *xc, const float *xs, int64_t k, const uint8_t *tile,
                       int nr, const W4A8Block *blk, const void *swt, const void *zt, int sdt, int M,
                       float out[W4A8_MT][8]) {
    const int8_t *xp = (const int8_t *)codes;
    (void)wide;
    const int64_t chunks = k / W4A8_CHUNK, nb = a8_blocks(k);
    for (int r = 0; r < nr; r++)
        for (int i = 0; i < M; i++) {
            float acc = 0.f;
            for (int64_t b = 0; b < nb; b++) {
                const W4A8Block s = blk[b];
                int32_t d[2] = {0, 0};
                for (int h = 0; h < 1 + s.full; h++)
                    for (int64_t kk = b * A8_BLOCK + h * W4A8_CHUNK; kk < b * A8_BLOCK + (h + 1) * W4A8_CHUNK; kk++)
                        d[h] += xp[i * k + kk] * w4a8_code(tile, nr, r, kk);
                const int32_t xa = xc[i * chunks + 2 * b], xb = s.full ? xc[i * chunks + 2 * b + 1] : 0;
                const float sx = xs[i * nb + b];
                const float za = zt ? load_f(zt, sdt, s.ga * 8 + r) : 8.f, swa = load_f(swt, sdt, s.ga * 8 + r);
                if (!s.split)
                    acc = fmaf(sx * swa, fmaf(-za, (float)(xa + xb), (float)(d[0] + d[1])), acc);
                else {
                    acc = fmaf(sx * swa, fmaf(-za, (float)xa, (float)d[0]), acc);
                    if (s.full) { /* (gb of a short last block may be one past the last group: read only here) */
                        const float zb = zt ? load_f(zt, sdt, s.gb * 8 + r) : 8.f, swb = load_f(swt, sdt, s.gb * 8 + r);
                        acc = fmaf(sx * swb, fmaf(-zb, (float)xb, (float)d[1]), acc);
                    }
                }
            }
            out[i][r] = acc;
        }
}
#endif

/* y's rows row0 .. row0 + nr of inputs i0 .. i0 + M: out plus bias (the quads' tiles, of every path) */
INLINE void quads_store(float out[W4A8_MT][8], int M, int nr, int64_t i0, int64_t row0, int64_t n, const float *bias,
                        void *y, int ydt) {
    for (int i = 0; i < M; i++)
        for (int r = 0; r < nr; r++) {
            const float v = out[i][r];
            store_f(y, ydt, (i0 + i) * n + row0 + r, bias ? v + bias[row0 + r] : v);
        }
}

/* tiles [t_begin, t_end) of y for all m inputs from their codes xp (int8, or int16 when `wide`: W4A8_MT or
 * QUADS_MT16 inputs a tile) */
static void quads_rows(const void *xp, int wide, const int32_t *xc, const float *xs, int64_t m, int64_t k,
                       const uint8_t *w, int64_t n, const W4A8Block *blk, const void *swt, const void *zt, int sdt,
                       int64_t group, const float *bias, void *y, int ydt, int64_t t_begin, int64_t t_end) {
    const int64_t groups = (k + group - 1) / group, chunks = k / W4A8_CHUNK, nb = a8_blocks(k);
    const int mt = wide ? QUADS_MT16 : W4A8_MT;
    float out[W4A8_MT][8];
    for (int64_t t = t_begin; t < t_end; t++) {
        const int64_t row0 = t * 8;
        const int nr = n - row0 < 8 ? (int)(n - row0) : 8;
        const uint8_t *tile = w + row0 * (k / 2);
        const void *sw = scales_at(swt, sdt, t * groups * 8), *z = scales_at(zt, sdt, t * groups * 8);
        for (int64_t i0 = 0; i0 < m; i0 += mt) {
            const int M = m - i0 >= mt ? mt : (int)(m - i0);
            const void *xi = (const char *)xp + i0 * k * (wide ? 2 : 1);
            const int32_t *ci = xc + i0 * chunks;
            const float *si = xs + i0 * nb;
            if (nr < 8) quads_tile(xi, wide, ci, si, k, tile, nr, blk, sw, z, sdt, M, out); /* the short last tile */
            else if (wide) { /* (constants: unrolled) */
                if (M == 1) quads_tile(xi, 1, ci, si, k, tile, 8, blk, sw, z, sdt, 1, out);
                else quads_tile(xi, 1, ci, si, k, tile, 8, blk, sw, z, sdt, QUADS_MT16, out);
            } else switch (M) {
#define QUADS_FULL(R) case R: quads_tile(xi, 0, ci, si, k, tile, 8, blk, sw, z, sdt, R, out); break;
                QUADS_FULL(1) QUADS_FULL(2) QUADS_FULL(3) QUADS_FULL(4) QUADS_FULL(5) /* (up to W4A8_MT) */
#undef QUADS_FULL
                default: break;
            }
            quads_store(out, M, nr, i0, row0, n, bias, y, ydt);
        }
    }
}

/* y [m, n] (ydt) from the input codes xp [m, k] (int8, or int16 when `wide`; permuted in place, quads_inputs)
 * with their block scales xs, times the quads w (module comment), on a8_parts(n, threads) threads */
static void quads_linear(void *xp, int wide, const float *xs, int64_t m, int64_t k, const uint8_t *w, int64_t n,
                         const void *swt, const void *zt, int sdt, int64_t group, const float *bias, void *y, int ydt,
                         int threads) {
    int32_t *xc = (int32_t *)malloc(sizeof(int32_t) * (size_t)(m * (k / W4A8_CHUNK)) + 4);
    W4A8Block *blk = (W4A8Block *)malloc(sizeof(W4A8Block) * (size_t)a8_blocks(k));
    quads_inputs(xp, wide, m, k, xc);
    w4a8_blocks(k, group, blk);
    const int64_t tiles = (n + 7) / 8;
    const int parts = a8_parts(n, threads);
#pragma omp parallel for num_threads(parts) schedule(static, 1)
    for (int part = 0; part < parts; part++)
        quads_rows(xp, wide, xc, xs, m, k, w, n, blk, swt, zt, sdt, group, bias, y, ydt, tiles * part / parts,
                   tiles * (part + 1) / parts);
    free(blk);
    free(xc);
}

/* bst_linear for DT_I4A8: y [m, n] (ydt) = x [m, k] (xdt) quantized per row and block, times the int4 quads
 * w [n, k / 2] (k % 32 == 0) with s_w and z tiled [ceil(n / 8)][groups][8] in sdt (module comment) */
static void w4a8_linear(const void *x, int xdt, int64_t m, int64_t k, const uint8_t *w, int64_t n, const void *swt,
                        const void *zt, int sdt, int64_t group, const float *bias, void *y, int ydt, int threads) {
    int8_t *xq = (int8_t *)malloc((size_t)(m * k) + 64);
    float *xs = (float *)malloc(sizeof(float) * (size_t)(m * a8_blocks(k)));
    a8_quantize(x, xdt, m, k, xq, xs, threads);
    quads_linear(xq, 0, xs, m, k, w, n, swt, zt, sdt, group, bias, y, ydt, threads);
    free(xs);
    free(xq);
}
