/* Part of kernels.c, the one translation unit of the CPU kernels: #included there in order, after
 * common.h, vector.h and the parts listed before it (never compiled alone). Linear, row tiles: the GEMV over
 * weight rows W [n, k]: float32 / bfloat16 / int8 and their row-tiled layouts (DT_F32T, DT_BF16T, DT_I8T),
 * int8 weights x bfloat16 inputs in int16 (q16), bfloat16 x bfloat16 in vdpbf16ps (bf16t, BST_BF16DOT). */

/* ---------------------------------------------------------------------------------------- */
/* linear: y[m, n] = sum_k x[m, k] W[n, k] (* scale[n]) + bias[n]                           */
/* ---------------------------------------------------------------------------------------- */

#define ROWS 8  /* most weight rows per tile (a single input row: 8 independent FMA chains) */
#define MT 4    /* most input rows per tile (each weight vector loaded once, used MT times) */
#define Q16_BLOCK 64 /* features per scale of the int16 inputs of the int8 x bf16 GEMV (q16, below) */
#ifndef Q16_AHEAD
#define Q16_AHEAD 2048 /* bytes of a tile's stream the q16 GEMV fetches ahead */
#endif

/* the input rows a tile reads: floats (xf [m, k]), or for the q16 path int16 codes (xq [m, k]) and
 * their block scales (xs [m, ceil(k / Q16_BLOCK)]) */
typedef struct {
    const float *xf;
    const int16_t *xq;
    const float *xs;
} tile_inputs;

/* the number of Q16_BLOCK-feature blocks (scales) of an input row of k features */
INLINE int64_t q16_blocks(int64_t k) { return (k + Q16_BLOCK - 1) / Q16_BLOCK; }

/* the same inputs from row i0 on */
INLINE tile_inputs inputs_at(tile_inputs in, int64_t i0, int64_t k) {
    tile_inputs at = {in.xf ? in.xf + i0 * k : NULL, in.xq ? in.xq + i0 * k : NULL,
                      in.xs ? in.xs + i0 * q16_blocks(k) : NULL};
    return at;
}

/* a tile: out[r][i] = sum_k W[row0 + r, k] x[i, k] for R rows and M inputs (unscaled) */
typedef void (*tile_fn)(tile_inputs in, int64_t k, const void *w, int wdt, int64_t row0, int R, int M,
                        float out[ROWS][MT]);

/* DT_I8T / DT_BF16T / DT_F32T: int8 / bfloat16 / float W [n, k] in tiles of TILE_ROWS rows
 * (n % 8 == 0, k % tile_k(dt) == 0): per tile, per block of tile_k(dt) features (32 bytes of int8,
 * 64 of bfloat16 or float), the 8 rows' blocks one after another. A tile's GEMV then reads one sequential
 * stream: the row-major layout interleaves 8 streams a row apart (half the bandwidth cache-cold),
 * the transposed one a stream per feature (~0.65x). */
#define TILE_ROWS 8
#define I8T_K 32
#define BF16T_K 32
#define F32T_K 16
INLINE int tiled_dt(int dt) { return dt == DT_I8T || dt == DT_BF16T || dt == DT_F32T; }
INLINE int64_t tile_k(int dt) { return dt == DT_BF16T ? BF16T_K : dt == DT_F32T ? F32T_K : I8T_K; }
/* the element type of a weight dtype (a tiled one's elements are int8 / bfloat16 / float) */
INLINE int elem_dt(int dt) { return dt == DT_I8T ? DT_I8 : dt == DT_BF16T ? DT_BF16 : dt == DT_F32T ? DT_F32 : dt; }
/* the element offset of W[row, kk] */
INLINE int64_t w_off(int dt, int64_t row, int64_t kk, int64_t k) {
    if (!tiled_dt(dt)) return row * k + kk;
    const int64_t tk = tile_k(dt);
    return row / TILE_ROWS * TILE_ROWS * k + kk / tk * (TILE_ROWS * tk) + row % TILE_ROWS * tk + kk % tk;
}

#if BST_SIMD
/* out[r][i] = dot(W row row0 + r, x row i) for R rows, M inputs (compile-time after inlining).
 * The weight stream of the row 64 features ahead is prefetched. */
