/* bestiary CPU kernels: the batch-1 / small-batch decode ops, AVX-512 with a scalar fallback.
 *
 * Built by bestiary.core.cpu.build (gcc -O3 -march=native -fopenmp) the first time they are
 * needed, loaded with ctypes. Each op has a torch reference in bestiary.core.cpu.ops, and the
 * tests compare the two. Tensors are passed as raw pointers, contiguous, in these dtypes:
 *
 *   DT_F32 = 0   float
 *   DT_BF16 = 1  bfloat16 (uint16 bit pattern; rounding to nearest even, as torch)
 *   DT_I8 = 2    int8 weights, one float scale per output row
 *   DT_I4 = 3    int4 weights, two per byte (low nibble = even k), float scale s and s * zero
 *                per row and group of G input features
 *   DT_F8 = 4    float8 e4m3fn KV cache codes (DT_I8 too: int8 KV codes), x ~ code * scale
 *
 * Threads: OpenMP, with the libgomp that torch already loaded (same soname), so there is one
 * thread pool in the process. Every op takes the number of threads to use.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <omp.h>
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#include <immintrin.h>
#define BST_AVX512 1
#else
#define BST_AVX512 0
#endif

enum { DT_F32 = 0, DT_BF16 = 1, DT_I8 = 2, DT_I4 = 3, DT_F8 = 4 };
#define INLINE static inline __attribute__((always_inline))

int bst_has_avx512(void) { return BST_AVX512; }

INLINE float bf16_to_f32(uint16_t v) {
    uint32_t u = (uint32_t)v << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

INLINE uint16_t f32_to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40); /* NaN stays NaN */
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

INLINE float load_f(const void *p, int dt, int64_t i) {
    return dt == DT_F32 ? ((const float *)p)[i] : bf16_to_f32(((const uint16_t *)p)[i]);
}

INLINE void store_f(void *p, int dt, int64_t i, float v) {
    if (dt == DT_F32)
        ((float *)p)[i] = v;
    else
        ((uint16_t *)p)[i] = f32_to_bf16(v);
}

/* a [n] float32 copy of p (dtype dt) into dst */
static void to_f32(const void *p, int dt, int64_t n, float *dst) {
    if (dt == DT_F32) {
        memcpy(dst, p, (size_t)n * sizeof(float));
        return;
    }
    for (int64_t i = 0; i < n; i++) dst[i] = bf16_to_f32(((const uint16_t *)p)[i]);
}

static void from_f32(const float *src, int64_t n, void *p, int dt) {
    if (dt == DT_F32) {
        memcpy(p, src, (size_t)n * sizeof(float));
        return;
    }
    for (int64_t i = 0; i < n; i++) ((uint16_t *)p)[i] = f32_to_bf16(src[i]);
}

/* ---------------------------------------------------------------------------------------- */
/* linear: y[m, n] = sum_k x[m, k] W[n, k] (* scale[n]) + bias[n]                           */
/* ---------------------------------------------------------------------------------------- */

#define ROWS 8  /* most weight rows per tile (a single input row: 8 independent FMA chains) */
#define MT 4    /* most input rows per tile (each weight vector loaded once, used MT times) */

#if BST_AVX512
INLINE __m512 load_w16(const void *w, int dt, int64_t off) {
    if (dt == DT_F32) return _mm512_loadu_ps((const float *)w + off);
    if (dt == DT_BF16) {
        __m256i h = _mm256_loadu_si256((const __m256i *)((const uint16_t *)w + off));
        return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
    }
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)((const int8_t *)w + off))));
}

INLINE __m512 load_w16_masked(const void *w, int dt, int64_t off, __mmask16 mask) {
    if (dt == DT_F32) return _mm512_maskz_loadu_ps(mask, (const float *)w + off);
    if (dt == DT_BF16) {
        __m256i h = _mm256_maskz_loadu_epi16(mask, (const uint16_t *)w + off);
        return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
    }
    __m128i b = _mm_maskz_loadu_epi8(mask, (const int8_t *)w + off);
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(b));
}

/* out[r][i] = dot(W row row0 + r, x row i) for R rows, M inputs (compile-time after inlining).
 * The weight stream of the row 64 features ahead is prefetched. */
