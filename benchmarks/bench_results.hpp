// bench_results.hpp -- what qbl_bench measures and checks: the timed items, one result row per
// shape and dtype (the training items' part included) and the numbers derived from it, and the
// GPU it ran on.
//
// Derived numbers: floor_ms = bare_gemm_ms + 2 * tokens * D * sizeof(T) B / copy bandwidth (read x
// once, write mixed once, at copy speed); prologue GB/s = 3 * tokens * D * sizeof(T) B /
// (amax_ms + quant_blend_ms) (amax reads x; quant_blend reads x and writes mixed); GEMM TFLOP/s =
// 2 * tokens * D^2 / bare_gemm_ms; train_floor_ms = floor_ms + bare_dgrad_ms + bare_wgrad_ms + 4 *
// tokens * D * sizeof(T) B / copy bandwidth (one read of grad_out for the bias gradient; the
// backward's elementwise stage reads g_mixed and x and writes grad_x). The training items' CSV
// columns follow all the earlier ones.
#pragma once

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <string>

#include "bench_args.hpp"
#include "bench_timing.hpp"

namespace {

// ---- the timed items ----------------------------------------------------------------------------

// The timed items, in the order of the CSV columns.
enum Item {
  forward_item,
  graph_item,
  amax_item,
  quant_blend_item,
  fused_prologue_item,
  gemm_item,
  bare_gemm_item,
  eager_item,
  copy_item,
  item_count
};
const char* const item_names[item_count] = {"forward",     "graph",          "amax",
                                            "quant_blend", "fused_prologue", "gemm",
                                            "bare_gemm",   "eager",          "copy"};

// ---- the training items' part (bench_train.cuh) -------------------------------------------------

enum TrainItem {
  train_item,
  train_graph_item,
  bare_dgrad_item,
  bare_wgrad_item,
  train_overlap_item,
  train_serial_item,
  bwd_elementwise_item,
  column_sum_item,
  train_item_count
};
const char* const train_item_names[train_item_count] = {
    "train",         "train_graph",  "bare_dgrad",      "bare_wgrad",
    "train_overlap", "train_serial", "bwd_elementwise", "column_sum"};

// What the training items measured and checked for one shape and dtype.
struct TrainRow {
  Timing t[train_item_count];
  bool mixed_bit_equal = false;
  double grad_x_rel_diff = NAN, grad_weight_rel_diff = NAN, grad_bias_rel_diff = NAN;
  double tolerance = NAN;                       // of the three rel diffs, for this dtype
  std::int64_t unwritten = -1, nonfinite = -1;  // elements of out and the four gradients
  int graph_bit_equal = -1;                     // -1: no graph
  std::string dgrad_algo, wgrad_algo;
  bool overlaps = false;        // the backward plan's choice for the shape: wgrad beside dgrad
  int variants_bit_equal = -1;  // train_overlap and train_serial gave train's gradients bit for bit
  std::string skipped;          // why the items did not run when they were asked for

  bool timed() const { return t[train_item].valid(); }
  double ms(TrainItem i) const { return t[i].median_ms; }
  bool check_ok() const {
    auto within = [&](double v) { return v <= tolerance; };  // false for NaN
    return unwritten == 0 && nonfinite == 0 && mixed_bit_equal && within(grad_x_rel_diff) &&
           within(grad_weight_rel_diff) && within(grad_bias_rel_diff) && graph_bit_equal != 0 &&
           variants_bit_equal != 0;
  }
};

// ---- one row: a shape and dtype -----------------------------------------------------------------

struct Row {
  Shape shape{};
  Dtype dtype = Dtype::fp32;
  double elem_bytes = 4;  // sizeof(T): every byte count below is in T
  std::int64_t tokens = 0;
  int x_sets = 0, graph_sets = 0;
  Timing t[item_count];
  double copy_bytes = 0;  // bytes of one copy (read once, written once)
  bool mixed_bit_equal = false, amax_bit_equal = false, out_bit_equal = false;
  double out_max_rel_diff = NAN;
  int graph_bit_equal = -1;  // -1: no graph
  std::string bare_algo;
  TrainRow train;  // the training items (bench_train.cuh); untimed with --no-train
  // Timed with the rest; its CSV columns come after the training items'.
  Timing bare_graph;  // the bare GEMM replayed from a graph

