/* int4 row kernels: one int4 weight row applied to up to 8 activation rows at a time, and the
 * activation preparations they read (f32, bf16 or int8 blocks; the layout: colibri/quant.py).
 * Included by rows.h, whose comment states the sums. */
#ifndef COLI_ROWS_Q4_H
#define COLI_ROWS_Q4_H
#include "common.h"

/* One 32-value block of activations to int8 (round to nearest even, |q| <= 127) with its scale;
 * returns the sum of the int8 values. The vector and scalar forms give the same bits. */
static inline int q8_block(const float *x, int8_t *q, float *scale) {
#ifdef COLI_AVX512
    __m512 a = _mm512_loadu_ps(x), b = _mm512_loadu_ps(x + 16);
    float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(a), _mm512_abs_ps(b)));
    float sc = amax / 127.f, inv = amax > 0.f ? 127.f / amax : 0.f;
    const __m512 vi = _mm512_set1_ps(inv);
    const __m512i lo = _mm512_set1_epi32(-127), hi = _mm512_set1_epi32(127);
    __m512i qa = _mm512_cvt_roundps_epi32(_mm512_mul_ps(a, vi), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512i qb = _mm512_cvt_roundps_epi32(_mm512_mul_ps(b, vi), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    qa = _mm512_min_epi32(_mm512_max_epi32(qa, lo), hi);
    qb = _mm512_min_epi32(_mm512_max_epi32(qb, lo), hi);
    _mm_storeu_si128((__m128i *)q, _mm512_cvtepi32_epi8(qa));
    _mm_storeu_si128((__m128i *)(q + 16), _mm512_cvtepi32_epi8(qb));
    *scale = sc;
    return _mm512_reduce_add_epi32(_mm512_add_epi32(qa, qb));
#else
    float amax = 0.f;
    for (int i = 0; i < 32; i++) amax = fmaxf(amax, fabsf(x[i]));
    float sc = amax / 127.f, inv = amax > 0.f ? 127.f / amax : 0.f;
    int sum = 0;
    for (int i = 0; i < 32; i++) {
        int v = (int)nearbyintf(x[i] * inv);
        v = v > 127 ? 127 : (v < -127 ? -127 : v);
        q[i] = (int8_t)v;
        sum += v;
    }
    *scale = sc;
    return sum;
#endif
}


/* Columns of one 32-column block in nibble order: x[0], x[2], ..., x[30] then x[1], ..., x[31],
 * so that the low nibbles of 16 bytes meet the first 16 values and the high nibbles the rest. */
static inline void permute_x4(const float *x, int K, float *xp) {
    for (int b = 0; b < K; b += 32)
        for (int j = 0; j < 16; j++) {
            xp[b + j] = x[b + 2 * j];
            xp[b + 16 + j] = x[b + 2 * j + 1];
        }
}

#if defined(COLI_AVX512) && defined(__AVX512BF16__)
#define COLI_BF16 1
/* int4 with bf16 activations (xb, natural column order): a nibble n becomes the bf16 of 128 + n by
 * OR-ing it into the mantissa of 0x4300 (128.0), so one vdpbf16ps multiplies 32 weights by 32
 * activations exactly, pairs summed in f32. The extra 128 * sum(x) per group is folded into the
 * group's offset: scale * (acc - 128 xs) + min xs = scale * acc + (min - 128 scale) xs. */
static inline void q4_row_block_bf(const uint16_t *xb, const float *xs, int K, int G, int g, const uint8_t *qo,
                                   const uint16_t *so, const uint16_t *mo, int TB, float *out, int N) {
    __m512 acc[8], pg[8];
    float macc[8];
    const __m512i lo_m = _mm512_set1_epi32(0x0f), hi_m = _mm512_set1_epi32(0xf0);
    const __m512i bias = _mm512_set1_epi32(0x43004300);
    for (int t = 0; t < TB; t++) { acc[t] = _mm512_setzero_ps(); macc[t] = 0.f; }
    for (int gi = 0; gi < G; gi++) {
        const uint8_t *qg = qo + (long)gi * (g / 2);
        for (int t = 0; t < TB; t++) pg[t] = _mm512_setzero_ps();
        for (int b = 0; b < g / 32; b++) {
            __m512i v = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(qg + 16 * b)));
            __m512i w = _mm512_or_si512(_mm512_or_si512(_mm512_and_si512(v, lo_m),
                                                        _mm512_slli_epi32(_mm512_and_si512(v, hi_m), 12)), bias);
            long c = (long)gi * g + 32 * b;
            for (int t = 0; t < TB; t++)
                pg[t] = _mm512_dpbf16_ps(pg[t], (__m512bh)w, (__m512bh)_mm512_loadu_si512(xb + (long)t * K + c));
        }
        float scf = f16_to_f32(so[gi]);
        __m512 sc = _mm512_set1_ps(scf);
        float mn = f16_to_f32(mo[gi]) - 128.f * scf;
        for (int t = 0; t < TB; t++) {
            acc[t] = _mm512_fmadd_ps(sc, pg[t], acc[t]);
            macc[t] += mn * xs[(long)t * G + gi];
        }
    }
    for (int t = 0; t < TB; t++) out[(long)t * N] = _mm512_reduce_add_ps(acc[t]) + macc[t];
}
#endif

