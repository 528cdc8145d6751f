/* An LSTM layer's steps in one C call: CPU inference, float32 (built with lstm_gates.c, called by step_loop.py).
 *
 * Why: from Python a step pays a dozen PyTorch calls besides its products, as much time again as its arithmetic
 * when few rows run (the long sentences' last steps). Here the steps run in one OpenMP region: each thread takes
 * the same panels of the weights at every step (its own cache keeps them where they fit), sums its products in
 * registers, and the threads meet at three barriers a step.
 *
 * Per step t, for the n_t rows still running (the rows are sorted longest first, so they are the first n_t), each
 * direction d:
 *     y = h W_hh^T,   z = y + bias + x_t,   c' = clip(sigmoid(z_f) c + sigmoid(z_i) tanh(z_g)),
 *     m = sigmoid(z_o) tanh(c'),   h' = clip(m W_hr^T)  (h' = clip(m) without a projection)
 * with lstm_gates.c's additions in its order and its exp; only the products sum in another order than oneDNN's, so
 * the numbers agree with the step in Python to a few 1e-7.
 */
#include "lstm_math.h"

#define PANEL 64 /* the weights come in panels of 64 columns, each (K, 64) contiguous: read in order, once */
#if defined(__AVX512F__)
#define LANES 16
#define ROW_BLOCK 4
#else
#define LANES 8 /* AVX2 and narrower: 16 vector registers, so two rows and half a panel at a time */
#define ROW_BLOCK 2
#endif
#define COLUMNS (4 * LANES)

typedef float vec __attribute__((vector_size(LANES * 4)));

static inline vec load(const float *p) {
    vec v;
    memcpy(&v, p, sizeof v);
    return v;
}

static inline void store(float *p, vec v) { memcpy(p, &v, sizeof v); }

/* y[i, 0:64] = a[i, :] @ panel for rows i < n: a (n, K) with row stride lda, panel (K, 64), y with row stride ldy.
 * Blocks of ROW_BLOCK rows x 4 vectors are summed in registers over all of K. */
static void product(const float *restrict a, int64_t lda, int64_t n, const float *restrict panel, int64_t k_dim,
                    float *restrict y, int64_t ldy) {
    for (int64_t j = 0; j < PANEL; j += COLUMNS) {
        int64_t i = 0;
        for (; i + ROW_BLOCK <= n; i += ROW_BLOCK) {
            vec acc[ROW_BLOCK][4] = {{0}};
            for (int64_t k = 0; k < k_dim; k++) {
                const float *wk = panel + k * PANEL + j;
                vec w0 = load(wk), w1 = load(wk + LANES), w2 = load(wk + 2 * LANES), w3 = load(wk + 3 * LANES);
                for (int r = 0; r < ROW_BLOCK; r++) {
                    float s = a[(i + r) * lda + k];
                    acc[r][0] += s * w0;
                    acc[r][1] += s * w1;
                    acc[r][2] += s * w2;
                    acc[r][3] += s * w3;
                }
            }
            for (int r = 0; r < ROW_BLOCK; r++)
                for (int v = 0; v < 4; v++) store(y + (i + r) * ldy + j + v * LANES, acc[r][v]);
        }
        for (; i < n; i++) {
            vec acc[4] = {0};
            for (int64_t k = 0; k < k_dim; k++) {
                const float *wk = panel + k * PANEL + j;
                float s = a[i * lda + k];
                acc[0] += s * load(wk);
                acc[1] += s * load(wk + LANES);
                acc[2] += s * load(wk + 2 * LANES);
                acc[3] += s * load(wk + 3 * LANES);
            }
            for (int v = 0; v < 4; v++) store(y + i * ldy + j + v * LANES, acc[v]);
        }
    }
}

/* Cells [j0, j1) of one row: lstm_gates.c's arithmetic, the cell state updated in place. */
static void gates(const float *restrict y, const float *restrict b, const float *restrict x, float *restrict c,
                  float *restrict m, int64_t hidden, int64_t j0, int64_t j1, float clip) {
    for (int64_t j = j0; j < j1; j++) {
        float zi = y[j] + b[j] + x[j];
        float zf = y[hidden + j] + b[hidden + j] + x[hidden + j];
        float zg = y[2 * hidden + j] + b[2 * hidden + j] + x[2 * hidden + j];
        float zo = y[3 * hidden + j] + b[3 * hidden + j] + x[3 * hidden + j];
        float cj = sigmoid_f32(zf) * c[j] + sigmoid_f32(zi) * tanh_f32(zg);
        cj = cj < -clip ? -clip : (cj > clip ? clip : cj);
        c[j] = cj;
        m[j] = sigmoid_f32(zo) * tanh_f32(cj);
    }
}

#define CELL_BLOCK 256

