// Runs one small forward when a GPU is present; says it skipped otherwise.
#include <qbl/qbl.cuh>

#include <cstdio>
#include <cstdlib>
#include <vector>

std::size_t default_workspace();

int main() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess || n == 0) {
    std::printf(
        "qbl_consumer: built and linked against qbl; no CUDA device, so no forward run "
        "(workspace default %zu)\n",
        default_workspace());
    return 0;
  }
  const int tokens = 4, in = 8, out = 8;
  std::vector<float> x(tokens * in, 0.5f), logits(tokens, 0.0f), w(out * in, 0.125f), b(out, 1.0f);
  float *dx, *dl, *dw, *db, *dout;
  cudaMalloc(&dx, x.size() * 4);
  cudaMalloc(&dl, logits.size() * 4);
  cudaMalloc(&dw, w.size() * 4);
  cudaMalloc(&db, b.size() * 4);
  cudaMalloc(&dout, tokens * out * 4);
  cudaMemcpy(dx, x.data(), x.size() * 4, cudaMemcpyHostToDevice);
  cudaMemcpy(dl, logits.data(), logits.size() * 4, cudaMemcpyHostToDevice);
  cudaMemcpy(dw, w.data(), w.size() * 4, cudaMemcpyHostToDevice);
  cudaMemcpy(db, b.data(), b.size() * 4, cudaMemcpyHostToDevice);
  qbl::QuantBlendLinear<float> layer(in, out, tokens);
  layer.forward(dx, dl, dw, db, dout, tokens);
  std::vector<float> o(tokens * out);
  cudaMemcpy(o.data(), dout, o.size() * 4, cudaMemcpyDeviceToHost);
  // x == amax everywhere: x_q == x up to rounding, so out = 8 * 0.5 * 0.125 + 1 = 1.5.
  for (float v : o) {
    if (!(v > 1.5f - 1e-5f && v < 1.5f + 1e-5f)) {
      std::printf("qbl_consumer: wrong result %g\n", v);
      return 1;
    }
  }
  std::printf("qbl_consumer: forward ok (%g)\n", o[0]);
  return 0;
}
