// LayerQueue: bounded asynchronous evaluation of per-layer work.
//
// push(arrays) starts evaluating a layer's outputs (mlx::core::async_eval) and, once more
// than `depth` layers are in flight, blocks until the oldest has finished. MoE prefill uses
// depth 2 so that at most two layers are queued ahead of the device and peak memory stays
// bounded whatever the prompt length. Results are exactly those of plain evaluation: the
// queue only changes when work is waited on, never what is computed.
#pragma once

#include <deque>
#include <mutex>
#include <vector>

#include "mlx/array.h"

namespace tensorfold {

class LayerQueue {
 public:
  explicit LayerQueue(int depth);
  void push(std::vector<mlx::core::array> outputs);
  void drain();
  int depth() const { return depth_; }
  int in_flight() const {
    std::lock_guard<std::mutex> lk(m_);
    return static_cast<int>(pending_.size());
  }
  int max_in_flight() const {
    std::lock_guard<std::mutex> lk(m_);
    return max_in_flight_;
  }
  long long pushed() const {
    std::lock_guard<std::mutex> lk(m_);
    return pushed_;
  }

 private:
  void wait_oldest();
  // push / drain run without the GIL: one caller at a time (a queue shared by Python threads
  // corrupted its deque: SIGSEGV / SIGBUS in an audit's 4-thread test)
  mutable std::mutex m_;
  int depth_;
  int max_in_flight_ = 0;
  long long pushed_ = 0;
  std::deque<std::vector<mlx::core::array>> pending_;
};

} // namespace tensorfold
