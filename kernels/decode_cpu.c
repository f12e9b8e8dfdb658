/* Fused fp32 CPU kernels around the serving runner's products (kernels/decode_cpu.py loads them).
 *
 * Built at first use with the machine's C compiler (-O3 -march=native -fopenmp) and loaded with
 * ctypes; OpenMP resolves to the libgomp torch already loaded, so these loops share torch's
 * intra-op threads. Every function takes raw pointers to contiguous fp32 tensors; the Python
 * wrappers check shapes, dtypes and contiguity before calling. NaN and inf propagate as in the
 * torch references: a non-finite input makes the affected outputs non-finite, never finite.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* Vector paths: AVX-512F (16 lanes), else AVX2 + FMA (8 lanes), else plain C that the compiler
 * vectorises where it can (the `omp simd` loops). -march=native picks the widest this CPU has. */
#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#include <immintrin.h>
#endif

#ifdef __AVX512F__

/* exp(x) for 16 lanes: x = n ln2 + r, |r| <= ln2/2, degree-6 polynomial on r, times 2^n
 * (scalef). Relative error ~2 ulp; x < -104 gives 0, x > 88.7 gives inf, NaN stays NaN (the
 * clamps keep the data operand second: MINPS/MAXPS return the second operand on NaN). */
static inline __m512 exp16(__m512 x) {
    x = _mm512_max_ps(_mm512_set1_ps(-104.0f), x);
    x = _mm512_min_ps(_mm512_set1_ps(89.0f), x);
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
    __m512 p = _mm512_set1_ps(1.9875691500e-4f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
    p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
    return _mm512_scalef_ps(p, n);
}
#elif defined(__AVX2__) && defined(__FMA__)
/* exp16's algorithm on 8 lanes. AVX2 has no scalef: 2^n is applied as two powers of two, 2^(n>>1)
 * and 2^(n - (n>>1)), each a normal float for n in [-150, 128]; p * 2^a is exact, so the result is
 * rounded once, as scalef's. NaN stays NaN (p is NaN; the integer path of n is then ignored). */
static inline __m256 exp8(__m256 x) {
    x = _mm256_max_ps(_mm256_set1_ps(-104.0f), x);
    x = _mm256_min_ps(_mm256_set1_ps(89.0f), x);
    const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
    __m256 p = _mm256_set1_ps(1.9875691500e-4f);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
    p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
    const __m256i ni = _mm256_cvtps_epi32(n), half = _mm256_srai_epi32(ni, 1), bias = _mm256_set1_epi32(127);
    const __m256 a = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(half, bias), 23));
    const __m256 b = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(_mm256_sub_epi32(ni, half), bias), 23));
    return _mm256_mul_ps(_mm256_mul_ps(p, a), b);
}

