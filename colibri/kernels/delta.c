/* Gated DeltaNet decode rows (Qwen3-Next's linear attention, colibri/layers/linear_attn.py) in one call:
 * from the layer's two input projections to the gated-normed output that goes to out_proj, for T rows each
 * continuing its own sequence's state.
 *
 * Why: the torch path spends ~45 small ops a layer and row (0.9 ms a layer on the 0.44b-shaped model, most of
 * a decode step), and passes over each head's [Dk, Dv] state five times; here two passes.
 *
 * Per row, from the input projections (parts, each with its row stride): qkv bf16 [C] (C = 2 nk dk + nv dv
 * channels: every q head, every k head, every v head; value head h reads key head h / (nv / nk)), z bf16
 * [nv * dv], b and a bf16 [nv]; its states: conv bf16 [C, K-1], f32 [nv, dk, dv]. The arithmetic is the torch path's in f32 (its roundings to bf16 where it
 * rounds: the state's inputs, the delta rule's output before the gated norm, the norm before its weight, the
 * output); sums run in another order, so the values agree to rounding, not to the bit. */
#include "common.h"

typedef struct {
    int T, nk, nv, dk, dv, K;
    const uint16_t *qkv, *z, *b, *a;
    long sq, sz, sb, sa;  /* their row strides */
    uint16_t *const *conv;
    float *const *ssm;
    const float *conv_w, *A_log, *dt_bias, *norm_w;
    float eps;
    float *y;  /* [T, C]: the convolution's outputs, after silu */
    uint16_t *out;  /* [T, nv * dv] */
} delta_job;

static inline float silu(float x) { return x / (1.f + expf(-x)); }
static inline float softplus(float x) { return x > 20.f ? x : log1pf(expf(x)); }  /* torch's threshold */

/* Rows x channels: the depthwise convolution over [kept inputs, this input], silu; the state shifts by one. */
static void conv_part(void *p, int id, int n) {
    const delta_job *j = (const delta_job *)p;
    int C = 2 * j->nk * j->dk + j->nv * j->dv, K = j->K;
    long a, b;
    split((long)j->T * C, id, n, &a, &b);
    for (long i = a; i < b; i++) {
        int t = (int)(i / C), c = (int)(i % C);
        uint16_t *st = j->conv[t] + (long)c * (K - 1);
        const float *w = j->conv_w + (long)c * K;
        j->y[i] = silu(conv_step(st, w, j->qkv[(long)t * j->sq + c], K));
    }
}

/* Rows x value heads: L2-normed q, k of its key head, the delta rule on its state, the gated RMSNorm. */
static void head_part(void *p, int id, int n) {
    const delta_job *j = (const delta_job *)p;
    int nk = j->nk, nv = j->nv, dk = j->dk, dv = j->dv, r = nv / nk;
    int C = 2 * nk * dk + nv * dv;
    float q[1024], k[1024], mem[1024], o[1024];  /* dk, dv <= 1024 (native.py checks) */
    long a, b;
    split((long)j->T * nv, id, n, &a, &b);
    for (long i = a; i < b; i++) {
        int t = (int)(i / nv), h = (int)(i % nv), gi = h / r;
        const float *y = j->y + (long)t * C;
        const float *yq = y + (long)gi * dk, *yk = y + (long)nk * dk + (long)gi * dk, *yv = y + 2L * nk * dk + (long)h * dv;
        float sq = 0.f, sk = 0.f;
        for (int d = 0; d < dk; d++) sq += yq[d] * yq[d], sk += yk[d] * yk[d];
        float iq = 1.f / sqrtf(sq + 1e-6f), ik = 1.f / sqrtf(sk + 1e-6f), scale = 1.f / sqrtf((float)dk);
        for (int d = 0; d < dk; d++) q[d] = yq[d] * iq * scale, k[d] = yk[d] * ik;
        float beta = 1.f / (1.f + expf(-bf16_to_f32(j->b[(long)t * j->sb + h])));
        float g = -expf(j->A_log[h]) * softplus(bf16_to_f32(j->a[(long)t * j->sa + h]) + j->dt_bias[h]);
        float decay = expf(g);
        float *S = j->ssm[t] + (long)h * dk * dv;
        for (int e = 0; e < dv; e++) mem[e] = 0.f, o[e] = 0.f;
        for (int d = 0; d < dk; d++) {  /* decay, and what the state recalls for k */
            float *s = S + (long)d * dv, kd = k[d];
            for (int e = 0; e < dv; e++) {
                s[e] *= decay;
                mem[e] += s[e] * kd;
            }
        }
        for (int e = 0; e < dv; e++) mem[e] = (yv[e] - mem[e]) * beta;  /* the correction to write */
        for (int d = 0; d < dk; d++) {  /* write it, and read the new state with q */
            float *s = S + (long)d * dv, kd = k[d], qd = q[d];
            for (int e = 0; e < dv; e++) {
                s[e] += kd * mem[e];
                o[e] += s[e] * qd;
            }
        }
        /* the gated norm on the output rounded to bf16, as the torch path rounds it */
        float ms = 0.f;
        for (int e = 0; e < dv; e++) {
            o[e] = bf16_to_f32(f32_to_bf16(o[e]));
            ms += o[e] * o[e];
        }
        float inv = 1.f / sqrtf(ms / (float)dv + j->eps);
        const uint16_t *z = j->z + (long)t * j->sz + (long)h * dv;
        uint16_t *out = j->out + (long)t * nv * dv + (long)h * dv;
        for (int e = 0; e < dv; e++) {
            float nrm = bf16_to_f32(f32_to_bf16(o[e] * inv));
            out[e] = f32_to_bf16(j->norm_w[e] * nrm * silu(bf16_to_f32(z[e])));
        }
    }
}

