// parallel_for_stealing and parallel_for_shared_tail (work_stealing.h) as
// operators, for their tests: which thread ran each item (and how many times),
// with thread 0 stalled at the first item it takes, as a thread that lost its
// core would be.
#include "work_stealing.h"

#include <ATen/core/Tensor.h>
#include <ATen/ops/full.h>
#include <ATen/ops/stack.h>
#include <ATen/ops/zeros.h>

#include <atomic>
#include <chrono>
#include <thread>

namespace {

// Which thread last ran each item (-1: none) and how many times each ran.
class Runs {
 public:
  explicit Runs(int64_t items)
      : ran_by_(at::full({items}, -1, at::kLong)), times_(at::zeros({items}, at::kLong)) {}
  void ran(int64_t item, int64_t thread) {
    ran_by_.data_ptr<int64_t>()[item] = thread;
    __atomic_add_fetch(times_.data_ptr<int64_t>() + item, 1, __ATOMIC_RELAXED);
  }
  at::Tensor stacked() const { return at::stack({ran_by_, times_}); }

 private:
  at::Tensor ran_by_, times_;
};

}  // namespace

at::Tensor stolen_items(int64_t items, int64_t stall_us) {
  Runs runs(items);
  llmserve::parallel_for_stealing(items, [&](auto& next) {
    const int64_t thread = at::get_thread_num();
    bool stalled = thread != 0;
    for (int64_t item; (item = next()) >= 0;) {
      if (!stalled) std::this_thread::sleep_for(std::chrono::microseconds(stall_us));
      stalled = true;
      runs.ran(item, thread);
    }
  });
  return runs.stacked();
}

at::Tensor shared_tail_rows(int64_t rows, int64_t grain, int64_t stall_us) {
  Runs runs(rows);
  std::atomic<bool> stalled{false};
  llmserve::parallel_for_shared_tail(rows, grain, [&](int64_t begin, int64_t end) {
    const int64_t thread = at::get_thread_num();
    if (thread == 0 && !stalled.exchange(true))
      std::this_thread::sleep_for(std::chrono::microseconds(stall_us));
    for (int64_t row = begin; row < end; ++row) runs.ran(row, thread);
  });
  return runs.stacked();
}