INLINE void dense_block(const float *x, int64_t k, const void *w, int dt, int64_t row0, int R, int M,
                        float out[ROWS][MT]) {
    __m512 acc[ROWS][MT];
    for (int r = 0; r < R; r++)
        for (int i = 0; i < M; i++) acc[r][i] = _mm512_setzero_ps();
    int64_t kk = 0;
    const int64_t esize = dt == DT_F32 ? 4 : dt == DT_BF16 ? 2 : 1, line = 64 / esize;
    for (; kk + 16 <= k; kk += 16) {
        __m512 xv[MT];
        for (int i = 0; i < M; i++) xv[i] = _mm512_loadu_ps(x + i * k + kk);
        if (kk % line == 0) /* rows are short (a few cache lines): fetch the next tile's rows early */
            for (int r = 0; r < R; r++) _mm_prefetch((const char *)w + ((row0 + R + r) * k + kk) * esize, _MM_HINT_T0);
        for (int r = 0; r < R; r++) {
            __m512 wv = load_w16(w, dt, (row0 + r) * k + kk);
            for (int i = 0; i < M; i++) acc[r][i] = _mm512_fmadd_ps(wv, xv[i], acc[r][i]);
        }
    }
    if (kk < k) {
        __mmask16 mask = (__mmask16)((1u << (k - kk)) - 1);
        __m512 xv[MT];
        for (int i = 0; i < M; i++) xv[i] = _mm512_maskz_loadu_ps(mask, x + i * k + kk);
        for (int r = 0; r < R; r++) {
            __m512 wv = load_w16_masked(w, dt, (row0 + r) * k + kk, mask);
            for (int i = 0; i < M; i++) acc[r][i] = _mm512_fmadd_ps(wv, xv[i], acc[r][i]);
        }
    }
    for (int r = 0; r < R; r++)
        for (int i = 0; i < M; i++) out[r][i] = _mm512_reduce_add_ps(acc[r][i]);
}
#endif

INLINE void dense_block_scalar(const float *x, int64_t k, const void *w, int dt, int64_t row0, int R, int M,
                               float out[ROWS][MT]) {
    for (int r = 0; r < R; r++)
        for (int i = 0; i < M; i++) {
            float s = 0.f;
            int64_t base = (row0 + r) * k;
            for (int64_t kk = 0; kk < k; kk++) {
                float wv = dt == DT_I8 ? (float)((const int8_t *)w)[base + kk] : load_f(w, dt, base + kk);
                s += wv * x[i * k + kk];
            }
            out[r][i] = s;
        }
}

INLINE void dense_tile(const float *x, int64_t k, const void *w, int dt, int64_t row0, int R, int M,
                       float out[ROWS][MT]) {
#if BST_AVX512
    dense_block(x, k, w, dt, row0, R, M, out);
#else
    dense_block_scalar(x, k, w, dt, row0, R, M, out);
#endif
}

/* The tile shapes (rows R x inputs M), each its own register-blocked loop per weight dtype:
 * 8 x 1, 4 x 2..4 (8 to 16 accumulators), and 1 x M for the rows left at the end. */
#define TILE_SHAPES(DT) \
    if (R == 8) dense_tile(xi, k, w, DT, row0, 8, 1, out); \
    else if (R == 4) { \
        if (M == 2) dense_tile(xi, k, w, DT, row0, 4, 2, out); \
        else if (M == 3) dense_tile(xi, k, w, DT, row0, 4, 3, out); \
        else dense_tile(xi, k, w, DT, row0, 4, 4, out); \
    } else { \
        if (M == 1) dense_tile(xi, k, w, DT, row0, 1, 1, out); \
        else if (M == 2) dense_tile(xi, k, w, DT, row0, 1, 2, out); \
        else if (M == 3) dense_tile(xi, k, w, DT, row0, 1, 3, out); \
        else dense_tile(xi, k, w, DT, row0, 1, 4, out); \
    }

static void tile_any(const float *xi, int64_t k, const void *w, int wdt, int64_t row0, int R, int M,
                     float out[ROWS][MT]) {
    if (wdt == DT_F32) {
        TILE_SHAPES(DT_F32)
    } else if (wdt == DT_BF16) {
        TILE_SHAPES(DT_BF16)
    } else {
        TILE_SHAPES(DT_I8)
    }
}

