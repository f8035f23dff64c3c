// bench_train.cuh -- qbl_bench's training items: QuantBlendLinear<T>'s forward + backward next to
// a floor made of bare cuBLASLt products (bench_gemm.hpp). Their results go into Row::train
// (bench_results.hpp).
//
// Items, timed side by side with the forward's items of the same shape and dtype (one round
// robin, same warm-up, same median of per-run event times):
//   train        one forward writing caller-provided `mixed` and `stats` buffers, as a framework
//                keeps them per call, then one backward computing all four gradients (x, logits,
//                weight, bias; accumulate = false, QuantGrad::zero), on one QuantBlendLinear<T>
//                built with Options::backward (and allow_tf32 for tf32), the backward plan making
//                its own choices for the shape. x and logits rotate over the forward's input
//                sets. grad_out is ONE fixed random tensor: in training it is consumed right after
//                the next layer's backward produced it, so it need not come cold from HBM.
//                mixed/stats are one fixed pair, written by the run's own forward.
//   train_overlap, train_serial
//                the same forward, then the backward on a qbl::BackwardPlan<T> built with
//                Options::overlap_wgrad = yes, run with the harness's qbl::SideStream (wgrad beside
//                dgrad) or with none (wgrad after dgrad on the one stream) -- the measurement that
//                the plan's choice of where wgrad runs is held to
//   train_graph  the same forward + backward captured into a CUDA graph per input set and
//                replayed (launch-bound shapes only, as the forward's `graph`)
//   bwd_elementwise
//                qbl::quant_blend_backward alone: grad_x and grad_logits from bare_dgrad's g_mixed
//   column_sum   qbl::bias_grad alone, with its workspace: grad_bias from grad_out
//   bare_dgrad   cuBLASLt NN: g_mixed[t, i] = sum_o g[t, o] W[o, i]; A, B, D in T, fp32 compute
//                and scale (TF32 compute for tf32), no epilogue
//   bare_wgrad   cuBLASLt NT: grad_W[o, i] = sum_t g[t, o] mixed[t, i], no epilogue
// Both bare products are set up as the forward's bare GEMM: default preferences besides the 32 MiB
// workspace (and split-K partials reduced in fp32 only for 16-bit T), cuBLASLt's first heuristic
// result, operands from cudaMalloc (256-byte aligned), g and W never rotating.
//
// train floor = forward floor (bare GEMM + 2 * tokens * D * E B at copy bandwidth)
//               + bare_dgrad + bare_wgrad
//               + tokens * D * E B at copy bandwidth (the bias gradient reads grad_out once)
//               + 3 * tokens * D * E B at copy bandwidth (the backward's elementwise stage reads
//                 g_mixed and x once and writes grad_x once).
// That is the cheapest way to the step's outputs measured here, and the simplest: cuBLASLt's
// BGRADB epilogue, which would fold the bias gradient into bare_wgrad, was cheaper than the
// product without it plus that one read at one shape and dtype of 21 only, by less than
// repeating a step moves (benchmarks/HISTORY.md, "The bias gradient's source"), so the floor
// times no BGRADB product.
//
// Check before timing, on input set 0: out, mixed and the four gradients are poisoned (all bits
// set: a NaN in every dtype), one forward + backward runs, and then no element may still hold the
// poison or be non-finite; `mixed` must be bit-equal to the plain forward's; grad_weight is
// compared with bare_wgrad's output on the same operands, grad_bias with a host fp64 sum of
// grad_out, and grad_x with qbl::grad_x_value applied on the host to bare_dgrad's g_mixed (alpha
// from the host's expf, which may differ from the device's in the last place) -- each as
// max|diff| / max|ref|. train_overlap's and train_serial's four gradients must equal train's bit
// for bit (where wgrad runs does not change a bit). The check reports; it does not stop the run.
#pragma once

#include <qbl/qbl.cuh>

#include <cuda_runtime.h>

#include <cinttypes>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <functional>
#include <string>
#include <type_traits>
#include <vector>

