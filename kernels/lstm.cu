// Fused elementwise steps of the block LSTM (TensorFlow's BlockLSTM/BlockLSTMV2).
//
// The GEMMs (input projection for all steps, h_prev @ W_h per step, and the
// backward's dgates @ W^T) run in cuBLAS; these kernels do everything else of
// one time step in a single pass over the [batch, units] cells.
//
// Layout: `gates` rows are [batch, 4*units]; the gate g of unit j sits at
// column off_g + j, where (off_i, off_f, off_c, off_o) are
//   IFCO (BlockLSTMV2): (0, H, 2H, 3H)
//   ICFO (BlockLSTM):   (0, 2H, H, 3H)
// Cell arrays are [batch, units] with the unit index fastest, so consecutive
// threads touch consecutive addresses (coalesced).
//
// Launch: 1-D, any grid (grid-stride loop). Templated on the element type
// (float, double; float16 computes as float32 in the caller).
//
// This file is also compiled on the CPU by tests/kernels/host_shim.cpp, which
// defines __global__/__device__ and the thread indices before including it.

template <typename T>
__device__ __forceinline__ T lstm_sigmoid(T x) {
  // Overflow-free: tanh saturates where exp would overflow.
  return T(0.5) * tanh(T(0.5) * x) + T(0.5);
}

template <typename T>
__device__ __forceinline__ T lstm_clip(T x, T limit) {
  return x < -limit ? -limit : (x > limit ? limit : x);
}

// Forward step t, in place. On entry i_out, f_out, ci_out, o_out hold this
// step's input projection x[t] @ W_x of their gate (one GEMM for all steps);
// gates_h = h_prev @ W_h (this step's GEMM), b the [4*units] bias. Each thread
// reads its cell's projections before writing the activations over them.
template <typename T>
__global__ void lstm_fwd_step(const T* __restrict__ gates_h, const T* __restrict__ b,
                              const T* __restrict__ cs_prev, const T* __restrict__ wci,
                              const T* __restrict__ wcf, const T* __restrict__ wco,
                              T* __restrict__ i_out, T* __restrict__ cs_out,
                              T* __restrict__ f_out, T* __restrict__ o_out,
                              T* __restrict__ ci_out, T* __restrict__ co_out,
                              T* __restrict__ h_out, const int batch, const int units,
                              const int off_i, const int off_f, const int off_c,
                              const int off_o, const T forget_bias, const T cell_clip,
                              const int use_peephole) {
  const long long n = (long long)batch * units;
  const long long stride = (long long)blockDim.x * gridDim.x;
  for (long long idx = (long long)blockIdx.x * blockDim.x + threadIdx.x; idx < n;
       idx += stride) {
    const long long row = (idx / units) * 4LL * units;
    const int j = (int)(idx % units);
    const T c_prev = cs_prev[idx];
    // Summed in the NumPy backend's order: x-part + (h-part + bias).
    T pre_i = i_out[idx] + (gates_h[row + off_i + j] + b[off_i + j]);
    T pre_f = f_out[idx] + (gates_h[row + off_f + j] + b[off_f + j]) + forget_bias;
    const T pre_c = ci_out[idx] + (gates_h[row + off_c + j] + b[off_c + j]);
    T pre_o = o_out[idx] + (gates_h[row + off_o + j] + b[off_o + j]);
    if (use_peephole) {
      pre_i += c_prev * wci[j];
      pre_f += c_prev * wcf[j];
    }
    const T ig = lstm_sigmoid(pre_i);
    const T fg = lstm_sigmoid(pre_f);
    const T cig = tanh(pre_c);
    T c = ig * cig + fg * c_prev;
    if (cell_clip > T(0)) c = lstm_clip(c, cell_clip);
    const T coa = tanh(c);
    if (use_peephole) pre_o += c * wco[j];  // the new, clipped cell state
    const T og = lstm_sigmoid(pre_o);
    i_out[idx] = ig;
    f_out[idx] = fg;
    ci_out[idx] = cig;
    cs_out[idx] = c;
    co_out[idx] = coa;
    o_out[idx] = og;
    h_out[idx] = og * coa;
  }
}

// Backward step t. dh_carry = dgates[t+1] @ W_h^T (zeros at the last step);
// dcs_carry holds the cell-state gradient from step t+1 and is overwritten
// with the one for step t-1. Writes this step's gate gradients into dgates.
// The forward's cell clip is ignored here, as TensorFlow ignores it.
template <typename T>
__global__ void lstm_bwd_step(const T* __restrict__ cs_prev, const T* __restrict__ i,
                              const T* __restrict__ f,
                              const T* __restrict__ o, const T* __restrict__ ci,
                              const T* __restrict__ co, const T* __restrict__ cs_grad,
                              const T* __restrict__ h_grad, const T* __restrict__ dh_carry,
                              T* __restrict__ dcs_carry, const T* __restrict__ wci,
                              const T* __restrict__ wcf, const T* __restrict__ wco,
                              T* __restrict__ dgates, const int batch, const int units,
                              const int off_i, const int off_f, const int off_c,
                              const int off_o, const int use_peephole) {
  const long long n = (long long)batch * units;
  const long long stride = (long long)blockDim.x * gridDim.x;
  for (long long idx = (long long)blockIdx.x * blockDim.x + threadIdx.x; idx < n;
       idx += stride) {
    const long long row = (idx / units) * 4LL * units;
    const int j = (int)(idx % units);
    const T one = T(1);
    const T ig = i[idx], fg = f[idx], og = o[idx], cig = ci[idx], coa = co[idx];
    const T dh = dh_carry[idx] + h_grad[idx];
    const T d_o = og * (one - og) * dh * coa;
    T dcs = (one - coa * coa) * dh * og + dcs_carry[idx] + cs_grad[idx];
    if (use_peephole) dcs += d_o * wco[j];
    const T dci = (one - cig * cig) * dcs * ig;
    const T df = fg * (one - fg) * dcs * cs_prev[idx];
    const T di = ig * (one - ig) * dcs * cig;
    dgates[row + off_i + j] = di;
    dgates[row + off_f + j] = df;
    dgates[row + off_c + j] = dci;
    dgates[row + off_o + j] = d_o;
    T carry = dcs * fg;
    if (use_peephole) carry += di * wci[j] + df * wcf[j];
    dcs_carry[idx] = carry;
  }
}
