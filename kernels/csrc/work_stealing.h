// How kernels share items out among at::parallel_for's threads. Each thread
// starts on one contiguous range, as at::parallel_for splits them, so each
// streams its own weights front to back; then
// - parallel_for_stealing: a thread that finishes its range takes items from
//   the back of another's. On two cores the engine core, the frontend and the
//   clients take turns on the worker's threads: with a static split the thread
//   that kept its core then waits at the end of every kernel for the one that
//   lost it (bench/NOTES.md);
// - parallel_for_shared_tail: the last rows are not in any range, and go out in
//   order to whichever thread is free (for short calls; below).
#pragma once

#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <vector>

namespace llmserve {

// One thread's range: the front it takes from and the back others steal from,
// in one word, so a take and a steal never hand out the same item; a cache line
// of its own, so threads taking from their own ranges do not share one.
class alignas(64) StealableRange {
 public:
  void reset(int64_t front, int64_t back) { word_.store(pack(front, back)); }

  // The next item from the front (`from_back`: from the back), or -1 when empty.
  int64_t take(bool from_back) {
    uint64_t word = word_.load(std::memory_order_relaxed);
    for (;;) {
      const auto front = static_cast<int64_t>(word & kMask);
      const auto back = static_cast<int64_t>(word >> 32);
      if (front >= back) return -1;
      const uint64_t next = from_back ? pack(front, back - 1) : pack(front + 1, back);
      if (word_.compare_exchange_weak(word, next, std::memory_order_relaxed))
        return from_back ? back - 1 : front;
    }
  }

 private:
  static constexpr uint64_t kMask = 0xffffffffu;
  static uint64_t pack(int64_t front, int64_t back) {
    return static_cast<uint64_t>(front) | (static_cast<uint64_t>(back) << 32);
  }
  std::atomic<uint64_t> word_{0};
};

// Every item in [0, items) exactly once, on at::parallel_for's threads: each
// thread runs body(next), where next() returns its next item, or -1 when none is
// left anywhere (so a thread sets up its scratch once, then loops).
template <typename Body>
void parallel_for_stealing(int64_t items, const Body& body) {
  const int64_t threads = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), items));
  std::vector<StealableRange> ranges(threads);
  for (int64_t t = 0; t < threads; ++t)
    ranges[t].reset(items * t / threads, items * (t + 1) / threads);
  at::parallel_for(0, threads, 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      int64_t victim = 0;  // 0: this thread's own range, from the front
      auto next = [&]() -> int64_t {
        for (; victim < threads; ++victim) {
          const int64_t item = ranges[(t + victim) % threads].take(victim > 0);
          if (item >= 0) return item;
        }
        return -1;
      };
      body(next);
    }
  });
}

// Rows [0, rows) on at::parallel_for's threads, `grain` rows at a time at the end:
// each thread streams its static share of the first rows front to back, then
// the last 1/kSharedTail of them go out in order, a grain to whichever thread is
// free. body(begin, end) runs each range. For kernels whose calls are short, as
// a decode step's GEMVs are: under a static split the thread that got less of
// the memory's bandwidth in a call made the other wait at the join every call,
// while over a long call the shares even out; stealing from the back of a range
// contended at every grain (bench/NOTES.md). Only the tail's grains share a
// counter, and they are taken front to back, as one stream.
constexpr int64_t kSharedTail = 8;

template <typename Body>
void parallel_for_shared_tail(int64_t rows, int64_t grain, const Body& body) {
  const int64_t threads =
      std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), rows / grain));
  const int64_t head = threads > 1 ? rows - rows / kSharedTail : rows;
  std::atomic<int64_t> next{head};
  at::parallel_for(0, threads, 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      body(head * t / threads, head * (t + 1) / threads);
      for (int64_t first; (first = next.fetch_add(grain, std::memory_order_relaxed)) < rows;)
        body(first, std::min(rows, first + grain));
    }
  });
}

}  // namespace llmserve
