// Thread pool and conversions shared by the CPU faces (see cpu_common.h).
#include "cpu_common.h"

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstdlib>
#include <exception>
#include <mutex>
#include <thread>
#include <vector>

namespace tensorfold::cpu {

namespace {

class Pool {
 public:
  explicit Pool(int n_workers) {
    for (int i = 0; i < n_workers; ++i) {
      workers_.emplace_back([this] { worker_loop(); });
    }
  }

  ~Pool() {
    {
      std::lock_guard<std::mutex> lk(m_);
      stop_ = true;
    }
    cv_.notify_all();
    for (auto& t : workers_) t.join();
  }

  int size() const { return static_cast<int>(workers_.size()) + 1; }

  void run(int64_t n_tasks, const std::function<void(int64_t)>& fn) {
    if (n_tasks <= 0) return;
    if (workers_.empty() || n_tasks == 1) {
      for (int64_t t = 0; t < n_tasks; ++t) fn(t);
      return;
    }
    std::lock_guard<std::mutex> submit(submit_m_); // one job at a time
    {
      std::lock_guard<std::mutex> lk(m_);
      fn_ = &fn;
      n_tasks_ = n_tasks;
      next_.store(0);
      active_ = static_cast<int>(workers_.size());
      error_ = nullptr;
      ++generation_;
    }
    cv_.notify_all();
    work();
    std::unique_lock<std::mutex> lk(m_);
    done_cv_.wait(lk, [this] { return active_ == 0; });
    fn_ = nullptr;
    if (error_) std::rethrow_exception(error_);
  }

 private:
  void work() {
    while (true) {
      int64_t t = next_.fetch_add(1);
      if (t >= n_tasks_) break;
      try {
        (*fn_)(t);
      } catch (...) {
        std::lock_guard<std::mutex> lk(m_);
        if (!error_) error_ = std::current_exception();
      }
    }
  }

  void worker_loop() {
    uint64_t seen = 0;
    while (true) {
      {
        std::unique_lock<std::mutex> lk(m_);
        cv_.wait(lk, [&] { return stop_ || generation_ != seen; });
        if (stop_) return;
        seen = generation_;
      }
      work();
      {
        std::lock_guard<std::mutex> lk(m_);
        if (--active_ == 0) done_cv_.notify_all();
      }
    }
  }

  std::vector<std::thread> workers_;
  std::mutex m_, submit_m_;
  std::condition_variable cv_, done_cv_;
  const std::function<void(int64_t)>* fn_ = nullptr;
  int64_t n_tasks_ = 0;
  std::atomic<int64_t> next_{0};
  int active_ = 0;
  uint64_t generation_ = 0;
  bool stop_ = false;
  std::exception_ptr error_;
};

int pool_threads() {
  if (const char* e = std::getenv("TF_CPU_THREADS")) {
    int n = std::atoi(e);
    if (n >= 1) return n;
  }
  int n = static_cast<int>(std::thread::hardware_concurrency());
  return std::clamp(n, 1, 64);
}

Pool& pool() {
  // Leaked on purpose: joining threads during static destruction at interpreter exit
  // can deadlock.
  static Pool* p = new Pool(pool_threads() - 1);
  return *p;
}

} // namespace

void parallel_for(int64_t n_tasks, const std::function<void(int64_t)>& fn) {
  pool().run(n_tasks, fn);
}

int num_threads() {
  return pool().size();
}

void convert_to_f32(const void* src, FType t, int64_t n, float* dst) {
  int64_t i = 0;
  if (t == FType::f32) {
    std::memcpy(dst, src, n * sizeof(float));
    return;
  }
  const uint16_t* s = static_cast<const uint16_t*>(src);
#if TF_AVX2
  if (t == FType::bf16) {
    for (; i + 8 <= n; i += 8) {
      __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s + i));
      __m256i u = _mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16);
      _mm256_storeu_ps(dst + i, _mm256_castsi256_ps(u));
    }
  } else {
    for (; i + 8 <= n; i += 8) {
      __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s + i));
      _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(h));
    }
  }
#endif
  for (; i < n; ++i) dst[i] = (t == FType::bf16) ? bf16_to_f32(s[i]) : f16_to_f32(s[i]);
}

} // namespace tensorfold::cpu
