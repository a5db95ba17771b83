/* All decoder blocks of a step in one call, for a model whose every layer runs the fused native
 * blocks (attention: block.c; a resident routed-expert layer: moe.c): layer after layer,
 * coli_attn_block then coli_moe_block on the same buffers the per-layer calls would get.
 *
 * Why: a small model's decode step spent ~15% of its time in the Python between the per-layer
 * calls (checks, ctypes conversions, tensor allocations). The bits are those of the per-layer
 * path (tests/test_native.py). */
#include "common.h"

int coli_attn_block(const coli_attn_layer *L, int T, const void *h, const int *pos, void *const *kc,
                    void *const *vc, long ks, long vs, const float *cs, const float *sn, void *h_out, void *x_out);
int coli_moe_block(const void *x, const void *h, int T, int H, int I, const float *W, int E, int k, int norm,
                   const coli_qw *gate_up, const coli_qw *down, int scheme, int g, int64_t *idx, float *w,
                   float *ys, void *h_out);

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
