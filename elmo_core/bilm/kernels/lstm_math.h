/* The float arithmetic every C loop of the LSTM shares (lstm_gates.c, lstm_steps.c): the same exp, sigmoid and
 * tanh everywhere, so that a step gives the same numbers whichever loop runs it. */
#ifndef ELMO_LSTM_MATH_H
#define ELMO_LSTM_MATH_H

#include <stdint.h>
#include <string.h>

static inline float bf16_to_f32(uint16_t b) {
    uint32_t u = (uint32_t)b << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

/* Round to nearest even, as PyTorch's float -> bfloat16 conversion (inputs here are finite). */
static inline uint16_t f32_to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    u += 0x7FFFu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

/* e^x: x clamped to [-87, 87], reduced by a two-part ln 2, then a degree-6 polynomial (Cephes' expf). Written
 * without calls or branches so that the compiler vectorises the loops that use it. */
static inline float exp_f32(float x) {
    x = x < -87.0f ? -87.0f : (x > 87.0f ? 87.0f : x);
    float n = __builtin_floorf(x * 1.44269504088896341f + 0.5f);
    float r = x - n * 0.693359375f;
    r = r + n * 2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    int32_t bits = ((int32_t)n + 127) << 23;
    float scale;
    memcpy(&scale, &bits, 4);
    return p * scale;
}

static inline float sigmoid_f32(float x) { return 1.0f / (1.0f + exp_f32(-x)); }

static inline float tanh_f32(float x) {
    float e = exp_f32(-2.0f * __builtin_fabsf(x));
    float t = (1.0f - e) / (1.0f + e);
    return x < 0.0f ? -t : t;
}

#endif
