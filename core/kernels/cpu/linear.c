/* Part of kernels.c, the one translation unit of the CPU kernels: #included there in order, after
 * common.h, vector.h and the parts listed before it (never compiled alone). Linear: bst_linear (the path each
 * weight dtype takes through linear_rows.c, linear_int4.c and linear_cols.c, split over threads) and
 * bst_dequantize. */

/* Split rows [0, n) in `parts` ranges on multiples of ROWS. */
INLINE void row_range(int64_t n, int part, int parts, int64_t *b, int64_t *e) {
    int64_t blocks = (n + ROWS - 1) / ROWS;
    *b = blocks * part / parts * ROWS;
    *e = blocks * (part + 1) / parts * ROWS;
    if (*e > n) *e = n;
    if (*b > n) *b = n;
}

/* y [m, n] (ydt) = x [m, k] (xdt) @ W^T: F32 / BF16 weights held transposed, Wt [k, n]; I8
 * q [n, k] (I8T: in row tiles) with scale [n]; for I4 s and sz = s * zero [n, ceil(k / group)], group % 32 == 0; bias [n] float or NULL.
 * scale and sz are float32, except those of I4A8 / I4Q with W_SCALES_BF16 in wdt: bfloat16. */
void bst_linear(const void *x, int xdt, int64_t m, int64_t k, const void *w, int wdt, int64_t n,
                const void *scale, const void *sz, int64_t group, const float *bias, void *y, int ydt,
                int threads) {
    const int sdt = wdt & W_SCALES_BF16 ? DT_BF16 : DT_F32;
    wdt &= ~W_SCALES_BF16;
    if (wdt == DT_I8A8) { /* int8 activations (linear_a8.c): sz holds 128 x the codes' block sums */
        a8_linear(x, xdt, m, k, (const int8_t *)w, n, scale, sz, bias, y, ydt, threads);
        return;
    }
    if (wdt == DT_I4A8) { /* int4 quads x int8 activations (linear_w4a8.c): scale, sz = s_w, z (or NULL) in row tiles */
        w4a8_linear(x, xdt, m, k, (const uint8_t *)w, n, scale, sz, sdt, group, bias, y, ydt, threads);
        return;
    }
    if (wdt == DT_I4Q) { /* int4 quads x float inputs (linear_int4q.c): scale, sz = s, z (or NULL) in row tiles */
        i4q_linear(x, xdt, m, k, (const uint8_t *)w, n, scale, sz, sdt, group, bias, y, ydt, threads);
        return;
    }
    float *xf = (float *)malloc(sizeof(float) * (size_t)(m * k) * (wdt == DT_I4 ? 2 : 1) + 64);
    float *xp = NULL, *xsum = NULL;
    uint32_t *x2 = NULL;
    to_f32(x, xdt, m * k, xf);
#if BST_BF16DOT
    if ((wdt == DT_BF16 || wdt == DT_BF16T) && xdt == DT_BF16) { /* bf16 x as the pairs vdpbf16ps reads: no rounding */
        int64_t kh = (k + 1) / 2;
        const uint16_t *xs = (const uint16_t *)x;
        x2 = (uint32_t *)malloc(sizeof(uint32_t) * (size_t)(m * kh));
        for (int64_t i = 0; i < m; i++)
            for (int64_t p = 0; p < kh; p++)
                x2[i * kh + p] = xs[i * k + 2 * p] | (2 * p + 1 < k ? (uint32_t)xs[i * k + 2 * p + 1] << 16 : 0u);
    }
#endif
    if (wdt == DT_I4) { /* x permuted per I4B-block: [even features, odd features] (int4_rows) */
        xp = xf + m * k;
        for (int64_t i = 0; i < m; i++)
            for (int64_t kk = 0; kk + I4B <= k && I4B > 1; kk += I4B)
                for (int j = 0; j < I4B / 2; j++) {
                    xp[i * k + kk + j] = xf[i * k + kk + 2 * j];
                    xp[i * k + kk + I4B / 2 + j] = xf[i * k + kk + 2 * j + 1];
                }
#if BST_ISA == 1
        xsum = group_sums(xf, m, k, k / I4B * I4B, group); /* the zero-point term of the blocks */
#endif
    }
#if BST_BF16DOT
    if (wdt == DT_I4D) xsum = group_sums(xf, m, k, k, group); /* the zero point and the codes' offset */
#endif
    int16_t *xq = NULL;
    float *xs = NULL;
#if BST_SIMD
    if (q16_fits(wdt, xdt, k)) { /* int8 weights x bfloat16 inputs: 16-bit integer dot products */
        xq = (int16_t *)malloc(sizeof(int16_t) * (size_t)(m * k) + 64);
        xs = (float *)malloc(sizeof(float) * (size_t)(m * q16_blocks(k)));
        q16_inputs(xf, m, k, xq, xs);
    }
#endif
    int parts = threads < 1 ? 1 : threads;
    if (n < 64 * parts) parts = 1;
#pragma omp parallel for num_threads(parts) schedule(static, 1)
    for (int part = 0; part < parts; part++) {
        int64_t b, e;
        row_range(n, part, parts, &b, &e);
        if (wdt == DT_F32 || wdt == DT_BF16) {
            int64_t unit = x2 ? 32 : 16; /* columns split on whole vectors (vdpbf16ps: groups of 32) */
            int64_t vecs = (n + unit - 1) / unit, cb = vecs * part / parts * unit, ce = vecs * (part + 1) / parts * unit;
            cols_range(xf, x2, m, k, w, wdt, bias, y, ydt, n, cb < n ? cb : n, ce < n ? ce : n);
        } else if (wdt == DT_I4)
            int4_rows(xf, xp, xsum, m, k, (const uint8_t *)w, scale, sz, group, bias, y, ydt, n, b, e);
        else if (wdt == DT_I4D) {
#if BST_BF16DOT
            int4d_rows(xf, xdt == DT_BF16 ? (const uint16_t *)x : NULL, xsum, m, k, (const uint8_t *)w, scale, sz, group,
                       bias, y, ydt, n, b, e);
#else /* packed for the avx512bf16 build: NaN rather than a plausible wrong answer */
            for (int64_t i = 0; i < m; i++)
                for (int64_t r = b; r < e; r++) store_f(y, ydt, i * n + r, NAN);
#endif
        }
#if BST_BF16DOT
        else if (wdt == DT_BF16T && x2)
            bf16t_rows(x2, m, k, (const uint16_t *)w, bias, y, ydt, n, b, e);
#endif
#if BST_SIMD
        else if (xq)
            dense_rows((tile_inputs){NULL, xq, xs}, m, k, w, wdt, q16_any, scale, bias, y, ydt, n, b, e);
#endif
        else
            dense_rows((tile_inputs){xf, NULL, NULL}, m, k, w, wdt, tile_any, wdt == DT_I8 || wdt == DT_I8T ? scale : NULL,
                       bias, y, ydt, n, b, e);
    }
    free(x2);
    free(xsum);
    free(xq);
    free(xs);
    free(xf);
}

