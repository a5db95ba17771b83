/* All decoder blocks of a step in one call, for a model whose every layer runs the fused native
 * blocks (attention: block.c; a resident routed-expert layer: moe.c): layer after layer,
 * coli_attn_block then coli_moe_block on the same buffers the per-layer calls would get.
 *
 * Why: a small model's decode step spent ~15% of its time in the Python between the per-layer
 * calls (checks, ctypes conversions, tensor allocations). The bits are those of the per-layer
 * path (tests/test_native.py). */
#include "common.h"
#include <stdatomic.h>

#ifdef COLI_PROF
long coli_prof[P_N];  /* common.h's stage timers: ns per stage, P_STEPS a count */
#endif

/* ----------------------------------------------------------- the next step's first weights, early
 * Between two decode steps the engine's Python runs (~0.5-0.7 ms a token on a small model) while the
 * memory sits idle, and the next step starts by streaming layer 0's attention weights. Those are
 * known now, so worker 1 reads them in the meantime (coli_background_post): each layer's q/k/v/o and
 * router in order, up to coli_pf_bytes, stopping as soon as the next step's first parallel job starts
 * (what it read then comes from the caches). Nothing it does changes a result. Measured on the 0.44b
 * int4 model (engine decode, sizes interleaved in one process, medians of 20 x 48 tokens): 4.30 ms a
 * token without, 4.21 with a worker that only spins through the gap, 4.05 at 8 MB, 3.98 at 24 MB (another
 * run 4.57 -> 4.19 at 8 MB); int8 6.51 -> 6.50 and 7.58 -> 7.00. 8 MB bounds what a long gap (a busy
 * server's Python) costs a core. */
#ifndef PF_BYTES
#define PF_BYTES (8L << 20)
#endif
#define PF_SPANS 64

typedef struct {
    const char *p;
    long n;
} pf_span;

long coli_pf_bytes = PF_BYTES; /* (a variable: benchmarks compare sizes in one process) */
static pf_span pf_spans[PF_SPANS]; /* written only by the holder of the background slot */
static int pf_n;

int coli_background_claim(void);
void coli_background_post(void (*fn)(void *, const atomic_int *), void *arg);

static void pf_job(void *arg, const atomic_int *stop) {
    (void)arg;
    volatile char sink = 0;
    for (int i = 0; i < pf_n; i++)
        for (long b = 0; b < pf_spans[i].n; b += 4096) {
            if (atomic_load_explicit(stop, memory_order_relaxed)) return;
            long e = b + 4096 < pf_spans[i].n ? b + 4096 : pf_spans[i].n;
            char acc = 0;
            for (long c = b; c < e; c += 64) acc ^= pf_spans[i].p[c];  /* loads: a prefetch may be dropped */
            sink ^= acc;
        }
}

static void pf_add(const void *p, long n, long *left) {
    if (!p || n <= 0 || *left <= 0 || pf_n >= PF_SPANS) return;
    pf_spans[pf_n].p = (const char *)p;
    pf_spans[pf_n].n = n < *left ? n : *left;
    *left -= pf_spans[pf_n++].n;
}

static void pf_weight(const coli_qw *w, int scheme, int g, long N, long K, long *left) {
    pf_add(w->q, scheme == 8 ? N * K : N * K / 2, left);
    if (scheme == 8) {
        pf_add(w->s, N * 4, left);
    } else {
        pf_add(w->s, N * (K / g) * 2, left);
        pf_add(w->m, N * (K / g) * 2, left);
    }
}

