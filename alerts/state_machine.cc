#include "alerts/state_machine.h"

#include <algorithm>
#include <bit>
#include <charconv>
#include <cmath>
#include <cstdlib>
#include <limits>
#include <tuple>
#include <unordered_set>
#include <utility>

#include "alerts/diagnosis.h"
#include "alerts/warmup.h"

namespace gradwatch::alerts {
namespace {

// non_finite and timer rules fire at once whatever a hand-built Rule says.
uint64_t EffectiveForSteps(const Rule& rule) {
  return rule.kind == RuleKind::kNonFinite || IsTimerRule(rule.kind) ? 0 : rule.for_steps;
}

// A firing instance whose condition no longer holds stays firing while its value has not crossed
// the clear bound. NaN has crossed nothing.
bool InClearBand(const Rule& rule, double value) {
  return (rule.clear_below && !(value < *rule.clear_below)) || (rule.clear_above && !(value > *rule.clear_above));
}

// The fields whose change must reach the disk; the value and annotations follow every step and
// are saved with the next such change.
auto DurableKey(const InstanceState& inst) {
  return std::make_tuple(inst.alert.state, inst.held_since_step, inst.clearing, inst.clearing_since_step,
                         inst.notified);
}

constexpr std::string_view kResolvedSummary = "resolved_summary";

// The annotations of an alert of `rule`: its templates rendered with the condition's variables
// and, when given (the rule shows the recommendation or the diagnosis), the diagnosis' text,
// recommendation and remediation fields. A page held during warm-up says so.
LabelSet Render(const Rule& rule, const TemplateVars& vars, const LabelSet& labels, const Diagnosis* diagnosis) {
  LabelSet out;
  if (diagnosis) {
    TemplateVars with = vars;
    with["recommendation"] = diagnosis->recommendation;
    with["diagnosis"] = diagnosis->text;
    with["cause"] = std::string(CauseName(diagnosis->cause));
    for (const auto& [name, text] : rule.annotations) {
      if (name != kResolvedSummary) out[name] = RenderTemplate(text, with, labels);
    }
    out[std::string(kCauseAnnotation)] = std::string(CauseName(diagnosis->cause));
    if (!diagnosis->remedy.param.empty()) {
      out[std::string(kRemediationParamAnnotation)] = diagnosis->remedy.param;
      out[std::string(kRemediationWeightDecayAnnotation)] = FormatNumber(diagnosis->remedy.weight_decay);
    }
    out[std::string(kRemediationSupportedAnnotation)] = diagnosis->remedy.supported ? "true" : "false";
    if (!diagnosis->remedy.why.empty()) out[std::string(kRemediationWhyAnnotation)] = diagnosis->remedy.why;
  } else {
    for (const auto& [name, text] : rule.annotations) {
      if (name != kResolvedSummary) out[name] = RenderTemplate(text, vars, labels);
    }
  }
  if (auto held = vars.find(kPageHeldVariable); held != vars.end() && !held->second.empty()) {
    out[std::string(kPageHeldVariable)] = held->second;
    std::string& summary = out["summary"];
    summary = "Not paged during warm-up: " + summary;
    std::string& description = out["description"];
    description += std::string(description.empty() ? "" : " ") + "Not paged because " + held->second +
                   "; it pages if the condition still holds once the warm-up is over.";
  }
  return out;
}

// The summary of a resolved alert, from the value and step that resolved it.
std::string ResolvedSummary(const Rule& rule, const TemplateVars& vars, const LabelSet& labels) {
  if (auto it = rule.annotations.find(std::string(kResolvedSummary)); it != rule.annotations.end()) {
    return RenderTemplate(it->second, vars, labels);
  }
  auto var = [&](const char* name) {
    auto v = vars.find(name);
    return v == vars.end() ? std::string() : v->second;
  };
  return rule.name + " resolved at step " + var("step") + " in run " + var("run") + ": value " + var("value");
}

// The summary of an instance resolved because the rule no longer yields it: the rule no longer
// selects its parameter (a catalog change), or nothing of it was reported.
std::string NoLongerJudgedSummary(const Rule& rule, const LabelSet& labels, const RunFacts& facts,
                                  const std::string& run) {
  std::string who, why;
  for (const char* label : {"param", "series", "group"}) {
    if (auto it = labels.find(label); it != labels.end() && who.empty()) who = it->second;
  }
  if (auto event = labels.find("event_step"); event != labels.end() && !who.empty()) {
    uint64_t at = 0;
    const auto [end, ec] = std::from_chars(event->second.data(), event->second.data() + event->second.size(), at);
    if (ec == std::errc() && end == event->second.data() + event->second.size()) {
      who = "the slope change of " + who + " at step " + FormatStep(at);
    }
  }
  if (why.empty() && rule.kind == RuleKind::kSlopeChange) why = "its slopes are no longer measured around the event";
  if (auto param = labels.find("param"); param != labels.end()) {
    for (const ParamFact& p : facts.params) {
      if (p.info.name != param->second) continue;
      if (rule.kind == RuleKind::kGrowthWithoutDecay && !GrowthRuleSelects(rule, p.info)) {
        why = p.info.weight_decay > rule.max_weight_decay
                  ? "its weight decay is now " + FormatNumber(p.info.weight_decay) + ", above the rule's " +
                        FormatNumber(rule.max_weight_decay)
                  : "the rule no longer selects its kind";
      } else if (rule.kind == RuleKind::kShare && !ShareRuleSelectsParam(rule, p.info.name, p.info.kind)) {
        why = "the rule no longer selects its kind";
      }
    }
  }
  if (why.empty()) why = "nothing of it was reported at this step";
  return rule.name + " resolved at step " + FormatStep(facts.step) + " in run " + run + ": " +
         (who.empty() ? std::string("it") : who) + " is no longer judged by this rule (" + why + ")";
}

// Firing → resolved at `step`, its summary rendered from the values that resolved it.
void Resolve(const Rule& rule, InstanceState& inst, const TemplateVars& vars, uint64_t step, double now,
             std::vector<Transition>* out) {
  if (inst.alert.labels.count(std::string(kPageHeldLabel))) {
    // Its condition may still hold: the held warning ends because the warm-up did.
    inst.alert.annotations["summary"] = rule.name + " warning held during warm-up over at step " + FormatStep(step) +
                                        " in run " + inst.run + ": the page rule judges the run from here";
  } else {
    inst.alert.annotations["summary"] = ResolvedSummary(rule, vars, inst.alert.labels);
  }
  inst.alert.state = AlertState::kResolved;
  inst.alert.step = step;
  inst.alert.ends_at = now;
  out->push_back(Transition{inst.alert, AlertState::kFiring, AlertState::kResolved, inst.notified});
}

}  // namespace

void StateChanges::Merge(StateChanges later) {
  for (auto& [fp, state] : later.instances) instances[fp] = std::move(state);
  for (auto& [id, silence] : later.silences) silences[id] = std::move(silence);
  for (auto& [fp, level] : later.levels) levels[fp] = std::move(level);
  for (auto& [run, step] : later.evaluated) evaluated[run] = step;
  for (HistoryEntry& e : later.history) history.push_back(std::move(e));
}

AlertEngine::AlertEngine(std::vector<Rule> rules) { SetRulesLocked(std::move(rules)); }

void AlertEngine::SetChangeSink(ChangeSink sink) {
  std::lock_guard lock(mu_);
  sink_ = std::move(sink);
}

void AlertEngine::PublishLocked(const std::vector<Transition>& transitions, bool progress_may_wait) {
  const bool durable = !dirty_instances_.empty() || !dirty_silences_.empty() || !transitions.empty();
  if (!durable && (progress_may_wait || (dirty_levels_.empty() && dirty_evaluated_.empty() && dirty_shown_.empty()))) {
    return;
  }
  StateChanges changes;
  for (uint64_t fp : dirty_levels_) {
    auto it = levels_.find(fp);
    if (it == levels_.end()) {
      if (sink_) changes.levels[fp] = std::nullopt;
      continue;
    }
    LevelTracker& t = it->second;
    t.dirty = false;
    if (sink_) changes.levels[fp] = LevelState{t.rule, t.run, t.window.raw(), t.since_mark, t.all_since_mark};
  }
  if (sink_) {
    // Instances whose shown value moved: written with the progress, as they are at this moment.
    for (uint64_t fp : dirty_shown_) {
      auto it = instances_.find(fp);
      if (it != instances_.end()) changes.instances[fp] = it->second;
    }
    for (const std::string& run : dirty_evaluated_) {
      auto it = evaluated_.find(run);
      changes.evaluated[run] = it == evaluated_.end() ? std::nullopt : std::optional<uint64_t>(it->second);
    }
    for (uint64_t fp : dirty_instances_) {
      auto it = instances_.find(fp);
      changes.instances[fp] = it == instances_.end() ? std::nullopt : std::optional<InstanceState>(it->second);
    }
    for (const std::string& id : dirty_silences_) {
      auto it = silences_.find(id);
      changes.silences[id] = it == silences_.end() ? std::nullopt : std::optional<Silence>(it->second);
    }
  }
  dirty_instances_.clear();
  dirty_silences_.clear();
  dirty_levels_.clear();
  dirty_evaluated_.clear();
  dirty_shown_.clear();
  if (sink_) sink_(std::move(changes), transitions);
}

std::vector<Transition> AlertEngine::Restore(SavedState saved, double now) {
  std::lock_guard lock(mu_);
  for (InstanceState& inst : saved.instances) {
    if (inst.alert.state != AlertState::kPending && inst.alert.state != AlertState::kFiring) continue;
    const uint64_t fp = Fingerprint(inst.alert.labels);
    instances_[fp] = std::move(inst);
  }
  for (Silence& silence : saved.silences) {
    if (silence.ends_at > now) {
      silences_[silence.id] = std::move(silence);
    } else {
      TouchSilence(silence.id);  // ended while the daemon was down: forget it
    }
  }
  for (auto& [fp, level] : saved.levels) {
    LevelTracker& t = levels_[fp];
    t.rule = std::move(level.rule);
    t.run = std::move(level.run);
    t.window = ReportWindow::FromRaw(level.window);
    t.since_mark = static_cast<size_t>(level.since_mark);
    t.all_since_mark = level.all_since_mark;
  }
  for (const auto& [run, step] : saved.evaluated) evaluated_[run] = step;
  std::unordered_set<std::string> names;
  for (const Rule& r : rules_) names.insert(r.name);
  std::vector<Transition> out;
  EndInstances([&](const Instance& inst) { return names.count(inst.rule) == 0; }, now, &out);
  DropTrackers([&](const LevelTracker& t) { return names.count(t.rule) == 0; });
  PublishLocked(out);
  return out;
}

void AlertEngine::FlushProgress() {
  std::lock_guard lock(mu_);
  PublishLocked({});
}

std::optional<uint64_t> AlertEngine::EvaluatedThrough(std::string_view run) const {
  std::lock_guard lock(mu_);
  auto it = evaluated_.find(run);
  if (it == evaluated_.end()) return std::nullopt;
  return it->second;
}

void AlertEngine::SetEvaluatedLocked(const std::string& run, std::optional<uint64_t> step) {
  auto it = evaluated_.find(run);
  if (!step) {
    if (it == evaluated_.end()) return;
    evaluated_.erase(it);
  } else if (it == evaluated_.end()) {
    evaluated_.emplace(run, *step);
  } else if (it->second != *step) {
    it->second = *step;
  } else {
    return;
  }
  dirty_evaluated_.insert(run);
}

AlertEngine::RunScratch& AlertEngine::ScratchLocked(const RunFacts& facts) {
  auto it = scratch_.find(facts.run_id);
  if (it == scratch_.end()) it = scratch_.emplace(facts.run_id, RunScratch{}).first;
  RunScratch& scratch = it->second;
  if (scratch.base.size() != rules_.size() || scratch.run_labels != facts.run_labels) {
    scratch.run_labels = facts.run_labels;
    scratch.base.clear();
    for (const Rule& rule : rules_) scratch.base.push_back(BaseLabels(rule, facts));
    scratch.conditions.resize(rules_.size());
  }
  return scratch;
}

void AlertEngine::SetRulesLocked(std::vector<Rule> rules) {
  scratch_.clear();  // rule indices change
  rules_ = std::move(rules);
  rules_generation_.fetch_add(1, std::memory_order_acq_rel);
  uses_recommendation_.assign(rules_.size(), false);
  for (size_t i = 0; i < rules_.size(); ++i) {
    for (const auto& [name, text] : rules_[i].annotations) {
      if (TemplateUses(text, "recommendation") || TemplateUses(text, "diagnosis")) uses_recommendation_[i] = true;
    }
  }
  bounds_ = BoundsFromRules(rules_);
}

std::vector<Transition> AlertEngine::ReplaceRules(std::vector<Rule> rules, double now) {
  std::lock_guard lock(mu_);
  std::unordered_set<std::string> names;
  for (const Rule& r : rules) names.insert(r.name);
  std::vector<Transition> out;
  EndInstances([&](const Instance& inst) { return names.count(inst.rule) == 0; }, now, &out);
  DropTrackers([&](const LevelTracker& t) { return names.count(t.rule) == 0; });
  SetRulesLocked(std::move(rules));
  PublishLocked(out);
  return out;
}

std::vector<Rule> AlertEngine::Rules() const {
  std::lock_guard lock(mu_);
  return rules_;
}

DiagnosisBounds AlertEngine::diagnosis_bounds() const {
  std::lock_guard lock(mu_);
  return bounds_;
}

void AlertEngine::ReadFits(const std::vector<ParamInfo>& catalog, size_t from, std::vector<uint8_t>& norm,
                           std::vector<uint8_t>& share) const {
  std::lock_guard lock(mu_);
  const bool recommendation =
      std::find(uses_recommendation_.begin(), uses_recommendation_.end(), true) != uses_recommendation_.end();
  RulesReadFits(rules_, recommendation, catalog, from, norm, share);
}

bool AlertEngine::Advance(const Rule& rule, Instance& inst, const Condition* cond, const RunFacts& facts, double now,
                          const Diagnosis* recommendation, std::vector<Transition>* out) {
  const uint64_t step = facts.step;
  const AlertState state = inst.alert.state;
  const bool holds = cond && cond->active;
  const bool in_band = !holds && cond && state == AlertState::kFiring && InClearBand(rule, cond->value);
  auto emit = [&](AlertState from, bool notify) {
    out->push_back(Transition{inst.alert, from, inst.alert.state, notify});
  };
  if (cond && (holds || in_band)) {
    inst.alert.value = cond->value;
    inst.alert.annotations = Render(rule, cond->vars.Format(), inst.alert.labels, recommendation);
  }

  switch (state) {
    case AlertState::kInactive:
    case AlertState::kResolved: {
      if (!holds) return false;
      inst.held_since_step = step;
      inst.alert.starts_at = now;
      inst.alert.ends_at = 0;
      inst.alert.step = step;
      if (EffectiveForSteps(rule) == 0) {
        inst.alert.state = AlertState::kFiring;
        inst.notified = !IsMutedLocked(inst.alert, now);
        emit(state, inst.notified);
      } else {
        inst.alert.state = AlertState::kPending;
        emit(state, false);
      }
      return true;
    }
    case AlertState::kPending: {
      if (!holds) {
        inst.alert.state = AlertState::kInactive;
        inst.alert.step = step;
        emit(AlertState::kPending, false);
        return false;
      }
      if (step < inst.held_since_step) inst.held_since_step = step;  // the run went back in steps
      if (step >= inst.held_since_step + EffectiveForSteps(rule)) {
        inst.alert.state = AlertState::kFiring;
        inst.alert.step = step;
        inst.notified = !IsMutedLocked(inst.alert, now);
        emit(AlertState::kPending, inst.notified);
      }
      return true;
    }
    case AlertState::kFiring: {
      if (holds || in_band) {
        inst.clearing = false;
        return true;
      }
      if (!inst.clearing || step < inst.clearing_since_step) {
        inst.clearing = true;
        inst.clearing_since_step = step;
      }
      if (step < inst.clearing_since_step + rule.resolve_for_steps) return true;
      if (cond) {
        inst.alert.value = cond->value;
        Resolve(rule, inst, cond->vars.Format(), step, now, out);
      } else {
        // No condition: the rule's own resolved_summary would speak of a value that was not
        // measured (a warning held during warm-up says why it ended: Resolve).
        Resolve(rule, inst, {}, step, now, out);
        if (!inst.alert.labels.count(std::string(kPageHeldLabel))) {
          out->back().alert.annotations["summary"] = inst.alert.annotations["summary"] =
              NoLongerJudgedSummary(rule, inst.alert.labels, facts, inst.run);
        }
      }
      return false;
    }
  }
  return false;
}

bool AlertEngine::AdvanceLevel(const Rule& rule, Instance& inst, const Condition& cond, LevelTracker& tracker,
                               uint64_t step, double now, const Diagnosis* recommendation,
                               std::vector<Transition>* out) {
  using Column = ReportWindow::Column;
  const LevelTest& level = *cond.level;
  const ReportWindow& window = tracker.window;
  const AlertState state = inst.alert.state;
  const bool up = IsUpward(level.op);
  const size_t k = std::min(window.size(), kLevelReports);
  const double sigma = window.Noise();
  const double scale = std::max(std::fabs(level.bound), std::numeric_limits<double>::min());
  const bool noise_free = sigma <= kNoiseFreeRelative * scale;
  const double margin = kLevelZ * 1.2533 * sigma / std::sqrt(static_cast<double>(std::max<size_t>(k, 1)));
  // Whether the level holds / is past the clear band significantly (see the header).
  auto level_holds = [&] {
    if (noise_free && tracker.all_since_mark) return true;
    const double m = window.Median(Column::kHold, k);
    return LevelHolds(level, up ? m - margin : m + margin);
  };
  auto level_cleared = [&] {
    if (noise_free && tracker.all_since_mark) return true;
    const double m = window.Median(Column::kClear, k);
    return LevelPastClear(level, up ? m + margin : m - margin);
  };
  auto recent = [&](Column column) { return window.Median(column, std::min(tracker.since_mark, kLevelReports)); };
  // The value shown: the level of the reports since the mark, or the estimate itself.
  auto render = [&](double shown) {
    TemplateVars vars = cond.vars.Format();
    if (level.shows_level && std::isfinite(shown)) {
      vars["value"] = level.percent ? FormatPercent(shown) : FormatNumber(shown);
    }
    inst.alert.value = level.shows_level && std::isfinite(shown) ? shown : cond.value;
    return vars;
  };
  auto emit = [&](AlertState from, bool notify) {
    out->push_back(Transition{inst.alert, from, inst.alert.state, notify});
  };
  auto fire = [&](AlertState from) {
    inst.alert.state = AlertState::kFiring;
    inst.alert.step = step;
    inst.notified = !IsMutedLocked(inst.alert, now);
    emit(from, inst.notified);
  };
  const bool holds = cond.active;
  const bool past = LevelPastClear(level, level.clear_measure);
  const uint64_t for_steps = EffectiveForSteps(rule);

  switch (state) {
    case AlertState::kInactive:
    case AlertState::kResolved: {
      if (!holds) return false;
      tracker.Mark();
      inst.held_since_step = step;
      inst.clearing = false;
      inst.alert.starts_at = now;
      inst.alert.ends_at = 0;
      inst.alert.step = step;
      inst.alert.annotations = Render(rule, render(recent(Column::kValue)), inst.alert.labels, recommendation);
      if (for_steps == 0 && level_holds()) {
        fire(state);
      } else {
        inst.alert.state = AlertState::kPending;
        emit(state, false);
      }
      return true;
    }
    case AlertState::kPending: {
      tracker.Count(holds);
      if (!LevelHolds(level, recent(Column::kHold))) {
        inst.alert.state = AlertState::kInactive;
        inst.alert.step = step;
        emit(AlertState::kPending, false);
        return false;
      }
      if (step < inst.held_since_step) inst.held_since_step = step;  // the run went back in steps
      inst.alert.annotations = Render(rule, render(recent(Column::kValue)), inst.alert.labels, recommendation);
      if (step >= inst.held_since_step + for_steps && level_holds()) fire(AlertState::kPending);
      return true;
    }
    case AlertState::kFiring: {
      if (!inst.clearing) {
        tracker.Count(holds);
        inst.alert.annotations = Render(rule, render(recent(Column::kValue)), inst.alert.labels, recommendation);
        if (!past) return true;
        inst.clearing = true;
        inst.clearing_since_step = step;
        tracker.Mark();
      } else {
        tracker.Count(past);
        if (!LevelPastClear(level, recent(Column::kClear))) {
          inst.clearing = false;
          tracker.since_mark = kLevelReports;  // the level shown is that of the last reports again
          inst.alert.annotations = Render(rule, render(recent(Column::kValue)), inst.alert.labels, recommendation);
          return true;
        }
        if (step < inst.clearing_since_step) inst.clearing_since_step = step;
      }
      if (step < inst.clearing_since_step + rule.resolve_for_steps || !level_cleared()) return true;
      Resolve(rule, inst, render(recent(Column::kValue)), step, now, out);
      return false;
    }
  }
  return false;
}

template <typename Pred>
void AlertEngine::DropTrackers(Pred drop) {
  for (auto it = levels_.begin(); it != levels_.end();) {
    if (drop(it->second)) {
      TouchLevel(it->first, it->second);
      it = levels_.erase(it);
    } else {
      ++it;
    }
  }
}

void AlertEngine::EvaluateRule(size_t rule_index, const RunFacts& facts, double now,
                               std::optional<Diagnosis>* recommendation, std::vector<Transition>* out) {
  const Rule& rule = rules_[rule_index];
  RunScratch& scratch = ScratchLocked(facts);
  // A non_finite rule looks at every series: only those with an instance need an inactive
  // condition (to count toward resolving), so the others cost nothing while finite.
  with_instance_.clear();
  if (rule.kind == RuleKind::kNonFinite) {
    for (const auto& [fp, inst] : instances_) {
      if (inst.rule != rule.name || inst.run != facts.run_id) continue;
      if (auto s = inst.alert.labels.find("series"); s != inst.alert.labels.end()) with_instance_.push_back(s->second);
    }
    std::sort(with_instance_.begin(), with_instance_.end());
  }
  const SeriesFilter filter = [this](std::string_view series) {
    return std::binary_search(with_instance_.begin(), with_instance_.end(), series);
  };
  ConditionList& conditions = scratch.conditions[rule_index];
  Evaluate(rule, facts, scratch.base[rule_index], rule.kind == RuleKind::kNonFinite ? &filter : nullptr, conditions);
  // One instance, one evaluation: the first condition of each fingerprint.
  fingerprints_.clear();
  for (size_t i = 0; i < conditions.size(); ++i) fingerprints_.emplace_back(conditions[i].fingerprint, i);
  std::sort(fingerprints_.begin(), fingerprints_.end());
  first_of_fingerprint_.assign(conditions.size(), 0);
  seen_.clear();
  for (size_t i = 0; i < fingerprints_.size(); ++i) {
    if (i > 0 && fingerprints_[i].first == fingerprints_[i - 1].first) continue;
    first_of_fingerprint_[fingerprints_[i].second] = 1;
    seen_.push_back(fingerprints_[i].first);
  }
  // Only instances that exist or start now reach Advance, so the recommendation is computed
  // (once per evaluation) only when some alert will carry it.
  auto recommendation_for = [&]() -> const Diagnosis* {
    if (!uses_recommendation_[rule_index]) return nullptr;
    if (!*recommendation) *recommendation = Diagnose(facts, bounds_);
    return &**recommendation;
  };

  // Advances one instance, recording a durable change; false when it ended.
  auto advance = [&](auto it, const Condition* c, const Diagnosis* rec) {
    const auto before = DurableKey(it->second);
    const double shown = it->second.alert.value;
    const bool keep = Advance(rule, it->second, c, facts, now, rec, out);
    if (!keep || DurableKey(it->second) != before) {
      Touch(it->first);
    } else if (std::bit_cast<uint64_t>(it->second.alert.value) != std::bit_cast<uint64_t>(shown)) {
      TouchShown(it->first);
    }
    return keep;
  };
  for (size_t i = 0; i < conditions.size(); ++i) {
    if (!first_of_fingerprint_[i]) continue;
    const Condition& c = conditions[i];
    const uint64_t fp = c.fingerprint;
    LevelTracker* tracker = nullptr;
    if (c.level) {
      if (std::isnan(c.level->hold_measure) || std::isnan(c.level->clear_measure)) continue;  // no report
      auto [t, created] = levels_.try_emplace(fp);
      if (created) t->second.rule = rule.name, t->second.run = facts.run_id;
      tracker = &t->second;
      tracker->window.Add(c.value, c.level->hold_measure, c.level->clear_measure);
      TouchLevel(fp, *tracker);
    }
    auto it = instances_.find(fp);
    if (it == instances_.end()) {
      if (!c.active) continue;
      Instance inst;
      inst.rule = rule.name;
      inst.run = facts.run_id;
      inst.alert.name = rule.name;
      inst.alert.labels = c.labels;
      it = instances_.emplace(fp, std::move(inst)).first;
    }
    bool keep;
    if (tracker != nullptr) {
      const auto before = DurableKey(it->second);
      const double shown = it->second.alert.value;
      keep = AdvanceLevel(rule, it->second, c, *tracker, facts.step, now, recommendation_for(), out);
      if (!keep || DurableKey(it->second) != before) {
        Touch(it->first);
      } else if (std::bit_cast<uint64_t>(it->second.alert.value) != std::bit_cast<uint64_t>(shown)) {
        TouchShown(it->first);
      }
    } else {
      keep = advance(it, &c, recommendation_for());
    }
    if (!keep) instances_.erase(it);
  }
  for (auto it = instances_.begin(); it != instances_.end();) {
    Instance& inst = it->second;
    if (inst.rule != rule.name || inst.run != facts.run_id ||
        std::binary_search(seen_.begin(), seen_.end(), it->first)) {
      ++it;
      continue;
    }
    if (!advance(it, nullptr, nullptr)) {
      it = instances_.erase(it);
    } else {
      ++it;
    }
  }
}

std::vector<Transition> AlertEngine::EvaluateStep(const RunFacts& facts, double now) {
  std::lock_guard lock(mu_);
  std::vector<Transition> out;
  std::optional<Diagnosis> recommendation;  // computed once, only if some alert needs it
  for (size_t i = 0; i < rules_.size(); ++i) {
    if (IsTimerRule(rules_[i].kind)) continue;
    EvaluateRule(i, facts, now, &recommendation, &out);
  }
  SetEvaluatedLocked(facts.run_id, facts.step);
  CatchUpLocked(facts.run_id, now, &out);
  PublishLocked(out, /*progress_may_wait=*/true);
  return out;
}

bool AlertEngine::HasTimerRules() const {
  std::lock_guard lock(mu_);
  return std::any_of(rules_.begin(), rules_.end(), [](const Rule& r) { return IsTimerRule(r.kind); });
}

std::vector<Transition> AlertEngine::EvaluateTimer(const std::vector<RunFacts>& runs, double now,
                                                   const std::vector<std::string>& idle) {
  std::vector<Transition> out;
  std::vector<std::string> held = idle;
  for (const RunFacts& facts : runs) {
    held.push_back(facts.run_id);
    for (Transition& t : EvaluateTimerRun(facts, now)) out.push_back(std::move(t));
  }
  for (Transition& t : EndTimers(held, now)) out.push_back(std::move(t));
  return out;
}

std::vector<Transition> AlertEngine::EvaluateTimerRun(const RunFacts& facts, double now) {
  std::lock_guard lock(mu_);
  std::vector<Transition> out;
  std::optional<Diagnosis> recommendation;
  for (size_t i = 0; i < rules_.size(); ++i) {
    if (IsTimerRule(rules_[i].kind)) EvaluateRule(i, facts, now, &recommendation, &out);
  }
  PublishLocked(out);
  return out;
}

std::vector<Transition> AlertEngine::EndTimers(const std::vector<std::string>& held, double now) {
  std::lock_guard lock(mu_);
  std::vector<Transition> out;
  const std::unordered_set<std::string_view> listed(held.begin(), held.end());
  std::unordered_set<std::string_view> stalled_rules;
  for (const Rule& r : rules_) {
    if (r.kind == RuleKind::kStalled) stalled_rules.insert(r.name);
  }
  EndInstances([&](const Instance& inst) { return stalled_rules.count(inst.rule) && !listed.count(inst.run); }, now,
               &out);
  EndRunDiedLocked(
      RunEnding::kLeftMemory, [&](const Instance& inst) { return !listed.count(inst.run); }, now, &out);
  for (auto it = silences_.begin(); it != silences_.end();) {
    if (it->second.ends_at <= now) {
      TouchSilence(it->first);
      it = silences_.erase(it);
    } else {
      ++it;
    }
  }
  CatchUpLocked({}, now, &out);
  PublishLocked(out);
  return out;
}

std::vector<Transition> AlertEngine::ForgetRun(const std::string& run_id, double now) {
  std::lock_guard lock(mu_);
  std::vector<Transition> out;
  EndInstances([&](const Instance& inst) { return inst.run == run_id; }, now, &out);
  DropTrackers([&](const LevelTracker& t) { return t.run == run_id; });
  SetEvaluatedLocked(run_id, std::nullopt);
  scratch_.erase(run_id);
  PublishLocked(out);
  return out;
}

std::vector<Transition> AlertEngine::RewindRun(const std::string& run_id, uint64_t from_step, double now) {
  std::lock_guard lock(mu_);
  std::vector<Transition> out;
  EndInstances(
      [&](const Instance& inst) {
        if (inst.run != run_id) return false;
        if (inst.alert.state == AlertState::kPending) return inst.held_since_step >= from_step;
        // A firing alert's step is the step it fired at (it changes only with its state).
        return inst.alert.state == AlertState::kFiring && inst.alert.step >= from_step;
      },
      now, &out);
  for (auto& [fingerprint, inst] : instances_) {
    if (inst.run == run_id && inst.clearing && inst.clearing_since_step >= from_step) {
      inst.clearing = false;
      Touch(fingerprint);
    }
  }
  // The reports of the abandoned branch say nothing about the new one.
  DropTrackers([&](const LevelTracker& t) { return t.run == run_id; });
  // Its steps from from_step on are reported again, and must be evaluated again.
  if (auto it = evaluated_.find(run_id); it != evaluated_.end() && it->second >= from_step) {
    SetEvaluatedLocked(run_id, from_step > 0 ? std::optional<uint64_t>(from_step - 1) : std::nullopt);
  }
  PublishLocked(out);
  return out;
}

std::vector<Transition> AlertEngine::EndRun(const std::string& run_id, RunEnding how, double now) {
  std::lock_guard lock(mu_);
  std::vector<Transition> out;
  EndInstances([&](const Instance& inst) { return inst.run == run_id && !IsRunDiedRuleLocked(inst.rule); }, now, &out);
  EndRunDiedLocked(
      how, [&](const Instance& inst) { return inst.run == run_id; }, now, &out);
  DropTrackers([&](const LevelTracker& t) { return t.run == run_id; });
  // A run brought back into memory later is evaluated from its next live step on.
  if (how == RunEnding::kLeftMemory) {
    SetEvaluatedLocked(run_id, std::nullopt);
    scratch_.erase(run_id);
  }
  PublishLocked(out);
  return out;
}

bool AlertEngine::IsRunDiedRuleLocked(std::string_view rule_name) const {
  for (const Rule& r : rules_) {
    if (r.name == rule_name) return r.kind == RuleKind::kRunDied;
  }
  return false;
}

template <typename Pred>
void AlertEngine::EndRunDiedLocked(RunEnding how, Pred of_run, double now, std::vector<Transition>* out) {
  if (how == RunEnding::kWithoutGoodbye) return;
  EndInstances(
      [&](const Instance& inst) {
        if (!of_run(inst) || !IsRunDiedRuleLocked(inst.rule)) return false;
        return how == RunEnding::kGoodbye || inst.ack.has_value();
      },
      now, out);
}

template <typename Pred>
void AlertEngine::EndInstances(Pred ends, double now, std::vector<Transition>* out) {
  for (auto it = instances_.begin(); it != instances_.end();) {
    Instance& inst = it->second;
    if (!ends(inst)) {
      ++it;
      continue;
    }
    const AlertState from = inst.alert.state;
    if (from == AlertState::kFiring) {
      inst.alert.state = AlertState::kResolved;
      inst.alert.ends_at = now;
      out->push_back(Transition{inst.alert, from, AlertState::kResolved, inst.notified});
    } else if (from == AlertState::kPending) {
      inst.alert.state = AlertState::kInactive;
      out->push_back(Transition{inst.alert, from, AlertState::kInactive, false});
    }
    Touch(it->first);
    it = instances_.erase(it);
  }
}

void AlertEngine::CatchUpLocked(std::string_view run, double now, std::vector<Transition>* out) {
  for (auto& [fp, inst] : instances_) {
    if (inst.alert.state != AlertState::kFiring || inst.notified) continue;
    if (!run.empty() && inst.run != run) continue;
    if (IsMutedLocked(inst.alert, now)) continue;
    inst.notified = true;
    Touch(fp);
    out->push_back(Transition{inst.alert, AlertState::kFiring, AlertState::kFiring, true});
  }
}

std::vector<Alert> AlertEngine::Active(std::string_view run) const {
  std::lock_guard lock(mu_);
  std::vector<Alert> out;
  for (const auto& [fp, inst] : instances_) {
    if (!run.empty() && inst.run != run) continue;
    if (inst.alert.state == AlertState::kPending || inst.alert.state == AlertState::kFiring) {
      out.push_back(inst.alert);
    }
  }
  std::sort(out.begin(), out.end(),
            [](const Alert& a, const Alert& b) { return std::tie(a.name, a.labels) < std::tie(b.name, b.labels); });
  return out;
}

}  // namespace gradwatch::alerts
