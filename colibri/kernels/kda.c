/* Kimi Delta Attention decode rows (Kimi-Linear's linear-attention layers, colibri/layers/kda.py) in one call: from
 * the layer's projections to the gated, head-normed output that goes to o_proj, for T rows each continuing its own
 * sequence's state.
 *
 * Why: the torch path spends ~25 small ops a layer and row (~1 ms a layer on the 0.44b-shaped model, against ~0.35
 * ms of weights); here one pass over each head's [D, D] state decays, updates and reads it.
 *
 * Per row and head h: q, k, v = silu(conv over [kept inputs, this input]) in f32 (the state shifts); q, k L2-normed
 * (x / sqrt(sum x^2 + 1e-6)), q times D^-1/2; g = -exp(A_log[h]) softplus(f + dt_bias) per channel (with a
 * lower bound L < 0, Ling 3.0's bounded form: g = L sigmoid(exp(A_log[h]) (f + dt_bias))); beta =
 * sigmoid(b) (rounded to bf16, as torch's bf16 sigmoid); S <- diag(exp(g)) S, S <- S + k (beta (v - S^T k))^T,
 * o = S^T q, rounded to bf16; then RMS-normed over the head, times its weight, times sigmoid(gate). The torch path's
 * arithmetic in f32, sums in another order: values agree to rounding, not to the bit. */
#include "common.h"

#define KDA_MAX_D 256  /* head width the row pass keeps on its stack (native_kda.py checks) */

typedef struct {
    int T, H, D, K, seq;  /* seq: the rows are consecutive positions of one sequence (state 0), in order */
    const uint16_t *qkv[3], *f, *b, *gate;  /* q, k, v [T, HD] each; [T, HD], [T, H], [T, HD] */
    uint16_t *const *conv;               /* per row: bf16 [3HD, K-1] (q, k, v channels) */
    float *const *ssm;                   /* per row: f32 [H, D, D] */
    const float *conv_w, *dt_bias, *A_log, *norm_w;  /* [3HD, K], [HD], [H], [D] */
    float eps, lower;                    /* lower: 0, Kimi's softplus decay; < 0, Ling's bounded one */
    uint16_t *out;                       /* [T, HD] */
} kda_job;

static inline float silu_f(float x) { return x / (1.f + expf(-x)); }

static void l2(float *x, int D) {
    float s = 0.f;
    for (int d = 0; d < D; d++) s += x[d] * x[d];
    float n = sqrtf(s + 1e-6f);
    for (int d = 0; d < D; d++) x[d] /= n;
}