/* One routed-expert layer's constants (colibri/kernels/native.py's MoeLayer). */
typedef struct {
    int inter, n_experts, k, norm, scheme, group;
    const float *router;           /* f32 [n_experts, hidden] */
    const coli_qw *gate_up, *down; /* [n_experts] each: every expert present */
    const float *bias;             /* the biased routing kinds' selection bias [n_experts] */
    float scale;                   /* coli_route's scale (sigmoid: the weights' factor; softmax-bias: a floor) */
    const coli_mlp *shared;        /* a shared expert, or NULL; with n_experts 0 the layer's dense MLP */
    int kind;                      /* coli_route's rule (common.h ROUTE_*) */
    const coli_expert_act *act;    /* the experts' activation and biases, or NULL (SiLU-GLU) */
    int n_group, topk_group;       /* coli_route's group-limited choice (1, 1: none) */
    const float *out_w;            /* non-NULL: the sublayer output's RMSNorm before the residual add (AFMoE) */
    float out_eps;
    coli_layer_hook hook;          /* non-NULL: the layer's experts stream in (moe_streamed), or it looks ahead */
    int layer;                     /* the model's index of the layer, for the hook */
    int ahead;                     /* > 0: the hook gets the routes of layer (this + ahead) predicted */
} coli_moe_layer;

/* The look-ahead's prediction (store/lookahead.py, here without a trip through torch): layer n's post-attention
 * norm and router applied to this layer's residual hm [T, H] -> pidx [T, n's k]. 0, or a code. */
static int predict(const coli_attn_layer *na, const coli_moe_layer *nm, const void *hm, int T, int H,
                   int64_t *pidx) {
    uint16_t *x = (uint16_t *)malloc(sizeof(uint16_t) * (size_t)T * H);
    float *w = (float *)malloc(sizeof(float) * (size_t)T * nm->k);
    int rc = x && w ? coli_block_norm(hm, T, H, na->post_w, na->post_b, na->post_eps, x) : -2;
    if (!rc)
        rc = coli_route(x, 1, T, H, nm->router, nm->n_experts, nm->k, nm->norm, nm->kind,
                        nm->n_group ? nm->n_group : 1, nm->topk_group ? nm->topk_group : 1, nm->bias, nm->scale,
                        pidx, w);
    free(x);
    free(w);
    return rc;
}

/* A routed layer with a hook: route x, tell the engine (COLI_HOOK_ROUTED: it claims the routed experts, starts
 * reading those not in memory and looks ahead to the next layers), then, while some are still being read,
 * compute those in the table and wait for the next read to land (COLI_HOOK_WAIT), in the order they land; the
 * last ones, the slot-order sum, the shared MLP and the residual as coli_moe_block. Each slot's output has its
 * own row of ys, so the bits are coli_moe_block's with every expert in memory (Llama 4's scaled inputs: all
 * experts waited for, then computed at once). */
static int moe_streamed(const coli_moe_layer *m, const coli_attn_layer *na, const coli_moe_layer *nm,
                        const void *x, const void *hm, int T, int H, int64_t *idx, float *w, float *ys, void *h_out) {
    int E = m->n_experts, P = T * m->k, rc;
    PROF(P_ROUTE, rc = coli_route(x, 1, T, H, m->router, E, m->k, m->norm, m->kind, m->n_group ? m->n_group : 1,
                                  m->topk_group ? m->topk_group : 1, m->bias, m->scale, idx, w));
    if (rc) return rc;
    int64_t *pidx = nm ? (int64_t *)malloc(sizeof(int64_t) * (size_t)T * nm->k) : NULL;
    int np = pidx && !predict(na, nm, hm, T, H, pidx) ? T * nm->k : 0;  /* (a failed prediction: none) */
    rc = m->hook(m->layer, COLI_HOOK_ROUTED, idx, P, hm, pidx, np);
    free(pidx);
    if (rc < 0) return COLI_HOOK_FAILED;
    coli_qw *gu = (coli_qw *)calloc(2 * (size_t)E, sizeof(coli_qw)), *dn = gu + E;
    char *done = (char *)calloc((size_t)E, 1);  /* experts computed already */
    if (!gu || !done) rc = -2;
    int early = !(m->act && m->act->input_scaled);
    while (!rc) {
        int fresh = 0, left = 0;
        memset(gu, 0, sizeof(coli_qw) * 2 * (size_t)E);
        for (int p = 0; p < P; p++) {
            int64_t e = idx[p];
            if (done[e] || gu[e].q) continue;
            if (m->gate_up[e].q) gu[e] = m->gate_up[e], dn[e] = m->down[e], fresh++;
            else left++;
        }
        if (!left) break;
        if (fresh && early) {  /* the experts in memory, while the others are read */
            rc = coli_moe(x, 1, T, H, m->inter, m->k, idx, w, E, gu, dn, m->scheme, m->group, ys, NULL, m->act);
            for (int e = 0; e < E; e++) done[e] |= gu[e].q != NULL;
        }
        int got = rc ? 0 : m->hook(m->layer, COLI_HOOK_WAIT, idx, P, hm, NULL, 0);
        if (!rc && got <= 0) rc = got < 0 ? COLI_HOOK_FAILED : COLI_MISS;  /* (none left to land, one missing) */
    }
    if (!rc) {  /* the rest, then every slot summed */
        for (int e = 0; e < E; e++) {
            gu[e] = done[e] ? (coli_qw){0} : m->gate_up[e];
            dn[e] = done[e] ? (coli_qw){0} : m->down[e];
        }
        rc = coli_moe_routed(x, hm, T, H, m->inter, E, m->k, gu, dn, m->scheme, m->group, idx, w, ys, h_out,
                             m->shared, m->act, m->out_w, m->out_eps);
    }
    free(gu);
    free(done);
    return rc;
}

