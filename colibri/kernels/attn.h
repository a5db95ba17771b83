/* What the attention kernels share (attn.c: ordinary heads; mla.c: MLA's many heads over one latent "head"):
 * prefetching cache rows, scoring 16 positions, the softmax's exponentials, the output's division. */
#ifndef COLI_ATTN_H
#define COLI_ATTN_H
#include "common.h"

/* Keys and values are read row after row from the cache, which the step's weight stream has evicted:
 * perf put most of the attention's time on those loads (a head's rows are only a few KiB, too short
 * for the hardware prefetcher to ramp up). So each head starts by fetching its first ATTN_PF rows,
 * and each row fetches the one ATTN_PF positions ahead (8 ahead and no start: attention 78 us a
 * token of the 0.44b model at 64 positions; 16 and the start: 60). A prefetch past the cache's end
 * does not fault. */
#ifndef ATTN_PF
#define ATTN_PF 16
#endif
static inline void attn_prefetch(const char *p, long bytes) {
#ifdef COLI_AVX512
    for (long b = 0; b < bytes; b += 64) _mm_prefetch(p + b, _MM_HINT_T0);
#else
    (void)p; (void)bytes;
#endif
}

#if defined(COLI_AVX512) && defined(__AVX512BF16__)
/* Scores of positions s1..s1+n (n <= 16) for one bf16 query head qb against the bf16 keys at kb
 * (position 0's, rows D apart): one vdpbf16ps multiplies 32 pairs exactly (bf16 products fit f32) and
 * adds them in f32; the 16 positions' sums reduce together (hsum16). Per position that is ~5 vector
 * ops where converting to f32, multiply-adds and a reduction took ~18: attention at 4096 positions
 * ran at ~36 GB/s of ~48, compute-bound. Scaled scores go to sc[s1..], their max into *mxv. */
static inline __attribute__((always_inline)) void attn_scores16(const uint16_t *kb, const uint16_t *qb, int D,
                                                                int s1, int n, float scale, float *sc, __m512 *mxv) {
    __m512 r[16];
#pragma GCC unroll 16
    for (int i = 0; i < 16; i++) {
        __m512 acc = _mm512_setzero_ps();
        if (i < n) {
            long base = (long)(s1 + i) * D;
            attn_prefetch((const char *)(kb + base + (long)ATTN_PF * D), D * 2);
            for (int d = 0; d < D; d += 32)
                acc = _mm512_dpbf16_ps(acc, (__m512bh)_mm512_loadu_si512((const void *)(kb + base + d)),
                                       (__m512bh)_mm512_loadu_si512((const void *)(qb + d)));
        }
        r[i] = acc;
    }
    __mmask16 m = n == 16 ? (__mmask16)0xffff : (__mmask16)((1u << n) - 1);
    __m512 sv = _mm512_mul_ps(hsum16(r), _mm512_set1_ps(scale));
    _mm512_mask_storeu_ps(sc + s1, m, sv);
    *mxv = _mm512_mask_max_ps(*mxv, m, *mxv, sv);
}
#endif

/* sc[s] = exp(sc[s] - mx) for s < S; returns the softmax denominator (plus the sink's share). */
static inline float attn_exp(float *sc, int S, float mx, const float *sink) {
    float den = sink ? expf(*sink - mx) : 0.f;
    int s0 = 0;
#ifdef COLI_AVX512
    __m512 dv = _mm512_setzero_ps();  /* the denominator in 16 partial sums */
    for (; s0 < S; s0 += 16) {
        __mmask16 m = S - s0 >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (S - s0)) - 1);
        __m512 e = exp512_ps(_mm512_sub_ps(_mm512_maskz_loadu_ps(m, sc + s0), _mm512_set1_ps(mx)));
        _mm512_mask_storeu_ps(sc + s0, m, e);
        dv = _mm512_mask_add_ps(dv, m, dv, e);
    }
    den += _mm512_reduce_add_ps(dv);
#endif
    for (; s0 < S; s0++) {
        sc[s0] = expf(sc[s0] - mx);
        den += sc[s0];
    }
    return den;
}

/* out[h] = of / den, rounded once to the output's dtype. */
static inline void attn_out(const float *of, float den, void *out, int bf16, long h, int Dv) {
    int d0 = 0;
#ifdef COLI_AVX512
    if (bf16)  /* the same division and rounding as below, 16 at a time */
        for (; d0 + 16 <= Dv; d0 += 16)
            _mm256_storeu_si256((__m256i *)((uint16_t *)out + h * Dv + d0),
                                f32_to_bf16_16(_mm512_div_ps(_mm512_loadu_ps(of + d0), _mm512_set1_ps(den))));
#endif
    for (int d = d0; d < Dv; d++) {
        float o = of[d] / den;
        if (bf16) ((uint16_t *)out)[h * Dv + d] = f32_to_bf16(o);
        else ((float *)out)[h * Dv + d] = o;
    }
}

#endif
