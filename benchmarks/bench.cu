// qbl_bench -- benchmark of qbl::QuantBlendLinear against its floor and an eager-like chain, in
// fp32, TF32, bf16 and fp16.
//
// For every shape (B, T, D) of the table below (tokens = B * T, in = out = D) and every dtype of
// --dtypes, one process times, side by side on one non-default stream:
//   forward      qbl::QuantBlendLinear<T>::forward (one object per shape and dtype,
//                max_tokens = tokens)
//   graph        the same forward captured once into a CUDA graph and replayed: the forward's
//                time without its host-side launch costs
//   amax         qbl::amax alone
//   quant_blend  qbl::quant_blend alone, given a ready d_amax
//   fused_prol.  qbl::amax_quant_blend (the prologue exactly as forward() issues it: the amax
//                kernel's per-block maxima and the quant-blend kernel as its programmatic
//                dependent, no memset)
//   gemm         qbl::GemmPlan<T> of the forward's product on a ready `mixed`, built with
//                Options::autotune (the forward runs the default: cuBLASLt's first-ranked
//                algorithm, as bare_gemm does)
//   bare_gemm    cuBLASLt set up here directly: TN, A/B/C/D in T, fp32 compute and scale,
//                EPILOGUE_BIAS, top heuristic algorithm, 32 MiB workspace -- the "GEMM floor"
//   bare_graph   the bare GEMM captured into a CUDA graph and replayed: the floor that the
//                forward's graph replay is held to (graph/bgraph)
//   eager        an unfused chain that mirrors eager PyTorch kernel by kernel (abs, max,
//                clamp_min, scale, div, round, clamp, mul, sigmoid, mul, rsub, mul, add), each
//                step its own kernel and its own temporary, then the same bare GEMM
//   copy         a 1 GiB device-to-device cudaMemcpyAsync: the bandwidth a streaming kernel can
//                hope for, measured in the same run (bytes read + bytes written over time), once
//                per shape and shared by its dtypes, so that their floors use one bandwidth
// and, unless --no-train, the training items of bench_train.cuh (its header comment defines them):
//   train        one forward into caller-provided mixed/stats + one backward computing grad_x,
//                grad_logits, grad_weight and grad_bias, on a QuantBlendLinear<T> built with
//                Options::backward (x and logits rotating, grad_out one fixed random tensor),
//                with the backward plan's own choices; train_overlap / train_serial the same
//                forward with the backward of a qbl::BackwardPlan<T> run with a qbl::SideStream
//                (wgrad beside dgrad) / with none (wgrad after dgrad)
//   train_graph  the same captured into CUDA graphs and replayed (launch-bound shapes only)
//   bwd_elementwise  qbl::quant_blend_backward alone (grad_x and grad_logits from a ready g_mixed)
//   column_sum   qbl's bias gradient alone (qbl::bias_grad with its workspace)
//   bare_dgrad   cuBLASLt NN g · W and bare_wgrad cuBLASLt NT gᵀ · mixed, both without epilogue,
//                set up as bare_gemm
//
// Dtypes (--dtypes, any of the four; default fp32,tf32,bf16), element type T:
//   fp32   float; every GEMM in CUBLAS_COMPUTE_32F (PyTorch's default fp32 matmul)
//   tf32   float; qbl built with Options::allow_tf32 and the bare GEMM in
//          CUBLAS_COMPUTE_32F_FAST_TF32 (torch.backends.cuda.matmul.allow_tf32 = True); the
//          prologue is fp32's
//   bf16   __nv_bfloat16
//   fp16   __half
// For bf16 and fp16 every tensor is in T and every element op computes in fp32 and rounds its
// result to T, as eager does; the GEMMs run on the tensor cores with fp32 accumulation, split-K
// partials reduced in fp32 only (the bare GEMM is held to the same rule as qbl's).
// For each shape the selected dtypes run one after another, so that they are measured next to
// each other.
//
// Method: bench_timing.hpp (warm-up, rounds of the items side by side, medians of per-run event
// times) and bench_inputs.cuh (inputs rotating over >= 3 x L2, random, generated on the device).
//
// Before timing, each shape and dtype is checked once: the chain's `mixed` must be bit-identical
// to QuantBlendLinear<T>::device_mixed() and its amax bit-equal; the two `out`s are compared and
// their largest relative difference reported (they differ only if cuBLASLt picked different
// algorithms for the two GEMMs: ~1e-6 in fp32, a few units in T's last place otherwise).
//
// The training items get their own check before timing (outputs poisoned and then all written and
// finite, gradients against the bare products' outputs; see bench_train.cuh).
//
// Derived numbers (floor, prologue GB/s, GEMM TFLOP/s, train floor): bench_results.hpp.
//
//   qbl_bench [--shapes 0,3,6] [--dtypes fp32,tf32,bf16,fp16] [--csv results.csv] [--md results.md]
//             [--min-ms 50] [--reps 20] [--no-graph] [--no-train] [--gemm-probe]
//
// The parts, one idea per file:
//   bench_args.hpp      command line: the shape table, dtypes, options, --help
//   bench_check.hpp     error checking: a failed CUDA / cuBLAS call ends the run
//   bench_memory.hpp    device buffers (qbl's device_buffer, counted)
//   bench_inputs.cuh    random inputs generated on the device; the rotating input sets
//   bench_timing.hpp    the timing method (RunTimer)
//   bench_gemm.hpp      the bare cuBLASLt products: the forward's GEMM floor, dgrad, wgrad
//   bench_eager.cuh     the eager-like unfused chain
//   bench_train.cuh     the training items
//   bench_results.hpp   the timed items, one result row per shape and dtype, derived numbers
//   bench_report.hpp    console lines and table, --md and --csv output
//   bench.cu            this file: one shape and dtype (bench_shape), the shape loop, main

