/* A token's log-probability and the most likely alternatives, from one logits row (the model's, before any
 * processor): engine/sampling.py `token_logprobs`'s native form, used by single steps and native runs alike
 * where the kernels load, so a request's log-probs do not depend on which of the two served it.
 * In f32, as torch's log_softmax: (x - max) - log(sum of exp(x - max)), the sum in 16 lanes and then across
 * them (x - (max + log(sum)) lost ~2 ulp of a very unlikely token's -85). */
#include "common.h"

/* *lp = log softmax(x)[tok]; ids/vals[0..n_top) the n_top (<= COLI_LP_MAX) largest, most likely first (ties: the
 * lower id), as log-probabilities. Returns 0, or -1 for a NaN or a row without a finite value. */
int coli_logprobs(const float *x, long V, long tok, int n_top, float *lp, int64_t *ids, float *vals) {
    if (V < 1 || tok < 0 || tok >= V || n_top < 0 || n_top > COLI_LP_MAX) return -1;
    float mx = row_max_nan(x, V);
    if (!(mx > -INFINITY) || mx == INFINITY) return -1;  /* (a NaN fails the first test) */
    float sum = 0.f;
    long i = 0;
#ifdef COLI_AVX512
    __m512 vs = _mm512_setzero_ps(), vmx = _mm512_set1_ps(mx);
    for (; i + 16 <= V; i += 16) vs = _mm512_add_ps(vs, exp512_ps(_mm512_sub_ps(_mm512_loadu_ps(x + i), vmx)));
    sum = _mm512_reduce_add_ps(vs);
#endif
    for (; i < V; i++) sum += expf(x[i] - mx);
    float ls = logf(sum);
    *lp = (x[tok] - mx) - ls;
    int n = 0;  /* the best n so far, in order (an insertion: n_top is small) */
    for (long j = 0; j < V && n_top > 0; j++) {
        float v = x[j];
        if (n == n_top && !(v > vals[n - 1])) continue;  /* (an equal value keeps the lower id, seen first) */
        int at = n < n_top ? n++ : n_top - 1;
        while (at > 0 && v > vals[at - 1]) {
            vals[at] = vals[at - 1];
            ids[at] = ids[at - 1];
            at--;
        }
        vals[at] = v;
        ids[at] = j;
    }
    for (int k = 0; k < n; k++) vals[k] = (vals[k] - mx) - ls;
    return 0;
}
