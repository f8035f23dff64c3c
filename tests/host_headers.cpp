// Compiled by the C++ compiler with no CUDA include directory (ctest host_headers_without_cuda):
// the host headers, the element math among them, need none of CUDA's headers.
#include <qbl/element_math.hpp>
#include <qbl/options.hpp>
#include <qbl/types.hpp>
#include <qbl/version.hpp>

#if QBL_HAS_CUDA_TYPES
#error "CUDA's headers were found: this check must compile without them"
#endif

static_assert(qbl::supported_types<float, __nv_bfloat16, float>,
              "the type list names CUDA's types");

float host_mixed(float x, float logit, float amax) {
  const float scale = qbl::scale_from_amax_cpu<float>(amax);
  return qbl::quant_blend_value<float>(x, qbl::sigmoid<float>(logit), scale) +
         qbl::grad_x_value<float>(x, 0.5f, 0.5f, scale, qbl::QuantGrad::straight_through);
}