#include <qbl/qbl.cuh>

#include <cublasLt.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cinttypes>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <exception>
#include <functional>
#include <memory>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "bench_args.hpp"
#include "bench_check.hpp"
#include "bench_eager.cuh"
#include "bench_gemm.hpp"
#include "bench_inputs.cuh"
#include "bench_memory.hpp"
#include "bench_report.hpp"
#include "bench_results.hpp"
#include "bench_timing.hpp"
#include "bench_train.cuh"

namespace {

// Shapes below this many elements are launch-bound: the training items' graph replay is timed
// for them.
constexpr std::int64_t launch_bound_elements = std::int64_t{1} << 20;
constexpr int max_graph_sets = 8192;  // one instantiated graph per rotating input set, at most

template <typename T>
inline constexpr bool is_element_type =
    std::is_same_v<T, float> || std::is_same_v<T, __nv_bfloat16> || std::is_same_v<T, __half>;

// ---- one shape, one dtype ---------------------------------------------------------------------

// Everything for one shape in element type T; `dtype` tells fp32 from tf32 when T is float.
// `copy` is this shape's copy measurement, shared by its dtypes.
template <typename T>
Row bench_shape(const Shape& shape, Dtype dtype, const GpuInfo& gpu, const Args& args,
                cudaStream_t stream, RunTimer& timer, const Timing& copy, std::size_t copy_bytes) {
  static_assert(is_element_type<T>, "T is float, __nv_bfloat16 or __half");
  Row row;
  row.shape = shape;
  row.dtype = dtype;
  row.elem_bytes = sizeof(T);
  const char* dt = row.dtype_label();
  const std::int64_t tokens = shape.b * shape.t, d = shape.d, n = tokens * d;
  row.tokens = tokens;
  const std::size_t x_bytes = static_cast<std::size_t>(n) * sizeof(T);
  const std::size_t logits_bytes = static_cast<std::size_t>(tokens) * sizeof(T);
  std::printf("-- %s %s: x %.2f MiB\n", row.label().c_str(), dt, x_bytes / 1048576.0);

  // Rotating input sets: K * bytes(x) >= 3 x L2 (and at least 2), within the rotation cap.
  // Each set starts on a 256-byte boundary, like a fresh cudaMalloc.
  const std::size_t x_stride = round_up(x_bytes, 256), l_stride = round_up(logits_bytes, 256);
  const std::size_t sets = rotating_set_count(x_bytes, x_stride, l_stride, gpu.l2_bytes);
  row.x_sets = static_cast<int>(sets);
  DeviceBuffer x_sets(sets * x_stride), logit_sets(sets * l_stride);
  const InputSets<T> inputs{x_sets.as<char>(), logit_sets.as<char>(), x_stride, l_stride, sets};

  DeviceBuffer w(static_cast<std::size_t>(d * d) * sizeof(T)),
      bias(static_cast<std::size_t>(d) * sizeof(T));
  DeviceBuffer out_fwd(x_bytes), out_chain(x_bytes), out_scratch(x_bytes);
  DeviceBuffer mixed_ready(x_bytes), mixed_scratch(x_bytes);
  DeviceBuffer amax_sets(sets * sizeof(float)), stats_scratch(2 * sizeof(float));
  DeviceBuffer prologue_ws(qbl::amax_quant_blend_workspace_bytes);
  float* amax_scratch = stats_scratch.as<float>();
  float* scale_scratch = amax_scratch + 1;

  const float bound = 1.0f / std::sqrt(static_cast<float>(d));
  fill_randn(x_sets.as<T>(), static_cast<std::int64_t>(x_sets.bytes() / sizeof(T)), 1, 1.0f,
             gpu.sms, stream);
  fill_randn(logit_sets.as<T>(), static_cast<std::int64_t>(logit_sets.bytes() / sizeof(T)), 2, 1.0f,
             gpu.sms, stream);
  fill_uniform(w.as<T>(), d * d, 3, bound, gpu.sms, stream);
  fill_uniform(bias.as<T>(), d, 4, bound, gpu.sms, stream);
  CUDA_CHECK(cudaStreamSynchronize(stream));

  const bool tf32 = dtype == Dtype::tf32;
  qbl::Options options;
  options.allow_tf32 = tf32;
  qbl::QuantBlendLinear<T> layer(d, d, tokens, options);
  // The `gemm` item is the autotuned GemmPlan: gemm/bare is what Options::autotune gains over
  // cuBLASLt's first choice (which the default forward and the bare GEMM both run).
  qbl::Options tuned = options;
  tuned.autotune = true;
  qbl::GemmPlan<T> gemm(qbl::GemmSpec::linear_forward(d, d), tokens, tuned);
  DeviceBuffer gemm_ws(gemm.workspace_bytes());
  BareGemm<T> bare(d, d, tokens, w.as<T>(), bias.as<T>(),
                   qbl::gemm_traits<T>::compute_type(options));
  EagerChain<T> chain(tokens, d, gpu.sms, bare);
  row.bare_algo = bare.describe();
  // What construction-time autotuning measured for this token count (bias epilogue).
  for (const qbl::GemmTuning& r : gemm.tuning()) {
    if (r.tokens == tokens && r.bias) {
      std::printf(
          "  %-4s autotune: %d candidates, cuBLASLt's first %.4f ms, chosen #%d %.4f ms (%.1f%% "
          "faster); %s\n",
          dt, r.candidates, r.first_ms, r.chosen, r.chosen_ms,
          100.0 * (r.first_ms - r.chosen_ms) / r.first_ms, gemm.describe(tokens, true).c_str());
    }
  }

  // ---- sanity check on set 0 ----
  layer.forward(inputs.x_of(0), inputs.logits_of(0), w.as<T>(), bias.as<T>(), out_fwd.as<T>(),
                tokens, stream);
  chain.run(inputs.x_of(0), inputs.logits_of(0), out_chain.as<T>(), stream);
  CUDA_CHECK(cudaStreamSynchronize(stream));
  {
    // Raw elements of T: bit-equality is a comparison of bytes, whatever T is.
    std::vector<T> a(static_cast<std::size_t>(n)), b(static_cast<std::size_t>(n));
    CUDA_CHECK(cudaMemcpy(a.data(), layer.device_mixed(), x_bytes, cudaMemcpyDeviceToHost));
    CUDA_CHECK(cudaMemcpy(b.data(), chain.mixed(), x_bytes, cudaMemcpyDeviceToHost));
    row.mixed_bit_equal = std::memcmp(a.data(), b.data(), x_bytes) == 0;
    float amax_a = 0, amax_b = 0;
    CUDA_CHECK(cudaMemcpy(&amax_a, layer.device_amax(), sizeof(float), cudaMemcpyDeviceToHost));
    CUDA_CHECK(cudaMemcpy(&amax_b, chain.amax(), sizeof(float), cudaMemcpyDeviceToHost));
    row.amax_bit_equal = std::memcmp(&amax_a, &amax_b, sizeof(float)) == 0;
    CUDA_CHECK(cudaMemcpy(a.data(), out_fwd.as<T>(), x_bytes, cudaMemcpyDeviceToHost));
    CUDA_CHECK(cudaMemcpy(b.data(), out_chain.as<T>(), x_bytes, cudaMemcpyDeviceToHost));
    row.out_bit_equal = std::memcmp(a.data(), b.data(), x_bytes) == 0;
    // Relative to the largest |out| of the reference: elementwise relative error is meaningless
    // for outputs that cancel to ~0. A NaN anywhere makes the result NaN.
    double max_diff = 0.0, max_ref = 0.0;
    for (std::size_t i = 0; i < a.size(); ++i) {
      const double ref = qbl::detail::to_float(b[i]);
      const double diff = std::fabs(static_cast<double>(qbl::detail::to_float(a[i])) - ref);
      max_diff = std::isnan(diff) ? NAN : std::max(max_diff, diff);
      max_ref = std::max(max_ref, std::fabs(ref));
      if (std::isnan(max_diff)) break;
    }
    row.out_max_rel_diff = max_ref > 0.0 ? max_diff / max_ref : max_diff;
    std::printf(
        "  %-4s check: amax %.6g, mixed bit-equal to eager chain: %s, amax bit-equal: %s, out max "
        "rel "
        "diff %.3g (max|diff| / max|ref|), out bit-equal: %s\n",
        dt, amax_a, row.mixed_bit_equal ? "yes" : "no", row.amax_bit_equal ? "yes" : "no",
        row.out_max_rel_diff, row.out_bit_equal ? "yes" : "no");
    std::printf("  %-4s bare GEMM algo: %s; x sets: %d (%.1f MiB)\n", dt, row.bare_algo.c_str(),
                row.x_sets, x_sets.bytes() / 1048576.0);
  }
  CUDA_CHECK(cudaMemcpyAsync(mixed_ready.as<T>(), layer.device_mixed(), x_bytes,
                             cudaMemcpyDeviceToDevice, stream));
  for (std::size_t k = 0; k < sets; ++k)
    CUDA_CHECK(qbl::amax(inputs.x_of(k), n, amax_sets.as<float>() + k, stream));
  CUDA_CHECK(cudaStreamSynchronize(stream));

  // ---- CUDA graph of the forward, one per input set (a graph's pointers are fixed) ----
  auto capture_forwards = [&](qbl::QuantBlendLinear<T>& l, std::size_t count) {
    std::vector<cudaGraphExec_t> execs;
    for (std::size_t k = 0; k < count; ++k) {
      cudaGraph_t g = nullptr;
      cudaGraphExec_t exec = nullptr;
      CUDA_CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal));
      l.forward(inputs.x_of(k), inputs.logits_of(k), w.as<T>(), bias.as<T>(), out_scratch.as<T>(),
                tokens, stream);
      CUDA_CHECK(cudaStreamEndCapture(stream, &g));
      CUDA_CHECK(cudaGraphInstantiate(&exec, g, 0));
      CUDA_CHECK(cudaGraphDestroy(g));
      CUDA_CHECK(cudaGraphUpload(exec, stream));  // the first launch would otherwise pay for it
      execs.push_back(exec);
    }
    return execs;
  };
  std::vector<cudaGraphExec_t> graphs;
  if (args.graph) {
    const std::size_t g_count = std::min<std::size_t>(sets, max_graph_sets);
    row.graph_sets = static_cast<int>(g_count);
    graphs = capture_forwards(layer, g_count);
    // The replay of set 0 must reproduce the direct forward bit for bit.
    CUDA_CHECK(cudaGraphLaunch(graphs[0], stream));
    CUDA_CHECK(cudaStreamSynchronize(stream));
    std::vector<T> a(static_cast<std::size_t>(n)), b(static_cast<std::size_t>(n));
    CUDA_CHECK(cudaMemcpy(a.data(), out_scratch.as<T>(), x_bytes, cudaMemcpyDeviceToHost));
    CUDA_CHECK(cudaMemcpy(b.data(), out_fwd.as<T>(), x_bytes, cudaMemcpyDeviceToHost));
    row.graph_bit_equal = std::memcmp(a.data(), b.data(), x_bytes) == 0;
    std::printf("  %-4s graph: %zu instantiated, replay of set 0 bit-equal to forward: %s\n", dt,
                g_count, row.graph_bit_equal ? "yes" : "no");
  }
  // The bare GEMM as one graph (its operands never rotate).
  cudaGraphExec_t bare_graph = nullptr;
  if (args.graph) {
    cudaGraph_t g = nullptr;
    CUDA_CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal));
    bare.run(mixed_ready.as<T>(), out_scratch.as<T>(), stream);
    CUDA_CHECK(cudaStreamEndCapture(stream, &g));
    CUDA_CHECK(cudaGraphInstantiate(&bare_graph, g, 0));
    CUDA_CHECK(cudaGraphDestroy(g));
    CUDA_CHECK(cudaGraphUpload(bare_graph, stream));
  }
  // ---- the training items (bench_train.cuh): the layer built for training, checked, graphs ----
  std::unique_ptr<TrainBench<T>> train;
  if (args.train) {
    try {
      train = std::make_unique<TrainBench<T>>(tokens, d, w.as<T>(), bias.as<T>(), inputs, tf32,
                                              gpu.sms, stream);
    } catch (const std::exception& e) {  // qbl could not plan the backward: report, time the rest
      row.train.skipped = e.what();
      std::printf(
          "  %-4s train: SKIPPED, QuantBlendLinear with Options::backward could not be built: %s\n",
          dt, e.what());
    }
  }
  if (train) {
    train->check(dt, mixed_ready.as<T>(), row.train);
    if (args.graph && n < launch_bound_elements) {
      train->capture_graphs(std::min<std::size_t>(sets, max_graph_sets), dt, row.train);
    }
  }

  // ---- timing: every item of this shape and dtype side by side (RunTimer::measure_together) ----
  row.copy_bytes = static_cast<double>(copy_bytes);
  row.t[copy_item] = copy;
  std::vector<Item> ids;
  std::vector<std::function<void(int)>> runs;
  auto item = [&](Item i, std::function<void(int)> f) {
    ids.push_back(i);
    runs.push_back(std::move(f));
  };
  item(bare_gemm_item, [&](int) { bare.run(mixed_ready.as<T>(), out_scratch.as<T>(), stream); });
  item(gemm_item, [&](int) {
    gemm.run(w.as<T>(), mixed_ready.as<T>(), out_scratch.as<T>(), bias.as<T>(), tokens, 0.0f,
             gemm_ws.as<void>(), stream);
  });
  item(amax_item, [&](int i) {
    CUDA_CHECK(qbl::amax(inputs.x_of(static_cast<std::size_t>(i)), n, amax_scratch, stream));
  });
  item(quant_blend_item, [&](int i) {
    const auto k = static_cast<std::size_t>(i) % sets;
    CUDA_CHECK(qbl::quant_blend(inputs.x_of(k), inputs.logits_of(k), amax_sets.as<float>() + k,
                                mixed_scratch.as<T>(), tokens, d, scale_scratch, stream));
  });
  item(fused_prologue_item, [&](int i) {
    const auto k = static_cast<std::size_t>(i);
    CUDA_CHECK(qbl::amax_quant_blend(inputs.x_of(k), inputs.logits_of(k), mixed_scratch.as<T>(),
                                     tokens, d, amax_scratch, scale_scratch, prologue_ws.as<void>(),
                                     stream));
  });
  item(forward_item, [&](int i) {
    const auto k = static_cast<std::size_t>(i);
    layer.forward(inputs.x_of(k), inputs.logits_of(k), w.as<T>(), bias.as<T>(), out_fwd.as<T>(),
                  tokens, stream);
  });
  if (!graphs.empty()) {
    item(graph_item, [&](int i) {
      CUDA_CHECK(cudaGraphLaunch(graphs[static_cast<std::size_t>(i) % graphs.size()], stream));
    });
  }
  item(eager_item, [&](int i) {
    const auto k = static_cast<std::size_t>(i);
    chain.run(inputs.x_of(k), inputs.logits_of(k), out_chain.as<T>(), stream);
  });
  const std::size_t first_extra = runs.size();
  if (bare_graph != nullptr) {
    runs.push_back([&](int) { CUDA_CHECK(cudaGraphLaunch(bare_graph, stream)); });
  }
  if (train) train->add_items(runs);  // train, [train_graph], bare_dgrad, bare_wgrad, ...
  // --gemm-probe: the bare GEMM planned as qbl::GemmPlan plans it, one difference at a time, and
  // the layer's own first-ranked GEMM, on the same operands and timed with the rest.
  const std::size_t first_probe = runs.size();
  const BareQuery probes[] = {
      {4, true, false}, {1, false, false}, {1, true, true}, {4, false, true}};
  std::vector<std::unique_ptr<BareGemm<T>>> variants;
  DeviceBuffer plain_ws(args.gemm_probe ? layer.forward_plan().gemm().workspace_bytes() : 0);
  std::unique_ptr<qbl::GemmPlan<T>> plain;
  if (args.gemm_probe) {
    const cublasComputeType_t compute = qbl::gemm_traits<T>::compute_type(options);
    for (const BareQuery& q : probes) {
      variants.push_back(
          std::make_unique<BareGemm<T>>(d, d, tokens, w.as<T>(), bias.as<T>(), compute, q));
      BareGemm<T>* v = variants.back().get();
      runs.push_back([&, v](int) { v->run(mixed_ready.as<T>(), out_scratch.as<T>(), stream); });
    }
    plain =
        std::make_unique<qbl::GemmPlan<T>>(qbl::GemmSpec::linear_forward(d, d), tokens, options);
    runs.push_back([&](int) {
      plain->run(w.as<T>(), mixed_ready.as<T>(), out_scratch.as<T>(), bias.as<T>(), tokens, 0.0f,
                 plain_ws.as<void>(), stream);
    });
  }
  const std::vector<Timing> timed = timer.measure_together(runs);
  for (std::size_t k = 0; k < ids.size(); ++k) {
    row.t[ids[k]] = timed[k];
    report(dt, ids[k], timed[k]);
  }
  if (bare_graph != nullptr) {
    row.bare_graph = timed[first_extra];
    std::printf("  %-4s bare_graph %.4f ms\n", dt, row.bare_graph.median_ms);
  }
  if (train) train->collect(timed, dt, row.train);
  if (args.gemm_probe) {
    std::printf("  %-4s probe bare default          %.4f ms  %s\n", dt, row.ms(bare_gemm_item),
                bare.describe_all().c_str());
    for (std::size_t v = 0; v < variants.size(); ++v) {
      std::printf("  %-4s probe bare %-20s %.4f ms  %s\n", dt, probes[v].name().c_str(),
                  timed[first_probe + v].median_ms, variants[v]->describe_all().c_str());
    }
    std::printf("  %-4s probe GemmPlan, default options %.4f ms  %s\n", dt, timed.back().median_ms,
                plain->describe(tokens, true).c_str());
  }

  CUDA_CHECK(cudaStreamSynchronize(stream));
  for (cudaGraphExec_t g : graphs) CUDA_CHECK(cudaGraphExecDestroy(g));  // before `layer` goes
  if (bare_graph != nullptr) CUDA_CHECK(cudaGraphExecDestroy(bare_graph));
  std::printf(
      "  %-4s copy %.0f GB/s, floor %.4f ms, forward/floor %.3f, eager/forward %.2f; device memory "
      "held by the harness %.2f GiB\n",
      dt, row.copy_gbps(), row.floor_ms(), row.over_floor(forward_item), row.speedup_vs_eager(),
      g_allocated_bytes / (1024.0 * 1048576.0));
  if (row.train.timed()) {
    std::printf(
        "  %-4s train floor %.4f ms (floor + bare_dgrad + bare_wgrad + 4 x tokens x D x E B at "
        "copy: one read of grad_out for the bias gradient, g_mixed and x read, grad_x written), "
        "train/floor %.3f%s\n",
        dt, row.train_floor_ms(), row.train_over_floor(train_item),
        row.train.t[train_graph_item].valid()
            ? (", train_graph/floor " + fmt("%.3f", row.train_over_floor(train_graph_item))).c_str()
            : "");
  }
  return row;
}

