/* Mamba (the selective-scan form: Jamba's layers, colibri/layers/mamba1.py Mamba1Mixer) for decode rows: the
 * convolution of each row over its sequence's kept inputs and the scan step of each row's state with the D term and
 * the gate (two calls, the layer's x_proj, dt/B/C norms and dt_proj modules between them); the whole mixer from
 * in_proj's output (coli_mamba1_rows, x_proj and dt_proj native), and the whole mixing half of the block with its
 * norms, projections and residual (coli_mamba1_block), as coli_attn_block is for attention.
 *
 * Why: the torch path spends ~25 small ops a layer and row (~280 us on the 0.44b-shaped model); the scan's
 * exp(dt A) over the [I, N] state is one pass here, with exp, softplus and silu the compiler vectorizes (below).
 * The arithmetic is the torch path's in f32, rounded to bf16 where it rounds (the convolution's output, the
 * layer's output); sums and exp differ in the last bits, so the values agree to rounding, not to the bit. */
#include "common.h"
#include "vmath.h"

typedef struct {
    int T, I, N, K;
    const uint16_t *xz;  /* [T, 2I]: x, then z */
    uint16_t *const *conv;
    float *const *ssm;
    const float *w, *b;  /* the convolution's [I, K], [I] or NULL */
    const uint16_t *dt, *B, *C;  /* [T, I] (before softplus, dt_proj's bias in), [T, *] rows of N at strides */
    long sb, sc;
    const float *A, *D;  /* A = -exp(A_log) [I, N], D [I] */
    uint16_t *out;  /* conv: u [T, I]; scan: y [T, I] */
    const uint16_t *u;
} mamba1_job;

static void conv_part(void *p, int id, int n) {
    const mamba1_job *j = (const mamba1_job *)p;
    int I = j->I, K = j->K;
    long a, b;
    split((long)j->T * I, id, n, &a, &b);
    for (long i0 = a; i0 < b;) {  /* 64 channels of a row at a time: the sums, then their silu (vectorized) */
        int t = (int)(i0 / I), c0 = (int)(i0 % I);
        int m = (int)((b - i0) < (I - c0) ? (b - i0) : (I - c0));
        if (m > 64) m = 64;
        float sums[64];
        for (int q = 0; q < m; q++) {
            int c = c0 + q;
            float s = conv_step(j->conv[t] + (long)c * (K - 1), j->w + (long)c * K, j->xz[(long)t * 2 * I + c], K);
            sums[q] = j->b ? s + j->b[c] : s;
        }
        for (int q = 0; q < m; q++) j->out[i0 + q] = f32_to_bf16(silu_v(sums[q]));
        i0 += m;
    }
}

/* Rows x channels, 64 channels at a time: their time steps and gates first (loops that vectorize), then each
 * channel's pass over its N states. */
static void scan_part(void *p, int id, int n) {
    const mamba1_job *j = (const mamba1_job *)p;
    int I = j->I, N = j->N;
    long a, b;
    split((long)j->T * I, id, n, &a, &b);
    for (long i0 = a; i0 < b;) {
        int t = (int)(i0 / I), c0 = (int)(i0 % I);
        int m = (int)((b - i0) < (I - c0) ? (b - i0) : (I - c0));
        if (m > 64) m = 64;
        float dts[64], gate[64];
        const uint16_t *dtr = j->dt + (long)t * I + c0, *z = j->xz + (long)t * 2 * I + I + c0;
        for (int q = 0; q < m; q++) dts[q] = softplus_v(bf16_to_f32(dtr[q]));
        for (int q = 0; q < m; q++) gate[q] = silu_v(bf16_to_f32(z[q]));
        const uint16_t *B = j->B + (long)t * j->sb, *C = j->C + (long)t * j->sc;
        float Bf[1024], Cf[1024], dA[1024];  /* N <= 1024 (native_mamba.py checks) */
        for (int s = 0; s < N; s++) Bf[s] = bf16_to_f32(B[s]), Cf[s] = bf16_to_f32(C[s]);
        for (int q = 0; q < m; q++) {
            int c = c0 + q;
            float dt = dts[q], u = bf16_to_f32(j->u[(long)t * I + c]), acc = 0.f;
            const float *A = j->A + (long)c * N;
            float *S = j->ssm[t] + (long)c * N;
            for (int s = 0; s < N; s++) dA[s] = exp_neg(dt * A[s]);
            for (int s = 0; s < N; s++) {
                S[s] = S[s] * dA[s] + dt * Bf[s] * u;
                acc += S[s] * Cf[s];
            }
            j->out[(long)t * I + c] = f32_to_bf16((acc + u * j->D[c]) * gate[q]);
        }
        i0 += m;
    }
}

