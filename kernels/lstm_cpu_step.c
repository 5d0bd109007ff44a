/* The elementwise pass of one forward step of the block LSTM on the CPU, fused.
 *
 * ``lstm_cpu.py`` computes a step's gate pre-activations with a GEMM (NumPy's BLAS)
 * and then runs about twenty NumPy passes over [batch, units] arrays to turn them
 * into the seven outputs; at TensorFlow's benchmark shapes those passes and their
 * calls cost a fifth of the forward. This file does the same arithmetic in one pass
 * over the batch, each element's four gates read once and its seven outputs written
 * once. ``native.py`` compiles it with the host's C compiler for the host's CPU
 * (``-O3 -march=native``: GCC and Clang vectorize the inner loop) and calls it
 * through ctypes, which releases the GIL for the call.
 *
 * The math is ``lstm_cpu._recur``'s (``lstm.py`` states the gates): the i, f and o
 * columns of the weights, bias and peepholes arrive halved, so
 * sigmoid(z) = 0.5 * tanh(z / 2) + 0.5 takes the halved pre-activation as it is.
 * tanh is a rational function (an odd degree-13 numerator over an even degree-6
 * denominator, as Eigen's float tanh, which TensorFlow's CPU kernel evaluates): no
 * exp, no branch, so it vectorizes; within 7 float32 ulps of the true tanh over every
 * float32 (``test_lstm_cpu_native.py`` checks a sample), where NumPy's is within one, and
 * never past +-1.
 * float32 only: the rational function is not accurate enough for float64, which
 * stays on NumPy.
 */

#define _POSIX_C_SOURCE 200809L /* pthreads under -std=c99 */

#include <math.h>
#include <pthread.h>
#include <sched.h>
#include <signal.h>
#include <stddef.h>
#include <stdlib.h>
#include <string.h>

/* Where the rational function reaches 1 (Eigen's clamp): beyond it tanh rounds to +-1
 * in float32, and the function itself, clamped at 9 instead, rose past 1 by up to 2 ulps
 * from 8.1 on (so a gate of 1.0000001; a review helper). */
#define TANH_CLAMP 7.90531110763549805f

static inline float rational_tanh(float z) {
    /* NaN passes through both comparisons and stays NaN; +-inf clamp to +-1. */
    const float x = z > TANH_CLAMP ? TANH_CLAMP : (z < -TANH_CLAMP ? -TANH_CLAMP : z);
    const float x2 = x * x;
    float p = -2.76076847742355e-16f;
    p = p * x2 + 2.00018790482477e-13f;
    p = p * x2 - 8.60467152213735e-11f;
    p = p * x2 + 5.12229709037114e-08f;
    p = p * x2 + 1.48572235717979e-05f;
    p = p * x2 + 6.37261928875436e-04f;
    p = p * x2 + 4.89352455891786e-03f;
    float q = 1.19825839466702e-06f;
    q = q * x2 + 1.18534705686654e-04f;
    q = q * x2 + 2.26843463243900e-03f;
    q = q * x2 + 4.89352518554385e-03f;
    return x * (p / q);
}

/* Exported for the accuracy test: ``out[k] = tanh(z[k])`` as the step computes it. */
void gradserve_rational_tanh_f32(const float *restrict z, float *restrict out, long n) {
    for (long k = 0; k < n; k++) out[k] = rational_tanh(z[k]);
}

/* sigmoid(z) from z / 2 where the rational tanh has reached -1 (z below -15.8):
 * 0.5 * tanh(z / 2) + 0.5 is exactly 0 there, where sigmoid(z) is not (4e-8 at -17;
 * NumPy's pass gives 6e-8 down to -18, and a forget gate of 0 meeting an infinite cell
 * made NaN where NumPy's pass made an infinity: a review helper). exp(z) / (1 + exp(z)),
 * from libm: rare, so the rows' loops stay vectorized and only these elements are
 * computed again (``fix_saturated``). */
static float saturated_sigmoid(float z_half) {
    const float e = expf(2.0f * z_half);
    return e / (1.0f + e);
}

/* sigmoid(z) from z / 2; ``exact_saturation``: from ``saturated_sigmoid`` where the
 * tanh saturated (a constant where inlined: 0 in the vectorized loop). */
static inline float sigmoid_half(float z_half, const int exact_saturation) {
    if (exact_saturation && z_half < -TANH_CLAMP) return saturated_sigmoid(z_half);
    return 0.5f * rational_tanh(z_half) + 0.5f;
}

/* Element k's four pre-activations: bias, plus the projection (``add``), plus the GEMM's,
 * in that order. */
static inline void pre_activations(
    const float *restrict g, const float *restrict pr, const float *restrict bias, long k,
    long off_i, long off_f, long off_c, long off_o, const int add,
    float *zi, float *zf, float *zc, float *zo)
{
    *zi = bias[off_i + k];
    *zf = bias[off_f + k];
    *zc = bias[off_c + k];
    *zo = bias[off_o + k];
    if (add) {
        *zi += pr[off_i + k];
        *zf += pr[off_f + k];
        *zc += pr[off_c + k];
        *zo += pr[off_o + k];
    }
    *zi += g[off_i + k];
    *zf += g[off_f + k];
    *zc += g[off_c + k];
    *zo += g[off_o + k];
}

/* Element k's seven outputs from its pre-activations (``lstm.py`` states the gates). */
static inline void cell(
    float zi, float zf, float zc, float zo, float c, float wci, float wcf, float wco,
    float cell_clip, const int peephole, const int exact_saturation, long k,
    float *restrict out_i, float *restrict out_cs, float *restrict out_f,
    float *restrict out_o, float *restrict out_ci, float *restrict out_co,
    float *restrict out_h)
{
    if (peephole) {
        zi += c * wci;
        zf += c * wcf;
    }
    const float i = sigmoid_half(zi, exact_saturation);
    const float f = sigmoid_half(zf, exact_saturation);
    const float ci = rational_tanh(zc);
    float cs = i * ci + f * c;
    if (cell_clip > 0.0f) {
        cs = cs > cell_clip ? cell_clip : (cs < -cell_clip ? -cell_clip : cs);
    }
    const float co = rational_tanh(cs);
    if (peephole) zo += cs * wco;
    const float o = sigmoid_half(zo, exact_saturation);
    out_i[k] = i;
    out_f[k] = f;
    out_ci[k] = ci;
    out_cs[k] = cs;
    out_co[k] = co;
    out_o[k] = o;
    out_h[k] = o * co;
}

/* One batch row, specialised by the caller for each combination of ``add`` (proj
 * given) and ``peephole``: a branch on a pointer that may be NULL inside the loop
 * stops GCC from vectorizing it (it may not load through such a pointer
 * unconditionally), which made the step 7x slower. */
static inline void step_row(
    const float *restrict g, const float *restrict pr, const float *restrict bias,
    const float *restrict c_row,
    const float *restrict wci, const float *restrict wcf, const float *restrict wco,
    long units, long off_i, long off_f, long off_c, long off_o, float cell_clip,
    const int add, const int peephole,
    float *restrict out_i, float *restrict out_cs, float *restrict out_f,
    float *restrict out_o, float *restrict out_ci, float *restrict out_co,
    float *restrict out_h)
{
    for (long k = 0; k < units; k++) {
        float zi, zf, zc, zo;
        pre_activations(g, pr, bias, k, off_i, off_f, off_c, off_o, add, &zi, &zf, &zc, &zo);
        cell(zi, zf, zc, zo, c_row[k], peephole ? wci[k] : 0.0f, peephole ? wcf[k] : 0.0f,
             peephole ? wco[k] : 0.0f, cell_clip, peephole, 0, k, out_i, out_cs, out_f,
             out_o, out_ci, out_co, out_h);
    }
}

