/* Mamba-2 decode rows (Granite 4.0-H's Mamba layers, colibri/layers/mamba2.py Mamba2Mixer) in one call: from the
 * layer's input projection to the gated, group-normed output that goes to out_proj, for T rows each continuing its
 * own sequence's state; and the whole mixing half of such a decoder block, as coli_attn_block is for attention.
 *
 * Why: the torch path spends ~40 small ops a layer and row (a conv1d call of ~100 us, a bmm of ~270 us over the
 * [H, P, N] state), ~0.6 ms a layer on the 0.44b-shaped model; here one pass over the state, which updates it and
 * reads it with C at once.
 *
 * Per row, in_proj's output bf16 [I + C + H] (I = H * P): z [I], the convolution's channels [C = I + 2 G N] (x, then
 * B and C of each group), dt [H]; its states: conv bf16 [C, K-1], f32 [H, P, N]. The arithmetic is the torch path's
 * in f32 (rounded to bf16 where it rounds: y before the gated norm, the norm before its weight, the output); sums
 * run in another order, so the values agree to rounding, not to the bit. */
#include "common.h"

typedef struct {
    int T, H, P, N, G, K;
    const uint16_t *in;  /* [T, I + C + H] */
    uint16_t *const *conv;
    float *const *ssm;
    const float *conv_w, *conv_b, *dt_bias, *A_log, *D, *norm_w;
    float eps;
    float *u;  /* [T, C]: the convolution's outputs, after silu */
    float *y;  /* [T, I]: the heads' outputs, rounded to bf16 */
    uint16_t *out;  /* [T, I] */
} mamba_job;

static inline float silu(float x) { return x / (1.f + expf(-x)); }
static inline float softplus(float x) { return x > 20.f ? x : log1pf(expf(x)); }  /* torch's threshold */

static inline long row_len(const mamba_job *j) {
    long I = (long)j->H * j->P;
    return I + (I + 2L * j->G * j->N) + j->H;
}

/* Rows x channels: the depthwise convolution over [kept inputs, this input] plus its bias, silu; the state shifts. */
static void conv_part(void *p, int id, int n) {
    const mamba_job *j = (const mamba_job *)p;
    long I = (long)j->H * j->P, C = I + 2L * j->G * j->N;
    int K = j->K;
    long a, b;
    split((long)j->T * C, id, n, &a, &b);
    for (long i = a; i < b; i++) {
        int t = (int)(i / C), c = (int)(i % C);
        float s = conv_step(j->conv[t] + (long)c * (K - 1), j->conv_w + (long)c * K,
                            j->in[(long)t * row_len(j) + I + c], K);
        j->u[i] = silu(j->conv_b ? s + j->conv_b[c] : s);
    }
}

/* Rows x heads: dt, the state's decay and update, and its reading with C, in one pass over [P, N]; plus D x. */
static void head_part(void *p, int id, int n) {
    const mamba_job *j = (const mamba_job *)p;
    int H = j->H, P = j->P, N = j->N, r = H / j->G;
    long I = (long)H * P, C = I + 2L * j->G * N;
    long a, b;
    split((long)j->T * H, id, n, &a, &b);
    for (long i = a; i < b; i++) {
        int t = (int)(i / H), h = (int)(i % H), g = h / r;
        const float *u = j->u + (long)t * C, *x = u + (long)h * P;
        const float *B = u + I + (long)g * N, *Cg = u + I + (long)j->G * N + (long)g * N;
        float dt = softplus(bf16_to_f32(j->in[(long)t * row_len(j) + I + C + h]) + j->dt_bias[h]);
        float dA = expf(dt * -expf(j->A_log[h])), Dh = j->D[h];
        float dB[1024];  /* N <= 1024 (native.py checks) */
        for (int s = 0; s < N; s++) dB[s] = dt * B[s];
        float *S = j->ssm[t] + (long)h * P * N;
        for (int q = 0; q < P; q++) {
            float *sq = S + (long)q * N, xq = x[q], part[16] = {0.f}, acc = 0.f;
            int s = 0;
            for (; s + 16 <= N; s += 16)  /* 16 partial sums: a vector's lanes (the reduction vectorizes) */
                for (int l = 0; l < 16; l++) {
                    float v = sq[s + l] * dA + dB[s + l] * xq;
                    sq[s + l] = v;
                    part[l] += v * Cg[s + l];
                }
            for (; s < N; s++) {
                float v = sq[s] * dA + dB[s] * xq;
                sq[s] = v;
                acc += v * Cg[s];
            }
            for (int l = 0; l < 16; l++) acc += part[l];
            j->y[(long)t * I + (long)h * P + q] = bf16_to_f32(f32_to_bf16(acc + xq * Dh));
        }
    }
}

