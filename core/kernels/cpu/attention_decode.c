/* Part of kernels.c, the one translation unit of the CPU kernels: #included there in order, after
 * common.h, vector.h and the parts listed before it (never compiled alone). bst_decode_attention over the
 * paged KV pool (load_kv_row: kv_cache.c). */

/* ---------------------------------------------------------------------------------------- */
/* decode attention over the paged pool                                                     */
/* ---------------------------------------------------------------------------------------- */

#define PAD 16 /* floats past a head's D in the stack rows: a vector tail reads zeros there */

/* out[b, h, :] = softmax_j(q[b, h] . K_j * scale + slope_h * (j - (L_b - 1))) V_j over the L_b =
 * kv_lens[b] cached keys of sequence b: K_j = k_pool[table[b, j / bs], j % bs, h / G], G = H / KVH.
 * q [B, H, D] (qdt; q_stride elements from one sequence's row to the next), pools [blocks, bs, KVH, D] (kvdt), tables [B, max_blocks] int64,
 * slopes [H] float or NULL, out [B, H, D] (odt). Quantized pools (kvdt DT_I8 / DT_F8) hold codes with
 * K = code * kv_scales[0], V = code * kv_scales[1]; float pools pass kv_scales NULL. windows [2, B] int64
 * (or NULL): each sequence's attention window W (0 = none) and sinks S (core.kernels.attention_window): the
 * query then sees only keys j < S and j >= L_b - (W - S), and no other key is read.
 *
 * A task is one sequence and up to GQ of the G query heads sharing a key head: each key and value row
 * is found, fetched and read once for them all (per head the sums run in the same order as for one). */