/* Row t, head h: the conv step, the gates, the state's decay, update and reading, the gated head norm. */
static void row_head(const kda_job *j, int t, int h) {
    int H = j->H, D = j->D, K = j->K, st = j->seq ? 0 : t;
    long HD = (long)H * D;
    float q[KDA_MAX_D], k[KDA_MAX_D], v[KDA_MAX_D], g[KDA_MAX_D], acc[KDA_MAX_D], mem[KDA_MAX_D];
    float *parts[3] = {q, k, v};
    for (int c3 = 0; c3 < 3; c3++)
        for (int d = 0; d < D; d++) {
            long ch = c3 * HD + (long)h * D + d;
            parts[c3][d] = silu_f(conv_step(j->conv[st] + ch * (K - 1), j->conv_w + ch * K,
                                            j->qkv[c3][(long)t * HD + (long)h * D + d], K));
        }
    l2(q, D);
    l2(k, D);
    float scale = 1.f / sqrtf((float)D), decay = expf(j->A_log[h]);
    for (int d = 0; d < D; d++) {
        q[d] *= scale;
        float x = bf16_to_f32(j->f[(long)t * HD + (long)h * D + d]) + j->dt_bias[(long)h * D + d];
        float lg = j->lower < 0.f ? j->lower / (1.f + expf(-decay * x))
                                  : -decay * (x > 20.f ? x : logf(1.f + expf(x)));
        g[d] = expf(lg);  /* exp(g): the channel's decay */
        mem[d] = 0.f;
        acc[d] = 0.f;
    }
    float beta = bf16_to_f32(f32_to_bf16(1.f / (1.f + expf(-bf16_to_f32(j->b[(long)t * H + h])))));
    float *S = j->ssm[st] + (long)h * D * D;
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

/* Rows x heads (one state a row), or heads with the rows in order inside (a prompt's rows of one state). */
static void head_part(void *p, int id, int n) {
    const kda_job *j = (const kda_job *)p;
    long a, b;
    if (j->seq) {
        split(j->H, id, n, &a, &b);
        for (long h = a; h < b; h++)
            for (int t = 0; t < j->T; t++) row_head(j, t, (int)h);
        return;
    }
    split((long)j->T * j->H, id, n, &a, &b);
    for (long i = a; i < b; i++) row_head(j, (int)(i / j->H), (int)(i % j->H));
}

/* T rows: q, k, v, f (f_b_proj's output), b (b_proj's), gate (g_b_proj's) bf16, contiguous; with seq 0 each row is
 * a decode row of its own sequence (conv[t] / ssm[t]), with seq 1 the rows are one sequence's consecutive positions
 * (conv[0] / ssm[0]); states updated in place -> out bf16 [T, H D], o_proj's input. */
int coli_kda_rows(int T, int seq, int H, int D, int K, const void *q, const void *k, const void *v, const void *f,
                  const void *b, const void *gate, void *const *conv, float *const *ssm, const float *conv_w,
                  const float *dt_bias, const float *A_log, const float *norm_w, float eps, float lower, void *out) {
    if (T < 1 || T > MAX_T || H < 1 || D < 1 || D > KDA_MAX_D || K < 2 || lower > 0.f) return -1;
    kda_job j = {T, H, D, K, seq, {(const uint16_t *)q, (const uint16_t *)k, (const uint16_t *)v},
                 (const uint16_t *)f, (const uint16_t *)b, (const uint16_t *)gate, (uint16_t *const *)conv, ssm,
                 conv_w, dt_bias, A_log, norm_w, eps, lower, (uint16_t *)out};
    coli_parallel(head_part, &j, n_threads_for((long)T * H * D * D * 12));
    return 0;
}

/* h bf16 [T, hidden] (one decode row per sequence) -> h_out = h + o_proj(kda rows(projections of x)) with x =
 * in_norm(h), and x_out = post_norm(h_out), both bf16 [T, hidden]. w: q, k, v, b, f_a, g_a (from x), f_b (from
 * f_a's output), g_b (from g_a's), o_proj (scheme 8 or 4, group g); without low_rank (Ling's full-rank gates) q, k, v,
 * b, f, g (from x), o_proj. The calls the layer-by-layer native path makes, in its order: the same bits. */
int coli_kda_block(int T, int hidden, int H, int D, int K, int scheme, int g, const coli_qw *w, const void *h,
                   const float *in_w, float in_eps, const float *post_w, float post_eps, void *const *conv,
                   float *const *ssm, const float *conv_w, const float *dt_bias, const float *A_log,
                   const float *norm_w, float eps, float lower, int low_rank, void *h_out, void *x_out) {
    if (T < 1 || T > MAX_T || H < 1 || D < 1 || D > KDA_MAX_D) return -1;
    long HD = (long)H * D;
    size_t n = (size_t)T * (hidden + 3 * HD + H + 2 * D + 2 * HD + HD + hidden);
    uint16_t *buf = (uint16_t *)malloc(sizeof(uint16_t) * n);
    if (!buf) return -2;
    uint16_t *xn = buf, *qkv = xn + (long)T * hidden, *b = qkv + (long)T * 3 * HD, *fa = b + (long)T * H;
    uint16_t *q = qkv, *k = q + (long)T * HD, *v = k + (long)T * HD;  /* q, k, v [T, HD] each */
    uint16_t *ga = fa + (long)T * D, *f = ga + (long)T * D, *gate = f + (long)T * HD, *o = gate + (long)T * HD;
    uint16_t *y = o + (long)T * HD;
    coli_rmsnorm(h, 1, T, hidden, in_w, in_eps, xn);
    int nw = low_rank ? D : (int)HD;  /* the gates' first projections: [D]-wide halves, or the whole */
    int ns1[4] = {(int)HD, (int)HD, (int)HD, H}, ns2[2] = {nw, nw}, nhd = (int)HD, rc;
    void *o1[4] = {q, k, v, b}, *o2[2] = {low_rank ? (void *)fa : f, low_rank ? (void *)ga : gate};
    void *of = f, *og = gate, *oy = y;
    rc = coli_multi_gemm(xn, 1, T, hidden, scheme, g, 4, w, ns1, o1);
    if (!rc) rc = coli_multi_gemm(xn, 1, T, hidden, scheme, g, 2, w + 4, ns2, o2);
    if (!rc && low_rank) rc = coli_multi_gemm(fa, 1, T, D, scheme, g, 1, w + 6, &nhd, &of);
    if (!rc && low_rank) rc = coli_multi_gemm(ga, 1, T, D, scheme, g, 1, w + 7, &nhd, &og);
    if (!rc)
        rc = coli_kda_rows(T, 0, H, D, K, q, k, v, f, b, gate, conv, ssm, conv_w, dt_bias, A_log, norm_w, eps, lower,
                           o);
    if (!rc) rc = coli_multi_gemm(o, 1, T, (int)HD, scheme, g, 1, w + (low_rank ? 8 : 6), &hidden, &oy);
    if (!rc) {
        add_bf16((const uint16_t *)h, y, (long)T * hidden, (uint16_t *)h_out);
        coli_rmsnorm(h_out, 1, T, hidden, post_w, post_eps, x_out);
    }
    free(buf);
    return rc;
}
