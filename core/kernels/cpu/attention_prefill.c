/* Part of kernels.c, the one translation unit of the CPU kernels: #included there in order, after
 * common.h, vector.h and the parts listed before it (never compiled alone). bst_prefill_attention: causal
 * attention of the new tokens, bfloat16, on the vector builds. */

/* Causal attention of n new queries over L keys (prefill), bfloat16:
 * out[i, h] = sum_j softmax_j(q[i, h] . k[j, h / G] * scale) v[j, h / G] over the keys j <= L - n + i
 * (query i sits at position L - n + i; G = H / KVH). q row i of head h at q + i * q_stride + h * D,
 * key / value row j of key head c at k + j * k_stride + c * D (likewise v), out [n, H, D] contiguous.
 * D % 32 == 0, D <= PF_MAX_D. Flash-style: per task a head and PF_QB queries, keys PF_QB at a time from
 * key 0 (the blocks do not depend on n: a query's output is the same whether its prompt is computed whole,
 * in chunks or after a reused prefix), an online softmax in float32, p rounded to bfloat16 for p v as torch's
 * bf16 SDPA does, float32 sums, the output rounded once.
 *   avx512bf16: the key block transposed once into dim pairs (transpose16), then each query's 16 scores in
 *     one register, a vdpbf16ps per dim pair with the query's pair broadcast (exact products, float32 sums;
 *     no lane sums: 1.35-1.4x the per-key dot products and shuffle tree this replaced), p v in vdpbf16ps
 *     over key pairs.
 *   avx2 / avx512 (pf_prefill_f32): the keys widened to float32 once per call and transposed per block
 *     ([D][16]: a query's 16 scores are D FMAs with its dims broadcast, in increasing d; 4 queries at a time),
 *     the values widened once; p v one FMA per key and VW dims, in increasing key order. These builds ran
 *     torch's SDPA on keys padded to whole blocks of 512 (attention_ref.whole_key_blocks) before: a 2-token
 *     prompt's attention call in SmolLM2-135M took 406 us, now 67-86 us with the Python around it.
 *   scalar: not called (prefill_attention_fits). */
#define PF_QB 16
#define PF_MAX_D 256

/* a task's running max m[r], sum l[r] and sums acc[r] [D] of its `rows` query rows before the first key block */
INLINE void pf_rows_begin(float *m, float *l, float (*acc)[PF_MAX_D], int rows, int64_t D) {
    for (int r = 0; r < rows; r++) {
        m[r] = -INFINITY, l[r] = 0.f;
        memset(acc[r], 0, sizeof(float) * (size_t)D);
    }
}

/* a task's outputs after its last key block: acc[r] / l[r] rounded once to bfloat16, row r at out + r * stride */
INLINE void pf_rows_end(float (*acc)[PF_MAX_D], const float *l, int rows, int64_t D, uint16_t *out, int64_t stride) {
    for (int r = 0; r < rows; r++) {
        const float inv = 1.f / l[r];
        for (int64_t d = 0; d < D; d++) acc[r][d] *= inv;
        from_f32(acc[r], D, out + r * stride, DT_BF16);
    }
}
#if BST_BF16DOT
/* m[i] lane j <- m[j] lane i: a 16 x 16 matrix of 32-bit elements (rows m[0..15]) transposed in
 * registers (32-bit, then 64-bit interleaves within 128-bit lanes, then two rounds of lane shuffles) */
INLINE void transpose16(__m512i m[16]) {
    __m512i a[16], b[16];
    for (int i = 0; i < 16; i += 2) {
        a[i] = _mm512_unpacklo_epi32(m[i], m[i + 1]);
        a[i + 1] = _mm512_unpackhi_epi32(m[i], m[i + 1]);
    }
    for (int i = 0; i < 16; i += 4) {
        b[i] = _mm512_unpacklo_epi64(a[i], a[i + 2]);
        b[i + 1] = _mm512_unpackhi_epi64(a[i], a[i + 2]);
        b[i + 2] = _mm512_unpacklo_epi64(a[i + 1], a[i + 3]);
        b[i + 3] = _mm512_unpackhi_epi64(a[i + 1], a[i + 3]);
    }
    for (int c = 0; c < 4; c++) { /* b[4 g + c] lane 4 l + u = m[4 g + u] lane 4 l + c (l: 128-bit lane) */
        __m512i y0 = _mm512_shuffle_i32x4(b[c], b[4 + c], 0x88), y1 = _mm512_shuffle_i32x4(b[c], b[4 + c], 0xDD);
        __m512i y2 = _mm512_shuffle_i32x4(b[8 + c], b[12 + c], 0x88), y3 = _mm512_shuffle_i32x4(b[8 + c], b[12 + c], 0xDD);
        m[c] = _mm512_shuffle_i32x4(y0, y2, 0x88);
        m[8 + c] = _mm512_shuffle_i32x4(y0, y2, 0xDD);
        m[4 + c] = _mm512_shuffle_i32x4(y1, y3, 0x88);
        m[12 + c] = _mm512_shuffle_i32x4(y1, y3, 0xDD);
    }
}

