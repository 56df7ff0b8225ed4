#include <catch2/catch.hpp>

#include "alerts/matcher.h"
#include "alerts/state_machine.h"
#include "tests/unit/alerts/default_rule.h"

using namespace gradwatch::alerts;

namespace {

Matcher Parsed(std::string_view text) {
  auto m = Matcher::Parse(text);
  INFO(text << ": " << m.status().message());
  REQUIRE(m.ok());
  return m.value();
}

std::string ParseError(std::string_view text) {
  auto m = Matcher::Parse(text);
  REQUIRE_FALSE(m.ok());
  return m.status().message();
}

}  // namespace

TEST_CASE("matchers parse as amtool writes them", "[alerts]") {
  const Matcher eq = Parsed("run=moe-6b");
  CHECK(eq.name() == "run");
  CHECK(eq.type() == MatchType::kEqual);
  CHECK(eq.value() == "moe-6b");
  CHECK(Parsed("run!=moe-6b").type() == MatchType::kNotEqual);
  CHECK(Parsed("run=~moe-.*").type() == MatchType::kRegex);
  CHECK(Parsed("run!~moe-.*").type() == MatchType::kNotRegex);
  CHECK(Parsed("run=~moe-.*").value() == "moe-.*");
  // The first operator splits: a value may hold = and ~.
  CHECK(Parsed("comment=a=b~c").value() == "a=b~c");
  CHECK(Parsed("x==y").value() == "=y");
  // Quoted values, with escapes; an empty value.
  CHECK(Parsed(R"(run="moe 6b")").value() == "moe 6b");
  CHECK(Parsed(R"(run="say \"hi\" \\ now")").value() == R"(say "hi" \ now)");
  CHECK(Parsed("run=").value().empty());
  CHECK(Parsed(R"(run="")").value().empty());
  // A bare word is an alertname, as in `amtool silence add Foo`.
  const Matcher bare = Parsed("GradNormContingency");
  CHECK(bare.name() == "alertname");
  CHECK(bare.type() == MatchType::kEqual);
  CHECK(bare.value() == "GradNormContingency");

  CHECK_THAT(ParseError("=x"), Catch::Contains("has no label name"));
  CHECK_THAT(ParseError("run!x"), Catch::Contains("'!' must be followed by = or ~"));
  CHECK_THAT(ParseError("9run=x"), Catch::Contains("is not a label name"));
  CHECK_THAT(ParseError("run-id=x"), Catch::Contains("is not a label name"));
  CHECK_THAT(ParseError(R"(run="open)"), Catch::Contains("never closed"));
  CHECK_THAT(ParseError(R"(run="a"b")"), Catch::Contains("needs \\\""));
  CHECK_THAT(ParseError("run=~moe-("), Catch::Contains("not a regular expression (RE2 syntax): missing )"));
  CHECK_THAT(ParseError("run=~a{2,1}"), Catch::Contains("not a regular expression"));
  CHECK_THAT(ParseError(""), Catch::Contains("empty matcher"));
  CHECK_THAT(ParseError("run=" + std::string(5000, 'x')), Catch::Contains("more than 4096"));
}

TEST_CASE("matchers match as Alertmanager's do", "[alerts]") {
  const LabelSet moe{{"alertname", "GradNormContingency"}, {"run", "moe-6b"}};
  const LabelSet old{{"alertname", "GradNormContingency"}, {"run", "old-moe-6b"}};
  const LabelSet none{{"alertname", "GradNormContingency"}};

  // Regular expressions are anchored at both ends.
  CHECK(Parsed("run=~moe-.*").Matches(moe));
  CHECK_FALSE(Parsed("run=~moe-.*").Matches(old));
  CHECK(Parsed("run=~.*moe-.*").Matches(old));
  CHECK(Parsed("run=~moe|old-moe-6b").Matches(old));  // the alternation is anchored as a whole
  CHECK_FALSE(Parsed("run=~moe|old").Matches(old));
  CHECK_FALSE(Parsed("run!~moe-.*").Matches(moe));
  CHECK(Parsed("run!~moe-.*").Matches(old));
  CHECK(Parsed("run!=moe-6b").Matches(old));
  CHECK_FALSE(Parsed("run!=moe-6b").Matches(moe));

  // A missing label is an empty one.
  CHECK(Parsed("run=").Matches(none));
  CHECK_FALSE(Parsed("run!=").Matches(none));
  CHECK(Parsed("run!=").Matches(moe));
  CHECK(Parsed("run=~.*").Matches(none));
  CHECK(Parsed("run!=moe-6b").Matches(none));
  CHECK_FALSE(Parsed("run=~.+").Matches(none));

  // Byte strings that are not UTF-8 neither crash nor match a literal they do not equal.
  CHECK_FALSE(Parsed("run=~moe.*").Matches(std::string_view("\xff\xfe")));
}

TEST_CASE("matchers print back as they parse", "[alerts]") {
  for (const std::string text :
       {"run=moe-6b", "run!=moe-6b", R"(run=~"moe-.*")", R"(run!~"a|b")", R"(comment="a \"quoted\" \\ value")",
        R"(run="")", "rank=0", "param=layers.0/final_norm:weight"}) {
    CHECK(Parsed(text).ToString() == text);
    CHECK(Parsed(Parsed(text).ToString()) == Parsed(text));
  }
}

