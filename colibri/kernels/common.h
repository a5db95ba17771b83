/* What every kernel file shares: dtype conversions, activation load/store, the pool's interface.
 * Built with the other kernel sources by colibri/kernels/native.py. */
#ifndef COLI_COMMON_H
#define COLI_COMMON_H
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <math.h>

/* pool.c */
typedef void (*coli_job)(void *arg, int id, int n);
void coli_parallel(coli_job fn, void *arg, int n);
int coli_get_threads(void);
#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h> /* (also for F16C's _cvtsh_ss on CPUs without AVX-512: undeclared, the library failed to load) */
#endif
#if defined(__AVX512F__) && defined(__AVX512BW__)
#define COLI_AVX512 1
#endif

#ifdef COLI_AVX512
/* e^x for 16 floats (Cephes' expf: x = n ln2 + r, |r| <= ln2/2, a degree-6 polynomial in r, times 2^n;
 * within 1 ulp of glibc's expf over [-110, 95], measured): the SiLU of the expert layers and the attention softmax called expf per value,
 * ~5% of a small model's decode step. x is clamped to [-104, 89] (0 and inf beyond, as expf); a NaN
 * stays NaN (max/min return their second operand when one is NaN). */
static inline __m512 exp512_ps(__m512 x) {
    x = _mm512_min_ps(_mm512_set1_ps(89.f), _mm512_max_ps(_mm512_set1_ps(-104.f), x));
    __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                    _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
    __m512 p = _mm512_set1_ps(1.9875691500e-4f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
    __m512 y = _mm512_add_ps(_mm512_fmadd_ps(_mm512_mul_ps(p, r), r, r), _mm512_set1_ps(1.f));
    return _mm512_scalef_ps(y, n);
}
#endif

/* A quantized weight as the kernels see it: int8 (q int8 [N, K], s f32 [N]) or int4 (q uint8
 * [N, K/2], s and m f16 [N, K/g]). */
typedef struct {
    const void *q, *s, *m;
} coli_qw;

/* One MLA (DeepSeek) attention layer's constants for mla.c (colibri/kernels/native_mla.py's MlaLayer). */
typedef struct {
    int hidden, heads, q_lora, kv_lora, nope, rope, vdim; /* q_lora 0: one q_proj (DeepSeek-V2-Lite) */
    int scheme, group;            /* of the projections: 8 (int8) or 4 (int4, group size g) */
    coli_qw wq, wqb, wkva, wo;    /* wq: q_proj, or q_a_proj when q_lora; wqb: q_b_proj */
    const float *in_w, *post_w, *qa_w, *kva_w; /* RMSNorm weights, f32 */
    float in_eps, post_eps, lora_eps;
    int interleaved;              /* rope pairs (2i, 2i + 1), DeepSeek's layout; else (i, i + Dr/2) */
    float scale;
    coli_qw kvb;                  /* kv_b_proj [H * (Dn + Dv), R] (head h: Dn K rows, Dv V rows), ... */
    int kvb_scheme, kvb_group;    /* ... int8 (8) or int4 (4, groups of kvb_group) */
    const uint16_t *bqa, *bkva, *bo; /* bf16 biases or NULL: wq's, wkva's, wo's (attention_bias) */
    int gated;                    /* 1: each head's output times sigmoid(wg x) [H] before o_proj (Ling 3.0) */
    coli_qw wg;                   /* g_proj [H, hidden], read with wq and wkva */
    int qgate;                    /* 1 (A.X K2): wqb reads [norm(qa), qa] (2 q_lora) and gives each head its Dq query
                                   * rows, then Dv gate rows: the heads' output times sigmoid(gate) before o_proj */
    int gate_rank;                /* > 0 (A.X K2): the input norm, and the post norm where post_gd.q is set, gated:
                                   * y = norm(x), y sigmoid(W_up silu(W_down y)) */
    coli_qw in_gd, in_gu, post_gd, post_gu; /* those norms' W_down [rank, hidden] and W_up [hidden, rank] */
    int gd_scheme, gd_group, gu_scheme, gu_group; /* theirs (W_up's rank may be too narrow for int4 groups) */
} coli_mla_layer;

/* coli_attn_layer's qk_norm: where q and k are RMS-normed (colibri/layers/attention.py's QKNorm). */
enum {
    COLI_QK_NORM_NONE = 0,
    COLI_QK_NORM_FULL = 1,           /* over the whole projection, before the heads split (OLMoE) */
    COLI_QK_NORM_HEAD = 2,           /* each head, before the rotary (Qwen3) */
    COLI_QK_NORM_HEAD_POST_ROPE = 3, /* each head, after the rotary (Hunyuan; Llama 4's L2 norm: weights of ones) */
};

/* coli_attn_gate's kind: the heads' output gate before o_proj (colibri/layers/attention.py's OutGate). */
enum {
    COLI_GATE_NONE = 0,
    COLI_GATE_Q_SIGMOID = 1,        /* wq gives each head's query then its gate (2 D rows a head), times sigmoid(gate)
                                     * (Qwen3-Next; with its bias: Beam) */
    COLI_GATE_CHANNEL_SOFTPLUS = 2, /* the gate's w gives a gate a channel, times softplus(gate) (Laguna) */
    COLI_GATE_HEAD_SOFTPLUS = 3,    /* the gate's w gives a gate a head, times softplus(gate) (Laguna) */
};

/* An attention layer's variants, each a small struct of its own that coli_attn_layer reaches through a named
 * pointer, NULL where the layer has no such variant. Why named pointers and not a tagged list: the block reads
 * each variant once a call, by name, with no search and with the compiler checking its type; a NULL test is the
 * one branch a flag cost before, so the rows' loops are untouched; and a family's extra is built by the code that
 * knows it (colibri/kernels/native_block.py's structs, filled in the family's attention class). */

/* Values unlike the keys' heads. */
typedef struct {
    int dim;                      /* the values' head width (MiMo-V2-Flash: not head_dim) */
    float scale;                  /* != 0 and != 1: values times it before they are cached, one rounding (MiMo) */
    int k_eq_v;                   /* 1: no wv, the values are wk's output before any q/k norm (Gemma 4's full layers) */
    const float *norm_w;          /* non-NULL: each value head RMS-normed with these f32 weights [dim], eps qk_eps
                                   * (Gemma 4: ones) */
} coli_attn_values;

/* The heads' output gate before o_proj (colibri/layers/attention.py's OutGate). */
typedef struct {
    int kind;                     /* a COLI_GATE_*: sigmoid by coli_gate_mul, softplus by coli_softplus_gate_mul */
    coli_qw w;                    /* the softplus gates' projection [heads * head_dim or heads, hidden] (Laguna) */
    const uint16_t *bias;         /* COLI_GATE_Q_SIGMOID, non-NULL: bf16 [heads * head_dim] added to the gate before
                                   * its sigmoid, as a bias add (Beam's gate_bias, one a head, repeated) */
} coli_attn_gate;

/* What a query's position changes besides its rotary. */
typedef struct {
    int chunk;                    /* > 0: chunked attention (Llama 4): a query sees its own chunk's keys */
    const float *temp;            /* non-NULL: q *= temp[floor((pos + 1) / temp_floor)] (the attention temperature of
                                   * Llama 4's and Beam's NoPE layers), temp_n entries */
    long temp_n;
    float temp_floor;
} coli_attn_positions;

/* The layer's own rotary tables, f32 [rows, rot] (MiMo-V2-Flash's two layer types), in coli_decode_layers instead
 * of the call's (row p position p's). */
typedef struct {
    const float *cos, *sin;
    long rows;
} coli_attn_rotary;

/* What the block hands on besides h + o_proj's output. */
typedef struct {
    const float *norm_w;          /* non-NULL: an RMSNorm (f32 weights, norm_eps) of o_proj's output before the
                                   * residual add (AFMoE's norms after each sublayer) */
    float norm_eps;
    int parallel;                 /* 1: x_out is the input norm's output, no post norm (Cohere's parallel block: its
                                   * MLP reads the attention's input) */
} coli_attn_output;

/* One call's kept key blocks (MiniMax-M3's sparse layers, the indexer's selection). */
typedef struct {
    const uint8_t *blocks;        /* each row's [T][kv_heads][nb], of blk positions a block */
    int blk, nb;
} coli_attn_keep;

/* One attention layer's constants for block.c (built once by colibri/kernels/native_block.py's AttnLayer): the
 * core every standard layer has, then its variants (above). */
typedef struct {
    int hidden, heads, kv_heads, head_dim;
    int scheme, group;            /* of all four projections: 8 (int8) or 4 (int4, group size g) */
    coli_qw wq, wk, wv, wo;
    const float *in_w, *post_w;   /* input / post-attention RMSNorm weights, f32; NULL: no such norm (FlexOlmo) */
    float in_eps, post_eps;
    const float *in_b, *post_b;   /* non-NULL: the input / post-attention norms are LayerNorms with these
                                   * biases, f32 (Phi-3.5-MoE), else RMSNorms */
    int qk_norm;                  /* a COLI_QK_NORM_* */
    const float *qn_w, *kn_w;
    float qk_eps;
    float clip;                   /* > 0: clamp q, k, v to [-clip, clip] */
    int rot, window;              /* rotary channels per head; sliding window (0: none) */
    float scale;
    const float *sinks;           /* [heads] f32 or NULL */
    const uint16_t *bq, *bk, *bv, *bo; /* bf16 projection biases or NULL (Qwen2-MoE, GLM: q/k/v; gpt-oss all) */
    const coli_mla_layer *mla;    /* non-NULL: an MLA layer (mla.c), whose block runs instead; of the fields
                                   * above only hidden and rot (the rope width) count, and a row's K cache
                                   * pointer is its latent cache */
    const coli_attn_values *values;
    const coli_attn_gate *gate;
    const coli_attn_positions *positions;
    const coli_attn_rotary *rotary;
    const coli_attn_output *output;
    const coli_attn_keep *keep;   /* (set for one call) */
} coli_attn_layer;

/* x[i] = x[i] * sigmoid(g[i]) over n bf16 values, each factor rounded to bf16 (torch's bf16 sigmoid, then the
 * bf16 product). */
void coli_gate_mul(uint16_t *x, const uint16_t *g, long n);
/* x [T, heads * D] times softplus(g) (torch's: g past 20 stays g), g bf16 [T, heads] (per_head) or like x, each
 * factor rounded to bf16 (the torch layer's f32 softplus cast to bf16, then the bf16 product). */
void coli_softplus_gate_mul(uint16_t *x, const uint16_t *g, long T, int heads, int D, int per_head);

/* A dense SwiGLU MLP with separate projections: a dense layer, or a MoE layer's shared expert, optionally
 * behind Qwen2-MoE's sigmoid gate (moe.c coli_mlp_rows). */
typedef struct {
    int inter, scheme, group, gated;
    coli_qw gate, up, down, sgate; /* [I, H], [I, H], [H, I]; sgate [1, H] when gated; no gate for ACT_RELU2 */
    int act;                       /* ACT_SILU, ACT_GELU_TANH (Gemma 4's dense MLP), ACT_RELU2 (Nemotron-H's),
                                    * ACT_CLAMPED (MiniMax-M3's: gpt-oss's SwiGLU with these) */
    float alpha, limit;
} coli_mlp;

/* Entry points the kernel files call in one another (gemv.c, attn.c, block.c, moe.c). */
int coli_multi_gemm(const void *x, int bf16, int T, int K, int scheme, int g, int n, const coli_qw *w, const int *N,
                    void *const *y);
int coli_attn_rows(int T, const void *q, int bf16, int H, int Hkv, int D, int Dv, const void *const *k, long ks,
                   const void *const *v, long vs, const int *S, float scale, const float *sinks, void *out, int kvt);
int coli_attn_rows_keep(int T, const void *q, int H, int Hkv, int D, int Dv, const void *const *k, long ks,
                        const void *const *v, long vs, const int *S, float scale, const uint8_t *keep, int blk, int nb,
                        void *out);
/* MiniMax-M3's kept key blocks (msa.c) */
int coli_msa_select(int T, const float *iq, int Hi, int Di, const void *const *ik, const int *S, int blk, int topk,
                    int local, int nb, uint8_t *keep);
int coli_mla_attn(int T, const void *q, int H, int W, int R, const void *const *kv, const int *S, float scale,
                  void *out);
int coli_rmsnorm(const void *x, int bf16, long R, int H, const float *w, float eps, void *out);
int coli_layernorm(const void *x, int bf16, long R, int H, const float *w, const float *b, float eps, void *out);
int coli_block_norm(const void *x, long R, int H, const float *w, const float *b, float eps, void *out);
int coli_route(const void *x, int bf16, int T, int H, const float *W, int E, int k, int norm, int kind,
               int n_group, int topk_group, const float *bias, float scale, int64_t *idx, float *w);
int coli_rope(const void *x, int bf16, int T, int nh, int D, int rot, const float *cs, const float *sn, void *out);
int coli_attn_block(const coli_attn_layer *L, int T, const void *h, const int *pos, void *const *kc,
                    void *const *vc, long ks, long vs, int kvt, const float *cs, const float *sn, void *h_out,
                    void *x_out);
int coli_mla_block(const coli_mla_layer *L, int T, const void *h, const int *pos, void *const *cache,
                   const float *cs, const float *sn, void *h_out, void *x_out);
int coli_mla_block_sel(const coli_mla_layer *L, int T, const void *h, const int *pos, void *const *cache,
                       const float *cs, const float *sn, const int *const *sel, const int *nsel, void *h_out,
                       void *x_out);
enum { ROUTE_SOFTMAX, ROUTE_SIGMOID, ROUTE_SOFTMAX_BIAS, ROUTE_TOPK_SOFTMAX, ROUTE_SPARSEMIXER,
       ROUTE_LOGIT_BIAS_SIGMOID };  /* coli_route's rules (route.c) */
#define COLI_MISS (-7)  /* coli_moe_block: a routed expert is not in the layer's table (a cached layer) */
#define COLI_HOOK_FAILED (-8)  /* coli_decode_layers: a streamed layer's hook failed (the engine holds the error) */
/* A streamed layer's hook into the engine (step.c moe_streamed): `event` COLI_HOOK_ROUTED once the layer's rows are
 * routed (idx [n]: their experts; h [n / k, hidden] bf16: the residual the look-ahead predicts from; pred [np]: the
 * next routed layer's routes for those rows, predicted from h, np 0 where not predicted here) -> 0, or < 0 on failure;
 * COLI_HOOK_WAIT while some routed expert is not in the table yet -> 1 once another one landed in it, 0 when none is
 * left to land, < 0 on failure. */
enum { COLI_HOOK_ROUTED, COLI_HOOK_WAIT };
typedef int (*coli_layer_hook)(int layer, int event, const int64_t *idx, int n, const void *h, const int64_t *pred,
                               int np);

/* The routed experts' activation and biases (NULL: SiLU-GLU without biases). kind ACT_CLAMPED: gpt-oss's
 * (up + 1) * gate * sigmoid(alpha * gate), gate clamped from above at limit, up to [-limit, limit]; ACT_GELU_TANH:
 * gelu(gate) * up with GELU's tanh approximation (Gemma 4); ACT_RELU2: no gate, relu(up)^2 (Nemotron-H: gate_up holds
 * the I up rows alone). The bias tables hold per expert a bf16 [2I] (gate_up; [I] ungated) / [H] (down) pointer, or
 * NULL. */
enum { ACT_SILU, ACT_CLAMPED, ACT_GELU_TANH, ACT_RELU2 };
typedef struct {
    int kind;
    float alpha, limit;
    const uint16_t *const *gu_bias, *const *dn_bias;
    int input_scaled;  /* coli_moe_block (k == 1): the score scales the expert's input, the outputs summed
                        * unweighted (Llama 4); coli_moe takes the rows scaled already and ignores it */
} coli_expert_act;
int coli_zero_moe(const void *x, int T, int H, int I, const float *W, int E, int Z, int k, int norm, int kind,
                  const float *bias, float scale, const coli_qw *gate_up, const coli_qw *down, int scheme, int g,
                  int64_t *idx, float *w, float *ys, void *y);
int coli_moe_block(const void *x, const void *h, int T, int H, int I, const float *W, int E, int k, int norm,
                   int kind, int n_group, int topk_group, const float *bias, float scale, const coli_qw *gate_up, const coli_qw *down, int scheme,
                   int g, int64_t *idx, float *w, float *ys, void *h_out, const coli_mlp *shared,
                   const coli_expert_act *act, const float *out_w, float out_eps);
int coli_moe_routed(const void *x, const void *h, int T, int H, int I, int E, int k, const coli_qw *gate_up,
                    const coli_qw *down, int scheme, int g, const int64_t *idx, const float *w, float *ys,
                    void *h_out, const coli_mlp *shared, const coli_expert_act *act, const float *out_w,
                    float out_eps);
int coli_mlp_rows(const coli_mlp *m, const void *x, int T, int H, void *y);
/* sample.c: one token from a logits row (temperature > 0), u in [0, 1); -1 a row it cannot sample. */
long coli_sample(const float *x, long V, float temperature, int top_k, float top_p, float min_p, double u);
/* logprobs.c: a token's log-probability and the n_top (<= COLI_LP_MAX, OpenAI's limit) most likely tokens'. */
#define COLI_LP_MAX 20
int coli_logprobs(const float *x, long V, long tok, int n_top, float *lp, int64_t *ids, float *vals);
/* procs.c: a row's logit processors in coli_decode_run (kernels/native.py Procs). hist and gen_ids /
 * gen_counts have room for the run's tokens too. */
typedef struct {
    const int64_t *bias_ids;
    const float *bias;
    int n_bias;
    float repeat_penalty;
    int window;            /* the repetition penalty's last tokens (< 0: all) */
    int64_t *hist;         /* the row's tokens so far (the last `window` of them at least) */
    int n_hist;
    float presence, frequency;
    int64_t *gen_ids;      /* the distinct tokens generated so far ... */
    int *gen_counts;       /* ... and how often each */
    int n_gen;
} coli_procs;
int coli_procs_apply(const coli_procs *p, float *row, long V, int *mark, int stamp);
void coli_procs_took(coli_procs *p, int64_t tok);

/* Stage timers inside a decode step, for benchmarks/profile_decode.py --stages: compiled in only with
 * -DCOLI_PROF (COLIBRI_NATIVE_CFLAGS); PROF(stage, statement) is the statement alone otherwise. The
 * stage order is native.py's PROF_STAGES. */
enum { P_RMS_IN, P_QKV, P_ROPE_KV, P_ATTN, P_O, P_RMS_POST, P_ROUTE, P_GATHER, P_GATE_UP, P_SILU, P_DOWN,
       P_COMBINE, P_TAIL, P_STEPS, P_N };
#ifdef COLI_PROF
#include <time.h>
extern long coli_prof[P_N];
static inline long coli_prof_now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec * 1000000000L + ts.tv_nsec;
}
#define PROF(i, ...) do { long _pt = coli_prof_now(); __VA_ARGS__; coli_prof[i] += coli_prof_now() - _pt; } while (0)
#define PROF_COUNT(i) (coli_prof[i]++)
#else
#define PROF(i, ...) __VA_ARGS__
#define PROF_COUNT(i) ((void)0)
#endif