static void dense_rows(const float *xf, int64_t m, int64_t k, const void *w, int wdt, const float *scale,
                       const float *bias, void *y, int ydt, int64_t n, int64_t r_begin, int64_t r_end) {
    float out[ROWS][MT];
    for (int64_t i0 = 0; i0 < m; i0 += MT) {
        int M = m - i0 >= MT ? MT : (int)(m - i0);
        int full = M == 1 ? 8 : 4;
        const float *xi = xf + i0 * k;
        for (int64_t row0 = r_begin; row0 < r_end;) {
            int R = r_end - row0 >= full ? full : 1;
            tile_any(xi, k, w, wdt, row0, R, M, out);
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

/* int4: W[row, k] = q * s - s * z for the nibble q of feature k (byte k / 2, low nibble = even
 * k) and the scales of its group (group % 32 == 0). Per 32 features, 16 bytes: the input is
 * permuted once per call so that a 32-block reads [even k..., odd k...] (xp), which matches
 * [low nibbles, high nibbles] of the 16 bytes. */
INLINE float int4_weight(const uint8_t *wr, const float *sr, const float *szr, int64_t kk, int64_t group) {
    uint8_t byte = wr[kk / 2];
    float q = (float)((kk & 1) ? byte >> 4 : byte & 15);
    return q * sr[kk / group] - szr[kk / group];
}

#if BST_AVX512
/* res[r][i] += sum over the 32-blocks of k < kb of W[row0 + r, k] x[i, k] for R rows and M
 * inputs (constants after inlining); low and high nibbles accumulate apart (2 R M independent
 * FMA chains). */
INLINE void int4_tile(const float *xp, int64_t m_stride, int64_t k, int64_t kb, const uint8_t *w, const float *s,
                      const float *sz, int64_t group, int64_t row0, int R, int M, float res[4][MT]) {
    const int64_t groups = (k + group - 1) / group;
    const __m128i low4 = _mm_set1_epi8(0x0f);
    const __m512 iota = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    __m512 acc[4][MT][2], lut[4];
    for (int r = 0; r < R; r++) {
        lut[r] = _mm512_setzero_ps();
        for (int i = 0; i < M; i++) acc[r][i][0] = acc[r][i][1] = _mm512_setzero_ps();
    }
    for (int64_t kk = 0; kk < kb; kk += 32) {
        __m512 xlo[MT], xhi[MT];
        for (int i = 0; i < M; i++) {
            xlo[i] = _mm512_loadu_ps(xp + i * m_stride + kk);
            xhi[i] = _mm512_loadu_ps(xp + i * m_stride + kk + 16);
        }
        for (int r = 0; r < R; r++) {
            const uint8_t *wr = w + (row0 + r) * (k / 2);
            if (kk % group == 0) { /* a new group: its table lut[q] = q * s - s * z */
                int64_t g = (row0 + r) * groups + kk / group;
                lut[r] = _mm512_fmsub_ps(iota, _mm512_set1_ps(s[g]), _mm512_set1_ps(sz[g]));
            }
            if (kk % 128 == 0) /* a row is a few cache lines: fetch the next tile's early */
                _mm_prefetch((const char *)(wr + R * (k / 2) + kk / 2), _MM_HINT_T0);
            __m128i b = _mm_loadu_si128((const __m128i *)(wr + kk / 2));
            __m512 lo = _mm512_permutexvar_ps(_mm512_cvtepu8_epi32(_mm_and_si128(b, low4)), lut[r]);
            __m512 hi = _mm512_permutexvar_ps(_mm512_cvtepu8_epi32(_mm_and_si128(_mm_srli_epi16(b, 4), low4)), lut[r]);
            for (int i = 0; i < M; i++) {
                acc[r][i][0] = _mm512_fmadd_ps(lo, xlo[i], acc[r][i][0]);
                acc[r][i][1] = _mm512_fmadd_ps(hi, xhi[i], acc[r][i][1]);
            }
        }
    }
    for (int r = 0; r < R; r++)
        for (int i = 0; i < M; i++) res[r][i] = _mm512_reduce_add_ps(_mm512_add_ps(acc[r][i][0], acc[r][i][1]));
}
#endif

/* int4 rows [r_begin, r_end) of y for all m inputs: tiles of 4 rows x 1 input or 1 row x up
 * to 4 inputs, then the features past the last 32-block one by one. */
static void int4_rows(const float *xf, const float *xp, int64_t m, int64_t k, const uint8_t *w, const float *s,
                      const float *sz, int64_t group, const float *bias, void *y, int ydt, int64_t n,
                      int64_t r_begin, int64_t r_end) {
    int64_t groups = (k + group - 1) / group, kb = BST_AVX512 ? k / 32 * 32 : 0;
    (void)xp;
    for (int64_t i0 = 0; i0 < m; i0 += MT) {
        int M = m - i0 >= MT ? MT : (int)(m - i0);
        for (int64_t row0 = r_begin; row0 < r_end;) {
            int R = M == 1 && r_end - row0 >= 4 ? 4 : 1;
            float res[4][MT] = {{0.f}};
#if BST_AVX512
            const float *xi = xp + i0 * k;
            if (R == 4) int4_tile(xi, k, k, kb, w, s, sz, group, row0, 4, 1, res);
            else if (M == 1) int4_tile(xi, k, k, kb, w, s, sz, group, row0, 1, 1, res);
            else if (M == 2) int4_tile(xi, k, k, kb, w, s, sz, group, row0, 1, 2, res);
            else if (M == 3) int4_tile(xi, k, k, kb, w, s, sz, group, row0, 1, 3, res);
            else int4_tile(xi, k, k, kb, w, s, sz, group, row0, 1, 4, res);
#endif
            for (int r = 0; r < R; r++) {
                const uint8_t *wr = w + (row0 + r) * (k / 2);
                const float *sr = s + (row0 + r) * groups, *szr = sz + (row0 + r) * groups;
                for (int i = 0; i < M; i++) {
                    const float *xr = xf + (i0 + i) * k;
                    float v = res[r][i];
                    for (int64_t kk = kb; kk < k; kk++) v += int4_weight(wr, sr, szr, kk, group) * xr[kk];
                    store_f(y, ydt, (i0 + i) * n + row0 + r, v + (bias ? bias[row0 + r] : 0.f));
                }
            }
            row0 += R;
        }
    }
}

/* Float weights held transposed, Wt [k, n] (the layout the CPU GEMMs of torch read too):
 * y[i, c] = sum_k x[i, k] Wt[k, c]. A tile is M inputs x C vectors of 16 columns; each step
 * over k loads C weight vectors and broadcasts M inputs. Column blocks of 64 stay in L2
 * while every 4-row tile of x passes over them. */
#define TCOLS 8 /* most 16-column vectors per tile (a single input row) */

#if BST_AVX512
/* out[i, 16c + j] (+)= sum over k0 <= kk < k1 of x[i, kk] Wt[kk, col0 + 16c + j]: adds to out
 * unless k0 == 0. */
INLINE void cols_block(const float *x, int64_t k, int64_t k0, int64_t k1, const void *wt, int dt, int64_t n,
                       int64_t col0, int C, int M, float *out, int64_t out_stride) {
    __m512 acc[MT][TCOLS];
    for (int i = 0; i < M; i++)
        for (int c = 0; c < C; c++)
            acc[i][c] = k0 == 0 ? _mm512_setzero_ps() : _mm512_loadu_ps(out + i * out_stride + 16 * c);
    for (int64_t kk = k0; kk < k1; kk++) {
        __m512 wv[TCOLS];
        for (int c = 0; c < C; c++) wv[c] = load_w16(wt, dt, kk * n + col0 + 16 * c);
        for (int i = 0; i < M; i++) {
            __m512 xb = _mm512_set1_ps(x[i * k + kk]);
            for (int c = 0; c < C; c++) acc[i][c] = _mm512_fmadd_ps(wv[c], xb, acc[i][c]);
        }
    }
    for (int i = 0; i < M; i++)
        for (int c = 0; c < C; c++) _mm512_storeu_ps(out + i * out_stride + 16 * c, acc[i][c]);
}
#endif

/* Columns [c_begin, c_end) of y for all m inputs; out: a [m, c_end - c_begin] float scratch. */
static void cols_range(const float *xf, int64_t m, int64_t k, const void *wt, int wdt, const float *bias, void *y,
                       int ydt, int64_t n, int64_t c_begin, int64_t c_end) {
    int64_t width = c_end - c_begin;
    if (width <= 0) return;
    float *out = (float *)malloc(sizeof(float) * (size_t)(m * width));
    int64_t col = c_begin, vec_end = c_begin + width / 16 * 16;
#if BST_AVX512
    /* k in chunks of KCHUNK rows: each chunk streams KCHUNK rows of the thread's columns
     * (sequential within a row), partial sums kept in `out` (L1/L2) between chunks. */
    const int64_t KCHUNK = 32, block = m == 1 ? 16 * TCOLS : 64;
    for (int64_t k0 = 0; k0 < k; k0 += KCHUNK) {
        int64_t k1 = k0 + KCHUNK < k ? k0 + KCHUNK : k;
        for (col = c_begin; col < vec_end; col += block) {
            int C = (int)((vec_end - col) / 16);
            if (C > block / 16) C = (int)(block / 16);
            for (int64_t i0 = 0; i0 < m; i0 += MT) {
                int M = m - i0 >= MT ? MT : (int)(m - i0);
                const float *xi = xf + i0 * k;
                float *o = out + i0 * width + (col - c_begin);
#define COLS_M(CC)                                                                                     \
    if (M == 1) cols_block(xi, k, k0, k1, wt, DTW, n, col + 16 * c, CC, 1, o + 16 * c, width);       \
    else if (M == 2) cols_block(xi, k, k0, k1, wt, DTW, n, col + 16 * c, CC, 2, o + 16 * c, width);  \
    else if (M == 3) cols_block(xi, k, k0, k1, wt, DTW, n, col + 16 * c, CC, 3, o + 16 * c, width);  \
    else cols_block(xi, k, k0, k1, wt, DTW, n, col + 16 * c, CC, 4, o + 16 * c, width);
#define COLS_ANY                                                                                       \
    if (C == 8) {                                                                                      \
        int c = 0;                                                                                     \
        cols_block(xi, k, k0, k1, wt, DTW, n, col, 8, 1, o, width);                                   \
        (void)c;                                                                                       \
    } else if (C == 4) {                                                                               \
        int c = 0;                                                                                     \
        COLS_M(4)                                                                                      \
    } else {                                                                                           \
        for (int c = 0; c < C; c++) { COLS_M(1) }                                                      \
    }
                if (wdt == DT_F32) {
#define DTW DT_F32
                    COLS_ANY
#undef DTW
                } else {
#define DTW DT_BF16
                    COLS_ANY
#undef DTW
                }
#undef COLS_ANY
#undef COLS_M
            }
        }
    }
    col = vec_end;
#endif
    for (; col < c_end; col++) /* columns past the last full vector of 16 */
        for (int64_t i = 0; i < m; i++) {
            float acc = 0.f;
            for (int64_t kk = 0; kk < k; kk++) acc += xf[i * k + kk] * load_f(wt, wdt, kk * n + col);
            out[i * width + col - c_begin] = acc;
        }
    for (int64_t i = 0; i < m; i++)
        for (int64_t c = c_begin; c < c_end; c++)
            store_f(y, ydt, i * n + c, out[i * width + c - c_begin] + (bias ? bias[c] : 0.f));
    free(out);
}

/* Split rows [0, n) in `parts` ranges on multiples of ROWS. */
INLINE void row_range(int64_t n, int part, int parts, int64_t *b, int64_t *e) {
    int64_t blocks = (n + ROWS - 1) / ROWS;
    *b = blocks * part / parts * ROWS;
    *e = blocks * (part + 1) / parts * ROWS;
    if (*e > n) *e = n;
    if (*b > n) *b = n;
}

/* y [m, n] (ydt) = x [m, k] (xdt) @ W^T: F32 / BF16 weights held transposed, Wt [k, n]; I8
 * q [n, k] with scale [n]; for I4 s and sz = s * zero [n, ceil(k / group)], group % 32 == 0; bias [n] float or NULL. */
void bst_linear(const void *x, int xdt, int64_t m, int64_t k, const void *w, int wdt, int64_t n,
                const float *scale, const float *sz, int64_t group, const float *bias, void *y, int ydt,
                int threads) {
    float *xf = (float *)malloc(sizeof(float) * (size_t)(m * k) * (wdt == DT_I4 ? 2 : 1) + 64);
    float *xp = NULL;
    to_f32(x, xdt, m * k, xf);
    if (wdt == DT_I4) { /* x permuted per 32-block: [even features, odd features] (int4_rows) */
        xp = xf + m * k;
        for (int64_t i = 0; i < m; i++)
            for (int64_t kk = 0; kk + 32 <= k; kk += 32)
                for (int j = 0; j < 16; j++) {
                    xp[i * k + kk + j] = xf[i * k + kk + 2 * j];
                    xp[i * k + kk + 16 + j] = xf[i * k + kk + 2 * j + 1];
                }
    }
    int parts = threads < 1 ? 1 : threads;
    if (n < 64 * parts) parts = 1;
#pragma omp parallel for num_threads(parts) schedule(static, 1)
    for (int part = 0; part < parts; part++) {
        int64_t b, e;
        row_range(n, part, parts, &b, &e);
        if (wdt == DT_F32 || wdt == DT_BF16) {
            int64_t vecs = (n + 15) / 16, cb = vecs * part / parts * 16, ce = vecs * (part + 1) / parts * 16;
            cols_range(xf, m, k, w, wdt, bias, y, ydt, n, cb < n ? cb : n, ce < n ? ce : n);
        } else if (wdt == DT_I4)
            int4_rows(xf, xp, m, k, (const uint8_t *)w, scale, sz, group, bias, y, ydt, n, b, e);
        else
            dense_rows(xf, m, k, w, wdt, wdt == DT_I8 ? scale : NULL, bias, y, ydt, n, b, e);
    }
    free(xf);
}

/* W [n, k] (I8 with scale / I4 with s, sz) -> float rows [n, k] in ydt: the dequantized
 * weight the prefill GEMM multiplies by. */
void bst_dequantize(const void *w, int wdt, int64_t n, int64_t k, const float *scale, const float *sz,
                    int64_t group, void *y, int ydt, int threads) {
    int64_t groups = wdt == DT_I4 ? (k + group - 1) / group : 1;
#pragma omp parallel for num_threads(threads < 1 ? 1 : threads) schedule(static)
    for (int64_t row = 0; row < n; row++) {
        for (int64_t kk = 0; kk < k; kk++) {
            float v;
            if (wdt == DT_I8) {
                v = (float)((const int8_t *)w)[row * k + kk] * scale[row];
            } else if (wdt == DT_I4) {
                v = int4_weight((const uint8_t *)w + row * (k / 2), scale + row * groups, sz + row * groups, kk, group);
            } else {
                v = NAN; /* float weights are not dequantized */
            }
            store_f(y, ydt, row * k + kk, v);
        }
    }
}

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

/* dst[d] = code(pool[off + d]) * s for a row of D codes */
static void load_kv_row(const void *pool, int dt, int64_t off, int64_t D, float s, float *dst) {
#if BST_AVX512
    const __m512 sv = _mm512_set1_ps(s);
    for (int64_t d = 0; d < D; d += 16) {
        __mmask16 mask = D - d >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (D - d)) - 1);
        __m128i c = _mm_maskz_loadu_epi8(mask, (const uint8_t *)pool + off + d);
        __m512 v = dt == DT_I8 ? _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(c))
                               : _mm512_mask_i32gather_ps(_mm512_setzero_ps(), mask, _mm512_cvtepu8_epi32(c),
                                                          e4m3_values, 4);
        _mm512_mask_storeu_ps(dst + d, mask, _mm512_mul_ps(v, sv));
    }
#else
    if (dt == DT_I8) {
        const int8_t *c = (const int8_t *)pool + off;
        for (int64_t d = 0; d < D; d++) dst[d] = (float)c[d] * s;
    } else {
        const uint8_t *c = (const uint8_t *)pool + off;
        for (int64_t d = 0; d < D; d++) dst[d] = e4m3_values[c[d]] * s;
    }
#endif
}

