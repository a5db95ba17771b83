/* Mamba (the selective-scan form: Jamba's layers, colibri/models/mamba1.py Mamba1Mixer) for decode rows: the
 * convolution of each row over its sequence's kept inputs, and the scan step of each row's state, with the D term
 * and the gate. x_proj, the dt/B/C norms and dt_proj stay the layer's own modules between the two calls.
 *
 * Why: the torch path spends ~25 small ops a layer and row (~280 us on the 0.44b-shaped model); the scan's
 * exp(dt A) over the [I, N] state is one pass here, with an exp the compiler vectorizes (exp_neg below).
 * The arithmetic is the torch path's in f32, rounded to bf16 where it rounds (the convolution's output, the
 * layer's output); sums and exp differ in the last bits, so the values agree to rounding, not to the bit. */
#include "common.h"

static inline float silu(float x) { return x / (1.f + expf(-x)); }
static inline float softplus(float x) { return x > 20.f ? x : log1pf(expf(x)); }  /* torch's threshold */

/* exp(x) for x <= 0 (the state's decay: dt >= 0, A < 0) within ~2 ulp, in plain float arithmetic so that loops of
 * it vectorize: x = k ln2 + r, |r| <= ln2 / 2, exp(r) by its Taylor polynomial to r^7, times 2^k by the exponent
 * bits (0 below 2^-126). */
static inline float exp_neg(float x) {
    if (x < -87.f) x = -87.f;
    float k = __builtin_rintf(x * 1.44269504f);
    float r = x - k * 0.693359375f + k * 2.12194440e-4f;  /* ln2 in two parts: r exact to a few ulp */
    float p = 1.f / 5040.f;
    p = p * r + 1.f / 720.f;
    p = p * r + 1.f / 120.f;
    p = p * r + 1.f / 24.f;
    p = p * r + 1.f / 6.f;
    p = p * r + 0.5f;
    p = p * r + 1.f;
    p = p * r + 1.f;
    union { int32_t i; float f; } s = {.i = ((int32_t)k + 127) << 23};
    return p * s.f;
}

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
    for (long i = a; i < b; i++) {
        int t = (int)(i / I), c = (int)(i % I);
        uint16_t *st = j->conv[t] + (long)c * (K - 1), x = j->xz[(long)t * 2 * I + c];
        const float *w = j->w + (long)c * K;
        float s = 0.f;
        for (int k = 0; k < K - 1; k++) s += bf16_to_f32(st[k]) * w[k];
        s += bf16_to_f32(x) * w[K - 1];
        if (j->b) s += j->b[c];
        for (int k = 0; k + 1 < K - 1; k++) st[k] = st[k + 1];
        st[K - 2] = x;
        j->out[i] = f32_to_bf16(silu(s));
    }
}

static void scan_part(void *p, int id, int n) {
    const mamba1_job *j = (const mamba1_job *)p;
    int I = j->I, N = j->N;
    long a, b;
    split((long)j->T * I, id, n, &a, &b);
    for (long i = a; i < b; i++) {
        int t = (int)(i / I), c = (int)(i % I);
        float dt = softplus(bf16_to_f32(j->dt[i])), u = bf16_to_f32(j->u[i]), acc = 0.f;
        const uint16_t *B = j->B + (long)t * j->sb, *C = j->C + (long)t * j->sc;
        const float *A = j->A + (long)c * N;
        float *S = j->ssm[t] + (long)c * N, dA[1024];  /* N <= 1024 (native_mamba.py checks) */
        for (int s = 0; s < N; s++) dA[s] = exp_neg(dt * A[s]);
        for (int s = 0; s < N; s++) {
            S[s] = S[s] * dA[s] + dt * bf16_to_f32(B[s]) * u;
            acc += S[s] * bf16_to_f32(C[s]);
        }
        float y = (acc + u * j->D[c]) * silu(bf16_to_f32(j->xz[(long)t * 2 * I + I + c]));
        j->out[i] = f32_to_bf16(y);
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
