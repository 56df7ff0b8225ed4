#include "client/cli/app.h"

#include <spdlog/sinks/stdout_color_sinks.h>
#include <spdlog/spdlog.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <cstdlib>
#include <iostream>
#include <string>
#include <vector>

#include "client/cli/commands.h"
#include "client/cli/completion.h"
#include "client/cli/log_formats.h"
#include "client/cli/options.h"
#include "client/cli/plot.h"
#include "client/cli/replay.h"
#include "client/cli/report.h"
#include "client/cli/tail.h"
#include "client/cli/values.h"
#include "gradwatch/monitor.h"
#include "gradwatch/query_client.h"
#include "server/core/suggest.h"
#include "server/core/version.h"

namespace gradwatch::cli {

namespace {

// The command line's deepest subcommand, as "series " (empty for none), for the hint.
std::string ActiveCommand(const CLI::App& app) {
  std::string path;
  const CLI::App* at = &app;
  for (;;) {
    const auto subs = at->get_subcommands();
    if (subs.empty()) break;
    at = subs.front();
    path += at->get_name() + " ";
  }
  return path;
}

// CLI11's messages for an unknown option and a value that does not convert, said as a sentence
// with a suggestion; empty for the errors whose own words are clear.
std::string UsageError(const CLI::App& app, const CLI::ParseError& e) {
  const std::string what = e.what();
  if (dynamic_cast<const CLI::ExtrasError*>(&e) != nullptr) {
    const size_t colon = what.find(": ");
    const std::string extra = colon == std::string::npos ? what : what.substr(colon + 2);
    // CLI11 lists them last first: the option among them, if any.
    std::string first;
    for (size_t at = 0; at < extra.size() && first.empty();) {
      const size_t end = std::min(extra.find(' ', at), extra.size());
      if (extra[at] == '-') first = extra.substr(at, end - at);
      at = end + 1;
    }
    if (first.empty()) return "";  // stray positionals: CLI11's words name them
    std::vector<std::string> known;
    const CLI::App* at = &app;
    for (;;) {
      for (const CLI::Option* opt : at->get_options()) {
        for (const std::string& name : opt->get_lnames()) known.push_back("--" + name);
      }
      const auto subs = at->get_subcommands();
      if (subs.empty()) break;
      at = subs.front();
    }
    return "unknown option " + first + DidYouMean(first, known);
  }
  if (dynamic_cast<const CLI::ConversionError*>(&e) != nullptr) {
    // "Could not convert: --from = abc"
    const size_t colon = what.find(": ");
    const size_t equals = what.find(" = ");
    if (colon == std::string::npos || equals == std::string::npos || equals < colon) return "";
    const std::string option = what.substr(colon + 2, equals - colon - 2);
    const std::string value = what.substr(equals + 3);
    std::string type;
    for (const CLI::App* at = &app; at != nullptr;) {
      if (const CLI::Option* opt = at->get_option_no_throw(option)) type = opt->get_type_name();
      const auto subs = at->get_subcommands();
      at = subs.empty() ? nullptr : subs.front();
    }
    const std::string kind = type == "UINT"    ? "a whole number of 0 or more"
                             : type == "INT"   ? "a whole number"
                             : type == "FLOAT" ? "a number"
                                               : "a value of its kind (" + (type.empty() ? "see --help" : type) + ")";
    return option + ": '" + value + "' is not " + kind;
  }
  return "";
}

constexpr char kFooter[] = R"(Exit codes:
  0  success
  1  failure: daemon unreachable, RPC error, run or series not found, file unreadable;
     replay stopped before every step was acknowledged (no acknowledgement for
     --stall-timeout, SIGINT or SIGTERM, stream refused): it says which steps are kept, and
     the same command run again sends only the rest
  2  usage error
  3  replay finished, but some lines were skipped or rejected by the daemon; tail ended,
     but the daemon rejected some steps or some were dropped while it was away

Environment:
  GRADWATCH_ADDR  default for --addr)";

std::string DefaultAddress() {
  const char* env = std::getenv("GRADWATCH_ADDR");
  return env != nullptr && *env != '\0' ? env : client::kDefaultAddress;
}

std::string Join(const std::vector<std::string>& words) {
  std::string out;
  for (const std::string& w : words) out += (out.empty() ? "" : " ") + w;
  return out;
}

// `app`'s subcommand called `name`, or null.
CLI::App* FindSubcommand(CLI::App& app, const std::string& name) {
  for (CLI::App* sub : app.get_subcommands([](CLI::App*) { return true; })) {
    if (sub->get_name() == name) return sub;
  }
  return nullptr;
}

// The names of `app`'s subcommands.
std::vector<std::string> SubcommandNames(CLI::App& app) {
  std::vector<std::string> names;
  for (const CLI::App* sub : app.get_subcommands([](const CLI::App*) { return true; }))
    names.push_back(sub->get_name());
  return names;
}

// The words of argv that name commands (not options or their values), as far as they go:
// `gradwatch --addr x silence add run=a` gives {silence, add}. Options are looked up in the
// command reached so far, then in its parents (global options may come anywhere).
std::vector<std::string> CommandWords(CLI::App& app, int argc, const char* const* argv) {
  std::vector<std::string> words;
  CLI::App* at = &app;
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    if (arg == "--") break;
    if (arg.size() > 1 && arg[0] == '-') {
      if (arg.find('=') != std::string::npos) continue;
      for (CLI::App* scope = at; scope != nullptr; scope = scope->get_parent()) {
        if (const CLI::Option* opt = scope->get_option_no_throw(arg); opt != nullptr) {
          if (opt->get_items_expected_min() > 0) ++i;  // its value
          break;
        }
      }
      continue;
    }
    words.push_back(arg);
    if (words[0] == "help") continue;  // help's words name commands to describe
    CLI::App* sub = FindSubcommand(*at, arg);
    if (sub == nullptr) break;  // a positional argument, or an unknown command
    at = sub;
  }
  return words;
}

