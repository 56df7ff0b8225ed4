#include "client/cli/replay_parser.h"

#include <catch2/catch.hpp>
#include <cmath>
#include <sstream>

#include "client/cli/replay.h"

using namespace gradwatch::cli;
namespace v1 = gradwatch::v1;

namespace {

StepRecord ParseStep(const std::string& line) {
  LineResult r = ParseReplayLine(line, false);
  INFO(line << " → " << r.error);
  REQUIRE(r.ok());
  REQUIRE(std::holds_alternative<StepRecord>(*r.line));
  return std::get<StepRecord>(*r.line);
}

std::string ErrorOf(const std::string& line, bool first = false) {
  LineResult r = ParseReplayLine(line, first);
  return r.ok() ? "" : r.error;
}

}  // namespace

TEST_CASE("bare NaN and Infinity tokens are quoted, strings are left alone", "[client]") {
  CHECK(QuoteNonFiniteTokens(R"({"a": NaN, "b": Infinity, "c": -Infinity})") ==
        R"({"a": "NaN", "b": "Infinity", "c": "-Infinity"})");
  CHECK(QuoteNonFiniteTokens(R"({"a":[NaN,1,-Infinity]})") == R"({"a":["NaN",1,"-Infinity"]})");
  CHECK(QuoteNonFiniteTokens(R"({"NaN": "Infinity NaN", "x": NaN})") == R"({"NaN": "Infinity NaN", "x": "NaN"})");
  CHECK(QuoteNonFiniteTokens(R"({"esc\"NaN": NaN})") == R"({"esc\"NaN": "NaN"})");
  CHECK(QuoteNonFiniteTokens(R"({"a": NaNx})") == R"({"a": NaNx})");
}

TEST_CASE("every kind of key lands in its StepStats field", "[client]") {
  StepRecord r = ParseStep(R"({"_step": 81716, "_timestamp": 1757800000.5, "_runtime": 12, "grad/norm/total": 0.40,)"
                           R"( "grad/norm/output_proj": 0.38, "params/norm/final_norm.weight": 340.2,)"
                           R"( "updates/norm/final_norm.weight": 0.01, "train/loss": 1.23, "train/z_loss": 0.002,)"
                           R"( "optim/learning_rate": 3e-4, "train/tokens": 4194304, "train/accuracy": 0.61,)"
                           R"( "note": "text", "flag": true, "nothing": null})");
  CHECK(r.step == 81716);
  CHECK(r.stats.step() == 81716);
  REQUIRE(r.timestamp);
  CHECK(*r.timestamp == Approx(1757800000.5));
  CHECK(r.stats.wall_time() == Approx(1757800000.5));
  CHECK(r.stats.total_grad().norm() == Approx(0.40));
  CHECK(r.stats.loss() == Approx(1.23));
  CHECK(r.stats.z_loss() == Approx(0.002));
  CHECK(r.stats.learning_rate() == Approx(3e-4));
  CHECK(r.stats.tokens() == 4194304);
  REQUIRE(r.stats.extra().size() == 1);
  CHECK(r.stats.extra().at("train/accuracy") == Approx(0.61));
  CHECK(r.has_metrics);
  CHECK_FALSE(r.event);
  REQUIRE(r.params.size() == 3);

  ReplayCatalog catalog;
  catalog.AddFrom(r);
  const v1::StepStats stats = ToStepStats(r, catalog);
  REQUIRE(stats.params_size() == 2);
  CHECK(catalog.IndexOf("output_proj") == 0u);
  CHECK(catalog.IndexOf("final_norm.weight") == 1u);
  CHECK(stats.params(0).index() == 0);
  CHECK(stats.params(0).grad().norm() == Approx(0.38));
  CHECK_FALSE(stats.params(0).has_param());
  CHECK(stats.params(1).param().norm() == Approx(340.2));
  CHECK(stats.params(1).update().norm() == Approx(0.01));
  CHECK_FALSE(stats.params(1).has_grad());
}

