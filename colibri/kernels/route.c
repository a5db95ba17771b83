/* The routers of the MoE layers (colibri/layers/moe.py native_route; coli_moe_block and the one-call step call
 * coli_route): the logits x W^T in f32, then each family's rule for its k experts and their weights. */
#include "rows.h"

#define ROUTE_PAR_MIN 8


typedef struct {
    const void *x;
    int bf16, T, H, E, k, norm, kind;  /* kind: common.h's ROUTE_* */
    int n_group, topk_group;           /* group-limited selection (DeepSeek): keep_groups */
    const float *W;
    const float *bias;  /* the bias [E] of the biased kinds (selection-only, or gpt-oss's logit bias) */
    float scale;        /* ROUTE_SOFTMAX (not renormalised) and ROUTE_SIGMOID: the weights' factor;
                         * ROUTE_SOFTMAX_BIAS: the renormalisation floor */
    int64_t *idx;
    float *w;
    int rc;
    float *xf, *logits;  /* the split-logits form: x rows in f32 [T, H], logits [T, E] */
} route_job;

/* Row xf's logit for expert e: one f32 dot product over H. */
static inline float route_logit(const float *xf, const float *W, int e, int H) {
    const float *we = W + (long)e * H;
    float a = 0.f;
    int i = 0;
#ifdef COLI_AVX512
    __m512 acc = _mm512_setzero_ps();
    for (; i + 16 <= H; i += 16) acc = _mm512_fmadd_ps(_mm512_loadu_ps(xf + i), _mm512_loadu_ps(we + i), acc);
    a = _mm512_reduce_add_ps(acc);
#endif
    for (; i < H; i++) a += xf[i] * we[i];
    return a;
}

/* A row's routes from its E logits p (overwritten): softmax, the k largest, optionally renormalised.
 * Returns 0, or -5 for NaN logits. */
/* Group-limited selection (DeepSeek): of G equal groups of the E values p, keep the tg with the best
 * scores -- a group's best value, or with `two` the sum of its two best (V3's noaux_tc, GLM-4.5's), as torch's
 * topk(2).values.sum() -- ties to the lower group, and set every value of the other groups to `off`, which
 * the selection then skips. */
#define MAX_GROUPS 64
static void keep_groups(float *p, int E, int G, int tg, int two, float off) {
    if (G <= 1 || tg >= G) return;
    int per = E / G, keep[MAX_GROUPS];
    float gs[MAX_GROUPS];
    for (int g = 0; g < G; g++) {
        float b1 = -INFINITY, b2 = -INFINITY;
        for (int e = g * per; e < (g + 1) * per; e++) {
            if (p[e] > b1) b2 = b1, b1 = p[e];
            else if (p[e] > b2) b2 = p[e];
        }
        gs[g] = two && per > 1 ? b1 + b2 : b1;
        keep[g] = 0;
    }
    for (int j = 0; j < tg; j++) {
        int best = -1;
        for (int g = 0; g < G; g++)
            if (!keep[g] && (best < 0 || gs[g] > gs[best])) best = g;
        keep[best] = 1;
    }
    for (int g = 0; g < G; g++)
        if (!keep[g])
            for (int e = g * per; e < (g + 1) * per; e++) p[e] = off;
}

static int route_select(float *p, int E, int k, int norm, int64_t *ix, float *wt, int G, int tg) {
    float mx = -INFINITY;
    for (int e = 0; e < E; e++)
        if (p[e] > mx) mx = p[e];
    float den = 0.f;
    for (int e = 0; e < E; e++) { p[e] = expf(p[e] - mx); den += p[e]; }
    keep_groups(p, E, G, tg, 0, -1.f);  /* (the order of p is the probabilities'; -1: not chosen) */
    float sum = 0.f;
    for (int jj = 0; jj < k; jj++) {  /* k passes of a max scan: k and E are small */
        int best = -1;
        for (int e = 0; e < E; e++)
            if (p[e] >= 0.f && (best < 0 || p[e] > p[best])) best = e;
        if (best < 0) return -5;  /* NaN logits: an error */
        ix[jj] = best;
        wt[jj] = p[best] / den;
        sum += wt[jj];
        p[best] = -1.f;  /* taken */
    }
    if (norm)
        for (int jj = 0; jj < k; jj++) wt[jj] /= sum;
    return 0;
}

/* The k largest of p[0..E) into ix in descending order (ties: the lower index first), each marked taken
 * (-inf) in p: the selection of the biased rules below. Returns 0, or -5 when fewer than k are finite. */
