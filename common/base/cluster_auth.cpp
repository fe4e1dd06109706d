#include "common/base/cluster_auth.h"

#include <openssl/crypto.h>
#include <openssl/evp.h>
#include <openssl/hmac.h>
#include <openssl/rand.h>
#include <sys/stat.h>

#include <fstream>
#include <sstream>

namespace pd::auth {

Result<std::string> readSecretFile(const std::string& path) {
  struct stat st {};
  if (::stat(path.c_str(), &st) != 0) return notFound("secret file " + path + " does not exist");
  if (!S_ISREG(st.st_mode)) return invalidArgument("secret file " + path + " is not a regular file");
  if ((st.st_mode & (S_IRWXG | S_IRWXO)) != 0) {
    char mode[8];
    std::snprintf(mode, sizeof mode, "%04o", unsigned(st.st_mode & 07777));
    return invalidArgument("secret file " + path + " has mode " + mode +
                           ": it must not be readable or writable by group or others (chmod 600)");
  }
  std::ifstream in(path, std::ios::binary);
  if (!in) return invalidArgument("secret file " + path + " cannot be opened for reading");
  std::ostringstream text;
  text << in.rdbuf();
  std::string secret = text.str();
  while (!secret.empty() &&
         (secret.back() == '\n' || secret.back() == '\r' || secret.back() == ' ' || secret.back() == '\t')) {
    secret.pop_back();
  }
  if (secret.empty()) return invalidArgument("secret file " + path + " is empty");
  if (secret.size() < kMinSecretBytes) {
    return invalidArgument("secret file " + path + " holds " + std::to_string(secret.size()) +
                           " bytes of secret; at least " + std::to_string(kMinSecretBytes) +
                           " are needed (e.g. head -c 48 /dev/urandom | base64 > FILE)");
  }
  return secret;
}

Result<std::string> randomNonce() {
  std::string nonce(kNonceBytes, '\0');
  if (RAND_bytes(reinterpret_cast<unsigned char*>(nonce.data()), int(nonce.size())) != 1) {
    return internalError("RAND_bytes failed: no nonce for the cluster handshake");
  }
  return nonce;
}

Transcript& Transcript::add(std::string_view field) {
  const uint32_t n = uint32_t(field.size());
  const char len[4] = {char(n >> 24), char(n >> 16), char(n >> 8), char(n)};
  bytes_.append(len, 4);
  bytes_.append(field);
  return *this;
}

Transcript& Transcript::add(uint64_t value) {
  char b[8];
  for (int i = 0; i < 8; ++i) b[i] = char(value >> (56 - 8 * i));
  return add(std::string_view(b, 8));
}

std::string proof(const std::string& secret, const Transcript& transcript) {
  unsigned char out[EVP_MAX_MD_SIZE];
  unsigned int len = 0;
  const std::string& t = transcript.bytes();
  if (HMAC(EVP_sha256(), secret.data(), int(secret.size()), reinterpret_cast<const unsigned char*>(t.data()), t.size(),
           out, &len) == nullptr ||
      len != kProofBytes) {
    return {};  // never matches a proof (verifyProof checks the length first)
  }
  return std::string(reinterpret_cast<const char*>(out), len);
}

bool constantTimeEqual(std::string_view a, std::string_view b) {
  return a.size() == b.size() && (a.empty() || CRYPTO_memcmp(a.data(), b.data(), a.size()) == 0);
}

bool verifyProof(const std::string& secret, const Transcript& transcript, std::string_view got) {
  const std::string want = proof(secret, transcript);
  if (want.size() != kProofBytes || got.size() != kProofBytes) return false;
  return CRYPTO_memcmp(want.data(), got.data(), kProofBytes) == 0;
}

}  // namespace pd::auth
