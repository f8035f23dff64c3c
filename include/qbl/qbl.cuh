// qbl/qbl.cuh -- umbrella header: everything in qbl.
//
//   #include <qbl/qbl.cuh>
//   qbl::QuantBlendLinear<float> layer(in_features, out_features, max_tokens);
//   layer.forward(d_x, d_logits, d_weight, d_bias, d_out, tokens, stream);
#pragma once

#include <qbl/detail/config.cuh>  // first: it stops a non-CUDA compile with one clear error

#include <qbl/activation.cuh>
#include <qbl/amax.cuh>
#include <qbl/bias_grad.cuh>
#include <qbl/element_math.hpp>
#include <qbl/error.hpp>
#include <qbl/gemm.cuh>
#include <qbl/layer_plans.cuh>
#include <qbl/options.hpp>
#include <qbl/quant_blend.cuh>
#include <qbl/quant_blend_backward.cuh>
#include <qbl/quant_blend_linear.cuh>
#include <qbl/types.hpp>
#include <qbl/version.hpp>
