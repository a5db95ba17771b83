/* One token from one logits row under temperature, top_k, top_p and min_p (colibri/engine/sampling.py
 * states the rule; this is its native form, used for every sampled pick where the kernels are loaded, in
 * single steps and in coli_decode_run alike, so a seeded request gets the same tokens either way).
 *
 * No sort of the vocabulary: top_k is a heap selection behind a vector filter; top_p and min_p take as
 * candidates the tokens within j nats of the most likely, j the first of a few steps at which they hold
 * top_p of the mass (a masked vector sum per try), and sort only those. The draw: u (in [0, 1), from the
 * request's generator) times the kept weights' sum, against their running sum in f64. */
#include "common.h"
#include <pthread.h>

typedef struct {
    float z, e;  /* the logit / temperature, exp(z - max) */
    int i;
} cand;

/* a before b: higher z first, the lower token id on ties */
static int cand_before(const cand *a, const cand *b) { return a->z > b->z || (a->z == b->z && a->i < b->i); }

static int cand_cmp(const void *a, const void *b) {
    return cand_before((const cand *)a, (const cand *)b) ? -1 : cand_before((const cand *)b, (const cand *)a);
}

/* Min-heap of the k best so far (the least on top), h[0..n). */
static void heap_down(cand *h, int n, int r) {
    for (;;) {
        int c = 2 * r + 1;
        if (c >= n) return;
        if (c + 1 < n && cand_before(h + c, h + c + 1)) c++;  /* the lesser child */
        if (!cand_before(h + r, h + c)) return;
        cand t = h[r]; h[r] = h[c]; h[c] = t;
        r = c;
    }
}

static void heap_up(cand *h, int r) {
    while (r > 0) {
        int p = (r - 1) / 2;
        if (!cand_before(h + p, h + r)) return;
        cand t = h[r]; h[r] = h[p]; h[p] = t;
        r = p;
    }
}

/* One scratch for all callers, grown to the largest vocabulary seen, under a lock (picks are short, and
 * the engine makes them from one thread): per-thread buffers would be lost with each thread that ends. */
static cand *cbuf;
static float *ebuf;
static long buf_n;
static pthread_mutex_t buf_lock = PTHREAD_MUTEX_INITIALIZER;

/* max_i x[i] / T, or NAN when x has a NaN. */
static float row_max(const float *x, long V, float T) {
    return row_max_nan(x, V) / T;  /* x / T is monotonic in x: the max of the quotients */
}

/* e[i] = exp(x[i] / T - m), i < V; returns their sum (16 at a time in f32, those sums in f64). */
static double row_exp(const float *x, long V, float T, float m, float *e) {
    double S = 0.0;
    long i = 0;
#ifdef COLI_AVX512
    __m512 vt = _mm512_set1_ps(T), vm = _mm512_set1_ps(m);
    for (; i + 16 <= V; i += 16) {
        __m512 v = exp512_ps(_mm512_sub_ps(_mm512_div_ps(_mm512_loadu_ps(x + i), vt), vm));
        _mm512_storeu_ps(e + i, v);
        S += _mm512_reduce_add_ps(v);
    }
#endif
    for (; i < V; i++) S += e[i] = expf(x[i] / T - m);
    return S;
}

/* The sum of e[i] >= thr. */
static double mass_from(const float *e, long V, float thr) {
    double S = 0.0;
    long i = 0;
#ifdef COLI_AVX512
    __m512 vt = _mm512_set1_ps(thr);
    for (; i + 16 <= V; i += 16) {
        __m512 v = _mm512_loadu_ps(e + i);
        S += _mm512_mask_reduce_add_ps(_mm512_cmp_ps_mask(v, vt, _CMP_GE_OQ), v);
    }
#endif
    for (; i < V; i++)
        if (e[i] >= thr) S += e[i];
    return S;
}

/* Index i in [0, n) where the running sum of e[0..n) passes r (never a zero weight: rounding at the very
 * top gives the last nonzero one). Whole blocks of 16 are skipped by their sums (row_exp's). */
static long walk(const float *e, long n, double r) {
    double cum = 0.0;
    long i = 0, last = -1;
#ifdef COLI_AVX512
    for (; i + 16 <= n; i += 16) {
        double s = _mm512_reduce_add_ps(_mm512_loadu_ps(e + i));
        if (cum + s > r) break;
        cum += s;
    }
#endif
    for (; i < n; i++) {
        if (e[i] <= 0.f) continue;
        last = i;
        if ((cum += e[i]) > r) return i;
    }
    if (last < 0)
        for (last = n - 1; last > 0 && e[last] <= 0.f; last--) {}
    return last;
}

