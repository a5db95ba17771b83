/* KV cache rows in 8 and 4 bits (common.h's COLI_KV_Q8_0 / COLI_KV_Q4_0; the attention reads them in attn.c).
 * Why: at long contexts a decode step's attention is the cache's bytes; q8_0 halves them, q4_0 quarters them.
 * The arithmetic is spelled out for colibri/layers' Python quantizer to give the same bytes (tests/test_native_kv.py):
 * per block of 32 values x (f32), an f16 scale d rounded to nearest even, dq = (float)d, and
 *   q8_0: d = f16(min(amax / 127, 65504)), q = dq == 0 ? 0 : clamp(rint(x / dq), -127, 127), value q dq;
 *   q4_0: m = the first x of largest |x|, d = f16(clamp(m / -8, +-65504)),
 *         code = dq == 0 ? 8 : clamp(rint(x / dq) + 8, 0, 15), value (code - 8) dq.
 * (f32 divisions, rint half to even.) */
#include "common.h"
#include "attn.h"

static void q8_block(const float *x, uint8_t *scale, int8_t *q) {
    float amax = 0.f;
    for (int i = 0; i < 32; i++) amax = fabsf(x[i]) > amax ? fabsf(x[i]) : amax;
    float r = amax / 127.f;
    uint16_t h = f32_to_f16(r < 65504.f ? r : 65504.f);
    memcpy(scale, &h, 2);
    float dq = f16_to_f32(h);
    for (int i = 0; i < 32; i++) {
        float v = dq == 0.f ? 0.f : rintf(x[i] / dq);
        q[i] = (int8_t)(v < -127.f ? -127.f : v > 127.f ? 127.f : v);
    }
}

static void q4_block(const float *x, uint8_t *scale, uint8_t *q) {
    float m = 0.f;
    for (int i = 0; i < 32; i++)
        if (fabsf(x[i]) > fabsf(m)) m = x[i];
    float r = m / -8.f;
    uint16_t h = f32_to_f16(r < -65504.f ? -65504.f : r > 65504.f ? 65504.f : r);
    memcpy(scale, &h, 2);
    float dq = f16_to_f32(h);
    uint8_t c[32];
    for (int i = 0; i < 32; i++) {
        float v = dq == 0.f ? 8.f : rintf(x[i] / dq) + 8.f;
        c[i] = (uint8_t)(v < 0.f ? 0.f : v > 15.f ? 15.f : v);
    }
    for (int j = 0; j < 16; j++) q[j] = (uint8_t)(c[j] | c[j + 16] << 4);
}

/* rows of D values (x contiguous, bf16 or f32) to rows of `type` at out + r * out_stride bytes. Returns 0, or -3
 * (a type or width it cannot write). */
int coli_kv_quantize(const void *x, int bf16, long rows, int D, int type, uint8_t *out, long out_stride) {
    if ((type != COLI_KV_Q8_0 && type != COLI_KV_Q4_0) || D < 32 || D % 32) return -3;
    int nb = D / 32;
    float xf[32];
    for (long r = 0; r < rows; r++) {
        uint8_t *o = out + r * out_stride;
        for (int b = 0; b < nb; b++) {
            for (int i = 0; i < 32; i++) xf[i] = ld(x, bf16, r * D + 32L * b + i);
            if (type == COLI_KV_Q8_0) q8_block(xf, o + 2 * b, (int8_t *)o + 2 * nb + 32 * b);
            else q4_block(xf, o + 2 * b, o + 2 * nb + 16 * b);
        }
    }
    return 0;
}

/* ------------------------------------------------------------------- attention over quantized rows */

/* Numerics. Keys: the query head is quantized once to int8 blocks of 32 (qd = amax / 127 in f32, not rounded to
 * f16: it never leaves the call; q = clamp(rint(x / qd), +-127), 0 where qd is 0) and each block's dot product
 * with a key row's values (q8_0: q; q4_0: code - 8) is an exact integer isum_b; the score is
 * s = fma(isum_b, qd_b * dk_b, s) over the blocks in order, times scale. (llama.cpp's way: 64 values of a row are one
 * vpdpbusd, where widening them to f32 took 8 ops; integer sums are exact, so the portable loop gives the same bits.)
 * Values: of = fma(p_s * dv_b, value, of) over the positions in order, in f32 (the same bits either way too). */
