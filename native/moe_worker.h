// A thread of the module's own that runs one MoE layer's CPU set (moe_ffn) at a time, beside the
// Python thread that drives the GPU. The driving thread hands a set over (`submit`) and collects it
// (`wait`, without the GIL); the worker never runs Python, so no GIL changes hands between the two.
// A Python worker thread would wait 0.09–0.17 ms per layer step between a set's submit and its start
// (cpu_queue_s): it has to take the GIL from the driving thread, which is busy issuing the layer's
// fills. The thread is the master of its own OpenMP team.
#pragma once

#include <chrono>
#include <condition_variable>
#include <functional>
#include <mutex>
#include <stdexcept>
#include <string>
#include <thread>
#include <utility>

#include "common.h"
#include "routed_set.h"

namespace tandem {

class MoeWorker {
 public:
  MoeWorker() : thread_([this] { loop(); }) {}
  MoeWorker(const MoeWorker&) = delete;
  MoeWorker& operator=(const MoeWorker&) = delete;

  // A set still queued is dropped; one running is finished first (its operands are the caller's, who
  // keeps them alive until `wait` returns or this object is gone).
  ~MoeWorker() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      stop_ = true;
    }
    wake_.notify_all();
    thread_.join();
  }

  // Start p on the worker. One set at a time: the previous one must have been collected.
  void submit(const MoeProblem& p, int threads) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (state_ != State::idle) throw std::logic_error("the previous CPU set has not been collected (wait)");
      problem_ = p;
      threads_ = threads;
      submitted_ = Clock::now();
      error_.clear();
      state_ = State::queued;
    }
    wake_.notify_one();
  }

  // Start a set of another kind (a quantised one, quant_moe.h) on the worker: the job owns or keeps
  // alive what it reads; same protocol as `submit`.
  void submit_job(std::function<void()> job) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (state_ != State::idle) throw std::logic_error("the previous CPU set has not been collected (wait)");
      job_ = std::move(job);
      submitted_ = Clock::now();
      error_.clear();
      state_ = State::queued;
    }
    wake_.notify_one();
  }

  // Block until the submitted set is done → (seconds from submit to start, seconds computing);
  // rethrows what the compute threw.
  std::pair<double, double> wait() {
    std::unique_lock<std::mutex> lock(mu_);
    if (state_ == State::idle) throw std::logic_error("no CPU set was submitted");
    done_.wait(lock, [this] { return state_ == State::done; });
    state_ = State::idle;
    if (!error_.empty()) throw std::runtime_error(error_);
    return {queue_s_, compute_s_};
  }

  bool pending() {
    std::lock_guard<std::mutex> lock(mu_);
    return state_ != State::idle;
  }

  // Where a set built from the layer's routing lives (routed_set.h): the caller fills it only while
  // nothing is pending, and the worker reads it until the set is collected.
  RoutedSetBuffers& routed_buffers() { return routed_; }

 private:
  using Clock = std::chrono::steady_clock;
  enum class State { idle, queued, running, done };

  void loop() {
    std::unique_lock<std::mutex> lock(mu_);
    for (;;) {
      wake_.wait(lock, [this] { return stop_ || state_ == State::queued; });
      if (stop_) return;
      state_ = State::running;
      const MoeProblem p = problem_;
      const int threads = threads_;
      std::function<void()> job = std::move(job_);
      job_ = nullptr;
      lock.unlock();
      const Clock::time_point start = Clock::now();
      std::string error;
      try {
        if (job)
          job();
        else
          moe_ffn(p, threads);
      } catch (const std::exception& e) {
        error = e.what();
      } catch (...) {
        error = "unknown error in the CPU expert set";
      }
      const Clock::time_point end = Clock::now();
      lock.lock();
      queue_s_ = std::chrono::duration<double>(start - submitted_).count();
      compute_s_ = std::chrono::duration<double>(end - start).count();
      error_ = std::move(error);
      state_ = State::done;
      done_.notify_all();
    }
  }

  std::mutex mu_;
  std::condition_variable wake_, done_;
  State state_ = State::idle;
  bool stop_ = false;
  MoeProblem problem_{};
  int threads_ = 0;
  std::function<void()> job_;  // set: the queued set is this job instead of problem_
  Clock::time_point submitted_;
  double queue_s_ = 0, compute_s_ = 0;
  std::string error_;
  RoutedSetBuffers routed_;
  std::thread thread_;  // last: starts once every member above is constructed
};

}  // namespace tandem