#include "bench_check.hpp"
#include "bench_gemm.hpp"
#include "bench_inputs.cuh"
#include "bench_memory.hpp"
#include "bench_report.hpp"
#include "bench_results.hpp"
#include "bench_timing.hpp"

namespace {

using qbl::detail::from_float;  // element <-> float through the named intrinsics
using qbl::detail::to_float;

template <typename T>
std::vector<T> download(const T* d, std::size_t count) {
  std::vector<T> h(count);
  CUDA_CHECK(cudaMemcpy(h.data(), d, count * sizeof(T), cudaMemcpyDeviceToHost));
  return h;
}

// max|a - ref| / max|ref| (max|a - ref| when ref is all zero); NaN if any difference is NaN.
template <typename T>
double max_rel_diff(const std::vector<T>& a, const std::vector<T>& ref) {
  double max_diff = 0.0, max_ref = 0.0;
  for (std::size_t i = 0; i < a.size() && i < ref.size(); ++i) {
    const double r = to_float(ref[i]);
    const double diff = std::fabs(static_cast<double>(to_float(a[i])) - r);
    if (std::isnan(diff)) return NAN;
    max_diff = std::max(max_diff, diff);
    max_ref = std::max(max_ref, std::fabs(r));
  }
  return max_ref > 0.0 ? max_diff / max_ref : max_diff;
}

// Elements still holding the poison (every byte 0xff), and elements that are not finite.
template <typename T>
void count_bad(const std::vector<T>& v, std::int64_t& unwritten, std::int64_t& nonfinite) {
  unsigned char poison[sizeof(T)];
  std::memset(poison, 0xff, sizeof poison);
  for (const T& e : v) {
    if (std::memcmp(&e, poison, sizeof(T)) == 0) ++unwritten;
    if (!std::isfinite(to_float(e))) ++nonfinite;
  }
}

// Everything the training items of one shape and dtype need. Construction builds the layer for
// training and the backward plan of train_overlap / train_serial (either may throw qbl's
// exceptions: the caller reports and skips the items) and the two bare products, and fills
// grad_out.
template <typename T>
class TrainBench {
 public:
  TrainBench(std::int64_t tokens, std::int64_t d, const T* w, const T* bias, InputSets<T> inputs,
             bool tf32, int sms, cudaStream_t stream)
      : tf32_(tf32),
        tokens_(tokens),
        d_(d),
        n_(tokens * d),
        w_(w),
        bias_(bias),
        inputs_(inputs),
        stream_(stream),
        layer_(d, d, tokens, training_options(tf32)),
        beside_(d, d, tokens, training_options(tf32, qbl::Choice::yes)),
        beside_ws_(beside_.workspace_bytes(tokens)),
        g_(bytes(n_)),
        out_(bytes(n_)),
        mixed_(bytes(n_)),
        stats_(qbl::stats_floats * sizeof(float)),
        grad_x_(bytes(n_)),
        grad_logits_(bytes(tokens)),
        grad_w_(bytes(d * d)),
        grad_b_(bytes(d)),
        ref_g_mixed_(bytes(n_)),
        ref_grad_w_(bytes(d * d)),
        scratch_x_(bytes(n_)),
        scratch_logits_(bytes(tokens)),
        scratch_b_(bytes(d)),
        column_ws_(qbl::bias_grad_workspace_bytes(d)),
        dgrad_(dgrad_spec(d, d, tokens), compute_type(tf32)),
        wgrad_(wgrad_spec(d, d, tokens), compute_type(tf32)) {
    if (!dgrad_.found()) {
      die("bare_dgrad", "cuBLASLt offers no algorithm for the NN product", __FILE__, __LINE__);
    }
    if (!wgrad_.found()) {
      die("bare_wgrad", "cuBLASLt offers no algorithm for the NT product", __FILE__, __LINE__);
    }
    fill_randn(g_.as<T>(), n_, 6, 1.0f, sms, stream_);
    CUDA_CHECK(cudaStreamSynchronize(stream_));
  }
  ~TrainBench() {
    cudaStreamSynchronize(stream_);  // no replay may still run; nothing to act on if this fails
    for (cudaGraphExec_t g : graphs_) cudaGraphExecDestroy(g);  // before layer_ goes
  }
  TrainBench(const TrainBench&) = delete;
  TrainBench& operator=(const TrainBench&) = delete;

