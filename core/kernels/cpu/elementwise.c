/* Part of kernels.c, the one translation unit of the CPU kernels: #included there in order, after
 * common.h, vector.h and the parts listed before it (never compiled alone). bst_rms_norm, bst_rotary (and
 * rotary_at, plan.c's), bst_act_and_mul. */

/* ---------------------------------------------------------------------------------------- */
/* elementwise: norms, rotary, gated activations                                            */
/* ---------------------------------------------------------------------------------------- */

/* h = x + residual (if residual; stored to h_out in dt), y = h / sqrt(mean(h^2) + eps) * w.
 * x, residual, h_out, y [T, H] in dt; w [H] in wdt. The sum is rounded to dt before the norm
 * (as the torch reference does). */
void bst_rms_norm(const void *x, const void *residual, void *h_out, void *y, int dt, const void *w, int wdt,
                  int64_t T, int64_t H, float eps, int threads) {
#pragma omp parallel for num_threads(threads < 1 ? 1 : threads) schedule(static) if (T > 1)
    for (int64_t t = 0; t < T; t++) {
        float hbuf[16384];
        float *h = H <= 16384 ? hbuf : (float *)malloc(sizeof(float) * (size_t)H);
        double ss = 0.0;
        int64_t i = 0;
#if BST_SIMD
        vf sv[2] = {vzero(), vzero()};
        for (; i + VW <= H; i += VW) {
            vf v = vload_any(x, dt, t * H + i);
            if (residual) {
                v = vadd(v, vload_any(residual, dt, t * H + i));
                if (dt == DT_BF16) v = vround_bf16(v);
                vstore_any(h_out, dt, t * H + i, v);
            }
            vstoreu(h + i, v);
            sv[(i / VW) & 1] = vfmadd(v, v, sv[(i / VW) & 1]);
        }
        ss = (double)vsum(vadd(sv[0], sv[1]));
#endif
        for (; i < H; i++) {
            float v = load_f(x, dt, t * H + i);
            if (residual) {
                v += load_f(residual, dt, t * H + i);
                if (dt == DT_BF16) v = bf16_to_f32(f32_to_bf16(v));
                store_f(h_out, dt, t * H + i, v);
            }
            h[i] = v;
            ss += (double)v * v;
        }
        float inv = 1.0f / sqrtf((float)(ss / (double)H) + eps);
        i = 0;
#if BST_SIMD
        for (; i + VW <= H; i += VW)
            vstore_any(y, dt, t * H + i, vmul(vmul(vloadu(h + i), vset1(inv)), vload_any(w, wdt, i)));
#endif
        for (; i < H; i++) store_f(y, dt, t * H + i, h[i] * inv * load_f(w, wdt, i));
        if (h != hbuf) free(h);
    }
}

/* Rotate the n heads of one token (x: its first head, heads D apart) in place: pair (a, b) =
 * (i, i + rot/2) (neox) or (2i, 2i + 1) (gptj), i < rot/2, by the angle with cos[i], sin[i]:
 * a' = a cos - b sin, b' = b cos + a sin. Vectors: neox reads VW a's and VW b's; gptj reads
 * VW / 2 interleaved pairs, the cos / sin of each pair duplicated, b a swapped within pairs. */
static void rotary_token(void *x, int dt, int64_t base, int64_t n, int64_t D, const void *cos, const void *sin,
                         int64_t cs_off, int csdt, int64_t rot, int gptj) {
    int64_t half = rot / 2, i0 = 0;
#if BST_SIMD
    float cb[512], sb[512];
    if (half <= 512) {
        int64_t esize = csdt == DT_F32 ? 4 : 2;
        to_f32((const char *)cos + cs_off * esize, csdt, half, cb);
        to_f32((const char *)sin + cs_off * esize, csdt, half, sb);
        i0 = gptj ? half / (VW / 2) * (VW / 2) : half / VW * VW; /* the pairs the vectors take */
        for (int64_t hd = 0; hd < n; hd++) {
            int64_t hb = base + hd * D;
            if (gptj) {
                for (int64_t i = 0; i < i0; i += VW / 2) {
                    vf v = vload_any(x, dt, hb + 2 * i);
                    vstore_any(x, dt, hb + 2 * i, vfmaddsub(v, vdup_pairs(cb + i), vmul(vswap_pairs(v), vdup_pairs(sb + i))));
                }
            } else {
                for (int64_t i = 0; i < i0; i += VW) {
                    vf a = vload_any(x, dt, hb + i), b = vload_any(x, dt, hb + half + i);
                    vf c = vloadu(cb + i), sn = vloadu(sb + i);
                    vstore_any(x, dt, hb + i, vfmsub(a, c, vmul(b, sn)));
                    vstore_any(x, dt, hb + half + i, vfmadd(b, c, vmul(a, sn)));
                }
            }
        }
    }
#endif
    for (int64_t hd = 0; hd < n; hd++)
        for (int64_t i = i0; i < half; i++) {
            int64_t ia = base + hd * D + (gptj ? 2 * i : i), ib = base + hd * D + (gptj ? 2 * i + 1 : i + half);
            float a = load_f(x, dt, ia), b = load_f(x, dt, ib);
            float c = load_f(cos, csdt, cs_off + i), s = load_f(sin, csdt, cs_off + i);
            store_f(x, dt, ia, a * c - b * s);
            store_f(x, dt, ib, b * c + a * s);
        }
}

