// parallel_for_stealing (work_stealing.h) as an operator, for its tests: which
// thread ran each item (and how many times), with thread 0 stalled at the first
// item it takes, as a thread that lost its core would be.
#include "work_stealing.h"

#include <ATen/core/Tensor.h>
#include <ATen/ops/full.h>
#include <ATen/ops/stack.h>
#include <ATen/ops/zeros.h>

#include <chrono>
#include <thread>

at::Tensor stolen_items(int64_t items, int64_t stall_us) {
  auto ran_by = at::full({items}, -1, at::kLong);
  auto times = at::zeros({items}, at::kLong);
  int64_t* owner = ran_by.data_ptr<int64_t>();
  int64_t* count = times.data_ptr<int64_t>();
  llmserve::parallel_for_stealing(items, [&](auto& next) {
    const int64_t thread = at::get_thread_num();
    bool stalled = thread != 0;
    for (int64_t item; (item = next()) >= 0;) {
      if (!stalled) std::this_thread::sleep_for(std::chrono::microseconds(stall_us));
      stalled = true;
      owner[item] = thread;
      __atomic_add_fetch(count + item, 1, __ATOMIC_RELAXED);
    }
  });
  return at::stack({ran_by, times});
}
