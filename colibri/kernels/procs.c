/* A row's logit processors in coli_decode_run, before its pick: colibri/engine/sampling.py
 * TokenPicker.processed's order and f32 arithmetic, so a request with them gets the same tokens in a native
 * run as step by step -- the logit bias; the repetition penalty (CTRL's, as transformers': a positive logit
 * divided by it, another multiplied by it) once for each distinct token of the row's last `window` tokens,
 * prompt included (window < 0: all of them); the presence and frequency penalties, presence + frequency *
 * count off each token generated so far. Why natively: Ollama's API asks for a repetition penalty by default,
 * and without this every such request decoded a step at a time from Python (about half the tokens/s of a
 * native run on a small model). */
#include "common.h"

/* mark: V ints, zero before the first call; stamp: nonzero, different at each call (the tokens already
 * penalised in this one are marked with it). Returns 0, or -8 for a token id outside [0, V). */
int coli_procs_apply(const coli_procs *p, float *row, long V, int *mark, int stamp) {
    for (int i = 0; i < p->n_bias; i++) {
        if (p->bias_ids[i] < 0 || p->bias_ids[i] >= V) return -8;
        row[p->bias_ids[i]] += p->bias[i];
    }
    if (p->repeat_penalty != 1.f && p->window != 0) {
        int from = p->window > 0 && p->n_hist > p->window ? p->n_hist - p->window : 0;
        float r = p->repeat_penalty;
        for (int i = from; i < p->n_hist; i++) {
            int64_t tok = p->hist[i];
            if (tok < 0 || tok >= V) return -8;
            if (mark[tok] == stamp) continue;
            mark[tok] = stamp;
            row[tok] = row[tok] > 0.f ? row[tok] / r : row[tok] * r;
        }
    }
    if (p->presence != 0.f || p->frequency != 0.f)
        for (int i = 0; i < p->n_gen; i++) {
            int64_t tok = p->gen_ids[i];
            if (tok < 0 || tok >= V) return -8;
            row[tok] -= p->presence + p->frequency * (float)p->gen_counts[i];
        }
    return 0;
}

/* The row picked tok: it joins the history and the generated counts (the arrays have room for a run; a row
 * without processors has none). */
void coli_procs_took(coli_procs *p, int64_t tok) {
    if (!p->hist || !p->gen_ids) return;
    p->hist[p->n_hist++] = tok;
    for (int i = 0; i < p->n_gen; i++)
        if (p->gen_ids[i] == tok) {
            p->gen_counts[i]++;
            return;
        }
    p->gen_ids[p->n_gen] = tok;
    p->gen_counts[p->n_gen++] = 1;
}
