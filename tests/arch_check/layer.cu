// Compiled for every GPU architecture from sm_75 up (QBL_ARCH_CHECK), never run: the layer's
// forward and backward in each element type, so that every kernel they launch -- amax, the
// quant-blend paths, the backward, the column sum, the fallback GEMM -- is instantiated for the
// architecture. QBL_ARCH_CHECK_TYPE (x's), QBL_ARCH_CHECK_GEMM_TYPE and QBL_ARCH_CHECK_LOGITS_TYPE
// pick one combination per translation unit, so that they compile in parallel.
#include <qbl/qbl.cuh>

#ifndef QBL_ARCH_CHECK_TYPE
#define QBL_ARCH_CHECK_TYPE float
#endif
#ifndef QBL_ARCH_CHECK_GEMM_TYPE
#define QBL_ARCH_CHECK_GEMM_TYPE QBL_ARCH_CHECK_TYPE
#endif
#ifndef QBL_ARCH_CHECK_LOGITS_TYPE
#define QBL_ARCH_CHECK_LOGITS_TYPE QBL_ARCH_CHECK_TYPE
#endif

using X = QBL_ARCH_CHECK_TYPE;
using G = QBL_ARCH_CHECK_GEMM_TYPE;
using L = QBL_ARCH_CHECK_LOGITS_TYPE;
using Layer = qbl::QuantBlendLinear<X, G, L>;

template class qbl::QuantBlendLinear<X, G, L>;

// Called by nothing; its calls make sure the public entry points are the ones instantiated.
void qbl_arch_check_run(const X* x, const L* logits, const G* w, const G* b, G* out, G* mixed,
                        float* stats, const G* grad_out, X* grad_x, cudaStream_t stream) {
  qbl::Options opt;
  opt.backward = true;
  Layer layer(64, 32, 16, opt);
  layer.forward(x, logits, w, b, out, 16, stream);
  Layer::ForwardArgs f;
  f.x = x, f.logits = logits, f.weight = w, f.bias = b, f.out = out, f.mixed = mixed;
  f.stats = stats, f.tokens = 16;
  layer.forward(f, stream);
  layer.forward_local_amax(x, 16, stats, stream);
  f.amax_source = qbl::AmaxSource::stats;
  layer.forward(f, stream);
  Layer::BackwardArgs g;
  g.grad_out = grad_out, g.x = x, g.logits = logits, g.weight = w, g.mixed = mixed;
  g.stats = stats, g.tokens = 16, g.grad_x = grad_x;
  layer.backward(g, stream);
}
