// A CPU emulation of the Metal execution model, enough to run this project's Metal kernels
// (metal/*.metal) as MLX's mx.fast.metal_kernel would launch them: a grid of threadgroups, each
// thread a fiber on one OS thread, simdgroups of 32 threads that meet at every
// simd_* operation and barrier. Threadgroups run one after another.
//
// What it checks while it runs (each a launch error, reported to Python):
// - every index into a device / constant buffer is inside the buffer (dptr::operator[]);
// - the 32 threads of a simdgroup reach each simdgroup operation together (a thread that has
//   returned, or waits at another kind of operation, while the others wait = divergence);
// - a threadgroup barrier is reached by every thread of the threadgroup.
//
// - (with another thread order, emu_launch's `order`) nothing depends on which thread of a
//   threadgroup runs first between two meeting points: a data race on threadgroup memory shows
//   as different bits.
//
// What it does NOT model: Apple's compiler (nothing here was compiled by it), its fast-math
// choices, memory ordering beyond the barriers, or timing. The arithmetic is IEEE float32 with
// fma exact (std::fma) and no contraction (-ffp-contract=off), which is what the kernels' own
// explicit fma calls and the row-exact contract rely on.
#pragma once
#pragma GCC system_header   // the emulator's own code: its GNU extensions are not the kernels'

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <cstdint>
#include <type_traits>
#include <ucontext.h>

typedef unsigned int uint;
typedef unsigned short ushort;
typedef unsigned char uchar;

struct uint3 {
  uint x, y, z;
};

