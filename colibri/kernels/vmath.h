/* Float functions written so that loops over them vectorize (GCC does not vectorize libm's expf / log1pf calls
 * without -ffast-math): kernels/mamba1.c's per-channel exp, softplus and silu, each in a loop of its own (a scalar
 * call costs more than libm's; kernels/mamba.c measured no faster with them). Each within a few ulp of libm's. */
#ifndef COLI_VMATH_H
#define COLI_VMATH_H

/* exp(x) for x <= 0 (the state's decay: dt >= 0, A < 0) within ~2 ulp, in plain float arithmetic so that loops of
 * it vectorize: x = k ln2 + r, |r| <= ln2 / 2, exp(r) by its Taylor polynomial to r^7, times 2^k by the exponent
 * bits (x clamped at -87: exp(-87) for anything below, a normal float). */
static inline float exp_neg(float x) {
    if (x < -87.f) x = -87.f;
    float k = __builtin_rintf(x * 1.44269504f);
    float r = x - k * 0.693359375f + k * 2.12194440e-4f;  /* ln2 in two parts: r exact to a few ulp */
    float p = 1.f / 5040.f;
    p = p * r + 1.f / 720.f;
    p = p * r + 1.f / 120.f;
    p = p * r + 1.f / 24.f;
    p = p * r + 1.f / 6.f;
    p = p * r + 0.5f;
    p = p * r + 1.f;
    p = p * r + 1.f;
    union { int32_t i; float f; } s = {.i = ((int32_t)k + 127) << 23};
    return p * s.f;
}

/* log(1 + y) for y in [0, 1], vectorizable: 2 atanh(s) with s = y / (2 + y) <= 1/3, its odd series to s^15. */
static inline float log1p_unit(float y) {
    float s = y / (2.f + y), s2 = s * s;
    float p = 1.f / 15.f;
    p = p * s2 + 1.f / 13.f;
    p = p * s2 + 1.f / 11.f;
    p = p * s2 + 1.f / 9.f;
    p = p * s2 + 1.f / 7.f;
    p = p * s2 + 1.f / 5.f;
    p = p * s2 + 1.f / 3.f;
    p = p * s2 + 1.f;
    return 2.f * s * p;
}

/* softplus (torch's: x past 20 is x) and silu from exp_neg, so that loops over channels vectorize. */
static inline float softplus_v(float x) {
    float e = exp_neg(x > 0.f ? -x : x);
    return x > 20.f ? x : (x > 0.f ? x : 0.f) + log1p_unit(e);
}

static inline float silu_v(float x) {
    float e = exp_neg(x > 0.f ? -x : x);  /* exp(-|x|): sigmoid(x) = 1 / (1 + e) for x >= 0, e / (1 + e) below */
    return x * (x >= 0.f ? 1.f : e) / (1.f + e);
}

#endif
