// A fixed set of worker threads running queued tasks in order. The host transport
// splits large copy batches across it. Workers never touch Python.
#pragma once

#include <condition_variable>
#include <cstddef>
#include <deque>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

namespace lmd {

class ThreadPool {
 public:
  explicit ThreadPool(std::size_t num_threads);
  ~ThreadPool();  // runs what is queued, then joins
  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;

  std::size_t size() const { return workers_.size(); }
  // Queues `task`; returns false (and drops it) once shutdown() began.
  bool post(std::function<void()> task);
  // Lets queued tasks finish, then joins the workers. Idempotent; not from a worker.
  void shutdown();

 private:
  void run();

  std::mutex join_mu_;  // serializes shutdown() callers
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::function<void()>> tasks_;
  bool stopping_ = false;
  std::vector<std::thread> workers_;
};

}  // namespace lmd
