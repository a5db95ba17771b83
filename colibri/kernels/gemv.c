/* Quantized GEMV/small-GEMM for decode (x [T, K] f32 or bf16, T <= MAX_T; output in x's dtype,
 * bf16 rounded to nearest even), output rows split across the pool's threads; and the int4
 * dequantization prefill uses. Over colibri's canonical layouts (colibri/quant.py): no repack, so a
 * weight read from disk into a cache slot is usable as is. */
#include "rows.h"

typedef struct {
    const float *xf;
    int T, K;
    const int8_t *q;
    const float *scale;
    int N;
    float *yf;
    int bf16;
    void *y;
    int vm;  /* xf holds q8_prep rows */
} q8_job;

/* Output rows o0..o1 of one int8 job. */
static void q8_range(const q8_job *j, long o0, long o1) {
    if (j->vm) {
        int P = panel_rows(j->K);
        for (long p0 = o0; p0 < o1; p0 += P) {
            long p1 = p0 + P < o1 ? p0 + P : o1;
            for (int t0 = 0; t0 < j->T; t0 += 8) {
                int tb = j->T - t0 < 8 ? j->T - t0 : 8;
                TB_SWITCH(Q8V_ROWS, tb, j->xf, j->K, j->q, j->scale, p0, p1, j->yf, j->N)
            }
        }
    } else {
        q8_rows(j->xf, j->T, j->K, j->q, j->scale, j->N, (int)o0, (int)o1, j->yf);
    }
    store_y(j->yf, j->bf16, j->T, j->N, (int)o0, (int)o1, j->y);
}

typedef struct {
    const float *xp, *xs;
    int T, K, G, g;
    const uint8_t *q;
    const uint16_t *scale, *mn;
    int N;
    float *yf;
    int bf16, bfm;
    void *y;
} q4_job;

/* Output rows o0..o1 of one int4 job. */
static void q4_range(const q4_job *j, long o0, long o1) {
    int K = j->K, G = j->G, g = j->g, N = j->N, bfm = j->bfm;
    int P = panel_rows(K / 2 + 4L * G);
    const float *xp = j->xp, *xs = j->xs;
    float *yf = j->yf;
    long p_end = o1;
#ifdef COLI_Q4V
    if (j->T == 1 && bfm == 2) {
        q4v_rows1(xp, xs, K, G, g, j->q, j->scale, j->mn, o0, o1, yf);
        p_end = o0;  /* (done: no panels) */
    }
#endif
    for (long p0 = o0; p0 < p_end; p0 += P) {
        long p1 = p0 + P < o1 ? p0 + P : o1;
        for (int t0 = 0; t0 < j->T; t0 += 8) {
            int tb = j->T - t0 < 8 ? j->T - t0 : 8;
            TB_SWITCH(Q4_ROWS, tb, xp, xs, K, G, g, j->q, j->scale, j->mn, p0, p1, yf, N, bfm)
        }
    }
    store_y(j->yf, j->bf16, j->T, N, (int)o0, (int)o1, j->y);
}

/* Weights applied to one input (one, or an attention layer's q, k and v): the activations prepared once
 * and every weight's output rows in one parallel region -- three fork/joins and three preparations of
 * the same row were a few percent of a small model's decode step. An output row's bits do not depend
 * on which weights share the call. */
#define MULTI_MAX 4
typedef struct {
    int n, scheme;
    long off[MULTI_MAX + 1];  /* weight m's rows are [off[m], off[m + 1]) of the flattened rows */
    q8_job j8[MULTI_MAX];
    q4_job j4[MULTI_MAX];
} multi_job;

static void multi_part(void *p, int id, int n) {
    multi_job *m = (multi_job *)p;
    long r0, r1;
    split(m->off[m->n], id, n, &r0, &r1);
    for (int i = 0; i < m->n; i++) {
        long a = r0 > m->off[i] ? r0 : m->off[i], b = r1 < m->off[i + 1] ? r1 : m->off[i + 1];
        if (a >= b) continue;
        if (m->scheme == 8) q8_range(&m->j8[i], a - m->off[i], b - m->off[i]);
        else q4_range(&m->j4[i], a - m->off[i], b - m->off[i]);
    }
}

/* x [T, K] (f32, or bf16 when bf16 != 0); w[i] (int8: q, s; int4: q, s, m with group g) [N[i], K]; y[i]
 * [T, N[i]] in x's dtype; n <= 4. Returns 0, -1 (T out of range), -2 (memory), -3 (bad shape). */
int coli_multi_gemm(const void *x, int bf16, int T, int K, int scheme, int g, int n, const coli_qw *w, const int *N,
                    void *const *y) {
    if (T < 1 || T > MAX_T) return -1;
    if (n < 1 || n > MULTI_MAX || (scheme == 4 && (K % 32 || g % 32 || K % g))) return -3;
    long Ntot = 0;
    for (int i = 0; i < n; i++) Ntot += N[i];
    size_t nx = (size_t)T * K, G = scheme == 4 ? (size_t)K / g : 0;
    size_t nprep = scheme == 4 ? nx + (size_t)T * G : (size_t)T * Q8_STRIDE(K);
    float *buf = (float *)coli_alloc(sizeof(float) * (nx + nprep + (size_t)T * Ntot));
    if (!buf) return -2;
    float *xf = buf, *xp = buf + nx, *yf = xp + nprep;
    load_x(x, bf16, T, K, xf);
    multi_job m = {n, scheme, {0}, {{0}}, {{0}}};
    if (scheme == 8) {
        int vm = Q8V_OK(bf16, K);
        if (vm) q8_prep(xf, T, K, xp);
        for (int i = 0; i < n; i++) {
            q8_job j = {vm ? xp : xf, T, K, (const int8_t *)w[i].q, (const float *)w[i].s, N[i], yf, bf16, y[i], vm};
            m.j8[i] = j;
            yf += (size_t)T * N[i];
            m.off[i + 1] = m.off[i] + N[i];
        }
    } else {
        int bfm = BF_MODE(bf16, K, g);
        float *xs = xp + nx;
        int4_prep(xf, T, K, g, xp, xs, bfm);
        for (int i = 0; i < n; i++) {
            q4_job j = {xp, xs, T, K, (int)G, g, (const uint8_t *)w[i].q, (const uint16_t *)w[i].s,
                        (const uint16_t *)w[i].m, N[i], yf, bf16, bfm, y[i]};
            m.j4[i] = j;
            yf += (size_t)T * N[i];
            m.off[i + 1] = m.off[i] + N[i];
        }
    }
    coli_parallel(multi_part, &m, n_threads_for(Ntot * K / (scheme == 4 ? 2 : 1)));
    free(buf);
    return 0;
}