int coli_kvq_portable = 0;

#ifndef KVQ_PF
#define KVQ_PF 32  /* rows fetched ahead: ~2 KiB of 68-byte q8_0 rows (D 64), as ATTN_PF's bf16 rows */
#endif

static void query_blocks(const float *qf, int D, int8_t *qq, float *qd) {
    for (int b = 0; b < D / 32; b++) {
        float amax = 0.f;
        for (int i = 0; i < 32; i++) amax = fabsf(qf[32 * b + i]) > amax ? fabsf(qf[32 * b + i]) : amax;
        float d = amax / 127.f;
        qd[b] = d;
        for (int i = 0; i < 32; i++) {
            float v = d == 0.f ? 0.f : rintf(qf[32 * b + i] / d);
            qq[32 * b + i] = (int8_t)(v < -127.f ? -127.f : v > 127.f ? 127.f : v);
        }
    }
}

static inline float f16_at(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, 2);
    return f16_to_f32(h);
}

/* One key row's score before the scale, the portable way. The integer dots are written unsigned key times signed
 * query, the offset taken back after: GCC 12.2 vectorizes a signed int8 dot product to vpdpbusd, which reads one
 * side unsigned (wrong sums, measured); the unsigned form is what that instruction computes. */
static float kq_dot(const uint8_t *row, int kt, int D, const int8_t *qq, const float *qd) {
    int nb = D / 32;
    const uint8_t *x = row + 2 * nb;
    float s = 0.f;
    for (int b = 0; b < nb; b++) {
        int32_t isum = 0, qsum = 0;
        const int8_t *q = qq + 32 * b;
        for (int i = 0; i < 32; i++) qsum += q[i];
        if (kt == COLI_KV_Q8_0) {
            for (int i = 0; i < 32; i++) isum += (uint8_t)(x[32 * b + i] ^ 0x80) * q[i];  /* (value + 128) q */
            isum -= 128 * qsum;
        } else {
            for (int i = 0; i < 16; i++) isum += (x[16 * b + i] & 15) * q[i] + (x[16 * b + i] >> 4) * q[i + 16];
            isum -= 8 * qsum;
        }
        s = fmaf((float)isum, qd[b] * f16_at(row + 2 * b), s);
    }
    return s;
}

#if defined(COLI_AVX512) && defined(__AVX512VNNI__)
/* One key row's chunk c (blocks 2c and 2c + 1; `two` 0: block 2c alone) times the query's chunk qv: lane l = the
 * 4 products of elements 64c + 4l.., exact. vpdpbusd wants unsigned keys: q8_0's + 128 (the sign bit flipped), q4_0's
 * codes as they are (unpacked in element order); corr = -128 or -8 times the query's lane sums takes that back. */
static inline __attribute__((always_inline)) __m512i kq_chunk(const uint8_t *x, int kt, int c, int two, __m512i qv,
                                                              __m512i corr) {
    __m512i k;
    if (kt == COLI_KV_Q8_0) {
        k = two ? _mm512_loadu_si512((const void *)(x + 64 * c)) : _mm512_maskz_loadu_epi8(0xFFFFFFFFull, x + 64 * c);
        k = _mm512_xor_si512(k, _mm512_set1_epi8((char)0x80));
    } else {
        __m256i y = two ? _mm256_loadu_si256((const __m256i *)(x + 32 * c)) : _mm256_maskz_loadu_epi8(0xFFFF, x + 32 * c);
        __m512i z = _mm512_castsi256_si512(y);
        z = _mm512_shuffle_i64x2(z, z, 0x50);  /* 128-bit parts: block 2c's bytes twice, then 2c + 1's */
        const __m512i sh = _mm512_set_epi64(0x0004000400040004LL, 0x0004000400040004LL, 0, 0,
                                            0x0004000400040004LL, 0x0004000400040004LL, 0, 0);
        k = _mm512_and_si512(_mm512_srlv_epi16(z, sh), _mm512_set1_epi8(0x0F));  /* low nibbles, then high */
    }
    return _mm512_dpbusd_epi32(corr, k, qv);
}

/* Scores of positions s1..s1+n (n <= 16) for one query: each chunk's 16 rows reduced to per-block sums together
 * (isum16_halves), their f16 scales gathered, the blocks' products added in order. */