INLINE void dense_block(const float *x, int64_t k, const void *w, int dt, int64_t row0, int R, int M,
                        float out[ROWS][MT]) {
    vf acc[ROWS][MT];
    for (int r = 0; r < R; r++)
        for (int i = 0; i < M; i++) acc[r][i] = vzero();
    int64_t kk = 0;
    const int ldt = elem_dt(dt);
    const int64_t esize = ldt == DT_F32 ? 4 : ldt == DT_BF16 ? 2 : 1, line = 64 / esize;
    for (; kk + VW <= k; kk += VW) {
        vf xv[MT];
        for (int i = 0; i < M; i++) xv[i] = vloadu(x + i * k + kk);
        if (tiled_dt(dt)) { /* one stream: 4 blocks ahead of this block's 8 rows */
            const int64_t tk = tile_k(dt), bytes = TILE_ROWS * tk * esize;
            if (kk % tk == 0) {
                const char *p = (const char *)w + w_off(dt, row0 / TILE_ROWS * TILE_ROWS, kk, k) * esize + 4 * bytes;
                for (int64_t b = 0; b < bytes; b += 64) _mm_prefetch(p + b, _MM_HINT_T0);
            }
        } else if (kk % line == 0) /* rows are short (a few cache lines): fetch the next tile's rows early */
            for (int r = 0; r < R; r++) _mm_prefetch((const char *)w + ((row0 + R + r) * k + kk) * esize, _MM_HINT_T0);
        for (int r = 0; r < R; r++) {
            vf wv = vload_any(w, ldt, w_off(dt, row0 + r, kk, k));
            for (int i = 0; i < M; i++) acc[r][i] = vfmadd(wv, xv[i], acc[r][i]);
        }
    }
    if (kk < k) { /* (DT_I8T: k % 32 == 0, never) */
        vf xv[MT];
        for (int i = 0; i < M; i++) xv[i] = vload_any_part(x, DT_F32, i * k + kk, k - kk);
        for (int r = 0; r < R; r++) {
            vf wv = vload_any_part(w, ldt, w_off(dt, row0 + r, kk, k), k - kk);
            for (int i = 0; i < M; i++) acc[r][i] = vfmadd(wv, xv[i], acc[r][i]);
        }
    }
    for (int r = 0; r < R; r++)
        for (int i = 0; i < M; i++) out[r][i] = vsum(acc[r][i]);
}
#endif

INLINE void dense_block_scalar(const float *x, int64_t k, const void *w, int dt, int64_t row0, int R, int M,
                               float out[ROWS][MT]) {
    for (int r = 0; r < R; r++)
        for (int i = 0; i < M; i++) {
            float s = 0.f;
            for (int64_t kk = 0; kk < k; kk++) {
                int64_t off = w_off(dt, row0 + r, kk, k);
                float wv = elem_dt(dt) == DT_I8 ? (float)((const int8_t *)w)[off] : load_f(w, elem_dt(dt), off);
                s += wv * x[i * k + kk];
            }
            out[r][i] = s;
        }
}

INLINE void dense_tile(tile_inputs in, int64_t k, const void *w, int dt, int64_t row0, int R, int M,
                       float out[ROWS][MT]) {
#if BST_SIMD
    dense_block(in.xf, k, w, dt, row0, R, M, out);
#else
    dense_block_scalar(in.xf, k, w, dt, row0, R, M, out);
#endif
}

/* The tile shapes (rows R x inputs M), each its own register-blocked loop per weight dtype:
 * 8 x 1, 4 x 2..4 (8 to 16 accumulators; AVX2, 16 registers: 2 x 3..4), and 1 x M for the
 * rows left at the end. */
#define TILE_SHAPES(FN, DT) \
    if (R == 8) FN(in, k, w, DT, row0, 8, 1, out); \
    else if (R == 4) { \
        if (M == 2) FN(in, k, w, DT, row0, 4, 2, out); \
        else if (M == 3) FN(in, k, w, DT, row0, 4, 3, out); \
        else FN(in, k, w, DT, row0, 4, 4, out); \
    } else if (R == 2) { \
        if (M == 3) FN(in, k, w, DT, row0, 2, 3, out); \
        else FN(in, k, w, DT, row0, 2, 4, out); \
    } else { \
        if (M == 1) FN(in, k, w, DT, row0, 1, 1, out); \
        else if (M == 2) FN(in, k, w, DT, row0, 1, 2, out); \
        else if (M == 3) FN(in, k, w, DT, row0, 1, 3, out); \
        else FN(in, k, w, DT, row0, 1, 4, out); \
    }

