// Half of a program whose two translation units both include all of qbl: a non-inline function
// in a header would fail to link here.
#include <qbl/qbl.cuh>

#include <cstdio>

int run_unit_b();

int main() {
  qbl::detail::device_buffer empty;  // instantiates nothing on the device
  std::printf("qbl %d: two translation units linked (%d)\n", QBL_VERSION, run_unit_b());
  return empty.get() == nullptr ? 0 : 1;
}

// Instantiate the device code in both units.
template cudaError_t qbl::amax_quant_blend<float>(const float*, const float*, float*, std::int64_t,
                                                  std::int64_t, float*, float*, void*,
                                                  cudaStream_t);
template class qbl::QuantBlendLinear<float, __nv_bfloat16, __nv_bfloat16>;
