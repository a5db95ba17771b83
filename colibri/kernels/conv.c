/* LFM2's gated short convolution for decode rows (colibri/models/lfm2_moe.py ShortConv): one row per sequence, each
 * continuing its own state (the last K-1 gated inputs, bf16 [H, K-1]); and the whole mixing half of such a decoder
 * block in one call, as coli_attn_block is for attention. The arithmetic is ShortConv's torch form for rows that
 * continue a state, step for step: the same bits. */
#include "common.h"

/* Rows t of bcx (bf16 [T, 3H]: B, C, x) -> out bf16 [T, H] = C * conv(B * x), the state of row t (state[t]) moved on
 * by one input: y = bias + sum_k w[c, k] * window[k] over the K-long window (the state, then this row's B * x),
 * accumulated in f32 from 0 in k's order, rounded to bf16, times C. w f32 [H, K]; bias f32 [H] or NULL. */
int coli_conv_rows(int T, int H, int K, const uint16_t *bcx, void *const *state, const float *w, const float *bias,
                   uint16_t *out) {
    if (T < 1 || T > MAX_T || K < 2) return -1;
    for (int t = 0; t < T; t++) {
        const uint16_t *b = bcx + (long)t * 3 * H, *c = b + H, *x = c + H;
        uint16_t *st = (uint16_t *)state[t];
        for (int ch = 0; ch < H; ch++) {
            uint16_t bx = f32_to_bf16(bf16_to_f32(b[ch]) * bf16_to_f32(x[ch]));
            float acc = conv_step(st + (long)ch * (K - 1), w + (long)ch * K, bx, K);
            if (bias) acc += bias[ch];
            out[(long)t * H + ch] = f32_to_bf16(bf16_to_f32(c[ch]) * bf16_to_f32(f32_to_bf16(acc)));
        }
    }
    return 0;
}

/* h bf16 [T, H] -> h_out = h + out_proj(conv rows(in_proj(rmsnorm(h)))) and x_out = post_norm(h_out), bf16 [T, H];
 * w: in_proj [3H, H] then out_proj [H, H] (scheme 8 or 4, group g). The kernels the layer-by-layer path calls, in
 * its order. */
int coli_conv_block(int T, int H, int K, int scheme, int g, const coli_qw *w, const void *h, const float *in_w,
                    float in_eps, const float *post_w, float post_eps, void *const *state, const float *conv_w,
                    const float *bias, void *h_out, void *x_out) {
    if (T < 1 || T > MAX_T) return -1;
    uint16_t *buf = (uint16_t *)malloc(sizeof(uint16_t) * (size_t)T * 6 * H);
    if (!buf) return -2;
    uint16_t *xn = buf, *bcx = xn + (long)T * H, *o = bcx + 3L * T * H, *y = o + (long)T * H;
    int N = 3 * H, rc;
    void *outs = bcx;
    coli_rmsnorm(h, 1, T, H, in_w, in_eps, xn);
    rc = coli_multi_gemm(xn, 1, T, H, scheme, g, 1, w, &N, &outs);
    if (!rc) rc = coli_conv_rows(T, H, K, bcx, state, conv_w, bias, o);
    if (!rc) {
        void *out = y;
        rc = coli_multi_gemm(o, 1, T, H, scheme, g, 1, w + 1, &H, &out);
    }
    if (!rc) {
        add_bf16((const uint16_t *)h, y, (long)T * H, (uint16_t *)h_out);
        coli_rmsnorm(h_out, 1, T, H, post_w, post_eps, x_out);
    }
    free(buf);
    return rc;
}