#define MAX_T 64          /* rows per call (decode batches); larger inputs go to a dense GEMM */
#define PAR_MIN_BYTES (256 * 1024) /* below this, one thread: a fork/join costs more than it saves */

/* 64-byte aligned scratch (free() it): the prepared activation rows are read 64 bytes at a time, and
 * a load that straddles two cache lines costs two. */
/* max_i x[i] over a logits row, or NAN when it has a NaN (the sampler's and the log-probs' first pass). */
static inline float row_max_nan(const float *x, long V) {
    float m = -INFINITY;
    long i = 0;
#ifdef COLI_AVX512
    __m512 vm = _mm512_set1_ps(-INFINITY);
    for (; i + 16 <= V; i += 16) {
        __m512 v = _mm512_loadu_ps(x + i);
        if (_mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q)) return NAN;
        vm = _mm512_max_ps(vm, v);
    }
    m = _mm512_reduce_max_ps(vm);
#endif
    for (; i < V; i++) {
        if (x[i] != x[i]) return NAN;
        if (x[i] > m) m = x[i];
    }
    return m;
}

static inline void *coli_alloc(size_t bytes) {
    void *p = NULL;
    return posix_memalign(&p, 64, (bytes + 63) / 64 * 64) == 0 ? p : NULL;
}