/* k / v rows [T, W] (src_stride elements apart, dtype sdt) -> pool slot rows (W = KVH * D); pools
 * in pdt: float (scales NULL) or int8 / e4m3 codes with scales (s_k, s_v). */
void bst_kv_write(const void *k, const void *v, int sdt, int64_t src_stride, void *k_pool, void *v_pool, int pdt,
                  const int64_t *slots, int64_t T, int64_t W, const float *scales) {
    for (int64_t t = 0; t < T; t++)
        for (int64_t j = 0; j < W; j++) {
            float kx = load_f(k, sdt, t * src_stride + j), vx = load_f(v, sdt, t * src_stride + j);
            if (scales) {
                store_kv(k_pool, pdt, slots[t] * W + j, kx, scales[0]);
                store_kv(v_pool, pdt, slots[t] * W + j, vx, scales[1]);
            } else {
                store_f(k_pool, pdt, slots[t] * W + j, kx);
                store_f(v_pool, pdt, slots[t] * W + j, vx);
            }
        }
}

/* ---------------------------------------------------------------------------------------- */
/* decode attention over the paged pool                                                     */
/* ---------------------------------------------------------------------------------------- */

/* out[b, h, :] = softmax_j(q[b, h] . K_j * scale + slope_h * (j - (L_b - 1))) V_j over the L_b =
 * kv_lens[b] cached keys of sequence b: K_j = k_pool[table[b, j / bs], j % bs, h / G], G = H / KVH.
 * q [B, H, D] (qdt; q_stride elements from one sequence's row to the next), pools [blocks, bs, KVH, D] (kvdt), tables [B, max_blocks] int64,
 * slopes [H] float or NULL, out [B, H, D] (odt). Quantized pools (kvdt DT_I8 / DT_F8) hold codes with
 * K = code * kv_scales[0], V = code * kv_scales[1]; float pools pass kv_scales NULL. */
