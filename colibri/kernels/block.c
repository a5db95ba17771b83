/* The attention half of a decoder block for a few rows (a decode step, a short prompt chunk) in one
 * call: RMSNorm (LayerNorm: Phi-3.5-MoE) -> q/k/v projections -> q/k norm -> clip -> rotary [-> q/k norm, q temperature: Llama 4]
 * -> KV cache write -> attention
 * over each row's own cache -> o_proj -> residual add -> the post-attention norm.
 *
 * Why: between the dozen kernels of this chain the Python glue cost more than the kernels (a third
 * of a small model's decode step) and let the pool's workers fall asleep. Each stage is the same
 * kernel the unfused path calls, on the same bf16-rounded intermediates, so the bits are those of
 * colibri/layers/attention.py's native path (tests/test_native.py checks it). */
#include "common.h"

static void clamp_bf16(uint16_t *x, long n, float c) {
    for (long i = 0; i < n; i++) {
        float v = bf16_to_f32(x[i]);
        if (v > c) x[i] = f32_to_bf16(c);
        else if (v < -c) x[i] = f32_to_bf16(-c);
    }
}

/* T rows of bf16 hidden states h [T, hidden]; row t sits at position pos[t] of the sequence whose
 * caches for this layer are kc[t] / vc[t] (bf16 [kv_heads, ctx, head_dim], head stride ks / vs; kvt != 0: rows of
 * common.h's quantized types, written by coli_kv_quantize, head strides in bytes);
 * cos/sin f32 [T, rot] the rows' rotary tables. Writes each row's key and value at its position,
 * then (all rows' keys written: a prompt chunk's rows see their predecessors) h_out = h + attn(h)
 * and x_out = post_norm(h_out) (a parallel block's: the input norm of h), both bf16 [T, hidden]. Returns 0, -1 (T out of range, or a position past
 * the temperature table), -2 (memory), -3 (a layout the layer cannot take). */