/* s[r] += the 16 scores q_r . k_t (lane t) of R query rows (qd[r]: row r's dims as bfloat16 pairs) against
 * a key block transposed in pairs (kt[p] lane t: key t's dims 2 p, 2 p + 1): per pair one vdpbf16ps per
 * row with the row's pair broadcast, R independent sums (called with R = 16 where it can: in registers) */
INLINE void pf_scores(__m512 *s, const uint32_t *const *qd, const __m512i *kt, int64_t pairs, const int R) {
    for (int r = 0; r < R; r++) s[r] = _mm512_setzero_ps();
    for (int64_t p = 0; p < pairs; p++)
        for (int r = 0; r < R; r++)
            s[r] = _mm512_dpbf16_ps(s[r], (__m512bh)kt[p], (__m512bh)_mm512_set1_epi32((int)qd[r][p]));
}

/* accr[:16 nd] = accr * cv + sum over key pairs kp < pairs of p[2 kp] v[2 kp] + p[2 kp + 1] v[2 kp + 1]:
 * pp[kp] holds the pair's two bfloat16 weights, vp[kp][u] dims 16 u .. 16 u + 15 of the two value rows
 * interleaved (vdpbf16ps; called with a constant nd where it can) */
INLINE void pf_pv(float *accr, const __m512i (*vp)[PF_MAX_D / 16], const uint32_t *pp, int pairs, __m512 cv,
                  const int nd) {
    __m512 av[PF_MAX_D / 16];
    for (int u = 0; u < nd; u++) av[u] = _mm512_mul_ps(_mm512_loadu_ps(accr + 16 * u), cv);
    for (int kp = 0; kp < pairs; kp++) {
        __m512bh pk = (__m512bh)_mm512_set1_epi32((int)pp[kp]);
        for (int u = 0; u < nd; u++) av[u] = _mm512_dpbf16_ps(av[u], (__m512bh)vp[kp][u], pk);
    }
    for (int u = 0; u < nd; u++) _mm512_storeu_ps(accr + 16 * u, av[u]);
}

