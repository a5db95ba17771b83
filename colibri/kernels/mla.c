/* The attention half of a DeepSeek (MLA) decoder block for a few rows in one call: RMSNorm -> q (q_proj,
 * or q_a_proj -> norm -> q_b_proj) and the latent kv_a projection -> the latent's norm and the shared rope
 * key into the latent cache -> each head's query folded into latent space (q_nope W_uk) -> one-"head"
 * attention over the cache -> the latent context unfolded per head (W_uv) -> o_proj -> residual add ->
 * the post-attention RMSNorm. The absorbed form of colibri/models/mla.py, whose docstring derives it.
 *
 * Why: layer by layer from Python, the absorbed attention was ~25 torch ops a layer (bmm, cat, matmul,
 * softmax, masks), 60% of a DeepSeek-shaped decode step against 22% for the experts. Projections and
 * norms are the kernels the unfused path calls (same bits); the attention core rounds once where torch
 * rounded the scores and the probabilities to bf16 (scores and softmax in f32 here, as coli_attn_rows). */
#include "common.h"

/* Rotary embedding of one head's `rot` channels, x -> out (bf16, may alias): rotate-half pairs (i, i + rot/2)
 * or DeepSeek's interleaved pairs (2i, 2i + 1); cos/sin f32 [rot] (the rotate-half table: pair i's angle at
 * i and at i + rot/2). The same products and rounding as coli_rope (attn.c) for either layout. */
static void rope_head(const uint16_t *x, int rot, int interleaved, const float *c, const float *s, uint16_t *out) {
    int half = rot / 2;
    uint16_t tmp[512];
    for (int i = 0; i < half; i++) {
        int a = interleaved ? 2 * i : i, b = interleaved ? 2 * i + 1 : i + half;
        float xa = bf16_to_f32(x[a]), xb = bf16_to_f32(x[b]);
        tmp[a] = f32_to_bf16(xa * c[i] - xb * s[i]);
        tmp[b] = f32_to_bf16(xb * c[i + half] + xa * s[i + half]);
    }
    memcpy(out, tmp, sizeof(uint16_t) * rot);
}

/* y[t][h] = bf16(sum_i x[t][h][i] * w[h][i][:]) for each head h: a per-head [n_in] x [n_in, n_out] product
 * (q_nope W_uk: n_in Dn, n_out R; ctx W_uv^T: n_in R, n_out Dv), f32 sums over i in order. */
typedef struct {
    const uint16_t *x, *w;
    uint16_t *y;
    int T, n_in, n_out, heads;
    long xs, ys;  /* row strides of x and y (elements); head h's part starts at h * n_in / h * n_out */
    long xh, yh;  /* head strides within a row */
} head_mm;

#define HM_ROWS 8  /* rows that share each pass over a head's weights */
static void head_mm_part(void *p, int id, int n) {
    const head_mm *j = (const head_mm *)p;
    long h0, h1;
    split(j->heads, id, n, &h0, &h1);
    float *acc = (float *)malloc(sizeof(float) * HM_ROWS * (size_t)j->n_out);
    if (!acc) return;
    for (long h = h0; h < h1; h++) {
        const uint16_t *wh = j->w + h * (long)j->n_in * j->n_out;
        for (int t0 = 0; t0 < j->T; t0 += HM_ROWS) {
            int nt = j->T - t0 < HM_ROWS ? j->T - t0 : HM_ROWS;
            memset(acc, 0, sizeof(float) * (size_t)nt * j->n_out);
            for (int i = 0; i < j->n_in; i++) {
                const uint16_t *wr = wh + (long)i * j->n_out;
                for (int t = 0; t < nt; t++) {
                    float a = bf16_to_f32(j->x[(t0 + t) * j->xs + h * j->xh + i]);
                    float *ac = acc + (long)t * j->n_out;
                    int o = 0;
#ifdef COLI_AVX512
                    __m512 av = _mm512_set1_ps(a);  /* the scalar loop's product and sum, 16 at a time */
                    for (; o + 16 <= j->n_out; o += 16)
                        _mm512_storeu_ps(ac + o, _mm512_add_ps(_mm512_loadu_ps(ac + o),
                                                               _mm512_mul_ps(av, bf16_16_to_f32(wr + o))));
#endif
                    for (; o < j->n_out; o++) ac[o] = ac[o] + a * bf16_to_f32(wr[o]);
                }
            }
            for (int t = 0; t < nt; t++)
                for (int o = 0; o < j->n_out; o++)
                    j->y[(t0 + t) * j->ys + h * j->yh + o] = f32_to_bf16(acc[(long)t * j->n_out + o]);
        }
    }
    free(acc);
}

static void head_matmul(head_mm *j) {
    coli_parallel(head_mm_part, j, n_threads_for((long)j->heads * j->n_in * j->n_out * 2));
}

static void add_bias(uint16_t *x, const uint16_t *b, int T, long n, long stride) {
    if (b)
        for (int t = 0; t < T; t++) add_bf16(x + t * stride, b, n, x + t * stride);
}

