/* Weight-only quantized GEMV/small-GEMM for decode on CPU, over colibri's canonical layouts
 * (colibri/quant.py): no repack, so a weight read from disk into a cache slot is usable as is.
 *
 *   int8: y[t, o] = scale[o] * sum_i x[t, i] * q[o, i]            q int8 [N, K], scale f32 [N]
 *   int4: y[t, o] = sum_g scale[o, g] * sum_{i in g} x[t, i] * q[o, i]  +  min[o, g] * sum_{i in g} x[t, i]
 *         q uint8 [N, K/2] (even column in the low nibble), scale/min f16 [N, K/g]
 *
 * Activations are f32 or bf16 (converted to f32 once per call); accumulation is f32; the output
 * has the activations' dtype (bf16 rounded to nearest even). Each weight row is read from RAM
 * once and applied to all T rows while it sits in L1, so a batch of T rows costs about what one
 * row costs. Output rows are split across the threads of pool.c (coli_set_threads). Built by
 * colibri/kernels/native.py.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <math.h>

/* pool.c */
typedef void (*coli_job)(void *arg, int id, int n);
void coli_parallel(coli_job fn, void *arg, int n);
int coli_get_threads(void);
#if defined(__AVX512F__) && defined(__AVX512BW__)
#include <immintrin.h>
#define COLI_AVX512 1
#endif

#define MAX_T 64          /* rows per call (decode batches); larger inputs go to a dense GEMM */
#define PAR_MIN_BYTES (256 * 1024) /* below this, one thread: a fork/join costs more than it saves */

static inline float bf16_to_f32(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static inline uint16_t f32_to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40); /* NaN stays NaN */
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

static inline float f16_to_f32(uint16_t h) {
#if defined(__F16C__)
    return _cvtsh_ss(h);
#else
    uint32_t s = (uint32_t)(h & 0x8000) << 16, e = (h >> 10) & 0x1f, m = h & 0x3ff, u;
    if (e == 0) {
        if (m == 0) { u = s; }
        else { e = 127 - 14; while (!(m & 0x400)) { m <<= 1; e--; } m &= 0x3ff; u = s | (e << 23) | (m << 13); }
    } else if (e == 31) { u = s | 0x7f800000u | (m << 13); }
    else { u = s | ((e + 112) << 23) | (m << 13); }
    float f;
    memcpy(&f, &u, 4);
    return f;
#endif
}

static void load_x(const void *x, int bf16, int T, int K, float *xf) {
    if (bf16) {
        const uint16_t *xb = (const uint16_t *)x;
        for (long i = 0; i < (long)T * K; i++) xf[i] = bf16_to_f32(xb[i]);
    } else {
        memcpy(xf, x, sizeof(float) * (size_t)T * K);
    }
}

static void store_y(const float *yf, int bf16, int T, int N, int o0, int o1, void *y) {
    for (int t = 0; t < T; t++)
        for (int o = o0; o < o1; o++) {
            if (bf16) ((uint16_t *)y)[(long)t * N + o] = f32_to_bf16(yf[(long)t * N + o]);
            else ((float *)y)[(long)t * N + o] = yf[(long)t * N + o];
        }
}

static int n_threads_for(long bytes) { return bytes >= PAR_MIN_BYTES ? coli_get_threads() : 1; }

static inline void split(long total, int id, int n, long *a, long *b) {
    *a = total * id / n;
    *b = total * (id + 1) / n;
}

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

#define ROW_BLOCKS(FN, T, ...)                                                              \
    for (int t0 = 0; t0 < (T); t0 += 8) {                                                   \
        int tb = (T) - t0 < 8 ? (T) - t0 : 8;                                               \
        switch (tb) {                                                                       \
        case 1: FN(1, __VA_ARGS__); break; case 2: FN(2, __VA_ARGS__); break;               \
        case 3: FN(3, __VA_ARGS__); break; case 4: FN(4, __VA_ARGS__); break;               \
        case 5: FN(5, __VA_ARGS__); break; case 6: FN(6, __VA_ARGS__); break;               \
        case 7: FN(7, __VA_ARGS__); break; default: FN(8, __VA_ARGS__); break;              \
        }                                                                                   \
    }

#define Q8_CALL(TB, xf, K, qo, so, yo, N) q8_row_block((xf) + (long)t0 * (K), K, qo, so, TB, (yo) + (long)t0 * (N), N)