/* Post the read-ahead of the layers' first weights (see pf_job) for the time until the next step. */
static void pf_post(int n_layers, const coli_attn_layer *attn, const coli_moe_layer *moe) {
    if (coli_pf_bytes <= 0 || !coli_background_claim()) return;
    pf_n = 0;
    long left = coli_pf_bytes;
    for (int l = 0; l < n_layers && left > 0; l++) {
        const coli_attn_layer *a = attn + l;
        const coli_mla_layer *m = a->mla;
        if (m) {  /* the projections that read the block's input, in order */
            long nq = (long)m->heads * (m->nope + m->rope);
            pf_weight(&m->wq, m->scheme, m->group, m->q_lora ? m->q_lora : nq, m->hidden, &left);
            pf_weight(&m->wkva, m->scheme, m->group, m->kv_lora + m->rope, m->hidden, &left);
            pf_add(moe[l].router, (long)moe[l].n_experts * a->hidden * 4, &left);
            continue;
        }
        long nq = (long)a->heads * a->head_dim, nk = (long)a->kv_heads * a->head_dim;
        pf_weight(&a->wq, a->scheme, a->group, nq, a->hidden, &left);
        pf_weight(&a->wk, a->scheme, a->group, nk, a->hidden, &left);
        pf_weight(&a->wv, a->scheme, a->group, nk, a->hidden, &left);
        pf_weight(&a->wo, a->scheme, a->group, a->hidden, nq, &left);
        pf_add(moe[l].router, (long)moe[l].n_experts * a->hidden * 4, &left);
    }
    coli_background_post(pf_job, NULL);
}

/* h: bf16 [T, hidden], in place (the input rows, then the last block's output); pos [T]; kc/vc [L][T]
 * row t's key/value cache base for layer l at [l * T + t] (head strides ks / vs and the rows' types kvt,
 * coli_attn_block's, the same in every layer); ctab/stab the rotary cos/sin tables f32 [tab_rows, rot] (one for all layers but those with
 * their own, coli_attn_layer.rotary: row p is position p's; the rows' own are gathered here, where slicing them in Python cost four torch ops a
 * step); idx/w [L][T][k] receive each layer's routes. Returns 0, or the failing block's code (-1 .. -5,
 * -1 also a position past the tables) with the layer in *failed. */
