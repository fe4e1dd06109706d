#include "router/api_keys.h"

#include <openssl/crypto.h>
#include <openssl/evp.h>
#include <strings.h>

namespace pd::router {

Sha256 sha256Of(std::string_view bytes) {
  Sha256 out{};
  unsigned int n = 0;
  EVP_Digest(bytes.data(), bytes.size(), out.data(), &n, EVP_sha256(), nullptr);
  return out;
}

namespace {

int hexValue(char c) {
  if (c >= '0' && c <= '9') return c - '0';
  if (c >= 'a' && c <= 'f') return c - 'a' + 10;
  if (c >= 'A' && c <= 'F') return c - 'A' + 10;
  return -1;
}

}  // namespace

Result<KeySet> KeySet::fromEntries(const std::vector<std::string>& entries, const std::string& what) {
  KeySet set;
  for (size_t i = 0; i < entries.size(); ++i) {
    const std::string& e = entries[i];
    if (e.rfind("sha256:", 0) == 0) {
      std::string_view hex(e);
      hex.remove_prefix(7);
      if (hex.size() != 64) return invalidArgument(what + "[" + std::to_string(i) + "]: sha256: needs 64 hex digits");
      Sha256 h{};
      for (size_t b = 0; b < 32; ++b) {
        int hi = hexValue(hex[2 * b]), lo = hexValue(hex[2 * b + 1]);
        if (hi < 0 || lo < 0) return invalidArgument(what + "[" + std::to_string(i) + "]: sha256: is not hex");
        h[b] = static_cast<unsigned char>(hi << 4 | lo);
      }
      set.hashes_.push_back(h);
    } else {
      if (e.empty()) return invalidArgument(what + "[" + std::to_string(i) + "]: empty");
      set.hashes_.push_back(sha256Of(e));
    }
  }
  return set;
}

int KeySet::match(std::string_view presented) const {
  if (presented.empty()) return -1;
  const Sha256 h = sha256Of(presented);
  int found = -1;
  for (size_t i = 0; i < hashes_.size(); ++i) {
    // No early exit: the loop's length is the set's size, whatever matched.
    const int same = CRYPTO_memcmp(h.data(), hashes_[i].data(), h.size()) == 0;
    found = same && found < 0 ? int(i) : found;
  }
  return found;
}

std::string_view KeySet::bearerToken(std::string_view header) {
  constexpr std::string_view kScheme = "bearer ";
  if (header.size() <= kScheme.size() || ::strncasecmp(header.data(), kScheme.data(), kScheme.size()) != 0) return {};
  header.remove_prefix(kScheme.size());
  while (!header.empty() && header.front() == ' ') header.remove_prefix(1);
  while (!header.empty() && (header.back() == ' ' || header.back() == '\r' || header.back() == '\n')) {
    header.remove_suffix(1);
  }
  return header;
}

void wipeSecret(std::string* secret) {
  if (!secret->empty()) OPENSSL_cleanse(secret->data(), secret->size());
  secret->clear();
}

void wipeSecrets(std::vector<std::string>* secrets) {
  for (auto& s : *secrets) wipeSecret(&s);
  secrets->clear();
}

}  // namespace pd::router
