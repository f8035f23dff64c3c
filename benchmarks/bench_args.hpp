// bench_args.hpp -- qbl_bench's command line: the shape table and the dtypes it picks from, the
// options (Args), their parsing and --help.
#pragma once

#include <algorithm>
#include <cinttypes>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <iterator>
#include <string>
#include <vector>

namespace {

// ---- the shape table ---------------------------------------------------------------------------

struct Shape {
  std::int64_t b, t, d;
};

constexpr Shape shape_table[] = {{1, 8, 1024},     {16, 512, 512},  {64, 512, 256}, {128, 128, 768},
                                 {32, 1024, 1024}, {8, 2048, 2048}, {4, 4096, 4096}};
constexpr int shape_count = static_cast<int>(sizeof shape_table / sizeof shape_table[0]);

inline std::string shape_label(const Shape& s) {
  return std::to_string(s.b) + "x" + std::to_string(s.t) + "x" + std::to_string(s.d);
}

// ---- dtypes ------------------------------------------------------------------------------------

// tf32 shares fp32's element type; it changes only how the GEMMs compute.
enum class Dtype { fp32, tf32, bf16, fp16 };
constexpr Dtype all_dtypes[] = {Dtype::fp32, Dtype::tf32, Dtype::bf16, Dtype::fp16};
constexpr const char* dtype_names[] = {"fp32", "tf32", "bf16", "fp16"};
constexpr const char* default_dtypes = "fp32,tf32,bf16";

inline const char* dtype_name(Dtype d) { return dtype_names[static_cast<int>(d)]; }

// ---- command line ------------------------------------------------------------------------------

struct Args {
  std::string csv_path, md_path;
  std::vector<int> shapes;
  std::vector<Dtype> dtypes;
  double min_ms = 50.0;
  int reps = 20;
  int max_runs = 100000;
  std::size_t copy_mib = 1024;
  int device = 0;
  bool graph = true;
  bool gemm_probe = false;
  bool train = true;
};

inline void print_usage(const char* argv0) {
  std::printf(
      "usage: %s [options]\n"
      "  --shapes i,j,...   indices into the shape table (default: all)\n"
      "  --dtypes LIST      comma-separated from fp32, tf32, bf16, fp16 (default %s);\n"
      "                     for each shape, every dtype listed, in the order given\n"
      "  --csv PATH         write one CSV row per shape and dtype\n"
      "  --md PATH          write a markdown table\n"
      "  --min-ms X         timed runs per item add up to at least X ms (default 50)\n"
      "  --reps N           at least N timed runs per item (default 20)\n"
      "  --max-runs N       at most N timed runs per item (default 100000)\n"
      "  --copy-mib N       size of the device-to-device copy (default 1024)\n"
      "  --device N         CUDA device (default 0)\n"
      "  --no-graph         skip the CUDA-graph replays of launch-bound shapes\n"
      "  --no-train         skip the training items (forward + backward and its floor)\n"
      "  --gemm-probe       also time the bare GEMM planned the ways qbl::GemmPlan plans it\n"
      "                     (heuristic asked for 4 results, no bias pointer while asking,\n"
      "                     explicit 256-byte alignment preferences) and the layer's own GEMM\n"
      "dtypes: fp32 and tf32 run float tensors (tf32: both GEMMs in "
      "CUBLAS_COMPUTE_32F_FAST_TF32),\n"
      "        bf16 and fp16 run __nv_bfloat16 and __half tensors with fp32 accumulation\n"
      "shapes (B, T, D):\n",
      argv0, default_dtypes);
  for (int i = 0; i < shape_count; ++i) {
    const Shape& s = shape_table[i];
    std::printf("  %d: (%" PRId64 ", %" PRId64 ", %" PRId64 ")  tokens %" PRId64 "\n", i, s.b, s.t,
                s.d, s.b * s.t);
  }
}

[[noreturn]] inline void bad_args(const std::string& msg) {
  std::fprintf(stderr, "qbl_bench: %s (see --help)\n", msg.c_str());
  std::exit(2);
}

inline long long parse_int(const std::string& flag, const char* s) {
  char* end = nullptr;
  const long long v = std::strtoll(s, &end, 10);
  if (end == s || *end != '\0') bad_args("bad integer for " + flag + ": " + s);
  return v;
}

// "a,b,c" -> {"a", "b", "c"}; an empty item stays (and is rejected by the caller).
inline std::vector<std::string> split_list(const std::string& list) {
  std::vector<std::string> items;
  std::size_t pos = 0;
  while (pos <= list.size()) {
    const std::size_t comma = std::min(list.find(',', pos), list.size());
    items.push_back(list.substr(pos, comma - pos));
    pos = comma + 1;
  }
  return items;
}

inline std::vector<Dtype> parse_dtypes(const std::string& list) {
  std::vector<Dtype> dtypes;
  for (const std::string& item : split_list(list)) {
    const auto known = std::find_if(std::begin(all_dtypes), std::end(all_dtypes),
                                    [&](Dtype d) { return item == dtype_name(d); });
    if (known == std::end(all_dtypes)) {
      bad_args("unknown dtype in --dtypes: '" + item + "' (fp32, tf32, bf16 or fp16)");
    }
    dtypes.push_back(*known);
  }
  return dtypes;
}

inline Args parse_args(int argc, char** argv) {
  Args a;
  for (int i = 1; i < argc; ++i) {
    const std::string flag = argv[i];
    auto value = [&]() -> const char* {
      if (i + 1 >= argc) bad_args("missing value for " + flag);
      return argv[++i];
    };
    if (flag == "--help" || flag == "-h") {
      print_usage(argv[0]);
      std::exit(0);
    } else if (flag == "--csv") {
      a.csv_path = value();
    } else if (flag == "--md") {
      a.md_path = value();
    } else if (flag == "--shapes") {
      for (const std::string& item : split_list(value())) {
        const long long idx = parse_int(flag, item.c_str());
        if (idx < 0 || idx >= shape_count) bad_args("shape index out of range: " + item);
        a.shapes.push_back(static_cast<int>(idx));
      }
    } else if (flag == "--dtypes") {
      a.dtypes = parse_dtypes(value());  // never empty: an empty item is rejected
    } else if (flag == "--min-ms") {
      const char* s = value();
      char* end = nullptr;
      a.min_ms = std::strtod(s, &end);
      if (end == s || *end != '\0' || !(a.min_ms >= 0)) bad_args(std::string("bad --min-ms: ") + s);
    } else if (flag == "--reps") {
      a.reps = static_cast<int>(parse_int(flag, value()));
      if (a.reps < 1) bad_args("--reps must be >= 1");
    } else if (flag == "--max-runs") {
      a.max_runs = static_cast<int>(parse_int(flag, value()));
      if (a.max_runs < 1) bad_args("--max-runs must be >= 1");
    } else if (flag == "--copy-mib") {
      const long long v = parse_int(flag, value());
      if (v < 1) bad_args("--copy-mib must be >= 1");
      a.copy_mib = static_cast<std::size_t>(v);
    } else if (flag == "--device") {
      a.device = static_cast<int>(parse_int(flag, value()));
    } else if (flag == "--no-graph") {
      a.graph = false;
    } else if (flag == "--gemm-probe") {
      a.gemm_probe = true;
    } else if (flag == "--no-train") {
      a.train = false;
    } else {
      bad_args("unknown option " + flag);
    }
  }
  if (a.shapes.empty()) {
    for (int i = 0; i < shape_count; ++i) a.shapes.push_back(i);
  }
  if (a.dtypes.empty()) a.dtypes = parse_dtypes(default_dtypes);
  a.max_runs = std::max(a.max_runs, a.reps);
  return a;
}

}  // namespace
