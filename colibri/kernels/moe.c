/* One routed-expert layer (SiLU-GLU) in one call: colibri/layers/moe.py's native path. */
#include "rows.h"

typedef struct {
    int scheme, g, K, N, nu;  /* N output rows per expert, K inputs */
    const int *uexp, *uoff;
    const coli_qw *w;
    const float *xf, *xp, *xs;
    float *out;
    int bfm;
} moe_job;

/* Rows (u, o) of all experts u of the call, flattened and split evenly between the threads; taken a
 * panel of an expert's rows at a time, each block of 8 of its activation rows over the whole panel. */
static void moe_part(void *p, int id, int n) {
    moe_job *j = (moe_job *)p;
    long r0, r1;
    split((long)j->nu * j->N, id, n, &r0, &r1);
    int G = j->scheme == 4 ? j->K / j->g : 0;  /* once here, not per row */
    int P = panel_rows(j->scheme == 4 ? j->K / 2 + 4L * G : j->K);
    int u = (int)(r0 / j->N), o = (int)(r0 % j->N);  /* then stepped: no division per row */
    for (long r = r0; r < r1;) {
        int np = P < j->N - o ? P : j->N - o;
        if (np > r1 - r) np = (int)(r1 - r);
        int a = j->uoff[u], rows = j->uoff[u + 1] - a;
        const coli_qw *w = j->w + j->uexp[u];
#ifdef COLI_Q4V
        if (rows == 1 && j->bfm == 2 && j->scheme == 4) {  /* one row for this expert: no call per weight row */
            q4v_rows1(xrow(j->xp, 2, a, j->K), j->xs + (long)a * G, j->K, G, j->g, (const uint8_t *)w->q,
                      (const uint16_t *)w->s, (const uint16_t *)w->m, o, o + np, j->out + (long)a * j->N);
            rows = 0;
        }
#endif
        /* the expert's rows in blocks of 8 over the panel (each block size its own constant: a block of
         * 5-8 rows row by row unpacked the int4 weights once per row) */
        for (int t0 = a; t0 < a + rows; t0 += 8) {
            int tb = a + rows - t0 < 8 ? a + rows - t0 : 8;
            if (j->scheme == 4)
                TB_SWITCH(Q4_ROWS, tb, j->xp, j->xs, j->K, G, j->g, (const uint8_t *)w->q, (const uint16_t *)w->s,
                          (const uint16_t *)w->m, o, o + np, j->out, j->N, j->bfm)
            else if (j->bfm)  /* int8, prepared (int8) activation rows */
                TB_SWITCH(Q8V_ROWS, tb, j->xp, j->K, (const int8_t *)w->q, (const float *)w->s, o, o + np, j->out, j->N)
            else  /* int8, f32 activations */
                q8_rows(j->xf + (long)t0 * j->K, tb, j->K, (const int8_t *)w->q, (const float *)w->s, j->N, o, o + np,
                        j->out + (long)t0 * j->N);
        }
        r += np;
        if ((o += np) == j->N) { o = 0; u++; }
    }
}

/* Row r of a layer's sorted rows (in the run [a, b) of one expert) prepared for the kernels: int4
 * rows are prepared within their expert's run (the VNNI layout interleaves the rows of each block of 8
 * the kernels take from the run's first row, rows_q4.h q4v_prep), int8 rows alone. */
static void prep_row(int scheme, int bfm, const float *x, int a, int b, int r, int K, int g, float *xp, float *xs) {
    if (scheme == 4) {
#ifdef COLI_Q4V
        if (bfm == 2) {
            q4v_prep_rows(x + (long)a * K, b - a, r - a, r - a + 1, K, g, (float *)xrow(xp, 2, a, K), xs + (long)a * (K / g));
            return;
        }
#endif
        int4_prep(x + (long)r * K, 1, K, g, (float *)xrow(xp, bfm, r, K), xs + (long)r * (K / g), bfm);
    } else if (bfm) {
        q8_prep(x + (long)r * K, 1, K, xp + (long)r * Q8_STRIDE(K));
    }
}