/* Lanes [0, k) set, for masked loads and stores of a tail of k < 8 floats. */
static inline __m256i tail_mask8(int64_t k) {
    return _mm256_cmpgt_epi32(_mm256_set1_epi32((int)k), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}
#endif

/* out[i] = exp(x[i]) in place over n floats; returns the sum. */
static float exp_sum(float *x, int64_t n) {
    int64_t i = 0;
    float sum = 0.0f;
#ifdef __AVX512F__
    __m512 acc = _mm512_setzero_ps();
    for (; i + 16 <= n; i += 16) {
        const __m512 e = exp16(_mm512_loadu_ps(x + i));
        _mm512_storeu_ps(x + i, e);
        acc = _mm512_add_ps(acc, e);
    }
    if (i < n) {
        const __mmask16 m = (__mmask16)((1u << (n - i)) - 1u);
        const __m512 e = exp16(_mm512_maskz_loadu_ps(m, x + i));
        _mm512_mask_storeu_ps(x + i, m, e);
        acc = _mm512_add_ps(acc, _mm512_maskz_mov_ps(m, e));
        i = n;
    }
    sum = _mm512_reduce_add_ps(acc);
#elif defined(__AVX2__) && defined(__FMA__)
    __m256 acc = _mm256_setzero_ps();
    for (; i + 8 <= n; i += 8) {
        const __m256 e = exp8(_mm256_loadu_ps(x + i));
        _mm256_storeu_ps(x + i, e);
        acc = _mm256_add_ps(acc, e);
    }
    if (i < n) {
        const __m256i m = tail_mask8(n - i);
        const __m256 e = _mm256_and_ps(exp8(_mm256_maskload_ps(x + i, m)), _mm256_castsi256_ps(m));
        _mm256_maskstore_ps(x + i, m, e);
        acc = _mm256_add_ps(acc, e);
        i = n;
    }
    const __m128 s4 = _mm_add_ps(_mm256_castps256_ps128(acc), _mm256_extractf128_ps(acc, 1));
    const __m128 s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
    sum = _mm_cvtss_f32(_mm_add_ss(s2, _mm_movehdup_ps(s2)));
#endif
    for (; i < n; i++) {
        x[i] = expf(x[i]);
        sum += x[i];
    }
    return sum;
}

static inline float dot(const float *a, const float *b, int64_t n) {
    float s = 0.0f;
#pragma omp simd reduction(+ : s)
    for (int64_t d = 0; d < n; d++) s += a[d] * b[d];
    return s;
}

/* Rotary embedding of one head: out = x * cos + flip_halves(x) * sin, sin sign-folded ([-sin, sin]
 * halves, drafters/common.py rope_table): the products of transformers' x*cos + rotate_half(x)*sin. */
static inline void rope(const float *x, const float *cos, const float *sin, float *out, int64_t hd) {
    const int64_t half = hd / 2;
    for (int64_t d = 0; d < half; d++) out[d] = x[d] * cos[d] + x[d + half] * sin[d];
    for (int64_t d = half; d < hd; d++) out[d] = x[d] * cos[d] + x[d - half] * sin[d];
}

/* Residual add and RMSNorm over R rows of D: if y, x += y (in place); then
 * out = x * rsqrt(mean(x^2) + eps) * w. */
void specray_add_rms_norm(float *x, const float *y, const float *w, float *out, int64_t R, int64_t D,
                          float eps, int nthreads) {
#pragma omp parallel for num_threads(nthreads) schedule(static) if (R > 1)
    for (int64_t r = 0; r < R; r++) {
        float *xr = x + r * D;
        float *o = out + r * D;
        if (y) {
            const float *yr = y + r * D;
#pragma omp simd
            for (int64_t d = 0; d < D; d++) xr[d] += yr[d];
        }
        const float inv = 1.0f / sqrtf(dot(xr, xr, D) / (float)D + eps);
#pragma omp simd
        for (int64_t d = 0; d < D; d++) o[d] = (xr[d] * inv) * w[d];
    }
}

/* out[r, i] = silu(gu[r, i]) * gu[r, I + i] over R rows ([gate; up] fused, gu [R, 2I]). */
void specray_silu_mul(const float *gu, float *out, int64_t R, int64_t I, int nthreads) {
#pragma omp parallel for num_threads(nthreads) schedule(static) if (R > 1)
    for (int64_t r = 0; r < R; r++) {
        const float *g = gu + r * 2 * I, *u = g + I;
        float *o = out + r * I;
        int64_t i = 0;
#ifdef __AVX512F__
        for (; i + 16 <= I; i += 16) {
            const __m512 gv = _mm512_loadu_ps(g + i);
            const __m512 e = exp16(_mm512_sub_ps(_mm512_setzero_ps(), gv));
            const __m512 s = _mm512_div_ps(gv, _mm512_add_ps(_mm512_set1_ps(1.0f), e));
            _mm512_storeu_ps(o + i, _mm512_mul_ps(s, _mm512_loadu_ps(u + i)));
        }
#elif defined(__AVX2__) && defined(__FMA__)
        for (; i + 8 <= I; i += 8) {
            const __m256 gv = _mm256_loadu_ps(g + i);
            const __m256 e = exp8(_mm256_sub_ps(_mm256_setzero_ps(), gv));
            const __m256 s = _mm256_div_ps(gv, _mm256_add_ps(_mm256_set1_ps(1.0f), e));
            _mm256_storeu_ps(o + i, _mm256_mul_ps(s, _mm256_loadu_ps(u + i)));
        }
#endif
        for (; i < I; i++) o[i] = g[i] / (1.0f + expf(-g[i])) * u[i];
    }
}

/* scores[j] = scale * (q . keys[j]) for j < n (keys [n, hd] row-major). */
static void scores_of(const float *q, const float *keys, int64_t n, int64_t hd, float scale, float *scores) {
    int64_t j = 0;
#ifdef __AVX512F__
    if (hd % 16 == 0) {
        /* 16 keys at a time: each key's 16-lane partial products, then one transposing reduction
         * gives the 16 dot products in one vector (instead of a horizontal sum per key). */
        const int64_t nd = hd / 16;
        const __m512 vscale = _mm512_set1_ps(scale);
        for (; j + 16 <= n; j += 16) {
            __m512 part[16];
            for (int u = 0; u < 16; u++) {
                const float *k = keys + (j + u) * hd;
                __m512 a = _mm512_mul_ps(_mm512_loadu_ps(q), _mm512_loadu_ps(k));
                for (int64_t c = 1; c < nd; c++) a = _mm512_fmadd_ps(_mm512_loadu_ps(q + 16 * c), _mm512_loadu_ps(k + 16 * c), a);
                part[u] = a;
            }
            /* pairs: each 128-bit lane holds [a, b, a, b] partial sums */
            __m512 r[8], w[4];
            for (int u = 0; u < 8; u++)
                r[u] = _mm512_add_ps(_mm512_unpacklo_ps(part[2 * u], part[2 * u + 1]),
                                     _mm512_unpackhi_ps(part[2 * u], part[2 * u + 1]));
            /* quads: each 128-bit lane holds [a, b, c, d] */
            for (int u = 0; u < 4; u++) {
                const __m512d x = _mm512_castps_pd(r[2 * u]), y = _mm512_castps_pd(r[2 * u + 1]);
                w[u] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)), _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
            }
            /* across the four 128-bit lanes */
            const __m512 u0 = _mm512_add_ps(_mm512_shuffle_f32x4(w[0], w[1], 0x44), _mm512_shuffle_f32x4(w[0], w[1], 0xEE));
            const __m512 u1 = _mm512_add_ps(_mm512_shuffle_f32x4(w[2], w[3], 0x44), _mm512_shuffle_f32x4(w[2], w[3], 0xEE));
            const __m512 sum = _mm512_add_ps(_mm512_shuffle_f32x4(u0, u1, 0x88), _mm512_shuffle_f32x4(u0, u1, 0xDD));
            _mm512_storeu_ps(scores + j, _mm512_mul_ps(sum, vscale));
        }
    }
