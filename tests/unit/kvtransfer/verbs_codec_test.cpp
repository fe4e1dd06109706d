// The verbs transport's device-independent logic: blobs, WRITE planning.
#include "kvtransfer/transports/verbs_codec.h"

#include <random>

#include <catch2/catch.hpp>

#include "kvtransfer/kvt.pb.h"

using namespace pd;
using namespace pd::kvt::verbs;
namespace proto = pd::kvt::proto;

TEST_CASE("verbs: remote keys round-trip and bad blobs are refused with a reason") {
  PackedKey k{0x7f0012345000ull, 1ull << 33, 0xdeadbeef};
  std::string blob = encodeKey(k);
  auto back = decodeKey(blob);
  REQUIRE(back.ok());
  CHECK(back->addr == k.addr);
  CHECK(back->len == k.len);
  CHECK(back->rkey == k.rkey);

  // Every blob cut short is refused: mid-field it does not parse, at a field boundary it lacks
  // a field (both kDataLoss); before the magic is complete it is not a verbs blob at all.
  for (size_t n = 0; n < blob.size(); ++n) {
    auto cut = decodeKey(blob.substr(0, n));
    CHECK(!cut.ok());
    CHECK(cut.status().code() == (n < 5 ? StatusCode::kInvalidArgument : StatusCode::kDataLoss));
  }
  CHECK(decodeKey(blob + "x").status().code() == StatusCode::kDataLoss);  // a tag without its value
  std::string wrongMagic = blob;
  wrongMagic[1] ^= 1;  // byte 0 is the tag of field 1, bytes 1..4 the magic
  CHECK(decodeKey(wrongMagic).status().message().find("bad magic") != std::string::npos);
  proto::VerbsRemoteKey m;
  REQUIRE(m.ParseFromString(blob));
  m.set_version(9);
  CHECK(decodeKey(m.SerializeAsString()).status().message().find("version 9") != std::string::npos);
  m.set_version(2);
  m.clear_rkey();
  CHECK(decodeKey(m.SerializeAsString()).status().code() == StatusCode::kDataLoss);
  CHECK(decodeKey(encodeKey(PackedKey{1, 0, 1})).status().code() == StatusCode::kInvalidArgument);
  CHECK(decodeKey(encodeKey(PackedKey{~0ull - 4, 100, 1})).status().code() == StatusCode::kInvalidArgument);
  // Another transport's key, and the connection info, are not verbs keys.
  pd::kvt::proto::TcpRemoteKey tcp;
  tcp.set_token(1);
  tcp.set_addr(k.addr);
  tcp.set_len(k.len);
  CHECK(decodeKey(tcp.SerializeAsString()).status().message().find("bad magic") != std::string::npos);
  ConnInfo c;
  c.mtu = 1;
  CHECK(decodeKey(encodeConnInfo(c)).status().code() == StatusCode::kInvalidArgument);
}

TEST_CASE("verbs: blobs decode to an error, never a crash, whatever the bytes") {
  std::mt19937 rng(7);
  const std::string key = encodeKey(PackedKey{0x1000, 0x1000, 5});
  ConnInfo c;
  c.name = "x";
  c.mtu = 3;
  const std::string conn = encodeConnInfo(c);
  for (int i = 0; i < 2000; ++i) {
    std::string junk(rng() % 64, '\0');
    for (char& ch : junk) ch = static_cast<char>(rng());
    CHECK(!decodeKey(junk).ok());
    CHECK(!decodeConnInfo(junk).ok());
    // Flipped bytes of a real blob: an error or a validated value, nothing else.
    std::string flipped = i % 2 ? key : conn;
    flipped[rng() % flipped.size()] ^= static_cast<char>(1 + rng() % 255);
    (void)decodeKey(flipped);
    (void)decodeConnInfo(flipped);
  }
}

