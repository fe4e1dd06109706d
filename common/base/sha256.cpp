#include "common/base/sha256.h"

#include <openssl/evp.h>

#include <cstdio>
#include <stdexcept>

namespace pd {

struct Sha256::State {
  EVP_MD_CTX* ctx = nullptr;
};

Sha256::Sha256() : state_(std::make_unique<State>()) {
  state_->ctx = EVP_MD_CTX_new();
  // Allocation failure of a few bytes: nothing sensible to return to.
  if (!state_->ctx || EVP_DigestInit_ex(state_->ctx, EVP_sha256(), nullptr) != 1)
    throw std::runtime_error("Sha256: EVP_DigestInit_ex failed");
}

Sha256::~Sha256() { EVP_MD_CTX_free(state_->ctx); }

void Sha256::update(const void* data, size_t len) {
  if (len > 0) EVP_DigestUpdate(state_->ctx, data, len);
}

std::string Sha256::hex() {
  unsigned char md[EVP_MAX_MD_SIZE];
  unsigned int n = 0;
  EVP_DigestFinal_ex(state_->ctx, md, &n);
  EVP_DigestInit_ex(state_->ctx, EVP_sha256(), nullptr);
  std::string out(size_t(n) * 2, '0');
  for (unsigned int i = 0; i < n; ++i) std::snprintf(&out[size_t(i) * 2], 3, "%02x", md[i]);
  return out;
}

}  // namespace pd