/* act[i] = silu(hg[i]) * hg[I + i], i < I: the gate half of a gate+up row times its up half. */
static void silu_glu(const float *hg, int I, float *act) {
    int i = 0;
#ifdef COLI_AVX512
    for (; i < I; i += 16) {
        __mmask16 m = I - i >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (I - i)) - 1);
        __m512 g = _mm512_maskz_loadu_ps(m, hg + i), u = _mm512_maskz_loadu_ps(m, hg + I + i);
        __m512 e = exp512_ps(_mm512_sub_ps(_mm512_setzero_ps(), g));
        _mm512_mask_storeu_ps(act + i, m, _mm512_mul_ps(_mm512_div_ps(g, _mm512_add_ps(_mm512_set1_ps(1.f), e)), u));
    }
#endif
    for (; i < I; i++) act[i] = hg[i] / (1.f + expf(-hg[i])) * hg[I + i];
}

/* The per-row work around the two expert GEMMs, split over rows between the threads when a step has
 * many (a prompt chunk: one thread spent ~15% of a 64-row step here while the other waited). Each row
 * is computed as one thread would, so the bits do not depend on the split.
 *   stage 0: row r of the sorted inputs = x's row of slot order[r], prepared;
 *   stage 1: act[r] = silu(gate) * up, prepared for the down projection;
 *   stage 2: row t of y = sum_j weights[t, j] * ys[t*k + j] (ys first filled from the sorted results). */
typedef struct {
    int stage, scheme, g, bfm, bf16, k, H, I, nu, Q, T;
    const int *order, *uoff, *inv, *uexp;
    const void *x;
    const float *weights;
    float *hgu;
    const float *ysrt;
    float *xsrt, *xp, *xsum, *act, *ap, *asum, *ys;
    void *y;
    const coli_expert_act *ea;  /* NULL: SiLU-GLU, no biases */
    const int64_t *idx;
} rows_job;

/* v[i] += b[i] (bf16) over n, when b is not NULL. */
static void add_bias(float *v, const uint16_t *b, int n) {
    if (b)
        for (int i = 0; i < n; i++) v[i] += bf16_to_f32(b[i]);
}

/* gpt-oss's activation of one row: act[i] = (up + 1) * gate * sigmoid(alpha * gate), gate = min(hg[i], limit),
 * up = hg[I + i] clamped to [-limit, limit] (models/gpt_oss.py clamped_swiglu, in f32). */
static void clamped_glu(const float *hg, int I, float alpha, float limit, float *act) {
    for (int i = 0; i < I; i++) {
        float g = hg[i] < limit ? hg[i] : limit, u = hg[I + i];
        u = u < -limit ? -limit : (u > limit ? limit : u);
        act[i] = (u + 1.f) * (g / (1.f + expf(-alpha * g)));
    }
}

/* act[i] = gelu(hg[i]) * hg[I + i], GELU's tanh form as torch computes it in f32: 0.5 g (1 + tanh(sqrt(2 / pi)
 * (g + 0.044715 g^3))). */
static void gelu_glu(const float *hg, int I, float *act) {
    for (int i = 0; i < I; i++) {
        float g = hg[i];
        act[i] = 0.5f * g * (1.f + tanhf(0.7978845608028654f * (g + 0.044715f * g * g * g))) * hg[I + i];
    }
}

/* Nemotron-H's ungated activation of one row: act[i] = relu(hg[i])^2 (hg: the I up rows alone). */
static void relu2(const float *hg, int I, float *act) {
    for (int i = 0; i < I; i++) {
        float u = hg[i] > 0.f ? hg[i] : 0.f;
        act[i] = u * u;
    }
}

/* gate_up's rows per intermediate channel under an activation: 1 where it has no gate. */
#define GU_ROWS(ea) ((ea) && (ea)->kind == ACT_RELU2 ? 1 : 2)