/* x [T, n, D] (x_stride elements between tokens) rotated in place with cos / sin rows
 * [T, rot/2] (cs_stride elements between tokens, dtype csdt). */
void bst_rotary(void *x, int dt, int64_t T, int64_t n, int64_t D, int64_t x_stride, const void *cos,
                const void *sin, int64_t cs_stride, int csdt, int64_t rot, int gptj) {
    for (int64_t t = 0; t < T; t++) rotary_token(x, dt, t * x_stride, n, D, cos, sin, t * cs_stride, csdt, rot, gptj);
}

/* The same at positions[t] of a float32 table cos_sin [P, rot] = [cos | sin]. */
static void rotary_at(void *x, int dt, int64_t T, int64_t n, int64_t D, int64_t x_stride, const int64_t *positions,
                      const float *cos_sin, int64_t rot, int gptj) {
    for (int64_t t = 0; t < T; t++) {
        const float *cs = cos_sin + positions[t] * rot;
        rotary_token(x, dt, t * x_stride, n, D, cs, cs + rot / 2, 0, DT_F32, rot, gptj);
    }
}

INLINE float act_of(float f, int act) {
    if (act == 0) return f / (1.f + expf(-f));
    if (act == 1) return 0.5f * f * (1.f + erff(f * 0.7071067811865476f));
    if (act == 2) return 0.5f * f * (1.f + tanhf(0.7978845608028654f * (f + 0.044715f * f * f * f)));
    return f > 0.f ? f : 0.f;
}

#if BST_SIMD
/* act_of on a vector. silu f / (1 + e^-f); gelu 0.5 f (1 + erf(z)), z = f / sqrt 2, with
 * 1 + erf(z) = 2 - erfc(z) (z >= 0) or erfc(|z|) (z < 0) and erfc(|z|) = t P(t) e^(-z^2),
 * t = 1 / (1 + 0.3275911 |z|) (Abramowitz & Stegun 7.1.26, |error| < 1.5e-7); gelu_new
 * 0.5 f (1 + tanh u) = f / (1 + e^(-2u)) (no cancellation); relu max(f, 0). */
INLINE vf vact(vf f, int act) {
    if (act == 0) return vdiv(f, vadd(vset1(1.f), vexp(vsub(vzero(), f))));
    if (act == 1) {
        vf z = vmul(f, vset1(0.7071067811865476f)), za = vabs(z);
        vf t = vdiv(vset1(1.f), vfmadd(za, vset1(0.3275911f), vset1(1.f)));
        vf poly = vfmadd(t, vset1(1.061405429f), vset1(-1.453152027f));
        poly = vfmadd(poly, t, vset1(1.421413741f));
        poly = vfmadd(poly, t, vset1(-0.284496736f));
        poly = vfmadd(poly, t, vset1(0.254829592f));
        vf erfc = vmul(vmul(poly, t), vexp(vmul(vsub(vzero(), za), za)));
        return vmul(vmul(vset1(0.5f), f), vselect_lt(z, vzero(), erfc, vsub(vset1(2.f), erfc)));
    }
    if (act == 2) {
        vf u = vmul(vset1(0.7978845608028654f), vfmadd(vmul(vmul(f, f), f), vset1(0.044715f), f));
        return vdiv(f, vadd(vset1(1.f), vexp(vmul(vset1(-2.f), u))));
    }
    return vmax(f, vzero());
}
#endif

void bst_act_and_mul(const void *fg, void *y, int dt, int64_t T, int64_t I, int act, int threads) {
#pragma omp parallel for num_threads(threads < 1 ? 1 : threads) schedule(static) if (T * I >= 65536)
    for (int64_t t = 0; t < T; t++) {
        int64_t i = 0;
#if BST_SIMD
        for (; i + VW <= I; i += VW) {
            vf a = vact(vload_any(fg, dt, t * 2 * I + i), act), g = vload_any(fg, dt, t * 2 * I + I + i);
            if (dt == DT_BF16) a = vround_bf16(a); /* the reference rounds act(f) first */
            vstore_any(y, dt, t * I + i, vmul(a, g));
        }
#endif
        for (; i < I; i++) {
            float f = load_f(fg, dt, t * 2 * I + i), g = load_f(fg, dt, t * 2 * I + I + i);
            float a = act_of(f, act);
            if (dt == DT_BF16) a = bf16_to_f32(f32_to_bf16(a)); /* the reference rounds act(f) first */
            store_f(y, dt, t * I + i, a * g);
        }
    }
}
