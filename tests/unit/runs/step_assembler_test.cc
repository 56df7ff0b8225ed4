#include <catch2/catch.hpp>

#include <chrono>
#include <vector>

#include "server/runs/step_assembler.h"

using namespace gradwatch;
using namespace gradwatch::runs;
using namespace std::chrono_literals;

namespace {

struct Done {
  uint64_t step;
  bool partial;
  uint32_t ranks;
  double grad_sq0;
  bool total_present;
  double total_sq;
};

RankStep Report(uint64_t step, double grad_sq0, uint64_t seq = 0) {
  RankStep r;
  r.step = step;
  r.seq = seq;
  r.params.push_back({.index = 0, .norms = {NormContribution::FromSqSum(grad_sq0), {}, {}}});
  return r;
}

auto Collect(std::vector<Done>& out) {
  return [&out](const PendingStep& p) {
    out.push_back({p.step, p.partial, p.ranks_reported, static_cast<double>(p.param_sq[0]), p.total_grad.present,
                   static_cast<double>(p.total_grad.sq)});
  };
}

const SteadyTime kT0 = SteadyTime(1s);

}  // namespace

TEST_CASE("a single-rank step completes at once", "[runs]") {
  StepAssembler a(1, 30s);
  a.SetParamCount(1);
  std::vector<Done> done;
  CHECK(a.Add(0, Report(10, 4.0), kT0, Collect(done)) == AddResult::kAccepted);
  REQUIRE(done.size() == 1);
  CHECK(done[0].step == 10);
  CHECK_FALSE(done[0].partial);
  CHECK(done[0].grad_sq0 == 4.0);
  CHECK(a.pending() == 0);
}

TEST_CASE("a step completes when every rank reported, summing squares", "[runs]") {
  StepAssembler a(3, 30s);
  a.SetParamCount(1);
  std::vector<Done> done;
  a.Add(0, Report(5, 1.0), kT0, Collect(done));
  a.Add(2, Report(5, 4.0), kT0, Collect(done));
  CHECK(done.empty());
  a.Add(1, Report(5, 9.0), kT0, Collect(done));
  REQUIRE(done.size() == 1);
  CHECK(done[0].grad_sq0 == 14.0);
  CHECK(done[0].ranks == 3);
  CHECK_FALSE(done[0].partial);
}

TEST_CASE("radial updates merge as a sum: whole parameters' radials, shards' dots", "[runs]") {
  StepAssembler a(3, 30s);
  a.SetParamCount(2);
  std::vector<PendingStep::Radial> radial;
  bool any = true;
  auto collect = [&](const PendingStep& p) {
    any = p.radial_any;
    radial = p.radial;
  };
  // Parameter 1 is sharded: each rank sends ⟨Δw_s, w_s⟩ and its part of |w|².
  for (uint32_t rank = 0; rank < 3; ++rank) {
    RankStep r;
    r.step = 4;
    r.params.push_back({.index = 1,
                        .norms = {{}, NormContribution::FromSqSum(3.0), {}},
                        .radial = {RadialContribution::Form::kDot, -0.5 * (rank + 1)}});
    // Parameter 0 is whole on rank 0 only.
    if (rank == 0) r.params.push_back({.index = 0, .radial = {RadialContribution::Form::kRadial, 0.125}});
    a.Add(rank, r, kT0, collect);
  }
  REQUIRE(any);
  REQUIRE(radial.size() == 2);
  CHECK(radial[0].present);
  CHECK_FALSE(radial[0].has_dot);
  CHECK(radial[0].radial == 0.125);
  CHECK(radial[1].present);
  CHECK(radial[1].has_dot);
  CHECK(radial[1].dot == -3.0);
  // The next step has none: nothing carried over.
  a.Add(0, Report(5, 1.0), kT0, collect);
  a.Add(1, Report(5, 1.0), kT0, collect);
  a.Add(2, Report(5, 1.0), kT0, collect);
  CHECK_FALSE(any);
}

TEST_CASE("a step still waiting when a later step completes is completed as partial first", "[runs]") {
  StepAssembler a(2, 30s);
  a.SetParamCount(1);
  std::vector<Done> done;
  a.Add(0, Report(1, 1.0), kT0, Collect(done));  // rank 1 never sends step 1
  a.Add(0, Report(2, 1.0), kT0, Collect(done));
  a.Add(1, Report(2, 1.0), kT0, Collect(done));
  REQUIRE(done.size() == 2);
  CHECK(done[0].step == 1);
  CHECK(done[0].partial);
  CHECK(done[0].ranks == 1);
  CHECK(done[1].step == 2);
  CHECK_FALSE(done[1].partial);
}

TEST_CASE("a step past the assembly timeout is completed as partial", "[runs]") {
  StepAssembler a(2, 30s);
  a.SetParamCount(1);
  std::vector<Done> done;
  a.Add(0, Report(7, 2.0), kT0, Collect(done));
  a.Expire(kT0 + 29s, Collect(done));
  CHECK(done.empty());
  a.Expire(kT0 + 30s, Collect(done));
  REQUIRE(done.size() == 1);
  CHECK(done[0].partial);
  CHECK(done[0].grad_sq0 == 2.0);
}