/* row `row` of W [n, k] (I8 / I8T with scale, I4 / I4D with s, sz, I4Q with s, z, BF16T / F32T) as floats in dst [k]:
 * q * scale, q * s - s z, the value; float weights held transposed (F32 / BF16): NaN. */
static void dequantize_row(const void *w, int wdt, int64_t row, int64_t n, int64_t k, const float *scale,
                           const float *sz, int sdt, int64_t group, float *dst) {
    if (wdt == DT_I4Q) {
        i4q_dequantize_row((const uint8_t *)w, row, n, k, scale, sz, sdt, group, dst);
        return;
    }
    const int64_t groups = wdt == DT_I4 || wdt == DT_I4D ? (k + group - 1) / group : 1;
    int64_t kk = 0;
#if BST_SIMD /* VW features never cross a block of a tiled layout (16 / 32 / 64 wide) or a group (% 32) */
    if (wdt == DT_I8 || wdt == DT_I8T) {
        const vf s = vset1(scale[row]);
        for (; kk + VW <= k; kk += VW) vstoreu(dst + kk, vmul(vload_i8((const int8_t *)w + w_off(wdt, row, kk, k)), s));
    } else if (wdt == DT_BF16T || wdt == DT_F32T) {
        for (; kk + VW <= k; kk += VW) vstoreu(dst + kk, vload_any(w, elem_dt(wdt), w_off(wdt, row, kk, k)));
    } else if (wdt == DT_I4) {
        const uint8_t *wr = (const uint8_t *)w + row * (k / 2);
        for (; kk + VW <= k; kk += VW) {
            int64_t g = row * groups + kk / group;
            vstoreu(dst + kk, vfmsub(vload_nibbles(wr + kk / 2), vset1(scale[g]), vset1(sz[g])));
        }
    } else if (wdt == DT_I4D) {
        for (; kk + VW <= k; kk += VW) {
            int64_t g = i4d_soff(row, kk / group, groups, n);
            vi b = vload_u8i((const uint8_t *)w + i4d_off(row, kk, k, n) + kk % 32);
            vf q = vi_to_f(kk % 64 >= 32 ? vi_srli(b, 4) : vi_and(b, vi_set1(15))); /* the high / low nibble plane */
            vstoreu(dst + kk, vfmsub(q, vset1(scale[g]), vset1(sz[g])));
        }
    }
#endif
    for (; kk < k; kk++) {
        float v;
        if (wdt == DT_I8 || wdt == DT_I8T) {
            v = (float)((const int8_t *)w)[w_off(wdt, row, kk, k)] * scale[row];
        } else if (wdt == DT_BF16T || wdt == DT_F32T) {
            v = load_f(w, elem_dt(wdt), w_off(wdt, row, kk, k));
        } else if (wdt == DT_I4) {
            v = int4_weight((const uint8_t *)w + row * (k / 2), scale + row * groups, sz + row * groups, kk, group);
        } else if (wdt == DT_I4D) {
            int64_t j = i4d_soff(row, kk / group, groups, n);
            v = (float)int4d_code((const uint8_t *)w, row, kk, k, n) * scale[j] - sz[j];
        } else {
            v = NAN; /* float weights are not dequantized */
        }
        dst[kk] = v;
    }
}

/* W [n, k] (I8 with scale / I4, I4D with s, sz / I4Q with s, z) -> float rows [n, k] in ydt: the dequantized
 * weight the prefill GEMM multiplies by. */
void bst_dequantize(const void *w, int wdt, int64_t n, int64_t k, const void *scale, const void *sz,
                    int64_t group, void *y, int ydt, int threads) {
    const int sdt = wdt & W_SCALES_BF16 ? DT_BF16 : DT_F32;
    wdt &= ~W_SCALES_BF16;
    const int parts = threads < 1 ? 1 : threads;
    float *rows = (float *)malloc(sizeof(float) * (size_t)(k * parts));
#pragma omp parallel for num_threads(parts) schedule(static)
    for (int64_t row = 0; row < n; row++) {
        float *dst = rows + k * omp_get_thread_num();
        dequantize_row(w, wdt, row, n, k, scale, sz, sdt, group, dst);
        from_f32(dst, k, (char *)y + (size_t)(row * k) * (ydt == DT_F32 ? 4 : 2), ydt);
    }
    free(rows);
}