static void rows_part(void *p, int id, int n) {
    rows_job *j = (rows_job *)p;
    int H = j->H, I = j->I, k = j->k;
    long r0, r1;
    if (j->stage == 2) {
        split(j->T, id, n, &r0, &r1);
        for (long t = r0; t < r1; t++) {
            for (int jj = 0; jj < k; jj++) {
                int r = j->inv[t * k + jj];
                if (r < 0) continue;
                memcpy(j->ys + (t * k + jj) * H, j->ysrt + (long)r * H, sizeof(float) * H);
                if (j->ea && j->ea->dn_bias) add_bias(j->ys + (t * k + jj) * H, j->ea->dn_bias[j->idx[t * k + jj]], H);
            }
            if (!j->y) continue;
            int c = 0;
#ifdef COLI_AVX512
            for (; c + 16 <= H; c += 16) {  /* 16 columns at a time, each summed in slot order as below */
                __m512 s = _mm512_setzero_ps();
                for (int jj = 0; jj < k; jj++)
                    s = _mm512_add_ps(s, _mm512_mul_ps(_mm512_set1_ps(j->weights[t * k + jj]),
                                                       _mm512_loadu_ps(j->ys + (t * k + jj) * H + c)));
                if (j->bf16) _mm256_storeu_si256((__m256i *)((uint16_t *)j->y + t * H + c), f32_to_bf16_16(s));
                else _mm512_storeu_ps((float *)j->y + t * H + c, s);
            }
#endif
            for (; c < H; c++) {
                float s = 0.f;
                for (int jj = 0; jj < k; jj++) s += j->weights[t * k + jj] * j->ys[(t * k + jj) * H + c];
                if (j->bf16) ((uint16_t *)j->y)[t * H + c] = f32_to_bf16(s);
                else ((float *)j->y)[t * H + c] = s;
            }
        }
        return;
    }
    split(j->Q, id, n, &r0, &r1);
    int u = 0;
    while (u + 1 < j->nu && j->uoff[u + 1] <= r0) u++;
    for (long r = r0; r < r1; r++) {
        while (j->uoff[u + 1] <= r) u++;
        int a = j->uoff[u], b = j->uoff[u + 1];
        if (j->stage == 0) {
            long src = (long)(j->order[r] / k) * H;
            load_x(j->bf16 ? (const void *)((const uint16_t *)j->x + src) : (const void *)((const float *)j->x + src),
                   j->bf16, 1, H, j->xsrt + r * H);
            prep_row(j->scheme, j->bfm, j->xsrt, a, b, (int)r, H, j->g, j->xp, j->xsum);
        } else {
            int G = GU_ROWS(j->ea);
            float *hg = j->hgu + r * G * I;
            if (!j->ea) {
                silu_glu(hg, I, j->act + r * I);
            } else {
                if (j->ea->gu_bias) add_bias(hg, j->ea->gu_bias[j->uexp[u]], G * I);
                if (j->ea->kind == ACT_CLAMPED) clamped_glu(hg, I, j->ea->alpha, j->ea->limit, j->act + r * I);
                else if (j->ea->kind == ACT_GELU_TANH) gelu_glu(hg, I, j->act + r * I);
                else if (j->ea->kind == ACT_RELU2) relu2(hg, I, j->act + r * I);
                else silu_glu(hg, I, j->act + r * I);
            }
            prep_row(j->scheme, j->bfm, j->act, a, b, (int)r, I, j->g, j->ap, j->asum);
        }
    }
}

/* Rows worth a fork/join: a decode step's few rows stay on the calling thread (a one-sequence step of
 * a top-8 model has 8 expert rows: measured no faster split). Routing costs more per row: a batch of
 * 8 sequences splits it (as RMSNorm and RoPE do, attn.c). */
#define ROWS_PAR_MIN 16