TEST_CASE("a report for a step already completed is late", "[runs]") {
  StepAssembler a(2, 1s);
  a.SetParamCount(1);
  std::vector<Done> done;
  a.Add(0, Report(7, 2.0), kT0, Collect(done));
  a.Expire(kT0 + 2s, Collect(done));
  CHECK(a.Add(1, Report(7, 2.0), kT0 + 3s, Collect(done)) == AddResult::kLate);
  CHECK(done.size() == 1);
}

TEST_CASE("the same rank reporting a pending step twice is a duplicate", "[runs]") {
  StepAssembler a(2, 30s);
  a.SetParamCount(1);
  std::vector<Done> done;
  a.Add(0, Report(7, 2.0), kT0, Collect(done));
  CHECK(a.Add(0, Report(7, 2.0), kT0, Collect(done)) == AddResult::kDuplicate);
  a.Add(1, Report(7, 3.0), kT0, Collect(done));
  REQUIRE(done.size() == 1);
  CHECK(done[0].grad_sq0 == 5.0);
}

TEST_CASE("pending steps beyond the bound complete the oldest as partial", "[runs]") {
  StepAssembler a(2, 30s, 4);
  a.SetParamCount(1);
  std::vector<Done> done;
  for (uint64_t s = 1; s <= 6; ++s) a.Add(0, Report(s, 1.0), kT0, Collect(done));
  REQUIRE(done.size() == 2);
  CHECK(done[0].step == 1);
  CHECK(done[1].step == 2);
  CHECK(a.pending() == 4);
}

TEST_CASE("out-of-order arrival across ranks still completes in step order", "[runs]") {
  StepAssembler a(2, 30s);
  a.SetParamCount(1);
  std::vector<Done> done;
  a.Add(0, Report(1, 1.0), kT0, Collect(done));
  a.Add(0, Report(2, 1.0), kT0, Collect(done));
  a.Add(0, Report(3, 1.0), kT0, Collect(done));
  a.Add(1, Report(1, 1.0), kT0, Collect(done));
  a.Add(1, Report(2, 1.0), kT0, Collect(done));
  REQUIRE(done.size() == 2);
  CHECK(done[0].step == 1);
  CHECK(done[1].step == 2);
  CHECK_FALSE(done[1].partial);
  CHECK(a.pending() == 1);
}

TEST_CASE("scalars merge: total grad squares summed, tokens summed, loss averaged", "[runs]") {
  StepAssembler a(2, 30s);
  a.SetParamCount(1);
  double loss = 0;
  uint64_t tokens = 0;
  double total_sq = 0;
  auto grab = [&](const PendingStep& p) {
    loss = p.loss_sum / p.loss_n;
    tokens = p.tokens_sum;
    total_sq = p.total_grad.sq;
  };
  RankStep r0 = Report(3, 0.0), r1 = Report(3, 0.0);
  r0.loss = 2.0, r1.loss = 3.0;
  r0.tokens = 100, r1.tokens = 150;
  r0.total_grad = NormContribution::FromNorm(3.0);
  r1.total_grad = NormContribution::FromSqSum(16.0);
  a.Add(0, r0, kT0, grab);
  a.Add(1, r1, kT0, grab);
  CHECK(loss == Approx(2.5));
  CHECK(tokens == 250);
  CHECK(total_sq == Approx(25.0));
}

TEST_CASE("a rewind completes pending steps below it, discards the rest and may resize the world", "[runs][rewind]") {
  StepAssembler a(2, 30s);
  a.SetParamCount(1);
  std::vector<Done> done;
  for (uint64_t s = 10; s <= 30; s += 10) {
    a.Add(0, Report(s, 1.0), kT0, Collect(done));
    a.Add(1, Report(s, 1.0), kT0, Collect(done));
  }
  a.Add(0, Report(40, 1.0), kT0, Collect(done));  // pending below the resume point
  a.Add(0, Report(50, 1.0), kT0, Collect(done));  // pending at the resume point
  a.Add(1, Report(60, 1.0), kT0, Collect(done));  // pending above it
  REQUIRE(done.size() == 3);

  a.Rewind(50, 3, Collect(done));
  REQUIRE(done.size() == 4);
  CHECK(done.back().step == 40);
  CHECK(done.back().partial);
  CHECK(a.pending() == 0);
  CHECK(a.last_completed_step() == 40);

  // Step 50 again, from the resumed world of three ranks: not late, complete only with all three.
  CHECK(a.Add(0, Report(50, 4.0), kT0, Collect(done)) == AddResult::kAccepted);
  CHECK(a.Add(1, Report(50, 4.0), kT0, Collect(done)) == AddResult::kAccepted);
  REQUIRE(done.size() == 4);
  CHECK(a.Add(2, Report(50, 4.0), kT0, Collect(done)) == AddResult::kAccepted);
  REQUIRE(done.size() == 5);
  CHECK(done.back().step == 50);
  CHECK_FALSE(done.back().partial);
  CHECK(done.back().ranks == 3);
  CHECK(done.back().grad_sq0 == 12.0);  // the discarded reports of step 50 are not summed in
}

TEST_CASE("a rewind to before every completed step accepts any step again", "[runs][rewind]") {
  StepAssembler a(1, 30s);
  a.SetParamCount(1);
  std::vector<Done> done;
  a.Add(0, Report(100, 1.0), kT0, Collect(done));
  a.Rewind(0, 1, Collect(done));
  CHECK_FALSE(a.has_completed());
  CHECK(a.Add(0, Report(0, 1.0), kT0, Collect(done)) == AddResult::kAccepted);
  CHECK(done.back().step == 0);
}