int coli_decode_layers(int n_layers, const coli_attn_layer *attn, const coli_moe_layer *moe, int T, void *h,
                       const int *pos, void *const *kc, void *const *vc, long ks, long vs, int kvt, const float *ctab,
                       const float *stab, long tab_rows, int64_t *idx, float *w, int *failed) {
    if (T < 1 || T > MAX_T) return -1;
    int H = attn[0].hidden, rot = 0, rot2 = 0, kmax = 0;
    for (int t = 0; t < T; t++)
        if (pos[t] < 0 || pos[t] >= tab_rows) return -1;
    for (int l = 0; l < n_layers; l++) {
        kmax = moe[l].k > kmax ? moe[l].k : kmax;
        int *r = attn[l].rotary ? &rot2 : &rot;  /* the width of the call's table, of the layers' own */
        *r = attn[l].rot > *r ? attn[l].rot : *r;  /* (a layer without RoPE has 0: Llama 4's) */
    }
    uint16_t *mid = (uint16_t *)malloc(sizeof(uint16_t) * 2 * (size_t)T * H);
    float *ys = (float *)malloc(sizeof(float) * (size_t)T * kmax * H);
    /* the call's rows, then (cs2, sn2) those of the layers with tables of their own, gathered when they change */
    float *cs = (float *)malloc(sizeof(float) * (2 * (size_t)T * (rot + rot2) + 1)), *sn = cs + (size_t)T * rot;
    float *cs2 = sn + (size_t)T * rot, *sn2 = cs2 + (size_t)T * rot2;
    const float *got = NULL;
    int rc = mid && ys && cs ? 0 : -2;
    for (int t = 0; t < T && !rc; t++) {
        memcpy(cs + (size_t)t * rot, ctab + (long)pos[t] * rot, sizeof(float) * rot);
        memcpy(sn + (size_t)t * rot, stab + (long)pos[t] * rot, sizeof(float) * rot);
    }
    for (int l = 0; l < n_layers && !rc; l++) {
        const coli_moe_layer *m = moe + l;
        const coli_attn_layer *a = attn + l;
        uint16_t *hm = mid, *x = mid + (size_t)T * H;
        const float *lc = cs, *ls = sn;
        if (a->rotary) {
            const coli_attn_rotary *rt = a->rotary;
            int r = a->rot;
            for (int t = 0; t < T && rt->cos != got; t++) {
                if (pos[t] >= rt->rows) { rc = -1; break; }
                memcpy(cs2 + (size_t)t * r, rt->cos + (long)pos[t] * r, sizeof(float) * r);
                memcpy(sn2 + (size_t)t * r, rt->sin + (long)pos[t] * r, sizeof(float) * r);
            }
            got = rc ? NULL : rt->cos;
            lc = cs2, ls = sn2;
        }
        if (!rc)
            rc = coli_attn_block(a, T, h, pos, kc + (long)l * T, vc + (long)l * T, ks, vs, kvt, lc, ls, hm, x);
        if (!rc && m->hook && m->n_experts > 0) {
            int n = m->ahead > 0 && l + m->ahead < n_layers ? l + m->ahead : -1;  /* (the next within this call) */
            rc = moe_streamed(m, n < 0 ? NULL : attn + n, n < 0 ? NULL : moe + n, x, hm, T, H,
                              idx + (long)l * T * kmax, w + (long)l * T * kmax, ys, h);
        }
        else if (!rc)
            rc = coli_moe_block(x, hm, T, H, m->inter, m->router, m->n_experts, m->k, m->norm, m->kind,
                                m->n_group ? m->n_group : 1, m->topk_group ? m->topk_group : 1, m->bias,
                                m->scale, m->gate_up, m->down, m->scheme, m->group, idx + (long)l * T * kmax,
                                w + (long)l * T * kmax, ys, h, m->shared, m->act, m->out_w, m->out_eps);
        if (rc) *failed = l;
    }
    free(mid);
    free(ys);
    free(cs);
    return rc;
}

/* A model's ends around coli_decode_layers: its bf16 token embedding, final norm and quantized head
 * (colibri/engine/native_step.py's _Tail). */
typedef struct {
    const uint16_t *embed; /* bf16 [vocab_in, hidden] */
    long vocab_in;
    const float *norm_w;   /* f32 [hidden] */
    float eps;
    coli_qw head;          /* [vocab, hidden], int8 or int4 */
    int scheme, group, vocab;
    const float *norm_b;   /* non-NULL: the final norm is a LayerNorm with this bias, f32 (Phi-3.5-MoE) */
    const uint16_t *head_b; /* bf16 [vocab] or NULL: the head's bias (Phi-3.5-MoE's lm_head) */
} coli_tail;