/* Rows of in_proj's output xz bf16 [T, 2I] (contiguous) -> u bf16 [T, I] = silu(conv(x)); conv[t]: row t's kept
 * inputs bf16 [I, K-1], moved on. Returns 0 or -1 (a shape out of range). */
int coli_mamba1_conv(int T, int I, int K, const void *xz, void *const *conv, const float *w, const float *b, void *u) {
    if (T < 1 || T > MAX_T || I < 1 || K < 2) return -1;
    mamba1_job j = {T, I, 0, K, (const uint16_t *)xz, (uint16_t *const *)conv, NULL, w, b, NULL, NULL, NULL, 0, 0,
                    NULL, NULL, (uint16_t *)u, NULL};
    coli_parallel(conv_part, &j, n_threads_for((long)T * I * K * 8));
    return 0;
}

/* One scan step a row: dt bf16 [T, I] (dt_proj's output, bias in), B and C bf16 rows of N at strides sb / sc, u
 * bf16 [T, I], the gate z in xz [T, 2I]; ssm[t]: row t's f32 [I, N] state, moved on -> y bf16 [T, I] =
 * (S C + D u) * silu(z). Returns 0 or -1. */
int coli_mamba1_scan(int T, int I, int N, const void *dt, const void *B, long sb, const void *C, long sc,
                     const void *u, const void *xz, float *const *ssm, const float *A, const float *D, void *y) {
    if (T < 1 || T > MAX_T || I < 1 || N < 1 || N > 1024) return -1;
    mamba1_job j = {T, I, N, 0, (const uint16_t *)xz, NULL, ssm, NULL, NULL, (const uint16_t *)dt,
                    (const uint16_t *)B, (const uint16_t *)C, sb, sc, A, D, (uint16_t *)y, (const uint16_t *)u};
    coli_parallel(scan_part, &j, n_threads_for((long)T * I * N * 8));
    return 0;
}

/* A decode row's whole Mamba mixer after in_proj: xz bf16 [T, 2I] -> y bf16 [T, I], through the convolution,
 * x_proj (w[0], [R + 2N, I]: scheme sch[0], group grp[0]), the RMSNorms of dt, B and C (dt_w, b_w, c_w; NULL: none),
 * dt_proj (w[1], [I, R]; its bias dt_b added in f32 before the softplus), the scan step. Returns 0, -1 (a shape out
 * of range), -2 (memory) or coli_multi_gemm's code. */