static void q8_rows(const float *xf, int T, int K, const int8_t *q, const float *scale, int N,
                    int o0, int o1, float *yf) {
    for (int o = o0; o < o1; o++) {
        const int8_t *qo = q + (long)o * K;
        ROW_BLOCKS(Q8_CALL, T, xf, K, qo, scale[o], yf + o, N)
    }
}

/* int8 with activations quantized like llama.cpp's Q8_0 (bf16 compute only, see docs/QUANT.md): each
 * run of 32 values of a row gets a scale max|x| / 127 and int8 values, so one vpdpbusd multiplies 64
 * weights by 64 activations in integers. The weights are signed and vpdpbusd wants one unsigned
 * side: w ^ 0x80 = w + 128, whose extra 128 * sum(xq) per block is subtracted once per row (corr).
 * A prepared row (Q8_STRIDE floats): int8 xq [K] | f32 scale per 4-byte lane [K/4] | corr. */
#define Q8_STRIDE(K) ((long)(K) / 2 + 1)
#if defined(COLI_AVX512) && defined(__AVX512VNNI__)
#define COLI_VNNI 1
#endif

static void q8_prep(const float *xf, int n, int K, float *xp) {
    for (int t = 0; t < n; t++) {
        const float *x = xf + (long)t * K;
        float *base = xp + (long)t * Q8_STRIDE(K);
        int8_t *xq = (int8_t *)base;
        float *lane = base + K / 4;
        double corr = 0.0;
        for (int b = 0; b < K; b += 32) {
            float amax = 0.f;
            for (int i = b; i < b + 32; i++) amax = fmaxf(amax, fabsf(x[i]));
            float sc = amax / 127.f, inv = amax > 0.f ? 127.f / amax : 0.f;
            int sum = 0;
            for (int i = b; i < b + 32; i++) {
                int v = (int)nearbyintf(x[i] * inv);
                v = v > 127 ? 127 : (v < -127 ? -127 : v);
                xq[i] = (int8_t)v;
                sum += v;
            }
            for (int l = 0; l < 8; l++) lane[b / 4 + l] = sc;
            corr += 128.0 * sc * sum;
        }
        base[K / 2] = (float)corr;
    }
}

#ifdef COLI_VNNI
static inline void q8v_row_block(const float *xp, int K, const int8_t *qo, float so, int TB, float *out, int N) {
    __m512 acc[8];
    const __m512i flip = _mm512_set1_epi8((char)0x80);
    for (int t = 0; t < TB; t++) acc[t] = _mm512_setzero_ps();
    for (int i = 0; i < K; i += 64) {
        __m512i wu = _mm512_xor_si512(_mm512_loadu_si512((const void *)(qo + i)), flip);
        for (int t = 0; t < TB; t++) {
            const float *b = xp + (long)t * Q8_STRIDE(K);
            __m512i p = _mm512_dpbusd_epi32(_mm512_setzero_si512(), wu, _mm512_loadu_si512((const void *)((const int8_t *)b + i)));
            acc[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(p), _mm512_loadu_ps(b + K / 4 + i / 4), acc[t]);
        }
    }
    for (int t = 0; t < TB; t++)
        out[(long)t * N] = so * (_mm512_reduce_add_ps(acc[t]) - xp[(long)t * Q8_STRIDE(K) + K / 2]);
}
#define Q8V_OK(bf16, K) ((bf16) && (K) % 64 == 0)
#else
static inline void q8v_row_block(const float *xp, int K, const int8_t *qo, float so, int TB, float *out, int N) {
    (void)xp; (void)K; (void)qo; (void)so; (void)TB; (void)out; (void)N;
}
#define Q8V_OK(bf16, K) 0
#endif

#define Q8V_CALL(TB, xp, K, qo, so, yo, N) \
    q8v_row_block((xp) + (long)t0 * Q8_STRIDE(K), K, qo, so, TB, (yo) + (long)t0 * (N), N)

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

static void q8_part(void *p, int id, int n) {
    q8_job *j = (q8_job *)p;
    long o0, o1;
    split(j->N, id, n, &o0, &o1);
    if (j->vm) {
        for (long o = o0; o < o1; o++) {
            const int8_t *qo = j->q + o * j->K;
            ROW_BLOCKS(Q8V_CALL, j->T, j->xf, j->K, qo, j->scale[o], j->yf + o, j->N)
        }
    } else {
        q8_rows(j->xf, j->T, j->K, j->q, j->scale, j->N, (int)o0, (int)o1, j->yf);
    }
    store_y(j->yf, j->bf16, j->T, j->N, (int)o0, (int)o1, j->y);
}