/* The routed experts of one layer, SiLU-GLU (or `ea`'s activation and biases, added in f32): for every
 * slot p = t*k + j whose expert e = idx[p] has
 * weights in the tables (gate_up[e]: [2I, H], gate rows first; down[e]: [H, I]; `scheme` 8 or 4,
 * group g), ys[p] (f32 [H]) = down_e(silu(gate_e(x_t)) * up_e(x_t)); other slots are left alone, so a
 * caller may pass the experts of a layer in several calls as they arrive. Then, if y is not NULL,
 * y[t] = sum_j weights[t, j] * ys[t*k + j] in slot order (the same sum whatever else is in the
 * batch), in x's dtype. Slots are sorted by expert so each weight row is read once for all its
 * slots; output rows of all experts are split across threads in one parallel region.
 * Returns 0, -2 (out of memory), -3 (bad shape), -4 (bad expert id). */
int coli_moe(const void *x, int bf16, int T, int H, int I, int k, const int64_t *idx, const float *weights,
             int n_experts, const coli_qw *gate_up, const coli_qw *down, int scheme, int g, float *ys, void *y,
             const coli_expert_act *ea) {
    if (scheme == 4 && (H % 32 || I % 32 || g % 32 || H % g || I % g)) return -3;
    int P = T * k, nu = 0, Q = 0;
    int *count = (int *)calloc((size_t)n_experts + 1, sizeof(int));
    int *order = (int *)malloc(sizeof(int) * ((size_t)P + 1));  /* sorted row -> slot */
    int *uexp = (int *)malloc(sizeof(int) * ((size_t)P + 1)), *uoff = (int *)malloc(sizeof(int) * ((size_t)P + 1));
    int *inv = (int *)malloc(sizeof(int) * ((size_t)P + 1));  /* slot -> sorted row, -1: not in this call */
    float *buf = NULL;
    int rc = 0;
    if (!count || !order || !uexp || !uoff || !inv) { rc = -2; goto done; }
    for (int p = 0; p < P; p++) {
        if (idx[p] < 0 || idx[p] >= n_experts) { rc = -4; goto done; }
        if (gate_up[idx[p]].q) { count[idx[p] + 1]++; Q++; }
    }
    for (int e = 0; e < n_experts; e++) count[e + 1] += count[e];
    for (int p = 0; p < P; p++)  /* stable counting sort of the present slots by expert */
        if (gate_up[idx[p]].q) order[count[idx[p]]++] = p;
    for (int r = 0; r < Q; r++) {
        int e = (int)idx[order[r]];
        if (r == 0 || e != uexp[nu - 1]) { uexp[nu] = e; uoff[nu++] = r; }
    }
    uoff[nu] = Q;
    int G = GU_ROWS(ea);  /* gate_up's rows per intermediate channel: 2 (gate, up), 1 (up alone: ACT_RELU2) */
    size_t nf = (size_t)Q * H + (size_t)Q * G * I + (size_t)Q * I + (size_t)Q * H;
    /* prepared activations (int4: nibble-ordered or bf16 copies + group sums; int8 in bf16: q8_prep) */
    size_t nxp = (size_t)Q * (H > Q8_STRIDE(H) ? H : Q8_STRIDE(H)), nxs = scheme == 4 ? (size_t)Q * H / g : 0;
    size_t nap = (size_t)Q * (I > Q8_STRIDE(I) ? I : Q8_STRIDE(I)), nas = scheme == 4 ? (size_t)Q * I / g : 0;
    size_t n4 = nxp + nxs + nap + nas;
    buf = (float *)coli_alloc(sizeof(float) * (nf + n4 + 1));
    if (!buf) { rc = -2; goto done; }
    float *xsrt = buf, *hgu = xsrt + (size_t)Q * H, *act = hgu + (size_t)Q * G * I;
    float *ysrt = act + (size_t)Q * I;
    float *xp = ysrt + (size_t)Q * H, *xsum = xp + nxp, *ap = xsum + nxs, *asum = ap + nap;
    int bfm = scheme == 4 ? (BF_MODE(bf16, H, g) < BF_MODE(bf16, I, g) ? BF_MODE(bf16, H, g) : BF_MODE(bf16, I, g))
                          : (Q8V_OK(bf16, H) && Q8V_OK(bf16, I));
    for (int p = 0; p < P; p++) inv[p] = -1;
    for (int r = 0; r < Q; r++) inv[order[r]] = r;

    long bytes = (long)nu * (G + 1) * H * I * (scheme == 4 ? 1 : 2) / 2;
    int nt = n_threads_for(bytes), nr = Q >= ROWS_PAR_MIN ? nt : 1;
    rows_job rj = {0, scheme, g, bfm, bf16, k, H, I, nu, Q, T, order, uoff, inv, uexp, x, weights, hgu, ysrt,
                   xsrt, xp, xsum, act, ap, asum, ys, y, ea, idx};
    PROF(P_GATHER, coli_parallel(rows_part, &rj, nr));
    /* gate+up: rows (u, o) for o < G I, flattened so the threads split all experts' rows evenly */
    moe_job j1 = {scheme, g, H, G * I, nu, uexp, uoff, gate_up, xsrt, xp, xsum, hgu, bfm};
    PROF(P_GATE_UP, coli_parallel(moe_part, &j1, nt));
    rj.stage = 1;
    PROF(P_SILU, coli_parallel(rows_part, &rj, nr));
    moe_job j2 = {scheme, g, I, H, nu, uexp, uoff, down, act, ap, asum, ysrt, bfm};
    PROF(P_DOWN, coli_parallel(moe_part, &j2, nt));
    rj.stage = 2;
    PROF(P_COMBINE, coli_parallel(rows_part, &rj, T * k >= ROWS_PAR_MIN ? nt : 1));
done:
    free(count); free(order); free(uexp); free(uoff); free(inv); free(buf);
    return rc;
}

