/* Row kernels: one weight row applied to up to 8 activation rows at a time, and the activation
 * preparations they read, for int8 here and int4 in rows_q4.h (the layouts: colibri/quant.py). Shared by gemv.c and
 * moe.c.
 *
 *   int8: y[t, o] = scale[o] * sum_i x[t, i] * q[o, i]            q int8 [N, K], scale f32 [N]
 *   int4: y[t, o] = sum_g scale[o, g] * sum_{i in g} x[t, i] * q[o, i]  +  min[o, g] * sum_{i in g} x[t, i]
 *         q uint8 [N, K/2] (even column in the low nibble), scale/min f16 [N, K/g]
 *
 * Accumulation is f32. Each weight row is read from RAM once and applied to all the rows while it
 * sits in L1, so a batch of rows costs about what one row costs in memory traffic. */
#ifndef COLI_ROWS_H
#define COLI_ROWS_H
#include "common.h"

/* ------------------------------------------------------------------------------------ int8 */

/* Rows t0..t0+TB of y for output row o: the weight row is converted once per 16 values and
 * applied to TB activation rows held in TB accumulators (TB <= 8, a constant after inlining). */
static inline void q8_row_block(const float *xf, int K, const int8_t *qo, float so, int TB, float *out, int N) {
#ifdef COLI_AVX512
    __m512 acc[8];
    for (int t = 0; t < TB; t++) acc[t] = _mm512_setzero_ps();
    int i = 0;
    for (; i + 16 <= K; i += 16) {
        __m512 w = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(qo + i))));
        for (int t = 0; t < TB; t++) acc[t] = _mm512_fmadd_ps(w, _mm512_loadu_ps(xf + (long)t * K + i), acc[t]);
    }
    for (int t = 0; t < TB; t++) {
        float s = _mm512_reduce_add_ps(acc[t]);
        for (int j = i; j < K; j++) s += xf[(long)t * K + j] * (float)qo[j];
        out[(long)t * N] = so * s;
    }
#else
    for (int t = 0; t < TB; t++) {
        float s = 0.f;
        for (int j = 0; j < K; j++) s += xf[(long)t * K + j] * (float)qo[j];
        out[(long)t * N] = so * s;
    }
#endif
}

/* FN(TB, ...) with TB = tb (1..8) a constant, so the row kernels keep their accumulators in registers. */
#define TB_SWITCH(FN, tb, ...)                                                              \
    switch (tb) {                                                                           \
    case 1: FN(1, __VA_ARGS__); break; case 2: FN(2, __VA_ARGS__); break;                   \
    case 3: FN(3, __VA_ARGS__); break; case 4: FN(4, __VA_ARGS__); break;                   \
    case 5: FN(5, __VA_ARGS__); break; case 6: FN(6, __VA_ARGS__); break;                   \
    case 7: FN(7, __VA_ARGS__); break; default: FN(8, __VA_ARGS__); break;                  \
    }

#define ROW_BLOCKS(FN, T, ...)                                                              \
    for (int t0 = 0; t0 < (T); t0 += 8) {                                                   \
        int tb = (T) - t0 < 8 ? (T) - t0 : 8;                                               \
        TB_SWITCH(FN, tb, __VA_ARGS__)                                                      \
    }

/* Output rows per panel when many activation rows share a weight: each block of 8 activation rows
 * runs over a panel of weight rows (~16 KiB, in L1/L2) before the next block. Row by row instead,
 * every weight row re-read all activation rows (64 rows of 1024: ~100 KiB) from L2: prefill chunks
 * and large batches were L2-bound. The bits do not change (each output is the same row kernel). */
static inline int panel_rows(long row_bytes) { return row_bytes >= 16384 ? 1 : (int)(16384 / row_bytes); }

#define Q8_CALL(TB, xf, K, qo, so, yo, N) q8_row_block((xf) + (long)t0 * (K), K, qo, so, TB, (yo) + (long)t0 * (N), N)

static inline void q8_rows(const float *xf, int T, int K, const int8_t *q, const float *scale, int N,
                    int o0, int o1, float *yf) {
    for (int o = o0; o < o1; o++) {
        const int8_t *qo = q + (long)o * K;
        ROW_BLOCKS(Q8_CALL, T, xf, K, qo, scale[o], yf + o, N)
    }
}