static int take_top(float *p, int E, int k, int64_t *ix) {
    for (int jj = 0; jj < k; jj++) {  /* k passes of a max scan: k and E are small */
        int best = -1;
        for (int e = 0; e < E; e++)
            if (p[e] > -INFINITY && (best < 0 || p[e] > p[best])) best = e;
        if (best < 0) return -5;
        ix[jj] = best;
        p[best] = -INFINITY;
    }
    return 0;
}

/* Sigmoid routing with a selection-only correction bias (GLM-4.5, MiniMax-M2: one expert group):
 * s = sigmoid(logit), the k largest s + bias[e] in descending order (ties: the lower expert first), their
 * weights the unbiased s, renormalised (over sum + 1e-20) when norm, times scale -- glm4_moe.py's
 * GroupLimitedRouter with n_group 1. p (E logits) is overwritten, s is E floats of scratch. Returns 0, or
 * -5 for NaN logits. */
static int route_select_sigmoid(float *p, float *s, int E, int k, int norm, const float *bias, float scale,
                                int64_t *ix, float *wt, int G, int tg) {
    for (int e = 0; e < E; e++) {
        if (p[e] != p[e]) return -5;
        s[e] = 1.f / (1.f + expf(-p[e]));
        p[e] = s[e] + bias[e];
    }
    keep_groups(p, E, G, tg, 1, -INFINITY);
    if (take_top(p, E, k, ix)) return -5;
    float sum = 0.f;
    for (int jj = 0; jj < k; jj++) sum += wt[jj] = s[ix[jj]];
    for (int jj = 0; jj < k; jj++) wt[jj] = (norm ? wt[jj] / (sum + 1e-20f) : wt[jj]) * scale;
    return 0;
}

/* Softmax probabilities chosen by probability + a selection-only bias (ERNIE-4.5's moe_statics): the k
 * largest s + bias[e] in descending order (ties: the lower expert first), weighted by their unbiased
 * probabilities over max(their sum, norm_min) -- ernie4_5_moe.py's Router; without `norm`, times norm_min as a
 * scale instead (LongCat-Flash's). p (E logits) is overwritten, s is E floats of scratch. Returns 0, or -5 for
 * NaN logits. */
static int route_select_softmax_bias(float *p, float *s, int E, int k, int norm, const float *bias, float norm_min,
                                     int64_t *ix, float *wt) {
    float mx = -INFINITY;
    for (int e = 0; e < E; e++) {
        if (p[e] != p[e]) return -5;
        if (p[e] > mx) mx = p[e];
    }
    float den = 0.f;
    for (int e = 0; e < E; e++) { s[e] = expf(p[e] - mx); den += s[e]; }
    for (int e = 0; e < E; e++) { s[e] /= den; p[e] = s[e] + bias[e]; }
    if (take_top(p, E, k, ix)) return -5;
    float sum = 0.f;
    for (int jj = 0; jj < k; jj++) sum += wt[jj] = s[ix[jj]];
    if (!norm) {
        for (int jj = 0; jj < k; jj++) wt[jj] *= norm_min;
        return 0;
    }
    float d = sum > norm_min ? sum : norm_min;
    for (int jj = 0; jj < k; jj++) wt[jj] /= d;
    return 0;
}

/* gpt-oss's rule: the k largest of logit + bias[e] in descending order (ties: the lower expert first),
 * weighted by the softmax over those k only, times `scale` (Granite's residual multiplier; 1 for gpt-oss). p (E
 * logits) is overwritten, s is E floats of scratch. Returns 0, or -5 for NaN logits. */
static int route_select_topk_softmax(float *p, float *s, int E, int k, const float *bias, float scale, int64_t *ix,
                                     float *wt) {
    for (int e = 0; e < E; e++) {
        p[e] += bias[e];
        if (p[e] != p[e]) return -5;
    }
    for (int e = 0; e < E; e++) s[e] = p[e];  /* (take_top marks the taken ones in p) */
    if (take_top(p, E, k, ix)) return -5;
    for (int jj = 0; jj < k; jj++) wt[jj] = s[ix[jj]];
    const float top = wt[0];  /* the largest (kept: the loop overwrites wt[0] first) */
    float den = 0.f;
    for (int jj = 0; jj < k; jj++) { wt[jj] = expf(wt[jj] - top); den += wt[jj]; }
    for (int jj = 0; jj < k; jj++) wt[jj] = wt[jj] / den * scale;
    return 0;
}

