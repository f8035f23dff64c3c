// bench_report.hpp -- qbl_bench's output: the per-item console lines, the final console table and
// summary, the markdown file (--md) and the CSV file (--csv). One table layout (`columns`) serves
// the console and the markdown; the CSV has its own, wider column set, whose names readers such
// as plot.py select by.
#pragma once

#include <qbl/version.hpp>

#include <algorithm>
#include <cerrno>
#include <cinttypes>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "bench_args.hpp"
#include "bench_results.hpp"
#include "bench_timing.hpp"

namespace {

// ---- one line per timed item ------------------------------------------------------------------

inline void report(const char* dtype, Item i, const Timing& t) {
  std::printf("  %-4s %-15s median %9.4f ms  min %9.4f ms  (%d runs)\n", dtype, item_names[i],
              t.median_ms, t.min_ms, t.runs);
  std::fflush(stdout);
}

inline void report_train(const char* dtype, TrainItem i, const Timing& t) {
  std::printf("  %-4s %-15s median %9.4f ms  min %9.4f ms  (%d runs)\n", dtype, train_item_names[i],
              t.median_ms, t.min_ms, t.runs);
  std::fflush(stdout);
}

// ---- files and the final table -----------------------------------------------------------------

inline std::string version_string(int v) {  // CUDA's 1000 * major + 10 * minor
  return std::to_string(v / 1000) + "." + std::to_string((v % 1000) / 10);
}

inline std::string fmt(const char* f, double v) {
  if (std::isnan(v)) return "";  // an item not run (graph) stays blank
  char buf[64];
  std::snprintf(buf, sizeof buf, f, v);
  return buf;
}

inline void write_csv(const std::string& path, const GpuInfo& gpu, const std::vector<Row>& rows) {
  FILE* f = std::fopen(path.c_str(), "w");
  if (f == nullptr) {
    std::fprintf(stderr, "qbl_bench: cannot write %s: %s\n", path.c_str(), std::strerror(errno));
    std::exit(1);
  }
  // dtype follows the shape (B, T, D); every other column keeps its name, so readers that pick
  // columns by name (plot.py) still work.
  std::fprintf(f, "gpu,sms,l2_bytes,driver,runtime,B,T,D,dtype,tokens,x_sets,graph_sets");
  for (int i = 0; i < item_count; ++i) {
    std::fprintf(f, ",%s_ms,%s_min_ms,%s_runs", item_names[i], item_names[i], item_names[i]);
  }
  std::fprintf(f,
               ",copy_gbps,floor_ms,forward_over_floor,graph_over_floor,eager_over_floor,"
               "prologue_gbps,prologue_over_copy,amax_gbps,amax_over_copy,quant_blend_gbps,"
               "quant_blend_over_copy,gemm_over_bare,gemm_tflops,speedup_vs_eager,"
               "mixed_bit_equal,amax_bit_equal,out_bit_equal,out_max_rel_diff,graph_bit_equal,"
               "bare_gemm_algo");
  // The training items' columns come last, so that every earlier column keeps its position; they
  // stay blank where the items did not run (--no-train).
  for (int i = 0; i < train_item_count; ++i) {
    std::fprintf(f, ",%s_ms,%s_min_ms,%s_runs", train_item_names[i], train_item_names[i],
                 train_item_names[i]);
  }
  std::fprintf(f,
               ",train_floor_ms,train_over_floor,train_graph_over_floor,"
               "train_check_ok,train_unwritten,train_nonfinite,train_mixed_bit_equal,"
               "train_grad_x_rel_diff,train_grad_weight_rel_diff,train_grad_bias_rel_diff,"
               "train_graph_bit_equal,bare_dgrad_algo,bare_wgrad_algo");
  std::fprintf(f,
               ",overlaps,variants_bit_equal,bwd_elementwise_over_copy,"
               "column_sum_over_copy,bare_graph_ms,bare_graph_min_ms,bare_graph_runs,"
               "graph_over_bare_graph\n");
  for (const Row& r : rows) {
    std::fprintf(f, "\"%s\",%d,%d,%s,%s,%" PRId64 ",%" PRId64 ",%" PRId64 ",%s,%" PRId64 ",%d,%d",
                 gpu.name.c_str(), gpu.sms, gpu.l2_bytes, version_string(gpu.driver).c_str(),
                 version_string(gpu.runtime).c_str(), r.shape.b, r.shape.t, r.shape.d,
                 r.dtype_label(), r.tokens, r.x_sets, r.graph_sets);
    for (int i = 0; i < item_count; ++i) {
      if (r.t[i].valid()) {
        std::fprintf(f, ",%.6g,%.6g,%d", r.t[i].median_ms, r.t[i].min_ms, r.t[i].runs);
      } else {
        std::fprintf(f, ",,,");
      }
    }
    const double copy = r.copy_gbps();
    std::fprintf(f, ",%.6g,%.6g,%.6g,%s,%.6g,%.6g,%.6g,%.6g,%.6g,%.6g,%.6g,%.6g,%.6g,%.6g", copy,
                 r.floor_ms(), r.over_floor(forward_item),
                 fmt("%.6g", r.over_floor(graph_item)).c_str(), r.over_floor(eager_item),
                 r.prologue_gbps(), r.prologue_gbps() / copy, r.amax_gbps(), r.amax_gbps() / copy,
                 r.quant_blend_gbps(), r.quant_blend_gbps() / copy,
                 r.ms(gemm_item) / r.ms(bare_gemm_item), r.gemm_tflops(), r.speedup_vs_eager());
    std::fprintf(f, ",%d,%d,%d,%.3g,%s,\"%s\"", r.mixed_bit_equal, r.amax_bit_equal,
                 r.out_bit_equal, r.out_max_rel_diff,
                 r.graph_bit_equal < 0 ? "" : std::to_string(r.graph_bit_equal).c_str(),
                 r.bare_algo.c_str());
    const TrainRow& tr = r.train;
    for (int i = 0; i < train_item_count; ++i) {
      if (tr.t[i].valid()) {
        std::fprintf(f, ",%.6g,%.6g,%d", tr.t[i].median_ms, tr.t[i].min_ms, tr.t[i].runs);
      } else {
        std::fprintf(f, ",,,");
      }
    }
    if (tr.timed()) {
      std::fprintf(f, ",%.6g,%.6g,%s,%d,%" PRId64 ",%" PRId64 ",%d,%.3g,%.3g,%.3g,%s,\"%s\",\"%s\"",
                   r.train_floor_ms(), r.train_over_floor(train_item),
                   fmt("%.6g", r.train_over_floor(train_graph_item)).c_str(), tr.check_ok(),
                   tr.unwritten, tr.nonfinite, tr.mixed_bit_equal, tr.grad_x_rel_diff,
                   tr.grad_weight_rel_diff, tr.grad_bias_rel_diff,
                   tr.graph_bit_equal < 0 ? "" : std::to_string(tr.graph_bit_equal).c_str(),
                   tr.dgrad_algo.c_str(), tr.wgrad_algo.c_str());
    } else {
      std::fprintf(f, ",,,,,,,,,,,,,");  // the 13 columns after the items' times
    }
    if (tr.timed()) {
      std::fprintf(f, ",%d,%s,%s,%s", tr.overlaps,
                   tr.variants_bit_equal < 0 ? "" : std::to_string(tr.variants_bit_equal).c_str(),
                   fmt("%.6g", r.bwd_elementwise_over_copy()).c_str(),
                   fmt("%.6g", r.column_sum_over_copy()).c_str());
    } else {
      std::fprintf(f, ",,,,");
    }
    if (r.bare_graph.valid()) {
      std::fprintf(f, ",%.6g,%.6g,%d", r.bare_graph.median_ms, r.bare_graph.min_ms,
                   r.bare_graph.runs);
    } else {
      std::fprintf(f, ",,,");
    }
    std::fprintf(f, ",%s\n", fmt("%.6g", r.graph_over_bare_graph()).c_str());
  }
  std::fclose(f);
  std::printf("wrote %s\n", path.c_str());
}

// One table layout shared by stdout (aligned) and markdown.
struct Column {
  const char* header;
  std::string (*cell)(const Row&);
  bool train = false;  // shown only when some row timed the training items
};

const Column columns[] = {
    {"shape", [](const Row& r) { return r.label(); }},
    {"dtype", [](const Row& r) { return std::string(r.dtype_label()); }},
    {"tokens", [](const Row& r) { return std::to_string(r.tokens); }},
    {"D", [](const Row& r) { return std::to_string(r.shape.d); }},
    {"fwd ms", [](const Row& r) { return fmt("%.4f", r.ms(forward_item)); }},
    {"graph ms", [](const Row& r) { return fmt("%.4f", r.ms(graph_item)); }},
    {"amax ms", [](const Row& r) { return fmt("%.4f", r.ms(amax_item)); }},
    {"qb ms", [](const Row& r) { return fmt("%.4f", r.ms(quant_blend_item)); }},
    {"fused ms", [](const Row& r) { return fmt("%.4f", r.ms(fused_prologue_item)); }},
    {"gemm ms", [](const Row& r) { return fmt("%.4f", r.ms(gemm_item)); }},
    {"bare ms", [](const Row& r) { return fmt("%.4f", r.ms(bare_gemm_item)); }},
    {"gemm/bare", [](const Row& r) { return fmt("%.3f", r.ms(gemm_item) / r.ms(bare_gemm_item)); }},
    {"eager ms", [](const Row& r) { return fmt("%.4f", r.ms(eager_item)); }},
    {"copy GB/s", [](const Row& r) { return fmt("%.0f", r.copy_gbps()); }},
    {"floor ms", [](const Row& r) { return fmt("%.4f", r.floor_ms()); }},
    {"fwd/floor", [](const Row& r) { return fmt("%.3f", r.over_floor(forward_item)); }},
    {"bgraph ms", [](const Row& r) { return fmt("%.4f", r.bare_graph.median_ms); }},
    {"graph/bgraph", [](const Row& r) { return fmt("%.3f", r.graph_over_bare_graph()); }},
    {"prol GB/s", [](const Row& r) { return fmt("%.0f", r.prologue_gbps()); }},
    {"prol/copy", [](const Row& r) { return fmt("%.3f", r.prologue_gbps() / r.copy_gbps()); }},
    {"amax GB/s", [](const Row& r) { return fmt("%.0f", r.amax_gbps()); }},
    {"amax/copy", [](const Row& r) { return fmt("%.3f", r.amax_gbps() / r.copy_gbps()); }},
    {"qb GB/s", [](const Row& r) { return fmt("%.0f", r.quant_blend_gbps()); }},
    {"qb/copy", [](const Row& r) { return fmt("%.3f", r.quant_blend_gbps() / r.copy_gbps()); }},
    {"TFLOP/s", [](const Row& r) { return fmt("%.1f", r.gemm_tflops()); }},
    {"eager/fwd", [](const Row& r) { return fmt("%.2f", r.speedup_vs_eager()); }},
    {"train ms", [](const Row& r) { return fmt("%.4f", r.train.ms(train_item)); }, true},
    {"tgraph ms", [](const Row& r) { return fmt("%.4f", r.train.ms(train_graph_item)); }, true},
    {"dgrad ms", [](const Row& r) { return fmt("%.4f", r.train.ms(bare_dgrad_item)); }, true},
    {"wgrad ms", [](const Row& r) { return fmt("%.4f", r.train.ms(bare_wgrad_item)); }, true},
    {"tfloor ms", [](const Row& r) { return fmt("%.4f", r.train_floor_ms()); }, true},
    {"train/floor", [](const Row& r) { return fmt("%.3f", r.train_over_floor(train_item)); }, true},
    {"tgraph/floor", [](const Row& r) { return fmt("%.3f", r.train_over_floor(train_graph_item)); },
     true},
    {"overlap ms", [](const Row& r) { return fmt("%.4f", r.train.ms(train_overlap_item)); }, true},
    {"serial ms", [](const Row& r) { return fmt("%.4f", r.train.ms(train_serial_item)); }, true},
    {"plan", [](const Row& r) { return std::string(r.train.overlaps ? "beside" : "after"); }, true},
    {"elem ms", [](const Row& r) { return fmt("%.4f", r.train.ms(bwd_elementwise_item)); }, true},
    {"elem/copy", [](const Row& r) { return fmt("%.2f", r.bwd_elementwise_over_copy()); }, true},
    {"colsum ms", [](const Row& r) { return fmt("%.4f", r.train.ms(column_sum_item)); }, true},
    {"colsum/copy", [](const Row& r) { return fmt("%.2f", r.column_sum_over_copy()); }, true},
};
constexpr int column_count = static_cast<int>(sizeof columns / sizeof columns[0]);
constexpr int text_columns = 2;  // shape and dtype, left-aligned; the numbers right-aligned

inline std::string gpu_line(const GpuInfo& g) {
  char buf[512];
  std::snprintf(buf, sizeof buf,
                "GPU %s (sm_%d%d), %d SMs, L2 %.1f MiB, %.1f GiB; driver %s, runtime %s, "
                "cuBLASLt %zu; qbl %d.%d.%d",
                g.name.c_str(), g.cc_major, g.cc_minor, g.sms, g.l2_bytes / 1048576.0,
                static_cast<double>(g.total_mem) / (1024.0 * 1048576.0),
                version_string(g.driver).c_str(), version_string(g.runtime).c_str(), g.cublaslt,
                QBL_VERSION_MAJOR, QBL_VERSION_MINOR, QBL_VERSION_PATCH);
  return buf;
}

inline bool any_train(const std::vector<Row>& rows) {
  return std::any_of(rows.begin(), rows.end(), [](const Row& r) { return r.train.timed(); });
}

// Indices of the columns to show: the training columns only when some row has them.
inline std::vector<int> shown_columns(const std::vector<Row>& rows) {
  std::vector<int> shown;
  const bool train = any_train(rows);
  for (int c = 0; c < column_count; ++c) {
    if (train || !columns[c].train) shown.push_back(c);
  }
  return shown;
}

inline void print_table(const std::vector<Row>& rows) {
  const std::vector<int> shown = shown_columns(rows);
  std::vector<std::vector<std::string>> cells(rows.size());
  std::size_t width[column_count];
  for (int c : shown) width[c] = std::strlen(columns[c].header);
  for (std::size_t r = 0; r < rows.size(); ++r) {
    for (int c : shown) {
      cells[r].push_back(columns[c].cell(rows[r]));
      width[c] = std::max(width[c], cells[r].back().size());
    }
  }
  for (int c : shown) {
    std::printf(c == 0 ? "%-*s" : (c < text_columns ? "  %-*s" : "  %*s"),
                static_cast<int>(width[c]), columns[c].header);
  }
  std::printf("\n");
  for (const auto& row : cells) {
    for (std::size_t j = 0; j < shown.size(); ++j) {
      const int c = shown[j];
      std::printf(c == 0 ? "%-*s" : (c < text_columns ? "  %-*s" : "  %*s"),
                  static_cast<int>(width[c]), row[j].c_str());
    }
    std::printf("\n");
  }
}

inline void write_md(const std::string& path, const GpuInfo& gpu, const Args& args,
                     const std::vector<Row>& rows) {
  FILE* f = std::fopen(path.c_str(), "w");
  if (f == nullptr) {
    std::fprintf(stderr, "qbl_bench: cannot write %s: %s\n", path.c_str(), std::strerror(errno));
    std::exit(1);
  }
  std::string dtypes;
  for (Dtype d : args.dtypes) dtypes += std::string(dtypes.empty() ? "" : ", ") + dtype_name(d);
  std::fprintf(f, "# qbl_bench, %s\n\n%s\n\n", dtypes.c_str(), gpu_line(gpu).c_str());
  std::fprintf(
      f,
      "Median of per-run CUDA-event times (>= %d runs and >= %.0f ms per item), inputs "
      "rotating over >= 3 x L2. fp32: float tensors, fp32 GEMMs; tf32: float tensors, both "
      "GEMMs in CUBLAS_COMPUTE_32F_FAST_TF32; bf16 / fp16: every tensor in the dtype, GEMMs "
      "with fp32 accumulation. Byte counts use the element size E (4 for fp32 and tf32, 2 "
      "for bf16 and fp16): floor = bare cuBLASLt GEMM+bias + 2*tokens*D*E B at copy "
      "bandwidth (copy measured once per shape). prol GB/s = 3*tokens*D*E B / (amax + "
      "quant_blend). fused = qbl::amax_quant_blend, the prologue as forward() issues it "
      "(one single-block launch up to 2^15 elements).\n\n",
      args.reps, args.min_ms);
  const bool train = any_train(rows);
  if (train) {
    std::fprintf(
        f,
        "train = one forward into caller buffers + one backward computing grad_x, "
        "grad_logits, grad_weight and grad_bias (QuantBlendLinear built with "
        "Options::backward), x and logits rotating, grad_out fixed; tgraph = the same "
        "replayed from a CUDA graph; overlap / serial = train's backward on a BackwardPlan "
        "that puts wgrad beside dgrad, run with a side stream / without one (wgrad after "
        "dgrad); plan = where the layer's backward plan puts wgrad for the shape. dgrad / "
        "wgrad = bare cuBLASLt NN g*W and NT g^T*mixed, no epilogue. elem = the backward's "
        "element kernel, over 3*tokens*D*E B at copy bandwidth; colsum = qbl's bias gradient "
        "(the only one), over tokens*D*E B. tfloor = floor + dgrad + wgrad + 4*tokens*D*E B at "
        "copy bandwidth (read grad_out for the bias gradient; read g_mixed and x, write "
        "grad_x).\n\n");
  }
  const std::vector<int> shown = shown_columns(rows);
  for (int c : shown) std::fprintf(f, "| %s ", columns[c].header);
  std::fprintf(f, "|\n");
  for (int c : shown) std::fprintf(f, c < text_columns ? "| --- " : "| ---: ");
  std::fprintf(f, "|\n");
  for (const Row& r : rows) {
    for (int c : shown) std::fprintf(f, "| %s ", columns[c].cell(r).c_str());
    std::fprintf(f, "|\n");
  }
  std::fprintf(f,
               "\n| shape | dtype | mixed bit-equal | amax bit-equal | out max rel diff | out "
               "bit-equal | bare GEMM algo |\n");
  std::fprintf(f, "| --- | --- | --- | --- | ---: | --- | --- |\n");
  for (const Row& r : rows) {
    std::fprintf(f, "| %s | %s | %s | %s | %.3g | %s | %s |\n", r.label().c_str(), r.dtype_label(),
                 r.mixed_bit_equal ? "yes" : "no", r.amax_bit_equal ? "yes" : "no",
                 r.out_max_rel_diff, r.out_bit_equal ? "yes" : "no", r.bare_algo.c_str());
  }
  if (train) {
    std::fprintf(
        f,
        "\nTraining check (input set 0; max rel diff = max|diff| / max|ref| against the "
        "bare products' outputs, grad_bias against a host fp64 sum of grad_out, grad_x "
        "through qbl::grad_x_value on the host):\n\n"
        "| shape | dtype | ok | unwritten | non-finite | mixed bit-equal | grad_x | "
        "grad_weight | grad_bias | tolerance | graph bit-equal | bare dgrad algo | bare wgrad "
        "algo |\n"
        "| --- | --- | --- | ---: | ---: | --- | ---: | ---: | ---: | ---: | --- | --- | --- "
        "|\n");
    for (const Row& r : rows) {
      const TrainRow& t = r.train;
      if (!t.timed()) continue;
      std::fprintf(f,
                   "| %s | %s | %s | %" PRId64 " | %" PRId64
                   " | %s | %.3g | %.3g | %.3g | %.0e | %s | %s | %s |\n",
                   r.label().c_str(), r.dtype_label(), t.check_ok() ? "yes" : "NO", t.unwritten,
                   t.nonfinite, t.mixed_bit_equal ? "yes" : "no", t.grad_x_rel_diff,
                   t.grad_weight_rel_diff, t.grad_bias_rel_diff, t.tolerance,
                   t.graph_bit_equal < 0 ? "" : (t.graph_bit_equal ? "yes" : "no"),
                   t.dgrad_algo.c_str(), t.wgrad_algo.c_str());
    }
  }
  for (const Row& r : rows) {
    if (!r.train.skipped.empty()) {
      std::fprintf(f, "\nTraining items skipped for %s %s: %s\n", r.label().c_str(),
                   r.dtype_label(), r.train.skipped.c_str());
    }
  }
  std::fclose(f);
  std::printf("wrote %s\n", path.c_str());
}

// The final console output: the GPU, the table, and whether every check passed.
inline void print_summary(const GpuInfo& gpu, const std::vector<Row>& rows, bool train) {
  std::printf("\n%s\n", gpu_line(gpu).c_str());
  print_table(rows);
  std::string unequal;  // "shape dtype" of every row whose mixed differs from the chain's
  for (const Row& r : rows) {
    if (r.mixed_bit_equal) continue;
    unequal += std::string(unequal.empty() ? "" : ", ") + r.label() + " " + r.dtype_label();
  }
  std::printf("mixed bit-equal to the eager chain on every shape and dtype: %s\n",
              unequal.empty() ? "yes" : ("NO (" + unequal + ")").c_str());
  if (train) {
    std::string failed, skipped;  // "shape dtype" lists
    auto add = [](std::string& list, const Row& r) {
      list += std::string(list.empty() ? "" : ", ") + r.label() + " " + r.dtype_label();
    };
    for (const Row& r : rows) {
      if (!r.train.timed()) {
        add(skipped, r);
        continue;
      }
      if (!r.train.check_ok()) add(failed, r);
    }
    std::printf(
        "training check (outputs written and finite, mixed bit-equal, gradients within "
        "tolerance of their references) on every shape and dtype timed: %s\n",
        failed.empty() ? "yes" : ("NO (" + failed + ")").c_str());
    if (!skipped.empty()) std::printf("training items SKIPPED for: %s\n", skipped.c_str());
  }
}

}  // namespace