// "  --addr TEXT=127.0.0.1:7390  Daemon gRPC address..." for each of the top level's options.
std::string GlobalOptionsText(const CLI::App& root) {
  std::string text = "Global options (before or after the command):\n";
  for (const CLI::Option* o : root.get_options([](const CLI::Option* o) { return o->nonpositional(); })) {
    std::string name;
    for (const std::string& s : o->get_snames()) name += (name.empty() ? "-" : ",-") + s;
    for (const std::string& l : o->get_lnames()) name += (name.empty() ? "--" : ",--") + l;
    if (name == "-h,--help" || name == "--version") continue;
    if (o->get_items_expected_min() > 0) name += " " + o->get_type_name();
    if (!o->get_default_str().empty()) name += "=" + o->get_default_str();
    text += "  " + name + std::string(name.size() < 28 ? 28 - name.size() : 1, ' ') + o->get_description() + "\n";
  }
  return text;
}

// Every command's --help ends with the global options, the exit codes and the environment.
void SetCommandFooters(const CLI::App& root, CLI::App& app) {
  for (CLI::App* sub : app.get_subcommands([](CLI::App*) { return true; })) {
    sub->footer(GlobalOptionsText(root) + "\n" + kFooter);
    SetCommandFooters(root, *sub);
  }
}

}  // namespace

