// bench_timing.hpp -- how qbl_bench times: CUDA events around every run, warm-up, the items of one
// shape and dtype side by side, medians.
//
// Method. Each item gets warm-up runs first (doubling rounds until one round lasts >= 10 ms), then
// at least --reps runs and enough that they add up to >= --min-ms. The items of one shape and
// dtype are timed side by side: rounds of ~2 ms per item go to each item in turn, so that all of
// them see the same clocks and temperature (timed one after another, a later item ran up to 15 %
// slower than an earlier one on an H200 under sustained bf16 GEMM load, the same kernel included).
// Every run is bracketed by its own event pair and the MEDIAN of the per-run times is reported
// (robust to the occasional preempted or clock-throttled run). The inputs each run reads rotate
// over sets larger than L2 (bench_inputs.cuh).
#pragma once

#include <qbl/detail/handles.hpp>

#include <cuda_runtime_api.h>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <functional>
#include <vector>

#include "bench_check.hpp"

namespace {

constexpr double warmup_round_ms = 10.0;

// ---- timing ----------------------------------------------------------------------------------

struct Timing {
  double median_ms = NAN;
  double min_ms = NAN;
  int runs = 0;
  bool valid() const { return runs > 0; }
};

class RunTimer {
 public:
  RunTimer(cudaStream_t stream, double min_total_ms, int min_runs, int max_runs)
      : stream_(stream), min_total_ms_(min_total_ms), min_runs_(min_runs), max_runs_(max_runs) {
    for (int i = 0; i < batch; ++i) {
      start_.push_back(make_event());
      stop_.push_back(make_event());
    }
  }
  RunTimer(const RunTimer&) = delete;
  RunTimer& operator=(const RunTimer&) = delete;

  // Times several items side by side: after each item's warm-up, rounds of about round_ms per
  // item go to every item in turn until each has its runs, so that every item is timed across
  // the same stretch of clocks and temperature. (Timed one after another, the items timed last
  // ran up to 15 % slower on an H200 under sustained bf16 GEMM load, the same kernel included.)
  std::vector<Timing> measure_together(const std::vector<std::function<void(int)>>& items) {
    const std::size_t n = items.size();
    std::vector<int> index(n, 0), chunk(n), wanted(n);
    for (std::size_t k = 0; k < n; ++k) {
      const double estimate_ms = warm_up(items[k], index[k]);
      const double runs = estimate_ms > 0.0 ? std::ceil(min_total_ms_ / estimate_ms) : max_runs_;
      wanted[k] = static_cast<int>(std::clamp<double>(runs, min_runs_, max_runs_));
      const double per_round = estimate_ms > 0.0 ? std::ceil(round_ms / estimate_ms) : 1.0;
      chunk[k] = static_cast<int>(std::clamp<double>(per_round, 1.0, batch));
    }
    std::vector<std::vector<float>> times(n);
    for (bool more = true; more;) {
      more = false;
      for (std::size_t k = 0; k < n; ++k) {
        if (static_cast<int>(times[k].size()) >= wanted[k]) continue;
        timed_runs(items[k], index[k],
                   std::min(chunk[k], wanted[k] - static_cast<int>(times[k].size())), times[k]);
        more = more || static_cast<int>(times[k].size()) < wanted[k];
      }
    }
    std::vector<Timing> result(n);
    for (std::size_t k = 0; k < n; ++k) result[k] = summarize(times[k]);
    return result;
  }

  // `run_once(i)` enqueues run i on the stream (i picks the rotating input set).
  template <typename F>
  Timing measure(F&& run_once) {
    int index = 0;
    const double estimate_ms = warm_up(run_once, index);
    const double wanted = estimate_ms > 0.0 ? std::ceil(min_total_ms_ / estimate_ms) : max_runs_;
    const int runs = static_cast<int>(std::clamp<double>(wanted, min_runs_, max_runs_));
    std::vector<float> times;
    times.reserve(static_cast<std::size_t>(runs));
    while (static_cast<int>(times.size()) < runs) {
      timed_runs(run_once, index, std::min(batch, runs - static_cast<int>(times.size())), times);
    }
    return summarize(times);
  }

 private:
  // Warm-up in doubling rounds until one round lasts warmup_round_ms: clocks ramp up, lazy
  // module loading and cuBLASLt's first-call setup happen here. Returns the last round's mean.
  template <typename F>
  double warm_up(F&& run_once, int& index) {
    for (int round = 4;; round *= 2) {
      CUDA_CHECK(cudaEventRecord(start_[0].get(), stream_));
      for (int r = 0; r < round; ++r) run_once(index++);
      CUDA_CHECK(cudaEventRecord(stop_[0].get(), stream_));
      CUDA_CHECK(cudaEventSynchronize(stop_[0].get()));
      float ms = 0.0f;
      CUDA_CHECK(cudaEventElapsedTime(&ms, start_[0].get(), stop_[0].get()));
      if (ms >= warmup_round_ms || round >= (1 << 14)) return static_cast<double>(ms) / round;
    }
  }

  // `count` (<= batch) runs, each bracketed by its own event pair; their times are appended.
  template <typename F>
  void timed_runs(F&& run_once, int& index, int count, std::vector<float>& times) {
    for (int j = 0; j < count; ++j) {
      CUDA_CHECK(cudaEventRecord(start_[j].get(), stream_));
      run_once(index++);
      CUDA_CHECK(cudaEventRecord(stop_[j].get(), stream_));
    }
    CUDA_CHECK(cudaEventSynchronize(stop_[count - 1].get()));
    for (int j = 0; j < count; ++j) {
      float ms = 0.0f;
      CUDA_CHECK(cudaEventElapsedTime(&ms, start_[j].get(), stop_[j].get()));
      times.push_back(ms);
    }
  }

  static qbl::detail::event_ptr make_event() {
    cudaEvent_t e = nullptr;
    CUDA_CHECK(cudaEventCreate(&e));
    return qbl::detail::event_ptr(e);
  }

  static Timing summarize(std::vector<float>& times) {
    Timing t;
    t.runs = static_cast<int>(times.size());
    std::sort(times.begin(), times.end());
    const std::size_t mid = times.size() / 2;
    t.median_ms =
        times.size() % 2 ? times[mid] : 0.5 * (static_cast<double>(times[mid - 1]) + times[mid]);
    t.min_ms = times.front();
    return t;
  }

  static constexpr int batch = 512;        // event pairs in flight before the host reads them back
  static constexpr double round_ms = 2.0;  // per item and round in measure_together
  cudaStream_t stream_;
  double min_total_ms_;
  int min_runs_, max_runs_;
  std::vector<qbl::detail::event_ptr> start_, stop_;  // owned: destroyed with the timer
};

}  // namespace
