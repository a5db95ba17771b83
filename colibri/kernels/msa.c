/* MiniMax-M3's block selection ("MiniMax Sparse Attention": its lightning indexer after the projections), for the
 * rows of one call: each indexer head scores every key up to the row's own position, a block of `blk` keys scores
 * its best key, the row's own `local` blocks are always kept and then the `topk` best (models/minimax_m3_vl_text.py
 * SparseAttention._blocks: the same rule in torch, which f32 and GPU rows take). */
#include "common.h"

typedef struct {
    int T, Hi, Di, blk, nb;
    const float *iq;        /* [T][Hi][Di] f32: the rows' indexer queries (normed, rotated) */
    const void *const *ik;  /* row t's sequence's indexer keys, bf16 [S[t]][Di] */
    const int *S;
    float *bs;              /* [T][Hi][nb]: the blocks' scores */
} msa_job;

static float dot_bf16(const uint16_t *k, const float *q, int D) {
    float a = 0.f;
    int d = 0;
#ifdef COLI_AVX512
    __m512 acc = _mm512_setzero_ps();
    for (; d + 16 <= D; d += 16) acc = _mm512_fmadd_ps(bf16_16_to_f32(k + d), _mm512_loadu_ps(q + d), acc);
    a = _mm512_reduce_add_ps(acc);
#endif
    for (; d < D; d++) a += bf16_to_f32(k[d]) * q[d];
    return a;
}

/* (row, block) jobs: the block's keys read once for every head */
static void msa_part(void *p, int id, int n) {
    msa_job *m = (msa_job *)p;
    long a, b;
    split((long)m->T * m->nb, id, n, &a, &b);
    for (long i = a; i < b; i++) {
        int t = (int)(i / m->nb), bl = (int)(i % m->nb);
        int s0 = bl * m->blk, s1 = s0 + m->blk < m->S[t] ? s0 + m->blk : m->S[t];
        float *out = m->bs + (long)t * m->Hi * m->nb + bl;
        for (int h = 0; h < m->Hi; h++) out[(long)h * m->nb] = -INFINITY;  /* (a block past the row: none) */
        for (int s = s0; s < s1; s++) {
            const uint16_t *k = (const uint16_t *)m->ik[t] + (long)s * m->Di;
            for (int h = 0; h < m->Hi; h++) {
                float v = dot_bf16(k, m->iq + ((long)t * m->Hi + h) * m->Di, m->Di);
                if (v > out[(long)h * m->nb]) out[(long)h * m->nb] = v;
            }
        }
    }
}

/* keep [T][Hi][nb] (1: kept) for T rows at positions S[t] - 1, blocks of blk keys (nb >= each row's block count). */
int coli_msa_select(int T, const float *iq, int Hi, int Di, const void *const *ik, const int *S, int blk, int topk,
                    int local, int nb, uint8_t *keep) {
    if (T < 1 || Hi < 1 || blk < 1 || topk < 1 || local < 0) return -3;
    long keys = 0;
    for (int t = 0; t < T; t++) {
        if (S[t] < 1 || (S[t] + blk - 1) / blk > nb) return -3;
        keys += S[t];
    }
    float *bs = (float *)malloc(sizeof(float) * (size_t)T * Hi * nb);
    if (!bs) return -2;
    msa_job m = {T, Hi, Di, blk, nb, iq, ik, S, bs};
    coli_parallel(msa_part, &m, n_threads_for(keys * Di * 2));
    memset(keep, 0, (size_t)T * Hi * nb);
    for (int t = 0; t < T; t++)
        for (int h = 0; h < Hi; h++) {
            float *sc = bs + ((long)t * Hi + h) * nb;
            uint8_t *kp = keep + ((long)t * Hi + h) * nb;
            int nbt = (S[t] + blk - 1) / blk, own = (S[t] - 1) / blk;
            for (int j = 0; j < local; j++) sc[own - j > 0 ? own - j : 0] = INFINITY;
            for (int r = 0; r < (topk < nbt ? topk : nbt); r++) {  /* the best block not yet kept, topk times */
                int best = -1;
                for (int c = 0; c < nbt; c++)
                    if (!kp[c] && (best < 0 || sc[c] > sc[best])) best = c;
                kp[best] = 1;
            }
        }
    free(bs);
    return 0;
}