/* int4 with activations quantized per 32 neighbouring values (q8_block; bf16 compute only): the
 * nibbles are unsigned bytes, so vpdpbusd takes them as they are. Per 128 columns (64 weight bytes),
 * the low nibbles hold the even columns and the high nibbles the odd ones: the prepared rows keep
 * their int8 values in that order (64 even, then 64 odd), so one lane (4 bytes) of each product covers
 * 8 neighbouring columns -- within one activation block and one weight group (g >= 32). A lane is
 * scaled by its block's activation scale times its group's weight scale; the group offsets (min)
 * multiply the group sums of the quantized x.
 *
 * Prepared rows come in blocks of up to 8 (the rows one q4v_row_block call takes), interleaved per
 * 128-column chunk: the block's nb rows' 128 int8 values, then their 16 lane scales (f32), 192 * nb
 * bytes a chunk. Every activation operand of a chunk is then a constant offset from one pointer:
 * with each row at its own base, the 8-row kernel ran out of registers (address arithmetic and
 * spills were a third of its instructions). A block starting at row r sits at r * Q4V_ROW(K) floats. */
#define Q4V_ROW(K) ((long)(K) * 3 / 8)
#if defined(COLI_AVX512) && defined(__AVX512VNNI__)
#define COLI_Q4V 1
/* Rows t0..t1 of a run of n rows prepared as a whole (xf, xp, xs: the run's row 0): the layout of a row
 * depends on the run, so threads may share the rows of one run. */
static inline void q4v_prep_rows(const float *xf, int n, int t0, int t1, int K, int g, float *xp, float *xs) {
    int G = K / g;
    int8_t nat[128];
    float bsc[4];
    int bsum[4];
    for (int t = t0; t < t1; t++) {
        const float *x = xf + (long)t * K;
        int b0 = t & ~7, nb = n - b0 < 8 ? n - b0 : 8, r = t - b0;  /* the row's block, its size, its place */
        int8_t *blk = (int8_t *)(xp + (long)b0 * Q4V_ROW(K));
        float *gs = xs + (long)t * G;
        for (int gi = 0; gi < G; gi++) gs[gi] = 0.f;
        for (int c = 0; c < K; c += 128) {  /* quantize a chunk in column order, then evens first, odds next */
            int8_t *xq = blk + (long)(c / 128) * 192 * nb + 128 * r;
            float *lane = (float *)(blk + (long)(c / 128) * 192 * nb + 128 * nb) + 16 * r;
            for (int b = 0; b < 4; b++) {
                bsum[b] = q8_block(x + c + 32 * b, nat + 32 * b, &bsc[b]);
                for (int l = 0; l < 4; l++) lane[4 * b + l] = bsc[b];  /* 4 lanes of 8 columns */
            }
#if defined(__AVX512VBMI__)
            const __m512i ev = _mm512_set_epi8(126, 124, 122, 120, 118, 116, 114, 112, 110, 108, 106, 104, 102, 100,
                                               98, 96, 94, 92, 90, 88, 86, 84, 82, 80, 78, 76, 74, 72, 70, 68, 66,
                                               64, 62, 60, 58, 56, 54, 52, 50, 48, 46, 44, 42, 40, 38, 36, 34, 32,
                                               30, 28, 26, 24, 22, 20, 18, 16, 14, 12, 10, 8, 6, 4, 2, 0);
            const __m512i od = _mm512_add_epi8(ev, _mm512_set1_epi8(1));
            __m512i v0 = _mm512_loadu_si512((const void *)nat), v1 = _mm512_loadu_si512((const void *)(nat + 64));
            _mm512_storeu_si512((void *)xq, _mm512_permutex2var_epi8(v0, ev, v1));
            _mm512_storeu_si512((void *)(xq + 64), _mm512_permutex2var_epi8(v0, od, v1));
#else
            for (int o = 0; o < 128; o++) xq[(o & 1) * 64 + o / 2] = nat[o];
#endif
            /* Group sums of the quantized values (scale * integer block sums): min * sum then pairs with
             * scale * q . xq, so the row computes w . xq exactly (w = q * scale + min); exact sums would
             * leave the large q-part's quantization error uncancelled (int4's offsets are ~7.5 scales). */
            for (int b = 0; b < 4; b++) gs[(c + 32 * b) / g] += bsc[b] * (float)bsum[b];
        }
    }
}

