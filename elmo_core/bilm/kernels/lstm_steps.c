/* An LSTM layer's steps in one C call: CPU inference, float32 (built with lstm_gates.c, called by step_loop.py).
 *
 * Why: from Python a step pays a dozen PyTorch calls besides its products, as much time again as its arithmetic
 * when few rows run (the long sentences' last steps). Here the steps run in one OpenMP region. With two threads each
 * runs one direction's steps alone (the directions share nothing); with more, each thread takes the same panels of
 * the weights at every step (its own cache keeps them where they fit) and the team meets at three barriers a step.
 * Either way the products are summed in registers.
 *
 * Per step t, for the n_t rows still running (the rows are sorted longest first, so they are the first n_t), each
 * direction d:
 *     y = h W_hh^T,   z = y + bias + x_t,   c' = clip(sigmoid(z_f) c + sigmoid(z_i) tanh(z_g)),
 *     m = sigmoid(z_o) tanh(c'),   h' = clip(m W_hr^T)  (h' = clip(m) without a projection)
 * with lstm_gates.c's additions in its order and its exp; only the products sum in another order than oneDNN's, so
 * the numbers agree with the step in Python to a few 1e-7.
 */
#include "lstm_math.h"
#ifdef _OPENMP
#include <omp.h>
#endif

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

/* The shapes and pointers of one call, shared by whatever runs its parts. */
typedef struct {
    int64_t steps, proj, hidden, width, rows, n_packed, x_dir, rows_dir, gate_panels, g_width, proj_panels, p_width,
        cell_blocks;
    const int64_t *batch_sizes, *x_rows;
    const float *x, *bias, *w_hh, *w_hr;
    float *h, *c, *out, *y, *m, *p;
    float cell_clip, proj_clip;
} Steps;

/* Part 1 of a step, one panel of one direction: y = h W_hh^T. */
static void gate_panel(const Steps *s, int64_t d, int64_t panel, int64_t n) {
    product(s->h + d * s->rows * s->proj, s->proj, n, s->w_hh + (d * s->gate_panels + panel) * s->proj * PANEL,
            s->proj, s->y + d * s->rows * s->g_width + panel * PANEL, s->g_width);
}

/* Part 2, one block of cells of one row: the gates. */
static void cell_block(const Steps *s, int64_t d, int64_t i, int64_t block, int64_t first) {
    const int64_t j0 = block * CELL_BLOCK, j1 = j0 + CELL_BLOCK < s->hidden ? j0 + CELL_BLOCK : s->hidden;
    const int64_t q = first + i, width = s->width;
    const float *xi = s->x_rows ? s->x + s->x_rows[d * s->rows_dir + q] * width : s->x + d * s->x_dir + q * width;
    gates(s->y + (d * s->rows + i) * s->g_width, s->bias + d * width, xi, s->c + (d * s->rows + i) * s->hidden,
          s->m + (d * s->rows + i) * s->hidden, s->hidden, j0, j1, s->cell_clip);
}

/* Part 3, one panel of one direction: h' = clip(m W_hr^T), into the state and the output. */
static void proj_panel(const Steps *s, int64_t d, int64_t panel, int64_t n, int64_t first) {
    const int64_t j = panel * PANEL, proj = s->proj, hidden = s->hidden;
    const int64_t cols = proj - j < PANEL ? proj - j : PANEL;
    const float *from = s->m + d * s->rows * hidden + j; /* no projection: h' is m */
    int64_t stride = hidden;
    if (s->w_hr) {
        product(s->m + d * s->rows * hidden, hidden, n, s->w_hr + (d * s->proj_panels + panel) * hidden * PANEL,
                hidden, s->p + d * s->rows * s->p_width + j, s->p_width);
        from = s->p + d * s->rows * s->p_width + j;
        stride = s->p_width;
    }
    for (int64_t i = 0; i < n; i++) {
        float *hi = s->h + (d * s->rows + i) * proj + j, *o = s->out + (d * s->n_packed + first + i) * proj + j;
        for (int64_t k = 0; k < cols; k++) {
            float v = from[i * stride + k];
            v = v < -s->proj_clip ? -s->proj_clip : (v > s->proj_clip ? s->proj_clip : v);
            hi[k] = v;
            o[k] = v;
        }
    }
}