#elif defined(__AVX2__) && defined(__FMA__)
    if (hd % 8 == 0) {
        /* 8 keys at a time, as above: per key 8-lane partial products (q's chunk loaded once for
         * the 8 keys), then horizontal adds that leave the 8 dot products in one vector. */
        const __m256 vscale = _mm256_set1_ps(scale);
        for (; j + 8 <= n; j += 8) {
            const float *k = keys + j * hd;
            __m256 part[8];
            for (int u = 0; u < 8; u++) part[u] = _mm256_setzero_ps();
            for (int64_t c = 0; c < hd; c += 8) {
                const __m256 qc = _mm256_loadu_ps(q + c);
                for (int u = 0; u < 8; u++) part[u] = _mm256_fmadd_ps(qc, _mm256_loadu_ps(k + u * hd + c), part[u]);
            }
            /* hadd pairs, then quads: [k0 k1 k2 k3 | k0 k1 k2 k3] halves of 4-lane sums */
            const __m256 q0 = _mm256_hadd_ps(_mm256_hadd_ps(part[0], part[1]), _mm256_hadd_ps(part[2], part[3]));
            const __m256 q1 = _mm256_hadd_ps(_mm256_hadd_ps(part[4], part[5]), _mm256_hadd_ps(part[6], part[7]));
            const __m256 sum = _mm256_add_ps(_mm256_permute2f128_ps(q0, q1, 0x20), _mm256_permute2f128_ps(q0, q1, 0x31));
            _mm256_storeu_ps(scores + j, _mm256_mul_ps(sum, vscale));
        }
    }
