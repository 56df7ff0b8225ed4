#include <catch2/catch.hpp>

#include <cmath>
#include <limits>

#include "server/ingest/convert.h"

using namespace gradwatch;
using namespace gradwatch::ingest;
using gradwatch::runs::IngestErrorReason;

namespace {
v1::Hello GoodHello() {
  v1::Hello h;
  h.set_run_id("moe-6b/run:1");
  h.set_rank(1);
  h.set_world_size(2);
  (*h.mutable_labels())["job"] = "pretrain";
  h.mutable_config()->set_hidden_size(6144);
  h.mutable_config()->set_z_loss_coef(1e-4);
  auto* p = h.add_params();
  p->set_name("final_norm.weight");
  p->set_numel(6144);
  p->set_kind(v1::PARAM_KIND_NORM_GAIN);
  p->set_role("final_norm");
  auto* q = h.add_params();
  q->set_name("lm_head.weight");
  q->set_kind(v1::PARAM_KIND_OUTPUT);
  q->set_weight_decay(0.1);
  q->set_init_norm(12.5);
  return h;
}
}  // namespace

TEST_CASE("a valid hello converts with its catalog and config", "[ingest]") {
  RunMeta meta;
  uint32_t rank = 0;
  REQUIRE_FALSE(HelloFromProto(GoodHello(), {}, &meta, &rank));
  CHECK(rank == 1);
  CHECK(meta.world_size == 2);
  CHECK(meta.labels.at("job") == "pretrain");
  CHECK(meta.config.z_loss_coef == 1e-4);
  CHECK_FALSE(meta.config.weight_decay.has_value());
  REQUIRE(meta.params.size() == 2);
  CHECK(meta.params[0].kind == ParamKind::kNormGain);
  CHECK_FALSE(meta.params[0].init_norm.has_value());
  CHECK(meta.params[1].init_norm == 12.5);
}

TEST_CASE("a hello's resume point is told apart from no resume, step 0 included", "[ingest]") {
  RunMeta meta;
  uint32_t rank = 0;
  v1::Hello h = GoodHello();
  REQUIRE_FALSE(HelloFromProto(h, {}, &meta, &rank));
  CHECK_FALSE(meta.resume_from_step.has_value());
  h.set_resume_from_step(0);
  REQUIRE_FALSE(HelloFromProto(h, {}, &meta, &rank));
  CHECK(meta.resume_from_step == 0u);
  h.set_resume_from_step(20000);
  REQUIRE_FALSE(HelloFromProto(h, {}, &meta, &rank));
  CHECK(meta.resume_from_step == 20000u);
}

TEST_CASE("invalid hellos are refused with a reason", "[ingest]") {
  RunMeta meta;
  uint32_t rank = 0;
  struct Case {
    const char* what;
    void (*mutate)(v1::Hello&);
  };
  const Case cases[] = {
      {"empty run id", [](v1::Hello& h) { h.set_run_id(""); }},
      {"run id with a space", [](v1::Hello& h) { h.set_run_id("a b"); }},
      {"rank not below world size", [](v1::Hello& h) { h.set_rank(2); }},
      {"world size 0", [](v1::Hello& h) { h.set_world_size(0); }},
      {"duplicate param name", [](v1::Hello& h) { h.mutable_params(1)->set_name("final_norm.weight"); }},
      {"param named total", [](v1::Hello& h) { h.mutable_params(1)->set_name("total"); }},
      {"negative weight decay", [](v1::Hello& h) { h.mutable_params(1)->set_weight_decay(-1); }},
      {"zero init norm", [](v1::Hello& h) { h.mutable_params(1)->set_init_norm(0); }},
  };
  for (const Case& c : cases) {
    INFO(c.what);
    v1::Hello h = GoodHello();
    c.mutate(h);
    auto err = HelloFromProto(h, {}, &meta, &rank);
    REQUIRE(err);
    CHECK(err->reason == IngestErrorReason::kInvalidHello);
    CHECK_FALSE(err->message.empty());
  }
}

