// Threads kept between calls, for callers that bring no OpenMP team (NumPy's). Starting and
// joining a thread per call took 50-100 µs on the 2-core machine this was measured on, as much
// as a whole short decoding step. The kept threads watch for work for a while after each call
// (`spin`, 300 µs: a model calls once per layer, tens to hundreds of µs apart), then sleep on a
// condition variable, whose wake-up took 20-100 µs there. Measured there, KVCache.attend of a
// 64-key step on 2 threads: a median of 185-245 µs with no watching, 150 with 50 µs of it, 77-131
// with 300 (one thread: 70-90). OpenMP runtimes and OpenBLAS keep their threads spinning too.
//
// run(fn, arg, n) has GOMP_parallel's meaning (fn(arg) on n threads, the caller one of them),
// so the kernels' for_tasks treats both teams alike. One call at a time: a second caller that
// finds the pool busy (two Python threads in native calls at once) gets false and starts its
// own threads, as every call did before. After fork() the child gets a new, empty pool (the
// parent's threads do not exist there). The pool is never destroyed: its threads sleep until
// the process ends, with every signal blocked, so signals still reach Python's main thread.

#pragma once

#include <pthread.h>
#include <signal.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <mutex>
#include <new>
#include <thread>
#include <vector>

// Hidden: one pool for the whole library (its five sources share these inline functions), and
// none shared with another library that includes this header.
namespace qkv_native __attribute__((visibility("hidden"))) {

class Pool {
   public:
    // fn(arg) on n threads, the caller one of them (fewer if threads could not be started:
    // fn must share its work out itself, as for_tasks' counter does). False if the pool is
    // busy with another call; then nothing has run.
    bool run(void (*fn)(void*), void* arg, unsigned n) {
        std::unique_lock<std::mutex> call(call_, std::try_to_lock);
        if (!call.owns_lock()) return false;
        const unsigned team = grow(n > 0 ? n - 1 : 0);
        if (team > 0) {
            std::lock_guard<std::mutex> g(m_);
            fn_ = fn;
            arg_ = arg;
            team_ = team;
            left_ = team;
            ++generation_;
        }
        if (team > 0) wake_.notify_all();
        fn(arg);
        if (team > 0 && !watch([this] { return left_.load() == 0; })) {
            std::unique_lock<std::mutex> g(m_);
            done_.wait(g, [this] { return left_.load() == 0; });
        }
        return true;
    }

    // How long a thread watches for a change before it sleeps.
    static constexpr std::chrono::microseconds spin{300};

   private:
    // Starts threads until `want` are kept (as many as could be started); how many there are.
    unsigned grow(unsigned want) {
        while (threads_ < want) {
            uint64_t seen;
            {
                std::lock_guard<std::mutex> g(m_);
                seen = generation_;
            }
            try {
                std::thread(&Pool::loop, this, threads_, seen).detach();
            } catch (...) {
                break;
            }
            ++threads_;
        }
        return threads_ < want ? threads_ : want;
    }

    // Polls until ready() or `spin` has passed; ready() then.
    template <typename Ready>
    static bool watch(const Ready& ready) {
        const auto until = std::chrono::steady_clock::now() + spin;
        for (unsigned i = 1;; ++i) {
            if (ready()) return true;
#if defined(__x86_64__) || defined(__i386__)
            __builtin_ia32_pause();
#endif
            if (i % 64 == 0 && std::chrono::steady_clock::now() > until) return ready();
        }
    }

    void loop(unsigned index, uint64_t seen) {
        sigset_t all;
        sigfillset(&all);
        pthread_sigmask(SIG_BLOCK, &all, nullptr);
        std::unique_lock<std::mutex> g(m_, std::defer_lock);
        for (;;) {
            watch([&] { return generation_.load() != seen; });
            g.lock();
            wake_.wait(g, [&] { return generation_.load() != seen; });
            seen = generation_.load();
            if (index >= team_) {  // not in this call's team
                g.unlock();
                continue;
            }
            void (*fn)(void*) = fn_;
            void* arg = arg_;
            g.unlock();
            fn(arg);
            g.lock();
            if (--left_ == 0) done_.notify_one();
            g.unlock();
        }
    }

    std::mutex call_;  // held by the one call running
    std::mutex m_;     // guards the fields below
    std::condition_variable wake_, done_;
    void (*fn_)(void*) = nullptr;
    void* arg_ = nullptr;
    unsigned team_ = 0, threads_ = 0;
    std::atomic<unsigned> left_{0};
    std::atomic<uint64_t> generation_{0};
};

// The process's pool, made at first use; a fresh one in a child after fork(). No lock is
// taken here, so none can be left held in a child forked during a call.
inline std::atomic<Pool*>& pool_slot() {
    static std::atomic<Pool*> slot{nullptr};
    return slot;
}

inline void pool_after_fork() { pool_slot().store(nullptr); }  // the parent's is left as it was

inline bool pool_run(void (*fn)(void*), void* arg, unsigned n) {
    static const bool hooked = pthread_atfork(nullptr, nullptr, pool_after_fork) == 0;
    (void)hooked;
    Pool* p = pool_slot().load();
    if (!p) {
        Pool* fresh = new (std::nothrow) Pool();
        if (!fresh) return false;
        if (pool_slot().compare_exchange_strong(p, fresh))
            p = fresh;
        else
            delete fresh;  // another call made one first (p is now that one); this had no threads
    }
    return p->run(fn, arg, n);
}

}  // namespace qkv_native