/* ------------------------------------------------------------------- the whole layer */

/* y [T, H] bf16 = m's MLP of x [T, H] bf16: gate and up (one pass over x), act = bf16(silu(gate) * up) (or GELU's)
 * (f32 math, one rounding), down; when gated, y = bf16(sigmoid(sgate . x) * y). The dense layers and shared
 * experts of colibri/models (layers.py MLP, moe.py SparseMoE) run exactly this at bf16 on the CPU, so the
 * per-layer and one-call paths agree bit for bit. Returns 0 or coli_multi_gemm's code. */
int coli_mlp_rows(const coli_mlp *m, const void *x, int T, int H, void *y) {
    if (T < 1 || T > MAX_T) return -1;
    int I = m->inter;
    size_t n = (size_t)T * I;
    uint16_t *g = (uint16_t *)malloc(sizeof(uint16_t) * (3 * n + T));
    float *hg = (float *)malloc(sizeof(float) * 3 * (size_t)I);  /* one row's [gate | up], then its act */
    int rc = g && hg ? 0 : -2;
    uint16_t *u = g + n, *a = u + n, *sg = a + n;
    int ungated = m->act == ACT_RELU2;  /* (Nemotron-H: no gate projection, relu(up)^2) */
    if (!rc) {
        coli_qw w[3] = {m->gate, m->up, m->sgate};
        int N[3] = {I, I, 1};
        void *o[3] = {g, u, sg};
        PROF(P_GATE_UP, rc = coli_multi_gemm(x, 1, T, H, m->scheme, m->group, (m->gated ? 3 : 2) - ungated,
                                             w + ungated, N + ungated, o + ungated));
    }
    for (int t = 0; t < T && !rc && ungated; t++)
        for (int i = 0; i < I; i++) {
            float v = bf16_to_f32(u[(size_t)t * I + i]);
            v = v > 0.f ? v : 0.f;
            a[(size_t)t * I + i] = f32_to_bf16(v * v);
        }
    for (int t = 0; t < T && !rc && !ungated; t++) {
        for (int i = 0; i < I; i++) {
            hg[i] = bf16_to_f32(g[(size_t)t * I + i]);
            hg[I + i] = bf16_to_f32(u[(size_t)t * I + i]);
        }
        if (m->act == ACT_GELU_TANH) gelu_glu(hg, I, hg + 2 * (size_t)I);
        else if (m->act == ACT_CLAMPED) clamped_glu(hg, I, m->alpha, m->limit, hg + 2 * (size_t)I);
        else silu_glu(hg, I, hg + 2 * (size_t)I);
        for (int i = 0; i < I; i++) a[(size_t)t * I + i] = f32_to_bf16(hg[2 * (size_t)I + i]);
    }
    if (!rc) {
        void *yy = y;
        PROF(P_DOWN, rc = coli_multi_gemm(a, 1, T, I, m->scheme, m->group, 1, &m->down, &H, &yy));
    }
    uint16_t *yb = (uint16_t *)y;
    for (int t = 0; t < T && !rc && m->gated; t++) {
        float s = 1.f / (1.f + expf(-bf16_to_f32(sg[t])));
        for (int c = 0; c < H; c++) yb[(size_t)t * H + c] = f32_to_bf16(s * bf16_to_f32(yb[(size_t)t * H + c]));
    }
    free(g);
    free(hg);
    return rc;
}