namespace emu {

enum State : int { RUN = 0, AT_SIMD = 1, AT_TG = 2, DONE = 3, FAILED = 4 };

enum Tag : int {
  T_SHUFFLE = 1, T_SHUFFLE_READ, T_REDUCE, T_REDUCE_READ,
  T_SIMD_BARRIER, T_SIMD_BARRIER_NOMEM, T_TG_BARRIER, T_TG_BARRIER_NOMEM
};

constexpr int SIMD = 32;
constexpr int MAX_THREADS = 1024;
constexpr size_t STACK = 256 * 1024;

struct Lane {
#if defined(__x86_64__)
  void* sp;
#else
  ucontext_t ctx;
#endif
  int state;
  int tag;
  unsigned long long site;   // where in the code it waits (call_site)
};

struct Launch {
  int nthreads = 0;   // threads in the current threadgroup
  int cur = 0;        // the running thread (linear index in its threadgroup)
  Lane lanes[MAX_THREADS];
  char* stacks = nullptr;
#if defined(__x86_64__)
  void* sched_sp = nullptr;
#else
  ucontext_t sched;
#endif
  alignas(16) unsigned char slot[MAX_THREADS][16];
  char err[512] = {0};
  int order = 0;      // the threads' order between meeting points (run_group)
  unsigned serial = 0;                 // threadgroups run so far (tg_array's fresh memory)
  unsigned sep[MAX_THREADS / SIMD];    // memory barriers each simdgroup has passed
  unsigned tep = 0;                    // threadgroup memory barriers the threadgroup has passed
  void (*body)(void*, int) = nullptr;   // runs thread t of the current threadgroup
  void* ctx = nullptr;
};

inline Launch* L = nullptr;

#if defined(__x86_64__)
// A context switch of the System V x86-64 ABI: the callee-saved registers on the old stack, its
// stack pointer to *save, then the new stack's. (ucontext's swapcontext makes a system call a
// switch to save the signal mask: 20-50x slower, and a kernel meets its simdgroup thousands of
// times a threadgroup.)
extern "C" void emu_switch(void** save, void* to);
asm(R"(
.text
.globl emu_switch
.hidden emu_switch
.type emu_switch,@function
emu_switch:
  pushq %rbp
  pushq %rbx
  pushq %r12
  pushq %r13
  pushq %r14
  pushq %r15
  movq %rsp, (%rdi)
  movq %rsi, %rsp
  popq %r15
  popq %r14
  popq %r13
  popq %r12
  popq %rbx
  popq %rbp
  ret
.size emu_switch, .-emu_switch
)");
#endif

inline void to_sched() {
#if defined(__x86_64__)
  emu_switch(&L->lanes[L->cur].sp, L->sched_sp);
#else
  swapcontext(&L->lanes[L->cur].ctx, &L->sched);
#endif
}

[[noreturn]] inline void fail(const char* msg) {
  if (!L->err[0]) std::snprintf(L->err, sizeof(L->err), "thread %d: %s", L->cur, msg);
  L->lanes[L->cur].state = FAILED;
  to_sched();   // never resumed
  std::abort();
}

// Where the running thread is in the code: a hash of the return addresses up its stack (built
// with -fno-omit-frame-pointer). Two threads of a simdgroup at one kind of operation but at
// different places (a shuffle in each arm of a branch) have diverged: on a GPU each shuffle runs
// with half the lanes, reading inactive ones. The same place in another loop turn is not told
// apart.
__attribute__((noinline)) inline unsigned long long call_site() {
  unsigned long long h = 1469598103934665603ull;
  void** fp = (void**)__builtin_frame_address(0);
  const char* lo = L->stacks + (size_t)L->cur * STACK;
  const char* hi = lo + STACK;
  for (int d = 0; d < 32 && fp && (const char*)fp >= lo && (const char*)fp < hi; ++d) {
    h = (h ^ (unsigned long long)(uintptr_t)fp[1]) * 1099511628211ull;
    fp = (void**)fp[0];
  }
  return h;
}

// This thread waits at a simdgroup (AT_SIMD) or threadgroup (AT_TG) meeting point.
inline void arrive(int scope, int tag) {
  Lane& me = L->lanes[L->cur];
  me.state = scope;
  me.tag = tag;
  me.site = call_site();
  to_sched();
}

inline int lane_id() { return L->cur % SIMD; }
inline int simd_base() { return L->cur - L->cur % SIMD; }

[[noreturn]] static void fiber_entry() {
  L->body(L->ctx, L->cur);
  L->lanes[L->cur].state = DONE;
  to_sched();   // never resumed
  std::abort();
}

#if !defined(__x86_64__)
static void trampoline() { fiber_entry(); }
#endif

inline void start_fiber(int t) {
  Lane& ln = L->lanes[t];
  char* top = L->stacks + (size_t)(t + 1) * STACK;
#if defined(__x86_64__)
  void** sp = (void**)((uintptr_t)top & ~(uintptr_t)15) - 8;
  for (int i = 0; i < 6; ++i) sp[i] = nullptr;    // r15, r14, r13, r12, rbx, rbp
  sp[6] = (void*)&fiber_entry;                    // emu_switch's ret lands here
  sp[7] = nullptr;                                // fiber_entry's (never used) return address
  ln.sp = sp;
#else
  getcontext(&ln.ctx);
  ln.ctx.uc_stack.ss_sp = top - STACK;
  ln.ctx.uc_stack.ss_size = STACK;
  ln.ctx.uc_link = nullptr;
  makecontext(&ln.ctx, trampoline, 0);
#endif
}

inline void resume(int t) {
  L->cur = t;
#if defined(__x86_64__)
  emu_switch(&L->sched_sp, L->lanes[t].sp);
#else
  swapcontext(&L->sched, &L->lanes[t].ctx);
#endif
}

// Runs one threadgroup of n threads to completion; false (L->err set) on a launch error.
inline bool run_group(int n) {
  L->nthreads = n;
  L->serial++;
  L->tep = 0;
  for (int s = 0; s < MAX_THREADS / SIMD; ++s) L->sep[s] = 0;
  for (int t = 0; t < n; ++t) {
    start_fiber(t);
    L->lanes[t].state = RUN;
    L->lanes[t].tag = 0;
  }
  unsigned rnd = 0x9E3779B9u;
  for (;;) {
    // Between two meeting points each thread runs alone, in an order set by L->order: 0 thread 0
    // first, 1 the last thread first, 2 a fresh pseudo-random order every round. A kernel whose
    // result changes with the order reads memory another thread writes without a barrier between.
    int perm[MAX_THREADS];
    for (int t = 0; t < n; ++t) perm[t] = L->order == 1 ? n - 1 - t : t;
    if (L->order == 2) {
      for (int t = n - 1; t > 0; --t) {
        rnd = rnd * 1664525u + 1013904223u;
        const int j = (int)((rnd >> 8) % (unsigned)(t + 1));
        const int tmp = perm[t];
        perm[t] = perm[j];
        perm[j] = tmp;
      }
    }
    for (int i = 0; i < n; ++i) {
      const int t = perm[i];
      if (L->lanes[t].state != RUN) continue;
      resume(t);
      if (L->err[0]) return false;
    }
    bool all_done = true, released = false, all_tg = true;
    int tg_tag = -1;
    unsigned long long tg_site = 0;
    for (int t = 0; t < n; ++t) {
      const Lane& ln = L->lanes[t];
      if (ln.state != DONE) all_done = false;
      if (ln.state != AT_TG || (tg_tag >= 0 && (ln.tag != tg_tag || ln.site != tg_site))) all_tg = false;
      if (ln.state == AT_TG) {
        tg_tag = ln.tag;
        tg_site = ln.site;
      }
    }
    if (all_done) return true;
    if (n % SIMD != 0) {
      std::snprintf(L->err, sizeof(L->err), "threadgroup of %d threads: not whole simdgroups", n);
      return false;
    }
    for (int s = 0; s < n; s += SIMD) {
      int at = 0, done = 0, tag = -1;
      unsigned long long site = 0;
      bool same = true;
      for (int t = s; t < s + SIMD; ++t) {
        if (L->lanes[t].state == AT_SIMD) {
          if (at++ == 0) {
            tag = L->lanes[t].tag;
            site = L->lanes[t].site;
          }
          same = same && L->lanes[t].tag == tag && L->lanes[t].site == site;
        } else if (L->lanes[t].state == DONE) {
          ++done;
        }
      }
      if (at == 0) continue;
      if (at == SIMD && same) {
        for (int t = s; t < s + SIMD; ++t) L->lanes[t].state = RUN;
        if (tag == T_SIMD_BARRIER) L->sep[s / SIMD]++;
        released = true;
      } else if (at + done == SIMD || !same) {
        std::snprintf(L->err, sizeof(L->err),
                      "simdgroup %d diverged: %d threads wait at a simdgroup operation, %d have "
                      "returned, %s", s / SIMD, at, done,
                      same ? "all at one" : "at different operations or places in the code");
        return false;
      }
    }
    if (!released && all_tg) {
      for (int t = 0; t < n; ++t) L->lanes[t].state = RUN;
      if (tg_tag == T_TG_BARRIER) {
        L->tep++;
        for (int s = 0; s < n / SIMD; ++s) L->sep[s]++;
      }
      released = true;
    }
    if (!released) {
      std::snprintf(L->err, sizeof(L->err),
                    "deadlock: threads wait at barriers the others never reach");
      return false;
    }
  }
}

// A device / constant buffer: every index is checked.
template <class T>
struct dptr {
  T* p;
  long long n;
  const char* name;
  template <class I, class = std::enable_if_t<std::is_integral_v<I>>>
  T& operator[](I i) const {
    if ((std::is_signed_v<I> && (long long)i < 0) || (unsigned long long)i >= (unsigned long long)n) {
      char m[160];
      std::snprintf(m, sizeof(m), "index %lld out of %s's %lld elements", (long long)i, name, n);
      fail(m);
    }
    return p[i];
  }
};

// Threadgroup memory (`threadgroup T name[N];` in a kernel, rewritten by metal_emu.render): one
// array for the threadgroup, fresh (NaN bytes, no element written) in each threadgroup, with each
// element's last writer and readers checked against the barriers passed since:
// - a read of an element no thread of this threadgroup has written is an error (on a GPU it holds
//   whatever was there);
// - a read of an element another thread wrote, a write of one another thread wrote or read, with
//   no memory barrier (simdgroup_barrier / threadgroup_barrier with mem_threadgroup) between the
//   two, is an error: a data race. (A shuffle is not a memory barrier: the threads of a simdgroup
//   meeting at one does not order their threadgroup memory.)
struct TgState {
  int writer;        // thread, -1 none
  unsigned w_sep, w_tep;
  int reader;        // thread, -1 none, -2 several
  unsigned r_sep, r_tep;
};

// a barrier separates thread `other`'s access at (sep, tep) from now, for the running thread
inline bool ordered(int other, unsigned sep, unsigned tep) {
  if (L->tep > tep) return true;
  return other / SIMD == L->cur / SIMD && L->sep[L->cur / SIMD] > sep;
}

template <class T, int N>
struct tg_array {
  T v[N];
  TgState st[N];
  unsigned gen = 0;