/* Kolibri-1's rule: the k largest of logit + bias[e] in descending order (ties: the lower expert first), weighted
 * by the sigmoid of their unbiased logits, renormalised (over their sum) when norm, times scale. p (E logits) is
 * overwritten, s is E floats of scratch. Returns 0, or -5 for NaN logits. */
static int route_select_biased_logit_sigmoid(float *p, float *s, int E, int k, int norm, const float *bias,
                                             float scale, int64_t *ix, float *wt) {
    for (int e = 0; e < E; e++) {
        if (p[e] != p[e]) return -5;
        s[e] = p[e];
        p[e] += bias[e];
    }
    if (take_top(p, E, k, ix)) return -5;
    float sum = 0.f;
    for (int jj = 0; jj < k; jj++) sum += wt[jj] = 1.f / (1.f + expf(-s[ix[jj]]));
    for (int jj = 0; jj < k; jj++) wt[jj] = (norm ? wt[jj] / sum : wt[jj]) * scale;
    return 0;
}

/* One pick of Phi-3.5-MoE's sparsemixer (transformers' `sparsemixer` at inference): the best logit of p among
 * those not `skip`, weighted by its softmax over the logits within a relative 2 * eps of it, i.e. those e with
 * (best - p[e]) / max(|p[e]|, best) <= 2 * eps (NaN: kept, as torch's comparison). Returns the expert. */
static int sparsemixer_pick(const float *p, int E, int skip, float eps, float *wt) {
    int best = -1;
    for (int e = 0; e < E; e++)
        if (e != skip && (best < 0 || p[e] > p[best])) best = e;
    const float top = p[best];
    float den = 0.f;
    for (int e = 0; e < E; e++) {
        if (e == skip) continue;
        float f = fabsf(p[e]);
        if (f < top) f = top;
        if (!((top - p[e]) / f > 2.f * eps)) den += expf(p[e] - top);
    }
    *wt = 1.f / den;
    return best;
}

/* Sparsemixer's two experts: the best, then the best of the rest, each weighted by its own masked softmax (not
 * renormalised); eps is the config's router_jitter_noise. Returns 0, or -5 for NaN logits. */
static int route_select_sparsemixer(const float *p, int E, float eps, int64_t *ix, float *wt) {
    for (int e = 0; e < E; e++)
        if (p[e] != p[e]) return -5;
    ix[0] = sparsemixer_pick(p, E, -1, eps, wt);
    ix[1] = sparsemixer_pick(p, E, (int)ix[0], eps, wt + 1);
    return 0;
}

/* Row t's routes from its logits p (overwritten; s: E floats of scratch) by the job's rule. */
static int route_row(const route_job *j, float *p, float *s, long t) {
    int64_t *ix = j->idx + t * j->k;
    float *wt = j->w + t * j->k;
    if (j->kind == ROUTE_TOPK_SOFTMAX) return route_select_topk_softmax(p, s, j->E, j->k, j->bias, j->scale, ix, wt);
    if (j->kind == ROUTE_SPARSEMIXER) return route_select_sparsemixer(p, j->E, j->scale, ix, wt);
    if (j->kind == ROUTE_LOGIT_BIAS_SIGMOID)
        return route_select_biased_logit_sigmoid(p, s, j->E, j->k, j->norm, j->bias, j->scale, ix, wt);
    if (j->kind == ROUTE_SIGMOID)
        return route_select_sigmoid(p, s, j->E, j->k, j->norm, j->bias, j->scale, ix, wt, j->n_group, j->topk_group);
    if (j->kind == ROUTE_SOFTMAX_BIAS)
        return route_select_softmax_bias(p, s, j->E, j->k, j->norm, j->bias, j->scale, ix, wt);
    int rc = route_select(p, j->E, j->k, j->norm, ix, wt, j->n_group, j->topk_group);
    if (!rc && !j->norm && j->scale != 1.f)  /* DeepSeek-V2's routed_scaling_factor (not renormalised) */
        for (int jj = 0; jj < j->k; jj++) wt[jj] *= j->scale;
    return rc;
}