#endif
    for (; j < n; j++) scores[j] = dot(q, keys + j * hd, hd) * scale;
}

/* acc[d] += sum_j p[j] * values[j, d] for j < n, four keys per pass over acc. */
static void add_weighted(const float *p, const float *values, int64_t n, int64_t hd, float *acc) {
    int64_t j = 0;
    for (; j + 4 <= n; j += 4) {
        const float p0 = p[j], p1 = p[j + 1], p2 = p[j + 2], p3 = p[j + 3];
        const float *v0 = values + j * hd, *v1 = v0 + hd, *v2 = v1 + hd, *v3 = v2 + hd;
#pragma omp simd
        for (int64_t d = 0; d < hd; d++) acc[d] += p0 * v0[d] + p1 * v1[d] + p2 * v2[d] + p3 * v3[d];
    }
    for (; j < n; j++) {
        const float pj = p[j], *v = values + j * hd;
#pragma omp simd
        for (int64_t d = 0; d < hd; d++) acc[d] += pj * v[d];
    }
}

/* The request b whose rows [first[b], first[b + 1]) hold row r (first ascending, B + 1 entries). */
static inline int64_t request_of(const int64_t *first, int64_t B, int64_t r) {
    int64_t lo = 0, hi = B - 1;
    while (lo < hi) {
        const int64_t mid = (lo + hi + 1) / 2;
        if (first[mid] <= r) lo = mid;
        else hi = mid - 1;
    }
    return lo;
}

/* One attention task: query head h of row r (row t of request b), keys as specray_attention says. */
static inline void attend_one(const float *qkv, int64_t b, int64_t h, int64_t t, int64_t r, int64_t T, int64_t H,
                              int64_t g, int64_t hd, int64_t width, const float *cos, const float *sin,
                              const float *kc, const float *vc, int64_t head_stride, int64_t slot_stride,
                              const int64_t *slots, const int64_t *start, const int64_t *num_new,
                              const uint8_t *vis, float scale, float *out, float *scores, int64_t *extra, float *q,
                              float *acc) {
    const float *keys = kc + slots[b] * slot_stride + (h / g) * head_stride;
    const float *values = vc + slots[b] * slot_stride + (h / g) * head_stride;
    rope(qkv + r * width + h * hd, cos + r * hd, sin + r * hd, q, hd);
    const int64_t s = start[b];
    /* keys 0 .. n0 - 1, then the new rows listed in extra (a mask over them) */
    int64_t n0, ne = 0;
    if (vis == NULL) {
        n0 = (t < num_new[b]) ? s + t + 1 : 1;
    } else {
        n0 = s;
        for (int64_t j = 0; j < T; j++)
            if (vis[(b * T + t) * T + j]) extra[ne++] = s + j;
    }
    const int64_t n = n0 + ne;
    scores_of(q, keys, n0, hd, scale, scores);
    for (int64_t e = 0; e < ne; e++) scores[n0 + e] = dot(q, keys + extra[e] * hd, hd) * scale;
    float m = -INFINITY, check = 0.0f;
    for (int64_t j = 0; j < n; j++) {
        m = scores[j] > m ? scores[j] : m;
        check += scores[j] * 0.0f; /* NaN if any score is NaN or inf */
    }
    float *o = out + r * H * hd + h * hd;
    if (n == 0 || check != check) {
        for (int64_t d = 0; d < hd; d++) o[d] = NAN;
        return;
    }
    for (int64_t j = 0; j < n; j++) scores[j] -= m;
    const float inv = 1.0f / exp_sum(scores, n);
    for (int64_t d = 0; d < hd; d++) acc[d] = 0.0f;
    add_weighted(scores, values, n0, hd, acc);
    for (int64_t e = 0; e < ne; e++) add_weighted(scores + n0 + e, values + extra[e] * hd, 1, hd, acc);
    for (int64_t d = 0; d < hd; d++) o[d] = acc[d] * inv;
}