/* bst_prefill_attention on the avx512bf16 build (module comment) */
static void pf_prefill_bf16dot(const uint16_t *q, int64_t q_stride, const uint16_t *k, int64_t k_stride,
                               const uint16_t *v, int64_t v_stride, uint16_t *out, int64_t n, int64_t L, int64_t H,
                               int64_t KVH, int64_t D, float scale, int threads) {
    int64_t G = H / KVH, blocks = (n + PF_QB - 1) / PF_QB;
#pragma omp parallel for num_threads(threads < 1 ? 1 : threads) schedule(dynamic, 1)
    for (int64_t task = 0; task < H * blocks; task++) {
        int64_t h = task % H, c = h / G, i0 = (blocks - 1 - task / H) * PF_QB; /* the longest blocks first */
        int rows = (int)(n - i0 < PF_QB ? n - i0 : PF_QB);
        float m[PF_QB], l[PF_QB];
        float acc[PF_QB][PF_MAX_D];
        __m512i vp[PF_QB / 2][PF_MAX_D / 16]; /* the block's value rows in key pairs (pf_pv) */
        __m512i kt[PF_MAX_D / 2];             /* the block's keys in pairs, transposed (pf_scores) */
        __m512 s[PF_QB];                      /* the scores of each query row (lane t: key t) */
        const uint32_t *qd[PF_QB];
        const int nd = (int)(D / 16);
        for (int r = 0; r < rows; r++) qd[r] = (const uint32_t *)(q + (i0 + r) * q_stride + h * D);
        pf_rows_begin(m, l, acc, rows, D);
        int64_t kend = L - n + i0 + rows; /* keys the last query sees */
        for (int64_t j0 = 0; j0 < kend; j0 += PF_QB) {
            int nk = (int)(kend - j0 < PF_QB ? kend - j0 : PF_QB);
            const uint16_t *krow[PF_QB];
            for (int t = 0; t < nk; t++) krow[t] = k + (j0 + t) * k_stride + c * D;
            for (int kp = 0; kp < (nk + 1) / 2; kp++) { /* dims of keys 2 kp, 2 kp + 1 interleaved (a missing one: 0) */
                const uint16_t *va = v + (j0 + 2 * kp) * v_stride + c * D, *vb = va + v_stride;
                for (int u = 0; u < nd; u++) {
                    __m512i lo = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(va + 16 * u)));
                    __m512i hi = 2 * kp + 1 < nk ? _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(vb + 16 * u)))
                                                 : _mm512_setzero_si512();
                    vp[kp][u] = _mm512_or_si512(lo, _mm512_slli_epi32(hi, 16));
                }
            }
            for (int t = nk; t < PF_QB; t++) krow[t] = krow[0]; /* a short block: key j0 again (masked) */
            for (int64_t c = 0; c < D / 32; c++) { /* 32 dims (16 pairs) of the 16 keys at a time */
                __m512i m16[16];
                for (int t = 0; t < 16; t++) m16[t] = _mm512_loadu_si512(krow[t] + 32 * c);
                transpose16(m16);
                for (int p = 0; p < 16; p++) kt[16 * c + p] = m16[p];
            }
            if (rows == PF_QB)
                pf_scores(s, qd, kt, D / 2, PF_QB);
            else
                for (int r = 0; r < rows; r++) pf_scores(s + r, qd + r, kt, D / 2, 1);
            for (int r = 0; r < rows; r++) {
                int64_t lim = L - n + i0 + r + 1; /* keys < lim */
                if (j0 >= lim) continue;
                int nv = (int)(lim - j0 < nk ? lim - j0 : nk);
                __mmask16 valid = (__mmask16)((1u << nv) - 1u); /* keys past nv (key j0 again) masked */
                __m512 sv = _mm512_mask_mul_ps(_mm512_set1_ps(-INFINITY), valid, s[r], _mm512_set1_ps(scale));
                float bmax = _mm512_reduce_max_ps(sv);
                float mnew = m[r] > bmax ? m[r] : bmax; /* the running max moves in few blocks: e^0 and e^-inf skipped */
                float corr = mnew == m[r] ? 1.f : m[r] == -INFINITY ? 0.f : expf(m[r] - mnew);
                __m512 e = _mm512_maskz_mov_ps(valid, vexp(_mm512_sub_ps(sv, _mm512_set1_ps(mnew))));
                l[r] = l[r] * corr + _mm512_reduce_add_ps(e);
                m[r] = mnew;
                uint32_t pp[8]; /* the weights in key order, rounded to bfloat16, in pairs */
                _mm256_storeu_si256((__m256i *)pp, (__m256i)_mm512_cvtneps_pbh(e));
                __m512 cv = _mm512_set1_ps(corr); /* acc[r] = acc[r] * corr + sum_t p_t v_t */
                int pairs = (nv + 1) / 2;
                switch (nd) { /* the common head sizes with constant bounds: the sums in registers */
                    case 2: pf_pv(acc[r], vp, pp, pairs, cv, 2); break;
                    case 4: pf_pv(acc[r], vp, pp, pairs, cv, 4); break;
                    case 8: pf_pv(acc[r], vp, pp, pairs, cv, 8); break;
                    default: pf_pv(acc[r], vp, pp, pairs, cv, nd);
                }
            }
        }
        pf_rows_end(acc, l, rows, D, out + (i0 * H + h) * D, H * D);
    }
}
#endif

#if BST_SIMD && !BST_BF16DOT
static const float PF_LANES[PF_QB] = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15}; /* key t of a block */

/* s[r][t] += the scores q_r . k_t of R query rows qf (float32) against a key block transposed to kt [D][PF_QB]:
 * per dim one FMA per row and VW keys with the row's dim broadcast, in increasing d (called with R = 4 where it
 * can: 4 x PF_QB / VW sums in registers, the block's dims loaded once for them) */