/* T rows of bf16 hidden states h [T, hidden]; row t sits at position pos[t] of the sequence whose latent
 * cache for this layer is cache[t] (bf16 [ctx, R + Dr]: the normed latent, then the rotated rope key);
 * cos/sin f32 [T, Dr]. Writes each row's latent at its position, then (all rows written: a prompt chunk's
 * rows see their predecessors) h_out = h + attn(h) and x_out = post_norm(h_out), bf16 [T, hidden].
 * Returns 0, -1 (T out of range), -2 (memory), or a projection's error. */
int coli_mla_block(const coli_mla_layer *L, int T, const void *h, const int *pos, void *const *cache,
                   const float *cs, const float *sn, void *h_out, void *x_out) {
    if (T < 1 || T > MAX_T || L->rope > 512) return -1;
    int Hd = L->hidden, H = L->heads, Dn = L->nope, Dr = L->rope, Dv = L->vdim, R = L->kv_lora, ql = L->q_lora;
    int Dq = Dn + Dr, W = R + Dr;
    long nq = (long)H * Dq;
    size_t n = (size_t)T * (Hd + ql + ql + nq + W + (long)H * W + (long)H * R + (long)H * Dv + Hd);
    uint16_t *buf = (uint16_t *)malloc(sizeof(uint16_t) * n);
    if (!buf) return -2;
    uint16_t *xn = buf, *qa = xn + (long)T * Hd, *qan = qa + (long)T * ql, *q = qan + (long)T * ql;
    uint16_t *kva = q + T * nq, *qf = kva + (long)T * W, *ctx = qf + (long)T * H * W, *av = ctx + (long)T * H * R;
    uint16_t *o = av + (long)T * H * Dv;
    int rc = 0;
    PROF(P_RMS_IN, coli_rmsnorm(h, 1, T, Hd, L->in_w, L->in_eps, xn));
    {   /* q_proj or q_a_proj, and kv_a_proj_with_mqa: both read the normed rows */
        coli_qw w[2] = {L->wq, L->wkva};
        int N[2] = {ql ? ql : (int)nq, W};
        void *y[2] = {ql ? qa : q, kva};
        PROF(P_QKV, rc = coli_multi_gemm(xn, 1, T, Hd, L->scheme, L->group, 2, w, N, y));
        if (rc) goto done;
        add_bias(ql ? qa : q, L->bqa, T, ql ? ql : nq, ql ? ql : nq);
        add_bias(kva, L->bkva, T, W, W);
    }
    if (ql) {
        coli_rmsnorm(qa, 1, T, ql, L->qa_w, L->lora_eps, qan);
        void *y = q;
        int N = (int)nq;
        PROF(P_QKV, rc = coli_multi_gemm(qan, 1, T, ql, L->scheme, L->group, 1, &L->wqb, &N, &y));
        if (rc) goto done;
    }
    for (int t = 0; t < T; t++) {  /* the latent cache row: [norm(c), rope(k_pe)] */
        uint16_t *row = (uint16_t *)cache[t] + (long)pos[t] * W;
        coli_rmsnorm(kva + (long)t * W, 1, 1, R, L->kva_w, L->lora_eps, row);
        rope_head(kva + (long)t * W + R, Dr, L->interleaved, cs + (long)t * Dr, sn + (long)t * Dr, row + R);
        for (int hh = 0; hh < H; hh++)  /* each head's rope query, next to where its latent query goes */
            rope_head(q + t * nq + (long)hh * Dq + Dn, Dr, L->interleaved, cs + (long)t * Dr, sn + (long)t * Dr,
                      qf + ((long)t * H + hh) * W + R);
    }
    head_mm fold = {q, L->w_uk, qf, T, Dn, R, H, nq, (long)H * W, Dq, W};
    PROF(P_ROPE_KV, head_matmul(&fold));  /* qf[t][h][:R] = q_nope[t][h] W_uk[h] */
    {
        const void *kb[MAX_T];
        int S[MAX_T];
        for (int t = 0; t < T; t++) {
            kb[t] = cache[t];
            S[t] = pos[t] + 1;
        }
        /* every head reads the one latent "head": keys the whole rows, values their first R channels */
        PROF(P_ATTN, rc = coli_mla_attn(T, qf, H, W, R, kb, S, L->scale, ctx));
        if (rc) goto done;
    }
    head_mm unfold = {ctx, L->w_uvt, av, T, R, Dv, H, (long)H * R, (long)H * Dv, R, Dv};
    PROF(P_O, head_matmul(&unfold));  /* av[t][h] = ctx[t][h][:R] W_uv^T[h] */
    {
        void *y = o;
        PROF(P_O, rc = coli_multi_gemm(av, 1, T, H * Dv, L->scheme, L->group, 1, &L->wo, &Hd, &y));
        if (rc) goto done;
        add_bias(o, L->bo, T, Hd, Hd);
    }
    add_bf16((const uint16_t *)h, o, (long)T * Hd, (uint16_t *)h_out);
    PROF(P_RMS_POST, coli_rmsnorm(h_out, 1, T, Hd, L->post_w, L->post_eps, x_out));
done:
    free(buf);
    return rc;
}