TEST_CASE("verbs: connection info round-trips and is validated") {
  ConnInfo c;
  c.name = "prefill-3";
  c.lid = 0x1234;
  for (int i = 0; i < 16; ++i) c.gid[i] = static_cast<uint8_t>(i * 11);
  c.gidIndex = 3;
  c.port = 2;
  c.mtu = 5;
  c.qpn = 0xabcdef;
  c.psn = 0x123456;
  auto back = decodeConnInfo(encodeConnInfo(c));
  REQUIRE(back.ok());
  CHECK(back->name == "prefill-3");
  CHECK(back->lid == 0x1234);
  CHECK(back->gid == c.gid);
  CHECK(back->gidIndex == 3);
  CHECK(back->port == 2);
  CHECK(back->mtu == 5);
  CHECK(back->qpn == 0xabcdef);
  CHECK(back->psn == 0x123456);

  ConnInfo wide = c;
  wide.qpn = 0x1000000;
  CHECK(decodeConnInfo(encodeConnInfo(wide)).status().code() == StatusCode::kInvalidArgument);
  ConnInfo badMtu = c;
  badMtu.mtu = 6;
  CHECK(decodeConnInfo(encodeConnInfo(badMtu)).status().message().find("MTU") != std::string::npos);
  std::string blob = encodeConnInfo(c);
  CHECK(decodeConnInfo(blob.substr(0, 20)).status().code() == StatusCode::kDataLoss);
  for (size_t n = 0; n < blob.size(); ++n) CHECK(!decodeConnInfo(blob.substr(0, n)).ok());
  proto::VerbsConnInfo m;
  REQUIRE(m.ParseFromString(blob));
  m.set_gid("short");
  CHECK(decodeConnInfo(m.SerializeAsString()).status().message().find("GID") != std::string::npos);
  m.set_gid(std::string(16, '\0'));
  m.set_port(256);
  CHECK(decodeConnInfo(m.SerializeAsString()).status().code() == StatusCode::kInvalidArgument);
  // A key blob is not connection info.
  CHECK(decodeConnInfo(encodeKey(PackedKey{1, 1, 1})).status().code() == StatusCode::kInvalidArgument);
}

TEST_CASE("verbs: a reply's peer QP number round-trips; an offer has none") {
  ConnInfo offer;
  offer.name = "decode-0";
  offer.mtu = 3;
  offer.qpn = 0x111;
  offer.psn = 7;
  auto o = decodeConnInfo(encodeConnInfo(offer));
  REQUIRE(o.ok());
  CHECK(!o->peerQpn.has_value());
  ConnInfo reply = offer;
  reply.name = "prefill-1";
  reply.qpn = 0x222;
  reply.peerQpn = 0x111;
  const std::string blob = encodeConnInfo(reply);
  auto r = decodeConnInfo(blob);
  REQUIRE(r.ok());
  REQUIRE(r->peerQpn.has_value());
  CHECK(*r->peerQpn == 0x111u);
  CHECK(r->qpn == 0x222u);
  CHECK(r->name == "prefill-1");
  // A reply cut short never reads as an offer: the peer QP number comes first on the wire, so
  // every strict prefix lacks a field the decoder requires.
  for (size_t n = 0; n < blob.size(); ++n) CHECK(!decodeConnInfo(blob.substr(0, n)).ok());
  CHECK(decodeConnInfo(blob + "z").status().code() == StatusCode::kDataLoss);
  // Unknown fields (a later version's) are skipped, as protobuf does.
  auto later = decodeConnInfo(blob + std::string("\xa0\x01\x05", 3));  // field 20, varint 5
  REQUIRE(later.ok());
  CHECK(*later->peerQpn == 0x111u);
  ConnInfo wide = reply;
  wide.peerQpn = 0x1000000;
  CHECK(decodeConnInfo(encodeConnInfo(wide)).status().code() == StatusCode::kInvalidArgument);
}

TEST_CASE("verbs: a reply connects exactly the QP it names, an offer the oldest or a fresh one") {
  PendingQps pending;
  ConnInfo offer;
  offer.name = "decode-0";
  offer.qpn = 0x50;
  // Nothing offered here: an offer needs a fresh QP, a reply is refused with a reason.
  auto fresh = pending.choose(offer);
  REQUIRE(fresh.ok());
  CHECK(!fresh->has_value());
  ConnInfo reply = offer;
  reply.name = "prefill-2";
  reply.peerQpn = 0x10;
  auto none = pending.choose(reply);
  CHECK(none.status().code() == StatusCode::kFailedPrecondition);
  CHECK_THAT(none.status().message(), Catch::Contains("prefill-2") && Catch::Contains("QP 16"));

  // Three QPs offered to three peers; their replies come back in another order.
  pending.offer(0x10);
  pending.offer(0x20);
  pending.offer(0x30);
  for (uint32_t qpn : {0x30u, 0x10u}) {
    reply.peerQpn = qpn;
    auto c = pending.choose(reply);
    REQUIRE(c.ok());
    REQUIRE(c->has_value());
    CHECK(**c == qpn);  // paired by number, not "oldest"
    pending.take(qpn);
  }
  CHECK(pending.size() == 1);
  // A reply naming a QP that is already connected is refused, not paired with another.
  reply.peerQpn = 0x30;
  CHECK(pending.choose(reply).status().code() == StatusCode::kFailedPrecondition);
  // An offer (no peer QP number) takes the oldest pending QP: the symmetric protocol.
  auto oldest = pending.choose(offer);
  REQUIRE(oldest.ok());
  REQUIRE(oldest->has_value());
  CHECK(**oldest == 0x20u);
  pending.take(0x20);
  CHECK(pending.size() == 0);
  pending.take(0x99);  // unknown: nothing happens
  CHECK(pending.all().empty());
}