#define GQ 4
/* Sequence b's query heads h0 .. h0 + gc of key head kvh (see bst_decode_attention). */
static void attend_heads(const void *q, int qdt, int64_t q_stride, const void *k_pool, const void *v_pool, int kvdt,
                         const int64_t *tables, int64_t max_blocks, const int64_t *kv_lens, int64_t B, int64_t H,
                         int64_t KVH, int64_t D, int64_t bs, int bs_shift, float scale, const float *slopes, void *out,
                         int odt, const float *kv_scales, const int64_t *windows, int64_t b, int64_t kvh, int64_t h0,
                         int gc) {
    int64_t L = kv_lens[b];
    const int64_t *table = tables + b * max_blocks;
    /* windows [2, B] (or NULL): window W (0 = none) and sinks S of each sequence. The query at L - 1
     * sees keys j < S and j >= lo = max(0, L - (W - S)): n of them, key t of the walk at j_of(t). */
    int64_t W = windows ? windows[b] : 0, S = W ? windows[B + b] : 0;
    int64_t lo = W ? (L - (W - S) > 0 ? L - (W - S) : 0) : 0, ns = S < lo ? S : lo, n = ns + L - lo;
#define J_OF(t) ((t) < ns ? (t) : lo + (t) - ns)
#define SLOT_OF(j) (bs_shift >= 0 ? (table[(j) >> bs_shift] << bs_shift) + ((j) & (bs - 1)) : table[(j) / bs] * bs + (j) % bs)
/* the rows are scattered (blocks, other heads between): fetch key t + 16 ahead, and the value at
 * element off (key t's, its own head) for the weighted sum after the softmax; `fetch` bytes of each row.
 * Into L2 (T1): T0 fills the L1's few miss buffers and stalls the walk. benchmarks/attention_stream.py,
 * 64 sequences x 150-1500 keys, pools out of cache: 12.7-15.5 GB/s with T0 (and a task per sequence
 * over whole rows), 15.5-18.1 with T1 (the same), 18.5-18.9 with T1 and a task per key head; ~10
 * without software prefetch */
#define FETCH_ROWS(t, off)                                                                                        \
    do {                                                                                                          \
        if ((t) + 16 < n) {                                                                                       \
            int64_t offa = (SLOT_OF(J_OF((t) + 16)) * KVH + kvh) * D;                                             \
            for (int64_t c = 0; c < fetch; c += 64) _mm_prefetch((const char *)k_pool + offa * esize + c, _MM_HINT_T1); \
        }                                                                                                         \
        for (int64_t c = 0; c < fetch; c += 64) _mm_prefetch((const char *)v_pool + (off) * esize + c, _MM_HINT_T1); \
    } while (0)
    float qf[GQ][512 + PAD], acc[GQ][512 + PAD], row[512 + PAD], mx[GQ];
    float stack_scores[4096];
    float *scores = n * gc <= 4096 ? stack_scores : (float *)malloc(sizeof(float) * (size_t)(n * gc)); /* [gc, n] */
    for (int g = 0; g < gc; g++) {
        to_f32((const char *)q + (b * q_stride + (h0 + g) * D) * (qdt == DT_F32 ? 4 : 2), qdt, D, qf[g]);
        memset(qf[g] + D, 0, sizeof(float) * PAD);
        memset(acc[g], 0, sizeof(float) * (size_t)(D + PAD));
        mx[g] = -INFINITY;
    }
#if BST_BF16DOT
    /* bf16 q . bf16 keys: vdpbf16ps (exact products, float32 sums) */
    const int dot = qdt == DT_BF16 && kvdt == DT_BF16 && !kv_scales;
    const uint16_t *q16 = (const uint16_t *)q + b * q_stride + h0 * D;
#endif
#if BST_SIMD
    const int64_t esize = kvdt == DT_F32 ? 4 : kvdt == DT_BF16 ? 2 : 1; /* a pool element's bytes */
    const int64_t fetch = D * esize; /* bytes fetched ahead per row */
    for (int64_t t = 0; t < n && t < 16; t++) { /* the first 16 keys (the walk fetches 16 ahead) */
        int64_t offa = (SLOT_OF(J_OF(t)) * KVH + kvh) * D;
        for (int64_t c = 0; c < fetch; c += 64) _mm_prefetch((const char *)k_pool + offa * esize + c, _MM_HINT_T1);
    }
#endif
    int64_t scored = 0; /* keys [0, scored) have their scores */
#if BST_BF16DOT
    const __m512i key_order = SUM16_KEY_ORDER; /* the 16 keys' scores in key order */
    __m512 mxv[GQ];
    for (int g = 0; g < GQ; g++) mxv[g] = _mm512_set1_ps(-INFINITY);
    if (dot && D % 32 == 0) /* 16 keys at a time: their 16 dot products summed in one shuffle tree */
        for (; scored < n; scored += 16) {
            int nk = n - scored < 16 ? (int)(n - scored) : 16;
            int64_t offs[16];
            for (int i = nk; i < 16; i++) offs[i] = (SLOT_OF(J_OF(scored)) * KVH + kvh) * D;
            for (int i = 0; i < nk; i++) {
                int64_t t = scored + i, j = J_OF(t);
                offs[i] = (SLOT_OF(j) * KVH + kvh) * D;
                FETCH_ROWS(t, offs[i]);
            }
            const __mmask16 live = (__mmask16)((1u << nk) - 1);
            __m512 dist = _mm512_setzero_ps(); /* ALiBi: each key's j - (L - 1) */
            if (slopes)
                for (int i = 0; i < 16; i++) ((float *)&dist)[i] = (float)(J_OF(scored + (i < nk ? i : 0)) - (L - 1));
            for (int g = 0; g < gc; g++) {
                __m512 a[16];
                for (int i = 0; i < 16; i++) a[i] = _mm512_setzero_ps();
                for (int64_t d = 0; d < D; d += 32) { /* all 16 (a short block repeats its first key): a[] in registers */
                    __m512bh qv = (__m512bh)_mm512_loadu_si512(q16 + g * D + d);
                    for (int i = 0; i < 16; i++)
                        a[i] = _mm512_dpbf16_ps(a[i], qv, (__m512bh)_mm512_loadu_si512((const uint16_t *)k_pool + offs[i] + d));
                }
                /* score = sum * scale (+ slope * distance, rounded as the scalar sum of the two) */
                __m512 sc = _mm512_mul_ps(_mm512_permutexvar_ps(key_order, sum16v(a)), _mm512_set1_ps(scale));
                if (slopes) sc = _mm512_add_ps(sc, _mm512_mul_ps(_mm512_set1_ps(slopes[h0 + g]), dist));
                _mm512_mask_storeu_ps(scores + g * n + scored, live, sc);
                mxv[g] = _mm512_mask_max_ps(mxv[g], live, mxv[g], sc);
            }
        }
    for (int g = 0; g < gc; g++) {
        float m = _mm512_reduce_max_ps(mxv[g]);
        if (m > mx[g]) mx[g] = m;
    }
#endif
    for (int64_t t = scored; t < n; t++) {
        int64_t j = J_OF(t), off = (SLOT_OF(j) * KVH + kvh) * D;
#if BST_SIMD
        FETCH_ROWS(t, off);
#endif
        const void *kp = k_pool;
        int kdt = kvdt;
        if (kv_scales) { /* codes -> a float row */
            load_kv_row(k_pool, kvdt, off, D, kv_scales[0], row);
            kp = row, kdt = DT_F32, off = 0;
        }
        for (int g = 0; g < gc; g++) {
            float s = 0.f;
#if BST_BF16DOT
            if (dot) {
                s = dot_bf16(q16 + g * D, (const uint16_t *)k_pool + off, D);
            } else
#endif
#if BST_SIMD
            {
                vf a = vzero();
                int64_t d = 0;
                for (; d + VW <= D; d += VW) a = vfmadd(vloadu(qf[g] + d), vload_any(kp, kdt, off + d), a);
                if (d < D) a = vfmadd(vloadu(qf[g] + d), vload_any_part(kp, kdt, off + d, D - d), a);
                s = vsum(a);
            }
#else
            for (int64_t d = 0; d < D; d++) s += qf[g][d] * load_f(kp, kdt, off + d);
#endif
            s *= scale;
            if (slopes) s += slopes[h0 + g] * (float)(j - (L - 1));
            scores[g * n + t] = s;
            if (s > mx[g]) mx[g] = s;
        }
    }
    for (int g = 0; g < gc; g++) {
        float *sc = scores + g * n, sum = 0.f;
        int64_t t = 0;
#if BST_SIMD
        vf tv = vzero();
        for (; t + VW <= n; t += VW) {
            vf e = vexp(vsub(vloadu(sc + t), vset1(mx[g])));
            vstoreu(sc + t, e);
            tv = vadd(tv, e);
        }
        sum = vsum(tv);
#endif
        for (; t < n; t++) {
            sc[t] = expf(sc[t] - mx[g]);
            sum += sc[t];
        }
        t = 0; /* the weights p = e / total, a vector of divisions at a time (each as the scalar one) */
#if BST_SIMD
        for (; t + VW <= n; t += VW) vstoreu(sc + t, vdiv(vloadu(sc + t), vset1(sum)));
#endif
        for (; t < n; t++) sc[t] /= sum;
    }
    int in_registers = 0;
#if BST_SIMD
    in_registers = !kv_scales && D % VW == 0 && D <= 8 * VW;
    if (in_registers) { /* 4 vectors of every head's sum in registers (16 at most) per walk over the keys */
        const int64_t nd = D / VW;
        for (int64_t c0 = 0; c0 < nd; c0 += 4) {
            vf va[GQ][4];
            for (int g = 0; g < GQ; g++)
                for (int c = 0; c < 4; c++) va[g][c] = vzero();
            for (int64_t t = 0; t < n; t++) {
                int64_t j = J_OF(t), off = (SLOT_OF(j) * KVH + kvh) * D + c0 * VW;
                vf pv[GQ];
                for (int g = 0; g < GQ; g++)
                    if (g < gc) pv[g] = vset1(scores[g * n + t]);
                for (int c = 0; c < 4; c++)
                    if (c0 + c < nd) {
                        vf vr = vload_any(v_pool, kvdt, off + c * VW);
                        for (int g = 0; g < GQ; g++)
                            if (g < gc) va[g][c] = vfmadd(pv[g], vr, va[g][c]);
                    }
            }
            for (int g = 0; g < gc; g++)
                for (int c = 0; c < 4; c++)
                    if (c0 + c < nd) vstoreu(acc[g] + (c0 + c) * VW, va[g][c]);
        }
    }
#endif
    for (int64_t t = 0; t < n && !in_registers; t++) {
        int64_t j = J_OF(t), off = (SLOT_OF(j) * KVH + kvh) * D;
        const void *vp = v_pool;
        int vdt = kvdt;
        if (kv_scales) {
            load_kv_row(v_pool, kvdt, off, D, kv_scales[1], row);
            vp = row, vdt = DT_F32, off = 0;
        }
        for (int g = 0; g < gc; g++) {
            float p = scores[g * n + t];
#if BST_SIMD
            vf pv = vset1(p);
            int64_t d = 0;
            for (; d + VW <= D; d += VW) vstoreu(acc[g] + d, vfmadd(pv, vload_any(vp, vdt, off + d), vloadu(acc[g] + d)));
            if (d < D) vstoreu(acc[g] + d, vfmadd(pv, vload_any_part(vp, vdt, off + d, D - d), vloadu(acc[g] + d)));
#else
            for (int64_t d = 0; d < D; d++) acc[g][d] += p * load_f(vp, vdt, off + d);
#endif
        }
    }
    for (int g = 0; g < gc; g++)
        from_f32(acc[g], D, (char *)out + (b * H + h0 + g) * D * (odt == DT_F32 ? 4 : 2), odt);
    if (scores != stack_scores) free(scores);
#undef J_OF
#undef SLOT_OF
#undef FETCH_ROWS
}