static inline float bf16_to_f32(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static inline uint16_t f32_to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40); /* NaN stays NaN */
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

#ifdef COLI_AVX512
/* f32_to_bf16 for 16 values, bit for bit (round to nearest even, a NaN stays NaN, subnormals kept). */
static inline __m256i f32_to_bf16_16(__m512 v) {
    __m512i u = _mm512_castps_si512(v);
    __m512i r = _mm512_add_epi32(u, _mm512_add_epi32(_mm512_set1_epi32(0x7fff),
                                                     _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1))));
    __mmask16 nan = _mm512_cmpgt_epu32_mask(_mm512_and_si512(u, _mm512_set1_epi32(0x7fffffff)),
                                            _mm512_set1_epi32(0x7f800000));
    r = _mm512_mask_mov_epi32(r, nan, _mm512_or_si512(u, _mm512_set1_epi32(0x400000)));
    return _mm512_cvtepi32_epi16(_mm512_srli_epi32(r, 16));
}

static inline __m512 bf16_16_to_f32(const uint16_t *p) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16));
}

/* The sum of v's lanes in a fixed tree: per 128 bits (v0 + v2) + (v1 + v3), then (L0 + L1) + (L2 + L3)
 * over the four 128-bit parts -- hsum16's order. */
static inline float hsum1(__m512 v) {
    __m512 t = _mm512_add_ps(v, _mm512_permute_ps(v, 0x4E));
    t = _mm512_add_ps(t, _mm512_permute_ps(t, 0xB1));
    t = _mm512_add_ps(t, _mm512_shuffle_f32x4(t, t, 0xB1));
    t = _mm512_add_ps(t, _mm512_shuffle_f32x4(t, t, 0x4E));
    return _mm512_cvtss_f32(t);
}