/* Rows x groups: y * silu(z), RMS-normed over the group's channels, rounded, times the weight. */
static void norm_part(void *p, int id, int n) {
    const mamba_job *j = (const mamba_job *)p;
    long I = (long)j->H * j->P, W = I / j->G;
    long a, b;
    split((long)j->T * j->G, id, n, &a, &b);
    for (long i = a; i < b; i++) {
        int t = (int)(i / j->G), g = (int)(i % j->G);
        float *y = j->y + (long)t * I + g * W;  /* (scratch: becomes y * silu(z)) */
        const uint16_t *z = j->in + (long)t * row_len(j) + g * W;
        float ms = 0.f;
        for (long c = 0; c < W; c++) {
            y[c] *= silu(bf16_to_f32(z[c]));
            ms += y[c] * y[c];
        }
        float inv = 1.f / sqrtf(ms / (float)W + j->eps);
        uint16_t *out = j->out + (long)t * I + g * W;
        for (long c = 0; c < W; c++)
            out[c] = f32_to_bf16(j->norm_w[g * W + c] * bf16_to_f32(f32_to_bf16(y[c] * inv)));
    }
}

/* T rows of in_proj's output (bf16 [T, I + C + H], contiguous) -> out bf16 [T, I]; conv[t] / ssm[t]: row t's
 * states, updated in place; conv_b may be NULL. Returns 0, -1 (a shape out of range), -2 (memory). */
int coli_mamba_rows(int T, int H, int P, int N, int G, int K, const void *in, void *const *conv, float *const *ssm,
                    const float *conv_w, const float *conv_b, const float *dt_bias, const float *A_log,
                    const float *D, const float *norm_w, float eps, void *out) {
    if (T < 1 || T > MAX_T || H < 1 || P < 1 || N < 1 || N > 1024 || G < 1 || H % G || K < 2) return -1;
    long I = (long)H * P, C = I + 2L * G * N;
    float *buf = (float *)coli_alloc(sizeof(float) * (size_t)(T * (C + I)));
    if (!buf) return -2;
    mamba_job j = {T, H, P, N, G, K, (const uint16_t *)in, (uint16_t *const *)conv, ssm, conv_w, conv_b, dt_bias,
                   A_log, D, norm_w, eps, buf, buf + (long)T * C, (uint16_t *)out};
    coli_parallel(conv_part, &j, n_threads_for(T * C * 8));
    coli_parallel(head_part, &j, n_threads_for((long)T * I * N * 4));
    coli_parallel(norm_part, &j, n_threads_for((long)T * I * 8));
    free(buf);
    return 0;
}

/* h bf16 [T, hidden] -> h_out = h + out_proj(mamba rows(in_proj(rmsnorm(h)))) and x_out = post_norm(h_out), both
 * bf16 [T, hidden]; w: in_proj [I + C + H, hidden] then out_proj [hidden, I] (scheme 8 or 4, group g). The kernels
 * the layer-by-layer native path calls, in its order: the same bits. */
int coli_mamba_block(int T, int hidden, int H, int P, int N, int G, int K, int scheme, int g, const coli_qw *w,
                     const void *h, const float *in_w, float in_eps, const float *post_w, float post_eps,
                     void *const *conv, float *const *ssm, const float *conv_w, const float *conv_b,
                     const float *dt_bias, const float *A_log, const float *D, const float *norm_w, float eps,
                     void *h_out, void *x_out) {
    if (T < 1 || T > MAX_T || H < 1 || P < 1 || G < 1 || H % G) return -1;
    long I = (long)H * P, C = I + 2L * G * N;
    int nin = (int)(I + C + H), rc;
    uint16_t *buf = (uint16_t *)malloc(sizeof(uint16_t) * (size_t)T * (hidden + nin + I + hidden));
    if (!buf) return -2;
    uint16_t *xn = buf, *in = xn + (long)T * hidden, *o = in + (long)T * nin, *y = o + (long)T * I;
    void *outs = in;
    coli_rmsnorm(h, 1, T, hidden, in_w, in_eps, xn);
    rc = coli_multi_gemm(xn, 1, T, hidden, scheme, g, 1, w, &nin, &outs);
    if (!rc) rc = coli_mamba_rows(T, H, P, N, G, K, in, conv, ssm, conv_w, conv_b, dt_bias, A_log, D, norm_w, eps, o);
    if (!rc) {
        void *out = y;
        rc = coli_multi_gemm(o, 1, T, (int)I, scheme, g, 1, w + 1, &hidden, &out);
    }
    if (!rc) {
        add_bf16((const uint16_t *)h, y, (long)T * hidden, (uint16_t *)h_out);
        coli_rmsnorm(h_out, 1, T, hidden, post_w, post_eps, x_out);
    }
    free(buf);
    return rc;
}