TEST_CASE("the whole model's params and updates norms are sent as their own series, not a parameter", "[client]") {
  StepRecord r = ParseStep(R"({"_step": 5, "params/norm/total": 312.5, "updates/norm/total": 0.02})");
  CHECK(r.params.empty());
  REQUIRE(r.stats.extra().size() == 2);
  CHECK(r.stats.extra().at("params/norm/total") == Approx(312.5));
  CHECK(r.stats.extra().at("updates/norm/total") == Approx(0.02));
}

TEST_CASE("NaN and infinities are accepted as bare tokens and as strings", "[client]") {
  StepRecord r = ParseStep(R"({"_step": 3, "grad/norm/total": NaN, "train/loss": Infinity, "train/z_loss": -Infinity,)"
                           R"( "grad/norm/lm_head": "nan", "params/norm/lm_head": "inf",)"
                           R"( "updates/norm/lm_head": "-inf",)"
                           R"( "x/a": "NaN", "x/b": "Infinity", "x/c": "-Infinity"})");
  CHECK(std::isnan(r.stats.total_grad().norm()));
  CHECK(r.stats.loss() == std::numeric_limits<double>::infinity());
  CHECK(r.stats.z_loss() == -std::numeric_limits<double>::infinity());
  CHECK(std::isnan(r.stats.extra().at("x/a")));
  CHECK(std::isinf(r.stats.extra().at("x/b")));
  CHECK(r.stats.extra().at("x/c") < 0);
  ReplayCatalog catalog;
  catalog.AddFrom(r);
  const v1::StepStats stats = ToStepStats(r, catalog);
  REQUIRE(stats.params_size() == 1);
  CHECK(std::isnan(stats.params(0).grad().norm()));
  CHECK(stats.params(0).param().norm() == std::numeric_limits<double>::infinity());
  CHECK(stats.params(0).update().norm() == -std::numeric_limits<double>::infinity());
}

TEST_CASE("event lines carry their text and step", "[client]") {
  StepRecord r = ParseStep(R"({"_step": 81716, "event": "switched to near-dropless EP routing"})");
  CHECK(r.step == 81716);
  REQUIRE(r.event);
  CHECK(*r.event == "switched to near-dropless EP routing");
  CHECK_FALSE(r.has_metrics);
}

TEST_CASE("bad lines are rejected with a reason", "[client]") {
  CHECK_THAT(ErrorOf(R"({"_step": 1, "train/loss": )"), Catch::Contains("invalid JSON"));
  CHECK_THAT(ErrorOf("not json"), Catch::Contains("invalid JSON"));
  CHECK(ErrorOf("[1, 2]") == "not a JSON object");
  CHECK(ErrorOf(R"({"train/loss": 1.0})") == "missing _step");
  CHECK(ErrorOf(R"({"_step": -3, "train/loss": 1.0})") == "negative _step");
  CHECK(ErrorOf(R"({"_step": -3.0})") == "negative _step");
  CHECK_THAT(ErrorOf(R"({"_step": 2.5})"), Catch::Contains("non-integer _step"));
  CHECK_THAT(ErrorOf(R"({"_step": 1e+30})"),
             Catch::Contains("_step 1e+30 is above the largest step the daemon keeps, 9223372036854775807"));
  CHECK_THAT(ErrorOf(R"({"_step": 9223372036854775808})"), Catch::Contains("above the largest step"));
  CHECK_THAT(ErrorOf(R"({"_step": 18446744073709551615})"), Catch::Contains("above the largest step"));
  CHECK(ErrorOf(R"({"_step": 9223372036854775807, "train/loss": 1.0})").empty());
  CHECK_THAT(ErrorOf(R"({"resume_from_step": 9223372036854775808})", true), Catch::Contains("above the largest step"));
  CHECK_THAT(ErrorOf(R"({"_step": 3, "train/loss": 1.0, "train/loss": 2.0})"),
             Catch::Contains("key \"train/loss\" appears twice in one object"));
  CHECK_THAT(ErrorOf(R"({"_step": 3, "params": [{"name": "a", "weight_decay": 0.1, "weight_decay": 0}]})"),
             Catch::Contains("key \"weight_decay\" appears twice"));
  CHECK_THAT(ErrorOf(R"({"_step": "7"})"), Catch::Contains("_step is not a number"));
  CHECK_THAT(ErrorOf(R"({"_step": NaN})"), Catch::Contains("_step is not a number"));
  CHECK(ErrorOf(R"({"_step": 1, "event": ""})") == "empty event text");
  CHECK(ErrorOf(R"({"_step": 1, "event": 5})") == "\"event\" must be a string");
  CHECK(ErrorOf(R"({"run": "x"})", false) == "a header is only allowed on the first line");
  CHECK_THAT(ErrorOf(R"({"run": "x", "params": [{"name": "a", "kind": "bogus"}]})", true),
             Catch::Contains("not a known kind"));
  CHECK_THAT(ErrorOf(R"({"params": [{"numel": 3}]})", true), Catch::Contains("name"));
  // An integral float step is still a step.
  CHECK(ParseStep(R"({"_step": 12.0})").step == 12);
  CHECK(ParseReplayLine("   ", false).ok());
}