static void tile_any(tile_inputs in, int64_t k, const void *w, int wdt, int64_t row0, int R, int M,
                     float out[ROWS][MT]) {
    if (wdt == DT_F32) {
        TILE_SHAPES(dense_tile, DT_F32)
    } else if (wdt == DT_BF16) {
        TILE_SHAPES(dense_tile, DT_BF16)
    } else if (wdt == DT_I8) {
        TILE_SHAPES(dense_tile, DT_I8)
    } else if (wdt == DT_BF16T) {
        TILE_SHAPES(dense_tile, DT_BF16T)
    } else if (wdt == DT_F32T) {
        TILE_SHAPES(dense_tile, DT_F32T)
    } else {
        TILE_SHAPES(dense_tile, DT_I8T)
    }
}

#if BST_AVX512
/* Several inputs on the row tiles (AVX-512: 32 registers): a tile's 8 rows x up to WIDE_M inputs
 * make 24 accumulators, and up to WIDE_PASSES such groups of inputs run over each chunk of
 * WIDE_KC features of the tile while it is in L1 (their accumulators kept between chunks), so the
 * weight streams from memory once for m <= 12 and every weight vector is loaded once per group:
 * a step of a few rows costs about one row's (memory-bound) time. */
#define WIDE_M 3
#define WIDE_PASSES 4
#define WIDE_KC 256
#ifndef WIDE_AHEAD
#define WIDE_AHEAD 384
#endif

/* acc[r][i] += sum_{k0 <= kk < k1} W[row0 + r, kk] x[i, kk] for the tile's 8 rows and M inputs
 * (x: the group's first input row), each lane summed in kk order as dense_block sums it, so every
 * row's result is the same bit for bit whatever the batch. *pf: a cursor ahead in the weight
 * stream, prefetched and moved on `adv` bytes a vector step (wide_rows: a chunk's passes together
 * move it one chunk, so memory keeps streaming while the later groups compute from L1). */
INLINE void wide_span(const float *x, int64_t k, int64_t k0, int64_t k1, const void *w, int dt, int64_t row0, int M,
                      const char **pf, int64_t adv, vf acc[ROWS][MT]) {
    vf a[ROWS][WIDE_M];
    for (int r = 0; r < ROWS; r++)
        for (int i = 0; i < M; i++) a[r][i] = acc[r][i];
    const int ldt = elem_dt(dt);
    const char *p = *pf;
    int64_t kk = k0;
    for (; kk + VW <= k1; kk += VW) {
        for (int64_t b = 0; b < adv; b += 64) _mm_prefetch(p + b, _MM_HINT_T0);
        p += adv;
        vf xv[WIDE_M];
        for (int i = 0; i < M; i++) xv[i] = vloadu(x + i * k + kk);
        for (int r = 0; r < ROWS; r++) {
            vf wv = vload_any(w, ldt, w_off(dt, row0 + r, kk, k));
            for (int i = 0; i < M; i++) a[r][i] = vfmadd(wv, xv[i], a[r][i]);
        }
    }
    if (kk < k1) { /* (the tiled layouts hold whole vectors: never) */
        vf xv[WIDE_M];
        for (int i = 0; i < M; i++) xv[i] = vload_any_part(x, DT_F32, i * k + kk, k1 - kk);
        for (int r = 0; r < ROWS; r++) {
            vf wv = vload_any_part(w, ldt, w_off(dt, row0 + r, kk, k), k1 - kk);
            for (int i = 0; i < M; i++) a[r][i] = vfmadd(wv, xv[i], a[r][i]);
        }
    }
    for (int r = 0; r < ROWS; r++)
        for (int i = 0; i < M; i++) acc[r][i] = a[r][i];
    *pf = p;
}

/* wide_span for a run-time M (1..WIDE_M) and weight dtype: each its own register-blocked loop */
static void wide_span_any(const float *x, int64_t k, int64_t k0, int64_t k1, const void *w, int dt, int64_t row0,
                          int M, const char **pf, int64_t adv, vf acc[ROWS][MT]) {
#define WIDE_DT(DT)                                                                   \
    if (M == 1) wide_span(x, k, k0, k1, w, DT, row0, 1, pf, adv, acc);               \
    else if (M == 2) wide_span(x, k, k0, k1, w, DT, row0, 2, pf, adv, acc);          \
    else wide_span(x, k, k0, k1, w, DT, row0, 3, pf, adv, acc);
    if (dt == DT_F32T) {
        WIDE_DT(DT_F32T)
    } else if (dt == DT_BF16T) {
        WIDE_DT(DT_BF16T)
    } else {
        WIDE_DT(DT_I8T)
    }
#undef WIDE_DT
}