static inline void q4v_prep(const float *xf, int n, int K, int g, float *xp, float *xs) {
    q4v_prep_rows(xf, n, 0, n, K, g, xp, xs);
}

/* Software prefetch distance of the int4 weight stream, bytes (~8 rows of 1024 columns): decode steps
 * stalled on the weight loads (perf: a third of the kernel's samples), the hardware prefetcher alone
 * falling behind; 4-8 KiB into L1 gave 12-18% more decode steps/s on the 0.44b model, 16 KiB into L2
 * (int8's choice) less. A prefetch past the end of the weights does not fault. */
#ifndef Q4_PREFETCH
#define Q4_PREFETCH 4096
#endif
/* Its per-row scales and offsets (2 * K/g f16 a row, two streams beside the weights) prefetched this many
 * rows ahead: their demand misses stalled each row's start (a [3072 x 1024] GEMV from RAM: 37-40 GB/s
 * without, 45-47 with; int4 decode steps/s +7% on the 0.44b model). */
#ifndef Q4_SPREFETCH
#define Q4_SPREFETCH 8
#endif
#ifndef Q4_PREFETCH_HINT
#define Q4_PREFETCH_HINT _MM_HINT_T0
#endif

/* One 128-column chunk (qc: its 64 weight bytes, xc: its block of TB prepared rows) with its weight
 * scale per lane (sw) into the rows' accumulators. */
static inline __attribute__((always_inline)) void q4v_chunk(const uint8_t *qc, const int8_t *xc, __m512 sw, int TB,
                                                            __m512 *acc, __m512i m4) {
    _mm_prefetch((const char *)(qc + Q4_PREFETCH), Q4_PREFETCH_HINT);
    __m512i v = _mm512_loadu_si512((const void *)qc);
    __m512i lo = _mm512_and_si512(v, m4), hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), m4);
#pragma GCC unroll 8
    for (int t = 0; t < TB; t++) {
        __m512i p = _mm512_dpbusd_epi32(_mm512_setzero_si512(), lo, _mm512_loadu_si512((const void *)(xc + 128 * t)));
        p = _mm512_dpbusd_epi32(p, hi, _mm512_loadu_si512((const void *)(xc + 128 * t + 64)));
        __m512 ls = _mm512_loadu_ps((const float *)(xc + 128 * TB) + 16 * t);
        acc[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(p), _mm512_mul_ps(ls, sw), acc[t]);
    }
}

