/* The attention half of a DeepSeek (MLA) decoder block for a few rows in one call: RMSNorm -> q (q_proj,
 * or q_a_proj -> norm -> q_b_proj) and the latent kv_a projection -> the latent's norm and the shared rope
 * key into the latent cache -> each head's query folded into latent space (q_nope W_uk) -> one-"head"
 * attention over the cache -> the latent context unfolded per head (W_uv) -> (a sigmoid gate per head, Ling
 * 3.0's, or per channel from the query's projection, A.X K2's, whose norms are gated too) -> o_proj -> residual
 * add -> the post-attention RMSNorm. The absorbed form of colibri/layers/mla.py, whose docstring derives it.
 *
 * Why: layer by layer from Python, the absorbed attention was ~25 torch ops a layer (bmm, cat, matmul,
 * softmax, masks), 60% of a DeepSeek-shaped decode step against 22% for the experts. Projections and
 * norms are the kernels the unfused path calls (same bits); the attention core rounds once where torch
 * rounded the scores and the probabilities to bf16 (scores and softmax in f32 here, as coli_attn_rows). */
#include "common.h"
#include "attn.h"

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

/* The two products with kv_b_proj's halves, read from its quantized rows as the container holds them (int8:
 * q [H * (Dn + Dv), R], one f32 scale a row; int4: nibbles [rows, R/2] with an f16 scale and min per group
 * of g along R; head h's K rows at h * (Dn + Dv), its V rows Dn further), each weight dequantized in f32 as
 * it is used: nothing dequantized is kept (a bf16 copy of the halves was twice the int8 bytes: ~2 GB more
 * RAM for DeepSeek-V3, read every token).
 *   fold:   qf[t][h][:R] = sum_d x[t][h][d] * w[K row d][:]     (q_nope W_uk)
 *   unfold: av[t][h][v]  = sum_r ctx[t][h][r] * w[V row v][r]   (ctx W_uv^T)
 * f32 sums (fused multiply-adds, in register tiles of 4 rows), one bf16 rounding each. */
typedef struct {
    const uint16_t *x;
    coli_qw w;
    int scheme, group;    /* 8, or 4 with groups of `group` */
    uint16_t *y;
    int T, H, Dn, Dv, R;
    long xs, xh, ys, yh;  /* row and head strides of x and y (elements) */
    int failed;           /* a worker's scratch allocation failed (the block returns -2) */
} kvb_job;

#define KB 4  /* rows (tokens), and V rows, per register tile */

/* Weight (row, c) of kv_b_proj in f32: int8 q * scale; int4 q * scale + min of its group. */
static inline float kvb_w(const kvb_job *j, long row, int c) {
    if (j->scheme == 8) return (float)((const int8_t *)j->w.q)[row * j->R + c] * ((const float *)j->w.s)[row];
    uint8_t b = ((const uint8_t *)j->w.q)[row * (j->R / 2) + c / 2];
    long gi = row * (j->R / j->group) + c / j->group;
    return fmaf((float)(c & 1 ? b >> 4 : b & 15), f16_to_f32(((const uint16_t *)j->w.s)[gi]),
                f16_to_f32(((const uint16_t *)j->w.m)[gi]));
}

#ifdef COLI_AVX512
/* Weights (row, c..c+16) as kvb_w computes them (c a multiple of 16; int4: within one group). */
static inline __m512 kvb_w16(const kvb_job *j, long row, int c) {
    if (j->scheme == 8)
        return _mm512_mul_ps(
            _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)((const int8_t *)j->w.q + row * j->R + c)))),
            _mm512_set1_ps(((const float *)j->w.s)[row]));
    __m128i b8 = _mm_loadl_epi64((const __m128i *)((const uint8_t *)j->w.q + row * (j->R / 2) + c / 2)), f = _mm_set1_epi8(15);
    __m128i e = _mm_unpacklo_epi8(_mm_and_si128(b8, f), _mm_and_si128(_mm_srli_epi16(b8, 4), f));  /* in column order */
    long gi = row * (j->R / j->group) + c / j->group;
    return _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(e)), _mm512_set1_ps(f16_to_f32(((const uint16_t *)j->w.s)[gi])),
                           _mm512_set1_ps(f16_to_f32(((const uint16_t *)j->w.m)[gi])));
}

