/* Part of kernels.c, the one translation unit of the CPU kernels: #included there in order, after
 * common.h, vector.h and the parts listed before it (never compiled alone). bst_lora_rows. */

/* ---------------------------------------------------------------------------------------- */
/* LoRA rows: each row's own adapter's low-rank update, added in place to a linear's output */
/* ---------------------------------------------------------------------------------------- */

/* v[r] = scale[r0 + r] * sum_k xf[k] A[r0 + r, k] for r < n (A [R, K] in wdt) */
static void lora_dots(const float *xf, int64_t K, const void *A, int wdt, int64_t r0, int64_t n, const float *scale,
                      float *v) {
    int64_t r = 0;
#if BST_SIMD
    for (; r + 4 <= n; r += 4) { /* four rows share each x vector */
        const int64_t o = (r0 + r) * K;
        vf s0 = vzero(), s1 = vzero(), s2 = vzero(), s3 = vzero();
        int64_t k = 0;
        for (; k + VW <= K; k += VW) {
            vf xv = vloadu(xf + k);
            s0 = vfmadd(xv, vload_any(A, wdt, o + k), s0);
            s1 = vfmadd(xv, vload_any(A, wdt, o + K + k), s1);
            s2 = vfmadd(xv, vload_any(A, wdt, o + 2 * K + k), s2);
            s3 = vfmadd(xv, vload_any(A, wdt, o + 3 * K + k), s3);
        }
        if (k < K) {
            vf xv = vload_any_part(xf, DT_F32, k, K - k);
            s0 = vfmadd(xv, vload_any_part(A, wdt, o + k, K - k), s0);
            s1 = vfmadd(xv, vload_any_part(A, wdt, o + K + k, K - k), s1);
            s2 = vfmadd(xv, vload_any_part(A, wdt, o + 2 * K + k, K - k), s2);
            s3 = vfmadd(xv, vload_any_part(A, wdt, o + 3 * K + k, K - k), s3);
        }
        v[r] = vsum(s0) * scale[r0 + r];
        v[r + 1] = vsum(s1) * scale[r0 + r + 1];
        v[r + 2] = vsum(s2) * scale[r0 + r + 2];
        v[r + 3] = vsum(s3) * scale[r0 + r + 3];
    }
#endif
    for (; r < n; r++) {
        float acc = 0.f;
        for (int64_t k = 0; k < K; k++) acc += xf[k] * load_f(A, wdt, (r0 + r) * K + k);
        v[r] = acc * scale[r0 + r];
    }
}

/* out[n0 + j] (odt) += sum_{r < rank} v[r] Bp[r * rows + j] for j < rows (Bp^T [rank, rows] in wdt), summed
 * in float32 and rounded once */
static void lora_piece_add(const float *v, int64_t rank, const void *B, int wdt, int64_t b_off, int64_t rows,
                           void *out, int odt, int64_t n0) {
    int64_t j = 0;
#if BST_SIMD
    for (; j + 4 * VW <= rows; j += 4 * VW) { /* four independent FMA chains */
        vf c0 = vzero(), c1 = vzero(), c2 = vzero(), c3 = vzero();
        for (int64_t r = 0; r < rank; r++) {
            vf s = vset1(v[r]);
            int64_t o = b_off + r * rows + j;
            c0 = vfmadd(s, vload_any(B, wdt, o), c0);
            c1 = vfmadd(s, vload_any(B, wdt, o + VW), c1);
            c2 = vfmadd(s, vload_any(B, wdt, o + 2 * VW), c2);
            c3 = vfmadd(s, vload_any(B, wdt, o + 3 * VW), c3);
        }
        vstore_any(out, odt, n0 + j, vadd(vload_any(out, odt, n0 + j), c0));
        vstore_any(out, odt, n0 + j + VW, vadd(vload_any(out, odt, n0 + j + VW), c1));
        vstore_any(out, odt, n0 + j + 2 * VW, vadd(vload_any(out, odt, n0 + j + 2 * VW), c2));
        vstore_any(out, odt, n0 + j + 3 * VW, vadd(vload_any(out, odt, n0 + j + 3 * VW), c3));
    }
    for (; j + VW <= rows; j += VW) {
        vf c = vzero();
        for (int64_t r = 0; r < rank; r++) c = vfmadd(vset1(v[r]), vload_any(B, wdt, b_off + r * rows + j), c);
        vstore_any(out, odt, n0 + j, vadd(vload_any(out, odt, n0 + j), c));
    }
#endif
    for (; j < rows; j++) {
        float acc = 0.f;
        for (int64_t r = 0; r < rank; r++) acc += v[r] * load_f(B, wdt, b_off + r * rows + j);
        store_f(out, odt, n0 + j, load_f(out, odt, n0 + j) + acc);
    }
}