namespace {
// Applies a plan to byte arrays, as the HCA would: gather local SGEs, write remote range.
void apply(const std::vector<WritePlan>& plan, const std::vector<uint8_t>& src, uint64_t srcBase,
           std::vector<uint8_t>* dst, uint64_t dstBase) {
  for (const WritePlan& w : plan) {
    uint64_t at = w.remoteAddr - dstBase;
    uint64_t sum = 0;
    for (const Sge& s : w.sges) {
      std::copy_n(src.begin() + static_cast<long>(s.addr - srcBase), s.len, dst->begin() + static_cast<long>(at));
      at += s.len;
      sum += s.len;
    }
    REQUIRE(sum == w.bytes);
  }
}
}  // namespace

TEST_CASE("verbs: contiguous remote runs merge into one WRITE within max_sge") {
  // Four 4 KiB blocks whose remote side is contiguous but local side scattered.
  std::vector<SegmentPair> pairs;
  for (int i = 0; i < 4; ++i)
    pairs.push_back(SegmentPair{0x10000 + static_cast<uint64_t>(i) * 0x3000, 7, 0x900000 + i * 4096ull, 9, 4096});
  auto plan = planWrites(pairs, BatchLimits{16, 1 << 30});
  REQUIRE(plan.ok());
  REQUIRE(plan->size() == 1);
  CHECK((*plan)[0].sges.size() == 4);
  CHECK((*plan)[0].bytes == 16384);

  plan = planWrites(pairs, BatchLimits{3, 1 << 30});  // max_sge 3: a second WRITE for block 4
  REQUIRE(plan.ok());
  REQUIRE(plan->size() == 2);
  CHECK((*plan)[0].sges.size() == 3);
  CHECK((*plan)[1].remoteAddr == 0x900000 + 3 * 4096);
  CHECK((*plan)[1].bytes == 4096);

  // Locally contiguous too: one SGE.
  std::vector<SegmentPair> both;
  for (int i = 0; i < 4; ++i) both.push_back(SegmentPair{0x10000 + i * 4096ull, 7, 0x900000 + i * 4096ull, 9, 4096});
  plan = planWrites(both, BatchLimits{1, 1 << 30});
  REQUIRE(plan.ok());
  REQUIRE(plan->size() == 1);
  REQUIRE((*plan)[0].sges.size() == 1);
  CHECK((*plan)[0].sges[0].len == 16384);

  // Different rkeys or a gap never merge; zero-length pairs vanish.
  std::vector<SegmentPair> mixed = {{0x10000, 7, 0x900000, 9, 100},
                                    {0x20000, 7, 0x900064, 8, 100},
                                    {0x30000, 7, 0x900100, 8, 100},
                                    {0x40000, 7, 0x900164, 8, 0}};
  plan = planWrites(mixed, BatchLimits{16, 1 << 30});
  REQUIRE(plan.ok());
  CHECK(plan->size() == 3);
  CHECK(planWrites(mixed, BatchLimits{0, 1}).status().code() == StatusCode::kInvalidArgument);
}

TEST_CASE("verbs: long segments split at max_msg_sz and plans move the right bytes") {
  std::vector<SegmentPair> big = {{0x1000, 1, 0x100000, 2, 10000}};
  auto plan = planWrites(big, BatchLimits{4, 4096});
  REQUIRE(plan.ok());
  REQUIRE(plan->size() == 3);
  CHECK((*plan)[0].bytes == 4096);
  CHECK((*plan)[2].bytes == 10000 - 8192);
  CHECK((*plan)[2].remoteAddr == 0x100000 + 8192);
  for (auto& w : *plan) CHECK(w.bytes <= 4096);

  // Random property check: random segment layouts, the plan reproduces a plain copy.
  std::mt19937_64 rng(3);
  const uint64_t srcBase = 0x100000, dstBase = 0x800000;
  for (int round = 0; round < 200; ++round) {
    const size_t n = 1 + rng() % 64;
    std::vector<uint8_t> src(1 << 16), dst(1 << 16, 0), want(1 << 16, 0);
    for (auto& b : src) b = static_cast<uint8_t>(rng());
    std::vector<SegmentPair> pairs;
    uint64_t remoteAt = rng() % 1024, localAt = rng() % 1024;
    for (size_t i = 0; i < n; ++i) {
      uint64_t len = rng() % 700;
      if (localAt + len > src.size() || remoteAt + len > dst.size()) break;
      pairs.push_back(SegmentPair{srcBase + localAt, 5, dstBase + remoteAt, static_cast<uint32_t>(rng() % 2), len});
      std::copy_n(src.begin() + static_cast<long>(localAt), len, want.begin() + static_cast<long>(remoteAt));
      localAt += len + (rng() % 3 == 0 ? rng() % 64 : 0);   // sometimes locally contiguous
      remoteAt += len + (rng() % 4 == 0 ? rng() % 64 : 0);  // sometimes remotely contiguous
    }
    BatchLimits limits{static_cast<uint32_t>(1 + rng() % 4), 1 + rng() % 2000};
    auto p = planWrites(pairs, limits);
    REQUIRE(p.ok());
    for (auto& w : *p) {
      CHECK(w.sges.size() <= limits.maxSge);
      CHECK(w.bytes <= limits.maxMsgBytes);
      CHECK(w.bytes > 0);
    }
    apply(*p, src, srcBase, &dst, dstBase);
    REQUIRE(dst == want);
  }
}