TEST_CASE("a header gives run, config, labels and catalog entries", "[client]") {
  LineResult r =
      ParseReplayLine(R"({"run": "moe-6b", "config": {"hidden_size": 6144, "z_loss_coef": 1e-4,)"
                      R"( "optimizer": "adamw", "weight_decay": 0.1, "routing": "dropless-ep", "layers": 48},)"
                      R"( "labels": {"job": "pretrain"}, "params": [{"name": "final_norm.weight", "numel": 6144,)"
                      R"( "kind": "norm", "weight_decay": 0, "init_norm": 78.38, "role": "final_norm"},)"
                      R"( {"name": "lm_head.weight", "numel": 788000000,)"
                      R"( "kind": "lm_head", "group": "head"}, {"name": "blocks.0.w1"}]})",
                      true);
  INFO(r.error);
  REQUIRE(r.ok());
  const auto& h = std::get<HeaderRecord>(*r.line);
  CHECK(h.run == "moe-6b");
  CHECK(h.config.hidden_size() == 6144);
  CHECK(h.config.z_loss_coef() == Approx(1e-4));
  CHECK(h.config.optimizer() == "adamw");
  CHECK(h.config.weight_decay() == Approx(0.1));
  CHECK(h.config.extra().at("routing") == "dropless-ep");
  CHECK(h.config.extra().at("layers") == "48");
  CHECK(h.labels.at("job") == "pretrain");
  REQUIRE(h.params.size() == 3);
  CHECK(h.params[0].kind() == v1::PARAM_KIND_NORM_GAIN);
  CHECK(h.params[0].init_norm() == Approx(78.38));
  CHECK(h.params[0].role() == "final_norm");
  CHECK(h.params[1].kind() == v1::PARAM_KIND_OUTPUT);
  CHECK(h.params[1].group() == "head");

  ReplayCatalog catalog;
  catalog.SetHeader(h);
  const auto params = catalog.Params();
  CHECK(params[0].weight_decay() == 0.0);
  // No weight decay given: the config's default for a decayed kind.
  CHECK(params[1].weight_decay() == Approx(0.1));
  CHECK(params[2].kind() == v1::PARAM_KIND_OTHER);
  CHECK(params[2].weight_decay() == Approx(0.1));
}

TEST_CASE("param kinds are inferred from names", "[client]") {
  const std::vector<std::pair<std::string, v1::ParamKind>> cases = {
      {"final_norm.weight", v1::PARAM_KIND_NORM_GAIN},
      {"transformer.ln_f.weight", v1::PARAM_KIND_NORM_GAIN},
      {"h.0.ln_1.weight", v1::PARAM_KIND_NORM_GAIN},
      {"layers.3.input_layernorm.weight", v1::PARAM_KIND_NORM_GAIN},
      {"lm_head.weight", v1::PARAM_KIND_OUTPUT},
      {"output_proj", v1::PARAM_KIND_OUTPUT},
      {"tok_embeddings.weight", v1::PARAM_KIND_EMBEDDING},
      {"layers.3.moe.router.weight", v1::PARAM_KIND_ROUTER},
      {"layers.3.gate.weight", v1::PARAM_KIND_ROUTER},
      {"layers.3.attn.qkv", v1::PARAM_KIND_ATTENTION},
      {"layers.3.self_attention.dense", v1::PARAM_KIND_ATTENTION},
      {"layers.3.mlp.fc1", v1::PARAM_KIND_MLP},
      {"layers.3.experts.w2", v1::PARAM_KIND_MLP},
      {"layers.3.ffn.w1", v1::PARAM_KIND_MLP},
      {"rotary.inv_freq", v1::PARAM_KIND_OTHER},
      {"model.layers.3.mlp.gate_proj.weight", v1::PARAM_KIND_MLP},
      {"layers.3.feed_forward.up_proj.weight", v1::PARAM_KIND_MLP},
      {"bert.encoder.layer.0.attention.output.dense.weight", v1::PARAM_KIND_ATTENTION},
      {"output.weight", v1::PARAM_KIND_OUTPUT},
  };
  for (const auto& [name, kind] : cases) {
    CAPTURE(name);
    CHECK(InferParamKind(name) == kind);
  }
  CHECK(ParseParamKind("norm_gain") == v1::PARAM_KIND_NORM_GAIN);
  CHECK(ParseParamKind("lm_head") == v1::PARAM_KIND_OUTPUT);
  CHECK(ParseParamKind("MLP") == v1::PARAM_KIND_MLP);
  CHECK_FALSE(ParseParamKind("bogus"));
}