int coli_attn_block(const coli_attn_layer *L, int T, const void *h, const int *pos, void *const *kc,
                    void *const *vc, long ks, long vs, int kvt, const float *cs, const float *sn, void *h_out,
                    void *x_out) {
    if (L->mla) return kvt ? -3 : coli_mla_block(L->mla, T, h, pos, kc, cs, sn, h_out, x_out);
    if (T < 1 || T > MAX_T) return -1;
    /* the variants, read once (common.h: NULL where absent) */
    const coli_attn_values *V = L->values;
    const coli_attn_gate *G = L->gate;
    const coli_attn_positions *P = L->positions;
    const coli_attn_output *O = L->output;
    const coli_attn_keep *K = L->keep;
    int gate = G ? G->kind : COLI_GATE_NONE, k_eq_v = V && V->k_eq_v, chunk = P ? P->chunk : 0;
    const float *temp = P ? P->temp : NULL;
    float v_scale = V ? V->scale : 1.f;
    coli_qw wg = G ? G->w : (coli_qw){0};
    int Hd = L->hidden, nh = L->heads, nkv = L->kv_heads, D = L->head_dim, Dv = V && V->dim > 0 ? V->dim : D;
    long nq = (long)nh * D, nk = (long)nkv * D, nv = (long)nkv * Dv, no = (long)nh * Dv;
    /* the q gate: the gated query's rows (q and gate per head), then the gates alone; a softplus gate: wg's gates */
    long ng = gate == COLI_GATE_Q_SIGMOID ? 3 * nq : gate != COLI_GATE_NONE ? nq : 0;
    if ((gate != COLI_GATE_NONE || k_eq_v) && Dv != D) return -1;
    if (!coli_kv_ok(kvt, D, Dv) || (kvt && K)) return -3;  /* (the kept blocks' gather copies bf16 rows) */
    /* a row's bytes, a head's stride in bytes */
    int kt = kvt & 15, vt = kvt >> 4;
    long krb = coli_kv_row_bytes(kt, D, 2), vrb = coli_kv_row_bytes(vt, Dv, 2);
    long ksb = kt ? ks : ks * 2, vsb = vt ? vs : vs * 2;
    uint16_t *buf = (uint16_t *)malloc(sizeof(uint16_t) * (size_t)T * (2 * Hd + 2 * nq + 2 * nk + nv + no + ng));
    if (!buf) return -2;
    uint16_t *xn = buf, *q = xn + (long)T * Hd, *k = q + T * nq, *v = k + T * nk;
    uint16_t *q2 = v + T * nv, *k2 = q2 + T * nq, *ao = k2 + T * nk, *o = ao + T * no;
    uint16_t *qg = o + (long)T * Hd, *gates = gate == COLI_GATE_Q_SIGMOID ? qg + 2 * T * nq : qg;
    const uint16_t *hb = (const uint16_t *)h;
    int rc = 0;
    float tscale[MAX_T];  /* the rows' attention temperatures (1: none) */
    for (int t = 0; t < T; t++) {
        tscale[t] = 1.f;
        if (temp) {  /* floor((pos + 1) / floor_scale) in f32, as the torch layer computes it */
            long m = (long)floorf(((float)pos[t] + 1.f) / P->temp_floor);
            if (m < 0 || m >= P->temp_n) {
                free(buf);
                return -1;
            }
            tscale[t] = temp[m];
        }
    }
    /* The cache lines this step's keys and values go to, fetched for writing now: cold (a new position
     * each step), the writes below waited on each one (RoPE + KV write at 8 sequences 126-129 -> 46-48 us
     * a step); the projections hide the fetch. */
    for (int t = 0; t < T; t++)
        for (int j = 0; j < nkv; j++)
            for (long b = 0; b < (krb > vrb ? krb : vrb); b += 64) {
                if (b < krb) __builtin_prefetch((char *)kc[t] + j * ksb + pos[t] * krb + b, 1, 3);
                if (b < vrb) __builtin_prefetch((char *)vc[t] + j * vsb + pos[t] * vrb + b, 1, 3);
            }
    PROF(P_RMS_IN, coli_block_norm(h, T, Hd, L->in_w, L->in_b, L->in_eps, xn));
    {
        /* (keys as values: no wv, the gate projection, if any, third) */
        coli_qw w[4] = {L->wq, L->wk, k_eq_v ? wg : L->wv, wg};
        int head_gate = gate == COLI_GATE_HEAD_SOFTPLUS;
        int N[4] = {(int)(gate == COLI_GATE_Q_SIGMOID ? 2 * nq : nq), (int)nk,
                    k_eq_v ? (head_gate ? nh : (int)nq) : (int)nv, head_gate ? nh : (int)nq};
        void *y[4] = {gate == COLI_GATE_Q_SIGMOID ? qg : q, k, k_eq_v ? (void *)gates : (void *)v, gates};
        int nw = (gate >= COLI_GATE_CHANNEL_SOFTPLUS ? 4 : 3) - (k_eq_v ? 1 : 0);  /* (the softplus gates) */
        PROF(P_QKV, rc = coli_multi_gemm(xn, 1, T, Hd, L->scheme, L->group, nw, w, N, y));
        if (rc) goto done;
        if (gate == COLI_GATE_Q_SIGMOID)  /* each head's 2 D rows: its query, then its output gate */
            for (long t = 0; t < T; t++)
                for (int j = 0; j < nh; j++) {
                    memcpy(q + t * nq + (long)j * D, qg + t * 2 * nq + 2L * j * D, sizeof(uint16_t) * D);
                    memcpy(gates + t * nq + (long)j * D, qg + t * 2 * nq + 2L * j * D + D, sizeof(uint16_t) * D);
                }
        if (gate == COLI_GATE_Q_SIGMOID) add_rows(gates, G->bias, T, nq);
        add_rows(q, L->bq, T, nq);  /* as the projection's own bias add: bf16 + bf16, one rounding */
        add_rows(k, L->bk, T, nk);
        if (k_eq_v) memcpy(v, k, sizeof(uint16_t) * (size_t)T * nk);  /* the projection's output, before k's norm */
        else add_rows(v, L->bv, T, nv);
        if (V && V->norm_w)  /* (row by row: in place is safe) */
            coli_rmsnorm(v, 1, (long)T * nkv, Dv, V->norm_w, L->qk_eps, v);
    }
    if (L->qk_norm == COLI_QK_NORM_FULL) {
        coli_rmsnorm(q, 1, T, (int)nq, L->qn_w, L->qk_eps, q2);
        coli_rmsnorm(k, 1, T, (int)nk, L->kn_w, L->qk_eps, k2);
        memcpy(q, q2, sizeof(uint16_t) * T * nq);
        memcpy(k, k2, sizeof(uint16_t) * T * nk);
    }
    if (L->clip > 0) {
        clamp_bf16(q, T * nq, L->clip);
        clamp_bf16(k, T * nk, L->clip);
        clamp_bf16(v, T * nv, L->clip);
    }
    if (v_scale != 0.f && v_scale != 1.f)  /* as the torch layer's bf16 * f32 product: one rounding */
        for (long i = 0; i < T * nv; i++) v[i] = f32_to_bf16(bf16_to_f32(v[i]) * v_scale);
    if (L->qk_norm == COLI_QK_NORM_HEAD) {
        coli_rmsnorm(q, 1, (long)T * nh, D, L->qn_w, L->qk_eps, q2);
        coli_rmsnorm(k, 1, (long)T * nkv, D, L->kn_w, L->qk_eps, k2);
        memcpy(q, q2, sizeof(uint16_t) * T * nq);
        memcpy(k, k2, sizeof(uint16_t) * T * nk);
    }
    PROF(P_ROPE_KV, {
        coli_rope(q, 1, T, nh, D, L->rot, cs, sn, q2);  /* q2, k2: rotated */
        coli_rope(k, 1, T, nkv, D, L->rot, cs, sn, k2);
        if (L->qk_norm == COLI_QK_NORM_HEAD_POST_ROPE) {  /* normed into q, k, then swapped */
            coli_rmsnorm(q2, 1, (long)T * nh, D, L->qn_w, L->qk_eps, q);
            coli_rmsnorm(k2, 1, (long)T * nkv, D, L->kn_w, L->qk_eps, k);
            uint16_t *tq = q2, *tk = k2;
            q2 = q, k2 = k, q = tq, k = tk;
        }
        if (temp)  /* q * scale in f32, one rounding (the torch layer's bf16 * f32 product) */
            for (int t = 0; t < T; t++)
                for (long i = 0; i < nq; i++)
                    q2[t * nq + i] = f32_to_bf16(bf16_to_f32(q2[t * nq + i]) * tscale[t]);
        for (int t = 0; t < T; t++)
            for (int j = 0; j < nkv; j++) {
                uint8_t *kd = (uint8_t *)kc[t] + j * ksb + pos[t] * krb, *vd = (uint8_t *)vc[t] + j * vsb + pos[t] * vrb;
                if (kt) coli_kv_quantize(k2 + t * nk + (long)j * D, 1, 1, D, kt, kd, 0);
                else memcpy(kd, k2 + t * nk + (long)j * D, sizeof(uint16_t) * D);
                if (vt) coli_kv_quantize(v + t * nv + (long)j * Dv, 1, 1, Dv, vt, vd, 0);
                else memcpy(vd, v + t * nv + (long)j * Dv, sizeof(uint16_t) * Dv);
            }
    });
    {
        const void *kb[MAX_T], *vb[MAX_T];
        int S[MAX_T];
        for (int t = 0; t < T; t++) {
            int valid = pos[t] + 1, lo = L->window > 0 && valid > L->window ? valid - L->window : 0;
            if (chunk > 0) lo = pos[t] / chunk * chunk;  /* chunked: the query's own chunk */
            kb[t] = (char *)kc[t] + lo * krb;
            vb[t] = (char *)vc[t] + lo * vrb;
            S[t] = valid - lo;
        }
        if (K && (L->window > 0 || chunk > 0 || L->sinks)) { rc = -3; goto done; }  /* (blocks from 0) */
        if (K)
            PROF(P_ATTN, rc = coli_attn_rows_keep(T, q2, nh, nkv, D, Dv, kb, ks, vb, vs, S, L->scale, K->blocks,
                                                  K->blk, K->nb, ao));
        else
            PROF(P_ATTN, rc = coli_attn_rows(T, q2, 1, nh, nkv, D, Dv, kb, ks, vb, vs, S, L->scale, L->sinks, ao,
                                             kvt));
        if (rc) goto done;
        if (gate == COLI_GATE_Q_SIGMOID) coli_gate_mul(ao, gates, T * nq);
        else if (gate != COLI_GATE_NONE)
            coli_softplus_gate_mul(ao, gates, T, nh, D, gate == COLI_GATE_HEAD_SOFTPLUS);
    }
    {
        void *y = o;
        PROF(P_O, rc = coli_multi_gemm(ao, 1, T, (int)no, L->scheme, L->group, 1, &L->wo, &Hd, &y));
        if (rc) goto done;
        add_rows(o, L->bo, T, Hd);
    }
    if (O && O->norm_w) coli_rmsnorm(o, 1, T, Hd, O->norm_w, O->norm_eps, o);  /* (row by row: in place is safe) */
    uint16_t *hn = (uint16_t *)h_out;
    add_bf16(hb, o, (long)T * Hd, hn);
    if (O && O->parallel) memcpy(x_out, xn, sizeof(uint16_t) * (size_t)T * Hd);
    else PROF(P_RMS_POST, coli_block_norm(h_out, T, Hd, L->post_w, L->post_b, L->post_eps, x_out));
done:
    free(buf);
    return rc;
}

void coli_gate_mul(uint16_t *x, const uint16_t *g, long n) {
    for (long i = 0; i < n; i++) {
        float s = bf16_to_f32(f32_to_bf16(1.f / (1.f + expf(-bf16_to_f32(g[i])))));
        x[i] = f32_to_bf16(bf16_to_f32(x[i]) * s);
    }
}

void coli_softplus_gate_mul(uint16_t *x, const uint16_t *g, long T, int heads, int D, int per_head) {
    for (long i = 0; i < T * heads * (long)D; i++) {
        float v = bf16_to_f32(g[per_head ? i / D : i]);
        float s = bf16_to_f32(f32_to_bf16(v > 20.f ? v : log1pf(expf(v))));
        x[i] = f32_to_bf16(bf16_to_f32(x[i]) * s);
    }
}
