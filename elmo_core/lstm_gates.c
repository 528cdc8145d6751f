/* The LSTM cell's gate arithmetic in one pass over memory, for CPU inference (built and loaded by fused_gates.py).
 *
 * Per row r and cell j, with z = y + add the pre-activations (gate order i, f, g, o as PyTorch stores them):
 *     c' = clip(sigmoid(z_f) c + sigmoid(z_i) tanh(s z_g)),   m = sigmoid(z_o) tanh(c')
 * where s undoes a scale folded into the g columns of the weights (the bf16 kernel scales them by 2).
 * PyTorch runs this as about ten separate passes over (rows, 4H) tensors (add, sigmoid, tanh, slices, products,
 * clamp, casts); here each element is read once. Everything is float32; y and m may be bfloat16 in memory.
 *
 * Accuracy: exp_f32 is within about 2 ulp of expf over the clamped range; against PyTorch's sigmoid/tanh the
 * results differ by at most a few 1e-7 (tested in tests/test_fused_gates.py).
 */
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

/* One direction's rows. add row r is add + add_rows[r] * 4H when add_rows is given (gathered input gates),
 * else add + r * add_stride (add_stride 0: one bias row for all). */
typedef struct {
    const void *y;            /* (rows, 4H) float32 or bfloat16 */
    const float *add;
    const int64_t *add_rows;  /* (rows,) or NULL */
    int64_t add_stride;
    const float *c_in;        /* (rows, H) */
    float *c_out;             /* (rows, H), not c_in */
    void *m_out;              /* (rows, H) float32 or bfloat16 */
} elmo_gate_rows;

/* One row, for y of type Y_TYPE and m of type M_TYPE: one function per pair of types, with restrict pointer
 * parameters, so that the compiler vectorises the loop over the row's cells. */
#define DEFINE_GATES(NAME, Y_TYPE, LOAD_Y, M_TYPE, STORE_M)                                                   \
    static void NAME(const Y_TYPE *restrict y, const float *restrict a, const float *restrict cin,           \
                     float *restrict cout, M_TYPE *restrict m, int64_t hidden, float g_scale, float clip) {   \
        for (int64_t j = 0; j < hidden; j++) {                                                               \
            float zi = LOAD_Y(y[j]) + a[j];                                                                  \
            float zf = LOAD_Y(y[hidden + j]) + a[hidden + j];                                                \
            float zg = (LOAD_Y(y[2 * hidden + j]) + a[2 * hidden + j]) * g_scale;                            \
            float zo = LOAD_Y(y[3 * hidden + j]) + a[3 * hidden + j];                                        \
            float c = sigmoid_f32(zf) * cin[j] + sigmoid_f32(zi) * tanh_f32(zg);                             \
            c = c < -clip ? -clip : (c > clip ? clip : c);                                                   \
            cout[j] = c;                                                                                     \
            m[j] = STORE_M(sigmoid_f32(zo) * tanh_f32(c));                                                   \
        }                                                                                                    \
    }

#define AS_IS(v) (v)
DEFINE_GATES(row_bf16_bf16, uint16_t, bf16_to_f32, uint16_t, f32_to_bf16)
DEFINE_GATES(row_bf16_f32, uint16_t, bf16_to_f32, float, AS_IS)
DEFINE_GATES(row_f32_bf16, float, AS_IS, uint16_t, f32_to_bf16)
DEFINE_GATES(row_f32_f32, float, AS_IS, float, AS_IS)

/* Every row of every direction (n_dirs <= 2) of one step, over up to `threads` OpenMP threads. Built against the
 * OpenMP runtime PyTorch has loaded, the threads are PyTorch's own: no second pool competing for the cores. */
int elmo_lstm_gates(const elmo_gate_rows *dirs, int n_dirs, int64_t rows, int64_t hidden, float g_scale, float clip,
                    int y_bf16, int m_bf16, int threads) {
    if (n_dirs < 1 || n_dirs > 2) return 1;
    const int64_t total = n_dirs * rows;
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1)
    for (int64_t k = 0; k < total; k++) {
        const elmo_gate_rows *d = &dirs[k / rows];
        const int64_t r = k % rows;
        const float *a = d->add + (d->add_rows ? d->add_rows[r] * 4 * hidden : r * d->add_stride);
        const float *cin = d->c_in + r * hidden;
        float *cout = d->c_out + r * hidden;
        if (y_bf16) {
            const uint16_t *y = (const uint16_t *)d->y + r * 4 * hidden;
            if (m_bf16) {
                row_bf16_bf16(y, a, cin, cout, (uint16_t *)d->m_out + r * hidden, hidden, g_scale, clip);
            } else {
                row_bf16_f32(y, a, cin, cout, (float *)d->m_out + r * hidden, hidden, g_scale, clip);
            }
        } else {
            const float *y = (const float *)d->y + r * 4 * hidden;
            if (m_bf16) {
                row_f32_bf16(y, a, cin, cout, (uint16_t *)d->m_out + r * hidden, hidden, g_scale, clip);
            } else {
                row_f32_f32(y, a, cin, cout, (float *)d->m_out + r * hidden, hidden, g_scale, clip);
            }
        }
    }
    return 0;
}