TEST_CASE("step stats convert norms and squared sums, refuse negatives and pass NaN", "[ingest]") {
  v1::StepStats s;
  s.set_step(42);
  s.set_loss(2.5);
  s.mutable_total_grad()->set_norm(3.0);
  auto* p = s.add_params();
  p->set_index(0);
  p->mutable_grad()->set_sq_sum(16.0);
  p->mutable_param()->set_norm(std::nan(""));
  (*s.mutable_extra())["b"] = 2;
  (*s.mutable_extra())["a"] = 1;
  RankStep out;
  REQUIRE_FALSE(StepFromProto(s, 7, &out));
  CHECK(out.step == 42);
  CHECK(out.seq == 7);
  CHECK(out.total_grad.sq == Approx(9.0));
  CHECK(out.params[0].norms[0].sq == Approx(16.0));
  CHECK(std::isnan(out.params[0].norms[1].sq));
  CHECK_FALSE(out.params[0].norms[2].present);
  REQUIRE(out.extra.size() == 2);
  CHECK(out.extra[0].first == "a");

  p->mutable_update()->set_norm(-0.5);
  auto err = StepFromProto(s, 8, &out);
  REQUIRE(err);
  CHECK(err->reason == IngestErrorReason::kNegativeNorm);
  CHECK(err->step == 42);

  // A norm is ≥ 0, +Inf or NaN: −Inf is refused, not kept as the +Inf its square would be.
  p->mutable_update()->set_sq_sum(-std::numeric_limits<double>::infinity());
  err = StepFromProto(s, 9, &out);
  REQUIRE(err);
  CHECK(err->reason == IngestErrorReason::kNegativeNorm);
  CHECK_THAT(err->message, Catch::Contains("-inf"));
  p->mutable_update()->set_norm(std::numeric_limits<double>::infinity());
  REQUIRE_FALSE(StepFromProto(s, 10, &out));
  CHECK(std::isinf(out.params[0].norms[2].sq));
}

TEST_CASE("steps above 2^63 - 1 are refused wherever a step arrives", "[ingest]") {
  constexpr uint64_t kLargest = 9223372036854775807ULL;
  v1::StepStats s;
  s.set_step(kLargest);
  RankStep out;
  REQUIRE_FALSE(StepFromProto(s, 1, &out));
  CHECK(out.step == kLargest);
  for (uint64_t step : {kLargest + 1, uint64_t{18446744073709551615ULL}}) {
    s.set_step(step);
    auto err = StepFromProto(s, 2, &out);
    REQUIRE(err);
    CHECK(err->reason == IngestErrorReason::kInvalidMessage);
    CHECK_THAT(err->message, Catch::Contains(std::to_string(step)) && Catch::Contains("2^63 - 1"));

    v1::Event e;
    e.set_step(step);
    e.set_text("past the end");
    EventRecord event;
    REQUIRE(EventFromProto(e, &event));
    CHECK(EventFromProto(e, &event)->reason == IngestErrorReason::kInvalidMessage);

    v1::CatalogUpdate update;
    update.set_from_step(step);
    update.add_params()->set_name("final_norm.weight");
    std::vector<ParamChange> changes;
    REQUIRE(CatalogUpdateFromProto(update, 10, &changes));
    CHECK_THAT(CatalogUpdateFromProto(update, 10, &changes)->message, Catch::Contains("largest step"));

    v1::Hello h = GoodHello();
    h.set_resume_from_step(step);
    RunMeta meta;
    uint32_t rank = 0;
    auto hello_err = HelloFromProto(h, HelloLimits{}, &meta, &rank);
    REQUIRE(hello_err);
    CHECK(hello_err->reason == IngestErrorReason::kInvalidHello);
  }
  v1::Hello h = GoodHello();
  h.set_resume_from_step(kLargest);
  RunMeta meta;
  uint32_t rank = 0;
  REQUIRE_FALSE(HelloFromProto(h, HelloLimits{}, &meta, &rank));
  CHECK(meta.resume_from_step == kLargest);
}