/* One forward's attention for one layer over B requests' new rows, R rows in all.
 *
 * Rows: with first == NULL, T rows per request (R = B*T, row r = b*T + t, the rows t >=
 * num_new[b] padding); else request b's rows are first[b] .. first[b + 1] - 1 (B + 1 offsets,
 * packed back to back, all real: a prefill; T is then the largest count, vis must be NULL).
 * qkv [R, (H + 2*Hkv)*hd]: each row's q heads, k heads, v heads (unrotated). cos, sin [R, hd]:
 * each row's RoPE table row. kc, vc: the layer's cache [num_slots, Hkv, max_len, hd]; request b
 * owns slot slots[b] with start[b] committed keys. Row t of request b writes its rotated k and
 * its v at cache row start[b] + t, then query head h reads KV head h / (H / Hkv) over:
 *   - vis == NULL (a causal chain): keys 0 .. start[b] + t; a padding row (t >= num_new[b])
 *     only key 0 (kept finite, as serving/kv_cache.py attention_mask);
 *   - vis [B, T, T] (a tree, or any mask over the new rows): every committed key (< start[b])
 *     and key start[b] + j iff vis[b, t, j].
 * Softmax as torch's: max, exp, sum. out [R, H*hd]. A non-finite score makes its row's output
 * NaN (the torch softmax would give NaN too). */
void specray_attention(const float *qkv, int64_t B, int64_t T, const int64_t *first, int64_t H, int64_t Hkv,
                       int64_t hd, const float *cos, const float *sin, float *kc, float *vc, int64_t max_len,
                       const int64_t *slots, const int64_t *start, const int64_t *num_new,
                       const uint8_t *vis, float scale, float *out, int nthreads) {
    const int64_t R = first ? first[B] : B * T, width = (H + 2 * Hkv) * hd, g = H / Hkv;
    const int64_t head_stride = max_len * hd, slot_stride = Hkv * head_stride;

#pragma omp parallel num_threads(nthreads)
    {
        /* 1. K/V writes: every row, every KV head. */
#pragma omp for schedule(static)
        for (int64_t rk = 0; rk < R * Hkv; rk++) {
            const int64_t r = rk / Hkv, kh = rk % Hkv, b = first ? request_of(first, B, r) : r / T;
            const int64_t t = first ? r - first[b] : r % T;
            const float *row = qkv + r * width;
            const int64_t at = slots[b] * slot_stride + kh * head_stride + (start[b] + t) * hd;
            rope(row + (H + kh) * hd, cos + r * hd, sin + r * hd, kc + at, hd);
            memcpy(vc + at, row + (H + Hkv + kh) * hd, hd * sizeof(float));
        }
        /* implicit barrier: every key of this forward is written */

        float *scores = malloc(sizeof(float) * (max_len + 16));
        int64_t *extra = malloc(sizeof(int64_t) * (T + 1));
        float *q = malloc(sizeof(float) * 2 * hd), *acc = q + hd;
        /* 2. attention: one task per (request, query head, row); tasks of one KV head are
         * adjacent, so a thread's consecutive tasks reread keys from its cache. Equal shares of
         * a step's few tasks (static); a prefill's tasks differ in length (row t reads t + 1
         * keys), so its threads take chunks as they finish (dynamic). */
        if (first == NULL) {
#pragma omp for schedule(static)
            for (int64_t task = 0; task < B * H * T; task++) {
                const int64_t b = task / (H * T), h = (task / T) % H, t = task % T;
                attend_one(qkv, b, h, t, b * T + t, T, H, g, hd, width, cos, sin, kc, vc, head_stride, slot_stride,
                           slots, start, num_new, vis, scale, out, scores, extra, q, acc);
            }
        } else {
#pragma omp for schedule(dynamic, 16)
            for (int64_t task = 0; task < H * R; task++) {
                const int64_t b = request_of(first, B, task / H), n = first[b + 1] - first[b];
                const int64_t local = task - H * first[b], h = local / n, t = local % n;
                attend_one(qkv, b, h, t, first[b] + t, T, H, g, hd, width, cos, sin, kc, vc, head_stride,
                           slot_stride, slots, start, num_new, NULL, scale, out, scores, extra, q, acc);
            }
        }
        free(q);
        free(extra);
        free(scores);
    }
}