/* dense_rows for float inputs xf [m, k] on a tiled weight (whole 8-row tiles): per tile, up to
 * WIDE_PASSES x WIDE_M inputs at a time in groups of about equal size (m = 4: 2 + 2, 5: 3 + 2,
 * 8: 3 + 3 + 2), k in chunks of WIDE_KC, every group over a chunk before the next chunk. */
static void wide_rows(const float *xf, int64_t m, int64_t k, const void *w, int wdt, const float *scale,
                      const float *bias, void *y, int ydt, int64_t n, int64_t r_begin, int64_t r_end) {
    vf acc[WIDE_PASSES][ROWS][MT];
    const int64_t esize = wdt == DT_F32T ? 4 : wdt == DT_BF16T ? 2 : 1, step = ROWS * VW * esize; /* bytes a vector step */
    for (int64_t row0 = r_begin; row0 < r_end; row0 += ROWS)
        for (int64_t i0 = 0; i0 < m;) {
            int64_t left = m - i0, span = left < WIDE_M * WIDE_PASSES ? left : WIDE_M * WIDE_PASSES;
            int groups = (int)((span + WIDE_M - 1) / WIDE_M), first[WIDE_PASSES + 1];
            for (int g = 0; g <= groups; g++) first[g] = (int)(span * g / groups); /* group g: inputs [first[g], first[g + 1]) */
            for (int g = 0; g < groups; g++)
                for (int r = 0; r < ROWS; r++)
                    for (int i = 0; i < WIDE_M; i++) acc[g][r][i] = vzero();
            for (int64_t k0 = 0; k0 < k; k0 += WIDE_KC) {
                /* the tiles are one stream: the cursor starts WIDE_AHEAD features past this chunk */
                const char *pf = (const char *)w + (row0 * k + k0 * ROWS + WIDE_AHEAD * ROWS) * esize;
                for (int g = 0; g < groups; g++)
                    wide_span_any(xf + (i0 + first[g]) * k, k, k0, k0 + WIDE_KC < k ? k0 + WIDE_KC : k, w, wdt, row0,
                                  first[g + 1] - first[g], &pf, step / groups, acc[g]);
            }
            for (int g = 0; g < groups; g++)
                for (int r = 0; r < ROWS; r++)
                    for (int i = first[g]; i < first[g + 1]; i++) {
                        float v = vsum(acc[g][r][i - first[g]]);
                        if (scale) v *= scale[row0 + r];
                        if (bias) v += bias[row0 + r];
                        store_f(y, ydt, (i0 + i) * n + row0 + r, v);
                    }
            i0 += span;
        }
}
#endif

/* Rows [r_begin, r_end) of y for all m inputs, ROWS rows at a time: every input against those rows
 * while they are in L1 (the weight streams once for any m), in tiles of R rows x M inputs, each
 * row's sum times scale[row] (if any) plus bias[row] (if any). */
static void dense_rows(tile_inputs in, int64_t m, int64_t k, const void *w, int wdt, tile_fn tile, const float *scale,
                       const float *bias, void *y, int ydt, int64_t n, int64_t r_begin, int64_t r_end) {
#if BST_AVX512
    if (m > 1 && tile == tile_any && tiled_dt(wdt)) { /* whole 8-row tiles (n % 8 == 0, ranges on multiples of 8) */
        wide_rows(in.xf, m, k, w, wdt, scale, bias, y, ydt, n, r_begin, r_end);
        return;
    }
#endif
    float out[ROWS][MT];
    for (int64_t rows0 = r_begin; rows0 < r_end; rows0 += ROWS) {
        int64_t rows1 = rows0 + ROWS < r_end ? rows0 + ROWS : r_end;
        for (int64_t i0 = 0; i0 < m; i0 += MT) {
            int M = m - i0 >= MT ? MT : (int)(m - i0);
            int full = M == 1 ? 8 : (BST_ISA == 1 && M > 2) ? 2 : 4;
            const tile_inputs xi = inputs_at(in, i0, k);
            for (int64_t row0 = rows0; row0 < rows1;) {
                int R = rows1 - row0 >= full ? full : 1;
                tile(xi, k, w, wdt, row0, R, M, out);
                for (int r = 0; r < R; r++)
                    for (int i = 0; i < M; i++) {
                        float v = out[r][i];
                        if (scale) v *= scale[row0 + r];
                        if (bias) v += bias[row0 + r];
                        store_f(y, ydt, (i0 + i) * n + row0 + r, v);
                    }
                row0 += R;
            }
        }
    }
}