/* T rows (see above) -> out bf16 [T, nv * dv]; conv[t] / ssm[t]: row t's states, updated in place. Returns 0,
 * -1 (a shape out of range), -2 (memory). */
int coli_delta_rows(int T, int nk, int nv, int dk, int dv, int K, const void *const *parts, const long *strides,
                    void *const *conv, float *const *ssm, const float *conv_w, const float *A_log,
                    const float *dt_bias, const float *norm_w, float eps, void *out) {
    if (T < 1 || T > MAX_T || nk < 1 || nv % nk || dk < 1 || dk > 1024 || dv < 1 || dv > 1024 || K < 1) return -1;
    long C = 2L * nk * dk + (long)nv * dv;
    float *y = (float *)coli_alloc(sizeof(float) * (size_t)(T * C));
    if (!y) return -2;
    delta_job j = {T, nk, nv, dk, dv, K, (const uint16_t *)parts[0], (const uint16_t *)parts[1],
                   (const uint16_t *)parts[2], (const uint16_t *)parts[3], strides[0], strides[1], strides[2],
                   strides[3], (uint16_t *const *)conv, ssm, conv_w, A_log, dt_bias, norm_w, eps, y, (uint16_t *)out};
    coli_parallel(conv_part, &j, n_threads_for(T * C * 8));
    coli_parallel(head_part, &j, n_threads_for((long)T * nv * dk * dv * 8));
    free(y);
    return 0;
}

/* The whole mixing half of a linear-attention decoder block, as coli_attn_block is for attention: h bf16
 * [T, hidden] -> h_out = h + out_proj(delta rows(in_proj(rmsnorm(h)))) and x_out = post_norm(h_out), both bf16
 * [T, hidden]. w: the n_in input projections (2: in_proj_qkvz, in_proj_ba; 4: in_proj_qkv, _z, _b, _a), then
 * out_proj (scheme 8 or 4, group g). The same kernels, in the same order, on the same bf16 intermediates as the
 * layer-by-layer native path: the same bits. */
int coli_delta_block(int T, int hidden, int nk, int nv, int dk, int dv, int K, int scheme, int g, int n_in,
                     const coli_qw *w, const void *h, const float *in_w, float in_eps, const float *post_w,
                     float post_eps, void *const *conv, float *const *ssm, const float *conv_w, const float *A_log,
                     const float *dt_bias, const float *norm_w, float eps, void *h_out, void *x_out) {
    if (T < 1 || T > MAX_T || nk < 1 || nv % nk || (n_in != 2 && n_in != 4)) return -1;
    long C = 2L * nk * dk + (long)nv * dv, vd = (long)nv * dv;
    int N[4] = {(int)(C + vd), 2 * nv, 0, 0};
    if (n_in == 4) N[0] = (int)C, N[1] = (int)vd, N[2] = N[3] = nv;
    long nin = (long)N[0] + N[1] + N[2] + N[3];
    uint16_t *buf = (uint16_t *)malloc(sizeof(uint16_t) * (size_t)T * (hidden + nin + vd + hidden));
    if (!buf) return -2;
    uint16_t *xn = buf, *o = xn + (long)T * hidden + T * nin, *y = o + T * vd;
    void *outs[4];
    const void *parts[4];
    long strides[4];
    for (int i = 0, off = 0; i < n_in; off += N[i], i++) outs[i] = xn + (long)T * hidden + (long)T * off;
    if (n_in == 2) {  /* qkv and z share in_proj_qkvz's rows, b and a in_proj_ba's */
        parts[0] = outs[0], parts[1] = (uint16_t *)outs[0] + C, parts[2] = outs[1], parts[3] = (uint16_t *)outs[1] + nv;
        strides[0] = strides[1] = C + vd, strides[2] = strides[3] = 2 * nv;
    } else {
        for (int i = 0; i < 4; i++) parts[i] = outs[i], strides[i] = N[i];
    }
    int rc;
    coli_rmsnorm(h, 1, T, hidden, in_w, in_eps, xn);
    rc = coli_multi_gemm(xn, 1, T, hidden, scheme, g, n_in, w, N, outs);
    if (!rc) rc = coli_delta_rows(T, nk, nv, dk, dv, K, parts, strides, conv, ssm, conv_w, A_log, dt_bias, norm_w, eps, o);
    if (!rc) {
        void *out = y;
        rc = coli_multi_gemm(o, 1, T, (int)vd, scheme, g, 1, w + n_in, &hidden, &out);
    }
    if (!rc) {
        add_bf16((const uint16_t *)h, y, (long)T * hidden, (uint16_t *)h_out);
        coli_rmsnorm(h_out, 1, T, hidden, post_w, post_eps, x_out);
    }
    free(buf);
    return rc;
}