INLINE void pf_scores_f32(vf (*s)[PF_QB / VW], float (*qf)[PF_MAX_D], const float *kt, int64_t D, const int R) {
    for (int r = 0; r < R; r++)
        for (int u = 0; u < PF_QB / VW; u++) s[r][u] = vzero();
    for (int64_t d = 0; d < D; d++) {
        vf kd[PF_QB / VW];
        for (int u = 0; u < PF_QB / VW; u++) kd[u] = vloadu(kt + d * PF_QB + u * VW);
        for (int r = 0; r < R; r++) {
            const vf qd = vset1(qf[r][d]);
            for (int u = 0; u < PF_QB / VW; u++) s[r][u] = vfmadd(kd[u], qd, s[r][u]);
        }
    }
}

#define PF_PV_DIMS 64 /* dims of a row's p v sums held in registers at a time */
/* acc [nu VW] = acc corr + sum_{t < nv} p[t] vb[t * D ..], in increasing t: nu independent sums in registers, one
 * broadcast of p[t] per key (called with a constant nu where it can) */
INLINE void pf_pv_f32(float *acc, const float *vb, int64_t D, const float *p, int nv, float corr, const int nu) {
    vf a[PF_PV_DIMS / VW];
    for (int u = 0; u < nu; u++) a[u] = vmul(vloadu(acc + u * VW), vset1(corr));
    for (int t = 0; t < nv; t++) {
        const vf pt = vset1(p[t]);
        for (int u = 0; u < nu; u++) a[u] = vfmadd(pt, vloadu(vb + t * D + u * VW), a[u]);
    }
    for (int u = 0; u < nu; u++) vstoreu(acc + u * VW, a[u]);
}

/* one key block (keys j0 .. j0 + nk - 1: kt [D][PF_QB] float32, transposed; vb [nk][D] float32) of `rows` query
 * rows qf [r][D] (float32): the online softmax's running max m[r], sum l[r] and acc[r] [D] updated (module
 * comment; query row r sees keys j0 + t, t < lim0 + r) */
static void pf_block_f32(float (*qf)[PF_MAX_D], int rows, const float *kt, const float *vb, int nk, int64_t lim0,
                         int64_t D, float scale, float *m, float *l, float (*acc)[PF_MAX_D]) {
    vf s[PF_QB][PF_QB / VW];
    int r0 = 0;
    for (; r0 + 4 <= rows; r0 += 4) pf_scores_f32(s + r0, qf + r0, kt, D, 4);
    for (; r0 < rows; r0++) pf_scores_f32(s + r0, qf + r0, kt, D, 1);
    for (int r = 0; r < rows; r++) {
        const int64_t lim = lim0 + r;
        if (lim <= 0) continue;
        const int nv = (int)(lim < nk ? lim : nk);
        float sc[PF_QB], p[PF_QB];
        for (int u = 0; u < PF_QB / VW; u++) vstoreu(sc + u * VW, vmul(s[r][u], vset1(scale)));
        float bmax = -INFINITY;
        for (int t = 0; t < nv; t++) bmax = sc[t] > bmax ? sc[t] : bmax;
        const float mnew = m[r] > bmax ? m[r] : bmax; /* the running max moves in few blocks: e^0 and e^-inf skipped */
        const float corr = mnew == m[r] ? 1.f : m[r] == -INFINITY ? 0.f : expf(m[r] - mnew);
        float bsum = 0.f;
        for (int u = 0; u < PF_QB / VW; u++) { /* e = exp(s - m) on the visible keys, 0 past them */
            const vf e = vselect_lt(vloadu(PF_LANES + u * VW), vset1((float)nv), vexp(vsub(vloadu(sc + u * VW), vset1(mnew))),
                                    vzero());
            bsum += vsum(e);
            vstoreu(p + u * VW, vround_bf16(e));
        }
        l[r] = l[r] * corr + bsum;
        m[r] = mnew;
        for (int64_t d0 = 0; d0 < D; d0 += PF_PV_DIMS) { /* acc = acc corr + sum_t p_t v_t, in increasing t */
            const int nu = (int)((D - d0 < PF_PV_DIMS ? D - d0 : PF_PV_DIMS) / VW);
            if (nu == PF_PV_DIMS / VW) pf_pv_f32(acc[r] + d0, vb + d0, D, p, nv, corr, PF_PV_DIMS / VW);
            else pf_pv_f32(acc[r] + d0, vb + d0, D, p, nv, corr, nu);
        }
    }
}

