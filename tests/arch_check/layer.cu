// Compiled for every GPU architecture from sm_75 up (QBL_ARCH_CHECK), never run: the layer's
// forward and backward in each element type, so that every kernel they launch -- amax, the
// quant-blend paths, the backward, the fallback GEMM -- is instantiated for the architecture.
// QBL_ARCH_CHECK_TYPE picks one type per translation unit, so the three compile in parallel.
#include <qbl/qbl.cuh>

#ifndef QBL_ARCH_CHECK_TYPE
#define QBL_ARCH_CHECK_TYPE float
#endif

using T = QBL_ARCH_CHECK_TYPE;

template class qbl::QuantBlendLinear<T>;

// Called by nothing; its calls make sure the public entry points are the ones instantiated.
void qbl_arch_check_run(const T* x, const T* logits, const T* w, const T* b, T* out, T* mixed,
                        float* stats, const T* grad_out, T* grad_x, cudaStream_t stream) {
  qbl::Options opt;
  opt.backward = true;
  qbl::QuantBlendLinear<T> layer(64, 32, 16, opt);
  layer.forward(x, logits, w, b, out, 16, stream);
  layer.forward(x, logits, w, b, out, 16, mixed, stats, stream);
  typename qbl::QuantBlendLinear<T>::Gradients g;
  g.x = grad_x;
  layer.backward(grad_out, x, logits, w, mixed, stats, 16, g, stream);
}
