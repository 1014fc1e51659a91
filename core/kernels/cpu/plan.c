/* Part of kernels.c, the one translation unit of the CPU kernels: #included there in order, after
 * common.h, vector.h and the parts listed before it (never compiled alone). bst_run_plan / bst_run_plan_timed:
 * a decode step's ops in one call; it calls the ops of the parts above, so it comes last. */

/* ---------------------------------------------------------------------------------------- */
/* step plans: a whole decode step as one list of ops, run by one call                      */
/* ---------------------------------------------------------------------------------------- */

/* One op of a plan (bestiary.core.runtime.cpu_plan builds them). Pointers are fixed when the plan is
 * built; what changes per step (token ids, positions, kv lengths, block tables, slots) lives
 * in buffers the ops point at. */
typedef struct {
    int64_t op;
    int64_t dt[4];
    void *p[8];
    int64_t i[8];
    float f[2];
} bst_op;

enum { OP_EMBED = 0, OP_RMS_NORM = 1, OP_LINEAR = 2, OP_ROTARY = 3, OP_KV_WRITE = 4, OP_ATTENTION = 5,
       OP_ACT_MUL = 6, OP_LORA = 7, OP_HEAD_NORM = 8 };

/* QK-norm inside the fused qkv rows: each of T rows (stride elements apart) holds n heads of D
 * elements from its start; each head becomes h / sqrt(mean(h^2) + eps) * w (w [D]), in place. */
static void head_norm(void *x, int dt, int64_t T, int64_t n, int64_t D, int64_t stride, const void *w, int wdt,
                      float eps, int threads) {
    const int64_t esize = dt == DT_F32 ? 4 : 2;
    for (int64_t t = 0; t < T; t++) {
        void *row = (char *)x + t * stride * esize;
        bst_rms_norm(row, NULL, NULL, row, dt, w, wdt, n, D, eps, threads);
    }
}

/* out[t, :] = table[ids[t], :] with table element (v, h) at v * s0 + h * s1 (a tied embedding
 * may be held transposed), or where w_off puts it in a tiled table (a tied one in row tiles). */
static void embed(const void *table, int tdt, int64_t s0, int64_t s1, const int64_t *ids, void *out, int odt,
                  int64_t T, int64_t H) {
    for (int64_t t = 0; t < T; t++)
        for (int64_t h = 0; h < H; h++) {
            int64_t off = tiled_dt(tdt) ? w_off(tdt, ids[t], h, H) : ids[t] * s0 + h * s1;
            store_f(out, odt, t * H + h, load_f(table, elem_dt(tdt), off));
        }
}

void bst_run_plan(const bst_op *ops, int64_t n, int threads) {
    for (int64_t j = 0; j < n; j++) {
        const bst_op *o = ops + j;
        switch (o->op) {
            case OP_EMBED:
                embed(o->p[0], (int)o->dt[0], o->i[2], o->i[3], (const int64_t *)o->p[1], o->p[2], (int)o->dt[1],
                      o->i[0], o->i[1]);
                break;
            case OP_RMS_NORM:
                bst_rms_norm(o->p[0], o->p[1], o->p[2], o->p[3], (int)o->dt[0], o->p[4], (int)o->dt[1], o->i[0],
                             o->i[1], o->f[0], threads);
                break;
            case OP_LINEAR:
                bst_linear(o->p[0], (int)o->dt[0], o->i[0], o->i[1], o->p[1], (int)o->dt[1], o->i[2],
                           (const float *)o->p[2], (const float *)o->p[3], o->i[3], (const float *)o->p[4], o->p[5],
                           (int)o->dt[2], threads);
                break;
            case OP_ROTARY:
                rotary_at(o->p[0], (int)o->dt[0], o->i[0], o->i[1], o->i[2], o->i[3], (const int64_t *)o->p[1],
                          (const float *)o->p[2], o->i[4], (int)o->i[5]);
                break;
            case OP_KV_WRITE:
                bst_kv_write(o->p[0], o->p[1], (int)o->dt[0], o->i[2], o->p[2], o->p[3], (int)o->dt[1],
                             (const int64_t *)o->p[4], o->i[0], o->i[1], (const float *)o->p[5]);
                break;
            case OP_ATTENTION:
                bst_decode_attention(o->p[0], (int)o->dt[0], o->i[7], o->p[1], o->p[2], (int)o->dt[1],
                                     (const int64_t *)o->p[3], o->i[0], (const int64_t *)o->p[4], o->i[1], o->i[2],
                                     o->i[3], o->i[4], o->i[5], o->f[0], (const float *)o->p[5], o->p[6],
                                     (int)o->dt[2], (const float *)o->p[7],
                                     o->i[6] ? (const int64_t *)o->p[4] + o->i[1] : NULL, threads);
                break;
            case OP_ACT_MUL:
                bst_act_and_mul(o->p[0], o->p[1], (int)o->dt[0], o->i[0], o->i[1], (int)o->i[2], threads);
                break;
            case OP_HEAD_NORM: /* p: x (the first head), w; dt: x, w; i: T, heads, D, row stride; f: eps */
                head_norm(o->p[0], (int)o->dt[0], o->i[0], o->i[1], o->i[2], o->i[3], o->p[1], (int)o->dt[1], o->f[0],
                          threads);
                break;
            case OP_LORA: /* p: x, A, B, scale, layout, idx, out; dt: x, weights, out; i: T, K, L, N */
                bst_lora_rows(o->p[0], (int)o->dt[0], o->i[0], o->i[1], o->p[1], o->p[2], (int)o->dt[1],
                              (const float *)o->p[3], (const int64_t *)o->p[4], o->i[2], (const int64_t *)o->p[5],
                              o->p[6], (int)o->dt[2], o->i[3], threads);
                break;
        }
    }
}

/* bst_run_plan one record at a time, adding each record's wall time (seconds) to seconds[j]: the
 * per-op profile of benchmarks/profile_step.py (core.runtime.cpu_plan.DecodePlan.start_profile). */
void bst_run_plan_timed(const bst_op *ops, int64_t n, int threads, double *seconds) {
    for (int64_t j = 0; j < n; j++) {
        struct timespec a, b;
        clock_gettime(CLOCK_MONOTONIC, &a);
        bst_run_plan(ops + j, 1, threads);
        clock_gettime(CLOCK_MONOTONIC, &b);
        seconds[j] += (double)(b.tv_sec - a.tv_sec) + 1e-9 * (double)(b.tv_nsec - a.tv_nsec);
    }
}