int coli_mamba1_rows(int T, int I, int N, int R, int K, const int *sch, const int *grp, const coli_qw *w,
                     const void *xz, void *const *conv, float *const *ssm, const float *conv_w, const float *conv_b,
                     const float *dt_w, const float *b_w, const float *c_w, float eps, const float *dt_b,
                     const float *A, const float *D, void *y) {
    if (T < 1 || T > MAX_T || I < 1 || N < 1 || N > 1024 || R < 1 || K < 2) return -1;
    int nd = R + 2 * N, rc;
    uint16_t *buf = (uint16_t *)malloc(sizeof(uint16_t) * (size_t)T * (I + nd + R + 2 * N + I));
    if (!buf) return -2;
    uint16_t *u = buf, *dbc = u + (long)T * I, *dtn = dbc + (long)T * nd, *B = dtn + (long)T * R, *C = B + (long)T * N;
    uint16_t *dt = C + (long)T * N;
    rc = coli_mamba1_conv(T, I, K, xz, conv, conv_w, conv_b, u);
    void *o = dbc;
    if (!rc) rc = coli_multi_gemm(u, 1, T, I, sch[0], grp[0], 1, w, &nd, &o);
    if (!rc) {
        for (int t = 0; t < T; t++) {  /* (contiguous copies: the norms and the GEMM take whole rows) */
            memcpy(dtn + (long)t * R, dbc + (long)t * nd, sizeof(uint16_t) * R);
            memcpy(B + (long)t * N, dbc + (long)t * nd + R, sizeof(uint16_t) * N);
            memcpy(C + (long)t * N, dbc + (long)t * nd + R + N, sizeof(uint16_t) * N);
        }
        if (dt_w) coli_rmsnorm(dtn, 1, T, R, dt_w, eps, dtn);  /* (row by row: in place is safe) */
        if (b_w) coli_rmsnorm(B, 1, T, N, b_w, eps, B);
        if (c_w) coli_rmsnorm(C, 1, T, N, c_w, eps, C);
        o = dt;
        rc = coli_multi_gemm(dtn, 1, T, R, sch[1], grp[1], 1, w + 1, &I, &o);
    }
    if (!rc && dt_b)
        for (long i = 0; i < (long)T * I; i++) dt[i] = f32_to_bf16(bf16_to_f32(dt[i]) + dt_b[i % I]);
    if (!rc) rc = coli_mamba1_scan(T, I, N, dt, B, N, C, N, u, xz, ssm, A, D, y);
    free(buf);
    return rc;
}

/* h bf16 [T, hidden] -> h_out = h + out_proj(mamba1 rows(in_proj(rmsnorm(h)))) and x_out = post_norm(h_out), both
 * bf16; w: in_proj [2I, hidden], x_proj, dt_proj, out_proj [hidden, I] (schemes sch[4], groups grp[4]). The kernels
 * the layer-by-layer native path calls, in its order: the same bits. */
int coli_mamba1_block(int T, int hidden, int I, int N, int R, int K, const int *sch, const int *grp,
                      const coli_qw *w, const void *h, const float *in_w, float in_eps, const float *post_w,
                      float post_eps, void *const *conv, float *const *ssm, const float *conv_w, const float *conv_b,
                      const float *dt_w, const float *b_w, const float *c_w, float eps, const float *dt_b,
                      const float *A, const float *D, void *h_out, void *x_out) {
    if (T < 1 || T > MAX_T) return -1;
    uint16_t *buf = (uint16_t *)malloc(sizeof(uint16_t) * (size_t)T * (hidden + 2 * I + I + hidden));
    if (!buf) return -2;
    uint16_t *xn = buf, *xz = xn + (long)T * hidden, *yr = xz + 2L * T * I, *o = yr + (long)T * I;
    int two = 2 * I, rc;
    void *out = xz;
    coli_rmsnorm(h, 1, T, hidden, in_w, in_eps, xn);
    rc = coli_multi_gemm(xn, 1, T, hidden, sch[0], grp[0], 1, w, &two, &out);
    if (!rc) rc = coli_mamba1_rows(T, I, N, R, K, sch + 1, grp + 1, w + 1, xz, conv, ssm, conv_w, conv_b, dt_w, b_w,
                                   c_w, eps, dt_b, A, D, yr);
    out = o;
    if (!rc) rc = coli_multi_gemm(yr, 1, T, I, sch[3], grp[3], 1, w + 3, &hidden, &out);
    if (!rc) {
        add_bf16((const uint16_t *)h, o, (long)T * hidden, (uint16_t *)h_out);
        coli_rmsnorm(h_out, 1, T, hidden, post_w, post_eps, x_out);
    }
    free(buf);
    return rc;
}