void bst_decode_attention(const void *q, int qdt, int64_t q_stride, const void *k_pool, const void *v_pool, int kvdt,
                          const int64_t *tables, int64_t max_blocks, const int64_t *kv_lens, int64_t B,
                          int64_t H, int64_t KVH, int64_t D, int64_t bs, float scale, const float *slopes,
                          void *out, int odt, const float *kv_scales, int threads) {
    int64_t G = H / KVH;
#pragma omp parallel for num_threads(threads < 1 ? 1 : threads) schedule(dynamic, 1)
    for (int64_t task = 0; task < B * H; task++) {
        int64_t b = task / H, h = task % H, kvh = h / G, L = kv_lens[b];
        const int64_t *table = tables + b * max_blocks;
        float qf[512], acc[512];
        float stack_scores[4096];
        float *scores = L <= 4096 ? stack_scores : (float *)malloc(sizeof(float) * (size_t)L);
        to_f32((const char *)q + (b * q_stride + h * D) * (qdt == DT_F32 ? 4 : 2), qdt, D, qf);
        float mx = -INFINITY;
        float row[512];
        for (int64_t j = 0; j < L; j++) {
            int64_t off = ((table[j / bs] * bs + j % bs) * KVH + kvh) * D;
            const void *kp = k_pool;
            int kdt = kvdt;
            if (kv_scales) { /* codes -> a float row */
                load_kv_row(k_pool, kvdt, off, D, kv_scales[0], row);
                kp = row, kdt = DT_F32, off = 0;
            }
            float s = 0.f;
#if BST_AVX512
            __m512 a = _mm512_setzero_ps();
            for (int64_t d = 0; d < D; d += 16) {
                __mmask16 mask = D - d >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (D - d)) - 1);
                a = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(mask, qf + d), load_w16_masked(kp, kdt, off + d, mask), a);
            }
            s = _mm512_reduce_add_ps(a);