/* x [T, K] (f32, or bf16 when bf16 != 0), y [T, N] same dtype. Returns 0, or -1 if T is too large. */
int coli_q8_gemm(const void *x, int bf16, int T, int K, const int8_t *q, const float *scale, int N, void *y) {
    if (T < 1 || T > MAX_T) return -1;
    int vm = Q8V_OK(bf16, K);
    float *xf = (float *)malloc(sizeof(float) * ((size_t)T * K + (size_t)T * N + (size_t)T * Q8_STRIDE(K)));
    if (!xf) return -2;
    float *yf = xf + (size_t)T * K, *xv = yf + (size_t)T * N;
    load_x(x, bf16, T, K, xf);
    if (vm) q8_prep(xf, T, K, xv);
    q8_job j = {vm ? xv : xf, T, K, q, scale, N, yf, bf16, y, vm};
    coli_parallel(q8_part, &j, n_threads_for((long)N * K));
    free(xf);
    return 0;
}

/* ------------------------------------------------------------------------------------ int4 */

/* Columns of one 32-column block in nibble order: x[0], x[2], ..., x[30] then x[1], ..., x[31],
 * so that the low nibbles of 16 bytes meet the first 16 values and the high nibbles the rest. */
static void permute_x4(const float *x, int K, float *xp) {
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

/* int4 with activations quantized per 32 values (like int8's VNNI path; bf16 compute only): the
 * nibbles are unsigned bytes, so vpdpbusd takes them as they are. Per 128 columns (64 weight bytes),
 * the low nibbles hold the even columns and the high nibbles the odd ones: the prepared row keeps
 * its int8 values in that order (64 even, then 64 odd), so one lane (4 bytes) of each product covers
 * 8 neighbouring columns -- within one activation block and one weight group (g >= 32). A lane is
 * scaled by its block's activation scale times its group's weight scale; the group offsets (min)
 * multiply the group sums of the quantized x. Prepared row: xq [K] int8 | lane scales [K/8] f32. */
#if defined(COLI_AVX512) && defined(__AVX512VNNI__)
#define COLI_Q4V 1
static void q4v_prep(const float *xf, int n, int K, int g, float *xp, float *xs) {
    int G = K / g;
    for (int t = 0; t < n; t++) {
        const float *x = xf + (long)t * K;
        float *base = xp + (long)t * K;
        int8_t *xq = (int8_t *)base;
        float *lane = base + K / 4;
        for (int b = 0; b < K; b += 32) {
            float amax = 0.f;
            for (int i = b; i < b + 32; i++) amax = fmaxf(amax, fabsf(x[i]));
            float sc = amax / 127.f, inv = amax > 0.f ? 127.f / amax : 0.f;
            for (int i = b; i < b + 32; i++) {
                int v = (int)nearbyintf(x[i] * inv);
                v = v > 127 ? 127 : (v < -127 ? -127 : v);
                int c = i & ~127, o = i & 127;  /* chunk start, offset: evens first, then odds */
                xq[c + (o & 1) * 64 + o / 2] = (int8_t)v;
            }
            for (int l = 0; l < 4; l++) lane[b / 8 + l] = sc;  /* 4 lanes of 8 columns per block */
        }
        /* Group sums of the quantized values: min * sum then pairs with scale * q . xq, so the row
         * computes w . xq exactly (w = q * scale + min); exact sums would leave the large q-part's
         * quantization error uncancelled (int4's offsets are ~7.5 scales). */
        for (int gi = 0; gi < G; gi++) {
            float s = 0.f;
            for (int i = gi * g; i < (gi + 1) * g; i++) {
                int c = i & ~127, o = i & 127;
                s += (float)xq[c + (o & 1) * 64 + o / 2] * lane[i / 8];
            }
            xs[(long)t * G + gi] = s;
        }
    }
}

static inline void q4v_row_block(const float *xp, const float *xs, int K, int G, int g, const uint8_t *qo,
                                 const uint16_t *so, const uint16_t *mo, int TB, float *out, int N) {
    __m512 acc[8];
    float macc[8];
    const __m512i m4 = _mm512_set1_epi8(0x0f);
    /* lane l of a 128-column chunk is in group 8l / g of the chunk's first (g a power of two >= 32) */
    __m512i idx = g == 32 ? _mm512_set_epi32(3, 3, 3, 3, 2, 2, 2, 2, 1, 1, 1, 1, 0, 0, 0, 0)
                          : _mm512_set_epi32(1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0);
    int per = g < 128 ? 128 / g : 1;
    for (int t = 0; t < TB; t++) {  /* the group offsets: sum_g min_g * xs_g, 16 groups at a time */
        acc[t] = _mm512_setzero_ps();
        __m512 mm = _mm512_setzero_ps();
        for (int gi = 0; gi < G; gi += 16) {
            __mmask16 k = G - gi >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (G - gi)) - 1);
            mm = _mm512_fmadd_ps(_mm512_cvtph_ps(_mm256_maskz_loadu_epi16(k, mo + gi)),
                                 _mm512_maskz_loadu_ps(k, xs + (long)t * G + gi), mm);
        }
        macc[t] = _mm512_reduce_add_ps(mm);
    }
    for (int c = 0; c < K; c += 128) {
        __m512i v = _mm512_loadu_si512((const void *)(qo + c / 2));
        __m512i lo = _mm512_and_si512(v, m4), hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), m4);
        __m512 sw;
        if (g >= 128) sw = _mm512_set1_ps(f16_to_f32(so[c / g]));
        else sw = _mm512_permutexvar_ps(idx, _mm512_cvtph_ps(_mm256_maskz_loadu_epi16((__mmask16)((1u << per) - 1),
                                                                                       so + c / g)));
        for (int t = 0; t < TB; t++) {
            const int8_t *xq = (const int8_t *)(xp + (long)t * K) + c;
            __m512i p = _mm512_dpbusd_epi32(_mm512_setzero_si512(), lo, _mm512_loadu_si512((const void *)xq));
            p = _mm512_dpbusd_epi32(p, hi, _mm512_loadu_si512((const void *)(xq + 64)));
            __m512 ls = _mm512_loadu_ps(xp + (long)t * K + K / 4 + c / 8);
            acc[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(p), _mm512_mul_ps(ls, sw), acc[t]);
        }
    }
    for (int t = 0; t < TB; t++) out[(long)t * N] = _mm512_reduce_add_ps(acc[t]) + macc[t];
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
static void int4_prep(const float *xf, int n, int K, int g, float *xp, float *xs, int bfm) {
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

static inline const float *xrow(const float *xp, int bfm, long r, int K) {
    return bfm == 1 ? (const float *)((const uint16_t *)xp + r * K) : xp + r * K;
}

#define Q4_CALL(TB, xp, xs, K, G, g, qo, so, mo, yo, N, bfm) \
    q4_row_block(xrow(xp, bfm, t0, K), (xs) + (long)t0 * (G), K, G, g, qo, so, mo, TB, (yo) + (long)t0 * (N), N, bfm)

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

static void q4_part(void *p, int id, int n) {
    q4_job *j = (q4_job *)p;
    long o0, o1;
    int K = j->K, G = j->G, g = j->g, N = j->N, bfm = j->bfm;
    split(N, id, n, &o0, &o1);
    for (long o = o0; o < o1; o++) {
        const uint8_t *qo = j->q + o * (K / 2);
        const uint16_t *so = j->scale + o * G, *mo = j->mn + o * G;
        const float *xp = j->xp, *xs = j->xs;
        float *yf = j->yf;
        ROW_BLOCKS(Q4_CALL, j->T, xp, xs, K, G, g, qo, so, mo, yf + o, N, bfm)
    }
    store_y(j->yf, j->bf16, j->T, N, (int)o0, (int)o1, j->y);
}

/* x [T, K], q uint8 [N, K/2], scale/min f16 [N, K/g]; K % 32 == 0 and g % 32 == 0. */
int coli_q4_gemm(const void *x, int bf16, int T, int K, const uint8_t *q, const uint16_t *scale,
                 const uint16_t *mn, int g, int N, void *y) {
    if (T < 1 || T > MAX_T) return -1;
    if (K % 32 || g % 32 || K % g) return -3;
    int G = K / g;
    size_t nx = (size_t)T * K;
    float *buf = (float *)malloc(sizeof(float) * (2 * nx + (size_t)T * G + (size_t)T * N));
    if (!buf) return -2;
    float *xf = buf, *xp = buf + nx, *xs = xp + nx, *yf = xs + (size_t)T * G;
    load_x(x, bf16, T, K, xf);
    int bfm = BF_MODE(bf16, K, g);
    int4_prep(xf, T, K, g, xp, xs, bfm);
    q4_job j = {xp, xs, T, K, G, g, q, scale, mn, N, yf, bf16, bfm, y};
    coli_parallel(q4_part, &j, n_threads_for((long)N * K / 2));
    free(buf);
    return 0;
}

int coli_max_rows(void) { return MAX_T; }

/* ------------------------------------------------------------------------ one MoE layer, fused */

/* A quantized weight as the MoE kernel sees it: int8 (q int8 [N, K], s f32 [N]) or int4 (q uint8
 * [N, K/2], s and m f16 [N, K/g]). */
typedef struct {
    const void *q, *s, *m;
} coli_qw;

/* Rows r0..r0+n of a [*, K] activation buffer (xf; for int4 also xp, xs) through output row o of w:
 * results to out[(r0 + t) * ldo], t < n, in blocks of 8 sharing one pass over the weight row. */
static void rows_through(int scheme, const coli_qw *w, int K, int g, int o, const float *xf, const float *xp,
                         const float *xs, int r0, int n, float *out, int ldo, int bfm) {
    int G = scheme == 4 ? K / g : 0;
    for (int t0 = r0; t0 < r0 + n; t0 += 8) {
        int tb = r0 + n - t0 < 8 ? r0 + n - t0 : 8;
        float *yo = out + (long)t0 * ldo + o;
        if (scheme == 8 && bfm) {  /* xp holds q8_prep rows */
            const int8_t *qo = (const int8_t *)w->q + (long)o * K;
            float so = ((const float *)w->s)[o];
            const float *xb = xp + (long)t0 * Q8_STRIDE(K);
            switch (tb) {
            case 1: q8v_row_block(xb, K, qo, so, 1, yo, ldo); break;
            case 2: q8v_row_block(xb, K, qo, so, 2, yo, ldo); break;
            case 3: q8v_row_block(xb, K, qo, so, 3, yo, ldo); break;
            case 4: q8v_row_block(xb, K, qo, so, 4, yo, ldo); break;
            case 5: q8v_row_block(xb, K, qo, so, 5, yo, ldo); break;
            case 6: q8v_row_block(xb, K, qo, so, 6, yo, ldo); break;
            case 7: q8v_row_block(xb, K, qo, so, 7, yo, ldo); break;
            default: q8v_row_block(xb, K, qo, so, 8, yo, ldo); break;
            }
        } else if (scheme == 8) {
            const int8_t *qo = (const int8_t *)w->q + (long)o * K;
            float so = ((const float *)w->s)[o];
            switch (tb) {
            case 1: q8_row_block(xf + (long)t0 * K, K, qo, so, 1, yo, ldo); break;
            case 2: q8_row_block(xf + (long)t0 * K, K, qo, so, 2, yo, ldo); break;
            case 3: q8_row_block(xf + (long)t0 * K, K, qo, so, 3, yo, ldo); break;
            case 4: q8_row_block(xf + (long)t0 * K, K, qo, so, 4, yo, ldo); break;
            default: for (int t = 0; t < tb; t++) q8_row_block(xf + (long)(t0 + t) * K, K, qo, so, 1, yo + (long)t * ldo, ldo);
            }
        } else {
            const uint8_t *qo = (const uint8_t *)w->q + (long)o * (K / 2);
            const uint16_t *so = (const uint16_t *)w->s + (long)o * G, *mo = (const uint16_t *)w->m + (long)o * G;
            switch (tb) {
            case 1: q4_row_block(xrow(xp, bfm, t0, K), xs + (long)t0 * G, K, G, g, qo, so, mo, 1, yo, ldo, bfm); break;
            case 2: q4_row_block(xrow(xp, bfm, t0, K), xs + (long)t0 * G, K, G, g, qo, so, mo, 2, yo, ldo, bfm); break;
            case 3: q4_row_block(xrow(xp, bfm, t0, K), xs + (long)t0 * G, K, G, g, qo, so, mo, 3, yo, ldo, bfm); break;
            case 4: q4_row_block(xrow(xp, bfm, t0, K), xs + (long)t0 * G, K, G, g, qo, so, mo, 4, yo, ldo, bfm); break;
            default:
                for (int t = 0; t < tb; t++)
                    q4_row_block(xrow(xp, bfm, t0 + t, K), xs + (long)(t0 + t) * G, K, G, g, qo, so, mo, 1,
                                 yo + (long)t * ldo, ldo, bfm);
            }
        }
    }
}

typedef struct {
    int scheme, g, K, N, nu;  /* N output rows per expert, K inputs */
    const int *uexp, *uoff;
    const coli_qw *w;
    const float *xf, *xp, *xs;
    float *out;
    int bfm;
} moe_job;

/* Rows (u, o) of all experts u of the call, flattened and split evenly between the threads. */
static void moe_part(void *p, int id, int n) {
    moe_job *j = (moe_job *)p;
    long r0, r1;
    split((long)j->nu * j->N, id, n, &r0, &r1);
    for (long r = r0; r < r1; r++) {
        int u = (int)(r / j->N), o = (int)(r % j->N);
        rows_through(j->scheme, j->w + j->uexp[u], j->K, j->g, o, j->xf, j->xp, j->xs, j->uoff[u],
                     j->uoff[u + 1] - j->uoff[u], j->out, j->N, j->bfm);
    }
}

static inline float silu(float v) { return v / (1.f + expf(-v)); }

/* The routed experts of one layer, SiLU-GLU: for every slot p = t*k + j whose expert e = idx[p] has
 * weights in the tables (gate_up[e]: [2I, H], gate rows first; down[e]: [H, I]; `scheme` 8 or 4,
 * group g), ys[p] (f32 [H]) = down_e(silu(gate_e(x_t)) * up_e(x_t)); other slots are left alone, so a
 * caller may pass the experts of a layer in several calls as they arrive. Then, if y is not NULL,
 * y[t] = sum_j weights[t, j] * ys[t*k + j] in slot order (the same sum whatever else is in the
 * batch), in x's dtype. Slots are sorted by expert so each weight row is read once for all its
 * slots; output rows of all experts are split across threads in one parallel region.
 * Returns 0, -2 (out of memory), -3 (bad shape), -4 (bad expert id). */
int coli_moe(const void *x, int bf16, int T, int H, int I, int k, const int64_t *idx, const float *weights,
             int n_experts, const coli_qw *gate_up, const coli_qw *down, int scheme, int g, float *ys, void *y) {
    if (scheme == 4 && (H % 32 || I % 32 || g % 32 || H % g || I % g)) return -3;
    int P = T * k, nu = 0, Q = 0;
    int *count = (int *)calloc((size_t)n_experts + 1, sizeof(int));
    int *order = (int *)malloc(sizeof(int) * ((size_t)P + 1));  /* sorted row -> slot */
    int *uexp = (int *)malloc(sizeof(int) * ((size_t)P + 1)), *uoff = (int *)malloc(sizeof(int) * ((size_t)P + 1));
    float *buf = NULL;
    int rc = 0;
    if (!count || !order || !uexp || !uoff) { rc = -2; goto done; }
    for (int p = 0; p < P; p++) {
        if (idx[p] < 0 || idx[p] >= n_experts) { rc = -4; goto done; }
        if (gate_up[idx[p]].q) { count[idx[p] + 1]++; Q++; }
    }
    for (int e = 0; e < n_experts; e++) count[e + 1] += count[e];
    for (int p = 0; p < P; p++)  /* stable counting sort of the present slots by expert */
        if (gate_up[idx[p]].q) order[count[idx[p]]++] = p;
    for (int r = 0; r < Q; r++) {
        int e = (int)idx[order[r]];
        if (r == 0 || e != uexp[nu - 1]) { uexp[nu] = e; uoff[nu++] = r; }
    }
    uoff[nu] = Q;
    size_t nf = (size_t)T * H + (size_t)Q * H + (size_t)Q * 2 * I + (size_t)Q * I + (size_t)Q * H;
    /* prepared activations (int4: nibble-ordered or bf16 copies + group sums; int8 in bf16: q8_prep) */
    size_t nxp = (size_t)Q * H, nxs = scheme == 4 ? (size_t)Q * H / g : 0;
    size_t nap = (size_t)Q * I, nas = scheme == 4 ? (size_t)Q * I / g : 0;
    size_t n4 = nxp + nxs + nap + nas;
    buf = (float *)malloc(sizeof(float) * (nf + n4 + 1));
    if (!buf) { rc = -2; goto done; }
    float *xf = buf, *xsrt = xf + (size_t)T * H, *hgu = xsrt + (size_t)Q * H, *act = hgu + (size_t)Q * 2 * I;
    float *ysrt = act + (size_t)Q * I;
    float *xp = ysrt + (size_t)Q * H, *xsum = xp + nxp, *ap = xsum + nxs, *asum = ap + nap;
    load_x(x, bf16, T, H, xf);
    for (int r = 0; r < Q; r++) memcpy(xsrt + (long)r * H, xf + (long)(order[r] / k) * H, sizeof(float) * H);
    int bfm = scheme == 4 ? (BF_MODE(bf16, H, g) < BF_MODE(bf16, I, g) ? BF_MODE(bf16, H, g) : BF_MODE(bf16, I, g))
                          : (Q8V_OK(bf16, H) && Q8V_OK(bf16, I));
    if (scheme == 4) int4_prep(xsrt, Q, H, g, xp, xsum, bfm);
    else if (bfm) q8_prep(xsrt, Q, H, xp);

    long bytes = (long)nu * 3 * H * I * (scheme == 4 ? 1 : 2) / 2;
    int nt = n_threads_for(bytes);
    /* gate+up: rows (u, o) for o < 2I, flattened so the threads split all experts' rows evenly */
    moe_job j1 = {scheme, g, H, 2 * I, nu, uexp, uoff, gate_up, xsrt, xp, xsum, hgu, bfm};
    coli_parallel(moe_part, &j1, nt);
    for (long r = 0; r < (long)Q; r++)
        for (int i = 0; i < I; i++) act[r * I + i] = silu(hgu[r * 2 * I + i]) * hgu[r * 2 * I + I + i];
    if (scheme == 4) int4_prep(act, Q, I, g, ap, asum, bfm);
    else if (bfm) q8_prep(act, Q, I, ap);
    moe_job j2 = {scheme, g, I, H, nu, uexp, uoff, down, act, ap, asum, ysrt, bfm};
    coli_parallel(moe_part, &j2, nt);
    for (long r = 0; r < (long)Q; r++) memcpy(ys + (long)order[r] * H, ysrt + r * H, sizeof(float) * H);
    if (y) {
        for (long t = 0; t < (long)T; t++)
            for (int c = 0; c < H; c++) {
                float s = 0.f;
                for (int jj = 0; jj < k; jj++) s += weights[t * k + jj] * ys[(t * k + jj) * H + c];
                if (bf16) ((uint16_t *)y)[t * H + c] = f32_to_bf16(s);
                else ((float *)y)[t * H + c] = s;
            }
    }
done:
    free(count); free(order); free(uexp); free(uoff); free(buf);
    return rc;
}

/* ------------------------------------------------------------------- one query's attention */

static inline float ld(const void *p, int bf16, long i) {
    return bf16 ? bf16_to_f32(((const uint16_t *)p)[i]) : ((const float *)p)[i];
}

/* Decode attention for one query row: q [H, D], keys/values of kv head j at k + j * ks (rows of D,
 * row stride D) and v + j * vs (rows of Dv), S of them; query head h reads kv head h / (H / Hkv).
 * out [H, Dv] = softmax(scale * q k^T [| sink_h]) v, scores and sums in f32, all in x's dtype
 * (bf16 when bf16 != 0, else f32). sinks: [H] f32 logits that join the denominator only, or NULL. */
typedef struct {
    const void *q, *k, *v;
    int bf16, H, rep, D, Dv, S;
    long ks, vs;
    float scale;
    const float *sinks;
    float *buf;
    void *out;
} attn_job;

static void attn_part(void *p, int id, int n) {
    attn_job *j = (attn_job *)p;
    const void *q = j->q, *k = j->k, *v = j->v;
    int bf16 = j->bf16, H = j->H, rep = j->rep, D = j->D, Dv = j->Dv, S = j->S;
    long ks = j->ks, vs = j->vs;
    float scale = j->scale, *buf = j->buf;
    const float *sinks = j->sinks;
    void *out = j->out;
    long h0, h1;
    split(H, id, n, &h0, &h1);
    for (int h = (int)h0; h < (int)h1; h++) {
        float *sc = buf + (size_t)h * S, *qf = buf + (size_t)H * S + (size_t)h * (D + Dv), *of = qf + D;
        long kv = h / rep;
        for (int d = 0; d < D; d++) qf[d] = ld(q, bf16, (long)h * D + d);
        float mx = sinks ? sinks[h] : -INFINITY;
        for (int s = 0; s < S; s++) {
            long base = kv * ks + (long)s * D;
            float a = 0.f;
#ifdef COLI_AVX512
            int d = 0;
            __m512 acc = _mm512_setzero_ps();
            if (bf16) {
                for (; d + 16 <= D; d += 16) {
                    __m256i kb = _mm256_loadu_si256((const __m256i *)((const uint16_t *)k + base + d));
                    __m512 kf = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(kb), 16));
                    acc = _mm512_fmadd_ps(kf, _mm512_loadu_ps(qf + d), acc);
                }
            } else {
                for (; d + 16 <= D; d += 16)
                    acc = _mm512_fmadd_ps(_mm512_loadu_ps((const float *)k + base + d), _mm512_loadu_ps(qf + d), acc);
            }
            a = _mm512_reduce_add_ps(acc);
            for (; d < D; d++) a += qf[d] * ld(k, bf16, base + d);
#else
            for (int d = 0; d < D; d++) a += qf[d] * ld(k, bf16, base + d);
#endif
            sc[s] = a * scale;
            if (sc[s] > mx) mx = sc[s];
        }
        float den = sinks ? expf(sinks[h] - mx) : 0.f;
        for (int s = 0; s < S; s++) { sc[s] = expf(sc[s] - mx); den += sc[s]; }
        for (int d = 0; d < Dv; d++) of[d] = 0.f;
        for (int s = 0; s < S; s++) {
            long base = kv * vs + (long)s * Dv;
            float p = sc[s];
            if (bf16) for (int d = 0; d < Dv; d++) of[d] += p * bf16_to_f32(((const uint16_t *)v)[base + d]);
            else for (int d = 0; d < Dv; d++) of[d] += p * ((const float *)v)[base + d];
        }
        for (int d = 0; d < Dv; d++) {
            float o = of[d] / den;
            if (bf16) ((uint16_t *)out)[(long)h * Dv + d] = f32_to_bf16(o);
            else ((float *)out)[(long)h * Dv + d] = o;
        }
    }
}