/* Llama 4's routed expert (k == 1): the expert of row t applied to bf16(x[t] * bf16(w[t])) -- the torch
 * layer's bf16 score times its bf16 rows -- and its output taken unweighted (coli_moe with weights of one). */
static int moe_scaled_input(const void *x, int T, int H, int I, const int64_t *idx, const float *w, int E,
                            const coli_qw *gate_up, const coli_qw *down, int scheme, int g, float *ys, void *y,
                            const coli_expert_act *act) {
    uint16_t *xs = (uint16_t *)malloc(sizeof(uint16_t) * (size_t)T * H);
    if (!xs) return -2;
    float ones[MAX_T];
    for (int t = 0; t < T; t++) {
        float s = bf16_to_f32(f32_to_bf16(w[t]));
        for (int c = 0; c < H; c++)
            xs[(size_t)t * H + c] = f32_to_bf16(bf16_to_f32(((const uint16_t *)x)[(size_t)t * H + c]) * s);
        ones[t] = 1.f;
    }
    int rc = coli_moe(xs, 1, T, H, I, 1, idx, ones, E, gate_up, down, scheme, g, ys, y, act);
    free(xs);
    return rc;
}

/* The feed-forward half of a decoder block: route x (the post-attention norm of h, bf16 [T, H]) as
 * coli_route does and run the experts, all in `gate_up`/`down` (a resident layer; a cached layer's table
 * holds the experts in memory, and a route to one it lacks returns COLI_MISS before anything is written), as coli_moe does; add
 * the shared MLP's output when `shared` (bf16 + bf16, as the Python sum), or take it alone where E == 0 (a
 * dense layer); h_out = h + that (RMS-normed first with out_w / out_eps when out_w: AFMoE), in bf16. idx/w
 * receive the routes (for the engine's route hooks). */
int coli_moe_block(const void *x, const void *h, int T, int H, int I, const float *W, int E, int k, int norm,
                   int kind, int n_group, int topk_group, const float *bias, float scale, const coli_qw *gate_up, const coli_qw *down, int scheme,
                   int g, int64_t *idx, float *w, float *ys, void *h_out, const coli_mlp *shared,
                   const coli_expert_act *act, const float *out_w, float out_eps) {
    if (E < 1 && !shared) return -3;
    if (E > 0) {
        int rc;
        PROF(P_ROUTE, rc = coli_route(x, 1, T, H, W, E, k, norm, kind, n_group, topk_group, bias, scale, idx, w));
        if (rc) return rc;
        for (int p = 0; p < T * k; p++)  /* a cached layer's table lacks a routed expert: h untouched */
            if (!gate_up[idx[p]].q) return COLI_MISS;
    }
    return coli_moe_routed(x, h, T, H, I, E, k, gate_up, down, scheme, g, idx, w, ys, h_out, shared, act, out_w,
                           out_eps);
}

/* coli_moe_block past its routing, over the routes idx / w [T, k]: the slots whose expert has an entry in the
 * tables are computed into ys (coli_moe; the others keep what an earlier call put there), every slot summed in
 * slot order, the shared MLP added, h_out = h + that. */