Row bench_dtype(const Shape& shape, Dtype dtype, const GpuInfo& gpu, const Args& args,
                cudaStream_t stream, RunTimer& timer, const Timing& copy, std::size_t copy_bytes) {
  switch (dtype) {
    case Dtype::fp32:
    case Dtype::tf32:
      return bench_shape<float>(shape, dtype, gpu, args, stream, timer, copy, copy_bytes);
    case Dtype::bf16:
      return bench_shape<__nv_bfloat16>(shape, dtype, gpu, args, stream, timer, copy, copy_bytes);
    case Dtype::fp16:
      return bench_shape<__half>(shape, dtype, gpu, args, stream, timer, copy, copy_bytes);
  }
  die("bench_dtype", "unknown dtype", __FILE__, __LINE__);
}

int run(const Args& args) {
  int count = 0;
  const cudaError_t st = cudaGetDeviceCount(&count);
  if (st != cudaSuccess || count == 0) {
    std::printf("qbl_bench: no CUDA device available (%s); nothing to benchmark.\n",
                st != cudaSuccess ? cudaGetErrorString(st) : "cudaGetDeviceCount returned 0");
    return 0;
  }
  if (args.device < 0 || args.device >= count) bad_args("--device out of range");
  CUDA_CHECK(cudaSetDevice(args.device));

  GpuInfo gpu;
  cudaDeviceProp prop{};
  CUDA_CHECK(cudaGetDeviceProperties(&prop, args.device));
  gpu.name = prop.name;
  gpu.total_mem = prop.totalGlobalMem;
  CUDA_CHECK(cudaDeviceGetAttribute(&gpu.sms, cudaDevAttrMultiProcessorCount, args.device));
  CUDA_CHECK(cudaDeviceGetAttribute(&gpu.l2_bytes, cudaDevAttrL2CacheSize, args.device));
  CUDA_CHECK(cudaDeviceGetAttribute(&gpu.cc_major, cudaDevAttrComputeCapabilityMajor, args.device));
  CUDA_CHECK(cudaDeviceGetAttribute(&gpu.cc_minor, cudaDevAttrComputeCapabilityMinor, args.device));
  CUDA_CHECK(cudaDriverGetVersion(&gpu.driver));
  CUDA_CHECK(cudaRuntimeGetVersion(&gpu.runtime));
  gpu.cublaslt = cublasLtGetVersion();
  std::printf("%s\n", gpu_line(gpu).c_str());
  std::string dtypes;
  for (Dtype d : args.dtypes) dtypes += std::string(dtypes.empty() ? "" : ",") + dtype_name(d);
  std::printf(
      "timing: median of per-run event times, >= %d runs and >= %.0f ms per item (at most %d "
      "runs); copy %zu MiB; dtypes %s\n",
      args.reps, args.min_ms, args.max_runs, args.copy_mib, dtypes.c_str());

  cudaStream_t stream = nullptr;
  CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  std::vector<Row> rows;
  {
    RunTimer timer(stream, args.min_ms, args.reps, args.max_runs);
    DeviceBuffer copy_src(args.copy_mib * mib), copy_dst(args.copy_mib * mib);
    fill_randn(copy_src.as<float>(), static_cast<std::int64_t>(copy_src.bytes() / sizeof(float)), 5,
               1.0f, gpu.sms, stream);
    CUDA_CHECK(cudaStreamSynchronize(stream));
    for (int idx : args.shapes) {
      const Shape& shape = shape_table[idx];
      std::printf("\n== shape %s: tokens %" PRId64 ", D %" PRId64 "\n", shape_label(shape).c_str(),
                  shape.b * shape.t, shape.d);
      // Once per shape, shared by its dtypes: their floors then divide by the same bandwidth.
      const Timing copy = timer.measure([&](int) {
        CUDA_CHECK(cudaMemcpyAsync(copy_dst.as<void>(), copy_src.as<void>(), copy_src.bytes(),
                                   cudaMemcpyDeviceToDevice, stream));
      });
      report("all", copy_item, copy);
      for (Dtype dtype : args.dtypes) {
        rows.push_back(bench_dtype(shape, dtype, gpu, args, stream, timer, copy, copy_src.bytes()));
      }
    }
  }
  CUDA_CHECK(cudaStreamDestroy(stream));

  print_summary(gpu, rows, args.train);
  if (!args.csv_path.empty()) write_csv(args.csv_path, gpu, rows);
  if (!args.md_path.empty()) write_md(args.md_path, gpu, args, rows);
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  const Args args = parse_args(argc, argv);
  try {
    return run(args);
  } catch (const std::exception& e) {  // qbl's host API throws on CUDA / cuBLAS failures
    std::fflush(stdout);
    std::fprintf(stderr, "qbl_bench: %s\n", e.what());
    return 1;
  }
}