/* One weight (the Python entry points): x [T, K] (f32, or bf16 when bf16 != 0), y [T, N] same dtype. */
int coli_q8_gemm(const void *x, int bf16, int T, int K, const int8_t *q, const float *scale, int N, void *y) {
    coli_qw w = {q, scale, NULL};
    return coli_multi_gemm(x, bf16, T, K, 8, 0, 1, &w, &N, &y);
}

/* q uint8 [N, K/2], scale/min f16 [N, K/g]; K % 32 == 0 and g % 32 == 0. */
int coli_q4_gemm(const void *x, int bf16, int T, int K, const uint8_t *q, const uint16_t *scale,
                 const uint16_t *mn, int g, int N, void *y) {
    coli_qw w = {q, scale, mn};
    return coli_multi_gemm(x, bf16, T, K, 4, g, 1, &w, &N, &y);
}

int coli_max_rows(void) { return MAX_T; }

/* What the build has: 1 = the AVX-512 kernels (without them only the portable C loops are left, which
 * decode ~3x slower than torch's own kernels -- 0.44b model, AVX2-only build: int8 32 vs 109 tok/s,
 * int4 54 vs 148 -- so native.py does not use such a build), | 2 = the int8-activation (VNNI) paths. */
int coli_simd(void) {
    int f = 0;
#ifdef COLI_AVX512
    f |= 1;
#endif
#ifdef COLI_VNNI
    f |= 2;
#endif
    return f;
}

/* ------------------------------------------------------------------- int4 dequantize (prefill) */

/* Rows of a canonical int4 weight to bf16 (or f32): w = q * scale + min, computed in f32 and rounded
 * once, like quant.dequantize. For prefill, where a dense GEMM on the dequantized rows wins. */
int coli_q4_dequant(const uint8_t *q, const uint16_t *scale, const uint16_t *mn, int rows, int K, int g, int bf16,
                    void *out) {
    if (K % 2 || g % 2 || K % g) return -3;
    int G = K / g;
    float tmp[1024];
    for (long r = 0; r < rows; r++) {
        const uint8_t *qr = q + r * (K / 2);
        for (int gi = 0; gi < G; gi++) {
            float sc = f16_to_f32(scale[r * G + gi]), m = f16_to_f32(mn[r * G + gi]);
            for (int c0 = gi * g; c0 < (gi + 1) * g; c0 += 1024) {  /* runs of <= 1024 columns */
                int n = (gi + 1) * g - c0 < 1024 ? (gi + 1) * g - c0 : 1024;
                const uint8_t *qb = qr + c0 / 2;
                int j0 = 0;
#ifdef COLI_BF16
                if (bf16) {  /* 32 columns a step, the scalar loop's f32 operations; vcvtne2ps2bf16 rounds to
                              * nearest even like the loop below (no denormals: values are multiples of 2^-24) */
                    const __m512 vs = _mm512_set1_ps(sc), vm = _mm512_set1_ps(m);
                    const __m512i m4 = _mm512_set1_epi32(15);
                    const __m512i ilo = _mm512_set_epi32(23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
                    const __m512i ihi = _mm512_add_epi32(ilo, _mm512_set1_epi32(8));
                    uint16_t *o = (uint16_t *)out + r * K + c0;
                    for (; j0 + 16 <= n / 2; j0 += 16) {
                        __m512i v = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(qb + j0)));
                        __m512 lo = _mm512_add_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_and_si512(v, m4)), vs), vm);
                        __m512 hi = _mm512_add_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_srli_epi32(v, 4)), vs), vm);
                        __m512 a = _mm512_permutex2var_ps(lo, ilo, hi), b = _mm512_permutex2var_ps(lo, ihi, hi);  /* lo0 hi0 .. */
                        _mm512_storeu_si512((void *)(o + 2 * j0), (__m512i)_mm512_cvtne2ps_pbh(b, a));
                    }
                }
#endif
                for (int j = j0; j < n / 2; j++) {  /* vectorizable: no branches */
                    tmp[2 * j] = (float)(qb[j] & 15) * sc + m;
                    tmp[2 * j + 1] = (float)(qb[j] >> 4) * sc + m;
                }
                if (bf16) {
                    uint16_t *o = (uint16_t *)out + r * K + c0;
                    for (int j = 2 * j0; j < n; j++) {  /* round to nearest even (finite: scales are validated) */
                        uint32_t u;
                        memcpy(&u, tmp + j, 4);
                        o[j] = (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
                    }
                } else {
                    memcpy((float *)out + r * K + c0, tmp, sizeof(float) * n);
                }
            }
        }
    }
    return 0;
}