  void fresh() {
    if (gen == L->serial) return;
    gen = L->serial;
    std::memset((void*)v, 0xFF, sizeof(v));
    for (int i = 0; i < N; ++i) st[i] = TgState{-1, 0, 0, -1, 0, 0};
  }
  T read(int i) {
    TgState& e = st[i];
    char m[200];
    if (e.writer == -1) {
      std::snprintf(m, sizeof(m), "reads threadgroup memory [%d] that no thread of this threadgroup wrote", i);
      fail(m);
    }
    if (e.writer != L->cur && !ordered(e.writer, e.w_sep, e.w_tep)) {
      std::snprintf(m, sizeof(m), "reads threadgroup memory [%d] that thread %d wrote with no barrier "
                    "between (a data race)", i, e.writer);
      fail(m);
    }
    const unsigned sep = L->sep[L->cur / SIMD];
    if (e.reader == -1 || ordered(e.reader < 0 ? L->cur : e.reader, e.r_sep, e.r_tep)) {
      e.reader = L->cur;
      e.r_sep = sep;
      e.r_tep = L->tep;
    } else if (e.reader != L->cur) {
      e.reader = -2;
    }
    return v[i];
  }
  void write(int i, T x) {
    TgState& e = st[i];
    char m[200];
    if (e.writer != -1 && e.writer != L->cur && !ordered(e.writer, e.w_sep, e.w_tep)) {
      std::snprintf(m, sizeof(m), "writes threadgroup memory [%d] that thread %d wrote with no barrier "
                    "between (a data race)", i, e.writer);
      fail(m);
    }
    if ((e.reader == -2 || (e.reader >= 0 && e.reader != L->cur)) &&
        !ordered(e.reader < 0 ? L->cur : e.reader, e.r_sep, e.r_tep)) {
      std::snprintf(m, sizeof(m), "writes threadgroup memory [%d] that %s read with no barrier "
                    "between (a data race)", i, e.reader == -2 ? "other threads" : "another thread");
      fail(m);
    }
    e.writer = L->cur;
    e.w_sep = L->sep[L->cur / SIMD];
    e.w_tep = L->tep;
    e.reader = -1;
    v[i] = x;
  }

  struct ref {
    tg_array* a;
    int i;
    operator T() const { return a->read(i); }
    ref& operator=(T x) {
      a->write(i, x);
      return *this;
    }
    ref& operator=(const ref& o) {
      a->write(i, (T)o);
      return *this;
    }
  };
  template <class I, class = std::enable_if_t<std::is_integral_v<I>>>
  ref operator[](I i) {
    if ((std::is_signed_v<I> && (long long)i < 0) || (unsigned long long)i >= (unsigned long long)N) {
      char m[160];
      std::snprintf(m, sizeof(m), "index %lld out of threadgroup memory of %d elements", (long long)i, N);
      fail(m);
    }
    fresh();
    return ref{this, (int)i};
  }
};

}  // namespace emu
