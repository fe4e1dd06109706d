// SHA-256, incrementally: feed bytes with update(), read the digest once with hex().
//
//   Sha256 h;
//   h.update(header);
//   h.update(sample.data(), sample.size());
//   std::string id = h.hex();  // 64 lowercase hex digits
//
// OpenSSL's libcrypto does the work (nothing hand-rolled). Not thread-safe: one hasher per
// thread. hex() finishes the hash; update() after it is a programming error (it restarts).
#pragma once

#include <cstddef>
#include <memory>
#include <string>
#include <string_view>

namespace pd {

class Sha256 {
 public:
  Sha256();
  ~Sha256();
  Sha256(const Sha256&) = delete;
  Sha256& operator=(const Sha256&) = delete;

  void update(const void* data, size_t len);
  void update(std::string_view s) { update(s.data(), s.size()); }
  std::string hex();

 private:
  struct State;
  std::unique_ptr<State> state_;
};

}  // namespace pd
