/* Kimi Delta Attention decode rows (Kimi-Linear's linear-attention layers, colibri/models/kda.py) in one call: from
 * the layer's projections to the gated, head-normed output that goes to o_proj, for T rows each continuing its own
 * sequence's state.
 *
 * Why: the torch path spends ~25 small ops a layer and row (~1 ms a layer on the 0.44b-shaped model, against ~0.35
 * ms of weights); here one pass over each head's [D, D] state decays, updates and reads it.
 *
 * Per row and head h: q, k, v = silu(conv over [kept inputs, this input]) in f32 (the state shifts); q, k L2-normed
 * (x / sqrt(sum x^2 + 1e-6)), q times D^-1/2; g = -exp(A_log[h]) softplus(f + dt_bias) per channel; beta =
 * sigmoid(b) (rounded to bf16, as torch's bf16 sigmoid); S <- diag(exp(g)) S, S <- S + k (beta (v - S^T k))^T,
 * o = S^T q, rounded to bf16; then RMS-normed over the head, times its weight, times sigmoid(gate). The torch path's
 * arithmetic in f32, sums in another order: values agree to rounding, not to the bit. */
#include "common.h"

#define KDA_MAX_D 256  /* head width the row pass keeps on its stack (native_kda.py checks) */

typedef struct {
    int T, H, D, K;
    const uint16_t *qkv, *f, *b, *gate;  /* [T, 3HD], [T, HD], [T, H], [T, HD] */
    uint16_t *const *conv;               /* per row: bf16 [3HD, K-1] */
    float *const *ssm;                   /* per row: f32 [H, D, D] */
    const float *conv_w, *dt_bias, *A_log, *norm_w;  /* [3HD, K], [HD], [H], [D] */
    float eps;
    uint16_t *out;                       /* [T, HD] */
} kda_job;

static inline float silu_f(float x) { return x / (1.f + expf(-x)); }

static void l2(float *x, int D) {
    float s = 0.f;
    for (int d = 0; d < D; d++) s += x[d] * x[d];
    float n = sqrtf(s + 1e-6f);
    for (int d = 0; d < D; d++) x[d] /= n;
}

static void head_part(void *p, int id, int n) {
    const kda_job *j = (const kda_job *)p;
    int H = j->H, D = j->D, K = j->K;
    long HD = (long)H * D;
    long a, b;
    split((long)j->T * H, id, n, &a, &b);
    for (long i = a; i < b; i++) {
        int t = (int)(i / H), h = (int)(i % H);
        float q[KDA_MAX_D], k[KDA_MAX_D], v[KDA_MAX_D], g[KDA_MAX_D], acc[KDA_MAX_D], mem[KDA_MAX_D];
        float *parts[3] = {q, k, v};
        for (int c3 = 0; c3 < 3; c3++)
            for (int d = 0; d < D; d++) {
                long ch = c3 * HD + (long)h * D + d;
                parts[c3][d] = silu_f(conv_step(j->conv[t] + ch * (K - 1), j->conv_w + ch * K,
                                                j->qkv[(long)t * 3 * HD + ch], K));
            }
        l2(q, D);
        l2(k, D);
        float scale = 1.f / sqrtf((float)D), decay = expf(j->A_log[h]);
        for (int d = 0; d < D; d++) {
            q[d] *= scale;
            float x = bf16_to_f32(j->f[(long)t * HD + (long)h * D + d]) + j->dt_bias[(long)h * D + d];
            g[d] = expf(-decay * (x > 20.f ? x : logf(1.f + expf(x))));  /* exp(g): the channel's decay */
            mem[d] = 0.f;
            acc[d] = 0.f;
        }
        float beta = bf16_to_f32(f32_to_bf16(1.f / (1.f + expf(-bf16_to_f32(j->b[(long)t * H + h])))));
        float *S = j->ssm[t] + (long)h * D * D;
        for (int x = 0; x < D; x++) {  /* decay the key channel's row, and recall: mem = S^T k */
            float *s = S + (long)x * D, gx = g[x], kx = k[x];
            for (int y = 0; y < D; y++) {
                s[y] *= gx;
                mem[y] += s[y] * kx;
            }
        }
        for (int y = 0; y < D; y++) mem[y] = (v[y] - mem[y]) * beta;  /* (the delta, in place) */
        for (int x = 0; x < D; x++) {  /* the update, then o = S^T q */
            float *s = S + (long)x * D, kx = k[x], qx = q[x];
            for (int y = 0; y < D; y++) {
                s[y] += kx * mem[y];
                acc[y] += s[y] * qx;
            }
        }
        float o[KDA_MAX_D], ms = 0.f;
        for (int y = 0; y < D; y++) {
            o[y] = bf16_to_f32(f32_to_bf16(acc[y]));
            ms += o[y] * o[y];
        }
        float inv = 1.f / sqrtf(ms / (float)D + j->eps);
        const uint16_t *gt = j->gate + (long)t * HD + (long)h * D;
        uint16_t *out = j->out + (long)t * HD + (long)h * D;
        for (int y = 0; y < D; y++) {
            float sg = 1.f / (1.f + expf(-bf16_to_f32(gt[y])));
            out[y] = f32_to_bf16(j->norm_w[y] * (o[y] * inv) * sg);
        }
    }
}

/* T decode rows (one a sequence): qkv, f (f_b_proj's output), b (b_proj's), gate (g_b_proj's) bf16, contiguous;
 * conv[t] / ssm[t]: row t's states (updated in place) -> out bf16 [T, H D], o_proj's input. */
int coli_kda_rows(int T, int H, int D, int K, const void *qkv, const void *f, const void *b, const void *gate,
                  void *const *conv, float *const *ssm, const float *conv_w, const float *dt_bias,
                  const float *A_log, const float *norm_w, float eps, void *out) {
    if (T < 1 || T > MAX_T || H < 1 || D < 1 || D > KDA_MAX_D || K < 2) return -1;
    kda_job j = {T, H, D, K, (const uint16_t *)qkv, (const uint16_t *)f, (const uint16_t *)b,
                 (const uint16_t *)gate, (uint16_t *const *)conv, ssm, conv_w, dt_bias, A_log, norm_w, eps,
                 (uint16_t *)out};
    coli_parallel(head_part, &j, n_threads_for((long)T * H * D * D * 12));
    return 0;
}
