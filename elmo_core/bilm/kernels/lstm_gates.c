/* The LSTM cell's gate arithmetic in one pass over memory, for CPU inference (built and loaded by fused_gates.py).
 *
 * Per row r and cell j, with z = y + bias + x the pre-activations (the step's products, the bias, the input gates;
 * gate order i, f, g, o as PyTorch stores them):
 *     c' = clip(sigmoid(z_f) c + sigmoid(z_i) tanh(s z_g)),   m = sigmoid(z_o) tanh(c')
 * where s undoes a scale folded into the g columns of the weights (the bf16 kernel scales them by 2).
 * PyTorch runs this as about ten separate passes over (rows, 4H) tensors (add, sigmoid, tanh, slices, products,
 * clamp, casts); here each element is read once. The arithmetic is float32; y, x and m may be bfloat16 in memory.
 *
 * Accuracy: against PyTorch's sigmoid/tanh arithmetic the results differ by at most a few 1e-7 (tested in
 * tests/test_fused_gates.py, and checked once per process by fused_gates._self_check).
 */
#include "lstm_math.h"

/* One direction's rows. The pre-activations of row r are y[r] + bias + x[xr] with xr = x_rows[r] when x_rows is
 * given (input gates gathered from a per-word table), else xr = r * x_stride (x_stride 1: a row each, 0: one row
 * for all). */
typedef struct {
    const void *y;            /* (rows, 4H) float32 or bfloat16: the step's products */
    const float *bias;        /* (4H,) */
    const void *x;            /* (R, 4H) float32 or bfloat16: input gates */
    const int64_t *x_rows;    /* (rows,) or NULL */
    int64_t x_stride;
    const float *c_in;        /* (rows, H) */
    float *c_out;             /* (rows, H), not c_in */
    void *m_out;              /* (rows, H) float32 or bfloat16 */
} elmo_gate_rows;

/* One row, for y, x and m of the given types: one function per combination, with restrict pointer parameters, so
 * that the compiler vectorises the loop over the row's cells. */
#define DEFINE_GATES(NAME, Y_TYPE, LOAD_Y, X_TYPE, LOAD_X, M_TYPE, STORE_M)                                   \
    static inline void NAME##_typed(const Y_TYPE *restrict y, const float *restrict b, const X_TYPE *restrict x, \
                                    const float *restrict cin, float *restrict cout, M_TYPE *restrict m,         \
                                    int64_t hidden, float g_scale, float clip) {                                 \
        for (int64_t j = 0; j < hidden; j++) {                                                               \
            float zi = LOAD_Y(y[j]) + b[j] + LOAD_X(x[j]);                                                   \
            float zf = LOAD_Y(y[hidden + j]) + b[hidden + j] + LOAD_X(x[hidden + j]);                        \
            float zg = (LOAD_Y(y[2 * hidden + j]) + b[2 * hidden + j] + LOAD_X(x[2 * hidden + j])) * g_scale; \
            float zo = LOAD_Y(y[3 * hidden + j]) + b[3 * hidden + j] + LOAD_X(x[3 * hidden + j]);            \
            float c = sigmoid_f32(zf) * cin[j] + sigmoid_f32(zi) * tanh_f32(zg);                             \
            c = c < -clip ? -clip : (c > clip ? clip : c);                                                   \
            cout[j] = c;                                                                                     \
            m[j] = STORE_M(sigmoid_f32(zo) * tanh_f32(c));                                                   \
        }                                                                                                    \
    }                                                                                                        \
    static void NAME(const void *y, const float *b, const void *x, const float *cin, float *cout, void *m,      \
                     int64_t hidden, float g_scale, float clip) {                                            \
        NAME##_typed(y, b, x, cin, cout, m, hidden, g_scale, clip);                                          \
    }

#define AS_IS(v) (v)
#define BF16 uint16_t
DEFINE_GATES(row_fff, float, AS_IS, float, AS_IS, float, AS_IS)
DEFINE_GATES(row_ffb, float, AS_IS, float, AS_IS, BF16, f32_to_bf16)
DEFINE_GATES(row_fbf, float, AS_IS, BF16, bf16_to_f32, float, AS_IS)
DEFINE_GATES(row_fbb, float, AS_IS, BF16, bf16_to_f32, BF16, f32_to_bf16)
DEFINE_GATES(row_bff, BF16, bf16_to_f32, float, AS_IS, float, AS_IS)
DEFINE_GATES(row_bfb, BF16, bf16_to_f32, float, AS_IS, BF16, f32_to_bf16)
DEFINE_GATES(row_bbf, BF16, bf16_to_f32, BF16, bf16_to_f32, float, AS_IS)
DEFINE_GATES(row_bbb, BF16, bf16_to_f32, BF16, bf16_to_f32, BF16, f32_to_bf16)