#else
            for (int64_t d = 0; d < D; d++) s += qf[d] * load_f(kp, kdt, off + d);
#endif
            s *= scale;
            if (slopes) s += slopes[h] * (float)(j - (L - 1));
            scores[j] = s;
            if (s > mx) mx = s;
        }
        float total = 0.f;
        for (int64_t j = 0; j < L; j++) {
            scores[j] = expf(scores[j] - mx);
            total += scores[j];
        }
        for (int64_t d = 0; d < D; d++) acc[d] = 0.f;
        for (int64_t j = 0; j < L; j++) {
            int64_t off = ((table[j / bs] * bs + j % bs) * KVH + kvh) * D;
            float p = scores[j] / total;
            const void *vp = v_pool;
            int vdt = kvdt;
            if (kv_scales) {
                load_kv_row(v_pool, kvdt, off, D, kv_scales[1], row);
                vp = row, vdt = DT_F32, off = 0;
            }
#if BST_AVX512
            __m512 pv = _mm512_set1_ps(p);
            for (int64_t d = 0; d < D; d += 16) {
                __mmask16 mask = D - d >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (D - d)) - 1);
                __m512 cur = _mm512_maskz_loadu_ps(mask, acc + d);
                _mm512_mask_storeu_ps(acc + d, mask, _mm512_fmadd_ps(pv, load_w16_masked(vp, vdt, off + d, mask), cur));
            }