TEST_CASE("verbs: selective signalling signals every Nth and always the last WR") {
  std::vector<size_t> signalled;
  for (size_t i = 0; i < 10; ++i)
    if (shouldSignal(i, 10, 4)) signalled.push_back(i);
  CHECK(signalled == std::vector<size_t>{3, 7, 9});
  CHECK(shouldSignal(0, 1, 64));
  CHECK(!shouldSignal(0, 2, 64));
}

TEST_CASE("verbs: the send window signals periodically and never overfills the queue") {
  SendWindow w(8, 3);
  // One transfer of 10 WRs: the queue takes 8, signalled at WRs 3 and 6 (indexes 2, 5).
  std::vector<size_t> signalled;
  size_t posted = 0;
  while (posted < 10 && w.room() > 0) {
    if (w.onPost(7, posted, 10)) signalled.push_back(posted);
    ++posted;
  }
  CHECK(posted == 8);
  CHECK(w.used() == 8);
  CHECK(signalled == std::vector<size_t>{2, 5});
  auto c = w.onCompletion();  // covers WRs 0..2
  REQUIRE(c);
  CHECK(c->transfer == 7);
  CHECK(!c->last);
  CHECK(w.room() == 3);
  while (posted < 10) {
    REQUIRE(w.room() > 0);
    if (w.onPost(7, posted, 10)) signalled.push_back(posted);
    ++posted;
  }
  CHECK(signalled == std::vector<size_t>{2, 5, 8, 9});  // the last WR is always signalled
  CHECK(!w.onCompletion()->last);                       // WR 5
  CHECK(!w.onCompletion()->last);                       // WR 8
  auto end = w.onCompletion();                          // WR 9
  REQUIRE(end);
  CHECK(end->last);
  CHECK(w.used() == 0);
  CHECK(!w.onCompletion());  // nothing outstanding

  // signalEvery larger than half the depth is clamped so room always comes back.
  SendWindow tight(4, 100);
  CHECK(!tight.onPost(1, 0, 50));
  CHECK(tight.onPost(1, 1, 50));
}

TEST_CASE("verbs: the send window keeps its invariants over random traffic and cancels") {
  std::mt19937_64 rng(11);
  for (int round = 0; round < 100; ++round) {
    const uint32_t depth = 2 + rng() % 64;
    const uint32_t every = 1 + rng() % 40;
    SendWindow w(depth, every);
    struct T {
      uint64_t id;
      size_t total, posted = 0;
      bool cancelled = false, done = false;
    };
    std::vector<T> ts;
    for (uint64_t id = 1; id <= 20; ++id) ts.push_back(T{id, 1 + rng() % 100});
    size_t active = 0;
    uint32_t unsignalledRun = 0;
    std::vector<uint64_t> finished;
    for (int step = 0; step < 20000 && finished.size() + 0 < ts.size(); ++step) {
      T& t = ts[active];
      if (rng() % 3 != 0 && w.room() > 0 && t.posted < t.total && !t.cancelled) {
        const bool sig = w.onPost(t.id, t.posted, t.total);
        unsignalledRun = sig ? 0 : unsignalledRun + 1;
        REQUIRE(unsignalledRun < std::max<uint32_t>(1, std::min(every, depth / 2)));
        ++t.posted;
        if (rng() % 200 == 0) t.cancelled = true;  // stops posting mid-way
      } else if (w.signalledOutstanding() > 0) {
        auto c = w.onCompletion();
        REQUIRE(c);
        if (c->last) {
          finished.push_back(c->transfer);
          ts[c->transfer - 1].done = true;
        }
      }
      REQUIRE(w.used() <= depth);
      if ((t.posted == t.total || t.cancelled) && active + 1 < ts.size()) ++active;
      if (active + 1 == ts.size() && (t.posted == t.total || t.cancelled) && w.signalledOutstanding() == 0) break;
    }
    // Every transfer that posted all its WRs finished exactly once, in posting order.
    std::vector<uint64_t> want;
    for (auto& t : ts)
      if (t.posted == t.total) want.push_back(t.id);
    REQUIRE(finished == want);
    // Unsignalled tails of cancelled transfers hold at most every-1 slots.
    CHECK(w.used() < std::max<uint32_t>(1, std::min(every, depth / 2)));
  }
}
