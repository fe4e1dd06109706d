// The decode step cost line that decode admission predicts from (router/admission.h).
#include "engine/step_cost_model.h"

#include <catch2/catch.hpp>

namespace pd::engine {
namespace {

TEST_CASE("step cost: the line of steps over several batch sizes is recovered") {
  StepCostModel m;
  CHECK_FALSE(m.line());
  // step = 12 ms + 3 ms per stream, batches 4..20 and back.
  for (int round = 0; round < 4; ++round)
    for (int n = 4; n <= 20; ++n) m.observe(n, 12 + 3.0 * n);
  auto l = m.line();
  REQUIRE(l);
  CHECK(l->baseMs == Approx(12).margin(1e-6));
  CHECK(l->perStreamMs == Approx(3).margin(1e-6));
  CHECK(l->stepMs(30) == Approx(102).margin(1e-6));
  CHECK(l->smallChunkMs == 0);  // no mixed step seen
}

TEST_CASE("step cost: one batch size alone says nothing about the slope") {
  StepCostModel m;
  for (int i = 0; i < 100; ++i) m.observe(8, 40);
  CHECK_FALSE(m.line());
  m.observe(9, 43);  // a single other size is still ~no spread
  CHECK_FALSE(m.line());
  // Ignored inputs.
  StepCostModel empty;
  empty.observe(0, 10);
  empty.observe(3, -1);
  CHECK_FALSE(empty.line());
}

TEST_CASE("step cost: the line follows a change within its window, and never slopes down") {
  StepCostModel m;
  for (int i = 0; i < 200; ++i) m.observe(4 + i % 8, 10 + 1.0 * (4 + i % 8));
  // The contexts grew: each stream now costs 2 ms. ~150 steps later the line says so.
  for (int i = 0; i < 150; ++i) m.observe(4 + i % 8, 10 + 2.0 * (4 + i % 8));
  auto l = m.line();
  REQUIRE(l);
  CHECK(l->perStreamMs == Approx(2).epsilon(0.1));
  // Noise that makes larger batches look faster is clamped at a flat line.
  StepCostModel noisy;
  for (int i = 0; i < 50; ++i) noisy.observe(2 + i % 4, 30 - 2.0 * (i % 4));
  auto f = noisy.line();
  REQUIRE(f);
  CHECK(f->perStreamMs == 0);
  CHECK(f->baseMs > 0);
}

TEST_CASE("step cost: a small prompt chunk's excess over the line is learnt") {
  StepCostModel m;
  m.observeSmallChunk(8, 60);  // no line yet: ignored
  for (int n = 2; n <= 12; ++n) m.observe(n, 10 + 2.0 * n);
  for (int i = 0; i < 300; ++i) m.observeSmallChunk(6, 22 + 15);  // the line says 22 ms
  auto l = m.line();
  REQUIRE(l);
  CHECK(l->smallChunkMs == Approx(15).epsilon(0.01));
}

}  // namespace
}  // namespace pd::engine