/* int8 with activations quantized to int8 in blocks of 32 (bf16 compute only, see docs/QUANT.md), so
 * one vpdpbusd multiplies 64 weights by 64 activations in integers. The weights are signed and
 * vpdpbusd wants one unsigned side: w ^ 0x80 = w + 128, whose extra 128 * sum(xq) is subtracted once
 * per row (corr). A block is strided, not contiguous: per 512 columns ("span", 8 chunks of 64), lane l
 * (bytes 4l..4l+3 of each chunk) of every chunk, 32 columns. So a span's 8 products add up in int32
 * per lane and meet their 16 scales once (llama.cpp's contiguous Q8_0 blocks need a float convert and
 * multiply-add per 64 columns and row: at 8 rows those made the dense projections compute-bound).
 * A shorter last span (K % 512) has blocks of 4 x its chunks. A prepared row (Q8_STRIDE floats):
 * int8 xq [K] (column order) | f32 scale per span and lane [K/32] (room for K/4) | corr | padding that
 * keeps every row 64-byte aligned (rows 4 bytes apart straddled cache lines: 3x slower at 8 rows). */
#define Q8_STRIDE(K) ((long)(K) / 2 + 16)
#define Q8_SPAN 512
#if defined(COLI_AVX512) && defined(__AVX512VNNI__)
#define COLI_VNNI 1

/* One span of nc chunks (x: its first column) to int8 with its 16 lane scales; returns the span's
 * sum of 128 * scale * xq (the correction's share). */