/* Whether a gate of the row saturated (exactly 0: ``saturated_sigmoid``). A loop of its
 * own: the same test inside ``step_row``'s loop stopped GCC from vectorizing it. */
static inline int any_saturated(const float *restrict i, const float *restrict f,
                                const float *restrict o, long units)
{
    int any = 0;
    for (long k = 0; k < units; k++) any |= (i[k] == 0.0f) | (f[k] == 0.0f) | (o[k] == 0.0f);
    return any;
}

/* The elements of a row where a gate saturated, computed again with its exact sigmoid
 * (the same operations otherwise: the other gates and outputs come out the same). */
static void fix_saturated(
    const float *g, const float *pr, const float *bias, const float *c_row,
    const float *wci, const float *wcf, const float *wco, long units, long off_i,
    long off_f, long off_c, long off_o, float cell_clip, float *out_i, float *out_cs,
    float *out_f, float *out_o, float *out_ci, float *out_co, float *out_h)
{
    const int peephole = wci != NULL;
    for (long k = 0; k < units; k++) {
        if (out_i[k] != 0.0f && out_f[k] != 0.0f && out_o[k] != 0.0f) continue;
        float zi, zf, zc, zo;
        pre_activations(g, pr, bias, k, off_i, off_f, off_c, off_o, pr != NULL, &zi, &zf,
                        &zc, &zo);
        cell(zi, zf, zc, zo, c_row[k], peephole ? wci[k] : 0.0f, peephole ? wcf[k] : 0.0f,
             peephole ? wco[k] : 0.0f, cell_clip, peephole, 1, k, out_i, out_cs, out_f,
             out_o, out_ci, out_co, out_h);
    }
}

/* One step: gates [batch, gates_stride] (the i, f, c, o columns at off_*, units wide
 * each; i, f, o halved), plus proj [batch, proj_stride] at the same columns when proj
 * is not NULL (the hoisted input projection), plus bias [4 units] (as the gates'
 * columns, i, f, o halved, the forget bias added): z = (bias + proj) + gates (NumPy's
 * pass adds them in that order too, but for the transposed formulation, whose
 * projection the caller adds to the gates first); c_last [batch, units]; peep [3, units] (wci, wcf, wco, halved)
 * or NULL for no peepholes; cell_clip > 0 clips the cell. The seven outputs are
 * [batch, units] each, contiguous. */
void gradserve_lstm_forward_step_f32(
    const float *restrict gates, long gates_stride,
    const float *restrict proj, long proj_stride, const float *restrict bias,
    const float *restrict c_last, const float *restrict peep,
    long batch, long units, long off_i, long off_f, long off_c, long off_o,
    float cell_clip,
    float *restrict out_i, float *restrict out_cs, float *restrict out_f,
    float *restrict out_o, float *restrict out_ci, float *restrict out_co,
    float *restrict out_h)
{
    const float *wci = peep;
    const float *wcf = peep != NULL ? peep + units : NULL;
    const float *wco = peep != NULL ? peep + 2 * units : NULL;
    for (long b = 0; b < batch; b++) {
        const float *g = gates + b * gates_stride;
        const float *pr = proj != NULL ? proj + b * proj_stride : NULL;
        const float *c_row = c_last + b * units;
        const long r = b * units;
#define STEP_ROW(ADD, PEEP)                                                           \
    step_row(g, pr, bias, c_row, wci, wcf, wco, units, off_i, off_f, off_c, off_o, cell_clip, \
             ADD, PEEP, out_i + r, out_cs + r, out_f + r, out_o + r, out_ci + r,       \
             out_co + r, out_h + r)
        if (proj != NULL && peep != NULL) STEP_ROW(1, 1);
        else if (proj != NULL) STEP_ROW(1, 0);
        else if (peep != NULL) STEP_ROW(0, 1);
        else STEP_ROW(0, 0);
#undef STEP_ROW
        if (any_saturated(out_i + r, out_f + r, out_o + r, units)) {
            fix_saturated(g, pr, bias, c_row, wci, wcf, wco, units, off_i, off_f, off_c,
                          off_o, cell_clip, out_i + r, out_cs + r, out_f + r, out_o + r,
                          out_ci + r, out_co + r, out_h + r);
        }
    }
}

/* One step of the backward's recurrence (``lstm_cpu_backward.py`` states it), in the
 * NumPy pass's grouping: the products of activations first (its per-block factors),
 * then each sum in its order, so with the ISO C floating point this file is compiled
 * with (``-ffp-contract=off``: no fused multiply-adds, ``native.FLAGS``) it gives NumPy's
 * bits, infinities included; a NaN may carry the other sign (where two NaNs meet, which
 * one an operation keeps depends on its operands' order, which the compiler may swap:
 * a review helper). No transcendental function: float64 too.
 *
 * dh [batch, units]: the carry from the step above (dgates @ W_h^T), h_grad added in
 * place; dcs [batch, units]: the cell's carry, replaced by the carry to the step
 * below; i, f, o, ci, co, cs, cs_last, h_grad, cs_grad: this step's [batch, units];
 * peep (wci, wcf, wco) [3, units] or NULL; clip: whether the forward clipped its
 * cells, at clip_at as stored (a clipped cell passes nothing to i, f, ci or the past;
 * a float16 clip of 1e-8 is stored as 0, where every cell is clipped: clip_at alone
 * could not say so, a review helper); dgates [batch, 4 units]: this
 * step's gate gradients at the columns off_*. */