/* int8 weights (I8 with k % 32 == 0, I8T) x bfloat16 inputs in 16-bit integers (q16, BST_ISA >= 1).
 * Each input row is read per block of Q16_BLOCK features (the last one may be 32) as x = q 2^(e - 15),
 * q int16, with 2^(e - 1) <= max |x| < 2^e over the block. A bfloat16 x has an 8-bit significand, so
 * every x of the block with |x| >= 2^(e - 8) is exact; smaller ones are rounded to a multiple of
 * 2^(e - 15), an error of at most max |x| 2^-15 (bfloat16 itself keeps 2^-9 of each value).
 * A block's products are summed exactly in int32 (|q W| < 2^22, 64 of them; vpmaddwd, or vpdpwssd
 * with AVX512_VNNI: 32 multiply-adds an instruction, against 16 of a float FMA that first has to widen
 * and convert each code), and each block's sum joins the float32 accumulator times its 2^(e - 15):
 *     y[i, r] = scale[r] sum_blocks 2^(e_b - 15) sum_{k in b} W[r, k] q[i, k]   (+ bias[r])
 * Every row of y is summed in the same order whatever the batch (batch-invariant, as the float paths).
 * A block holding a NaN or an infinity gets a NaN scale, so its rows come out NaN. */
INLINE int q16_fits(int wdt, int xdt, int64_t k) {
    return BST_SIMD && xdt == DT_BF16 && ((wdt == DT_I8 && k % 32 == 0) || wdt == DT_I8T);
}

#if BST_SIMD
/* x [m, k] floats -> q [m, k] int16 and the block scales xs [m, ceil(k / Q16_BLOCK)] (k % 32 == 0) */
static void q16_inputs(const float *xf, int64_t m, int64_t k, int16_t *q, float *xs) {
    const int64_t nb = q16_blocks(k);
    for (int64_t i = 0; i < m; i++)
        for (int64_t b = 0; b < nb; b++) {
            const float *x = xf + i * k + b * Q16_BLOCK;
            int16_t *qb = q + i * k + b * Q16_BLOCK;
            const int64_t len = k - b * Q16_BLOCK < Q16_BLOCK ? k - b * Q16_BLOCK : Q16_BLOCK;
            vf mx = vzero(), bad = vzero(); /* bad: x * 0 summed, NaN once a NaN or an infinity was seen */
            for (int64_t j = 0; j < len; j += VW) {
                vf v = vloadu(x + j);
                mx = vmax(mx, vabs(v));
                bad = vadd(bad, vmul(v, vzero()));
            }
            float lanes[VW], amax = 0.f;
            vstoreu(lanes, mx);
            for (int j = 0; j < VW; j++) amax = lanes[j] > amax ? lanes[j] : amax;
            if (vsum(bad) != 0.f) amax = NAN;
            int e = 0;
            if (amax > 0.f && amax < INFINITY) frexpf(amax, &e);
            if (!(amax < INFINITY) || amax == 0.f || e < -100) { /* NaN / inf: a NaN row; zero (or below 2^-100): 0 */
                memset(qb, 0, sizeof(int16_t) * (size_t)len);
                xs[i * nb + b] = amax == amax && amax < INFINITY ? 0.f : NAN;
                continue;
            }
            xs[i * nb + b] = ldexpf(1.f, e - 15);
            const vf inv = vset1(ldexpf(1.f, 15 - e));
            for (int64_t j = 0; j < len; j += VW) {
#if BST_AVX512
                _mm256_storeu_si256((__m256i *)(qb + j), _mm512_cvtsepi32_epi16(vcvt_i32(vround(vmul(vloadu(x + j), inv)))));
#else
                __m256i v = vcvt_i32(vround(vmul(vloadu(x + j), inv)));
                _mm_storeu_si128((__m128i *)(qb + j), _mm_packs_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1)));
#endif
            }
        }
}