/* out [T, N] (odt) += each row's own adapter's update on x [T, K] (xdt); rows with idx[t] < 0 or >= L
 * are left alone. Adapter a = idx[t] adds, for each of its pieces (r0, rank, n0, rows, b_off):
 *
 *   v[r] = scale[r0 + r] * sum_k x[t, k] A[r0 + r, k]                         r < rank
 *   out[t, n0 + j] += sum_r v[r] B[b_off + r * rows + j]                      j < rows
 *
 * A [R, K] and B (its pieces' B^T [rank, rows] one after another) in wdt (float / bfloat16), scale
 * [R] float. layout (int64): L + 1 piece starts (adapter a's pieces are start[a] .. start[a + 1] - 1),
 * then 5 per piece as above. An adapter's pieces cover disjoint columns, so each output is read,
 * summed in float32 and rounded once. A == NULL: nothing to add. Rows are taken adapter by adapter
 * (an adapter's weights stay in cache across its rows), split over threads when the work is large. */
void bst_lora_rows(const void *x, int xdt, int64_t T, int64_t K, const void *A, const void *B, int wdt,
                   const float *scale, const int64_t *layout, int64_t L, const int64_t *idx, void *out, int odt,
                   int64_t N, int threads) {
    if (A == NULL || T <= 0) return;
    const int64_t *pieces = layout + L + 1;
    int64_t *order = (int64_t *)malloc(sizeof(int64_t) * (size_t)T);
    int64_t m = 0, work = 0, rmax = 1;
    for (int64_t p = 0; p < layout[L]; p++)
        if (pieces[5 * p + 1] > rmax) rmax = pieces[5 * p + 1];
    for (int64_t a = 0; a < L; a++)
        for (int64_t t = 0; t < T; t++)
            if (idx[t] == a) {
                order[m++] = t;
                for (int64_t p = layout[a]; p < layout[a + 1]; p++) work += pieces[5 * p + 1] * (K + pieces[5 * p + 3]);
            }
    if (m == 0) {
        free(order);
        return;
    }
    int parts = threads < 1 ? 1 : threads;
    if (parts > m) parts = (int)m;
    if (work < (1 << 18)) parts = 1; /* a few microseconds: not worth waking threads */
    const int64_t stride = K + rmax + 16;
    float *scratch = (float *)malloc(sizeof(float) * (size_t)(stride * parts));
    const size_t xs = xdt == DT_F32 ? 4 : 2, os = odt == DT_F32 ? 4 : 2;
#pragma omp parallel for num_threads(parts) schedule(static) if (parts > 1)
    for (int64_t i = 0; i < m; i++) {
        float *xf = scratch + stride * omp_get_thread_num(), *v = xf + K;
        int64_t t = order[i], a = idx[t];
        to_f32((const char *)x + (size_t)(t * K) * xs, xdt, K, xf);
        void *row = (char *)out + (size_t)(t * N) * os;
        for (int64_t p = layout[a]; p < layout[a + 1]; p++) {
            const int64_t *pc = pieces + 5 * p;
            lora_dots(xf, K, A, wdt, pc[0], pc[1], scale, v);
            lora_piece_add(v, pc[1], B, wdt, pc[4], pc[3], row, odt, pc[2]);
        }
    }
    free(scratch);
    free(order);
}