static inline __attribute__((always_inline)) void kq_scores16(const uint8_t *kh, long rb, int kt, int nb,
                                                              const __m512i *qv, const __m512i *corr, const float *qd,
                                                              __m512i vidx, int s1, int n, float scale, float *sc,
                                                              __m512 *mxv) {
    const uint8_t *base = kh + (long)s1 * rb;
    __mmask16 m = n == 16 ? (__mmask16)0xffff : (__mmask16)((1u << n) - 1);
    __m512 acc = _mm512_setzero_ps();
    for (int c = 0; c < (nb + 1) / 2; c++) {
        int two = 2 * c + 1 < nb;
        __m512i r[16], b0, b1;
#pragma GCC unroll 16
        for (int i = 0; i < 16; i++)
            r[i] = i < n ? kq_chunk(base + i * rb + 2 * nb, kt, c, two, qv[c], corr[c]) : _mm512_setzero_si512();
        isum16_halves(r, &b0, &b1);
        __m512i g = _mm512_mask_i32gather_epi32(_mm512_setzero_si512(), m, vidx, base + 4 * c, 1);
        __m512 d0 = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(g));
        acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(b0), _mm512_mul_ps(_mm512_set1_ps(qd[2 * c]), d0), acc);
        if (two) {
            __m512 d1 = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_srli_epi32(g, 16)));
            acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(b1), _mm512_mul_ps(_mm512_set1_ps(qd[2 * c + 1]), d1), acc);
        }
    }
    __m512 sv = _mm512_mul_ps(acc, _mm512_set1_ps(scale));
    _mm512_mask_storeu_ps(sc + s1, m, sv);
    *mxv = _mm512_mask_max_ps(*mxv, m, *mxv, sv);
}

/* R queries over the same keys, each 16-position block in turn while it sits in L1. */
static inline __attribute__((always_inline)) void kq_scores(const uint8_t *kh, long rb, int kt, int D, int R,
                                                            int8_t (*qq)[KVQ_DMAX], float (*qd)[KVQ_DMAX / 32],
                                                            const int *S, float scale, float *const *sc, float *mx) {
    int nb = D / 32, Smax = 0;
    __m512i qv[KVQ_RB][KVQ_DMAX / 64], corr[KVQ_RB][KVQ_DMAX / 64];
    __m512 mxv[KVQ_RB];
    for (int r = 0; r < R; r++) {
        for (int c = 0; c < (nb + 1) / 2; c++) {
            qv[r][c] = _mm512_maskz_loadu_epi8(2 * c + 1 < nb ? ~0ull : 0xFFFFFFFFull, qq[r] + 64 * c);
            __m512i off = _mm512_set1_epi8(kt == COLI_KV_Q8_0 ? (char)0x80 : 8);
            corr[r][c] = _mm512_sub_epi32(_mm512_setzero_si512(),
                                          _mm512_dpbusd_epi32(_mm512_setzero_si512(), off, qv[r][c]));
        }
        mxv[r] = _mm512_set1_ps(mx[r]);
        Smax = S[r] > Smax ? S[r] : Smax;
    }
    __m512i vidx = _mm512_mullo_epi32(_mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0),
                                      _mm512_set1_epi32((int)rb));
    for (int s1 = 0; s1 < Smax; s1 += 16) {
        attn_prefetch((const char *)kh + (long)(s1 + KVQ_PF) * rb, 16 * rb);
        for (int r = 0; r < R; r++)
            if (s1 < S[r])
                kq_scores16(kh, rb, kt, nb, qv[r], corr[r], qd[r], vidx, s1, S[r] - s1 < 16 ? S[r] - s1 : 16, scale,
                            sc[r], &mxv[r]);
    }
    for (int r = 0; r < R; r++) mx[r] = _mm512_reduce_max_ps(mxv[r]);
}
#endif