#define DEFINE_BACKWARD_STEP(T, NAME)                                                      \
    static inline void NAME##_row(                                                         \
        T *restrict dh, T *restrict dcs, const T *restrict i, const T *restrict f,         \
        const T *restrict o, const T *restrict ci, const T *restrict co,                   \
        const T *restrict cs, const T *restrict cs_last, const T *restrict h_grad,         \
        const T *restrict cs_grad, const T *restrict wci, const T *restrict wcf,           \
        const T *restrict wco, T clip_at, const int peephole, const int clip,              \
        long units, T *restrict di_out, T *restrict df_out, T *restrict dc_out,            \
        T *restrict do_out)                                                                \
    {                                                                                      \
        const T one = 1;                                                                   \
        for (long k = 0; k < units; k++) {                                                 \
            const T ig = i[k], fg = f[k], og = o[k], cig = ci[k], coa = co[k];              \
            const T a_o = (one - og) * og * coa;                                           \
            const T b_h = (one - coa * coa) * og;                                          \
            const T a_i = (one - ig) * ig * cig;                                           \
            const T a_f = (one - fg) * fg * cs_last[k];                                    \
            const T a_c = (one - cig * cig) * ig;                                          \
            const T dhk = dh[k] + h_grad[k];                                               \
            dh[k] = dhk;                                                                   \
            const T d_o = a_o * dhk;                                                       \
            T d = dcs[k] + b_h * dhk;                                                      \
            d = d + cs_grad[k];                                                            \
            if (peephole) d = d + d_o * wco[k];                                            \
            T d_i = a_i * d, d_f = a_f * d, d_c = a_c * d;                                 \
            T carry = d * fg;                                                              \
            if (peephole) {                                                                \
                carry = carry + d_i * wci[k];                                              \
                carry = carry + d_f * wcf[k];                                              \
            }                                                                              \
            if (clip) {                                                                    \
                const T a = cs[k] < 0 ? -cs[k] : cs[k];                                    \
                const T unclipped = a < clip_at ? one : (T)0;                              \
                carry *= unclipped;                                                        \
                d_i *= unclipped;                                                          \
                d_f *= unclipped;                                                          \
                d_c *= unclipped;                                                          \
            }                                                                              \
            dcs[k] = carry;                                                                \
            di_out[k] = d_i;                                                               \
            df_out[k] = d_f;                                                               \
            dc_out[k] = d_c;                                                               \
            do_out[k] = d_o;                                                               \
        }                                                                                  \
    }                                                                                      \
                                                                                           \
    void NAME(T *restrict dh, T *restrict dcs, const T *restrict i, const T *restrict f,   \
              const T *restrict o, const T *restrict ci, const T *restrict co,             \
              const T *restrict cs, const T *restrict cs_last, const T *restrict h_grad,   \
              const T *restrict cs_grad, const T *restrict peep, int clip, T clip_at,      \
              long batch, long units, long off_i, long off_f, long off_c, long off_o,      \
              T *restrict dgates)                                                          \
    {                                                                                      \
        const T *wci = peep;                                                               \
        const T *wcf = peep != NULL ? peep + units : NULL;                                 \
        const T *wco = peep != NULL ? peep + 2 * units : NULL;                             \
        for (long b = 0; b < batch; b++) {                                                 \
            const long r = b * units;                                                      \
            T *g = dgates + b * 4 * units;                                                 \
            /* specialised per flag, as step_row: see there */                             \
            if (peep != NULL && clip)                                                      \
                NAME##_row(dh + r, dcs + r, i + r, f + r, o + r, ci + r, co + r, cs + r,   \
                           cs_last + r, h_grad + r, cs_grad + r, wci, wcf, wco, clip_at,   \
                           1, 1, units, g + off_i, g + off_f, g + off_c, g + off_o);       \
            else if (peep != NULL)                                                         \
                NAME##_row(dh + r, dcs + r, i + r, f + r, o + r, ci + r, co + r, cs + r,   \
                           cs_last + r, h_grad + r, cs_grad + r, wci, wcf, wco, clip_at,   \
                           1, 0, units, g + off_i, g + off_f, g + off_c, g + off_o);       \
            else if (clip)                                                                 \
                NAME##_row(dh + r, dcs + r, i + r, f + r, o + r, ci + r, co + r, cs + r,   \
                           cs_last + r, h_grad + r, cs_grad + r, wci, wcf, wco, clip_at,   \
                           0, 1, units, g + off_i, g + off_f, g + off_c, g + off_o);       \
            else                                                                           \
                NAME##_row(dh + r, dcs + r, i + r, f + r, o + r, ci + r, co + r, cs + r,   \
                           cs_last + r, h_grad + r, cs_grad + r, wci, wcf, wco, clip_at,   \
                           0, 0, units, g + off_i, g + off_f, g + off_c, g + off_o);       \
        }                                                                                  \
    }

DEFINE_BACKWARD_STEP(float, gradserve_lstm_backward_step_f32)
DEFINE_BACKWARD_STEP(double, gradserve_lstm_backward_step_f64)

/* ---- The fused formulation: the recurrent GEMM and the step in one loop ----
 *
 * ``lstm_cpu``'s HOISTED formulation computes each step's h @ W_h with NumPy's BLAS,
 * which packs both operands again on every call (W_h, a megabyte at 256 units, for a
 * GEMM of 32 rows) and runs at about 60% of its large-GEMM speed there; the step above
 * then reads the gates back from memory. FUSED packs W_h once per call, into panels
 * of VL units by the four gates (``gradserve_lstm_pack_f32``), and each step
 * (``fused_forward_step``) computes a tile of MR batch rows by one
 * panel in registers (a register-blocked GEMM: MR x 4 vectors of accumulators, as BLAS
 * libraries' micro-kernels), starting from the bias and the input projection (the
 * BLAS's GEMM of a chunk of steps), and turns it into the seven outputs of those rows
 * and units while it is still in the L1 cache.
 *
 * VL and MR follow the vector registers the compiler targets: 32 of 16 floats with
 * AVX-512, 16 of 8 with AVX, 32 of 4 on AArch64, else SSE's or the baseline's 4 (GCC's
 * and Clang's vector extensions compile the same code for each). FUSED's arithmetic
 * uses fused multiply-adds where the CPU has them (the rest of this file is compiled
 * without contraction: ``FMA_FUNCTION``), its products summed in the order of k: its
 * last bits differ from the BLAS formulations', as those differ from each other. */

#if defined(__AVX512F__)
#define VL 16
#define MR 6
#elif defined(__AVX__)
#define VL 8
#define MR 2
#elif defined(__aarch64__)
#define VL 4
#define MR 6
#else
#define VL 4
#define MR 2
#endif
#define PANEL_WIDTH (4 * VL) /* one panel's columns: VL units of each of the 4 gates */

/* Loads and stores through this type are unaligned ones (aligned(4)) and may alias
 * the floats they read. */
typedef float vfloat __attribute__((vector_size(VL * sizeof(float)), aligned(4), may_alias));

#if defined(__clang__)
#define FMA_FUNCTION
#define CONTRACT_FMA _Pragma("clang fp contract(fast)")
#else
#define FMA_FUNCTION __attribute__((optimize("fp-contract=fast")))
#define CONTRACT_FMA
#endif

static long panels_of(long units) { return (units + VL - 1) / VL; }

/* Subnormal floats read and written as zero while FUSED computes, as TensorFlow's CPU
 * kernels compute (its thread pools set flush-to-zero and denormals-are-zero): a
 * forward of subnormal weights took 4.4 s against 42 ms, every multiply-add with one
 * taking a microcode assist (a review helper). The mode is the thread's: the caller
 * sets it around a call (``native.flushing_subnormals``), a team's workers when they
 * start. */
#if defined(__SSE__)
#include <xmmintrin.h>
#define FLUSH_BITS 0x8040u /* MXCSR's FTZ (bit 15) and DAZ (bit 6) */
unsigned long gradserve_flush_subnormals(void) {
    const unsigned int was = _mm_getcsr();
    _mm_setcsr(was | FLUSH_BITS);
    return was;
}
void gradserve_restore_fp_mode(unsigned long was) { _mm_setcsr((unsigned int)was); }
#elif defined(__aarch64__)
unsigned long gradserve_flush_subnormals(void) {
    unsigned long was;
    __asm__ __volatile__("mrs %0, fpcr" : "=r"(was));
    __asm__ __volatile__("msr fpcr, %0" : : "r"(was | (1UL << 24))); /* FZ */
    return was;
}
void gradserve_restore_fp_mode(unsigned long was) {
    __asm__ __volatile__("msr fpcr, %0" : : "r"(was));
}
#else
unsigned long gradserve_flush_subnormals(void) { return 0; }
void gradserve_restore_fp_mode(unsigned long was) { (void)was; }
#endif

/* Whether any of a's n floats is subnormal. The BLAS's threads run without that mode:
 * the GEMM of W_x after FUSED's backward recurrence took 120 ms against 11 with
 * subnormal weights, so the BLAS's GEMMs of FUSED read copies of their operands with
 * them as zero where there are any (``lstm_cpu.without_subnormals``); this scan (1.6
 * MB of x at (50, 32, 256)) is what the common case pays. */
int gradserve_any_subnormal_f32(const float *restrict a, long n) {
    unsigned int any = 0;
    for (long k = 0; k < n; k++) {
        unsigned int bits;
        memcpy(&bits, a + k, sizeof bits);
        any |= ((bits & 0x7f800000u) == 0) & ((bits & 0x007fffffu) != 0);
    }
    return (int)any;
}

