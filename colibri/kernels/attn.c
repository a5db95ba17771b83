/* Per-row ops of a decode step: attention for one query over a KV cache, RMSNorm, RoPE. */
#include "common.h"
#include "attn.h"

/* Decode attention for one query row: q [H, D], keys/values of kv head j at k + j * ks (rows of D,
 * row stride D) and v + j * vs (rows of Dv), S of them; query head h reads kv head h / (H / Hkv).
 * out [H, Dv] = softmax(scale * q k^T [| sink_h]) v, scores and sums in f32, all in x's dtype
 * (bf16 when bf16 != 0, else f32). sinks: [H] f32 logits that join the denominator only, or NULL.
 * Keys (kt) or values (vt) of a quantized type (common.h COLI_KV_*): rows of krb / vrb bytes, head strides
 * ks / vs in bytes, read by kvq.c. */
typedef struct {
    const void *q, *k, *v;
    int bf16, H, rep, D, Dv, S;
    long ks, vs;
    float scale;
    const float *sinks;
    float *buf;
    void *out;
    int kt, vt;
    long krb, vrb;
} attn_job;

#ifdef COLI_AVX512
/* of[0..Dv) = sum_s p[s] * v[s] for bf16 value rows (vb: position 0's, rows Dv apart), Dv a multiple of
 * 32 up to 128 (a constant after inlining): the sums stay in registers, even and odd channels apart
 * (a 32-bit lane holds channels 2i and 2i+1: a shift and a mask make both f32), interleaved once at the
 * end. Per position that is ~10 vector ops where the loop over of[] in memory took ~24. */