static inline __attribute__((always_inline)) void q4v_row_acc(const float *xp, const float *xs, int K, int G, int g,
                                                              const uint8_t *qo, const uint16_t *so, const uint16_t *mo,
                                                              int TB, __m512 *acc) {
    const __m512i m4 = _mm512_set1_epi8(0x0f);
#if Q4_SPREFETCH
    _mm_prefetch((const char *)(so + Q4_SPREFETCH * G), Q4_PREFETCH_HINT);
    _mm_prefetch((const char *)(mo + Q4_SPREFETCH * G), Q4_PREFETCH_HINT);
#endif
    /* lane l of a 128-column chunk is in group 8l / g of the chunk's first (g a power of two >= 32) */
    const __m512i lane_g = g == 32 ? _mm512_set_epi32(3, 3, 3, 3, 2, 2, 2, 2, 1, 1, 1, 1, 0, 0, 0, 0)
                         : g == 64 ? _mm512_set_epi32(1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0)
                                   : _mm512_setzero_si512();
    /* (unrolled: with acc[t] indexed in a loop that stays a loop, acc lived on the stack and every
     * chunk stored all TB accumulators) */
#pragma GCC unroll 8
    for (int t = 0; t < TB; t++) {  /* start from the group offsets: sum_g min_g * xs_g, 16 groups at a time */
        __m512 mm = _mm512_setzero_ps();
        for (int gi = 0; gi < G; gi += 16) {
            __mmask16 k = G - gi >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (G - gi)) - 1);
            mm = _mm512_fmadd_ps(_mm512_cvtph_ps(_mm256_maskz_loadu_epi16(k, mo + gi)),
                                 _mm512_maskz_loadu_ps(k, xs + (long)t * G + gi), mm);
        }
        acc[t] = mm;
    }
    /* The chunks run in blocks of 16 weight groups (one f16 -> f32 convert of their scales); in a full
     * block of g = 32 / 64 the 4 / 8 chunks are unrolled so that each one's lane -> scale index is a
     * constant (counting the group per chunk cost a broadcast, an add and ~8 scalar ops a chunk, of ~11
     * vector ops: the kernel is compute-bound with its weights in cache). */
    const int8_t *xc = (const int8_t *)xp;  /* this chunk's block of prepared rows: 192 * TB bytes */
    const uint8_t *qc = qo;
    /* the first group of chunk j + 1 is that of chunk j plus 128 / g (g <= 64), or one more every g / 128 */
    const int every = g >= 128 ? g >> 7 : 1;
    const __m512i inc = _mm512_set1_epi32(g == 32 ? 4 : g == 64 ? 2 : 1);
    for (int gb = 0; gb < G; gb += 16) {
        int rem = G - gb, ng = rem >= 16 ? 16 : rem;
        __mmask16 k = (__mmask16)((1u << ng) - 1);
        const __m512 s16 = _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(k, so + gb));
        int nch = ng * g / 128;  /* chunks in this block (K % 128 == 0 and g | K: whole chunks) */
        if (TB == 1 && g == 64 && nch == 8) {
#pragma GCC unroll 8
            for (int j = 0; j < 8; j++, qc += 64, xc += 192)
                q4v_chunk(qc, xc, _mm512_permutexvar_ps(_mm512_add_epi32(lane_g, _mm512_set1_epi32(2 * j)), s16),
                          1, acc, m4);
        } else if (TB == 1 && g == 32 && nch == 4) {
#pragma GCC unroll 4
            for (int j = 0; j < 4; j++, qc += 64, xc += 192)
                q4v_chunk(qc, xc, _mm512_permutexvar_ps(_mm512_add_epi32(lane_g, _mm512_set1_epi32(4 * j)), s16),
                          1, acc, m4);
        } else {  /* (several rows: the index's cost is shared by their products) */
            __m512i idx = lane_g;
            for (int j = 0, n = 0; j < nch; j++, qc += 64, xc += 192 * TB) {
                q4v_chunk(qc, xc, _mm512_permutexvar_ps(idx, s16), TB, acc, m4);
                if (++n == every) {
                    n = 0;
                    idx = _mm512_add_epi32(idx, inc);
                }
            }
        }
    }
}

/* Rows t < TB of y for int4 output row o (qo, so, mo: its weights, scales, offsets). */
static inline __attribute__((always_inline)) void q4v_row_block(const float *xp, const float *xs, int K, int G, int g,
                                                                const uint8_t *qo, const uint16_t *so,
                                                                const uint16_t *mo, int TB, float *out, int N) {
    __m512 acc[8];
    q4v_row_acc(xp, xs, K, G, g, qo, so, mo, TB, acc);
#pragma GCC unroll 8
    for (int t = 0; t < TB; t++) out[(long)t * N] = hsum1(acc[t]);
}

