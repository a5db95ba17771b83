/* MiniMax's lightning-attention layer (colibri/layers/lightning.py LightningAttention) for decode rows, as the whole
 * mixing half of a MiniMax block in one call: the input norm, qkv_proj and output_gate, each row's state step, the
 * heads' RMSNorm and sigmoid gate, out_proj, the weighted residual over the normed stream and the post norm.
 *
 * Why: the torch path spends ~20 small ops a layer and row (~0.4 ms a layer on the 0.44b-shaped model, against
 * ~0.2 ms of weights); here one pass over each head's state updates it and reads it with q at once.
 *
 * Per row and head: q, k, v = silu(qkv) (rounded to bf16, as torch's bf16 silu), S <- exp(-s) S + k^T v (each
 * product and sum rounded as torch's f32 ops: the state's bits), o = q S (sums in another order: o agrees to
 * rounding). The rest rounds where the torch path rounds. */
#include "common.h"

#define LA_MAX_D 512  /* head width the row pass keeps on its stack (native_lightning.py checks) */

typedef struct {
    int T, H, D;
    const uint16_t *qkv;  /* [T, H * 3D]: per head q, k, v */
    float *const *ssm;    /* per row: f32 [H, D, D] */
    const float *slope;   /* [H] */
    uint16_t *o;          /* [T, H * D] */
} la_job;

static inline float silu_bf16(uint16_t x) {
    float v = bf16_to_f32(x);
    return bf16_to_f32(f32_to_bf16(v / (1.f + expf(-v))));
}

/* Rows x heads: the state's decay and update, and its reading with q, in one pass over [D, D]. */
static void head_part(void *p, int id, int n) {
    const la_job *j = (const la_job *)p;
    int H = j->H, D = j->D;
    long a, b;
    split((long)j->T * H, id, n, &a, &b);
    for (long i = a; i < b; i++) {
        int t = (int)(i / H), h = (int)(i % H);
        const uint16_t *row = j->qkv + (long)t * H * 3 * D + (long)h * 3 * D;
        float q[LA_MAX_D], k[LA_MAX_D], v[LA_MAX_D], acc[LA_MAX_D];
        for (int d = 0; d < D; d++) {
            q[d] = silu_bf16(row[d]);
            k[d] = silu_bf16(row[D + d]);
            v[d] = silu_bf16(row[2 * D + d]);
            acc[d] = 0.f;
        }
        float r = expf(-j->slope[h]);
        float *S = j->ssm[t] + (long)h * D * D;
        for (int x = 0; x < D; x++) {  /* S's rows: one per key channel */
            float *s = S + (long)x * D, kx = k[x], qx = q[x];
            for (int y = 0; y < D; y++) {
                float val = s[y] * r + kx * v[y];
                s[y] = val;
                acc[y] += qx * val;
            }
        }
        uint16_t *o = j->o + (long)t * H * D + (long)h * D;
        for (int y = 0; y < D; y++) o[y] = f32_to_bf16(acc[y]);
    }
}

/* h bf16 [T, hidden] (one decode row per sequence: ssm[t] is row t's state) -> x = in_norm(h); h_out = alpha x +
 * beta out_proj(sigmoid(output_gate x) * norm(lightning(silu(qkv_proj x)))); x_out = post_norm(h_out), both bf16
 * [T, hidden]. w: qkv_proj [3 H D, hidden], output_gate [H D, hidden], out_proj [hidden, H D] (scheme 8 or 4,
 * group g). */
int coli_lightning_block(int T, int hidden, int H, int D, int scheme, int g, const coli_qw *w, const void *h,
                         const float *in_w, float in_eps, const float *post_w, float post_eps, float alpha, float beta,
                         float *const *ssm, const float *slope, const float *norm_w, float norm_eps, void *h_out,
                         void *x_out) {
    if (T < 1 || T > MAX_T || H < 1 || D < 1 || D > LA_MAX_D) return -1;
    long HD = (long)H * D;
    uint16_t *buf = (uint16_t *)malloc(sizeof(uint16_t) * (size_t)T * (hidden + 3 * HD + HD + 2 * HD + hidden));
    if (!buf) return -2;
    uint16_t *xn = buf, *qkv = xn + (long)T * hidden, *gate = qkv + (long)T * 3 * HD, *o = gate + (long)T * HD;
    uint16_t *on = o + (long)T * HD, *y = on + (long)T * HD;
    coli_rmsnorm(h, 1, T, hidden, in_w, in_eps, xn);
    int ns[2] = {(int)(3 * HD), (int)HD}, rc;
    void *outs[2] = {qkv, gate};
    rc = coli_multi_gemm(xn, 1, T, hidden, scheme, g, 2, w, ns, outs);
    if (!rc) {
        la_job j = {T, H, D, qkv, ssm, slope, o};
        coli_parallel(head_part, &j, n_threads_for((long)T * HD * D * 8));
        coli_rmsnorm(o, 1, T, (int)HD, norm_w, norm_eps, on);
        coli_gate_mul(on, gate, (long)T * HD);
        void *out = y;
        rc = coli_multi_gemm(on, 1, T, (int)HD, scheme, g, 1, w + 2, &hidden, &out);
    }
    if (!rc) {
        uint16_t *ho = (uint16_t *)h_out;
        for (long i = 0; i < (long)T * hidden; i++) {  /* alpha x + beta y, each term rounded as torch's bf16 ops */
            float ax = bf16_to_f32(f32_to_bf16(bf16_to_f32(xn[i]) * alpha));
            float by = bf16_to_f32(f32_to_bf16(bf16_to_f32(y[i]) * beta));
            ho[i] = f32_to_bf16(ax + by);
        }
        coli_rmsnorm(h_out, 1, T, hidden, post_w, post_eps, x_out);
    }
    free(buf);
    return rc;
}
