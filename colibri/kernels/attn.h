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

#ifdef COLI_AVX512
/* The integer form of hsum16's tree, stopped one level early: of 16 rows' int32 vectors r[i] (lanes 0-7 one block
 * of 32 values, lanes 8-15 the next), b0 lane i = the sum of r[i]'s lanes 0-7 and b1 lane i of its lanes 8-15.
 * (Integer sums: exact in any order.) */
static inline void isum16_halves(const __m512i *r, __m512i *b0, __m512i *b1) {
    __m512i c[8], e[4], h[2];
    for (int i = 0; i < 8; i++)  /* per 128 bits: [a0+a2, b0+b2, a1+a3, b1+b3] of r[2i], r[2i+1] */
        c[i] = _mm512_add_epi32(_mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]),
                                _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]));
    for (int i = 0; i < 4; i++) {  /* per 128 bits P: P's sums of r[4i..4i+3] */
        __m512 x = _mm512_castsi512_ps(c[2 * i]), y = _mm512_castsi512_ps(c[2 * i + 1]);
        e[i] = _mm512_add_epi32(_mm512_castps_si512(_mm512_shuffle_ps(x, y, 0x44)),
                                _mm512_castps_si512(_mm512_shuffle_ps(x, y, 0xEE)));
    }
    for (int i = 0; i < 2; i++)  /* [r 8i.. block 0 | r 8i.. block 1 | r 8i+4.. block 0 | r 8i+4.. block 1] */
        h[i] = _mm512_add_epi32(_mm512_shuffle_i32x4(e[2 * i], e[2 * i + 1], 0x88),
                                _mm512_shuffle_i32x4(e[2 * i], e[2 * i + 1], 0xDD));
    *b0 = _mm512_shuffle_i32x4(h[0], h[1], 0x88);
    *b1 = _mm512_shuffle_i32x4(h[0], h[1], 0xDD);
}
#endif

/* Quantized caches (kvq.c), for R <= KVQ_RB query rows over the same cache head: row r's scores sc[r][s] = scale
 * q_r.k_s over its S[r] key rows of type kt (kh: position 0's, rows rb bytes apart, D <= KVQ_DMAX), mx[r] raised to
 * their max; of[r][0..Dv) = sum_s p[r][s] v_s over value rows of type vt. A row's bits do not depend on the others.
 * coli_kvq_portable = 1 (tests) takes the portable loops on any build: the same bits. */
#define KVQ_DMAX 1024
#define KVQ_RB 4
void coli_kvq_scores(const uint8_t *kh, long rb, int kt, int D, int R, const float *const *qf, const int *S,
                     float scale, float *const *sc, float *mx);
void coli_kvq_values(const uint8_t *vh, long rb, int vt, int Dv, int R, const int *S, float *const *p,
                     float *const *of);
extern int coli_kvq_portable;

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
