/* All decoder blocks of a step in one call, for a model whose every layer runs the fused native
 * blocks (attention: block.c; a resident routed-expert layer: moe.c): layer after layer,
 * coli_attn_block then coli_moe_block on the same buffers the per-layer calls would get.
 *
 * Why: a small model's decode step spent ~15% of its time in the Python between the per-layer
 * calls (checks, ctypes conversions, tensor allocations). The bits are those of the per-layer
 * path (tests/test_native.py). */
#include "common.h"

#ifdef COLI_PROF
long coli_prof[P_N];  /* common.h's stage timers: ns per stage, P_STEPS a count */
#endif

/* One routed-expert layer's constants (colibri/kernels/native.py's MoeLayer). */
typedef struct {
    int inter, n_experts, k, norm, scheme, group;
    const float *router;           /* f32 [n_experts, hidden] */
    const coli_qw *gate_up, *down; /* [n_experts] each: every expert present */
} coli_moe_layer;

/* h: bf16 [T, hidden], in place (the input rows, then the last block's output); pos [T]; kc/vc [L][T]
 * row t's key/value cache base for layer l at [l * T + t] (head strides ks / vs, the same in every
 * layer); cos/sin f32 [T, rot] (one rotary table for all layers); idx/w [L][T][k] receive each
 * layer's routes. Returns 0, or the failing block's code (-1 .. -5) with the layer in *failed. */
int coli_decode_layers(int n_layers, const coli_attn_layer *attn, const coli_moe_layer *moe, int T, void *h,
                       const int *pos, void *const *kc, void *const *vc, long ks, long vs, const float *cs,
                       const float *sn, int64_t *idx, float *w, int *failed) {
    if (T < 1 || T > MAX_T) return -1;
    int H = attn[0].hidden, kmax = 0;
    for (int l = 0; l < n_layers; l++) kmax = moe[l].k > kmax ? moe[l].k : kmax;
    uint16_t *mid = (uint16_t *)malloc(sizeof(uint16_t) * 2 * (size_t)T * H);
    float *ys = (float *)malloc(sizeof(float) * (size_t)T * kmax * H);
    int rc = mid && ys ? 0 : -2;
    for (int l = 0; l < n_layers && !rc; l++) {
        const coli_moe_layer *m = moe + l;
        uint16_t *hm = mid, *x = mid + (size_t)T * H;
        rc = coli_attn_block(attn + l, T, h, pos, kc + (long)l * T, vc + (long)l * T, ks, vs, cs, sn, hm, x);
        if (!rc)
            rc = coli_moe_block(x, hm, T, H, m->inter, m->router, m->n_experts, m->k, m->norm, m->gate_up, m->down,
                                m->scheme, m->group, idx + (long)l * T * kmax, w + (long)l * T * kmax, ys, h);
        if (rc) *failed = l;
    }
    free(mid);
    free(ys);
    return rc;
}

/* A model's ends around coli_decode_layers: its bf16 token embedding, final RMSNorm and quantized head
 * (colibri/models/native_step.py's _Tail). */
typedef struct {
    const uint16_t *embed; /* bf16 [vocab_in, hidden] */
    long vocab_in;
    const float *norm_w;   /* f32 [hidden] */
    float eps;
    coli_qw head;          /* [vocab, hidden], int8 or int4 */
    int scheme, group, vocab;
} coli_tail;

/* The whole forward of a step in one call: h[t] = embed[tokens[t]], every decoder block
 * (coli_decode_layers), then for the R rows `rows` the final norm and the head, logits f32 [R, vocab].
 * Why: after the blocks have streamed the step's weights through the caches, each of the embedding,
 * norm and head calls from Python ran cold, ~50-75 us each (8-15 us in a warm loop): ~5% of a small
 * model's decode step. The bits are those of the separate calls (bf16 rows, logits = bf16 head output
 * widened). Returns 0, -6 (a token id out of range), -3 (a bad row), or coli_decode_layers's code. */
int coli_decode_step(const coli_tail *tl, const int64_t *tokens, int n_layers, const coli_attn_layer *attn,
                     const coli_moe_layer *moe, int T, const int *pos, void *const *kc, void *const *vc, long ks,
                     long vs, const float *cs, const float *sn, int64_t *idx, float *w, int *failed,
                     const int64_t *rows, int R, float *logits) {
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
    int rc = coli_decode_layers(n_layers, attn, moe, T, h, pos, kc, vc, ks, vs, cs, sn, idx, w, failed);
    if (!rc) PROF(P_TAIL, {
        for (int r = 0; r < R; r++) memcpy(xr + (size_t)r * H, h + rows[r] * H, sizeof(uint16_t) * H);
        coli_rmsnorm(xr, 1, R, H, tl->norm_w, tl->eps, xn);
        void *yy = y;
        rc = coli_multi_gemm(xn, 1, R, H, tl->scheme, tl->group, 1, &tl->head, &V, &yy);
        for (long i = 0; !rc && i < (long)R * V; i++) logits[i] = bf16_to_f32(y[i]);
    });
    PROF_COUNT(P_STEPS);
    free(h);
    return rc;
}