static void route_part(void *p, int id, int n) {
    route_job *j = (route_job *)p;
    int H = j->H, E = j->E;
    long t0, t1;
    split(j->T, id, n, &t0, &t1);
    float *buf = (float *)malloc(sizeof(float) * ((size_t)H + 2 * (size_t)E));
    if (!buf) { __atomic_store_n(&j->rc, -2, __ATOMIC_RELAXED); return; }
    float *xf = buf, *p_ = buf + H, *s = p_ + E;
    for (long t = t0; t < t1; t++) {
        if (j->bf16) load_x((const uint16_t *)j->x + t * H, 1, 1, H, xf);
        else memcpy(xf, (const float *)j->x + t * H, sizeof(float) * H);
        for (int e = 0; e < E; e++) p_[e] = route_logit(xf, j->W, e, H);
        if (route_row(j, p_, s, t))
            __atomic_store_n(&j->rc, -5, __ATOMIC_RELAXED);
    }
    free(buf);
}

/* The (row, expert) logits of a few rows, split between the threads: a decode step's router weights
 * are cold (the step's weight stream evicted them) and one thread read them alone. */
static void logits_part(void *p, int id, int n) {
    route_job *j = (route_job *)p;
    long a, b;
    split((long)j->T * j->E, id, n, &a, &b);
    for (long r = a; r < b; r++)
        j->logits[r] = route_logit(j->xf + (r / j->E) * j->H, j->W, (int)(r % j->E), j->H);
}

/* Router bytes from which a few rows' logits are split between the threads. */
#define ROUTE_SPLIT_BYTES (64 * 1024)

/* Top-k routing: for each of T rows of x, logits = x W^T in f32 (W f32 [E, H]); by `kind`: ROUTE_SOFTMAX,
 * softmax over all E (Mixtral, OLMoE, Qwen-MoE, DeepSeek-V2), the k largest probabilities in descending order
 * (ties: the lower expert first), renormalised to sum to one when `norm`, else times `scale`;
 * ROUTE_SIGMOID, route_select_sigmoid's rule;
 * ROUTE_SOFTMAX_BIAS, route_select_softmax_bias's; ROUTE_TOPK_SOFTMAX, route_select_topk_softmax's (the
 * three with a bias [E]); ROUTE_SPARSEMIXER, route_select_sparsemixer's (k 2, `scale` its jitter eps);
 * ROUTE_LOGIT_BIAS_SIGMOID, route_select_biased_logit_sigmoid's (with a bias [E]). With n_group > 1 (ROUTE_SOFTMAX and ROUTE_SIGMOID), the choice is limited to the
 * topk_group best of n_group equal groups first (keep_groups: DeepSeek-V2's group_limited_greedy, V3's
 * noaux_tc). idx int64 [T, k], w f32 [T, k].
 * Many rows are split between the threads; a few rows' logits are (the same values either way). Returns 0,
 * -2 (memory), -3 (bad k, kind or groups), -5 (a NaN logit). */
int coli_route(const void *x, int bf16, int T, int H, const float *W, int E, int k, int norm, int kind,
               int n_group, int topk_group, const float *bias, float scale, int64_t *idx, float *w) {
    if (k < 1 || k > E || kind < ROUTE_SOFTMAX || kind > ROUTE_LOGIT_BIAS_SIGMOID
        || (kind != ROUTE_SOFTMAX && kind != ROUTE_SPARSEMIXER && !bias) || (kind == ROUTE_SPARSEMIXER && k != 2))
        return -3;
    if (n_group < 1 || n_group > MAX_GROUPS || E % n_group || topk_group < 1 || topk_group > n_group
        || (n_group > 1 && (kind > ROUTE_SIGMOID || k > topk_group * (E / n_group))))
        return -3;
    route_job j = {x, bf16, T, H, E, k, norm, kind, n_group, topk_group, W, bias, scale, idx, w, 0, NULL, NULL};
    if (T >= ROUTE_PAR_MIN || coli_get_threads() < 2 || (long)E * H * 4 < ROUTE_SPLIT_BYTES) {
        coli_parallel(route_part, &j, T >= ROUTE_PAR_MIN ? coli_get_threads() : 1);
        return j.rc;
    }
    float *buf = (float *)malloc(sizeof(float) * ((size_t)T * H + (size_t)T * E + (size_t)E));
    if (!buf) return -2;
    j.xf = buf;
    j.logits = buf + (size_t)T * H;
    float *s = j.logits + (size_t)T * E;
    if (bf16) load_x(x, 1, T, H, j.xf);
    else memcpy(j.xf, x, sizeof(float) * (size_t)T * H);
    coli_parallel(logits_part, &j, coli_get_threads());
    for (int t = 0; t < T && !j.rc; t++)
        j.rc = route_row(&j, j.logits + (long)t * E, s, t);
    free(buf);
    return j.rc;
}