int Run(int argc, const char* const* argv, std::ostream& out, std::ostream& err) {
  CLI::App app{"gradwatch: query the gradwatch daemon, replay training histories and follow training logs into it",
               "gradwatch"};
  app.footer(kFooter);
  app.set_version_flag("--version", std::string("gradwatch ") + kVersion);
  app.require_subcommand(1);
  // Lets global options follow the subcommand: `gradwatch runs --json`.
  app.fallthrough();

  GlobalOptions global;
  global.address = DefaultAddress();
  app.add_option("--addr", global.address,
                 "Daemon gRPC address, host:port; replay and tail take several, comma-separated, and send "
                 "every step to each (replicas watching one run)")
      ->capture_default_str();
  global.tls = client::ChannelSecurityFromEnvironment();
  app.add_option("--tls-ca", global.tls.ca_file,
                 "TLS: the CA file (PEM) that signed the daemon's certificate; giving any --tls-* option turns "
                 "TLS on (env GRADWATCH_TLS_CA)");
  app.add_option("--tls-cert", global.tls.cert_file,
                 "TLS: this client's certificate (PEM), for a daemon that requires client certificates "
                 "(env GRADWATCH_TLS_CERT)");
  app.add_option("--tls-key", global.tls.key_file, "TLS: the key of --tls-cert (PEM) (env GRADWATCH_TLS_KEY)");
  app.add_option("--tls-server-name", global.tls.server_name,
                 "TLS: the name the daemon's certificate must carry, when not the address's host "
                 "(env GRADWATCH_TLS_SERVER_NAME)");
  std::string token_file;
  if (const char* env = std::getenv("GRADWATCH_TOKEN_FILE"); env != nullptr) token_file = env;
  app.add_option("--token-file", token_file,
                 "A file holding the bearer token for a daemon with security.tokens_file (env GRADWATCH_TOKEN_FILE, "
                 "or the token itself in GRADWATCH_TOKEN)");
  app.add_option("--timeout", global.timeout_seconds,
                 "Deadline of each query, and how long replay waits for the daemon to accept its "
                 "stream (90s, 15m, 1h or seconds)")
      ->capture_default_str()
      ->transform(PositiveDuration())
      ->type_name("DURATION");
  app.add_flag("--json", global.json, "Machine-readable output on stdout");
  app.add_flag("-v,--verbose", global.verbose, "Log connection details on stderr");

  ReplayOptions replay;
  bool replay_max = false;
  auto* replay_cmd =
      app.add_subcommand("replay", "Stream a JSONL history (W&B history style) to the daemon as one trainer rank");
  replay_cmd
      ->add_option("FILE", replay.file,
                   "JSONL file, one object per line; - (standard input), a pipe or a FIFO is read once, "
                   "into a temporary copy")
      ->required();
  replay_cmd->add_option("--run", replay.run, "Run id (default: the header's \"run\", else the file's stem)");
  auto* speed = replay_cmd->add_option("--speed", replay.speed, "Pace by _timestamp at X times real time")
                    ->check(PositiveValue());
  auto* max = replay_cmd->add_flag("--max", replay_max, "Send as fast as the daemon acknowledges (the default)");
  speed->excludes(max);
  replay_cmd->add_flag("--finish", replay.finish,
                       "Once every step is acknowledged, say Goodbye: the run is recorded as finished "
                       "(its alerts resolve; it does not page as dead)");
  replay_cmd
      ->add_option("--stall-timeout", replay.stall_timeout_seconds,
                   "Give up once the daemon has acknowledged nothing for this long (90s, 15m, 1h or seconds). There is "
                   "no overall deadline: a slow daemon is waited for as long as it keeps "
                   "acknowledging, and the file is read only as fast as it does")
      ->capture_default_str()
      ->transform(PositiveDuration())
      ->type_name("DURATION");
  replay_cmd->add_flag("-q,--quiet", replay.quiet,
                       "No progress line (percentage, rate, ETA) on stderr; it is drawn only when stderr is a "
                       "terminal, and the report at the end is printed either way");
  replay_cmd->add_option("--rank", replay.rank, "This rank")->capture_default_str();
  replay_cmd->add_option("--resume-from", replay.resume_from,
                         "The history resumes the run from its checkpoint at step N: the daemon "
                         "replaces the steps it holds from N on (default: the header's "
                         "\"resume_from_step\")");
  replay_cmd->add_option("--world-size", replay.world_size, "Ranks reporting each step")
      ->capture_default_str()
      ->check(PositiveValue());

  TailOptions tail;
  auto* tail_cmd = app.add_subcommand(
      "tail",
      "Follow a training job's output (a log file as tail -F, or - for a pipe) and stream the metrics "
      "its lines print into a run");
  tail_cmd
      ->add_option("FILE", tail.file,
                   "Log file, followed through rotation and truncation and waited for if it does not exist "
                   "yet; - (standard input), a pipe or a FIFO is read until its writer closes it")
      ->required();
  tail_cmd->add_option("--run", tail.run, "Run id (default: the file's stem; required for -)");
  tail_cmd
      ->add_option("--format", tail.format,
                   "jsonl, megatron (Megatron-LM and Megatron-DeepSpeed), deepspeed, hf (Hugging Face Trainer), "
                   "torchtitan, nanogpt, llmc (default: detected from the first line one of them prints)")
      ->check(CLI::IsMember({"jsonl", "megatron", "megatron-deepspeed", "deepspeed", "hf", "huggingface", "torchtitan",
                             "nanogpt", "llmc", "llm.c"}));
  tail_cmd
      ->add_option("--step-interval", tail.step_interval,
                   "Hugging Face Trainer dicts print no step: without a progress bar in the same output, "
                   "the k-th is step k times this (the Trainer's logging_steps)")
      ->capture_default_str()
      ->check(PositiveValue());
  tail_cmd->add_option("--pid", tail.pid, "Stop following the file once this process has exited (as tail --pid)")
      ->check(PositiveValue());
  tail_cmd->add_flag("--finish", tail.finish,
                     "When the input ends (its writer closed it, or --pid exited), say Goodbye: the run is "
                     "recorded as finished");
  tail_cmd
      ->add_option("--stall-timeout", tail.stall_timeout_seconds,
                   "At the end, give up waiting for acknowledgements once the daemon has acknowledged "
                   "nothing for this long (90s, 15m, 1h or seconds)")
      ->capture_default_str()
      ->transform(PositiveDuration())
      ->type_name("DURATION");
  tail_cmd->add_flag("-q,--quiet", tail.quiet,
                     "No progress line (steps, rate, step reached) on stderr; it is drawn only when stderr is a "
                     "terminal, and the report at the end is printed either way");
  tail_cmd
      ->add_option("--log-tz", tail.log_tz,
                   "Zone of the log's timestamps that carry none: local, UTC or an offset such as +02:00 (a step "
                   "takes its time from its line's timestamp, else the time it was read)")
      ->check([](const std::string& v) {
        return ParseLogTimeZone(v) ? std::string() : "'" + v + "' is not local, UTC or an offset such as +02:00";
      })
      ->capture_default_str();
  tail_cmd->add_option("--rank", tail.rank, "This rank")->capture_default_str();
  tail_cmd->add_option("--world-size", tail.world_size, "Ranks reporting each step")
      ->capture_default_str()
      ->check(PositiveValue());

  bool runs_all = false;
  auto* runs_cmd = app.add_subcommand("runs", "List the runs the daemon holds");
  runs_cmd->add_flag("--all", runs_all, "Also the runs that left memory but are still in the journal (archived)");

  std::string show_run;
  auto* show_cmd = app.add_subcommand("show", "Summarise a run: info, config, catalog, latest values, events");
  show_cmd->add_option("RUN", show_run, "Run id")->required();

  SeriesOptions series;
  auto* series_cmd = app.add_subcommand("series", "Print a series: step value min max count per point");
  series_cmd->add_option("RUN", series.run, "Run id")->required();
  series_cmd->add_option("KEY", series.key, "Series key, e.g. grad/norm/total")->required();
  series_cmd->add_option("--from", series.from_step, "First step (inclusive)");
  series_cmd->add_option("--to", series.to_step, "Last step (inclusive; 0: to the end)");
  series_cmd->add_option("--max-points", series.max_points,
                         "Merge into at most N points keeping min and max (0: no limit)");

  std::string annotate_run;
  uint64_t annotate_step = 0;
  std::vector<std::string> annotate_text;
  auto* annotate_cmd = app.add_subcommand("annotate", "Record an event on a run at a step");
  annotate_cmd->add_option("RUN", annotate_run, "Run id")->required();
  annotate_cmd->add_option("STEP", annotate_step, "Step the event took effect")->required();
  annotate_cmd->add_option("TEXT", annotate_text, "What happened")->required();

  std::string alerts_run;
  auto* alerts_cmd = app.add_subcommand("alerts", "List pending and firing alerts, with their recommendations");
  alerts_cmd->add_option("RUN", alerts_run, "Only this run's alerts");
  bool alerts_history = false;
  alerts_cmd->add_flag("--history", alerts_history,
                       "Every state change instead (pending, firing, resolved, cleared), oldest first, past "
                       "alerts included");

  auto* rules_cmd = app.add_subcommand("rules", "Alert rule files");
  rules_cmd->require_subcommand(1);
  std::vector<std::string> rule_files;
  auto* rules_check_cmd =
      rules_cmd->add_subcommand("check", "Validate rule files (errors give file:line); needs no daemon");
  std::string rules_config;
  rules_check_cmd->add_option("FILE", rule_files, "Rule files");
  rules_check_cmd->add_option("--config", rules_config,
                              "Check the rules a daemon with this configuration would load: the built-in ones "
                              "(unless alerts.default_rules is false), alerts.rule_files and the FILEs, with "
                              "alerts.overrides applied");

  auto* rules_reload_cmd = rules_cmd->add_subcommand("reload", "Make the daemon reload its rule files (as SIGHUP)");

  auto* silence_cmd = app.add_subcommand("silence", "Mute notifications of matching alerts (state stays visible)");
  silence_cmd->require_subcommand(1);
  SilenceOptions silence;
  auto* silence_add_cmd = silence_cmd->add_subcommand("add", "Add a silence");
  silence_add_cmd
      ->add_option("MATCHER", silence.matchers,
                   "Matchers as amtool takes them, all of which an alert must match: name=value, name!=value, "
                   "name=~regex, name!~regex (RE2, anchored; quote the argument for the shell, e.g. "
                   "'run=~moe-.*'); a word without an operator is an alertname")
      ->required();
  silence_add_cmd
      ->add_option("--duration", silence.duration_seconds,
                   "How long the silence lasts: 90s, 15m, 1h30m, 2d, or seconds")
      ->capture_default_str()
      ->transform(PositiveDuration())
      ->type_name("DURATION");
  silence_add_cmd->add_option("--comment", silence.comment, "Why");
  silence_add_cmd->add_option("--by", silence.by, "Who");
  auto* silence_list_cmd = silence_cmd->add_subcommand("list", "List silences");
  std::string silence_id;
  auto* silence_remove_cmd = silence_cmd->add_subcommand("remove", "Remove a silence");
  silence_remove_cmd->add_option("ID", silence_id, "Silence id")->required();

  std::string plot_run, plot_output;
  auto* plot_cmd = app.add_subcommand(
      "plot", "Draw a run's total grad norm and final norm (with its slopes at events) into an SVG or PNG file");
  plot_cmd->add_option("RUN", plot_run, "Run id")->required();
  plot_cmd->add_option("-o,--output", plot_output, "FILE.svg, or FILE.png (needs rsvg-convert)")->required();

  std::string report_run, report_dir;
  auto* report_cmd = app.add_subcommand(
      "report", "Write a run's incident report: DIR/report.md from the daemon's analysis, with its SVG charts");
  report_cmd->add_option("RUN", report_run, "Run id")->required();
  report_cmd->add_option("-o,--output", report_dir, "Directory to write (created if missing)")->required();

  std::string ack_fingerprint, ack_by, ack_comment;
  auto* ack_cmd = app.add_subcommand("ack", "Acknowledge a firing alert: no re-notification until it resolves");
  ack_cmd->add_option("FINGERPRINT", ack_fingerprint, "The alert's fingerprint (see gradwatch alerts)")->required();
  ack_cmd->add_option("--by", ack_by, "Who");
  ack_cmd->add_option("--comment", ack_comment, "Why");

  std::string completion_shell;
  auto* completion_cmd = app.add_subcommand(
      "completion", "Print the shell completion script: source <(gradwatch completion bash), or zsh");
  completion_cmd->add_option("SHELL", completion_shell, "bash or zsh")
      ->required()
      ->check(CLI::IsMember({"bash", "zsh"}));
  SetCommandFooters(app, app);

  // `gradwatch help [COMMAND...]`, and unknown commands with a suggestion, before CLI11 (which
  // only says "A subcommand is required").
  const std::vector<std::string> words = CommandWords(app, argc, argv);
  if (!words.empty() && words[0] == "help") {
    CLI::App* at = &app;
    for (size_t i = 1; i < words.size(); ++i) {
      CLI::App* sub = FindSubcommand(*at, words[i]);
      if (sub == nullptr) {
        err << "gradwatch help: no command '" << words[i] << "'" << DidYouMean(words[i], SubcommandNames(*at)) << "\n";
        return kExitUsage;
      }
      at = sub;
    }
    out << at->help();
    return kExitOk;
  }
  if (!words.empty()) {
    // The deepest command reached, and the word after it that is not one of its commands.
    CLI::App* at = &app;
    for (const std::string& word : words) {
      CLI::App* sub = FindSubcommand(*at, word);
      if (sub != nullptr) {
        at = sub;
        continue;
      }
      // Commands that take no positional argument here (they have subcommands): a typo.
      if (!SubcommandNames(*at).empty()) {
        const std::string where = at == &app ? "gradwatch" : "gradwatch " + at->get_name();
        std::vector<std::string> names = SubcommandNames(*at);
        if (at == &app) names.push_back("help");
        err << where << ": unknown command '" << word << "'" << DidYouMean(word, names) << "\n  `" << where
            << " --help` lists the commands\n";
        return kExitUsage;
      }
      break;
    }
  }

  try {
    app.parse(argc, argv);
    if (*tail_cmd && tail.rank >= tail.world_size) {
      throw CLI::ValidationError("--rank", "must be below --world-size (" + std::to_string(tail.world_size) + ")");
    }
    if (const size_t scheme = global.address.find("://"); scheme != std::string::npos) {
      const std::string rest = global.address.substr(scheme + 3);
      throw CLI::ValidationError("--addr", "takes host:port, not a URL: try --addr " + rest.substr(0, rest.find('/')));
    }
    if (!*replay_cmd && !*tail_cmd && global.address.find(',') != std::string::npos) {
      throw CLI::ValidationError("--addr",
                                 "lists several daemons; only replay and tail send to several: run the "
                                 "queries once per daemon");
    }
    if (*series_cmd && series.to_step != 0 && series.to_step < series.from_step) {
      throw CLI::ValidationError("--to", "step " + std::to_string(series.to_step) + " is before --from " +
                                             std::to_string(series.from_step) + ": the range is inclusive, --to last");
    }
    if (*replay_cmd && replay.rank >= replay.world_size) {
      throw CLI::ValidationError("--rank", "must be below --world-size (" + std::to_string(replay.world_size) + ")");
    }
  } catch (const CLI::ParseError& e) {
    if (std::string said = UsageError(app, e); !said.empty()) {
      err << "gradwatch: " << said << "\n  `gradwatch " << ActiveCommand(app) << "--help` lists its options\n";
      return kExitUsage;
    }
    const int code = app.exit(e, out, err);
    return code == 0 ? kExitOk : kExitUsage;
  }

  spdlog::set_level(global.verbose ? spdlog::level::debug : spdlog::level::warn);

  if (*completion_cmd) {
    out << CompletionScript(app, completion_shell).value_or("");
    return kExitOk;
  }
  if (*rules_check_cmd) {
    if (rule_files.empty() && rules_config.empty()) {
      err << "gradwatch rules check: give rule files, --config FILE, or both\n";
      return kExitUsage;
    }
    return RunRulesCheck(global, rule_files, rules_config, out, err);
  }
  if (std::string error; !token_file.empty() && !client::ReadTokenFile(token_file, &global.tls.token, &error)) {
    err << "gradwatch: " << error << "\n";
    return kExitFailure;
  }
  if (std::string error; global.tls.enabled() && client::MakeChannelCredentials(global.tls, &error) == nullptr) {
    err << "gradwatch: " << error << "\n";
    return kExitFailure;
  }
  if (*replay_cmd) return RunReplay(global, replay, out, err);
  if (*tail_cmd) return RunTail(global, tail, out, err);
  client::QueryClient query(global.address, global.timeout(), global.tls);
  if (*runs_cmd) return RunRuns(global, query, runs_all, out, err);
  if (*alerts_cmd) return RunAlerts(global, query, alerts_run, alerts_history, out, err);
  if (*rules_reload_cmd) return RunRulesReload(global, query, out, err);
  if (*silence_add_cmd) return RunSilenceAdd(global, query, silence, out, err);
  if (*silence_list_cmd) return RunSilenceList(global, query, out, err);
  if (*silence_remove_cmd) return RunSilenceRemove(global, query, silence_id, out, err);
  if (*ack_cmd) return RunAck(global, query, ack_fingerprint, ack_by, ack_comment, out, err);
  if (*show_cmd) return RunShow(global, query, show_run, out, err);
  if (*series_cmd) return RunSeries(global, query, series, out, err);
  if (*plot_cmd) return RunPlot(global, query, plot_run, plot_output, out, err);
  if (*report_cmd) return RunReport(global, query, report_run, report_dir, out, err);
  if (*annotate_cmd) {
    return RunAnnotate(global, query, annotate_run, annotate_step, Join(annotate_text), out, err);
  }
  return kExitUsage;
}

int Main(int argc, const char* const* argv) {
  // Logging goes to stderr so that stdout stays clean for --json.
  auto logger = spdlog::stderr_color_mt("gradwatch");
  logger->set_pattern("[%l] %v");
  spdlog::set_default_logger(logger);
  try {
    return Run(argc, argv, std::cout, std::cerr);
  } catch (const std::exception& e) {
    std::cerr << "gradwatch: " << e.what() << "\n";
    return kExitFailure;
  }
}

}  // namespace gradwatch::cli
