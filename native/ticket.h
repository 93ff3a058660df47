// A Ticket tracks one submitted batch of copies until it completes.
#pragma once

#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>

namespace lmd {

class Ticket {
 public:
  Ticket(std::uint64_t nbytes, std::size_t num_copies)
      : nbytes_(nbytes), num_copies_(num_copies) {}
  virtual ~Ticket() = default;
  Ticket(const Ticket&) = delete;
  Ticket& operator=(const Ticket&) = delete;

  // True once every copy finished; throws std::runtime_error if the batch failed.
  virtual bool poll() = 0;
  // Blocks up to `timeout_s` seconds (< 0: no limit); true when done, false on timeout.
  // Throws like poll() when the batch failed.
  virtual bool wait(double timeout_s) = 0;

  std::uint64_t nbytes() const { return nbytes_; }          // bytes the batch moves
  std::size_t num_copies() const { return num_copies_; }   // after merging adjacent ops

 private:
  std::uint64_t nbytes_;
  std::size_t num_copies_;
};

// Done when `parts` independent pieces of work have each called finish(). Holds what
// the copies touch (`keep_alive`) until then.
class CountdownTicket final : public Ticket {
 public:
  CountdownTicket(std::uint64_t nbytes, std::size_t num_copies, std::size_t parts,
                  std::shared_ptr<const void> keep_alive);

  bool poll() override;
  bool wait(double timeout_s) override;

  // Marks one part done; `error` non-empty marks the whole batch failed.
  void finish(const std::string& error = {});

 private:
  bool done_locked() const { return remaining_ == 0; }
  void raise_if_failed_locked() const;

  std::mutex mu_;
  std::condition_variable cv_;
  std::size_t remaining_;
  std::string error_;
  std::shared_ptr<const void> keep_alive_;
};

}  // namespace lmd