/* Every step of direction d in the calling thread alone: the two directions share nothing, so two threads run one
 * each without meeting. Why: the shared team's three barriers a step cost little on idle cores, but where another
 * process holds a core (a server's HTTP process beside its model process) one thread waits at each barrier for
 * the other to be scheduled again: 36% of a server's model-process samples were libgomp's waiting. */
static void direction_steps(const Steps *s, int64_t d) {
    int64_t first = 0;
    for (int64_t t = 0; t < s->steps; t++) {
        const int64_t n = s->batch_sizes[t];
        for (int64_t panel = 0; panel < s->gate_panels; panel++) gate_panel(s, d, panel, n);
        for (int64_t i = 0; i < n; i++)
            for (int64_t block = 0; block < s->cell_blocks; block++) cell_block(s, d, i, block, first);
        for (int64_t panel = 0; panel < s->proj_panels; panel++) proj_panel(s, d, panel, n, first);
        first += n;
    }
}

/* Every step, both directions, in a team of `threads` that splits each part of a step and meets after it. */
static void team_steps(const Steps *s, int threads) {
#pragma omp parallel num_threads(threads) if (threads > 1)
    {
        int64_t first = 0; /* the packed row of this step's first row */
        for (int64_t t = 0; t < s->steps; t++) {
            const int64_t n = s->batch_sizes[t];
#pragma omp for schedule(static)
            for (int64_t item = 0; item < 2 * s->gate_panels; item++)
                gate_panel(s, item / s->gate_panels, item % s->gate_panels, n);
#pragma omp for schedule(static)
            for (int64_t item = 0; item < 2 * n * s->cell_blocks; item++)
                cell_block(s, item / (n * s->cell_blocks), (item / s->cell_blocks) % n, item % s->cell_blocks, first);
#pragma omp for schedule(static)
            for (int64_t item = 0; item < 2 * s->proj_panels; item++)
                proj_panel(s, item / s->proj_panels, item % s->proj_panels, n, first);
            first += n;
        }
    }
}

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
 * cell_clip and proj_clip: INFINITY for none. threads: 2 runs a direction per thread; more, a team over both.
 * Returns 0, or 1 for arguments it cannot run. */
int elmo_lstm_steps(int64_t steps, const int64_t *batch_sizes, int64_t proj, int64_t hidden, const float *x,
                   int64_t x_dir, const int64_t *x_rows, int64_t rows_dir, const float *bias, const float *w_hh,
                   const float *w_hr, float *h, float *c, float *out, int64_t n_packed, float *y, float *m, float *p,
                   float cell_clip, float proj_clip, int threads) {
    if (steps < 1 || batch_sizes[0] < 1 || (w_hr == NULL && proj != hidden)) return 1;
    for (int64_t t = 1; t < steps; t++)
        if (batch_sizes[t] < 1 || batch_sizes[t] > batch_sizes[t - 1]) return 1;
    const int64_t width = 4 * hidden, gate_panels = (width + PANEL - 1) / PANEL;
    const int64_t proj_panels = (proj + PANEL - 1) / PANEL;
    const Steps s = {steps, proj, hidden, width, batch_sizes[0], n_packed, x_dir, rows_dir, gate_panels,
                     gate_panels * PANEL, proj_panels, proj_panels * PANEL, (hidden + CELL_BLOCK - 1) / CELL_BLOCK,
                     batch_sizes, x_rows, x, bias, w_hh, w_hr, h, c, out, y, m, p, cell_clip, proj_clip};
    if (threads == 2) {
#pragma omp parallel num_threads(2)
        {
#ifdef _OPENMP
            const int64_t me = omp_get_thread_num(), team = omp_get_num_threads(); /* one thread where nested */
#else
            const int64_t me = 0, team = 1;
#endif
            for (int64_t d = me; d < 2; d += team) direction_steps(&s, d);
        }
    } else {
        team_steps(&s, threads);
    }
    return 0;
}