/* sum_{j < 32 c} W[j] q[j] in int32 lanes, for c = 1 or 2 runs of 32 codes (w0, w1) and 32 q each */
typedef vi q16v; /* 16-bit lanes in, int32 lanes out of the dot products */
#if BST_AVX512
INLINE q16v q16_w(const int8_t *w) { return _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i *)w)); }
INLINE q16v q16_x(const int16_t *q) { return _mm512_loadu_si512((const void *)q); }
INLINE q16v q16_dot(q16v w, q16v x) { return _mm512_madd_epi16(w, x); }
#if defined(__AVX512VNNI__)
INLINE q16v q16_dot_add(q16v acc, q16v w, q16v x) { return _mm512_dpwssd_epi32(acc, w, x); }
#else
INLINE q16v q16_dot_add(q16v acc, q16v w, q16v x) { return _mm512_add_epi32(acc, _mm512_madd_epi16(w, x)); }
#endif
#define Q16_PER 1 /* vectors per 32 codes */
#else
INLINE q16v q16_w(const int8_t *w) { return _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)w)); }
INLINE q16v q16_x(const int16_t *q) { return _mm256_loadu_si256((const __m256i *)q); }
INLINE q16v q16_dot(q16v w, q16v x) { return _mm256_madd_epi16(w, x); }
INLINE q16v q16_dot_add(q16v acc, q16v w, q16v x) { return _mm256_add_epi32(acc, _mm256_madd_epi16(w, x)); }
#define Q16_PER 2
#endif

/* acc[r][i] += 2^(e_b - 15) sum_{k in block b} W[row0 + r, k] q[i, k] for the block at kk (RUNS 32-code
 * runs: 2, or 1 for a last block of 32); R, M and RUNS are compile-time after inlining */
INLINE void q16_step(const int16_t *xq, const float *xs, int64_t k, int64_t nb, const int8_t *w, int dt,
                     int64_t row0, int R, int M, int64_t b, int RUNS, vf acc[ROWS][MT]) {
    const int64_t kk = b * Q16_BLOCK;
    q16v xv[MT][2 * Q16_PER];
    vf sb[MT];
    for (int i = 0; i < M; i++) {
        for (int v = 0; v < RUNS * Q16_PER; v++) xv[i][v] = q16_x(xq + i * k + kk + v * (32 / Q16_PER));
        sb[i] = vset1(xs[i * nb + b]);
    }
    if (dt == DT_I8T && R == TILE_ROWS) /* a whole tile: one stream, fetched Q16_AHEAD bytes ahead */
        for (int l = 0; l < RUNS * 4; l++)
            _mm_prefetch((const char *)(w + w_off(dt, row0, kk, k)) + Q16_AHEAD + 64 * l, _MM_HINT_T0);
    for (int r = 0; r < R; r++) {
        q16v wv[2 * Q16_PER];
        for (int c = 0; c < RUNS; c++) {
            const int8_t *wr = w + w_off(dt, row0 + r, kk + 32 * c, k);
            for (int v = 0; v < Q16_PER; v++) wv[c * Q16_PER + v] = q16_w(wr + v * (32 / Q16_PER));
        }
        for (int i = 0; i < M; i++) {
            q16v s = q16_dot(wv[0], xv[i][0]);
            for (int v = 1; v < RUNS * Q16_PER; v++) s = q16_dot_add(s, wv[v], xv[i][v]);
            acc[r][i] = vfmadd(vi_to_f(s), sb[i], acc[r][i]);
        }
    }
}

/* out[r][i] = sum_k W[row0 + r, k] x[i, k] / scale for R rows, M inputs (compile-time after inlining) */
INLINE void q16_block(tile_inputs in, int64_t k, const int8_t *w, int dt, int64_t row0, int R, int M,
                      float out[ROWS][MT]) {
    const int16_t *xq = in.xq;
    const float *xs = in.xs;
    const int64_t nb = q16_blocks(k), whole = k / Q16_BLOCK;
    vf acc[ROWS][MT];
    for (int r = 0; r < R; r++)
        for (int i = 0; i < M; i++) acc[r][i] = vzero();
    for (int64_t b = 0; b < whole; b++) q16_step(xq, xs, k, nb, w, dt, row0, R, M, b, 2, acc);
    if (whole < nb) q16_step(xq, xs, k, nb, w, dt, row0, R, M, whole, 1, acc); /* the last 32 features */
    for (int r = 0; r < R; r++)
        for (int i = 0; i < M; i++) out[r][i] = vsum(acc[r][i]);
}