  // The check on input set 0 (see the header comment); `plain_mixed` is the plain forward's
  // `mixed` of set 0. Fills the check fields of `row` and prints them.
  void check(const char* dt, const T* plain_mixed, TrainRow& row) {
    row.dgrad_algo = dgrad_.describe();
    row.wgrad_algo = wgrad_.describe();
    row.tolerance = std::is_same_v<T, float> && !tf32_ ? 1e-4 : 1e-2;
    row.overlaps = layer_.backward_plan()->overlaps(tokens_);
    for (const DeviceBuffer* b : {&out_, &mixed_, &grad_x_, &grad_logits_, &grad_w_, &grad_b_,
                                  &ref_g_mixed_, &ref_grad_w_}) {
      CUDA_CHECK(cudaMemsetAsync(b->as<void>(), 0xff, b->bytes(), stream_));
    }
    // train_overlap's and train_serial's first: where wgrad runs changes no bit of the gradients.
    std::vector<unsigned char> variant_bytes[2];
    for (int v = 0; v < 2; ++v) {
      step(v == 0 ? Backward::beside : Backward::serial, 0);
      CUDA_CHECK(cudaStreamSynchronize(stream_));
      variant_bytes[v] = gradient_bytes();
    }
    step(Backward::layer, 0);
    dgrad_.run(w_, g_.as<T>(), ref_g_mixed_.as<T>(), stream_);
    wgrad_.run(mixed_.as<T>(), g_.as<T>(), ref_grad_w_.as<T>(), stream_);
    CUDA_CHECK(cudaStreamSynchronize(stream_));

    const auto n = static_cast<std::size_t>(n_), t = static_cast<std::size_t>(tokens_),
               dd = static_cast<std::size_t>(d_);
    row.unwritten = row.nonfinite = 0;
    {
      const std::vector<T> mixed = download(mixed_.as<T>(), n);
      const std::vector<T> plain = download(plain_mixed, n);
      row.mixed_bit_equal = std::memcmp(mixed.data(), plain.data(), n * sizeof(T)) == 0;
    }
    count_bad(download(out_.as<T>(), n), row.unwritten, row.nonfinite);
    count_bad(download(grad_logits_.as<T>(), t), row.unwritten, row.nonfinite);
    {
      const std::vector<T> grad_w = download(grad_w_.as<T>(), dd * dd);
      count_bad(grad_w, row.unwritten, row.nonfinite);
      row.grad_weight_rel_diff = max_rel_diff(grad_w, download(ref_grad_w_.as<T>(), dd * dd));
    }
    {
      const std::vector<T> grad_b = download(grad_b_.as<T>(), dd);
      count_bad(grad_b, row.unwritten, row.nonfinite);
      row.grad_bias_rel_diff = max_rel_diff(grad_b, host_bias_grad());
    }
    {
      const std::vector<T> grad_x = download(grad_x_.as<T>(), n);
      count_bad(grad_x, row.unwritten, row.nonfinite);
      row.grad_x_rel_diff = max_rel_diff(grad_x, host_grad_x());
    }
    const std::vector<unsigned char> mine = gradient_bytes();
    row.variants_bit_equal = variant_bytes[0] == mine && variant_bytes[1] == mine;
    std::printf("  %-4s train check: %" PRId64 " output elements unwritten, %" PRId64
                " non-finite; mixed bit-equal to the forward's: %s; max rel diff (max|diff| / "
                "max|ref|) grad_x %.3g, grad_weight %.3g, grad_bias %.3g (tolerance %.0e); wgrad "
                "beside and after dgrad bit-equal: %s: %s\n",
                dt, row.unwritten, row.nonfinite, row.mixed_bit_equal ? "yes" : "no",
                row.grad_x_rel_diff, row.grad_weight_rel_diff, row.grad_bias_rel_diff,
                row.tolerance, row.variants_bit_equal ? "yes" : "NO",
                row.check_ok() ? "ok" : "CHECK FAILED");
    // What the layer itself runs: cuBLASLt (and which algorithm) or its fallback kernel, and the
    // backward plan's choices.
    const qbl::BackwardPlan<T>& bp = *layer_.backward_plan();
    const qbl::GemmPlan<T>& dp = bp.dgrad();
    const qbl::GemmPlan<T>& wp = bp.wgrad();
    const bool d_lt = dp.uses_cublaslt(w_, g_.as<T>(), grad_x_.as<T>(), nullptr, tokens_);
    const bool w_lt =
        wp.uses_cublaslt(mixed_.as<T>(), g_.as<T>(), grad_w_.as<T>(), nullptr, tokens_);
    qbl::ForwardArgs<T> fa;
    fa.weight = w_, fa.bias = bias_, fa.out = out_.as<T>(), fa.mixed = mixed_.as<T>();
    fa.tokens = tokens_;
    std::printf("  %-4s layer forward: %s (%s); dgrad: %s (%s); wgrad: %s (%s); wgrad %s dgrad\n",
                dt, layer_.uses_cublaslt(fa) ? "cuBLASLt" : "FALLBACK",
                layer_.forward_plan().gemm().describe(tokens_, bias_ != nullptr).c_str(),
                d_lt ? "cuBLASLt" : "FALLBACK", dp.describe(tokens_, false).c_str(),
                w_lt ? "cuBLASLt" : "FALLBACK", wp.describe(tokens_, false).c_str(),
                bp.overlaps(tokens_) ? "beside" : "after");
    std::printf("  %-4s bare dgrad algo: %s; bare wgrad algo: %s\n", dt, row.dgrad_algo.c_str(),
                row.wgrad_algo.c_str());
  }