TEST_CASE("a silence needs a matcher that does not match everything", "[alerts]") {
  CHECK_THAT(CheckSilenceMatchers({}).message(), Catch::Contains("at least one matcher"));
  CHECK_THAT(CheckSilenceMatchers({Parsed("run=~.*")}).message(), Catch::Contains("it would mute every alert"));
  CHECK_THAT(CheckSilenceMatchers({Parsed("run="), Parsed("rank!=3")}).message(),
             Catch::Contains("it would mute every alert"));
  CHECK(CheckSilenceMatchers({Parsed("run=~.*"), Parsed("alertname=X")}).ok());
  CHECK(CheckSilenceMatchers({Parsed("run!=")}).ok());
  CHECK(EqualityMatchers({{"run", "a"}, {"rank", "0"}}).value().size() == 2);
  CHECK(MatchTypeFromNumber(2) == MatchType::kRegex);
  CHECK_FALSE(MatchTypeFromNumber(4).has_value());
  CHECK_FALSE(MatchTypeFromNumber(-1).has_value());
  CHECK_THAT(EqualityMatchers({{"run", "a"}, {"bad-name", "0"}}).status().message(),
             Catch::Contains("is not a label name"));
}

TEST_CASE("a regular-expression silence mutes the runs it matches and no other", "[alerts]") {
  AlertEngine engine({gradwatch::alerts::testing::DefaultRule("GradNormContingency")});
  constexpr double kT0 = 1.7e9;
  CHECK(engine.AddSilence({"all", {Parsed("run=~.*")}, kT0, kT0 + 100, "", ""}).code() ==
        gradwatch::StatusCode::kInvalidArgument);
  REQUIRE(
      engine.AddSilence({"moe", {Parsed("run=~moe-.*"), Parsed("alertname!~Loss.*")}, kT0, kT0 + 100, "", ""}).ok());
  Alert alert;
  alert.name = "GradNormContingency";
  alert.labels = {{"alertname", "GradNormContingency"}, {"run", "moe-6b"}};
  CHECK(engine.SilencesMuting(alert, kT0 + 1) == std::vector<std::string>{"moe"});
  alert.labels["run"] = "dense-1b";
  CHECK(engine.SilencesMuting(alert, kT0 + 1).empty());
  alert.labels = {{"alertname", "LossSpike"}, {"run", "moe-6b"}};
  CHECK(engine.SilencesMuting(alert, kT0 + 1).empty());
}