/* `steps` steps of both directions (2 x the same shapes, each direction's block after the other's). 4H and P padded
 * up to whole panels are G and Q (the padding columns of the panels are zeros).
 *   batch_sizes (steps,)  rows running at each step, non-increasing; rows = batch_sizes[0]
 *   x            input gates: with x_rows, a table whose row x_rows[d * rows_dir + q] goes with packed row q;
 *                else packed rows (N, 4H) per direction, x_dir floats apart
 *   bias         (2, 4H), zeros where the input gates hold it
 *   w_hh         (2, G / 64, P, 64): W_hh^T in panels;  w_hr (2, Q / 64, H, 64): W_hr^T in panels, or NULL (P = H)
 *   h, c         (2, rows, P), (2, rows, H): the state at the first step, the final state on return (a row that
 *                ends keeps its last state)
 *   out          (2, N, P): every step's h', packed as the input
 *   y, m, p      scratch (2, rows, G), (2, rows, H), (2, rows, Q)
 * cell_clip and proj_clip: INFINITY for none. Returns 0, or 1 for arguments it cannot run. */
int elmo_lstm_steps(int64_t steps, const int64_t *batch_sizes, int64_t proj, int64_t hidden, const float *x,
                   int64_t x_dir, const int64_t *x_rows, int64_t rows_dir, const float *bias, const float *w_hh,
                   const float *w_hr, float *h, float *c, float *out, int64_t n_packed, float *y, float *m, float *p,
                   float cell_clip, float proj_clip, int threads) {
    if (steps < 1 || batch_sizes[0] < 1 || (w_hr == NULL && proj != hidden)) return 1;
    const int64_t rows = batch_sizes[0], width = 4 * hidden;
    for (int64_t t = 1; t < steps; t++)
        if (batch_sizes[t] < 1 || batch_sizes[t] > batch_sizes[t - 1]) return 1;
    const int64_t gate_panels = (width + PANEL - 1) / PANEL, g_width = gate_panels * PANEL;
    const int64_t proj_panels = (proj + PANEL - 1) / PANEL, p_width = proj_panels * PANEL;
    const int64_t cell_blocks = (hidden + CELL_BLOCK - 1) / CELL_BLOCK;
#pragma omp parallel num_threads(threads) if (threads > 1)
    {
        int64_t first = 0; /* the packed row of this step's first row */
        for (int64_t t = 0; t < steps; t++) {
            const int64_t n = batch_sizes[t];
            /* 1. y = h W_hh^T: each thread the same panels at every step */
#pragma omp for schedule(static)
            for (int64_t item = 0; item < 2 * gate_panels; item++) {
                const int64_t d = item / gate_panels, panel = item % gate_panels;
                product(h + d * rows * proj, proj, n, w_hh + (d * gate_panels + panel) * proj * PANEL, proj,
                        y + d * rows * g_width + panel * PANEL, g_width);
            }
            /* 2. the gates, by blocks of cells */
#pragma omp for schedule(static)
            for (int64_t item = 0; item < 2 * n * cell_blocks; item++) {
                const int64_t d = item / (n * cell_blocks), i = (item / cell_blocks) % n;
                const int64_t j0 = (item % cell_blocks) * CELL_BLOCK;
                const int64_t j1 = j0 + CELL_BLOCK < hidden ? j0 + CELL_BLOCK : hidden;
                const int64_t q = first + i;
                const float *xi = x_rows ? x + x_rows[d * rows_dir + q] * width : x + d * x_dir + q * width;
                gates(y + (d * rows + i) * g_width, bias + d * width, xi, c + (d * rows + i) * hidden,
                      m + (d * rows + i) * hidden, hidden, j0, j1, cell_clip);
            }
            /* 3. h' = clip(m W_hr^T), into the state and the output */
#pragma omp for schedule(static)
            for (int64_t item = 0; item < 2 * proj_panels; item++) {
                const int64_t d = item / proj_panels, panel = item % proj_panels, j = panel * PANEL;
                const int64_t cols = proj - j < PANEL ? proj - j : PANEL;
                const float *from = m + d * rows * hidden + j; /* no projection: h' is m */
                int64_t stride = hidden;
                if (w_hr) {
                    product(m + d * rows * hidden, hidden, n, w_hr + (d * proj_panels + panel) * hidden * PANEL, hidden,
                            p + d * rows * p_width + j, p_width);
                    from = p + d * rows * p_width + j;
                    stride = p_width;
                }
                for (int64_t i = 0; i < n; i++) {
                    float *hi = h + (d * rows + i) * proj + j, *o = out + (d * n_packed + first + i) * proj + j;
                    for (int64_t k = 0; k < cols; k++) {
                        float v = from[i * stride + k];
                        v = v < -proj_clip ? -proj_clip : (v > proj_clip ? proj_clip : v);
                        hi[k] = v;
                        o[k] = v;
                    }
                }
            }
            first += n;
        }
    }
    return 0;
}