/* ---- the products: out [M, N] = x [M, K] · w [N, K]ᵀ, w as stored (row-major [out, in]) ----
 *
 * For the few rows of a decode step or a small verify the product streams the weights from
 * memory once; what matters is reading them at full bandwidth and doing every row's FMAs on each
 * weight vector while it is in registers. Each task takes 8 weight rows: one row of x against 8
 * weight rows (8 accumulators, 8 streams), or pairs of x rows against 4 weight rows (8
 * accumulators; the 4 rows stay in L1 for the next pair). Threads split the weight rows. */
#if defined(__AVX2__) && defined(__FMA__)
static inline float hsum8(__m256 v) {
    const __m128 s4 = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    const __m128 s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
    return _mm_cvtss_f32(_mm_add_ss(s2, _mm_movehdup_ps(s2)));
}

/* MR rows of x (stride K) against NR rows of w (stride K) into out (row stride N). */
#define SPECRAY_TILE(MR, NR)                                                                         \
    static inline void tile_##MR##x##NR(const float *x, const float *w, float *out, int64_t K,       \
                                        int64_t N) {                                                 \
        __m256 acc[MR][NR];                                                                          \
        for (int i = 0; i < MR; i++)                                                                 \
            for (int j = 0; j < NR; j++) acc[i][j] = _mm256_setzero_ps();                            \
        int64_t k = 0;                                                                               \
        for (; k + 8 <= K; k += 8) {                                                                 \
            __m256 wv[NR];                                                                           \
            for (int j = 0; j < NR; j++) wv[j] = _mm256_loadu_ps(w + j * K + k);                     \
            for (int i = 0; i < MR; i++) {                                                           \
                const __m256 xv = _mm256_loadu_ps(x + i * K + k);                                    \
                for (int j = 0; j < NR; j++) acc[i][j] = _mm256_fmadd_ps(xv, wv[j], acc[i][j]);      \
            }                                                                                        \
        }                                                                                            \
        for (int i = 0; i < MR; i++)                                                                 \
            for (int j = 0; j < NR; j++) {                                                           \
                float s = hsum8(acc[i][j]);                                                          \
                for (int64_t t = k; t < K; t++) s += x[i * K + t] * w[j * K + t];                    \
                out[i * N + j] = s;                                                                  \
            }                                                                                        \
    }
SPECRAY_TILE(1, 8)
SPECRAY_TILE(2, 4)
SPECRAY_TILE(1, 4)
SPECRAY_TILE(1, 1)
#endif

void specray_linear(const float *x, const float *w, float *out, int64_t M, int64_t K, int64_t N, int nthreads) {
#pragma omp parallel for num_threads(nthreads) schedule(static)
    for (int64_t n0 = 0; n0 < N; n0 += 8) {
        const int64_t nb = N - n0 < 8 ? N - n0 : 8;
#if defined(__AVX2__) && defined(__FMA__)
        int64_t j = 0;
        if (M == 1 && nb == 8) {
            tile_1x8(x, w + n0 * K, out + n0, K, N);
            continue;
        }
        for (; j + 4 <= nb; j += 4) {
            const float *wj = w + (n0 + j) * K;
            int64_t m = 0;
            for (; m + 2 <= M; m += 2) tile_2x4(x + m * K, wj, out + m * N + n0 + j, K, N);
            if (m < M) tile_1x4(x + m * K, wj, out + m * N + n0 + j, K, N);
        }
        for (; j < nb; j++)
            for (int64_t m = 0; m < M; m++) tile_1x1(x + m * K, w + (n0 + j) * K, out + m * N + n0 + j, K, N);
#else
        for (int64_t j = 0; j < nb; j++)
            for (int64_t m = 0; m < M; m++) out[m * N + n0 + j] = dot(x + m * K, w + (n0 + j) * K, K);
#endif
    }
}