static inline __attribute__((always_inline)) void attn_values_bf(const uint16_t *vb, int S, int Dv, const float *p,
                                                                 float *of) {
    __m512 ev[4], od[4];
    const __m512i hi = _mm512_set1_epi32((int)0xFFFF0000u);
    for (int j = 0; j < Dv / 32; j++) ev[j] = od[j] = _mm512_setzero_ps();
    for (int s = 0; s < S; s++) {
        const uint16_t *row = vb + (long)s * Dv;
        attn_prefetch((const char *)(row + (long)ATTN_PF * Dv), Dv * 2);
        __m512 ps = _mm512_set1_ps(p[s]);
        for (int j = 0; j < Dv / 32; j++) {
            __m512i x = _mm512_loadu_si512((const void *)(row + 32 * j));
            ev[j] = _mm512_fmadd_ps(_mm512_castsi512_ps(_mm512_slli_epi32(x, 16)), ps, ev[j]);
            od[j] = _mm512_fmadd_ps(_mm512_castsi512_ps(_mm512_and_si512(x, hi)), ps, od[j]);
        }
    }
    const __m512i lo_i = _mm512_set_epi32(23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
    const __m512i hi_i = _mm512_set_epi32(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8);
    for (int j = 0; j < Dv / 32; j++) {
        _mm512_storeu_ps(of + 32 * j, _mm512_permutex2var_ps(ev[j], lo_i, od[j]));
        _mm512_storeu_ps(of + 32 * j + 16, _mm512_permutex2var_ps(ev[j], hi_i, od[j]));
    }
}
#endif

/* Heads h0..h1 of one query row. */
static void attn_heads(const attn_job *j, long h0, long h1) {
    const void *q = j->q, *k = j->k, *v = j->v;
    int bf16 = j->bf16, H = j->H, rep = j->rep, D = j->D, Dv = j->Dv, S = j->S;
    long ks = j->ks, vs = j->vs;
    float scale = j->scale, *buf = j->buf;
    const float *sinks = j->sinks;
    void *out = j->out;
    int fast = 0;  /* the bf16 vector path (keys scored 16 at a time): reads q as it is */
#if defined(COLI_AVX512) && defined(__AVX512BF16__)
    fast = bf16 && D % 32 == 0 && !j->kt;
#endif
    for (int h = (int)h0; h < (int)h1; h++) {
        float *sc = buf + (size_t)h * S, *qf = buf + (size_t)H * S + (size_t)h * (D + Dv), *of = qf + D;
        long kv = h / rep;
        if (!fast)
            for (int d = 0; d < D; d++) qf[d] = ld(q, bf16, (long)h * D + d);
        float mx = sinks ? sinks[h] : -INFINITY;
        long es = bf16 ? 2 : 4;
        (void)es;  /* (the prefetches are AVX-512 builds only) */
#ifdef COLI_AVX512
        /* the head's first ATTN_PF key and value rows, which no row before them prefetches (kvq.c: its own) */
        if (!j->kt) attn_prefetch((const char *)k + kv * ks * es, (S < ATTN_PF ? S : ATTN_PF) * D * es);
        if (!j->vt) attn_prefetch((const char *)v + kv * vs * es, (S < ATTN_PF ? S : ATTN_PF) * Dv * es);
#endif
        int s1 = 0;  /* positions scored so far */
        if (j->kt) {
            coli_kvq_scores((const uint8_t *)k + kv * ks, j->krb, j->kt, D, 1, (const float *const *)&qf, &S, scale,
                            &sc, &mx);
            s1 = S;
        }
#if defined(COLI_AVX512) && defined(__AVX512BF16__)
        if (fast) {  /* bf16 keys and query, 16 positions at a time (attn_scores16) */
            const uint16_t *qb = (const uint16_t *)q + (long)h * D, *kb = (const uint16_t *)k + kv * ks;
            __m512 mxv = _mm512_set1_ps(mx);
            for (; s1 < S; s1 += 16)
                attn_scores16(kb, qb, D, s1, S - s1 < 16 ? S - s1 : 16, scale, sc, &mxv);
            mx = _mm512_reduce_max_ps(mxv);
        }
#endif
        for (int s = s1; s < S; s++) {
            long base = kv * ks + (long)s * D;
            float a = 0.f;
#ifdef COLI_AVX512
            attn_prefetch((const char *)k + (base + (long)ATTN_PF * D) * es, D * es);
            int d = 0;
            __m512 acc = _mm512_setzero_ps();
            if (bf16) {
                for (; d + 16 <= D; d += 16) {
                    __m512 kf = bf16_16_to_f32((const uint16_t *)k + base + d);
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
        float den = attn_exp(sc, S, mx, sinks ? sinks + h : NULL);
        if (j->vt)
            coli_kvq_values((const uint8_t *)v + kv * vs, j->vrb, j->vt, Dv, 1, &S, &sc, &of);
#ifdef COLI_AVX512
        else if (bf16 && Dv == 64)
            attn_values_bf((const uint16_t *)v + kv * vs, S, 64, sc, of);
        else if (bf16 && Dv == 128)
            attn_values_bf((const uint16_t *)v + kv * vs, S, 128, sc, of);
#endif
        else {
            for (int d = 0; d < Dv; d++) of[d] = 0.f;
            for (int s = 0; s < S; s++) {
                long base = kv * vs + (long)s * Dv;
                float p = sc[s];
#ifdef COLI_AVX512
                attn_prefetch((const char *)v + (base + (long)ATTN_PF * Dv) * es, Dv * es);
#endif
                if (bf16) for (int d = 0; d < Dv; d++) of[d] += p * bf16_to_f32(((const uint16_t *)v)[base + d]);
                else for (int d = 0; d < Dv; d++) of[d] += p * ((const float *)v)[base + d];
            }
        }
        attn_out(of, den, out, bf16, h, Dv);
    }
}

#if defined(COLI_AVX512) && defined(__AVX512BF16__)
#ifndef ATTN_RB
#define ATTN_RB 4  /* query rows of one sequence that share each pass over a head's keys and values */
#endif
/* of[r][0..Dv) = sum_s p[r][s] * v[s] for R rows at once, row r over positions s < S[r] (S[r] = 0: no
 * row): attn_values_bf's arithmetic for each row, in its order (the same bits), but each value row is
 * loaded and widened once for all R. R and Dv are constants after inlining (R x Dv = 256: 16 accumulators). */
static inline __attribute__((always_inline)) void attn_values_rows(const uint16_t *vb, const int *S, int R, int Dv,
                                                                   float *const *p, float *const *of) {
    __m512 ev[ATTN_RB][4], od[ATTN_RB][4];
    const __m512i hi = _mm512_set1_epi32((int)0xFFFF0000u);
    int Smax = 0;
    for (int r = 0; r < R; r++) {
        for (int j = 0; j < Dv / 32; j++) ev[r][j] = od[r][j] = _mm512_setzero_ps();
        Smax = S[r] > Smax ? S[r] : Smax;
    }
    for (int s = 0; s < Smax; s++) {
        const uint16_t *row = vb + (long)s * Dv;
        attn_prefetch((const char *)(row + (long)ATTN_PF * Dv), Dv * 2);
        for (int j = 0; j < Dv / 32; j++) {
            __m512i x = _mm512_loadu_si512((const void *)(row + 32 * j));
            __m512 lo = _mm512_castsi512_ps(_mm512_slli_epi32(x, 16)), up = _mm512_castsi512_ps(_mm512_and_si512(x, hi));
            for (int r = 0; r < R; r++)
                if (s < S[r]) {
                    __m512 ps = _mm512_set1_ps(p[r][s]);
                    ev[r][j] = _mm512_fmadd_ps(lo, ps, ev[r][j]);
                    od[r][j] = _mm512_fmadd_ps(up, ps, od[r][j]);
                }
        }
    }
    const __m512i lo_i = _mm512_set_epi32(23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
    const __m512i hi_i = _mm512_set_epi32(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8);
    for (int r = 0; r < R; r++)
        if (S[r])
            for (int j = 0; j < Dv / 32; j++) {
                _mm512_storeu_ps(of[r] + 32 * j, _mm512_permutex2var_ps(ev[r][j], lo_i, od[r][j]));
                _mm512_storeu_ps(of[r] + 32 * j + 16, _mm512_permutex2var_ps(ev[r][j], hi_i, od[r][j]));
            }
}

/* Head h of nr <= ATTN_RB query rows of one sequence (the same keys and values, bf16, D % 32 == 0, Dv 64 or
 * 128): each row's arithmetic is attn_heads' (the same bits), but the rows take each 16-position block of
 * keys in turn while it sits in L1, and share each value row's loads (attn_values_rows). A prompt chunk's
 * rows read a long context's keys and values once per ATTN_RB rows instead of once per row. */
static void attn_heads_rows(const attn_job *j, int nr, int h) {
    int D = j[0].D, Dv = j[0].Dv, Smax = 0;
    long kv = h / j[0].rep;
    const uint16_t *kb = (const uint16_t *)j[0].k + kv * j[0].ks, *vb = (const uint16_t *)j[0].v + kv * j[0].vs;
    float *sc[ATTN_RB], *of[ATTN_RB];
    int S[ATTN_RB];
    __m512 mxv[ATTN_RB];
    for (int r = 0; r < ATTN_RB; r++) {
        const attn_job *a = j + (r < nr ? r : 0);
        S[r] = r < nr ? a->S : 0;
        sc[r] = a->buf + (size_t)h * a->S;
        of[r] = a->buf + (size_t)a->H * a->S + (size_t)h * (D + Dv) + D;
        mxv[r] = _mm512_set1_ps(a->sinks ? a->sinks[h] : -INFINITY);
        Smax = S[r] > Smax ? S[r] : Smax;
    }
    attn_prefetch((const char *)kb, (S[0] < ATTN_PF ? S[0] : ATTN_PF) * D * 2);
    attn_prefetch((const char *)vb, (S[0] < ATTN_PF ? S[0] : ATTN_PF) * Dv * 2);
    for (int s1 = 0; s1 < Smax; s1 += 16)
        for (int r = 0; r < nr; r++)
            if (s1 < S[r])
                attn_scores16(kb, (const uint16_t *)j[r].q + (long)h * D, D, s1, S[r] - s1 < 16 ? S[r] - s1 : 16,
                              j[r].scale, sc[r], &mxv[r]);
    float den[ATTN_RB];
    for (int r = 0; r < nr; r++)
        den[r] = attn_exp(sc[r], S[r], _mm512_reduce_max_ps(mxv[r]), j[r].sinks ? j[r].sinks + h : NULL);
    if (Dv == 64)
        attn_values_rows(vb, S, ATTN_RB, 64, sc, of);
    else
        for (int r0 = 0; r0 < ATTN_RB; r0 += 2) {  /* 128-wide rows two at a time: 16 accumulators */
            if (ATTN_RB - r0 >= 2)
                attn_values_rows(vb, S + r0, 2, 128, sc + r0, of + r0);
            else
                attn_values_rows(vb, S + r0, 1, 128, sc + r0, of + r0);
        }
    for (int r = 0; r < nr; r++) attn_out(of[r], den[r], j[r].out, 1, h, Dv);
}

/* Whether rows r0..r0+n can take attn_heads_rows: one sequence, the bf16 vector path. */
static int attn_rows_ok(const attn_job *j, int n) {
    if (!(j[0].bf16 && j[0].D % 32 == 0 && (j[0].Dv == 64 || j[0].Dv == 128) && !j[0].kt && !j[0].vt)) return 0;
    for (int r = 1; r < n; r++)
        if (j[r].k != j[0].k || j[r].v != j[0].v) return 0;
    return 1;
}

/* Head h of nr query rows of one sequence over quantized keys and values: each row's arithmetic is attn_heads' (the
 * same bits), but KVQ_RB rows at a time score each 16-position block of keys in turn while it sits in L1 and share
 * each value row's widening (kvq.c): a prompt chunk reads a long context once per KVQ_RB rows. */
static void attn_heads_rows_q(const attn_job *j, int nr, int h) {
    int D = j[0].D, Dv = j[0].Dv;
    long kv = h / j[0].rep;
    const uint8_t *kh = (const uint8_t *)j[0].k + kv * j[0].ks, *vh = (const uint8_t *)j[0].v + kv * j[0].vs;
    for (int r0 = 0; r0 < nr; r0 += KVQ_RB) {
        int R = nr - r0 < KVQ_RB ? nr - r0 : KVQ_RB, S[KVQ_RB];
        float *sc[KVQ_RB], *qf[KVQ_RB], *of[KVQ_RB], mx[KVQ_RB];
        for (int r = 0; r < R; r++) {
            const attn_job *a = j + r0 + r;
            S[r] = a->S;
            sc[r] = a->buf + (size_t)h * a->S;
            qf[r] = a->buf + (size_t)a->H * a->S + (size_t)h * (D + Dv);
            of[r] = qf[r] + D;
            mx[r] = a->sinks ? a->sinks[h] : -INFINITY;
            for (int d = 0; d < D; d++) qf[r][d] = ld(a->q, a->bf16, (long)h * D + d);
        }
        coli_kvq_scores(kh, j[0].krb, j[0].kt, D, R, (const float *const *)qf, S, j[0].scale, sc, mx);
        float den[KVQ_RB];
        for (int r = 0; r < R; r++) den[r] = attn_exp(sc[r], S[r], mx[r], j[r0 + r].sinks ? j[r0 + r].sinks + h : NULL);
        coli_kvq_values(vh, j[0].vrb, j[0].vt, Dv, R, S, sc, of);
        for (int r = 0; r < R; r++) attn_out(of[r], den[r], j[r0 + r].out, j[r0 + r].bf16, h, Dv);
    }
}

/* Whether rows r0..r0+n can take attn_heads_rows_q: one sequence, quantized keys and values. */
static int attn_rows_q_ok(const attn_job *j, int n) {
    if (!j[0].kt || !j[0].vt) return 0;
    for (int r = 1; r < n; r++)
        if (j[r].k != j[0].k || j[r].v != j[0].v) return 0;
    return 1;
}
#endif

typedef struct {
    const attn_job *rows;
    int T, H;
} attn_multi;

/* Head-major: a head's keys and values (a few hundred KiB at a long context) are read by every row of a
 * prompt chunk while they sit in L2; row-major (-DATTN_ROW_MAJOR) read all heads' (MiBs) again per row,
 * from L3. Same jobs, same bits. */
static void attn_multi_part(void *p, int id, int n) {
    attn_multi *m = (attn_multi *)p;
    long a, b;
#if defined(ATTN_ROW_MAJOR)
    split((long)m->T * m->H, id, n, &a, &b);
    for (long i = a; i < b; i++) attn_heads(&m->rows[i / m->H], i % m->H, i % m->H + 1);
#elif defined(COLI_AVX512) && defined(__AVX512BF16__)
    /* (head, block of ATTN_RB rows) jobs, head-major */
    long nb = (m->T + ATTN_RB - 1) / ATTN_RB;
    split(nb * m->H, id, n, &a, &b);
    for (long i = a; i < b; i++) {
        int h = (int)(i / nb), r0 = (int)(i % nb) * ATTN_RB, nr = m->T - r0 < ATTN_RB ? m->T - r0 : ATTN_RB;
        if (nr > 1 && attn_rows_ok(m->rows + r0, nr))
            attn_heads_rows(m->rows + r0, nr, h);
        else if (nr > 1 && attn_rows_q_ok(m->rows + r0, nr))
            attn_heads_rows_q(m->rows + r0, nr, h);
        else
            for (int r = r0; r < r0 + nr; r++) attn_heads(&m->rows[r], h, h + 1);
    }
#else
    split((long)m->T * m->H, id, n, &a, &b);
    for (long i = a; i < b; i++) attn_heads(&m->rows[i % m->T], i / m->T, i / m->T + 1);
#endif
}

/* coli_attn_decode for T query rows at once (a prompt chunk, a batch of sequences): row t's query at
 * q + t * H * D, its keys/values at k[t] / v[t] (S[t] of them), its output at out + t * H * Dv. All
 * rows x heads go to the threads in one parallel region (a fork/join per row cost more than a short
 * row's attention). A head's bits do not depend on the other rows of the call. kvt: the caches' row types
 * (common.h), a quantized one's head stride in bytes. Returns 0, -2 (memory), -3 (a bad S or layout). */
int coli_attn_rows(int T, const void *q, int bf16, int H, int Hkv, int D, int Dv, const void *const *k, long ks,
                   const void *const *v, long vs, const int *S, float scale, const float *sinks, void *out, int kvt) {
    long tot = 0, es = bf16 ? 2 : 4;
    int kt = kvt & 15, vt = kvt >> 4;
    if (!coli_kv_ok(kvt, D, Dv) || (kt && D > KVQ_DMAX) || (vt && Dv > KVQ_DMAX)) return -3;
    long krb = coli_kv_row_bytes(kt, D, (int)es), vrb = coli_kv_row_bytes(vt, Dv, (int)es);
    for (int t = 0; t < T; t++) {
        if (S[t] < 1) return -3;
        tot += S[t];
    }
    float *buf = (float *)malloc(sizeof(float) * ((size_t)H * tot + (size_t)T * H * (D + Dv)));
    attn_job *rows = (attn_job *)malloc(sizeof(attn_job) * (size_t)T);
    if (!buf || !rows) { free(buf); free(rows); return -2; }
    float *b = buf;
    for (int t = 0; t < T; t++) {
        attn_job r = {(const char *)q + (long)t * H * D * es, k[t], v[t], bf16, H, H / Hkv, D, Dv, S[t], ks, vs,
                      scale, sinks, b, (char *)out + (long)t * H * Dv * es, kt, vt, krb, vrb};
        rows[t] = r;
        b += (size_t)H * S[t] + (size_t)H * (D + Dv);
    }
    attn_multi m = {rows, T, H};
    coli_parallel(attn_multi_part, &m, n_threads_for((long)Hkv * tot * (krb + vrb) * 4));
    free(rows);
    free(buf);
    return 0;
}

/* coli_attn_rows (bf16, no sinks) where row t's query heads of KV group g attend only to the keys of g's kept blocks:
 * keep [T][Hkv][nb], one byte a block of blk positions from position 0 (MiniMax-M3's sparse attention). The kept keys
 * and values are gathered per (row, group), which then runs as a row of its own (H / Hkv heads over one KV head):
 * the work is the kept keys', not the context's. */
int coli_attn_rows_keep(int T, const void *q, int H, int Hkv, int D, int Dv, const void *const *k, long ks,
                        const void *const *v, long vs, const int *S, float scale, const uint8_t *keep, int blk, int nb,
                        void *out) {
    if (T < 1 || H % Hkv || blk < 1 || nb < 1) return -3;
    int R = T * Hkv;
    long tot = 0;
    int *n = (int *)malloc(sizeof(int) * (size_t)R);
    if (!n) return -2;
    for (int t = 0; t < T; t++) {
        if (S[t] < 1 || (S[t] + blk - 1) / blk > nb) { free(n); return -3; }
        for (int g = 0; g < Hkv; g++) {
            const uint8_t *kp = keep + ((long)t * Hkv + g) * nb;
            int c = 0;
            for (int b = 0; b * blk < S[t]; b++)
                if (kp[b]) c += (b + 1) * blk < S[t] ? blk : S[t] - b * blk;
            if (c < 1) { free(n); return -3; }  /* (a row keeps at least its own block) */
            n[t * Hkv + g] = c;
            tot += c;
        }
    }
    uint16_t *kv = (uint16_t *)malloc(sizeof(uint16_t) * (size_t)tot * (D + Dv));
    const void **kr = (const void **)malloc(sizeof(void *) * 2 * (size_t)R);
    if (!kv || !kr) { free(n); free(kv); free(kr); return -2; }
    const void **vr = kr + R;
    uint16_t *kd = kv, *vd = kv + (size_t)tot * D;
    for (int t = 0; t < T; t++)
        for (int g = 0; g < Hkv; g++) {
            const uint8_t *kp = keep + ((long)t * Hkv + g) * nb;
            const uint16_t *ksrc = (const uint16_t *)k[t] + g * ks, *vsrc = (const uint16_t *)v[t] + g * vs;
            kr[t * Hkv + g] = kd, vr[t * Hkv + g] = vd;
            for (int b = 0; b * blk < S[t]; b++) {
                if (!kp[b]) continue;
                int s0 = b * blk, c = (b + 1) * blk < S[t] ? blk : S[t] - s0;  /* (positions ascending, as dense) */
                memcpy(kd, ksrc + (long)s0 * D, sizeof(uint16_t) * (size_t)c * D);
                memcpy(vd, vsrc + (long)s0 * Dv, sizeof(uint16_t) * (size_t)c * Dv);
                kd += (size_t)c * D, vd += (size_t)c * Dv;
            }
        }
    /* row t's group g: its H / Hkv query heads (q + (t H + g H / Hkv) D) over its own keys; out likewise */
    int rc = coli_attn_rows(R, q, 1, H / Hkv, 1, D, Dv, kr, 0, vr, 0, n, scale, NULL, out, 0);
    free(n);
    free(kv);
    free(kr);
    return rc;
}

int coli_attn_decode(const void *q, int bf16, int H, int Hkv, int D, int Dv, const void *k, long ks,
                     const void *v, long vs, int S, float scale, const float *sinks, void *out, int kvt) {
    return coli_attn_rows(1, q, bf16, H, Hkv, D, Dv, &k, ks, &v, vs, &S, scale, sinks, out, kvt);
}

/* ------------------------------------------------------------------- norm and rotary, per row */

/* Values per call worth splitting between the threads: a prompt chunk's rows. 8 sequences' rows (8192
 * values of the 0.44b model) ran faster on one thread once RMSNorm was vectorized (RMSNorm 16-18 vs
 * 37-44 us a step over 8 layers: the fork/join cost more than the work). */
#ifndef ROW_OPS_PAR_MIN
#define ROW_OPS_PAR_MIN 32768
#endif

typedef struct {
    const void *x;
    int bf16, H, nh, D, rot;
    long R;
    const float *w, *cs, *sn;
    float eps;
    void *out;
    const float *b;  /* LayerNorm's bias (layernorm_rows) */
} row_op;

/* out[r] = w * x[r] / sqrt(mean(x[r]^2) + eps) for rows r0..r1 of H, in f32, rounded once to x's dtype. */
static void rmsnorm_rows(const row_op *a, long r0, long r1) {
    const void *x = a->x;
    int bf16 = a->bf16, H = a->H;
    for (long r = r0; r < r1; r++) {
        float ss = 0.f;
        int i0 = 0;
#ifdef COLI_AVX512
        if (bf16) {  /* 16 partial sums, then one reduction: a scalar chain of H dependent adds was ~2 us a row */
            __m512 acc = _mm512_setzero_ps();
            for (; i0 + 16 <= H; i0 += 16) {
                __m512 v = bf16_16_to_f32((const uint16_t *)x + r * H + i0);
                acc = _mm512_fmadd_ps(v, v, acc);
            }
            ss = _mm512_reduce_add_ps(acc);
        }
#endif
        for (int i = i0; i < H; i++) { float v = ld(x, bf16, r * H + i); ss += v * v; }
        float inv = 1.f / sqrtf(ss / (float)H + a->eps);
        int i1 = 0;
#ifdef COLI_AVX512
        if (bf16) {  /* the same two products and one rounding per value as below, 16 at a time */
            const __m512 vi = _mm512_set1_ps(inv);
            for (; i1 + 16 <= H; i1 += 16) {
                __m512 v = _mm512_mul_ps(_mm512_loadu_ps(a->w + i1),
                                         _mm512_mul_ps(bf16_16_to_f32((const uint16_t *)x + r * H + i1), vi));
                _mm256_storeu_si256((__m256i *)((uint16_t *)a->out + r * H + i1), f32_to_bf16_16(v));
            }
        }
#endif
        for (int i = i1; i < H; i++) {
            float v = a->w[i] * (ld(x, bf16, r * H + i) * inv);
            if (bf16) ((uint16_t *)a->out)[r * H + i] = f32_to_bf16(v);
            else ((float *)a->out)[r * H + i] = v;
        }
    }
}

/* LayerNorm (Phi-3.5-MoE) of rows r0..r1 in f32: the mean, then the mean square of x - mean (two passes, as
 * torch's), out = (x - mean) / sqrt(var + eps) * w + b rounded once to x's dtype. */
static void layernorm_rows(const row_op *a, long r0, long r1) {
    const void *x = a->x;
    int bf16 = a->bf16, H = a->H;
    for (long r = r0; r < r1; r++) {
        float sum = 0.f, ss = 0.f;
        for (int i = 0; i < H; i++) sum += ld(x, bf16, r * H + i);
        const float mean = sum / (float)H;
        for (int i = 0; i < H; i++) { float d = ld(x, bf16, r * H + i) - mean; ss += d * d; }
        const float inv = 1.f / sqrtf(ss / (float)H + a->eps);
        for (int i = 0; i < H; i++) {
            float v = (ld(x, bf16, r * H + i) - mean) * inv * a->w[i] + a->b[i];
            if (bf16) ((uint16_t *)a->out)[r * H + i] = f32_to_bf16(v);
            else ((float *)a->out)[r * H + i] = v;
        }
    }
}

static void layernorm_part(void *p, int id, int n) {
    long r0, r1;
    split(((row_op *)p)->R, id, n, &r0, &r1);
    layernorm_rows((row_op *)p, r0, r1);
}

/* Rotary embedding (rotate-half convention) of the first `rot` channels of each of the nh heads of rows
 * t0..t1 (x [T, nh, D]); cos/sin f32 [T, rot] (the scale folded in); the other channels are copied.
 * In f32, rounded once to x's dtype. */
static void rope_rows(const row_op *a, long t0, long t1) {
    const void *x = a->x;
    int bf16 = a->bf16, nh = a->nh, D = a->D, rot = a->rot, half = a->rot / 2;
    for (long t = t0; t < t1; t++)
        for (int h = 0; h < nh; h++) {
            long b = ((long)t * nh + h) * D;
            const float *c = a->cs + t * rot, *s = a->sn + t * rot;
            int i = 0;
#ifdef COLI_AVX512
            if (bf16 && half % 16 == 0) {  /* 16 lanes: the same products, one rounding each, as below */
                const uint16_t *xb = (const uint16_t *)x + b;
                uint16_t *ob = (uint16_t *)a->out + b;
                for (; i < half; i += 16) {
                    __m512 lo = _mm512_sub_ps(_mm512_mul_ps(bf16_16_to_f32(xb + i), _mm512_loadu_ps(c + i)),
                                              _mm512_mul_ps(bf16_16_to_f32(xb + i + half), _mm512_loadu_ps(s + i)));
                    __m512 hi = _mm512_add_ps(_mm512_mul_ps(bf16_16_to_f32(xb + i + half), _mm512_loadu_ps(c + i + half)),
                                              _mm512_mul_ps(bf16_16_to_f32(xb + i), _mm512_loadu_ps(s + i + half)));
                    _mm256_storeu_si256((__m256i *)(ob + i), f32_to_bf16_16(lo));
                    _mm256_storeu_si256((__m256i *)(ob + i + half), f32_to_bf16_16(hi));
                }
                i = rot;
            }
#endif
            for (; i < D; i++) {
                float v;
                if (i < half) v = ld(x, bf16, b + i) * c[i] - ld(x, bf16, b + i + half) * s[i];
                else if (i < rot) v = ld(x, bf16, b + i) * c[i] + ld(x, bf16, b + i - half) * s[i];
                else v = ld(x, bf16, b + i);
                if (bf16) ((uint16_t *)a->out)[b + i] = f32_to_bf16(v);
                else ((float *)a->out)[b + i] = v;
            }
        }
}

static void rmsnorm_part(void *p, int id, int n) {
    long r0, r1;
    split(((row_op *)p)->R, id, n, &r0, &r1);
    rmsnorm_rows((row_op *)p, r0, r1);
}

static void rope_part(void *p, int id, int n) {
    long r0, r1;
    split(((row_op *)p)->R, id, n, &r0, &r1);
    rope_rows((row_op *)p, r0, r1);
}

int coli_rmsnorm(const void *x, int bf16, long R, int H, const float *w, float eps, void *out) {
    row_op a = {x, bf16, H, 0, 0, 0, R, w, NULL, NULL, eps, out};
    coli_parallel(rmsnorm_part, &a, R * H >= ROW_OPS_PAR_MIN ? coli_get_threads() : 1);
    return 0;
}

int coli_layernorm(const void *x, int bf16, long R, int H, const float *w, const float *b, float eps, void *out) {
    row_op a = {x, bf16, H, 0, 0, 0, R, w, NULL, NULL, eps, out, b};
    coli_parallel(layernorm_part, &a, R * H >= ROW_OPS_PAR_MIN ? coli_get_threads() : 1);
    return 0;
}

/* The input / post-attention norm of an attention block: LayerNorm where the layer has a bias, else RMSNorm; none
 * (the rows as they are) where w is NULL (FlexOlmo's blocks norm only their sublayers' outputs). */
int coli_block_norm(const void *x, long R, int H, const float *w, const float *b, float eps, void *out) {
    if (!w) {
        if (out != x) memcpy(out, x, sizeof(uint16_t) * (size_t)R * H);
        return 0;
    }
    return b ? coli_layernorm(x, 1, R, H, w, b, eps, out) : coli_rmsnorm(x, 1, R, H, w, eps, out);
}

int coli_rope(const void *x, int bf16, int T, int nh, int D, int rot, const float *cs, const float *sn, void *out) {
    row_op a = {x, bf16, 0, nh, D, rot, T, NULL, cs, sn, 0.f, out};
    coli_parallel(rope_part, &a, (long)T * nh * D >= ROW_OPS_PAR_MIN ? coli_get_threads() : 1);
    return 0;
}