/* Exported for the accuracy test: ``out[k] = tanh(z[k])`` as FUSED's cells compute it,
 * with fused multiply-adds where GCC contracts them (``fused_tiles``). */
FMA_FUNCTION void gradserve_rational_tanh_fma_f32(const float *restrict z, float *restrict out,
                                                 long n) {
    for (long k = 0; k < n; k++) out[k] = rational_tanh(z[k]);
}

/* Floats of a packed [rows, 4 units] weight matrix (the caller aligns it to 64 bytes). */
long gradserve_lstm_packed_floats(long rows, long units) {
    return panels_of(units) * rows * PANEL_WIDTH;
}

/* packed[p][k][g][u] = w[k][off_g + p * VL + u] for each gate g (i, f, c, o), 0 past the
 * last unit: w is [rows, 4 units] (W_h: rows = units), the gates'
 * columns at off_*. */
void gradserve_lstm_pack_f32(
    const float *restrict w, long rows, long units, long off_i, long off_f, long off_c,
    long off_o, float *restrict packed)
{
    const long offs[4] = {off_i, off_f, off_c, off_o};
    for (long p = 0; p < panels_of(units); p++) {
        const long u0 = p * VL, n = units - u0 < VL ? units - u0 : VL;
        for (long k = 0; k < rows; k++) {
            const float *row = w + k * 4 * units + u0;
            float *dst = packed + (p * rows + k) * PANEL_WIDTH;
            for (int g = 0; g < 4; g++) {
                if (n == VL) {
                    for (long u = 0; u < VL; u++) dst[g * VL + u] = row[offs[g] + u];
                } else {
                    for (long u = 0; u < VL; u++) dst[g * VL + u] = u < n ? row[offs[g] + u] : 0.0f;
                }
            }
        }
    }
}

/* z [mr][PANEL_WIDTH] += a [mr rows of depth] @ panel [depth][PANEL_WIDTH]: the
 * accumulators stay in registers over all of k (mr a constant where inlined). */
static inline __attribute__((always_inline)) FMA_FUNCTION void panel_tile(
    const float *restrict a, long depth, const float *restrict panel, float *restrict z,
    const int mr)
{
    CONTRACT_FMA
    vfloat acc[MR][4];
    for (int r = 0; r < mr; r++)
        for (int g = 0; g < 4; g++) acc[r][g] = *(const vfloat *)(z + r * PANEL_WIDTH + g * VL);
    for (long k = 0; k < depth; k++) {
        const float *w = panel + k * PANEL_WIDTH;
        const vfloat w0 = *(const vfloat *)w, w1 = *(const vfloat *)(w + VL);
        const vfloat w2 = *(const vfloat *)(w + 2 * VL), w3 = *(const vfloat *)(w + 3 * VL);
        for (int r = 0; r < mr; r++) {
            const float ark = a[r * depth + k];
            acc[r][0] = ark * w0 + acc[r][0];
            acc[r][1] = ark * w1 + acc[r][1];
            acc[r][2] = ark * w2 + acc[r][2];
            acc[r][3] = ark * w3 + acc[r][3];
        }
    }
    for (int r = 0; r < mr; r++)
        for (int g = 0; g < 4; g++) *(vfloat *)(z + r * PANEL_WIDTH + g * VL) = acc[r][g];
}

/* ``panel_tile`` for 1 .. MR rows, each count compiled on its own. */
static FMA_FUNCTION void panel_tile_rows(
    const float *restrict a, long depth, const float *restrict panel, float *restrict z, int mr)
{
    switch (mr) {
#if MR >= 6
    case 6: panel_tile(a, depth, panel, z, 6); break;
    case 5: panel_tile(a, depth, panel, z, 5); break;
    case 4: panel_tile(a, depth, panel, z, 4); break;
    case 3: panel_tile(a, depth, panel, z, 3); break;
#endif
    case 2: panel_tile(a, depth, panel, z, 2); break;
    default: panel_tile(a, depth, panel, z, 1); break;
    }
}

/* The outputs of one row's n units of a tile: z holds their pre-activations, gate g's
 * at z[g * VL ..]; the outputs and c_row point at the row's first unit of the panel. */
static inline __attribute__((always_inline)) void tile_row_cells(
    const float *restrict z, const float *restrict c_row, const float *restrict wci,
    const float *restrict wcf, const float *restrict wco, long n, float cell_clip,
    const int peephole, const int exact_saturation,
    float *restrict out_i, float *restrict out_cs, float *restrict out_f,
    float *restrict out_o, float *restrict out_ci, float *restrict out_co,
    float *restrict out_h)
{
    for (long u = 0; u < n; u++) {
        cell(z[u], z[VL + u], z[2 * VL + u], z[3 * VL + u], c_row[u],
             peephole ? wci[u] : 0.0f, peephole ? wcf[u] : 0.0f, peephole ? wco[u] : 0.0f,
             cell_clip, peephole, exact_saturation, u, out_i, out_cs, out_f, out_o, out_ci,
             out_co, out_h);
    }
}

/* The batch's rows in blocks of at most MR, as even as they come (32 rows: 6, 6, 5, 5,
 * 5, 5), so that no block runs a narrow tail: ``blocks_of`` blocks, block b's first row
 * ``block_start(batch, blocks, b)``. */
static long blocks_of(long batch) { return (batch + MR - 1) / MR; }

static long block_start(long batch, long blocks, long b) {
    return b * (batch / blocks) + (b < batch % blocks ? b : batch % blocks);
}

/* Panels per unit of a team's work (``take_tiles``): 4 panels of 16 units write 256
 * bytes of each output row in a row. */
#define GROUP_PANELS 4
/* Bytes of packed panels the row blocks go through one after another (a "cache
 * group"), so that they stay in the L2 cache from block to block: at 512 units all of
 * W_h block by block went through the cache once per row block (4 MB), and the forward
 * took 52.6 against 39.8 ms panel by panel (1 thread, a probe of 24 steps). Measured at
 * (100, 64, 512), 1 and 2 threads: 1 MB groups 163 and 92 ms, 512 KB 154 and 89, 256 KB
 * 157 and 91 (a quarter of this machine's 2 MB L2). */
#define CACHE_GROUP_BYTES (1L << 19)

/* Panels of a cache group: a multiple of GROUP_PANELS. */
static long cache_group_panels(long rows) {
    const long fit = CACHE_GROUP_BYTES / (rows * PANEL_WIDTH * (long)sizeof(float));
    return fit < GROUP_PANELS ? GROUP_PANELS : fit / GROUP_PANELS * GROUP_PANELS;
}

/* One step's arguments (``fused_forward_step`` states them). */
struct fused_step {
    const float *h_last, *packed, *proj, *bias, *c_last, *peep;
    long proj_stride, batch, units, offs[4];
    float cell_clip;
    float *out_i, *out_cs, *out_f, *out_o, *out_ci, *out_co, *out_h;
};

/* The tiles of row blocks [b_begin, b_end) by panels [p_begin, p_end) of one step, a
 * block's panels one after another: so each output row is written from its start on
 * (panel by panel, the rows 1 KB apart, every write missed the cache where the outputs
 * were not in it: after 0.2 s idle a forward at (50, 32, 256) took 13.7 ms in its steps
 * against 11.1 ms busy; a block at a time, 12.7). */