/* Lane i of the result = the sum of r[i]'s 16 lanes (a transpose-and-add tree: ~3 ops a vector where
 * one reduction each costs ~8), added in hsum1's order: a kernel may reduce 16 rows together or one
 * alone with the same bits. */
static inline __m512 hsum16(const __m512 *r) {
    __m512 c[8], e[4], h[2];
    for (int i = 0; i < 8; i++)  /* per 128 bits: [a0+a2, b0+b2, a1+a3, b1+b3] of r[2i], r[2i+1] */
        c[i] = _mm512_add_ps(_mm512_unpacklo_ps(r[2 * i], r[2 * i + 1]), _mm512_unpackhi_ps(r[2 * i], r[2 * i + 1]));
    for (int i = 0; i < 4; i++)  /* per 128 bits: the partial sums of r[4i..4i+3] */
        e[i] = _mm512_add_ps(_mm512_shuffle_ps(c[2 * i], c[2 * i + 1], 0x44), _mm512_shuffle_ps(c[2 * i], c[2 * i + 1], 0xEE));
    for (int i = 0; i < 2; i++)  /* [r 8i..8i+3 | r 8i..8i+3 | r 8i+4.. | r 8i+4..], two halves each */
        h[i] = _mm512_add_ps(_mm512_shuffle_f32x4(e[2 * i], e[2 * i + 1], 0x88),
                             _mm512_shuffle_f32x4(e[2 * i], e[2 * i + 1], 0xDD));
    return _mm512_add_ps(_mm512_shuffle_f32x4(h[0], h[1], 0x88), _mm512_shuffle_f32x4(h[0], h[1], 0xDD));
}
#endif