TEST_CASE("the pre-scan builds the catalog from header and keys and counts bad lines", "[client]") {
  std::istringstream in(R"({"run": "r1", "config": {"weight_decay": 0.05},)"
                        R"( "params": [{"name": "lm_head.weight", "numel": 10}]})"
                        "\n"
                        R"({"_step": 1, "grad/norm/lm_head.weight": 0.3, "grad/norm/final_norm.weight": 0.01,)"
                        R"( "train/loss": NaN})"
                        "\n"
                        "\n"
                        R"({"_step": 2, "params/norm/blocks.0.attn.qkv": 12.5})"
                        "\n"
                        R"({"_step": -1})"
                        "\n"
                        R"({"_step": 2, "event": "routing switch"})"
                        "\n"
                        "garbage\n");
  const ReplayPlan plan = ScanReplay(in);
  CHECK(plan.lines == 7);
  CHECK(plan.step_lines == 2);
  CHECK(plan.events == 1);
  CHECK(plan.bad_line_count == 2);
  REQUIRE(plan.bad_lines.size() == 2);
  CHECK(plan.bad_lines[0].line == 5);
  CHECK(plan.bad_lines[0].reason == "negative _step");
  CHECK(plan.bad_lines[1].line == 7);
  REQUIRE(plan.header);

  const auto params = plan.catalog.Params();
  REQUIRE(params.size() == 3);
  CHECK(params[0].name() == "lm_head.weight");
  CHECK(params[0].numel() == 10);
  CHECK(params[0].kind() == v1::PARAM_KIND_OUTPUT);
  CHECK(params[0].weight_decay() == Approx(0.05));
  CHECK(params[1].name() == "final_norm.weight");
  CHECK(params[1].kind() == v1::PARAM_KIND_NORM_GAIN);
  CHECK(params[1].weight_decay() == 0.0);
  CHECK(params[2].name() == "blocks.0.attn.qkv");
  CHECK(params[2].kind() == v1::PARAM_KIND_ATTENTION);
  CHECK(params[2].weight_decay() == Approx(0.05));

  ReplayOptions options;
  options.rank = 1;
  options.world_size = 2;
  const v1::Hello hello = BuildHello(plan, options, ChooseRunId("", plan, "/tmp/x.jsonl"));
  CHECK(hello.run_id() == "r1");
  CHECK(hello.rank() == 1);
  CHECK(hello.world_size() == 2);
  CHECK(hello.params_size() == 3);
  CHECK(hello.config().weight_decay() == Approx(0.05));
}

TEST_CASE("the run id comes from the flag, then the header, then the file's stem", "[client]") {
  ReplayPlan plan;
  CHECK(ChooseRunId("", plan, "/data/my run (v2).jsonl") == "my-run--v2-");
  CHECK(ChooseRunId("explicit", plan, "/data/a.jsonl") == "explicit");
  plan.header = HeaderRecord{};
  plan.header->run = "from-header";
  CHECK(ChooseRunId("", plan, "/data/a.jsonl") == "from-header");
  CHECK(ChooseRunId("explicit", plan, "/data/a.jsonl") == "explicit");
}