typedef void (*row_fn)(const void *, const float *, const void *, const float *, float *, void *, int64_t, float,
                       float);

/* Every row of every direction (n_dirs <= 2) of one step, over up to `threads` OpenMP threads. Built against the
 * OpenMP runtime PyTorch has loaded, the threads are PyTorch's own: no second pool competing for the cores.
 * y_bf16, x_bf16, m_bf16: whether y, x and m hold bfloat16 (else float32). */
int elmo_lstm_gates(const elmo_gate_rows *dirs, int n_dirs, int64_t rows, int64_t hidden, float g_scale, float clip,
                    int y_bf16, int x_bf16, int m_bf16, int threads) {
    static const row_fn rows_of[8] = {row_fff, row_ffb, row_fbf, row_fbb, row_bff, row_bfb, row_bbf, row_bbb};
    if (n_dirs < 1 || n_dirs > 2) return 1;
    const row_fn row = rows_of[(y_bf16 ? 4 : 0) + (x_bf16 ? 2 : 0) + (m_bf16 ? 1 : 0)];
    const int64_t y_size = y_bf16 ? 2 : 4, x_size = x_bf16 ? 2 : 4, m_size = m_bf16 ? 2 : 4;
    const int64_t total = n_dirs * rows;
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1)
    for (int64_t k = 0; k < total; k++) {
        const elmo_gate_rows *d = &dirs[k / rows];
        const int64_t r = k % rows;
        const int64_t xr = d->x_rows ? d->x_rows[r] : r * d->x_stride;
        row((const char *)d->y + r * 4 * hidden * y_size, d->bias, (const char *)d->x + xr * 4 * hidden * x_size,
            d->c_in + r * hidden, d->c_out + r * hidden, (char *)d->m_out + r * hidden * m_size, hidden, g_scale,
            clip);
    }
    return 0;
}

/* ----- training: the same gates, differentiable (trained_step.py wraps them in autograd Functions) -----
 *
 * Forward, per row and cell, from the pre-activations z (gate order i, f, g, o) and the cell state c:
 *     c_raw = sigmoid(z_f) c + sigmoid(z_i) tanh(z_g),   c' = clip(c_raw),   m = sigmoid(z_o) tanh(c')
 * and it keeps, for the backward, the four activated gates (rows, 4H) and c_raw (rows, H). Backward, from the
 * gradients of m and of c' (zeros where c' is not differentiated through, as a window's last cell state):
 *     dc_raw = (dc' + dm sigmoid(z_o) (1 - tanh(c')^2)) where |c_raw| <= clip, else 0   (as clamp's gradient)
 *     dz_i = dc_raw tanh(z_g) s_i (1 - s_i),   dz_f = dc_raw c s_f (1 - s_f),   dz_g = dc_raw s_i (1 - tanh(z_g)^2)
 *     dz_o = dm tanh(c') s_o (1 - s_o),        dc = dc_raw s_f
 * PyTorch's autograd runs this as about twenty operations per step, forward and backward; here it is one pass each.
 * z and dz may be bfloat16 (the step's product under autocast), m and dm too (the projection's input); the
 * arithmetic and the cell state are float32, as in the reference. */
#define DEFINE_TRAIN_GATES(NAME, Z_TYPE, LOAD_Z, STORE_Z, M_TYPE, LOAD_M, STORE_M)                                 \
    static void NAME##_forward(const void *z_, const float *restrict cin, float *restrict cout, void *m_,       \
                               float *restrict act, float *restrict craw, int64_t hidden, float clip) {          \
        const Z_TYPE *restrict z = z_;                                                                           \
        M_TYPE *restrict m = m_;                                                                                 \
        for (int64_t j = 0; j < hidden; j++) {                                                                   \
            float i = sigmoid_f32(LOAD_Z(z[j])), f = sigmoid_f32(LOAD_Z(z[hidden + j]));                          \
            float g = tanh_f32(LOAD_Z(z[2 * hidden + j])), o = sigmoid_f32(LOAD_Z(z[3 * hidden + j]));            \
            act[j] = i;                                                                                          \
            act[hidden + j] = f;                                                                                 \
            act[2 * hidden + j] = g;                                                                             \
            act[3 * hidden + j] = o;                                                                             \
            float c = f * cin[j] + i * g;                                                                        \
            craw[j] = c;                                                                                         \
            c = c < -clip ? -clip : (c > clip ? clip : c);                                                       \
            cout[j] = c;                                                                                         \
            m[j] = STORE_M(o * tanh_f32(c));                                                                     \
        }                                                                                                        \
    }                                                                                                            \
    static void NAME##_backward(const float *restrict act, const float *restrict cin, const float *restrict craw, \
                                const float *restrict cout, const void *dm_, const float *restrict dcout,        \
                                void *dz_, float *restrict dcin, int64_t hidden, float clip) {                   \
        const M_TYPE *restrict dm = dm_;                                                                         \
        Z_TYPE *restrict dz = dz_;                                                                               \
        for (int64_t j = 0; j < hidden; j++) {                                                                   \
            float i = act[j], f = act[hidden + j], g = act[2 * hidden + j], o = act[3 * hidden + j];             \
            float tc = tanh_f32(cout[j]), dmj = LOAD_M(dm[j]);                                                    \
            float dc = dcout[j] + dmj * o * (1.0f - tc * tc);                                   \
            dc = (craw[j] >= -clip && craw[j] <= clip) ? dc : 0.0f;                                              \
            dcin[j] = dc * f;                                                                                    \
            dz[j] = STORE_Z(dc * g * (i * (1.0f - i)));                                                          \
            dz[hidden + j] = STORE_Z(dc * cin[j] * (f * (1.0f - f)));                                            \
            dz[2 * hidden + j] = STORE_Z(dc * i * (1.0f - g * g));                                               \
            dz[3 * hidden + j] = STORE_Z(dmj * tc * (o * (1.0f - o)));                                           \
        }                                                                                                        \
    }