  // One graph of forward + backward per input set (a graph's pointers are fixed); the replay of
  // set 0 must reproduce the direct call's four gradients bit for bit.
  void capture_graphs(std::size_t count, const char* dt, TrainRow& row) {
    for (std::size_t k = 0; k < count; ++k) {
      cudaGraph_t g = nullptr;
      cudaGraphExec_t exec = nullptr;
      CUDA_CHECK(cudaStreamBeginCapture(stream_, cudaStreamCaptureModeGlobal));
      step(Backward::layer, k);
      CUDA_CHECK(cudaStreamEndCapture(stream_, &g));
      const cudaError_t st = cudaGraphInstantiate(&exec, g, 0);
      CUDA_CHECK(cudaGraphDestroy(g));
      CUDA_CHECK(st);
      graphs_.push_back(exec);
      CUDA_CHECK(cudaGraphUpload(exec, stream_));  // the first launch would otherwise pay for it
    }
    if (graphs_.empty()) return;
    step(Backward::layer, 0);
    CUDA_CHECK(cudaStreamSynchronize(stream_));
    const std::vector<unsigned char> direct = gradient_bytes();
    CUDA_CHECK(cudaGraphLaunch(graphs_[0], stream_));
    CUDA_CHECK(cudaStreamSynchronize(stream_));
    row.graph_bit_equal = gradient_bytes() == direct;
    std::printf(
        "  %-4s train graph: %zu instantiated, replay of set 0 bit-equal to the direct "
        "call: %s\n",
        dt, graphs_.size(), row.graph_bit_equal ? "yes" : "no");
  }