#else
            for (int64_t d = 0; d < D; d++) acc[d] += p * load_f(vp, vdt, off + d);
#endif
        }
        from_f32(acc, D, (char *)out + (b * H + h) * D * (odt == DT_F32 ? 4 : 2), odt);
        if (scores != stack_scores) free(scores);
    }
}

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
        for (int64_t i = 0; i < H; i++) {
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
        for (int64_t i = 0; i < H; i++) store_f(y, dt, t * H + i, h[i] * inv * load_f(w, wdt, i));
        if (h != hbuf) free(h);
    }
}

/* Rotate the n heads of one token (x: its first head, heads D apart) in place: pair (a, b) =
 * (i, i + rot/2) (neox) or (2i, 2i + 1) (gptj), i < rot/2, by the angle with cos[i], sin[i]. */
static void rotary_token(void *x, int dt, int64_t base, int64_t n, int64_t D, const void *cos, const void *sin,
                         int64_t cs_off, int csdt, int64_t rot, int gptj) {
    int64_t half = rot / 2;
    for (int64_t hd = 0; hd < n; hd++)
        for (int64_t i = 0; i < half; i++) {
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

void bst_act_and_mul(const void *fg, void *y, int dt, int64_t T, int64_t I, int act, int threads) {
#pragma omp parallel for num_threads(threads < 1 ? 1 : threads) schedule(static) if (T * I >= 65536)
    for (int64_t t = 0; t < T; t++)
        for (int64_t i = 0; i < I; i++) {
            float f = load_f(fg, dt, t * 2 * I + i), g = load_f(fg, dt, t * 2 * I + I + i);
            float a = act_of(f, act);
            if (dt == DT_BF16) a = bf16_to_f32(f32_to_bf16(a)); /* the reference rounds act(f) first */
            store_f(y, dt, t * I + i, a * g);
        }
}

/* ---------------------------------------------------------------------------------------- */
/* step plans: a whole decode step as one list of ops, run by one call                      */
/* ---------------------------------------------------------------------------------------- */

/* One op of a plan (bestiary.core.cpu.plan builds them). Pointers are fixed when the plan is
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
       OP_ACT_MUL = 6 };

/* out[t, :] = table[ids[t], :] with table element (v, h) at v * s0 + h * s1 (a tied embedding
 * may be held transposed). */
static void embed(const void *table, int tdt, int64_t s0, int64_t s1, const int64_t *ids, void *out, int odt,
                  int64_t T, int64_t H) {
    for (int64_t t = 0; t < T; t++)
        for (int64_t h = 0; h < H; h++) store_f(out, odt, t * H + h, load_f(table, tdt, ids[t] * s0 + h * s1));
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
                                     (int)o->dt[2], (const float *)o->p[7], threads);
                break;
            case OP_ACT_MUL:
                bst_act_and_mul(o->p[0], o->p[1], (int)o->dt[0], o->i[0], o->i[1], (int)o->i[2], threads);
                break;
        }
    }
}
