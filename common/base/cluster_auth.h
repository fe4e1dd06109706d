// Cluster identity (docs/security.md): the primitives both internal planes
// (the framed control plane in common/net, the KV TCP transport in kvtransfer) use to prove
// that a peer knows the cluster secret (cluster.secret_file), without sending it.
//
// A proof is HMAC-SHA256(secret, transcript). A transcript is a protocol tag followed by
// length-prefixed fields (Transcript below), so two different field lists never give the same
// bytes; each protocol puts both sides' fresh nonces and the direction of the proof in it, so a
// proof is good for one connection, one direction, once. Proofs are compared with
// CRYPTO_memcmp (constant time). All crypto is OpenSSL's libcrypto; nothing is hand-rolled.
//
// Threads: every function is thread-safe (no shared state; RAND_bytes is thread-safe in
// OpenSSL 3). ClusterSecret is an immutable value shared through a shared_ptr.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <string_view>

#include "common/base/status.h"

namespace pd::auth {

inline constexpr size_t kNonceBytes = 32;
inline constexpr size_t kProofBytes = 32;  // HMAC-SHA256
inline constexpr size_t kMinSecretBytes = 32;

// The cluster secret's bytes. Null / empty shared_ptr means "no secret configured": the planes
// are open (and every process says so at start).
using ClusterSecret = std::shared_ptr<const std::string>;

// Reads a secret file: it must exist, be a regular file, not be group- or world-readable
// (mode & 077 == 0 for the read bits) and hold at least kMinSecretBytes bytes after trailing
// whitespace (a newline an editor added) is stripped. Errors (kInvalidArgument / kNotFound)
// name the file and the problem; the caller prefixes the config key.
Result<std::string> readSecretFile(const std::string& path);

// kNonceBytes fresh random bytes (RAND_bytes). kInternal when the RNG fails (never silently
// a weak nonce).
Result<std::string> randomNonce();

// Builds the bytes a proof is computed over: tag, then each field as a 4-byte big-endian
// length and the bytes.
class Transcript {
 public:
  explicit Transcript(std::string_view tag) { add(tag); }
  Transcript& add(std::string_view field);
  Transcript& add(uint64_t value);  // 8 bytes big-endian (after its length)
  const std::string& bytes() const { return bytes_; }

 private:
  std::string bytes_;
};

// HMAC-SHA256(secret, transcript): kProofBytes bytes.
std::string proof(const std::string& secret, const Transcript& transcript);

// a == b in time that depends only on the lengths (CRYPTO_memcmp).
bool constantTimeEqual(std::string_view a, std::string_view b);

// True when `got` equals proof(secret, transcript), compared in constant time.
bool verifyProof(const std::string& secret, const Transcript& transcript, std::string_view got);

}  // namespace pd::auth