int coli_moe_routed(const void *x, const void *h, int T, int H, int I, int E, int k, const coli_qw *gate_up,
                    const coli_qw *down, int scheme, int g, const int64_t *idx, const float *w, float *ys,
                    void *h_out, const coli_mlp *shared, const coli_expert_act *act, const float *out_w,
                    float out_eps) {
    uint16_t *y = (uint16_t *)malloc(sizeof(uint16_t) * 2 * (size_t)T * H);
    if (!y) return -2;
    uint16_t *s = y + (size_t)T * H;
    int rc = 0;
    if (E > 0) {
        if (act && act->input_scaled)
            rc = k == 1 ? moe_scaled_input(x, T, H, I, idx, w, E, gate_up, down, scheme, g, ys, y, act) : -3;
        else
            rc = coli_moe(x, 1, T, H, I, k, idx, w, E, gate_up, down, scheme, g, ys, y, act);
    }
    if (!rc && shared) {
        rc = coli_mlp_rows(shared, x, T, H, E > 0 ? s : y);
        if (!rc && E > 0) add_bf16(y, s, (long)T * H, y);
    }
    if (!rc && out_w) coli_rmsnorm(y, 1, T, H, out_w, out_eps, y);
    if (!rc) add_bf16((const uint16_t *)h, y, (long)T * H, (uint16_t *)h_out);
    free(y);
    return rc;
}

/* LongCat-Flash's MoE (models/longcat_flash.py ZeroExpertMoE) for a few bf16 rows: route x over the E routed + Z
 * zero-computation experts by `kind` (W [E + Z, H]); each zero slot becomes a weight-0 repeat of its row's first
 * routed expert (the step's first where a row has none, else expert 0) and its weight goes to the row's identity
 * term; the routed experts run as coli_moe does, and y = their sum + bf16(identity x), in bf16. idx / w receive the
 * routes as the experts saw them. Returns coli_moe's codes, or COLI_MISS before anything is written where the
 * tables lack a routed expert (a cached layer). */
int coli_zero_moe(const void *x, int T, int H, int I, const float *W, int E, int Z, int k, int norm, int kind,
                  const float *bias, float scale, const coli_qw *gate_up, const coli_qw *down, int scheme, int g,
                  int64_t *idx, float *w, float *ys, void *y) {
    if (T < 1 || T > MAX_T || E < 1 || Z < 0) return -3;
    int rc = coli_route(x, 1, T, H, W, E + Z, k, norm, kind, 1, 1, bias, scale, idx, w);
    if (rc) return rc;
    int64_t step_first = 0;
    for (int p = 0; p < T * k; p++)
        if (idx[p] < E) { step_first = idx[p]; break; }
    float ident[MAX_T];
    for (int t = 0; t < T; t++) {
        int64_t first = step_first, *it = idx + (long)t * k;
        for (int j = 0; j < k; j++)
            if (it[j] < E) { first = it[j]; break; }
        ident[t] = 0.f;
        for (int j = 0; j < k; j++)
            if (it[j] >= E) {
                ident[t] += w[(long)t * k + j];
                it[j] = first;
                w[(long)t * k + j] = 0.f;
            }
    }
    for (int p = 0; p < T * k; p++)
        if (!gate_up[idx[p]].q) return COLI_MISS;
    rc = coli_moe(x, 1, T, H, I, k, idx, w, E, gate_up, down, scheme, g, ys, y, NULL);
    if (rc) return rc;
    const uint16_t *xb = (const uint16_t *)x;
    uint16_t *yb = (uint16_t *)y;
    for (int t = 0; t < T; t++)  /* (the torch path's bf16(ident * x), then the bf16 sum) */
        for (long c = (long)t * H; c < (long)(t + 1) * H; c++)
            yb[c] = f32_to_bf16(bf16_to_f32(yb[c]) + bf16_to_f32(f32_to_bf16(ident[t] * bf16_to_f32(xb[c]))));
    return 0;
}
