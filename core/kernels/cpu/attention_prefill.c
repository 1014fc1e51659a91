/* Part of kernels.c, the one translation unit of the CPU kernels: #included there in order, after
 * common.h, vector.h and the parts listed before it (never compiled alone). bst_prefill_attention: causal
 * attention of the new tokens, bfloat16, on the avx512bf16 build. */

/* Causal attention of n new queries over L keys (prefill), bfloat16, on the avx512bf16 build:
 * out[i, h] = sum_j softmax_j(q[i, h] . k[j, h / G] * scale) v[j, h / G] over the keys j <= L - n + i
 * (query i sits at position L - n + i; G = H / KVH). q row i of head h at q + i * q_stride + h * D,
 * key / value row j of key head c at k + j * k_stride + c * D (likewise v), out [n, H, D] contiguous.
 * D % 32 == 0, D <= PF_MAX_D. Flash-style: per task a head and PF_QB queries, keys PF_QB at a time;
 * the key block transposed once into dim pairs (transpose16), then each query's 16 scores in one
 * register, a vdpbf16ps per dim pair with the query's pair broadcast (exact products, float32 sums;
 * no lane sums: 1.35-1.4x the per-key dot products and shuffle tree this replaced), an online softmax in
 * float32, p v in vdpbf16ps over key pairs (p rounded to bfloat16 as torch's bf16 SDPA does, float32
 * sums). */
#define PF_QB 16
#define PF_MAX_D 256
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
#endif

void bst_prefill_attention(const uint16_t *q, int64_t q_stride, const uint16_t *k, int64_t k_stride, const uint16_t *v,
                           int64_t v_stride, uint16_t *out, int64_t n, int64_t L, int64_t H, int64_t KVH, int64_t D,
                           float scale, int threads) {
    int64_t G = H / KVH, blocks = (n + PF_QB - 1) / PF_QB;
#pragma omp parallel for num_threads(threads < 1 ? 1 : threads) schedule(dynamic, 1)
    for (int64_t task = 0; task < H * blocks; task++) {
        int64_t h = task % H, c = h / G, i0 = (blocks - 1 - task / H) * PF_QB; /* the longest blocks first */
        int rows = (int)(n - i0 < PF_QB ? n - i0 : PF_QB);
#if BST_BF16DOT
        float m[PF_QB], l[PF_QB];
        float acc[PF_QB][PF_MAX_D];
        __m512i vp[PF_QB / 2][PF_MAX_D / 16]; /* the block's value rows in key pairs (pf_pv) */
        __m512i kt[PF_MAX_D / 2];             /* the block's keys in pairs, transposed (pf_scores) */
        __m512 s[PF_QB];                      /* the scores of each query row (lane t: key t) */
        const uint32_t *qd[PF_QB];
        const int nd = (int)(D / 16);
        for (int r = 0; r < rows; r++) qd[r] = (const uint32_t *)(q + (i0 + r) * q_stride + h * D);
        for (int r = 0; r < rows; r++) {
            m[r] = -INFINITY, l[r] = 0.f;
            memset(acc[r], 0, sizeof(float) * (size_t)D);
        }
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
        for (int r = 0; r < rows; r++) {
            float inv = 1.f / l[r];
            for (int64_t d = 0; d < D; d++) acc[r][d] *= inv;
            from_f32(acc[r], D, out + ((i0 + r) * H + h) * D, DT_BF16);
        }
#else /* called on the avx512bf16 build only: NaN rather than a plausible wrong answer */
        for (int r = 0; r < rows; r++)
            for (int64_t d = 0; d < D; d++) out[((i0 + r) * H + h) * D + d] = 0x7fc0;
        (void)q, (void)q_stride, (void)k, (void)k_stride, (void)v, (void)v_stride, (void)L, (void)c, (void)scale;
#endif
    }
}
#undef PF_QB