DEFINE_TRAIN_GATES(train_ff, float, AS_IS, AS_IS, float, AS_IS, AS_IS)
DEFINE_TRAIN_GATES(train_fb, float, AS_IS, AS_IS, BF16, bf16_to_f32, f32_to_bf16)
DEFINE_TRAIN_GATES(train_bf, BF16, bf16_to_f32, f32_to_bf16, float, AS_IS, AS_IS)
DEFINE_TRAIN_GATES(train_bb, BF16, bf16_to_f32, f32_to_bf16, BF16, bf16_to_f32, f32_to_bf16)

typedef void (*train_forward_fn)(const void *, const float *, float *, void *, float *, float *, int64_t, float);
typedef void (*train_backward_fn)(const float *, const float *, const float *, const float *, const void *,
                                  const float *, void *, float *, int64_t, float);

/* All `rows` rows (both directions stacked: every tensor dense, row-major). z_bf16, m_bf16: whether z/dz and m/dm
 * hold bfloat16. */
int elmo_train_gates_forward(const void *z, const float *cin, float *cout, void *m, float *act, float *craw,
                             int64_t rows, int64_t hidden, float clip, int z_bf16, int m_bf16, int threads) {
    static const train_forward_fn of[4] = {train_ff_forward, train_fb_forward, train_bf_forward, train_bb_forward};
    const train_forward_fn run = of[(z_bf16 ? 2 : 0) + (m_bf16 ? 1 : 0)];
    const int64_t z_size = z_bf16 ? 2 : 4, m_size = m_bf16 ? 2 : 4;
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1)
    for (int64_t r = 0; r < rows; r++)
        run((const char *)z + r * 4 * hidden * z_size, cin + r * hidden, cout + r * hidden,
            (char *)m + r * hidden * m_size, act + r * 4 * hidden, craw + r * hidden, hidden, clip);
    return 0;
}

int elmo_train_gates_backward(const float *act, const float *cin, const float *craw, const float *cout,
                              const void *dm, const float *dcout, void *dz, float *dcin, int64_t rows, int64_t hidden,
                              float clip, int z_bf16, int m_bf16, int threads) {
    static const train_backward_fn of[4] = {train_ff_backward, train_fb_backward, train_bf_backward,
                                            train_bb_backward};
    const train_backward_fn run = of[(z_bf16 ? 2 : 0) + (m_bf16 ? 1 : 0)];
    const int64_t z_size = z_bf16 ? 2 : 4, m_size = m_bf16 ? 2 : 4;
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1)
    for (int64_t r = 0; r < rows; r++)
        run(act + r * 4 * hidden, cin + r * hidden, craw + r * hidden, cout + r * hidden,
            (const char *)dm + r * hidden * m_size, dcout + r * hidden, (char *)dz + r * 4 * hidden * z_size,
            dcin + r * hidden, hidden, clip);
    return 0;
}

/* The projection clip's gradient: dp = dh where |p| <= clip (the boundary included, as clamp's), else 0; p, dh and
 * dp hold `n` values, bfloat16 when `bf16`, else float32. */
int elmo_clip_backward(const void *p, const void *dh, void *dp, int64_t n, float clip, int bf16) {
    if (bf16) {
        const uint16_t *restrict pb = p, *restrict db = dh;
        uint16_t *restrict out = dp;
        for (int64_t k = 0; k < n; k++) {
            float x = bf16_to_f32(pb[k]);
            out[k] = (x >= -clip && x <= clip) ? db[k] : 0;
        }
    } else {
        const float *restrict pf = p, *restrict df = dh;
        float *restrict out = dp;
        for (int64_t k = 0; k < n; k++) out[k] = (pf[k] >= -clip && pf[k] <= clip) ? df[k] : 0.0f;
    }
    return 0;
}