/* out[i] = bf16(a[i] + b[i]) over n bf16 values: a residual add. */
static inline void add_bf16(const uint16_t *a, const uint16_t *b, long n, uint16_t *out) {
    long i = 0;
#ifdef COLI_AVX512
    for (; i + 16 <= n; i += 16)
        _mm256_storeu_si256((__m256i *)(out + i), f32_to_bf16_16(_mm512_add_ps(bf16_16_to_f32(a + i), bf16_16_to_f32(b + i))));
#endif
    for (; i < n; i++) out[i] = f32_to_bf16(bf16_to_f32(a[i]) + bf16_to_f32(b[i]));
}

/* Each of T rows of x [T, n] bf16 += b [n] bf16 (none when b is NULL), in place: a projection's bias, added
 * as QLinear's own `y + bias` (block.c, mla.c). */
static inline void add_rows(uint16_t *x, const uint16_t *b, int T, long n) {
    if (b)
        for (int t = 0; t < T; t++) add_bf16(x + t * n, b, n, x + t * n);
}

static inline float f16_to_f32(uint16_t h) {
#if defined(__F16C__)
    return _cvtsh_ss(h);
#else
    uint32_t s = (uint32_t)(h & 0x8000) << 16, e = (h >> 10) & 0x1f, m = h & 0x3ff, u;
    if (e == 0) {
        if (m == 0) { u = s; }
        else { e = 127 - 14; while (!(m & 0x400)) { m <<= 1; e--; } m &= 0x3ff; u = s | (e << 23) | (m << 13); }
    } else if (e == 31) { u = s | 0x7f800000u | (m << 13); }
    else { u = s | ((e + 112) << 23) | (m << 13); }
    float f;
    memcpy(&f, &u, 4);
    return f;
#endif
}