void coli_kvq_scores(const uint8_t *kh, long rb, int kt, int D, int R, const float *const *qf, const int *S,
                     float scale, float *const *sc, float *mx) {
    int8_t qq[KVQ_RB][KVQ_DMAX] __attribute__((aligned(64)));
    float qd[KVQ_RB][KVQ_DMAX / 32];
    for (int r = 0; r < R; r++) query_blocks(qf[r], D, qq[r], qd[r]);
    attn_prefetch((const char *)kh, (S[0] < KVQ_PF ? S[0] : KVQ_PF) * rb);
#if defined(COLI_AVX512) && defined(__AVX512VNNI__)
    if (!coli_kvq_portable) {  /* (the type a constant in each copy) */
        if (kt == COLI_KV_Q8_0) kq_scores(kh, rb, COLI_KV_Q8_0, D, R, qq, qd, S, scale, sc, mx);
        else kq_scores(kh, rb, COLI_KV_Q4_0, D, R, qq, qd, S, scale, sc, mx);
        return;
    }
#endif
    for (int r = 0; r < R; r++)
        for (int s = 0; s < S[r]; s++) {
            sc[r][s] = kq_dot(kh + (long)s * rb, kt, D, qq[r], qd[r]) * scale;
            mx[r] = sc[r][s] > mx[r] ? sc[r][s] : mx[r];
        }
}

#ifdef COLI_AVX512
/* of[r][c0..c0 + 16 NA) of R rows (R, NA, vt constants after inlining; R NA <= 16 accumulators in registers), row r
 * over positions s < S[r]: per 16 positions each row's weights p_s dv_b of the chunk's blocks (the scales gathered
 * once; 0 past S[r]: its fmas then add exact zeros, the row's bits are its own call's), then per position each 16
 * values widened to f32 once (q4_0: codes to values by a 16-entry table) and added to every row's with one fma. */
static inline __attribute__((always_inline)) void kv_values_chunk(const uint8_t *vh, long rb, int vt, int nb, int R,
                                                                  const int *S, float *const *p, int c0, int NA,
                                                                  float *const *of) {
    __m512 acc[KVQ_RB][8];
    float w[KVQ_RB][4][16] __attribute__((aligned(64)));
    const __m512 tab = _mm512_set_ps(7, 6, 5, 4, 3, 2, 1, 0, -1, -2, -3, -4, -5, -6, -7, -8);
    __m512i vidx = _mm512_mullo_epi32(_mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0),
                                      _mm512_set1_epi32((int)rb));
    int b0 = c0 / 32, Smax = 0;
    for (int r = 0; r < R; r++) {
        for (int j = 0; j < NA; j++) acc[r][j] = _mm512_setzero_ps();
        Smax = S[r] > Smax ? S[r] : Smax;
    }
    for (int s1 = 0; s1 < Smax; s1 += 16) {
        int n = Smax - s1 < 16 ? Smax - s1 : 16;
        __mmask16 m = n == 16 ? (__mmask16)0xffff : (__mmask16)((1u << n) - 1);
        const uint8_t *base = vh + (long)s1 * rb;
        attn_prefetch((const char *)base + KVQ_PF * rb, 16 * rb);
        __m512 pv[KVQ_RB];
        for (int r = 0; r < R; r++) {
            int nr = S[r] - s1 < 0 ? 0 : S[r] - s1 < 16 ? S[r] - s1 : 16;
            pv[r] = _mm512_maskz_loadu_ps(nr == 16 ? (__mmask16)0xffff : (__mmask16)((1u << nr) - 1), p[r] + s1);
        }
        for (int b = 0; b < NA / 2; b += 2) {  /* a gathered dword holds blocks b0 + b and b0 + b + 1's scales */
            __m512i g = _mm512_mask_i32gather_epi32(_mm512_setzero_si512(), m, vidx, base + 2 * (b0 + b), 1);
            __m512 d0 = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(g));
            __m512 d1 = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_srli_epi32(g, 16)));
            for (int r = 0; r < R; r++) {
                _mm512_store_ps(w[r][b], _mm512_mul_ps(pv[r], d0));
                if (b + 1 < NA / 2) _mm512_store_ps(w[r][b + 1], _mm512_mul_ps(pv[r], d1));
            }
        }
        for (int i = 0; i < n; i++) {
            const uint8_t *x = base + i * rb + 2 * nb;
            for (int b = 0; b < NA / 2; b++) {
                __m512 lo, hi;
                if (vt == COLI_KV_Q8_0) {
                    lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(x + c0 + 32 * b))));
                    hi = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(x + c0 + 32 * b + 16))));
                } else {
                    __m512i c = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(x + 16 * (b0 + b))));
                    lo = _mm512_permutexvar_ps(c, tab);
                    hi = _mm512_permutexvar_ps(_mm512_srli_epi32(c, 4), tab);
                }
                for (int r = 0; r < R; r++) {
                    __m512 wv = _mm512_set1_ps(w[r][b][i]);
                    acc[r][2 * b] = _mm512_fmadd_ps(wv, lo, acc[r][2 * b]);
                    acc[r][2 * b + 1] = _mm512_fmadd_ps(wv, hi, acc[r][2 * b + 1]);
                }
            }
        }
    }
    for (int r = 0; r < R; r++)
        for (int j = 0; j < NA; j++) _mm512_storeu_ps(of[r] + c0 + 16 * j, acc[r][j]);
}