static void q16_any(tile_inputs in, int64_t k, const void *w, int wdt, int64_t row0, int R, int M,
                    float out[ROWS][MT]) {
    if (wdt == DT_I8T) {
        TILE_SHAPES(q16_block, DT_I8T)
    } else {
        TILE_SHAPES(q16_block, DT_I8)
    }
}
#endif

#if BST_BF16DOT
/* DT_BF16T rows row0 .. row0 + R of one tile (R <= 8) x M bfloat16 inputs as pairs (x2 [M, kh],
 * bst_linear): per block of 32 features a row's 64 bytes and an input's 16 pairs make one
 * vdpbf16ps; out[r][i] = the sum of row r's lanes. A row's sum has the same order for any M. */
INLINE void bf16t_block_acc(const uint32_t *x2, int64_t kh, int64_t k, const uint16_t *w, int64_t row0, int R, int M,
                            __m512 acc[ROWS][MT]) {
    for (int r = 0; r < R; r++)
        for (int i = 0; i < M; i++) acc[r][i] = _mm512_setzero_ps();
    const uint16_t *tile = w + row0 / TILE_ROWS * TILE_ROWS * k + row0 % TILE_ROWS * BF16T_K;
    for (int64_t kk = 0; kk < k; kk += BF16T_K) {
        /* this block's first row (w_off); no software prefetch: 4 or 8 blocks ahead measured 20-30%
         * slower cache-cold than the hardware prefetcher alone on this one stream */
        const uint16_t *blk = tile + kk * TILE_ROWS;
        __m512bh xv[MT];
        for (int i = 0; i < M; i++) xv[i] = (__m512bh)_mm512_loadu_si512(x2 + i * kh + kk / 2);
        for (int r = 0; r < R; r++) {
            __m512bh wv = (__m512bh)_mm512_loadu_si512(blk + r * BF16T_K);
            for (int i = 0; i < M; i++) acc[r][i] = _mm512_dpbf16_ps(acc[r][i], wv, xv[i]);
        }
    }
}

/* 4 rows x 4 inputs: the 16 sums in sum16v's lanes (lane 4 i + r) */
INLINE __m512 bf16t_dot_4x4(const uint32_t *x2, int64_t kh, int64_t k, const uint16_t *w, int64_t row0) {
    __m512 acc[ROWS][MT], v[16];
    bf16t_block_acc(x2, kh, k, w, row0, 4, 4, acc);
    for (int r = 0; r < 4; r++)
        for (int i = 0; i < 4; i++) v[r * 4 + i] = acc[r][i];
    return sum16v(v);
}

/* out[r][i] = row r0 + r's sum for input i (R rows x M inputs) */
INLINE void bf16t_block_dot(const uint32_t *x2, int64_t kh, int64_t k, const uint16_t *w, int64_t row0, int R, int M,
                            float out[ROWS][MT]) {
    __m512 acc[ROWS][MT];
    bf16t_block_acc(x2, kh, k, w, row0, R, M, acc);
    for (int r = 0; r < R; r++)
        for (int i = 0; i < M; i++) out[r][i] = _mm512_reduce_add_ps(acc[r][i]);
}

/* y rows [r0, r0 + 4) of inputs [i0, i0 + 4) from 16 sums in sum16v's lanes (lane 4 i + r: input i,
 * row r), + bias: per input one store of 4 floats or 4 bfloat16 (rounded as store_f rounds). */
INLINE void store_4x4(void *y, int ydt, int64_t n, int64_t i0, int64_t r0, __m512 sv, const float *bias) {
    sv = _mm512_add_ps(sv, bias ? _mm512_broadcast_f32x4(_mm_loadu_ps(bias + r0)) : _mm512_setzero_ps());
    if (ydt == DT_F32) {
        float *yf = (float *)y + i0 * n + r0;
        _mm_storeu_ps(yf, _mm512_extractf32x4_ps(sv, 0));
        _mm_storeu_ps(yf + n, _mm512_extractf32x4_ps(sv, 1));
        _mm_storeu_ps(yf + 2 * n, _mm512_extractf32x4_ps(sv, 2));
        _mm_storeu_ps(yf + 3 * n, _mm512_extractf32x4_ps(sv, 3));
    } else {
        __m256i b = _mm512_cvtepi32_epi16(vbf16_bits(sv));
        __m128i lo = _mm256_castsi256_si128(b), hi = _mm256_extracti128_si256(b, 1);
        uint16_t *yb = (uint16_t *)y + i0 * n + r0;
        _mm_storel_epi64((__m128i *)yb, lo);
        _mm_storeh_pd((double *)(yb + n), _mm_castsi128_pd(lo));
        _mm_storel_epi64((__m128i *)(yb + 2 * n), hi);
        _mm_storeh_pd((double *)(yb + 3 * n), _mm_castsi128_pd(hi));
    }
}

