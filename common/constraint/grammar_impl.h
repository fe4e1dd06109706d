// The insides of a Grammar, shared by grammar.cpp (the compiler) and matcher.cpp (the token
// masks, which walk the DFA under one lock per mask rather than one per byte).
// Not part of the module's contract: include constraint.h.
#pragma once

#include <cstdint>
#include <map>
#include <mutex>
#include <vector>

#include "common/constraint/constraint.h"

namespace pd::constraint {

struct NfaEdge {
  uint8_t lo, hi;  // one byte in [lo, hi]
  int to;
};

struct NfaState {
  std::vector<NfaEdge> edges;
  std::vector<int> eps;
};

struct NfaData {
  std::vector<NfaState> states;
  int accept = -1;
};

struct DfaState {
  std::vector<int> set;  // NFA states that read a byte or accept, sorted
  bool accepting = false;
  bool hasNext = false;
};

struct Grammar::Impl {
  static constexpr State kUnknown = -2;

  std::mutex mu;  // guards everything below but `nfa`, which is immutable once compiled
  NfaData nfa;
  std::vector<DfaState> dfa;
  std::map<std::vector<int>, int> index;  // NFA state set -> DFA state
  std::vector<State> next;                // dfa.size() x 256: kUnknown until computed

  // Callers hold mu.
  State step(State s, uint8_t byte) {
    const State t = next[size_t(s) * 256 + byte];
    return t != kUnknown ? t : computeStep(s, byte);
  }
  State computeStep(State s, uint8_t byte);
  int addDfaState(std::vector<int> set);
  std::vector<int> closure(std::vector<int> seeds) const;
};

}  // namespace pd::constraint
