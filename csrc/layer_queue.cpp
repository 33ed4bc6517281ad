#include "layer_queue.h"

#include <stdexcept>

#include "mlx/transforms.h"

namespace mx = mlx::core;

namespace tensorfold {

LayerQueue::LayerQueue(int depth) : depth_(depth) {
  if (depth < 1) {
    throw std::invalid_argument("LayerQueue depth must be >= 1");
  }
}

void LayerQueue::wait_oldest() {
  auto oldest = std::move(pending_.front());
  pending_.pop_front();
  mx::eval(oldest); // already scheduled: this only waits
}

void LayerQueue::push(std::vector<mx::array> outputs) {
  mx::async_eval(outputs);
  pending_.push_back(std::move(outputs));
  pushed_ += 1;
  while (static_cast<int>(pending_.size()) > depth_) {
    wait_oldest();
  }
  if (in_flight() > max_in_flight_) {
    max_in_flight_ = in_flight();
  }
}

void LayerQueue::drain() {
  while (!pending_.empty()) {
    wait_oldest();
  }
}

} // namespace tensorfold
