// Every layer type instantiated with the macros PyTorch's extension builds define, which remove
// the implicit __half / __nv_bfloat16 conversions and operators: qbl must build inside a torch
// extension. Compiled, not run.
#include <qbl/qbl.cuh>

#if !defined(__CUDA_NO_HALF_CONVERSIONS__) || !defined(__CUDA_NO_BFLOAT16_CONVERSIONS__)
#error "build this file with PyTorch's __CUDA_NO_*_CONVERSIONS__ macros"
#endif

template class qbl::QuantBlendLinear<float>;
template class qbl::QuantBlendLinear<__nv_bfloat16>;
template class qbl::QuantBlendLinear<__half>;
template class qbl::QuantBlendLinear<float, __nv_bfloat16>;
template class qbl::QuantBlendLinear<float, __nv_bfloat16, __nv_bfloat16>;
template class qbl::QuantBlendLinear<float, __half>;
template class qbl::QuantBlendLinear<float, __half, __half>;
template cudaError_t qbl::amax<__nv_bfloat16>(const __nv_bfloat16*, std::int64_t, float*,
                                              cudaStream_t);
template cudaError_t qbl::amax<__half>(const __half*, std::int64_t, float*, cudaStream_t);
