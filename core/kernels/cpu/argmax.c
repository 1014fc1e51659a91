/* Part of kernels.c, the one translation unit of the CPU kernels: #included there in order, after
 * common.h, vector.h and the parts listed before it (never compiled alone). bst_argmax_rows. */

/* ---------------------------------------------------------------------------------------- */
/* greedy sampling                                                                           */
/* ---------------------------------------------------------------------------------------- */

/* out[b] = the first index of the largest of x[b, :V] (float32), as torch.argmax: a NaN counts as
 * the largest (the first NaN's index). One pass: per lane the largest value and where it first
 * was (a strictly larger value moves it), then the lanes' best, the lowest index among ties. */
void bst_argmax_rows(const float *x, int64_t B, int64_t V, int64_t *out, int threads) {
#pragma omp parallel for num_threads(threads < 1 ? 1 : threads) schedule(static) if (B > 1)
    for (int64_t b = 0; b < B; b++) {
        const float *r = x + b * V;
        int64_t j = 0, at = -1;
        float best = -INFINITY;
#if BST_SIMD
        vf m = vset1(-INFINITY);
        vi where = vi_set1(-1), idx, nan = vi_set1(0); /* where: each lane's first maximum; nan: lanes that saw one */
        int32_t lane[VW];
        for (int l = 0; l < VW; l++) lane[l] = l;
        idx = vf_as_i(vloadu((const float *)lane));
        for (; j + VW <= V && V < INT32_MAX; j += VW) {
            vf v = vloadu(r + j);
            where = vi_select_lt(m, v, idx, where); /* strictly larger: the lane's maximum moves */
            m = vselect_lt(m, v, v, m);
            nan = vi_or(nan, vi_select_nan(v, vi_set1(1), vi_set1(0)));
            idx = vi_add(idx, vi_set1(VW));
        }
        float lanes[VW];
        int32_t pos[VW], seen[VW];
        vstoreu(lanes, m);
        vstoreu((float *)pos, vi_as_f(where));
        vstoreu((float *)seen, vi_as_f(nan));
        int any_nan = 0;
        for (int l = 0; l < VW; l++) any_nan |= seen[l] != 0;
        if (any_nan) { /* the first NaN */
            for (at = 0; r[at] == r[at]; at++) {}
            out[b] = at;
            continue;
        }
        for (int l = 0; l < VW; l++)
            if (pos[l] >= 0 && (lanes[l] > best || (lanes[l] == best && pos[l] < at))) best = lanes[l], at = pos[l];
#endif
        for (; j < V; j++) {
            if (r[j] != r[j]) { /* the first NaN (the vector part had none) */
                at = j;
                break;
            }
            if (r[j] > best) best = r[j], at = j;
        }
        out[b] = at < 0 ? 0 : at;
    }
}
