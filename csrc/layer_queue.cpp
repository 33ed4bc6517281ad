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
  std::lock_guard<std::mutex> lk(m_);
  mx::async_eval(outputs);
  pending_.push_back(std::move(outputs));
  pushed_ += 1;
  while (static_cast<int>(pending_.size()) > depth_) {
    wait_oldest();
  }
  if (static_cast<int>(pending_.size()) > max_in_flight_) {
    max_in_flight_ = static_cast<int>(pending_.size());
  }
}

void LayerQueue::drain() {
  std::lock_guard<std::mutex> lk(m_);
  while (!pending_.empty()) {
    wait_oldest();
  }
}

} // namespace tensorfold