int coli_attn_decode(const void *q, int bf16, int H, int Hkv, int D, int Dv, const void *k, long ks,
                     const void *v, long vs, int S, float scale, const float *sinks, void *out) {
    if (S < 1 || H % Hkv) return -3;
    float *buf = (float *)malloc(sizeof(float) * ((size_t)H * S + (size_t)H * (D + Dv)));
    if (!buf) return -2;
    attn_job j = {q, k, v, bf16, H, H / Hkv, D, Dv, S, ks, vs, scale, sinks, buf, out};
    coli_parallel(attn_part, &j, n_threads_for((long)Hkv * S * (D + Dv) * (bf16 ? 2 : 4) / 4));
    free(buf);
    return 0;
}

/* ------------------------------------------------------------------- norm and rotary, per row */

/* out[r] = w * x[r] / sqrt(mean(x[r]^2) + eps) for R rows of H, in f32, rounded once to x's dtype. */
int coli_rmsnorm(const void *x, int bf16, long R, int H, const float *w, float eps, void *out) {
    for (long r = 0; r < R; r++) {
        float ss = 0.f;
        for (int i = 0; i < H; i++) { float v = ld(x, bf16, r * H + i); ss += v * v; }
        float inv = 1.f / sqrtf(ss / (float)H + eps);
        for (int i = 0; i < H; i++) {
            float v = w[i] * (ld(x, bf16, r * H + i) * inv);
            if (bf16) ((uint16_t *)out)[r * H + i] = f32_to_bf16(v);
            else ((float *)out)[r * H + i] = v;
        }
    }
    return 0;
}

