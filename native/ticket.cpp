#include "ticket.h"

#include <chrono>
#include <stdexcept>
#include <utility>

namespace lmd {

CountdownTicket::CountdownTicket(std::uint64_t nbytes, std::size_t num_copies,
                                 std::size_t parts, std::shared_ptr<const void> keep_alive)
    : Ticket(nbytes, num_copies), remaining_(parts), keep_alive_(std::move(keep_alive)) {}

void CountdownTicket::raise_if_failed_locked() const {
  if (!error_.empty()) throw std::runtime_error("copy batch failed: " + error_);
}

bool CountdownTicket::poll() {
  std::lock_guard<std::mutex> lock(mu_);
  raise_if_failed_locked();
  return done_locked();
}

bool CountdownTicket::wait(double timeout_s) {
  std::unique_lock<std::mutex> lock(mu_);
  constexpr double kForever = 1e7;  // seconds; longer limits wait without one
  if (!(timeout_s >= 0) || timeout_s > kForever) {
    cv_.wait(lock, [this] { return done_locked(); });
  } else {
    auto limit = std::chrono::duration<double>(timeout_s);
    cv_.wait_for(lock, std::chrono::duration_cast<std::chrono::nanoseconds>(limit),
                 [this] { return done_locked(); });
  }
  raise_if_failed_locked();
  return done_locked();
}

void CountdownTicket::finish(const std::string& error) {
  std::shared_ptr<const void> released;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (!error.empty() && error_.empty()) error_ = error;
    if (remaining_ > 0) --remaining_;
    if (remaining_ == 0) released = std::move(keep_alive_);
  }
  cv_.notify_all();
  // `released` drops the regions here, outside the lock.
}

}  // namespace lmd