/* 8 rows x 2 inputs: the 16 sums in one shuffle tree (v[2 r + i]: row r, input i), permuted to
 * [input][row] lanes, then each input's 8 rows stored at once with bias */
INLINE void bf16t_dot_8x2_store(const uint32_t *x2, int64_t kh, int64_t k, const uint16_t *w, int64_t row0,
                                void *y, int ydt, int64_t n, int64_t i0, const float *bias) {
    __m512 acc[ROWS][MT], v[16];
    bf16t_block_acc(x2, kh, k, w, row0, 8, 2, acc);
    for (int r = 0; r < 8; r++)
        for (int i = 0; i < 2; i++) v[r * 2 + i] = acc[r][i];
    const __m512i perm = _mm512_setr_epi32(0, 8, 1, 9, 2, 10, 3, 11, 4, 12, 5, 13, 6, 14, 7, 15); /* SUM16_LANE(2 r + i) */
    __m512 sv = _mm512_permutexvar_ps(perm, sum16v(v)); /* lane 8 i + r */
    __m256 b8 = bias ? _mm256_loadu_ps(bias + row0) : _mm256_setzero_ps();
    __m512 b = _mm512_castps256_ps512(b8);
    sv = _mm512_add_ps(sv, _mm512_shuffle_f32x4(b, b, 0x44));
    if (ydt == DT_F32) {
        _mm256_storeu_ps((float *)y + i0 * n + row0, _mm512_castps512_ps256(sv));
        _mm256_storeu_ps((float *)y + (i0 + 1) * n + row0, _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(sv), 1)));
    } else {
        __m256i h = _mm512_cvtepi32_epi16(vbf16_bits(sv));
        _mm_storeu_si128((__m128i *)((uint16_t *)y + i0 * n + row0), _mm256_castsi256_si128(h));
        _mm_storeu_si128((__m128i *)((uint16_t *)y + (i0 + 1) * n + row0), _mm256_extracti128_si256(h, 1));
    }
}

/* DT_BF16T rows [r_begin, r_end) (whole tiles) of y for m bfloat16 inputs (x2 [m, kh]): tile by
 * tile, every input against a tile while it is in L1 (the weight streams once for any m). */
static void bf16t_rows(const uint32_t *x2, int64_t m, int64_t k, const uint16_t *w, const float *bias, void *y,
                       int ydt, int64_t n, int64_t r_begin, int64_t r_end) {
    const int64_t kh = k / 2;
    float out[ROWS][MT];
    for (int64_t row0 = r_begin; row0 < r_end; row0 += TILE_ROWS) {
        for (int64_t i0 = 0; i0 < m; i0 += MT) {
            int M = m - i0 >= MT ? MT : (int)(m - i0);
            const uint32_t *xi = x2 + i0 * kh;
            for (int half = 0; half < (M == MT ? 2 : 1); half++) { /* 4 inputs: 4 rows at a time (16 sums) */
                int R = M == MT ? 4 : 8;
                int64_t r0 = row0 + half * 4;
                if (M == 4) { /* 16 sums in sum16v's order, stored 4 at a time */
                    store_4x4(y, ydt, n, i0, r0, bf16t_dot_4x4(xi, kh, k, w, r0), bias);
                    continue;
                }
                if (M == 2) { /* 8 rows of each input stored at once (1 input: memory-bound, the loop below) */
                    bf16t_dot_8x2_store(xi, kh, k, w, r0, y, ydt, n, i0, bias);
                    continue;
                }
                if (M == 1) bf16t_block_dot(xi, kh, k, w, r0, 8, 1, out);
                else bf16t_block_dot(xi, kh, k, w, r0, 8, 3, out);
                for (int r = 0; r < R; r++)
                    for (int i = 0; i < M; i++)
                        store_f(y, ydt, (i0 + i) * n + r0 + r, out[r][i] + (bias ? bias[r0 + r] : 0.f));
            }
        }
    }
}
#endif
