// What a constrained request's output must be (docs/serving.md "Structured outputs"): the
// one description of a constraint that the router builds from the API fields, the proto
// carries to the workers and the engine compiles into a token mask (constraint.h).
//
// The constrained text is `prefix`, then one value of the kind below, then `suffix`. The
// literal prefix and suffix let a model's own syntax wrap the value: a tool call in the
// Hermes form is prefix `<tool_call>{"name": "f", "arguments": `, a JSON-schema value, and
// suffix `}</tool_call>`.
//
// Threads: a plain value; any thread.
#pragma once

#include <cstdint>
#include <string>

namespace pd::constraint {

enum class SpecKind : uint8_t {
  kNone = 0,        // unconstrained; every other field is ignored
  kJsonObject = 1,  // any JSON object (response_format json_object); body unused
  kJsonSchema = 2,  // a value of the JSON schema in body (response_format json_schema)
  kRegex = 3,       // a full match of the regular expression in body (guided_regex)
  kChoice = 4,      // exactly one of the strings of the JSON array of strings in body (guided_choice)
};

struct ConstraintSpec {
  SpecKind kind = SpecKind::kNone;
  std::string body;    // the schema / pattern / JSON array of choices, as the client sent it
  std::string prefix;  // fixed text before the value (may be empty)
  std::string suffix;  // fixed text after the value (may be empty)

  bool active() const { return kind != SpecKind::kNone; }
  // The identity of the compiled form: equal keys compile to the same automaton (the
  // compile cache's key).
  std::string cacheKey() const {
    std::string k;
    k.reserve(body.size() + prefix.size() + suffix.size() + 40);
    k += char('0' + int(kind));
    for (const std::string* s : {&prefix, &body, &suffix}) {
      k += std::to_string(s->size());
      k += ':';
      k += *s;
    }
    return k;
  }
  bool operator==(const ConstraintSpec&) const = default;
};

}  // namespace pd::constraint