void bst_decode_attention(const void *q, int qdt, int64_t q_stride, const void *k_pool, const void *v_pool, int kvdt,
                          const int64_t *tables, int64_t max_blocks, const int64_t *kv_lens, int64_t B,
                          int64_t H, int64_t KVH, int64_t D, int64_t bs, float scale, const float *slopes,
                          void *out, int odt, const float *kv_scales, const int64_t *windows, int threads) {
    int64_t G = H / KVH, chunks = (G + GQ - 1) / GQ, parts = threads < 1 ? 1 : threads;
    int bs_shift = -1; /* log2(bs) when bs is a power of two: a key's block and row by shifts */
    for (int e = 0; e < 31; e++)
        if ((int64_t)1 << e == bs) bs_shift = e;
    /* a task per sequence, key head and group of its query heads */
#pragma omp parallel for num_threads(parts) schedule(dynamic, 1)
    for (int64_t u = 0; u < B * KVH * chunks; u++) {
        int64_t b = u / (KVH * chunks), kvh = u / chunks % KVH, h0 = kvh * G + u % chunks * GQ;
        int gc = (int)(kvh * G + G - h0 < GQ ? kvh * G + G - h0 : GQ); /* heads h0 .. h0 + gc */
        attend_heads(q, qdt, q_stride, k_pool, v_pool, kvdt, tables, max_blocks, kv_lens, B, H, KVH, D, bs, bs_shift,
                     scale, slopes, out, odt, kv_scales, windows, b, kvh, h0, gc);
    }
}
#undef GQ
