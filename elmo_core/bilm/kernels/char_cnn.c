/* The char CNN's backward in training, sparse at each max's position (built and loaded with lstm_gates.c by
 * fused_gates.py; called by char_cnn.py).
 *
 * bilm-tf's char CNN takes, per word n and filter f, the largest value over positions of a width-w convolution of the
 * word's char embeddings (then the activation). A max passes its gradient to the one position that gave it (PyTorch's
 * max pooling keeps the first of equal values), so of the convolution's dense backward over every position only one
 * position per (word, filter) is nonzero. With p = argmax[n, f] and g = grad[n, f]:
 *     dW[f, j, :] += g * E[ids[n, p + j]]        dE[ids[n, p + j]] += g * W[f, j, :]        (j < w)
 *     db[f]       += g
 * where E is the char embedding table: dE is the table's gradient, the lookup's backward folded in. That is
 * N x F x w x D products each way, against N x F x positions x w x D for the dense backward.
 *
 * The arithmetic is float32; E, W and the gradient may be bfloat16 in memory (the products' dtype under autocast).
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

static inline float bf16_value(uint16_t b) {
    uint32_t u = (uint32_t)b << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

/* n values, bfloat16 when `bf16`, else float32, as a new float32 array (NULL when out of memory). */
static float *as_float(const void *p, int64_t n, int bf16) {
    float *out = malloc((size_t)(n > 0 ? n : 1) * sizeof(float));
    if (out == NULL) return NULL;
    if (bf16)
        for (int64_t k = 0; k < n; k++) out[k] = bf16_value(((const uint16_t *)p)[k]);
    else
        memcpy(out, p, (size_t)n * sizeof(float));
    return out;
}

/* One convolution width. ids (words, length) int64; table (vocab, dim); weight (filters, width, dim); argmax and grad
 * (words, filters), argmax a position in [0, length - width]. Writes dweight (filters, width, dim) and dbias (filters)
 * and adds into dtable (vocab, dim), all float32. Returns 0, or 1 when out of memory. */
int elmo_conv_max_backward(const int64_t *ids, const void *table, const void *weight, const int64_t *argmax,
                           const void *grad, float *dweight, float *dbias, float *dtable, int64_t words,
                           int64_t length, int64_t dim, int64_t vocab, int64_t filters, int64_t width, int bf16,
                           int grad_bf16, int threads) {
    float *e = as_float(table, vocab * dim, bf16), *w = as_float(weight, filters * width * dim, bf16);
    float *g = as_float(grad, words * filters, grad_bf16);
    int failed = e == NULL || w == NULL || g == NULL;
    if (!failed) {
        const int64_t span = width * dim;
        /* dW and db: each thread its own filters */
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1)
        for (int64_t f = 0; f < filters; f++) {
            float *restrict dw = dweight + f * span;
            float db = 0.0f;
            memset(dw, 0, (size_t)span * sizeof(float));
            for (int64_t n = 0; n < words; n++) {
                const float gv = g[n * filters + f];
                if (gv == 0.0f) continue;
                db += gv;
                const int64_t *row = ids + n * length + argmax[n * filters + f];
                for (int64_t j = 0; j < width; j++) {
                    const float *restrict ej = e + row[j] * dim;
                    float *restrict dwj = dw + j * dim;
                    for (int64_t d = 0; d < dim; d++) dwj[d] += gv * ej[d];
                }
            }
            dbias[f] = db;
        }
        /* dE: each thread its own words, into its own copy of the table's gradient, summed at the end */
#pragma omp parallel num_threads(threads) if (threads > 1)
        {
            float *part = calloc((size_t)(vocab * dim), sizeof(float));
            if (part == NULL) {
#pragma omp atomic write
                failed = 1;
            }
#pragma omp for schedule(static)
            for (int64_t n = 0; n < words; n++) {
                if (part == NULL) continue;
                const int64_t *row = ids + n * length;
                const float *restrict gn = g + n * filters;
                const int64_t *restrict pn = argmax + n * filters;
                for (int64_t f = 0; f < filters; f++) {
                    const float gv = gn[f];
                    if (gv == 0.0f) continue;
                    const float *restrict wf = w + f * span;
                    const int64_t *at = row + pn[f];
                    for (int64_t j = 0; j < width; j++) {
                        float *restrict de = part + at[j] * dim;
                        const float *restrict wj = wf + j * dim;
                        for (int64_t d = 0; d < dim; d++) de[d] += gv * wj[d];
                    }
                }
            }
            if (part != NULL) {
#pragma omp critical
                for (int64_t k = 0; k < vocab * dim; k++) dtable[k] += part[k];
                free(part);
            }
        }
    }
    free(e);
    free(w);
    free(g);
    return failed;
}