/* The copies: per type and chunk width one for a lone row (decode) and one for rows together. */
#define KV_VALUES_R(vt, R_, NA_) kv_values_chunk(vh, rb, vt, nb, R_, S + r0, p + r0, c0, NA_, of + r0)
#define KV_VALUES_NA(vt)                                                                           \
    switch (na) {                                                                                  \
    case 2: if (rp == 1) KV_VALUES_R(vt, 1, 2); else KV_VALUES_R(vt, KVQ_RB, 2); break;             \
    case 4: if (rp == 1) KV_VALUES_R(vt, 1, 4); else KV_VALUES_R(vt, KVQ_RB, 4); break;             \
    case 6: if (rp == 1) KV_VALUES_R(vt, 1, 6); else KV_VALUES_R(vt, 2, 6); break;                  \
    default: if (rp == 1) KV_VALUES_R(vt, 1, 8); else KV_VALUES_R(vt, 2, 8); break;                 \
    }
#endif

void coli_kvq_values(const uint8_t *vh, long rb, int vt, int Dv, int R, const int *S, float *const *p,
                     float *const *of) {
    int nb = Dv / 32;
    attn_prefetch((const char *)vh, (S[0] < KVQ_PF ? S[0] : KVQ_PF) * rb);
#ifdef COLI_AVX512
    if (!coli_kvq_portable) {
        /* rows past R: none (S 0, weights 0, a scratch output) */
        int Sp[2 * KVQ_RB] = {0};
        float *pp[2 * KVQ_RB], *op[2 * KVQ_RB], spare[KVQ_DMAX] __attribute__((aligned(64)));
        for (int r = 0; r < 2 * KVQ_RB; r++) {
            Sp[r] = r < R ? S[r] : 0;
            pp[r] = r < R ? p[r] : p[0];
            op[r] = r < R ? of[r] : spare;
        }
        S = Sp, p = pp, of = op;
        for (int c0 = 0; c0 < Dv; c0 += 128) {  /* 128 channels at a time: 8 accumulators a row */
            int na = (Dv - c0) / 16 < 8 ? (Dv - c0) / 16 : 8, rp = R == 1 ? 1 : na <= 4 ? KVQ_RB : 2;
            for (int r0 = 0; r0 < R; r0 += rp) {
                if (vt == COLI_KV_Q8_0) KV_VALUES_NA(COLI_KV_Q8_0)
                else KV_VALUES_NA(COLI_KV_Q4_0)
            }
        }
        return;
    }
#endif
    for (int r = 0; r < R; r++) {
        float *o = of[r];
        for (int d = 0; d < Dv; d++) o[d] = 0.f;
        for (int s = 0; s < S[r]; s++) {
            const uint8_t *row = vh + (long)s * rb, *x = row + 2 * nb;
            for (int b = 0; b < nb; b++) {
                float w = p[r][s] * f16_at(row + 2 * b), *ob = o + 32 * b;
                if (vt == COLI_KV_Q8_0)
                    for (int i = 0; i < 32; i++) ob[i] = fmaf(w, (float)(int8_t)x[32 * b + i], ob[i]);
                else
                    for (int i = 0; i < 16; i++) {
                        ob[i] = fmaf(w, (float)((x[16 * b + i] & 15) - 8), ob[i]);
                        ob[i + 16] = fmaf(w, (float)((x[16 * b + i] >> 4) - 8), ob[i + 16]);
                    }
            }
        }
    }
}