  // Appends the items to `runs` (train, train_graph if captured, bare_dgrad, bare_wgrad,
  // train_overlap, train_serial, the backward's element kernel and column sum alone).
  void add_items(std::vector<std::function<void(int)>>& runs) {
    first_ = runs.size();
    ids_.clear();
    auto add = [&](TrainItem id, std::function<void(int)> f) {
      ids_.push_back(id);
      runs.push_back(std::move(f));
    };
    add(train_item, [this](int i) { step(Backward::layer, static_cast<std::size_t>(i)); });
    if (!graphs_.empty()) {
      add(train_graph_item, [this](int i) {
        CUDA_CHECK(cudaGraphLaunch(graphs_[static_cast<std::size_t>(i) % graphs_.size()], stream_));
      });
    }
    add(bare_dgrad_item,
        [this](int) { dgrad_.run(w_, g_.as<T>(), ref_g_mixed_.as<T>(), stream_); });
    add(bare_wgrad_item,
        [this](int) { wgrad_.run(mixed_.as<T>(), g_.as<T>(), ref_grad_w_.as<T>(), stream_); });
    add(train_overlap_item, [this](int i) { step(Backward::beside, static_cast<std::size_t>(i)); });
    add(train_serial_item, [this](int i) { step(Backward::serial, static_cast<std::size_t>(i)); });
    add(bwd_elementwise_item, [this](int) {
      CUDA_CHECK(qbl::quant_blend_backward(
          ref_g_mixed_.as<T>(), inputs_.x_of(0), inputs_.logits_of(0), stats_.as<float>() + 1,
          scratch_x_.as<T>(), scratch_logits_.as<T>(), tokens_, d_, qbl::QuantGrad::zero, stream_));
    });
    add(column_sum_item, [this](int) {
      CUDA_CHECK(qbl::bias_grad(g_.as<T>(), scratch_b_.as<T>(), tokens_, d_, false,
                                column_ws_.as<void>(), stream_));
    });
  }

  // Takes this object's timings out of measure_together's result and reports them.
  void collect(const std::vector<Timing>& timed, const char* dt, TrainRow& row) const {
    for (std::size_t j = 0; j < ids_.size(); ++j) {
      row.t[ids_[j]] = timed.at(first_ + j);
      report_train(dt, ids_[j], row.t[ids_[j]]);
    }
  }

 private:
  static std::size_t bytes(std::int64_t elements) {
    return static_cast<std::size_t>(elements) * sizeof(T);
  }
  static qbl::Options training_options(bool tf32, qbl::Choice overlap = qbl::Choice::by_shape) {
    qbl::Options o;
    o.backward = true;
    o.allow_tf32 = tf32;
    o.overlap_wgrad = overlap;
    return o;
  }
  static cublasComputeType_t compute_type(bool tf32) {
    return qbl::gemm_traits<T>::compute_type(training_options(tf32));
  }

  // Which backward a step runs: the layer's own (its plan's choices, its own side stream), or
  // beside_ with the harness's side stream (wgrad beside dgrad) or with none (wgrad after dgrad).
  enum class Backward { layer, beside, serial };

  // The timed step: the layer's forward into the caller buffers, then a backward from them
  // (input set k).
  void step(Backward backward, std::size_t k) {
    qbl::ForwardArgs<T> f;
    f.x = inputs_.x_of(k), f.logits = inputs_.logits_of(k), f.weight = w_, f.bias = bias_;
    f.out = out_.as<T>(), f.mixed = mixed_.as<T>(), f.stats = stats_.as<float>();
    f.tokens = tokens_;
    layer_.forward(f, stream_);
    qbl::BackwardArgs<T> b;
    b.grad_out = g_.as<T>(), b.x = f.x, b.logits = f.logits, b.weight = w_;
    b.mixed = mixed_.as<T>(), b.stats = stats_.as<float>(), b.tokens = tokens_;
    b.grad_x = grad_x_.as<T>(), b.grad_logits = grad_logits_.as<T>();
    b.grad_weight = grad_w_.as<T>(), b.grad_bias = grad_b_.as<T>();
    switch (backward) {
      case Backward::layer:
        layer_.backward(b, stream_);
        break;
      case Backward::beside:
        beside_.run(b, beside_ws_.as<void>(), &side_, stream_);
        break;
      case Backward::serial:
        beside_.run(b, beside_ws_.as<void>(), nullptr, stream_);
        break;
    }
  }

