/* The expert cache's reuse policy on its per-fetch path (colibri/store/reuse.py, store/cache.py).
 *
 * Why in C: the store updates the estimate of one layer at every fetch and picks a victim at every read it
 * starts, ~50 times a token. In numpy those are ~20 small array calls each; between two of them the expert
 * kernels stream megabytes through the caches, and the cold interpreter paid ~70 us an update and ~45 us a
 * victim (an 8 MB sweep between calls alone takes a numpy update from 14 to 48 us). The arithmetic is
 * reuse.py's, operation for operation (built with -ffp-contract=off), so both give the same bits
 * (tests/test_cache.py). */
#include <math.h>
#include <stdint.h>
#include <string.h>

#define MAX_E 4096 /* native_reuse.py MAX_EXPERTS: a wider layer stays on the numpy path */

/* One fetch of a layer whose row is (b, a_skip, prev, seen, exp)[E]; ids[n] the experts it used; *a_reuse and
 * *last the row's scalars; rate, reuse_rate and L as in ReuseEstimator. */
int coli_reuse_observe(double *b, double *a_skip, uint8_t *prev, uint8_t *seen, double *exp, long E,
                       const long *ids, int n, double rate, double reuse_rate, double *a_reuse, double *last,
                       double t, long L) {
    if (E > MAX_E) return -1;
    double u[MAX_E];
    memset(u, 0, (size_t)E * sizeof(double));
    for (int i = 0; i < n; i++) {
        if (ids[i] < 0 || ids[i] >= E) return -2;
        u[ids[i]] = 1.0;
    }
    long k = 0;
    for (long j = 0; j < E; j++) k += prev[j] != 0;
    double c = reuse_rate, s = 0.0;
    /* the last access's experts, ascending, one EWMA step each: sum of (1 - c) ** (k-1-p) * used, in order */
    for (long j = 0, p = 0; j < E; j++)
        if (prev[j]) {
            double x = pow(1 - c, (double)(k - 1 - p)) * u[j];
            s = p++ == 0 ? x : s + x;
        }
    if (k) {
        *a_reuse = pow(1 - c, (double)k) * *a_reuse + c * s;
    }
    double r3 = 3 * rate, lw = (double)L, base = t + lw, ar = 1 - *a_reuse;
    for (long j = 0; j < E; j++) {
        int used = u[j] > 0, sn = seen[j] | used;
        if (sn) b[j] = b[j] + (u[j] - b[j]) * rate;
        if (sn && !prev[j]) a_skip[j] = a_skip[j] + (u[j] - a_skip[j]) * r3;
        seen[j] = (uint8_t)sn;
        prev[j] = (uint8_t)used;
        double o = used ? ar : 1.0 - a_skip[j];
        exp[j] = o * lw / (b[j] > 1e-6 ? b[j] : 1e-6) + base;
    }
    *last = t;
    return 0;
}

/* far[i] = row[key_expert[i]] for the slots whose key_layer is `layer` (a fetch moved that layer's estimate). */
int coli_reuse_rescore(double *far, const long *key_layer, const long *key_expert, long n, long layer,
                       const double *row, long E) {
    for (long i = 0; i < n; i++)
        if (key_layer[i] == layer) {
            if (key_expert[i] < 0 || key_expert[i] >= E) return -2;
            far[i] = row[key_expert[i]];
        }
    return 0;
}

static int before(const double *far, const long *lpos, const long *tick, long i, long j) {
    return far[i] > far[j] || (far[i] == far[j] && (lpos[i] < lpos[j] || (lpos[i] == lpos[j] && tick[i] < tick[j])));
}

/* The first m slots of the victim order into out (the count returned): largest far, then smallest lpos, then
 * smallest tick, then lowest index (numpy's stable lexsort in cache.py's _victim); slots at far -inf (nothing
 * resident) are not in it. The store walks it until a slot may go, almost always within the first few. */
long coli_reuse_order(const double *far, const long *lpos, const long *tick, long n, long *out, long m) {
    long got = 0;
    for (long i = 0; i < n; i++) {
        if (far[i] == -INFINITY || (got == m && !before(far, lpos, tick, i, out[m - 1]))) continue;
        long p = got < m ? got++ : m - 1;  /* (insert: shift the later ones down, the last drops out when full) */
        while (p > 0 && before(far, lpos, tick, i, out[p - 1])) {
            out[p] = out[p - 1];
            p--;
        }
        out[p] = i;
    }
    return got;
}