/* The top_k best of x / T into cbuf, most likely first (their e still unset). */
static int select_top_k(const float *x, long V, float T, int k) {
    int n = 0;
    for (long i = 0; i < V; i++) {
#ifdef COLI_AVX512
        if (n == k && (i & 15) == 0 && i + 16 <= V) {  /* a full heap: skip 16 at a time below its least */
            __m512 z = _mm512_div_ps(_mm512_loadu_ps(x + i), _mm512_set1_ps(T));
            if (!_mm512_cmp_ps_mask(z, _mm512_set1_ps(cbuf[0].z), _CMP_GT_OQ)) {
                i += 15;
                continue;
            }
        }
#endif
        cand c = {x[i] / T, 0.f, (int)i};
        if (n < k) {
            cbuf[n] = c;
            heap_up(cbuf, n++);
        } else if (cand_before(&c, cbuf)) {
            cbuf[0] = c;
            heap_down(cbuf, n, 0);
        }
    }
    qsort(cbuf, (size_t)n, sizeof(cand), cand_cmp);
    return n;
}

#ifndef BISECT
#define BISECT 4
#endif

/* Candidate steps for top_p, in nats below the most likely token (then: every token). */
static const float STEPS[] = {2.f, 4.f, 6.f, 8.f, 12.f, 16.f, 24.f, 32.f, 48.f, 64.f};

/* The token picked from x [V] f32 with u in [0, 1): -1 when the row has a NaN or no finite value,
 * -2 out of memory. temperature must be > 0; top_k 0 or >= V, top_p 1 and min_p 0 turn each cut off. */
static long sample_locked(const float *x, long V, float temperature, int top_k, float top_p, float min_p,
                          double u) {
    if (buf_n < V) {
        cand *c = (cand *)realloc(cbuf, sizeof(cand) * (size_t)V);
        if (c) cbuf = c;
        float *e = (float *)realloc(ebuf, sizeof(float) * (size_t)V);
        if (e) ebuf = e;
        if (!c || !e) return -2;
        buf_n = V;
    }
    float m = row_max(x, V, temperature);
    if (m != m || m == -INFINITY || m == INFINITY) return -1;
    int n = 0;
    double S;  /* the weights' sum the cuts are relative to */
    if (top_k > 0 && top_k < V) {
        n = select_top_k(x, V, temperature, top_k);
        S = 0.0;
        for (int j = 0; j < n; j++) S += cbuf[j].e = expf(cbuf[j].z - m);
    } else {
        S = row_exp(x, V, temperature, m, ebuf);
        if (top_p >= 1.f && min_p <= 0.f)  /* temperature alone: every token, in vocabulary order */
            return walk(ebuf, V, u * S);
        float thr = 0.f;  /* candidates: e >= thr (and > 0) */
        if (top_p < 1.f) {
            double want = (double)top_p * S;
            float lo = 0.f, hi = -1.f;  /* nats below the max: within lo too little mass, within hi enough */
            for (int s = 0; s < (int)(sizeof STEPS / sizeof STEPS[0]) && hi < 0.f; s++) {
                if (expf(-STEPS[s]) < min_p || mass_from(ebuf, V, expf(-STEPS[s])) >= want) hi = STEPS[s];
                else lo = STEPS[s];
            }
            if (hi > 0.f) {
                for (int it = 0; it < BISECT; it++) {  /* halve [lo, hi]: fewer candidates to sort */
                    float mid = 0.5f * (lo + hi);
                    if (expf(-mid) < min_p || mass_from(ebuf, V, expf(-mid)) >= want) hi = mid;
                    else lo = mid;
                }
                thr = expf(-hi);
            }
        }
        if (thr < min_p) thr = min_p;  /* min_p: e >= min_p * e_max, e_max = exp(0) = 1 */
        for (long i = 0; i < V; i++)
            if (ebuf[i] >= thr && ebuf[i] > 0.f) cbuf[n++] = (cand){x[i] / temperature, ebuf[i], (int)i};
        qsort(cbuf, (size_t)n, sizeof(cand), cand_cmp);
    }
    int keep = n;
    if (top_p < 1.f) {  /* a token goes once the mass before it reaches top_p; the first stays */
        double cum = 0.0;
        for (int j = 0; j < n; j++) {
            if (j > 0 && cum >= (double)top_p * S) {
                keep = j;
                break;
            }
            cum += cbuf[j].e;
        }
    }
    if (min_p > 0.f) {
        int j = 0;
        while (j < keep && cbuf[j].e >= min_p * cbuf[0].e) j++;
        keep = j > 0 ? j : 1;
    }
    double T = 0.0;
    for (int j = 0; j < keep; j++) T += ebuf[j] = cbuf[j].e;  /* (ebuf reused: the kept weights in order) */
    return cbuf[walk(ebuf, keep, u * T)].i;
}

/* sample_locked (above) under the scratch's lock. */
long coli_sample(const float *x, long V, float temperature, int top_k, float top_p, float min_p, double u) {
    pthread_mutex_lock(&buf_lock);
    long tok = sample_locked(x, V, temperature, top_k, top_p, min_p, u);
    pthread_mutex_unlock(&buf_lock);
    return tok;
}