/* The whole forward of a step in one call: h[t] = embed[tokens[t]], every decoder block
 * (coli_decode_layers), then for the R rows `rows` the final norm and the head, logits f32 [R, vocab].
 * Why: after the blocks have streamed the step's weights through the caches, each of the embedding,
 * norm and head calls from Python ran cold, ~50-75 us each (8-15 us in a warm loop): ~5% of a small
 * model's decode step. The bits are those of the separate calls (bf16 rows, logits = bf16 head output
 * widened). Returns 0, -6 (a token id out of range), -3 (a bad row), or coli_decode_layers's code. */
int coli_decode_step(const coli_tail *tl, const int64_t *tokens, int n_layers, const coli_attn_layer *attn,
                     const coli_moe_layer *moe, int T, const int *pos, void *const *kc, void *const *vc, long ks,
                     long vs, int kvt, const float *ctab, const float *stab, long tab_rows, int64_t *idx, float *w,
                     int *failed, const int64_t *rows, int R, float *logits) {
    if (T < 1 || T > MAX_T || R < 1 || R > T) return -1;
    int H = attn[0].hidden, V = tl->vocab;
    for (int t = 0; t < T; t++)
        if (tokens[t] < 0 || tokens[t] >= tl->vocab_in) return -6;
    for (int r = 0; r < R; r++)
        if (rows[r] < 0 || rows[r] >= T) return -3;
    uint16_t *h = (uint16_t *)malloc(sizeof(uint16_t) * ((size_t)T * H + 2 * (size_t)R * H + (size_t)R * V));
    if (!h) return -2;
    uint16_t *xr = h + (size_t)T * H, *xn = xr + (size_t)R * H, *y = xn + (size_t)R * H;
    for (int t = 0; t < T; t++) memcpy(h + (size_t)t * H, tl->embed + tokens[t] * H, sizeof(uint16_t) * H);
    int rc = coli_decode_layers(n_layers, attn, moe, T, h, pos, kc, vc, ks, vs, kvt, ctab, stab, tab_rows, idx, w,
                                failed);
    if (!rc) PROF(P_TAIL, {
        for (int r = 0; r < R; r++) memcpy(xr + (size_t)r * H, h + rows[r] * H, sizeof(uint16_t) * H);
        coli_block_norm(xr, R, H, tl->norm_w, tl->norm_b, tl->eps, xn);
        void *yy = y;
        rc = coli_multi_gemm(xn, 1, R, H, tl->scheme, tl->group, 1, &tl->head, &V, &yy);
        if (!rc) add_rows(y, tl->head_b, R, V);  /* (the head's own bias add: bf16 + bf16, one rounding) */
        for (long i = 0; !rc && i < (long)R * V; i++) logits[i] = bf16_to_f32(y[i]);
    });
    PROF_COUNT(P_STEPS);
    free(h);
    if (!rc) pf_post(n_layers, attn, moe);
    return rc;
}

/* The first index of the largest of n values, a NaN counting as the largest (numpy's and torch's argmax). */
static long argmax_f32(const float *x, long n) {
    long best = 0;
    for (long i = 0; i < n; i++) {
        if (x[i] != x[i]) return i;
        if (x[i] > x[best]) best = i;
    }
    return best;
}

/* Up to n_steps decode steps of T sequences (one row each) in one call: step s feeds row t's token at
 * position pos0[t] + s (the first ones are tok[0..T)) through coli_decode_step and picks the next into
 * out[s * T + t]: the argmax of that row's logits, or where samp is not NULL and row t's temperature
 * samp[4t] > 0, coli_sample with (temperature, top_k, top_p, min_p) = samp[4t..4t+4) and the uniform
 * u[s * T + t]; where procs is not NULL, of the logits after procs[t]'s processors (procs.c). Where lp_n is not
 * NULL and lp_n[t] >= 0, the pick's log-probability under the model's logits goes to lp[s * T + t] and the
 * lp_n[t] most likely tokens' to lp_ids / lp_vals at (s * T + t) * COLI_LP_MAX (logprobs.c). The run ends after a step in which any row picked a token of stop[0..n_stop).
 * kc/vc: per (layer, row) the row's K/V cache pointer, as coli_decode_step; the rotary tables must hold
 * every position < pos0[t] + n_steps. idx/w: each step's routes, [n_steps, L, T, k].
 * Why: between one-token steps the engine's Python ran ~0.6-0.7 ms a step on a small model (15-20% of a
 * lone request's decode, more with several rows), while requests that need nothing of the picked tokens
 * but the tokens (greedy or plain sampling) need none of it until they are handed out. The bits are those
 * of one coli_decode_step per step and the picks those of single steps. Returns the steps run (>= 1), or
 * the first step's error code (-7: a row coli_sample cannot sample; a later step's failure ends the run
 * early: the caller's next step meets it again; -8: a processor's token id out of range). */
