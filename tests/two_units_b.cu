#include <qbl/qbl.cuh>

template cudaError_t qbl::amax_quant_blend<float>(const float*, const float*, float*, std::int64_t,
                                                  std::int64_t, float*, float*, void*,
                                                  cudaStream_t);
template class qbl::QuantBlendLinear<float, __nv_bfloat16, __nv_bfloat16>;

int run_unit_b() { return static_cast<int>(qbl::abs_bits(-2.0f) >> 23); }