/* Rotary embedding (rotate-half convention) of the first `rot` channels of each of the nh heads of
 * T rows (x [T, nh, D]); cos/sin f32 [T, rot] (the scale folded in); the other channels are copied.
 * In f32, rounded once to x's dtype. */
int coli_rope(const void *x, int bf16, int T, int nh, int D, int rot, const float *cs, const float *sn, void *out) {
    int half = rot / 2;
    for (int t = 0; t < T; t++)
        for (int h = 0; h < nh; h++) {
            long b = ((long)t * nh + h) * D;
            const float *c = cs + (long)t * rot, *s = sn + (long)t * rot;
            for (int i = 0; i < D; i++) {
                float v;
                if (i < half) v = ld(x, bf16, b + i) * c[i] - ld(x, bf16, b + i + half) * s[i];
                else if (i < rot) v = ld(x, bf16, b + i) * c[i] + ld(x, bf16, b + i - half) * s[i];
                else v = ld(x, bf16, b + i);
                if (bf16) ((uint16_t *)out)[b + i] = f32_to_bf16(v);
                else ((float *)out)[b + i] = v;
            }
        }
    return 0;
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
                for (int j = 0; j < n / 2; j++) {  /* vectorizable: no branches */
                    tmp[2 * j] = (float)(qb[j] & 15) * sc + m;
                    tmp[2 * j + 1] = (float)(qb[j] >> 4) * sc + m;
                }
                if (bf16) {
                    uint16_t *o = (uint16_t *)out + r * K + c0;
                    for (int j = 0; j < n; j++) {  /* round to nearest even (finite: scales are validated) */
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