/* f32 -> IEEE f16, rounded to nearest even (subnormals kept, past 65504 inf, a NaN stays NaN): F16C's conversion,
 * and the same bits without it. */
static inline uint16_t f32_to_f16(float f) {
#if defined(__F16C__)
    return (uint16_t)_cvtss_sh(f, _MM_FROUND_TO_NEAREST_INT);
#else
    uint32_t u, s, a;
    memcpy(&u, &f, 4);
    s = (u >> 16) & 0x8000u, a = u & 0x7fffffffu;
    if (a > 0x7f800000u) return (uint16_t)(s | 0x7e00u | ((a >> 13) & 0x3ffu));
    if (a >= 0x477ff000u) return (uint16_t)(s | 0x7c00u);  /* 65520 and up round to inf */
    if (a >= 0x38800000u) {  /* a normal f16: rebias the exponent, round the 13 bits dropped */
        a -= 0x38000000u;
        return (uint16_t)(s | ((a + 0xfffu + ((a >> 13) & 1u)) >> 13));
    }
    float m;  /* a subnormal one: units of 2^-24, the scaling exact */
    memcpy(&m, &a, 4);
    return (uint16_t)(s | (uint32_t)rintf(m * 16777216.f));
#endif
}

/* A KV cache's row types (kernels/kvq.c): the compute dtype (bf16, or f32 on f32 paths), or blocks of 32 values
 * with an f16 scale each: row = nb f16 scales, then int8 values (q8_0) or 16 bytes of nibbles a block (q4_0: byte j
 * holds elements j and j + 16). A call's layout is kvt = k_type | v_type << 4. */