/* KB rows' fold over KC chunks of 16 channels from c (KC a constant after inlining: the KB x KC sums stay in
 * registers): y[t][16k..] = bf16(sum_d xa[t][d] * w[row0 + d][c + 16k..]). */
static inline __attribute__((always_inline)) void fold_tile(const kvb_job *j, const float *xa, long row0, int c, int KC,
                                                            uint16_t *const *y) {
    __m512 acc[KB][4];
    for (int t = 0; t < KB; t++)
        for (int k = 0; k < KC; k++) acc[t][k] = _mm512_setzero_ps();
    for (int d = 0; d < j->Dn; d++) {
        __m512 wv[4];
        for (int k = 0; k < KC; k++) wv[k] = kvb_w16(j, row0 + d, c + 16 * k);
        for (int t = 0; t < KB; t++) {
            __m512 a = _mm512_set1_ps(xa[t * j->Dn + d]);
            for (int k = 0; k < KC; k++) acc[t][k] = _mm512_fmadd_ps(a, wv[k], acc[t][k]);
        }
    }
    for (int t = 0; t < KB; t++)
        if (y[t])
            for (int k = 0; k < KC; k++) _mm256_storeu_si256((__m256i *)(y[t] + 16 * k), f32_to_bf16_16(acc[t][k]));
}

/* KB rows x the KB V rows from row0: the unfold's dot products over R (a multiple of 16), out[t * KB + v]. */
static inline void unfold_tile(const kvb_job *j, const uint16_t *const *x, long row0, float *out) {
    __m512 acc[KB * KB];
    for (int i = 0; i < KB * KB; i++) acc[i] = _mm512_setzero_ps();
    for (int r = 0; r < j->R; r += 16) {
        __m512 xv[KB], wv[KB];
        for (int t = 0; t < KB; t++) xv[t] = bf16_16_to_f32(x[t] + r);
        for (int v = 0; v < KB; v++) wv[v] = kvb_w16(j, row0 + v, r);
        for (int t = 0; t < KB; t++)
            for (int v = 0; v < KB; v++) acc[t * KB + v] = _mm512_fmadd_ps(xv[t], wv[v], acc[t * KB + v]);
    }
    _mm512_storeu_ps(out, hsum16(acc));
}
#endif

/* Whether kvb_w16 applies from column 0 in steps of 16 (int4: groups of 16s). */
static inline int kvb_vec(const kvb_job *j) { return j->scheme == 8 || j->group % 16 == 0; }

static void fold_part(void *p, int id, int n) {
    kvb_job *j = (kvb_job *)p;
    long h0, h1;
    split(j->H, id, n, &h0, &h1);
    int R = j->R, Dn = j->Dn;
    float *xa = (float *)malloc(sizeof(float) * KB * (size_t)Dn);
    if (!xa) {
        j->failed = 1;
        return;
    }
    for (long h = h0; h < h1; h++) {
        long row0 = h * (long)(Dn + j->Dv);  /* the head's first K row */
        for (int t0 = 0; t0 < j->T; t0 += KB) {
            uint16_t *y[KB];
            for (int t = 0; t < KB; t++) {  /* rows past T: zeros, not stored */
                y[t] = t0 + t < j->T ? j->y + (t0 + t) * j->ys + h * j->yh : NULL;
                for (int d = 0; d < Dn; d++)
                    xa[t * Dn + d] = y[t] ? bf16_to_f32(j->x[(t0 + t) * j->xs + h * j->xh + d]) : 0.f;
            }
            int c = 0;
#ifdef COLI_AVX512
            for (; kvb_vec(j) && c + 64 <= R; c += 64) {
                uint16_t *yc[KB];
                for (int t = 0; t < KB; t++) yc[t] = y[t] ? y[t] + c : NULL;
                fold_tile(j, xa, row0, c, 4, yc);
            }
            for (; kvb_vec(j) && c + 16 <= R; c += 16) {
                uint16_t *yc[KB];
                for (int t = 0; t < KB; t++) yc[t] = y[t] ? y[t] + c : NULL;
                fold_tile(j, xa, row0, c, 1, yc);
            }
#endif
            for (; c < R; c++)
                for (int t = 0; t < KB && y[t]; t++) {
                    float a = 0.f;
                    for (int d = 0; d < Dn; d++) a = fmaf(xa[t * Dn + d], kvb_w(j, row0 + d, c), a);
                    y[t][c] = f32_to_bf16(a);
                }
        }
    }
    free(xa);
}

