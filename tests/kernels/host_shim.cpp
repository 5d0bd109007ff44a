// Runs kernels/lstm.cu on the CPU: a loop over a (deliberately small) grid, so
// that the same source the GPU runs is checked against NumPy in CI.
#include <cmath>

struct Dim3 {
  unsigned x, y, z;
};
static Dim3 blockIdx, threadIdx, blockDim, gridDim;

#define __global__
#define __device__
#define __forceinline__ inline
using std::tanh;

#include "lstm.cu"

// Two blocks of 32 threads: every launch exercises the grid-stride loop.
template <typename Launch>
static void run_grid(Launch launch) {
  gridDim = {2, 1, 1};
  blockDim = {32, 1, 1};
  for (unsigned b = 0; b < gridDim.x; ++b)
    for (unsigned t = 0; t < blockDim.x; ++t) {
      blockIdx = {b, 0, 0};
      threadIdx = {t, 0, 0};
      launch();
    }
}

#define SHIM(T)                                                                               \
  extern "C" void fwd_step_##T(const T* gh, const T* b, const T* cs_prev, const T* wci,       \
                               const T* wcf, const T* wco, T* i, T* cs, T* f, T* o, T* ci,   \
                               T* co, T* h, int batch, int units, int oi, int of, int oc,     \
                               int oo, T forget_bias, T cell_clip, int use_peephole) {        \
    run_grid([&] {                                                                            \
      lstm_fwd_step<T>(gh, b, cs_prev, wci, wcf, wco, i, cs, f, o, ci, co, h, batch, units, \
                       oi, of, oc, oo, forget_bias, cell_clip, use_peephole);                 \
    });                                                                                       \
  }                                                                                           \
  extern "C" void bwd_step_##T(const T* cs_prev, const T* i, const T* f, const T* o,          \
                               const T* ci, const T* co, const T* cs_grad, const T* h_grad,  \
                               const T* dh, T* dcs, const T* wci, const T* wcf, const T* wco, \
                               T* dgates, int batch, int units, int oi, int of, int oc,       \
                               int oo, int use_peephole) {                                    \
    run_grid([&] {                                                                            \
      lstm_bwd_step<T>(cs_prev, i, f, o, ci, co, cs_grad, h_grad, dh, dcs, wci, wcf, wco,    \
                       dgates, batch, units, oi, of, oc, oo, use_peephole);                   \
    });                                                                                       \
  }

SHIM(float)
SHIM(double)
