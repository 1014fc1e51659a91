/* Part of kernels.c, the one translation unit of the CPU kernels: #included there in order, after
 * common.h, vector.h and the parts listed before it (never compiled alone). The quantized KV cache codes
 * (int8, float8 e4m3fn), bst_kv_write, and load_kv_row (attention_decode.c reads the pool with it). */

/* ---------------------------------------------------------------------------------------- */
/* quantized KV cache codes: int8 and float8 e4m3fn                                         */
/* ---------------------------------------------------------------------------------------- */

static float e4m3_values[256]; /* code -> value (0x7f, 0xff: NaN) */

__attribute__((constructor)) static void init_e4m3(void) {
    for (int c = 0; c < 256; c++) {
        int e = (c >> 3) & 15, m = c & 7;
        float v = e == 0 ? ldexpf((float)m, -9) : ldexpf(1.f + (float)m / 8.f, e - 7);
        if ((c & 0x7f) == 0x7f) v = NAN;
        e4m3_values[c] = (c & 0x80) ? -v : v;
    }
}

/* float -> e4m3fn code, round to nearest even, |y| <= 448 (the caller clamps) */
INLINE uint8_t f32_to_e4m3(float y) {
    uint8_t sign = signbit(y) ? 0x80 : 0;
    float a = fabsf(y);
    int lo = 0, hi = 126; /* largest code c with value(c) <= a */
    while (lo < hi) {
        int mid = (lo + hi + 1) / 2;
        if (e4m3_values[mid] <= a) lo = mid; else hi = mid - 1;
    }
    if (lo < 126) {
        float below = a - e4m3_values[lo], above = e4m3_values[lo + 1] - a;
        if (above < below || (above == below && (lo & 1))) lo++;
    }
    return (uint8_t)(sign | lo);
}

/* the KV code of x: int8 clamp(round(x / s), -127, 127), e4m3fn(clamp(x / s, -448, 448)) */
INLINE void store_kv(void *pool, int dt, int64_t i, float x, float s) {
    float y = x / s;
    if (dt == DT_I8) {
        float r = nearbyintf(y);
        ((int8_t *)pool)[i] = (int8_t)(r > 127.f ? 127.f : r < -127.f ? -127.f : r);
    } else {
        ((uint8_t *)pool)[i] = f32_to_e4m3(y > 448.f ? 448.f : y < -448.f ? -448.f : y);
    }
}

#if BST_SIMD
/* the e4m3fn codes of y (|y| <= 448, not NaN), round to nearest even: a normal |y| keeps 3
 * mantissa bits (the carry may bump the exponent), code = bits >> 20 - (127 - 7) << 3; below
 * 2^-6 the code is the subnormal count round(|y| 2^9) (8 there is the smallest normal: equal). */
INLINE vi ve4m3_codes(vf y) {
    vf a = vabs(y);
    vi u = vf_as_i(a), sign = vi_and(vi_srli(vf_as_i(y), 24), vi_set1(0x80));
    vi normal = vi_sub(vi_srli(vi_add(u, vi_add(vi_set1(0x7ffff), vi_and(vi_srli(u, 20), vi_set1(1)))), 20),
                       vi_set1(120 << 3));
    vi sub = vcvt_i32(vround(vmul(a, vset1(512.f))));
    return vi_or(sign, vi_select_lt(a, vset1(0.015625f), sub, normal));
}

/* VW KV codes of x / s at pool element off: int8 clamp(round(x / s), -127, 127) or
 * e4m3fn(clamp(x / s, -448, 448)) (store_kv's, lane by lane) */
INLINE void vstore_kv(void *pool, int dt, int64_t off, vf x, float s) {
    vf y = vdiv(x, vset1(s));
    if (dt == DT_I8)
        vstore_i8((int8_t *)pool + off, vcvt_i32(vmin(vmax(vround(y), vset1(-127.f)), vset1(127.f))));
    else
        vstore_u8((uint8_t *)pool + off, ve4m3_codes(vmin(vmax(y, vset1(-448.f)), vset1(448.f))));
}
#endif

/* dst[d] = code(pool[off + d]) * s for a row of D codes */
static void load_kv_row(const void *pool, int dt, int64_t off, int64_t D, float s, float *dst) {
    int64_t d = 0;
#if BST_SIMD
    const vf sv = vset1(s);
    for (; d + VW <= D; d += VW) {
        const void *c = (const uint8_t *)pool + off + d;
        vf v = dt == DT_I8 ? vload_i8((const int8_t *)c) : vload_lut8((const uint8_t *)c, e4m3_values);
        vstoreu(dst + d, vmul(v, sv));
    }
#endif
    if (dt == DT_I8) {
        const int8_t *c = (const int8_t *)pool + off;
        for (; d < D; d++) dst[d] = (float)c[d] * s;
    } else {
        const uint8_t *c = (const uint8_t *)pool + off;
        for (; d < D; d++) dst[d] = e4m3_values[c[d]] * s;
    }
}

/* k / v rows [T, W] (src_stride elements apart, dtype sdt) -> pool slot rows (W = KVH * D); pools
 * in pdt: float (scales NULL) or int8 / e4m3 codes with scales (s_k, s_v). */
void bst_kv_write(const void *k, const void *v, int sdt, int64_t src_stride, void *k_pool, void *v_pool, int pdt,
                  const int64_t *slots, int64_t T, int64_t W, const float *scales) {
    for (int64_t t = 0; t < T; t++) {
        int64_t j = 0, src = t * src_stride, dst = slots[t] * W;
#if BST_SIMD
        for (; j + VW <= W; j += VW) {
            vf kx = vload_any(k, sdt, src + j), vx = vload_any(v, sdt, src + j);
            if (scales) {
                vstore_kv(k_pool, pdt, dst + j, kx, scales[0]);
                vstore_kv(v_pool, pdt, dst + j, vx, scales[1]);
            } else {
                vstore_any(k_pool, pdt, dst + j, kx);
                vstore_any(v_pool, pdt, dst + j, vx);
            }
        }
#endif
        for (; j < W; j++) {
            float kx = load_f(k, sdt, src + j), vx = load_f(v, sdt, src + j);
            if (scales) {
                store_kv(k_pool, pdt, dst + j, kx, scales[0]);
                store_kv(v_pool, pdt, dst + j, vx, scales[1]);
            } else {
                store_f(k_pool, pdt, dst + j, kx);
                store_f(v_pool, pdt, dst + j, vx);
            }
        }
    }
}