int coli_decode_run(const coli_tail *tl, const int64_t *tok0, int T, int n_layers, const coli_attn_layer *attn,
                    const coli_moe_layer *moe, const int *pos0, void *const *kc, void *const *vc, long ks, long vs,
                    int kvt, const float *ctab, const float *stab, long tab_rows, int n_steps, const int64_t *stop,
                    int n_stop, const float *samp, const double *u, coli_procs *procs, const int *lp_n, float *lp,
                    int64_t *lp_ids, float *lp_vals, int64_t *out, int64_t *idx, float *w, int *failed) {
    if (n_steps < 1 || T < 1 || T > MAX_T) return -1;
    for (int t = 0; t < T; t++)
        if (pos0[t] + n_steps > tab_rows) return -1;
    float *logits = (float *)malloc(sizeof(float) * (size_t)tl->vocab * (T + 1));  /* (+1: a raw row's copy) */
    int *mark = procs ? (int *)calloc((size_t)tl->vocab, sizeof(int)) : NULL;  /* procs.c's marks */
    if (!logits || (procs && !mark)) {
        free(logits);
        free(mark);
        return -2;
    }
    float *raw = logits + (size_t)tl->vocab * T;
    int64_t tok[MAX_T], rows[MAX_T];
    int pos[MAX_T];
    for (int t = 0; t < T; t++) tok[t] = tok0[t], rows[t] = t;
    int k = moe[0].k, s = 0;
    for (; s < n_steps; s++) {
        for (int t = 0; t < T; t++) pos[t] = pos0[t] + s;
        size_t r = (size_t)s * n_layers * T * k;
        int rc = coli_decode_step(tl, tok, n_layers, attn, moe, T, pos, kc, vc, ks, vs, kvt, ctab, stab, tab_rows,
                                  idx + r, w + r, failed, rows, T, logits);
        int end = 0;
        for (int t = 0; t < T && !rc; t++) {
            float *row = logits + (size_t)t * tl->vocab;
            const float *sp = samp ? samp + 4 * t : NULL;
            int want_lp = lp_n && lp_n[t] >= 0;
            const float *model = row;  /* the model's logits, for the log-probs: before the processors */
            if (want_lp && procs) {
                memcpy(raw, row, sizeof(float) * tl->vocab);
                model = raw;
            }
            if (procs && (rc = coli_procs_apply(procs + t, row, tl->vocab, mark, s * T + t + 1)))
                break;
            long pick = sp && sp[0] > 0.f
                ? coli_sample(row, tl->vocab, sp[0], (int)sp[1], sp[2], sp[3], u[(size_t)s * T + t])
                : argmax_f32(row, tl->vocab);
            if (pick < 0) rc = pick == -2 ? -2 : -7;
            size_t at = (size_t)s * T + t;
            if (!rc && want_lp && coli_logprobs(model, tl->vocab, pick, lp_n[t], lp + at, lp_ids + at * COLI_LP_MAX,
                                               lp_vals + at * COLI_LP_MAX))
                rc = -7;
            tok[t] = out[(size_t)s * T + t] = pick;
            if (!rc && procs) coli_procs_took(procs + t, pick);
            for (int j = 0; j < n_stop && !end; j++) end = stop[j] == tok[t];
        }
        if (rc) {
            free(logits);
            free(mark);
            return s ? s : rc;
        }
        if (end) {
            s++;
            break;
        }
    }
    free(logits);
    free(mark);
    return s;
}