/* Output rows o0..o1 of an int4 weight (q, s, m: its row 0) for one prepared activation row, a decode
 * step's case: the row kernel inlined in the loop, its constants hoisted. A call per row cost about as
 * much as a row of 1024 columns (moe_part and q4_part's own time: ~10% of an int4 decode step). */
static void q4v_rows1(const float *xp, const float *xs, int K, int G, int g, const uint8_t *q, const uint16_t *s,
                      const uint16_t *m, long o0, long o1, float *out) {
    long o = o0;
    for (; o + 16 <= o1; o += 16) {  /* 16 rows' sums reduced together, in hsum1's order (as q8v_rows) */
        __m512 acc[16];
        for (int r = 0; r < 16; r++)
            q4v_row_acc(xp, xs, K, G, g, q + (o + r) * (K / 2), s + (o + r) * G, m + (o + r) * G, 1, acc + r);
        _mm512_storeu_ps(out + o, hsum16(acc));
    }
    for (; o < o1; o++)
        q4v_row_block(xp, xs, K, G, g, q + o * (K / 2), s + o * G, m + o * G, 1, out + o, 1);
}
#endif

/* int4 activation modes: 0 f32 (nibble-ordered f32), 1 bf16 (vdpbf16ps), 2 int8 blocks (vpdpbusd, for
 * widths that are multiples of 128 and groups of 32, 64 or a multiple of 128) -- bf16 activations take
 * 2 or 1, their down-projection input too. */
#ifdef COLI_BF16
#ifdef COLI_Q4V
#define BF_MODE(bf16, K, g) ((bf16) ? ((K) % 128 == 0 && ((g) == 32 || (g) == 64 || (g) % 128 == 0) ? 2 : 1) : 0)
#else
#define BF_MODE(bf16, K, g) ((bf16) ? 1 : 0)
#endif
#else
#define BF_MODE(bf16, K, g) 0
#endif

/* Rows t0..t0+TB of y for int4 output row o: per group, sum_{i in g} q_i x_i accumulates in a
 * vector per row; the group's scale is applied once per group, its min through xs (the group
 * sums of x). Weight nibbles are decoded once per 32 values for all TB rows. xp is in nibble order. */
static inline void q4_row_block(const float *xp, const float *xs, int K, int G, int g, const uint8_t *qo,
                                const uint16_t *so, const uint16_t *mo, int TB, float *out, int N, int bfm) {
#ifdef COLI_Q4V
    if (bfm == 2) {
        q4v_row_block(xp, xs, K, G, g, qo, so, mo, TB, out, N);
        return;
    }
#endif
#ifdef COLI_BF16
    if (bfm) {
        q4_row_block_bf((const uint16_t *)xp, xs, K, G, g, qo, so, mo, TB, out, N);
        return;
    }
#else
    (void)bfm;
#endif
#ifdef COLI_AVX512
    __m512 acc[8], pg[8];
    float macc[8];
    const __m128i m = _mm_set1_epi8(0x0f);
    for (int t = 0; t < TB; t++) { acc[t] = _mm512_setzero_ps(); macc[t] = 0.f; }
    for (int gi = 0; gi < G; gi++) {
        const uint8_t *qg = qo + (long)gi * (g / 2);
        for (int t = 0; t < TB; t++) pg[t] = _mm512_setzero_ps();
        for (int b = 0; b < g / 32; b++) {
            __m128i v = _mm_loadu_si128((const __m128i *)(qg + 16 * b));
            __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(v, m)));
            __m512 hi = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(_mm_srli_epi16(v, 4), m)));
            long c = (long)gi * g + 32 * b;
            for (int t = 0; t < TB; t++) {
                pg[t] = _mm512_fmadd_ps(lo, _mm512_loadu_ps(xp + (long)t * K + c), pg[t]);
                pg[t] = _mm512_fmadd_ps(hi, _mm512_loadu_ps(xp + (long)t * K + c + 16), pg[t]);
            }
        }
        __m512 sc = _mm512_set1_ps(f16_to_f32(so[gi]));
        float mn = f16_to_f32(mo[gi]);
        for (int t = 0; t < TB; t++) {
            acc[t] = _mm512_fmadd_ps(sc, pg[t], acc[t]);
            macc[t] += mn * xs[(long)t * G + gi];
        }
    }
    for (int t = 0; t < TB; t++) out[(long)t * N] = _mm512_reduce_add_ps(acc[t]) + macc[t];