static void unfold_part(void *p, int id, int n) {
    kvb_job *j = (kvb_job *)p;
    long h0, h1;
    split(j->H, id, n, &h0, &h1);
    int R = j->R, Dv = j->Dv;
    for (long h = h0; h < h1; h++) {
        long v_row = h * (j->Dn + Dv) + j->Dn;  /* the head's first V row */
        for (int t0 = 0; t0 < j->T; t0 += KB)
            for (int v0 = 0; v0 < Dv; v0 += KB) {
                const uint16_t *x[KB];
                int nt = j->T - t0 < KB ? j->T - t0 : KB, nv = Dv - v0 < KB ? Dv - v0 : KB;
                for (int t = 0; t < KB; t++) x[t] = j->x + (t0 + (t < nt ? t : 0)) * j->xs + h * j->xh;
                float out[KB * KB];
#ifdef COLI_AVX512
                if (nv == KB && R % 16 == 0 && kvb_vec(j)) {
                    unfold_tile(j, x, v_row + v0, out);
                } else
#endif
                {
                    for (int t = 0; t < KB; t++)
                        for (int v = 0; v < nv; v++) {
                            float a = 0.f;
                            for (int r = 0; r < R; r++) a = fmaf(bf16_to_f32(x[t][r]), kvb_w(j, v_row + v0 + v, r), a);
                            out[t * KB + v] = a;
                        }
                }
                for (int t = 0; t < nt; t++)
                    for (int v = 0; v < nv; v++) j->y[(t0 + t) * j->ys + h * j->yh + v0 + v] = f32_to_bf16(out[t * KB + v]);
            }
    }
}

/* A.X K2's gated norm on rows already RMS-normed, in place: x = x sigmoid(W_up silu(W_down x)), rounded as torch's
 * bf16 ops (silu's output, W_up's, then the product in f32 once). */
static int norm_gate(const coli_mla_layer *L, const coli_qw *gd, const coli_qw *gu, uint16_t *x, int T) {
    int r = L->gate_rank, Hd = L->hidden;
    uint16_t *t1 = (uint16_t *)malloc(sizeof(uint16_t) * (size_t)T * (r + Hd)), *t2 = t1 + (long)T * r;
    if (!t1) return -2;
    void *y1 = t1, *y2 = t2;
    int rc = coli_multi_gemm(x, 1, T, Hd, L->gd_scheme, L->gd_group, 1, gd, &r, &y1);
    if (!rc) {
        for (long i = 0; i < (long)T * r; i++) {
            float v = bf16_to_f32(t1[i]);
            t1[i] = f32_to_bf16(v / (1.f + expf(-v)));
        }
        rc = coli_multi_gemm(t1, 1, T, r, L->gu_scheme, L->gu_group, 1, gu, &Hd, &y2);
    }
    if (!rc)
        for (long i = 0; i < (long)T * Hd; i++)
            x[i] = f32_to_bf16(bf16_to_f32(x[i]) / (1.f + expf(-bf16_to_f32(t2[i]))));
    free(t1);
    return rc;
}

/* T rows of bf16 hidden states h [T, hidden]; row t sits at position pos[t] of the sequence whose latent
 * cache for this layer is cache[t] (bf16 [ctx, R + Dr]: the normed latent, then the rotated rope key);
 * cos/sin f32 [T, Dr]. Writes each row's latent at its position, then (all rows written: a prompt chunk's
 * rows see their predecessors) h_out = h + attn(h) and x_out = post_norm(h_out), bf16 [T, hidden].
 * Returns 0, -1 (T out of range), -2 (memory), or a projection's error. */
int coli_mla_block(const coli_mla_layer *L, int T, const void *h, const int *pos, void *const *cache,
                   const float *cs, const float *sn, void *h_out, void *x_out) {
    return coli_mla_block_sel(L, T, h, pos, cache, cs, sn, NULL, NULL, h_out, x_out);
}