static __attribute__((noinline)) FMA_FUNCTION void fused_tiles(
    long b_begin, long b_end, long p_begin, long p_end,
    const float *restrict h_last, const float *restrict packed,
    const float *restrict proj, long proj_stride, const float *restrict bias,
    const float *restrict c_last, const float *restrict peep, long batch, long units,
    const long offs[4], float cell_clip,
    float *restrict out_i, float *restrict out_cs, float *restrict out_f,
    float *restrict out_o, float *restrict out_ci, float *restrict out_co,
    float *restrict out_h)
{
    /* (restrict parameters: through a struct's fields GCC assumed the outputs might
     * alias the operands, and the step ran 2.2x slower; ``tiles_of_step`` unpacks) */
    const long blocks = blocks_of(batch);
    float z[MR * PANEL_WIDTH] __attribute__((aligned(64)));
    for (long block = b_begin; block < b_end; block++) {
        const long r0 = block_start(batch, blocks, block);
        const int mr = (int)(block_start(batch, blocks, block + 1) - r0);
        for (long p = p_begin; p < p_end; p++) {
            const float *panel = packed + p * units * PANEL_WIDTH;
            const long u0 = p * VL, n = units - u0 < VL ? units - u0 : VL;
            const float *wci = peep != NULL ? peep + u0 : NULL;
            const float *wcf = peep != NULL ? peep + units + u0 : NULL;
            const float *wco = peep != NULL ? peep + 2 * units + u0 : NULL;
            if (u0 + VL < units) { /* the next tile's output lines, for writing */
                for (int r = 0; r < mr; r++) {
                    const long next = (r0 + r) * units + u0 + VL;
                    __builtin_prefetch(out_i + next, 1, 3);
                    __builtin_prefetch(out_cs + next, 1, 3);
                    __builtin_prefetch(out_f + next, 1, 3);
                    __builtin_prefetch(out_o + next, 1, 3);
                    __builtin_prefetch(out_ci + next, 1, 3);
                    __builtin_prefetch(out_co + next, 1, 3);
                    __builtin_prefetch(out_h + next, 1, 3);
                }
            }
            for (int r = 0; r < mr; r++) {
                const float *pr = proj + (r0 + r) * proj_stride;
                for (int g = 0; g < 4; g++) {
                    float *zg = z + r * PANEL_WIDTH + g * VL;
                    const float *bg = bias + offs[g] + u0;
                    if (n == VL) { /* whole vectors: the micro-kernel loads them as such */
                        const vfloat pg = *(const vfloat *)(pr + offs[g] + u0);
                        *(vfloat *)zg = *(const vfloat *)bg + pg;
                        continue;
                    }
                    for (long u = 0; u < VL; u++) zg[u] = u < n ? bg[u] : 0.0f;
                    for (long u = 0; u < n; u++) zg[u] += pr[offs[g] + u0 + u];
                }
            }
            panel_tile_rows(h_last + r0 * units, units, panel, z, mr);
            for (int r = 0; r < mr; r++) {
                const long at = (r0 + r) * units + u0;
                const float *zr = z + r * PANEL_WIDTH;
#define ROW_CELLS(PEEP, EXACT)                                                              \
    tile_row_cells(zr, c_last + at, wci, wcf, wco, n, cell_clip, PEEP, EXACT, out_i + at,  \
                   out_cs + at, out_f + at, out_o + at, out_ci + at, out_co + at, out_h + at)
                if (peep != NULL) ROW_CELLS(1, 0);
                else ROW_CELLS(0, 0);
                if (any_saturated(out_i + at, out_f + at, out_o + at, n)) {
                    /* the whole row's units again, each gate's sigmoid exact where it
                     * saturated (the others come out the same) */
                    if (peep != NULL) ROW_CELLS(1, 1);
                    else ROW_CELLS(0, 1);
                }
#undef ROW_CELLS
            }
        }
    }
}

/* ``fused_tiles`` of a step's arguments. */
static void tiles_of_step(const struct fused_step *s, long b_begin, long b_end, long p_begin,
                          long p_end) {
    fused_tiles(b_begin, b_end, p_begin, p_end, s->h_last, s->packed, s->proj,
                 s->proj_stride, s->bias,
                 s->c_last, s->peep, s->batch, s->units, s->offs, s->cell_clip, s->out_i,
                 s->out_cs, s->out_f, s->out_o, s->out_ci, s->out_co, s->out_h);
}

/* ---- FUSED's backward: the recurrent GEMM and the backward step in one loop ----
 *
 * The backward's recurrence (``lstm_cpu_backward``) is, per step t from the last:
 * the gate gradients of step t from dh (the carry dgates[t + 1] @ W_h^T, plus
 * h_grad[t]) and dcs, elementwise; then dgates[t] @ W_h^T for step t - 1. With the
 * BLAS that GEMM is a call per step that packs W_h^T again (as the forward's), and the
 * elementwise step reads its result back from memory. Here W_h^T is packed once per
 * call into panels of PANEL_WIDTH units (``gradserve_lstm_pack_transposed_f32``) and
 * each tile of MR batch rows by a panel is ``panel_tile``'s GEMM over the 4 x units
 * columns of dgates[t + 1]'s rows, turned at once into step t's gate gradients of those rows and
 * units (the backward step's row code above, on the tile's dh): each (row, unit) of a
 * step needs its own dh, dcs and activations only, and dcs is each tile's own. */

/* Panels of W_h^T's [4 units, units]: PANEL_WIDTH units each. */
static long transposed_panels_of(long units) { return (units + PANEL_WIDTH - 1) / PANEL_WIDTH; }

/* Floats of W_h^T packed (the caller aligns it to 64 bytes). */
long gradserve_lstm_packed_transposed_floats(long units) {
    return transposed_panels_of(units) * 4 * units * PANEL_WIDTH;
}

/* Columns of W_h a packing pass copies at once: PACK_T_COLUMNS of each of a panel's
 * rows, so its reads and writes stay in a few cache lines (a column at a time, the
 * writes strode a whole panel: 0.5 ms for W_h at 256 units, against 0.13). */
#define PACK_T_COLUMNS 16

/* packed[p][k][j] = w_h[p * PANEL_WIDTH + j][k], 0 past the last unit: W_h^T by panels
 * of PANEL_WIDTH units (w_h: W_h, [units, 4 units], contiguous). */
void gradserve_lstm_pack_transposed_f32(const float *restrict w_h, long units,
                                        float *restrict packed)
{
    const long depth = 4 * units;
    for (long p = 0; p < transposed_panels_of(units); p++) {
        float *dst = packed + p * depth * PANEL_WIDTH;
        for (long k0 = 0; k0 < depth; k0 += PACK_T_COLUMNS) {
            const long k1 = k0 + PACK_T_COLUMNS < depth ? k0 + PACK_T_COLUMNS : depth;
            for (long j = 0; j < PANEL_WIDTH; j++) {
                const long u = p * PANEL_WIDTH + j;
                const float *row = u < units ? w_h + u * depth : NULL;
                for (long k = k0; k < k1; k++) dst[k * PANEL_WIDTH + j] = row ? row[k] : 0.0f;
            }
        }
    }
}

/* One backward step's arguments (``gradserve_lstm_backward_fused_step_f32`` states
 * them). */
struct backward_step {
    const float *dgates_next, *packed, *i, *f, *o, *ci, *co, *cs, *cs_last, *h_grad,
        *cs_grad, *peep;
    int clip;
    float clip_at;
    long batch, units, offs[4];
    float *dcs, *dgates, *dh;
};

/* Panels of W_h^T that go through the row blocks one after another (a cache group, as
 * the forward's ``cache_group_panels``): one at least. */
static long backward_group_panels(long units) {
    if (units <= 0) return 1;
    const long fit = CACHE_GROUP_BYTES / (4 * units * PANEL_WIDTH * (long)sizeof(float));
    return fit < 1 ? 1 : fit;
}

/* The tiles of row blocks [b_begin, b_end) by W_h^T's panels [p_begin, p_end) of one
 * backward step, a block's panels one after another (restrict parameters: see
 * ``fused_tiles``). */