static inline double q8_span(const float *x, int nc, int8_t *q, float *scale) {
    __m512 m[4];
    for (int j = 0; j < 4; j++) m[j] = _mm512_setzero_ps();
    for (int c = 0; c < nc; c++)
        for (int j = 0; j < 4; j++) m[j] = _mm512_max_ps(m[j], _mm512_abs_ps(_mm512_loadu_ps(x + 64 * c + 16 * j)));
    float am[64], inv[64];
    for (int j = 0; j < 4; j++) {  /* the max of each 4 neighbouring floats: one lane's share of a chunk */
        m[j] = _mm512_max_ps(m[j], _mm512_permute_ps(m[j], 0xB1));
        m[j] = _mm512_max_ps(m[j], _mm512_permute_ps(m[j], 0x4E));
        _mm512_storeu_ps(am + 16 * j, m[j]);
    }
    for (int l = 0; l < 16; l++) {
        float a = am[4 * l], iv = a > 0.f ? 127.f / a : 0.f;
        scale[l] = a / 127.f;
        for (int i = 0; i < 4; i++) inv[4 * l + i] = iv;
    }
    const __m512i lo = _mm512_set1_epi32(-127), hi = _mm512_set1_epi32(127);
    __m512i sum[4];
    for (int j = 0; j < 4; j++) sum[j] = _mm512_setzero_si512();
    for (int c = 0; c < nc; c++)
        for (int j = 0; j < 4; j++) {
            __m512i v = _mm512_cvt_roundps_epi32(_mm512_mul_ps(_mm512_loadu_ps(x + 64 * c + 16 * j),
                                                               _mm512_loadu_ps(inv + 16 * j)),
                                                 _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
            v = _mm512_min_epi32(_mm512_max_epi32(v, lo), hi);
            _mm_storeu_si128((__m128i *)(q + 64 * c + 16 * j), _mm512_cvtepi32_epi8(v));
            sum[j] = _mm512_add_epi32(sum[j], v);
        }
    int ss[64];
    for (int j = 0; j < 4; j++) _mm512_storeu_si512((void *)(ss + 16 * j), sum[j]);
    double corr = 0.0;
    for (int l = 0; l < 16; l++) corr += 128.0 * scale[l] * (ss[4 * l] + ss[4 * l + 1] + ss[4 * l + 2] + ss[4 * l + 3]);
    return corr;
}

static inline void q8_prep(const float *xf, int n, int K, float *xp) {
    for (int t = 0; t < n; t++) {
        const float *x = xf + (long)t * K;
        float *base = xp + (long)t * Q8_STRIDE(K);
        double corr = 0.0;
        for (int s0 = 0; s0 < K; s0 += Q8_SPAN) {
            int nc = (K - s0) / 64 < Q8_SPAN / 64 ? (K - s0) / 64 : Q8_SPAN / 64;
            corr += q8_span(x + s0, nc, (int8_t *)base + s0, base + K / 4 + s0 / 32);
        }
        base[K / 2] = (float)corr;
    }
}
#endif

/* Software prefetch of the int8 weight stream into L2, 16 KiB ahead: decode steps/s +6% (median of 5
 * interleaved runs, twice; 4 KiB into L1 was slower than none). */
#ifndef Q8_PREFETCH
#define Q8_PREFETCH 16384
#endif
#ifndef Q8_PREFETCH_HINT
#define Q8_PREFETCH_HINT _MM_HINT_T1
#endif

#ifdef COLI_VNNI
/* One 64-column chunk at column i into the named sums p0..p7 (rows t < TB: TB is a constant after
 * inlining, so the others vanish). Named variables, not an array: with p[8] GCC copied every sum to
 * another register around each chunk's products (16 vector moves a chunk at 8 rows), and a
 * [3072 x 1024] 8-row GEMV from L3 took 199 us instead of 176 (one thread; the same bits). */
#define Q8V_DP(t, i) p##t = _mm512_dpbusd_epi32(p##t, wu, _mm512_loadu_si512((const void *)(x##t + (i))))
#define Q8V_CHUNK(i)                                                                                  \
    do {                                                                                              \
        _mm_prefetch((const char *)(qo + (i) + Q8_PREFETCH), Q8_PREFETCH_HINT);                       \
        __m512i wu = _mm512_xor_si512(_mm512_loadu_si512((const void *)(qo + (i))), flip);           \
        Q8V_DP(0, i);                                                                                 \
        if (TB > 1) Q8V_DP(1, i);                                                                     \
        if (TB > 2) Q8V_DP(2, i);                                                                     \
        if (TB > 3) Q8V_DP(3, i);                                                                     \
        if (TB > 4) Q8V_DP(4, i);                                                                     \
        if (TB > 5) Q8V_DP(5, i);                                                                     \
        if (TB > 6) Q8V_DP(6, i);                                                                     \
        if (TB > 7) Q8V_DP(7, i);                                                                     \
    } while (0)

/* The 16 partial sums (acc[t], t < TB <= 8) of weight row qo with TB prepared rows; the output is
 * scale * (the sum of acc[t]'s lanes - row t's corr). */
static inline __attribute__((always_inline)) void q8v_row_acc(const float *xp, int K, const int8_t *qo, int TB,
                                                              __m512 *acc) {
    const __m512i flip = _mm512_set1_epi8((char)0x80);
    const long st = Q8_STRIDE(K);
    /* (rows past TB point at row 0: never read, and no pointer past the buffer) */
    const int8_t *x0 = (const int8_t *)xp, *x1 = (const int8_t *)(xp + (TB > 1) * st),
                 *x2 = (const int8_t *)(xp + (TB > 2) * 2 * st), *x3 = (const int8_t *)(xp + (TB > 3) * 3 * st),
                 *x4 = (const int8_t *)(xp + (TB > 4) * 4 * st), *x5 = (const int8_t *)(xp + (TB > 5) * 5 * st),
                 *x6 = (const int8_t *)(xp + (TB > 6) * 6 * st), *x7 = (const int8_t *)(xp + (TB > 7) * 7 * st);
#pragma GCC unroll 8
    for (int t = 0; t < TB; t++) acc[t] = _mm512_setzero_ps();
    for (int s0 = 0; s0 < K; s0 += Q8_SPAN) {
        __m512i p0 = _mm512_setzero_si512(), p1 = p0, p2 = p0, p3 = p0, p4 = p0, p5 = p0, p6 = p0, p7 = p0;
        if (TB > 4 && K - s0 >= Q8_SPAN) {  /* a whole span: its 8 chunks unrolled (at 1-3 rows 2-7% slower so) */
            Q8V_CHUNK(s0); Q8V_CHUNK(s0 + 64); Q8V_CHUNK(s0 + 128); Q8V_CHUNK(s0 + 192);
            Q8V_CHUNK(s0 + 256); Q8V_CHUNK(s0 + 320); Q8V_CHUNK(s0 + 384); Q8V_CHUNK(s0 + 448);
        } else {
            for (int i = s0, se = s0 + Q8_SPAN < K ? s0 + Q8_SPAN : K; i < se; i += 64) Q8V_CHUNK(i);
        }
        const __m512i p[8] = {p0, p1, p2, p3, p4, p5, p6, p7};
#pragma GCC unroll 8
        for (int t = 0; t < TB; t++)
            acc[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(p[t]), _mm512_loadu_ps(xp + t * st + K / 4 + s0 / 32), acc[t]);
    }
}
#undef Q8V_CHUNK
#undef Q8V_DP

/* Output rows o0..o1 of an int8 weight (q: its row 0) for TB prepared rows (xp; outputs out[t * N + o]):
 * for one or two rows the sums are reduced 16 at a time (hsum16) and scaled as one vector -- a
 * reduction per output row was ~8 vector ops against ~3 a 64-column chunk, most of a one-row GEMV's
 * overhead on 512-column rows (an expert's down projection); hot GEMVs: [3072 x 1024] one row 26.2 ->
 * 23.2 us, two rows 34.0 -> 31.2, [1024 x 512] one row 6.6 -> 5.7. (The loop over output rows is here,
 * not a dispatch per row: 8 rows 74.5 -> 66.7 us.) A sum's bits
 * do not depend on which others share its reduction (hsum16 adds each vector in hsum1's order). */
static inline __attribute__((always_inline)) void q8v_rows(const float *xp, int K, const int8_t *q, const float *scale,
                                                           long o0, long o1, int TB, float *out, long N) {
    __m512 sums[16];
    float sc[16], cr[16], res[16], corr[8];
    float *dst[16];
    int n = 0;
#pragma GCC unroll 8
    for (int t = 0; t < TB; t++) corr[t] = xp[(long)t * Q8_STRIDE(K) + K / 2];
    for (long o = o0; o < o1; o++) {
        __m512 acc[8];
        q8v_row_acc(xp, K, q + o * K, TB, acc);
        if (TB > 2) {  /* 4-8 rows: the products are the work (vpdpbusd-bound); buffering the sums cost more */
#pragma GCC unroll 8
            for (int t = 0; t < TB; t++) out[t * N + o] = scale[o] * (hsum1(acc[t]) - corr[t]);
            continue;
        }
#pragma GCC unroll 8
        for (int t = 0; t < TB; t++, n++) {
            sums[n] = acc[t];
            sc[n] = scale[o];
            cr[n] = corr[t];
            dst[n] = out + t * N + o;
        }
        if (n + TB > 16 || o + 1 == o1) {  /* full (the next row's would not fit), or the last row */
            for (int i = n; i < 16; i++) {  /* unused lanes: zeros, not stale values */
                sums[i] = _mm512_setzero_ps();
                sc[i] = cr[i] = 0.f;
            }
            _mm512_storeu_ps(res, _mm512_mul_ps(_mm512_loadu_ps(sc), _mm512_sub_ps(hsum16(sums), _mm512_loadu_ps(cr))));
            for (int i = 0; i < n; i++) *dst[i] = res[i];
            n = 0;
        }
    }
}

#define Q8V_OK(bf16, K) ((bf16) && (K) % 64 == 0)
#else
static inline void q8_prep(const float *xf, int n, int K, float *xp) {
    (void)xf; (void)n; (void)K; (void)xp;
}
static inline void q8v_rows(const float *xp, int K, const int8_t *q, const float *scale, long o0, long o1, int TB,
                            float *out, long N) {
    (void)xp; (void)K; (void)q; (void)scale; (void)o0; (void)o1; (void)TB; (void)out; (void)N;
}
#define Q8V_OK(bf16, K) 0
#endif

#define Q8V_ROWS(TB, xp, K, q, scale, o0, o1, y, N) \
    q8v_rows((xp) + (long)t0 * Q8_STRIDE(K), K, q, scale, o0, o1, TB, (y) + (long)t0 * (N), N)

#include "rows_q4.h"

#endif