#else
    for (int t = 0; t < TB; t++) {
        float acc = 0.f;
        for (int gi = 0; gi < G; gi++) {
            float s = 0.f;
            const uint8_t *qg = qo + (long)gi * (g / 2);
            const float *xg = xp + (long)t * K + (long)gi * g;
            for (int b = 0; b < g / 32; b++)
                for (int j = 0; j < 16; j++) {
                    uint8_t v = qg[16 * b + j];
                    s += xg[32 * b + j] * (float)(v & 15) + xg[32 * b + 16 + j] * (float)(v >> 4);
                }
            acc += f16_to_f32(so[gi]) * s + f16_to_f32(mo[gi]) * xs[(long)t * G + gi];
        }
        out[(long)t * N] = acc;
    }
#endif
}

/* Activations prepared for the int4 kernels, n rows of K: with bfm, rounded to bf16 in natural order
 * (xp read as uint16); else f32 in nibble order. xs: per-group sums of exactly those values. */
static inline void int4_prep(const float *xf, int n, int K, int g, float *xp, float *xs, int bfm) {
#ifdef COLI_Q4V
    if (bfm == 2) {
        q4v_prep(xf, n, K, g, xp, xs);
        return;
    }
#endif
    int G = K / g;
    for (int t = 0; t < n; t++) {
        const float *x = xf + (long)t * K;
        if (bfm) {
            uint16_t *xb = (uint16_t *)xp + (long)t * K;
            for (int i = 0; i < K; i++) xb[i] = f32_to_bf16(x[i]);
            for (int gi = 0; gi < G; gi++) {
                float s = 0.f;
                for (int i = 0; i < g; i++) s += bf16_to_f32(xb[gi * g + i]);
                xs[(long)t * G + gi] = s;
            }
        } else {
            permute_x4(x, K, xp + (long)t * K);
            for (int gi = 0; gi < G; gi++) {
                float s = 0.f;
                for (int i = 0; i < g; i++) s += x[gi * g + i];
                xs[(long)t * G + gi] = s;
            }
        }
    }
}

/* Row r of prepared activations (a block's first row for bfm 2: see q4v_prep). */
static inline const float *xrow(const float *xp, int bfm, long r, int K) {
    return bfm == 1 ? (const float *)((const uint16_t *)xp + r * K) : bfm == 2 ? xp + r * Q4V_ROW(K) : xp + r * K;
}

/* Output rows o0..o1 of an int4 weight (q, s, m: its row 0) for TB (<= 8, a constant after inlining)
 * rows prepared from activation row t0 (outputs y[t * N + o]): the loop over output rows inside, one
 * dispatch on TB per panel (as q8v_rows; a switch per output row cost ~10% of an 8-row int8 GEMV). */
static inline __attribute__((always_inline)) void q4_rows(const float *xp, const float *xs, int K, int G, int g,
                                                          const uint8_t *q, const uint16_t *s, const uint16_t *m,
                                                          long o0, long o1, int TB, float *y, long N, int bfm, long t0) {
    const float *xb = xrow(xp, bfm, t0, K), *xsb = xs + t0 * G;
    for (long o = o0; o < o1; o++)
        q4_row_block(xb, xsb, K, G, g, q + o * (K / 2), s + o * G, m + o * G, TB, y + t0 * N + o, (int)N, bfm);
}

#define Q4_ROWS(TB, xp, xs, K, G, g, q, s, m, o0, o1, y, N, bfm) q4_rows(xp, xs, K, G, g, q, s, m, o0, o1, TB, y, N, bfm, t0)

#endif