static __attribute__((noinline)) FMA_FUNCTION void backward_tiles(
    long b_begin, long b_end, long p_begin, long p_end, const float *restrict dgates_next,
    const float *restrict packed, const float *restrict i, const float *restrict f,
    const float *restrict o, const float *restrict ci, const float *restrict co,
    const float *restrict cs, const float *restrict cs_last, const float *restrict h_grad,
    const float *restrict cs_grad, const float *restrict peep, int clip, float clip_at,
    long batch, long units, const long offs[4], float *restrict dcs, float *restrict dgates,
    float *restrict dh)
{
    const long blocks = blocks_of(batch), depth = 4 * units;
    float z[MR * PANEL_WIDTH] __attribute__((aligned(64)));
    for (long block = b_begin; block < b_end; block++) {
        const long r0 = block_start(batch, blocks, block);
        const int mr = (int)(block_start(batch, blocks, block + 1) - r0);
        for (long p = p_begin; p < p_end; p++) {
            const long u0 = p * PANEL_WIDTH;
            const long n = units - u0 < PANEL_WIDTH ? units - u0 : PANEL_WIDTH;
            for (long k = 0; k < mr * PANEL_WIDTH; k++) z[k] = 0.0f;
            panel_tile_rows(dgates_next + r0 * depth, depth, packed + p * depth * PANEL_WIDTH,
                            z, mr);
            if (i == NULL) { /* the product alone */
                for (int r = 0; r < mr; r++)
                    for (long u = 0; u < n; u++) dh[(r0 + r) * units + u0 + u] = z[r * PANEL_WIDTH + u];
                continue;
            }
            const float *wci = peep != NULL ? peep + u0 : NULL;
            const float *wcf = peep != NULL ? peep + units + u0 : NULL;
            const float *wco = peep != NULL ? peep + 2 * units + u0 : NULL;
            for (int r = 0; r < mr; r++) {
                const long at = (r0 + r) * units + u0;
                float *g = dgates + (r0 + r) * depth + u0;
#define BACKWARD_ROW(PEEP, CLIP)                                                            \
    gradserve_lstm_backward_step_f32_row(                                                  \
        z + r * PANEL_WIDTH, dcs + at, i + at, f + at, o + at, ci + at, co + at, cs + at,   \
        cs_last + at, h_grad + at, cs_grad + at, wci, wcf, wco, clip_at, PEEP, CLIP, n,     \
        g + offs[0], g + offs[1], g + offs[2], g + offs[3])
                if (peep != NULL && clip) BACKWARD_ROW(1, 1);
                else if (peep != NULL) BACKWARD_ROW(1, 0);
                else if (clip) BACKWARD_ROW(0, 1);
                else BACKWARD_ROW(0, 0);
#undef BACKWARD_ROW
            }
        }
    }
}

static void backward_tiles_of_step(const struct backward_step *s, long b_begin, long b_end,
                                   long p_begin, long p_end) {
    backward_tiles(b_begin, b_end, p_begin, p_end, s->dgates_next, s->packed, s->i, s->f, s->o,
                   s->ci, s->co, s->cs, s->cs_last, s->h_grad, s->cs_grad, s->peep, s->clip,
                   s->clip_at, s->batch, s->units, s->offs, s->dcs, s->dgates, s->dh);
}

/* Panels of W_h^T in a team's claim of a backward step (at most a cache group's): each
 * claim reads its rows of dgates[t + 1] (4 KB a row at 256 units), half of them
 * written by the other core in the step before. A panel a claim: the recurrence at (50,
 * 32, 256) took 5.8-6.0 ms in a team of two, two panels 5.0-5.4 (medians of 18
 * interleaved calls, two runs; the caller alone 7.8-8.4: ``repros17y/bwcmp.py``). */
#define CLAIM_PANELS 2

/* The claims of a backward step of that shape, and claim c's tiles, in the order the
 * caller alone computes them: cache group by cache group (the last may have fewer
 * panels), in each its row blocks one after another, in each block CLAIM_PANELS panels
 * at a time. */
long gradserve_backward_fused_step_claims(long batch, long units) {
    if (batch <= 0 || units <= 0) return 0;
    const long panels = transposed_panels_of(units), group = backward_group_panels(units);
    long claims = 0;
    for (long first = 0; first < panels; first += group) {
        const long in_group = panels - first < group ? panels - first : group;
        claims += blocks_of(batch) * ((in_group + CLAIM_PANELS - 1) / CLAIM_PANELS);
    }
    return claims;
}

static void claimed_backward_tiles(const struct backward_step *s, long c) {
    const long panels = transposed_panels_of(s->units), blocks = blocks_of(s->batch);
    const long group = backward_group_panels(s->units);
    for (long first = 0; first < panels; first += group) {
        const long in_group = panels - first < group ? panels - first : group;
        const long subs = (in_group + CLAIM_PANELS - 1) / CLAIM_PANELS;
        if (c >= blocks * subs) {
            c -= blocks * subs;
            continue;
        }
        const long block = c / subs, p = first + c % subs * CLAIM_PANELS;
        const long end = p + CLAIM_PANELS < first + in_group ? p + CLAIM_PANELS : first + in_group;
        backward_tiles_of_step(s, block, block + 1, p, end);
        return;
    }
}

/* ---- A team of threads for FUSED's steps ----
 *
 * With more than one BLAS thread, a step's tiles are shared by a team: the calling
 * thread and ``threads - 1`` workers (``gradserve_fused_team_start``; ``native.py``
 * keeps teams between calls). A team serves forward steps and backward steps (one at
 * a time: a call's forward, its backward, the next call's forward; ``backward`` says
 * which the current step is). The forward's input projection stays the BLAS's, a GEMM
 * per chunk of steps between them (``lstm_cpu.CHUNK_BYTES``): teams run only where the
 * BLAS's threads sleep soon after a call (``native.py``), and the steps projecting the
 * input themselves (all of W packed, a team where there were BLAS threads) ran 4-9%
 * slower, W_x's panels read again every step.
 *
 * Per step the caller stores it, publishes it (a new generation in the ticket, under
 * the team's mutex so that no worker going to sleep misses it) and every member takes
 * claims (a forward step's: a row block by a group of GROUP_PANELS panels; a
 * backward's: a row block by CLAIM_PANELS panels of W_h^T) one at a time by moving the
 * ticket on, until none is left; the caller then waits for the claims taken to be done
 * and closes the step. The caller stores the next step only then, so no member ever
 * reads a step being stored. A member the scheduler does not run takes nothing, so the
 * step never waits for it beyond a claim it had taken (statically divided, a step
 * waited for a worker that shared the caller's core). Each tile is computed by one
 * member, in one order, so a team's outputs are the same bits at any team size (and
 * the same as the caller alone). Between steps a worker spins a while
 * (``SPIN_ROUNDS``: the next step comes within microseconds), then sleeps on the
 * condition variable: an op paused, or between calls, costs no core. */

/* Test builds only (``-DGRADSERVE_TEAM_DELAYS``): sleeps that widen the team's race
 * windows, so that a test sees in thousands of steps what a server might see once in
 * millions (``test_lstm_cpu_fused.py``). */
#ifdef GRADSERVE_TEAM_DELAYS
#include <time.h>
static void team_delay(long ns) {
    const struct timespec pause = {0, ns};
    nanosleep(&pause, NULL);
}
#define TEAM_DELAY(ns) team_delay(ns)
#else
#define TEAM_DELAY(ns) ((void)0)
#endif