TEST_CASE("without a config weight decay, inferred params are not decayed", "[client]") {
  ReplayCatalog catalog;
  catalog.AddFrom(ParseStep(R"({"_step": 1, "grad/norm/lm_head.weight": 1})"));
  CHECK(catalog.Params()[0].weight_decay() == 0.0);
}

TEST_CASE("a header's resume_from_step becomes the hello's and --resume-from overrides it", "[client][rewind]") {
  std::istringstream in(R"({"run": "r1", "resume_from_step": 20000})"
                        "\n"
                        R"({"_step": 20000, "train/loss": 2.0})"
                        "\n");
  const ReplayPlan plan = ScanReplay(in);
  REQUIRE(plan.header);
  CHECK(plan.header->resume_from_step == 20000u);
  ReplayOptions options;
  v1::Hello hello = BuildHello(plan, options, "r1");
  REQUIRE(hello.has_resume_from_step());
  CHECK(hello.resume_from_step() == 20000);
  options.resume_from = 0;  // 0 is a resume too: start over
  hello = BuildHello(plan, options, "r1");
  REQUIRE(hello.has_resume_from_step());
  CHECK(hello.resume_from_step() == 0);

  std::istringstream plain(R"({"_step": 1, "train/loss": 2.0})");
  CHECK_FALSE(BuildHello(ScanReplay(plain), ReplayOptions{}, "r1").has_resume_from_step());

  // A header with nothing but the resume point is a header; a bad value is refused.
  LineResult only = ParseReplayLine(R"({"resume_from_step": 5})", true);
  REQUIRE(only.ok());
  CHECK(std::get<HeaderRecord>(*only.line).resume_from_step == 5u);
  CHECK_THAT(ErrorOf(R"({"resume_from_step": -1})", true), Catch::Contains("resume_from_step"));
  CHECK_THAT(ErrorOf(R"({"resume_from_step": "20000"})", true), Catch::Contains("resume_from_step"));
}

TEST_CASE("a built-in series with a value that is not a number rejects its line", "[client]") {
  struct Case {
    std::string line;
    std::string error;
  };
  const std::vector<Case> cases = {
      {R"({"_step": 1, "grad/norm/total": "1.0"})", R"("grad/norm/total": "1.0" is not a number)"},
      {R"({"_step": 1, "grad/norm/total": null})", R"("grad/norm/total": null is not a number)"},
      {R"({"_step": 1, "train/loss": true})", R"("train/loss": true is not a number)"},
      {R"({"_step": 1, "params/norm/final_norm.weight": [1]})", R"("params/norm/final_norm.weight": [1] is not)"},
      {R"({"_step": 1, "train/tokens": -5})", R"("train/tokens" must be a non-negative count)"},
      {R"({"_step": 1, "grad/norm/": 0.5})", R"("grad/norm/" names no parameter)"},
      // A number written as text under a key of the user's own was meant as a number too.
      {R"({"_step": 1, "train/accuracy": "0.61"})", R"("train/accuracy": "0.61" is not a number)"},
  };
  for (const Case& c : cases) {
    CAPTURE(c.line);
    CHECK_THAT(ErrorOf(c.line), Catch::Contains(c.error));
  }
  // Text, flags and null under the user's own keys are not metrics: ignored, as before.
  const StepRecord r = ParseStep(R"({"_step": 1, "note": "text", "flag": true, "nothing": null, "loss_x": 1})");
  CHECK(r.stats.extra().size() == 1);
}

TEST_CASE("the pre-scan counts a line with a non-number built-in value as skipped", "[client]") {
  std::istringstream in(R"({"_step": 1, "grad/norm/total": 0.3})"
                        "\n"
                        R"({"_step": 2, "grad/norm/total": "1.0"})"
                        "\n"
                        R"({"_step": 3, "grad/norm/total": null})"
                        "\n");
  const ReplayPlan plan = ScanReplay(in);
  CHECK(plan.step_lines == 1);
  CHECK(plan.bad_line_count == 2);
  REQUIRE(plan.bad_lines.size() == 2);
  CHECK(plan.bad_lines[0].line == 2);
  CHECK(plan.bad_lines[1].line == 3);
}