TEST_CASE("a radial update is signed, and its shard form needs the rank's parameter norm", "[ingest]") {
  v1::StepStats s;
  s.set_step(9);
  auto* p = s.add_params();
  p->set_index(2);
  p->mutable_radial_update()->set_radial(-0.25);
  RankStep out;
  REQUIRE_FALSE(StepFromProto(s, 1, &out));
  CHECK(out.params[0].radial.form == RadialContribution::Form::kRadial);
  CHECK(out.params[0].radial.value == -0.25);

  p->mutable_radial_update()->set_dot(-3.0);
  auto err = StepFromProto(s, 2, &out);
  REQUIRE(err);
  CHECK(err->reason == IngestErrorReason::kInvalidMessage);
  CHECK_THAT(err->message, Catch::Contains("parameter index 2") && Catch::Contains("radial_update.dot needs"));

  p->mutable_param()->set_sq_sum(4.0);
  REQUIRE_FALSE(StepFromProto(s, 3, &out));
  CHECK(out.params[0].radial.form == RadialContribution::Form::kDot);
  CHECK(out.params[0].radial.value == -3.0);

  p->clear_radial_update();
  REQUIRE_FALSE(StepFromProto(s, 4, &out));
  CHECK_FALSE(out.params[0].radial.present());
}

TEST_CASE("events need text of 1 to 1024 bytes", "[ingest]") {
  v1::Event e;
  e.set_step(81716);
  EventRecord out;
  CHECK(EventFromProto(e, &out));
  e.set_text("switched to near-dropless EP routing");
  REQUIRE_FALSE(EventFromProto(e, &out));
  CHECK(out.step == 81716);
  e.set_text(std::string(1025, 'x'));
  CHECK(EventFromProto(e, &out));
}

TEST_CASE("run label names must be Prometheus label names", "[ingest]") {
  struct Case {
    std::string key;
    bool ok;
    std::string named;  // how the error names the key
  };
  const std::vector<Case> cases = {
      {"job", true, ""},
      {"_private", true, ""},
      {"team_2", true, ""},
      {"1x", false, "'1x' starts with a digit"},
      {"a-b", false, "'a-b' has a character outside"},
      {"__name__", false, "'__name__' starts with '__'"},
      {"line\nbreak", false, "'line\\x0abreak'"},
      {"caf\xc3\xa9", false, "'caf\\xc3\\xa9'"},
  };
  for (const Case& c : cases) {
    CAPTURE(c.key);
    v1::Hello h = GoodHello();
    (*h.mutable_labels())[c.key] = "value \"quoted\"\nwith a newline";
    RunMeta meta;
    uint32_t rank = 0;
    const auto err = HelloFromProto(h, {}, &meta, &rank);
    CHECK(err.has_value() == !c.ok);
    if (err) {
      CHECK(err->reason == IngestErrorReason::kInvalidHello);
      CHECK_THAT(err->message, Catch::Contains(c.named));
    }
  }
}

TEST_CASE("extra keys cannot name a built-in series", "[ingest]") {
  for (const std::string key : {"grad/norm/total", "train/loss", "train/z_loss", "optim/learning_rate", "train/tokens",
                                "grad/norm/lm_head.weight", "params/norm/x", "updates/norm/x", "updates/radial/x"}) {
    CAPTURE(key);
    v1::StepStats in;
    in.set_step(7);
    (*in.mutable_extra())[key] = 1.0;
    RankStep out;
    const auto err = StepFromProto(in, 1, &out);
    REQUIRE(err.has_value());
    CHECK(err->reason == IngestErrorReason::kInvalidMessage);
    CHECK(err->step == 7);
    CHECK_THAT(err->message, Catch::Contains("built-in series"));
  }
  v1::StepStats in;
  (*in.mutable_extra())["train/accuracy"] = 0.6;
  (*in.mutable_extra())["grad/norm_ratio"] = 0.6;
  // The whole model's parameter and update norms, as logs print them: no parameter is "total".
  (*in.mutable_extra())["params/norm/total"] = 312.5;
  (*in.mutable_extra())["updates/norm/total"] = 0.02;
  RankStep out;
  CHECK_FALSE(StepFromProto(in, 1, &out));
  CHECK(out.extra.size() == 4);
}

TEST_CASE("a norm's square keeps a finite norm finite", "[ingest]") {
  v1::StepStats in;
  in.mutable_total_grad()->set_norm(1e160);
  RankStep out;
  REQUIRE_FALSE(StepFromProto(in, 1, &out));
  CHECK(std::isfinite(out.total_grad.sq));
  CHECK(static_cast<double>(std::sqrt(out.total_grad.sq)) == Approx(1e160));
}