enum { COLI_KV_BF16 = 0, COLI_KV_Q8_0 = 1, COLI_KV_Q4_0 = 2 };
static inline long coli_kv_row_bytes(int type, int D, int es) {
    return type == COLI_KV_Q8_0 ? 2L * (D / 32) + D : type == COLI_KV_Q4_0 ? 2L * (D / 32) + D / 2 : (long)D * es;
}
/* Whether kvt names types these heads can take (a quantized row needs whole blocks). */
static inline int coli_kv_ok(int kvt, int D, int Dv) {
    int kt = kvt & 15, vt = kvt >> 4;
    return kt <= COLI_KV_Q4_0 && vt <= COLI_KV_Q4_0 && (!kt || D % 32 == 0) && (!vt || Dv % 32 == 0);
}
int coli_kv_quantize(const void *x, int bf16, long rows, int D, int type, uint8_t *out, long out_stride);

static inline void load_x(const void *x, int bf16, int T, int K, float *xf) {
    if (bf16) {
        const uint16_t *xb = (const uint16_t *)x;
        for (long i = 0; i < (long)T * K; i++) xf[i] = bf16_to_f32(xb[i]);
    } else {
        memcpy(xf, x, sizeof(float) * (size_t)T * K);
    }
}

static inline void store_y(const float *yf, int bf16, int T, int N, int o0, int o1, void *y) {
    for (int t = 0; t < T; t++)
        for (int o = o0; o < o1; o++) {
            if (bf16) ((uint16_t *)y)[(long)t * N + o] = f32_to_bf16(yf[(long)t * N + o]);
            else ((float *)y)[(long)t * N + o] = yf[(long)t * N + o];
        }
}

static inline int n_threads_for(long bytes) { return bytes >= PAR_MIN_BYTES ? coli_get_threads() : 1; }

static inline void split(long total, int id, int n, long *a, long *b) {
    *a = total * id / n;
    *b = total * (id + 1) / n;
}

/* One channel of a causal depthwise convolution taking its next input x: the K taps w over [the K-1 kept inputs st,
 * x], summed in f32 from tap 0 (the order the torch forms sum in), and st moved on to end with x. */
static inline float conv_step(uint16_t *st, const float *w, uint16_t x, int K) {
    float s = 0.f;
    for (int k = 0; k < K - 1; k++) s += bf16_to_f32(st[k]) * w[k];
    s += bf16_to_f32(x) * w[K - 1];
    for (int k = 0; k + 1 < K - 1; k++) st[k] = st[k + 1];
    if (K > 1) st[K - 2] = x;
    return s;
}

static inline float ld(const void *p, int bf16, long i) {
    return bf16 ? bf16_to_f32(((const uint16_t *)p)[i]) : ((const float *)p)[i];
}

#endif