/* coli_mla_block where row t attends to the nsel[t] positions sel[t] (ascending, each <= pos[t]: DeepSeek Sparse
 * Attention's selection) instead of all pos[t] + 1; sel NULL, or sel[t] NULL, for all of them. The selected
 * latents are gathered first, so the attention is the dense one over them, in position order. */
int coli_mla_block_sel(const coli_mla_layer *L, int T, const void *h, const int *pos, void *const *cache,
                       const float *cs, const float *sn, const int *const *sel, const int *nsel, void *h_out,
                       void *x_out) {
    if (T < 1 || T > MAX_T || L->rope > 512) return -1;
    int Hd = L->hidden, H = L->heads, Dn = L->nope, Dr = L->rope, Dv = L->vdim, R = L->kv_lora, ql = L->q_lora;
    int Dq = Dn + Dr, W = R + Dr;
    long nq = (long)H * Dq;
    long nqg = L->qgate ? (long)H * (Dq + Dv) : 0;  /* A.X K2: [norm(qa), qa], q with its gates, the gates */
    size_t n = (size_t)T * (Hd + ql + ql + nq + W + (long)H * W + (long)H * R + (long)H * Dv + Hd + H
                            + (L->qgate ? 2 * ql + nqg + (long)H * Dv : 0));
    uint16_t *buf = (uint16_t *)malloc(sizeof(uint16_t) * n);
    if (!buf) return -2;
    uint16_t *xn = buf, *qa = xn + (long)T * Hd, *qan = qa + (long)T * ql, *q = qan + (long)T * ql;
    uint16_t *kva = q + T * nq, *qf = kva + (long)T * W, *ctx = qf + (long)T * H * W, *av = ctx + (long)T * H * R;
    uint16_t *o = av + (long)T * H * Dv, *gates = o + (long)T * Hd;  /* gates [T, H]: g_proj's (gated) */
    uint16_t *qcat = gates + (long)T * H, *qg = qcat + (long)T * 2 * ql, *og = qg + (long)T * nqg;
    int rc = 0;
    PROF(P_RMS_IN, coli_rmsnorm(h, 1, T, Hd, L->in_w, L->in_eps, xn));
    if (L->gate_rank && (rc = norm_gate(L, &L->in_gd, &L->in_gu, xn, T))) goto done;
    {   /* q_proj or q_a_proj, kv_a_proj_with_mqa (and g_proj): all read the normed rows */
        coli_qw w[3] = {L->wq, L->wkva, L->wg};
        int N[3] = {ql ? ql : (int)nq, W, H};
        void *y[3] = {ql ? qa : q, kva, gates};
        PROF(P_QKV, rc = coli_multi_gemm(xn, 1, T, Hd, L->scheme, L->group, L->gated ? 3 : 2, w, N, y));
        if (rc) goto done;
        add_rows(ql ? qa : q, L->bqa, T, ql ? ql : nq);
        add_rows(kva, L->bkva, T, W);
    }
    if (ql && L->qgate) {  /* one projection of [norm(qa), qa]: per head Dq query rows, then Dv gate rows */
        coli_rmsnorm(qa, 1, T, ql, L->qa_w, L->lora_eps, qan);
        for (int t = 0; t < T; t++) {
            memcpy(qcat + (long)t * 2 * ql, qan + (long)t * ql, sizeof(uint16_t) * ql);
            memcpy(qcat + (long)t * 2 * ql + ql, qa + (long)t * ql, sizeof(uint16_t) * ql);
        }
        void *y = qg;
        int N = (int)nqg;
        PROF(P_QKV, rc = coli_multi_gemm(qcat, 1, T, 2 * ql, L->scheme, L->group, 1, &L->wqb, &N, &y));
        if (rc) goto done;
        for (long th = 0; th < (long)T * H; th++) {
            memcpy(q + th * Dq, qg + th * (Dq + Dv), sizeof(uint16_t) * Dq);
            memcpy(og + th * Dv, qg + th * (Dq + Dv) + Dq, sizeof(uint16_t) * Dv);
        }
    } else if (ql) {
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
    kvb_job fold = {q, L->kvb, L->kvb_scheme, L->kvb_group, qf, T, H, Dn, Dv, R, nq, Dq, (long)H * W, W, 0};
    PROF(P_ROPE_KV, coli_parallel(fold_part, &fold, n_threads_for((long)H * Dn * R)));  /* qf[t][h][:R] */
    if (fold.failed) {
        rc = -2;
        goto done;
    }
    {
        const void *kb[MAX_T];
        int S[MAX_T];
        long gtot = 0;
        for (int t = 0; t < T; t++) {
            if (!sel || !sel[t]) continue;
            if (nsel[t] < 1) { rc = -3; goto done; }
            for (int i = 0; i < nsel[t]; i++)
                if (sel[t][i] < 0 || sel[t][i] > pos[t]) { rc = -3; goto done; }
            gtot += nsel[t];
        }
        uint16_t *gath = gtot ? (uint16_t *)malloc(sizeof(uint16_t) * (size_t)gtot * W) : NULL;
        if (gtot && !gath) { rc = -2; goto done; }
        long off = 0;
        for (int t = 0; t < T; t++) {
            if (sel && sel[t]) {  /* the selected latents, in position order */
                for (int i = 0; i < nsel[t]; i++)
                    memcpy(gath + (off + i) * W, (const uint16_t *)cache[t] + (long)sel[t][i] * W,
                           sizeof(uint16_t) * W);
                kb[t] = gath + off * W;
                S[t] = nsel[t];
                off += nsel[t];
            } else {
                kb[t] = cache[t];
                S[t] = pos[t] + 1;
            }
        }
        /* every head reads the one latent "head": keys the whole rows, values their first R channels */
        PROF(P_ATTN, rc = coli_mla_attn(T, qf, H, W, R, kb, S, L->scale, ctx));
        free(gath);
        if (rc) goto done;
    }
    kvb_job unfold = {ctx, L->kvb, L->kvb_scheme, L->kvb_group, av, T, H, Dn, Dv, R, (long)H * R, R, (long)H * Dv, Dv, 0};
    PROF(P_O, coli_parallel(unfold_part, &unfold, n_threads_for((long)H * Dv * R)));  /* av[t][h] */
    if (unfold.failed) {
        rc = -2;
        goto done;
    }
    if (L->qgate)  /* each output channel times sigmoid(its gate), the product in f32 once (torch's f32 gate) */
        for (long i = 0; i < (long)T * H * Dv; i++)
            av[i] = f32_to_bf16(bf16_to_f32(av[i]) / (1.f + expf(-bf16_to_f32(og[i]))));
    if (L->gated)  /* each head's output times sigmoid(its gate), both rounded to bf16 as torch's bf16 ops */
        for (long r = 0; r < (long)T * H; r++) {
            float s = bf16_to_f32(f32_to_bf16(1.f / (1.f + expf(-bf16_to_f32(gates[r])))));
            for (int d = 0; d < Dv; d++) av[r * Dv + d] = f32_to_bf16(bf16_to_f32(av[r * Dv + d]) * s);
        }
    {
        void *y = o;
        PROF(P_O, rc = coli_multi_gemm(av, 1, T, H * Dv, L->scheme, L->group, 1, &L->wo, &Hd, &y));
        if (rc) goto done;
        add_rows(o, L->bo, T, Hd);
    }
    add_bf16((const uint16_t *)h, o, (long)T * Hd, (uint16_t *)h_out);
    PROF(P_RMS_POST, coli_rmsnorm(h_out, 1, T, Hd, L->post_w, L->post_eps, x_out));
    if (L->gate_rank && L->post_gd.q) rc = norm_gate(L, &L->post_gd, &L->post_gu, (uint16_t *)x_out, T);
done:
    free(buf);
    return rc;
}

/* MLA's absorbed attention (mla.c): row t's H query heads q [T, H, W] (bf16) over its latent cache kv[t]
 * (bf16 [S[t], W], keys the whole rows, values their first R channels) -> out [T, H, R] bf16, scores and
 * softmax in f32. Why not coli_attn_rows with one kv head: each of its heads reads the whole cache, H times
 * a token (16-128 heads: at 2048 positions the DeepSeek-V3 layer's attention cost more than torch's one
 * matmul). Here a group of MLA_HB heads shares each pass over the cache: 16 positions' rows are scored
 * against every head of the group while they sit in L1, and summed into every head's values the same way. */
#ifndef MLA_HB
#define MLA_HB 16
#endif
typedef struct {
    const uint16_t *q;
    const void *const *kv;
    const int *S;
    int T, H, W, R, Smax, hb;  /* hb: heads per group (a job), at most MLA_HB */
    float scale;
    uint16_t *out;
    int failed;
} mla_job;

static void mla_heads(const mla_job *j, int t, int h0, int nh, float *sc, float *of) {
    const uint16_t *kb = (const uint16_t *)j->kv[t], *q = j->q + ((long)t * j->H + h0) * j->W;
    int S = j->S[t], W = j->W, R = j->R;
    float mx[MLA_HB], den[MLA_HB];  /* (nh <= hb <= MLA_HB) */
    int s1 = 0;
#if defined(COLI_AVX512) && defined(__AVX512BF16__)
    if (W % 32 == 0) {
        __m512 mxv[MLA_HB];
        for (int h = 0; h < nh; h++) mxv[h] = _mm512_set1_ps(-INFINITY);
        for (; s1 < S; s1 += 16)
            for (int h = 0; h < nh; h++)
                attn_scores16(kb, q + (long)h * W, W, s1, S - s1 < 16 ? S - s1 : 16, j->scale, sc + (long)h * S, mxv + h);
        for (int h = 0; h < nh; h++) mx[h] = _mm512_reduce_max_ps(mxv[h]);
    } else
#endif
    {
        for (int h = 0; h < nh; h++) mx[h] = -INFINITY;
        for (int s = 0; s < S; s++)
            for (int h = 0; h < nh; h++) {
                float a = 0.f;
                for (int d = 0; d < W; d++) a += bf16_to_f32(q[(long)h * W + d]) * bf16_to_f32(kb[(long)s * W + d]);
                float v = sc[(long)h * S + s] = a * j->scale;
                if (v > mx[h]) mx[h] = v;
            }
    }
    for (int h = 0; h < nh; h++) den[h] = attn_exp(sc + (long)h * S, S, mx[h], NULL);
    memset(of, 0, sizeof(float) * (size_t)nh * R);
    for (int b = 0; b < S; b += 16) {  /* 16 positions' rows, summed into every head while in L1 */
        int nb = S - b < 16 ? S - b : 16, c = 0;
        for (int h = 0; h < nh; h++) {
            const float *p = sc + (long)h * S + b;
            float *o = of + (long)h * R;
            c = 0;
#if defined(COLI_AVX512) && defined(__AVX512BF16__) && !defined(MLA_VALUES_F32)
            /* two positions per vdpbf16ps, their weights rounded to bf16 (as torch's bf16 product of the
             * probabilities and the latents), sums in f32: half the instructions of widening each value
             * (-DMLA_VALUES_F32 via COLIBRI_NATIVE_CFLAGS: the widening path below, for A/B runs)
             * (the values were 2/3 of the attention of a 128-head layer at 4096 positions) */
            uint32_t pp[8];
            for (int s = 0; s < 16; s += 2)
                pp[s / 2] = (s < nb ? f32_to_bf16(p[s]) : 0u) | (uint32_t)(s + 1 < nb ? f32_to_bf16(p[s + 1]) : 0u) << 16;
            /* unpacklo/hi put channels 8k..8k+3 / 8k+4..8k+7 in lanes 4k..4k+3: back in channel order */
            const __m512i o0 = _mm512_set_epi32(23, 22, 21, 20, 7, 6, 5, 4, 19, 18, 17, 16, 3, 2, 1, 0);
            const __m512i o1 = _mm512_set_epi32(31, 30, 29, 28, 15, 14, 13, 12, 27, 26, 25, 24, 11, 10, 9, 8);
            for (; c + 32 <= R; c += 32) {
                __m512 lo = _mm512_setzero_ps(), hi = _mm512_setzero_ps();
                for (int s = 0; s < nb; s += 2) {
                    __m512i r0 = _mm512_loadu_si512((const void *)(kb + (long)(b + s) * W + c));
                    __m512i r1 = s + 1 < nb ? _mm512_loadu_si512((const void *)(kb + (long)(b + s + 1) * W + c))
                                            : _mm512_setzero_si512();
                    __m512bh w = (__m512bh)_mm512_set1_epi32((int)pp[s / 2]);
                    lo = _mm512_dpbf16_ps(lo, (__m512bh)_mm512_unpacklo_epi16(r0, r1), w);
                    hi = _mm512_dpbf16_ps(hi, (__m512bh)_mm512_unpackhi_epi16(r0, r1), w);
                }
                _mm512_storeu_ps(o + c, _mm512_add_ps(_mm512_loadu_ps(o + c), _mm512_permutex2var_ps(lo, o0, hi)));
                _mm512_storeu_ps(o + c + 16,
                                 _mm512_add_ps(_mm512_loadu_ps(o + c + 16), _mm512_permutex2var_ps(lo, o1, hi)));
            }
#elif defined(COLI_AVX512)
            const __m512i hi = _mm512_set1_epi32((int)0xFFFF0000u);
            const __m512i lo_i = _mm512_set_epi32(23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
            const __m512i hi_i = _mm512_set_epi32(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8);
            for (; c + 32 <= R; c += 32) {  /* even and odd channels apart, interleaved once (attn_values_bf) */
                __m512 ev = _mm512_setzero_ps(), od = _mm512_setzero_ps();
                for (int s = 0; s < nb; s++) {
                    __m512i x = _mm512_loadu_si512((const void *)(kb + (long)(b + s) * W + c));
                    __m512 ps = _mm512_set1_ps(p[s]);
                    ev = _mm512_fmadd_ps(_mm512_castsi512_ps(_mm512_slli_epi32(x, 16)), ps, ev);
                    od = _mm512_fmadd_ps(_mm512_castsi512_ps(_mm512_and_si512(x, hi)), ps, od);
                }
                _mm512_storeu_ps(o + c, _mm512_add_ps(_mm512_loadu_ps(o + c), _mm512_permutex2var_ps(ev, lo_i, od)));
                _mm512_storeu_ps(o + c + 16,
                                 _mm512_add_ps(_mm512_loadu_ps(o + c + 16), _mm512_permutex2var_ps(ev, hi_i, od)));
            }
#endif
            for (; c < R; c++) {
                float a = 0.f;
                for (int s = 0; s < nb; s++) a += p[s] * bf16_to_f32(kb[(long)(b + s) * W + c]);
                o[c] += a;
            }
        }
    }
    for (int h = 0; h < nh; h++) attn_out(of + (long)h * R, den[h], j->out + ((long)t * j->H + h0) * R, 1, h, R);
}

static void mla_part(void *p, int id, int n) {
    mla_job *j = (mla_job *)p;
    int groups = (j->H + j->hb - 1) / j->hb;
    long a, b;
    split((long)j->T * groups, id, n, &a, &b);
    if (a >= b) return;
    float *sc = (float *)malloc(sizeof(float) * (size_t)j->hb * ((size_t)j->Smax + j->R));
    if (!sc) {
        j->failed = 1;  /* (any worker's: the call returns -2) */
        return;
    }
    for (long i = a; i < b; i++) {
        int t = (int)(i / groups), h0 = (int)(i % groups) * j->hb;
        mla_heads(j, t, h0, j->H - h0 < j->hb ? j->H - h0 : j->hb, sc, sc + (size_t)j->hb * j->Smax);
    }
    free(sc);
}

int coli_mla_attn(int T, const void *q, int H, int W, int R, const void *const *kv, const int *S, float scale,
                  void *out) {
    if (T < 1 || R > W) return -3;
    int Smax = 0;
    long tot = 0;
    for (int t = 0; t < T; t++) {
        if (S[t] < 1) return -3;
        Smax = S[t] > Smax ? S[t] : Smax;
        tot += S[t];
    }
    int nt = n_threads_for((long)H * tot * W * 2), hb = MLA_HB;
    while (hb > 1 && (long)T * ((H + hb - 1) / hb) < nt) hb /= 2;  /* a group per thread at least */
    mla_job j = {(const uint16_t *)q, kv, S, T, H, W, R, Smax, hb, scale, (uint16_t *)out, 0};
    coli_parallel(mla_part, &j, nt);
    return j.failed ? -2 : 0;
}