/* bst_prefill_attention on the avx2 / avx512 builds (module comment): the keys widened to float32 once per call,
 * transposed per block ([KVH][blocks][D][PF_QB], zeros past L), and the values ([KVH][L][D]) */
static void pf_prefill_f32(const uint16_t *q, int64_t q_stride, const uint16_t *k, int64_t k_stride, const uint16_t *v,
                           int64_t v_stride, uint16_t *out, int64_t n, int64_t L, int64_t H, int64_t KVH, int64_t D,
                           float scale, int threads) {
    const int64_t G = H / KVH, blocks = (n + PF_QB - 1) / PF_QB, kblocks = (L + PF_QB - 1) / PF_QB;
    float *kt = (float *)malloc(sizeof(float) * (size_t)(KVH * kblocks * D * PF_QB));
    float *vw = (float *)malloc(sizeof(float) * (size_t)(KVH * L * D));
#pragma omp parallel for num_threads(threads < 1 ? 1 : threads) schedule(static)
    for (int64_t cb = 0; cb < KVH * kblocks; cb++) {
        const int64_t c = cb / kblocks, j0 = cb % kblocks * PF_QB;
        float *dst = kt + cb * D * PF_QB;
        for (int t = 0; t < PF_QB; t++) {
            const uint16_t *row = k + (j0 + t) * k_stride + c * D;
            for (int64_t d = 0; d < D; d++) dst[d * PF_QB + t] = j0 + t < L ? bf16_to_f32(row[d]) : 0.f;
            if (j0 + t < L) to_f32(v + (j0 + t) * v_stride + c * D, DT_BF16, D, vw + (c * L + j0 + t) * D);
        }
    }
#pragma omp parallel for num_threads(threads < 1 ? 1 : threads) schedule(dynamic, 1)
    for (int64_t task = 0; task < H * blocks; task++) {
        const int64_t h = task % H, c = h / G, i0 = (blocks - 1 - task / H) * PF_QB; /* the longest blocks first */
        const int rows = (int)(n - i0 < PF_QB ? n - i0 : PF_QB);
        float m[PF_QB], l[PF_QB];
        float qf[PF_QB][PF_MAX_D], acc[PF_QB][PF_MAX_D];
        for (int r = 0; r < rows; r++) to_f32(q + (i0 + r) * q_stride + h * D, DT_BF16, D, qf[r]);
        pf_rows_begin(m, l, acc, rows, D);
        const int64_t kend = L - n + i0 + rows; /* keys the last query sees */
        for (int64_t j0 = 0; j0 < kend; j0 += PF_QB) {
            const int nk = (int)(kend - j0 < PF_QB ? kend - j0 : PF_QB);
            pf_block_f32(qf, rows, kt + (c * kblocks + j0 / PF_QB) * D * PF_QB, vw + (c * L + j0) * D, nk,
                         L - n + i0 + 1 - j0, D, scale, m, l, acc);
        }
        pf_rows_end(acc, l, rows, D, out + (i0 * H + h) * D, H * D);
    }
    free(vw);
    free(kt);
}
#endif


void bst_prefill_attention(const uint16_t *q, int64_t q_stride, const uint16_t *k, int64_t k_stride, const uint16_t *v,
                           int64_t v_stride, uint16_t *out, int64_t n, int64_t L, int64_t H, int64_t KVH, int64_t D,
                           float scale, int threads) {
#if BST_BF16DOT
    pf_prefill_bf16dot(q, q_stride, k, k_stride, v, v_stride, out, n, L, H, KVH, D, scale, threads);
#elif BST_SIMD
    pf_prefill_f32(q, q_stride, k, k_stride, v, v_stride, out, n, L, H, KVH, D, scale, threads);
#else /* not called on the scalar build (prefill_attention_fits): NaN rather than a plausible wrong answer */
    for (int64_t i = 0; i < n * H * D; i++) out[i] = 0x7fc0;
    (void)q, (void)q_stride, (void)k, (void)k_stride, (void)v, (void)v_stride, (void)L, (void)KVH, (void)scale,
        (void)threads;
#endif
}
#undef PF_QB