  double n() const { return static_cast<double>(tokens) * static_cast<double>(shape.d); }
  double ms(Item i) const { return t[i].median_ms; }
  double copy_gbps() const { return 2.0 * copy_bytes / (ms(copy_item) * 1e-3) / 1e9; }
  double floor_ms() const {
    return ms(bare_gemm_item) + 2.0 * n() * elem_bytes / (copy_gbps() * 1e9) * 1e3;
  }
  double over_floor(Item i) const { return t[i].valid() ? ms(i) / floor_ms() : NAN; }
  // Launch-bound shapes: the forward's graph replay over the bare GEMM's.
  double graph_over_bare_graph() const {
    return t[graph_item].valid() && bare_graph.valid() ? ms(graph_item) / bare_graph.median_ms
                                                       : NAN;
  }
  double copy_ms(double elements) const {
    return elements * elem_bytes / (copy_gbps() * 1e9) * 1e3;
  }
  // The cheapest way to the training step's outputs that the harness can measure: the forward's
  // floor + bare dgrad + bare wgrad (both without epilogue) + one read of grad_out for the bias
  // gradient + reading g_mixed and x and writing grad_x once, those bytes at copy bandwidth.
  // (cuBLASLt's BGRADB epilogue, the fused alternative for the bias gradient, was no cheaper
  // than the plain wgrad plus that read beyond a repeat's spread: bench_train.cuh, HISTORY.md.)
  // The products are added one after the other: with wgrad beside dgrad the step can come in
  // under this floor.
  double train_floor_ms() const {
    if (!train.timed()) return NAN;
    return floor_ms() + train.ms(bare_dgrad_item) + train.ms(bare_wgrad_item) + copy_ms(4.0 * n());
  }
  // The backward's element kernel over its reads (g_mixed, x) and write (grad_x) at copy speed.
  double bwd_elementwise_over_copy() const {
    return train.t[bwd_elementwise_item].valid()
               ? train.ms(bwd_elementwise_item) / copy_ms(3.0 * n())
               : NAN;
  }
  // The column sum over one read of grad_out at copy speed.
  double column_sum_over_copy() const {
    return train.t[column_sum_item].valid() ? train.ms(column_sum_item) / copy_ms(n()) : NAN;
  }
  double train_over_floor(TrainItem i) const {
    return train.t[i].valid() ? train.ms(i) / train_floor_ms() : NAN;
  }
  double prologue_gbps() const {
    return 3.0 * n() * elem_bytes / ((ms(amax_item) + ms(quant_blend_item)) * 1e-3) / 1e9;
  }
  double amax_gbps() const { return n() * elem_bytes / (ms(amax_item) * 1e-3) / 1e9; }
  double quant_blend_gbps() const {
    return 2.0 * n() * elem_bytes / (ms(quant_blend_item) * 1e-3) / 1e9;
  }
  double gemm_tflops() const {
    return 2.0 * n() * static_cast<double>(shape.d) / (ms(bare_gemm_item) * 1e-3) / 1e12;
  }
  double speedup_vs_eager() const { return ms(eager_item) / ms(forward_item); }
  std::string label() const { return shape_label(shape); }
  const char* dtype_label() const { return dtype_name(dtype); }
};

struct GpuInfo {
  std::string name;
  int sms = 0, l2_bytes = 0, driver = 0, runtime = 0, cc_major = 0, cc_minor = 0;
  std::size_t total_mem = 0, cublaslt = 0;
};

}  // namespace