#define SPIN_ROUNDS 4000L /* pause instructions: up to about 0.2 ms (140 cycles each) */
#define YIELD_ROUNDS 64L  /* pause instructions: a few microseconds */

static inline void cpu_relax(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#elif defined(__aarch64__)
    __asm__ __volatile__("yield");
#endif
}

struct fused_team;

struct team_member {
    struct fused_team *team;
    pthread_t thread;
};

struct fused_team {
    pthread_mutex_t lock;
    pthread_cond_t wake;
    long started;              /* workers running */
    unsigned long long ticket; /* the step's generation << 32 | its next untaken claim */
    long claims;               /* of the current step (``run_team_step``) */
    long done;                 /* claims of the current step computed */
    int stop;
    int backward;              /* the current step: back's, else step's */
    struct fused_step step;
    struct backward_step back;
    struct team_member members[];
};

#define GENERATION(ticket) ((ticket) >> 32)
#define CLAIM(ticket) ((long)((ticket) & 0xffffffffULL))
#define CLOSED 0xffffffffULL /* a step's claim once it is over: more than any count */

static long groups_of(long units) { return (panels_of(units) + GROUP_PANELS - 1) / GROUP_PANELS; }

/* The tiles of claim c, in the order the caller alone computes them: cache group by
 * cache group, in each its row blocks one after another, in each block its groups of
 * GROUP_PANELS panels (so a member's next claim goes on along the rows it wrote). */
static void claimed_tiles(const struct fused_step *s, long c) {
    const long panels = panels_of(s->units), blocks = blocks_of(s->batch);
    const long cache_group = cache_group_panels(s->units);
    const long full_claims = blocks * (cache_group / GROUP_PANELS); /* of a whole group */
    const long first = c / full_claims * cache_group, rest = c % full_claims;
    const long in_group = panels - first < cache_group ? panels - first : cache_group;
    const long subgroups = (in_group + GROUP_PANELS - 1) / GROUP_PANELS;
    const long block = rest / subgroups, p0 = first + rest % subgroups * GROUP_PANELS;
    tiles_of_step(s, block, block + 1, p0, p0 + GROUP_PANELS < panels ? p0 + GROUP_PANELS : panels);
}

/* A member's part of step ``generation``: a claim at a time, taken by moving the ticket
 * on, until none is left. A member that comes late (after the step ended, its core busy
 * with another thread) finds the ticket closed or of another generation and takes
 * nothing, so no member ever waits for a member that is not running. (``claims`` is
 * read with acquire: had it seen the next step's count, stored after the caller closed
 * the step, its CAS sees the closed ticket and fails. Before the step was closed, a
 * member late for the last step of a call took a claim of the next call's, where that
 * call had more, and the step ended with it still computing: a review helper.) */
static void take_tiles(struct fused_team *t, unsigned long long generation) {
    unsigned long long ticket = __atomic_load_n(&t->ticket, __ATOMIC_ACQUIRE);
    while (GENERATION(ticket) == generation &&
           CLAIM(ticket) < __atomic_load_n(&t->claims, __ATOMIC_ACQUIRE)) {
        if (__atomic_compare_exchange_n(&t->ticket, &ticket, ticket + 1, 0, __ATOMIC_ACQ_REL,
                                        __ATOMIC_ACQUIRE)) {
            TEAM_DELAY(30000); /* a member slow to compute its claim */
            if (t->backward) claimed_backward_tiles(&t->back, CLAIM(ticket));
            else claimed_tiles(&t->step, CLAIM(ticket));
            __atomic_fetch_add(&t->done, 1, __ATOMIC_RELEASE);
            ticket = __atomic_load_n(&t->ticket, __ATOMIC_ACQUIRE);
        } /* else ticket holds its current value: try again */
    }
}

/* The generation after ``seen``: spun for, then slept for. */
static unsigned long long next_generation(struct fused_team *t, unsigned long long seen) {
    unsigned long long g;
    for (long spin = 0; spin < SPIN_ROUNDS; spin++) {
        g = GENERATION(__atomic_load_n(&t->ticket, __ATOMIC_ACQUIRE));
        if (g != seen) return g;
        cpu_relax();
    }
    pthread_mutex_lock(&t->lock);
    while ((g = GENERATION(__atomic_load_n(&t->ticket, __ATOMIC_ACQUIRE))) == seen)
        pthread_cond_wait(&t->wake, &t->lock);
    pthread_mutex_unlock(&t->lock);
    return g;
}

static void *team_worker(void *arg) {
    struct fused_team *t = ((struct team_member *)arg)->team;
    unsigned long long seen = 0;
    gradserve_flush_subnormals(); /* for good: the thread computes FUSED's tiles only */
    for (;;) {
        seen = next_generation(t, seen);
        TEAM_DELAY(1000 + (long)(seen % 7) * 10000); /* a member late for its step */
        if (__atomic_load_n(&t->stop, __ATOMIC_ACQUIRE)) return NULL;
        take_tiles(t, seen);
    }
}

/* The next generation, nothing of it claimed, under the lock so no worker going to
 * sleep misses it; returns it (32 bits, as the ticket holds it). */
static unsigned long long publish(struct fused_team *t) {
    pthread_mutex_lock(&t->lock);
    const unsigned long long g =
        (GENERATION(__atomic_load_n(&t->ticket, __ATOMIC_RELAXED)) + 1) & 0xffffffffULL;
    __atomic_store_n(&t->ticket, g << 32, __ATOMIC_RELEASE);
    pthread_cond_broadcast(&t->wake);
    pthread_mutex_unlock(&t->lock);
    return g;
}

void gradserve_fused_team_stop(struct fused_team *t);

/* The claims of a step of that shape: row blocks by groups of panels. */
long gradserve_fused_step_claims(long batch, long units) {
    return blocks_of(batch) * groups_of(units);
}

/* A team of ``threads`` (the caller and threads - 1 workers), or NULL where no worker
 * could be started (the caller then computes alone: the same bits). The workers block
 * every signal, so that the process's signals go to the threads that handle them. */
struct fused_team *gradserve_fused_team_start(long threads) {
    if (threads < 2) return NULL;
    struct fused_team *t = calloc(1, sizeof *t + (size_t)(threads - 1) * sizeof t->members[0]);
    if (t == NULL) return NULL;
    if (pthread_mutex_init(&t->lock, NULL) != 0) {
        free(t);
        return NULL;
    }
    if (pthread_cond_init(&t->wake, NULL) != 0) {
        pthread_mutex_destroy(&t->lock);
        free(t);
        return NULL;
    }
    sigset_t all, was;
    sigfillset(&all);
    pthread_sigmask(SIG_SETMASK, &all, &was);
    for (long k = 0; k < threads - 1; k++) {
        t->members[k].team = t;
        if (pthread_create(&t->members[k].thread, NULL, team_worker, &t->members[k]) != 0) break;
        t->started++;
    }
    pthread_sigmask(SIG_SETMASK, &was, NULL);
    if (t->started == 0) {
        gradserve_fused_team_stop(t);
        return NULL;
    }
    return t;
}

void gradserve_fused_team_stop(struct fused_team *t) {
    if (t == NULL) return;
    __atomic_store_n(&t->stop, 1, __ATOMIC_RELEASE);
    publish(t);
    for (long k = 0; k < t->started; k++) pthread_join(t->members[k].thread, NULL);
    pthread_cond_destroy(&t->wake);
    pthread_mutex_destroy(&t->lock);
    free(t);
}

static void run_team_step(struct fused_team *team, long claims);