  // The four gradients' bytes, one after another.
  std::vector<unsigned char> gradient_bytes() const {
    std::vector<unsigned char> all;
    for (const DeviceBuffer* b : {&grad_x_, &grad_logits_, &grad_w_, &grad_b_}) {
      const std::size_t at = all.size();
      all.resize(at + b->bytes());
      CUDA_CHECK(cudaMemcpy(all.data() + at, b->as<void>(), b->bytes(), cudaMemcpyDeviceToHost));
    }
    return all;
  }

  // grad_bias[o] = sum_t g[t, o] in fp64, rounded to T: grad_bias's reference.
  std::vector<T> host_bias_grad() const {
    const std::vector<T> g = download(g_.as<T>(), static_cast<std::size_t>(n_));
    std::vector<double> sum(static_cast<std::size_t>(d_), 0.0);
    for (std::size_t i = 0; i < g.size(); ++i) sum[i % sum.size()] += to_float(g[i]);
    std::vector<T> r(sum.size());
    for (std::size_t o = 0; o < sum.size(); ++o) r[o] = from_float<T>(static_cast<float>(sum[o]));
    return r;
  }

  // grad_x of set 0 from bare_dgrad's g_mixed: qbl::grad_x_value per element, with the forward's
  // scale (stats[1]) and alpha = sigmoid(logit) computed on the host.
  std::vector<T> host_grad_x() const {
    const std::vector<T> g_mixed = download(ref_g_mixed_.as<T>(), static_cast<std::size_t>(n_));
    const std::vector<T> logits = download(inputs_.logits_of(0), static_cast<std::size_t>(tokens_));
    float scale = 0.0f;
    CUDA_CHECK(cudaMemcpy(&scale, stats_.as<float>() + 1, sizeof scale, cudaMemcpyDeviceToHost));
    std::vector<T> r(g_mixed.size());
    const auto d = static_cast<std::size_t>(d_);
    for (std::size_t t = 0; t < logits.size(); ++t) {
      const float alpha = qbl::sigmoid<T>(to_float(logits[t]));
      const float one_minus_alpha = qbl::one_minus<T>(alpha);
      for (std::size_t i = t * d; i < (t + 1) * d; ++i) {
        r[i] = from_float<T>(qbl::grad_x_value<T>(to_float(g_mixed[i]), alpha, one_minus_alpha,
                                                  scale, qbl::QuantGrad::zero));
      }
    }
    return r;
  }

  bool tf32_;
  std::int64_t tokens_, d_, n_;
  const T* w_;
  const T* bias_;
  InputSets<T> inputs_;
  cudaStream_t stream_;
  qbl::QuantBlendLinear<T> layer_;  // train: its own backward plan, side stream and workspace
  // train_overlap / train_serial: a plan that puts wgrad beside dgrad wherever it is given a side
  // stream, its workspace, and the side stream of the one stream the harness runs backwards on.
  qbl::BackwardPlan<T> beside_;
  DeviceBuffer beside_ws_;
  qbl::SideStream side_;
  DeviceBuffer g_, out_, mixed_, stats_;
  DeviceBuffer grad_x_, grad_logits_, grad_w_, grad_b_;
  DeviceBuffer ref_g_mixed_, ref_grad_w_;                            // the bare products' outputs
  DeviceBuffer scratch_x_, scratch_logits_, scratch_b_, column_ws_;  // the stages timed alone
  BareProduct<T> dgrad_, wgrad_;
  std::vector<cudaGraphExec_t> graphs_;
  std::size_t first_ = 0;       // index of this object's first item in measure_together's list
  std::vector<TrainItem> ids_;  // its items, in order
};

}  // namespace