/* One step of FUSED into the seven outputs [batch, units]: z = (bias + proj) + h_last @
 * W_h, bias and proj as ``gradserve_lstm_forward_step_f32`` takes them (the projection
 * always given: a zero GEMM's where there are no inputs), packed W_h's rows (``gradserve_lstm_pack_f32``), h_last [batch,
 * units] contiguous. By ``team``'s members where it is not NULL
 * (``gradserve_fused_team_start``), else by the caller alone. */
static void fused_forward_step(
    struct fused_team *team, const float *restrict h_last, const float *restrict packed,
    const float *restrict proj, long proj_stride, const float *restrict bias,
    const float *restrict c_last, const float *restrict peep,
    long batch, long units, long off_i, long off_f, long off_c, long off_o,
    float cell_clip,
    float *restrict out_i, float *restrict out_cs, float *restrict out_f,
    float *restrict out_o, float *restrict out_ci, float *restrict out_co,
    float *restrict out_h)
{
    const struct fused_step step = {
        h_last, packed, proj, bias, c_last, peep, proj_stride, batch, units,
        {off_i, off_f, off_c, off_o}, cell_clip,
        out_i, out_cs, out_f, out_o, out_ci, out_co, out_h,
    };
    if (team == NULL) {
        const long panels = panels_of(units), group = cache_group_panels(units);
        for (long p0 = 0; p0 < panels; p0 += group)
            tiles_of_step(&step, 0, blocks_of(batch), p0, p0 + group < panels ? p0 + group : panels);
        return;
    }
    team->step = step;
    team->backward = 0;
    run_team_step(team, gradserve_fused_step_claims(batch, units));
}

/* Steps 0 .. steps - 1 of FUSED, one after another (``fused_forward_step``): step t
 * reads proj's rows t * batch .. (t + 1) * batch - 1 (proj_stride floats apart), h_last
 * and c_last from h0 and c0 at t = 0, else from step t - 1's out_h and out_cs, and
 * writes the outputs' rows of step t ([steps, batch, units] each, contiguous). One call
 * for several steps: a call per step from Python cost about 5 us a step (a quarter of
 * a step at (500, 8, 128)); the caller checks for cancellation between calls. */
void gradserve_lstm_forward_fused_steps_f32(
    struct fused_team *team, long steps, const float *h0, const float *c0,
    const float *packed, const float *proj, long proj_stride, const float *bias,
    const float *peep, long batch, long units, long off_i, long off_f, long off_c,
    long off_o, float cell_clip, float *out_i, float *out_cs, float *out_f, float *out_o,
    float *out_ci, float *out_co, float *out_h)
{
    const long row = batch * units;
    for (long t = 0; t < steps; t++) {
        const long at = t * row;
        fused_forward_step(
            team, t == 0 ? h0 : out_h + at - row, packed,
            proj + t * batch * proj_stride, proj_stride, bias,
            t == 0 ? c0 : out_cs + at - row, peep, batch, units, off_i, off_f, off_c, off_o,
            cell_clip, out_i + at, out_cs + at, out_f + at, out_o + at, out_ci + at,
            out_co + at, out_h + at);
    }
}

/* The step stored in ``team`` (``backward`` says which) by its members, the caller one
 * of them; returns once every claim is done and the step is closed. */
static void run_team_step(struct fused_team *team, long claims) {
    __atomic_store_n(&team->claims, claims, __ATOMIC_RELEASE);
    __atomic_store_n(&team->done, 0, __ATOMIC_RELAXED);
    TEAM_DELAY(20000); /* the caller slow to publish the step it stored */
    const unsigned long long generation = publish(team);
    take_tiles(team, generation);
    /* the workers' last panels: spun for, the core offered every YIELD_ROUNDS (a
     * worker preempted on this core, mid-panel, finishes only when this thread gives
     * the core up; spinning long before doing so cost up to 0.1 ms a step) */
    for (long spin = 1; __atomic_load_n(&team->done, __ATOMIC_ACQUIRE) < claims; spin++) {
        if (spin % YIELD_ROUNDS) cpu_relax();
        else sched_yield();
    }
    /* closed: a member late for this step takes nothing now, whatever comes next */
    __atomic_store_n(&team->ticket, generation << 32 | CLOSED, __ATOMIC_SEQ_CST);
}

/* One step t of FUSED's backward, t below the last: dh = dgates_next @ W_h^T (the
 * gate gradients of step t + 1, [batch, 4 units] contiguous; packed: W_h^T,
 * ``gradserve_lstm_pack_transposed_f32``), then as ``gradserve_lstm_backward_step_f32``
 * with that dh (not written back): step t's gate gradients into dgates and dcs, the
 * carry, updated in place. Where i is NULL, the product alone, into dh ([batch, units]:
 * the gradient of h_prev after step 0; the other step arguments unused). By ``team``'s
 * members where it is not NULL, else by the caller alone: each tile by one member, in
 * one order, the same bits either way. */
void gradserve_lstm_backward_fused_step_f32(
    struct fused_team *team, const float *restrict dgates_next, const float *restrict packed,
    const float *restrict i, const float *restrict f, const float *restrict o,
    const float *restrict ci, const float *restrict co, const float *restrict cs,
    const float *restrict cs_last, const float *restrict h_grad,
    const float *restrict cs_grad, const float *restrict peep, int clip, float clip_at,
    long batch, long units, long off_i, long off_f, long off_c, long off_o,
    float *restrict dcs, float *restrict dgates, float *restrict dh)
{
    if (batch <= 0 || units <= 0) return; /* no element: nothing to compute */
    const struct backward_step step = {
        dgates_next, packed, i, f, o, ci, co, cs, cs_last, h_grad, cs_grad, peep, clip,
        clip_at, batch, units, {off_i, off_f, off_c, off_o}, dcs, dgates, dh,
    };
    if (team == NULL) {
        const long panels = transposed_panels_of(units), group = backward_group_panels(units);
        for (long p0 = 0; p0 < panels; p0 += group)
            backward_tiles_of_step(&step, 0, blocks_of(batch), p0,
                                   p0 + group < panels ? p0 + group : panels);
        return;
    }
    team->back = step;
    team->backward = 1;
    run_team_step(team, gradserve_backward_fused_step_claims(batch, units));
}

/* Steps t_from, t_from - 1, .., t_from - steps + 1 of FUSED's backward recurrence, one
 * after another, each ``gradserve_lstm_backward_fused_step_f32``'s (dh NULL): step t
 * reads dgates' rows of step t + 1 and writes its own ([T, batch, 4 units]); the
 * activations and output gradients are [T, batch, units] (step t's rows), cs_last
 * cs_prev at t = 0, else cs's rows of t - 1. Several steps a call, as the forward's
 * (``gradserve_lstm_forward_fused_steps_f32``). */
void gradserve_lstm_backward_fused_steps_f32(
    struct fused_team *team, long t_from, long steps, const float *packed, const float *i,
    const float *f, const float *o, const float *ci, const float *co, const float *cs,
    const float *cs_prev, const float *h_grad, const float *cs_grad, const float *peep,
    int clip, float clip_at, long batch, long units, long off_i, long off_f, long off_c,
    long off_o, float *dcs, float *dgates)
{
    const long row = batch * units, gates_row = 4 * row;
    for (long t = t_from; t > t_from - steps; t--) {
        const long at = t * row;
        gradserve_lstm_backward_fused_step_f32(
            team, dgates + (t + 1) * gates_row, packed, i + at, f + at, o + at, ci + at,
            co + at, cs + at, t == 0 ? cs_prev : cs + at - row, h_grad + at, cs_grad + at,
            peep, clip, clip_at, batch, units, off_i, off_f, off_c, off_o, dcs,
            dgates + t * gates_row, NULL);
    }
}
